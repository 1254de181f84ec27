"""Run-to-run spread of one workload's decode through the pipeline's own path: N decodes in one process, per-run
CUDA-event times and allocator activity (new device segments per run).

    python3 benchmarks/gpu_repeat.py --workload wan21-480p --runs 10 [--cudnn-autotune]
        -> $OUT/repeat_<workload>[-autotune].json
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import make_pipe, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="wan21-480p")
ap.add_argument("--runs", type=int, default=10)
ap.add_argument("--cudnn-autotune", action="store_true", help="stages/cudnn_autotune on before the first decode")
args = ap.parse_args()
if args.cudnn_autotune:
    from vaeopt.stages import cudnn_autotune

    print(cudnn_autotune.apply("gpu_repeat --cudnn-autotune").line())
fam, shape = WORKLOADS[args.workload]
pipe = make_pipe(fam)
z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
plan = pipe.plan(shape)
runs = []
with torch.inference_mode():
    for i in range(args.runs + 1):  # the first is the warm-up (compiles, allocates)
        s0 = torch.cuda.memory_stats()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y = pipe._decode_video(z, plan, None) if pipe.family.is_video else pipe._decode_whole_raw(z)
        b.record()
        torch.cuda.synchronize()
        s1 = torch.cuda.memory_stats()
        del y
        runs.append({"ms": a.elapsed_time(b), "new_segments": s1["num_device_alloc"] - s0["num_device_alloc"],
                     "warmup": i == 0})
        print(runs[-1], flush=True)
ts = [r["ms"] for r in runs if not r["warmup"]]
summary = {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "chunk": plan.chunk}
meta = run_meta("python3 benchmarks/gpu_repeat.py " + " ".join(sys.argv[1:]))
tag = "-autotune" if args.cudnn_autotune else ""
(out_dir() / f"repeat_{args.workload}{tag}.json").write_text(json.dumps({**meta, "workload": args.workload,
                                                                     "runs": runs, **summary}, indent=1))
print(f"\n# {meta['gpu']}: {args.workload}{tag} {len(ts)} decodes: median {summary['median_ms']:.1f} ms, "
      f"{summary['min_ms']:.1f}-{summary['max_ms']:.1f}")
