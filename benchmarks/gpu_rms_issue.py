"""Wan's RMS kernel: fewer instructions per element (SiLU's arithmetic) x more loads in flight (persistent programs),
per call on the wan21-480p chunk decoder's shapes, then whole wan21-480p decodes with the best settings.

    python3 benchmarks/gpu_rms_issue.py [--rounds 5] [--reps 20] [--decode-rounds 8]    -> $OUT/rms_issue.json

Why (perf-notes E31): Nsight Compute on the 96-ch call (H200, base clock) reads 84% issue slots busy and 48% of DRAM
bandwidth: the kernel is bound by the instructions it issues, ~26 per element, of which the exact SiLU's range
fix-ups around its two MUFU ops are ~12.

Variants: rms_norm_silu.SILU_MODE 0 (exact, the default for 16-bit outputs) / 2 (tanh.approx) / 3 (ftz ex2 + rcp),
each with one program per row block (the default) and as persistent programs (8 per SM, Triton's cp.async pipeline
with 3 stages; 8 per SM, the next block prefetched into registers). Per call: median over `rounds` interleaved rounds of
a CUDA-event median of `reps` calls; max |diff| against the default's output. Decodes: the default, the best SiLU mode
alone and the best overall setting (least summed per-call time), interleaved, with the PSNR of each against the
default and against an fp32 decode.
"""
import argparse
import importlib
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import event_ms, out_dir, run_meta, wan_norm_inputs  # noqa: E402

from vaeopt.kernels import _sm_count  # noqa: E402

rms = importlib.import_module("vaeopt.kernels.rms_norm_silu")
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--reps", type=int, default=20)
ap.add_argument("--decode-rounds", type=int, default=8)
args = ap.parse_args()
SMS = _sm_count(torch.cuda.current_device())
SHAPES = [("96ch 480x832 k12", 96, 480, 832, 0, 12), ("192ch 240x416 k12", 192, 240, 416, 0, 12),
          ("384ch 120x208 k6 taps3", 384, 120, 208, 3, 6)]
# (name, SILU_MODE, LOOP_PER_SM, LOOP_STAGES)
VARIANTS = [(f"silu{m}-{lp}", m, per_sm, st) for m in (0, 2, 3)
            for lp, per_sm, st in (("blocks", 0, 0), ("loop8s3", 8, 3), ("loop8s0", 8, 0))]


def apply(v):
    _, rms.SILU_MODE, rms.LOOP_PER_SM, rms.LOOP_STAGES = v


g = torch.Generator().manual_seed(0)
rows = []
for label, C, H, W, taps, k in SHAPES:
    h, r, kw = wan_norm_inputs(C, H, W, taps, k, g)
    gamma = (1 + 0.1 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    beta = (0.1 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    out = kw["out"]
    out.zero_()
    if "cache_out" in kw:
        kw["cache_out"].zero_()
    u = torch.empty_like(h)
    for resid in (False, True):
        def call():
            extra = dict(residual=r, sum_out=u) if resid else {}  # u = r + h, stored apart (not over h)
            return rms.rms_norm_silu(h, gamma, beta, 1e-12, True, **kw, **extra)

        el = h.numel() * h.element_size()
        moved = el * (1 + taps if taps else 2) + (2 * el if resid else 0) + (el * 2 / k if taps else 0)
        outs, ms = {}, {v[0]: [] for v in VARIANTS}
        for v in VARIANTS:
            apply(v)
            call()
            outs[v[0]] = out.float().clone()
        for i in range(args.rounds):
            for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
                apply(v)
                ms[v[0]].append(event_ms(call, reps=args.reps, warmup=2))
        ref = outs[VARIANTS[0][0]]
        res = {"shape": label, "C": C, "taps": taps, "frames": k, "residual": resid, "bytes": moved, "variants": {}}
        for v in VARIANTS:
            med = statistics.median(ms[v[0]])
            res["variants"][v[0]] = {"ms": med, "ms_rounds": ms[v[0]], "tbps": moved / med / 1e9,
                                     "max_abs_diff_vs_default": (outs[v[0]] - ref).abs().max().item()}
        rows.append(res)
        best = min(res["variants"], key=lambda n: res["variants"][n]["ms"])
        print(f"{label:24s} res={int(resid)}  default {res['variants'][VARIANTS[0][0]]['ms']:.3f} ms, best {best} "
              f"{res['variants'][best]['ms']:.3f} ms ({res['variants'][best]['tbps']:.2f} TB/s)", flush=True)
apply((None, None, 0, 0))
tot = {v[0]: sum(rw["variants"][v[0]]["ms"] for rw in rows) for v in VARIANTS}
best_all = min(VARIANTS, key=lambda v: tot[v[0]])
best_mode = min((v for v in VARIANTS if v[2] == 0), key=lambda v: tot[v[0]])
decode = None
if args.decode_rounds:
    from _common import interleaved_ms, make_pipe

    from vaeopt.benchmark import WORKLOADS

    fam, shape = WORKLOADS["wan21-480p"]
    pipe = make_pipe(fam)
    plan = pipe.plan(shape)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    settings = [("default", None, 0, 0)] + [v for v in (best_mode, best_all) if v[0] != "silu0-blocks"]
    settings = list(dict((s[0], s) for s in settings).values())
    outs = {}
    with torch.inference_mode():
        for s in settings:
            apply(s)
            outs[s[0]] = pipe._decode_video(z, plan, None).float().clamp(-1, 1).cpu()
        ms = interleaved_ms(lambda: pipe._decode_video(z, plan, None), settings, args.decode_rounds, apply)
        apply((None, None, 0, 0))
        pipe32 = make_pipe(fam, dtype="fp32")
        ref32 = pipe32._decode_video(z.float(), pipe32.plan(shape), None).float().clamp(-1, 1).cpu()
        del pipe32

    def psnr(a, b):
        mse = ((a - b) ** 2).mean().item()
        return 99.0 if mse == 0 else 10 * math.log10(4.0 / mse)

    decode = {"workload": "wan21-480p", "chunk": plan.chunk, "rounds": args.decode_rounds, "settings": {}}
    for s in settings:
        decode["settings"][s[0]] = {"silu_mode": s[1], "loop_per_sm": s[2], "loop_stages": s[3], "ms": ms[s],
                                    "median_ms": statistics.median(ms[s]),
                                    "psnr_vs_default_db": psnr(outs[s[0]], outs["default"]),
                                    "psnr_vs_fp32_db": psnr(outs[s[0]], ref32)}
meta = run_meta("python3 benchmarks/gpu_rms_issue.py " + " ".join(sys.argv[1:]))
(out_dir() / "rms_issue.json").write_text(json.dumps({**meta, "rows": rows, "sum_ms": tot, "decode": decode}, indent=1))
print(f"\n# {meta['gpu']}  per call ms (median of {args.rounds} rounds); sum over the six calls")
names = [v[0] for v in VARIANTS]
print(f"{'shape':24s} {'res':>3s} " + " ".join(f"{n[4:]:>14s}" for n in names))
for rw in rows:
    print(f"{rw['shape']:24s} {int(rw['residual']):>3d} " + " ".join(f"{rw['variants'][n]['ms']:>14.3f}" for n in names))
print(f"{'sum':24s} {'':>3s} " + " ".join(f"{tot[n]:>14.3f}" for n in names))
print("max |diff| vs default: " + ", ".join(f"{n} {max(rw['variants'][n]['max_abs_diff_vs_default'] for rw in rows):.3g}"
                                          for n in names))
if decode:
    print(f"\nwan21-480p, chunk {decode['chunk']}, {args.decode_rounds} interleaved rounds")
    for n, d in decode["settings"].items():
        print(f"  {n:16s} {d['median_ms']:7.1f} ms ({min(d['ms']):.1f}-{max(d['ms']):.1f})  "
              f"{d['psnr_vs_default_db']:.1f} dB vs default, {d['psnr_vs_fp32_db']:.2f} dB vs fp32")
