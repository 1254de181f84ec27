"""Stage `fused_epilogues`: conv biases folded into the next kernel, residual epilogues as one pass, the up-block's
2x nearest upsample written by that epilogue, and chunked GEMM attention for wide heads. Runs after `fused_norms`.

Per decoder `ResnetBlock2D` (AutoencoderKL; temb-free, no up/down-sampling inside, norms already fused):

    stock                                           here
    norm1+SiLU (fused)                              norm1+SiLU (fused)
    conv1 (+ bias: separate broadcast kernel)       conv1 without bias
    norm2+SiLU (fused)                              norm2+SiLU with conv1.bias added inside (x_bias)
    conv2 (+ bias kernel)                           conv2 without bias
    [conv_shortcut (+ bias kernel)]                 [conv_shortcut without bias]
    (input + hidden) / output_scale_factor          one bias_residual kernel: conv2.bias, residual, shortcut
                                                    bias, scale; it also takes the statistics of the norm that
                                                    reads its output next (that norm skips its stats pass)
    [Upsample2D: F.interpolate nearest 2x]          [same kernel writes the 2x-upsampled output directly]

The upsample is fused for the last resnet of a stock `UpDecoderBlock2D` whose single upsampler is a stock
`Upsample2D`: the resnet returns the upsampled tensor and tells the upsampler so through a weak reference to exactly
that tensor, so the upsampler skips its interpolate only for that very object (an `output_size` other than 2x is
honoured from `x[..., ::2, ::2]`, the input exactly). When stages/upsample_conv marked the upsampler's conv, the
resnet writes its low-resolution output instead and the upsampler runs the 2x2 phase convs on it.

Mid-block attention (AttnProcessor2_0, head_dim > 256, CUDA, bf16/fp16): SDPA has only its memory-efficient kernel
there, so the processor set here computes the same attention exactly in query chunks (S = Q K^T as a GEMM with fp32
output, one Triton softmax pass writing P, O = P V), a chunk's fp32 scores under `max_score_bytes`; the output
projection's bias goes into one bias_residual kernel with the residual. Masks, cross-attention, spatial norm, q/k
norms and autocast take the stock path.

Weights are used as they are (no parameter changes: state_dict and `.to()` are unaffected). Each patched forward
re-checks at call time that its fast path still holds (kernel backend for this tensor, no autocast/compile tracing,
plain nn.Conv2d without hooks, fused norms in place), else runs the stock diffusers forward. `revert(model)` restores
every forward and processor.
"""

from __future__ import annotations

import contextvars
import math
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from vaeopt.kernels import interpreting, triton_available
from vaeopt.kernels import tapconv
from vaeopt.kernels.fp8_quant import E4M3, E4M3_MAX, quantize_per_tensor
from vaeopt.kernels.tapconv import MAX_TAP_COLUMNS, SUPPORTED_DTYPES, fits
from vaeopt.stages import fused_norms, upsample_conv
from vaeopt.stages import (BoundForward, StageResult, cached_weight, class_forward, foreign_global_hooks,
                           foreign_hooks, unhooked)
from vaeopt.stages.marks import (FP8_ATTR, FUSED_EPILOGUES, head_dim, interpolating_upsampler, packed_fp8,
                                 wan_channels_last)

NAME = "fused_epilogues"
_MARK = FUSED_EPILOGUES  # model attribute: the record revert() needs
_PENDING = "_vaeopt_upsampled"  # Upsample2D attribute: weakref to the tensor its resnet already upsampled
_STATE = "_vaeopt_epi"  # ResnetBlock2D attribute: the Upsample2D whose interpolate it performs, or None
_NEXT_G = "_vaeopt_next_groups"  # ResnetBlock2D / Attention / Upsample2D attribute: groups of the GroupNorm that
# reads the module's output next in the stock Decoder (set by apply where that is known from the structure)
MAX_SCORE_BYTES = 512 << 20
MIN_HEAD_DIM = 256  # chunked attention replaces SDPA above this (flash / cuDNN attention stop at 256)
# The residual epilogues of resnets and attention also take the statistics of the GroupNorm that reads their output
# next (the next block's norm1, the mid-block attention's norm, the head's norm), which then skips its own stats pass
# (kernels/group_norm_silu.noted_partials); so does an upsampler's phase-conv interleave for the next up-block's
# first norm. Where a norm reads next comes from the stock Decoder's structure (_norm_readers).
# A resnet whose conv2 runs as the int8 kernel adds its input in that conv's epilogue (no residual pass; the next
# norm takes its own statistics; E47).
# on for the length of a patched Decoder call without foreign hooks (a hook could change an activation in place, which
# an inference tensor's missing version counter would not show); off outside it, e.g. for the tiler's own calls
_NOTES_ON = contextvars.ContextVar("vaeopt_gn_notes", default=False)


def _next_groups(m) -> int | None:
    """Groups of the GroupNorm that reads m's output next, when this decoder call may note statistics."""
    return m.__dict__.get(_NEXT_G) if _NOTES_ON.get() else None


def _foreign_hooks(dec: nn.Module) -> bool:
    """A hook inside the decoder (or a global one) that may touch activations. The decoder's own hooks see only its
    input and output; fp8 weight storage's hooks say they keep activations."""
    return foreign_global_hooks() or any(foreign_hooks(m) for m in dec.modules() if m is not dec)


def available(device: torch.device | str | None = None) -> tuple[bool, str]:
    return triton_available(device)


def _use_kernel(x: torch.Tensor, *params) -> bool:
    return fused_norms.use_kernel(x, *params)


def _no_hooks(m: nn.Module) -> bool:
    return unhooked(m)


def _plain_conv(m) -> bool:
    """A stock nn.Conv2d we may run as F.conv2d(x, m.weight, None, ...) (no fp8 storage hooks, no subclass)."""
    return type(m) is nn.Conv2d and m.padding_mode == "zeros" and m.weight is not None and _no_hooks(m)


def _conv_nobias(m: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, m.weight, None, m.stride, m.padding, m.dilation, m.groups)


def _fused_gn(m) -> bool:
    return type(m) is fused_norms.FusedGroupNormSiLU and m.silu and _no_hooks(m)


# --- ResnetBlock2D ---------------------------------------------------------------------------------------------


def _resnet_static_ok(m) -> bool:
    """The structure the fused forward assumes (checked again, cheaply, at every call)."""
    return (
        m.time_emb_proj is None
        and m.time_embedding_norm != "scale_shift"
        and m.upsample is None
        and m.downsample is None
        and _fused_gn(m.norm1)
        and _fused_gn(m.norm2)
        and type(m.nonlinearity) is nn.Identity
        and _plain_conv(m.conv1)
        and _plain_conv(m.conv2)
    )


def _resnet_forward(self, input_tensor, temb=None, *args, **kwargs):
    """ResnetBlock2D.forward with conv biases folded and one epilogue kernel (see the module docstring)."""
    x = input_tensor
    if (
        args
        or kwargs
        or temb is not None
        or x.dim() != 4
        or not _use_kernel(x, self)
        or (self.dropout.training and self.dropout.p > 0)
        or not _resnet_static_ok(self)
    ):
        return type(self).forward(self, input_tensor, temb, *args, **kwargs)
    from vaeopt.kernels.epilogue import bias_residual

    c1, c2, n1, n2, sc = self.conv1, self.conv2, self.norm1, self.norm2, self.conv_shortcut
    h = _norm_conv(n1, c1, x, None)  # fused GroupNorm + SiLU, conv1 without its bias
    up = self.__dict__.get(_STATE)
    # a hook on this block must see its real output; an upsampler on phase convs wants the low-resolution one
    up = up if up is not None and _no_hooks(self) and not _phase_upsampler(up, x) else None
    if up is None and sc is None and float(self.output_scale_factor) == 1.0 and _residual_in_conv(c2, h, x):
        # the int8 conv2 adds its bias and the block input in its epilogue: no residual pass (the next norm then
        # takes its statistics itself)
        return _norm_conv(n2, c2, h, c1.bias, residual=x, bias=c2.bias)
    h = _norm_conv(n2, c2, h, c1.bias)  # conv1's bias folded into norm2, conv2 without its bias
    rb = None
    if sc is None:
        res = x
    elif _plain_conv(sc):
        res, rb = _conv_nobias(sc, x), sc.bias
    else:
        res = sc(x)
    stats = _next_groups(self)  # the next norm's statistics, taken by this epilogue
    out = bias_residual(h, c2.bias, res, self.output_scale_factor, upsample2x=up is not None, residual_bias=rb,
                        stats_groups=stats)
    if up is not None:
        setattr(up, _PENDING, _PendingRef(out))
    return out


class _PendingRef:
    """The upsampler's note of the tensor its resnet already upsampled: a weak reference, called like one. It pickles
    as no note (a saved model has no tensor in flight), so torch.save works even after a decode stopped between the
    resnet and its upsampler."""

    __slots__ = ("ref",)

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)

    def __call__(self):
        return self.ref()

    def __reduce__(self):
        return _no_pending, ()


def _no_pending() -> None:
    return None


def _fp8_weights(conv, x: torch.Tensor):
    """conv's e4m3 packed weights when the FP8 level-3 stage marked it (stages/triton_conv.apply_fp8) and x is an
    NHWC activation the e4m3 kernels take; else None."""
    if not getattr(conv, "_vaeopt_fp8conv", False) or x.dim() != 4:
        return None
    if not x.is_contiguous(memory_format=torch.channels_last) or x.dtype not in (torch.bfloat16, torch.float16,
                                                                                 torch.float32):
        return None
    return packed_fp8(conv)


def takes_residual_in_conv(block) -> bool:
    """The structural side of _resnet_forward's residual-in-conv path for a resnet whose conv2 is int8 (the fp8
    stage counts these): no shortcut, output_scale_factor 1, and no fused 2x upsample in its epilogue (none, or an
    upsampler on phase convs, which reads the low-resolution output)."""
    up = block.__dict__.get(_STATE)
    return (getattr(block, "conv_shortcut", 1) is None
            and float(getattr(block, "output_scale_factor", 0.0)) == 1.0
            and (up is None or (getattr(up, "conv", None) is not None and upsample_conv.marked(up.conv))))


def _residual_in_conv(conv, h: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether conv (a resnet's conv2, fed by norm2 from h) runs as the int8 kernel and can add the block input x in
    its epilogue (kernels/conv.conv_igemm(residual=)): x channels-last dense in h's dtype, the conv's output shape."""
    pw = _fp8_weights(conv, h)
    if pw is None or pw.w.dtype != torch.int8:
        return False
    if h.is_cuda:  # measured on the row tile only (widths that are a multiple of 128; E47)
        from vaeopt.kernels import tma_conv  # (imports Triton)

        if tma_conv.int8_config(conv.in_channels, conv.out_channels, h.shape[-1]) != tma_conv.ROW_TILE:
            return False
    from vaeopt.kernels.conv import residual_fits

    return residual_fits(x, (h.shape[0], conv.out_channels, *h.shape[2:]), h.dtype, h.device)


def _norm_conv(norm, conv, x: torch.Tensor, x_bias, residual: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """conv(silu(group_norm(x + x_bias))) without conv's bias. For an fp8-marked conv the norm kernel writes e4m3
    (or int8 with a zero point, where the stage chose int8) with a per-sample scale derived from bounds of the group
    max/min, and the conv is the 8-bit implicit-GEMM kernel (fp32 / int32 accumulation, output in x's dtype);
    otherwise the bf16 norm kernel and cuDNN. residual, bias (int8 convs only, see _residual_in_conv): the result
    is residual + (conv + bias), both added in the conv's epilogue."""
    pw = _fp8_weights(conv, x)
    if pw is not None:
        from vaeopt.kernels.conv import conv_igemm
        from vaeopt.kernels.group_norm_silu import group_norm_silu_e4m3, group_norm_silu_int8

        if pw.w.dtype == torch.int8:  # int8 operands (stages/triton_conv.int8_convs): asymmetric activations
            q, s, zq = group_norm_silu_int8(x, norm.num_groups, norm.weight, norm.bias, norm.eps, True,
                                            x_bias=x_bias)
            return conv_igemm(q, pw, bias, tuple(conv.padding), x_scale=s, x_zero=zq, out_dtype=x.dtype,
                              residual=residual)
        h8, s = group_norm_silu_e4m3(x, norm.num_groups, norm.weight, norm.bias, norm.eps, True, x_bias=x_bias)
        return conv_igemm(h8, pw, None, tuple(conv.padding), x_scale=s, out_dtype=x.dtype)
    if x_bias is None:
        h = norm(x)
    else:
        from vaeopt.kernels.group_norm_silu import group_norm_silu

        h = group_norm_silu(x, norm.num_groups, norm.weight, norm.bias, norm.eps, True, x_bias=x_bias)
    return _conv_nobias(conv, h)


# --- Upsample2D --------------------------------------------------------------------------------------------------


_upsample_static_ok = interpolating_upsampler


def _phase_upsampler(u, x: torch.Tensor) -> bool:
    """u's conv runs as 2x2 phase convs on u's low-resolution input (stages/upsample_conv marked it)."""
    return u.use_conv and u.name == "conv" and upsample_conv.applies(u.conv, x.dtype, x.device, x)


def _upsample_tail(self, h: torch.Tensor) -> torch.Tensor:
    if self.use_conv:
        h = self.conv(h) if self.name == "conv" else self.Conv2d_0(h)
    return h


def upsample_forward(self, hidden_states, output_size=None, *args, **kwargs):
    """Upsample2D.forward: skips the interpolate for the tensor its resnet already upsampled; otherwise the 2x2 phase
    convs (stages/upsample_conv) or our NHWC/NCHW nearest-2x kernel where they apply, else the stock forward."""
    pending = self.__dict__.pop(_PENDING, None)
    plain = not args and not kwargs and _upsample_static_ok(self) and hidden_states.dim() == 4
    if plain and hidden_states.shape[1] == self.channels:
        if pending is not None and pending() is hidden_states:
            if output_size is not None and tuple(output_size) != tuple(hidden_states.shape[-2:]):
                # nearest 2x keeps the input at the even pixels: interpolate to the asked size from there
                hidden_states = F.interpolate(hidden_states[:, :, ::2, ::2], size=output_size, mode="nearest")
            return _upsample_tail(self, hidden_states)
        if output_size is None and _phase_upsampler(self, hidden_states):
            # e4m3 phase convs if FP8 level 3 marked the conv
            return upsample_conv.run(self.conv, hidden_states, fp8=True, stats_groups=_next_groups(self))
        if output_size is None and _use_kernel(hidden_states, self):
            from vaeopt.kernels.epilogue import upsample_nearest2x

            return _upsample_tail(self, upsample_nearest2x(hidden_states))
    return type(self).forward(self, hidden_states, output_size, *args, **kwargs)


# --- the head: conv_norm_out + conv_act + conv_out --------------------------------------------------------------
# cuDNN runs conv_out (128 -> 3 channels, 3x3) as an implicit GEMM with N = 3 on a slow sm80 kernel (E22). Here, as
# in Wan's head (kernels/tapconv): GroupNorm statistics, then one kernel normalizes each pixel and multiplies it by
# the (C x 27) tap matrix (the normalized activation is never written), then a tap sum. Only inside the decoder's own stock forward: for the length of that
# call the patched decoder forward gives conv_norm_out and conv_out instance forwards (conv_norm_out returns its
# input with the statistics attached, conv_out takes them for exactly that tensor object). Outside it the two
# modules are stock, for the tiler (which runs the head itself) and anyone else.

_HEAD = "_vaeopt_head"  # conv_out attribute during a decoder call: (weakref to x, mean, scale, norm)
HEAD_MAX_SAMPLE = 2**31  # elements per sample: the statistics kernels address a sample with int32 offsets (above
# it, e.g. 128 ch at 4096², the stock fused norm hands over to torch's GroupNorm, and so does the head)


def _head_static_ok(dec) -> bool:
    c = dec.conv_out
    return (_fused_gn(dec.conv_norm_out) and type(dec.conv_act) is nn.Identity and _no_hooks(dec.conv_act)
            and _plain_conv(c)
            and c.kernel_size == (3, 3) and c.stride == (1, 1) and c.padding == (1, 1) and c.dilation == (1, 1)
            and c.groups == 1 and fits(c.out_channels, 9) and c.in_channels <= 256)


# One decode at a time per decoder: a call leaves notes on shared modules for later modules of the same call (the
# resnet's upsampled output on Upsample2D, the head's statistics and per-call forwards on conv_norm_out / conv_out).
# Two threads decoding with one model (a web server) would read each other's: an output upsampled twice, or conv_out
# on the raw activation. The GPU runs one decode's kernels after the other's anyway. (A registry, not an attribute:
# the model stays deep-copyable and picklable.)
_CALL_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_CALL_LOCKS_GUARD = threading.Lock()


def _call_lock(dec: nn.Module) -> threading.RLock:
    with _CALL_LOCKS_GUARD:
        lock = _CALL_LOCKS.get(dec)
        if lock is None:
            lock = _CALL_LOCKS[dec] = threading.RLock()
        return lock


def _decoder_forward(self, *args, **kwargs):
    """diffusers' Decoder.forward: statistics notes on for the call unless a foreign hook could see activations,
    and the head on the tap path (see above) when it can."""
    with _call_lock(self):
        token = _NOTES_ON.set(not _foreign_hooks(self))
        try:
            return _decoder_call(self, *args, **kwargs)
        finally:
            _NOTES_ON.reset(token)


def _decoder_call(self, *args, **kwargs):
    # (hooks on the decoder itself see the same inputs and output: the channels_last stage's input relayout is one)
    if not _head_static_ok(self):
        return type(self).forward(self, *args, **kwargs)
    norm, conv = self.conv_norm_out, self.conv_out
    norm.forward = lambda x, *a, **k: _head_norm(norm, conv, x, *a, **k)
    conv.forward = lambda x, *a, **k: _head_conv(conv, x, *a, **k)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        for m in (norm, conv):
            m.__dict__.pop("forward", None)
        conv.__dict__.pop(_HEAD, None)


def _head_norm(norm, conv, x, *args, **kwargs):
    """conv_norm_out within the decoder call: the GroupNorm statistics of x for conv_out, and x itself."""
    if (args or kwargs or x.dim() != 4 or x.numel() == 0 or x[0].numel() >= HEAD_MAX_SAMPLE
            or x.dtype not in SUPPORTED_DTYPES or conv.weight.dtype != x.dtype
            or not x.is_contiguous(memory_format=torch.channels_last)
            or not _use_kernel(x, norm.weight, norm.bias, conv.weight, conv.bias)):
        return type(norm).forward(norm, x, *args, **kwargs)
    from vaeopt.kernels.group_norm_silu import group_norm_finalize, group_norm_partials

    mean, scale = group_norm_finalize(group_norm_partials(x, norm.num_groups), norm.num_groups, norm.num_channels,
                                      norm.weight, norm.eps)
    conv.__dict__[_HEAD] = (weakref.ref(x), mean, scale, norm)
    return x


def _head_conv(conv, x, *args, **kwargs):
    """conv_out within the decoder call: for the very tensor conv_norm_out passed on, silu(GroupNorm(x)) conv'd as a
    norm+GEMM kernel and a tap sum; otherwise the stock conv."""
    pending = conv.__dict__.pop(_HEAD, None)
    if pending is None or args or kwargs or pending[0]() is not x:
        return type(conv).forward(conv, x, *args, **kwargs)
    _, mean, scale, norm = pending
    N, C, H, W = x.shape
    co = conv.out_channels
    nt = 9 * co
    wt = cached_weight(conv, "_vaeopt_tap_matrix", x.dtype, lambda: tapconv.tap_weights(conv.weight, dtype=x.dtype))
    y = torch.empty((N, nt, 1, H, W), dtype=x.dtype, device=x.device)
    tapconv.group_norm_taps(x, mean, scale, norm.bias, wt, nt, y)
    out = torch.empty((N, co, H, W), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    tapconv.tap_sum(y, co, (1, 3, 3), conv.bias, out.unsqueeze(2))
    return out


# --- attention ---------------------------------------------------------------------------------------------------

_BMM_OUT_DTYPE: dict[str, bool] = {}


def _scores(q: torch.Tensor, kt: torch.Tensor) -> torch.Tensor:
    """fp32 q @ kt for bf16/fp16/fp32 operands: cuBLAS with fp32 output where torch has it (>= 2.8, CUDA);
    else upcast operands (exact products, fp32 accumulation)."""
    if q.dtype != torch.float32 and q.is_cuda:
        if _BMM_OUT_DTYPE.get("ok", True):
            try:
                s = torch.bmm(q, kt, out_dtype=torch.float32)
                _BMM_OUT_DTYPE["ok"] = True
                return s
            except (TypeError, RuntimeError, NotImplementedError):
                _BMM_OUT_DTYPE["ok"] = False
    return torch.bmm(q.float(), kt.float())


def chunked_attention(q, k, v, max_score_bytes: int = MAX_SCORE_BYTES, chunk: int | None = None,
                      softmax_kernel: bool | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for (B, H, L, d) tensors, exactly (fp32 scores and softmax), in query chunks whose
    fp32 score block stays under max_score_bytes (or of `chunk` queries). Output in v's dtype. softmax_kernel: the
    Triton softmax (None: wherever Triton runs, the CPU interpreter included)."""
    B, H, L, d = q.shape
    Lk = k.shape[2]
    q3 = q.reshape(B * H, L, d)
    kt = k.reshape(B * H, Lk, d).transpose(1, 2)
    v3 = v.reshape(B * H, Lk, v.shape[-1])
    scale = 1.0 / math.sqrt(d)  # SDPA's default, which AttnProcessor2_0 relies on
    if chunk is None:
        chunk = max(1, max_score_bytes // max(1, B * H * Lk * 4))
    chunk = min(chunk, L)
    out = torch.empty((B * H, L, v3.shape[-1]), device=q.device, dtype=v.dtype)
    use_triton = triton_available(q.device)[0] and not torch.compiler.is_compiling() and softmax_kernel is not False
    for i in range(0, L, chunk):
        s = _scores(q3[:, i : i + chunk], kt)
        if use_triton:
            from vaeopt.kernels.epilogue import softmax_rows

            p = softmax_rows(s, scale, v.dtype)
        else:
            p = torch.softmax(s.mul_(scale), dim=-1).to(v.dtype)
        del s
        dst = out[:, i : i + chunk]
        if dst.is_contiguous():
            torch.bmm(p, v3, out=dst)
        else:
            dst.copy_(torch.bmm(p, v3))
        del p
    return out.view(B, H, L, -1)


def _e4m3_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (2-D) -> (row-major e4m3 copy, fp32 scale (1,)) with x ≈ q * scale: on CUDA the two Triton passes of
    kernels/act_quant (amax, then cast; no host sync, so graph-capturable), elsewhere fp8_quant's torch version."""
    if x.is_cuda:
        from vaeopt.kernels.act_quant import quantize_e4m3_per_sample

        q, s = quantize_e4m3_per_sample(x.contiguous()[None])
        return q[0], s
    q, s = quantize_per_tensor(x)
    return q.contiguous(), s.reshape(1)


def fp8_attention(q, k, v, max_score_bytes: int = MAX_SCORE_BYTES, chunk: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for (B, H, L, d) tensors with e4m3 GEMMs (FP8 level 2 for the attention core):
    Q, K and V each quantized per tensor (one dynamic scale), S = Q K^T through torch._scaled_mm (fp32 accumulate,
    bf16 out: half the score traffic of fp32 at the same error, docs/experiments.md E44), the Triton softmax
    writing P = exp(S - row max) * 448 in e4m3 with its row scale 1 / (448 * row sum), and O = P V through
    torch._scaled_mm with that row scale: the normalization costs nothing. Lossy (e4m3 Q/K/V/P): the fp8 convs stage
    gates it like a layer. On CUDA with FP8 tensor cores; elsewhere an emulation with the same roundings in fp32 (CPU
    tests). cuBLAS's fp8 fast accumulation stays off: over 16384 keys it measured 2e-1 relative error. Queries in chunks whose fp32-sized scores stay under max_score_bytes. Output in v's dtype."""
    B, H, L, d = q.shape
    Lk, dv = k.shape[2], v.shape[-1]
    q3, k3, v3 = q.reshape(B * H, L, d), k.reshape(B * H, Lk, d), v.reshape(B * H, Lk, dv)
    sm = 1.0 / math.sqrt(d)
    if chunk is None:
        chunk = max(16, max_score_bytes // max(1, Lk * 4) // 16 * 16)
    chunk = min(chunk, L)
    out = torch.empty((B * H, L, dv), device=q.device, dtype=v.dtype)
    real = q.is_cuda
    # cuBLASLt's fp8 GEMMs take K and N in multiples of 16: keys padded with zero rows (zero K and V; their scores
    # are left out of the softmax, their P columns are zero)
    Lp = -(-Lk // 16) * 16 if real else Lk
    for b in range(B * H):
        kb, vb = k3[b], v3[b]
        if Lp != Lk:
            kb, vb = F.pad(kb, (0, 0, 0, Lp - Lk)), F.pad(vb, (0, 0, 0, Lp - Lk))
        q8, sq = _e4m3_per_tensor(q3[b])
        k8, sk = _e4m3_per_tensor(kb)
        v8, sv = _e4m3_per_tensor(vb)
        vt8 = v8.t().contiguous()  # (dv, Lp) row-major: P @ V's B operand column-major, as cuBLASLt wants it
        if real:
            from vaeopt.kernels.epilogue import softmax_rows

            svrow = sv.reshape(1, 1).expand(1, dv).contiguous()
        for i in range(0, L, chunk):
            c = min(chunk, L - i)
            if real:
                s = torch._scaled_mm(q8[i:i + c], k8.t(), scale_a=sq, scale_b=sk, out_dtype=torch.bfloat16)
                p = (torch.empty if Lp == Lk else torch.zeros)((c, Lp), device=q.device, dtype=E4M3)
                rs = torch.empty((c, 1), device=q.device, dtype=torch.float32)
                softmax_rows(s[:, :Lk], sm, E4M3, out=p[:, :Lk], row_scale=rs, pscale=E4M3_MAX)
                del s
                out[b, i:i + c] = torch._scaled_mm(p, vt8.t(), scale_a=rs, scale_b=svrow, out_dtype=v.dtype)
            else:  # the same roundings in fp32
                s = ((q8[i:i + c].float() @ k8.float().t()) * (sq * sk)).to(torch.bfloat16).float() * sm
                e = torch.exp(s - s.amax(dim=-1, keepdim=True))
                p = (e * E4M3_MAX).to(E4M3).float()
                o = (p @ vt8.float().t()) * (sv / (E4M3_MAX * e.sum(dim=-1, keepdim=True)))
                out[b, i:i + c] = o.to(v.dtype)
    return out.view(B, H, L, dv)


def _attn_processor_base():
    from diffusers.models.attention_processor import AttnProcessor2_0

    return AttnProcessor2_0


def _make_processor_class():
    base = _attn_processor_base()

    class ChunkedAttnProcessor(base):
        """AttnProcessor2_0 with SDPA replaced by `chunked_attention` for wide heads (and the output projection's bias,
        residual and rescale as one epilogue kernel). Subclasses AttnProcessor2_0 so the `attention` stage keeps it."""

        def __init__(self, max_score_bytes: int = MAX_SCORE_BYTES, min_head_dim: int = MIN_HEAD_DIM,
                     chunk: int | None = None):
            super().__init__()
            self.max_score_bytes, self.min_head_dim, self.chunk = max_score_bytes, min_head_dim, chunk
            self.calls = 0  # chunked calls made (for tests and reports)

        def _applies(self, attn, x, encoder_hidden_states, attention_mask, args, kwargs) -> bool:
            if args or kwargs.get("scale") is not None:
                return False
            if encoder_hidden_states is not None or attention_mask is not None:
                return False
            if attn.spatial_norm is not None or attn.norm_q is not None or attn.norm_k is not None:
                return False
            if x.dim() not in (3, 4) or attn.to_out is None or head_dim(attn) <= self.min_head_dim:
                return False
            if torch.is_autocast_enabled(x.device.type) or torch.compiler.is_compiling():
                return False
            if x.is_cuda:
                return x.dtype in (torch.bfloat16, torch.float16)
            return x.device.type == "cpu" and interpreting()  # CPU: tests only (the interpreter runs the softmax kernel)

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                     *args, **kwargs):
            if not self._applies(attn, hidden_states, encoder_hidden_states, attention_mask, args, kwargs):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, temb,
                                        *args, **kwargs)
            self.calls += 1
            residual = hidden_states
            input_ndim = hidden_states.ndim
            if input_ndim == 4:
                batch_size, channel, height, width = hidden_states.shape
                hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
            batch_size = hidden_states.shape[0]
            if attn.group_norm is not None:
                hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
            query = attn.to_q(hidden_states)
            key = attn.to_k(hidden_states)
            value = attn.to_v(hidden_states)
            head_dim = key.shape[-1] // attn.heads
            query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            if getattr(attn, FP8_ATTR, False):  # set by the fp8 convs stage when the gate admits it
                hidden_states = fp8_attention(query, key, value, self.max_score_bytes, self.chunk)
            else:
                hidden_states = chunked_attention(query, key, value, self.max_score_bytes, self.chunk)
            hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
            hidden_states = hidden_states.to(query.dtype)

            proj, drop = attn.to_out[0], attn.to_out[1]
            epilogue = (
                input_ndim == 4
                and type(proj) is nn.Linear
                and _no_hooks(proj)
                and not (drop.training and getattr(drop, "p", 0) > 0)
                and _use_kernel(hidden_states, proj.weight, proj.bias)
            )
            if epilogue:
                from vaeopt.kernels.epilogue import bias_residual

                h = F.linear(hidden_states, proj.weight)  # bias goes into the epilogue
                h = h.transpose(-1, -2).reshape(batch_size, channel, height, width)
                stats = _next_groups(attn)
                return bias_residual(h, proj.bias, residual if attn.residual_connection else None,
                                     attn.rescale_output_factor, stats_groups=stats)
            hidden_states = drop(proj(hidden_states))
            if input_ndim == 4:
                hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
            if attn.residual_connection:
                hidden_states = hidden_states + residual
            return hidden_states / attn.rescale_output_factor

    return ChunkedAttnProcessor


_PROC_CLS = None


def chunked_processor_class():
    global _PROC_CLS
    if _PROC_CLS is None:
        _PROC_CLS = _make_processor_class()
    return _PROC_CLS


# --- planning / apply / revert -----------------------------------------------------------------------------------


def _classes() -> dict:
    K = fused_norms.diffusers_classes()
    try:
        from diffusers.models.attention_processor import AttnProcessor2_0
        from diffusers.models.unets.unet_2d_blocks import UpDecoderBlock2D
        from diffusers.models.upsampling import Upsample2D
    except ImportError:
        AttnProcessor2_0 = UpDecoderBlock2D = Upsample2D = None
    try:
        from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D
    except ImportError:
        UNetMidBlock2D = None
    K.update(AttnProcessor2_0=AttnProcessor2_0, UpDecoderBlock2D=UpDecoderBlock2D, Upsample2D=Upsample2D,
             UNetMidBlock2D=UNetMidBlock2D)
    return K


def _same_forward(m, cls) -> bool:
    return cls is not None and isinstance(m, cls) and type(m).forward is cls.forward and class_forward(m)


def apply(
    model: nn.Module,
    upsample: bool = True,
    attention: bool = True,
    min_head_dim: int = MIN_HEAD_DIM,
    max_score_bytes: int = MAX_SCORE_BYTES,
    attention_chunk: int | None = None,
    device: torch.device | str | None = None,
) -> StageResult:
    """Patch model.decoder in place (after fused_norms). `upsample`: fuse/replace Upsample2D interpolates.
    `attention`: chunked attention for heads wider than `min_head_dim` (chunk: `attention_chunk` queries, or as many
    as keep a chunk's fp32 scores under `max_score_bytes`). `device`: where it will run (default: the model's)."""
    if getattr(model, _MARK, None):
        return StageResult.skipped(NAME, "already applied")
    if type(model).__name__ == "AutoencoderKLWan":
        return _apply_wan(model, device)
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else None
    ok, why = triton_available(device)
    if not ok:
        return StageResult.skipped(NAME, why)
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return StageResult.skipped(NAME, f"{type(model).__name__} has no decoder")
    K = _classes()
    resnets = [m for m in decoder.modules() if _same_forward(m, K["ResnetBlock2D"]) and _resnet_static_ok(m)]
    if not resnets and any(_same_forward(m, K["ResnetBlock2D"]) for m in decoder.modules()):
        return StageResult.skipped(NAME, "no resnet block has fused norms (apply fused_norms first)")
    rset = {id(m) for m in resnets}

    fused_up: dict[int, nn.Module] = {}  # id(resnet) -> the Upsample2D whose interpolate it performs
    upsamplers = []
    if upsample:
        upsamplers = [m for m in decoder.modules() if _same_forward(m, K["Upsample2D"]) and _upsample_static_ok(m)]
        ups = {id(u) for u in upsamplers}
        for blk in decoder.modules():
            # stock UpDecoderBlock2D.forward: resnets in turn, then its upsamplers; the last resnet's output goes
            # nowhere but into the (single) upsampler
            if not _same_forward(blk, K["UpDecoderBlock2D"]) or blk.upsamplers is None or len(blk.upsamplers) != 1:
                continue
            u, last = blk.upsamplers[0], blk.resnets[-1]
            if id(u) in ups and id(last) in rset and last.conv2.out_channels == u.channels:
                fused_up[id(last)] = u

    attns = []
    if attention and K["Attention"] is not None and K["AttnProcessor2_0"] is not None:
        for m in decoder.modules():
            if isinstance(m, K["Attention"]) and type(getattr(m, "processor", None)) is K["AttnProcessor2_0"]:
                if head_dim(m) > min_head_dim:
                    attns.append(m)

    patch_decoder = _same_forward(decoder, K["Decoder"])
    head = patch_decoder and _head_static_ok(decoder)
    readers = _norm_readers(decoder, K) if patch_decoder else {}
    if not (resnets or upsamplers or attns or head):
        return StageResult.skipped(NAME, f"nothing to fuse in {type(model).__name__}'s decoder")

    record = {"resnets": [], "upsamplers": [], "attns": [], "head": None}
    if patch_decoder:  # the head taps and the statistics notes live for the length of its call
        decoder.forward = BoundForward(_decoder_forward, decoder)
        record["head"] = decoder
    for m in resnets:
        m.__dict__[_STATE] = fused_up.get(id(m))  # plain attribute: nn.Module.__setattr__ would adopt the module
        m.forward = BoundForward(_resnet_forward, m)
        record["resnets"].append(m)
    for u in upsamplers:
        u.forward = BoundForward(upsample_forward, u)
        record["upsamplers"].append(u)
    cls = chunked_processor_class()
    for a in attns:
        record["attns"].append((a, a.processor))
        a.set_processor(cls(max_score_bytes=max_score_bytes, min_head_dim=min_head_dim, chunk=attention_chunk))
    notes = [m for m in resnets + upsamplers + attns if id(m) in readers]
    for m in notes:
        m.__dict__[_NEXT_G] = readers[id(m)]
    record["notes"] = notes
    setattr(model, _MARK, record)

    n = dict(
        bias_folded=sum(m.conv1.bias is not None for m in resnets),
        epilogues=len(resnets),
        shortcut_bias_folded=sum(_plain_conv(m.conv_shortcut) and m.conv_shortcut.bias is not None
                                 for m in resnets if m.conv_shortcut is not None),
        upsample_fused=len(fused_up),
        upsamplers=len(upsamplers),
        attention_chunked=len(attns),
        head_dims=sorted({head_dim(a) for a in attns}),
        head_taps=decoder.conv_out.out_channels if head else 0,
    )
    return StageResult(NAME, "applied", _describe(n), dict(n, backend=why))


def _norm_readers(decoder, K) -> dict[int, int]:
    """id(module) -> groups of the fused GroupNorm that reads its output next, for the stock Decoder's data path:
    mid-block resnets and attentions in turn, each up-block's resnets then its upsampler, then the head's norm. Only
    where both sides run their stock forwards (the chain breaks at anything else)."""
    FusedGroupNormSiLU = fused_norms.FusedGroupNormSiLU

    mid_cls = K.get("UNetMidBlock2D")
    mid = decoder.mid_block
    if mid is None or not _same_forward(mid, mid_cls):
        return {}
    seq = [mid.resnets[0]]
    for a, r in zip(mid.attentions, mid.resnets[1:]):
        seq += ([a] if a is not None else []) + [r]
    for b in decoder.up_blocks:
        if not _same_forward(b, K["UpDecoderBlock2D"]):
            seq.append(None)
            continue
        seq += list(b.resnets) + [u for u in (b.upsamplers or [])]
    seq.append(decoder.conv_norm_out)

    def reads_with(m) -> int | None:  # the norm that reads m's input first
        if m is None:
            return None
        norm = getattr(m, "norm1", None) if _same_forward(m, K["ResnetBlock2D"]) else \
            getattr(m, "group_norm", None) if K["Attention"] is not None and isinstance(m, K["Attention"]) else m
        return norm.num_groups if type(norm) is FusedGroupNormSiLU else None

    return {id(p): g for p, c in zip(seq, seq[1:]) if p is not None and (g := reads_with(c)) is not None}


def _describe(n: dict) -> str:
    parts = []
    if n["epilogues"]:
        s = f"folded {n['bias_folded']} conv biases into GroupNorm, {n['epilogues']} residual epilogues"
        extra = []
        if n["upsample_fused"]:
            extra.append(f"{n['upsample_fused']} with fused 2x upsample")
        if n["shortcut_bias_folded"]:
            extra.append(f"{n['shortcut_bias_folded']} shortcut biases folded")
        parts.append(s + (f" ({', '.join(extra)})" if extra else ""))
    if n["upsamplers"] > n["upsample_fused"]:
        parts.append(f"{n['upsamplers'] - n['upsample_fused']} upsamplers on the nearest-2x kernel")
    if n["attention_chunked"]:
        dims = ", ".join(str(d) for d in n["head_dims"])
        parts.append(f"chunked attention for head_dim {dims} ({n['attention_chunked']} block"
                     f"{'s' if n['attention_chunked'] > 1 else ''})")
    if n.get("head_taps"):
        parts.append(f"the head (conv_norm_out + conv_out, {n['head_taps']} channels) as one GroupNorm+GEMM kernel "
                     "and a tap sum (whole-image decodes)")
    return ", ".join(parts)


def _apply_wan(model: nn.Module, device) -> StageResult:
    """Wan's decoder runs chunk by chunk in vaeopt.video, which owns its caches: the epilogues are fused there (conv
    biases folded into the RMSNorm / residual kernels, residual + upsample and time_conv interleave fused). This stage
    switches that path on for this model; what ran is counted per decode in the chunk decoder's stats."""
    if not getattr(model, "_vaeopt_fused_norms", None):
        return StageResult.skipped(NAME, "needs the fused norms (they carry the folded biases)")
    ok, why = triton_available(device)
    if not ok:
        return StageResult.skipped(NAME, why)
    names = [type(m).__name__ for m in model.decoder.modules()]
    n_res, n_rs, n_attn = names.count("WanResidualBlock"), names.count("WanResample"), names.count("WanAttentionBlock")
    co = getattr(getattr(model.decoder, "conv_out", None), "out_channels", 0)
    cl = wan_channels_last(model, None)  # the chunk decoder runs these two on channels_last_3d activations only
    head = fits(co) and cl
    setattr(model, _MARK, {"wan": True, "resnets": [], "upsamplers": [], "attns": []})
    extra = ""
    if n_attn:
        extra += (f"; {n_attn} mid-block attention(s) as chunked GEMM attention (fp32 scores) + one epilogue" if cl
                  else "; the mid-block attention stays diffusers' (needs channels_last_3d activations)")
    extra += (f"; the head (norm_out + conv_out, {co} channels) as one norm+GEMM kernel and a tap sum" if head else
              f"; conv_out ({co} channels) stays a Conv3d (" + (
                  f"the tap GEMM is used up to {MAX_TAP_COLUMNS // 27} output channels: 27 taps x channels <= "
                  f"{MAX_TAP_COLUMNS} GEMM columns)" if cl else "the tap path needs channels_last_3d activations)"))
    return StageResult(NAME, "applied", f"Wan: {n_res} residual blocks and {n_rs} resamplers run fused in the chunk "
                                        "decoder (conv biases folded into RMSNorm/residual epilogues, upsample and "
                                        "time_conv interleave fused into the epilogue)" + extra,
                       {"residual_blocks": n_res, "resamplers": n_rs, "attentions": n_attn, "head_taps": head})


def revert(model: nn.Module) -> None:
    """Restore every forward and attention processor apply() changed (no-op if it was not applied)."""
    record = getattr(model, _MARK, None)
    if not record:
        return
    for m in record["resnets"]:
        m.__dict__.pop("forward", None)
        m.__dict__.pop(_STATE, None)
    for u in record["upsamplers"]:
        u.__dict__.pop("forward", None)
        u.__dict__.pop(_PENDING, None)
    for m in record.get("notes", []):
        m.__dict__.pop(_NEXT_G, None)
    for a, proc in record["attns"]:
        a.set_processor(proc)
    dec = record.get("head")
    if dec is not None:
        dec.__dict__.pop("forward", None)
        dec.conv_out.__dict__.pop("_vaeopt_tap_matrix", None)
    delattr(model, _MARK)
