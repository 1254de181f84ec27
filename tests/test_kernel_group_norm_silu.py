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
