"""benchmarks/harness.py on the CPU: whole decodes of a narrow SDXL-family model, and the JSON every run writes."""

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from vaeopt import fidelity

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(BENCH))  # the setups import the harness by module name, as when run as scripts
    try:
        yield importlib.import_module("harness")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def run(harness, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "r.json"
    harness.main("decode_image", ["--tiny", "--device", "cpu", "--variants", "diffusers,vaeopt,graphs",
                                  "--repeats", "3", "--warmup", "1", "--json", str(path)])
    return json.loads(path.read_text())


def test_json_names_the_run(run):
    assert run["setup"] == "decode_image" and run["workload"] == "sdxl-1024" and run["tiny"] is True
    assert run["latent_shape"] == [1, 4, 16, 16] and run["dtype"] == "fp32" and run["device"] == "cpu"
    assert run["gpu"] is None and run["gpu_count"] == 0  # a CPU run says so; a GPU run carries the GPU's name
    v = run["versions"]
    assert v["torch"] == torch.__version__ and v["diffusers"] and set(v) >= {"cuda", "cudnn", "triton", "python"}
    assert run["git"]["rev"] is None or re.fullmatch(r"[0-9a-f]{40}", run["git"]["rev"])
    assert run["command"].startswith("python benchmarks/decode_image.py --tiny") and run["date"][:2] == "20"
    assert (run["repeats"], run["warmup"]) == (3, 1)


def test_rows_have_median_spread_and_fidelity(run):
    rows = {r["variant"]: r for r in run["rows"]}
    assert list(rows) == ["diffusers", "vaeopt", "graphs"]
    for name in ("diffusers", "vaeopt"):
        r = rows[name]
        assert r["status"] == "ok" and len(r["times_ms"]) == 3 and r["first_call_ms"] > 0
        assert r["min_ms"] <= r["p20_ms"] <= r["median_ms"] <= r["p80_ms"] <= r["max_ms"]
        assert r["median_ms"] == pytest.approx(sorted(r["times_ms"])[1], abs=1e-3)
        assert r["tflops"] > 0 and r["peak_gib"] is None  # no CUDA allocator to read on the CPU
    # the reference is the same fp32 decode of the same weights and latent: diffusers' row is exact, vaeopt's close
    assert rows["diffusers"]["psnr_db"] == fidelity.PSNR_CAP and rows["diffusers"]["max_abs"] == 0
    assert rows["vaeopt"]["psnr_db"] > 100 and rows["vaeopt"]["max_abs_vs_baseline"] < 1e-4
    assert rows["vaeopt"]["speedup"] == pytest.approx(rows["diffusers"]["median_ms"] / rows["vaeopt"]["median_ms"])
    assert "plan" in rows["vaeopt"]["info"]
    # a variant that cannot run here is a row with the reason, not a crash
    assert rows["graphs"]["status"] == "skipped" and "GPU" in rows["graphs"]["reason"]


def test_summary_is_median_with_p20_p80(harness):
    s = harness.summary([float(t) for t in range(1, 12)])  # 1..11 ms
    assert (s["median_ms"], s["p20_ms"], s["p80_ms"], s["min_ms"], s["max_ms"]) == (6.0, 3.0, 9.0, 1.0, 11.0)


def test_bad_variant_is_refused(harness):
    with pytest.raises(SystemExit):
        harness.parse("decode_image", ["--variants", "nope"])


def test_a_process_past_its_timeout_is_stopped_with_its_stacks(harness):
    """one_shot.py's and first_call.py's child processes: one past its timeout is stopped, and says where it was."""
    import os

    secs, p = harness.timed_run([sys.executable, "-c", "import time\ntime.sleep(60)"], dict(os.environ), timeout=1)
    assert p.returncode == harness.TIMEOUT_RC and secs < 30
    assert "most recent call first" in p.stderr and 'File "<string>", line 2' in p.stderr


def test_plain_script_writes_diffusers_decode_and_its_phases(harness, tmp_path):
    """benchmarks/plain_decode.py, the baseline of one_shot.py and scripts/one_shot_phases.py: the PNG is diffusers'
    own decode of the folder's model, and with $PHASES_OUT it leaves one mark per phase, in order."""
    import os
    import subprocess

    import numpy as np
    from PIL import Image

    over = harness.TINY["AutoencoderKL"][0]
    folder = harness.save_model("sdxl", tmp_path / "vae", over)
    z = harness.randn((1, 4, 8, 8), 0)
    torch.save(z, tmp_path / "z.pt")
    env = dict(os.environ, PHASES_T0=repr(__import__("time").time()), PHASES_OUT=str(tmp_path / "marks.json"))
    p = subprocess.run([sys.executable, str(BENCH / "plain_decode.py"), str(folder), str(tmp_path / "z.pt"),
                        str(tmp_path / "out.png"), "cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.splitlines()[-1])["decode_s"] > 0
    from diffusers import AutoencoderKL

    with torch.inference_mode():
        x = AutoencoderKL.from_pretrained(folder).decode(z).sample
    want = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)[0].permute(1, 2, 0).numpy()
    got = np.asarray(Image.open(tmp_path / "out.png"))
    assert got.shape == want.shape == (64, 64, 3) and np.abs(got.astype(int) - want).max() <= 1
    marks = json.loads((tmp_path / "marks.json").read_text())["marks"]
    assert [m[0] for m in marks] == ["python", "cli", "torch", "read", "diffusers", "load", "plan", "stages", "decode",
                                     "write", "report", "atexit"]
    assert all(a[1] <= b[1] for a, b in zip(marks, marks[1:]))


def test_header_leaves_the_gpus_alone(harness, monkeypatch):
    """A result file's header records versions without the per-GPU memory query: that query creates a CUDA context
    on every GPU, which a parent process timing child processes must not hold."""
    from vaeopt import hw

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90"])
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    monkeypatch.setattr(hw, "gpu_info", lambda i: asked.append(i))
    h = harness.header(torch.device("cpu"), "python benchmarks/x.py")
    assert asked == [] and h["command"] == "python benchmarks/x.py" and h["versions"]["torch"] == torch.__version__
    hw.machine_info()
    assert asked == [0, 1]  # (the full machine report still lists every GPU)
