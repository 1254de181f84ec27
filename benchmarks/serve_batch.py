"""Does batching same-shape image requests pay? Times B latents decoded as one (B, C, H, W) batch against B decodes
of (1, C, H, W), each as `vaeopt serve`'s worker runs it: vaeopt.decode leaving the output on the device, the
uint8 channels-last images made there and copied to the host (random-weight SDXL by default). `vaeopt serve
--batch N` is worth turning on only where the per-image time of the batch is clearly lower; benchmarks/serve_load.py
--batch 1,2,4,8 then measures what it does to latency and throughput under load.

    python benchmarks/serve_batch.py --family sdxl --shapes 128x128,64x64 --batches 1,2,4,8 \
        --out benchmarks/results/serve_batch_sdxl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, which puts the repository first

import harness as H  # noqa: E402
import vaeopt  # noqa: E402
from vaeopt import outputs  # noqa: E402


def worker_decode(z: torch.Tensor, loaded, opts) -> torch.Tensor:
    """What the server's worker does for image answers: decode, uint8 on the device, to the host."""
    out = vaeopt.decode(z, loaded, latent_space="raw", options=opts, on_device=True)
    return outputs.to_uint8_images(out, on_device=True).cpu()


def table(rows: list[dict], gpu: str | None) -> str:
    lines = [f"serve_batch: {gpu or 'cpu'}", f"{'latent':>9} {'batch':>5} {'batched ms':>10} {'1-by-1 ms':>10} "
             f"{'ms/image':>9} {'(1-by-1)':>9} {'speedup':>7}"]
    for r in rows:
        lines.append(f"{'x'.join(map(str, r['latent'])):>9} {r['batch']:>5} {r['batched_ms']:>10.2f} "
                     f"{r['one_by_one_ms']:>10.2f} {r['per_image_batched_ms']:>9.2f} {r['per_image_single_ms']:>9.2f} "
                     f"{r['speedup']:>7.3f}")
    return "\n".join(lines)


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
    t_start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="vaeopt-batch-")
    loaded = vaeopt.load_vae(a.model or H.save_model(a.family, Path(tmp.name) / a.family))
    opts = vaeopt.Options(device=a.device) if a.device else vaeopt.Options()
    c = loaded.family.latent_channels
    rows = []
    for sh in [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]:
        for b in [int(v) for v in a.batches.split(",")]:
            z = torch.randn(b, c, *sh, generator=torch.Generator().manual_seed(b))
            singles = [z[i:i + 1] for i in range(b)]
            worker_decode(z, loaded, opts)  # warm: this batch shape's first decode
            worker_decode(singles[0], loaded, opts)
            t_batch, t_single = [], []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                worker_decode(z, loaded, opts)
                t_batch.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for s in singles:
                    worker_decode(s, loaded, opts)
                t_single.append(time.perf_counter() - t0)
            mb, ms = statistics.median(t_batch) * 1e3, statistics.median(t_single) * 1e3
            rows.append({"latent": list(sh), "batch": b, "batched_ms": round(mb, 2), "one_by_one_ms": round(ms, 2),
                         "per_image_batched_ms": round(mb / b, 2), "per_image_single_ms": round(ms / b, 2),
                         "speedup": round(ms / mb, 3)})
            print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    res = {"model": str(a.model) if a.model else f"{a.family} (random weights)", "gpu": gpu,
           "torch": torch.__version__, "what": "vaeopt.decode(on_device=True) + uint8 on the device + copy to host",
           "seconds": round(time.perf_counter() - t_start, 1), "rows": rows}
    H.write_json(res, a.out)
    tmp.cleanup()
    print(table(rows, gpu), flush=True)


if __name__ == "__main__":
    main()
