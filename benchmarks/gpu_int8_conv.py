"""int8 vs e4m3 on the TMA implicit-GEMM conv (kernels/tma_conv.py), the image decoders' 3x3 resnet conv shapes.

    python3 benchmarks/gpu_int8_conv.py [--rounds 5]   # sm_90; writes $OUT/int8_conv.json

Both take 8-bit operands and run on sm_90's 8-bit wgmma; int8 accumulates in int32 and adds a zero-point term in
the epilogue (x ~= s * (q + zq), asymmetric activations: a SiLU output's range is [-0.28, max]). Per shape, as
CUDA-graph replays in alternating rounds, against cuDNN bf16 without bias (how the decoder calls it): ms, TFLOP/s,
and the relative error of each vs the fp32 conv of the unquantized input (TF32 off).
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
from vaeopt.kernels import tma_conv  # noqa: E402
from vaeopt.kernels.conv import E4M3, conv_igemm, pack_weight  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
OUT = out_dir()
dev = torch.device("cuda")
no_tf32()

# (Cin, Cout, H=W, convs of this shape in an sdxl-1024 decode)
SHAPES = [(512, 512, 128, 10), (512, 512, 256, 6), (512, 256, 512, 1), (256, 256, 512, 5), (256, 128, 1024, 1),
          (128, 128, 1024, 5)]


def no_zp(fn):
    """fn() with the int8 epilogue's zero-point term off (wrong numbers: the main loop's time alone)."""
    tma_conv.ZERO_POINT = False
    try:
        return fn()
    finally:
        tma_conv.ZERO_POINT = True


def rel(a, r):
    return ((a.float() - r).norm() / r.norm()).item()


rows = []
for ci, co, hw, count in SHAPES:
    g = torch.Generator().manual_seed(0)
    x = F.silu(torch.randn(1, ci, hw, hw, generator=g) * 1.5).to(dev).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(co, ci, 3, 3, generator=g) / (9 * ci) ** 0.5).to(dev)
    ref = F.conv2d(x, w, None, padding=1)
    xb, wb = x.bfloat16(), w.bfloat16().contiguous(memory_format=torch.channels_last)
    # e4m3: per-tensor scale
    s8 = x.abs().amax().reshape(1) / 448.0
    x8 = (x / s8).clamp(-448, 448).to(E4M3).contiguous(memory_format=torch.channels_last)
    p8 = pack_weight(w, E4M3)
    # int8: asymmetric over [-0.27847, max]
    hi = x.amax().reshape(1)
    lo = torch.full_like(hi, -0.27847)
    si = (hi - lo) / 254
    zq = (hi + lo) / 2 / si
    xi = torch.round(x / si - zq).clamp(-127, 127).to(torch.int8).contiguous(memory_format=torch.channels_last)
    pi = pack_weight(w, torch.int8)
    variants = {
        "cudnn bf16": lambda: F.conv2d(xb, wb, None, padding=1),
        "tma e4m3": lambda: conv_igemm(x8, p8, None, (1, 1), x_scale=s8),
        "tma int8": lambda: conv_igemm(xi, pi, None, (1, 1), x_scale=si, x_zero=zq),
        "tma int8 no zp": lambda: no_zp(lambda: conv_igemm(xi, pi, None, (1, 1), x_scale=si, x_zero=zq)),
    }
    flop = 2 * hw * hw * co * ci * 9
    row = {"shape": f"{ci}->{co} @{hw}²", "count_per_decode": count, "gflop": flop / 1e9,
           "rel": {k: rel(f(), ref) for k, f in variants.items()}}
    res = {k: [] for k in variants}
    for r in range(args.rounds):
        for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            res[k].append(graph_ms(variants[k], n=10, reps=10))
    row["ms"] = {k: statistics.median(v) for k, v in res.items()}
    row["all_ms"] = res
    row["tflops"] = {k: flop / v / 1e9 for k, v in row["ms"].items()}
    print(row["shape"], {k: round(v, 4) for k, v in row["ms"].items()}, {k: f"{v:.2e}" for k, v in row["rel"].items()},
          flush=True)
    rows.append(row)

res = {"rows": rows, **run_meta("python3 benchmarks/gpu_int8_conv.py " + " ".join(sys.argv[1:]))}
(OUT / "int8_conv.json").write_text(json.dumps(res, indent=1))
print("\n| shape | x/decode | cuDNN bf16 | TMA e4m3 | TMA int8 | TFLOP/s e4m3 / int8 | rel err bf16 / e4m3 / int8 |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    m, t, e = r["ms"], r["tflops"], r["rel"]
    print(f"| {r['shape']} | {r['count_per_decode']} | {m['cudnn bf16']:.3f} | {m['tma e4m3']:.3f} | {m['tma int8']:.3f} | "
          f"{t['tma e4m3']:.0f} / {t['tma int8']:.0f} | {e['cudnn bf16']:.1e} / {e['tma e4m3']:.1e} / {e['tma int8']:.1e} |")
try:  # which MMA each compiled variant uses (Triton internals: diagnostic only)
    for dev_cache in tma_conv._tma_conv_kernel.device_caches.values():
        for key, k in dev_cache[0].items():
            ptx = k.asm.get("ptx", "")
            print("kernel", str(key)[-160:], "wgmma.mma_async:", ptx.count("wgmma.mma_async"), "mma.sync:",
                  ptx.count("mma.sync"), "regs", getattr(k, "n_regs", "?"), "spills", getattr(k, "n_spills", "?"))
except Exception as e:  # noqa: BLE001
    print("no kernel introspection:", type(e).__name__, e)
tot = {k: sum(r["ms"][k] * r["count_per_decode"] for r in rows) for k in rows[0]["ms"]}
print("per sdxl-1024 decode (all 28 resnet convs):", {k: round(v, 3) for k, v in tot.items()})
