"""`vaeopt decode`: argument mistakes first (before torch loads), then load, plan, decode and write; one rank or
several (--gpus)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from vaeopt import outputs
from vaeopt.cli import printing
from vaeopt.cli.exits import clean_errors
from vaeopt.cli.paths import (check_config_exists, check_inputs_exist, check_model_exists,
                               check_output_not_an_input, output_arg, output_folder)
from vaeopt.cli.printing import QUIET_HELP, VERBOSE_HELP, detail, log, say, set_verbosity
from vaeopt.cli.report import DecodeProgress, fps_unused, optimizer_summary, plan_words, report_model, report_read
from vaeopt.errors import VaeoptError
from vaeopt.options import Options, check_device_name, check_dtype_name, check_limits, spell_flags


@contextlib.contextmanager
def imports_without_gc():
    """Python's cyclic garbage collector paused over a block of imports, and what they built frozen after it
    (gc.freeze: modules, classes and functions live as long as the process, so later collections need not walk
    them). An import of diffusers makes hundreds of thousands of objects, which set off hundreds of collections that
    each walk what is there already: a quarter of its time (E67: 2.7-3.1 s of CPU instead of 3.5-4.0 s). Objects are
    still freed by reference counting; only the few cycles left by the imports stay, until the process exits: the
    freeze is undone by an atexit handler, so that the interpreter's own teardown collects as it would (extension
    modules such as Triton's complain of leaked objects otherwise). Frozen only where the block imported something:
    a process that has its modules already, such as a program calling the command in-process, has nothing new.
    VAEOPT_IMPORT_GC=on keeps the collector running (to measure one against the other)."""
    if not gc.isenabled() or os.environ.get("VAEOPT_IMPORT_GC", "").strip().lower() == "on":
        yield
        return
    modules = len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.freeze()
            if not _UNFREEZE_AT_EXIT:
                atexit.register(gc.unfreeze)
                _UNFREEZE_AT_EXIT.append(True)
        gc.enable()


_UNFREEZE_AT_EXIT: list = []  # (registered once per process)


@clean_errors
def decode(
    latents: List[Path] = typer.Argument(..., help="Latent files: .pt/.pth, .safetensors, ComfyUI .latent, .npy, .npz."),
    model: Optional[Path] = typer.Option(None, "--model", "-m",
                                         help="VAE checkpoint (.safetensors/.ckpt/.pt or diffusers folder). "
                                              "Default: vaeopt.json beside the latents, $VAEOPT_MODEL, or the user config."),
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="out.png | out.mp4 | folder/ | out.safetensors (raw). A folder gets one "
                                              "PNG per image, or one PNG per frame of a clip (one MP4 per "
                                              "clip when there are several); a trailing / always means a "
                                              "folder (made if missing); a bare suffix (-o .png) is refused. "
                                              "Several outputs to one file name: a batch is numbered "
                                              "(out_000.png, out_001.png), a dict's tensors take their key "
                                              "(out_<key>.png), several inputs their file name (out_<file>.png). "
                                              "Default: beside the input."),
    family: Optional[str] = typer.Option(None, "--family", help="Override family detection (sd15, sdxl, flux, wan21, ...)."),
    config: Optional[Path] = typer.Option(None, "--config", help="diffusers config.json overriding detection."),
    key: Optional[str] = typer.Option(None, "--key", help="Decode only this tensor of a dict-of-tensors file."),
    height: Optional[int] = typer.Option(None, "--height", help="Image height in pixels of packed FLUX.2 / "
                                                                "Qwen-Image latents (batch, sequence, features)."),
    width: Optional[int] = typer.Option(None, "--width", help="Image width in pixels of packed latents."),
    latent_space: Optional[str] = typer.Option(None, "--latent-space",
                                               help="scaled (pipeline output; default for .pt/.safetensors/.npy/.npz) or "
                                                    "raw (VAE latents; default for ComfyUI .latent)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto | fp32 | bf16 | fp16 (auto: bf16 on GPUs that have it, fp32 on CPU)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:1, cpu (default: cuda if available)."),
    tile: Optional[int] = typer.Option(None, "--tile", help="Force tiled decode with this tile side in latent pixels."),
    chunk: Optional[int] = typer.Option(None, "--chunk", help="Latent frames per decoder call (video)."),
    vram_budget: Optional[float] = typer.Option(None, "--vram-budget", help="Plan for this many GB instead of free VRAM."),
    tiling: str = typer.Option("auto", "--tiling", help="auto | on | off"),
    channels_last: str = typer.Option("auto", "--channels-last", help="auto | on | off"),
    triton: str = typer.Option("auto", "--triton", help="Fused Triton norm kernels: auto | on | off"),
    epilogues: str = typer.Option("auto", "--epilogues", help="Fused conv-bias/residual/upsample epilogues and "
                                                              "chunked wide-head attention: auto | on | off"),
    upsample_conv: str = typer.Option("auto", "--upsample-conv", help="Upsampler convs as four 2x2 phase convs on "
                                                                      "the low-res input (4/9 of the FLOPs): auto | on | off"),
    stack_conv3d: str = typer.Option("auto", "--stack-conv3d", help="Wan's causal Conv3d as one Conv2d over "
                                                                    "time-stacked channels: auto | on | off"),
    conv_kernel: str = typer.Option("auto", "--conv-kernel", help="Triton implicit-GEMM conv for the layers it "
                                                                  "beats cuDNN on: Wan's 96-ch Conv3d (bf16 on "
                                                                  "sm_90: alongside --stack-conv3d, which then "
                                                                  "stacks the 384-ch ones; else with --stack-conv3d "
                                                                  "off), and the e4m3 convs of --fp8: auto | on | off"),
    graphs: str = typer.Option("auto", "--graphs", help="CUDA graphs: auto | on | off"),
    cudnn_autotune: str = typer.Option("auto", "--cudnn-autotune", help="Time cuDNN's engine configs per new conv "
                                       "shape (one-time cost; pays for many same-shape decodes): auto | on | off"),
    fp8: str = typer.Option("off", "--fp8", help="FP8/8-bit weights and compute, gated on fidelity: off | on | "
                                                 "weights (level 1 alone: e4m3 weight storage) | gemm (levels 1-2: "
                                                 "plus fp8 GEMMs for 1x1 convs/linears) | auto (the same as on: "
                                                 "8-bit convs where they run, else levels 1-2)"),
    fp8_gate: float = typer.Option(40.0, "--fp8-gate", help="Lowest PSNR (dB) vs the fp32 decode at which FP8 is kept."),
    fps: Optional[float] = typer.Option(None, "--fps", show_default=False,
                                        help="Frames per second of MP4 output (default 16, Wan's rate)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Decode on N GPUs (spawns N ranks; one large input is "
                                                            "split into bands, many inputs are spread over ranks)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing outputs. An output's name is never "
                                   "followed: a symbolic link there is refused without --overwrite and replaced by "
                                   "the output itself with it (what the link points to is left alone)."),
    max_outputs: int = typer.Option(1000, "--max-outputs", help="Most outputs (images, clips) and tensors one input "
                                     "file may ask for; checked before anything is decoded (a small file can repeat "
                                     "one tensor thousands of times)."),
    max_output_gb: float = typer.Option(64.0, "--max-output-gb", help="Most decoded output one input file may ask "
                                        "for, in GB of 8-bit RGB pixels (4x for .safetensors output); bounds the "
                                        "decode work too. Checked before anything is decoded."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
):
    """Decode latents to PNG / MP4 / frames / safetensors with the optimized pipeline."""
    set_verbosity(verbose, quiet)
    # Argument mistakes first, before torch and diffusers load (seconds): a typo is reported at once.
    if latent_space is not None and latent_space.lower() in ("scaled", "raw"):
        latent_space = latent_space.lower()  # any case: RAW, Scaled
    if latent_space not in (None, "scaled", "raw"):
        raise VaeoptError(f"--latent-space must be 'scaled' or 'raw', got '{latent_space}'")
    fps_given = fps is not None
    fps = 16.0 if fps is None else fps
    if not 0.01 <= fps <= 1000:  # also NaN/inf; an MP4 frame rate is a fraction with a bounded denominator
        raise VaeoptError(f"--fps must be between 0.01 and 1000, got {fps}")
    check_inputs_exist(latents)
    check_model_exists(model)
    check_config_exists(config)
    output, out_folder = output_arg(output)
    check_output_not_an_input(output, out_folder, latents, model)
    opts = Options(device=device, dtype=dtype, channels_last=channels_last, triton=triton, epilogues=epilogues,
                   upsample_conv=upsample_conv, stack_conv3d=stack_conv3d, conv_kernel=conv_kernel, fp8=fp8,
                   gate_db=fp8_gate, graphs=graphs, cudnn_autotune=cudnn_autotune, tiling=tiling, tile=tile, chunk=chunk,
                   vram_budget_gb=vram_budget)
    opts.validate()
    check_dtype_name(dtype)
    check_device_name(device)
    if gpus is not None and gpus < 1:
        raise VaeoptError("--gpus must be at least 1")
    check_limits(max_outputs, max_output_gb)
    if family is not None:
        from vaeopt.families import get_family

        get_family(family)  # a misspelled name: the known ones listed
    if (height is not None or width is not None) and (height is None or width is None or height <= 0 or width <= 0):
        raise VaeoptError(f"--height and --width go together, as positive pixel counts (got {height}, {width})")

    with imports_without_gc():  # torch, Triton and vaeopt's stages: seconds
        from vaeopt import api
        from vaeopt import latents as lat

    if gpus == 1 and (device or "").strip().lower() == "cpu":  # one rank on the CPU: the plain CPU decode
        log("--gpus 1 --device cpu: one CPU decode (--gpus spreads work over GPUs)")
        gpus = None
    if gpus is None:  # before the checkpoint loads (seconds for a full model): a bad --device / --dtype fails now
        from vaeopt import hw

        hw.resolve_dtype(dtype, hw.resolve_device(device))
    if gpus is not None and (height is not None or width is not None):
        raise VaeoptError("--height/--width with --gpus: give the packed latents' image size in the file's metadata "
                          "(\"height\", \"width\") or in vaeopt.json beside it, which every rank reads")
    limits = api.Limits(max_outputs, max_output_gb)
    limits.check()  # (before anything is read)
    if gpus is not None:
        with output_folder(output if out_folder else None):  # removed again if the ranks fail before writing
            _decode_distributed(gpus, latents, model, output, family, config, key, latent_space, overwrite, opts, fps,
                                as_json, fps_given, limits)
        return
    t0 = time.perf_counter()
    files = [lat.read_latents(p, key, manifest_needed=not (model and latent_space), max_tensors=max_outputs)
             for p in latents]
    if height is not None:  # packed token sequences: the image size they were made for (both given: checked above)
        for f in files:
            for e in f.entries + (f.all_entries or []):
                e.size = (height, width)
    report_read(files, latent_space, time.perf_counter() - t0)
    if (output is not None and not out_folder and (output.is_file() or output.is_symlink())
            and sum(len(f.entries) for f in files) == 1):
        outputs.check_writable([output], overwrite)  # one output file named by -o: exists? said now, not after the load
    model_path, why = api.resolve_model(model, files)
    # the latents' own mistakes now, with the lines the checks after the load give, not after seconds of loading
    api.check_latents_early(files, family or (api.manifest_family(files) if why.startswith(lat.MANIFEST) else None))
    # the GPU warmed on a thread: the CUDA context, cuDNN and cuBLAS while diffusers imports, then the Triton kernels
    # this decode loaded last time while the checkpoint loads (told by imports_done); joined before the stages use
    # the GPU. None on a CPU.
    from vaeopt import hw, prewarm

    dev = hw.resolve_device(device)
    kernels_key = prewarm.key(prewarm.source_id(model_path), opts)
    pw = prewarm.start(dev, hw.resolve_dtype(dtype, dev), kernels_key,
                       video=any(e.tensor.dim() == 5 for f in files for e in f.entries), imports_pending=True)
    try:
        _load_and_decode(files, model_path, why, family, config, latent_space, output, out_folder, overwrite, limits,
                         fps, fps_given, chunk, opts, as_json, pw, kernels_key, dev)
    finally:  # (an error in the load: the thread is waited for before the process exits)
        if pw is not None:
            pw.join()


def _load_and_decode(files, model_path, why, family, config, latent_space, output, out_folder, overwrite, limits,
                     fps, fps_given, chunk, opts, as_json, pw, kernels_key, dev) -> None:
    from vaeopt import api, prewarm
    from vaeopt import latents as lat
    from vaeopt.loading import load_vae

    from_manifest = None
    if family is None and why.startswith(lat.MANIFEST):  # the manifest that named the model may name its family too
        family = from_manifest = api.manifest_family(files)
    t0 = time.perf_counter()
    with imports_without_gc():  # diffusers' VAE classes with all they import (seconds), timed apart from the load
        try:
            import diffusers.models.autoencoders  # noqa: F401
        except ImportError as e:  # every load builds a diffusers model: what to install, as one line
            from vaeopt.families import diffusers_missing

            raise diffusers_missing(e) from e
    t_import = time.perf_counter() - t0
    if pw is not None:  # the imports are over: the warm-up thread's Python-heavy part (the kernels) may run now
        pw.imports_done()
    t0 = time.perf_counter()
    loaded = load_vae(model_path, family=family, config=config)
    report_model(loaded, model_path, why, time.perf_counter() - t0, t_import)
    if from_manifest:
        detail(f"(family {from_manifest}: named by {lat.MANIFEST} beside the latents)")
    if any((latent_space or f.default_space) == "scaled" for f in files):  # the factors actually used
        detail(f"scaled latents are unscaled with {loaded.family.describe_scaling()}")
    raw_tiny = loaded.family.config.get("_raw_latents") if loaded.family.cls_name == "AutoencoderTiny" else None
    if raw_tiny and any((latent_space or f.default_space) == "raw" for f in files):
        from vaeopt.families import get_family

        big = get_family(raw_tiny["vae"])
        detail(f"raw latents are the {big.title} VAE's: the tiny decoder takes them scaled with "
               f"{big.describe_scaling()} (as the pipeline hands them over, and as ComfyUI's TAESD does)")
    jobs = api.plan_jobs(files, loaded, output, latent_space, overwrite, out_is_folder=out_folder, log=log,
                         limits=limits)
    if fps_given and not any(j.kind == "mp4" for j in jobs):
        fps_unused(fps)
    if chunk is not None and not loaded.family.is_video:
        log(f"--chunk {chunk} ignored: it sets the latent frames per decoder call of a video VAE, and "
            f"{loaded.family.title} decodes images")
    if pw is not None:  # before the stages: they move the model to the GPU and may launch Triton kernels
        pw.join(log, detail)
    # made after planning; removed again if nothing lands in it. The Triton kernels the decodes load are stored for
    # the next process's warm-up (on a GPU).
    record = prewarm.Record(kernels_key, dev, detail) if dev.type == "cuda" else contextlib.nullcontext()
    with output_folder(output if out_folder else None), record:
        _decode_jobs(loaded, opts, jobs, fps, model_path, as_json)


def clip_words(family, latent_shape, fps: float | None) -> str:
    """A decoded clip in words: '17 frames of 384x256 at 16 fps' (fps: None for a folder of frames)."""
    *_, t, h, w = latent_shape
    f = family.spatial_factor
    return f"{family.output_frames(t)} frames of {w * f}x{h * f}" + (f" at {fps:g} fps" if fps else "")


def _decode_jobs(loaded, opts, jobs, fps, model_path, as_json) -> None:
    from vaeopt import api
    from vaeopt.pipeline import Pipeline

    if printing.level >= 2:
        printing.console.print("[bold]optimize[/]")
    images = [j.z_raw.shape for j in jobs if j.z_raw.dim() == 4]
    if images and opts.fp8 != "off":  # the int8 convs' gate measures at the largest decode (stages/triton_conv)
        opts = dataclasses.replace(opts, decode_shape=(1, *max(images, key=lambda s: s[-2] * s[-1])[1:]))
    pipe = Pipeline(loaded, opts, log=detail, spell=spell_flags)
    if printing.level >= 2:
        printing.console.print("[bold]decode[/]")
    else:
        say(optimizer_summary(pipe.stages, pipe.device, pipe.dtype), markup=False, highlight=False)
    with DecodeProgress() as bar:
        def report(r):  # as each output lands, not after the last one: an error or Ctrl-C later keeps these lines
            bar.restart()
            peak = f", peak VRAM {r.peak_bytes / 2**30:.2f} GiB" if r.peak_bytes else ""
            batch = f" for the batch of {len(r.written)}" if len(r.written) > 1 else ""  # one decode, n files
            took = (f"{r.seconds:.2f} s decode" if printing.level >= 2
                    else f"{plan_words(r.plan)} in {r.seconds:.2f} s")
            if r.job.kind in ("mp4", "frames"):  # what a clip holds, which its name does not say
                took = f"{clip_words(loaded.family, r.job.z_raw.shape, fps if r.job.kind == 'mp4' else None)}; {took}"
            for p in r.written:
                say(f"[bold green]wrote[/] {escape(str(p))}  ({took}{batch}{peak})", highlight=False)
            for msg in r.retries:
                log("↩ " + msg)

        from vaeopt.kernels import triton_cache_entries

        tc0 = triton_cache_entries() if pipe.device.type == "cuda" else None
        results = api.run_jobs(pipe, jobs, fps=fps, progress=bar, on_result=report)
    if tc0 is not None and (tc := triton_cache_entries())[1] > tc0[1]:
        log(f"Triton compiled {tc[1] - tc0[1]} kernels on first use (in the times above; later runs reuse them)")
        detail(f"Triton's cache: {tc[0]}")
    if as_json:
        printing.out_console.print_json(json.dumps({
            "model": str(model_path), "family": loaded.family.name, "layout": loaded.layout,
            "device": str(pipe.device), "dtype": str(pipe.dtype).replace("torch.", ""),
            "stages": [{"name": s.name, "status": s.status, "detail": s.text(spell_flags)} for s in pipe.stages],
            "outputs": [{"source": str(r.job.source), "entry": r.job.entry, "shape": list(r.job.z_raw.shape),
                         "written": [str(p) for p in r.written], "seconds": r.seconds, "peak_bytes": r.peak_bytes,
                         "plan": r.plan, "retries": r.retries} for r in results],
        }))


def _log_stderr(msg: str) -> None:
    """The ranks' log lines (module level: spawned ranks get it pickled)."""
    print(msg, file=sys.stderr, flush=True)


def _decode_distributed(gpus, latents, model, output, family, config, key, latent_space, overwrite, opts, fps,
                        as_json, fps_given=False, limits=None) -> None:
    import torch

    from vaeopt.distributed import DistributedError, decode_files_distributed, launch

    if gpus < 1:
        raise VaeoptError("--gpus must be at least 1")
    n_cuda = torch.cuda.device_count()
    if gpus > n_cuda and "WORLD_SIZE" not in os.environ:  # under torchrun the ranks exist already (gloo on CPU)
        raise VaeoptError(f"--gpus {gpus}: only {n_cuda} CUDA GPU(s) visible" + (
            " (on CPU: torchrun --nproc-per-node N -m vaeopt decode ... --gpus N runs the same code on gloo)" if not n_cuda else ""))
    say(f"[bold]distributed[/] {gpus} ranks ({'NCCL' if n_cuda >= gpus else 'gloo, CPU'}), "
        f"{len(latents)} input file(s)")
    try:
        summary = launch(gpus, decode_files_distributed, [str(p) for p in latents],
                         str(model) if model else None,
                         kwargs=dict(output=output, family=family, config=config, key=key, latent_space=latent_space,
                                     overwrite=overwrite, options=opts, fps=fps, limits=limits, spell=spell_flags,
                                     log=_log_stderr if printing.level >= 2 else None))  # stdout: --json only
    except DistributedError as e:
        raise VaeoptError(str(e).splitlines()[0]) from None
    for r in summary or []:
        for p in r["written"]:
            say(f"[bold green]wrote[/] {escape(str(p))}  (rank {r['rank']}, {r['mode']}, {r['seconds']:.2f} s)",
                highlight=False)
    if fps_given and summary is not None and not any(str(p).lower().endswith(".mp4") for r in summary
                                                     for p in r["written"]):
        fps_unused(fps)
    if as_json and summary is not None:  # under torchrun only rank 0 has the summary: one JSON document
        printing.out_console.print_json(json.dumps({"distributed": gpus, "outputs": summary}, default=str))
