"""The GroupNorm kernels' launch and SiLU before E24/E25 vs as shipped, in whole decodes of other workloads than the
ones they were tuned on (CUDA graphs, bf16 and e4m3 gate 30, interleaved in one process): a regression check.

    python3 benchmarks/gpu_gn_ab.py [--workloads sd15-512,flux-1024,sdxl-2048] [--rounds 15]   -> $OUT/gn_ab.json

"before": stats (4096-element tiles, 4 warps, 8 programs per SM, 1 row block per iteration), apply (4096, 4), exact
SiLU everywhere. "now": the package's defaults.
"""
import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graphed_pipe, interleaved_graph_ms, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402

gns = importlib.import_module("vaeopt.kernels.group_norm_silu")
common = importlib.import_module("vaeopt.kernels.common")  # SILU_MODE: the SiLU policy of every norm kernel
ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="sd15-512,flux-1024,sdxl-2048")
ap.add_argument("--rounds", type=int, default=15)
args = ap.parse_args()
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count
shipped = (gns._stats_cl_defaults, gns.APPLY_CL_CUDA, common.SILU_MODE)


def setting(name):
    if name == "before":
        gns._stats_cl_defaults = lambda C, d: (4096, 4, 8 * SMS, 1) if d.type == "cuda" else shipped[0](C, d)
        gns.APPLY_CL_CUDA, common.SILU_MODE = (4096, 4), 0
    else:
        gns._stats_cl_defaults, gns.APPLY_CL_CUDA, common.SILU_MODE = shipped


res = {}
for wl in args.workloads.split(","):
    fam, shape = WORKLOADS[wl]
    zz = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    for mode in ("bf16", "fp8-gate30"):
        pipes = {}
        for name in ("before", "now"):
            setting(name)  # captured under it
            pipes[name] = graphed_pipe(fam, zz, None if mode == "bf16" else 30.0, "gpu_gn_ab")[0]
        setting("now")
        ms = interleaved_graph_ms(pipes, zz, args.rounds)
        res[f"{wl} {mode}"] = {n: {"median_ms": statistics.median(v), "ms": v} for n, v in ms.items()}
        print(f"{wl} {mode}: before {statistics.median(ms['before']):.2f} ms, now {statistics.median(ms['now']):.2f} ms",
              flush=True)
        del pipes
        torch.cuda.empty_cache()
meta = run_meta("python3 benchmarks/gpu_gn_ab.py " + " ".join(sys.argv[1:]))
(out_dir() / "gn_ab.json").write_text(json.dumps({**meta, **res}, indent=1))
print(f"\n# {meta['gpu']}")
for k, r in res.items():
    print(f"{k:22s} before {r['before']['median_ms']:7.2f} ms  now {r['now']['median_ms']:7.2f} ms")
