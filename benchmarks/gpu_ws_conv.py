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
from _common import graph_rounds, out_dir, run_meta  # noqa: E402

from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.kernels import conv as K  # noqa: E402
from vaeopt.kernels import tma_conv, ws_conv  # noqa: E402

SHIPPED = "triton"  # 96 ch: the Triton TMA kernel; 192 ch: cuDNN's Conv3d
ap = argparse.ArgumentParser()
ap.add_argument("--variants", default=None, help="default: a sweep for --channels")
ap.add_argument("--channels", type=int, default=96, help="96: 480x832 (vs the Triton TMA kernel); 192: 240x416 "
                                                        "(vs cuDNN's Conv3d, what those layers run on)")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--decode-rounds", type=int, default=0)
ap.add_argument("--decode-ab-192", type=int, default=0, help="rounds of whole wan21-480p decodes: a pipeline built "
                "without the 192-ch config (those layers on cuDNN's Conv3d) against the default one")
args = ap.parse_args()
C = args.channels
T, H, W = (12, 480, 832) if C == 96 else (12, 240, 416)
if args.variants is None:
    args.variants = (";stages=6;bh=2,bw=128;bh=8,bw=32;stages=7" if C == 96 else
                     "bh=2,bw=64,bn0=128,bn1=64;bh=2,bw=64,bn0=128,bn1=64,stages=4;bh=2,bw=64,bn0=128,bn1=64,bk=64,stages=3;"
                     "bh=1,bw=128,bn0=128,bn1=64;bh=2,bw=64,bn0=128,bn1=64,stages=8")
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
        if C == 96:
            y = tma_conv.conv_tma(x, pwk, bias, (1, 1), config=tma_conv.BF16_WAN96)  # (1, C, T, H, W) cl_3d
        else:
            y = F.conv3d(x, w, bias, 1, (0, 1, 1))
        return y.permute(0, 2, 3, 4, 1).reshape(T, H, W, C)
    return ws_conv.conv(x, pwk.w, bias, cfg(spec))


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
graph_rounds(call, ok, args.rounds, res, flop)
del ref, base

decode = None
cands = sorted((s for s in ok if s != SHIPPED), key=lambda s: res[s]["median_ms"])
if args.decode_rounds and cands and C == 96:
    from _common import wan480_ab

    settings = [SHIPPED, cands[0]]
    base_cfgs = dict(ws_conv.CONFIGS)

    def apply(s):  # conv_igemm routes these layers to ws_conv while it is ENABLED, with ws_conv.CONFIGS[C]
        ws_conv.ENABLED = s != SHIPPED
        ws_conv.CONFIGS.update(base_cfgs)
        if s != SHIPPED:
            ws_conv.CONFIGS[C] = cfg(s)

    chunk, outs, ms = wan480_ab(settings, args.decode_rounds, apply)
    decode = {"workload": "wan21-480p", "chunk": chunk, "rounds": args.decode_rounds,
              "settings": {s: {"ms": ms[s], "median_ms": statistics.median(ms[s]),
                               "psnr_vs_shipped_db": psnr(outs[s], outs[SHIPPED])} for s in settings}}

ab192 = None
if args.decode_ab_192 and C == 96:
    from _common import interleaved_ms, make_pipe

    from vaeopt.benchmark import WORKLOADS

    fam, shape = WORKLOADS["wan21-480p"]
    saved = ws_conv.CONFIGS.pop(192)
    pipes = {"192 on cuDNN": make_pipe(fam)}  # the stage leaves the 192-ch convs to cuDNN without a config
    ws_conv.CONFIGS[192] = saved
    pipes["192 on ws_conv"] = make_pipe(fam)
    lines = {k: next(s_.line() for s_ in p.stages if s_.name == "triton_conv") for k, p in pipes.items()}
    plan = pipes["192 on ws_conv"].plan(shape)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    cur = {}
    with torch.inference_mode():
        outs = {k: p._decode_video(z, plan, None).float().clamp(-1, 1).cpu() for k, p in pipes.items()}
        ms = interleaved_ms(lambda: cur["p"]._decode_video(z, plan, None), list(pipes), args.decode_ab_192,
                            lambda k: cur.update(p=pipes[k]))
    ab192 = {"workload": "wan21-480p", "chunk": plan.chunk, "rounds": args.decode_ab_192,
             "settings": {k: {"ms": ms[k], "median_ms": statistics.median(ms[k]), "triton_conv": lines[k],
                              "psnr_vs_192_on_cudnn_db": psnr(outs[k], outs["192 on cuDNN"])} for k in pipes}}

meta = run_meta("python3 benchmarks/gpu_ws_conv.py " + " ".join(sys.argv[1:]))
(out_dir() / f"ws_conv{'' if C == 96 else C}.json").write_text(json.dumps({**meta, "shape": [1, C, T + 2, H, W], "flop": flop,
                                                    "variants": res, "decode": decode, "decode_ab_192": ab192}, indent=1))
print(f"\n# {meta['gpu']}: {C} -> {C} causal Conv3d, {T} frames at {H}x{W}, bf16; graph replays, {args.rounds} rounds")
print(f"{'variant':40s} {'ms':>7s} {'TFLOP/s':>8s} {'err':>8s} {'vs triton':>10s}")
for s in specs:
    r = res[s]
    name = s or "default (bh4 bw64 bk32 s6 w8)"
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
if ab192:
    print(f"\nwan21-480p decodes, chunk {ab192['chunk']}, {args.decode_ab_192} interleaved rounds")
    for k, d in ab192["settings"].items():
        print(f"  {k:40s} {d['median_ms']:7.1f} ms ({min(d['ms']):.1f}-{max(d['ms']):.1f}) "
              f"{d['psnr_vs_192_on_cudnn_db']:.1f} dB vs 192 on cuDNN")
