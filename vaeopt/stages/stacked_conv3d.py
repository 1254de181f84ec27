"""Stage `stacked_conv3d`: Wan's causal 3x3x3 Conv3d as one Conv2d over time-stacked channels.

A causal conv's output frame t reads input frames t, t+1, t+2 of [history | new frames]. Stacking those three frames
along the channels gives a (3*Cin)-channel frame, and the Conv3d becomes a Conv2d with weights (Cout, 3*Cin, 3, 3)
(the same K = 27*Cin dot products, the same zero spatial padding, bitwise the same products; only cuDNN's summation
order differs). cuDNN runs that Conv2d on its sm90 kernels, where for 96 channels it picks an sm80 kernel for the
Conv3d. The stacked input is written by the RMS-norm kernel that already writes the conv's input (each frame to its
up to three places, `rms_norm_silu(taps=3)`), so the only extra cost is 2 more writes of the activation.

Measured (E17, E28): it pays at 96 and 384 channels (Wan 2.1's full- and quarter-resolution widths), not at 192, so
auto stacks those on sm_90, where it was measured; `--stack-conv3d on` stacks every stock causal 3x3x3 conv anywhere.
In bf16 where the TMA conv kernel runs (kernels/tma_conv.bf16_wan96) and triton_conv will run, auto leaves the
96-channel convs to triton_conv, which reads the plain [history | frames] buffer: no triple write, no 25% of cuDNN's
128-wide column tile wasted on Cout = 96 (faster in whole decodes, E28).

It runs in vaeopt.video's fused chunk decoder (kernel path, bf16/fp16/fp32 activations, untiled, one GPU): a conv
marked here and not taken by FP8 level 3 is staged stacked and run as the Conv2d; its causal history is read back
from the stack. The planner's dry run counts the stacked buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from vaeopt.kernels import interpreter_hint
from vaeopt.stages import Hint, Said, StageResult, cached_weight, drop_attrs
from vaeopt.stages.marks import STACK3D, stacked, wan_conv_fits

NAME = "stacked_conv3d"
_MARK = STACK3D
_W = "_vaeopt_stack3d_w"
MEASURED_CHANNELS = (96, 384)  # stacked beat the Conv3d path (and 96: our Triton kernel) at these widths
MEASURED_SM = ((9, 0),)


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, Said("CPU decode: the Conv3d kept (the stack is written by the fused kernels: "
                           f"{interpreter_hint()})", (Hint("triton", "on"), Hint("stack_conv3d", "on")))
    return True, "cuDNN"


def tma_takes_96(device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether auto leaves the 96-channel convs to triton_conv's TMA kernel (bf16 where that kernel runs)."""
    from vaeopt.kernels import tma_conv

    return device is not None and dtype is not None and tma_conv.bf16_wan96(torch.device(device), dtype)


def candidates(model: nn.Module, every: bool = False, skip: tuple[int, ...] = ()) -> list[nn.Module]:
    """The decoder's stock causal 3x3x3 convs with a measured width not in `skip` (every=True: all of them)."""

    dec = getattr(model, "decoder", None)
    if dec is None:
        return []
    return [m for m in dec.modules() if isinstance(m, nn.Conv3d) and wan_conv_fits(m)
            and (every or (m.in_channels == m.out_channels and m.in_channels in MEASURED_CHANNELS
                           and m.in_channels not in skip))]


def mark(convs) -> None:
    for m in convs:
        setattr(m, _MARK, True)


def apply(model: nn.Module, device: torch.device | None = None, force: bool = False,
          dtype: torch.dtype | None = None, triton_conv_runs: bool = False, **_) -> StageResult:
    """Mark the causal convs to stack: the measured widths, or every one (force). triton_conv_runs: the triton_conv
    stage will run after this one (the stage table knows), so the 96-ch convs may be left to its TMA kernel (auto,
    `tma_takes_96`); otherwise they are stacked as before. Where it runs in auto mode (GPUs it was measured on) is
    the stage table's rule."""
    if type(model).__name__ != "AutoencoderKLWan":
        return StageResult.skipped(NAME, f"{type(model).__name__} has no causal Conv3d")
    device = device or next(model.parameters()).device
    if not getattr(model, "_vaeopt_fused_epilogues", None):
        return StageResult.skipped(NAME, "needs the fused chunk decoder (its RMS-norm kernel writes the stack)")
    skip = (96,) if not force and triton_conv_runs and tma_takes_96(device, dtype) else ()
    convs = candidates(model, every=force, skip=skip)
    left = len(candidates(model)) - len(convs) if skip else 0
    note = f"; {left} with 96 ch left to triton_conv (its TMA kernel)" if left else ""
    if not convs:
        widths = [c for c in MEASURED_CHANNELS if c not in skip]
        return StageResult.skipped(NAME, f"no causal 3x3x3 Conv3d with {' or '.join(map(str, widths))} "
                                         f"channels (the widths it is used for){note}")
    mark(convs)
    shapes = sorted({m.in_channels for m in convs})
    return StageResult(NAME, "applied",
                       f"{len(convs)} causal Conv3d ({', '.join(map(str, shapes))} ch) as Conv2d over time-stacked "
                       f"channels (3x the staged input, written by the RMS-norm kernel){note}",
                       {"layers": len(convs), "channels": shapes, "left_to_triton_conv": left})


def revert(model: nn.Module) -> None:
    drop_attrs(model, _MARK, _W)


marked = stacked


def stacked_weight(conv: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """(Cout, Cin, 3, kh, kw) -> (Cout, 3*Cin, kh, kw), channel block dt = time tap dt; channels_last. Cached per
    weight version and dtype."""
    def make():
        co, ci, kt, kh, kw = conv.weight.shape
        ws = conv.weight.detach().to(dtype).permute(0, 2, 1, 3, 4).reshape(co, kt * ci, kh, kw)
        return ws.contiguous(memory_format=torch.channels_last)

    return cached_weight(conv, _W, dtype, make)
