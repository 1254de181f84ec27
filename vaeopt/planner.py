"""VRAM planner: choose whole / tiled / chunked decoding from a memory budget.

Peak memory of a decode is modelled per diffusers class as
    peak ≈ weights + act_bytes_per_px · dtype_bytes · pixels_in_flight + output bytes
where pixels_in_flight is the output pixels of one decoder call (whole image; or one temporal chunk of video).
The coefficients live in configs/memory_model.json with the measurements they were fitted from.
Tiling is never free, so the planner tiles only when the whole decode does not fit.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass

import torch

from vaeopt import cache, tiling_memory
from vaeopt import video_stream
from vaeopt import video_tiling as vt
from vaeopt.engine.memory import stacked_names
from vaeopt.engine.regions import (TilingError, band_tiles, front_scale, min_tile_rows, receptive_field,
                                   tile_grid)
from vaeopt.engine.wan_ops import fused_from_env
from vaeopt.errors import VaeoptError
from vaeopt.families import CONFIG_DIR, FamilySpec
from vaeopt.stages.fused_norms import has_fused_rms_norms

RESERVE_FRACTION = 0.10  # headroom kept free for the allocator's fragmentation and cuDNN workspaces
RESERVE_MIN = 512 * 2**20
# Latent frames per decoder call. Measured on an H200 (docs/experiments.md E5/E9): 2 frames ~2% faster than 1 on
# Wan 2.1; 8 frames -4% (480p), -0.4% (720p) on Wan 2.1 but +9% slower on Wan 2.2, at 2.5-3.5x the memory.
MAX_CHUNK = 2
# With Wan 2.1's convs time-stacked (stages/stacked_conv3d) the untiled decode gains from 3 (h200_wan_stack_2026-11-21:
# 480p 665.7 -> 641.7 ms, 720p 1538.6 -> 1502.5 ms, +1.4 / +3.3 GiB; 4 frames no faster).
MAX_CHUNK_STACKED = 3
# Wan 2.2 (residual up blocks, patch 2): 1 frame per call measured fastest (h200_wan22-720p_2026-11-21e: 3164-3173 ms at
# 1 vs 3238 ms at 2 after the phase upsample convs).
MAX_CHUNK_WAN22 = 1
# A Wan plan made from free memory is made for it rounded down to this step (planned and cached alike): a stored plan
# then fits every later run with as much free memory, and the step costs at most a quarter GiB of the budget.
BUDGET_STEP = 2**28


def memory_model() -> dict:
    return json.loads((CONFIG_DIR / "memory_model.json").read_text())


@dataclass
class Plan:
    mode: str  # "whole", "tiled", "chunked"
    budget_bytes: int | None
    est_bytes: int
    tile: int | tuple[int, int] | None = None  # latent pixels per tile side; video: (rows, cols) of a tile
    chunk: int | None = None  # latent frames per decoder call
    reason: str = ""
    split: int | None = None  # video tiles: the first tiled up block (vaeopt.video_tiling)
    storage: str | None = None  # video tiles: where the per-tile causal caches live, "device" or "host"

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def graphs_rule() -> dict:
    """configs/graphs_rule.json: graph replay against eager decodes, measured per family and size."""
    return json.loads((CONFIG_DIR / "graphs_rule.json").read_text())


def graphs_pay(family: FamilySpec, latent_shape: tuple, repeats: int, variant: str = "bf16",
               gpu: str | None = None) -> tuple[bool, str]:
    """Whether CUDA graphs pay for `repeats` whole decodes of `latent_shape` (one capture, then replays) on the GPU
    named `gpu` (as torch names it; DeviceInfo.gpu), from the measured table (configs/graphs_rule.json,
    graphs_rule()): the row of this family (else of its diffusers class) and variant ("bf16", or "8bit" where the
    8-bit convs run; else the other) at the nearest output pixel count within the table's max_pixel_ratio. They pay
    when repeats x the replay's saving per decode exceeds the capture's cost (the first decode's warm-up and
    capture). A row counts as measured only on its own GPU; elsewhere its capture cost is taken
    unmeasured_capture_margin times over, so an unmeasured GPU captures only for long runs.
    -> (pay, why: the numbers and where they come from)."""
    rule = graphs_rule()
    f = family.spatial_factor
    px = latent_shape[0] * latent_shape[-2] * latent_shape[-1] * f * f
    if family.is_video:  # a one-chunk clip (stage_table.one_chunk_clip): every output frame is decoded
        px *= family.output_frames(latent_shape[2])
    rows = [r for r in rule["rows"] if r["family"] == family.name] or \
        [r for r in rule["rows"] if r["cls"] == family.cls_name]
    rows = [r for r in rows if abs(math.log(px / r["pixels"])) <= math.log(rule["max_pixel_ratio"])]
    if not rows:
        return False, (f"no graph measurement for {family.title} near {px / 1e6:.2f} MP per decode "
                       "(configs/graphs_rule.json)")
    r = min(rows, key=lambda r: (r["gpu"] != gpu, r["variant"] != variant, abs(math.log(px / r["pixels"]))))
    saving = r["eager_ms"] - r["replay_ms"]
    capture = r["capture_ms"] or rule["capture_factor"] * r["eager_ms"]
    at = (f"{r['workload'] or r['family']} {r['variant']} on an {r['gpu'].replace('NVIDIA ', '')}: "
          f"{r['eager_ms']:.1f} -> {r['replay_ms']:.1f} ms replayed, capture ~{capture:.0f} ms")
    head = ""
    if r["gpu"] != gpu:  # the conservative default: that GPU's numbers with a dearer capture
        margin = rule["unmeasured_capture_margin"]
        capture *= margin
        head = f"no measured row for this GPU ({gpu or 'unknown'}): "
        at += f", taken as {margin:g}x that, ~{capture:.0f} ms"
    if saving <= 0:
        return False, f"{head}replay measured no faster ({at})"
    need = math.ceil(capture / saving)
    if repeats < need:
        return False, f"{head}{repeats} decode(s) of this shape: the capture pays from {need} ({at})"
    return True, f"{head}{repeats} decodes of the same shape, paying from {need} ({at})"


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
        return int(vram_budget_gb * 2**30), f"{vram_budget_gb:g} GB asked for"
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
    if family.cls_name == "AutoencoderKLWan" and budget is not None:
        # its plans come from dry runs of the decoder (seconds per shape): kept on disk for the next process (not on
        # the CPU without a budget, whose host-memory budget changes from run to run). Free memory differs by
        # megabytes from run to run, so it is planned for rounded down to a step: the same plan on a hit as on a
        # miss, never over the real budget.
        given = vram_budget_gb is not None
        if not given:
            budget = max(BUDGET_STEP, budget // BUDGET_STEP * BUDGET_STEP) if budget >= BUDGET_STEP else budget
            why = f"{why}, rounded down to {BUDGET_STEP / 2**30:g} GB steps"
        key = _plan_key(family, model, latent_shape, dtype, device, budget, "given" if given else "free memory",
                        chunk, tile, tiling)
        hit = cache.get("plans", key, device)
        if hit is not None:
            try:
                old_why = hit.pop("why", why)  # this run's free memory in the reason, not the stored run's
                p = Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in hit.items()})
                p.reason = p.reason.replace(old_why, why)
                return p
            except TypeError:  # a Plan of another layout: planned again below, and stored anew
                pass
        p = _plan_video(family, model, latent_shape, dtype, budget, why, chunk, tile, tiling, device)
        cache.put("plans", key, {**p.to_dict(), "why": why}, device)
        return p
    if family.is_video:
        return _plan_video(family, model, latent_shape, dtype, budget, why, chunk, tile, tiling, device)
    whole = estimate_whole(family, model, latent_shape, dtype)
    host = None  # CPU: half the available host memory, where the decode was checked against it
    if budget is None and family.cls_name == "AutoencoderKL" and tiling != "off":
        host = _host_budget()
        if whole > host:  # CPU: a decode that would not fit in host memory is tiled like one on the GPU (a 3072²
            budget, why = host, "half of the available host memory"  # SDXL image needs ~47 GB whole)
    if tile is not None or tiling == "on":
        t = tile or largest_tile(family, model, latent_shape, dtype, budget or whole // 2)
        h, w = latent_shape[-2:]
        t = min(t, max(h, w))  # a tile beyond the latent is the latent: said as the size used
        f = family.spatial_factor
        reason = "tiling forced" if not tile else f"tile {t * f}px requested" if t == tile else (
            f"tile {t * f}px (the tile of {tile} asked for is larger than the {h}x{w} latent: one tile, the whole image)")
        return Plan("tiled", budget, _estimate_tiled(family, model, latent_shape, dtype, t), tile=t, reason=reason)
    if budget is None or whole <= budget or tiling == "off" or family.cls_name != "AutoencoderKL":
        if budget is None and host is not None:
            reason = f"whole decode (est. {gib(whole)}; {why}: within half the available host memory, {gib(host)})"
        elif budget is None:
            reason = f"whole decode (est. {gib(whole)}; {why}: memory not planned)"
        elif whole <= budget:
            reason = f"whole decode: est. {gib(whole)} of {gib(budget)} budget ({why})"
        elif tiling == "off":
            reason = f"whole decode (tiling off) although est. {gib(whole)} > {gib(budget)} budget"
        else:
            reason = f"whole decode: est. {gib(whole)} > {gib(budget)}, and {family.cls_name} has no seamless tiler"
        return Plan("whole", budget, whole, reason=reason)
    t = largest_tile(family, model, latent_shape, dtype, budget)
    est = _estimate_tiled(family, model, latent_shape, dtype, t)
    px = t * family.spatial_factor
    over = ("; over the budget even at the smallest tile: the decode may run out of memory" if est > budget
            else "")
    return Plan("tiled", budget, est, tile=t,
                reason=f"tile {px}x{px}: est. {gib(est)} of {gib(budget)} budget ({why}); whole would need "
                       f"{gib(whole)}{over}")


def _plan_key(family, model, latent_shape, dtype, device, budget, why, chunk, tile, tiling) -> dict:
    """What a Wan plan depends on: the architecture (config), how the decoder will run (layout, fused kernels,
    time-stacked convs), the shape, dtype, budget and the user's tile/chunk/tiling choices."""
    cl, fused = _video_flags(model)
    return {"family": family.name, "config": cache.digest(dict(getattr(model, "config", {}) or {})),
            "channels_last": cl, "fused": fused, "stacked": sorted(stacked_names(model)),
            "epilogues": bool(getattr(model, "_vaeopt_fused_epilogues", None)), "shape": list(latent_shape),
            "dtype": str(dtype), "device": torch.device(device).type if device is not None else None,
            "budget": budget, "why": why, "chunk": chunk, "tile": tile, "tiling": tiling,
            "rules": cache.digest([memory_model(), MAX_CHUNK, MAX_CHUNK_STACKED, MAX_CHUNK_WAN22])}


def _estimate_tiled(family, model, latent_shape, dtype, tile: int) -> int:
    return int(tiling_memory.estimate_tiled_bytes(model, tuple(latent_shape[-2:]), tile, dtype, batch=latent_shape[0]))


def largest_tile(family, model, latent_shape, dtype, budget: int) -> int:
    """The largest tile side (latent px, a multiple of 8) whose tiled decode is estimated within `budget` bytes."""
    h, w = latent_shape[-2:]
    t = max(h, w)
    t = (t + 7) // 8 * 8
    while t > 8 and _estimate_tiled(family, model, latent_shape, dtype, t) > budget:
        t -= 8
    return t


def smaller_whole_plan(family, model, latent_shape, dtype, failed: Plan) -> Plan | None:
    """The plan to decode again with after a whole decode planned as `failed` ran out of memory: tiles estimated
    within half its estimate, the image tiler's (largest_tile), or HunyuanVideo's diffusers' spatial tiles (None
    where its frames are no larger than a tile: nothing to tile)."""
    budget = failed.est_bytes // 2
    if family.cls_name == "AutoencoderKLHunyuanVideo":
        tiles = hunyuan_tile(family, model, latent_shape, dtype, budget)
        return None if tiles is None else Plan("tiled", budget, tiles[1], tile=tiles[0] // family.spatial_factor)
    t = largest_tile(family, model, latent_shape, dtype, budget)
    return Plan("tiled", budget, _estimate_tiled(family, model, latent_shape, dtype, t), tile=t)


# ---- Wan: the order of tiled plans, and the re-plan after an out-of-memory error ----------------------------------

# The planner and the OOM re-plan order plans by a rough relative decode time (1 = untiled, device caches): the
# halo rows every interior band edge recomputes (2 * halo per edge at the split's resolution, counted as if all of
# the decode were tiled: an upper bound), CHUNK_COST per latent frame per call below MAX_CHUNK (H200: 2 frames per
# call ~2% faster than 1 on Wan 2.1, docs/experiments.md), and for host cache storage HOST_COST / chunk (every tile's
# caches cross PCIe twice per call; at wan21-720p that is ~2.4 GB per call against ~0.1 s of compute per latent
# frame, so roughly doubling the time).
CHUNK_COST = 0.02
HOST_COST = 1.0
BAND_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # band counts the planner tries (then the 1-row band)
SHRINK_FACTOR = 0.8  # an OOM re-plan must be estimated at <= this fraction of the plan that failed


def plan_cost(vae, latent_hw: tuple[int, int], plan: vt.TiledVideoPlan, max_chunk: int = MAX_CHUNK) -> float:
    cost = 1.0 + CHUNK_COST * max(0, max_chunk - plan.chunk)
    if plan.tile is not None:
        h, w = latent_hw
        halo, _ = receptive_field(vae, plan.split)
        s = front_scale(vae, plan.split)
        ny, nx = -(-h // plan.tile[0]), -(-w // plan.tile[1])
        cost += 2 * halo * ((ny - 1) / (h * s) + (nx - 1) / (w * s))
        if plan.storage == "host":
            cost += HOST_COST / plan.chunk
    return cost


def candidate_plans(vae, latent_hw: tuple[int, int], chunks, host: bool) -> list[vt.TiledVideoPlan]:
    """Tiled plans worth trying, cheapest first (plan_cost): full-width bands (BAND_COUNTS bands, down to the
    halo's minimum rows), split at the last up block or the one before it (earlier splits have larger halos and
    a front too small to matter), each chunk in `chunks`, caches on the device, or on the host when `host`."""
    h, w = latent_hw
    n_up = len(vae.decoder.up_blocks)
    out = set()
    for split in range(n_up - 1, max(-1, n_up - 3), -1):
        try:
            m = min_tile_rows(vae, split)
        except TilingError:
            continue
        rows = sorted({-(-h // n) for n in BAND_COUNTS if n < h} | {1}, reverse=True)
        for r in rows:
            if r < m or r >= h:
                continue
            for k in chunks:
                for st in ("device", "host") if host else ("device",):
                    out.add(vt.TiledVideoPlan(int(k), (r, w), split, st))
    return sorted(out, key=lambda p: (plan_cost(vae, latent_hw, p), p.split != n_up - 1, -p.tile[0]))


def smaller_video_plan(vae, latent_shape, plan: vt.TiledVideoPlan, tried: set, dtype: torch.dtype,
                       channels_last: bool, fused: bool, host: bool) -> vt.TiledVideoPlan | None:
    """The Wan plan to retry with after an out-of-memory error (vaeopt.video_tiling.iter_raw's `replan`): the
    cheapest candidate (plan_cost: a smaller tile before a smaller chunk where the halo costs less, host caches
    last) not tried yet, with a chunk no larger than the failed one, whose dry-run estimate is at most SHRINK_FACTOR
    of the failed plan's; failing that, the candidate with the smallest estimate below it. When the estimates see
    no smaller plan (they leave out cuDNN workspaces and fragmentation, which shrink with the convs), the
    structural ladder: halve the tile (a band's rows; the longer side of a 2D tile) down to the halo's minimum,
    then halve the chunk, then host caches (host: a CUDA device). None when all of those were tried."""
    hw = tuple(latent_shape[-2:])

    def est(p):
        return vt.estimate_tiled_video_bytes(vae, latent_shape, p.chunk, p.tile, dtype, channels_last, fused,
                                             p.split, p.storage)

    cur = est(plan)
    best = None
    for c in candidate_plans(vae, hw, range(plan.chunk, 0, -1), host):
        if c in tried:
            continue
        e = est(c)
        if e <= SHRINK_FACTOR * cur:
            return c
        if e < cur and (best is None or e < best[0]):
            best = (e, c)
    if best is not None:
        return best[1]
    h, w = hw
    m = min_tile_rows(vae, plan.split)
    th, tw = plan.tile if plan.tile is not None else (h, w)
    t = (-(-th // 2), tw) if plan.tile is None or th >= tw or tw >= w else (th, -(-tw // 2))
    ladder = [vt.TiledVideoPlan(plan.chunk, t, plan.split, plan.storage)] \
        if min(t) >= min(m, h, w) and t != (th, tw) else []
    if plan.chunk > 1:
        ladder.append(vt.TiledVideoPlan(plan.chunk // 2, plan.tile, plan.split, plan.storage))
    if host and plan.storage == "device":
        ladder.append(vt.TiledVideoPlan(plan.chunk, plan.tile or band_tiles(hw, 2), plan.split, "host"))
    return next((c for c in ladder if c not in tried), None)


def smaller_stream_plan(latent_shape, chunk: int, tile) -> tuple[int, object] | None:
    """The HunyuanVideo 1.5 / LTX-2 plan to retry with after an out-of-memory error (vaeopt.video_stream.decode_clip's
    `replan`): half the chunk, then tiles of half the frame's side, then halved tiles; None below one pixel."""
    if chunk > 1:
        return chunk // 2, tile
    h, w = latent_shape[-2:]
    if tile is None:
        t = max(1, max(h, w) // 2)
        return (1, t) if t < max(h, w) else None
    th, tw = (tile, tile) if isinstance(tile, int) else tile
    if max(th, tw) <= 1:
        return None
    return 1, (max(1, th // 2), max(1, tw // 2))


def _video_flags(model) -> tuple[bool, bool]:
    """(channels_last, fused) as vaeopt.video's decoder will run this model: what the estimates must model."""
    cl = any(m.weight.is_contiguous(memory_format=torch.channels_last_3d) and not m.weight.is_contiguous()
             for m in model.decoder.modules() if isinstance(m, torch.nn.Conv3d) and m.weight is not None)
    env = fused_from_env()
    fused = env if env is not None else (has_fused_rms_norms(model.decoder)
                                         and bool(getattr(model, "_vaeopt_fused_epilogues", None)))
    return cl, fused


def estimate_video(family, model, latent_shape, dtype, chunk: int, tile=None, split: int | None = None,
                   storage: str = "device") -> int:
    """Peak bytes of a chunked (optionally spatially tiled) video decode: the dry-run estimate of vaeopt.video /
    vaeopt.video_tiling (activations and causal caches of one chunk, on the path that will run: layout, fused
    kernels) + weights + the whole-clip output + 15% for allocator rounding and cuDNN workspaces."""
    if family.cls_name != "AutoencoderKLWan":
        return estimate_whole(family, model, latent_shape, dtype, chunk)
    cl, fused = _video_flags(model)
    act = vt.estimate_tiled_video_bytes(model, latent_shape, chunk, tile, dtype, channels_last=cl,
                                                  fused=fused, split=split, storage=storage)
    return int(1.15 * act) + _video_fixed_bytes(family, model, latent_shape, dtype)


def _video_fixed_bytes(family, model, latent_shape, dtype) -> int:
    """Weights + decode_video's whole-clip output."""
    eb = torch.tensor([], dtype=dtype).element_size()
    n, _, t, h, w = latent_shape
    out = n * 3 * family.output_frames(t) * h * family.spatial_factor * w * family.spatial_factor * eb
    return _weights_bytes(model, dtype) + out


def _host_budget() -> int:
    """Half the available host memory: /proc/meminfo's MemAvailable (free memory plus the page cache the kernel
    can drop, e.g. a checkpoint just read), else free pages, else 4 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def _tile_words(family, model, latent_shape, p, device, requested: bool = False) -> tuple[str, str]:
    """('tile 1280x240px (3 bands), chunk 1', how the tiles run) for a video plan's reason."""
    f = family.spatial_factor
    rows, cols = p.tile
    n = len(tile_grid(*latent_shape[-2:], rows, cols))
    shape = ("band" if cols >= latent_shape[-1] else "tile") + ("s" if n != 1 else "")
    halo, _ = vt.receptive_field(model, p.split)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    where = "pinned host memory" if p.storage == "host" else ("the GPU" if dev.type == "cuda" else str(dev))
    return (f"tile {cols * f}x{rows * f}px{' requested' if requested else ''} ({n} {shape}), chunk {p.chunk}",
            f"tiled from up block {p.split} (halo {halo}px at {front_scale(model, p.split)}x latent "
            f"resolution), one causal cache per tile on {where}")


# HunyuanVideo's spatial tile sides (output px) for diffusers' tiled decode, largest first: its default (256, blended
# over 64 px), then smaller ones where that does not fit the budget.
HUNYUAN_TILES = (256, 192, 128)


def hunyuan_call_frames(model, t_lat: int) -> int:
    """Latent frames per decoder call of diffusers' HunyuanVideo decode: with its framewise decoding (on by default)
    a clip longer than tile_sample_min_num_frames // 4 latent frames runs as temporal tiles of that many + 1."""
    if getattr(model, "use_framewise_decoding", False):
        n = model.tile_sample_min_num_frames // model.temporal_compression_ratio
        if t_lat > n:
            return n + 1
    return t_lat


def hunyuan_stride(tile: int) -> int:
    """Latent px between diffusers' HunyuanVideo spatial tiles of `tile` latent px: three quarters of a tile. diffusers
    steps by stride // 8 latent px but keeps `stride` output px of each tile, so the stride it is given must be
    this many latent px times 8 (a side of 10 latent px with a stride of 60 px would leave 4-px seams)."""
    return max(1, tile * 3 // 4)


def estimate_hunyuan(family, model, latent_shape, dtype, side: int | None) -> int:
    """Peak bytes of diffusers' HunyuanVideo decode: one decoder call of hunyuan_call_frames latent frames over the
    whole frame (side None) or over one spatial tile of side x side output px, plus what it keeps of the clip: each
    temporal tile's frames (all of them, until the end) and the concatenated output."""
    n, c, t_lat, h, w = latent_shape
    k = hunyuan_call_frames(model, t_lat)
    if side is not None:
        s = side // family.spatial_factor
        h, w = min(h, s), min(w, s)
    est = estimate_whole(family, model, (n, c, t_lat, h, w), dtype, k)
    eb = torch.tensor([], dtype=dtype).element_size()
    H, W = latent_shape[-2] * family.spatial_factor, latent_shape[-1] * family.spatial_factor
    frames_out = family.output_frames(t_lat)
    kept = frames_out
    if k < t_lat:  # temporal tiles every stride latent frames, each of output_frames(k) frames
        stride = max(1, model.tile_sample_stride_num_frames // model.temporal_compression_ratio)
        kept = -(-t_lat // stride) * family.output_frames(k)
    px = H * W * 3 * eb * n
    est += (kept + frames_out) * px - frames_out * h * w * family.spatial_factor**2 * 3 * eb * n
    return est


def hunyuan_tile(family, model, latent_shape, dtype, budget: int | None,
                 sides=HUNYUAN_TILES) -> tuple[int, int] | None:
    """(side px, est. bytes) of diffusers' spatial tiles for these frames: the first of `sides` whose estimate fits
    `budget` (None: the first), else the last; None where the frames are no larger than every side (diffusers tiles a
    frame only where it is larger than the tile, so there is nothing to tile)."""
    f = family.spatial_factor
    fitting = [s for s in sides if s // f < max(latent_shape[-2:])]
    for side in fitting:
        est = estimate_hunyuan(family, model, latent_shape, dtype, side)
        if budget is None or est <= budget:
            break
    return (side, est) if fitting else None


def _plan_hunyuan(family, model, latent_shape, dtype, budget, why, tile, tiling, chunk=None) -> Plan:
    """HunyuanVideo runs diffusers' own decode. Its GroupNorms take statistics over all frames of a decoder call, so
    no exact chunking exists (vaeopt.video's causal chunks need per-frame norms, as Wan's); diffusers already splits
    long clips into blended temporal tiles by default. Here: whole frames when they fit the budget, else diffusers'
    spatial tiles (approximate, like its temporal ones: each tile normalizes with its own statistics)."""
    t_lat, (h, w) = latent_shape[2], latent_shape[-2:]
    k = hunyuan_call_frames(model, t_lat)
    if chunk is not None:
        raise VaeoptError(f"--chunk: {family.title} decodes through diffusers' own decode"
                          f"{f', in its temporal tiles of {k} latent frames' if k < t_lat else ''}; its GroupNorms "
                          "take statistics over every frame of a call, so it has no exact chunks to choose")
    how = f"diffusers' {family.title} decode" + (f", in its temporal tiles of {k} latent frames" if k < t_lat else "")
    whole = estimate_hunyuan(family, model, latent_shape, dtype, None)
    forced = tile is not None or tiling == "on"
    tiles = hunyuan_tile(family, model, latent_shape, dtype, budget,
                         (tile * family.spatial_factor,) if tile is not None else HUNYUAN_TILES)
    if tiles is None or (not forced and (budget is None or whole <= budget or tiling == "off")):
        if tiles is None and (forced or (budget is not None and whole > budget and tiling != "off")):
            small = tile * family.spatial_factor if tile is not None else HUNYUAN_TILES[-1]
            reason = (f"whole frames through {how}: {w * family.spatial_factor}x{h * family.spatial_factor}px frames "
                      f"are no larger than a {small}px tile, so there is nothing to tile (est. {gib(whole)}"
                      + (f" of {gib(budget)} budget, {why})" if budget is not None else ")"))
        elif budget is None:
            reason = f"whole frames through {how} (est. {gib(whole)}; {why}: memory not planned)"
        elif whole <= budget:
            reason = f"whole frames through {how}: est. {gib(whole)} of {gib(budget)} budget ({why})"
        else:
            reason = f"whole frames through {how} (tiling off) although est. {gib(whole)} > {gib(budget)} budget"
        return Plan("whole", budget, whole, chunk=k, reason=reason)
    side, est = tiles
    t = side // family.spatial_factor
    overlap = (t - hunyuan_stride(t)) * family.spatial_factor
    fits = "requested" if tile is not None else ("tiling forced" if tiling == "on" else (
        f"est. {gib(est)} of {gib(budget)} budget ({why}); whole frames would need {gib(whole)}" if est <= budget
        else f"the smallest tile, est. {gib(est)} > {gib(budget)} budget ({why})"))
    return Plan("tiled", budget, est, tile=t, chunk=k,
                reason=f"diffusers' spatial tiles of {side}px with {overlap}px blended overlaps through {how} "
                       f"(approximate: each tile normalizes with its own statistics): {fits}")


# HunyuanVideo 1.5 / LTX-2 (vaeopt.video_stream): the largest chunk whose estimate fits, the whole clip where it does.
# No speed cap: one decoder call over the clip is diffusers' own schedule (LTX-2: its ops in its order), and smaller
# chunks only add calls; chunks are evened out (31 latent frames with room for 23: 16 + 15, not 23 + 8) so the same
# number of calls holds less memory.


def _stream_model(family) -> dict:
    mm = memory_model()
    return mm.get(family.cls_name) or mm["default"]


def estimate_stream(family, model, latent_shape, dtype, chunk: int, tile: int | None = None) -> int:
    """Peak bytes of vaeopt.video_stream's decode, everything it holds on the device: the whole model's weights (the
    pipeline moves the encoder too), the clip's output, and the activations of `chunk` latent frames' worth of output
    frames, fitted from measured peaks (configs/memory_model.json: stream_act_bytes_per_px per output pixel per dtype
    byte, stream_const_bytes for what does not grow with the chunk: cuDNN workspaces, conv histories, residual
    queues, the attention's keys) times stream_margin. With tiles only the back's share of the activations shrinks
    with the tile (stream_tile_front_share stays whole-frame)."""
    n, _, t_lat, h, w = latent_shape
    eb = torch.tensor([], dtype=dtype).element_size()
    H, W = h * family.spatial_factor, w * family.spatial_factor
    e = _stream_model(family)
    slope = float(e.get("stream_act_bytes_per_px", e["act_bytes_per_px"]))
    const, margin = float(e.get("stream_const_bytes", 0)), float(e.get("stream_margin", 1.0))
    frac = 1.0
    if tile is not None:
        split = video_stream.default_split(model)
        sc = video_stream.split_scale(model, split)
        halo = 2 * video_stream.back_halo(model, split)
        back = min(1.0, (min(tile, h) * sc + halo) * (min(tile, w) * sc + halo) / (h * sc * w * sc))
        front = float(e.get("stream_tile_front_share", 0.0))
        frac = front + (1 - front) * back
    px = n * chunk * family.temporal_factor * H * W * frac
    out = n * family.output_frames(t_lat) * H * W * 3 * eb
    weights = sum(t.numel() for t in model.parameters()) * eb if model is not None else 0
    return int(weights + out + margin * (slope * eb * px + const))


def stream_chunks(t_lat: int) -> list[int]:
    """Candidate chunks, largest first, each evened out over the clip (for each number of calls, the smallest chunk
    that gives it): the first that fits holds no more memory than its calls need."""
    out: list[int] = []
    for k in range(t_lat, 0, -1):
        even = -(-t_lat // -(-t_lat // k))
        if even not in out:
            out.append(even)
    return out


def _plan_stream(family, model, latent_shape, dtype, budget, why, chunk, tile, tiling) -> Plan:
    """HunyuanVideo 1.5 / LTX-2: exact chunks (the largest that fits, the whole clip where it does), else exact
    spatial tiles (the largest that fits, one latent frame per call); a tile or tiling='on' forces tiles."""
    t_lat, (h, w) = latent_shape[2], latent_shape[-2:]
    if budget is None:
        budget, why = _host_budget(), "half of the available host memory"
    chunks = [chunk] if chunk is not None else stream_chunks(t_lat)
    how = f"{family.title}'s exact chunk decoder"
    split = video_stream.default_split(model)
    if tile is None and tiling != "on":
        fit = None
        for k in chunks:  # largest first: the first that fits
            est = estimate_stream(family, model, latent_shape, dtype, k)
            if est <= budget:
                fit = (k, est)
                break
        if fit or tiling == "off":
            k, est = fit or (chunks[-1], est)
            what = f"chunk {k} latent frame(s)" + (" (the whole clip in one call)" if k >= t_lat else "")
            verdict = (f"est. {gib(est)} of {gib(budget)} budget ({why})" if fit else
                       f"est. {gib(est)} exceeds the {gib(budget)} budget ({why}); may run out of memory (tiling off)")
            return Plan("chunked", budget, est, chunk=k, reason=f"{what} through {how}: {verdict}")
    k = chunks[-1] if chunk is None else chunk
    if tile is not None:
        t = max(1, min(int(tile), max(h, w)))
        est = estimate_stream(family, model, latent_shape, dtype, k, t)
        src = "requested"
    else:
        # --tiling on: at least two tiles, even where the whole frame would fit
        sides = range(-(-max(h, w) // 2) if tiling == "on" else max(h, w), 0, -1)
        t = next((s for s in sides if estimate_stream(family, model, latent_shape, dtype, k, s) <= budget), 1)
        est = estimate_stream(family, model, latent_shape, dtype, k, t)
        src = "tiling forced" if tiling == "on" else (
            f"est. {gib(est)} of {gib(budget)} budget ({why})" if est <= budget else
            f"the smallest tile, est. {gib(est)} > {gib(budget)} budget ({why}); may run out of memory")
    f = family.spatial_factor
    return Plan("tiled", budget, est, tile=t, chunk=k, split=split,
                reason=f"exact spatial tiles of {t * f}px (up blocks {split}.. per tile, with a "
                       f"{video_stream.back_halo(model, split)}-px halo), chunk {k} latent frame(s), through {how}: "
                       f"{src}")


def _plan_video(family, model, latent_shape, dtype, budget, why, chunk, tile=None, tiling="auto",
                device=None) -> Plan:
    t_lat = latent_shape[2]
    if video_stream.applies(model):
        return _plan_stream(family, model, latent_shape, dtype, budget, why, chunk, tile, tiling)
    if family.cls_name != "AutoencoderKLWan":
        return _plan_hunyuan(family, model, latent_shape, dtype, budget, why, tile, tiling, chunk)
    hw = tuple(latent_shape[-2:])
    host = device is not None and torch.device(device).type == "cuda"  # pinned host caches need a CUDA device
    top = MAX_CHUNK_WAN22 if getattr(getattr(model, "config", None), "is_residual", False) else MAX_CHUNK
    chunks = [chunk] if chunk is not None else list(range(min(top, max(t_lat - 1, 1)), 0, -1))
    if budget is None:
        # CPU: bigger chunks are much faster here (fewer, larger convs: 15.8 s -> 4.4 s for a 5-frame clip of the tiny
        # model, docs/video.md); plan them from half the available host memory.
        budget, why = _host_budget(), "half of the available host memory"


    stacked = bool(stacked_names(model))

    def video_plan(p, est: int, head: str) -> Plan:
        if stacked:  # the stage's line was written before the plan: say that tiles do not use it
            head += "; stacked_conv3d not used (tiles run the Conv3d on their 5-D input)"
        return Plan("tiled", budget, est, tile=p.tile, chunk=p.chunk, split=p.split, storage=p.storage, reason=head)

    if tile is not None:  # --tile: that tile; the largest chunk (or --chunk) and the cheapest cache storage that fit
        split = vt.default_split(model)
        t = vt.resolve_tile(tile, hw)
        vt.check_tile(model, vt.TiledVideoPlan(1, t, split), hw)
        tries = [vt.TiledVideoPlan(k, t, split, st) for k in chunks for st in (("device", "host") if host else
                                                                                ("device",))]
        tries.sort(key=lambda p: plan_cost(model, hw, p))
        ests = [(p, estimate_video(family, model, latent_shape, dtype, p.chunk, p.tile, p.split, p.storage))
                for p in tries]
        fit = [(p, e) for p, e in ests if e <= budget]
        p, est = fit[0] if fit else min(ests, key=lambda pe: pe[1])
        what, how = _tile_words(family, model, latent_shape, p, device, requested=True)
        verdict = (f"est. {gib(est)} of {gib(budget)} budget ({why})" if fit else
                   f"est. {gib(est)} exceeds the {gib(budget)} budget ({why}); may run out of memory")
        return video_plan(p, est, f"{what}: {verdict}; {how}")

    longer = []
    if chunk is None and stacked:
        longer = list(range(min(MAX_CHUNK_STACKED, max(t_lat - 1, 1)), max(chunks), -1))
    untiled = [(k, estimate_video(family, model, latent_shape, dtype, k)) for k in longer + chunks]
    if tiling != "on":
        fit = [(k, e) for k, e in untiled if e <= budget]
        if fit or tiling == "off":
            if fit:
                k, est = fit[0]  # chunks are in decreasing order
                src = ("requested" if chunk is not None else
                       f"(the whole clip, {family.output_frames(t_lat)} output frame(s), in one call)" if k >= t_lat
                       else f"({family.temporal_factor * k} output frames) per call")
                return Plan("chunked", budget, est, chunk=k,
                            reason=f"chunk {k} latent frame(s) {src}: est. {gib(est)} of {gib(budget)} budget ({why})")
            k, est = untiled[-1]
            return Plan("chunked", budget, est, chunk=k,
                        reason=f"chunk {k}: est. {gib(est)} exceeds the {gib(budget)} budget ({why}); may run out of "
                               "memory (tiling off)")
    # The untiled decode does not fit (or tiling is forced): the cheapest tiled plan that does (plan_cost order:
    # fewest halo rows, device caches before host caches), estimated by a dry run of the tiled decode itself.
    # Bounds that skip dry runs which cannot fit: plans with the caches on the device need at least the untiled
    # decode's caches; with host caches, the estimate falls as the bands get thinner, so the thinnest band of each
    # (split, chunk) shows whether any of them can fit.
    cands = candidate_plans(model, hw, chunks, host)
    device_floor = _video_fixed_bytes(family, model, latent_shape, dtype) + int(
        1.15 * vt.cache_floor_bytes(model, latent_shape, dtype, _video_flags(model)[0]))
    host_min: dict[tuple, int] = {}
    best = None
    for p in cands:
        if p.storage == "device" and device_floor > budget:
            continue
        if p.storage == "host":
            g = (p.split, p.chunk)
            if g not in host_min:
                thin = min((c for c in cands if (c.split, c.chunk, c.storage) == (*g, "host")), key=lambda c: c.tile[0])
                host_min[g] = estimate_video(family, model, latent_shape, dtype, thin.chunk, thin.tile, thin.split,
                                             thin.storage)
                if best is None or host_min[g] < best[1]:
                    best = (thin, host_min[g])
            if host_min[g] > budget:
                continue
        est = estimate_video(family, model, latent_shape, dtype, p.chunk, p.tile, p.split, p.storage)
        if est <= budget:
            what, how = _tile_words(family, model, latent_shape, p, device)
            k1 = untiled[-1]
            more = "tiling forced" if tiling == "on" and untiled[-1][1] <= budget else \
                f"untiled chunk {k1[0]} would need {gib(k1[1])}"
            return video_plan(p, est, f"{what}: est. {gib(est)} of {gib(budget)} budget ({why}); {how}; {more}")
        if best is None or est < best[1]:
            best = (p, est)
    if best is None and not cands:  # a frame too small to tile
        k, est = untiled[-1]
        return Plan("chunked", budget, est, chunk=k, reason=f"chunk {k}: est. {gib(est)} exceeds the {gib(budget)} "
                                                           f"budget ({why}) and the frame is too small to tile; may "
                                                           "run out of memory")
    if best is None:  # every plan was skipped by the bounds: the cheapest, with its estimate
        p = cands[0]
        best = (p, estimate_video(family, model, latent_shape, dtype, p.chunk, p.tile, p.split, p.storage))
    p, est = best
    if untiled[-1][1] <= est:
        k, est = untiled[-1]
        return Plan("chunked", budget, est, chunk=k, reason=f"chunk {k}: est. {gib(est)} exceeds the {gib(budget)} "
                                                           f"budget ({why}), and no tiling needs less; may run out of "
                                                           "memory")
    what, how = _tile_words(family, model, latent_shape, p, device)
    return video_plan(p, est, f"{what}: est. {gib(est)} exceeds the {gib(budget)} budget ({why}), the least of any "
                              f"plan; {how}; may run out of memory")
