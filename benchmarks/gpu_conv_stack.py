"""Wan's causal 3x3x3 Conv3d, other ways to run it: per call at the decoder's shapes (4 output frames + 2 history).

    python3 benchmarks/gpu_conv_stack.py          # GPU machine, ~1 min; writes $OUT/conv_stack.json

  cudnn3d:   cuDNN Conv3d on NDHWC (what the stage keeps for >= 192 ch)
  triton:    our implicit-GEMM kernel with its default config (what runs the 96-ch convs)
  triton128: the same with Cout zero-padded to a power of two (one accumulator, N = 128 / 256)
  stack2d:   the three time taps stacked into channels: conv2d (Cout, 3*Cin, 3, 3) on frames whose channels are
             [x(t), x(t+1), x(t+2)] (cuDNN Conv2d, NHWC); the stacking copy timed separately ("stack_copy")
Error: max |y - ref| / max |ref| vs cuDNN Conv3d in fp32 (TF32 off).
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

from _common import event_ms, no_tf32, out_dir, run_meta  # noqa: E402
from vaeopt.kernels import conv as K  # noqa: E402

OUT = out_dir()
dev = torch.device("cuda")
no_tf32()

SHAPES = [("wan480-96", 96, 480, 832), ("wan480-192", 192, 240, 416), ("wan480-384", 384, 120, 208),
          ("wan720-96", 96, 720, 1280)]
T = 4


def rel(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


rows = []
for name, c, H, W in SHAPES:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, c, T + 2, H, W, generator=g).to(dev, torch.bfloat16).contiguous(
        memory_format=torch.channels_last_3d)
    w = (torch.randn(c, c, 3, 3, 3, generator=g) / (27 * c) ** 0.5).to(dev, torch.bfloat16)
    ref = F.conv3d(x.float(), w.float(), None, 1, (0, 1, 1))
    w3 = w.contiguous(memory_format=torch.channels_last_3d)
    fl = 2 * T * H * W * c * c * 27
    r = {"shape": name, "C": c, "H": H, "W": W, "T": T}
    r["ms_cudnn3d"] = event_ms(lambda: F.conv3d(x, w3, None, 1, (0, 1, 1)))
    r["err_cudnn3d"] = rel(F.conv3d(x, w3, None, 1, (0, 1, 1)), ref)
    pw = K.pack_weight(w)
    r["ms_triton"] = event_ms(lambda: K.conv_igemm(x, pw, None, (1, 1)))
    r["err_triton"] = rel(K.conv_igemm(x, pw, None, (1, 1)), ref)
    cp = triton.next_power_of_2(c)
    if cp != c:
        wp = torch.zeros(cp, c, 3, 3, 3, device=dev, dtype=w.dtype)
        wp[:c] = w
        pwp = K.pack_weight(wp)
        best = None
        for cfg in (K.Config(128, cp, 0, 64, 8, 4), K.Config(256, cp, 0, 64, 8, 3), K.Config(128, cp, 0, 32, 8, 4),
                    K.Config(64, cp, 0, 64, 4, 4)):
            try:
                ms = event_ms(lambda: K.conv_igemm(x, pwp, None, (1, 1), config=cfg), 10)
            except Exception as e:  # noqa: BLE001 (shared memory limits)
                r.setdefault("triton128_errors", []).append(f"{cfg}: {type(e).__name__}")
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is not None:
            r["ms_triton128"], r["cfg_triton128"] = best[0], str(best[1])
            r["err_triton128"] = rel(K.conv_igemm(x, pwp, None, (1, 1), config=best[1])[:, :c], ref)
    # time taps stacked into channels
    ws = w.permute(0, 2, 1, 3, 4).reshape(c, 3 * c, 3, 3).contiguous(memory_format=torch.channels_last)
    xs = torch.empty((T, H, W, 3 * c), device=dev, dtype=x.dtype)
    xf = x[0].permute(1, 2, 3, 0)  # (Tin, H, W, C)

    def stack():
        for dt in range(3):
            xs[..., dt * c : (dt + 1) * c].copy_(xf[dt : dt + T])

    stack()
    xs4 = xs.permute(0, 3, 1, 2)
    r["ms_stack_copy"] = event_ms(stack)
    for bench_mode in (False, True):
        torch.backends.cudnn.benchmark = bench_mode
        r[f"ms_stack2d{'_bench' if bench_mode else ''}"] = event_ms(lambda: F.conv2d(xs4, ws, None, 1, 1))
    torch.backends.cudnn.benchmark = False
    y2 = F.conv2d(xs4, ws, None, 1, 1)  # (T, C, H, W)
    r["err_stack2d"] = rel(y2.permute(1, 0, 2, 3).unsqueeze(0), ref)
    for k in [k for k in r if k.startswith("ms_") and k != "ms_stack_copy"]:
        r["tf" + k[2:]] = fl / r[k] / 1e9
    rows.append(r)
    del x, ref, xs, xs4, y2
    torch.cuda.empty_cache()

meta = run_meta("python3 benchmarks/gpu_conv_stack.py")
(OUT / "conv_stack.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
print(f"\n# {meta['gpu']} | torch {torch.__version__} | triton {triton.__version__} | cuDNN {meta['versions']['cudnn']}")
print(f"{'shape':12s} {'cudnn3d':>8s} {'triton':>8s} {'tri128':>8s} {'stack2d':>8s} {'st2d_bm':>8s} {'copy':>6s}  "
      "TFLOP/s (cudnn3d, triton, tri128, stack2d)")
for r in rows:
    print(f"{r['shape']:12s} {r['ms_cudnn3d']:8.3f} {r['ms_triton']:8.3f} {r.get('ms_triton128', float('nan')):8.3f} "
          f"{r['ms_stack2d']:8.3f} {r['ms_stack2d_bench']:8.3f} {r['ms_stack_copy']:6.3f}  "
          f"{r['tf_cudnn3d']:.0f} {r['tf_triton']:.0f} {r.get('tf_triton128', 0):.0f} {r['tf_stack2d']:.0f}  "
          f"err {r['err_cudnn3d']:.1e} {r['err_triton']:.1e} {r['err_stack2d']:.1e}")
