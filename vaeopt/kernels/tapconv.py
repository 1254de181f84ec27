"""A conv with very few output channels (a decoder's conv_out: 96 -> 3) as one GEMM per pixel plus a tap sum.

cuDNN runs Wan's conv_out (a causal 3x3x3 Conv3d, 96 -> 3 channels) as an implicit GEMM with N = 3 on a slow sm80
kernel (E18). Here the conv is split the other way round:

1. `rms_norm_taps`: per pixel p, Y[p, tap, o] = sum_c a[p, c] * W[o, c, tap] for all 27 taps and 3 outputs at once
   (one (pixels x C) @ (C x 81) GEMM on tensor cores), where a = silu(rms_norm(x)) is computed by the same kernel
   from x (Wan's RMS norm + SiLU, as rms_norm_silu): the normalized activation is never written. Y is stored planar,
   (N, 27*Co, frames, H, W), in the compute dtype.
2. `tap_sum`: out[t, h, w, o] = bias[o] + sum over taps (dt, dh, dw) of Y[t + dt, h + dh - 1, w + dw - 1, tap, o]
   (zero outside the frame): every Y element is read by exactly one output pixel, with unit-stride rows.

The causal history of the conv (its last two input frames) is kept as the last two frames of Y instead: the GEMM
is linear, so Y of the history frames is what the taps need, and the first chunk's zero padding is Y = 0.

Rounding: a is rounded to the compute dtype as
the conv input would be; Y is rounded once per (tap, output) to the dtype of its buffer (bf16: 27 roundings of
partial sums instead of one of the total; fp32 buffers make it exact up to summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vaeopt.kernels.common import affine_args, channel_vector, silu_mode

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TAP_COLUMNS = 128  # taps * out channels the GEMM may produce (27 * 4); wider heads (Wan 2.2's 12 channels: 324
# columns) were not tried: their partial sums would be 3.4x the input


def fits(co: int, taps: int = 27) -> bool:
    """Does a conv with `co` output channels and `taps` taps take this path (GEMM width <= MAX_TAP_COLUMNS)?"""
    return 0 < co * taps <= MAX_TAP_COLUMNS


def block_c(c: int) -> int:
    """The kernel's channel block for C input channels (tap matrix rows): a power of 2, at least 16 (tl.dot)."""
    return max(16, 1 << (int(c) - 1).bit_length())


def tap_weights(w: torch.Tensor, rows: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(Co, C, kt, kh, kw) or (Co, C, kh, kw) -> (C', NT') matrix with column ((dt*kh + dh)*kw + dw)*Co + o, zero
    padded to `rows` rows (default: the kernel's block_c(C)) and a multiple of 32 columns, in `dtype` (default
    w's)."""
    if w.dim() == 4:
        w = w.unsqueeze(2)
    if w.dim() != 5:
        raise ValueError(f"tap_weights: expected a conv kernel, got {tuple(w.shape)}")
    co, c = w.shape[:2]
    m = w.detach().permute(1, 2, 3, 4, 0).reshape(c, -1)
    nt = m.shape[1]
    rows = max(c, rows or block_c(c))
    cols = -(-nt // 32) * 32
    out = torch.zeros((rows, cols), dtype=dtype or w.dtype, device=w.device)
    out[:c, :nt] = m
    return out


def _use_triton(t: torch.Tensor, impl: str | None) -> bool:
    """impl None: the Triton kernels on CUDA, torch ops on CPU (the interpreter would run them ~10x slower than the
    rest of a CPU decode; tests run the kernels on CPU with impl="triton")."""
    if impl not in (None, "triton", "torch"):
        raise ValueError(f"impl must be 'triton', 'torch' or None, not {impl!r}")
    return impl == "triton" or (impl is None and t.is_cuda)


def _checked(who: str, x: torch.Tensor, y: torch.Tensor, wt: torch.Tensor, nt: int, hist: int) -> torch.Tensor:
    """x as (N, C, k, H, W), after the checks both norm+GEMM entry points share."""
    if x.dim() == 4:
        x = x.unsqueeze(2)
    N, C, k, H, W = x.shape
    if not x.permute(0, 2, 3, 4, 1).is_contiguous():
        raise ValueError(f"{who}: x must be dense channels-last")
    if tuple(y.shape) != (N, nt, hist + k, H, W) or not y.is_contiguous():
        raise ValueError(f"{who}: y {tuple(y.shape)} for x {tuple(x.shape)}, {nt} columns, {hist} history")
    if wt.shape[0] < C or wt.shape[1] < nt:
        raise ValueError(f"{who}: tap matrix {tuple(wt.shape)} for {C} channels, {nt} columns")
    return x


def _taps_torch(a: torch.Tensor, b, silu: bool, x: torch.Tensor, wt: torch.Tensor, nt: int, y: torch.Tensor,
                hist: int) -> None:
    """The kernel's tail in torch: + bias, SiLU, the input rounded once to x's dtype, fp32 GEMM into y's frames."""
    C = x.shape[1]
    if b is not None:
        a = a + b.float().view(1, C, 1, 1, 1)
    if silu:
        a = torch.nn.functional.silu(a)
    y[:, :, hist:] = torch.einsum("nckhw,cj->njkhw", a.to(x.dtype).float(), wt[:C, :nt].float()).to(y.dtype)


def _taps_launch(x, y, wt, nt, hist, g, b, xb, scale, eps, silu, **flags) -> None:
    """_rms_taps_kernel over the pixels of x (N, C, k, H, W); g/b/xb: gamma / bias / input bias pointers (None:
    absent) or, with GN=True, the statistics in `flags`."""
    import triton

    N, C, k, H, W = x.shape
    R = N * k * H * W
    BLOCK_R = 64 if x.is_cuda else 1024  # CPU: few interpreted programs
    ieee = x.dtype == torch.float32 or not x.is_cuda  # fp32 inputs, or the interpreter (its bf16 dot upcasts)
    _rms_taps_kernel[(triton.cdiv(R, BLOCK_R),)](
        x, g, b if b is not None else g, xb if xb is not None else g, wt, y,
        R, k * H * W, C, nt, nt * (hist + k) * H * W, (hist + k) * H * W, hist * H * W, float(scale), float(eps),
        BLOCK_R=BLOCK_R, BLOCK_C=wt.shape[0], BLOCK_N=32, NT_PAD=wt.shape[1], HAS_BIAS=b is not None,
        HAS_XB=xb is not None, SILU=bool(silu), IEEE=ieee,
        SILU_MODE=silu_mode(x.dtype, x.device, wan_rms=not flags.get("GN", False)), num_warps=4, **flags)


def rms_norm_taps(x: torch.Tensor, gamma: torch.Tensor, bias, eps: float, scale: float, wt: torch.Tensor, nt: int,
                  y: torch.Tensor, hist: int, *, x_bias: torch.Tensor | None = None, silu: bool = True,
                  impl: str | None = None, residual: torch.Tensor | None = None,
                  residual_bias: torch.Tensor | None = None) -> None:
    """y[:, :, hist:] <- planar GEMM of silu(rms_norm(x + x_bias)) with the tap matrix `wt` (tap_weights).

    x: (N, C, k, H, W) dense channels_last_3d (or (N, C, H, W) channels_last, k = 1). y: (N, nt, hist + k, H, W)
    contiguous. gamma/bias/x_bias/eps/scale: as rms_norm_silu. impl: see _use_triton.
    residual (x's shape and layout): x is the last residual block's conv output h, and the input of the norm is
    that block's output u = (residual + residual_bias) + (x + x_bias), rounded to x's dtype as
    epilogue.bias_residual would store it. u itself is never written (nothing after the head reads it)."""
    if residual is not None and x.dim() == 4:
        residual = residual.unsqueeze(2)
    x = _checked("rms_norm_taps", x, y, wt, nt, hist)
    N, C, k, H, W = x.shape
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.device != x.device
                                 or not residual.permute(0, 2, 3, 4, 1).is_contiguous()):
        raise ValueError(f"rms_norm_taps: residual must be a dense channels-last {tuple(x.shape)} tensor on "
                         f"{x.device}")
    if residual is None and residual_bias is not None:
        raise ValueError("rms_norm_taps: residual_bias needs a residual")
    g, b, has_bias, xb = affine_args(x, gamma, bias, x_bias)
    b = b if has_bias else None
    rb = channel_vector("residual_bias", residual_bias, C, x.device)
    if N * k * H * W == 0:
        return
    if not _use_triton(x, impl):  # the kernel's math in torch: fp32 norm, input rounded once, fp32 GEMM
        a = x.float() if xb is None else x.float() + xb.float().view(1, C, 1, 1, 1)
        if residual is not None:  # the block's output, as bias_residual rounds it
            r = residual.float() if rb is None else residual.float() + rb.float().view(1, C, 1, 1, 1)
            a = (r + a).to(x.dtype).float()
        a = a * (float(scale) / a.norm(dim=1, keepdim=True).clamp_min(eps)) * g.float().view(1, C, 1, 1, 1)
        _taps_torch(a, b, silu, x, wt, nt, y, hist)
        return
    _taps_launch(x, y, wt, nt, hist, g, b, xb, scale, eps, silu, r_ptr=residual if residual is not None else x,
                 rb_ptr=rb if rb is not None else g, RES=residual is not None, HAS_RB=rb is not None)


def group_norm_taps(x: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    wt: torch.Tensor, nt: int, y: torch.Tensor, hist: int = 0, *, silu: bool = True,
                    impl: str | None = None) -> None:
    """y[:, :, hist:] <- planar GEMM of silu((x - mean) * scale + bias) with the tap matrix `wt`: an image
    decoder's head (GroupNorm + SiLU + conv_out) with the statistics given, as group_norm_finalize returns them
    (mean, scale = rstd * weight: float32 (N, C)). x: (N, C, H, W) dense channels_last (or (N, C, k, H, W)
    channels_last_3d); y as rms_norm_taps. The normalized activation is never written."""
    x = _checked("group_norm_taps", x, y, wt, nt, hist)
    N, C, k, H, W = x.shape
    mean, scale = (v.reshape(N, C).float().contiguous() for v in (mean, scale))
    b = bias.reshape(C) if bias is not None else None
    if N * k * H * W == 0:
        return
    if not _use_triton(x, impl):  # the kernel's math in torch
        a = (x.float() - mean.view(N, C, 1, 1, 1)) * scale.view(N, C, 1, 1, 1)
        _taps_torch(a, b, silu, x, wt, nt, y, hist)
        return
    _taps_launch(x, y, wt, nt, hist, mean, b, None, 1.0, 1.0, silu, GN=True, mean_ptr=mean, sc_ptr=scale)


def tap_sum(y: torch.Tensor, co: int, kernel: tuple[int, int, int], bias: torch.Tensor | None,
            out: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """out (N, co, k, H, W) [any strides] <- bias + sum over taps of the planar GEMM output y (N, kt*kh*kw*co,
    kt - 1 + k, H, W): the conv with 'same' zero padding in H and W and none in time (the history frames are y's
    first kt - 1). impl: see _use_triton."""
    kt, kh, kw = kernel
    N, nt, Ts, H, W = y.shape
    k = Ts - (kt - 1)
    if nt != kt * kh * kw * co or tuple(out.shape) != (N, co, k, H, W) or not y.is_contiguous():
        raise ValueError(f"tap_sum: y {tuple(y.shape)}, out {tuple(out.shape)}, kernel {kernel}, {co} outputs")
    if out.numel() == 0:
        return out
    if not _use_triton(y, impl):  # the same sum in torch: fp32, taps in the kernel's order
        ph, pw = kh // 2, kw // 2
        yp = F.pad(y.float(), (pw, pw, ph, ph)).view(N, kt, kh, kw, co, Ts, H + 2 * ph, W + 2 * pw)
        acc = torch.zeros((N, co, k, H, W), dtype=torch.float32, device=y.device)
        for dt in range(kt):
            for dh in range(kh):
                for dw in range(kw):
                    acc += yp[:, dt, dh, dw, :, dt : dt + k, dh : dh + H, dw : dw + W]
        if bias is not None:
            acc += bias.float().view(1, co, 1, 1, 1)
        out.copy_(acc)
        return out
    import triton

    BLOCK_P = min(1024 if y.is_cuda else 1 << 14, triton.next_power_of_2(H * W))  # CPU: few interpreted programs
    if bias is not None:
        bias = bias.contiguous()
    _tap_sum_kernel[(triton.cdiv(H * W, BLOCK_P), N * k)](
        y, bias if bias is not None else y, out, H, W, k, nt * Ts * H * W, Ts * H * W,
        *out.stride(),
        CO=co, CO_PAD=max(2, triton.next_power_of_2(co)), KT=kt, KH=kh, KW=kw, BLOCK_P=BLOCK_P,
        HAS_B=bias is not None, num_warps=4)
    return out


try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - no triton: the torch versions above (impl="torch")
    triton = None

if triton is not None:
    from vaeopt.kernels.common import silu

    @triton.jit
    def _rms_taps_kernel(
        x_ptr,  # [R, C] dense rows (pixels of N samples x k frames, channels innermost)
        g_ptr,
        b_ptr,
        xb_ptr,
        w_ptr,  # [BLOCK_C, NT_PAD] tap matrix, zero padded
        y_ptr,  # [N, NT, Ts, H, W] planar
        R,
        KHW,  # pixels per sample (k * H * W)
        C,
        NT,
        plane_n,  # elements per sample of y
        plane_c,  # elements per column plane of y (Ts * H * W)
        y_off,  # hist * H * W: the new frames' offset in a plane
        scale,
        eps,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NT_PAD: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_XB: tl.constexpr,
        SILU: tl.constexpr,
        IEEE: tl.constexpr,
        r_ptr=None,  # RES: [R, C] the residual, dense like x
        rb_ptr=None,  # RES with HAS_RB: [C] its bias
        RES: tl.constexpr = False,
        HAS_RB: tl.constexpr = False,
        GN: tl.constexpr = False,  # GroupNorm with given statistics instead of the RMS norm:
        mean_ptr=None,  # [N, C] float32: the mean of channel c's group in sample n
        sc_ptr=None,  # [N, C] float32: rstd * weight[c]
        SILU_MODE: tl.constexpr = 0,  # common.silu's MODE (silu_mode)
    ):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < R
        cc = tl.arange(0, BLOCK_C)
        cm = cc < C
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * C + cc[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_XB:
            x += tl.load(xb_ptr + cc, mask=cm, other=0.0).to(tl.float32)[None, :]
        if RES:  # the block's output (r + rb) + (h + b), rounded as epilogue.bias_residual stores it
            rr = tl.load(r_ptr + r.to(tl.int64)[:, None] * C + cc[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_RB:
                rr += tl.load(rb_ptr + cc, mask=cm, other=0.0).to(tl.float32)[None, :]
            x = (rr + x).to(x_ptr.dtype.element_ty).to(tl.float32)
        if GN:  # (x - mean) * rstd * weight, as group_norm_apply
            so = (r // KHW).to(tl.int64)[:, None] * C + cc[None, :]
            a = (x - tl.load(mean_ptr + so, mask=m, other=0.0)) * tl.load(sc_ptr + so, mask=m, other=0.0)
        else:
            inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
            g = tl.load(g_ptr + cc, mask=cm, other=0.0).to(tl.float32)
            a = x * inv[:, None] * g[None, :]
        if HAS_BIAS:
            a += tl.load(b_ptr + cc, mask=cm, other=0.0).to(tl.float32)[None, :]
        if SILU:
            a = silu(a, SILU_MODE)
        a = tl.where(m, a, 0.0).to(x_ptr.dtype.element_ty)  # the conv input as the torch path rounds it
        n = r // KHW
        q = r % KHW
        base = n.to(tl.int64) * plane_n + y_off + q.to(tl.int64)
        for n0 in tl.static_range(0, NT_PAD, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            w = tl.load(w_ptr + cc[:, None] * NT_PAD + j[None, :])
            if IEEE:  # fp32 inputs, or the CPU interpreter (its bf16 dot is wrong: operands upcast)
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(a, w)
            tl.store(y_ptr + base[:, None] + j.to(tl.int64)[None, :] * plane_c, acc.to(y_ptr.dtype.element_ty),
                     mask=rm[:, None] & (j < NT)[None, :])

    @triton.jit
    def _tap_sum_kernel(
        y_ptr,  # [N, NT, Ts, H, W] planar
        b_ptr,
        o_ptr,
        H,
        W,
        K,  # output frames
        plane_n,
        plane_c,
        so_n,
        so_c,
        so_t,
        so_h,
        so_w,
        CO: tl.constexpr,
        CO_PAD: tl.constexpr,
        KT: tl.constexpr,
        KH: tl.constexpr,
        KW: tl.constexpr,
        BLOCK_P: tl.constexpr,  # consecutive pixels (h*W + w) of one output frame per program
        HAS_B: tl.constexpr,
    ):
        HW = H * W
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        nt = tl.program_id(1)
        n = nt // K
        t = nt % K
        pm = p < HW
        h = p // W
        w = p % W
        o = tl.arange(0, CO_PAD)
        om = o < CO
        acc = tl.zeros([BLOCK_P, CO_PAD], dtype=tl.float32)
        ybase = y_ptr + n.to(tl.int64) * plane_n
        for dt in tl.static_range(KT):
            fbase = ybase + (t + dt).to(tl.int64) * HW
            for dh in tl.static_range(KH):
                hh = h + (dh - KH // 2)
                mh = pm & (hh >= 0) & (hh < H)
                for dw in tl.static_range(KW):
                    ww = w + (dw - KW // 2)
                    m = mh & (ww >= 0) & (ww < W)
                    col = ((dt * KH + dh) * KW + dw) * CO + o
                    # the source pixel is p shifted by a constant: unit-stride loads along the block
                    src = p + ((dh - KH // 2) * W + (dw - KW // 2))
                    ptr = fbase + col.to(tl.int64)[None, :] * plane_c + src[:, None]
                    acc += tl.load(ptr, mask=m[:, None] & om[None, :], other=0.0).to(tl.float32)
        if HAS_B:
            acc += tl.load(b_ptr + o, mask=om, other=0.0).to(tl.float32)[None, :]
        dst = o_ptr + n.to(tl.int64) * so_n + t.to(tl.int64) * so_t + (h.to(tl.int64) * so_h
                                                                         + w.to(tl.int64) * so_w)[:, None] \
            + o[None, :] * so_c
        tl.store(dst, acc.to(o_ptr.dtype.element_ty), mask=pm[:, None] & om[None, :])


__all__ = ["tap_weights", "rms_norm_taps", "group_norm_taps", "tap_sum", "fits", "block_c",
           "MAX_TAP_COLUMNS"]
