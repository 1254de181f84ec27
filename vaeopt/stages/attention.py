"""Attention backend: the VAE mid-block attention through SDPA with the fastest backend for its head dim.

The SD-family VAE has one head of dim 512 (Wan: 384); flash attention takes head_dim <= 256, so SDPA falls back to
the memory-efficient kernel there. This stage probes which backends accept the model's real head dim on this device
and reports the one SDPA will use.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from vaeopt.stages import StageResult

NAME = "attention"


def available(device: torch.device) -> tuple[bool, str]:
    return True, ""


def _head_dims(model: nn.Module) -> list[int]:
    dims = set()
    dec = getattr(model, "decoder", model)
    for m in dec.modules():
        cls = type(m).__name__
        if cls == "Attention" and getattr(m, "heads", None):
            dims.add(m.inner_dim // m.heads if hasattr(m, "inner_dim") else m.to_q.out_features // m.heads)
        elif cls in ("WanAttentionBlock",):
            dims.add(m.dim)
    return sorted(dims)


def _probe(head_dim: int, device: torch.device, dtype: torch.dtype) -> list[str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ok = []
    q = torch.randn(1, 1, 64, head_dim, device=device, dtype=dtype)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("mem_efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            # torch warns for each backend it cannot use here (head_dim > 256: six UserWarnings on a GPU): the
            # result is what this probe reports, so the warnings stay out of the user's console
            with warnings.catch_warnings(), sdpa_kernel([be]):
                warnings.simplefilter("ignore")
                F.scaled_dot_product_attention(q, q, q)
            ok.append(name)
        except RuntimeError:
            pass
    return ok


def apply(model: nn.Module, device: torch.device | None = None, dtype: torch.dtype = torch.float32, **_) -> StageResult:
    dims = _head_dims(model)
    if not dims:
        return StageResult.skipped(NAME, "model has no attention in its decoder")
    # diffusers' VAE Attention defaults to AttnProcessor2_0 (SDPA); make sure nothing else was set.
    n = 0
    chunked = 0
    for m in model.modules():
        if type(m).__name__ == "Attention" and hasattr(m, "set_processor"):
            from diffusers.models.attention_processor import AttnProcessor2_0

            if type(m.processor).__name__ == "ChunkedAttnProcessor":
                chunked += 1  # fused_epilogues already replaced SDPA for this wide head
            elif not isinstance(m.processor, AttnProcessor2_0):
                m.set_processor(AttnProcessor2_0())
                n += 1
    device = device or next(model.parameters()).device
    per_dim = {d: _probe(d, device, dtype) for d in dims}
    desc = "; ".join(f"head_dim {d}: SDPA uses {v[0] if v else 'none'} (usable: {', '.join(v)})" for d, v in per_dim.items())
    data = {"head_dims": dims, "backends": per_dim, "switched": n, "chunked": chunked}
    if chunked:
        desc = (f"{chunked} block(s) on exact query-chunked GEMM attention (set by fused_epilogues; SDPA would use "
                f"{', '.join(v[0] for v in per_dim.values() if v)})")
    if n:
        return StageResult(NAME, "applied", f"switched {n} attention processors to SDPA; {desc}", data)
    return StageResult(NAME, "skipped", f"nothing to change: already SDPA; {desc}", data)
