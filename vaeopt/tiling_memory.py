"""Memory model of the layer-streamed tiled image decoder (vaeopt/tiling.py): how many bytes a decode needs where.

It answers the planner's and the decoder's questions before anything is allocated: which full-size activation
buffers one sample's decode creates and when it frees them (:func:`storage_buffers`, :func:`storage_bytes`), and the
peak a decode needs on the compute device for a given tile (:func:`estimate_tiled_bytes`). The working-set model
follows the decoder's code path by path, so it also holds the two path choices both must agree on
(:func:`kernels_usable`, :func:`use_bands`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from vaeopt.engine.image import Pass, kl_decoder, plan_passes
from vaeopt.engine.regions import pair, tile_geometry
from vaeopt.kernels import triton_available

__all__ = [
    "CUDA_MARGIN",
    "CUDNN_WORKSPACE_BYTES",
    "decoder_weights_bytes",
    "estimate_tiled_bytes",
    "kernels_usable",
    "storage_buffers",
    "storage_bytes",
    "use_bands",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CUDNN_WORKSPACE_BYTES = 256 << 20  # allowance for cuDNN conv workspaces in estimate_tiled_bytes (CUDA only)
CUDA_MARGIN = 1.10  # allocator rounding / fragmentation on CUDA; CPU keeps the validated 1.125


# ---------------------------------------------------------------------------------------------------- path choice


def kernels_usable(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(whether the Triton kernel path can run for this device and dtype, why not)."""
    if dtype not in _KERNEL_DTYPES:
        return False, f"dtype {dtype} has no kernels"
    if torch.is_autocast_enabled(device.type) if device.type in ("cuda", "cpu") else False:
        return False, "autocast is on"
    return triton_available(device)


def use_bands(shape: str, kernels: bool, device: torch.device) -> bool:
    """Whether tiles are full-width row bands: ``shape`` "bands", or "auto" on the kernel path or on CUDA."""
    if shape not in ("auto", "bands", "tiles"):
        raise ValueError(f"shape must be 'auto', 'bands' or 'tiles', got {shape!r}")
    return shape == "bands" or (shape == "auto" and (kernels or device.type == "cuda"))


# ---------------------------------------------------------------------------------------------------------- bytes


def decoder_weights_bytes(vae: nn.Module) -> int:
    """Bytes of the decoder's parameters and buffers (post_quant_conv included), each tensor counted once."""
    mods = [m for m in (getattr(vae, "post_quant_conv", None), getattr(vae, "decoder", None)) if m is not None]
    seen, total = set(), 0
    for m in mods:
        for t in list(m.parameters()) + list(m.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _model_device(vae: nn.Module) -> torch.device:
    dec = getattr(vae, "decoder", vae)
    p = next((p for p in dec.parameters() if p.is_floating_point()), None)
    return p.device if p is not None else torch.device("cpu")


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def storage_bytes(vae: nn.Module, latent_hw: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
    """Bytes of full-size activation buffers alive at once on the storage device (per sample; samples are decoded
    one after another). The worst point is a channel-changing resnet: input + conv1 output + block output."""
    h, w = latent_hw
    b = _dtype_bytes(dtype)
    worst = 0
    passes = plan_passes(vae)
    for i, ps in enumerate(passes):
        px = h * w * ps.scale * ps.scale
        if ps.kind == "res1":
            nxt = passes[i + 1]
            sep = nxt.cout if (getattr(ps.module, "conv_shortcut", None) is not None or nxt.cout != ps.cin) else 0
            worst = max(worst, px * b * (ps.cin + ps.cout + sep))
        elif ps.kind == "up":
            worst = max(worst, px * b * ps.cout + (px // 4) * b * ps.cin)
    return int(worst)


def storage_buffers(vae: nn.Module, latent_hw: Sequence[int], dtype: torch.dtype = torch.float32
                    ) -> list[tuple[int, int, int]]:
    """The full-size buffers one sample's decode allocates, in order: (bytes, step allocated, step freed), steps
    counting allocations and frees. The mid-block output, then per pass: a resnet's conv1 output (freed after its
    conv2), its block output unless written over its input (no shortcut, same width), an upsampler's output; each
    replaces the activation before it. The largest sum alive at one step is :func:`storage_bytes`."""
    h, w = latent_hw
    b = _dtype_bytes(dtype)
    passes = plan_passes(vae)
    bufs: list[list] = []
    step = iter(range(1 << 30))

    def new(c: int, s: int) -> int:
        bufs.append([c * h * w * s * s * b, next(step), None])
        return len(bufs) - 1

    def free(i: int) -> None:
        bufs[i][2] = next(step)

    cur, h1 = new(passes[0].cin, 1), None
    for ps in passes:
        if ps.kind == "res1":
            h1 = new(ps.cout, ps.scale)
        elif ps.kind == "res2":
            if getattr(ps.module, "conv_shortcut", None) is not None or ps.cout != ps.sc_cin:
                nxt = new(ps.cout, ps.scale)
                free(h1)  # (the pass lets its conv1 output go first, then the walk replaces the activation)
                free(cur)
                cur = nxt
            else:
                free(h1)
        elif ps.kind == "up":
            nxt = new(ps.cout, ps.scale)
            free(cur)
            cur = nxt
        else:
            free(cur)
    return [tuple(x) for x in bufs]


def _attention_extra(dec: nn.Module, tokens: int, b: int) -> int:
    """Score memory of the mid-block attention beyond its activations: the fused_epilogues chunked processor keeps
    one fp32 score chunk (<= its max_score_bytes) and its probabilities in the model dtype. Stock SDPA is assumed
    to pick a memory-efficient kernel (no tokens^2 matrix)."""
    extra = 0
    mid = getattr(dec, "mid_block", None)
    for m in mid.modules() if mid is not None else ():
        proc = getattr(m, "processor", None)
        if proc is not None and type(proc).__name__ == "ChunkedAttnProcessor":
            s = min(tokens * tokens * 4, int(getattr(proc, "max_score_bytes", 512 << 20)))
            extra = max(extra, s + s * b // 4)
    return extra


def _pass_bytes(ps: Pass, ty: int, tx: int, b: int, kernels: bool, remote: bool, tiles2d: bool) -> int:
    """Compute-device working set of one tile of pass `ps` ((ty, tx) px at its resolution), modelled on the code:
    remote storage adds the fetched regions twice (current + prefetched) and the output of the previous tile whose
    device->host write is still in flight; 2D tiles add the relayout copies that row bands avoid."""
    f32 = 4
    low = b < f32
    A, Ah = ty * tx, (ty + 2) * (tx + 2)
    out = ps.cout * A * b
    if ps.kind in ("res1", "res2", "head"):
        region = ps.cin * Ah * b
        fetched = 2 * region if remote else 0
        has_sc = ps.kind == "res2" and (getattr(ps.module, "conv_shortcut", None) is not None or ps.sc_cin != ps.cout)
        if kernels:
            act = ps.cin * Ah * b  # the apply kernel's padded output, in the model dtype
            if ps.kind == "res2":
                resid = 2 * ps.sc_cin * A * b if remote else 0
                rs = out if has_sc else 0
                rc = ps.sc_cin * A * b if tiles2d else 0  # bias_residual makes a 2D-window residual dense
                y = out if (remote or tiles2d) else 0  # else written in place
                return fetched + resid + max(act + out, out + rs + rc + y) + (y if remote else 0)
            return fetched + act + out + (out if (remote or ps.kind == "head") else 0)
        # torch path: fp32 normalised tile, its cast, the conv output, an fp32 statistics temporary
        norm = Ah * ps.cin * f32
        act = Ah * ps.cin * b if low else norm
        stats = out // b * f32 if low else 0
        ws = max(fetched + norm + (Ah * ps.cin * b if low else 0), fetched + act + out, out + stats)
        if ps.kind == "res2":
            res = ps.sc_cin * A * b * (2 if remote else 0)
            sc = out if ps.sc_cin != ps.cout else 0
            ws = max(ws, act + out + res, out + res + sc, 3 * out + stats)
        return ws + (out if remote else 0)
    # up: source region (half resolution + halo) -> 2x nearest -> crop -> conv
    As, Au, Ao = (ty // 2 + 2) * (tx // 2 + 2), (ty + 4) * (tx + 4), (ty + 2) * (tx + 2)
    src = ps.cin * As * b
    fetched = 2 * src if remote else 0
    upd = ps.cin * Au * b
    pending = out if remote else 0
    if kernels:
        copies = (src + ps.cin * Ao * b + out) if tiles2d else 0  # dense source, cuDNN's copy of the crop, stats
        return fetched + upd + ps.cout * Ao * b + copies + pending
    stats = out // b * f32 if low else 0
    return max(fetched + upd, upd + out, out + stats) + pending


def estimate_tiled_bytes(
    vae: nn.Module,
    latent_hw: Sequence[int],
    tile: int | Sequence[int],
    dtype: torch.dtype = torch.float32,
    storage_on_device: bool = False,
    include_output: bool = True,
    batch: int = 1,
    *,
    include_weights: bool = True,
    untiled: bool = True,
    kernels: bool | None = None,
    shape: str = "auto",
    device: torch.device | str | None = None,
) -> int:
    """Peak bytes :func:`tiled_decode` needs on the compute device for one sample at ``latent_hw`` with a latent
    ``tile`` (same units as tiled_decode) -- an upper bound meant to be compared with a whole memory budget.

    Sum of: the decoder weights (``include_weights``), the output image (``include_output``; ``batch`` samples),
    the full-size buffers when ``storage_on_device`` (:func:`storage_bytes`; otherwise they are on the host and tile
    regions are copied in -- prefetched one tile ahead -- and out), and the larger of
      * the untiled latent-resolution part: conv_in + mid-block, ~8 activations of the mid-block width (+ an fp32
        one for 16-bit dtypes) + the chunked attention's score block (stages/fused_epilogues; stock SDPA is assumed
        memory-efficient), and
      * the largest tiled pass's working set, modelled on the code for the path that will run (``kernels`` and
        ``shape`` as tiled_decode decides them for the model's ``device`` when None): see `_pass_bytes`,
    times 1.125 (CPU) or 1.10 plus CUDNN_WORKSPACE_BYTES for cuDNN workspaces (CUDA). The tiled part grows with the
    tile area, the latent-resolution part with the latent area. Validated against a live-tensor tracker on CPU
    (docs/tiling.md). ``untiled=False`` leaves the latent-resolution part out: the working set that lives beside the
    full-size buffers (the untiled part runs before the first of them is allocated, and its memory is free again
    when the tiled passes begin), which is what the placement of those buffers must leave room for.
    """
    h, w = latent_hw
    th, tw = pair(tile)
    th, tw = min(th, h), min(tw, w)
    b = _dtype_bytes(dtype)
    dev = torch.device(device) if device is not None else _model_device(vae)
    if kernels is None:
        kernels = kernels_usable(dev, dtype)[0]
    bands = use_bands(shape, kernels, dev)
    passes = plan_passes(vae)
    dec = kl_decoder(vae)
    c_mid = passes[0].cin
    low = b < 4
    peak = h * w * c_mid * (8 * b + (4 if low else 0)) + _attention_extra(dec, h * w, b) if untiled else 0
    for ps in passes:
        ty, tx = tile_geometry((h, w), (th, tw), ps.scale, bands)
        peak = max(peak, _pass_bytes(ps, ty, tx, b, kernels, not storage_on_device, not bands))
    total = peak * CUDA_MARGIN + CUDNN_WORKSPACE_BYTES if dev.type == "cuda" else peak * 1.125
    if include_output:
        total += max(1, int(batch)) * passes[-1].cout * h * w * passes[-1].scale ** 2 * b
    if storage_on_device:
        total += storage_bytes(vae, latent_hw, dtype)
    if include_weights:
        total += decoder_weights_bytes(vae)
    return int(total)
