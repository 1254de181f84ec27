"""One decode replayed back to back (a CUDA graph for image workloads): the time of each call in order, with the GPU's
clock sampled by nvidia-smi, to see how a decode's time moves once the GPU is under sustained load (perf-notes E31).

    python3 benchmarks/gpu_sustained.py --workload sdxl-1024 [--fp8-gate 40] [--n 200] [--pause-ms 0]  -> $OUT/sustained.json

--pause-ms P: also time a second series with P ms of host sleep between calls (the GPU idles between decodes).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graphed_pipe, out_dir, replay_ms, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.hw import ClockSampler  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="sdxl-1024")
ap.add_argument("--fp8-gate", type=float, default=None)
ap.add_argument("--n", type=int, default=200)
ap.add_argument("--pause-ms", type=float, default=0.0)
args = ap.parse_args()
fam, shape = WORKLOADS[args.workload]
z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
pipe, _ = graphed_pipe(fam, z, args.fp8_gate, "sustained-load benchmark")


def series(pause_ms: float) -> dict:
    ts = []
    dev = torch.device("cuda")
    with torch.inference_mode(), ClockSampler(dev) as cs:
        for _ in range(args.n):
            if pause_ms:
                time.sleep(pause_ms / 1e3)
            ts.append(replay_ms(pipe, z))
    q = max(1, args.n // 10)
    return {"pause_ms": pause_ms, "ms": ts, "first_10pct_median": statistics.median(ts[:q]),
            "last_10pct_median": statistics.median(ts[-q:]), "median": statistics.median(ts), "clock": cs.summary}


runs = [series(0.0)] + ([series(args.pause_ms)] if args.pause_ms else [])
meta = run_meta("python3 benchmarks/gpu_sustained.py " + " ".join(sys.argv[1:]))
(out_dir() / "sustained.json").write_text(json.dumps({**meta, "workload": args.workload, "fp8_gate": args.fp8_gate,
                                                      "runs": runs}, indent=1))
print(f"\n# {meta['gpu']} {args.workload} fp8 gate {args.fp8_gate}: {args.n} graph replays")
for r in runs:
    ms = r["ms"]
    marks = ", ".join(f"#{i}: {ms[i]:.2f}" for i in (0, 1, 2, 3, 4, 5, 8, 12, 20, 50, 100, len(ms) - 1) if i < len(ms))
    c = r["clock"] or {}
    print(f"pause {r['pause_ms']:.0f} ms: median {r['median']:.2f} ms, first 10% {r['first_10pct_median']:.2f}, last 10% "
          f"{r['last_10pct_median']:.2f}; SM {c.get('sm_mhz_median')} MHz (min {c.get('sm_mhz_min')}), "
          f"power max {c.get('power_w_max')} W, {c.get('slowdown')}\n  {marks}")
