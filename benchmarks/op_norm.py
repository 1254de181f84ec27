"""The decoder's norms at a workload's shapes: GroupNorm + SiLU (image decoders) or Wan's RMS norm + SiLU, torch
against vaeopt's Triton kernels, per call (CUDA graph of 10 calls). GB/s counts one read of x and one write of y.

    python benchmarks/op_norm.py --workload sdxl-1024
    python benchmarks/op_norm.py --workload wan21-480p --chunk 3

Variants: torch (what diffusers runs: channels-first, F.group_norm / F.normalize, then SiLU), vaeopt (the fused
kernel on channels-last input, as the fused_norms stage calls it). Wan's shapes are those of one chunk of --chunk
latent frames (the first frame's smaller calls left out).
"""

import torch.nn.functional as F

import harness as H

VARIANTS = ("torch", "vaeopt")


def add_args(ap):
    ap.add_argument("--chunk", type=int, default=3, help="Wan: latent frames per decoder call")


def items(ctx):
    best = {}  # (kind, shape) -> the call; Wan: (kind, C, H, W) -> the chunk's call, the most frames
    for kind, shape, mod in H.layer_inputs(ctx, ("GroupNorm", "WanRMS_norm")):
        key = (kind, shape)
        if kind == "WanRMS_norm":
            if len(shape) != 5:  # (the mid-block attention's 2D norm)
                continue
            key, shape = (kind, shape[1], shape[3:]), (*shape[:2], shape[2] * ctx.args.chunk, *shape[3:])
            if key in best and best[key][1][2] >= shape[2]:
                continue
        best[key] = (kind, shape, getattr(mod, "num_groups", None), getattr(mod, "eps", 1e-6))
    return [(f"{k} {tuple(s)}", (k, s, g, e)) for k, s, g, e in best.values()]


def setup(variant, item, ctx):
    from vaeopt.kernels.group_norm_silu import group_norm_silu
    from vaeopt.kernels.rms_norm_silu import rms_norm_silu

    kind, shape, groups, eps = item
    C = shape[1]
    x = H.randn(shape, 1, ctx.device, ctx.dtype, channels_last=variant == "vaeopt")
    w, b = H.randn((C,), 2, ctx.device, ctx.dtype), H.randn((C,), 3, ctx.device, ctx.dtype)
    nbytes = 2 * x.numel() * x.element_size()
    if kind == "GroupNorm":
        def ref():
            return F.silu(F.group_norm(x.float(), groups, w.float(), b.float(), eps))

        fn = ((lambda: F.silu(F.group_norm(x, groups, w, b, eps))) if variant == "torch" else
              (lambda: group_norm_silu(x, groups, w, b, eps)))
        return H.Case(fn, ref, bytes=nbytes, graph=True)
    gamma = w.view(C, *([1] * (x.dim() - 2)))  # WanRMS_norm: F.normalize(x, dim=1) * sqrt(C) * gamma (+ bias 0)

    def ref():
        return F.silu(F.normalize(x.float(), dim=1) * C**0.5 * gamma.float())

    fn = ((lambda: F.silu(F.normalize(x, dim=1) * C**0.5 * gamma)) if variant == "torch" else
          (lambda: rms_norm_silu(x, w, None, scale=C**0.5)))
    return H.Case(fn, ref, bytes=nbytes, graph=True)


if __name__ == "__main__":
    H.main("op_norm")
