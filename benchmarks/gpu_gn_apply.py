"""The channels-last GroupNorm apply kernel (`_apply_cl_kernel`) at SDXL's decoder shapes: bf16 out vs e4m3 out (the
FP8 path's quantizing apply), per tile size and warps; e4m3 with the per-sample amax reduced in every program (as
shipped) vs read from a precomputed [N] buffer. GPU time of 20 calls in a CUDA graph.

    python3 benchmarks/gpu_gn_apply.py      -> $OUT/gn_apply.json

Why: E23's profile had the apply kernels at 1.68 ms (bf16: read 2 B + write 2 B per element) and 1.91 ms (e4m3: read
2 B + write 1 B) per sdxl-1024 decode: ~4.3 vs ~2.9 TB/s. GB/s below counts exactly that traffic.
"""
import importlib
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graph_ms, out_dir, run_meta  # noqa: E402

gns = importlib.import_module("vaeopt.kernels.group_norm_silu")
dev = torch.device("cuda")
SHAPES = {(512, 128, 128): 11, (512, 256, 256): 6, (512, 512, 512): 1, (256, 512, 512): 5, (256, 1024, 1024): 1,
          (128, 1024, 1024): 6}
DEFAULT = (4096, 4)




def apply(x, y, mean, a, b, bound, scale, amax, tile, warps, mode):
    N, C, H, W = x.shape
    S = H * W
    BLOCK_C = triton.next_power_of_2(C)
    BLOCK_S = max(1, min(tile // BLOCK_C, triton.next_power_of_2(S)))
    n_s = triton.cdiv(S, BLOCK_S)
    out8 = mode != "bf16"
    gns._apply_cl_kernel[(N * n_s,)](
        x, y, mean, a, b, S, C, C * S, n_s, N * n_s, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, SILU=True,
        bound_ptr=bound if out8 else None, s_ptr=scale if out8 else None, OUT8=out8, EXACT8=False,
        amax_ptr=amax if mode == "e4m3-pre" else None, PRE_AMAX=mode == "e4m3-pre", num_warps=warps)


res = {"shapes": {}}
for (C, H, W), cnt in SHAPES.items():
    x = torch.randn(1, C, H, W, device=dev).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y16 = torch.empty_like(x)
    y8 = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    mean, a = torch.randn(1, C, device=dev) * 0.1, torch.rand(1, C, device=dev) + 0.5
    b = torch.randn(C, device=dev) * 0.1
    bound = torch.rand(1, C, device=dev) * 4 + 1
    scale = torch.empty(1, device=dev)
    amax = bound.amax(dim=1)
    ref8 = None
    r = {"count": cnt, "elements": x.numel(), "rows": {}}
    for mode, tile, warps in itertools.product(("bf16", "e4m3", "e4m3-pre"), (2048, 4096, 8192, 16384), (4, 8)):
        y = y16 if mode == "bf16" else y8
        apply(x, y, mean, a, b, bound, scale, amax, tile, warps, mode)
        torch.cuda.synchronize()
        if mode != "bf16":
            if ref8 is None:
                ref8 = y8.clone()
            same = bool(torch.equal(y8.view(torch.uint8), ref8.view(torch.uint8)))
        else:
            same = True
        ms = graph_ms(lambda: apply(x, y, mean, a, b, bound, scale, amax, tile, warps, mode))
        nbytes = x.numel() * (2 + (2 if mode == "bf16" else 1))
        r["rows"][f"{mode} {tile} {warps}"] = {"ms": ms, "TBps": nbytes / ms / 1e9, "same_as_default": same}
    res["shapes"][f"{C}x{H}x{W}"] = r
    d16, d8 = r["rows"][f"bf16 {DEFAULT[0]} {DEFAULT[1]}"], r["rows"][f"e4m3 {DEFAULT[0]} {DEFAULT[1]}"]
    print(f"{C}x{H}x{W}: default bf16 {d16['TBps']:.2f} TB/s, e4m3 {d8['TBps']:.2f} TB/s; best per mode: " + ", ".join(
        f"{m} {min((k for k in r['rows'] if k.startswith(m + ' ')), key=lambda k: r['rows'][k]['ms'])}" for m in
        ("bf16", "e4m3", "e4m3-pre")), flush=True)
    del x, y16, y8

modes = ("bf16", "e4m3", "e4m3-pre")
configs = [f"{t} {w}" for t in (2048, 4096, 8192, 16384) for w in (4, 8)]
totals = {m: {c: sum(r["count"] * r["rows"][f"{m} {c}"]["ms"] for r in res["shapes"].values()) for c in configs}
          for m in modes}
res["totals_ms_per_decode"] = totals
meta = run_meta("python3 benchmarks/gpu_gn_apply.py " + " ".join(sys.argv[1:]))
(out_dir() / "gn_apply.json").write_text(json.dumps({**meta, **res}, indent=1))
print(f"\n# {meta['gpu']}: apply kernels per sdxl-1024 decode (ms), tile / warps")
print(f"{'config':12s} " + " ".join(f"{m:>9s}" for m in modes))
for c in configs:
    print(f"{c:12s} " + " ".join(f"{totals[m][c]:9.3f}" for m in modes))
bad = [f"{k} {c}" for k, r in res["shapes"].items() for c, v in r["rows"].items() if not v["same_as_default"]]
print("e4m3 outputs bitwise equal across configs:", not bad, bad[:4])

if "--decode" in sys.argv:  # same-process sdxl-1024 decodes (CUDA graphs, e4m3 gate 30 and bf16): old vs new apply
    import statistics

    from _common import graphed_pipe, interleaved_graph_ms

    from vaeopt.benchmark import WORKLOADS

    fam, shape = WORKLOADS["sdxl-1024"]
    zz = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    shipped = gns.APPLY_CL_CUDA
    res["decode"] = {}
    for mode in ("fp8-gate30", "bf16"):
        pipes = {}
        for name, cfg in (("old", (4096, 4)), ("new", shipped)):
            gns.APPLY_CL_CUDA = cfg  # captured under this launch
            pipes[name] = graphed_pipe(fam, zz, None if mode == "bf16" else 30.0, "gpu_gn_apply")[0]
        gns.APPLY_CL_CUDA = shipped
        ms = interleaved_graph_ms(pipes, zz, 15)
        res["decode"][mode] = {n: {"median_ms": statistics.median(v), "ms": v} for n, v in ms.items()}
        print(f"sdxl-1024 {mode} graphs: apply (4096, 4) {statistics.median(ms['old']):.2f} ms, {shipped} "
              f"{statistics.median(ms['new']):.2f} ms", flush=True)
        del pipes
        torch.cuda.empty_cache()
    (out_dir() / "gn_apply.json").write_text(json.dumps({**meta, **res}, indent=1))
