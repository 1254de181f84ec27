"""`vaeopt benchmark`: peers and the vaeopt ladder measured side by side, in one process, with fidelity.

Rows: diffusers fp32 (the fidelity reference), diffusers bf16 eager, diffusers bf16 + enable_tiling(), optionally
torch.compile of the diffusers decoder; then vaeopt's plain path and each pipeline stage added on top of the previous
ones, in pipeline order. Every row: median/min/max time, peak memory, throughput, achieved TFLOP/s (FLOPs counted
with FlopCounterMode) and its fraction of a bf16 matmul measured in the same run, PSNR / max abs error vs fp32.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import importlib.util
import statistics
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vaeopt import fidelity, video, video_stream
from vaeopt.cache import driver_version
from vaeopt.errors import VaeoptError
from vaeopt.families import FamilySpec, build_model
from vaeopt.hw import DTYPE_NAMES, ClockSampler, machine_info
from vaeopt.loading import LoadedVAE
from vaeopt.outputs import atomic_path
from vaeopt.pipeline import DecodeStats, Options, Pipeline
from vaeopt.stage_table import channels_last_veto
from vaeopt.stages import cudnn_autotune, spelled, triton_conv

# Standard workloads (docs/benchmarks.md): name -> (family, raw latent shape)
WORKLOADS: dict[str, tuple[str, tuple[int, ...]]] = {
    "sdxl-1024": ("sdxl", (1, 4, 128, 128)),
    "sdxl-2048": ("sdxl", (1, 4, 256, 256)),
    "sdxl-4096": ("sdxl", (1, 4, 512, 512)),
    "flux-1024": ("flux", (1, 16, 128, 128)),
    "sd15-512": ("sd15", (1, 4, 64, 64)),
    "wan21-480p": ("wan21", (1, 16, 21, 60, 104)),
    "wan21-720p": ("wan21", (1, 16, 21, 90, 160)),
    "wan22-720p": ("wan22", (1, 48, 31, 44, 80)),
    "hunyuan-480p": ("hunyuanvideo", (1, 16, 16, 60, 106)),  # 61 frames at 480x848
    "taesd-1024": ("taesd", (1, 4, 128, 128)),
    "flux2-1024": ("flux2", (1, 32, 128, 128)),  # a 1024² FLUX.2 image
    "qwenimage-1328": ("qwenimage", (1, 16, 1, 166, 166)),  # Qwen-Image's default 1328², one latent frame
    "hunyuan15-480p": ("hunyuanvideo15", (1, 32, 31, 30, 53)),  # 121 frames at 480x848 (16x spatial, 4x time)
    "ltx2-768": ("ltx2", (1, 128, 16, 24, 40)),  # 121 frames at 768x1280 (32x spatial, 8x time)
}


def default_shape(spec, device) -> tuple[tuple[int, ...], str | None, str]:
    """The latent shape `vaeopt benchmark model.safetensors` measures when given none -> (shape, workload, why): on a
    GPU the family's standard workload (its first in WORKLOADS), else a 128x128 latent (21 latent frames of 60x104
    for video, wan21-480p's); on the CPU a small one (32x32; 3 frames of 16x16), since every row decodes repeatedly."""
    C = spec.latent_channels
    if getattr(device, "type", "cpu") == "cuda":
        wl = next((w for w, (fam, shp) in WORKLOADS.items() if fam == spec.name and shp[1] == C), None)
        if wl is not None:
            return WORKLOADS[wl][1], wl, f"the {wl} workload"
        return ((1, C, 21, 60, 104) if spec.is_video else (1, C, 128, 128)), None, "the GPU default"
    return ((1, C, 3, 16, 16) if spec.is_video else (1, C, 32, 32)), None, "a small CPU default"


PEERS = ("fp32", "bf16", "tiling", "compile")


@dataclass
class Row:
    name: str
    kind: str  # "peer", "ladder", "reference", "fp8" (one FP8 level on its own, after the ladder)
    status: str = "ok"  # ok, skipped, failed
    reason: str = ""
    times_ms: list[float] = field(default_factory=list)  # every timed call, in order
    # --warmup 0: the first timed call, which pays the one-time costs (compiles, allocator growth, cuDNN's choice).
    # With 2 or more repeats it is kept out of median/min/max, so those stay steady-state numbers; with one repeat
    # it is all there is: median_is_cold says the median is that cold call.
    cold_ms: float | None = None
    median_is_cold: bool = False
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    peak_alloc_gib: float | None = None
    peak_reserved_gib: float | None = None
    throughput: float | None = None
    throughput_unit: str = ""
    tflops: float | None = None
    frac_of_matmul: float | None = None
    psnr_db: float | None = None
    max_abs: float | None = None
    setup_s: float | None = None
    stages: list[dict] = field(default_factory=list)
    gpu_clock: dict | None = None  # hw.summarize_clocks over the timed repeats (CUDA with nvidia-smi)
    speedup_vs_baseline: float | None = None  # vs the result's speedup_baseline row
    speedup_vs_diffusers_bf16: float | None = None  # the same, where the baseline is diffusers bf16 eager
    speedup_vs_best_peer: float | None = None


def count_flops(spec: FamilySpec, shape: tuple, overrides: dict | None = None) -> float:
    """FLOPs of one diffusers decode, counted on the meta device (no memory, no time). A Wan picture (one latent
    frame, a Qwen-Image image) counts the decode without the products with its zero causal history (the chunk
    decoder's one call: 8.4 of diffusers' 20.1 TFLOP at 1328x1328), so that TFLOP/s stays work done per second."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        m = build_model(spec, **(overrides or {}))
        z = torch.empty(shape)
    fc = FlopCounterMode(display=False)
    with fc, torch.inference_mode():
        if spec.cls_name == "AutoencoderKLWan" and len(shape) == 5 and shape[2] == 1:
            video.decode_video(m, z, chunk=1, fused=False)
        else:
            m.decode(z)
    return float(fc.get_total_flops())


def matmul_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        a @ b
    e1.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (e0.elapsed_time(e1) / 1e3) / 1e12


def time_fn(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int, repeats: int,
            clocks: ClockSampler | None = None):
    """fn() `warmup` times, then `repeats` timed calls back to back: (last output, ms per call, (peak allocated,
    peak reserved) GiB). `clocks` samples the GPU's clock over the timed calls."""
    out = None
    if device.type == "cuda":  # peak includes warm-up (and a CUDA graph's capture pool)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        out = fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with clocks or contextlib.nullcontext():
            for _ in range(repeats):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                out = fn()
                e1.record()
                torch.cuda.synchronize(device)
                times.append(e0.elapsed_time(e1))
        peak = (torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = (None, None)
    return out, times, peak


class Bench:
    def __init__(self, spec: FamilySpec, state_dict: dict, shape: tuple, device: torch.device, dtype: torch.dtype,
                 repeats: int, warmup: int, log: Callable[[str], None], model_overrides: dict | None = None,
                 detail: Callable[[str], None] | None = None):
        self.spec, self.sd, self.shape, self.device, self.dtype = spec, state_dict, shape, device, dtype
        self.repeats, self.warmup, self.log = repeats, warmup, log
        self.detail = detail or log  # the progress lines a short log leaves out (a row starting, a skipped row)
        self.spell = None  # how the stages' hints are written in the rows (run_benchmark's spell)
        self.overrides = model_overrides or {}
        g = torch.Generator().manual_seed(0)
        self.z = torch.randn(shape, generator=g)
        self.ref: torch.Tensor | None = None
        self.flops = count_flops(spec, shape, self.overrides)
        self.matmul = matmul_tflops(device)
        n, h, w = shape[0], shape[-2] * spec.spatial_factor, shape[-1] * spec.spatial_factor
        self.units, self.unit = ((n * spec.output_frames(shape[2]), "frames/s") if spec.is_video
                                 else (n * h * w / 1e6, "MP/s"))

    def fresh_model(self, dtype: torch.dtype) -> torch.nn.Module:
        with torch.device("meta"):
            m = build_model(self.spec, **self.overrides)
        m.load_state_dict(self.sd, assign=True)
        return m.to(self.device, dtype).eval().requires_grad_(False)

    def finish(self, row: Row, out: torch.Tensor | None, times: list[float], peak) -> Row:
        row.times_ms = [round(t, 3) for t in times]
        if self.warmup == 0 and times:  # no untimed call before: the first one timed is cold
            row.cold_ms = times[0]
            row.median_is_cold = len(times) == 1
            times = times[1:] or times
        row.median_ms = statistics.median(times)
        row.min_ms, row.max_ms = min(times), max(times)
        row.peak_alloc_gib, row.peak_reserved_gib = peak
        row.throughput = self.units / (row.median_ms / 1e3)
        row.throughput_unit = self.unit
        row.tflops = self.flops / (row.median_ms / 1e3) / 1e12
        if self.matmul:
            row.frac_of_matmul = row.tflops / self.matmul
        if out is not None and self.ref is not None:
            f = fidelity.compare(out.float().clamp(-1, 1), self.ref)
            row.psnr_db, row.max_abs = f["psnr_db"], f["max_abs"]
        return row

    def run(self, name: str, kind: str, make: Callable[[], Callable[[], torch.Tensor]],
            skip: Callable[[list[dict]], tuple[str, str] | None] | None = None) -> Row:
        """Build (`make`), time, log. skip(stage lines) -> (status, reason) marks the row so: untimed where the stages
        as built say so, else after the timed runs (graphs that were never captured)."""
        row = Row(name, kind)
        self.detail(f"{name} ...")
        gc.collect()  # the rows before: their models (and graph pools) gone before this row's peak is measured
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            t0 = time.perf_counter()
            fn = make()
            row.setup_s = time.perf_counter() - t0
            built = getattr(fn, "built_stages", None)
            if reason := getattr(fn, "skip_reason", None):  # known from the built model: not timed
                row.status, row.reason = "skipped", reason
            elif skip is not None and built is not None and (said := skip(built())):
                row.status, row.reason = said
                row.stages = built()
            else:
                clocks = ClockSampler(self.device)
                with torch.inference_mode():
                    out, times, peak = time_fn(fn, self.device, self.warmup, self.repeats, clocks)
                row.gpu_clock = clocks.summary
                out = out.float().cpu()
                if kind == "reference":
                    self.ref = out.clamp(-1, 1)
                self.finish(row, out, times, peak)
                row.stages = fn.stages() if hasattr(fn, "stages") else []
                if skip is not None and (said := skip(row.stages)):
                    row.status, row.reason = said
        except torch.cuda.OutOfMemoryError as e:
            row.status, row.reason = "failed", f"out of memory: {str(e).splitlines()[0][:120]}"
        except VaeoptError as e:
            row.status, row.reason = "failed", str(e)
        except RuntimeError as e:
            if kind == "reference":
                raise
            # a peer that cannot run this size (e.g. a one-call decode of a long clip past cuDNN's 32-bit indexing):
            # a failed row with the reason, and the rows after it still run
            row.status, row.reason = "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.log_row(row)
        return row

    def log_row(self, row: Row) -> None:
        (self.log if row.status != "skipped" else self.detail)(f"  {_fmt_row(row)}")


def clock_note(rows: list[dict]) -> str | None:
    """One line on the GPU clock during the last measured ladder row's timed repeats (the headline row), or None
    when no clock was sampled: its median SM clock against the rated maximum, the highest power draw against the
    limit, and what slowed the clock in how many readings (decodes back to back at the power limit run at a lower
    clock: experiments.md E31)."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("gpu_clock") and r.get("kind") == "ladder"]
    if not ok:
        return None
    r, c = ok[-1], ok[-1]["gpu_clock"]
    n = c["samples"]
    line = f"GPU during '{r['name']}' ({n} nvidia-smi reading{'s' if n != 1 else ''}): SM clock "
    line += (f"{c['sm_mhz_median']:.0f} MHz median (min {c['sm_mhz_min']:.0f}"
             + (f", max {c['sm_mhz_max_rated']:.0f})" if c["sm_mhz_max_rated"] else ")"))
    if c["power_w_max"] is not None:
        line += f", up to {c['power_w_max']:.0f}" + (f" of {c['power_limit_w']:.0f} W" if c["power_limit_w"] else " W")
    if c["slowdown"]:
        line += "; " + ", ".join(f"{k} in {v:.0%} of readings" for k, v in c["slowdown"].items())
    return line


def _fmt_row(r: Row) -> str:
    if r.status != "ok":
        return f"{r.name}: {r.status} — {r.reason}"
    p = "reference" if r.kind == "reference" else f"{fidelity.psnr_text(r.psnr_db)} vs fp32"
    return f"{r.name}: {r.median_ms:.1f} ms, {p}"


def _reference_fn(b: Bench) -> Callable[[], torch.Tensor]:
    """fp32 decode of the same weights. Video: vaeopt's chunk-1 loop, which is diffusers' schedule with the same cache
    semantics (max |diff| 0.0 vs diffusers' decode in fp32 with TF32 off, benchmarks/results/h200_video_*.json) and
    without the growing torch.cat that makes diffusers' fp32 decode need 39 GiB at wan21-480p."""
    model = b.fresh_model(torch.float32)
    z = b.z.to(b.device, torch.float32)
    if b.spec.cls_name == "AutoencoderKLWan":
        return lambda: video.decode_video(model, z, chunk=1)
    if video_stream.applies(model):  # HunyuanVideo 1.5, LTX-2: the exact chunk decoder, one latent frame per call
        # (>= 100 dB against diffusers' whole-clip decode in fp32, tests/test_video_stream.py), which would need over
        # 100 GB in fp32 for 121 frames at 480p (one decoder call over the clip)
        return lambda: video_stream.decode_clip(model, z, 1, clamp=False)
    return lambda: model.decode(z).sample  # HunyuanVideo too: diffusers' decode (in its temporal tiles)


def _peer_fn(b: Bench, dtype: torch.dtype, tiling=False, compile_=False) -> Callable[[], Callable]:
    counted = [0]  # tiled decodes diffusers ran (tiling=True)

    def make():
        model = b.fresh_model(dtype)
        z = b.z.to(b.device, dtype)
        if tiling:
            model.enable_tiling()
            real = model.tiled_decode  # counted: below its tile size diffusers decodes untiled despite enable_tiling()

            def tiled_decode(*a, **k):
                counted[0] += 1
                return real(*a, **k)

            model.tiled_decode = tiled_decode
            if _would_tile(model, b.shape) is False:  # the same untiled decode as the row above: not run again
                fn = lambda: model.decode(z).sample  # noqa: E731
                fn.skip_reason = _not_tiled(b.shape)
                return fn
        if compile_:
            model.to(memory_format=torch.channels_last) if not b.spec.is_video else None
            model.decoder = torch.compile(model.decoder)
            with torch.inference_mode():
                t0 = time.perf_counter()
                model.decode(z)
                if b.device.type == "cuda":
                    torch.cuda.synchronize()
                b.log(f"  torch.compile warm-up {time.perf_counter() - t0:.1f} s")
        return lambda: model.decode(z).sample

    make.tiled_decodes = counted
    return make


def _not_tiled(shape: tuple) -> str:
    return (f"diffusers' enable_tiling() does not tile a {shape[-2]}x{shape[-1]} latent (below its tile size): the "
            "same untiled decode as the diffusers row above")


def _would_tile(model, shape: tuple) -> bool | None:
    """Whether diffusers' decode with enable_tiling() tiles this latent (its _decode's own test: a side above the
    tile's latent size); None where the model has no such settings."""
    h, w = shape[-2], shape[-1]
    if isinstance(getattr(model, "tile_latent_min_size", None), int):  # AutoencoderKL
        return h > model.tile_latent_min_size or w > model.tile_latent_min_size
    r = getattr(model, "spatial_compression_ratio", None)
    if isinstance(r, int) and r > 0 and isinstance(getattr(model, "tile_sample_min_height", None), int):
        return h > model.tile_sample_min_height // r or w > model.tile_sample_min_width // r  # Wan, HunyuanVideo
    return None


LADDER = (
    # (row name, Options overrides) — each adds one stage on top of the previous row
    ("vaeopt plain", dict(channels_last="off", triton="off", epilogues="off", upsample_conv="off",
                          stack_conv3d="off", conv_kernel="off", attention="off", graphs="off", fp8="off",
                          tiling="off")),
    ("+ fp8", dict(fp8="on")),
    ("+ channels_last", dict(channels_last="on")),
    ("+ fused norms (Triton)", dict(triton="auto", epilogues="off")),  # auto: on CPU it would only run interpreted
    ("+ fused epilogues", dict(epilogues="auto")),
    ("+ phase upsample convs", dict(upsample_conv="auto")),
    ("+ stacked Conv3d", dict(stack_conv3d="auto")),
    ("+ Triton conv", dict(conv_kernel="auto")),
    ("+ attention backend", dict(attention="auto")),
    ("+ planner (tile/chunk)", dict(tiling="auto")),
    ("+ CUDA graphs", dict(graphs="on")),
)


def _ladder_fn(b: Bench, opts: dict, tuned=None) -> Callable[[], Callable]:
    """`tuned`: the cudnn_autotune StageResult when run_benchmark turned the autotuner on (process-wide, once)."""
    def make():
        model = b.fresh_model(torch.float32)
        loaded = LoadedVAE(model=model, family=b.spec, layout="benchmark", path=None, notes=[], dtype_on_disk=None)
        o = Options(device=str(b.device), dtype=DTYPE_NAMES[b.dtype], cudnn_autotune="on" if tuned else "off",
                    decode_shape=tuple(b.shape), **opts)
        lines = []
        pipe = Pipeline(loaded, o, log=lines.append, spell=b.spell)  # (the rows show its stage lines)
        if tuned is not None:
            pipe._record(tuned)  # already on for the whole run: the row shows the line, nothing is applied again
        plan = pipe.plan(b.shape)
        if b.spec.is_video and o.tiling == "off":
            plan.chunk = 1  # before the planner row: diffusers' one-latent-frame-per-call schedule
        if o.graphs == "on":  # whole decodes captured (a Wan row's line says why not)
            pipe.setup_graphs(plan, repeats=99, chunks=False, reason="benchmark repeats")
        z = b.z.to(b.device, b.dtype)

        def fn():  # the path `vaeopt decode` takes (OOM retry included), not a shortcut around it
            if b.spec.is_video:
                return pipe._decode_video(z, plan, None)
            return pipe._decode_image(z, plan, DecodeStats(), None)

        def lines(graphs_status=None):
            # their hints spelled as the benchmark has them (b.spell: its own flags, or `vaeopt decode ...`); the
            # FP8 stages' numbers too (fp8_levels reads them)
            return [{"name": s.name, "detail": s.text(b.spell),
                     "status": graphs_status if graphs_status and s.name == "graphs" else s.status,
                     **({"data": _scalars(s.data)} if s.name in _FP8_STAGES and s.data else {})}
                    for s in pipe.stages] + [{"name": "plan", "status": "applied", "detail": pipe.text(plan.reason)}]

        def stages():  # read after the timed runs: graphs are captured during them
            pipe.report_graphs()
            return lines()

        fn.stages = stages
        # as built, before any decode; armed CUDA graphs are captured during the timed decodes (their line says
        # "nothing captured yet" until then): "armed", so that the row is timed and judged after its decodes
        fn.built_stages = lambda: lines("armed" if pipe.graphed is not None else None)
        return fn

    return make


def run_benchmark(spec: FamilySpec, state_dict: dict, shape: tuple, *, device: torch.device, dtype: torch.dtype,
                  peers: tuple[str, ...], repeats: int, warmup: int, fp8: bool, log: Callable[[str], None],
                  workload: str | None, command: str, model_overrides: dict | None = None, gate_db: float = 40.0,
                  autotune: bool = False,
                  detail: Callable[[str], None] | None = None, spell: Callable | None = None) -> dict:
    """`log` gets each measured row as it lands; `detail` (default: log) the rest: each row starting, the skipped
    rows (also in the result, with their reasons), the decode's FLOPs. `spell` writes the hints in the stages'
    lines as the caller names its options (`vaeopt benchmark`: its flags; default: Options fields)."""
    tuned = None
    if autotune:  # for every row, peers included: on before any conv shape is seen (torch caches its first choice)
        ok, why = cudnn_autotune.available(device)
        if not ok:
            raise VaeoptError(f"--cudnn-autotune: {why}")
        tuned = cudnn_autotune.apply("benchmark --cudnn-autotune")
        log("✓ " + tuned.detail)
    # Each row's gc.collect() walks every object Python tracks, torch's and diffusers' modules included (half a
    # second per row on a CPU): what exists before the first row is frozen out of those walks for the run (where no
    # one froze objects before; the models of the rows are made after it and collected as before). Inside the try: a
    # Ctrl-C during that collection still turns the autotuner back off.
    frozen = gc.get_freeze_count() == 0
    try:
        if frozen:
            gc.collect()
            gc.freeze()
        return _run_benchmark(spec, state_dict, shape, device, dtype, peers, repeats, warmup, fp8, log, workload,
                              command, model_overrides, gate_db, tuned, detail or log, spell)
    finally:
        if frozen:
            gc.unfreeze()
        if tuned is not None:
            cudnn_autotune.revert(tuned)


def _run_benchmark(spec, state_dict, shape, device, dtype, peers, repeats, warmup, fp8, log, workload, command,
                   model_overrides, gate_db, tuned, detail, spell) -> dict:
    b = Bench(spec, state_dict, shape, device, dtype, repeats, warmup, log, model_overrides, detail)
    b.spell = spell
    detail(f"decode FLOPs {b.flops / 1e12:.2f} TFLOP" + (f"; bf16 matmul {b.matmul:.0f} TFLOP/s here" if b.matmul else ""))
    rows: list[Row] = []
    wan = spec.cls_name == "AutoencoderKLWan"
    ref_name = ("fp32 reference (chunk-1 = diffusers)" if wan or spec.cls_name in video_stream.STREAM_CLASSES
                else "diffusers fp32 (reference)")
    ref_row = b.run(ref_name, "reference", lambda: _reference_fn(b))
    if ref_row.status != "ok":
        raise VaeoptError(f"the fp32 reference decode failed ({ref_row.reason}); use a smaller --shape")
    rows.append(ref_row)
    if "bf16" in peers and dtype != torch.float32:
        rows.append(b.run(f"diffusers {DTYPE_NAMES[dtype]} eager", "peer", _peer_fn(b, dtype)))
    if "tiling" in peers and spec.cls_name != "AutoencoderTiny":
        make = _peer_fn(b, dtype, tiling=True)  # (a row that timed its untiled decode is no tiling row)
        rows.append(b.run(f"diffusers {DTYPE_NAMES[dtype]} + tiling", "peer", make,
                          skip=lambda _: None if make.tiled_decodes[0] else ("skipped", _not_tiled(shape))))
    if "compile" in peers:
        rows.append(b.run(f"diffusers {DTYPE_NAMES[dtype]} + torch.compile", "peer", _peer_fn(b, dtype, compile_=True)))
    acc: dict = {"gate_db": gate_db}
    for name, opts in LADDER:
        acc.update(opts)
        if name == "+ fp8" and not fp8:
            rows.append(Row(name, "ladder", status="skipped", reason="not requested (--fp8)"))
            acc["fp8"] = "off"
            continue
        # the decode's auto choice, not the row's forced "on"
        if name == "+ channels_last" and (veto := channels_last_veto(spec)):
            rows.append(Row(name, "ladder", status="skipped", reason=spelled(veto, b.spell)))
            b.log_row(rows[-1])
            acc["channels_last"] = "off"
            continue
        make = _ladder_fn(b, dict(acc), tuned)
        # a row whose stage did nothing is shown so, not as a measurement of the row above it
        rows.append(b.run(name, "ladder", make, skip=lambda stages, name=name: _row_skipped(name, stages, spec, shape)))
    levels = _fp8_levels(b, rows, acc, tuned, spec) if fp8 else None
    baseline = _speedups(rows, dtype)
    mi = machine_info()
    return {
        "workload": workload, "family": spec.name, "latent_shape": list(shape), "dtype": DTYPE_NAMES[dtype],
        "device": str(device), "gpu": mi.gpus[0].name if mi.gpus and device.type == "cuda" else None,
        "cpu_numbers": device.type != "cuda", "flops": b.flops, "matmul_tflops": b.matmul,
        "versions": {"torch": mi.torch, "cuda": mi.cuda, "cudnn": mi.cudnn, "triton": mi.triton,
                     "diffusers": mi.diffusers, "python": mi.python},
        "driver": driver_version(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "repeats": repeats, "warmup": warmup,
        "cudnn_autotune": {"benchmark_limit": tuned.data["limit"]} if tuned else None,
        "speedup_baseline": baseline, "rows": [asdict(r) for r in rows],
        **({"fp8_levels": levels} if levels is not None else {}),
    }


_FP8_STAGES = ("fp8", "fp8 convs")


def _scalars(d: dict) -> dict:
    """A stage's numbers for the JSON: its scalar entries (and lists of names), not its per-layer tables."""
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None
            or (isinstance(v, list) and all(isinstance(x, str) for x in v))}


# FP8's levels 1 and 2, each measured on its own (`vaeopt benchmark --fp8`) on top of 'vaeopt plain': (level, row
# name, what it does, Options.fp8)
FP8_LEVELS = (
    (1, "fp8 level 1: e4m3 weights", "e4m3 weight storage with per-channel scales, dequantized per layer", "weights"),
    (2, "fp8 level 2: + fp8 GEMMs", "level 1 plus the 1x1 convs and linears as fp8 GEMMs (torch._scaled_mm)", "gemm"),
)
LEVEL_NAMES = {1: "e4m3 weight storage", 2: "fp8 GEMMs", 3: "8-bit convs"}
LEVEL3_OFF = "fp8 level 3 off (the last row in 16 bits)"


def _stage_line(row: Row, name: str) -> dict | None:
    return next((s for s in row.stages if s["name"] == name), None)


def _fp8_levels(b: Bench, rows: list[Row], acc: dict, tuned, spec: FamilySpec) -> list[dict]:
    """Rows for FP8 levels 1 and 2 alone on top of 'vaeopt plain' (the ladder runs level 3 where it can, which the
    storage hooks of level 1 would disable), and the last ladder row again without FP8, so that level 3 is compared
    with the same stages in 16 bits. Appends the rows; returns one summary per level: time, fidelity and weight
    memory against the row it adds to, or why it did not run."""
    plain = next(r for r in rows if r.name == "vaeopt plain")
    ladder = [r for r in rows if r.kind == "ladder" and r.status == "ok"]
    esize = torch.empty((), dtype=b.dtype).element_size()
    decoder_mib = sum(v.numel() for k, v in b.sd.items() if k.startswith("decoder.")) * esize / 2**20
    out = []
    for level, name, what, mode in FP8_LEVELS:
        r = b.run(name, "fp8", _ladder_fn(b, {**dict(LADDER)["vaeopt plain"], "gate_db": acc["gate_db"], "fp8": mode},
                                          tuned), skip=lambda stages: _row_skipped("+ fp8", stages, spec))
        rows.append(r)
        line = _stage_line(r, "fp8") or {}
        d = line.get("data") or {}
        s = _level_summary(level, what, r, plain, reason=r.reason or line.get("detail", ""),
                           layers=d.get("storage", 0) + d.get("gemm", 0) if d else None,
                           weights_mib=(decoder_mib, decoder_mib - (d["bytes_before"] - d["bytes_after"]) / 2**20)
                           if "bytes_before" in d else None)
        if s["status"] == "fallback" and "psnr_db" in d:  # what the gate measured and what it would have saved
            s.update(probe_db=d["psnr_db"], gate_db=d.get("gate_db"))
        out.append(s)
    # level 3: the ladder row where the 8-bit convs first ran (with it, every row below), against the last row
    # rebuilt with fp8 off
    first = next((r for r in ladder if (ln := _stage_line(r, "fp8 convs")) and ln["status"] == "applied"), None)
    # (why it did not run: the last ladder row's word, with every stage of the ladder on)
    l3 = next((ln for r in reversed(rows) if r.kind == "ladder" for ln in r.stages if ln["name"] == "fp8 convs"), None)
    what3 = "the resnet (and upsampler) 3x3 convs as 8-bit implicit-GEMM Triton kernels, inputs quantized by the norms"
    if first is None:
        ok, why = triton_conv.fp8_available(b.device)
        if spec.cls_name not in ("AutoencoderKL", "AutoencoderKLWan"):
            why = f"no 8-bit conv path for {spec.title} (SD/SDXL/SD3/FLUX and Wan decoders)"
        elif l3 is not None and l3["status"] != "applied":
            why = l3["detail"]
        elif ok:
            why = "no ladder row ran the 8-bit convs"
        out.append(_level_summary(3, what3, None, None, reason=why))
        return out
    last = ladder[-1]
    off = b.run(LEVEL3_OFF, "fp8", _ladder_fn(b, {**acc, "fp8": "off"}, tuned))
    rows.append(off)
    d = (_stage_line(last, "fp8 convs") or {}).get("data") or {}
    s = _level_summary(3, what3, last, off, reason=off.reason, layers=d.get("layers"))
    s["first_row"] = first.name
    if d.get("resnet_format"):
        s["resnet_format"] = d["resnet_format"]
    out.append(s)
    return out


def _level_summary(level: int, what: str, row: Row | None, base: Row | None, reason: str = "",
                   layers: int | None = None, weights_mib: tuple | None = None) -> dict:
    ok = row is not None and base is not None and row.status == "ok" and base.status == "ok"
    s = {"level": level, "what": what, "status": "ok" if ok else (row.status if row is not None and
                                                                  row.status != "ok" else "skipped"),
         "row": row.name if row is not None else None, "vs_row": base.name if base is not None else None,
         "layers": layers, "reason": "" if ok else reason}
    if ok:
        s.update(ms=row.median_ms, vs_ms=base.median_ms, psnr_db=row.psnr_db, vs_psnr_db=base.psnr_db,
                 peak_alloc_gib=row.peak_alloc_gib, vs_peak_alloc_gib=base.peak_alloc_gib)
    if weights_mib is not None and (ok or s["status"] == "fallback"):  # a fallback: what the layers would take
        s["weights_mib"], s["vs_weights_mib"] = weights_mib[1], weights_mib[0]
    return s


def level_lines(levels: list[dict]) -> list[str]:
    """One line per FP8 level for the table's foot: what it changed against the row it adds to, or why it did not
    run."""
    out = []
    for s in levels:
        head = f"FP8 level {s['level']} ({LEVEL_NAMES[s['level']]})"
        if s["status"] != "ok":
            would = (f" (the decoder's weights would have gone {s['vs_weights_mib']:.1f} -> {s['weights_mib']:.1f} MiB)"
                     if s["status"] == "fallback" and s.get("weights_mib") is not None else "")
            out.append(f"{head}: {s['status']} — {s['reason']}{would}")
            continue
        parts = [f"{s['vs_ms']:.1f} -> {s['ms']:.1f} ms", f"PSNR {fidelity.psnr_text(s['vs_psnr_db'])} -> "
                 f"{fidelity.psnr_text(s['psnr_db'])}"]
        if s.get("weights_mib") is not None:
            parts.append(f"decoder weights {s['vs_weights_mib']:.1f} -> {s['weights_mib']:.1f} MiB")
        if s.get("peak_alloc_gib") is not None and s.get("vs_peak_alloc_gib") is not None:
            parts.append(f"peak {s['vs_peak_alloc_gib']:.2f} -> {s['peak_alloc_gib']:.2f} GiB")
        n = f"{s['layers']} layers" + (f" ({s['resnet_format']} resnet convs)" if s.get("resnet_format") else "")
        out.append(f"{head}: {n}; {', '.join(parts)} (vs '{s['vs_row']}')")
    return out


CHART_SOFTWARE = "vaeopt benchmark"


def is_own_output(path: Path) -> bool:
    """Whether an existing file is a result this command wrote (a benchmark JSON, a chart PNG), which a re-run may
    replace. Anything else is the user's (a model's config.json, a vaeopt.json manifest, a picture) and is kept."""
    try:
        if path.suffix.lower() == ".json":
            import json

            d = json.loads(path.read_text())
            return isinstance(d, dict) and isinstance(d.get("rows"), list) and "latent_shape" in d
        from PIL import Image

        with Image.open(path) as im:
            return im.format == "PNG" and im.info.get("Software") == CHART_SOFTWARE
    except Exception:  # noqa: BLE001  unreadable, not JSON, not an image: not ours
        return False


def _row_skipped(name: str, stages: list[dict], spec: FamilySpec, shape: tuple = ()) -> tuple[str, str] | None:
    """(status, reason) when a ladder row's stage did nothing, so that the row is shown as skipped rather than as a
    measurement of the row above it; None when it ran (or, for stage lines as built, may run: armed CUDA graphs)."""
    plan = next((s for s in stages if s["name"] == "plan"), None)
    if name == "+ planner (tile/chunk)" and plan and plan["detail"].startswith(("whole decode", "chunk 1 ",
                                                                                "whole frames")):
        return "skipped", f"nothing to change: {plan['detail']}"
    # the Triton conv row also carries FP8 level 3, whose e4m3 convs are Triton kernels: it counts when those ran
    fp8_convs = any(s["name"] == "fp8 convs" and s["status"] == "applied" for s in stages)
    key = _ROW_STAGE.get(name)
    if not key or (name == "+ Triton conv" and fp8_convs):
        return None
    if name in ("+ stacked Conv3d", "+ Triton conv") and spec.cls_name == "AutoencoderKLWan" and len(shape) == 5 \
            and shape[2] == 1 and not fp8_convs:
        return "skipped", ("one latent frame in one call: every causal conv runs as the 2D conv of its last temporal "
                           "tap (the chunk decoder's own), so no Conv3d is left for this stage")
    line = next((s for s in stages if s["name"] == key), None)
    if line is None:  # the pipeline has no such stage for this family (e.g. stacked Conv3d for an image VAE)
        return "skipped", f"no {key} stage for {spec.name}: nothing to apply"
    if line["status"] in ("skipped", "fallback"):
        return line["status"], line["detail"]
    return None


# each ladder row's stage: a row counts only when its stage's line says "applied"
_ROW_STAGE = {"+ fp8": "fp8", "+ channels_last": "channels_last", "+ fused norms (Triton)": "fused_norms",
              "+ fused epilogues": "fused_epilogues", "+ phase upsample convs": "upsample_conv",
              "+ stacked Conv3d": "stacked_conv3d", "+ Triton conv": "triton_conv", "+ attention backend": "attention",
              "+ CUDA graphs": "graphs"}


def _speedups(rows: list[Row], dtype) -> str | None:
    """Fill each row's speedups; returns the baseline row's name: diffusers' eager decode in the benchmark's dtype,
    else the fp32 reference (speedup_vs_baseline). speedup_vs_diffusers_bf16 only where that is the baseline."""
    base = next((r for r in rows if r.name == f"diffusers {DTYPE_NAMES[dtype]} eager" and r.status == "ok"), None)
    base = base or next((r for r in rows if r.kind == "reference"), None)
    peers = [r for r in rows if r.kind in ("peer", "reference") and r.status == "ok" and r.median_ms]
    best = min(peers, key=lambda r: r.median_ms) if peers else None
    for r in rows:
        if r.status == "ok" and r.median_ms:
            if base:
                r.speedup_vs_baseline = base.median_ms / r.median_ms
                if base.name == "diffusers bf16 eager":
                    r.speedup_vs_diffusers_bf16 = r.speedup_vs_baseline
            if best:
                r.speedup_vs_best_peer = best.median_ms / r.median_ms
    return base.name if base else None


PLOT_MISSING = "--plot draws with matplotlib, which is not installed: pip install 'vaeopt[plot]' (or matplotlib)"
_KIND_COLORS = {"reference": "#9e9e9e", "peer": "#4a78c2", "ladder": "#e8782a", "fp8": "#6aa84f"}
_KIND_LABELS = {"reference": "fp32 reference", "peer": "diffusers peers", "ladder": "vaeopt ladder",
                "fp8": "FP8 levels alone"}


def plot_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def hardware_line(result: dict) -> str:
    """What the numbers were measured on, for a chart's title: the device and the versions that set the speed."""
    v = result.get("versions") or {}
    where = result.get("gpu") or "CPU (CPU numbers, not GPU performance)"
    soft = ", ".join(f"{k} {v[k]}" for k in ("torch", "cuda", "diffusers") if v.get(k))
    return f"{where}" + (f" · {soft}" if soft else "")


def plot(result: dict, path: Path) -> None:
    """Horizontal bars of the median time per measured row (min-max whiskers), each labelled with its time, its
    speedup and its PSNR vs the fp32 reference; the skipped rows listed under the chart with their reasons; the
    hardware line as the title. Needs matplotlib (the `plot` extra)."""
    if not plot_available():
        raise VaeoptError(PLOT_MISSING)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = [r for r in result["rows"] if r["status"] == "ok" and r.get("median_ms")]
    skipped = [r for r in result["rows"] if r["status"] != "ok"]
    base = result.get("speedup_baseline")
    skip_lines = [textwrap.shorten(f"{r['name']}{'' if r['status'] == 'skipped' else ' (' + r['status'] + ')'}: "
                                   f"{r['reason']}", 118, placeholder=" ...") for r in skipped]
    bar_h = 0.42  # inches per row
    foot = 0.3 + 0.165 * (len(skip_lines) + 1) if skip_lines else 0.3
    fig = Figure(figsize=(11, 1.5 + bar_h * max(len(rows), 1) + foot), dpi=110)
    top = 1 - 1.05 / fig.get_figheight()
    bottom = (foot + 0.45) / fig.get_figheight()
    ax = fig.add_axes((0.22, bottom, 0.55, top - bottom))
    y = list(range(len(rows)))[::-1]  # the first row on top
    med = [r["median_ms"] for r in rows]
    err = [[r["median_ms"] - r["min_ms"] for r in rows], [r["max_ms"] - r["median_ms"] for r in rows]]
    ax.barh(y, med, height=0.62, color=[_KIND_COLORS.get(r["kind"], "#777777") for r in rows],
            xerr=err, error_kw={"ecolor": "#333333", "elinewidth": 0.8, "capsize": 2.5})
    ax.set_yticks(y, [textwrap.shorten(r["name"], 40, placeholder="...") for r in rows], fontsize=10)
    ax.set_xlabel("median decode time (ms; whiskers: min-max of the timed repeats)", fontsize=10)
    ax.set_xlim(0, max(max(r["max_ms"] for r in rows), 1e-9) * 1.02 if rows else 1)
    ax.grid(axis="x", color="#dddddd", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    # each row's numbers in a column right of the axes: time, speedup, PSNR
    tx = ax.get_yaxis_transform()  # x in axes fractions, y in rows
    for yi, r in zip(y, rows):
        sp = r.get("speedup_vs_baseline")
        psnr = "reference" if r["kind"] == "reference" else fidelity.psnr_text(r.get("psnr_db"))
        ax.text(1.03, yi, f"{r['median_ms']:.1f} ms", transform=tx, va="center", fontsize=9.5)
        ax.text(1.18, yi, f"{sp:.2f}x" if sp else "-", transform=tx, va="center", fontsize=9.5,
                fontweight="bold" if sp and sp > 1.005 and r["kind"] != "reference" else "normal")
        ax.text(1.31, yi, psnr, transform=tx, va="center", fontsize=9.5)
    for x, head in ((1.03, "time"), (1.18, "speedup"), (1.31, "PSNR")):
        ax.text(x, 1.0, head, transform=ax.transAxes, va="bottom", fontsize=9.5, fontweight="bold")
    kinds = [k for k in _KIND_COLORS if any(r["kind"] == k for r in rows)]
    ax.legend(handles=[Patch(color=_KIND_COLORS[k], label=_KIND_LABELS[k]) for k in kinds], loc="lower left",
              bbox_to_anchor=(0, 1.0), ncol=len(kinds), fontsize=8.5, frameon=False, borderaxespad=0.2)
    fig.suptitle(hardware_line(result), fontsize=12.5, fontweight="bold", y=1 - 0.18 / fig.get_figheight())
    what = (f"{result.get('workload') or result['family']}, latent {tuple(result['latent_shape'])}, "
            f"{result['dtype']}, median of {result.get('repeats', '?')} repeats; speedup vs '{base}', PSNR vs the "
            "fp32 reference")
    fig.text(0.5, 1 - 0.5 / fig.get_figheight(), what, ha="center", fontsize=9.5, color="#444444")
    if skip_lines:
        fig.text(0.02, (foot - 0.05) / fig.get_figheight(), "Not timed (the reasons in full: --json, or the table's foot with -v):\n" + "\n".join(skip_lines), fontsize=8.5,
                 va="top", color="#555555", linespacing=1.35)
    with atomic_path(path) as tmp:
        # "Software": how a later --plot knows the file it would replace is a chart of ours
        fig.savefig(tmp, format="png", metadata={"Software": CHART_SOFTWARE})
