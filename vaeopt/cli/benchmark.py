"""`vaeopt benchmark`: the measured ladder of peers and stages, printed as a table, and written as JSON / a chart."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from vaeopt.cli import printing
from vaeopt.cli.report import spell_benchmark_flags
from vaeopt.cli.exits import clean_errors
from vaeopt.cli.printing import detail, log, say, set_verbosity
from vaeopt.errors import VaeoptError
from vaeopt.options import check_device_name, check_dtype_name, parse_shape
from vaeopt.outputs import atomic_path, check_writable


# vaeopt.benchmark.WORKLOADS' names, here without importing torch for --help (a test keeps the two equal)
WORKLOAD_NAMES = ("sdxl-1024", "sdxl-2048", "sdxl-4096", "flux-1024", "sd15-512", "wan21-480p", "wan21-720p",
                  "wan22-720p", "hunyuan-480p", "taesd-1024", "flux2-1024", "qwenimage-1328", "hunyuan15-480p",
                  "ltx2-768")
PEER_NAMES = ("fp32", "bf16", "tiling", "compile")  # vaeopt.benchmark.PEERS, likewise


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
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs per row. 0: the first timed run of each "
                                                   "row is reported on its own as cold (it pays one-time compiles and "
                                                   "allocations) and left out of the median when --repeats >= 2."),
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

    A quick CPU run: vaeopt benchmark samples/tiny_kl_image.safetensors --shape 1,4,16,16 (a 128x128 decode)."""
    set_verbosity(verbose, quiet)
    # argument mistakes first, before torch loads (seconds)
    if repeats is not None and repeats < 1:
        raise VaeoptError(f"--repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise VaeoptError(f"--warmup must be 0 or more, got {warmup}")
    if not 0 <= fp8_gate < float("inf"):
        raise VaeoptError(f"--fp8-gate must be a PSNR in dB, 0 or more, got {fp8_gate}")
    check_dtype_name(dtype)
    check_device_name(device)
    if workload and workload not in WORKLOAD_NAMES:
        raise VaeoptError(f"unknown workload '{workload}' (known: {', '.join(WORKLOAD_NAMES)})")
    if shape:
        parse_shape(shape)
    peer_list = tuple(p.strip() for p in peers.split(",") if p.strip())
    bad = [p for p in peer_list if p not in PEER_NAMES]
    if bad:  # (before the checkpoint loads)
        raise VaeoptError(f"--peers: unknown {', '.join(bad)} (choose from {', '.join(PEER_NAMES)})")
    if family is not None:
        from vaeopt.families import get_family

        get_family(family)  # a misspelled name: the known ones listed
    if plot_out is not None and plot_out.suffix.lower() != ".png":
        raise VaeoptError(f"--plot {plot_out}: the chart is a PNG; give a .png file name")
    if (json_out is not None and json_out.suffix.lower() != ".json" and not json_out.exists()
            and json_out != plot_out):  # (a folder, the model or the --plot file: named as such after the imports)
        raise VaeoptError(f"--json {json_out}: the results are a JSON file; give a .json file name")
    if model is None and not family and not workload:
        raise VaeoptError("give a checkpoint, --family or --workload")
    from vaeopt import benchmark as bm
    from vaeopt.hw import resolve_device, resolve_dtype

    if plot_out is not None and not bm.plot_available():  # before minutes of measuring, not after
        raise VaeoptError(bm.PLOT_MISSING)

    # '--json=~/r.json': the shell leaves a '~' after '=' as it is; decode's -o and --model expand it, so do these
    from vaeopt.loading import expand_user  # ('~nosuchuser/r.json': one clear line, not an internal error)

    json_out, plot_out = (expand_user(p, flag) if p is not None else None
                          for p, flag in ((json_out, "--json"), (plot_out, "--plot")))
    _check_bench_outputs(model, json_out, plot_out)  # before minutes of measuring, not after
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if repeats is None:
        repeats = 5 if dev.type == "cuda" else 3
    spec, sd, shp, wl, notes = bench_inputs(model, family, workload, shape, dev)
    for n in notes:
        detail(n)
    where = torch_device_name(dev)
    say(f"[bold]benchmark[/] {wl or spec.name} latent {shp} {str(dt).replace('torch.', '')} on {where}"
        + ("  [yellow](CPU numbers: not GPU performance)[/]" if dev.type != "cuda" else ""))
    if dev.type != "cuda" and math.prod(shp[2:]) > 64 * 64:
        say(f"  [yellow]a {'x'.join(map(str, shp[2:]))} latent on the CPU: each decode takes a minute or "
            f"more, and the ladder runs {repeats + warmup} per row (Ctrl-C stops it; --shape "
            f"1,{shp[1]},{'1,' if len(shp) == 5 else ''}32,32 is a quick CPU run)[/]")
    result = bm.run_benchmark(spec, sd, shp, device=dev, dtype=dt, peers=peer_list, repeats=repeats, warmup=warmup,
                              fp8=fp8, gate_db=fp8_gate, autotune=cudnn_autotune, log=log, detail=detail,
                              spell=spell_benchmark_flags,
                              workload=wl, command=" ".join(["vaeopt"] + sys.argv[1:]))
    if printing.level >= 1:  # -q: the results are in --json / --plot
        print_bench(result)
    if json_out:
        replaced = _replacing(json_out)
        with atomic_path(json_out) as tmp:
            tmp.write_text(json.dumps(result, indent=1))
        say(f"[bold green]wrote[/] {escape(str(json_out))}{replaced}")
    if plot_out:
        replaced = _replacing(plot_out)
        bm.plot(result, plot_out)
        say(f"[bold green]wrote[/] {escape(str(plot_out))}{replaced}")


def _replacing(p: Path) -> str:
    """benchmark's --json/--plot replace an existing .json/.png (a re-run updates its results): said so."""
    return " (replaced the file that was there)" if p.exists() else ""


def _check_bench_outputs(model, json_out, plot_out) -> None:
    outs = [p for p in (json_out, plot_out) if p is not None]
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


def bench_inputs(model, family, workload, shape, dev):
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
        shp = parse_shape(shape)
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


def print_bench(result: dict) -> None:
    from vaeopt.fidelity import psnr_text

    title = (f"{result.get('workload') or result['family']} {tuple(result['latent_shape'])} {result['dtype']} "
             f"on {result.get('gpu') or 'CPU (CPU numbers)'}")
    f = lambda v, fmt: (fmt.format(v) if v is not None else "-")  # noqa: E731
    cold = result.get("warmup") == 0 and result.get("repeats", 0) >= 2  # the first call timed on its own
    cols = ("row", "ms", "min-max") + (("cold ms",) if cold else ()) + ("GiB", "TFLOP/s", "PSNR", "max err", "speedup")
    cells, skipped = [], []
    for r in result["rows"]:
        if r["status"] != "ok":
            skipped.append(r)
            continue
        psnr = "ref" if r["kind"] == "reference" else psnr_text(r["psnr_db"], "")
        cells.append((r["name"][:36], f(r["median_ms"], "{:.1f}"), f"{r['min_ms']:.1f}-{r['max_ms']:.1f}",
                      *((f(r.get("cold_ms"), "{:.1f}"),) if cold else ()), f(r["peak_alloc_gib"], "{:.2f}"),
                      f(r["tflops"], "{:.0f}" if (r["tflops"] or 0) >= 10 else "{:.2g}"), psnr,
                      f(r["max_abs"], "{:.3f}"), f(r.get("speedup_vs_baseline", r["speedup_vs_diffusers_bf16"]),
                                                   "{:.2f}x")))
    # A narrow terminal drops the least needed columns rather than cutting every number short; the row names fold.
    width = printing.out_console.width
    need = {c: max([len(c)] + [len(row[i]) for row in cells]) + 3 for i, c in enumerate(cols)}
    shown = list(cols)
    for c in (c for c in ("cold ms", "min-max", "TFLOP/s", "max err", "GiB") if c in cols):
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
    printing.out_console.print(t)
    matmul = f"; bf16 matmul here {result['matmul_tflops']:.0f} TFLOP/s" if result.get("matmul_tflops") else ""
    printing.out_console.print(f"PSNR/max err vs the fp32 diffusers decode; speedup vs "
                               f"'{result.get('speedup_baseline')}'{matmul}", style="dim")
    from vaeopt.benchmark import clock_note, level_lines

    if result.get("warmup") == 0:  # the first call pays one-time costs: said, so no one reads it as steady
        printing.out_console.print(
            "--warmup 0: the first call of each row (cold: one-time compiles, allocations, kernel choice) is timed "
            "on its own ('cold ms') and left out of the median" if cold else
            "--warmup 0 --repeats 1: each time is one cold call (one-time compiles, allocations and kernel choice "
            "included), not a steady-state time", style="dim", highlight=False)
    if note := clock_note(result["rows"]):
        printing.out_console.print(note, style="dim", highlight=False)
    for r in skipped:  # the reasons in full with -v (and in --json)
        why = r["reason"] if printing.level >= 2 else textwrap.shorten(r["reason"], max(40, 96 - len(r["name"])),
                                                                       placeholder=" ...")
        printing.out_console.print(f"  [yellow]{r['status']}[/] {escape(r['name'])}: {escape(why)}", highlight=False)
    for line in level_lines(result.get("fp8_levels") or []):
        printing.out_console.print(line, highlight=False)
