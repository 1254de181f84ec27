"""The mid-block attention core of an image decoder at a workload's size (one head, head_dim = the block's channels,
one query per latent pixel): torch's SDPA against vaeopt's chunked attention, per call, with TFLOP/s.

    python benchmarks/op_attention.py --workload sdxl-1024

Variants: sdpa (F.scaled_dot_product_attention, the backend torch picks: what diffusers' AttnProcessor2_0 runs),
vaeopt (stages/fused_epilogues.chunked_attention: GEMM scores in fp32 query chunks, the Triton softmax, GEMM).
"""

import torch.nn.functional as F

import harness as H

VARIANTS = ("sdpa", "vaeopt")


def items(ctx):
    shapes = [s for _, s, _ in H.layer_inputs(ctx, ("Attention",)) if len(s) == 4]
    if not shapes:
        raise SystemExit(f"op_attention: no 2D mid-block attention in {ctx.workload}'s decoder")
    return [(f"attention L={s[2] * s[3]} d={s[1]}", (s[0], 1, s[2] * s[3], s[1])) for s in shapes]


def setup(variant, shape, ctx):
    from vaeopt.stages.fused_epilogues import chunked_attention

    q, k, v = (H.randn(shape, seed, ctx.device, ctx.dtype) for seed in (1, 2, 3))
    flops = 4 * shape[0] * shape[1] * shape[2] ** 2 * shape[3]

    def ref():
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float())

    if variant == "sdpa":
        return H.Case(lambda: F.scaled_dot_product_attention(q, k, v), ref, flops=flops, graph=True)
    return H.Case(lambda: chunked_attention(q, k, v), ref, flops=flops, graph=True)


if __name__ == "__main__":
    H.main("op_attention")
