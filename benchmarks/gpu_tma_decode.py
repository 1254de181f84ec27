"""Whole decodes through the pipeline's own path with the TMA conv kernel (`vaeopt/kernels/tma_conv.py`) on or off.

    python3 benchmarks/gpu_tma_decode.py --workload wan21-480p --variants stacked,tma,fp8_pointer,fp8_tma
        [--rounds 5] [--chunk 3] [--fp8-gate 30] [--graphs] [--bf16-tile 2,64,64,64,32,4,3,32]  -> $OUT/tma_decode_<workload>.json

A variant name may carry its own chunk: `--variants stacked@3,stacked@5,stacked@10` (latent frames per call).

Variants (one pipeline each, one process, interleaved rounds, CUDA events around each decode):
  stacked      default options (Wan 2.1 bf16 on sm_90 since E28: the 384-ch causal convs as time-stacked cuDNN
               Conv2d, the 96-ch ones on the TMA kernel)
  stack96      the default before E28: the 96-ch convs time-stacked too (stacked_conv3d.TMA_96 = False)
  tma          --stack-conv3d off: triton_conv takes the 96-ch convs; conv_igemm dispatches them to the TMA kernel
               (bf16 too since E28); the 384-ch convs run as cuDNN Conv3d
  pointer      --stack-conv3d off with the TMA kernel disabled (the pointer kernel)
  bf16         default options (image workloads)
  fp8_pointer  --fp8 on --fp8-gate G, the e4m3 convs on the pointer kernel
  fp8_tma      the same on the TMA kernel (image decoders: the upsampler convs too, as e4m3 phase convs)
  fp8_noup     fp8_tma with the upsampler convs kept in bf16 (image decoders)
  fp8_all      fp8_tma with the 128-channel resnet convs too (IMAGE_FP8_MIN_CH = 0)
--profile: afterwards, a torch.profiler kernel table of 3 eager (ungraphed) decodes per variant.
PSNR of each variant's output against the first variant's.
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
from _common import bf16_tma_tile, make_pipe, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.kernels import tma_conv  # noqa: E402
from vaeopt.stages import stacked_conv3d, triton_conv  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="wan21-480p")
ap.add_argument("--variants", default="stacked,tma")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--chunk", type=int, default=None)
ap.add_argument("--fp8-gate", type=float, default=30.0)
ap.add_argument("--graphs", action="store_true", help="image workloads: decode through the captured CUDA graph")
ap.add_argument("--profile", action="store_true")
ap.add_argument("--bf16-tile", default="", help="bh,bw,bk,bn0,bn1,warps,stages,bk1: the bf16 96-ch Conv3d layers "
                "on the TMA kernel take this tile instead of tma_conv.BF16_WAN96")
args = ap.parse_args()
if args.bf16_tile:
    bf16_tma_tile(args.bf16_tile)

OPTS = {"stacked": {}, "stack96": {}, "bf16": {}, "tma": {"stack_conv3d": "off"}, "pointer": {"stack_conv3d": "off"},
        "fp8_pointer": {"fp8": "on", "gate_db": args.fp8_gate}, "fp8_tma": {"fp8": "on", "gate_db": args.fp8_gate},
        "fp8_noup": {"fp8": "on", "gate_db": args.fp8_gate}, "fp8_all": {"fp8": "on", "gate_db": args.fp8_gate}}
calls = {"tma": 0}


def counting(fn):
    def f(*a, **k):
        calls["tma"] += 1
        return fn(*a, **k)
    return f


# what conv_igemm's dispatch calls, and the upsamplers' e4m3 phase convs (one launch each)
tma_conv.conv_tma_checked = counting(tma_conv.conv_tma_checked)
tma_conv.upconv_tma_checked = counting(tma_conv.upconv_tma_checked)
fam, shape = WORKLOADS[args.workload]
z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
extra = {"chunk": args.chunk} if args.chunk else {}
pipes, res = {}, {}
for name in args.variants.split(","):
    base, _, k = name.partition("@")  # "stacked@5": that variant at a fixed chunk of 5 latent frames
    tma_conv.ENABLED = "pointer" not in name
    ups, min_ch = triton_conv.fp8_upsampler_candidates, triton_conv.IMAGE_FP8_MIN_CH
    if base == "fp8_noup":
        triton_conv.fp8_upsampler_candidates = lambda m, d: []
    if base == "fp8_all":
        triton_conv.IMAGE_FP8_MIN_CH = 0
    stacked_conv3d.TMA_96 = base != "stack96"
    p = make_pipe(fam, **({"chunk": int(k)} if k else extra), **OPTS[base])
    stacked_conv3d.TMA_96 = True
    triton_conv.fp8_upsampler_candidates, triton_conv.IMAGE_FP8_MIN_CH = ups, min_ch
    if args.graphs and not p.family.is_video:
        p.enable_graphs("gpu_tma_decode --graphs")
    pipes[name] = (p, p.plan(shape))
    res[name] = {"opts": OPTS[base], "chunk": pipes[name][1].chunk, "stages": [r.line() for r in p.stages], "ms": []}
    print(name, *res[name]["stages"], sep="\n  ", flush=True)


def decode(name):
    p, plan = pipes[name]
    tma_conv.ENABLED = "pointer" not in name
    if p.family.is_video:
        return p._decode_video(z, plan, None)
    return p.graphed(z) if args.graphs else p._decode_whole_raw(z)


outs = {}
with torch.inference_mode():
    for name in pipes:  # warm-up: compiles, allocates
        torch.cuda.reset_peak_memory_stats()
        c0 = calls["tma"]
        outs[name] = decode(name).float().cpu()
        torch.cuda.synchronize()
        res[name]["tma_calls_per_decode"] = calls["tma"] - c0
        res[name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for _ in range(args.rounds):
        for name in pipes:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y = decode(name)
            b.record()
            torch.cuda.synchronize()
            del y
            res[name]["ms"].append(a.elapsed_time(b))
    if args.profile:
        from gpu_profile import profile

        for name in pipes:
            p, plan = pipes[name]
            tma_conv.ENABLED = "pointer" not in name
            fn = (lambda p=p, plan=plan: p._decode_video(z, plan, None)) if p.family.is_video else (
                lambda p=p: p._decode_whole_raw(z))
            res[name]["profile"] = profile(fn, n=3, top=30)
first = next(iter(outs))
for name, r in res.items():
    r["median_ms"] = statistics.median(r["ms"])
    mse = ((outs[name].clamp(-1, 1) - outs[first].clamp(-1, 1)) ** 2).mean().item()
    r[f"psnr_vs_{first}_db"] = 99.0 if mse == 0 else 10 * math.log10(4.0 / mse)
meta = run_meta("python3 benchmarks/gpu_tma_decode.py " + " ".join(sys.argv[1:]))
(out_dir() / f"tma_decode_{args.workload}{'-graphs' if args.graphs else ''}.json").write_text(json.dumps(
    {**meta, "workload": args.workload, "plan_chunk": next(iter(pipes.values()))[1].chunk, "variants": res}, indent=1))
print(f"\n# {meta['gpu']}: {args.workload}, {args.rounds} interleaved rounds")
for name, r in res.items():
    print(f"{name:12s} median {r['median_ms']:7.1f} ms  range {min(r['ms']):.1f}-{max(r['ms']):.1f}  "
          f"tma calls/decode {r['tma_calls_per_decode']:3d}  peak {r['peak_gib']:.2f} GiB  "
          f"PSNR vs {first} {r[f'psnr_vs_{first}_db']:.1f} dB")
if args.profile:
    for name, r in res.items():
        pr = r["profile"]
        print(f"\n## {name}: {pr['total_ms']:.2f} ms of kernels; " + ", ".join(
            f"{k} {v:.2f}" for k, v in pr["by_category_ms"].items()))
        for k, v in pr["top_kernels_ms"][:14]:
            print(f"  {v:6.3f}  {k}")
