"""ComfyUI's loaded VAE decoded through vaeopt, on ComfyUI's own weights.

ComfyUI keeps a VAE as `vae.first_stage_model` (LDM key names for SD/SDXL/SD3/FLUX, the original Wan names for
Wan 2.1/2.2, ComfyUI's HunyuanVideo names) inside a ModelPatcher that moves it between its load and offload devices.
Here that state dict is read through vaeopt's own key mapping into a diffusers model whose parameters are the same
tensors (built on the meta device, assigned), optimized by vaeopt's pipeline, and cached per VAE object. Where a
stage re-lays a weight out (channels_last), ComfyUI's parameter is pointed at the new layout too, so one copy of each
weight lives on the GPU. When ComfyUI moves its weights (offload, reload), ours follow them before the next decode,
and after ComfyUI offloads the VAE nothing of ours keeps the old GPU copies alive.

Only this module touches ComfyUI (imported lazily: the package imports without it).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Callable

import torch

import vaeopt
from vaeopt import planner
from vaeopt.api import spell_options
from vaeopt.errors import VaeoptError
from vaeopt.loading import LoadedVAE, load_vae_from_state_dict

log = logging.getLogger("vaeopt.comfyui")

# diffusers classes vaeopt decodes here; others (TAESD, whose ComfyUI module scales latents itself, audio, 3D...) go
# to ComfyUI's own decode
SUPPORTED = ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLHunyuanVideo")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_CALLBACK_KEY = "vaeopt"


class Unsupported(Exception):
    """This VAE or latent is not one vaeopt decodes here: ComfyUI's own decode runs instead (the message says why)."""


@dataclasses.dataclass
class _Pair:
    """One weight as both models hold it: ComfyUI's module attribute and ours (same tensor, maybe another view)."""
    theirs: torch.nn.Module
    theirs_attr: str
    ours: torch.nn.Module
    ours_attr: str


@dataclasses.dataclass
class Entry:
    loaded: LoadedVAE
    pairs: list[_Pair]
    key: tuple  # what the pipeline was built for: (device, dtype, fp8)
    pipe: object = None  # vaeopt.Pipeline, built on the device once ComfyUI has loaded the weights there


_CACHE: "weakref.WeakKeyDictionary[object, Entry | str]" = weakref.WeakKeyDictionary()


def _mm():
    import comfy.model_management as mm  # ComfyUI's memory manager

    return mm


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the decoder's weights: ComfyUI's model loader counts those itself, apart from the decode's need."""
    parts = [m for m in (getattr(model, "post_quant_conv", None), getattr(model, "decoder", None)) if m is not None]
    return sum(p.numel() * p.element_size() for m in parts for p in m.parameters())


def _norm_groups(module: torch.nn.Module) -> int | None:
    """GroupNorm's group count as ComfyUI built the module: the weights cannot show it (ComfyUI's LDM VAE uses 32)."""
    for m in module.modules():
        if isinstance(m, torch.nn.GroupNorm):
            return m.num_groups
    return None


def _attr_of(root: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = key.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def _build(vae) -> Entry:
    fsm = getattr(vae, "first_stage_model", None)
    if not isinstance(fsm, torch.nn.Module):
        raise Unsupported("the VAE has no first_stage_model module")
    for p in fsm.parameters():
        if not p.is_contiguous():  # relaid out by an earlier build: back to the standard layout, so that the new
            p.data = p.data.contiguous()  # model can take these very tensors (it assigns contiguous ones only)
    sd = fsm.state_dict()
    groups = _norm_groups(fsm)
    try:
        loaded = load_vae_from_state_dict(sd, label="ComfyUI VAE",
                                          config={"norm_num_groups": groups} if groups else None)
    except VaeoptError as e:
        raise Unsupported(f"vaeopt does not know this VAE's weights ({e})") from None
    cls = loaded.family.cls_name
    if cls not in SUPPORTED:
        raise Unsupported(f"{cls} ({loaded.family.title}) is decoded by ComfyUI's own VAE decode")
    # which of ComfyUI's tensors each of our parameters is: matched by address, since the key mapping only renamed
    # (and for attention, re-viewed) them
    by_ptr = {(v.data_ptr(), v.device): k for k, v in sd.items() if v.numel()}
    pairs = []
    for k, p in loaded.model.named_parameters():
        theirs = by_ptr.get((p.data_ptr(), p.device))
        if theirs is None:
            continue
        tm, ta = _attr_of(fsm, theirs)
        om, oa = _attr_of(loaded.model, k)
        pairs.append(_Pair(tm, ta, om, oa))
    n_params = sum(1 for _ in loaded.model.parameters())
    if len(pairs) < n_params:
        log.info("vaeopt: %d of %d weights hold their own memory (a dtype or layout ComfyUI's did not have)",
                 n_params - len(pairs), n_params)
    return Entry(loaded, pairs, key=())


def _follow_comfy(entry: Entry) -> int:
    """Point our parameters at ComfyUI's tensors where ComfyUI moved them (offload and reload give new tensors).
    -> how many moved."""
    moved = 0
    for pr in entry.pairs:
        ours = getattr(pr.ours, pr.ours_attr)
        theirs = getattr(pr.theirs, pr.theirs_attr)
        if ours is None or theirs is None or ours.dtype != theirs.dtype:
            continue  # vaeopt keeps its own storage for this one (fp8)
        if ours.data_ptr() != theirs.data_ptr() or ours.device != theirs.device:
            ours.data = theirs.data.view(ours.shape) if theirs.shape != ours.shape else theirs.data
            moved += 1
    return moved


def _share_with_comfy(entry: Entry) -> int:
    """After the pipeline re-laid weights out (channels_last), point ComfyUI's parameters at ours: one copy, which
    ComfyUI's own modules compute with as before (a conv takes any weight layout). -> how many."""
    n = 0
    for pr in entry.pairs:
        ours = getattr(pr.ours, pr.ours_attr)
        theirs = getattr(pr.theirs, pr.theirs_attr)
        if ours is None or theirs is None or ours.dtype != theirs.dtype or ours.device != theirs.device:
            continue
        if ours.data_ptr() == theirs.data_ptr():
            continue
        theirs.data = ours.data if ours.shape == theirs.shape else ours.data.view(theirs.shape)
        n += 1
    return n


def _on_detach(vae_ref: weakref.ref) -> Callable:
    def callback(patcher, unpatch_all=True):
        vae = vae_ref()
        entry = _CACHE.get(vae) if vae is not None else None
        if isinstance(entry, Entry):
            _follow_comfy(entry)  # now on ComfyUI's offload device: the GPU copies are free to go
            from vaeopt.stages import free_derived

            free_derived(entry.loaded.model)
    return callback


def entry_for(vae) -> Entry:
    """The cached vaeopt model of this ComfyUI VAE (built on first use); raises Unsupported."""
    got = _CACHE.get(vae)
    if isinstance(got, str):
        raise Unsupported(got)
    if got is None:
        try:
            got = _build(vae)
        except Unsupported as e:
            _CACHE[vae] = str(e)  # asked once per VAE object
            raise
        _CACHE[vae] = got
        patcher = getattr(vae, "patcher", None)
        if hasattr(patcher, "add_callback_with_key"):
            try:
                from comfy.patcher_extension import CallbacksMP

                patcher.remove_callbacks_with_key(CallbacksMP.ON_DETACH, _CALLBACK_KEY)
                patcher.add_callback_with_key(CallbacksMP.ON_DETACH, _CALLBACK_KEY, _on_detach(weakref.ref(vae)))
            except ImportError:
                pass
    return got


def _options(vae, fp8: bool, vram_budget_gb: float, tile: int, chunk: int, family) -> vaeopt.Options:
    if torch.device(vae.device).type not in ("cuda", "cpu"):
        raise Unsupported(f"vaeopt decodes on CUDA GPUs and the CPU, not on {vae.device}")
    dtype = _DTYPE_NAMES.get(getattr(vae, "vae_dtype", torch.float32))
    if dtype is None:
        raise Unsupported(f"ComfyUI runs this VAE in {vae.vae_dtype}, which vaeopt does not decode in")
    t = None
    if tile and tile > 0:
        t = max(8, int(tile) // family.spatial_factor)  # tile side in output px -> latent px
    return vaeopt.Options(device=str(torch.device(vae.device)), dtype=dtype, fp8="on" if fp8 else "off",
                          vram_budget_gb=float(vram_budget_gb) if vram_budget_gb and vram_budget_gb > 0 else None,
                          tile=t, chunk=int(chunk) if chunk and chunk > 0 else None)


def memory_request(entry: Entry, shape: tuple, opts: vaeopt.Options) -> tuple[int, planner.Plan]:
    """Bytes to ask ComfyUI's model manager to free for this decode, beyond the VAE's own weights: the planner's
    estimate for the plan it would make if the device were free of other models (or within the given budget)."""
    model = entry.pipe.model if entry.pipe is not None else entry.loaded.model
    device = torch.device(opts.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[opts.dtype]
    budget = opts.vram_budget_gb
    if budget is None and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory * (1 - planner.RESERVE_FRACTION) / 2**30
    plan = planner.plan_decode(entry.loaded.family, model, tuple(shape), dtype, device, vram_budget_gb=budget,
                               tile=opts.tile, chunk=opts.chunk, tiling=opts.tiling)
    return max(0, int(plan.est_bytes) - weights_bytes(model)), plan


def _all_on(entry: Entry, device: torch.device) -> str | None:
    for pr in entry.pairs:
        t = getattr(pr.theirs, pr.theirs_attr)
        if t is not None and (t.device.type != device.type or (t.device.index or 0) != (device.index or 0)):
            return f"ComfyUI keeps part of the VAE on {t.device} (low-VRAM mode), not all on {device}"
    return None


def _pipeline(vae, entry: Entry, opts: vaeopt.Options) -> object:
    key = (opts.device, opts.dtype, opts.fp8)
    if entry.pipe is not None and entry.key != key:
        # another device, precision or fp8 changes the model in place: start again from ComfyUI's weights
        entry = _CACHE[vae] = _build(vae)
    if entry.pipe is None:
        try:
            entry.pipe = vaeopt.Pipeline(entry.loaded, dataclasses.replace(opts), log=_log_line,
                                         spell=spell_options)
        except VaeoptError as e:  # e.g. a setting this GPU cannot run
            _CACHE.pop(vae, None)  # the half-set-up model goes; the next decode starts from ComfyUI's weights again
            raise Unsupported(f"vaeopt cannot set this VAE up here ({e})") from None
        entry.key = key
        n = _share_with_comfy(entry)
        if n:
            log.info("vaeopt: ComfyUI's VAE now computes with vaeopt's layout of %d weights (one copy)", n)
    return entry.pipe


def _log_line(line: str) -> None:
    log.info("vaeopt: %s", line)


def _progress():
    try:
        import comfy.utils

        bar = {}

        def cb(done: int, total: int) -> None:
            if "bar" not in bar:
                bar["bar"] = comfy.utils.ProgressBar(total)
            bar["bar"].update_absolute(done, total)
        return cb
    except Exception:  # outside ComfyUI, or an older one: no bar
        return None


def decode(vae, samples: torch.Tensor, *, fp8: bool = False, vram_budget_gb: float = 0.0, tile: int = 0,
           chunk: int = 0) -> torch.Tensor:
    """ComfyUI LATENT samples (raw VAE latents) -> IMAGE (N, H, W, 3) float in [0, 1] on vae.output_device; video
    frames flattened into the batch as ComfyUI's VAEDecode does. Raises Unsupported where ComfyUI's decode must run."""
    if type(samples) is not torch.Tensor:  # ComfyUI's NestedTensor (audio+video latents) and the like
        raise Unsupported(f"the latent is a {type(samples).__name__}, not a plain tensor")
    entry = entry_for(vae)
    fam = entry.loaded.family
    want = 5 if fam.is_video else 4
    if samples.ndim != want:
        raise Unsupported(f"{fam.title} takes {want}-D latents, this one is {tuple(samples.shape)}")
    opts = _options(vae, fp8, vram_budget_gb, tile, chunk, fam)
    mm = _mm()
    need, plan = memory_request(entry, tuple(samples.shape), opts)
    log.info("vaeopt: decode %s needs %.2f GB beyond the weights (planner: %s)", tuple(samples.shape), need / 2**30,
             plan.reason)
    # ComfyUI frees other models for this much and loads the VAE whole (vaeopt's kernels want every weight on the GPU)
    mm.load_models_gpu([vae.patcher], memory_required=need, force_full_load=True)
    device = torch.device(opts.device)
    why = _all_on(entry, device)
    if why:
        raise Unsupported(why)
    if _follow_comfy(entry):
        vaeopt.refresh()  # derived weights (packed, phase, time-stacked) are rebuilt from the moved ones
    pipe = _pipeline(vae, entry, opts)
    pipe.opts = dataclasses.replace(opts)  # decode-time choices: budget, tile, chunk
    out = _run(pipe, samples, mm)
    bad = (~torch.isfinite(out)).sum().item()
    if bad:
        raise VaeoptError(f"the decode produced {bad} NaN/Inf values (latents out of this VAE's range, or fp16 "
                          "overflow: run ComfyUI with --fp32-vae or --bf16-vae)")
    images = vae.process_output(out.clamp(-1, 1)).movedim(1, -1)
    if images.ndim == 5:  # (N, T, H, W, 3) -> frames in the batch, as VAEDecode
        images = images.reshape(-1, *images.shape[-3:])
    return images.to(getattr(vae, "output_device", "cpu"))


def _run(pipe, samples: torch.Tensor, mm) -> torch.Tensor:
    from vaeopt import video_graphs

    z = samples.float()
    oom = getattr(mm, "OOM_EXCEPTION", torch.cuda.OutOfMemoryError)
    for attempt in range(2):
        plan = pipe.plan(tuple(z.shape))
        log.info("vaeopt: plan %s: %s", tuple(z.shape), plan.reason)
        try:
            vg = pipe.setup_graphs(plan) if video_graphs.applies(pipe) else None
            out, stats = pipe.decode(z, plan, progress=_progress())
            if vg is not None:
                video_graphs.report_to(pipe, vg)
            if stats.peak_bytes is not None:
                log.info("vaeopt: %.3f s, peak %.2f GB", stats.seconds, stats.peak_bytes / 2**30)
            return out
        except oom:
            if attempt:
                raise
            # past vaeopt's own retry: free what ComfyUI can and plan again within half of what is free then
            mm.soft_empty_cache()
            free = mm.get_free_memory(pipe.device)
            pipe.opts = dataclasses.replace(pipe.opts, vram_budget_gb=max(free / 2 / 2**30, 0.25))
            log.warning("vaeopt: out of memory; retrying within %.2f GB", pipe.opts.vram_budget_gb)
    raise AssertionError("unreachable")


def decode_or_fallback(vae, samples: torch.Tensor, **kw) -> torch.Tensor:
    try:
        return decode(vae, samples, **kw)
    except Unsupported as e:
        log.warning("vaeopt: using ComfyUI's VAE decode: %s", e)
    images = vae.decode(samples)
    if images.ndim == 5:
        images = images.reshape(-1, *images.shape[-3:])
    return images


__all__ = ["decode", "decode_or_fallback", "entry_for", "memory_request", "weights_bytes", "Unsupported", "SUPPORTED"]
