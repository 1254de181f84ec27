"""The resnet's residual added in the int8 conv2's epilogue (kernels/conv.conv_igemm(residual=),
stages/fused_epilogues.RESIDUAL_IN_CONV) vs the conv then the separate residual epilogue (perf-notes E47).

    python3 benchmarks/gpu_res_in_conv.py [--rounds 10] [--decode-rounds 15] [--variants plain,maxnreg128]
    # sm_90; $OUT/res_in_conv.json (runs `a` and `b` of E47 ran before --variants: one variant each, `plain` and
    # `maxnreg128`, against the separate epilogue)

1. Per call (CUDA-graph replays), the image decoders' int8 conv shapes: conv + residual epilogue with the next
   GroupNorm's statistics (as the decoder ran it) against the conv with the residual in its epilogue + the stats
   pass the next norm then runs itself; and the same two without statistics (an upsampler reads next). Max |error|
   of each vs the fp32 composition; registers and spills of the compiled conv variants.
2. Whole sdxl-1024 decodes at the default FP8 gate (40 dB, int8 gated at the decode's size), residual in the conv
   on / off, CUDA graphs, interleaved rounds (0.1 s idle before each); PSNR vs the fp32 decode; kernel time by name
   for each (torch.profiler over 5 replays).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import (fp32_reference, graph_kernel_ms, graph_ms, graphed_pipe, interleaved_graph_ms,  # noqa: E402
                     no_tf32, out_dir, run_meta)
from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.kernels import epilogue, tma_conv  # noqa: E402
from vaeopt.kernels.conv import conv_igemm, pack_weight  # noqa: E402
from vaeopt.stages import fused_epilogues  # noqa: E402

gn = importlib.import_module("vaeopt.kernels.group_norm_silu")
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=10)
ap.add_argument("--decode-rounds", type=int, default=15)
ap.add_argument("--variants", default="plain,maxnreg128", help="variants of the residual conv: plain (no register "
                "cap), maxnreg<N> (tma_conv.RES_MAXNREG = N)")
args = ap.parse_args()
VARIANTS = args.variants.split(",")


def use(v: str) -> None:
    tma_conv.RES_MAXNREG = int(v.split("maxnreg")[1]) if "maxnreg" in v else None


OUT = out_dir()
no_tf32()
dev = torch.device("cuda")
cl = torch.channels_last
res = {"calls": [], "decodes": {}}

for c, hw in [(128, 1024), (256, 512), (512, 256), (512, 128)]:
    g = torch.Generator().manual_seed(0)
    xin = F.silu(torch.randn(1, c, hw, hw, generator=g) * 1.5)
    hi = xin.amax().reshape(1)
    s = (hi + 0.27847) / 254
    zq = (hi - 0.27847) / 2 / s
    q = torch.round(xin / s - zq).clamp(-127, 127).to(torch.int8).contiguous(memory_format=cl).to(dev)
    xd = ((q.float().cpu() + zq) * s)
    w = torch.randn(c, c, 3, 3, generator=g) / (9 * c) ** 0.5
    b = torch.randn(c, generator=g) * 0.1
    r = torch.randn(1, c, hw, hw, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=cl)
    pw = pack_weight(w.to(dev), torch.int8)
    s, zq, b = s.to(dev), zq.to(dev), b.to(dev)
    del xin
    G = 32

    # (below 2^24 elements, e.g. 512 ch @128², the epilogue takes no statistics: the norm then runs its own pass,
    # which "conv + epilogue with stats" does not include there)
    def sep(stats=True):
        h = conv_igemm(q, pw, None, (1, 1), x_scale=s, x_zero=zq, out_dtype=torch.bfloat16)
        return epilogue.bias_residual(h, b, r, 1.0, stats_groups=G if stats else None)

    def fused(stats=True):
        y = conv_igemm(q, pw, b, (1, 1), x_scale=s, x_zero=zq, out_dtype=torch.bfloat16, residual=r)
        if stats:  # the pass an int8 norm runs on it (max/min bounds too)
            gn._launch_stats(y, G, None, None, None, None, minmax=True)
        return y

    wd = (pw.w.float().cpu() * pw.scale.cpu()[:, None]).reshape(c, 3, 3, c).permute(0, 3, 1, 2)
    ref = (F.conv2d(xd, wd, b.cpu(), padding=1) + r.float().cpu())
    row = {"shape": f"{c} ch @{hw}²", "err_sep": (sep().float().cpu() - ref).abs().max().item(),
           "err_fused": (fused().float().cpu() - ref).abs().max().item(), "ms": {}}
    variants = {"conv + epilogue with stats": (None, lambda: sep(True)), "conv + epilogue": (None, lambda: sep(False))}
    for v in VARIANTS:
        variants[f"conv+residual ({v}) + stats pass"] = (v, lambda: fused(True))
        variants[f"conv+residual ({v})"] = (v, lambda: fused(False))
    allms = {k: [] for k in variants}
    for i in range(args.rounds):
        for k in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            use(variants[k][0] or "plain")
            allms[k].append(graph_ms(variants[k][1], n=10, reps=10))
    row["ms"] = {k: statistics.median(v) for k, v in allms.items()}
    print(row["shape"], {k: round(v, 4) for k, v in row["ms"].items()}, f"err {row['err_sep']:.3f} / "
          f"{row['err_fused']:.3f}", flush=True)
    res["calls"].append(row)

try:  # registers / spills of each compiled variant of the TMA conv (Triton internals: diagnostic only)
    res["kernels"] = []
    for dev_cache in tma_conv._tma_conv_kernel.device_caches.values():
        for key, k in dev_cache[0].items():
            res["kernels"].append({"key": str(key)[-200:], "regs": getattr(k, "n_regs", None),
                                   "spills": getattr(k, "n_spills", None)})
            print("kernel regs", getattr(k, "n_regs", "?"), "spills", getattr(k, "n_spills", "?"), str(key)[-120:])
except Exception as e:  # noqa: BLE001
    print("no kernel introspection:", type(e).__name__, e)

z = torch.randn(1, 4, 128, 128, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()
refd = fp32_reference("sdxl", z)
pipes, info = {}, {}
for v in [None] + VARIANTS:
    fused_epilogues.RESIDUAL_IN_CONV = v is not None
    use(v or "plain")
    name = f"int8 gate 40, residual {f'in the conv ({v})' if v else 'epilogue'}"
    p, y = graphed_pipe("sdxl", z, 40.0, "A/B", decode_shape=tuple(z.shape))
    st = next((s for s in p.stages if s.name == "fp8 convs"), None)
    info[name] = {"psnr_db": psnr(y.float(), refd), "fp8_layers": (st.data or {}).get("layers") if st else None,
                  "kept": (st.data or {}).get("kept") if st else None}
    pipes[name] = p
    print(name, {k: v for k, v in info[name].items() if k != "kept"}, flush=True)
fused_epilogues.RESIDUAL_IN_CONV = True
ms = interleaved_graph_ms(pipes, z, args.decode_rounds, before=lambda n: time.sleep(0.1))
for name, p in pipes.items():
    info[name]["median_ms"] = statistics.median(ms[name])
    info[name]["ms"] = ms[name]
    info[name]["kernel_ms"] = graph_kernel_ms(p, z)
res["decodes"] = info
res.update(run_meta("python3 benchmarks/gpu_res_in_conv.py " + " ".join(sys.argv[1:])))
(OUT / "res_in_conv.json").write_text(json.dumps(res, indent=1))
print("\n| shape | " + " | ".join(res["calls"][0]["ms"]) + " |")
print("|---|" + "---|" * len(res["calls"][0]["ms"]))
for r in res["calls"]:
    m = r["ms"]
    print(f"| {r['shape']} | " + " | ".join(f"{m[k]:.3f}" for k in m) + " |")
print("\n| sdxl-1024 | median ms | PSNR dB | fp8 layers | top kernels |")
print("|---|---|---|---|---|")
for name, v in info.items():
    top = ", ".join(f"{k[:24]} {t:.2f}" for k, t in list(v["kernel_ms"].items())[:5])
    print(f"| {name} | {v['median_ms']:.2f} | {v['psnr_db']:.1f} | {v['fp8_layers']} | {top} |")
