"""Wan's 96- and 192-channel convs split along Cout into cuDNN calls of 64/128 output channels, per call.

    python3 benchmarks/gpu_cout_split.py   -> $OUT/cout_split.json

Why: in a wan21-480p decode (`gpu_conv_shapes.py`, H200) the time-stacked 96-ch Conv2d runs at 493-527 TFLOP/s and
the 192-ch Conv3d at 597-626, against 770-784 for the 384-ch layers. cuDNN's sm90 kernels have 128-wide N tiles, so
Cout = 96 fills 75% of one and 192 fills 75% of two. Cout = 128 + 64 (or 64 + 32) as two calls wastes no N but reads
the input twice; if the narrow call runs near the wide one's rate, the pair is faster.

Each row: one cuDNN call per Cout part, graph-timed (GPU time only), the kernel cuDNN picked, and the split's sum
against the whole conv. Outputs are checked: the parts equal the whole conv's channel slices (same kernel math per
output element is not guaranteed, so the max abs difference is reported, not asserted).
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graph_ms, out_dir, run_meta  # noqa: E402

OUT = out_dir()
dev = torch.device("cuda")
torch.backends.cudnn.benchmark = False
g = torch.Generator(device="cuda").manual_seed(0)


def kernel_name(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ks = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    k = max(ks, key=lambda e: e.device_time_total) if ks else None
    return "" if k is None else k.name[:140]


# (name, input shape, channels_last kind, Cout whole, splits, kernel spatial)
ROWS = [
    ("wan480-96-stacked", (12, 288, 480, 832), torch.channels_last, 96, ((64, 32), (32, 32, 32)), (3, 3)),
    ("wan480-96-stacked-9f", (9, 288, 480, 832), torch.channels_last, 96, ((64, 32),), (3, 3)),
    ("wan480-192-conv3d", (1, 192, 14, 240, 416), torch.channels_last_3d, 192, ((128, 64), (64, 64, 64)), (3, 3, 3)),
    ("wan480-192-stacked", (12, 576, 240, 416), torch.channels_last, 192, ((128, 64),), (3, 3)),
    ("wan720-96-stacked", (12, 288, 720, 1280), torch.channels_last, 96, ((64, 32),), (3, 3)),
    ("wan720-192-conv3d", (1, 192, 14, 360, 640), torch.channels_last_3d, 192, ((128, 64),), (3, 3, 3)),
]
res = {"rows": []}
lines = []
with torch.inference_mode():
    for name, shp, fmt, cout, splits, ks in ROWS:
        x = torch.randn(shp, device=dev, generator=g, dtype=torch.bfloat16).contiguous(memory_format=fmt)
        cin = shp[1]
        conv = F.conv3d if len(ks) == 3 else F.conv2d
        pad = (0, 1, 1) if len(ks) == 3 else (1, 1)
        w = (torch.randn((cout, cin) + ks, device=dev, generator=g) * 0.02).to(torch.bfloat16).contiguous(
            memory_format=fmt)
        n_out = x.shape[0] * cout * (x.shape[2] - 2 if len(ks) == 3 else 1) * x.shape[-2] * x.shape[-1]
        flop = 2 * n_out * cin * torch.tensor(ks).prod().item()
        row = {"name": name, "input": list(shp), "cout": cout, "tflop": flop / 1e12}
        whole = lambda w=w: conv(x, w, padding=pad)  # noqa: E731
        ref = whole()
        row["whole_ms"] = graph_ms(whole, n=5, reps=10)
        row["whole_kernel"] = kernel_name(whole)
        row["whole_tflops"] = flop / row["whole_ms"] / 1e9
        for co in sorted({c for s in splits for c in s} | {128 if cout == 96 else 256}):
            wp = (torch.randn((co, cin) + ks, device=dev, generator=g) * 0.02).to(torch.bfloat16).contiguous(
                memory_format=fmt)
            f = lambda wp=wp: conv(x, wp, padding=pad)  # noqa: E731
            ms = graph_ms(f, n=5, reps=10)
            row[f"cout{co}_ms"] = ms
            row[f"cout{co}_kernel"] = kernel_name(f)
            row[f"cout{co}_tflops"] = flop * co / cout / ms / 1e9
        for s in splits:
            parts = torch.split(w, list(s), dim=0)
            parts = [p.contiguous(memory_format=fmt) for p in parts]
            fs = lambda parts=parts: [conv(x, p, padding=pad) for p in parts]  # noqa: E731
            ys = fs()
            err = max((y.float() - r.float()).abs().max().item()
                      for y, r in zip(ys, torch.split(ref, list(s), dim=1)))
            key = "+".join(map(str, s))
            row[f"split{key}_ms"] = graph_ms(fs, n=5, reps=10)
            row[f"split{key}_max_abs_diff"] = err
            lines.append(f"{name:22s} whole {row['whole_ms']:.3f} ms ({row['whole_tflops']:.0f} TF/s) | split {key}: "
                         f"{row[f'split{key}_ms']:.3f} ms ({flop / row[f'split{key}_ms'] / 1e9:.0f} TF/s), "
                         f"diff {err:.1e}")
            del ys
        lines.append("    " + ", ".join(f"cout{co} {row[f'cout{co}_ms']:.3f} ms ({row[f'cout{co}_tflops']:.0f})"
                                       for co in sorted(int(k[4:-3]) for k in row if k.startswith("cout")
                                                        and k.endswith("_ms"))))
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        del w, ref
        torch.cuda.empty_cache()
res.update(run_meta("python3 benchmarks/gpu_cout_split.py"))
json.dump(res, open(OUT / "cout_split.json", "w"), indent=1)
print(f"\n# {res['gpu']} | torch {torch.__version__} | cuDNN {torch.backends.cudnn.version()}")
print("\n".join(lines))
