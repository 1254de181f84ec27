"""Residual epilogues that also take the next GroupNorm's statistics (perf-notes E26): per call against the
epilogue + the stats pass it replaces, over a few launch configs; then whole decodes with the notes on and off
(CUDA graphs, interleaved in one process), bf16 and e4m3 gate 30.

    python3 benchmarks/gpu_epi_stats.py [--workloads sdxl-1024] [--rounds 15]   -> $OUT/epi_stats.json
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
from vaeopt.kernels import epilogue, upconv  # noqa: E402
from vaeopt.stages import fused_epilogues  # noqa: E402

gns = importlib.import_module("vaeopt.kernels.group_norm_silu")
ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="sdxl-1024")
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--no-sweep", action="store_true", help="whole decodes only, at the package's launch settings")
args = ap.parse_args()
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
CFGS = [(4096, 4, 4, 1), (4096, 4, 4, 2), (2048, 4, 8, 1), (4096, 4, 8, 1)]
SHAPES = [(512, 128), (512, 256), (256, 512), (128, 1024)]
res = {"per_call": {}, "decodes": {}}
if not args.no_sweep:
    tot = {str(c): 0.0 for c in CFGS}
    tot_base = {"bf16": 0.0, "e4m3": 0.0}
    for C, H in SHAPES:
        mk = lambda: torch.randn((1, H, H, C), device=dev, generator=g).to(torch.bfloat16).permute(0, 3, 1, 2)  # noqa
        h, r = mk(), mk() * 2 + 1
        b = torch.randn(C, device=dev, generator=g) * 0.1
        y = epilogue.bias_residual(h, b, r)
        row = {
            "epilogue": graph_ms(lambda: epilogue.bias_residual(h, b, r)),
            "stats bf16": graph_ms(lambda: gns._launch_stats(y, 32, None, None, None, None)),
            "stats e4m3": graph_ms(lambda: gns._launch_stats(y, 32, None, None, None, None, minmax=True)),
        }
        ref = gns._launch_stats(y, 32, None, None, None, None, minmax=True)[4]
        _, m_ref, v_ref = gns.merge_partials(ref[:3])
        for cfg in CFGS:
            epilogue._epi_stats_launch = lambda C, d, cfg=cfg: cfg
            y2 = epilogue.bias_residual(h, b, r, stats_groups=32)
            part = gns.noted_partials(y2, 32)
            _, m, v = gns.merge_partials(part[:3])
            ok = torch.equal(y2, y) and torch.allclose(m, m_ref, rtol=1e-5, atol=1e-5) and \
                torch.allclose(v, v_ref, rtol=1e-4)
            t = graph_ms(lambda: epilogue.bias_residual(h, b, r, stats_groups=32))
            row[f"fused {cfg}"] = t
            row[f"ok {cfg}"] = bool(ok)
            tot[str(cfg)] += t
        tot_base["bf16"] += row["epilogue"] + row["stats bf16"]
        tot_base["e4m3"] += row["epilogue"] + row["stats e4m3"]
        res["per_call"][f"{C}ch@{H}"] = row
        print(f"{C}ch@{H}: epi {row['epilogue']:.3f} + stats {row['stats bf16']:.3f}/{row['stats e4m3']:.3f} ms; fused "
              + ", ".join(f"{c}: {row[f'fused {c}']:.3f}{'' if row[f'ok {c}'] else ' WRONG'}" for c in CFGS), flush=True)
    res["interleave"] = {}
    for C, H in [(512, 128), (512, 256), (256, 512)]:  # the upsamplers' inputs; outputs are 2H
        pp = torch.randn((1, H + 1, H + 1, 4 * C), device=dev, generator=g).to(torch.bfloat16).permute(0, 3, 1, 2)
        b = torch.randn(C, device=dev, generator=g) * 0.1
        y = upconv.interleave_phases(pp, b)
        row = {"interleave": graph_ms(lambda: upconv.interleave_phases(pp, b)),
               "stats bf16": graph_ms(lambda: gns._launch_stats(y, 32, None, None, None, None))}
        for cfg in CFGS:
            epilogue._epi_stats_launch = lambda C, d, cfg=cfg: cfg
            y2 = upconv.interleave_phases(pp, b, stats_groups=32)
            row[f"ok {cfg}"] = bool(torch.equal(y2, y) and gns.noted_partials(y2, 32) is not None)
            row[f"fused {cfg}"] = graph_ms(lambda: upconv.interleave_phases(pp, b, stats_groups=32))
        res["interleave"][f"{C}ch@{H}->{2 * H}"] = row
        print(f"interleave {C}ch@{H}: {row['interleave']:.3f} + stats {row['stats bf16']:.3f} ms; fused "
              + ", ".join(f"{c}: {row[f'fused {c}']:.3f}{'' if row[f'ok {c}'] else ' WRONG'}" for c in CFGS), flush=True)
    ok_all = [c for c in CFGS if all(res["per_call"][k][f"ok {c}"] for k in res["per_call"])]
    pc = res["per_call"]
    best = {"narrow": min(ok_all, key=lambda c: pc["128ch@1024"][f"fused {c}"]),  # C <= 128
            "wide": min(ok_all, key=lambda c: sum(pc[k][f"fused {c}"] for k in pc if not k.startswith("128ch")))}
    res["best_cfg"] = best
    res["sum_ms"] = {"epilogue+stats": tot_base, "fused": tot}
    print(f"sum over shapes: epi+stats {tot_base}, best fused {best}", flush=True)
    epilogue._epi_stats_launch = lambda C, d: best["narrow" if C <= 128 else "wide"]

for wl in args.workloads.split(","):
    fam, shape = WORKLOADS[wl]
    zz = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    for mode in ("bf16", "fp8-gate30"):
        pipes, outs = {}, {}
        for name in ("stats pass", "noted"):
            fused_epilogues.NOTE_STATS = name == "noted"  # captured under it
            pipes[name], outs[name] = graphed_pipe(fam, zz, None if mode == "bf16" else 30.0, "gpu_epi_stats")
        fused_epilogues.NOTE_STATS = True
        ms = interleaved_graph_ms(pipes, zz, args.rounds)
        a, b2 = outs["stats pass"].float(), outs["noted"].float()
        psnr = float(10 * torch.log10(4.0 / ((a - b2) ** 2).mean().clamp_min(1e-20)))
        res["decodes"][f"{wl} {mode}"] = {**{n: {"median_ms": statistics.median(v), "ms": v} for n, v in ms.items()},
                                          "psnr_between_db": psnr}
        print(f"{wl} {mode}: stats pass {statistics.median(ms['stats pass']):.2f} ms, noted "
              f"{statistics.median(ms['noted']):.2f} ms, outputs agree to {psnr:.1f} dB", flush=True)
        del pipes, outs
        torch.cuda.empty_cache()
meta = run_meta("python3 benchmarks/gpu_epi_stats.py " + " ".join(sys.argv[1:]))
(out_dir() / "epi_stats.json").write_text(json.dumps({**meta, **res}, indent=1, default=str))
print(f"\n# {meta['gpu']}")
for k, r in res["decodes"].items():
    print(f"{k:22s} stats pass {r['stats pass']['median_ms']:7.2f} ms  noted {r['noted']['median_ms']:7.2f} ms")
