"""Triton implicit-GEMM conv (bf16 and fp8) vs cuDNN at the decoders' conv shapes: correctness, then timings.

    python3 benchmarks/gpu_conv.py                 # GPU machine (torch + triton only), ~3-4 min
    TRITON_INTERPRET=1 python benchmarks/gpu_conv.py --smoke   # CPU smoke test of the script

Per shape: cuDNN bf16 (channels_last[_3d], what vaeopt runs today), a sweep of Triton tile configs in bf16 and fp8
(e4m3 operands, fp32 accumulate, bf16 out; activation quantization timed separately), and for Wan's causal Conv3d
the "three Conv2d over time-shifted frame views" alternative. Error = max |y - y_fp32| / max |y_fp32| against
cuDNN in fp32 (TF32 off). Writes $OUT/conv.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import triton  # noqa: E402

from _common import event_ms  # noqa: E402
from vaeopt.kernels import conv as K  # noqa: E402

# (name, N, Cin, Cout, Tin, H, W, kt): kt None = Conv2d (N frames), else causal Conv3d with Tin = T + kt - 1
SHAPES = [
    ("wan480-96", 1, 96, 96, 6, 480, 832, 3),  # 1 latent frame -> 4 frames, + 2 history
    ("wan480-192", 1, 192, 192, 6, 240, 416, 3),
    ("wan480-384", 1, 384, 384, 4, 120, 208, 3),
    ("wan720-96", 1, 96, 96, 6, 720, 1280, 3),
    ("wan480-up192-96", 4, 192, 96, 1, 480, 832, None),  # WanResample conv2d after the last 2x upsample
    ("sdxl-512@128", 1, 512, 512, 1, 128, 128, None),
    ("sdxl-512@256", 1, 512, 512, 1, 256, 256, None),
    ("sdxl-256@512", 1, 256, 256, 1, 512, 512, None),
    ("sdxl-128@1024", 1, 128, 128, 1, 1024, 1024, None),
]
SMOKE = [("smoke3d", 1, 32, 96, 4, 12, 20, 3), ("smoke2d", 2, 64, 64, 1, 16, 16, None)]

C = K.Config
BF16_CFGS = {  # (block_m, bn0, bn1, block_k, num_warps, num_stages, bk1): see vaeopt.kernels.conv.Config
    96: [C(128, 64, 32, 32, 4, 4), C(128, 64, 32, 64, 4, 4, 32), C(128, 64, 32, 64, 4, 3, 32),
         C(128, 64, 32, 64, 8, 3, 32), C(256, 64, 32, 64, 8, 3, 32), C(64, 64, 32, 64, 4, 4, 32)],
    192: [C(128, 128, 64, 64, 8, 3), C(128, 128, 64, 128, 8, 3, 64), C(128, 64, 0, 128, 4, 3, 64),
          C(256, 64, 0, 128, 8, 3, 64)],
    "big": [C(128, 128, 0, 64, 8, 4), C(256, 128, 0, 64, 8, 3), C(128, 256, 0, 64, 8, 3)],
}
FP8_CFGS = {  # fp8 weights are packed K-major (Hopper's fp8 wgmma operand layout)
    96: [C(128, 64, 32, 32, 4, 4), C(128, 64, 32, 64, 4, 4, 32), C(256, 64, 32, 64, 8, 4, 32),
         C(128, 64, 32, 64, 8, 3, 32)],
    192: [C(128, 128, 64, 128, 8, 3, 64), C(128, 64, 0, 128, 4, 4, 64), C(256, 64, 0, 128, 8, 3, 64)],
    "big": [C(128, 128, 0, 128, 8, 4), C(128, 256, 0, 128, 8, 3), C(256, 128, 0, 128, 8, 3)],
}


def bench(fn, reps: int, warmup: int = 3) -> float:
    """Median ms over reps (CUDA events), or wall time on CPU."""
    if torch.cuda.is_available():
        return event_ms(fn, reps, warmup)
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1000 / reps


def cfgs_for(table, cout: int):
    return table.get(cout, table["big"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=330.0)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shapes = SMOKE if args.smoke else SHAPES
    reps = 2 if args.smoke else args.reps
    t_start = time.time()
    rows = []
    for name, N, Ci, Co, Tin, H, W, kt in shapes:
        torch.manual_seed(0)
        if kt is None:
            x = torch.randn(N, Ci, H, W, device=dev).to(memory_format=torch.channels_last)
            w = torch.randn(Co, Ci, 3, 3, device=dev) / (Ci * 9) ** 0.5
            cudnn = lambda xx, ww, bb: F.conv2d(xx, ww, bb, 1, 1)  # noqa: E731
        else:
            x = torch.randn(N, Ci, Tin, H, W, device=dev).to(memory_format=torch.channels_last_3d)
            w = torch.randn(Co, Ci, kt, 3, 3, device=dev) / (Ci * 27) ** 0.5
            cudnn = lambda xx, ww, bb: F.conv3d(xx, ww, bb, 1, (0, 1, 1))  # noqa: E731
        b = torch.randn(Co, device=dev) * 0.1
        ref = cudnn(x, w, b)
        refmax = ref.abs().max().item()
        mf = torch.channels_last if kt is None else torch.channels_last_3d
        xb, wb, bb = x.to(torch.bfloat16).contiguous(memory_format=mf), w.to(torch.bfloat16).contiguous(
            memory_format=mf), b.to(torch.bfloat16)
        pwb = K.pack_weight(w.to(torch.bfloat16))
        flop = K.flops(tuple(x.shape), pwb)
        row = {"shape": name, "x": list(x.shape), "cout": Co, "kt": kt, "gflop": flop / 1e9, "variants": []}

        def add(variant, ms, y=None, **extra):
            err = None if y is None else (y.float() - ref).abs().max().item() / refmax
            row["variants"].append({"variant": variant, "ms": ms, "tflops": flop / ms / 1e9 if ms else None,
                                    "rel_err": err, **extra})

        y = cudnn(xb, wb, bb)
        add("cudnn-bf16", bench(lambda: cudnn(xb, wb, bb), reps), y)
        del y
        if kt is not None:  # three Conv2d over time-shifted frame views, summed
            xf = xb.permute(0, 2, 1, 3, 4)[0]  # (Tin, C, H, W), channels_last memory
            T = Tin - kt + 1
            w2 = [wb[:, :, i].contiguous(memory_format=torch.channels_last) for i in range(kt)]

            def three():
                o = F.conv2d(xf[0:T], w2[0], bb, 1, 1)
                for i in range(1, kt):
                    o += F.conv2d(xf[i:i + T], w2[i], None, 1, 1)
                return o

            y = three()
            add("cudnn-3xconv2d", bench(three, reps), y.unsqueeze(0).permute(0, 2, 1, 3, 4))
            del y
        best = None
        for cfg in cfgs_for(BF16_CFGS, Co) if not args.smoke else [K.default_config(Ci, Co, dev)]:
            if time.time() - t_start > args.budget_s:
                break
            try:
                y = K.conv_igemm(xb, pwb, b, (1, 1), config=cfg)
                ms = bench(lambda: K.conv_igemm(xb, pwb, b, (1, 1), config=cfg), reps)
            except Exception as e:  # a config that does not compile (e.g. out of shared memory)
                row["variants"].append({"variant": f"triton-bf16 {cfg}", "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            add(f"triton-bf16 {cfg}", ms, y, config=vars(cfg))
            if best is None or ms < best[0]:
                best = (ms, cfg)
            del y
        row["best_bf16"] = None if best is None else {"ms": best[0], "config": vars(best[1])}
        if K.E4M3 is not None and (dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (8, 9)):
            xq, xs = K.quantize_activation(xb)
            pwq = K.pack_weight(w, K.E4M3)
            add("fp8-quantize-x (torch)", bench(lambda: K.quantize_activation(xb), reps))
            bestq = None
            for cfg in cfgs_for(FP8_CFGS, Co) if not args.smoke else [K.default_config(Ci, Co, dev, True)]:
                if time.time() - t_start > args.budget_s:
                    break
                try:
                    y = K.conv_igemm(xq, pwq, b, (1, 1), x_scale=xs, config=cfg)
                    ms = bench(lambda: K.conv_igemm(xq, pwq, b, (1, 1), x_scale=xs, config=cfg), reps)
                except Exception as e:
                    row["variants"].append({"variant": f"triton-fp8 {cfg}", "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                add(f"triton-fp8 {cfg}", ms, y, config=vars(cfg))
                if bestq is None or ms < bestq[0]:
                    bestq = (ms, cfg)
                del y
            row["best_fp8"] = None if bestq is None else {"ms": bestq[0], "config": vars(bestq[1])}
        rows.append(row)
        del x, xb, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[{time.time() - t_start:5.0f}s] {name} done", flush=True)

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python3 benchmarks/gpu_conv.py" + (" --smoke" if args.smoke else ""),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                         "cudnn": torch.backends.cudnn.version()}}
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "conv.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"\n# {meta['gpu']} | torch {torch.__version__} | triton {triton.__version__} | cuDNN {meta['versions']['cudnn']}")
    print(f"{'shape':18} {'GFLOP':>7} {'cuDNN ms':>9} {'TF/s':>5} {'3xc2d':>7} {'triton bf16':>11} {'TF/s':>5} "
          f"{'err':>8} {'fp8 ms':>7} {'TF/s':>5} {'err':>7} {'quant':>6}")
    for r in rows:
        v = {x["variant"]: x for x in r["variants"] if "ms" in x}
        cd = v["cudnn-bf16"]
        c3 = v.get("cudnn-3xconv2d", {}).get("ms")
        bb = r.get("best_bf16")
        bq = r.get("best_fp8")
        tb = v.get(f"triton-bf16 {K.Config(**bb['config'])}") if bb else None
        tq = v.get(f"triton-fp8 {K.Config(**bq['config'])}") if bq else None
        qz = v.get("fp8-quantize-x (torch)", {}).get("ms")
        f = lambda z, k, fmt: format(z[k], fmt) if z and z.get(k) is not None else "-"  # noqa: E731
        print(f"{r['shape']:18} {r['gflop']:7.0f} {cd['ms']:9.3f} {cd['tflops']:5.0f} "
              f"{(format(c3, '.3f') if c3 else '-'):>7} {f(tb, 'ms', '.3f'):>11} {f(tb, 'tflops', '.0f'):>5} "
              f"{f(tb, 'rel_err', '.1e'):>8} {f(tq, 'ms', '.3f'):>7} {f(tq, 'tflops', '.0f'):>5} "
              f"{f(tq, 'rel_err', '.1e'):>7} {(format(qz, '.2f') if qz else '-'):>6}")
        if bb:
            print(f"{'':18} best bf16 {bb['config']}" + (f" | best fp8 {bq['config']}" if bq else ""))


if __name__ == "__main__":
    main()
