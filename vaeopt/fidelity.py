"""Fidelity metrics vs a reference decode (images in [-1, 1])."""

from __future__ import annotations

import math

import torch


PSNR_CAP = 200.0  # identical outputs report 200 dB (keeps JSON numeric; real differences stay far below)


def psnr_text(db: float | None, unit: str = " dB") -> str:
    """A PSNR for people: "exact" for the cap (identical outputs), not a measured-looking 200.0."""
    if db is None:
        return "-"
    return "exact" if db >= PSNR_CAP else f"{db:.1f}{unit}"


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN/Inf elements of t, counted in pieces (no full-size bool temporary for a long decode)."""
    return sum(int(part.numel() - torch.isfinite(part).sum()) for part in t.reshape(-1).split(1 << 24))


def psnr(x: torch.Tensor, ref: torch.Tensor, data_range: float = 2.0) -> float:
    """PSNR in dB of x against ref, both in [-1, 1] (data range 2), capped at PSNR_CAP."""
    mse = torch.mean((x.detach().double().cpu() - ref.detach().double().cpu()) ** 2).item()
    if mse == 0:
        return PSNR_CAP
    return min(PSNR_CAP, 10.0 * math.log10(data_range**2 / mse))


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.detach().double().cpu() - ref.detach().double().cpu()).abs().max().item()


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch {tuple(x.shape)} vs {tuple(ref.shape)}")
    if not torch.isfinite(x).all():
        return {"psnr_db": 0.0, "max_abs": math.inf, "finite": False}
    return {"psnr_db": psnr(x, ref), "max_abs": max_abs(x, ref), "finite": True}
