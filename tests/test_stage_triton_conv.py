"""The triton_conv stage: which convs it picks, what it reports, and that Wan decodes through the kernel equal the
stock diffusers decode (CPU, Triton interpreter: tests/conftest.py sets TRITON_INTERPRET=1)."""

import inspect

import pytest
import torch

from vaeopt import video
from vaeopt.kernels import triton_available
from vaeopt.stages import marks, triton_conv
from vaeopt.engine.wan_ops import wan_module

from test_video_fused import _tiny_wan21, decode


@pytest.fixture(autouse=True)
def _backend():
    ok, why = triton_available("cpu")
    if not ok:
        pytest.skip(why)


@pytest.fixture(scope="module")
def z(samples_dir):
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    return lat["coffee_zoom"].float()[:, :, :3, 10:11, 20:22].contiguous()  # 1x2 latent px: the interpreter is slow


@pytest.fixture(scope="module")
def ref(samples_dir, z):
    with torch.no_grad():
        return _tiny_wan21(samples_dir, fused=False).decode(z).sample


def _eligible_count(vae, max_cout):
    wan = wan_module()
    return sum(isinstance(m, wan.WanCausalConv3d) and tuple(m.kernel_size) == (3, 3, 3)
               and 16 <= m.out_channels <= max_cout for m in vae.decoder.modules())


@pytest.mark.parametrize("fused", [True, False])
def test_decode_through_kernel_equals_diffusers(samples_dir, z, ref, fused, monkeypatch):
    # the policy's cut at the tiny model's width: its 16-channel full-resolution convs, like Wan's 96-channel ones
    # (all layers would work too, but the interpreter is slow)
    monkeypatch.setattr(triton_conv, "MAX_COUT", 16)
    monkeypatch.setattr(triton_conv, "MIN_COUT", 16)
    vae = _tiny_wan21(samples_dir, fused=fused, channels_last=True)
    r = triton_conv.apply(vae, device=torch.device("cpu"), force=True)
    assert r.status == "applied"
    n = _eligible_count(vae, 16)
    assert n > 0 and r.data["layers"] == n and r.data["cudnn_layers"] > 0
    assert f"{n} causal Conv3d" in r.detail
    for chunk in ((1, 3) if fused else (2,)):  # schedules [1, 1, 1] and [3]
        out, st = decode(vae, z, chunk)
        assert (out - ref).abs().max().item() <= 1e-4, chunk
        steps = len(video.chunk_schedule(z.shape[2], chunk))
        assert st["triton_conv"] == n * steps  # every marked conv ran on the kernel, every step
    triton_conv.revert(vae)
    assert not any(hasattr(m, "_vaeopt_igemm") or hasattr(m, "_vaeopt_igemm_packed") for m in vae.modules())


def test_ncdhw_activations_stay_on_torch(samples_dir, z, ref):
    """Marked convs with NCDHW inputs (channels_last off) are not sent to the NDHWC kernel."""
    vae = _tiny_wan21(samples_dir, fused=False, channels_last=False)
    assert triton_conv.apply(vae, device=torch.device("cpu"), force=True).status == "applied"
    out, st = decode(vae, z, 2)
    assert "triton_conv" not in st and (out - ref).abs().max().item() <= 1e-4


def test_repacks_after_weight_change(samples_dir, z):
    vae = _tiny_wan21(samples_dir, fused=False, channels_last=True)
    triton_conv.apply(vae, device=torch.device("cpu"), force=True)
    conv = next(m for m in vae.modules() if getattr(m, "_vaeopt_igemm", False))
    x = torch.randn(1, conv.in_channels, 3, 4, 4).to(memory_format=torch.channels_last_3d)
    p1 = triton_conv.packed_for(conv, x)
    assert triton_conv.packed_for(conv, x) is p1  # cached
    with torch.no_grad():
        conv.weight.mul_(2)
    p2 = triton_conv.packed_for(conv, x)
    assert p2 is not p1 and torch.allclose(p2.w, p1.w * 2)
    assert triton_conv.packed_for(conv, x.contiguous()) is None  # NCDHW: not for the kernel


def test_skips_with_reasons(samples_dir):
    from vaeopt.families import build_model, get_family

    kl = build_model(get_family("sd15"), block_out_channels=[8, 8], layers_per_block=1,
                     down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                     norm_num_groups=4)
    r = triton_conv.apply(kl, device=torch.device("cpu"), force=True)
    assert r.status == "skipped" and "no Conv3d" in r.detail
    # not forced (the stage table's rule): the CPU is not a target, nor a GPU it was not measured on
    from vaeopt.pipeline import Options
    from vaeopt.stage_table import DeviceInfo, decide_stages

    def row(info, **o):
        return {r.name: r for r in decide_stages(Options(triton="on", **o), get_family("wan21"), torch.bfloat16,
                                                 info)}["triton_conv"]

    cpu = DeviceInfo("cpu", triton=(True, ""))
    assert row(cpu, conv_kernel="on").status == "applied"  # forced: through the interpreter (tests)
    r = row(cpu)
    assert r.status == "skipped" and "the Triton conv would run only through the interpreter" in r.detail
    r = row(DeviceInfo("cpu", triton=(False, "no interpreter")), conv_kernel="on")
    assert r.status == "skipped" and "no CUDA GPU" in r.detail
    r = row(DeviceInfo("cuda", "a GPU", (8, 6), triton=(True, "")))
    assert r.status == "skipped" and r.text() == "tuned for sm_90 only; cuDNN kept on sm_86 (conv_kernel=on to force)"
    assert row(DeviceInfo("cuda", "a GPU", (8, 6), triton=(True, "")), conv_kernel="on").status == "applied"


def test_pipeline_reports(samples_dir):
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline

    def stage(**o):
        lines = []
        p = Pipeline(load_vae(samples_dir / "tiny_wan_video.safetensors"), Options(device="cpu", **o),
                     log=lines.append)
        return next(s for s in p.stages if s.name == "triton_conv")

    s = stage()
    assert s.status == "skipped" and "interpreter" in s.detail
    assert stage(conv_kernel="off").detail == "off"
    s = stage(conv_kernel="on", channels_last="off")
    assert s.status == "skipped" and "channels_last" in s.detail
    s = stage(conv_kernel="on", channels_last="on")
    assert s.status == "applied"


def test_fp8_convs_on_the_trained_model(samples_dir, monkeypatch):
    """FP8 level 3 on the trained tiny Wan: the residual-block convs run on e4m3 inputs written by the RMS-norm
    kernel (static scales), the probe PSNR vs fp32 is real, and the gate falls back with the number."""
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    z = lat["coffee_zoom"].float()[:, :, :2, 10:11, 20:22].contiguous()
    vae = _tiny_wan21(samples_dir, fused=True, channels_last=True)
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    r = triton_conv.apply_fp8(vae, torch.device("cpu"), torch.float32, gate_db=20.0, probe=z,
                              decode=video.decode_video)
    n = len(triton_conv.fp8_candidates(vae))
    assert r.status == "applied" and r.data["layers"] == n > 0, r.line()
    print(r.line())
    assert 20.0 <= r.data["probe_db"] < r.data["bf16_probe_db"], r.data  # lossy, but not garbage
    assert r.data["tma_layers"] == 0 and "TMA" not in r.line()  # the TMA variant is sm_90-only: never claimed on CPU
    out, st = decode(vae, z, 2)  # the marked convs really ran on fp8 (chunk 2: one step)
    assert st["fp8_conv"] == n
    with torch.no_grad():
        ref = _tiny_wan21(samples_dir, fused=False).decode(z).sample
    from vaeopt.fidelity import psnr

    assert abs(psnr(out, ref) - r.data["probe_db"]) < 0.5
    # the gate: above what fp8 reaches -> per-layer sensitivity, then fallback, marks removed, the number in the
    # line (on two candidates: every probe of the search runs the interpreted e4m3 conv)
    triton_conv.revert(vae)
    two = triton_conv.fp8_candidates(vae)[-2:]
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: two)
    r2 = triton_conv.apply_fp8(vae, torch.device("cpu"), torch.float32, gate_db=99.0, probe=z,
                               decode=video.decode_video)
    assert r2.status == "fallback" and f"{r2.data['probe_db']:.1f} dB" in r2.detail and "< gate 99" in r2.detail
    assert not any(getattr(m, "_vaeopt_fp8conv", False) for m in vae.modules())
    out, st = decode(vae, z, 2)
    assert "fp8_conv" not in st


def test_fp8_convs_need_the_fused_path(samples_dir, monkeypatch):
    ok, why = triton_conv.fp8_available(torch.device("cpu"))
    assert not ok and "no CUDA GPU" in why
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    vae = _tiny_wan21(samples_dir, fused=False, channels_last=True)
    r = triton_conv.apply_fp8(vae, torch.device("cpu"), torch.float32, decode=video.decode_video)
    assert r.status == "skipped" and "fused path" in r.detail and "RMS-norm" in r.detail


def test_fp8_convs_keep_the_sensitive_layers(samples_dir, monkeypatch):
    """When all candidates miss the gate, per-layer sensitivity decides: a layer made deliberately fp8-hostile (one
    huge input channel that crushes the others' e4m3 precision under a per-tensor scale) is the one kept in the
    compute dtype, and the rest run in fp8 above the gate."""
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    z = lat["coffee_zoom"].float()[:, :, :1, 10:11, 20:21].contiguous()
    vae = _tiny_wan21(samples_dir, fused=True, channels_last=True)
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    cands = triton_conv.fp8_candidates(vae)[-3:]  # three full-resolution convs (fast under the interpreter)
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: cands)
    bad_name, bad = cands[1]
    blk = next(b for n, b in vae.decoder.named_modules() if f"decoder.{n}.conv1" == bad_name or
               f"decoder.{n}.conv2" == bad_name)
    norm = blk.norm1 if bad_name.endswith("conv1") else blk.norm2
    with torch.no_grad():  # channel 0 of the norm output becomes ~1e4x the rest; the conv undoes it exactly
        norm.gamma.data[0] *= 1e4
        bad.weight.data[:, 0] /= 1e4
    r0 = triton_conv.apply_fp8(vae, torch.device("cpu"), torch.float32, gate_db=10.0, probe=z,
                              decode=video.decode_video)
    # above all-fp8 (54.6 dB), so the sensitivity pass must run; below the two unplanted layers together (~58.9 dB:
    # 60.7 and 63.7 dB alone; the planted one alone 58.5), so keeping the planted one alone passes
    gate = r0.data["probe_db"] + 3
    r = triton_conv.apply_fp8(vae, torch.device("cpu"), torch.float32, gate_db=gate, probe=z, margin_db=0.0,
                              decode=video.decode_video)
    assert r.status == "applied", r.line()
    assert r.data["kept"] == [bad_name] and r.data["layers"] == 2
    assert r.data["probe_db"] >= gate
    assert min(r.data["sensitivity_db"], key=r.data["sensitivity_db"].get) == bad_name
    assert "most sensitive kept" in r.detail and bad_name.replace("decoder.", "") in r.detail
    assert not getattr(bad, "_vaeopt_fp8conv") and all(getattr(m, "_vaeopt_fp8conv") for n, m in cands if m is not bad)


def _tiny_kl_fused(samples_dir):
    """The trained tiny AutoencoderKL, NHWC, with fused norms + epilogues (the path FP8 level 3 runs in)."""
    from vaeopt.loading import load_vae
    from vaeopt.stages import fused_epilogues, fused_norms

    model = load_vae(samples_dir / "tiny_kl_image.safetensors").model.float().eval()
    model.to(memory_format=torch.channels_last)
    assert fused_norms.apply(model).status == "applied"
    assert fused_epilogues.apply(model, device="cpu").status == "applied"
    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"][:, :, 20:24, 24:28]
    return model, z.float().contiguous(memory_format=torch.channels_last)


def _resnet_of(model, conv_name: str):
    """The ResnetBlock2D holding the conv named conv_name (a name from fp8_candidates)."""
    return model.get_submodule(conv_name.rsplit(".", 1)[0])


def _record_conv_dtypes(monkeypatch) -> list:
    """The input dtype of every conv_igemm call from here on (the patched module attribute: callers import it at
    call time)."""
    import importlib

    conv = importlib.import_module("vaeopt.kernels.conv")
    calls = []
    real = conv.conv_igemm
    monkeypatch.setattr(conv, "conv_igemm", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    return calls


def test_fp8_convs_in_the_image_decoder(samples_dir, monkeypatch):
    """FP8 level 3 on the trained tiny AutoencoderKL: the resnets' 3x3 convs run on e4m3 inputs written by the
    GroupNorm kernel (per-sample scales), the probe PSNR is the decode's real PSNR vs fp32, and the gate falls back
    with the number; conv_in / conv_out / upsampler convs are not candidates."""

    from vaeopt.fidelity import psnr

    model, z = _tiny_kl_fused(samples_dir)
    with torch.no_grad():
        ref = model.decode(z).sample.float()
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    # the measured policy: only >= 256-channel convs (the tiny model's are 32-128 ch wide) ...
    assert triton_conv.fp8_candidates(model) == []
    r0 = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, probe=z)
    assert r0.status == "skipped" and ">= 256 channels" in r0.detail
    monkeypatch.setattr(triton_conv, "IMAGE_FP8_MIN_CH", 0)  # ... lowered here to exercise the path
    cands = triton_conv.fp8_candidates(model)
    names = [n for n, _ in cands]
    assert len(cands) == 2 * sum(len(b.resnets) for b in model.decoder.up_blocks) + 2 * len(
        model.decoder.mid_block.resnets)
    assert all(n.endswith((".conv1", ".conv2")) and ".resnets." in n for n in names)
    cands = cands[::3]  # every third (each block kind stays covered): the interpreted e4m3 convs dominate the time
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: cands)
    r = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=25.0, probe=z)
    assert r.status == "applied" and r.data["layers"] == len(cands), r.line()
    assert "GroupNorm kernel" in r.detail and "Conv2d" in r.detail
    assert 25.0 <= r.data["probe_db"] < r.data["bf16_probe_db"], r.data
    calls = _record_conv_dtypes(monkeypatch)
    with torch.no_grad():
        out = model.decode(z).sample.float()
    assert calls == [torch.float8_e4m3fn] * len(cands)  # every marked conv ran on e4m3, nothing else did
    assert abs(psnr(out, ref) - r.data["probe_db"]) < 0.5
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: cands[-1:])  # one layer: the interpreter is slow
    r2 = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=99.0, probe=z)
    assert r2.status == "fallback" and "< gate 99" in r2.detail
    triton_conv.revert(model)
    assert not any(getattr(m, "_vaeopt_fp8conv", False) for m in model.modules())
    calls.clear()
    with torch.no_grad():
        out2 = model.decode(z).sample.float()
    assert calls == [] and torch.equal(out2, ref)  # fallback: exactly the bf16/fp32 fused path again


def test_int8_convs_in_the_image_decoder(samples_dir, monkeypatch):
    """Where the stage chooses int8 for the image resnet convs (sm_90; faked here) and knows the decode's size to
    gate at, the GroupNorm kernel writes int8 with a per-sample zero point, the convs run on int8 operands, the stage
    line says int8, and the probe (the decode's real PSNR vs fp32) is higher than with the same layers in e4m3: the
    point of int8 here."""

    from vaeopt.fidelity import psnr

    model, z = _tiny_kl_fused(samples_dir)
    with torch.no_grad():
        ref = model.decode(z).sample.float()
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    monkeypatch.setattr(triton_conv, "IMAGE_FP8_MIN_CH", 0)
    cands = triton_conv.fp8_candidates(model)[::3]
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: cands)
    monkeypatch.setattr(triton_conv, "int8_convs", lambda m, d: True)
    # int8's step grows with the image: without the decode's size to gate at, e4m3, and the line says why (this is
    # the same e4m3 gate as where int8 is not chosen at all: test_fp8_convs_in_the_image_decoder)
    r8 = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=25.0, probe=z)
    assert r8.status == "applied" and r8.data["resnet_format"] == "e4m3" and "e4m3 implicit-GEMM" in r8.detail
    assert "gated at the decode's size" in r8.detail, r8.line()
    # a larger decode: the gate measures int8 on a latent of that size, not on the small probe
    big = (1, z.shape[1], 2 * z.shape[2], 2 * z.shape[3])
    rb = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=25.0, probe=z, decode_shape=big)
    assert rb.data["resnet_format"] == "int8" and rb.data["probe_shape"] == list(big), rb.line()
    assert "8x8 latent, the decode size" in rb.detail
    r = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=25.0, probe=z,
                              decode_shape=tuple(z.shape))
    assert r.status == "applied" and r.data["layers"] == len(cands), r.line()
    assert r.data["resnet_format"] == "int8" and "int8 implicit-GEMM" in r.detail and "zero point" in r.detail
    assert r.data["probe_db"] > r8.data["probe_db"] + 1.0, (r.data["probe_db"], r8.data["probe_db"])
    import importlib

    conv = importlib.import_module("vaeopt.kernels.conv")
    calls, real = [], conv.conv_igemm
    monkeypatch.setattr(conv, "conv_igemm", lambda *a, **k: calls.append((a[0].dtype, k.get("residual") is not None))
                        or real(*a, **k))
    with torch.no_grad():
        out = model.decode(z).sample.float()
    assert [c[0] for c in calls] == [torch.int8] * len(cands)
    assert abs(psnr(out, ref) - r.data["probe_db"]) < 0.5
    # an int8 conv2 of a resnet without a shortcut adds the block input in its epilogue (no residual pass), and the
    # decode is the same as with the separate residual epilogue up to fp32 association, which the next norm's int8
    # rounding can turn into a code step here and there (70 dB between the two with Triton 3.9's interpreter; a
    # misplaced residual would cost far more than the 0.5 dB allowed against fp32)
    fused_res = [n for n, _ in cands if n.endswith("conv2") and _resnet_of(model, n).conv_shortcut is None]
    assert fused_res and sum(c[1] for c in calls) == len(fused_res) == r.data["residual_in_conv"]
    assert f"{len(fused_res)} int8 conv2 add their resnet's input in the epilogue" in r.detail
    # the separate residual epilogue, as where the residual does not fit the conv's epilogue
    monkeypatch.setattr(conv, "residual_fits", lambda *a, **k: False)
    calls.clear()
    with torch.no_grad():
        out_sep = model.decode(z).sample.float()
    assert not any(c[1] for c in calls)
    assert psnr(out_sep, out) > 60.0 and abs(psnr(out_sep, ref) - psnr(out, ref)) < 0.5, (psnr(out_sep, out),
                                                                                        psnr(out_sep, ref))
    triton_conv.revert(model)
    assert not any(getattr(m, "_vaeopt_conv8_int8", False) for m in model.modules())


def test_fp8_attention_core_joins_the_gate(samples_dir, monkeypatch):
    """Where it was measured (sm_90; faked here) the mid-block attention on fused_epilogues' chunked GEMM path is an
    FP8 level-3 candidate like a conv: the gate's probe includes it, the line names it, the decode runs
    fp8_attention, and the attention stage no longer calls it exact; revert takes it back. On CPU it is never a
    candidate."""
    from vaeopt.fidelity import psnr
    from vaeopt.loading import load_vae
    from vaeopt.stages import attention, fused_norms
    from vaeopt.stages import fused_epilogues as fe

    model = load_vae(samples_dir / "tiny_kl_image.safetensors").model.float().eval()
    model.to(memory_format=torch.channels_last)
    assert fused_norms.apply(model).status == "applied"
    assert fe.apply(model, device="cpu", min_head_dim=64).status == "applied"  # its head_dim 128 on the GEMM path
    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"][:, :, 20:24, 24:28]
    z = z.float().contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model.decode(z).sample.float()
    cpu = torch.device("cpu")
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    assert triton_conv.fp8_attention_candidates(model, cpu) == []
    monkeypatch.setattr(triton_conv, "attention_fp8_ready", lambda d: True)
    att = triton_conv.fp8_attention_candidates(model, cpu)
    assert [n for n, _ in att] == ["decoder.mid_block.attentions.0"]
    monkeypatch.setattr(triton_conv, "IMAGE_FP8_MIN_CH", 0)
    convs = triton_conv.fp8_candidates(model, cpu)[-1:]  # one conv beside it: the interpreter is slow
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: convs)
    calls = []
    real = fe.fp8_attention
    monkeypatch.setattr(fe, "fp8_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    r = triton_conv.apply_fp8(model, cpu, torch.float32, gate_db=20.0, probe=z)
    assert r.status == "applied" and r.data["layers"] == 2 and r.data["attention_cores"] == 1, r.line()
    assert "the mid-block attention core in e4m3" in r.detail and "1 residual-block Conv2d" in r.detail
    assert calls  # the gate's probes ran it
    calls.clear()
    with torch.no_grad():
        out = model.decode(z).sample.float()
    assert len(calls) == 1 and abs(psnr(out, ref) - r.data["probe_db"]) < 0.5
    assert 20.0 <= r.data["probe_db"] < r.data["bf16_probe_db"]
    a = attention.apply(model, device=cpu)
    assert a.data["fp8_blocks"] == 1 and "in e4m3" in a.detail and "exact" not in a.detail
    triton_conv.revert(model)
    assert not any(getattr(m, fe.FP8_ATTR, False) for m in model.modules())
    assert "exact query-chunked" in attention.apply(model, device=cpu).detail
    calls.clear()
    with torch.no_grad():
        model.decode(z)
    assert calls == []


def test_fp8_pack_cache_accepts_inference_tensors(samples_dir):
    """A model moved to its device under torch.inference_mode has weights without a version counter: the e4m3 pack
    cache must still work (found on the H200: 'Inference tensors do not track version counter')."""
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    with torch.inference_mode():
        conv.weight.data = conv.weight.data.clone()
        assert conv.weight.is_inference()
        pw = marks.packed_fp8(conv)
        assert marks.packed_fp8(conv) is pw  # cached
    assert pw.w.dtype == torch.float8_e4m3fn and pw.cout == 8


def test_fp8_upsampler_convs_join_the_gate(samples_dir, monkeypatch):
    """Where the TMA kernel has a tile (sm_90; faked here, the interpreter runs it), the upsampler convs that run as
    phase convs become FP8 level-3 candidates: the stage line names them, the gate's probe includes them, and the
    decode runs them as e4m3 phase convs; on CPU (no TMA) they are never candidates."""
    import importlib

    from vaeopt.fidelity import psnr
    from vaeopt.kernels import tma_conv
    from vaeopt.stages import upsample_conv

    model, z = _tiny_kl_fused(samples_dir)
    with torch.no_grad():
        ref = model.decode(z).sample.float()
    assert upsample_conv.apply(model, device=torch.device("cpu"), force=True).status == "applied"
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    monkeypatch.setattr(triton_conv, "IMAGE_FP8_MIN_CH", 0)
    monkeypatch.setattr(triton_conv, "IMAGE_FP8_MIN_CH_TMA", 0)
    assert triton_conv.fp8_upsampler_candidates(model, torch.device("cpu")) == []  # no TMA on CPU
    monkeypatch.setattr(tma_conv, "available", lambda d: True)
    # big tiles: few interpreted programs
    monkeypatch.setattr(tma_conv, "tuned_upconv_config",
                        lambda ci, co, w=None: tma_conv.TmaConfig(8, 8, 32, co, 0, 4, 1))
    ups = triton_conv.fp8_upsampler_candidates(model, torch.device("cpu"))
    assert [n for n, _ in ups] == [f"decoder.up_blocks.{i}.upsamplers.0.conv" for i in range(len(ups))]
    assert len(ups) == sum(b.upsamplers is not None for b in model.decoder.up_blocks)
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: [])  # the upsamplers alone: the interpreter is slow
    upconv = importlib.import_module("vaeopt.kernels.upconv")
    calls = []
    real = upconv.upconv2x_8bit
    monkeypatch.setattr(upconv, "upconv2x_8bit", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    r = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=20.0, probe=z)
    assert r.status == "applied" and r.data["layers"] == r.data["upsampler_layers"] == len(ups), r.line()
    assert r.detail.startswith(f"{len(ups)} upsampler convs as 2x2 phase convs in e4m3"), r.detail
    assert r.data["gate_s"] > 0 and f"gate probes {r.data['gate_s']:.1f} s" in r.detail  # the setup cost, measured
    calls.clear()
    with torch.no_grad():
        out = model.decode(z).sample.float()
    assert len(calls) == len(ups)
    assert abs(psnr(out, ref) - r.data["probe_db"]) < 0.5
    # where the resnet convs take int8, the upsamplers take symmetric int8 (no zero point), closer to fp32
    monkeypatch.setattr(triton_conv, "int8_convs", lambda m, d: True)
    r8 = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=20.0, probe=z,
                               decode_shape=tuple(z.shape))
    assert r8.detail.startswith(f"{len(ups)} upsampler convs as 2x2 phase convs in symmetric int8"), r8.detail
    dtypes = []
    monkeypatch.setattr(upconv, "upconv2x_8bit", lambda *a, **k: dtypes.append(a[0].dtype) or real(*a, **k))
    with torch.no_grad():
        out8 = model.decode(z).sample.float()
    assert dtypes == [torch.int8] * len(ups) and psnr(out8, ref) > psnr(out, ref)
    triton_conv.revert(model)
    upsample_conv.revert(model)


def test_image_fp8_channel_policy_follows_the_kernel(samples_dir, monkeypatch):
    """The narrowest e4m3 resnet conv is the one measured to pay on the kernel this device runs: >= 256 channels on
    the pointer kernel, >= 128 where the TMA kernel runs (sm_90)."""
    from vaeopt.kernels import tma_conv

    model, _ = _tiny_kl_fused(samples_dir)  # 32-128 channels wide
    cpu = torch.device("cpu")
    assert triton_conv.image_min_channels(cpu) == triton_conv.IMAGE_FP8_MIN_CH == 256
    assert triton_conv.fp8_candidates(model, cpu) == []
    monkeypatch.setattr(tma_conv, "available", lambda d: True)
    assert triton_conv.image_min_channels(cpu) == triton_conv.IMAGE_FP8_MIN_CH_TMA == 128
    wide = triton_conv.fp8_candidates(model, cpu)
    assert wide and all(min(c.in_channels, c.out_channels) >= 128 for _, c in wide)
    monkeypatch.setattr(triton_conv, "IMAGE_FP8_MIN_CH_TMA", 0)
    assert len(triton_conv.fp8_candidates(model, cpu)) > len(wide)  # the narrower convs exist and were left out


def test_192_channel_layers_go_back_to_cudnn_where_the_gluon_kernel_does_not_run(monkeypatch):
    """The stage marks Wan's 192-ch convs only for the warp-specialized kernel (E42); if that kernel does not run
    for a call (switched off after a failed launch, another dtype or device), packed_for hands the layer back to
    cuDNN instead of the pointer kernel, which is slower there."""
    conv = wan_module().WanCausalConv3d(192, 192, 3, padding=1).to(torch.bfloat16)
    conv._vaeopt_igemm = True
    x = torch.zeros(1, 192, 3, 2, 2, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    assert triton_conv.packed_for(conv, x) is None  # CPU: no Gluon kernel here
    monkeypatch.setattr(triton_conv, "_on_ws", lambda c, d, t: t == torch.bfloat16)
    pw = triton_conv.packed_for(conv, x)
    assert pw is not None and pw.kmajor and pw.cout == 192
    assert triton_conv.packed_for(conv, x.half()) is None


def test_int8_gate_falls_back_to_e4m3(samples_dir, monkeypatch):
    """Where the int8 gate at the decode's size cannot run (out of GPU memory) or no int8 subset passes there, the
    resnet convs take e4m3 on the small probe, and the stage line says which and why."""
    model, z = _tiny_kl_fused(samples_dir)
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    monkeypatch.setattr(triton_conv, "IMAGE_FP8_MIN_CH", 0)
    cands = triton_conv.fp8_candidates(model)[::3]
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: cands)
    monkeypatch.setattr(triton_conv, "int8_convs", lambda m, d: True)
    real = triton_conv._gate_search
    probes, e4m3 = [], []

    def oom_at_full_size(model, cands, probe, *a):
        probes.append((tuple(probe.shape), bool(getattr(cands[0][1], triton_conv._INT8, False))))
        if len(probes) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        e4m3.append((tuple(probe.shape), real(model, cands, probe, *a)))
        return e4m3[-1][1]

    monkeypatch.setattr(triton_conv, "_gate_search", oom_at_full_size)
    big = (1, z.shape[1], 64, 64)
    r = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=25.0, probe=z, decode_shape=big)
    assert probes == [(big, True), (tuple(z.shape), False)]
    assert r.status == "applied" and r.data["resnet_format"] == "e4m3", r.line()
    assert "not int8: the int8 gate's probe at the decode's size (64, 64) ran out of GPU memory" in r.detail
    assert not any(getattr(m, triton_conv._INT8, False) for _, m in cands)

    def no_int8_subset(model, cands, probe, *a):
        if getattr(cands[0][1], triton_conv._INT8, False):
            return None, {}, "probe 20.0 dB vs fp32 < gate 25 dB with all 2 layers, and no subset cleared it"
        # the e4m3 search at the small probe, as above (same layers, probe and gate): its result again, marks set
        assert not any(getattr(m, triton_conv._INT8, False) for _, m in cands) and tuple(probe.shape) == e4m3[0][0]
        chosen, stats, note = e4m3[0][1]
        inspect.signature(real).bind(model, cands, probe, *a).arguments["mark"](chosen or [])
        probes.append("e4m3 again")
        return chosen, dict(stats), note

    monkeypatch.setattr(triton_conv, "_gate_search", no_int8_subset)
    r = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=25.0, probe=z,
                              decode_shape=tuple(z.shape))
    assert r.status == "applied" and r.data["resnet_format"] == "e4m3" and probes[-1] == "e4m3 again", r.line()
    assert "; int8 at the decode's size: probe 20.0 dB vs fp32 < gate 25 dB with all 2 layers, and no subset cleared " \
           "it, so e4m3;" in r.detail, r.detail


def test_int8_gate_orders_layers_by_flops_per_noise(samples_dir, monkeypatch):
    """int8 (image decoders): the gate's per-layer order is FLOPs per unit of noise (E46), from the decoder's
    layout: an up block's convs run at the latent's size times 2 per upsampling block before it, an upsampler's conv
    as four 2x2 phase convs at twice its block's size. The chosen layers are a prefix of that order and clear the
    gate. e4m3 keeps least noisy first."""
    from vaeopt.families import build_model, get_family

    with torch.device("meta"):
        sdxl = build_model(get_family("sdxl"))
    named = dict(sdxl.named_modules())
    pick = ["decoder.mid_block.resnets.0.conv1", "decoder.up_blocks.0.resnets.0.conv1",
            "decoder.up_blocks.3.resnets.0.conv1", "decoder.up_blocks.1.upsamplers.0.conv"]
    fl = triton_conv._image_flops(sdxl, [(n, named[n]) for n in pick], (128, 128))
    assert fl["decoder.mid_block.resnets.0.conv1"] == fl["decoder.up_blocks.0.resnets.0.conv1"] == \
        2 * 128 * 128 * 512 * 512 * 9
    assert fl["decoder.up_blocks.3.resnets.0.conv1"] == 2 * 1024 * 1024 * 256 * 128 * 9  # after three upsamplers
    assert fl["decoder.up_blocks.1.upsamplers.0.conv"] == 2 * 512 * 512 * 512 * 512 * 4  # 256² -> 512², 2x2 taps
    assert triton_conv._image_flops(sdxl, [("decoder.conv_in", named["decoder.conv_in"])], (8, 8)) is None

    model, z = _tiny_kl_fused(samples_dir)
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    monkeypatch.setattr(triton_conv, "IMAGE_FP8_MIN_CH", 0)
    cands = triton_conv.fp8_candidates(model)[::5]  # every fifth layer: each gate pass decodes once per layer
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: cands)
    # e4m3 above what any subset reaches: the per-layer pass runs and orders (no int8 mark was set)
    r8 = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=99.0, probe=z, margin_db=0.0)
    assert r8.status == "fallback" and r8.data["order"] == "least noisy first", r8.line()
    assert sorted(r8.data["sensitivity_db"]) == sorted(n for n, _ in cands)
    assert not any(getattr(m, triton_conv._INT8, False) for _, m in cands)
    monkeypatch.setattr(triton_conv, "int8_convs", lambda m, d: True)
    r0 = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=10.0, probe=z,
                               decode_shape=tuple(z.shape))
    gate = r0.data["probe_db"] + 2  # above all-8-bit: the per-layer pass runs
    r = triton_conv.apply_fp8(model, torch.device("cpu"), torch.float32, gate_db=gate, probe=z, margin_db=0.0,
                              decode_shape=tuple(z.shape))
    assert r.status == "applied" and r.data["resnet_format"] == "int8", r.line()
    assert r.data["order"] == "FLOPs per unit of noise" and "the fewest FLOPs per unit of noise" in r.detail
    fl = triton_conv._image_flops(model, cands, tuple(z.shape[-2:]))
    sens = r.data["sensitivity_db"]
    order = sorted(sens, key=lambda n: -fl[n] * 10 ** (sens[n] / 10))
    chosen = [n for n, m in cands if getattr(m, "_vaeopt_fp8conv", False)]
    assert sorted(chosen) == sorted(order[:r.data["layers"]]) and r.data["probe_db"] >= gate


def test_fp8_convs_verdict_reused_and_slower_falls_back(samples_dir, monkeypatch):
    """The gate's verdict is stored (vaeopt.cache): the same model gated again marks the same convs without a probe
    and says from when; and a chosen set measured slower than the plain convs at the decode's size is undone with
    both times in the line (--fp8 on never slows a decode)."""
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    z = lat["coffee_zoom"].float()[:, :, :2, 10:11, 20:22].contiguous()
    vae = _tiny_wan21(samples_dir, fused=True, channels_last=True)
    monkeypatch.setattr(triton_conv, "fp8_available", lambda d: (True, ""))
    two = triton_conv.fp8_candidates(vae)[-2:]
    monkeypatch.setattr(triton_conv, "fp8_candidates", lambda m, d=None: two)
    searches = []
    real = triton_conv._gate_search
    monkeypatch.setattr(triton_conv, "_gate_search", lambda *a, **k: (searches.append(1), real(*a, **k))[1])

    def gate(**kw):
        triton_conv.revert(vae)
        return triton_conv.apply_fp8(vae, torch.device("cpu"), torch.float32, gate_db=20.0, probe=z,
                                     decode=video.decode_video, **kw)

    r1 = gate()
    marked1 = [getattr(m, "_vaeopt_fp8conv", False) for _, m in two]
    assert r1.status == "applied" and len(searches) == 1 and "reused" not in r1.detail
    r2 = gate()
    assert len(searches) == 1 and r2.status == "applied" and "verdict reused from" in r2.detail
    assert [getattr(m, "_vaeopt_fp8conv", False) for _, m in two] == marked1 and any(marked1)
    monkeypatch.setattr(triton_conv, "_speed", lambda *a, **k: {"ms_8bit": 5.0, "ms_plain": 4.0})
    r3 = gate(decode_shape=tuple(z.shape))  # another key (the decode's size): gated and timed
    assert r3.status == "fallback" and "slower" in r3.detail and "5.00 ms against 4.00 ms" in r3.detail
    assert not any(getattr(m, "_vaeopt_fp8conv", False) for _, m in two)
    r4 = gate(decode_shape=tuple(z.shape))  # the stored verdict keeps the fallback, without a probe
    assert r4.status == "fallback" and "reused" in r4.detail and len(searches) == 2
