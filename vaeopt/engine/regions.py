"""Region geometry: which part of an activation a tile or band needs, and how far its halo reaches.

One idea serves every decoder: a tile (or a rank's band) of an output is exact when each conv sees its input
region widened by the conv's radius (the halo); a 2x upsample halves the halo it asks of its input. The image
tiler (vaeopt.tiling) widens every region by one conv's halo per pass; the Wan tiler (vaeopt.video_tiling) crops one
region per tile at the split, widened by the receptive field of everything after it; band-parallel decodes
(vaeopt.distributed) exchange each band's edge rows with the neighbour ranks instead of storing them.
Structures these rules cannot follow raise TilingError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vaeopt.engine.wan_ops import patch_size, wan_module
from vaeopt.errors import VaeoptError
from vaeopt.stages import unhooked


class TilingError(VaeoptError):
    """The model's decoder has a structure the exact tiler does not know how to stream."""


# -----------------------------------------------------------------------------------------------------------
# Image decoders: tiles, halo'd regions, a conv on a region


def pair(t: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(t, int):
        return int(t), int(t)
    th, tw = t
    return int(th), int(tw)


def tile_grid(h: int, w: int, th: int, tw: int) -> list[tuple[int, int, int, int]]:
    return [(y, min(y + th, h), x, min(x + tw, w)) for y in range(0, h, th) for x in range(0, w, tw)]


def halo_region(hw: tuple[int, int], y0: int, y1: int, x0: int, x1: int, hy: int, hx: int
                ) -> tuple[int, int, int, int]:
    """Rows [y0, y1) x cols [x0, x1) widened by the halo (hy, hx), clipped to the activation (hw)."""
    h, w = hw
    return max(y0 - hy, 0), min(y1 + hy, h), max(x0 - hx, 0), min(x1 + hx, w)


def tile_geometry(lat_hw: tuple[int, int], tile: tuple[int, int], scale: int, bands: bool) -> tuple[int, int]:
    """(rows, cols) of one tile at a layer running at `scale` x latent resolution."""
    h, w = lat_hw
    th, tw = tile
    if bands:
        rows = max(1, (th * min(tw, w)) // w)
        return min(rows, h) * scale, w * scale
    return min(th, h) * scale, min(tw, w) * scale


def is_plain_conv(m: nn.Module) -> bool:
    """A stock nn.Conv2d whose forward we may evaluate as F.conv2d(padding=0) on a halo'd tile."""
    return (
        isinstance(m, nn.Conv2d)
        and type(m).forward is nn.Conv2d.forward
        and unhooked(m)
        and m.padding_mode == "zeros"
        and tuple(m.stride) == (1, 1)
        and tuple(m.dilation) == (1, 1)
        and isinstance(m.padding, tuple)
        and tuple(m.padding) == (m.kernel_size[0] // 2, m.kernel_size[1] // 2)
        and m.kernel_size[0] % 2 == 1
        and m.kernel_size[1] % 2 == 1
    )


def conv_region(conv: nn.Module, x: torch.Tensor, oy: int, ox: int, h: int, w: int) -> torch.Tensor:
    """Apply a stride-1, padding-preserving conv to a region `x` of its input and return the (h, w) output tile that
    starts at (oy, ox) inside the region. The region holds the tile plus the conv's halo wherever the image goes on;
    where it stops at a true image border the conv's own zero padding supplies the border (no padded copy is made).

    A plain nn.Conv2d on a region with its full halo runs with padding=0 (no wasted ring); everything else runs with
    the module's own padding (the module itself is called if it is not a plain nn.Conv2d) and is cropped."""
    if is_plain_conv(conv):
        kh, kw = conv.kernel_size[0] // 2, conv.kernel_size[1] // 2
        if (oy, ox) == (kh, kw) and x.shape[-2] == h + 2 * kh and x.shape[-1] == w + 2 * kw:
            return F.conv2d(x, conv.weight, conv.bias, 1, 0, 1, conv.groups)
        y = F.conv2d(x, conv.weight, conv.bias, 1, conv.padding, 1, conv.groups)
    else:
        y = conv(x)
    if y.shape[-2:] != x.shape[-2:]:
        raise TilingError(f"{type(conv).__name__}: tiling needs stride-1 size-preserving convolutions")
    if y.shape[-2:] == (h, w):
        return y
    return y[..., oy : oy + h, ox : ox + w]


# ---------------------------------------------------------------------------------------------------------------
# Wan decoders: the receptive field of the tiled part, counted from the modules


def causal_radius(conv: nn.Module, where: str) -> int:
    """Spatial radius of a WanCausalConv3d (or a module with its attributes) with 'same' spatial zero padding."""
    k = tuple(getattr(conv, "kernel_size", ()))
    pad = getattr(conv, "_padding", None)
    if len(k) != 3 or pad is None or tuple(getattr(conv, "stride", (1, 1, 1))) != (1, 1, 1) \
            or tuple(getattr(conv, "dilation", (1, 1, 1))) != (1, 1, 1):
        raise TilingError(f"{where}: {type(conv).__name__} is not a stride-1 WanCausalConv3d")
    kh, kw = k[1], k[2]
    if kh % 2 == 0 or kw % 2 == 0 or pad[2] != (kh - 1) // 2 or pad[0] != (kw - 1) // 2:
        raise TilingError(f"{where}: spatial padding {pad[:4]} is not 'same' for kernel {k}")
    return max(kh, kw) // 2


def conv2d_radius(conv: nn.Module, where: str) -> int:
    if not isinstance(conv, nn.Conv2d) or conv.padding_mode != "zeros" or tuple(conv.stride) != (1, 1) \
            or tuple(conv.dilation) != (1, 1) or any(k % 2 == 0 for k in conv.kernel_size) \
            or tuple(conv.padding) != tuple((k - 1) // 2 for k in conv.kernel_size):
        raise TilingError(f"{where}: {type(conv).__name__} is not a stride-1 'same' zero-padded Conv2d")
    return max(conv.kernel_size) // 2


def check_pointwise_norm(norm: nn.Module, where: str) -> None:
    """RMS norms over channels only (per pixel): Wan's WanRMS_norm (channel_first) or the fused_norms stage's."""
    if type(norm).__name__ not in ("WanRMS_norm", "FusedRMSNormSiLU") or not getattr(norm, "channel_first", False):
        raise TilingError(f"{where}: {type(norm).__name__} is not a per-pixel (channel) RMS norm; a norm with "
                          "spatial statistics cannot be tiled with halos")


def check_pointwise_act(act: nn.Module, where: str) -> None:
    if not (isinstance(act, nn.Identity) or type(act).__module__ == nn.SiLU.__module__):
        raise TilingError(f"{where}: {type(act).__name__} is not an elementwise activation")


def resblock_radius(blk: nn.Module, where: str) -> list[tuple[str, int]]:
    wan = wan_module()
    if not isinstance(blk, wan.WanResidualBlock):
        raise TilingError(f"{where}: {type(blk).__name__} is not a WanResidualBlock")
    check_pointwise_norm(blk.norm1, where + ".norm1")
    check_pointwise_norm(blk.norm2, where + ".norm2")
    check_pointwise_act(blk.nonlinearity, where + ".nonlinearity")
    sc = blk.conv_shortcut
    if not isinstance(sc, nn.Identity) and causal_radius(sc, where + ".conv_shortcut") != 0:
        raise TilingError(f"{where}.conv_shortcut: only 1x1 spatial shortcuts are supported")
    return [("conv", causal_radius(blk.conv1, where + ".conv1")),
            ("conv", causal_radius(blk.conv2, where + ".conv2"))]


def resample_ops(rs: nn.Module, where: str) -> list[tuple[str, int]]:
    if rs.mode not in ("upsample2d", "upsample3d") or not isinstance(rs.resample, nn.Sequential) \
            or len(rs.resample) != 2:
        raise TilingError(f"{where}: WanResample mode {rs.mode!r} / layout is not a 2x upsample + conv")
    up, conv = rs.resample[0], rs.resample[1]
    if not (isinstance(up, nn.Upsample) and up.mode in ("nearest", "nearest-exact") and up.size is None):
        raise TilingError(f"{where}.resample.0: {type(up).__name__} is not a nearest upsample")
    sf = up.scale_factor if isinstance(up.scale_factor, (tuple, list)) else (up.scale_factor, up.scale_factor)
    if tuple(float(f) for f in sf) != (2.0, 2.0):
        raise TilingError(f"{where}.resample.0: scale {sf} is not 2x")
    ops = []
    if rs.mode == "upsample3d":
        ops.append(("conv", causal_radius(rs.time_conv, where + ".time_conv")))  # (3,1,1): radius 0
    return ops + [("up", 2), ("conv", conv2d_radius(conv, where + ".resample.1"))]


def upblock_ops(ub: nn.Module, where: str) -> list[tuple[str, int]]:
    wan = wan_module()
    ops: list[tuple[str, int]] = []
    for i, res in enumerate(ub.resnets):
        ops += resblock_radius(res, f"{where}.resnets.{i}")
    if isinstance(ub, wan.WanResidualUpBlock):
        rs = ub.upsampler
        if ub.avg_shortcut is not None and (rs is None or ub.avg_shortcut.factor_s != 2):
            raise TilingError(f"{where}.avg_shortcut: DupUp3D factor_s {ub.avg_shortcut.factor_s} does not match "
                              "the block's upsampler")  # the shortcut is a local pixel shuffle at the same scale
    elif isinstance(ub, wan.WanUpBlock):
        rs = ub.upsamplers[0] if ub.upsamplers is not None else None
    else:
        raise TilingError(f"{where}: {type(ub).__name__} is not a Wan up block")
    if rs is not None:
        ops += resample_ops(rs, f"{where}.upsampler")
    return ops


def tiled_ops(vae, split: int) -> list[tuple[str, int]]:
    """The spatial operations of the tiled part, in order: ("conv", radius) / ("up", 2)."""
    dec = vae.decoder
    ops: list[tuple[str, int]] = []
    for i in range(split, len(dec.up_blocks)):
        ops += upblock_ops(dec.up_blocks[i], f"decoder.up_blocks.{i}")
    check_pointwise_norm(dec.norm_out, "decoder.norm_out")
    check_pointwise_act(dec.nonlinearity, "decoder.nonlinearity")
    return ops + [("conv", causal_radius(dec.conv_out, "decoder.conv_out"))]


def receptive_field(vae, split: int) -> tuple[int, int]:
    """(halo, scale) of tiling up_blocks[split:] + head: the halo in pixels at the split's resolution (the input of
    up_blocks[split]) that makes the interior of a crop exact, and the factor from that resolution to the decoder's
    output. Counted backwards from the output: a conv adds its radius, a 2x upsample halves (rounding up)."""
    need, scale = 0, 1
    for kind, v in reversed(tiled_ops(vae, split)):
        if kind == "conv":
            need += v
        else:
            need, scale = -(-need // v), scale * v
    return need, scale


def front_scale(vae, split: int) -> int:
    """Resolution of the input of up_blocks[split] / latent resolution."""
    return math.prod(v for i in range(split) for k, v in upblock_ops(vae.decoder.up_blocks[i], f"up_blocks.{i}")
                     if k == "up")


def default_split(vae) -> int:
    """Tile only the last up block (the full-resolution one) and the head: the smallest halo (7 output rows for
    Wan 2.1). The planner also tries earlier splits when the front would not fit."""
    return len(vae.decoder.up_blocks) - 1


def min_tile_rows(vae, split: int) -> int:
    """Smallest tile side in latent pixels for `split`: the halo must not exceed the tile (beyond that a tile would
    spend more than 3x its interior's compute on halo rows)."""
    halo, _ = receptive_field(vae, split)
    return max(1, -(-halo // front_scale(vae, split)))


# ---------------------------------------------------------------------------------------------------------------
# Tile geometry


def resolve_tile(tile: int | Sequence[int], latent_hw: tuple[int, int]) -> tuple[int, int]:
    """(rows, cols) of one tile in latent pixels. An int is a square tile side turned into full-width row bands of
    the same area (as the image tiler's bands; at least one row); (rows, cols) is taken as is (cols >= width:
    bands). Clamped to the frame."""
    h, w = latent_hw
    if isinstance(tile, int):
        return max(1, min(h, (tile * tile) // w)), w
    th, tw = (int(t) for t in tile)
    return min(th, h), min(tw, w)


def band_tiles(latent_hw: tuple[int, int], n: int) -> tuple[int, int]:
    """Full-width bands that split h latent rows into n (the last may be shorter)."""
    h, w = latent_hw
    return -(-h // n), w


def spatial_factor(vae) -> int:
    """Output pixels per latent pixel: the decoder's 2x upsamplers, then Wan 2.2's unpatchify."""
    return front_scale(vae, len(vae.decoder.up_blocks)) * patch_size(vae)
