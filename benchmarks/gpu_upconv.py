"""Upsampler convs as four 2x2 phase convs (vaeopt/kernels/upconv.py) vs upsample + 3x3 conv, per layer.

    python3 benchmarks/gpu_upconv.py            # GPU machine, ~1 min; writes $OUT/upconv.json

Per decoder upsampler shape (SDXL 1024², Wan 2.1 480p/720p per 2-latent-frame chunk): CUDA-event medians of
  plain:  our NHWC nearest-2x kernel + cuDNN conv3x3 (bias-free: the pipeline folds the bias elsewhere)
  conv3:  the conv3x3 alone (what the fused path pays when the upsample is written by the previous epilogue)
  phase:  cuDNN 2x2 conv with 4*Cout channels + the Triton interleave (with the bias added)
  phase_torch: the same with the four strided torch copies
and the error of each vs an fp32 reference (TF32 off) of the plain composition.
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
from vaeopt.kernels.epilogue import upsample_nearest2x  # noqa: E402
from vaeopt.kernels import upconv as U  # noqa: E402

OUT = out_dir()
dev = torch.device("cuda")
no_tf32()

# (name, frames, cin, cout, H, W) of the low-resolution input
SHAPES = [("sdxl up0 512@128", 1, 512, 512, 128, 128), ("sdxl up1 512@256", 1, 512, 512, 256, 256),
          ("sdxl up2 256@512", 1, 256, 256, 512, 512), ("wan480 up1 384->192 @120x208", 8, 384, 192, 120, 208),
          ("wan480 up2 192->96 @240x416", 8, 192, 96, 240, 416), ("wan720 up2 192->96 @360x640", 8, 192, 96, 360, 640)]


def rel(a, r):
    return ((a.float() - r).norm() / r.norm()).item()


rows = []
for name, n, ci, co, H, W in SHAPES:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, ci, H, W, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(co, ci, 3, 3, generator=g) / (9 * ci) ** 0.5).to(dev, torch.bfloat16)
    b = (torch.randn(co, generator=g) * 0.1).to(dev, torch.bfloat16)
    w = w.contiguous(memory_format=torch.channels_last)
    w4 = U.phase_weights(w).contiguous(memory_format=torch.channels_last)
    ref = U.upconv2x_reference(x.float(), w.float(), b.float())
    plain = lambda: F.conv2d(upsample_nearest2x(x), w, None, padding=1)  # noqa: E731
    u = upsample_nearest2x(x)
    conv3 = lambda: F.conv2d(u, w, None, padding=1)  # noqa: E731
    phase = lambda: U.upconv2x(x, w4, b)  # noqa: E731
    p = F.conv2d(x, w4, None, padding=1)

    ilv = lambda: U.interleave_phases(p, b)  # noqa: E731
    conv2 = lambda: F.conv2d(x, w4, None, padding=1)  # noqa: E731
    fl3 = 2 * n * 4 * H * W * co * ci * 9
    fl2 = 2 * n * (H + 1) * (W + 1) * 4 * co * ci * 4
    r = {"shape": name, "frames": n, "cin": ci, "cout": co, "H": H, "W": W,
         "ms_plain": event_ms(plain), "ms_conv3": event_ms(conv3), "ms_phase": event_ms(phase),
         "ms_phase_conv": event_ms(conv2), "ms_interleave": event_ms(ilv),
         "ms_upsample": event_ms(lambda: upsample_nearest2x(x))}
    # torch interleave on the same channels_last phase output (the kernel's fallback path)
    y6 = torch.empty((n, co, 2 * H, 2 * W), dtype=x.dtype, device=dev, memory_format=torch.channels_last)

    def torch_ilv():
        yv = y6.view(n, co, H, 2, W, 2)
        p5 = p.permute(0, 2, 3, 1).unflatten(3, (4, co)).permute(0, 3, 4, 1, 2)
        for a in (0, 1):
            for bb in (0, 1):
                yv[:, :, :, a, :, bb].copy_(p5[:, 2 * a + bb, :, a : a + H, bb : bb + W])
        y6.add_(b.view(1, co, 1, 1))
    r["ms_interleave_torch"] = event_ms(torch_ilv)
    r["tflops_conv3"] = fl3 / r["ms_conv3"] / 1e9
    r["tflops_phase_conv"] = fl2 / r["ms_phase_conv"] / 1e9
    yp = phase()
    r["rel_err_phase"] = rel(yp, ref)
    r["rel_err_plain"] = rel(plain() + b.view(1, co, 1, 1), ref)
    r["max_abs_phase_vs_plain"] = (yp.float() - (plain() + b.view(1, co, 1, 1)).float()).abs().max().item()
    r["layout_ok"] = bool(yp.is_contiguous(memory_format=torch.channels_last))
    rows.append(r)
    del x, u, p, yp, ref, y6
    torch.cuda.empty_cache()

meta = run_meta("python3 benchmarks/gpu_upconv.py")
(OUT / "upconv.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
print(f"\n# {meta['gpu']} | torch {torch.__version__} | triton {triton.__version__} | cuDNN {meta['versions']['cudnn']}")
print(f"{'shape':32s} {'up+conv3':>8s} {'conv3':>7s} {'phase':>7s} {'(conv2':>7s} {'ilv':>6s} {'ilv_t)':>7s} "
      f"{'TF3':>5s} {'TF2':>5s} {'err_ph':>8s} {'err_pl':>8s}")
for r in rows:
    print(f"{r['shape']:32s} {r['ms_plain']:8.3f} {r['ms_conv3']:7.3f} {r['ms_phase']:7.3f} {r['ms_phase_conv']:7.3f} "
          f"{r['ms_interleave']:6.3f} {r['ms_interleave_torch']:7.3f} {r['tflops_conv3']:5.0f} "
          f"{r['tflops_phase_conv']:5.0f} {r['rel_err_phase']:8.2e} {r['rel_err_plain']:8.2e}")
