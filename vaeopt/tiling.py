"""Exact layer-streamed tiled decoding for diffusers ``AutoencoderKL`` (SD 1.x/2.x, SDXL, SD3, FLUX topology).

Why not diffusers' ``enable_tiling()``: it decodes overlapping latent tiles *independently* and blends them. Every
GroupNorm inside a tile then normalizes with that tile's own statistics, so tiles come out with different tones; on
the trained ``tiny_kl_image`` VAE that is only 26-28 dB PSNR against the untiled decode (see docs/notes-tiling.md),
and the overlap costs ~2.4x the compute at 1024^2.

What this module does instead ("layer streaming"): the whole decode is run *layer by layer* over the full image, but
each layer is evaluated tile by tile, so that the accelerator only ever holds one tile's working set:

* ``post_quant_conv``, ``conv_in`` and the mid-block (resnets + global attention) run untiled at latent resolution
  (1/64 of the output pixels, so cheap; attention over all latent tokens stays exact).
* Every up-block layer and the output head is a tiled *pass*: a 3x3 conv reads its tile plus a 1-pixel halo of the
  full input activation (zeros only at true image borders), so conv results are exact, not approximated.
* Every GroupNorm uses the statistics of the WHOLE activation: the pass that produces an activation also records
  per-tile, per-channel (count, mean, M2) and merges them exactly (Chan et al.'s parallel variance, fp64). Per-channel
  moments are merged into per-group moments when the norm is applied, so any ``num_groups`` works.
* Nearest upsampling, residual adds and the 1x1 shortcut convs are pointwise per tile.
* Full-size intermediate activations live in buffers on a *storage* device (the compute device when they fit, else
  CPU, pinned when CUDA is present). Only tiles travel to the compute device.

The result equals the untiled decode up to fp32 rounding (>100 dB PSNR in fp32 on tiny_kl_image), for 1x the
convolution FLOPs plus a 1-pixel halo ring per tile ((t+2)^2/t^2: 1.6% at a 256-px tile).

Modules are *called*, not re-implemented, wherever that keeps the result exact: a plain ``nn.Conv2d`` (no hooks, no
overridden ``forward``) is evaluated as ``F.conv2d`` with its own weights and ``padding=0`` on the halo'd tile (same
math, no wasted ring); any other conv / upsampler module (fused, quantized, hooked, ...) is called on the halo'd tile
and the interior of its output is cropped, which is exact for any padding-preserving local operator of radius <= the
halo. The nonlinearities and dropout of the model are called as modules. Only GroupNorm must be applied by hand
(with the global statistics); any norm module exposing ``num_groups``, ``eps``, ``weight`` and ``bias`` is accepted.

OOM handling: every tile computes into fresh tensors and commits (buffer write + statistics merge) only at its very
end. If a tile raises ``torch.cuda.OutOfMemoryError`` (or ``torch.OutOfMemoryError``) the tile side is halved for all
remaining work, the failed tile is re-split and the pass resumes; completed tiles are never recomputed. How often
that happened is reported in the info dict (``shrinks``).

Public API: :func:`tiled_decode`, :class:`TiledDecoder`, :func:`estimate_tiled_bytes`, :func:`storage_bytes`,
:func:`tile_from_pixels`.

Not covered: video VAEs (AutoencoderKLWan / HunyuanVideo: causal 3D convs with temporal caches), AutoencoderTiny,
decoders with SpatialNorm (MoVQ) or attention inside up-blocks; those raise :class:`TilingError`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vaeopt.errors import VaeoptError

__all__ = [
    "TilingError",
    "TiledDecoder",
    "tiled_decode",
    "estimate_tiled_bytes",
    "storage_bytes",
    "tile_from_pixels",
]

_OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {e for e in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if e}
)


class TilingError(VaeoptError):
    """The model's decoder has a structure the exact tiler does not know how to stream."""


# ----------------------------------------------------------------------------------------------------------- plan


@dataclass
class _Pass:
    """One tiled pass over an activation. ``scale`` is the pass's output resolution / latent resolution."""

    kind: str  # "res1" | "res2" | "up" | "head"
    module: nn.Module
    cin: int
    cout: int
    scale: int
    name: str
    sc_cin: int = 0  # res2: channels of the residual input (shortcut conv input)


def _decoder(vae: nn.Module) -> nn.Module:
    dec = getattr(vae, "decoder", None)
    need = ("conv_in", "mid_block", "up_blocks", "conv_norm_out", "conv_act", "conv_out")
    if dec is None or not all(hasattr(dec, a) for a in need):
        raise TilingError(
            f"{type(vae).__name__}: exact tiling supports diffusers AutoencoderKL-style decoders "
            "(conv_in, mid_block, up_blocks, conv_norm_out, conv_act, conv_out)"
        )
    return dec


def _check_norm(norm: nn.Module, where: str) -> None:
    if not all(hasattr(norm, a) for a in ("num_groups", "eps", "weight", "bias")):
        raise TilingError(f"{where}: {type(norm).__name__} is not a GroupNorm (needs num_groups/eps/weight/bias)")


def _check_resnet(blk: nn.Module, where: str) -> None:
    need = ("norm1", "conv1", "norm2", "conv2", "nonlinearity")
    if not all(hasattr(blk, a) for a in need):
        raise TilingError(f"{where}: {type(blk).__name__} is not a ResnetBlock2D-like block")
    if getattr(blk, "upsample", None) is not None or getattr(blk, "downsample", None) is not None:
        raise TilingError(f"{where}: resnets with built-in up/downsampling are not supported")
    if getattr(blk, "time_emb_proj", None) is not None:
        raise TilingError(f"{where}: resnets with a time embedding are not supported")
    if getattr(blk, "time_embedding_norm", "default") not in ("default", "group"):
        raise TilingError(f"{where}: time_embedding_norm={blk.time_embedding_norm!r} is not supported")
    _check_norm(blk.norm1, where + ".norm1")
    _check_norm(blk.norm2, where + ".norm2")


def _conv_channels(conv: nn.Module, fallback_in: int, fallback_out: int) -> tuple[int, int]:
    return int(getattr(conv, "in_channels", fallback_in)), int(getattr(conv, "out_channels", fallback_out))


def _plan(vae: nn.Module) -> list[_Pass]:
    """The tiled passes of the decoder, in order (everything after the mid-block)."""
    dec = _decoder(vae)
    passes: list[_Pass] = []
    scale = 1
    for bi, ub in enumerate(dec.up_blocks):
        if getattr(ub, "attentions", None) is not None or not hasattr(ub, "resnets"):
            raise TilingError(f"up_blocks.{bi}: {type(ub).__name__} is not supported (only UpDecoderBlock2D)")
        for ri, blk in enumerate(ub.resnets):
            where = f"up_blocks.{bi}.resnets.{ri}"
            _check_resnet(blk, where)
            cin, mid = _conv_channels(blk.conv1, blk.in_channels, blk.out_channels)
            _, cout = _conv_channels(blk.conv2, mid, blk.out_channels)
            passes.append(_Pass("res1", blk, cin, mid, scale, where + "[norm1/conv1]"))
            passes.append(_Pass("res2", blk, mid, cout, scale, where + "[norm2/conv2]", sc_cin=cin))
        ups = getattr(ub, "upsamplers", None)
        if ups is not None:
            for ui, up in enumerate(ups):
                c = int(getattr(up, "channels", passes[-1].cout if passes else 0))
                cout = int(getattr(up, "out_channels", c))
                if getattr(up, "use_conv_transpose", False) or getattr(up, "norm", None) is not None:
                    raise TilingError(
                        f"up_blocks.{bi}.upsamplers.{ui}: only nearest-2x + conv upsamplers are supported"
                    )
                scale *= 2
                passes.append(_Pass("up", up, c, cout, scale, f"up_blocks.{bi}.upsamplers.{ui}"))
    if type(dec.conv_norm_out).__name__ == "SpatialNorm":
        raise TilingError("decoders with SpatialNorm (norm_type='spatial') are not supported")
    _check_norm(dec.conv_norm_out, "conv_norm_out")
    cin, cout = _conv_channels(dec.conv_out, passes[-1].cout if passes else 0, 3)
    passes.append(_Pass("head", dec, cin, cout, scale, "conv_norm_out/conv_out"))
    return passes


def _factor(vae: nn.Module) -> int:
    return _plan(vae)[-1].scale


def tile_from_pixels(vae: nn.Module, tile_px: int | Sequence[int]) -> tuple[int, int]:
    """Output-pixel tile side(s) -> latent-pixel tile (what :func:`tiled_decode` takes), rounded down to the VAE's
    spatial factor (8 for SD/SDXL/SD3/FLUX), at least 1 latent px."""
    f = _factor(vae)
    th, tw = _pair(tile_px)
    return max(1, th // f), max(1, tw // f)


def _pair(t: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(t, int):
        return int(t), int(t)
    th, tw = t
    return int(th), int(tw)


# ---------------------------------------------------------------------------------------------------- statistics


class _Moments:
    """Per-channel running (count, mean, M2) of one activation, merged exactly across tiles (Chan et al.)."""

    def __init__(self, channels: int, device: torch.device):
        dt = torch.float32 if device.type == "mps" else torch.float64
        self.n = 0
        self.mean = torch.zeros(channels, dtype=dt, device=device)
        self.m2 = torch.zeros(channels, dtype=dt, device=device)
        self._affine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def of_tile(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Tile-local moments in fp32 (x: (1, C, h, w)); returns (count, mean, M2) with mean/M2 of shape (C,)."""
        n = x.shape[0] * x.shape[2] * x.shape[3]
        xf = x.float()
        if x.device.type == "cpu":
            # two-pass (mean, then sum of squared deviations): 6x faster than var_mean's Welford on CPU, as exact
            mean = xf.mean(dim=(0, 2, 3))
            m2 = torch.linalg.vector_norm(xf - mean.view(1, -1, 1, 1), 2, dim=(0, 2, 3)).square_()
            return n, mean, m2
        var, mean = torch.var_mean(xf, dim=(0, 2, 3), correction=0)  # one-pass Welford reduction on GPUs
        return n, mean, var * n

    def merge(self, part: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        nb, mb, m2b = part
        if nb == 0:
            return
        mb = mb.to(self.mean.dtype)
        m2b = m2b.to(self.mean.dtype)
        na, n = self.n, self.n + nb
        delta = mb - self.mean
        self.mean += delta * (nb / n)
        self.m2 += m2b + delta * delta * (na * nb / n)
        self.n = n
        self._affine.clear()

    def affine(self, norm: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift_c, scale_c) as (1, C, 1, 1) fp32 tensors such that GroupNorm(x)_c = x_c * scale_c + shift_c with
        the statistics of the whole activation (computed in fp64 from the merged per-channel moments)."""
        key = id(norm)
        if key not in self._affine:
            g = int(norm.num_groups)
            c = self.mean.numel()
            cg = c // g
            mean_c = self.mean.view(g, cg)
            mean_g = mean_c.mean(dim=1, keepdim=True)  # all channels have the same count
            m2_g = self.m2.view(g, cg).sum(dim=1, keepdim=True) + self.n * ((mean_c - mean_g) ** 2).sum(
                dim=1, keepdim=True
            )
            var_g = m2_g / (self.n * cg)
            rstd = torch.rsqrt(var_g + float(norm.eps))
            w = norm.weight.detach().to(self.mean.dtype).view(g, cg) if norm.weight is not None else 1.0
            b = norm.bias.detach().to(self.mean.dtype).view(g, cg) if norm.bias is not None else 0.0
            scale = (rstd * w).expand(g, cg)
            shift = (b - mean_g * scale).expand(g, cg)
            f = dict(dtype=torch.float32, device=device)
            self._affine[key] = (shift.reshape(1, c, 1, 1).to(**f), scale.reshape(1, c, 1, 1).to(**f))
        return self._affine[key]


class _Act:
    """A full-size activation (1, C, H, W) on the storage device plus its running moments."""

    def __init__(self, t: torch.Tensor, stats_device: torch.device):
        self.t = t
        self.stats = _Moments(t.shape[1], stats_device)

    @property
    def hw(self) -> tuple[int, int]:
        return self.t.shape[-2], self.t.shape[-1]


# ------------------------------------------------------------------------------------------------ module helpers


def _is_plain_conv(m: nn.Module) -> bool:
    """A stock nn.Conv2d whose forward we may evaluate as F.conv2d(padding=0) on a halo'd tile."""
    return (
        isinstance(m, nn.Conv2d)
        and type(m).forward is nn.Conv2d.forward
        and "forward" not in m.__dict__
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and m.padding_mode == "zeros"
        and tuple(m.stride) == (1, 1)
        and tuple(m.dilation) == (1, 1)
        and isinstance(m.padding, tuple)
        and tuple(m.padding) == (m.kernel_size[0] // 2, m.kernel_size[1] // 2)
        and m.kernel_size[0] % 2 == 1
        and m.kernel_size[1] % 2 == 1
    )


def _conv_region(conv: nn.Module, x: torch.Tensor, oy: int, ox: int, h: int, w: int) -> torch.Tensor:
    """Apply a stride-1, padding-preserving conv to a region `x` of its input and return the (h, w) output tile that
    starts at (oy, ox) inside the region. The region holds the tile plus the conv's halo wherever the image goes on;
    where it stops at a true image border the conv's own zero padding supplies the border (no padded copy is made).

    A plain nn.Conv2d on a region with its full halo runs with padding=0 (no wasted ring); everything else runs with
    the module's own padding (the module itself is called if it is not a plain nn.Conv2d) and is cropped."""
    if _is_plain_conv(conv):
        kh, kw = conv.kernel_size[0] // 2, conv.kernel_size[1] // 2
        if (oy, ox) == (kh, kw) and x.shape[-2] == h + 2 * kh and x.shape[-1] == w + 2 * kw:
            return F.conv2d(x, conv.weight, conv.bias, 1, 0, 1, conv.groups)
        y = F.conv2d(x, conv.weight, conv.bias, 1, conv.padding, 1, conv.groups)
    else:
        y = conv(x)
    if y.shape[-2:] != x.shape[-2:]:
        raise TilingError(f"{type(conv).__name__}: tiling needs stride-1 size-preserving convolutions")
    if y.shape[-2:] == (h, w):
        return y
    return y[..., oy : oy + h, ox : ox + w]


def _is_plain_upsampler(up: nn.Module) -> bool:
    try:
        from diffusers.models.upsampling import Upsample2D
    except Exception:  # pragma: no cover - diffusers always present in practice
        return False
    return (
        type(up).forward is Upsample2D.forward
        and "forward" not in up.__dict__
        and not up._forward_hooks
        and not up._forward_pre_hooks
        and getattr(up, "interpolate", False)
        and getattr(up, "use_conv", False)
        and not getattr(up, "use_conv_transpose", False)
        and getattr(up, "norm", None) is None
    )


def _memory_format(dec: nn.Module) -> torch.memory_format:
    """channels_last when the decoder's convs were converted to NHWC (stages/channels_last.py): the buffers then use
    it too, so tiles reach cuDNN without relayouts."""
    w = getattr(getattr(dec, "conv_out", None), "weight", None)
    if isinstance(w, torch.Tensor) and w.ndim == 4 and w.is_contiguous(memory_format=torch.channels_last):
        if not w.is_contiguous():
            return torch.channels_last
    return torch.contiguous_format


def _up_conv(up: nn.Module) -> nn.Module:
    return up.conv if getattr(up, "name", "conv") == "conv" else up.Conv2d_0


# ------------------------------------------------------------------------------------------------------ decoder


def _tiles(h: int, w: int, th: int, tw: int) -> list[tuple[int, int, int, int]]:
    return [(y, min(y + th, h), x, min(x + tw, w)) for y in range(0, h, th) for x in range(0, w, tw)]


class TiledDecoder:
    """Exact layer-streamed tiled decoding of one diffusers AutoencoderKL.

    Args:
        vae: the AutoencoderKL (any dtype/device; eval mode). Its submodules may be swapped for optimized ones as
            long as convs stay stride-1 padding-preserving and norms expose num_groups/eps/weight/bias.
        tile: tile side in LATENT pixels (int or (h, w)); the output tile is ``tile * 8`` px for SD/SDXL/SD3/FLUX.
            At a layer that runs at ``s`` times the latent resolution the tile is ``tile * s`` px of that layer.
            Use :func:`tile_from_pixels` to convert from output pixels.
        storage: where the full-size intermediate activations live. ``None``: the compute device if they fit in
            its free memory next to the tile working set, else CPU (pinned if CUDA is available).
        progress: ``progress(done, total)`` after every tile of every pass (``total`` grows if tiles are split).
        min_tile: smallest latent tile the OOM fallback may shrink to.
        vram_budget: bytes the decode may use on a CUDA device (e.g. the planner's budget). With ``storage=None``
            the full-size buffers go to the GPU only if buffers + working set fit both this and 85% of free memory.
    """

    def __init__(
        self,
        vae: nn.Module,
        tile: int | Sequence[int] = 64,
        storage: torch.device | str | None = None,
        progress: Callable[[int, int], None] | None = None,
        min_tile: int = 2,
        vram_budget: int | None = None,
    ):
        self.vae = vae
        self.vram_budget = vram_budget
        self.dec = _decoder(vae)
        self.passes = _plan(vae)
        self.factor = self.passes[-1].scale
        self.tile = _pair(tile)
        if min(self.tile) < 1:
            raise ValueError("tile must be >= 1 latent pixel")
        self.storage_arg = storage
        self.progress = progress
        self.min_tile = max(1, int(min_tile))
        self.info: dict = {}

    # -- public ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Raw (unscaled) latents (N, C, h, w) -> images (N, 3, h*f, w*f) in the model's dtype, on its device."""
        if z.ndim != 4:
            raise ValueError(f"expected latents of shape (N, C, h, w), got {tuple(z.shape)}")
        p = next(p for p in self.dec.parameters() if p.is_floating_point())
        self.device, self.dtype = p.device, p.dtype
        self.memory_format = _memory_format(self.dec)
        n, _, h, w = z.shape
        self.storage = self._choose_storage((h, w))
        self.cur_tile = self.tile
        self.done = 0
        self.total = n * sum(len(_tiles(h * ps.scale, w * ps.scale, *self._tile_px(ps.scale))) for ps in self.passes)
        self.info = {
            "tile": self.tile,
            "final_tile": self.tile,
            "shrinks": 0,
            "oom_events": [],
            "tiles": 0,
            "passes": len(self.passes),
            "storage": str(self.storage),
            "factor": self.factor,
        }
        f, c_out = self.factor, self.passes[-1].cout
        out = torch.empty(n, c_out, h * f, w * f, device=self.device, dtype=self.dtype)
        for i in range(n):
            self._decode_one(z[i : i + 1], out[i : i + 1])
        self.info["tiles"] = self.done
        self.info["final_tile"] = self.cur_tile
        return out

    # -- internals -----------------------------------------------------------------------------------------------

    def _choose_storage(self, latent_hw: tuple[int, int]) -> torch.device:
        if self.storage_arg is not None:
            return torch.device(self.storage_arg)
        if self.device.type != "cuda":
            return self.device
        need = storage_bytes(self.vae, latent_hw, self.dtype) + estimate_tiled_bytes(
            self.vae, latent_hw, self.tile, self.dtype
        )
        free, _ = torch.cuda.mem_get_info(self.device)
        limit = 0.85 * free if self.vram_budget is None else min(0.85 * free, self.vram_budget)
        return self.device if need <= limit else torch.device("cpu")

    def _alloc(self, c: int, h: int, w: int) -> torch.Tensor:
        pin = self.storage.type == "cpu" and self.device.type == "cuda"
        t = torch.empty(1, c, h, w, dtype=self.dtype, device=self.storage, pin_memory=pin)
        if self.memory_format is torch.channels_last:  # (empty() cannot pin and pick a format at once)
            t = t.as_strided((1, c, h, w), (c * h * w, 1, w * c, c))
        return t

    def _to_storage(self, x: torch.Tensor) -> _Act:
        if x.device == self.storage:
            a = _Act(x.contiguous(memory_format=self.memory_format), self.device)
        else:
            a = _Act(self._alloc(*x.shape[1:]), self.device)
            a.t.copy_(x)
        a.stats.merge(_Moments.of_tile(x))
        return a

    def _tile_px(self, scale: int) -> tuple[int, int]:
        return self.cur_tile[0] * scale, self.cur_tile[1] * scale

    def _read(self, act: _Act, y0: int, y1: int, x0: int, x1: int, halo: int):
        """Tile [y0:y1, x0:x1] of `act` plus up to `halo` px of context, clamped to the image, on the compute device
        (a view when storage is the compute device). Returns (region, oy, ox): the tile's offset inside the region."""
        h, w = act.hw
        ya, yb, xa, xb = max(y0 - halo, 0), min(y1 + halo, h), max(x0 - halo, 0), min(x1 + halo, w)
        t = act.t[:, :, ya:yb, xa:xb]
        if t.device != self.device:
            t = t.to(self.device, non_blocking=True)
        return t, y0 - ya, x0 - xa

    def _norm_act(self, x: torch.Tensor, act: _Act, norm: nn.Module, nonlin: nn.Module) -> torch.Tensor:
        """GroupNorm with the statistics of the whole activation, then the model's nonlinearity. Always returns a
        fresh tensor (never a view of a storage buffer)."""
        shift, scale = act.stats.affine(norm, self.device)
        y = torch.addcmul(shift, x, scale)  # fp32 (promoted), one pass
        if y.dtype != self.dtype:
            y = y.to(self.dtype)
        if getattr(norm, "silu", False) is True:  # a fused GroupNorm+SiLU module (stages/fused_norms.py)
            y = F.silu(y, inplace=True)
        if type(nonlin) is nn.SiLU and not nonlin._forward_hooks and not nonlin._forward_pre_hooks:
            return F.silu(y, inplace=True)
        return nonlin(y)

    def _write(self, dst: _Act | torch.Tensor, y0: int, y1: int, x0: int, x1: int, val: torch.Tensor) -> None:
        t = dst.t if isinstance(dst, _Act) else dst
        t[:, :, y0:y1, x0:x1].copy_(val, non_blocking=True)

    def _run(self, ps: _Pass, hw: tuple[int, int], fn: Callable[[int, int, int, int], None]) -> None:
        """Run `fn` on every tile of a pass; on OOM halve the tile and resume without redoing finished tiles."""
        queue = deque(_tiles(*hw, *self._tile_px(ps.scale)))
        while queue:
            y0, y1, x0, x1 = queue.popleft()
            th, tw = self._tile_px(ps.scale)
            if y1 - y0 > th or x1 - x0 > tw:  # tile shrank since this one was queued: split it
                sub = [
                    (y0 + a, min(y0 + b, y1), x0 + c, min(x0 + d, x1))
                    for a, b, c, d in _tiles(y1 - y0, x1 - x0, th, tw)
                ]
                self.total += len(sub) - 1
                queue.extendleft(reversed(sub))
                continue
            oom = False
            try:
                fn(y0, y1, x0, x1)
            except _OOM_ERRORS:
                if max(self.cur_tile) <= self.min_tile:
                    raise
                oom = True  # handled below, once the traceback (and the tile's tensors it holds) is released
            if oom:
                self.cur_tile = tuple(max(self.min_tile, t // 2) for t in self.cur_tile)
                self.info["shrinks"] += 1
                self.info["oom_events"].append((ps.name, (y0, y1, x0, x1), self.cur_tile))
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                queue.appendleft((y0, y1, x0, x1))
                continue
            self.done += 1
            if self.progress is not None:
                self.progress(self.done, self.total)

    def _decode_one(self, z: torch.Tensor, out: torch.Tensor) -> None:
        dec, vae = self.dec, self.vae
        # ---- untiled at latent resolution: post_quant_conv, conv_in, mid-block (incl. global attention)
        x = z.to(self.device, self.dtype)
        pqc = getattr(vae, "post_quant_conv", None)
        if pqc is not None:
            x = pqc(x)
        x = dec.conv_in(x)
        x = dec.mid_block(x, None)
        cur = self._to_storage(x)
        del x
        h, w = cur.hw
        # ---- tiled passes; each pass method returns its output activation and drops its inputs
        h1: _Act | None = None
        for ps in self.passes:
            hw = (h * ps.scale, w * ps.scale)
            if ps.kind == "res1":
                h1 = self._pass_res1(ps, hw, cur)
            elif ps.kind == "res2":
                cur = self._pass_res2(ps, hw, cur, h1)
                h1 = None
            elif ps.kind == "up":
                cur = self._pass_up(ps, hw, cur)
            else:
                self._pass_head(ps, hw, cur, out)
                cur = None
        if self.storage.type == "cpu" and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _pass_res1(self, ps: _Pass, hw: tuple[int, int], src: _Act) -> _Act:
        """h1 = conv1(act(norm1(x))) -- x is kept (it is the residual)."""
        blk = ps.module
        dst = _Act(self._alloc(ps.cout, *hw), self.device)

        def fn(y0, y1, x0, x1):
            t, oy, ox = self._read(src, y0, y1, x0, x1, 1)
            a = self._norm_act(t, src, blk.norm1, blk.nonlinearity)
            del t
            o = _conv_region(blk.conv1, a, oy, ox, y1 - y0, x1 - x0)
            del a
            st = _Moments.of_tile(o)
            self._write(dst, y0, y1, x0, x1, o)
            dst.stats.merge(st)

        self._run(ps, hw, fn)
        return dst

    def _pass_res2(self, ps: _Pass, hw: tuple[int, int], res: _Act, src: _Act) -> _Act:
        """out = (shortcut(x) + conv2(dropout(act(norm2(h1))))) / output_scale_factor."""
        blk = ps.module
        sc_conv = getattr(blk, "conv_shortcut", None)
        drop = getattr(blk, "dropout", None)
        osf = float(getattr(blk, "output_scale_factor", 1.0))
        res_t = res.t
        # The block output may overwrite its input in place: a tile reads the residual only at its own pixels.
        if sc_conv is None and ps.cout == ps.sc_cin:
            dst = res
            dst.stats = _Moments(ps.cout, self.device)
        else:
            dst = _Act(self._alloc(ps.cout, *hw), self.device)
        del res

        def fn(y0, y1, x0, x1):
            t, oy, ox = self._read(src, y0, y1, x0, x1, 1)
            a = self._norm_act(t, src, blk.norm2, blk.nonlinearity)
            del t
            if drop is not None:
                a = drop(a)
            o = _conv_region(blk.conv2, a, oy, ox, y1 - y0, x1 - x0)
            del a
            r = res_t[:, :, y0:y1, x0:x1]
            if r.device != self.device:
                r = r.to(self.device, non_blocking=True)
            if sc_conv is not None:
                r = _conv_region(sc_conv, r, 0, 0, y1 - y0, x1 - x0)
            o = r + o
            del r
            if osf != 1.0:
                o = o / osf
            st = _Moments.of_tile(o)
            self._write(dst, y0, y1, x0, x1, o)
            dst.stats.merge(st)

        self._run(ps, hw, fn)
        return dst

    def _pass_up(self, ps: _Pass, hw: tuple[int, int], src: _Act) -> _Act:
        """2x nearest upsampling + 3x3 conv, computed per output tile from a source tile with a 1-px halo."""
        up = ps.module
        dst = _Act(self._alloc(ps.cout, *hw), self.device)
        plain = _is_plain_upsampler(up)
        H, W = hw

        def fn(y0, y1, x0, x1):
            # output tile [y0, y1) at 2x <- source rows [y0/2 - 1, y1/2 + 1), clamped to the image
            t, sy, sx = self._read(src, y0 // 2, (y1 + 1) // 2, x0 // 2, (x1 + 1) // 2, 1)
            uy0, ux0 = 2 * (y0 // 2 - sy), 2 * (x0 // 2 - sx)  # upsampled coords of t's first pixel
            if plain:
                u = F.interpolate(t, scale_factor=2.0, mode="nearest")
                del t
                # keep the upsampled rows [y0 - 1, y1 + 1) that exist in the image
                ya, yb, xa, xb = max(y0 - 1, 0), min(y1 + 1, H), max(x0 - 1, 0), min(x1 + 1, W)
                u = u[:, :, ya - uy0 : yb - uy0, xa - ux0 : xb - ux0]
                o = _conv_region(_up_conv(up), u, y0 - ya, x0 - xa, y1 - y0, x1 - x0)
            else:
                u = up(t)
                if u.shape[-2:] != (2 * t.shape[-2], 2 * t.shape[-1]):
                    raise TilingError(f"{ps.name}: upsampler is not a 2x size-preserving module")
                del t
                # u's rows at distance >= 1 from a non-border edge are exact
                o = u[:, :, y0 - uy0 : y1 - uy0, x0 - ux0 : x1 - ux0]
            del u
            st = _Moments.of_tile(o)
            self._write(dst, y0, y1, x0, x1, o)
            dst.stats.merge(st)

        self._run(ps, hw, fn)
        return dst

    def _pass_head(self, ps: _Pass, hw: tuple[int, int], src: _Act, out: torch.Tensor) -> None:
        """conv_norm_out -> conv_act -> conv_out, written straight into the output image."""
        dec = self.dec

        def fn(y0, y1, x0, x1):
            t, oy, ox = self._read(src, y0, y1, x0, x1, 1)
            a = self._norm_act(t, src, dec.conv_norm_out, dec.conv_act)
            del t
            o = _conv_region(dec.conv_out, a, oy, ox, y1 - y0, x1 - x0)
            del a
            self._write(out, y0, y1, x0, x1, o)

        self._run(ps, hw, fn)


def tiled_decode(
    vae: nn.Module,
    z_raw: torch.Tensor,
    tile: int | Sequence[int] = 64,
    storage: torch.device | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    return_info: bool = False,
    min_tile: int = 2,
    vram_budget: int | None = None,
):
    """Decode raw (unscaled) latents ``z_raw`` (N, C, h, w) with exact layer-streamed tiling.

    ``tile`` is the tile side in LATENT pixels (int or (h, w)); an output tile is ``tile * factor`` px (factor 8
    for SD/SDXL/SD3/FLUX), so tiles are always aligned to the VAE's factor. Sizes need not be multiples of the tile.
    Returns images (N, 3, h*factor, w*factor) in [-1, 1] (model dtype, model device); with ``return_info=True``
    returns ``(images, info)`` where info has ``shrinks`` (OOM tile halvings), ``final_tile``, ``tiles``, ``storage``.
    ``storage``, ``progress``, ``min_tile`` and ``vram_budget``: see :class:`TiledDecoder`.
    """
    td = TiledDecoder(vae, tile=tile, storage=storage, progress=progress, min_tile=min_tile, vram_budget=vram_budget)
    img = td.decode(z_raw)
    return (img, td.info) if return_info else img


# ------------------------------------------------------------------------------------------------------ memory


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def storage_bytes(vae: nn.Module, latent_hw: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
    """Bytes of full-size activation buffers alive at once on the storage device (per sample; samples are decoded
    one after another). The worst point is a channel-changing resnet: input + conv1 output + block output."""
    h, w = latent_hw
    b = _dtype_bytes(dtype)
    worst = 0
    passes = _plan(vae)
    for i, ps in enumerate(passes):
        px = h * w * ps.scale * ps.scale
        if ps.kind == "res1":
            nxt = passes[i + 1]
            sep = nxt.cout if (getattr(ps.module, "conv_shortcut", None) is not None or nxt.cout != ps.cin) else 0
            worst = max(worst, px * b * (ps.cin + ps.cout + sep))
        elif ps.kind == "up":
            worst = max(worst, px * b * ps.cout + (px // 4) * b * ps.cin)
    return int(worst)


def estimate_tiled_bytes(
    vae: nn.Module,
    latent_hw: Sequence[int],
    tile: int | Sequence[int],
    dtype: torch.dtype = torch.float32,
    storage_on_device: bool = False,
    include_output: bool = True,
    batch: int = 1,
) -> int:
    """Peak bytes :func:`tiled_decode` needs on the compute device for one sample at ``latent_hw`` with a latent
    ``tile`` (same units as tiled_decode), excluding weights.

    It is the max over the untiled latent-resolution part (conv_in + mid-block incl. attention, ~8 live activations,
    assuming a memory-efficient SDPA kernel, i.e. no N^2 score matrix) and every tiled pass's working set, modelled
    on the code: halo'd input tile (a copy only when storage is elsewhere), fp32 normalised tile, its cast to
    ``dtype``, conv output, fp32 statistics temporary, residual/shortcut tiles; plus a 12.5% margin for convolution
    workspaces. Samples of a batch are decoded one after another, so ``batch`` only scales the output image.
    Added on top: the output image (``include_output``) and, with ``storage_on_device=True``, the
    full-size activation buffers (:func:`storage_bytes`). The tiled part grows with the tile area and does not
    depend on the image size; the latent-resolution part grows with the latent area (1/64 of the pixels).
    Validated against a live-tensor tracker on CPU (docs/notes-tiling.md): within +0..+25% of the measured peak.
    """
    h, w = latent_hw
    th, tw = _pair(tile)
    th, tw = min(th, h), min(tw, w)
    b = _dtype_bytes(dtype)
    f32 = 4
    low = b < f32
    copy_in = 0 if storage_on_device else 1
    passes = _plan(vae)
    c_mid = passes[0].cin
    peak = h * w * c_mid * (8 * b + (f32 if low else 0))
    for ps in passes:
        s = ps.scale
        ty, tx = min(th * s, h * s), min(tw * s, w * s)
        inner = ty * tx
        if ps.kind in ("res1", "res2", "head"):
            halo = (ty + 2) * (tx + 2) * ps.cin
            read = copy_in * halo * b
            norm = halo * f32
            act = halo * b if low else norm  # after the cast (the fp32 temporary is dropped)
            out = ps.cout * inner * b
            stats = ps.cout * inner * f32 if low else 0
            ws = max(read + norm + (halo * b if low else 0), act + out, out + stats)
            if ps.kind == "res2":
                res = ps.sc_cin * inner * b * copy_in
                sc = ps.cout * inner * b if ps.sc_cin != ps.cout else 0
                ws = max(ws, act + out + res, out + res + sc, 3 * out + stats)
        else:  # up: source tile (half res + halo) -> 2x nearest -> conv
            src = copy_in * ps.cin * (ty // 2 + 2) * (tx // 2 + 2) * b
            upd = ps.cin * (ty + 4) * (tx + 4) * b
            out = ps.cout * inner * b
            stats = ps.cout * inner * f32 if low else 0
            ws = max(src + upd, upd + out, out + stats)
        peak = max(peak, ws)
    total = int(peak * 1.125)
    if include_output:
        total += max(1, int(batch)) * passes[-1].cout * h * w * passes[-1].scale ** 2 * b
    if storage_on_device:
        total += storage_bytes(vae, latent_hw, dtype)
    return int(total)
