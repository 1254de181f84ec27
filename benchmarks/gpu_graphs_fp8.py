"""CUDA graphs and FP8 on the GPU: where graphs pay, what FP8 costs in fidelity and saves in memory/time.

Graphs: sd15-512 / sdxl-1024 single decodes eager vs replayed, a 16-decode same-shape batch (as `vaeopt decode` of 16
files runs it: first decode captures, the rest replay), correctness replay == eager.
FP8: the fp8 stage (e4m3 weight storage + fp8 GEMMs for 1x1 convs/linears) on sdxl-1024 with and without the fused
stages: probe PSNR, decode PSNR vs fp32, weight memory, time.

    python3 benchmarks/gpu_graphs_fp8.py      # writes $OUT/graphs_fp8.json
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vaeopt.fidelity import psnr  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import make_pipe, timed  # noqa: E402
from vaeopt.pipeline import Options, Pipeline  # noqa: E402
from vaeopt.hw import machine_info  # noqa: E402

OUT = Path(os.environ.get("OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")


res = {"graphs": [], "fp8": []}
with torch.inference_mode():
    for fam, shape in (("sd15", (1, 4, 64, 64)), ("sdxl", (1, 4, 128, 128)), ("sd15", (4, 4, 64, 64))):
        pipe = make_pipe(fam, graphs="off")
        z = torch.randn(shape).to(dev, torch.bfloat16)
        eager_out, eager = timed(lambda: pipe._decode_whole_raw(z), 10)
        pipe.enable_graphs("benchmark")
        t0 = time.perf_counter()
        pipe.graphed(z)
        torch.cuda.synchronize()
        capture_ms = (time.perf_counter() - t0) * 1e3
        g_out, graphed = timed(lambda: pipe.graphed(z), 10)
        # a batch of 16 same-shape decodes from a cold graph cache, as `vaeopt decode` runs 16 files
        pipe.graphed.reset()
        _, batch_graphed = timed(lambda: [pipe.graphed(z) for _ in range(16)], 1)
        _, batch_eager = timed(lambda: [pipe._decode_whole_raw(z) for _ in range(16)], 1)
        row = {"family": fam, "shape": list(shape), "eager_ms": statistics.median(eager),
               "graphed_ms": statistics.median(graphed), "capture_ms_incl_warmup": capture_ms,
               "batch16_eager_ms": batch_eager[0], "batch16_graphed_cold_ms": batch_graphed[0],
               "replay_max_abs_vs_eager": (g_out.float() - eager_out.float()).abs().max().item()}
        res["graphs"].append(row)
        print(row)
        del pipe
        torch.cuda.empty_cache()

    # FP8: fidelity and memory on sdxl-1024 (random weights: fidelity numbers are a lower bound for real weights,
    # whose activations are better behaved; the gate runs on every load)
    z = torch.randn(1, 4, 128, 128)
    ref_pipe = make_pipe("sdxl", graphs="off", dtype="fp32", channels_last="off", triton="off", epilogues="off")
    ref = ref_pipe._decode_whole_raw(z.to(dev)).float()
    del ref_pipe
    torch.cuda.empty_cache()
    for label, opts in (("bf16 fused", {}), ("bf16 fused + fp8", {"fp8": "on", "gate_db": 0.0}),
                        ("bf16 plain + fp8", {"fp8": "on", "gate_db": 0.0, "triton": "off", "channels_last": "off"})):
        pipe = make_pipe("sdxl", graphs="off", **opts)
        zz = z.to(dev, torch.bfloat16)
        out, ts = timed(lambda: pipe._decode_whole_raw(zz), 6)
        wbytes = sum(b.numel() * b.element_size() for b in pipe.model.decoder.buffers()) + \
            sum(p.numel() * p.element_size() for p in pipe.model.decoder.parameters())
        row = {"variant": label, "median_ms": statistics.median(ts[1:]), "psnr_vs_fp32": psnr(out.float().clamp(-1, 1),
               ref.clamp(-1, 1)), "decoder_weight_mib": wbytes / 2**20,
               "stages": [s.line() for s in pipe.stages]}
        res["fp8"].append(row)
        print({k: v for k, v in row.items() if k != "stages"})
        for s in pipe.stages:
            if s.name == "fp8":
                print("   ", s.line())
        del pipe
        torch.cuda.empty_cache()

    # FP8 on real trained weights: the bundled tiny_kl_image VAE with real latents (astronaut, upsampled to 1024²)
    from vaeopt.loading import load_vae

    lat = torch.load(Path(__file__).resolve().parent.parent / "samples" / "tiny_kl_image_latents.pt",
                     weights_only=True)["astronaut"].float()
    zt = torch.nn.functional.interpolate(lat, scale_factor=2, mode="nearest") / 0.84481
    ref_l = load_vae(Path(__file__).resolve().parent.parent / "samples" / "tiny_kl_image.safetensors")
    ref = ref_l.model.to(dev).decode(zt.to(dev)).sample.float()
    for label, opts in (("trained tiny bf16", {}), ("trained tiny bf16 + fp8", {"fp8": "on", "gate_db": 0.0})):
        loaded = load_vae(Path(__file__).resolve().parent.parent / "samples" / "tiny_kl_image.safetensors")
        pipe = Pipeline(loaded, Options(**{"device": "cuda", "dtype": "bf16", "graphs": "off", **opts}))
        out = pipe._decode_whole_raw(zt.to(dev, torch.bfloat16))
        row = {"variant": label, "psnr_vs_fp32": psnr(out.float().clamp(-1, 1), ref.clamp(-1, 1)),
               "stages": [s.line() for s in pipe.stages]}
        res["fp8"].append(row)
        print(label, row["psnr_vs_fp32"], [s.line() for s in pipe.stages if s.name == "fp8"])

mi = machine_info()
res.update(gpu=mi.gpus[0].name, versions={"torch": mi.torch, "cudnn": mi.cudnn, "triton": mi.triton},
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           command="python3 benchmarks/gpu_graphs_fp8.py")
(OUT / "graphs_fp8.json").write_text(json.dumps(res, indent=1))
print("\ngraphs                 eager ms  graphed ms  capture ms  16x eager  16x graphed(cold)  max|replay-eager|")
for r in res["graphs"]:
    print(f"{r['family']:5s} {str(tuple(r['shape'])):18s} {r['eager_ms']:8.2f} {r['graphed_ms']:10.2f} "
          f"{r['capture_ms_incl_warmup']:10.0f} {r['batch16_eager_ms']:10.0f} {r['batch16_graphed_cold_ms']:14.0f} "
          f"{r['replay_max_abs_vs_eager']:12.2e}")
print("fp8 (sdxl-1024)          ms     PSNR vs fp32   decoder weights MiB")
for r in res["fp8"]:
    print(f"{r['variant']:24s} {r.get('median_ms', float('nan')):8.2f} {r['psnr_vs_fp32']:10.1f} "
          f"{r.get('decoder_weight_mib', float('nan')):12.1f}")
