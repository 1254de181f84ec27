"""cuDNN autotuning: time several engine configs for each new conv shape and keep the fastest, instead of taking
the first one cuDNN's heuristic offers (torch.backends.cudnn.benchmark, with torch's benchmark_limit).

Measured (one process per setting; torch keeps its choice per conv shape for the life of the process):
- H100, the pipeline's wan21-480p decode (benchmarks/results/h100_cudnn_tune_wan21-480p_2026-11-21{a,b,c}.json):
  630 -> 612 ms and 636 -> 622 ms with up to 10 configs timed per shape, for +1.7 s on the first decode (the
  tuning); every config (limit 0): 609-614 ms for +63 s; cuDNN's heuristic mode B: slower (652 ms).
- H200, `vaeopt benchmark` ladders (h200_wan21-480p_2026-11-21h.json vs h200_wan21-480p-autotune_2026-11-21.json):
  planner row 616.4 -> 604.9 ms; gpu_repeat.py, 10 decodes x 2 processes per setting on one H200: 600.5 / 601.1 ->
  597.2 / 592.6 ms (h200_repeat_wan21-480p*_2026-11-21*.json). sdxl-1024 (h200_sdxl-1024_2026-11-21c /
  -autotune): no gain (18.8 / 19.1 ms).
Tuning allocates the trial configs' workspaces on the first decode of each shape: the wan21-480p planner row's peak,
which includes that warm-up, went 6.81 -> 10.05 GiB (+48%), the fp32 reference's 8.5 -> 41 GiB. Steady decodes after
it peak as untuned ones do (6.62 GiB in every mode, h200_targeted_tune_2026-11-21.json). So `auto` also wants that
transient headroom under the planner's VRAM budget.
The heuristic's misses are specific shapes: the time-stacked 96-channel conv (tile 128x128x64 where 128x128x32 is
faster), the upsamplers' 2x2 phase convs (1.69 -> 1.12 ms on the H100), the 384-channel Conv3d.

So it pays only where the same shapes are decoded often (a server, a long batch): `auto` turns it on from
MIN_REPEATS same-shape decodes (the rule: vaeopt.stage_table.decide_autotune). The setting is process-wide (torch
keeps one plan cache per process, keyed by the conv's shape, not by this flag), so it must be on before a shape's
first decode to have any effect on it.
"""

from __future__ import annotations

import torch

from vaeopt.stages import StageResult

NAME = "cudnn_autotune"
LIMIT = 10  # engine configs timed per new conv shape (torch's default benchmark_limit)
TUNE_S, GAIN = 1.7, 0.02  # measured at wan21-480p on an H100: one-time cost, fraction saved per decode after it
PEAK_GROWTH = 1.48  # first-decode peak while tuning / untuned: 10.05 / 6.81 GiB (H200 ladder above)
MIN_REPEATS = 128  # ~TUNE_S / (GAIN x 0.62 s): break-even at wan21-480p (~140 decodes), rounded to a power of 2


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "no CUDA device: cuDNN runs on the GPU only"
    if not (torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled):
        return False, "cuDNN is not available or disabled in this torch"
    return True, ""


def apply(reason: str, limit: int = LIMIT) -> StageResult:
    """Turn the autotuner on for this process (every conv shape not yet seen by cuDNN)."""
    was = torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark_limit = limit
    what = "every engine config" if limit == 0 else f"up to {limit} engine configs"
    return StageResult(NAME, "applied", f"cuDNN times {what} on each new conv shape's first call and keeps the "
                                        f"fastest, workspace-hungrier ones included ({reason}; process-wide)",
                       {"previous": was, "limit": limit})


def revert(result: StageResult) -> None:
    torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = result.data["previous"]
