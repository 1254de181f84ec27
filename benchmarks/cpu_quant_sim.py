"""CPU simulation of 8-bit conv numerics on a random-weight decoder: could another zero-cost numeric format or
correction let the default 40 dB gate admit many more layers than e4m3 does? (docs/perf-notes.md, E22)

Emulated in fp32 (values rounded through the format and back), the stage's candidates (resnet conv1/conv2 and the
upsampler convs): per-output-channel weight scales, one per-tensor activation scale from the input's amax (times
`slack`: the GroupNorm kernel's cheap bound is up to 2x the amax). Variants:
  e4m3        float8_e4m3fn weights and activations (what FP8 level 3 runs)
  e4m3+bc     the same with bias correction: conv bias -= sum over the kernel of (Wq - W) * E[x_c] (E[x_c] measured
              on this decode; after GroupNorm+SiLU it is known from the affine parameters)
  int8        symmetric int8 weights and activations, round to nearest
PSNR of the decode vs the unquantized one, for all layers and for each layer alone.

    python benchmarks/cpu_quant_sim.py [--family sdxl] [--latent 32]  -> benchmarks/results/cpu_quant_sim_<family>_<date>.json
"""
import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vaeopt.fidelity import psnr  # noqa: E402
from vaeopt.loading import load_vae  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--family", default="sdxl")
ap.add_argument("--latent", type=int, default=32)
args = ap.parse_args()
torch.manual_seed(0)
m = load_vae(None, family=args.family).model.eval()
cands = [(n, mod) for n, mod in m.decoder.named_modules() if isinstance(mod, torch.nn.Conv2d)
         and mod.kernel_size == (3, 3) and (n.endswith(("conv1", "conv2")) or "upsamplers" in n)]
z = torch.randn(1, m.config.latent_channels, args.latent, args.latent, generator=torch.Generator().manual_seed(0))


def decode():
    with torch.no_grad():
        return m.decode(z).sample.float().clamp(-1, 1)


ref = decode()
means = {}
hooks = [mod.register_forward_pre_hook(lambda mod, a, n=n: means.__setitem__(n, a[0].mean(dim=(0, 2, 3))))
         for n, mod in cands]
decode()
for h in hooks:
    h.remove()
saved = {n: (mod.weight.data.clone(), None if mod.bias is None else mod.bias.data.clone()) for n, mod in cands}


def q(t, s, fmt):
    if fmt == "int8":
        return (t / s).round().clamp(-127, 127) * s
    return (t / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def run(sel, fmt, slack=1.0, bc=False):
    top = 127.0 if fmt == "int8" else 448.0
    hooks = []
    for n, mod in sel:
        w, b = saved[n]
        wq = q(w, w.abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(1e-12) / top, fmt)
        mod.weight.data = wq
        if bc and b is not None:
            mod.bias.data = b - ((wq - w).sum(dim=(2, 3)) * means[n][None, :]).sum(1)
        hooks.append(mod.register_forward_pre_hook(
            lambda mod, a: (q(a[0], a[0].abs().amax().clamp_min(1e-12) * slack / top, fmt),)))
    try:
        return round(psnr(decode(), ref), 2)
    finally:
        for h in hooks:
            h.remove()
        for n, mod in sel:
            w, b = saved[n]
            mod.weight.data = w
            if b is not None:
                mod.bias.data = b


t0 = time.time()
res = {"all_layers_db": {"e4m3": run(cands, "e4m3"), "e4m3+bc": run(cands, "e4m3", bc=True),
                         "int8": run(cands, "int8"), "int8 slack 1.5": run(cands, "int8", 1.5),
                         "int8 slack 2": run(cands, "int8", 2.0)}}
print(res, flush=True)
alone = {v: {n: run([(n, mod)], *spec) for n, mod in cands}
         for v, spec in (("e4m3", ("e4m3",)), ("e4m3+bc", ("e4m3", 1.0, True)), ("int8", ("int8",)))}
res["alone_db"] = alone
res["alone_summary"] = {v: {"min": min(d.values()), "median": statistics.median(d.values()), "max": max(d.values())}
                        for v, d in alone.items()}
out = {"date": datetime.date.today().isoformat(), "device": "cpu (emulated quantization, fp32)",
       "torch": torch.__version__, "command": "python benchmarks/cpu_quant_sim.py " + " ".join(sys.argv[1:]),
       "family": args.family, "latent": list(z.shape), "layers": len(cands), "seconds": round(time.time() - t0),
       **res}
path = Path(__file__).resolve().parent / "results" / f"cpu_quant_sim_{args.family}_{out['date']}.json"
path.write_text(json.dumps(out, indent=1))
print(res["all_layers_db"], res["alone_summary"], f"-> {path}")
