"""Peak device memory of Wan's chunk decoder, by a dry run of the decoder itself on meta tensors."""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
import torch.utils._pytree
from torch import Tensor

from vaeopt.engine.wan import ChunkDecoder
from vaeopt.engine.wan_ops import Chunk, check_vae, chunk_schedule
from vaeopt.loading import quiet_diffusers
from vaeopt.stages import marks, stacked_conv3d


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes of storages created under it that are still alive, and their peak: what a caching
    allocator must hold for eager execution (before its rounding, fragmentation and cuDNN workspaces)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor):
                s = t.untyped_storage()
                if s not in self._seen:
                    self._seen.add(s)
                    n = s.nbytes()
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(s, self._free, n)
        return out


class MemEfficientSDPA(torch.overrides.TorchFunctionMode):
    """On meta tensors SDPA would decompose into the math path and materialize the (L, L) scores; on CUDA the
    fused kernels do not, so count only its output (plus the fp32 logsumexp, negligible)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, v = args[0], args[2]
            return q.new_empty((*q.shape[:-1], v.shape[-1]))
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=4)
def meta_skeleton(cls, config_json: str, dtype: torch.dtype):
    cfg = {k: v for k, v in json.loads(config_json).items() if not k.startswith("_")}
    with torch.device("meta"):
        m = cls(**cfg)
    with quiet_diffusers():  # (its fp32-modules warning, on a skeleton that never computes)
        return m.to(dtype).eval().requires_grad_(False)


def stacked_names(vae) -> tuple[str, ...]:
    """Names of the decoder convs stages/stacked_conv3d marked (the dry run marks the same ones on its skeleton)."""
    return tuple(n for n, m in vae.decoder.named_modules() if marks.stacked(m))


def estimate_chunk_bytes(
    vae, latent_shape: Sequence[int], chunk: Chunk, dtype: torch.dtype | None = None, channels_last: bool = False,
    fused: bool = False,
) -> int:
    """Peak device bytes of decoding one steady-state chunk with decode_video / iter_decode_video, excluding the
    model's weights and decode_video's whole-clip output tensor (add N*3*T_out*H*W*itemsize for that).

    Basis: a dry run of this module's own decode on meta tensors (no compute; seconds on a CPU at full size, cached
    per shape) with the VAE's architecture, counting the bytes of every tensor storage alive at each op: a first
    chunk and one full chunk after it (so the static caches are included), peak over both. That is what PyTorch's
    caching allocator must hold in eager mode. Not included: the allocator's block rounding and fragmentation,
    cuDNN workspaces, the CUDA context -- leave ~15% and some hundreds of MB on top (docs/experiments.md E6 holds
    the estimate against torch.cuda.max_memory_allocated). Attention counts as a fused kernel (output only), as
    CUDA's SDPA runs it. The iterator adds only the chunk's converted frames (3 channels) on top.
    wan21-480p bf16 (1,16,21,60,104): K=1 3.05 GiB, 2: 3.9, 4: 5.6, 8: 9.05 (+0.24 GiB weights, +0.19 GiB output)."""
    check_vae(vae)
    dtype = dtype or vae.post_quant_conv.weight.dtype
    shape = tuple(int(s) for s in latent_shape)
    K = max(chunk_schedule(shape[2], chunk))  # the first call never has more frames than the others
    config = json.dumps(dict(vae.config), sort_keys=True, default=str)
    return estimate_peak(type(vae), config, shape, K, dtype, bool(channels_last), bool(fused),
                     stacked_names(vae) if fused else ())


def meta_peak(make_stepper, shape: tuple, K: int, dtype: torch.dtype) -> int:
    """Peak live bytes of a dry run on the meta device: a first chunk of K latent frames and one full chunk after
    it, through the object make_stepper() builds (built inside the count: its caches are included)."""
    N, C, T, h, w = shape
    sched = [K] + ([K] if T > K else [])
    counter = LiveBytes()
    with MemEfficientSDPA(), counter, torch.no_grad():
        z = torch.empty((N, C, sum(sched), h, w), device="meta", dtype=dtype)
        stepper = make_stepper()
        t0 = 0
        for k in sched:
            y = stepper.step(z[:, :, t0 : t0 + k])
            t0 += k
            del y
        peak = counter.peak
        del stepper, z
    return int(peak)


@functools.lru_cache(maxsize=256)
def estimate_peak(cls, config_json: str, shape: tuple, K: int, dtype: torch.dtype, channels_last: bool,
                  fused: bool = False, stacked: tuple[str, ...] = ()) -> int:
    skel = meta_skeleton(cls, config_json, dtype)  # (shared, cached: the marks below are removed again)
    if not stacked:  # fused: the kernel path, results' storage only
        return meta_peak(lambda: ChunkDecoder(skel, channels_last, fused=fused), shape, K, dtype)
    names = set(stacked)  # the time-stacked Conv2d inputs of the convs stacked_conv3d marked on the real model
    stacked_conv3d.mark(m for n, m in skel.decoder.named_modules() if n in names)
    try:
        return meta_peak(lambda: ChunkDecoder(skel, channels_last, fused=fused), shape, K, dtype)
    finally:
        stacked_conv3d.revert(skel)
