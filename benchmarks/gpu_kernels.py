"""Fused norm kernels vs torch at real VAE-decoder shapes: correctness, then timings, then a small tuning sweep.

    python3 benchmarks/gpu_kernels.py            # on the GPU machine (torch + triton; no diffusers needed), < 3 min
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --smoke   # CPU smoke test of the script (tiny shapes)

Providers per shape (bf16):
  GroupNorm+SiLU  torch-nchw, torch-cl (aten GroupNorm on channels_last input), ours-nchw, ours-cl, copy
  RMSNorm+SiLU    torch-ncdhw, torch-cl (diffusers' F.normalize composition), ours-ncdhw, ours-cl, copy
"copy" is y.copy_(x): the read-once + write-once ceiling at that size. GB/s counts exactly that traffic
(x read once + y written once) for every provider, so it is comparable across them.
Writes $OUT/kernels.json (OUT defaults to ./out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

import triton  # noqa: E402

from vaeopt.kernels import group_norm_silu, rms_norm_silu  # noqa: E402

GN_SHAPES = [  # SDXL decoder GroupNorm inputs (1024² and 2048² decodes), then Hunyuan/Wan-sized video activations
    (1, 512, 128, 128),
    (1, 512, 256, 256),
    (1, 512, 512, 512),
    (1, 256, 1024, 1024),
    (1, 128, 1024, 1024),
    (1, 384, 2, 60, 104),
    (1, 96, 4, 480, 832),
]
RMS_SHAPES = [(1, 384, 2, 60, 104), (1, 192, 4, 120, 208), (1, 96, 4, 240, 416), (1, 96, 4, 480, 832)]
SMOKE_GN = [(1, 64, 16, 16), (1, 96, 2, 6, 10)]
SMOKE_RMS = [(1, 96, 2, 6, 10), (1, 384, 1, 4, 6)]
GROUPS, EPS, DT = 32, 1e-6, torch.bfloat16


def channels_last(x):
    return x.movedim(1, -1).contiguous().movedim(-1, 1)  # NHWC / NDHWC memory, logical NC...


def torch_gn_silu(x, w, b):
    return F.silu(F.group_norm(x, GROUPS, w, b, EPS))


def torch_rms_silu(x, gamma):
    """diffusers WanRMS_norm(channel_first) + SiLU: normalize in fp32, downcast, * sqrt(C) * gamma + 0.0."""
    y = F.normalize(x.float(), dim=1).to(x.dtype) * (x.shape[1] ** 0.5) * gamma + 0.0
    return F.silu(y)


def bench(fn, smoke):
    """-> (median, p20, p80) in microseconds."""
    if smoke:  # CPU interpreter: one timed call is plenty
        fn()
        t = time.perf_counter()
        fn()
        us = (time.perf_counter() - t) * 1e6
        return us, us, us
    q = triton.testing.do_bench(fn, warmup=10, rep=60, quantiles=[0.5, 0.2, 0.8])
    return tuple(v * 1e3 for v in q)


def row(op, shape, layout, provider, t, nbytes, **extra):
    us, p20, p80 = t
    r = dict(op=op, shape=list(shape), layout=layout, dtype="bf16", provider=provider, us=round(us, 2),
             p20_us=round(p20, 2), p80_us=round(p80, 2), gbps=round(nbytes / us / 1e3, 1), bytes=nbytes, **extra)
    print(f"  {op:8s} {str(tuple(shape)):22s} {layout:5s} {provider:12s} {us:10.1f} us  {r['gbps']:7.0f} GB/s"
          + (f"  {extra}" if extra else ""), flush=True)
    return r


def check(name, y, ref32, torch_lp, floor=1.6e-2):
    """bf16 rule: max error vs the fp32 reference <= 2x torch-bf16's own + floor."""
    err = (y.float() - ref32).abs().max().item()
    err_t = (torch_lp.float() - ref32).abs().max().item()
    ok = err <= 2 * err_t + floor
    print(f"  check {name}: err {err:.4g} vs torch-bf16 {err_t:.4g} -> {'ok' if ok else 'FAIL'}", flush=True)
    return dict(err=round(err, 5), err_torch=round(err_t, 5), ok=ok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    t_start = time.time()
    dev = "cpu" if args.smoke and not torch.cuda.is_available() else "cuda"
    gn_shapes, rms_shapes = (SMOKE_GN, SMOKE_RMS) if args.smoke else (GN_SHAPES, RMS_SHAPES)
    gpu = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        rev = None
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                cudnn=torch.backends.cudnn.version() if dev == "cuda" else None,
                cuda=torch.version.cuda, date=datetime.datetime.now().isoformat(timespec="seconds"), git=rev)
    print(f"# {meta}", flush=True)
    rows, sweeps, checks = [], [], []
    gen = torch.Generator(device=dev).manual_seed(0)

    # ---- GroupNorm + SiLU ---------------------------------------------------------------------------------------
    for shape in gn_shapes:
        C = shape[1]
        x = torch.randn(shape, device=dev, dtype=DT, generator=gen) * 2 + 0.5
        w = (torch.rand(C, device=dev, generator=gen) + 0.5).to(DT)
        b = (torch.randn(C, device=dev, generator=gen) * 0.3).to(DT)
        xc = channels_last(x)
        nbytes = 2 * x.numel() * x.element_size()
        ref = torch_gn_silu(x.float(), w.float(), b.float())
        t_lp = torch_gn_silu(x, w, b)
        chk = {}
        for lay, xx in (("nchw", x), ("cl", xc)):
            y = group_norm_silu(xx, GROUPS, w, b, EPS)
            assert y.stride() == xx.stride() or min(shape[2:]) == 1, "layout not kept"
            chk[lay] = check(f"gn {tuple(shape)} {lay}", y, ref, t_lp)
            del y
        checks.append(dict(op="gn_silu", shape=list(shape), **{k: v for k, v in chk.items()}))
        del ref, t_lp
        out = torch.empty_like(x)
        rows.append(row("gn_silu", shape, "-", "copy", bench(lambda: out.copy_(x), args.smoke), nbytes))
        rows.append(row("gn_silu", shape, "nchw", "torch", bench(lambda: torch_gn_silu(x, w, b), args.smoke), nbytes))
        rows.append(row("gn_silu", shape, "cl", "torch", bench(lambda: torch_gn_silu(xc, w, b), args.smoke), nbytes))
        for lay, xx in (("nchw", x), ("cl", xc)):
            t = bench(lambda: group_norm_silu(xx, GROUPS, w, b, EPS), args.smoke)
            rows.append(row("gn_silu", shape, lay, "ours", t, nbytes, ok=chk[lay]["ok"]))
        del x, xc, out
        if dev == "cuda":
            torch.cuda.empty_cache()

    # ---- Wan RMSNorm + SiLU -------------------------------------------------------------------------------------
    for shape in rms_shapes:
        C = shape[1]
        x = torch.randn(shape, device=dev, dtype=DT, generator=gen) * 2 + 0.3
        gamma = (torch.rand(C, 1, 1, 1, device=dev, generator=gen) + 0.5).to(DT)
        xc = channels_last(x)
        nbytes = 2 * x.numel() * x.element_size()
        ref = torch_rms_silu(x.float(), gamma.float())
        t_lp = torch_rms_silu(x, gamma)
        chk = {}
        for lay, xx in (("ncdhw", x), ("cl", xc)):
            y = rms_norm_silu(xx, gamma, 0.0, 1e-12)
            chk[lay] = check(f"rms {tuple(shape)} {lay}", y, ref, t_lp)
            del y
        checks.append(dict(op="rms_silu", shape=list(shape), **chk))
        del ref, t_lp
        out = torch.empty_like(x)
        rows.append(row("rms_silu", shape, "-", "copy", bench(lambda: out.copy_(x), args.smoke), nbytes))
        for lay, xx in (("ncdhw", x), ("cl", xc)):
            rows.append(row("rms_silu", shape, lay, "torch", bench(lambda: torch_rms_silu(xx, gamma), args.smoke), nbytes))
        for lay, xx in (("ncdhw", x), ("cl", xc)):
            t = bench(lambda: rms_norm_silu(xx, gamma, 0.0, 1e-12), args.smoke)
            rows.append(row("rms_silu", shape, lay, "ours", t, nbytes, ok=chk[lay]["ok"]))
        del x, xc, out
        if dev == "cuda":
            torch.cuda.empty_cache()

    # ---- tuning sweep (bounded in time) -------------------------------------------------------------------------
    best = {}
    if not args.no_sweep:
        sm = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 1
        tiles = [2048, 4096, 8192, 16384] if not args.smoke else [64, 256]
        cases = [("gn_silu", gn_shapes[1]), ("gn_silu", gn_shapes[4 if not args.smoke else 0]),
                 ("gn_silu", gn_shapes[-1]), ("rms_silu", rms_shapes[0]), ("rms_silu", rms_shapes[-1])]
        print("# sweep", flush=True)
        for op, shape in cases:
            if time.time() - t_start > 150:
                print(f"# sweep cut short (time budget): skipped {op} {tuple(shape)}", flush=True)
                continue
            C = shape[1]
            x = torch.randn(shape, device=dev, dtype=DT, generator=gen)
            w = torch.ones(C, device=dev, dtype=DT)
            nbytes = 2 * x.numel() * x.element_size()
            for lay, xx in (("cf", x), ("cl", channels_last(x))):
                results = []
                configs = [dict(tile=t, num_warps=nw) for t in tiles for nw in (4, 8)]
                if op == "gn_silu":
                    configs += [dict(tile=t, num_warps=nw, target_programs=k * sm)
                                for t in tiles[1:3] for nw in (4, 8) for k in (4, 16)]
                for cfg in configs:
                    if op == "gn_silu":
                        fn = lambda: group_norm_silu(xx, GROUPS, w, w, EPS, **cfg)  # noqa: E731
                    else:
                        fn = lambda: rms_norm_silu(xx, w, 0.0, 1e-12, **cfg)  # noqa: E731
                    us = bench(fn, args.smoke)[0]
                    results.append((us, cfg))
                    sweeps.append(dict(op=op, shape=list(shape), layout=lay, us=round(us, 2),
                                       gbps=round(nbytes / us / 1e3, 1), **cfg))
                us, cfg = min(results, key=lambda r: r[0])
                key = f"{op} {tuple(shape)} {lay}"
                best[key] = dict(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), **cfg)
                print(f"  best {key}: {cfg} {us:.1f} us {nbytes / us / 1e3:.0f} GB/s", flush=True)
            del x
            if dev == "cuda":
                torch.cuda.empty_cache()

    # ---- summary ------------------------------------------------------------------------------------------------
    print(f"\n# {gpu} | torch {torch.__version__} | triton {triton.__version__} | cuDNN {meta['cudnn']} | bf16")
    print(f"{'op':8s} {'shape':22s} {'copy us':>9s} {'torch-cf':>9s} {'torch-cl':>9s} {'ours-cf':>9s} {'ours-cl':>9s}"
          f" {'ours-cl GB/s':>12s} {'x vs torch-cf':>13s} {'x vs torch-cl':>13s} {'ok':>3s}")
    for op, shapes in (("gn_silu", gn_shapes), ("rms_silu", rms_shapes)):
        for shape in shapes:
            rs = [r for r in rows if r["op"] == op and r["shape"] == list(shape)]
            get = {(r["provider"], r["layout"]): r for r in rs}
            cf = "nchw" if op == "gn_silu" else "ncdhw"
            cp, tcf, tcl = get[("copy", "-")], get[("torch", cf)], get[("torch", "cl")]
            ocf, ocl = get[("ours", cf)], get[("ours", "cl")]
            ok = "yes" if ocf["ok"] and ocl["ok"] else "NO"
            print(f"{op:8s} {str(tuple(shape)):22s} {cp['us']:9.1f} {tcf['us']:9.1f} {tcl['us']:9.1f} {ocf['us']:9.1f}"
                  f" {ocl['us']:9.1f} {ocl['gbps']:12.0f} {tcf['us'] / ocf['us']:13.2f} {tcl['us'] / ocl['us']:13.2f}"
                  f" {ok:>3s}")
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = dict(meta=meta, rows=rows, checks=checks, sweep=sweeps, best=best,
                  elapsed_s=round(time.time() - t_start, 1))
    (out_dir / "kernels.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_dir / 'kernels.json'} ({time.time() - t_start:.0f} s)")
    if not all(c[k]["ok"] for c in checks for k in c if isinstance(c[k], dict)):
        sys.exit(1)


if __name__ == "__main__":
    main()
