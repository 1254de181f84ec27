"""HunyuanVideo 1.5's and LTX-2's decoders, run chunk by chunk: exact multi-frame chunks with carried conv state.

Both decoders are built from per-position ops and 3D convs over time, so a clip can stream through them a few latent
frames at a time, with every conv keeping the last input frames it needs, and give the whole-clip decode:

* **Norms are per position.** HunyuanVideo 1.5's `HunyuanVideo15RMS_norm` is `F.normalize` over channels, LTX-2's
  `PerChannelRMSNorm` the RMS over channels and its shortcut `LayerNorm` runs over channels too: no statistic spans
  frames or pixels, so chunks (and spatial tiles with a halo) need no statistics reducer, unlike the GroupNorm
  decoders of vaeopt's image path and HunyuanVideo 1.0.
* **Convs pad time with the first frame, not zeros.** HunyuanVideo 1.5's causal conv pads 2 replicas of frame 0
  (and replicates at the spatial border too); LTX-2's conv pads `kt-1` replicas in front when causal, and one replica
  on each side when not (LTX-2.0's released decoder is not causal: each output frame reads the next input frame). A
  streamed conv keeps the last `kt-1` frames of its input: its first chunk is padded as diffusers pads the clip, a
  non-causal conv holds back its last output until the next frame (or the clip's end, where it pads the last frame).
  Outputs therefore lag inputs inside LTX-2's blocks; residual sums line their two streams up with a small queue.
* **Frame 0 is special once per clip.** HunyuanVideo 1.5's temporal upsampler turns frame 0 into one frame (the
  first half of its channel-to-space result) and every later frame into two; LTX-2's upsampler drops the first
  `stride_t - 1` frames of its stream. Both are applied to the clip's first frames only, wherever the chunk starts.
* **Attention.** HunyuanVideo 1.5's mid-block attention lets every latent frame attend to itself and every earlier
  frame (diffusers builds a frame-causal mask over the whole clip: (T*H*W)^2 entries). Streamed, the keys and values
  of earlier frames are kept (latent resolution: ~0.2 GB for 121 frames at 480p in bf16) and each frame attends to
  its prefix without a mask: the same softmax over the same keys.

`StreamDecoder.step(z, final)` takes the next latent frames and returns the output frames that are complete; with
`final=True` it ends the clip (flushing LTX-2's held-back frames). `front`/`back` split one step at an up block, as
vaeopt.engine.wan's ChunkDecoder does: vaeopt.video_stream runs the front on whole frames and the back per spatial
tile, each tile a StreamDecoder of its own with a halo (`back_halo`) that covers the back's spatial reach.

The decoder's own modules and weights are called (convs, norms, LayerNorms, 1x1 convs); what moves between them is
vaeopt's: each conv's input is one padded buffer its producer writes into (a norm, or the residual sum before an
upsampler), the upsamplers' channel-to-space and shortcut are one add into the upsampled layout, and LTX-2's upsampler
convs compute their output channels in the order that add reads (a reordered copy of the weight, the same dot
products). fp32 on the CPU: bit-identical to diffusers' decode where the chunk is the whole clip (LTX-2), and to float
rounding otherwise (HunyuanVideo 1.5's attention splits its keys differently; chunks).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vaeopt.engine.pad import MODES as PAD_MODES
from vaeopt.engine.pad import fill_borders, padded_empty
from vaeopt.errors import VaeoptError
from vaeopt.stages import foreign_global_hooks, unhooked, weight_version
from vaeopt.stages.fused_norms import writes_into

STREAM_CLASSES = ("AutoencoderKLHunyuanVideo15", "AutoencoderKLLTX2Video")
# LTX-2 upsampler conv weights in sub-position-major channel order, alive while a decoder's state holds them
_SUB_MAJOR: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def kind_of(vae) -> str | None:
    """'hv15' or 'ltx2' for the decoders this module streams, else None."""
    return {"AutoencoderKLHunyuanVideo15": "hv15", "AutoencoderKLLTX2Video": "ltx2"}.get(type(vae).__name__)


def unsupported(vae) -> str | None:
    """Why this VAE's decode cannot be streamed exactly (None: it can)."""
    kind = kind_of(vae)
    if kind is None:
        return f"{type(vae).__name__} is not a HunyuanVideo 1.5 or LTX-2 VAE"
    if kind == "ltx2":
        dec = vae.decoder
        if getattr(dec, "time_embedder", None) is not None or getattr(dec, "timestep_scale_multiplier", None) is not None:
            return "its decoder is timestep-conditioned (LTX-Video 0.9.x style)"
        for m in dec.modules():
            if getattr(m, "per_channel_scale1", None) is not None:
                return "its decoder injects random noise per call, which no chunking reproduces"
            if type(m).__name__ == "LTX2VideoCausalConv3d" and (m.conv.stride != (1, 1, 1) or m.conv.dilation[0] != 1):
                return "a strided or dilated causal conv"
    if any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in vae.decoder.modules()):
        return "training mode with an active dropout"
    return None


def empty_frames(x: Tensor, channels: int | None = None) -> Tensor:
    n, c, _, h, w = x.shape
    return x.new_empty((n, channels if channels is not None else c, 0, h, w))


def _cat(a: Tensor | None, b: Tensor) -> Tensor:
    if a is None or a.shape[2] == 0:
        return b
    if b.shape[2] == 0:
        return a
    return torch.cat([a, b], dim=2)


def back_halo(vae, start: int) -> int:
    """Pixels at the input of up_blocks[start] that the rest of the decoder reads beyond an output region (each
    spatial 3x3 conv adds one pixel at its resolution, a 2x spatial upsample halves what is needed below it),
    rounded up; the tiled decode reads this many extra pixels around a tile, so its interior equals the untiled
    decode's whatever the convs' padding (replicate, reflect or zeros) puts at the tile's edge."""
    reach, scale = 0.0, 1.0
    for ub in list(vae.decoder.up_blocks)[start:]:
        for m in _ordered(ub):
            if isinstance(m, nn.Conv3d):
                reach += (m.kernel_size[1] // 2) / scale
            elif _spatial_up(m):
                scale *= _spatial_up(m)
    reach += (vae.decoder.conv_out.conv.kernel_size[1] // 2) / scale
    return int(math.ceil(reach - 1e-9))


def _ordered(ub) -> list[nn.Module]:
    """The up block's convs and upsamplers in execution order (LTX-2: conv_in, upsamplers, resnets; HunyuanVideo
    1.5: resnets, upsamplers)."""
    out: list[nn.Module] = []
    parts = ([ub.conv_in] if getattr(ub, "conv_in", None) is not None else [])
    ups = list(ub.upsamplers) if ub.upsamplers is not None else []
    if type(ub).__name__.startswith("LTX2"):
        parts += ups + list(ub.resnets)
    else:
        parts += list(ub.resnets) + ups
    for p in parts:
        if _spatial_up(p):
            out += [p.conv.conv, p]  # the conv runs before the channel-to-space step
        else:
            out += [m for m in p.modules() if isinstance(m, nn.Conv3d)]
    return out


def _spatial_up(m) -> int:
    n = type(m).__name__
    if n == "LTX2VideoUpsampler3d":
        return m.stride[1]
    if n == "HunyuanVideo15Upsample":
        return 2
    return 0


def _into_space(dst: Tensor, h: Tensor, x: Tensor, r1: int, repeats: int, take: int | None = None) -> None:
    """dst (N, c, r1*T, 2H, 2W) <- HunyuanVideo 1.5's channel-to-space of h (N, r1*4*c', T, H, W; its first `take`
    channels of each sub-position when given, else all) plus that of x with each channel repeated `repeats` times, in
    one add: diffusers' `_dcae_upsample_rearrange` puts packed channel (sub, ch) at sub-position sub = (i1, i2, i3) of
    output channel ch, and the shortcut's output channel ch reads x's channel ch // repeats of the same sub-position
    (whether the repeat comes before the rearrange, as without a temporal upsample, or after it), so
    dst[ch, t, i1, y, i2, w, i3] = h[sub, ch] + x[sub, ch // repeats]."""
    N, _, T, H, W = h.shape
    c = dst.shape[1]
    k = c // repeats  # x's channels per sub-position
    hv = h.view(N, r1, 2, 2, h.shape[1] // (r1 * 4), T, H, W)[:, :, :, :, :take or c]
    hv = hv.unflatten(4, (k, repeats)).permute(0, 4, 5, 6, 1, 7, 2, 8, 3)
    xv = x.view(N, r1, 2, 2, k, 1, T, H, W).expand(N, r1, 2, 2, k, repeats, T, H, W).permute(0, 4, 5, 6, 1, 7, 2, 8, 3)
    torch.add(hv, xv, out=dst.view(N, k, repeats, T, r1, H, 2, W, 2))


class _ConvState:
    __slots__ = ("hist",)

    def __init__(self):
        self.hist: Tensor | None = None


class StreamDecoder:
    """Decodes consecutive latent chunks of one clip; holds every conv's input history, the residual queues, the
    upsamplers' first-frame bookkeeping and the attention's earlier keys/values. One instance per clip (and per
    spatial tile of a tiled decode)."""

    def __init__(self, vae, causal: bool | None = None, cap: int = 1):
        why = unsupported(vae)
        if why:
            raise VaeoptError(f"vaeopt's chunked decode does not apply: {why}")
        self.vae, self.dec = vae, vae.decoder
        self.kind = kind_of(vae)
        # LTX-2: diffusers' decode(causal=None) runs `causal or decoder.is_causal`
        self.causal = True if self.kind == "hv15" else bool(causal or self.dec.is_causal)
        self.state: dict[nn.Module, object] = {}
        self.cap = max(1, int(cap))  # latent frames' worth that one stage runs on at once (the chunk)
        self._build()

    # -- streamed primitives -------------------------------------------------------------------------------
    # False: the conv input is built as diffusers builds it (torch.cat of the time padding, then F.pad / the conv's
    # own padding_mode), for measuring the preallocated buffer against it
    fast_pad = True
    # False: the upsamplers run diffusers' rearrange / repeat / cat / add ops instead of one add into the output
    fused_upsample = True
    # True: a resnet's output (its residual sum) is written into the next conv's (an upsampler's) padded input buffer
    # instead of being a new tensor that conv copies in. Off until measured on a GPU: it saves the copy but turns the
    # sum into a strided write (E68)
    feed_buffers = False
    # True: LTX-2's upsampler convs compute their output channels sub-position-major (each sub-position's channels
    # contiguous, so the upsample's one add reads coalesced) instead of in diffusers' channel-major order. Off until
    # measured on a GPU (E68)
    sub_major = False

    def conv(self, wrapper, x: Tensor, final: bool, norm: nn.Module | None = None,
             weight: tuple[Tensor, Tensor | None] | None = None) -> Tensor:
        """A causal-conv wrapper (HunyuanVideo15CausalConv3d / LTX2VideoCausalConv3d) continuing its stream: the new
        frames x after the kept input history; -> the output frames that are complete. norm: the conv's input is
        norm(x) (a fused RMS norm + SiLU, which then writes straight into the conv's padded input buffer). weight:
        (weight, bias) to run in place of the conv's own (the same conv with its output channels reordered; only
        where `_plain_padding` holds)."""
        if not self._fast(wrapper):
            return self._conv_torch_pad(wrapper, norm(x) if norm is not None and x.shape[2] else x, final)
        conv = wrapper.conv
        kt = conv.kernel_size[0]
        st = self.state.get(wrapper)
        if st is None:
            st = self.state[wrapper] = _ConvState()
        if st.hist is None and x.shape[2] == 0:
            return empty_frames(x, conv.out_channels)
        fed = self.state.pop((wrapper, "fed"), None)
        if fed is not None and fed[2] is x and norm is None:  # the producer already wrote x into this buffer's interior
            buf, inner, _, (front, head, n, back, space, time_mode) = fed
        else:
            front, head, n, back, space, time_mode = self._geometry(wrapper, x.shape[2], final)
            buf, inner = padded_empty((x.shape[0], x.shape[1], n + back, x.shape[3], x.shape[4]), space, x,
                                      self._layout(conv))
            if x.shape[2]:
                dst = inner[:, :, front + head:n]
                if norm is None:
                    dst.copy_(x)
                elif writes_into(norm):
                    norm(x, out=dst)  # the producer writes the interior: the pad costs only its borders
                else:
                    dst.copy_(norm(x))
        if head:
            inner[:, :, :head].copy_(st.hist)
        data = buf[:, :, front:n]
        if any(space):
            fill_borders(data, space, self._space_mode(wrapper))
        if front or back:
            fill_borders(buf.movedim(2, -1), (front, back), time_mode)  # whole frames, their borders included
        keep = kt - 1
        # a copy: a view would keep the whole chunk's input alive until the next call (none after the clip's end)
        st.hist = inner[:, :, max(0, n - keep):n].clone() if keep and not final else None
        if buf.shape[2] < kt:
            return empty_frames(x, conv.out_channels)
        if weight is not None or (self.kind == "ltx2" and any(space)):  # the conv's own padding is in the buffer
            w, b = weight or (conv.weight, conv.bias)
            return F.conv3d(buf, w, b, conv.stride, 0 if any(space) else conv.padding, conv.dilation, conv.groups)
        return conv(buf)

    def _fast(self, wrapper) -> bool:
        """The conv's input goes into one preallocated buffer (engine.pad fills the padding mode)."""
        return self.fast_pad and not (self.kind == "hv15" and wrapper.pad_mode not in PAD_MODES)

    def _geometry(self, wrapper, frames: int, final: bool) -> tuple:
        """The conv's padded input buffer for its next `frames` frames: (front, head, n, back, space, time_mode):
        the front padding (the clip's first call), the kept history, the stream's frames before the back padding
        (the clip's end), that back padding, the spatial pads the buffer holds and the time padding's mode."""
        conv = wrapper.conv
        kt = conv.kernel_size[0]
        hist = self.state[wrapper].hist if wrapper in self.state else None
        if self.kind == "hv15":
            p = wrapper.time_causal_padding  # (w, w, h, h, t_front, t_back) as F.pad reads it, in pad_mode
            space, time_mode, left, right = p[:4], wrapper.pad_mode, p[4], p[5]
        else:
            left, right = (kt - 1, 0) if self.causal else ((kt - 1) // 2, (kt - 1) // 2)
            space, time_mode = self._own_spatial_pad(conv), "replicate"  # diffusers repeats frame 0 / the last
        head = 0 if hist is None else hist.shape[2]
        front = left if hist is None else 0  # the clip's first frames: the front padding, filled like a border
        back = right if final else 0  # the clip's end: the back padding
        return front, head, front + head + frames, back, space, time_mode

    def _feed(self, wrapper, like: Tensor, final: bool) -> Tensor | None:
        """The interior slot of `wrapper`'s next padded input buffer for frames shaped like `like`, for the stage
        before the conv to write its output into (then the conv's input costs no copy); None where the conv does not
        take the one-buffer path."""
        if not (self.feed_buffers and self._fast(wrapper)) or like.shape[2] == 0:
            return None
        self.state.setdefault(wrapper, _ConvState())
        g = self._geometry(wrapper, like.shape[2], final)
        front, head, n, back, space, _ = g
        N, C, _, H, W = like.shape
        buf, inner = padded_empty((N, C, n + back, H, W), space, like, self._layout(wrapper.conv))
        dst = inner[:, :, front + head:n]
        self.state[(wrapper, "fed")] = (buf, inner, dst, g)
        return dst

    @staticmethod
    def _own_spatial_pad(conv: nn.Conv3d) -> tuple[int, ...]:
        """LTX-2: the spatial padding of a plain nn.Conv3d with padding_mode reflect (or replicate), which the buffer
        then holds so the conv runs unpadded; (0, 0, 0, 0) where cuDNN's zero padding is free, where the mode is one
        engine.pad does not fill (circular), or where the conv is not a plain, unhooked nn.Conv3d (its forward must
        run, and it pads itself)."""
        if conv.padding_mode not in ("reflect", "replicate") or not StreamDecoder._plain(conv):
            return (0, 0, 0, 0)
        _, ph, pw = conv.padding
        return (pw, pw, ph, ph)

    @staticmethod
    def _plain(conv: nn.Conv3d) -> bool:
        """A plain, unhooked nn.Conv3d with its weight at hand: F.conv3d on its weight is its forward."""
        return (type(conv) is nn.Conv3d and unhooked(conv) and "forward" not in conv.__dict__
                and isinstance(conv.padding, tuple) and isinstance(conv.weight, Tensor) and not foreign_global_hooks())

    def _plain_padding(self, wrapper) -> bool:
        """conv(..., weight=) can stand for the conv: its spatial padding is in the buffer, or zeros that F.conv3d
        adds itself."""
        conv = wrapper.conv
        return self._fast(wrapper) and self.kind == "ltx2" and (
            any(self._own_spatial_pad(conv)) or (conv.padding_mode == "zeros" and self._plain(conv)))

    def _space_mode(self, wrapper) -> str:
        return wrapper.pad_mode if self.kind == "hv15" else wrapper.conv.padding_mode

    @staticmethod
    def _layout(conv: nn.Conv3d) -> torch.memory_format:
        """The layout the channels_last stage gave the conv's weights, so cuDNN reads its input as it is."""
        w = conv.weight
        return (torch.channels_last_3d if w.is_contiguous(memory_format=torch.channels_last_3d)
                and not w.is_contiguous() else torch.contiguous_format)

    def _conv_torch_pad(self, wrapper, x: Tensor, final: bool) -> Tensor:
        """conv() with diffusers' padding ops: torch.cat over time, F.pad (HunyuanVideo 1.5) or the conv's own
        padding_mode (LTX-2) in space."""
        conv = wrapper.conv
        kt = conv.kernel_size[0]
        st = self.state.get(wrapper)
        if st is None:
            st = self.state[wrapper] = _ConvState()
        if self.kind == "hv15":
            left, right = kt - 1, 0
        else:
            left, right = (kt - 1, 0) if self.causal else ((kt - 1) // 2, (kt - 1) // 2)
        keep = kt - 1
        if st.hist is None:
            if x.shape[2] == 0:
                return empty_frames(x, conv.out_channels)
            if self.kind == "hv15":
                if keep and not final:
                    st.hist = (x if x.shape[2] >= keep else
                               _cat(x[:, :, :1].expand(-1, -1, keep - x.shape[2], -1, -1), x))[:, :, -keep:].clone()
                return self._conv_call(conv, F.pad(x, wrapper.time_causal_padding, mode=wrapper.pad_mode))
            head = x[:, :, :1].expand(-1, -1, left, -1, -1) if left else None
        else:
            head = st.hist
        tail = None
        if final and right:
            last = x if x.shape[2] else head
            tail = last[:, :, -1:].expand(-1, -1, right, -1, -1)
        parts = [t for t in (head, x, tail) if t is not None and t.shape[2]]
        buf = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        n = (head.shape[2] if head is not None else 0) + x.shape[2]
        st.hist = buf[:, :, max(0, n - keep):n].clone() if keep and not final else None
        if buf.shape[2] < kt:
            return empty_frames(x, conv.out_channels)
        if self.kind == "hv15":
            p = wrapper.time_causal_padding
            buf = F.pad(buf, (p[0], p[1], p[2], p[3], 0, 0), mode=wrapper.pad_mode)
        return self._conv_call(conv, buf)

    @classmethod
    def _conv_call(cls, conv: nn.Conv3d, buf: Tensor) -> Tensor:
        return conv(buf.contiguous(memory_format=cls._layout(conv)))

    def pointwise(self, conv: nn.Conv3d, x: Tensor) -> Tensor:
        return conv(x) if x.shape[2] else empty_frames(x, conv.out_channels)

    def _align(self, key, residual: Tensor, h: Tensor, into=None, final: bool = False) -> Tensor:
        """h + the residual frames that line up with h (the residual stream runs ahead where convs lag). into: the
        conv wrapper that reads the sum next, which is then written into its padded input buffer (`_feed`)."""
        q = _cat(self.state.get(key), residual)
        n = h.shape[2]
        self.state[key] = q[:, :, n:].clone() if q.shape[2] > n else None  # (a view would keep q alive)
        if not n:
            return h
        dst = self._feed(into, h, final) if into is not None else None
        return torch.add(h, q[:, :, :n], out=dst) if dst is not None else h + q[:, :, :n]

    # -- blocks --------------------------------------------------------------------------------------------
    @staticmethod
    def _fused(act: nn.Module, norm: nn.Module) -> bool:
        """norm -> act is one fused norm + SiLU module (fused_norms) that can write into a conv's input buffer."""
        return type(act) is nn.Identity and unhooked(act) and writes_into(norm)

    def resnet(self, blk, x: Tensor, final: bool) -> Tensor:
        act = blk.nonlinearity
        if self._fused(act, blk.norm1):
            h = self.conv(blk.conv1, x, final, norm=blk.norm1)
        else:
            h = self.conv(blk.conv1, act(blk.norm1(x)), final)
        drop = getattr(blk, "dropout", None)
        idle = drop is None or (type(drop) is nn.Dropout and (not drop.training or drop.p == 0) and unhooked(drop))
        if idle and self._fused(act, blk.norm2):
            h = self.conv(blk.conv2, h, final, norm=blk.norm2)
        else:
            h = act(blk.norm2(h))
            if drop is not None:
                h = drop(h)
            h = self.conv(blk.conv2, h, final)
        r = x
        if getattr(blk, "norm3", None) is not None and r.shape[2]:
            r = blk.norm3(r.movedim(1, -1)).movedim(-1, 1)
        if blk.conv_shortcut is not None:
            r = self.pointwise(blk.conv_shortcut, r)
        nxt = self.feeds.get(blk)  # the conv that reads this block's output: the sum goes into its buffer
        return self._align(blk, r, h, into=nxt, final=final)

    def hv_attention(self, blk, x: Tensor) -> Tensor:
        """HunyuanVideo15AttnBlock with the clip's earlier keys/values: latent frame i attends to frames 0..i."""
        if x.shape[2] == 0:
            return x
        N, C, T, H, W = x.shape
        hn = blk.norm(x)
        q, k, v = blk.to_q(hn), blk.to_k(hn), blk.to_v(hn)
        del hn
        # tokens (N, 1, T*H*W, C), contiguous once: every frame's query block and key/value prefix is then a
        # contiguous view, not a copy of the growing prefix per frame
        tok = lambda t: t.reshape(N, C, -1).transpose(1, 2).unsqueeze(1).contiguous()  # noqa: E731
        kv = self.state.get(blk)
        k, v = tok(k), tok(v)
        Ks, Vs = (torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)) if kv is not None else (k, v)
        self.state[blk] = (Ks, Vs)
        L = H * W
        start = Ks.shape[2] // L - T  # frames before this chunk
        qs = tok(q)
        out = torch.empty((N, 1, T * L, C), dtype=x.dtype, device=x.device)
        for i in range(T):
            end = (start + i + 1) * L
            out[:, :, i * L:(i + 1) * L] = F.scaled_dot_product_attention(
                qs[:, :, i * L:(i + 1) * L], Ks[:, :, :end], Vs[:, :, :end])
        y = out.squeeze(1).reshape(N, T, H, W, C).permute(0, 4, 1, 2, 3)
        return blk.proj_out(y) + x

    def hv_upsample(self, up, x: Tensor, final: bool) -> Tensor:
        """HunyuanVideo15Upsample continuing its stream: conv, channel-to-space of the conv output and of the
        shortcut (the input's channels repeated), and their sum, as one add written straight into the upsampled
        layout (`_into_space`), not diffusers' rearrange, repeat_interleave, cat and add passes: the same sums."""
        h = self.conv(up.conv, x, final)
        r1 = 2 if up.add_temporal_upsample else 1
        c = h.shape[1] // (r1 * 4)  # output channels
        N, _, T, H, W = x.shape
        if T == 0:
            return h.new_empty((N, c, 0, 2 * H, 2 * W))
        if (not self.fused_upsample or h.shape[2] != T or c % up.repeats
                or (r1 == 2 and (up.repeats % 2 or c % (up.repeats // 2)))):
            return self._hv_upsample_ops(up, x, h)
        first = up.add_temporal_upsample and up not in self.state
        self.state[up] = True
        out = torch.empty((N, c, r1 * T - (1 if first else 0), 2 * H, 2 * W), dtype=h.dtype, device=h.device,
                          memory_format=self._layout(up.conv.conv))
        if first:  # frame 0 of the clip: one frame, the first half of its channel-to-space result
            _into_space(out[:, :, :1], h[:, :, :1], x[:, :, :1], 1, up.repeats // 2, take=c)
            h, x = h[:, :, 1:], x[:, :, 1:]
        if h.shape[2]:
            _into_space(out[:, :, 1 if first else 0:], h, x, r1, up.repeats)
        return out

    def _hv_upsample_ops(self, up, x: Tensor, h: Tensor) -> Tensor:
        """hv_upsample with diffusers' own ops (where the conv's output frames do not line up with its input's)."""
        rr = up._dcae_upsample_rearrange
        if not up.add_temporal_upsample:
            sc = rr(x.repeat_interleave(repeats=up.repeats, dim=1), r1=1, r2=2, r3=2)
            return rr(h, r1=1, r2=2, r3=2) + sc
        first = up not in self.state
        if x.shape[2] == 0:
            return rr(h, r1=2, r2=2, r3=2)
        self.state[up] = True
        if first:  # frame 0 of the clip: one frame, the first half of its channel-to-space result
            hf = rr(h[:, :, :1], r1=1, r2=2, r3=2)
            hf = hf[:, : hf.shape[1] // 2]
            xf = rr(x[:, :, :1], r1=1, r2=2, r3=2).repeat_interleave(repeats=up.repeats // 2, dim=1)
            h, x = h[:, :, 1:], x[:, :, 1:]
        hn = rr(h, r1=2, r2=2, r3=2)
        xn = rr(x, r1=2, r2=2, r3=2).repeat_interleave(repeats=up.repeats, dim=1)
        if first:
            return torch.cat([hf, hn], dim=2) + torch.cat([xf, xn], dim=2)
        return hn + xn

    def ltx_upsample(self, up, x: Tensor, final: bool) -> Tensor:
        s = up.stride

        def d2s(t: Tensor) -> Tensor:  # diffusers' LTX2VideoUpsampler3d rearrangement, per frame
            b, c, f, hh, ww = t.shape
            t = t.reshape(b, c // (s[0] * s[1] * s[2]), s[0], s[1], s[2], f, hh, ww)
            return t.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)

        def drop(key, t: Tensor) -> Tensor:  # the stream's first stride_t - 1 frames, once per clip
            left = self.state.get(key, s[0] - 1)
            n = min(left, t.shape[2])
            self.state[key] = left - n
            return t[:, :, n:]

        k = (s[0] * s[1] * s[2]) // up.upscale_factor  # the shortcut's channel repeats
        fused = (up.residual and self.fused_upsample and up.conv.conv.out_channels == k * x.shape[1]
                 and (up, "h") not in self.state)
        sub = s if fused and self.sub_major and self._plain_padding(up.conv) else None
        hl = self.conv(up.conv, x, final, weight=self._sub_major_weight(up) if sub else None)
        if not up.residual:
            return drop((up, "h"), d2s(hl))
        if not fused:
            h = drop((up, "h"), d2s(hl))
            r = d2s(x).repeat(1, k, 1, 1, 1)
            return self._align(up, drop((up, "r"), r), h)
        # the conv's output lags its input (non-causal): line x's frames up with it at the latent side, then the sum
        # of the two channel-to-space results in one add written into the upsampled layout: diffusers' d2s puts
        # packed channel (ch, sub) at sub-position sub of output channel ch, and the repeated shortcut's channel
        # ki * Cx + cx reads x's channel (cx, sub); the same sums as d2s(h) + d2s(x).repeat, without their copies
        q = _cat(self.state.get((up, "x")), x)
        n = hl.shape[2]
        self.state[(up, "x")] = q[:, :, n:].clone() if q.shape[2] > n else None  # (a view would keep q alive)
        N, _, _, H, W = x.shape
        cx = x.shape[1] // (s[0] * s[1] * s[2])
        out = torch.empty((N, k * cx, n * s[0], H * s[1], W * s[2]), dtype=hl.dtype, device=hl.device,
                          memory_format=self._layout(up.conv.conv))
        if n:
            if sub:  # hl's channels are (s0, s1, s2, k, cx): the same sums, each sub-position's channels contiguous
                hv = hl.view(N, *s, k, cx, n, H, W).permute(0, 4, 5, 6, 1, 7, 2, 8, 3)
            else:
                hv = hl.view(N, k, cx, *s, n, H, W).permute(0, 1, 2, 6, 3, 7, 4, 8, 5)  # -> (N, k, cx, f, s0, ...)
            order = (0, 1, 2, 6, 3, 7, 4, 8, 5)
            xv = q[:, :, :n].view(N, 1, cx, *s, n, H, W).expand(N, k, cx, *s, n, H, W).permute(order)
            torch.add(hv, xv, out=out.view(N, k, cx, n, s[0], H, s[1], W, s[2]))
        return drop((up, "o"), out)

    def _sub_major_weight(self, up) -> tuple[Tensor, Tensor | None]:
        """LTX-2 upsampler conv's weight and bias with the output channels reordered from diffusers' (k, cx, s0, s1,
        s2) to (s0, s1, s2, k, cx): every output channel is the same dot product, only its place changes, so that
        one add reads each sub-position's k*cx channels contiguously. Made once per clip and shared by the clip's
        decoders (the spatial tiles': one copy, 0.3 GB in bf16 for LTX-2.0's three), freed with the last of them."""
        key = (up, "w")
        if key not in self.state:
            conv, s = up.conv.conv, up.stride
            w, b = conv.weight, conv.bias
            kc = w.shape[0] // (s[0] * s[1] * s[2])
            # a changed or reloaded weight gets a new copy (vaeopt.refresh() included, as for every derived weight;
            # inference tensors, which count no version, too)
            wkey = (id(conv), weight_version(w), w.dtype)
            # (not shared while a CUDA graph is captured: its copy is made by the graph, in the graph's memory)
            capturing = w.is_cuda and torch.cuda.is_current_stream_capturing()
            wp = None if capturing else _SUB_MAJOR.get(wkey)
            if wp is None:
                wp = w.unflatten(0, (kc, *s)).permute(1, 2, 3, 0, *range(4, w.dim() + 3)).flatten(0, 3)
                wp = wp.contiguous(memory_format=self._layout(conv))
                if not capturing:
                    _SUB_MAJOR[wkey] = wp
            self.state[key] = (wp, b.view(kc, *s).permute(1, 2, 3, 0).flatten() if b is not None else None)
        return self.state[key]

    # -- the decoder as a list of stages -------------------------------------------------------------------
    def _build(self) -> None:
        """self.stages: (fn(x, final) -> x, temporal rate of the input vs the latents); self.at[s]: the index of
        up_blocks[s]'s first stage (self.at[len(up_blocks)]: the head's)."""
        dec, st, at = self.dec, [], []
        self.feeds: dict[nn.Module, nn.Module] = {}  # resnet -> the upsampler conv that reads its output
        if self.kind == "hv15":
            st.append((lambda x, f: self.conv(dec.conv_in, x, f) + x.repeat_interleave(repeats=dec.repeat, dim=1), 1))
            mid = dec.mid_block
            st.append((lambda x, f, r=mid.resnets[0]: self.resnet(r, x, f), 1))
            for attn, res in zip(mid.attentions, mid.resnets[1:]):
                if attn is not None:
                    st.append((lambda x, f, a=attn: self.hv_attention(a, x), 1))
                st.append((lambda x, f, r=res: self.resnet(r, x, f), 1))
        else:
            st.append((lambda x, f: self.conv(dec.conv_in, x, f), 1))
            st += [(lambda x, f, r=r: self.resnet(r, x, f), 1) for r in dec.mid_block.resnets]
        rate = 1
        last = dec.mid_block.resnets[-1] if len(dec.mid_block.resnets) else None  # the latest stage, if a resnet
        for ub in dec.up_blocks:
            at.append(len(st))
            ups = list(ub.upsamplers or ())
            if self.kind == "ltx2":
                if ub.conv_in is not None:
                    st.append((lambda x, f, r=ub.conv_in: self.resnet(r, x, f), rate))
                    last = ub.conv_in
                for up in ups:
                    if last is not None:
                        self.feeds[last] = up.conv
                    st.append((lambda x, f, u=up: self.ltx_upsample(u, x, f), rate))
                    rate *= up.stride[0]
                    last = None
                st += [(lambda x, f, r=r: self.resnet(r, x, f), rate) for r in ub.resnets]
                last = ub.resnets[-1] if len(ub.resnets) else last
            else:
                st += [(lambda x, f, r=r: self.resnet(r, x, f), rate) for r in ub.resnets]
                last = ub.resnets[-1] if len(ub.resnets) else last
                for up in ups:
                    if last is not None:
                        self.feeds[last] = up.conv
                    st.append((lambda x, f, u=up: self.hv_upsample(u, x, f), rate))
                    rate *= 2 if up.add_temporal_upsample else 1
                    last = None
        at.append(len(st))
        st.append((self._head, rate))
        self.stages, self.at = st, at

    def _head(self, x: Tensor, final: bool) -> Tensor:
        """norm_out, SiLU, conv_out (and LTX-2's unpatchify)."""
        dec = self.dec
        if self._fused(dec.conv_act, dec.norm_out):
            x = self.conv(dec.conv_out, x, final, norm=dec.norm_out)
        else:
            x = self.conv(dec.conv_out, dec.conv_act(dec.norm_out(x)), final)
        if self.kind == "ltx2":
            p, pt = dec.patch_size, dec.patch_size_t
            b, c, f, h, w = x.shape
            x = x.reshape(b, c // (pt * p * p), pt, p, p, f, h, w)
            x = x.permute(0, 1, 5, 2, 6, 4, 7, 3).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        return x

    def _run(self, i: int, stop: int, x: Tensor, final: bool) -> Iterator[tuple[Tensor, bool]]:
        """Stages i..stop-1 on x, depth first: where more frames reach a stage than `cap` latent frames' worth
        (LTX-2's non-causal convs hold frames back and release them all at the clip's end), they go on in pieces,
        so that no stage ever holds more than a chunk's frames. Yields (piece out of stage stop-1, whether it is the
        clip's last)."""
        if i == stop:
            yield x, final
            return
        fn, rate = self.stages[i]
        n, cap = x.shape[2], max(1, self.cap * rate)
        cuts = list(range(0, n, cap)) or [0]
        for j, a in enumerate(cuts):
            last = final and j == len(cuts) - 1
            y = fn(x[:, :, a:a + cap] if n > cap else x, last)
            yield from self._run(i + 1, stop, y, last)
            del y

    def close(self) -> None:
        """Drop the clip's state (conv histories, residual queues, earlier keys/values) and the stage closures: they
        refer back to this decoder, so without this the state would stay on the device until Python's cycle
        collector runs, on top of the next decode's memory."""
        self.state.clear()
        self.stages = []

    # -- one step ------------------------------------------------------------------------------------------
    def front(self, z: Tensor, stop: int, final: bool) -> Iterator[tuple[Tensor, bool]]:
        """conv_in, the mid-block and up_blocks[:stop] on the next latent frames -> pieces of up_blocks[stop]'s input
        (the frames that are complete), at most `cap` latent frames' worth each, with whether each is the clip's
        last."""
        with torch.no_grad():
            yield from self._run(0, self.at[stop], z, final)

    def back(self, x: Tensor, start: int, final: bool) -> Tensor:
        """up_blocks[start:] and the head on frames of up_blocks[start]'s input -> the output frames that are
        complete (one tensor)."""
        with torch.no_grad():
            outs = [y for y, _ in self._run(self.at[start], len(self.stages), x, final)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def pieces(self, z: Tensor, final: bool = False) -> Iterator[Tensor]:
        """The next latent frames (final: the clip's last) -> the output frames that are complete, in pieces of at
        most `cap` latent frames' worth."""
        with torch.no_grad():
            for y, _ in self._run(0, len(self.stages), z, final):
                yield y

    def step(self, z: Tensor, final: bool = False) -> Tensor:
        """pieces() as one tensor."""
        outs = list(self.pieces(z, final))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def chunk_schedule(t_lat: int, chunk: int) -> list[tuple[int, int]]:
    """(start, stop) latent frames of each call: `chunk` frames each, the remainder last."""
    chunk = max(1, int(chunk))
    return [(s, min(s + chunk, t_lat)) for s in range(0, t_lat, chunk)]
