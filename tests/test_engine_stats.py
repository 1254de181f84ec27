"""vaeopt.engine.stats: the GroupNorm statistics of a part of an activation (a rank's band) and the norm applied
with the statistics of the whole, on the Triton kernels (the interpreter on CPU) and in torch ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vaeopt.engine.stats import GroupNormer, chan_merge, part_moments


def _triton_ok() -> bool:
    from vaeopt.kernels import triton_available

    return triton_available("cpu")[0]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_triton_statistics_and_apply_match_torch(layout):
    """The GroupNorm pieces of the GPU path, on the Triton interpreter: band moments (with an owed bias) and the
    apply with given statistics == the torch ops."""
    if not _triton_ok():
        pytest.skip("triton (interpreter) not available")
    from vaeopt.kernels.group_norm_silu import group_norm_apply

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 32, 7, 9, generator=g) * 3 + 1
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    xb = torch.randn(32, generator=g)
    n0, m0, v0 = part_moments(x, 8, xb)
    mean_c, a_c, b = torch.randn(32, generator=g), torch.rand(32, generator=g) + 0.5, torch.randn(32, generator=g)
    ref = torch.nn.functional.silu((x - mean_c.view(1, -1, 1, 1)) * a_c.view(1, -1, 1, 1) + b.view(1, -1, 1, 1))
    n, m, v = part_moments(x, 8, xb, kernel=True)
    assert n == n0 == 7 * 9 * 4
    assert torch.allclose(m, m0, rtol=1e-6, atol=1e-6) and torch.allclose(v, v0, rtol=1e-5)
    y = group_norm_apply(x, mean_c, a_c, b, True)
    assert (y - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("kernels", [False, True])
def test_parts_reduced_to_the_whole_equal_group_norm(kernels):
    """Two row halves of one activation, each normalized with the statistics of both (the reduce merges the other
    half's moments in, as the all-gather across ranks does) == nn.GroupNorm + SiLU of the whole; with an owed bias."""
    if kernels and not _triton_ok():
        pytest.skip("triton (interpreter) not available")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 10, 6, generator=g) * 2 + 0.5
    xb = torch.randn(16, generator=g)
    norm = nn.GroupNorm(4, 16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
        norm.bias.copy_(torch.randn(16, generator=g))
        ref = torch.nn.functional.silu(norm(x + xb.view(1, -1, 1, 1)))
    halves = (x[:, :, :4], x[:, :, 4:])
    parts = [part_moments(h, 4, xb) for h in halves]

    def reduce_with(other):
        def reduce(n, mean, m2):
            po = parts[other]
            cnt = torch.tensor([[float(n)], [float(po[0])]], dtype=torch.float64)
            total, mu, M2 = chan_merge(cnt, torch.stack([mean.double(), po[1]]), torch.stack([m2.double(), po[2]]))
            return int(total[0]), mu, M2
        return reduce

    notes: list[str] = []
    ys = [GroupNormer(reduce_with(1 - i), kernels, notes)(h, norm, nn.SiLU(), xb) for i, h in enumerate(halves)]
    assert notes == []
    assert (torch.cat(ys, 2) - ref).abs().max().item() < 1e-5
