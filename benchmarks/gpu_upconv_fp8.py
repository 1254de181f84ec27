"""Upsampler phase convs in e4m3 on the TMA conv kernel (kernels/upconv.upconv2x_8bit) vs the bf16 phase convs.

    python3 benchmarks/gpu_upconv_fp8.py [--budget-s 240]   # sm_90; writes $OUT/upconv_fp8.json

Per SDXL/FLUX upsampler shape (1024² decode), CUDA-event medians (with --graph: the e4m3 configs as CUDA-graph
replays, the bf16 / quant / total columns still event-timed, so compare within a column) of
  bf16:    cuDNN 2x2 conv with 4*Cout channels + the Triton interleave (bias added): today's path
  quant:   the per-sample e4m3 quantization of the input alone (kernels/act_quant.py: amax pass + cast pass)
  e4m3 <cfg>: the four phase convs on the TMA kernel, input already quantized, stored into the upsampled output:
           one launch (merged) and one launch per phase (split)
  e4m3 total: quant + the best config, merged
and each path's relative error vs an fp32 reference (TF32 off) of upsample + conv3x3.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import event_ms, graph_ms, no_tf32, out_dir, run_meta  # noqa: E402
from vaeopt.kernels import upconv as U  # noqa: E402
from vaeopt.kernels.act_quant import quantize_e4m3_per_sample  # noqa: E402
from vaeopt.kernels.tma_conv import TmaConfig, tuned_upconv_config  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--budget-s", type=float, default=240.0)
ap.add_argument("--graph", action="store_true", help="time the e4m3 configs as CUDA-graph replays (GPU time only)")
ap.add_argument("--no-split", action="store_true", help="merged launches only")
args = ap.parse_args()
OUT = out_dir()
dev = torch.device("cuda")
no_tf32()
t_start = time.time()

SHAPES = [("sdxl up0 512@128", 512, 512, 128, 128), ("sdxl up1 512@256", 512, 512, 256, 256),
          ("sdxl up2 256@512", 256, 256, 512, 512)]
CFGS = [TmaConfig(4, 32, 128, 128, 0, 8, 4), TmaConfig(2, 64, 128, 128, 0, 8, 4), TmaConfig(1, 128, 128, 128, 0, 8, 4),
        TmaConfig(8, 16, 128, 128, 0, 8, 4), TmaConfig(4, 32, 128, 256, 0, 8, 3), TmaConfig(4, 32, 64, 128, 0, 4, 4),
        TmaConfig(2, 64, 128, 256, 0, 8, 3), TmaConfig(4, 64, 128, 128, 0, 8, 3), TmaConfig(1, 128, 128, 128, 0, 8, 3),
        TmaConfig(2, 64, 128, 128, 0, 8, 3), TmaConfig(8, 16, 128, 128, 0, 8, 3)]


def rel(a, r):
    return ((a.float() - r).norm() / r.norm()).item()


rows = []
for name, ci, co, H, W in SHAPES:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, ci, H, W, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(co, ci, 3, 3, generator=g) / (9 * ci) ** 0.5).to(dev, torch.bfloat16)
    b = (torch.randn(co, generator=g) * 0.1).to(dev, torch.bfloat16)
    ref = U.upconv2x_reference(x.float(), w.float(), b.float())
    w4 = U.phase_weights(w).contiguous(memory_format=torch.channels_last)
    flops = 2 * 4 * H * W * co * ci * 4  # four phases, 2x2 taps each
    row = {"shape": name, "gflop": flops / 1e9}
    row["bf16_ms"] = event_ms(lambda: U.upconv2x(x, w4, b))
    row["bf16_rel"] = rel(U.upconv2x(x, w4, b), ref)
    row["quant_ms"] = event_ms(lambda: quantize_e4m3_per_sample(x))
    x8, s = quantize_e4m3_per_sample(x)
    row["quant_scale_ok"] = abs(s.item() - x.float().abs().max().item() / 448) < 1e-6 * x.float().abs().max().item()
    pws = U.phase_weights_8bit(w)
    row["configs"] = {}
    best = None
    for cfg in [tuned_upconv_config(ci, co, W)] + CFGS:
        if cfg is None or time.time() - t_start > args.budget_s:
            continue
        key = str(cfg)
        if key in row["configs"]:
            continue
        row["configs"][key] = {}
        for merged in (True,) if args.no_split else (True, False):
            tag = "merged" if merged else "split"
            try:
                y = U.upconv2x_8bit(x8, s, pws, b, config=cfg, merged=merged)
                f = lambda: U.upconv2x_8bit(x8, s, pws, b, config=cfg, merged=merged)  # noqa: E731
                ms = graph_ms(f, n=10, reps=10) if args.graph else event_ms(f)
                e = rel(y, ref)
            except Exception as ex:  # a config that does not compile (shared memory, registers)
                row["configs"][key][tag] = {"error": f"{type(ex).__name__}: {str(ex)[:160]}"}
                continue
            row["configs"][key][tag] = {"ms": ms, "rel": e, "tflops": flops / ms / 1e9}
            if merged and (best is None or ms < best[1]):
                best = (cfg, ms, e)
    row["e4m3_best_cfg"], row["e4m3_conv_ms"], row["e4m3_rel"] = str(best[0]), best[1], best[2]
    tuned = row["configs"].get(str(tuned_upconv_config(ci, co, W)), {})
    row["e4m3_tuned_ms"] = tuned.get("merged", {}).get("ms")
    row["e4m3_tuned_split_ms"] = tuned.get("split", {}).get("ms")

    def total(cfg=best[0]):
        q, sc = quantize_e4m3_per_sample(x)
        return U.upconv2x_8bit(q, sc, pws, b, config=cfg)

    row["e4m3_total_ms"] = event_ms(total)
    rows.append(row)
    print(name, {k: v for k, v in row.items() if k != "configs"}, flush=True)

meta = run_meta("python3 benchmarks/gpu_upconv_fp8.py " + " ".join(sys.argv[1:]))
(OUT / "upconv_fp8.json").write_text(json.dumps({**meta, "timing": "graph" if args.graph else "event", "rows": rows},
                                                indent=1))
print(f"\n# {meta['gpu']}: upsampler phase convs, bf16 (cuDNN + interleave) vs e4m3 (TMA kernel), ms per call")
print(f"{'shape':18s} {'bf16':>7s} {'quant':>7s} {'tuned split':>11s} {'tuned':>7s} {'best':>7s} {'total':>7s}  "
      "rel bf16 / e4m3")
for r in rows:
    print(f"{r['shape']:18s} {r['bf16_ms']:7.3f} {r['quant_ms']:7.3f} {r['e4m3_tuned_split_ms'] or float('nan'):11.3f} "
          f"{r['e4m3_tuned_ms'] or float('nan'):7.3f} "
          f"{r['e4m3_conv_ms']:7.3f} {r['e4m3_total_ms']:7.3f}  {r['bf16_rel']:.1e} / {r['e4m3_rel']:.1e}  "
          f"best {r['e4m3_best_cfg']}")
