"""`pipe.vae = vaeopt.optimize(pipe.vae)`: what a diffusers pipeline's own `vae.decode(latents)` gets, against the
same VAE left alone. Full-size models with random N(0, 0.02) weights (timing equals real weights), bf16 on the GPU,
decoded as a pipeline decodes (under torch.no_grad, the parameters left with requires_grad=True as from_pretrained
leaves them). Per workload:
  diffusers   -- the stock model, `vae.decode(z).sample`;
  optimize    -- a copy after `vaeopt.optimize(vae)`, the same call (Wan: it now runs vaeopt.video's chunk decoder);
  frameloop   -- Wan only: the same optimized copy with diffusers' own _decode put back (its frame loop on the
                 optimized modules: what `optimize` gave a WanPipeline before vae.decode was routed);
each timed over --repeats synchronized calls after one warm-up, with its peak memory and its PSNR / max abs error
against the stock model's fp32 decode. For Wan it also counts the chunk decoder's calls, to show which path ran.
Writes $OUT/optimize_api.json; prints a table last.

    python3 benchmarks/gpu_optimize_api.py [--workloads wan21-480p,sdxl-1024] [--repeats 5]
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

import vaeopt  # noqa: E402
from vaeopt import video  # noqa: E402
from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.fidelity import psnr  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="wan21-480p,sdxl-1024")
ap.add_argument("--repeats", type=int, default=5)
args = ap.parse_args()

calls = []
_real = video.decode_video


def _counted(*a, **k):
    calls.append(k.get("chunk"))
    return _real(*a, **k)


video.decode_video = _counted  # what api._WanChunkDecode calls (it looks it up on the module at call time)

result = {**run_meta(" ".join(["python3"] + sys.argv)), "repeats": args.repeats, "workloads": {}}
rows = []
for wl in args.workloads.split(","):
    fam, shape = WORKLOADS[wl]
    base = random_model(fam)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        ref_model = copy.deepcopy(base).cuda().eval()
        ref = ref_model.decode(z).sample.float().clamp(-1, 1)
        del ref_model
        torch.cuda.empty_cache()
    res = {}
    for name in ("diffusers", "optimize") + (("frameloop",) if fam.startswith("wan") else ()):
        vae = copy.deepcopy(base).to("cuda", torch.bfloat16).eval()
        if name != "diffusers":
            lines = []
            vaeopt.optimize(vae, log=lines.append)
            res["optimize_log"] = lines
        if name == "frameloop":
            del vae._decode  # the class's _decode again
        zb = z.to(torch.bfloat16)
        n0 = len(calls)
        with torch.no_grad():
            vae.decode(zb)  # warm-up (Triton compiles / loads its kernels here)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out, ts = timed(lambda vae=vae: vae.decode(zb).sample, args.repeats)
        peak = torch.cuda.max_memory_allocated() / 2**30
        o = out.float().clamp(-1, 1)
        r = {"median_ms": statistics.median(ts), "ms": [round(t, 2) for t in ts], "peak_gib": round(peak, 3),
             "psnr_vs_fp32": round(psnr(o, ref), 2), "max_abs_vs_fp32": (o - ref).abs().max().item(),
             "contiguous": out.is_contiguous(), "chunk_decoder_calls": len(calls) - n0,
             "chunks": sorted({c for c in calls[n0:] if c is not None})}
        res[name] = r
        rows.append((wl, name, r))
        print(f"[{wl}] {name}: {json.dumps(r)}", flush=True)
        del vae, out, o
        torch.cuda.empty_cache()
    res["speedup"] = res["diffusers"]["median_ms"] / res["optimize"]["median_ms"]
    result["workloads"][wl] = res

(out_dir() / "optimize_api.json").write_text(json.dumps(result, indent=1))
print(f"\n# {result['gpu']}: diffusers vae.decode vs the same after vaeopt.optimize (bf16, no_grad)")
print(f"{'workload':12} {'variant':10} {'median ms':>10} {'peak GiB':>9} {'PSNR dB':>8} {'chunk calls':>11}")
for wl, name, r in rows:
    print(f"{wl:12} {name:10} {r['median_ms']:10.1f} {r['peak_gib']:9.2f} {r['psnr_vs_fp32']:8.2f} "
          f"{r['chunk_decoder_calls']:11d}")
for wl, res in result["workloads"].items():
    print(f"{wl}: optimize {res['speedup']:.2f}x the stock decode")
