"""Implicit-GEMM convolution with TMA tensor descriptors (Hopper and newer): the A operand is a box of the NDHWC input.

Where the pointer kernel (`conv.py`) builds every A block from row pointers and a border mask, each K step here
loads one [1, BH, BW, BK] box of the input seen as (frames, H, W, C) at the output tile's corner shifted by the tap;
the hardware zero-fills what falls outside H or W (the conv's padding) and copies asynchronously. The output tile is
BH x BW pixels of one frame; temporal taps read whole frames (causal history in front, as for the pointer kernel).
Cout that is not a power of two (96, 192) takes two accumulators (64 + 32, 128 + 64) sharing each A box. Weights are
packed K-major; Cin is a multiple of BK so that a K step never straddles two taps.

Where it runs (docs/kernels.md, experiments.md E20, E28): the 8-bit convs of FP8 level 3 on sm_90, and in bf16 only
Wan 2.1's 96-channel causal Conv3d (`BF16_WAN96`) where the Gluon kernel (ws_conv.py) does not run; elsewhere in
bf16 cuDNN is faster.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from vaeopt.kernels.conv_args import ConvArgs, PackedWeight, check_args

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

MEASURED_SM = ((9, 0),)
# The variant that adds a residual in its epilogue (int8 resnet conv2) compiles to 190 registers per thread; capped
# at 128 it spills a little and is faster than both the uncapped variant and a separate residual pass (E47).
RES_MAXNREG = 128


def available(device: torch.device) -> bool:
    """TMA tensor descriptors in this Triton, on a GPU where the tile choices below were measured (sm_90). Asked on
    every e4m3 conv call by conv_igemm: no imports here."""
    if TensorDescriptor is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) in MEASURED_SM


@triton.jit
def _mma(a, b, acc, I32: tl.constexpr):
    """acc + a @ b^T; int8 operands accumulate in int32 (I32)."""
    if I32:
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _int8_border_kernel(
    y_ptr,  # (frames, H, W, CO) with any strides, channels dense: the conv's stored output, fixed in place
    s_ptr,  # [CO] fp32 weight scales
    xs_ptr,  # [N] fp32 activation scales
    zq_ptr,  # [N] fp32 zero points, in units of the scale
    ws_ptr,  # [9, CO] fp32: conv.tap_sums of the int8 weights
    H, W, CO, n_border, n_c_blocks, syf, syh, syw,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The border half of the int8 zero-point term (see _tma_epilogue): each output pixel on the image's edge gets
    - xs * sw * zq * (the sum of the weights of its taps that fall outside), by inclusion-exclusion over conv.tap_sums'
    rows (top / bottom row of taps, left / right column, minus the corners counted twice). Border pixels: the top row,
    the bottom row (H > 1), then rows 1 .. H-2 at w = 0 and w = W - 1 (once where W = 1)."""
    pid = tl.program_id(0)
    cb = pid % n_c_blocks
    t = pid // n_c_blocks
    nb = tl.cdiv(n_border, BLOCK_P)
    pb = t % nb
    f = t // nb  # one frame per sample (int8 convs are 2D)
    i = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = i < n_border
    nrow = tl.minimum(H, 2)
    ncol = tl.minimum(W, 2)
    in_rows = i < nrow * W
    j = i - nrow * W
    h = tl.where(in_rows, (i // W) * (H - 1), 1 + j // ncol)
    w = tl.where(in_rows, i % W, (j % ncol) * (W - 1))
    top = (h == 0).to(tl.float32)
    bot = (h == H - 1).to(tl.float32)
    lef = (w == 0).to(tl.float32)
    rig = (w == W - 1).to(tl.float32)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < CO
    k = tl.load(s_ptr + c, mask=cm, other=0.0) * (tl.load(xs_ptr + f) * tl.load(zq_ptr + f))
    out = top[:, None] * tl.load(ws_ptr + CO + c, mask=cm, other=0.0)[None, :]
    out += bot[:, None] * tl.load(ws_ptr + 2 * CO + c, mask=cm, other=0.0)[None, :]
    out += lef[:, None] * tl.load(ws_ptr + 3 * CO + c, mask=cm, other=0.0)[None, :]
    out += rig[:, None] * tl.load(ws_ptr + 4 * CO + c, mask=cm, other=0.0)[None, :]
    out -= (top * lef)[:, None] * tl.load(ws_ptr + 5 * CO + c, mask=cm, other=0.0)[None, :]
    out -= (top * rig)[:, None] * tl.load(ws_ptr + 6 * CO + c, mask=cm, other=0.0)[None, :]
    out -= (bot * lef)[:, None] * tl.load(ws_ptr + 7 * CO + c, mask=cm, other=0.0)[None, :]
    out -= (bot * rig)[:, None] * tl.load(ws_ptr + 8 * CO + c, mask=cm, other=0.0)[None, :]
    off = f.to(tl.int64) * syf + h.to(tl.int64) * syh + w.to(tl.int64) * syw
    m = pm[:, None] & cm[None, :]
    ptr = y_ptr + off[:, None] + c[None, :]
    y = tl.load(ptr, mask=m, other=0.0).to(tl.float32) - out * k[None, :]
    tl.store(ptr, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _tma_epilogue(acc, n, co, f, h0, w0, y_desc, s_ptr, b_ptr, xs, BH: tl.constexpr, BW: tl.constexpr,
                  BN: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PHASES: tl.constexpr, ph, pa,
                  pb, ZP: tl.constexpr = False, zq=0.0, ws_ptr=None, RES: tl.constexpr = False, r_desc=None):
    """Scales, bias, store. ZP (int8 with a zero point, x ~= xs * (q + zq)): TMA's zero fill reads q = 0 in the
    padding, which is x = 0 only without the zero point, so each output needs + zq * (the sum of the weights of its
    taps inside the image). For interior pixels that is every tap, one value per column: it is folded into the bias
    here, at no per-element cost. The border pixels' difference (the taps outside) is subtracted after the store by
    _int8_border_kernel. Per-pixel terms in this epilogue cost ~1.3 ms per sdxl-1024 decode on an H200 (nine
    in-place [BM, BN] passes, which at K = 9 * Cin are as long as the main loop; docs/experiments.md E45, E46).
    RES: + the residual's tile (a box of r_desc, like the output's), added in fp32 as diffusers' resnet adds
    (input + hidden): the resnet's separate residual pass disappears (E47)."""
    cols = n + tl.arange(0, BN)
    cm = cols < co
    acc = acc.to(tl.float32)
    if ZP:  # + zq * (the sum of all taps' weights) * scales, folded into the bias
        sc = tl.load(s_ptr + cols, mask=cm, other=0.0) * xs
        off = zq * tl.load(ws_ptr + cols, mask=cm, other=0.0) * sc
        if HAS_BIAS:
            off += tl.load(b_ptr + cols, mask=cm, other=0.0)
        acc = acc * sc[None, :] + off[None, :]
    else:
        if HAS_SCALE:  # phase ph's weight scales are rows [ph * co, (ph + 1) * co) of the packed weights
            acc = acc * (tl.load(s_ptr + ph * co + cols, mask=cm, other=0.0)[None, :] * xs)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + cols, mask=cm, other=0.0)[None, :]
    if RES:  # (PHASES never: the host refuses a residual there)
        acc = tl.reshape(r_desc.load([f, h0, w0, n]), [BH * BW, BN]).to(tl.float32) + acc
    if PHASES:  # y seen as (frames, H, 2, W, 2 * co): output pixel (2h + pa, 2w + pb)
        y_desc.store([f, h0, pa, w0, pb * co + n], tl.reshape(acc.to(y_desc.dtype), [1, BH, 1, BW, BN]))
    else:
        y_desc.store([f, h0, w0, n], tl.reshape(acc.to(y_desc.dtype), [1, BH, BW, BN]))


@triton.jit
def _tma_conv_kernel(
    x_desc,  # [frames_in, H, W, C], box [1, BH, BW, BK]
    x1_desc,  # box [1, BH, BW, BK1] (BK1 > 0)
    w0_desc,  # [CO, K] K-major weights, box [BN0, BK]
    w1_desc,  # the same weights, box [BN1, BK] (unused when BN1 == 0)
    w01_desc,  # box [BN0, BK1] (BK1 > 0)
    w11_desc,  # box [BN1, BK1] (BK1 > 0 and BN1 > 0)
    y0_desc,  # [frames_out, H, W, CO], box [1, BH, BW, BN0]
    y1_desc,  # box [1, BH, BW, BN1]
    b_ptr,  # [CO] fp32 bias (HAS_BIAS)
    s_ptr,  # [CO] fp32 weight scale (HAS_SCALE)
    xs_ptr,  # [N] fp32 activation scale per sample (XS_PTR)
    x_scale,  # fp32 activation scale when not XS_PTR
    T,  # output frames per sample
    H,
    W,
    C,
    CO,
    N_TILES,  # column tiles of BN0 + BN1 channels
    KT: tl.constexpr,
    KH: tl.constexpr,
    KW: tl.constexpr,
    PH: tl.constexpr,
    PW: tl.constexpr,
    BH: tl.constexpr,
    BW: tl.constexpr,
    BK: tl.constexpr,
    BN0: tl.constexpr,
    BN1: tl.constexpr,
    BK1: tl.constexpr,  # > 0: C == BK + BK1, one K step per tap with two channel boxes (e.g. 96 = 64 + 32)
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    XS_PTR: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast operands before tl.dot (the CPU interpreter's bf16 dot is wrong)
    PHASES: tl.constexpr = False,  # the four 2x2 phase convs of a 2x upsample + 3x3 conv in one launch (see below)
    ZP: tl.constexpr = False,  # int8 with zero points: the interior term in the epilogue (see _tma_epilogue)
    I32: tl.constexpr = False,  # int8 operands and not DOT_F32: accumulate in int32
    zq_ptr=None,  # [N] fp32 (ZP): per-sample zero point, in units of the activation scale
    ws_ptr=None,  # [9, CO] fp32 (ZP): conv.tap_sums of the int8 weights
    RES: tl.constexpr = False,  # add a residual in the epilogue (see _tma_epilogue)
    r0_desc=None,  # (RES) the residual as [frames_out, H, W, CO], box [1, BH, BW, BN0]
    r1_desc=None,  # box [1, BH, BW, BN1]
):
    pid = tl.program_id(0)
    # column tiles fastest: the programs that share an input box run together and meet it in L2
    pid_n = pid % N_TILES
    pid_s = pid // N_TILES
    if PHASES:  # phase (a, b) next: its boxes are its neighbours' shifted by one pixel
        ph = pid_s % 4
        pid_s = pid_s // 4
        pa = ph // 2
        pb = ph % 2
    else:
        ph = 0
        pa = 0
        pb = 0
    nw = tl.cdiv(W, BW)
    nh = tl.cdiv(H, BH)
    wt = pid_s % nw
    r = pid_s // nw
    ht = r % nh
    f = r // nh  # output frame over all samples
    smp = f // T
    fin = f + smp * (KT - 1)  # the same frame's tap dt = 0 in the input (history in front of each sample)
    h0 = ht * BH
    w0 = wt * BW
    n0 = pid_n * (BN0 + BN1)
    BM: tl.constexpr = BH * BW
    if I32:
        acc0 = tl.zeros([BM, BN0], dtype=tl.int32)
        acc1 = tl.zeros([BM, BN1 if BN1 > 0 else 16], dtype=tl.int32)
    else:
        acc0 = tl.zeros([BM, BN0], dtype=tl.float32)
        acc1 = tl.zeros([BM, BN1 if BN1 > 0 else 16], dtype=tl.float32)
    CB = 1 if BK1 > 0 else C // BK
    for it in tl.range(0, KT * KH * KW * CB, num_stages=NUM_STAGES):
        tap = it // CB
        cb = it - tap * CB
        dt = tap // (KH * KW)
        rr = tap - dt * (KH * KW)
        dy = rr // KW - PH + pa
        dx = rr % KW - PW + pb
        a = tl.reshape(x_desc.load([fin + dt, h0 + dy, w0 + dx, cb * BK]), [BM, BK])
        k = tap * C + cb * BK
        b0 = w0_desc.load([ph * CO + n0, k])
        if DOT_F32:
            a = a.to(tl.float32)
            b0 = b0.to(tl.float32)
        acc0 = _mma(a, b0, acc0, I32)
        if BN1 > 0:
            b1 = w1_desc.load([ph * CO + n0 + BN0, k])
            if DOT_F32:
                b1 = b1.to(tl.float32)
            acc1 = _mma(a, b1, acc1, I32)
        if BK1 > 0:
            a1 = tl.reshape(x1_desc.load([fin + dt, h0 + dy, w0 + dx, BK]), [BM, BK1])
            b01 = w01_desc.load([ph * CO + n0, k + BK])
            if DOT_F32:
                a1 = a1.to(tl.float32)
                b01 = b01.to(tl.float32)
            acc0 = _mma(a1, b01, acc0, I32)
            if BN1 > 0:
                b11 = w11_desc.load([ph * CO + n0 + BN0, k + BK])
                if DOT_F32:
                    b11 = b11.to(tl.float32)
                acc1 = _mma(a1, b11, acc1, I32)
    if XS_PTR:
        xs = tl.load(xs_ptr + smp)
    else:
        xs = x_scale
    zq = 0.0
    if ZP:
        zq = tl.load(zq_ptr + smp)
    _tma_epilogue(acc0, n0, CO, f, h0, w0, y0_desc, s_ptr, b_ptr, xs, BH, BW, BN0, HAS_SCALE, HAS_BIAS,
                  PHASES, ph, pa, pb, ZP, zq, ws_ptr, RES, r0_desc)
    if BN1 > 0:
        _tma_epilogue(acc1, n0 + BN0, CO, f, h0, w0, y1_desc, s_ptr, b_ptr, xs, BH, BW, BN1, HAS_SCALE, HAS_BIAS,
                      PHASES, ph, pa, pb, ZP, zq, ws_ptr, RES, r1_desc)


@dataclasses.dataclass(frozen=True)
class TmaConfig:
    bh: int = 1  # output tile: bh rows x bw columns of one frame
    bw: int = 128
    bk: int = 32
    bn0: int = 64
    bn1: int = 32
    num_warps: int = 4
    num_stages: int = 4
    bk1: int = 0  # > 0: Cin == bk + bk1, one K step per tap

    def n_width(self) -> int:
        return self.bn0 + self.bn1


ROW_TILE = TmaConfig(1, 128, 128, 128, 0, 8, 3)  # 2D e4m3 layers whose width is a multiple of 128 (E27)
_TILE_4X32 = TmaConfig(4, 32, 128, 128, 0, 8, 4)  # E20's tile for 128-512 ch: Conv3d layers, other widths
_TILE_8X16 = TmaConfig(8, 16, 128, 128, 0, 8, 4)  # E21's tile for the phase convs at other widths
# bf16, Wan 2.1's 96 -> 96 causal Conv3d: the best of a CUDA-graph-timed sweep (h200_tma_conv-bf16-wan_2026-11-22)
BF16_WAN96 = TmaConfig(2, 64, 64, 64, 32, 4, 3, bk1=32)


def bf16_wan96(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Wan's bf16 96-channel causal convs can run on this kernel: bf16 activations on a GPU where `available`.
    Where it holds, triton_conv packs their weights K-major, and stacked_conv3d (auto) leaves them unstacked when the
    pipeline will run triton_conv."""
    return dtype == torch.bfloat16 and available(device)


def tuned_config(cin: int, cout: int, w: int, fp8: bool, video: bool = False) -> TmaConfig | None:
    """The measured best tile for an e4m3 layer class, or None where the pointer kernel stays (E20, E27): Wan's
    96/192 ch; 128-512 ch as one 128-pixel row for 2D convs whose width w is a multiple of 128, else 4 x 32 (video:
    causal Conv3d). bf16: only Wan's 96 -> 96 causal Conv3d (BF16_WAN96; the caller packs those weights K-major only
    where `bf16_wan96` holds); elsewhere the kernel trails cuDNN."""
    if not fp8:
        return BF16_WAN96 if video and cin == cout == 96 else None
    if cin == cout == 96:
        return TmaConfig(1, 256, 64, 64, 32, 8, 3, bk1=32)
    if cin == cout == 192:
        return TmaConfig(1, 128, 64, 128, 64, 8, 3)
    if cin % 128 == 0 and cout % 128 == 0 and w >= 32:  # measured at Cin = Cout; the tile is the same for 512 -> 256
        return ROW_TILE if not video and w % 128 == 0 else _TILE_4X32
    return None


def int8_config(cin: int, cout: int, w: int) -> TmaConfig:
    """The tile for an int8 3x3 conv: the e4m3 tile of the same shape (same operand bytes and wgmma rate on sm_90),
    else E20's 4 x 32 with the widest BK that divides Cin."""
    cfg = tuned_config(cin, cout, w, True)
    if cfg is not None and not cfg.bk1:
        return cfg
    bk = next(b for b in (128, 64, 32, 16) if cin % b == 0) if cin % 16 == 0 else None
    if bk is None or cout % 16:
        raise ValueError(f"int8 conv: {cin} -> {cout} channels (needs multiples of 16)")
    bn = 128 if cout % 128 == 0 else (64 if cout % 64 == 0 else (32 if cout % 32 == 0 else 16))
    return TmaConfig(4, 32, bk, bn, 0, 8 if bn == 128 else 4, 3)


def tuned_upconv_config(cin: int, cout: int, w: int | None = None) -> TmaConfig | None:
    """The measured tile for the merged e4m3 phase convs of an upsampler (upconv_tma_checked) with input width w, or
    None where the channels do not fit one: the row tile for widths that are a multiple of 128, else 8 x 16, which
    wastes fewer padding pixels on narrow frames (w None: unknown; E21, E27)."""
    if cin % 128 == 0 and cout % 128 == 0:
        return ROW_TILE if w is not None and w % 128 == 0 else _TILE_8X16
    return None


def conv_tma(
    x: torch.Tensor,
    pw: PackedWeight,
    bias: torch.Tensor | None,
    padding: tuple[int, int],
    *,
    x_scale: torch.Tensor | float | None = None,
    out_dtype: torch.dtype | None = None,
    config: TmaConfig | None = None,
) -> torch.Tensor:
    """The same contract as `conv.conv_igemm` (stride 1, 'same' spatial padding, no temporal padding), through TMA
    boxes. pw must be packed K-major and Cin a multiple of the config's BK."""
    a = check_args("conv_tma", x, pw, padding, x_scale, out_dtype)
    if not pw.kmajor:
        raise ValueError("conv_tma: weights must be packed K-major (pack_weight(..., kmajor=True))")
    cfg = config or tuned_config(pw.cin, pw.cout, a.W, a.fp8, a.video)
    if cfg is None:
        raise ValueError(f"conv_tma: no tile config for {pw.cin}->{pw.cout} channels (pass one)")
    return conv_tma_checked(x, pw, bias, padding, a, cfg)


def _check_k(who: str, C: int, cfg: TmaConfig) -> None:
    """A K step never straddles two taps: Cin is a multiple of BK, or exactly BK + BK1."""
    if cfg.bk1 and cfg.bk + cfg.bk1 != C:
        raise ValueError(f"{who}: config splits Cin as {cfg.bk} + {cfg.bk1}, the layer has {C}")
    if not cfg.bk1 and C % cfg.bk:
        raise ValueError(f"{who}: Cin {C} is not a multiple of BK {cfg.bk}")


def _launch(x: torch.Tensor, xd: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, a: ConvArgs,
            cfg: TmaConfig, yv: torch.Tensor, y_box: list[int], frames: int, T: int, CO: int, pads: tuple[int, int],
            phases: bool, rv: torch.Tensor | None = None) -> None:
    """Encode the descriptors and launch _tma_conv_kernel over `frames` output frames (N*T, or N*4 phase frames).
    xd: the input as (frames_in, H, W, C); yv: the output view the store descriptor covers, y_box its box without
    the column width. rv: a residual laid out like yv, added in the epilogue. Unused descriptors are passed as None
    (constexpr): each descriptor argument costs host time at every launch."""
    bh, bw, bk, bn0, bn1, bk1 = cfg.bh, cfg.bw, cfg.bk, cfg.bn0, cfg.bn1, cfg.bk1
    kt, kh, kw = pw.kernel
    b = bias.detach().float().contiguous() if bias is not None else None
    x_desc = TensorDescriptor(xd, list(xd.shape), list(xd.stride()), [1, bh, bw, bk])
    x1_desc = TensorDescriptor(xd, list(xd.shape), list(xd.stride()), [1, bh, bw, bk1]) if bk1 else None
    w0_desc = TensorDescriptor.from_tensor(pw.w, [bn0, bk])
    w1_desc = TensorDescriptor.from_tensor(pw.w, [bn1, bk]) if bn1 else None
    w01_desc = TensorDescriptor.from_tensor(pw.w, [bn0, bk1]) if bk1 else None
    w11_desc = TensorDescriptor.from_tensor(pw.w, [bn1, bk1]) if bk1 and bn1 else None
    y0_desc = TensorDescriptor(yv, list(yv.shape), list(yv.stride()), [*y_box, bn0])
    y1_desc = TensorDescriptor(yv, list(yv.shape), list(yv.stride()), [*y_box, bn1]) if bn1 else None
    r0_desc = TensorDescriptor(rv, list(rv.shape), list(rv.stride()), [*y_box, bn0]) if rv is not None else None
    r1_desc = TensorDescriptor(rv, list(rv.shape), list(rv.stride()), [*y_box, bn1]) if rv is not None and bn1 \
        else None
    n_tiles = triton.cdiv(CO, cfg.n_width())
    zp = a.int8 and a.zq_t is not None  # symmetric int8 (the upsamplers' inputs): no zero point
    if zp and (phases or kt != 1 or yv.stride(3) != 1):
        raise ValueError("conv_tma: int8 zero points are for 2D 3x3 convs into a (frames, H, W, Cout) output")
    grid = (frames * triton.cdiv(a.H, bh) * triton.cdiv(a.W, bw) * n_tiles,)
    _tma_conv_kernel[grid](
        x_desc, x1_desc, w0_desc, w1_desc, w01_desc, w11_desc, y0_desc, y1_desc,
        b, pw.scale if a.fp8 else None, a.xs_t, a.xs_f,
        T, a.H, a.W, pw.cin, CO, n_tiles,
        KT=kt, KH=kh, KW=kw, PH=pads[0], PW=pads[1], BH=bh, BW=bw, BK=bk, BN0=bn0, BN1=bn1, BK1=bk1,
        HAS_BIAS=b is not None, HAS_SCALE=a.fp8, XS_PTR=a.xs_t is not None, NUM_STAGES=cfg.num_stages,
        DOT_F32=x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.int8), PHASES=phases,
        ZP=zp, I32=a.int8 and x.device.type != "cpu", zq_ptr=a.zq_t if zp else None,
        ws_ptr=pw.tapsum if zp else None, RES=rv is not None, r0_desc=r0_desc, r1_desc=r1_desc,
        num_warps=cfg.num_warps, **({"maxnreg": RES_MAXNREG} if rv is not None and RES_MAXNREG and x.is_cuda else {}),
    )
    if zp:  # the zero-point term's border half (_int8_border_kernel): 2W + 2H pixels per frame
        n_border = a.W * min(a.H, 2) + max(a.H - 2, 0) * min(a.W, 2)
        bc = min(128, triton.next_power_of_2(CO))
        n_c = triton.cdiv(CO, bc)
        _int8_border_kernel[(frames * triton.cdiv(n_border, 32) * n_c,)](
            yv, pw.scale, a.xs_t, a.zq_t, pw.tapsum, a.H, a.W, CO, n_border, n_c, yv.stride(0), yv.stride(1),
            yv.stride(2), BLOCK_P=32, BLOCK_C=bc, num_warps=4,
        )  # fmt: skip


def upconv_tma_checked(x: torch.Tensor, pw4: PackedWeight, bias: torch.Tensor | None, a: ConvArgs,
                       cfg: TmaConfig) -> torch.Tensor:
    """conv3x3(2x nearest upsample of x) as its four 2x2 phase convs in one launch (kernels/upconv.py explains the
    phases). x: (N, Cin, H, W) channels_last, pw4: the K-major packed phase kernels (4 * Cout, Cin, 2, 2), phase
    p = 2a + b in rows [p * Cout, (p + 1) * Cout); `a` describes x (N, H, W, scales; Tin = T = 1). Each program
    computes one phase of one output tile, with top/left padding (1 - a, 1 - b), and stores it through a descriptor
    of the output seen as (N, H, 2, W, 2 * Cout): no phase-stacked buffer, no interleave pass. Cout must be a
    multiple of the config's column tile, so that a store box never reaches into the other column phase.
    x and pw4 were checked by the caller (upconv.upconv2x_8bit). Returns (N, 2H, 2W, Cout) dense (NHWC) in a.odt."""
    N, H, W = a.N, a.H, a.W
    CO = pw4.cout // 4
    if CO % cfg.n_width():
        raise ValueError(f"upconv_tma: Cout {CO} is not a multiple of the config's column tile {cfg.n_width()}")
    _check_k("upconv_tma", pw4.cin, cfg)
    y = torch.empty((N, 2 * H, 2 * W, CO), device=x.device, dtype=a.odt)
    if y.numel():
        _launch(x, x.permute(0, 2, 3, 1), pw4, bias, a, cfg, y.view(N, H, 2, W, 2 * CO), [1, cfg.bh, 1, cfg.bw],
                N * 4, 1, CO, (1, 1), True)
    return y


def conv_tma_checked(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, padding: tuple[int, int],
                     a: ConvArgs, cfg: TmaConfig, residual: torch.Tensor | None = None) -> torch.Tensor:
    """conv_tma after its arguments were checked (`a` from conv.check_args, pw K-major): what conv_igemm's dispatch
    calls, so that a dispatched call is validated once.

    padding is the top / left padding (the kernel's tap offsets); the output has the input's H x W. residual: a tensor of the output's shape and dtype, channels_last, added to the result in the epilogue (2D
    convs; checked by conv.check_residual)."""
    N, Tin, T, H, W = a.N, a.Tin, a.T, a.H, a.W
    _check_k("conv_tma", pw.cin, cfg)
    rv = None
    if residual is not None:  # (N, H, W, Cout) with its dense strides spelled out (size-1 dims report odd ones)
        C = pw.cout
        rv = residual.as_strided((N, H, W, C), (H * W * C, W * C, C, 1), residual.storage_offset())
    yd = torch.empty((N * T, H, W, pw.cout), device=x.device, dtype=a.odt)
    if yd.numel():
        xd = (x.permute(0, 2, 3, 1) if x.ndim == 4 else x.permute(0, 2, 3, 4, 1)).reshape(N * Tin, H, W, pw.cin)
        _launch(x, xd, pw, bias, a, cfg, yd, [1, cfg.bh, cfg.bw], N * T, T, pw.cout, padding, False, rv)
    return a.output_view(yd)
