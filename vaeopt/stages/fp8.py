"""FP8 (float8_e4m3fn) for the decoder, gated on measured fidelity.

Level 1, storage: conv/linear weights kept in e4m3 with one scale per output channel, dequantized per layer at
    forward time: halves weight memory (bf16 -> fp8), costs one small dequantize per layer, not a speedup.
Level 2, compute: 1x1 convs and linears as `torch._scaled_mm` GEMMs with fp8 operands (per-tensor dynamic activation
    scale, per-tensor weight scale), on GPUs with FP8 tensor cores (sm_89+).
First and last layers (conv_in, conv_out) stay in the compute dtype, and so do layers whose error dominates: stored for
the measured bundled decoders (configs/fp8_sensitivity.json), or measured at run time when the probe misses the gate.
After conversion a probe decode is compared with the fp32 decode of the same weights; below the gate (default 40 dB
PSNR) the stage measures each layer's sensitivity on the probe (vaeopt/fp8_sensitivity.py), keeps the most sensitive
layers out of fp8 and probes again (at most twice); if that does not clear the gate either, the stage is undone and
says so, with the measured numbers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

# E4M3, E4M3_MAX, quantize_per_channel and quantize_per_tensor are defined in the kernels layer (shared with the fp8 conv's
# pack_weight) and stay public here.
from vaeopt.kernels.fp8_quant import E4M3, E4M3_MAX, quantize_per_channel, quantize_per_tensor  # noqa: F401
from vaeopt.stages import StageResult

NAME = "fp8"
KEEP = ("conv_in", "conv_out")  # the decoder's first and last layers: most sensitive, cheapest to keep


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


def _decoder(model: nn.Module) -> nn.Module:
    return getattr(model, "decoder", model)


def gemm_eligible(layer: nn.Module) -> bool:
    """Can `layer` run as a level-2 fp8 GEMM (on a CUDA device): a linear or a plain 1x1 conv, dims multiple of 16."""
    w = layer.weight
    return w.shape[0] % 16 == 0 and w[0].numel() % 16 == 0 and (
        type(layer) is nn.Linear
        or (type(layer) is nn.Conv2d and layer.kernel_size == (1, 1) and layer.groups == 1
            and layer.stride == (1, 1) and layer.padding == (0, 0)))


def is_kept(name: str, keep: tuple[str, ...] | list[str]) -> bool:
    return name in keep or name.startswith(tuple(k + "." for k in keep))


def plan_layers(model: nn.Module, keep=KEEP, compute: bool = True) -> list[tuple[str, nn.Module, str, nn.Module, str]]:
    """Every decoder conv/linear as (full name, parent, attribute, layer, path), path one of "gemm" (level 2),
    "storage" (level 1) or "kept" (stays in the compute dtype). `compute` is taken as given (the caller decides
    whether a GPU is there): the sensitivity measurement uses this to emulate the GPU's choice on a CPU."""
    out = []
    for parent_name, parent in _decoder(model).named_modules():
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, (nn.Conv2d, nn.Conv3d, nn.Linear)) or child.weight is None:
                continue
            if is_kept(full, keep):
                path = "kept"
            elif compute and gemm_eligible(child):
                path = "gemm"
            elif isinstance(child, (nn.Conv2d, nn.Conv3d)):
                path = "storage"
            else:
                continue  # a linear the GEMM path cannot take: not converted
            out.append((full, parent, name, child, path))
    return out


def convert(model: nn.Module, compute: bool = True, keep=KEEP) -> dict:
    """Convert decoder layers in place, all but those named in `keep` (and their children). Returns counts and bytes."""
    dec = _decoder(model)
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


@contextmanager
def _exact_fp32():
    """fp32 reference decodes without TF32 (PyTorch lets cuDNN convs use TF32 by default: ~1e-3 relative error, which
    would be charged to bf16/fp8 by the gate)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _kept_desc(keep: list[str], why: dict, rows: list[dict] | None, stored: str | None) -> str:
    """'conv_in, conv_out: first/last; a (50.3 dB alone, dominant), b (54.2 dB alone): most sensitive, measured ...'"""
    alone = {r["layer"]: r["psnr_db"] for r in rows or []}
    first = [k for k in keep if why.get(k) == "first/last"]
    prior = [k for k in keep if why.get(k) == "stored"]
    meas = [k for k in keep if why.get(k) in ("dominant", "gate")]
    parts = [f"{', '.join(first)}: first/last"] if first else []
    if prior:
        parts.append(f"{', '.join(prior)}: most sensitive in the stored measurement of {stored} "
                     "(configs/fp8_sensitivity.json)")
    if meas:
        parts.append(", ".join(f"{k} ({alone[k]:.1f} dB alone{', dominant' if why[k] == 'dominant' else ''})"
                               for k in meas) + ": most sensitive, measured on the probe")
    return "; ".join(parts)


def apply(model: nn.Module, family=None, gate_db: float = 40.0, device=None, dtype=torch.bfloat16,
          compute: bool = True, probe: torch.Tensor | None = None, sensitivity: str = "auto", margin_db: float = 1.0,
          max_rounds: int = 2, dominant_share: float = 0.25, max_keep_frac: float = 0.5, **_) -> StageResult:
    """Convert, probe, gate. Which layers stay in `dtype` (vaeopt/fp8_sensitivity.py measures and chooses):
      sensitivity="auto": conv_in/conv_out, plus the layers stored for this decoder in configs/fp8_sensitivity.json
          when it is one that was measured. If the probe misses the gate: measure each converted layer's sensitivity
          on the probe (one emulated fp32 decode per layer), keep the dominant and most sensitive ones until the
          predicted PSNR (calibrated on the failed probe) clears gate + margin_db, and probe again; at most
          `max_rounds` retries, and never more than `max_keep_frac` of the weights kept. Else undone.
      "always": measure before the first try as well (dominant layers are kept even where the gate would pass).
      "off": conv_in/conv_out only, one try.
    `probe`: the latent to probe with (default: a seeded N(0, 1) latent, 32x32 or 3x16x16)."""
    from vaeopt import fp8_sensitivity as sens
    from vaeopt.fidelity import psnr, psnr_text

    if sensitivity not in ("auto", "always", "off"):
        raise ValueError(f"sensitivity={sensitivity!r}: auto | always | off")
    if margin_db < 0:
        raise ValueError(f"margin_db={margin_db}: the retry aims at gate + margin, margin >= 0")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    z = (probe if probe is not None else _probe_latent(family, device)).to(device)
    dname = str(dtype).replace("torch.", "")
    compute_here = compute and device.type == "cuda"  # what convert() will do, for the emulation to match
    # fp32 reference of the same weights (upcast temporarily), and the plain low-precision decode for context
    model.float()
    with _exact_fp32():
        ref = _decode(model, z.float()).clamp(-1, 1)
    keep, why = list(KEEP), {k: "first/last" for k in KEEP}
    stored = sens.stored_keep(model) if sensitivity != "off" else None
    for n in stored[1] if stored else []:
        keep.append(n)
        why[n] = "stored"
    model.to(dtype)
    base = _decode(model, z.to(dtype)).clamp(-1, 1)
    p_base, base_mse = psnr(base, ref), sens.mse([base], [ref])
    sizes = {n: layer.weight.numel() for n, layer, _ in sens.candidates(model, compute_here)}
    rows, sens_s = None, 0.0

    def measure():  # per-layer sensitivity on the probe, emulated in fp32 (the fp8 error alone)
        nonlocal rows, sens_s
        t0 = time.perf_counter()
        model.float()
        with _exact_fp32():
            rows = sens.measure(model, [z.float()], names=[n for n in sizes if not is_kept(n, keep)],
                                compute=compute_here, ref=[ref])
        model.to(dtype)
        sens_s = time.perf_counter() - t0

    def choose(calib):
        kept, _pred, w = sens.choose_keep(rows, gate_db + margin_db, keep=keep, floor_mse=base_mse, calib=calib,
                                          dominant_share=dominant_share)
        return kept, {**w, **why}

    if sensitivity == "always":
        measure()
        keep, why = choose(1.0)
    tries, stop = [], ""
    while True:
        stats = convert(model, compute=compute, keep=keep)
        try:
            out = _decode(model, z.to(dtype)).clamp(-1, 1)
        except RuntimeError as e:  # an fp8 kernel this torch/GPU combination lacks: undo, say why
            revert(model)
            return StageResult(NAME, "fallback", f"fp8 decode failed here, undone: {str(e).splitlines()[0][:150]}",
                               {**stats, "error": str(e)[:500]})
        p = psnr(out, ref)
        tries.append({"kept": list(keep), "fp8_layers": stats["storage"] + stats["gemm"], "psnr_db": p})
        if p >= gate_db:
            break
        revert(model)
        if sensitivity == "off" or len(tries) > max_rounds:
            break
        if p_base < gate_db:
            stop = f"{dname} alone is under the gate"
            break
        if rows is None:
            measure()
        fp8_sum = sum(r["mse"] for r in rows if not is_kept(r["layer"], keep))
        calib = (sens.mse([out], [ref]) - base_mse) / fp8_sum if fp8_sum > 0 else 1.0
        new_keep, new_why = choose(calib)
        if len(new_keep) == len(keep):  # (with margin >= 0 the failed probe always asks for more)
            stop = "no layer left to keep"
            break
        frac = sum(v for n, v in sizes.items() if is_kept(n, new_keep)) / sum(sizes.values())
        if frac > max_keep_frac:
            stop = (f"the gate would need {len(new_keep)} layers, {100 * frac:.0f}% of the weights, kept in {dname}: "
                    "not worth it")
            break
        keep, why = new_keep, new_why
    if p < gate_db and not stop and len(tries) > 1:
        stop = f"still under the gate after {len(tries) - 1} retr{'y' if len(tries) == 2 else 'ies'}"
    saved = (stats["bytes_before"] - stats["bytes_after"]) / 2**20
    data = {**stats, "psnr_db": p, "psnr_plain_db": p_base, "gate_db": gate_db, "saved_mib": saved,
            "kept_layers": keep, "kept_why": {k: why[k] for k in keep}, "tries": tries,
            "stored": stored[0] if stored else None, "sensitivity_s": sens_s,
            "sensitivity": [{"layer": r["layer"], "psnr_db": r["psnr_db"]} for r in rows] if rows else None}
    # what happened: "; tries: 39.5 dB with 37 in e4m3 -> 42.3 dB with 35 in e4m3; per-layer sensitivity on the probe
    # (37 decodes, 0.2 s)"
    hist = ""
    if rows is not None or len(tries) > 1:
        steps = [f"{t['psnr_db']:.1f} dB with {t['fp8_layers']} in e4m3" for t in tries]
        measured = f"per-layer sensitivity on the probe ({len(rows)} decodes, {sens_s:.1f} s)" if rows else ""
        hist = (f"; tries: {' -> '.join(steps)}" if len(tries) > 1 else "") + (f"; {measured}" if measured else "")
    if p < gate_db:
        return StageResult(NAME, "fallback",
                           f"probe {p:.1f} dB vs fp32 < gate {gate_db:g} dB with {len(keep)} kept in {dname} "
                           f"({_kept_desc(keep, why, rows, stored and stored[0])}){hist}"
                           f"{': ' + stop if stop else ''}; undone ({dname} alone: {psnr_text(p_base)})", data)
    how = (f"{stats['storage']} convs with weight storage, {stats['gemm']} 1x1/linear as fp8 GEMMs" if compute_here
           else "weight storage, dequantized per layer: level 1 only, no fp8 GEMMs")
    return StageResult(NAME, "applied",
                       f"{stats['storage'] + stats['gemm']} layers in e4m3 ({how}), kept {stats['kept']} in {dname} "
                       f"({_kept_desc(keep, why, rows, stored and stored[0])}); weights {saved:.1f} MiB smaller; "
                       f"probe {p:.1f} dB vs fp32 (gate {gate_db:g}; {dname} alone {psnr_text(p_base)}){hist}", data)
