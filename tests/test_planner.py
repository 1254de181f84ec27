"""The VRAM planner: whole when it fits, tiles/chunks from the budget, and the calibrated memory model."""

import json
from pathlib import Path

import pytest
import torch

from vaeopt import planner
from vaeopt.families import build_model, get_family

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


@pytest.fixture(scope="module")
def sdxl_meta():
    spec = get_family("sdxl")
    with torch.device("meta"):
        return spec, build_model(spec)


def test_whole_when_it_fits_tiled_when_not(sdxl_meta):
    spec, m = sdxl_meta
    cpu = torch.device("cpu")
    p = planner.plan_decode(spec, m, (1, 4, 128, 128), torch.bfloat16, cpu, vram_budget_gb=16)
    assert p.mode == "whole" and "whole decode" in p.reason and p.est_bytes < 16 * 2**30
    p = planner.plan_decode(spec, m, (1, 4, 512, 512), torch.bfloat16, cpu, vram_budget_gb=8)
    assert p.mode == "tiled" and p.tile % 8 == 0 and p.tile < 512
    assert p.est_bytes <= 8 * 2**30 and f"tile {p.tile * 8}x{p.tile * 8}" in p.reason
    # a bigger budget never gives a smaller tile
    p16 = planner.plan_decode(spec, m, (1, 4, 512, 512), torch.bfloat16, cpu, vram_budget_gb=16)
    assert p16.mode == "tiled" and p16.tile >= p.tile
    assert planner.plan_decode(spec, m, (1, 4, 512, 512), torch.bfloat16, cpu, tile=64).tile == 64
    assert "over the budget" not in p16.reason
    tight = planner.plan_decode(spec, m, (1, 4, 512, 512), torch.bfloat16, cpu, vram_budget_gb=0.01)
    assert tight.mode == "tiled" and tight.est_bytes > tight.budget_bytes  # said, not hidden
    assert "over the budget even at the smallest tile: the decode may run out of memory" in tight.reason


def test_cpu_plans_only_what_would_not_fit_in_host_memory(sdxl_meta, monkeypatch):
    """A CPU decode stays whole where it fits in half the available host memory. One that would not (a 384² latent,
    est. 47 GB whole, decoded for minutes on a 23 GB host) is tiled as on a GPU."""
    spec, m = sdxl_meta
    monkeypatch.setattr(planner, "_host_budget", lambda: 1 << 50)
    p = planner.plan_decode(spec, m, (1, 4, 128, 128), torch.float32, torch.device("cpu"))
    assert p.mode == "whole" and "CPU: within half the available host memory, 1048576.0 GB" in p.reason, p.reason
    monkeypatch.setattr(planner, "_host_budget", lambda: 4 << 30)
    p = planner.plan_decode(spec, m, (1, 4, 384, 384), torch.float32, torch.device("cpu"))
    assert p.mode == "tiled" and p.est_bytes <= 4 << 30
    assert "half of the available host memory" in p.reason and "whole would need" in p.reason
    p = planner.plan_decode(spec, m, (1, 4, 384, 384), torch.float32, torch.device("cpu"), tiling="off")
    assert p.mode == "whole"


WAN480 = (1, 16, 21, 60, 104)


def _wan_meta():
    spec = get_family("wan21")
    with torch.device("meta"):
        return spec, build_model(spec)


def test_video_chunk_grows_with_budget():
    spec, m = _wan_meta()
    shape, cpu = WAN480, torch.device("cpu")
    small = planner.plan_decode(spec, m, shape, torch.bfloat16, cpu, vram_budget_gb=4.4)
    big = planner.plan_decode(spec, m, shape, torch.bfloat16, cpu, vram_budget_gb=40)
    assert small.mode == big.mode == "chunked"
    assert 1 <= small.chunk < big.chunk <= planner.MAX_CHUNK
    assert small.est_bytes <= 5 * 2**30 and big.est_bytes <= 40 * 2**30
    tiny = planner.plan_decode(spec, m, shape, torch.bfloat16, cpu, vram_budget_gb=1)
    assert tiny.chunk == 1 and "may run out of memory" in tiny.reason
    one = planner.plan_decode(spec, m, (1, 16, 1, 60, 104), torch.bfloat16, cpu, vram_budget_gb=40)
    assert "(the whole clip, 1 output frame(s), in one call)" in one.reason, one.reason


def test_video_chunk_policy_per_model():
    """With stacked_conv3d's marks the untiled plan may take 3 latent frames per call (measured faster there), and
    its estimate counts the stacks; a requested --chunk is kept as asked."""
    from vaeopt.stages import stacked_conv3d

    spec, m = _wan_meta()
    shape, cpu = WAN480, torch.device("cpu")
    plain = planner.plan_decode(spec, m, shape, torch.bfloat16, cpu, vram_budget_gb=40)
    stacked_conv3d.mark(stacked_conv3d.candidates(m))
    stacked = planner.plan_decode(spec, m, shape, torch.bfloat16, cpu, vram_budget_gb=40)
    asked = planner.plan_decode(spec, m, shape, torch.bfloat16, cpu, vram_budget_gb=40, chunk=2)
    assert plain.chunk == planner.MAX_CHUNK == 2 and stacked.chunk == planner.MAX_CHUNK_STACKED == 3
    assert asked.chunk == 2
    assert stacked.est_bytes > plain.est_bytes
    tiled = planner.plan_decode(spec, m, shape, torch.bfloat16, cpu, vram_budget_gb=40, tile=32)
    assert tiled.mode == "tiled" and "stacked_conv3d not used" in tiled.reason
    spec22 = get_family("wan22")
    with torch.device("meta"):
        m22 = build_model(spec22)
    p22 = planner.plan_decode(spec22, m22, (1, 48, 31, 44, 80), torch.bfloat16, cpu, vram_budget_gb=40)
    assert p22.chunk == planner.MAX_CHUNK_WAN22 == 1  # measured fastest for Wan 2.2


def test_memory_model_predicts_measured_peaks_within_15_percent(sdxl_meta):
    """The coefficients in configs/memory_model.json against the H200 peaks they were fitted on (and held out)."""
    spec, m = sdxl_meta
    cal = json.loads((RESULTS / "h200_calibration_2026-11-21.json").read_text())
    m._vaeopt_fused_epilogues = True  # the calibration measured the default (fused) pipeline
    try:
        rows = [r for r in cal["peaks"] if r["family"] == "sdxl"]
        assert len(rows) >= 5
        for r in rows:
            est = planner.estimate_whole(spec, m, tuple(r["shape"]), torch.bfloat16)
            rel = est / (r["peak_gib"] * 2**30) - 1
            assert abs(rel) < 0.15, (r["shape"], rel)
    finally:
        del m._vaeopt_fused_epilogues
    held = cal["fits"]["sdxl"]
    assert held["held_out_shape"] == [1, 4, 256, 256] and abs(held["held_out_rel_error"]) < 0.15
