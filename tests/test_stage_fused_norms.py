"""Stage fused_norms on small real diffusers decoders: decode equals stock, counts are what ran, revert restores.

CPU: fp32 through the Triton interpreter. "cuda" (pytest -m gpu): fp32 and bf16, bf16 judged against stock bf16's
own error vs fp32.
"""

import importlib

import pytest
import torch
from torch import nn

from vaeopt.families import build_model, get_family
from vaeopt.kernels import triton_available
from vaeopt.stages import fused_norms

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _need(device):
    ok, why = triton_available(device)
    if not ok:
        pytest.skip(why)


def _spy(monkeypatch, module_name, fn_name):
    """Count real kernel launches: wrap the launcher the fused modules import at call time."""
    mod = importlib.import_module(module_name)
    calls = []
    real = getattr(mod, fn_name)

    def wrapper(*a, **k):
        calls.append(tuple(a[0].shape))
        return real(*a, **k)

    monkeypatch.setattr(mod, fn_name, wrapper)
    return calls


def _decode(model, z):
    with torch.no_grad():
        return model.decode(z).sample.float()


def _types(module):
    return [type(m) for m in module.modules()]


def _check_decode(model, z, device, swapped_check):
    """Stock decode vs stage decode (fp32; on CUDA also bf16). Returns (StageResult, kernel-call shapes)."""
    model = model.to(device)
    z = z.to(device)
    # fp32 comparison must not go through TF32 convs (cuDNN's default on Ampere+), which round differently per call
    torch.backends.cudnn.allow_tf32 = False
    ref = _decode(model, z)
    result = fused_norms.apply(model)
    assert result.status == "applied", result.detail
    swapped_check(model, result)
    out = _decode(model, z)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    if device == "cuda":  # bf16: fused error vs fp32 within 2x stock bf16's own + floor
        fused16 = _decode(model.to(torch.bfloat16), z.to(torch.bfloat16))
        fused_norms.revert(model)
        stock16 = _decode(model, z.to(torch.bfloat16))
        err, err_stock = (fused16 - ref).abs().max().item(), (stock16 - ref).abs().max().item()
        assert err <= 2 * err_stock + 2e-2, (err, err_stock)
        model.float()
        fused_norms.apply(model)
    torch.backends.cudnn.allow_tf32 = True
    return result


@pytest.fixture(scope="module")
def small_kl():
    """A small SDXL-config AutoencoderKL (random weights); tests that patch it revert before returning."""
    torch.manual_seed(0)
    return build_model(get_family("sdxl"), block_out_channels=[32, 32, 64, 64], norm_num_groups=8)


@pytest.mark.parametrize("device", DEVICES)
def test_autoencoder_kl(device, monkeypatch, small_kl):
    _need(device)
    model = small_kl
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    dec = model.decoder
    originals = {name: m for name, m in dec.named_modules() if isinstance(m, (nn.GroupNorm, nn.SiLU))}
    n_resnets = sum(isinstance(m, ResnetBlock2D) for m in dec.modules())
    n_attn = sum(isinstance(m, Attention) and m.group_norm is not None for m in dec.modules())
    enc_types, keys = _types(model.encoder), list(model.state_dict())
    calls = _spy(monkeypatch, "vaeopt.kernels.group_norm_silu", "group_norm_silu")

    def swapped(model, result):
        # every GroupNorm/SiLU in the decoder is gone, each resnet's pair fused, plus the output head
        assert not any(isinstance(m, (nn.GroupNorm, nn.SiLU)) for m in model.decoder.modules())
        fused = [m for m in model.decoder.modules() if isinstance(m, fused_norms.FusedGroupNormSiLU)]
        assert result.data["gn_silu"] == 2 * n_resnets + 1 == sum(m.silu for m in fused)
        assert result.data["gn"] == n_attn == sum(not m.silu for m in fused) == 1
        assert result.detail == f"fused {2 * n_resnets + 1} GroupNorm+SiLU pairs, 1 GroupNorm (attention)"
        assert _types(model.encoder) == enc_types, "the encoder must be left alone"
        assert list(model.state_dict()) == keys, "same parameters under the same names"

    z = torch.randn(1, 4, 8, 8)
    result = _check_decode(model, z, device, swapped)
    assert len(calls) >= result.data["gn_silu"] + result.data["gn"]  # every fused module ran the kernel
    assert fused_norms.apply(model).status == "skipped"  # applying twice is refused

    fused_norms.revert(model)
    now = {name: m for name, m in model.decoder.named_modules() if isinstance(m, (nn.GroupNorm, nn.SiLU))}
    assert now.keys() == originals.keys() and all(now[k] is originals[k] for k in now)
    assert not any(isinstance(m, (fused_norms.FusedGroupNormSiLU, nn.Identity)) for m in model.decoder.modules())
    model.cpu()


def test_fallback_and_skip_without_triton_backend(monkeypatch, small_kl):
    """CPU without the interpreter: apply() skips with the reason, and fused modules fall back to the torch ops."""
    model = small_kl.cpu().float()
    z = torch.randn(1, 4, 4, 4)
    ref = _decode(model, z)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    result = fused_norms.apply(model, device="cpu")
    assert result.status == "skipped" and "CPU" in result.detail and fused_norms.available("cpu")[0] is False
    assert not any(isinstance(m, fused_norms.FusedGroupNormSiLU) for m in model.modules())
    # patched while the interpreter counted as a backend, then run without it: torch fallback, no kernel launch
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_norms.apply(model, device="cpu").status == "applied"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = _spy(monkeypatch, "vaeopt.kernels.group_norm_silu", "group_norm_silu")
    torch.testing.assert_close(_decode(model, z), ref, atol=1e-6, rtol=1e-6)
    assert calls == []
    fused_norms.revert(model)


@pytest.mark.parametrize("device", DEVICES)
def test_wan(device, monkeypatch):
    _need(device)
    torch.manual_seed(0)
    model = build_model(get_family("wan21"), base_dim=8)
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanRMS_norm, WanResidualBlock

    dec = model.decoder
    n_res = sum(isinstance(m, WanResidualBlock) for m in dec.modules())
    n_attn = sum(isinstance(m, WanAttentionBlock) for m in dec.modules())
    enc_types = _types(model.encoder)
    calls = _spy(monkeypatch, "vaeopt.kernels.rms_norm_silu", "rms_norm_silu")

    def swapped(model, result):
        assert not any(isinstance(m, (WanRMS_norm, nn.SiLU)) for m in model.decoder.modules())
        assert result.data["rms_silu"] == 2 * n_res + 1  # two per residual block + the head
        assert result.data["rms"] == n_attn == 1
        assert result.detail == f"fused {2 * n_res + 1} RMSNorm+SiLU pairs, 1 RMSNorm (attention)"
        assert _types(model.encoder) == enc_types

    # 2 latent frames: the first chunk and one that runs through the causal caches (which store post-SiLU x)
    z = torch.randn(1, 16, 2, 4, 6)
    result = _check_decode(model, z, device, swapped)
    per_chunk = result.data["rms_silu"] + result.data["rms"]
    assert len(calls) >= 2 * per_chunk  # every fused norm ran the kernel in each chunk
    fused_norms.revert(model)
    assert not any(isinstance(m, fused_norms.FusedRMSNormSiLU) for m in model.decoder.modules())
    assert sum(isinstance(m, WanRMS_norm) for m in model.decoder.modules()) == per_chunk


@pytest.mark.slow
def test_hunyuan_video():
    _need("cpu")
    torch.manual_seed(0)
    model = build_model(get_family("hunyuanvideo"), block_out_channels=[16, 16, 32, 32], norm_num_groups=8)
    z = torch.randn(1, 16, 2, 4, 4)
    ref = _decode(model, z)
    result = fused_norms.apply(model)
    assert result.data["gn_silu"] == 29 and result.data["gn"] == 1, result.detail
    assert not any(isinstance(m, (nn.GroupNorm, nn.SiLU)) for m in model.decoder.modules())
    torch.testing.assert_close(_decode(model, z), ref, atol=2e-4, rtol=1e-4)
    fused_norms.revert(model)


def test_hooked_modules_stay_unfused_and_their_hooks_fire(monkeypatch):
    """A user's hooks (forward, pre-forward, or a per-instance forward as accelerate / diffusers' offloading and
    casting install) on norm / SiLU modules: those pairs stay as they are, every hook fires as often as on the stock
    model with the same tensors, the rest is fused, the decode is unchanged, and the stage line names the modules."""
    _need("cpu")
    torch.manual_seed(0)
    model = build_model(get_family("sdxl"), block_out_channels=[32, 32, 64, 64], norm_num_groups=8).eval()
    dec = model.decoder
    seen = {"fwd": [], "pre": [], "inst": []}
    norm1 = dec.up_blocks[0].resnets[0].norm1
    norm1.register_forward_hook(lambda m, i, o: seen["fwd"].append(o.detach().clone()))
    dec.conv_act.register_forward_pre_hook(lambda m, i: seen["pre"].append(i[0].shape))
    wrapped = dec.up_blocks[1].resnets[1].nonlinearity
    stock = wrapped.forward

    def instance_forward(x):  # what accelerate's add_hook_to_module does: module.forward replaced per instance
        seen["inst"].append(x.shape)
        return stock(x)

    wrapped.forward = instance_forward
    z = torch.randn(1, 4, 8, 8)
    ref = _decode(model, z)
    stock_counts = {k: len(v) for k, v in seen.items()}
    ref_norm1 = seen["fwd"][0]
    assert all(stock_counts.values()), stock_counts
    for v in seen.values():
        v.clear()

    result = fused_norms.apply(model)
    assert result.status == "applied"
    hooked = result.data["hooked"]
    assert hooked == ["decoder.conv_act", "decoder.up_blocks.0.resnets.0.norm1",
                      "decoder.up_blocks.1.resnets.1.nonlinearity"], hooked
    assert "left unfused where modules carry hooks" in result.detail and "decoder.up_blocks.0.resnets.0.norm1" in result.detail
    assert type(dec.up_blocks[0].resnets[0].norm1) is nn.GroupNorm and type(dec.conv_norm_out) is nn.GroupNorm
    assert type(dec.up_blocks[0].resnets[1].norm1) is fused_norms.FusedGroupNormSiLU  # the others still fuse
    out = _decode(model, z)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    assert {k: len(v) for k, v in seen.items()} == stock_counts
    torch.testing.assert_close(seen["fwd"][0], ref_norm1, atol=1e-5, rtol=1e-5)
    fused_norms.revert(model)
