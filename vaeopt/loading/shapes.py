"""Structure from the weights: which diffusers class, its state dict in diffusers' names, and the widths and depths
read from the tensors' shapes (the config a checkpoint does not carry)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vaeopt.errors import CheckpointError
from vaeopt.loading.files import few
from vaeopt.loading.layouts import (TAESD_INDEX, convert_hy15_original, convert_ldm, convert_taesd_original,
                                    convert_wan22_original, fix_attention, no_vae_error, refuse_unbuildable_taesd,
                                    take_latent_stats, unrecognised, vae_prefix)


_VAE_ROOTS = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")


@dataclass
class Analysis:
    cls_name: str
    layout: str
    sd: dict[str, Tensor]
    inferred: dict
    latent: int
    has_encoder: bool
    notes: list[str]
    unused_decoder: list[str]
    is_residual: bool = False
    extra: dict = field(default_factory=dict)  # per-checkpoint latent statistics (FLUX.2's bn, LTX-2's mean/std)


def _idx(sd, pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return sorted({int(m[1]) for k in sd if (m := rx.match(k))})


def _up_blocks(sd, label, what: str) -> list[int]:
    """The decoder's up block numbers, 0..n-1, or an error naming the decoder (`what`: "Wan ", ...)."""
    ups = _idx(sd, r"^decoder\.up_blocks\.(\d+)\.")
    if not ups or ups != list(range(len(ups))):
        raise unrecognised(label, sd, f" ({what}decoder up blocks missing or not numbered 0..n-1)")
    return ups


def _shape(sd, key, label) -> torch.Size:
    if key not in sd:
        raise CheckpointError(f"{label}: VAE checkpoint is missing {key}")
    return sd[key].shape


def analyse(state_dict: dict[str, Tensor], label: str, notes: list[str], n_total: int = 0) -> Analysis:
    keys = list(state_dict)
    prefix = vae_prefix(keys)
    if prefix is None:
        raise no_vae_error(label, keys)

    # -- take the VAE part ---------------------------------------------------------------------------------------------
    if prefix == "taesd_":  # ComfyUI-style combined TAESD: taesd_decoder.N / taesd_encoder.N
        dec = {k[len("taesd_decoder."):]: v for k, v in state_dict.items() if k.startswith("taesd_decoder.")}
        enc = {k[len("taesd_encoder."):]: v for k, v in state_dict.items() if k.startswith("taesd_encoder.")}
        refuse_unbuildable_taesd(dec, label)
        sd = {**convert_taesd_original(dec, "decoder"), **convert_taesd_original(enc, "encoder")}
        return _finish(sd, "taesd-original+taesd_decoder", notes, [], label)
    sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    suffix = f"+{prefix.rstrip('.')}" if prefix else ""
    if prefix:
        others = max(n_total, len(state_dict)) - len(sub)
        extra = f" ({others} other tensors, e.g. UNet/text encoders, ignored)" if others else ""
        notes.append(f"VAE taken from under the '{prefix}' prefix: {len(sub)} tensors{extra}")

    if all(TAESD_INDEX.match(k) for k in sub):
        refuse_unbuildable_taesd(sub, label)
        return _finish(convert_taesd_original(sub, "decoder"), "taesd-original" + suffix, notes, [], label)

    sub, extra = take_latent_stats(sub, notes)  # FLUX.2's BatchNorm, LTX-2's per-channel statistics
    special = _analyse_video_families(sub, suffix, notes, label)  # HunyuanVideo 1.5, LTX-2
    if special is not None:
        special.extra.update(extra)
        return special

    dkeys = [k for k in sub if k.startswith("decoder.")]
    if any(k.startswith("decoder.layers.") for k in dkeys):
        refuse_unbuildable_taesd(sub, label)  # TAEF2 under diffusers' AutoencoderTiny names
        style = "diffusers"
    elif any(k.startswith(("decoder.middle.", "decoder.upsamples.", "decoder.head.")) for k in dkeys):
        style = "wan-original"
    elif any(k.startswith(("decoder.up.", "decoder.mid.")) for k in dkeys):
        style = "ldm"
    elif any(k.startswith(("decoder.up_blocks.", "decoder.mid_block.", "decoder.conv_in.")) for k in dkeys):
        style = "diffusers"
    else:
        raise unrecognised(label, state_dict)

    roots = _VAE_ROOTS + (("conv1.", "conv2.") if style == "wan-original" else ())
    dropped = [k for k in sub if not k.startswith(roots)]
    if dropped:
        sub = {k: v for k, v in sub.items() if k.startswith(roots)}
        ema = [k for k in dropped if k.startswith("model_ema.")]
        if any(re.match(r"model_ema\.(encoder|decoder|quant_conv|post_quant_conv)", k) for k in ema):
            # LDM's LitEma keeps a second copy of the VAE (names without dots), e.g. vae-ft-mse-840000-ema-pruned.ckpt
            notes.append(f"the checkpoint holds the VAE twice, plain and as an EMA copy (model_ema.*, {len(ema)} "
                         "tensors): the plain weights are used, the EMA copy is ignored")
            dropped = [k for k in dropped if not k.startswith("model_ema.")]
        if dropped:
            notes.append(f"ignored {len(dropped)} non-VAE tensors, e.g. {', '.join(dropped[:3])}")

    unused: list[str] = []
    if style == "ldm":
        sd, unused = convert_ldm(sub, notes)
    elif style == "wan-original":
        if any(re.match(r"^decoder\.upsamples\.\d+\.upsamples\.", k) for k in sub):
            sd = convert_wan22_original(sub)
            notes.append("original Wan 2.2 layout (nested upsamples) converted")
        else:
            from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

            sd = convert_wan_vae_to_diffusers(sub)
    else:
        sd = sub
    sd = fix_attention(sd, notes)
    a = _finish(sd, style + suffix, notes, [k for k in unused if k.startswith("decoder.")], label)
    a.extra.update(extra)
    return a


def _finish(sd: dict[str, Tensor], layout: str, notes: list[str], unused_dec: list[str], label: str) -> Analysis:
    has_encoder = any(k.startswith("encoder.") for k in sd)
    if "decoder.layers.0.weight" in sd:
        return _infer_tiny(sd, layout, notes, unused_dec, has_encoder, label)
    if any(k.startswith("decoder.") and (k.endswith(".gamma") or ".to_qkv." in k) for k in sd):
        return _infer_wan(sd, layout, notes, unused_dec, has_encoder, label)
    w = sd.get("decoder.conv_in.conv.weight")
    if w is not None and w.ndim == 5:
        return _infer_kl(sd, layout, notes, unused_dec, has_encoder, label, "AutoencoderKLHunyuanVideo")
    w = sd.get("decoder.conv_in.weight")
    if w is not None and w.ndim == 4:
        return _infer_kl(sd, layout, notes, unused_dec, has_encoder, label, "AutoencoderKL")
    raise unrecognised(label, sd, " (a decoder without conv_in)")


def _infer_kl(sd, layout, notes, unused_dec, has_encoder, label, cls_name) -> Analysis:
    c = ".conv" if cls_name == "AutoencoderKLHunyuanVideo" else ""
    ups = _up_blocks(sd, label, "")
    rev = [_shape(sd, f"decoder.up_blocks.{i}.resnets.0.conv2{c}.weight", label)[0] for i in ups]
    n_res = len(_idx(sd, r"^decoder\.up_blocks\.0\.resnets\.(\d+)\."))
    latent = _shape(sd, f"decoder.conv_in{c}.weight", label)[1]
    out_ch = _shape(sd, f"decoder.conv_out{c}.weight", label)[0]
    in_ch = sd["encoder.conv_in" + c + ".weight"].shape[1] if f"encoder.conv_in{c}.weight" in sd else out_ch
    n = len(ups)
    down_t = "HunyuanVideoDownBlock3D" if c else "DownEncoderBlock2D"
    up_t = "HunyuanVideoUpBlock3D" if c else "UpDecoderBlock2D"
    inferred = {
        "in_channels": int(in_ch),
        "out_channels": int(out_ch),
        "latent_channels": int(latent),
        "block_out_channels": [int(x) for x in reversed(rev)],
        "layers_per_block": max(n_res - 1, 1),
        "down_block_types": [down_t] * n,
        "up_block_types": [up_t] * n,
        "mid_block_add_attention": any(k.startswith("decoder.mid_block.attentions.") for k in sd),
    }
    if cls_name == "AutoencoderKL":
        post = "post_quant_conv.weight" in sd
        quant = "quant_conv.weight" in sd if has_encoder else post
        inferred["use_post_quant_conv"] = post
        inferred["use_quant_conv"] = quant
    return Analysis(cls_name, layout, sd, inferred, int(latent), has_encoder, notes, unused_dec)


def _infer_wan(sd, layout, notes, unused_dec, has_encoder, label) -> Analysis:
    ups = _up_blocks(sd, label, "Wan ")
    residual = any(re.match(r"^decoder\.up_blocks\.\d+\.upsampler\.", k) for k in sd)
    z = int(_shape(sd, "decoder.conv_in.weight", label)[1])
    dec_base = int(_shape(sd, "decoder.conv_out.weight", label)[1])
    out_ch = int(_shape(sd, "decoder.conv_out.weight", label)[0])
    outs = [int(_shape(sd, f"decoder.up_blocks.{i}.resnets.0.conv2.weight", label)[0]) for i in ups]
    if any(o % dec_base for o in outs):
        raise CheckpointError(f"{label}: Wan decoder widths {outs} are not multiples of {dec_base}; pass config")
    dim_mult = [o // dec_base for o in reversed(outs)]
    n_res = len(_idx(sd, r"^decoder\.up_blocks\.0\.resnets\.(\d+)\.")) - 1
    sampler = "upsampler" if residual else "upsamplers.0"
    t_up = [f"decoder.up_blocks.{i}.{sampler}.time_conv.weight" in sd for i in ups[:-1]]
    enc_w = sd.get("encoder.conv_in.weight")
    in_ch = int(enc_w.shape[1]) if enc_w is not None else out_ch
    patch = int(round((out_ch / 3) ** 0.5)) if out_ch % 3 == 0 else 1
    inferred = {
        "decoder_base_dim": dec_base,
        "z_dim": z,
        "dim_mult": dim_mult,
        "num_res_blocks": n_res,
        "temperal_downsample": list(reversed(t_up)),
        "is_residual": residual,
        "in_channels": in_ch,
        "out_channels": out_ch,
    }
    if enc_w is not None:
        inferred["base_dim"] = int(enc_w.shape[0])
    if patch > 1:
        inferred["patch_size"] = patch
        inferred["scale_factor_spatial"] = 2 ** (len(dim_mult) - 1) * patch
    return Analysis("AutoencoderKLWan", layout, sd, inferred, z, has_encoder, notes, unused_dec, residual)


def _tiny_layers(sd, part: str) -> list[tuple[str, torch.Size]]:
    """AutoencoderTiny `layers` in order: ("block", conv.4 shape) or ("conv", weight shape)."""
    items = []
    for i in _idx(sd, rf"^{part}\.layers\.(\d+)\."):
        if f"{part}.layers.{i}.conv.4.weight" in sd:
            items.append(("block", sd[f"{part}.layers.{i}.conv.4.weight"].shape))
        elif f"{part}.layers.{i}.weight" in sd:
            items.append(("conv", sd[f"{part}.layers.{i}.weight"].shape))
    return items


def _infer_tiny(sd, layout, notes, unused_dec, has_encoder, label) -> Analysis:
    items = _tiny_layers(sd, "decoder")
    if not items or items[0][0] != "conv" or items[-1][0] != "conv":
        raise unrecognised(label, sd, " (tiny decoder without first/last conv)")
    latent = int(items[0][1][1])
    chans, counts, cur, n = [], [], int(items[0][1][0]), 0
    for kind, shape in items[1:]:
        if kind == "block":
            cur, n = int(shape[0]), n + 1
        else:
            chans.append(cur)
            counts.append(n)
            n = 0
    inferred = {
        "latent_channels": latent,
        "out_channels": int(items[-1][1][0]),
        "decoder_block_out_channels": chans,
        "num_decoder_blocks": counts,
    }
    if has_encoder:
        eitems = _tiny_layers(sd, "encoder")
        if eitems and eitems[0][0] == "conv":
            inferred["in_channels"] = int(eitems[0][1][1])
            echans, ecounts = [], []
            for kind, shape in eitems[:-1]:
                if kind == "conv":
                    echans.append(int(shape[0]))
                    ecounts.append(0)
                else:
                    ecounts[-1] += 1
            inferred["encoder_block_out_channels"] = echans
            inferred["num_encoder_blocks"] = ecounts
    else:
        inferred["in_channels"] = inferred["out_channels"]
    return Analysis("AutoencoderTiny", layout, sd, inferred, latent, has_encoder, notes, unused_dec)


def _is_hy15(sd) -> bool:
    """Causal-conv wrappers (`.conv.weight`, 5-D) with RMS norms (`.gamma`): HunyuanVideo 1.5 (Wan has `.gamma` with
    plain conv names; HunyuanVideo 1 and LTX-2 have no `.gamma`)."""
    w = sd.get("decoder.conv_in.conv.weight")
    return w is not None and w.ndim == 5 and any(k.startswith("decoder.") and k.endswith(".gamma") for k in sd)


def _is_ltx2(sd) -> bool:
    """LTX-2: causal convs with parameter-free norms (no norm weights in its resnets, unlike HunyuanVideo's
    GroupNorms), or the original's `res_blocks` names."""
    w = sd.get("decoder.conv_in.conv.weight")
    if w is None or w.ndim != 5:
        return False
    if any(".res_blocks." in k for k in sd if k.startswith("decoder.")):
        return True
    return ("decoder.mid_block.resnets.0.conv1.conv.weight" in sd
            and not any(k.startswith("decoder.mid_block.resnets.0.norm") for k in sd))


def _analyse_video_families(sd: dict[str, Tensor], suffix: str, notes: list[str], label: str) -> Analysis | None:
    """HunyuanVideo 1.5 and LTX-2 (diffusers or original keys) -> their analysis; None for every other layout."""
    if _is_hy15(sd):
        original = any(re.match(r"^decoder\.(mid\.block_1|up\.\d+\.block)\.", k) for k in sd)
        if original:
            sd = convert_hy15_original(sd)
        keep = {k: v for k, v in sd.items() if k.startswith(("encoder.", "decoder."))}
        if len(keep) != len(sd):
            notes.append(f"ignored {len(sd) - len(keep)} non-VAE tensors, e.g. {few(k for k in sd if k not in keep)}")
        return _infer_hy15(keep, ("hunyuanvideo15-original" if original else "diffusers") + suffix, notes, label)
    if _is_ltx2(sd):
        original = any(".res_blocks." in k for k in sd)
        if original:
            from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers

            sd = convert_ltx2_vae_to_diffusers(dict(sd))  # (it pops from the dict it is given)
            # LTX-2.3's fourth up block (scripts/convert_ltx2_to_diffusers.py LTX_2_3_VIDEO_VAE_RENAME_DICT), which
            # the 2.0 renaming leaves alone
            sd = {re.sub(r"^decoder\.up_blocks\.7\.", "decoder.up_blocks.3.upsamplers.0.",
                         re.sub(r"^decoder\.up_blocks\.8\.", "decoder.up_blocks.3.", k)): v for k, v in sd.items()}
        keep = {k: v for k, v in sd.items() if k.startswith(("encoder.", "decoder.", "latents_"))}
        if len(keep) != len(sd):
            notes.append(f"ignored {len(sd) - len(keep)} non-VAE tensors, e.g. {few(k for k in sd if k not in keep)}")
        return _infer_ltx2(keep, ("ltx2-original" if original else "diffusers") + suffix, notes, label)
    return None


def _infer_hy15(sd, layout, notes, label) -> Analysis:
    ups = _up_blocks(sd, label, "HunyuanVideo 1.5 ")
    widths = [int(_shape(sd, f"decoder.up_blocks.{i}.resnets.0.conv2.conv.weight", label)[0]) for i in ups]
    n_res = len(_idx(sd, r"^decoder\.up_blocks\.0\.resnets\.(\d+)\."))
    latent = int(_shape(sd, "decoder.conv_in.conv.weight", label)[1])
    out_ch = int(_shape(sd, "decoder.conv_out.conv.weight", label)[0])
    enc = sd.get("encoder.conv_in.conv.weight")
    has_encoder = any(k.startswith("encoder.") for k in sd)
    inferred = {"in_channels": int(enc.shape[1]) if enc is not None else out_ch, "out_channels": out_ch,
                "latent_channels": latent, "block_out_channels": list(reversed(widths)),
                "layers_per_block": max(n_res - 1, 1)}
    return Analysis("AutoencoderKLHunyuanVideo15", layout, sd, inferred, latent, has_encoder, notes, [])


# LTX-2 decoders by their number of up blocks (scripts/convert_ltx2_to_diffusers.py get_ltx2_video_vae_config): 2.0's
# three, each upsampling by 2 in space and time with a residual; 2.3's (and 2.5's) four, with mixed factors
_LTX_UP = {
    3: {"upsample_type": ["spatiotemporal"] * 3, "upsample_residual": [True] * 3, "upsample_factor": [2, 2, 2],
        "decoder_spatio_temporal_scaling": [True] * 3, "decoder_inject_noise": [False] * 4},
    4: {"upsample_type": ["spatiotemporal", "spatiotemporal", "temporal", "spatial"],
        "upsample_residual": [False] * 4, "upsample_factor": [2, 2, 1, 2],
        "decoder_spatio_temporal_scaling": [True] * 4, "decoder_inject_noise": [False] * 5},
}
# the padding is not in the weights: each release's, where no config says otherwise
_LTX_PADDING = {3: "reflect", 4: "zeros"}


def _infer_ltx2(sd, layout, notes, label) -> Analysis:
    """LTX-2's decoder shape from its weights: the number of up blocks tells LTX-2.0 from LTX-2.3 (their upsampler
    kinds and factors), the shapes then give the widths and depths."""
    latent = int(_shape(sd, "decoder.conv_in.conv.weight", label)[1])
    out_ch = int(_shape(sd, "decoder.conv_out.conv.weight", label)[0])
    has_encoder = any(k.startswith("encoder.") for k in sd)
    ups = _idx(sd, r"^decoder\.up_blocks\.(\d+)\.")
    inferred: dict = {"latent_channels": latent}
    extra: dict = {}
    patch = int(round((out_ch / 3) ** 0.5))
    if patch * patch * 3 == out_ch:
        inferred["patch_size"] = patch
    if all(f"decoder.up_blocks.{i}.upsamplers.0.conv.conv.weight" in sd for i in ups) and len(ups) in _LTX_UP:
        shape = _LTX_UP[len(ups)]
        rev = [int(_shape(sd, f"decoder.up_blocks.{i}.resnets.0.conv2.conv.weight", label)[0]) * f
               for i, f in zip(ups, reversed(shape["upsample_factor"]))]
        n_mid = len(_idx(sd, r"^decoder\.mid_block\.resnets\.(\d+)\."))
        n_up = [len(_idx(sd, rf"^decoder\.up_blocks\.{i}\.resnets\.(\d+)\.")) for i in ups]
        inferred.update(shape)
        extra = {"ltx_padding": _LTX_PADDING[len(ups)]}
        inferred["decoder_block_out_channels"] = list(reversed(rev))
        inferred["decoder_layers_per_block"] = list(reversed([n_mid] + n_up))
    a = Analysis("AutoencoderKLLTX2Video", layout, sd, inferred, latent, has_encoder, notes, [])
    a.extra.update(extra)
    return a
