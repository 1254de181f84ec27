"""`vaeopt info`'s FP8 rows where this machine has no FP8 compute (a CPU, an sm_80 GPU): what runs here is said once,
with this device's reason, and what FP8 does on a GPU with FP8 tensor cores follows it, marked as such, instead of the
GPU path's reasons (Wan's 8-bit convs) set beside this device's ("no CUDA GPU"), which read as if they ran here."""

import pytest
import torch
from test_stage_table import A100, H200

from vaeopt import info as vinfo
from vaeopt.options import spell_flags
from vaeopt.families import get_family
from vaeopt.hw import machine_info
from vaeopt.pipeline import Options
from vaeopt.stage_table import DeviceInfo, decide_stages

GPU_PART = "On a GPU with FP8 tensor cores (sm_89+), with --fp8 on: "


def _rows(monkeypatch, dev):
    monkeypatch.setattr(DeviceInfo, "of", classmethod(lambda cls, device: dev))
    monkeypatch.setattr(vinfo, "resolve_dtype",
                        lambda dtype, device: torch.bfloat16 if dev.type == "cuda" else torch.float32)
    mi = machine_info()
    mi.gpus = [] if dev.type != "cuda" else [
        type("G", (), {"bf16": True, "sm": f"sm_{dev.capability[0]}{dev.capability[1]}", "free_gib": 100.0})]
    return {r["stage"]: r for r in vinfo.stage_outlook(mi, spell_flags)}


CPU = DeviceInfo.of(torch.device("cpu"))  # (this machine's CPU as the table sees it: fp8 compute's reason included)


@pytest.mark.parametrize("dev", [CPU, A100], ids=["cpu", "a100"])
def test_fp8_rows_say_what_runs_here_then_on_a_gpu(monkeypatch, dev):
    rows = _rows(monkeypatch, dev)
    reason = dev.fp8_compute[1]  # "no CUDA GPU: ..." / "GPU sm_80 has no FP8 tensor cores (needs sm_89+)"
    assert reason
    for stage in ("fp8", "fp8 convs"):
        why = rows[stage]["why"]
        here, _, gpu = why.partition(GPU_PART)
        assert not rows[stage]["runs"] and gpu, why
        assert here.startswith(f"opt-in. Here --fp8 on runs no FP8 compute ({reason})"), why
        assert reason not in gpu and "8-bit implicit-GEMM convs" not in here, why  # each device's text in its part
    # here: level 1 (weight storage) runs without FP8 tensor cores, for every family
    for name, _ in vinfo.WORKLOADS:
        r = next(r for r in decide_stages(Options(fp8="weights"), get_family(name), torch.float32, dev)
                 if r.name == "fp8")
        assert r.status == "applied", (name, r.detail)
    assert "--fp8 weights (level 1: e4m3 weight storage, cast per layer; less memory, no FP8 math) runs. " in \
        rows["fp8"]["why"]
    # on a GPU: the table's decisions there (FLUX.1 and Wan 2.1 as the 8-bit convs, HunyuanVideo 1.5 fp8 GEMMs)
    gpu = rows["fp8"]["why"].partition(GPU_PART)[2]
    assert gpu == ("FLUX.1, Wan 2.1: as 8-bit implicit-GEMM convs (the fp8 convs row); HunyuanVideo 1.5: "
                   + vinfo.WHAT["fp8"])
    for name in ("flux", "wan21"):
        r = {r.name: r for r in decide_stages(Options(fp8="on"), get_family(name), torch.bfloat16, H200)}
        assert r["fp8 convs"].status == "applied" and r["fp8"].status == "skipped"
    assert rows["fp8 convs"]["why"].endswith(GPU_PART + "FLUX.1, Wan 2.1: " + vinfo.WHAT["fp8 convs"])


def test_fp8_rows_on_an_fp8_gpu_are_the_tables(monkeypatch):
    """Where FP8 compute runs (an H200), the rows are the table's decisions for this device, as before."""
    rows = _rows(monkeypatch, H200)
    assert rows["fp8 convs"]["runs"] and rows["fp8"]["why"].startswith("opt-in, with --fp8 on: ")
    assert all("Here" not in rows[s]["why"] and GPU_PART not in rows[s]["why"] for s in ("fp8", "fp8 convs"))
