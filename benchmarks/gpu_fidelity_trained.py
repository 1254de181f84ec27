"""bf16 fidelity on the GPU with trained weights: does vaeopt's kernel path lose PSNR against diffusers' own bf16
decode? (A new-user pass saw, through the CPU Triton interpreter on the tiny trained KL, 60.6 dB for diffusers bf16
and 54.8 dB for vaeopt with the fused epilogues; the interpreter's bf16 rounding is not the GPU's.)

The bundled trained VAEs and their real latents (samples/): tiny_kl_image (astronaut, coffee) and tiny_wan_video
(astronaut_pan, coffee_zoom). Per model and latent: diffusers fp32 (the reference), diffusers bf16, and vaeopt.decode in bf16 with
the default options and with single stages switched off (epilogues, triton, upsample_conv), PSNR and max abs error
against the reference. Writes $OUT/fidelity_trained.json; prints a table last.

    python3 benchmarks/gpu_fidelity_trained.py
"""
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _common import out_dir, run_meta  # noqa: E402

import vaeopt  # noqa: E402
from vaeopt import latents as lat  # noqa: E402
from vaeopt.fidelity import max_abs, psnr  # noqa: E402
from vaeopt.loading import load_vae  # noqa: E402
from vaeopt.pipeline import Options  # noqa: E402

S = ROOT / "samples"
VARIANTS = {"vaeopt default": {}, "epilogues off": {"epilogues": "off"}, "triton off": {"triton": "off"},
            "upsample_conv off": {"upsample_conv": "off"}}
result = {**run_meta(" ".join(["python3"] + sys.argv)), "cases": []}
rows = []
for model, lat_file in (("tiny_kl_image.safetensors", "tiny_kl_image_latents.pt"),
                        ("tiny_wan_video.safetensors", "tiny_wan_video_latents.pt")):
    zs = torch.load(S / lat_file, weights_only=True)
    for name, z_scaled in zs.items():
        ref_vae = load_vae(S / model, device="cuda")
        z = lat.to_raw(z_scaled.float(), ref_vae.family, "scaled")
        with torch.no_grad():
            ref = ref_vae.model.decode(z.cuda()).sample.float().clamp(-1, 1).cpu()
            bf = ref_vae.model.to(torch.bfloat16).decode(z.cuda().to(torch.bfloat16)).sample.float().clamp(-1, 1).cpu()
        case = {"model": model, "latent": name, "shape": list(z.shape),
                "diffusers bf16": {"psnr": psnr(bf, ref), "max_abs": max_abs(bf, ref)}}
        rows.append((model, name, "diffusers bf16", case["diffusers bf16"]))
        for v, kw in VARIANTS.items():
            out = vaeopt.decode(z, load_vae(S / model), latent_space="raw",
                                options=Options(device="cuda", dtype="bf16", **kw), log=None)
            case[v] = {"psnr": psnr(out, ref), "max_abs": max_abs(out, ref)}
            rows.append((model, name, v, case[v]))
        result["cases"].append(case)
        print(json.dumps(case), flush=True)

(out_dir() / "fidelity_trained.json").write_text(json.dumps(result, indent=1))
print(f"\n# {result['gpu']}: bf16 decodes of the trained tiny VAEs vs diffusers fp32")
print(f"{'model':28} {'latent':10} {'variant':18} {'PSNR dB':>8} {'max abs':>8}")
for m, n, v, r in rows:
    print(f"{m:28} {n:10} {v:18} {r['psnr']:8.2f} {r['max_abs']:8.4f}")
