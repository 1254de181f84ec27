"""`vaeopt` command line: info, decode, benchmark. Thin: parses options, logs, and calls vaeopt.api."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import math
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vaeopt import __version__
from vaeopt.errors import OutputError, VaeoptError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")  # its per-call dtype warnings are noise here


def _flags_show_no_type() -> None:
    """typer's rich help prints a flag's type like an option's value (`--overwrite <bool>`, `--help <bool>`), as if
    the flag took one; show nothing there, as plain click help does for flags."""
    import typer.core

    cls = getattr(typer.core, "TyperOption", None)
    orig = getattr(cls, "display_type_rich", None)
    if orig is None or getattr(orig, "_vaeopt_flag", False):
        return

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return orig(self, ctx)

    display_type_rich._vaeopt_flag = True
    cls.display_type_rich = display_type_rich


_flags_show_no_type()

app = typer.Typer(
    help="Fast, memory-aware, fidelity-checked VAE decoding for latent diffusion "
    "(SD 1.x/2.x, SDXL, SD3, FLUX.1/FLUX.2, Wan 2.1/2.2, Qwen-Image, HunyuanVideo 1/1.5, LTX-2, TAESD).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _Stderr:
    """sys.stderr (looked up at each write, as rich does, so that test runners' capture sees it) whose write errors
    are dropped: the log is commentary, and a full or closed stderr (`2>/dev/full`) must not fail a decode whose
    output can still be written."""

    @staticmethod
    def _target():
        f = sys.stderr  # during a progress bar, rich's proxy: write where it writes (no loop back into the bar)
        return getattr(f, "rich_proxied_file", None) or f

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):  # ValueError: a closed file
            self._target().write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._target().flush()

    def __getattr__(self, name):  # isatty, fileno, encoding ... for rich's terminal detection
        if name == "rich_proxied_file":  # so that rich writes through this wrapper, not around it
            raise AttributeError(name)
        return getattr(self._target(), name)


console = Console(file=_Stderr(), highlight=False, soft_wrap=True)  # long paths: let the terminal wrap
# piped or logged (not a terminal): rich would assume 80 columns and cut the benchmark table's cells to "11…"
out_console = Console(highlight=False, width=None if sys.stdout is not None and sys.stdout.isatty() else 200)


def _version_cb(value: bool):
    if value:
        out_console.print(f"vaeopt {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version_cb, is_eager=True,
                                      help="Show the version and exit.")):
    pass


class _Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, unwound like Ctrl-C (temporary outputs removed) but exiting 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupt(signum, frame):
    from vaeopt import cleanup

    cleanup.handled()  # the main thread got here: its watchdog stands down
    raise _Terminated(signum)


def _host_oom(e: BaseException) -> bool:
    """torch on the CPU reports a failed allocation as RuntimeError ("DefaultCPUAllocator: can't allocate memory"),
    not MemoryError."""
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def clean_errors(fn):
    """User errors -> one red line and exit code 2; Ctrl-C -> exit 130; no tracebacks for either."""

    def fail(kw, msg: str, code: int):
        """The error line on stderr; with --json also a JSON document on stdout, so a script reading stdout gets
        one either way."""
        console.print(f"[bold red]error:[/] {escape(msg)}")
        if kw.get("as_json"):
            with contextlib.suppress(OSError, ValueError):
                out_console.print_json(json.dumps({"error": msg, "exit_code": code}))
        raise typer.Exit(code)

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        # kill / docker stop / a closed terminal: unwind like Ctrl-C, so that the temporary outputs are removed
        # (Python's default SIGTERM/SIGHUP handling exits without running any cleanup)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError, AttributeError):  # not the main thread / no SIGHUP
                if signal.getsignal(sig) is not signal.SIG_IGN:  # `nohup` / a supervisor ignoring it: keep that
                    signal.signal(sig, _raise_interrupt)
        from vaeopt import cleanup

        cleanup.exit_promptly_on_signals()  # also inside one long torch op (cleanup's docstring says how)
        try:
            return fn(*a, **kw)
        except VaeoptError as e:
            fail(kw, str(e), e.exit_code)  # (escaped: paths/keys like `[x]` are not markup)
        except KeyboardInterrupt as e:
            console.print("[yellow]interrupted — no partial output was left behind[/]")
            raise typer.Exit(128 + e.signum if isinstance(e, _Terminated) else 130)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as e:  # a bug, not bad input: one line, the traceback only on request
            if _host_oom(e):
                fail(kw, "out of host memory (smaller inputs; a decode also takes --tile / --chunk / --vram-budget)", 3)
            if isinstance(e, OSError) and getattr(e, "filename", None) is None and e.errno == errno.EPIPE:
                # `vaeopt ... | head -1`: the reader has gone; quietly, with rich's exit code for the same case (1)
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
                raise typer.Exit(1)
            if isinstance(e, OSError) and getattr(e, "filename", None) is None and e.errno in (
                    errno.ENOSPC, errno.EBADF):  # printing to a full /dev/full, a closed stdout
                with contextlib.suppress(Exception):
                    console.print(f"[bold red]error:[/] cannot write the output to stdout ({escape(e.strerror or '')})")
                raise typer.Exit(1)
            if os.environ.get("VAEOPT_DEBUG"):
                raise
            first = str(e).splitlines()[0][:300] if str(e) else ""
            fail(kw, f"unexpected {type(e).__name__}: {first} — this is a vaeopt bug; rerun with VAEOPT_DEBUG=1 for "
                     "the traceback and report it", 1)

    return wrapper


# How much a command prints on stderr: 0 = errors only (-q), 1 = a short summary (default), 2 = every stage's line and
# note (-v). Set by each command from its flags; stdout (--json, the benchmark table) is not affected.
_verbosity = 1


def _set_verbosity(verbose: bool, quiet: bool) -> None:
    global _verbosity
    if verbose and quiet:
        raise VaeoptError("-v/--verbose and -q/--quiet contradict each other: give one of them")
    _verbosity = 2 if verbose else 0 if quiet else 1


def _say(text: str, **kw) -> None:
    """A summary line (rich markup): printed unless -q."""
    if _verbosity >= 1:
        console.print(text, **kw)


def _log(msg: str) -> None:
    """A note the user should see (a flag ignored, a tensor skipped, a retry): printed unless -q."""
    if _verbosity >= 1:
        console.print(f"  {msg}", markup=False)


def _detail(msg: str) -> None:
    """A stage line or loading note: printed with -v only."""
    if _verbosity >= 2:
        console.print(f"  {msg}", markup=False)


VERBOSE_HELP = "Print every stage's line and the loading notes."
QUIET_HELP = "Print nothing but errors (the exit code still tells success)."


# ---------------------------------------------------------------------------------------------------- info
@app.command()
@clean_errors
def info(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """GPU, VRAM, versions, capabilities, and what each optimization stage will do here."""
    from vaeopt.info import family_outlook, stage_outlook
    from vaeopt.hw import machine_info

    mi = machine_info()
    outlook = stage_outlook(mi, spell_flags)
    if as_json:
        out_console.print_json(json.dumps({**mi.to_dict(), "stages": outlook, "families": family_outlook()}))
        return
    t = Table(title="vaeopt " + __version__, show_header=False, box=None)
    t.add_row("python", mi.python)
    t.add_row("torch", f"{mi.torch}  (CUDA {mi.cuda or '—'}, cuDNN {mi.cudnn or '—'}, "
                       f"arch list {' '.join(mi.torch_arch_list) or '—'})")
    t.add_row("triton", (mi.triton or "not installed") + ("  [TRITON_INTERPRET=1]" if mi.triton_interpret else ""))
    t.add_row("diffusers", mi.diffusers or "not installed")
    t.add_row("PyAV", mi.pyav or "not installed (no MP4 output)")
    out_console.print(t)
    if not mi.gpus:
        out_console.print("[bold]No CUDA GPU visible.[/] vaeopt runs on the CPU: fp32 decode, whole or tiled, "
                          "chunked video; no CUDA graphs, no FP8 compute (--fp8 weights stores weights in e4m3), Triton "
                          "kernels only under TRITON_INTERPRET=1.")
    for g in mi.gpus:
        out_console.print(
            f"[bold]GPU {g.index}[/]: {g.name}  {g.sm}  {g.multiprocessors} SMs  "
            f"VRAM {g.free_gib:.1f} / {g.total_gib:.1f} GiB free  bf16 {'yes' if g.bf16 else 'no'}  "
            f"FP8 tensor cores {'yes' if g.fp8 else 'no'}  in torch build {'yes' if g.arch_in_build else 'NO'}")
    out_console.print("SDPA backends enabled: " + ", ".join(k for k, v in mi.sdpa_backends.items() if v))
    st = Table(title="Stages on this machine", show_lines=False)
    st.add_column("stage")
    st.add_column("here")
    st.add_column("why / what")
    for s in outlook:
        st.add_row(s["stage"], "[green]runs[/]" if s["runs"] else "[yellow]skipped[/]", s["why"])
    out_console.print(st)
    ft = Table(title="Families", show_lines=False)
    for col in ("family", "title", "latents", "what the stages do"):
        ft.add_column(col)
    for f in family_outlook():
        ft.add_row(f["family"], f"{f['title']} [{f['class']}]", f["latents"], f["stages"])
    out_console.print(ft)


# ---------------------------------------------------------------------------------------------------- decode
@app.command()
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
    _set_verbosity(verbose, quiet)
    # Argument mistakes first, before torch and diffusers load (seconds): a typo is reported at once.
    if latent_space is not None and latent_space.lower() in ("scaled", "raw"):
        latent_space = latent_space.lower()  # any case: RAW, Scaled
    if latent_space not in (None, "scaled", "raw"):
        raise VaeoptError(f"--latent-space must be 'scaled' or 'raw', got '{latent_space}'")
    fps_given = fps is not None
    fps = 16.0 if fps is None else fps
    if not 0.01 <= fps <= 1000:  # also NaN/inf; an MP4 frame rate is a fraction with a bounded denominator
        raise VaeoptError(f"--fps must be between 0.01 and 1000, got {fps}")
    _check_inputs_exist(latents)
    output, out_folder = _output_arg(output)

    from vaeopt import api
    from vaeopt import latents as lat
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options

    opts = Options(device=device, dtype=dtype, channels_last=channels_last, triton=triton, epilogues=epilogues,
                   upsample_conv=upsample_conv, stack_conv3d=stack_conv3d, conv_kernel=conv_kernel, fp8=fp8,
                   gate_db=fp8_gate, graphs=graphs, cudnn_autotune=cudnn_autotune, tiling=tiling, tile=tile, chunk=chunk,
                   vram_budget_gb=vram_budget)
    opts.validate()
    if gpus == 1 and (device or "").strip().lower() == "cpu":  # one rank on the CPU: the plain CPU decode
        _log("--gpus 1 --device cpu: one CPU decode (--gpus spreads work over GPUs)")
        gpus = None
    if gpus is None:  # before the checkpoint loads (seconds for a full model): a bad --device / --dtype fails now
        from vaeopt import hw

        hw.resolve_dtype(dtype, hw.resolve_device(device))
    if gpus is not None and (height is not None or width is not None):
        raise VaeoptError("--height/--width with --gpus: give the packed latents' image size in the file's metadata "
                          "(\"height\", \"width\") or in vaeopt.json beside it, which every rank reads")
    if gpus is not None:
        with _output_folder(output if out_folder else None):  # removed again if the ranks fail before writing
            _decode_distributed(gpus, latents, model, output, family, config, key, latent_space, overwrite, opts, fps,
                                as_json, fps_given)
        return
    t0 = time.perf_counter()
    limits = api.Limits(max_outputs, max_output_gb)
    limits.check()  # (before anything is read)
    files = [lat.read_latents(p, key, manifest_needed=not (model and latent_space), max_tensors=max_outputs)
             for p in latents]
    if height is not None or width is not None:  # packed token sequences: the image size they were made for
        if height is None or width is None or height <= 0 or width <= 0:
            raise VaeoptError(f"--height and --width go together, as positive pixel counts (got {height}, {width})")
        for f in files:
            for e in f.entries + (f.all_entries or []):
                e.size = (height, width)
    _report_read(files, latent_space, time.perf_counter() - t0)
    if (output is not None and not out_folder and (output.is_file() or output.is_symlink())
            and sum(len(f.entries) for f in files) == 1):
        from vaeopt import outputs  # one output file named by -o: an existing one fails now, not after the load

        outputs.check_writable([output], overwrite)
    model_path, why = api.resolve_model(model, files)
    from_manifest = None
    if family is None and why.startswith(lat.MANIFEST):  # the manifest that named the model may name its family too
        family = from_manifest = api.manifest_family(files)
    t0 = time.perf_counter()
    import diffusers  # noqa: F401  (a few seconds on first import; timed apart from reading the checkpoint)

    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = load_vae(model_path, family=family, config=config)
    _report_model(loaded, model_path, why, time.perf_counter() - t0, t_import)
    if from_manifest:
        _detail(f"(family {from_manifest}: named by {lat.MANIFEST} beside the latents)")
    if any((latent_space or f.default_space) == "scaled" for f in files):  # the factors actually used
        _detail(f"scaled latents are unscaled with {loaded.family.describe_scaling()}")
    raw_tiny = loaded.family.config.get("_raw_latents") if loaded.family.cls_name == "AutoencoderTiny" else None
    if raw_tiny and any((latent_space or f.default_space) == "raw" for f in files):
        from vaeopt.families import get_family

        big = get_family(raw_tiny["vae"])
        _detail(f"raw latents are the {big.title} VAE's: the tiny decoder takes them scaled with "
                f"{big.describe_scaling()} (as the pipeline hands them over, and as ComfyUI's TAESD does)")
    jobs = api.plan_jobs(files, loaded, output, latent_space, overwrite, out_is_folder=out_folder, log=_log,
                         limits=limits)
    if fps_given and not any(j.kind == "mp4" for j in jobs):
        _fps_unused(fps)
    if chunk is not None and not loaded.family.is_video:
        _log(f"--chunk {chunk} ignored: it sets the latent frames per decoder call of a video VAE, and "
             f"{loaded.family.title} decodes images")
    with _output_folder(output if out_folder else None):  # made after planning; removed again if nothing lands in it
        _decode_jobs(loaded, opts, jobs, fps, model_path, as_json)


def _check_inputs_exist(latents: List[Path]) -> None:
    """A missing latent file, said before torch loads (vaeopt.latents.read_latents checks the rest)."""
    for p in latents:
        if not p.exists():
            raise VaeoptError(f"{p}: " + ("a broken or looping symlink" if p.is_symlink() else "no such file"))


def _shape(t) -> str:
    return "x".join(map(str, t.shape))


def _report_read(files, latent_space, seconds: float) -> None:
    """What was read: one line (each file's tensors in -v)."""
    if _verbosity >= 2:
        console.print(f"[bold]read[/] {len(files)} latent file(s) in {seconds:.2f} s")
        names = [f.path.name for f in files]
        for f in files:
            space = f"{f.format}, {latent_space or f.default_space} latents"
            name = f.path if names.count(f.path.name) > 1 else f.path.name  # a/lat.pt, b/lat.pt: which is which
            shown = lambda e: f"{tuple(e.tensor.shape)} {str(e.tensor.dtype).replace('torch.', '')}"  # noqa: E731
            if len(f.entries) == 1:
                e = f.entries[0]
                console.print(f"  {name}{'[' + e.name + ']' if e.name else ''}: {shown(e)} ({space})", markup=False)
            else:  # which of them are latents is known once the VAE is (the others are skipped with a reason then)
                console.print(f"  {name}: {len(f.entries)} tensors ({space} where they fit the VAE)", markup=False)
                for e in f.entries:
                    console.print(f"    [{e.name}]: {shown(e)}", markup=False)
    spaces = "/".join(sorted({latent_space or f.default_space for f in files}))
    if len(files) == 1:
        f = files[0]
        what = ", ".join(f"{e.name + ' ' if e.name else ''}{_shape(e.tensor)}" for e in f.entries)
        if len(what) > 60:
            what = f"{len(f.entries)} tensors"
        line = f"read {f.path.name}: {what} ({spaces} latents)"
    else:
        n = sum(len(f.entries) for f in files)
        line = f"read {len(files)} latent files, {n} tensor(s) ({spaces} latents)"
    if _verbosity == 1:
        console.print(line, markup=False, highlight=False)
    for f in files:
        for n in f.notes:
            _log(n)


def _report_model(loaded, model_path, why: str, seconds: float, t_import: float) -> None:
    """The model: one line; the loading notes in -v (a guessed family in short without it)."""
    from vaeopt.loading import Notice

    fam = loaded.family
    if _verbosity >= 2:
        console.print(f"[bold]load[/] {escape(str(model_path))} ({escape(why)}) in {seconds:.2f} s "
                      f"(+{t_import:.1f} s importing diffusers): {fam.title} [{fam.cls_name}], layout {loaded.layout}",
                      highlight=False)
        for n in loaded.notes:
            _detail(n)
        return
    _say(f"model {Path(model_path).name}: {fam.title} ({fam.cls_name}), loaded in {seconds:.1f} s",
         markup=False, highlight=False)
    for n in loaded.notes:
        if isinstance(n, Notice):
            _log(n.short)


# What the one-line optimizer summary calls each stage.
_STAGE_WORDS = {"fp8": "FP8", "fp8 convs": "FP8 convs", "channels_last": "channels_last", "fused_norms": "fused norms",
                "fused_epilogues": "fused epilogues", "upsample_conv": "upsample convs", "triton_conv": "Triton convs",
                "stacked_conv3d": "stacked Conv3d", "attention": "attention", "graphs": "CUDA graphs",
                "cudnn_autotune": "cuDNN autotuning"}


_DTYPE_WORDS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # as --dtype spells them

# The stages' lines suggest settings as Hint groups (Options fields); `vaeopt decode` names them by its flags.
_FLAG_OF = {"gate_db": "fp8-gate", "vram_budget_gb": "vram-budget"}  # Options fields whose flag is named otherwise


def _flags(group) -> list[tuple[str, str]]:
    return [(_FLAG_OF.get(h.option, h.option.replace("_", "-")), "" if h.value is None else f"{h.value}")
            for h in group]


def spell_flags(group) -> str:
    """A hint group as `vaeopt decode`'s flags: `--triton on --conv-kernel on`."""
    return " ".join(f"--{n}" + (f" {v}" if v else "") for n, v in _flags(group))


_BENCH_FLAGS = ("dtype", "device", "fp8-gate")  # `vaeopt benchmark`'s own, spelled as decode's
_BENCH_SWITCHES = ("fp8", "cudnn-autotune")  # its on/off flags, which take no value


def spell_benchmark_flags(group) -> str:
    """A hint group as `vaeopt benchmark` can act on it: its own flags; a setting of "off" as what the ladder row
    set (an "off" there is the row's, not the user's doing); else as `vaeopt decode ...`."""
    flags = _flags(group)
    if all(n in _BENCH_FLAGS or (n in _BENCH_SWITCHES and v in ("", "on", "auto")) for n, v in flags):
        return " ".join(f"--{n}" + (f" {v}" if v and n not in _BENCH_SWITCHES else "") for n, v in flags)
    if all(v == "off" for _, v in flags):
        return ", ".join(f"{n} off" for n, _ in flags) + " in this ladder row"
    return f"`vaeopt decode {spell_flags(group)}`"


def optimizer_summary(stages, device, dtype) -> str:
    """One line for what the optimizer did in this run: the stages applied, or that the plain path ran and why."""
    dt = str(dtype).replace("torch.", "")
    where = f"{_DTYPE_WORDS.get(dt, dt)}, {'CPU' if device.type == 'cpu' else device}"
    applied = [_STAGE_WORDS.get(s.name, s.name) for s in stages if s.status == "applied" and s.name != "precision"]
    fell = [_STAGE_WORDS.get(s.name, s.name) for s in stages if s.status == "fallback"]
    skipped = [s for s in stages if s.status == "skipped"]
    extra = f"; fell back: {', '.join(fell)}" if fell else ""
    if applied:
        if device.type != "cuda" and skipped:
            extra += "; the GPU kernels need CUDA"
        tail = f" ({where}{extra}; -v for details)"

        def fits(ns):
            return len("optimized: " + ", ".join(ns) + tail) <= 104  # (~100: a terminal's width with room)

        names = applied
        if not fits(names):  # one short line: the first stages, and how many more (-v lists them all)
            k = len(applied) - 1
            while k > 1 and not fits(applied[:k] + [f"+{len(applied) - k} more"]):
                k -= 1
            names = applied[:k] + [f"+{len(applied) - k} more"]
        return "optimized: " + ", ".join(names) + tail
    if skipped and all(s.detail == "off" for s in skipped):
        why = "every stage switched off"
    elif device.type != "cuda":
        why = "the GPU kernels need CUDA"
    else:
        why = "no stage applies to this model"
    return f"plain diffusers decode ({where}): {why}{extra} (-v for details)"


def _plan_words(plan: dict) -> str:
    """A decode plan in a few words: whole, tiled, chunks."""
    if plan.get("mode") == "whole":
        return "whole decode"
    tile, chunk = plan.get("tile"), plan.get("chunk")
    if isinstance(tile, (list, tuple)):
        tile = "x".join(map(str, tile))
    parts = []
    if chunk:
        parts.append(f"chunks of {chunk} latent frame{'s' if chunk != 1 else ''}")
    if tile:
        parts.append(f"tiles of {tile} latent px" if not isinstance(tile, str) else f"{tile} tiles")
    return ", ".join(parts) or str(plan.get("mode"))


class _DecodeProgress:
    """A rich progress bar for a decode that has run over SHOW_AFTER_S seconds (tiles, or frames and frames/s);
    only on a terminal and not with -q: a log or a pipe gets the summary lines alone."""

    SHOW_AFTER_S = 2.0

    def __init__(self):
        self.enabled = _verbosity >= 1 and console.is_terminal
        self.prog = None
        self.task = None
        self.job = None
        self.t0 = time.perf_counter()

    def restart(self) -> None:  # after each output: the next decode's time counts from here
        self._stop()
        self.t0 = time.perf_counter()
        self.job = None

    def __call__(self, job, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.prog is None:
            if now - self.t0 < self.SHOW_AFTER_S or done >= total:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.prog = Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console,
                                 transient=True)
            self.prog.start()
        if job is not self.job:
            self.job = job
            video = job.z_raw.dim() == 5
            unit = "frames" if video else "tiles"  # (tiles of every pass: the stats pass too)
            name = job.source.name + (f"[{job.entry}]" if job.entry else "")
            self.task = self.prog.add_task(f"{name} {unit}", total=total, rate="")
            self.job_t0 = self.t0
        rate = done / max(now - self.job_t0, 1e-9)
        self.prog.update(self.task, completed=done, total=total,
                         rate=f"{rate:.1f} frames/s" if job.z_raw.dim() == 5 else f"{rate:.1f} tiles/s")

    def _stop(self) -> None:
        if self.prog is not None:
            self.prog.stop()
            self.prog = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop()


def _decode_jobs(loaded, opts, jobs, fps, model_path, as_json) -> None:
    from vaeopt import api
    from vaeopt.pipeline import Pipeline

    if _verbosity >= 2:
        console.print("[bold]optimize[/]")
    images = [j.z_raw.shape for j in jobs if j.z_raw.dim() == 4]
    if images and opts.fp8 != "off":  # the int8 convs' gate measures at the largest decode (stages/triton_conv)
        opts = dataclasses.replace(opts, decode_shape=(1, *max(images, key=lambda s: s[-2] * s[-1])[1:]))
    pipe = Pipeline(loaded, opts, log=_detail, spell=spell_flags)
    if _verbosity >= 2:
        console.print("[bold]decode[/]")
    else:
        _say(optimizer_summary(pipe.stages, pipe.device, pipe.dtype), markup=False, highlight=False)
    with _DecodeProgress() as bar:
        def report(r):  # as each output lands, not after the last one: an error or Ctrl-C later keeps these lines
            bar.restart()
            peak = f", peak VRAM {r.peak_bytes / 2**30:.2f} GiB" if r.peak_bytes else ""
            batch = f" for the batch of {len(r.written)}" if len(r.written) > 1 else ""  # one decode, n files
            took = (f"{r.seconds:.2f} s decode" if _verbosity >= 2 else f"{_plan_words(r.plan)} in {r.seconds:.2f} s")
            for p in r.written:
                _say(f"[bold green]wrote[/] {escape(str(p))}  ({took}{batch}{peak})", highlight=False)
            for msg in r.retries:
                _log("↩ " + msg)

        from vaeopt.kernels import triton_cache_entries

        tc0 = triton_cache_entries() if pipe.device.type == "cuda" else None
        results = api.run_jobs(pipe, jobs, fps=fps, progress=bar, on_result=report)
    if tc0 is not None and (tc := triton_cache_entries())[1] > tc0[1]:
        _log(f"Triton compiled {tc[1] - tc0[1]} kernels on first use (in the times above; later runs reuse them)")
        _detail(f"Triton's cache: {tc[0]}")
    if as_json:
        out_console.print_json(json.dumps({
            "model": str(model_path), "family": loaded.family.name, "layout": loaded.layout,
            "device": str(pipe.device), "dtype": str(pipe.dtype).replace("torch.", ""),
            "stages": [{"name": s.name, "status": s.status, "detail": s.text(spell_flags)} for s in pipe.stages],
            "outputs": [{"source": str(r.job.source), "entry": r.job.entry, "shape": list(r.job.z_raw.shape),
                         "written": [str(p) for p in r.written], "seconds": r.seconds, "peak_bytes": r.peak_bytes,
                         "plan": r.plan, "retries": r.retries} for r in results],
        }))


def _output_arg(output: str | None) -> tuple[Path | None, bool]:
    """-o as typed -> (path, is a folder). A trailing separator means a folder whatever the name looks like
    ("renders/2024.06.01/", "renders/run.safetensors/"); Path() drops it, so it is read from the text."""
    if output is None:
        return None, False
    if not output.strip():
        raise OutputError("-o is empty: name a file or a folder")
    if output.strip() == "-":  # (it would make a folder named '-')
        raise OutputError("-o -: writing to stdout is not supported; give a file (out.png, out.mp4, out.safetensors) "
                          "or a folder (out/)")
    try:
        path = Path(output).expanduser()  # as --model is; a quoted '~/x.png' would otherwise make a folder named '~'
        path.is_dir()
    except (OSError, RuntimeError) as e:  # a name too long for the file system, a symlink loop, '~nosuchuser'
        raise OutputError(f"-o {output}: not a usable path ({getattr(e, 'strerror', None) or e})") from None
    folder = output.endswith(("/", os.sep))
    if folder and path.exists() and not path.is_dir():
        raise OutputError(f"-o {output}: the trailing '/' asks for a folder, but {path} is a file; choose another "
                          "-o (nothing was written)")
    from vaeopt import outputs

    if not folder and not path.is_dir() and path.name.endswith(".") and path.name != "..":
        # 'out.png.' has no suffix, so it would silently become a folder named so
        raise OutputError(f"-o {output}: the name ends in '.', likely a typo; name a .png/.mp4/.safetensors file, or "
                          f"a folder with a trailing '/' ({output}/) if that is the name you want")
    if not folder and path.suffix == "" and path.is_file():  # before "exists, pass --overwrite", which would not help
        raise OutputError(f"-o {output}: a name without a suffix is a folder output, but {path} is a file, which "
                          "--overwrite does not replace with a folder; name a .png/.mp4/.safetensors file, or "
                          "another folder (nothing was written)")
    if not folder and not path.is_dir() and path.suffix and path.suffix.lower() not in outputs.OUTPUT_SUFFIXES:
        # before the checkpoint loads (the same check runs again when the outputs are planned)
        raise OutputError(outputs.unknown_type(f"-o {output}", path.suffix))
    if not folder and not path.is_dir() and path.name.lower() in outputs.OUTPUT_SUFFIXES:  # a hidden folder, else
        raise OutputError(f"-o {output}: a suffix alone is not a file name; name the file "
                          f"({path.with_name('out' + path.name)}), or leave -o out to write each output beside its input")
    outputs.check_output_folder(path, folder, f"-o {output}")  # /proc, a read-only folder: now, not after the decode
    return path, folder


@contextlib.contextmanager
def _output_folder(path: Path | None):
    """Make the -o folder (a trailing '/'); if the decode then fails or is interrupted and the folder it made is still
    empty, remove it, so that "nothing was left behind" holds."""
    made = []  # the folders mkdir makes, innermost first (-o new/newer/ makes both)
    if path is not None:
        p = path
        while not p.exists() and not p.is_symlink() and p != p.parent:
            made.append(p)
            p = p.parent
        _make_output_folder(path)
        from vaeopt import cleanup

        cleanup.add_folders(made)  # (removed if still empty when a signal must end the process at once)
    try:
        yield
    except BaseException:
        for p in made:
            try:
                p.rmdir()  # only if empty
            except OSError:
                break
        raise


def _make_output_folder(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{path}/: cannot create the output folder ({e.strerror or e})") from None


# ---------------------------------------------------------------------------------------------------- benchmark
# vaeopt.benchmark.WORKLOADS' names, here without importing torch for --help (a test keeps the two equal)
WORKLOAD_NAMES = ("sdxl-1024", "sdxl-2048", "sdxl-4096", "flux-1024", "sd15-512", "wan21-480p", "wan21-720p",
                  "wan22-720p", "hunyuan-480p", "taesd-1024", "flux2-1024", "qwenimage-1328", "hunyuan15-480p",
                  "ltx2-768")


@app.command()
@clean_errors
def benchmark(
    model: Optional[Path] = typer.Argument(None, help="VAE checkpoint to benchmark (or use --family for random weights)."),
    family: Optional[str] = typer.Option(None, "--family", help="Build this family's full-size architecture with random "
                                                                "weights (sdxl, flux, wan21, wan22, ...)."),
    workload: Optional[str] = typer.Option(None, "--workload", "-w", help="Standard workload; implies its family "
                                           "(random weights) unless a checkpoint or --family is given: " + ", ".join(
        WORKLOAD_NAMES) + "."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Raw latent shape N,C,[T,]H,W (instead of --workload)."),
    peers: str = typer.Option("bf16,tiling", "--peers", help="Comma list of peers: bf16, tiling, compile (fp32 always "
                                                             "runs: it is the fidelity reference)."),
    dtype: str = typer.Option("auto", "--dtype", help="Precision of the peers and the ladder: auto | fp32 | bf16 | "
                                                      "fp16 (auto: bf16 on GPUs that have it, fp32 on CPU)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:1, cpu (default: cuda if available)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", show_default=False,
                                          help="Timed repeats per row, median reported (default 5; 3 on the CPU, "
                                               "where each decode takes seconds)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs per row."),
    fp8: bool = typer.Option(False, "--fp8", help="Include FP8 in the ladder, and measure its three levels each "
                                                  "on its own after it (weight storage, fp8 GEMMs, 8-bit convs)."),
    fp8_gate: float = typer.Option(40.0, "--fp8-gate", help="FP8 fidelity gate (dB PSNR vs fp32) used by the ladder."),
    cudnn_autotune: bool = typer.Option(False, "--cudnn-autotune", help="cuDNN autotuning on for every row, peers "
                                                                        "included (each row's warm-up pays the tuning)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write all numbers to this JSON file."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG chart: time, speedup and PSNR per "
                                                                 "row, the rows not timed (needs matplotlib: "
                                                                 "the package's plot extra, or pip install "
                                                                 "matplotlib)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print each row as it starts and every skip reason "
                                                                "in full."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors; the results go to --json / "
                                                            "--plot."),
):
    """Measured ladder: peers (diffusers fp32/bf16/tiling/compile) and each vaeopt stage on top of the last.

    A quick CPU run: vaeopt benchmark samples/tiny_kl_image.safetensors (a 256x256 decode, under a minute)."""
    _set_verbosity(verbose, quiet)
    from vaeopt import benchmark as bm
    from vaeopt.hw import resolve_device, resolve_dtype

    if plot_out is not None and not bm.plot_available():  # before minutes of measuring, not after
        raise VaeoptError(bm.PLOT_MISSING)

    if repeats is not None and repeats < 1:
        raise VaeoptError(f"--repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise VaeoptError(f"--warmup must be 0 or more, got {warmup}")
    if not 0 <= fp8_gate < float("inf"):
        raise VaeoptError(f"--fp8-gate must be a PSNR in dB, 0 or more, got {fp8_gate}")
    # '--json=~/r.json': the shell leaves a '~' after '=' as it is; decode's -o and --model expand it, so do these
    from vaeopt.loading import expand_user  # ('~nosuchuser/r.json': one clear line, not an internal error)

    json_out, plot_out = (expand_user(p, flag) if p is not None else None
                          for p, flag in ((json_out, "--json"), (plot_out, "--plot")))
    _check_bench_outputs(model, json_out, plot_out)  # before minutes of measuring, not after
    peer_list = tuple(p.strip() for p in peers.split(",") if p.strip())
    bad = [p for p in peer_list if p not in bm.PEERS]
    if bad:  # (before the checkpoint loads)
        raise VaeoptError(f"--peers: unknown {', '.join(bad)} (choose from {', '.join(bm.PEERS)})")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if repeats is None:
        repeats = 5 if dev.type == "cuda" else 3
    spec, sd, shp, wl, notes = _bench_inputs(model, family, workload, shape, dev)
    for n in notes:
        _detail(n)
    where = torch_device_name(dev)
    _say(f"[bold]benchmark[/] {wl or spec.name} latent {shp} {str(dt).replace('torch.', '')} on {where}"
         + ("  [yellow](CPU numbers: not GPU performance)[/]" if dev.type != "cuda" else ""))
    if dev.type != "cuda" and math.prod(shp[2:]) > 64 * 64:
        _say(f"  [yellow]a {'x'.join(map(str, shp[2:]))} latent on the CPU: each decode takes a minute or "
                      f"more, and the ladder runs {repeats + warmup} per row (Ctrl-C stops it; --shape "
                      f"1,{shp[1]},{'1,' if len(shp) == 5 else ''}32,32 is a quick CPU run)[/]")
    result = bm.run_benchmark(spec, sd, shp, device=dev, dtype=dt, peers=peer_list, repeats=repeats, warmup=warmup,
                              fp8=fp8, gate_db=fp8_gate, autotune=cudnn_autotune, log=_log, detail=_detail, spell=spell_benchmark_flags,
                              workload=wl, command=" ".join(["vaeopt"] + sys.argv[1:]))
    if _verbosity >= 1:  # -q: the results are in --json / --plot
        _print_bench(result)
    if json_out:
        from vaeopt.outputs import atomic_path

        replaced = _replacing(json_out)
        with atomic_path(json_out) as tmp:
            tmp.write_text(json.dumps(result, indent=1))
        _say(f"[bold green]wrote[/] {escape(str(json_out))}{replaced}")
    if plot_out:
        replaced = _replacing(plot_out)
        bm.plot(result, plot_out)
        _say(f"[bold green]wrote[/] {escape(str(plot_out))}{replaced}")


def _replacing(p: Path) -> str:
    """benchmark's --json/--plot replace an existing .json/.png (a re-run updates its results): said so."""
    return " (replaced the file that was there)" if p.exists() else ""


def _log_stderr(msg: str) -> None:
    """The ranks' log lines (module level: spawned ranks get it pickled)."""
    print(msg, file=sys.stderr, flush=True)


def _check_bench_outputs(model, json_out, plot_out) -> None:
    from vaeopt.outputs import check_writable

    outs = [p for p in (json_out, plot_out) if p is not None]
    if plot_out is not None and plot_out.suffix.lower() != ".png":
        raise VaeoptError(f"--plot {plot_out}: the chart is a PNG; give a .png file name")
    if json_out is not None and plot_out is not None and json_out.resolve() == plot_out.resolve():
        raise VaeoptError(f"--json and --plot name the same file {json_out}")
    for p in outs:
        if model is not None and p.resolve() == Path(model).resolve():
            raise VaeoptError(f"{p}: would overwrite the model being benchmarked; choose another path")
        if p.is_dir():
            raise VaeoptError(f"{p}: is a folder; give a file name")
    if json_out is not None and json_out.suffix.lower() != ".json":  # it replaces an existing file: only a .json one
        raise VaeoptError(f"--json {json_out}: the results are a JSON file; give a .json file name")
    from vaeopt.benchmark import is_own_output

    for p, flag in ((json_out, "--json"), (plot_out, "--plot")):
        # a re-run replaces its own results; never a model's config.json, a vaeopt.json manifest or a picture
        if p is not None and p.exists() and not p.is_dir() and not is_own_output(p):
            raise VaeoptError(f"{flag} {p}: exists and is not a vaeopt benchmark {'result' if flag == '--json' else 'chart'}"
                              "; it is kept: choose another file name" + (
                                  " (a chart from a vaeopt before 2026-11-22 carries no tag: remove it)"
                                  if flag == "--plot" else ""))
    check_writable(outs, overwrite=True)


def torch_device_name(dev) -> str:
    import torch

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"


def _bench_inputs(model, family, workload, shape, dev):
    import torch

    from vaeopt import benchmark as bm
    from vaeopt.families import build_model, get_family

    notes = []
    wl = shp = None
    if workload:
        if workload not in bm.WORKLOADS:
            raise VaeoptError(f"unknown workload '{workload}' (known: {', '.join(bm.WORKLOADS)})")
        wl = workload
        wl_family, shp = bm.WORKLOADS[workload]
        family = family or (None if model else wl_family)
    if shape:
        try:
            shp = tuple(int(s) for s in shape.replace("x", ",").split(","))
        except ValueError:
            raise VaeoptError(f"--shape '{shape}': expected integers like 1,4,128,128") from None
    if shp is not None and any(d < 1 for d in shp):
        raise VaeoptError(f"--shape {','.join(map(str, shp))}: every dimension must be at least 1")
    if model is not None:
        from vaeopt.loading import load_vae

        loaded = load_vae(model, family=family)
        spec, sd = loaded.family, {k: v.float() for k, v in loaded.model.state_dict().items()}
        notes += loaded.notes
    elif family:
        spec = get_family(family)
        torch.manual_seed(0)
        sd = build_model(spec).state_dict()
        notes.append(f"{spec.title}: full-size architecture with random weights (timing equals real weights)")
    else:
        raise VaeoptError("give a checkpoint, --family or --workload")
    if shp is None:
        shp, wl, why = bm.default_shape(spec, dev)
        notes.append(f"no --workload/--shape: latent {shp}, {why} (--shape N,C,[T,]H,W for another)")
    if wl is not None and (shape or bm.WORKLOADS[wl][0] != spec.name):
        notes.append(f"not the {wl} workload: " + ("--shape given" if shape else f"the model is {spec.title}"))
        wl = None  # the JSON and the table name what was measured
    want = 5 if spec.is_video else 4
    if len(shp) != want or shp[1] != spec.latent_channels:
        raise VaeoptError(f"latent shape {shp} does not fit {spec.title}: expected {want} dims with "
                          f"{spec.latent_channels} channels")
    from vaeopt.latents import MAX_OUTPUT_PIXELS

    f = spec.spatial_factor
    if shp[-2] * shp[-1] * f * f > MAX_OUTPUT_PIXELS or shp[0] > 256 or (spec.is_video and shp[2] > 1024):
        raise VaeoptError(f"--shape {','.join(map(str, shp))}: beyond what the benchmark runs (at most "
                          f"{int(MAX_OUTPUT_PIXELS ** 0.5)}² pixels per frame, as decode; a batch of 256; 1024 latent "
                          "frames)")
    return spec, sd, shp, wl, notes


def _print_bench(result: dict) -> None:
    from vaeopt.fidelity import psnr_text

    title = (f"{result.get('workload') or result['family']} {tuple(result['latent_shape'])} {result['dtype']} "
             f"on {result.get('gpu') or 'CPU (CPU numbers)'}")
    f = lambda v, fmt: (fmt.format(v) if v is not None else "-")  # noqa: E731
    cols = ("row", "ms", "min-max", "GiB", "TFLOP/s", "PSNR", "max err", "speedup")
    cells, skipped = [], []
    for r in result["rows"]:
        if r["status"] != "ok":
            skipped.append(r)
            continue
        psnr = "ref" if r["kind"] == "reference" else psnr_text(r["psnr_db"], "")
        cells.append((r["name"][:36], f(r["median_ms"], "{:.1f}"), f"{r['min_ms']:.1f}-{r['max_ms']:.1f}",
                      f(r["peak_alloc_gib"], "{:.2f}"),
                      f(r["tflops"], "{:.0f}" if (r["tflops"] or 0) >= 10 else "{:.2g}"), psnr,
                      f(r["max_abs"], "{:.3f}"), f(r.get("speedup_vs_baseline", r["speedup_vs_diffusers_bf16"]),
                                                   "{:.2f}x")))
    # A narrow terminal drops the least needed columns rather than cutting every number short; the row names fold.
    width = out_console.width
    need = {c: max([len(c)] + [len(row[i]) for row in cells]) + 3 for i, c in enumerate(cols)}
    shown = list(cols)
    for c in ("min-max", "TFLOP/s", "max err", "GiB"):
        if sum(need[k] for k in shown if k != "row") + 16 <= width:
            break
        shown.remove(c)
    t = Table(title=title, title_justify="left")
    for c in shown:
        if c == "row":
            t.add_column(c, justify="left", overflow="fold", min_width=12)
        else:
            t.add_column(c, justify="right", no_wrap=True, min_width=need[c] - 3)
    for row in cells:
        t.add_row(*(v for c, v in zip(cols, row) if c in shown))
    if len(shown) < len(cols):
        t.caption = f"({', '.join(c for c in cols if c not in shown)}: in a wider terminal, or --json)"
    out_console.print(t)
    out_console.print(f"PSNR/max err vs the fp32 diffusers decode; speedup vs '{result.get('speedup_baseline')}'"
                      + (f"; bf16 matmul here {result['matmul_tflops']:.0f} TFLOP/s"
                         if result.get("matmul_tflops") else ""), style="dim")
    from vaeopt.benchmark import clock_note, level_lines

    if note := clock_note(result["rows"]):
        out_console.print(note, style="dim", highlight=False)
    for r in skipped:  # the reasons in full with -v (and in --json)
        why = r["reason"] if _verbosity >= 2 else textwrap.shorten(r["reason"], max(40, 96 - len(r["name"])),
                                                                    placeholder=" ...")
        out_console.print(f"  [yellow]{r['status']}[/] {escape(r['name'])}: {escape(why)}", highlight=False)
    for line in level_lines(result.get("fp8_levels") or []):
        out_console.print(line, highlight=False)


def _fps_unused(fps: float) -> None:
    _log(f"--fps {fps:g} ignored: it sets the frame rate of MP4 output, and nothing here is written as MP4")


def _decode_distributed(gpus, latents, model, output, family, config, key, latent_space, overwrite, opts, fps,
                        as_json, fps_given=False) -> None:
    import torch

    from vaeopt.distributed import DistributedError, decode_files_distributed, launch

    if gpus < 1:
        raise VaeoptError("--gpus must be at least 1")
    n_cuda = torch.cuda.device_count()
    if gpus > n_cuda and "WORLD_SIZE" not in os.environ:  # under torchrun the ranks exist already (gloo on CPU)
        raise VaeoptError(f"--gpus {gpus}: only {n_cuda} CUDA GPU(s) visible" + (
            " (on CPU: torchrun --nproc-per-node N -m vaeopt decode ... --gpus N runs the same code on gloo)" if not n_cuda else ""))
    _say(f"[bold]distributed[/] {gpus} ranks ({'NCCL' if n_cuda >= gpus else 'gloo, CPU'}), "
                  f"{len(latents)} input file(s)")
    try:
        summary = launch(gpus, decode_files_distributed, [str(p) for p in latents],
                         str(model) if model else None,
                         kwargs=dict(output=output, family=family, config=config, key=key, latent_space=latent_space,
                                     overwrite=overwrite, options=opts, fps=fps, spell=spell_flags,
                                     log=_log_stderr if _verbosity >= 2 else None))  # stdout: --json only
    except DistributedError as e:
        raise VaeoptError(str(e).splitlines()[0]) from None
    for r in summary or []:
        for p in r["written"]:
            _say(f"[bold green]wrote[/] {escape(str(p))}  (rank {r['rank']}, {r['mode']}, {r['seconds']:.2f} s)",
                 highlight=False)
    if fps_given and summary is not None and not any(str(p).lower().endswith(".mp4") for r in summary
                                                      for p in r["written"]):
        _fps_unused(fps)
    if as_json and summary is not None:  # under torchrun only rank 0 has the summary: one JSON document
        out_console.print_json(json.dumps({"distributed": gpus, "outputs": summary}, default=str))


# ---------------------------------------------------------------------------------------------------- serve
@app.command()
@clean_errors
def serve(
    model: List[str] = typer.Option(..., "--model", "-m", help="VAE checkpoint to serve at http://HOST:PORT/, or "
                                    "NAME=PATH (repeatable) to serve each at /NAME."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; any but loopback needs a token."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: a free one)."),
    token: Optional[str] = typer.Option(None, "--token", envvar="VAEOPT_TOKEN", show_envvar=True,
                                        help="Require Authorization: Bearer TOKEN on every request (prefer the "
                                             "environment variable: the command line shows in `ps`)."),
    device: Optional[str] = typer.Option(None, "--device", help="One device to serve on (cpu, cuda:1)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="One worker on each of the first N GPUs (default: all "
                                                            "visible GPUs, else the CPU)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto | fp32 | bf16 | fp16."),
    queue: int = typer.Option(64, "--queue", help="Requests waiting per worker before 503 + Retry-After."),
    batch: int = typer.Option(1, "--batch", help="Decode up to N queued same-shape image latents as one batch."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds per request (body, queue, decode, encoding)."),
    body_timeout: float = typer.Option(30.0, "--body-timeout", help="Seconds to receive a request's body."),
    max_body_mb: float = typer.Option(256.0, "--max-body-mb", help="Largest latents accepted per request (MiB)."),
    max_megapixels: float = typer.Option(128.0, "--max-megapixels", help="Largest output per request (Mi pixels, "
                                                                        "all frames and images)."),
    jpeg_quality: int = typer.Option(95, "--jpeg-quality", help="Quality of image_format=jpg answers."),
    log_level: str = typer.Option("info", "--log-level", help="debug (one line per request) | info | warning."),
):
    """Serve decodes over HTTP to diffusers' remote_decode client (needs starlette and uvicorn: the 'serve' extra)."""
    from vaeopt.server import serve as run_server

    run_server(model, host=host, port=port, token=token, device=device, gpus=gpus, dtype=dtype, max_queue=queue,
               batch=batch, timeout_s=timeout, body_timeout_s=body_timeout, max_body_mb=max_body_mb,
               max_megapixels=max_megapixels, jpeg_quality=jpeg_quality, log_level=log_level)


def run():  # console-script entry
    app()


if __name__ == "__main__":
    sys.exit(app())
