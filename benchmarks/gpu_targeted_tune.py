"""cuDNN autotuning for chosen conv shapes only (E23): does timing cuDNN's engine configs for the shapes its heuristic
mis-picks (E19: the 2x2 phase convs of the upsamplers, the time-stacked 96-channel conv) give most of the full
autotuner's gain at a fraction of its tuning time and workspace memory?

    python3 benchmarks/gpu_targeted_tune.py [--workloads wan21-480p,sdxl-1024] [--runs 8] [--rounds 2]
        -> $OUT/targeted_tune.json

Each (workload, mode) runs in its own process (torch keeps one cuDNN plan per conv shape for the life of a process),
modes alternating over `--rounds`. In a process: the pipeline's own decode path (make_pipe: bf16, no graphs), the
first decode timed wall-clock (it includes the tuning), then `--runs` decodes timed with CUDA events; peak memory of
a steady decode; the output's PSNR against the heuristic mode's output (other kernels sum in another order).
Modes set torch.backends.cudnn.benchmark (and benchmark_limit) around the matching F.conv2d calls only:
  heuristic   cuDNN's heuristic everywhere (the default)
  phase10     2x2-kernel convs (the upsamplers' phase convs): up to 10 configs
  phase10+stack0   and the 3x3 convs with 288 input channels (Wan's time-stacked 96-ch conv): every config
  all10       every conv (the cudnn_autotune stage, for reference)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import make_pipe, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402

MODES = ("heuristic", "phase10", "phase10+stack0", "all10")


def rule(mode: str):
    """(weight) -> benchmark_limit for this conv call, or None to keep the heuristic."""
    def f(w):
        if w.dim() != 4:
            return None
        if "phase10" in mode and tuple(w.shape[-2:]) == (2, 2):
            return 10
        if "stack0" in mode and tuple(w.shape[-2:]) == (3, 3) and w.shape[1] == 288:
            return 0
        return None
    return f


def child(workload: str, mode: str, runs: int) -> dict:
    pick = rule(mode)
    seen = {}
    if mode == "all10":
        torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = True, 10
    else:
        orig = F.conv2d

        def conv2d(x, w, *a, **k):
            lim = pick(w)
            if lim is None or torch.cuda.is_current_stream_capturing():
                return orig(x, w, *a, **k)
            was = torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit
            torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = True, lim
            try:
                key = (tuple(x.shape), tuple(w.shape))
                t0 = time.perf_counter()
                y = orig(x, w, *a, **k)
                if key not in seen:
                    torch.cuda.synchronize()
                    seen[key] = (time.perf_counter() - t0) * 1e3
                return y
            finally:
                torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = was

        F.conv2d = conv2d
    fam, shape = WORKLOADS[workload]
    pipe = make_pipe(fam)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    plan = pipe.plan(shape)

    def dec():
        return pipe._decode_video(z, plan, None) if pipe.family.is_video else pipe._decode_whole_raw(z)

    with torch.inference_mode():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = dec()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        del y
        ts = []
        for i in range(runs):
            if i == runs - 1:
                torch.cuda.reset_peak_memory_stats()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y = dec()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
            if i < runs - 1:
                del y
        peak = torch.cuda.max_memory_allocated()
    sample = y[..., ::4, ::4].float().cpu() if y.dim() == 4 else y[:, :, ::4, ::8, ::8].float().cpu()
    return {"workload": workload, "mode": mode, "first_decode_s": first_s, "ms": ts,
            "median_ms": statistics.median(ts), "peak_gib": peak / 2**30, "chunk": getattr(plan, "chunk", None),
            "tuned_shapes": [{"x": list(k[0]), "w": list(k[1]), "first_call_ms": v} for k, v in seen.items()],
            "_sample": sample}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="wan21-480p,sdxl-1024")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"))
    args = ap.parse_args()
    out = out_dir()
    if args.child:
        wl, mode = args.child
        r = child(wl, mode, args.runs)
        torch.save(r.pop("_sample"), out / f"_sample_{wl}_{mode}.pt")
        print("RESULT " + json.dumps(r), flush=True)
        return
    res = {"workloads": {}}
    for wl in args.workloads.split(","):
        rows = {m: [] for m in args.modes.split(",")}
        for rnd in range(args.rounds):
            for m in (list(rows) if rnd % 2 == 0 else list(rows)[::-1]):
                p = subprocess.run([sys.executable, __file__, "--child", wl, m, "--runs", str(args.runs)],
                                   capture_output=True, text=True, env=os.environ)
                line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                if not line:
                    print(p.stdout[-2000:], p.stderr[-3000:])
                    continue
                r = json.loads(line[0][7:])
                ref = torch.load(out / f"_sample_{wl}_heuristic.pt") if (out / f"_sample_{wl}_heuristic.pt").exists() \
                    else None
                cur = torch.load(out / f"_sample_{wl}_{m}.pt")
                if ref is not None:
                    mse = (cur - ref).pow(2).mean().item()
                    r["psnr_vs_heuristic_db"] = float("inf") if mse == 0 else 10 * torch.log10(
                        torch.tensor(4.0 / mse)).item()
                rows[m].append(r)
                print(f"{wl:12s} {m:16s} median {r['median_ms']:8.2f} ms  first {r['first_decode_s']:.2f} s  "
                      f"peak {r['peak_gib']:.2f} GiB  psnr {r.get('psnr_vs_heuristic_db', float('nan')):.1f}",
                      flush=True)
        res["workloads"][wl] = rows
    for f in out.glob("_sample_*.pt"):
        f.unlink()
    res.update(run_meta("python3 benchmarks/gpu_targeted_tune.py " + " ".join(sys.argv[1:])))
    (out / "targeted_tune.json").write_text(json.dumps(res, indent=1))
    print("\n| workload | mode | median ms per process | first decode s | peak GiB |")
    print("|---|---|---|---|---|")
    for wl, rows in res["workloads"].items():
        for m, rs in rows.items():
            med = " / ".join("%.1f" % r["median_ms"] for r in rs)
            first = " / ".join("%.2f" % r["first_decode_s"] for r in rs)
            peak = max((r["peak_gib"] for r in rs), default=0)
            print(f"| {wl} | {m} | {med} | {first} | {peak:.2f} |")


if __name__ == "__main__":
    main()
