"""Every kernel of one decode under Nsight Compute: time, DRAM throughput and issue-slot use, to tell the kernels bound
by memory from those bound by the instructions they issue (perf-notes E31).

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__inst_issued.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed \
        --csv --page raw [--launch-skip S --launch-count N] python3 benchmarks/ncu_scan.py --workload wan21-480p > scan.csv
    python3 benchmarks/ncu_scan.py --summarize scan.csv [--json out.json]

The program decodes once (compiles, warms up), then decodes again between cudaProfilerStart/Stop: only that decode's
kernels are profiled. --summarize groups the CSV's rows by kernel name (time-weighted means). ncu serializes kernels
and runs them at base clocks, so the durations are larger than in a normal decode; their shares and the two
percentages are what this is for.
"""
import argparse
import csv
import json
import sys
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="wan21-480p")
ap.add_argument("--summarize", default=None, help="an ncu --csv --page raw file")
ap.add_argument("--json", default=None)
ap.add_argument("--top", type=int, default=25)
args = ap.parse_args()

if args.summarize:
    lines = Path(args.summarize).read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
    rows = list(csv.DictReader(lines[start:]))[1:]  # the row after the header holds the units

    def num(r, k):
        try:
            return float(r[k].replace(",", ""))
        except (KeyError, ValueError):
            return float("nan")

    agg = {}
    for r in rows:
        name = r["Kernel Name"].split("(")[0][:80]
        t = num(r, "gpu__time_duration.sum") / 1e3  # ns -> us
        a = agg.setdefault(name, {"calls": 0, "us": 0.0, "dram_x_us": 0.0, "issue_x_us": 0.0, "sm_x_us": 0.0})
        a["calls"] += 1
        a["us"] += t
        a["dram_x_us"] += t * num(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed")
        a["issue_x_us"] += t * num(r, "sm__inst_issued.avg.pct_of_peak_sustained_active")
        a["sm_x_us"] += t * num(r, "sm__throughput.avg.pct_of_peak_sustained_elapsed")
    total = sum(a["us"] for a in agg.values())
    out = []
    for name, a in sorted(agg.items(), key=lambda kv: -kv[1]["us"]):
        out.append({"kernel": name, "calls": a["calls"], "ms": a["us"] / 1e3, "share": a["us"] / total,
                    "dram_pct": a["dram_x_us"] / a["us"], "issue_pct": a["issue_x_us"] / a["us"],
                    "sm_pct": a["sm_x_us"] / a["us"]})
    print(f"{len(rows)} kernels, {total / 1e3:.1f} ms under ncu")
    print(f"{'kernel':60s} {'calls':>5s} {'ms':>8s} {'share':>6s} {'DRAM%':>6s} {'issue%':>6s} {'SM%':>5s}")
    for o in out[:args.top]:
        print(f"{o['kernel'][:60]:60s} {o['calls']:>5d} {o['ms']:>8.2f} {o['share']:>6.1%} {o['dram_pct']:>6.1f} "
              f"{o['issue_pct']:>6.1f} {o['sm_pct']:>5.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"source": args.summarize, "kernels": len(rows), "total_ms": total / 1e3,
                                               "by_kernel": out}, indent=1))
    sys.exit(0)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import make_pipe  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402

fam, shape = WORKLOADS[args.workload]
pipe = make_pipe(fam)
plan = pipe.plan(shape)
z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)


def run():
    return pipe._decode_video(z, plan, None) if pipe.family.is_video else pipe._decode_whole_raw(z)


with torch.inference_mode():
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
print("decoded", args.workload, file=sys.stderr)
