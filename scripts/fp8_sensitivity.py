"""Per-layer FP8 sensitivity of the bundled trained VAEs (tiny_kl_image, tiny_wan_video) on their real latents.

For every conv/linear the fp8 stage would convert: only that layer in e4m3 (emulated, see vaeopt/quant/sensitivity.py),
decode the sample latents, PSNR vs the unquantized fp32 decode. Then the cumulative curve: layers converted from least
to most sensitive, measured PSNR after each, next to the PSNR predicted by adding single-layer MSEs. Then the policy
(vaeopt.quant.sensitivity.choose_keep) on the "stage" ranking: which layers stay in bf16.

    python scripts/fp8_sensitivity.py                       # CPU, one cropped latent a model: 11 min (2 busy cores)
    python scripts/fp8_sensitivity.py --full --device cuda --cumulative all   # whole sample latents, GPU: seconds
    python scripts/fp8_sensitivity.py --write-config        # also store the results in vaeopt/configs/

Prints the tables; --json writes everything measured; --write-config writes the compact per-model entry the fp8 stage
reads (vaeopt/configs/fp8_sensitivity.json: fingerprint, kept layers, per-layer and cumulative PSNR).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vaeopt.quant import sensitivity as S  # noqa: E402
from vaeopt.loading import load_vae  # noqa: E402
from vaeopt.stages import fp8  # noqa: E402

SAMPLES = ROOT / "samples"
# (model file, latents file, latent space of the file, CPU crop: (H, W) or (T, H, W) from the top-left corner of the
# file's first latent; --full takes every latent of the file whole)
MODELS = {
    "tiny_kl_image": ("tiny_kl_image.safetensors", "tiny_kl_image_latents.pt", "scaled", (32, 32)),
    "tiny_wan_video": ("tiny_wan_video.safetensors", "tiny_wan_video_latents.pt", "raw", (2, 12, 16)),
}


def load(name: str, full: bool, device: torch.device):
    mfile, lfile, space, crop = MODELS[name]
    loaded = load_vae(SAMPLES / mfile, device=device)
    lat = torch.load(SAMPLES / lfile, weights_only=True)
    zs, desc = [], []
    for key, z in list(lat.items())[: None if full else 1]:
        z = z.float()
        z = loaded.family.unscale(z) if space == "scaled" else z
        if not full:
            z = z[(slice(None), slice(None)) + tuple(slice(0, c) for c in crop)]
        zs.append(z.to(device))
        desc.append(f"{key} {tuple(z.shape)}")
    return loaded.model.eval(), zs, desc


def run(name: str, modes: list[str], full: bool, device: torch.device, cumulative: str, gate_db: float,
        margin_db: float, share: float, log) -> dict:
    model, zs, desc = load(name, full, device)
    log(f"\n== {name}: {len(S.candidates(model))} layers; latents {', '.join(desc)} ({device.type}) ==")
    t0 = time.perf_counter()
    ref = S.decode_all(model, zs)
    log(f"fp32 reference decode: {time.perf_counter() - t0:.1f} s")
    res = {"latents": desc, "full": full, "device": device.type, "date": str(datetime.date.today()), "modes": {},
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for mode in modes:
        t0 = time.perf_counter()
        rows = S.measure(model, zs, mode=mode, ref=ref)
        res["modes"][mode] = m = {"layers": rows, "seconds": round(time.perf_counter() - t0, 1)}
        rest = [r for r in rows if not fp8.is_kept(r["layer"], fp8.KEEP)]
        log(f"\n[{mode}] one layer in e4m3 at a time ({m['seconds']} s); most sensitive first:")
        total = sum(r["mse"] for r in rest)
        log(f"  {'layer':44s} {'path':8s} {'params':>7s} {'PSNR':>7s} {'share':>6s}")
        for r in rows[:12]:
            sh = "kept" if fp8.is_kept(r["layer"], fp8.KEEP) else f"{100 * r['mse'] / total:5.1f}%"
            log(f"  {r['layer']:44s} {r['path']:8s} {r['params']:7d} {r['psnr_db']:6.1f}  {sh:>6s}")
        log(f"  predicted, all but {'/'.join(fp8.KEEP)} in e4m3 (sum of MSEs): {S.psnr_of(total):.1f} dB")
        with S.emulated(model, [r["layer"] for r in rest], mode):
            meas = S.psnr_of(S.mse(S.decode_all(model, zs), ref))
        m["all_but_keep_db"] = meas
        log(f"  measured,  all but {'/'.join(fp8.KEEP)} in e4m3: {meas:.1f} dB")
        if cumulative == "all" or cumulative == mode:
            t0 = time.perf_counter()
            m["cumulative"] = S.cumulative(model, zs, rows, mode=mode, ref=ref)
            log(f"  cumulative, least sensitive first ({time.perf_counter() - t0:.1f} s): "
                + ", ".join(f"{c['n_fp8']}: {c['psnr_db']:.1f} ({c['predicted_psnr_db']:.1f})"
                            for c in m["cumulative"] if c["n_fp8"] % 4 == 0 or c["n_fp8"] >= len(rows) - 4))
        kept, pred, why = S.choose_keep(rows, gate_db + margin_db, dominant_share=share)
        with S.emulated(model, [r["layer"] for r in rows if r["layer"] not in kept], mode):
            after = S.psnr_of(S.mse(S.decode_all(model, zs), ref))
        m["policy"] = {"keep": kept, "why": why, "predicted_db": pred, "measured_db": after}
        log(f"  policy (dominant share {share:g}, target {gate_db + margin_db:g} dB): keep "
            + ", ".join(f"{k} ({why[k]})" for k in kept) + f" -> predicted {pred:.1f}, measured {after:.1f} dB")
    res["fingerprint"] = S.fingerprint(model)
    return res


def compact(res: dict, source: Path | None) -> dict:
    """The per-model entry of vaeopt/configs/fp8_sensitivity.json (small: rounded, lists not dicts)."""
    st = res["modes"]["stage"]
    entry = {
        "fingerprint": res["fingerprint"],
        "measured": f"scripts/fp8_sensitivity.py{' (' + str(source) + ')' if source else ''}"
                    f"{' ' + res['date'] if 'date' in res else ''} on {res.get('device_name', res['device'])}, "
                    f"emulated fp32; latents: " + "; ".join(res["latents"]),
        "keep": st["policy"]["keep"],
        "why": st["policy"]["why"],
        "keep_db": round(st["policy"]["measured_db"], 2),
        "all_but_first_last_db": {m: round(v["all_but_keep_db"], 2) for m, v in res["modes"].items()},
        "_columns": "layers: [name, path, params, PSNR dB with only it in e4m3]; cumulative: [name added, layers "
                    "in e4m3, measured PSNR, predicted PSNR]",
    }
    for mode, m in res["modes"].items():
        entry[mode] = {"layers": [[r["layer"], r["path"], r["params"], round(r["psnr_db"], 2)] for r in m["layers"]]}
        if "cumulative" in m:
            entry[mode]["cumulative"] = [[c["added"], c["n_fp8"], round(c["psnr_db"], 2),
                                          round(c["predicted_psnr_db"], 2)] for c in m["cumulative"]]
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=list(S.MODES), choices=list(S.MODES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--full", action="store_true", help="whole sample latents (default: CPU-sized crops)")
    ap.add_argument("--cumulative", choices=["stage", "all", "none"], default="stage",
                    help="which modes get the cumulative curve (one decode per layer each)")
    ap.add_argument("--gate-db", type=float, default=40.0)
    ap.add_argument("--margin-db", type=float, default=1.0)
    ap.add_argument("--dominant-share", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", type=Path, help="write everything measured here")
    ap.add_argument("--write-config", action="store_true", help=f"store the compact results in {S.STORED}")
    ap.add_argument("--from-json", type=Path, help="measure nothing: take the results of an earlier --json run")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cuda":  # an fp32 reference means fp32: no TF32 convs/matmuls
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    if args.write_config and "stage" not in args.modes:
        ap.error("--write-config needs the stage mode (the policy uses its ranking)")
    out = json.loads(args.from_json.read_text()) if args.from_json else {}
    for name in [] if args.from_json else args.models:
        out[name] = run(name, args.modes, args.full, dev, args.cumulative, args.gate_db, args.margin_db,
                        args.dominant_share, lambda s: print(s, flush=True))
    if args.json and not args.from_json:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.json}")
    if args.write_config:
        stored = S.load_stored() or {}
        stored["_doc"] = ("Per-layer FP8 sensitivity of the bundled trained VAEs, written by "
                          "scripts/fp8_sensitivity.py. The fp8 stage keeps `keep` in the compute dtype for a decoder "
                          "with this fingerprint (and still gates on its probe). See docs/experiments.md, E11.")
        stored.setdefault("models", {})
        for name, res in out.items():
            stored["models"][name] = compact(res, args.from_json)
        text = json.dumps(stored, indent=1)  # one table row per line: innermost lists on one line each
        text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
        S.STORED.write_text(text + "\n")
        print(f"wrote {S.STORED}")


if __name__ == "__main__":
    main()
