"""group_norm_silu kernel vs torch (F.group_norm + F.silu) over reduced decoder shapes, odd shapes, layouts, dtypes.

On CPU the kernel runs in the Triton interpreter (TRITON_INTERPRET=1 from conftest): shapes stay small. The "cuda"
parametrization repeats every check on a GPU (pytest -m gpu).
"""

import pytest
import torch
import torch.nn.functional as F

from vaeopt.kernels import triton_available

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LOW = [torch.bfloat16, torch.float16]
# absolute error floors for the low-precision rule (about one output ulp at |y| ~ 2-4)
FLOOR = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}

# (shape, groups)
SHAPES = [
    ((1, 64, 16, 16), 32),  # SDXL mid/up layer (512 ch, 32 groups) scaled down: 2 channels per group
    ((1, 32, 24, 24), 8),  # high-res 128-ch layer scaled down
    ((2, 48, 7, 13), 16),  # batch 2; 3 channels per group (not a power of 2); prime H, W
    ((1, 96, 2, 6, 10), 32),  # video NCDHW (Wan/Hunyuan 96-ch level, 32 groups -> 3 channels per group)
    ((1, 40, 3, 5, 7), 8),  # 5-D, 5 channels per group, prime T/H/W
    ((3, 30, 11), 6),  # (B, C, L) as the attention processor calls group_norm; batch 3, prime L
    ((2, 24, 1, 1), 4),  # 1x1 spatial: each group holds just 6 values
]


def _need(device):
    ok, why = triton_available(device)
    if not ok:
        pytest.skip(why)


def _layout(x, layout):
    if layout == "cl":  # channels last, any rank: NHWC / NDHWC / (B, L, C) memory
        return x.movedim(1, -1).contiguous().movedim(-1, 1)
    return x.contiguous()


def _same_format(y, x):
    """Same memory layout (strides of size-1 dims are meaningless and ignored)."""
    return [st for st, n in zip(y.stride(), y.shape) if n > 1] == [st for st, n in zip(x.stride(), x.shape) if n > 1]


def _ref64(x, groups, w, b, eps=1e-6, silu=True):
    y = F.group_norm(x.double(), groups, None if w is None else w.double(), None if b is None else b.double(), eps)
    return F.silu(y) if silu else y


def _inputs(shape, dtype, device, seed=0, offset=0.5, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = (torch.randn(shape, generator=g) * spread + offset).to(device=device, dtype=dtype)
    w = (torch.rand(C, generator=g) + 0.5).to(device=device, dtype=dtype)
    b = (torch.randn(C, generator=g) * 0.5).to(device=device, dtype=dtype)
    return x, w, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("shape,groups", SHAPES)
def test_fp32_matches_torch(device, layout, shape, groups):
    _need(device)
    from vaeopt.kernels import group_norm_silu

    x, w, b = _inputs(shape, torch.float32, device)
    x = _layout(x, layout)
    y = group_norm_silu(x, groups, w, b, 1e-6)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert _same_format(y, x), "output must keep the input's memory format"
    ref = _ref64(x, groups, w, b)
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(y, F.silu(F.group_norm(x, groups, w, b, 1e-6)), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("shape,groups", SHAPES[:5])
def test_low_precision_within_2x_torch(device, dtype, layout, shape, groups):
    """bf16/fp16: the kernel's error vs an fp64 reference of the same (rounded) inputs must be at most twice torch's
    own low-precision GroupNorm+SiLU error, plus a small floor."""
    _need(device)
    from vaeopt.kernels import group_norm_silu

    x, w, b = _inputs(shape, dtype, device, seed=1)
    x = _layout(x, layout)
    y = group_norm_silu(x, groups, w, b, 1e-6)
    assert y.dtype == dtype and _same_format(y, x)
    ref = _ref64(x, groups, w, b)
    err = (y.double() - ref).abs().max().item()
    err_torch = (F.silu(F.group_norm(x, groups, w, b, 1e-6)).double() - ref).abs().max().item()
    assert err <= 2 * err_torch + FLOOR[dtype], (err, err_torch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_split_reduction_is_exact_and_cancellation_free(device, layout):
    """Tiny tiles + many programs: several chunks per group, several blocks per chunk, a multi-step finalize.
    Data with |mean| = 1000 * std: a naive E[x^2] - E[x]^2 in fp32 would lose the variance entirely."""
    _need(device)
    from vaeopt.kernels import group_norm_silu

    x, w, b = _inputs((2, 8, 6, 7), torch.float32, device, seed=2, offset=1000.0, spread=1.0)
    x = _layout(x, layout)
    y = group_norm_silu(x, 2, w, b, 1e-6, tile=32, target_programs=12, max_block_p=2)
    torch.testing.assert_close(y.double(), _ref64(x, 2, w, b), atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unroll", [2, 4])
def test_stats_row_blocks_per_iteration(device, unroll, monkeypatch):
    """The channels-last stats kernel loading several row blocks per loop iteration (its CUDA launch at C >= 256,
    experiments.md E24): exact sums with a ragged last block, partials shaped as group_norm_partials_shape says, and
    the e4m3 path's bounds still bound the output."""
    _need(device)
    import importlib

    gns = importlib.import_module("vaeopt.kernels.group_norm_silu")
    monkeypatch.setattr(gns, "_stats_cl_defaults", lambda C, dev: (64, 4, 3, unroll))
    x, w, b = _inputs((2, 16, 9, 11), torch.float32, device, seed=3, offset=100.0, spread=1.0)  # 99 rows: ragged
    x = _layout(x, "cl")
    y = gns.group_norm_silu(x, 4, w, b, 1e-6)
    torch.testing.assert_close(y.double(), _ref64(x, 4, w, b), atol=5e-4, rtol=1e-4)
    part = gns.group_norm_partials(x, 4)
    assert tuple(part.shape) == gns.group_norm_partials_shape(x, 4) and part.shape[2] > 1  # several chunks
    n, mean, _ = gns.merge_partials(part)
    assert torch.equal(n, torch.full_like(n, 99 * 4))
    torch.testing.assert_close(mean, x.double().reshape(2, 4, -1).mean(-1).reshape(-1), atol=1e-5, rtol=0)
    if gns.E4M3 is not None:
        y8, scale = gns.group_norm_silu_e4m3(x, 4, w, b, 1e-6)
        deq = y8.float() * scale.view(-1, 1, 1, 1)
        assert (deq - y).abs().max() <= 0.07 * y.abs().max()  # e4m3 steps, no saturation from a wrong bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_group_norm_only_and_no_affine(device, layout):
    _need(device)
    from vaeopt.kernels import group_norm_silu

    x, w, b = _inputs((2, 12, 5, 9), torch.float32, device, seed=3)
    x = _layout(x, layout)
    y = group_norm_silu(x, 4, w, b, 1e-5, silu=False)  # attention blocks: GroupNorm alone
    torch.testing.assert_close(y.double(), _ref64(x, 4, w, b, 1e-5, silu=False), atol=2e-5, rtol=2e-5)
    y = group_norm_silu(x, 4, None, None, 1e-5)  # affine=False
    torch.testing.assert_close(y.double(), _ref64(x, 4, None, None, 1e-5), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_layout_and_odd_strides(device):
    _need(device)
    from vaeopt.kernels import group_norm_silu

    # the attention processor's group_norm input: (B, L, C) memory viewed as (B, C, L) -> channels-last, kept
    x, w, b = _inputs((2, 24, 17), torch.float32, device, seed=4)
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)  # (B, C, L) view of (B, L, C) memory
    y = group_norm_silu(xt, 8, w, b, 1e-6, silu=False)
    assert xt.stride()[1] == 1 and _same_format(y, xt)
    torch.testing.assert_close(y.double(), _ref64(xt, 8, w, b, silu=False), atol=2e-5, rtol=2e-5)
    # a channel-sliced view is neither layout: made contiguous first, still correct
    x, w, b = _inputs((1, 32, 5, 6), torch.float32, device, seed=5)
    xs = x[:, ::2]
    y = group_norm_silu(xs, 4, w[:16], b[:16], 1e-6)
    torch.testing.assert_close(y.double(), _ref64(xs, 4, w[:16], b[:16]), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError):
        group_norm_silu(x, 4, w[:16], b[:16])  # affine params of the wrong size are refused, not read past


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("shape", [(1, 512, 128, 128), (1, 96, 4, 120, 208)])  # real SDXL / Wan-size activations
def test_gpu_real_shapes_bf16(layout, shape):
    _need("cuda")
    from vaeopt.kernels import group_norm_silu

    x, w, b = _inputs(shape, torch.bfloat16, "cuda", seed=6)
    x = _layout(x, layout)
    y = group_norm_silu(x, 32, w, b, 1e-6)
    ref = _ref64(x, 32, w, b)
    err = (y.double() - ref).abs().max().item()
    err_torch = (F.silu(F.group_norm(x, 32, w, b, 1e-6)).double() - ref).abs().max().item()
    assert _same_format(y, x) and err <= 2 * err_torch + FLOOR[torch.bfloat16], (err, err_torch)


# --- x_bias: a conv's bias folded into the norm (the conv runs without it) ------------------------------------------

XB_CASES = [  # (shape, groups, launcher knobs): per-element channel lookup (cf: S % BLOCK != 0) and per-block lookup
    ((2, 48, 7, 13), 16, {}),  # odd sizes, 3 channels per group
    ((1, 64, 16, 16), 32, {}),  # one block spans several channels (cf per-element path)
    ((1, 32, 8, 8), 8, dict(tile=64, target_programs=32)),  # cf: one channel per block, 4 chunks per group
    ((1, 24, 2, 3, 5), 6, {}),  # 5-D
]


def _ref64_xb(x, groups, w, b, xb, eps=1e-6, silu=True):
    xx = x.double() + xb.double().reshape(-1, *([1] * (x.dim() - 2)))
    y = F.group_norm(xx, groups, w.double(), b.double(), eps)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("shape,groups,knobs", XB_CASES)
def test_x_bias(device, dtype, layout, shape, groups, knobs):
    """group_norm_silu(x, ..., x_bias=b) == silu(group_norm(x + b)); bf16: within 2x torch's own bf16 error (torch
    rounds x + b to bf16 before the norm; the kernel adds in fp32)."""
    _need(device)
    from vaeopt.kernels import group_norm_silu

    x, w, b = _inputs(shape, dtype, device, seed=7)
    xb = (torch.randn(shape[1], generator=torch.Generator().manual_seed(8)) * 3).to(device=device, dtype=dtype)
    x = _layout(x, layout)
    y = group_norm_silu(x, groups, w, b, 1e-6, x_bias=xb, **knobs)
    assert y.dtype == dtype and _same_format(y, x)
    ref = _ref64_xb(x, groups, w, b, xb)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=2e-5)
    else:
        err = (y.double() - ref).abs().max().item()
        xx = x + xb.reshape(-1, *([1] * (x.dim() - 2)))
        err_torch = (F.silu(F.group_norm(xx, groups, w, b, 1e-6)).double() - ref).abs().max().item()
        assert err <= 2 * err_torch + FLOOR[dtype], (err, err_torch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_x_bias_large_offset_and_gn_only(device, layout):
    """A bias 1000x the spread of x (the shift trick must see it), silu=False; a wrongly sized x_bias is refused."""
    _need(device)
    from vaeopt.kernels import group_norm_silu

    x, w, b = _inputs((2, 8, 6, 7), torch.float32, device, seed=9, offset=0.0, spread=1.0)
    xb = torch.linspace(-1000, 1000, 8, device=device)
    x = _layout(x, layout)
    y = group_norm_silu(x, 2, w, b, 1e-6, False, tile=32, target_programs=12, max_block_p=2, x_bias=xb)
    torch.testing.assert_close(y.double(), _ref64_xb(x, 2, w, b, xb, silu=False), atol=5e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        group_norm_silu(x, 2, w, b, x_bias=xb[:4])


# --- split API (the exact tiled decoder's norms): partials of windows, exact merge, apply with given statistics -------


def _windows(H, W):
    """Disjoint windows covering (H, W): uneven rows x uneven cols (odd sizes, like tiles at an image border)."""
    ys, xs = [0, 3, H - 2, H], [0, 5, W]
    return [(ys[i], ys[i + 1], xs[j], xs[j + 1]) for i in range(3) for j in range(2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("with_xb", [False, True])
def test_partials_of_windows_merge_exactly(device, layout, with_xb):
    """Partials of disjoint windows (read in place from the big tensor; several chunks each), concatenated, merge to the
    moments of the whole tensor; group_norm_finalize gives its mean and rstd * weight -- with a bias 100x the spread
    of x folded in (x_bias), so the between-window term and the shift trick both matter."""
    _need(device)
    from vaeopt.kernels.group_norm_silu import (
        group_norm_finalize, group_norm_partials, group_norm_partials_shape, merge_partials,
    )  # fmt: skip

    N, C, G, H, W = 2, 12, 4, 11, 14
    x, w, _ = _inputs((N, C, H, W), torch.float32, device, seed=11, offset=3.0)
    x = _layout(x, layout)
    xb = torch.linspace(-200, 200, C, device=device) if with_xb else None
    parts = []
    for y0, y1, x0, x1 in _windows(H, W):
        win = x[:, :, y0:y1, x0:x1]
        p = group_norm_partials(win, G, x_bias=xb, tile=16, target_programs=64)
        assert p.shape == group_norm_partials_shape(win, G, tile=16, target_programs=64)
        parts.append(p)
    assert all(p.shape[2] > 1 for p in parts)
    xx = x.double() + (xb.double().view(1, -1, 1, 1) if with_xb else 0.0)
    grp = xx.reshape(N * G, -1)
    n, mean, m2 = merge_partials(parts)
    assert torch.equal(n.cpu(), torch.full((N * G,), float(grp.shape[1]), dtype=torch.float64))
    torch.testing.assert_close(mean, grp.mean(1), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(m2, grp.var(1, unbiased=False) * grp.shape[1], atol=1e-4, rtol=2e-5)
    mu, a = group_norm_finalize(parts, G, C, w, 1e-6, max_block_p=4)  # several merge steps
    exp_mu = grp.mean(1).view(N, G, 1).expand(N, G, C // G).reshape(N, C)
    exp_a = (torch.rsqrt(grp.var(1, unbiased=False) + 1e-6).view(N, G, 1).expand(N, G, C // G).reshape(N, C)
             * w.double().view(1, C))
    torch.testing.assert_close(mu.double(), exp_mu, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(a.double(), exp_a, atol=1e-6, rtol=2e-5)
    # preallocated output buffer; wrong shapes are refused
    win = x[:, :, :3, :5]
    buf = torch.empty(group_norm_partials_shape(win, G), device=device)
    assert group_norm_partials(win, G, out=buf).data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError):
        group_norm_partials(win, G, out=torch.empty(3, N * G, buf.shape[2] + 1, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_apply_window_with_padding(device, dtype, layout):
    """group_norm_apply on a window of a bigger buffer (read in place), zero-padded ring (the next conv's padding),
    x_bias and SiLU: equals silu(group_norm(x + b)) of the whole tensor at the window, zeros around; output in the
    window's layout and dtype, written once (bf16: within 2x torch's bf16 error)."""
    _need(device)
    from vaeopt.kernels.group_norm_silu import group_norm_apply, group_norm_finalize, group_norm_partials

    N, C, G, H, W = 1, 16, 4, 10, 13
    x, w, b = _inputs((N, C, H, W), dtype, device, seed=12)
    x = _layout(x, layout)
    xb = (torch.randn(C, generator=torch.Generator().manual_seed(13)) * 2).to(device=device, dtype=dtype)
    mu, a = group_norm_finalize(group_norm_partials(x, G, x_bias=xb), G, C, w, 1e-6)
    ref = _ref64_xb(x, G, w, b, xb)
    win = x[:, :, 2:7, 0:9]  # touches the left border: padded there, real neighbours elsewhere
    for silu in (True, False):
        y = group_norm_apply(win, mu, a, b, silu, x_bias=xb, pad=(1, 2, 1, 0))
        assert y.shape == (N, C, 5 + 3, 9 + 1) and y.dtype == dtype
        assert (y.stride(1) == 1) == (layout == "cl"), "output keeps the input's layout"
        exp = torch.zeros(y.shape, dtype=torch.float64, device=device)
        r = ref if silu else _ref64_xb(x, G, w, b, xb, silu=False)
        exp[:, :, 1:6, 1:10] = r[:, :, 2:7, 0:9]
        err = (y.double() - exp).abs().max().item()
        if dtype == torch.float32:
            assert err <= 2e-5, err
        else:
            xx = x + xb.view(1, -1, 1, 1)
            t = F.group_norm(xx, G, w, b, 1e-6)
            t = F.silu(t) if silu else t
            err_torch = (t[:, :, 2:7, 0:9].double() - r[:, :, 2:7, 0:9]).abs().max().item()
            assert err <= 2 * err_torch + FLOOR[dtype], (err, err_torch)
    # out=: straight into a window of another buffer; (C,) statistics broadcast over the batch
    big = torch.full((N, C, H + 4, W + 4), 7.0, device=device, dtype=dtype)
    big = _layout(big, layout)
    view = big[:, :, 3:8, 2:11]
    group_norm_apply(win, mu[0], a[0], b, True, x_bias=xb, out=view)
    torch.testing.assert_close(view.double(), ref[:, :, 2:7, 0:9], atol=2e-5 if dtype == torch.float32 else 0.05,
                               rtol=0)
    assert (big[:, :, :3] == 7).all() and (big[:, :, 8:] == 7).all() and (big[:, :, :, :2] == 7).all()
    with pytest.raises(ValueError):
        group_norm_apply(win, mu, a, b, out=big)


E4M3_SHAPES = [((2, 64, 12, 10), 32), ((1, 48, 5, 7), 16), ((1, 96, 2, 6, 10), 32)]  # 3 ch/group: one-hot path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("shape,groups", E4M3_SHAPES)
def test_e4m3_output(device, silu, shape, groups):
    """group_norm_silu_e4m3 (the fp8 conv's input): the per-sample scale bounds the true amax from above without
    wasting range (bound <= 2x amax), and the codes are exactly e4m3(y / scale) of the reference y (no rounding
    beyond the one fp8 cast); x_bias folded in; multi-chunk stats/merges (small tile)."""
    from vaeopt.kernels.group_norm_silu import group_norm_silu_e4m3

    _need(device)
    x, w, b = _inputs(shape, torch.bfloat16, device, spread=3.0)
    x = _layout(x, "cl")
    xb = torch.randn(shape[1], generator=torch.Generator().manual_seed(1)).to(device)
    y8, s = group_norm_silu_e4m3(x, groups, w, b, 1e-6, silu, x_bias=xb, tile=256, target_programs=4)
    assert y8.dtype == torch.float8_e4m3fn and _same_format(y8, x) and s.shape == (shape[0],)
    ref = _ref64(x.double() + xb.double().view(1, -1, *[1] * (x.dim() - 2)), groups, w, b, silu=silu)
    amax = ref.abs().flatten(1).amax(1)
    scale = s.double().view(-1, *[1] * (x.dim() - 1))
    assert (s.double() >= amax / 448 * (1 - 1e-5)).all() and (s.double() <= amax / 448 * 2).all(), (s, amax / 448)
    codes = (ref / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    assert (codes.float() != y8.float()).float().mean().item() < 1e-3  # ties / fp32 vs fp64 rounding only
    deq = y8.double() * scale
    assert ((deq - ref).norm() / ref.norm()).item() < 0.04  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("shape,groups", E4M3_SHAPES[:2])
def test_int8_output(device, silu, shape, groups):
    """group_norm_silu_int8 (the int8 conv's input): 255 levels over [lo, bound] per sample, lo = SiLU's minimum
    (or -bound without SiLU); every value within half a step of the reference, the codes span the range, and
    the bound is not loose by more than 2x."""
    from vaeopt.kernels.group_norm_silu import group_norm_silu_int8

    _need(device)
    x, w, b = _inputs(shape, torch.bfloat16, device, spread=3.0)
    x = _layout(x, "cl")
    xb = torch.randn(shape[1], generator=torch.Generator().manual_seed(1)).to(device)
    q, s, zq = group_norm_silu_int8(x, groups, w, b, 1e-6, silu, x_bias=xb, tile=256, target_programs=4)
    assert q.dtype == torch.int8 and _same_format(q, x) and s.shape == zq.shape == (shape[0],)
    ref = _ref64(x.double() + xb.double().view(1, -1, *[1] * (x.dim() - 2)), groups, w, b, silu=silu)
    view = (-1, *[1] * (x.dim() - 1))
    deq = (q.double() + zq.double().view(view)) * s.double().view(view)
    assert ((deq - ref).abs() <= s.double().view(view) * 0.5 * (1 + 1e-3) + 1e-6).all()
    hi = ref.flatten(1).amax(1)
    lo = -0.27847 if silu else -ref.abs().flatten(1).amax(1)
    top = s.double() * (127 + zq.double())  # the largest value a code can hold
    assert (top >= hi * (1 - 1e-5)).all() and ((top - lo) <= 2 * (hi - lo)).all()
    assert q.min().item() >= -127 and q.max().item() <= 127


def test_e4m3_output_needs_channels_last():
    from vaeopt.kernels.group_norm_silu import group_norm_silu_e4m3

    _need("cpu")
    x, w, b = _inputs((1, 32, 8, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match="channels-last"):
        group_norm_silu_e4m3(x, 8, w, b)
