"""Attention backend: the VAE mid-block attention through SDPA with the fastest backend for its head dim.

The SD-family VAE has one head of dim 512 (Wan: 384); flash attention takes head_dim <= 256, so SDPA falls back to
the memory-efficient kernel there. This stage probes which backends accept the model's real head dim on this device
and reports the one SDPA will use.

HunyuanVideo: diffusers' mid-block attention is causal over frames (a query of frame f sees the keys of frames <= f)
and builds that as an additive mask of (frames * h * w)^2 elements before every call (GiBs at video sizes).
Here the mid-block's forward is replaced by the same computation without the mask: the module's own group_norm
(over all frames of the call, as before), to_q/k/v and to_out, and for each query frame an attention over the
prefix of keys it may see, which is what the mask selects (`frame_causal_attention`): exact, and about half the
score work, since the masked half is never computed. The prefix attention is `fused_epilogues.chunked_attention`
(fp32 scores and softmax, query chunks bounded in memory). Measured 1-4% faster per decode (docs/experiments.md E39).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from vaeopt.stages import BoundForward, StageResult, class_forward, needs_autograd, unhooked
from vaeopt.stages.fused_epilogues import chunked_attention
from vaeopt.stages.marks import FP8_ATTR

NAME = "attention"
_MARK = "_vaeopt_frame_causal"  # model attribute: the mid-blocks whose forward this stage replaced


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


def frame_causal_attention(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HunyuanVideoMidBlock3D's attention step on x (B, C, T, H, W): AttnProcessor2_0 of `attn` with the mask of
    prepare_causal_attention_mask (token of frame f attends to the tokens of frames <= f), computed frame by frame
    over key prefixes instead of through the (T*H*W)^2 mask. Returns (B, C, T, H, W)."""
    B, _, T, H, W = x.shape
    hw = H * W
    tokens = x.permute(0, 2, 3, 4, 1).flatten(1, 3)  # (B, T*H*W, C), as the stock block
    h = tokens
    if attn.group_norm is not None:
        h = attn.group_norm(h.transpose(1, 2)).transpose(1, 2)
    q, k, v = attn.to_q(h), attn.to_k(h), attn.to_v(h)
    del h
    d = k.shape[-1] // attn.heads
    q, k, v = (t.view(B, -1, attn.heads, d).transpose(1, 2) for t in (q, k, v))
    out = torch.empty((B, attn.heads, T * hw, v.shape[-1]), device=x.device, dtype=v.dtype)
    for f in range(T):
        end = (f + 1) * hw
        out[:, :, f * hw:end] = chunked_attention(q[:, :, f * hw:end], k[:, :, :end], v[:, :, :end])
    del q, k, v
    o = out.transpose(1, 2).reshape(B, T * hw, -1).to(tokens.dtype)
    o = attn.to_out[1](attn.to_out[0](o))
    if attn.residual_connection:
        o = o + tokens
    o = o / attn.rescale_output_factor
    return o.unflatten(1, (T, H, W)).permute(0, 4, 1, 2, 3)


def _plain_attention(attn) -> bool:
    """An Attention the frame-causal step computes exactly as AttnProcessor2_0 would: self-attention with that
    processor, no spatial / q / k norms, no hooks on it or its projections."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    if type(attn.processor) is not AttnProcessor2_0 and type(attn.processor).__name__ != "ChunkedAttnProcessor":
        return False
    if attn.spatial_norm is not None or attn.norm_q is not None or attn.norm_k is not None or attn.is_cross_attention:
        return False
    mods = [attn, attn.to_q, attn.to_k, attn.to_v, *attn.to_out]
    return all(unhooked(m) for m in mods)


def _hunyuan_mid_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """HunyuanVideoMidBlock3D.forward without the (T*H*W)^2 mask (frame_causal_attention); the stock forward where
    autograd needs it (gradient checkpointing) or an attention is not plain."""
    cls = type(self)
    if (needs_autograd(hidden_states, self) or torch.compiler.is_compiling()
            or not all(a is None or _plain_attention(a) for a in self.attentions)):
        return cls.forward(self, hidden_states)
    hidden_states = self.resnets[0](hidden_states)
    for attn, resnet in zip(self.attentions, self.resnets[1:]):
        if attn is not None:
            hidden_states = frame_causal_attention(attn, hidden_states)
        hidden_states = resnet(hidden_states)
    return hidden_states


def _patch_hunyuan(model: nn.Module) -> int:
    """Replace each stock HunyuanVideoMidBlock3D forward in the decoder; -> how many (already patched count)."""
    try:
        from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoMidBlock3D
    except ImportError:  # pragma: no cover - an older diffusers
        return 0
    done = getattr(model, _MARK, None)
    if done is not None:
        return len(done)
    blocks = [m for m in getattr(model, "decoder", model).modules()
              if type(m) is HunyuanVideoMidBlock3D and class_forward(m)
              and any(a is not None for a in m.attentions)]
    for m in blocks:
        m.forward = BoundForward(_hunyuan_mid_forward, m)
    if blocks:
        setattr(model, _MARK, blocks)
    return len(blocks)


def revert(model: nn.Module) -> None:
    """Give the HunyuanVideo mid-blocks their stock forward back (processors switched to SDPA stay SDPA)."""
    for m in getattr(model, _MARK, None) or []:
        m.__dict__.pop("forward", None)
    model.__dict__.pop(_MARK, None)


def apply(model: nn.Module, device: torch.device | None = None, dtype: torch.dtype = torch.float32, **_) -> StageResult:
    dims = _head_dims(model)
    if not dims:
        return StageResult.skipped(NAME, "model has no attention in its decoder")
    causal = _patch_hunyuan(model)
    # diffusers' VAE Attention defaults to AttnProcessor2_0 (SDPA). Only the decoder's, and only diffusers' plain
    # eager AttnProcessor (set_default_attn_processor) is switched: a processor the user chose (their own class,
    # xformers, ...) is theirs to keep, and the encoder is not this stage's business.
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0


    n = chunked = fp8 = 0
    kept = []

    for name, m in getattr(model, "decoder", model).named_modules():
        if type(m).__name__ == "Attention" and hasattr(m, "set_processor"):
            if type(m.processor).__name__ == "ChunkedAttnProcessor":
                chunked += 1  # fused_epilogues already replaced SDPA for this wide head
                fp8 += bool(getattr(m, FP8_ATTR, False))  # the fp8 convs stage's gate admitted its e4m3 core
            elif type(m.processor) is AttnProcessor:
                m.set_processor(AttnProcessor2_0())
                n += 1
            elif type(m.processor) is not AttnProcessor2_0:
                kept.append(f"{name} ({type(m.processor).__name__})")
    device = device or next(model.parameters()).device
    per_dim = {d: _probe(d, device, dtype) for d in dims}
    desc = "; ".join(f"head_dim {d}: SDPA uses {v[0] if v else 'none'} (usable: {', '.join(v)})" for d, v in per_dim.items())
    data = {"head_dims": dims, "backends": per_dim, "switched": n, "chunked": chunked, "frame_causal": causal}
    if chunked:
        how = ("exact query-chunked GEMM attention" if not fp8 else
               "query-chunked GEMM attention" + (" in e4m3" if fp8 == chunked else f", {fp8} of them in e4m3")
               + " (admitted by the fp8 convs gate)")
        desc = (f"{chunked} block(s) on {how} (set by fused_epilogues; SDPA would use "
                f"{', '.join(v[0] for v in per_dim.values() if v)})")
        data["fp8_blocks"] = fp8
    if causal:  # the mid-block is the decoder's only attention: SDPA's backend no longer matters there
        desc = ("HunyuanVideo mid-block: frame-causal attention over key prefixes, exact, without diffusers' "
                "(frames x h x w)^2 mask (query-chunked GEMM attention, fp32 scores; no SDPA)")
    if kept:
        data["kept"] = kept
        desc += f"; kept the processor set on {', '.join(kept[:2])}{', ...' if len(kept) > 2 else ''}"
    if n or causal:
        return StageResult(NAME, "applied", (f"switched {n} attention processors to SDPA; " if n else "") + desc, data)
    return StageResult(NAME, "skipped", f"nothing to change{': already SDPA' if not kept else ''}; {desc}", data)
