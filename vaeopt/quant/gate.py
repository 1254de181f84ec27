"""The fidelity gate of the fp8 stage: convert, decode a probe, compare with the fp32 decode of the same weights.

Below the gate (default 40 dB PSNR) it measures each layer's sensitivity on the probe (quant/sensitivity.py), keeps the
most sensitive layers out of fp8 and probes again (at most twice); if that does not clear the gate either, the
conversion is undone, and the stage says so with the measured numbers. The conversion itself is the caller's
(`convert` / `revert`: the module wrappers of vaeopt/stages/fp8.py), so the gate knows the plan, not the modules.

The verdict (the layers kept, applied or undone, and the measured numbers) is stored in vaeopt's cache (vaeopt/cache.py)
per weights fingerprint, probe, gate settings, GPU and versions: the same model gated again converts the same layers
without probing, and its line says from when the verdict is.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from vaeopt import cache
from vaeopt.fidelity import psnr, psnr_text
from vaeopt.quant import sensitivity as sens
from vaeopt.quant.plan import KEEP, is_kept


def probe_latent(family, device) -> torch.Tensor:
    """The default probe: a seeded N(0, 1) latent of the family's channels, 32x32 (image) or 3x16x16 (video)."""
    g = torch.Generator().manual_seed(0)
    c = family.latent_channels
    shape = (1, c, 3, 16, 16) if family.is_video else (1, c, 32, 32)
    return torch.randn(shape, generator=g).to(device)


def _decode(model, z):
    with torch.inference_mode():
        return model.decode(z).sample.float()


@contextmanager
def exact_fp32():
    """fp32 reference decodes without TF32 (PyTorch lets cuDNN convs use TF32 by default: ~1e-3 relative error, which
    would be charged to bf16/fp8 by the gate)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def kept_desc(keep: list[str], why: dict, rows: list[dict] | None, stored: str | None) -> str:
    """'conv_in, conv_out: first/last; a (50.3 dB alone, dominant), b (54.2 dB alone): most sensitive, measured ...'"""
    alone = {r["layer"]: r["psnr_db"] for r in rows or []}
    first = [k for k in keep if why.get(k) == "first/last"]
    prior = [k for k in keep if why.get(k) == "stored"]
    meas = [k for k in keep if why.get(k) in ("dominant", "gate")]
    parts = [f"{', '.join(first)}: first/last"] if first else []
    if prior:
        parts.append(f"{', '.join(prior)}: most sensitive in the stored measurement of {stored} "
                     "(configs/fp8_sensitivity.json)")
    if meas:
        parts.append(", ".join(f"{k} ({alone[k]:.1f} dB alone{', dominant' if why[k] == 'dominant' else ''})"
                               for k in meas) + ": most sensitive, measured on the probe")
    return "; ".join(parts)


def run(model: nn.Module, convert: Callable[..., dict], revert: Callable[[nn.Module], int], family=None,
        gate_db: float = 40.0, device=None, dtype=torch.bfloat16, compute: bool = True,
        probe: torch.Tensor | None = None, sensitivity: str = "auto", margin_db: float = 1.0, max_rounds: int = 2,
        dominant_share: float = 0.25, max_keep_frac: float = 0.5, log: Callable[[str], None] | None = None
        ) -> tuple[str, str, dict]:
    """Convert, probe, gate -> (status "applied" | "fallback", the stage's one-line detail, data).
    `convert(model, compute=, keep=)` converts every planned layer but those in `keep` and returns its counts
    (storage, gemm, kept, bytes_before, bytes_after); `revert(model)` undoes it. Which layers stay in `dtype`
    (quant/sensitivity.py measures and chooses):
      sensitivity="auto": conv_in/conv_out, plus the layers stored for this decoder in configs/fp8_sensitivity.json
          when it is one that was measured. If the probe misses the gate: measure each converted layer's sensitivity
          on the probe (one emulated fp32 decode per layer), keep the dominant and most sensitive ones until the
          predicted PSNR (calibrated on the failed probe) clears gate + margin_db, and probe again; at most
          `max_rounds` retries, and never more than `max_keep_frac` of the weights kept. Else undone.
      "off": conv_in/conv_out only, one try.
    `probe`: the latent to probe with (default: a seeded N(0, 1) latent, 32x32 or 3x16x16).
    A verdict stored for the same weights, probe and settings on this GPU (vaeopt.cache) is applied without probing;
    `log` gets one line if a stored entry was unreadable."""
    if sensitivity not in ("auto", "off"):
        raise ValueError(f"sensitivity={sensitivity!r}: auto | off")
    if margin_db < 0:
        raise ValueError(f"margin_db={margin_db}: the retry aims at gate + margin, margin >= 0")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    z = (probe if probe is not None else probe_latent(family, device)).to(device)
    key = {"weights": cache.weights_fingerprint(model), "probe": probe_digest(z), "dtype": str(dtype),
           "compute": compute, "gate_db": gate_db, "sensitivity": sensitivity, "margin_db": margin_db,
           "max_rounds": max_rounds, "dominant_share": dominant_share, "max_keep_frac": max_keep_frac}
    hit = cache.get("fp8_gate", key, device, log)
    if hit is not None and hit.get("status") in ("applied", "fallback") and isinstance(hit.get("keep"), list):
        data = {**hit["data"], "reused": str(hit.path)}
        if hit["status"] == "applied":
            convert(model, compute=compute, keep=hit["keep"])
        return hit["status"], f"{hit['detail']}; {reused_note(hit)}", data
    status, detail, data = _run(model, convert, revert, family, gate_db, device, dtype, compute, z, sensitivity,
                                margin_db, max_rounds, dominant_share, max_keep_frac)
    if "error" not in data:  # a kernel that failed here is not a verdict on the weights
        cache.put("fp8_gate", key, {"status": status, "detail": detail, "keep": data.get("kept_layers", []),
                                    "data": data}, device, log)
    return status, detail, data


def probe_digest(z: torch.Tensor) -> str:
    """A hash of a probe latent's shape and values (a small tensor: one copy to the host)."""
    f = z.detach().float().flatten()
    return cache.digest([list(z.shape), f[:4096].cpu().tolist(), float(f.sum()), float(f.square().sum())])


def reused_note(hit) -> str:
    """'verdict reused from 2026-11-29 01:12 UTC (vaeopt cache, no probe run; VAEOPT_CACHE=off to measure again)'"""
    return f"verdict reused from {hit.when} (vaeopt cache, no probe run; VAEOPT_CACHE=off to measure again)"


def _run(model, convert, revert, family, gate_db, device, dtype, compute, z, sensitivity, margin_db, max_rounds,
         dominant_share, max_keep_frac) -> tuple[str, str, dict]:
    dname = str(dtype).replace("torch.", "")
    compute_here = compute and device.type == "cuda"  # what convert() will do, for the emulation to match
    # fp32 reference of the same weights (upcast temporarily), and the plain low-precision decode for context
    model.float()
    with exact_fp32():
        ref = _decode(model, z.float()).clamp(-1, 1)
    keep, why = list(KEEP), {k: "first/last" for k in KEEP}
    stored = sens.stored_keep(model) if sensitivity != "off" else None
    for n in stored[1] if stored else []:
        keep.append(n)
        why[n] = "stored"
    model.to(dtype)
    base = _decode(model, z.to(dtype)).clamp(-1, 1)
    p_base, base_mse = psnr(base, ref), sens.mse([base], [ref])
    sizes = {n: layer.weight.numel() for n, layer, _ in sens.candidates(model, compute_here)}
    rows, sens_s = None, 0.0

    def measure():  # per-layer sensitivity on the probe, emulated in fp32 (the fp8 error alone)
        nonlocal rows, sens_s
        t0 = time.perf_counter()
        model.float()
        with exact_fp32():
            rows = sens.measure(model, [z.float()], names=[n for n in sizes if not is_kept(n, keep)],
                                compute=compute_here, ref=[ref])
        model.to(dtype)
        sens_s = time.perf_counter() - t0

    def choose(calib):
        kept, _pred, w = sens.choose_keep(rows, gate_db + margin_db, keep=keep, floor_mse=base_mse, calib=calib,
                                          dominant_share=dominant_share)
        return kept, {**w, **why}

    tries, stop = [], ""
    while True:
        stats = convert(model, compute=compute, keep=keep)
        try:
            out = _decode(model, z.to(dtype)).clamp(-1, 1)
        except RuntimeError as e:  # an fp8 kernel this torch/GPU combination lacks: undo, say why
            revert(model)
            return "fallback", f"fp8 decode failed here, undone: {str(e).splitlines()[0][:150]}", \
                {**stats, "error": str(e)[:500]}
        p = psnr(out, ref)
        tries.append({"kept": list(keep), "fp8_layers": stats["storage"] + stats["gemm"], "psnr_db": p})
        if p >= gate_db:
            break
        revert(model)
        if sensitivity == "off" or len(tries) > max_rounds:
            break
        if p_base < gate_db:
            stop = f"{dname} alone is under the gate"
            break
        if rows is None:
            measure()
        fp8_sum = sum(r["mse"] for r in rows if not is_kept(r["layer"], keep))
        calib = (sens.mse([out], [ref]) - base_mse) / fp8_sum if fp8_sum > 0 else 1.0
        new_keep, new_why = choose(calib)
        if len(new_keep) == len(keep):  # (with margin >= 0 the failed probe always asks for more)
            stop = "no layer left to keep"
            break
        frac = sum(v for n, v in sizes.items() if is_kept(n, new_keep)) / sum(sizes.values())
        if frac > max_keep_frac:
            stop = (f"the gate would need {len(new_keep)} layers, {100 * frac:.0f}% of the weights, kept in {dname}: "
                    "not worth it")
            break
        keep, why = new_keep, new_why
    if p < gate_db and not stop and len(tries) > 1:
        stop = f"still under the gate after {len(tries) - 1} retr{'y' if len(tries) == 2 else 'ies'}"
    saved = (stats["bytes_before"] - stats["bytes_after"]) / 2**20
    data = {**stats, "psnr_db": p, "psnr_plain_db": p_base, "gate_db": gate_db, "saved_mib": saved,
            "kept_layers": keep, "kept_why": {k: why[k] for k in keep}, "tries": tries,
            "stored": stored[0] if stored else None, "sensitivity_s": sens_s,
            "sensitivity": [{"layer": r["layer"], "psnr_db": r["psnr_db"]} for r in rows] if rows else None}
    # what happened: "; tries: 39.5 dB with 37 in e4m3 -> 42.3 dB with 35 in e4m3; per-layer sensitivity on the probe
    # (37 decodes, 0.2 s)"
    hist = ""
    if rows is not None or len(tries) > 1:
        steps = [f"{t['psnr_db']:.1f} dB with {t['fp8_layers']} in e4m3" for t in tries]
        measured = f"per-layer sensitivity on the probe ({len(rows)} decodes, {sens_s:.1f} s)" if rows else ""
        hist = (f"; tries: {' -> '.join(steps)}" if len(tries) > 1 else "") + (f"; {measured}" if measured else "")
    if p < gate_db:
        return ("fallback",
                f"probe {p:.1f} dB vs fp32 < gate {gate_db:g} dB with {len(keep)} kept in {dname} "
                f"({kept_desc(keep, why, rows, stored and stored[0])}){hist}"
                f"{': ' + stop if stop else ''}; undone ({dname} alone: {psnr_text(p_base)})", data)
    how = (f"{stats['storage']} convs with weight storage, {stats['gemm']} 1x1/linear as fp8 GEMMs" if compute_here
           else "weight storage, dequantized per layer: level 1 only, no fp8 GEMMs")
    return ("applied",
            f"{stats['storage'] + stats['gemm']} layers in e4m3 ({how}), kept {stats['kept']} in {dname} "
            f"({kept_desc(keep, why, rows, stored and stored[0])}); weights {saved:.1f} MiB smaller; "
            f"probe {p:.1f} dB vs fp32 (gate {gate_db:g}; {dname} alone {psnr_text(p_base)}){hist}", data)
