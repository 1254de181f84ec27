"""Band-parallel decodes on torch.distributed: one large image / clip split into horizontal bands over the ranks,
equal to the single-process decode up to float rounding (docs/multi-gpu.md, "Design: bands", says how each operator
is made exact across band edges). The ranks are started by vaeopt.distributed; the halo exchange is
vaeopt.engine.halo, the GroupNorm statistics merge vaeopt.engine.stats.

Rank r of R owns latent rows [r*h//R, (r+1)*h//R), and s times those at a layer s times the latent resolution. 3x3
convs run on the band with their own zero padding, and the two edge rows are completed from the neighbours'
boundary rows (exchanged while the band's conv runs); GroupNorm merges every band's (count, mean, M2) exactly; the
mid-block attention is split by queries; Wan's causal caches hold each rank's own rows, and the halo rows carry
their history frames. The output is gathered on rank 0 (gather=True) or left on each rank with its row range.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from vaeopt import video
from vaeopt.engine.fold import shortcut_bias
from vaeopt.engine.halo import (BandComm, add_halo, band_rows, conv2d_rows, halo_weight, kernel_hw,
                                plain_same_conv2d)
from vaeopt.engine.image import Pass, check_resnet, kl_decoder, plan_passes, up_conv, walk
from vaeopt.engine.stats import GroupNormer
from vaeopt.engine.store import Activation
from vaeopt.engine.wan import ChunkDecoder
from vaeopt.engine.wan_ops import (Stacked, frames_up_conv, patch_size, phase_ok, prepare_latents, stacked_w,
                                   temporal_factor, wan_module)
from vaeopt.errors import DistributedError, VaeoptError
from vaeopt.kernels import tapconv
from vaeopt.stages import Hint, Said, spelled, unhooked
from vaeopt.stages.fused_epilogues import chunked_attention
from vaeopt.stages.marks import interpolating_upsampler, is_2x_nearest, wan_channels_last

__all__ = ["band_parallel_decode", "band_rows", "supports_band"]


# ================================================================================================================
# AutoencoderKL (SD / SDXL / SD3 / FLUX): band-parallel decode
# ================================================================================================================


def _attn_split_ok(attn: nn.Module) -> tuple[bool, str]:
    from diffusers.models.attention_processor import AttnProcessor2_0

    proc = getattr(attn, "processor", None)
    if not (type(proc) is AttnProcessor2_0 or type(proc).__name__ == "ChunkedAttnProcessor"):
        return False, f"attention processor {type(proc).__name__} is not one whose math is known here"
    if not unhooked(attn):
        return False, "the attention module has hooks"
    for a in ("spatial_norm", "norm_q", "norm_k"):
        if getattr(attn, a, None) is not None:
            return False, f"attention with {a}"
    if getattr(attn, "to_out", None) is None or getattr(attn, "is_cross_attention", False):
        return False, "not a self-attention with an output projection"
    return True, ""


def _upsampler_ok(up: nn.Module) -> bool:
    return interpolating_upsampler(up) and bool(getattr(up, "use_conv", False))


class _ImageBandDecoder:
    """AutoencoderKL decoder on one band. With the kernels on (CUDA + triton: the single-GPU fused path's
    equivalents), plain convs run without their bias, which the next consumer folds in (GroupNorm statistics and
    apply, the residual epilogue), and the residual epilogue of an up-block's last resnet writes the 2x upsampled
    tensor directly -- the same passes the fused single-GPU decode saves. Otherwise torch ops, biases in place."""

    def __init__(self, vae: nn.Module, comm: BandComm, kernels: bool | None):
        self.vae = vae
        self.dec = kl_decoder(vae)
        self.passes = plan_passes(vae)  # raises TilingError (clear message) for structures it cannot follow
        for i, blk in enumerate(self.dec.mid_block.resnets):
            check_resnet(blk, f"mid_block.resnets.{i}")
        self.comm = comm
        self.notes: list[str] = []
        self.norm = GroupNormer(comm.merge_moments, kernels, self.notes, DistributedError)
        self.kernels = kernels
        self.fold = False
        self.upsampled = False  # the last band came out of a residual epilogue already 2x upsampled
        self.counts = {"bias_folded": 0, "epilogue_kernel": 0, "upsample_fused": 0}

    # -- building blocks ---------------------------------------------------------------------------------------
    def _conv(self, conv: nn.Module, y: Tensor, fold: bool = True) -> tuple[Tensor, Tensor | None]:
        """conv(y) for a band y, exact at the band edges (BandComm.conv2d). -> (out, owed bias): with folding on, a
        plain nn.Conv2d runs without its bias and returns it as owed."""
        nobias = fold and self.fold and plain_same_conv2d(conv) and conv.bias is not None
        self.counts["bias_folded"] += nobias
        return self.comm.conv2d(conv, y, bias=not nobias), (conv.bias if nobias else None)

    def _up2x(self, x: Tensor) -> Tensor:
        if self.fold:
            try:
                from vaeopt.kernels.epilogue import upsample_nearest2x

                return upsample_nearest2x(x)
            except Exception as e:  # noqa: BLE001 - the same copy in torch
                self.norm.fallback(e)
        return F.interpolate(x, scale_factor=2.0, mode="nearest")

    def _upsample(self, up: nn.Module, x: Tensor, already: bool) -> tuple[Tensor, Tensor | None]:
        """Upsample2D (nearest 2x + conv) of a band; `already`: x is upsampled (by the residual epilogue). The
        halo rows exchanged are the upsampled boundary rows: row 2a-1 of the whole image is the upper
        neighbour's last upsampled row."""
        if not _upsampler_ok(up):
            raise DistributedError(f"{type(up).__name__}: band decoding supports nearest-2x + conv upsamplers only")
        u = x if already else self._up2x(x)
        del x
        return self._conv(up_conv(up), u)

    def _epilogue(self, o: Tensor, ob, r: Tensor, rb, osf: float, up: bool) -> Tensor:
        """((r + rb) + (o + ob)) / osf, 2x nearest-upsampled if `up`."""
        if self.fold:
            try:
                from vaeopt.kernels.epilogue import bias_residual

                self.counts["epilogue_kernel"] += 1
                self.counts["upsample_fused"] += bool(up)
                return bias_residual(o, ob, r, osf, upsample2x=up, residual_bias=rb)
            except Exception as e:  # noqa: BLE001
                self.norm.fallback(e)
        shape = (1, -1, 1, 1)
        if ob is not None:
            o = o + ob.to(o.dtype).view(shape)
        if rb is not None:
            r = r + rb.to(r.dtype).view(shape)
        o = o.add_(r)  # == input_tensor + hidden_states (addition commutes bitwise)
        if osf != 1.0:
            o = o.div_(osf)
        return F.interpolate(o, scale_factor=2.0, mode="nearest") if up else o

    # -- the steps of the walk (engine.image.walk): activations are Activation(band, None, owed bias) ---------------
    def res1(self, i: int | None, ps, x: Activation) -> Activation:
        blk = ps.module
        y = self.norm(x.t, blk.norm1, blk.nonlinearity, x.bias)
        h, hb = self._conv(blk.conv1, y)
        return Activation(h, None, hb)

    def res2(self, i: int | None, ps, res: Activation, h1: Activation) -> Activation:
        """The resnet's second half; the residual epilogue of an up-block's last resnet writes the 2x upsampled
        output when its one upsampler follows (self.upsampled: the up step then runs only its conv)."""
        blk, ahead = ps.module, self.passes[i + 1 : i + 3] if i is not None else []
        up = (self.fold and len(ahead) > 0 and ahead[0].kind == "up" and _upsampler_ok(ahead[0].module)
              and (len(ahead) == 1 or ahead[1].kind != "up"))
        h, hb, x, xb = h1.t, h1.bias, res.t, res.bias
        h1.t = res.t = None  # the walk's references: let the band tensors go as soon as they are read
        y = self.norm(h, blk.norm2, blk.nonlinearity, hb)
        del h
        drop = getattr(blk, "dropout", None)
        if drop is not None:
            y = drop(y)
        o, ob = self._conv(blk.conv2, y)
        del y
        sc = getattr(blk, "conv_shortcut", None)
        osf = float(getattr(blk, "output_scale_factor", 1.0))
        if sc is None:
            r, rb = x, xb
        elif (xb is not None and plain_same_conv2d(sc) and kernel_hw(sc) == (1, 1) and sc.groups == 1):
            # a 1x1 conv of (x + xb) == conv(x) + W @ xb: the owed bias folds through it exactly
            r, _ = self._conv(sc, x)
            rb = shortcut_bias(sc, xb)
        else:
            if xb is not None:
                x = x + xb.to(x.dtype).view(1, -1, 1, 1)
            r, rb = self._conv(sc, x)
        del x
        self.upsampled = up
        return Activation(self._epilogue(o, ob, r, rb, osf, up), None)

    def up(self, i: int, ps, x: Activation) -> Activation:
        already, self.upsampled = self.upsampled, False
        t = x.t
        x.t = None
        o, ob = self._upsample(ps.module, t, already)
        return Activation(o, None, ob)

    def head(self, i: int, ps, x: Activation) -> Tensor:
        dec = self.dec
        y = self.norm(x.t, dec.conv_norm_out, dec.conv_act, x.bias)
        x.t = None
        out, _ = self._conv(dec.conv_out, y, fold=False)
        return out

    def _attention(self, attn: nn.Module, x: Tensor) -> Tensor:
        """Attention over all latent tokens of the full x, for the queries of this rank's rows only."""
        a, b = self.comm.a, self.comm.b
        ok, why = _attn_split_ok(attn)
        if not ok:
            self.notes.append(f"mid-block attention computed whole on every rank ({why})")
            return attn(x).narrow(2, a, b - a).contiguous()
        B, C, H, W = x.shape
        residual = x.narrow(2, a, b - a)
        hs = x.view(B, C, H * W).transpose(1, 2)
        if attn.group_norm is not None:
            hs = attn.group_norm(hs.transpose(1, 2)).transpose(1, 2)
        q = attn.to_q(hs[:, a * W : b * W])
        k = attn.to_k(hs)
        v = attn.to_v(hs)
        del hs
        heads = attn.heads
        hd = k.shape[-1] // heads
        q = q.view(B, -1, heads, hd).transpose(1, 2)
        k = k.view(B, -1, heads, hd).transpose(1, 2)
        v = v.view(B, -1, heads, hd).transpose(1, 2)
        proc = attn.processor
        if type(proc).__name__ == "ChunkedAttnProcessor" and proc._applies(attn, x, None, None, (), {}):
            o = chunked_attention(q, k, v, proc.max_score_bytes, proc.chunk)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        del k, v
        o = o.transpose(1, 2).reshape(B, -1, heads * hd).to(q.dtype)
        o = attn.to_out[1](attn.to_out[0](o))
        o = o.transpose(-1, -2).reshape(B, C, b - a, W)
        if attn.residual_connection:
            o = o + residual
        return o / attn.rescale_output_factor

    # -- the decode -----------------------------------------------------------------------------------------------
    def decode_one(self, z: Tensor) -> Tensor:
        """z: (1, C, h, w) raw latents (every rank the same) -> this rank's band of the image (1, 3, (b-a)*f, w*f)."""
        dec, vae = self.dec, self.vae
        comm = self.comm
        x = z
        pqc = getattr(vae, "post_quant_conv", None)
        if pqc is not None and getattr(vae.config, "use_post_quant_conv", True) is not False:
            x = pqc(x)
        # latent resolution, redundant on every rank: conv_in, the mid-block up to its last attention
        x = dec.conv_in(x)
        self.fold = self.norm.use_kernels(x)
        mid = dec.mid_block
        ops = [("res", mid.resnets[0])]
        for attn, res in zip(mid.attentions, mid.resnets[1:]):
            if attn is not None:
                ops.append(("attn", attn))
            ops.append(("res", res))
        last_attn = max((i for i, (k, _) in enumerate(ops) if k == "attn"), default=None)
        whole_until = last_attn if last_attn is not None else len(ops)
        for kind, m in ops[:whole_until]:
            x = m(x) if kind == "attn" else m(x, None)
        # full -> this rank's rows
        x = (self._attention(ops[last_attn][1], x) if last_attn is not None
             else x.narrow(2, comm.a, comm.b - comm.a).contiguous())
        for kind, m in ops[whole_until + 1 :]:  # (resnets: their two halves as the up-blocks' passes run)
            ps = Pass("res", m, 0, 0, 1, "mid")
            x = self.res2(None, ps, Activation(x, None), self.res1(None, ps, Activation(x, None))).t
        up_dtype = next(iter(dec.up_blocks.parameters())).dtype
        return walk(self.passes, self, Activation(x.to(up_dtype), None))


# ================================================================================================================
# AutoencoderKLWan (Wan 2.1 / 2.2): band-parallel chunked decode with per-band causal caches
# ================================================================================================================


class WanBandHalo:
    """The rows beyond a band's edges for Wan's chunk decoder (ChunkDecoder(halo=...)), from the neighbour ranks:
    every spatial conv exchanges the boundary rows of its staged input ([causal history | new frames], i.e. including
    the history), runs on the band with zero padding, and adds the neighbours' rows to its edge rows (add_halo: the
    received row through the kernel's first / last row). The mid-block attention gathers its latent-resolution
    input. Each band keeps its own causal caches. A conv stacked_conv3d marked runs time-stacked as on one GPU: the
    rows exchanged are the stack's (each holds the 3 frames its output frame reads). The head conv on tapconv
    exchanges rows of its GEMM output (the 27 taps per pixel)."""

    def __init__(self, vae, comm: BandComm):
        self.comm = comm
        self.halo_seen: set[int] = set()
        self.attn_calls = 0
        wan = wan_module()
        self.expected = {}
        for name, m in vae.decoder.named_modules():
            if isinstance(m, wan.WanCausalConv3d) and m.kernel_size[1] > 1:
                self.expected[id(m)] = name
            elif isinstance(m, wan.WanResample) and isinstance(getattr(m, "resample", None), nn.Sequential):
                c = m.resample[-1] if len(m.resample) else None
                if c is not None and kernel_hw(c)[0] > 1:
                    self.expected[id(c)] = name + ".resample"

    def run(self, dec: ChunkDecoder, conv, x: Tensor, bias: bool) -> Tensor:
        if isinstance(x, Stacked):
            return self.run_stacked(dec, conv, x, bias)
        kh, kw = kernel_hw(conv)
        if kh == 1:
            return dec.run_local(conv, x, bias)
        if not dec._plain(conv) or kh != 3 or tuple(conv.stride) != (1, 1, 1) or conv._padding[2] != 1:
            raise DistributedError(f"band decoding needs stock 3x3x3 WanCausalConv3d convs; {type(conv).__name__}"
                                   " is patched/hooked or of another shape (decode on one GPU instead)")
        self.halo_seen.add(id(conv))
        pend = self.comm.exchange_start(x, 3)
        y = dec.run_local(conv, x, bias)
        top, bot = pend.wait()
        pw = conv._padding[0]

        def halo(r: Tensor, i: int) -> Tensor:  # (N, C, hist + k, 1, W) -> (N, C', k, 1, W): no temporal padding
            return F.conv3d(r, halo_weight(conv, conv.weight, i, 3), None, 1, (0, 0, pw), 1, conv.groups)

        add_halo(top, bot, y, halo, 3)
        return y

    def run_stacked(self, dec: ChunkDecoder, conv, st: Stacked, bias: bool) -> Tensor:
        """The time-stacked Conv2d on this band's stack S (N*k, 3C, h, W): S's boundary rows go to the
        neighbours while it runs, then the received rows complete its first / last output rows (add_halo)."""
        S = st.S
        self.halo_seen.add(id(conv))
        pend = self.comm.exchange_start(S, 2)
        w = stacked_w(conv, S.dtype)
        pw = conv._padding[0]
        y4 = F.conv2d(S, w, conv.bias if bias else None, 1, (conv._padding[2], pw))
        top, bot = pend.wait()
        add_halo(top, bot, y4, lambda r, i: F.conv2d(r, halo_weight(conv, w, i, 2), None, 1, (0, pw)), 2)
        return dec._unstack(y4, st)

    def tap_sum(self, dec: ChunkDecoder, conv, Y: Tensor, y: Tensor) -> None:
        """The head conv as tapconv's GEMM + tap sum: the rows exchanged are those of the planar GEMM output Y
        (27 taps x Co channels); a received row's taps of kernel row 0 (from above) / 2 (from below), summed
        with kernel (3, 1, 3), complete the edge rows."""
        self.halo_seen.add(id(conv))
        pend = self.comm.exchange_start(Y, 3)
        co = conv.out_channels
        tapconv.tap_sum(Y, co, (3, 3, 3), conv.bias, y)
        top, bot = pend.wait()

        def halo(r: Tensor, i: int) -> Tensor:  # Y's row (n, 27 Co, hist + k, 1, W) -> its taps of kernel row i
            n, _, ts, _, w = r.shape
            taps = r.reshape(n, 3, 3, 3, co, ts, 1, w)[:, :, i].reshape(n, 9 * co, ts, 1, w)  # (dt, dw, o)
            o = torch.empty((n, co, ts - 2, 1, w), dtype=y.dtype, device=y.device)
            return tapconv.tap_sum(taps, co, (3, 1, 3), None, o)

        add_halo(top, bot, y, halo, 3)

    def attention(self, dec: ChunkDecoder, blk, x: Tensor) -> Tensor | None:
        """The kernel path's mid-block attention for this band's query rows (None: the decoder calls blk)."""
        if isinstance(blk, _WanBandAttention) and dec._attn_fusable(blk.inner, x):
            return blk.fused(x, dec)
        return None

    def upsample_conv2d(self, dec: ChunkDecoder, up, conv2d, x2: Tensor) -> Tensor:
        """The resample's 2x upsample + 2D conv on the band's frames, with a halo exchange around the frame-group
        conv (frames_up_conv) and the edge rows recomputed from slabs of the upsampled neighbour rows."""
        # not the single-GPU choice, on purpose: the edge slabs below assume 2x; a hooked Upsample runs with its hooks
        if dec.kern and is_2x_nearest(up):
            up_fn = functools.partial(dec._br, upsample2x=True)  # the kernel: bitwise the same copy
            dec.stats["upsample_kernel"] += 1
        elif is_2x_nearest(up) or (isinstance(up, nn.Upsample) and up.mode in ("nearest", "nearest-exact")
                                   and unhooked(up)):
            up_fn = lambda t_: F.interpolate(t_, scale_factor=2.0, mode="nearest")  # noqa: E731 (a copy)
        else:
            up_fn = up
        if kernel_hw(conv2d)[0] != 3:
            raise DistributedError("band decoding: the Wan resample conv is not 3x3")
        self.halo_seen.add(id(conv2d))
        pend = self.comm.exchange_start(x2, 2)
        phase = phase_ok(conv2d, up, x2)  # stages/upsample_conv's 2x2 phase convs: the same map
        dec.stats["upsample_phase"] += phase
        y = frames_up_conv(conv2d, up_fn, x2, phase)  # its rows 0 / -1 are fixed below
        top, bot = pend.wait()
        rows = conv2d_rows(conv2d)
        if top is not None:  # upsampled rows 2a-1, 2a, 2a+1 = [top, x0, x0]
            slab = up_fn(torch.cat([top, x2[:, :, :1]], 2)).narrow(2, 1, 3)
            y[:, :, :1].copy_(rows(slab))
        if bot is not None:  # upsampled rows 2b-2, 2b-1, 2b = [x_last, x_last, bot]
            slab = up_fn(torch.cat([x2[:, :, -1:], bot], 2)).narrow(2, 0, 3)
            y[:, :, -1:].copy_(rows(slab))
        return y

    def check_coverage(self) -> None:
        missing = [n for i, n in self.expected.items() if i not in self.halo_seen]
        if missing:
            raise DistributedError("band decoding: these convs ran without the halo exchange (the chunk decoder "
                                   f"changed?): {', '.join(sorted(missing)[:6])}")


class _WanBandAttention(nn.Module):
    """Stands in for a WanAttentionBlock during a band decode: per-frame attention over the whole latent plane for
    the queries of this rank's rows (the plane is gathered from all bands; K/V computed for all of it)."""

    def __init__(self, inner: nn.Module, comm: BandComm, owner):
        super().__init__()
        self.inner = inner
        self.comm = comm
        self.owner = owner

    def forward(self, x: Tensor) -> Tensor:
        self.owner.attn_calls += 1
        m, comm = self.inner, self.comm
        full = comm.allgather_rows(x, 3)  # (b, c, t, H, W) at latent resolution
        b, c, t, H, W = full.shape
        a0, b0 = comm.a, comm.b
        f = full.permute(0, 2, 1, 3, 4).reshape(b * t, c, H, W)
        del full
        f = m.norm(f)
        qkv = m.to_qkv(f)
        del f
        qkv = qkv.reshape(b * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        q = q[:, :, a0 * W : b0 * W]
        o = F.scaled_dot_product_attention(q, k, v)
        del qkv, q, k, v
        o = o.squeeze(1).permute(0, 2, 1).reshape(b * t, c, b0 - a0, W)
        o = m.proj(o)
        o = o.view(b, t, c, b0 - a0, W).permute(0, 2, 1, 3, 4)
        return o + x

    def fused(self, x: Tensor, dec) -> Tensor:
        """The kernel path (ChunkDecoder._attention's math for this rank's query rows): the channels-last
        bands are gathered as they are, the norm and the K/V projection run on the whole plane, Q only for this
        rank's rows, fused_epilogues' exact chunked GEMM attention (SDPA's only kernel for head_dim 384 is its
        memory-efficient one, several times slower), and one epilogue for proj's bias and the residual."""
        self.owner.attn_calls += 1
        m, comm = self.inner, self.comm
        N, C, T, h, W = x.shape
        full = comm.allgather_rows(x.permute(0, 2, 3, 4, 1), 2)  # (N, T, H, W, C): every band's rows, no relayout
        H = full.shape[2]
        B, L = N * T, H * W
        f = m.norm(full.permute(0, 1, 4, 2, 3).reshape(B, C, H, W))  # a channels_last view of the frames
        del full
        rows = f.permute(0, 2, 3, 1).reshape(B, L, C)
        del f
        wq, bq = m.to_qkv.weight.reshape(3 * C, C), m.to_qkv.bias
        bq_q, bq_kv = (None, None) if bq is None else (bq[:C], bq[C:])
        kv = F.linear(rows, wq[C:], bq_kv).view(B, 1, L, 2 * C)
        k, v = kv.split(C, dim=-1)
        q = F.linear(rows[:, comm.a * W : comm.b * W], wq[:C], bq_q).view(B, 1, h * W, C)
        del rows
        o = chunked_attention(q, k, v, softmax_kernel=None if x.is_cuda else False)
        del q, k, v, kv
        hp = F.linear(o.view(B * h * W, C), m.proj.weight.reshape(C, C))
        del o
        dec.stats["attention_chunked"] += 1
        return dec._br(hp.view(N, T, h, W, C).permute(0, 4, 1, 2, 3), m.proj.bias, x)


def _decode_wan_band(vae, z: Tensor, comm: BandComm, chunk, fused, channels_last, gather: bool):
    z = prepare_latents(vae, z)
    wan = wan_module()
    mid = vae.decoder.mid_block
    for i, m in enumerate(mid.attentions):
        if m is not None and not isinstance(m, wan.WanAttentionBlock):
            raise DistributedError(f"mid_block.attentions.{i}: {type(m).__name__} is not a WanAttentionBlock")
    halo = WanBandHalo(vae, comm)
    dec = ChunkDecoder(vae, wan_channels_last(vae, channels_last), fused, stack=True, halo=halo)
    p = patch_size(vae)
    sched = video.chunk_schedule(z.shape[2], chunk)
    total = sum(video.output_frame_counts(sched, temporal_factor(vae)))
    zb = z[:, :, :, comm.a : comm.b].contiguous()
    band = None
    orig = list(mid.attentions)
    try:
        for i, m in enumerate(orig):
            if m is not None:
                mid.attentions[i] = _WanBandAttention(m, comm, halo)
        t0 = f0 = 0
        for k in sched:
            y = dec.step(zb[:, :, t0 : t0 + k])
            if t0 == 0:
                halo.check_coverage()
                if any(m is not None for m in orig) and halo.attn_calls == 0:
                    raise DistributedError("band decoding: the Wan mid-block attention was not reached")
            t0 += k
            if band is None:
                band = torch.empty(video.final_shape(y, p, total), dtype=y.dtype, device=y.device)
            video.finish_float(y, p, band[:, :, f0 : f0 + y.shape[2]])
            f0 += y.shape[2]
            del y
    finally:
        for i, m in enumerate(orig):
            if m is not None:
                mid.attentions[i] = m
    scale = band.shape[3] // (comm.b - comm.a)
    return (_gather(comm, band, 3, scale) if gather else band), {"stats": dict(dec.stats), "schedule": sched,
                                                                  "scale": scale}


def _gather(comm: BandComm, band: Tensor, dim: int, scale: int) -> Tensor | None:
    """Every rank's band (rows along `dim`) -> the whole output on rank 0, None elsewhere."""
    out = None
    if comm.rank == 0:
        shape = list(band.shape)
        shape[dim] = scale * comm.bands[-1][1]
        out = torch.empty(shape, dtype=band.dtype, device=band.device)
    comm.gather_to_root(band, dim, scale, out)
    return out


# ================================================================================================================
# Public: band-parallel decode
# ================================================================================================================


def supports_band(vae: nn.Module) -> tuple[bool, str]:
    """Can :func:`band_parallel_decode` split this VAE? -> (ok, why not)."""
    cls = type(vae).__name__
    if cls == "AutoencoderKLWan":
        fp8 = sum(1 for m in vae.decoder.modules() if getattr(m, "_vaeopt_fp8conv", False))
        if fp8:  # e4m3 staged inputs: the halo rows' convs would need the fp8 conv's scales and packed weights
            return False, Said(f"{fp8} of the decoder's convs run in fp8: band decoding runs Wan's convs in the "
                               "compute dtype only (decode on one GPU, or with {0})", Hint("fp8", "off"))
        return True, ""
    if cls != "AutoencoderKL":
        return False, f"{cls}: band-parallel decoding covers AutoencoderKL (SD/SDXL/SD3/FLUX) and AutoencoderKLWan"
    try:
        plan_passes(vae)
    except VaeoptError as e:
        return False, str(e)
    return True, ""


@torch.no_grad()
def band_parallel_decode(vae: nn.Module, z_raw: Tensor, group=None, *, chunk: int | Sequence[int] | None = 4,
                         gather: bool = True, kernels: bool | None = None, fused: bool | None = None,
                         channels_last: bool | None = None, return_info: bool = False):
    """Decode raw latents on all ranks of `group` (default: the world), each rank one horizontal band
    (docs/multi-gpu.md). Call it on every rank with the same VAE weights and latents (checked): (N, C, h, w) for an
    AutoencoderKL -> (N, 3, 8h, 8w) as ``vae.decode(z).sample``; (N, C, T, h, w) for an AutoencoderKLWan -> as
    ``vaeopt.video.decode_video`` (``chunk``, ``fused``, ``channels_last`` as there). ``kernels``: the Triton
    GroupNorm kernels of the image path (None: on CUDA when available). Returns the whole decode on rank 0 and None
    elsewhere (``gather=True``), or ``(band, (y0, y1))`` on every rank; with ``return_info`` also a dict (halo
    exchanges and bytes, statistics merges, fallbacks, the bands) as the last element."""
    ok, why = supports_band(vae)
    if not ok:
        raise DistributedError(spelled(why))  # (its hint as an Options field: this is the Python entry)
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError("band_parallel_decode needs an initialised process group (torchrun, or "
                               "vaeopt.distributed.launch / init_distributed)")
    p = next(p for p in vae.parameters() if p.is_floating_point())
    device, dtype = p.device, p.dtype
    if getattr(vae, "training", False):
        raise DistributedError("band-parallel decoding runs in eval mode only (call vae.eval())")
    cls = type(vae).__name__
    video = cls == "AutoencoderKLWan"
    if video and z_raw.dim() != 5:
        raise DistributedError(f"Wan latents must be (N, C, T, h, w), got {tuple(z_raw.shape)}")
    if not video and z_raw.dim() != 4:
        raise DistributedError(f"image latents must be (N, C, h, w), got {tuple(z_raw.shape)}")
    h = z_raw.shape[-2]
    comm = BandComm(group, h, device)
    comm.check_same(tuple(z_raw.shape), "the latent shape")
    t0 = time.perf_counter()
    if video:
        res, vinfo = _decode_wan_band(vae, z_raw, comm, chunk, fused, channels_last, gather)
        info = {"kind": "wan", **vinfo}
    else:
        dec = _ImageBandDecoder(vae, comm, kernels)
        z = z_raw.to(device, dtype)
        bands = []
        for i in range(z.shape[0]):
            bands.append(dec.decode_one(z[i : i + 1]))
        band = bands[0] if len(bands) == 1 else torch.cat(bands, 0)
        del bands
        scale = band.shape[2] // (comm.b - comm.a)
        info = {"kind": "image", "notes": dec.notes, "scale": scale, "fold": dec.fold, **dec.counts}
        res = _gather(comm, band, 2, scale) if gather else band
    scale = info["scale"]
    info.update(comm.counts, bands=comm.bands, rank=comm.rank, world=comm.world,
                seconds=time.perf_counter() - t0)
    if not gather:
        res = (res, (comm.a * scale, comm.b * scale))
        return (*res, info) if return_info else res
    return (res, info) if return_info else res
