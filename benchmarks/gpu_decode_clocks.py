"""Why one wan21-480p decode takes ~580 ms and the next ~600: back-to-back decodes with the GPU's SM clock, power and
throttle reasons sampled by nvidia-smi every 50 ms, and the caching allocator's cudaMalloc count per decode
(perf-notes E31).

    python3 benchmarks/gpu_decode_clocks.py [--workload wan21-480p] [--decodes 12] [--idle-s 0]   -> $OUT/decode_clocks.json

--idle-s S: sleep S seconds between decodes (the GPU cools / its power budget recovers).
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import make_pipe, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="wan21-480p")
ap.add_argument("--decodes", type=int, default=12)
ap.add_argument("--idle-s", type=float, default=0.0)
args = ap.parse_args()
fam, shape = WORKLOADS[args.workload]
pipe = make_pipe(fam)
plan = pipe.plan(shape)
z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
with torch.inference_mode():
    y = pipe._decode_video(z, plan, None)  # warm-up: compiles
    del y
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    runs = []
    for i in range(args.decodes):
        if args.idle_s:
            time.sleep(args.idle_s)
        n0 = torch.cuda.memory_stats().get("num_device_alloc", 0)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time()
        a.record()
        y = pipe._decode_video(z, plan, None)
        b.record()
        torch.cuda.synchronize()
        t1 = time.time()
        del y
        runs.append({"i": i, "ms": a.elapsed_time(b), "t0": t0, "t1": t1,
                     "cuda_mallocs": torch.cuda.memory_stats().get("num_device_alloc", 0) - n0})
    time.sleep(0.5)
    smi.terminate()
    samples = []
    for line in smi.stdout.read().splitlines():
        p = [s.strip() for s in line.split(",")]
        try:
            ts = time.mktime(time.strptime(p[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + p[0].split(".")[1])
            samples.append({"t": ts, "sm_mhz": float(p[1]), "mem_mhz": float(p[2]), "power_w": float(p[3]),
                            "temp_c": float(p[4]), "throttle": p[5]})
        except (ValueError, IndexError):
            continue
for r in runs:
    s = [x for x in samples if r["t0"] <= x["t"] <= r["t1"]]
    if s:
        r["sm_mhz_mean"] = statistics.mean(x["sm_mhz"] for x in s)
        r["sm_mhz_min"] = min(x["sm_mhz"] for x in s)
        r["power_w_mean"] = statistics.mean(x["power_w"] for x in s)
        r["temp_c"] = s[-1]["temp_c"]
        r["throttle"] = sorted({x["throttle"] for x in s})
        r["samples"] = len(s)
meta = run_meta("python3 benchmarks/gpu_decode_clocks.py " + " ".join(sys.argv[1:]))
(out_dir() / "decode_clocks.json").write_text(json.dumps({**meta, "workload": args.workload, "chunk": plan.chunk,
                                                          "runs": runs, "samples": samples}, indent=1))
print(f"\n# {meta['gpu']} {args.workload} chunk {plan.chunk}, idle {args.idle_s} s between decodes")
print(f"{'i':>2s} {'ms':>7s} {'SM MHz':>7s} {'min':>5s} {'W':>5s} {'C':>3s} {'mallocs':>7s} throttle")
for r in runs:
    print(f"{r['i']:>2d} {r['ms']:>7.1f} {r.get('sm_mhz_mean', 0):>7.0f} {r.get('sm_mhz_min', 0):>5.0f} "
          f"{r.get('power_w_mean', 0):>5.0f} {r.get('temp_c', 0):>3.0f} {r['cuda_mallocs']:>7d} {r.get('throttle')}")
