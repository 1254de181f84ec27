"""Wan 2.1's bf16 96 -> 96 causal Conv3d (480x832, 12 output frames) on the TMA kernel: tiles with the 96 output
channels as one padded 128-wide accumulator against the shipped 64 + 32 split, 4 / 8 warps (perf-notes E31).

    python3 benchmarks/gpu_tma_wan96.py [--tiles T1;T2;...] [--decode-rounds 8]      -> $OUT/tma_wan96.json
    ncu --set full --profile-from-start off -k regex:_tma_conv_kernel python3 benchmarks/gpu_tma_wan96.py --ncu T1;T2

A tile is "bh,bw,bk,bn0,bn1,warps,stages,bk1" (tma_conv.TmaConfig). Per call: CUDA-graph replays (10 calls per graph),
the median of `rounds` interleaved rounds, and the max error relative to an fp32 F.conv3d. --decode-rounds: whole
wan21-480p decodes through the pipeline's path with tma_conv.BF16_WAN96 set to each tile (looked up per call),
interleaved, with the PSNR of each against the shipped tile's output (vaeopt.fidelity.psnr: identical outputs read
200 dB; the committed E31 run, from a local copy of it, wrote 99.0). --ncu: one call per tile after a warm-up,
between cudaProfilerStart/Stop, for Nsight Compute.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graph_rounds, out_dir, run_meta  # noqa: E402

from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.kernels import conv as K  # noqa: E402
from vaeopt.kernels import tma_conv, ws_conv  # noqa: E402

ws_conv.ENABLED = False  # the Triton kernel's tiles are what this script compares (E42's Gluon kernel would take over)

SHIPPED = "2,64,64,64,32,4,3,32"
ap = argparse.ArgumentParser()
ap.add_argument("--tiles", default=f"{SHIPPED};2,64,64,128,0,4,3,32;2,64,64,128,0,8,3,32;2,64,64,64,32,8,3,32;"
                                    "1,128,64,128,0,4,3,32;2,64,64,128,0,4,4,32;4,64,64,128,0,8,3,32")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--decode-rounds", type=int, default=0)
ap.add_argument("--ncu", default=None, help="tiles to run once each for ncu")
args = ap.parse_args()
T, C, H, W = 12, 96, 480, 832
g = torch.Generator().manual_seed(0)
x = torch.randn(1, C, T + 2, H, W, generator=g).to("cuda", torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
w = (torch.randn(C, C, 3, 3, 3, generator=g) / (27 * C) ** 0.5).to("cuda", torch.bfloat16)
pwk = K.pack_weight(w, kmajor=True)


def cfg(spec):
    return tma_conv.TmaConfig(*map(int, spec.split(",")))


def call(spec):
    return tma_conv.conv_tma(x, pwk, None, (1, 1), config=cfg(spec))


if args.ncu:
    specs = args.ncu.split(";")
    for s in specs:
        call(s)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for s in specs:
        call(s)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    sys.exit(0)

specs = args.tiles.split(";")
ref = F.conv3d(x.float(), w.float(), None, 1, (0, 1, 1))
flop = 2 * T * H * W * C * C * 27
res = {}
for s in specs:
    try:
        y = call(s)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        res[s] = {"err_rel": err, "ms": []}
    except Exception as e:  # noqa: BLE001
        res[s] = {"error": str(e)[:300]}
        print(f"{s}: {res[s]['error']}", flush=True)
ok = [s for s in specs if "error" not in res[s]]
graph_rounds(call, ok, args.rounds, res, flop)
del ref
decode = None
if args.decode_rounds:
    from _common import wan480_ab

    best = sorted((s for s in ok if s != SHIPPED), key=lambda s: res[s]["median_ms"])[:2]
    settings = [SHIPPED] + best

    def apply(s):
        tma_conv.BF16_WAN96 = cfg(s)

    chunk, outs, ms = wan480_ab(settings, args.decode_rounds, apply)
    apply(SHIPPED)
    decode = {"workload": "wan21-480p", "chunk": chunk, "rounds": args.decode_rounds,
              "tiles": {s: {"ms": ms[s], "median_ms": statistics.median(ms[s]),
                            "psnr_vs_shipped_db": psnr(outs[s], outs[SHIPPED])} for s in settings}}
meta = run_meta("python3 benchmarks/gpu_tma_wan96.py " + " ".join(sys.argv[1:]))
(out_dir() / "tma_wan96.json").write_text(json.dumps({**meta, "shape": [1, C, T + 2, H, W], "flop": flop,
                                                      "tiles": res, "decode": decode}, indent=1))
print(f"\n# {meta['gpu']}: 96 -> 96 causal Conv3d, 12 frames at 480x832, bf16; graph replays")
print(f"{'tile (bh,bw,bk,bn0,bn1,warps,stages,bk1)':42s} {'ms':>7s} {'TFLOP/s':>8s} {'err':>8s}")
for s in specs:
    r = res[s]
    if "error" in r:
        print(f"{s:42s} error")
    else:
        print(f"{s:42s} {r['median_ms']:>7.3f} {r['tflops']:>8.0f} {r['err_rel']:>8.1e}")
if decode:
    print(f"\nwan21-480p decodes, chunk {decode['chunk']}, {args.decode_rounds} interleaved rounds")
    for s, d in decode["tiles"].items():
        print(f"  {s:40s} {d['median_ms']:7.1f} ms ({min(d['ms']):.1f}-{max(d['ms']):.1f}) "
              f"{d['psnr_vs_shipped_db']:.1f} dB vs shipped")
