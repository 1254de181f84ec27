"""Does cuDNN's kernel choice for the time-stacked Conv2d depend on the batch (frames per call)? Times F.conv2d on
(F, 3C, H, W) channels_last stacks for several frame counts, the same work split into calls of <= g frames, and
names the conv kernels (torch.profiler).

    python3 benchmarks/gpu_stack_split.py     -> $OUT/stack_split.json
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import event_ms, out_dir, run_meta  # noqa: E402


def kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    names = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            names[e.name[:70]] = names.get(e.name[:70], 0) + e.device_time / 1e3
    return sorted(names.items(), key=lambda kv: -kv[1])[:3]


rows = []
dev = "cuda"
for C, H, W in ((96, 480, 832), (96, 720, 1280), (384, 120, 208), (384, 180, 320)):
    w = (torch.randn(C, 3 * C, 3, 3, device=dev) / (27 * C) ** 0.5).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    for Fr in (4, 8, 12):
        x = torch.randn(Fr, 3 * C, H, W, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        fl = 2 * Fr * H * W * C * 3 * C * 9
        r = {"C": C, "H": H, "W": W, "frames": Fr, "in_bytes": x.numel() * 2}
        r["ms_one"] = event_ms(lambda: F.conv2d(x, w, None, 1, 1), 5, warmup=1)
        r["kernels_one"] = kernels(lambda: F.conv2d(x, w, None, 1, 1))
        for g in (2, 4):
            if g >= Fr:
                continue
            y = torch.empty((Fr, C, H, W), device=dev, dtype=x.dtype, memory_format=torch.channels_last)

            def split(g=g, y=y):
                for i in range(0, Fr, g):
                    y[i:i + g].copy_(F.conv2d(x[i:i + g], w, None, 1, 1))

            r[f"ms_split{g}"] = event_ms(split, 5, warmup=1)
            r[f"ms_split{g}_nocopy"] = event_ms(lambda g=g: [F.conv2d(x[i:i + g], w, None, 1, 1)
                                                             for i in range(0, Fr, g)], 5, warmup=1)
            if g == 4:
                r["kernels_split4"] = kernels(split)
        r["tflops_one"] = fl / r["ms_one"] / 1e9
        rows.append(r)
        print(r, flush=True)
        del x
        torch.cuda.empty_cache()

meta = run_meta("python3 benchmarks/gpu_stack_split.py")
(out_dir() / "stack_split.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
print(f"\n# {meta['gpu']}")
print(f"{'C':>4s} {'HxW':>9s} {'F':>3s} {'GB in':>6s} {'one':>8s} {'split2':>8s} {'split4':>8s} {'s4 nocp':>8s}  kernel (one)")
for r in rows:
    print(f"{r['C']:4d} {r['H']}x{r['W']:<5d} {r['frames']:3d} {r['in_bytes'] / 1e9:6.2f} {r['ms_one']:8.2f} "
          f"{r.get('ms_split2', float('nan')):8.2f} {r.get('ms_split4', float('nan')):8.2f} "
          f"{r.get('ms_split4_nocopy', float('nan')):8.2f}  {r['kernels_one'][0][0][:40]}")
