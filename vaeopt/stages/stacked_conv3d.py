"""Stage `stacked_conv3d`: Wan's causal 3x3x3 Conv3d as one Conv2d over time-stacked channels.

A causal conv's output frame t reads input frames t, t+1, t+2 of [history | new frames]. Stacking those three frames
along the channels gives a (3*Cin)-channel frame, and the Conv3d becomes a Conv2d with weights (Cout, 3*Cin, 3, 3)
(the same K = 27*Cin dot products, the same zero spatial padding, bitwise the same products; only cuDNN's summation
order differs). cuDNN runs that Conv2d on its sm90 kernels, where for 96 channels it picks an sm80 kernel for the
Conv3d. The stacked input is written by the RMS-norm kernel that already writes the conv's input (each frame to its
up to three places, `rms_norm_silu(taps=3)`), so the only extra cost is 2 more writes of the activation.

Measured on an H200 (benchmarks/results/h200_conv_stack_2026-11-21.json), bf16, 4 output frames per call:
    96 ch @480x832: cuDNN Conv3d 2.74 ms, our Triton implicit GEMM 2.17, stacked Conv2d 1.49 (534 TFLOP/s)
    96 ch @720x1280: 6.53 / 5.38 / 3.49;  384 ch @120x208: 1.22 / 2.09 / 0.99 (800 TFLOP/s)
    192 ch @240x416: 1.24 / 2.13 / 1.31 -- no gain: those stay on the Conv3d
So auto stacks the convs with 96 or 384 channels (Wan 2.1's full- and quarter-resolution widths) on sm_90, where it
was measured; `--stack-conv3d on` stacks every stock causal 3x3x3 conv anywhere.

It runs in vaeopt.video's fused chunk decoder (kernel path, bf16/fp16/fp32 activations, untiled, one GPU): a conv
marked here and not taken by FP8 level 3 is staged stacked and run as the Conv2d; its causal history is read back
from the stack. The planner's dry run counts the stacked buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from vaeopt.stages import StageResult, cached_weight, drop_attrs, unmeasured_gpu

NAME = "stacked_conv3d"
_MARK = "_vaeopt_stack3d"
_W = "_vaeopt_stack3d_w"
MEASURED_CHANNELS = (96, 384)  # stacked beat the Conv3d path (and 96: our Triton kernel) at these widths
MEASURED_SM = ((9, 0),)


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "CPU decode: the Conv3d kept (--stack-conv3d on forces it)"
    return True, "cuDNN"


def candidates(model: nn.Module, every: bool = False) -> list[nn.Module]:
    """The decoder's stock causal 3x3x3 convs with a measured width (every=True: all of them)."""
    from vaeopt.stages.triton_conv import _kernel_fits  # (a stock, unhooked WanCausalConv3d, 3x3x3, stride 1)

    dec = getattr(model, "decoder", None)
    if dec is None:
        return []
    return [m for m in dec.modules() if isinstance(m, nn.Conv3d) and _kernel_fits(m)
            and (every or (m.in_channels == m.out_channels and m.in_channels in MEASURED_CHANNELS))]


def mark(convs) -> None:
    for m in convs:
        setattr(m, _MARK, True)


def apply(model: nn.Module, device: torch.device | None = None, force: bool = False, **_) -> StageResult:
    if type(model).__name__ != "AutoencoderKLWan":
        return StageResult.skipped(NAME, f"{type(model).__name__} has no causal Conv3d")
    device = device or next(model.parameters()).device
    ok, why = available(device)
    if not ok and not force:
        return StageResult.skipped(NAME, why)
    why = None if force else unmeasured_gpu(device, MEASURED_SM, "the Conv3d", "--stack-conv3d")
    if why:
        return StageResult.skipped(NAME, why)
    if not getattr(model, "_vaeopt_fused_epilogues", None):
        return StageResult.skipped(NAME, "needs the fused chunk decoder (its RMS-norm kernel writes the stack)")
    convs = candidates(model, every=force)
    if not convs:
        return StageResult.skipped(NAME, f"no causal 3x3x3 Conv3d with {' or '.join(map(str, MEASURED_CHANNELS))} "
                                         "channels (where stacking measured faster)")
    mark(convs)
    shapes = sorted({m.in_channels for m in convs})
    return StageResult(NAME, "applied",
                       f"{len(convs)} causal Conv3d ({', '.join(map(str, shapes))} ch) as Conv2d over time-stacked "
                       "channels (3x the staged input, written by the RMS-norm kernel)",
                       {"layers": len(convs), "channels": shapes})


def revert(model: nn.Module) -> None:
    drop_attrs(model, _MARK, _W)


def marked(conv) -> bool:
    return bool(getattr(conv, _MARK, False))


def stacked_weight(conv: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """(Cout, Cin, 3, kh, kw) -> (Cout, 3*Cin, kh, kw), channel block dt = time tap dt; channels_last. Cached per
    weight version and dtype."""
    def make():
        co, ci, kt, kh, kw = conv.weight.shape
        ws = conv.weight.detach().to(dtype).permute(0, 2, 1, 3, 4).reshape(co, kt * ci, kh, kw)
        return ws.contiguous(memory_format=torch.channels_last)

    return cached_weight(conv, _W, dtype, make)
