"""Where the decode time goes: torch.profiler kernel time by category for diffusers and vaeopt decodes, the number of
layout-conversion kernels, and micro-experiments for the remaining costs.

    python3 benchmarks/gpu_profile.py --workload sdxl-1024 [--experiments]

Writes $OUT/profile_<workload>.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vaeopt.benchmark import WORKLOADS  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import event_ms, make_pipe  # noqa: E402
from vaeopt.hw import machine_info  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)

CATS = [  # first match wins
    ("norm", ("group_norm", "groupnorm", "rowwisemoments", "_gn_", "gn_", "rms", "layer_norm", "normalize",
              "welford", "_stats", "_apply")),
    ("attention", ("fmha", "attention", "flash", "efficient", "softmax", "sdpa")),
    ("layout", ("nchwtonhwc", "nhwctonchw", "copy", "transpose", "cat", "pad", "permute", "contiguous", "clone")),
    ("upsample", ("upsample", "interp", "nearest")),
    ("conv", ("conv", "cudnn", "implicit", "xmma", "sm90", "cutlass", "fprop", "wgrad", "dgrad", "gemm", "cublas")),
    ("elementwise", ("elementwise", "vectorized", "add", "mul", "silu", "div", "fill", "where", "clamp", "unrolled")),
]


def category(name: str) -> str:
    n = name.lower()
    for cat, keys in CATS:
        if any(k in n for k in keys):
            return cat
    return "other"


def profile(fn, n=3, top=15) -> dict:
    from torch.profiler import ProfilerActivity, profile as tprof

    fn()
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    by_cat = collections.Counter()
    by_kernel = collections.Counter()
    counts = collections.Counter()
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        t = e.device_time / 1e3 / n if hasattr(e, "device_time") else e.cuda_time / 1e3 / n
        c = category(e.name)
        by_cat[c] += t
        by_kernel[e.name[:90]] += t
        counts[c] += 1
    return {"total_ms": sum(by_cat.values()), "by_category_ms": dict(by_cat.most_common()),
            "kernels_per_decode": {k: v / n for k, v in counts.items()},
            "top_kernels_ms": by_kernel.most_common(top)}


def bench(fn, reps=20) -> float:
    return event_ms(fn, reps, warmup=1)


def chunked_attention(q, k, v, chunk=4096):
    """Exact attention by query chunks: S = q k^T (GEMM), softmax, @ v (GEMM). Works for any head dim."""
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    kt = k.transpose(-1, -2)
    for i in range(0, q.shape[-2], chunk):
        s = torch.matmul(q[..., i:i + chunk, :], kt).mul_(scale)
        out[..., i:i + chunk, :] = torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
    return out


def experiments() -> dict:
    res = {}
    # attention: one head, head_dim 512 (SD VAE) / 384 (Wan), tokens of 1024² / 2048² decodes
    for tokens, hd in ((16384, 512), (65536, 512), (6240, 384)):
        q, k, v = (torch.randn(1, 1, tokens, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float()) if tokens <= 16384 else None
        row = {}
        row["sdpa_default_ms"] = bench(lambda: F.scaled_dot_product_attention(q, k, v), 5)
        for ch in (2048, 4096, 8192):
            row[f"chunked_{ch}_ms"] = bench(lambda: chunked_attention(q, k, v, ch), 5)
        if ref is not None:
            row["sdpa_err"] = (F.scaled_dot_product_attention(q, k, v).float() - ref).abs().max().item()
            row["chunked_err"] = (chunked_attention(q, k, v).float() - ref).abs().max().item()
        flops = 4 * tokens * tokens * hd
        row["tflops_default"] = flops / row["sdpa_default_ms"] / 1e9
        res[f"attn_{tokens}x{hd}"] = row
    # nearest 2x upsample of NHWC activations
    for c, hw in ((512, 256), (512, 512), (256, 1024)):
        x = torch.randn(1, c, hw, hw, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        xc = x.contiguous()

        def expand_up(x=x):
            n, c_, h, w = x.shape
            y = x.permute(0, 2, 3, 1)[:, :, None, :, None, :].expand(n, h, 2, w, 2, c_).reshape(n, 2 * h, 2 * w, c_)
            return y.permute(0, 3, 1, 2)

        ok = torch.equal(expand_up(), F.interpolate(x, scale_factor=2.0, mode="nearest"))
        res[f"upsample_{c}x{hw}"] = {
            "interp_nchw_ms": bench(lambda: F.interpolate(xc, scale_factor=2.0, mode="nearest")),
            "interp_cl_ms": bench(lambda: F.interpolate(x, scale_factor=2.0, mode="nearest")),
            "expand_cl_ms": bench(expand_up), "expand_equal": ok,
            "expand_is_cl": expand_up().is_contiguous(memory_format=torch.channels_last)}
        # residual: (a + b) / 1.0 as diffusers does, vs in-place add
        a = torch.randn_like(x)
        res[f"residual_{c}x{hw}"] = {"add_div_ms": bench(lambda: (a + x) / 1.0), "add_ms": bench(lambda: a + x),
                                     "add_inplace_ms": bench(lambda: a.add_(x))}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="sdxl-1024")
    ap.add_argument("--experiments", action="store_true")
    ap.add_argument("--tiled", type=int, nargs="*", default=[], help="also profile tiled decodes with these tiles")
    ap.add_argument("--only-tiled", action="store_true")
    ap.add_argument("--only-vaeopt", action="store_true", help="skip the diffusers-bf16 variant")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per variant")
    ap.add_argument("--fp8-gate", type=float, nargs="*", default=[], help="also profile the FP8 path at these gates")
    args = ap.parse_args()
    fam, shape = WORKLOADS[args.workload]
    z = torch.randn(shape)
    result = {"workload": args.workload, "variants": {}}
    variants = {
        "diffusers-bf16": dict(channels_last="off", triton="off", attention="off"),
        "vaeopt": dict(),
    }
    for g in args.fp8_gate:
        variants[f"vaeopt-fp8-gate{g:g}"] = dict(fp8="on", gate_db=g)
    if args.only_tiled:
        variants = {}
    elif args.only_vaeopt:
        del variants["diffusers-bf16"]
    for name, opts in variants.items():
        pipe = make_pipe(fam, **opts)
        zz = z.to("cuda", torch.bfloat16)
        plan = pipe.plan(shape)
        with torch.inference_mode():
            fn = (lambda: pipe._decode_video(zz, plan, None)) if pipe.family.is_video else \
                (lambda: pipe._decode_whole_raw(zz))
            result["variants"][name] = profile(fn, n=1 if pipe.family.is_video else 3, top=args.top)
            result["variants"][name]["stages"] = [s.line() for s in pipe.stages]
        del pipe
        torch.cuda.empty_cache()
    from vaeopt import tiling

    for tile in args.tiled:
        pipe = make_pipe(fam)
        zz = z.to("cuda", torch.bfloat16)
        with torch.inference_mode():
            ref = pipe._decode_whole_raw(zz).float()
            infos = []
            fn = lambda: infos.append(tiling.tiled_decode(pipe.model, zz, tile=tile, return_info=True))  # noqa: E731
            ms = bench(fn, 2)
            out, info = infos[-1]
            from vaeopt.fidelity import psnr

            rec = profile(fn, n=1)
            rec.update(wall_ms=ms, info={k: v for k, v in info.items() if k != "oom_events"},
                       psnr_vs_untiled=psnr(out.float(), ref), untiled_ms=bench(lambda: pipe._decode_whole_raw(zz), 3))
            result["variants"][f"tiled-{tile}"] = rec
        del pipe
        torch.cuda.empty_cache()
    if args.experiments:
        result["experiments"] = experiments()
    mi = machine_info()
    result.update(gpu=mi.gpus[0].name, versions={"torch": mi.torch, "cudnn": mi.cudnn, "triton": mi.triton},
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join(["python3"] + sys.argv))
    (OUT / f"profile_{args.workload}.json").write_text(json.dumps(result, indent=1))
    for name, v in result["variants"].items():
        print(f"\n== {args.workload} {name}: {v['total_ms']:.1f} ms kernel time per decode"
              + (f"; wall {v['wall_ms']:.0f} ms vs untiled {v['untiled_ms']:.0f} ms, {v['psnr_vs_untiled']:.1f} dB, "
                 f"info {v['info']}" if "wall_ms" in v else ""))
        print("   " + ", ".join(f"{k} {t:.1f}" for k, t in v["by_category_ms"].items()))
        print("   kernels/decode: " + ", ".join(f"{k} {int(c)}" for k, c in v["kernels_per_decode"].items()))
        for kname, t in v["top_kernels_ms"][:args.top]:
            print(f"     {t:7.2f} ms  {kname}")
    for k, v in result.get("experiments", {}).items():
        print(k, {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()})


if __name__ == "__main__":
    main()
