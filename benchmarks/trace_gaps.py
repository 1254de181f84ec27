"""Read a torch.profiler chrome trace (as benchmarks/gpu_wan_gaps.py writes it, gzipped) on any machine: where the GPU
idles, what the host spends per op, when the host has launched everything, kernel time by name.

    python benchmarks/trace_gaps.py TRACE.json.gz [--early-ms 10] [--json OUT.json]
"""
import argparse
import collections
import gzip
import json

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--early-ms", type=float, default=10.0, help="report the idle time within this much of the start")
ap.add_argument("--json")
args = ap.parse_args()
ev = json.load(gzip.open(args.trace) if args.trace.endswith(".gz") else open(args.trace))["traceEvents"]
kern = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
t0, end, idle, idle_early = kern[0][0], kern[0][0], 0.0, 0.0
for a, b, _ in kern:
    if a > end:
        idle += a - end
        if end - t0 < args.early_ms * 1e3:
            idle_early += min(a, t0 + args.early_ms * 1e3) - end
    end = max(end, b)
host = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
              if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"))
top, last = [], -1.0  # top-level host intervals (ops nested in others are inside them)
for a, b, n in host:
    if a >= last:
        top.append((a, b, n))
        last = b
    elif b > last:
        top[-1] = (top[-1][0], b, top[-1][2])
        last = b
per_op = collections.defaultdict(list)
for a, b, n in top:
    per_op[n].append(b - a)
launched_by = (max(b for a, b, n in top if "Synchronize" not in n) - t0) / 1e3
by_kernel = collections.Counter()
for a, b, n in kern:
    by_kernel[n[:90]] += (b - a) / 1e3
res = {
    "trace": args.trace,
    "span_ms": (end - t0) / 1e3, "busy_ms": (end - t0 - idle) / 1e3, "idle_ms": idle / 1e3,
    f"idle_in_first_{args.early_ms:g}_ms": idle_early / 1e3,
    "host_launched_everything_by_ms": launched_by,
    "host_us_per_call": {n: {"calls": len(v), "mean_us": sum(v) / len(v)} for n, v in per_op.items()
                         if n in ("aten::conv2d", "aten::conv3d", "aten::copy_", "cuLaunchKernelEx", "cudaLaunchKernel")},
    "kernel_ms_top": by_kernel.most_common(12),
}
print(json.dumps(res, indent=1))
if args.json:
    json.dump(res, open(args.json, "w"), indent=1)
