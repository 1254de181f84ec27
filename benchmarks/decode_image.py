"""Whole image decodes of a workload: diffusers' own decode against vaeopt's pipeline as `vaeopt decode` runs it.

    python benchmarks/decode_image.py --workload sdxl-1024 [--variants diffusers,vaeopt,graphs,fp8]
    python benchmarks/decode_image.py --workload sdxl-4096 --variants vaeopt,tiled --vram-budget 8

Variants: diffusers (vae.decode, the dtype's eager decode), vaeopt (every default stage, CUDA graphs off), graphs
(+ CUDA graphs), fp8 (+ FP8 at the --fp8-gate), tiled (the planner's exact tiles within --vram-budget). vaeopt's
rows are timed by the pipeline's own clock (DecodeStats.seconds: launch to last kernel, not the copy to the host).
"""

import torch

import harness as H

VARIANTS = ("diffusers", "vaeopt", "graphs", "fp8", "tiled")
OPTIONS = {"vaeopt": dict(graphs="off", tiling="off"), "graphs": dict(graphs="on", tiling="off"),
           "fp8": dict(graphs="on", tiling="off", fp8="on"), "tiled": dict(graphs="off", tiling="on")}
add_args = H.decode_args
items = H.decode_items(video=False)


def setup(variant, shape, ctx):
    flops, z = ctx.flops(), ctx.latent()

    def reference():
        return ctx.model(torch.float32).decode(z.float()).sample

    if variant == "diffusers":
        model = ctx.model()
        return H.Case(lambda: model.decode(z).sample, reference, image=True, flops=flops)
    pipe, plan = H.pipeline_plan(ctx, OPTIONS[variant], shape)
    if variant in ("graphs", "fp8"):
        pipe.setup_graphs(plan, tuple(shape), 99, chunks=False, reason="benchmark repeats")
        if pipe.graphed is None:
            raise H.Skip("CUDA graphs: " + next(s.text() for s in pipe.stages if s.name == "graphs"))
    if variant == "fp8" and not any(s.name == "fp8 convs" and s.status == "applied" for s in pipe.stages):
        raise H.Skip("FP8 level 3 did not run: " + "; ".join(f"{s.name}: {s.text()}" for s in pipe.stages
                                                             if s.name.startswith("fp8")))
    return H.pipeline_case(pipe, plan, z, reference, flops)


if __name__ == "__main__":
    H.main("decode_image")
