"""The fp8 stage on a GPU with FP8 tensor cores, on the bundled trained VAEs: does the emulation used to rank layers
match the real kernels, and what does the keep policy do with the real stage?

1. Emulation vs real, per layer: for the --top most sensitive layers of the emulated ranking (probe latent), PSNR vs the
   fp32 decode (TF32 off) with only that layer in fp8 — real stage path (e4m3 storage / torch._scaled_mm) in bf16 vs
   the emulation in bf16 — plus all-but-conv_in/conv_out.
2. The stage itself (bf16, gate 40 dB, default probe) with sensitivity off (conv_in/conv_out only, the old behaviour),
   auto with no stored measurement (the run-time retry), auto with the stored one, and always: its log line each.
3. For each of those that applied: the decode of the whole sample latents vs fp32, and bf16 alone.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_fp8_sensitivity.py --json $OUT/fp8_sensitivity_gpu.json
    python benchmarks/gpu_fp8_sensitivity.py --device cpu --models tiny_kl_image --top 1   # smoke test, CPU

Run scripts/fp8_sensitivity.py --write-config first where configs/fp8_sensitivity.json should be fresh.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vaeopt.quant import gate  # noqa: E402
from vaeopt.quant import sensitivity as S  # noqa: E402
from vaeopt.loading import load_vae  # noqa: E402
from vaeopt.stages import fp8  # noqa: E402

SAMPLES = ROOT / "samples"
MODELS = {"tiny_kl_image": "scaled", "tiny_wan_video": "raw"}


def sample_latents(name, family, dev, crop: int | None = None):
    lat = torch.load(SAMPLES / f"{name}_latents.pt", weights_only=True)
    zs = [(family.unscale(z.float()) if MODELS[name] == "scaled" else z.float()).to(dev) for z in lat.values()]
    return zs if crop is None else [z[..., :2, :crop, :crop] if z.ndim == 5 else z[..., :crop, :crop] for z in zs]


def psnr_vs(model, zs, ref, dtype):
    return S.psnr_of(S.mse(S.decode_all(model, [z.to(dtype) for z in zs]), ref))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (storage path only)")
    args = ap.parse_args()
    dev, bf16 = torch.device(args.device), torch.bfloat16
    ok, why = fp8.available(dev)
    assert ok or dev.type == "cpu", why
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    crop = None
    if dev.type == "cpu":  # smoke test: an 8x8 probe and 16x16 sample crops, so it ends in a minute or two
        crop, probe_latent = 16, gate.probe_latent
        gate.probe_latent = lambda fam, d: probe_latent(fam, d)[..., :8, :8]
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    for name in args.models:
        res = out[name] = {}
        loaded = load_vae(SAMPLES / f"{name}.safetensors", device=dev)
        model, fam = loaded.model.eval(), loaded.family
        probe = [gate.probe_latent(fam, dev)]
        model.float()
        ref = S.decode_all(model, probe)
        rows = S.measure(model, probe, compute=True, ref=ref)  # emulated in fp32: the ranking the stage uses
        res["probe_ranking_fp32"] = [(r["layer"], r["path"], round(r["psnr_db"], 2)) for r in rows]
        model.to(bf16)
        res["probe_bf16_alone_db"] = psnr_vs(model, probe, ref, bf16)
        cmp = []
        names = [r["layer"] for r in rows[: args.top]]
        rest = [n for n, _, _ in S.candidates(model) if not fp8.is_kept(n, fp8.KEEP)]
        for label, conv in [(n, [n]) for n in names] + [("all but conv_in/conv_out", rest)]:
            keep = [n for n, _, _ in S.candidates(model) if n not in conv]
            with S.emulated(model, conv, compute=True):
                emu = psnr_vs(model, probe, ref, bf16)
            fp8.convert(model, compute=True, keep=keep)
            real = psnr_vs(model, probe, ref, bf16)
            fp8.revert(model)
            cmp.append({"layers": label, "emulated_bf16_db": round(emu, 2), "real_bf16_db": round(real, 2)})
            print(f"{name}: {label:44s} emulated {emu:6.2f}  real {real:6.2f} dB "
                  f"(bf16 alone {res['probe_bf16_alone_db']:.2f})", flush=True)
        res["emulated_vs_real_probe"] = cmp
        zs = sample_latents(name, fam, dev, crop)
        model.float()
        ref_s = S.decode_all(model, zs)
        model.to(bf16)
        res["samples_bf16_alone_db"] = psnr_vs(model, zs, ref_s, bf16)
        runs = {}
        stored_path = S.STORED
        for label, kw in [("off", dict(sensitivity="off")), ("auto, nothing stored", dict(sensitivity="auto")),
                          ("auto, stored", dict(sensitivity="auto")), ("always", dict(sensitivity="always"))]:
            S.STORED = stored_path if label == "auto, stored" else Path("/nonexistent.json")
            t0 = time.perf_counter()
            r = fp8.apply(model, family=fam, gate_db=40.0, device=dev, dtype=bf16, **kw)
            secs = time.perf_counter() - t0
            run = {"line": r.line(), "status": r.status, "seconds": round(secs, 2),
                   "tries": r.data.get("tries"), "kept": r.data.get("kept_layers")}
            if r.status == "applied":
                run["samples_db"] = psnr_vs(model, zs, ref_s, bf16)
                fp8.revert(model)
            runs[label] = run
            print(f"{name} [{label}] {secs:.2f} s: {r.line()}", flush=True)
            if "samples_db" in run:
                print(f"    sample latents: {run['samples_db']:.2f} dB vs fp32 "
                      f"(bf16 alone {res['samples_bf16_alone_db']:.2f})", flush=True)
        S.STORED = stored_path
        res["stage"] = runs
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
