"""VAE families: their diffusers configs (shipped in configs/), latent geometry and latent scaling.

A family is what the rest of vaeopt needs to know about a checkpoint beyond its weights: which diffusers class
builds it, how many latent channels it takes, how much it upsamples, and how pipeline ("scaled") latents map to the
raw latents the decoder consumes.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vaeopt.errors import CheckpointError

if TYPE_CHECKING:  # torch is imported where tensors are made: the CLI checks a --family name before torch loads
    import torch

CONFIG_DIR = Path(__file__).parent / "configs"

# name -> (human name, aliases). Order matters for `vaeopt info` and error messages.
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sd15": ("Stable Diffusion 1.x", ("sd1", "sd1.5", "sd-1.5", "sd")),
    "sd2": ("Stable Diffusion 2.x", ("sd2.1", "sd-2")),
    "sdxl": ("Stable Diffusion XL", ("xl", "sd-xl")),
    "sd3": ("Stable Diffusion 3 / 3.5", ("sd3.5", "sd35")),
    "flux": ("FLUX.1", ("flux1", "flux.1")),
    "flux2": ("FLUX.2", ("flux.2", "flux-2")),
    "qwenimage": ("Qwen-Image", ("qwen", "qwen-image", "qwen_image")),
    "wan21": ("Wan 2.1", ("wan", "wan2.1", "wan-2.1")),
    "wan22": ("Wan 2.2 TI2V-5B", ("wan2.2", "wan-2.2")),
    "hunyuanvideo": ("HunyuanVideo", ("hunyuan", "hyvideo")),
    "hunyuanvideo15": ("HunyuanVideo 1.5", ("hunyuanvideo1.5", "hunyuan15", "hyvideo15")),
    "ltx2": ("LTX-2", ("ltx", "ltx-2", "ltxv2")),
    "taesd": ("TAESD (tiny SD / SD2 decoder)", ("tiny",)),
    "taesdxl": ("TAESDXL (tiny SDXL decoder)", ()),
}

VIDEO_CLASSES = {"AutoencoderKLWan", "AutoencoderKLHunyuanVideo", "AutoencoderKLHunyuanVideo15",
                 "AutoencoderKLLTX2Video"}
# video classes whose config names its compression ratios (spatial_compression_ratio / temporal_compression_ratio)
_RATIO_CLASSES = {"AutoencoderKLHunyuanVideo": (8, 4), "AutoencoderKLHunyuanVideo15": (16, 4),
                  "AutoencoderKLLTX2Video": (32, 8)}


@dataclass
class FamilySpec:
    name: str
    title: str
    config: dict = field(repr=False)

    @property
    def cls_name(self) -> str:
        return self.config["_class_name"]

    @property
    def is_video(self) -> bool:
        return self.cls_name in VIDEO_CLASSES

    @property
    def makes_images(self) -> bool:
        """An image model on a video VAE (Qwen-Image on Wan 2.1's): one-frame latents are pictures (PNG by default)."""
        return self.name == "qwenimage"

    @property
    def latent_channels(self) -> int:
        c = self.config
        return int(c.get("latent_channels") or c.get("z_dim") or 4)

    @property
    def spatial_factor(self) -> int:
        c = self.config
        if self.cls_name == "AutoencoderKLWan":
            return int(c.get("scale_factor_spatial", 8))
        if self.cls_name in _RATIO_CLASSES:
            return int(c.get("spatial_compression_ratio") or _RATIO_CLASSES[self.cls_name][0])
        if self.cls_name == "AutoencoderTiny":
            return int(c.get("upsampling_scaling_factor", 2)) ** (len(c.get("decoder_block_out_channels", [0] * 4)) - 1)
        return 2 ** (len(c.get("block_out_channels", [0] * 4)) - 1)

    @property
    def temporal_factor(self) -> int:
        c = self.config
        if self.cls_name == "AutoencoderKLWan":
            return int(c.get("scale_factor_temporal", 4))
        if self.cls_name in _RATIO_CLASSES:
            return int(c.get("temporal_compression_ratio") or _RATIO_CLASSES[self.cls_name][1])
        return 1

    def output_frames(self, latent_frames: int) -> int:
        """Causal video VAEs: the first latent frame gives 1 frame, each later one `temporal_factor`."""
        return 1 + (latent_frames - 1) * self.temporal_factor if self.is_video else latent_frames

    def describe_scaling(self) -> str:
        c = self.config
        if "_bn" in c:
            where = ("the checkpoint's" if c["_bn"].get("mean") is not None
                     else "default (0/1, no statistics in the weights)")
            return (f"BatchNorm latent normalization over 2x2 patches ({where} running mean/var, eps "
                    f"{c['_bn'].get('eps', 1e-4)})")
        if c.get("latents_mean") is not None and c.get("latents_std") is not None:
            return f"per-channel mean/std ({len(c['latents_mean'])} channels)"
        s = f"scaling_factor {c.get('scaling_factor', 1.0)}"
        if c.get("shift_factor"):
            s += f", shift_factor {c['shift_factor']}"
        return s

    def _mean_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-channel (dim 1) latents_mean / latents_std shaped for x (Wan, LTX-2), or None."""
        c = self.config
        if c.get("latents_mean") is None or c.get("latents_std") is None:
            return None
        import torch

        shape = [1, -1] + [1] * (x.ndim - 2)
        return (torch.tensor(c["latents_mean"], dtype=x.dtype).view(shape),
                torch.tensor(c["latents_std"], dtype=x.dtype).view(shape))

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """Pipeline ("scaled") latents -> raw decoder latents, exactly as diffusers' pipelines do before vae.decode."""
        c = self.config
        x = latents.float()
        if "_bn" in c:
            return bn_unscale(x, c)
        if (ms := self._mean_std(x)) is not None:
            mean, std = ms
            if c.get("scaling_factor"):  # LTX-2 (pipeline_ltx2.py _denormalize_latents)
                return x * std / float(c["scaling_factor"]) + mean
            return x * std + mean  # Wan pipelines: latents / (1/std) + mean
        x = x / float(c.get("scaling_factor") or 1.0)
        if c.get("shift_factor"):
            x = x + float(c["shift_factor"])
        return x

    def scale(self, raw: torch.Tensor) -> torch.Tensor:
        """Inverse of unscale: raw decoder latents -> pipeline latents."""
        c = self.config
        x = raw.float()
        if "_bn" in c:
            return bn_scale(x, c)
        if (ms := self._mean_std(x)) is not None:
            mean, std = ms
            if c.get("scaling_factor"):  # LTX-2 (pipeline_ltx2.py _normalize_latents)
                return (x - mean) * float(c["scaling_factor"]) / std
            return (x - mean) / std
        if c.get("shift_factor"):
            x = x - float(c["shift_factor"])
        return x * float(c.get("scaling_factor") or 1.0)

    def with_config(self, overrides: dict) -> "FamilySpec":
        cfg = copy.deepcopy(self.config)
        cfg.update(overrides)
        return FamilySpec(self.name, self.title, cfg)


def family_names() -> list[str]:
    return list(_FAMILIES)


def get_family(name: str) -> FamilySpec:
    key = name.strip().lower()
    for fam, (title, aliases) in _FAMILIES.items():
        if key == fam or key in aliases:
            cfg = json.loads((CONFIG_DIR / f"{fam}.json").read_text())
            return FamilySpec(fam, title, cfg)
    raise CheckpointError(f"unknown family '{name}'. Known: {', '.join(_FAMILIES)}")


def diffusers_missing(e: ImportError) -> CheckpointError:
    """The one-line error for a diffusers that does not import (missing, or broken by one of its dependencies)."""
    return CheckpointError(f"diffusers is not installed ({e}); vaeopt builds its models with it: pip install diffusers")


def model_class(cls_name: str):
    try:
        import diffusers
    except ImportError as e:  # what to install, not a traceback
        raise diffusers_missing(e) from e

    try:
        return getattr(diffusers, cls_name)
    except AttributeError as e:  # an older diffusers without e.g. AutoencoderKLWan
        raise CheckpointError(f"diffusers {diffusers.__version__} has no {cls_name}; upgrade diffusers") from e


def build_model(spec: FamilySpec, **overrides) -> torch.nn.Module:
    """Instantiate the family's diffusers model with random weights (for benchmarks/tests); config keys may be
    overridden (e.g. narrower widths for fast tests)."""
    cls = model_class(spec.cls_name)
    cfg = {k: v for k, v in spec.config.items() if not k.startswith("_")}
    cfg.update(overrides)
    return cls(**cfg).eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------------------------------
# FLUX.2's latent normalization (pipeline_flux2.py): the transformer works on 2x2-patchified latents (N, 4C, H/2, W/2),
# normalized per patchified channel by the VAE's BatchNorm running statistics; before vae.decode the pipeline does
# latents * sqrt(running_var + eps) + running_mean, then unpatchifies. config["_bn"] = {"mean", "var", "eps",
# "patch_size"}; mean/var None (a checkpoint without them, or random weights) read as diffusers' init: 0 and 1.
# ----------------------------------------------------------------------------------------------------------------------


def patchify(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, 4C, H/2, W/2), as Flux2Pipeline._patchify_latents."""
    n, c, h, w = x.shape
    return x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, c * 4, h // 2, w // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """(N, 4C, h, w) -> (N, C, 2h, 2w), as Flux2Pipeline._unpatchify_latents."""
    n, c4, h, w = x.shape
    return x.reshape(n, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, c4 // 4, h * 2, w * 2)


def bn_stats(c: dict, channels: int, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of FLUX.2's latent BatchNorm, each (1, channels, 1, 1): std = sqrt(running_var + eps); float32
    unless dtype says otherwise."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    bn = c["_bn"]
    mean = torch.tensor(bn["mean"], dtype=dtype) if bn.get("mean") is not None else torch.zeros(channels, dtype=dtype)
    var = torch.tensor(bn["var"], dtype=dtype) if bn.get("var") is not None else torch.ones(channels, dtype=dtype)
    if mean.numel() != channels or var.numel() != channels:
        raise CheckpointError(f"FLUX.2 latent statistics have {mean.numel()} channels, the patchified latents "
                              f"{channels}")
    return mean.view(1, -1, 1, 1), torch.sqrt(var.view(1, -1, 1, 1) + float(bn.get("eps", 1e-4)))


def bn_unscale(x: torch.Tensor, c: dict) -> torch.Tensor:
    """Normalized latents -> raw (N, C, H, W) decoder latents. Takes the pipeline's patchified (N, 4C, h, w) form or
    the same numbers unpatchified (N, C, H, W); both end unpatchified."""
    lc = int(c.get("latent_channels") or 32)
    patched = x.shape[1] == 4 * lc
    if not patched:
        x = patchify(x)
    mean, std = bn_stats(c, x.shape[1], x.dtype)
    return unpatchify(x * std + mean)


def bn_scale(x: torch.Tensor, c: dict) -> torch.Tensor:
    """Raw (N, C, H, W) latents -> normalized, unpatchified (N, C, H, W) (the inverse of bn_unscale); a patchified
    (N, 4C, h, w) input is normalized as it is."""
    if x.shape[1] == 4 * int(c.get("latent_channels") or 32):
        mean, std = bn_stats(c, x.shape[1], x.dtype)
        return (x - mean) / std
    p = patchify(x)
    mean, std = bn_stats(c, p.shape[1], x.dtype)
    return unpatchify((p - mean) / std)
