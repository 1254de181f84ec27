"""Conv-bias folding, residual epilogues, fused 2x upsample and chunked attention: correctness and timings on the GPU,
then the full SDXL decoder with fused_norms alone vs fused_norms + fused_epilogues.

    python3 benchmarks/gpu_epilogue.py          # on the GPU machine, < 2 min on an H200
    TRITON_INTERPRET=1 python3 benchmarks/gpu_epilogue.py --smoke   # CPU smoke test of the script (tiny shapes)

(a) ops, bf16 channels_last, at (1,512,256,256) (1,512,512,512) (1,256,1024,1024) (1,128,1024,1024):
    conv+GN   conv2d(bias) -> group_norm_silu   vs  conv2d(no bias) -> group_norm_silu(x_bias=bias)
    bias      conv2d(bias) vs conv2d(no bias): what the separate bias kernel costs
    epilogue  torch: h.add_(bias) (cuDNN's bias kernel), (r + h) / 1.0   vs  bias_residual(h, bias, r)
    up        torch: the epilogue above + F.interpolate(nearest 2x)   vs  bias_residual(..., upsample2x=True)
    upsample  F.interpolate on NHWC / NCHW, the expand trick, upsample_nearest2x (NHWC)
    attention SDPA vs chunked_attention at 16384x512 (sdxl-1024), 65536x512 (sdxl-2048), 6240x384 (Wan)
(b) the SDXL decoder (random weights, bf16, channels_last), (1,4,128,128) latents: stock / fused_norms /
    fused_norms + fused_epilogues, CUDA-event median of 10 after warm-up, max |diff| vs the stock fp32 decode
    (TF32 off), and a torch.profiler kernel-time split per category for the last two.
Writes $OUT/epilogue.json (OUT defaults to ./out).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

import triton  # noqa: E402

from vaeopt.kernels.epilogue import bias_residual, upsample_nearest2x, upsample_nearest2x_expand  # noqa: E402
from vaeopt.kernels.group_norm_silu import group_norm_silu  # noqa: E402

SHAPES = [(1, 512, 256, 256), (1, 512, 512, 512), (1, 256, 1024, 1024), (1, 128, 1024, 1024)]
ATTN = [(16384, 512), (65536, 512), (6240, 384)]
SMOKE_SHAPES = [(1, 16, 8, 8)]
SMOKE_ATTN = [(64, 32)]
DT = torch.bfloat16


def cl(x):
    return x.contiguous(memory_format=torch.channels_last)


def bench(fn, smoke, rep=60):
    """-> median ms (do_bench; on the CPU interpreter one timed call)."""
    if smoke:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    v = triton.testing.do_bench(fn, warmup=10, rep=rep, quantiles=[0.5])
    return v[0] if isinstance(v, (list, tuple)) else v


def maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


def ops(dev, smoke, out_rows, checks):
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in SMOKE_SHAPES if smoke else SHAPES:
        N, C, H, W = shape
        x = cl(torch.randn(shape, device=dev, dtype=DT, generator=gen))
        r = cl(torch.randn(shape, device=dev, dtype=DT, generator=gen))
        w = cl((torch.randn(C, C, 3, 3, device=dev, generator=gen) / (3 * C**0.5)).to(DT))
        b = (torch.randn(C, device=dev, generator=gen) * 0.5).to(DT)
        gw = (torch.rand(C, device=dev, generator=gen) + 0.5).to(DT)
        gb = (torch.randn(C, device=dev, generator=gen) * 0.3).to(DT)
        G = 32 if C % 32 == 0 else 8
        B = x.numel() * x.element_size()

        def stock_conv_gn():
            return group_norm_silu(F.conv2d(x, w, b, padding=1), G, gw, gb, 1e-6)

        def fold_conv_gn():
            return group_norm_silu(F.conv2d(x, w, None, padding=1), G, gw, gb, 1e-6, x_bias=b)

        ref = group_norm_silu(F.conv2d(x.float(), w.float(), b.float(), padding=1), G, gw.float(), gb.float(), 1e-6)
        e_fold, e_stock = maxdiff(fold_conv_gn(), ref), maxdiff(stock_conv_gn(), ref)
        checks.append(dict(op="conv+gn", shape=shape, err=e_fold, err_stock=e_stock, ok=e_fold <= 2 * e_stock + 2e-2))
        h = F.conv2d(x, w, None, padding=1)

        def torch_epi(up=False):  # values of aten's path: conv bias add, then diffusers' (input + hidden) / 1.0
            y = (r + (h + b.view(1, -1, 1, 1))) / 1.0
            return F.interpolate(y, scale_factor=2.0, mode="nearest") if up else y

        ref_e = (r.float() + (h.float() + b.float().view(1, -1, 1, 1)))
        for up in (False, True):
            y = bias_residual(h, b, r, 1.0, up)
            rr = F.interpolate(ref_e, scale_factor=2.0, mode="nearest") if up else ref_e
            e, es = maxdiff(y, rr), maxdiff(torch_epi(up), rr)
            checks.append(dict(op="epilogue" + ("+up" if up else ""), shape=shape, err=e, err_stock=es,
                               ok=e <= es + 2**-7 * rr.abs().max().item(), channels_last=y.is_contiguous(
                                   memory_format=torch.channels_last)))
        u = upsample_nearest2x(x)
        checks.append(dict(op="upsample", shape=shape, ok=bool(torch.equal(u, F.interpolate(x, scale_factor=2.0)))
                           and bool(torch.equal(upsample_nearest2x_expand(x), u))))
        del u, y

        t = {}
        t["conv+gn stock"] = bench(stock_conv_gn, smoke)
        t["conv+gn folded"] = bench(fold_conv_gn, smoke)
        t["conv bias"] = bench(lambda: F.conv2d(x, w, b, padding=1), smoke)
        t["conv nobias"] = bench(lambda: F.conv2d(x, w, None, padding=1), smoke)
        hb = h.clone()
        t["bias add_ (aten)"] = bench(lambda: hb.add_(b.view(1, -1, 1, 1)), smoke)
        t["r+h"] = bench(lambda: r + h, smoke)
        t["(r+h)/1.0"] = bench(lambda: (r + h) / 1.0, smoke)
        t["epi torch"] = t["bias add_ (aten)"] + t["(r+h)/1.0"]
        t["epi ours"] = bench(lambda: bias_residual(h, b, r), smoke)
        t["interp nhwc"] = bench(lambda: F.interpolate(h, scale_factor=2.0, mode="nearest"), smoke)
        hn = h.contiguous()
        t["interp nchw"] = bench(lambda: F.interpolate(hn, scale_factor=2.0, mode="nearest"), smoke)
        t["up expand"] = bench(lambda: upsample_nearest2x_expand(h), smoke)
        t["up ours"] = bench(lambda: upsample_nearest2x(h), smoke)
        t["up ours nchw"] = bench(lambda: upsample_nearest2x(hn), smoke)
        del hn
        t["epi+up torch"] = t["epi torch"] + t["interp nhwc"]
        t["epi+up ours"] = bench(lambda: bias_residual(h, b, r, 1.0, True), smoke)
        t["copy"] = bench(lambda: hb.copy_(h), smoke)
        row = dict(shape=list(shape), bytes=B, ms={k: round(v, 4) for k, v in t.items()})
        row["gbps_epi_ours"] = round(3 * B / t["epi ours"] / 1e6, 1)
        row["gbps_epi_up_ours"] = round(6 * B / t["epi+up ours"] / 1e6, 1)
        out_rows.append(row)
        print(f"  {str(shape):22s} " + "  ".join(f"{k} {v * 1e3:.0f}us" for k, v in t.items()), flush=True)
        del x, r, h, hb, w
        if dev == "cuda":
            torch.cuda.empty_cache()


def sweep(dev, smoke, best):
    """bias_residual tile / num_warps at one large NHWC shape, plain and with the 2x upsample."""
    shape = SMOKE_SHAPES[0] if smoke else (1, 256, 1024, 1024)
    gen = torch.Generator(device=dev).manual_seed(3)
    h, r = (cl(torch.randn(shape, device=dev, dtype=DT, generator=gen)) for _ in range(2))
    b = torch.randn(shape[1], device=dev, dtype=DT, generator=gen)
    B = h.numel() * h.element_size()
    for up, nbytes in ((False, 3 * B), (True, 6 * B)):
        res = []
        for tile in ((256, 1024) if smoke else (2048, 4096, 8192, 16384)):
            for nw in (4, 8):
                ms = bench(lambda: bias_residual(h, b, r, 1.0, up, tile=tile, num_warps=nw), smoke)
                res.append((ms, tile, nw))
        ms, tile, nw = min(res)
        key = f"{'epi+up' if up else 'epi'} {shape} cl"
        best[key] = dict(ms=round(ms, 4), tile=tile, num_warps=nw, gbps=round(nbytes / ms / 1e6, 1),
                         all=[dict(ms=round(a, 4), tile=t, num_warps=w) for a, t, w in res])
        print(f"  sweep {key}: best tile {tile} warps {nw} {ms * 1e3:.0f} us ({nbytes / ms / 1e6:.0f} GB/s)",
              flush=True)
    del h, r


def attention(dev, smoke, rows, checks):
    from vaeopt.stages.fused_epilogues import chunked_attention

    gen = torch.Generator(device=dev).manual_seed(1)
    for L, d in SMOKE_ATTN if smoke else ATTN:
        q, k, v = (torch.randn(1, 1, L, d, device=dev, dtype=DT, generator=gen) for _ in range(3))
        if L <= 16384:
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            e = maxdiff(chunked_attention(q, k, v), ref)
            es = maxdiff(F.scaled_dot_product_attention(q, k, v), ref)
            checks.append(dict(op="attention", shape=[L, d], err=e, err_stock=es, ok=e <= 2 * es + 1e-2))
            del ref
        rep = 200 if L > 16384 else 60
        t_sdpa = bench(lambda: F.scaled_dot_product_attention(q, k, v), smoke, rep)
        t_ours = bench(lambda: chunked_attention(q, k, v), smoke, rep)
        rows.append(dict(L=L, d=d, sdpa_ms=round(t_sdpa, 3), chunked_ms=round(t_ours, 3)))
        print(f"  attention {L}x{d}: sdpa {t_sdpa:.3f} ms, chunked {t_ours:.3f} ms", flush=True)
        del q, k, v
        if dev == "cuda":
            torch.cuda.empty_cache()


def decoder(dev, smoke):
    from vaeopt.families import build_model, get_family
    from vaeopt.stages import fused_epilogues, fused_norms

    spec = get_family("sdxl")
    torch.manual_seed(0)
    kw = dict(block_out_channels=[32, 32, 64, 64], norm_num_groups=8) if smoke else {}
    with torch.device("meta"):
        m = build_model(spec, **kw)
    m = m.to_empty(device=dev)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    shape = (1, 4, 8, 8) if smoke else (1, 4, 128, 128)
    z = torch.randn(shape, device=dev, generator=torch.Generator(device=dev).manual_seed(2))
    if dev == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        ref = m.float().decode(z).sample.float()
    torch.backends.cudnn.allow_tf32 = True
    m16 = copy.deepcopy(m).to(DT).to(memory_format=torch.channels_last)
    del m
    z16 = z.to(DT).contiguous(memory_format=torch.channels_last)

    def run():
        return m16.decode(z16).sample

    def timed(n=10):
        with torch.inference_mode():
            for _ in range(1 if smoke else 3):
                run()
            if dev != "cuda":
                t = time.perf_counter()
                run()
                return (time.perf_counter() - t) * 1e3, []
            torch.cuda.synchronize()
            ts = []
            for _ in range(n):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            return statistics.median(ts), ts

    def err():
        with torch.inference_mode():
            return maxdiff(run(), ref)

    res = {}
    prof = {}
    if dev == "cuda":
        from gpu_profile import profile  # same categories as the main profile script
    else:
        profile = None
    res["stock"] = dict(ms=timed()[0], err=err())
    stages = [fused_norms.apply(m16).line()]
    res["fused_norms"] = dict(ms=timed()[0], err=err())
    if profile:
        with torch.inference_mode():
            prof["fused_norms"] = profile(run, n=3)
    r = fused_epilogues.apply(m16)
    stages.append(r.line())
    res["fused_norms+fused_epilogues"] = dict(ms=timed()[0], err=err())
    if profile:
        with torch.inference_mode():
            prof["fused_norms+fused_epilogues"] = profile(run, n=3)
    for k, v in res.items():
        print(f"  decoder {k:28s} {v['ms']:8.2f} ms   max|diff| vs fp32 {v['err']:.4f}", flush=True)
    for k, v in prof.items():
        print(f"  profile {k}: {v['total_ms']:.1f} ms kernel: " +
              ", ".join(f"{c} {t:.2f}" for c, t in v["by_category_ms"].items()), flush=True)
    return dict(shape=list(shape), results=res, stages=stages, stage_data=r.data, profile=prof)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--no-decoder", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    dev = "cpu" if args.smoke and not torch.cuda.is_available() else "cuda"
    import diffusers

    meta = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                triton=triton.__version__, diffusers=diffusers.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version() if dev == "cuda" else None,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    print(f"# {meta}", flush=True)
    rows, attn_rows, checks, best = [], [], [], {}
    ops(dev, args.smoke, rows, checks)
    sweep(dev, args.smoke, best)
    attention(dev, args.smoke, attn_rows, checks)
    dec = None if args.no_decoder else decoder(dev, args.smoke)

    # ---- summary (last) ---------------------------------------------------------------------------------------
    print(f"\n# {meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | bf16 channels_last | "
          f"{time.time() - t0:.0f} s")
    print(f"{'shape':22s} {'bias kern':>9s} {'conv+GN':>15s} {'epilogue':>15s} {'epi+upsample':>15s}"
          f" {'upsample nhwc':>22s}   (torch -> ours, us)")
    for r in rows:
        t = {k: v * 1e3 for k, v in r["ms"].items()}
        print(f"{str(tuple(r['shape'])):22s} {t['conv bias'] - t['conv nobias']:9.0f}"
              f" {t['conv+gn stock']:7.0f}->{t['conv+gn folded']:<7.0f} {t['epi torch']:7.0f}->{t['epi ours']:<7.0f}"
              f" {t['epi+up torch']:7.0f}->{t['epi+up ours']:<7.0f}"
              f" {t['interp nhwc']:7.0f}->{t['up ours']:<6.0f}(exp {t['up expand']:.0f})")
    for a in attn_rows:
        print(f"attention {a['L']}x{a['d']}: SDPA {a['sdpa_ms']:.2f} ms -> chunked {a['chunked_ms']:.2f} ms")
    if dec:
        for k, v in dec["results"].items():
            print(f"decode {k:28s} {v['ms']:7.2f} ms  err {v['err']:.4f}")
    bad = [c for c in checks if not c["ok"]]
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok" + (f"  FAILED: {bad}" if bad else ""))
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for k, v in best.items():
        print(f"best {k}: tile {v['tile']} warps {v['num_warps']} {v['ms'] * 1e3:.0f} us {v['gbps']:.0f} GB/s")
    result = dict(meta=meta, ops=rows, attention=attn_rows, checks=checks, decoder=dec, sweep=best,
                  elapsed_s=round(time.time() - t0, 1))
    (out_dir / "epilogue.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out_dir / 'epilogue.json'}")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
