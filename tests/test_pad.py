"""vaeopt.engine.pad against F.pad: replicate / reflect / zeros, both layouts, the shapes the stream decoder pads
(one frame, several, time padding in front only or on both sides) and odd ones."""

import pytest
import torch
import torch.nn.functional as F

from vaeopt.engine import pad as P

SHAPES = [
    (1, 8, 1, 6, 10),  # one frame (a chunk of one latent frame, or an image-like clip)
    (1, 8, 5, 6, 10),  # several frames
    (2, 3, 3, 7, 5),  # two samples, odd H/W, channels not a multiple of 8
    (1, 1, 2, 2, 3),  # one channel, the smallest H/W a reflect pad of 1 allows
    (1, 5, 4, 11, 13),  # primes
]
PADS = [
    (1, 1, 1, 1, 0, 0),  # a 3x3 conv's spatial padding (LTX-2's reflect, the chunk history already in time)
    (1, 1, 1, 1, 2, 0),  # HunyuanVideo 1.5's causal padding: two frames in front
    (1, 1, 1, 1, 1, 1),  # LTX-2's non-causal: one frame each side
    (0, 0, 0, 0, 1, 0),  # time only
    (2, 1, 0, 2, 0, 0),  # uneven
    (1, 1, 1, 1),  # 4 pads (H, W)
]
MODES = ["replicate", "reflect", "constant"]


def _ref(x, pads, mode):
    pads = tuple(pads) + (0,) * (6 - len(pads))  # (F.pad's 5D replicate/reflect takes all three dims' pads)
    try:
        return F.pad(x, pads, mode=mode)
    except (RuntimeError, NotImplementedError, ValueError):
        return None


@pytest.mark.parametrize("cl", [False, True], ids=["ncdhw", "ndhwc"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pad_equals_f_pad(shape, mode, cl):
    g = torch.Generator().manual_seed(sum(shape) * 10 + MODES.index(mode))
    x = torch.randn(shape, generator=g)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    checked = 0
    for pads in PADS:
        ref = _ref(x, pads, mode)
        if ref is None:  # F.pad refuses it (reflect wider than the dim): so does pad, with a one-line reason
            with pytest.raises(ValueError):
                P.pad(x, pads, mode)
            continue
        y = P.pad(x, pads, mode)
        assert torch.equal(y, ref), (pads, mode)
        # the layout follows x (or the one asked for): the conv reading it needs no relayout
        assert y.is_contiguous(memory_format=torch.channels_last_3d if cl else torch.contiguous_format)
        other = torch.contiguous_format if cl else torch.channels_last_3d
        z = P.pad(x, pads, mode, memory_format=other)
        assert torch.equal(z, ref) and z.is_contiguous(memory_format=other)
        checked += 1
    assert checked >= 3  # (one frame: reflect refuses every time padding)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pad_is_a_copy_in_low_precision(dtype):
    x = torch.randn(1, 4, 3, 5, 6).to(dtype)
    for mode in MODES:
        assert torch.equal(P.pad(x, (1, 1, 1, 1, 2, 0), mode), F.pad(x, (1, 1, 1, 1, 2, 0), mode=mode))


def test_producer_writes_the_interior():
    """padded_empty's interior view is where a producer (a norm kernel's out=) writes; fill_borders then gives F.pad's
    borders without a copy of the data."""
    x = torch.randn(1, 6, 3, 5, 7)
    for mf in (torch.contiguous_format, torch.channels_last_3d):
        buf, inner = P.padded_empty(tuple(x.shape), (1, 1, 1, 1), x, mf)
        assert inner.shape == x.shape and inner.data_ptr() != buf.data_ptr()
        inner.copy_(x)
        assert torch.equal(P.fill_borders(buf, (1, 1, 1, 1), "reflect"), F.pad(x, (1, 1, 1, 1, 0, 0), mode="reflect"))


def test_bad_pads_are_one_line_errors():
    x = torch.randn(1, 2, 1, 3, 3)
    with pytest.raises(ValueError, match="mode"):
        P.pad(x, (1, 1), "circularish")
    with pytest.raises(ValueError, match="reflect padding 1"):
        P.pad(x, (0, 0, 0, 0, 1, 0), "reflect")  # one frame cannot be mirrored
    with pytest.raises(ValueError, match="negative"):
        P.pad(x, (-1, 0), "replicate")
    with pytest.raises(ValueError, match="pairs"):
        P.pad(x, (1, 1, 1), "replicate")
