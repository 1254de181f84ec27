"""Where a wan21-480p decode's wall time goes besides kernels: the GPU's idle gaps inside one decode.

    python3 benchmarks/gpu_wan_gaps.py [--workload wan21-480p] [--reps 5]   -> $OUT/wan_gaps.json, $OUT/trace.json.gz

Why: E23's profile summed 582.5 ms of kernels while whole decodes on H200s measured 593-612 ms. If the GPU idles
inside the decode (host syncs, allocator calls, Python between chunks), that time is a lever no conv kernel touches.
Measures: wall ms of the pipeline's own decode (as the ladder's planner row), then one profiled decode: span from the
first to the last kernel, busy time (union of kernel intervals), and the largest idle gaps with the CPU ops around
them. The chrome trace comes back gzipped for a closer look.
"""
import argparse
import gzip
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import make_pipe, out_dir, run_meta, timed  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="wan21-480p")
ap.add_argument("--reps", type=int, default=5)
args = ap.parse_args()
OUT = out_dir()
fam, shape = WORKLOADS[args.workload]
pipe = make_pipe(fam)
plan = pipe.plan(shape)
z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
fn = lambda: pipe._decode_video(z, plan, None)  # noqa: E731
res = {"workload": args.workload, "chunk": plan.chunk, "stages": [s.line() for s in pipe.stages]}
with torch.inference_mode():
    fn()
    fn()
    _, wall = timed(fn, args.reps)
    res["wall_ms"] = wall
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
trace = OUT / "trace.json"
prof.export_chrome_trace(str(trace))
with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
    shutil.copyfileobj(f, g)
ev = json.load(open(trace))["traceEvents"]
trace.unlink()
kern = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
busy, gaps, end = 0.0, [], kern[0][0]
for i, (a, b, name) in enumerate(kern):
    if a > end:
        gaps.append((a - end, end, kern[i - 1][2] if i else "", name))
    busy += max(0.0, b - max(a, end))
    end = max(end, b)
span = (end - kern[0][0]) / 1e3  # to the latest kernel end
cpu_ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
                 if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function"))


def cpu_during(t0, t1, n=6):
    """The longest CPU ops overlapping [t0, t1]: what the host was doing while the GPU idled."""
    over = [(min(b, t1) - max(a, t0), nm) for a, b, nm in cpu_ops if b > t0 and a < t1]
    return [f"{nm} ({d / 1e3:.2f} ms)" for d, nm in sorted(over, reverse=True)[:n]]


gaps.sort(reverse=True)
res.update(span_ms=span, busy_ms=busy / 1e3, idle_ms=span - busy / 1e3, kernels=len(kern),
           gaps_over_50us=sum(1 for g in gaps if g[0] > 50), idle_in_gaps_over_50us_ms=sum(g[0] for g in gaps if g[0] > 50) / 1e3,
           top_gaps=[{"us": round(d, 1), "at_ms": round((t - kern[0][0]) / 1e3, 2), "after": p[:80], "before": n[:80],
                      "cpu": cpu_during(t, t + d)} for d, t, p, n in gaps[:25]])
res.update(run_meta(f"python3 benchmarks/gpu_wan_gaps.py --workload {args.workload} --reps {args.reps}"))
json.dump(res, open(OUT / "wan_gaps.json", "w"), indent=1)
for g in res["top_gaps"][:12]:
    print(f"gap {g['us']:8.1f} us at {g['at_ms']:8.2f} ms  after {g['after'][:40]}  before {g['before'][:40]}")
    print("      cpu:", "; ".join(g["cpu"][:3]))
print(f"\n{args.workload} chunk {plan.chunk}: wall median {statistics.median(wall):.1f} ms ({min(wall):.1f}-{max(wall):.1f})")
print(f"profiled decode: span {span:.1f} ms, kernels busy {busy / 1e3:.1f} ms, idle {span - busy / 1e3:.1f} ms "
      f"({res['gaps_over_50us']} gaps > 50 us = {res['idle_in_gaps_over_50us_ms']:.1f} ms), {len(kern)} kernels")
