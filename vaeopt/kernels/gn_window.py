"""GroupNorm applied with given statistics to a window of a larger buffer, in place: the last step of the split API
(group_norm_silu.py: partials of tiles -> merged -> applied), which the exact tiled and the band-parallel decoders use.

y = silu((x + x_bias[c] - mean[n, c]) * scale[n, c] + bias[c]), one read and one write, fp32 math, one rounding;
x and y may have any strides, and a zero ring around y (the next conv's padding) is written in the same pass.
`group_norm_silu.group_norm_apply` is this function (re-exported there, next to the rest of the split API).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vaeopt.kernels.common import default_tile, default_warps

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Sizes/offsets that differ between the tiles of one layer (border vs interior tiles, the last row band) are not
# specialized on, so a layer compiles one variant instead of one per divisibility pattern.
@triton.jit(do_not_specialize=["Hi", "Wi", "Wo", "P", "syn", "syh", "pt", "pl", "n_p_blocks"])
def _apply_win_kernel(
    x_ptr,  # (N, C, Hi, Wi) with any strides (e.g. a window of a larger NHWC / NCHW buffer), read in place
    y_ptr,  # (N, C, Ho, Wo) with any strides (dense output, or a window of a buffer)
    mean_ptr,  # [N, C] fp32: group mean of (x + x_bias)
    a_ptr,  # [N, C] fp32: rstd * weight
    b_ptr,  # [C] affine bias
    xb_ptr,  # [C] input bias (read only when XB)
    C,
    Hi,
    Wi,
    Wo,
    P,  # output pixels per sample: Ho * Wo
    sxn,
    sxc,
    sxh,
    sxw,
    syn,
    syc,
    syh,
    syw,
    pt,  # output (i, j) reads input (i - pt, j - pl); outside the input the output is 0 (a conv's zero padding)
    pl,
    n_p_blocks,
    n_c_blocks,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SILU: tl.constexpr,
    XB: tl.constexpr,
    PAD: tl.constexpr,  # some output pixels lie outside the input
    CF: tl.constexpr,  # channels-first tile [BLOCK_C, BLOCK_P] (pixels contiguous); else [BLOCK_P, BLOCK_C]
):
    pid = tl.program_id(0)
    cb = pid % n_c_blocks
    t = pid // n_c_blocks
    pb = t % n_p_blocks
    n = t // n_p_blocks
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    pm = p < P
    cm = c < C
    i = p // Wo
    j = p - i * Wo
    si = i - pt
    sj = j - pl
    if PAD:
        inside = pm & (si >= 0) & (si < Hi) & (sj >= 0) & (sj < Wi)
    else:
        inside = pm
    xo = n.to(tl.int64) * sxn + si.to(tl.int64) * sxh + sj.to(tl.int64) * sxw  # [BLOCK_P]
    yo = n.to(tl.int64) * syn + i.to(tl.int64) * syh + j.to(tl.int64) * syw
    mu = tl.load(mean_ptr + n * C + c, mask=cm, other=0.0)
    if XB:  # same association as the fused path's finalize: (x - (mean - xb)) * a + b
        mu = mu - tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + n * C + c, mask=cm, other=0.0)
    b = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    cx = c.to(tl.int64) * sxc
    cy = c.to(tl.int64) * syc
    if CF:
        m = cm[:, None] & inside[None, :]
        x = tl.load(x_ptr + cx[:, None] + xo[None, :], mask=m, other=0.0).to(tl.float32)
        y = (x - mu[:, None]) * a[:, None] + b[:, None]
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        if PAD:
            y = tl.where(m, y, 0.0)
        tl.store(y_ptr + cy[:, None] + yo[None, :], y.to(y_ptr.dtype.element_ty), mask=cm[:, None] & pm[None, :])
    else:
        m = inside[:, None] & cm[None, :]
        x = tl.load(x_ptr + xo[:, None] + cx[None, :], mask=m, other=0.0).to(tl.float32)
        y = (x - mu[None, :]) * a[None, :] + b[None, :]
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        if PAD:
            y = tl.where(m, y, 0.0)
        tl.store(y_ptr + yo[:, None] + cy[None, :], y.to(y_ptr.dtype.element_ty), mask=pm[:, None] & cm[None, :])


def group_norm_apply(
    x: torch.Tensor,
    mean: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
    *,
    x_bias: torch.Tensor | None = None,
    pad: tuple[int, int, int, int] = (0, 0, 0, 0),
    out: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """y = silu((x + x_bias[c] - mean[n, c]) * scale[n, c] + bias[c]) (silu optional) for x (N, C, H, W) with GIVEN
    statistics (e.g. `group_norm_finalize` of partials merged over all tiles of an activation). One read of x, one
    write of y, fp32 math, one rounding to the output dtype (no fp32 intermediate tensor).

    x may have any strides -- a window of a larger NHWC/NCHW buffer is read in place. pad = (top, bottom, left,
    right): the output is (N, C, H + top + bottom, W + left + right) with x at offset (top, left) and ZEROS in the
    ring (after the activation: a following conv's zero padding, so it can run with padding=0). Output: dense, in x's
    layout (channels-last when x's channel stride is 1, else contiguous), x's dtype; or written into `out` (any
    strides, any float dtype). mean/scale: float32 (N, C) or (C,).
    """
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"group_norm_apply: dtype {x.dtype} not supported")
    if x.dim() != 4:
        raise ValueError(f"group_norm_apply: expected (N, C, H, W), got {tuple(x.shape)}")
    N, C, Hi, Wi = x.shape
    pt, pb, pl, pr = (int(v) for v in pad)
    if min(pt, pb, pl, pr) < 0:
        raise ValueError(f"group_norm_apply: negative pad {pad}")
    Ho, Wo = Hi + pt + pb, Wi + pl + pr
    dev = x.device

    def vec(name, v, per_sample):
        if v is None:
            return None
        v = v.to(device=dev)
        if per_sample and v.numel() == C and N > 1:
            v = v.reshape(1, C).expand(N, C)
        if v.numel() != (N * C if per_sample else C):
            raise ValueError(f"group_norm_apply: {name} has {v.numel()} values for {N} x {C}")
        return v.reshape(N, C).float().contiguous() if per_sample else v.reshape(C)

    mean, scale = vec("mean", mean, True), vec("scale", scale, True)
    b = vec("bias", bias, False)
    xb = vec("x_bias", x_bias, False)
    if b is None:
        b = torch.zeros(C, device=dev, dtype=torch.float32)
    cl = C > 1 and x.stride(1) == 1 and Hi * Wi > 1
    if out is None:
        if cl:
            out = torch.empty((N, Ho, Wo, C), device=dev, dtype=x.dtype).permute(0, 3, 1, 2)
        else:
            out = torch.empty((N, C, Ho, Wo), device=dev, dtype=x.dtype)
    elif tuple(out.shape) != (N, C, Ho, Wo) or out.dtype not in SUPPORTED_DTYPES or out.device != dev:
        raise ValueError(f"group_norm_apply: out must be a float tensor {(N, C, Ho, Wo)} on {dev}")
    if out.numel() == 0:
        return out
    tile = tile or default_tile(dev)
    nw = num_warps or default_warps(tile)
    P = Ho * Wo
    CF = not (out.stride(1) == 1 or C == 1)  # channels-first output: tile with pixels fastest
    if CF:
        BLOCK_P = min(triton.next_power_of_2(P), max(256, tile // 4))
        BLOCK_C = max(1, min(tile // BLOCK_P, triton.next_power_of_2(C)))
    else:
        BLOCK_C = min(triton.next_power_of_2(C), max(16, tile // 4))
        BLOCK_P = max(1, min(tile // BLOCK_C, triton.next_power_of_2(P)))
    npb, ncb = triton.cdiv(P, BLOCK_P), triton.cdiv(C, BLOCK_C)
    _apply_win_kernel[(N * npb * ncb,)](
        x, out, mean, scale, b, xb if xb is not None else b, C, Hi, Wi, Wo, P,
        *x.stride(), *out.stride(), pt, pl, npb, ncb,
        BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C, SILU=bool(silu), XB=xb is not None, PAD=(Ho, Wo) != (Hi, Wi),
        CF=CF, num_warps=nw,
    )  # fmt: skip
    return out
