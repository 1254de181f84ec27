"""vaeopt.optimize: the drop-in for diffusers. It optimizes a diffusers VAE (e.g. ``pipe.vae``) in place and gives it a
``vae.decode`` that keeps diffusers' signature and output: Wan and HunyuanVideo 1.5 / LTX-2 clips through vaeopt's
exact chunk decoders, repeated image shapes through CUDA graphs once they pay, and diffusers' own decode wherever the
plan optimize chose no longer holds (another device, offloading hooks), with vaeopt's in-place changes undone there.
The decode-time wrappers are module-level classes, so that an optimized model pickles and deep-copies."""

from __future__ import annotations

import sys
import warnings
from typing import Callable

import torch

from vaeopt import planner, stage_table, video, video_stream
from vaeopt.api import check_log, refuse_other, spell_kwargs
from vaeopt.errors import VaeoptError
from vaeopt.families import FamilySpec, get_family
from vaeopt.hw import DTYPE_NAMES, resolve_dtype
from vaeopt.loading import LoadedVAE
from vaeopt.pipeline import Options, Pipeline, compute_dtype
from vaeopt.stages import Hint, foreign_hooked, free_derived, needs_autograd, refresh_weights, weights_epoch

_OPTIMIZE_KWARGS = ("device", "dtype", "channels_last", "triton", "attention")  # vaeopt.optimize(vae, ...)


def spell_optimize(group: tuple[Hint, ...]) -> str:
    """A hint as vaeopt.optimize's caller can act on it: its keyword arguments where it takes them all
    (`triton='on'`), else vaeopt.decode with Options."""
    if all(h.option in _OPTIMIZE_KWARGS for h in group):
        return spell_kwargs(group)
    return f"vaeopt.decode(..., options=vaeopt.Options({spell_kwargs(group)}))"


# the diffusers classes optimize() was built and measured for, and the family whose stages each takes
_OPTIMIZE_FAMILIES = {"AutoencoderKL": "sdxl", "AutoencoderKLWan": "wan21", "AutoencoderKLHunyuanVideo": "hunyuanvideo",
                      "AutoencoderTiny": "taesd", "AutoencoderKLFlux2": "flux2", "AutoencoderKLQwenImage": "qwenimage",
                      "AutoencoderKLHunyuanVideo15": "hunyuanvideo15", "AutoencoderKLLTX2Video": "ltx2"}
_OPTIMIZE_CLASSES = tuple(_OPTIMIZE_FAMILIES)


def wan_view(vae) -> tuple[torch.nn.Module | None, str]:
    """An AutoencoderKLWan over an AutoencoderKLQwenImage's own decoder weights, for vaeopt's Wan path (the stages and
    the chunk decoder know Wan's module classes), or (None, why not). Qwen-Image's decoder is Wan 2.1's module for
    module (diffusers' autoencoder_kl_qwenimage.py is autoencoder_kl_wan.py renamed, is_residual=False), so each Wan
    module shares its Qwen-Image twin's parameter, buffer and hook dicts (all but its children): one set of weights,
    no copy, and whatever edits one (in-place edits, load_state_dict with or without assign, `module.weight =
    nn.Parameter(...)`, `.to()`, a hook) edits both; the stages' state-dict and load hooks serve the VAE's own
    state_dict / load_state_dict, as on a Wan VAE. The encoder and quant_conv are the VAE's own modules. The view is
    built on the meta device (no memory) and is not a submodule of the VAE (its state dict stays the same)."""
    import inspect

    from diffusers import AutoencoderKLWan

    from vaeopt.loading.config import alias_new_class

    cfg = alias_new_class(dict(vae.config), "the VAE's config", [])
    params = inspect.signature(AutoencoderKLWan.__init__).parameters
    with torch.device("meta"):
        wan = AutoencoderKLWan(**{k: v for k, v in cfg.items() if k in params})
    pairs = []
    for wan_part, own in ((wan.decoder, vae.decoder), (wan.post_quant_conv, vae.post_quant_conv)):
        ours, theirs = dict(own.named_modules()), dict(wan_part.named_modules())
        if ours.keys() != theirs.keys():
            extra = sorted(ours.keys() ^ theirs.keys())[0]
            return None, f"its decoder is not Qwen-Image's stock one ({extra or 'its root'} differs)"
        for name, m in ours.items():
            w = theirs[name]
            if (type(m).__name__.replace("QwenImage", "Wan") != type(w).__name__
                    or m._parameters.keys() != w._parameters.keys() or m._buffers.keys() != w._buffers.keys()):
                return None, f"its module {name or 'decoder'} ({type(m).__name__}) is not Qwen-Image's stock one"
            pairs.append((w, m))
    for w, m in pairs:
        w.__dict__.update({k: v for k, v in m.__dict__.items()
                           if k.startswith("_") and k != "_modules" and isinstance(v, (dict, set))})
        w.training = False  # (the drop-in sends active dropout to diffusers' own decode)
    wan.encoder, wan.quant_conv = vae.encoder, vae.quant_conv
    wan.training = False
    return wan, ""


def wan_runs(vae) -> torch.nn.Module:
    """The model vaeopt's stages changed and its chunk decoder runs: the VAE, or an AutoencoderKLQwenImage's Wan view
    (wan_view)."""
    d = vae.__dict__.get("_decode")
    return d.wan if isinstance(d, _WanChunkDecode) else vae


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
    check_log(log, "vaeopt.optimize")
    wanted = dict(device=device, dtype=dtype, channels_last=channels_last, triton=triton, attention=attention)
    if getattr(vae, "_vaeopt_stood_down", None) is not None:  # (its changes are undone; redoing them is not safe)
        if log:
            log(f"! vaeopt stepped aside for this VAE ({vae._vaeopt_stood_down}): vae.decode is diffusers' own; for "
                "vaeopt's path, load or build the VAE again, move it where it decodes, then optimize it")
        return vae
    if getattr(vae, "_vaeopt_optimized", None) is not None:  # again would stack hooks and redo (or undo) its work
        refuse_other(vae, "vaeopt.optimize", wanted)
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
    runner = vae  # the model the stages change and the fast path runs
    if cls == "AutoencoderKLQwenImage":
        # diffusers' Qwen-Image decode runs the decoder once per latent frame: vaeopt's Wan path (the stages, the
        # chunk decoder, a picture's one-frame convs as Conv2d) runs an AutoencoderKLWan over the same weights
        runner, why_not = wan_view(vae)
        if runner is None:
            runner = vae
            if log:
                log(f"! vae.decode stays diffusers' own frame loop: {why_not}, so vaeopt's Wan path does not run it")
        else:
            spec = FamilySpec(base.name, base.title, {**runner.config, "_class_name": "AutoencoderKLWan"})
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
    loaded = LoadedVAE(model=runner, family=spec, layout="in-memory", path=None, notes=[], dtype_on_disk=None)
    pipe = Pipeline(loaded, Options(device=device, dtype=dtype, channels_last=channels_last, triton=triton,
                                    attention=attention, graphs="off"), log=log, spell=spell_optimize)
    if (log and pipe.device.type == "cpu" and runs_on is None and explicit_device is None
            and torch.cuda.is_available()):
        log("! optimized for the CPU, where the VAE's weights are, though a GPU is here: its GPU stages were skipped. "
            "Move it first (pipe.to('cuda')), or call optimize after pipe.enable_model_cpu_offload(), which it follows")
    if runs_on is not None and home is not None and not _same_device(pipe.device, home):
        vae.to(home)  # set up on the offload hook's device; the weights wait where they were until a decode
        free_derived(runner)  # and nothing stays behind on the GPU (phase weights built by upsample_conv)
        if log:
            log(f"model CPU offload: optimized for {pipe.device}, where the offload hook moves the VAE for each decode; "
                f"its weights are back on {home}")
    vae._vaeopt_stages = pipe.stages
    vae._vaeopt_optimized = ("vaeopt.optimize", wanted)
    vae._vaeopt_device = pipe.device  # the device its stages were chosen for (_off_plan)
    if callable(getattr(type(vae), "enable_group_offload", None)):  # (pipe.enable_group_offload calls this one)
        vae.enable_group_offload = _StandDownFirst(vae)
    wan = spec.cls_name == "AutoencoderKLWan"  # (Wan 2.1 / 2.2, and Qwen-Image through its Wan view)
    if wan:
        # diffusers' Wan decode runs the decoder one latent frame at a time; the stages' Wan work (fused chunk
        # decoder, time-stacked and phase convs, the planner's chunk) lives in vaeopt.video: send vae.decode there
        vae._decode = _WanChunkDecode(vae, spec, runner)
        if log:
            log("vae.decode: vaeopt's exact chunk decoder (chunk and spatial tiles planned per clip from free "
                "memory" + ("; Qwen-Image's decoder runs as Wan 2.1's, on the same weights" if runner is not vae
                            else "") + "); diffusers' own decode where autograd is needed, or with enable_tiling() "
                "on a latent larger than its tile")
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
    # repeated image shapes, and one-chunk Wan clips (a picture: one latent frame), through CUDA graphs once they pay
    vae.decode = _Decode(vae, _RepeatGraphs(vae, spec, log, runner) if not spec.is_video or wan else None)
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
    if (name := _swapped(vae)) is not None:
        return f"vae.{name}{_SWAPPED}"
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


_SWAP_FIX = ("For vaeopt's path, swap modules before optimizing: load or build the VAE again, make the change, then "
             "call vaeopt.optimize")


def _stand_down(vae, why: str) -> None:
    """Undo what optimize changed in place (layouts, swapped and patched modules, marks), so that vae.decode is
    diffusers' own decode with the VAE as diffusers built it, and say once how to get vaeopt's path back. Where vaeopt
    no longer runs its fast path, a drop-in gives the answer diffusers gives on that device, not a mix of one
    device's plan and another device's kernels. For good: the model is not re-planned behind the user's back."""
    import importlib

    runs = wan_runs(vae)
    for r in reversed(getattr(vae, "_vaeopt_stages", None) or []):
        name = _REVERTIBLE.get(r.name)
        if name is not None and r.status == "applied":
            importlib.import_module(f"vaeopt.stages.{name}").revert(runs)
    free_derived(runs)
    vae._vaeopt_stood_down = why
    fix = _SWAP_FIX if why.endswith(_SWAPPED) else (
        "For vaeopt's path, optimize the VAE where it decodes: load or build it again, move it there "
        "(pipe.to('cuda')) and then call vaeopt.optimize; with offloading, use pipe.enable_model_cpu_offload() "
        "before it")
    warnings.warn(f"vaeopt: {why}, so vae.decode is diffusers' own decode from here on (vaeopt's in-place changes "
                  f"undone: the same output as the stock model there). {fix}", stacklevel=3)


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
    CUDA graphs are captured again. Ordinary in-place edits and load_state_dict are seen without it. A module
    replaced after optimize (`vae.decoder.conv_out = new_conv`) needs it too where CUDA graphs replay decodes; an
    AutoencoderKLQwenImage, whose decode runs through a Wan view of the modules optimize saw, notices a replaced
    module at its next decode by itself and steps aside to diffusers' own decode, with a warning (swap modules
    before optimize to keep vaeopt's path). `vae` is accepted for readability; the refresh covers every model."""
    refresh_weights()


_SWAPPED = " was replaced after vaeopt.optimize, which had set up the module there before"


def _decoder_modules(vae) -> list[tuple[str, torch.nn.Module]]:
    """The VAE's decode-side modules by name (a walk: ~0.1 ms for Qwen-Image's 150)."""
    return [(f"{part}.{n}" if n else part, m) for part in ("post_quant_conv", "decoder")
            for n, m in getattr(vae, part).named_modules()]


def _swapped(vae) -> str | None:
    """The first module replaced on an AutoencoderKLQwenImage since optimize built its Wan view (e.g.
    `vae.decoder.conv_out = new_conv`), or None. The view's modules share their twins' weights and hooks, not their
    children, so it would go on decoding with the module that was replaced, without a word."""
    d = vae.__dict__.get("_decode")
    then = d.__dict__.get("modules") if isinstance(d, _WanChunkDecode) else None
    if then is None:
        return None
    now = _decoder_modules(vae)
    for (name, m), (_, m_now) in zip(then, now):
        if m is not m_now:  # (a walk in order: the first module that differs is the one replaced, or its parent's)
            return name
    return None if len(then) == len(now) else (then if len(then) > len(now) else now)[min(len(then), len(now))][0]


class _WanChunkDecode:
    """`vae._decode` of an AutoencoderKLWan after `optimize`: the clip through vaeopt.video.decode_video (the exact
    multi-frame chunk decoder, the same output as diffusers' frame loop), with the chunk planned per clip as
    `vaeopt decode` plans it, OOM retries included. diffusers' `_decode` runs where it must: autograd (our kernels
    have no backward), enable_tiling() on a latent larger than diffusers' tile (the user asked for its tiles), and
    training mode with an active dropout (p > 0; its random drops are diffusers'). Training mode alone (a model
    built with from_config, or a frozen VAE in a training script) decodes here: nothing in the decoder differs.
    An AutoencoderKLQwenImage's decode runs the same way through its Wan view (`wan`, see wan_view); the checks
    above look at the VAE itself, whose modules a user hooks or tiles. A class, not a closure: the model still
    pickles and deep-copies."""

    def __init__(self, vae, family, wan=None):
        self.vae, self.family = vae, family
        self.wan = vae if wan is None else wan
        # a Wan view holds the VAE's modules of this moment: one swapped on the VAE later is not in it (_swapped)
        self.modules = _decoder_modules(vae) if wan is not None and wan is not vae else None

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
        plan = planner.plan_decode(self.family, self.wan, tuple(z.shape), compute_dtype(v) or w.dtype, w.device)
        with torch.no_grad():
            out = video.decode_video(self.wan, z, **Pipeline._video_kwargs(plan, {}))  # as `vaeopt decode` runs a clip
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
        return (getattr(v, "_vaeopt_stood_down", None) is not None  # (see _off_plan)
                or needs_autograd(z, v) or torch.compiler.is_compiling() or bool(getattr(v, "use_tiling", False))
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
                                           split=plan.split, replan=planner.smaller_stream_plan, causal=causal,
                                           clamp=False)
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
                free_derived(wan_runs(v))


class _RepeatGraphs:
    """CUDA graphs for an optimized image VAE (or a Wan VAE decoding pictures: one-chunk clips, such as Qwen-Image's
    one latent frame) that a pipeline calls once per image: `vae.decode(z)` calls are counted
    per latent shape and dtype, and a shape is captured on the call where its decodes so far would have repaid the
    capture (planner.graphs_pay, the measured table); its later calls replay (the same kernels: the same output).
    Only plain calls take this path: latents on a CUDA device, no autograd, no offload hooks or hooks of others, no
    diffusers slicing or tiling, not inside torch.compile or another capture, and room on the device for the graph's
    pool; everything else runs diffusers' decode as before. A new weights version (vaeopt.refresh, an in-place edit)
    captures again. Pickling or copying the model keeps the policy and drops the graphs (they hold device memory).
    `run`: the model the Wan path decodes with (an AutoencoderKLQwenImage's Wan view; the VAE itself when None)."""

    def __init__(self, vae, family: FamilySpec, log: Callable[[str], None] | None = None, run=None):
        self.vae, self.family, self.log = vae, family, log
        self.run = vae if run is None else run
        self._fresh()

    def _fresh(self) -> None:
        self.calls: dict = {}
        self.shapes: set = set()
        self.never: set = set()  # Wan clips of several chunks: per-chunk graphs are the clip decoder's, never these
        self.graphed = None
        self.epoch = None

    def __getstate__(self):
        return {"vae": self.vae, "family": self.family, "log": self.log, "run": self.run}

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
        if len(args) != 1 or not self._plain(args[0], kwargs):
            return None
        z, v = args[0], self.vae
        wan = self.family.cls_name == "AutoencoderKLWan"
        if wan and (z.dim() != 5 or video.active_dropout(v) or foreign_hooked(v.decoder) is not None):
            return None  # (what _WanChunkDecode leaves to diffusers' own decode)
        key = (tuple(z.shape), z.dtype)
        if key in self.never:
            return None
        n = self.calls[key] = self.calls.get(key, 0) + 1
        if key not in self.shapes:
            # a Wan clip: whole only where its plan is one untiled chunk (stage_table.one_chunk_clip); a clip of
            # several is remembered, so that its later calls do not plan again only to be told no
            plan = planner.plan_decode(self.family, self.run, tuple(z.shape), z.dtype, z.device) if wan else None
            if wan and not stage_table.one_chunk_clip(self.family, plan, tuple(z.shape)):
                self.never.add(key)
                return None
            est = plan.est_bytes if wan else planner.estimate_whole(self.family, v, tuple(z.shape), z.dtype)
            d = stage_table.decide_call_graphs("auto", self.family, tuple(z.shape), n, est,
                                               torch.cuda.mem_get_info(z.device)[0],
                                               gpu=torch.cuda.get_device_name(z.device), plan=plan)
            if d.kind != "whole":
                return None
            why = d.why
            self.shapes.add(key)
            if self.log:
                self.log(f"✓ graphs: vae.decode of {tuple(z.shape)} captured as a CUDA graph and replayed from now on "
                         f"({why})")
        if self.graphed is None:
            from vaeopt.stages import graphs as graphs_stage

            # Wan: the chunk decoder in one call, as _WanChunkDecode runs it, without its planning (free memory)
            # and OOM retries, which have no place inside a capture
            run = self.run
            fn = (lambda x: video.decode_video(run, x, chunk=x.shape[2], graphs="off")) if wan else \
                (lambda x: type(v).decode(v, x).sample)
            self.graphed = graphs_stage.GraphedDecode(fn, z.device)
        if (now := weights_epoch(v)) != self.epoch:
            if self.epoch is not None:
                self.graphed.reset()
            self.epoch = now
        with torch.no_grad():
            out = self.graphed(z)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=out) if kwargs.get("return_dict", True) else (out,)
