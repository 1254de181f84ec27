"""Band-parallel multi-GPU decode (vaeopt.distributed): one GPU against all ranks, each decoding a horizontal band.

    python benchmarks/decode_band.py --workload wan21-720p --gpus 2        # spawns one process per GPU (NCCL)
    torchrun --nproc-per-node 4 benchmarks/decode_band.py --workload sdxl-4096
    python benchmarks/decode_band.py --tiny --device cpu --gpus 2          # smoke test (gloo on the CPU)

Variants: one-gpu (rank 0 alone: the pipeline's decode with its planner, CUDA graphs off, the other ranks idle) and
band (band_parallel_decode on every rank with the same stages, timed on rank 0 from a barrier to the gathered result
on its GPU). max_abs_vs_baseline: the band decode against the one-GPU decode (the same output); peaks are rank 0's.
"""

import time

import torch

import harness as H
from vaeopt import distributed as D

VARIANTS = ("one-gpu", "band")
DEFAULTS = {"workload": "wan21-720p", "repeats": 3, "warmup": 1}


def add_args(ap):
    ap.add_argument("--gpus", type=int, default=None, help="ranks (default: every GPU; 2 on the CPU)")


def launch(body, setup_name, args):
    cpu = args.device == "cpu"
    n = args.gpus if args.gpus or D.under_torchrun() else (2 if cpu else torch.cuda.device_count())
    return D.launch(n, body, setup_name, args, backend="gloo" if cpu else None, timeout=3600)


def rank_device(device):
    return D.rank_device()


items = H.decode_items()


def setup(variant, shape, ctx):
    import torch.distributed as dist

    from vaeopt import video
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    if variant == "one-gpu" and ctx.rank != 0:
        return H.Case(lambda: None)
    loaded = LoadedVAE(ctx.model(torch.float32), ctx.family, "benchmark", None, [], None)
    pipe = Pipeline(loaded, Options(device=str(ctx.device), dtype=ctx.dtype_name, graphs="off"), log=lambda s: None)
    z, wan = ctx.latent(), ctx.family.cls_name == "AutoencoderKLWan"

    def reference():
        m = ctx.model(torch.float32)
        return video.decode_video(m, z.float(), chunk=1) if wan else m.decode(z.float()).sample

    if variant == "one-gpu":
        return H.pipeline_case(pipe, pipe.plan(tuple(shape)), z, reference, ctx.flops())
    world = dist.get_world_size()
    band = (*shape[:-2], -(-shape[-2] // world), shape[-1])
    chunk = pipe.plan(band).chunk if wan else None  # the chunk one band's size gets on one GPU

    def fn():
        dist.barrier()
        H.sync(ctx.device)
        t0 = time.perf_counter()
        out = D.band_parallel_decode(pipe.model, z, chunk=chunk)
        H.sync(ctx.device)
        ms = (time.perf_counter() - t0) * 1e3
        return H.Timed(out.clamp(-1, 1) if out is not None else None, ms)

    return H.Case(fn, reference, image=True, flops=ctx.flops(), info={"ranks": world, "chunk": chunk})


if __name__ == "__main__":
    H.main("decode_band")
