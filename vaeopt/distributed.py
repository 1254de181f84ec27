"""Multi-GPU decoding on torch.distributed: one large image / clip split into horizontal bands over the ranks, or
many files spread over the ranks. NCCL on GPUs, gloo on CPU; started by torchrun or by :func:`launch`.

Band-parallel decode (one large decode, :func:`band_parallel_decode`)
----------------------------------------------------------------------
Every rank owns the rows ``[r*h//R, (r+1)*h//R)`` of the latent (``R`` ranks, ``h`` latent rows); at a layer that runs
at ``s`` times the latent resolution it owns the rows ``s`` times those bounds. The result equals the single-process
decode up to float rounding because every operator is either pointwise, or made exact across band boundaries:

* 3x3 convolutions: the conv runs on the band with its own zero padding, so only the band's first and last output
  rows are wrong (they saw a zero row where the neighbour's row belongs). The boundary rows of the conv *input* are
  exchanged with the neighbours (one row each way, ``isend``/``irecv``, overlapped with the band's conv), and the two
  edge rows are recomputed from 3-row slabs ``[neighbour row | own rows]``. Rows at the true image border keep the
  conv's zero padding. The conv module itself is called (fused / quantised / hooked modules work as long as they
  are stride-1, size-preserving 3x3 convs); a stock ``nn.Conv2d`` / ``WanCausalConv3d`` runs the slabs as
  ``F.conv2d`` / ``F.conv3d`` on its own weights.
* Nearest-2x upsampling + conv: pixel-local; the conv's halo is the neighbour's upsampled boundary row (Wan: the
  source row, upsampled locally).
* GroupNorm (AutoencoderKL): each rank computes per-group (count, mean, M2) of its band (fp32 partial sums, a Triton
  reduction on CUDA), the ranks ``all_gather`` them in fp64 and merge exactly (Chan et al.: mean = sum n_i m_i / n,
  M2 = sum M2_i + n_i (m_i - mean)^2), so the norm uses the statistics of the whole activation, as the single-GPU
  decode does. Applied as (x - mean) * rstd * w + b in fp32 (the Triton apply kernel on CUDA), then the model's
  nonlinearity. On CUDA, as in the fused single-GPU path, plain convs run without bias and the bias is folded into
  the next norm (statistics and apply) or the residual epilogue (which also writes an up-block's 2x upsample).
* RMS norm (Wan) is per pixel over channels: no cross-rank statistics at all.
* Mid-block attention at latent resolution (global over all latent tokens): the mid-block up to the attention runs
  redundantly on every rank at latent resolution (AutoencoderKL: conv_in + first resnet, 1/64 of the output pixels).
  The attention is then split by *queries*: every rank computes K and V for all tokens and Q only for its own rows,
  which is exactly the attention of those rows (softmax rows are independent). Wan's per-frame attention gathers its
  latent-resolution input (all_gather of the bands) and does the same per frame.
* Wan's causal convolutions: each rank keeps the static 2-frame causal caches of its own band for the whole clip
  (vaeopt.video's chunk decoder, subclassed here); the halo rows sent to a neighbour include the cached history
  frames of the conv input, so the neighbour's edge rows see the same history as the single-GPU decode.

The output is gathered on rank 0 (``gather=True``) or left on each rank as its band with its row range
(``gather=False``; e.g. for a rank to write its slice of a memory-mapped output). See docs/multi-gpu.md.

Many files (:func:`decode_files_distributed`)
---------------------------------------------
Jobs (one per latent tensor) are assigned to ranks, largest first to the least loaded rank; each rank loads the VAE
once, builds its own Pipeline (own planner, own device) and writes its own outputs with vaeopt.api; rank 0 gathers a
summary. With fewer jobs than ranks (one big file), the ranks decode each job together band-parallel and rank 0 writes.

Launch (:func:`launch`): spawns N local processes (NCCL on CUDA when there are N GPUs, else gloo on CPU) on
127.0.0.1 with a free port, joins with a timeout, and turns any rank's failure into one :class:`DistributedError`
(the other ranks are terminated, nothing hangs). Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR in the environment) it
joins the existing job instead of spawning. NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are always set.
"""

from __future__ import annotations

import datetime
import functools
import heapq
import importlib
import math
import os
import re
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from vaeopt import video
from vaeopt.errors import VaeoptError
from vaeopt.stages import fused_norms
from vaeopt.video import _unhooked

__all__ = [
    "DistributedError",
    "ENV_RULES",
    "band_parallel_decode",
    "band_rows",
    "supports_band",
    "launch",
    "init_distributed",
    "rank_device",
    "under_torchrun",
    "decode_files_distributed",
    "assign_jobs",
]

# Workplace rule for the GPU machines: no NVLink SHARP / multicast (see docs/multi-gpu.md).
ENV_RULES = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class DistributedError(VaeoptError):
    """A rank failed, timed out, or the ranks disagree (different latents, unsupported model)."""


def _apply_env_rules() -> None:
    for k, v in ENV_RULES.items():
        os.environ[k] = v


# ================================================================================================================
# Band geometry and communication
# ================================================================================================================


def band_rows(h: int, world: int) -> list[tuple[int, int]]:
    """Latent rows [a, b) of each rank's band: as equal as integers allow (sizes differ by at most one)."""
    return [(r * h // world, (r + 1) * h // world) for r in range(world)]


class _Comm:
    """Band neighbours, halo exchange, exact moment merge and gathers over one process group."""

    def __init__(self, group, h: int, device: torch.device):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise DistributedError("this rank is not a member of the process group it was asked to decode in")
        self.device = device
        if h < self.world:
            raise DistributedError(f"the latent has {h} rows, fewer than the {self.world} ranks: every rank needs "
                                   "at least one latent row (use fewer ranks)")
        self.bands = band_rows(h, self.world)
        self.a, self.b = self.bands[self.rank]
        self.prev = self.rank - 1 if self.rank > 0 else None
        self.next = self.rank + 1 if self.rank < self.world - 1 else None
        self.counts = {"halo_exchanges": 0, "halo_bytes": 0, "stat_merges": 0}
        self._rows: dict = {}

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _p2p(self, ops: list[tuple[str, Tensor, int, int]]) -> list:
        if not ops:
            return []
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self._peer(peer), self.group, tag)
               for kind, t, peer, tag in ops]
        return dist.batch_isend_irecv(p2p)

    # -- halo rows ---------------------------------------------------------------------------------------------
    def exchange_start(self, x: Tensor, dim: int) -> "_Pending":
        """Send x's first row (along `dim`) to the previous rank and its last row to the next; receive theirs.
        Tags: 1 = a rank's first row (the previous rank's bottom halo), 2 = its last row (the next rank's top)."""
        ops, keep = [], []
        top = bot = None
        n = x.shape[dim]
        # channels-last rows travel as the contiguous (N, [T,] 1, W, C) tensor of their bytes (gloo's p2p takes only
        # contiguous tensors) and arrive as channels-last views: no transposes, and the slabs built from them feed
        # cuDNN's NHWC kernels
        order = (0, *range(2, x.dim()), 1) if x.dim() in (4, 5) and x.stride(1) == 1 and x.shape[1] > 1 else None
        back = None if order is None else (0, x.dim() - 1, *range(1, x.dim() - 1))

        def wire(row: Tensor) -> Tensor:
            return row.contiguous() if order is None else row.permute(order).contiguous()

        def view(t: Tensor) -> Tensor:
            return t if back is None else t.permute(back)

        if self.prev is not None:
            s = wire(x.narrow(dim, 0, 1))
            r = torch.empty_like(s)
            ops += [("send", s, self.prev, 1), ("recv", r, self.prev, 2)]
            keep.append(s)
            top = view(r)
        if self.next is not None:
            s = wire(x.narrow(dim, n - 1, 1))
            r = torch.empty_like(s)
            ops += [("send", s, self.next, 2), ("recv", r, self.next, 1)]
            keep.append(s)
            bot = view(r)
        self.counts["halo_exchanges"] += 1
        self.counts["halo_bytes"] += sum(t.numel() * t.element_size() for t in keep)
        return _Pending(self._p2p(ops), top, bot, keep)

    # -- exact GroupNorm statistics ----------------------------------------------------------------------------
    def merge_moments(self, n_local: int, mean: Tensor, m2: Tensor) -> tuple[int, Tensor, Tensor]:
        """(count, mean[G], M2[G]) of this rank's band -> those of the whole activation (fp64 where the device has
        it), identical on every rank. One all_gather of 2G values per rank; counts are known on every host."""
        dt = torch.float32 if mean.device.type == "mps" else torch.float64
        mine = torch.cat([mean.to(dt), m2.to(dt)])
        self.counts["stat_merges"] += 1
        if self.world == 1:
            return n_local, mean.to(dt), m2.to(dt)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        allp = torch.stack(parts)  # (R, 2G)
        G = mean.numel()
        means, m2s = allp[:, :G], allp[:, G:]
        per = n_local // (self.b - self.a)  # elements per latent row of the band (same on every rank)
        key = (allp.device, dt)
        if key not in self._rows:  # once: a host->device copy would otherwise stall the host at every norm
            self._rows[key] = torch.tensor([b - a for a, b in self.bands], dtype=dt, device=allp.device).view(-1, 1)
        ns = self._rows[key] * per  # element count of each rank's band
        n = per * self.bands[-1][1]
        mu = (ns * means).sum(0) / n
        M2 = (m2s + ns * (means - mu) ** 2).sum(0)
        return n, mu, M2

    # -- gathers -------------------------------------------------------------------------------------------------
    def rows_at(self, scale: int) -> list[tuple[int, int]]:
        return [(a * scale, b * scale) for a, b in self.bands]

    def allgather_rows(self, x: Tensor, dim: int, scale: int = 1) -> Tensor:
        """Every rank's band of x (split along `dim`, bands of `scale` x the latent rows) -> the full tensor."""
        if self.world == 1:
            return x
        rows = self.rows_at(scale)
        m = max(b - a for a, b in rows)
        x = x.contiguous()
        pad = list(x.shape)
        pad[dim] = m
        buf = x.new_zeros(pad)
        buf.narrow(dim, 0, x.shape[dim]).copy_(x)
        parts = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(parts, buf, group=self.group)
        return torch.cat([p.narrow(dim, 0, b - a) for p, (a, b) in zip(parts, rows)], dim)

    def gather_to_root(self, x: Tensor, dim: int, scale: int, out: Tensor | None) -> None:
        """Rank 0 receives every band of x into `out` (rows `scale` x the latent bands along `dim`)."""
        rows = self.rows_at(scale)
        if self.rank != 0:
            s = x.contiguous()
            for w in self._p2p([("send", s, 0, 3)]):
                w.wait()
            return
        a0, b0 = rows[0]
        out.narrow(dim, a0, b0 - a0).copy_(x)
        ops, bufs = [], []
        for r in range(1, self.world):
            a, b = rows[r]
            shape = list(x.shape)
            shape[dim] = b - a
            t = torch.empty(shape, dtype=x.dtype, device=x.device)
            bufs.append((t, a, b))
            ops.append(("recv", t, r, 3))
        for w in self._p2p(ops):
            w.wait()
        for t, a, b in bufs:
            out.narrow(dim, a, b - a).copy_(t)

    def check_same(self, values: Sequence[int], what: str) -> None:
        """Raise on every rank if the ranks disagree on `values` (e.g. the latent shape)."""
        if self.world == 1:
            return
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        got = [tuple(int(v) for v in p.tolist()) for p in parts]
        if len(set(got)) != 1:
            raise DistributedError(f"ranks disagree on {what}: " + ", ".join(f"rank {r}: {g}" for r, g in
                                                                           enumerate(got)))


@dataclass
class _Pending:
    works: list
    top: Tensor | None
    bot: Tensor | None
    keep: list = field(default_factory=list)  # send buffers, alive until the exchange completes

    def wait(self) -> tuple[Tensor | None, Tensor | None]:
        for w in self.works:
            w.wait()
        self.works = []
        self.keep = []
        return self.top, self.bot


def _fix_edges(inp: Tensor, top: Tensor | None, bot: Tensor | None, out: Tensor, conv_rows: Callable,
               dim: int) -> None:
    """Recompute out's first / last row (along `dim`) of a radius-1 conv from 3-row slabs [top | inp | bot]: the
    band's conv ran with zero padding there. Rows at the image border (no neighbour) are already right. Both slabs
    go through conv_rows in one call (stacked along the batch dim)."""
    H = inp.shape[dim]

    def row(i: int) -> Tensor:
        if i < 0:
            return top if top is not None else torch.zeros_like(inp.narrow(dim, 0, 1))
        if i >= H:
            return bot if bot is not None else torch.zeros_like(inp.narrow(dim, 0, 1))
        return inp.narrow(dim, i, 1)

    slabs, at = [], []
    if top is not None:
        slabs.append([row(-1), row(0), row(1)])
        at.append(0)
    if bot is not None and (H > 1 or top is None):
        slabs.append([row(H - 2), row(H - 1), row(H)])
        at.append(H - 1)
    if not slabs:
        return
    n = inp.shape[0]
    s = torch.cat([torch.cat(rows, dim) for rows in slabs], 0)
    y = conv_rows(s)  # (len(slabs) * n, C', ..., 1, ...)
    for j, i in enumerate(at):
        out.narrow(dim, i, 1).copy_(y[j * n : (j + 1) * n])


def _add_halo(top: Tensor | None, bot: Tensor | None, out: Tensor, halo: Callable, dim: int) -> None:
    """out's first / last row (along `dim`) of a radius-1 conv that ran on the band with zero padding, completed by
    what the neighbours' rows add: halo(row, 0) is the conv of the row above the band with the kernel's first row
    only (no bias), halo(row, 2) that of the row below with its last row. The conv is linear, so this is the row
    over the 3-row slab, summed in two parts (a one-row band gets both)."""
    if top is not None:
        out.narrow(dim, 0, 1).add_(halo(top, 0))
    if bot is not None:
        out.narrow(dim, out.shape[dim] - 1, 1).add_(halo(bot, 2))


def _halo_weight(conv: nn.Module, w: Tensor, i: int, dim: int) -> Tensor:
    """Kernel row i (along the weight's H dim `dim`) of w, a weight derived from conv's, dense in w's layout; cached
    on conv per weight version (stages.cached_weight)."""
    from vaeopt.stages import cached_weight

    def make() -> Tensor:
        r = w.detach().narrow(dim, i, 1)
        fmt = torch.contiguous_format
        if w.stride(1) == 1 and w.shape[1] > 1:
            fmt = torch.channels_last_3d if w.dim() == 5 else torch.channels_last
        return r.contiguous(memory_format=fmt)

    return cached_weight(conv, f"_vaeopt_halo_w{i}_{w.dim()}d", w.dtype, make)


def _plain_conv2d(m: nn.Module) -> bool:
    # video's test, plus what recomputing edge rows from 3-row slabs needs: stride 1, no dilation, "same" padding
    return (video._plain_conv2d(m) and tuple(m.stride) == (1, 1) and tuple(m.dilation) == (1, 1)
            and tuple(m.padding) == (m.kernel_size[0] // 2, m.kernel_size[1] // 2))


def _conv2d_rows(conv: nn.Module) -> Callable[[Tensor], Tensor]:
    """slab (N, C, 3, W) -> the conv's output row for the slab's middle row (N, C', 1, W)."""
    if _plain_conv2d(conv):
        pw = conv.kernel_size[1] // 2
        return lambda s: F.conv2d(s, conv.weight, conv.bias, 1, (0, pw), 1, conv.groups)
    return lambda s: conv(s).narrow(2, 1, 1)  # any size-preserving module: its own padding, middle row


def _kernel_hw(conv: nn.Module) -> tuple[int, int]:
    k = getattr(conv, "kernel_size", None)
    if k is None:
        w = getattr(conv, "weight", None)
        if w is None:
            raise DistributedError(f"{type(conv).__name__}: cannot tell its kernel size for the halo exchange")
        k = tuple(w.shape[2:])
    k = tuple(k) if isinstance(k, (tuple, list)) else (k, k)
    return int(k[-2]), int(k[-1])


# ================================================================================================================
# GroupNorm with global statistics (torch ops, or the project's Triton reduction / apply kernels on CUDA)
# ================================================================================================================


def _gn_module():
    return importlib.import_module("vaeopt.kernels.group_norm_silu")


def _kernels_possible(x: Tensor) -> bool:
    return fused_norms.use_kernel(x)


def _torch_group_moments(x: Tensor, G: int, xb: Tensor | None = None) -> tuple[int, Tensor, Tensor]:
    """Per-group (count, mean, M2) of x (+ xb[c]) for x (1, C, ...): per-channel two-pass moments in fp32, merged
    into groups in fp64."""
    C = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    n_c = x.numel() // C
    bshape = (1, -1) + (1,) * (x.dim() - 2)
    xf = x.float() if xb is None else x.float() + xb.float().view(bshape)
    mean_c = xf.mean(dim=dims)
    m2_c = torch.linalg.vector_norm(xf - mean_c.view(bshape), 2, dim=dims).square_()
    del xf
    dt = torch.float32 if x.device.type == "mps" else torch.float64
    mean_c, m2_c = mean_c.to(dt).view(G, C // G), m2_c.to(dt).view(G, C // G)
    mean_g = mean_c.mean(dim=1)
    m2_g = m2_c.sum(dim=1) + n_c * ((mean_c - mean_g[:, None]) ** 2).sum(dim=1)
    return n_c * (C // G), mean_g, m2_g


def _triton_group_moments(x: Tensor, G: int, xb: Tensor | None = None, public: bool = True
                          ) -> tuple[int, Tensor, Tensor]:
    """The same with the project's GroupNorm statistics kernel (one read of x; fp32 sums around a shift; the owed
    bias xb added on load), its chunk partials merged in fp64. Uses kernels.group_norm_silu's public
    group_norm_partials / merge_partials where that module has them, else launches its stats kernels here."""
    import triton

    from vaeopt.kernels import default_tile, flat_layout, n_programs_target

    K = _gn_module()
    if public and hasattr(K, "group_norm_partials") and hasattr(K, "merge_partials") and x.shape[0] == 1:
        _n, mean_g, m2_g = K.merge_partials(K.group_norm_partials(x, G, x_bias=xb))
        return x.numel() // G, mean_g, m2_g
    lay = flat_layout(x)
    C = x.shape[1]
    if lay is None or x.shape[0] != 1 or (lay[0] == "cl" and C > 8192):
        return _torch_group_moments(x, G, xb)
    kind, S, stride_n = lay
    CG = C // G
    dev = x.device
    tile, target = default_tile(dev), n_programs_target(dev)
    nw = K._warps(tile)
    xbp = xb.reshape(C) if xb is not None else torch.zeros(1, device=dev, dtype=torch.float32)
    if kind == "cf":
        L = CG * S
        BLOCK = min(tile, triton.next_power_of_2(L))
        BLOCK_GR = min(triton.next_power_of_2(G), max(1, tile // BLOCK))
        blocks = triton.cdiv(L, BLOCK)
        iters = max(1, triton.cdiv(triton.cdiv(G, BLOCK_GR) * blocks, target))
        n_chunks = triton.cdiv(blocks, iters)
        part = torch.empty((3, G, n_chunks), device=dev, dtype=torch.float32)
        xb_mode = 0 if xb is None else (1 if S % BLOCK == 0 else 2)
        K._stats_cf_kernel[(n_chunks, triton.cdiv(G, BLOCK_GR))](
            x, part, xbp, G, L, stride_n, G, n_chunks, iters, S, CG,
            BLOCK_GR=BLOCK_GR, BLOCK=BLOCK, XB=xb_mode, num_warps=nw,
        )  # fmt: skip
    else:
        BLOCK_C = triton.next_power_of_2(C)
        BLOCK_S = max(1, min(tile // BLOCK_C, triton.next_power_of_2(S)))
        blocks = triton.cdiv(S, BLOCK_S)
        iters = max(1, triton.cdiv(blocks, target))
        n_chunks = triton.cdiv(blocks, iters)
        part = torch.empty((3, G, n_chunks), device=dev, dtype=torch.float32)
        K._stats_cl_kernel[(n_chunks, 1)](
            x, part, xbp, S, C, CG, G, stride_n, n_chunks, iters,
            BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, BLOCK_G=triton.next_power_of_2(G),
            CG_POW2=CG if CG & (CG - 1) == 0 else 0, XB=xb is not None, num_warps=nw,
        )  # fmt: skip
    p = part.double()
    cnt, mu, m2 = p[0], p[1], p[2]
    n_g = cnt.sum(dim=1)
    mean_g = (cnt * mu).sum(dim=1) / n_g
    m2_g = (m2 + cnt * (mu - mean_g[:, None]) ** 2).sum(dim=1)
    return S * CG, mean_g, m2_g


def _triton_apply(x: Tensor, mean_c: Tensor, a_c: Tensor, bias: Tensor, silu: bool, public: bool = True
                  ) -> Tensor | None:
    """y = (x - mean_c) * a_c + bias_c (+ SiLU) with the project's GroupNorm apply kernel (one read, one write; the
    public group_norm_apply where kernels.group_norm_silu has it); None if x's layout does not suit it."""
    import triton

    from vaeopt.kernels import default_tile, flat_layout, new_like

    K = _gn_module()
    if public and hasattr(K, "group_norm_apply") and x.dim() == 4:
        return K.group_norm_apply(x, mean_c, a_c, bias, silu)
    lay = flat_layout(x)
    C = x.shape[1]
    if lay is None or x.shape[0] != 1 or (lay[0] == "cl" and C > 8192):
        return None
    kind, S, stride_n = lay
    dev = x.device
    tile = default_tile(dev)
    nw = K._warps(tile)
    y = new_like(x, kind)
    mean = mean_c.reshape(1, C).contiguous()
    a = a_c.reshape(1, C).contiguous()
    if kind == "cf":
        BS = min(triton.next_power_of_2(S), max(1024, tile // 4))
        BR = max(1, min(tile // BS, triton.next_power_of_2(C)))
        n_s_blocks = triton.cdiv(S, BS)
        n_tiles = n_s_blocks * triton.cdiv(C, BR)
        K._apply_cf_kernel[(n_tiles,)](
            x, y, mean, a, bias, C, C, S, stride_n, n_s_blocks, n_tiles,
            BLOCK_R=BR, BLOCK_S=BS, SILU=silu, num_warps=nw,
        )  # fmt: skip
    else:
        BLOCK_C = triton.next_power_of_2(C)
        BLOCK_S = max(1, min(tile // BLOCK_C, triton.next_power_of_2(S)))
        n_s_blocks = triton.cdiv(S, BLOCK_S)
        K._apply_cl_kernel[(n_s_blocks,)](
            x, y, mean, a, bias, S, C, stride_n, n_s_blocks, n_s_blocks,
            BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, SILU=silu, num_warps=nw,
        )  # fmt: skip
    return y


class _GroupNormer:
    """GroupNorm (+ the model's nonlinearity) of a band with the statistics of the whole activation. `xb`: a bias
    the band still owes (its conv ran without it): normalizes x + xb[c] without materializing it."""

    def __init__(self, comm: _Comm, kernels: bool | None, notes: list[str]):
        self.comm = comm
        self.kernels = kernels  # None: auto (CUDA with triton), True: required, False: torch ops
        self.notes = notes
        self._broken = False

    def use_kernels(self, x: Tensor) -> bool:
        if self.kernels is False or self._broken:
            return False
        ok = _kernels_possible(x)
        if self.kernels is None:
            return ok and x.is_cuda
        if not ok:
            raise DistributedError("kernels=True, but the Triton GroupNorm kernels cannot run for this tensor")
        return True

    def fallback(self, e: BaseException) -> None:
        oom = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                    if t is not None)
        if self.kernels or isinstance(e, oom):  # required kernels, or out of memory (torch ops would need more)
            raise e
        self._broken = True
        self.notes.append(f"Triton kernels failed ({type(e).__name__}: {e}); using torch ops")

    def moments(self, x: Tensor, G: int, xb: Tensor | None) -> tuple[int, Tensor, Tensor]:
        if self.use_kernels(x):
            try:
                return _triton_group_moments(x, G, xb)
            except Exception as e:  # noqa: BLE001 - a kernel API drift must not kill the decode
                self.fallback(e)
        return _torch_group_moments(x, G, xb)

    def __call__(self, x: Tensor, norm: nn.Module, nonlin: nn.Module | None, xb: Tensor | None = None) -> Tensor:
        G = int(norm.num_groups)
        n, mean, m2 = self.moments(x, G, xb)
        n, mean_g, m2_g = self.comm.merge_moments(n, mean, m2)
        C = x.shape[1]
        rstd = torch.rsqrt(m2_g / n + float(norm.eps))  # biased variance, as nn.GroupNorm
        dt = rstd.dtype
        w = norm.weight.detach().to(device=rstd.device, dtype=dt) if norm.weight is not None else \
            torch.ones(C, dtype=dt, device=rstd.device)
        b = norm.bias.detach().to(device=rstd.device, dtype=dt) if norm.bias is not None else \
            torch.zeros(C, dtype=dt, device=rstd.device)
        a_c = rstd.repeat_interleave(C // G) * w
        mean_c = mean_g.repeat_interleave(C // G)
        if xb is not None:  # (x + xb - mean) * a + b == (x - (mean - xb)) * a + b
            mean_c = mean_c - xb.detach().to(dt)
        fused_silu = getattr(norm, "silu", False) is True  # FusedGroupNormSiLU (stages/fused_norms.py)
        plain_silu = nonlin is not None and type(nonlin) is nn.SiLU and _unhooked(nonlin)
        silu = fused_silu or plain_silu
        y = None
        if self.use_kernels(x):
            try:
                y = _triton_apply(x, mean_c.float(), a_c.float(), b.to(x.device, torch.float32), silu)
            except Exception as e:  # noqa: BLE001
                self.fallback(e)
        if y is None:
            f = dict(dtype=torch.float32, device=x.device)
            shape = (1, C) + (1,) * (x.dim() - 2)
            scale = a_c.to(**f).view(shape)
            shift = (b - mean_c * a_c).to(**f).view(shape)
            y = torch.addcmul(shift, x, scale)
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
            if silu:
                y = F.silu(y, inplace=True)
        if nonlin is not None and not plain_silu and not (type(nonlin) is nn.Identity):
            y = nonlin(y)
        return y


# ================================================================================================================
# AutoencoderKL (SD / SDXL / SD3 / FLUX): band-parallel decode
# ================================================================================================================


def _attn_split_ok(attn: nn.Module) -> tuple[bool, str]:
    try:
        from diffusers.models.attention_processor import AttnProcessor2_0
    except ImportError:  # pragma: no cover
        return False, "diffusers' AttnProcessor2_0 is not importable"
    proc = getattr(attn, "processor", None)
    if not (type(proc) is AttnProcessor2_0 or type(proc).__name__ == "ChunkedAttnProcessor"):
        return False, f"attention processor {type(proc).__name__} is not one whose math is known here"
    if not _unhooked(attn):
        return False, "the attention module has hooks"
    for a in ("spatial_norm", "norm_q", "norm_k"):
        if getattr(attn, a, None) is not None:
            return False, f"attention with {a}"
    if getattr(attn, "to_out", None) is None or getattr(attn, "is_cross_attention", False):
        return False, "not a self-attention with an output projection"
    return True, ""


def _upsampler_ok(up: nn.Module) -> bool:
    return (getattr(up, "interpolate", False) and getattr(up, "use_conv", False)
            and not getattr(up, "use_conv_transpose", False) and getattr(up, "norm", None) is None)


class _ImageBandDecoder:
    """AutoencoderKL decoder on one band. With the kernels on (CUDA + triton: the single-GPU fused path's
    equivalents), plain convs run without their bias, which the next consumer folds in (GroupNorm statistics and
    apply, the residual epilogue), and the residual epilogue of an up-block's last resnet writes the 2x upsampled
    tensor directly -- the same passes the fused single-GPU decode saves. Otherwise torch ops, biases in place."""

    def __init__(self, vae: nn.Module, comm: _Comm, kernels: bool | None):
        from vaeopt import tiling

        self.vae = vae
        self.dec = tiling._decoder(vae)
        tiling._plan(vae)  # raises TilingError (clear message) for structures the band split cannot follow
        for i, blk in enumerate(self.dec.mid_block.resnets):
            tiling._check_resnet(blk, f"mid_block.resnets.{i}")
        self.comm = comm
        self.notes: list[str] = []
        self.norm = _GroupNormer(comm, kernels, self.notes)
        self.kernels = kernels
        self.fold = False
        self.counts = {"bias_folded": 0, "epilogue_kernel": 0, "upsample_fused": 0}

    # -- building blocks ---------------------------------------------------------------------------------------
    def _conv(self, conv: nn.Module, y: Tensor, fold: bool = True) -> tuple[Tensor, Tensor | None]:
        """conv(y) for a band y, exact at the band edges (halo rows from the neighbours). -> (out, owed bias): with
        folding on, a plain nn.Conv2d runs without its bias and returns it as owed."""
        kh, kw = _kernel_hw(conv)
        nobias = fold and self.fold and _plain_conv2d(conv) and conv.bias is not None
        if nobias:
            self.counts["bias_folded"] += 1

            def main(t: Tensor) -> Tensor:
                return F.conv2d(t, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
        else:
            main = conv
        owed = conv.bias if nobias else None
        if kh == 1:
            return main(y), owed
        if kh != 3:
            raise DistributedError(f"{type(conv).__name__}: band decoding handles 1x1 and 3x3 convs, not {kh}x{kw}")
        pend = self.comm.exchange_start(y, 2)
        out = main(y)
        if out.shape[-2:] != y.shape[-2:]:
            raise DistributedError(f"{type(conv).__name__}: band decoding needs size-preserving convolutions")
        top, bot = pend.wait()
        if nobias:
            pw = conv.kernel_size[1] // 2
            rows = lambda s: F.conv2d(s, conv.weight, None, 1, (0, pw), 1, conv.groups)  # noqa: E731
        else:
            rows = _conv2d_rows(conv)
        _fix_edges(y, top, bot, out, rows, 2)
        return out, owed

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
        from vaeopt.tiling import _up_conv

        u = x if already else self._up2x(x)
        del x
        return self._conv(_up_conv(up), u)

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

    def _resnet(self, blk: nn.Module, x: Tensor, xb: Tensor | None, up: bool = False) -> Tensor:
        y = self.norm(x, blk.norm1, blk.nonlinearity, xb)
        h, hb = self._conv(blk.conv1, y)
        del y
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
        elif (xb is not None and _plain_conv2d(sc) and _kernel_hw(sc) == (1, 1) and sc.groups == 1):
            # a 1x1 conv of (x + xb) == conv(x) + W @ xb: the owed bias folds through it exactly
            r, rb = self._conv(sc, x)
            fold = torch.mv(sc.weight.reshape(sc.out_channels, -1).float(), xb.float())
            rb = fold + (rb if rb is not None else sc.bias if sc.bias is not None else 0.0)
            rb = rb.float()
        else:
            if xb is not None:
                x = x + xb.to(x.dtype).view(1, -1, 1, 1)
            r, rb = self._conv(sc, x)
        del x
        return self._epilogue(o, ob, r, rb, osf, up)

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
            from vaeopt.stages.fused_epilogues import chunked_attention

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
        if last_attn is not None:
            x = self._attention(ops[last_attn][1], x)  # full -> this rank's rows
        else:
            x = x.narrow(2, comm.a, comm.b - comm.a).contiguous()
        for kind, m in ops[whole_until + 1 :]:
            x = self._resnet(m, x, None)
        up_dtype = next(iter(dec.up_blocks.parameters())).dtype
        x, xb = x.to(up_dtype), None
        # up-blocks on the band
        for ub in dec.up_blocks:
            ups = list(getattr(ub, "upsamplers", None) or [])
            fuse_up = self.fold and len(ups) == 1 and _upsampler_ok(ups[0])
            last = len(ub.resnets) - 1
            for i, res in enumerate(ub.resnets):
                x, xb = self._resnet(res, x, xb, up=fuse_up and i == last), None
            for j, up in enumerate(ups):
                x, xb = self._upsample(up, x, already=fuse_up and j == 0)
        y = self.norm(x, dec.conv_norm_out, dec.conv_act, xb)
        del x
        out, _ = self._conv(dec.conv_out, y, fold=False)
        return out


# ================================================================================================================
# AutoencoderKLWan (Wan 2.1 / 2.2): band-parallel chunked decode with per-band causal caches
# ================================================================================================================


BAND_STACK = True  # bands run stacked_conv3d's time-stacked convs (benchmarks' A/B switch; read per decoder class)


def _band_chunk_decoder_class():
    class _BandChunkDecoder(video._ChunkDecoder):
        """vaeopt.video's chunk decoder on one band of rows: every spatial conv exchanges the boundary rows of its
        staged input ([causal history | new frames], i.e. including the history), runs on the band with zero
        padding, and adds the neighbours' rows to its edge rows (_add_halo: the received row through the kernel's
        first / last row). The mid-block attention gathers its latent-resolution input. Each band keeps its own
        causal caches. A conv stacked_conv3d marked runs time-stacked as on one GPU: the rows exchanged are the
        stack's (each holds the 3 frames its output frame reads). The head conv on tapconv exchanges rows of its
        GEMM output (the 27 taps per pixel)."""

        STACK = BAND_STACK

        def __init__(self, vae, channels_last: bool, fused, comm: _Comm):
            super().__init__(vae, channels_last, fused)
            self.comm = comm
            self.halo_seen: set[int] = set()
            self.attn_calls = 0
            wan = video._wan()
            self.expected = {}
            for name, m in self.dec.named_modules():
                if isinstance(m, wan.WanCausalConv3d) and m.kernel_size[1] > 1:
                    self.expected[id(m)] = name
                elif isinstance(m, wan.WanResample) and isinstance(getattr(m, "resample", None), nn.Sequential):
                    c = m.resample[-1] if len(m.resample) else None
                    if c is not None and _kernel_hw(c)[0] > 1:
                        self.expected[id(c)] = name + ".resample"

        # The fused resample path runs its 2D conv inline; the halo-aware _resample below takes over instead.
        def _up_fusable(self, rs) -> bool:
            return False

        def _run(self, conv, x: Tensor, bias: bool = True) -> Tensor:
            if isinstance(x, video._Stacked):
                return self._run_stacked(conv, x, bias)
            kh, kw = _kernel_hw(conv)
            if kh == 1:
                return super()._run(conv, x, bias)
            if not self._plain(conv) or kh != 3 or tuple(conv.stride) != (1, 1, 1) or conv._padding[2] != 1:
                raise DistributedError(f"band decoding needs stock 3x3x3 WanCausalConv3d convs; {type(conv).__name__}"
                                       " is patched/hooked or of another shape (decode on one GPU instead)")
            self.halo_seen.add(id(conv))
            pend = self.comm.exchange_start(x, 3)
            y = super()._run(conv, x, bias)
            top, bot = pend.wait()
            pw = conv._padding[0]

            def halo(r: Tensor, i: int) -> Tensor:  # (N, C, hist + k, 1, W) -> (N, C', k, 1, W): no temporal padding
                return F.conv3d(r, _halo_weight(conv, conv.weight, i, 3), None, 1, (0, 0, pw), 1, conv.groups)

            _add_halo(top, bot, y, halo, 3)
            return y

        def _run_stacked(self, conv, st, bias: bool) -> Tensor:
            """The time-stacked Conv2d on this band's stack S (N*k, 3C, h, W): S's boundary rows go to the
            neighbours while it runs, then the received rows complete its first / last output rows (_add_halo)."""
            S = st.S
            self.halo_seen.add(id(conv))
            pend = self.comm.exchange_start(S, 2)
            w = video._stacked_w(conv, S.dtype)
            pw = conv._padding[0]
            y4 = F.conv2d(S, w, conv.bias if bias else None, 1, (conv._padding[2], pw))
            top, bot = pend.wait()
            _add_halo(top, bot, y4, lambda r, i: F.conv2d(r, _halo_weight(conv, w, i, 2), None, 1, (0, pw)), 2)
            return self._unstack(y4, st)

        def _tap_sum(self, conv, Y: Tensor, y: Tensor) -> None:
            """The head conv as tapconv's GEMM + tap sum: the rows exchanged are those of the planar GEMM output Y
            (27 taps x Co channels); a received row's taps of kernel row 0 (from above) / 2 (from below), summed
            with kernel (3, 1, 3), complete the edge rows."""
            from vaeopt.kernels import tapconv

            self.halo_seen.add(id(conv))
            pend = self.comm.exchange_start(Y, 3)
            super()._tap_sum(conv, Y, y)
            top, bot = pend.wait()
            co = conv.out_channels

            def halo(r: Tensor, i: int) -> Tensor:  # Y's row (n, 27 Co, hist + k, 1, W) -> its taps of kernel row i
                n, _, ts, _, w = r.shape
                taps = r.reshape(n, 3, 3, 3, co, ts, 1, w)[:, :, i].reshape(n, 9 * co, ts, 1, w)  # (dt, dw, o)
                o = torch.empty((n, co, ts - 2, 1, w), dtype=y.dtype, device=y.device)
                return tapconv.tap_sum(taps, co, (3, 1, 3), None, o)

            _add_halo(top, bot, y, halo, 3)

        def _attention(self, blk, x: Tensor) -> Tensor:
            if isinstance(blk, _WanBandAttention) and self._attn_fusable(blk.inner, x):
                return blk.fused(x, self)
            return super()._attention(blk, x)

        # video's _resample with a halo exchange around its frame-group conv (video._frames_up_conv)
        def _resample(self, rs, box: list[Tensor]) -> Tensor:
            if rs.mode == "upsample3d":
                x = self._time_upsample(rs, box.pop())
            elif rs.mode == "upsample2d":
                x = box.pop()
            else:
                raise DistributedError(f"unexpected resample mode {rs.mode!r} in a Wan decoder")
            b, c, t, h, w = x.shape
            x2 = video._frames4(x)
            del x
            up, conv2d = rs.resample[0], rs.resample[1]
            # not video's choice, on purpose: the edge slabs below assume 2x; a hooked Upsample runs with its hooks
            if self.kern and video._is_2x_nearest(up) and hasattr(self, "_br"):
                up_fn = functools.partial(self._br, upsample2x=True)  # the kernel: bitwise the same copy
                self.stats["upsample_kernel"] += 1
            elif video._is_2x_nearest(up) or (isinstance(up, nn.Upsample) and up.mode in ("nearest", "nearest-exact")
                                              and _unhooked(up)):
                up_fn = lambda t_: F.interpolate(t_, scale_factor=2.0, mode="nearest")  # noqa: E731 (a copy)
            else:
                up_fn = up
            if _kernel_hw(conv2d)[0] != 3:
                raise DistributedError("band decoding: the Wan resample conv is not 3x3")
            self.halo_seen.add(id(conv2d))
            pend = self.comm.exchange_start(x2, 2)
            phase = video._phase_ok(conv2d, up, x2)  # stages/upsample_conv's 2x2 phase convs: the same map
            self.stats["upsample_phase"] += phase
            y = video._frames_up_conv(conv2d, up_fn, x2, phase)  # its rows 0 / -1 are fixed below
            top, bot = pend.wait()
            rows = _conv2d_rows(conv2d)
            if top is not None:  # upsampled rows 2a-1, 2a, 2a+1 = [top, x0, x0]
                slab = up_fn(torch.cat([top, x2[:, :, :1]], 2)).narrow(2, 1, 3)
                y[:, :, :1].copy_(rows(slab))
            if bot is not None:  # upsampled rows 2b-2, 2b-1, 2b = [x_last, x_last, bot]
                slab = up_fn(torch.cat([x2[:, :, -1:], bot], 2)).narrow(2, 0, 3)
                y[:, :, -1:].copy_(rows(slab))
            return y.view(b, t, y.size(1), y.size(2), y.size(3)).permute(0, 2, 1, 3, 4)

        def check_coverage(self) -> None:
            missing = [n for i, n in self.expected.items() if i not in self.halo_seen]
            if missing:
                raise DistributedError("band decoding: these convs ran without the halo exchange (vaeopt.video's "
                                       f"decoder changed?): {', '.join(sorted(missing)[:6])}")

    return _BandChunkDecoder


class _WanBandAttention(nn.Module):
    """Stands in for a WanAttentionBlock during a band decode: per-frame attention over the whole latent plane for
    the queries of this rank's rows (the plane is gathered from all bands; K/V computed for all of it)."""

    def __init__(self, inner: nn.Module, comm: _Comm, owner):
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
        """The kernel path (video._ChunkDecoder._attention's math for this rank's query rows): the channels-last
        bands are gathered as they are, the norm and the K/V projection run on the whole plane, Q only for this
        rank's rows, fused_epilogues' exact chunked GEMM attention (SDPA's only kernel for head_dim 384 is its
        memory-efficient one, several times slower), and one epilogue for proj's bias and the residual."""
        from vaeopt.stages.fused_epilogues import chunked_attention

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


def _decode_wan_band(vae, z: Tensor, comm: _Comm, chunk, fused, channels_last, gather: bool):
    z = video._prepare(vae, z)
    wan = video._wan()
    mid = vae.decoder.mid_block
    for i, m in enumerate(mid.attentions):
        if m is not None and not isinstance(m, wan.WanAttentionBlock):
            raise DistributedError(f"mid_block.attentions.{i}: {type(m).__name__} is not a WanAttentionBlock")
    cls = _band_chunk_decoder_class()
    dec = cls(vae, video._channels_last(vae, channels_last), fused, comm)
    p = video._patch(vae)
    sched = video.chunk_schedule(z.shape[2], chunk)
    total = sum(video.output_frame_counts(sched, video._temporal_factor(vae)))
    zb = z[:, :, :, comm.a : comm.b].contiguous()
    band = None
    orig = list(mid.attentions)
    try:
        for i, m in enumerate(orig):
            if m is not None:
                mid.attentions[i] = _WanBandAttention(m, comm, dec)
        t0 = f0 = 0
        for k in sched:
            y = dec.step(zb[:, :, t0 : t0 + k])
            if t0 == 0:
                dec.check_coverage()
                if any(m is not None for m in orig) and dec.attn_calls == 0:
                    raise DistributedError("band decoding: the Wan mid-block attention was not reached")
            t0 += k
            if band is None:
                band = torch.empty(video._final_shape(y, p, total), dtype=y.dtype, device=y.device)
            video._finish_float(y, p, band[:, :, f0 : f0 + y.shape[2]])
            f0 += y.shape[2]
            del y
    finally:
        for i, m in enumerate(orig):
            if m is not None:
                mid.attentions[i] = m
    scale = band.shape[3] // (comm.b - comm.a)
    info = {"stats": dict(dec.stats), "schedule": sched, "scale": scale}
    if not gather:
        return band, info
    out = None
    if comm.rank == 0:
        N, C, T, _, W = band.shape
        out = torch.empty((N, C, T, scale * comm.bands[-1][1], W), dtype=band.dtype, device=band.device)
    comm.gather_to_root(band, 3, scale, out)
    return out, info


# ================================================================================================================
# Public: band-parallel decode
# ================================================================================================================


def supports_band(vae: nn.Module) -> tuple[bool, str]:
    """Can :func:`band_parallel_decode` split this VAE? -> (ok, why not)."""
    cls = type(vae).__name__
    if cls == "AutoencoderKLWan":
        fp8 = sum(1 for m in vae.decoder.modules() if getattr(m, "_vaeopt_fp8conv", False))
        if fp8:  # e4m3 staged inputs: the halo rows' convs would need the fp8 conv's scales and packed weights
            return False, (f"{fp8} of the decoder's convs run in fp8 (--fp8): band decoding runs Wan's convs in the "
                           "compute dtype only (decode on one GPU, or without --fp8)")
        return True, ""
    if cls != "AutoencoderKL":
        return False, f"{cls}: band-parallel decoding covers AutoencoderKL (SD/SDXL/SD3/FLUX) and AutoencoderKLWan"
    try:
        from vaeopt import tiling

        tiling._plan(vae)
    except VaeoptError as e:
        return False, str(e)
    return True, ""


def _model_device(vae: nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(p for p in vae.parameters() if p.is_floating_point())
    return p.device, p.dtype


@torch.no_grad()
def band_parallel_decode(
    vae: nn.Module,
    z_raw: Tensor,
    group=None,
    *,
    chunk: int | Sequence[int] | None = 4,
    gather: bool = True,
    kernels: bool | None = None,
    fused: bool | None = None,
    channels_last: bool | None = None,
    return_info: bool = False,
):
    """Decode raw latents on all ranks of `group` (default: the world), each rank one horizontal band.

    Call it on every rank with the same VAE weights and the same latents (checked). Images: ``z_raw`` (N, C, h, w)
    for a diffusers AutoencoderKL -> (N, 3, 8h, 8w) like ``vae.decode(z).sample``. Video: (N, C, T, h, w) for an
    AutoencoderKLWan -> (N, 3, T', 8h, 8w) clamped to [-1, 1] like ``vaeopt.video.decode_video`` (``chunk`` latent
    frames per decoder call, ``fused`` / ``channels_last`` as there). Runs on the VAE's device in its dtype
    (one GPU per rank: NCCL; CPU: gloo). Needs at least one latent row per rank.

    Returns, with ``gather=True``, the whole decode on rank 0 (model dtype, model device) and None on the other
    ranks; with ``gather=False``, ``(band, (y0, y1))`` on every rank: its output rows y0:y1. With
    ``return_info=True`` a dict is returned as well (as the last element): halo exchanges / bytes, statistics
    merges, notes on fallbacks, the bands. ``kernels``: the Triton GroupNorm statistics / apply kernels for the
    image path (None: on CUDA when available, True: required, False: torch ops).
    """
    ok, why = supports_band(vae)
    if not ok:
        raise DistributedError(why)
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError("band_parallel_decode needs an initialised process group (torchrun, or "
                               "vaeopt.distributed.launch / init_distributed)")
    device, dtype = _model_device(vae)
    if getattr(vae, "training", False):
        raise DistributedError("band-parallel decoding runs in eval mode only (call vae.eval())")
    cls = type(vae).__name__
    video = cls == "AutoencoderKLWan"
    if video and z_raw.dim() != 5:
        raise DistributedError(f"Wan latents must be (N, C, T, h, w), got {tuple(z_raw.shape)}")
    if not video and z_raw.dim() != 4:
        raise DistributedError(f"image latents must be (N, C, h, w), got {tuple(z_raw.shape)}")
    h = z_raw.shape[-2]
    comm = _Comm(group, h, device)
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
        if gather:
            out = None
            if comm.rank == 0:
                N, C, _, W = band.shape
                out = torch.empty((N, C, scale * h, W), dtype=band.dtype, device=band.device)
            comm.gather_to_root(band, 2, scale, out)
            res = out
        else:
            res = band
    scale = info["scale"]
    info.update(comm.counts, bands=comm.bands, rank=comm.rank, world=comm.world,
                seconds=time.perf_counter() - t0)
    if not gather:
        res = (res, (comm.a * scale, comm.b * scale))
        return (*res, info) if return_info else res
    return (res, info) if return_info else res


# ================================================================================================================
# Process groups: launch, torchrun, devices
# ================================================================================================================


def under_torchrun() -> bool:
    """Started by torchrun / torch.distributed.elastic (or any launcher that sets the env:// variables)?"""
    e = os.environ
    return all(k in e for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) and "_VAEOPT_SPAWNED" not in e


def _default_backend(n_procs: int) -> str:
    return "nccl" if torch.cuda.is_available() and n_procs <= torch.cuda.device_count() else "gloo"


def rank_device(backend: str | None = None) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under NCCL, else CPU."""
    if backend is None:
        backend = dist.get_backend() if dist.is_initialized() else _default_backend(int(os.environ.get(
            "WORLD_SIZE", "1")))
    if "nccl" in str(backend):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Initialise the default process group from the environment (torchrun's env://) if not done yet.
    -> (rank, world size, this rank's device). Sets the CUDA device of the rank under NCCL."""
    _apply_env_rules()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        backend = backend or _default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kw = {}
        if backend == "nccl":
            kw["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s),
                                    **kw)
        except TypeError:  # an older torch without device_id
            dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    dev = rank_device(dist.get_backend())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dist.get_rank(), dist.get_world_size(), dev


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(index: int, world: int, port: int, backend: str, fn: Callable, args: tuple, kwargs: dict,
           result_path: str, timeout_s: float) -> None:
    os.environ.update({"RANK": str(index), "LOCAL_RANK": str(index), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "_VAEOPT_SPAWNED": "1"})
    _apply_env_rules()
    if backend == "gloo" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on the loopback interface, like MASTER_ADDR
    init_distributed(backend, timeout_s)
    out = fn(*args, **kwargs)  # an exception ends this process; the parent stops the other ranks and reports it
    if index == 0:
        torch.save(out, result_path)
    del out
    dist.destroy_process_group()
    # Leave without interpreter finalization. destroy_process_group drops only the group's registry entries; gloo's
    # C++ worker threads live until the last Python reference goes, and if that happens while the interpreter is being
    # torn down the rank dies with SIGABRT ("terminate called without an active exception"), after its work is done
    # (seen rarely, under load, in the 2-rank CPU tests). The result is saved and closed above; nothing else is pending.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join(ctx, timeout: float) -> bool:
    try:  # a grace period lets the other ranks write their own error before they are terminated
        return ctx.join(timeout=timeout, grace_period=3.0)
    except TypeError:  # an older torch without grace_period
        return ctx.join(timeout=timeout)


_COMM_ERRORS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "distbackenderror",
                "timed out", "socket", "watchdog", "peer")


def _failure_report(ctx) -> str:
    """One message for all failed ranks, the root cause first: a rank's own exception (or death) rather than the
    communication errors it caused in its peers."""
    import pickle
    import signal

    fails = []
    for i, p in enumerate(ctx.processes):
        p.join(0.2)
        ef = ctx.error_files[i]
        text = None
        if os.access(ef, os.R_OK) and os.path.getsize(ef) > 0:
            try:
                with open(ef, "rb") as fh:
                    text = pickle.load(fh)
            except Exception:  # noqa: BLE001
                text = None
        if text is not None:
            last = [ln for ln in str(text).strip().splitlines() if ln.strip()][-1]
            last = re.sub(r"^[\w.]+\.(\w+):", r"\1:", last)  # vaeopt.errors.OutputError: -> OutputError:
            fails.append((i, last, str(text).strip()))
        elif p.exitcode not in (0, None, -signal.SIGTERM, -signal.SIGINT):
            code = p.exitcode
            what = f"exit code {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
            fails.append((i, f"died ({what})", ""))
    if not fails:
        return "a rank failed (no error was recorded)"
    fails.sort(key=lambda f: (any(k in f[1].lower() for k in _COMM_ERRORS), f[0]))
    r, last, text = fails[0]
    msg = f"rank {r} failed: {last}" + ("; the other ranks were stopped" if "died" in last else "")
    others = [f"rank {i}: {ln}" for i, ln, _ in fails[1:] if ln != last]  # (the same error everywhere: once)
    if others:
        msg += "\n(then " + "; ".join(others) + ")"
    if text:
        msg += "\n" + text
    return msg


def launch(n_procs: int | None, fn: Callable, *args, backend: str | None = None, timeout: float | None = 3600.0,
           kwargs: dict | None = None) -> Any:
    """Run ``fn(*args, **kwargs)`` on `n_procs` ranks of a fresh process group and return rank 0's result.

    * Under torchrun (env vars present): no spawning; joins the job (initialising the default group if needed),
      runs fn on this rank and returns its result. `n_procs`, if given, must equal WORLD_SIZE.
    * Otherwise spawns `n_procs` local processes (spawn start method; fn and args must be picklable: a module-level
      function) on 127.0.0.1 with a free port. backend None: NCCL with one GPU per rank when CUDA has n_procs
      devices, else gloo on CPU. Returns rank 0's return value (passed back through torch.save / torch.load).

    Any rank raising or dying ends the others and raises :class:`DistributedError` naming the rank, with its
    traceback; after `timeout` seconds all ranks are terminated and DistributedError is raised. Inside fn, use
    ``torch.distributed.get_rank()`` and :func:`rank_device`.
    """
    _apply_env_rules()
    kwargs = kwargs or {}
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if n_procs is not None and n_procs != world:
            raise DistributedError(f"started by torchrun with {world} ranks, but {n_procs} were asked for")
        created = not dist.is_initialized()
        init_distributed(backend)
        try:
            return fn(*args, **kwargs)
        finally:
            if created and dist.is_initialized():
                dist.destroy_process_group()
    if n_procs is None:
        n_procs = torch.cuda.device_count() or 1
    if n_procs < 1:
        raise DistributedError("n_procs must be at least 1")
    backend = backend or _default_backend(n_procs)
    if backend == "nccl" and n_procs > torch.cuda.device_count():
        raise DistributedError(f"NCCL needs one GPU per rank: {n_procs} ranks, {torch.cuda.device_count()} GPUs")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vaeopt-dist-") as tmp:
        result_path = os.path.join(tmp, "rank0.pt")
        port = _free_port()
        ctx = mp.start_processes(
            _child, args=(n_procs, port, backend, fn, args, kwargs, result_path, float(timeout or 3600.0)),
            nprocs=n_procs, join=False, start_method="spawn",
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not _join(ctx, 0.5):
                if deadline is not None and time.monotonic() > deadline:
                    raise DistributedError(f"{n_procs} ranks did not finish within {timeout:g} s; terminated")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            raise DistributedError(_failure_report(ctx)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if not os.path.exists(result_path):
            return None
        return torch.load(result_path, weights_only=False)


# ================================================================================================================
# Many files: jobs spread over the ranks (or decoded together, band-parallel, when there are fewer jobs than ranks)
# ================================================================================================================


def assign_jobs(sizes: Sequence[int], world: int) -> list[list[int]]:
    """Job indices per rank: largest job first to the least loaded rank (ties: lower rank, lower index);
    deterministic, so every rank computes the same assignment. Each rank's list keeps the input order."""
    heap = [(0, r) for r in range(world)]
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + int(sizes[i]), r))
    return [sorted(x) for x in out]


def _result_dict(r, rank: int, mode: str) -> dict:
    return {"source": str(r.job.source), "entry": r.job.entry, "shape": list(r.job.z_raw.shape),
            "written": [str(p) for p in r.written], "seconds": r.seconds, "peak_bytes": r.peak_bytes,
            "plan": r.plan, "retries": list(r.retries), "rank": rank, "mode": mode}


def decode_files_distributed(
    latents: Sequence[str | Path],
    model: str | Path | None = None,
    *,
    output: str | Path | None = None,
    family: str | None = None,
    config: str | Path | None = None,
    key: str | None = None,
    latent_space: str | None = None,
    overwrite: bool = False,
    options=None,
    fps: float = 16.0,
    mode: str = "auto",
    group=None,
    log: Callable[[str], None] | None = None,
) -> list[dict] | None:
    """Per-rank entry of ``vaeopt decode ... --gpus N``: call it on every rank of an initialised process group
    (e.g. ``launch(N, decode_files_distributed, paths, model, kwargs={...})``).

    Every rank reads the latents and plans the same jobs (vaeopt.api.plan_jobs: same output paths, same checks),
    loads the VAE once and builds its own Pipeline on its own device (``options``: a pipeline.Options; its device is
    replaced by the rank's). mode "files": jobs spread over the ranks (:func:`assign_jobs`), each rank decodes and
    writes its own with vaeopt.api.run_jobs. mode "band": all ranks decode every job together
    (:func:`band_parallel_decode`, the planner's chunk for the band) and rank 0 writes it. "auto": "band" when there
    are fewer jobs than ranks and the model supports it, else "files".

    Returns on rank 0 the summary of every job in job order (dicts: source, entry, shape, written, seconds,
    peak_bytes, plan, retries, rank, mode), None on the other ranks. If any rank failed, every rank raises
    DistributedError listing the failures.
    """
    from vaeopt import api
    from vaeopt import latents as lat
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline

    if not dist.is_initialized():
        raise DistributedError("decode_files_distributed runs inside a process group (use vaeopt.distributed.launch)")
    if mode not in ("auto", "files", "band"):
        raise DistributedError(f"mode must be auto, files or band, not {mode!r}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = rank_device()
    say = log or (lambda s: None)

    # phase 1, every rank: read, load, plan (identical job lists and checks); nobody writes before all have checked
    jobs = pipe = None
    used_mode = mode
    err = None
    try:
        files = [lat.read_latents(Path(p), key) for p in latents]
        model_path, _why = api.resolve_model(model, files)
        loaded = load_vae(model_path, family=family, config=config)
        jobs = api.plan_jobs(files, loaded, Path(output) if output is not None else None, latent_space, overwrite,
                             log=say if rank == 0 else None)
        opts = Options(**{**(options.__dict__ if options is not None else {}), "device": str(dev)})
        pipe = Pipeline(loaded, opts, log=(lambda s: say(f"[rank {rank}] {s}")))
        ok, why = supports_band(pipe.model)
        if mode == "auto":
            few = len(jobs) < world and world > 1  # fewer files than ranks: band mode where the model allows it
            used_mode = "band" if few and ok else "files"
            if few and not ok and rank == 0:
                say(f"band-parallel decoding not used ({why}): {len(jobs)} file(s) on {world} ranks, one rank each")
        elif mode == "band" and not ok:
            raise DistributedError(f"band mode: {why}")
    except Exception as e:  # noqa: BLE001 - reported on every rank
        err = _describe_error(e)
    _raise_if_any(err, group, world)

    # phase 2: decode and write
    results: list[dict] = []
    err = None
    try:
        if used_mode == "files":
            mine = assign_jobs([int(j.z_raw.numel()) for j in jobs], world)[rank]
            say(f"[rank {rank}] {len(mine)} of {len(jobs)} job(s)")
            idx = {id(j): i for i, j in enumerate(jobs)}
            for r in api.run_jobs(pipe, [jobs[i] for i in mine], fps=fps):
                d = _result_dict(r, rank, "files")
                d["index"] = idx[id(r.job)]
                results.append(d)
        else:
            for i, job in enumerate(jobs):
                results.append(_band_job(pipe, job, group, rank, fps, i))
    except Exception as e:  # noqa: BLE001
        err = _describe_error(e)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (rank, err, results), group=group)
    _raise_gathered([(r, e) for r, e, _ in gathered])
    if rank != 0:
        return None
    allres = [d for _, _, res in gathered for d in res]
    if used_mode == "band":
        allres = [d for d in allres if d["rank"] == 0]
    return sorted(allres, key=lambda d: d["index"])


def _describe_error(e: BaseException) -> str:
    if isinstance(e, VaeoptError):  # user-facing: the message is the point (not our class names)
        return str(e)
    msg = "".join(traceback.format_exception_only(type(e), e)).strip()
    return msg + "\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-6)).strip()


def _raise_gathered(pairs: list[tuple[int, str | None]]) -> None:
    by_msg: dict[str, list[int]] = {}
    for r, e in pairs:
        if e:
            by_msg.setdefault(e, []).append(r)
    if by_msg:
        raise DistributedError("; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}"
                                         for m, rs in by_msg.items()))


def _raise_if_any(err: str | None, group, world: int) -> None:
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (dist.get_rank(group), err), group=group)
    _raise_gathered(gathered)


def _band_job(pipe, job, group, rank: int, fps: float, index: int) -> dict:
    from vaeopt import api

    z = job.z_raw.to(pipe.device, pipe.dtype)
    shape = list(z.shape)
    world = dist.get_world_size(group)
    band_shape = shape[:-2] + [max(1, math.ceil(shape[-2] / world)), shape[-1]]
    plan = pipe.plan(tuple(band_shape))
    if pipe.device.type == "cuda":
        torch.cuda.synchronize(pipe.device)
        torch.cuda.reset_peak_memory_stats(pipe.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = band_parallel_decode(pipe.model, z, group, chunk=plan.chunk or 1)
    if pipe.device.type == "cuda":
        torch.cuda.synchronize(pipe.device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(pipe.device) if pipe.device.type == "cuda" else None
    written: list[Path] = []
    if rank == 0:
        written = api.write_job(job, out.float().cpu(), fps)
    return {"source": str(job.source), "entry": job.entry, "shape": shape, "written": [str(p) for p in written],
            "seconds": seconds, "peak_bytes": peak, "plan": {**plan.to_dict(), "mode": "band", "world": world},
            "retries": [], "rank": rank, "mode": "band", "index": index}
