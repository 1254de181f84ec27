"""Per-sample e4m3 activation quantization (vaeopt/kernels/act_quant.py) under the Triton interpreter: the scales are
each sample's amax / 448, the values are torch's own e4m3 cast of x / scale, the layout is kept, and what it cannot
take is refused."""

import pytest
import torch

from test_kernel_conv import _backend  # noqa: F401 (autouse: the interpreter on CPU, the GPU for gpu tests)

AQ = pytest.importorskip("vaeopt.kernels.act_quant")


@pytest.mark.parametrize("fmt,shape", [(torch.channels_last, (3, 8, 5, 7)), (torch.contiguous_format, (2, 4, 3, 6)),
                                       (torch.channels_last_3d, (2, 4, 2, 3, 5))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scales_values_and_layout(fmt, shape, dtype):
    g = torch.Generator().manual_seed(1)
    mag = torch.tensor([0.01, 3.0, 200.0][: shape[0]]).view(-1, *[1] * (len(shape) - 1))
    x = torch.randn(shape, generator=g) * mag
    x = x.to(dtype).contiguous(memory_format=fmt)
    if shape[0] == 3:
        x[2].zero_()  # an all-zero sample: quantizes to zeros with a tiny scale
    q, s = AQ.quantize_e4m3_per_sample(x, block=64)  # several blocks per sample: the atomic max combines them
    amax = x.float().flatten(1).abs().amax(1)
    assert s.dtype == torch.float32 and s.shape == (shape[0],)
    torch.testing.assert_close(s, amax.clamp_min(1e-12) / 448.0, rtol=0, atol=0)
    assert q.dtype == torch.float8_e4m3fn and q.stride() == x.stride()
    bshape = (-1,) + (1,) * (x.dim() - 1)
    v = x.float() * (448.0 / amax.clamp_min(1e-12)).view(bshape)
    ref = v.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    off = q.float() != ref
    # torch's cast rounds ties to even; the interpreter's emulation (EXACT8) rounds them away from zero. The GPU's
    # cast is torch's (test_gpu_matches_torch). So the only differences allowed here are exact ties.
    lo, hi = torch.minimum(q.float(), ref)[off], torch.maximum(q.float(), ref)[off]
    assert torch.equal((lo + hi) / 2, v[off]), "a difference that is not a rounding tie"
    assert q.float().abs().flatten(1).amax(1)[amax > 0].eq(448).all()  # each sample uses the full range
    deq = q.float() * s.view(bshape)
    assert ((deq - x.float()).abs() <= x.float().abs() / 16 + 1e-30).all()  # e4m3: 3 mantissa bits


def test_refuses_what_it_cannot_take():
    x = torch.randn(2, 4, 6, 6)
    with pytest.raises(ValueError, match="dense"):
        AQ.quantize_e4m3_per_sample(x[:, :, ::2])
    with pytest.raises(ValueError, match="dense"):
        AQ.quantize_e4m3_per_sample(x.permute(1, 0, 2, 3))  # batch not outermost
    with pytest.raises(ValueError, match="float"):
        AQ.quantize_e4m3_per_sample(torch.ones(2, 3, dtype=torch.int32))
    q, s = AQ.quantize_e4m3_per_sample(torch.empty(0, 4, 2, 2))
    assert q.shape == (0, 4, 2, 2) and s.shape == (0,)


@pytest.mark.gpu
def test_gpu_matches_torch():
    x = torch.randn(2, 256, 64, 64, device="cuda").to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    q, s = AQ.quantize_e4m3_per_sample(x)
    amax = x.float().flatten(1).abs().amax(1)
    torch.testing.assert_close(s, amax / 448.0, rtol=1e-6, atol=0)
    ref = (x.float() * (448.0 / amax).view(-1, 1, 1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    off = q.float() != ref  # the kernel's fp32 division may differ from torch's by an ulp: a rare one-step change
    assert off.float().mean() < 1e-4
    assert ((q.float() - ref).abs()[off] <= ref.abs()[off] / 8 + 2 ** -9).all()
    q8, s8 = AQ.quantize_int8_per_sample(x)  # symmetric int8: round to nearest, scale amax / 127
    torch.testing.assert_close(s8, amax / 127.0, rtol=1e-6, atol=0)
    assert ((q8.float() - x.float() * (127.0 / amax).view(-1, 1, 1, 1)).abs() <= 0.5 + 1e-4).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_scales_values_and_layout(dtype):
    """Symmetric int8 (the upsamplers' int8 inputs): scale amax / 127, codes round(x / scale) in [-127, 127] (ties
    aside), the layout kept, zero stays zero, an all-zero sample quantizes to zeros."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 8, 5, 7, generator=g) * torch.tensor([0.01, 3.0, 200.0]).view(-1, 1, 1, 1)).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    x[2].zero_()
    x[0, 0, 0, 0] = 0.0
    q, s = AQ.quantize_int8_per_sample(x, block=64)
    amax = x.float().flatten(1).abs().amax(1)
    torch.testing.assert_close(s, amax.clamp_min(1e-12) / 127.0, rtol=0, atol=0)
    assert q.dtype == torch.int8 and q.stride() == x.stride()
    v = x.float() * (127.0 / amax.clamp_min(1e-12)).view(-1, 1, 1, 1)
    assert ((q.float() - v).abs() <= 0.5 + 1e-4).all()
    assert q[0, 0, 0, 0] == 0 and not q[2].any()
    assert q.abs().flatten(1).amax(1)[:2].eq(127).all()  # each nonzero sample uses the full range
    with pytest.raises(ValueError, match="quantize_int8_per_sample: x must be dense"):
        AQ.quantize_int8_per_sample(x[:, :, ::2])
