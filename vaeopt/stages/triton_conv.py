"""Triton implicit-GEMM convolution for the layers where it beats cuDNN (vaeopt/kernels/conv.py; docs/kernels.md).

Policy (measured on sm_90 only, docs/experiments.md E12, E28, E42; elsewhere the stage runs only when forced with
--conv-kernel on): Wan's causal 3x3x3 Conv3d with 64-128 output channels, and the 192-channel ones where the
warp-specialized Gluon kernel runs (kernels/ws_conv.py); every other conv stays on cuDNN. stacked_conv3d runs first
and leaves the 96-channel convs here only where the bf16 TMA variant runs (kernels/tma_conv.bf16_wan96); their
weights are then packed K-major.

The stage marks the convs; vaeopt.video's chunk decoder runs a marked conv through the kernel (weights packed once
per weight version, cached on the module). Image VAEs' resnet convs take the 8-bit kernel only under FP8 level 3
(`apply_fp8` below, run by stages/fused_epilogues' resnet forward).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from vaeopt.fidelity import psnr
from vaeopt.kernels import triton_available, ws_conv
from vaeopt.stages import (StageResult, derived, drop_attrs, fused_epilogues, fused_norms, unhooked, upsample_conv,
                           weight_version)
from vaeopt.stages.fp8 import available as fp8_stage_available
from vaeopt import cache
from vaeopt.quant import gate as gate_mod
from vaeopt.quant.gate import exact_fp32
from vaeopt.stages.marks import CONV8 as _MARK8
from vaeopt.stages.marks import CONV8_INT8 as _INT8
from vaeopt.stages.marks import CONV8_PACKED as _PACKED8
from vaeopt.stages.marks import FP8_ATTR, head_dim, is_wan, stacked
from vaeopt.stages.marks import IGEMM as _MARK
from vaeopt.stages.marks import IGEMM_PACKED as _PACKED
from vaeopt.stages.marks import wan_conv_fits as _kernel_fits

NAME = "triton_conv"
MAX_COUT = 128  # measured: Triton wins at 96 output channels, cuDNN from 192 up
MIN_COUT = 64  # narrower outputs (conv_out's 3 channels) were not measured: cuDNN
MEASURED_SM = ((9, 0),)


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "no CUDA GPU (the kernel runs on CPU only through the Triton interpreter, for tests)"
    return triton_available(device)


def _eligible(m: nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None) -> bool:
    """_kernel_fits, not taken by stacked_conv3d (its time-stacked cuDNN Conv2d measured faster than this kernel at
    96 channels), and either few enough output channels that the bf16 kernel beats cuDNN, or a layer the
    warp-specialized kernel takes here (Wan's 192-ch convs: faster than cuDNN's Conv3d, E42)."""
    if not _kernel_fits(m) or stacked(m):
        return False
    return MIN_COUT <= m.out_channels <= MAX_COUT or _on_ws(m, device, dtype)


def _on_ws(conv: nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether conv_igemm runs this layer on the warp-specialized Gluon kernel (kernels/ws_conv.py): bf16 on sm_90
    with Gluon, and a channel count it has a measured config for (96, 192)."""
    return (device is not None and dtype is not None and ws_conv.takes(conv.in_channels, conv.out_channels)
            and ws_conv.available(torch.device(device), dtype))


def apply(model: nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None,
          **_) -> StageResult:
    """Mark the Conv3d layers the kernel takes. Where it runs in auto mode (CUDA GPUs it was measured on; the CPU
    only through the interpreter, for tests) is the stage table's rule; here only whether Triton runs at all."""
    device = device or next(model.parameters()).device
    ok, why = triton_available(device)
    if not ok:
        return StageResult.skipped(NAME, why)
    # the decode path only: the encoder is never run by a decode (and its layers would inflate the count)
    parts = [getattr(model, "post_quant_conv", None), getattr(model, "decoder", None)] if hasattr(
        model, "decoder") else [model]
    convs = [m for p in parts if p is not None for m in p.modules() if isinstance(m, nn.Conv3d)]
    if not convs:
        return StageResult.skipped(NAME, "no Conv3d layers: 2D convs stay with cuDNN")
    chosen = [m for m in convs if _eligible(m, device, dtype)]
    if not chosen:
        if any(stacked(m) for m in convs) and any(_kernel_fits(m) and MIN_COUT <= m.out_channels <= MAX_COUT
                                                  for m in convs):
            return StageResult.skipped(NAME, f"the {MIN_COUT}-{MAX_COUT}-channel Conv3d layers run as stacked Conv2d "
                                             "(stacked_conv3d took them)")
        return StageResult.skipped(NAME, f"none of {len(convs)} Conv3d layers has {MIN_COUT}-{MAX_COUT} output channels "
                                         "and a 3x3x3 kernel (where the kernel beats cuDNN)")
    for m in chosen:
        setattr(m, _MARK, True)
    shapes = sorted({f"{m.in_channels}->{m.out_channels}" for m in chosen}, key=lambda t: int(t.split("->")[1]))
    on_ws = [m for m in chosen if _on_ws(m, device, dtype)]
    ws = sorted({m.out_channels for m in on_ws})
    tma = dtype is not None and any(_bf16_tma(m, torch.device(device), dtype) for m in chosen)
    kern = "Triton implicit-GEMM kernel"
    if ws and len(on_ws) == len(chosen):
        kern = "warp-specialized Gluon TMA kernel (kernels/ws_conv.py)"
    elif ws:
        kern += (f" (the {' and '.join(map(str, ws))}-ch ones on the warp-specialized Gluon TMA kernel, "
                 "kernels/ws_conv.py)")
    elif tma:
        kern += " (its TMA variant for the 96-ch ones)"
    return StageResult(NAME, "applied",
                       f"{len(chosen)} causal Conv3d ({', '.join(shapes)} ch, 3x3x3) on the {kern}; the other "
                       f"{len(convs) - len(chosen)} Conv3d are not on this kernel",
                       {"layers": len(chosen), "cudnn_layers": len(convs) - len(chosen), "shapes": shapes,
                        "ws_channels": ws})


def revert(model: nn.Module) -> None:
    drop_attrs(model, _MARK, _PACKED, _MARK8, _PACKED8, FP8_ATTR, _INT8)


_weight_key = weight_version
derived(_PACKED, _PACKED8)


def _bf16_tma(conv: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether conv_igemm hands this marked bf16 layer to the TMA kernel: bf16 on sm_90 with TMA, and a layer with a
    bf16 tile (Wan's 96-ch causal convs, E28). Its weights are then packed K-major; every other layer keeps the
    pointer kernel's measured layout."""
    from vaeopt.kernels import tma_conv  # (imports Triton)

    return (tma_conv.bf16_wan96(device, dtype)
            and tma_conv.tuned_config(conv.in_channels, conv.out_channels, 0, False, video=True) is not None
            ) or _on_ws(conv, device, dtype)


def packed_for(conv: nn.Module, x: torch.Tensor):
    """The conv's PackedWeight for input x when the stage marked it and x suits the kernel, else None. Packed once
    per weight version and dtype (a later weight change repacks)."""
    if not getattr(conv, _MARK, False) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    wide = conv.out_channels > MAX_COUT
    if wide and not _on_ws(conv, x.device, x.dtype):
        return None  # marked for the Gluon kernel, which does not run here (switched off, another dtype): cuDNN
    if x.dtype == torch.float32 and x.device.type == "cuda":  # tl.dot would round fp32 operands to TF32
        return None
    if x.ndim != 5 or not x.is_contiguous(memory_format=torch.channels_last_3d):
        return None
    w = conv.weight
    if w is None or w.device != x.device:
        return None
    kmajor = wide or _bf16_tma(conv, x.device, x.dtype)  # wide: on the Gluon kernel (checked above), K-major
    key = (*_weight_key(w), x.dtype, kmajor)
    cached = getattr(conv, _PACKED, None)
    if cached is None or cached[0] != key:
        from vaeopt.kernels.conv import pack_weight

        cached = (key, pack_weight(w.detach().to(x.dtype), kmajor=True if kmajor else None))
        setattr(conv, _PACKED, cached)
    return cached[1]


# ---- FP8 level 3: 8-bit implicit-GEMM convs for the residual blocks' 3x3(x3) convs ------------------------------------
# They pay only with the activation quantization fused into the norm kernel that writes the conv's input (a torch
# quantize pass costs more than the conv): vaeopt.video's fused path for Wan, fused_epilogues' resnet forward for
# AutoencoderKL. On sm_90 conv_igemm runs them on the TMA kernel (E20). Image upsampler convs can join as 8-bit 2x2
# phase convs in one TMA launch, their input quantized per sample by kernels/act_quant.py; they are the most
# sensitive layers on random weights, so the gate decides (E21).


def fp8_available(device: torch.device) -> tuple[bool, str]:
    """FP8 tensor cores here (sm_89+), as for the level 1-2 stage."""
    return fp8_stage_available(device)


# Image decoders: the narrowest resnet conv where (8-bit GroupNorm + 8-bit conv) measured faster than bf16 (E15, E21):
# 128 channels on the TMA kernel, 256 on the pointer kernel.
IMAGE_FP8_MIN_CH = 256  # pointer kernel (sm_89, sm_120, or sm_90 without TMA descriptors)
IMAGE_FP8_MIN_CH_TMA = 128  # TMA kernel (sm_90)


def _conv2d_fits(m: nn.Module) -> bool:
    """A plain 3x3 Conv2d, stride/dilation 1, one group, zero 'same' padding: what the kernel computes exactly."""
    return (type(m) is nn.Conv2d and unhooked(m) and m.padding_mode == "zeros"
            and tuple(m.kernel_size) == (3, 3) and tuple(m.stride) == (1, 1) and tuple(m.dilation) == (1, 1)
            and m.groups == 1 and tuple(m.padding) == (1, 1))


def image_min_channels(device: torch.device | None) -> int:
    """The narrowest AutoencoderKL resnet conv (min of Cin, Cout) that measured faster in e4m3 on this device."""
    from vaeopt.kernels import tma_conv  # (imports Triton)

    return IMAGE_FP8_MIN_CH_TMA if device is not None and tma_conv.available(torch.device(device)) else IMAGE_FP8_MIN_CH


def fp8_candidates(model: nn.Module, device: torch.device | None = None) -> list[tuple[str, nn.Module]]:
    """The decoder's residual-block convs fed by a norm + SiLU (conv1, conv2), where the fp8 input can be written by
    the norm kernel: Wan's 3x3x3 causal convs (RMS norm, vaeopt.video's chunk decoder) and AutoencoderKL's 3x3
    Conv2d in the resnets that stages/fused_epilogues runs (GroupNorm), as wide as `image_min_channels(device)`.
    conv_in / conv_out / shortcuts / time convs stay in bf16 (their inputs come from no norm kernel); upsampler
    convs are `fp8_upsampler_candidates`."""
    out = []
    min_ch = image_min_channels(device)
    dec = getattr(model, "decoder", None)
    if dec is None:
        return out
    if is_wan(model):
        for name, m in dec.named_modules():
            if name.endswith((".conv1", ".conv2")) and ".resnets." in name and _kernel_fits(m):
                out.append((f"decoder.{name}", m))
        return out
    fused = {id(r) for r in (getattr(model, "_vaeopt_fused_epilogues", None) or {}).get("resnets", [])}
    for name, m in dec.named_modules():
        if id(m) in fused:
            for cname in ("conv1", "conv2"):
                c = getattr(m, cname)
                if _conv2d_fits(c) and min(c.in_channels, c.out_channels) >= min_ch:
                    out.append((f"decoder.{name}.{cname}", c))
    return out


def fp8_upsampler_candidates(model: nn.Module, device: torch.device) -> list[tuple[str, nn.Module]]:
    """AutoencoderKL's upsampler convs that run as 2x2 phase convs (stages/upsample_conv) and can run them in e4m3
    here: the TMA conv kernel with a measured tile (sm_90), >= IMAGE_FP8_MIN_CH_TMA channels. Their input, a residual
    sum that no norm writes, is quantized per sample by kernels/act_quant.py (upsample_conv.run)."""
    dec = getattr(model, "decoder", None)
    if dec is None or is_wan(model):
        return []
    ups = {id(u) for u in (getattr(model, "_vaeopt_fused_epilogues", None) or {}).get("upsamplers", [])}
    min_ch = image_min_channels(device)
    out = []
    for name, m in dec.named_modules():
        c = getattr(m, "conv", None) if id(m) in ups else None
        if (c is not None and _conv2d_fits(c) and min(c.in_channels, c.out_channels) >= min_ch
                and upsample_conv.fp8_ready(c, device)):
            out.append((f"decoder.{name}.conv", c))
    return out


ATTN_FP8_SM = ((9, 0),)  # fp8_attention measured there (E44: 1.31 -> 0.83 ms per sdxl-1024 call, H200)
_ATTN_FP8_OK: dict = {}  # device -> whether this torch's _scaled_mm runs fp8_attention (row-wise scales) there


def fp8_attention_candidates(model: nn.Module, device: torch.device) -> list[tuple[str, nn.Module]]:
    """The image decoder's attention cores on fused_epilogues' chunked GEMM path (head_dim > 256: the mid-block of
    SD/SDXL/SD3/FLUX), which can run as fp8_attention (e4m3 Q/K/V/P through torch._scaled_mm, row-scaled P @ V)
    here: sm_90, where it was measured (ATTN_FP8_SM), with a torch whose _scaled_mm takes row-wise scales."""
    dec = getattr(model, "decoder", None)
    if dec is None or is_wan(model) or not attention_fp8_ready(torch.device(device)):
        return []

    out = []
    for name, m in dec.named_modules():
        proc = getattr(m, "processor", None)
        if (type(m).__name__ == "Attention" and type(proc).__name__ == "ChunkedAttnProcessor"
                and head_dim(m) > proc.min_head_dim and head_dim(m) % 16 == 0):
            out.append((f"decoder.{name}", m))
    return out


def attention_fp8_ready(device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) not in ATTN_FP8_SM:
        return False
    key = str(device)
    if key not in _ATTN_FP8_OK:  # one tiny call: older torch builds lack row-wise scaled fp8 GEMMs
        try:
            x = torch.randn(1, 1, 32, 16, device=device, dtype=torch.bfloat16)
            _ATTN_FP8_OK[key] = bool(torch.isfinite(fused_epilogues.fp8_attention(x, x, x)).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _ATTN_FP8_OK[key] = False
    return _ATTN_FP8_OK[key]


def _is_attention(m: nn.Module) -> bool:
    return type(m).__name__ == "Attention"


# int8 for the image resnet convs (sm_90, the TMA kernel): a SiLU output over [-0.28, max] in 255 levels is closer
# to fp32 than e4m3, and faster once gated at the decode's size (docs/experiments.md E45, E46).


def int8_convs(model: nn.Module, device: torch.device) -> bool:
    """Whether this model's image resnet convs run their 8-bit path in int8 here (else e4m3)."""
    from vaeopt.kernels import tma_conv  # (imports Triton)

    return (not is_wan(model) and getattr(model, "decoder", None) is not None
            and tma_conv.available(torch.device(device)))


Decode = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _decode(model: nn.Module, z: torch.Tensor, decode: Decode | None = None) -> torch.Tensor:
    """The decode the pipeline runs: `decode` (vaeopt.video.decode_video for Wan, whose chunk decoder is where the
    marks take effect), else the (patched) model.decode."""
    if decode is not None:
        with torch.no_grad():
            return decode(model, z)
    if is_wan(model):
        raise ValueError("the fp8 convs' gate decodes Wan with vaeopt.video's chunk decoder: pass decode=")
    with torch.no_grad():
        return model.decode(z).sample


def _references(model: nn.Module, z: torch.Tensor, dtype: torch.dtype, decode: Decode | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp32 decode of the same weights, TF32 off; the decode in `dtype`) of the probe z. Call with no fp8 marks."""
    try:
        model.float()
        with exact_fp32():
            ref = _decode(model, z.float(), decode).float()
        model.to(dtype)
        base = _decode(model, z.to(dtype), decode).float()
    finally:
        model.to(dtype)
    return ref, base


def _probe_db(model: nn.Module, z: torch.Tensor, dtype: torch.dtype, ref: torch.Tensor,
              decode: Decode | None = None) -> float:
    """PSNR vs ref of the probe decode with the fp8 marks as they are now."""
    return psnr(_decode(model, z.to(dtype), decode).float(), ref)


def _image_flops(model: nn.Module, cands: list, latent_hw: tuple[int, int]) -> dict | None:
    """{candidate name: its FLOPs in a decode of a latent_hw latent} for an AutoencoderKL decoder: the mid block runs
    at the latent's size, each up block at that size times 2 per upsampling block before it, an upsampler's conv at
    twice its block's size as four 2x2 phase convs (4 taps per output pixel), the attention core's two GEMMs at
    4 L^2 d. None where a name or module does not fit that layout."""
    dec = getattr(model, "decoder", None)
    if dec is None or is_wan(model) or not hasattr(dec, "up_blocks"):
        return None
    scale, res = 1, {}
    for i, blk in enumerate(dec.up_blocks):
        res[i] = scale
        if getattr(blk, "upsamplers", None):
            scale *= 2
    h, w = latent_hw
    out = {}
    for name, m in cands:
        parts = name.split(".")
        if "mid_block" in parts:
            r = 1
        elif "up_blocks" in parts and parts[parts.index("up_blocks") + 1].isdigit():
            r = res.get(int(parts[parts.index("up_blocks") + 1]))
        else:
            r = None
        if r is None:
            return None
        if _is_attention(m):
            tokens = h * w * r * r
            out[name] = 4 * tokens * tokens * head_dim(m) * getattr(m, "heads", 1)
        elif "upsamplers" in parts:
            out[name] = 2 * (4 * h * w * r * r) * m.in_channels * m.out_channels * 4
        else:
            out[name] = 2 * (h * w * r * r) * m.in_channels * m.out_channels * m.kernel_size[0] * m.kernel_size[1]
    return out


def _gate_search(model: nn.Module, cands: list, probe: torch.Tensor, dtype: torch.dtype, gate_db: float,
                 margin_db: float, mark: Callable, flops: dict | None = None, decode: Decode | None = None
                 ) -> tuple[list | None, dict, str]:
    """Probe-decode with every candidate in 8 bits; if that misses the gate, measure each layer's sensitivity (the
    probe with only that layer in 8 bits), order the layers, and keep the largest prefix that clears gate + margin
    (binary search on the count). -> (the chosen candidates, or None: no subset passed; stats; note).

    The order: least noisy first, or with `flops` (_image_flops) the most FLOPs per unit of noise (FLOPs over
    10^(-dB/10) of the layer's probe alone) first, so that the noise budget goes where 8 bits save the most time:
    apply_fp8 passes flops for int8, where it measured faster; for e4m3 it measured slower (experiments.md E46)."""
    dname = str(dtype).replace("torch.", "")
    mark([])
    ref, base = _references(model, probe, dtype, decode)  # once: every probe below is compared with the same decodes
    pb = psnr(base, ref)
    mark(cands)
    p8 = _probe_db(model, probe, dtype, ref, decode)
    stats = {"layers": len(cands), "probe_db": p8, "bf16_probe_db": pb, "gate_db": gate_db, "kept": [],
             "probe_shape": list(probe.shape)}
    if p8 >= gate_db:
        return cands, stats, ""
    sens = []
    for c in cands:
        mark([c])
        sens.append((_probe_db(model, probe, dtype, ref, decode), c))
    if flops is not None:
        sens.sort(key=lambda t: -flops[t[1][0]] * 10 ** (t[0] / 10))
    else:
        sens.sort(key=lambda t: -t[0])  # least harmful first
    order = [c for _, c in sens]
    lo, hi, best = 1, len(order) - 1, None
    while lo <= hi:
        k = (lo + hi) // 2
        mark(order[:k])
        pk = _probe_db(model, probe, dtype, ref, decode)
        if pk >= gate_db + margin_db:
            best, lo = (k, pk), k + 1
        else:
            hi = k - 1
    stats["sensitivity_db"] = {n: round(p, 2) for p, (n, _) in sens}
    stats["order"] = "FLOPs per unit of noise" if flops is not None else "least noisy first"
    if best is None:
        mark([])
        return None, stats, (f"probe {p8:.1f} dB vs fp32 < gate {gate_db:g} dB with all {len(cands)} layers, and no "
                             f"subset of them in that order cleared it ({dname} path {pb:.1f} dB)")
    k, pk = best
    chosen = order[:k]
    mark(chosen)
    kept = [n for n, _ in order[k:]]
    stats.update(probe_db=pk, layers=k, kept=kept, all_fp8_db=p8)
    alone = {n: p for p, (n, _) in sens}
    worst = ", ".join(f"{n.replace('decoder.', '')} ({alone[n]:.1f} dB alone)" for n in kept[-3:][::-1])
    which = (f"{len(kept)} kept in {dname}, those with the fewest FLOPs per unit of noise" if flops is not None
             else f"{len(kept)} most sensitive kept in {dname}")
    return chosen, stats, (f"; all {len(cands)} in 8 bits measured {p8:.1f} dB, so {which} (per-layer probe: "
                           f"{worst}{', ...' if len(kept) > 3 else ''})")


def _speed(model: nn.Module, mark: Callable, chosen: list, decode_shape: tuple, dtype: torch.dtype, device,
           decode: Decode | None, repeats: int = 3) -> dict:
    """Median ms of a decode at decode_shape with the chosen 8-bit convs and with none (CUDA events, after one
    warm-up each: compiles and cuDNN's first choice are not charged to either), marks left as chosen. A decode that
    does not fit in memory at that size (a tiled plan's image) is not timed: {"why": ...}; nor a CPU decode (the
    8-bit convs run there only through Triton's interpreter, for tests)."""
    if torch.device(device).type != "cuda":
        return {"why": "not timed off the GPU"}
    z = torch.randn((1, *tuple(decode_shape)[1:]), generator=torch.Generator().manual_seed(1)).to(device, dtype)

    def timed() -> float:
        _decode(model, z, decode)
        ms = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _decode(model, z, decode)
            b.record()
            torch.cuda.synchronize(device)
            ms.append(a.elapsed_time(b))
        return sorted(ms)[len(ms) // 2]

    try:
        t8 = timed()
        mark([])
        t16 = timed()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"why": "the whole decode at that size does not fit in GPU memory"}
    finally:
        mark(chosen)
    return {"ms_8bit": t8, "ms_plain": t16}


def apply_fp8(model: nn.Module, device: torch.device, dtype: torch.dtype, gate_db: float = 40.0,
              probe: torch.Tensor | None = None, force: bool = False, margin_db: float = 0.5,
              decode_shape: tuple | None = None, decode: Decode | None = None,
              log: Callable[[str], None] | None = None) -> StageResult:
    """Mark the fp8 candidates and keep the set that clears the gate (PSNR vs fp32 of a probe decode, _gate_search),
    else fall back. The probe is a 16x16 latent for e4m3, whose relative step does not depend on the image. int8's
    step is the whole tensor's range / 254, and a larger image has larger extremes (E45: a 16x16 probe measured 40.6
    dB where the 1024² decode measured 39.1), so int8 (int8_convs) is gated at decode_shape, the decode's latent
    shape (with `probe` where it has that size, else a seeded N(0, 1) latent): without it, or if that probe does not
    fit in memory, or if no int8 subset passes there, the resnet convs take e4m3. `decode`: how the probe is
    decoded (vaeopt.video.decode_video for Wan; None: model.decode).
    On a GPU with decode_shape known, the chosen set is also timed against the plain convs at that size (a lossy
    stage stays only where it is faster: else a fallback that says so). The verdict (chosen layers, format, timing)
    is stored in vaeopt's cache per weights, candidates, gate settings, decode shape, GPU and versions, and reused
    without probing; `log` gets one line if a stored entry was unreadable."""
    name = "fp8 convs"
    ok, why = fp8_available(device)
    if not ok and not force:
        return StageResult.skipped(name, why)
    wan = is_wan(model)
    norm = "RMS-norm" if wan else "GroupNorm"
    if wan:
        fused = fused_norms.has_fused_rms_norms(model.decoder) and getattr(model, "_vaeopt_fused_epilogues", None)
    else:
        fused = (getattr(model, "_vaeopt_fused_epilogues", None) or {}).get("resnets")
    if not fused:
        return StageResult.skipped(name, f"needs the fused path (fused_norms + fused_epilogues): the {norm} kernel "
                                         "writes the convs' e4m3 inputs")
    cands = fp8_candidates(model, torch.device(device))
    ups = [] if wan else fp8_upsampler_candidates(model, torch.device(device))
    att = fp8_attention_candidates(model, torch.device(device)) if cands or ups else []
    cands = cands + ups + att
    if not cands:
        why = "" if wan else (f" with >= {image_min_channels(device)} channels (narrower ones stay with "
                              "cuDNN bf16)")
        return StageResult.skipped(name, f"no residual-block 3x3 convs fed by a fused norm{why} in this decoder")
    g = torch.Generator().manual_seed(0)
    if probe is None:
        shape = (1, model.config.z_dim, 3, 16, 16) if wan else (1, model.config.latent_channels, 16, 16)
        probe = torch.randn(shape, generator=g)
    dname = str(dtype).replace("torch.", "")

    up_ids = {id(m) for _, m in ups}

    def mark(chosen):
        ids = {id(m) for _, m in chosen}
        for _, m in cands:
            setattr(m, FP8_ATTR if _is_attention(m) else _MARK8, id(m) in ids)

    def set_format(int8: bool):  # resnet convs: asymmetric int8 (a SiLU output); upsamplers: symmetric int8
        for _, m in cands:
            if not _is_attention(m):
                setattr(m, _INT8, int8)

    t0 = time.perf_counter()
    key = {"weights": cache.weights_fingerprint(model), "candidates": [n for n, _ in cands], "dtype": str(dtype),
           "gate_db": gate_db, "margin_db": margin_db, "decode_shape": list(decode_shape or []),
           "probe": gate_mod.probe_digest(probe), "int8": int8_convs(model, torch.device(device))}
    hit = cache.get("fp8_convs", key, device, log)
    by_name = dict(cands)
    if hit is not None and all(n in by_name for n in hit.get("chosen") or []):
        i8, note8, speed = bool(hit["int8"]), str(hit["note8"]), hit.get("speed")
        set_format(i8)
        chosen = None if hit["chosen"] is None else [(n, by_name[n]) for n in hit["chosen"]]
        mark(chosen or [])
        result = (chosen, dict(hit["stats"]), str(hit["note"]))
    else:
        hit, speed = None, None
        i8, note8 = int8_convs(model, torch.device(device)), ""
        if i8 and decode_shape is None:
            i8, note8 = False, ("; resnet convs in e4m3, not int8: int8 is gated at the decode's size (its step grows "
                                "with the image), unknown to this pipeline")
        result = None
        if i8:
            size = (1, *tuple(decode_shape)[1:])  # the caller's probe where it has that size, else a random latent
            big = (probe[:1] if probe.shape[1:] == size[1:] else torch.randn(size, generator=g)).to(device)
            set_format(True)
            try:
                result = _gate_search(model, cands, big, dtype, gate_db, margin_db, mark,
                                      _image_flops(model, cands, tuple(big.shape[-2:])), decode)
            except torch.cuda.OutOfMemoryError:
                mark([])
                torch.cuda.empty_cache()
                note8 = (f"; resnet convs in e4m3, not int8: the int8 gate's probe at the decode's size "
                         f"{tuple(big.shape[-2:])} ran out of GPU memory")
            if result is not None and result[0] is None:  # no int8 subset passed at full size: e4m3 at the small probe
                note8 = f"; int8 at the decode's size: {result[2]}, so e4m3"
                result = None
            i8 = result is not None
        if result is None:
            set_format(False)
            result = _gate_search(model, cands, probe.to(device), dtype, gate_db, margin_db, mark, None, decode)
    chosen, stats, note = result
    if hit is None:
        if chosen is not None and decode_shape is not None:
            speed = _speed(model, mark, chosen, decode_shape, dtype, device, decode)
        cache.put("fp8_convs", key, {"chosen": None if chosen is None else [n for n, _ in chosen], "int8": i8,
                                     "note8": note8, "stats": stats, "note": note, "speed": speed}, device, log)
    reused = f"; {gate_mod.reused_note(hit)}" if hit is not None else ""
    if chosen is None:
        return StageResult(name, "fallback", f"{note}: convs kept in {dname}{note8}{reused}", stats)
    if speed and speed.get("ms_8bit") is not None and speed["ms_8bit"] >= speed["ms_plain"]:
        mark([])  # a lossy stage stays only where it is also faster at the decode's size
        return StageResult(name, "fallback", f"the 8-bit convs cleared the gate ({stats['probe_db']:.1f} dB) but "
                                             f"measured slower at the decode's size {tuple(decode_shape)[-2:]}: "
                                             f"{speed['ms_8bit']:.2f} ms against {speed['ms_plain']:.2f} ms in "
                                             f"{dname}, so the convs stay in {dname}{reused}", {**stats, **speed})
    note += note8
    n_up = sum(id(m) in up_ids for _, m in chosen)
    n_att = sum(_is_attention(m) for _, m in chosen)
    chosen = [(n, m) for n, m in chosen if not _is_attention(m)]  # the convs, for what follows
    stats["upsampler_layers"] = n_up
    stats["attention_cores"] = n_att
    from vaeopt.kernels import tma_conv  # (imports Triton)

    n_tma = sum(id(m) in up_ids or (tma_conv.available(torch.device(device)) and tma_conv.tuned_config(
        m.in_channels, m.out_channels, 1 << 30, True) is not None) for _, m in chosen)
    stats["tma_layers"] = n_tma
    stats["gate_s"] = time.perf_counter() - t0
    if hit is None:
        note += (f"; gate probes {stats['gate_s']:.1f} s (the first use on a machine includes compiling the 8-bit "
                 "kernels)")
    else:
        note += reused
    if speed and speed.get("ms_8bit") is not None:
        stats.update(speed)
        note += f"; {speed['ms_8bit']:.2f} ms against {speed['ms_plain']:.2f} ms in {dname} at the decode's size"
    elif speed and torch.device(device).type == "cuda":
        note += f"; speed at the decode's size not measured ({speed['why']})"
    if n_tma:
        note += f"; {n_tma} of the {len(chosen)} 8-bit convs through TMA boxes (kernels/tma_conv.py)"
    if i8 and not wan:  # fused_epilogues._residual_in_conv: a conv2 of a resnet without a shortcut
        blocks = [model.get_submodule(n.rsplit(".", 1)[0]) for n, _ in chosen if n.endswith(".conv2")]
        n_res = sum(fused_epilogues.takes_residual_in_conv(b) for b in blocks)
        stats["residual_in_conv"] = n_res
        if n_res:
            note += (f"; {n_res} int8 conv2 add their resnet's input in the epilogue, no residual pass (where the "
                     "image width is a multiple of 128 on a GPU)")
    what = ("Conv3d", "the RMS-norm kernel (static scales)") if wan else (
        "Conv2d", "the GroupNorm kernel (per-sample " + ("scale and zero point over [-0.28, max]" if i8 else "scales")
        + " from bounds of the group max/min; whole-image decodes, tiled ones keep their convs)")
    stats["resnet_format"] = "int8" if i8 else "e4m3"
    res_chans = sorted({m.out_channels for _, m in chosen if id(m) not in up_ids})
    ups_txt = (f"; {n_up} upsampler conv{'s' if n_up != 1 else ''} as 2x2 phase convs in "
               f"{'symmetric int8' if i8 else 'e4m3'} (inputs quantized per sample by an amax pass, "
               "kernels/act_quant.py)" if n_up else "")
    att_txt = (f"; the mid-block attention core{'s' if n_att > 1 else ''} in e4m3 (Q, K, V and the softmax P "
               "through torch._scaled_mm, P @ V row-scaled)" if n_att else "")
    res_txt = (f"{len(chosen) - n_up} residual-block {what[0]} ({'/'.join(map(str, res_chans))} ch) on the "
               f"{stats['resnet_format']} implicit-GEMM kernel, inputs quantized by {what[1]}{ups_txt}{att_txt}"
               if res_chans
               else (ups_txt + att_txt)[2:])
    where = "x".join(map(str, stats["probe_shape"][-2:]))
    return StageResult(name, "applied", f"{res_txt}; probe ({where} latent{', the decode size' if i8 else ''}) "
                                        f"{stats['probe_db']:.1f} dB vs fp32 (gate {gate_db:g}; {dname} path "
                                        f"{stats['bf16_probe_db']:.1f} dB){note}", stats)
