"""The entry points: detect a state dict's family and layout, build the diffusers model on the meta device and
assign the weights (decoder strict, encoder optional), load_vae / load_vae_from_state_dict."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vaeopt.errors import CheckpointError, VaeoptError
from vaeopt.families import FamilySpec, get_family, model_class
from vaeopt.hw import resolve_device, resolve_dtype
from vaeopt.loading.config import (alias_config, alias_new_class, build_spec, check_config_values,
                                   finish_new_family_spec, init_params, load_config_arg, meta_config, precheck_config)
from vaeopt.loading.family import choose_family, tiny_raw_latents
from vaeopt.loading.files import few, read_source, short_error
from vaeopt.loading.shapes import Analysis, analyse


@dataclass
class LoadedVAE:
    model: torch.nn.Module
    family: FamilySpec
    layout: str
    path: Path | None
    notes: list[str] = field(default_factory=list)
    dtype_on_disk: torch.dtype | None = None


@contextlib.contextmanager
def quiet_diffusers():
    """diffusers' logger at error level for the block: it warns about `.to(dtype)` on every model with fp32 modules
    (Wan), and vaeopt casts deliberately (the weights, and its meta-device skeletons for memory estimates)."""
    from diffusers.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(level)


def _detect(
    state_dict, *, filename="", metadata=None, family=None, config=None, other_keys=None, names=None, is_dir=False
) -> tuple[FamilySpec, Analysis, list[str]]:
    label = filename or "checkpoint"
    notes: list[str] = []
    if not state_dict:
        raise CheckpointError(f"{label}: not a checkpoint: it holds no tensors")
    a = analyse(state_dict, label, notes, len(other_keys or ()))
    if is_dir:
        a.layout = "diffusers-dir" if a.layout == "diffusers" else f"{a.layout} (directory)"
    explicit = alias_new_class(alias_config(load_config_arg(config), "the given config", notes), "the given config",
                               notes)
    meta_cfg = alias_new_class(alias_config(meta_config(metadata, notes), "the checkpoint's config", notes),
                               "the checkpoint's config", notes)
    precheck_config(explicit, "the given config", label)
    precheck_config(meta_cfg, "the checkpoint's config", label)
    if names is None:
        names = [Path(filename).name] if filename else []
    spec = choose_family(a, family, explicit, meta_cfg, metadata, other_keys or list(state_dict), names, notes, label)
    spec = build_spec(a, spec, meta_cfg, explicit, notes, label)
    finish_new_family_spec(spec, a, explicit, meta_cfg, notes, label)
    if a.cls_name == "AutoencoderTiny" and spec.latent_channels != 4:
        tiny_raw_latents(spec, names + [label], notes)
    return spec, a, notes


def detect(
    state_dict: dict[str, Tensor],
    *,
    filename: str = "",
    metadata: dict | None = None,
    family: str | None = None,
    config: dict | str | Path | None = None,
) -> tuple[FamilySpec, str, list[str]]:
    """Family (its config adjusted to the checkpoint's real widths), layout name and human notes for a state dict."""
    spec, a, notes = _detect(state_dict, filename=filename, metadata=metadata, family=family, config=config)
    return spec, a.layout, notes


def _dtype_on_disk(tensors: dict[str, Tensor], notes: list[str]) -> torch.dtype | None:
    count: dict[torch.dtype, int] = {}
    for v in tensors.values():
        if v.is_floating_point():
            count[v.dtype] = count.get(v.dtype, 0) + v.numel()
    if not count:
        return None
    main = max(count, key=count.get)
    if len(count) > 1:
        notes.append("mixed dtypes on disk: " + ", ".join(str(d).replace("torch.", "") for d in count))
    return main


def _all_finite(v: Tensor) -> bool:
    """No NaN or Inf in v. Its minimum and maximum in one pass (a NaN makes both NaN, an Inf shows in one): no bool
    tensor the size of each weight, as isfinite(v).all() makes; over SDXL's 84M fp32 weights on one CPU thread 0.05 s
    against 0.64 s, on every load of a checkpoint."""
    if v.numel() == 0:
        return True
    lo, hi = torch.aminmax(v if v.element_size() > 1 else v.float())  # (8-bit floats: no min/max kernels)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _no_init():
    """diffusers' own switch for building a model whose weights come from a file (its from_pretrained builds in it):
    torch.nn.init's functions skipped. On the meta device they change nothing, but still cost their Python calls
    (SDXL's VAE built in 0.05 s instead of 0.10-0.18 s on a CPU)."""
    try:
        from diffusers.models.modeling_utils import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _instantiate(spec: FamilySpec, label: str, meta: bool = False):
    params = init_params(spec.cls_name)
    kwargs = {k: v for k, v in spec.config.items() if k in params}
    cls = model_class(spec.cls_name)
    try:
        if meta:  # no memory, no init: every tensor is assigned from the checkpoint afterwards
            with torch.device("meta"), _no_init():
                return cls(**kwargs)
        return cls(**kwargs)
    except Exception as e:
        raise CheckpointError(f"{label}: cannot build {spec.cls_name} from the detected config "
                              f"({short_error(e)})") from None


def _load_into_model(spec: FamilySpec, a: Analysis, label: str, notes: list[str], dtype) -> torch.nn.Module:
    model = _instantiate(spec, label, meta=True)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sd = a.sd
    # (LTX-2's latents_mean/std buffers go with the decoder: the latent statistics its pipeline decodes with)
    is_dec = lambda k: k.startswith(("decoder.", "post_quant_conv.", "latents_"))  # noqa: E731

    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    mism = [k for k in sd if k in expected and tuple(sd[k].shape) != expected[k]]
    problems = []
    dec_missing = [k for k in missing if is_dec(k)]
    dec_unexpected = [k for k in unexpected if is_dec(k)] + list(a.unused_decoder)
    if dec_missing:
        problems.append(f"missing {len(dec_missing)} decoder tensors: {few(dec_missing)}")
    if dec_unexpected:
        problems.append(f"unexpected decoder tensors: {few(dec_unexpected)}")
    dec_mism = [k for k in mism if is_dec(k)]
    if dec_mism:
        problems.append(
            "shape mismatch: "
            + "; ".join(f"{k} {list(sd[k].shape)} vs expected {list(expected[k])}" for k in dec_mism[:3])
            + (f" (+{len(dec_mism) - 3} more)" if len(dec_mism) > 3 else "")
        )
    if problems:
        raise CheckpointError(
            f"{label}: decoder weights do not fit {spec.cls_name} ({spec.name}, layout {a.layout}): "
            + "; ".join(problems)
            + " — wrong family/config, or a damaged file"
        )

    enc_missing = [k for k in missing if not is_dec(k)]
    enc_bad = [k for k in unexpected if not is_dec(k)] + [k for k in mism if not is_dec(k)]
    if enc_bad:
        notes.append(f"encoder weights do not fit ({few(enc_bad)}): encoder left at init, decode only")
        enc_missing = [k for k in expected if not is_dec(k)]
    elif enc_missing and not a.has_encoder:
        notes.append("encoder weights absent: decode only")
    elif enc_missing:
        notes.append(
            f"encoder incomplete ({len(enc_missing)} tensors missing, e.g. {few(enc_missing, 2)}): decode only"
        )
    skip = set(enc_missing)
    load = {k: v.to(dtype=dtype).contiguous() for k, v in sd.items() if k in expected and k not in skip}
    if enc_missing:  # take those from a normally initialised model
        fresh = _instantiate(spec, label).state_dict()
        load.update({k: fresh[k].to(dtype) for k in enc_missing})
    model.load_state_dict(load, strict=True, assign=True)
    return model


def _to(model: torch.nn.Module, device, dtype) -> torch.nn.Module:
    # torch's own .to: diffusers' ModelMixin.to logs a warning about fp32 modules whenever a dtype is passed.
    return torch.nn.Module.to(model, device=device, dtype=dtype).eval().requires_grad_(False)


def load_vae(
    path: str | Path | None = None,
    *,
    family: str | None = None,
    config: str | Path | dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedVAE:
    """Load a VAE checkpoint (file or diffusers directory) into an eval-mode diffusers model on `device` in `dtype`
    (a torch.dtype, or "fp32" / "bf16" / "fp16" as Options takes). With path=None, builds the family's model with
    random weights (for benchmarks)."""
    # all checked before the checkpoint is read: torch's own errors (an int8 load_state_dict, device 'tpu', CUDA on a
    # CPU build) would come after seconds of reading, as tracebacks
    if not isinstance(dtype, (torch.dtype, str)) or (isinstance(dtype, str) and dtype.lower() == "auto"):
        raise VaeoptError(f"load_vae: dtype must be a torch.dtype or one of fp32, bf16, fp16, got {dtype!r}")
    dtype = resolve_dtype(dtype, torch.device("cpu"))  # torch.float32 / bfloat16 / float16 only
    if device is not None:  # (None: left where it is built, the CPU)
        if not isinstance(device, (str, torch.device)):
            raise VaeoptError(f"load_vae: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
        device = resolve_device(str(device))
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise VaeoptError(f"load_vae: path must be a checkpoint file or diffusers folder (a str or Path), got "
                          f"{type(path).__name__} {path!r:.60}")
    if path is None:
        if not family:
            raise CheckpointError("no checkpoint given: pass a path, or a family for a randomly initialised model")
        spec = get_family(family)
        explicit = load_config_arg(config)
        if explicit:
            spec = spec.with_config({k: v for k, v in explicit.items() if k in init_params(spec.cls_name)})
            check_config_values(spec.cls_name, spec.config, lambda k: "the given config", spec.name)
        model = _instantiate(spec, spec.name)
        model = _to(model, device, dtype)
        return LoadedVAE(model, spec, "random-init", None, ["no checkpoint: random weights"], None)

    path = Path(path)
    sibling = path.parent / "config.json"
    if (config is None and path.is_file() and path.name.startswith("diffusion_pytorch_model")
            and sibling.is_file()):
        # the weights file of a diffusers folder (an HF download's vae/): its settings are in the config beside it,
        # not in the file (scaling_factor, norm groups), so read them there, as loading the folder would
        config = sibling
        sibling_note = f"settings from {sibling} (the diffusers folder this weights file is in)"
    else:
        sibling_note = None
    src = read_source(path, select_vae=True)
    label = str(src.path)
    spec, a, notes = _detect(
        src.tensors,
        filename=label,
        metadata=src.metadata,
        family=family,
        config=config,
        other_keys=src.all_keys,
        names=src.hint_names,
        is_dir=src.is_dir,
    )
    if sibling_note:
        notes.insert(0, sibling_note)
    disk = _dtype_on_disk(a.sd, notes)
    bad = [k for k, v in a.sd.items() if k.startswith(("decoder.", "post_quant_conv.")) and v.is_floating_point()
           and not _all_finite(v)]
    if bad:  # the decode would be NaN and blamed on fp16 or the latents
        raise CheckpointError(f"{label}: {len(bad)} decoder weight tensor(s) hold NaN/Inf (e.g. {bad[0]}): a broken "
                              "checkpoint (a diverged training run, or a bad conversion)")
    model = _load_into_model(spec, a, label, notes, dtype)
    model = _to(model, device, dtype)
    if disk is not None:
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        notes.append(f"weights on disk: {name(disk)}, loaded as {name(dtype)}")
    return LoadedVAE(model, spec, a.layout, src.path, notes, disk)


def load_vae_from_state_dict(
    state_dict: dict[str, Tensor],
    *,
    family: str | None = None,
    metadata: dict | None = None,
    config: dict | None = None,
    label: str = "state dict",
    dtype: torch.dtype | None = None,
) -> LoadedVAE:
    """A LoadedVAE built from tensors already in memory (another program's loaded VAE, e.g. ComfyUI's
    `first_stage_model.state_dict()`), in any layout load_vae reads (LDM, original Wan 2.1 / 2.2, diffusers...).

    The model is built on the meta device and the tensors are assigned, not copied: where a tensor already has the
    wanted dtype and is contiguous, the model's parameter shares its memory (and device) with the caller's, so a VAE
    on the GPU is not held twice. dtype=None keeps the tensors' own dtype. family and config (e.g. the
    norm_num_groups that the weights cannot show) as load_vae takes them. Nothing is moved; no NaN scan (the
    caller's weights already decode in its own program)."""
    if not isinstance(state_dict, dict) or not all(isinstance(v, Tensor) for v in state_dict.values()):
        raise VaeoptError(f"{label}: expected a dict of name -> tensor, got {type(state_dict).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise VaeoptError(f"{label}: dtype must be a torch.dtype or None (keep the tensors' own), got {dtype!r}")
    spec, a, notes = _detect(state_dict, filename=label, metadata=metadata, family=family, config=config, names=[])
    disk = _dtype_on_disk(a.sd, notes)
    model = _load_into_model(spec, a, label, notes, dtype or disk or torch.float32)
    model.eval().requires_grad_(False)
    return LoadedVAE(model, spec, f"{a.layout} (state dict)", None, notes, disk)
