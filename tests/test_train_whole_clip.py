"""The sample trainer (scripts/train_sample_vaes.py) trains the Wan video VAE on whole clips in one call per module;
the weights it ships are decoded by diffusers' frame-by-frame cached loop and by vaeopt. The whole-clip forward must
be the same function as the cached loop, or the trained model would decode differently from how it was trained."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_sample_vaes.py"


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location("train_sample_vaes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _tiny_cfg(trainer):
    # the shipped layout (three levels of 2x downsampling, two of them also in time) at widths a CPU runs in
    # milliseconds; a decoder wider than the encoder, as the sample's is
    return dict(trainer.VIDEO_CONFIG, base_dim=4, decoder_base_dim=8, z_dim=4)


@pytest.fixture(scope="module")
def tiny_wan(trainer):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**_tiny_cfg(trainer)).eval()
    with torch.no_grad():  # larger biases than the default init, so a frame mixed up in time would show
        for m in vae.modules():
            if isinstance(getattr(m, "bias", None), torch.nn.Parameter):
                m.bias.normal_(0, 0.2)
        vae.decoder.conv_out.weight.mul_(20)  # outputs past [-1, 1], where the clamp of diffusers' decode acts
    return trainer.whole_clip(vae)


# frames: a single frame (no temporal resampling runs), one latent step, and the shipped clips' 17 (five latent
# frames: the cache carries state across four chunk boundaries); 24x40 is not square and not a power of two
@pytest.mark.parametrize("frames", [1, 5, 17])
def test_whole_clip_encode_equals_diffusers_encode(trainer, tiny_wan, frames):
    torch.manual_seed(frames)
    x = torch.rand(2, 3, frames, 24, 40) * 2 - 1
    with torch.no_grad():
        ref = tiny_wan.encode(x).latent_dist
        got = trainer.wan_encode_whole(tiny_wan, x)
    assert got.mean.shape == ref.mean.shape == (2, 4, 1 + (frames - 1) // 4, 3, 5)
    torch.testing.assert_close(got.mean, ref.mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logvar, ref.logvar, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("latent_frames", [1, 2, 5])
def test_whole_clip_decode_equals_diffusers_decode(trainer, tiny_wan, latent_frames):
    torch.manual_seed(latent_frames)
    z = torch.randn(2, 4, latent_frames, 3, 5)
    with torch.no_grad():
        ref = tiny_wan.decode(z).sample  # diffusers' cached loop, clamped to [-1, 1]
        loop = trainer.wan_decode_unclamped(tiny_wan, z)  # the same loop, unclamped
        got = trainer.wan_decode_whole(tiny_wan, z)
    assert got.shape == ref.shape == (2, 3, 1 + 4 * (latent_frames - 1), 24, 40)
    assert got.abs().max() > 1  # the unclamped decode is what trains: the comparison below must see the clamp
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.clamp(-1, 1), ref, atol=1e-5, rtol=1e-5)


def test_whole_clip_trains_the_same_function_as_the_loop(trainer, tiny_wan):
    """The gradients agree too: a step on whole clips is a step on the function the cached loop computes."""
    torch.manual_seed(3)
    z = torch.randn(1, 4, 3, 3, 5)
    grads = []
    for fwd in (trainer.wan_decode_whole, trainer.wan_decode_unclamped):
        tiny_wan.zero_grad(set_to_none=True)
        fwd(tiny_wan, z).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in tiny_wan.decoder.named_parameters() if p.grad is not None})
    tiny_wan.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and any("time_conv" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4, msg=n)


def test_saved_sample_decodes_the_same_through_vaeopt(trainer, tiny_wan, tmp_path):
    """The trainer's file (fp16 weights, config with a decoder wider than the encoder in its metadata) is read by
    vaeopt as the model it trained: vaeopt's decode equals diffusers' decode of the same fp16 weights."""
    import vaeopt
    from diffusers import AutoencoderKLWan

    cfg = _tiny_cfg(trainer)
    path = tmp_path / "tiny_wan.safetensors"
    sd = trainer.save_weights(tiny_wan, cfg, path)
    ref_vae = AutoencoderKLWan(**cfg).eval()
    ref_vae.load_state_dict({k: v.float() for k, v in sd.items()})
    torch.manual_seed(4)
    z = torch.randn(1, 4, 3, 3, 5)
    with torch.no_grad():
        ref = ref_vae.decode(z).sample
    out = vaeopt.decode(z, path, latent_space="raw")
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=0)
