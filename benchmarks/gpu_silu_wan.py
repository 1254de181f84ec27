"""wan21-480p in bf16 with the RMS norm's SiLU exact (MODE 0, shipped) vs tanh.approx (MODE 2): whole decodes
interleaved in one process, and each one's PSNR / max error vs the fp32 decode of the same weights (vaeopt's
chunk-1 loop in fp32, TF32 off: the benchmark's reference).

    python3 benchmarks/gpu_silu_wan.py [--rounds 8]     -> $OUT/silu_wan.json

Why: benchmarks/gpu_silu.py measured 605.3 -> 601.2 ms medians with MODE 2 (6 rounds; every MODE-2 decode below
every MODE-0 one), although the RMS kernel alone did not get faster per call.
"""
import argparse
import copy
import importlib
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import interleaved_ms, no_tf32, out_dir, run_meta  # noqa: E402

from vaeopt import video  # noqa: E402
from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.loading import load_vae  # noqa: E402
from vaeopt.pipeline import Options, Pipeline  # noqa: E402

common = importlib.import_module("vaeopt.kernels.common")  # SILU_MODE: the SiLU policy of every norm kernel
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=8)
args = ap.parse_args()
dev = torch.device("cuda")
fam, shape = WORKLOADS["wan21-480p"]
torch.manual_seed(0)
loaded = load_vae(None, family=fam)
ref_model = copy.deepcopy(loaded.model).float().to(dev).eval()
z32 = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev)
no_tf32()
with torch.inference_mode():
    ref = video.decode_video(ref_model, z32, chunk=1).float().clamp(-1, 1)
del ref_model
torch.cuda.empty_cache()
torch.backends.cudnn.allow_tf32 = True  # back to torch's default (matmul TF32 is off by default)
pipe = Pipeline(loaded, Options(device="cuda", dtype="bf16", graphs="off", tiling="off"))
plan = pipe.plan(shape)
z = z32.to(torch.bfloat16)
MODES = (0, 2)
r = {"chunk": plan.chunk, "ms": {m: [] for m in MODES}, "psnr_vs_fp32_db": {}, "max_abs_vs_fp32": {}}
with torch.inference_mode():
    for m in MODES:
        common.SILU_MODE = m
        y = pipe._decode_video(z, plan, None).float().clamp(-1, 1)
        mse = ((y - ref) ** 2).mean().item()
        r["psnr_vs_fp32_db"][m] = 10 * math.log10(4.0 / mse)
        r["max_abs_vs_fp32"][m] = (y - ref).abs().max().item()
        del y
    r["ms"] = interleaved_ms(lambda: pipe._decode_video(z, plan, None), MODES, args.rounds,
                             lambda m: setattr(common, "SILU_MODE", m))
common.SILU_MODE = None
r["median_ms"] = {m: statistics.median(v) for m, v in r["ms"].items()}
meta = run_meta("python3 benchmarks/gpu_silu_wan.py " + " ".join(sys.argv[1:]))
(out_dir() / "silu_wan.json").write_text(json.dumps({**meta, "wan21-480p": r}, indent=1))
print(f"\n# {meta['gpu']}, wan21-480p bf16, chunk {plan.chunk}")
for m in MODES:
    print(f"MODE {m}: {r['median_ms'][m]:.1f} ms ({min(r['ms'][m]):.1f}-{max(r['ms'][m]):.1f}), "
          f"{r['psnr_vs_fp32_db'][m]:.2f} dB vs fp32, max abs {r['max_abs_vs_fp32'][m]:.3f}")
