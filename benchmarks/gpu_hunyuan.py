"""HunyuanVideo's decode: diffusers as it comes, diffusers with its tiles (what HunyuanVideo pipelines enable), and
vaeopt's pipeline with and without the frame-causal mid-block attention (stages/attention.py: no (T*h*w)^2 mask).

Full-size AutoencoderKLHunyuanVideo (configs/hunyuanvideo.json) with random N(0, 0.02) weights, bf16, 480x848
frames (latents of 60x106), clips of --frames latent frames. Per clip and variant: median wall ms of --repeats
synchronized decodes after one warm-up, peak memory above the model, and PSNR / max abs error against diffusers' bf16
whole decode and (clips up to --fp32-max latent frames) its fp32 decode. A variant that runs out of memory is
recorded as "oom". Writes $OUT/hunyuan.json; prints a table last.

    python3 benchmarks/gpu_hunyuan.py [--frames 2,5,16,31] [--repeats 3]
"""
import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import out_dir, random_model, run_meta, timed  # noqa: E402

from vaeopt.families import get_family  # noqa: E402
from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.loading import LoadedVAE  # noqa: E402
from vaeopt.pipeline import Options, Pipeline  # noqa: E402
from vaeopt.stages import attention  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--frames", default="2,5,16,31")
ap.add_argument("--hw", default="60,106")
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--fp32-max", type=int, default=5)
ap.add_argument("--variants", default="diffusers,diffusers-tiled,vaeopt,vaeopt-masked",
                help="also: vaeopt-cl-off, vaeopt-norms-off, vaeopt-cl-norms-off (stages switched off), "
                     "vaeopt-whole (diffusers' framewise decoding off: the whole clip in one decoder call)")
args = ap.parse_args()
h, w = (int(v) for v in args.hw.split(","))

spec = get_family("hunyuanvideo")
base = random_model("hunyuanvideo").eval()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run(fn, repeats: int):
    """(output float32 on the host or None, times, peak GiB above the start, error)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    try:
        with torch.no_grad():
            fn()  # warm-up (Triton / cuDNN)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            y, ts = timed(fn, repeats)
        peak = (torch.cuda.max_memory_allocated() - start) / 2**30
        return y.float().cpu(), ts, peak, None
    except Exception as e:  # noqa: BLE001 - recorded per variant
        torch.cuda.empty_cache()
        return None, [], None, ("oom" if is_oom(e) else f"{type(e).__name__}: {str(e)[:200]}")


result = {**run_meta(" ".join(["python3"] + sys.argv)), "repeats": args.repeats, "latent_hw": [h, w],
          "note": "", "clips": {}}
rows = []
for T in (int(v) for v in args.frames.split(",")):
    z = torch.randn((1, 16, T, h, w), generator=torch.Generator().manual_seed(T)).cuda()
    frames = 4 * (T - 1) + 1
    clip = {"latent_frames": T, "frames": frames, "mask_gib_bf16": (T * h * w) ** 2 * 2 / 2**30, "variants": {}}
    ref32 = None
    if T <= args.fp32_max:
        m32 = copy.deepcopy(base).cuda()
        try:
            with torch.no_grad():
                ref32 = m32.decode(z).sample.float().clamp(-1, 1).cpu()
        except Exception as e:  # noqa: BLE001
            clip["fp32_reference"] = "oom" if is_oom(e) else str(e)[:200]
        del m32
        torch.cuda.empty_cache()
    ref16 = None
    zb = z.to(torch.bfloat16)
    for name in args.variants.split(","):
        if name.startswith("diffusers"):
            m = copy.deepcopy(base).to("cuda", torch.bfloat16)
            if name == "diffusers-tiled":
                m.enable_tiling()

            def fn(m=m, zb=zb):
                return m.decode(zb).sample.clamp(-1, 1)
            log = []
        else:
            log = []
            off = {"cl": {"channels_last": "off"}, "norms": {"triton": "off"},
                   "cl-norms": {"channels_last": "off", "triton": "off"}}.get(name.removeprefix("vaeopt-")[:-4], {})
            pipe = Pipeline(LoadedVAE(copy.deepcopy(base), spec, "random", None, [], None),
                            Options(device="cuda", dtype="bf16", graphs="off", **off), log=log.append)
            if name == "vaeopt-whole":
                pipe.model.use_framewise_decoding = False
            if name == "vaeopt-masked":
                attention.revert(pipe.model)
            plan = pipe.plan(tuple(z.shape))

            def fn(pipe=pipe, plan=plan, z=z):
                return pipe.decode(z, plan)[0]
            m = pipe.model
        y, ts, peak, err = run(fn, args.repeats)
        v = {"error": err} if err else {"median_ms": statistics.median(ts), "times_ms": ts, "peak_gib": peak}
        if y is not None:
            if name == "diffusers":
                ref16 = y
            if ref16 is not None and name != "diffusers":
                v["psnr_vs_diffusers_bf16"] = psnr(y, ref16)
                v["max_abs_vs_diffusers_bf16"] = (y - ref16).abs().max().item()
            if ref32 is not None:
                v["psnr_vs_fp32"] = psnr(y, ref32)
                v["max_abs_vs_fp32"] = (y - ref32).abs().max().item()
        if log:
            v["log"] = log
        clip["variants"][name] = v
        rows.append((T, frames, name, v))
        print(T, name, {k: v[k] for k in v if k not in ("log", "times_ms")}, flush=True)
        del m, fn, y
        if not name.startswith("diffusers"):
            del pipe
        torch.cuda.empty_cache()
    result["clips"][str(T)] = clip

path = out_dir() / "hunyuan.json"
path.write_text(json.dumps(result, indent=1))
print(f"\nwrote {path}")
print(f"{'T':>3} {'frames':>6} {'variant':<16} {'ms':>9} {'peak GiB':>9} {'dB vs bf16':>10} {'dB vs fp32':>10}")
for T, frames, name, v in rows:
    if "error" in v:
        print(f"{T:>3} {frames:>6} {name:<16} {v['error'][:40]}")
        continue
    a = v.get("psnr_vs_diffusers_bf16")
    b = v.get("psnr_vs_fp32")
    print(f"{T:>3} {frames:>6} {name:<16} {v['median_ms']:>9.1f} {v['peak_gib']:>9.2f} "
          f"{'' if a is None else f'{a:.1f}':>10} {'' if b is None else f'{b:.1f}':>10}")
