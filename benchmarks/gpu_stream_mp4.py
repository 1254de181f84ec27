"""A long Wan 2.1 video streamed to MP4: does encoding overlap the decode, and which libx264 threading keeps up
with the GPU (issue #6's streams and long-video items).

Full-size Wan 2.1 VAE with random N(0, 0.02) weights, latents (1, 16, --T, 60, 104) -> 1 + 4(T-1) frames 480x832
(T = 121: 481 frames). In one process, through the pipeline `vaeopt decode` builds (Pipeline.iter_video, the loop
api.run_jobs runs):
1. decode only: iterate the clip's uint8 frame groups to the host and drop them (median of --repeats);
2. encode only: the decoded frames (kept from one pass) through vaeopt.outputs.Mp4Writer, per variant;
3. both, as the CLI does it (each group put into the writer as it arrives), per variant, with the time the decode
   loop spent blocked in Mp4Writer.put (queue full: the encoder is behind).
A variant is "TYPE/THREADS" (outputs.MP4_THREAD_TYPE / MP4_THREADS; "default" = PyAV's, i.e. slice threads;
THREADS 0 = libx264's own count). Then --cli variants run `python -m vaeopt decode lat.pt --model m.safetensors -o
out.mp4 --json` in a child (the variant set before the CLI starts): wall time, the CLI's decode + write seconds,
host RSS peak (VmRSS every 20 ms), GPU peak, frames read back from the MP4 with PyAV.
Writes $OUT/stream_mp4.json; prints a table last.

The GPU machine has no PyAV: its wheel goes as .whl/av-19.0.2.tar.xz (the wheel's files, tar.xz: the zip is too
large for the transfer with the checkout), unpacked into /tmp/site.

    python3 benchmarks/gpu_stream_mp4.py [--variants default,FRAME/0,FRAME/14] [--cli FRAME/0] [--repeats 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpu_wan_graphs as G  # noqa: E402
from _common import make_pipe, out_dir, run_meta  # noqa: E402

from vaeopt import outputs  # noqa: E402
from vaeopt.pipeline import DecodeStats  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--variants", default="default,FRAME/0,FRAME/14,FRAME/8")
ap.add_argument("--cli", default="default,FRAME/0")
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--T", type=int, default=121)
args = ap.parse_args()
T = args.T
frames_n = 1 + 4 * (T - 1)
res = {"latent": [1, 16, T, 60, 104], "frames": frames_n, "cpus": os.cpu_count(), "decode_only_s": [],
       "encode_only": {}, "streamed": {}, "cli": {}}
tmp = Path(tempfile.mkdtemp(prefix="stream_mp4_"))


def setv(v):
    tt, _, n = v.partition("/")
    outputs.MP4_THREAD_TYPE = None if tt == "default" else tt
    outputs.MP4_THREADS = int(n) if n else None


pipe = make_pipe("wan21")
z = torch.randn(1, 16, T, 60, 104, generator=torch.Generator().manual_seed(3))
plan = pipe.plan(tuple(z.shape))
res["chunk"] = plan.chunk
kept = []
with torch.inference_mode():
    for i in range(args.repeats + 1):  # 1. decode only (the first pass keeps the frames, and warms up)
        t = time.perf_counter()
        for fr in pipe.iter_video(z, plan, DecodeStats()):
            if i == 0:
                kept.append(fr.clone())
        s = time.perf_counter() - t
        if i:
            res["decode_only_s"].append(round(s, 3))
    G.log(f"decode only: {res['decode_only_s']}")
    for v in args.variants.split(","):  # 2. encode only
        setv(v)
        t = time.perf_counter()
        wr = outputs.Mp4Writer(tmp / "enc.mp4", fps=16)
        for fr in kept:
            wr.put(fr)
        n = wr.close()
        s = time.perf_counter() - t
        res["encode_only"][v] = {"s": round(s, 3), "frames_per_s": round(n / s, 1),
                                 "bytes": (tmp / "enc.mp4").stat().st_size}
        G.log(f"encode only {v}: {res['encode_only'][v]}")
    del kept
    for v in args.variants.split(","):  # 3. both, as api.run_jobs does
        setv(v)
        t = time.perf_counter()
        wr = outputs.Mp4Writer(tmp / "both.mp4", fps=16)
        blocked, n = 0.0, 0
        for fr in pipe.iter_video(z, plan, DecodeStats()):
            tp = time.perf_counter()
            wr.put(fr)
            blocked += time.perf_counter() - tp
        t_loop = time.perf_counter() - t
        n = wr.close()
        s = time.perf_counter() - t
        res["streamed"][v] = {"s": round(s, 3), "frames_per_s": round(n / s, 1), "decode_loop_s": round(t_loop, 3),
                              "blocked_in_put_s": round(blocked, 3), "close_s": round(s - t_loop, 3)}
        G.log(f"streamed {v}: {res['streamed'][v]}")
setv("default")
del pipe
torch.cuda.empty_cache()

# 4. the CLI in a child process, per --cli variant
m = G.random_wan21(False)
cfg = {k: v for k, v in dict(m.config).items() if not k.startswith("_")}
from safetensors.torch import save_file  # noqa: E402

model = tmp / "wan21_random.safetensors"
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in m.state_dict().items()}, str(model),
          metadata={"config": json.dumps(cfg)})
del m
lat = tmp / f"lat_T{T}.pt"
torch.save(z, lat)
runner = tmp / "cli_with_variant.py"
orig = subprocess.Popen
for v in [c for c in args.cli.split(",") if c]:
    tt, _, nthreads = v.partition("/")
    runner.write_text("import runpy, sys\nimport vaeopt.outputs as o\n"
                      f"o.MP4_THREAD_TYPE = {None if tt == 'default' else tt!r}\n"
                      f"o.MP4_THREADS = {int(nthreads) if nthreads else None!r}\nsys.argv[0] = 'vaeopt'\n"
                      "runpy.run_module('vaeopt', run_name='__main__')\n")

    def popen(cmd, *a, **k):  # cli_run starts [python, -m, vaeopt, ...]: start the wrapper that sets the variant
        if cmd[1:3] == ["-m", "vaeopt"]:
            cmd = [cmd[0], str(runner), *cmd[3:]]
        return orig(cmd, *a, **k)

    subprocess.Popen = popen
    try:
        rec = G.cli_run(f"T{T} {v}", lat, model, tmp / "out.mp4", [], frames_n, False)
    finally:
        subprocess.Popen = orig
    rec.pop("stderr_tail", None)
    res["cli"][v] = rec
    G.log(json.dumps({k: x for k, x in rec.items() if k not in ("stages", "cmd")})[:1200])
meta = run_meta("python3 benchmarks/gpu_stream_mp4.py " + " ".join(sys.argv[1:]))
(out_dir() / "stream_mp4.json").write_text(json.dumps({**meta, **res}, indent=1))
print(f"\n# {meta['gpu']}, {os.cpu_count()} CPUs: wan21 {frames_n} frames 480x832 to MP4 (libx264 crf 18)")
print(f"decode only (uint8 groups to the host, dropped): {statistics.median(res['decode_only_s']):.2f} s")
print(f"{'variant':10s} {'encode only s':>13s} {'streamed s':>10s} {'fps':>5s} {'blocked in put s':>16s} "
      f"{'close s':>7s} | {'CLI s':>6s} {'CLI fps':>7s} {'RSS MB':>6s} {'MP4 frames':>10s}")
for v in args.variants.split(","):
    e, b, c = res["encode_only"][v], res["streamed"][v], res["cli"].get(v, {})
    print(f"{v:10s} {e['s']:>13.2f} {b['s']:>10.2f} {b['frames_per_s']:>5.0f} {b['blocked_in_put_s']:>16.2f} "
          f"{b['close_s']:>7.2f} | {c.get('decode_write_s', float('nan')):>6.2f} {c.get('frames_per_s', float('nan')):>7.0f} "
          f"{c.get('rss_peak_mb_sampled', float('nan')):>6.0f} {str(c.get('mp4_decoded_frames', c.get('error', '')))[:40]:>10s}")
