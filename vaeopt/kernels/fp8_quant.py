"""Per-channel e4m3 (float8_e4m3fn) weight quantization: the one definition behind the fp8 stage's weight storage
(vaeopt.stages.fp8) and the fp8 implicit-GEMM conv's packed weights (vaeopt.kernels.conv.pack_weight). Pure torch."""

from __future__ import annotations

import torch

E4M3 = getattr(torch, "float8_e4m3fn", None)
E4M3_MAX = 448.0  # e4m3's largest finite value


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (e4m3 tensor of x's shape, fp32 0-d scale) with x ≈ q * scale: one scale for the tensor, amax / E4M3_MAX
    (an all-zero tensor gets amax 1e-12), values clamped to e4m3's range and cast (round to nearest). The dynamic
    activation scale of the fp8 GEMMs and its emulation."""
    s = x.detach().abs().amax().float().clamp_min(1e-12) / E4M3_MAX
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s


def _channel_scales(w: torch.Tensor, dim: int, qmax: float) -> tuple[torch.Tensor, list[int]]:
    """One scale per index of `dim`: that slice's amax / qmax (an all-zero slice gets amax 1e-12), and the shape
    that broadcasts it along `dim`."""
    dim = dim % w.ndim
    n = w.shape[dim]
    amax = w.detach().float().movedim(dim, 0).reshape(n, -1).abs().amax(dim=1).clamp_min(1e-12)
    bshape = [1] * w.ndim
    bshape[dim] = -1
    return amax / qmax, bshape


def quantize_per_channel(w: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (e4m3 tensor of w's shape, fp32 scale (w.shape[dim],)) with w ≈ q * scale broadcast along `dim`.

    One scale per index of `dim` (dim 0: the output channels of an (O, ...) weight): amax / E4M3_MAX, so each
    channel's largest |w| maps to ±E4M3_MAX (an all-zero channel gets amax 1e-12 and quantizes to zeros); the scaled
    values are clamped to e4m3's range and cast (round to nearest)."""
    scale, bshape = _channel_scales(w, dim, E4M3_MAX)
    q = (w.float() / scale.view(bshape)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def quantize_per_channel_int8(w: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (int8 tensor of w's shape, fp32 scale (w.shape[dim],)) with w ≈ q * scale broadcast along `dim`:
    symmetric, amax / 127 per index of `dim`, round to nearest (an all-zero channel quantizes to zeros)."""
    scale, bshape = _channel_scales(w, dim, 127.0)
    q = torch.round(w.float() / scale.view(bshape)).clamp(-127, 127).to(torch.int8)
    return q, scale
