"""Per-sample 8-bit quantization of an activation on the GPU: two Triton passes, no host sync.

For an 8-bit conv whose input no quantizing norm writes: an upsampler's input is a residual sum
(kernels/upconv.upconv2x_8bit, which takes both formats). One pass takes each sample's amax (a block max, then an
atomic max per block). The second writes x * (448 / amax) as e4m3 and the scale amax / 448, or x * (127 / amax)
rounded to int8 and the scale amax / 127 (symmetric: a residual sum has both signs, and zero must stay zero for the
conv's zero padding). Both run on the device, so the call fits CUDA graphs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vaeopt.kernels.fp8_quant import E4M3, E4M3_MAX
from vaeopt.kernels.common import sat_e4m3


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, L, BLOCK: tl.constexpr):
    n = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + n.to(tl.int64) * L + offs, mask=offs < L, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + n, tl.max(tl.abs(v), axis=0))


@triton.jit
def _quant_kernel(x_ptr, q_ptr, amax_ptr, s_ptr, L, BLOCK: tl.constexpr, EXACT8: tl.constexpr,
                  INT8: tl.constexpr = False):
    n = tl.program_id(1)
    b = tl.program_id(0)
    amax = tl.maximum(tl.load(amax_ptr + n), 1e-12)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    base = n.to(tl.int64) * L
    v = tl.load(x_ptr + base + offs, mask=offs < L, other=0.0).to(tl.float32)
    if INT8:  # round to nearest by adding 1.5 * 2^23 (see group_norm_silu's int8 apply); the store truncates
        top = 127.0
        y = tl.minimum(tl.maximum(v * (127.0 / amax) + 12582912.0, 12582912.0 - 127.0), 12582912.0 + 127.0)
        y = y.to(tl.int32, bitcast=True)
    else:
        top = 448.0
        y = sat_e4m3(v * (448.0 / amax), EXACT8)
    tl.store(q_ptr + base + offs, y.to(q_ptr.dtype.element_ty), mask=offs < L)
    if b == 0:
        tl.store(s_ptr + n, amax / top)


def quantize_e4m3_per_sample(x: torch.Tensor, *, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, ...) -> (e4m3 tensor in x's layout, fp32 scales (N,)) with x ≈ q * scale[n], scale = amax_n / 448.

    x must be dense with the batch outermost (contiguous or channels_last[_3d]): each sample is one run of memory,
    processed in memory order, so the output keeps x's strides. A zero sample gets amax 1e-12 and quantizes to
    zeros; values are saturated to ±448 (a NaN stays NaN)."""
    if E4M3 is None:
        raise TypeError(f"torch {torch.__version__} has no float8_e4m3fn")
    return _quantize_per_sample(x, E4M3, block)


def quantize_int8_per_sample(x: torch.Tensor, *, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_e4m3_per_sample` in symmetric int8: x ≈ q * scale[n], scale = amax_n / 127, q rounded to nearest in
    [-127, 127] (no zero point: x = 0 is q = 0, as the conv's zero padding reads)."""
    return _quantize_per_sample(x, torch.int8, block)


def _quantize_per_sample(x: torch.Tensor, dtype: torch.dtype, block: int | None):
    who = "quantize_int8_per_sample" if dtype == torch.int8 else "quantize_e4m3_per_sample"
    if x.dim() < 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{who}: expected a float (N, ...) tensor, got {x.dtype} {tuple(x.shape)}")
    N = x.shape[0]
    L = x.numel() // max(N, 1)
    formats = {4: (torch.contiguous_format, torch.channels_last),
               5: (torch.contiguous_format, torch.channels_last_3d)}.get(x.dim(), (torch.contiguous_format,))
    if not any(x.is_contiguous(memory_format=f) for f in formats) or (N > 1 and x.stride(0) != L):
        raise ValueError(f"{who}: x must be dense with the batch outermost (contiguous or channels_last)")
    i8 = dtype == torch.int8
    q = torch.empty_like(x, dtype=dtype)
    scale = torch.empty(N, dtype=torch.float32, device=x.device)  # written by the cast pass
    if x.numel() == 0:
        return q, scale.fill_(1e-12 / (127.0 if i8 else E4M3_MAX))
    blk = block or (8192 if x.is_cuda else 1024)
    amax = torch.zeros(N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(L, blk), N)
    nw = 8 if x.is_cuda else 4
    _amax_kernel[grid](x, amax, L, BLOCK=blk, num_warps=nw)
    _quant_kernel[grid](x, q, amax, scale, L, BLOCK=blk, EXACT8=x.device.type == "cpu" and not i8, INT8=i8,
                        num_warps=nw)
    return q, scale
