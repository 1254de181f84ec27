"""`vaeopt` as a process leaves without the interpreter's teardown (vaeopt.cli.run): the outputs, the exit status,
stdout and the atexit handlers are as before; only the freeing of every module and object is skipped."""

import json
import os
import subprocess
import sys

import numpy as np
import torch
from PIL import Image

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
ENV.pop("VAEOPT_FAST_EXIT", None)

# a process that runs `vaeopt <args>` through run(), with an atexit handler and a module-level object whose __del__
# runs only in the interpreter's teardown; each leaves a file behind when it runs
PROBE = r"""
import atexit, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
class Teardown:
    def __del__(self):
        (out / "teardown").write_text("ran")
kept = Teardown()
if sys.argv[2] == "thread":  # a non-daemon thread still at work when the command returns
    threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
from vaeopt.cli import run
sys.argv = ["vaeopt", *sys.argv[3:]]
run()
"""


def _probe(tmp_path, *args, mode="plain", env=None):
    return subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), mode, *args], capture_output=True, text=True,
                          env=env or ENV)


def test_exit_skips_the_teardown_but_runs_atexit(tmp_path):
    from vaeopt import __version__

    p = _probe(tmp_path, "--version")
    assert p.returncode == 0 and f"vaeopt {__version__}" in p.stdout
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()


def test_fast_exit_off_keeps_the_full_teardown(tmp_path):
    # the control: the probe's object is freed in an ordinary exit, so its absence above means the teardown was skipped
    p = _probe(tmp_path, "--version", env={**ENV, "VAEOPT_FAST_EXIT": "off"})
    assert p.returncode == 0
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "teardown").read_text() == "ran"


def test_a_working_thread_is_waited_for(tmp_path):
    p = _probe(tmp_path, "--version", mode="thread")
    assert p.returncode == 0 and (tmp_path / "thread").read_text() == "done"


def test_exit_status_of_a_usage_error_is_kept(tmp_path):
    p = _probe(tmp_path, "decode", str(tmp_path / "missing.pt"))
    assert p.returncode == 2 and "Traceback" not in p.stderr and "error:" in p.stderr
    assert (tmp_path / "atexit").exists() and not (tmp_path / "teardown").exists()


def test_decode_process_writes_png_and_json(tmp_path, samples_dir):
    """python -m vaeopt decode ... --json -q: the PNG whole on disk and the JSON whole on stdout at exit."""
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)
    z = next(iter(lat.values())) if isinstance(lat, dict) else lat
    torch.save(z[:1], tmp_path / "a.pt")
    p = subprocess.run([sys.executable, "-m", "vaeopt", "decode", str(tmp_path / "a.pt"), "-m",
                        str(samples_dir / "tiny_kl_image.safetensors"), "-o", str(tmp_path / "a.png"), "--device",
                        "cpu", "--json", "-q"], capture_output=True, text=True, env=ENV)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout[p.stdout.index("{"):])
    assert doc["outputs"][0]["written"] == [str(tmp_path / "a.png")]
    img = np.asarray(Image.open(tmp_path / "a.png"))
    assert img.dtype == np.uint8 and img.shape[-1] == 3 and img.shape[0] == z.shape[-2] * 8


def test_cli_import_stays_light():
    """`vaeopt --help`, `--version` and argument mistakes answer before torch, diffusers or Triton load."""
    code = "import sys, vaeopt.cli; print(sorted(m for m in ('torch', 'diffusers', 'triton') if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert p.returncode == 0 and p.stdout.strip() == "[]"
