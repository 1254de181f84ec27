"""SiLU's arithmetic in the fused norm kernels (`common.silu` MODE): 0 = y / (1 + exp(-y)) (as shipped
before this script), 1 = the same with tl.fdiv's fast division, 2 = y * (1 + tanh.approx(y / 2)) / 2.
Per call (GroupNorm apply at SDXL shapes, bf16 and e4m3 out; Wan RMS norm at 480p shapes) and in whole decodes
(wan21-480p; sdxl-1024 with CUDA graphs, bf16 and e4m3 gate 30), interleaved in one process.

    python3 benchmarks/gpu_silu.py [--rounds 6]     -> $OUT/silu.json

Why: after E24 the e4m3 GroupNorm apply (3 B per element) takes as long as the bf16 one (4 B): the kernels look
bound by arithmetic, not bytes, and SiLU's exp + IEEE division is most of it (two MUFU ops and a Newton sequence).
"""
import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graph_ms, graphed_pipe, interleaved_graph_ms, interleaved_ms, out_dir, run_meta, wan_norm_inputs  # noqa: E402

from vaeopt.benchmark import WORKLOADS  # noqa: E402

gns = importlib.import_module("vaeopt.kernels.group_norm_silu")
rms = importlib.import_module("vaeopt.kernels.rms_norm_silu")
common = importlib.import_module("vaeopt.kernels.common")  # SILU_MODE: the SiLU policy of every norm kernel
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=6)
args = ap.parse_args()
dev = torch.device("cuda")
MODES = (0, 1, 2)
res = {"apply": {}, "rms": {}, "decode": {}}


def psnr(a, b):
    mse = ((a.float().clamp(-1, 1) - b.float().clamp(-1, 1)) ** 2).mean().item()
    return 99.0 if mse == 0 else 10 * torch.log10(torch.tensor(4.0 / mse)).item()


# GroupNorm apply at SDXL's shapes, the shipped launch (8192, 4)
for C, H, W in ((512, 128, 128), (512, 256, 256), (256, 512, 512), (128, 1024, 1024)):
    x = torch.randn(1, C, H, W, device=dev).mul(2).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    mean, a = torch.zeros(1, C, device=dev), torch.ones(1, C, device=dev)
    b = torch.zeros(C, device=dev)
    bound = torch.full((1, C), 16.0, device=dev)
    scale = torch.empty(1, device=dev)
    S, BLOCK_C = H * W, triton.next_power_of_2(C)
    BLOCK_S = 8192 // BLOCK_C
    n_s = triton.cdiv(S, BLOCK_S)
    exact = torch.nn.functional.silu(x.double())
    row = {}
    for out in ("bf16", "e4m3"):
        y = torch.empty_like(x, dtype=torch.bfloat16 if out == "bf16" else torch.float8_e4m3fn)
        outs = {}
        for m in MODES:
            def run(m=m, y=y, out=out):
                gns._apply_cl_kernel[(n_s,)](
                    x, y, mean, a, b, S, C, C * S, n_s, n_s, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, SILU=True,
                    bound_ptr=bound if out == "e4m3" else None, s_ptr=scale if out == "e4m3" else None,
                    OUT8=out == "e4m3", SILU_MODE=m, num_warps=4)
            run()
            torch.cuda.synchronize()
            deq = y.double() * (scale.double() if out == "e4m3" else 1.0)
            outs[m] = y.clone()
            row[f"{out} mode{m}"] = {
                "ms": graph_ms(run), "max_abs_err_vs_fp64": (deq - exact).abs().max().item(),
                "frac_differs_from_mode0": (outs[m].view(torch.uint8 if out == "e4m3" else torch.int16)
                                            != outs[0].view(torch.uint8 if out == "e4m3" else torch.int16)
                                            ).float().mean().item()}
    res["apply"][f"{C}x{H}x{W}"] = row
    print(f"apply {C}x{H}x{W}: " + ", ".join(f"{k} {v['ms'] * 1e3:.1f} us" for k, v in row.items()), flush=True)
    del x

# Wan RMS norm + SiLU at 480p, 12 output frames per call: the time-stacked 96-ch input (3 taps + cache) with the
# residual sum, and the 192-ch conv buffer
g = torch.Generator().manual_seed(0)
for name, C, H, W, taps in (("96ch-480p-stacked", 96, 480, 832, 3), ("192ch-240x416-buffer", 192, 240, 416, 0)):
    h, r, kw = wan_norm_inputs(C, H, W, taps, 12, g)
    gamma, beta, xb = torch.ones(C, device=dev), torch.zeros(C, device=dev), torch.randn(C, device=dev)
    u = torch.empty_like(h)
    row = {}
    for m in MODES:
        common.SILU_MODE = m
        row[f"mode{m}"] = {"ms": graph_ms(lambda: rms.rms_norm_silu(h, gamma, beta, x_bias=xb, residual=r,
                                                                     sum_out=u, **kw), n=5, reps=10)}
    common.SILU_MODE = None
    res["rms"][name] = row
    print(f"rms {name}: " + ", ".join(f"{k} {v['ms']:.3f} ms" for k, v in row.items()), flush=True)
    del h, r, u, kw
    torch.cuda.empty_cache()

# whole decodes
from vaeopt.loading import load_vae  # noqa: E402
from vaeopt.pipeline import Options, Pipeline  # noqa: E402

fam, shape = WORKLOADS["wan21-480p"]
torch.manual_seed(0)
pipe = Pipeline(load_vae(None, family=fam), Options(device="cuda", dtype="bf16", graphs="off", tiling="off"))
plan = pipe.plan(shape)
z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
r = {"chunk": plan.chunk, "ms": {m: [] for m in MODES}}
with torch.inference_mode():
    outs = {}
    for m in MODES:
        common.SILU_MODE = m
        outs[m] = pipe._decode_video(z, plan, None)
        torch.cuda.synchronize()
    r["psnr_vs_mode0_db"] = {m: psnr(outs[m], outs[0]) for m in MODES}
    del outs
    r["ms"] = interleaved_ms(lambda: pipe._decode_video(z, plan, None), MODES, args.rounds,
                             lambda m: setattr(common, "SILU_MODE", m))
common.SILU_MODE = None
r["median_ms"] = {m: statistics.median(v) for m, v in r["ms"].items()}
res["decode"]["wan21-480p"] = r
print("wan21-480p: " + ", ".join(f"mode{m} {r['median_ms'][m]:.1f} ms ({r['psnr_vs_mode0_db'][m]:.1f} dB vs mode 0)"
                                  for m in MODES), flush=True)
del pipe
torch.cuda.empty_cache()

fam, shape = WORKLOADS["sdxl-1024"]
zz = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
for mode in ("bf16", "fp8-gate30"):
    pipes, outs = {}, {}
    for m in MODES:
        common.SILU_MODE = m  # captured with this mode
        pipes[m], y = graphed_pipe(fam, zz, None if mode == "bf16" else 30.0, "gpu_silu")
        outs[m] = y.float()
    common.SILU_MODE = None
    ms = interleaved_graph_ms(pipes, zz, 15)
    res["decode"][f"sdxl-1024 {mode}"] = {"median_ms": {m: statistics.median(v) for m, v in ms.items()}, "ms": ms,
                                          "psnr_vs_mode0_db": {m: psnr(outs[m], outs[0]) for m in MODES}}
    rr = res["decode"][f"sdxl-1024 {mode}"]
    print(f"sdxl-1024 {mode} graphs: " + ", ".join(
        f"mode{m} {rr['median_ms'][m]:.2f} ms ({rr['psnr_vs_mode0_db'][m]:.1f} dB)" for m in MODES), flush=True)
    del pipes, outs
    torch.cuda.empty_cache()

meta = run_meta("python3 benchmarks/gpu_silu.py " + " ".join(sys.argv[1:]))
(out_dir() / "silu.json").write_text(json.dumps({**meta, **res}, indent=1, default=str))
print(f"\n# {meta['gpu']}")
for k, row in res["apply"].items():
    print(f"apply {k:14s} " + "  ".join(f"{n} {v['ms'] * 1e3:6.1f} us err {v['max_abs_err_vs_fp64']:.1e}"
                                          for n, v in row.items()))
for k, row in res["rms"].items():
    print(f"rms {k:22s} " + "  ".join(f"{n} {v['ms']:.3f} ms" for n, v in row.items()))
for k, row in res["decode"].items():
    print(f"{k:22s} " + "  ".join(f"mode{m} {row['median_ms'][m]:.2f} ms" for m in MODES))
