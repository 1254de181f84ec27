"""benchmarks/first_call.py on a narrow model on the CPU: every phase of a fresh process is reported, the first
decode's profile is compared with a steady one, and the table names each variant."""

import json
import subprocess
import sys

from conftest import ROOT


def test_first_call_reports_each_phase(tmp_path):
    p = subprocess.run([sys.executable, "first_call.py", "--tiny", "--device", "cpu", "--variants", "warm",
                        "--out", str(tmp_path)], cwd=ROOT / "benchmarks", capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads((tmp_path / "first_call_sdxl-1024.json").read_text())
    (row,) = doc["rows"]
    assert row["status"] == "ok" and len(row["info"]["calls"]) == 2  # the warm-up process, then the timed one
    c = row["info"]["calls"][-1]
    for k in ("import_s", "build_s", "stages_s", "plan_s", "first_decode_s", "steady_s", "process_s"):
        assert c[k] > 0, k
    assert abs(c["overhead_s"] - (c["first_decode_s"] - c["steady_s"])) < 1e-9
    assert c["plan"] == "whole" and c["cudnn_benchmark"] is False
    assert c["prewarm"] is None and c["kernels_recorded"] == 0  # CPU: no warm-up thread, no kernels to store
    assert abs(c["first_over_steady"] - c["first_decode_s"] / c["steady_s"]) < 1e-9
    assert any(ln["line"].startswith("✓ precision") for ln in c["stage_lines"])
    assert c["triton_first_decode"]["compiled"] == 0 and "autotuned" in c["triton_first_decode"]  # CPU: no Triton
    assert c["profile_first_vs_steady_ms"] and all("first_ms" in x for x in c["profile_first_vs_steady_ms"])
    last = p.stdout.strip().splitlines()
    assert last[-1].startswith("sdxl-1024    warm ") and last[-2].startswith("sdxl-1024    warm/1st")
    assert "import" in last[-3]
