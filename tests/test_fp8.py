"""FP8 math on CPU: quantize/dequantize error, weight-storage conversion of a real decoder, revert, the gate."""

import pytest
import torch

from vaeopt.families import build_model, get_family
from vaeopt.fidelity import psnr
from vaeopt.stages import fp8

pytestmark = pytest.mark.skipif(fp8.E4M3 is None, reason="no float8 dtype in this torch")


def test_quantize_per_channel_error_bound():
    torch.manual_seed(0)
    w = torch.randn(64, 32, 3, 3) * torch.logspace(-2, 1, 64).view(-1, 1, 1, 1)  # channels of very different scale
    q, s = fp8.quantize_per_channel(w)
    assert q.dtype == fp8.E4M3 and s.shape == (64,)
    back = fp8.dequantize(q, s, torch.float32)
    rel = (back - w).flatten(1).norm(dim=1) / w.flatten(1).norm(dim=1)
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4, per channel much smaller on average
    assert rel.max() < 0.05, rel.max()
    assert (back.abs().amax(dim=(1, 2, 3)) - w.abs().amax(dim=(1, 2, 3))).abs().max() < 1e-6 * 448


def test_storage_conversion_on_trained_decoder(samples_dir):
    from vaeopt.loading import load_vae

    loaded = load_vae(samples_dir / "tiny_kl_image.safetensors")
    model = loaded.model
    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"][:, :, :32, :32]
    z = z.float() / model.config.scaling_factor
    with torch.no_grad():
        ref = model.decode(z).sample
    before = {k: v.clone() for k, v in model.decoder.state_dict().items()}
    stats = fp8.convert(model, compute=False)  # CPU: storage only
    assert stats["storage"] > 10 and stats["gemm"] == 0 and stats["kept"] == 2
    assert stats["bytes_after"] * 4 == stats["bytes_before"]  # fp32 -> fp8
    with torch.no_grad():
        out = model.decode(z).sample
    p = psnr(out.clamp(-1, 1), ref.clamp(-1, 1))
    assert 25 < p < 80, p  # lossy but close; the exact figure goes into the log
    assert fp8.revert(model) == stats["storage"]
    with torch.no_grad():
        assert torch.equal(model.decode(z).sample, ref)
    for k, v in model.decoder.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_storage_works_for_wan_causal_convs(samples_dir):
    from vaeopt.loading import load_vae

    model = load_vae(samples_dir / "tiny_wan_video.safetensors").model
    z = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["astronaut_pan"][:, :, :2, :16, :16].float()
    with torch.no_grad():
        ref = model.decode(z).sample
    stats = fp8.convert(model, compute=False)
    assert stats["storage"] > 10
    with torch.no_grad():
        out = model.decode(z).sample
    assert out.shape == ref.shape and psnr(out, ref) > 25
    fp8.revert(model)
    with torch.no_grad():
        assert torch.equal(model.decode(z).sample, ref)


def test_channels_last_after_fp8_storage(samples_dir):
    from vaeopt.loading import load_vae
    from vaeopt.stages import channels_last

    model = load_vae(samples_dir / "tiny_kl_image.safetensors").model
    z = torch.randn(1, 4, 16, 16)
    with torch.no_grad():
        ref = model.decode(z).sample
    fp8.convert(model, compute=False)
    r = channels_last.apply(model)
    assert r.status == "applied" and r.data["conv2d"] > 10
    with torch.no_grad():
        out = model.decode(z).sample
    assert psnr(out, ref) > 25
    channels_last.revert(model)
    fp8.revert(model)
    with torch.no_grad():
        assert torch.allclose(model.decode(z).sample, ref, atol=1e-5)


def test_gate_reverts_when_fidelity_is_too_low():
    torch.manual_seed(0)
    spec = get_family("sdxl")
    model = build_model(spec, block_out_channels=[32, 32, 64, 64], norm_num_groups=8)
    r = fp8.apply(model, family=spec, gate_db=500.0, device=torch.device("cpu"), dtype=torch.float32, compute=False)
    assert r.status == "fallback" and "undone" in r.detail and r.data["psnr_db"] < 500
    assert not any(hasattr(m, "_vaeopt_fp8_hooks") for m in model.modules())
    r = fp8.apply(model, family=spec, gate_db=10.0, device=torch.device("cpu"), dtype=torch.float32, compute=False)
    assert r.status == "applied" and "e4m3" in r.detail and r.data["psnr_db"] >= 10


def test_available_reason_on_cpu():
    ok, why = fp8.available(torch.device("cpu"))
    assert not ok and "GPU" in why


def test_fp8_weights_runs_level_1_alone_and_gemm_says_why_not_on_cpu(samples_dir):
    """--fp8 weights is level 1 alone: e4m3 weight storage, which needs no FP8 tensor cores, so it runs on the CPU
    too (every conv but conv_in/conv_out stored in e4m3, no fp8 GEMM), its line says so, and the decode keeps the
    gate. --fp8 gemm (levels 1-2) needs the tensor cores: skipped with the reason and the level that would run."""
    from vaeopt.errors import VaeoptError
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline

    loaded = load_vae(samples_dir / "tiny_kl_image.safetensors")
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"].float()
    z = loaded.family.unscale(lat[:, :, 16:32, 16:32])
    with torch.inference_mode():
        ref = loaded.model.decode(z).sample.float().clamp(-1, 1)
    before = sum(p.numel() * p.element_size() for p in loaded.model.decoder.parameters())
    pipe = Pipeline(loaded, Options(device="cpu", fp8="weights"), log=None)
    st = next(s for s in pipe.stages if s.name == "fp8")
    assert st.status == "applied" and "level 1 only, no fp8 GEMMs" in st.detail, st.line()
    assert st.data["gemm"] == 0 and st.data["storage"] > 20 and st.data["saved_mib"] > 0
    stored = [m for m in loaded.model.decoder.modules() if hasattr(m, "qweight")]
    assert len(stored) == st.data["storage"] and all(m.qweight.dtype == fp8.E4M3 for m in stored)
    after = sum(t.numel() * t.element_size() for m in loaded.model.decoder.modules()
                for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
    assert after < 0.5 * before  # fp32 -> e4m3 for all but the first/last layers
    with torch.inference_mode():
        out = pipe.model.decode(z).sample.float().clamp(-1, 1)
    assert 40.0 <= psnr(out, ref) < 100  # lossy, within the default gate
    g = Pipeline(load_vae(samples_dir / "tiny_kl_image.safetensors"), Options(device="cpu", fp8="gemm"), log=None)
    st = next(s for s in g.stages if s.name == "fp8")
    assert st.status == "skipped" and "tensor cores" in st.detail, st.line()
    assert "(fp8=weights, level 1 alone, runs without them)" in st.line(), st.line()  # the hint, as Options fields
    with pytest.raises(VaeoptError, match="weights, gemm"):
        Options(fp8="level1").validate()


@pytest.mark.gpu
def test_fp8_gemm_mode_on_gpu(samples_dir):
    """--fp8 gemm on an FP8 GPU: level 2's GEMMs run (the 1x1 convs and linears as FP8GemmLinear), next to the
    stored convs, on the default (fused) path; the decode keeps the gate."""
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    loaded = load_vae(samples_dir / "tiny_kl_image.safetensors")
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"].float()
    z = loaded.family.unscale(lat)
    with torch.inference_mode():
        ref = loaded.model.decode(z).sample.float().clamp(-1, 1)
    pipe = Pipeline(loaded, Options(device="cuda", fp8="gemm", graphs="off"), log=None)
    st = next(s for s in pipe.stages if s.name == "fp8")
    assert st.status == "applied" and st.data["gemm"] > 0 and st.data["storage"] > 0, st.line()
    assert sum(isinstance(m, fp8.FP8GemmLinear) for m in loaded.model.modules()) == st.data["gemm"]
    with torch.inference_mode():
        out = pipe.model.decode(z.cuda().bfloat16()).sample.float().cpu().clamp(-1, 1)
    assert psnr(out, ref) >= 40.0


@pytest.mark.gpu
def test_scaled_mm_linear_on_gpu():
    lin = torch.nn.Linear(512, 512).cuda().bfloat16()
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    ref = lin(x)
    y = fp8.FP8GemmLinear(lin)(x)
    assert psnr(y.float() / ref.abs().max(), ref.float() / ref.abs().max(), data_range=2) > 25


# ---- per-layer sensitivity and the keep policy (vaeopt/quant/sensitivity.py; emulated, so CPU-testable) -----------

PLANTED = "up_blocks.1.resnets.1.conv1"


def _tiny_kl(samples_dir):
    from vaeopt.loading import load_vae

    loaded = load_vae(samples_dir / "tiny_kl_image.safetensors")
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"]
    return loaded.model, loaded.family.unscale(lat.float()[:, :, 20:28, 20:28])  # 8x8 latent crop: 64x64 decode


def _plant_sensitive_conv(model, name=PLANTED, factor=1e6):
    """Make one resnet conv1 fp8-hostile without touching what it computes much: its input channel 0 is silenced
    (norm1's gamma/beta zeroed, so silu(norm1(x))[:, 0] == 0) and that dead channel carries a weight 1e6x the
    channel's largest. Per-output-channel e4m3 scales then follow the outlier and the real weights underflow."""
    mods = dict(model.decoder.named_modules())
    res, conv = mods[name.rsplit(".", 1)[0]], mods[name]
    res.norm1.weight.data[0] = 0
    res.norm1.bias.data[0] = 0
    amax = conv.weight.data.abs().amax(dim=(1, 2, 3))
    conv.weight.data[:, 0, 1, 1] = factor * amax


def _plant_outlier_channel(model, factor=1e6):
    """Function-preserving outlier channel in the mid-block attention: value channel 0 scaled up (to_v's row 0 and
    bias), to_out's input column 0 scaled down by the same factor. Attention is linear in v, so the fp32 decode is
    unchanged; but to_v now has one huge output row (a per-tensor weight scale follows it, the other rows underflow),
    and to_out.0 one huge input channel (a per-tensor activation scale follows it) and one tiny weight column."""
    attn = model.decoder.mid_block.attentions[0]
    attn.to_v.weight.data[0] *= factor
    attn.to_v.bias.data[0] *= factor
    attn.to_out[0].weight.data[:, 0] /= factor


def test_fake_quant_is_the_stage_quantization():
    from vaeopt.quant import sensitivity as sens

    torch.manual_seed(0)
    w = torch.randn(64, 32, 3, 3)
    back = fp8.dequantize(*fp8.quantize_per_channel(w), torch.float32)
    assert torch.equal(sens.fake_quant(w, per_channel=True), back)
    lin = torch.nn.Linear(64, 32)
    assert torch.equal(sens.fake_quant(lin.weight.data, per_channel=False), fp8.FP8GemmLinear(lin).weight)
    x = torch.randn(4, 64)
    (xq,) = sens._act_pre_hook(lin, (x,))
    s = x.abs().amax() / fp8.E4M3_MAX
    assert torch.allclose((xq / s).to(fp8.E4M3).float(), xq / s, rtol=1e-6)  # on the e4m3 grid of the scale
    assert (xq - x).abs().max() <= x.abs().max() * 2**-4  # within half an e4m3 step of the largest


def test_emulation_restores_weights_and_matches_storage(samples_dir):
    from vaeopt.quant import sensitivity as sens

    model, z = _tiny_kl(samples_dir)
    ref = sens.decode_all(model, [z])
    names = [n for n, _, _ in sens.candidates(model, compute=False) if not fp8.is_kept(n, fp8.KEEP)]
    with sens.emulated(model, names, compute=False):
        emu = sens.decode_all(model, [z])
    assert torch.equal(sens.decode_all(model, [z])[0], ref[0])  # restored bit for bit
    fp8.convert(model, compute=False)  # the real storage path: same rounded weights, so the same decode
    real = sens.decode_all(model, [z])
    fp8.revert(model)
    assert torch.allclose(emu[0], real[0], atol=1e-6), (emu[0] - real[0]).abs().max()


def test_sensitivity_ranks_planted_conv_first(samples_dir):
    from vaeopt.quant import sensitivity as sens

    model, z = _tiny_kl(samples_dir)
    _plant_sensitive_conv(model)
    rows = sens.measure(model, [z], compute=False)  # storage recipe, as the stage on this machine
    assert rows[0]["layer"] == PLANTED, [(r["layer"], round(r["psnr_db"], 1)) for r in rows[:3]]
    assert rows[0]["psnr_db"] < rows[1]["psnr_db"] - 6  # 4x the error of the next one, at least
    assert {r["layer"] for r in rows} >= {"conv_in", "conv_out"}  # first/last measured too
    kept, pred, why = sens.choose_keep(rows, target_db=40.0)
    assert kept[:2] == list(fp8.KEEP) and why[PLANTED] == "dominant"


def test_sensitivity_finds_outlier_channel_with_activation_quantization(samples_dir):
    from vaeopt.quant import sensitivity as sens

    model, z = _tiny_kl(samples_dir)
    ref = sens.decode_all(model, [z])
    _plant_outlier_channel(model)
    assert sens.psnr_of(sens.mse(sens.decode_all(model, [z]), ref)) > 100  # the plant changed nothing in fp32
    names = [n for n, _, _ in sens.candidates(model) if ".attentions." in n] + ["conv_out"]
    # the GPU's recipe (compute=True): to_v/to_out.0 are fp8 GEMMs, per-tensor weight and activation scales
    rows = sens.measure(model, [z], names=names, mode="stage", compute=True)
    db = {r["layer"]: r["psnr_db"] for r in rows}
    assert {r["layer"] for r in rows[:2]} == {"mid_block.attentions.0.to_v", "mid_block.attentions.0.to_out.0"}, db
    assert max(db["mid_block.attentions.0.to_v"], db["mid_block.attentions.0.to_out.0"]) < db["conv_out"] - 6
    assert {r["path"] for r in rows if ".attentions." in r["layer"]} == {"gemm"}
    # w8a8: per-channel weight scales absorb to_v's big row; to_out.0's big input channel still hurts
    rows = sens.measure(model, [z], names=names, mode="w8a8", compute=True)
    db = {r["layer"]: r["psnr_db"] for r in rows}
    assert rows[0]["layer"] == "mid_block.attentions.0.to_out.0" and db["mid_block.attentions.0.to_v"] > 70, db


def test_cumulative_curve_is_close_to_the_sum_of_single_layer_errors(samples_dir):
    from vaeopt.quant import sensitivity as sens

    model, z = _tiny_kl(samples_dir)
    names = ["up_blocks.0.resnets.0.conv1", "up_blocks.1.resnets.2.conv2", "up_blocks.2.upsamplers.0.conv",
             "up_blocks.3.resnets.1.conv2", "mid_block.resnets.1.conv1"]
    rows = sens.measure(model, [z], names=names, compute=False)
    curve = sens.cumulative(model, [z], rows, compute=False)
    assert [c["added"] for c in curve] == [r["layer"] for r in reversed(rows)]  # least sensitive first
    assert curve[0]["psnr_db"] == pytest.approx(rows[-1]["psnr_db"])
    assert all(a["psnr_db"] > b["psnr_db"] - 0.5 for a, b in zip(curve, curve[1:]))  # adding layers costs fidelity
    assert abs(curve[-1]["psnr_db"] - curve[-1]["predicted_psnr_db"]) < 2.0


def test_choose_keep_policy():
    from vaeopt.quant import sensitivity as sens

    def row(n, db):
        return {"layer": n, "mse": 4.0 / 10 ** (db / 10)}

    rows = [row("conv_out", 45), row("a", 48), row("b", 55), row("c", 56), row("d", 57), row("conv_in", 60)]
    kept, pred, why = sens.choose_keep(rows, target_db=50.0)
    assert kept == ["conv_in", "conv_out", "a"] and why["a"] == "dominant" and pred > 50  # 'a' is 69% of the error
    kept, pred, why = sens.choose_keep(rows, target_db=53.0)  # b+c+d predict 51.2 dB, c+d 53.5
    assert kept == ["conv_in", "conv_out", "a", "b"] and why["b"] == "gate" and 53 <= pred < 54
    kept, pred, _ = sens.choose_keep(rows, target_db=50.0, dominant_share=1.0, calib=4.0)  # calibrated: 4x the sum
    assert kept == ["conv_in", "conv_out", "a", "b", "c"] and 50 <= pred < 52
    assert sens.choose_keep(rows, target_db=200.0)[0][-1] == "d"  # unreachable: everything kept


def test_gate_retry_keeps_the_sensitive_layer(samples_dir):
    model, z = _tiny_kl(samples_dir)
    _plant_sensitive_conv(model)
    before = {k: v.clone() for k, v in model.decoder.state_dict().items()}
    r = fp8.apply(model, gate_db=40.0, device=torch.device("cpu"), dtype=torch.float32, compute=False, probe=z)
    first, last = r.data["tries"][0], r.data["tries"][-1]
    assert first["psnr_db"] < 40 and first["kept"] == list(fp8.KEEP)  # conv_in/conv_out alone: under the gate
    assert r.status == "applied" and last["psnr_db"] >= 40 and r.data["psnr_db"] == last["psnr_db"]
    assert PLANTED in r.data["kept_layers"] and r.data["kept_why"][PLANTED] in ("dominant", "gate")
    assert r.data["sensitivity"][0]["layer"] == PLANTED
    assert PLANTED in r.detail and "most sensitive, measured on the probe" in r.detail
    assert f"probe {last['psnr_db']:.1f} dB vs fp32 (gate 40" in r.detail
    assert f"{first['psnr_db']:.1f} dB with {first['fp8_layers']} in e4m3 -> " in r.detail
    mods = dict(model.decoder.named_modules())
    assert not hasattr(mods[PLANTED], "_vaeopt_fp8_hooks") and hasattr(mods["up_blocks.0.resnets.0.conv1"],
                                                                        "_vaeopt_fp8_hooks")
    assert r.data["storage"] == first["fp8_layers"] - (len(r.data["kept_layers"]) - 2)
    fp8.revert(model)
    for k, v in model.decoder.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_gate_without_sensitivity_and_fallback_when_nothing_passes(samples_dir):
    model, z = _tiny_kl(samples_dir)
    _plant_sensitive_conv(model)
    cpu = torch.device("cpu")
    r = fp8.apply(model, gate_db=40.0, device=cpu, dtype=torch.float32, compute=False, probe=z, sensitivity="off")
    assert r.status == "fallback" and len(r.data["tries"]) == 1 and f"probe {r.data['psnr_db']:.1f} dB" in r.detail
    assert "undone" in r.detail and r.data["sensitivity"] is None
    # 120 dB is out of fp8's reach: the policy would keep nearly everything, which is not worth it
    r = fp8.apply(model, gate_db=120.0, device=cpu, dtype=torch.float32, compute=False, probe=z)
    assert r.status == "fallback" and "not worth it" in r.detail and "undone" in r.detail
    assert f"probe {r.data['psnr_db']:.1f} dB vs fp32 < gate 120 dB" in r.detail
    assert not any(hasattr(m, "_vaeopt_fp8_hooks") for m in model.modules())


def test_retry_that_misses_the_gate_falls_back_with_its_numbers(samples_dir, monkeypatch):
    from vaeopt.quant import sensitivity as sens

    model, z = _tiny_kl(samples_dir)
    _plant_sensitive_conv(model)
    real = sens.measure

    def misranked(*a, **k):  # an emulation that got the ranking wrong: the planted layer looks harmless
        rows = real(*a, **k)
        rows[0]["mse"] = 0.0
        return sorted(rows, key=lambda r: -r["mse"])

    monkeypatch.setattr(sens, "measure", misranked)
    # one retry, as many layers kept as the (wrong) calibrated prediction wants: the planted layer stays in e4m3
    r = fp8.apply(model, gate_db=40.0, device=torch.device("cpu"), dtype=torch.float32, compute=False, probe=z,
                  max_rounds=1, max_keep_frac=1.0)
    tries = r.data["tries"]
    assert r.status == "fallback" and len(tries) == 2 and all(t["psnr_db"] < 40 for t in tries)
    assert PLANTED not in r.data["kept_layers"] and len(tries[1]["kept"]) > 2
    assert "still under the gate after 1 retry" in r.detail and "undone" in r.detail
    assert " -> ".join(f"{t['psnr_db']:.1f} dB with {t['fp8_layers']} in e4m3" for t in tries) in r.detail
    assert not any(hasattr(m, "_vaeopt_fp8_hooks") for m in model.modules())


def test_stored_measurements_match_the_bundled_models(samples_dir):
    from vaeopt.quant import sensitivity as sens
    from vaeopt.loading import load_vae

    stored = sens.load_stored()["models"]
    for name in ("tiny_kl_image", "tiny_wan_video"):
        model = load_vae(samples_dir / f"{name}.safetensors").model
        entry = stored[name]
        names = {n for n, _, _ in sens.candidates(model)}
        assert {row[0] for row in entry["stage"]["layers"]} == names
        assert set(entry["keep"]) <= names and entry["keep"][:2] == list(fp8.KEEP)
        for dt in (torch.float32, torch.bfloat16):
            assert sens.stored_keep(model.to(dt)) == (name, entry["keep"][2:]), (name, dt)
    torch.manual_seed(0)
    spec = get_family("sdxl")
    assert sens.stored_keep(build_model(spec, block_out_channels=[32, 32, 64, 64], norm_num_groups=8)) is None


def test_pipeline_logs_kept_layers(samples_dir, monkeypatch):
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import Options, Pipeline

    monkeypatch.setattr(fp8, "available", lambda device, compute=True: (True, ""))  # the stage's logic, minus the GPU
    lines = []
    Pipeline(load_vae(samples_dir / "tiny_kl_image.safetensors"), Options(device="cpu", fp8="on"), log=lines.append)
    line = next(s for s in lines if s.split(":")[0].endswith("fp8"))
    assert "conv_in, conv_out: first/last" in line and "dB vs fp32 (gate 40" in line, line
    # this decoder was measured (configs/fp8_sensitivity.json): its dominant layer is kept from the first try
    assert "up_blocks.3.resnets.0.conv_shortcut: most sensitive in the stored measurement of tiny_kl_image" in line
