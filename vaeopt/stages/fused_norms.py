"""Stage `fused_norms`: swap the decoder's norm -> SiLU pairs for one fused Triton kernel each.

- AutoencoderKL (SD/SDXL/SD3/FLUX) and AutoencoderKLHunyuanVideo: in every resnet block whose forward is
  norm1 -> SiLU -> ... -> norm2 -> SiLU, norm1/norm2 become FusedGroupNormSiLU and `nonlinearity` becomes Identity;
  the decoder's conv_norm_out + conv_act likewise; attention blocks' group_norm becomes a GroupNorm-only kernel.
- AutoencoderKLWan (2.1, 2.2): WanResidualBlock norm1/norm2 + nonlinearity and the decoder head's norm_out +
  nonlinearity become FusedRMSNormSiLU; the attention block's norm an RMS-only kernel. The blocks' causal caches
  store x after norm+SiLU, which is exactly what the fused module returns, so chunked decoding is unchanged.

Only the decoder is touched. The fused modules hold the *same* Parameter objects under the same names (state_dict
keys and later .to() conversions are unaffected), run the kernel on CUDA (or on CPU under TRITON_INTERPRET=1), and
otherwise — other devices/dtypes, autocast, torch.compile tracing — the exact torch ops of the modules they replace.
`revert(model)` puts the original modules back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vaeopt.kernels import triton_available
from vaeopt.stages import StageResult, needs_autograd, unhooked
from vaeopt.stages.marks import FUSED_NORMS

NAME = "fused_norms"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MARK = FUSED_NORMS  # model attribute: [(parent, attr, original module), ...] for revert


def use_kernel(x: torch.Tensor, *params) -> bool:
    """`params`: the weights the kernel reads. The kernels have no backward: under grad mode, a tensor that needs a
    gradient takes the torch ops (else autograd would silently return no gradient for it)."""
    if needs_autograd(x, *params):
        return False
    if x.dtype not in _KERNEL_DTYPES or torch.is_autocast_enabled(x.device.type):
        return False  # autocast runs GroupNorm in fp32 with an fp32 output: leave those semantics to torch
    if torch.compiler.is_compiling():
        return False  # let inductor trace (and fuse) the plain ops instead of graph-breaking on a launcher
    return triton_available(x.device)[0]


class FusedGroupNormSiLU(nn.Module):
    """nn.GroupNorm followed by SiLU (silu=True) or alone (silu=False), as one kernel; NCHW/NHWC/NCDHW/NDHWC."""

    def __init__(self, norm: nn.GroupNorm, silu: bool = True):
        super().__init__()
        self.num_groups, self.num_channels, self.eps, self.affine = (
            norm.num_groups, norm.num_channels, norm.eps, norm.affine,
        )  # fmt: skip
        self.weight = norm.weight  # shared Parameter (or None)
        self.bias = norm.bias
        self.silu = silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernel(x, self.weight, self.bias):
            from vaeopt.kernels.group_norm_silu import group_norm_silu

            return group_norm_silu(x, self.num_groups, self.weight, self.bias, self.eps, self.silu)
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if self.silu else y

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, silu={self.silu}"


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    return out.copy_(y)


def writes_into(m: nn.Module) -> bool:
    """m is one of this stage's RMS norm (+ SiLU) modules, unhooked, so `m(x, out=buf)` writes its result straight
    into a buffer (a conv's padded input) instead of a new tensor that is then copied there."""
    return type(m) in (FusedRMSNormSiLU, FusedPixelRMSNormSiLU) and unhooked(m)


class FusedRMSNormSiLU(nn.Module):
    """diffusers' WanRMS_norm (channel_first) followed by SiLU (silu=True) or alone, as one kernel."""

    def __init__(self, norm: nn.Module, silu: bool = True):
        super().__init__()
        self.channel_first = True
        self.scale = norm.scale
        self.gamma = norm.gamma  # shared Parameter, shape (C, 1, 1[, 1])
        self.bias = norm.bias  # shared Parameter, or the float 0.0 of a bias-free norm
        self.eps = 1e-12  # F.normalize's default, as WanRMS_norm uses it
        self.silu = silu

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: where to write the result (x's shape; e.g. the interior of a conv's padded input buffer), returned."""
        if use_kernel(x, self.gamma, self.bias):
            from vaeopt.kernels.rms_norm_silu import rms_norm_silu

            return rms_norm_silu(x, self.gamma, self.bias, self.eps, self.silu, scale=self.scale, out=out)
        # WanRMS_norm.forward, op for op
        upcast = x.dtype in (torch.float16, torch.bfloat16)
        y = F.normalize(x.float() if upcast else x, dim=1, eps=self.eps).to(x.dtype)
        y = y * self.scale * self.gamma + self.bias
        return _into(F.silu(y) if self.silu else y, out)

    def extra_repr(self) -> str:
        return f"{self.gamma.shape[0]}, scale={self.scale:.4g}, silu={self.silu}"


class FusedPixelRMSNormSiLU(nn.Module):
    """LTX-2's weight-free PerChannelRMSNorm (x / sqrt(mean over channels of x^2 + eps)) followed by SiLU (silu=True)
    or alone, as the rms_norm_silu kernel with a unit gamma: F.normalize(x) * sqrt(C) is x / sqrt(mean(x^2)), the
    kernel clamping the norm at sqrt(C * eps) where diffusers adds eps under the root (the same but for pixels whose
    channels are all ~0). The kernel normalizes in fp32; diffusers in the input dtype (bf16: the kernel is closer to
    the fp32 decode)."""

    def __init__(self, norm: nn.Module, silu: bool = True):
        super().__init__()
        self.eps = float(norm.eps)
        self.silu = silu
        self._ones: dict[tuple, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: where to write the result (x's shape; e.g. the interior of a conv's padded input buffer), returned."""
        if use_kernel(x):
            from vaeopt.kernels.rms_norm_silu import rms_norm_silu

            c = x.shape[1]
            key = (c, x.device)
            g = self._ones.get(key)
            if g is None:
                g = self._ones[key] = torch.ones(c, device=x.device, dtype=torch.float32)
            return rms_norm_silu(x, g, None, (c * self.eps) ** 0.5, self.silu, scale=c**0.5, out=out)
        # PerChannelRMSNorm.forward, op for op
        y = x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + self.eps)
        return _into(F.silu(y) if self.silu else y, out)

    def extra_repr(self) -> str:
        return f"eps={self.eps:g}, silu={self.silu}"


def available(device: torch.device | str | None = None) -> tuple[bool, str]:
    return triton_available(device)


# --- matching --------------------------------------------------------------------------------------------------


def diffusers_classes() -> dict[str, type | None]:
    """diffusers classes whose forward we rely on (None where this diffusers lacks them)."""
    import importlib

    where = {
        "ResnetBlock2D": "diffusers.models.resnet",
        "Decoder": "diffusers.models.autoencoders.vae",
        "Attention": "diffusers.models.attention_processor",
        "HunyuanVideoResnetBlockCausal3D": "diffusers.models.autoencoders.autoencoder_kl_hunyuan_video",
        "HunyuanVideoDecoder3D": "diffusers.models.autoencoders.autoencoder_kl_hunyuan_video",
        "WanRMS_norm": "diffusers.models.autoencoders.autoencoder_kl_wan",
        "WanResidualBlock": "diffusers.models.autoencoders.autoencoder_kl_wan",
        "WanAttentionBlock": "diffusers.models.autoencoders.autoencoder_kl_wan",
        "WanDecoder3d": "diffusers.models.autoencoders.autoencoder_kl_wan",
        # HunyuanVideo 1.5's RMS norm is WanRMS_norm's formula (F.normalize over channels, fp32 for 16-bit inputs,
        # * sqrt(C) * gamma + bias), so the same kernel serves it
        "HunyuanVideo15RMS_norm": "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15",
        "HunyuanVideo15ResnetBlock": "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15",
        "HunyuanVideo15AttnBlock": "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15",
        "HunyuanVideo15Decoder3D": "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15",
        "PerChannelRMSNorm": "diffusers.models.autoencoders.autoencoder_kl_ltx2",
        "LTX2VideoResnetBlock3d": "diffusers.models.autoencoders.autoencoder_kl_ltx2",
        "LTX2VideoDecoder3d": "diffusers.models.autoencoders.autoencoder_kl_ltx2",
    }
    out = {}
    for name, mod in where.items():
        try:
            out[name] = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            out[name] = None
    return out


def _same_forward(m: nn.Module, cls: type | None) -> bool:
    """m runs cls.forward unmodified (so the norm -> nonlinearity order we read in diffusers' source holds)."""
    return cls is not None and isinstance(m, cls) and type(m).forward is cls.forward


def _is_gn(m) -> bool:
    return type(m) is nn.GroupNorm and unhooked(m)


def _is_silu(m) -> bool:
    return type(m) is nn.SiLU and unhooked(m)


def _is_pixel_rms(m, cls) -> bool:
    return cls is not None and type(m) is cls and m.channel_dim == 1 and unhooked(m)


def _is_wan_rms(m, cls) -> bool:
    return cls is not None and type(m) is cls and m.channel_first and unhooked(m)


# the modules a match replaces: a hook on any of them (a user's forward hook, accelerate / diffusers offloading or
# casting) leaves the whole pair as it is, so that the hook still fires (the replaced module would never be called)
_PARTS = {"ResnetBlock2D": ("norm1", "norm2", "nonlinearity"),
          "HunyuanVideoResnetBlockCausal3D": ("norm1", "norm2", "nonlinearity"),
          "Decoder": ("conv_norm_out", "conv_act"), "HunyuanVideoDecoder3D": ("conv_norm_out", "conv_act"),
          "Attention": ("group_norm",), "WanResidualBlock": ("norm1", "norm2", "nonlinearity"),
          "WanDecoder3d": ("norm_out", "nonlinearity"), "WanAttentionBlock": ("norm",),
          "HunyuanVideo15ResnetBlock": ("norm1", "norm2", "nonlinearity"),
          "HunyuanVideo15Decoder3D": ("norm_out", "conv_act"), "HunyuanVideo15AttnBlock": ("norm",),
          "LTX2VideoResnetBlock3d": ("norm1", "norm2", "nonlinearity"), "LTX2VideoDecoder3d": ("norm_out", "conv_act")}


def hooked_parts(decoder: nn.Module, attention: bool = True) -> list[str]:
    """Names (under the decoder) of the norm / SiLU modules the stage would replace but leaves because they carry
    hooks. Matched by class name, as _plan matches by class."""
    out = []
    for name, m in decoder.named_modules():
        kind = type(m).__name__
        if not attention and kind in ("Attention", "WanAttentionBlock", "HunyuanVideo15AttnBlock"):
            continue
        for attr in _PARTS.get(kind, ()):
            sub = getattr(m, attr, None)
            if isinstance(sub, nn.Module) and not unhooked(sub):
                out.append(f"decoder.{name}.{attr}" if name else f"decoder.{attr}")
    return out


def _plan(decoder: nn.Module, attention: bool) -> tuple[list[tuple[nn.Module, str, nn.Module]], dict[str, int]]:
    """-> [(parent, attr, new module)], counts. Pure: builds the replacements, changes nothing."""
    K = diffusers_classes()
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    n = {"gn_silu": 0, "gn": 0, "rms_silu": 0, "rms": 0, "hooked": hooked_parts(decoder, attention)}
    for m in decoder.modules():
        if _same_forward(m, K["ResnetBlock2D"]):
            # nonlinearity touches temb only when time_emb_proj exists; unless "scale_shift", norm2 comes right
            # before the nonlinearity (a temb, if any, is added *before* norm2) -> both pairs fuse exactly.
            # (Decoder passes time_embedding_norm="group", which takes the plain norm2 branch.)
            ok = m.time_emb_proj is None and m.time_embedding_norm != "scale_shift"
            ok = ok and _is_gn(m.norm1) and _is_gn(m.norm2) and _is_silu(m.nonlinearity)
        elif _same_forward(m, K["HunyuanVideoResnetBlockCausal3D"]):
            ok = _is_gn(m.norm1) and _is_gn(m.norm2) and _is_silu(m.nonlinearity)
        else:
            ok = None
        if ok:
            swaps += [(m, "norm1", FusedGroupNormSiLU(m.norm1)), (m, "norm2", FusedGroupNormSiLU(m.norm2))]
            swaps.append((m, "nonlinearity", nn.Identity()))
            n["gn_silu"] += 2
            continue
        if ok is None and (_same_forward(m, K["Decoder"]) or _same_forward(m, K["HunyuanVideoDecoder3D"])):
            if _is_gn(m.conv_norm_out) and _is_silu(m.conv_act):  # not SpatialNorm (MoVQ-style decoders)
                swaps += [(m, "conv_norm_out", FusedGroupNormSiLU(m.conv_norm_out)), (m, "conv_act", nn.Identity())]
                n["gn_silu"] += 1
            continue
        if attention and K["Attention"] is not None and isinstance(m, K["Attention"]) and _is_gn(m.group_norm):
            swaps.append((m, "group_norm", FusedGroupNormSiLU(m.group_norm, silu=False)))
            n["gn"] += 1
            continue
        # Wan: norm1 -> nonlinearity -> (cache) conv1 -> norm2 -> nonlinearity -> dropout -> (cache) conv2.
        if _same_forward(m, K["WanResidualBlock"]):
            rms = K["WanRMS_norm"]
            if _is_wan_rms(m.norm1, rms) and _is_wan_rms(m.norm2, rms) and _is_silu(m.nonlinearity):
                swaps += [(m, "norm1", FusedRMSNormSiLU(m.norm1)), (m, "norm2", FusedRMSNormSiLU(m.norm2))]
                swaps.append((m, "nonlinearity", nn.Identity()))
                n["rms_silu"] += 2
        elif _same_forward(m, K["WanDecoder3d"]):
            # the decoder's own nonlinearity is used only in its head, right after norm_out
            if _is_wan_rms(m.norm_out, K["WanRMS_norm"]) and _is_silu(m.nonlinearity):
                swaps += [(m, "norm_out", FusedRMSNormSiLU(m.norm_out)), (m, "nonlinearity", nn.Identity())]
                n["rms_silu"] += 1
        elif attention and _same_forward(m, K["WanAttentionBlock"]) and _is_wan_rms(m.norm, K["WanRMS_norm"]):
            swaps.append((m, "norm", FusedRMSNormSiLU(m.norm, silu=False)))
            n["rms"] += 1
        # HunyuanVideo 1.5: norm1 -> nonlinearity -> conv1 -> norm2 -> nonlinearity -> conv2; the decoder's head
        # norm_out -> conv_act; the mid-block attention's norm alone
        elif _same_forward(m, K["HunyuanVideo15ResnetBlock"]):
            rms = K["HunyuanVideo15RMS_norm"]
            if _is_wan_rms(m.norm1, rms) and _is_wan_rms(m.norm2, rms) and _is_silu(m.nonlinearity):
                swaps += [(m, "norm1", FusedRMSNormSiLU(m.norm1)), (m, "norm2", FusedRMSNormSiLU(m.norm2))]
                swaps.append((m, "nonlinearity", nn.Identity()))
                n["rms_silu"] += 2
        elif _same_forward(m, K["HunyuanVideo15Decoder3D"]):
            if _is_wan_rms(m.norm_out, K["HunyuanVideo15RMS_norm"]) and _is_silu(m.conv_act):
                swaps += [(m, "norm_out", FusedRMSNormSiLU(m.norm_out)), (m, "conv_act", nn.Identity())]
                n["rms_silu"] += 1
        elif (attention and _same_forward(m, K["HunyuanVideo15AttnBlock"])
              and _is_wan_rms(m.norm, K["HunyuanVideo15RMS_norm"])):
            swaps.append((m, "norm", FusedRMSNormSiLU(m.norm, silu=False)))
            n["rms"] += 1
        # LTX-2: norm1 -> [timestep scale/shift] -> nonlinearity -> conv1 -> norm2 -> [scale/shift] -> nonlinearity;
        # the head norm_out -> [scale/shift] -> conv_act. Pairs fuse where no timestep scale/shift sits between them.
        elif _same_forward(m, K["LTX2VideoResnetBlock3d"]):
            px = K["PerChannelRMSNorm"]
            if (m.scale_shift_table is None and _is_pixel_rms(m.norm1, px) and _is_pixel_rms(m.norm2, px)
                    and _is_silu(m.nonlinearity)):
                swaps += [(m, "norm1", FusedPixelRMSNormSiLU(m.norm1)), (m, "norm2", FusedPixelRMSNormSiLU(m.norm2))]
                swaps.append((m, "nonlinearity", nn.Identity()))
                n["rms_silu"] += 2
        elif _same_forward(m, K["LTX2VideoDecoder3d"]):
            if (m.time_embedder is None and _is_pixel_rms(m.norm_out, K["PerChannelRMSNorm"])
                    and _is_silu(m.conv_act)):
                swaps += [(m, "norm_out", FusedPixelRMSNormSiLU(m.norm_out)), (m, "conv_act", nn.Identity())]
                n["rms_silu"] += 1
    return swaps, n


def _describe(n: dict[str, int]) -> str:
    parts = []
    if n["gn_silu"]:
        parts.append(f"fused {n['gn_silu']} GroupNorm+SiLU pairs")
    if n["gn"]:
        parts.append(f"{n['gn']} GroupNorm (attention)")
    if n["rms_silu"]:
        parts.append(f"fused {n['rms_silu']} RMSNorm+SiLU pairs")
    if n["rms"]:
        parts.append(f"{n['rms']} RMSNorm (attention)")
    return ", ".join(parts) + _hooked_note(n["hooked"])


def _hooked_note(hooked: list[str]) -> str:
    if not hooked:
        return ""
    more = f" and {len(hooked) - 2} more" if len(hooked) > 2 else ""
    return (f"; left unfused where modules carry hooks, so that they still fire ({', '.join(hooked[:2])}{more})")


def has_fused_rms_norms(dec: nn.Module) -> bool:
    """This stage swapped RMS norm + SiLU pairs in `dec` (Wan's fused chunk decode reads its kernels' parameters)."""
    return any(type(m) is FusedRMSNormSiLU for m in dec.modules())


def apply(model: nn.Module, attention: bool = True, device: torch.device | str | None = None) -> StageResult:
    """Patch model.decoder in place. `attention`: also swap attention blocks' norms. `device`: where the kernels
    will run (default: the model's device) — checked for triton support."""
    if getattr(model, _MARK, None):
        return StageResult.skipped(NAME, f"already applied ({len(getattr(model, _MARK))} modules swapped)")
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else None
    ok, why = triton_available(device)
    if not ok:
        return StageResult.skipped(NAME, why)
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return StageResult.skipped(NAME, f"{type(model).__name__} has no decoder")
    swaps, n = _plan(decoder, attention)
    if not swaps:
        return StageResult.skipped(NAME, f"no fusable norms in {type(model).__name__}'s decoder"
                                   + _hooked_note(n["hooked"]), hooked=n["hooked"])
    record = []
    for parent, attr, new in swaps:
        old = getattr(parent, attr)
        if isinstance(old, nn.Module):  # keep the new module on the old one's device (the Identity has no params)
            new.train(old.training)
        record.append((parent, attr, old))
        setattr(parent, attr, new)
    setattr(model, _MARK, record)
    return StageResult(NAME, "applied", _describe(n), dict(n, modules_swapped=len(record), backend=why))


def revert(model: nn.Module) -> None:
    """Put back every module apply() swapped (no-op if it was not applied)."""
    record = getattr(model, _MARK, None)
    if not record:
        return
    for parent, attr, old in reversed(record):
        setattr(parent, attr, old)
    delattr(model, _MARK)
