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


def _first_call_module():
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))  # first_call imports the harness by module name
    try:
        return importlib.import_module("first_call")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_first_only_summary():
    """--trace's comparison: CPU items ordered by what the first decode spent over the steady one, the kernels that
    ran only in the first decode (a cuDNN engine picked for a shape seen once), kernels launched more often, and the
    GPU's busy time in each."""
    fc = _first_call_module()
    first = {"names": {"cudaMalloc": (30.0, 40), "aten::conv2d": (12.0, 10), "cudaLaunchKernel": (5.0, 100)},
             "kernels": {"sm90_xmma_a": (4.0, 10), "gn_apply": (2.0, 12), "cudnn_setup_once": (0.5, 1)}}
    steady = {"names": {"cudaMalloc": (0.2, 1), "aten::conv2d": (11.0, 10), "cudaLaunchKernel": (4.5, 100)},
              "kernels": {"sm90_xmma_a": (4.0, 10), "gn_apply": (1.8, 10)}}
    r = fc._first_only(first, steady, top=2)
    assert [x["item"] for x in r["cpu_items"]] == ["cudaMalloc", "aten::conv2d"]  # 29.8 ms over, then 1.0 ms
    assert r["cpu_items"][0] == {"item": "cudaMalloc", "first_ms": 30.0, "first_n": 40, "steady_ms": 0.2,
                                 "steady_n": 1}
    assert r["first_only_kernels"] == [{"kernel": "cudnn_setup_once", "ms": 0.5, "n": 1}]
    assert r["first_only_kernel_count"] == 1 and r["first_only_kernel_ms"] == 0.5
    assert r["kernels_launched_more"] == [{"kernel": "gn_apply", "extra": 2}]
    assert r["gpu_busy_ms"] == {"first": 6.5, "steady": 5.8}
    # the first decode's extra self CPU time by kind: 29.8 ms in the allocator, 1.0 in aten::conv2d ("other": cuDNN's
    # own time shows under aten::cudnn_convolution), 0.5 launching
    assert r["by_kind_ms"] == {"allocator": 29.8, "other": 1.0, "launches": 0.5}
    assert fc._kind("aten::cudnn_convolution") == "cudnn" and fc._kind("cudaFuncGetAttributes") == "kernel loading"


def test_first_call_trace(tmp_path):
    """--trace DIR: the timed process writes its first decode's Chrome trace (gzipped) there, and the summary after
    the table compares each process's profile with a steady decode's under the same profiler."""
    import gzip

    p = subprocess.run([sys.executable, "first_call.py", "--tiny", "--device", "cpu", "--variants", "warm",
                        "--steady", "1", "--trace", str(tmp_path / "tr"), "--out", str(tmp_path)],
                       cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    warmup, c = json.loads((tmp_path / "first_call_sdxl-1024.json").read_text())["rows"][0]["info"]["calls"]
    assert warmup["trace"]["file"] is None and warmup["trace"]["cpu_items"]  # (its summary, not its trace file)
    assert [f.name for f in (tmp_path / "tr").iterdir()] == ["sdxl-1024_warm_1_first.json.gz"]
    tr = c["trace"]
    assert tr["file"].endswith("sdxl-1024_warm_1_first.json.gz")
    assert json.loads(gzip.open(tr["file"]).read())["traceEvents"]
    assert tr["cpu_items"] and all(x["first_n"] > 0 for x in tr["cpu_items"])
    assert abs(c["overhead_profiled_s"] - (c["first_decode_s"] - c["steady_profiled_s"])) < 1e-9
    assert "sdxl-1024 warm process 2: first" in p.stdout and "CPU item (by first - steady)" in p.stdout
