"""What the three implicit-GEMM conv kernels share (`conv.py`'s pointer kernel, `tma_conv.py`, `ws_conv.py`): the
packed weight (the GEMM's B operand, bf16 / e4m3 / int8) and the checked arguments of a call. Pure torch.

Each kernel file imports this contract rather than another kernel file, so `conv.conv_igemm` can dispatch to the
TMA and warp-specialized kernels at import time with no cycle between them.
"""

from __future__ import annotations

import dataclasses

import torch

from vaeopt.kernels.fp8_quant import E4M3, quantize_per_channel, quantize_per_channel_int8


@dataclasses.dataclass
class PackedWeight:
    """Conv weights as the kernel's B operand: [taps * Cin, Cout] dense, taps in (kt, kh, kw) order."""

    w: torch.Tensor
    kernel: tuple[int, int, int]  # (kt, kh, kw)
    cin: int
    cout: int
    scale: torch.Tensor | None = None  # fp8 / int8: [Cout] fp32 per-output-channel weight scale
    kmajor: bool = False  # stored [Cout, taps * Cin] (K contiguous) instead of [taps * Cin, Cout]
    tapsum: torch.Tensor | None = None  # int8 3x3: [9, Cout] fp32 sums of the int8 weights by border class (tap_sums)


def pack_weight(weight: torch.Tensor, dtype: torch.dtype | None = None, kmajor: bool | None = None) -> PackedWeight:
    """weight (Cout, Cin, kt, kh, kw) or (Cout, Cin, kh, kw) -> PackedWeight. dtype float8_e4m3fn: per-output-channel
    scaled e4m3 (scale in `.scale`); torch.int8: per-output-channel symmetric int8 (scale = amax / 127, round to
    nearest), plus `tapsum` for 3x3 kernels (the TMA kernel's zero-point correction, tma_conv); else the compute
    dtype (default: the weight's). kmajor (default: 8-bit only): store the B operand K-contiguous, the layout
    Hopper's 8-bit wgmma reads."""
    if weight.ndim == 4:
        weight = weight.unsqueeze(2)
    if weight.ndim != 5:
        raise ValueError(f"conv weight must be 4D or 5D, got {tuple(weight.shape)}")
    co, ci, kt, kh, kw = weight.shape
    wk = weight.detach().permute(2, 3, 4, 1, 0).reshape(kt * kh * kw * ci, co)
    scale = tapsum = None
    if dtype is not None and dtype == E4M3:
        wk, scale = quantize_per_channel(wk, dim=1)  # one scale per output channel (column of [K, Cout])
    elif dtype == torch.int8:
        wk, scale = quantize_per_channel_int8(wk, dim=1)
        if (kt, kh, kw) == (1, 3, 3):
            tapsum = tap_sums(wk.float().view(kh, kw, ci, co))
    elif dtype is not None:
        wk = wk.to(dtype)
    if kmajor is None:
        kmajor = scale is not None
    if kmajor:
        wk = wk.t()
    return PackedWeight(wk.contiguous(), (kt, kh, kw), ci, co, scale, kmajor, tapsum)


def tap_sums(wq: torch.Tensor) -> torch.Tensor:
    """wq (3, 3, Cin, Cout) (the int8 weights as floats) -> [9, Cout] fp32: the sum over all taps and Cin, then
    the sums of the top row, bottom row, left column and right column of taps, then the four corner taps.

    An int8 activation with a zero point, x ~= s * (q + zq), contributes s * zq * (sum of the weights of the taps
    that fall inside the image) to each output; for a 3x3 'same' conv that sum is all - (top row if the output is on
    the first row) - (bottom row if on the last) - (left / right column likewise) + (the corners counted twice).
    The padding itself reads q = 0 (TMA's zero fill), which is x = 0 only without the zero point."""
    t = wq.sum(dim=2)  # (3, 3, Cout)
    return torch.stack([t.sum((0, 1)), t[0].sum(0), t[2].sum(0), t[:, 0].sum(0), t[:, 2].sum(0),
                        t[0, 0], t[0, 2], t[2, 0], t[2, 2]]).float().contiguous()


def _frames_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int] | None:
    """x (N, C, T, H, W) channels_last_3d or (N, C, H, W) channels_last -> (x, N, T, H, W) when its memory is the
    dense NDHWC / NHWC block the kernel reads, else None."""
    if x.ndim == 4:
        if not x.is_contiguous(memory_format=torch.channels_last):
            return None
        n, _, h, w = x.shape
        return x, n, 1, h, w
    if x.ndim == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        n, _, t, h, w = x.shape
        return x, n, t, h, w
    return None


@dataclasses.dataclass
class ConvArgs:
    """What both implicit-GEMM kernels need to know about a call, after its arguments were checked."""

    N: int
    Tin: int
    T: int
    H: int
    W: int
    fp8: bool
    odt: torch.dtype
    xs_t: torch.Tensor | None  # fp8: per-sample activation scales on the device
    xs_f: float  # fp8: one activation scale (when xs_t is None)
    video: bool
    int8: bool = False  # int8 operands (int32 accumulation), x ~= xs * (q + zq)
    zq_t: torch.Tensor | None = None  # int8: per-sample zero points in units of the scale, on the device

    def output_view(self, yd: torch.Tensor) -> torch.Tensor:
        """yd (N*T, H, W, Cout) dense -> the output in x's layout: (N, Cout, [T,] H, W) channels_last[_3d]."""
        if not self.video:
            return yd.view(self.N, self.H, self.W, -1).permute(0, 3, 1, 2)
        return yd.view(self.N, self.T, self.H, self.W, -1).permute(0, 4, 1, 2, 3)


def per_sample_scales(who: str, x_scale: torch.Tensor, N: int, device: torch.device) -> torch.Tensor:
    """An activation scale tensor of 1 or N values on `device` -> N fp32 values, one per sample (read by the
    kernels from the device: no host sync)."""
    if x_scale.numel() not in (1, N) or x_scale.device != device:
        raise ValueError(f"{who}: x_scale must hold 1 or {N} values on {device}, got "
                         f"{tuple(x_scale.shape)} on {x_scale.device}")
    xs = x_scale.reshape(-1).float()
    return xs.expand(N).contiguous() if xs.numel() == 1 and N > 1 else xs


def residual_fits(r: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether r can be an int8 conv's epilogue residual for an output of this (N, Cout, H, W) shape, dtype and
    device: the same, channels_last dense."""
    return (r.dim() == 4 and tuple(r.shape) == tuple(shape) and r.dtype == dtype and r.device == device
            and r.permute(0, 2, 3, 1).is_contiguous())


def check_residual(who: str, r: torch.Tensor, a: ConvArgs, cout: int, device: torch.device) -> None:
    """A residual for the int8 conv's epilogue: the output's shape, dtype and device, channels_last dense."""
    if not a.int8:
        raise ValueError(f"{who}: a residual in the epilogue is for int8 convs")
    shape = (a.N, cout, a.H, a.W)
    if not residual_fits(r, shape, a.odt, device):
        raise ValueError(f"{who}: the residual must be a channels_last {shape} {a.odt} tensor on {device}, got "
                         f"{tuple(r.shape)} {r.dtype} on {r.device}")


def check_args(who: str, x: torch.Tensor, pw: PackedWeight, padding: tuple[int, int],
               x_scale: torch.Tensor | float | None, out_dtype: torch.dtype | None,
               x_zero: torch.Tensor | None = None) -> ConvArgs:
    """Validate a conv_igemm / conv_tma call (layout, channels, 'same' padding, frames, 8-bit pairing, scales)."""
    v = _frames_view(x)
    if v is None:
        raise ValueError(f"{who}: x {tuple(x.shape)} must be dense channels_last / channels_last_3d")
    _, N, Tin, H, W = v
    kt, kh, kw = pw.kernel
    ph, pwd = padding
    if x.shape[1] != pw.cin:
        raise ValueError(f"{who}: x has {x.shape[1]} channels, weights expect {pw.cin}")
    if 2 * ph != kh - 1 or 2 * pwd != kw - 1:
        raise ValueError(f"{who}: only 'same' spatial padding is supported (kernel {kh}x{kw}, pad {padding})")
    T = Tin - kt + 1
    if T < 1 or (x.ndim == 4 and kt != 1):
        raise ValueError(f"{who}: {Tin} input frames for a temporal kernel of {kt}")
    fp8 = pw.scale is not None  # 8-bit operands with scales: e4m3, or int8
    int8 = pw.w.dtype == torch.int8
    if fp8 and x.dtype != pw.w.dtype:
        raise ValueError(f"{who}: {pw.w.dtype} weights need {pw.w.dtype} activations, got {x.dtype}")
    if not fp8 and x.dtype in (E4M3, torch.int8):
        raise ValueError(f"{who}: 8-bit activations need 8-bit weights (pack_weight(w, {x.dtype}))")
    if not fp8 and x.dtype != pw.w.dtype:
        raise ValueError(f"{who}: x is {x.dtype}, weights {pw.w.dtype}")
    if x_zero is not None and not int8:
        raise ValueError(f"{who}: x_zero is for int8 activations")
    if int8 and (pw.kernel != (1, 3, 3) or pw.tapsum is None or not pw.kmajor):
        raise ValueError(f"{who}: int8 runs 3x3 'same' convs with K-major weights (pack_weight(w, torch.int8))")
    xs_t, xs_f = None, 1.0
    if fp8 and isinstance(x_scale, torch.Tensor):
        xs_t = per_sample_scales(who, x_scale, N, x.device)
    elif fp8:
        xs_f = float(x_scale or 1.0)
    zq_t = None
    if int8:
        if xs_t is None:
            xs_t = torch.full((N,), xs_f, device=x.device, dtype=torch.float32)
        zq_t = (per_sample_scales(who, x_zero, N, x.device) if isinstance(x_zero, torch.Tensor)
                else torch.zeros(N, device=x.device, dtype=torch.float32))
    return ConvArgs(N, Tin, T, H, W, fp8, out_dtype or (torch.bfloat16 if fp8 else x.dtype), xs_t, xs_f, x.ndim == 5,
                    int8, zq_t)
