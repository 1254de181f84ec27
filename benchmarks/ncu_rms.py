"""Wan's RMS kernel on the wan21-480p 96-ch / 192-ch shapes, for Nsight Compute (`ncu`) to read its hardware counters.

    ncu --set detailed -k regex:_rms_cl_kernel --launch-skip 4 --launch-count 4 python3 benchmarks/ncu_rms.py
        [--silu-mode M]

Runs each call (96 ch 480x832 and 192 ch 240x416, 12 frames, bf16, into the conv buffer; without and with the residual)
once after a warm-up, so the profiled launches are: warm-ups first, then the four calls in that order. (E31's
--programs / --stages, persistent programs, went with them after commit 051ea6e.)"""
import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import wan_norm_inputs  # noqa: E402

from vaeopt.kernels.rms_norm_silu import rms_norm_silu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--silu-mode", type=int, default=None)
args = ap.parse_args()
importlib.import_module("vaeopt.kernels.common").SILU_MODE = args.silu_mode
g = torch.Generator().manual_seed(0)
calls = []
for C, H, W in ((96, 480, 832), (192, 240, 416)):
    h, r, kw = wan_norm_inputs(C, H, W, 0, 12, g)
    gamma = (1 + 0.1 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    beta = (0.1 * torch.randn(C, generator=g)).to("cuda", torch.bfloat16)
    u = torch.empty_like(h)
    for resid in (False, True):
        extra = dict(residual=r, sum_out=u) if resid else {}
        calls.append(lambda h=h, gamma=gamma, beta=beta, kw=kw, extra=extra: rms_norm_silu(
            h, gamma, beta, 1e-12, True, **kw, **extra))
for c in calls:  # compile + warm
    c()
torch.cuda.synchronize()
for c in calls:
    c()
torch.cuda.synchronize()
print("done")
