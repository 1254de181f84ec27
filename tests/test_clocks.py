"""The GPU clock sampler behind `vaeopt benchmark`'s clock line: nvidia-smi's CSV parsed, summarized, and the note
the CLI prints; the sampler's subprocess path against a fake nvidia-smi (it never raises into the timed work); off
CUDA it samples nothing."""

import os
import stat
import time
import types

import pytest
import torch

from vaeopt import hw
from vaeopt.benchmark import clock_note

# nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active
# --format=csv,noheader,nounits, as an H200 printed it during back-to-back decodes (the H200 sets the power-cap bit
# at full clock too), plus a line with a field the GPU does not report and a line cut short
SMI = """1980, 1980, 112.31, 700.00, 0x0000000000000004
1560, 1980, 694.12, 700.00, 0x0000000000000004
1575, 1980, 695.40, 700.00, 0x0000000000000004
1605, 1980, [N/A], 700.00, 0x0000000000000004
1590, 19"""


def test_parse_and_summarize():
    s = hw.parse_smi_samples(SMI)
    assert [x["sm_mhz"] for x in s] == [1980, 1560, 1575, 1605]  # the cut line is dropped, the N/A one kept
    assert s[1]["throttle"] == 4 and s[1]["power_limit_w"] == 700.0 and s[3]["power_w"] is None
    c = hw.summarize_clocks(s)
    assert c["samples"] == 4 and c["sm_mhz_median"] == 1605 and c["sm_mhz_min"] == 1560
    assert c["sm_mhz_max_rated"] == 1980 and c["power_w_max"] == 695.40
    assert c["slowdown"] == {"power cap": 3 / 4}  # the bit at full clock (line 1) is not a slowdown
    assert hw.summarize_clocks([]) is None
    assert hw.summarize_clocks(hw.parse_smi_samples("1410, 1410, [N/A], [N/A], [N/A]"))["power_w_max"] is None
    assert hw.parse_smi_samples("Field \"clocks_throttle_reasons.active\" is not a valid field to query.") == []


def test_note_names_the_headline_row_and_the_power_cap():
    c = hw.summarize_clocks(hw.parse_smi_samples(SMI))
    rows = [{"name": "diffusers bf16 eager", "kind": "peer", "status": "ok", "gpu_clock": c},
            {"name": "+ planner (tile/chunk)", "kind": "ladder", "status": "ok", "gpu_clock": c},
            {"name": "+ CUDA graphs", "kind": "ladder", "status": "skipped", "gpu_clock": None}]
    note = clock_note(rows)
    assert "'+ planner (tile/chunk)' (4 nvidia-smi readings)" in note and "1605 MHz median" in note
    assert "max 1980" in note and "up to 695 of 700 W" in note and "power cap in 75% of readings" in note
    assert "readings" not in clock_note([dict(rows[1], gpu_clock=dict(c, slowdown={}))]).split("):")[1]
    no_power = hw.summarize_clocks(hw.parse_smi_samples("1410, 1410, [N/A], [N/A], [N/A]"))
    assert " W" not in clock_note([dict(rows[1], gpu_clock=no_power)])
    assert clock_note([dict(rows[1], gpu_clock=None)]) is None


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A fake nvidia-smi on PATH (its script body given per test) and a CUDA device whose properties carry a uuid."""
    def install(body: str):
        f = tmp_path / "nvidia-smi"
        f.write_text("#!/bin/sh\n" + body)
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="abc-123", name="NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", None)
    return install


@pytest.mark.skipif(os.name != "posix", reason="the fake nvidia-smi is a shell script")
def test_sampler_reads_nvidia_smi_through_a_file(fake_gpu, tmp_path):
    # prints its arguments, then more lines than a pipe holds (64 KiB), then waits to be stopped
    fake_gpu(f'echo "$@" > "{tmp_path}/args"\ni=0\nwhile [ $i -lt 3000 ]; do echo "1560, 1980, 690.5, 700.00, 0x4"; '
             'i=$((i+1)); done\necho "1980, 1980, 100.0, 700.00, 0x0"\nexec sleep 30\n')
    with hw.ClockSampler(torch.device("cuda", 0), interval_ms=100) as cs:
        proc = cs.proc

        for _ in range(100):  # until the script reached its last line
            time.sleep(0.05)
            if cs.out is not None and os.fstat(cs.out.fileno()).st_size >= 3001 * 31:
                break
    assert cs.proc is None and proc.returncode is not None  # stopped and reaped
    assert cs.summary["samples"] == 3001 and cs.summary["sm_mhz_median"] == 1560
    assert cs.summary["slowdown"] == {"power cap": 3000 / 3001}
    args = (tmp_path / "args").read_text()
    assert "-i GPU-abc-123" in args and "-lms 100" in args


@pytest.mark.skipif(os.name != "posix", reason="the fake nvidia-smi is a shell script")
def test_sampler_never_raises(fake_gpu, monkeypatch):
    fake_gpu("printf '\\377\\376 not csv\\n'\nexit 3\n")  # prints bytes that are not UTF-8, then fails
    with hw.ClockSampler(torch.device("cuda", 0)) as cs:
        cs.proc.wait()
    assert cs.summary is None
    # deaf to SIGTERM: killed and reaped, and what it wrote is still read
    fake_gpu('trap "" TERM\necho "1500, 1980, 650.0, 700.00, 0x4"\nwhile :; do sleep 0.1; done\n')
    with hw.ClockSampler(torch.device("cuda", 0)) as cs:
        proc = cs.proc
        for _ in range(100):
            if os.fstat(cs.out.fileno()).st_size:
                break
            time.sleep(0.05)
    assert proc.returncode is not None and cs.summary["sm_mhz_median"] == 1500
    monkeypatch.setenv("VAEOPT_GPU_CLOCKS", "0")  # switched off: no process at all
    with hw.ClockSampler(torch.device("cuda", 0)) as cs:
        assert cs.proc is None
    monkeypatch.delenv("VAEOPT_GPU_CLOCKS")
    monkeypatch.setattr(torch.cuda, "get_device_properties",  # a MIG slice: torch's uuid does not name the GPU
                        lambda i: types.SimpleNamespace(uuid="abc-123", name="NVIDIA H100 80GB HBM3 MIG 1g.10gb"))
    with hw.ClockSampler(torch.device("cuda", 0)) as cs:
        assert cs.proc is None
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: no nvidia-smi readings
    with hw.ClockSampler(torch.device("cuda", 0)) as cs:
        assert cs.proc is None


def test_sampler_off_cuda_is_a_no_op():
    with hw.ClockSampler(torch.device("cpu")) as cs:
        pass
    assert cs.proc is None and cs.summary is None
