"""Whole video decodes of a workload: diffusers' own decode against vaeopt's pipeline as `vaeopt decode` runs it.

    python benchmarks/decode_video.py --workload wan21-480p [--variants diffusers,vaeopt,graphs]
    python benchmarks/decode_video.py --workload wan21-720p --variants vaeopt,tiled --vram-budget 8

Variants: diffusers (vae.decode: Wan one latent frame per call), vaeopt (every default stage, the planner's chunk,
CUDA graphs off), graphs (+ Wan's per-chunk CUDA graphs, armed as `vaeopt decode` arms them), fp8 (+ FP8), tiled
(spatial tiles within --vram-budget), budget (the planner's own choice within --vram-budget: chunks, tiles where a
chunk does not fit). The reference is the fp32 decode that `vaeopt benchmark` uses (Wan: vaeopt's
chunk-1 loop, diffusers' schedule without its growing torch.cat), so the PSNRs match its table. vaeopt's rows are
timed by the pipeline's own clock.
"""

import torch

import harness as H

VARIANTS = ("diffusers", "vaeopt", "graphs", "fp8", "tiled", "budget")
DEFAULTS = {"workload": "wan21-480p", "repeats": 5, "warmup": 2}
OPTIONS = {"vaeopt": dict(graphs="off", tiling="off"), "graphs": dict(graphs="on", tiling="off"),
           "fp8": dict(graphs="on", tiling="off", fp8="on"), "tiled": dict(graphs="off", tiling="on"),
           "budget": dict(graphs="off", tiling="auto")}


def add_args(ap):
    ap.add_argument("--vram-budget", type=float, default=8.0, help="GB, for the tiled and budget variants")
    ap.add_argument("--fp8-gate", type=float, default=40.0, help="dB, for the fp8 variant")


def items(ctx):
    if not ctx.family.is_video:
        raise SystemExit(f"{ctx.workload} is an image workload: decode_image.py")
    return [(f"{ctx.workload} {tuple(ctx.shape)}", ctx.shape)]


def setup(variant, shape, ctx):
    from vaeopt import video, video_graphs, video_stream
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    flops, z = ctx.flops(), ctx.latent()

    def reference():
        m, zf = ctx.model(torch.float32), z.float()
        if ctx.family.cls_name == "AutoencoderKLWan":
            return video.decode_video(m, zf, chunk=1)
        if video_stream.applies(m):  # HunyuanVideo 1.5, LTX-2: exact chunks of one latent frame, as vaeopt benchmark
            return video_stream.decode_clip(m, zf, 1, clamp=False)
        return m.decode(zf).sample

    if variant == "diffusers":
        model = ctx.model()
        return H.Case(lambda: model.decode(z).sample, reference, image=True, flops=flops)
    opts = dict(OPTIONS[variant], device=str(ctx.device), dtype=ctx.dtype_name, decode_shape=tuple(shape))
    if variant in ("tiled", "budget"):
        opts["vram_budget_gb"] = ctx.args.vram_budget
    if variant == "fp8":
        opts["gate_db"] = ctx.args.fp8_gate
    loaded = LoadedVAE(ctx.model(torch.float32), ctx.family, "benchmark", None, [], None)
    pipe = Pipeline(loaded, Options(**opts), log=lambda s: None)
    plan = pipe.plan(tuple(shape))
    if variant == "tiled" and plan.mode != "tiled":
        raise H.Skip(f"the planner did not tile within {ctx.args.vram_budget:g} GB: {plan.reason}")
    if variant in ("graphs", "fp8") and video_graphs.applies(pipe) and pipe.setup_graphs(plan) is None \
            and pipe.graphed is None:  # (a one-chunk clip, a Qwen-Image picture: captured whole)
        raise H.Skip("per-chunk CUDA graphs: " + next(s.text() for s in pipe.stages if s.name == "graphs"))
    if variant == "graphs" and not video_graphs.applies(pipe):
        raise H.Skip("per-chunk CUDA graphs exist for Wan's chunk decoder only")
    if variant == "fp8" and not any(s.name.startswith("fp8") and s.status == "applied" for s in pipe.stages):
        raise H.Skip("FP8 did not run: " + "; ".join(f"{s.name}: {s.text()}" for s in pipe.stages
                                                    if s.name.startswith("fp8")))

    def fn():
        out, stats = pipe.decode(z, plan)
        return H.Timed(out, stats.seconds * 1e3)

    return H.Case(fn, reference, image=True, flops=flops,
                  info={"plan": plan.reason, "stages": [f"{s.name}: {s.status}" for s in pipe.stages]})


if __name__ == "__main__":
    H.main("decode_video")
