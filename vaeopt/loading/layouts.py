"""Key layouts -> diffusers keys: where the VAE sits in a full checkpoint, and the conversions of the original
LDM / A1111 / ComfyUI, Wan 2.1 / 2.2, TAESD, FLUX.2, LTX-2 and HunyuanVideo 1.5 names."""

from __future__ import annotations

import re

from torch import Tensor

from vaeopt.errors import CheckpointError
from vaeopt.families import family_names


_PREFIXES = ("first_stage_model.", "vae.", "autoencoder.", "model.", "module.")
TAESD_INDEX = re.compile(r"^\d+\.")


def _looks_vae(keys) -> bool:
    keys = list(keys)
    if any(k.startswith("decoder.") for k in keys):
        return True
    return bool(keys) and all(TAESD_INDEX.match(k) for k in keys) and "1.weight" in keys


def vae_prefix(keys: list[str]) -> str | None:
    """The prefix under which the VAE lives ('' for none); None if no VAE is visible."""
    if _looks_vae(keys):
        return ""
    if any(k.startswith("taesd_decoder.") for k in keys):  # ComfyUI-style combined TAESD
        return "taesd_"
    for p in _PREFIXES:
        sub = [k[len(p):] for k in keys if k.startswith(p)]
        if sub and _looks_vae(sub):
            return p
    return None


# key prefixes of the other parts of a diffusion model (original, ComfyUI and diffusers layouts)
_NOT_VAE = ("model.diffusion_model.", "diffusion_model.", "time_embedding.", "double_blocks.", "joint_blocks.",
            "transformer_blocks.", "cond_stage_model.", "conditioner.", "text_model.", "text_encoders.")


def unrecognised(label: str, keys, extra: str = "") -> CheckpointError:
    keys = list(keys)
    return CheckpointError(
        f"{label}: not a recognised VAE checkpoint: found {len(keys)} tensors, e.g. {', '.join(keys[:3])}{extra}; "
        f"recognised families: {', '.join(family_names())}"
    )


def no_vae_error(label: str, keys: list[str]) -> CheckpointError:
    enc = ("encoder.", "taesd_encoder.")
    if any(k.startswith(enc) or (k.startswith(_PREFIXES) and k.split(".", 1)[1].startswith(enc)) for k in keys) or (
        keys and all(TAESD_INDEX.match(k) for k in keys) and "0.weight" in keys
    ):
        return CheckpointError(f"{label}: encoder weights only (no decoder): nothing to decode with")
    other = next((k for k in keys if k.startswith(_NOT_VAE)), None)
    if other is not None:
        return CheckpointError(
            f"{label}: this checkpoint has no VAE weights (a UNet/text-encoder checkpoint? {len(keys)} tensors, e.g. "
            f"{other}; none under first_stage_model./vae./decoder.) — pass the VAE file with --model"
        )
    return unrecognised(label, keys)


_WAN_RES = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
            "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
            "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_WAN_TOP = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
            "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias"}


def convert_wan22_original(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Original Wan 2.2 (vae2_2.py) keys, nested `decoder.upsamples.{b}.upsamples.{j}`, -> AutoencoderKLWan
    (is_residual=True). diffusers' convert_wan_vae_to_diffusers only knows the flat Wan 2.1 layout."""
    out = {}
    nested = re.compile(r"^(encoder|decoder)\.(downsamples|upsamples)\.(\d+)\.(downsamples|upsamples)\.(\d+)\.(.+)$")
    for k, v in sd.items():
        new = None
        if k in _WAN_TOP:
            new = _WAN_TOP[k]
        elif m := re.match(r"^(encoder|decoder)\.conv1\.(weight|bias)$", k):
            new = f"{m[1]}.conv_in.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.head\.(0\.gamma|2\.weight|2\.bias)$", k):
            head = {"0.gamma": "norm_out.gamma", "2.weight": "conv_out.weight", "2.bias": "conv_out.bias"}
            new = f"{m[1]}.{head[m[2]]}"
        elif m := re.match(r"^(encoder|decoder)\.middle\.([02])\.(.+)$", k):
            if m[3] in _WAN_RES:
                new = f"{m[1]}.mid_block.resnets.{int(m[2]) // 2}.{_WAN_RES[m[3]]}"
        elif m := re.match(r"^(encoder|decoder)\.middle\.1\.(.+)$", k):
            new = f"{m[1]}.mid_block.attentions.0.{m[2]}"
        elif m := nested.match(k):
            part, b, rest = m[1], m[3], m[6]
            blocks = "down_blocks" if part == "encoder" else "up_blocks"
            sampler = "downsampler" if part == "encoder" else "upsampler"
            if rest in _WAN_RES:
                new = f"{part}.{blocks}.{b}.resnets.{m[5]}.{_WAN_RES[rest]}"
            elif rest.startswith(("resample.", "time_conv.")):
                new = f"{part}.{blocks}.{b}.{sampler}.{rest}"
        out[new or k] = v  # unknown keys pass through unchanged and are reported by the strict load
    return out


_HY_CONV_WRAP = re.compile(r"^(.*\.(?:conv_in|conv_out|conv1|conv2|nin_shortcut|conv))\.conv\.(weight|bias)$")
_HY_CONV_UNWRAP = re.compile(
    r"^((?:encoder|decoder)\..*(?:conv_in|conv_out|conv1|conv2|conv_shortcut|samplers\.0\.conv))\.(weight|bias)$"
)
_ATTN_LINEAR = re.compile(r"\.attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$")
_OLD_ATTN = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


def convert_ldm(sd: dict[str, Tensor], notes: list[str]) -> tuple[dict[str, Tensor], list[str]]:
    """LDM / A1111 / ComfyUI VAE keys -> diffusers keys, via diffusers' own converter. Returns the converted dict and
    the source keys the converter did not use (diffusers drops them silently)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    video = any(v.ndim == 5 for k, v in sd.items() if k.startswith("decoder."))
    if video:  # 3-D (HunyuanVideo, ComfyUI style): causal convs wrap an inner `.conv`
        unwrapped = {}
        for k, v in sd.items():
            m = _HY_CONV_WRAP.match(k)
            unwrapped[f"{m[1]}.{m[2]}" if m else k] = v
        sd = unwrapped

    def n_blocks(part: str, word: str) -> int:
        ids = {int(m[1]) for k in sd if (m := re.match(rf"^{part}\.{word}\.(\d+)\.", k))}
        return max(ids) + 1 if ids else 0

    cfg = {
        "down_block_types": ["DownEncoderBlock2D"] * n_blocks("encoder", "down"),
        "up_block_types": ["UpDecoderBlock2D"] * n_blocks("decoder", "up"),
    }
    out = convert_ldm_vae_checkpoint(sd, cfg)
    used = {v.data_ptr() for v in out.values()}
    unused = [k for k, v in sd.items() if v.data_ptr() not in used]
    if any(v.ndim > 2 for k, v in sd.items() if re.search(r"\.attn_1\.(q|k|v|proj_out)\.weight$", k)):
        notes.append("attention 1x1-conv weights reshaped to linear")
    if video:
        out = {(f"{m[1]}.conv.{m[2]}" if (m := _HY_CONV_UNWRAP.match(k)) else k): v for k, v in out.items()}
    return out, unused


def fix_attention(sd: dict[str, Tensor], notes: list[str]) -> dict[str, Tensor]:
    """Old diffusers attention names (query/key/value/proj_attn) and conv-shaped attention weights -> linear."""
    from diffusers.loaders.single_file_utils import conv_attn_to_linear

    if any(o in k for k in sd for o in _OLD_ATTN):
        sd = dict(sd)
        conv_attn_to_linear(sd)
        renamed = {}
        for k, v in sd.items():
            for old, new in _OLD_ATTN.items():
                k = k.replace(old, new)
            renamed[k] = v
        sd = renamed
        notes.append("old attention names (query/key/value/proj_attn) renamed to to_q/to_k/to_v/to_out.0")
    squeezed = False
    for k in list(sd):
        v = sd[k]
        if _ATTN_LINEAR.search(k) and v.ndim > 2 and all(s == 1 for s in v.shape[2:]):
            sd[k] = v.reshape(v.shape[0], v.shape[1])
            squeezed = True
    if squeezed and "attention 1x1-conv weights reshaped to linear" not in notes:
        notes.append("attention 1x1-conv weights reshaped to linear")
    return sd


def convert_taesd_original(sd: dict[str, Tensor], part: str) -> dict[str, Tensor]:
    """Original TAESD (madebyollin) Sequential-index keys -> AutoencoderTiny keys. The original decoder starts with a
    parameter-free Clamp layer, which diffusers does in forward(), so decoder indices shift by one."""
    out = {}
    for k, v in sd.items():
        i, rest = k.split(".", 1)
        idx = int(i) - 1 if part == "decoder" else int(i)
        out[f"{part}.layers.{idx}.{rest}"] = v
    return out


def refuse_unbuildable_taesd(sd: dict[str, Tensor], label: str) -> None:
    """TAESD-family decoders that AutoencoderTiny cannot build (original Sequential-index keys; the pooled kind also
    under diffusers' decoder.layers.N names): say which and why, instead of a list of keys that do not fit."""
    pooled = sorted(k for k in sd if re.match(r"^(?:decoder\.layers\.)?\d+\.pool\.", k))
    if pooled:  # taef2_decoder.pth (Sequential indices), or taef2.safetensors (diffusers' decoder.layers.N names)
        blocks = {k.rsplit(".pool.", 1)[0] for k in pooled}
        raise CheckpointError(
            f"{label}: a TAESD-family decoder with GroupNorm pooling blocks (TAEF2, for FLUX.2; {len(blocks)} blocks "
            f"have a .pool branch, e.g. {min(blocks)}.pool.*): diffusers' AutoencoderTiny has no such layers, so "
            "vaeopt cannot run it; the file itself looks fine"
        )
    convs = sorted((int(k.split(".", 1)[0]), v.shape) for k, v in sd.items()
                   if re.fullmatch(r"\d+\.weight", k) and v.ndim == 4)
    if len(convs) < 3 or all(shape[0] == shape[1] for _, shape in convs[1:-1]):
        return
    widths = [int(convs[0][1][0])]  # the first conv, then the conv after each upsample
    for _, shape in convs[1:-1]:
        if int(shape[0]) != widths[-1]:
            widths.append(int(shape[0]))
    name = "TAESana, for Sana's 32x DC-AE; " if len(convs) - 2 == 5 else ""  # 5 upsamples: upstream's F32Decoder
    raise CheckpointError(
        f"{label}: a TAESD-family decoder whose width changes between stages ({name}widths "
        f"{' -> '.join(map(str, widths))}): diffusers' AutoencoderTiny keeps one width throughout, so vaeopt cannot "
        "run it; the file itself looks fine"
    )


# FLUX.2's original ae.safetensors (BFL) keeps the quant convs inside the encoder/decoder; diffusers'
# scripts/convert_flux2_to_diffusers.py (DIFFUSERS_VAE_TO_FLUX2_MAPPING) moves them to the top level, the rest is LDM.
_FLUX2_ORIGINAL = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}
# LTX-2's original per-channel statistics (diffusers' convert_ltx2_vae_to_diffusers: mean-of-means and std-of-means
# become the latents_mean / latents_std buffers; `channel` and mean-of-stds are dropped)
_LTX2_STATS = {"per_channel_statistics.mean-of-means": "latents_mean",
               "per_channel_statistics.std-of-means": "latents_std"}


def take_latent_stats(sd: dict[str, Tensor], notes: list[str]) -> tuple[dict[str, Tensor], dict]:
    """Per-checkpoint latent statistics out of the state dict: FLUX.2's BatchNorm (`bn.running_mean/var`, which
    AutoencoderKL, the class vaeopt builds FLUX.2 as, has no place for), and LTX-2's latents_mean/std (kept in the
    state dict too: they are buffers of AutoencoderKLLTX2Video). FLUX.2's original quant-conv names are moved."""
    extra: dict = {}
    if "bn.running_mean" in sd or "bn.running_var" in sd:
        extra["bn"] = {k: sd[f"bn.{k}"].float() for k in ("running_mean", "running_var") if f"bn.{k}" in sd}
        sd = {k: v for k, v in sd.items() if not k.startswith("bn.")}
        moved = [k for k in sd if k.startswith(tuple(_FLUX2_ORIGINAL))]
        if moved:
            renamed = {}
            for k, v in sd.items():
                for old, new in _FLUX2_ORIGINAL.items():
                    if k.startswith(old):
                        k = new + k[len(old):]
                renamed[k] = v
            sd = renamed
            notes.append("original FLUX.2 layout (quant convs inside encoder/decoder) converted")
    if any(k.startswith("per_channel_statistics.") for k in sd):
        sd = {_LTX2_STATS.get(k, k): v for k, v in sd.items()
              if k in _LTX2_STATS or not k.startswith("per_channel_statistics.")}
    if "latents_mean" in sd and "latents_std" in sd:
        extra["latents_mean"], extra["latents_std"] = sd["latents_mean"].float(), sd["latents_std"].float()
    return sd, extra


# HunyuanVideo 1.5's original (Tencent) VAE keys -> AutoencoderKLHunyuanVideo15, after diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py (convert_hunyuan_video_15_vae_checkpoint_to_diffusers): a pure
# renaming; the attention's q/k/v/proj_out are 1x1x1 convs on both sides.
_HY15_RENAMES = [
    (re.compile(r"^(encoder|decoder)\.(down|up)\.(\d+)\.block\.(\d+)\."),
     lambda m: f"{m[1]}.{m[2]}_blocks.{m[3]}.resnets.{m[4]}."),
    (re.compile(r"^(encoder|decoder)\.(down|up)\.(\d+)\.(downsample|upsample)\."),
     lambda m: f"{m[1]}.{m[2]}_blocks.{m[3]}.{m[4]}rs.0."),
    (re.compile(r"^(encoder|decoder)\.mid\.block_([12])\."), lambda m: f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}."),
    (re.compile(r"^(encoder|decoder)\.mid\.attn_1\.(q|k|v)\."), lambda m: f"{m[1]}.mid_block.attentions.0.to_{m[2]}."),
    (re.compile(r"^(encoder|decoder)\.mid\.attn_1\."), lambda m: f"{m[1]}.mid_block.attentions.0."),
]


def convert_hy15_original(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for k, v in sd.items():
        for rx, fn in _HY15_RENAMES:
            if m := rx.match(k):
                k = fn(m) + k[m.end():]
                break
        out[k] = v
    return out
