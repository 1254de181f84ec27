"""Exact tiled decoding on the GPU (vaeopt/tiling.py): speed, peak memory, host traffic and exactness of the tiled paths
against the untiled decode, for SDXL 2048^2 and 4096^2 in bf16, with the pipeline's stages (channels_last,
fused_norms, fused_epilogues, attention) -- random weights, as benchmarks/gpu_profile.py.

    python benchmarks/gpu_tiling.py [--quick]

Per workload: untiled (where it fits); tiled with storage on the GPU at several tile sizes (row bands, the default,
and 2D tiles once); storage forced to pinned host memory (overlapped copy streams, and once synchronous); and under
emulated budgets (torch.cuda.set_per_process_memory_fraction 16 GB / 8 GB, the planner choosing the plan through
Pipeline.plan with Options(vram_budget_gb=...)). Each: time (perf_counter after synchronize; first run and median of
the steady ones), peak allocated memory, estimate_tiled_bytes for the same configuration, the tiler's info (tiles,
shrinks, storage, bytes moved) and PSNR against the untiled bf16 decode. One kernel profile (kernel time by
category, kernel counts) of the 2048^2 tiled decode. Writes $OUT/tiling.json; prints a table last. Takes < 4 min.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_pipe  # noqa: E402  (full-size random-weight model through vaeopt's pipeline)

from vaeopt import tiling  # noqa: E402
from vaeopt.hw import machine_info  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
GIB = 2**30
DEADLINE_S = 215.0  # stop starting new runs after this (the script must stay < 4 min)
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = torch.mean((a.float() - b.float()) ** 2).item()
    return float("inf") if mse == 0 else 10 * math.log10(4.0 / mse)


def clean() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def timed(fn, reps: int) -> tuple[object, dict]:
    """Run fn 1 + reps times; -> (last result, timing/peak record). The first run pays compiles / host pinning."""
    times, res, peak = [], None, 0
    for i in range(1 + reps):
        res = None
        clean()
        t = time.perf_counter()
        res = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        peak = max(peak, torch.cuda.max_memory_allocated())
        if (elapsed() > DEADLINE_S and i >= 1) or times[0] > 20.0:  # a very slow configuration runs once
            break
    steady = times[1:] or times
    return res, {"first_ms": round(times[0] * 1e3, 1), "ms": round(statistics.median(steady) * 1e3, 1),
                 "runs": len(times), "peak_gib": round(peak / GIB, 3)}


def tiled_info(info: dict) -> dict:
    keep = ("tile", "planned_tile", "final_tile", "shrinks", "tiles", "passes", "storage", "kernels", "shape",
            "overlap", "bias_folded", "bytes_h2d", "bytes_d2h", "prefetch_hits")
    d = {k: info.get(k) for k in keep}
    for k in ("bytes_h2d", "bytes_d2h"):
        d[k.replace("bytes", "gib")] = round((d.pop(k) or 0) / GIB, 2)
    if info.get("oom_events"):
        d["oom_events"] = [list(map(str, e)) for e in info["oom_events"][:5]]
    return d


CATS = [  # kernel-name categories (first match wins), as in gpu_profile.py
    ("norm", ("_stats", "_apply", "_finalize", "welford", "group_norm", "rowwisemoments")),
    ("epilogue", ("_epi_",)),
    ("attention", ("fmha", "attention", "flash", "softmax", "gemm", "nvjet", "cublas")),
    ("conv", ("conv", "cudnn", "implicit", "xmma", "fprop", "cutlass", "sm90", "sm80")),
    ("copy", ("copy", "memcpy", "cat", "transpose", "nchwtonhwc", "nhwctonchw")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "fill", "add", "mul", "silu")),
]


def profile(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile as tprof

    fn()
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ms, cnt, top = collections.Counter(), collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        t = (e.device_time if hasattr(e, "device_time") else e.cuda_time) / 1e3
        n = e.name.lower()
        cat = next((c for c, keys in CATS if any(k in n for k in keys)), "other")
        ms[cat] += t
        cnt[cat] += 1
        top[e.name[:80]] += t
    return {"total_ms": round(sum(ms.values()), 1), "by_category_ms": {k: round(v, 1) for k, v in ms.most_common()},
            "kernels": dict(cnt), "kernels_total": sum(cnt.values()),
            "top_kernels_ms": [(k, round(v, 2)) for k, v in top.most_common(12)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2048^2 only, fewer configurations")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = False
    pipe = make_pipe("sdxl", tiling="auto")  # the planner may tile (budget runs)
    for st in pipe.stages:
        print(st.line())
    model = pipe.model
    dev = torch.device("cuda")
    total_mem = torch.cuda.get_device_properties(dev).total_memory
    results: dict = {"runs": [], "profile": None}
    rows = []  # table lines

    def record(workload, name, rec, ref=None, out=None, est=None, extra=None):
        rec = dict(workload=workload, config=name, **rec)
        if est is not None:
            rec["estimate_gib"] = round(est / GIB, 3)
        if ref is not None and out is not None:
            rec["psnr_db"] = round(psnr(out, ref), 2)
        if extra:
            rec.update(extra)
        results["runs"].append(rec)
        print(json.dumps(rec), flush=True)
        return rec

    workloads = [("sdxl-2048", 256)] + ([] if args.quick else [("sdxl-4096", 512)])
    for wl, lat in workloads:
        torch.manual_seed(1)
        z = torch.randn(1, 4, lat, lat, device=dev, dtype=torch.bfloat16)
        hw = (lat, lat)
        # ---- untiled
        ref = None
        try:
            with torch.inference_mode():
                ref, rec = timed(lambda: model.decode(z).sample, 2)
            record(wl, "untiled", rec)
        except torch.cuda.OutOfMemoryError as e:
            record(wl, "untiled", {"error": f"OOM: {str(e)[:120]}"})
            ref = None
        clean()

        kept = {}  # outputs kept for the overlap-vs-synchronous bitwise check

        def run_tiled(name, tile, reps=2, keep=None, **kw):
            kw.setdefault("shape", "bands")
            if elapsed() > DEADLINE_S:
                record(wl, name, {"skipped": "time budget"})
                return None
            try:
                with torch.inference_mode():
                    res, rec = timed(lambda: tiling.tiled_decode(model, z, tile=tile, return_info=True, **kw), reps)
                out, info = res
                on_dev = str(info["storage"]).startswith("cuda")
                est = tiling.estimate_tiled_bytes(model, hw, info["tile"], torch.bfloat16, storage_on_device=on_dev,
                                                  shape=info["shape"], kernels=info["kernels"])
                extra = {"info": tiled_info(info)}
                if keep is not None:
                    kept[keep] = out.cpu()
                    if len(kept) == 2:  # the copy streams must not change a single bit
                        extra["bitwise_equal_to_sync_copies"] = bool(torch.equal(*kept.values()))
                r = record(wl, name, rec, ref, out, est, extra)
                rows.append((wl, name, r))
                del out
                return info
            except Exception as e:  # record and go on: one failure must not lose the other numbers
                record(wl, name, {"error": f"{type(e).__name__}: {str(e)[:200]}",
                                  "trace": traceback.format_exc()[-800:]})
                return None
            finally:
                clean()

        # ---- tiled, storage on the GPU
        tiles = (64, 128, 256) if lat == 256 else (64, 128, 256)
        for t in tiles:
            run_tiled(f"tiled {t * 8}px bands, gpu storage", t, storage="cuda")
        if lat == 256:
            run_tiled("tiled 1024px 2D tiles, gpu storage", 128, storage="cuda", shape="tiles")
            run_tiled("tiled 1024px bands, gpu storage, torch path", 128, storage="cuda", kernels=False)
        # ---- storage forced to pinned host memory
        run_tiled("tiled 1024px bands, cpu storage (overlap)", 128, storage="cpu", reps=1 if lat > 256 else 2,
                  keep="overlap")
        if lat == 256:
            run_tiled("tiled 1024px bands, cpu storage (sync copies)", 128, storage="cpu", overlap=False, reps=1,
                      keep="sync")
        if lat > 256 and not args.quick:
            run_tiled("tiled 2048px bands, cpu storage (overlap)", 256, storage="cpu", reps=1)

        # ---- emulated budgets: the planner picks whole / tile, the pipeline decodes (and the tiler picks storage)
        for gb in (16, 8):
            name = f"budget {gb} GB (planner)"
            if elapsed() > DEADLINE_S:
                record(wl, name, {"skipped": "time budget"})
                continue
            clean()
            try:
                torch.cuda.set_per_process_memory_fraction(min(1.0, gb * GIB / total_mem), torch.cuda.current_device())
                pipe.opts.vram_budget_gb = float(gb)
                plan = pipe.plan(tuple(z.shape))
                outs, stats = [], []
                for _ in range(2):  # first (compiles, pinning) + one steady
                    clean()
                    o, st = pipe.decode(z, plan)
                    outs = [o]
                    stats.append(st)
                    if elapsed() > DEADLINE_S or st.seconds > 20.0:
                        break
                rec = {"first_ms": round(stats[0].seconds * 1e3, 1), "ms": round(stats[-1].seconds * 1e3, 1),
                       "peak_gib": round(max(s.peak_bytes or 0 for s in stats) / GIB, 3),
                       "plan": {k: plan.to_dict()[k] for k in ("mode", "tile", "est_bytes", "reason")},
                       "retries": stats[-1].retries}
                est = None
                if stats[-1].tiling:
                    info = stats[-1].tiling
                    rec["info"] = tiled_info(info)
                    on_dev = str(info["storage"]).startswith("cuda")
                    est = tiling.estimate_tiled_bytes(model, hw, info["tile"], torch.bfloat16,
                                                      storage_on_device=on_dev, shape=info["shape"],
                                                      kernels=info["kernels"])
                r = record(wl, name, rec, ref.float().cpu() if ref is not None else None, outs[-1], est)
                rows.append((wl, name, r))
                del outs
            except Exception as e:
                record(wl, name, {"error": f"{type(e).__name__}: {str(e)[:200]}",
                                  "trace": traceback.format_exc()[-800:]})
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
                pipe.opts.vram_budget_gb = None
                clean()
        del ref, z
        clean()
        # ---- one kernel profile: 2048^2, 1024-px bands, storage on the GPU
        if lat == 256 and elapsed() < DEADLINE_S:
            z2 = torch.randn(1, 4, lat, lat, device=dev, dtype=torch.bfloat16)
            try:
                with torch.inference_mode():
                    prof = profile(lambda: tiling.tiled_decode(model, z2, tile=128, storage="cuda"))
                results["profile"] = dict(config=f"{wl} tiled 1024px bands, gpu storage", **prof)
                print(json.dumps(results["profile"]), flush=True)
            except Exception as e:
                results["profile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            del z2
            clean()

    mi = machine_info()
    results.update(gpu=mi.gpus[0].name if mi.gpus else torch.cuda.get_device_name(),
                   versions={"torch": mi.torch, "cuda": mi.cuda, "cudnn": mi.cudnn, "triton": mi.triton,
                             "diffusers": mi.diffusers},
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="python benchmarks/gpu_tiling.py" + (" --quick" if args.quick else ""),
                   stages=[s.line() for s in pipe.stages], wall_s=round(elapsed(), 1))
    (OUT / "tiling.json").write_text(json.dumps(results, indent=1, default=str))

    print(f"\n{'workload':10} {'config':46} {'ms':>8} {'first':>8} {'peak':>6} {'est':>6} {'PSNR':>6} "
          f"{'tiles':>5} {'shr':>3} {'storage':>7} {'h2d':>6} {'d2h':>6}")
    for r in results["runs"]:
        info = r.get("info") or {}
        if "error" in r or "skipped" in r:
            print(f"{r['workload']:10} {r['config']:46} {r.get('error', r.get('skipped'))[:60]}")
            continue
        print(f"{r['workload']:10} {r['config']:46} {r['ms']:8.1f} {r['first_ms']:8.1f} {r['peak_gib']:6.2f} "
              f"{r.get('estimate_gib', float('nan')):6.2f} {r.get('psnr_db', float('nan')):6.1f} "
              f"{str(info.get('tiles', '-')):>5} {str(info.get('shrinks', '-')):>3} "
              f"{str(info.get('storage', '-'))[:7]:>7} {info.get('gib_h2d', 0):6.1f} {info.get('gib_d2h', 0):6.1f}")
    if results["profile"]:
        p = results["profile"]
        print(f"profile ({p['config']}): {p['total_ms']} ms kernel time, {p['kernels_total']} kernels; "
              f"{p['by_category_ms']}")
    print(f"wrote {OUT / 'tiling.json'} ({elapsed():.0f} s)")


if __name__ == "__main__":
    main()
