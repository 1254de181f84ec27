"""Halo rows from the neighbour ranks: the band-parallel decodes' halo source.

A rank owns rows [a, b) of the latent (band_rows) and `s` times those at a layer running at `s` times the latent
resolution. A radius-1 conv on a band is exact except on its first and last rows, which saw the conv's zero padding
where a neighbour's row belongs: the boundary rows of the conv's input go to the neighbours (one row each way,
isend / irecv over torch.distributed, overlapped with the band's own conv), and the edge rows are then completed
(`add_halo`: what the received row adds through the kernel's first / last row; `fix_edges`: recomputed from 3-row
slabs). The same communicator merges GroupNorm statistics across the ranks (vaeopt.engine.stats.chan_merge) and
gathers bands. A single-GPU tiled decode gets its halos by cropping a stored activation instead
(vaeopt.engine.regions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from vaeopt.engine.stats import chan_merge, stats_dtype
from vaeopt.engine.wan_ops import plain_conv2d
from vaeopt.errors import DistributedError
from vaeopt.stages import cached_weight



def band_rows(h: int, world: int) -> list[tuple[int, int]]:
    """Latent rows [a, b) of each rank's band: as equal as integers allow (sizes differ by at most one)."""
    return [(r * h // world, (r + 1) * h // world) for r in range(world)]


class BandComm:
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
    def exchange_start(self, x: Tensor, dim: int) -> "PendingRows":
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
        return PendingRows(self._p2p(ops), top, bot, keep)

    def conv2d(self, conv: nn.Module, y: Tensor, bias: bool = True) -> Tensor:
        """conv(y) for an image band y (N, C, h, W), exact at the band's edges: a 3x3 conv's boundary input rows go
        to the neighbours while the band's own conv runs, then its first / last output rows are recomputed from
        3-row slabs (fix_edges); a 1x1 conv needs no halo. bias=False: a plain nn.Conv2d (plain_same_conv2d) run
        without its bias (the caller owes it)."""
        kh, kw = kernel_hw(conv)
        main = conv if bias else (
            lambda t: F.conv2d(t, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups))
        if kh == 1:
            return main(y)
        if kh != 3:
            raise DistributedError(f"{type(conv).__name__}: band decoding handles 1x1 and 3x3 convs, not {kh}x{kw}")
        pend = self.exchange_start(y, 2)
        out = main(y)
        if out.shape[-2:] != y.shape[-2:]:
            raise DistributedError(f"{type(conv).__name__}: band decoding needs size-preserving convolutions")
        top, bot = pend.wait()
        fix_edges(y, top, bot, out, conv2d_rows(conv, bias), 2)
        return out

    # -- exact GroupNorm statistics ----------------------------------------------------------------------------
    def merge_moments(self, n_local: int, mean: Tensor, m2: Tensor) -> tuple[int, Tensor, Tensor]:
        """(count, mean[G], M2[G]) of this rank's band -> those of the whole activation (fp64 where the device has
        it), identical on every rank. One all_gather of 2G values per rank; counts are known on every host."""
        dt = stats_dtype(mean.device)
        mine = torch.cat([mean.to(dt), m2.to(dt)])
        self.counts["stat_merges"] += 1
        if self.world == 1:
            return n_local, mean.to(dt), m2.to(dt)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        allp = torch.stack(parts)  # (R, 2G)
        G = mean.numel()
        per = n_local // (self.b - self.a)  # elements per latent row of the band (same on every rank)
        key = (allp.device, dt)
        if key not in self._rows:  # once: a host->device copy would otherwise stall the host at every norm
            self._rows[key] = torch.tensor([b - a for a, b in self.bands], dtype=dt, device=allp.device).view(-1, 1)
        _, mu, M2 = chan_merge(self._rows[key] * per, allp[:, :G], allp[:, G:])  # each rank's band is a part
        return per * self.bands[-1][1], mu, M2

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
class PendingRows:
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


def fix_edges(inp: Tensor, top: Tensor | None, bot: Tensor | None, out: Tensor, conv_rows: Callable,
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


def add_halo(top: Tensor | None, bot: Tensor | None, out: Tensor, halo: Callable, dim: int) -> None:
    """out's first / last row (along `dim`) of a radius-1 conv that ran on the band with zero padding, completed by
    what the neighbours' rows add: halo(row, 0) is the conv of the row above the band with the kernel's first row
    only (no bias), halo(row, 2) that of the row below with its last row. The conv is linear, so this is the row
    over the 3-row slab, summed in two parts (a one-row band gets both)."""
    if top is not None:
        out.narrow(dim, 0, 1).add_(halo(top, 0))
    if bot is not None:
        out.narrow(dim, out.shape[dim] - 1, 1).add_(halo(bot, 2))


def halo_weight(conv: nn.Module, w: Tensor, i: int, dim: int) -> Tensor:
    """Kernel row i (along the weight's H dim `dim`) of w, a weight derived from conv's, dense in w's layout; cached
    on conv per weight version (stages.cached_weight)."""
    def make() -> Tensor:
        r = w.detach().narrow(dim, i, 1)
        fmt = torch.contiguous_format
        if w.stride(1) == 1 and w.shape[1] > 1:
            fmt = torch.channels_last_3d if w.dim() == 5 else torch.channels_last
        return r.contiguous(memory_format=fmt)

    return cached_weight(conv, f"_vaeopt_halo_w{i}_{w.dim()}d", w.dtype, make)


def plain_same_conv2d(m: nn.Module) -> bool:
    # video's test, plus what recomputing edge rows from 3-row slabs needs: stride 1, no dilation, "same" padding
    return (plain_conv2d(m) and tuple(m.stride) == (1, 1) and tuple(m.dilation) == (1, 1)
            and tuple(m.padding) == (m.kernel_size[0] // 2, m.kernel_size[1] // 2))


def conv2d_rows(conv: nn.Module, bias: bool = True) -> Callable[[Tensor], Tensor]:
    """slab (N, C, 3, W) -> the conv's output row for the slab's middle row (N, C', 1, W) (without the bias of a plain
    conv if not `bias`)."""
    if plain_same_conv2d(conv):
        pw = conv.kernel_size[1] // 2
        return lambda s: F.conv2d(s, conv.weight, conv.bias if bias else None, 1, (0, pw), 1, conv.groups)
    return lambda s: conv(s).narrow(2, 1, 1)  # any size-preserving module: its own padding, middle row


def kernel_hw(conv: nn.Module) -> tuple[int, int]:
    k = getattr(conv, "kernel_size", None)
    if k is None:
        w = getattr(conv, "weight", None)
        if w is None:
            raise DistributedError(f"{type(conv).__name__}: cannot tell its kernel size for the halo exchange")
        k = tuple(w.shape[2:])
    k = tuple(k) if isinstance(k, (tuple, list)) else (k, k)
    return int(k[-2]), int(k[-1])
