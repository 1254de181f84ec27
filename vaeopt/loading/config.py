"""The model config: the given config and the checkpoint's own (class aliases included), merged over the family's
settings with the widths from the weights; every value checked against the type the model class declares."""

from __future__ import annotations

import copy
import inspect
import json
import math

from vaeopt.errors import CheckpointError
from vaeopt.families import FamilySpec, get_family, model_class
from vaeopt.loading.files import expand_user, parse_json, short_error
from vaeopt.loading.shapes import Analysis


def init_params(cls_name: str) -> set[str]:
    return set(inspect.signature(model_class(cls_name).__init__).parameters) - {"self"}


def load_config_arg(config) -> dict | None:
    if config is None:
        return None
    if isinstance(config, dict):
        if not isinstance(config.get("_class_name", ""), str):
            raise CheckpointError(f"config: \"_class_name\" must be the name of a diffusers class, got "
                                  f"{config['_class_name']!r:.40}")
        return copy.deepcopy(config)
    p = expand_user(config, "--config")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CheckpointError(f"config file not found: the folder {p.resolve()} has no config.json")
        p = p / "config.json"
    if p.exists() and not p.is_file():  # a FIFO or a device: it exists, and reading it could block for ever
        raise CheckpointError(f"--config {p}: not a regular file (a FIFO, socket or device); give a config.json file")
    if not p.is_file():
        raise CheckpointError(f"config file not found: {p}")
    try:
        cfg = parse_json(p.read_text())
    except Exception as e:
        raise CheckpointError(f"{p}: config is not valid JSON ({short_error(e)})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{p}: config must be a JSON object")
    if not isinstance(cfg.get("_class_name", ""), str):
        raise CheckpointError(f"{p}: \"_class_name\" must be the name of a diffusers class, got "
                              f"{json.dumps(cfg['_class_name'])[:40]}")
    return cfg


def meta_config(metadata: dict | None, notes: list[str]) -> dict | None:
    raw = (metadata or {}).get("config")
    if raw is None:
        return None
    try:
        cfg = parse_json(raw) if isinstance(raw, str) else raw
    except Exception:
        notes.append("metadata 'config' is not valid JSON: ignored")
        return None
    if isinstance(cfg, dict) and not isinstance(cfg.get("_class_name", ""), str):
        notes.append("metadata 'config' names no class (its \"_class_name\" is not text): ignored")
        return None
    return cfg if isinstance(cfg, dict) else None


# original class names of configs shipped beside original weights -> the diffusers class that ports them
_CLASS_ALIASES = {"AutoencoderKLCausal3D": "AutoencoderKLHunyuanVideo"}


def alias_config(cfg: dict | None, where: str, notes: list[str]) -> dict | None:
    """HunyuanVideo's original vae/config.json (AutoencoderKLCausal3D) is read as diffusers' AutoencoderKLHunyuanVideo
    config: the same parameters (scaling_factor, widths, ...), except its *_block_types, which name the original's
    block classes and mean nothing to diffusers: dropped (the weights give the block types)."""
    if not isinstance(cfg, dict) or cfg.get("_class_name") not in _CLASS_ALIASES:
        return cfg
    orig = cfg["_class_name"]
    cfg = {k: v for k, v in cfg.items() if not k.endswith("_block_types")}
    cfg["_class_name"] = _CLASS_ALIASES[orig]
    notes.append(f"{where} is for {orig} (the original HunyuanVideo VAE): read as diffusers' {cfg['_class_name']}, "
                 "without its block type names")
    return cfg


# diffusers classes whose decoders vaeopt runs as another class's (module for module the same): the config of the
# first is read as the second's, and the family is remembered
_NEW_CLASS_ALIASES = {"AutoencoderKLQwenImage": ("AutoencoderKLWan", "qwenimage"),
                      "AutoencoderKLFlux2": ("AutoencoderKL", "flux2")}


def alias_new_class(cfg: dict | None, where: str, notes: list[str]) -> dict | None:
    """A Qwen-Image config (AutoencoderKLQwenImage) read as AutoencoderKLWan's (its decoder is Wan 2.1's;
    input_channels is Wan's in/out_channels), a FLUX.2 config (AutoencoderKLFlux2) as AutoencoderKL's (its
    encoder/decoder are AutoencoderKL's; batch_norm_eps kept for the latent normalization)."""
    if not isinstance(cfg, dict) or cfg.get("_class_name") not in _NEW_CLASS_ALIASES:
        return cfg
    orig = cfg["_class_name"]
    cls, fam = _NEW_CLASS_ALIASES[orig]
    cfg = dict(cfg)
    if orig == "AutoencoderKLQwenImage" and "input_channels" in cfg:
        cfg["in_channels"] = cfg["out_channels"] = cfg.pop("input_channels")
    if orig == "AutoencoderKLFlux2":
        if "batch_norm_eps" in cfg:
            cfg["_bn_eps"] = cfg.pop("batch_norm_eps")
        if cfg.get("decoder_block_out_channels") is None:
            cfg.pop("decoder_block_out_channels", None)
    cfg["_class_name"], cfg["_family"] = cls, fam
    notes.append(f"{where} is for {orig} ({get_family(fam).title}): its decoder is diffusers' {cls}'s, module for "
                 f"module, so it runs as one")
    return cfg


_GROUPS_HINT = ("give its group count (CLI: --config with a config.json holding \"norm_num_groups\"; Python: "
                "config={'norm_num_groups': N})")


def _norm_groups(cfg: dict, widths: list[int], source: str, notes: list[str]) -> None:
    g = cfg.get("norm_num_groups") or 32
    if (isinstance(g, bool) or not isinstance(g, int) or g < 1
            or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths)):
        return  # not a usable number: check_config_values says so, naming where it came from
    if source == "family default" and any(w % g for w in widths):
        g2 = max(d for d in range(1, g + 1) if all(w % d == 0 for w in widths))
        notes.append(
            f"norm_num_groups {g} (family default) does not divide the widths {widths}; using {g2} — a guess; "
            f"{_GROUPS_HINT} if the model was trained with another value"
        )
        cfg["norm_num_groups"] = g2
    elif source == "family default":
        notes.append(
            f"norm_num_groups {g} assumed (family default; group count cannot be read from the weights) — "
            f"{_GROUPS_HINT} if the model was trained with another value"
        )
    else:
        notes.append(f"norm_num_groups {g} from {source}")


def _describe(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def build_spec(a: Analysis, spec: FamilySpec, meta_cfg, explicit, notes, label) -> FamilySpec:
    params = init_params(a.cls_name)
    cfg = copy.deepcopy(spec.config)
    if meta_cfg:
        mc = meta_cfg.get("_class_name")
        if mc and mc != a.cls_name:
            notes.append(f"the checkpoint's config is for {mc}, but the weights are an {a.cls_name}: config ignored")
            meta_cfg = None
    meta_use = {k: v for k, v in (meta_cfg or {}).items() if k in params}
    cfg.update(meta_use)
    shaped = {}
    for k, v in a.inferred.items():
        if k not in params:
            continue
        if k in meta_use and _norm(meta_use[k]) != _norm(v):
            notes.append(f"the checkpoint's config says {k} {meta_use[k]}, the weights say {v}: using the weights")
        if _norm(spec.config.get(k)) != _norm(v) and k not in meta_use:
            shaped[k] = v
        cfg[k] = v
    if a.cls_name == "AutoencoderKLWan" and not a.has_encoder and "base_dim" not in meta_use:
        cfg["base_dim"] = cfg["decoder_base_dim"]  # the encoder is left at init anyway: keep it as small as the decoder
    if shaped:
        keys = [k for k in ("base_dim", "decoder_base_dim", "block_out_channels", "layers_per_block",
                            "latent_channels", "z_dim", "dim_mult", "num_res_blocks",
                            "decoder_block_out_channels", "num_decoder_blocks") if k in shaped]
        if keys:
            notes.append("widths inferred from shapes: " + _describe({k: shaped[k] for k in keys}))
    if "norm_num_groups" in params:
        if explicit and "norm_num_groups" in explicit:
            source = "the given config"
        elif "norm_num_groups" in meta_use:
            source = "the checkpoint's config metadata"
        else:
            source = "family default"
        standard = _norm(cfg.get("block_out_channels")) == _norm(spec.config.get("block_out_channels"))
        if source == "the checkpoint's config metadata" or (source == "family default" and not standard):
            # (a model with the family's own widths uses the family's group count: nothing worth a note)
            _norm_groups(cfg, list(cfg.get("block_out_channels", [])), source, notes)
    for k in ("scaling_factor", "shift_factor"):  # say where the factor in use came from
        if explicit and k in explicit:
            notes.append(f"{k} {explicit[k]} from the given config" + (
                f" (over {meta_use[k]} in the checkpoint's config metadata)" if k in meta_use else
                f" ({spec.name}'s default is {spec.config.get(k)})"))
        elif k in meta_use and _norm(meta_use[k]) != _norm(spec.config.get(k)):
            notes.append(f"{k} {meta_use[k]} from the checkpoint's config metadata ({spec.name}'s default is "
                         f"{spec.config.get(k)})")
    if explicit:
        xc = explicit.get("_class_name")
        if xc and xc != a.cls_name:
            raise CheckpointError(f"{label}: the given config is for {xc}, but the weights are an {a.cls_name}")
        use = {k: v for k, v in explicit.items() if k in params}
        unknown = [k for k in explicit if k not in params and not k.startswith("_")]
        if unknown:
            notes.append(f"ignored unknown config keys for {a.cls_name}: {', '.join(unknown[:5])}")
        for k, v in use.items():
            if k in a.inferred and _norm(a.inferred[k]) != _norm(v):
                notes.append(f"the given config sets {k} {v}, the weights suggest {a.inferred[k]}")
        cfg.update(use)
        if "norm_num_groups" in use:
            notes.append(f"norm_num_groups {use['norm_num_groups']} from the given config")
    if a.cls_name == "AutoencoderKL" and "post_quant_conv.weight" not in a.sd and _post_quant_expected(
            spec, meta_use, explicit):
        raise CheckpointError(
            f"{label}: the weights have no post_quant_conv, which {spec.title} VAEs have (a decoder-only export that "
            "dropped it?): the decode would be wrong. If this VAE really has none, pass a config with "
            '"use_post_quant_conv": false')
    for k in ("scaling_factor", "shift_factor"):  # what unscales "scaled" latents: usable numbers only
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                              or (k == "scaling_factor" and v <= 0)):
            raise CheckpointError(f"{label}: {k} {v!r} in the config is not a "
                                  f"{'positive ' if k == 'scaling_factor' else ''}finite number")
    check_config_values(a.cls_name, cfg, lambda k: "the given config" if explicit and k in explicit else (
        "the checkpoint's config" if k in meta_use else f"{spec.name}'s settings"), label)
    cfg["_class_name"] = a.cls_name
    return FamilySpec(spec.name, spec.title, cfg)


def finish_new_family_spec(spec: FamilySpec, a: Analysis, explicit, meta_cfg, notes: list[str], label: str
                            ) -> None:
    """The checkpoint's own latent statistics into its family config: FLUX.2's BatchNorm running mean/var (and eps,
    from the config where it says one), LTX-2's latents_mean/std. An LTX decoder with timestep conditioning is
    refused: its pipeline decodes with a timestep and noise (decode_timestep / decode_noise_scale) that the plain
    decode does not pass, and diffusers' decode without them fails."""
    if spec.name == "ltx2" and spec.config.get("timestep_conditioning"):
        raise CheckpointError(f"{label}: an LTX VAE with timestep conditioning (its decoder takes the pipeline's "
                              "decode_timestep and noise): vaeopt decodes LTX-2 VAEs without it only")
    if spec.name == "flux2":
        bn = a.extra.get("bn", {})
        eps = next((c["_bn_eps"] for c in (explicit, meta_cfg) if isinstance(c, dict) and "_bn_eps" in c),
                   spec.config["_bn"].get("eps", 1e-4))
        stats = {"eps": float(eps), "patch_size": [2, 2],
                 "mean": bn["running_mean"].tolist() if "running_mean" in bn else None,
                 "var": bn["running_var"].tolist() if "running_var" in bn else None}
        want = 4 * spec.latent_channels
        for k in ("mean", "var"):
            if stats[k] is not None and len(stats[k]) != want:
                raise CheckpointError(f"{label}: FLUX.2 BatchNorm running_{k} has {len(stats[k])} channels, the "
                                      f"2x2-patchified latents {want}")
        if stats["mean"] is None or stats["var"] is None:
            notes.append("no BatchNorm statistics (bn.running_mean/var) in the weights: pipeline (scaled) latents are "
                         "read with mean 0 and variance 1; pass raw latents (--latent-space raw) for an exact decode")
        spec.config["_bn"] = stats
    elif spec.name == "ltx2":
        if "latents_mean" in a.extra:
            spec.config["latents_mean"] = a.extra["latents_mean"].tolist()
            spec.config["latents_std"] = a.extra["latents_std"].tolist()
        key = "decoder_spatial_padding_mode"
        if "ltx_padding" in a.extra and not any(isinstance(c, dict) and key in c for c in (explicit, meta_cfg)):
            spec.config[key] = a.extra["ltx_padding"]


_MAX_CONFIG_INT = 65536  # no VAE setting (widths, channels, groups, blocks) comes near it; a width of 10**9 would be
# refused only after allocating (or failing to allocate) its weights


def _value_problem(param: inspect.Parameter, v) -> str | None:
    """None if v fits the type a model class's __init__ declares for this setting, else what it should be: a whole
    number >= 1 (0 where that is the default) for an int, a finite number for a float, true/false for a bool, text
    for a str, a list of those for a list or tuple. Settings of no such type are left to the class."""
    import typing

    def kind_ok(want, v, default) -> str | None:
        if want is bool:
            return None if isinstance(v, bool) else "true or false"
        if want is int:
            lo = 0 if default == 0 else 1
            ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= _MAX_CONFIG_INT
            return None if ok else f"a whole number from {lo} to {_MAX_CONFIG_INT}"
        if want is float:
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if param.name == "scaling_factor":  # latents are divided by it
                return None if ok and v > 0 else "a positive finite number"
            return None if ok else "a finite number"
        if want is str:
            return None if isinstance(v, str) else "text"
        return None

    ann = param.annotation
    if isinstance(ann, str) or ann is inspect.Parameter.empty:
        return None
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    origin = typing.get_origin(ann)
    if v is None and (type(None) in typing.get_args(ann) or param.default is None):  # `x: int = None`: unset
        return None
    if origin in (list, tuple) or (origin is not None and args and typing.get_origin(args[0]) in (list, tuple)):
        inner = args if origin in (list, tuple) else typing.get_args(args[0])
        inner = [a for a in inner if a is not Ellipsis][:1]
        if not isinstance(v, list | tuple) or len(v) > 1024:
            return "a list"
        why = next((w for x in v if (w := kind_ok(inner[0], x, None) if inner else None)), None)
        return f"a list of {why.replace('a ', '', 1)}s" if why else None
    if ann in (bool, int, float, str):
        return kind_ok(ann, v, param.default)
    if args and all(a in (bool, int, float, str) for a in args):  # e.g. float | None, int | None
        return kind_ok(args[0], v, param.default)
    return None


def check_config_values(cls_name: str, cfg: dict, source_of, label: str) -> None:
    """Every setting the model class takes, checked against the type its __init__ declares (_value_problem) before
    the model is built. Caught here, a bad value is an error naming the setting and where it came from; caught by
    torch, it was a crash at the first decode (norm_num_groups -4, true)."""
    sig = inspect.signature(model_class(cls_name).__init__).parameters
    for k, v in cfg.items():
        if k in sig and not k.startswith("_") and (why := _value_problem(sig[k], v)):
            raise CheckpointError(f"{label}: {k} {json.dumps(v)[:40]} in {source_of(k)} is not {why}")


_DETECT_CLASSES = ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLHunyuanVideo", "AutoencoderTiny",
                   "AutoencoderKLFlux2", "AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo15",
                   "AutoencoderKLLTX2Video")


def precheck_config(cfg: dict | None, source: str, label: str) -> None:
    """Before detection reads a config (scaling_factor, shift_factor, latent_channels decide families): a setting
    that fits no model class's declared type is refused now (the class is not known yet)."""
    if not cfg:
        return
    sigs = [inspect.signature(model_class(c).__init__).parameters for c in _DETECT_CLASSES]
    for k, v in cfg.items():
        if k.startswith("_"):
            continue
        problems = [_value_problem(sig[k], v) for sig in sigs if k in sig]
        if problems and all(problems):
            raise CheckpointError(f"{label}: {k} {json.dumps(v)[:40]} in {source} is not {problems[0]}")


def _post_quant_expected(spec: FamilySpec, meta_use: dict, explicit) -> bool:
    """Whether the config in use says the model has a post_quant_conv: the given config, else the checkpoint's
    metadata, else the family (SD 1.x/2.x/SDXL: yes, diffusers' default; SD3/FLUX: no)."""
    for cfg in (explicit or {}, meta_use, spec.config):
        if "use_post_quant_conv" in cfg:
            return cfg["use_post_quant_conv"] is not False
    return True


def _norm(v):
    if isinstance(v, tuple | list):
        return [_norm(x) for x in v]
    return v
