"""The attention stage (vaeopt/stages/attention.py): which SDPA backends take the model's real head dim here, a
decoder's attention processors switched to SDPA with the decode unchanged, and torch's per-backend warnings kept out
of the user's console."""

import warnings

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
    assert r.status == "applied" and r.data["switched"] == 2 and r.data["head_dims"] == [32]
    assert "switched 2 attention processors to SDPA" in r.line()
    assert "math" in r.data["backends"][32]
    assert all(isinstance(p, AttnProcessor2_0) for p in vae.attn_processors.values())
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
