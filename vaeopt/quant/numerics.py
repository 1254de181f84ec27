"""The number formats of the quantized decoder and their emulation: e4m3 (float8_e4m3fn) with one scale per output
channel or per tensor, int8 per output channel. The quantizers themselves are the kernels layer's
(`vaeopt.kernels.fp8_quant`, shared with the 8-bit convs' packed weights), so a weight stored by the fp8 stage, packed
for a conv kernel, or rounded by the sensitivity emulation gets the very same values."""

from __future__ import annotations

import torch

from vaeopt.kernels.fp8_quant import E4M3, E4M3_MAX, quantize_per_channel, quantize_per_tensor  # noqa: F401


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale (one scale per index of dim 0) in `dtype`: a per-channel quantized weight back in the compute dtype."""
    return (q.to(torch.float32) * scale.view(-1, *([1] * (q.ndim - 1)))).to(dtype)


def fake_quant(x: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """x rounded through e4m3 and back, in x's dtype: one scale per output channel (dim 0) or one for the tensor."""
    if per_channel:
        q, s = quantize_per_channel(x)
        return dequantize(q, s, x.dtype)
    q, s = quantize_per_tensor(x)
    return (q.float() * s).to(x.dtype)
