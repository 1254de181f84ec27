"""Fused GroupNorm (+ optional SiLU) for NCHW / NHWC / NCDHW / NDHWC activations, output in the input's layout.

Why: aten GroupNorm reduces with one CUDA block per (sample, group) — 32 blocks on a 132-SM GPU for a batch-1 VAE —
and relayouts channels_last inputs to NCHW and back; SiLU is one more full read+write. Here:

  1. stats     many programs per (n, group): each reduces a chunk to (count, mean, M2). Sums are taken around a
               shift (the mean of the chunk's first block), so there is no E[x^2]-E[x]^2 cancellation.
  2. finalize  one tiny program per (n, group) merges the chunks exactly (Chan et al.) and writes per-(n, channel)
               mean and rstd*weight.
  3. apply     elementwise y = (x - mean) * a + bias, SiLU, one read + one write. Tiles are visited in the reverse of
               the stats order, so the tail that stats read last is still in L2.

DRAM traffic: 2 reads + 1 write of x (vs 5 passes for aten GroupNorm + SiLU); ~1 read + 1 write when x fits in L2.

Input bias (`x_bias`, optional [C]): the kernels normalize x + x_bias[c] instead of x, so a conv can run without its
bias and the bias is folded in here (one full read+write pass less per conv: aten's cuDNN path adds the bias in a
separate broadcast kernel). Stats add it on load; finalize subtracts it from the per-channel mean it writes
(mean' = mean_g - x_bias[c]), so apply is unchanged: (x - mean') * a + b = (x + x_bias - mean_g) * a + b.

Layouts: every tensor is seen as (N, C, S) with S = flattened spatial dims; "channels-first" means each sample is a
contiguous [C, S] block (NCHW, NCDHW, (B, C, L)), "channels-last" means a contiguous [S, C] block (NHWC, NDHWC,
(B, C, L) with channel stride 1). Anything else is made contiguous first (the only relayout, and only for odd strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vaeopt.kernels import default_tile, flat_layout, n_programs_target, new_like

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
):
    chunk = tl.program_id(0)
    n = tl.program_id(1)
    s_start = chunk.to(tl.int64) * iters * BLOCK_S
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
    for it in range(iters):
        r = it * BLOCK_S + rows
        m = (r < lim)[:, None] & cm[None, :]
        x = tl.load(base + r[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if XB:
            x += xbc[None, :]
        d = tl.where(m, x - k[None, :], 0.0)
        s1 += d
        s2 += d * d
    cnt = tl.minimum(lim, iters * BLOCK_S).to(tl.float32)  # rows seen; same for every channel
    t1 = tl.sum(s1, axis=0)
    t2 = tl.sum(s2, axis=0)
    mean_c = k + t1 / cnt  # [BLOCK_C]
    m2_c = tl.maximum(t2 - t1 * t1 / cnt, 0.0)

    # Channels -> groups, once per program: Chan merge of equal-count parts.
    ga = tl.arange(0, BLOCK_G)
    if CG_POW2 > 0:  # CG_POW2 == CG: the groups tile BLOCK_C exactly -> reshape [BLOCK_G, CG] (real decoder widths)
        mean_2d = tl.reshape(mean_c, [BLOCK_G, CG_POW2])
        mean_g = tl.sum(mean_2d, axis=1) / CG_POW2  # [BLOCK_G]
        dev = mean_2d - mean_g[:, None]
        m2_g = tl.sum(tl.reshape(m2_c, [BLOCK_G, CG_POW2]) + cnt * dev * dev, axis=1)
    else:  # odd group sizes: one-hot [BLOCK_G, BLOCK_C] mask
        ohf = (((cols[None, :] // CG) == ga[:, None]) & cm[None, :]).to(tl.float32)
        mean_g = tl.sum(ohf * mean_c[None, :], axis=1) / CG
        dev = mean_c[None, :] - mean_g[:, None]
        m2_g = tl.sum(ohf * (m2_c[None, :] + cnt * dev * dev), axis=1)

    gm = ga < G
    out = part_ptr + (n * G + ga) * n_chunks + chunk
    plane = n_chunks * G * tl.num_programs(1)
    tl.store(out, tl.zeros([BLOCK_G], dtype=tl.float32) + cnt * CG, mask=gm)
    tl.store(out + plane, mean_g, mask=gm)
    tl.store(out + 2 * plane, m2_g, mask=gm)


@triton.jit
def _finalize_kernel(
    part_ptr,  # [3, NG, n_chunks] fp32
    w_ptr,  # [C] affine weight
    xb_ptr,  # [C] input bias (read only when XB)
    mean_ptr,  # [N, C] fp32 out: mean of the channel's group, minus the channel's input bias
    a_ptr,  # [N, C] fp32 out: rstd * weight
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
    tl.store(a_ptr + out, rstd[:, None] * w, mask=cm)


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
        y = y / (1.0 + tl.exp(-y))  # SiLU (exp -> inf gives the right limit, -0)
    tl.store(y_ptr + n.to(tl.int64) * S * C + off, y.to(y_ptr.dtype.element_ty), mask=m)


def _warps(tile: int) -> int:
    return 4 if tile <= 4096 else 8


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
    if x.numel() == 0:
        return torch.empty_like(x)
    if x[0].numel() >= 2**31:
        raise ValueError("group_norm_silu: one sample must have < 2**31 elements (int32 in-sample offsets)")
    CG = C // G
    layout = flat_layout(x)
    if layout is None or (layout[0] == "cl" and C > 8192):
        # odd strides (e.g. a sliced channel dim), or channels-last rows too wide for one tile: the only relayout
        x = x.contiguous()
        layout = flat_layout(x)
    kind, S, stride_n = layout
    y = new_like(x, kind)
    dev = x.device
    w = weight if weight is not None else torch.ones(C, device=dev, dtype=torch.float32)
    b = bias if bias is not None else torch.zeros(C, device=dev, dtype=torch.float32)
    tile = tile or default_tile(dev)
    target = target_programs or n_programs_target(dev)
    nw = num_warps or _warps(tile)
    has_xb = x_bias is not None
    xb = x_bias.reshape(C) if has_xb else w  # a valid pointer either way; read only under the XB flags

    if kind == "cf":
        L = CG * S
        BLOCK = min(tile, triton.next_power_of_2(L))
        BLOCK_GR = min(triton.next_power_of_2(N * G), max(1, tile // BLOCK))
        blocks = triton.cdiv(L, BLOCK)
        iters = max(1, triton.cdiv(triton.cdiv(N * G, BLOCK_GR) * blocks, target))
        n_chunks = triton.cdiv(blocks, iters)
    else:
        BLOCK_C = triton.next_power_of_2(C)
        BLOCK_S = max(1, min(tile // BLOCK_C, triton.next_power_of_2(S)))
        blocks = triton.cdiv(S, BLOCK_S)
        iters = max(1, triton.cdiv(N * blocks, target))
        n_chunks = triton.cdiv(blocks, iters)

    part = torch.empty((3, N * G, n_chunks), device=dev, dtype=torch.float32)
    if kind == "cf":
        xb_mode = 0 if not has_xb else (1 if S % BLOCK == 0 else 2)  # 1: no per-element channel division
        _stats_cf_kernel[(n_chunks, triton.cdiv(N * G, BLOCK_GR))](
            x, part, xb, N * G, L, stride_n, G, n_chunks, iters, S, CG,
            BLOCK_GR=BLOCK_GR, BLOCK=BLOCK, XB=xb_mode, num_warps=nw,
        )  # fmt: skip
    else:
        _stats_cl_kernel[(n_chunks, N)](
            x, part, xb, S, C, CG, G, stride_n, n_chunks, iters,
            BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, BLOCK_G=triton.next_power_of_2(G),
            CG_POW2=CG if CG & (CG - 1) == 0 else 0, XB=has_xb, num_warps=nw,
        )  # fmt: skip

    mean = torch.empty((N, C), device=dev, dtype=torch.float32)
    a = torch.empty((N, C), device=dev, dtype=torch.float32)
    BLOCK_P = min(max_block_p, triton.next_power_of_2(n_chunks))
    BLOCK_NG = min(triton.next_power_of_2(N * G), max(1, 2048 // BLOCK_P))  # tiny work: few programs
    _finalize_kernel[(triton.cdiv(N * G, BLOCK_NG),)](
        part, w, xb, mean, a, N * G, C, G, CG, n_chunks, float(eps),
        BLOCK_NG=BLOCK_NG, BLOCK_P=BLOCK_P, BLOCK_CG=triton.next_power_of_2(CG), XB=has_xb, num_warps=4,
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
        n_s_blocks = triton.cdiv(S, BLOCK_S)
        n_tiles = N * n_s_blocks
        _apply_cl_kernel[(n_tiles,)](
            x, y, mean, a, b, S, C, stride_n, n_s_blocks, n_tiles,
            BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, SILU=silu, num_warps=nw,
        )  # fmt: skip
    return y


def group_norm_silu_reference(x, num_groups, weight, bias, eps=1e-6, silu=True, x_bias=None):
    """The exact torch composition the kernel replaces (and the fallback off-GPU)."""
    if x_bias is not None:
        x = x + x_bias.to(x.dtype).reshape(-1, *([1] * (x.dim() - 2)))
    y = torch.nn.functional.group_norm(x, num_groups, weight, bias, eps)
    return torch.nn.functional.silu(y) if silu else y


__all__ = ["group_norm_silu", "group_norm_silu_reference", "SUPPORTED_DTYPES"]
