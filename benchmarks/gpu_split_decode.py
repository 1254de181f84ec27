"""Wan's time-stacked 96-ch conv as several cuDNN calls of fewer frames (video._ChunkDecoder.STACK_SPLIT, E23).

    python3 benchmarks/gpu_split_decode.py [--workloads wan21-480p,wan21-720p] [--splits 0,8,4] [--rounds 5]
        -> $OUT/split_decode.json

gpu_conv_heur.py measured the same cuDNN kernel (heuristic choice) 11% faster per frame at 720p with 4 frames per
call than with 12. Here: the pipeline's own decode (make_pipe: bf16, no graphs), one process per workload, the
split toggled between interleaved decodes (CUDA events), each variant's output compared with the unsplit one.
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

from vaeopt import video  # noqa: E402
from vaeopt.benchmark import WORKLOADS  # noqa: E402

SEEN = {"stacked": 0, "split": 0}
_orig = video._ChunkDecoder._run_stacked


def _counted(self, *a, **k):
    before = self.stats["stacked_split"]
    y = _orig(self, *a, **k)
    SEEN["stacked"] += 1
    SEEN["split"] += self.stats["stacked_split"] - before
    return y


video._ChunkDecoder._run_stacked = _counted
ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="wan21-480p,wan21-720p")
ap.add_argument("--splits", default="0,8,4")
ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
splits = [int(s) for s in args.splits.split(",")]
res = {"workloads": {}}
for wl in args.workloads.split(","):
    fam, shape = WORKLOADS[wl]
    pipe = make_pipe(fam)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    plan = pipe.plan(shape)
    ts = {s: [] for s in splits}
    peak, diff, ref = {}, {}, None
    with torch.inference_mode():
        for s in splits:  # warm-up: Triton, cuDNN plans of every split's shapes
            video._ChunkDecoder.STACK_SPLIT = s or None
            y = pipe._decode_video(z, plan, None)
            print(f"split {s}: stacked calls {SEEN['stacked']}, split {SEEN['split']}", flush=True)
            if ref is None:
                ref = y.float().cpu()
            else:
                diff[s] = (y.float().cpu() - ref).abs().max().item()
            del y
        for r in range(args.rounds):
            for s in (splits if r % 2 == 0 else splits[::-1]):
                video._ChunkDecoder.STACK_SPLIT = s or None
                torch.cuda.reset_peak_memory_stats()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                y = pipe._decode_video(z, plan, None)
                b.record()
                torch.cuda.synchronize()
                ts[s].append(a.elapsed_time(b))
                peak[s] = torch.cuda.max_memory_allocated() / 2**30
                del y
    video._ChunkDecoder.STACK_SPLIT = None
    rows = {str(s): {"ms": ts[s], "median_ms": statistics.median(ts[s]), "peak_gib": peak[s],
                     "max_abs_diff_vs_unsplit": diff.get(s, 0.0)} for s in splits}
    res["workloads"][wl] = {"chunk": plan.chunk, "splits": rows}
    for s in splits:
        print(f"{wl} split {s or 'none'}: median {rows[str(s)]['median_ms']:.1f} ms "
              f"({min(ts[s]):.1f}-{max(ts[s]):.1f}), peak {peak[s]:.2f} GiB, max diff {diff.get(s, 0.0):.3g}",
              flush=True)
    del pipe, ref
    torch.cuda.empty_cache()
res.update(run_meta("python3 benchmarks/gpu_split_decode.py " + " ".join(sys.argv[1:])))
(out_dir() / "split_decode.json").write_text(json.dumps(res, indent=1))
print("\n| workload | chunk | split | median ms | range | peak GiB | max diff vs unsplit |")
print("|---|---|---|---|---|---|---|")
for wl, w in res["workloads"].items():
    for s, r in w["splits"].items():
        print(f"| {wl} | {w['chunk']} | {s if s != '0' else 'none'} | {r['median_ms']:.1f} | "
              f"{min(r['ms']):.1f}-{max(r['ms']):.1f} | {r['peak_gib']:.2f} | {r['max_abs_diff_vs_unsplit']:.3g} |")
