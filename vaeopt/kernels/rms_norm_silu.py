"""Fused Wan RMS norm (+ optional SiLU) over the channel dim, for NCHW / NCDHW and NHWC / NDHWC activations.

Computes silu(x / max(||x||_2 over C, eps) * scale * gamma + bias), scale = sqrt(C) — diffusers' `WanRMS_norm`
(F.normalize in fp32, then affine) followed by the decoder's SiLU. diffusers spends ~6 full passes on this
(upcast copy, norm reduction, divide, downcast, scale*gamma, +bias, SiLU); here it is one read and one write:
each program owns whole channel vectors (all C values of a block of positions), so the reduction never leaves
registers. Channels larger than `max_block_c` take a two-loop path whose second read hits L1/L2.

Input bias (`x_bias`, optional [C]): the kernels normalize x + x_bias[c] (formed in fp32, never materialized), so
the conv before the norm can run without its bias (PyTorch's cuDNN path adds a conv bias as a separate broadcast
pass). `out=`: write into a given tensor (e.g. the frames after the causal history in a conv's input buffer) instead
of a new one; it may be a strided view as long as each sample is [C, S] with contiguous S ("cf", any channel
stride) or a contiguous [S, C] block ("cl"), in x's layout kind, or the interior of a buffer padded in H and W
(any frame and row strides), so a conv's padded input costs only its borders.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vaeopt.kernels.common import (OUT8, affine_args, channel_vector, default_tile, flat_layout, new_like, sat_e4m3,
                                   silu, silu_mode)
from vaeopt.kernels.epilogue import bias_residual

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_cf_kernel(
    x_ptr,  # [N, C, S]: element (n, c, s) at n*stride_xn + c*stride_xc + s
    y_ptr,  # [N, C, S]: element (n, c, s) at n*stride_yn + c*stride_yc + s
    g_ptr,  # [C] gamma
    b_ptr,  # [C] bias (read only if HAS_BIAS)
    xb_ptr,  # [C] input bias (read only if HAS_XB)
    C,
    S,
    stride_xn,
    stride_xc,
    stride_yn,
    stride_yc,
    scale,
    eps,
    out_mul,  # the result is multiplied by this before the store (1 / the fp8 scale of an e4m3 output)
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK_C >= C: the tile holds whole channel vectors, x is read once
    HAS_BIAS: tl.constexpr,
    HAS_XB: tl.constexpr,
    SILU: tl.constexpr,
    SAT8: tl.constexpr = False,  # e4m3 output: saturate to +-448 before the cast
    EXACT8: tl.constexpr = False,  # and round to the e4m3 grid first (the CPU interpreter's fp8 cast misrounds)
    OUT_PAD: tl.constexpr = False,  # y is the interior of a padded buffer: position s = (t, h, w) at OUT_PAD's strides
    OW=1,  # OUT_PAD: the interior's W, H*W, and the buffer's frame and row strides (w's stride is 1)
    OHW=1,
    stride_yt=0,
    stride_yh=0,
):
    sb = tl.program_id(0)
    n = tl.program_id(1)
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    sm = s < S
    cc = tl.arange(0, BLOCK_C)
    xb = x_ptr + n.to(tl.int64) * stride_xn
    yb = y_ptr + n.to(tl.int64) * stride_yn
    if OUT_PAD:
        so = (s // OHW).to(tl.int64) * stride_yt + ((s % OHW) // OW).to(tl.int64) * stride_yh + s % OW
    else:
        so = s
    if ONE_PASS:
        cm = cc < C
        m = cm[:, None] & sm[None, :]
        c64 = cc.to(tl.int64)[:, None]
        x = tl.load(xb + c64 * stride_xc + s[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_XB:
            x += tl.load(xb_ptr + cc, mask=cm, other=0.0).to(tl.float32)[:, None]
        inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), eps)  # [BLOCK_S]
        g = tl.load(g_ptr + cc, mask=cm, other=0.0).to(tl.float32)
        y = x * inv[None, :] * g[:, None]
        if HAS_BIAS:
            y += tl.load(b_ptr + cc, mask=cm, other=0.0).to(tl.float32)[:, None]
        if SILU:
            y = y / (1.0 + tl.exp(-y))  # SiLU
        y = y * out_mul
        if SAT8:
            y = sat_e4m3(y, EXACT8)
        tl.store(yb + c64 * stride_yc + so[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([BLOCK_S], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            cm = c < C
            m = cm[:, None] & sm[None, :]
            x = tl.load(xb + c.to(tl.int64)[:, None] * stride_xc + s[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_XB:
                x += tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)[:, None]
            acc += tl.sum(x * x, axis=0)
        inv = scale / tl.maximum(tl.sqrt(acc), eps)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            cm = c < C
            m = cm[:, None] & sm[None, :]
            c64 = c.to(tl.int64)[:, None]
            x = tl.load(xb + c64 * stride_xc + s[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_XB:
                x += tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)[:, None]
            g = tl.load(g_ptr + c, mask=cm, other=0.0).to(tl.float32)
            y = x * inv[None, :] * g[:, None]
            if HAS_BIAS:
                y += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[:, None]
            if SILU:
                y = y / (1.0 + tl.exp(-y))  # SiLU
            y = y * out_mul
            if SAT8:
                y = sat_e4m3(y, EXACT8)
            tl.store(yb + c64 * stride_yc + so[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_cl_kernel(
    x_ptr,  # [N, S, C]: sample n at x_ptr + n*stride_xn, contiguous [S, C] inside
    y_ptr,  # [N, S, C]: sample n at y_ptr + n*stride_yn, contiguous [S, C] inside
    g_ptr,  # [C] gamma
    b_ptr,  # [C] bias (read only if HAS_BIAS)
    xb_ptr,  # [C] input bias (read only if HAS_XB)
    R,  # N*S rows
    S,
    C,
    stride_xn,
    stride_yn,
    scale,
    eps,
    out_mul,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ONE_PASS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_XB: tl.constexpr,
    SILU: tl.constexpr,
    SAT8: tl.constexpr = False,  # e4m3 output: saturate to +-448 before the cast
    EXACT8: tl.constexpr = False,  # and round to the e4m3 grid first (the CPU interpreter's fp8 cast misrounds)
    TAPS: tl.constexpr = 0,  # > 0: tap-stacked output (see rms_norm_silu's `taps`); x is (N, C, K, HW)
    K=1,
    HW=1,
    c_ptr=None,  # TAPS with CACHE: [N, TAPS-1, HW, C] the stream's last TAPS-1 frames (the conv's next history)
    CACHE: tl.constexpr = False,
    RES: tl.constexpr = False,  # x is a residual block's conv output h: normalize u = (r + rb) + (h + xb), rounded
    r_ptr=None,  # RES: [N, S, C] the residual r (sample n at r_ptr + n*stride_rn)
    rb_ptr=None,  # RES with HAS_RB: [C] the residual's bias
    u_ptr=None,  # RES with STORE_U: [N, S, C] where u is stored (may be x itself)
    stride_rn=0,
    stride_un=0,
    HAS_RB: tl.constexpr = False,
    STORE_U: tl.constexpr = False,
    SILU_MODE: tl.constexpr = 0,  # see common.silu
    HAS_MUL: tl.constexpr = True,  # out_mul != 1: otherwise the one-pass path leaves the multiply out
    OUT_PAD: tl.constexpr = False,  # y is the interior of a padded buffer: position s = (t, h, w) at OUT_PAD's strides
    OW=1,  # OUT_PAD: the interior's W, H*W, and the buffer's frame and row strides (w's stride is C)
    OHW=1,
    stride_yt=0,
    stride_yh=0,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < R
    n = r // S
    s = r % S
    xo = n.to(tl.int64) * stride_xn + s.to(tl.int64) * C  # [BLOCK_R]
    if OUT_PAD:
        yo = (n.to(tl.int64) * stride_yn + (s // OHW).to(tl.int64) * stride_yt
              + ((s % OHW) // OW).to(tl.int64) * stride_yh + (s % OW).to(tl.int64) * C)
    else:
        yo = n.to(tl.int64) * stride_yn + s.to(tl.int64) * C
    cc = tl.arange(0, BLOCK_C)
    if ONE_PASS:
        cm = cc < C
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + xo[:, None] + cc[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_XB:
            x += tl.load(xb_ptr + cc, mask=cm, other=0.0).to(tl.float32)[None, :]
        if RES:  # the block's output, as epilogue.bias_residual computes and rounds it: (r + rb) + (h + b)
            ro = n.to(tl.int64) * stride_rn + s.to(tl.int64) * C
            rr = tl.load(r_ptr + ro[:, None] + cc[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_RB:
                rr += tl.load(rb_ptr + cc, mask=cm, other=0.0).to(tl.float32)[None, :]
            u = (rr + x).to(x_ptr.dtype.element_ty)
            if STORE_U:
                uo = n.to(tl.int64) * stride_un + s.to(tl.int64) * C
                tl.store(u_ptr + uo[:, None] + cc[None, :], u, mask=m)
            x = u.to(tl.float32)
        inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)  # [BLOCK_R]
        g = tl.load(g_ptr + cc, mask=cm, other=0.0).to(tl.float32)
        y = x * inv[:, None] * g[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + cc, mask=cm, other=0.0).to(tl.float32)[None, :]
        if SILU:
            y = silu(y, SILU_MODE)
        if HAS_MUL:
            y = y * out_mul
        if SAT8:
            y = sat_e4m3(y, EXACT8)
        if TAPS > 0:
            # frame j of sample n is tap dt of output frame j + TAPS - 1 - dt (the first TAPS - 1 frames of the
            # stack are the causal history, written by the caller): up to TAPS stores of the same values
            j = s // HW
            pix = s % HW
            y = y.to(y_ptr.dtype.element_ty)
            for dt in tl.static_range(TAPS):
                t = j + (TAPS - 1 - dt)
                mt = m & (t < K)[:, None]
                to = ((n * K + t).to(tl.int64) * HW + pix.to(tl.int64)) * (TAPS * C) + dt * C
                tl.store(y_ptr + to[:, None] + cc[None, :], y, mask=mt)
            if CACHE:  # frame j is slot j - (K - (TAPS - 1)) of the next history, where that is >= 0
                slot = j - (K - (TAPS - 1))
                co = ((n * (TAPS - 1) + slot).to(tl.int64) * HW + pix.to(tl.int64)) * C
                tl.store(c_ptr + co[:, None] + cc[None, :], y, mask=m & (slot >= 0)[:, None])
        else:
            tl.store(y_ptr + yo[:, None] + cc[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            cm = c < C
            m = rm[:, None] & cm[None, :]
            x = tl.load(x_ptr + xo[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_XB:
                x += tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
            acc += tl.sum(x * x, axis=1)
        inv = scale / tl.maximum(tl.sqrt(acc), eps)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            cm = c < C
            m = rm[:, None] & cm[None, :]
            x = tl.load(x_ptr + xo[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_XB:
                x += tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
            g = tl.load(g_ptr + c, mask=cm, other=0.0).to(tl.float32)
            y = x * inv[:, None] * g[None, :]
            if HAS_BIAS:
                y += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
            if SILU:
                y = silu(y, SILU_MODE)
            y = y * out_mul
            if SAT8:
                y = sat_e4m3(y, EXACT8)
            tl.store(y_ptr + yo[:, None] + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def _res_kwargs(x: torch.Tensor, residual, residual_bias, sum_out, max_block_c: int = 1024) -> dict | None:
    """The cl kernel's arguments for a residual folded into the norm (see rms_norm_silu's `residual`), or None when
    the kernel cannot address these tensors (then the caller forms the sum first)."""
    C = x.shape[1]
    lx, lr = flat_layout(x), flat_layout(residual)
    if lx is None or lx[0] != "cl" or lr is None or lr[0] != "cl" or tuple(residual.shape) != tuple(x.shape):
        return None
    if triton.next_power_of_2(C) > max_block_c or residual.device != x.device:
        return None
    stride_un = 0
    if sum_out is not None:
        lu = flat_layout(sum_out)
        if (lu is None or lu[0] != "cl" or tuple(sum_out.shape) != tuple(x.shape) or sum_out.dtype != x.dtype
                or sum_out.device != x.device):
            return None
        stride_un = lu[2]
    rb = channel_vector("residual_bias", residual_bias, C, x.device)
    return dict(RES=True, r_ptr=residual, rb_ptr=rb if rb is not None else residual, u_ptr=sum_out if sum_out is not
                None else residual, stride_rn=lr[2], stride_un=stride_un, HAS_RB=rb is not None,
                STORE_U=sum_out is not None)


def _residual_first(x, x_bias, residual, residual_bias, sum_out):
    """u = (residual + residual_bias) + (x + x_bias) as a tensor (into sum_out if given): the unfused form."""
    return bias_residual(x, x_bias, residual, residual_bias=residual_bias, out=sum_out)


def _rms_taps(x, gamma, bias, eps, silu, scale, x_bias, out, taps, tile, num_warps, cache_out=None,
              res: dict | None = None) -> torch.Tensor:
    if x.dim() != 5 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rms_norm_silu(taps=): x must be a (N, C, K, H, W) float tensor, got {tuple(x.shape)}")
    lay = flat_layout(x)
    if lay is None or lay[0] != "cl":  # each sample must be one [K*H*W, C] block
        x = x.contiguous(memory_format=torch.channels_last_3d)
        lay = flat_layout(x)
    N, C, K, H, W = x.shape
    if out is None or tuple(out.shape) != (N * K, taps * C, H, W) or out.dtype not in SUPPORTED_DTYPES \
            or out.device != x.device or not out.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"rms_norm_silu(taps={taps}): out must be a dense channels_last ({N * K}, {taps * C}, {H}, "
                         f"{W}) tensor on {x.device}")
    if triton.next_power_of_2(C) > 1024:
        raise ValueError(f"rms_norm_silu(taps=): {C} channels (at most 1024)")
    if cache_out is not None and (tuple(cache_out.shape) != (N, C, taps - 1, H, W) or cache_out.dtype != out.dtype
                                  or not cache_out.permute(0, 2, 3, 4, 1).is_contiguous()):
        raise ValueError(f"rms_norm_silu(taps={taps}): cache_out must be a dense channels_last_3d ({N}, {C}, "
                         f"{taps - 1}, {H}, {W}) {out.dtype} tensor")
    g, b, has_bias, xb = affine_args(x, gamma, bias, x_bias)
    if x.numel() == 0:
        return out
    S = K * H * W
    R = N * S
    if R >= 2**31:
        raise ValueError("rms_norm_silu: N * spatial positions must be < 2**31 (int32 position indices)")
    tile = tile or default_tile(x.device)
    BLOCK_C = triton.next_power_of_2(C)
    BLOCK_R = min(max(1, tile // BLOCK_C), triton.next_power_of_2(R))
    nw = num_warps or (4 if BLOCK_C * BLOCK_R <= 4096 else 8)
    _rms_cl_kernel[(triton.cdiv(R, BLOCK_R),)](
        x, out, g, b, xb if xb is not None else g, R, S, C, lay[2], 0,
        float(C) ** 0.5 if scale is None else float(scale), float(eps), 1.0,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ONE_PASS=True, HAS_BIAS=has_bias, HAS_XB=xb is not None, SILU=silu,
        TAPS=taps, K=K, HW=H * W, c_ptr=cache_out if cache_out is not None else out, CACHE=cache_out is not None,
        SILU_MODE=silu_mode(out.dtype, x.device, wan_rms=True), HAS_MUL=False, num_warps=nw, **(res or {}),
    )  # fmt: skip
    return out


def _out_strides(out: torch.Tensor, kind: str, S: int) -> tuple[int, int] | None:
    """(stride_n, stride_c) of `out` (N, C, *spatial) when its spatial dims merge into one dim of stride 1 ("cf")
    or a contiguous [S, C] block per sample ("cl"), else None."""
    layout = flat_layout(out)
    if layout is not None and layout[0] == kind:
        return layout[2], (S if kind == "cf" else 1)
    if kind != "cf":
        return None
    st = out.stride()
    dims = [(n, s) for n, s in zip(out.shape[2:], st[2:]) if n != 1]
    if not all(s0 == s1 * n1 for (_, s0), (n1, s1) in zip(dims, dims[1:])):
        return None
    if dims and dims[-1][1] != 1:
        return None
    return st[0], st[1]


def _padded_out(out: torch.Tensor, kind: str) -> dict | None:
    """The kernels' OUT_PAD arguments for an `out` (N, C, T, H, W) that is the interior of a larger buffer in x's
    layout kind (a conv input padded in H and W, vaeopt.engine.pad): W with stride 1 ("cf") or C ("cl"), channels
    at stride 1 ("cl"), any frame and row strides. None where it is not such a view."""
    if out.dim() != 5:
        return None
    N, C, T, H, W = out.shape
    sn, sc, st, sh, sw = out.stride()
    row = W if kind == "cf" else W * C
    if (H > 1 and sh < row) or (T > 1 and st < H * max(sh, row)):  # rows or frames that overlap: not a buffer
        return None
    if kind == "cf" and (sw == 1 or W == 1):
        return dict(stride_n=sn, stride_c=sc, OUT_PAD=True, OW=W, OHW=H * W, stride_yt=st, stride_yh=sh)
    if kind == "cl" and (sc == 1 or C == 1) and (sw == C or W == 1):
        return dict(stride_n=sn, stride_c=1, OUT_PAD=True, OW=W, OHW=H * W, stride_yt=st, stride_yh=sh)
    return None


def rms_norm_silu(
    x: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | float | None = None,
    eps: float = 1e-12,
    silu: bool = True,
    *,
    scale: float | None = None,
    x_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tile: int | None = None,
    max_block_c: int = 1024,
    num_warps: int | None = None,
    out_scale: float | None = None,
    taps: int = 0,
    cache_out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    residual_bias: torch.Tensor | None = None,
    sum_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(F.normalize(x + x_bias, dim=1, eps) * scale * gamma + bias) for x (N, C, *spatial), fp32/bf16/fp16, fp32
    math.

    gamma/bias: C values in any shape ((C,), (C,1,1), (C,1,1,1)); bias may be a number (Wan's default 0.0) or None.
    x_bias: optional C values added to x (in fp32) before the norm: a preceding conv's bias, so that conv can run
    without it. scale defaults to sqrt(C) as in WanRMS_norm. Output has x's dtype and memory format, or is written
    into `out` (x's shape; any supported float dtype; a view whose samples are [C, S] with contiguous S for a
    channels-first x, or contiguous [S, C] blocks for a channels-last x; other strides are filled by a copy) and
    `out` is returned. fp8: an `out` in float8_e4m3fn receives y / out_scale, saturated to +-448 (the fp8 conv
    multiplies out_scale back in its epilogue). `tile`, `max_block_c`, `num_warps` are tuning knobs (tests lower max_block_c to exercise the
    two-loop path).
    taps=k > 0 (a causal conv's time-stacked input, vaeopt.video): x (N, C, K, H, W) channels_last_3d, out the dense
    channels_last (N*K, k*C, H, W) stack whose frame n*K + t holds input frames t-k+1 .. t of the conv's
    [history | x] stream in channel blocks 0 .. k-1; frame j of x goes to block dt of frame j + k-1-dt wherever
    that frame exists (blocks taken by the k-1 history frames are the caller's). One read, up to k writes.
    cache_out (taps only): the conv's (N, C, k-1, H, W) dense channels_last_3d history, whose slots the kernel fills
    with the last frames of x (slot s <- frame K - (k-1) + s; with K < k-1 the caller shifts the older slots first):
    the next call's history without reading it back from the stack.
    residual (x's shape): x is a residual block's conv output h, and what is normalized is the block's output
    u = (residual + residual_bias) + (x + x_bias), formed in fp32 and rounded to x's dtype exactly as
    epilogue.bias_residual writes it; sum_out (x's shape and dtype; x itself for in place, or None) receives u. One
    pass instead of the epilogue's and the norm's: the norm does not read u back. Channels-last one-pass layouts run
    it in the kernel; any other layout forms u first (the same numbers, two passes).
    """
    res = None
    if residual is not None:
        res = _res_kwargs(x, residual, residual_bias, sum_out, max_block_c) if x.dtype in SUPPORTED_DTYPES else None
        if res is None:
            x = _residual_first(x, x_bias, residual, residual_bias, sum_out)
            x_bias = None
    elif residual_bias is not None or sum_out is not None:
        raise ValueError("rms_norm_silu: residual_bias / sum_out need a residual")
    if taps:
        return _rms_taps(x, gamma, bias, eps, silu, scale, x_bias, out, int(taps), tile, num_warps, cache_out, res)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm_silu: dtype {x.dtype} not supported")
    if x.dim() < 2:
        raise ValueError(f"rms_norm_silu: expected (N, C, ...), got {tuple(x.shape)}")
    N, C = x.shape[:2]
    g, b, has_bias, xb = affine_args(x, gamma, bias, x_bias)
    if out is not None:
        if tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"rms_norm_silu: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
        if out.dtype not in SUPPORTED_DTYPES + OUT8 or out.device != x.device:
            raise ValueError(f"rms_norm_silu: out must be a float tensor on {x.device} ({out.dtype}, {out.device})")
    scale = float(C) ** 0.5 if scale is None else float(scale)
    sat8 = out is not None and out.dtype in OUT8
    if sat8 and not out_scale:
        raise ValueError("rms_norm_silu: an e4m3 `out` needs out_scale")
    out_mul = 1.0 / float(out_scale) if out_scale else 1.0
    if x.numel() == 0:
        return torch.empty_like(x) if out is None else out
    S = x[0, 0].numel()
    if N * S >= 2**31:
        raise ValueError("rms_norm_silu: N * spatial positions must be < 2**31 (int32 position indices)")
    layout = flat_layout(x)
    xs = _out_strides(x, "cf", S) if layout is None else None  # e.g. a frame slice of an NCDHW tensor
    if layout is None and xs is None:  # odd strides: the one case that relayouts
        x = x.contiguous()
        layout = flat_layout(x)
    kind, stride_n = (layout[0], layout[2]) if layout is not None else ("cf", xs[0])
    ys = _out_strides(out, kind, S) if out is not None else None
    pad = _padded_out(out, kind) if out is not None and ys is None and res is None else None
    if pad is not None:  # the interior of a padded buffer: written in place
        ys, y = (pad.pop("stride_n"), pad.pop("stride_c")), out
    elif ys is None:
        y = new_like(x, kind)  # e4m3 `out`: scaled and saturated here, rounded by the copy below
        ys = (C * S, S if kind == "cf" else 1)
    else:
        y = out
    pad = pad or {}
    tile = tile or default_tile(x.device)
    BLOCK_C = min(triton.next_power_of_2(C), max_block_c)
    one_pass = triton.next_power_of_2(C) <= max_block_c
    xbp = xb if xb is not None else g  # placeholder pointer when absent (never read)
    if kind == "cf":
        # >= 16 positions per row segment keeps loads at least 32-byte sectors wide
        BLOCK_S = min(max(16, tile // BLOCK_C), triton.next_power_of_2(S))
        nw = num_warps or (4 if BLOCK_C * BLOCK_S <= 4096 else 8)
        stride_c = xs[1] if xs is not None else S
        _rms_cf_kernel[(triton.cdiv(S, BLOCK_S), N)](
            x, y, g, b, xbp, C, S, stride_n, stride_c, ys[0], ys[1], scale, float(eps), out_mul,
            BLOCK_C=BLOCK_C, BLOCK_S=BLOCK_S, ONE_PASS=one_pass, HAS_BIAS=has_bias, HAS_XB=xb is not None,
            SILU=silu, SAT8=sat8, EXACT8=y.dtype in OUT8 and x.device.type == "cpu", num_warps=nw, **pad,
        )  # fmt: skip
    else:
        R = N * S
        BLOCK_R = min(max(1, tile // BLOCK_C), triton.next_power_of_2(R))
        nw = num_warps or (4 if BLOCK_C * BLOCK_R <= 4096 else 8)
        _rms_cl_kernel[(triton.cdiv(R, BLOCK_R),)](
            x, y, g, b, xbp, R, S, C, stride_n, ys[0], scale, float(eps), out_mul,
            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ONE_PASS=one_pass, HAS_BIAS=has_bias, HAS_XB=xb is not None,
            SILU=silu, SAT8=sat8, EXACT8=y.dtype in OUT8 and x.device.type == "cpu",
            SILU_MODE=silu_mode(y.dtype, x.device, wan_rms=True), HAS_MUL=out_mul != 1.0, num_warps=nw,
            **(res or {}), **pad,
        )  # fmt: skip
    if out is not None and y is not out:  # an `out` whose strides the kernels cannot address directly
        out.copy_(y)
        return out
    return y


def rms_norm_silu_reference(x, gamma, bias=None, eps=1e-12, silu=True, scale=None, x_bias=None):
    """diffusers' WanRMS_norm (channel_first) + SiLU, op for op (and the fallback off-GPU); x_bias is added to x
    first, in x's dtype (as a conv's own bias add would)."""
    C = x.shape[1]
    shape = (C,) + (1,) * (x.dim() - 2)
    if x_bias is not None:
        x = x + x_bias.to(x.dtype).reshape(shape)
    scale = float(C) ** 0.5 if scale is None else scale
    upcast = x.dtype in (torch.float16, torch.bfloat16)
    y = torch.nn.functional.normalize(x.float() if upcast else x, dim=1, eps=eps).to(x.dtype)
    y = y * scale * gamma.reshape(shape)
    if isinstance(bias, torch.Tensor):
        y = y + bias.reshape(shape)
    elif bias:
        y = y + bias
    return torch.nn.functional.silu(y) if silu else y


__all__ = ["rms_norm_silu", "rms_norm_silu_reference", "SUPPORTED_DTYPES"]
