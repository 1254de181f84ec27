"""wan21-480p on one GPU: vaeopt.video's fused Wan kernel path on vs off, with cudnn.benchmark off vs on.

Full-size Wan 2.1 VAE (vaeopt.families.build_model, diffusers' default init, seed 0) in bf16 through
vaeopt.pipeline.Pipeline (stages as the CLI applies them: channels_last_3d + fused RMSNorm+SiLU), latents
(1, 16, 21, 60, 104) -> 81 frames 480x832, `vaeopt.video.decode_video(..., chunk=4, fused=...)`:

  * fused off: the torch path (conv + separate bias kernel, residual adds, aten nearest upsample, norm outputs
    copied into the conv buffers); fused on: conv biases folded into the next kernel, one-pass residual epilogues,
    the norms writing into the conv buffers, the 2x upsample fused into the epilogue / time_conv interleave;
  * for each (fused, cudnn.benchmark): median of --repeats decodes (CUDA events, one warm-up excluded), peak memory
    (max_memory_allocated, and above the pre-call allocation, next to estimate_chunk_bytes), max / mean |diff|
    against diffusers' own bf16 decode of the same weights (a stock copy, NCDHW, timed too) and against the
    unfused decode;
  * fidelity on a smaller clip (1, 16, 9, 30, 52) against an fp32 reference (stock model, TF32 off): diffusers bf16,
    ours bf16 fused / unfused, and ours fp32 fused / unfused (the exactness claim: <= 1e-4);
  * a torch.profiler kernel-time breakdown by category (benchmarks/gpu_profile.py's profile()/category(), with our
    epilogue kernels and Memcpy split out), fused on and off, and what the fused decoder did (its stats).
Prints a short table last and writes $OUT/wan_fused.json (GPU, versions, date).

    python3 benchmarks/gpu_wan_fused.py                       # ~1.5-2 min on an H200
    TRITON_INTERPRET=1 python3 benchmarks/gpu_wan_fused.py --device cpu --tiny   # smoke test of the script (CPU)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from vaeopt import video  # noqa: E402
from vaeopt.families import build_model, get_family  # noqa: E402
from vaeopt.loading import LoadedVAE  # noqa: E402
from vaeopt.pipeline import Options, Pipeline  # noqa: E402
from vaeopt.engine.wan import ChunkDecoder  # noqa: E402

LATENT = (1, 16, 21, 60, 104)
SMALL = (1, 16, 9, 30, 52)
GiB = 2**30


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, repeats):
    """(median s, times, last output, peak bytes, peak above the pre-call allocation); one warm-up run first."""
    out = fn()
    del out
    cuda = dev.type == "cuda"
    base = 0
    if cuda:
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    times = []
    for i in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
        if i < repeats - 1:
            del out
    peak = torch.cuda.max_memory_allocated(dev) if cuda else None
    return statistics.median(times), times, out, peak, (peak - base) if cuda else None


def diff(a, b) -> dict:
    """max / mean |a - b| in fp32, frame by frame (no full-clip fp32 temporaries)."""
    mx, tot, n = 0.0, 0.0, 0
    for t in range(a.shape[2]):
        d = (a[:, :, t].float() - b[:, :, t].float()).abs()
        mx = max(mx, d.max().item())
        tot += d.sum().item()
        n += d.numel()
    return {"max": mx, "mean": tot / max(1, n)}


def versions(dev) -> dict:
    import diffusers

    v = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
         "diffusers": diffusers.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:
        v["triton"] = None
    v["gpu"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    try:
        v["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                  cwd=HERE.parent).stdout.strip() or None
        v["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                                             timeout=5, cwd=HERE.parent).stdout.strip())
    except Exception:
        v["git"] = None
    return v


def make_model(tiny: bool, seed: int = 0):
    torch.manual_seed(seed)
    kw = {"base_dim": 8} if tiny else {}
    return build_model(get_family("wan21"), **kw)


def make_pipe(model, dev, dtype: str) -> Pipeline:
    """The model through vaeopt's pipeline, as the CLI would run it (graphs and tiling off: chunked video)."""
    opts = dict(device=str(dev), dtype=dtype, graphs="off", tiling="off")
    if dev.type != "cuda":  # smoke test: force the stages the GPU run gets (kernels through the interpreter)
        opts.update(triton="on", channels_last="on")
    return Pipeline(LoadedVAE(model, get_family("wan21"), "random", None, [], None), Options(**opts))


def fused_stats(vae, z, chunk) -> dict:
    """What the fused decoder did over one decode (counts of folded biases, epilogues, kernels)."""
    made = []

    class Recording(ChunkDecoder):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    orig = video.ChunkDecoder
    video.ChunkDecoder = Recording
    try:
        with torch.inference_mode():
            video.decode_video(vae, z, chunk, fused=True)
    finally:
        video.ChunkDecoder = orig
    return dict(made[0].stats)


def profile_breakdown(fn) -> dict:
    import gpu_profile

    base = gpu_profile.category

    def category(name: str) -> str:
        n = name.lower()
        if n.startswith("_epi_up"):
            return "epilogue+upsample"
        if n.startswith("_epi_"):
            return "epilogue"
        if "memcpy" in n or "memset" in n:
            return "memcpy/memset"
        return base(name)

    gpu_profile.category = category
    try:
        return gpu_profile.profile(fn, n=1)
    finally:
        gpu_profile.category = base


def fidelity(dev, tiny: bool, ref_bf16_model, vae_bf16) -> dict:
    """Small clip: errors against an fp32 reference (stock model, TF32 off)."""
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        shape = (1, 16, 5, 4, 6) if tiny else SMALL
        z = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dev)
        stock32 = make_model(tiny).to(dev)  # same seed: the fp32 weights the bf16 models were cast from
        with torch.inference_mode():
            ref32 = stock32.decode(z).sample
            res = {"shape": list(shape),
                   "diffusers_bf16": diff(ref_bf16_model.decode(z.bfloat16()).sample, ref32)}
            for f in (False, True):
                res[f"ours_bf16_fused_{f}"] = diff(video.decode_video(vae_bf16, z.bfloat16(), 4, fused=f), ref32)
        del stock32
        pipe32 = make_pipe(make_model(tiny), dev, "fp32")  # same seed: the same weights
        with torch.inference_mode():
            for f in (False, True):
                res[f"ours_fp32_fused_{f}"] = diff(video.decode_video(pipe32.model, z, 4, fused=f), ref32)
        res["fp32_exact_le_1e-4"] = all(res[f"ours_fp32_fused_{f}"]["max"] <= 1e-4 for f in (False, True))
        del pipe32
        return res
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and latent (smoke test)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/wan_fused.json)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    t_start = time.perf_counter()

    model = make_model(args.tiny)
    stock = copy.deepcopy(model).to(dev, torch.bfloat16)  # diffusers as shipped: no stages, NCDHW
    pipe = make_pipe(model, dev, "bf16")
    vae = pipe.model
    shape = (1, 16, 5, 4, 6) if args.tiny else LATENT
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)
    info = versions(dev)
    stages = [s.line() for s in pipe.stages]
    print(f"# {info['gpu']} | torch {info['torch']} cuDNN {info['cudnn']} triton {info['triton']} "
          f"diffusers {info['diffusers']} | wan21 {shape} bf16, chunk {args.chunk}", flush=True)
    for s in stages:
        print("#   " + s, flush=True)

    rows = []
    outs = {}
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        variants = [("diffusers", None), ("vaeopt", False), ("vaeopt", True)]
        for name, fused in variants:
            if name == "diffusers":
                def fn():
                    with torch.inference_mode():
                        return stock.decode(z).sample
            else:
                def fn(fused=fused):
                    with torch.inference_mode():
                        return video.decode_video(vae, z, args.chunk, fused=fused)
            med, times, out, peak, over = timed(fn, dev, args.repeats)
            row = {"variant": name, "fused": fused, "cudnn_benchmark": bench, "median_s": med, "times_s": times,
                   "peak_gib": peak / GiB if peak is not None else None,
                   "peak_over_base_gib": over / GiB if over is not None else None}
            if name == "diffusers":
                if "diffusers" not in outs:
                    outs["diffusers"] = out
            else:
                row["estimate_gib"] = video.estimate_chunk_bytes(vae, shape, args.chunk, torch.bfloat16,
                                                                 channels_last=True, fused=bool(fused)) / GiB
                row["vs_diffusers_bf16"] = diff(out, outs["diffusers"])
                key = f"fused_{fused}"
                if key in outs:
                    row["vs_same_variant_other_cudnn_setting"] = diff(out, outs[key])
                else:
                    outs[key] = out
                if fused and "fused_False" in outs:
                    row["vs_unfused"] = diff(out, outs["fused_False"])
            del out
            rows.append(row)
            print(json.dumps(row), flush=True)
    del outs
    best_bench = min((r for r in rows if r["fused"]), key=lambda r: r["median_s"])["cudnn_benchmark"]
    torch.backends.cudnn.benchmark = best_bench

    stats = fused_stats(vae, z, args.chunk)
    print("fused decoder stats:", json.dumps(stats), flush=True)

    profiles = {}
    if dev.type == "cuda" and not args.no_profile:
        for fused in (False, True):
            def fn(fused=fused):
                with torch.inference_mode():
                    return video.decode_video(vae, z, args.chunk, fused=fused)
            profiles[f"fused_{fused}"] = profile_breakdown(fn)
            p = profiles[f"fused_{fused}"]
            print(f"profile fused={fused} (cudnn.benchmark={best_bench}): {p['total_ms']:.1f} ms kernel time: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in p["by_category_ms"].items()), flush=True)
            for kname, t in p["top_kernels_ms"][:8]:
                print(f"     {t:8.2f} ms  {kname}", flush=True)

    fid = fidelity(dev, args.tiny, stock, vae)
    print("fidelity (small clip, vs fp32 stock, TF32 off):", json.dumps(fid), flush=True)

    result = {**info, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python3"] + sys.argv), "workload": "tiny" if args.tiny else "wan21-480p",
              "latent_shape": list(shape), "dtype": "bfloat16", "chunk": args.chunk, "repeats": args.repeats,
              "stages": stages, "rows": rows, "fused_stats": stats, "profile_cudnn_benchmark": best_bench,
              "profiles": profiles, "fidelity": fid, "wall_s": time.perf_counter() - t_start}
    path = Path(args.out) if args.out else Path(os.environ.get("OUT", "benchmarks/results")) / "wan_fused.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))

    print(f"\n{info['gpu']}, torch {info['torch']}, cuDNN {info['cudnn']}, triton {info['triton']}: "
          f"{result['workload']} {shape} bf16, chunk {args.chunk}, median of {args.repeats}")
    print(f"{'variant':<10} {'fused':>5} {'cudnn.bm':>8} {'time s':>8} {'peak GiB':>9} {'est GiB':>8} "
          f"{'max|d| diffusers':>17} {'max|d| unfused':>15}")
    for r in rows:
        f = lambda v, fmt: (fmt % v) if v is not None else "-"  # noqa: E731
        print(f"{r['variant']:<10} {f(r['fused'], '%s'):>5} {str(r['cudnn_benchmark']):>8} {r['median_s']:8.3f} "
              f"{f(r['peak_gib'], '%.2f'):>9} {f(r.get('estimate_gib'), '%.2f'):>8} "
              f"{f(r.get('vs_diffusers_bf16', {}).get('max'), '%.4f'):>17} "
              f"{f(r.get('vs_unfused', {}).get('max'), '%.4f'):>15}")
    for k, p in profiles.items():
        print(f"profile {k}: {p['total_ms']:.0f} ms = " + ", ".join(f"{c} {v:.0f}" for c, v in
                                                                    p["by_category_ms"].items()))
    print("fidelity vs fp32 (max|d|): " + ", ".join(f"{k} {v['max']:.2e}" for k, v in fid.items()
                                                    if isinstance(v, dict)))
    print(f"wrote {path} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
