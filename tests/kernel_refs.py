"""The torch compositions the kernels replace: the oracles of the kernel tests (fp32 unless the inputs say else)."""

import torch
import torch.nn.functional as F


def conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: tuple[int, int]):
    """conv.conv_igemm's conv with torch, in fp32: 2D for (N, C, H, W), causal 3D (no temporal padding) otherwise."""
    xf, wf = x.float(), weight.float()
    bf = bias.float() if bias is not None else None
    if x.ndim == 4:
        return F.conv2d(xf, wf, bf, 1, padding)
    return F.conv3d(xf, wf, bf, 1, (0, *padding))


def upconv2x_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What upconv.upconv2x replaces: conv3x3(interpolate(x, 2x nearest), padding 1)."""
    return F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), w, bias, padding=1)


def conv_taps_reference(stream: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What tapconv's norm+GEMM and tap sum compute: the conv over the [history | new] stream, 'same' in H and W."""
    return F.conv3d(stream, w, bias, 1, (0, w.shape[-2] // 2, w.shape[-1] // 2))


def bias_residual_reference(h, bias=None, residual=None, scale=1.0, upsample2x=False, residual_bias=None):
    """What epilogue.bias_residual replaces, in torch (diffusers' association and rounding points aside)."""
    shape = (1, -1) + (1,) * (h.dim() - 2)
    y = h if bias is None else h + bias.to(h.dtype).reshape(shape)
    if residual is not None:
        r = residual if residual_bias is None else residual + residual_bias.to(h.dtype).reshape(shape)
        y = r + y
    elif residual_bias is not None:
        y = residual_bias.to(h.dtype).reshape(shape) + y
    y = y / scale
    if upsample2x:
        y = F.interpolate(y, scale_factor=2.0, mode="nearest")
    return y
