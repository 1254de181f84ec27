"""How Triton compiles the TMA conv kernel (`tma_conv._tma_conv_kernel`) for Wan's 96 -> 96 causal Conv3d at 480x832,
per tile, offline for sm_90: no GPU needed (perf-notes E32).

    PYTHONPATH=/path/to/triton-3.6 python3 benchmarks/sass_tma.py [--tiles T1;T2] [--json out.json]

A tile is "bh,bw,bk,bn0,bn1,warps,stages,bk1" (tma_conv.TmaConfig; extra fields go to TmaConfig too). For each tile
it reports: registers per thread and shared memory per program (so programs per SM), whether the A operand goes
through registers (a `local_load` of the input box before the dots) or is read by wgmma from shared memory, and the
`warpgroup_mma_wait` ops in the TTGIR with their `pendings` (0: every wgmma is waited for before the loop goes on;
n > 0: n wgmma groups stay in flight across iterations).
"""
import argparse
import collections
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vaeopt.kernels import tma_conv  # noqa: E402

SHIPPED = "2,64,64,64,32,4,3,32"
ap = argparse.ArgumentParser()
ap.add_argument("--tiles", default=f"{SHIPPED};1,128,32,64,32,4,4,0;2,64,32,64,32,4,4,0;1,128,32,128,0,4,4,0")
ap.add_argument("--json", default=None)
args = ap.parse_args()
H, W, C, T = 480, 832, 96, 12
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
x = torch.empty(T + 2, H, W, C, dtype=torch.bfloat16)  # never allocated on a GPU: descriptors only need shapes
w = torch.empty(C, 27 * C, dtype=torch.bfloat16)
y = torch.empty(T, H, W, C, dtype=torch.bfloat16)


def desc(t, box):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), box)


rows = {}
for spec in args.tiles.split(";"):
    cfg = tma_conv.TmaConfig(*map(int, spec.split(",")))
    bh, bw, bk, bn0, bn1, bk1 = cfg.bh, cfg.bw, cfg.bk, cfg.bn0, cfg.bn1, cfg.bk1
    k = tma_conv._tma_conv_kernel  # E33's grouped kernel (commit 2d246db) was compiled here too
    params = list(inspect.signature(k.fn).parameters)
    xx, yy, lead = x, y, [1]
    vals = dict(x_desc=desc(xx, [*lead, bh, bw, bk]), x1_desc=desc(xx, [*lead, bh, bw, bk1]) if bk1 else None,
                w0_desc=desc(w, [bn0, bk]), w1_desc=desc(w, [bn1, bk]) if bn1 else None,
                w01_desc=desc(w, [bn0, bk1]) if bk1 else None, w11_desc=desc(w, [bn1, bk1]) if bk1 and bn1 else None,
                y0_desc=desc(yy, [*lead, bh, bw, bn0]), y1_desc=desc(yy, [*lead, bh, bw, bn1]) if bn1 else None,
                b_ptr=w, s_ptr=None, xs_ptr=None, x_scale=1.0, T=T, H=H, W=W, C=C, CO=C, N_TILES=1)
    consts = dict(KT=3, KH=3, KW=3, PH=1, PW=1, BH=bh, BW=bw, BK=bk, BN0=bn0, BN1=bn1, BK1=bk1, HAS_BIAS=True,
                  HAS_SCALE=False, XS_PTR=False, NUM_STAGES=cfg.num_stages, DOT_F32=False, PHASES=False)
    extra = {f.name.upper(): getattr(cfg, f.name) for f in dataclasses.fields(cfg)
             if f.name.upper() in params and f.name.upper() not in consts}
    consts.update(extra)  # e.g. a flag an experiment adds to both the config and the kernel
    sig, cx, attrs = {}, {}, {}
    for i, p in enumerate(params):
        v = vals.get(p)
        if p in consts:
            sig[p], cx[(i,)] = "constexpr", consts[p]
        elif v is None:
            sig[p], cx[(i,)] = "constexpr", None
        elif isinstance(v, float):
            sig[p] = "fp32"
        elif isinstance(v, int):
            sig[p] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]] if v % 16 == 0 else []
        elif isinstance(v, torch.Tensor):
            sig[p], attrs[(i,)] = "*fp32", [["tt.divisibility", 16]]
        else:
            sig[p] = mangle_type(v)
    cc = triton.compile(ASTSource(fn=k, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ttgir = cc.asm["ttgir"]
    cubin = f"/tmp/sass_tma_{os.getpid()}.cubin"
    Path(cubin).write_bytes(cc.asm["cubin"])
    usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", cubin],
                           capture_output=True, text=True).stdout
    os.unlink(cubin)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    smem = cc.metadata.shared
    per_sm = min(65536 // (regs * 32 * cfg.num_warps), (228 * 1024) // max(smem, 1), 32 // cfg.num_warps)
    waits = collections.Counter(int(m) for m in re.findall(r"warp_group_dot_wait.*?pendings = (\d+)", ttgir))
    rows[spec] = {"registers": regs, "stack_bytes": stack, "shared_bytes": smem, "programs_per_sm": per_sm,
                  "a_in_registers": "ttg.local_load" in ttgir,
                  "wgmma": ttgir.count("ttng.warp_group_dot "),
                  "waits_by_pendings": {str(p): n for p, n in sorted(waits.items())}}
print(f"# Triton {triton.__version__}, sm_90, {C} -> {C} causal Conv3d at {H}x{W}")
print(f"{'tile (bh,bw,bk,bn0,bn1,warps,stages,bk1[,...])':46s} {'regs':>4s} {'smem KB':>7s} {'per SM':>6s} "
      f"{'stack':>5s} {'A':>5s} {'waits (pendings: count)':>24s}")
for spec, r in rows.items():
    waits = ", ".join(f"{p}: {n}" for p, n in r["waits_by_pendings"].items())
    print(f"{spec:46s} {r['registers']:>4d} {r['shared_bytes'] / 1024:>7.1f} {r['programs_per_sm']:>6d} "
          f"{r['stack_bytes']:>5d} {'regs' if r['a_in_registers'] else 'smem':>5s} {waits:>24s}")
if args.json:
    Path(args.json).write_text(json.dumps({"triton": triton.__version__, "target": "sm_90",
                                           "command": "python3 benchmarks/sass_tma.py " + " ".join(sys.argv[1:]),
                                           "shape": [1, C, T + 2, H, W], "tiles": rows}, indent=1))
