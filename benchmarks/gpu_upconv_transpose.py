"""Upsampler convs in bf16 as one cuDNN transposed conv (stride 2, 4x4 kernel, padding 1), which writes the 2x
output in place, vs today's 2x2 phase conv (4*Cout channels) + the Triton interleave pass.

    python3 benchmarks/gpu_upconv_transpose.py [--rounds 5]   # writes $OUT/upconv_transpose.json

`nearest 2x + conv3x3(pad 1)` is exactly `conv_transpose2d(x, T(w), stride=2, padding=1)` with the 4x4 taps summed
from the 3x3 kernel (kernels/upconv.transpose_weights). Per shape, as the decode calls it (channels_last bf16, no
TF32), CUDA-graph replays in alternating rounds:
- phase: cuDNN 2x2 conv + interleave (bias added; with the next GroupNorm's statistics for the image shapes, as
  the decode does); its two parts alone;
- transpose: conv_transpose2d without bias, with bias; for the image shapes also + a separate statistics pass
  (what the next GroupNorm would then run itself);
- each under cuDNN's heuristic (the default) and with cudnn.benchmark on.
Relative error vs an fp32 reference (TF32 off) of upsample + conv3x3; max difference between the two bf16 paths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import graph_ms, no_tf32, out_dir, run_meta  # noqa: E402
from vaeopt.kernels import upconv as U  # noqa: E402
from vaeopt.kernels.group_norm_silu import group_norm_partials  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
OUT = out_dir()
dev = torch.device("cuda")
no_tf32()

# (name, N frames, Cin, Cout, H, W, calls per decode, next GroupNorm groups or 0)
SHAPES = [("sdxl up0 512@128", 1, 512, 512, 128, 128, 1, 32), ("sdxl up1 512@256", 1, 512, 512, 256, 256, 1, 32),
          ("sdxl up2 256@512", 1, 256, 256, 512, 512, 1, 32),
          ("wan480 384->192 @120x208 x12", 12, 384, 192, 120, 208, 6, 0),
          ("wan480 192->96 @240x416 x12", 12, 192, 96, 240, 416, 6, 0)]


def transpose_weights(w: torch.Tensor) -> torch.Tensor:
    """(Cout, Cin, 3, 3) -> (Cin, Cout, 4, 4) for conv_transpose2d(stride 2, padding 1); summed in fp32."""
    t = torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float32, device=w.device)
    return torch.einsum("ki,ocij,lj->cokl", t, w.float(), t).to(w.dtype)


def rel(a, r):
    return ((a.float() - r).norm() / r.norm()).item()


rows = []
for name, N, ci, co, H, W, calls, G in SHAPES:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, ci, H, W, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(co, ci, 3, 3, generator=g) / (9 * ci) ** 0.5).to(dev, torch.bfloat16)
    b = (torch.randn(co, generator=g) * 0.1).to(dev, torch.bfloat16)
    ref = U.upconv2x_reference(x[:1].float(), w.float(), b.float())
    w4 = U.phase_weights(w).contiguous(memory_format=torch.channels_last)
    wt = transpose_weights(w).contiguous(memory_format=torch.channels_last)
    flops = 2 * 4 * H * W * co * ci * 4 * N
    sg = G or None
    p = F.conv2d(x, w4, None, padding=1)
    yt = F.conv_transpose2d(x, wt, None, stride=2, padding=1)
    variants = {
        "phase+interleave": lambda: U.upconv2x(x, w4, b, sg),
        "phase conv only": lambda: F.conv2d(x, w4, None, padding=1),
        "interleave only": lambda: U.interleave_phases(p, b, sg),
        "transpose no bias": lambda: F.conv_transpose2d(x, wt, None, stride=2, padding=1),
        "transpose + bias": lambda: F.conv_transpose2d(x, wt, b, stride=2, padding=1),
    }
    if G:
        variants["stats pass only"] = lambda: group_norm_partials(yt, G)
        variants["transpose + stats pass"] = lambda: group_norm_partials(
            F.conv_transpose2d(x, wt, None, stride=2, padding=1), G, x_bias=b)
    row = {"shape": name, "N": N, "cin": ci, "cout": co, "H": H, "W": W, "calls_per_decode": calls,
           "gflop": flops / 1e9, "next_norm_groups": G}
    yp = U.upconv2x(x, w4, b)
    ytb = F.conv_transpose2d(x, wt, b, stride=2, padding=1)
    row["rel_phase"] = rel(yp[:1], ref)
    row["rel_transpose"] = rel(ytb[:1], ref)
    row["max_diff_phase_vs_transpose"] = (yp.float() - ytb.float()).abs().max().item()
    row["transpose_out_channels_last"] = ytb.is_contiguous(memory_format=torch.channels_last)
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        key = "benchmark" if bench else "heuristic"
        res = {k: [] for k in variants}
        for r in range(args.rounds):
            for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                res[k].append(graph_ms(variants[k], n=10, reps=10))
        row[key] = {k: {"median_ms": statistics.median(v), "ms": v} for k, v in res.items()}
        print(name, key, {k: round(statistics.median(v), 4) for k, v in res.items()}, flush=True)
    torch.backends.cudnn.benchmark = False
    rows.append(row)
    x = p = yt = yp = ytb = variants = None
    torch.cuda.empty_cache()

res = {"rows": rows, **run_meta("python3 benchmarks/gpu_upconv_transpose.py " + " ".join(sys.argv[1:]))}
(OUT / "upconv_transpose.json").write_text(json.dumps(res, indent=1))
print("\n| shape | mode | phase + interleave | conv / interleave | transpose (no bias / + bias / + stats) | "
      "rel err phase / transpose |")
print("|---|---|---|---|---|---|")
for r in rows:
    for key in ("heuristic", "benchmark"):
        m = {k: v["median_ms"] for k, v in r[key].items()}
        st = f" / {m['transpose + stats pass']:.3f}" if "transpose + stats pass" in m else ""
        print(f"| {r['shape']} | {key} | {m['phase+interleave']:.3f} | {m['phase conv only']:.3f} / "
              f"{m['interleave only']:.3f} | {m['transpose no bias']:.3f} / {m['transpose + bias']:.3f}{st} | "
              f"{r['rel_phase']:.2e} / {r['rel_transpose']:.2e} |")
