"""Wan 2.1 with the time-stacked Conv2d (stages/stacked_conv3d): chunk size, 192-channel convs, conv_out.

    python3 benchmarks/gpu_wan_stack.py           # GPU machine, ~3 min; writes $OUT/wan_stack.json

1. Whole decodes (random N(0, 0.02) weights, every default stage, bf16), wan21-480p and -720p, latent frames per
   decoder call K = 1..4: CUDA-event median of 3 decodes, peak allocated bytes.
2. Per call at 8 output frames (+2 history): the 192-channel conv as cuDNN Conv3d vs stacked Conv2d; conv_out
   (96 -> 3 channels) as cuDNN Conv3d, stacked Conv2d, and stacked Conv2d with Cout zero-padded to 8 / 16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import triton  # noqa: E402

from _common import event_ms, make_pipe, out_dir, run_meta  # noqa: E402
from vaeopt import video  # noqa: E402
from vaeopt.benchmark import WORKLOADS  # noqa: E402

OUT = out_dir()
dev = torch.device("cuda")
res: dict = {"decodes": [], "calls": []}

for wl in ("wan21-480p", "wan21-720p"):
    fam, shape = WORKLOADS[wl]
    pipe = make_pipe(fam)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    with torch.inference_mode():
        for K in (1, 2, 3, 4):
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                ms = event_ms(lambda: video.decode_video(pipe.model, z, chunk=K), reps=3, warmup=1)
                peak = torch.cuda.max_memory_allocated()
                est = video.estimate_chunk_bytes(pipe.model, shape, K, torch.bfloat16, True, True)
                res["decodes"].append({"workload": wl, "K": K, "ms": ms, "peak_gib": peak / 2**30,
                                       "est_chunk_gib": est / 2**30})
            except torch.cuda.OutOfMemoryError as e:
                res["decodes"].append({"workload": wl, "K": K, "error": str(e)[:200]})
    res.setdefault("stages", {})[wl] = [s.line() for s in pipe.stages]
    del pipe
    torch.cuda.empty_cache()


def stack_input(x, T):
    """(1, C, T+2, H, W) NDHWC -> (T, 3C, H, W) channels_last, frame t = [x(t), x(t+1), x(t+2)]."""
    c = x.shape[1]
    xf = x[0].permute(1, 2, 3, 0)
    xs = torch.empty((T, *xf.shape[1:3], 3 * c), device=x.device, dtype=x.dtype)
    for dt in range(3):
        xs[..., dt * c : (dt + 1) * c].copy_(xf[dt : dt + T])
    return xs.permute(0, 3, 1, 2)


T = 8
for name, ci, co, H, W in (("192@240x416", 192, 192, 240, 416), ("conv_out 96->3 @480x832", 96, 3, 480, 832)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, ci, T + 2, H, W, generator=g).to(dev, torch.bfloat16).contiguous(
        memory_format=torch.channels_last_3d)
    w = (torch.randn(co, ci, 3, 3, 3, generator=g) / (27 * ci) ** 0.5).to(dev, torch.bfloat16)
    w3 = w.contiguous(memory_format=torch.channels_last_3d)
    ref = F.conv3d(x.float(), w.float(), None, 1, (0, 1, 1))
    xs = stack_input(x, T)
    ws = w.permute(0, 2, 1, 3, 4).reshape(co, 3 * ci, 3, 3).contiguous(memory_format=torch.channels_last)
    r = {"shape": name, "frames": T, "ms_conv3d": event_ms(lambda: F.conv3d(x, w3, None, 1, (0, 1, 1))),
         "ms_stack2d": event_ms(lambda: F.conv2d(xs, ws, None, 1, 1))}
    y = F.conv2d(xs, ws, None, 1, 1)
    r["err_stack2d"] = ((y.permute(1, 0, 2, 3).unsqueeze(0).float() - ref).abs().max() / ref.abs().max()).item()
    if co < 16:
        for cp in (8, 16):
            wp = torch.zeros(cp, 3 * ci, 3, 3, device=dev, dtype=ws.dtype).contiguous(memory_format=torch.channels_last)
            wp[:co] = ws
            r[f"ms_stack2d_pad{cp}"] = event_ms(lambda: F.conv2d(xs, wp, None, 1, 1))
    res["calls"].append(r)
    del x, xs, ref, y
    torch.cuda.empty_cache()

res.update(run_meta("python3 benchmarks/gpu_wan_stack.py"))
(OUT / "wan_stack.json").write_text(json.dumps(res, indent=1))
print(f"\n# {res['gpu']} | torch {torch.__version__} | triton {triton.__version__} | cuDNN {res['versions']['cudnn']}")
for d in res["decodes"]:
    print(f"{d['workload']:11s} K={d['K']}: " + (f"{d['ms']:8.1f} ms  peak {d['peak_gib']:.2f} GiB (est. chunk "
                                                  f"{d['est_chunk_gib']:.2f})" if "ms" in d else d["error"]))
for r in res["calls"]:
    print(r)
