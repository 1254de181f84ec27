"""Whole video decodes of a workload: diffusers' own decode against vaeopt's pipeline as `vaeopt decode` runs it.

    python benchmarks/decode_video.py --workload wan21-480p [--variants diffusers,vaeopt,graphs]
    python benchmarks/decode_video.py --workload wan21-720p --variants vaeopt,tiled --vram-budget 8
    python benchmarks/decode_video.py --workload ltx2-768 --variants \
        diffusers,vaeopt,whole,chunk1,chunk4,cl,nofused,cl_nofused,budget16,budget8 --repeats 3 --warmup 1

Variants: diffusers (vae.decode: Wan one latent frame per call), vaeopt (every default stage, the planner's chunk, CUDA
graphs off), graphs (+ Wan's per-chunk CUDA graphs, armed as `vaeopt decode` arms them), fp8 (+ FP8), tiled (spatial
tiles within --vram-budget), budget (the planner's own choice within --vram-budget: chunks, tiles where a chunk does not
fit), budget16 / budget8 (the same within 16 / 8 GB); vaeopt with one thing changed: whole (the clip in one call),
chunkK (K latent frames per call), cl (channels_last_3d on), nofused (no Triton norms), cl_nofused; HunyuanVideo 1.5
and LTX-2 only: oldpad / cl_oldpad (conv inputs padded by torch.cat + PyTorch's 3D pad kernels, not in one buffer),
before (that, and the upsamplers as diffusers' rearrange / repeat / add ops), feed (each upsampler conv's input
written into its padded buffer by the resnet sum before it, not copied there), submajor (LTX-2's upsampler convs
with their output channels sub-position-major, so their one add reads coalesced), pad2 (both).
The reference is the fp32 decode that `vaeopt benchmark` uses (Wan: vaeopt's chunk-1 loop, diffusers' schedule without
its growing torch.cat), so the PSNRs match its table. vaeopt's rows are timed by the pipeline's own clock; the table's
"decode" is their own peak (the weights plus the peak above the call's start), held against the plan's estimate and
the budget.
"""

import torch

import harness as H

VARIANTS = ("diffusers", "vaeopt", "graphs", "fp8", "tiled", "budget", "budget16", "budget8", "whole", "chunk1",
            "chunk2", "chunk4", "cl", "nofused", "cl_nofused", "oldpad", "cl_oldpad", "before", "feed", "submajor",
            "pad2")
# HunyuanVideo 1.5 / LTX-2's chunk decoder with diffusers' ops in place of its own, as StreamDecoder's switches:
# (fast_pad: conv inputs in one preallocated buffer whose borders are filled after the data, not torch.cat + PyTorch's
# 3D pad kernels; fused_upsample: the upsamplers' channel-to-space and shortcut as one add into the output;
# feed_buffers: resnet sums written into the next conv's padded buffer; sub_major: LTX-2's upsampler conv channels
# ordered so that the one add reads them contiguously)
STREAM_SWITCHES = {"oldpad": dict(fast_pad=False), "cl_oldpad": dict(fast_pad=False),
                   "before": dict(fast_pad=False, fused_upsample=False), "feed": dict(feed_buffers=True),
                   "submajor": dict(sub_major=True), "pad2": dict(feed_buffers=True, sub_major=True)}
DEFAULTS = {"workload": "wan21-480p", "repeats": 5, "warmup": 2}
_V = dict(graphs="off", tiling="off")
OPTIONS = {"vaeopt": _V, "graphs": dict(graphs="on", tiling="off"),
           "fp8": dict(graphs="on", tiling="off", fp8="on"), "tiled": dict(graphs="off", tiling="on"),
           "budget": dict(graphs="off", tiling="auto"), "whole": _V,
           **{f"budget{g}": dict(graphs="off", tiling="auto", vram_budget_gb=g) for g in (16, 8)},
           **{f"chunk{k}": dict(_V, chunk=k) for k in (1, 2, 4)}, "cl": dict(_V, channels_last="on"),
           "nofused": dict(_V, triton="off"), "cl_nofused": dict(_V, channels_last="on", triton="off"),
           "oldpad": _V, "cl_oldpad": dict(_V, channels_last="on"), "before": _V, "feed": _V, "submajor": _V,
           "pad2": _V}


add_args = H.decode_args
items = H.decode_items(video=True)


def setup(variant, shape, ctx):
    from vaeopt import video, video_graphs, video_stream

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
    opts = dict(OPTIONS[variant], **({"chunk": shape[2]} if variant == "whole" else {}))
    pipe, plan = H.pipeline_plan(ctx, opts, shape)
    weights = sum(p.numel() * p.element_size() for p in pipe.model.parameters())
    if variant in ("graphs", "fp8") and video_graphs.applies(pipe) and pipe.setup_graphs(plan) is None \
            and pipe.graphed is None:  # (a one-chunk clip, a Qwen-Image picture: captured whole)
        raise H.Skip("per-chunk CUDA graphs: " + next(s.text() for s in pipe.stages if s.name == "graphs"))
    if variant == "graphs" and not video_graphs.applies(pipe):
        raise H.Skip("per-chunk CUDA graphs exist for Wan's chunk decoder only")
    if variant == "fp8" and not any(s.name.startswith("fp8") and s.status == "applied" for s in pipe.stages):
        raise H.Skip("FP8 did not run: " + "; ".join(f"{s.name}: {s.text()}" for s in pipe.stages
                                                    if s.name.startswith("fp8")))
    case = H.pipeline_case(pipe, plan, z, reference, flops, est_gib=plan.est_bytes / 2**30, weights_gib=weights / 2**30,
                           budget_gib=(plan.budget_bytes or 0) / 2**30 if opts["tiling"] != "off" else None)
    if variant in STREAM_SWITCHES:
        if not video_stream.applies(pipe.model):
            raise H.Skip("this variant exists for HunyuanVideo 1.5's and LTX-2's chunk decoder only")
        case.fn = _switched(case.fn, STREAM_SWITCHES[variant])
    return case


def _switched(fn, switches: dict):
    """fn with StreamDecoder's switches set for the call (profiled calls included), then put back."""
    from vaeopt.engine.stream import StreamDecoder

    def call():
        old = {k: getattr(StreamDecoder, k) for k in switches}
        for k, v in switches.items():
            setattr(StreamDecoder, k, v)
        try:
            return fn()
        finally:
            for k, v in old.items():
                setattr(StreamDecoder, k, v)

    return call


def table(res: dict) -> None:
    """variant, ms, speedup, PSNR, the decode's own peak (weights + above the start) against the plan's estimate and
    any budget, the plan."""
    print(f"\n{'variant':<11} {'ms':>9} {'x':>5} {'PSNR':>6} {'decode':>7} {'est':>6} {'budget':>7}  plan")
    for r in res["rows"]:
        if r["status"] != "ok":
            print(f"{r['variant']:<11} {r['status']}: {r['reason'][:100]}")
            continue
        i = r.get("info") or {}
        dec = (i["weights_gib"] + r["peak_above_start_gib"]) if "weights_gib" in i and r.get("peak_above_start_gib") \
            is not None else None
        b = i.get("budget_gib")
        held = "" if b is None or dec is None else (" ok" if dec <= b else " OVER")
        f = lambda v, w, p: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        print(f"{r['variant']:<11} {r['median_ms']:9.1f} {f(r.get('speedup', 1.0), 5, 2)} {f(r.get('psnr_db'), 6, 1)}"
              f" {f(dec, 7, 2)} {f(i.get('est_gib'), 6, 2)} {f(b, 4, 0)}{held:<3}  {i.get('plan', '')[:90]}")


if __name__ == "__main__":
    out = H.main("decode_video")
    if out is not None:
        table(out)
