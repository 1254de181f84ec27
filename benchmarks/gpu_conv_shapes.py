"""Per-shape conv efficiency inside one pipeline decode: torch.profiler with shapes, kernel time of every
aten::convolution grouped by (input, weight, stride, padding), FLOPs from the shapes, TFLOP/s.

    python3 benchmarks/gpu_conv_shapes.py [--workload wan21-480p]   -> $OUT/conv_shapes.json

Why: the gaps trace (E27) has convs at 80% of wan21-480p's kernel time but no shapes. Which layers run far below
cuDNN's ~800 TFLOP/s at 384 channels decides where a conv change could still pay.
"""
import argparse
import collections
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import bf16_tma_tile, make_pipe, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.stages import stacked_conv3d  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="wan21-480p")
ap.add_argument("--chunk", type=int, default=None)
ap.add_argument("--variants", default="stacked", help="comma-separated, profiled in this order: stacked (default "
                "options: since E28 the 96-ch convs on the TMA kernel), stack96 (the 96-ch convs time-stacked too, as "
                "before E28 and in h200_conv_shapes-aba's 'stacked' runs), tma (stack_conv3d off, the 96-ch convs on "
                "the TMA kernel with --bf16-tile)")
ap.add_argument("--bf16-tile", default="2,64,64,64,32,4,3,32")
args = ap.parse_args()
OUT = out_dir()
fam, shape = WORKLOADS[args.workload]
z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
video = len(shape) == 5
names = args.variants.split(",")
if "tma" in names:
    bf16_tma_tile(args.bf16_tile)
extra = {"chunk": args.chunk} if args.chunk else {}
pipes = {}
for n in dict.fromkeys(names):
    stacked_conv3d.TMA_96 = n != "stack96"
    pipes[n] = make_pipe(fam, **extra, **({"stack_conv3d": "off"} if n == "tma" else {}))
stacked_conv3d.TMA_96 = True
plans = {n: p.plan(shape) for n, p in pipes.items()}


def flops(inp, w, stride, pad, dil):
    sp = inp[2:]
    k = w[2:]
    out = [(s + 2 * p - d * (kk - 1) - 1) // st + 1 for s, kk, st, p, d in zip(sp, k, stride, pad, dil)]
    return 2 * inp[0] * w[0] * math.prod(out) * w[1] * math.prod(k), out


from torch.profiler import ProfilerActivity, profile  # noqa: E402


def run(name):
    pipe, plan = pipes[name], plans[name]
    fn = (lambda: pipe._decode_video(z, plan, None)) if video else (lambda: pipe._decode_image(z, plan, None))  # noqa: E731
    with torch.inference_mode():
        fn()
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            fn()
            torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: {"calls": 0, "ms": 0.0, "tflop": 0.0})
    kern = collections.Counter()
    for e in prof.events():
        if e.name == "aten::convolution":
            sh, ci = e.input_shapes, e.concrete_inputs
            inp, w = sh[0], sh[1]
            # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
            stride, pad, dil = ci[3], ci[4], ci[5]
            f, out = flops(inp, w, stride, pad, dil)
            a = agg[f"in {tuple(inp)} w {tuple(w)} pad {tuple(pad)} -> {tuple(out)}"]
            a["calls"] += 1
            a["ms"] += e.device_time_total / 1e3
            a["tflop"] += f / 1e12
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[e.key[:160]] += e.self_device_time_total / 1e3
    rows = sorted(({"shape": k, **v, "tflops": v["tflop"] / (v["ms"] / 1e3) if v["ms"] else 0.0}
                   for k, v in agg.items()), key=lambda r: -r["ms"])
    r = {"chunk": plan.chunk if video else None, "stages": [s.line() for s in pipe.stages],
         "kernel_ms_total": sum(kern.values()), "conv_ms_total": sum(r["ms"] for r in rows),
         "conv_tflop_total": sum(r["tflop"] for r in rows), "convs": rows, "kernels_top": kern.most_common(30)}
    print(f"\n## {name} (chunk {r['chunk']})\n{'ms':>8} {'calls':>5} {'TFLOP':>7} {'TFLOP/s':>8}  shape")
    for row in rows[:14]:
        print(f"{row['ms']:8.2f} {row['calls']:5d} {row['tflop']:7.2f} {row['tflops']:8.0f}  {row['shape']}")
    for k, v in r["kernels_top"][:8]:
        print(f"  {v:8.2f}  {k}")
    print(f"{name}: kernels {r['kernel_ms_total']:.1f} ms, cuDNN convs {r['conv_ms_total']:.1f} ms "
          f"({r['conv_tflop_total']:.1f} TFLOP, {r['conv_tflop_total'] / max(r['conv_ms_total'], 1e-9) * 1e3:.0f} "
          "TFLOP/s)", flush=True)
    return r


res = {"workload": args.workload, "order": names, "runs": [{"variant": n, **run(n)} for n in names]}
res.update(run_meta("python3 benchmarks/gpu_conv_shapes.py " + " ".join(sys.argv[1:])))
json.dump(res, open(OUT / f"conv_shapes_{args.workload}.json", "w"), indent=1)
