"""An image decoder's head (conv_norm_out + SiLU + conv_out, 128 -> 3 channels) as GroupNorm statistics, one
norm+GEMM kernel and a tap sum (stages/fused_epilogues, kernels/tapconv.group_norm_taps) vs the fused GroupNorm
kernel + cuDNN's conv: per call, and in whole decodes through the pipeline's own path with CUDA graphs.

    python3 benchmarks/gpu_head.py [--workloads sdxl-1024,flux-1024,sd15-512] [--rounds 15]
        -> $OUT/head_<workloads>.json

Whole decodes: per workload two pipelines in one process (fused_epilogues.HEAD_TAPS on / off while each captures
and replays its graph), interleaved rounds, CUDA events; PSNR of each against the fp32 decode of the same weights.
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import event_ms, interleaved_graph_ms, make_pipe, no_tf32, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.kernels import tapconv  # noqa: E402
from vaeopt.kernels.group_norm_silu import group_norm_finalize, group_norm_partials, group_norm_silu  # noqa: E402
from vaeopt.stages import fused_epilogues  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="sdxl-1024,flux-1024,sd15-512")
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--init", default="default", choices=["default", "normal"],
                help="weights: diffusers' default init, as `vaeopt benchmark` (outputs with structure, a meaningful "
                     "PSNR), or _common.make_pipe's N(0, 0.02)")
args = ap.parse_args()
dev = torch.device("cuda")


def per_call(C=128, H=1024, W=1024, co=3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, C, H, W, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    gw, gb = torch.ones(C, device=dev), torch.zeros(C, device=dev)
    w = (torch.randn(co, C, 3, 3, generator=g) / (9 * C) ** 0.5).to(dev, torch.bfloat16)
    b = torch.zeros(co, device=dev, dtype=torch.bfloat16)
    wt, nt = tapconv.tap_weights(w), 9 * co

    def stock():
        return F.conv2d(group_norm_silu(x, 32, gw, gb, 1e-6, True), w, b, padding=1)

    def taps():
        mean, scale = group_norm_finalize(group_norm_partials(x, 32), 32, C, gw, 1e-6)
        y = torch.empty((1, nt, 1, H, W), dtype=x.dtype, device=dev)
        tapconv.group_norm_taps(x, mean, scale, gb, wt, nt, y)
        out = torch.empty((1, co, H, W), dtype=x.dtype, device=dev, memory_format=torch.channels_last)
        tapconv.tap_sum(y, co, (1, 3, 3), b, out.unsqueeze(2))
        return out

    ref = F.conv2d(F.silu(F.group_norm(x.double(), 32, gw.double(), gb.double(), 1e-6)), w.double(), b.double(),
                   padding=1)
    rel = {n: ((f().double() - ref).norm() / ref.norm()).item() for n, f in (("stock", stock), ("taps", taps))}
    return {"shape": [1, C, H, W], "stock_ms": event_ms(stock), "taps_ms": event_ms(taps), "rel_err_vs_fp64": rel}


res = {"per_call": per_call(), "workloads": {}}
print(res["per_call"], flush=True)
for wl in args.workloads.split(","):
    fam, shape = WORKLOADS[wl]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    pipes, r = {}, {}
    for name in ("taps", "stock"):
        fused_epilogues.HEAD_TAPS = name == "taps"
        if args.init == "normal":
            p = make_pipe(fam)
        else:
            from vaeopt.loading import load_vae
            from vaeopt.pipeline import Options, Pipeline

            torch.manual_seed(0)
            p = Pipeline(load_vae(None, family=fam),
                         Options(device="cuda", dtype="bf16", graphs="off", tiling="off"))
        p.enable_graphs("gpu_head")
        pipes[name] = p
        r[name] = {"ms": []}
    ref = None
    with torch.inference_mode():
        m = pipes["taps"].model
        sd = {k: v.float() for k, v in m.state_dict().items()}
        outs = {}
        for name, p in pipes.items():
            fused_epilogues.HEAD_TAPS = name == "taps"
            outs[name] = p.graphed(z.to(dev, torch.bfloat16)).float()
            torch.cuda.synchronize()

        with torch.device("meta"):
            from vaeopt.families import build_model, get_family

            m32 = build_model(get_family(fam))
        m32.load_state_dict(sd, assign=True)
        m32 = m32.to(dev).eval()
        no_tf32()
        ref = m32.decode(z.to(dev)).sample.float()
        del m32
        for name in pipes:
            mse = ((outs[name].clamp(-1, 1) - ref.clamp(-1, 1)) ** 2).mean().item()
            r[name]["psnr_vs_fp32_db"] = 99.0 if mse == 0 else 10 * math.log10(4.0 / mse)
        r["taps_vs_stock_max_abs"] = (outs["taps"] - outs["stock"]).abs().max().item()
        del outs, ref
        zz = z.to(dev, torch.bfloat16)
        for name, ms in interleaved_graph_ms(pipes, zz, args.rounds,
                                             before=lambda n: setattr(fused_epilogues, "HEAD_TAPS", n == "taps")).items():
            r[name]["ms"] = ms
    fused_epilogues.HEAD_TAPS = True
    for name in pipes:
        r[name]["median_ms"] = statistics.median(r[name]["ms"])
        r[name]["min_ms"] = min(r[name]["ms"])
    res["workloads"][wl] = r
    del pipes
    torch.cuda.empty_cache()


meta = run_meta("python3 benchmarks/gpu_head.py " + " ".join(sys.argv[1:]))
(out_dir() / f"head_{args.workloads.replace(',', '_')}.json").write_text(json.dumps({**meta, **res}, indent=1))
pc = res["per_call"]
print(f"\n# {meta['gpu']}\nper call {pc['shape']}: norm kernel + cuDNN conv {pc['stock_ms']:.3f} ms, taps "
      f"{pc['taps_ms']:.3f} ms; rel. error vs fp64 {pc['rel_err_vs_fp64']}")
for wl, r in res["workloads"].items():
    print(f"{wl:10s} graphs: taps {r['taps']['median_ms']:.2f} ms ({min(r['taps']['ms']):.2f}-{max(r['taps']['ms']):.2f}"
          f", {r['taps']['psnr_vs_fp32_db']:.2f} dB), stock {r['stock']['median_ms']:.2f} ms ("
          f"{min(r['stock']['ms']):.2f}-{max(r['stock']['ms']):.2f}, {r['stock']['psnr_vs_fp32_db']:.2f} dB); "
          f"max |taps - stock| {r['taps_vs_stock_max_abs']:.3g}")
