"""Wan 2.1 video decode on one GPU: diffusers' one-latent-frame-at-a-time decode vs vaeopt.video's chunked decode.

Workload wan21-480p (ANCHORS.md): full-size Wan 2.1 VAE, random weights, bf16, latents (1, 16, 21, 60, 104) ->
81 frames 480x832. Variants:
  * diffusers `vae.decode(z).sample` and `vaeopt.video.decode_video(vae, z, K)` for K = 1, 2, 4, 8 latent frames
    per call, each with the Conv3d weights + input in NCDHW and in channels_last_3d: median of --repeats timed runs
    (CUDA events, one warm-up run excluded), peak memory (max_memory_allocated after a reset; also above what was
    allocated before the call, to compare with estimate_chunk_bytes + the clip's output), max/mean |diff| against
    diffusers' NCDHW bf16 output;
  * iterating to the host with iter_decode_video (uint8 frames, pinned double buffers), copy_stream True vs False,
    with no consumer and with a simulated video writer that takes --writer-ms-per-frame per frame;
  * an fp32 exactness check on a small latent (TF32 off): chunked vs diffusers.
Prints a table last and writes $OUT/video.json (or --out).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_video.py [--quick]
    python benchmarks/gpu_video.py --device cpu --tiny      # smoke test of this script (tiny model, CPU)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vaeopt import video  # noqa: E402
from vaeopt.families import build_model, get_family  # noqa: E402

WORKLOAD = "wan21-480p"
LATENT = (1, 16, 21, 60, 104)
TFLOP = 275.0  # ANCHORS.md, FlopCounterMode through diffusers' decode
GiB = 2**30


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, repeats: int):
    """(median seconds, all times, last result, peak bytes, peak bytes above the pre-call allocation); one warm-up
    run first. The peak is read over the timed runs (each frees the previous result before it starts)."""
    out = fn()
    del out
    cuda = dev.type == "cuda"
    if cuda:
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)  # allocated bytes; cached blocks stay so no run pays cudaMalloc
        base = torch.cuda.memory_allocated(dev)
    times = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
        if len(times) < repeats:
            del out
    peak = torch.cuda.max_memory_allocated(dev) if cuda else None
    return statistics.median(times), times, out, peak, (peak - base) if cuda else None


def set_layout(vae, channels_last: bool):
    fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
    for m in vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=fmt)


def versions(dev):
    v = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0]}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:
        v["triton"] = None
    import diffusers

    v["diffusers"] = diffusers.__version__
    v["gpu"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    try:
        v["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or None
    except Exception:
        v["git"] = None
    return v


def fp32_check(dev, tiny: bool):
    """Chunked vs diffusers in fp32 on a small latent, TF32 off: the exactness claim on this GPU."""
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(1)
        kw = {"base_dim": 8} if tiny else {"base_dim": 32}
        vae = build_model(get_family("wan21"), **kw).to(dev)
        z = torch.randn(1, 16, 5, 8, 12, device=dev)
        with torch.no_grad():
            ref = vae.decode(z).sample
        errs = {str(k): (video.decode_video(vae, z, k) - ref).abs().max().item() for k in (1, 2, 3, None)}
        set_layout(vae, True)
        errs["2,channels_last"] = (video.decode_video(vae, z, 2) - ref).abs().max().item()
        return errs
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def iterate_to_host(vae, z, chunk, copy_stream, writer_ms_per_frame, dev):
    """Wall time of decoding to host uint8 frames while a (simulated) writer consumes each group."""
    sync(dev)
    t = time.perf_counter()
    frames = 0
    for g in video.iter_decode_video(vae, z, chunk, copy_stream=copy_stream):
        frames += g.shape[0]  # (f, H, W, 3) uint8
        int(g[-1, -1, -1, -1])  # touch the host buffer, as a writer would
        if writer_ms_per_frame:
            time.sleep(writer_ms_per_frame * g.shape[0] / 1e3)
    sync(dev)
    return time.perf_counter() - t, frames


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer variants: K in {1, 4}, K=4 only in NCDHW")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and latent (smoke test)")
    ap.add_argument("--writer-ms-per-frame", type=float, default=3.0)
    ap.add_argument("--cudnn-benchmark", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/video.json)")
    args = ap.parse_args()

    dev = torch.device(args.device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.manual_seed(0)
    if args.tiny:
        vae = build_model(get_family("wan21"), base_dim=8).to(dev, torch.bfloat16)
        shape = (1, 16, 5, 4, 6)
    else:
        vae = build_model(get_family("wan21")).to(dev, torch.bfloat16)
        shape = LATENT
    z = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    ks = [1, 4] if args.quick else [1, 2, 4, 8]
    info = versions(dev)
    print(f"# {info['gpu']} | torch {info['torch']} cuDNN {info['cudnn']} triton {info['triton']} "
          f"diffusers {info['diffusers']} | {WORKLOAD if not args.tiny else 'tiny'} {shape} bf16", flush=True)

    out_frames = 1 + 4 * (shape[2] - 1)
    out_bytes = shape[0] * 3 * out_frames * shape[3] * 8 * shape[4] * 8 * 2
    rows = []
    ref = None
    for cl in (False, True):
        set_layout(vae, cl)
        zz = z.contiguous(memory_format=torch.channels_last_3d) if cl else z
        layout = "channels_last_3d" if cl else "NCDHW"
        variants = [("diffusers", None)] + [("chunked", k) for k in ks if not (args.quick and not cl and k != 4)]
        for name, k in variants:
            if name == "diffusers":
                def fn():
                    with torch.no_grad():
                        return vae.decode(zz).sample
            else:
                def fn(k=k):
                    return video.decode_video(vae, zz, k)
            med, times, out, peak, over = timed(fn, dev, args.repeats)
            if ref is None:
                ref = out  # diffusers NCDHW: the reference
            d = (out.float() - ref.float()).abs()
            row = {
                "workload": WORKLOAD if not args.tiny else "tiny", "variant": name, "chunk": k, "layout": layout,
                "median_s": med, "times_s": times, "max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(),
            }
            del out, d
            row["peak_gib"] = peak / GiB if peak is not None else None
            row["peak_over_base_gib"] = over / GiB if over is not None else None
            if k is not None:
                est = video.estimate_chunk_bytes(vae, shape, k, torch.bfloat16, channels_last=cl)
                row["estimate_gib"] = est / GiB
                row["estimate_plus_output_gib"] = (est + out_bytes) / GiB
            if not args.tiny:
                row["tflops"] = TFLOP / med
            rows.append(row)
            print(json.dumps(row), flush=True)

    # copy-out overlap: channels_last_3d (left set), K=4
    overlap = []
    k = 4
    for writer in (0.0, args.writer_ms_per_frame):
        for cs in (False, True):
            iterate_to_host(vae, z.contiguous(memory_format=torch.channels_last_3d), k, cs, writer, dev)  # warm-up
            ts = [iterate_to_host(vae, z.contiguous(memory_format=torch.channels_last_3d), k, cs, writer, dev)[0]
                  for _ in range(max(1, args.repeats - 1))]
            r = {"chunk": k, "layout": "channels_last_3d", "copy_stream": cs, "writer_ms_per_frame": writer,
                 "median_s": statistics.median(ts), "times_s": ts, "writer_total_s": writer * out_frames / 1e3}
            overlap.append(r)
            print(json.dumps(r), flush=True)

    check = fp32_check(dev, args.tiny)
    print("fp32 max|chunked - diffusers| (TF32 off):", json.dumps(check), flush=True)

    result = {**info, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "workload": WORKLOAD if not args.tiny else "tiny", "latent_shape": list(shape), "dtype": "bfloat16",
              "cudnn_benchmark": args.cudnn_benchmark, "repeats": args.repeats, "rows": rows, "overlap": overlap,
              "fp32_check": check}
    path = Path(args.out) if args.out else Path(os.environ.get("OUT", "benchmarks/results")) / "video.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))

    print(f"\n{info['gpu']}, torch {info['torch']}, cuDNN {info['cudnn']}: {result['workload']} {shape} bf16, "
          f"median of {args.repeats}")
    print(f"{'variant':<10} {'K':>3} {'layout':<17} {'time s':>8} {'TFLOP/s':>8} {'peak GiB':>9} {'over GiB':>9} "
          f"{'est+out':>8} {'max|d|':>8}")
    for r in rows:
        f = lambda v, fmt: (fmt % v) if v is not None else "-"  # noqa: E731
        print(f"{r['variant']:<10} {f(r['chunk'], '%d'):>3} {r['layout']:<17} {r['median_s']:8.3f} "
              f"{f(r.get('tflops'), '%.0f'):>8} {f(r['peak_gib'], '%.2f'):>9} {f(r['peak_over_base_gib'], '%.2f'):>9} "
              f"{f(r.get('estimate_plus_output_gib'), '%.2f'):>8} {r['max_abs_diff']:8.4f}")
    print(f"{'iterate to host (uint8, K=4, channels_last_3d)':<48} {'copy_stream':>11} {'time s':>8}")
    for r in overlap:
        print(f"  writer {r['writer_ms_per_frame']:.1f} ms/frame ({r['writer_total_s']:.2f} s){'':<17} "
              f"{str(r['copy_stream']):>11} {r['median_s']:8.3f}")
    print(f"fp32 exactness (TF32 off), max|chunked - diffusers|: {check}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
