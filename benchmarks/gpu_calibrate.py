"""Calibrate the planner's memory model on the GPU, and check budgets on emulated smaller cards.

1. Peak memory of vaeopt's whole decode (default stages) over a grid of shapes per family -> least-squares fit of
   act_bytes_per_px (see vaeopt/planner.py); held-out shapes checked against the fit.
2. Budget emulation: torch.cuda.set_per_process_memory_fraction to 16 GB / 8 GB, decode sdxl-2048, sdxl-4096 and
   wan21-720p with --vram-budget set accordingly; report plan, time, peak, PSNR vs an fp32 reference where cheap.

Writes $OUT/calibration.json. Usage: python benchmarks/gpu_calibrate.py [--quick]
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing
from vaeopt import planner  # noqa: E402
from vaeopt.families import build_model, get_family  # noqa: E402
from vaeopt.hw import machine_info  # noqa: E402
from vaeopt.loading import LoadedVAE  # noqa: E402
from vaeopt.pipeline import Options, Pipeline  # noqa: E402


def make_pipe(fam: str, **opts) -> Pipeline:
    """The family's full-size model with random N(0, 0.02) weights (memory and time equal real weights') in vaeopt's
    pipeline, on CUDA in bf16, CUDA graphs off."""
    torch.manual_seed(0)
    with torch.device("meta"):
        m = build_model(get_family(fam))
    m = m.to_empty(device="cpu")
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    o = {"device": "cuda", "dtype": "bf16", "graphs": "off", "tiling": "off", **opts}
    return Pipeline(LoadedVAE(m, get_family(fam), "random", None, [], None), Options(**o))


OUT = Path(os.environ.get("OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
quick = "--quick" in sys.argv


def measure(pipe, shape, **plan_kw):
    z = torch.randn(shape)
    plan = pipe.plan(shape)
    for k, v in plan_kw.items():
        setattr(plan, k, v)
    torch.cuda.empty_cache()
    out, stats = pipe.decode(z, plan)
    return plan, stats


rows = []
fits = {}
grids = {
    "sdxl": [(1, 4, 64, 64), (1, 4, 96, 96), (1, 4, 128, 128), (1, 4, 160, 160), (1, 4, 192, 192), (1, 4, 256, 256)],
    "wan21": [(1, 16, 5, 30, 52), (1, 16, 5, 45, 80), (1, 16, 5, 60, 104), (1, 16, 5, 90, 160)],
}
if quick:
    grids = {k: v[:3] for k, v in grids.items()}
for fam, shapes in grids.items():
    pipe = make_pipe(fam, tiling="off")
    spec = pipe.family
    eb = 2
    xs, ys = [], []
    for shape in shapes:
        chunk = 1 if spec.is_video else None
        try:
            plan, stats = measure(pipe, shape, mode="chunked" if chunk else "whole", chunk=chunk)
        except torch.cuda.OutOfMemoryError:
            print(f"{fam} {shape}: OOM")
            continue
        n, h, w = shape[0], shape[-2] * spec.spatial_factor, shape[-1] * spec.spatial_factor
        frames = (chunk or 1) * spec.temporal_factor if spec.is_video else 1
        px = n * frames * h * w
        out_b = (n * spec.output_frames(shape[2]) if spec.is_video else n) * h * w * 3 * eb
        wb = planner._weights_bytes(pipe.model, torch.bfloat16)
        xs.append(px * eb)
        ys.append(stats.peak_bytes - wb - out_b)
        est = (planner.estimate_video(spec, pipe.model, shape, torch.bfloat16, chunk) if spec.is_video
               else planner.estimate_whole(spec, pipe.model, shape, torch.bfloat16))
        rows.append({"family": fam, "shape": list(shape), "peak_gib": stats.peak_bytes / 2**30, "seconds": stats.seconds,
                     "px_in_flight": px, "planner_estimate_gib": est / 2**30,
                     "estimate_rel_error": (est - stats.peak_bytes) / stats.peak_bytes})
        print(f"{fam} {shape}: peak {stats.peak_bytes / 2**30:.2f} GiB, planner est {est / 2**30:.2f} GiB, "
              f"{stats.seconds * 1e3:.0f} ms")
    # fit on all but the last (held out)
    if len(xs) >= 3 and not spec.is_video:  # video: the planner uses vaeopt.video's dry-run estimate instead
        fx, fy = xs[:-1], ys[:-1]
        coef = sum(a * b for a, b in zip(fx, fy)) / sum(a * a for a in fx)
        held = rows[-1]
        est = coef * xs[-1]
        err = (est - ys[-1]) / (ys[-1] + planner._weights_bytes(pipe.model, torch.bfloat16))
        fits[fam] = {"act_bytes_per_px": round(coef, 1), "held_out_shape": held["shape"],
                     "held_out_rel_error": err}
        print(f"fit {fam}: act_bytes_per_px {coef:.0f}; held-out {held['shape']} error {100 * err:+.1f}%")
    del pipe
    torch.cuda.empty_cache()

# ---- budget emulation
budget_rows = []
total = torch.cuda.get_device_properties(0).total_memory
cases = [("sdxl", (1, 4, 256, 256)), ("sdxl", (1, 4, 512, 512)), ("wan21", (1, 16, 21, 90, 160))]
if quick:
    cases = cases[:2]
for budget_gb in (16, 8):
    for fam, shape in cases:
        pipe = make_pipe(fam, tiling="auto")
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(budget_gb * 2**30 / total, 0)
        rec = {"family": fam, "shape": list(shape), "budget_gb": budget_gb}
        try:
            pipe.opts.vram_budget_gb = budget_gb * 0.9
            plan = pipe.plan(shape)
            rec["plan"] = plan.to_dict()
            _, stats = pipe.decode(torch.randn(shape), plan)
            rec.update(ok=True, seconds=stats.seconds, peak_gib=stats.peak_bytes / 2**30, retries=stats.retries)
        except torch.cuda.OutOfMemoryError as e:
            rec.update(ok=False, error=str(e).splitlines()[0][:200])
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
            del pipe
            torch.cuda.empty_cache()
        budget_rows.append(rec)
        print(f"budget {budget_gb} GB {fam} {shape}: " + (
            f"{rec['plan']['mode']} tile={rec['plan']['tile']} chunk={rec['plan']['chunk']} "
            f"{rec['seconds']:.2f} s peak {rec['peak_gib']:.2f} GiB" if rec.get("ok") else f"FAILED {rec.get('error')}"))

mi = machine_info()
result = {"gpu": mi.gpus[0].name, "versions": {"torch": mi.torch, "cudnn": mi.cudnn, "triton": mi.triton,
                                                 "diffusers": mi.diffusers},
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "command": "python benchmarks/gpu_calibrate.py" + (" --quick" if quick else ""),
          "peaks": rows, "fits": fits, "budgets": budget_rows}
(OUT / "calibration.json").write_text(json.dumps(result, indent=1))
print("\nfamily  act_bytes_per_px  held-out error")
for k, v in fits.items():
    print(f"{k:8s} {v['act_bytes_per_px']:10.0f} {100 * v['held_out_rel_error']:+8.1f}%")
print("budget  workload            ok   plan        time    peak")
for r in budget_rows:
    print(f"{r['budget_gb']:4d} GB {r['family']:6s} {str(tuple(r['shape'])):22s} {str(r.get('ok')):5s} "
          f"{r.get('plan', {}).get('mode', '-'):8s} {r.get('seconds', 0):7.2f}s {r.get('peak_gib', 0):6.2f} GiB")

# ---- cuDNN autotuning on the Wan decode (fixed chunk shapes): does torch.backends.cudnn.benchmark pay?
if "--cudnn" in sys.argv:
    from vaeopt import video

    pipe = make_pipe("wan21")
    z = torch.randn(1, 16, 21, 60, 104).to("cuda", torch.bfloat16)
    for bench_flag in (False, True):
        torch.backends.cudnn.benchmark = bench_flag
        with torch.inference_mode():
            t0 = time.perf_counter()
            video.decode_video(pipe.model, z, chunk=4)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            ts = []
            for _ in range(2):
                t0 = time.perf_counter()
                video.decode_video(pipe.model, z, chunk=4)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
        print(f"wan21-480p chunk 4 cudnn.benchmark={bench_flag}: first {first:.3f} s, then {min(ts):.3f} s")
        result.setdefault("cudnn_benchmark", []).append({"flag": bench_flag, "first_s": first, "steady_s": min(ts)})
    torch.backends.cudnn.benchmark = False
    (OUT / "calibration.json").write_text(json.dumps(result, indent=1))
