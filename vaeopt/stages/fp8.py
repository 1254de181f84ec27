"""FP8 (float8_e4m3fn) for the decoder: the module wrappers that run the quantization plan, gated on fidelity.

Level 1, storage: conv/linear weights kept in e4m3 with one scale per output channel, dequantized per layer at
    forward time: halves weight memory (bf16 -> fp8), costs one small dequantize per layer, not a speedup.
Level 2, compute: 1x1 convs and linears as `torch._scaled_mm` GEMMs with fp8 operands (per-tensor dynamic activation
    scale, per-tensor weight scale), on GPUs with FP8 tensor cores (sm_89+).
Which layer takes which path is the plan's (vaeopt/quant/plan.py); which layers stay in the compute dtype is the
gate's (vaeopt/quant/gate.py): conv_in / conv_out, the layers stored for the measured bundled decoders
(configs/fp8_sensitivity.json), and those a probe that misses the gate (default 40 dB PSNR vs fp32) finds most
sensitive (vaeopt/quant/sensitivity.py); if no choice clears the gate the stage is undone and says so, with the
measured numbers.
"""

from __future__ import annotations

import torch
from torch import nn

# The formats and the plan are the quantization package's; they stay importable from here for the stage's callers.
from vaeopt.quant import gate
from vaeopt.quant.numerics import E4M3, E4M3_MAX, dequantize, quantize_per_channel, quantize_per_tensor  # noqa: F401
from vaeopt.quant.plan import KEEP, decoder_of, is_kept, plan_layers  # noqa: F401
from vaeopt.stages import StageResult

NAME = "fp8"


def available(device: torch.device, compute: bool = True) -> tuple[bool, str]:
    """Whether the stage can run here: level 1 alone (compute=False, weight storage dequantized per layer) needs only
    torch's float8_e4m3fn, on any device; with level 2's fp8 GEMMs it needs FP8 tensor cores."""
    if E4M3 is None:
        return False, f"torch {torch.__version__} has no float8_e4m3fn"
    if not compute:
        return True, ""
    if device.type != "cuda":
        return False, "no CUDA GPU: FP8 tensor cores are a GPU feature"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"GPU sm_{cap[0]}{cap[1]} has no FP8 tensor cores (needs sm_89+)"
    return True, ""


def _fmt_of(w: torch.Tensor):
    if w.ndim == 4 and w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous():
        return torch.channels_last
    if w.ndim == 5 and w.is_contiguous(memory_format=torch.channels_last_3d) and not w.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def _storage_pre_hook(mod, args):
    w = dequantize(mod.qweight, mod.wscale, args[0].dtype)
    mod.weight = w.contiguous(memory_format=mod._vaeopt_fp8_fmt)


def _storage_post_hook(mod, args, out):
    mod.weight = None  # drop the dequantized copy right away


# neither hook touches an activation (fused_epilogues' statistics notes stay valid under them)
_storage_pre_hook.vaeopt_keeps_activations = _storage_post_hook.vaeopt_keeps_activations = True


def attach_storage(conv: nn.Module) -> None:
    """e4m3 weight storage on any conv module, subclasses included (Wan's causal conv keeps its own forward):
    the weight parameter becomes fp8 buffers, dequantized by a pre-hook for each call."""
    w = conv.weight
    q, s = quantize_per_channel(w.data)
    conv._vaeopt_fp8_fmt = _fmt_of(w)
    conv._vaeopt_fp8_orig = w.detach().to("cpu")  # for revert; kept off the GPU
    del conv._parameters["weight"]
    conv.register_buffer("qweight", q)
    conv.register_buffer("wscale", s)
    conv.weight = None
    conv._vaeopt_fp8_hooks = (conv.register_forward_pre_hook(_storage_pre_hook),
                              conv.register_forward_hook(_storage_post_hook))


def detach_storage(conv: nn.Module) -> None:
    for h in conv._vaeopt_fp8_hooks:
        h.remove()
    dev = conv.qweight.device
    del conv._buffers["qweight"], conv._buffers["wscale"]
    del conv.weight
    conv.weight = nn.Parameter(conv._vaeopt_fp8_orig.to(dev), requires_grad=False)
    for a in ("_vaeopt_fp8_fmt", "_vaeopt_fp8_orig", "_vaeopt_fp8_hooks"):
        delattr(conv, a)


class FP8GemmLinear(nn.Module):
    """Linear (or 1x1 conv, NHWC/NCHW) as an fp8 GEMM through torch._scaled_mm, bf16 out."""

    def __init__(self, layer: nn.Linear | nn.Conv2d):
        super().__init__()
        w = layer.weight.data.reshape(layer.weight.shape[0], -1)  # (O, I)
        q, s = quantize_per_tensor(w)
        self.register_buffer("wscale", s)
        # _scaled_mm wants B column-major: store (I, O) as the transpose of a row-major (O, I)
        self.register_buffer("qweight_t", q.t())
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
        self.is_conv = isinstance(layer, nn.Conv2d)
        self.out_features = w.shape[0]
        self.orig_device = layer.weight.device
        self.original = [layer.to("cpu")]  # for revert; off the GPU so the fp8 copy really saves memory

    @property
    def weight(self) -> torch.Tensor:
        """Dequantized weight for code that reads `.weight` (e.g. fused epilogues); the GEMM never uses it."""
        w = (self.qweight_t.t().float() * self.wscale).to(self.bias.dtype if self.bias is not None else torch.bfloat16)
        return w.view(self.original[0].weight.shape) if self.is_conv else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_conv:
            n, c, h, w_ = x.shape
            x2 = x.permute(0, 2, 3, 1).reshape(-1, c)
        else:
            x2 = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_per_tensor(x2)
        xq = xq.contiguous()  # cuBLASLt: A row-major
        y = torch._scaled_mm(xq, self.qweight_t, scale_a=xs, scale_b=self.wscale, out_dtype=x.dtype,
                             bias=self.bias.to(x.dtype) if self.bias is not None else None)
        if self.is_conv:
            return y.view(n, h, w_, -1).permute(0, 3, 1, 2)
        return y.view(*x.shape[:-1], self.out_features)


def convert(model: nn.Module, compute: bool = True, keep=KEEP) -> dict:
    """Convert decoder layers in place, all but those named in `keep` (and their children). Returns counts and bytes."""
    dec = decoder_of(model)
    on_gpu = any(t.is_cuda for t in dec.parameters())
    stats = {"storage": 0, "gemm": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
    swaps, stores = [], []
    for _full, parent, name, child, path in plan_layers(model, keep, compute and on_gpu):
        stats[path] += 1
        if path == "kept":
            continue
        w = child.weight
        stats["bytes_before"] += w.numel() * w.element_size()
        stats["bytes_after"] += w.numel()
        if path == "gemm":
            swaps.append((parent, name, FP8GemmLinear(child)))
        else:
            stores.append(child)
    for parent, name, new in swaps:
        setattr(parent, name, new)
    for conv in stores:
        attach_storage(conv)
    return stats


def revert(model: nn.Module) -> int:
    n = 0
    for parent in list(decoder_of(model).modules()):
        if hasattr(parent, "_vaeopt_fp8_hooks"):
            detach_storage(parent)
            n += 1
        for name, child in list(parent.named_children()):
            if isinstance(child, FP8GemmLinear):
                setattr(parent, name, child.original[0].to(child.orig_device))
                n += 1
    return n




def apply(model: nn.Module, family=None, gate_db: float = 40.0, device=None, dtype=torch.bfloat16,
          compute: bool = True, probe: torch.Tensor | None = None, sensitivity: str = "auto", margin_db: float = 1.0,
          max_rounds: int = 2, dominant_share: float = 0.25, max_keep_frac: float = 0.5, log=None, **_) -> StageResult:
    """Convert with this module's wrappers, probe, gate (quant/gate.run says how, and which layers stay in `dtype`)."""
    return StageResult(NAME, *gate.run(model, convert, revert, family=family, gate_db=gate_db, device=device,
                                       dtype=dtype, compute=compute, probe=probe, sensitivity=sensitivity,
                                       margin_db=margin_db, max_rounds=max_rounds, dominant_share=dominant_share,
                                       max_keep_frac=max_keep_frac, log=log))
