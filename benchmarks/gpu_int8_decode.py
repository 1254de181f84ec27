"""Whole sdxl-1024 decodes with the image resnet convs' 8-bit path in e4m3 vs int8 (stages/triton_conv.INT8_FORMAT),
same process, CUDA-graph replays interleaved (0.1 s idle before each, E31's clocks), PSNR vs the fp32 decode.

    python3 benchmarks/gpu_int8_decode.py [--rounds 15] [--gates none,40,0] [--profile]   # sm_90; $OUT/int8_decode.json

Gate 0 admits every candidate: the two formats' speed with the same layers. Gate 40 is the default: how many layers
each format gets in, and what the decode measures at full size (the gate judges e4m3 on a 16x16-latent probe, int8
on a latent of the decode's size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import (fp32_reference, graph_kernel_ms, graphed_pipe, interleaved_graph_ms, no_tf32,  # noqa: E402
                     out_dir, run_meta)
from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.stages import triton_conv  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--gates", default="none,40,0")
ap.add_argument("--formats", default="e4m3,int8", help="the 8-bit formats to run at each numeric gate")
ap.add_argument("--profile", action="store_true", help="also kernel time by kernel name per variant (torch.profiler "
                "over 5 graph replays)")
args = ap.parse_args()
OUT = out_dir()
no_tf32()
g = torch.Generator().manual_seed(1)
z = torch.randn(1, 4, 128, 128, generator=g).cuda().bfloat16()

ref = fp32_reference("sdxl", z)

pipes, info = {}, {}
default_format = triton_conv.INT8_FORMAT
for gate in args.gates.split(","):
    fmts = ["bf16"] if gate == "none" else args.formats.split(",")
    for fmt in fmts:
        triton_conv.INT8_FORMAT = fmt == "int8"
        name = fmt if gate == "none" else f"{fmt} gate {gate}"
        # the decode's size: int8 is gated there (without it the stage takes e4m3)
        p, y = graphed_pipe("sdxl", z, None if gate == "none" else float(gate), "A/B", decode_shape=tuple(z.shape))
        st = next((s for s in p.stages if s.name == "fp8 convs"), None)
        data = dict(st.data) if st is not None and st.data else {}
        info[name] = {"psnr_db": psnr(y.float(), ref), "layers": data.get("layers"),
                      "probe_db": data.get("probe_db"), "resnet_format": data.get("resnet_format"),
                      "kept_bf16": len(data.get("kept", [])), "kept": data.get("kept"),
                      "sensitivity_db": data.get("sensitivity_db"),
                      "probe_shape": data.get("probe_shape"), "gate_s": data.get("gate_s")}
        pipes[name] = p
        print(name, info[name], flush=True)
triton_conv.INT8_FORMAT = default_format

ms = interleaved_graph_ms(pipes, z, args.rounds, before=lambda n: time.sleep(0.1))
for name in pipes:
    info[name]["median_ms"] = statistics.median(ms[name])
    info[name]["ms"] = ms[name]
if args.profile:
    for name, p in pipes.items():
        by = graph_kernel_ms(p, z)
        info[name]["kernel_ms"] = by
        info[name]["kernel_total_ms"] = sum(by.values())
        print(f"\n{name}: {sum(by.values()):.2f} ms of kernels per decode", flush=True)
        for k, v in list(info[name]["kernel_ms"].items())[:12]:
            print(f"  {v:7.3f}  {k}")

res = {"variants": info, "rounds": args.rounds,
       **run_meta("python3 benchmarks/gpu_int8_decode.py " + " ".join(sys.argv[1:]))}
(OUT / "int8_decode.json").write_text(json.dumps(res, indent=1))
print("\n| sdxl-1024 | median ms | layers in 8-bit | probe dB | full-size PSNR dB |")
print("|---|---|---|---|---|")
for name, v in info.items():
    pr = f"{v['probe_db']:.1f}" if v["probe_db"] is not None else "-"
    print(f"| {name} | {v['median_ms']:.2f} | {v['layers'] if v['layers'] is not None else '-'} | {pr} | "
          f"{v['psnr_db']:.1f} |")
