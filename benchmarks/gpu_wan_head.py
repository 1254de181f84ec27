"""Wan decoder head and mid-block: conv_out (96 -> 3 ch) as kernels/tapconv's norm+GEMM + tap sum vs RMS norm +
cuDNN Conv3d, and the mid-block attention as chunked GEMM attention vs SDPA; per call and in whole decodes (the
pipeline's own path, planner chunk), with the error against fp32.

    python3 benchmarks/gpu_wan_head.py        -> $OUT/wan_head.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import event_ms, make_pipe, out_dir, run_meta  # noqa: E402

from vaeopt import video  # noqa: E402
from vaeopt.benchmark import WORKLOADS  # noqa: E402
from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.kernels import tapconv  # noqa: E402
from vaeopt.kernels.rms_norm_silu import rms_norm_silu  # noqa: E402
from vaeopt.engine.wan import ChunkDecoder  # noqa: E402

dev = "cuda"
res = {"per_call": [], "decodes": []}

# ---- per call: the head of one chunk (3 latent frames -> 12 output frames), bf16
for name, H, W in (("480p", 480, 832), ("720p", 720, 1280)):
    C, co, k, hist = 96, 3, 12, 2
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, C, k, H, W, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    gamma = (1 + 0.1 * torch.randn(C, generator=g)).to(dev)
    w = (torch.randn(co, C, 3, 3, 3, generator=g) / (27 * C) ** 0.5).to(dev, torch.bfloat16)
    b = torch.randn(co, generator=g).to(dev, torch.bfloat16) * 0.1
    histx = torch.randn(1, C, hist, H, W, generator=g).to(dev, torch.bfloat16)
    w3 = w.contiguous(memory_format=torch.channels_last_3d)
    buf = torch.empty(1, C, hist + k, H, W, device=dev, dtype=torch.bfloat16, memory_format=torch.channels_last_3d)
    buf[:, :, :hist].copy_(histx)
    scale = C ** 0.5

    def base():
        rms_norm_silu(x, gamma, None, 1e-12, True, scale=scale, out=buf[:, :, hist:])
        return F.conv3d(buf, w3, b, 1, (0, 1, 1))

    wt = tapconv.tap_weights(w, 128, torch.bfloat16)
    nt = 27 * co
    Y = torch.empty(1, nt, hist + k, H, W, device=dev, dtype=torch.bfloat16)
    Y[:, :, :hist] = torch.einsum("nctHW,cj->njtHW", histx.float(), wt[:C, :nt].float()).to(torch.bfloat16)
    out = torch.empty(1, co, k, H, W, device=dev, dtype=torch.bfloat16, memory_format=torch.channels_last_3d)

    def taps():
        tapconv.rms_norm_taps(x, gamma, None, 1e-12, scale, wt, nt, Y, hist)
        return tapconv.tap_sum(Y, co, (3, 3, 3), b, out)

    base()  # (fills buf's new frames: the reference convolves the same normalized input in fp32)
    ref = F.conv3d(torch.cat([histx.float(), buf[:, :, hist:].float()], 2), w.float(), b.float(), 1, (0, 1, 1))
    r = {"shape": name, "frames": k}
    for label, fn in (("norm+cudnn", base), ("taps", taps)):
        r[f"ms_{label}"] = event_ms(fn, 10, warmup=2)
        y = fn().float()
        r[f"maxerr_{label}"] = (y - ref).abs().max().item()
        r[f"relerr_{label}"] = ((y - ref).norm() / ref.norm()).item()
    r["ms_norm_only"] = event_ms(lambda: rms_norm_silu(x, gamma, None, 1e-12, True, scale=scale, out=buf[:, :, hist:]),
                                 10, warmup=2)
    r["ms_gemm_only"] = event_ms(lambda: tapconv.rms_norm_taps(x, gamma, None, 1e-12, scale, wt, nt, Y, hist), 10, 2)
    res["per_call"].append(r)
    print(r, flush=True)
    del x, buf, Y, out, histx, ref
    torch.cuda.empty_cache()

# ---- whole decodes through the pipeline's path (OOM-retry runner, planner's chunk)
orig_attn = ChunkDecoder._attn_fusable
for wl in ("wan21-480p", "wan21-720p"):
    fam, shape = WORKLOADS[wl]
    pipe = make_pipe(fam)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)
    plan = pipe.plan(shape)
    outs = {}
    with torch.inference_mode():
        for label, taps_on, attn_on in (("taps+chunked_attn", True, True), ("conv3d+chunked_attn", False, True),
                                        ("taps+sdpa", True, False)):
            ChunkDecoder.TAPS = taps_on
            ChunkDecoder._attn_fusable = orig_attn if attn_on else (lambda self, blk, x: False)
            ms = event_ms(lambda: pipe._decode_video(z, plan, None), 3, warmup=1)
            outs[label] = pipe._decode_video(z, plan, None).float()
            row = {"workload": wl, "variant": label, "chunk": plan.chunk, "ms": ms}
            if label != "conv3d+chunked_attn" and "conv3d+chunked_attn" in outs:
                row["psnr_vs_conv3d"] = psnr(outs[label], outs["conv3d+chunked_attn"])
            res["decodes"].append(row)
            print(row, flush=True)
    ChunkDecoder.TAPS = True
    ChunkDecoder._attn_fusable = orig_attn
    del pipe, z, outs
    torch.cuda.empty_cache()

meta = run_meta("python3 benchmarks/gpu_wan_head.py")
(out_dir() / "wan_head.json").write_text(json.dumps({**meta, **res}, indent=1))
print(f"\n# {meta['gpu']}")
for r in res["per_call"]:
    print(f"head {r['shape']} 12 frames: norm+cuDNN {r['ms_norm+cudnn']:.2f} ms (rel err {r['relerr_norm+cudnn']:.1e}), "
          f"taps {r['ms_taps']:.2f} ms ({r['relerr_taps']:.1e}); norm alone {r['ms_norm_only']:.2f}, "
          f"norm+GEMM {r['ms_gemm_only']:.2f}")
for r in res["decodes"]:
    print(f"{r['workload']:11s} {r['variant']:22s} chunk {r['chunk']}: {r['ms']:7.1f} ms"
          + (f"  ({r['psnr_vs_conv3d']:.1f} dB vs conv3d)" if "psnr_vs_conv3d" in r else ""))
