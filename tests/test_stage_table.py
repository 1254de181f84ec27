"""The stage table (vaeopt.stage_table): the decisions it makes, pinned for representative cases, on the CPU (a real
pipeline on the tiny sample VAEs) and on GPUs written out as DeviceInfo (no GPU needed)."""

import pytest
import torch

from vaeopt import planner
from vaeopt.options import spell_flags
from vaeopt.families import get_family
from vaeopt.kernels import triton_available
from vaeopt.loading import load_vae
from vaeopt.pipeline import Options, Pipeline
from vaeopt.stage_table import (AUTO_MIN_STEADY, ROWS, DeviceInfo, chunk_graphs, decide_autotune,
                                decide_chunk_graphs, decide_graphs, decide_stages)
from vaeopt.stages import Hint

# an H200 as the rules see it: Triton kernels, FP8 tensor cores, CUDA graphs, cuDNN
H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), triton=(True, ""), fp8_compute=(True, ""), graphs=(True, ""),
                  cudnn=(True, ""))
# a CUDA GPU without FP8 tensor cores (sm_80)
A100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0), triton=(True, ""),
                  fp8_compute=(False, "GPU sm_80 has no FP8 tensor cores (needs sm_89+)"), graphs=(True, ""),
                  cudnn=(True, ""))
CPU = DeviceInfo("cpu", triton=(True, ""))  # (the tests run with the Triton interpreter)


def _short(results) -> list[tuple[str, str]]:
    return [(r.name, "run" if r.status == "applied" else r.status) for r in results]


def test_rows_in_their_fixed_order():
    assert [r.name for r in ROWS] == ["precision", "fp8", "channels_last", "fused_norms", "fused_epilogues",
                                      "upsample_conv", "stacked_conv3d", "triton_conv", "fp8 convs", "attention"]
    needs = {r.name: [n for n, _ in r.needs] for r in ROWS}
    assert needs["fused_epilogues"] == ["fused_norms"] and needs["triton_conv"] == ["channels_last"]
    assert needs["stacked_conv3d"] == ["channels_last"]
    # a row only needs rows before it
    order = [r.name for r in ROWS]
    assert all(order.index(n) < order.index(r) for r, ns in needs.items() for n in ns)


@pytest.mark.parametrize("sample, want", [
    ("tiny_kl_image.safetensors", [
        ("precision", "run"), ("fp8", "skipped"), ("channels_last", "run"), ("fused_norms", "skipped"),
        ("fused_epilogues", "skipped"), ("upsample_conv", "skipped"), ("triton_conv", "skipped"),
        ("attention", "skipped")]),
    ("tiny_wan_video.safetensors", [
        ("precision", "run"), ("fp8", "skipped"), ("channels_last", "run"), ("fused_norms", "skipped"),
        ("fused_epilogues", "skipped"), ("upsample_conv", "skipped"), ("stacked_conv3d", "skipped"),
        ("triton_conv", "skipped"), ("attention", "skipped")]),
])
def test_cpu_defaults_pinned(samples_dir, sample, want):
    """A CPU pipeline with default options: channels_last alone (it pays there), the Triton stages skipped with the
    interpreter hint, no fp8; the table's dry run agrees with the real pipeline wherever the table decides."""
    lines = []
    pipe = Pipeline(load_vae(samples_dir / sample), Options(device="cpu"), log=lines.append, spell=spell_flags)
    assert _short(pipe.stages) == want
    st = {s.name: s for s in pipe.stages}
    assert st["fp8"].hints == ((Hint("fp8", "on"),),) and "off (enable with --fp8 on; gated at 40 dB" in lines[1]
    assert "(on the CPU it pays without the fused kernels)" in st["channels_last"].detail
    assert st["fused_norms"].hints == ((Hint("triton", "on"),),)
    assert st["triton_conv"].hints == ((Hint("triton", "on"), Hint("conv_kernel", "on")),)
    assert not any("{" in line for line in lines), lines  # every slot filled
    dry = decide_stages(Options(device="cpu"), pipe.family, torch.float32, CPU)
    # the table lets attention run; the stage finds nothing to change on the CPU (diffusers' SDPA already)
    table = dict(_short(dry))
    assert dict(_short(pipe.stages)) == {**table, "attention": "skipped"} and table["attention"] == "run"


@pytest.mark.skipif(not triton_available("cpu")[0], reason="the Triton interpreter runs the forced kernels")
def test_cpu_forced_stages(samples_dir):
    """Forced on, on the CPU: the table lets every stage run (the interpreter runs the kernels); the stacked
    Conv3d then leaves triton_conv nothing at the tiny Wan's widths."""
    o = Options(device="cpu", triton="on", conv_kernel="on", upsample_conv="on", stack_conv3d="on")
    pipe = Pipeline(load_vae(samples_dir / "tiny_wan_video.safetensors"), o)
    assert _short(pipe.stages) == [("precision", "run"), ("fp8", "skipped"), ("channels_last", "run"),
                                   ("fused_norms", "run"), ("fused_epilogues", "run"), ("upsample_conv", "run"),
                                   ("stacked_conv3d", "run"), ("triton_conv", "skipped"), ("attention", "skipped")]
    assert "stacked_conv3d took them" in pipe.stages[7].detail


def _gpu(family: str, dtype=torch.bfloat16, info=H200, **opts):
    return {r.name: r for r in decide_stages(Options(device="cpu", **opts), get_family(family), dtype, info)}


def test_h200_image_defaults_pinned():
    d = _gpu("sdxl")
    assert _short(d.values()) == [("precision", "run"), ("fp8", "skipped"), ("channels_last", "run"),
                                  ("fused_norms", "run"), ("fused_epilogues", "run"), ("upsample_conv", "run"),
                                  ("triton_conv", "run"), ("attention", "run")]
    assert "stacked_conv3d" not in d and "fp8 convs" not in d  # no causal Conv3d; fp8 off: no level 3 row


def test_h200_fp8_is_level_3_for_16_bit_image_decodes():
    d = _gpu("sdxl", fp8="on")
    assert d["fp8"].status == "skipped" and "8-bit implicit-GEMM convs" in d["fp8"].detail
    assert d["fp8"].hints == ((Hint("fp8", "weights"),), (Hint("fp8", "gemm"),))
    assert d["fp8 convs"].status == "applied"
    d = _gpu("sdxl", fp8="on", conv_kernel="off")
    assert d["fp8 convs"].status == "skipped" and d["fp8 convs"].text(spell_flags) == \
        "--conv-kernel off (the e4m3 convs are Triton kernels)"
    assert d["triton_conv"].detail == "off"
    # fp32 on a GPU: levels 1-2 (level 3 is for 16-bit decodes), and triton_conv keeps cuDNN
    d = _gpu("sdxl", dtype=torch.float32, fp8="on")
    assert d["fp8"].status == "applied" and "fp8 convs" not in d
    assert d["triton_conv"].detail == "fp32 decode: cuDNN kept (the kernel's fp32 dot would use TF32)"
    # no FP8 tensor cores: levels 1-2 cannot run either; level 1 alone can
    d = _gpu("sdxl", info=A100, fp8="on")
    assert d["fp8"].status == "skipped" and "fp8 convs" not in d
    assert d["fp8"].text(spell_flags) == ("GPU sm_80 has no FP8 tensor cores (needs sm_89+) (--fp8 weights, level 1 "
                                          "alone, runs without them)")
    assert _gpu("sdxl", info=A100, fp8="weights")["fp8"].status == "applied"


def test_h200_other_families_pinned():
    d = _gpu("wan21")
    assert _short(d.values()) == [("precision", "run"), ("fp8", "skipped"), ("channels_last", "run"),
                                  ("fused_norms", "run"), ("fused_epilogues", "run"), ("upsample_conv", "run"),
                                  ("stacked_conv3d", "run"), ("triton_conv", "run"), ("attention", "run")]
    assert _gpu("wan21", dtype=torch.float32, fp8="on")["fp8 convs"].status == "applied"  # Wan: level 3 always
    # a GPU the Wan stages were not measured on: the Conv3d and cuDNN kept unless forced
    sm86 = DeviceInfo("cuda", "a GPU", (8, 6), triton=(True, ""), graphs=(True, ""), cudnn=(True, ""))
    d = _gpu("wan21", info=sm86)
    assert d["stacked_conv3d"].text() == "tuned for sm_90 only; the Conv3d kept on sm_86 (stack_conv3d=on to force)"
    assert d["triton_conv"].text() == "tuned for sm_90 only; cuDNN kept on sm_86 (conv_kernel=on to force)"
    assert _gpu("wan21", info=sm86, stack_conv3d="on")["stacked_conv3d"].status == "applied"
    d = _gpu("hunyuanvideo")
    assert d["channels_last"].status == "skipped" and "NCDHW" in d["channels_last"].detail
    assert d["triton_conv"].detail == "needs channels_last activations (the kernel reads NDHWC)"
    assert _gpu("hunyuanvideo", channels_last="on")["channels_last"].status == "applied"
    d = _gpu("taesd")
    assert d["channels_last"].detail == "TAESD is too small to gain from NHWC"
    # the fused norms switched off: channels_last does not pay alone on a GPU
    d = _gpu("sdxl", triton="off")
    assert d["channels_last"].status == "skipped" and "aten GroupNorm relayouts NHWC" in d["channels_last"].detail
    assert d["fused_epilogues"].detail == "needs the fused norms (they carry the folded biases)"


def test_h200_chunk_decoder_families_take_channels_last_3d():
    """HunyuanVideo 1.5 / LTX-2: channels_last_3d and the fused norms on in auto mode, on CUDA as on the CPU (with
    conv inputs padded in one buffer, NDHWC measured 1.97x / 1.96x diffusers on an H200 against NCDHW's 1.00x /
    1.13x: h200_ltx2-768_onebuffer_2026-11-29.json, h200_hunyuan15-480p_onebuffer_2026-11-29.json); "off" still
    keeps NCDHW."""
    for fam in ("ltx2", "hunyuanvideo15"):
        d = _gpu(fam)
        assert d["channels_last"].status == "applied", d["channels_last"].text()
        assert d["fused_norms"].status == "applied"
        assert _gpu(fam, channels_last="off")["channels_last"].status == "skipped"
        assert _gpu(fam, info=CPU)["channels_last"].status == "applied"


def test_fp16_sdxl_runs_in_fp32():
    d = decide_stages(Options(device="cpu"), get_family("sdxl"), torch.float16, H200)
    assert {r.name: r for r in d}["triton_conv"].status == "skipped"  # the fp32 it was raised to
    d = decide_stages(Options(device="cpu"), get_family("sdxl"), torch.float16, H200, layout="in-memory")
    assert {r.name: r for r in d}["triton_conv"].status == "applied"  # optimize(pipe.vae): the caller's fp16


def _plan(mode="whole"):
    return planner.Plan(mode, 80 * 2**30, 2**30)


def test_graphs_decisions_pinned():
    o, sdxl = Options(), get_family("sdxl")
    # whole decodes: the measured table's break-even (planner.graphs_pay), the hint to force them where it says no
    need = next(n for n in range(1, 1000) if planner.graphs_pay(sdxl, (1, 4, 128, 128), n, gpu="NVIDIA H200")[0])
    d = decide_graphs(o, sdxl, H200, _plan(), (1, 4, 128, 128), need)
    assert d.kind == "whole" and d.why.startswith(f"{need} decodes of the same shape")
    d = decide_graphs(o, sdxl, H200, _plan(), (1, 4, 128, 128), need - 1)
    assert d.kind is None and d.why.hints == ((Hint("graphs", "on"),),)
    d = decide_graphs(o, sdxl, H200, _plan(), (1, 4, 512, 512), 1000)  # 16 MP: nothing measured near it
    assert d.kind is None and d.why.startswith("no graph measurement")
    assert decide_graphs(Options(graphs="on"), sdxl, H200, _plan(), (1, 4, 128, 128), 1).kind == "whole"
    assert decide_graphs(o, sdxl, H200, _plan("tiled"), (1, 4, 64, 64), 100).why == \
        "tiled decode: graphs are captured for whole decodes only"
    assert decide_graphs(Options(graphs="off"), sdxl, H200, _plan(), None, 100).why == "off"
    assert decide_graphs(o, sdxl, CPU, _plan(), None, 100).why == "no CUDA device: CUDA graphs need a GPU"
    wan = get_family("wan21")
    assert decide_graphs(o, wan, H200, _plan("tiled"), None, 1) == decide_graphs(o, wan, H200, _plan(), None, 1)
    assert decide_graphs(o, wan, H200, _plan(), None, 1).kind == "chunks"  # armed; decided per clip
    assert decide_graphs(o, wan, H200, _plan(), None, 99, chunks=False).why.startswith("Wan: the whole-clip graph")
    assert decide_graphs(o, get_family("hunyuanvideo"), H200, _plan(), None, 99).kind is None


def test_graphs_rows_apply_on_their_own_gpu_only():
    """The table's rows were measured on an H200: an A100 gets them with a 4x capture cost (graphs pay from 4x the
    decodes), and its line says it has no measured row; a real device's name carries "(cuda:0)", which the match
    ignores."""
    o, sdxl, z = Options(), get_family("sdxl"), (1, 4, 128, 128)
    need = next(n for n in range(1, 1000) if decide_graphs(o, sdxl, H200, _plan(), z, n).kind == "whole")
    far = next(n for n in range(1, 1000) if decide_graphs(o, sdxl, A100, _plan(), z, n).kind == "whole")
    assert (need, far) == (28, 111)
    d = decide_graphs(o, sdxl, A100, _plan(), z, need)
    assert d.kind is None and d.why.spell(spell_flags).startswith("no measured row for this GPU (NVIDIA A100)")
    assert "--graphs on" in d.why.spell(spell_flags)
    assert "no measured row" in decide_graphs(o, sdxl, A100, _plan(), z, far).why
    named = DeviceInfo("cuda", "NVIDIA H200 (cuda:0)", (9, 0), graphs=(True, ""), cudnn=(True, ""))
    assert named.gpu == "NVIDIA H200" and decide_graphs(o, sdxl, named, _plan(), z, need).kind == "whole"


def test_chunk_graphs_decisions_pinned():
    """Wan's per-chunk graphs, decided per clip: forced on from one warm-up chunk and one to replay, auto from
    AUTO_MIN_STEADY steady chunks of at most 0.5 MP; never tiled plans, the CPU or a decode inside a capture."""
    from vaeopt import video

    def d(mode, sched, info=H200, **kw):
        return decide_chunk_graphs(mode, info, sched, **kw)

    assert d("on", [1, 2, 2]) == (True, "2 chunks of 2 latent frame(s) after the first")
    use, why = d("auto", [1, 2, 2])
    assert not use and f"auto captures from {AUTO_MIN_STEADY}" in why
    assert why.hints == ((Hint("graphs", "on"),),) and "(graphs=on forces it)" in why.spell()
    assert not d("auto", [1] * 8, chunk_pixels=1)[0] and d("auto", [1] * 9, chunk_pixels=1)[0]
    sched = video.chunk_schedule(21, 2)  # [1, 2 x 10]
    assert d("auto", sched, chunk_pixels=8 * 128 * 128)[0]
    use, why = d("auto", sched, chunk_pixels=8 * 480 * 832)  # wan21-480p: GPU-bound, measured no gain
    assert not use and "3.2 MP per chunk: GPU-bound" in why and "(graphs=on forces it)" in why.spell()
    assert d("on", sched, chunk_pixels=8 * 480 * 832)[0]
    # the rule does not depend on FP8 or the GPU's generation: an A100 decides as the H200
    for mode in ("on", "auto"):
        for px in (1, 8 * 480 * 832):
            assert d(mode, sched, A100, chunk_pixels=px) == d(mode, sched, H200, chunk_pixels=px)
    use, why = d("on", [1, 2])
    assert not use and "needs one warm-up chunk and one more to replay" in why
    assert not d("on", [5])[0]
    use, why = d("on", [1, 2, 2, 2], tiles=3)
    assert not use and "spatially tiled plan (3 tiles)" in why
    assert d("on", [1, 2, 2, 2], capturing=True) == (False, "already inside a CUDA graph capture")
    assert d("on", [1, 2, 2, 2], CPU) == (False, "CPU decode: CUDA graphs need a GPU")
    assert d("off", [1, 2, 2, 2]) == (False, "off")
    # the policy the pipeline arms carries this rule, bound to its mode and device
    assert chunk_graphs("auto", H200).rule([1, 2, 2], 1, None, False) == d("auto", [1, 2, 2])
    with pytest.raises(ValueError):
        chunk_graphs("always", H200)


def test_autotune_decisions_pinned(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    from vaeopt.stages import cudnn_autotune as ct

    assert decide_autotune("auto", H200, ct.MIN_REPEATS)[0] is True
    assert decide_autotune("auto", H200, ct.MIN_REPEATS - 1)[0] is False
    assert decide_autotune("auto", CPU, 10_000) == (False, "no CUDA device: cuDNN runs on the GPU only")


@pytest.mark.parametrize("gpu", ["H200", "A100"])
def test_info_outlook_is_the_tables(monkeypatch, gpu):
    """`vaeopt info`'s stage rows are the table's decisions for its workloads on this device (here written out)."""
    from vaeopt import info as vinfo
    from vaeopt.hw import machine_info

    dev = {"H200": H200, "A100": A100}[gpu]
    monkeypatch.setattr(DeviceInfo, "of", classmethod(lambda cls, device: dev))
    monkeypatch.setattr(vinfo, "resolve_dtype", lambda dtype, device: torch.bfloat16)
    mi = machine_info()
    mi.gpus = [type("G", (), {"bf16": True, "sm": f"sm_{dev.capability[0]}{dev.capability[1]}", "free_gib": 100.0})]
    rows = {r["stage"]: r for r in vinfo.stage_outlook(mi, spell_flags)}
    wan = {r.name: r for r in decide_stages(Options(), get_family("wan21"), torch.bfloat16, dev)}
    assert rows["stacked_conv3d"]["runs"] is (wan["stacked_conv3d"].status == "applied") is (gpu == "H200")
    if gpu == "A100":
        assert rows["stacked_conv3d"]["why"] == "Wan 2.1: " + wan["stacked_conv3d"].text(spell_flags)
        # no FP8 compute here: said once, before what a GPU with it would do (tests/test_info_fp8.py)
        assert rows["fp8 convs"]["why"].startswith("opt-in. Here --fp8 on runs no FP8 compute (GPU sm_80 has no FP8 "
                                                   "tensor cores (needs sm_89+)). On a GPU with FP8 tensor cores")
    else:
        assert rows["fp8 convs"]["runs"] and rows["fp8"]["why"].startswith("opt-in, with --fp8 on: ")
    # Wan's per-chunk graphs for the 480p clip: the table's per-clip rule (GPU-bound at 3.2 MP per chunk)
    _, why = decide_chunk_graphs("auto", dev, [1] + [2] * 10, 1, 8 * 480 * 832)
    assert f"Wan 2.1: per chunk: {why.spell(spell_flags)}" in rows["graphs"]["why"]
    assert rows["cudnn_autotune"]["why"] == decide_autotune("auto", dev, 1)[1].spell(spell_flags)
