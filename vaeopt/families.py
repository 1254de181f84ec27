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

import torch

from vaeopt.errors import CheckpointError

CONFIG_DIR = Path(__file__).parent / "configs"

# name -> (human name, aliases). Order matters for `vaeopt info` and error messages.
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sd15": ("Stable Diffusion 1.x", ("sd1", "sd1.5", "sd-1.5", "sd")),
    "sd2": ("Stable Diffusion 2.x", ("sd2.1", "sd-2")),
    "sdxl": ("Stable Diffusion XL", ("xl", "sd-xl")),
    "sd3": ("Stable Diffusion 3 / 3.5", ("sd3.5", "sd35")),
    "flux": ("FLUX.1", ("flux1", "flux.1")),
    "wan21": ("Wan 2.1", ("wan", "wan2.1", "wan-2.1")),
    "wan22": ("Wan 2.2 TI2V-5B", ("wan2.2", "wan-2.2")),
    "hunyuanvideo": ("HunyuanVideo", ("hunyuan", "hyvideo")),
    "taesd": ("TAESD (tiny SD / SD2 decoder)", ("tiny",)),
    "taesdxl": ("TAESDXL (tiny SDXL decoder)", ()),
}

VIDEO_CLASSES = {"AutoencoderKLWan", "AutoencoderKLHunyuanVideo"}


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
    def latent_channels(self) -> int:
        c = self.config
        return int(c.get("latent_channels") or c.get("z_dim") or 4)

    @property
    def spatial_factor(self) -> int:
        c = self.config
        if self.cls_name == "AutoencoderKLWan":
            return int(c.get("scale_factor_spatial", 8))
        if self.cls_name == "AutoencoderKLHunyuanVideo":
            return int(c.get("spatial_compression_ratio", 8))
        if self.cls_name == "AutoencoderTiny":
            return int(c.get("upsampling_scaling_factor", 2)) ** (len(c.get("decoder_block_out_channels", [0] * 4)) - 1)
        return 2 ** (len(c.get("block_out_channels", [0] * 4)) - 1)

    @property
    def temporal_factor(self) -> int:
        c = self.config
        if self.cls_name == "AutoencoderKLWan":
            return int(c.get("scale_factor_temporal", 4))
        if self.cls_name == "AutoencoderKLHunyuanVideo":
            return int(c.get("temporal_compression_ratio", 4))
        return 1

    def output_frames(self, latent_frames: int) -> int:
        """Causal video VAEs: the first latent frame gives 1 frame, each later one `temporal_factor`."""
        return 1 + (latent_frames - 1) * self.temporal_factor if self.is_video else latent_frames

    def describe_scaling(self) -> str:
        c = self.config
        if c.get("latents_mean") is not None and c.get("latents_std") is not None:
            return f"per-channel mean/std ({len(c['latents_mean'])} channels)"
        s = f"scaling_factor {c.get('scaling_factor', 1.0)}"
        if c.get("shift_factor"):
            s += f", shift_factor {c['shift_factor']}"
        return s

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """Pipeline ("scaled") latents -> raw decoder latents, exactly as diffusers' pipelines do before vae.decode."""
        c = self.config
        x = latents.float()
        if c.get("latents_mean") is not None and c.get("latents_std") is not None:
            # Wan pipelines: latents / (1/std) + mean, per channel (dim 1).
            shape = [1, -1] + [1] * (x.ndim - 2)
            mean = torch.tensor(c["latents_mean"], dtype=x.dtype).view(shape)
            std = torch.tensor(c["latents_std"], dtype=x.dtype).view(shape)
            return x * std + mean
        x = x / float(c.get("scaling_factor") or 1.0)
        if c.get("shift_factor"):
            x = x + float(c["shift_factor"])
        return x

    def scale(self, raw: torch.Tensor) -> torch.Tensor:
        """Inverse of unscale: raw decoder latents -> pipeline latents."""
        c = self.config
        x = raw.float()
        if c.get("latents_mean") is not None and c.get("latents_std") is not None:
            shape = [1, -1] + [1] * (x.ndim - 2)
            mean = torch.tensor(c["latents_mean"], dtype=x.dtype).view(shape)
            std = torch.tensor(c["latents_std"], dtype=x.dtype).view(shape)
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


def model_class(cls_name: str):
    try:
        import diffusers
    except ImportError as e:
        raise CheckpointError(f"diffusers is not installed ({e}); vaeopt builds its models with it: "
                              "pip install diffusers") from e

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
