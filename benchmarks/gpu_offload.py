"""`pipe.enable_model_cpu_offload()` and then `vaeopt.optimize(pipe.vae)`: what a pipeline's decode gets when the VAE
lives on the CPU between calls and accelerate's hook moves it to the GPU for each decode. Full-size models with
random N(0, 0.02) weights, bf16, decoded as a pipeline decodes: `vae.decode(z)` under no_grad (diffusers'
apply_forward_hook runs the hook's pre_forward, which moves the VAE to the GPU), then `hook.offload()` (what the
pipeline's maybe_free_model_hooks does at the end of a call). Variants per workload:
  stock      -- the offloaded VAE left alone;
  before     -- optimize(vae, device="cpu"): what optimize planned for before it followed the hook (the weights' device);
  optimize   -- optimize(vae): planned for the hook's execution device, weights put back on the CPU;
  resident   -- optimize(vae) on a VAE kept on the GPU (no offload): the decode without the transfers.
After one warm-up each (which also measures what a variant leaves on the GPU once optimized, and once it decoded and
was offloaded, against the memory allocated before it was set up), the variants are timed
in --repeats interleaved rounds of one synchronized decode + offload each, with the weights' bare round trip
(stock.to("cuda"), stock.to("cpu")) in every round; peak GPU memory above what was allocated at the call's start, and
PSNR / max abs error against the stock model's fp32 decode on the GPU. Writes $OUT/offload.json; prints a table last.

    python3 benchmarks/gpu_offload.py [--workloads sdxl-1024,wan21-480p] [--repeats 5]
"""
import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import out_dir, random_model, run_meta, timed  # noqa: E402

from accelerate import cpu_offload_with_hook  # noqa: E402

import vaeopt  # noqa: E402
from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.fidelity import psnr  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="sdxl-1024,wan21-480p")
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--profile", default="", help="variants to profile (one decode + offload each, after the timing): "
                "torch.profiler's table of the top ops, by CPU and by CUDA time, into $OUT")
args = ap.parse_args()

result = {**run_meta(" ".join(["python3"] + sys.argv)), "repeats": args.repeats, "workloads": {}}
rows = []
for wl in args.workloads.split(","):
    fam, shape = WORKLOADS[wl]
    base = random_model(fam).eval()
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        ref_model = copy.deepcopy(base).cuda()
        ref = ref_model.decode(z).sample.float().clamp(-1, 1)
        del ref_model
        torch.cuda.empty_cache()
    zb = z.to(torch.bfloat16)

    def once(v):
        out = v["vae"].decode(zb).sample
        if v["hook"] is not None:
            v["hook"].offload()  # the pipeline's maybe_free_model_hooks: the VAE goes back to the CPU
        return out

    # each variant set up and warmed up in turn (Triton compiles / loads its kernels in the warm-up), and what it
    # leaves on the GPU once offloaded: the bytes allocated after optimize + decode + offload beyond those before
    # optimize, less the decode's output
    variants = {}
    for name in ("stock", "before", "optimize", "resident"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        vae = copy.deepcopy(base).to(torch.bfloat16)
        hook = None
        if name == "resident":
            vae.cuda()
        else:
            _, hook = cpu_offload_with_hook(vae, execution_device="cuda")
        lines = []
        if name == "before":
            vaeopt.optimize(vae, device="cpu", log=lines.append)
        elif name != "stock":
            vaeopt.optimize(vae, log=lines.append)
        v = variants[name] = {"vae": vae, "hook": hook, "log": lines, "home": str(next(vae.parameters()).device),
                              "ms": [], "peak": 0}
        torch.cuda.synchronize()
        v["held_after_optimize_mib"] = (torch.cuda.memory_allocated() - before) / 2**20
        with torch.no_grad():
            out = once(v)
        torch.cuda.synchronize()
        v["held_mib"] = (torch.cuda.memory_allocated() - before - out.numel() * out.element_size()) / 2**20
        del out
    # timed rounds, the variants interleaved (the host's pageable copies drift from run to run: E40)
    rt = []
    for _ in range(args.repeats):
        for name, v in variants.items():
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                v["out"], ts = timed(lambda v=v: once(v), 1)
            v["ms"] += ts
            v["peak"] = max(v["peak"], torch.cuda.max_memory_allocated() - before)
        stock = variants["stock"]["vae"]
        _, mv = timed(lambda: (stock.to("cuda"), stock.to("cpu")), 1)  # the weights' round trip alone
        rt += mv
    res = {"weights_round_trip_ms": statistics.median(rt), "weights_round_trip_all_ms": [round(t, 2) for t in rt]}
    for name, v in variants.items():
        if name in args.profile.split(","):
            from torch.profiler import ProfilerActivity, profile

            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                once(v)
                torch.cuda.synchronize()
            ka = prof.key_averages()
            (out_dir() / f"profile_{wl}_{name}.txt").write_text(
                ka.table(sort_by="cpu_time_total", row_limit=30) + "\n" + ka.table(sort_by="cuda_time_total", row_limit=30))
        o = v["out"].float().clamp(-1, 1)
        r = {"median_ms": statistics.median(v["ms"]), "ms": [round(t, 2) for t in v["ms"]],
             "peak_gib_above_call_start": round(v["peak"] / 2**30, 3),
             "psnr_vs_fp32": round(psnr(o, ref), 2), "max_abs_vs_fp32": (o - ref).abs().max().item(),
             "weights_after_optimize": v["home"], "weights_after_decode": str(next(v["vae"].parameters()).device),
             "gpu_mib_held_after_offload": round(v["held_mib"], 1) if v["hook"] is not None else None,
             "gpu_mib_held_after_optimize": round(v["held_after_optimize_mib"], 1) if v["hook"] is not None else None,
             "log": v["log"]}
        res[name] = r
        rows.append((wl, name, r))
        print(f"[{wl}] {name}: {json.dumps(r)}", flush=True)
    del variants, o
    torch.cuda.empty_cache()
    res["speedup_vs_stock"] = res["stock"]["median_ms"] / res["optimize"]["median_ms"]
    result["workloads"][wl] = res

(out_dir() / "offload.json").write_text(json.dumps(result, indent=1))
print(f"\n# {result['gpu']}: vae.decode + hook.offload() under accelerate's model CPU offload (bf16, no_grad)")
print(f"{'workload':12} {'variant':10} {'median ms':>10} {'peak GiB':>9} {'PSNR dB':>8} {'weights after':>14} "
      f"{'MiB held offloaded':>18}")
for wl, name, r in rows:
    held = r["gpu_mib_held_after_offload"]
    print(f"{wl:12} {name:10} {r['median_ms']:10.1f} {r['peak_gib_above_call_start']:9.2f} {r['psnr_vs_fp32']:8.2f} "
          f"{r['weights_after_optimize']:>14} {held if held is not None else float('nan'):18.1f}")
for wl, res in result["workloads"].items():
    print(f"{wl}: the weights' round trip alone (to the GPU and back): {res['weights_round_trip_ms']:.1f} ms")
for wl, res in result["workloads"].items():
    print(f"{wl}: optimize under offload {res['speedup_vs_stock']:.2f}x the stock offloaded decode")
