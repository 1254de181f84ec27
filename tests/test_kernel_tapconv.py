"""kernels/tapconv: conv_out (few output channels) as a norm+GEMM kernel writing planar per-tap partial sums, then a
tap-sum kernel, against the conv over the [history | rms_norm_silu(x)] stream in torch. CPU runs use the Triton
interpreter; "cuda" repeats the checks on a GPU."""

import pytest
import torch

from vaeopt.kernels import tapconv as T
from vaeopt.kernels import triton_available
from vaeopt.kernels.rms_norm_silu import rms_norm_silu_reference

from kernel_refs import conv_taps_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _need(device):
    ok, why = triton_available(device)
    if not ok:
        pytest.skip(why)


def _case(device, dtype, N, C, k, H, W, co, hist, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, k, H, W, generator=g).to(device, dtype).contiguous(memory_format=torch.channels_last_3d)
    gamma = (1 + 0.2 * torch.randn(C, generator=g)).to(device)
    beta = (0.1 * torch.randn(C, generator=g)).to(device)
    xb = (0.1 * torch.randn(C, generator=g)).to(device)
    kt = hist + 1
    w = (torch.randn(co, C, kt, 3, 3, generator=g) / (9 * kt * C) ** 0.5).to(device, dtype)
    bias = (0.1 * torch.randn(co, generator=g)).to(device, dtype)
    hx = torch.randn(N, C, hist, H, W, generator=g).to(device, dtype)
    return x, gamma, beta, xb, w, bias, hx


def _run(x, gamma, beta, xb, w, bias, hx, ydtype=None, impl="triton"):
    N, C, k, H, W = x.shape
    co, kt = w.shape[0], w.shape[2]
    hist = kt - 1
    nt = co * kt * 9
    wt = T.tap_weights(w)
    y = torch.empty(N, nt, hist + k, H, W, dtype=ydtype or x.dtype, device=x.device)
    # history frames: their Y is the GEMM of the (already normalized) history input, as the decoder caches it
    y[:, :, :hist] = torch.einsum("nctHW,cj->njtHW", hx.float(), wt[:C, :nt].float()).to(y.dtype)
    T.rms_norm_taps(x, gamma, beta, 1e-12, C**0.5, wt, nt, y, hist, x_bias=xb, impl=impl)
    out = torch.empty(N, co, k, H, W, dtype=x.dtype, device=x.device).contiguous(memory_format=torch.channels_last_3d)
    assert T.tap_sum(y, co, (kt, 3, 3), bias, out, impl=impl) is out
    return out


def _reference(x, gamma, beta, xb, w, bias, hx):
    a = rms_norm_silu_reference(x.float(), gamma.float(), beta.float(), 1e-12, True, x_bias=xb.float()).to(x.dtype)
    return conv_taps_reference(torch.cat([hx, a], 2).double(), w.double(), bias.double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 96, 3, 6, 13, 3, 2), (2, 20, 1, 5, 7, 3, 2), (1, 16, 4, 3, 33, 4, 2),
                                   (1, 24, 2, 4, 9, 3, 0)],
                         ids=["wan-head", "batch2-k1", "co4-wide", "2d-no-history"])
def test_matches_the_conv_fp32(device, shape):
    _need(device)
    N, C, k, H, W, co, hist = shape
    args = _case(device, torch.float32, N, C, k, H, W, co, hist)
    out = _run(*args)
    ref = _reference(*args)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    # the torch version (CPU decodes) computes the same
    torch.testing.assert_close(_run(*args, impl="torch"), out, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_error_like_the_conv(device):
    """bf16: the per-tap partial sums are rounded once each; the error stays of the size of the plain bf16 path's
    (rms_norm_silu + conv in bf16) against the same fp64 reference."""
    _need(device)
    import importlib

    rms = importlib.import_module("vaeopt.kernels.rms_norm_silu")
    args = _case(device, torch.bfloat16, 1, 96, 3, 6, 13, 3, 2, seed=1)
    out = _run(*args).double()
    x, gamma, beta, xb, w, bias, hx = args
    a = rms.rms_norm_silu(x, gamma, beta, 1e-12, True, x_bias=xb)  # the conv input both paths round the same way
    stream = torch.cat([hx, a], 2)
    ref = conv_taps_reference(stream.double(), w.double(), bias.double())
    plain = conv_taps_reference(stream.float(), w.float(), bias.float()).to(x.dtype).double()
    err = ((out - ref).norm() / ref.norm()).item()
    err_plain = ((plain - ref).norm() / ref.norm()).item()
    assert err < max(3 * err_plain, 4e-3), (err, err_plain)


def test_tap_weights_layout_and_errors():
    w = torch.arange(3 * 4 * 3 * 3 * 3, dtype=torch.float32).reshape(3, 4, 3, 3, 3)
    m = T.tap_weights(w, 16)
    assert m.shape == (16, 96)  # 81 columns padded to a multiple of 32, rows to the kernel's channel block
    assert m[2, ((1 * 3 + 2) * 3 + 0) * 3 + 1] == w[1, 2, 1, 2, 0]  # column ((dt*3 + dh)*3 + dw)*Co + o
    assert (m[4:] == 0).all() and (m[:, 81:] == 0).all()
    assert T.tap_weights(w).shape == (16, 96) and T.block_c(96) == 128  # default rows: the kernel's channel block
    assert T.fits(3) and T.fits(4) and not T.fits(12)  # Wan 2.1's head takes the path, Wan 2.2's does not
    x = torch.zeros(1, 4, 2, 3, 3).contiguous(memory_format=torch.channels_last_3d)
    y = torch.zeros(1, 81, 3, 3, 3)
    with pytest.raises(ValueError, match="y"):
        T.rms_norm_taps(x, torch.ones(4), None, 1e-12, 2.0, m, 81, y, 2)  # y has 3 frames, needs 2 + 2
    with pytest.raises(ValueError, match="channels-last"):
        T.rms_norm_taps(x.contiguous(), torch.ones(4), None, 1e-12, 2.0, m, 81, torch.zeros(1, 81, 4, 3, 3), 2)
    with pytest.raises(ValueError, match="impl"):
        T.tap_sum(torch.zeros(1, 81, 4, 3, 3), 3, (3, 3, 3), None, torch.zeros(1, 3, 2, 3, 3), impl="cuda")
    with pytest.raises(ValueError, match="tap_sum"):
        T.tap_sum(torch.zeros(1, 81, 4, 3, 3), 3, (3, 3, 3), None, torch.zeros(1, 3, 3, 3, 3))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_residual_folded_equals_the_materialized_block_output(impl):
    """rms_norm_taps(residual=...) normalizes the last block's output (r + rb) + (h + b) without storing it: the
    partial sums equal those of bias_residual followed by the plain call, bit for bit (bf16)."""
    _need("cpu")
    from vaeopt.kernels.epilogue import bias_residual

    N, C, k, H, W, co, hist = 1, 96, 2, 4, 9, 3, 2
    h, gamma, beta, b, w, _, _ = _case("cpu", torch.bfloat16, N, C, k, H, W, co, hist, seed=3)
    r = torch.randn(N, C, k, H, W, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    r = r.contiguous(memory_format=torch.channels_last_3d)
    rb = 0.1 * torch.randn(C, generator=torch.Generator().manual_seed(5))
    wt, nt = T.tap_weights(w), co * 27

    def planar(x, **kw):
        y = torch.zeros(N, nt, hist + k, H, W, dtype=torch.bfloat16)
        T.rms_norm_taps(x, gamma, beta, 1e-12, C**0.5, wt, nt, y, hist, impl=impl, **kw)
        return y

    if impl == "triton":  # the stored block output, as the epilogue kernel writes it
        u = bias_residual(h, b.to(h.dtype), r, residual_bias=rb)
    else:  # torch rounds to bf16 to nearest even (the CPU interpreter's kernels truncate)
        u = ((r.float() + rb.view(1, C, 1, 1, 1)) + (h.float() + b.to(h.dtype).float().view(1, C, 1, 1, 1))).to(h.dtype)
    assert torch.equal(planar(h, x_bias=b.to(h.dtype), residual=r, residual_bias=rb), planar(u))
    with pytest.raises(ValueError, match="residual"):
        planar(h, residual=r.contiguous())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_image_head_group_norm_taps(device, dtype):
    """An image decoder's head (GroupNorm(32) + SiLU + 3x3 conv_out to 3 channels, padding 1) as group_norm_taps
    with the statistics of group_norm_partials / group_norm_finalize, then the tap sum (no history): equal to the
    torch head in fp32 (to 2e-5), of the error size of the bf16 torch head in bf16; batch 2, odd H/W."""
    _need(device)
    import torch.nn.functional as F

    from vaeopt.kernels.group_norm_silu import group_norm_finalize, group_norm_partials

    g = torch.Generator().manual_seed(7)
    N, C, H, W, co = 2, 64, 9, 14, 3
    x = (torch.randn(N, C, H, W, generator=g) * 2 + 0.5).to(device, dtype).contiguous(memory_format=torch.channels_last)
    gw, gb = (1 + 0.3 * torch.randn(C, generator=g)).to(device), (0.2 * torch.randn(C, generator=g)).to(device)
    w = (torch.randn(co, C, 3, 3, generator=g) / (9 * C) ** 0.5).to(device, dtype)
    bias = (0.1 * torch.randn(co, generator=g)).to(device, dtype)
    mean, scale = group_norm_finalize(group_norm_partials(x, 32), 32, C, gw, 1e-6)
    wt, nt = T.tap_weights(w), co * 9
    outs = {}
    for impl in ("triton", "torch"):
        y = torch.empty(N, nt, 1, H, W, dtype=dtype, device=device)
        T.group_norm_taps(x, mean, scale, gb, wt, nt, y, impl=impl)
        out = torch.empty(N, co, H, W, dtype=dtype, device=device).contiguous(memory_format=torch.channels_last)
        T.tap_sum(y, co, (1, 3, 3), bias, out.unsqueeze(2), impl=impl)
        outs[impl] = out
    ref = F.conv2d(F.silu(F.group_norm(x.double(), 32, gw.double(), gb.double(), 1e-6)), w.double(), bias.double(),
                   padding=1)
    if dtype == torch.float32:
        torch.testing.assert_close(outs["triton"].double(), ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(outs["torch"], outs["triton"], atol=2e-5, rtol=1e-5)
    else:
        plain = F.conv2d(F.silu(F.group_norm(x, 32, gw.to(dtype), gb.to(dtype), 1e-6)), w, bias, padding=1).double()
        e_plain = ((plain - ref).norm() / ref.norm()).item()
        for impl, out in outs.items():
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < max(3 * e_plain, 4e-3), (impl, err, e_plain)
    with pytest.raises(ValueError, match="channels-last"):
        T.group_norm_taps(x.contiguous(), mean, scale, gb, wt, nt, torch.empty(N, nt, 1, H, W, dtype=dtype,
                                                                            device=device))


def test_silu_mode_asked_per_norm(monkeypatch):
    """The norm + tap GEMM kernel asks common.silu_mode for its SiLU: as a Wan RMS kernel for the RMS head
    (mode 3 on CUDA for 16-bit) and as a GroupNorm kernel for the image head (exact)."""
    _need("cpu")
    from vaeopt.kernels.group_norm_silu import group_norm_finalize, group_norm_partials

    asked = []
    real = T.silu_mode
    monkeypatch.setattr(T, "silu_mode",
                        lambda dt, dev, wan_rms=False: asked.append(wan_rms) or real(dt, dev, wan_rms))
    x, gamma, beta, xb, w, bias, hx = _case("cpu", torch.bfloat16, 1, 16, 1, 3, 5, 3, 2)
    _run(x, gamma, beta, xb, w, bias, hx)
    xi = x[:, :, 0].contiguous(memory_format=torch.channels_last)
    mean, scale = group_norm_finalize(group_norm_partials(xi, 8), 8, 16, gamma, 1e-6)
    wt = T.tap_weights(w[:, :, :1])
    T.group_norm_taps(xi, mean, scale, beta, wt, 27, torch.empty(1, 27, 1, 3, 5, dtype=torch.bfloat16),
                      impl="triton")
    assert asked == [True, False]
