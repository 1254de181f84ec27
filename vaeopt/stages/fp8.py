"""FP8 (float8_e4m3fn) for the decoder, gated on measured fidelity.

Level 1, storage: conv/linear weights kept in e4m3 with one scale per output channel, dequantized per layer at
    forward time: halves weight memory (bf16 -> fp8), costs one small dequantize per layer, not a speedup.
Level 2, compute: 1x1 convs and linears as `torch._scaled_mm` GEMMs with fp8 operands (per-tensor dynamic activation
    scale, per-tensor weight scale), on GPUs with FP8 tensor cores (sm_89+).
First and last layers (conv_in, conv_out) stay in the compute dtype. After conversion a probe decode is compared with
the fp32 decode of the same weights; below the gate (default 40 dB PSNR) the stage is undone and says so.
"""

from __future__ import annotations

import torch
from torch import nn

from vaeopt.stages import StageResult

NAME = "fp8"
E4M3 = getattr(torch, "float8_e4m3fn", None)
E4M3_MAX = 448.0
KEEP = ("conv_in", "conv_out")  # the decoder's first and last layers: most sensitive, cheapest to keep


def available(device: torch.device) -> tuple[bool, str]:
    if E4M3 is None:
        return False, f"torch {torch.__version__} has no float8_e4m3fn"
    if device.type != "cuda":
        return False, "no CUDA GPU: FP8 tensor cores are a GPU feature"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"GPU sm_{cap[0]}{cap[1]} has no FP8 tensor cores (needs sm_89+)"
    return True, ""


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (O, ...) -> (e4m3 weights, fp32 scale (O,)) with w ≈ q * scale[:, None...]."""
    amax = w.detach().float().reshape(w.shape[0], -1).abs().amax(dim=1).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    q = (w.float() / scale.view(-1, *([1] * (w.ndim - 1)))).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale.view(-1, *([1] * (q.ndim - 1)))).to(dtype)


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
        amax = w.float().abs().amax().clamp_min(1e-12)
        self.register_buffer("wscale", (amax / E4M3_MAX).float().reshape(()))
        # _scaled_mm wants B column-major: store (I, O) as the transpose of a row-major (O, I)
        self.register_buffer("qweight_t", (w.float() / self.wscale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).t())
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
        amax = x2.abs().amax().float().clamp_min(1e-12)
        xs = amax / E4M3_MAX
        xq = (x2.float() / xs).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous()  # cuBLASLt: A row-major
        y = torch._scaled_mm(xq, self.qweight_t, scale_a=xs, scale_b=self.wscale, out_dtype=x.dtype,
                             bias=self.bias.to(x.dtype) if self.bias is not None else None)
        if self.is_conv:
            return y.view(n, h, w_, -1).permute(0, 3, 1, 2)
        return y.view(*x.shape[:-1], self.out_features)


def _decoder(model: nn.Module) -> nn.Module:
    return getattr(model, "decoder", model)


def convert(model: nn.Module, compute: bool = True) -> dict:
    """Convert decoder layers in place. Returns counts and bytes."""
    dec = _decoder(model)
    stats = {"storage": 0, "gemm": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
    swaps, stores = [], []
    for parent_name, parent in dec.named_modules():
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, (nn.Conv2d, nn.Conv3d, nn.Linear)) or child.weight is None:
                continue
            if full in KEEP or full.startswith(tuple(k + "." for k in KEEP)):
                stats["kept"] += 1
                continue
            w = child.weight
            gemm_ok = compute and w.is_cuda and w.shape[0] % 16 == 0 and w[0].numel() % 16 == 0 and (
                type(child) is nn.Linear
                or (type(child) is nn.Conv2d and child.kernel_size == (1, 1) and child.groups == 1
                    and child.stride == (1, 1) and child.padding == (0, 0)))
            if gemm_ok:
                swaps.append((parent, name, FP8GemmLinear(child)))
                stats["gemm"] += 1
            elif isinstance(child, (nn.Conv2d, nn.Conv3d)):
                stores.append(child)
                stats["storage"] += 1
            else:
                continue
            stats["bytes_before"] += w.numel() * w.element_size()
            stats["bytes_after"] += w.numel()
    for parent, name, new in swaps:
        setattr(parent, name, new)
    for conv in stores:
        attach_storage(conv)
    return stats


def revert(model: nn.Module) -> int:
    n = 0
    for parent in list(_decoder(model).modules()):
        if hasattr(parent, "_vaeopt_fp8_hooks"):
            detach_storage(parent)
            n += 1
        for name, child in list(parent.named_children()):
            if isinstance(child, FP8GemmLinear):
                setattr(parent, name, child.original[0].to(child.orig_device))
                n += 1
    return n


def _probe_latent(family, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    c = family.latent_channels
    shape = (1, c, 3, 16, 16) if family.is_video else (1, c, 32, 32)
    return torch.randn(shape, generator=g).to(device)


def _decode(model, z):
    with torch.inference_mode():
        return model.decode(z).sample.float()


def apply(model: nn.Module, family=None, gate_db: float = 40.0, device=None, dtype=torch.bfloat16,
          compute: bool = True, **_) -> StageResult:
    from vaeopt.fidelity import psnr

    device = device or next(model.parameters()).device
    z = _probe_latent(family, device)
    # fp32 reference of the same weights (upcast temporarily), and the plain low-precision decode for context
    model.float()
    ref = _decode(model, z.float())
    model.to(dtype)
    base = _decode(model, z.to(dtype))
    stats = convert(model, compute=compute)
    try:
        out = _decode(model, z.to(dtype))
    except RuntimeError as e:  # an fp8 kernel this torch/GPU combination lacks: undo, say why
        revert(model)
        return StageResult(NAME, "fallback", f"fp8 decode failed here, undone: {str(e).splitlines()[0][:150]}",
                           {**stats, "error": str(e)[:500]})
    p, p_base = psnr(out.clamp(-1, 1), ref.clamp(-1, 1)), psnr(base.clamp(-1, 1), ref.clamp(-1, 1))
    saved = (stats["bytes_before"] - stats["bytes_after"]) / 2**20
    data = {**stats, "psnr_db": p, "psnr_plain_db": p_base, "gate_db": gate_db, "saved_mib": saved}
    if p < gate_db:
        revert(model)
        return StageResult(NAME, "fallback", f"probe decode {p:.1f} dB vs fp32 < gate {gate_db:g} dB "
                                             f"({str(dtype).replace('torch.', '')} alone: {p_base:.1f} dB): undone", data)
    return StageResult(NAME, "applied",
                       f"{stats['storage']} convs with e4m3 weight storage, {stats['gemm']} 1x1/linear as fp8 GEMMs, "
                       f"{stats['kept']} kept ({', '.join(KEEP)}); weights {saved:.1f} MiB smaller; probe "
                       f"{p:.1f} dB vs fp32 (gate {gate_db:g}; {str(dtype).replace('torch.', '')} alone {p_base:.1f} dB)",
                       data)
