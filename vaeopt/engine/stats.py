"""GroupNorm statistics of an activation that no single call sees whole.

A tiled decode computes an activation tile by tile on one GPU; a band-parallel decode computes one band per rank.
Either way the GroupNorm that reads it needs the statistics of the whole activation, which parts give exactly: each
part's (count, mean, M2) merge by Chan et al.'s parallel rule (`chan_merge`, in fp64 where the device has it). The
parts are the tiles this GPU computed (`Moments.add`), or every rank's band in a band-parallel decode (an
all-gather over torch.distributed: vaeopt.engine.halo.BandComm.merge_moments). The Triton path keeps its partials in
the kernel's own layout (`KernelStats`) and merges them in one finalize launch, as the untiled fused kernel does.
"""

from __future__ import annotations

import torch
from torch import nn

# Parts of one activation: (count, per-channel or per-group mean, M2).
Part = tuple[int, torch.Tensor, torch.Tensor]


def stats_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # (MPS has no fp64)


def chan_merge(n: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parts stacked along dim 0 (n broadcastable to mean: (k, 1) or (k,)) -> (count, mean, M2) of their union
    (Chan, Golub & LeVeque): mean = sum(n_i mean_i) / n, M2 = sum(M2_i) + sum(n_i (mean_i - mean)^2)."""
    total = n.sum(0)
    mu = (n * mean).sum(0) / total
    return total, mu, m2.sum(0) + (n * (mean - mu) ** 2).sum(0)


def channel_moments(x: torch.Tensor, xb: torch.Tensor | None = None) -> Part:
    """(count, mean, M2) per channel of x (+ xb[c]) for x (N, C, ...), in fp32. Two passes (mean, then the sum of
    squared deviations) on the CPU, where that is 6x faster than var_mean's Welford and as exact; Welford on GPUs."""
    C = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    n = x.numel() // C
    bshape = (1, -1) + (1,) * (x.dim() - 2)
    xf = x.float() if xb is None else x.float() + xb.float().view(bshape)
    if x.device.type == "cpu":
        mean = xf.mean(dim=dims)
        return n, mean, torch.linalg.vector_norm(xf - mean.view(bshape), 2, dim=dims).square_()
    var, mean = torch.var_mean(xf, dim=dims, correction=0)
    return n, mean, var * n


def group_moments(n_c: int, mean_c: torch.Tensor, m2_c: torch.Tensor, groups: int) -> Part:
    """Per-channel moments (all channels have count n_c) -> per-group ones: the channels of a group are parts."""
    dt = stats_dtype(mean_c.device)
    cg = mean_c.numel() // groups
    counts = torch.full((cg, 1), float(n_c), dtype=dt, device=mean_c.device)
    n, mean, m2 = chan_merge(counts, mean_c.to(dt).view(groups, cg).t(), m2_c.to(dt).view(groups, cg).t())
    return n_c * cg, mean, m2


def norm_affine(n: int, mean_g: torch.Tensor, m2_g: torch.Tensor, norm: nn.Module, channels: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_c, shift_c), (C,) in the statistics' dtype, with GroupNorm(x)_c = x_c * scale_c + shift_c."""
    g = mean_g.numel()
    cg = channels // g
    rstd = torch.rsqrt(m2_g / n + float(norm.eps))  # biased variance, as nn.GroupNorm
    dt = rstd.dtype
    w = norm.weight.detach().to(device=rstd.device, dtype=dt) if norm.weight is not None else \
        torch.ones(channels, dtype=dt, device=rstd.device)
    b = norm.bias.detach().to(device=rstd.device, dtype=dt) if norm.bias is not None else \
        torch.zeros(channels, dtype=dt, device=rstd.device)
    scale = rstd.repeat_interleave(cg) * w
    return scale, b - mean_g.repeat_interleave(cg) * scale


class Moments:
    """Torch path: per-channel (count, mean, M2) of one activation, merged from its tiles as they come (`add`).
    Per-channel moments give per-group ones for any `num_groups` at `affine`. (A band-parallel decode merges each
    norm's per-group moments across the ranks the same way: vaeopt.engine.halo.BandComm.merge_moments.)"""

    def __init__(self, channels: int, device: torch.device):
        self.dt = stats_dtype(device)
        self.n = 0
        self.mean = torch.zeros(channels, dtype=self.dt, device=device)
        self.m2 = torch.zeros(channels, dtype=self.dt, device=device)
        self._affine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    of_tile = staticmethod(channel_moments)

    def add(self, part: Part | None) -> None:
        if part is None or part[0] == 0:
            return
        nb, mb, m2b = part
        if self.n == 0:
            self.n, self.mean, self.m2 = nb, mb.to(self.dt), m2b.to(self.dt)
            self._affine.clear()
            return
        n = torch.tensor([[float(self.n)], [float(nb)]], dtype=self.dt, device=self.mean.device)
        _, self.mean, self.m2 = chan_merge(n, torch.stack([self.mean, mb.to(self.dt)]),
                                               torch.stack([self.m2, m2b.to(self.dt)]))
        self.n += nb
        self._affine.clear()

    def affine(self, norm: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift_c, scale_c) as (1, C, 1, 1) fp32 tensors such that GroupNorm(x)_c = x_c * scale_c + shift_c with
        the statistics of the whole activation."""
        key = id(norm)
        if key not in self._affine:
            c = self.mean.numel()
            ng, mean_g, m2_g = group_moments(self.n, self.mean, self.m2, int(norm.num_groups))
            scale, shift = norm_affine(ng, mean_g, m2_g, norm, c)
            f = dict(dtype=torch.float32, device=device)
            self._affine[key] = (shift.view(1, c, 1, 1).to(**f), scale.view(1, c, 1, 1).to(**f))
        return self._affine[key]


class KernelStats:
    """Kernel path: the ``group_norm_partials`` of every tile of one activation (for the one norm that will read it).
    Concatenated, they are the partials of the whole activation; ``affine`` merges them exactly in one finalize
    launch (fp32 Chan merge, as the untiled fused kernel does)."""

    def __init__(self, channels: int, groups: int):
        self.c, self.groups = channels, groups
        self.parts: list[torch.Tensor] = []
        self._affine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, part: torch.Tensor | list[torch.Tensor] | None) -> None:
        if part is not None:
            self.parts.extend(part if isinstance(part, list) else [part])
            self._affine.clear()

    def affine(self, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, scale) as (1, C) fp32: the group mean of (stored value + pending bias) and rstd * weight."""
        key = id(norm)
        if key not in self._affine:
            if int(norm.num_groups) != self.groups or not self.parts:
                raise RuntimeError(f"tiling: statistics for {self.groups} groups, norm wants {norm.num_groups}")
            from vaeopt.kernels.group_norm_silu import group_norm_finalize  # (imports Triton)

            if len(self.parts) > 1:
                self.parts = [torch.cat(self.parts, dim=2)]
            self._affine[key] = group_norm_finalize(self.parts[0], self.groups, self.c, norm.weight, float(norm.eps))
        return self._affine[key]
