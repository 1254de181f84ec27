"""The warp-specialized Gluon conv (`kernels/ws_conv.py`, E42) on the image decoders' bf16 3x3 convs (sdxl-1024's
shapes, NHWC, each image one frame with KT=1), against cuDNN's channels_last conv2d, which runs them (E43: measured
slower than cuDNN's conv without bias, which is how the decoders call it; not kept).

Runs at commit 5cde3e3: the kernel's column tiles and KT=1 launch, ws_conv.CONFIGS_2D / IMAGE and the triton_conv
stage's image branch that --decodes switches were reverted after it.

    python3 benchmarks/gpu_ws_conv2d.py [--shapes 128x1024,256x512] [--rounds 5]   -> $OUT/ws_conv2d.json
    python3 benchmarks/gpu_ws_conv2d.py --shapes "" --decodes sdxl-1024,flux-1024 [--gate 40] [--decode-rounds 15]

A shape "CinxS" or "Cin-CoutxS" is a Cin -> Cout conv of one S x S image. Variants per output width (ws_conv.WsConfig
fields, output channels in column tiles of bn0 + bn1). Per call: CUDA-graph replays (10 calls per graph), the median
of `rounds` interleaved rounds, the max error relative to an fp32 conv2d, and the max abs difference from cuDNN.
--decodes: whole decodes (diffusers' default init, seed 0, bf16, CUDA graphs; FP8 level 3 at --gate dB if given) of a
pipeline built with the image convs on cuDNN (ws_conv.IMAGE off) and one with them on the Gluon kernel, replays
interleaved; PSNR of each against the fp32 diffusers decode of the same weights.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import graph_rounds, out_dir, run_meta  # noqa: E402

from vaeopt.kernels import conv as K  # noqa: E402
from vaeopt.kernels import ws_conv  # noqa: E402

VARIANTS = {
    128: ["bh=2,bw=64,bk=64,bn0=64,bn1=64,stages=6", "bh=1,bw=128,bk=64,bn0=64,bn1=64,stages=6",
          "bh=2,bw=128,bk=64,bn0=64,bn1=64,stages=4", "bh=2,bw=64,bk=32,bn0=64,bn1=64,stages=8"],
    256: ["bh=1,bw=128,bk=64,bn0=128,bn1=128,stages=4", "bh=2,bw=64,bk=64,bn0=128,bn1=128,stages=4",
          "bh=2,bw=64,bk=64,bn0=64,bn1=64,stages=6", "bh=2,bw=128,bk=64,bn0=64,bn1=64,stages=4"],
    512: ["bh=1,bw=128,bk=64,bn0=128,bn1=128,stages=4", "bh=2,bw=64,bk=64,bn0=128,bn1=128,stages=4",
          "bh=2,bw=128,bk=64,bn0=64,bn1=64,stages=4", "bh=1,bw=128,bk=64,bn0=64,bn1=64,stages=6"],
}
ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="128x1024,256-128x1024,256x512,512-256x512,512x256,512x128")
ap.add_argument("--variants", default=None, help="';'-separated, for every shape (default: VARIANTS by Cout)")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--bias", type=int, default=1, help="0: both without bias, as the decoders' fused resnets call them")
ap.add_argument("--decodes", default="", help="workloads for the whole-decode A/B")
ap.add_argument("--decode-rounds", type=int, default=15)
ap.add_argument("--decode-widths", default="", help="the output widths (CONFIGS_2D keys) the Gluon pipeline keeps, "
                "e.g. 512 (default: all)")
ap.add_argument("--gate", type=float, default=None, help="FP8 level 3 at this gate (dB); default: bf16 only")
args = ap.parse_args()


def cfg(spec: str) -> ws_conv.WsConfig:
    kv = dict(p.split("=") for p in spec.split(",")) if spec else {}
    return ws_conv.WsConfig(**{k: int(v) for k, v in kv.items()})


def ws_call(x, wk, bias, c: ws_conv.WsConfig):
    N, C, H, W = x.shape
    y = torch.empty((N, H, W, wk.shape[0]), device=x.device, dtype=torch.bfloat16)
    grid, a, kw = ws_conv.kernel_args(x.permute(0, 2, 3, 1), wk, y, bias, 1, c, kt=1)
    ws_conv._ws_conv_kernel[grid](*a, **kw)
    return y.permute(0, 3, 1, 2)


results = []
g = torch.Generator().manual_seed(0)
for shape in [s_ for s_ in args.shapes.split(",") if s_]:
    ch, S = shape.split("x")
    cin, cout = (int(c) for c in ch.split("-")) if "-" in ch else (int(ch), int(ch))
    S = int(S)
    x = torch.randn(1, cin, S, S, generator=g).to("cuda", torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(cout, cin, 3, 3, generator=g) / (9 * cin) ** 0.5).to("cuda", torch.bfloat16)
    bias = (torch.randn(cout, generator=g) * 0.1).to("cuda", torch.bfloat16) if args.bias else None
    wk = K.pack_weight(w, kmajor=True).w
    bf = bias.float().contiguous() if args.bias else None
    ref = F.conv2d(x.float(), w.float(), bias.float() if args.bias else None, padding=1)
    flop = 2 * S * S * cout * cin * 9
    specs = ["cudnn"] + (args.variants.split(";") if args.variants else VARIANTS[cout])

    def call(s):
        if s == "cudnn":
            return F.conv2d(x, w, bias, padding=1)
        return ws_call(x, wk, bf, cfg(s))

    res, base = {}, None
    for s in specs:
        try:
            y = call(s)
            torch.cuda.synchronize()
            r = {"err_rel": ((y.float() - ref).abs().max() / ref.abs().max()).item()}
            if s == "cudnn":
                base = y
            else:
                r["max_abs_vs_cudnn"] = (y.float() - base.float()).abs().max().item()
            res[s] = r
        except Exception as e:  # noqa: BLE001
            res[s] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(shape, s, res[s], flush=True)
    ok = [s for s in specs if "error" not in res[s] and res[s]["err_rel"] < 2e-2]
    graph_rounds(call, ok, args.rounds, res, flop)
    results.append({"shape": shape, "cin": cin, "cout": cout, "size": S, "flop": flop, "variants": res})
    del x, ref, base

decodes = {}
for wl in [w_ for w_ in args.decodes.split(",") if w_]:
    import statistics

    from _common import graphed_pipe, interleaved_graph_ms, no_tf32

    from vaeopt.benchmark import WORKLOADS
    from vaeopt.fidelity import psnr
    from vaeopt.loading import load_vae

    fam, shape = WORKLOADS[wl]
    zz = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    pipes, outs, lines = {}, {}, {}
    all_cfgs = dict(ws_conv.CONFIGS_2D)
    keep = [int(c) for c in args.decode_widths.split(",") if c] or list(all_cfgs)
    for name, on in (("cudnn", False), ("ws_conv", True)):
        ws_conv.IMAGE = on  # read when the triton_conv stage marks the convs, before the graph is captured
        ws_conv.CONFIGS_2D.clear()
        ws_conv.CONFIGS_2D.update({c: v for c, v in all_cfgs.items() if c in keep})
        pipes[name], y = graphed_pipe(fam, zz, args.gate, "gpu_ws_conv2d")
        ws_conv.CONFIGS_2D.update(all_cfgs)
        outs[name] = y.float().clamp(-1, 1).cpu()
        lines[name] = [s_.line() for s_ in pipes[name].stages if s_.name in ("triton_conv", "fp8 convs")]
    ws_conv.IMAGE = True
    torch.manual_seed(0)
    no_tf32()
    ref_model = load_vae(None, family=fam).model.to("cuda").float().eval()
    with torch.inference_mode():
        ref = ref_model.decode(zz.float()).sample.float().clamp(-1, 1).cpu()
    del ref_model
    ms = interleaved_graph_ms(pipes, zz, args.decode_rounds)
    decodes[wl] = {n: {"ms": ms[n], "median_ms": statistics.median(ms[n]), "psnr_vs_fp32_db": psnr(outs[n], ref),
                       "stages": lines[n]} for n in pipes}
    decodes[wl]["psnr_between_db"] = psnr(outs["ws_conv"], outs["cudnn"])
    del pipes, outs, ref
    torch.cuda.empty_cache()

meta = run_meta("python3 benchmarks/gpu_ws_conv2d.py " + " ".join(sys.argv[1:]))
(out_dir() / "ws_conv2d.json").write_text(json.dumps({**meta, "results": results, "decodes": decodes,
                                                      "gate_db": args.gate}, indent=1))
print(f"\n# {meta['gpu']}: bf16 3x3 conv2d, NHWC, one image; graph replays, {args.rounds} rounds")
print(f"{'shape':12s} {'variant':44s} {'ms':>7s} {'TFLOP/s':>8s} {'err':>8s} {'vs cudnn':>9s}")
for r in results:
    for s, v in r["variants"].items():
        if "median_ms" not in v:
            print(f"{r['shape']:12s} {s:44s} {v.get('error', 'wrong: err %.1e' % v.get('err_rel', 0))[:70]}")
        else:
            d = "" if s == "cudnn" else f"{v['max_abs_vs_cudnn']:.1e}"
            print(f"{r['shape']:12s} {s:44s} {v['median_ms']:>7.3f} {v['tflops']:>8.0f} {v['err_rel']:>8.1e} {d:>9s}")
if decodes:
    print(f"\nwhole decodes, CUDA-graph replays, {args.decode_rounds} interleaved rounds, "
          f"{'bf16' if args.gate is None else f'FP8 gate {args.gate:g} dB'}")
    for wl, d in decodes.items():
        for n in ("cudnn", "ws_conv"):
            print(f"  {wl:10s} {n:8s} {d[n]['median_ms']:7.2f} ms ({min(d[n]['ms']):.2f}-{max(d[n]['ms']):.2f}) "
                  f"{d[n]['psnr_vs_fp32_db']:.2f} dB vs fp32")
        print(f"  {wl:10s} between: {d['psnr_between_db']:.1f} dB")
