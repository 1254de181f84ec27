"""cudnn_autotune: when it turns cuDNN's autotuner on, what it says when it does not, and that it undoes itself."""

import types

import pytest
import torch

from vaeopt.options import spell_flags
from vaeopt.stage_table import DeviceInfo, decide_autotune
from vaeopt.stages import Hint
from vaeopt.stages import cudnn_autotune as ct

# the device as the stage table's rules see it: a GPU with cuDNN written out, so that these run without one
CPU = DeviceInfo("cpu")
GPU = DeviceInfo("cuda", "a GPU", cudnn=(True, ""))


def test_cpu_skips_with_the_reason():
    for mode in ("auto", "on"):
        use, why = decide_autotune(mode, CPU, 1000)
        assert use is False and "no CUDA device" in why
    assert decide_autotune("off", CPU, 1000) == (False, "off")


@pytest.fixture
def fake_cudnn(monkeypatch):
    """A GPU with cuDNN, as far as the stage can tell (its flags in a stand-in for torch.backends.cudnn)."""
    fake = types.SimpleNamespace(benchmark=False, benchmark_limit=10, enabled=True, is_available=lambda: True)
    monkeypatch.setattr(torch.backends, "cudnn", fake)
    return fake


def test_auto_tunes_only_where_it_pays(fake_cudnn):
    use, why = decide_autotune("auto", GPU, 1)
    assert use is False
    assert f"from ~{ct.MIN_REPEATS} same-shape decodes" in why and (Hint("cudnn_autotune", "on"),) in why.hints
    assert "(--cudnn-autotune on for a long-running job)" in why.spell(spell_flags)
    assert "H100" not in why and "H200" not in why  # the measured reasons live in the docs
    assert decide_autotune("auto", GPU, ct.MIN_REPEATS) == (True, f"{ct.MIN_REPEATS} decodes of the same shape")
    assert decide_autotune("on", GPU, 1) == (True, "forced on")
    gib = 2**30  # tuned convs take more workspace: auto wants the headroom under the planner's budget
    use, why = decide_autotune("auto", GPU, 1000, est_bytes=7 * gib, budget_bytes=10 * gib)
    assert use is False and "7.0 of 10.0 GiB" in why and "48% more peak memory" in why
    assert decide_autotune("auto", GPU, 1000, est_bytes=6 * gib, budget_bytes=10 * gib)[0] is True
    assert decide_autotune("on", GPU, 1, est_bytes=7 * gib, budget_bytes=10 * gib)[0] is True
    assert decide_autotune("off", GPU, 10_000) == (False, "off")
    fake_cudnn.benchmark = True  # someone turned it on already: say so rather than claim a decision
    assert decide_autotune("auto", GPU, 1)[0] is True and "already on" in decide_autotune("auto", GPU, 1)[1]
    fake_cudnn.enabled = False  # what the stage reports for DeviceInfo.of then
    off = DeviceInfo("cuda", "a GPU", cudnn=ct.available(torch.device("cuda")))
    assert decide_autotune("on", off, 1) == (False, "cuDNN is not available or disabled in this torch")


def test_apply_sets_the_flags_and_revert_restores_them(fake_cudnn):
    r = ct.apply("forced on", limit=3)
    assert r.status == "applied" and "up to 3 engine configs" in r.detail and "forced on" in r.detail
    assert "workspace" in r.detail
    assert fake_cudnn.benchmark is True and fake_cudnn.benchmark_limit == 3
    ct.revert(r)
    assert fake_cudnn.benchmark is False and fake_cudnn.benchmark_limit == 10
    assert "every engine config" in ct.apply("x", limit=0).detail


def test_the_pipeline_logs_the_decision_once_per_job_list(samples_dir, tmp_path):
    from vaeopt import api
    from vaeopt.latents import read_latents
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline

    lat = tmp_path / "z.pt"
    torch.save(torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True), lat)
    lines = []
    pipe = Pipeline(load_vae(samples_dir / "tiny_kl_image.safetensors"), Options(device="cpu"), log=lines.append)
    jobs = api.plan_jobs([read_latents(lat)], pipe.loaded, tmp_path / "out.png", None, False)
    api.run_jobs(pipe, jobs)
    tuned = [line for line in lines if "cudnn_autotune" in line]
    assert tuned == ["– cudnn_autotune: skipped — no CUDA device: cuDNN runs on the GPU only"]


@pytest.mark.gpu
def test_autotuned_convs_stay_correct_on_the_gpu():
    """With the autotuner on, a conv shape this process has not seen yet is tuned, runs, and still matches fp32."""
    r = ct.apply("test")
    try:
        torch.manual_seed(0)
        x = torch.randn(2, 96, 3, 40, 56, device="cuda").to(memory_format=torch.channels_last_3d)
        w = torch.randn(96, 96, 3, 3, 3, device="cuda") * 0.02
        ref = torch.nn.functional.conv3d(x.double(), w.double(), padding=1)
        for _ in range(2):  # the first call tunes, the second reuses the choice
            y = torch.nn.functional.conv3d(x.bfloat16(), w.bfloat16(), padding=1)
        err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 2e-2, err
    finally:
        ct.revert(r)
    assert torch.backends.cudnn.benchmark is False
