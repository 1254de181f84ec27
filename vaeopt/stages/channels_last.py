"""channels_last / channels_last_3d: decoder conv weights and activations in NHWC / NDHWC.

On the GPU it only pays together with NHWC-native norm kernels (fused_norms): aten's CUDA GroupNorm relayouts NHWC
inputs, which made a channels_last SDXL decode slower in eager mode (86.6 -> 127.8 ms on an H200,
docs/benchmarks.md). So there the pipeline applies it only with the fused norms, unless forced. On the CPU, aten's
convs and norms take NHWC natively, and it pays alone (see the note above alone_pays).
"""

from __future__ import annotations

import torch
from torch import nn

from vaeopt.stages import StageResult

NAME = "channels_last"


# On the CPU, aten's NHWC convs and norms make channels_last pay on its own (measured with `vaeopt benchmark`,
# "vaeopt plain" -> "+ channels_last" rows: about 1.4x on the tiny KL and Wan samples; docs/benchmarks.md).


def available(device: torch.device) -> tuple[bool, str]:
    return True, ""


def alone_pays(device: torch.device) -> bool:
    """Without the fused norms: on the CPU (aten's NHWC convs and norms), not on CUDA (aten GroupNorm relayouts)."""
    return device.type == "cpu"


def _decoder_parts(model: nn.Module) -> list[nn.Module]:
    return [m for m in (getattr(model, "post_quant_conv", None), getattr(model, "decoder", None)) if m is not None]


def _to_layout(x: torch.Tensor) -> torch.Tensor:
    if x.ndim == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if x.ndim == 5:
        return x.contiguous(memory_format=torch.channels_last_3d)
    return x


def _relayout_input(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of the decoder's first part (a module-level function, so an optimized model pickles)."""
    return (_to_layout(args[0]),) + tuple(args[1:])


_relayout_input.vaeopt_keeps_activations = True  # a layout, not values (stages.foreign_hooks)


def _contiguous_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook of a converted conv (module-level, so the model pickles): its weight goes out in the
    standard layout, as from the stock model. safetensors' save_file (how ComfyUI/A1111-style tools save a VAE)
    refuses non-contiguous tensors. state_dict(keep_vars=True) hands out the Parameters themselves: left alone."""
    k = prefix + "weight"
    w = state_dict.get(k)
    if isinstance(w, torch.Tensor) and not isinstance(w, nn.Parameter) and not w.is_contiguous():
        state_dict[k] = w.contiguous()


def apply(model: nn.Module, **_) -> StageResult:
    n2 = n3 = 0
    for part in _decoder_parts(model):
        for m in part.modules():
            if not isinstance(m, (nn.Conv2d, nn.Conv3d)):
                continue
            fmt = torch.channels_last if isinstance(m, nn.Conv2d) else torch.channels_last_3d
            if m.weight is None and hasattr(m, "_vaeopt_fp8_fmt"):  # fp8 storage: dequantize straight into NHWC
                m._vaeopt_fp8_fmt = fmt
            else:
                m.weight.data = m.weight.data.contiguous(memory_format=fmt)
            if getattr(m, "_vaeopt_cl_sd_hook", None) is None:
                reg = getattr(m, "register_state_dict_post_hook", None) or m._register_state_dict_hook  # torch < 2.5
                m._vaeopt_cl_sd_hook = reg(_contiguous_state)
            n2 += isinstance(m, nn.Conv2d)
            n3 += isinstance(m, nn.Conv3d)
    # The decoder's input arrives NCHW from the caller: relayout once at the entry.
    if getattr(model, "_vaeopt_cl_hook", None) is None:  # once: a second pipeline on this model adds no second hook
        model._vaeopt_cl_hook = _decoder_parts(model)[0].register_forward_pre_hook(_relayout_input)
    parts = []
    if n2:
        parts.append(f"{n2} Conv2d to channels_last")
    if n3:
        parts.append(f"{n3} Conv3d to channels_last_3d")
    return StageResult(NAME, "applied", "converted " + ", ".join(parts) + "; input relayout once at the decoder entry",
                       {"conv2d": n2, "conv3d": n3})


def revert(model: nn.Module) -> None:
    h = getattr(model, "_vaeopt_cl_hook", None)
    if h is not None:
        h.remove()
        del model._vaeopt_cl_hook
    for part in _decoder_parts(model):
        for m in part.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d)):
                h = m.__dict__.pop("_vaeopt_cl_sd_hook", None)
                if h is not None:
                    h.remove()
                if m.weight is None and hasattr(m, "_vaeopt_fp8_fmt"):
                    m._vaeopt_fp8_fmt = torch.contiguous_format
                else:
                    m.weight.data = m.weight.data.contiguous()
