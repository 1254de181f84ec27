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
    z = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["bikes"][:, :, :2, :16, :16].float()
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


@pytest.mark.gpu
def test_scaled_mm_linear_on_gpu():
    lin = torch.nn.Linear(512, 512).cuda().bfloat16()
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    ref = lin(x)
    y = fp8.FP8GemmLinear(lin)(x)
    assert psnr(y.float() / ref.abs().max(), ref.float() / ref.abs().max(), data_range=2) > 25
