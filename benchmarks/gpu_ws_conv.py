"""Wan 2.1's bf16 96 -> 96 causal Conv3d (480x832, 12 output frames): the warp-specialized Gluon kernel
(`kernels/ws_conv.py`) against the shipped Triton TMA kernel (tma_conv.BF16_WAN96), perf-notes E42.

    python3 benchmarks/gpu_ws_conv.py [--variants V1;V2] [--rounds 5] [--decode-rounds 6]   -> $OUT/ws_conv.json

A variant is "key=value,..." over ws_conv.WsConfig fields (empty: the defaults). Per call: CUDA-graph replays (10
calls per graph), the median of `rounds` interleaved rounds, the max error relative to an fp32 F.conv3d, and the
max abs difference from the Triton TMA kernel's output ("shipped": the kernel these layers ran on before E42).
--decode-rounds: whole wan21-480p decodes through the pipeline, the Triton kernel (ws_conv.ENABLED off) against the
fastest variant (conv_igemm routes these layers to ws_conv), interleaved, with the PSNR of the output against the
Triton kernel's.
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
from _common import graph_ms, out_dir, run_meta  # noqa: E402

from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.kernels import conv as K  # noqa: E402
from vaeopt.kernels import tma_conv, ws_conv  # noqa: E402

SHIPPED = "triton"
ap = argparse.ArgumentParser()
ap.add_argument("--variants", default=";stages=6;bh=2,bw=128;bh=8,bw=32;stages=7")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--decode-rounds", type=int, default=0)
args = ap.parse_args()
T, C, H, W = 12, 96, 480, 832
g = torch.Generator().manual_seed(0)
x = torch.randn(1, C, T + 2, H, W, generator=g).to("cuda", torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
w = (torch.randn(C, C, 3, 3, 3, generator=g) / (27 * C) ** 0.5).to("cuda", torch.bfloat16)
bias = (torch.randn(C, generator=g) * 0.1).to("cuda", torch.bfloat16)
pwk = K.pack_weight(w, kmajor=True)


def cfg(spec: str) -> ws_conv.WsConfig:
    kv = dict(p.split("=") for p in spec.split(",")) if spec else {}
    return ws_conv.WsConfig(**{k: int(v) for k, v in kv.items()})


def call(spec: str) -> torch.Tensor:
    if spec == SHIPPED:
        y = tma_conv.conv_tma(x, pwk, bias, (1, 1), config=tma_conv.BF16_WAN96)  # (1, C, T, H, W) channels_last_3d
        return y.permute(0, 2, 3, 4, 1).reshape(T, H, W, C)
    return ws_conv.conv96(x, pwk.w, bias, cfg(spec))


specs = [SHIPPED] + args.variants.split(";")
ref = F.conv3d(x.float(), w.float(), bias.float(), 1, (0, 1, 1)).permute(0, 2, 3, 4, 1).reshape(T, H, W, C)
flop = 2 * T * H * W * C * C * 27
res, base = {}, None
for s in specs:
    try:
        y = call(s)
        torch.cuda.synchronize()
        r = {"err_rel": ((y.float() - ref).abs().max() / ref.abs().max()).item(), "ms": []}
        if s == SHIPPED:
            base = y
        else:
            r["max_abs_vs_shipped"] = (y.float() - base.float()).abs().max().item()
            r["equal_shipped"] = bool(torch.equal(y, base))
        res[s] = r
    except Exception as e:  # noqa: BLE001
        res[s] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    print(s or "default", res[s], flush=True)
ok = [s for s in specs if "error" not in res[s] and res[s]["err_rel"] < 2e-2]
for i in range(args.rounds):
    for s in (ok if i % 2 == 0 else ok[::-1]):
        res[s]["ms"].append(graph_ms(lambda s=s: call(s), n=10, reps=10))
for s in ok:
    res[s]["median_ms"] = statistics.median(res[s]["ms"])
    res[s]["tflops"] = flop / res[s]["median_ms"] / 1e9
del ref, base

decode = None
cands = sorted((s for s in ok if s != SHIPPED), key=lambda s: res[s]["median_ms"])
if args.decode_rounds and cands:
    from _common import interleaved_ms, make_pipe

    from vaeopt.benchmark import WORKLOADS

    fam, shape = WORKLOADS["wan21-480p"]
    pipe = make_pipe(fam)
    plan = pipe.plan(shape)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    settings = [SHIPPED, cands[0]]

    def apply(s):  # conv_igemm routes these layers to ws_conv while it is ENABLED, with ws_conv.CONFIG
        ws_conv.ENABLED = s != SHIPPED
        if s != SHIPPED:
            ws_conv.CONFIG = cfg(s)

    outs = {}
    with torch.inference_mode():
        for s in settings:
            apply(s)
            outs[s] = pipe._decode_video(z, plan, None).float().clamp(-1, 1).cpu()
        ms = interleaved_ms(lambda: pipe._decode_video(z, plan, None), settings, args.decode_rounds, apply)
    decode = {"workload": "wan21-480p", "chunk": plan.chunk, "rounds": args.decode_rounds,
              "settings": {s: {"ms": ms[s], "median_ms": statistics.median(ms[s]),
                               "psnr_vs_shipped_db": psnr(outs[s], outs[SHIPPED])} for s in settings}}

meta = run_meta("python3 benchmarks/gpu_ws_conv.py " + " ".join(sys.argv[1:]))
(out_dir() / "ws_conv.json").write_text(json.dumps({**meta, "shape": [1, C, T + 2, H, W], "flop": flop,
                                                    "variants": res, "decode": decode}, indent=1))
print(f"\n# {meta['gpu']}: 96 -> 96 causal Conv3d, 12 frames at 480x832, bf16; graph replays, {args.rounds} rounds")
print(f"{'variant':40s} {'ms':>7s} {'TFLOP/s':>8s} {'err':>8s} {'vs triton':>10s}")
for s in specs:
    r = res[s]
    name = s or "default (bh4 bw64 bk32 s8 w8)"
    if "error" in r or "median_ms" not in r:
        print(f"{name:40s} {r.get('error', 'wrong: err %.1e' % r.get('err_rel', 0))[:80]}")
    else:
        d = "" if s == SHIPPED else f"{r['max_abs_vs_shipped']:.1e}"
        print(f"{name:40s} {r['median_ms']:>7.3f} {r['tflops']:>8.0f} {r['err_rel']:>8.1e} {d:>10s}")
if decode:
    print(f"\nwan21-480p decodes, chunk {decode['chunk']}, {args.decode_rounds} interleaved rounds")
    for s, d in decode["settings"].items():
        print(f"  {s or 'default':40s} {d['median_ms']:7.1f} ms ({min(d['ms']):.1f}-{max(d['ms']):.1f}) "
              f"{d['psnr_vs_shipped_db']:.1f} dB vs triton")
