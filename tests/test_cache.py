"""vaeopt's on-disk cache (vaeopt/cache.py): location, atomic entries, bad entries ignored and rebuilt, and the FP8
gate's verdict reused across processes (here: two pipelines)."""

import json
import os
from pathlib import Path

import pytest
import torch

from vaeopt import cache


def test_location_env_override_and_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("VAEOPT_CACHE_DIR", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("VAEOPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "vaeopt"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: a relative path is ignored
    assert cache.cache_dir() == Path.home() / ".cache" / "vaeopt"


def test_put_get_roundtrip_and_keys_separate():
    key = {"shape": (1, 4, 32, 32), "gate_db": 40.0}
    assert cache.get("k", key) is None
    path = cache.put("k", key, {"chosen": ["a", "b"]})
    assert path.is_file() and path.is_relative_to(cache.cache_dir() / "k")
    assert not list(path.parent.glob("*.tmp"))  # written through a temporary, then renamed
    hit = cache.get("k", {"shape": [1, 4, 32, 32], "gate_db": 40.0})  # tuples and lists are the same key
    assert hit == {"chosen": ["a", "b"]} and hit.path == path and "UTC" in hit.when
    assert cache.get("k", {**key, "gate_db": 41.0}) is None
    assert cache.get("other", key) is None


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not a dict", "no value", "other env", "other key"])
def test_bad_entry_is_ignored_with_one_line_and_rebuilt(damage):
    key = {"k": 1}
    path = cache.put("verdicts", key, {"v": 1})
    doc = json.loads(path.read_text())
    text = {"truncated": path.read_text()[: len(path.read_text()) // 2],
            "garbage": "\x00\xff not json",
            "not a dict": "[1, 2]",
            "no value": json.dumps({**doc, "value": None}),
            "other env": json.dumps({**doc, "env": {**doc["env"], "torch": "0.0"}}),
            "other key": json.dumps({**doc, "key": {"k": 2}})}[damage]
    path.write_text(text)
    lines = []
    assert cache.get("verdicts", key, log=lines.append) is None
    assert len(lines) == 1 and str(path) in lines[0] and "measuring again" in lines[0]
    cache.put("verdicts", key, {"v": 2}, log=lines.append)  # the rebuilt entry replaces it
    assert cache.get("verdicts", key) == {"v": 2} and len(lines) == 1


def test_stale_environment_is_another_folder(monkeypatch):
    cache.put("verdicts", {"k": 1}, {"v": 1})
    monkeypatch.setattr(cache, "package_version", lambda pkg: "9.9" if pkg == "triton" else None)  # a Triton upgrade
    assert cache.get("verdicts", {"k": 1}) is None


def test_switched_off_reads_and_writes_nothing(monkeypatch):
    monkeypatch.setenv("VAEOPT_CACHE", "off")
    assert cache.put("k", {"a": 1}, {"v": 1}) is None
    assert not cache.cache_dir().exists() or not cache.entries()


def test_unwritable_folder_is_one_line_not_a_crash(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("VAEOPT_CACHE_DIR", str(blocker / "sub"))  # a folder under a file cannot be made
    lines = []
    assert cache.put("k", {"a": 1}, {"v": 1}, log=lines.append) is None
    assert len(lines) == 1 and "not cached" in lines[0]
    assert cache.get("k", {"a": 1}) is None


def test_weights_fingerprint_sees_one_changed_weight():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 3, 1))
    a = cache.weights_fingerprint(m)
    assert cache.weights_fingerprint(m) == a
    with torch.no_grad():
        m[1].weight[2, 5] += 1e-3
    assert cache.weights_fingerprint(m) != a


def test_fp8_gate_verdict_is_reused_not_probed_again(samples_dir, monkeypatch):
    """A second `--fp8 weights` pipeline of the same checkpoint (on the CPU; `--fp8 on` on a GPU gates the same way)
    applies the stored verdict: the probe decodes do not run again, the same layers are converted, and the line says
    from when the verdict is. A corrupt entry is measured again."""
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline
    from vaeopt.quant import gate

    probes = []
    real = gate._decode
    monkeypatch.setattr(gate, "_decode", lambda model, z: (probes.append(1), real(model, z))[1])

    def run():
        lines = []
        pipe = Pipeline(load_vae(samples_dir / "tiny_kl_image.safetensors"), Options(device="cpu", fp8="weights"),
                        log=lines.append)
        st = next(s for s in pipe.stages if s.name == "fp8")
        stored = sorted(n for n, m in pipe.model.decoder.named_modules() if hasattr(m, "qweight"))
        return st, stored, lines

    st1, stored1, _ = run()
    n_first = len(probes)
    assert st1.status == "applied" and n_first >= 3 and "reused" not in st1.detail  # fp32 ref, base, fp8 probe
    st2, stored2, lines = run()
    assert len(probes) == n_first  # no probe the second time
    assert st2.status == "applied" and stored2 == stored1 and len(stored2) == st1.data["storage"]
    line = next(ln for ln in lines if ln.startswith("✓ fp8"))
    assert "verdict reused from 20" in line and "UTC" in line
    (entry,) = cache.entries("fp8_gate")
    entry.write_text(entry.read_text()[:40])  # truncated: ignored, probed again, rewritten
    st3, stored3, lines = run()
    assert len(probes) > n_first and stored3 == stored1 and "reused" not in st3.detail
    assert any("ignored" in ln and "measuring again" in ln for ln in lines)
    assert json.loads(entry.read_text())["value"]["status"] == "applied"


def test_fp8_gate_verdict_keyed_by_weights(samples_dir, monkeypatch):
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline

    Pipeline(load_vae(samples_dir / "tiny_kl_image.safetensors"), Options(device="cpu", fp8="weights"), log=None)
    other = load_vae(samples_dir / "tiny_kl_image.safetensors")
    with torch.no_grad():
        other.model.decoder.up_blocks[0].resnets[0].conv1.weight.mul_(1.01)  # another checkpoint
    pipe = Pipeline(other, Options(device="cpu", fp8="weights"), log=None)
    st = next(s for s in pipe.stages if s.name == "fp8")
    assert "reused" not in st.detail and len(cache.entries("fp8_gate")) == 2
    assert os.environ["VAEOPT_CACHE_DIR"] in str(cache.entries("fp8_gate")[0])  # conftest's per-test folder


def test_wan_plans_are_reused_across_processes(samples_dir, monkeypatch):
    """A Wan plan (seconds of dry runs at real sizes) is stored per architecture, flags, shape and budget: planning
    the same decode again (another process: here the in-process path is counted) reads it, equal to the first; a
    corrupt entry is planned again."""
    from vaeopt import planner
    from vaeopt.loading import load_vae

    loaded = load_vae(samples_dir / "tiny_wan_video.safetensors")
    calls = []
    real = planner._plan_video
    monkeypatch.setattr(planner, "_plan_video", lambda *a, **k: (calls.append(1), real(*a, **k))[1])

    def plan(shape=(1, 16, 5, 8, 8), budget=2.0):
        return planner.plan_decode(loaded.family, loaded.model, shape, torch.float32, torch.device("cpu"),
                                   vram_budget_gb=budget)

    p1 = plan()
    assert len(calls) == 1 and len(cache.entries("plans")) == 1
    p2 = plan()
    assert len(calls) == 1 and p2 == p1
    plan(budget=1.0)
    plan(shape=(1, 16, 3, 8, 8))
    assert len(calls) == 3  # another budget, another shape: planned
    planner.plan_decode(loaded.family, loaded.model, (1, 16, 5, 8, 8), torch.float32, torch.device("cpu"))
    assert len(calls) == 4 and len(cache.entries("plans")) == 3  # no budget on the CPU: not stored
    for e in cache.entries("plans"):
        e.write_text("{")
    assert plan() == p1 and len(calls) == 5


def test_wan_plans_from_free_memory_hit_across_runs(samples_dir, monkeypatch):
    """Without --vram-budget a Wan plan is made from free memory, which moves by megabytes between runs: the budget is
    rounded down to a 1/4 GiB step before planning, so a later run with a few MB more or less free memory (the same
    step) reads the stored plan, which is the plan it would have made itself, within its real budget; a run a step
    lower plans again. The reason names this run's free memory, not the stored run's."""
    from vaeopt import planner
    from vaeopt.loading import load_vae

    loaded = load_vae(samples_dir / "tiny_wan_video.safetensors")
    got = []
    real = planner._plan_video
    monkeypatch.setattr(planner, "_plan_video", lambda *a, **k: (got.append(a[4]), real(*a, **k))[1])
    step = planner.BUDGET_STEP
    free = [10 * 2**30 + 37 * 2**20]  # 10 GiB + 37 MB of budget this run

    monkeypatch.setattr(planner, "budget_bytes", lambda device, gb: (
        (free[0], f"{free[0] / 2**20:.0f} MB free") if gb is None else (int(gb * 2**30), f"{gb:g} GB asked for")))

    def plan():
        return planner.plan_decode(loaded.family, loaded.model, (1, 16, 5, 8, 8), torch.float32, torch.device("cuda"))

    p1 = plan()
    assert got == [10 * 2**30] and p1.budget_bytes == 10 * 2**30 <= free[0]  # planned with the rounded budget
    assert "10277 MB free, rounded down to 0.25 GB steps" in p1.reason
    free[0] = 10 * 2**30 + 200 * 2**20  # another run, 163 MB more free: the same step
    p2 = plan()
    assert got == [10 * 2**30] and len(cache.entries("plans")) == 1  # read, not planned
    assert (p2.mode, p2.chunk, p2.tile, p2.budget_bytes) == (p1.mode, p1.chunk, p1.tile, p1.budget_bytes)
    assert "10440 MB free" in p2.reason and "10277" not in p2.reason
    fresh = real(loaded.family, loaded.model, (1, 16, 5, 8, 8), torch.float32, 10 * 2**30, "", None, device="cuda")
    assert (fresh.mode, fresh.chunk, fresh.tile) == (p2.mode, p2.chunk, p2.tile)  # what a miss would have planned
    free[0] = 10 * 2**30 - 1  # a byte under the step: the step below, planned again, never over the real budget
    p3 = plan()
    assert got == [10 * 2**30, 10 * 2**30 - step] and p3.budget_bytes <= free[0]
    assert len(cache.entries("plans")) == 2
    p4 = planner.plan_decode(loaded.family, loaded.model, (1, 16, 5, 8, 8), torch.float32, torch.device("cuda"),
                             vram_budget_gb=1.3)  # a given budget: planned as given (exact, no rounding)
    assert got[-1] == int(1.3 * 2**30) and p4.budget_bytes == int(1.3 * 2**30)
