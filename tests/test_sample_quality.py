"""The bundled samples look right: the sample image VAE (samples/tiny_kl_image.safetensors) decodes its held-out
astronaut latents to the photo (samples/astronaut.png) at >= 22 dB with every channel mean within 6/255 -- no colour
cast -- and the sample video VAE decodes its held-out clips close to their frames (samples/*_frames.mp4, lossless).

The latents are the encoders' output for photos and clips the VAEs never saw in training
(scripts/train_sample_vaes.py holds both out). Decodes go through vaeopt.decode, as `vaeopt decode` runs them."""

import numpy as np
import pytest
import torch
from PIL import Image

import vaeopt


def _to_uint8(x: torch.Tensor) -> np.ndarray:
    """(3, ...) in [-1, 1] -> (..., 3) uint8, the way vaeopt writes PNG/MP4 pixels."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(0, -1).numpy()


def _measure(dec: np.ndarray, ref: np.ndarray) -> tuple[float, np.ndarray]:
    d = dec.astype(np.float64) - ref.astype(np.float64)
    return 10 * np.log10(255**2 / (d**2).mean()), d.reshape(-1, 3).mean(0)


@pytest.mark.parametrize("name", ["tiny_kl_image.safetensors", "tiny_wan_video.safetensors"])
def test_sample_weights_stay_small(samples_dir, name):
    """The samples ship inside the package: each VAE file stays within 12 MB (fp16 weights, ~6M parameters)."""
    assert (samples_dir / name).stat().st_size <= 12_000_000


def test_image_sample_decodes_the_astronaut_without_a_colour_cast(samples_dir):
    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"]
    out = vaeopt.decode(z, samples_dir / "tiny_kl_image.safetensors", latent_space="scaled")
    ref = np.asarray(Image.open(samples_dir / "astronaut.png").convert("RGB"))
    dec = _to_uint8(out[0])
    assert dec.shape == ref.shape == (512, 512, 3)
    db, mean_err = _measure(dec, ref)
    # measured 23.62 dB, channel means off by (+2.06, -0.59, +1.76)/255
    assert db >= 22.0, db
    assert np.abs(mean_err).max() <= 6.0, mean_err


@pytest.fixture(scope="module")
def video_decodes(samples_dir):
    import av

    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)
    res = {}
    for name in ("astronaut_pan", "coffee_zoom"):
        with av.open(str(samples_dir / f"{name}_frames.mp4")) as c:
            ref = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
        out = vaeopt.decode(lat[name], samples_dir / "tiny_wan_video.safetensors", latent_space="raw")
        res[name] = (_to_uint8(out[0]), ref)
    return res


# (min PSNR dB, max |channel mean error| /255), re-derived from the shipped weights: astronaut_pan measured 17.39 dB
# with (-5.46, +0.68, +5.23); coffee_zoom 21.41 dB with (-5.73, -1.43, +8.61); floors 0.7 dB under and 1.2/255 over.
# The 22 dB / 6/255 goal of the image sample is not reached yet by the video sample: see the xfail below.
VIDEO_FLOORS = {"astronaut_pan": (16.6, 6.7), "coffee_zoom": (20.7, 9.9)}


@pytest.mark.parametrize("name", list(VIDEO_FLOORS))
def test_video_sample_decodes_its_held_out_frames(video_decodes, name):
    dec, ref = video_decodes[name]
    assert dec.shape == ref.shape == (17, 256, 384, 3)
    db, mean_err = _measure(dec, ref)
    floor_db, max_cast = VIDEO_FLOORS[name]
    assert db >= floor_db, (name, db)
    assert np.abs(mean_err).max() <= max_cast, (name, mean_err)


@pytest.mark.xfail(strict=True, reason="the sample video VAE needs a longer GPU run of "
                                       "scripts/train_video_sample.sh to reach the image sample's 22 dB / 6/255")
def test_video_sample_reaches_the_image_samples_bar(video_decodes):
    for name, (dec, ref) in video_decodes.items():
        db, mean_err = _measure(dec, ref)
        assert db >= 22.0 and np.abs(mean_err).max() <= 6.0, (name, db, mean_err)


def test_user_guide_names_the_image_samples_own_scaling(samples_dir):
    """docs/user-guide.md quotes the bundled image VAE's scaling factor, which its checkpoint's config overrides the
    family's with: the number a user scales pipeline latents by for this sample, so it must be the file's."""
    import json
    import re
    from pathlib import Path

    from safetensors import safe_open

    with safe_open(str(samples_dir / "tiny_kl_image.safetensors"), "pt") as f:
        factor = json.loads(f.metadata()["config"])["scaling_factor"]
    guide = " ".join((Path(__file__).resolve().parent.parent / "docs" / "user-guide.md").read_text().split())
    assert re.search(rf"bundled sample image VAE has its own, {factor}\b", guide), factor

