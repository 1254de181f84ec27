"""AutoencoderKL decoders (SD 1.x/2.x, SDXL, SD3, FLUX): the structure every decode configuration walks.

The whole decode (diffusers' own forward, patched by stages/fused_epilogues), the tiled decode (vaeopt.tiling) and
the band-parallel decode (vaeopt.distributed) read the decoder the same way: conv_in, the mid-block at latent
resolution, then up-blocks of ResnetBlock2D (norm1 -> conv1 -> norm2 -> conv2, plus a shortcut) and nearest-2x +
conv upsamplers, then the head (GroupNorm, SiLU, conv_out). `plan_passes` lists what follows the mid-block as
passes over full activations and rejects structures that the exact decoders cannot follow (TilingError). The tiled
and band-parallel decodes walk those passes with one loop (`walk`), each supplying its steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vaeopt.engine.regions import TilingError
from vaeopt.stages import unhooked
from vaeopt.stages.fused_epilogues import upsample_forward

@dataclass
class Pass:
    """One tiled pass over an activation. ``scale`` is the pass's output resolution / latent resolution."""

    kind: str  # "res1" | "res2" | "up" | "head"
    module: nn.Module
    cin: int
    cout: int
    scale: int
    name: str
    sc_cin: int = 0  # res2: channels of the residual input (shortcut conv input)


def kl_decoder(vae: nn.Module) -> nn.Module:
    dec = getattr(vae, "decoder", None)
    need = ("conv_in", "mid_block", "up_blocks", "conv_norm_out", "conv_act", "conv_out")
    if dec is None or not all(hasattr(dec, a) for a in need):
        raise TilingError(
            f"{type(vae).__name__}: exact tiling supports diffusers AutoencoderKL-style decoders "
            "(conv_in, mid_block, up_blocks, conv_norm_out, conv_act, conv_out)"
        )
    return dec


def check_norm(norm: nn.Module, where: str) -> None:
    if not all(hasattr(norm, a) for a in ("num_groups", "eps", "weight", "bias")):
        raise TilingError(f"{where}: {type(norm).__name__} is not a GroupNorm (needs num_groups/eps/weight/bias)")


def check_resnet(blk: nn.Module, where: str) -> None:
    need = ("norm1", "conv1", "norm2", "conv2", "nonlinearity")
    if not all(hasattr(blk, a) for a in need):
        raise TilingError(f"{where}: {type(blk).__name__} is not a ResnetBlock2D-like block")
    if getattr(blk, "upsample", None) is not None or getattr(blk, "downsample", None) is not None:
        raise TilingError(f"{where}: resnets with built-in up/downsampling are not supported")
    if getattr(blk, "time_emb_proj", None) is not None:
        raise TilingError(f"{where}: resnets with a time embedding are not supported")
    if getattr(blk, "time_embedding_norm", "default") not in ("default", "group"):
        raise TilingError(f"{where}: time_embedding_norm={blk.time_embedding_norm!r} is not supported")
    check_norm(blk.norm1, where + ".norm1")
    check_norm(blk.norm2, where + ".norm2")


def conv_channels(conv: nn.Module, fallback_in: int, fallback_out: int) -> tuple[int, int]:
    return int(getattr(conv, "in_channels", fallback_in)), int(getattr(conv, "out_channels", fallback_out))


def plan_passes(vae: nn.Module) -> list[Pass]:
    """The tiled passes of the decoder, in order (everything after the mid-block)."""
    dec = kl_decoder(vae)
    passes: list[Pass] = []
    scale = 1
    for bi, ub in enumerate(dec.up_blocks):
        if getattr(ub, "attentions", None) is not None or not hasattr(ub, "resnets"):
            raise TilingError(f"up_blocks.{bi}: {type(ub).__name__} is not supported (only UpDecoderBlock2D)")
        for ri, blk in enumerate(ub.resnets):
            where = f"up_blocks.{bi}.resnets.{ri}"
            check_resnet(blk, where)
            cin, mid = conv_channels(blk.conv1, blk.in_channels, blk.out_channels)
            _, cout = conv_channels(blk.conv2, mid, blk.out_channels)
            passes.append(Pass("res1", blk, cin, mid, scale, where + "[norm1/conv1]"))
            passes.append(Pass("res2", blk, mid, cout, scale, where + "[norm2/conv2]", sc_cin=cin))
        ups = getattr(ub, "upsamplers", None)
        if ups is not None:
            for ui, up in enumerate(ups):
                c = int(getattr(up, "channels", passes[-1].cout if passes else 0))
                cout = int(getattr(up, "out_channels", c))
                if getattr(up, "use_conv_transpose", False) or getattr(up, "norm", None) is not None:
                    raise TilingError(
                        f"up_blocks.{bi}.upsamplers.{ui}: only nearest-2x + conv upsamplers are supported"
                    )
                scale *= 2
                passes.append(Pass("up", up, c, cout, scale, f"up_blocks.{bi}.upsamplers.{ui}"))
    if type(dec.conv_norm_out).__name__ == "SpatialNorm":
        raise TilingError("decoders with SpatialNorm (norm_type='spatial') are not supported")
    check_norm(dec.conv_norm_out, "conv_norm_out")
    cin, cout = conv_channels(dec.conv_out, passes[-1].cout if passes else 0, 3)
    passes.append(Pass("head", dec, cin, cout, scale, "conv_norm_out/conv_out"))
    return passes


def is_plain_upsampler(up: nn.Module) -> bool:
    """Upsample2D doing interpolate(nearest, 2x) + conv, with its stock forward -- or with the forward that
    stages/fused_epilogues.py installs (same result for any tensor its resnet did not already upsample)."""
    try:
        from diffusers.models.upsampling import Upsample2D
    except Exception:  # pragma: no cover - diffusers always present in practice
        return False
    fwd = up.__dict__.get("forward")
    if fwd is not None:
        if getattr(fwd, "__func__", None) is not upsample_forward:
            return False
    return (
        isinstance(up, Upsample2D)
        and type(up).forward is Upsample2D.forward
        and unhooked(up)
        and getattr(up, "interpolate", False)
        and getattr(up, "use_conv", False)
        and not getattr(up, "use_conv_transpose", False)
        and getattr(up, "norm", None) is None
    )


def up_conv(up: nn.Module) -> nn.Module:
    return up.conv if getattr(up, "name", "conv") == "conv" else up.Conv2d_0


def walk(passes: list[Pass], steps, x):
    """The one walk of an AutoencoderKL decoder after its mid-block, for every decode configuration: each pass of
    `passes` (plan_passes) is handed to `steps` -- a tiled decode's tile loops over stored activations, a band
    decode's ops on this rank's band -- with the activation it reads: ``res1(i, ps, x)`` -> h1,
    ``res2(i, ps, x, h1)`` -> the block output (x is the residual), ``up(i, ps, x)``, and ``head(i, ps, x)``, whose
    result the walk returns. The walk holds only the activation objects: a step may let an input's tensor go
    (``x.t = None``) once it has read it."""
    h1 = None
    for i, ps in enumerate(passes):
        if ps.kind == "res1":
            h1 = steps.res1(i, ps, x)
        elif ps.kind == "res2":
            x, h1 = steps.res2(i, ps, x, h1), None
        elif ps.kind == "up":
            x = steps.up(i, ps, x)
        else:
            return steps.head(i, ps, x)  # (plan_passes ends with the head)
