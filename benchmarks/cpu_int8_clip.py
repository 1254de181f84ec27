"""CPU emulation: would clipping the int8 activation range help the resnet convs' fidelity? The int8 path spans
[-0.27847, max] of each sample (group_norm_silu_int8). Clipping the top at kappa standard deviations of the norm's
output (kappa * |gamma_c| + beta_c, the largest over channels) trades a finer step for clipped outliers, the usual
MSE-optimal clip for Gaussian data. Every 3x3 resnet conv in int8 (weights per output channel), PSNR of the decode vs
fp32; a sample of single layers alone. Models: the random-weight SDXL decoder at a 48x48 latent (`sdxl`), and the
trained tiny VAE of ../shared/data with its two real latents and one N(0, 1) latent (`tiny`).

    python benchmarks/cpu_int8_clip.py sdxl|tiny  -> benchmarks/results/cpu_int8_clip_<which>_<date>.json
"""
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from vaeopt.fidelity import psnr
from vaeopt.loading import load_vae
torch.set_num_threads(2)
which = sys.argv[1]
if which == "sdxl":
    torch.manual_seed(0)
    m = load_vae(None, family="sdxl").model.eval().float()
    zs = [torch.randn(1, 4, 48, 48, generator=torch.Generator().manual_seed(0))]
    minch = 128
else:
    m = load_vae(str(ROOT.parent / "shared/data" / "tiny_kl_image.safetensors")).model.eval().float()
    lat = torch.load(str(ROOT.parent / "shared/data" / "tiny_kl_image_latents.pt"), weights_only=True)
    zs = [lat["astronaut"].float() / m.config.scaling_factor, lat["coffee"].float() / m.config.scaling_factor]
    zs += [torch.randn(1, 4, 64, 64, generator=torch.Generator().manual_seed(0))]
    minch = 0
mods = dict(m.decoder.named_modules())
cands = [(n, mod) for n, mod in m.decoder.named_modules() if isinstance(mod, torch.nn.Conv2d)
         and mod.kernel_size == (3, 3) and n.endswith(("conv1", "conv2")) and "resnets" in n
         and mod.in_channels >= minch]
print(len(cands), "convs")
def decode(z):
    with torch.no_grad():
        return m.decode(z).sample.float()
refs = [decode(z) for z in zs]
saved = {n: mod.weight.data.clone() for n, mod in cands}
def qw(w):
    s = w.abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(1e-12) / 127
    return (w / s).round().clamp(-127, 127) * s
def qa(x, hi_clip):
    lo, hi = -0.27847, x.amax().item()
    if hi_clip is not None: hi = min(hi, hi_clip)
    s = (hi - lo) / 254
    zq = (hi + lo) / (2 * s)
    return ((x / s - zq).round().clamp(-127, 127) + zq) * s
def run(sel, kappa):
    hooks = []
    for n, mod in sel:
        norm = mods[n[:-5] + "norm" + n[-1]]
        clip = None if kappa is None else (kappa * norm.weight.abs() + norm.bias).max().item()
        mod.weight.data = qw(saved[n])
        hooks.append(mod.register_forward_pre_hook(lambda mod, a, c=clip: (qa(a[0], c),)))
    try:
        return [psnr(decode(z), r) for z, r in zip(zs, refs)]
    finally:
        for h in hooks: h.remove()
        for n, mod in sel: mod.weight.data = saved[n]
t0 = time.time()
out = {"date": datetime.date.today().isoformat(), "device": "cpu (emulated quantization, fp32)",
       "torch": torch.__version__, "command": "python benchmarks/cpu_int8_clip.py " + " ".join(sys.argv[1:]),
       "model": which, "latents": [list(z.shape) for z in zs], "convs": len(cands), "rows": []}
sample = cands[:: max(1, len(cands) // 6)]
for kappa in [None, 6, 5, 4]:
    allp = run(cands, kappa)
    alone = [run([c], kappa)[0] for c in sample]
    out["rows"].append({"kappa": kappa, "all_int8_db": [round(p, 2) for p in allp],
                        "alone_db": {n: round(p, 2) for (n, _), p in zip(sample, alone)}})
    print(kappa, "all:", [round(p, 2) for p in allp], "alone(sample):", [round(p, 1) for p in alone],
          f"{time.time() - t0:.0f}s", flush=True)
out["seconds"] = round(time.time() - t0)
path = ROOT / "benchmarks" / "results" / f"cpu_int8_clip_{which}_{out['date']}.json"
path.write_text(json.dumps(out, indent=1))
print("->", path)
