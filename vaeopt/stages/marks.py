"""What the stages leave on modules, and the shape tests that several stages and the decoders share.

A stage marks the layers it chose (an attribute on the module); the decoders that honour a mark, and the other stages
that build on it, read it here. Keeping the names and tests in one module lets every stage import it without
importing each other both ways, and lets the decoders (vaeopt.engine, vaeopt.video, vaeopt.tiling) read a mark
without importing the stage that sets it.
"""

from __future__ import annotations

import torch
from torch import nn

from vaeopt.stages import unhooked, weight_version

# --- attribute names ------------------------------------------------------------------------------------------------
FUSED_EPILOGUES = "_vaeopt_fused_epilogues"  # model: the record fused_epilogues.revert() needs
FUSED_NORMS = "_vaeopt_fused_norms"  # model: the modules fused_norms swapped
IGEMM = "_vaeopt_igemm"  # Conv3d: triton_conv runs it on the implicit-GEMM kernel
IGEMM_PACKED = "_vaeopt_igemm_packed"
CONV8 = "_vaeopt_fp8conv"  # conv: FP8 level 3 runs it with 8-bit operands (e4m3, or int8 with CONV8_INT8)
CONV8_PACKED = "_vaeopt_fp8conv_packed"
CONV8_INT8 = "_vaeopt_conv8_int8"  # image resnet conv: int8 operands, not e4m3 (resnets asymmetric, upsamplers not)
FP8_ATTR = "_vaeopt_fp8_attention"  # Attention: its core runs as fp8_attention (e4m3 GEMMs)
STACK3D = "_vaeopt_stack3d"  # WanCausalConv3d: stacked_conv3d runs it as a Conv2d over time-stacked channels
UPCONV = "_vaeopt_upconv"  # Conv2d after a 2x nearest upsample: upsample_conv runs it as 2x2 phase convs


def is_wan(model: nn.Module) -> bool:
    return type(model).__name__ == "AutoencoderKLWan"


def stacked(conv: nn.Module) -> bool:
    """stacked_conv3d marked this conv."""
    return bool(getattr(conv, STACK3D, False))


def wan_conv_fits(m: nn.Module) -> bool:
    """A stock, unhooked WanCausalConv3d that the implicit-GEMM kernel computes exactly: 3x3x3, stride/dilation 1,
    one group, 'same' spatial padding done by the cache-aware caller."""
    try:
        from diffusers.models.autoencoders import autoencoder_kl_wan as wan
    except ImportError:  # pragma: no cover
        return False
    if type(m).forward is not wan.WanCausalConv3d.forward or not unhooked(m):
        return False
    return (tuple(m.kernel_size) == (3, 3, 3) and tuple(m.stride) == (1, 1, 1) and tuple(m.dilation) == (1, 1, 1)
            and m.groups == 1 and m.padding == (0, 0, 0) and m._padding[0] == 1 and m._padding[2] == 1
            and getattr(m, "weight", None) is not None)


def is_2x_nearest(up: nn.Module) -> bool:
    """An nn.Upsample (e.g. WanUpsample) doing exactly a 2x nearest / nearest-exact upsample of H and W (for a 2x
    factor both modes pick source pixel i // 2: the same copy)."""
    if not isinstance(up, nn.Upsample) or up.mode not in ("nearest", "nearest-exact") or up.size is not None:
        return False
    sf = up.scale_factor
    sf = tuple(sf) if isinstance(sf, (tuple, list)) else (sf, sf)
    return len(sf) == 2 and all(float(f) == 2.0 for f in sf) and unhooked(up)


def interpolating_upsampler(up: nn.Module) -> bool:
    """diffusers' Upsample2D in its nearest-2x-then-conv form (no transposed conv, no norm)."""
    return bool(getattr(up, "interpolate", False) and not getattr(up, "use_conv_transpose", False)
                and getattr(up, "norm", None) is None)


def head_dim(attn: nn.Module) -> int:
    return attn.to_q.out_features // attn.heads


def wan_channels_last(vae: nn.Module, channels_last: bool | None = None) -> bool:
    """Whether Wan's chunk decoder runs channels_last_3d: as asked, else as the decoder's Conv3d weights are."""
    if channels_last is not None:
        return bool(channels_last)
    w = vae.decoder.conv_in.weight
    return w.is_contiguous(memory_format=torch.channels_last_3d) and not w.is_contiguous()


def packed_fp8(conv: nn.Module):
    """The conv's 8-bit K-major PackedWeight (per-output-channel scales): int8 where FP8 level 3 chose int8 for it
    (CONV8_INT8), else e4m3; packed once per weight version and format."""
    from vaeopt.kernels.conv import E4M3, pack_weight  # (imports Triton: only where a marked conv runs)

    w = conv.weight
    i8 = bool(getattr(conv, CONV8_INT8, False))
    key = (weight_version(w), i8)
    cached = getattr(conv, CONV8_PACKED, None)
    if cached is None or cached[0] != key:
        cached = (key, pack_weight(w.detach(), torch.int8 if i8 else E4M3))
        setattr(conv, CONV8_PACKED, cached)
    return cached[1]
