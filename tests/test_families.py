"""FLUX.2, Qwen-Image, HunyuanVideo 1.5 and LTX-2: every layout loads as the right family with the right weights, the
latent conventions match the pipelines' arithmetic, and the plain decode equals diffusers' own `vae.decode`."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import vaeopt
from vaeopt import latents as lat
from vaeopt.families import build_model, get_family
from vaeopt.loading import load_vae

NEW = ("flux2", "qwenimage", "hunyuanvideo15", "ltx2")
CPU32 = vaeopt.Options(device="cpu", dtype="fp32")


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------------------------------
# tiny models of the real diffusers classes, with every tensor distinct
# ----------------------------------------------------------------------------------------------------------------------


def _jitter(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval().requires_grad_(False)


def tiny(fam: str):
    import diffusers

    torch.manual_seed(sum(map(ord, fam)))
    if fam == "flux2":
        m = diffusers.AutoencoderKLFlux2(block_out_channels=(32, 32, 64, 64), norm_num_groups=8, layers_per_block=1)
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2.0)
    elif fam == "qwenimage":
        m = diffusers.AutoencoderKLQwenImage(base_dim=8)
    elif fam == "hunyuanvideo15":
        m = build_model(get_family(fam), block_out_channels=[16, 32, 32, 32, 32], layers_per_block=1)
    else:
        m = build_model(get_family(fam), block_out_channels=[16, 32, 32, 32], decoder_block_out_channels=[16, 32, 64],
                        layers_per_block=[1, 1, 1, 1, 1], decoder_layers_per_block=[1, 1, 1, 1])
        m.latents_mean.normal_()
        m.latents_std.uniform_(0.5, 2.0)
    return _jitter(m)


@pytest.fixture(scope="module")
def models():
    return {f: tiny(f) for f in NEW}


def raw_latent(fam: str, n: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    c = get_family(fam).latent_channels
    if fam == "flux2":
        return torch.randn(n, c, 6, 4, generator=g)
    if fam == "qwenimage":
        return torch.randn(n, c, 1, 6, 4, generator=g)
    return torch.randn(n, c, 2, 3, 2, generator=g)


def reference(model, z):
    with torch.no_grad():
        out = model.decode(z).sample
    return out.clamp(-1, 1)


def psnr(a, b) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(4 / mse)


# ----------------------------------------------------------------------------------------------------------------------
# original layouts (inverses of diffusers' converters)
# ----------------------------------------------------------------------------------------------------------------------


def flux2_original(sd: dict) -> dict:
    """AutoencoderKLFlux2 keys -> BFL's ae.safetensors keys: LDM names, with the quant convs inside the encoder and
    decoder and the BatchNorm stats at the top (inverse of scripts/convert_flux2_to_diffusers.py)."""
    from test_loading import to_ldm

    ldm = to_ldm({k: v for k, v in sd.items() if not k.startswith("bn.")})
    out = {}
    for k, v in ldm.items():
        k = re.sub(r"^quant_conv\.", "encoder.quant_conv.", k)
        out[re.sub(r"^post_quant_conv\.", "decoder.post_quant_conv.", k)] = v
    out.update({k: v.clone() for k, v in sd.items() if k.startswith("bn.")})
    return out


def hy15_original(sd: dict) -> dict:
    """AutoencoderKLHunyuanVideo15 keys -> Tencent's (inverse of convert_hunyuan_video_15_vae_checkpoint_to_diffusers
    in diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py)."""
    out = {}
    for k, v in sd.items():
        k = re.sub(r"^(encoder|decoder)\.(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.", r"\1.\2.\3.block.\4.", k)
        k = re.sub(r"^(encoder|decoder)\.(down|up)_blocks\.(\d+)\.(down|up)samplers\.0\.", r"\1.\2.\3.\4sample.", k)
        k = re.sub(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.", lambda m: f"{m[1]}.mid.block_{int(m[2]) + 1}.", k)
        k = re.sub(r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_(q|k|v)\.", r"\1.mid.attn_1.\2.", k)
        k = re.sub(r"^(encoder|decoder)\.mid_block\.attentions\.0\.", r"\1.mid.attn_1.", k)
        out[k] = v.clone()
    return out


def ltx2_original(sd: dict, prefix: str = "") -> dict:
    """AutoencoderKLLTX2Video keys -> Lightricks' LTX-2 keys (inverse of diffusers' convert_ltx2_vae_to_diffusers:
    the decoder's mid block is up_blocks.0, each up block's upsampler and resnets are separate blocks 2i+1 and 2i+2;
    the encoder's likewise, its mid block down_blocks.8; per-channel statistics under per_channel_statistics.)."""
    stats = {"latents_mean": "per_channel_statistics.mean-of-means",
             "latents_std": "per_channel_statistics.std-of-means"}
    out = {}
    for k, v in sd.items():
        if k in stats:
            k = stats[k]
        elif m := re.match(r"^decoder\.mid_block\.(.+)$", k):
            k = f"decoder.up_blocks.0.{m[1]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", k):
            k = f"decoder.up_blocks.{2 * int(m[1]) + 1}.{m[2]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.(.+)$", k):
            k = f"decoder.up_blocks.{2 * int(m[1]) + 2}.{m[2]}"
        elif m := re.match(r"^encoder\.mid_block\.(.+)$", k):
            k = f"encoder.down_blocks.8.{m[1]}"
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.+)$", k):
            k = f"encoder.down_blocks.{2 * int(m[1]) + 1}.{m[2]}"
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", k):
            k = f"encoder.down_blocks.{2 * int(m[1])}.{m[2]}"
        out[prefix + k.replace(".resnets.", ".res_blocks.")] = v.clone()
    c = sd["latents_mean"].numel()
    out[prefix + "per_channel_statistics.channel"] = torch.arange(c, dtype=torch.float32)
    out[prefix + "per_channel_statistics.mean-of-stds"] = torch.ones(c)
    return out


def _save(path: Path, sd: dict, metadata: dict | None = None) -> Path:
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


def check_weights(loaded, model, fam):
    """Every decoder tensor of the loaded model equals the reference's (FLUX.2: the BatchNorm stats are in the family
    config instead, LTX-2's also)."""
    got = loaded.model.state_dict()
    ref = model.state_dict()
    dec = [k for k in ref if k.startswith(("decoder.", "post_quant_conv."))]
    assert dec and all(torch.equal(got[k], ref[k]) for k in dec)
    if fam == "flux2":
        assert loaded.family.config["_bn"]["mean"] == ref["bn.running_mean"].tolist()
        assert loaded.family.config["_bn"]["var"] == ref["bn.running_var"].tolist()
    if fam == "ltx2":
        assert loaded.family.config["latents_mean"] == ref["latents_mean"].tolist()
        assert torch.equal(got["latents_std"], ref["latents_std"])


# ----------------------------------------------------------------------------------------------------------------------
# 1. loading
# ----------------------------------------------------------------------------------------------------------------------

CLASSES = {"flux2": "AutoencoderKL", "qwenimage": "AutoencoderKLWan",
           "hunyuanvideo15": "AutoencoderKLHunyuanVideo15", "ltx2": "AutoencoderKLLTX2Video"}


@pytest.mark.parametrize("fam", NEW)
def test_diffusers_folder_and_its_weights_file(fam, models, tmp_path):
    model = models[fam]
    model.save_pretrained(tmp_path / "vae")
    for path in (tmp_path / "vae", tmp_path / "vae" / "diffusion_pytorch_model.safetensors"):
        r = load_vae(path)
        assert r.family.name == fam and type(r.model).__name__ == CLASSES[fam], r.notes
        assert not any("config ignored" in n or "matches no known family" in n for n in r.notes), r.notes
        check_weights(r, model, fam)
    # the family is named as users know it
    assert r.family.title == {"flux2": "FLUX.2", "qwenimage": "Qwen-Image", "hunyuanvideo15": "HunyuanVideo 1.5",
                              "ltx2": "LTX-2"}[fam]


def test_flux2_original_ae_and_comfyui_prefix(models, tmp_path):
    model = models["flux2"]
    orig = flux2_original(model.state_dict())
    r = load_vae(_save(tmp_path / "ae.safetensors", orig))
    assert (r.family.name, r.layout) == ("flux2", "ldm"), r.notes
    assert any("original FLUX.2 layout" in n for n in r.notes)
    check_weights(r, model, "flux2")
    # widths from shapes: the tiny widths, not the family's 128..512
    assert r.family.config["block_out_channels"] == [32, 32, 64, 64]
    # ComfyUI / full checkpoints: the VAE under vae. / first_stage_model.
    r = load_vae(_save(tmp_path / "flux2_full.safetensors", {f"vae.{k}": v for k, v in orig.items()}))
    assert r.family.name == "flux2"
    check_weights(r, model, "flux2")


def test_qwenimage_original_single_file_named_by_file(models, tmp_path):
    from test_loading import to_wan_original

    model = models["qwenimage"]
    orig = to_wan_original(model.state_dict())
    r = load_vae(_save(tmp_path / "qwen_image_vae.safetensors", orig))
    assert (r.family.name, r.layout) == ("qwenimage", "wan-original"), r.notes
    assert r.family.title == "Qwen-Image"
    check_weights(r, model, "qwenimage")
    # the same weights under another name are Wan 2.1's (nothing tells them apart), and --family says otherwise
    assert load_vae(_save(tmp_path / "vae.safetensors", orig)).family.name == "wan21"
    assert load_vae(tmp_path / "vae.safetensors", family="qwen-image").family.name == "qwenimage"


def test_hunyuanvideo15_original_layout(models, tmp_path):
    model = models["hunyuanvideo15"]
    orig = hy15_original(model.state_dict())
    assert "decoder.mid.block_1.norm1.gamma" in orig and "decoder.up.0.block.0.conv1.conv.weight" in orig
    r = load_vae(_save(tmp_path / "hunyuanvideo15_vae.safetensors", orig))
    assert (r.family.name, r.layout) == ("hunyuanvideo15", "hunyuanvideo15-original"), r.notes
    assert r.family.config["block_out_channels"] == [16, 32, 32, 32, 32]
    check_weights(r, model, "hunyuanvideo15")
    for k, v in model.state_dict().items():  # encoder too
        assert torch.equal(r.model.state_dict()[k], v), k


@pytest.mark.parametrize("prefix", ["", "vae."])
def test_ltx2_original_layout(prefix, models, tmp_path):
    from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers

    model = models["ltx2"]
    orig = ltx2_original(model.state_dict(), prefix)
    # the inverse is right: diffusers' own converter maps it back
    back = convert_ltx2_vae_to_diffusers(dict(orig))
    assert set(back) == set(model.state_dict())
    if prefix:  # a full LTX-2 checkpoint: the transformer and audio VAE beside it are ignored
        orig["model.diffusion_model.proj_out.weight"] = torch.zeros(2, 2)
        orig["audio_vae.per_channel_statistics.mean-of-means"] = torch.zeros(8)
    r = load_vae(_save(tmp_path / "ltx-2-vae.safetensors", orig))
    assert (r.family.name, r.layout) == ("ltx2", "ltx2-original" + ("+vae" if prefix else "")), r.notes
    assert r.family.config["decoder_block_out_channels"] == [16, 32, 64]
    check_weights(r, model, "ltx2")


def test_ltx2_is_not_hunyuanvideo_and_hy15_not_wan(models, tmp_path):
    for fam in ("ltx2", "hunyuanvideo15"):
        f = _save(tmp_path / f"{fam}.safetensors", models[fam].state_dict())
        r = load_vae(f)
        assert r.family.name == fam and type(r.model).__name__ == CLASSES[fam], r.notes
        assert "family" in " ".join(r.notes)


# ----------------------------------------------------------------------------------------------------------------------
# 3. exact decode: vaeopt.decode and `vaeopt decode` equal diffusers' vae.decode (fp32, CPU)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", NEW)
def test_decode_equals_diffusers(fam, models, tmp_path):
    model = models[fam]
    model.save_pretrained(tmp_path / "vae")
    z = raw_latent(fam)
    ref = reference(model, z)
    got = vaeopt.decode(z, load_vae(tmp_path / "vae"), latent_space="raw", options=CPU32, log=None)
    assert got.shape == ref.shape
    if fam in ("flux2", "qwenimage"):  # the image path's NHWC convs on the CPU; Wan's chunk decoder
        assert psnr(got, ref) >= 60, psnr(got, ref)
    else:  # vaeopt.video_stream's exact chunks: fp32 rounding
        assert psnr(got, ref) >= 100, psnr(got, ref)
    if fam == "flux2":  # NCHW, as diffusers: the same ops, bitwise
        plain = vaeopt.Options(device="cpu", dtype="fp32", channels_last="off")
        assert torch.equal(vaeopt.decode(z, load_vae(tmp_path / "vae"), latent_space="raw", options=plain, log=None),
                           ref)


@pytest.mark.parametrize("fam", NEW)
def test_cli_decode_equals_diffusers(fam, models, tmp_path):
    from typer.testing import CliRunner

    from vaeopt.cli import app

    model = models[fam]
    model.save_pretrained(tmp_path / "vae")
    z = raw_latent(fam)
    save_file({"samples": z}, str(tmp_path / "lat.safetensors"))
    r = CliRunner().invoke(app, ["decode", str(tmp_path / "lat.safetensors"), "--model", str(tmp_path / "vae"),
                                 "--latent-space", "raw", "--device", "cpu", "--dtype", "fp32",
                                 "-o", str(tmp_path / "out.safetensors")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert get_family(fam).title in r.output
    got = load_file(str(tmp_path / "out.safetensors"))["sample"]
    assert psnr(got, reference(model, z)) >= 60


# ----------------------------------------------------------------------------------------------------------------------
# 2. latent conventions: the pipelines' own arithmetic
# ----------------------------------------------------------------------------------------------------------------------


def test_flux2_scaled_latents_as_the_pipeline(models, tmp_path):
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline as P

    model = models["flux2"]
    model.save_pretrained(tmp_path / "vae")
    loaded = load_vae(tmp_path / "vae")
    g = torch.Generator().manual_seed(3)
    packed_bn = torch.randn(1, 4 * 32, 3, 2, generator=g)  # the transformer's latents, unpacked from tokens
    # pipeline_flux2.py __call__: latents * sqrt(bn.running_var + eps) + bn.running_mean, then _unpatchify_latents
    mean = model.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
    raw = P._unpatchify_latents(packed_bn * std + mean)
    fam = loaded.family
    torch.testing.assert_close(lat.to_raw(packed_bn, fam, "scaled"), raw, rtol=0, atol=1e-6)
    # the same numbers unpatchified (N, 32, H, W), and the scale/unscale round trip
    torch.testing.assert_close(lat.to_raw(P._unpatchify_latents(packed_bn), fam, "scaled"), raw, rtol=0, atol=1e-6)
    torch.testing.assert_close(fam.unscale(fam.scale(raw)), raw, rtol=1e-5, atol=1e-5)
    # the packed token sequence (N, seq, 128) with the image size: _pack_latents / _unpack_latents_with_ids
    tokens = P._pack_latents(packed_bn)
    ids = P._prepare_latent_ids(packed_bn)
    assert torch.equal(P._unpack_latents_with_ids(tokens, ids), packed_bn)
    entry = lat.LatentEntry("", tokens, size=(48, 32))
    t = lat.validate(entry, fam, Path("<t>"))
    torch.testing.assert_close(lat.to_raw(t, fam, "scaled"), raw, rtol=0, atol=1e-6)
    # without a size: one clear error naming --height/--width
    with pytest.raises(vaeopt.errors.LatentError, match="--height"):
        lat.validate(lat.LatentEntry("", tokens), fam, Path("<t>"))
    # and through the API, decoded as the pipeline would
    got = vaeopt.decode(packed_bn, loaded, options=CPU32, log=None)
    assert psnr(got, reference(model, raw)) >= 60  # (the de-normalization's float rounding: ulps of the latents)


def test_qwenimage_latents_as_the_pipeline(models, tmp_path):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline as P

    model = models["qwenimage"]
    model.save_pretrained(tmp_path / "vae")
    fam = load_vae(tmp_path / "vae").family
    g = torch.Generator().manual_seed(4)
    z = torch.randn(1, 16, 1, 6, 4, generator=g)
    # pipeline_qwenimage.py __call__: latents / (1 / latents_std) + latents_mean, per channel, 5-D with T=1
    mean = torch.tensor(model.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(model.config.latents_std).view(1, 16, 1, 1, 1)
    want = z / inv_std + mean
    torch.testing.assert_close(lat.to_raw(lat.validate(lat.LatentEntry("", z), fam, Path("<t>")), fam, "scaled"),
                               want, rtol=1e-6, atol=1e-6)
    # the packed sequence (N, seq, 64) with the image size: _unpack_latents(latents, height, width, 8)
    tokens = P._pack_latents(z[:, :, 0], 1, 16, 6, 4)
    assert torch.equal(P._unpack_latents(tokens, 48, 32, 8), z)
    t = lat.validate(lat.LatentEntry("", tokens, size=(48, 32)), fam, Path("<t>"))
    torch.testing.assert_close(lat.to_raw(t, fam, "scaled"), want, rtol=1e-6, atol=1e-6)


def test_hunyuanvideo15_scaling_factor(models, tmp_path):
    model = models["hunyuanvideo15"]
    model.save_pretrained(tmp_path / "vae")
    fam = load_vae(tmp_path / "vae").family
    z = raw_latent("hunyuanvideo15")
    # pipeline_hunyuan_video1_5.py: latents / vae.config.scaling_factor
    torch.testing.assert_close(lat.to_raw(z, fam, "scaled"), z / model.config.scaling_factor, rtol=0, atol=0)
    assert fam.output_frames(2) == 5 and fam.spatial_factor == 16


def test_ltx2_latents_as_the_pipeline(models, tmp_path):
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline as P

    model = models["ltx2"]
    model.save_pretrained(tmp_path / "vae")
    fam = load_vae(tmp_path / "vae").family
    z = raw_latent("ltx2")
    want = P._denormalize_latents(z, model.latents_mean, model.latents_std, model.config.scaling_factor)
    torch.testing.assert_close(lat.to_raw(z, fam, "scaled"), want, rtol=1e-6, atol=1e-6)
    back = P._normalize_latents(want, model.latents_mean, model.latents_std, model.config.scaling_factor)
    torch.testing.assert_close(fam.scale(want), back, rtol=1e-5, atol=1e-5)
    assert fam.output_frames(16) == 121 and fam.spatial_factor == 32


def test_comfyui_flux2_latent_is_normalized_and_patchified(models, tmp_path):
    """ComfyUI's FLUX.2 LATENT is (N, 128, H/16, W/16), normalized: its VAE, like BFL's AutoEncoder.decode
    (flux2/src/flux2/autoencoder.py: decoder(unpack(inv_normalize(z)))), de-normalizes and unpatchifies inside."""
    model = models["flux2"]
    model.save_pretrained(tmp_path / "vae")
    loaded = load_vae(tmp_path / "vae")
    z = torch.randn(1, 128, 3, 2, generator=torch.Generator().manual_seed(8))
    save_file({"latent_tensor": z, "latent_format_version_0": torch.tensor([])}, str(tmp_path / "f.latent"))
    lf = lat.read_latents(tmp_path / "f.latent")
    t = lat.validate(lf.entries[0], loaded.family, lf.path)
    mean = model.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline as P

    want = P._unpatchify_latents(z * std + mean)
    torch.testing.assert_close(lat.to_raw(t, loaded.family, lf.default_space), want, rtol=0, atol=1e-6)


def test_comfyui_latent_files_are_raw(models, tmp_path):
    """ComfyUI .latent files hold raw latents: decoded as they are, for each family."""
    for fam in ("hunyuanvideo15", "ltx2"):
        model = models[fam]
        model.save_pretrained(tmp_path / fam)
        z = raw_latent(fam)
        f = tmp_path / f"{fam}.latent"
        save_file({"latent_tensor": z, "latent_format_version_0": torch.tensor([])}, str(f))
        lf = lat.read_latents(f)
        assert lf.default_space == "raw"
        got = vaeopt.decode(lf.entries[0].tensor, load_vae(tmp_path / fam), latent_space=lf.default_space,
                            options=CPU32, log=None)
        assert psnr(got, reference(model, z)) >= 100  # the exact chunk decoder: fp32 rounding


# ----------------------------------------------------------------------------------------------------------------------
# 4. fast paths that apply by family
# ----------------------------------------------------------------------------------------------------------------------


def test_flux2_tiled_equals_untiled(models, tmp_path):
    from vaeopt import tiling

    model = models["flux2"]
    model.save_pretrained(tmp_path / "vae")
    loaded = load_vae(tmp_path / "vae")
    z = torch.randn(1, 32, 12, 10, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = loaded.model.decode(z).sample
        tiled = tiling.tiled_decode(loaded.model, z, tile=4)
    assert psnr(tiled, whole) >= 100


def test_qwenimage_chunked_equals_whole(models, tmp_path):
    from vaeopt import video

    model = models["qwenimage"]
    model.save_pretrained(tmp_path / "vae")
    loaded = load_vae(tmp_path / "vae")
    z = torch.randn(1, 16, 5, 4, 4, generator=torch.Generator().manual_seed(6))
    ref = reference(model, z)
    with torch.no_grad():
        for chunk in (1, 2, 5):
            assert psnr(video.decode_video(loaded.model, z, chunk=chunk).clamp(-1, 1), ref) >= 60


@pytest.mark.parametrize("fam", NEW)
def test_optimize_keeps_decode(fam, models):
    import copy

    model = copy.deepcopy(models[fam])
    z = raw_latent(fam)
    ref = reference(model, z)
    vaeopt.optimize(model, device="cpu", log=None)
    with torch.no_grad():
        got = model.decode(z).sample.clamp(-1, 1)
    assert psnr(got, ref) >= 60


def test_info_lists_the_families():
    from vaeopt.info import family_outlook

    rows = {r["family"]: r for r in family_outlook()}
    for fam in NEW:
        assert fam in rows and rows[fam]["stages"]
    assert "Wan" in rows["qwenimage"]["stages"] and "tiling" in rows["flux2"]["stages"]


# ----------------------------------------------------------------------------------------------------------------------
# 5. the standard workloads (full size on a GPU; here their shapes, and the benchmark on tiny models)
# ----------------------------------------------------------------------------------------------------------------------

TINY_OVERRIDES = {
    "flux2": dict(block_out_channels=[32, 32, 64, 64], norm_num_groups=8, layers_per_block=1),
    "qwenimage": dict(base_dim=8),
    "hunyuanvideo15": dict(block_out_channels=[16, 32, 32, 32, 32], layers_per_block=1),
    "ltx2": dict(block_out_channels=[16, 32, 32, 32], decoder_block_out_channels=[16, 32, 64],
                 layers_per_block=[1, 1, 1, 1, 1], decoder_layers_per_block=[1, 1, 1, 1]),
}


def test_workload_shapes():
    from vaeopt.benchmark import WORKLOADS

    want = {"flux2-1024": (1, 1024, 1024), "qwenimage-1328": (1, 1328, 1328), "hunyuan15-480p": (121, 480, 848),
            "ltx2-768": (121, 768, 1280)}
    for wl, (frames, h, w) in want.items():
        fam, shape = WORKLOADS[wl]
        spec = get_family(fam)
        assert shape[1] == spec.latent_channels
        got_frames = spec.output_frames(shape[2]) if len(shape) == 5 else 1
        assert (got_frames, shape[-2] * spec.spatial_factor, shape[-1] * spec.spatial_factor) == (frames, h, w), wl


@pytest.mark.parametrize("fam", NEW)
def test_benchmark_runs_each_family_on_tiny_models(fam):
    from vaeopt import benchmark as B

    spec = get_family(fam)
    over = TINY_OVERRIDES[fam]
    shape = tuple(raw_latent(fam).shape)
    res = B.run_benchmark(spec, build_model(spec, **over).state_dict(), shape, device=torch.device("cpu"),
                          dtype=torch.float32, peers=(), repeats=1, warmup=0, fp8=False, log=lambda s: None,
                          workload=None, command="x", model_overrides=over)
    rows = {r["name"]: r for r in res["rows"]}
    assert rows["vaeopt plain"]["status"] == "ok" and rows["vaeopt plain"]["psnr_db"] >= 60, rows["vaeopt plain"]
    for r in res["rows"]:  # every row ran, or says why not; none failed
        assert r["status"] in ("ok", "skipped"), (r["name"], r["reason"])
        if r["status"] == "ok" and r["kind"] == "ladder":
            assert r["psnr_db"] >= 60, (r["name"], r["psnr_db"])


def test_cli_packed_latents_with_height_width_or_metadata(models, tmp_path):
    """`vaeopt decode` of the token sequences the FLUX.2 and Qwen-Image pipelines return: the image size from
    --height/--width or the file's metadata; without either, one line naming the flags (exit 2)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline as F2
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline as Q
    from typer.testing import CliRunner

    from vaeopt.cli import app

    def run(*args):
        return CliRunner().invoke(app, ["decode", *map(str, args), "--device", "cpu", "--dtype", "fp32"],
                                  catch_exceptions=False)

    g = torch.Generator().manual_seed(7)
    for fam in ("flux2", "qwenimage"):
        model = models[fam]
        model.save_pretrained(tmp_path / fam)
        loaded = load_vae(tmp_path / fam)
        if fam == "flux2":
            grid = torch.randn(1, 128, 3, 2, generator=g)
            tokens = F2._pack_latents(grid)
            raw = loaded.family.unscale(grid)
        else:
            grid = torch.randn(1, 16, 6, 4, generator=g)
            tokens = Q._pack_latents(grid, 1, 16, 6, 4)
            raw = loaded.family.unscale(grid.unsqueeze(2))
        ref = reference(model, raw)
        save_file({"latents": tokens.contiguous()}, str(tmp_path / f"{fam}.safetensors"))
        r = run(tmp_path / f"{fam}.safetensors", "-m", tmp_path / fam, "-o", tmp_path / f"{fam}_a.safetensors")
        assert r.exit_code == 2 and "--height" in r.output and "Traceback" not in r.output
        r = run(tmp_path / f"{fam}.safetensors", "-m", tmp_path / fam, "--height", 48, "--width", 32,
                "-o", tmp_path / f"{fam}_a.safetensors")
        assert r.exit_code == 0, r.output
        assert psnr(load_file(str(tmp_path / f"{fam}_a.safetensors"))["sample"], ref) >= 60
        save_file({"latents": tokens.contiguous()}, str(tmp_path / f"{fam}_meta.safetensors"), metadata={"height": "48",
                                                                                             "width": "32"})
        r = run(tmp_path / f"{fam}_meta.safetensors", "-m", tmp_path / fam, "-o", tmp_path / f"{fam}_b.safetensors")
        assert r.exit_code == 0, r.output
        assert psnr(load_file(str(tmp_path / f"{fam}_b.safetensors"))["sample"], ref) >= 60
        # vaeopt.json beside the latents: per file
        d = tmp_path / f"{fam}_folder"
        d.mkdir()
        torch.save(tokens.clone(), d / "lat.pt")
        (d / "vaeopt.json").write_text(json.dumps({"files": {"lat.pt": {"model": str(tmp_path / fam), "height": 48,
                                                                        "width": 32}}}))
        r = run(d / "lat.pt", "-o", d / "out.safetensors")
        assert r.exit_code == 0, r.output
        assert psnr(load_file(str(d / "out.safetensors"))["sample"], ref) >= 60


def test_timestep_conditioned_ltx_is_refused_in_one_line(tmp_path):
    m = build_model(get_family("ltx2"), block_out_channels=[16, 32, 32, 32], decoder_block_out_channels=[16, 32, 64],
                    layers_per_block=[1, 1, 1, 1, 1], decoder_layers_per_block=[1, 1, 1, 1], timestep_conditioning=True)
    m.save_pretrained(tmp_path / "vae")
    with pytest.raises(vaeopt.errors.CheckpointError, match="timestep conditioning"):
        load_vae(tmp_path / "vae")


def test_qwenimage_decodes_to_png_by_default(models, tmp_path):
    from PIL import Image
    from typer.testing import CliRunner

    from vaeopt.cli import app

    models["qwenimage"].save_pretrained(tmp_path / "qwen-image-vae")
    torch.save(torch.randn(1, 16, 1, 6, 4), tmp_path / "lat.pt")
    r = CliRunner().invoke(app, ["decode", str(tmp_path / "lat.pt"), "-m", str(tmp_path / "qwen-image-vae"),
                                 "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert Image.open(tmp_path / "lat.png").size == (32, 48)


def test_flux2_odd_scaled_latents_are_one_clear_error(models, tmp_path):
    models["flux2"].save_pretrained(tmp_path / "vae")
    fam = load_vae(tmp_path / "vae").family
    with pytest.raises(vaeopt.errors.LatentError, match="even"):
        lat.to_raw(torch.randn(1, 32, 5, 4), fam, "scaled")
    assert lat.to_raw(torch.randn(1, 32, 5, 4), fam, "raw").shape == (1, 32, 5, 4)


@pytest.mark.parametrize("fam", ["hunyuanvideo15", "ltx2"])
def test_forced_tiles_are_exact(fam, models, tmp_path):
    """--tile on HunyuanVideo 1.5 / LTX-2: vaeopt.video_stream's exact spatial tiles (not diffusers' blended ones),
    the model's own tiling settings untouched."""
    model = models[fam]
    model.save_pretrained(tmp_path / "vae")
    loaded = load_vae(tmp_path / "vae")
    z = torch.randn(1, get_family(fam).latent_channels, 2, 12, 12, generator=torch.Generator().manual_seed(9))
    ref = reference(model, z)
    got = vaeopt.decode(z, loaded, latent_space="raw", options=vaeopt.Options(device="cpu", dtype="fp32", tile=8),
                        log=None)
    assert got.shape == ref.shape
    assert psnr(got, ref) >= 100
    assert loaded.model.use_tiling is False


def tiny_ltx23():
    """LTX-2.3's decoder shape (scripts/convert_ltx2_to_diffusers.py, version "2.3"): four up blocks with factors
    (2, 2, 1, 2), no residual upsamplers, zero padding; narrow."""
    import diffusers

    torch.manual_seed(23)
    m = diffusers.AutoencoderKLLTX2Video(
        block_out_channels=(16, 32, 32, 32), decoder_block_out_channels=(16, 32, 32, 64),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 2, 1, 1, 1),
        decoder_spatio_temporal_scaling=(True,) * 4, decoder_inject_noise=(False,) * 5,
        upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"), upsample_residual=(False,) * 4,
        upsample_factor=(2, 2, 1, 2), decoder_causal=False, decoder_spatial_padding_mode="zeros")
    m.latents_mean.normal_()
    return _jitter(m)


def test_ltx23_folder_and_original_file(tmp_path):
    model = tiny_ltx23()
    z = raw_latent("ltx2")
    ref = reference(model, z)
    model.save_pretrained(tmp_path / "vae")
    orig = ltx2_original(model.state_dict(), "vae.")
    assert any(k.startswith("vae.decoder.up_blocks.8.") for k in orig)  # the fourth up block
    for path in (tmp_path / "vae", _save(tmp_path / "ltx-2.3-22b-dev.safetensors", orig)):
        r = load_vae(path)
        assert r.family.name == "ltx2", r.notes
        assert r.family.config["decoder_block_out_channels"] == [16, 32, 32, 64]
        assert r.family.config["decoder_spatial_padding_mode"] == "zeros"
        check_weights(r, model, "ltx2")
        assert torch.equal(vaeopt.decode(z, r, latent_space="raw", options=CPU32, log=None), ref)


def test_model_class_without_diffusers_is_a_one_line_error(monkeypatch):
    """A missing or broken diffusers install is said as a CheckpointError (exit 2, what to install), not reported
    as an unexpected error of vaeopt's own."""
    import sys

    from vaeopt.errors import CheckpointError
    from vaeopt.families import model_class

    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ImportError
    with pytest.raises(CheckpointError, match=r"diffusers is not installed .*pip install diffusers"):
        model_class("AutoencoderKL")
