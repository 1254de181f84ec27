"""Wan's RMS-norm kernel (`kernels/rms_norm_silu`) on the wan21-480p chunk decoder's shapes: launch tile x warps sweep,
TB/s against a plain copy of the same bytes.

    python3 benchmarks/gpu_rms_tile.py [--reps 10] [--no-sweep]     -> $OUT/rms_tile.json

(Its --split-ab / --decode-rounds, an A/B of the channels as two power-of-2 tiles, went with that experiment's revert:
commit b3305f9, docs/perf-notes.md E30. Its --loop, persistent programs, went with E31's: commit 051ea6e.)

Shapes (one call of the chunk decoder at chunk 3, bf16, channels_last_3d): 96 ch at 480x832 and 192 ch at 240x416,
12 frames, into the plain [history | frames] conv buffer; 384 ch at 120x208, 6 frames, into the time-stacked input
(taps=3, with the next history). Each with and without the residual formed in the kernel (the block's output u =
r + h, also stored). Output of every variant checked equal (bitwise) to the default launch's.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import event_ms, out_dir, run_meta, wan_norm_inputs  # noqa: E402

from vaeopt.kernels.rms_norm_silu import rms_norm_silu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--no-sweep", action="store_true")
args = ap.parse_args()
SHAPES = [("96ch 480x832 k12", 96, 480, 832, 0, 12), ("192ch 240x416 k12", 192, 240, 416, 0, 12),
          ("384ch 120x208 k6 taps3", 384, 120, 208, 3, 6)]
TILES = [2048, 4096, 8192, 16384]
WARPS = [2, 4, 8, 16]
g = torch.Generator().manual_seed(0)
rows = []
for label, C, H, W, taps, k in SHAPES:
    h, r, kw = wan_norm_inputs(C, H, W, taps, k, g)
    gamma = (1 + 0.1 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    beta = (0.1 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    out = kw["out"]
    u = torch.empty_like(h)
    for resid in (False, True):
        def call(tile=None, nw=None):
            extra = dict(residual=r, sum_out=u) if resid else {}  # u = r + h stored (the decoder stores it over h)
            return rms_norm_silu(h, gamma, beta, 1e-12, True, tile=tile, num_warps=nw, **kw, **extra)

        el = h.numel() * h.element_size()
        moved = el * (1 + taps if taps else 2) + (2 * el if resid else 0) + (el * 2 / k if taps else 0)
        dst = torch.empty_like(h)
        copy_ms = event_ms(lambda: dst.copy_(h), reps=args.reps)
        call()
        ref = out.clone()
        res = {"shape": label, "C": C, "taps": taps, "frames": k, "residual": resid, "bytes": moved,
               "copy_ms_same_elems": copy_ms, "variants": []}
        for tile in ([None] + TILES) if not args.no_sweep else [None]:
            for nw in ([None] + WARPS) if not args.no_sweep else [None]:
                if (tile is None) != (nw is None):
                    continue
                try:
                    ms = event_ms(lambda: call(tile, nw), reps=args.reps)
                    same = bool(torch.equal(out, ref))
                    res["variants"].append({"tile": tile, "warps": nw, "ms": ms, "tbps": moved / ms / 1e9,
                                            "equal": same})
                except Exception as e:  # noqa: BLE001
                    res["variants"].append({"tile": tile, "warps": nw, "error": str(e)[:200]})
        rows.append(res)
        best = min((v for v in res["variants"] if "ms" in v), key=lambda v: v["ms"])
        d = res["variants"][0]
        print(f"{label:24s} res={int(resid)}  default {d['ms']:.3f} ms ({d['tbps']:.2f} TB/s)  best tile {best['tile']} "
              f"warps {best['warps']}: {best['ms']:.3f} ms ({best['tbps']:.2f} TB/s); a copy of h: {copy_ms:.3f} ms "
              f"({2 * el / copy_ms / 1e9:.2f} TB/s)", flush=True)
meta = run_meta("python3 benchmarks/gpu_rms_tile.py " + " ".join(sys.argv[1:]))
(out_dir() / "rms_tile.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
print(f"\n# {meta['gpu']}")
print(f"{'shape':24s} {'res':>3s} {'default ms':>10s} {'TB/s':>5s} {'best':>14s} {'ms':>7s} {'TB/s':>5s} {'all equal':>9s}")
for res in rows:
    vs = [v for v in res["variants"] if "ms" in v]
    d, b = vs[0], min(vs, key=lambda v: v["ms"])
    print(f"{res['shape']:24s} {int(res['residual']):>3d} {d['ms']:>10.3f} {d['tbps']:>5.2f} "
          f"{str(b['tile']) + 'x' + str(b['warps']):>14s} {b['ms']:>7.3f} {b['tbps']:>5.2f} "
          f"{str(all(v['equal'] for v in vs)):>9s}")
