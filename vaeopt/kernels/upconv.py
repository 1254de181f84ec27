"""2x nearest upsample followed by a 3x3 conv (padding 1), as four 2x2 convs on the low-resolution input.

Every decoder up-block ends with `conv3x3(interpolate(x, scale_factor=2, mode="nearest"))` (diffusers' Upsample2D,
WanResample's upsample2d/upsample3d). Output pixel (2i+a, 2j+b) of that conv reads the upsampled rows 2i+a-1 ..
2i+a+1, which are the input rows {i-1, i, i} (a = 0) or {i, i, i+1} (a = 1), and likewise for the columns. So each of
the four output phases (a, b) is a 2x2 conv of the *input* with taps summed from the 3x3 kernel:

    rows, a = 0:  [w0, w1 + w2] at input rows i-1, i        a = 1:  [w0 + w1, w2] at input rows i, i+1

The four phase kernels are stacked into one conv of 4*Cout output channels with a 2x2 kernel and padding 1, whose
output (H+1, W+1) holds phase (a, b) at offset (a, b): one cuDNN call with 16 instead of 36 multiply-adds per output
pixel and input channel (4/9 of the FLOPs), reading the input instead of its 4x upsampled copy. One pass then
interleaves the phases into the (2H, 2W) output, adding the conv's bias on the way (the Triton kernel below for NHWC;
four strided torch copies otherwise).

Exactness: the zero padding of the upsampled image is the zero padding of the input (upsampled row -1 and 2H are
input row -1 and H), so the result is the same linear map. In fp32 the only difference is rounding (the summed
taps, the summation order); in bf16/fp16 the summed taps are rounded once to the weight dtype (relative 2^-9 for
bf16), an error of the size the weights' own rounding already has. Tests compare against the plain composition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vaeopt.kernels.common import flat_layout, triton_available
from vaeopt.kernels.conv_args import ConvArgs, pack_weight, per_sample_scales
from vaeopt.kernels.fp8_quant import E4M3

# phase a's 2-tap rows as sums of the 3x3 kernel's rows: a=0 -> [w0, w1+w2], a=1 -> [w0+w1, w2]
_ROWS = ((1.0, 0.0, 0.0), (0.0, 1.0, 1.0)), ((1.0, 1.0, 0.0), (0.0, 0.0, 1.0))


def phase_weights(w: torch.Tensor) -> torch.Tensor:
    """(Cout, Cin, 3, 3) -> (4*Cout, Cin, 2, 2): phase p = 2a + b at channels [p*Cout, (p+1)*Cout). Summed in
    fp32 (fp64 for fp64 weights), rounded once to w's dtype."""
    if w.dim() != 4 or tuple(w.shape[-2:]) != (3, 3):
        raise ValueError(f"phase_weights: expected a (Cout, Cin, 3, 3) kernel, got {tuple(w.shape)}")
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    r = torch.tensor(_ROWS, dtype=acc, device=w.device)  # (a, tap, 3)
    w4 = torch.einsum("aik,ockl,bjl->abocij", r, w.detach().to(acc), r)  # (2, 2, Cout, Cin, 2, 2)
    return w4.reshape(4 * w.shape[0], w.shape[1], 2, 2).to(w.dtype)


def upconv2x(x: torch.Tensor, w4: torch.Tensor, bias: torch.Tensor | None = None,
             stats_groups: int | None = None) -> torch.Tensor:
    """conv3x3(2x nearest upsample of x) for x (N, Cin, H, W), given w4 = phase_weights(w): (N, Cout, 2H, 2W) in
    x's memory format (channels_last stays channels_last). stats_groups: see interleave_phases."""
    if x.dim() != 4 or w4.dim() != 4 or tuple(w4.shape[-2:]) != (2, 2) or w4.shape[0] % 4:
        raise ValueError(f"upconv2x: x {tuple(x.shape)}, w4 {tuple(w4.shape)}")
    p = F.conv2d(x, w4, None, padding=1)  # (N, 4*Cout, H+1, W+1)
    return interleave_phases(p, bias, stats_groups)


def phase_weights_8bit(w: torch.Tensor, dtype: torch.dtype | None = None):
    """(Cout, Cin, 3, 3) -> the phase kernels (4 * Cout, Cin, 2, 2) (phase p = 2a + b in rows [p * Cout, (p + 1) *
    Cout)) as one 8-bit K-major PackedWeight with per-row scales: e4m3, or dtype torch.int8 (symmetric). The taps are
    summed in fp32 and quantized once."""
    return pack_weight(phase_weights(w.detach().float()), dtype or E4M3)


def upconv2x_8bit(x8: torch.Tensor, x_scale: torch.Tensor, pw4, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16, config=None) -> torch.Tensor:
    """conv3x3(2x nearest upsample of x) for an 8-bit x: an e4m3 x (N, Cin, H, W) channels_last with per-sample scales
    (x ≈ x8 * x_scale[n]) and pw4 = phase_weights_8bit(w): (N, Cout, 2H, 2W) channels_last in out_dtype. An int8 x
    (symmetric, act_quant.quantize_int8_per_sample) takes int8 phase kernels (phase_weights_8bit(w, torch.int8)):
    int32 accumulation on the same kernel, no zero point.

    Each phase (a, b) is a 2x2 conv of x with top/left padding (1 - a, 1 - b) on the TMA conv kernel
    (kernels/tma_conv.py: e4m3 operands, fp32 accumulation, scales and bias in the epilogue), whose output tile is
    stored straight into its strided place out[:, 2i + a, 2j + b]: no phase-stacked buffer, no interleave pass; the
    four phases in one launch (tma_conv.upconv_tma_checked: fewer launches than one per phase, E21). Needs
    TMA descriptors (sm_90 on a GPU; the interpreter on CPU) and a tile config for the channel counts
    (tma_conv.tuned_upconv_config unless `config` is given)."""
    if (x8.dim() != 4 or x8.dtype not in (E4M3, torch.int8)
            or not x8.is_contiguous(memory_format=torch.channels_last)):
        raise ValueError(f"upconv2x_8bit: x must be e4m3 or int8 (N, C, H, W) channels_last, got {x8.dtype} "
                         f"{tuple(x8.shape)}")
    N, C, H, W = x8.shape
    if (getattr(pw4, "kernel", None) != (1, 2, 2) or pw4.cin != C or pw4.scale is None or not pw4.kmajor
            or pw4.cout % 4 or pw4.w.dtype != x8.dtype):
        raise ValueError(f"upconv2x_8bit: pw4 must be the {str(x8.dtype).replace('torch.', '')} K-major 2x2 phase "
                         f"kernels of a {C}-channel input (phase_weights_8bit)")
    CO = pw4.cout // 4
    if not isinstance(x_scale, torch.Tensor):
        raise ValueError(f"upconv2x_8bit: x_scale must be a tensor of 1 or {N} scales on {x8.device}")
    xs = per_sample_scales("upconv2x_8bit", x_scale, N, x8.device)
    cfg = config or tma_conv.tuned_upconv_config(C, CO, W)
    if cfg is None:
        raise ValueError(f"upconv2x_8bit: no TMA tile for {C}->{CO} channels")
    args = ConvArgs(N, 1, 1, H, W, True, out_dtype, xs, 1.0, False, int8=x8.dtype == torch.int8)
    return tma_conv.upconv_tma_checked(x8, pw4, bias, args, cfg).permute(0, 3, 1, 2)


def interleave_phases(p: torch.Tensor, bias: torch.Tensor | None = None,
                      stats_groups: int | None = None) -> torch.Tensor:
    """(N, 4*C, H+1, W+1) phase-stacked conv output -> (N, C, 2H, 2W): out[2i+a, 2j+b] = p[phase 2a+b][i+a, j+b]
    (+ bias[c]). stats_groups=G: a GroupNorm of G groups reads the result next; on the channels-last kernel path the
    same pass takes its statistics and notes them on the result (as epilogue.bias_residual(stats_groups=))."""
    N, C4, H1, W1 = p.shape
    C, H, W = C4 // 4, H1 - 1, W1 - 1
    lay = flat_layout(p)
    if lay is not None and lay[0] == "cl" and p.dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and triton_available(p)[0] and not torch.compiler.is_compiling() and p.numel() > 0:
        if stats_groups and producer_stats_ok(C, int(stats_groups), 4 * H * W * C, p.device):
            return _interleave_cl_stats(p, lay[2], bias, C, H, W, int(stats_groups))
        return _interleave_cl(p, lay[2], bias, C, H, W)
    cl = lay is not None and lay[0] == "cl" and C > 1
    y = torch.empty((N, C, 2 * H, 2 * W), dtype=p.dtype, device=p.device,
                    memory_format=torch.channels_last if cl else torch.contiguous_format)
    y6 = y.view(N, C, H, 2, W, 2)
    p5 = p.view(N, 4, C, H1, W1) if not cl else p.permute(0, 2, 3, 1).unflatten(3, (4, C)).permute(0, 3, 4, 1, 2)
    for a in (0, 1):
        for b in (0, 1):
            y6[:, :, :, a, :, b].copy_(p5[:, 2 * a + b, :, a : a + H, b : b + W])
    if bias is not None:
        y.add_(bias.to(y.dtype).view(1, C, 1, 1))
    return y


def _interleave_cl(p: torch.Tensor, stride_pn: int, bias, C: int, H: int, W: int) -> torch.Tensor:
    import triton

    N = p.shape[0]
    y = torch.empty((N, 2 * H, 2 * W, C), dtype=p.dtype, device=p.device).permute(0, 3, 1, 2)
    BC = triton.next_power_of_2(C)
    tile = 4096 if p.is_cuda else 1 << 16
    BW = max(1, min(tile // BC, triton.next_power_of_2(2 * W)))
    nwb = triton.cdiv(2 * W, BW)
    if bias is not None:
        if bias.shape != (C,):
            raise ValueError(f"interleave_phases: bias {tuple(bias.shape)} for {C} channels")
        bias = bias.contiguous()
    _interleave_kernel[(N * 2 * H * nwb,)](p, bias if bias is not None else p, y, H, W, stride_pn, nwb,
                                           C=C, BLOCK_W=BW, BLOCK_C=BC, HAS_B=bias is not None,
                                           num_warps=4 if BW * BC <= 4096 else 8)
    return y


def _interleave_cl_stats(p: torch.Tensor, stride_pn: int, bias, C: int, H: int, W: int, G: int) -> torch.Tensor:
    """_interleave_cl that also writes the next GroupNorm's partials (G groups) and notes them on its output: chunks of
    output pixels per program, 8 programs per SM (the best of 4 launches at SDXL's upsamplers on an H100, E26)."""
    N = p.shape[0]
    y = torch.empty((N, 2 * H, 2 * W, C), dtype=p.dtype, device=p.device).permute(0, 3, 1, 2)
    if bias is not None:
        if bias.shape != (C,):
            raise ValueError(f"interleave_phases: bias {tuple(bias.shape)} for {C} channels")
        bias = bias.contiguous()
    g, part, kw = producer_partials(N, C, G, 4 * H * W, p.device, (4096, 4, 8, 1))
    _interleave_stats_kernel[(g["n_chunks"], N)](
        p, bias if bias is not None else p, y, part, H, W, stride_pn, G, C // G, g["n_chunks"], g["iters"],
        C=C, HAS_B=bias is not None, **kw,
    )  # fmt: skip
    attach_partials(y, G, part)
    return y


try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - no triton: the torch path above
    triton = None

if triton is not None:  # the 8-bit path (TMA conv) and the kernels below; the torch path above needs neither
    from vaeopt.kernels import tma_conv
    from vaeopt.kernels.common import accumulate_shifted, cl_store_partials, first_block_shift
    from vaeopt.kernels.group_norm_silu import attach_partials, producer_partials, producer_stats_ok

    @triton.jit
    def _interleave_kernel(
        p_ptr,  # [N, H+1, W+1, 4*C]: sample n at n*stride_pn, dense inside
        b_ptr,
        y_ptr,  # [N, 2H, 2W, C] dense
        H,
        W,
        stride_pn,
        n_w_blocks,
        C: tl.constexpr,
        BLOCK_W: tl.constexpr,  # output pixels of one output row per program
        BLOCK_C: tl.constexpr,
        HAS_B: tl.constexpr,
    ):
        t = tl.program_id(0)
        wb = t % n_w_blocks
        row = t // n_w_blocks  # n*2H + output row
        n = row // (2 * H)
        oy = row % (2 * H)
        i = oy // 2
        a = oy % 2
        wo = wb * BLOCK_W + tl.arange(0, BLOCK_W)
        c = tl.arange(0, BLOCK_C)
        cm = c < C
        m = (wo < 2 * W)[:, None] & cm[None, :]
        j = wo // 2
        b = wo % 2
        src = ((i + a).to(tl.int64) * (W + 1) + (j + b).to(tl.int64)[:, None]) * (4 * C) \
            + ((2 * a + b) * C)[:, None] + c[None, :]
        v = tl.load(p_ptr + n.to(tl.int64) * stride_pn + src, mask=m, other=0.0)
        if HAS_B:
            v = (v.to(tl.float32) + tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :])
        dst = (row.to(tl.int64) * (2 * W) + wo.to(tl.int64)[:, None]) * C + c[None, :]
        tl.store(y_ptr + dst, v.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _interleave_vals(p_row, s, c, m, W, C: tl.constexpr, b, HAS_B: tl.constexpr):
        """Output pixels s (flattened over (2H, 2W)) of one sample, channels c: the phase values (+ bias), fp32."""
        oy = s // (2 * W)
        ox = s - oy * (2 * W)
        i = oy // 2
        a = oy - 2 * i
        j = ox // 2
        bb = ox - 2 * j
        src = ((i + a).to(tl.int64) * (W + 1) + (j + bb).to(tl.int64)) * (4 * C) + (2 * a + bb) * C
        v = tl.load(p_row + src[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            v = v + b[None, :]
        return v

    @triton.jit
    def _interleave_stats_kernel(
        p_ptr,  # [N, H+1, W+1, 4*C]: sample n at n*stride_pn, dense inside
        b_ptr,
        y_ptr,  # [N, 2H, 2W, C] dense
        part_ptr,  # [5, N*G, n_chunks] fp32 out: the next GroupNorm's partials of y
        H,
        W,
        stride_pn,
        G,
        CG,
        n_chunks,
        iters,
        C: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_G: tl.constexpr,
        CG_POW2: tl.constexpr,
        UNROLL: tl.constexpr,
        HAS_B: tl.constexpr,
    ):
        chunk = tl.program_id(0)
        n = tl.program_id(1)
        S = 4 * H * W
        s_start = chunk * iters * (BLOCK_S * UNROLL)
        lim = S - s_start
        rows = tl.arange(0, BLOCK_S)
        c = tl.arange(0, BLOCK_C)
        cm = c < C
        p_row = p_ptr + n.to(tl.int64) * stride_pn
        y_row = y_ptr + n.to(tl.int64) * S * C
        b = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_B:
            b = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
        m0 = (rows < lim)[:, None] & cm[None, :]  # the shift: mean of the first row block (see the stats kernel)
        y0 = _interleave_vals(p_row, s_start + rows, c, m0, W, C, b, HAS_B)
        k = first_block_shift(y0.to(y_ptr.dtype.element_ty).to(tl.float32), m0, lim, BLOCK_S)
        s1 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        s2 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        am = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        for it in range(iters):
            for u in tl.static_range(UNROLL):
                r = (it * UNROLL + u) * BLOCK_S + rows
                m = (r < lim)[:, None] & cm[None, :]
                s = s_start + r
                yq = _interleave_vals(p_row, s, c, m, W, C, b, HAS_B).to(y_ptr.dtype.element_ty)
                tl.store(y_row + s.to(tl.int64)[:, None] * C + c[None, :], yq, mask=m)
                s1, s2, am = accumulate_shifted(yq.to(tl.float32), m, k, s1, s2, am)
        cnt = tl.minimum(lim, iters * BLOCK_S * UNROLL).to(tl.float32)
        cl_store_partials(s1, s2, am, k, cnt, part_ptr, n, chunk, n_chunks, tl.num_programs(1), G, CG, c, cm,
                           BLOCK_G, CG_POW2, True)
