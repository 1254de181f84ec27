"""Per-layer FP8 sensitivity of a decoder, measured by decoding, and the policy that picks the layers kept out of fp8.

For each layer the fp8 stage would convert: quantize only that layer the way the stage would, decode, compare with the
unquantized decode of the same latents (PSNR, MSE). Quantization is emulated — values rounded through float8_e4m3fn
and back with the stage's own scales, then the layer runs in the model's dtype (fp32 for a measurement, so the number
is the fp8 error alone) — so it runs anywhere, CPU included, and needs no FP8 tensor cores. On an H200 the emulation
matched the real kernels: storage layers to 0.01 dB, GEMM layers within 0.4 dB (docs/experiments.md, E11).

Two recipes (what "quantize a layer" means):
  "stage"  what the fp8 stage runs: convs it stores (level 1) get e4m3 weights with one scale per output channel and
           untouched activations (the weight is dequantized to the compute dtype); 1x1 convs and linears it runs as
           fp8 GEMMs (level 2, `compute=True`) get one weight scale per tensor and the input quantized to e4m3 with a
           dynamic per-tensor scale, as `FP8GemmLinear` does.
  "w8a8"   every layer: per-output-channel e4m3 weights and per-tensor dynamic e4m3 inputs — the numerics of fp8
           compute for every conv (level 3, not built yet); the stricter of the two.

Errors of different layers are close to independent, so their MSEs add: the predicted MSE of a set of fp8 layers is the
sum of their single-layer MSEs. `cumulative` measures how well that holds (docs/experiments.md, E11), and the policy
(`choose_keep`) uses it, calibrated against a measured probe, to pick how many of the most sensitive layers to keep.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from vaeopt.fidelity import PSNR_CAP
from vaeopt.quant.numerics import E4M3, E4M3_MAX, fake_quant  # noqa: F401
from vaeopt.quant.plan import KEEP, MODES, candidates, is_kept, recipe  # noqa: F401

STORED = Path(__file__).resolve().parent.parent / "configs" / "fp8_sensitivity.json"


# ---- emulated quantization ---------------------------------------------------------------------------------------

def _act_pre_hook(mod, args):
    """Per-tensor e4m3 input, as FP8GemmLinear quantizes it. A causal conv's cache (args[1]) is concatenated in front
    of its input before the conv runs, so both share one scale, as one quantized input would."""
    x = args[0]
    cache = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
    amax = x.detach().abs().amax().float()
    if cache is not None:
        amax = torch.maximum(amax, cache.detach().abs().amax().float().to(amax.device))
    s = amax.clamp_min(1e-12) / E4M3_MAX

    def q(t):
        return ((t.float() / s.to(t.device)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()
                * s.to(t.device)).to(t.dtype)

    return (q(x),) + ((q(cache),) if cache is not None else args[1:2]) + tuple(args[2:])


@contextmanager
def emulated(model: nn.Module, names: Iterable[str], mode: str = "stage", compute: bool = True):
    """Within the block, the named decoder layers compute with e4m3-rounded weights (and inputs, per `recipe`).
    The weights are restored bit for bit on exit."""
    layers = {n: (layer, path) for n, layer, path in candidates(model, compute)}
    saved, hooks = [], []
    try:
        for n in names:
            if n not in layers:
                raise KeyError(f"{n!r} is not a layer the fp8 stage converts")
            layer, path = layers[n]
            per_channel, act = recipe(path, mode)
            w = layer.weight.data
            saved.append((layer, w))
            layer.weight.data = fake_quant(w, per_channel)
            if act:
                hooks.append(layer.register_forward_pre_hook(_act_pre_hook))
        yield
    finally:
        for layer, w in saved:
            layer.weight.data = w
        for h in hooks:
            h.remove()


# ---- measuring ---------------------------------------------------------------------------------------------------

def decode_all(model: nn.Module, latents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Decode each latent (raw decoder latents), clamped to [-1, 1] as the fidelity gate compares them."""
    with torch.inference_mode():
        return [model.decode(z).sample.float().clamp(-1, 1) for z in latents]


def mse(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    """Mean squared error over all pixels of all outputs (fp64)."""
    se = sum(((o.double() - r.double()) ** 2).sum().item() for o, r in zip(outs, refs))
    return se / sum(r.numel() for r in refs)


def psnr_of(m: float) -> float:
    """PSNR in dB for an MSE on [-1, 1] images (data range 2), capped like vaeopt.fidelity."""
    return PSNR_CAP if m <= 0 else min(PSNR_CAP, 10.0 * math.log10(4.0 / m))


def measure(model: nn.Module, latents: Sequence[torch.Tensor], names: Sequence[str] | None = None,
            mode: str = "stage", compute: bool = True, ref: Sequence[torch.Tensor] | None = None,
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """Quantize one layer at a time and decode `latents`: a row per layer, most sensitive (largest MSE) first:
    {"layer", "path", "params", "mse", "psnr_db"} — psnr_db is the whole decode's PSNR vs `ref` (the unquantized
    decode; computed here if not given) with only that layer in e4m3. One decode per layer."""
    ref = decode_all(model, latents) if ref is None else ref
    cands = candidates(model, compute)
    want = [n for n, _, _ in cands] if names is None else list(names)
    info = {n: (layer, path) for n, layer, path in cands}
    rows = []
    for i, n in enumerate(want):
        layer, path = info[n]
        with emulated(model, [n], mode, compute):
            m = mse(decode_all(model, latents), ref)
        rows.append({"layer": n, "path": path, "params": layer.weight.numel(), "mse": m, "psnr_db": psnr_of(m)})
        if progress:
            progress(f"  [{i + 1}/{len(want)}] {n}: {psnr_of(m):.1f} dB")
    return sorted(rows, key=lambda r: -r["mse"])


def cumulative(model: nn.Module, latents: Sequence[torch.Tensor], rows: Sequence[dict], mode: str = "stage",
               compute: bool = True, ref: Sequence[torch.Tensor] | None = None,
               progress: Callable[[str], None] | None = None) -> list[dict]:
    """Layers converted from least to most sensitive (`rows` as `measure` returns them), one more per step: a row per
    step with the measured PSNR and the one predicted by adding single-layer MSEs."""
    ref = decode_all(model, latents) if ref is None else ref
    order = [r["layer"] for r in reversed(rows)]
    single = {r["layer"]: r["mse"] for r in rows}
    out = []
    for k in range(1, len(order) + 1):
        with emulated(model, order[:k], mode, compute):
            m = mse(decode_all(model, latents), ref)
        pred = sum(single[n] for n in order[:k])
        out.append({"n_fp8": k, "added": order[k - 1], "mse": m, "psnr_db": psnr_of(m),
                    "predicted_psnr_db": psnr_of(pred)})
        if progress:
            progress(f"  +{order[k - 1]} ({k} in fp8): {psnr_of(m):.1f} dB (predicted {psnr_of(pred):.1f})")
    return out


# ---- the policy --------------------------------------------------------------------------------------------------

def choose_keep(rows: Sequence[dict], target_db: float, keep: Sequence[str] = KEEP, floor_mse: float = 0.0,
                calib: float = 1.0, dominant_share: float = 0.25) -> tuple[list[str], float, dict[str, str]]:
    """The layers to keep out of fp8, from single-layer measurements (`rows` as `measure` returns them):
      1. `keep` (conv_in, conv_out by default);
      2. any other layer whose error dominates: its single-layer MSE is >= `dominant_share` of the summed MSE of all
         the layers that would be converted (a layer like that costs most of the fidelity for a sliver of the bytes);
      3. then the most sensitive of the rest, one at a time, until the predicted PSNR reaches `target_db`.
    Predicted MSE = floor_mse (the error without fp8, e.g. bf16's) + calib * (sum of the converted layers' MSEs);
    calib scales the emulated sum to what a real decode measured (1: trust the sum).
    Returns (kept names, predicted PSNR, {name: why}) with why one of "first/last", "dominant", "gate"."""
    kept = list(keep)
    why = {k: "first/last" if k in KEEP else "kept" for k in kept}
    rest = sorted((r for r in rows if not is_kept(r["layer"], kept)), key=lambda r: -r["mse"])
    total = sum(r["mse"] for r in rest)
    for r in [r for r in rest if total > 0 and r["mse"] >= dominant_share * total]:
        kept.append(r["layer"])
        why[r["layer"]] = "dominant"
        rest.remove(r)
    total = sum(r["mse"] for r in rest)
    while rest and psnr_of(floor_mse + calib * total) < target_db:
        worst = rest.pop(0)
        kept.append(worst["layer"])
        why[worst["layer"]] = "gate"
        total -= worst["mse"]
    return kept, psnr_of(floor_mse + calib * max(total, 0.0)), why


# ---- stored measurements -----------------------------------------------------------------------------------------

def fingerprint(model: nn.Module) -> str:
    """Identifies a decoder's weights across dtypes and devices: layer names, shapes and the mean |w| of each layer
    to 2 significant digits (bf16 rounding moves a mean by ~1e-4 relative, rarely across a digit; a miss only means
    the stage measures at run time instead)."""
    h = hashlib.sha256()
    for n, layer, _ in candidates(model, compute=False):
        w = layer.weight.detach()
        h.update(f"{n}:{tuple(w.shape)}:{w.float().abs().mean().item():.1e};".encode())
    return h.hexdigest()[:16]


def load_stored(path: Path | None = None) -> dict:
    try:
        return json.loads(Path(path or STORED).read_text())
    except (OSError, ValueError):
        return {}


def stored_keep(model: nn.Module, path: Path | None = None) -> tuple[str, list[str]] | None:
    """(entry name, extra layers to keep) when `model` is one of the decoders measured in the stored file."""
    fp = fingerprint(model)
    for name, entry in load_stored(path).get("models", {}).items():
        if entry.get("fingerprint") == fp:
            return name, [n for n in entry.get("keep", []) if not is_kept(n, KEEP)]
    return None
