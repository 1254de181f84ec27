"""An image decoder's 3x3 convs at a workload's shapes: cuDNN against vaeopt's implicit-GEMM conv kernels, per call
(CUDA graph of 10 calls), with TFLOP/s.

    python benchmarks/op_conv.py --workload sdxl-1024 [--variants cudnn,vaeopt,vaeopt-e4m3]

Variants: cudnn (F.conv2d on channels-last input, with bias), vaeopt (kernels/conv.conv_igemm, bf16, on the TMA
kernel where that is available), vaeopt-e4m3 (the same kernel with e4m3 operands, the input quantized outside the
timed call, as the norm before it writes it in FP8 level 3). Wan's convs run time-stacked or on the TMA kernel inside
the chunk decoder: measure them in decode_video.py.
"""

import torch
import torch.nn.functional as F

import harness as H

VARIANTS = ("cudnn", "vaeopt", "vaeopt-e4m3")


def items(ctx):
    if ctx.family.cls_name != "AutoencoderKL":
        raise SystemExit(f"op_conv: the image decoders' Conv2d (AutoencoderKL workloads), not {ctx.family.cls_name}")
    return [(f"conv3x3 {tuple(s)} -> {m.out_channels}", (s, m.out_channels))
            for _, s, m in H.layer_inputs(ctx, ("Conv2d",)) if m.kernel_size == (3, 3) and s[1] >= 32]


def setup(variant, item, ctx):
    from vaeopt.kernels import conv as K

    shape, cout = item
    x = H.randn(shape, 1, ctx.device, ctx.dtype, channels_last=True)
    w = H.randn((cout, shape[1], 3, 3), 2, ctx.device, ctx.dtype) * (shape[1] * 9) ** -0.5
    b = H.randn((cout,), 3, ctx.device, ctx.dtype)
    flops = 2 * shape[0] * shape[2] * shape[3] * cout * shape[1] * 9

    def ref():
        return F.conv2d(x.float(), w.float(), b.float(), padding=1)

    if variant == "cudnn":
        return H.Case(lambda: F.conv2d(x, w, b, padding=1), ref, flops=flops, graph=True)
    if variant == "vaeopt":
        pw = K.pack_weight(w)
        return H.Case(lambda: K.conv_igemm(x, pw, b, (1, 1)), ref, flops=flops, graph=True)
    if ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device) < (8, 9):
        raise H.Skip("e4m3 needs FP8 tensor cores (sm_89 or newer)")
    pw8 = K.pack_weight(w, K.E4M3)
    xq, s = K.quantize_activation(x)
    return H.Case(lambda: K.conv_igemm(xq, pw8, b, (1, 1), x_scale=s), ref, flops=flops, graph=True)


if __name__ == "__main__":
    H.main("op_conv")
