"""Conv epilogues as one memory pass: out = ((h + bias[c]) + (residual + residual_bias[c])) / scale, optionally
written straight into its 2x nearest-upsampled form; and a row softmax for chunked attention.

Why: with a bias, PyTorch's cuDNN conv path adds it in a separate broadcast kernel after every conv (a full read +
write, E3), and diffusers' ResnetBlock2D then runs `(input + hidden) / output_scale_factor` as two more. Here the conv runs without its bias and one
kernel reads h and the residual once and writes the output once. With `upsample2x`, the Upsample2D interpolate that
follows the last resnet of an up-block disappears too: the kernel writes each value to its 2x2 output pixels
(F.interpolate(scale_factor=2, mode="nearest") copies input (h, w) to exactly those four; bitwise the same).

Layouts: `h` leads. It is viewed as (N, C, S) (see `flat_layout`): "cf" (NCHW, NCDHW, (B, C, L)) or "cl" (NHWC,
NDHWC); anything else is made contiguous first. The output is dense in h's layout, or written into `out=` (e.g. the
frames after the causal history in a video conv's input buffer: any sample stride, and any channel stride for "cf").
The residual may have any strides that flatten to (N, C, S) (e.g. NCHW residual for an NHWC h): it is read through
its own strides, never copied. `groups=G` writes channel group g of sample n as sample n*G + g (Wan's time_conv
output (b, 2c, t) -> frames (b, c, 2t), interleaved), in the same pass.
Arithmetic in fp32, one rounding to h's dtype. The association is diffusers' own: (residual + (h + bias)) / scale,
with the division skipped when scale == 1 (x / 1.0 == x exactly) and done with IEEE rounding (div_rn) otherwise.

DRAM traffic per call (B = bytes of h): torch (bias add 2B + residual add 3B + divide 2B) = 7B (+2B for a shortcut
conv bias); ours 3B. With the upsample: torch 7B + interpolate 5B = 12B; ours 2B + 4B = 6B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vaeopt.kernels.common import (accumulate_shifted, cl_store_partials, default_tile, first_block_shift, flat_layout,
                                   sat_e4m3)
from vaeopt.kernels.group_norm_silu import attach_partials, drop_partials, producer_partials, producer_stats_ok

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _combine(h, b, r, rb, scale, SCALE: tl.constexpr):
    """(r + rb) + (h + b), then / scale (IEEE-rounded, as torch divides) when SCALE; fp32, b/rb pre-broadcast."""
    y = (r + rb) + (h + b)
    if SCALE:
        y = tl.div_rn(y, tl.zeros_like(y) + scale)
    return y


@triton.jit
def _epi_cf_kernel(
    h_ptr,  # [N, C, S]: sample n at h_ptr + n*stride_hn, contiguous [C, S] inside
    b_ptr,  # [C] bias (HAS_B)
    r_ptr,  # residual, element (n, c, s) at n*rsn + c*rsc + s*rss (HAS_R)
    rb_ptr,  # [C] residual bias (HAS_RB)
    y_ptr,  # output: group g of sample n, channel c' at (n*G + g)*stride_yn + c'*stride_yc + s
    NC,
    C,
    S,
    stride_hn,
    rsn,
    rsc,
    rss,
    stride_yn,
    stride_yc,
    CG,  # channels per output group (C // G)
    scale,
    n_s_blocks,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_RB: tl.constexpr,
    SCALE: tl.constexpr,
    R_LIKE_H: tl.constexpr,  # residual laid out like h inside a sample (only its batch stride differs)
):
    t = tl.program_id(0)
    rb_ = t // n_s_blocks
    sb = t % n_s_blocks
    r = rb_ * BLOCK_R + tl.arange(0, BLOCK_R)  # row = n*C + c
    rm = r < NC
    n = r // C
    c = r % C
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    m = rm[:, None] & (s < S)[None, :]
    ho = n.to(tl.int64) * stride_hn + c.to(tl.int64) * S
    h = tl.load(h_ptr + ho[:, None] + s[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + c, mask=rm, other=0.0).to(tl.float32)
    res = tl.zeros([BLOCK_R, BLOCK_S], dtype=tl.float32)
    if HAS_R:
        if R_LIKE_H:
            ro = n.to(tl.int64) * rsn + c.to(tl.int64) * S
            res = tl.load(r_ptr + ro[:, None] + s[None, :], mask=m, other=0.0).to(tl.float32)
        else:
            ro = n.to(tl.int64) * rsn + c.to(tl.int64) * rsc
            res = tl.load(r_ptr + ro[:, None] + s.to(tl.int64)[None, :] * rss, mask=m, other=0.0).to(tl.float32)
    rbv = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_RB:
        rbv = tl.load(rb_ptr + c, mask=rm, other=0.0).to(tl.float32)
    y = _combine(h, b[:, None], res, rbv[:, None], scale, SCALE)
    yo = (n * (C // CG) + c // CG).to(tl.int64) * stride_yn + (c % CG).to(tl.int64) * stride_yc
    tl.store(y_ptr + yo[:, None] + s[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _epi_cl_kernel(
    h_ptr,  # [N, S, C]: sample n at h_ptr + n*stride_hn, contiguous [S, C] inside
    b_ptr,
    r_ptr,  # residual, element (n, c, s) at n*rsn + c*rsc + s*rss
    rb_ptr,
    y_ptr,  # output: group g of sample n at (n*G + g)*stride_yn, a contiguous [S, C // G] block inside
    S,
    C,
    stride_hn,
    rsn,
    rsc,
    rss,
    stride_yn,
    CG,  # channels per output group (C // G)
    scale,
    n_s_blocks,
    n_c_blocks,  # channel blocks per group
    G,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_RB: tl.constexpr,
    SCALE: tl.constexpr,
    R_LIKE_H: tl.constexpr,
):
    # A program covers BLOCK_C channels of one group (so addresses stay contiguous along channels: vector access)
    t = tl.program_id(0)
    cb = t % (n_c_blocks * G)
    t2 = t // (n_c_blocks * G)
    n = t2 // n_s_blocks
    sb = t2 % n_s_blocks
    g = cb // n_c_blocks
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    cl = (cb % n_c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)  # channel within the group
    cm = cl < CG
    cols = g * CG + cl
    m = (s < S)[:, None] & cm[None, :]
    off = s.to(tl.int64)[:, None] * C + cols[None, :]
    h = tl.load(h_ptr + n.to(tl.int64) * stride_hn + off, mask=m, other=0.0).to(tl.float32)
    b = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    res = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    if HAS_R:
        if R_LIKE_H:
            res = tl.load(r_ptr + n.to(tl.int64) * rsn + off, mask=m, other=0.0).to(tl.float32)
        else:
            ro = n.to(tl.int64) * rsn + s.to(tl.int64)[:, None] * rss + cols.to(tl.int64)[None, :] * rsc
            res = tl.load(r_ptr + ro, mask=m, other=0.0).to(tl.float32)
    rbv = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_RB:
        rbv = tl.load(rb_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    y = _combine(h, b[None, :], res, rbv[None, :], scale, SCALE)
    yo = (n * G + g).to(tl.int64) * stride_yn + s.to(tl.int64)[:, None] * CG + cl[None, :]
    tl.store(y_ptr + yo, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _epi_rows(h_row, r_row, rows, cols, m, b, rbv, scale, C, rsc, rss, HAS_R: tl.constexpr, SCALE: tl.constexpr,
              R_LIKE_H: tl.constexpr):
    """The combined fp32 values of rows `rows` (relative to h_row / r_row, a dense [S, C] h) and channels `cols`."""
    off = rows.to(tl.int64)[:, None] * C + cols[None, :]
    h = tl.load(h_row + off, mask=m, other=0.0).to(tl.float32)
    res = tl.zeros_like(h)
    if HAS_R:
        if R_LIKE_H:
            res = tl.load(r_row + off, mask=m, other=0.0).to(tl.float32)
        else:
            ro = rows.to(tl.int64)[:, None] * rss + cols.to(tl.int64)[None, :] * rsc
            res = tl.load(r_row + ro, mask=m, other=0.0).to(tl.float32)
    return _combine(h, b[None, :], res, rbv[None, :], scale, SCALE)


@triton.jit
def _epi_cl_stats_kernel(
    h_ptr,  # [N, S, C]: sample n at h_ptr + n*stride_hn, contiguous [S, C] inside
    b_ptr,
    r_ptr,  # residual, element (n, c, s) at n*rsn + c*rsc + s*rss
    rb_ptr,
    y_ptr,  # [N, S, C] dense
    part_ptr,  # [5, N*G, n_chunks] fp32 out: the next GroupNorm's partials of y (group_norm_silu's stats kernel)
    S,
    C,
    stride_hn,
    rsn,
    rsc,
    rss,
    scale,
    G,  # the norm's groups
    CG,  # its channels per group
    n_chunks,
    iters,  # row blocks (of UNROLL x BLOCK_S rows) per program
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_G: tl.constexpr,
    CG_POW2: tl.constexpr,
    UNROLL: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_RB: tl.constexpr,
    SCALE: tl.constexpr,
    R_LIKE_H: tl.constexpr,
):
    # The stats kernel's chunking (program = chunk of rows of one sample, all channels) with the epilogue's math:
    # each value is stored once and its rounded copy summed around a per-channel shift, as the stats kernel does.
    chunk = tl.program_id(0)
    n = tl.program_id(1)
    s_start = chunk.to(tl.int64) * iters * (BLOCK_S * UNROLL)
    lim = S - s_start
    rows = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_C)
    cm = cols < C
    h_row = h_ptr + n.to(tl.int64) * stride_hn + s_start * C
    y_row = y_ptr + n.to(tl.int64) * S * C + s_start * C
    if R_LIKE_H:
        r_row = r_ptr + n.to(tl.int64) * rsn + s_start * C
    else:
        r_row = r_ptr + n.to(tl.int64) * rsn + s_start * rss
    b = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    rbv = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_RB:
        rbv = tl.load(rb_ptr + cols, mask=cm, other=0.0).to(tl.float32)

    m0 = (rows < lim)[:, None] & cm[None, :]  # the shift: mean of the first row block (read again below, from L2)
    y0 = _epi_rows(h_row, r_row, rows, cols, m0, b, rbv, scale, C, rsc, rss, HAS_R, SCALE, R_LIKE_H)
    k = first_block_shift(y0.to(y_ptr.dtype.element_ty).to(tl.float32), m0, lim, BLOCK_S)
    s1 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    am = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for it in range(iters):
        for u in tl.static_range(UNROLL):
            r = (it * UNROLL + u) * BLOCK_S + rows
            m = (r < lim)[:, None] & cm[None, :]
            y = _epi_rows(h_row, r_row, r, cols, m, b, rbv, scale, C, rsc, rss, HAS_R, SCALE, R_LIKE_H)
            yq = y.to(y_ptr.dtype.element_ty)
            tl.store(y_row + r.to(tl.int64)[:, None] * C + cols[None, :], yq, mask=m)
            s1, s2, am = accumulate_shifted(yq.to(tl.float32), m, k, s1, s2, am)
    cnt = tl.minimum(lim, iters * BLOCK_S * UNROLL).to(tl.float32)
    cl_store_partials(s1, s2, am, k, cnt, part_ptr, n, chunk, n_chunks, tl.num_programs(1), G, CG, cols, cm,
                       BLOCK_G, CG_POW2, True)


@triton.jit
def _epi_up_cf_kernel(
    h_ptr,  # [N, C, H, W]: sample n at h_ptr + n*stride_hn, contiguous [C, H, W] inside
    b_ptr,
    r_ptr,  # residual, element (n, c, i, j) at n*rsn + c*rsc + i*rsh + j*rsw
    rb_ptr,
    y_ptr,  # [N*G, C // G, 2H, 2W]: (n*G + g, c') at (n*G + g)*stride_yn + c'*stride_yc, dense [2H, 2W] inside
    NCH,  # input rows: N*C*H
    C,
    H,
    W,
    stride_hn,
    rsn,
    rsc,
    rsh,
    rsw,
    stride_yn,
    stride_yc,
    CG,
    scale,
    n_w_blocks,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,  # output columns per program
    HAS_B: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_RB: tl.constexpr,
    SCALE: tl.constexpr,
    R_LIKE_H: tl.constexpr,
):
    t = tl.program_id(0)
    rblk = t // n_w_blocks
    wb = t % n_w_blocks
    R = rblk * BLOCK_R + tl.arange(0, BLOCK_R)  # input row (n*C + c)*H + i -> output rows 2R, 2R+1
    rm = R < NCH
    i = R % H
    nc = R // H
    c = nc % C
    n = nc // C
    wo = wb * BLOCK_W + tl.arange(0, BLOCK_W)  # output columns
    W2 = 2 * W
    m = rm[:, None] & (wo < W2)[None, :]
    wi = wo // 2  # input column (each is read twice; the second read hits L1)
    ho = n.to(tl.int64) * stride_hn + (c.to(tl.int64) * H + i) * W
    h = tl.load(h_ptr + ho[:, None] + wi[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + c, mask=rm, other=0.0).to(tl.float32)
    res = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float32)
    if HAS_R:
        if R_LIKE_H:
            ro = n.to(tl.int64) * rsn + (c.to(tl.int64) * H + i) * W
            res = tl.load(r_ptr + ro[:, None] + wi[None, :], mask=m, other=0.0).to(tl.float32)
        else:
            ro = n.to(tl.int64) * rsn + c.to(tl.int64) * rsc + i.to(tl.int64) * rsh
            res = tl.load(r_ptr + ro[:, None] + wi.to(tl.int64)[None, :] * rsw, mask=m, other=0.0).to(tl.float32)
    rbv = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_RB:
        rbv = tl.load(rb_ptr + c, mask=rm, other=0.0).to(tl.float32)
    y = _combine(h, b[:, None], res, rbv[:, None], scale, SCALE).to(y_ptr.dtype.element_ty)
    # output row 2i of (sample n*G + c // CG, channel c % CG); row 2i+1 follows at + W2
    yo = (n * (C // CG) + c // CG).to(tl.int64) * stride_yn + (c % CG).to(tl.int64) * stride_yc + 2 * i * W2
    p = y_ptr + yo[:, None] + wo[None, :]
    tl.store(p, y, mask=m)
    tl.store(p + W2, y, mask=m)


@triton.jit
def _epi_up_cl_kernel(
    h_ptr,  # [N, H, W, C]: sample n at h_ptr + n*stride_hn, contiguous [H, W, C] inside
    b_ptr,
    r_ptr,  # residual, element (n, c, i, j) at n*rsn + c*rsc + i*rsh + j*rsw
    rb_ptr,
    y_ptr,  # [N*G, 2H, 2W, C // G]: sample n*G + g at (n*G + g)*stride_yn, dense [2H, 2W, C // G] inside
    C,
    H,
    W,
    stride_hn,
    rsn,
    rsc,
    rsh,
    rsw,
    stride_yn,
    CG,
    scale,
    n_w_blocks,
    n_c_blocks,  # channel blocks per group
    G,
    BLOCK_W: tl.constexpr,  # output pixels (of one output row pair) per program
    BLOCK_C: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_RB: tl.constexpr,
    SCALE: tl.constexpr,
    R_LIKE_H: tl.constexpr,
):
    t = tl.program_id(0)
    cb = t % (n_c_blocks * G)
    t2 = t // (n_c_blocks * G)
    wb = t2 % n_w_blocks
    row = t2 // n_w_blocks  # n*H + i
    n = row // H
    i = row % H
    g = cb // n_c_blocks
    wo = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    W2 = 2 * W
    cl = (cb % n_c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)  # channel within the group
    cm = cl < CG
    cols = g * CG + cl
    m = (wo < W2)[:, None] & cm[None, :]
    wi = wo // 2
    hoff = i.to(tl.int64) * W * C + wi.to(tl.int64)[:, None] * C + cols[None, :]
    h = tl.load(h_ptr + n.to(tl.int64) * stride_hn + hoff, mask=m, other=0.0).to(tl.float32)
    b = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    res = tl.zeros([BLOCK_W, BLOCK_C], dtype=tl.float32)
    if HAS_R:
        if R_LIKE_H:
            res = tl.load(r_ptr + n.to(tl.int64) * rsn + hoff, mask=m, other=0.0).to(tl.float32)
        else:
            rbase = n.to(tl.int64) * rsn + i.to(tl.int64) * rsh
            ro = rbase + wi.to(tl.int64)[:, None] * rsw + cols.to(tl.int64)[None, :] * rsc
            res = tl.load(r_ptr + ro, mask=m, other=0.0).to(tl.float32)
    rbv = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_RB:
        rbv = tl.load(rb_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    y = _combine(h, b[None, :], res, rbv[None, :], scale, SCALE).to(y_ptr.dtype.element_ty)
    # output row 2i of sample n*G + g, then row 2i+1 one output row (2W*CG elements) further
    yo = (n * G + g).to(tl.int64) * stride_yn + (2 * i.to(tl.int64) * W2 + wo.to(tl.int64)[:, None]) * CG
    p = y_ptr + yo + cl[None, :]
    tl.store(p, y, mask=m)
    tl.store(p + W2 * CG, y, mask=m)


@triton.jit
def _softmax_rows_kernel(
    s_ptr,  # [R, L] fp32 scores, row stride stride_s
    p_ptr,  # [R, L] out (any float dtype), row stride stride_p
    L,
    stride_s,
    stride_p,
    scale,
    rs_ptr,  # [R] fp32 out, UNNORM only: 1 / (pscale * row sum)
    pscale,  # UNNORM only: the written p is exp(x - row max) * pscale (row max -> pscale exactly)
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # L <= BLOCK: the whole row stays in registers
    UNNORM: tl.constexpr,  # write unnormalized p (for an fp8 P: its row scale goes into the next GEMM)
    EXACT8: tl.constexpr,  # p is e4m3 under the CPU interpreter: round on the grid first (its cast is not RTN)
):
    row = tl.program_id(0).to(tl.int64)
    src = s_ptr + row * stride_s
    dst = p_ptr + row * stride_p
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        m = offs < L
        x = tl.load(src + offs, mask=m, other=-float("inf")).to(tl.float32) * scale
        e = tl.exp(x - tl.max(x, axis=0))
        if UNNORM:
            tl.store(dst + offs, sat_e4m3(e * pscale, EXACT8).to(p_ptr.dtype.element_ty), mask=m)
            tl.store(rs_ptr + row, 1.0 / (pscale * tl.sum(e, axis=0)))
        else:
            tl.store(dst + offs, (e / tl.sum(e, axis=0)).to(p_ptr.dtype.element_ty), mask=m)
    else:  # online max/sum, then a second read (from L2 for VAE-sized rows) to write exp / sum
        mx = tl.full([BLOCK], -float("inf"), dtype=tl.float32)
        sm = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, L, BLOCK):
            o = start + offs
            x = tl.load(src + o, mask=o < L, other=-float("inf")).to(tl.float32) * scale
            new = tl.maximum(mx, x)
            # lanes still at -inf (no value yet) keep sum 0 instead of exp(nan)
            sm = tl.where(new == -float("inf"), 0.0, sm * tl.exp(mx - new) + tl.exp(x - new))
            mx = new
        gmax = tl.max(mx, axis=0)
        total = tl.sum(tl.where(mx == -float("inf"), 0.0, sm * tl.exp(mx - gmax)), axis=0)
        if UNNORM:
            inv = pscale
            tl.store(rs_ptr + row, 1.0 / (pscale * total))
        else:
            inv = 1.0 / total
        for start in range(0, L, BLOCK):
            o = start + offs
            x = tl.load(src + o, mask=o < L, other=-float("inf")).to(tl.float32) * scale
            y = tl.exp(x - gmax) * inv
            if UNNORM:
                y = sat_e4m3(y, EXACT8)
            tl.store(dst + o, y.to(p_ptr.dtype.element_ty), mask=o < L)


# --- launchers ---------------------------------------------------------------------------------------------------


def _nc_s_strides(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(stride_n, stride_c, stride_s) when t's spatial dims flatten to one strided dim (any layout), else None."""
    st = t.stride()
    dims = [(n, s) for n, s in zip(t.shape[2:], st[2:]) if n != 1]
    if not all(s0 == s1 * n1 for (_, s0), (n1, s1) in zip(dims, dims[1:])):
        return None
    return st[0], st[1], (dims[-1][1] if dims else 1)


def _check_vec(name: str, v: torch.Tensor | None, C: int) -> torch.Tensor | None:
    if v is None:
        return None
    if v.numel() != C:
        raise ValueError(f"bias_residual: {name} has {v.numel()} values for {C} channels")
    return v.reshape(C)


def _dense(shape: tuple, kind: str, like: torch.Tensor) -> torch.Tensor:
    """Dense empty tensor of `shape` in layout kind ("cf": contiguous, "cl": channels last)."""
    if kind == "cf":
        return torch.empty(shape, device=like.device, dtype=like.dtype)
    return torch.empty((shape[0], *shape[2:], shape[1]), device=like.device, dtype=like.dtype).movedim(-1, 1)


def _same_inner(t: torch.Tensor, ref: torch.Tensor) -> bool:
    """t has ref's strides in every non-batch dim of size > 1 (batch strides may differ)."""
    return all(a == b for a, b, n in zip(t.stride()[1:], ref.stride()[1:], t.shape[1:]) if n > 1)


def _out_strides(out: torch.Tensor, kind: str) -> tuple[int, int] | None:
    """(stride_n, stride_c) of `out` (N, C, *spatial) when the kernels can write it directly: per sample a contiguous
    [S, C] block for "cl"; for "cf" spatial dims merging into one of stride 1 (any channel stride). Else None."""
    st = _nc_s_strides(out)
    if st is None:
        return None
    sn, sc, ss = st
    C = out.shape[1]
    S = out[0, 0].numel() if out.numel() else 0
    if kind == "cl":
        return (sn, 1) if (C == 1 or sc == 1) and (S <= 1 or ss == C) else None
    return (sn, sc) if S <= 1 or ss == 1 else None


def bias_residual(
    h: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    scale: float = 1.0,
    upsample2x: bool = False,
    *,
    residual_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    groups: int = 1,
    tile: int | None = None,
    num_warps: int | None = None,
    stats_groups: int | None = None,
) -> torch.Tensor:
    """((residual + residual_bias[c]) + (h + bias[c])) / scale for h of shape (N, C, *spatial), in h's layout.

    bias / residual_bias: [C] or None. residual: h's shape, any strides (or None). scale: diffusers'
    output_scale_factor (1.0: no division). upsample2x (4-D only): return the result 2x nearest-upsampled,
    (N, C, 2H, 2W), written directly: equal to F.interpolate(result, scale_factor=2, mode="nearest").
    groups=G (C divisible by G): the channels are G consecutive groups and the result is returned as
    (N*G, C/G, ...), group g of sample n becoming sample n*G + g -- Wan's time_conv interleave (channel half j of
    latent frame i is output frame 2i + j), written by the same pass.
    out: write the result there (its shape must be the result's) and return it; the kernels address it directly if
    each of its samples is laid out like the result (h's layout kind; channels-first: any channel stride), e.g. a
    frame range of a larger NDHWC / NCDHW buffer; otherwise the result is copied in.
    `tile` (elements per program) and `num_warps` are tuning knobs.
    stats_groups=G: the result goes to a GroupNorm of G groups next. Where h is channels-last (no upsample2x, groups,
    out), the same pass also takes that norm's statistics of the result (rounded, as the norm reads it) and notes
    them on the result (`group_norm_silu.attach_partials`): the norm then skips its statistics pass, one full read.
    Elsewhere the result carries no note and the norm reads it as usual.
    """
    if h.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"bias_residual: dtype {h.dtype} not supported")
    if h.dim() < 2:
        raise ValueError(f"bias_residual: expected (N, C, ...), got {tuple(h.shape)}")
    if upsample2x and h.dim() != 4:
        raise ValueError(f"bias_residual: upsample2x needs (N, C, H, W), got {tuple(h.shape)}")
    N, C = h.shape[:2]
    G = int(groups)
    if G < 1 or C % G:
        raise ValueError(f"bias_residual: {C} channels do not split into {groups} groups")
    CG = C // G
    bias = _check_vec("bias", bias, C)
    residual_bias = _check_vec("residual_bias", residual_bias, C)
    if residual is not None:
        if tuple(residual.shape) != tuple(h.shape):
            raise ValueError(f"bias_residual: residual {tuple(residual.shape)} vs h {tuple(h.shape)}")
        if residual.device != h.device:
            raise ValueError("bias_residual: residual on another device")
    layout = flat_layout(h)
    if layout is None:  # odd strides: the only relayout
        h = h.contiguous()
        layout = flat_layout(h)
    kind, S, stride_hn = layout
    spatial = (2 * h.shape[2], 2 * h.shape[3]) if upsample2x else tuple(h.shape[2:])
    shape = (N * G, CG, *spatial)
    if out is not None:
        if tuple(out.shape) != shape:
            raise ValueError(f"bias_residual: out has shape {tuple(out.shape)}, the result {shape}")
        if out.dtype not in SUPPORTED_DTYPES or out.device != h.device:
            raise ValueError(f"bias_residual: out must be a float tensor on {h.device} ({out.dtype}, {out.device})")
    if out is not None:
        drop_partials(out)  # its data changes here: a note of its statistics would be stale
    ys = _out_strides(out, kind) if out is not None else None
    y = out if ys is not None else _dense(shape, kind, h)
    if ys is None:
        ys = _out_strides(y, kind)
    if h.numel() == 0:
        return out if out is not None else y
    rs = (0, 0, 0, 0) if upsample2x else (0, 0, 0)
    like = False
    if residual is not None:
        like = _same_inner(residual, h)
        if upsample2x:
            rs = residual.stride()
        else:
            rs = _nc_s_strides(residual)
            if rs is None:  # spatial dims that do not merge: make it h-like once
                residual = residual.contiguous(memory_format=torch.channels_last if kind == "cl" and h.dim() == 4
                                               else torch.contiguous_format)
                like = _same_inner(residual, h)
                rs = _nc_s_strides(residual)
    dummy = h  # a valid pointer for absent operands (never read: the HAS_* flags are constexpr)
    flags = dict(HAS_B=bias is not None, HAS_R=residual is not None, HAS_RB=residual_bias is not None,
                 SCALE=float(scale) != 1.0, R_LIKE_H=like)
    args = (h, bias if bias is not None else dummy, residual if residual is not None else dummy,
            residual_bias if residual_bias is not None else dummy, y)
    sc = float(scale)
    if stats_groups and not upsample2x and kind == "cl" and G == 1 and out is None \
            and producer_stats_ok(C, int(stats_groups), h[0].numel(), h.device):
        _launch_stats_epilogue(args, flags, N, C, S, stride_hn, rs, sc, int(stats_groups))
        return y
    tile = tile or default_tile(h.device)
    nw = num_warps or (4 if tile <= 4096 else 8)

    if not upsample2x and kind == "cf":
        BS = min(triton.next_power_of_2(S), max(1024, tile // 4))
        BR = max(1, min(tile // BS, triton.next_power_of_2(N * C)))
        nsb = triton.cdiv(S, BS)
        grid = (nsb * triton.cdiv(N * C, BR),)
        _epi_cf_kernel[grid](*args, N * C, C, S, stride_hn, *rs, ys[0], ys[1], CG, sc, nsb,
                             BLOCK_R=BR, BLOCK_S=BS, **flags, num_warps=nw)
    elif not upsample2x:
        BC = min(triton.next_power_of_2(CG), 1024)
        BS = max(1, min(tile // BC, triton.next_power_of_2(S)))
        nsb, ncb = triton.cdiv(S, BS), triton.cdiv(CG, BC)
        _epi_cl_kernel[(N * nsb * ncb * G,)](*args, S, C, stride_hn, *rs, ys[0], CG, sc, nsb, ncb, G,
                                             BLOCK_S=BS, BLOCK_C=BC, **flags, num_warps=nw)
    elif kind == "cf":
        Hh, Ww = h.shape[2:]
        BW = min(triton.next_power_of_2(2 * Ww), max(256, tile // 4))
        BR = max(1, min(tile // BW, triton.next_power_of_2(N * C * Hh)))
        nwb = triton.cdiv(2 * Ww, BW)
        grid = (nwb * triton.cdiv(N * C * Hh, BR),)
        _epi_up_cf_kernel[grid](*args, N * C * Hh, C, Hh, Ww, stride_hn, *rs, ys[0], ys[1], CG, sc, nwb,
                                BLOCK_R=BR, BLOCK_W=BW, **flags, num_warps=nw)
    else:
        Hh, Ww = h.shape[2:]
        BC = min(triton.next_power_of_2(CG), 1024)
        BW = max(1, min(tile // BC, triton.next_power_of_2(2 * Ww)))
        nwb, ncb = triton.cdiv(2 * Ww, BW), triton.cdiv(CG, BC)
        _epi_up_cl_kernel[(N * Hh * nwb * ncb * G,)](*args, C, Hh, Ww, stride_hn, *rs, ys[0], CG, sc, nwb, ncb, G,
                                                     BLOCK_W=BW, BLOCK_C=BC, **flags, num_warps=nw)
    if out is not None and y is not out:  # an `out` the kernels cannot address: filled by a copy
        out.copy_(y)
        return out
    return y


def _epi_stats_launch(C: int, dev: torch.device) -> tuple[int, int, int, int]:
    """(tile, warps, programs per SM, row blocks per iteration) of the epilogue that also takes GroupNorm statistics,
    on CUDA, measured at SDXL's shapes (E26: the stats kernel's own launch made it slower)."""
    return (4096, 4, 4, 1) if C <= 128 else (4096, 4, 4, 2)


def _launch_stats_epilogue(args, flags, N: int, C: int, S: int, stride_hn: int, rs, sc: float, G: int) -> None:
    """bias_residual's channels-last pass that also writes the partials of the next GroupNorm (G groups) and notes
    them on its output (args[-1])."""
    h, y = args[0], args[-1]
    g, part, kw = producer_partials(N, C, G, S, h.device, _epi_stats_launch(C, h.device))
    _epi_cl_stats_kernel[(g["n_chunks"], N)](
        *args, part, S, C, stride_hn, *rs, sc, G, C // G, g["n_chunks"], g["iters"], **kw, **flags,
    )  # fmt: skip
    attach_partials(y, G, part)


def upsample_nearest2x(x: torch.Tensor, **kw) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2, mode="nearest") for (N, C, H, W), bitwise, in x's layout (one read, one
    4x write; aten's NHWC kernel is ~2.7x slower than its NCHW one)."""
    return bias_residual(x, upsample2x=True, **kw)


def softmax_rows(s: torch.Tensor, scale: float, out_dtype: torch.dtype, *, block: int | None = None,
                 out: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
                 pscale: float = 1.0) -> torch.Tensor:
    """softmax(s * scale, dim=-1) of scores s (..., L) (fp32, or bf16/fp16 for the fp8 attention; last dim
    contiguous), computed in fp32 and written once in out_dtype: one read of s, one write of p (torch: softmax 2
    passes + cast 1.5 passes).

    row_scale (an fp32 tensor of s.shape[:-1]): write p unnormalized instead, exp(s * scale - row max) * pscale, so
    each row's largest entry is exactly pscale (an fp8 P uses e4m3's whole range), and 1 / (pscale * row sum) into
    row_scale: softmax = p * row_scale, which the P @ V GEMM applies as its row scale."""
    if s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError("softmax_rows: scores must be float32, bfloat16 or float16")
    L = s.shape[-1]
    s2 = s.reshape(-1, L)
    if s2.stride(-1) != 1:
        s2 = s2.contiguous()
    p = out if out is not None else torch.empty(s.shape, device=s.device, dtype=out_dtype)
    p2 = p.view(-1, L)
    if s2.shape[0] == 0 or L == 0:
        return p
    if block is None:
        block = 16384 if s.is_cuda else 1 << 20
    BLOCK = min(triton.next_power_of_2(L), block)
    nw = 4 if BLOCK <= 2048 else (8 if BLOCK <= 8192 else 16)
    unnorm = row_scale is not None
    if unnorm and (row_scale.dtype != torch.float32 or row_scale.numel() != s2.shape[0]
                   or not row_scale.is_contiguous()):
        raise ValueError("softmax_rows: row_scale must be a contiguous float32 tensor of one value per row")
    rs = row_scale.view(-1) if unnorm else s2  # (a placeholder pointer when not UNNORM)
    _softmax_rows_kernel[(s2.shape[0],)](s2, p2, L, s2.stride(0), p2.stride(0), float(scale), rs, float(pscale),
                                         BLOCK=BLOCK, ONE_PASS=L <= BLOCK, UNNORM=unnorm,
                                         EXACT8=unnorm and p.element_size() == 1 and not s.is_cuda, num_warps=nw)
    return p


__all__ = ["bias_residual", "upsample_nearest2x",
           "softmax_rows", "SUPPORTED_DTYPES"]
