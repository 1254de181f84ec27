"""The graphs stage's auto rule (planner.graphs_pay): from the measured table configs/graphs_rule.json."""

import math

import pytest
import torch

from vaeopt import planner
from vaeopt.benchmark import WORKLOADS
from vaeopt.families import get_family

H200 = "NVIDIA H200"  # the GPU the table's rows were measured on, as torch names it


def test_table_rows_are_complete_and_match_their_workloads():
    rule = planner.graphs_rule()
    assert rule["capture_factor"] > 1 and rule["max_pixel_ratio"] > 1
    for r in rule["rows"]:
        assert r["eager_ms"] > 0 and r["replay_ms"] > 0 and r["source"] and r["gpu"]
        assert r["variant"] in ("bf16", "8bit") and get_family(r["family"]).cls_name == r["cls"]
        if r["workload"]:
            fam, shape = WORKLOADS[r["workload"]]
            assert fam == r["family"]
            assert r["pixels"] == shape[0] * shape[-2] * shape[-1] * get_family(fam).spatial_factor ** 2


def test_sdxl_1024_pays_from_the_measured_break_even():
    """sdxl-1024 on the H200: 18.9 -> 16.9 ms replayed, a 55.5 ms capture: from 28 same-shape decodes."""
    fam = get_family("sdxl")
    need = math.ceil(55.5 / (18.9 - 16.9))
    ok, why = planner.graphs_pay(fam, (1, 4, 128, 128), need - 1, gpu=H200)
    assert not ok and f"pays from {need}" in why and "18.9 -> 16.9 ms" in why
    ok, why = planner.graphs_pay(fam, (1, 4, 128, 128), need, gpu=H200)
    assert ok and "H200" in why
    assert not planner.graphs_pay(fam, (1, 4, 128, 128), 1, gpu=H200)[0]  # a one-shot decode never captures


def test_the_8bit_row_is_used_where_the_8bit_convs_run():
    fam = get_family("flux")
    need = math.ceil(3.0 * 17.0 / (17.0 - 13.7))  # no capture measured: capture_factor x eager
    assert planner.graphs_pay(fam, (1, 16, 128, 128), need, "8bit", H200)[0]
    assert not planner.graphs_pay(fam, (1, 16, 128, 128), need - 1, "8bit", H200)[0]
    ok, why = planner.graphs_pay(fam, (1, 16, 128, 128), need, "bf16", H200)  # flux has only its 8-bit row: that one
    assert ok and "8bit" in why


def test_rows_apply_only_to_the_gpu_they_were_measured_on():
    """On an A100 (no row of its own) the H200's sdxl-1024 row is used with 4x its capture cost, and the reason says
    so; on the H200 the row as measured. The break-even moves from 28 to 111 decodes."""
    fam, z = get_family("sdxl"), (1, 4, 128, 128)
    rule = planner.graphs_rule()
    assert {r["gpu"] for r in rule["rows"]} == {H200} and rule["unmeasured_capture_margin"] == 4.0
    need = math.ceil(55.5 / (18.9 - 16.9))
    far = math.ceil(4 * 55.5 / (18.9 - 16.9))
    for gpu in ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", None):
        ok, why = planner.graphs_pay(fam, z, far - 1, gpu=gpu)
        assert not ok and why.startswith("no measured row for this GPU") and f"pays from {far}" in why
        assert (gpu or "unknown") in why and "taken as 4x that, ~222 ms" in why
        assert planner.graphs_pay(fam, z, far, gpu=gpu)[0]
    assert planner.graphs_pay(fam, z, need, gpu=H200)[0]
    assert "no measured row" not in planner.graphs_pay(fam, z, need, gpu=H200)[1]


def test_sizes_far_from_any_measurement_stay_eager():
    ok, why = planner.graphs_pay(get_family("sdxl"), (1, 4, 512, 512), 1000, gpu=H200)  # 16 MP: no row within 4x
    assert not ok and "no graph measurement" in why and "16.78 MP" in why
    # a Wan clip in one call falls back to its class's row (Qwen-Image at 1.76 MP), but not 81 frames (32 MP)
    ok, why = planner.graphs_pay(get_family("wan21"), (1, 16, 21, 60, 104), 1000, gpu=H200)
    assert not ok and "no graph measurement" in why
    # sd15 at 512²: its own row (8.21 -> 5.58 ms, 27.2 ms capture): from 11 decodes
    assert planner.graphs_pay(get_family("sd15"), (1, 4, 64, 64), 11, gpu=H200)[0]
    assert not planner.graphs_pay(get_family("sd15"), (1, 4, 64, 64), 10, gpu=H200)[0]


def test_api_decodes_graph_a_shape_once_its_calls_have_paid(samples_dir, monkeypatch):
    """vaeopt.decode called once per image (as a pipeline calls its VAE): a shape is counted over the calls and
    captured from the call where the rule says the capture has paid (here from the 3rd); a shape seen once stays
    eager. (CPU: the graph is a stand-in that records which calls it ran; the rule is the real function with a
    table that pays from 3 decodes.)"""
    import vaeopt
    from vaeopt.stages import graphs

    monkeypatch.setattr(planner, "graphs_rule", lambda: {
        "capture_factor": 3.0, "max_pixel_ratio": 4.0,  # (measured on the device the test runs on)
        "rows": [{"family": "sdxl", "cls": "AutoencoderKL", "workload": None, "pixels": 128 * 128, "variant": "bf16",
                  "gpu": "CPU", "eager_ms": 10.0, "replay_ms": 5.0, "capture_ms": 15.0, "source": "test"}]})
    replayed = []

    class Fake:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, z):
            replayed.append(tuple(z.shape))
            return self.fn(z)

    monkeypatch.setattr(graphs, "available", lambda device: (True, ""))
    monkeypatch.setattr(graphs, "apply", lambda fn, device, **_: (Fake(fn), graphs.StageResult(
        "graphs", "skipped", "nothing captured yet")))
    loaded = vaeopt.load_vae(samples_dir / "tiny_kl_image.safetensors")
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"]
    a, b = lat[:, :, :16, :16], lat[:, :, :8, :16]
    lines = []
    outs = [vaeopt.decode(a, loaded, log=lines.append) for _ in range(2)]
    assert replayed == [] and not any("graphs" in ln for ln in lines)
    outs.append(vaeopt.decode(a, loaded, log=lines.append))  # the 3rd: 3 x 5 ms saved >= a 15 ms capture
    assert replayed == [(1, 4, 16, 16)]
    assert any("graphs" in ln and "paying from 3" in ln and "counted over calls" in ln for ln in lines)
    vaeopt.decode(b, loaded)  # another shape, once: eager
    vaeopt.decode(a, loaded)
    assert replayed == [(1, 4, 16, 16)] * 2
    assert torch.equal(outs[0], outs[2])  # the stand-in runs the same decode


def test_optimized_vae_decode_calls_graph_a_repeated_shape(samples_dir, monkeypatch):
    """vaeopt.optimize(pipe.vae): a pipeline calls vae.decode once per image; the repeated shape is captured from
    the call where the rule says it has paid (3rd here), with one stage line, and the output is unchanged; the model
    still deep-copies (the copy starts counting afresh). (CPU: a stand-in graph; the CUDA-only checks patched.)"""
    import copy

    import vaeopt
    from vaeopt import dropin
    from vaeopt.stages import graphs

    monkeypatch.setattr(planner, "graphs_rule", lambda: {
        "capture_factor": 3.0, "max_pixel_ratio": 4.0,
        "rows": [{"family": "sdxl", "cls": "AutoencoderKL", "workload": None, "pixels": 128 * 128, "variant": "bf16",
                  "gpu": "Test GPU", "eager_ms": 10.0, "replay_ms": 5.0, "capture_ms": 15.0, "source": "test"}]})
    replayed = []

    class Fake:
        def __init__(self, fn, device):
            self.fn = fn

        def __call__(self, z):
            replayed.append(tuple(z.shape))
            return self.fn(z)

        def reset(self):
            pass

    monkeypatch.setattr(graphs, "GraphedDecode", Fake)
    monkeypatch.setattr(dropin._RepeatGraphs, "_plain", lambda self, z, kw: not set(kw) - {"return_dict"})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    vae = vaeopt.load_vae(samples_dir / "tiny_kl_image.safetensors").model
    lines = []
    vaeopt.optimize(vae, log=lines.append)
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outs = [vae.decode(z).sample for _ in range(2)]
        assert replayed == [] and not any("graphs" in ln for ln in lines)
        outs.append(vae.decode(z).sample)
        outs.append(vae.decode(z, return_dict=False)[0])
        vae.decode(z[:, :, :8])  # another shape, once: eager
    assert replayed == [(1, 4, 16, 16)] * 2
    assert sum("graphs" in ln and "captured" in ln and "paying from 3" in ln for ln in lines) == 1
    assert all(torch.equal(o, outs[0]) for o in outs)
    twin = copy.deepcopy(vae)
    assert twin.decode.graphs.calls == {} and twin.decode.graphs.graphed is None


def test_a_capture_that_runs_out_of_memory_is_not_tried_again(monkeypatch):
    """An OOM while capturing goes to the caller's OOM path once; later calls of that shape decode eagerly instead
    of failing a capture (warm-up, capture, OOM) every time."""
    from vaeopt.stages.graphs import GraphedDecode

    calls = []
    g = GraphedDecode(lambda z: calls.append(tuple(z.shape)) or z * 2, torch.device("cpu"))

    def no_room(z):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(g, "_capture", no_room)
    z = torch.ones(1, 4, 8, 8)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        g(z)
    assert torch.equal(g(z), z * 2) and calls == [(1, 4, 8, 8)]
    assert g.failed[(tuple(z.shape), z.dtype, z.stride())] == "out of memory while capturing"
