"""The first decode in a fresh process: how much slower than the next, and why (what every one-shot `vaeopt decode`
pays). Each case runs in its own child process:
  cold  -- an empty Triton cache (TRITON_CACHE_DIR): what a first run on a new machine pays, kernels compiled;
  warm  -- the same cache again: a new process on a machine that has decoded before;
  eager -- warm cache with CUDA_MODULE_LOADING=EAGER: CUDA's lazy module loading moved to context creation.
The child builds the pipeline as `vaeopt decode` does (random N(0, 0.02) weights, _common.make_pipe), then times
three decodes of the workload (wall, synchronized), and the first decode's Triton compile / load time (Triton's
JITFunction.run timed per call for each kernel's first launch).
Writes $OUT/cold_start.json; prints a table last.

    python3 benchmarks/gpu_cold_start.py [--workloads wan21-480p,sdxl-1024] [--cases cold,warm,eager]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="wan21-480p,sdxl-1024")
ap.add_argument("--cases", default="cold,warm,eager")
ap.add_argument("--child", default=None)
args = ap.parse_args()

if args.child:
    t_start = time.perf_counter()
    import torch
    import triton.runtime.jit as jit

    from _common import make_pipe

    from vaeopt.benchmark import WORKLOADS

    first: dict = {}
    real_run = jit.JITFunction.run

    def run(self, *a, **k):  # the first launch of each kernel: compile or cache load + launch
        name = self.fn.__name__
        if name in first:
            return real_run(self, *a, **k)
        t = time.perf_counter()
        r = real_run(self, *a, **k)
        first[name] = first.get(name, 0.0) + time.perf_counter() - t
        return r

    jit.JITFunction.run = run
    t_import = time.perf_counter() - t_start
    fam, shape = WORKLOADS[args.child]
    t = time.perf_counter()
    pipe = make_pipe(fam)
    torch.cuda.synchronize()
    t_build = time.perf_counter() - t
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    plan = pipe.plan(tuple(z.shape))
    ts = []
    for i in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y, _ = pipe.decode(z, plan)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
        if i == 0:
            first_kernels = dict(first)
        del y
    print(json.dumps({"import_s": round(t_import, 3), "build_s": round(t_build, 3),
                      "decodes_s": [round(x, 4) for x in ts], "triton_first_launch_s": round(sum(first_kernels.values()), 3),
                      "triton_kernels": len(first_kernels),
                      "triton_slowest": sorted(((round(v, 3), k) for k, v in first_kernels.items()), reverse=True)[:5]}))
    sys.exit(0)

from _common import out_dir, run_meta  # noqa: E402

res = {}
for wl in args.workloads.split(","):
    cache = tempfile.mkdtemp(prefix="triton_cache_")  # empty: the cold case fills it, the others reuse it
    for case in args.cases.split(","):
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        if case == "eager":
            env["CUDA_MODULE_LOADING"] = "EAGER"
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child", wl], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            r = {"error": (p.stderr or p.stdout)[-1500:]}
        r["process_wall_s"] = round(wall, 2)
        res[f"{wl} {case}"] = r
        print(wl, case, json.dumps(r)[:600], flush=True)
meta = run_meta("python3 benchmarks/gpu_cold_start.py " + " ".join(sys.argv[1:]))
(out_dir() / "cold_start.json").write_text(json.dumps({**meta, "cases": res}, indent=1))
print(f"\n# {meta['gpu']}: the first decode in a fresh process (s)")
print(f"{'workload, case':24s} {'import':>6s} {'build':>6s} {'decode 1':>8s} {'decode 2':>8s} {'decode 3':>8s} "
      f"{'triton 1st':>10s} {'process':>7s}")
for k, r in res.items():
    if "error" in r:
        print(f"{k:24s} error")
        continue
    d = r["decodes_s"]
    print(f"{k:24s} {r['import_s']:>6.2f} {r['build_s']:>6.2f} {d[0]:>8.3f} {d[1]:>8.3f} {d[2]:>8.3f} "
          f"{r['triton_first_launch_s']:>10.2f} {r['process_wall_s']:>7.1f}")
