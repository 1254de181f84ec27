"""Does cuDNN's heuristic pick a better kernel for Wan's 96-channel convs with another dtype or frame count?
(E23; E19 found the time-stacked conv on tile 128x128x64 where 128x128x32, found only by timing every config, is
7% faster.)

    python3 benchmarks/gpu_conv_heur.py   # -> $OUT/conv_heur.json

Per (size, frames per call, dtype): the time-stacked Conv2d (N frames, 288 ch in, 96 out, 3x3) and the causal
Conv3d it replaces (96 ch, N + 2 input frames, 3x3x3), channels_last(_3d), heuristic choice (benchmark off):
CUDA-event median per call and per output frame, TFLOP/s, and the cuDNN kernel name from the profiler.
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import event_ms, no_tf32, out_dir, run_meta  # noqa: E402

no_tf32()
torch.backends.cudnn.benchmark = False
dev = torch.device("cuda")


def kernel_name(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in p.events() if e.device_type.name == "CUDA" and "elementwise" not in e.name
             and "Memset" not in e.name]
    return names[0][:110] if names else ""


rows = []
for size, (H, W) in (("480p", (480, 832)), ("720p", (720, 1280))):
    for n in (4, 8, 12, 16):
        if size == "720p" and n > 12:
            continue
        for dt in (torch.bfloat16, torch.float16):
            g = torch.Generator().manual_seed(0)
            w3 = (torch.randn(96, 96, 3, 3, 3, generator=g) / (27 * 96) ** 0.5).to(dev, dt)
            w2 = w3.permute(0, 2, 1, 3, 4).reshape(96, 288, 3, 3).contiguous(memory_format=torch.channels_last)
            s = torch.randn(n, 288, H, W, generator=g).to(dev, dt).contiguous(memory_format=torch.channels_last)
            x3 = torch.randn(1, 96, n + 2, H, W, generator=g).to(dev, dt).contiguous(
                memory_format=torch.channels_last_3d)
            flops = 2 * n * H * W * 96 * 288 * 9
            st = lambda: F.conv2d(s, w2, None, 1, 1)  # noqa: E731
            c3 = lambda: F.conv3d(x3, w3, None, 1, (0, 1, 1))  # noqa: E731
            r = {"size": size, "frames": n, "dtype": str(dt).split(".")[-1]}
            r["stacked_ms"] = event_ms(st, 10)
            r["stacked_ms_per_frame"] = r["stacked_ms"] / n
            r["stacked_tflops"] = flops / r["stacked_ms"] / 1e9
            r["stacked_kernel"] = kernel_name(st)
            r["conv3d_ms"] = event_ms(c3, 10)
            r["conv3d_tflops"] = flops / r["conv3d_ms"] / 1e9
            r["conv3d_kernel"] = kernel_name(c3)
            rows.append(r)
            print(r, flush=True)
            del s, x3
            torch.cuda.empty_cache()

res = {"rows": rows, **run_meta("python3 benchmarks/gpu_conv_heur.py")}
(out_dir() / "conv_heur.json").write_text(json.dumps(res, indent=1))
print("\n| size | frames | dtype | stacked ms/frame | TFLOP/s | kernel | Conv3d TFLOP/s | Conv3d kernel |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['size']} | {r['frames']} | {r['dtype']} | {r['stacked_ms_per_frame']:.3f} | {r['stacked_tflops']:.0f} | "
          f"{r['stacked_kernel'][30:95]} | {r['conv3d_tflops']:.0f} | {r['conv3d_kernel'][:40]} |")
