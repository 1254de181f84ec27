"""The TMA implicit-GEMM conv (`vaeopt/kernels/tma_conv.py`) against cuDNN and the pointer kernel, per call.

    python3 benchmarks/gpu_tma_conv.py [--quick] [--no-fp8] [--budget-s 420]   # GPU machine; $OUT/tma_conv.json

Video rows: Wan's causal 3x3x3 conv, 12 output frames + 2 history frames (one 3-latent-frame chunk).
  cudnn      cuDNN Conv3d on NDHWC
  stack2d    what the pipeline runs for 96 ch today: the three time taps stacked into channels, cuDNN Conv2d
             (the stacking writes are timed apart: "stack_copy"; in the pipeline the RMS kernel makes them)
  igemm      the pointer kernel (conv.py), default config
  tma        this kernel, best of a sweep of tile shapes (every config's time is in the JSON)
Image rows: SDXL decoder 3x3 convs (C -> C, bias-free, as the pipeline runs them), cudnn = Conv2d.
fp8: e4m3 activations (quantized beforehand, not timed) and per-channel e4m3 weights: igemm vs tma.
Error: max |y - ref| / max |ref| against the fp32 conv (TF32 off).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import triton  # noqa: E402

from _common import event_ms, graph_ms, no_tf32, out_dir, run_meta  # noqa: E402
from vaeopt.kernels import conv as K  # noqa: E402
from vaeopt.kernels import tma_conv as TC  # noqa: E402
from vaeopt.kernels.tma_conv import TmaConfig, conv_tma  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--no-fp8", action="store_true")
ap.add_argument("--fp8-only", action="store_true", help="skip the bf16 kernels' rows (cuDNN stays, as the reference)")
ap.add_argument("--graph", action="store_true", help="time the sweep's configs as CUDA-graph replays (GPU time only; "
                "event timing of single launches includes the host's descriptor setup when that is slower)")
ap.add_argument("--budget-s", type=float, default=420.0)
ap.add_argument("--shapes", default="", help="comma-separated row names (default: all)")
ap.add_argument("--launch", action="store_true", help="only: host time per call of a tiny e4m3 conv, both kernels")
args = ap.parse_args()

OUT = out_dir()
dev = torch.device("cuda")
no_tf32()
T0 = time.time()

VIDEO = [("wan480-96", 96, 480, 832), ("wan480-192", 192, 240, 416), ("wan480-384", 384, 120, 208),
         ("wan720-96", 96, 720, 1280)]
IMAGE = [("sdxl-128@1024", 128, 1024, 1024), ("sdxl-256@512", 256, 512, 512), ("sdxl-512@256", 512, 256, 256)]
if args.quick:
    VIDEO, IMAGE = VIDEO[:1], IMAGE[:1]
if args.shapes:
    VIDEO = [v for v in VIDEO if v[0] in args.shapes.split(",")]
    IMAGE = [v for v in IMAGE if v[0] in args.shapes.split(",")]
T = 12


def rel(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def tiles(w: int, bm: int):
    """(bh, bw) rectangles of bm pixels, widest first, bw at most the next power of two of the width."""
    out, bw = [], min(256, triton.next_power_of_2(w), bm)
    while bw >= 16 and len(out) < 3:
        out.append((bm // bw, bw))
        bw //= 2
    return out


def sweep(c: int, w: int, fp8: bool) -> list[TmaConfig]:
    bks = [b for b in ((128, 64) if fp8 else (64, 32)) if c % b == 0] or [32]
    cfgs = []
    if c == 96:
        ns = [(64, 32, 128, 4), (64, 32, 256, 8), (32, 0, 128, 4)]
    elif c == 192:
        ns = [(128, 64, 128, 8), (128, 64, 64, 4), (64, 0, 128, 4)]
    else:
        ns = [(128, 0, 128, 8), (128, 0, 256, 8), (256, 0, 128, 8)]
    for bn0, bn1, bm, warps in ns:
        for i, (bh, bw) in enumerate(tiles(w, bm)):
            for bk in bks[:1] if i else bks:
                for st in (3, 4) if (i == 0 and bk == bks[0]) else (4,):
                    cfgs.append(TmaConfig(bh, bw, bk, bn0, bn1, warps, st))
    if c == 96:  # one K step per tap: a 64- and a 32-channel box
        for bn0, bn1, bm, warps in ns[:2]:
            for bh, bw in tiles(w, bm)[:2]:
                for st in (2, 3, 4):
                    cfgs.append(TmaConfig(bh, bw, 64, bn0, bn1, warps, st, bk1=32))
    # (run b also tried Triton's automatic warp specialization of the K loop, `tl.range(warp_specialize=True)`: it
    # failed to compile with two accumulators or 4 warps and gained <= 2% elsewhere; dropped)
    return cfgs[:8] if args.quick else cfgs


def time_tma(x, pw, xs, cfgs, ref_fast):
    res, best = [], None
    for cfg in cfgs:
        if time.time() - T0 > args.budget_s:
            res.append({"cfg": str(cfg), "skipped": "budget"})
            continue
        try:
            y = conv_tma(x, pw, None, (1, 1), x_scale=xs, config=cfg)
            torch.cuda.synchronize()
            err = rel(y, ref_fast)
            f = lambda: conv_tma(x, pw, None, (1, 1), x_scale=xs, config=cfg)  # noqa: E731
            ms = graph_ms(f, n=10, reps=10) if args.graph else event_ms(f, 10, 2)
        except Exception as e:  # noqa: BLE001 (compile errors, shared memory limits)
            res.append({"cfg": str(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        res.append({"cfg": str(cfg), "ms": ms, "err_vs_bf16": err})
        if err < 0.1 and (best is None or ms < best[0]):
            best = (ms, cfg)
    return res, best


if args.launch:  # CPU-side cost per call (descriptor objects + launch) where the GPU work is negligible
    x = torch.randn(1, 128, 16, 16, device=dev).contiguous(memory_format=torch.channels_last)
    xq, s = K.quantize_activation(x)
    p8 = K.pack_weight(torch.randn(128, 128, 3, 3, device=dev) * 0.05, K.E4M3)
    cfg = TmaConfig(4, 32, 128, 128, 0, 8, 4)
    launch = {}
    for name, fn in (("igemm", lambda: K.conv_igemm(xq, p8, None, (1, 1), x_scale=s)),
                     ("tma", lambda: conv_tma(xq, p8, None, (1, 1), x_scale=s, config=cfg))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(500):
            fn()
        launch[name] = (time.perf_counter() - t) / 500 * 1e6
        torch.cuda.synchronize()
    meta = run_meta("python3 benchmarks/gpu_tma_conv.py " + " ".join(sys.argv[1:]))
    (OUT / "tma_launch.json").write_text(json.dumps({**meta, "host_us_per_call": launch}, indent=1))
    print(f"host us per call: {launch}")
    sys.exit(0)

rows = []
for kind, shapes in (("video", VIDEO), ("image", IMAGE)):
    for name, c, H, W in shapes:
        g = torch.Generator().manual_seed(0)
        if kind == "video":
            x = torch.randn(1, c, T + 2, H, W, generator=g).to(dev, torch.bfloat16).contiguous(
                memory_format=torch.channels_last_3d)
            w = (torch.randn(c, c, 3, 3, 3, generator=g) / (27 * c) ** 0.5).to(dev, torch.bfloat16)
            ref = F.conv3d(x.float(), w.float(), None, 1, (0, 1, 1))
            wc = w.contiguous(memory_format=torch.channels_last_3d)
            cud = lambda: F.conv3d(x, wc, None, 1, (0, 1, 1))  # noqa: E731
            fl = 2 * T * H * W * c * c * 27
        else:
            x = torch.randn(1, c, H, W, generator=g).to(dev, torch.bfloat16).contiguous(
                memory_format=torch.channels_last)
            w = (torch.randn(c, c, 3, 3, generator=g) / (9 * c) ** 0.5).to(dev, torch.bfloat16)
            ref = F.conv2d(x.float(), w.float(), None, 1, 1)
            wc = w.contiguous(memory_format=torch.channels_last)
            cud = lambda: F.conv2d(x, wc, None, 1, 1)  # noqa: E731
            fl = 2 * H * W * c * c * 9
        r = {"shape": name, "kind": kind, "C": c, "H": H, "W": W, "T": T if kind == "video" else 1, "flop": fl}
        ycud = cud()
        r["ms_cudnn"], r["err_cudnn"] = (graph_ms(cud, n=10, reps=10) if args.graph else event_ms(cud)), rel(ycud, ref)
        if kind == "video":
            ws = w.permute(0, 2, 1, 3, 4).reshape(c, 3 * c, 3, 3).contiguous(memory_format=torch.channels_last)
            xsk = torch.empty((T, H, W, 3 * c), device=dev, dtype=x.dtype)
            xf = x[0].permute(1, 2, 3, 0)

            def stack():
                for dt in range(3):
                    xsk[..., dt * c:(dt + 1) * c].copy_(xf[dt:dt + T])

            stack()
            xs4 = xsk.permute(0, 3, 1, 2)
            r["ms_stack_copy"] = event_ms(stack)
            r["ms_stack2d"] = event_ms(lambda: F.conv2d(xs4, ws, None, 1, 1))
            r["err_stack2d"] = rel(F.conv2d(xs4, ws, None, 1, 1).permute(1, 0, 2, 3).unsqueeze(0), ref)
            del xsk, xs4
        pw = K.pack_weight(w)
        if not args.fp8_only:
            r["ms_igemm"] = event_ms(lambda: K.conv_igemm(x, pw, None, (1, 1)), 10, 2)
            r["err_igemm"] = rel(K.conv_igemm(x, pw, None, (1, 1)), ref)
        pwk = K.pack_weight(w, kmajor=True)
        r["tma"], best = time_tma(x, pwk, None, sweep(c, W, False), ycud) if not args.fp8_only else ([], None)
        if best:
            r["ms_tma"], r["cfg_tma"] = best[0], str(best[1])
            r["err_tma"] = rel(conv_tma(x, pwk, None, (1, 1), config=best[1]), ref)
        if not args.no_fp8:
            xq, s = K.quantize_activation(x)
            p8 = K.pack_weight(w, K.E4M3)
            TC.ENABLED = False  # the pointer kernel: conv_igemm would hand K-major e4m3 weights to the TMA kernel
            try:
                f8 = lambda: K.conv_igemm(xq, p8, None, (1, 1), x_scale=s)  # noqa: E731
                r["ms_igemm_fp8"] = graph_ms(f8, n=10, reps=10) if args.graph else event_ms(f8, 10, 2)
                r["err_igemm_fp8"] = rel(f8(), ref)
            finally:
                TC.ENABLED = True
            r["tma_fp8"], best8 = time_tma(xq, p8, s, sweep(c, W, True), ycud)
            if best8:
                r["ms_tma_fp8"], r["cfg_tma_fp8"] = best8[0], str(best8[1])
                r["err_tma_fp8"] = rel(conv_tma(xq, p8, None, (1, 1), x_scale=s, config=best8[1]), ref)
            del xq
        for k in [k for k in list(r) if k.startswith("ms_") and k != "ms_stack_copy"]:
            r["tf" + k[2:]] = fl / r[k] / 1e9
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("tma", "tma_fp8")}), flush=True)
        del x, ref, ycud
        torch.cuda.empty_cache()

meta = run_meta("python3 benchmarks/gpu_tma_conv.py " + " ".join(sys.argv[1:]))
# timing: "graph" = the sweep, cuDNN and the pointer kernel as CUDA-graph replays (cuDNN and the pointer kernel only
# since b758067; the fp8 "_22g" results of 2026-11-22 have them event-timed)
(OUT / "tma_conv.json").write_text(json.dumps({**meta, "timing": "graph" if args.graph else "event", "rows": rows},
                                              indent=1))
print(f"\n# {meta['gpu']} | torch {torch.__version__} | triton {triton.__version__} | cuDNN {meta['versions']['cudnn']}"
      f" | {time.time() - T0:.0f} s")
print("ms per call (TFLOP/s): cudnn | stack2d (+copy) | igemm | tma | igemm fp8 | tma fp8")


def f(r, k):
    return f"{r[k]:.3f} ({r['tf' + k[2:]]:.0f})" if k in r else "-"


for r in rows:
    st = f"{f(r, 'ms_stack2d')} +{r['ms_stack_copy']:.2f}" if "ms_stack2d" in r else "-"
    print(f"{r['shape']:14s} {f(r, 'ms_cudnn'):>14s} | {st:>20s} | {f(r, 'ms_igemm'):>14s} | {f(r, 'ms_tma'):>14s} | "
          f"{f(r, 'ms_igemm_fp8'):>14s} | {f(r, 'ms_tma_fp8'):>14s}")
    print(f"{'':14s} tma: {r.get('cfg_tma', '-')} err {r.get('err_tma', float('nan')):.1e};"
          f" fp8: {r.get('cfg_tma_fp8', '-')} err {r.get('err_tma_fp8', float('nan')):.1e}")
    fails = [x["error"] for x in r.get("tma", []) + r.get("tma_fp8", []) if "error" in x]
    if fails:
        print(f"{'':14s} {len(fails)} configs failed, e.g. {fails[0][:150]}")
