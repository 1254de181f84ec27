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


def add_args(ap):
    ap.add_argument("--vram-budget", type=float, default=8.0, help="GB, for the tiled variant")
    ap.add_argument("--fp8-gate", type=float, default=40.0, help="dB, for the fp8 variant")


def items(ctx):
    if ctx.family.is_video:
        raise SystemExit(f"{ctx.workload} is a video workload: decode_video.py")
    return [(f"{ctx.workload} {tuple(ctx.shape)}", ctx.shape)]


def setup(variant, shape, ctx):
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    flops, z = ctx.flops(), ctx.latent()

    def reference():
        return ctx.model(torch.float32).decode(z.float()).sample

    if variant == "diffusers":
        model = ctx.model()
        return H.Case(lambda: model.decode(z).sample, reference, image=True, flops=flops)
    opts = dict(OPTIONS[variant], device=str(ctx.device), dtype=ctx.dtype_name, decode_shape=tuple(shape))
    if variant == "tiled":
        opts["vram_budget_gb"] = ctx.args.vram_budget
    if variant == "fp8":
        opts["gate_db"] = ctx.args.fp8_gate
    loaded = LoadedVAE(ctx.model(torch.float32), ctx.family, "benchmark", None, [], None)
    pipe = Pipeline(loaded, Options(**opts), log=lambda s: None)
    plan = pipe.plan(tuple(shape))
    if variant == "tiled" and plan.mode != "tiled":
        raise H.Skip(f"the planner did not tile within {ctx.args.vram_budget:g} GB: {plan.reason}")
    if variant in ("graphs", "fp8"):
        pipe.setup_graphs(plan, tuple(shape), 99, chunks=False, reason="benchmark repeats")
        if pipe.graphed is None:
            raise H.Skip("CUDA graphs: " + next(s.text() for s in pipe.stages if s.name == "graphs"))
    if variant == "fp8" and not any(s.name == "fp8 convs" and s.status == "applied" for s in pipe.stages):
        raise H.Skip("FP8 level 3 did not run: " + "; ".join(f"{s.name}: {s.text()}" for s in pipe.stages
                                                             if s.name.startswith("fp8")))

    def fn():
        out, stats = pipe.decode(z, plan)
        return H.Timed(out, stats.seconds * 1e3)

    return H.Case(fn, reference, image=True, flops=flops,
                  info={"plan": plan.reason, "stages": [f"{s.name}: {s.status}" for s in pipe.stages]})


if __name__ == "__main__":
    H.main("decode_image")
