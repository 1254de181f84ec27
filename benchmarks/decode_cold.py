"""The first decode in a fresh process (what every one-shot `vaeopt decode` pays): each timed call is a new Python
process that imports vaeopt, builds the pipeline (random-init weights, default stages) and decodes twice.

    python benchmarks/decode_cold.py --workload sdxl-1024 [--variants cold,warm]

Variants: cold (an empty Triton cache each time: kernels compiled, as on a new machine), warm (a cache that an
earlier process filled: kernels loaded). The row's time is the first decode's (the pipeline's clock); info.calls
holds each process's import, build, both decodes and its wall time, in seconds.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import harness as H

VARIANTS = ("cold", "warm")
DEFAULTS = {"repeats": 3, "warmup": 1}


def add_args(ap):
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def items(ctx):
    return [(f"{ctx.workload} {tuple(ctx.shape)}", ctx.shape)]


def setup(variant, shape, ctx):
    a = ctx.args
    cmd = [sys.executable, __file__, "--child", "--workload", a.workload, *(["--tiny"] if a.tiny else []),
           *(["--device", a.device] if a.device else []), "--dtype", ctx.dtype_name]
    warm_cache, calls = tempfile.mkdtemp(prefix="triton-cache-"), []

    def fn():
        cache = tempfile.mkdtemp(prefix="triton-cache-") if variant == "cold" else warm_cache
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TRITON_CACHE_DIR=cache))
        if variant == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        if p.returncode:
            raise RuntimeError(f"the child process failed: {(p.stderr or p.stdout)[-800:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        calls.append({**r, "process_s": time.perf_counter() - t0})
        return H.Timed(None, r["decode_s"][0] * 1e3)

    return H.Case(fn, info={"calls": calls, "triton_cache": "empty each call" if variant == "cold" else "kept"})


def child(args) -> None:
    t0 = time.perf_counter()
    import torch

    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    t_import = time.perf_counter() - t0
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ctx = H.Ctx(args.workload, *H.workload_shape(args), dev, H.DTYPES[args.dtype], args)
    t = time.perf_counter()
    pipe = Pipeline(LoadedVAE(ctx.model(torch.float32), ctx.family, "benchmark", None, [], None),
                    Options(device=str(dev), dtype=ctx.dtype_name), log=lambda s: None)
    plan = pipe.plan(ctx.shape)
    t_build = time.perf_counter() - t
    z = ctx.latent()
    secs = [pipe.decode(z, plan)[1].seconds for _ in range(2)]
    print(json.dumps({"import_s": t_import, "build_s": t_build, "decode_s": secs}))


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(H.parse("decode_cold"))
    else:
        H.main("decode_cold")
