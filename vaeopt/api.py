"""Python API that the CLI is built on: load_vae, decode, optimize, decode_files."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vaeopt import latents as lat
from vaeopt import outputs, planner, video, video_graphs, video_stream
from vaeopt.errors import DecodeError, LatentError, VaeoptError
from vaeopt.families import FamilySpec, get_family
from vaeopt.fidelity import count_nonfinite
from vaeopt.hw import DTYPE_NAMES, resolve_device, resolve_dtype
from vaeopt.loading import LoadedVAE, expand_user, load_vae, parse_json
from vaeopt.pipeline import DecodeStats, Options, Pipeline, compute_dtype
from vaeopt.stages import Hint, StageResult, foreign_hooked, free_derived, needs_autograd, refresh_weights, weights_epoch

USER_CONFIG = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "vaeopt" / "config.json"


def resolve_model(model: str | Path | None, latent_files: list[lat.LatentFile] | None = None) -> tuple[Path, str]:
    """Which checkpoint to use, and why: --model, the manifest beside the latents, $VAEOPT_MODEL, the user config.
    One run decodes with one model: latent files whose manifests name different models are refused."""
    if model:
        return Path(model), "--model"
    named = {str(f.manifest["model"]): f for f in latent_files or [] if f.manifest.get("model")}
    if len(named) > 1:
        pairs = "; ".join(f"{f.path.name} -> {m}" for m, f in list(named.items())[:3])
        raise VaeoptError(f"the latent files name different models in their {lat.MANIFEST} ({pairs}): one run decodes "
                          "with one model; decode them in separate runs, or pass --model")
    if named:
        return _existing(Path(next(iter(named))), f"{lat.MANIFEST} beside the latents")
    if os.environ.get("VAEOPT_MODEL"):
        return _existing(Path(os.environ["VAEOPT_MODEL"]), "$VAEOPT_MODEL")
    if USER_CONFIG.is_file():
        try:
            cfg = parse_json(USER_CONFIG.read_text())
        except ValueError as e:
            raise VaeoptError(f"{USER_CONFIG}: not valid JSON ({e})") from e
        except OSError as e:
            raise VaeoptError(f"{USER_CONFIG}: cannot read it ({e.strerror or e})") from e
        if not isinstance(cfg, dict) or not isinstance(cfg.get("model", ""), str):
            raise VaeoptError(f'{USER_CONFIG}: expected {{"model": "path/to/vae.safetensors"}}, got {json.dumps(cfg)[:80]}')
        if cfg.get("model"):  # a relative path is taken from the config's folder, as a vaeopt.json's is from its own
            model = expand_user(cfg["model"], f"{USER_CONFIG}: \"model\"")
            return _existing(USER_CONFIG.parent / model, str(USER_CONFIG))
    unlisted = next((f for f in latent_files or [] if f.manifest.get("unlisted_in")), None)
    if unlisted is not None:  # a manifest was found, but names other files (case, wildcards are not matched)
        m = unlisted.manifest
        raise VaeoptError(f"no VAE checkpoint given: {m['unlisted_in']} has no entry for {unlisted.path.name} (it "
                          f"lists {', '.join(m['listed'])}; names are matched exactly); add one, a top-level "
                          "\"model\", or pass --model")
    if USER_CONFIG.is_file():
        raise VaeoptError(f"no VAE checkpoint given: pass --model path/to/vae.safetensors, set VAEOPT_MODEL, or put "
                          f"\"model\" in {USER_CONFIG} (it has no \"model\" path)")
    raise VaeoptError(
        "no VAE checkpoint given: pass --model path/to/vae.safetensors, set VAEOPT_MODEL, "
        f"or write {{\"model\": \"...\"}} to {USER_CONFIG}"
    )


def manifest_family(latent_files: list[lat.LatentFile]) -> str | None:
    """The family the vaeopt.json beside the latents names for its model (taken where that manifest's model is the
    one decoding and no family is given), or None."""
    fams = {f.manifest["family"] for f in latent_files if f.manifest.get("family")}
    if len(fams) > 1:
        raise VaeoptError(f"the latent files' {lat.MANIFEST} name different families ({', '.join(sorted(fams))}) for "
                          "one model: pass --family")
    return next(iter(fams), None)


def _existing(path: Path, source: str) -> tuple[Path, str]:
    """A checkpoint path that did not come from --model, checked here so that the error names where it came from."""
    full = expand_user(path, f"the checkpoint named by {source}:")
    if not full.exists() and not full.is_symlink():
        raise VaeoptError(f"checkpoint not found: {path} (named by {source}; pass --model to use another)")
    return path, source


def decode(latents: torch.Tensor, vae: LoadedVAE | str | Path, *, latent_space: str = "scaled",
           options: Options | None = None, log: Callable[[str], None] | None = None,
           progress: Callable[[int, int], None] | None = None, on_device: bool = False) -> torch.Tensor:
    """Decode latents with the optimized pipeline. Returns float32 CPU images in [-1, 1]: (N,3,H,W) or (N,3,T,H,W).
    on_device=True: the same values, left where the decoder produced them (the GPU for image decodes), for a caller
    that converts them there (to uint8, to half) and copies fewer bytes to the host.
    A vaeopt.load_vae(...) result is optimized in place on its first decode, and later decodes of it reuse that
    pipeline (options=None, or the same options); other options need the checkpoint loaded again.
    progress(done, total): called after each tile of a tiled image decode (a whole one has no steps to report) and
    with the frames done after each chunk of a video decode (Wan)."""
    if vae is None:
        raise VaeoptError("vaeopt.decode(latents, vae) needs the VAE: a checkpoint path or vaeopt.load_vae(...)")
    if isinstance(vae, torch.nn.Module):
        raise VaeoptError(f"vaeopt.decode takes a checkpoint path or vaeopt.load_vae(...), not a "
                          f"{type(vae).__name__} module: for pipe.vae use vaeopt.optimize(pipe.vae), then "
                          "pipe.vae.decode(...)")
    if not isinstance(vae, (LoadedVAE, str, os.PathLike)):  # (pathlib's TypeError would name neither)
        raise VaeoptError(f"vaeopt.decode: vae must be a checkpoint path or vaeopt.load_vae(...), got "
                          f"{type(vae).__name__} {vae!r:.60}")
    _check_log(log, "vaeopt.decode")
    if not isinstance(latents, torch.Tensor):
        raise VaeoptError(f"latents must be a torch.Tensor, got {type(latents).__name__}")
    if latents.device.type == "meta":
        raise VaeoptError("latents are on the meta device: they have a shape but no values to decode")
    if options is not None and not isinstance(options, Options):
        raise VaeoptError(f"options must be vaeopt.Options(...), got {type(options).__name__} (e.g. "
                          "Options(dtype='bf16'))")
    loaded = vae if isinstance(vae, LoadedVAE) else load_vae(vae)
    pipe = _pipeline_for(loaded, options, log)
    entry = lat.LatentEntry("", latents)
    z = lat.to_raw(lat.validate(entry, loaded.family, Path("<tensor>")), loaded.family, latent_space)
    plan = pipe.plan(tuple(z.shape))
    pipe.log(f"plan {tuple(z.shape)}: {plan.reason}")  # as `vaeopt decode` logs each job's
    vg = pipe.setup_graphs(plan) if video_graphs.applies(pipe) else None  # per-chunk graphs (Wan)
    pipe.count_decode(tuple(z.shape), plan)  # images: graphs once this shape's calls have repaid a capture
    out, _ = pipe.decode(z, plan, progress=progress, to_host=not on_device)
    if vg is not None:
        video_graphs.report_to(pipe, vg)
    bad = _nonfinite(out)
    if bad:  # as the CLI does: NaN/Inf images are not a result
        raise DecodeError(f"{bad} ({NONFINITE_HINT})")
    # images as video: the decoder's own range (after the check: clamp turns Inf into 1); NCHW in memory, as
    # diffusers' output (the optimized image decoder ends channels-last, where `.view(...)` would raise)
    c = out.contiguous()  # one copy where the layout changes, none where it does not
    return c.clamp_(-1, 1) if c.data_ptr() != out.data_ptr() else out.clamp(-1, 1)


def _kwargs(group: tuple[Hint, ...]) -> str:
    return ", ".join(h.option if h.value is None else f"{h.option}={h.value}" if isinstance(h.value, (int, float))
                     else f"{h.option}={h.value!r}" for h in group)


def spell_options(group: tuple[Hint, ...]) -> str:
    """A hint as vaeopt.decode takes it: `vaeopt.Options(fp8='on')` (the spelling of vaeopt.decode's lines)."""
    return f"vaeopt.Options({_kwargs(group)})"


_OPTIMIZE_KWARGS = ("device", "dtype", "channels_last", "triton", "attention")  # vaeopt.optimize(vae, ...)


def spell_optimize(group: tuple[Hint, ...]) -> str:
    """A hint as vaeopt.optimize's caller can act on it: its keyword arguments where it takes them all
    (`triton='on'`), else vaeopt.decode with Options."""
    if all(h.option in _OPTIMIZE_KWARGS for h in group):
        return _kwargs(group)
    return f"vaeopt.decode(..., options=vaeopt.Options({_kwargs(group)}))"


# Options that change the model in place (weights' device and dtype, layouts, fused modules, e4m3 layers); the others
# (tiling, tile, chunk, VRAM budget, graphs, cuDNN autotuning) are decode-time choices a built pipeline can take.
_MODEL_OPTIONS = ("channels_last", "triton", "epilogues", "attention", "upsample_conv", "stack_conv3d", "conv_kernel",
                  "fp8", "gate_db")


def _model_key(o: Options) -> dict:
    o.validate()
    dev = resolve_device(o.device)
    return {"device": str(dev), "dtype": str(resolve_dtype(o.dtype, dev)).replace("torch.", ""),
            **{f: getattr(o, f) for f in _MODEL_OPTIONS}}


def _refuse_other(model: torch.nn.Module, who: str, key: dict) -> None:
    """The one mark that vaeopt.decode and vaeopt.optimize leave on a model they changed in place: a second call
    is accepted only from the same function with the same model-changing options."""
    done = getattr(model, "_vaeopt_optimized", None)
    if done is None or done == (who, key):
        return
    by, old = done
    diff = ", ".join(f"{k}={old.get(k)!r} -> {key.get(k)!r}" for k in key if old.get(k) != key.get(k))
    raise VaeoptError(f"this model was already optimized in place by {by}(...)" + (f" for other options ({diff})"
                      if by == who else f", not by {who}(...)") + "; load or build it again for this call")


def _pipeline_for(loaded: LoadedVAE, options: Options | None, log: Callable[[str], None] | None) -> Pipeline:
    """The pipeline of a load_vae(...) result: built once, in place on its model, and reused by later decodes (with no
    options, or options that change the model the same way), so that decoding twice neither stacks the stages'
    hooks nor redoes their work. Options that would change the model otherwise need the unmodified model, which the
    first pipeline changed in place (dtype, layout, fused modules): refused, rather than silently decoding with the
    first options' precision. So is a model that vaeopt.optimize changed."""
    pipe = getattr(loaded, "_vaeopt_pipeline", None)
    if pipe is None or options is not None:
        key = _model_key(options if options is not None else Options())
        _refuse_other(loaded.model, "vaeopt.decode", key)
    if pipe is None:
        pipe = Pipeline(loaded, dataclasses.replace(options) if options is not None else None, log=log,
                        spell=spell_options)
        loaded.model._vaeopt_optimized = ("vaeopt.decode", key)
        loaded._vaeopt_pipeline = pipe
        return pipe
    now = compute_dtype(loaded.model)
    if now is not None and now != pipe.dtype:  # e.g. loaded.model.half() between two decodes
        raise VaeoptError(f"the loaded VAE's weights are {str(now).replace('torch.', '')} now, but its first decode set "
                          f"it up for {str(pipe.dtype).replace('torch.', '')}: load the checkpoint again, with "
                          "options=vaeopt.Options(dtype=...) for another precision")
    if options is not None:
        pipe.opts = dataclasses.replace(options)  # its decode-time choices (tiling, chunk, budget...) take effect
    pipe.log = log  # (its lines spell the flags their hints name as Options fields)
    return pipe


# the diffusers classes optimize() was built and measured for, and the family whose stages each takes
_OPTIMIZE_FAMILIES = {"AutoencoderKL": "sdxl", "AutoencoderKLWan": "wan21", "AutoencoderKLHunyuanVideo": "hunyuanvideo",
                      "AutoencoderTiny": "taesd", "AutoencoderKLFlux2": "flux2", "AutoencoderKLQwenImage": "qwenimage",
                      "AutoencoderKLHunyuanVideo15": "hunyuanvideo15", "AutoencoderKLLTX2Video": "ltx2"}
_OPTIMIZE_CLASSES = tuple(_OPTIMIZE_FAMILIES)


def _check_log(log, who: str) -> None:
    """log is called with each line, long after the call began (a 5 would fail as "'int' object is not callable")."""
    if log is not None and not callable(log):
        raise VaeoptError(f"{who}: log must be a function taking one line (e.g. print, logging.getLogger(...).info) or "
                          f"None for silence, got {type(log).__name__} {log!r:.60}")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _dtype_name(dtype) -> str:
    """optimize's dtype as Options takes it ("auto", "fp32", "bf16", "fp16"); anything else is refused."""
    if isinstance(dtype, str):
        if dtype.lower() == "auto":
            return "auto"
        return DTYPE_NAMES[resolve_dtype(dtype, torch.device("cpu"))]
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise VaeoptError(f"vaeopt.optimize: dtype must be 'auto' (the model's own), 'fp32', 'bf16', 'fp16' or one of "
                      f"torch.float32 / bfloat16 / float16, got {dtype!r}")


def optimize(vae: torch.nn.Module, *, device: str | None = None, dtype: str = "auto", channels_last: str = "auto",
             triton: str = "auto", attention: str = "auto",
             log: Callable[[str], None] | None = _to_stderr) -> torch.nn.Module:
    """Optimize a diffusers VAE in place (e.g. ``pipe.vae``) and return it; ``vae.decode(...)`` keeps its signature
    and output structure. Each stage's line goes to ``log``: stderr by default (a script's stdout stays its own),
    ``log=None`` for silence, ``log=logging.getLogger(...).info`` to route it. Tiling/graphs are decode-time choices,
    so they are not applied here. dtype "auto" keeps the model's dtype ("fp32"/"bf16"/"fp16" or those torch dtypes
    cast it). The Triton kernels run where no gradient is needed (no_grad / inference_mode, as diffusers pipelines
    decode); with autograd on for the input or the weights the torch ops run, so gradients stay right. Add hooks and
    swap modules before calling it; a module compiled with torch.compile is optimized before compiling."""
    if isinstance(vae, LoadedVAE):
        raise VaeoptError("vaeopt.optimize takes a diffusers VAE module (e.g. pipe.vae): for a vaeopt.load_vae(...) "
                          "result use vaeopt.decode(latents, loaded), or optimize(loaded.model)")
    if isinstance(vae, torch.nn.Module) and hasattr(vae, "config") and not hasattr(vae, "decoder"):
        raise VaeoptError(f"vaeopt.optimize: {type(vae).__name__} is a diffusers model vaeopt does not support (it has "
                          f"no .decoder to optimize; supported: {', '.join(_OPTIMIZE_CLASSES)})")
    if not isinstance(vae, torch.nn.Module) or not hasattr(vae, "config") or not hasattr(vae, "decoder"):
        raise VaeoptError(f"vaeopt.optimize takes a diffusers VAE module (e.g. pipe.vae), got {type(vae).__name__}; "
                          "for a checkpoint file use vaeopt.decode(latents, path) or vaeopt.load_vae(path)")
    if isinstance(getattr(vae, "_orig_mod", None), torch.nn.Module):  # torch.compile(vae): an OptimizedModule
        raise VaeoptError("vaeopt.optimize: this VAE is already wrapped by torch.compile; optimize the module first, "
                          "then compile it: vae = vaeopt.optimize(vae); vae = torch.compile(vae)")
    if "decode" in vae.__dict__ and not isinstance(vae.__dict__["decode"], _Decode):
        raise VaeoptError("vaeopt.optimize: this VAE's decode is replaced on the instance (vae.decode = ..., e.g. "
                          "torch.compile(vae.decode)); optimize runs before that, and its own vae.decode would drop "
                          "yours: call optimize first, then wrap vae.decode")
    dtype = _dtype_name(dtype)  # a clear error before the model is touched
    _check_log(log, "vaeopt.optimize")
    wanted = dict(device=device, dtype=dtype, channels_last=channels_last, triton=triton, attention=attention)
    if getattr(vae, "_vaeopt_stood_down", None) is not None:  # (its changes are undone; redoing them is not safe)
        if log:
            log(f"! vaeopt stepped aside for this VAE ({vae._vaeopt_stood_down}): vae.decode is diffusers' own; for "
                "vaeopt's path, load or build the VAE again, move it where it decodes, then optimize it")
        return vae
    if getattr(vae, "_vaeopt_optimized", None) is not None:  # again would stack hooks and redo (or undo) its work
        _refuse_other(vae, "vaeopt.optimize", wanted)
        if log:
            log("already optimized by vaeopt with these options: nothing to do")
        return vae
    placed = _offloaded_parts(vae)
    if placed:
        if log:
            log(f"! vaeopt.optimize: left unchanged: {placed}. vaeopt moves and fuses the decoder's layers, which those "
                "hooks place one by one; optimize a VAE without them (pipe.enable_model_cpu_offload() is followed: "
                "the whole VAE moves to the GPU for its decode)")
        return vae
    cfg = dict(vae.config)
    cls = type(vae).__name__
    if cls not in _OPTIMIZE_CLASSES and log:
        log(f"! {cls} is not one of the VAE classes vaeopt was built and measured for ({', '.join(_OPTIMIZE_CLASSES)})"
            ": its stages are applied where its modules are diffusers' own; check its output against the stock "
            "model's")
    fam_name = _OPTIMIZE_FAMILIES.get(cls, "sdxl")
    base = get_family(fam_name)
    spec = FamilySpec(base.name, base.title, {"_class_name": cls, **cfg})
    first = next(vae.parameters(), None)
    home = first.device if first is not None else None
    explicit_device = device
    runs_on = _offload_device(vae)  # model CPU offload: decode runs where the hook moves the VAE, not where it is
    if runs_on is not None and runs_on.type != "cuda":
        if log:
            log(f"! model CPU offload to {runs_on}: vaeopt's stages are for CUDA GPUs and the CPU; set up for where the "
                "weights are")
        runs_on = None
    if device is None and home is not None:
        device = str(runs_on or home)
    if dtype == "auto" and first is not None:
        # keep the caller's precision: pipelines hand `vae.decode` latents in their own dtype (an fp16 pipeline's
        # latents into a bf16/fp32 VAE raise "Input type (Half) and bias type ... should be the same")
        dtype = DTYPE_NAMES.get(compute_dtype(vae), "auto")
    loaded = LoadedVAE(model=vae, family=spec, layout="in-memory", path=None, notes=[], dtype_on_disk=None)
    pipe = Pipeline(loaded, Options(device=device, dtype=dtype, channels_last=channels_last, triton=triton,
                                    attention=attention, graphs="off"), log=log, spell=spell_optimize)
    if (log and pipe.device.type == "cpu" and runs_on is None and explicit_device is None
            and torch.cuda.is_available()):
        log("! optimized for the CPU, where the VAE's weights are, though a GPU is here: its GPU stages were skipped. "
            "Move it first (pipe.to('cuda')), or call optimize after pipe.enable_model_cpu_offload(), which it follows")
    if runs_on is not None and home is not None and not _same_device(pipe.device, home):
        vae.to(home)  # set up on the offload hook's device; the weights wait where they were until a decode
        free_derived(vae)  # and nothing stays behind on the GPU (phase weights built by upsample_conv)
        if log:
            log(f"model CPU offload: optimized for {pipe.device}, where the offload hook moves the VAE for each decode; "
                f"its weights are back on {home}")
    vae._vaeopt_stages = pipe.stages
    vae._vaeopt_optimized = ("vaeopt.optimize", wanted)
    vae._vaeopt_device = pipe.device  # the device its stages were chosen for (_off_plan)
    if callable(getattr(type(vae), "enable_group_offload", None)):  # (pipe.enable_group_offload calls this one)
        vae.enable_group_offload = _StandDownFirst(vae)
    if cls == "AutoencoderKLWan":
        # diffusers' Wan decode runs the decoder one latent frame at a time; the stages' Wan work (fused chunk
        # decoder, time-stacked and phase convs, the planner's chunk) lives in vaeopt.video: send vae.decode there
        vae._decode = _WanChunkDecode(vae, spec)
        if log:
            log("vae.decode: vaeopt's exact chunk decoder (chunk and spatial tiles planned per clip from free "
                "memory); diffusers' own decode where autograd is needed, or with enable_tiling() on a latent "
                "larger than its tile")
    elif cls in video_stream.STREAM_CLASSES:
        # HunyuanVideo 1.5 / LTX-2: diffusers decodes the whole clip in one decoder call (memory grows with the
        # clip); vaeopt.video_stream streams it in exact chunks, with exact tiles where a chunk does not fit
        vae._decode = _StreamDecode(vae, spec)
        if log:
            log("vae.decode: vaeopt's exact chunk decoder (chunk and spatial tiles planned per clip from free "
                "memory); diffusers' own decode where autograd is needed, with enable_tiling() / framewise decoding, "
                "or for a decoder it does not cover (timestep conditioning, noise injection)")
    # vae.decode(...) returns what diffusers' does: a contiguous NCHW/NCDHW sample, not the channels-last tensor the
    # optimized decoder ends with (`.view(...)` on it would raise)
    vae.decoder.register_forward_hook(_contiguous_output)
    vae.decode = _Decode(vae, _RepeatGraphs(vae, spec, log) if not spec.is_video else None)
    return vae


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _offload_device(vae) -> torch.device | None:
    """The execution device of accelerate's model CPU offload hook on the VAE itself (pipe.enable_model_cpu_offload():
    diffusers' decode moves the whole model there first, through apply_forward_hook), else None. A hook appended to
    another is one of a SequentialHook's."""
    hook = getattr(vae, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or [hook]:
        dev = getattr(h, "execution_device", None)
        if isinstance(dev, (str, int, torch.device)):
            return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    return None


def _offloaded_parts(vae) -> str:
    """What places this VAE's weights layer by layer (accelerate's sequential CPU offload, diffusers' group
    offloading), in words; "" if nothing does."""
    seq = [n for n, m in vae.named_modules() if n and getattr(m, "_hf_hook", None) is not None]
    if seq:
        return f"accelerate hooks on {len(seq)} of its modules (sequential CPU offload; e.g. {seq[0]})"
    grouped = [n or type(vae).__name__ for n, m in vae.named_modules()
               if (reg := getattr(m, "_diffusers_hook", None)) is not None
               and any("offload" in str(k) for k in getattr(reg, "hooks", {}))]
    if grouped:
        return f"diffusers' group offloading on {len(grouped)} of its modules (e.g. {grouped[0]})"
    return ""


def _placed_by_others(vae) -> bool:
    """accelerate's hooks (sequential CPU offload, from_pretrained(device_map=...)) or diffusers' group offloading
    place the decoder's layers. Looked for where each of them puts a hook (the decoder's entry modules and its first
    conv): cheap enough for every decode, unlike _offloaded_parts' walk over all modules, which names them."""
    dec = getattr(vae, "decoder", None)
    first_conv = next((m for m in dec.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))), None) \
        if isinstance(dec, torch.nn.Module) else None
    for m in (getattr(vae, "post_quant_conv", None), dec, first_conv):
        if m is None:
            continue
        if getattr(m, "_hf_hook", None) is not None:
            return True
        if any("offload" in str(k) for k in getattr(getattr(m, "_diffusers_hook", None), "hooks", None) or ()):
            return True
    return False


def _off_plan(vae) -> str | None:
    """Why the plan optimize chose no longer holds for this VAE, or None while it does: the one place that decides
    whether an optimized VAE still decodes vaeopt's way. Its stages were chosen for one device (a CPU plan converts
    conv weights to channels_last, which on a GPU makes cuDNN pick other algorithms than diffusers' NCHW convs; a
    GPU plan's kernels do not run on the CPU), with vaeopt placing the weights. Not so once another device runs it
    (moved after optimize; under model CPU offload, the device its hook moves it to) or once accelerate / diffusers'
    group offloading place its layers."""
    planned = getattr(vae, "_vaeopt_device", None)
    if planned is None:
        return None
    if _placed_by_others(vae):
        return f"{_offloaded_parts(vae) or 'offloading hooks'} place its layers now"
    now = _offload_device(vae)
    if now is None:
        w = next((p for m in (getattr(vae, "post_quant_conv", None), vae.decoder) if m is not None
                  for p in m.parameters()), None)
        now = w.device if w is not None else None
    if now is not None and now.type not in (planned.type, "meta"):
        return f"it was optimized for {planned.type} and decodes on {now.type} now"
    return None


# Stages whose in-place changes stand down (in reverse order of application) where the plan no longer holds; the
# others change nothing in the model (precision is the dtype the VAE was asked for or kept, and stays).
_REVERTIBLE = {"channels_last": "channels_last", "fused_norms": "fused_norms", "fused_epilogues": "fused_epilogues",
               "upsample_conv": "upsample_conv", "stacked_conv3d": "stacked_conv3d", "triton_conv": "triton_conv",
               "fp8 convs": "triton_conv", "fp8": "fp8", "attention": "attention"}


def _stand_down(vae, why: str) -> None:
    """Undo what optimize changed in place (layouts, swapped and patched modules, marks), so that vae.decode is
    diffusers' own decode with the VAE as diffusers built it, and say once how to get vaeopt's path back. Where vaeopt
    no longer runs its fast path, a drop-in gives the answer diffusers gives on that device, not a mix of one
    device's plan and another device's kernels. For good: the model is not re-planned behind the user's back."""
    import importlib

    for r in reversed(getattr(vae, "_vaeopt_stages", None) or []):
        name = _REVERTIBLE.get(r.name)
        if name is not None and r.status == "applied":
            importlib.import_module(f"vaeopt.stages.{name}").revert(vae)
    free_derived(vae)
    vae._vaeopt_stood_down = why
    warnings.warn(f"vaeopt: {why}, so vae.decode is diffusers' own decode from here on (vaeopt's in-place changes "
                  "undone: the same output as the stock model there). For vaeopt's path, optimize the VAE where it "
                  "decodes: load or build it again, move it there (pipe.to('cuda')) and then call vaeopt.optimize; "
                  "with offloading, use pipe.enable_model_cpu_offload() before it", stacklevel=3)


class _StandDownFirst:
    """`vae.enable_group_offload` after optimize: diffusers' group offloading places the layers from then on (it saves
    `param.data` to safetensors files with offload_to_disk_path, which refuses the channels_last weights), so
    vaeopt's in-place changes are undone before it takes over. pipe.enable_group_offload calls this method on each
    component. A class, not a closure: the model still pickles and deep-copies."""

    def __init__(self, vae):
        self.vae = vae

    def __call__(self, *args, **kwargs):
        v = self.vae
        if getattr(v, "_vaeopt_stood_down", None) is None and getattr(v, "_supports_group_offloading", True):
            _stand_down(v, "diffusers' group offloading places its layers now")  # (else diffusers refuses it)
        return type(v).enable_group_offload(v, *args, **kwargs)


def refresh(vae=None) -> None:
    """Call after changing an optimized VAE's weights in place where torch keeps no version count: through
    `param.data` (EMA copies, LoRA merges) or under torch.inference_mode, or after replacing a parameter with a new
    one (`module.weight = nn.Parameter(...)`). The weights vaeopt derives from them (tap
    matrices, phase and time-stacked conv weights, packed kernel weights) are rebuilt on their next use, and captured
    CUDA graphs are captured again. Ordinary in-place edits and load_state_dict are seen without it. `vae` is
    accepted for readability; the refresh covers every model."""
    refresh_weights()


class _WanChunkDecode:
    """`vae._decode` of an AutoencoderKLWan after `optimize`: the clip through vaeopt.video.decode_video (the exact
    multi-frame chunk decoder, the same output as diffusers' frame loop), with the chunk planned per clip as
    `vaeopt decode` plans it, OOM retries included. diffusers' `_decode` runs where it must: autograd (our kernels
    have no backward), enable_tiling() on a latent larger than diffusers' tile (the user asked for its tiles), and
    training mode with an active dropout (p > 0; its random drops are diffusers'). Training mode alone (a model
    built with from_config, or a frozen VAE in a training script) decodes here: nothing in the decoder differs.
    A class, not a closure: the model still pickles and deep-copies."""

    def __init__(self, vae, family):
        self.vae, self.family = vae, family

    def _diffusers_tiles(self, z: torch.Tensor) -> bool:
        v = self.vae
        r = v.spatial_compression_ratio
        return bool(v.use_tiling) and (z.shape[-1] > v.tile_sample_min_width // r
                                       or z.shape[-2] > v.tile_sample_min_height // r)

    def __call__(self, z: torch.Tensor, return_dict: bool = True):
        from diffusers.models.autoencoders.vae import DecoderOutput


        v = self.vae
        if (getattr(v, "_vaeopt_stood_down", None) is not None  # (see _off_plan)
                or needs_autograd(z, v) or self._diffusers_tiles(z) or torch.compiler.is_compiling()
                or video.active_dropout(v)):  # (training mode with dropout p > 0: diffusers' decode, dropout included)
            return type(v)._decode(v, z, return_dict=return_dict)  # (compile: dynamo traces diffusers' loop)
        hooked = foreign_hooked(v.decoder)
        if hooked is not None:  # the chunk decoder calls no block's forward: a user's hook there would not fire
            if not self.__dict__.get("_hook_noted"):
                self._hook_noted = True
                where = ("torch's global module hooks" if hooked == "<global>" else
                         "vae." + ("decoder." + hooked if hooked else "decoder"))
                warnings.warn(f"vaeopt: {where} carries a hook (yours, or one of diffusers' layerwise casting / "
                              "offloading), which vaeopt's chunk decoder would not call: vae.decode runs diffusers' "
                              "own frame loop instead, so that it fires", stacklevel=2)
            return type(v)._decode(v, z, return_dict=return_dict)
        w = v.post_quant_conv.weight  # where the model is now (it may have moved since optimize)
        plan = planner.plan_decode(self.family, v, tuple(z.shape), compute_dtype(v) or w.dtype, w.device)
        with torch.no_grad():
            out = video.decode_video(v, z, **Pipeline._video_kwargs(plan, {}))  # as `vaeopt decode` runs a clip
        return DecoderOutput(sample=out) if return_dict else (out,)


class _StreamDecode:
    """`vae._decode` of an AutoencoderKLHunyuanVideo15 / AutoencoderKLLTX2Video after `optimize`: the clip through
    vaeopt.video_stream.decode_clip (exact chunks, the same output as diffusers' whole-clip decode, unclamped as
    diffusers returns it), planned per clip as `vaeopt decode` plans it. diffusers' `_decode` runs where it must:
    autograd, compile tracing, a hook on the decoder, the user's enable_tiling() / enable_framewise_decoding(), a
    decoder video_stream does not cover, or LTX-2 timesteps for a timestep-conditioned decoder. Keeps each class's
    `_decode` signature and return type (HunyuanVideo 1.5: a tensor; LTX-2: DecoderOutput or a tuple)."""

    def __init__(self, vae, family):
        self.vae, self.family = vae, family

    def _diffusers(self, z) -> bool:
        v = self.vae
        return (needs_autograd(z, v) or torch.compiler.is_compiling() or bool(getattr(v, "use_tiling", False))
                or bool(getattr(v, "use_framewise_decoding", False)) or not video_stream.applies(v)
                or foreign_hooked(v.decoder) is not None)

    def __call__(self, z: torch.Tensor, temb=None, causal=None, return_dict: bool = True):
        from diffusers.models.autoencoders.vae import DecoderOutput

        v = self.vae
        ltx = type(v).__name__ == "AutoencoderKLLTX2Video"
        if self._diffusers(z):
            if ltx:
                return type(v)._decode(v, z, temb, causal=causal, return_dict=return_dict)
            return type(v)._decode(v, z)
        # (LTX-2 without timestep conditioning: diffusers' decoder ignores temb, so does this)
        w = next(v.decoder.parameters())
        plan = planner.plan_decode(self.family, v, tuple(z.shape), compute_dtype(v) or w.dtype, w.device)
        with torch.no_grad():
            out = video_stream.decode_clip(v, z, plan.chunk or 1, tile=plan.tile if plan.mode == "tiled" else None,
                                           split=plan.split, oom_retry=True, causal=causal, clamp=False)
        if not ltx:
            return out
        return DecoderOutput(sample=out) if return_dict else (out,)


def _contiguous_output(module, args, out):
    """Forward hook of an optimized decoder (module-level, so that the model pickles)."""
    return out.contiguous() if isinstance(out, torch.Tensor) else out


_contiguous_output.vaeopt_keeps_activations = True  # a layout, not values: no reason to leave the fused paths


class _Decode:
    """`vae.decode` after `optimize`: diffusers' own decode (its offload hook, slicing and tiling included), then,
    under model CPU offload, the derived-weight caches dropped once per call, so that nothing of the VAE stays on the
    GPU when the hook offloads it (its weights come back at a new address each time, so they would be rebuilt
    anyway). A class, not a closure: the model still pickles and deep-copies."""

    def __init__(self, vae, graphs: _RepeatGraphs | None = None):
        self.vae = vae
        self.graphs = graphs

    class _Signature:  # inspect.signature(vae.decode) / IDEs: diffusers' own, not (*args, **kwargs)
        def __get__(self, obj, cls=None):
            if obj is None:  # on the class itself: no override (inspect.signature(_Decode) works as usual)
                return None
            import inspect

            return inspect.signature(type(obj.vae).decode.__get__(obj.vae))

    __signature__ = _Signature()

    def __call__(self, *args, **kwargs):
        v = self.vae
        if (getattr(v, "_vaeopt_stood_down", None) is None and not torch.compiler.is_compiling()
                and (why := _off_plan(v)) is not None):
            _stand_down(v, why)
        g = self.__dict__.get("graphs")
        if g is not None and getattr(v, "_vaeopt_stood_down", None) is None:
            out = g.decode(args, kwargs)
            if out is not None:
                return out
        try:
            return type(v).decode(v, *args, **kwargs)
        finally:
            if _offload_device(v) is not None:
                free_derived(v)


class _RepeatGraphs:
    """CUDA graphs for an optimized image VAE that a pipeline calls once per image: `vae.decode(z)` calls are counted
    per latent shape and dtype, and a shape is captured on the call where its decodes so far would have repaid the
    capture (planner.graphs_pay, the measured table); its later calls replay (the same kernels: the same output).
    Only plain calls take this path: latents on a CUDA device, no autograd, no offload hooks or hooks of others, no
    diffusers slicing or tiling, not inside torch.compile or another capture, and room on the device for the graph's
    pool; everything else runs diffusers' decode as before. A new weights version (vaeopt.refresh, an in-place edit)
    captures again. Pickling or copying the model keeps the policy and drops the graphs (they hold device memory)."""

    def __init__(self, vae, family: FamilySpec, log: Callable[[str], None] | None = None):
        self.vae, self.family, self.log = vae, family, log
        self._fresh()

    def _fresh(self) -> None:
        self.calls: dict = {}
        self.shapes: set = set()
        self.graphed = None
        self.epoch = None

    def __getstate__(self):
        return {"vae": self.vae, "family": self.family, "log": self.log}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fresh()

    def _plain(self, z, kwargs) -> bool:
        v = self.vae
        return (isinstance(z, torch.Tensor) and z.device.type == "cuda" and not set(kwargs) - {"return_dict"}
                and not needs_autograd(z, v) and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing() and _offload_device(v) is None
                and not getattr(v, "use_slicing", False) and not getattr(v, "use_tiling", False)
                and foreign_hooked(v) is None)

    def decode(self, args, kwargs):
        """The graphed decode's output for a plain call of a shape that has paid, else None (the caller decodes)."""
        if self.family.is_video or len(args) != 1 or not self._plain(args[0], kwargs):
            return None
        z, v = args[0], self.vae
        key = (tuple(z.shape), z.dtype)
        n = self.calls[key] = self.calls.get(key, 0) + 1
        if key not in self.shapes:
            use, why = planner.graphs_pay(self.family, tuple(z.shape), n)
            if not use:
                return None
            est = planner.estimate_whole(self.family, v, tuple(z.shape), z.dtype)
            if 2 * est > torch.cuda.mem_get_info(z.device)[0]:
                return None  # the graph's pool holds a decode's transients: only with room for them
            self.shapes.add(key)
            if self.log:
                self.log(f"✓ graphs: vae.decode of {tuple(z.shape)} captured as a CUDA graph and replayed from now on "
                         f"({why})")
        if self.graphed is None:
            from vaeopt.stages import graphs as graphs_stage

            self.graphed = graphs_stage.GraphedDecode(lambda x: type(v).decode(v, x).sample, z.device)
        if (now := weights_epoch(v)) != self.epoch:
            if self.epoch is not None:
                self.graphed.reset()
            self.epoch = now
        with torch.no_grad():
            out = self.graphed(z)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=out) if kwargs.get("return_dict", True) else (out,)


@dataclass
class DecodeJob:
    """One latent tensor to decode and where its output goes."""

    source: Path
    entry: str
    z_raw: torch.Tensor
    outputs: list[Path]  # one per batch item
    kind: str  # "png", "mp4", "frames", "safetensors"
    overwrite: bool = True  # False: an output that appears during the decode is kept (outputs.AppearedError)


@dataclass
class DecodeResult:
    job: DecodeJob
    seconds: float
    peak_bytes: int | None
    written: list[Path] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    retries: list[str] = field(default_factory=list)


def output_kind(path: Path, is_video: bool) -> str:
    s = path.suffix.lower()
    if path.is_dir():  # an existing folder is a folder, whatever its name ends with ("renders/2024.06.01", "x.png")
        return "frames" if is_video else "png-dir"
    if s in outputs.IMAGE_SUFFIXES:
        if is_video:
            raise VaeoptError(f"{path}: a video VAE decodes clips: use an .mp4 output, or a folder path (e.g. "
                              f"{path.with_suffix('')}/) for one PNG per frame (a .png takes only a one-frame clip: "
                              "1 latent frame)")
        return "png"
    if s in outputs.VIDEO_SUFFIXES:
        if not is_video:
            raise VaeoptError(f"{path}: an image VAE decodes images; use a .png output")
        return "mp4"
    if s in outputs.TENSOR_SUFFIXES:
        return "safetensors"
    if s == "":
        if path.exists() and not path.is_file():  # not a folder (above) nor a file: /dev/null, a FIFO, a socket
            raise VaeoptError(f"{path}: a device, pipe or socket, not a folder or a .png/.mp4/.safetensors file, which "
                              "is what -o takes (to decode without writing, time it with vaeopt benchmark)")
        return "frames" if is_video else "png-dir"
    raise VaeoptError(outputs.unknown_type(str(path), s))


def _latents_in(lf: lat.LatentFile, fam) -> int:
    """How many of the file's tensors (all of them, before --key chose one) can be latents for this VAE."""
    try:
        return len(_latent_entries(dataclasses.replace(lf, entries=lf.all_entries), fam, None))
    except LatentError:  # none fits: the chosen tensor's own error is reported when it is validated
        return 0


def _latent_entries(lf: lat.LatentFile, fam, log: Callable[[str], None] | None) -> list[lat.LatentEntry]:
    """A file's tensors that can be latents for this VAE. A dict that also holds other tensors (e.g. {"latents",
    "prompt_embeds"}, as scripts save them) decodes its latents and says what it skipped; if none fits, the first
    tensor's error, with the names --key can pick."""
    if len(lf.entries) < 2:
        return lf.entries
    fits, misfits = [], []
    for e in lf.entries:
        try:
            lat.validate(e, fam, lf.path, values=False)
            fits.append(e)
        except lat.NotALatent as err:  # wrong rank or channel count, no hint of a fixable layout: another tensor
            misfits.append((e, err))
    if not fits:
        e, err = misfits[0]
        names = ", ".join(x.name for x in lf.entries[:8]) + (", ..." if len(lf.entries) > 8 else "")
        raise LatentError(f"{err}; none of its {len(lf.entries)} tensors fits this VAE (--key NAME picks one: "
                          f"{names})")
    if misfits and log is not None:
        log(f"{lf.path}: skipped {len(misfits)} tensor(s) that are not {fam.title} latents: "
            + ", ".join(f"{e.name} {tuple(e.tensor.shape)} ({err.reason})" for e, err in misfits[:4])
            + (", ..." if len(misfits) > 4 else ""))
    return fits


def _have_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Limits:
    """The work one input file may ask for (vaeopt decode --max-outputs, --max-output-gb): outputs (images, clips)
    and decoded size, counted as 8-bit RGB pixels (4x that for a .safetensors output). Decode time grows with the
    same pixels, so the size also bounds the work."""

    max_outputs: int = lat.DEFAULT_MAX_OUTPUTS
    max_output_gb: float = lat.DEFAULT_MAX_OUTPUT_GB

    def check(self) -> None:
        if isinstance(self.max_outputs, bool) or not isinstance(self.max_outputs, int) or self.max_outputs < 1:
            raise VaeoptError(f"--max-outputs must be a whole number of at least 1, got {self.max_outputs}")
        if not (isinstance(self.max_output_gb, int | float) and 0 < self.max_output_gb < float("inf")):
            raise VaeoptError(f"--max-output-gb must be a positive number of GB, got {self.max_output_gb}")


def _check_limits(lf: lat.LatentFile, entries: list[lat.LatentEntry], fam, limits: Limits, raw_floats: bool) -> None:
    """Refuse a file that asks for more outputs or output than `limits` allow, from shapes alone (before any value
    is looked at, and before the first decode). Each entry counts, also where several are one shared tensor."""
    outs = nbytes = 0
    biggest = None
    for e in entries:
        t = lat.validate(e, fam, lf.path, values=False)
        n = t.shape[0]
        frames = fam.output_frames(t.shape[2]) if fam.is_video else 1
        h, w = t.shape[-2] * fam.spatial_factor, t.shape[-1] * fam.spatial_factor
        outs += n
        nbytes += n * frames * h * w * 3 * (4 if raw_floats else 1)
        biggest = max(biggest or (0, 0, 0), (h * w * frames, h, w))
    if outs > limits.max_outputs:
        raise VaeoptError(f"{lf.path}: asks for {outs} outputs (images or clips), more than the {limits.max_outputs} "
                          "one input file may make (--max-outputs, a guard against files that ask for unbounded "
                          f"work); nothing was decoded: pass --max-outputs {outs} to allow it")
    gb = nbytes / 1e9
    if gb > limits.max_output_gb:
        _, h, w = biggest
        size = f"{gb:.1f} GB" if gb >= 1 else f"{nbytes / 1e6:.1f} MB"
        raise VaeoptError(f"{lf.path}: its {outs} output(s) (up to {h}x{w} pixels{' per frame' if fam.is_video else ''})"
                          f" would be {size} decoded ({'float32' if raw_floats else '8-bit RGB'}), more than the "
                          f"{limits.max_output_gb:g} GB one input file may make (--max-output-gb, a guard against files "
                          f"that ask for unbounded work); nothing was decoded: pass --max-output-gb {math.ceil(gb)} to "
                          "allow it")


def plan_jobs(latent_files: list[lat.LatentFile], loaded: LoadedVAE, out: Path | None, latent_space: str | None,
              overwrite: bool, out_is_folder: bool = False, log: Callable[[str], None] | None = None,
              limits: Limits | None = None) -> list[DecodeJob]:
    """The decode jobs and their output paths, checked (shapes, duplicates, inputs, writability, the work each file
    asks for: `limits`, default Limits()) before any work.
    out_is_folder: `out` is a folder whatever its name (typed with a trailing '/'), even if it does not exist yet.
    log: where to say which tensors of a file were skipped as not latents for this VAE."""
    fam = loaded.family
    limits = limits or Limits()
    limits.check()
    jobs: list[DecodeJob] = []
    tags: list[str] = []  # per job: the tensor name its outputs carry ("" for none)
    given: dict[str, Path] = {}
    for lf in latent_files:
        r = os.path.abspath(lf.path)  # a.pt and ../d/a.pt are one; two names linked to one blob are two inputs
        if r in given:
            raise VaeoptError(f"{lf.path}: given twice (also as {given[r]}); name each latent file once")
        given[r] = lf.path
    entries = {lf.path: _latent_entries(lf, fam, log) for lf in latent_files}
    raw_floats = out is not None and not out_is_folder and out.suffix.lower() in outputs.TENSOR_SUFFIXES
    for lf in latent_files:
        _check_limits(lf, entries[lf.path], fam, limits, raw_floats)
    multi = sum(len(v) for v in entries.values()) > 1
    # inputs with one name (a/lat.pt, b/lat.pt into -o out/): outputs named after their folders (out/a_lat.png)
    stems = outputs.distinct_stems([lf.path for lf in latent_files], one_folder=out is not None and multi)
    for lf in latent_files:
        space = latent_space or lf.default_space
        # one of several latents in the file (--key or not): its name goes in the output's
        named = len(entries[lf.path]) > 1 or (lf.all_entries is not None and _latents_in(lf, fam) > 1)
        for e in entries[lf.path]:
            t = lat.validate(e, fam, lf.path)
            if log is not None and (hint := lat.space_hint(t, fam, space)):  # a likely wrong latent space
                log(f"warning: {lf.path.name}{'[' + e.name + ']' if e.name else ''}: {hint}")
            z = lat.to_raw(t, fam, space)
            n = z.shape[0]
            stem = stems[lf.path] + (f"_{outputs.safe_name(e.name)}" if e.name and named else "")
            clip = fam.is_video and not (fam.makes_images and z.shape[2] == 1)  # (Qwen-Image: a picture)
            if out is None:
                base = outputs.default_output(lf.path, clip, e.name if named else "", stem=stems[lf.path])
            elif multi:
                folder = out_is_folder or out.suffix == "" or out.is_dir()
                # -o both.png for several outputs: both_<tensor>.png from one file's tensors, both_<file>.png from
                # several files (both_<file>_<tensor>.png where those hold several): the input's name is said once
                tag = outputs.safe_name(e.name) if len(latent_files) == 1 and e.name and named else stem
                base = (out / (stem + (".mp4" if clip else ".png"))) if folder \
                    else out.with_name(f"{out.stem}_{tag}{out.suffix}")
            else:
                base = out
            outputs.check_name_length(base)
            if out_is_folder and base == out:
                kind = "frames" if fam.is_video else "png-dir"
            elif fam.is_video and z.shape[2] == 1 and base.suffix.lower() in outputs.IMAGE_SUFFIXES \
                    and not base.is_dir():
                kind = "png"  # one latent frame decodes to one frame (Wan as a text-to-image model): a PNG is right
            else:
                kind = output_kind(base, fam.is_video)
            if kind == "png-dir":
                base = base / (stem + ".png")  # (the entry's name kept, as without -o)
                kind = "png"
            elif kind == "frames" and n > 1:  # a batch of clips into a folder: one MP4 each, inside it (as for
                base = base / (stem + ".mp4")  # several files or dict entries)
                kind = "mp4"
            paths = [outputs.numbered(base, i, n) for i in range(n)] if kind != "safetensors" else [base]
            jobs.append(DecodeJob(lf.path, e.name, z, paths, kind, overwrite))
            tags.append(e.name if named else "")
    if any(j.kind == "mp4" for j in jobs) and not _have_pyav():
        raise VaeoptError("MP4 output needs PyAV (pip install av). Without it, write PNG frames (-o a folder, one clip "
                          "at a time: --key NAME picks one of a dict) or a .safetensors file. Nothing was decoded")
    all_paths = [p for j in jobs for p in j.outputs]
    real = {p: os.path.realpath(p) for p in all_paths}  # one file under two spellings (a.png, ../names/a.png) too
    where = [real[p] for p in all_paths]
    dupes = {p for p, r in zip(all_paths, where) if where.count(r) > 1}
    if dupes:
        first = sorted(dupes)[0]
        clash = [j for j in jobs if any(real[p] == real[first] for p in j.outputs)]
        if len({j.source for j in clash}) == 1:  # two tensors of one file whose names map to one file name
            names = ", ".join(repr(j.entry) for j in clash[:3])
            raise VaeoptError(f"{clash[0].source.name}: its tensors {names} would write the same output {first} "
                              "(a file name cannot keep what tells their names apart): decode one at a time with "
                              "--key NAME and its own -o")
        helps = False  # would -o a folder tell them apart? (not where names meet: p.pt['q'] and p_q.pt are p_q.png)
        if out is None or not (out_is_folder or out.is_dir()):
            fs = outputs.distinct_stems([lf.path for lf in latent_files], one_folder=True)
            ext = ".mp4" if fam.is_video else ".png"
            would = [outputs.numbered(Path(fs[j.source] + (f"_{outputs.safe_name(t)}" if t else "") + ext), i, n)
                     for j, t in zip(jobs, tags) for n in [j.z_raw.shape[0]] for i in range(n)]
            helps = len(set(would)) == len(would)
        who = " and ".join(f"{j.source}{'[' + j.entry + ']' if j.entry else ''}" for j in clash[:2])
        keyed = next((j for j in clash if j.entry), None)
        fix = "pass -o a folder" if helps else (
            "rename one of the inputs, or decode them in separate runs, each with its own -o"
            + (f" (--key {keyed.entry} decodes {keyed.source}[{keyed.entry}] alone)" if keyed else ""))
        raise VaeoptError(f"two inputs ({who}) would write the same output {first}: {fix}")
    inputs = {lf.path.resolve() for lf in latent_files}
    model = loaded.path.resolve() if loaded.path is not None else None
    if model is not None and model in inputs:
        raise VaeoptError(f"{loaded.path}: given as latents too; it is the model checkpoint (latents are the "
                          ".pt/.safetensors/.latent/.npy/.npz files a pipeline or ComfyUI saved)")
    for p in all_paths:
        try:
            r = p.resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop on the way
            raise VaeoptError(f"{p}: not a usable output path ({e})") from None
        if r in inputs or (model is not None and (r == model or (model in r.parents and r.exists()))):
            raise VaeoptError(f"{p}: would overwrite {'the model' if r not in inputs else 'an input latent file'}"
                              " (even --overwrite does not replace inputs); choose another -o")
    outputs.check_writable(all_paths, overwrite, folders={p for j in jobs if j.kind == "frames" for p in j.outputs})
    renamed = [j for j in jobs if stems[j.source] != j.source.stem]
    if renamed and log is not None:  # which input goes where, since the names alone no longer say it
        log("inputs with the same file name, told apart in their outputs' names: " + "; ".join(
            f"{j.source}{'[' + j.entry + ']' if j.entry else ''} -> "
            + (str(j.outputs[0]) if len(j.outputs) == 1 else f"{j.outputs[0]} .. {j.outputs[-1].name}")
            for j in renamed))
    return jobs


NONFINITE_HINT = ("the latents may be far outside the VAE's range (check --latent-space: scaled or raw), or an fp16 "
                  "decode overflowed (--dtype bf16 or fp32)")


def _nonfinite(decoded: torch.Tensor) -> str | None:
    """What is wrong with a decode that produced NaN/Inf, or None when it is finite."""
    bad = count_nonfinite(decoded)
    return f"the decoder produced {bad} non-finite values (NaN/Inf) of {decoded.numel()}" if bad else None


def check_finite(decoded: torch.Tensor, job: DecodeJob) -> None:
    """A decode that produced NaN/Inf (fp16 overflow, broken weights, extreme latents) would be written as a black
    image and reported as done: refuse it instead."""
    bad = _nonfinite(decoded)
    if bad:
        where = f"{job.source}" + (f" [{job.entry}]" if job.entry else "")
        raise DecodeError(f"{where}: {bad}; nothing was written for it ({NONFINITE_HINT})")


def write_job(job: DecodeJob, decoded: torch.Tensor, fps: float = 16.0) -> list[Path]:
    check_finite(decoded, job)
    written = []
    if job.kind == "safetensors":  # clamped as video decodes are: what the metadata says
        outputs.write_tensor(job.outputs[0], decoded.clamp(-1, 1), {"source": str(job.source), "range": "[-1,1]"},
                             overwrite=job.overwrite)
        return [job.outputs[0]]
    imgs = outputs.to_uint8_images(decoded)
    with outputs.land_together(job.outputs, job.overwrite):  # a batch's files land whole, or none of them
        for i, path in enumerate(job.outputs):
            if job.kind == "png":
                outputs.write_png(path, imgs[i][0] if imgs.ndim == 5 else imgs[i], job.overwrite)  # video: one frame
            elif job.kind == "mp4":
                outputs.write_mp4(path, [imgs[i]], fps=fps, overwrite=job.overwrite)
            elif job.kind == "frames":
                outputs.write_frames_dir(path, [imgs[i]], job.overwrite)
            written.append(path)
    return written


def run_jobs(pipe: Pipeline, jobs: list[DecodeJob], fps: float = 16.0,
             progress: Callable[[DecodeJob, int, int], None] | None = None,
             on_result: Callable[[DecodeResult], None] | None = None) -> list[DecodeResult]:
    """Decode and write every job. `progress(job, done, total)` is called as a job's decode advances: frames of a
    video job, tiles of a tiled image decode (a whole decode is one call, with no steps to report); a caller
    draws its own bar from it. `on_result` sees each result as soon as its outputs are on disk, so that a later
    failure or Ctrl-C does not hide what was already written. A job whose decode is unusable (NaN/Inf) stops the run;
    its error then says which outputs of earlier jobs were written and kept, and how many inputs were not decoded."""
    done: list[DecodeResult] = []
    try:
        return _run_jobs(pipe, jobs, fps, progress, on_result, done)
    except VaeoptError as e:  # NaN/Inf output, a full disk...: what is on disk now, exactly
        if not done:
            raise
        kept = [p for r in done for p in r.written]
        rest = len(jobs) - len(done) - 1
        msg = (f"{e}; kept the {len(kept)} output(s) written before it ({', '.join(map(str, kept[:3]))}"
               f"{', ...' if len(kept) > 3 else ''})" + (f", {rest} input(s) after it not decoded" if rest else "")
               + "; to go on, decode the remaining inputs alone (--overwrite replaces what is there)")
        raise (type(e) if type(e) in (DecodeError, outputs.OutputError, outputs.AppearedError) else VaeoptError)(
            msg) from None


def _run_jobs(pipe, jobs, fps, progress, on_result, results: list[DecodeResult]) -> list[DecodeResult]:
    shapes = [tuple(j.z_raw.shape) for j in jobs]
    vg = None  # Wan video: per-chunk CUDA graphs (vaeopt.video_graphs), decided per clip
    for job in jobs:
        shape = tuple(job.z_raw.shape)
        plan = pipe.plan(shape)
        src = job.source if len({j.source for j in jobs if j.source.name == job.source.name}) > 1 else job.source.name
        pipe.log(f"plan {src}{'[' + job.entry + ']' if job.entry else ''} {shape}: {plan.reason}")
        if job is jobs[0]:  # the graphs stage, decided by the table from the first job's plan
            vg = pipe.setup_graphs(plan, shape, shapes.count(shape))
        if vg is not None:
            vg.budget_bytes = plan.budget_bytes  # the budget this clip was planned for bounds its graph pool
        pipe.autotune(shapes.count(shape), plan)  # before the shape's first decode: cuDNN keeps its first choice
        cb = (lambda d, t, job=job: progress(job, d, t)) if progress else None
        if job.kind == "mp4" and job.z_raw.shape[0] == 1:
            t0 = time.perf_counter()
            writer = outputs.Mp4Writer(job.outputs[0], fps=fps, overwrite=job.overwrite)
            try:
                done = 0
                total = pipe.family.output_frames(job.z_raw.shape[2])
                vstats = DecodeStats()
                for frames in pipe.iter_video(job.z_raw, plan, vstats):
                    writer.put(frames)
                    done += frames.shape[0]
                    if cb:
                        cb(done, total)
            except DecodeError as e:  # NaN/Inf frames (checked on the device as they are decoded)
                writer.abort()
                raise DecodeError(f"{job.source}: {e}; nothing was written for it ({NONFINITE_HINT})") from None
            except BaseException:
                writer.abort()
                raise
            try:
                writer.close()
            except BaseException:  # Ctrl-C / SIGTERM while the encoder flushes: no .partial file stays
                writer.abort()
                raise
            peak = torch.cuda.max_memory_allocated(pipe.device) if pipe.device.type == "cuda" else None
            results.append(DecodeResult(job, time.perf_counter() - t0, peak, [job.outputs[0]], plan.to_dict(),
                                        vstats.retries))
            if on_result:
                on_result(results[-1])
            continue
        decoded, stats = pipe.decode(job.z_raw, plan, progress=cb)
        written = write_job(job, decoded, fps)
        results.append(DecodeResult(job, stats.seconds, stats.peak_bytes, written, plan.to_dict(), stats.retries))
        if on_result:
            on_result(results[-1])
    if vg is not None:
        video_graphs.report_to(pipe, vg)  # the measured outcome, after the decodes
    if pipe.graphed is not None:
        for s in pipe.stages:
            if s.name == "graphs":
                s.status = "applied" if pipe.graphed.captures else "skipped"
                s.detail = pipe.graphed.report()
                s.data = {"replays": pipe.graphed.replays, "captures": pipe.graphed.captures}
                pipe.log(s.line(pipe.spell))  # the measured outcome, after the decodes
    return results
