"""Decoding latents, the Python API the CLI is built on: vaeopt.decode (a tensor), and the jobs of `vaeopt decode`
(which checkpoint, one job per latent tensor with its checked output paths, the decodes, the atomic writes).
vaeopt.optimize, the drop-in for a diffusers VAE, lives in vaeopt.dropin."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vaeopt import latents as lat
from vaeopt import outputs, stage_table, video_graphs
from vaeopt.errors import DecodeError, LatentError, VaeoptError
from vaeopt.families import get_family
from vaeopt.fidelity import count_nonfinite
from vaeopt.hw import resolve_device, resolve_dtype
from vaeopt.loading import LoadedVAE, expand_user, load_vae, parse_json
from vaeopt.options import check_limits
from vaeopt.pipeline import DecodeStats, Options, Pipeline, compute_dtype
from vaeopt.stages import Hint

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
           progress: Callable[[int, int], None] | None = None, on_device: bool = False,
           spell: Callable[[tuple[Hint, ...]], str] | None = None) -> torch.Tensor:
    """Decode latents with the optimized pipeline. Returns float32 CPU images in [-1, 1]: (N,3,H,W) or (N,3,T,H,W).
    on_device=True: the same values, left where the decoder produced them (the GPU for image decodes), for a caller
    that converts them there (to uint8, to half) and copies fewer bytes to the host.
    A vaeopt.load_vae(...) result is optimized in place on its first decode, and later decodes of it reuse that
    pipeline (options=None, or the same options); other options need the checkpoint loaded again.
    progress(done, total): called after each tile of a tiled image decode (a whole one has no steps to report) and
    with the frames done after each chunk of a video decode (Wan).
    spell: how the stage lines sent to `log` write the settings they suggest (default spell_options:
    `vaeopt.Options(fp8='on')`), for a caller whose users set them another way (`vaeopt serve`)."""
    if vae is None:
        raise VaeoptError("vaeopt.decode(latents, vae) needs the VAE: a checkpoint path or vaeopt.load_vae(...)")
    if isinstance(vae, torch.nn.Module):
        raise VaeoptError(f"vaeopt.decode takes a checkpoint path or vaeopt.load_vae(...), not a "
                          f"{type(vae).__name__} module: for pipe.vae use vaeopt.optimize(pipe.vae), then "
                          "pipe.vae.decode(...)")
    if not isinstance(vae, (LoadedVAE, str, os.PathLike)):  # (pathlib's TypeError would name neither)
        raise VaeoptError(f"vaeopt.decode: vae must be a checkpoint path or vaeopt.load_vae(...), got "
                          f"{type(vae).__name__} {vae!r:.60}")
    check_log(log, "vaeopt.decode")
    if spell is not None and not callable(spell):
        raise VaeoptError(f"vaeopt.decode: spell must be a function of a hint group returning text, got "
                          f"{type(spell).__name__}")
    if not isinstance(latents, torch.Tensor):
        raise VaeoptError(f"latents must be a torch.Tensor, got {type(latents).__name__}")
    if latents.device.type == "meta":
        raise VaeoptError("latents are on the meta device: they have a shape but no values to decode")
    if options is not None and not isinstance(options, Options):
        raise VaeoptError(f"options must be vaeopt.Options(...), got {type(options).__name__} (e.g. "
                          "Options(dtype='bf16'))")
    if not isinstance(latent_space, str) or latent_space.lower() not in ("scaled", "raw"):  # before the load
        raise LatentError(f"latent space must be 'scaled' or 'raw', got '{latent_space}'")
    latent_space = latent_space.lower()  # any case, as --latent-space takes it
    entry = lat.LatentEntry("", latents)
    if not isinstance(vae, LoadedVAE):
        lat.check_values(entry, Path("<tensor>"))  # NaN/Inf need no VAE: said before seconds of loading one
    loaded = vae if isinstance(vae, LoadedVAE) else load_vae(vae)
    t = lat.validate(entry, loaded.family, Path("<tensor>"))  # (before the stages are set up on the model)
    pipe = _pipeline_for(loaded, options, log, spell or spell_options)
    z = lat.to_raw(t, loaded.family, latent_space)
    plan = pipe.plan(tuple(z.shape))
    pipe.log(f"plan {tuple(z.shape)}: {plan.reason}")  # as `vaeopt decode` logs each job's
    # per-chunk graphs (Wan clips of several chunks); a one-chunk clip is counted and captured whole, as an image
    one = stage_table.one_chunk_clip(loaded.family, plan, tuple(z.shape))
    vg = pipe.setup_graphs(plan) if video_graphs.applies(pipe) and not one else None
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


def spell_kwargs(group: tuple[Hint, ...]) -> str:
    """A hint's settings as Python keyword arguments (`fp8='on', tile=512`): spell_options' and
    dropin.spell_optimize's common part."""
    return ", ".join(h.option if h.value is None else f"{h.option}={h.value}" if isinstance(h.value, (int, float))
                     else f"{h.option}={h.value!r}" for h in group)


def spell_options(group: tuple[Hint, ...]) -> str:
    """A hint as vaeopt.decode takes it: `vaeopt.Options(fp8='on')` (the spelling of vaeopt.decode's lines)."""
    return f"vaeopt.Options({spell_kwargs(group)})"


# Options that change the model in place (weights' device and dtype, layouts, fused modules, e4m3 layers); the others
# (tiling, tile, chunk, VRAM budget, graphs, cuDNN autotuning) are decode-time choices a built pipeline can take.
_MODEL_OPTIONS = ("channels_last", "triton", "epilogues", "attention", "upsample_conv", "stack_conv3d", "conv_kernel",
                  "fp8", "gate_db")


def _model_key(o: Options) -> dict:
    o.validate()
    dev = resolve_device(o.device)
    return {"device": str(dev), "dtype": str(resolve_dtype(o.dtype, dev)).replace("torch.", ""),
            **{f: getattr(o, f) for f in _MODEL_OPTIONS}}


def refuse_other(model: torch.nn.Module, who: str, key: dict) -> None:
    """The one mark that vaeopt.decode and vaeopt.optimize leave on a model they changed in place: a second call
    is accepted only from the same function with the same model-changing options."""
    done = getattr(model, "_vaeopt_optimized", None)
    if done is None or done == (who, key):
        return
    by, old = done
    diff = ", ".join(f"{k}={old.get(k)!r} -> {key.get(k)!r}" for k in key if old.get(k) != key.get(k))
    raise VaeoptError(f"this model was already optimized in place by {by}(...)" + (f" for other options ({diff})"
                      if by == who else f", not by {who}(...)") + "; load or build it again for this call")


def _pipeline_for(loaded: LoadedVAE, options: Options | None, log: Callable[[str], None] | None,
                  spell: Callable[[tuple[Hint, ...]], str]) -> Pipeline:
    """The pipeline of a load_vae(...) result: built once, in place on its model, and reused by later decodes (with no
    options, or options that change the model the same way), so that decoding twice neither stacks the stages'
    hooks nor redoes their work. Options that would change the model otherwise need the unmodified model, which the
    first pipeline changed in place (dtype, layout, fused modules): refused, rather than silently decoding with the
    first options' precision. So is a model that vaeopt.optimize changed."""
    pipe = getattr(loaded, "_vaeopt_pipeline", None)
    if pipe is None or options is not None:
        key = _model_key(options if options is not None else Options())
        refuse_other(loaded.model, "vaeopt.decode", key)
    if pipe is None:
        pipe = Pipeline(loaded, dataclasses.replace(options) if options is not None else None, log=log,
                        spell=spell)
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
    pipe.log, pipe.spell = log, spell  # (this call's log, and the spelling of its lines' hints)
    return pipe


def check_log(log, who: str) -> None:
    """vaeopt.decode's and vaeopt.optimize's check of their log argument: log is called with each line, long after
    the call began (a 5 would fail there as "'int' object is not callable")."""
    if log is not None and not callable(log):
        raise VaeoptError(f"{who}: log must be a function taking one line (e.g. print, logging.getLogger(...).info) or "
                          f"None for silence, got {type(log).__name__} {log!r:.60}")


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


def check_latents_early(latent_files: list[lat.LatentFile], family: str | None) -> None:
    """The latents' own mistakes before the model loads (seconds), with the lines plan_jobs gives after it: NaN/Inf
    in a file's one tensor always (a dict may hold other tensors, e.g. masks with -inf, that are not decoded); where
    the family is named (--family, vaeopt.json beside the latents) the whole validation, shapes and channel counts
    too: a named family's weights must have its latent channels or the load refuses them. A tiny decoder takes its
    channel count from its weights: values only."""
    spec = get_family(family) if family else None
    for lf in latent_files:
        if spec is not None and spec.cls_name != "AutoencoderTiny":
            for e in _latent_entries(lf, spec, None):
                lat.validate(e, spec, lf.path)
        elif len(lf.entries) == 1:
            lat.check_values(lf.entries[0], lf.path)


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
        check_limits(self.max_outputs, self.max_output_gb)


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
    for s in pipe.report_graphs():
        pipe.log(s.line(pipe.spell))  # the measured outcome, after the decodes
    return results
