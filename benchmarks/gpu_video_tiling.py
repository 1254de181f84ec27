"""Spatially tiled video decoding on the GPU (vaeopt/video_tiling.py): wan21-720p within 16 / 8 / 6 GB budgets.

Workload wan21-720p: full-size Wan 2.1 VAE with random weights through vaeopt's pipeline (bf16, channels_last,
fused norms / epilogues, ... as `vaeopt decode` sets it up), latents (1, 16, 21, 90, 160) -> 81 frames 720x1280.

    python benchmarks/gpu_video_tiling.py [--quick]
    python benchmarks/gpu_video_tiling.py --smoke     # this script's logic on the CPU: tiny Wan 2.1, small latent

Rows:
  * untiled, chunk 1 and chunk 2 (no budget): the references for PSNR (same chunk size) and the baseline times;
  * forced tiled plans: 2 bands from the last up block (caches on the GPU), 3 bands from up block 2 (GPU), 6 bands
    from up block 2 with the caches in pinned host memory (copy streams, and once synchronous copies: the two must
    be bitwise equal);
  * budgets emulated with torch.cuda.set_per_process_memory_fraction (16, 8, 6 GB), the planner choosing the plan
    (Pipeline.plan with Options(vram_budget_gb=...)) and the pipeline decoding it (with its OOM fallback; retries
    are reported); plus 8 GB with tiling forced on;
  * the allocator: untiled chunk 1 under an 8 GB cap with the causal caches allocated one by one vs from one block
    (video_tiling._Arena; the first run of this script, without it, saw 30-48% reserved over allocated).
Each: time (first run and steady run, perf_counter after synchronize), peak allocated and reserved memory, the
planner's estimate for that plan (dry run + 15% + weights + output) and the raw dry run, the plan and its reason,
PSNR of the output against the untiled bf16 decode with the same chunk size (frames compared in pieces on the CPU).
Also an fp32 exactness check (TF32 off) on a small latent: tiled vs untiled, several tile shapes and splits.
Writes $OUT/video_tiling.json; prints a table last. Stays under ~4 min (DEADLINE_S).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import make_pipe  # noqa: E402  (full-size random-weight model through vaeopt's pipeline)

from vaeopt import planner, video  # noqa: E402
from vaeopt import video_tiling as vt  # noqa: E402
from vaeopt.hw import machine_info  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
GIB = 2**30
DEADLINE_S = 200.0  # stop starting new runs after this
T0 = time.perf_counter()
SHAPE = (1, 16, 21, 90, 160)


def elapsed() -> float:
    return time.perf_counter() - T0


CUDA = torch.cuda.is_available()


def clean() -> None:
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peaks() -> tuple[int, int]:
    return (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if CUDA else (0, 0)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR over [-1, 1] of two (N, C, T, H, W) clips, accumulated over frame groups in fp64 on the CPU."""
    se, n = 0.0, 0
    for t in range(0, a.shape[2], 8):
        d = a[:, :, t : t + 8].double().cpu() - b[:, :, t : t + 8].double().cpu()
        se += float(d.pow(2).sum())
        n += d.numel()
    return float("inf") if se == 0 else 10 * math.log10(4.0 / (se / n))


def timed(fn, runs: int = 2) -> tuple[object, dict]:
    """fn() `runs` times (the first pays Triton compiles, cuDNN heuristics, host pinning); -> (last result, record)."""
    times, res = [], None
    peak = peak_res = 0
    for i in range(runs):
        res = None
        clean()
        t = time.perf_counter()
        res = fn()
        clean_sync()
        times.append(time.perf_counter() - t)
        peak, peak_res = (max(a, b) for a, b in zip((peak, peak_res), peaks()))
        if elapsed() > DEADLINE_S or times[0] > 30.0:
            break
    return res, {"first_s": round(times[0], 3), "s": round(min(times[1:] or times), 3), "runs": len(times),
                 "peak_gib": round(peak / GIB, 3), "peak_reserved_gib": round(peak_res / GIB, 3)}


def slim(info: dict) -> dict:
    d = {k: info[k] for k in ("tiles", "halo", "split", "shrinks", "prefetch_hits") if k in info}
    for k in ("cache_bytes", "bytes_h2d", "bytes_d2h"):
        if k in info:
            d[k.replace("bytes", "gib")] = round(info[k] / GIB, 2)
    if info.get("plan") is not None:
        d["plan"] = str(info["plan"])
    if info.get("oom_events"):
        d["oom_events"] = [{k: str(v) for k, v in e.items()} for e in info["oom_events"]]
    return d


def clean_sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def model_pipe(smoke: bool, **opts):
    """The full-size Wan 2.1 (random weights) through vaeopt's pipeline; --smoke: base_dim 16 on the CPU, fp32."""
    if not smoke:
        return make_pipe("wan21", tiling="auto", **opts)
    from vaeopt.families import build_model, get_family
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    spec = get_family("wan21")
    torch.manual_seed(opts.pop("seed", 0))
    m = build_model(spec, base_dim=16)
    o = {"device": "cpu", "graphs": "off", "tiling": "auto", **opts, "dtype": "fp32"}
    return Pipeline(LoadedVAE(m, spec, "random", None, [], None), Options(**o))


def fp32_check(smoke: bool) -> list[dict]:
    """Tiled == untiled in fp32 (TF32 off) on a small latent of the full-size model: the exactness claim on the GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    pipe = model_pipe(smoke, dtype="fp32", seed=0)
    m = pipe.model
    torch.manual_seed(2)
    z = torch.randn((1, 16, 5, 24, 40) if not smoke else (1, 16, 3, 12, 8), device=pipe.device)
    h, w = z.shape[-2:]
    rows = []
    with torch.inference_mode():
        for chunk in (1, 2):
            ref = video.decode_video(m, z, chunk)
            for tile, split in (((h // 2, w), 3), ((h // 5, w), 3), ((h // 3, w), 2), ((h // 2, w // 3 + 1), 3)):
                out = video.decode_video(m, z, chunk, tile=tile, split=split)
                rows.append({"chunk": chunk, "tile": list(tile), "split": split, "psnr_db": round(psnr(out, ref), 1),
                             "max_abs": float((out - ref).abs().max())})
                print(json.dumps({"fp32_check": rows[-1]}), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    del pipe, m
    clean()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the 6 GB budget and the synchronous-copy row")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small latent: checks this script's logic")
    args = ap.parse_args()
    global SHAPE, DEADLINE_S
    if args.smoke:
        SHAPE, DEADLINE_S = (1, 16, 3, 6, 8), 1e9
    elif not CUDA:
        sys.exit("needs a CUDA GPU (or --smoke)")
    torch.backends.cudnn.benchmark = False
    h, w = SHAPE[-2:]
    total_mem = torch.cuda.get_device_properties(0).total_memory if CUDA else 64 * GIB
    results: dict = {"workload": "wan21-720p" if not args.smoke else "smoke", "latent_shape": list(SHAPE),
                     "dtype": "bfloat16", "runs": []}
    try:
        results["fp32_check"] = fp32_check(args.smoke)
    except Exception as e:
        results["fp32_check_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(results["fp32_check_error"], flush=True)

    pipe = model_pipe(args.smoke)
    for st in pipe.stages:
        print(st.line(), flush=True)
    model, spec, dev = pipe.model, pipe.family, pipe.device
    dtype = pipe.dtype
    torch.manual_seed(1)
    z = torch.randn(SHAPE, device=dev, dtype=dtype)
    refs: dict[int, torch.Tensor] = {}  # chunk -> untiled output (bf16, CPU)

    def estimates(chunk, tile=None, split=None, storage="device") -> dict:
        e = planner.estimate_video(spec, model, SHAPE, dtype, chunk, tile, split, storage)
        cl, fused = planner._video_flags(model)
        raw = vt.estimate_tiled_video_bytes(model, SHAPE, chunk, tile, dtype, cl, fused, split, storage)
        return {"estimate_gib": round(e / GIB, 3), "dry_run_gib": round(raw / GIB, 3)}

    def record(name: str, rec: dict, out=None, chunk=None) -> dict:
        rec = {"config": name, **rec}
        if out is not None and chunk in refs:
            rec["psnr_db"] = round(psnr(out, refs[chunk]), 2)
        results["runs"].append(rec)
        print(json.dumps(rec, default=str), flush=True)
        return rec

    # ---- untiled references
    for chunk in (1, 2):
        try:
            with torch.inference_mode():
                out, rec = timed(lambda: video.decode_video(model, z, chunk))
            refs[chunk] = out.cpu()
            record(f"untiled, chunk {chunk}", {**rec, **estimates(chunk), "chunk": chunk})
            del out
        except Exception as e:
            record(f"untiled, chunk {chunk}", {"error": f"{type(e).__name__}: {str(e)[:200]}"})
        clean()

    # ---- forced tiled plans (no budget)
    kept = {}

    def forced(name, chunk, tile, split, storage="device", keep=None, runs=2, **kw):
        if elapsed() > DEADLINE_S:
            return record(name, {"skipped": "time budget"})
        info: dict = {}
        try:
            with torch.inference_mode():
                out, rec = timed(lambda: video.decode_video(model, z, chunk, tile=tile, split=split, storage=storage,
                                                            info=info, **kw), runs)
            extra = {}
            if keep is not None:
                kept[keep] = out.cpu()
                if len(kept) == 2:
                    extra["bitwise_equal_to_overlapped"] = bool(torch.equal(*kept.values()))
            r = record(name, {**rec, **estimates(chunk, tile, split, storage), "chunk": chunk, "info": slim(info),
                              **extra}, out, chunk)
            del out
            return r
        except Exception as e:
            return record(name, {"error": f"{type(e).__name__}: {str(e)[:200]}",
                                 "trace": traceback.format_exc()[-600:]})
        finally:
            clean()

    host = {"storage": "host"} if CUDA else {"storage": "host", "_force_copy": True}
    forced("tiled 2 bands, split 3, GPU caches, chunk 1", 1, vt.band_tiles((h, w), 2), 3, "device")
    forced("tiled 3 bands, split 2, GPU caches, chunk 1", 1, vt.band_tiles((h, w), 3), 2, "device")
    forced("tiled 6 bands, split 2, host caches, chunk 2", 2, vt.band_tiles((h, w), 6), 2, keep="overlap", **host)
    if not args.quick:
        forced("same, synchronous copies", 2, vt.band_tiles((h, w), 6), 2, keep="sync", runs=1, overlap=False,
               **host)

    # ---- emulated budgets: the planner picks the plan, the pipeline decodes it (OOM -> smaller plan, reported)
    budgets = [(16, "auto"), (8, "auto"), (8, "on")] + ([] if args.quick else [(6, "auto")])
    for gb, tiling in budgets:
        name = f"budget {gb} GB" + (" (tiling on)" if tiling == "on" else "")
        if elapsed() > DEADLINE_S:
            record(name, {"skipped": "time budget"})
            continue
        clean()
        try:
            if CUDA:
                torch.cuda.set_per_process_memory_fraction(min(1.0, gb * GIB / total_mem), dev.index or 0)
            pipe.opts.vram_budget_gb, pipe.opts.tiling = float(gb), tiling
            t = time.perf_counter()
            plan = pipe.plan(SHAPE)
            plan_s = time.perf_counter() - t
            stats = []
            out = None
            rsvd = 0
            for _ in range(2):
                out = None
                clean()
                out, st = pipe.decode(z, plan)
                stats.append(st)
                rsvd = max(rsvd, peaks()[1])
                if elapsed() > DEADLINE_S or st.seconds > 30.0:
                    break
            rec = {"first_s": round(stats[0].seconds, 3), "s": round(min(s.seconds for s in stats[1:] or stats), 3),
                   "runs": len(stats), "peak_gib": round(max(s.peak_bytes or 0 for s in stats) / GIB, 3),
                   "peak_reserved_gib": round(rsvd / GIB, 3),
                   "plan_s": round(plan_s, 2),
                   "plan": {k: plan.to_dict()[k] for k in ("mode", "tile", "chunk", "split", "storage", "reason")},
                   "estimate_gib": round(plan.est_bytes / GIB, 3), "retries": [r for s in stats for r in s.retries],
                   "tiling": stats[-1].tiling}
            record(name, rec, out, plan.chunk)
            del out
        except Exception as e:
            record(name, {"error": f"{type(e).__name__}: {str(e)[:200]}", "trace": traceback.format_exc()[-600:]})
        finally:
            if CUDA:
                torch.cuda.set_per_process_memory_fraction(1.0, dev.index or 0)
            pipe.opts.vram_budget_gb, pipe.opts.tiling = None, "auto"
            clean()

    # ---- the allocator: the same plan under an 8 GB cap with the causal caches allocated one by one (as before
    # _Arena) and from one block (default). OOMs are retried (smaller plan) and counted.
    for name, kw in (("8 GB cap, untiled chunk 1, caches one by one", {"arena": False}),
                     ("8 GB cap, untiled chunk 1, caches in one block", {})):
        if elapsed() > DEADLINE_S:
            record(name, {"skipped": "time budget"})
            continue
        info: dict = {}
        try:
            if CUDA:
                torch.cuda.set_per_process_memory_fraction(min(1.0, 8 * GIB / total_mem), dev.index or 0)
            with torch.inference_mode():
                out, rec = timed(lambda: video.decode_video(model, z, 1, oom_retry=True, info=info, **kw))
            record(name, {**rec, "chunk": 1, "info": slim(info)}, out, 1)
            del out
        except Exception as e:
            record(name, {"error": f"{type(e).__name__}: {str(e)[:200]}", "trace": traceback.format_exc()[-600:]})
        finally:
            if CUDA:
                torch.cuda.set_per_process_memory_fraction(1.0, dev.index or 0)
            clean()

    mi = machine_info()
    results.update(gpu=mi.gpus[0].name if mi.gpus else "none",
                   versions={"torch": mi.torch, "cuda": mi.cuda, "cudnn": mi.cudnn, "triton": mi.triton,
                             "diffusers": mi.diffusers},
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="python benchmarks/gpu_video_tiling.py" + (" --quick" if args.quick else "")
                   + (" --smoke" if args.smoke else ""),
                   stages=[s.line() for s in pipe.stages], wall_s=round(elapsed(), 1))
    (OUT / "video_tiling.json").write_text(json.dumps(results, indent=1, default=str))

    if results.get("fp32_check"):
        worst = min(r["psnr_db"] for r in results["fp32_check"])
        print(f"\nfp32 tiled vs untiled (TF32 off), {len(results['fp32_check'])} configs: worst {worst} dB, max |diff| "
              f"{max(r['max_abs'] for r in results['fp32_check']):.2e}")
    print(f"\n{'config':46} {'s':>7} {'first':>7} {'peak':>6} {'rsvd':>6} {'est':>6} {'PSNR':>6}  plan")
    for r in results["runs"]:
        if "error" in r or "skipped" in r:
            print(f"{r['config']:46} {r.get('error', r.get('skipped'))[:70]}")
            continue
        plan = r.get("plan")
        desc = (f"{plan['mode']} tile={plan['tile']} chunk={plan['chunk']} split={plan['split']} "
                f"{plan['storage'] or ''}" if plan else (r.get("info") or {}).get("plan", ""))
        retries = len(r.get("retries") or []) or len((r.get("info") or {}).get("oom_events") or [])
        if retries:
            desc += f" [{retries} OOM retries]"
        print(f"{r['config']:46} {r['s']:7.3f} {r['first_s']:7.3f} {r['peak_gib']:6.2f} "
              f"{r.get('peak_reserved_gib', float('nan')):6.2f} {r.get('estimate_gib', float('nan')):6.2f} "
              f"{r.get('psnr_db', float('nan')):6.1f}  {desc}")
    print(f"wrote {OUT / 'video_tiling.json'} ({elapsed():.0f} s)")


if __name__ == "__main__":
    main()
