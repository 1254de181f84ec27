"""The GPU clock sampler behind `vaeopt benchmark`'s clock line: nvidia-smi's CSV parsed, summarized, and the note
the CLI prints; off CUDA it samples nothing."""

import torch

from vaeopt import hw
from vaeopt.benchmark import clock_note

# nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active
# --format=csv,noheader,nounits, as an H200 printed it during back-to-back decodes (one line cut short, one N/A; the
# H200 sets the power-cap bit at full clock too)
SMI = """1980, 1980, 112.31, 700.00, 0x0000000000000004
1560, 1980, 694.12, 700.00, 0x0000000000000004
1575, 1980, 695.40, 700.00, 0x0000000000000004
1605, 1980, [N/A], 700.00, 0x0000000000000004
1590, 19"""


def test_parse_and_summarize():
    s = hw.parse_smi_samples(SMI)
    assert [x["sm_mhz"] for x in s] == [1980, 1560, 1575]  # the N/A line and the cut line are dropped
    assert s[1]["throttle"] == 4 and s[1]["power_limit_w"] == 700.0
    c = hw.summarize_clocks(s)
    assert c["sm_mhz_median"] == 1575 and c["sm_mhz_min"] == 1560 and c["sm_mhz_max_rated"] == 1980
    assert c["power_w_max"] == 695.40
    assert c["slowdown"] == {"power cap": 2 / 3}  # the bit at full clock (line 1) is not a slowdown
    assert hw.summarize_clocks([]) is None


def test_note_names_the_headline_row_and_the_power_cap():
    c = hw.summarize_clocks(hw.parse_smi_samples(SMI))
    rows = [{"name": "diffusers bf16 eager", "kind": "peer", "status": "ok", "gpu_clock": c},
            {"name": "+ planner (tile/chunk)", "kind": "ladder", "status": "ok", "gpu_clock": c},
            {"name": "+ CUDA graphs", "kind": "ladder", "status": "skipped", "gpu_clock": None}]
    note = clock_note(rows)
    assert "'+ planner (tile/chunk)'" in note and "1575 MHz median" in note and "max 1980" in note
    assert "up to 695 of 700 W" in note and "power cap in 67% of samples" in note
    quiet = dict(c, slowdown={})
    assert "samples" not in clock_note([dict(rows[1], gpu_clock=quiet)])
    assert clock_note([dict(rows[1], gpu_clock=None)]) is None


def test_sampler_off_cuda_is_a_no_op():
    with hw.ClockSampler(torch.device("cpu")) as cs:
        pass
    assert cs.proc is None and cs.summary is None
