"""VRAM planner: choose whole / tiled / chunked decoding from a memory budget.

Peak memory of a decode is modelled per diffusers class as
    peak ≈ weights + act_bytes_per_px · dtype_bytes · pixels_in_flight + output bytes
where pixels_in_flight is the output pixels of one decoder call (whole image; or one temporal chunk of video).
The coefficients live in configs/memory_model.json with the measurements they were fitted from.
Tiling is never free, so the planner tiles only when the whole decode does not fit.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from vaeopt.families import CONFIG_DIR, FamilySpec

RESERVE_FRACTION = 0.10  # headroom kept free for the allocator's fragmentation and cuDNN workspaces
RESERVE_MIN = 512 * 2**20
# Latent frames per decoder call. Measured on an H200 (docs/perf-notes.md E5/E9): 2 frames ~2% faster than 1 on
# Wan 2.1; 8 frames -4% (480p), -0.4% (720p) on Wan 2.1 but +9% slower on Wan 2.2, at 2.5-3.5x the memory.
MAX_CHUNK = 2


def memory_model() -> dict:
    return json.loads((CONFIG_DIR / "memory_model.json").read_text())


@dataclass
class Plan:
    mode: str  # "whole", "tiled", "chunked"
    budget_bytes: int | None
    est_bytes: int
    tile: int | None = None  # latent pixels per tile side
    chunk: int | None = None  # latent frames per decoder call
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def gib(b: float) -> str:
    return f"{b / 2**30:.1f} GB"


def _weights_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    dec = [m for m in (getattr(model, "post_quant_conv", None), getattr(model, "decoder", None)) if m is not None]
    n = sum(p.numel() for m in dec for p in m.parameters()) if dec else sum(p.numel() for p in model.parameters())
    return n * torch.tensor([], dtype=dtype).element_size()


def _coef(family: FamilySpec, model=None) -> tuple[float, int]:
    """(activation bytes per output pixel per dtype byte, constant bytes) for this family and pipeline."""
    mm = memory_model()
    entry = mm.get(family.name) or mm.get(family.cls_name) or mm["default"]
    if model is not None and getattr(model, "_vaeopt_fused_epilogues", None) and "act_bytes_per_px_fused" in entry:
        # fused stages hold fewer activations (measured); the constant is cuDNN workspace and allocator slack
        return float(entry["act_bytes_per_px_fused"]), int(entry.get("const_bytes_fused", 0))
    return float(entry["act_bytes_per_px"]), int(entry.get("const_bytes", 0))


def estimate_whole(family: FamilySpec, model, latent_shape: tuple, dtype: torch.dtype, chunk: int | None = None) -> int:
    """Peak bytes of an untiled decode (video: one decoder call of `chunk` latent frames)."""
    eb = torch.tensor([], dtype=dtype).element_size()
    n = latent_shape[0]
    h, w = latent_shape[-2] * family.spatial_factor, latent_shape[-1] * family.spatial_factor
    if family.is_video:
        t_lat = latent_shape[2]
        frames_in_flight = (chunk or 1) * family.temporal_factor
        px = n * frames_in_flight * h * w
        out = n * family.output_frames(t_lat) * h * w * 3 * eb
    else:
        px = n * h * w
        out = n * h * w * 3 * eb
    slope, const = _coef(family, model)
    return int(_weights_bytes(model, dtype) + slope * eb * px + const + out)


def budget_bytes(device: torch.device, vram_budget_gb: float | None) -> tuple[int | None, str]:
    if vram_budget_gb is not None:
        return int(vram_budget_gb * 2**30), f"--vram-budget {vram_budget_gb:g} GB"
    if device.type != "cuda":
        return None, "CPU"
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # our cache is reusable
    reserve = max(RESERVE_MIN, int(free * RESERVE_FRACTION))
    return free - reserve, f"{gib(free)} free - {gib(reserve)} reserve"


def plan_decode(family: FamilySpec, model, latent_shape: tuple, dtype: torch.dtype, device: torch.device,
                vram_budget_gb: float | None = None, tile: int | None = None, chunk: int | None = None,
                tiling: str = "auto") -> Plan:
    budget, why = budget_bytes(device, vram_budget_gb)
    if family.is_video:
        return _plan_video(family, model, latent_shape, dtype, budget, why, chunk)
    whole = estimate_whole(family, model, latent_shape, dtype)
    if tile is not None or tiling == "on":
        t = tile or _largest_tile(family, model, latent_shape, dtype, budget or whole // 2)
        return Plan("tiled", budget, _estimate_tiled(family, model, latent_shape, dtype, t), tile=t,
                    reason=f"tile {t * family.spatial_factor}px requested" if tile else "tiling forced")
    if budget is None or whole <= budget or tiling == "off" or family.cls_name != "AutoencoderKL":
        if budget is None:
            reason = f"whole decode (est. {gib(whole)}; {why}: memory not planned)"
        elif whole <= budget:
            reason = f"whole decode: est. {gib(whole)} of {gib(budget)} budget ({why})"
        elif tiling == "off":
            reason = f"whole decode (tiling off) although est. {gib(whole)} > {gib(budget)} budget"
        else:
            reason = f"whole decode: est. {gib(whole)} > {gib(budget)}, and {family.cls_name} has no seamless tiler"
        return Plan("whole", budget, whole, reason=reason)
    t = _largest_tile(family, model, latent_shape, dtype, budget)
    est = _estimate_tiled(family, model, latent_shape, dtype, t)
    px = t * family.spatial_factor
    return Plan("tiled", budget, est, tile=t,
                reason=f"tile {px}x{px}: est. {gib(est)} of {gib(budget)} budget ({why}); whole would need {gib(whole)}")


def _estimate_tiled(family, model, latent_shape, dtype, tile: int) -> int:
    from vaeopt import tiling

    return int(tiling.estimate_tiled_bytes(model, tuple(latent_shape[-2:]), tile, dtype, batch=latent_shape[0]))


def _largest_tile(family, model, latent_shape, dtype, budget: int) -> int:
    h, w = latent_shape[-2:]
    t = max(h, w)
    t = (t + 7) // 8 * 8
    while t > 8 and _estimate_tiled(family, model, latent_shape, dtype, t) > budget:
        t -= 8
    return t


def estimate_video(family, model, latent_shape, dtype, chunk: int) -> int:
    """Peak bytes of a chunked video decode: the dry-run estimate of vaeopt.video (activations and static caches of
    one chunk) + weights + the whole-clip output + 15% for allocator rounding and cuDNN workspaces."""
    if family.cls_name != "AutoencoderKLWan":
        return estimate_whole(family, model, latent_shape, dtype, chunk)
    from vaeopt import video

    eb = torch.tensor([], dtype=dtype).element_size()
    cl = any(m.weight.is_contiguous(memory_format=torch.channels_last_3d) and not m.weight.is_contiguous()
             for m in model.decoder.modules() if isinstance(m, torch.nn.Conv3d) and m.weight is not None)
    act = video.estimate_chunk_bytes(model, latent_shape, chunk, dtype, channels_last=cl)
    n, _, t, h, w = latent_shape
    out = n * 3 * family.output_frames(t) * h * family.spatial_factor * w * family.spatial_factor * eb
    return int(1.15 * act + _weights_bytes(model, dtype) + out)


def _host_budget() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def _plan_video(family, model, latent_shape, dtype, budget, why, chunk) -> Plan:
    t_lat = latent_shape[2]
    if family.cls_name != "AutoencoderKLWan":
        est = estimate_whole(family, model, latent_shape, dtype, t_lat)
        return Plan("whole", budget, est, reason=f"whole clip through diffusers' {family.cls_name}.decode (vaeopt's "
                                                 f"chunked video decoder covers Wan only): est. {gib(est)}")
    if chunk is not None:
        est = estimate_video(family, model, latent_shape, dtype, chunk)
        return Plan("chunked", budget, est, chunk=chunk, reason=f"chunk {chunk} latent frames requested")
    if budget is None:
        # CPU: bigger chunks are much faster here (fewer, larger convs: 15.8 s -> 4.4 s for a 5-frame clip of the tiny
        # model, docs/notes-video.md); plan them from half the available host memory.
        budget, why = _host_budget(), "half of the available host memory"
    best = None
    for k in range(1, min(MAX_CHUNK, max(t_lat - 1, 1)) + 1):
        est = estimate_video(family, model, latent_shape, dtype, k)
        if est <= budget:
            best = (k, est)
    if best is None:
        est = estimate_video(family, model, latent_shape, dtype, 1)
        return Plan("chunked", budget, est, chunk=1,
                    reason=f"chunk 1: est. {gib(est)} exceeds the {gib(budget)} budget ({why}); may run out of memory")
    k, est = best
    return Plan("chunked", budget, est, chunk=k,
                reason=f"chunk {k} latent frame(s) ({family.temporal_factor * k} output frames) per call: "
                       f"est. {gib(est)} of {gib(budget)} budget ({why})")
