"""vaeopt.loading: every family at reduced width, saved in every layout that applies, loaded back; error cases; the
trained sample checkpoints. CPU only, no network."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vaeopt.errors import CheckpointError
from vaeopt.families import build_model, family_names, get_family
from vaeopt.loading import detect, load_vae, read_state_dict

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
WAN_SAMPLE_CONFIG = ROOT.parent / "shared" / "data" / "tiny_wan_video.config.json"

KL = ("sd15", "sd2", "sdxl", "sd3", "flux")
SMALL = {
    **{f: dict(block_out_channels=[32, 32, 64, 64], norm_num_groups=8, layers_per_block=1) for f in KL},
    "wan21": dict(base_dim=8),
    "wan22": dict(base_dim=8, decoder_base_dim=16),
    "hunyuanvideo": dict(block_out_channels=[16, 16, 32, 32], norm_num_groups=8, layers_per_block=1),
    # (FLUX.2 and Qwen-Image are built here as the classes vaeopt runs them as; their own diffusers classes'
    # files are tested in test_families.py)
    "flux2": dict(block_out_channels=[32, 32, 64, 64], norm_num_groups=8, layers_per_block=1),
    "qwenimage": dict(base_dim=8),
    "hunyuanvideo15": dict(block_out_channels=[16, 32, 32, 32, 32], layers_per_block=1),
    "ltx2": dict(block_out_channels=[16, 32, 32, 32], decoder_block_out_channels=[16, 32, 64],
                 layers_per_block=[1, 1, 1, 1, 1], decoder_layers_per_block=[1, 1, 1, 1]),
    "taesd": dict(encoder_block_out_channels=[16] * 4, decoder_block_out_channels=[16] * 4),
    "taesdxl": dict(encoder_block_out_channels=[16] * 4, decoder_block_out_channels=[16] * 4),
}


# ----------------------------------------------------------------------------------------------------------------------
# helpers: small models and the layouts they are saved in
# ----------------------------------------------------------------------------------------------------------------------


def small_model(fam: str):
    torch.manual_seed(sum(map(ord, fam)))
    spec = get_family(fam)
    model = build_model(spec, **SMALL[fam])
    with torch.no_grad():  # make every tensor distinct, so a swapped mapping cannot go unnoticed
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    cfg = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    return model, cfg


def latent_for(fam: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    c = get_family(fam).latent_channels
    if get_family(fam).is_video:
        return torch.randn(1, c, 2, 4, 4, generator=g)
    return torch.randn(1, c, 8, 8, generator=g)


def decode(model, z):
    with torch.no_grad():
        return model.decode(z).sample


def to_ldm(sd: dict, video: bool = False) -> dict:
    """diffusers AutoencoderKL / HunyuanVideo keys -> original LDM keys (inverse of diffusers' converter)."""
    n_up = 1 + max(int(m[1]) for k in sd if (m := re.match(r"^decoder\.up_blocks\.(\d+)\.", k)))
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    out = {}
    for k, v in sd.items():
        nk = k
        if m := re.match(r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", k):
            nk = f"encoder.down.{m[1]}.block.{m[2]}.{m[3]}"
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.+)$", k):
            nk = f"encoder.down.{m[1]}.downsample.{m[2]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", k):
            nk = f"decoder.up.{n_up - 1 - int(m[1])}.block.{m[2]}.{m[3]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", k):
            nk = f"decoder.up.{n_up - 1 - int(m[1])}.upsample.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)$", k):
            nk = f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_[qkv]|to_out\.0)\.(.+)$", k):
            nk = f"{m[1]}.mid.attn_1.{attn[m[2]]}.{m[3]}"
            if m[3] == "weight" and m[2] != "group_norm":  # LDM attention is 1x1 convs
                v = v.reshape(*v.shape, *([1] * (3 if video else 2)))
        elif m := re.match(r"^(encoder|decoder)\.conv_norm_out\.(.+)$", k):
            nk = f"{m[1]}.norm_out.{m[2]}"
        out[nk.replace("conv_shortcut", "nin_shortcut")] = v.clone()
    return out


_RES_INV = {
    "norm1.gamma": "residual.0.gamma",
    "conv1.weight": "residual.2.weight",
    "conv1.bias": "residual.2.bias",
    "norm2.gamma": "residual.3.gamma",
    "conv2.weight": "residual.6.weight",
    "conv2.bias": "residual.6.bias",
    "conv_shortcut.weight": "shortcut.weight",
    "conv_shortcut.bias": "shortcut.bias",
}


def to_wan_original(sd: dict, num_res_blocks: int = 2, nested: bool = False) -> dict:
    """diffusers AutoencoderKLWan keys -> the original Wan 2.1 (flat) or Wan 2.2 (nested) .pth keys."""
    out = {}
    for k, v in sd.items():
        nk = None
        top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
        if (m := re.match(r"^(quant_conv|post_quant_conv)\.(.+)$", k)):
            nk = f"{top[m[1]]}.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.conv_in\.(.+)$", k):
            nk = f"{m[1]}.conv1.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.norm_out\.gamma$", k):
            nk = f"{m[1]}.head.0.gamma"
        elif m := re.match(r"^(encoder|decoder)\.conv_out\.(.+)$", k):
            nk = f"{m[1]}.head.2.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)$", k):
            nk = f"{m[1]}.middle.{2 * int(m[2])}.{_RES_INV[m[3]]}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(.+)$", k):
            nk = f"{m[1]}.middle.1.{m[2]}"
        elif not nested and (m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", k)):
            nk = f"encoder.downsamples.{m[1]}.{_RES_INV.get(m[2], m[2])}"
        elif not nested and (m := re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", k)):
            nk = f"decoder.upsamples.{int(m[1]) * (num_res_blocks + 2) + int(m[2])}.{_RES_INV[m[3]]}"
        elif not nested and (m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", k)):
            nk = f"decoder.upsamples.{int(m[1]) * (num_res_blocks + 2) + num_res_blocks + 1}.{m[2]}"
        elif nested and (m := re.match(r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", k)):
            nk = f"encoder.downsamples.{m[1]}.downsamples.{m[2]}.{_RES_INV[m[3]]}"
        elif nested and (m := re.match(r"^encoder\.down_blocks\.(\d+)\.downsampler\.(.+)$", k)):
            nk = f"encoder.downsamples.{m[1]}.downsamples.{num_res_blocks}.{m[2]}"
        elif nested and (m := re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", k)):
            nk = f"decoder.upsamples.{m[1]}.upsamples.{m[2]}.{_RES_INV[m[3]]}"
        elif nested and (m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsampler\.(.+)$", k)):
            nk = f"decoder.upsamples.{m[1]}.upsamples.{num_res_blocks + 1}.{m[2]}"
        assert nk is not None, k
        out[nk] = v.clone()
    return out


def to_taesd_decoder(sd: dict) -> dict:
    """diffusers AutoencoderTiny -> original taesd_decoder.pth keys (index + 1: the original starts with a Clamp)."""
    out = {}
    for k, v in sd.items():
        if m := re.match(r"^decoder\.layers\.(\d+)\.(.+)$", k):
            out[f"{int(m[1]) + 1}.{m[2]}"] = v.clone()
    return out


def decoder_tensors(sd: dict) -> dict:
    return {k: v for k, v in sd.items() if k.startswith(("decoder.", "post_quant_conv."))}


def assert_same_decoder(loaded, ref_model, z=None, fam=None):
    got = loaded.model.state_dict()
    ref = decoder_tensors(ref_model.state_dict())
    assert set(decoder_tensors(got)) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k
    if z is not None:
        torch.testing.assert_close(decode(loaded.model, z), decode(ref_model, z), rtol=0, atol=1e-6)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    return {f: small_model(f) for f in family_names()}


# ----------------------------------------------------------------------------------------------------------------------
# every family, every layout
# ----------------------------------------------------------------------------------------------------------------------

def _save_st(path: Path, sd: dict, metadata: dict | None = None) -> Path:
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("fam", [f for f in family_names() if f != "qwenimage"])  # (as an AutoencoderKLWan it is Wan
def test_diffusers_single_file_and_dir(fam, models, tmp_path):  # 2.1: test_families.py saves AutoencoderKLQwenImage)
    model, cfg = models[fam]
    sd = model.state_dict()
    meta = {"config": json.dumps(cfg)}
    if fam == "taesdxl":  # TAESD and TAESDXL configs are identical: only a name can tell
        meta["modelspec.title"] = "TAESDXL"
    f = _save_st(tmp_path / "diffusion_pytorch_model.safetensors", sd, meta)
    r = load_vae(f)
    assert (r.family.name, r.layout) == (fam, "diffusers"), r.notes
    assert r.dtype_on_disk == torch.float32
    assert not any(p.requires_grad for p in r.model.parameters()) and not r.model.training
    assert_same_decoder(r, model, latent_for(fam))
    for k, v in model.state_dict().items():  # encoder too
        assert torch.equal(r.model.state_dict()[k], v), k

    d = tmp_path / (f"{fam}-model" if fam == "taesdxl" else "some-model")
    model.save_pretrained(d)
    r = load_vae(d)
    assert (r.family.name, r.layout) == (fam, "diffusers-dir"), r.notes
    assert_same_decoder(r, model)
    # a pipeline directory: <dir>/vae/
    pipe = tmp_path / ("pipe-taesdxl" if fam == "taesdxl" else "pipe")
    (pipe / "vae").mkdir(parents=True)
    (pipe / "model_index.json").write_text("{}")
    for p in d.iterdir():
        (pipe / "vae" / p.name).write_bytes(p.read_bytes())
    r = load_vae(pipe)
    assert (r.family.name, r.layout) == (fam, "diffusers-dir")


LDM_NAMES = {  # file name -> the family it should be guessed as
    "sd15": "vae-ft-mse-840000-ema-pruned.safetensors",  # no hint: the documented default
    "sd2": "v2-1_768_vae.safetensors",
    "sdxl": "sdxl_vae.safetensors",
    "sd3": "sd3.5_vae.safetensors",
    "flux": "ae.safetensors",
    "hunyuanvideo": "hunyuan_video_vae_bf16.safetensors",
}


@pytest.mark.parametrize("fam", list(LDM_NAMES))
def test_ldm_layout_guessed_from_file_name(fam, models, tmp_path):
    model, cfg = models[fam]
    ldm = to_ldm(model.state_dict(), video=fam == "hunyuanvideo")
    f = _save_st(tmp_path / LDM_NAMES[fam], ldm)
    r = load_vae(f, config={"norm_num_groups": 8})  # a group count is not visible in the weights
    assert (r.family.name, r.layout) == (fam, "ldm"), r.notes
    assert r.family.config["block_out_channels"] == cfg["block_out_channels"]
    assert r.family.config["layers_per_block"] == 1
    assert_same_decoder(r, model, latent_for(fam))
    if fam == "sd15":
        assert any("family sd15 assumed" in n and "family='sdxl'" in n for n in r.notes)
    elif fam != "hunyuanvideo":
        assert any(f"guessed from file name '{LDM_NAMES[fam]}'" in n for n in r.notes)
    if fam in ("sd15", "sdxl", "hunyuanvideo"):
        assert any("reshaped to linear" in n for n in r.notes)


FULL_CKPT_KEYS = {  # other weights of a full checkpoint -> family
    "sd15": "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
    "sd2": "cond_stage_model.model.token_embedding.weight",
    "sdxl": "conditioner.embedders.1.model.token_embedding.weight",
    "sd3": "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
    "flux": "model.diffusion_model.double_blocks.0.img_attn.qkv.weight",
}


@pytest.mark.parametrize("fam", list(FULL_CKPT_KEYS))
def test_full_checkpoint_with_first_stage_model_prefix(fam, models, tmp_path):
    model, cfg = models[fam]
    sd = {f"first_stage_model.{k}": v for k, v in to_ldm(model.state_dict()).items()}
    sd["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(8, 4, 3, 3)
    sd[FULL_CKPT_KEYS[fam]] = torch.zeros(4, 4)
    sd["model_ema.decay"] = torch.tensor(0.999)
    if fam == "sd15":  # an A1111-era .ckpt: a pickle with a "state_dict" nesting, read with weights_only=True
        f = tmp_path / "model.ckpt"
        torch.save({"state_dict": sd, "global_step": 470000}, f)
    else:
        f = _save_st(tmp_path / "model.safetensors", sd)
    r = load_vae(f, config={"norm_num_groups": 8})
    assert (r.family.name, r.layout) == (fam, "ldm+first_stage_model"), r.notes
    assert any("other weights" in n for n in r.notes)
    assert_same_decoder(r, model)


@pytest.mark.parametrize("fam", ["wan21", "wan22"])
def test_wan_original_layout(fam, models, tmp_path):
    model, cfg = models[fam]
    orig = to_wan_original(model.state_dict(), nested=fam == "wan22")
    f = tmp_path / ("Wan2.2_VAE.pth" if fam == "wan22" else "Wan2.1_VAE.pth")
    torch.save(orig, f)
    r = load_vae(f)
    assert (r.family.name, r.layout) == (fam, "wan-original"), r.notes
    for k in ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample", "is_residual"):
        assert r.family.config[k] == cfg[k], k
    assert r.family.config["decoder_base_dim"] == (16 if fam == "wan22" else 8)
    assert any("widths inferred from shapes" in n for n in r.notes)
    assert_same_decoder(r, model, latent_for(fam))


@pytest.mark.parametrize("fam,name", [("taesd", "taesd_decoder.pth"), ("taesdxl", "taesdxl_decoder.safetensors")])
def test_taesd_original_decoder_only(fam, name, models, tmp_path):
    model, cfg = models[fam]
    f = tmp_path / name
    dec = to_taesd_decoder(model.state_dict())
    torch.save(dec, f) if name.endswith(".pth") else _save_st(f, dec)
    r = load_vae(f)
    assert (r.family.name, r.layout) == (fam, "taesd-original"), r.notes
    assert "encoder weights absent: decode only" in r.notes
    assert r.family.config["decoder_block_out_channels"] == [16] * 4
    assert_same_decoder(r, model, latent_for(fam))
    assert all(torch.isfinite(p).all() for p in r.model.encoder.parameters())


def upstream_taesd_decoder(latent: int, stages: list[tuple[int, int]], pool: bool = False) -> dict:
    """A decoder state dict in the key layout of madebyollin/taesd's taesd.py (random tiny tensors): Clamp, conv,
    ReLU, then per stage (width, blocks): the blocks (`.pool` GroupNorm branches in the first stage with pool=True,
    as TAEF2's use_midblock_gn), Upsample and a bias-free conv to the next width; the last conv to RGB."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    sd = {"1.weight": r(stages[0][0], latent, 3, 3), "1.bias": r(stages[0][0])}
    i = 3
    for s, (w, n) in enumerate(stages):
        for _ in range(n):
            for j in (0, 2, 4):
                sd[f"{i}.conv.{j}.weight"], sd[f"{i}.conv.{j}.bias"] = r(w, w, 3, 3), r(w)
            if pool and s == 0:
                sd.update({f"{i}.pool.0.weight": r(4 * w, w, 1, 1), f"{i}.pool.1.weight": r(4 * w),
                           f"{i}.pool.1.bias": r(4 * w), f"{i}.pool.3.weight": r(w, 4 * w, 1, 1)})
            i += 1
        if s < len(stages) - 1:
            sd[f"{i + 1}.weight"] = r(stages[s + 1][0], w, 3, 3)  # after the (parameter-free) Upsample at i
            i += 2
    sd[f"{i}.weight"], sd[f"{i}.bias"] = r(3, stages[-1][0], 3, 3), r(3)
    return sd


TAEF2_REAL = Path("/tmp/taef2_decoder.pth")  # madebyollin/taesd's taef2_decoder.pth, where a machine has it


def test_taesd_variants_autoencodertiny_cannot_build(tmp_path):
    """TAEF2 (GroupNorm pooling blocks) and TAESana (32x, widths 256 -> 128 -> 64) said 'decoder weights do not fit
    AutoencoderTiny ... or a damaged file' with a list of renamed keys: now named, with the reason."""
    plain = upstream_taesd_decoder(4, [(8, 3), (8, 3), (8, 3), (8, 1)])
    torch.save(plain, tmp_path / "taesd_decoder.pth")  # the helper's layout is upstream's: this one loads
    assert load_vae(tmp_path / "taesd_decoder.pth").layout == "taesd-original"
    torch.save(upstream_taesd_decoder(32, [(8, 3), (8, 3), (8, 3), (8, 1)], pool=True), tmp_path / "taef2.pth")
    with pytest.raises(CheckpointError, match=r"taef2.pth: a TAESD-family decoder with GroupNorm pooling blocks "
                                              r"\(TAEF2, for FLUX.2; 3 blocks .*AutoencoderTiny has no such layers.*"
                                              r"file itself looks fine"):
        load_vae(tmp_path / "taef2.pth")
    sana = upstream_taesd_decoder(32, [(16, 3), (8, 3), (4, 3), (4, 3), (4, 3), (4, 1)])
    _save_st(tmp_path / "taesana_decoder.safetensors", sana)
    with pytest.raises(CheckpointError, match=r"width changes between stages \(TAESana, for Sana's 32x DC-AE; widths "
                                              r"16 -> 8 -> 4\): diffusers' AutoencoderTiny keeps one width"):
        load_vae(tmp_path / "taesana_decoder.safetensors")
    comfy = {f"taesd_decoder.{k}": v for k, v in upstream_taesd_decoder(32, [(8, 1), (8, 1)], pool=True).items()}
    with pytest.raises(CheckpointError, match="TAEF2"):  # ComfyUI's combined layout too
        load_vae(_save_st(tmp_path / "taef2_comfy.safetensors", comfy))
    # madebyollin/taef2's taef2.safetensors: diffusers' names (decoder.layers.N, N = upstream index - 1: no Clamp)
    named = {f"decoder.layers.{int(k.split('.', 1)[0]) - 1}.{k.split('.', 1)[1]}": v
             for k, v in upstream_taesd_decoder(32, [(8, 3), (8, 1)], pool=True).items()}
    with pytest.raises(CheckpointError, match=r"TAEF2, for FLUX.2; 3 blocks have a .pool branch, e.g. "
                                              r"decoder.layers.2.pool"):
        load_vae(_save_st(tmp_path / "taef2.safetensors", named))


@pytest.mark.skipif(not TAEF2_REAL.is_file(), reason=f"no {TAEF2_REAL}")
def test_taef2_real_file():
    with pytest.raises(CheckpointError, match=r"GroupNorm pooling blocks \(TAEF2, for FLUX.2; 3 blocks"):
        load_vae(TAEF2_REAL)


@pytest.mark.parametrize("variant", [None, "fp16", "bf16"])  # the variants' index: ...safetensors.index.fp16.json
def test_sharded_diffusers_dir(variant, models, tmp_path):
    model, _ = models["sd3"]
    model.save_pretrained(tmp_path / "sd3-vae", max_shard_size="1MB", variant=variant)
    index = "diffusion_pytorch_model.safetensors.index" + (f".{variant}" if variant else "") + ".json"
    assert (tmp_path / "sd3-vae" / index).is_file()
    r = load_vae(tmp_path / "sd3-vae")
    assert (r.family.name, r.layout) == ("sd3", "diffusers-dir")
    assert_same_decoder(r, model)
    if variant:  # beside a plain single file, the plain weights win, as in diffusers (variant=None)
        plain = copy.deepcopy(model)
        with torch.no_grad():
            plain.decoder.conv_in.bias.add_(1.0)
        plain.save_pretrained(tmp_path / "sd3-vae")
        assert (tmp_path / "sd3-vae" / "diffusion_pytorch_model.safetensors").is_file()
        got = load_vae(tmp_path / "sd3-vae").model.decoder.conv_in.bias
        assert torch.equal(got.float(), plain.decoder.conv_in.bias.float())


def test_comfyui_combined_taesd(models, tmp_path):
    model, cfg = models["taesd"]
    sd = {f"taesd_decoder.{k}": v for k, v in to_taesd_decoder(model.state_dict()).items()}
    for k, v in model.state_dict().items():
        if m := re.match(r"^encoder\.layers\.(.+)$", k):
            sd[f"taesd_encoder.{m[1]}"] = v
    sd["vae_scale"] = torch.tensor(1.0)
    r = load_vae(_save_st(tmp_path / "taesd.safetensors", sd))
    assert (r.family.name, r.layout) == ("taesd", "taesd-original+taesd_decoder")
    assert not any("decode only" in n for n in r.notes)
    for k, v in model.state_dict().items():
        assert torch.equal(r.model.state_dict()[k], v), k


def test_hunyuan_with_vae_prefix(models, tmp_path):
    model, _ = models["hunyuanvideo"]
    f = tmp_path / "pytorch_model.pt"
    torch.save({"state_dict": {f"vae.{k}": v for k, v in model.state_dict().items()}}, f)
    r = load_vae(f, config={"norm_num_groups": 8})
    assert (r.family.name, r.layout) == ("hunyuanvideo", "diffusers+vae")
    assert_same_decoder(r, model)


def test_hunyuan_original_vae_folder(models, tmp_path):
    """HunyuanVideo's own ckpts/.../vae/: config.json for AutoencoderKLCausal3D beside pytorch_model.pt. The folder
    was 'holds no model', and --config of that config.json 'is for AutoencoderKLCausal3D, but the weights are an
    AutoencoderKLHunyuanVideo'. Its scaling_factor and widths are used; its block type names are not."""
    model, cfg = models["hunyuanvideo"]
    d = tmp_path / "hunyuan-video-t2v-720p" / "vae"
    d.mkdir(parents=True)
    torch.save({"state_dict": {f"vae.{k}": v for k, v in model.state_dict().items()}}, d / "pytorch_model.pt")
    original = {"_class_name": "AutoencoderKLCausal3D", "_diffusers_version": "0.4.2", "scaling_factor": 0.5,
                "block_out_channels": cfg["block_out_channels"], "norm_num_groups": 8, "layers_per_block": 1,
                "latent_channels": 16, "down_block_types": ["DownEncoderBlockCausal3D"] * 4,
                "up_block_types": ["UpDecoderBlockCausal3D"] * 4, "time_compression_ratio": 4, "sample_tsize": 64}
    (d / "config.json").write_text(json.dumps(original))
    for r in (load_vae(d), load_vae(d / "pytorch_model.pt", config=d / "config.json")):
        assert r.family.name == "hunyuanvideo" and r.family.cls_name == "AutoencoderKLHunyuanVideo"
        assert r.family.config["scaling_factor"] == 0.5 and r.family.config["norm_num_groups"] == 8
        assert r.family.config["up_block_types"] == ["HunyuanVideoUpBlock3D"] * 4
        assert any("AutoencoderKLCausal3D (the original HunyuanVideo VAE)" in n for n in r.notes), r.notes
        assert_same_decoder(r, model)


# ----------------------------------------------------------------------------------------------------------------------
# special cases
# ----------------------------------------------------------------------------------------------------------------------


def test_pruned_decoder_only_kl(models, tmp_path):
    model, cfg = models["sdxl"]
    f = _save_st(tmp_path / "sdxl_vae_decoder_only.safetensors", decoder_tensors(to_ldm(model.state_dict())))
    r = load_vae(f, config={"norm_num_groups": 8})
    assert (r.family.name, r.layout) == ("sdxl", "ldm")
    assert "encoder weights absent: decode only" in r.notes
    assert r.family.config["use_quant_conv"] and r.family.config["use_post_quant_conv"]
    assert_same_decoder(r, model, latent_for("sdxl"))
    assert all(torch.isfinite(p).all() for p in r.model.encoder.parameters())


def test_pruned_decoder_only_wan22(models, tmp_path):
    model, cfg = models["wan22"]
    f = _save_st(tmp_path / "wan2.2_vae_decoder.safetensors", decoder_tensors(model.state_dict()))
    r = load_vae(f)
    assert (r.family.name, r.layout) == ("wan22", "diffusers")
    assert "encoder weights absent: decode only" in r.notes
    assert r.family.config["base_dim"] == r.family.config["decoder_base_dim"] == 16  # small encoder, left at init
    assert_same_decoder(r, model, latent_for("wan22"))


def test_old_attention_names_and_conv_shapes(models, tmp_path):
    model, cfg = models["sd15"]
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    sd = {}
    for k, v in model.state_dict().items():
        if m := re.match(r"^(.*\.attentions\.0\.)(to_q|to_k|to_v|to_out\.0)\.(weight|bias)$", k):
            k = f"{m[1]}{old[m[2]]}.{m[3]}"
            v = v[:, :, None, None] if m[3] == "weight" else v
        sd[k] = v
    f = _save_st(tmp_path / "old.safetensors", sd, {"config": json.dumps(cfg)})
    r = load_vae(f)
    assert any("old attention names" in n for n in r.notes)
    assert_same_decoder(r, model, latent_for("sd15"))


def test_ema_copy_beside_the_plain_vae_is_named(models, tmp_path):
    """vae-ft-mse-840000-ema-pruned.ckpt style: the VAE plus LitEma's copy (model_ema.<key without dots>). The EMA
    copy was reported as 'ignored N non-VAE tensors'; the notes now say which set is used."""
    model, cfg = models["sd15"]
    ldm = to_ldm(model.state_dict())
    ema = {f"model_ema.{k.replace('.', '')}": torch.zeros_like(v) for k, v in ldm.items()}
    f = tmp_path / "vae-ft-mse-840000-ema-pruned.ckpt"
    torch.save({"state_dict": {**ldm, **ema, "model_ema.decay": torch.tensor(0.9999)}, "global_step": 840001}, f)
    r = load_vae(f, config={"norm_num_groups": 8})
    assert (f"the checkpoint holds the VAE twice, plain and as an EMA copy (model_ema.*, {len(ema) + 1} tensors): "
            "the plain weights are used, the EMA copy is ignored") in r.notes
    assert not any(n.startswith("ignored") for n in r.notes), r.notes
    assert_same_decoder(r, model)  # the plain set (the EMA copy here is zeros)


@pytest.mark.parametrize("disk", [torch.float16, torch.bfloat16])
def test_half_precision_on_disk(disk, models, tmp_path):
    model, cfg = models["flux"]
    sd = {k: v.to(disk) for k, v in model.state_dict().items()}
    f = _save_st(tmp_path / "flux_vae.safetensors", sd, {"config": json.dumps(cfg)})
    r = load_vae(f, dtype=torch.bfloat16)
    assert r.dtype_on_disk == disk and r.family.name == "flux"
    assert next(r.model.parameters()).dtype == torch.bfloat16
    for k, v in sd.items():
        assert torch.equal(r.model.state_dict()[k], v.to(torch.bfloat16)), k


@pytest.mark.parametrize("disk", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_non_finite_decoder_weights_are_refused_in_every_dtype(disk, tmp_path):
    """One NaN, +Inf or -Inf anywhere in a decoder tensor (here deep inside the largest one, and in a 1-element one)
    is found, in every floating dtype on disk; an encoder tensor's NaN is not the decoder's concern."""
    tensors, meta = read_state_dict(SAMPLES / "tiny_kl_image.safetensors")
    sd = {k: v.to(disk) for k, v in tensors.items()}
    big = max((k for k in sd if k.startswith("decoder.")), key=lambda k: sd[k].numel())
    assert load_vae(_save_st(tmp_path / "ok.safetensors", sd, meta)).family.name == "sd15"
    for k, i in ((big, sd[big].numel() * 2 // 3), ("decoder.conv_out.bias", 2)):
        # (e4m3fn has no Inf: torch's cast saturates it to ±448, so there only NaN)
        for bad in (float("nan"),) + ((float("inf"), float("-inf")) if disk != torch.float8_e4m3fn else ()):
            t = sd[k].float().clone()
            t.view(-1)[i] = bad
            f = _save_st(tmp_path / "bad.safetensors", {**sd, k: t.to(disk)}, meta)
            with pytest.raises(CheckpointError, match=rf"1 decoder weight tensor\(s\) hold NaN/Inf \(e.g. {k}\)"):
                load_vae(f)
    enc = next(k for k in sd if k.startswith("encoder.") and sd[k].numel() > 1)
    t = sd[enc].float().clone()
    t.view(-1)[0] = float("nan")
    assert load_vae(_save_st(tmp_path / "enc.safetensors", {**sd, enc: t.to(disk)}, meta)).family.name == "sd15"


def test_the_model_is_built_without_running_weight_init(monkeypatch):
    """The meta-device skeleton skips torch.nn.init (diffusers' no_init_weights, as its from_pretrained), and the
    init functions are torch's own again afterwards; the weights are the file's, bitwise."""
    calls = []
    real = torch.nn.init.kaiming_uniform_
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = load_vae(SAMPLES / "tiny_kl_image.safetensors")
    assert calls == [] and torch.nn.init.kaiming_uniform_ is real
    tensors, _ = read_state_dict(SAMPLES / "tiny_kl_image.safetensors")
    assert all(torch.equal(r.model.state_dict()[k], v.float()) for k, v in tensors.items())


def test_family_argument_and_explicit_config(models, tmp_path):
    model, cfg = models["sd15"]
    f = _save_st(tmp_path / "vae.safetensors", to_ldm(model.state_dict()))
    r = load_vae(f, family="sdxl", config={"norm_num_groups": 8})
    assert r.family.name == "sdxl" and r.family.config["scaling_factor"] == 0.13025
    assert "family sdxl as requested" in r.notes
    # a config file overrides: scaling factor and group count come from it
    cf = tmp_path / "cfg.json"
    cf.write_text(json.dumps({"norm_num_groups": 8, "scaling_factor": 0.5}))
    r = load_vae(f, config=cf)
    assert r.family.config["scaling_factor"] == 0.5 and r.family.config["norm_num_groups"] == 8
    assert_same_decoder(r, model, latent_for("sd15"))
    # without a group count, the family default is assumed, and said so
    r = load_vae(f)
    assert r.family.config["norm_num_groups"] == 32
    assert any("norm_num_groups 32 assumed" in n for n in r.notes)
    with pytest.raises(CheckpointError, match=r"vae.safetensors: family 'flux'.*does not match.*AutoencoderKL with 4"):
        load_vae(f, family="flux")
    with pytest.raises(CheckpointError, match="vae.safetensors: the given config is for AutoencoderKLWan"):
        load_vae(f, config={"_class_name": "AutoencoderKLWan"})


def test_detect_and_read_state_dict(models, tmp_path):
    model, cfg = models["sd3"]
    sd = to_ldm(model.state_dict())
    spec, layout, notes = detect(sd, filename="sd3_medium_vae.safetensors")
    assert (spec.name, layout) == ("sd3", "ldm")
    assert spec.config["block_out_channels"] == [32, 32, 64, 64] and spec.config["use_quant_conv"] is False
    spec, _, notes = detect(sd)  # no hint at all: the documented default for 16-channel KL
    assert spec.name == "flux" and any("family='sd3'" in n for n in notes)
    f = tmp_path / "nested.pt"
    torch.save({"model": {"module": {"decoder.x": torch.ones(2)}}, "epoch": 1}, f)
    tensors, meta = read_state_dict(f)
    assert list(tensors) == ["decoder.x"] and meta == {}


# ----------------------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------------------


def test_errors_files(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found: .*nope.safetensors"):
        load_vae(tmp_path / "nope.safetensors")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CheckpointError, match="emptydir: directory holds no model"):
        load_vae(tmp_path / "emptydir")
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="pipe: pipeline directory without a usable vae/"):
        load_vae(tmp_path / "pipe")
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.safetensors: empty file"):
        load_vae(empty)
    png = tmp_path / "image.safetensors"
    png.write_bytes((SAMPLES / "astronaut.png").read_bytes()[:4096])
    with pytest.raises(CheckpointError, match=r"image.safetensors: not a checkpoint \(a PNG image\)"):
        load_vae(png)
    good = _save_st(tmp_path / "good.safetensors", {"decoder.conv_in.weight": torch.ones(64, 4, 3, 3)})
    data = good.read_bytes()
    for name, cut in (("trunc.safetensors", len(data) // 2), ("trunc2.safetensors", 20), ("trunc3.safetensors", 5)):
        (tmp_path / name).write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=rf"{name}: corrupt or truncated safetensors"):
            load_vae(tmp_path / name)
    torch.save({"a": torch.ones(1000)}, tmp_path / "ok.pt")
    (tmp_path / "trunc.pt").write_bytes((tmp_path / "ok.pt").read_bytes()[:600])
    with pytest.raises(CheckpointError, match="trunc.pt: cannot read torch checkpoint"):
        load_vae(tmp_path / "trunc.pt")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("name", ["evil.pt", "evil.ckpt"])
def test_error_pickle_with_code(name, tmp_path):
    marker = tmp_path / "pwned"
    f = tmp_path / name
    if name.endswith(".pt"):
        torch.save({"state_dict": {"decoder.x": torch.ones(1)}, "hook": _Evil(marker)}, f)
    else:  # legacy (non-zip) pickle
        import pickle

        f.write_bytes(pickle.dumps({"hook": _Evil(marker)}, protocol=2))
    with pytest.raises(CheckpointError, match=rf"{name}: refusing to unpickle arbitrary objects \(weights_only=True\)"):
        load_vae(f)
    assert not marker.exists()


class _TrainerState:  # a training script's own class, pickled into its checkpoint
    pass


@pytest.mark.parametrize("legacy", [False, True])
def test_pickled_checkpoint_numpy_scalars_load(legacy, models, tmp_path):
    """Old SD training checkpoints store a numpy global_step: data, not code. They were refused as 'more than
    tensors'; numpy scalars and dtypes (only those) are now rebuilt, in zip and legacy pickles."""
    import numpy as np

    model, _ = models["taesd"]
    f = tmp_path / "sd_numpy_step.ckpt"
    torch.save({"state_dict": to_taesd_decoder(model.state_dict()), "global_step": np.int64(470000),
                "epoch": np.float64(6.0), "half": np.float16(1), "flag": np.bool_(True), "dtype": np.dtype("float32")},
               f, _use_new_zipfile_serialization=not legacy)
    r = load_vae(f)
    assert r.layout == "taesd-original"
    assert_same_decoder(r, model)


def test_pickled_checkpoint_names_the_refused_class(models, tmp_path, monkeypatch):
    """torch's refusal reached the user as 'Weights only load failed': the class is named, a Lightning one with
    what it means, and how to convert the file."""
    import types

    dec = to_taesd_decoder(models["taesd"][0].state_dict())
    f = tmp_path / "trainer.ckpt"
    torch.save({"state_dict": dec, "trainer": _TrainerState()}, f)
    with pytest.raises(CheckpointError, match=r"trainer.ckpt: refusing to unpickle arbitrary objects \(weights_only="
                                              r"True\): the file holds more than tensors \(it refers to [\w.]*"
                                              r"_TrainerState\); to convert it, load it with torch.load in an "
                                              r"environment you trust and save its state_dict with "
                                              r"safetensors.torch.save_file"):
        load_vae(f)
    import numpy as np

    torch.save({"state_dict": dec, "arr": np.zeros(3)}, f)  # numpy scalars are allowed, not arrays
    with pytest.raises(CheckpointError, match=r"it refers to numpy[\w.]*\._reconstruct"):
        load_vae(f)
    pl = types.ModuleType("pytorch_lightning")
    pl.ModelCheckpoint = type("ModelCheckpoint", (), {"__module__": "pytorch_lightning"})
    monkeypatch.setitem(sys.modules, "pytorch_lightning", pl)
    f = tmp_path / "sd-v1-4-full-ema.ckpt"
    torch.save({"state_dict": dec, "callbacks": {pl.ModelCheckpoint: {"best_model_score": 0.5}}}, f)
    with pytest.raises(CheckpointError, match=r"\(it refers to pytorch_lightning.ModelCheckpoint, a PyTorch Lightning "
                                              r"class: a training checkpoint, .*under 'state_dict'\)"):
        load_vae(f)


def test_error_unknown_checkpoints(tmp_path):
    unet = _save_st(
        tmp_path / "unet.safetensors",
        {"model.diffusion_model.input_blocks.0.0.weight": torch.ones(4, 4, 3, 3),
         "model.diffusion_model.out.2.weight": torch.ones(4, 4, 3, 3)},
    )
    # the other parts of an SD checkpoint, without its VAE: said so, and what to pass instead
    with pytest.raises(CheckpointError, match=r"unet.safetensors: this checkpoint has no VAE weights \(a UNet/text-"
                                              r"encoder checkpoint\? 2 tensors, e\.g\. model\.diffusion_model\..*"
                                              r"\) — pass the VAE file with --model"):
        load_vae(unet)
    te = tmp_path / "text_encoder.pt"
    torch.save({"cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": torch.ones(10, 4)}, te)
    with pytest.raises(CheckpointError, match="text_encoder.pt: this checkpoint has no VAE weights"):
        load_vae(te)
    lora = _save_st(tmp_path / "lora.safetensors", {"lora_unet_down_blocks_0_proj_in.lora_down.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"lora.safetensors: not a recognised VAE checkpoint: found 1 tensors, "
                                              r"e\.g\. lora_unet.*; recognised families: sd15, sd2, sdxl"):
        load_vae(lora)
    enc = {"0.weight": torch.ones(8, 3, 3, 3), "0.bias": torch.ones(8)}
    enc = _save_st(tmp_path / "taesd_encoder.safetensors", enc)
    with pytest.raises(CheckpointError, match="encoder weights only"):
        load_vae(enc)
    with pytest.raises(CheckpointError, match="no tensors"):
        detect({})


def test_error_decoder_mismatch(models, tmp_path):
    model, cfg = models["sd15"]
    base = dict(model.state_dict())
    meta = {"config": json.dumps(cfg)}
    sd = {k: v for k, v in base.items() if k != "decoder.up_blocks.1.resnets.0.conv1.weight"}
    f = _save_st(tmp_path / "missing.safetensors", sd, meta)
    with pytest.raises(CheckpointError, match=r"missing.safetensors: decoder weights do not fit.*missing 1 decoder "
                                              r"tensors: decoder\.up_blocks\.1\.resnets\.0\.conv1\.weight"):
        load_vae(f)
    extra = {**base, "decoder.up_blocks.0.resnets.0.extra.weight": torch.ones(3)}
    f = _save_st(tmp_path / "extra.safetensors", extra, meta)
    with pytest.raises(CheckpointError, match=r"unexpected decoder tensors: decoder\.up_blocks\.0\.resnets\.0\.extra"):
        load_vae(f)
    f = _save_st(tmp_path / "ok.safetensors", base, meta)
    with pytest.raises(CheckpointError, match=r"shape mismatch: decoder\.[a-z_.0-9]+ \[\d+(, \d+)*\] vs expected"):
        load_vae(f, config={"block_out_channels": [32, 32, 64, 128]})
    # an LDM key the converter cannot place is an error too, not silently dropped
    ldm = to_ldm(base)
    ldm["decoder.up.0.upsample.weird.weight"] = torch.ones(2)
    f = _save_st(tmp_path / "ldm_extra.safetensors", ldm, meta)
    with pytest.raises(CheckpointError, match=r"unexpected decoder tensors: decoder\.up\.0\.upsample\.weird"):
        load_vae(f)


# ----------------------------------------------------------------------------------------------------------------------
# the trained sample checkpoints
# ----------------------------------------------------------------------------------------------------------------------


def test_real_tiny_kl_image():
    from diffusers import AutoencoderKL

    f = SAMPLES / "tiny_kl_image.safetensors"
    r = load_vae(f)
    assert (r.family.name, r.layout, r.dtype_on_disk) == ("sd15", "diffusers", torch.float16)
    assert r.family.config["norm_num_groups"] == 16 and r.family.config["scaling_factor"] == 0.30478
    assert "norm_num_groups 16 from the checkpoint's config metadata" in r.notes
    tensors, meta = read_state_dict(f)
    ref = AutoencoderKL(**json.loads(meta["config"])).eval()
    ref.load_state_dict({k: v.float() for k, v in tensors.items()})
    z = torch.load(SAMPLES / "tiny_kl_image_latents.pt", weights_only=True)["astronaut"][:, :, :16, :16].float()
    z = r.family.unscale(z)
    torch.testing.assert_close(decode(r.model, z), decode(ref, z), rtol=0, atol=1e-6)


def test_real_tiny_wan_video(tmp_path):
    from diffusers import AutoencoderKLWan

    tensors, _ = read_state_dict(SAMPLES / "tiny_wan_video.safetensors")
    f = _save_st(tmp_path / "tiny_wan_video.safetensors", tensors)  # no config in the metadata: infer from shapes
    r = load_vae(f)
    assert (r.family.name, r.layout) == ("wan21", "diffusers")
    assert any(n.startswith("widths inferred from shapes: base_dim 16") for n in r.notes), r.notes
    if WAN_SAMPLE_CONFIG.is_file():
        cfg = json.loads(WAN_SAMPLE_CONFIG.read_text())
    else:
        cfg = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                   temperal_downsample=[False, True, True])
    for k in ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample"):
        assert r.family.config[k] == cfg[k], k
    ref = AutoencoderKLWan(**{k: v for k, v in cfg.items() if not k.startswith("_")}).eval()
    ref.load_state_dict({k: v.float() for k, v in tensors.items()})
    z = torch.load(SAMPLES / "tiny_wan_video_latents.pt", weights_only=True)["coffee_zoom"][:, :, :2, :8, :8].float()
    z = r.family.unscale(z)
    torch.testing.assert_close(decode(r.model, z), decode(ref, z), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# regression tests: unusual checkpoints and arguments
# ----------------------------------------------------------------------------------------------------------------------


def test_kl_without_post_quant_conv_is_refused(models, tmp_path):
    """A decoder-only SD export that dropped post_quant_conv decoded garbage (5.8 dB) and said 'wrote'."""
    model, cfg = models["sd15"]
    sd = {k: v for k, v in decoder_tensors(to_ldm(model.state_dict())).items() if not k.startswith("post_quant_conv")}
    f = _save_st(tmp_path / "sd15_vae_dec.safetensors", sd)
    with pytest.raises(CheckpointError, match="no post_quant_conv, which Stable Diffusion 1.x VAEs have"):
        load_vae(f, config={"norm_num_groups": 8})
    r = load_vae(f, config={"norm_num_groups": 8, "use_post_quant_conv": False})  # a VAE that really has none
    assert r.model.post_quant_conv is None
    flux, _ = models["flux"]  # 16-channel families have no post_quant_conv: nothing to refuse
    f2 = _save_st(tmp_path / "ae.safetensors", to_ldm(flux.state_dict()))
    assert load_vae(f2, config={"norm_num_groups": 8}).family.name == "flux"


def test_torch_file_under_a_safetensors_name(models, tmp_path):
    """torch.load picks its safetensors reader by the file name: a torch zip named .safetensors failed with 'header
    too large'."""
    model, cfg = models["sd15"]
    f = tmp_path / "vae.safetensors"
    torch.save(to_ldm(model.state_dict()), f)
    r = load_vae(f, config={"norm_num_groups": 8})
    assert_same_decoder(r, model, latent_for("sd15"))


def test_encoder_only_under_a_prefix_says_so(models, tmp_path):
    model, cfg = models["sd15"]
    sd = {f"first_stage_model.{k}": v for k, v in to_ldm(model.state_dict()).items()
          if k.startswith(("encoder.", "quant_conv."))}
    with pytest.raises(CheckpointError, match="encoder weights only"):
        load_vae(_save_st(tmp_path / "enc.safetensors", sd))


@pytest.mark.parametrize("fam,factor", [("taesd", 0.18215), ("taesdxl", 0.13025)])
def test_tiny_decoder_takes_raw_latents_scaled(fam, factor):
    """TAESD decodes the latents a pipeline hands the UNet; raw latents (ComfyUI .latent) are the big VAE's and are
    scaled as ComfyUI's TAESD does. Scaled latents go in unchanged."""
    from vaeopt.latents import to_raw

    z = latent_for(fam)
    spec = get_family(fam)
    assert torch.equal(to_raw(z, spec, "raw"), z * factor)
    assert torch.equal(to_raw(z, spec, "scaled"), z)


@pytest.mark.parametrize("name,base", [("taesd3_decoder.safetensors", "sd3"), ("taef1_decoder.safetensors", "flux"),
                                       ("tiny16.safetensors", None)])
def test_16_channel_tiny_decoder_raw_latents(name, base, tmp_path):
    from vaeopt.errors import LatentError
    from vaeopt.latents import to_raw

    model = build_model(get_family("taesd"), latent_channels=16, encoder_block_out_channels=[16] * 4,
                        decoder_block_out_channels=[16] * 4)
    r = load_vae(_save_st(tmp_path / name, to_taesd_decoder(model.state_dict())))
    z = torch.randn(1, 16, 8, 8)
    if base is None:
        with pytest.raises(LatentError, match="TAESD3: SD3's, TAEF1: FLUX's"):
            to_raw(z, r.family, "raw")
    else:
        ref = get_family(base).config
        assert torch.allclose(to_raw(z, r.family, "raw"), (z - ref["shift_factor"]) * ref["scaling_factor"])
        assert any(f"scaled as {get_family(base).title}'s" in n for n in r.notes), r.notes
    assert torch.equal(to_raw(z, r.family, "scaled"), z)


def test_real_world_layouts_and_hostile_folders(models, tmp_path):
    """Regression:
    - a Lightning checkpoint whose step count is a tensor ({"state_dict": ..., "global_step": tensor(1000)}) was
      refused ("found 1 tensors, e.g. global_step"): the nested state dict is used;
    - a diffusers folder whose config.json is valid JSON but not an object ([1, 2, 3], null) was decoded with default
      settings, 12.9 dB off, without a word: refused;
    - a shard index naming a file outside its folder ("../other/x.safetensors") was followed: refused."""
    model, _ = models["sd15"]
    sd = {f"first_stage_model.{k}": v for k, v in to_ldm(model.state_dict()).items()}
    torch.save({"state_dict": sd, "global_step": torch.tensor(1000), "epoch": torch.tensor(3)}, tmp_path / "l.ckpt")
    r = load_vae(tmp_path / "l.ckpt", config={"norm_num_groups": 8})
    assert r.family.name == "sd15"
    assert_same_decoder(r, model)

    model.save_pretrained(tmp_path / "dir")
    for bad in ("[1, 2, 3]", "null"):
        (tmp_path / "dir" / "config.json").write_text(bad)
        with pytest.raises(CheckpointError, match=r"config.json: must be a JSON object \(the model's settings\)"):
            load_vae(tmp_path / "dir")

    model.save_pretrained(tmp_path / "sharded", max_shard_size="1MB")
    idx = tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(idx.read_text())
    first = next(iter(data["weight_map"]))
    (tmp_path / "elsewhere").mkdir()
    shard = data["weight_map"][first]
    (tmp_path / "sharded" / shard).rename(tmp_path / "elsewhere" / shard)
    data["weight_map"] = {k: (f"../elsewhere/{v}" if v == shard else v) for k, v in data["weight_map"].items()}
    idx.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"shard '\.\./elsewhere/.*' is outside the model folder"):
        load_vae(tmp_path / "sharded")
    # a Hugging Face cache: every file a symlink into ../blobs/ (it loads: shards are checked by name)
    model.save_pretrained(tmp_path / "snap", max_shard_size="1MB")
    (tmp_path / "blobs").mkdir()
    for f in list((tmp_path / "snap").iterdir()):
        f.rename(tmp_path / "blobs" / f.name)
        f.symlink_to(Path("..") / "blobs" / f.name)
    assert_same_decoder(load_vae(tmp_path / "snap"), model)


def test_safetensors_whose_header_length_looks_like_a_pickle(tmp_path):
    """Regression: a header of 640 bytes makes a safetensors file start 80 02, pickle protocol 2's opening, and
    it was refused as a pickle (a shard of a small save_pretrained hit it). The safetensors header is read first."""
    from vaeopt.loading import sniff

    f = tmp_path / "x.safetensors"
    for pad in range(0, 700):
        save_file({"w": torch.zeros(2)}, str(f), metadata={"p": "x" * pad})
        if f.read_bytes()[:2] == b"\x80\x02":
            break
    else:
        pytest.skip("no padding gave a 640-byte header")
    assert sniff(f) == "safetensors"


def test_weights_file_of_a_diffusers_folder_reads_the_config_beside_it(tmp_path):
    """-m vae/diffusion_pytorch_model.safetensors (an HF download's folder): the settings come from the config.json
    beside it, as loading the folder would (here a non-default scaling_factor and group count, which the weights
    alone do not tell); the decode equals the folder's."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    v = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                      up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8, layers_per_block=1,
                      scaling_factor=0.13025)
    v.save_pretrained(tmp_path / "vae")
    folder = load_vae(tmp_path / "vae")
    file = load_vae(tmp_path / "vae" / "diffusion_pytorch_model.safetensors")
    assert file.model.config.scaling_factor == folder.model.config.scaling_factor == 0.13025
    assert file.model.config.norm_num_groups == 8
    assert any("config.json (the diffusers folder" in n for n in file.notes)
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        assert torch.equal(file.model.decode(z).sample, folder.model.decode(z).sample)


def test_a_given_config_says_which_factor_it_replaced(samples_dir):
    """--config {"scaling_factor": 0.5} over a checkpoint whose metadata says 0.30478: the load used to report the
    metadata's value and then unscale with the config's; now the note names both."""
    from vaeopt.loading import load_vae

    lv = load_vae(samples_dir / "tiny_kl_image.safetensors", config={"scaling_factor": 0.5})
    assert lv.family.config["scaling_factor"] == 0.5
    notes = " | ".join(lv.notes)
    assert "scaling_factor 0.5 from the given config (over 0.30478 in the checkpoint's config metadata)" in notes
    assert "scaling_factor 0.30478 from the checkpoint's config metadata" not in notes


def test_load_vae_arguments_are_checked_before_reading(tmp_path):
    """Regression: dtype=torch.int8 leaked torch's load_state_dict RuntimeError, device='tpu' torch's
    device-string RuntimeError, device='cuda' on a CPU build "AssertionError: Torch not compiled with CUDA enabled",
    and load_vae(123) a pathlib TypeError. One-line VaeoptErrors now, before the checkpoint is read (a missing file
    is not even looked at)."""
    from vaeopt.errors import VaeoptError

    nope = tmp_path / "nope.safetensors"
    cases = [(dict(dtype=torch.int8), "dtype torch.int8: vaeopt decodes in torch.float32, torch.bfloat16 or "
                                      "torch.float16"),
             (dict(dtype=3), "load_vae: dtype must be a torch.dtype or one of fp32, bf16, fp16, got 3"),
             (dict(device="tpu"), "--device tpu: expected cpu, cuda or cuda:N"),
             (dict(device=0.5), "load_vae: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got 0.5")]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), "--device cuda: no CUDA GPU is visible to torch"))
    for kw, msg in cases:
        with pytest.raises(VaeoptError, match=re.escape(msg)):
            load_vae(nope, **kw)
    with pytest.raises(VaeoptError, match=re.escape("load_vae: path must be a checkpoint file or diffusers folder (a "
                                                    "str or Path), got int 123")):
        load_vae(123)
    r = load_vae(SAMPLES / "tiny_kl_image.safetensors", dtype="bf16", device=torch.device("cpu"))
    assert next(r.model.parameters()).dtype == torch.bfloat16


def test_plain_pickle_model_is_named_as_one(tmp_path):
    """Regression: a pickle.dump file given as the model said "(Weights only load failed)", torch's
    boilerplate; the latent reader said what it is. The loader says the same now (and never unpickles it)."""
    import pickle

    marker = tmp_path / "pwned"
    for name, obj in (("sd.pt", {"decoder.conv_in.weight": torch.ones(4, 4, 3, 3)}), ("evil.pt", _Evil(marker))):
        with open(tmp_path / name, "wb") as fh:
            pickle.dump(obj, fh)
        with pytest.raises(CheckpointError, match=re.escape(
                f"{name}: a plain pickle stream (pickle.dump), not a torch.save file: vaeopt does not unpickle")):
            load_vae(tmp_path / name)
    assert not marker.exists()


# ---- hostile configs and paths: one-line CheckpointErrors naming the file, never crashes -------------------------------

@pytest.mark.parametrize("value", [-4, 1.5, True, 0, "x", 10**30, [8]])
def test_config_values_are_checked_against_the_model_class(tmp_path, samples_dir, value):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"norm_num_groups": value}))
    with pytest.raises(CheckpointError, match=r"norm_num_groups .* in the given config is not a whole number") as e:
        load_vae(samples_dir / "tiny_kl_image.safetensors", config=cfg)
    assert str(e.value).startswith(str(samples_dir / "tiny_kl_image.safetensors")) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="is not a whole number"):  # random weights with a config: the same
        load_vae(None, family="sd15", config={"norm_num_groups": value})


def test_config_value_kinds(tmp_path, samples_dir):
    model = samples_dir / "tiny_kl_image.safetensors"
    for bad, why in (({"force_upcast": "yes"}, "true or false"), ({"act_fn": 3}, "text"),
                     ({"block_out_channels": [32, -1]}, "a list of whole number"),
                     ({"scaling_factor": float("nan")}, "finite number")):
        with pytest.raises(CheckpointError, match=why):
            load_vae(model, config=bad)
    load_vae(model, config={"force_upcast": False})  # a right value passes


def test_nested_json_tilde_users_and_fifos(tmp_path, samples_dir, monkeypatch):
    import os

    from vaeopt import api

    model = samples_dir / "tiny_kl_image.safetensors"
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CheckpointError, match="nested more than"):
        load_vae(model, config=tmp_path / "deep.json")
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(CheckpointError, match="not a regular file"):  # (not "not found"; and not read: no hang)
        load_vae(model, config=tmp_path / "fifo.json")
    for call, what in ((lambda: load_vae("~nosuchuser_vaeopt/vae.safetensors"), "checkpoint"),
                       (lambda: load_vae(model, config="~nosuchuser_vaeopt/c.json"), "--config")):
        with pytest.raises(CheckpointError, match="'~nosuchuser_vaeopt' names no user") as e:
            call()
        assert str(e.value).startswith(what)
    monkeypatch.setenv("VAEOPT_MODEL", "~nosuchuser_vaeopt/vae.safetensors")
    with pytest.raises(CheckpointError, match=r"\$VAEOPT_MODEL.*names no user"):
        api.resolve_model(None, [])
    monkeypatch.delenv("VAEOPT_MODEL")
    user = tmp_path / "cfg" / "config.json"
    user.parent.mkdir()
    monkeypatch.setattr(api, "USER_CONFIG", user)
    user.write_text('{"model": ' + "[" * 50000 + "]" * 50000 + "}")
    with pytest.raises(Exception, match="not valid JSON .nested more than") as e:
        api.resolve_model(None, [])
    assert isinstance(e.value, api.VaeoptError)
    user.write_text(json.dumps({"model": "~nosuchuser_vaeopt/v.safetensors"}))
    with pytest.raises(CheckpointError, match="names no user"):
        api.resolve_model(None, [])
