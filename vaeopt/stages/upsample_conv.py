"""Stage `upsample_conv`: each decoder upsampler's "2x nearest upsample, then 3x3 conv" as four 2x2 phase convs on
the low-resolution input (vaeopt/kernels/upconv.py): 4/9 of the conv FLOPs, and the 4x-upsampled tensor is never
written: 1.3-2x faster per layer call than the 3x3 conv on the upsampled input, at every SDXL and Wan shape
measured (E16).

The stage marks the convs and computes their phase kernels (once per weight version and dtype, cached on the conv);
the code that runs them decides per call:
- AutoencoderKL (SD/SDXL/SD3/FLUX): Upsample2D modules patched by `fused_epilogues` run the phase conv, and the
  up-block's last resnet stops writing its output 2x-upsampled (stages/fused_epilogues.py).
- Wan: WanResample's `resample` (nn.Upsample 2x nearest + Conv2d 3x3) runs as the phase conv in vaeopt.video's chunk
  decoder, on the fused path and the torch path alike (vaeopt.engine.wan_ops.frames_up_conv).
Numerics: an exact rewrite of the same linear map; only rounding differs (the summed taps are rounded once to the
weight dtype), which the benchmark's PSNR vs fp32 measures. On CPU, auto keeps the stock composition (CPU decodes
stay bitwise diffusers); `--upsample-conv on` forces it anywhere.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from vaeopt.kernels import interpreter_hint
from vaeopt.kernels import upconv  # (the module: tests watch its launchers)
from vaeopt.stages import Hint, Said, StageResult, cached_weight, drop_attrs, needs_autograd, unhooked
from vaeopt.stages.marks import CONV8, CONV8_INT8, FUSED_EPILOGUES, UPCONV, interpolating_upsampler, is_2x_nearest

NAME = "upsample_conv"
_MARK = UPCONV  # on the nn.Conv2d: run as phase convs
_W4 = "_vaeopt_upconv_w4"  # on the nn.Conv2d: (weight key, dtype) -> phase kernels
_W4_8 = "_vaeopt_upconv_w4_e4m3"  # on the nn.Conv2d: (weight key) -> the e4m3 phase kernels (one PackedWeight)
_FP8 = CONV8  # set on the conv by FP8 level 3 (stages/triton_conv.apply_fp8)
_INT8 = CONV8_INT8  # set with it where the 8-bit format is int8


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, Said("CPU decode: the stock upsample + conv kept (bitwise diffusers); {0} forces it",
                           Hint("upsample_conv", "on"))
    return True, "cuDNN"


def cpu_reason(cls_name: str) -> Said:
    """Why auto keeps the stock upsampler on the CPU: image VAEs run the phase convs inside the fused Triton path,
    so the hint names --triton too (the bare one led to 'needs fused_epilogues')."""
    if cls_name == "AutoencoderKLWan":
        return available(torch.device("cpu"))[1]
    return Said("CPU decode: the stock upsample + conv kept (bitwise diffusers); image VAEs run the phase "
                f"convs inside the fused Triton path ({interpreter_hint()})",
                (Hint("triton", "on"), Hint("upsample_conv", "on")))


def _conv3x3(m) -> bool:
    return (type(m) is nn.Conv2d and m.padding_mode == "zeros" and m.weight is not None
            and tuple(m.kernel_size) == (3, 3) and tuple(m.stride) == (1, 1) and tuple(m.padding) == (1, 1)
            and tuple(m.dilation) == (1, 1) and m.groups == 1 and unhooked(m))


def _image_candidates(model: nn.Module) -> list[nn.Conv2d]:
    """Convs of the Upsample2D modules that fused_epilogues patched (their forward is the one that consumes the
    mark) with an interpolating, conv-ending stock layout."""
    record = getattr(model, FUSED_EPILOGUES, None) or {}
    out = []
    for u in record.get("upsamplers", []):
        conv = getattr(u, "conv", None) if getattr(u, "name", "conv") == "conv" else None
        if u.use_conv and interpolating_upsampler(u) and conv is not None and _conv3x3(conv):
            out.append(conv)
    return out


def _wan_candidates(model: nn.Module) -> list[nn.Conv2d]:
    out = []
    for m in model.decoder.modules():
        if type(m).__name__ != "WanResample" or m.mode not in ("upsample2d", "upsample3d"):
            continue
        rs = m.resample
        if isinstance(rs, nn.Sequential) and len(rs) == 2 and is_2x_nearest(rs[0]) and _conv3x3(rs[1]):
            out.append(rs[1])
    return out


def apply(model: nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None,
          **_) -> StageResult:
    """Mark the upsampler convs that fit. Where it pays (GPUs; on the CPU the stock path stays bitwise diffusers') is
    the stage table's auto rule (vaeopt.stage_table, `cpu_reason`)."""
    device = device or next(model.parameters()).device
    if getattr(model, "decoder", None) is None:
        return StageResult.skipped(NAME, f"{type(model).__name__} has no decoder")
    wan = type(model).__name__ == "AutoencoderKLWan"
    if wan:
        convs = _wan_candidates(model)
    else:
        if not getattr(model, FUSED_EPILOGUES, None):
            return StageResult.skipped(NAME, "needs fused_epilogues (its Upsample2D forward runs the phase convs)")
        convs = _image_candidates(model)
    if not convs:
        return StageResult.skipped(NAME, "no upsampler of the form nearest 2x + 3x3 conv (padding 1) in the decoder")
    dtype = dtype or convs[0].weight.dtype
    t0 = time.perf_counter()
    for c in convs:
        setattr(c, _MARK, True)
        phase_for(c, dtype)
    ms = (time.perf_counter() - t0) * 1e3
    shapes = sorted({f"{c.in_channels}->{c.out_channels}" for c in convs})
    return StageResult(NAME, "applied",
                       f"{len(convs)} upsampler convs ({', '.join(shapes)} ch) as four 2x2 phase convs on the "
                       f"low-resolution input: 4/9 of their FLOPs, no 4x-upsampled tensor (phase weights built in "
                       f"{ms:.0f} ms)",
                       {"layers": len(convs), "shapes": shapes})


def revert(model: nn.Module) -> None:
    drop_attrs(model, _MARK, _W4, _W4_8)


def marked(conv) -> bool:
    return bool(getattr(conv, _MARK, False)) and _conv3x3(conv)


def applies(conv, dtype: torch.dtype, device: torch.device, x: torch.Tensor | None = None) -> bool:
    """conv is marked and activations of this dtype / device can run through its phase kernels (the weights'
    own; anything else, e.g. autocast or a dry run on meta, takes the plain composition). With x: not when autograd
    needs gradients of x or of the weights (the phase kernels are derived once, without a backward)."""
    return (marked(conv) and dtype == conv.weight.dtype and device == conv.weight.device
            and not needs_autograd(x, conv.weight, conv.bias))


def phase_for(conv: nn.Conv2d, dtype: torch.dtype) -> torch.Tensor:
    """The conv's phase kernels (4*Cout, Cin, 2, 2) in `dtype` (channels_last for cuDNN's NHWC kernels), computed
    once per weight version and dtype."""
    def make():
        w = conv.weight
        w4 = upconv.phase_weights(w.detach()).to(dtype)
        if w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous():
            w4 = w4.contiguous(memory_format=torch.channels_last)
        return w4

    return cached_weight(conv, _W4, dtype, make)


def fp8_ready(conv: nn.Conv2d, device: torch.device) -> bool:
    """The conv's phase convs can run in e4m3 here: the TMA conv kernel is available (sm_90) and has a measured tile
    for its channels (kernels/tma_conv.tuned_upconv_config)."""
    from vaeopt.kernels import tma_conv  # (imports Triton)

    return (marked(conv) and tma_conv.available(torch.device(device))
            and tma_conv.tuned_upconv_config(conv.in_channels, conv.out_channels) is not None)


def _fp8_phase(conv: nn.Conv2d, x: torch.Tensor):
    """The conv's 8-bit phase kernels (e4m3, or int8 where FP8 level 3 chose int8) when FP8 level 3 marked it and x
    suits the 8-bit path, else None."""
    if not getattr(conv, _FP8, False) or x.dim() != 4 or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    if not x.is_contiguous(memory_format=torch.channels_last) or not fp8_ready(conv, x.device):
        return None
    if getattr(conv, _INT8, False):
        return cached_weight(conv, _W4_8, "int8", lambda: upconv.phase_weights_8bit(conv.weight, torch.int8))
    return cached_weight(conv, _W4_8, "e4m3", lambda: upconv.phase_weights_8bit(conv.weight))


def run(conv: nn.Conv2d, x: torch.Tensor, bias: bool = True, fp8: bool = False,
        stats_groups: int | None = None) -> torch.Tensor:
    """conv(2x nearest upsample of x) through the phase kernels; the conv's bias added unless bias=False.

    fp8=True (the whole-image decode's Upsample2D forward): when FP8 level 3 marked the conv, x is quantized to
    e4m3 (or symmetric int8) per sample (kernels/act_quant.py) and the phases run on the 8-bit TMA conv kernel,
    written straight into the upsampled output (kernels/upconv.upconv2x_8bit). Tiled decodes keep bf16 (a tile's
    scale would differ from the whole image's). stats_groups: a GroupNorm of that many groups reads the output next;
    the bf16 path's interleave pass takes its statistics (kernels/upconv.interleave_phases)."""
    pw4 = _fp8_phase(conv, x) if fp8 else None
    if pw4 is not None:
        from vaeopt.kernels.act_quant import quantize_e4m3_per_sample, quantize_int8_per_sample
        x8, s = (quantize_int8_per_sample if pw4.w.dtype == torch.int8 else quantize_e4m3_per_sample)(x)
        return upconv.upconv2x_8bit(x8, s, pw4, conv.bias if bias else None, out_dtype=x.dtype)
    return upconv.upconv2x(x, phase_for(conv, x.dtype), conv.bias if bias else None, stats_groups)
