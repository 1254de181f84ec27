"""SASS instruction counts of Wan's RMS kernel (`_rms_cl_kernel`) per SiLU mode, compiled offline for sm_90: no GPU
needed, only Triton's bundled ptxas and cuobjdump (perf-notes E31).

    python3 benchmarks/sass_rms.py [--json out.json]

The launch is the decoder's plain call: bf16 in and out, 96 channels in a 128-lane tile, 32 rows x 4 warps (the
default 4096-element tile), input bias, no affine bias, no residual. Each thread holds 4 rows x 8 channels = 32
elements, so instructions per element = SASS instructions / 32 (setup and the per-row reduction included).
"""
import argparse
import collections
import importlib
import inspect
import json
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
args = ap.parse_args()
k = importlib.import_module("vaeopt.kernels.rms_norm_silu")._rms_cl_kernel
params = list(inspect.signature(k.fn).parameters)
PTRS = {"x_ptr": "*bf16", "y_ptr": "*bf16", "g_ptr": "*fp32", "b_ptr": "*fp32", "xb_ptr": "*fp32", "c_ptr": "*bf16",
        "r_ptr": "*bf16", "rb_ptr": "*fp32", "u_ptr": "*bf16"}
INTS = ("R", "S", "C", "stride_xn", "stride_yn", "K", "HW", "stride_rn", "stride_un")
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
rows = {}
for mode in (0, 2, 3):
    consts = dict(BLOCK_R=32, BLOCK_C=128, ONE_PASS=True, HAS_BIAS=False, HAS_XB=True, SILU=True, SAT8=False,
                  EXACT8=False, TAPS=0, CACHE=False, RES=False, HAS_RB=False, STORE_U=False, SILU_MODE=mode,
                  HAS_MUL=False)
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(params):
        if p in consts:
            sig[p], cx[(i,)] = "constexpr", consts[p]
        elif p in PTRS:
            sig[p], attrs[(i,)] = PTRS[p], [["tt.divisibility", 16]]
        elif p in INTS:
            sig[p], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
        else:
            sig[p] = "fp32"
    cc = triton.compile(ASTSource(fn=k, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4})
    path = f"/tmp/sass_rms_{mode}.cubin"
    open(path, "wb").write(cc.asm["cubin"])
    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", sass)
    hist = collections.Counter(ops)
    rows[mode] = {"instructions": len(ops), "per_element": len(ops) / 32, "histogram": dict(hist.most_common())}
    top = ", ".join(f"{n} {c}" for n, c in hist.most_common(8))
    print(f"SILU_MODE {mode}: {len(ops)} SASS instructions, {len(ops) / 32:.1f} per element; {top}")
if args.json:
    json.dump({"triton": triton.__version__, "target": "sm_90", "launch": "bf16, C=96 in 128 lanes, 32 rows, 4 warps",
               "modes": rows}, open(args.json, "w"), indent=1)
