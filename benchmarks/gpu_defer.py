"""A residual block's output formed by the next norm (Pending, rms_norm_silu / rms_norm_taps `residual=`)
instead of by its own epilogue pass: whole Wan decodes with it on and off, and the two passes it replaces per call.

    python3 benchmarks/gpu_defer.py [--workloads wan21-480p,wan21-720p] [--rounds 8] [--profile]
        -> $OUT/defer_<workloads>.json

Whole decodes: one pipeline per workload (the pipeline's own path, `_decode_video`), `ChunkDecoder.DEFER` toggled
between interleaved decodes, CUDA events around each; the outputs of the two settings compared bit for bit.
Per call (12 output frames + 2 history, bf16): bias_residual then rms_norm_silu vs rms_norm_silu(residual=), for the
time-stacked 96-ch input (taps=3) and the 192-ch conv buffer.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import event_ms, make_pipe, out_dir, run_meta, wan_norm_inputs  # noqa: E402

from vaeopt import video  # noqa: E402
from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.kernels.epilogue import bias_residual  # noqa: E402
from vaeopt.kernels.rms_norm_silu import rms_norm_silu  # noqa: E402
from vaeopt.engine.wan import ChunkDecoder  # noqa: E402
from vaeopt.engine.wan_ops import Pending  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="wan21-480p,wan21-720p")
ap.add_argument("--rounds", type=int, default=8)
ap.add_argument("--profile", action="store_true", help="kernel table of 2 decodes per setting (first workload)")
args = ap.parse_args()
dev = torch.device("cuda")


def per_call():
    rows = {}
    g = torch.Generator().manual_seed(0)
    for name, C, H, W, taps in (("96ch-480p-stacked", 96, 480, 832, 3), ("192ch-240x416-buffer", 192, 240, 416, 0)):
        h, r, kw = wan_norm_inputs(C, H, W, taps, 12, g)
        gamma, beta = torch.ones(C, device=dev), torch.zeros(C, device=dev)
        b, rb = torch.randn(C, device=dev), torch.randn(C, device=dev)
        u = torch.empty_like(h)

        def two():
            v = bias_residual(h, b, r, residual_bias=rb)
            rms_norm_silu(v, gamma, beta, **kw)

        def one():
            rms_norm_silu(h, gamma, beta, x_bias=b, residual=r, residual_bias=rb, sum_out=u, **kw)

        rows[name] = {"epilogue_then_norm_ms": event_ms(two), "norm_with_residual_ms": event_ms(one)}
        v = bias_residual(h, b, r, residual_bias=rb)
        rows[name]["sum_bitwise_equal"] = bool(torch.equal(u, v))
    return rows


res = {"per_call": per_call(), "workloads": {}}
for wl in args.workloads.split(","):
    fam, shape = WORKLOADS[wl]
    pipe = make_pipe(fam)
    plan = pipe.plan(shape)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    r = {"chunk": plan.chunk, "ms": {"on": [], "off": []}, "peak_gib": {}}
    outs = {}
    with torch.inference_mode():
        for mode in ("on", "off"):  # warm-up (compiles, allocates); peaks and outputs
            ChunkDecoder.DEFER = mode == "on"
            torch.cuda.reset_peak_memory_stats()
            outs[mode] = pipe._decode_video(z, plan, None)
            torch.cuda.synchronize()
            r["peak_gib"][mode] = torch.cuda.max_memory_allocated() / 2**30
        r["bitwise_equal"] = bool(torch.equal(outs["on"], outs["off"]))
        r["max_abs_diff"] = (outs["on"].float() - outs["off"].float()).abs().max().item()
        del outs
        for _ in range(args.rounds):
            for mode in ("on", "off"):
                ChunkDecoder.DEFER = mode == "on"
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                y = pipe._decode_video(z, plan, None)
                b.record()
                torch.cuda.synchronize()
                del y
                r["ms"][mode].append(a.elapsed_time(b))
        if args.profile and not res.get("profile"):
            from gpu_profile import profile

            res["profile"] = {}
            for mode in ("on", "off"):
                ChunkDecoder.DEFER = mode == "on"
                res["profile"][mode] = profile(lambda: pipe._decode_video(z, plan, None), n=2, top=20)
    ChunkDecoder.DEFER = True
    r["median_ms"] = {m: statistics.median(v) for m, v in r["ms"].items()}
    res["workloads"][wl] = r
    del pipe
    torch.cuda.empty_cache()

meta = run_meta("python3 benchmarks/gpu_defer.py " + " ".join(sys.argv[1:]))
(out_dir() / f"defer_{args.workloads.replace(',', '_')}.json").write_text(json.dumps({**meta, **res}, indent=1))
print(f"\n# {meta['gpu']}")
for name, row in res["per_call"].items():
    print(f"{name:22s} epilogue+norm {row['epilogue_then_norm_ms']:.3f} ms, norm with residual "
          f"{row['norm_with_residual_ms']:.3f} ms, sum bitwise equal {row['sum_bitwise_equal']}")
if res.get("profile"):
    for mode, pr in res["profile"].items():
        print(f"profile {mode}: {pr['total_ms']:.1f} ms of kernels / 2 decodes; " + ", ".join(
            f"{k} {v:.1f}" for k, v in pr["by_category_ms"].items()))
for wl, r in res["workloads"].items():
    print(f"{wl:12s} chunk {r['chunk']}: on {r['median_ms']['on']:7.1f} ms ({min(r['ms']['on']):.1f}-"
          f"{max(r['ms']['on']):.1f}), off {r['median_ms']['off']:7.1f} ms ({min(r['ms']['off']):.1f}-"
          f"{max(r['ms']['off']):.1f}); peak {r['peak_gib']['on']:.2f} / {r['peak_gib']['off']:.2f} GiB; "
          f"bitwise equal {r['bitwise_equal']} (max diff {r['max_abs_diff']:.2e})")
