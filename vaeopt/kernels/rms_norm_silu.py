"""Fused Wan RMS norm (+ optional SiLU) over the channel dim, for NCHW / NCDHW and NHWC / NDHWC activations.

Computes silu(x / max(||x||_2 over C, eps) * scale * gamma + bias), scale = sqrt(C) — diffusers' `WanRMS_norm`
(F.normalize in fp32, then affine) followed by the decoder's SiLU. diffusers spends ~6 full passes on this
(upcast copy, norm reduction, divide, downcast, scale*gamma, +bias, SiLU); here it is one read and one write:
each program owns whole channel vectors (all C values of a block of positions), so the reduction never leaves
registers. Channels larger than `max_block_c` take a two-loop path whose second read hits L1/L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vaeopt.kernels import default_tile, flat_layout, new_like

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_cf_kernel(
    x_ptr,  # [N, C, S]: sample n at x_ptr + n*stride_xn, contiguous [C, S] inside
    y_ptr,  # [N, C, S] dense
    g_ptr,  # [C] gamma
    b_ptr,  # [C] bias (read only if HAS_BIAS)
    C,
    S,
    stride_xn,
    scale,
    eps,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK_C >= C: the tile holds whole channel vectors, x is read once
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    sb = tl.program_id(0)
    n = tl.program_id(1)
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    sm = s < S
    cc = tl.arange(0, BLOCK_C)
    xb = x_ptr + n.to(tl.int64) * stride_xn
    yb = y_ptr + n.to(tl.int64) * C * S
    if ONE_PASS:
        cm = cc < C
        m = cm[:, None] & sm[None, :]
        off = cc[:, None] * S + s[None, :]
        x = tl.load(xb + off, mask=m, other=0.0).to(tl.float32)
        inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), eps)  # [BLOCK_S]
        g = tl.load(g_ptr + cc, mask=cm, other=0.0).to(tl.float32)
        y = x * inv[None, :] * g[:, None]
        if HAS_BIAS:
            y += tl.load(b_ptr + cc, mask=cm, other=0.0).to(tl.float32)[:, None]
        if SILU:
            y = y / (1.0 + tl.exp(-y))  # SiLU
        tl.store(yb + off, y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([BLOCK_S], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            m = (c < C)[:, None] & sm[None, :]
            x = tl.load(xb + c[:, None] * S + s[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(x * x, axis=0)
        inv = scale / tl.maximum(tl.sqrt(acc), eps)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            cm = c < C
            m = cm[:, None] & sm[None, :]
            off = c[:, None] * S + s[None, :]
            x = tl.load(xb + off, mask=m, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + c, mask=cm, other=0.0).to(tl.float32)
            y = x * inv[None, :] * g[:, None]
            if HAS_BIAS:
                y += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[:, None]
            if SILU:
                y = y / (1.0 + tl.exp(-y))  # SiLU
            tl.store(yb + off, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_cl_kernel(
    x_ptr,  # [N, S, C]: sample n at x_ptr + n*stride_xn, contiguous [S, C] inside
    y_ptr,  # [N*S, C] dense
    g_ptr,  # [C] gamma
    b_ptr,  # [C] bias (read only if HAS_BIAS)
    R,  # N*S rows
    S,
    C,
    stride_xn,
    scale,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ONE_PASS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < R
    n = r // S
    s = r % S
    xo = n.to(tl.int64) * stride_xn + s.to(tl.int64) * C  # [BLOCK_R]
    yo = r.to(tl.int64) * C
    cc = tl.arange(0, BLOCK_C)
    if ONE_PASS:
        cm = cc < C
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + xo[:, None] + cc[None, :], mask=m, other=0.0).to(tl.float32)
        inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)  # [BLOCK_R]
        g = tl.load(g_ptr + cc, mask=cm, other=0.0).to(tl.float32)
        y = x * inv[:, None] * g[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + cc, mask=cm, other=0.0).to(tl.float32)[None, :]
        if SILU:
            y = y / (1.0 + tl.exp(-y))  # SiLU
        tl.store(y_ptr + yo[:, None] + cc[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            m = rm[:, None] & (c < C)[None, :]
            x = tl.load(x_ptr + xo[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(x * x, axis=1)
        inv = scale / tl.maximum(tl.sqrt(acc), eps)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            cm = c < C
            m = rm[:, None] & cm[None, :]
            x = tl.load(x_ptr + xo[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + c, mask=cm, other=0.0).to(tl.float32)
            y = x * inv[:, None] * g[None, :]
            if HAS_BIAS:
                y += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
            if SILU:
                y = y / (1.0 + tl.exp(-y))  # SiLU
            tl.store(y_ptr + yo[:, None] + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def rms_norm_silu(
    x: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | float | None = None,
    eps: float = 1e-12,
    silu: bool = True,
    *,
    scale: float | None = None,
    tile: int | None = None,
    max_block_c: int = 1024,
    num_warps: int | None = None,
) -> torch.Tensor:
    """silu(F.normalize(x, dim=1, eps) * scale * gamma + bias) for x (N, C, *spatial), fp32/bf16/fp16, fp32 math.

    gamma/bias: C values in any shape ((C,), (C,1,1), (C,1,1,1)); bias may be a number (Wan's default 0.0) or None.
    scale defaults to sqrt(C) as in WanRMS_norm. Output has x's dtype and memory format. `tile`, `max_block_c`,
    `num_warps` are tuning knobs (tests lower max_block_c to exercise the two-loop path).
    """
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm_silu: dtype {x.dtype} not supported")
    if x.dim() < 2:
        raise ValueError(f"rms_norm_silu: expected (N, C, ...), got {tuple(x.shape)}")
    N, C = x.shape[:2]
    g = gamma.reshape(-1)
    if g.numel() != C:
        raise ValueError(f"rms_norm_silu: gamma has {g.numel()} values for {C} channels")
    if isinstance(bias, torch.Tensor):
        b, has_bias = bias.reshape(-1), True
        if b.numel() != C:
            raise ValueError(f"rms_norm_silu: bias has {b.numel()} values for {C} channels")
    elif bias:  # a nonzero number
        b, has_bias = torch.full((C,), float(bias), device=x.device, dtype=torch.float32), True
    else:
        b, has_bias = g, False  # placeholder pointer, never read
    scale = float(C) ** 0.5 if scale is None else float(scale)
    if x.numel() == 0:
        return torch.empty_like(x)
    if x[0].numel() >= 2**31:
        raise ValueError("rms_norm_silu: one sample must have < 2**31 elements (int32 in-sample offsets)")
    layout = flat_layout(x)
    if layout is None:  # odd strides: the one case that relayouts
        x = x.contiguous()
        layout = flat_layout(x)
    kind, S, stride_n = layout
    y = new_like(x, kind)
    tile = tile or default_tile(x.device)
    BLOCK_C = min(triton.next_power_of_2(C), max_block_c)
    one_pass = triton.next_power_of_2(C) <= max_block_c
    if kind == "cf":
        # >= 16 positions per row segment keeps loads at least 32-byte sectors wide
        BLOCK_S = min(max(16, tile // BLOCK_C), triton.next_power_of_2(S))
        nw = num_warps or (4 if BLOCK_C * BLOCK_S <= 4096 else 8)
        _rms_cf_kernel[(triton.cdiv(S, BLOCK_S), N)](
            x, y, g, b, C, S, stride_n, scale, float(eps),
            BLOCK_C=BLOCK_C, BLOCK_S=BLOCK_S, ONE_PASS=one_pass, HAS_BIAS=has_bias, SILU=silu, num_warps=nw,
        )  # fmt: skip
    else:
        R = N * S
        BLOCK_R = min(max(1, tile // BLOCK_C), triton.next_power_of_2(R))
        nw = num_warps or (4 if BLOCK_C * BLOCK_R <= 4096 else 8)
        _rms_cl_kernel[(triton.cdiv(R, BLOCK_R),)](
            x, y, g, b, R, S, C, stride_n, scale, float(eps),
            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ONE_PASS=one_pass, HAS_BIAS=has_bias, SILU=silu, num_warps=nw,
        )  # fmt: skip
    return y


def rms_norm_silu_reference(x, gamma, bias=None, eps=1e-12, silu=True, scale=None):
    """diffusers' WanRMS_norm (channel_first) + SiLU, op for op (and the fallback off-GPU)."""
    C = x.shape[1]
    shape = (C,) + (1,) * (x.dim() - 2)
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
