"""CPU emulation of the gate's choice at the default 40 dB with the image resnet convs in int8 (zero point over
[-0.27847, max], as group_norm_silu_int8 writes them) and the upsampler convs in e4m3 (what runs) or in symmetric
int8 (a candidate): which layers the gate would admit, on the random-weight decoder (diffusers' default init,
seed 0) at a given latent size. Weights per output channel in the same format. The attention core is left out.
--order: the gate's per-layer order, least noisy first (noise) or most FLOPs per unit of noise first (flops, what
the int8 gate does since E46; FLOPs from stages/triton_conv._image_flops).

    python benchmarks/cpu_int8_sim.py [--family sdxl] [--latent 48] [--order noise|flops] [--ups e4m3,int8]
      -> benchmarks/results/cpu_int8_sim_<family>[_flops]_<date>.json
"""
import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.loading import load_vae  # noqa: E402
from vaeopt.stages.triton_conv import _image_flops  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--family", default="sdxl")
ap.add_argument("--latent", type=int, default=48)
ap.add_argument("--gate", type=float, default=40.5)  # the stage's gate + margin
ap.add_argument("--order", choices=("noise", "flops"), default="noise")
ap.add_argument("--ups", default="e4m3,int8", help="the upsamplers' formats to try")
args = ap.parse_args()
torch.set_num_threads(2)
torch.manual_seed(0)
m = load_vae(None, family=args.family).model.eval()
cands = [(n, mod) for n, mod in m.decoder.named_modules() if isinstance(mod, torch.nn.Conv2d)
         and mod.kernel_size == (3, 3) and (n.endswith(("conv1", "conv2")) or "upsamplers" in n)
         and mod.in_channels >= 128 and mod.out_channels >= 128]
z = torch.randn(1, m.config.latent_channels, args.latent, args.latent, generator=torch.Generator().manual_seed(0))


def decode():
    with torch.no_grad():
        return m.decode(z).sample.float()


with torch.no_grad():
    m.float()
    ref = decode()
saved = {n: mod.weight.data.clone() for n, mod in cands}


def qw(w, fmt):
    top = 448.0 if fmt == "e4m3" else 127.0
    s = w.abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(1e-12) / top
    if fmt == "e4m3":
        return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return (w / s).round().clamp(-127, 127) * s


def qa(x, fmt):
    if fmt == "e4m3":
        s = x.abs().amax().clamp_min(1e-12) / 448
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    if fmt == "int8":  # symmetric
        s = x.abs().amax().clamp_min(1e-12) / 127
        return (x / s).round().clamp(-127, 127) * s
    lo, hi = -0.27847, x.amax().item()  # int8zp: 255 levels over [lo, hi]
    s = (hi - lo) / 254
    zq = (hi + lo) / (2 * s)
    return ((x / s - zq).round().clamp(-127, 127) + zq) * s


def fmt_of(n, ups):
    return ups if "upsamplers" in n else "int8zp"


def run(sel, ups):
    hooks = []
    for n, mod in sel:
        f = fmt_of(n, ups)
        mod.weight.data = qw(saved[n], "e4m3" if f == "e4m3" else "int8")
        hooks.append(mod.register_forward_pre_hook(lambda mod, a, f=f: (qa(a[0], f),)))
    try:
        return psnr(decode(), ref)
    finally:
        for h in hooks:
            h.remove()
        for n, mod in sel:
            mod.weight.data = saved[n]


t0 = time.time()
out = {"date": datetime.date.today().isoformat(), "device": "cpu (emulated quantization, fp32)",
       "torch": torch.__version__, "command": "python benchmarks/cpu_int8_sim.py " + " ".join(sys.argv[1:]),
       "family": args.family, "latent": list(z.shape), "gate_plus_margin_db": args.gate, "order": args.order,
       "variants": {}}
flops = _image_flops(m, cands, tuple(z.shape[-2:]))
for ups in args.ups.split(","):
    alone = {n: round(run([(n, mod)], ups), 2) for n, mod in cands}
    if args.order == "flops":
        order = sorted(cands, key=lambda c: -flops[c[0]] * 10 ** (alone[c[0]] / 10))
    else:
        order = sorted(cands, key=lambda c: -alone[c[0]])
    lo, hi, best = 1, len(order), None
    while lo <= hi:
        k = (lo + hi) // 2
        p = run(order[:k], ups)
        if p >= args.gate:
            best, lo = (k, round(p, 2)), k + 1
        else:
            hi = k - 1
    admitted = [n for n, _ in order[:best[0]]] if best else []
    out["variants"][f"upsamplers {ups}"] = {
        "alone_db": alone, "all_db": round(run(cands, ups), 2), "admitted": admitted,
        "admitted_db": best[1] if best else None,
        "upsamplers_admitted": [n for n in admitted if "upsamplers" in n],
        "admitted_gflop": round(sum(flops[n] for n in admitted) / 1e9, 1)}
    v = out["variants"][f"upsamplers {ups}"]
    print(ups, "all", v["all_db"], "admitted", len(admitted), v["admitted_db"], v["upsamplers_admitted"],
          {n: d for n, d in alone.items() if "upsamplers" in n}, f"{time.time() - t0:.0f} s", flush=True)
out["seconds"] = round(time.time() - t0)
suffix = "_flops" if args.order == "flops" else ""
path = Path(__file__).resolve().parent / "results" / f"cpu_int8_sim_{args.family}{suffix}_{out['date']}.json"
path.write_text(json.dumps(out, indent=1))
print("->", path)
