"""The attention stage (vaeopt/stages/attention.py): which SDPA backends take the model's real head dim here, a
decoder's attention processors switched to SDPA with the decode unchanged, and torch's per-backend warnings kept out
of the user's console."""

import warnings

import pytest
import torch

from vaeopt.families import build_model, get_family
from vaeopt.stages import attention

TINY_KL = dict(block_out_channels=[32, 32], norm_num_groups=8, layers_per_block=1,
               down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)


def test_switches_other_processors_to_sdpa_and_decodes_the_same():
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    vae = build_model(get_family("sdxl"), **TINY_KL)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    vae.set_attn_processor(AttnProcessor())  # the eager attention, as some scripts leave it (encoder and decoder)
    with torch.no_grad():
        ref = vae.decode(z).sample
    r = attention.apply(vae, torch.device("cpu"))
    assert r.status == "applied" and r.data["switched"] == 1 and r.data["head_dims"] == [32]
    assert "switched 1 attention processors to SDPA" in r.line()
    assert "math" in r.data["backends"][32]
    procs = vae.attn_processors
    assert all(isinstance(p, AttnProcessor2_0) for k, p in procs.items() if k.startswith("decoder."))
    assert all(type(p) is AttnProcessor for k, p in procs.items() if k.startswith("encoder."))  # not the stage's
    with torch.no_grad():
        assert torch.allclose(vae.decode(z).sample, ref, atol=1e-5)
    again = attention.apply(vae, torch.device("cpu"))  # already SDPA: nothing to do, said so
    assert again.status == "skipped" and "nothing to change" in again.line()


def test_probe_keeps_torchs_backend_warnings_out_of_the_console(monkeypatch):
    """On a GPU, a head dim over 256 makes torch warn once per backend it cannot use (six UserWarnings in the
    decode log). The probe reports those backends itself, so it swallows the warnings and still tells which work."""
    def sdpa(q, k, v):
        warnings.warn("Flash attention requires head_dim <= 256", UserWarning)
        if torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled():
            raise RuntimeError("No available kernel")
        return q

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = attention._probe(384, torch.device("cpu"), torch.float32)
    assert caught == []
    assert "flash" not in ok and "math" in ok


TINY_HY = dict(block_out_channels=[16, 16, 32, 32], norm_num_groups=8, layers_per_block=1)


def test_hunyuan_mid_block_is_frame_causal_without_the_mask(monkeypatch):
    """HunyuanVideo's mid-block attention: diffusers builds a (frames*h*w)^2 additive mask (19.3 GiB for 16 latent
    frames of 60x106 in bf16). The stage computes the same frame-causal attention over key prefixes: the decode is
    the stock one, the mask is never built, and revert restores diffusers. (Causality: the test below.)"""
    from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hy

    torch.manual_seed(0)
    vae = build_model(get_family("hunyuanvideo"), **TINY_HY).eval()
    z = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = vae.decode(z).sample
    r = attention.apply(vae, torch.device("cpu"))
    assert r.status == "applied" and r.data["frame_causal"] == 1, r.line()
    assert "frame-causal attention" in r.line() and "mask" in r.line() and "SDPA uses" not in r.line()

    def no_mask(*a, **k):
        raise AssertionError("the (T*H*W)^2 mask was built")

    monkeypatch.setattr(hy, "prepare_causal_attention_mask", no_mask)
    with torch.no_grad():
        out = vae.decode(z).sample
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert attention.apply(vae, torch.device("cpu")).data["frame_causal"] == 1  # a second apply patches nothing twice
    attention.revert(vae)
    monkeypatch.undo()
    with torch.no_grad():
        torch.testing.assert_close(vae.decode(z).sample, ref, atol=0, rtol=0)


def test_frame_causal_attention_equals_the_masked_one():
    """The attention step alone against diffusers' processor with prepare_causal_attention_mask, with a norm-free
    attention so that causality shows exactly: editing frame 2 leaves frames 0 and 1 bitwise unchanged."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import prepare_causal_attention_mask

    torch.manual_seed(0)
    attn = Attention(32, heads=1, dim_head=32, residual_connection=True, bias=True, upcast_softmax=True,
                     _from_deprecated_attn_block=True).eval()
    x = torch.randn(2, 32, 4, 3, 5)
    B, _, T, H, W = x.shape
    with torch.no_grad():
        tok = x.permute(0, 2, 3, 4, 1).flatten(1, 3)
        mask = prepare_causal_attention_mask(T, H * W, tok.dtype, tok.device, batch_size=B)
        ref = attn(tok, attention_mask=mask).unflatten(1, (T, H, W)).permute(0, 4, 1, 2, 3)
        out = attention.frame_causal_attention(attn, x)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        x2 = x.clone()
        x2[:, :, 2:] = torch.randn_like(x2[:, :, 2:])
        out2 = attention.frame_causal_attention(attn, x2)
    assert torch.equal(out2[:, :, :2], out[:, :, :2])
    assert not torch.equal(out2[:, :, 2:], out[:, :, 2:])


@pytest.mark.gpu
def test_frame_causal_attention_on_the_gpu_matches_the_masked_one():
    """bf16 on CUDA with HunyuanVideo's real head dim (512): the prefix attention runs the Triton softmax of
    chunked_attention; against diffusers' masked SDPA, both compared to an fp32 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from diffusers.models.attention_processor import Attention
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import prepare_causal_attention_mask

    torch.manual_seed(0)
    attn = Attention(512, heads=1, dim_head=512, eps=1e-6, norm_num_groups=32, residual_connection=True, bias=True,
                     upcast_softmax=True, _from_deprecated_attn_block=True).cuda().eval()
    x = torch.randn(1, 512, 5, 12, 20, device="cuda")
    B, _, T, H, W = x.shape

    def masked(a, x):
        tok = x.permute(0, 2, 3, 4, 1).flatten(1, 3)
        mask = prepare_causal_attention_mask(T, H * W, tok.dtype, tok.device, batch_size=B)
        return a(tok, attention_mask=mask).unflatten(1, (T, H, W)).permute(0, 4, 1, 2, 3)

    with torch.no_grad():
        ref = masked(attn, x)
        attn16 = attn.to(torch.bfloat16)
        stock = masked(attn16, x.bfloat16()).float()
        ours = attention.frame_causal_attention(attn16, x.bfloat16()).float()
    err_stock = (stock - ref).abs().max().item()
    err_ours = (ours - ref).abs().max().item()
    assert err_ours <= max(2 * err_stock, 0.05), (err_ours, err_stock)


def test_a_processor_the_user_set_is_kept():
    """optimize replaced a user's own processor (and the encoder's) with AttnProcessor2_0, silently with log=None."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    class Halved(AttnProcessor2_0):
        def __call__(self, *a, **k):
            return super().__call__(*a, **k) * 0.5

    vae = build_model(get_family("sdxl"), **TINY_KL)
    vae.set_attn_processor(Halved())
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = vae.decode(z).sample
    r = attention.apply(vae, torch.device("cpu"))
    assert r.data["switched"] == 0 and "kept the processor set on mid_block.attentions.0 (Halved)" in r.line()
    assert all(type(p) is Halved for p in vae.attn_processors.values())
    with torch.no_grad():
        assert torch.equal(vae.decode(z).sample, ref)
