"""The pieces of Wan's chunk decoder (vaeopt.engine.wan) that its configurations share: the clip's chunk schedule,
checks of the model and latents, the RMS-norm + SiLU writes into conv input buffers, the frame-wise 2x upsample +
conv (phase convs where stages/upsample_conv marked the conv), and the hand-over records between blocks."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vaeopt.errors import CheckpointError, LatentError
from vaeopt.kernels import flat_layout
from vaeopt.kernels.tapconv import tap_weights
from vaeopt.stages import cached_weight, unhooked, upsample_conv
from vaeopt.stages.fused_norms import FusedRMSNormSiLU
from vaeopt.stages.marks import is_2x_nearest
from vaeopt.stages.stacked_conv3d import stacked_weight
from vaeopt.stages.triton_conv import packed_for

Chunk = int | Sequence[int] | None

# RMS norm runs over frame groups of at most this many elements (>= 1 frame): bounds its fp32 temporaries.
NORM_SLICE_ELEMS = 1 << 26
# Several CUDA kernels index with int32 (NHWC nearest upsampling; cuDNN cannot split a batch of 1), and big chunks at
# 720p would cross 2^31 elements. The 2x upsample + conv2d always runs over frame groups of at most SPLIT_ELEMS
# upsampled elements (it also bounds that transient); a Conv3d whose input or output would reach INT32_ELEMS runs
# over temporal windows of about SPLIT_ELEMS / 2 elements.
SPLIT_ELEMS = 1 << 30
INT32_ELEMS = 2**31 - 1
E4M3 = getattr(torch, "float8_e4m3fn", None)


def wan_module():
    from diffusers.models.autoencoders import autoencoder_kl_wan

    return autoencoder_kl_wan


def check_vae(vae) -> None:
    if type(vae).__name__ != "AutoencoderKLWan" or not hasattr(vae, "decoder"):
        raise CheckpointError(
            f"vaeopt.video decodes AutoencoderKLWan (Wan 2.1 / 2.2) only, not {type(vae).__name__}; "
            "use the model's own decode for other video VAEs"
        )
    if active_dropout(vae):
        raise CheckpointError("vaeopt.video decodes without dropout, and this model is in training mode with active "
                              "dropout (p > 0): decode with vae.decode (diffusers' own decode, its dropout included), "
                              "or call vae.eval()")


def active_dropout(vae) -> bool:
    """Whether a decode in the model's current mode would drop activations: training mode (a model built with
    __init__ / from_config, or after .train()) with a dropout of p > 0 in its decoder. Training mode alone changes
    nothing in Wan's decoder (no batch norm), so the chunk decoder's result is diffusers' own there."""
    return any(m.training and getattr(m, "p", 0) > 0 for m in vae.decoder.modules()
               if isinstance(m, torch.nn.modules.dropout._DropoutNd))


def temporal_factor(vae) -> int:
    wan = wan_module()
    n = sum(isinstance(m, wan.WanResample) and m.mode == "upsample3d" for m in vae.decoder.modules())
    return 2**n


def chunk_schedule(num_latent_frames: int, chunk: Chunk) -> list[int]:
    """Latent frames per decoder call. `chunk` None/<=0/>=T: one call. An int K: every call but the first has K
    frames, the first takes the remainder ((T-1) % K + 1), so Wan's usual T = 1 + 4n gives [1, K, K, ...] when K
    divides 4n, and all calls after the first have one static shape. A sequence is taken as the schedule itself."""
    T = int(num_latent_frames)
    if T < 1:
        raise LatentError("a video latent needs at least one frame")
    if chunk is not None and not isinstance(chunk, int):
        sched = [int(k) for k in chunk]
        if sum(sched) != T or min(sched) < 1:
            raise LatentError(f"chunk schedule {sched} does not cover {T} latent frames")
        return sched
    K = T if chunk is None or chunk <= 0 or chunk >= T else int(chunk)
    first = (T - 1) % K + 1
    return [first] + [K] * ((T - first) // K)


def output_frame_counts(schedule: Sequence[int], temporal_factor: int = 4) -> list[int]:
    """Output frames of each call: the first latent frame of the clip gives 1 frame, every later one `factor`."""
    return [(1 + temporal_factor * (k - 1)) if i == 0 else temporal_factor * k for i, k in enumerate(schedule)]


# ---------------------------------------------------------------------------------------------------------------
# The chunked decoder


def norm_act_into(norm: nn.Module, act: nn.Module, x: Tensor, out: Tensor) -> None:
    """out <- act(norm(x)), writing into `out` (a view of a conv input buffer). For diffusers' WanRMS_norm + SiLU the
    ops are WanRMS_norm.forward's own, in its order, so the result is bit-identical; other modules are called."""
    wan = wan_module()
    if type(norm) is wan.WanRMS_norm and unhooked(norm) and norm.channel_first and type(act) is nn.SiLU:
        low = x.dtype in (torch.float16, torch.bfloat16) or any(t in str(x.dtype) for t in ("float4_", "float8_"))
        # The norm is per pixel and frame, so run it over groups of frames: its fp32 temporaries (2x the input each
        # in bf16) would otherwise set the decode's peak memory at the full-resolution layers.
        step = max(1, NORM_SLICE_ELEMS // max(1, x[:, :, :1].numel()))
        for t in range(0, x.shape[2], step):
            xs, o = x[:, :, t : t + step], out[:, :, t : t + step]
            n = F.normalize(xs.float() if low else xs, dim=1).to(x.dtype)
            n = n.mul_(norm.scale)  # n is fresh (F.normalize allocates); same kernel as `n * scale`
            torch.mul(n, norm.gamma, out=o)
            del n
            if isinstance(norm.bias, Tensor):
                o.add_(norm.bias)
            F.silu(o, inplace=True)
    else:
        out.copy_(act(norm(x)))


FUSED_ENV = "VAEOPT_VIDEO_FUSED"  # "0"/"off": never use the fused kernel path; "1"/"on": require it; unset: auto


def fused_from_env() -> bool | None:
    v = os.environ.get(FUSED_ENV, "").strip().lower()
    if v in ("0", "off", "false", "no"):
        return False
    if v in ("1", "on", "true", "yes"):
        return True
    return None


def rms_params(norm: nn.Module, act: nn.Module | None):
    """(gamma, bias, scale, eps) when act(norm(x)) is Wan's channel-first RMS norm + SiLU, i.e. what our
    rms_norm_silu kernel computes: the fused_norms stage's FusedRMSNormSiLU(silu=True) followed by an Identity, or a
    stock WanRMS_norm followed by nn.SiLU. None for anything else (hooks, other modules)."""
    if not unhooked(norm) or (act is not None and not unhooked(act)):
        return None
    if type(norm) is FusedRMSNormSiLU and norm.silu and norm.channel_first and type(act) is nn.Identity:
        return norm.gamma, norm.bias, norm.scale, norm.eps
    if type(norm) is wan_module().WanRMS_norm and norm.channel_first and type(act) is nn.SiLU:
        return norm.gamma, norm.bias, norm.scale, 1e-12  # F.normalize's default eps, as WanRMS_norm uses it
    return None




def plain_conv2d(m: nn.Module) -> bool:
    return type(m) is nn.Conv2d and m.padding_mode == "zeros" and unhooked(m)


def igemm_weights(conv: nn.Module, x: Tensor):
    """Packed weights when the triton_conv stage marked `conv` and x suits the kernel (not on meta dry runs)."""
    if x.is_meta or not getattr(conv, "_vaeopt_igemm", False):
        return None
    return packed_for(conv, x)


def copy_lastdim(dst: Tensor, src: Tensor) -> None:
    """dst.copy_(src), bitwise, for same-dtype views whose last dim is contiguous (channels of a channels-last
    activation): moved as 8-byte words where the strides allow, so torch's strided copy kernel handles 4x fewer
    bf16 elements (the stacked convs' history copies; docs/experiments.md E18)."""
    w = 8 // dst.element_size() if dst.element_size() in (1, 2, 4) else 0
    if (w and not dst.is_meta and dst.dtype == src.dtype and dst.shape == src.shape and dst.dim() > 0
            and dst.stride(-1) == 1 and src.stride(-1) == 1 and dst.shape[-1] % w == 0
            and all(t.storage_offset() % w == 0 and all(st % w == 0 for st in t.stride()[:-1]) for t in (dst, src))):
        dst.view(torch.int64).copy_(src.view(torch.int64))
    else:
        dst.copy_(src)


def stacked_w(conv: nn.Module, dtype: torch.dtype) -> Tensor:
    return stacked_weight(conv, dtype)


def last_tap_w(conv: nn.Module, dtype: torch.dtype, fmt: torch.memory_format) -> Tensor:
    """A causal conv's last temporal tap as Conv2d weights (Co, Ci, kh, kw) in `fmt` (cached per weight version):
    all that meets a first frame whose history is diffusers' zero padding."""
    return cached_weight(conv, "_vaeopt_last_tap_w", dtype,
                         lambda: conv.weight[:, :, -1].to(dtype).contiguous(memory_format=fmt))


def tap_matrix(conv: nn.Module, dtype: torch.dtype) -> Tensor:
    """kernels/tapconv's (C, 27*Co) tap matrix of `conv` (cached per weight version and dtype)."""
    return cached_weight(conv, "_vaeopt_tap_matrix", dtype, lambda: tap_weights(conv.weight, dtype=dtype))


def meta_result(like: Tensor, shape: tuple) -> Tensor:
    """An empty meta tensor of `shape` in the layout our kernels would give a result computed from `like`."""
    lay = flat_layout(like)
    if lay is not None and lay[0] == "cl":
        return torch.empty((shape[0], *shape[2:], shape[1]), dtype=like.dtype, device=like.device).movedim(-1, 1)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def frames4(x: Tensor) -> Tensor:
    """(b, c, t, h, w) -> (b*t, c, h, w): a free (channels_last) view of an NDHWC tensor, a copy otherwise."""
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)


def phase_ok(conv2d, up, x: Tensor) -> bool:
    """conv2d(up(x)) may run as 2x2 phase convs on x: up is a 2x nearest upsample and stages/upsample_conv marked
    conv2d (a stock 3x3, padding-1 conv) for x's dtype and device."""
    return upsample_conv.applies(conv2d, x.dtype, x.device, x) and (up is None or is_2x_nearest(up))


def frames_up_conv(conv2d, up, x2: Tensor, phase: bool = False) -> Tensor:
    """conv2d(up(x2)) for frames x2 (n, c, h, w), a few frames per call so the 2x-upsampled tensor stays bounded
    (SPLIT_ELEMS), into one output. phase: up is a 2x nearest upsample and conv2d runs as the 2x2 phase convs of
    stages/upsample_conv on x2 itself (4/9 of the FLOPs, no upsampled tensor)."""
    if phase:
        def f(t: Tensor) -> Tensor:
            return upsample_conv.run(conv2d, t)
    else:
        def f(t: Tensor) -> Tensor:
            return conv2d(up(t))
    n = x2.shape[0]
    g = max(1, SPLIT_ELEMS // (4 * x2[:1].numel()))
    if g >= n:
        return f(x2)
    y = None
    for s in range(0, n, g):
        ys = f(x2[s : s + g])
        if y is None:
            y = torch.empty((n, *ys.shape[1:]), dtype=ys.dtype, device=ys.device, memory_format=suggest_2d(ys))
        y[s : s + g].copy_(ys)
        del ys
    return y


class Single(NamedTuple):
    """A causal conv's input on a clip's only call of one frame (ChunkDecoder._single): the frame (N, C, 1, H, W)
    alone, without its zero history."""

    x: Tensor


class Stacked(NamedTuple):
    """A causal conv's time-stacked input (see ChunkDecoder._stage_stacked): S (N*k, 3C, H, W) channels_last."""

    S: Tensor
    N: int
    k: int


class Pending(NamedTuple):
    """A residual block's output not yet written: (r + rb) + (h + b). The next kernel that reads it (the next
    block's first norm, or the head's norm) forms it in registers (rms_norm_silu / rms_norm_taps `residual=`), so the
    block's epilogue pass and one read of its output go away."""

    h: Tensor
    b: Tensor | None
    r: Tensor
    rb: Tensor | None


def suggest_2d(t: Tensor) -> torch.memory_format:
    return torch.channels_last if t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() \
        else torch.contiguous_format



def prepare_latents(vae, z_raw: Tensor) -> Tensor:
    check_vae(vae)
    if z_raw.dim() != 5:
        raise LatentError(f"video latents must be (N, C, T, h, w), got {tuple(z_raw.shape)}")
    p = vae.post_quant_conv.weight
    if z_raw.shape[1] != p.shape[1]:
        raise LatentError(f"latents have {z_raw.shape[1]} channels, the VAE takes {p.shape[1]}")
    return z_raw.to(device=p.device, dtype=p.dtype)


def patch_size(vae) -> int:
    return int(vae.config.get("patch_size") or 1)
