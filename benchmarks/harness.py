"""One timer for vaeopt's benchmark setups: named workloads, warm-up, median with spread, peak memory, PSNR vs fp32,
and one JSON row per (workload, item, variant) with the GPU, the versions and the git revision.

    python benchmarks/harness.py SETUP [--workload W] [--variants a,b] [--repeats N] [--warmup N] [--json PATH]
    python benchmarks/op_norm.py --workload sdxl-1024       # the same: each setup file runs the harness on itself
    python benchmarks/decode_image.py --tiny --device cpu   # a narrow model of the workload's family (smoke test)

A setup module (op_*.py, decode_*.py) defines VARIANTS (the first is the baseline of the speedups), items(ctx) ->
[(label, item)] (an op: each distinct layer input of the workload's decoder; a decode: the latent) and
setup(variant, item, ctx) -> Case. Optional: DEFAULTS (argument defaults), add_args(parser), launch(body, setup, args)
(multi-process setups). Workloads are `vaeopt benchmark`'s (vaeopt.benchmark.WORKLOADS); weights are diffusers'
default init under seed 0 and latents N(0, 1) under seed 0, as there, so PSNRs match its table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere without installing
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")  # (its note on every .to(dtype) of a random-init model)

from vaeopt import fidelity  # noqa: E402
from vaeopt.benchmark import WORKLOADS, count_flops  # noqa: E402
from vaeopt.families import build_model, get_family  # noqa: E402
from vaeopt.hw import machine_info  # noqa: E402

SETUPS = ("op_norm", "op_conv", "op_attention", "op_upsample", "decode_image", "decode_video", "decode_band", "dropin",
          "first_call")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# --tiny: the workload's family at a narrow width and a small latent (same code paths, seconds on a CPU)
TINY = {"AutoencoderKL": (dict(block_out_channels=[32, 32, 64, 64], norm_num_groups=8), (1, None, 16, 16)),
        "AutoencoderKLWan": (dict(base_dim=16), (1, None, 3, 8, 8)),
        "AutoencoderKLHunyuanVideo15": (dict(block_out_channels=[16, 32, 32, 32, 32], layers_per_block=1),
                                        (1, None, 2, 4, 4)),
        "AutoencoderKLLTX2Video": (dict(block_out_channels=[16, 32, 32, 32], decoder_block_out_channels=[16, 32, 64],
                                        layers_per_block=[1, 1, 1, 1, 1], decoder_layers_per_block=[1, 1, 1, 1]),
                                   (1, None, 2, 4, 4))}


class Skip(Exception):
    """Raised by a setup when a variant cannot run here (no GPU, no FP8 tensor cores, ...): a row with the reason."""


class Timed(NamedTuple):
    """What a case's fn returns when it clocks itself (a decode whose own timer stops before its copy to the host,
    a call that spans processes): the output and its milliseconds."""
    out: Any
    ms: float


@dataclass
class Case:
    fn: Callable[[], Any]  # the timed call: returns the output (or Timed)
    reference: Callable[[], torch.Tensor] | None = None  # fp32 output of the same work (TF32 off); one per item
    image: bool = False  # outputs are pixels in [-1, 1]: clamped and compared as `vaeopt benchmark` compares them
    flops: float | None = None  # -> TFLOP/s
    bytes: float | None = None  # moved per call -> GB/s
    # on CUDA, time 10 calls captured in one CUDA graph (kernels of ~10-200 us: eager launches time the host)
    graph: bool = False
    info: dict = field(default_factory=dict)  # what the row should carry (the plan, the stages)


@dataclass
class Ctx:
    """What a setup gets: the workload, its family (with --tiny's overrides), the device, dtype and arguments."""
    workload: str
    shape: tuple
    overrides: dict
    device: torch.device
    dtype: torch.dtype
    args: argparse.Namespace
    rank: int = 0
    _sd: dict | None = None
    _flops: float | None = None

    @property
    def family(self):
        spec = get_family(WORKLOADS[self.workload][0])
        return spec.with_config(self.overrides) if self.overrides else spec

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    def model(self, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """A fresh copy of the workload's model (diffusers' default init, seed 0) on the device."""
        if self._sd is None:
            torch.manual_seed(0)
            self._sd = build_model(self.family, **self.overrides).state_dict()
        with torch.device("meta"):
            m = build_model(self.family, **self.overrides)
        m.load_state_dict(self._sd, assign=True)
        return m.to(self.device, dtype or self.dtype).eval().requires_grad_(False)

    def latent(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return randn(self.shape, 0).to(self.device, dtype or self.dtype)

    def flops(self) -> float:
        """FLOPs of one diffusers decode of the workload (counted once, on the meta device)."""
        if self._flops is None:
            self._flops = count_flops(self.family, self.shape, self.overrides)
        return self._flops


def randn(shape, seed: int, device="cpu", dtype=torch.float32, channels_last: bool = False) -> torch.Tensor:
    """N(0, 1) drawn on the CPU (the same values on every device), optionally channels-last."""
    x = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    if channels_last and x.dim() in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


def layer_inputs(ctx: Ctx, types: tuple[str, ...]) -> list[tuple[str, tuple, torch.nn.Module]]:
    """The distinct (module class, input shape) of the decoder's modules of these classes in one decode of the
    workload, run on the meta device (no memory, no time), in order of first use; with a (meta) module of each."""
    with torch.device("meta"):
        m = build_model(ctx.family, **ctx.overrides)
        z = torch.empty(ctx.shape)
    seen: dict = {}

    def hook(mod, args, out):
        seen.setdefault((type(mod).__name__, tuple(args[0].shape)), mod)

    for mod in m.decoder.modules():
        if type(mod).__name__ in types:
            mod.register_forward_hook(hook)
    with torch.inference_mode():
        m.decode(z)
    return [(t, s, mod) for (t, s), mod in seen.items()]


def decode_args(ap) -> None:
    """The options of the whole-decode setups (decode_image.py, decode_video.py)."""
    ap.add_argument("--vram-budget", type=float, default=8.0, help="GB, for the tiled (and budget) variants")
    ap.add_argument("--fp8-gate", type=float, default=40.0, help="dB, for the fp8 variant")


def decode_items(video: bool | None = None):
    """A whole-decode setup's items(ctx): the workload's latent; with `video`, a workload of the other kind refused."""
    def items(ctx: Ctx) -> list:
        if video is not None and ctx.family.is_video != video:
            raise SystemExit(f"{ctx.workload} is {'an image' if video else 'a video'} workload: decode_"
                             f"{'image' if video else 'video'}.py")
        return [(f"{ctx.workload} {tuple(ctx.shape)}", ctx.shape)]
    return items


def pipeline_plan(ctx: Ctx, options: dict, shape):
    """vaeopt's Pipeline as `vaeopt decode` builds it for the workload's model, and its plan for `shape`; rows that may
    tile get --vram-budget unless their options name one, fp8 rows --fp8-gate (a forced tiling left untiled: Skip)."""
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    opts = dict(options, device=str(ctx.device), dtype=ctx.dtype_name, decode_shape=tuple(shape))
    if opts.get("tiling") != "off":
        opts.setdefault("vram_budget_gb", ctx.args.vram_budget)
    if opts.get("fp8") == "on":
        opts["gate_db"] = ctx.args.fp8_gate
    loaded = LoadedVAE(ctx.model(torch.float32), ctx.family, "benchmark", None, [], None)
    pipe = Pipeline(loaded, Options(**opts), log=lambda s: None)
    plan = pipe.plan(tuple(shape))
    if opts.get("tiling") == "on" and plan.mode != "tiled":
        raise Skip(f"the planner did not tile within {ctx.args.vram_budget:g} GB: {plan.reason}")
    return pipe, plan


def pipeline_case(pipe, plan, z: torch.Tensor, reference, flops, **info) -> Case:
    """A row timed by the pipeline's own clock (DecodeStats.seconds: launch to last kernel, not the copy out)."""
    def fn():
        out, stats = pipe.decode(z, plan)
        return Timed(out, stats.seconds * 1e3)

    return Case(fn, reference, image=True, flops=flops,
                info={"plan": plan.reason, **info, "stages": [f"{s.name}: {s.status}" for s in pipe.stages]})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call_ms(fn, device) -> tuple[Any, float, bool]:
    """(output, ms, whether the call clocked itself)"""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize(device)
        ms = a.elapsed_time(b)
    else:
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
    return (out.out, out.ms, True) if isinstance(out, Timed) else (out, ms, False)


def measure(case: Case, device: torch.device, warmup: int, repeats: int) -> dict:
    """The first call timed on its own (compiles, autotuning, cuDNN's choice), warmup - 1 more, then the peak reset
    and `repeats` timed calls -> times, peak memory above zero and above the start, the last output."""
    out, first, own = _call_ms(case.fn, device)
    for _ in range(warmup - 1):
        out = None
        out, _, _ = _call_ms(case.fn, device)
    fn, per_call = case.fn, 1
    timer = "the call's own clock" if own else "cuda events" if device.type == "cuda" else "wall"
    if case.graph and device.type == "cuda":
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(10):
                    out = case.fn()
            fn, per_call, timer = (lambda: g.replay()), 10, "cuda graph of 10 calls"
        except RuntimeError as e:  # not capturable (a host sync inside): eager launches
            timer = f"cuda events (no graph: {str(e).splitlines()[0][:80]})"
    sync(device)
    start = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        if per_call == 1:
            out = None
        r, ms, _ = _call_ms(fn, device)
        out = r if per_call == 1 else out
        times.append(ms / per_call)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"times": times, "first_call_ms": first, "timer": timer, "out": out,
            "peak_gib": peak / 2**30 if peak is not None else None,
            "peak_above_start_gib": (peak - start) / 2**30 if peak is not None else None}


def summary(times: list[float]) -> dict:
    """Median with its spread (p20 / p80, as Triton's do_bench reports), min and max, in ms."""
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    return {"median_ms": statistics.median(times), "p20_ms": q[1], "p80_ms": q[7], "min_ms": min(times),
            "max_ms": max(times)}


def fidelity_of(out, ref: torch.Tensor | None, image: bool) -> dict:
    if ref is None or not isinstance(out, torch.Tensor):
        return {}
    x = out.detach().float().cpu()
    if image:  # as `vaeopt benchmark`: both clamped to the pixel range, PSNR over a data range of 2
        f = fidelity.compare(x.clamp(-1, 1), ref.clamp(-1, 1))
        return {"psnr_db": f["psnr_db"], "max_abs": f["max_abs"]}
    rng = float(ref.max() - ref.min()) or 1.0  # an activation: PSNR over the reference's own range
    return {"psnr_db": fidelity.psnr(x, ref, data_range=rng), "max_abs": fidelity.max_abs(x, ref)}


def reference_of(case: Case) -> torch.Tensor | None:
    if case.reference is None:
        return None
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # TF32 would be ~1e-3 off
    try:
        with torch.inference_mode():
            return case.reference().detach().float().cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def profile_kernels(fn, top: int = 15) -> dict:
    """GPU time per kernel name (ms, first 90 characters) over one call under torch.profiler, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by[e.name[:90]] = by.get(e.name[:90], 0.0) + e.device_time / 1e3
    return dict(sorted(by.items(), key=lambda kv: -kv[1])[:top])


def run_variant(S, variant: str, item, ctx: Ctx, ref: list) -> dict:
    """One row: set up, time, judge. ref: [reference output or None], filled by the first case that has one."""
    row: dict = {"variant": variant, "status": "ok", "reason": ""}
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        t0 = time.perf_counter()
        case = S.setup(variant, item, ctx)
        row["setup_s"] = time.perf_counter() - t0
        if not ref and ctx.rank == 0:
            ref.append(reference_of(case))
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()  # the fp32 model's blocks: not this row's to keep
        with torch.inference_mode():
            m = measure(case, ctx.device, ctx.args.warmup, ctx.args.repeats)
            if ctx.args.profile and ctx.device.type == "cuda":
                row["kernels_ms"] = profile_kernels(case.fn)
    except Skip as e:
        return {**row, "status": "skipped", "reason": str(e)}
    except torch.cuda.OutOfMemoryError as e:
        return {**row, "status": "failed", "reason": f"out of memory: {str(e).splitlines()[0][:120]}"}
    row.update(summary(m["times"]), times_ms=[round(t, 4) for t in m["times"]], first_call_ms=m["first_call_ms"],
               timer=m["timer"], peak_gib=m["peak_gib"], peak_above_start_gib=m["peak_above_start_gib"],
               info=case.info)
    if case.flops:
        row["tflops"] = case.flops / row["median_ms"] / 1e9
    if case.bytes:
        row["gbps"] = case.bytes / row["median_ms"] / 1e6
    row.update(fidelity_of(m["out"], ref[0] if ref else None, case.image))
    if isinstance(m["out"], torch.Tensor):  # for max_abs_vs_baseline (pixels clamped, as the PSNR has them)
        row["_out"] = m["out"].detach().float().cpu().clamp(-1, 1) if case.image else m["out"].detach().float().cpu()
    return row


def workload_shape(args) -> tuple[tuple, dict]:
    """(latent shape, model config overrides) of args.workload, narrowed by --tiny."""
    fam, shape = WORKLOADS[args.workload]
    if not args.tiny:
        return tuple(shape), {}
    cls = get_family(fam).cls_name
    if cls not in TINY:
        raise SystemExit(f"--tiny: no narrow config for {cls} (tiny: {', '.join(TINY)})")
    return tuple(shape[1] if s is None else s for s in TINY[cls][1]), TINY[cls][0]


def run_rows(setup_name: str, args: argparse.Namespace) -> dict | None:
    """Every item x variant of a setup on this process (a rank of a multi-process setup: all ranks run the same
    calls, rank 0's rows are the result). -> the result dict on rank 0, None elsewhere."""
    import torch.distributed as dist

    S = importlib.import_module(setup_name)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    device = torch.device(args.device) if args.device else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if hasattr(S, "rank_device"):  # a rank of a multi-process setup: its own GPU
        device = S.rank_device(device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    ctx = Ctx(args.workload, *workload_shape(args), device, dtype, args, rank)
    rows = []
    for label, item in S.items(ctx):
        ref: list = []
        base = None
        for v in args.variants:
            r = {"workload": args.workload, "item": label, **run_variant(S, v, item, ctx, ref)}
            out = r.pop("_out", None)
            if r["status"] == "ok" and base is None:
                base = (r["median_ms"], out)
            elif r["status"] == "ok":
                r["speedup"] = base[0] / r["median_ms"]
                if out is not None and base[1] is not None and out.shape == base[1].shape:
                    r["max_abs_vs_baseline"] = (out - base[1]).abs().max().item()
            rows.append(r)
            if rank == 0:
                print(line(r), flush=True)
    return result(setup_name, args, ctx, rows) if rank == 0 else None


def line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['item']:<34} {r['variant']:<14} {r['status']}: {r['reason']}"
    extra = "".join(f"  {r[k]:.3g} {u}" for k, u in (("tflops", "TFLOP/s"), ("gbps", "GB/s")) if r.get(k))
    psnr = f"  {fidelity.psnr_text(r['psnr_db'])}" if r.get("psnr_db") is not None else ""
    peak = f"  peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else ""
    sp = f"  {r['speedup']:.2f}x" if r.get("speedup") else ""
    return (f"{r['item']:<34} {r['variant']:<14} {r['median_ms']:9.3f} ms [{r['p20_ms']:.3f}, {r['p80_ms']:.3f}]"
            f"{extra}{psnr}{peak}{sp}")


def git_revision() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        rev = git("rev-parse", "HEAD") or os.environ.get("VAEOPT_GIT_REV") or None
        return {"rev": rev, "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if rev else None}
    except (OSError, subprocess.SubprocessError):
        return {"rev": os.environ.get("VAEOPT_GIT_REV"), "dirty": None}


def header(device: torch.device, command: str) -> dict:
    """What every result file starts with: the GPU, the versions (CUDA's and cuDNN's on a GPU run), the git revision,
    the date and the command that reproduces the run."""
    cuda, m = device.type == "cuda", machine_info(gpus=False)
    return {"gpu": torch.cuda.get_device_name(device) if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0,
            "versions": {"torch": m.torch, "cuda": m.cuda if cuda else None, "cudnn": m.cudnn if cuda else None,
                         "triton": m.triton, "diffusers": m.diffusers, "av": m.pyav, "python": m.python},
            "git": git_revision(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command}


def result(setup_name: str, args, ctx: Ctx, rows: list[dict]) -> dict:
    return {"setup": setup_name, "workload": args.workload, "tiny": args.tiny, "latent_shape": list(ctx.shape),
            "dtype": ctx.dtype_name, "device": str(ctx.device), **header(ctx.device, args.command),
            "repeats": args.repeats, "warmup": args.warmup, "variants": args.variants, "rows": rows}


def save_model(family: str, folder: Path, overrides: dict | None = None) -> Path:
    """The family's architecture (narrowed by `overrides`) with diffusers' default init under seed 0, as the workloads
    build it, saved as a diffusers model folder (config.json + safetensors) that vaeopt and diffusers both load."""
    spec = get_family(family)
    torch.manual_seed(0)
    build_model(spec.with_config(overrides) if overrides else spec, **(overrides or {})).save_pretrained(
        folder, safe_serialization=True)
    return folder


def cache_env(root: Path | str, **extra: str) -> dict:
    """The environment of a fresh process whose Triton and vaeopt caches are under `root` (empty: a new machine's;
    shared: warm), with this checkout importable."""
    return dict(os.environ, TRITON_CACHE_DIR=os.path.join(root, "triton"), VAEOPT_CACHE_DIR=os.path.join(root, "vaeopt"),
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)


TIMEOUT_RC = -signal.SIGABRT  # a process stopped at its timeout


def timed_run(cmd: list[str], env: dict, timeout: float | None = None) -> tuple[float, subprocess.CompletedProcess]:
    """Run cmd -> (wall seconds, the finished process). Past `timeout` seconds it is stopped with SIGABRT, on which
    Python's faulthandler (on through PYTHONFAULTHANDLER) prints every thread's stack: its output then says where the
    time went, and one slow process never takes the whole run's time with it."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(env, PYTHONFAULTHANDLER="1"))
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # (stuck in native code with the signal blocked)
            p.kill()
            out, err = p.communicate()
        return time.perf_counter() - t0, subprocess.CompletedProcess(cmd, TIMEOUT_RC, out, err)
    return time.perf_counter() - t0, subprocess.CompletedProcess(cmd, p.returncode, out, err)


def write_json(res: dict, path: Path) -> None:
    """Atomically: a run killed half-way leaves the old file, not half a new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    os.replace(tmp, path)


def parse(setup_name: str, argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    if not (Path(__file__).parent / f"{setup_name}.py").is_file() or setup_name in ("harness", "make_tables"):
        raise SystemExit(f"unknown setup {setup_name!r}: one of {', '.join(SETUPS)}")
    S = importlib.import_module(setup_name)
    d = {"workload": "sdxl-1024", "repeats": 20, "warmup": 3, **getattr(S, "DEFAULTS", {})}
    ap = argparse.ArgumentParser(prog=setup_name, description=(S.__doc__ or "").strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=d["workload"], choices=list(WORKLOADS))
    ap.add_argument("--variants", default=",".join(S.VARIANTS), help=f"of {', '.join(S.VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=d["repeats"])
    ap.add_argument("--warmup", type=int, default=d["warmup"], help="calls before timing (the first timed alone)")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bf16 (fp32 on CPU)")
    ap.add_argument("--tiny", action="store_true", help="a narrow model and small latent (smoke test)")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel of one more call per row")
    ap.add_argument("--json", default=None, help="default $OUT/<setup>_<workload>.json (OUT: the current folder)")
    if hasattr(S, "add_args"):
        S.add_args(ap)
    args = ap.parse_args(argv)
    args.command = " ".join([f"python benchmarks/{setup_name}.py", *argv])  # what reproduces this run
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in S.VARIANTS]
    if bad or args.repeats < 1 or args.warmup < 1:
        ap.error(f"unknown variant {bad[0]!r} (known: {', '.join(S.VARIANTS)})" if bad else
                 "--repeats and --warmup must be at least 1")
    return args


def main(setup_name: str | None = None, argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if setup_name is None:
        if not argv or argv[0].startswith("-"):
            raise SystemExit(f"usage: python benchmarks/harness.py SETUP [options]  (SETUP: {', '.join(SETUPS)})")
        setup_name, argv = argv[0].removesuffix(".py"), argv[1:]
    args = parse(setup_name, argv)
    import harness as H  # by module name: a multi-process setup's ranks unpickle it

    S = importlib.import_module(setup_name)
    res = S.launch(H.run_rows, setup_name, args) if hasattr(S, "launch") else H.run_rows(setup_name, args)
    if res is None:  # a rank other than 0
        return None
    path = Path(args.json) if args.json else Path(os.environ.get("OUT", ".")) / f"{setup_name}_{args.workload}.json"
    write_json(res, path)
    v = res["versions"]
    print(f"\n{res['gpu'] or 'CPU'}, torch {v['torch']}, cuDNN {v['cudnn']}, Triton {v['triton']}, diffusers "
          f"{v['diffusers']}, git {str(res['git']['rev'])[:10]}; {res['dtype']}, median of {args.repeats} "
          f"[p20, p80] -> {path}")
    return res


if __name__ == "__main__":
    main()
