"""GroupNorm statistics of an activation that no single call sees whole.

A tiled decode computes an activation tile by tile on one GPU; a band-parallel decode computes one band per rank.
Either way the GroupNorm that reads it needs the statistics of the whole activation, which parts give exactly: each
part's (count, mean, M2) merge by Chan et al.'s parallel rule (`chan_merge`, in fp64 where the device has it). The
parts are the tiles this GPU computed (`Moments.add`), or every rank's band in a band-parallel decode
(`GroupNormer` with reduce = vaeopt.engine.halo.BandComm.merge_moments, an all-gather over torch.distributed). The
Triton path keeps a tiled decode's partials in the kernel's own layout (`KernelStats`) and merges them in one finalize
launch, as the untiled fused kernel does. Both decodes apply the norm the same way (`norm_scale`, `affine_act`).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vaeopt.stages import fused_norms, unhooked

# Parts of one activation: (count, per-channel or per-group mean, M2).
Part = tuple[int, torch.Tensor, torch.Tensor]


def gn_kernels():
    """vaeopt.kernels.group_norm_silu, imported where the kernel path runs (it imports Triton; the package exports a
    function of the same name, hence import_module)."""
    return importlib.import_module("vaeopt.kernels.group_norm_silu")


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


def norm_scale(n: int, mean_g: torch.Tensor, m2_g: torch.Tensor, norm: nn.Module, channels: int,
               xb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean_c, scale_c, beta_c), (C,) in the statistics' dtype: GroupNorm(x)_c = (x_c - mean_c) * scale_c + beta_c.
    The moments are those of x + xb[c] when x still owes a bias xb: its normalized value is then the same map of x
    with xb taken off the mean ((x + xb - mean) * a + b == (x - (mean - xb)) * a + b)."""
    g = mean_g.numel()
    cg = channels // g
    rstd = torch.rsqrt(m2_g / n + float(norm.eps))  # biased variance, as nn.GroupNorm
    dt = rstd.dtype
    w = norm.weight.detach().to(device=rstd.device, dtype=dt) if norm.weight is not None else \
        torch.ones(channels, dtype=dt, device=rstd.device)
    b = norm.bias.detach().to(device=rstd.device, dtype=dt) if norm.bias is not None else \
        torch.zeros(channels, dtype=dt, device=rstd.device)
    mean_c = mean_g.repeat_interleave(cg)
    if xb is not None:
        mean_c = mean_c - xb.detach().to(dt)
    return mean_c, rstd.repeat_interleave(cg) * w, b


def norm_affine(n: int, mean_g: torch.Tensor, m2_g: torch.Tensor, norm: nn.Module, channels: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_c, shift_c), (C,) in the statistics' dtype, with GroupNorm(x)_c = x_c * scale_c + shift_c."""
    mean_c, scale, b = norm_scale(n, mean_g, m2_g, norm, channels)
    return scale, b - mean_c * scale


def affine_act(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, norm: nn.Module, nonlin: nn.Module | None
               ) -> torch.Tensor:
    """The torch path's GroupNorm apply: x * scale + shift in fp32 (shift, scale: fp32, broadcastable to x), one
    cast to x's dtype, then the norm's own SiLU (a fused GroupNorm+SiLU module, stages/fused_norms.py) and the
    model's nonlinearity. Always a fresh tensor (never a view of a stored activation)."""
    y = torch.addcmul(shift, x, scale)  # fp32 (promoted), one pass
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if getattr(norm, "silu", False) is True:
        y = F.silu(y, inplace=True)
    if nonlin is None or (type(nonlin) is nn.Identity and unhooked(nonlin)):
        return y
    if type(nonlin) is nn.SiLU and unhooked(nonlin):
        return F.silu(y, inplace=True)
    return nonlin(y)


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
            if len(self.parts) > 1:
                self.parts = [torch.cat(self.parts, dim=2)]
            self._affine[key] = gn_kernels().group_norm_finalize(self.parts[0], self.groups, self.c, norm.weight,
                                                                 float(norm.eps))
        return self._affine[key]


OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {e for e in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if e}
)


def part_moments(x: torch.Tensor, groups: int, xb: torch.Tensor | None = None, kernel: bool = False) -> Part:
    """Per-group (count, mean, M2) of x (+ xb[c]) for x (1, C, ...): the GroupNorm statistics kernel's chunk partials
    (one read of x, the owed bias added on load) merged in fp64, or per-channel torch moments merged into groups."""
    if kernel:
        K = gn_kernels()
        _n, mean_g, m2_g = K.merge_partials(K.group_norm_partials(x, groups, x_bias=xb))
        return x.numel() // groups, mean_g, m2_g
    return group_moments(*channel_moments(x, xb), groups)


class GroupNormer:
    """GroupNorm (+ the model's nonlinearity) of one part of an activation -- a rank's band -- with the statistics
    of the whole: the part's per-group moments go through `reduce` ((count, mean, M2) of the part -> of the whole;
    vaeopt.engine.halo.BandComm.merge_moments all-gathers them across the ranks), then one apply. `xb`: a bias the
    part still owes (its conv ran without it), normalized as x + xb[c] without materializing it. `kernels`: the
    Triton statistics / apply kernels (None: on CUDA when they can run, True: required, False: torch ops); a kernel
    failure that is not an OOM falls back to torch ops with a note, unless they were required."""

    def __init__(self, reduce: Callable[[int, torch.Tensor, torch.Tensor], Part], kernels: bool | None,
                 notes: list[str], error: type[Exception] = RuntimeError):
        self.reduce = reduce
        self.kernels = kernels
        self.notes = notes
        self.error = error
        self._broken = False

    def use_kernels(self, x: torch.Tensor) -> bool:
        if self.kernels is False or self._broken:
            return False
        ok = fused_norms.use_kernel(x)
        if self.kernels is None:
            return ok and x.is_cuda
        if not ok:
            raise self.error("kernels=True, but the Triton GroupNorm kernels cannot run for this tensor")
        return True

    def fallback(self, e: BaseException) -> None:
        if self.kernels or isinstance(e, OOM_ERRORS):  # required kernels, or out of memory (torch ops need more)
            raise e
        self._broken = True
        self.notes.append(f"Triton kernels failed ({type(e).__name__}: {e}); using torch ops")

    def __call__(self, x: torch.Tensor, norm: nn.Module, nonlin: nn.Module | None, xb: torch.Tensor | None = None
                 ) -> torch.Tensor:
        G, C = int(norm.num_groups), x.shape[1]
        part = None
        if self.use_kernels(x):
            try:
                part = part_moments(x, G, xb, kernel=True)
            except Exception as e:  # noqa: BLE001 - a kernel API drift must not kill the decode
                self.fallback(e)
        n, mean_g, m2_g = self.reduce(*(part or part_moments(x, G, xb)))
        mean_c, a_c, b = norm_scale(n, mean_g, m2_g, norm, C, xb)
        if self.use_kernels(x):
            plain_silu = nonlin is not None and type(nonlin) is nn.SiLU and unhooked(nonlin)
            try:
                y = gn_kernels().group_norm_apply(x, mean_c.float(), a_c.float(), b.to(x.device, torch.float32),
                                     getattr(norm, "silu", False) is True or plain_silu)
                skip = plain_silu or nonlin is None or (type(nonlin) is nn.Identity and unhooked(nonlin))
                return y if skip else nonlin(y)  # (a hooked Identity runs, as on the torch path)
            except Exception as e:  # noqa: BLE001
                self.fallback(e)
        f = dict(dtype=torch.float32, device=x.device)
        shape = (1, C) + (1,) * (x.dim() - 2)
        return affine_act(x, (b - mean_c * a_c).to(**f).view(shape), a_c.to(**f).view(shape), norm, nonlin)
