"""rms_norm_silu kernel vs diffusers' WanRMS_norm (+ SiLU) over reduced Wan shapes, odd shapes, layouts, dtypes.

The reference is WanRMS_norm's own computation (F.normalize in fp32, downcast, * scale * gamma + bias) and, for the
accuracy rules, the same in fp64. CPU runs use the Triton interpreter; "cuda" repeats every check on a GPU.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from vaeopt.kernels import triton_available

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FLOOR = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}

SHAPES = [
    (1, 96, 2, 12, 16),  # Wan 2.1 decoder's 96-ch level (NCDHW), 2 frames, scaled-down frame
    (1, 384, 1, 4, 6),  # Wan's 384-ch level: C not a power of 2 (padded to 512 lanes), 1 frame (per-chunk decode)
    (2, 48, 3, 5, 7),  # batch 2, prime T/H/W
    (1, 20, 9, 11),  # 4-D (b*t, c, h, w) as WanAttentionBlock calls its norm; prime H/W
    (1, 7, 2, 3, 5),  # 7 channels (prime, < 16 lanes)
]


def _need(device):
    ok, why = triton_available(device)
    if not ok:
        pytest.skip(why)


def _layout(x, layout):
    if layout == "cl":  # channels_last(_3d) memory
        return x.movedim(1, -1).contiguous().movedim(-1, 1)
    return x.contiguous()


def _same_format(y, x):
    return [st for st, n in zip(y.stride(), y.shape) if n > 1] == [st for st, n in zip(x.stride(), x.shape) if n > 1]


def _wan_rms_silu(x, gamma, bias, silu=True, eps=1e-12):
    """diffusers WanRMS_norm.forward (channel_first) + SiLU, in x's dtype."""
    shape = (x.shape[1],) + (1,) * (x.dim() - 2)
    upcast = x.dtype in (torch.float16, torch.bfloat16)
    y = F.normalize(x.float() if upcast else x, dim=1, eps=eps).to(x.dtype)
    y = y * x.shape[1] ** 0.5 * gamma.reshape(shape) + (bias.reshape(shape) if isinstance(bias, torch.Tensor) else bias)
    return F.silu(y) if silu else y


def _ref64(x, gamma, bias, silu=True, eps=1e-12):
    b = bias.double() if isinstance(bias, torch.Tensor) else bias
    return _wan_rms_silu(x.double(), gamma.double(), b, silu, eps)


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(device=device, dtype=dtype)
    gamma = (torch.rand(C, generator=g) + 0.5).to(device=device, dtype=dtype)
    bias = (torch.randn(C, generator=g) * 0.3).to(device=device, dtype=dtype)
    return x, gamma, bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_wan_rms_norm(device, layout, shape):
    _need(device)
    from vaeopt.kernels import rms_norm_silu

    x, gamma, bias = _inputs(shape, torch.float32, device)
    x = _layout(x, layout)
    g4 = gamma.reshape(-1, *([1] * (x.dim() - 2)))  # WanRMS_norm's gamma shape (C, 1, 1[, 1])
    y = rms_norm_silu(x, g4, 0.0)  # Wan's default: bias = 0.0 (a float)
    assert y.dtype == x.dtype and _same_format(y, x)
    torch.testing.assert_close(y.double(), _ref64(x, gamma, 0.0), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(y, _wan_rms_silu(x, gamma, 0.0), atol=2e-5, rtol=2e-5)
    y = rms_norm_silu(x, gamma, bias)  # with a bias tensor
    torch.testing.assert_close(y.double(), _ref64(x, gamma, bias), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_low_precision_within_2x_torch(device, dtype, layout, shape):
    """bf16/fp16 (gamma in the same dtype, as in a bf16 model): kernel error vs fp64 <= 2x diffusers' own + floor."""
    _need(device)
    from vaeopt.kernels import rms_norm_silu

    x, gamma, bias = _inputs(shape, dtype, device, seed=1)
    x = _layout(x, layout)
    y = rms_norm_silu(x, gamma, bias)
    assert y.dtype == dtype and _same_format(y, x)
    ref = _ref64(x, gamma, bias)
    err = (y.double() - ref).abs().max().item()
    err_torch = (_wan_rms_silu(x, gamma, bias).double() - ref).abs().max().item()
    assert err <= 2 * err_torch + FLOOR[dtype], (err, err_torch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_two_loop_path_for_wide_channels(device, layout):
    """C wider than one tile (Wan 2.2's 1024-ch level, here forced with max_block_c=32; 100 = 3 full + 1 partial)."""
    _need(device)
    from vaeopt.kernels import rms_norm_silu

    x, gamma, bias = _inputs((2, 100, 1, 3, 5), torch.float32, device, seed=2)
    x = _layout(x, layout)
    y = rms_norm_silu(x, gamma, bias, max_block_c=32)
    torch.testing.assert_close(y.double(), _ref64(x, gamma, bias), atol=2e-5, rtol=2e-5)
    y = rms_norm_silu(x, gamma, 0.25, silu=False, max_block_c=32)  # a nonzero float bias, no SiLU
    torch.testing.assert_close(y.double(), _ref64(x, gamma, 0.25, silu=False), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_only_eps_and_zero_vectors(device):
    """silu=False (attention norm); an all-zero channel vector divides by eps like F.normalize (-> bias only);
    a custom eps larger than some norms."""
    _need(device)
    from vaeopt.kernels import rms_norm_silu

    x, gamma, bias = _inputs((1, 16, 2, 4, 5), torch.float32, device, seed=3)
    x[:, :, 0, 1, 2] = 0.0
    x[:, :, 1, 0, 0] *= 1e-4
    y = rms_norm_silu(x, gamma, bias, silu=False)
    torch.testing.assert_close(y.double(), _ref64(x, gamma, bias, silu=False), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(y[0, :, 0, 1, 2], bias)
    y = rms_norm_silu(x, gamma, bias, eps=1e-2)
    torch.testing.assert_close(y.double(), _ref64(x, gamma, bias, eps=1e-2), atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("shape", [(1, 384, 2, 60, 104), (1, 96, 4, 240, 416)])  # real Wan 480p activations
def test_gpu_real_shapes_bf16(layout, shape):
    _need("cuda")
    from vaeopt.kernels import rms_norm_silu

    x, gamma, bias = _inputs(shape, torch.bfloat16, "cuda", seed=4)
    x = _layout(x, layout)
    y = rms_norm_silu(x, gamma, 0.0)
    ref = _ref64(x, gamma, 0.0)
    err = (y.double() - ref).abs().max().item()
    err_torch = (_wan_rms_silu(x, gamma, 0.0).double() - ref).abs().max().item()
    assert _same_format(y, x) and err <= 2 * err_torch + FLOOR[torch.bfloat16], (err, err_torch)


# --- x_bias (a conv's bias folded into the norm) and out= (writing into a conv input buffer) ----------------------


def _ref64_xb(x, gamma, bias, x_bias, silu=True):
    """WanRMS_norm + SiLU of (x + x_bias) in fp64: what the conv with its bias, then the norm, compute exactly."""
    xb = x.double() + x_bias.double().reshape(-1, *([1] * (x.dim() - 2)))
    b = bias.double() if isinstance(bias, torch.Tensor) else bias
    return _wan_rms_silu(xb, gamma.double(), b, silu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("shape,max_block_c", [((2, 48, 3, 5, 7), 1024), ((1, 100, 2, 3, 5), 32),
                                                 ((1, 20, 9, 11), 1024)])
def test_x_bias_fp32(device, layout, shape, max_block_c):
    """x_bias in one-pass and two-loop kernels, 5-D and 4-D, both layouts: equal to norm(x + x_bias)."""
    _need(device)
    from vaeopt.kernels import rms_norm_silu

    x, gamma, bias = _inputs(shape, torch.float32, device, seed=5)
    xb = (torch.randn(shape[1], generator=torch.Generator().manual_seed(6)) * 2).to(device)
    x = _layout(x, layout)
    y = rms_norm_silu(x, gamma, bias, x_bias=xb, max_block_c=max_block_c)
    assert y.dtype == x.dtype and _same_format(y, x)
    torch.testing.assert_close(y.double(), _ref64_xb(x, gamma, bias, xb), atol=2e-5, rtol=2e-5)
    y = rms_norm_silu(x, gamma, 0.0, silu=False, x_bias=xb.reshape(-1, 1, 1), max_block_c=max_block_c)  # any shape
    torch.testing.assert_close(y.double(), _ref64_xb(x, gamma, 0.0, xb, silu=False), atol=2e-5, rtol=2e-5)
    # x_bias=None is the default path, bit for bit
    assert torch.equal(rms_norm_silu(x, gamma, bias, x_bias=None), rms_norm_silu(x, gamma, bias))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_x_bias_low_precision(device, dtype, layout):
    """bf16/fp16: the sum is formed in fp32 (never rounded), so the kernel is at least as close to the fp64 result
    as diffusers' composition (conv output + bias rounded to bf16, then the norm) -- within 2x + floor."""
    _need(device)
    from vaeopt.kernels import rms_norm_silu
    from vaeopt.kernels.rms_norm_silu import rms_norm_silu_reference

    x, gamma, bias = _inputs((1, 96, 2, 6, 8), dtype, device, seed=7)
    xb = torch.randn(96, generator=torch.Generator().manual_seed(8)).to(device=device, dtype=dtype)
    x = _layout(x, layout)
    y = rms_norm_silu(x, gamma, bias, x_bias=xb)
    ref = _ref64_xb(x, gamma, bias, xb)
    err = (y.double() - ref).abs().max().item()
    err_torch = (rms_norm_silu_reference(x, gamma, bias, x_bias=xb).double() - ref).abs().max().item()
    assert err <= 2 * err_torch + FLOOR[dtype], (err, err_torch)


def _buffer(shape, hist, layout, device, dtype=torch.float32, fill=7.0):
    """A causal conv input buffer (N, C, hist + T, ...) filled with a sentinel, in the given layout."""
    full = (shape[0], shape[1], hist + shape[2], *shape[3:])
    return _layout(torch.full(full, fill, device=device, dtype=dtype), layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("max_block_c", [1024, 16])
def test_out_into_conv_buffer(device, layout, max_block_c):
    """out= a frame range of a larger buffer (batch 2: sample strides differ from x's; channels-first: channel
    stride too): written in place, the history frames untouched, same values as without out=."""
    _need(device)
    from vaeopt.kernels import rms_norm_silu

    shape = (2, 40, 3, 5, 6)
    x, gamma, bias = _inputs(shape, torch.float32, device, seed=9)
    xb = torch.randn(40, generator=torch.Generator().manual_seed(10)).to(device)
    x = _layout(x, layout)
    buf = _buffer(shape, 2, layout, device)
    dst = buf[:, :, 2:]
    ret = rms_norm_silu(x, gamma, bias, x_bias=xb, out=dst, max_block_c=max_block_c)
    assert ret.data_ptr() == dst.data_ptr() and ret.stride() == dst.stride()
    assert (buf[:, :, :2] == 7.0).all()
    assert torch.equal(dst, rms_norm_silu(x, gamma, bias, x_bias=xb, max_block_c=max_block_c))
    torch.testing.assert_close(dst.double(), _ref64_xb(x, gamma, bias, xb), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_out_odd_strides_dtype_and_errors(device):
    """An out= the kernels cannot address (other layout kind, transposed spatial dims) is filled through a copy; an
    fp32 out for a bf16 x gets the fp32 result rounded once; strided (frame-slice) channels-first inputs read in
    place; wrong shapes / types are rejected."""
    _need(device)
    from vaeopt.kernels import rms_norm_silu

    shape = (1, 24, 2, 4, 5)
    x, gamma, bias = _inputs(shape, torch.float32, device, seed=11)
    ref = rms_norm_silu(x, gamma, bias)
    for out in (_layout(torch.empty(shape, device=device), "cl"),  # cl out for a cf x
                torch.empty(1, 24, 2, 5, 4, device=device).transpose(3, 4)):  # spatial dims that do not merge
        ret = rms_norm_silu(x, gamma, bias, out=out)
        assert ret is out and torch.equal(out, ref)
    xb16 = x.bfloat16()
    out32 = torch.empty(shape, device=device)
    rms_norm_silu(xb16, gamma, bias, out=out32)
    torch.testing.assert_close(out32.double(), _ref64(xb16, gamma, bias), atol=2e-5, rtol=2e-5)
    big = torch.randn(1, 24, 5, 4, 5, generator=torch.Generator().manual_seed(12)).to(device)
    torch.testing.assert_close(rms_norm_silu(big[:, :, 1:3], gamma, bias), rms_norm_silu(big[:, :, 1:3].contiguous(),
                                                                                          gamma, bias))
    with pytest.raises(ValueError, match="shape"):
        rms_norm_silu(x, gamma, bias, out=torch.empty(1, 24, 3, 4, 5, device=device))
    with pytest.raises(ValueError, match="x_bias"):
        rms_norm_silu(x, gamma, bias, x_bias=torch.zeros(23, device=device))
    with pytest.raises(ValueError):
        rms_norm_silu(x, gamma, bias, out=torch.empty(shape, device=device, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cl", "cf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_residual_folded_equals_epilogue_then_norm(device, layout, dtype, in_place):
    """norm(residual + rb + h + b) in one pass (rms_norm_silu(residual=...)) gives the same bits as the two passes it
    replaces, epilogue.bias_residual then the norm: the block output it stores (sum_out, also in place over h) and
    the normalized output. Channels-first layouts take the two-pass form inside the call: same numbers."""
    _need(device)
    from vaeopt.kernels.epilogue import bias_residual
    from vaeopt.kernels.rms_norm_silu import rms_norm_silu

    shape = (1, 96, 3, 5, 7)
    h, gamma, beta = _inputs(shape, dtype, device)
    r, _, rb = _inputs(shape, dtype, device, seed=1)
    b = torch.randn(96, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    h, r = _layout(h, layout), _layout(r, layout)
    u_ref = bias_residual(h, b, r, residual_bias=rb)
    y_ref = rms_norm_silu(u_ref, gamma, beta)
    hh = h.clone()
    u = hh if in_place else torch.empty_like(h)
    y = rms_norm_silu(hh, gamma, beta, x_bias=b, residual=r, residual_bias=rb, sum_out=u)
    assert torch.equal(u, u_ref) and torch.equal(y, y_ref)
    assert in_place or torch.equal(hh, h)  # h untouched unless it is sum_out
    y2 = rms_norm_silu(h, gamma, beta, x_bias=b, residual=r, residual_bias=rb)  # no sum stored
    assert torch.equal(y2, y_ref)
    with pytest.raises(ValueError, match="need a residual"):
        rms_norm_silu(h, gamma, beta, sum_out=u)


@pytest.mark.parametrize("k", [1, 3])
def test_residual_folded_into_tap_stack(k):
    """The time-stacked norm (taps=3, cache_out) with the block's residual folded in: stack, history and stored sum
    equal those of bias_residual followed by the unfused taps=3 call."""
    _need("cpu")
    from vaeopt.kernels.epilogue import bias_residual
    from vaeopt.kernels.rms_norm_silu import rms_norm_silu

    N, C, H, W = 1, 48, 4, 6
    h, gamma, beta = _inputs((N, C, k, H, W), torch.bfloat16, "cpu")
    r, _, rb = _inputs((N, C, k, H, W), torch.bfloat16, "cpu", seed=1)
    h, r = _layout(h, "cl"), _layout(r, "cl")
    b = torch.randn(C, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def bufs():
        S = torch.full((N * k, 3 * C, H, W), 7.0, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        cache = torch.full((N, C, 2, H, W), 5.0, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
        return S, cache

    u_ref = bias_residual(h, b, r, residual_bias=rb)
    S_ref, c_ref = bufs()
    rms_norm_silu(u_ref, gamma, beta, out=S_ref, taps=3, cache_out=c_ref)
    S, cache = bufs()
    u = torch.empty_like(h)
    rms_norm_silu(h, gamma, beta, x_bias=b, out=S, taps=3, cache_out=cache, residual=r, residual_bias=rb, sum_out=u)
    assert torch.equal(u, u_ref) and torch.equal(S, S_ref) and torch.equal(cache, c_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [2, 3])
def test_gpu_silu_modes_bf16(mode, monkeypatch):
    """SILU_MODE 3 (ftz ex2 + rcp) and 2 (tanh.approx) against the exact SiLU (0) on a bf16 output: within one bf16
    step of it (mode 3: nearly always the same bits)."""
    _need("cuda")
    import importlib

    rms = importlib.import_module("vaeopt.kernels.rms_norm_silu")
    common = importlib.import_module("vaeopt.kernels.common")
    x, gamma, beta = _inputs((1, 96, 4, 60, 104), torch.bfloat16, "cuda")
    x = _layout(x, "cl")
    monkeypatch.setattr(common, "SILU_MODE", 0)
    y0 = rms.rms_norm_silu(x, gamma, beta).float()
    monkeypatch.setattr(common, "SILU_MODE", mode)
    y = rms.rms_norm_silu(x, gamma, beta).float()
    step = torch.maximum(y0.abs(), torch.full_like(y0, 2.0**-126)) * 2.0**-7
    assert bool(((y - y0).abs() <= step).all())
    if mode == 3:
        assert (y != y0).float().mean().item() < 1e-4


def test_silu_mode_policy(monkeypatch):
    """Which SiLU each kernel gets: exact on the CPU / interpreter / ROCm and for fp32; tanh.approx for e4m3
    outputs; for 16-bit outputs exact in the GroupNorm kernels and the ftz formula (3) in Wan's RMS kernel;
    SILU_MODE overrides."""
    import importlib

    common = importlib.import_module("vaeopt.kernels.common")  # the one SiLU policy of the norm kernels
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(common, "interpreting", lambda: False)
    assert common.silu_mode(torch.bfloat16, cpu, wan_rms=True) == 0
    assert common.silu_mode(torch.float32, cuda, wan_rms=True) == 0
    assert common.silu_mode(torch.bfloat16, cuda) == 0 and common.silu_mode(torch.float16, cuda) == 0
    assert common.silu_mode(torch.bfloat16, cuda, wan_rms=True) == 3
    assert common.silu_mode(torch.float8_e4m3fn, cuda) == 2
    assert common.silu_mode(torch.float8_e4m3fn, cuda, wan_rms=True) == 2
    monkeypatch.setattr(common, "SILU_MODE", 0)
    assert common.silu_mode(torch.bfloat16, cuda, wan_rms=True) == 0
    monkeypatch.setattr(common, "interpreting", lambda: True)
    monkeypatch.setattr(common, "SILU_MODE", 2)
    assert common.silu_mode(torch.bfloat16, cuda, wan_rms=True) == 0  # modes 2/3 are PTX: never under the interpreter
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "SILU_MODE", None)
    monkeypatch.setattr(torch.version, "hip", "6.2")  # nor on ROCm, whose "cuda" devices run no PTX
    assert common.silu_mode(torch.bfloat16, cuda, wan_rms=True) == 0
    assert common.silu_mode(torch.float8_e4m3fn, cuda) == 0


@pytest.mark.parametrize("out_scale", [1.0, 0.25, 3.0, 0.005])  # 0.005: |y| / out_scale beyond 448, saturated
@pytest.mark.parametrize("max_block_c", [1024, 32])
def test_e4m3_out_scale(out_scale, max_block_c):
    """An e4m3 `out` receives y / out_scale, saturated to +-448 and rounded to the e4m3 grid, in the one-pass kernel
    (its multiply present only when out_scale != 1) and the two-loop one. The interpreter's path rounds exact ties
    half up where torch's cast rounds them to even: those (1 of 6720 here) may sit one e4m3 step apart."""
    _need("cpu")
    from vaeopt.kernels.rms_norm_silu import rms_norm_silu, rms_norm_silu_reference

    x, gamma, beta = _inputs((1, 96, 2, 5, 7), torch.float32, "cpu")
    x = _layout(x, "cl")
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn).contiguous(memory_format=torch.channels_last_3d)
    rms_norm_silu(x, gamma, beta, out=out, out_scale=out_scale, max_block_c=max_block_c)
    y = (rms_norm_silu_reference(x, gamma, beta) / out_scale).clamp(-448, 448)
    ref = y.to(torch.float8_e4m3fn).float()
    off = out.float() != ref
    step = torch.exp2(torch.floor(torch.log2(y.abs().clamp_min(2.0**-6))) - 3)
    assert off.sum().item() <= 2 and bool(((out.float() - ref).abs() <= step)[off].all())
    assert bool((out.float() - y).abs().le(step / 2 + 1e-6).all())  # every value is a nearest grid point
    assert out_scale > 0.01 or out.float().abs().max().item() == 448.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("max_block_c", [1024, 16])
def test_out_into_a_padded_buffer_interior(device, layout, max_block_c):
    """out= the interior of a conv input padded in H and W (and in time: frames of history before it), as
    vaeopt.engine.pad builds it: the kernel writes the interior in place, never the borders or the other frames,
    with the same values as without out=."""
    _need(device)
    from vaeopt.engine.pad import padded_empty
    from vaeopt.kernels import rms_norm_silu
    rn = importlib.import_module("vaeopt.kernels.rms_norm_silu")  # (the package exports the function by that name)

    for shape in ((2, 40, 3, 5, 6), (1, 7, 1, 3, 11)):  # batch 2, 40 channels; 7 channels, one frame, odd W
        x, gamma, bias = _inputs(shape, torch.float32, device, seed=13)
        x = _layout(x, layout)
        mf = torch.channels_last_3d if layout == "cl" else torch.contiguous_format
        full = (shape[0], shape[1], shape[2] + 2, *shape[3:])
        buf, inner = padded_empty(full, (1, 2, 1, 1), x, mf)
        buf.fill_(7.0)
        dst = inner[:, :, 2:]
        assert rn._padded_out(dst, layout) is not None  # addressed by the kernel itself, not filled through a copy
        ret = rms_norm_silu(x, gamma, bias, out=dst, max_block_c=max_block_c)
        assert ret is dst
        assert torch.equal(dst, rms_norm_silu(x, gamma, bias, max_block_c=max_block_c))
        mask = torch.ones_like(buf, dtype=torch.bool)
        mask[:, :, 2:, 1:-1, 1:-2] = False
        assert (buf[mask] == 7.0).all()  # borders and history frames untouched
