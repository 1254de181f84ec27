"""cuDNN autotuning: time several engine configs for each new conv shape and keep the fastest, instead of taking
the first one cuDNN's heuristic offers (torch.backends.cudnn.benchmark, with torch's benchmark_limit).

Measured (docs/experiments.md E19, E23): ~2% at wan21-480p steady state, nothing at sdxl-1024, for seconds of
tuning on the first decode of each shape set, whose peak grows by the trial configs' workspaces (+48% at
wan21-480p); steady decodes peak as untuned ones do. So `auto` also wants that transient headroom under the
planner's VRAM budget.

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
PEAK_GROWTH = 1.48  # first-decode peak while tuning / untuned: 10.05 / 6.81 GiB (wan21-480p ladder, H200, E19)
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
