"""bias_residual / upsample_nearest2x / softmax_rows kernels vs torch: layouts, residual strides, scale, dtypes,
odd sizes, fused 2x nearest upsample; chunked attention vs SDPA.

CPU: the Triton interpreter (TRITON_INTERPRET=1 from conftest), small shapes. "cuda" copies run with -m gpu.
"""

import pytest
import torch
import torch.nn.functional as F

from vaeopt.kernels import triton_available

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _need(device):
    ok, why = triton_available(device)
    if not ok:
        pytest.skip(why)


def _cl(x):
    return x.movedim(1, -1).contiguous().movedim(-1, 1)


def _lay(x, layout):
    return _cl(x) if layout == "cl" else x.contiguous()


def _same_format(y, x):
    return [st for st, n in zip(y.stride(), y.shape) if n > 1] == [st for st, n in zip(x.stride(), x.shape) if n > 1]


def _ref32(h, bias, residual, scale, up, rb):
    """diffusers' association in fp32 from the (possibly rounded) inputs: ((r + rb) + (h + b)) / scale."""
    sh = (1, -1) + (1,) * (h.dim() - 2)
    y = h.float() + (0 if bias is None else bias.float().reshape(sh))
    if residual is not None:
        y = (residual.float() + (0 if rb is None else rb.float().reshape(sh))) + y
    y = y / scale if scale != 1.0 else y
    return F.interpolate(y, scale_factor=2.0, mode="nearest") if up else y


def _data(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(*shape), mk(C), mk(*shape), mk(C)


SHAPES = [(2, 6, 5, 7), (1, 16, 8, 8), (1, 3, 1, 9)]  # odd H/W and C; batch 2; a 1-row image


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("up", [False, True], ids=["plain", "up2x"])
@pytest.mark.parametrize("layout,rlayout", [("cf", "cf"), ("cl", "cl"), ("cf", "cl"), ("cl", "cf")])
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_residual_fp32(device, up, layout, rlayout, shape):
    _need(device)
    from vaeopt.kernels.epilogue import bias_residual

    h, b, r, rb = _data(shape, torch.float32, device, seed=sum(shape))
    h, r = _lay(h, layout), _lay(r, rlayout)
    for scale in (1.0, 0.7):
        y = bias_residual(h, b, r, scale, up, residual_bias=rb, tile=64)  # small tile: many programs, tails
        ref = _ref32(h, b, r, scale, up, rb)
        assert y.shape == ref.shape and y.dtype == h.dtype
        assert _same_format(y, _lay(ref, layout)), "output keeps h's layout"
        torch.testing.assert_close(y, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("up", [False, True], ids=["plain", "up2x"])
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_residual_low_precision(device, up, layout, dtype):
    """One rounding of the fp32 result (torch rounds after every op): within one output ulp of the fp32 result, and
    never worse than torch's own composition (+ the interpreter's truncating casts)."""
    _need(device)
    from kernel_refs import bias_residual_reference
    from vaeopt.kernels.epilogue import bias_residual

    h, b, r, rb = _data((2, 12, 5, 6), dtype, device, seed=3)
    h, r = _lay(h, layout), _lay(r, layout)
    y = bias_residual(h, b, r, 1.0, up, residual_bias=rb)
    ref = _ref32(h, b, r, 1.0, up, rb)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(y.float(), ref, atol=ulp, rtol=ulp)
    err = (y.float() - ref).abs().max().item()
    err_torch = (bias_residual_reference(h, b, r, 1.0, up, rb).float() - ref).abs().max().item()
    assert err <= err_torch + ulp * ref.abs().max().item(), (err, err_torch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_optional_operands_and_5d(device, layout):
    _need(device)
    from vaeopt.kernels.epilogue import bias_residual

    h, b, r, rb = _data((2, 5, 3, 4), torch.float32, device, seed=5)
    h, r = _lay(h, layout), _lay(r, layout)
    torch.testing.assert_close(bias_residual(h, b), _ref32(h, b, None, 1.0, False, None), atol=1e-6, rtol=0)
    torch.testing.assert_close(bias_residual(h, None, r), _ref32(h, None, r, 1.0, False, None), atol=1e-6, rtol=0)
    torch.testing.assert_close(bias_residual(h, None, r, 2.0, True), _ref32(h, None, r, 2.0, True, None),
                               atol=1e-6, rtol=0)
    # 5-D (video activations): plain epilogue, NCDHW and NDHWC
    h5, b5, r5, _ = _data((1, 6, 2, 3, 5), torch.float32, device, seed=6)
    if layout == "cl":
        h5, r5 = _cl(h5), _cl(r5)
    y = bias_residual(h5, b5, r5, 1.0)
    assert _same_format(y, h5)
    torch.testing.assert_close(y, _ref32(h5, b5, r5, 1.0, False, None), atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_odd_residual_strides_and_errors(device):
    _need(device)
    from vaeopt.kernels.epilogue import bias_residual

    h, b, _, _ = _data((2, 4, 5, 6), torch.float32, device, seed=7)
    big = torch.randn(3, 4, 5, 12, device=device)
    r = big[1:, :, :, ::2]  # batch offset + every other column: spatial dims do not merge
    for up in (False, True):
        torch.testing.assert_close(bias_residual(h, b, r, 1.0, up), _ref32(h, b, r, 1.0, up, None), atol=1e-6, rtol=0)
    hs = torch.randn(2, 8, 5, 6, device=device)[:, ::2]  # channel-sliced h: relaid once, still right
    torch.testing.assert_close(bias_residual(hs, b, r), _ref32(hs, b, r, 1.0, False, None), atol=1e-6, rtol=0)
    with pytest.raises(ValueError):
        bias_residual(h, b[:3])
    with pytest.raises(ValueError):
        bias_residual(h, b, r[:, :, :4])
    with pytest.raises(ValueError):
        bias_residual(torch.randn(1, 4, 2, 3, 3, device=device), upsample2x=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upsample_nearest2x_bitwise(device, layout, dtype):
    _need(device)
    from vaeopt.kernels.epilogue import upsample_nearest2x

    x = _lay(torch.randn(2, 5, 3, 7, device=device).to(dtype), layout)
    ref = F.interpolate(x, scale_factor=2.0, mode="nearest")
    y = upsample_nearest2x(x)
    assert torch.equal(y, ref) and _same_format(y, _lay(ref, layout))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("L,block", [(37, None), (37, 8), (300, 64)])  # one pass; online two-pass with tails
def test_softmax_rows(device, L, block):
    _need(device)
    from vaeopt.kernels.epilogue import softmax_rows

    s = torch.randn(2, 5, L, device=device) * 6
    ref = torch.softmax(s.double() * 0.3, dim=-1)
    p = softmax_rows(s, 0.3, torch.float32, block=block)
    torch.testing.assert_close(p.double(), ref, atol=1e-6, rtol=1e-5)
    p16 = softmax_rows(s, 0.3, torch.bfloat16, block=block)
    assert p16.dtype == torch.bfloat16
    torch.testing.assert_close(p16.double(), ref, atol=2**-8, rtol=2**-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [None, 7])
def test_chunked_attention_matches_sdpa(device, chunk):
    _need(device)
    from vaeopt.stages.fused_epilogues import chunked_attention

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 1, 24, 40, generator=g).to(device) * 2 for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    out = chunked_attention(q, k, v, chunk=chunk, max_score_bytes=1 << 30)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    out = chunked_attention(q, k, v, max_score_bytes=2 * 24 * 4 * 5)  # budget -> 5 queries per chunk
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("L,block", [(37, None), (300, 64)])
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16])
def test_softmax_rows_unnormalized_e4m3(device, L, block, sdtype):
    """The fp8 attention's softmax: P = exp(s * scale - row max) * 448 written in e4m3 (each row's largest entry is
    exactly 448), and 1 / (448 * row sum) per row, so P * row_scale is the softmax; bf16 scores are read as they
    are."""
    _need(device)
    from vaeopt.kernels.epilogue import softmax_rows

    e4m3 = torch.float8_e4m3fn
    s = (torch.randn(6, L, generator=torch.Generator().manual_seed(3)) * 6).to(device, sdtype)
    p = torch.empty(6, L, device=device, dtype=e4m3)
    rs = torch.empty(6, 1, device=device)
    softmax_rows(s, 0.3, e4m3, out=p, row_scale=rs, pscale=448.0, block=block)
    x = s.double() * 0.3
    e = torch.exp(x - x.amax(-1, keepdim=True))
    assert torch.equal(p.float().amax(-1), torch.full((6,), 448.0, device=device))
    # the cast: round to nearest on the e4m3 grid (ties may go either way: one grid step, 2^-3 relative, at most)
    torch.testing.assert_close(p.double(), e * 448, rtol=2**-4, atol=2**-9)
    assert (p.double() - (e * 448).to(e4m3).double()).abs().gt(0).float().mean() < 0.01
    torch.testing.assert_close(rs.double().view(-1), 1 / (448 * e.sum(-1)), rtol=1e-5, atol=0)
    soft = p.double() * rs.double()
    torch.testing.assert_close(soft, torch.softmax(x, -1), rtol=2**-4, atol=1e-6)
    with pytest.raises(ValueError, match="row_scale"):
        softmax_rows(s, 0.3, e4m3, out=p, row_scale=torch.empty(5, device=device), pscale=448.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("L", [256, 250])  # 250 keys: padded to 256 for cuBLASLt (CUDA)
def test_fp8_attention_close_to_exact(device, L):
    """fp8_attention (CUDA: torch._scaled_mm; CPU: the fp32 emulation of the same roundings) against exact
    attention: lossy at e4m3's precision, and not more. With keys of one coherent direction (as a trained or
    random-weight VAE's mid-block has; E44 measured 2.6e-3 relative RMS on a real sdxl decode's q/k/v), the error is
    well under e4m3's 2^-4 step."""
    if device == "cuda":
        _need(device)
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("no FP8 tensor cores")
    from vaeopt.stages.fused_epilogues import fp8_attention

    g = torch.Generator().manual_seed(5)
    d = 64
    base = torch.randn(d, generator=g)
    q, k, v = ((torch.randn(2, 1, L, d, generator=g) * 0.5 + base).to(device) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    for chunk in (None, 48):
        out = fp8_attention(q, k, v, chunk=chunk)
        assert out.shape == ref.shape and out.dtype == q.dtype
        rel = ((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
        assert 1e-4 < rel < 2e-2, rel  # really quantized, and close
    if device == "cuda":  # the real kernels agree with the emulation of their roundings
        emu = fp8_attention(q.cpu(), k.cpu(), v.cpu())
        rel = ((out.cpu().double() - emu.double()).pow(2).mean().sqrt() / emu.double().pow(2).mean().sqrt()).item()
        assert rel < 5e-3, rel


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_gpu_real_shapes_bf16(layout):
    _need("cuda")
    from vaeopt.kernels.epilogue import bias_residual

    h, b, r, rb = _data((1, 512, 128, 128), torch.bfloat16, "cuda", seed=12)
    h, r = _lay(h, layout), _lay(r, layout)
    for up in (False, True):
        y = bias_residual(h, b, r, 1.0, up, residual_bias=rb)
        torch.testing.assert_close(y.float(), _ref32(h, b, r, 1.0, up, rb), atol=2**-7, rtol=2**-7)


@pytest.mark.gpu
def test_gpu_chunked_attention_bf16():
    _need("cuda")
    from vaeopt.stages.fused_epilogues import chunked_attention

    q, k, v = (torch.randn(1, 1, 4096, 512, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = (chunked_attention(q, k, v, chunk=1024).float() - ref).abs().max().item()
    err_sdpa = (F.scaled_dot_product_attention(q, k, v).float() - ref).abs().max().item()
    assert err <= 2 * err_sdpa + 1e-2, (err, err_sdpa)


# --- the residual epilogue that also takes the next GroupNorm's statistics ----------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rlayout", ["cl", "cf"])
@pytest.mark.parametrize("shape,groups", [((2, 32, 9, 11), 8), ((1, 24, 6, 5), 4), ((1, 12, 3, 3), 3)])
def test_bias_residual_stats_groups(device, dtype, rlayout, shape, groups, monkeypatch):
    """The output is bitwise the plain epilogue's; the noted partials are the stats kernel's moments of that output
    (exact merge in float64), their max/min bounds hold, and the norm that reads the noted partials gives the plain
    norm's result. Small programs (several chunks, a ragged last one) via the interpreter's one-program launch knobs."""
    _need(device)
    import importlib

    from vaeopt.kernels import epilogue

    gn = importlib.import_module("vaeopt.kernels.group_norm_silu")

    h, b, r, rb = _data(shape, dtype, device, 11)
    h, r = _cl(h), _lay(r, rlayout)
    r = r * 3 + 5  # a mean far from 0: the shifted sums must not cancel
    monkeypatch.setattr(gn, "STATS_MIN_NUMEL_CUDA", 0)  # small tensors take the stats epilogue on a GPU too
    # several chunks per sample, a ragged last one: small launches (interpreter: the stats defaults; GPU: its own)
    monkeypatch.setattr(gn, "_stats_cl_defaults", lambda C, dev: (4 * 32, 4, 3, 2))
    monkeypatch.setattr(epilogue, "_epi_stats_launch", lambda C, dev: (4 * 32, 4, 1, 2))
    plain = epilogue.bias_residual(h, b, r, 1.5, residual_bias=rb)
    y = epilogue.bias_residual(h, b, r, 1.5, residual_bias=rb, stats_groups=groups)
    assert torch.equal(y, plain) and _same_format(y, plain)
    part = gn.noted_partials(y, groups)
    assert part is not None and part.shape[0] == 5 and part.shape[2] > 1
    n, mean, m2 = gn.merge_partials(part[:3])
    N, C = shape[:2]
    ref = y.double().reshape(N, groups, -1)  # (n, g) rows: the group's channels, all pixels (logical NCHW order)
    assert torch.equal(n.cpu(), torch.full((N * groups,), float(ref.shape[-1]), dtype=torch.float64))
    torch.testing.assert_close(mean.cpu(), ref.mean(-1).reshape(-1).cpu(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m2.cpu(), (ref.var(-1, unbiased=False) * ref.shape[-1]).reshape(-1).cpu(),
                               rtol=1e-5, atol=1e-5)
    hi = part[3].max(dim=1).values.double().cpu()
    lo = part[4].min(dim=1).values.double().cpu()
    assert (hi >= ref.amax(-1).reshape(-1).cpu() - 1e-6).all() and (lo <= ref.amin(-1).reshape(-1).cpu() + 1e-6).all()
    w = torch.randn(C, device=device)
    bb = torch.randn(C, device=device)
    got = gn.group_norm_silu(y, groups, w, bb)
    want = gn.group_norm_silu(y.clone(), groups, w, bb)  # a copy carries no note: its own stats pass
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # the e4m3 norm takes the max/min bounds from the note too
    q, sc = gn.group_norm_silu_e4m3(y, groups, w, bb)
    deq = q.float() * sc.reshape(-1, 1, 1, 1)
    assert (deq - want.float()).abs().max() <= 0.07 * want.float().abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_noted_partials_are_dropped_when_stale_or_elsewhere(device, monkeypatch):
    """The note holds only for the very data: a view that sees each sample the same way (attention's (N, C, H*W))
    uses it; an in-place write, another group count, a slice, or a channels-first result never do. An
    upsampling epilogue writes no note."""
    _need(device)
    import importlib

    from vaeopt.kernels import epilogue

    gn = importlib.import_module("vaeopt.kernels.group_norm_silu")

    monkeypatch.setattr(gn, "STATS_MIN_NUMEL_CUDA", 0)
    calls = []
    real = gn._launch_stats
    monkeypatch.setattr(gn, "_launch_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    h, b, r, _ = _data((1, 16, 4, 6), torch.float32, device, 3)
    y = epilogue.bias_residual(_cl(h), b, _cl(r), stats_groups=4)
    flat = y.flatten(2)  # (N, C, H*W) view, still a per-sample [S, C] block
    assert gn.noted_partials(flat, 4) is not None
    assert gn.noted_partials(y, 2) is None  # another group count
    assert gn.noted_partials(y[:, :, 1:], 4) is None  # a slice sees other data
    gn.group_norm_silu(y, 4, None, None)
    assert calls == []  # the noted partials were used
    y.mul_(2.0)  # written since: the note is stale
    assert gn.noted_partials(y, 4) is None
    torch.testing.assert_close(gn.group_norm_silu(y, 4, None, None), gn.group_norm_silu_reference(y, 4, None, None),
                               rtol=1e-5, atol=1e-5)
    assert len(calls) == 1
    assert gn.noted_partials(epilogue.bias_residual(h.contiguous(), b, r, stats_groups=4), 4) is None  # NCHW
    assert gn.noted_partials(epilogue.bias_residual(_cl(h), b, _cl(r), upsample2x=True, stats_groups=4), 4) is None
    y = epilogue.bias_residual(_cl(h), b, _cl(r), stats_groups=4)
    assert gn.noted_partials(y[:, :, :2], 4) is None  # same data pointer, fewer rows
    epilogue.bias_residual(_cl(r), out=y)  # a kernel writing into it through out= drops the note
    assert gn.noted_partials(y, 4) is None
    with torch.inference_mode():  # no version counter: the note holds while the tensor does, and out= still drops it
        hi, bi, ri = h.clone(), b.clone(), r.clone()
        yi = epilogue.bias_residual(_cl(hi), bi, _cl(ri), stats_groups=4)
        assert gn.noted_partials(yi, 4) is not None
        epilogue.bias_residual(_cl(ri), out=yi)
        assert gn.noted_partials(yi, 4) is None
    one = epilogue.bias_residual(_cl(h[:, :1]), stats_groups=1)  # C == 1 reads as channels-first: no note, so the
    assert gn.noted_partials(one, 1) is None  # e4m3 norm (channels-last only) refuses it as before
    with pytest.raises(ValueError, match="channels-last"):
        gn.group_norm_silu_e4m3(one, 1, None, None)
