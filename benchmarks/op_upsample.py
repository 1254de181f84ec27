"""An image decoder's upsamplers (2x nearest + 3x3 conv) at a workload's shapes: the stock composition against
vaeopt's four 2x2 phase convs on the low-resolution input, per call (CUDA graph of 10 calls), with TFLOP/s of the
stock conv's work.

    python benchmarks/op_upsample.py --workload sdxl-1024

Variants: torch (F.interpolate + F.conv2d, channels-last: what the decoder runs without the stage), vaeopt
(kernels/upconv.upconv2x: cuDNN's 2x2 conv with 4*Cout channels + the Triton interleave, as the upsample_conv stage).
"""

import torch.nn.functional as F

import harness as H

VARIANTS = ("torch", "vaeopt")


def items(ctx):
    return [(f"upsample {tuple(s)}", s) for _, s, _ in H.layer_inputs(ctx, ("Upsample2D",))]


def setup(variant, shape, ctx):
    from vaeopt.kernels.upconv import phase_weights, upconv2x

    C = shape[1]
    x = H.randn(shape, 1, ctx.device, ctx.dtype, channels_last=True)
    w = H.randn((C, C, 3, 3), 2, ctx.device, ctx.dtype) * (C * 9) ** -0.5
    b = H.randn((C,), 3, ctx.device, ctx.dtype)
    flops = 2 * shape[0] * 4 * shape[2] * shape[3] * C * C * 9

    def ref():
        return F.conv2d(F.interpolate(x.float(), scale_factor=2, mode="nearest"), w.float(), b.float(), padding=1)

    if variant == "torch":
        return H.Case(lambda: F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), w, b, padding=1), ref,
                      flops=flops, graph=True)
    w4 = phase_weights(w)
    return H.Case(lambda: upconv2x(x, w4, b), ref, flops=flops, graph=True)


if __name__ == "__main__":
    H.main("op_upsample")
