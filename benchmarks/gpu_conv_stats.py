"""The e4m3 TMA conv taking the next GroupNorm's statistics in its epilogue (perf-notes E27; the kernel change ran at
commit 1d98c9b and was reverted after this measurement: check that commit out to run it). Per call, conv + the
e4m3 norm that reads its output, with and without the stats pass; then whole decodes (CUDA graphs, interleaved in one
process, FP8 gate 30) with tma_conv.STATS on and off.

    python3 benchmarks/gpu_conv_stats.py [--workloads sdxl-1024,flux-1024] [--rounds 15]   -> $OUT/conv_stats.json

Prediction (written before the run): the stats pass of a conv-written norm input reads it once more (~85 us for 128 ch
@1024² on the H100); the epilogue's four reductions over a 128x128 tile cost ~0.5-1 us per ~5 us tile of main loop at
128 channels, less at 256/512. Net per decode ~0.1-0.3 ms on the H100, less on the H200.
"""
import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graph_ms, graphed_pipe, interleaved_graph_ms, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.kernels import tma_conv  # noqa: E402
from vaeopt.kernels.act_quant import quantize_e4m3_per_sample  # noqa: E402
from vaeopt.kernels.conv import E4M3, conv_igemm, pack_weight  # noqa: E402
from vaeopt.kernels.upconv import phase_weights_e4m3, upconv2x_e4m3  # noqa: E402

gns = importlib.import_module("vaeopt.kernels.group_norm_silu")
if not hasattr(tma_conv, "_tile_stats"):  # the experiment was reverted: both variants would be the same code
    sys.exit("gpu_conv_stats.py needs the experiment's code: git checkout 1d98c9b (see the docstring)")
ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="sdxl-1024,flux-1024")
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--no-per-call", action="store_true")
ap.add_argument("--maxnreg", type=int, default=0, help="cap the stats variant's registers (tma_conv.STATS_MAXNREG)")
args = ap.parse_args()
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
G = 32
tma_conv.STATS_MAXNREG = args.maxnreg
res = {"per_call": {}, "decodes": {}}


def check(y_plain, y):
    part = gns.noted_partials(y, G)
    if part is None or not torch.equal(y, y_plain):
        return False
    ref = gns._launch_stats(y_plain, G, None, None, None, None, minmax=True)[4]
    _, m_ref, v_ref = gns.merge_partials(ref[:3])
    _, m, v = gns.merge_partials(part[:3])
    return bool(torch.allclose(m, m_ref, rtol=1e-5, atol=1e-5) and torch.allclose(v, v_ref, rtol=1e-4))


if not args.no_per_call:
    tot = {"plain": 0.0, "stats": 0.0}
    for kind, ci, co, H in [("conv", 128, 128, 1024), ("conv", 256, 128, 1024), ("conv", 256, 256, 512),
                            ("conv", 512, 256, 512), ("conv", 512, 512, 256), ("conv", 512, 512, 128),
                            ("upconv", 256, 256, 512), ("upconv", 512, 512, 256), ("upconv", 512, 512, 128)]:
        x = torch.randn((1, H, H, ci), device=dev, generator=g).to(torch.bfloat16).permute(0, 3, 1, 2)
        x8, s = quantize_e4m3_per_sample(x)
        w = torch.randn((co, ci, 3, 3), device=dev, generator=g) / (9 * ci) ** 0.5
        b = torch.randn(co, device=dev, generator=g) * 0.1
        nw, nb = torch.randn(co, device=dev, generator=g), torch.randn(co, device=dev, generator=g)
        if kind == "conv":
            pw = pack_weight(w, E4M3)
            f = lambda sg=None: conv_igemm(x8, pw, b, (1, 1), x_scale=s, out_dtype=torch.bfloat16,  # noqa: E731
                                           stats_groups=sg)
        else:
            pw4 = phase_weights_e4m3(w)
            f = lambda sg=None: upconv2x_e4m3(x8, s, pw4, b, stats_groups=sg)  # noqa: E731
        row = {"ok": check(f(), f(G)),
               "conv": graph_ms(lambda: f(), n=10), "conv+stats epilogue": graph_ms(lambda: f(G), n=10),
               "conv, norm (stats pass)": graph_ms(lambda: gns.group_norm_silu_e4m3(f(), G, nw, nb), n=10),
               "conv with stats, norm (noted)": graph_ms(lambda: gns.group_norm_silu_e4m3(f(G), G, nw, nb), n=10)}
        key = f"{kind} {ci}->{co} @{H}" + (f"->{2 * H}" if kind == "upconv" else "")
        res["per_call"][key] = row
        tot["plain"] += row["conv, norm (stats pass)"]
        tot["stats"] += row["conv with stats, norm (noted)"]
        print(f"{key:26s} conv {row['conv'] * 1e3:7.1f} us, with stats {row['conv+stats epilogue'] * 1e3:7.1f} us | "
              f"+norm: {row['conv, norm (stats pass)'] * 1e3:7.1f} -> {row['conv with stats, norm (noted)'] * 1e3:7.1f}"
              f" us {'' if row['ok'] else 'WRONG'}", flush=True)
        del x, x8, w
    res["per_call_sum_ms"] = tot
    res["compiled"] = []
    try:  # registers and spills of each compiled variant (Triton's per-device kernel cache)
        for dc in tma_conv._tma_conv_kernel.device_caches.values():
            for ck in dc[0].values():
                c = ck.metadata
                row = {"n_regs": ck.n_regs, "n_spills": ck.n_spills, "shared": getattr(c, "shared", None),
                       "num_warps": getattr(c, "num_warps", None), "name": getattr(c, "name", "")}
                res["compiled"].append(row)
                print("compiled:", row)
    except Exception as e:  # noqa: BLE001
        print("no compiled-kernel info:", type(e).__name__, e)
    torch.cuda.empty_cache()

for wl in [w for w in args.workloads.split(",") if w]:
    fam, shape = WORKLOADS[wl]
    zz = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    pipes, outs, lines = {}, {}, {}
    for name in ("stats pass", "conv epilogue"):
        tma_conv.STATS = name == "conv epilogue"  # captured under it
        pipes[name], outs[name] = graphed_pipe(fam, zz, 30.0, "gpu_conv_stats")
        lines[name] = [s.line() for s in pipes[name].stages if s.name == "fp8"]
    tma_conv.STATS = True
    ms = interleaved_graph_ms(pipes, zz, args.rounds)
    a, b2 = outs["stats pass"].float(), outs["conv epilogue"].float()
    psnr = float(10 * torch.log10(4.0 / ((a - b2) ** 2).mean().clamp_min(1e-20)))
    res["decodes"][f"{wl} fp8-gate30"] = {**{n: {"median_ms": statistics.median(v), "ms": v} for n, v in ms.items()},
                                          "psnr_between_db": psnr, "fp8_stage": lines}
    print(f"{wl} fp8-gate30: stats pass {statistics.median(ms['stats pass']):.2f} ms, conv epilogue "
          f"{statistics.median(ms['conv epilogue']):.2f} ms, outputs agree to {psnr:.1f} dB", flush=True)
    for n, ln in lines.items():
        print(f"   {n}: {ln}")
    del pipes, outs
    torch.cuda.empty_cache()
meta = run_meta("python3 benchmarks/gpu_conv_stats.py " + " ".join(sys.argv[1:]))
(out_dir() / "conv_stats.json").write_text(json.dumps({**meta, **res}, indent=1, default=str))
print(f"\n# {meta['gpu']}")
if res["per_call"]:
    print(f"per call, sum of conv + norm: {res['per_call_sum_ms']['plain']:.3f} -> {res['per_call_sum_ms']['stats']:.3f} ms")
for k, r in res["decodes"].items():
    print(f"{k:22s} stats pass {r['stats pass']['median_ms']:7.2f} ms  conv epilogue {r['conv epilogue']['median_ms']:7.2f} ms")
