"""Several Python threads decoding with one optimized VAE (a web server's pattern), on the GPU's fused path.

A decode through the fused image decoder leaves notes on shared modules for its later layers (the resnet's upsampled
output on Upsample2D, the head's statistics on conv_out); a second thread in between read them. Decodes of one
decoder now take turns (fused_epilogues' per-decoder lock). This checks, for sdxl-1024 and a small Wan clip after
`vaeopt.optimize(vae)` in bf16:
  sequential -- each latent decoded alone, one after the other;
  threaded   -- the same latents, N threads at once, each decoding its share;
that every threaded output equals its sequential one (max abs difference), and times both (wall ms for all). It also
counts the Wan chunk decoder's calls (the optimized path must run, not diffusers' frame loop: vaeopt's own hooks
must not count as a user's). Writes $OUT/threads.json; prints a table last.

    python3 benchmarks/gpu_threads.py [--threads 4] [--per-thread 3]
"""
import argparse
import copy
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import out_dir, random_model, run_meta  # noqa: E402

import vaeopt  # noqa: E402
from vaeopt import video  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=4)
ap.add_argument("--per-thread", type=int, default=3)
args = ap.parse_args()

calls = []
_real = video.decode_video
video.decode_video = lambda *a, **k: calls.append(1) or _real(*a, **k)

cases = {"sdxl-1024": ("sdxl", (1, 4, 128, 128)), "wan21-small": ("wan21", (1, 16, 5, 30, 52))}
rows = []
for name, (fam, shape) in cases.items():
    vae = vaeopt.optimize(random_model(fam).to("cuda", torch.bfloat16), log=None)
    n = args.threads * args.per_thread
    g = torch.Generator(device="cuda").manual_seed(0)
    zs = [torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    with torch.no_grad():
        vae.decode(zs[0])  # warm-up: Triton compiles, cuDNN picks its kernels
    calls.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        seq = [vae.decode(z).sample for z in zs]
    torch.cuda.synchronize()
    t_seq = (time.perf_counter() - t0) * 1e3
    seq_calls = len(calls)
    out = [None] * n

    def work(t):
        with torch.no_grad():
            for i in range(t, n, args.threads):
                out[i] = vae.decode(zs[i]).sample

    ts = [threading.Thread(target=work, args=(t,)) for t in range(args.threads)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    t_thr = (time.perf_counter() - t0) * 1e3
    diffs = [(o.float() - s.float()).abs().max().item() if o is not None and o.shape == s.shape else float("inf")
             for o, s in zip(out, seq)]
    rows.append({"case": name, "decodes": n, "threads": args.threads, "sequential_ms": t_seq, "threaded_ms": t_thr,
                 "max_abs_diff": max(diffs), "shapes_equal": all(o is not None and o.shape == s.shape
                                                                 for o, s in zip(out, seq)),
                 "chunk_decoder_calls_sequential": seq_calls if fam == "wan21" else None})
    del vae, seq, out
    torch.cuda.empty_cache()

res = {**run_meta("python3 benchmarks/gpu_threads.py " + " ".join(sys.argv[1:])), "rows": rows,
       "note": "threaded decodes with one optimized VAE equal the sequential ones (fused_epilogues' per-decoder lock)"}
(out_dir() / "threads.json").write_text(json.dumps(res, indent=1))
print(f"{'case':<12} {'decodes':>7} {'seq ms':>9} {'thr ms':>9} {'max|diff|':>10} {'chunk calls':>11}")
for r in rows:
    print(f"{r['case']:<12} {r['decodes']:>7} {r['sequential_ms']:>9.1f} {r['threaded_ms']:>9.1f} "
          f"{r['max_abs_diff']:>10.3g} {str(r['chunk_decoder_calls_sequential']):>11}")
