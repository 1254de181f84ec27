"""The padding of HunyuanVideo 1.5's / LTX-2's conv inputs at a workload's shapes (each distinct conv input of the
whole-clip decode): diffusers' ops against vaeopt's one buffer, per call. GB/s counts one read of x and one write of
the padded buffer for every variant, so the columns compare as times.

    python benchmarks/op_pad.py --workload ltx2-768
    python benchmarks/op_pad.py --workload hunyuan15-480p --variants torch,vaeopt,borders

Variants: torch (what diffusers runs: HunyuanVideo 1.5 F.pad(replicate) over time and space; LTX-2 torch.cat of the
edge frames, then the conv's reflect F.pad), vaeopt (engine.pad: one buffer, the interior copied, the borders filled
from its edge planes, as StreamDecoder.conv builds it), borders (the same without the interior copy: what is left
when the fused norm writes the interior itself), vaeopt_cl / borders_cl (the same in channels_last_3d).
"""

import torch
import torch.nn.functional as F

import harness as H

VARIANTS = ("torch", "vaeopt", "borders", "vaeopt_cl", "borders_cl")
_CONVS = ("LTX2VideoCausalConv3d", "HunyuanVideo15CausalConv3d")


def items(ctx):
    out = []
    for kind, shape, mod in H.layer_inputs(ctx, _CONVS):
        kt = mod.conv.kernel_size[0]
        if kind == "HunyuanVideo15CausalConv3d":
            p = mod.time_causal_padding
            pad = dict(space=tuple(p[:4]), smode=mod.pad_mode, front=p[4], back=p[5], tmode=mod.pad_mode)
        else:
            _, ph, pw = mod.conv.padding
            causal = bool(getattr(ctx.family, "config", {}).get("decoder_causal", False))
            front, back = (kt - 1, 0) if causal else ((kt - 1) // 2, (kt - 1) // 2)
            pad = dict(space=(pw, pw, ph, ph), smode=mod.conv.padding_mode, front=front, back=back,
                       tmode="replicate")
        if kt > 1:
            out.append((f"{kind[:4]} {tuple(shape)} {pad['smode']}", (tuple(shape), pad)))
    return out


def _torch(x, pad):
    """diffusers' padding ops for this conv."""
    s = pad["space"]
    if pad["tmode"] == pad["smode"]:  # HunyuanVideo 1.5: one F.pad over time and space
        return F.pad(x, (*s, pad["front"], pad["back"]), mode=pad["smode"])
    parts = [x[:, :, :1].repeat(1, 1, pad["front"], 1, 1)] if pad["front"] else []
    parts += [x] + ([x[:, :, -1:].repeat(1, 1, pad["back"], 1, 1)] if pad["back"] else [])
    return F.pad(torch.cat(parts, dim=2), (*s, 0, 0), mode=pad["smode"])


def _one_buffer(x, pad, buf=None, interior: bool = True):
    """StreamDecoder.conv's build: the interior (unless a producer wrote it), the spatial borders of the data frames,
    then the time padding as whole frames."""
    from vaeopt.engine.pad import fill_borders, padded_empty

    front, back, s = pad["front"], pad["back"], pad["space"]
    n = front + x.shape[2]
    if buf is None:
        mf = torch.channels_last_3d if x.is_contiguous(memory_format=torch.channels_last_3d) and not \
            x.is_contiguous() else torch.contiguous_format
        buf, inner = padded_empty((x.shape[0], x.shape[1], n + back, *x.shape[3:]), s, x, mf)
    else:
        inner = buf[(slice(None), slice(None), slice(None), slice(s[2], buf.shape[3] - s[3]),
                     slice(s[0], buf.shape[4] - s[1]))]
    if interior:
        inner[:, :, front:n].copy_(x)
    if any(s):
        fill_borders(buf[:, :, front:n], s, pad["smode"])
    if front or back:
        fill_borders(buf.movedim(2, -1), (front, back), pad["tmode"])
    return buf


def setup(variant, item, ctx):
    shape, pad = item
    x = H.randn(shape, 1, ctx.device, ctx.dtype, channels_last=variant.endswith("_cl"))
    T = shape[2] + pad["front"] + pad["back"]
    s = pad["space"]
    padded = shape[0] * shape[1] * T * (shape[3] + s[2] + s[3]) * (shape[4] + s[0] + s[1])
    nbytes = (x.numel() + padded) * x.element_size()

    def ref():
        return _torch(x.float(), pad)

    if variant == "torch":
        return H.Case(lambda: _torch(x, pad), ref, bytes=nbytes)
    if variant.startswith("vaeopt"):
        return H.Case(lambda: _one_buffer(x, pad), ref, bytes=nbytes)
    buf = _one_buffer(x, pad)  # the interior as the producer leaves it; each call fills the borders again
    return H.Case(lambda: _one_buffer(x, pad, buf, interior=False), ref, bytes=nbytes)


if __name__ == "__main__":
    H.main("op_pad")
