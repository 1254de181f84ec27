"""Wan 2.1 / 2.2's decoder, run chunk by chunk: exact multi-frame chunks, static causal caches (docs/video.md).

diffusers' `AutoencoderKLWan._decode` runs the decoder once per latent frame and keeps, for every causal conv, the
last `CACHE_T`=2 frames of that conv's *input* (`feat_cache`): exactly a causal convolution over the whole clip with
2 zero frames in front. Two places need more than that:

* `WanResample('upsample3d')`: on the first call it stores the marker 'Rep' and does *not* run `time_conv`, so latent
  frame 0 yields one frame, not two; from the next call on, `time_conv` runs over the frames after frame 0 with zero
  history. So K-frame calls are exact once frame 0 went alone (verified in tests/test_video.py).
* Wan 2.2's `DupUp3D(first_chunk=True)` drops the first `factor_t-1` frames of the shortcut: the same rule.

Everything else is per frame or a causal conv, so a call of K latent frames equals K one-frame calls up to float
summation order. `ChunkDecoder` runs the decoder's own submodules (nothing copied or changed) with this control flow:
one static 2-frame history buffer per conv, updated in place; the conv input built once per call as
[history | new frames], written straight by the previous norm (`out=`), spatial padding left to the conv (diffusers
does clone + cat + `F.pad`); channels_last_3d end to end when the Conv3d weights are; a one-frame clip in one call
(a Qwen-Image picture, `one_call`) runs each causal conv as the Conv2d of its last tap, keeping no history; outputs
go into a preallocated clip tensor or, frame group by frame group, to the host; oversized norms, 2D upsamples and
Conv3d calls run over frame groups to keep the peak low (estimate_chunk_bytes). The op sequence per element is
diffusers', so fp32 agrees to ~1e-6 and bf16 to bf16 rounding.

Fused kernel path (`fused=`; on by default where the Triton kernels run and fused_norms was applied), per residual
block:

    norm1+SiLU (kernel, + the input's owed bias)  -> written straight into conv1's input buffer (rms_norm_silu out=)
    conv1 without bias                            -> norm2+SiLU with conv1's bias folded in (x_bias), into conv2's
                                                     input buffer
    conv2 without bias [, 1x1x1 shortcut conv without bias]
    one epilogue kernel: (residual + shortcut bias) + (conv2 out + conv2 bias)           (epilogue.bias_residual)

and WanResample's nearest 2x upsample disappears into kernels (the epilogue writes the upsampled frames; for
'upsample3d' one kernel adds time_conv's bias, interleaves the channel halves into frames and upsamples). Biases
that cuDNN would add in a broadcast pass are folded into the next norm (x_bias) or residual (residual_bias; through
a 1x1x1 shortcut as W @ bias). Blocks or resamplers that do not match (hooks, other modules) take the torch path; a
bias they cannot fold is added first. Counts of what was fused: `ChunkDecoder.stats`.
"""

from __future__ import annotations

import collections
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vaeopt.engine import wan_ops
from vaeopt.engine.fold import shortcut_bias
from vaeopt.engine.wan_ops import (E4M3, Pending, Single, Stacked, copy_lastdim, frames4, last_tap_w,
                                   frames_up_conv, fused_from_env, igemm_weights, meta_result, norm_act_into,
                                   phase_ok, plain_conv2d, rms_params, stacked_w, tap_matrix, wan_module)
from vaeopt.errors import CheckpointError, VaeoptError
from vaeopt.kernels import tapconv, triton_available
from vaeopt.stages import fused_norms, unhooked, upsample_conv
from vaeopt.stages.fused_epilogues import chunked_attention
from vaeopt.stages.fused_norms import has_fused_rms_norms
from vaeopt.stages.marks import is_2x_nearest, packed_fp8, stacked


class ChunkDecoder:
    """Decodes consecutive latent chunks of one clip with the decoder's submodules; holds the causal caches.

    fused (None: auto, True: required, False: off; `VAEOPT_VIDEO_FUSED` when None): the fused kernel path of the
    module docstring, where the Triton kernels run for the latents (CUDA, or CPU under TRITON_INTERPRET=1; no
    autocast) and, in auto mode, the fused_norms and fused_epilogues stages were applied; otherwise (and for any module
    that does not match) the torch path. `stats` counts what the fused path did (per decoder, over all calls)."""

    STACK = True  # stacked_conv3d's Conv2d-over-time-stacked-channels may run (spatial tiles, which crop the staged
    # 5-D input, turn it off; band decoders exchange rows of the stack instead)

    def __init__(self, vae, channels_last: bool, fused: bool | None = None, stack: bool | None = None, arena=None,
                 halo=None):
        """stack: whether stacked_conv3d's time-stacked convs may run (None: the class default, STACK). arena: where
        new causal caches come from (anything with take(shape, dtype, memory_format=) -> Tensor | None, e.g. one
        block reserved up front by vaeopt.video_tiling); None, or a None from take(): allocated one by one.
        halo: None for a whole frame; else the source of the rows beyond a band's edges, which completes every
        spatial conv of the band (run, run_stacked, tap_sum, upsample_conv2d; attention may take over the mid-block
        attention; vaeopt.bands.WanBandHalo exchanges them with the neighbour ranks)."""
        if stack is not None:
            self.STACK = bool(stack)
        self.arena = arena
        self.halo = halo
        self.vae = vae
        self.dec = vae.decoder
        self.mf = torch.channels_last_3d if channels_last else torch.contiguous_format
        self.cache: dict[nn.Module, Tensor] = {}  # conv -> (N, C, 2, H, W) last input frames, updated in place
        self.first = True
        # set by the caller when this decoder makes the clip's only call (one chunk: a Qwen-Image picture): no later
        # call reads the causal caches, and a one-frame call's convs meet only their last temporal tap (_single)
        self.one_call = False
        self.fused = fused_from_env() if fused is None else bool(fused)
        self.kern = False  # the fused kernel path is on for the current call
        self.stats: collections.Counter = collections.Counter()
        self.fp8_scales: dict[nn.Module, float] = {}  # conv -> static e4m3 scale of its input (fp8 convs)

    def _kernels_on(self, z: Tensor) -> bool:
        if self.fused is False:
            return False
        if z.is_meta:  # dry run of the fused path (estimate_chunk_bytes(fused=True))
            return bool(self.fused)
        if not fused_norms.use_kernel(z):
            if self.fused:
                raise VaeoptError("fused video decode requested, but the Triton kernels cannot run for these latents "
                                  f"({triton_available(z.device)[1]}; dtype {z.dtype}, autocast/compile off needed)")
            return False
        # auto: on when the pipeline applied both fused_norms and fused_epilogues to this model
        return True if self.fused else (has_fused_rms_norms(self.dec)
                                        and bool(getattr(self.vae, "_vaeopt_fused_epilogues", None)))

    def step(self, z: Tensor) -> Tensor:
        """z: (N, z_dim, k, h, w) raw latents of the next k frames -> decoder output (N, C_out, f, H, W), unclamped,
        before unpatchify; f = 1 + 4(k-1) on the first call, 4k after."""
        n = len(self.dec.up_blocks)
        box, xb = self.front(z, n, defer_last=True)
        return self.back(box, xb, n)

    # A call can also run in two parts, front(z, s) then back(box, xb, s), with the activation between them (the
    # input of up_blocks[s]) handed over in `box`: vaeopt.video_tiling runs the front once per chunk on the whole
    # frame and the back per spatial tile, each tile with its own ChunkDecoder (own causal caches).
    # Activations are handed to the next block in a one-element list that the block empties (`box.pop()`), so that no
    # caller keeps a block's input alive while the block runs (a full activation less at the peak). `xb` is a bias
    # still owed to the activation in the box (its conv ran without it: the consumer folds it in).
    def front(self, z: Tensor, stop: int, defer_last: bool = False) -> tuple[list[Tensor], Tensor | None]:
        """post_quant_conv, conv_in, the mid-block and up_blocks[:stop] on the next k latent frames -> ([activation],
        owed bias or None). Does not end the call: back() does (a caller running only the front sets `first`).
        defer_last (step(), which hands the box straight to back()): with every up block run here, the activation
        may be a Pending block output for the head's norm."""
        with torch.no_grad():
            self.kern = self._kernels_on(z)
            x = self._conv(self.vae.post_quant_conv, z.contiguous(memory_format=self.mf))
            conv_in = self.dec.conv_in
            if self.kern and self._plain(conv_in) and self._hist(conv_in):
                box, xb = [self._run(conv_in, self._stage(conv_in, x), bias=False)], conv_in.bias
                self.stats["bias_folded"] += conv_in.bias is not None
            else:
                box, xb = [self._conv(conv_in, x)], None
            del x
            mid = self.dec.mid_block
            box = [self._block(mid.resnets[0], box, xb)]
            for attn, res in zip(mid.attentions, mid.resnets[1:]):
                if attn is not None:
                    box = [self._attention(attn, box.pop())]
                box = [self._block(res, box, None)]
            xb = None
            ubs = self.dec.up_blocks[:stop]
            defer_last = defer_last and stop >= len(self.dec.up_blocks) and self._head_k() is not None
            for i, ub in enumerate(ubs):
                x, xb = self._upblock(ub, box, xb, defer_last=defer_last and i == len(ubs) - 1)
                box = [x]
                del x
        return box, xb

    def back(self, box: list[Tensor], xb: Tensor | None, start: int) -> Tensor:
        """up_blocks[start:], norm_out and conv_out on the activation in `box` (emptied), which owes the bias `xb`
        -> decoder output, as step(). Ends the call."""
        with torch.no_grad():
            b0 = box[0].h if isinstance(box[0], Pending) else box[0]
            self.kern = self._kernels_on(b0)
            conv_out, norm_out, act = self.dec.conv_out, self.dec.norm_out, self.dec.nonlinearity
            p = self._head_k()
            ubs = self.dec.up_blocks[start:]
            for i, ub in enumerate(ubs):
                x, xb = self._upblock(ub, box, xb, defer_last=p is not None and i == len(ubs) - 1)
                box = [x]
                del x
            if p is not None:
                src = box[0].h if isinstance(box[0], Pending) else box[0]
                if self._taps_ok(conv_out, src):
                    y = self._conv_taps(conv_out, box.pop(), p, xb)
                else:
                    y = self._run(conv_out, self._stage_k(conv_out, box.pop(), p, xb))
            else:
                y = self._run(conv_out, self._stage(conv_out, self._materialize(box.pop(), xb), norm_out, act))
        self.first = False
        return y

    def _head_k(self):
        """norm_out's kernel parameters when the head (norm_out + SiLU + conv_out) runs on the kernels, else None."""
        conv_out = self.dec.conv_out
        p = rms_params(self.dec.norm_out, self.dec.nonlinearity) if self.kern else None
        return p if p is not None and self._plain(conv_out) and self._hist(conv_out) else None

    # -- mid-block attention ---------------------------------------------------------------------------------
    def _attn_fusable(self, blk, x: Tensor) -> bool:
        wan = wan_module()
        return (self.kern and type(blk) is wan.WanAttentionBlock and unhooked(blk) and self.mf is torch.channels_last_3d
                and all(plain_conv2d(c) and c.kernel_size == (1, 1) and c.groups == 1 and c.stride == (1, 1)
                        and c.padding == (0, 0) for c in (blk.to_qkv, blk.proj)))

    def _attention(self, blk, x: Tensor) -> Tensor:
        """WanAttentionBlock (one head, per frame): x + proj(attention(to_qkv(norm(x)))). On the kernel path the
        attention is fused_epilogues' exact query-chunked GEMM attention (fp32 scores and softmax; SDPA has only its
        memory-efficient kernel for head_dim 384), the 1x1 convs are GEMMs on the channels-last rows, and one
        epilogue adds proj's bias and the residual. Else diffusers' forward."""
        if self.halo is not None and (y := self.halo.attention(self, blk, x)) is not None:
            return y
        if not self._attn_fusable(blk, x):
            return blk(x)
        N, C, T, H, W = x.shape
        B, L = N * T, H * W
        h = blk.norm(x.permute(0, 2, 1, 3, 4).reshape(B, C, H, W))  # a view of the frames (channels_last)
        rows = h.permute(0, 2, 3, 1).reshape(B * L, C)
        del h
        wq, wp = blk.to_qkv.weight, blk.proj.weight
        qkv = F.linear(rows, wq.reshape(wq.shape[0], C), blk.to_qkv.bias).view(B, 1, L, 3 * C)
        del rows
        q, k, v = qkv.split(C, dim=-1)  # strided views, as the GEMMs take them
        o = chunked_attention(q, k, v, softmax_kernel=None if x.is_cuda else False)  # CPU: torch's softmax (the
        # interpreted kernel, tested on its own, would double a CPU test decode)
        del qkv, q, k, v
        h = F.linear(o.view(B * L, C), wp.reshape(C, C))
        del o
        self.stats["attention_chunked"] += 1
        h5 = h.view(N, T, H, W, C).permute(0, 4, 1, 2, 3)  # channels_last_3d
        return self._br(h5, blk.proj.bias, x)

    # -- causal conv with a static 2-frame history ------------------------------------------------------------
    # A conv call is split in two so that callers can drop the producer's tensor between them:
    #   staged = self._stage(conv, src, norm, act); del src; y = self._run(conv, staged)
    def _conv(self, conv: nn.Module, src: Tensor):
        """conv(src) continuing the conv's causal stream. src: (N, C, k, H, W)."""
        return self._run(conv, self._stage(conv, src))

    @staticmethod
    def _plain(conv: nn.Module) -> bool:
        """A stock WanCausalConv3d we may run as F.conv3d on its weights (no hooks or patched forward to honour)."""
        wan = wan_module()
        return (
            type(conv).forward is wan.WanCausalConv3d.forward
            and unhooked(conv)
            and conv.stride[0] == 1
            and conv.dilation[0] == 1
            and conv.padding == (0, 0, 0)
        )

    @staticmethod
    def _hist(conv: nn.Module) -> int:
        return conv._padding[4] if hasattr(conv, "_padding") else 0  # causal frames in front (2 for kernel 3)

    def _stage(self, conv, src: Tensor, norm=None, act=None) -> Tensor:
        """The conv's input for this call: [history | act(norm(src))] in one buffer (plain WanCausalConv3d with a
        temporal kernel), else act(norm(src))."""
        hist = self._hist(conv)
        if not self._plain(conv) or hist == 0:
            if norm is None:
                return src
            if not self._plain(conv):
                return act(norm(src))
            x = torch.empty_like(src, memory_format=self.mf)
            norm_act_into(norm, act, src, x)
            return x
        N, C, k, H, W = src.shape
        if self._single(conv, src):
            if norm is None:
                return Single(src.contiguous(memory_format=self.mf))
            x = torch.empty_like(src, memory_format=self.mf)
            norm_act_into(norm, act, src, x)
            return Single(x)
        buf = torch.empty((N, C, hist + k, H, W), dtype=src.dtype, device=src.device, memory_format=self.mf)
        cache = self.cache.get(conv)
        if cache is None:
            buf[:, :, :hist].zero_()  # diffusers' zero padding before the clip's first frame
        else:
            buf[:, :, :hist].copy_(cache)
        if norm is None:
            buf[:, :, hist:].copy_(src)
        else:
            norm_act_into(norm, act, src, buf[:, :, hist:])
        return buf

    def _single(self, conv, src: Tensor) -> bool:
        """Whether this causal conv runs as a Conv2d of its last temporal tap on the new frame alone: the clip's only
        call (one_call), one frame, no history yet. Its history is diffusers' zero padding, which the other taps only
        multiply (a third of the FLOPs and of the staged input at kernel 3), and no later call reads the history it
        would leave, so none is kept. Not for a band's decoder (its halo exchange runs the staged conv) or a frame past
        32-bit indexing (the frame-grouped Conv3d)."""
        N, C, k, H, W = src.shape
        return (self.one_call and self.first and k == 1 and self.halo is None and conv not in self.cache
                and self._plain(conv) and self._hist(conv) == conv.kernel_size[0] - 1 > 0
                and N * max(C, conv.out_channels) * H * W < wan_ops.INT32_ELEMS)

    def _run_single(self, conv, x: Tensor, bias: bool) -> Tensor:
        """conv([zeros | x]) for one frame x (N, C, 1, H, W): the Conv2d of the last temporal tap, same padding."""
        fmt = torch.channels_last if self.mf is torch.channels_last_3d else torch.contiguous_format
        self.stats["single_frame_conv"] += 1
        y = F.conv2d(x[:, :, 0], last_tap_w(conv, x.dtype, fmt), conv.bias if bias else None, 1,
                     (conv._padding[2], conv._padding[0]))
        return y.unsqueeze(2)  # (N, Co, 1, H, W): channels_last_3d strides from a channels_last y

    def _run(self, conv, x: Tensor, bias: bool = True) -> Tensor:
        """The conv over a staged input (updates its history). bias=False (plain convs only): without the conv's
        bias, which the caller has folded into the next kernel. A band's conv also takes its halo rows."""
        if self.halo is not None:
            return self.halo.run(self, conv, x, bias)
        return self.run_local(conv, x, bias)

    def run_local(self, conv, x: Tensor, bias: bool = True) -> Tensor:
        """_run on this decoder's rows only (zero padding at their edges)."""
        if isinstance(x, Single):
            return self._run_single(conv, x.x, bias)
        if isinstance(x, Stacked):
            return self._run_stacked(conv, x, bias)
        hist = self._hist(conv)
        if not self._plain(conv):  # a swapped-in conv module: call it with WanCausalConv3d's (x, cache_x) contract
            if not bias:
                raise AssertionError("bias folding needs a plain WanCausalConv3d")
            if hist == 0:
                return conv(x)
            N, C, k, H, W = x.shape
            cache = self._history(conv, (N, C, hist, H, W), x)
            y = conv(x, cache)  # cache has exactly `hist` frames, so no zero padding is added
            self._update(conv, torch.cat([cache, x], 2) if k < hist else x)
            return y
        pad = (0, conv._padding[2], conv._padding[0])  # spatial zero padding done by the conv, not F.pad
        N, C, T, H, W = x.shape
        k = T - hist
        per = N * max(C, conv.out_channels) * H * W  # elements per frame, input or output
        cb = conv.bias if bias else None
        if x.dtype == E4M3:  # staged in e4m3 by _stage_k: the fp8 implicit-GEMM conv, output in the compute dtype
            from vaeopt.kernels.conv import conv_igemm
            y = conv_igemm(x, packed_fp8(conv), cb, pad[1:], x_scale=self.fp8_scales[conv],
                           out_dtype=conv.weight.dtype)
            self.stats["fp8_conv"] += 1
        elif (packed := igemm_weights(conv, x)) is not None:  # triton_conv chose this layer (64-bit addressing)
            from vaeopt.kernels.conv import conv_igemm

            y = conv_igemm(x, packed, cb, pad[1:])
            self.stats["triton_conv"] += 1
        elif per * T < wan_ops.INT32_ELEMS:
            y = F.conv3d(x, conv.weight, cb, 1, pad, 1, conv.groups)
        else:  # windows of [hist | g frames]: the same causal conv, in pieces
            g = max(4, wan_ops.SPLIT_ELEMS // 2 // per)
            y = torch.empty((N, conv.out_channels, k, H, W), dtype=x.dtype, device=x.device, memory_format=self.mf)
            for s in range(0, k, g):
                y[:, :, s : s + g].copy_(F.conv3d(x[:, :, s : s + g + hist], conv.weight, cb, 1, pad, 1, conv.groups))
        if hist:
            self._update(conv, x)
        return y

    def _history(self, conv, shape, like: Tensor) -> Tensor:
        c = self.cache.get(conv)
        if c is None and self.arena is not None:
            c = self.arena.take(tuple(shape), like.dtype, memory_format=self.mf)
            if c is not None:
                self.cache[conv] = c = c.zero_()
        if c is None:
            c = torch.zeros(shape, dtype=like.dtype, device=like.device).contiguous(memory_format=self.mf)
            self.cache[conv] = c
        return c

    def _update(self, conv, stream_tail: Tensor, fmt: torch.memory_format | None = None) -> None:
        """History <- last frames of [history | new frames] (`stream_tail` ends with them), in place. A new history
        tensor gets the decode's layout, or `fmt`."""
        c = self.cache.get(conv)
        hist = self._hist(conv)
        if c is None and self.arena is not None:
            N, C, _, H, W = stream_tail.shape
            c = self.arena.take((N, C, hist, H, W), stream_tail.dtype, memory_format=fmt or self.mf)
            if c is not None:
                self.cache[conv] = c
        if c is None:
            N, C, _, H, W = stream_tail.shape
            c = torch.empty((N, C, hist, H, W), dtype=stream_tail.dtype, device=stream_tail.device,
                            memory_format=fmt or self.mf)
            self.cache[conv] = c
        if c.stride(1) == 1 and stream_tail.stride(1) == 1:  # channels last: copy with the channels innermost
            copy_lastdim(c.permute(0, 2, 3, 4, 1), stream_tail[:, :, -hist:].permute(0, 2, 3, 4, 1))
        else:
            c.copy_(stream_tail[:, :, -hist:])

    # -- blocks -------------------------------------------------------------------------------------------------
    def _resblock(self, blk, box: list[Tensor]) -> Tensor:
        # dropout is the identity here: eval mode, or p = 0 (check_vae refuses an active one)
        x = box.pop()
        act = blk.nonlinearity
        y = self._run(blk.conv1, self._stage(blk.conv1, x, blk.norm1, act))
        b = self._stage(blk.conv2, y, blk.norm2, act)
        del y  # conv1's output is in conv2's input buffer now: one full activation less at the peak
        y = self._run(blk.conv2, b)
        del b
        # x lives on for the residual anyway; computing a conv shortcut only now avoids holding h (out_dim) as well
        h = x if isinstance(blk.conv_shortcut, nn.Identity) else self._conv(blk.conv_shortcut, x)
        return y.add_(h)

    def _upblock(self, ub, box: list[Tensor], xb: Tensor | None,
                 defer_last: bool = False) -> tuple[Tensor | Pending, Tensor | None]:
        """-> (output, bias it still owes or None). defer_last: the caller's next kernel takes a Pending output
        (the head's norm), so the last residual block may leave it unwritten."""
        wan = wan_module()
        residual = isinstance(ub, wan.WanResidualUpBlock)
        resampler = ub.upsampler if residual else (ub.upsamplers[0] if ub.upsamplers is not None else None)
        dup = residual and ub.avg_shortcut is not None
        if dup and xb is not None:  # DupUp3D reads the block input as is: give it its bias first
            box, xb = [self._materialize(box.pop(), xb)], None
        # Wan 2.2's DupUp3D shortcut needs the block input (diffusers clones it; nothing here writes into it)
        x_in = box[0] if dup else None
        fuse_up = self.kern and resampler is not None and self._up_fusable(resampler)
        last = len(ub.resnets) - 1
        x = None
        ps = [self._res_fusable(res) if self.kern else None for res in ub.resnets]
        for i, (res, p) in enumerate(zip(ub.resnets, ps)):
            if i == last and fuse_up and p is not None:  # its epilogue writes what the resampler needs
                x, xb = self._resample_fused(resampler, [*self._res_parts(res, box, xb, p)])
                break
            # the next block's norm1 (or the head's norm) can add this block's residual itself
            nxt = ps[i + 1] is not None if i < last else (defer_last and resampler is None and not dup)
            # a residual block followed by another one (or by the head) leaves its output Pending: the next norm adds
            # the residual itself (no epilogue pass, one read less; channels-first has no such one-pass kernel)
            defer = nxt and self.mf is torch.channels_last_3d
            box, xb = [self._block(res, box, xb, defer=defer)], None
        if x is None:
            x = box.pop()
            if resampler is not None:
                x = self._resample(resampler, [self._materialize(x, xb)])
                xb = None
        if x_in is not None:
            d = ub.avg_shortcut(x_in, first_chunk=self.first)
            del x_in
            if xb is not None:  # (x + bias) + shortcut in one pass, diffusers' association
                x = self._epilogue(x, xb, d, None)
                xb = None
            else:
                x = x.add_(d)
        return x, xb

    # -- the fused kernel path ------------------------------------------------------------------------------------
    def _materialize(self, x: Tensor | Pending, xb: Tensor | None) -> Tensor:
        """x + xb for a consumer that cannot fold the bias (the same pass cuDNN's bias add would have made); a
        Pending block output is written by its epilogue."""
        if isinstance(x, Pending):
            return self._epilogue(*x)
        if xb is None:
            return x
        self.stats["bias_materialized"] += 1
        return x.add_(xb.to(x.dtype).reshape(1, -1, *([1] * (x.dim() - 2))))

    def _res_fusable(self, blk):
        """(norm1 params, norm2 params) when `blk` can run on the kernels: Wan RMS norm + SiLU twice, plain causal
        convs, and an identity or 1x1x1 plain conv shortcut; else None."""
        p1 = rms_params(blk.norm1, blk.nonlinearity)
        p2 = rms_params(blk.norm2, blk.nonlinearity)
        if p1 is None or p2 is None:
            return None
        c1, c2, sc = blk.conv1, blk.conv2, blk.conv_shortcut
        if not (self._plain(c1) and self._plain(c2) and self._hist(c1) and self._hist(c2)):
            return None
        if not isinstance(sc, nn.Identity):
            if not (self._plain(sc) and self._hist(sc) == 0 and tuple(sc.kernel_size) == (1, 1, 1)):
                return None
        if blk.dropout.training and blk.dropout.p > 0:
            return None
        return p1, p2

    def _block(self, blk, box: list[Tensor], xb: Tensor | None, defer: bool = False) -> Tensor | Pending:
        p = self._res_fusable(blk) if self.kern else None
        if p is None:
            return self._resblock(blk, [self._materialize(box.pop(), xb)])
        h, b, r, rb = self._res_parts(blk, box, xb, p)
        if defer:  # the consumer counts it: as "residual_in_norm" where a norm forms it, else as an "epilogue"
            return Pending(h, b, r, rb)
        return self._epilogue(h, b, r, rb)

    def _norm_k(self, p, x: Tensor, out: Tensor | None = None, xb: Tensor | None = None,
                out_scale: float | None = None, res: Pending | None = None) -> Tensor:
        """rms_norm_silu(x + xb); with `res` (x is res.h), of the block output res, which it also writes over h."""
        self.stats["norm_kernel"] += 1
        if x.is_meta:  # dry run (estimate_chunk_bytes): only the result's storage
            return out if out is not None else meta_result(x, tuple(x.shape))
        from vaeopt.kernels.rms_norm_silu import rms_norm_silu

        gamma, bias, scale, eps = p
        kw = dict(residual=res.r, residual_bias=res.rb, sum_out=x) if res is not None else {}
        return rms_norm_silu(x, gamma, bias, eps, True, scale=scale, x_bias=xb, out=out, out_scale=out_scale, **kw)

    @staticmethod
    def _br(h: Tensor, bias=None, r=None, rb=None, *, upsample2x=False, groups=1, out=None) -> Tensor:
        """epilogue.bias_residual, or on meta tensors (dry run) just its result's storage."""
        if h.is_meta:
            if out is not None:
                return out
            N, C = h.shape[:2]
            sp = (2 * h.shape[2], 2 * h.shape[3]) if upsample2x else tuple(h.shape[2:])
            return meta_result(h, (N * groups, C // groups, *sp))
        from vaeopt.kernels.epilogue import bias_residual

        return bias_residual(h, bias, r, upsample2x=upsample2x, residual_bias=rb, groups=groups, out=out)

    def _stage_k(self, conv, src: Tensor | Pending, p, xb: Tensor | None) -> Tensor | Stacked:
        """[history | rms_norm_silu(src + xb)] for a plain causal conv, the kernel writing into the buffer. For a
        conv the triton_conv stage put on fp8, the buffer (and so the conv's history) is e4m3 with a static scale;
        for a conv stacked_conv3d marked, the time-stacked Conv2d input (Stacked). A Pending src (owing no xb):
        the kernel forms the block output and also writes it over src.h, which the caller keeps as that output."""
        res = None
        if isinstance(src, Pending):
            res, src, xb = src, src.h, src.b
            self.stats["residual_in_norm"] += 1
        hist = self._hist(conv)
        N, C, k, H, W = src.shape
        s8 = self._fp8_scale(conv, p, src)
        if s8 is None and self._single(conv, src):  # the frame alone, normalized by the kernel
            buf = torch.empty((N, C, 1, H, W), dtype=src.dtype, device=src.device, memory_format=self.mf)
            self._norm_k(p, src, buf, xb, res=res)
            return Single(buf)
        if s8 is None and self._stackable(conv, src):
            return self._stage_stacked(conv, src, p, xb, res)
        dt = src.dtype if s8 is None else E4M3
        buf = torch.empty((N, C, hist + k, H, W), dtype=dt, device=src.device, memory_format=self.mf)
        cache = self.cache.get(conv)
        if cache is None:
            buf[:, :, :hist].zero_()
        else:
            buf[:, :, :hist].copy_(cache)
        self._norm_k(p, src, buf[:, :, hist:], xb, out_scale=s8, res=res)
        return buf

    def _stackable(self, conv, src: Tensor) -> bool:
        return (self.STACK and stacked(conv) and self.mf is torch.channels_last_3d and self._hist(conv) == 2
                and conv.kernel_size[0] == 3 and src.dtype == conv.weight.dtype)

    def _stage_stacked(self, conv, src: Tensor, p, xb: Tensor | None, res: Pending | None = None) -> Stacked:
        """The conv's input as (N*k, 3C, H, W) channels_last: frame n*k + t holds stream frames t, t+1, t+2 of
        [history (2) | rms_norm_silu(src + xb) (k)] in channel blocks 0, 1, 2. The history goes into the blocks of
        output frames 0 and 1, the kernel writes every new frame into its (up to) three places."""
        N, C, k, H, W = src.shape
        S = torch.empty((N * k, 3 * C, H, W), dtype=src.dtype, device=src.device, memory_format=torch.channels_last)
        Sv = S.permute(0, 2, 3, 1).view(N, k, H, W, 3, C)
        first = conv not in self.cache
        cache = self._history(conv, (N, C, 2, H, W), src)  # (zeros before the clip's first frame, as diffusers pads)
        hv = cache.permute(0, 2, 3, 4, 1)  # (N, 2, H, W, C)
        copy_lastdim(Sv[:, 0, :, :, 0:2], hv.permute(0, 2, 3, 1, 4))
        if k > 1:
            copy_lastdim(Sv[:, 1, :, :, 0], hv[:, 1])
        elif not first:  # one new frame: the next history is [old slot 1 | it]
            copy_lastdim(hv[:, 0], hv[:, 1])
        self.stats["norm_kernel"] += 1
        if not src.is_meta:
            from vaeopt.kernels.rms_norm_silu import rms_norm_silu

            gamma, bias, scale, eps = p
            # the kernel also writes the stream's last two frames into the history (cache_out)
            kw = dict(residual=res.r, residual_bias=res.rb, sum_out=src) if res is not None else {}
            rms_norm_silu(src, gamma, bias, eps, True, scale=scale, x_bias=xb, out=S, taps=3, cache_out=cache, **kw)
        return Stacked(S, N, k)

    def _run_stacked(self, conv, st: Stacked, bias: bool) -> Tensor:
        """The causal Conv3d as a Conv2d over the stack (stages/stacked_conv3d)."""
        S, N, k = st
        if S.is_meta:
            y4 = torch.empty((N * k, conv.out_channels, *S.shape[2:]), dtype=S.dtype, device=S.device,
                             memory_format=torch.channels_last)
        else:
            y4 = F.conv2d(S, stacked_w(conv, S.dtype), conv.bias if bias else None, 1,
                          (conv._padding[2], conv._padding[0]))
        return self._unstack(y4, st)

    def _unstack(self, y4: Tensor, st: Stacked) -> Tensor:
        """The stacked Conv2d's output (N*k, Co, H, W) channels_last -> (N, Co, k, H, W) channels_last_3d (a view)."""
        _, N, k = st
        _, Co, H, W = y4.shape
        self.stats["stacked_conv"] += 1  # (its history was written by the norm kernel: _stage_stacked)
        return y4.permute(0, 2, 3, 1).reshape(N, k, H, W, Co).permute(0, 4, 1, 2, 3)

    def _taps_ok(self, conv, src: Tensor) -> bool:
        """conv_out (3 channels) runs as kernels/tapconv's norm+GEMM and tap sum (band decoders exchange the GEMM
        output's edge rows: _tap_sum)."""
        return (self.mf is torch.channels_last_3d and conv.kernel_size == (3, 3, 3)
                and tuple(conv._padding) == (1, 1, 1, 1, 2, 0) and conv.groups == 1 and tuple(conv.dilation) == (1, 1, 1)
                and tuple(conv.stride) == (1, 1, 1) and src.dtype == conv.weight.dtype and src.shape[1] <= 256
                and src.dtype in tapconv.SUPPORTED_DTYPES and tapconv.fits(conv.out_channels)
                and not getattr(conv, "_vaeopt_fp8conv", False) and not getattr(conv, "_vaeopt_igemm", False)
                and not self._stackable(conv, src))  # a stage's explicit choice for this conv wins

    def _conv_taps(self, conv, src: Tensor, p, xb: Tensor | None) -> Tensor:
        """conv(rms_norm_silu(src + xb)) continuing the causal stream, for a conv with few output channels
        (kernels/tapconv): one kernel normalizes and multiplies every pixel by the (C, 27*Co) tap matrix into the
        planar Y, whose first two frames are the cached Y of the last two frames (so the history is kept as Y, not
        as the conv's input), one kernel sums the taps. -> (N, Co, k, H, W)."""
        res = None
        if isinstance(src, Pending):  # the last block's output, formed by the kernel and never written
            res, src, xb = src, src.h, src.b
            if not src.is_meta and not (src.permute(0, 2, 3, 4, 1).is_contiguous()
                                        and res.r.permute(0, 2, 3, 4, 1).is_contiguous()):
                src, xb, res = self._epilogue(*res), None, None
            else:
                self.stats["residual_in_norm"] += 1
        N, C, k, H, W = src.shape
        co, hist = conv.out_channels, 2
        nt = 27 * co
        if not src.is_meta and not src.permute(0, 2, 3, 4, 1).is_contiguous():
            src = src.contiguous(memory_format=torch.channels_last_3d)
        Y = torch.empty((N, nt, hist + k, H, W), dtype=src.dtype, device=src.device)
        cache = self.cache.get(conv)
        if cache is None:
            Y[:, :, :hist].zero_()  # zero input frames before the clip: Y = 0
        else:
            Y[:, :, :hist].copy_(cache)
        y = torch.empty((N, co, k, H, W), dtype=src.dtype, device=src.device, memory_format=self.mf)
        self.stats["norm_kernel"] += 1
        self.stats["conv_taps"] += 1
        if not src.is_meta:
            gamma, beta, scale, eps = p
            wt = tap_matrix(conv, src.dtype)
            kw = dict(residual=res.r, residual_bias=res.rb) if res is not None else {}
            tapconv.rms_norm_taps(src, gamma, beta, eps, scale, wt, nt, Y, hist, x_bias=xb, **kw)
            del src, res
            self._tap_sum(conv, Y, y)
        self._update(conv, Y, fmt=torch.contiguous_format)
        return y

    def _tap_sum(self, conv, Y: Tensor, y: Tensor) -> None:
        """y <- conv's bias + the tap sum of the planar GEMM output Y (kernels/tapconv.tap_sum)."""
        if self.halo is not None:
            self.halo.tap_sum(self, conv, Y, y)
        else:
            tapconv.tap_sum(Y, conv.out_channels, (3, 3, 3), conv.bias, y)

    def _fp8_scale(self, conv, p, src: Tensor) -> float | None:
        """The e4m3 scale of this conv's input when it runs on fp8 (triton_conv stage, fp8 on), else None. Static:
        RMS norm bounds |x/||x||| by 1, so |silu(norm * scale * gamma + beta)| <= scale * max|gamma| + max|beta|; that
        bound maps to e4m3's largest value (never saturates; e4m3 keeps 3 mantissa bits anywhere in its range)."""
        if src.is_meta or self.mf is not torch.channels_last_3d or not getattr(conv, "_vaeopt_fp8conv", False):
            return None
        s8 = self.fp8_scales.get(conv)
        if s8 is None:
            gamma, beta, scale, _ = p
            bound = scale * gamma.detach().float().abs().max().item()
            if isinstance(beta, Tensor):
                bound += beta.detach().float().abs().max().item()
            elif beta:
                bound += abs(float(beta))
            s8 = self.fp8_scales[conv] = max(bound, 1e-12) / 448.0
        return s8

    def _epilogue(self, h, b, r, rb, **kw) -> Tensor:
        self.stats["epilogue"] += 1
        return self._br(h, b, r, rb, **kw)

    def _res_parts(self, blk, box: list[Tensor], xb: Tensor | None, p):
        """A residual block up to its epilogue: norm1 (+ the input's owed bias) -> conv1 without bias -> norm2 with
        conv1's bias folded -> conv2 without bias; the shortcut conv without bias. -> (h, bias, residual,
        residual_bias): the block's output is (residual + residual_bias) + (h + bias)."""
        x = box.pop()
        (p1, p2), c1, c2, sc = p, blk.conv1, blk.conv2, blk.conv_shortcut
        self.stats["fused_blocks"] += 1
        b = self._stage_k(c1, x, p1, xb)
        if isinstance(x, Pending):  # norm1 wrote the previous block's output over its h: that is this input
            x = x.h
        y = self._run(c1, b, bias=False)
        del b
        b = self._stage_k(c2, y, p2, c1.bias)
        del y  # conv1's output is in conv2's input buffer now
        y = self._run(c2, b, bias=False)
        del b
        self.stats["bias_folded"] += (c1.bias is not None) + (c2.bias is not None)
        if isinstance(sc, nn.Identity):
            return y, c2.bias, x, xb
        if xb is not None and sc.groups != 1:
            x, xb = x + xb.to(x.dtype).reshape(1, -1, 1, 1, 1), None
            self.stats["bias_materialized"] += 1
        r = self._run(sc, x, bias=False)
        del x
        self.stats["bias_folded"] += sc.bias is not None
        return y, c2.bias, r, shortcut_bias(sc, xb)  # a 1x1x1 conv without padding: xb folds through it exactly

    def _up_fusable(self, rs) -> bool:
        if self.halo is not None:  # a band's resample runs its 2D conv through the halo (_upsample_conv2d)
            return False
        if rs.mode not in ("upsample2d", "upsample3d") or not isinstance(rs.resample, nn.Sequential):
            return False
        if len(rs.resample) != 2 or not is_2x_nearest(rs.resample[0]) or not plain_conv2d(rs.resample[1]):
            return False
        return rs.mode == "upsample2d" or (self._plain(rs.time_conv) and self._hist(rs.time_conv) > 0)

    def _resample_fused(self, rs, parts: list) -> tuple[Tensor, Tensor | None]:
        """WanResample after a residual block whose epilogue is still to run: the epilogue writes the 2x upsampled
        frames directly (upsample2d), or into time_conv's input buffer, time_conv runs without bias, and one kernel
        adds its bias, interleaves the two channel halves into frames and upsamples (upsample3d). The 2D conv runs
        without its bias, which the next block folds in. When stages/upsample_conv marked the 2D conv, nothing is
        upsampled: the epilogue / interleave write low-resolution frames and the conv runs as 2x2 phase convs.
        -> (x, owed bias)."""
        h, b2, r, rb = parts
        parts.clear()  # (emptied, not just unbound: a profiler or torch's frame hook may hold this frame's arguments)
        N, C, t, H, W = h.shape
        conv2d = rs.resample[1]
        phase = phase_ok(conv2d, None, h)  # the 2D conv as 2x2 phase convs: its input is not upsampled
        up2 = not phase
        f = 2 if up2 else 1
        skip = 1 if rs.mode == "upsample3d" and self.first else 0
        T = 2 * t - skip if rs.mode == "upsample3d" else t
        per = C * 4 * H * W  # upsampled elements per frame
        limit = min(2 * wan_ops.SPLIT_ELEMS, wan_ops.INT32_ELEMS)
        fmt4 = torch.channels_last if self.mf == torch.channels_last_3d else torch.contiguous_format
        if per * N * T > limit:  # too big for one upsampled tensor: the frame-grouped path of _resample on a
            # materialized x (holding h and the residual over all groups would cost more memory than x)
            x = self._epilogue(h, b2, r, rb)
            del h, r
            return self._resample(rs, [x]), None
        if rs.mode == "upsample2d":
            h4, r4 = frames4(h), frames4(r)
            del h, r
            if up2:
                self.stats["upsample_fused"] += 1
            u = self._epilogue(h4, b2, r4, rb, upsample2x=up2)
            del h4, r4
        else:
            tc = rs.time_conv
            hist = self._hist(tc)
            if skip == 0:  # the epilogue writes straight into time_conv's input buffer, after its history
                buf = torch.empty((N, C, hist + t, H, W), dtype=h.dtype, device=h.device, memory_format=self.mf)
                cache = self.cache.get(tc)
                if cache is None:  # the first chunk had one frame, so time_conv starts now, from zeros ('Rep')
                    buf[:, :, :hist].zero_()
                else:
                    buf[:, :, :hist].copy_(cache)
                self._epilogue(h, b2, r, rb, out=buf[:, :, hist:])
                del h, r
                y = self._run(tc, buf, bias=False)
                del buf
                u = torch.empty((N * T, C, f * H, f * W), dtype=y.dtype, device=y.device, memory_format=fmt4)
                self._interleave_up(y, tc.bias, u, up2)
                del y
            else:  # first chunk: frame 0 skips time_conv and is upsampled as it is
                x = self._epilogue(h, b2, r, rb)
                del h, r
                u = torch.empty((N * T, C, f * H, f * W), dtype=x.dtype, device=x.device, memory_format=fmt4)
                u5 = u.view(N, T, C, f * H, f * W)
                if up2:
                    self._br(x[:, :, 0], upsample2x=True, out=u5[:, 0])
                    self.stats["upsample_kernel"] += 1
                else:
                    u5[:, 0].copy_(x[:, :, 0])
                if t > 1:
                    b = self._stage(tc, x[:, :, 1:])
                    del x
                    y = self._run(tc, b, bias=False)
                    del b
                    for n in range(N):
                        self._interleave_up(y[n : n + 1], tc.bias, u5[n, 1:], up2)
                    del y
                else:
                    del x
        if phase:
            self.stats["upsample_phase"] += 1
            y = upsample_conv.run(conv2d, u, bias=False)
        else:
            y = F.conv2d(u, conv2d.weight, None, conv2d.stride, conv2d.padding, conv2d.dilation, conv2d.groups)
        del u
        self.stats["bias_folded"] += conv2d.bias is not None
        return y.view(N, T, y.size(1), y.size(2), y.size(3)).permute(0, 2, 1, 3, 4), conv2d.bias

    def _interleave_up(self, y: Tensor, bias: Tensor | None, out: Tensor, upsample2x: bool = True) -> None:
        """out (n*2t, c, 2H, 2W) <- frames of time_conv's output y (n, 2c, t, H, W) + bias: channel half j of
        frame i becomes frame 2i + j (diffusers' reshape + stack), 2x nearest upsampled, in one pass (not
        upsampled, out (n*2t, c, H, W), when the 2D conv after it runs as phase convs)."""
        self.stats["interleave_upsample" if upsample2x else "interleave"] += 1
        self.stats["bias_folded"] += bias is not None
        self._br(frames4(y), bias, upsample2x=upsample2x, groups=2, out=out)

    def _resample(self, rs, box: list[Tensor]) -> Tensor:
        if rs.mode == "upsample3d":
            x = self._time_upsample(rs, box.pop())
        elif rs.mode == "upsample2d":
            x = box.pop()
        else:
            raise CheckpointError(f"unexpected resample mode {rs.mode!r} in a Wan decoder")
        b, c, t, h, w = x.shape
        x2 = frames4(x)  # per-frame 2D: a free view when x is channels_last_3d, a copy otherwise
        del x
        y = self._upsample_conv2d(rs.resample[0], rs.resample[1], x2)
        return y.view(b, t, y.size(1), y.size(2), y.size(3)).permute(0, 2, 1, 3, 4)

    def _upsample_conv2d(self, up, conv2d, x2: Tensor) -> Tensor:
        """conv2d(up(x2)) for the frames x2 (n, c, h, w) of a resample: the 2x2 phase convs where stages/upsample_conv
        marked conv2d, else the nearest-2x copy (our kernel on the fused path) and the conv, in frame groups. The step
        a band-parallel decode does with its neighbours' rows."""
        if self.halo is not None:
            return self.halo.upsample_conv2d(self, up, conv2d, x2)
        phase = phase_ok(conv2d, up, x2)
        if phase:
            self.stats["upsample_phase"] += 1
        elif self.kern and is_2x_nearest(up):
            up = functools.partial(self._br, upsample2x=True)  # bitwise the same copy, in x's layout
            self.stats["upsample_kernel"] += 1
        elif isinstance(up, nn.Upsample) and up.mode in ("nearest", "nearest-exact"):
            up = functools.partial(nn.Upsample.forward, up)  # a pure copy: skipping WanUpsample's fp32 round trip
            # is bit-identical
        return frames_up_conv(conv2d, up, x2, phase)

    def _time_upsample(self, rs, x: Tensor) -> Tensor:
        """(b, c, t, h, w) -> (b, c, 2t, h, w), or 2t-1 on the clip's first chunk (its frame 0 is not doubled)."""
        b, c, t, h, w = x.shape
        skip = 1 if self.first else 0  # diffusers' 'Rep': frame 0 bypasses time_conv, which starts at frame 1
        out = torch.empty((b, c, 2 * t - skip, h, w), dtype=x.dtype, device=x.device, memory_format=self.mf)
        if skip:
            out[:, :, :1].copy_(x[:, :, :1])
        if t > skip:
            y = self._conv(rs.time_conv, x[:, :, skip:])  # (b, 2c, t', h, w): channel half j -> frame 2i + j
            out[:, :, skip:].unflatten(2, (t - skip, 2)).copy_(y.unflatten(1, (2, c)).permute(0, 2, 3, 1, 4, 5))
        return out
