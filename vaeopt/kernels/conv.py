"""Implicit-GEMM convolution in Triton for channels-last activations (NHWC / NDHWC), bf16/fp16 or fp8 operands.

Why: cuDNN picks an sm80 kernel for Wan's 96-channel full-resolution causal Conv3d, most of a wan21-480p decode's
conv time (docs/experiments.md E5, E12); the same GEMM as Triton programs runs on Hopper's wgmma.

The conv is a GEMM with M = output pixels, N = Cout, K = taps x Cin, where the A operand (im2col) is never built:
for tap (dt, dy, dx) the rows of A are the input pixels at a constant offset from the output pixel, so each K step
loads a [BLOCK_M, BLOCK_K] block of the NDHWC input (rows masked to zero where the tap falls outside the frame:
the conv's spatial zero padding) and a [BLOCK_K, BLOCK_N] block of the weights packed once as [taps*Cin, Cout].

Time: no temporal padding — the caller passes the input with its causal history in front (Tin = T + kt - 1), as
vaeopt.video stages it. 2D convs are the kt = 1, T = 1 case (frames = batch).

Cout that is not a power of two (96, 192, 384) is covered without masking waste by two accumulators of
power-of-two widths (e.g. 64 + 32) that share each A block.

fp8 (float8_e4m3fn): x and the packed weights in e4m3, fp32 accumulation, and the epilogue multiplies by
x_scale * w_scale[cout] before the bias; the output is in `out_dtype` (bf16).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from vaeopt.kernels import tma_conv, ws_conv
from vaeopt.kernels.conv_args import PackedWeight, check_args, check_residual, pack_weight, residual_fits  # noqa: F401
from vaeopt.kernels.fp8_quant import E4M3, quantize_per_tensor

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _kstep(x_ptr, w_ptr, src, ok, c, c_ok, tap, C, CO, KTOT, n0, n0_ok, n1, n1_ok, acc0, acc1,
           BN1: tl.constexpr, W_KMAJOR: tl.constexpr, DOT_F32: tl.constexpr):
    """acc += A[rows, c] @ B[tap*C + c, n] for both accumulators."""
    a = tl.load(x_ptr + src[:, None] * C + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
    k = (tap * C + c).to(tl.int64)
    if W_KMAJOR:  # B stored [CO, K]: each column's K values contiguous (what Hopper's fp8 wgmma wants)
        b0 = tl.load(w_ptr + n0.to(tl.int64)[None, :] * KTOT + k[:, None], mask=c_ok[:, None] & n0_ok[None, :],
                     other=0.0)
    else:
        b0 = tl.load(w_ptr + k[:, None] * CO + n0[None, :], mask=c_ok[:, None] & n0_ok[None, :], other=0.0)
    if DOT_F32:
        a = a.to(tl.float32)
        b0 = b0.to(tl.float32)
    acc0 = tl.dot(a, b0, acc0)
    if BN1 > 0:
        if W_KMAJOR:
            b1 = tl.load(w_ptr + n1.to(tl.int64)[None, :] * KTOT + k[:, None], mask=c_ok[:, None] & n1_ok[None, :],
                         other=0.0)
        else:
            b1 = tl.load(w_ptr + k[:, None] * CO + n1[None, :], mask=c_ok[:, None] & n1_ok[None, :], other=0.0)
        if DOT_F32:
            b1 = b1.to(tl.float32)
        acc1 = tl.dot(a, b1, acc1)
    return acc0, acc1


@triton.jit
def _epilogue_store(acc, n, n_ok, m_ok, yrow, y_ptr, b_ptr, s_ptr, xs, HAS_BIAS: tl.constexpr,
                    HAS_SCALE: tl.constexpr):
    if HAS_SCALE:  # fp8: x_scale (per output row, or one number) * w_scale[cout]
        acc = acc * tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
        acc = acc * xs
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + n, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + yrow + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _igemm_kernel(
    x_ptr,  # input, [frames_in, H, W, C] dense (NDHWC / NHWC)
    w_ptr,  # packed weights: [TAPS * C, CO] dense, or [CO, TAPS * C] (W_KMAJOR)
    b_ptr,  # [CO] fp32 bias (HAS_BIAS)
    s_ptr,  # [CO] fp32 per-output-channel weight scale (HAS_SCALE, fp8)
    xs_ptr,  # [N] fp32 per-sample activation scale (XS_PTR, fp8; e.g. written by the GroupNorm kernel)
    x_scale,  # fp32 activation scale when not XS_PTR (fp8)
    y_ptr,  # output, pixel m's channels at y_ptr + m * stride_ym + [0, CO)
    M,  # output pixels: N * T * H * W
    HW,
    THW,  # output pixels per sample
    H,
    W,
    C,
    CO,
    stride_ym,
    KT: tl.constexpr,
    KH: tl.constexpr,
    KW: tl.constexpr,
    PH: tl.constexpr,
    PW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BN0: tl.constexpr,  # first accumulator width
    BN1: tl.constexpr,  # second accumulator width (0: none)
    BLOCK_K: tl.constexpr,
    BK1: tl.constexpr,  # > 0: C == BLOCK_K + BK1, one K step per tap with two channel pieces (e.g. 96 = 64 + 32)
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    XS_PTR: tl.constexpr,
    W_KMAJOR: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast operands before tl.dot (the CPU interpreter's bf16 dot is wrong)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    xw = m % W
    yh = (m // W) % H
    # input pixel of tap (0, 0, 0) shifted by the padding: samples have KT - 1 extra (history) frames in front
    base = m.to(tl.int64) + (m // THW).to(tl.int64) * ((KT - 1) * HW)
    n0 = pid_n * (BN0 + BN1) + tl.arange(0, BN0)
    n0_ok = n0 < CO
    n1 = pid_n * (BN0 + BN1) + BN0 + tl.arange(0, BN1 if BN1 > 0 else 16)
    n1_ok = n1 < CO
    kk = tl.arange(0, BLOCK_K)
    kk1 = BLOCK_K + tl.arange(0, BK1 if BK1 > 0 else 16)
    acc0 = tl.zeros([BLOCK_M, BN0], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BN1 if BN1 > 0 else 16], dtype=tl.float32)
    KTOT = KT * KH * KW * C
    CB = 1 if BK1 > 0 else tl.cdiv(C, BLOCK_K)
    for it in tl.range(0, KT * KH * KW * CB, num_stages=NUM_STAGES):
        tap = it // CB
        c = (it - tap * CB) * BLOCK_K + kk
        dt = tap // (KH * KW)
        r = tap - dt * (KH * KW)
        dy = r // KW - PH
        dx = r % KW - PW
        ok = m_ok & (yh + dy >= 0) & (yh + dy < H) & (xw + dx >= 0) & (xw + dx < W)
        src = base + (dt * HW + dy * W + dx)
        acc0, acc1 = _kstep(x_ptr, w_ptr, src, ok, c, c < C, tap, C, CO, KTOT, n0, n0_ok, n1, n1_ok, acc0, acc1,
                            BN1, W_KMAJOR, DOT_F32)
        if BK1 > 0:
            acc0, acc1 = _kstep(x_ptr, w_ptr, src, ok, kk1, kk1 < C, tap, C, CO, KTOT, n0, n0_ok, n1, n1_ok, acc0,
                                acc1, BN1, W_KMAJOR, DOT_F32)
    yrow = m.to(tl.int64)[:, None] * stride_ym
    if XS_PTR:
        xs = tl.load(xs_ptr + m // THW, mask=m_ok, other=0.0)[:, None]
    else:
        xs = x_scale
    _epilogue_store(acc0, n0, n0_ok, m_ok, yrow, y_ptr, b_ptr, s_ptr, xs, HAS_BIAS, HAS_SCALE)
    if BN1 > 0:
        _epilogue_store(acc1, n1, n1_ok, m_ok, yrow, y_ptr, b_ptr, s_ptr, xs, HAS_BIAS, HAS_SCALE)


@dataclasses.dataclass(frozen=True)
class Config:
    block_m: int = 128
    bn0: int = 64
    bn1: int = 32
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    bk1: int = 0  # > 0: Cin == block_k + bk1, one K step per tap

    def n_width(self) -> int:
        return self.bn0 + self.bn1


def default_config(cin: int, cout: int, device: torch.device, fp8: bool = False, m: int = 64) -> Config:
    """Tile shape for a layer of m output pixels (measured choices in docs/experiments.md E11)."""
    if device.type != "cuda":
        # the interpreter pays per op and per program, not per FLOP: few programs, wide K steps
        return Config(block_m=min(2048, triton.next_power_of_2(max(16, m))), bn0=min(64, triton.next_power_of_2(cout)), bn1=0,
                      block_k=min(64, triton.next_power_of_2(cin)), num_warps=4, num_stages=1)
    bk = 64 if cin % 64 == 0 else 32
    if fp8:
        bk = 128 if cin % 128 == 0 else (64 if cin % 64 == 0 else 32)
    if cout == 96:
        return Config(128, 64, 32, bk, 4, 4)
    if cout % 128 == 0:
        if fp8:  # measured best for e4m3 at 128-512 ch (h200_conv_2026-11-21b.json)
            return Config(256, 128, 0, bk, 8, 3)
        return Config(128, 128, 0, bk, 8, 4)
    if cout % 192 == 0:
        return Config(128, 128, 64, bk, 8, 3)
    return Config(128, 64, 0, bk, 4, 4)


def conv_igemm(
    x: torch.Tensor,
    pw: PackedWeight,
    bias: torch.Tensor | None,
    padding: tuple[int, int],
    *,
    x_scale: torch.Tensor | float | None = None,
    out_dtype: torch.dtype | None = None,
    config: Config | None = None,
    x_zero: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stride-1, dilation-1, groups-1 convolution of channels-last x with packed weights.

    x: (N, Cin, Tin, H, W) channels_last_3d (output T = Tin - kt + 1: no temporal padding) or (N, Cin, H, W)
    channels_last (kt must be 1). padding: (ph, pw) zero padding of H and W. fp8: x in e4m3 with x_scale (a
    python float, or an fp32 device tensor of one value or one per sample, read by the kernel: no host sync, fit for
    CUDA graphs), weights packed in e4m3; output in out_dtype (default bf16 for fp8). int8: x holds int8 codes q
    of the activation a ~= x_scale * (q + x_zero) per sample (x_zero: an fp32 device tensor, default 0), weights
    packed in int8; 2D 3x3 convs only, always on the TMA kernel (kernels/tma_conv.py; the CPU interpreter too).
    residual (int8 only): a tensor of the output's shape and dtype, channels_last, added in the epilogue: the result
    is residual + (conv + bias), as a resnet adds its input (one pass instead of a separate residual kernel).
    Returns the output in x's memory format (channels_last[_3d])."""
    a = check_args("conv_igemm", x, pw, padding, x_scale, out_dtype, x_zero)
    if residual is not None:
        check_residual("conv_igemm", residual, a, pw.cout, x.device)
    if a.int8:
        return tma_conv.conv_tma_checked(x, pw, bias, padding, a, tma_conv.int8_config(pw.cin, pw.cout, a.W),
                                         residual=residual)
    if config is None and pw.kmajor and x.is_cuda:
        # Wan's bf16 96- and 192-ch convs: the warp-specialized Gluon kernel (E42)
        if ws_conv.handles(x, pw, padding, a) and (y := ws_conv.conv_checked(x, pw, bias, a)) is not None:
            return y
        if tma_conv.available(x.device) and (cfg := tma_conv.tuned_config(pw.cin, pw.cout, a.W, a.fp8, a.video)):
            return tma_conv.conv_tma_checked(x, pw, bias, padding, a, cfg)
    N, T, H, W, CO, fp8 = a.N, a.T, a.H, a.W, pw.cout, a.fp8
    kt, kh, kw = pw.kernel
    ph, pwd = padding
    yd = torch.empty((N * T, H, W, CO), device=x.device, dtype=a.odt)
    y = a.output_view(yd)
    M = N * T * H * W
    if M == 0:
        return y
    cfg = config or default_config(pw.cin, CO, x.device, fp8, M)
    if cfg.bk1 and cfg.block_k + cfg.bk1 != pw.cin:
        raise ValueError(f"conv_igemm: config splits Cin as {cfg.block_k} + {cfg.bk1}, the layer has {pw.cin}")
    xs_t, xs_f = a.xs_t, a.xs_f
    scale = pw.scale if fp8 else None
    b = bias.detach().float().contiguous() if bias is not None else None
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(CO, cfg.n_width()))
    _igemm_kernel[grid](
        x, pw.w, b if b is not None else y, scale if scale is not None else y, xs_t if xs_t is not None else y,
        xs_f, y, M, H * W, T * H * W, H, W, pw.cin, CO, CO,
        KT=kt, KH=kh, KW=kw, PH=ph, PW=pwd,
        BLOCK_M=cfg.block_m, BN0=cfg.bn0, BN1=cfg.bn1, BLOCK_K=cfg.block_k, BK1=cfg.bk1,
        HAS_BIAS=b is not None, HAS_SCALE=scale is not None, XS_PTR=xs_t is not None, W_KMAJOR=pw.kmajor, NUM_STAGES=cfg.num_stages,
        DOT_F32=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps,
    )
    return y


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 quantization of an activation (keeps its memory format) -> (x_fp8, scale):
    fp8_quant.quantize_per_tensor, the one definition of the dynamic activation scale."""
    return quantize_per_tensor(x)


def flops(x_shape: tuple, pw: PackedWeight) -> int:
    """2 * M * N * K of the conv."""
    kt = pw.kernel[0]
    if len(x_shape) == 4:
        n, _, h, w = x_shape
        t = 1
    else:
        n, _, tin, h, w = x_shape
        t = tin - kt + 1
    return 2 * n * t * h * w * pw.cout * math.prod(pw.kernel) * pw.cin
