"""Does cuDNN's autotuner find faster conv kernels than its heuristics for the pipeline's own decode? One child process
per setting (torch caches the chosen algorithm per conv shape for the life of the process):

  heuristic   torch.backends.cudnn.benchmark = False (what vaeopt runs today)
  bench10     benchmark = True, benchmark_limit = 10 (torch's default limit)
  bench0      benchmark = True, benchmark_limit = 0 (every engine config cuDNN offers)
  heurB       TORCH_CUDNN_USE_HEURISTIC_MODE_B=1: cuDNN's slower, more accurate heuristic, no benchmarking
  heurB_bench0  both
The first decode's time is kept apart: with benchmark on it includes the autotuning (run 'heuristic' twice to have
a first decode without Triton compiles for comparison).

Each child records every conv call of one decode (shape, strides, weight), times whole decodes (CUDA events) and then
each distinct conv call alone, with the kernel it ran.

    python3 benchmarks/gpu_cudnn_tune.py --workload wan21-480p [--runs 5]     -> $OUT/cudnn_tune_<workload>.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import event_ms, make_pipe, out_dir, run_meta  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.pipeline import DecodeStats  # noqa: E402

MODES = {"heuristic": (False, 10, False), "heurB": (False, 10, True), "bench10": (True, 10, False),
         "bench3": (True, 3, False), "bench0": (True, 0, False), "heurB_bench0": (True, 0, True)}


class _Record(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.conv2d, F.conv3d, torch.conv2d, torch.conv3d) and not args[0].is_meta:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            rest = (tuple(args[3:]), {k: v for k, v in kwargs.items() if k != "bias"})
            key = (func.__name__, tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()), b is not None,
                   repr(rest), str(x.dtype))
            self.calls[key] += 1
        return func(*args, **kwargs)


def _kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:120] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def child(workload: str, mode: str, runs: int, convs: bool = True) -> dict:
    bench, limit, heur_b = MODES[mode]
    if heur_b:
        os.environ["TORCH_CUDNN_USE_HEURISTIC_MODE_B"] = "1"
    torch.backends.cudnn.benchmark = bench
    torch.backends.cudnn.benchmark_limit = limit
    fam, shape = WORKLOADS[workload]
    pipe = make_pipe(fam)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    plan = pipe.plan(shape)

    def decode():
        if pipe.family.is_video:
            return pipe._decode_video(z, plan, None)
        return pipe._decode_image(z, plan, DecodeStats(), None)

    rec = _Record()
    with torch.inference_mode():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with rec:  # also the autotuning run
            y = decode()
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        ref = y.float()
        del y
        ts = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y = decode()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        err = (y.float() - ref).abs().max().item()
        del y
        convs = []
        for key, n in (rec.calls.items() if convs else ()):
            name, xs, xst, ws, wst, has_b, rest, dt = key
            dtype = getattr(torch, dt.split(".")[-1])
            x = torch.empty_strided(xs, xst, dtype=dtype, device="cuda").normal_()
            w = torch.empty_strided(ws, wst, dtype=dtype, device="cuda").normal_(std=0.02)
            bias = torch.zeros(ws[0], dtype=dtype, device="cuda") if has_b else None
            f = getattr(F, name)
            r, kw = eval(rest)  # (stride, padding, dilation, groups) as recorded
            fn = (lambda f=f, x=x, w=w, bias=bias, r=r, kw=kw: f(x, w, bias, *r, **kw))
            ms = event_ms(fn, reps=10, warmup=2)
            out = fn()
            macs = out.numel() * w[0].numel()
            convs.append({"fn": name, "x": xs, "x_stride": xst, "w": ws, "bias": has_b, "args": rest, "calls": n,
                          "ms": ms, "tflops": 2 * macs / ms / 1e9, "kernels": _kernels(fn)})
            del x, w, out
    return {"mode": mode, "first_ms": first_ms, "decode_ms": ts, "median_ms": statistics.median(ts),
            "max_abs_vs_first": err, "chunk": plan.chunk, "convs": convs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="wan21-480p")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--child", default=None)
    ap.add_argument("--no-convs", action="store_true", help="whole decodes only, no per-conv timing")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.workload, args.child, args.runs, not args.no_convs)))
        return
    res = {}
    for mode in args.modes.split(","):
        p = subprocess.run([sys.executable, __file__, "--workload", args.workload, "--runs", str(args.runs),
                            "--child", mode] + (["--no-convs"] if args.no_convs else []),
                           capture_output=True, text=True)
        if p.returncode:
            print(p.stderr[-3000:])
            res[mode] = {"error": p.stderr[-2000:]}
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        if mode in res:  # a repeated mode (Triton's compile cache warm now): keep the later run
            res[mode + "_first"] = res[mode]
        res[mode] = r
        print(f"{mode}: decodes {[round(t, 1) for t in r['decode_ms']]}  median {r['median_ms']:.1f} ms, "
              f"first decode {r['first_ms']:.0f} ms", flush=True)
    meta = run_meta("python3 benchmarks/gpu_cudnn_tune.py " + " ".join(sys.argv[1:]))
    (out_dir() / f"cudnn_tune_{args.workload}.json").write_text(json.dumps({**meta, "workload": args.workload,
                                                                            "modes": res}, indent=1))
    base = {(c["fn"], tuple(c["x"]), tuple(c["w"]), c["args"]): c for c in res.get("heuristic", {}).get("convs", [])}
    print(f"\n# {meta['gpu']}  {args.workload}: per distinct conv call (ms; TFLOP/s), x calls per decode")
    for mode, r in res.items():
        if "convs" not in r or mode.startswith("heuristic"):
            continue
        print(f"## {mode} vs heuristic")
        tot_b = tot_m = 0.0
        for c in sorted(r["convs"], key=lambda c: -c["ms"] * c["calls"]):
            b = base.get((c["fn"], tuple(c["x"]), tuple(c["w"]), c["args"]))
            if b is None:
                continue
            tot_b += b["ms"] * c["calls"]
            tot_m += c["ms"] * c["calls"]
            print(f"{c['fn']} x{tuple(c['x'])} w{tuple(c['w'])} n={c['calls']}: {b['ms']:.3f} ({b['tflops']:.0f}) -> "
                  f"{c['ms']:.3f} ({c['tflops']:.0f})  {c['kernels'][0][:60] if c['kernels'] else ''}")
        print(f"sum over calls: {tot_b:.1f} -> {tot_m:.1f} ms")
    for mode, r in res.items():
        if "median_ms" in r:
            print(f"{mode:12s} decode median {r['median_ms']:.1f} ms, first {r['first_ms']:.0f} ms "
                  f"(max abs vs its first decode {r['max_abs_vs_first']:.2e})")


if __name__ == "__main__":
    main()
