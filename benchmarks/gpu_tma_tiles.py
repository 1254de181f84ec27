"""Whole e4m3 decodes with the TMA conv's image tiles as shipped vs one-row tiles (perf-notes E27).

    python3 benchmarks/gpu_tma_tiles.py [--workloads sdxl-1024,flux-1024] [--rounds 15]   -> $OUT/tma_tiles.json

Variants: "shipped" = the tiles before E27 (4 x 32 convs, 8 x 16 phase convs; hard-coded here since the package now
ships the row tile), "row tiles" = the package's tuned_config / tuned_upconv_config.

Why: graph-timed sweeps (gpu_tma_conv.py --graph, gpu_upconv_fp8.py --graph) on an H100 put a 1 x 128-pixel tile
with 3 pipeline stages ahead of the shipped 4 x 32 / 8 x 16 tiles by 3-12% per call at every SDXL shape; the shipped
tiles came from sweeps timed with CUDA events around single launches, which also time the host's descriptor setup.
Variants are switched by replacing tma_conv.tuned_config / tuned_upconv_config before each pipeline's graph is
captured (FP8 gate 30); CUDA-graph replays interleaved in one process; PSNR between the variants' outputs.
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graphed_pipe, interleaved_graph_ms, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.kernels import tma_conv  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="sdxl-1024,flux-1024")
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--gate", type=float, default=30.0)
args = ap.parse_args()
dev = torch.device("cuda")
SHIPPED = (tma_conv.tuned_config, tma_conv.tuned_upconv_config)  # since 488da22: the row tile where it applies
E20_CONV, E21_UP = tma_conv.TmaConfig(4, 32, 128, 128, 0, 8, 4), tma_conv.TmaConfig(8, 16, 128, 128, 0, 8, 4)


def e20_conv(cin, cout, w, fp8, video=False):
    """The tiles before E27: 4 x 32 for every 128-512-channel e4m3 layer (Wan's 96/192 ch unchanged)."""
    cfg = SHIPPED[0](cin, cout, w, fp8, video)
    return E20_CONV if cfg == tma_conv.ROW_TILE else cfg


def e21_upconv(cin, cout, w=None):
    return E21_UP if SHIPPED[1](cin, cout, w) is not None else None


# "shipped" was the E20/E21 tiles when the results of 2026-11-22 were taken; the keys stay for comparability
VARIANTS = {"shipped": (e20_conv, e21_upconv), "row tiles": SHIPPED}
res = {"decodes": {}}
for wl in [w for w in args.workloads.split(",") if w]:
    fam, shape = WORKLOADS[wl]
    zz = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    pipes, outs = {}, {}
    for name, (tc, tu) in VARIANTS.items():
        tma_conv.tuned_config, tma_conv.tuned_upconv_config = tc, tu  # captured under it
        pipes[name], outs[name] = graphed_pipe(fam, zz, args.gate, "gpu_tma_tiles")
    tma_conv.tuned_config, tma_conv.tuned_upconv_config = SHIPPED
    ms = interleaved_graph_ms(pipes, zz, args.rounds)
    a, b = outs["shipped"].float(), outs["row tiles"].float()
    mse = ((a - b) ** 2).mean().item()
    r = {n: {"median_ms": statistics.median(v), "ms": v} for n, v in ms.items()}
    r["bitwise_equal"] = bool(torch.equal(outs["shipped"], outs["row tiles"]))
    r["psnr_between_db"] = None if mse == 0 else 10 * math.log10(4.0 / mse)
    r["fp8_layers"] = {n: [s.line() for s in p.stages if "fp8" in s.name] for n, p in pipes.items()}
    res["decodes"][f"{wl} fp8-gate{args.gate:g}"] = r
    print(f"{wl}: shipped {r['shipped']['median_ms']:.2f} ms, row tiles {r['row tiles']['median_ms']:.2f} ms, "
          f"bitwise equal {r['bitwise_equal']}", flush=True)
    del pipes, outs
    torch.cuda.empty_cache()
meta = run_meta("python3 benchmarks/gpu_tma_tiles.py " + " ".join(sys.argv[1:]))
(out_dir() / "tma_tiles.json").write_text(json.dumps({**meta, **res}, indent=1, default=str))
print(f"\n# {meta['gpu']}")
for k, r in res["decodes"].items():
    print(f"{k:24s} shipped {r['shipped']['median_ms']:7.2f} ms  row tiles {r['row tiles']['median_ms']:7.2f} ms  "
          f"equal {r['bitwise_equal']}")
