"""Replicate / reflect / zero padding of 5D activations by filling a preallocated buffer's borders.

PyTorch's 3D pad kernels (`F.pad(..., mode="replicate" | "reflect")` on NCDHW, and nn.Conv3d's own
`padding_mode="reflect"`) compute an index per output element and run far below memory bandwidth: on an H200 they
took a third of an LTX-2 decode and a fifth of a HunyuanVideo 1.5 one. Padding is separable, so here it is
one buffer allocated at its padded size, the data copied into its interior (one strided copy, or nothing at all
when the producer writes there itself), and then each padded dim's thin borders copied from the edge planes of
what is already filled, innermost dim first: every border of a later dim then carries the earlier dims' borders,
which is exactly the corner values F.pad gives. The buffer may be in either layout (NCDHW or channels_last_3d), so
the conv that reads it needs no relayout.

Pads follow F.pad's order: (w_left, w_right, h_left, h_right, t_left, t_right), any even-length prefix.
"""

from __future__ import annotations

import torch
from torch import Tensor

MODES = ("replicate", "reflect", "constant", "zeros")


def padded_empty(shape: tuple[int, ...], pads: tuple[int, ...], like: Tensor,
                 memory_format: torch.memory_format = torch.contiguous_format) -> tuple[Tensor, Tensor]:
    """An uninitialized buffer of `shape` grown by `pads` (like's dtype and device), and the view of its interior
    (`shape`), where the caller (or a kernel's `out=`) writes the data before `fill_borders`."""
    shape = list(shape)
    nd = len(pads) // 2
    for i in range(nd):
        shape[-1 - i] += pads[2 * i] + pads[2 * i + 1]
    buf = torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=memory_format)
    return buf, buf[interior(buf, pads)]


def interior(buf: Tensor, pads: tuple[int, ...]) -> tuple[slice, ...]:
    """The index of buf's unpadded region."""
    idx = [slice(None)] * buf.dim()
    for i in range(len(pads) // 2):
        d = buf.dim() - 1 - i
        idx[d] = slice(pads[2 * i], buf.shape[d] - pads[2 * i + 1])
    return tuple(idx)


def _check(buf: Tensor, pads: tuple[int, ...], mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"pad mode {mode!r}: one of {', '.join(MODES)}")
    if len(pads) % 2 or len(pads) // 2 > buf.dim():
        raise ValueError(f"pads {tuple(pads)}: pairs for at most {buf.dim()} dims")
    for i in range(len(pads) // 2):
        left, right = pads[2 * i], pads[2 * i + 1]
        if left < 0 or right < 0:
            raise ValueError(f"pads {tuple(pads)}: negative padding (cropping) is not supported")
        inner = buf.shape[-1 - i] - left - right
        if (left or right) and inner < 1:
            raise ValueError(f"cannot pad an empty dim (pads {tuple(pads)}, shape {tuple(buf.shape)})")
        if mode == "reflect" and max(left, right) >= inner:
            raise ValueError(f"reflect padding {max(left, right)} needs more than {inner} values along the dim")


def fill_borders(buf: Tensor, pads: tuple[int, ...], mode: str = "replicate") -> Tensor:
    """Fill the borders of buf (whose interior holds the data) in place, as F.pad(interior, pads, mode) would have
    them; returns buf. Each border is a copy of one edge plane (replicate), of the mirrored planes (reflect), or zeros
    (constant / zeros)."""
    _check(buf, pads, mode)
    idx = list(interior(buf, pads))
    for i in range(len(pads) // 2):  # innermost dim first
        d = buf.dim() - 1 - i
        left, right, n = pads[2 * i], pads[2 * i + 1], buf.shape[d]

        def at(a: int, b: int) -> Tensor:  # planes a:b of dim d over the region filled so far
            idx[d] = slice(a, b)
            return buf[tuple(idx)]

        if mode in ("constant", "zeros"):
            if left:
                at(0, left).zero_()
            if right:
                at(n - right, n).zero_()
        elif mode == "replicate":  # plane by plane: source and destination then have the same strides, which on
            # CUDA is a vectorized copy (a whole frame in NDHWC), not the generic strided kernel an expand needs
            for j in range(left):
                at(j, j + 1).copy_(at(left, left + 1))
            for j in range(n - right, n):
                at(j, j + 1).copy_(at(n - right - 1, n - right))
        else:  # reflect: plane left - j <- left + j, plane n - right - 1 + j <- n - right - 1 - j (1 plane each)
            for j in range(1, left + 1):
                at(left - j, left - j + 1).copy_(at(left + j, left + j + 1))
            for j in range(1, right + 1):
                at(n - right - 1 + j, n - right + j).copy_(at(n - right - 1 - j, n - right - j))
        idx[d] = slice(None)  # the later (outer) dims' borders span this dim's borders too
    return buf


def pad(x: Tensor, pads: tuple[int, ...], mode: str = "replicate",
        memory_format: torch.memory_format | None = None) -> Tensor:
    """F.pad(x, pads, mode) for a 5D x (or any dims), as one buffer: the interior copied once, then the borders.
    memory_format: the result's layout (default: channels_last_3d where x is in it, else contiguous)."""
    if memory_format is None:
        memory_format = (torch.channels_last_3d if x.dim() == 5 and not x.is_contiguous()
                         and x.is_contiguous(memory_format=torch.channels_last_3d) else torch.contiguous_format)
    buf, inner = padded_empty(tuple(x.shape), tuple(pads), x, memory_format)
    _check(buf, tuple(pads), mode)
    inner.copy_(x)
    return fill_borders(buf, tuple(pads), mode)
