"""Shared by the GPU scripts: a full-size family model with random weights, optimized by vaeopt's pipeline."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vaeopt.families import build_model, get_family  # noqa: E402
from vaeopt.loading import LoadedVAE  # noqa: E402
from vaeopt.pipeline import Options, Pipeline  # noqa: E402


def random_model(fam: str, seed: int = 0) -> torch.nn.Module:
    """The family's full-size model on the CPU with random N(0, 0.02) weights (timing equals real weights)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = build_model(get_family(fam))
    m = m.to_empty(device="cpu")
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return m


def make_pipe(fam: str, seed: int = 0, **opts) -> Pipeline:
    """random_model in vaeopt's pipeline; Options default to CUDA, bf16, graphs/tiling off."""
    o = {"device": "cuda", "dtype": "bf16", "graphs": "off", "tiling": "off", **opts}
    return Pipeline(LoadedVAE(random_model(fam, seed), get_family(fam), "random", None, [], None), Options(**o))


def event_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median GPU time of fn() in ms over `reps` calls (CUDA events), after `warmup` calls."""
    import statistics

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def timed(fn, n: int):
    """(last output, wall ms of each of n synchronized calls)."""
    import time

    ts, out = [], None
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return out, ts


def out_dir():
    """$OUT (what the device tool brings back), created."""
    import os
    from pathlib import Path

    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_meta(command: str) -> dict:
    """Date, GPU and versions for a result file."""
    import datetime

    import triton

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "command": command,
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                         "cudnn": torch.backends.cudnn.version()}}


def no_tf32() -> None:
    """fp32 references without TF32 (cuDNN's default would put ~1e-3 relative error into them)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def interleaved_graph_ms(pipes: dict, z, rounds: int, before=None) -> dict:
    """CUDA-graph replays of each pipeline (already captured for z) in interleaved rounds, alternating the order;
    -> {name: [ms per replay]} (CUDA events). before(name), if given, runs ahead of each replay."""
    ms = {name: [] for name in pipes}
    with torch.inference_mode():
        for i in range(rounds):
            for name, p in (pipes.items() if i % 2 else reversed(pipes.items())):
                if before is not None:
                    before(name)
                ms[name].append(replay_ms(p, z))
    return ms


def replay_ms(pipe, z) -> float:
    """One CUDA-graph replay of a pipeline already captured for z, timed with CUDA events (ms)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    y = pipe.graphed(z)
    b.record()
    torch.cuda.synchronize()
    del y
    return a.elapsed_time(b)


def graph_ms(fn, n: int = 20, reps: int = 15) -> float:
    """GPU time of one fn() in ms: n calls captured in one CUDA graph, median replay / n. For kernels of ~10-200 us,
    where timing eager launches times the host."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return event_ms(g.replay, reps=reps) / n


def graph_rounds(call, specs: list, rounds: int, res: dict, flop: float) -> None:
    """Time call(spec) for each spec as CUDA-graph replays (graph_ms, 10 calls per graph), `rounds` times in
    alternating order; into res[spec]: "ms" (one per round), "median_ms" and "tflops" (from `flop` per call)."""
    import statistics

    for i in range(rounds):
        for s in (specs if i % 2 == 0 else specs[::-1]):
            res[s].setdefault("ms", []).append(graph_ms(lambda s=s: call(s), n=10, reps=10))
    for s in specs:
        res[s]["median_ms"] = statistics.median(res[s]["ms"])
        res[s]["tflops"] = flop / res[s]["median_ms"] / 1e9


def wan480_ab(settings: list, rounds: int, apply):
    """Whole wan21-480p decodes (random weights, seed 0, through the pipeline's video path) under each setting:
    one decode each for its output, then `rounds` interleaved timings (interleaved_ms). apply(setting) switches.
    -> (plan chunk, {setting: output in [-1, 1] on the CPU}, {setting: [ms]})."""
    from vaeopt.benchmark import WORKLOADS

    fam, shape = WORKLOADS["wan21-480p"]
    pipe = make_pipe(fam)
    plan = pipe.plan(shape)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    outs = {}
    with torch.inference_mode():
        for s in settings:
            apply(s)
            outs[s] = pipe._decode_video(z, plan, None).float().clamp(-1, 1).cpu()
        ms = interleaved_ms(lambda: pipe._decode_video(z, plan, None), settings, rounds, apply)
    return plan.chunk, outs, ms


def graphed_pipe(fam: str, z, fp8_gate: float | None, reason: str, **options):
    """-> (pipeline, first output): the family's model with diffusers' default init (seed 0, as `vaeopt benchmark`),
    bf16 on CUDA, FP8 level 3 at fp8_gate dB if given, its CUDA graph captured for z (so module-level launch settings
    in force now are the ones baked into the graph). options: more Options fields."""
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline

    torch.manual_seed(0)
    o = dict(device="cuda", dtype="bf16", graphs="off", tiling="off")
    if fp8_gate is not None:
        o.update(fp8="on", gate_db=float(fp8_gate))
    o.update(options)
    p = Pipeline(load_vae(None, family=fam), Options(**o))
    p.enable_graphs(reason)
    with torch.inference_mode():
        y = p.graphed(z)
    torch.cuda.synchronize()
    return p, y


def fp32_reference(fam: str, z) -> torch.Tensor:
    """The fp32 decode of z (on the GPU, TF32 as set by the caller) by the family's model with diffusers' default init
    (seed 0, as graphed_pipe builds it): the reference of the scripts' PSNR figures. The model is freed after."""
    from vaeopt.loading import load_vae

    torch.manual_seed(0)
    m = load_vae(None, family=fam).model.float().cuda().eval()
    with torch.no_grad():
        ref = m.decode(z.float()).sample.float()
    del m
    torch.cuda.empty_cache()
    return ref


def graph_kernel_ms(pipe, z, replays: int = 5) -> dict:
    """GPU time per decode by kernel name (first 90 characters), largest first: torch.profiler over `replays` CUDA
    graph replays of a pipeline already captured for z."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        pipe.graphed(z)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                pipe.graphed(z)
            torch.cuda.synchronize()
    by = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by[e.name[:90]] = by.get(e.name[:90], 0.0) + e.device_time / (1e3 * replays)  # us -> ms per decode
    return dict(sorted(by.items(), key=lambda t: -t[1]))


def interleaved_ms(fn, settings, rounds: int, apply) -> dict:
    """fn() timed (CUDA events) under each setting in turn, `rounds` times, the order alternating each round;
    apply(setting) switches to it. -> {setting: [ms per call]}."""
    ms = {s: [] for s in settings}
    for i in range(rounds):
        for s in (settings if i % 2 else settings[::-1]):
            apply(s)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y = fn()
            b.record()
            torch.cuda.synchronize()
            del y
            ms[s].append(a.elapsed_time(b))
    return ms


def wan_norm_inputs(C: int, H: int, W: int, taps: int, k: int, g, device="cuda"):
    """Inputs of one Wan RMS-norm call of the chunk decoder (bf16, channels_last_3d): (h, r, kw). h: a conv output
    of k frames, r: a residual, kw: rms_norm_silu's output arguments - the time-stacked conv input with `taps` and
    the next history (taps=3), or the frames after the 2-frame history in a conv buffer (taps=0)."""
    def mk():
        return torch.randn(1, C, k, H, W, generator=g).to(device, torch.bfloat16).contiguous(
            memory_format=torch.channels_last_3d)

    h, r = mk(), mk()
    if taps:
        out = torch.empty(k, taps * C, H, W, device=device, dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last)
        cache = torch.empty(1, C, taps - 1, H, W, device=device, dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last_3d)
        return h, r, dict(out=out, taps=taps, cache_out=cache)
    buf = torch.empty(1, C, k + 2, H, W, device=device, dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last_3d)
    return h, r, dict(out=buf[:, :, 2:])


def bf16_tma_tile(spec: str) -> None:
    """Run Wan's bf16 96-ch causal convs (where triton_conv takes them) on the TMA kernel with the tile
    "bh,bw,bk,bn0,bn1,warps,stages,bk1" instead of tma_conv.BF16_WAN96 (triton_conv packs K-major where
    tuned_config gives a bf16 tile). Process-wide: for benchmark scripts only."""
    from vaeopt.kernels import tma_conv

    tile = tma_conv.TmaConfig(*map(int, spec.split(",")))
    tuned = tma_conv.tuned_config

    def with_bf16(cin, cout, w, fp8, video=False):
        return tile if (not fp8 and video and cin == cout == 96) else tuned(cin, cout, w, fp8, video)

    tma_conv.tuned_config = with_bf16
