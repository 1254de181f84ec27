"""Does batching same-shape image requests pay? Times B latents decoded as one (B, C, H, W) batch against B decodes
of (1, C, H, W), through vaeopt.decode as the server's worker runs it (random-weight SDXL by default). `vaeopt serve
--batch N` is worth turning on only where the per-image time of the batch is clearly lower.

    python benchmarks/serve_batch.py --family sdxl --shapes 128x128,64x64 --batches 1,2,4,8 \
        --out benchmarks/results/serve_batch_sdxl.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vaeopt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--family", default="sdxl")
    ap.add_argument("--device")
    ap.add_argument("--shapes", default="128x128,64x64")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="vaeopt-batch-")
    model = a.model
    if model is None:
        from vaeopt.families import build_model, get_family

        torch.manual_seed(0)
        model = Path(tmp.name) / a.family
        build_model(get_family(a.family)).save_pretrained(model)
    loaded = vaeopt.load_vae(model)
    opts = vaeopt.Options(device=a.device) if a.device else None
    c = loaded.family.latent_channels
    rows = []
    for sh in [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]:
        for b in [int(v) for v in a.batches.split(",")]:
            z = torch.randn(b, c, *sh).half()
            singles = [z[i:i + 1] for i in range(b)]
            vaeopt.decode(z, loaded, options=opts)  # warm: this batch shape's first decode
            vaeopt.decode(singles[0], loaded, options=opts)
            t_batch, t_single = [], []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                vaeopt.decode(z, loaded, options=opts)
                t_batch.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for s in singles:
                    vaeopt.decode(s, loaded, options=opts)
                t_single.append(time.perf_counter() - t0)
            mb, ms = statistics.median(t_batch) * 1e3, statistics.median(t_single) * 1e3
            rows.append({"latent": list(sh), "batch": b, "batched_ms": round(mb, 2), "one_by_one_ms": round(ms, 2),
                         "per_image_batched_ms": round(mb / b, 2), "per_image_single_ms": round(ms / b, 2),
                         "speedup": round(ms / mb, 3)})
            print(json.dumps(rows[-1]), flush=True)
    res = {"model": str(a.model) if a.model else f"{a.family} (random weights)",
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
           "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    part = a.out.with_name(f".{a.out.name}.partial")
    part.write_text(json.dumps(res, indent=1))
    os.replace(part, a.out)
    tmp.cleanup()


if __name__ == "__main__":
    main()
