"""Which family a checkpoint is: the weights where they can tell, else family=, the config, the file's metadata,
the other weights of a full checkpoint, the file name, then a documented default (docs/user-guide.md)."""

from __future__ import annotations

import re
from pathlib import Path

from vaeopt.errors import CheckpointError
from vaeopt.families import FamilySpec, family_names, get_family
from vaeopt.loading.shapes import Analysis


class Notice(str):
    """A loading note worth showing without -v (a guess the user may need to correct); `short` is its one-line
    form, the full text stays the note."""

    short: str

    def __new__(cls, text: str, short: str) -> "Notice":
        obj = super().__new__(cls, text)
        obj.short = short
        return obj

    def __reduce__(self):  # pickles (spawned ranks) as what it is, short form included
        return Notice, (str(self), self.short)


_NAME_HINTS = [  # (family, pattern) on the lower-cased file/dir name or metadata text; first match wins
    ("taesdxl", r"taesd[-_]?xl"),
    ("taesd", r"taesd"),
    ("wan22", r"wan[-_ ]?2[._]?2|ti2v"),
    ("wan21", r"wan[-_ ]?2[._]?1"),
    ("hunyuanvideo15", r"(hunyuan|hy)[-_ ]?video[-_ ]?1[._]?5|hunyuan[-_ ]?1[._]5"),
    ("hunyuanvideo", r"hunyuan|hyvideo"),
    ("ltx2", r"ltx"),
    ("qwenimage", r"qwen"),
    ("flux2", r"flux[-_ .]?2"),
    ("sd3", r"sd[-_ ]?3|stable[-_ ]?diffusion[-_ ]?3"),
    ("flux", r"flux|^ae\.(safetensors|sft)$"),
    ("sdxl", r"sdxl|sd[-_ ]xl|xl(?![a-z])"),
    ("sd2", r"sd[-_ ]?2|v2[-_]1|768-v|stable[-_ ]?diffusion[-_ ]?2"),
    ("sd15", r"sd[-_ ]?v?1(?!\d)|sd[-_ ]?1\.?5|v1[-_][45]|stable[-_ ]?diffusion[-_ ]?v?1"),
]
_KEY_HINTS = [  # other weights of a full checkpoint -> family
    ("sd3", ("model.diffusion_model.joint_blocks.",), "SD3 MMDiT weights"),
    ("flux", ("model.diffusion_model.double_blocks.", "double_blocks."), "FLUX transformer weights"),
    ("sdxl", ("conditioner.embedders.1.", "conditioner.embedders.0.model."), "SDXL text encoders"),
    ("sd2", ("cond_stage_model.model.",), "OpenCLIP text encoder (SD 2.x)"),
    ("sd15", ("cond_stage_model.transformer.",), "CLIP text encoder (SD 1.x)"),
]
_DEFAULTS = {"AutoencoderKLHunyuanVideo": "hunyuanvideo", "AutoencoderTiny": "taesd",
             "AutoencoderKLHunyuanVideo15": "hunyuanvideo15", "AutoencoderKLLTX2Video": "ltx2"}


def _name_hint(text: str) -> str | None:
    text = text.lower()
    for fam, pat in _NAME_HINTS:
        if re.search(pat, text):
            return fam
    return None


def _metadata_texts(metadata: dict | None, meta_cfg) -> list[str]:
    """The file's metadata strings and its config's _name_or_path: where a family's name may be written."""
    texts = [str(v) for k, v in (metadata or {}).items() if k != "config" and isinstance(v, str)]
    if isinstance(meta_cfg, dict) and meta_cfg.get("_name_or_path"):
        texts.append(str(meta_cfg["_name_or_path"]))
    return texts


def _compatible(spec: FamilySpec, a: Analysis) -> bool:
    if spec.cls_name != a.cls_name:
        return False
    return a.cls_name == "AutoencoderTiny" or spec.latent_channels == a.latent


def _structure(a: Analysis) -> str:
    if a.cls_name == "AutoencoderKLWan":
        return f"{a.cls_name} with z_dim {a.latent}"
    return f"{a.cls_name} with {a.latent} latent channels"


def _scaling_match(cfg: dict, a: Analysis) -> str | None:
    if not isinstance(cfg, dict) or cfg.get("scaling_factor") is None or a.cls_name == "AutoencoderTiny":
        return None
    if isinstance(cfg["scaling_factor"], bool) or not isinstance(cfg["scaling_factor"], int | float):
        return None  # not a number: build_spec refuses it with a clear message
    hits = []
    for name in family_names():
        spec = get_family(name)
        if _compatible(spec, a) and spec.config.get("scaling_factor") is not None:
            same_scale = abs(float(spec.config["scaling_factor"]) - float(cfg["scaling_factor"])) < 1e-6
            same_shift = abs(float(spec.config.get("shift_factor") or 0) - float(cfg.get("shift_factor") or 0)) < 1e-6
            if same_scale and same_shift:
                hits.append(name)
    if len(hits) > 1 and cfg.get("sample_size") is not None:
        by_size = [h for h in hits if get_family(h).config.get("sample_size") == cfg.get("sample_size")]
        hits = by_size or hits
    return hits[0] if hits else None


def choose_family(a: Analysis, family, explicit, meta_cfg, metadata, other_keys, names, notes, label) -> FamilySpec:
    if family:
        spec = get_family(family)
        if not _compatible(spec, a):
            raise CheckpointError(
                f"{label}: family '{spec.name}' ({spec.cls_name}, {spec.latent_channels} latent channels) does not "
                f"match the checkpoint: its weights are an {_structure(a)}"
            )
        notes.append(f"family {spec.name} as requested")
        return spec
    if (spec := _choose_new_family(a, explicit, meta_cfg, metadata, names, notes)) is not None:
        return spec
    if a.cls_name == "AutoencoderKLWan":  # shapes decide
        name = "wan22" if a.is_residual or a.latent == 48 else "wan21"
        spec = get_family(name)
        why = f"{'residual up blocks, ' if a.is_residual else ''}z_dim {a.latent}"
        notes.append(f"family {name} from the weights ({why})")
        if spec.latent_channels != a.latent:
            notes.append(f"z_dim {a.latent} differs from {name}'s {spec.latent_channels}: latents_mean/std do not fit")
        return spec

    ignored = set()

    def accept(name: str | None, source: str, verb: str = "from") -> FamilySpec | None:
        if not name:
            return None
        spec = get_family(name)
        if _compatible(spec, a):
            notes.append(f"family {name} {verb} {source}")
            return spec
        if name not in ignored:
            ignored.add(name)
            notes.append(f"{source} suggests {name}, but the weights are an {_structure(a)}: ignored")
        return None

    for cfg, where in ((explicit, "the given config"), (meta_cfg, "the checkpoint's config")):
        if spec := accept(_scaling_match(cfg, a), f"{where} (scaling_factor {cfg and cfg.get('scaling_factor')})"):
            return spec
    for t in _metadata_texts(metadata, meta_cfg):
        if spec := accept(_name_hint(t), f"the file's metadata ('{t[:60]}')"):
            return spec
    for fam, prefixes, what in _KEY_HINTS:
        if any(k.startswith(prefixes) for k in other_keys):
            if spec := accept(fam, f"the checkpoint's other weights ({what})"):
                return spec
    for n in names:
        if n and (spec := accept(_name_hint(n), f"file name '{n}'", "guessed from")):
            return spec

    # Defaults.
    if a.cls_name == "AutoencoderKL":
        if a.latent == 4:
            notes.append(Notice(
                "family sd15 assumed: SD 1.x, SD 2.x and SDXL VAEs have identical shapes and nothing in the metadata "
                "or file name tells them apart (sd15's scaling_factor 0.18215 is also SD 2.x's); for an SDXL "
                "VAE pass family='sdxl' (--family sdxl)",
                "family sd15 assumed (SD 1.x/2.x and SDXL VAEs look alike): --family sdxl for an SDXL VAE"))
            return get_family("sd15")
        if a.latent == 16:
            notes.append(Notice(
                "family flux assumed: SD3 and FLUX VAEs have identical shapes (16 channels, no quant convs) and "
                "nothing in the metadata or file name tells them apart; for an SD3/3.5 VAE pass family='sd3' "
                "(--family sd3)",
                "family flux assumed (SD3 and FLUX VAEs look alike): --family sd3 for an SD3 VAE"))
            return get_family("flux")
    elif a.cls_name in _DEFAULTS:
        name = _DEFAULTS[a.cls_name]
        spec = get_family(name)
        if a.cls_name == "AutoencoderTiny":
            if a.latent == spec.latent_channels:
                notes.append(Notice(
                    "family taesd assumed: TAESD and TAESDXL have identical shapes; for TAESDXL pass family='taesdxl'",
                    "family taesd assumed (TAESD and TAESDXL look alike): --family taesdxl for TAESDXL"))
            else:
                notes.append(f"{a.latent}-channel tiny autoencoder (e.g. TAESD3/TAEF1): no family of its own, using "
                             f"taesd settings with latent_channels {a.latent}")
            return spec
        if _compatible(spec, a):
            notes.append(f"family {name} from the weights")
            return spec
    if explicit or (isinstance(meta_cfg, dict) and meta_cfg.get("scaling_factor") is not None):
        base = (("sd15" if "post_quant_conv.weight" in a.sd else "flux") if a.cls_name == "AutoencoderKL"
                else _DEFAULTS.get(a.cls_name, "sd15"))
        notes.append(f"{_structure(a)} matches no known family; using {base} as the base config (scaling from config)")
        return get_family(base)
    raise CheckpointError(
        f"{label}: not a recognised VAE checkpoint: an {_structure(a)} matches no known family; pass family= and "
        f"config= (recognised families: {', '.join(family_names())})"
    )


def _choose_new_family(a: Analysis, explicit, meta_cfg, metadata, names, notes) -> FamilySpec | None:
    """FLUX.2 (an AutoencoderKL with 32 latent channels: no other AutoencoderKL family has them) and Qwen-Image (Wan
    2.1's shapes, named by its config class, the file's metadata or its name); None: the other families' rules."""
    if a.cls_name in ("AutoencoderKLHunyuanVideo15", "AutoencoderKLLTX2Video"):  # one family per class
        name = _DEFAULTS[a.cls_name]
        notes.append(f"family {name} from the weights ({a.cls_name})")
        return get_family(name)
    if a.cls_name == "AutoencoderKL" and a.latent == 32:
        why = "BatchNorm latent statistics" if a.extra.get("bn") else "no BatchNorm statistics in the weights"
        notes.append(f"family flux2 from the weights (32 latent channels, {why})")
        return get_family("flux2")
    if a.cls_name != "AutoencoderKLWan" or a.is_residual or a.latent != 16:
        return None
    for cfg, where in ((explicit, "the given config"), (meta_cfg, "the checkpoint's config")):
        if isinstance(cfg, dict) and cfg.get("_family") == "qwenimage":
            notes.append(f"family qwenimage from {where} (AutoencoderKLQwenImage)")
            return get_family("qwenimage")
    texts = [(t, f"the file's metadata ('{t[:60]}')") for t in _metadata_texts(metadata, meta_cfg)]
    for t, where in texts + [(n, f"file name '{n}'") for n in names if n]:
        if _name_hint(t) == "qwenimage":
            notes.append(f"family qwenimage from {where}")
            return get_family("qwenimage")
    return None


def tiny_raw_latents(spec: FamilySpec, names: list[str], notes: list[str]) -> None:
    """Which big VAE's raw latents a 16-channel tiny decoder's input is scaled from (TAESD3: SD3's, TAEF1: FLUX's),
    as ComfyUI does: (raw - shift_factor) * scaling_factor. Only the file name tells the two apart; without a hint
    raw latents are refused for it (latents.to_raw), pipeline ("scaled") latents need no factor."""
    base = None
    for n in names:  # the file's own name first, then the folders around it
        text = Path(n).name.lower() if n else ""
        base = "sd3" if re.search(r"taesd[-_]?3|sd[-_ ]?3", text) else "flux" if re.search(r"taef1|flux", text) else None
        if base:
            break
    if base is None or spec.latent_channels != 16:
        spec.config["_raw_latents"] = None
        return
    spec.config["_raw_latents"] = {"vae": base}
    notes.append(f"raw latents (e.g. ComfyUI .latent) are scaled as {get_family(base).title}'s (file name) before this "
                 "tiny decoder")
