"""Upsampler phase convs in bf16: cuDNN (2x2 conv with 4*Cout channels, heuristic choice) + the Triton interleave,
as today, vs the four phases in one launch of the TMA conv kernel with bf16 operands, stored straight into the
upsampled output (kernels/tma_conv.upconv_tma_checked, the e4m3 path's kernel).

    python3 benchmarks/gpu_upconv_bf16.py [--budget-s 300]   # sm_90; writes $OUT/upconv_bf16.json

E19 found cuDNN's heuristic mis-picks these 2x2 convs (1.69 -> 1.12 ms tuned, H100) and E22's profile has 0.42 ms
(sdxl-1024) and 4.7 ms (wan21-480p) of interleave. Per shape: CUDA-event medians, TFLOP/s, the relative error of
each path vs an fp32 reference (TF32 off) of upsample + conv3x3, and the max difference between the two bf16 paths.
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

from _common import event_ms, no_tf32, out_dir, run_meta  # noqa: E402
from vaeopt.kernels import upconv as U  # noqa: E402
from vaeopt.kernels.conv import ConvArgs, pack_weight  # noqa: E402
from vaeopt.kernels.tma_conv import TmaConfig, upconv_tma_checked  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--budget-s", type=float, default=300.0)
args = ap.parse_args()
OUT = out_dir()
dev = torch.device("cuda")
no_tf32()
t_start = time.time()

# (name, N frames, Cin, Cout, H, W, calls per decode)
SHAPES = [("sdxl up0 512@128", 1, 512, 512, 128, 128, 1), ("sdxl up1 512@256", 1, 512, 512, 256, 256, 1),
          ("sdxl up2 256@512", 1, 256, 256, 512, 512, 1),
          ("wan480 384->192 @120x208 x12", 12, 384, 192, 120, 208, 6),
          ("wan480 192->96 @240x416 x12", 12, 192, 96, 240, 416, 6)]
CFGS = [TmaConfig(8, 16, 64, 128, 0, 8, 4), TmaConfig(4, 32, 64, 128, 0, 8, 4), TmaConfig(8, 16, 128, 128, 0, 8, 3),
        TmaConfig(2, 64, 64, 128, 0, 8, 4), TmaConfig(4, 32, 64, 256, 0, 8, 3), TmaConfig(8, 16, 64, 64, 0, 4, 4),
        TmaConfig(1, 128, 64, 128, 0, 8, 4), TmaConfig(8, 32, 64, 128, 0, 8, 3),
        TmaConfig(8, 16, 64, 64, 32, 8, 4), TmaConfig(4, 32, 64, 64, 32, 8, 4), TmaConfig(1, 128, 64, 64, 32, 8, 4),
        TmaConfig(8, 16, 96, 64, 32, 8, 3), TmaConfig(4, 64, 64, 64, 32, 8, 3)]


def rel(a, r):
    return ((a.float() - r).norm() / r.norm()).item()


rows = []
for name, N, ci, co, H, W, calls in SHAPES:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, ci, H, W, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(co, ci, 3, 3, generator=g) / (9 * ci) ** 0.5).to(dev, torch.bfloat16)
    b = (torch.randn(co, generator=g) * 0.1).to(dev, torch.bfloat16)
    ref = U.upconv2x_reference(x[:2].float(), w.float(), b.float())
    w4 = U.phase_weights(w).contiguous(memory_format=torch.channels_last)
    pw4 = pack_weight(U.phase_weights(w), torch.bfloat16, kmajor=True)
    flops = 2 * 4 * H * W * co * ci * 4 * N
    row = {"shape": name, "N": N, "cin": ci, "cout": co, "H": H, "W": W, "calls_per_decode": calls,
           "gflop": flops / 1e9}
    cud = U.upconv2x(x, w4, b)
    row["cudnn_ms"] = event_ms(lambda: U.upconv2x(x, w4, b))
    p = torch.nn.functional.conv2d(x, w4, None, padding=1)
    row["cudnn_conv_only_ms"] = event_ms(lambda: torch.nn.functional.conv2d(x, w4, None, padding=1))
    row["interleave_only_ms"] = event_ms(lambda: U.interleave_phases(p, b))
    row["cudnn_rel"] = rel(cud[:2], ref)
    row["cudnn_tflops"] = flops / row["cudnn_ms"] / 1e9
    a = ConvArgs(N, 1, 1, H, W, False, torch.bfloat16, None, 1.0, False)
    row["configs"] = {}
    best = None
    for cfg in CFGS:
        if time.time() - t_start > args.budget_s:
            break
        if co % cfg.n_width() or (cfg.bk1 == 0 and ci % cfg.bk) or (cfg.bk1 and cfg.bk + cfg.bk1 != ci):
            continue
        key = str(cfg)
        try:
            y = upconv_tma_checked(x, pw4, b, a, cfg).permute(0, 3, 1, 2)
            torch.cuda.synchronize()
            ms = event_ms(lambda: upconv_tma_checked(x, pw4, b, a, cfg))
            r = {"ms": ms, "tflops": flops / ms / 1e9, "rel": rel(y[:2], ref),
                 "max_diff_vs_cudnn": (y.float() - cud.float()).abs().max().item()}
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is a result too
            r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        row["configs"][key] = r
        if "ms" in r and (best is None or r["ms"] < row["configs"][best]["ms"]):
            best = key
        print(name, key, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    row["best"] = best
    if best:
        row["tma_best_ms"] = row["configs"][best]["ms"]
        row["saved_per_decode_ms"] = (row["cudnn_ms"] - row["tma_best_ms"]) * calls
    rows.append(row)
    del x, p, cud
    torch.cuda.empty_cache()

res = {"rows": rows, **run_meta("python3 benchmarks/gpu_upconv_bf16.py " + " ".join(sys.argv[1:]))}
(OUT / "upconv_bf16.json").write_text(json.dumps(res, indent=1))
print("\n| shape | cuDNN + interleave | conv / interleave | TMA bf16 best | TFLOP/s cuDNN / TMA | rel err cuDNN / TMA |"
      " saved per decode |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    bt = r["configs"].get(r.get("best") or "", {})
    print(f"| {r['shape']} | {r['cudnn_ms']:.3f} | {r['cudnn_conv_only_ms']:.3f} / {r['interleave_only_ms']:.3f} | "
          f"{bt.get('ms', float('nan')):.3f} {r.get('best')} | {r['cudnn_tflops']:.0f} / {bt.get('tflops', 0):.0f} | "
          f"{r['cudnn_rel']:.2e} / {bt.get('rel', float('nan')):.2e} | {r.get('saved_per_decode_ms', float('nan')):.3f} |")
