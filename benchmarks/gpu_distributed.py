"""Band-parallel multi-GPU decode (vaeopt.distributed) vs vaeopt on one GPU, on one 2- or 4-GPU host (NCCL).

Workloads (full-size diffusers architectures, random weights seeded identically on every rank, bf16, the pipeline's
stages applied: fused GroupNorm/RMSNorm kernels, epilogues, channels_last; CUDA graphs off):
  * sdxl-4096:  AutoencoderKL (SDXL), raw latents (1, 4, 512, 512) -> 4096x4096
  * wan21-720p: AutoencoderKLWan (Wan 2.1), raw latents (1, 16, 21, 90, 160) -> 81 frames 720x1280
For each: the single-GPU vaeopt decode on rank 0 alone (Pipeline.decode with the planner's plan; its own timer, which
stops before the copy to the host), then band_parallel_decode on all GPUs (and, on a 4-GPU host, also on GPUs 0-1 as
a 2-rank subgroup), timed on rank 0 from a barrier to the gathered result on its GPU (the gather is included).
One warm-up + --repeats timed runs each, median reported. Per-rank peak memory (max_memory_allocated over the timed
runs), PSNR / max |diff| of the band-parallel result vs the single-GPU result (both bf16), speedup. Plus an fp32
exactness check (TF32 off) of sdxl on a small latent. Table last; JSON to $OUT/distributed.json (or --out).

    python benchmarks/gpu_distributed.py                 # all visible GPUs (spawns one process per GPU, NCCL)
    torchrun --nproc-per-node 4 benchmarks/gpu_distributed.py
    python benchmarks/gpu_distributed.py --tiny --device cpu --gpus 2   # smoke test of this script (gloo, CPU)
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vaeopt import bands  # noqa: E402
from vaeopt import distributed as D  # noqa: E402

GiB = 2**30
WORKLOADS = {
    "sdxl-4096": ("sdxl", (1, 4, 512, 512)),
    "wan21-720p": ("wan21", (1, 16, 21, 90, 160)),
}
TINY = {  # --tiny: same code path, small models and latents (CPU smoke test)
    "sdxl-4096": ("sdxl", (1, 4, 24, 20), dict(block_out_channels=[32, 32, 64, 64], norm_num_groups=8)),
    "wan21-720p": ("wan21", (1, 16, 5, 9, 8), dict(base_dim=16)),
}
TARGETS = {("wan21-720p", 2): 1.8, ("wan21-720p", 4): 3.2, ("sdxl-4096", 2): 1.7}


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(4.0 / mse)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_peak(dev):
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def peak(dev):
    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None


def build(family: str, tiny: bool, overrides: dict, device: torch.device, dtype: str, log):
    from vaeopt.families import build_model, get_family
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    spec = get_family(family)
    torch.manual_seed(0)  # same weights on every rank
    model = build_model(spec, **overrides)
    if overrides:
        spec = spec.with_config(overrides)
    loaded = LoadedVAE(model=model, family=spec, layout="random-init", path=None, notes=[], dtype_on_disk=None)
    return Pipeline(loaded, Options(device=str(device), dtype=dtype, graphs="off"), log=log)


def latents(shape, device, dtype):
    g = torch.Generator().manual_seed(1234)
    return torch.randn(shape, generator=g).to(device, dtype)


def time_band(pipe, z, group, chunk, repeats, dev, in_group: bool):
    """Median seconds of band_parallel_decode over `repeats` (after a warm-up), timed by rank 0; peak bytes."""
    times, out = [], None
    for i in range(repeats + 1):
        dist.barrier()
        if i == 1:
            reset_peak(dev)
        sync(dev)
        t0 = time.perf_counter()
        if in_group:
            with torch.inference_mode():
                out = D.band_parallel_decode(pipe.model, z, group, chunk=chunk)
        sync(dev)
        if i > 0:
            times.append(time.perf_counter() - t0)
        if i < repeats:
            out = None
    return statistics.median(times), times, out, peak(dev)


def time_band_ab(pipe, z, group, chunk, repeats, dev, in_group: bool) -> dict:
    """--stack-ab: band decodes with the bands' time-stacked convs on / off (bands.BAND_STACK), interleaved rounds
    after one warm-up of each; rank 0's median seconds per variant."""
    res: dict = {}
    saved = bands.BAND_STACK
    try:
        for i in range(repeats + 1):
            for v in (True, False):
                bands.BAND_STACK = v
                dist.barrier()
                sync(dev)
                t0 = time.perf_counter()
                if in_group:
                    with torch.inference_mode():
                        D.band_parallel_decode(pipe.model, z, group, chunk=chunk)
                sync(dev)
                if i > 0:
                    res.setdefault("stacked" if v else "conv3d", []).append(time.perf_counter() - t0)
    finally:
        bands.BAND_STACK = saved
    return {k: {"median_s": statistics.median(t), "times": t} for k, t in res.items()}


def profile_kernels(fn, dev, record: bool, trace: str | None = None) -> dict | None:
    """One call of fn under torch.profiler (CUDA kernels) on every rank; rank 0's kernel time by category, its busy
    time (union of kernel intervals) and span (first kernel start to last kernel end)."""
    from torch.profiler import ProfilerActivity, profile as tprof

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_profile import category

    dist.barrier()
    sync(dev)
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with tprof(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(dev)
        wall = time.perf_counter() - t0
    if trace:  # every rank's chrome trace (host and GPU), gzipped, for benchmarks/trace_gaps.py-style reading
        raw = Path(trace.format(rank=dist.get_rank()))
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
            g.write(f.read())
        raw.unlink()
    if not record:
        return None
    by_cat: dict = {}
    top: dict = {}
    iv = []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.name.startswith("nccl:"):  # (GPU-side annotations of NCCL calls,
            continue  # recorded with CPU activity on: they span the kernels, which are counted themselves)
        t = e.device_time / 1e3
        c = "nccl" if "nccl" in e.name.lower() else category(e.name)
        by_cat[c] = by_cat.get(c, 0.0) + t
        top[e.name[:90]] = top.get(e.name[:90], 0.0) + t
        iv.append((e.time_range.start, e.time_range.end))
    iv.sort()
    busy, cur = 0.0, None
    for a, b in iv:
        if cur is None or a > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur is not None:
        busy += cur[1] - cur[0]
    span = (iv[-1][1] - iv[0][0]) / 1e3 if iv else 0.0
    return {"wall_ms": wall * 1e3, "busy_ms": busy / 1e3, "span_ms": span, "kernels": len(iv),
            "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": sorted(top.items(), key=lambda kv: -kv[1])[:20]}


def run_workload(name: str, args, rank: int, world: int, dev: torch.device, sub2) -> dict:
    fam, shape, ov = (TINY[name] if args.tiny else (*WORKLOADS[name], {}))
    say = (lambda s: print(f"[{name}] {s}", flush=True)) if rank == 0 else (lambda s: None)
    dtype = "fp32" if dev.type == "cpu" else "bf16"
    t0 = time.perf_counter()
    pipe = build(fam, args.tiny, ov, dev, dtype, say)
    z = latents(shape, dev, pipe.dtype)
    say(f"built + optimized in {time.perf_counter() - t0:.1f} s; stages: "
        + ", ".join(f"{s.name}={s.status}" for s in pipe.stages))
    row = {"workload": name, "family": fam, "latent": list(shape), "dtype": str(pipe.dtype).replace("torch.", ""),
           "world": world}

    # ---- single GPU: rank 0 alone, vaeopt's pipeline with its planner
    single = None
    if rank == 0:
        plan = pipe.plan(shape)
        say(f"single-GPU plan: {plan.reason}")
        secs = []
        for i in range(args.repeats + 1):
            out, st = pipe.decode(z, plan)
            if i > 0:
                secs.append(st.seconds)
            if i < args.repeats:
                del out
        single = out
        row["single"] = {"seconds": statistics.median(secs), "times": secs, "peak_gib": (st.peak_bytes or 0) / GiB,
                         "plan": plan.to_dict()}
        say(f"single GPU: {row['single']['seconds'] * 1e3:.0f} ms (peak {row['single']['peak_gib']:.2f} GiB)")
        if args.profile and dev.type == "cuda":
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from gpu_profile import profile  # kernel ms by category (after one unprofiled call)

            row["single"]["profile"] = profile(lambda p=pipe, z=z, plan=plan: p.decode(z, plan), n=1)
            say(f"single GPU profile: {_prof_line(row['single']['profile'])}")
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # ---- band-parallel on all ranks (and on ranks 0-1 of a 4-GPU host)
    groups = [("all", None, world, True)]
    if sub2 is not None:
        groups.append(("2", sub2, 2, rank < 2))
    row["band"] = {}
    for label, group, n, member in groups:
        h = shape[-2]
        band_shape = tuple(shape[:-2]) + (math.ceil(h / n), shape[-1])
        chunk = pipe.plan(band_shape).chunk if len(shape) == 5 else None
        med, times, out, pk = time_band(pipe, z, group, chunk, args.repeats, dev, member)
        peaks = [None] * world
        dist.all_gather_object(peaks, pk if member else None)
        r = {"ranks": n, "seconds": med, "times": times, "chunk": chunk, "band_stack": bands.BAND_STACK,
             "peak_gib_per_rank": [p / GiB if p else None for p in peaks[:n]]}
        if args.stack_ab and len(shape) == 5:
            r["stack_ab"] = time_band_ab(pipe, z, group, chunk, args.repeats, dev, member)
            say("bands, time-stacked 384-ch convs vs Conv3d: " + ", ".join(
                f"{k} {v['median_s'] * 1e3:.1f} ms" for k, v in r["stack_ab"].items()))
        if args.profile and dev.type == "cuda":
            def one(model=pipe.model, z=z, group=group, chunk=chunk, member=member):
                if member:
                    with torch.inference_mode():
                        D.band_parallel_decode(model, z, group, chunk=chunk)
            tr = (str(Path(os.environ.get("OUT", ".")) / f"band_trace_{name}_{label}_rank{{rank}}.json")
                  if args.trace else None)
            r["profile_rank0"] = profile_kernels(one, dev, rank == 0, tr)
            if rank == 0:
                say(f"band profile, rank 0: {_prof_line(r['profile_rank0'])}")
        if rank == 0:
            o = out.float().cpu()
            r["psnr_vs_single_db"] = psnr(o, single)
            r["max_abs_vs_single"] = (o - single).abs().max().item()
            r["max_abs_rel_to_range"] = r["max_abs_vs_single"] / max(single.abs().max().item(), 1e-12)
            r["speedup"] = row["single"]["seconds"] / med
            tgt = TARGETS.get((name, n))
            r["target"] = tgt
            say(f"band-parallel on {n} ranks: {med * 1e3:.0f} ms, speedup {r['speedup']:.2f}x"
                + (f" (goal {tgt}x)" if tgt else "") + f", PSNR vs single {r['psnr_vs_single_db']:.1f} dB, "
                f"max |diff| {r['max_abs_vs_single']:.3g} ({r['max_abs_rel_to_range']:.2g} of max |x|), "
                f"peak/rank {', '.join(f'{p:.2f}' for p in r['peak_gib_per_rank'] if p is not None)} GiB")
            del o
        del out
        row["band"][label] = r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    del pipe, z, single
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _prof_line(p: dict) -> str:
    head = (f"wall {p['wall_ms']:.0f} ms, kernels busy {p['busy_ms']:.0f} of a {p['span_ms']:.0f} ms span; "
            if "busy_ms" in p else "")
    return head + ", ".join(f"{k} {v:.1f}" for k, v in p["by_category_ms"].items())


def fp32_check(args, rank: int, dev: torch.device) -> dict:
    """sdxl fp32 on a small latent, TF32 off: band-parallel vs the model's own decode on rank 0."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ov = TINY["sdxl-4096"][2] if args.tiny else {}
    pipe = build("sdxl", args.tiny, ov, dev, "fp32", lambda s: None)
    z = latents((1, 4, 40, 48), dev, torch.float32)
    with torch.inference_mode():
        out = D.band_parallel_decode(pipe.model, z)
        ref = pipe.model.decode(z).sample if rank == 0 else None
    res = {}
    if rank == 0:
        res = {"latent": [1, 4, 40, 48], "psnr_db": psnr(out, ref), "max_abs": (out - ref).abs().max().item()}
        print(f"[fp32 check] sdxl (1,4,40,48): band vs whole {res['psnr_db']:.1f} dB, max abs {res['max_abs']:.2e}",
              flush=True)
    del pipe
    # Wan 2.1 through the pipeline's stages (time-stacked 384-ch convs, the tapconv head, the chunked attention),
    # band-parallel vs the same pipeline's decode on one GPU, fp32
    ov = TINY["wan21-720p"][2] if args.tiny else {}
    pipe = build("wan21", args.tiny, ov, dev, "fp32", lambda s: None)
    shape = (1, 16, 5, 12, 20)
    z = latents(shape, dev, torch.float32)
    with torch.inference_mode():
        out, info = D.band_parallel_decode(pipe.model, z, chunk=2, return_info=True)
    if rank == 0:
        ref, _ = pipe.decode(z, pipe.plan(shape))
        o = out.float().cpu()
        res["wan21"] = {"latent": list(shape), "psnr_db": psnr(o, ref), "max_abs": (o - ref).abs().max().item(),
                        "stats": {k: v for k, v in info["stats"].items()
                                  if k in ("stacked_conv", "conv_taps", "attention_chunked", "triton_conv")}}
        w = res["wan21"]
        print(f"[fp32 check] wan21 {shape}: band vs one GPU {w['psnr_db']:.1f} dB, max abs {w['max_abs']:.2e}, "
              f"{w['stats']}", flush=True)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    del pipe
    dist.barrier()
    return res


def versions(dev) -> dict:
    from vaeopt.hw import machine_info

    v = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        v.update(machine_info().to_dict())
    except Exception as e:  # noqa: BLE001
        v["machine_info_error"] = str(e)
    if dev.type == "cuda":
        v["gpu_name"] = torch.cuda.get_device_name(dev)
        v["gpu_count"] = torch.cuda.device_count()
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            v["nccl"] = None
    try:
        v["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parent.parent).stdout.strip() or None
    except OSError:
        v["git"] = None
    v["env"] = {k: os.environ.get(k) for k in D.ENV_RULES}
    return v


def worker(args) -> dict | None:
    torch.backends.cudnn.benchmark = False
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = D.rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    sub2 = dist.new_group([0, 1]) if world >= 4 else None  # collective: every rank creates it
    t0 = time.perf_counter()
    rows = []
    for name in args.workloads.split(","):
        rows.append(run_workload(name, args, rank, world, dev, sub2))  # a failure ends all ranks (launch reports it)
    check = fp32_check(args, rank, dev) if not args.skip_fp32 else {}
    dist.barrier()
    if rank != 0:
        return None
    return {"versions": versions(dev), "world": world, "rows": rows, "fp32_check": check,
            "seconds_total": time.perf_counter() - t0, "tiny": args.tiny}


def table(res: dict) -> str:
    lines = [f"{'workload':<12} {'ranks':>5} {'ms':>9} {'speedup':>8} {'goal':>5} {'PSNR dB':>8} {'peak GiB/rank':>20}"]
    for row in res["rows"]:
        s = row["single"]
        lines.append(f"{row['workload']:<12} {1:>5} {s['seconds'] * 1e3:>9.1f} {1.0:>8.2f} {'':>5} {'':>8} "
                     f"{s['peak_gib']:>20.2f}")
        for r in sorted(row["band"].values(), key=lambda r: r["ranks"]):
            pk = "/".join(f"{p:.1f}" for p in r["peak_gib_per_rank"] if p is not None)
            goal = f"{r['target']:.1f}" if r.get("target") else ""
            lines.append(f"{'':<12} {r['ranks']:>5} {r['seconds'] * 1e3:>9.1f} {r['speedup']:>8.2f} {goal:>5} "
                         f"{r['psnr_vs_single_db']:>8.1f} {pk:>20}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None, help="ranks to spawn (default: all GPUs; torchrun: its world)")
    ap.add_argument("--workloads", default="sdxl-4096,wan21-720p")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda (NCCL, one GPU per rank) or cpu (gloo; with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="small models/latents (smoke test)")
    ap.add_argument("--skip-fp32", action="store_true")
    ap.add_argument("--timeout", type=float, default=1500.0)
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/distributed.json)")
    ap.add_argument("--stack-ab", action="store_true",
                    help="Wan: also time the bands with their time-stacked convs off (bands.BAND_STACK), interleaved")
    ap.add_argument("--profile", action="store_true",
                    help="one profiled decode each (single GPU; rank 0 of the bands): kernel ms by category")
    ap.add_argument("--trace", action="store_true", help="--profile, plus every rank's chrome trace to $OUT")
    args = ap.parse_args()
    args.profile = args.profile or args.trace
    backend = "gloo" if args.device == "cpu" else None
    n = args.gpus
    if n is None and not D.under_torchrun():
        n = torch.cuda.device_count() if args.device != "cpu" else 2
    t0 = time.perf_counter()
    res = D.launch(n, worker, args, backend=backend, timeout=args.timeout)
    if res is None:  # a torchrun rank other than 0
        return
    res["wall_seconds"] = time.perf_counter() - t0
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "distributed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    v = res["versions"]
    print(f"\n{v.get('gpu_name', 'CPU')} x{res['world']}, torch {v.get('torch')}, diffusers {v.get('diffusers')}, "
          f"nccl {v.get('nccl')}; {res['wall_seconds']:.0f} s total; JSON: {out}")
    if res.get("fp32_check"):
        c = res["fp32_check"]
        print(f"fp32 exactness (sdxl, latent (1,4,40,48), TF32 off): {c['psnr_db']:.1f} dB, max abs {c['max_abs']:.2e}")
    print(table(res))


if __name__ == "__main__":
    main()
