"""The Triton implicit-GEMM conv (vaeopt/kernels/conv.py) against torch's conv, under the interpreter on CPU
(tests/conftest.py sets TRITON_INTERPRET=1) and, marked gpu, against cuDNN on the GPU."""

import pytest
import torch

from vaeopt.kernels import triton_available

from kernel_refs import conv_reference  # noqa: E402

K = pytest.importorskip("vaeopt.kernels.conv")


@pytest.fixture(autouse=True)
def _backend(request):
    dev = "cuda" if "gpu" in request.keywords else "cpu"
    ok, why = triton_available(dev)
    if not ok:
        pytest.skip(why)


def _case(N, C, Co, T, H, W, kt, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if kt is None:
        x = torch.randn(N, C, H, W, generator=g).to(memory_format=torch.channels_last)
        w = torch.randn(Co, C, 3, 3, generator=g) / (9 * C) ** 0.5
    else:
        x = torch.randn(N, C, T + kt - 1, H, W, generator=g).to(memory_format=torch.channels_last_3d)
        w = torch.randn(Co, C, kt, 3, 3, generator=g) / (9 * kt * C) ** 0.5
    b = torch.randn(Co, generator=g)
    return x.to(device, dtype), w.to(device, dtype), b.to(device)


def _rel(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("shape", [
    (1, 8, 8, 2, 5, 7, 3),  # causal Conv3d: 2 output frames from 2 + 2 history
    (2, 16, 24, 3, 6, 5, 3),  # batch 2: each sample's history frames are skipped correctly
    (1, 16, 24, 1, 9, 11, None),  # Conv2d
    (3, 32, 48, 1, 4, 4, None),  # Conv2d, batch = frames
    (1, 8, 16, 4, 3, 3, 1),  # kt = 1 on 5D input
])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_torch_fp32(shape, bias):
    x, w, b = _case(*shape)
    b = b if bias else None
    y = K.conv_igemm(x, K.pack_weight(w), b, (1, 1))
    ref = conv_reference(x, w, b, (1, 1))
    assert y.shape == ref.shape
    mf = torch.channels_last if x.ndim == 4 else torch.channels_last_3d
    assert y.is_contiguous(memory_format=mf)
    assert _rel(y, ref) < 1e-5


@pytest.mark.parametrize("cfg", [
    K.Config(32, 64, 32, 32, 4, 1),  # Cout 96 as 64 + 32 accumulators
    K.Config(32, 64, 32, 64, 4, 1, 32),  # and Cin 96 as 64 + 32 per tap
    K.Config(64, 128, 0, 64, 4, 1, 32),  # one masked 128-wide accumulator
    K.Config(64, 32, 0, 32, 4, 1),  # three N programs
])
@pytest.mark.parametrize("kmajor", [False, True])
def test_tile_splits(cfg, kmajor):
    x, w, b = _case(1, 96, 96, 2, 5, 9, 3)
    y = K.conv_igemm(x, K.pack_weight(w, kmajor=kmajor), b, (1, 1), config=cfg)
    assert _rel(y, conv_reference(x, w, b, (1, 1))) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    x, w, b = _case(1, 32, 40, 2, 6, 6, 3, dtype=dtype)
    y = K.conv_igemm(x, K.pack_weight(w), b, (1, 1))
    assert y.dtype == dtype
    # the reference sees the same rounded inputs; what differs is fp32 accumulation order and the output rounding
    assert _rel(y, conv_reference(x, w, b, (1, 1))) < 1e-2


def test_fp8():
    x, w, b = _case(1, 64, 32, 2, 6, 6, 3)
    pw = K.pack_weight(w, K.E4M3)
    assert pw.w.dtype == K.E4M3 and pw.kmajor and pw.scale.shape == (32,)
    xq, s = K.quantize_activation(x)
    assert xq.dtype == K.E4M3 and xq.is_contiguous(memory_format=torch.channels_last_3d)
    y = K.conv_igemm(xq, pw, b, (1, 1), x_scale=s)
    assert y.dtype == torch.bfloat16
    ref = conv_reference(x, w, b, (1, 1))
    err = _rel(y, ref)
    assert 1e-3 < err < 0.08  # e4m3 has 3 mantissa bits: a few % of the range, not exact, not garbage
    # per-channel weight scales: a channel 1000x larger does not swamp the others' precision
    w2 = w.clone()
    w2[0] *= 1000
    y2 = K.conv_igemm(xq, K.pack_weight(w2, K.E4M3), None, (1, 1), x_scale=s)
    ref2 = conv_reference(x, w2, None, (1, 1))
    assert _rel(y2[:, 1:], ref2[:, 1:]) < 0.08


def test_bad_inputs():
    x, w, b = _case(1, 8, 8, 2, 5, 7, 3)
    pw = K.pack_weight(w)
    with pytest.raises(ValueError, match="channels_last"):
        K.conv_igemm(x.contiguous(), pw, b, (1, 1))
    with pytest.raises(ValueError, match="channels"):
        K.conv_igemm(x[:, :4].contiguous(memory_format=torch.channels_last_3d), pw, b, (1, 1))
    with pytest.raises(ValueError, match="padding"):
        K.conv_igemm(x, pw, b, (0, 0))
    with pytest.raises(ValueError, match="frames"):
        K.conv_igemm(x[:, :, :2].contiguous(memory_format=torch.channels_last_3d), pw, b, (1, 1))
    with pytest.raises(ValueError, match="float8_e4m3fn weights need torch.float8_e4m3fn activations"):
        K.conv_igemm(x, K.pack_weight(w, K.E4M3), b, (1, 1))
    with pytest.raises(ValueError, match="splits"):
        K.conv_igemm(x, pw, b, (1, 1), config=K.Config(32, 8, 0, 4, 4, 1, 2))


def test_flops():
    x, w, _ = _case(1, 8, 16, 4, 3, 5, 3)
    assert K.flops(tuple(x.shape), K.pack_weight(w)) == 2 * 4 * 3 * 5 * 16 * 27 * 8


@pytest.mark.gpu
def test_gpu_matches_cudnn():
    for shape in [(1, 96, 96, 4, 60, 104, 3), (1, 192, 96, 1, 64, 64, None)]:
        x, w, b = _case(*shape, dtype=torch.bfloat16, device="cuda")
        y = K.conv_igemm(x, K.pack_weight(w), b, (1, 1))
        assert _rel(y, conv_reference(x, w, b, (1, 1))) < 1e-2


def test_fp8_per_sample_scale_tensor():
    """x_scale as a device tensor with one value per sample (what the GroupNorm kernel writes): each sample is scaled
    by its own value, equal to separate calls with python floats; a one-value tensor broadcasts."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 6, 5, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 16, 3, 3, generator=g) * 0.1
    b = torch.randn(32, generator=g)
    pw = K.pack_weight(w, K.E4M3)
    xq, _ = K.quantize_activation(x)
    s = torch.tensor([0.5, 3.0])
    y = K.conv_igemm(xq, pw, b, (1, 1), x_scale=s)
    for n in range(2):
        yn = K.conv_igemm(xq[n:n + 1].contiguous(memory_format=torch.channels_last), pw, b, (1, 1),
                          x_scale=float(s[n]))
        assert torch.allclose(y[n:n + 1].float(), yn.float(), rtol=1e-2, atol=1e-2)
    y1 = K.conv_igemm(xq, pw, b, (1, 1), x_scale=torch.tensor(0.5))
    assert torch.allclose(y1[:1].float(), y[:1].float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="x_scale"):
        K.conv_igemm(xq, pw, b, (1, 1), x_scale=torch.ones(3))
