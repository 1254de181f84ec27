"""Fused GroupNorm (+ optional SiLU) for NCHW / NHWC / NCDHW / NDHWC activations, output in the input's layout.

Why: aten GroupNorm reduces with one CUDA block per (sample, group) and relayouts channels_last inputs; SiLU is one
more full read+write (docs/kernels.md, E1). Here:

  1. stats     many programs per (n, group): each reduces a chunk to (count, mean, M2). Sums are taken around a
               shift (the mean of the chunk's first block), so there is no E[x^2]-E[x]^2 cancellation.
  2. finalize  one tiny program per (n, group) merges the chunks exactly (Chan et al.) and writes per-(n, channel)
               mean and rstd*weight.
  3. apply     elementwise y = (x - mean) * a + bias, SiLU, one read + one write. Tiles are visited in the reverse of
               the stats order, so the tail that stats read last is still in L2.

Input bias (`x_bias`, optional [C]): the kernels normalize x + x_bias[c] instead of x, so a conv can run without its
bias (cuDNN would add it in a separate broadcast pass). Stats add it on load; finalize subtracts it from the
per-channel mean it writes (mean' = mean_g - x_bias[c]), so apply is unchanged: (x - mean') * a + b.

Split API (the exact tiled decoder, whose norms need the statistics of an activation only ever seen a tile at a time):
`group_norm_partials` returns a tile's per-chunk (count, mean, M2) partials (those of disjoint tiles concatenate into
those of their union); `group_norm_finalize` merges any number of them exactly in one launch; `group_norm_apply`
(gn_window.py) normalizes a region of a larger buffer with them. `merge_partials` is the float64 torch reference.

Layouts: every tensor is seen as (N, C, S) with S = flattened spatial dims; "channels-first" means each sample is a
contiguous [C, S] block (NCHW, NCDHW, (B, C, L)), "channels-last" means a contiguous [S, C] block (NHWC, NDHWC,
(B, C, L) with channel stride 1). Anything else is made contiguous first (the only relayout, and only for odd strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vaeopt.kernels.common import (cl_store_partials, default_tile, default_warps, flat_layout, n_programs_target,
                                   new_like, sat_e4m3, silu, silu_mode)
from vaeopt.kernels.fp8_quant import E4M3
from vaeopt.kernels.gn_window import group_norm_apply  # noqa: F401  (the split API's last step, re-exported)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (tile, warps) of the channels-last apply on CUDA where the caller sets none (measured at SDXL's shapes, E24)
APPLY_CL_CUDA = (8192, 4)


@triton.jit
def _stats_cf_kernel(
    x_ptr,  # [N, G, L]: sample n at x_ptr + n*stride_n, group g is the contiguous run [g*L, (g+1)*L)
    part_ptr,  # [3, NG, n_chunks] fp32: count, mean, M2 of each chunk
    xb_ptr,  # [C] input bias (read only when XB > 0)
    NG,
    L,
    stride_n,
    G,
    n_chunks,
    iters,  # blocks per chunk
    S,  # spatial size: element o of a group belongs to its channel o // S
    CG,
    BLOCK_GR: tl.constexpr,  # (n, group) rows per program: 1 for big groups, more when groups are small
    BLOCK: tl.constexpr,
    XB: tl.constexpr,  # input bias: 0 none, 1 one channel per block (S % BLOCK == 0), 2 per element
):
    chunk = tl.program_id(0)
    ng = tl.program_id(1) * BLOCK_GR + tl.arange(0, BLOCK_GR)
    ngm = ng < NG
    n = ng // G
    g = ng % G
    start = chunk.to(tl.int64) * iters * BLOCK  # element offset inside each group
    row = x_ptr + n.to(tl.int64) * stride_n + g.to(tl.int64) * L + start  # [BLOCK_GR] pointers
    lim = L - start  # elements of each group from `start` on (>= 1)
    offs = tl.arange(0, BLOCK)

    # Shift by the first block's mean: sum/sumsq of (x - k) stay well-conditioned even when |mean| >> std.
    m0 = ngm[:, None] & (offs < lim)[None, :]
    x0 = tl.load(row[:, None] + offs[None, :], mask=m0, other=0.0).to(tl.float32)
    gc = g * CG  # first channel of each row's group
    if XB == 1:  # the whole block lies in one channel: one bias value per row
        b0 = tl.load(xb_ptr + gc + (start // S).to(tl.int32), mask=ngm, other=0.0).to(tl.float32)
        x0 = tl.where(m0, x0 + b0[:, None], 0.0)
    elif XB == 2:  # odd sizes: channel of each element
        cl0 = (start.to(tl.int32) + offs) // S
        x0 = tl.where(m0, x0 + tl.load(xb_ptr + gc[:, None] + cl0[None, :], mask=m0, other=0.0).to(tl.float32), 0.0)
    k = tl.sum(x0, axis=1) / tl.minimum(lim, BLOCK).to(tl.float32)  # [BLOCK_GR]

    s1 = tl.zeros([BLOCK_GR, BLOCK], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_GR, BLOCK], dtype=tl.float32)
    for it in range(iters):
        o = it * BLOCK + offs
        m = ngm[:, None] & (o < lim)[None, :]
        x = tl.load(row[:, None] + o[None, :], mask=m, other=0.0).to(tl.float32)
        if XB == 1:
            cb = ((start + it * BLOCK) // S).to(tl.int32)
            x += tl.load(xb_ptr + gc + cb, mask=ngm, other=0.0).to(tl.float32)[:, None]
        elif XB == 2:
            cl = (start.to(tl.int32) + o) // S
            x += tl.load(xb_ptr + gc[:, None] + cl[None, :], mask=m, other=0.0).to(tl.float32)
        d = tl.where(m, x - k[:, None], 0.0)
        s1 += d
        s2 += d * d
    cnt = tl.minimum(lim, iters * BLOCK).to(tl.float32)
    t1 = tl.sum(s1, axis=1)
    t2 = tl.sum(s2, axis=1)
    out = part_ptr + ng * n_chunks + chunk
    plane = n_chunks * NG
    tl.store(out, tl.zeros([BLOCK_GR], dtype=tl.float32) + cnt, mask=ngm)
    tl.store(out + plane, k + t1 / cnt, mask=ngm)
    tl.store(out + 2 * plane, tl.maximum(t2 - t1 * t1 / cnt, 0.0), mask=ngm)


@triton.jit
def _stats_cl_kernel(
    x_ptr,  # [N, S, C]: sample n at x_ptr + n*stride_n, channel stride 1, spatial stride C
    part_ptr,  # [3, N*G, n_chunks] fp32: count, mean, M2 of each chunk
    xb_ptr,  # [C] input bias (read only when XB)
    S,
    C,
    CG,  # channels per group
    G,
    stride_n,
    n_chunks,
    iters,  # row blocks per chunk
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_G: tl.constexpr,
    CG_POW2: tl.constexpr,  # CG if it is a power of 2, else 0
    XB: tl.constexpr,  # add the input bias xb[c]
    MINMAX: tl.constexpr = False,  # also write bounds of each group's max and min (planes 3, 4), for an e4m3 output
    UNROLL: tl.constexpr = 1,  # row blocks loaded per loop iteration into the same accumulators (more loads in flight)
):
    chunk = tl.program_id(0)
    n = tl.program_id(1)
    s_start = chunk.to(tl.int64) * iters * (BLOCK_S * UNROLL)
    base = x_ptr + n.to(tl.int64) * stride_n + s_start * C
    lim = S - s_start  # spatial rows of this sample from s_start on (>= 1)
    rows = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_C)
    cm = cols < C

    # Per-channel shift = mean of the chunk's first row block (see _stats_cf_kernel).
    m0 = (rows < lim)[:, None] & cm[None, :]
    x0 = tl.load(base + rows[:, None] * C + cols[None, :], mask=m0, other=0.0).to(tl.float32)
    if XB:
        xbc = tl.load(xb_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        x0 = tl.where(m0, x0 + xbc[None, :], 0.0)
    k = tl.sum(x0, axis=0) / tl.minimum(lim, BLOCK_S).to(tl.float32)  # [BLOCK_C]

    # Whole rows are contiguous in memory: loads stay coalesced/vectorized whatever the group size.
    s1 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    # running elementwise max |x - k| when MINMAX (reducing every row block instead measured 1.3-2.9x slower, H200)
    am = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for it in range(iters):
        for u in tl.static_range(UNROLL):
            r = (it * UNROLL + u) * BLOCK_S + rows
            m = (r < lim)[:, None] & cm[None, :]
            x = tl.load(base + r[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if XB:
                x += xbc[None, :]
            d = tl.where(m, x - k[None, :], 0.0)
            s1 += d
            s2 += d * d
            if MINMAX:  # one op on the shifted value the sums already need (masked rows are 0)
                am = tl.maximum(am, tl.abs(d))
    cnt = tl.minimum(lim, iters * BLOCK_S * UNROLL).to(tl.float32)  # rows seen; same for every channel
    cl_store_partials(s1, s2, am, k, cnt, part_ptr, n, chunk, n_chunks, tl.num_programs(1), G, CG,
                       cols, cm, BLOCK_G, CG_POW2, MINMAX)


@triton.jit
def _finalize_kernel(
    part_ptr,  # [3, NG, n_chunks] fp32
    w_ptr,  # [C] affine weight
    xb_ptr,  # [C] input bias (read only when XB)
    mean_ptr,  # [N, C] fp32 out: mean of the channel's group, minus the channel's input bias
    a_ptr,  # [N, C] fp32 out: rstd * weight
    b_ptr,  # [C] affine bias (read only when BOUND)
    bound_ptr,  # [N, C] fp32 out (BOUND): an upper bound of |output| of the channel
    NG,
    C,
    G,
    CG,
    n_chunks,
    eps,
    BLOCK_NG: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_CG: tl.constexpr,
    XB: tl.constexpr,
    BOUND: tl.constexpr = False,  # partials carry group max/min bounds (planes 3, 4): write per-channel output bounds
    SILU: tl.constexpr = False,
):
    ng = tl.program_id(0) * BLOCK_NG + tl.arange(0, BLOCK_NG)  # (n, group) pairs of this program
    ngm = ng < NG
    plane = n_chunks * NG
    p = tl.arange(0, BLOCK_P)
    # Exact parallel merge: mean = sum(n_i mean_i) / n, M2 = sum(M2_i + n_i (mean_i - mean)^2).
    acc_n = tl.zeros([BLOCK_NG, BLOCK_P], dtype=tl.float32)
    acc_s = tl.zeros([BLOCK_NG, BLOCK_P], dtype=tl.float32)
    for c0 in range(0, n_chunks, BLOCK_P):
        m = ngm[:, None] & (c0 + p < n_chunks)[None, :]
        off = ng[:, None] * n_chunks + c0 + p[None, :]
        cnt = tl.load(part_ptr + off, mask=m, other=0.0)
        mu = tl.load(part_ptr + plane + off, mask=m, other=0.0)
        acc_n += cnt
        acc_s += cnt * mu
    total = tl.maximum(tl.sum(acc_n, axis=1), 1.0)  # [BLOCK_NG]
    mean = tl.sum(acc_s, axis=1) / total
    acc_m2 = tl.zeros([BLOCK_NG, BLOCK_P], dtype=tl.float32)
    for c0 in range(0, n_chunks, BLOCK_P):
        m = ngm[:, None] & (c0 + p < n_chunks)[None, :]
        off = ng[:, None] * n_chunks + c0 + p[None, :]
        cnt = tl.load(part_ptr + off, mask=m, other=0.0)
        dmu = tl.load(part_ptr + plane + off, mask=m, other=0.0) - mean[:, None]
        acc_m2 += tl.load(part_ptr + 2 * plane + off, mask=m, other=0.0) + cnt * dmu * dmu
    var = tl.sum(acc_m2, axis=1) / total  # biased, as nn.GroupNorm
    rstd = 1.0 / tl.sqrt(var + eps)

    n = ng // G
    g = ng % G
    j = tl.arange(0, BLOCK_CG)
    cm = ngm[:, None] & (j < CG)[None, :]
    c = g[:, None] * CG + j[None, :]  # [BLOCK_NG, BLOCK_CG] channel ids
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    out = n[:, None] * C + c
    mean_c = tl.zeros([BLOCK_NG, BLOCK_CG], dtype=tl.float32) + mean[:, None]
    if XB:  # apply computes (x - mean') * a: with mean' = mean - xb[c] that is (x + xb[c] - mean) * a
        mean_c -= tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(mean_ptr + out, mean_c, mask=cm)
    a = rstd[:, None] * w
    tl.store(a_ptr + out, a, mask=cm)
    if BOUND:
        # apply computes y = (x + xb - mean) * a + b, and x + xb lies in [lo, hi] of its group
        hi = tl.full([BLOCK_NG], float("-inf"), dtype=tl.float32)
        lo = tl.full([BLOCK_NG], float("inf"), dtype=tl.float32)
        for c0 in range(0, n_chunks, BLOCK_P):
            m = ngm[:, None] & (c0 + p < n_chunks)[None, :]
            off = ng[:, None] * n_chunks + c0 + p[None, :]
            hi = tl.maximum(hi, tl.max(tl.load(part_ptr + 3 * plane + off, mask=m, other=float("-inf")), axis=1))
            lo = tl.minimum(lo, tl.min(tl.load(part_ptr + 4 * plane + off, mask=m, other=float("inf")), axis=1))
        b = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
        e1 = (hi - mean)[:, None] * a + b
        e2 = (lo - mean)[:, None] * a + b
        top = tl.maximum(e1, e2)
        if SILU:  # silu rises above y > -1.28 and never goes below -0.2785
            bnd = tl.maximum(top, 0.2785)
        else:
            bnd = tl.maximum(tl.abs(e1), tl.abs(e2))
        tl.store(bound_ptr + out, tl.where(cm, bnd, 0.0), mask=cm)


@triton.jit
def _apply_cf_kernel(
    x_ptr,  # [N, C, S]: sample n at x_ptr + n*stride_xn, contiguous [C, S] inside
    y_ptr,  # [N, C, S] dense
    mean_ptr,  # [N, C] fp32
    a_ptr,  # [N, C] fp32
    b_ptr,  # [C] affine bias
    NC,
    C,
    S,
    stride_xn,
    n_s_blocks,
    n_tiles,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SILU: tl.constexpr,
):
    t = n_tiles - 1 - tl.program_id(0)  # reverse of the stats order: L2 still holds what stats read last
    rb = t // n_s_blocks
    sb = t % n_s_blocks
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)  # row = n*C + c
    rm = r < NC
    n = r // C
    c = r % C
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    m = rm[:, None] & (s < S)[None, :]
    mu = tl.load(mean_ptr + r, mask=rm, other=0.0)
    a = tl.load(a_ptr + r, mask=rm, other=0.0)
    b = tl.load(b_ptr + c, mask=rm, other=0.0).to(tl.float32)
    xo = n.to(tl.int64) * stride_xn + c.to(tl.int64) * S
    x = tl.load(x_ptr + xo[:, None] + s[None, :], mask=m, other=0.0).to(tl.float32)
    y = (x - mu[:, None]) * a[:, None] + b[:, None]
    if SILU:
        y = y / (1.0 + tl.exp(-y))  # SiLU (exp -> inf gives the right limit, -0)
    yo = r.to(tl.int64) * S
    tl.store(y_ptr + yo[:, None] + s[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _apply_cl_kernel(
    x_ptr,  # [N, S, C]: sample n at x_ptr + n*stride_xn, contiguous [S, C] inside
    y_ptr,  # [N, S, C] dense
    mean_ptr,  # [N, C] fp32
    a_ptr,  # [N, C] fp32
    b_ptr,  # [C] affine bias
    S,
    C,
    stride_xn,
    n_s_blocks,
    n_tiles,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SILU: tl.constexpr,
    bound_ptr=None,  # [N, C] fp32 (OUT8): per-channel bounds of |y| from the finalize kernel
    s_ptr=None,  # [N] fp32 out (OUT8): the sample's e4m3 scale, y ~= y_ptr value * scale
    OUT8: tl.constexpr = False,  # y_ptr is float8_e4m3fn: y / scale, scale = max bound / 448 (per sample)
    EXACT8: tl.constexpr = False,  # round to the e4m3 grid before the cast (the CPU interpreter's cast misrounds)
    amax_ptr=None,  # [N] fp32 (PRE_AMAX): the largest per-channel bound of each sample, computed once
    PRE_AMAX: tl.constexpr = False,
    SILU_MODE: tl.constexpr = 0,  # see common.silu
    OUT_I8: tl.constexpr = False,  # with OUT8: y_ptr is int8, y ~= scale * (q + zq) over [lo, max bound] (see below)
    zq_ptr=None,  # [N] fp32 out (OUT_I8): the sample's zero point in units of its scale
):
    t = n_tiles - 1 - tl.program_id(0)  # reverse of the stats order (see _apply_cf_kernel)
    n = t // n_s_blocks
    sb = t % n_s_blocks
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_C)
    cm = cols < C
    m = (s < S)[:, None] & cm[None, :]
    mu = tl.load(mean_ptr + n * C + cols, mask=cm, other=0.0)
    a = tl.load(a_ptr + n * C + cols, mask=cm, other=0.0)
    b = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    off = s.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + n.to(tl.int64) * stride_xn + off, mask=m, other=0.0).to(tl.float32)
    y = (x - mu[None, :]) * a[None, :] + b[None, :]
    if SILU:
        y = silu(y, SILU_MODE)
    if OUT8:
        if PRE_AMAX:
            amax = tl.maximum(tl.load(amax_ptr + n), 1e-12)
        else:
            amax = tl.maximum(tl.max(tl.load(bound_ptr + n * C + cols, mask=cm, other=0.0), axis=0), 1e-12)
        if OUT_I8:  # 255 levels over [lo, amax]: SiLU's output never goes below -0.27846 (its minimum)
            if SILU:
                lo = amax * 0.0 - 0.27847
            else:
                lo = -amax
            sc = (amax - lo) / 254.0
            zq = (amax + lo) / (2.0 * sc)
            # the code round(y / sc - zq) in [-127, 127], rounded by adding 1.5 * 2^23: the sum's low mantissa
            # bits hold the integer, and its bits' low byte is the int8 code (the store truncates). No floor or
            # float -> int conversion: quarter-rate instructions on sm_90, +0.29 ms per sdxl-1024 decode (E46)
            v = (y * (254.0 / (amax - lo)) - zq) + 12582912.0  # (12582912 - zq would lose zq's fraction)
            y = tl.minimum(tl.maximum(v, 12582912.0 - 127.0), 12582912.0 + 127.0).to(tl.int32, bitcast=True)
            if sb == 0:
                tl.store(s_ptr + n, sc)
                tl.store(zq_ptr + n, zq)
        else:
            y = sat_e4m3(y * (448.0 / amax), EXACT8)
            if sb == 0:
                tl.store(s_ptr + n, amax / 448.0)
    tl.store(y_ptr + n.to(tl.int64) * S * C + off, y.to(y_ptr.dtype.element_ty), mask=m)


def _cl_blocks(C: int, S: int, tile: int) -> tuple[int, int]:
    BLOCK_C = triton.next_power_of_2(C)
    return BLOCK_C, max(1, min(tile // BLOCK_C, triton.next_power_of_2(S)))


def _stats_cl_defaults(C: int, dev: torch.device) -> tuple[int, int, int, int]:
    """(tile, num_warps, target programs, unroll) of the channels-last stats kernel where the caller sets none. On
    CUDA, measured at SDXL's decoder shapes (E24): the shared defaults kept too few loads in flight per warp, so wide
    rows (C >= 256) load 4 row blocks per iteration into the same accumulators."""
    tile = default_tile(dev)
    if dev.type != "cuda":
        return tile, default_warps(tile), n_programs_target(dev), 1
    per_sm = n_programs_target(dev) // 8  # SMs
    if C <= 128:
        return 2048, 8, 4 * per_sm, 1
    return 8192, 4, 2 * per_sm, 4


def _launch_stats(x, G, x_bias, tile, target_programs, num_warps, out=None, minmax=False):
    """Run the split stats kernel on x (N, C, *spatial). -> (x as read, kind, S, stride_n, partials [3, N*G, chunks])
    (x is made contiguous first only for odd strides). `out`: a preallocated partials buffer of the right shape (see
    `group_norm_partials_shape`). `minmax` (channels-last only): partials [5, ...] with each group's max and min."""
    N, C = x.shape[:2]
    CG = C // G
    layout = flat_layout(x)
    if layout is None or (layout[0] == "cl" and C > 8192):
        # odd strides (e.g. a sliced channel dim), or channels-last rows too wide for one tile: the only relayout
        x = x.contiguous()
        layout = flat_layout(x)
    kind, S, stride_n = layout
    dev = x.device
    tile, nw, target, unroll = _stats_params(kind, C, dev, tile, num_warps, target_programs)
    has_xb = x_bias is not None
    xb = x_bias.reshape(C) if has_xb else x  # a valid pointer either way; read only under the XB flags
    g = _stats_geometry(N, C, G, kind, S, tile, target, unroll)
    n_chunks, iters = g["n_chunks"], g["iters"]

    if out is not None:
        if tuple(out.shape) != (3, N * G, n_chunks) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"group_norm_partials: out must be a contiguous float32 {(3, N * G, n_chunks)} tensor")
        part = out
    else:
        part = torch.empty((5 if minmax else 3, N * G, n_chunks), device=dev, dtype=torch.float32)
    if minmax and kind != "cl":
        raise ValueError("group_norm_silu: an e4m3 output needs a channels-last input")
    if kind == "cf":
        BLOCK, BLOCK_GR = g["BLOCK"], g["BLOCK_GR"]
        xb_mode = 0 if not has_xb else (1 if S % BLOCK == 0 else 2)  # 1: no per-element channel division
        _stats_cf_kernel[(n_chunks, triton.cdiv(N * G, BLOCK_GR))](
            x, part, xb, N * G, CG * S, stride_n, G, n_chunks, iters, S, CG,
            BLOCK_GR=BLOCK_GR, BLOCK=BLOCK, XB=xb_mode, num_warps=nw,
        )  # fmt: skip
    else:
        _stats_cl_kernel[(n_chunks, N)](
            x, part, xb, S, C, CG, G, stride_n, n_chunks, iters,
            BLOCK_S=g["BLOCK_S"], BLOCK_C=g["BLOCK_C"], BLOCK_G=triton.next_power_of_2(G),
            CG_POW2=CG if CG & (CG - 1) == 0 else 0, XB=has_xb, MINMAX=minmax, UNROLL=g["UNROLL"], num_warps=nw,
        )  # fmt: skip
    return x, kind, S, stride_n, part


# --- statistics taken by the kernel that wrote the tensor ------------------------------------------------------
# A kernel that writes a norm's input (the resnet's residual epilogue, kernels/epilogue.bias_residual(stats_groups=))
# can take the norm's statistics on its way, at no extra read. It notes the partials on the tensor it returns; the
# norm of exactly that data (the tensor, or a view of it with the same per-sample [S, C] layout, e.g. attention's
# (N, C, H*W)) skips its stats pass, as long as nothing wrote to the tensor since (its version counter).

_PARTS = "_vaeopt_gn_parts"


def _signature(x: torch.Tensor):
    lay = flat_layout(x)
    if lay is None:
        return None
    kind, S, stride_n = lay
    return x.data_ptr(), x.device, tuple(x.shape[:2]), kind, S, stride_n if x.shape[0] > 1 else None


def _version(t: torch.Tensor):
    """t's version counter, or None for an inference tensor (inference mode keeps none)."""
    return None if t.is_inference() else t._version


def attach_partials(t: torch.Tensor, num_groups: int, part: torch.Tensor) -> None:
    """Note on t the partials (5, N*G, chunks) -- count, mean, M2, max and min bounds, as the channels-last stats
    kernel writes them with MINMAX -- of t's GroupNorm statistics with num_groups groups. The note sits on the
    tensor that owns t's storage (t itself, or its view base), where any view of the same data finds it."""
    sig = _signature(t)
    if sig is None or sig[3] != "cl":  # the partials' format and the e4m3 norm need a channels-last tensor
        return
    root = t if t._base is None else t._base
    root.__dict__[_PARTS] = (int(num_groups), part, _version(t), sig)


def drop_partials(t: torch.Tensor) -> None:
    """Forget any note on t's storage (a kernel is about to write into it through an `out=` argument). Writes that
    bypass the version counter otherwise (`.data`, inference tensors) are the caller's to avoid."""
    (t if t._base is None else t._base).__dict__.pop(_PARTS, None)


def noted_partials(x: torch.Tensor, num_groups: int) -> torch.Tensor | None:
    """The partials noted on x (or on the tensor x is a view of, when x sees the same data the same way per sample)
    for num_groups groups, if x has not been written since; else None. Inference tensors keep no version counter:
    their note holds for as long as the tensor lives (the decoders' forwards never write an activation in place)."""
    rec = (x if x._base is None else x._base).__dict__.get(_PARTS)
    if rec is None or rec[0] != int(num_groups) or rec[2] != _version(x):
        return None
    return rec[1] if rec[3] is not None and _signature(x) == rec[3] else None


STATS_MIN_NUMEL_CUDA = 1 << 24


def producer_stats_ok(C: int, G: int, numel: int, dev: torch.device) -> bool:
    """Whether a kernel writing a channels-last norm input of C channels and numel elements per sample should take
    the norm's statistics (G groups) on its way: G divides C, one tile holds a row (C <= 8192), int32 in-sample
    offsets, and it pays: on CUDA from 2^24 elements (E26). Always on the CPU interpreter, where the tests run it."""
    return (C % G == 0 and C <= 8192 and numel < 2**31
            and (dev.type != "cuda" or numel >= STATS_MIN_NUMEL_CUDA))


def producer_partials(N: int, C: int, G: int, S: int, dev: torch.device,
                      cuda_launch: tuple[int, int, int, int]) -> tuple[dict, torch.Tensor, dict]:
    """Geometry, partials buffer (5, N*G, chunks) and the common constexprs of a kernel that writes a dense
    channels-last (N, S, C) norm input and takes the norm's statistics on the way, chunked as the stats kernel is.
    cuda_launch: (tile, warps, programs per SM, row blocks per iteration) on CUDA; the CPU interpreter takes the stats
    kernel's defaults. -> (geometry with "num_warps", partials, constexpr kwargs)."""
    if dev.type == "cuda":
        tile, nw, per_sm, unroll = cuda_launch
        target = per_sm * (n_programs_target(dev) // 8)  # SMs
    else:
        tile, nw, target, unroll = _stats_cl_defaults(C, dev)
    g = _stats_geometry(N, C, G, "cl", S, tile, target, unroll)
    part = torch.empty((5, N * G, g["n_chunks"]), device=dev, dtype=torch.float32)
    CG = C // G
    kw = dict(BLOCK_S=g["BLOCK_S"], BLOCK_C=g["BLOCK_C"], BLOCK_G=triton.next_power_of_2(G),
              CG_POW2=CG if CG & (CG - 1) == 0 else 0, UNROLL=g["UNROLL"], num_warps=nw)
    return g, part, kw


def _stats_params(kind: str, C: int, dev: torch.device, tile: int | None, num_warps: int | None,
                  target: int | None) -> tuple[int, int, int, int]:
    """(tile, num_warps, target programs, unroll) of a stats launch: the caller's where given, else the defaults."""
    if kind == "cl":
        t, w, p, u = _stats_cl_defaults(C, dev)
        if tile is not None and tile != t:  # an explicit tile keeps the generic warps rule
            w = default_warps(tile)
        return tile or t, num_warps or w, target or p, u
    tile = tile or default_tile(dev)
    return tile, num_warps or default_warps(tile), target or n_programs_target(dev), 1


def _stats_geometry(N: int, C: int, G: int, kind: str, S: int, tile: int, target: int, unroll: int = 1) -> dict:
    """Block sizes and chunking of the split stats kernels (one place, so partials buffers can be preallocated)."""
    if kind == "cf":
        L = (C // G) * S
        BLOCK = min(tile, triton.next_power_of_2(L))
        BLOCK_GR = min(triton.next_power_of_2(N * G), max(1, tile // BLOCK))
        blocks = triton.cdiv(L, BLOCK)
        iters = max(1, triton.cdiv(triton.cdiv(N * G, BLOCK_GR) * blocks, target))
        return dict(BLOCK=BLOCK, BLOCK_GR=BLOCK_GR, iters=iters, n_chunks=triton.cdiv(blocks, iters))
    BLOCK_C, BLOCK_S = _cl_blocks(C, S, tile)
    unroll = unroll if S >= unroll * BLOCK_S else 1
    blocks = triton.cdiv(S, BLOCK_S * unroll)
    iters = max(1, triton.cdiv(N * blocks, target))
    return dict(BLOCK_C=BLOCK_C, BLOCK_S=BLOCK_S, UNROLL=unroll, iters=iters, n_chunks=triton.cdiv(blocks, iters))


def group_norm_silu(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
    silu: bool = True,
    *,
    tile: int | None = None,
    target_programs: int | None = None,
    num_warps: int | None = None,
    max_block_p: int = 1024,
    x_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(group_norm(x)) (or plain group_norm with silu=False) for x of shape (N, C, *spatial), fp32/bf16/fp16.

    `x_bias` ([C], optional): normalize x + x_bias[c] instead (a conv's bias folded in: the conv runs without it);
    the sum is formed in fp32 inside the kernels, never materialized.

    Output has x's dtype and memory format. `tile` (elements per block), `target_programs` (stats grid size) and
    `num_warps` are tuning knobs; tests shrink them (and `max_block_p`, partials merged per finalize step) to
    exercise multi-chunk merges on small tensors.
    """
    return _group_norm(x, num_groups, weight, bias, eps, silu, tile=tile, target_programs=target_programs,
                       num_warps=num_warps, max_block_p=max_block_p, x_bias=x_bias)


def group_norm_silu_e4m3(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         eps: float = 1e-6, silu: bool = True, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_norm_silu` (the same keywords) written as float8_e4m3fn for an fp8 conv: -> (y8, scale),
    y ~= y8 * scale[n].

    x must be channels-last (NHWC / NDHWC). The scale is per sample and computed on the GPU, with no extra memory
    pass: the stats kernel also takes each channel's max |x - k| (k: the shift it already subtracts for the sums),
    which bounds the group's max and min as k ± that; the finalize kernel turns them into a bound of |y| per
    channel ((max - mean) * rstd * weight + bias, either end; SiLU only shrinks it), and the apply kernel scales by
    448 / (the largest bound). A bound, not the exact amax, so the largest value may use a little less than the full
    e4m3 range: e4m3's relative step (2^-3) is the same at any magnitude, so this costs precision only for values
    2^17 below the bound (subnormals). The scale tensor stays on the device (no host sync; fits CUDA graphs). One
    max |x - k| instead of max and min made the stats pass cheaper (E21)."""
    if E4M3 is None:
        raise TypeError(f"torch {torch.__version__} has no float8_e4m3fn")
    return _group_norm(x, num_groups, weight, bias, eps, silu, out8=True, **kw)


def group_norm_silu_int8(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         eps: float = 1e-6, silu: bool = True, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`group_norm_silu` written as int8 for an int8 conv: -> (q, scale, zq), y ~= scale[n] * (q + zq[n]).

    Asymmetric: the 255 levels span [lo, hi] of each sample, hi the same per-sample bound of the output that the
    e4m3 variant scales by (group_norm_silu_e4m3), lo SiLU's minimum (-0.27846) with silu, else -hi. A SiLU output
    lies mostly on one side of zero, so this spends no levels on values that cannot occur (closer to fp32 than
    e4m3, E45). The step is uniform, so a loose bound costs precision everywhere (e4m3 keeps its
    relative step); the bound is the group's max |x - k| mapped through the affine, as for e4m3."""
    return _group_norm(x, num_groups, weight, bias, eps, silu, out8="int8", **kw)


def _group_norm(x, num_groups, weight, bias, eps, silu, *, tile=None, target_programs=None, num_warps=None,
                max_block_p=1024, x_bias=None, out8: bool | str = False):
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"group_norm_silu: dtype {x.dtype} not supported")
    if x.dim() < 2:
        raise ValueError(f"group_norm_silu: expected (N, C, ...), got {tuple(x.shape)}")
    N, C = x.shape[:2]
    G = int(num_groups)
    if C % G:
        raise ValueError(f"group_norm_silu: {C} channels not divisible by {G} groups")
    for name, t in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if t is not None and t.numel() != C:
            raise ValueError(f"group_norm_silu: {name} has {t.numel()} values for {C} channels")
    i8 = out8 == "int8"
    out8 = bool(out8)  # e4m3 or int8: both take the bound statistics
    if out8 and (x.numel() == 0 or x[0].numel() >= 2**31):
        raise ValueError(f"group_norm_silu_{'int8' if i8 else 'e4m3'}: no 8-bit kernel path for x of shape "
                         f"{tuple(x.shape)}")
    if x.numel() == 0:
        return torch.empty_like(x)
    if x[0].numel() >= 2**31:
        # int32 in-sample offsets: a sample this large (e.g. 128 ch at 4096²) takes the exact torch ops instead,
        # in the input's memory format
        y = group_norm_silu_reference(x, G, weight, bias, eps, silu, x_bias)
        return y.contiguous(memory_format=torch.channels_last) if x.dim() == 4 and not x.is_contiguous() \
            and x.is_contiguous(memory_format=torch.channels_last) else y
    part = noted_partials(x, G) if x_bias is None else None
    if part is not None:  # taken by the kernel that wrote x (a dense channels-last tensor: attach_partials)
        kind, S, stride_n = flat_layout(x)
    else:
        x, kind, S, stride_n, part = _launch_stats(x, G, x_bias, tile, target_programs, num_warps, minmax=out8)
    CG = C // G
    dev = x.device
    w = weight if weight is not None else torch.ones(C, device=dev, dtype=torch.float32)
    b = bias if bias is not None else torch.zeros(C, device=dev, dtype=torch.float32)
    if kind == "cl" and tile is None and dev.type == "cuda":
        tile, nw = APPLY_CL_CUDA[0], num_warps or APPLY_CL_CUDA[1]
    else:
        tile = tile or default_tile(dev)
        nw = num_warps or default_warps(tile)
    has_xb = x_bias is not None
    xb = x_bias.reshape(C) if has_xb else w  # a valid pointer either way; read only under the XB flags
    y = new_like(x, kind, (torch.int8 if i8 else E4M3) if out8 else None)
    n_chunks = part.shape[2]

    mean = torch.empty((N, C), device=dev, dtype=torch.float32)
    a = torch.empty((N, C), device=dev, dtype=torch.float32)
    bound = torch.empty((N, C), device=dev, dtype=torch.float32) if out8 else mean
    scale = torch.empty((N,), device=dev, dtype=torch.float32) if out8 else mean
    zq = torch.empty((N,), device=dev, dtype=torch.float32) if i8 else None
    BLOCK_P = min(max_block_p, triton.next_power_of_2(n_chunks))
    BLOCK_NG = min(triton.next_power_of_2(N * G), max(1, 2048 // BLOCK_P))  # tiny work: few programs
    _finalize_kernel[(triton.cdiv(N * G, BLOCK_NG),)](
        part, w, xb, mean, a, b, bound, N * G, C, G, CG, n_chunks, float(eps),
        BLOCK_NG=BLOCK_NG, BLOCK_P=BLOCK_P, BLOCK_CG=triton.next_power_of_2(CG), XB=has_xb, BOUND=out8, SILU=silu,
        num_warps=4,
    )  # fmt: skip

    if kind == "cf":
        BS = min(triton.next_power_of_2(S), max(1024, tile // 4))
        BR = max(1, min(tile // BS, triton.next_power_of_2(N * C)))
        n_s_blocks = triton.cdiv(S, BS)
        n_tiles = n_s_blocks * triton.cdiv(N * C, BR)
        _apply_cf_kernel[(n_tiles,)](
            x, y, mean, a, b, N * C, C, S, stride_n, n_s_blocks, n_tiles,
            BLOCK_R=BR, BLOCK_S=BS, SILU=silu, num_warps=nw,
        )  # fmt: skip
    else:
        BLOCK_C, BLOCK_S = _cl_blocks(C, S, tile)
        n_s_blocks = triton.cdiv(S, BLOCK_S)
        n_tiles = N * n_s_blocks
        _apply_cl_kernel[(n_tiles,)](
            x, y, mean, a, b, S, C, stride_n, n_s_blocks, n_tiles,
            BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, SILU=silu, bound_ptr=bound if out8 else None,
            s_ptr=scale if out8 else None, OUT8=out8, EXACT8=out8 and not i8 and dev.type == "cpu",
            SILU_MODE=silu_mode(y.dtype, dev), OUT_I8=i8, zq_ptr=zq, num_warps=nw,
        )  # fmt: skip
    if i8:
        return y, scale, zq
    return (y, scale) if out8 else y


# --- split API: statistics of parts of a tensor, merged, then applied (the exact tiled decoder's norms) -------------


def _check_x(x: torch.Tensor, num_groups: int, who: str) -> tuple[int, int, int]:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{who}: dtype {x.dtype} not supported")
    if x.dim() < 2:
        raise ValueError(f"{who}: expected (N, C, ...), got {tuple(x.shape)}")
    N, C = x.shape[:2]
    G = int(num_groups)
    if G < 1 or C % G:
        raise ValueError(f"{who}: {C} channels not divisible by {num_groups} groups")
    if x[0].numel() >= 2**31:
        raise ValueError(f"{who}: one sample must have < 2**31 elements (int32 in-sample offsets)")
    return N, C, G


def group_norm_partials_shape(x: torch.Tensor, num_groups: int, *, tile: int | None = None,
                              target_programs: int | None = None) -> tuple[int, int, int]:
    """Shape of `group_norm_partials(x, num_groups)` ((3, N*G, chunks)), e.g. to preallocate its `out`."""
    N, C, G = _check_x(x, num_groups, "group_norm_partials")
    layout = flat_layout(x)
    if layout is None or (layout[0] == "cl" and C > 8192):
        layout = flat_layout(x.contiguous()) if x.numel() else ("cf", 0, 0)
    kind, S, _ = layout
    tile, _, target, unroll = _stats_params(kind, C, x.device, tile, None, target_programs)
    g = _stats_geometry(N, C, G, kind, S, tile, target, unroll)
    return 3, N * G, g["n_chunks"]


def group_norm_partials(
    x: torch.Tensor,
    num_groups: int,
    *,
    x_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tile: int | None = None,
    target_programs: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Partial GroupNorm statistics of x (N, C, *spatial) -- of x + x_bias[c] when `x_bias` ([C]) is given -- from
    the split stats kernels: a float32 tensor (3, N*G, chunks) holding (count, mean, M2) of each chunk of each
    (sample, group). Each chunk's moments are taken around a shift (no cancellation), so they are exact to fp32.

    Partials are *mergeable*: the partials of disjoint parts of one activation (e.g. tiles), concatenated along
    dim 2, are the partials of the whole (`group_norm_finalize` merges them exactly, Chan et al.; `merge_partials`
    gives the merged moments). Layout as group_norm_silu (NCHW/NHWC/NCDHW/NDHWC read in place; odd strides are
    made contiguous first). `out`: a preallocated buffer of shape `group_norm_partials_shape(x, num_groups)`.
    """
    N, C, G = _check_x(x, num_groups, "group_norm_partials")
    if x_bias is not None and x_bias.numel() != C:
        raise ValueError(f"group_norm_partials: x_bias has {x_bias.numel()} values for {C} channels")
    if x.numel() == 0:
        return torch.zeros((3, N * G, 0), device=x.device, dtype=torch.float32)
    noted = noted_partials(x, G) if x_bias is None and out is None else None
    if noted is not None:  # (a copy: the caller may change it; its chunk count is the note's, not the shape helper's)
        return noted[:3].clone()
    return _launch_stats(x, G, x_bias, tile, target_programs, num_warps, out=out)[4]


def merge_partials(parts: torch.Tensor | list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact merge (Chan et al., float64) of partials (3, R, chunks) -- or a list of them, concatenated along the
    chunks -- into per-row (count, mean, M2), each of shape (R,): row r = n*G + g is group g of sample n."""
    p = torch.cat(list(parts), dim=2) if isinstance(parts, (list, tuple)) else parts
    p = p.double()
    cnt, mu, m2 = p[0], p[1], p[2]
    n = cnt.sum(dim=1)
    mean = (cnt * mu).sum(dim=1) / n.clamp_min(1.0)
    M2 = (m2 + cnt * (mu - mean[:, None]) ** 2).sum(dim=1)
    return n, mean, M2


def group_norm_finalize(
    parts: torch.Tensor | list[torch.Tensor],
    num_groups: int,
    num_channels: int,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    max_block_p: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials (see `group_norm_partials`; a list is concatenated along the chunks) exactly, in one launch of
    the fused path's finalize kernel. -> (mean, scale), float32 (N, C): mean = the mean of channel c's group (of x +
    x_bias if the partials were taken with one), scale = rstd * weight[c] (biased variance, as nn.GroupNorm)."""
    p = torch.cat(list(parts), dim=2) if isinstance(parts, (list, tuple)) else parts
    if p.dim() != 3 or p.shape[0] != 3 or p.dtype != torch.float32:
        raise ValueError(f"group_norm_finalize: expected float32 partials (3, N*G, chunks), got {tuple(p.shape)}")
    p = p.contiguous()
    G, C = int(num_groups), int(num_channels)
    if C % G or p.shape[1] % G:
        raise ValueError(f"group_norm_finalize: {C} channels / {p.shape[1]} partial rows vs {G} groups")
    N = p.shape[1] // G
    dev = p.device
    w = weight if weight is not None else torch.ones(C, device=dev, dtype=torch.float32)
    if w.numel() != C:
        raise ValueError(f"group_norm_finalize: weight has {w.numel()} values for {C} channels")
    n_chunks = p.shape[2]
    mean = torch.empty((N, C), device=dev, dtype=torch.float32)
    a = torch.empty((N, C), device=dev, dtype=torch.float32)
    BLOCK_P = min(max_block_p, triton.next_power_of_2(max(1, n_chunks)))
    BLOCK_NG = min(triton.next_power_of_2(N * G), max(1, 2048 // BLOCK_P))
    _finalize_kernel[(triton.cdiv(N * G, BLOCK_NG),)](
        p, w, w, mean, a, w, mean, N * G, C, G, C // G, n_chunks, float(eps),
        BLOCK_NG=BLOCK_NG, BLOCK_P=BLOCK_P, BLOCK_CG=triton.next_power_of_2(C // G), XB=False, num_warps=4,
    )  # fmt: skip
    return mean, a


def group_norm_silu_reference(x, num_groups, weight, bias, eps=1e-6, silu=True, x_bias=None):
    """The exact torch composition the kernel replaces (and the fallback off-GPU)."""
    if x_bias is not None:
        x = x + x_bias.to(x.dtype).reshape(-1, *([1] * (x.dim() - 2)))
    y = torch.nn.functional.group_norm(x, num_groups, weight, bias, eps)
    return torch.nn.functional.silu(y) if silu else y


__all__ = [
    "group_norm_silu",
    "group_norm_silu_reference",
    "group_norm_partials",
    "group_norm_partials_shape",
    "merge_partials",
    "group_norm_finalize",
    "group_norm_apply",
    "attach_partials",
    "drop_partials",
    "noted_partials",
    "SUPPORTED_DTYPES",
]
