"""The resnets' 1x1 shortcut conv inside the residual epilogue (kernels/epilogue.bias_shortcut_residual) vs a
separate GEMM (F.conv2d 1x1, cuBLAS) + the residual epilogue with the next norm's statistics, as the decoder runs them
(perf-notes E47: the fused pass was slower; its code ran at commit 1a9a366 and was reverted after this measurement:
check that commit out to run this script).

    python3 benchmarks/gpu_shortcut_epi.py [--rounds 10] [--decodes bf16,int8]   # $OUT/shortcut_epi.json

1. Per call, the two SDXL/FLUX shortcut shapes (512 -> 256 @512², 256 -> 128 @1024²), bf16, CUDA-graph replays:
   the fused pass under several launch configs (rows per block, K step, warps, programs per SM) against the two
   kernels; max |error| of each vs the fp32 composition, and the fused pass's noted statistics vs the stats
   epilogue's.
2. Whole sdxl-1024 decodes (CUDA graphs, interleaved rounds, 0.1 s idle before each), fusion on / off: bf16, and
   the default FP8 gate (40 dB, int8 resnet convs gated at the decode's size). PSNR vs the fp32 decode.
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

from _common import graph_ms, graphed_pipe, interleaved_graph_ms, no_tf32, out_dir, run_meta  # noqa: E402
from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.kernels import epilogue  # noqa: E402
from vaeopt.stages import fused_epilogues  # noqa: E402

gn = importlib.import_module("vaeopt.kernels.group_norm_silu")
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=10)
ap.add_argument("--decodes", default="bf16,int8", help="whole-decode A/Bs to run (bf16, int8: the default gate)")
ap.add_argument("--configs", default="64:64:8:2,64:64:4:2,128:64:8:1,128:64:8:2,64:128:8:2,32:64:4:4,64:64:4:4")
args = ap.parse_args()
OUT = out_dir()
no_tf32()
dev = torch.device("cuda")
cl = torch.channels_last
res = {"calls": [], "decodes": {}}

for cin, co, hw in [(512, 256, 512), (256, 128, 1024)]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, cin, hw, hw, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=cl)
    h = torch.randn(1, co, hw, hw, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=cl)
    w = (torch.randn(co, cin, 1, 1, generator=g) / cin ** 0.5).to(dev, torch.bfloat16)
    b, rb = torch.randn(co, generator=g).to(dev), torch.randn(co, generator=g).to(dev)
    wt = w.reshape(co, cin).t().contiguous()
    ref = ((F.conv2d(x.float(), w.float()) + rb.view(1, -1, 1, 1)) + (h.float() + b.view(1, -1, 1, 1)))
    G = 32

    def two():
        r = F.conv2d(x, w)
        return epilogue.bias_residual(h, b, r, 1.0, residual_bias=rb, stats_groups=G)

    def fused():
        return epilogue.bias_shortcut_residual(h, b, x, wt, rb, 1.0, stats_groups=G)

    y2 = two()
    p2 = gn.noted_partials(y2, G)
    n2, m2mean, m2m2 = gn.merge_partials(p2[:3])
    row = {"shape": f"{cin}->{co} @{hw}²", "gemm+epilogue": {"err": (y2.float() - ref).abs().max().item()},
           "fused": {}}
    row["gemm+epilogue"]["ms"] = statistics.median(graph_ms(two) for _ in range(args.rounds))
    default = epilogue.SC_LAUNCH
    for spec in args.configs.split(","):
        cfg = tuple(int(v) for v in spec.split(":"))
        epilogue.SC_LAUNCH = cfg
        try:
            y = fused()
            p = gn.noted_partials(y, G)
            n, mean, m2 = gn.merge_partials(p[:3])
            ms = statistics.median(graph_ms(fused) for _ in range(args.rounds))
            row["fused"][spec] = {"ms": ms, "err": (y.float() - ref).abs().max().item(),
                                  "mean_vs_epi": (mean - m2mean).abs().max().item(),
                                  "m2_rel_vs_epi": ((m2 - m2m2) / m2m2).abs().max().item()}
        except Exception as e:  # noqa: BLE001
            row["fused"][spec] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(row["shape"], spec, row["fused"][spec], flush=True)
    epilogue.SC_LAUNCH = default
    print(row["shape"], "gemm+epilogue", row["gemm+epilogue"], flush=True)
    res["calls"].append(row)

if args.decodes:
    from vaeopt.loading import load_vae

    z = torch.randn(1, 4, 128, 128, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()
    torch.manual_seed(0)
    ref_model = load_vae(None, family="sdxl").model.float().cuda().eval()
    with torch.no_grad():
        refd = ref_model.decode(z.float()).sample.float()
    del ref_model
    torch.cuda.empty_cache()
    pipes, info = {}, {}
    for kind in args.decodes.split(","):
        for on in (False, True):
            fused_epilogues.FUSE_SHORTCUT = on
            name = f"{kind} shortcut {'fused' if on else 'GEMM'}"
            gate = 40.0 if kind == "int8" else None
            p, y = graphed_pipe("sdxl", z, gate, "A/B", decode_shape=tuple(z.shape) if gate else None)
            st = next((s for s in p.stages if s.name == "fp8 convs"), None)
            epi = next((s for s in p.stages if s.name == "fused_epilogues"), None)
            info[name] = {"psnr_db": psnr(y.float(), refd), "fp8_layers": (st.data or {}).get("layers") if st else None,
                          "fused_epilogues": epi.detail if epi else None}
            pipes[name] = p
            print(name, info[name], flush=True)
    fused_epilogues.FUSE_SHORTCUT = True
    ms = interleaved_graph_ms(pipes, z, args.rounds, before=lambda n: time.sleep(0.1))
    for name in pipes:
        info[name]["median_ms"] = statistics.median(ms[name])
        info[name]["ms"] = ms[name]
    res["decodes"] = info

res.update(run_meta("python3 benchmarks/gpu_shortcut_epi.py " + " ".join(sys.argv[1:])))
(OUT / "shortcut_epi.json").write_text(json.dumps(res, indent=1))
print("\n| shape | GEMM + epilogue | fused, best config | max err GEMM+epi / fused |")
print("|---|---|---|---|")
for r in res["calls"]:
    ok = {k: v for k, v in r["fused"].items() if "ms" in v}
    best = min(ok, key=lambda k: ok[k]["ms"]) if ok else None
    bs = f"{ok[best]['ms']:.3f} ({best})" if best else "-"
    be = f"{ok[best]['err']:.2e}" if best else "-"
    print(f"| {r['shape']} | {r['gemm+epilogue']['ms']:.3f} | {bs} | {r['gemm+epilogue']['err']:.2e} / {be} |")
if res["decodes"]:
    print("\n| sdxl-1024 | median ms | PSNR dB | fp8 layers |")
    print("|---|---|---|---|")
    for name, v in res["decodes"].items():
        print(f"| {name} | {v['median_ms']:.2f} | {v['psnr_db']:.1f} | {v['fp8_layers']} |")
