"""The ComfyUI nodes (comfyui_vaeopt/) against a stand-in of ComfyUI's node API: a fake `comfy.model_management`
that records what the node asks of it, and a fake VAE object whose `first_stage_model` holds the bundled samples'
weights under ComfyUI's key names (LDM for the image VAE, the original Wan names for the video VAE). CPU, fast.
The same checks against a real ComfyUI: comfyui_vaeopt/tests/run_in_comfyui.py."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch

import vaeopt
from vaeopt import planner
from vaeopt.fidelity import psnr
from vaeopt.loading import load_vae, load_vae_from_state_dict
from test_loading import to_ldm, to_wan_original

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
sys.path.insert(0, str(ROOT))
from comfyui_vaeopt import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, bridge  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------------
# the stand-in
# ----------------------------------------------------------------------------------------------------------------------


class FakeModelManagement(types.ModuleType):
    OOM_EXCEPTION = torch.cuda.OutOfMemoryError

    def __init__(self):
        super().__init__("comfy.model_management")
        self.calls = []

    def load_models_gpu(self, models, memory_required=0, force_patch_weights=False, minimum_memory_required=None,
                        force_full_load=False):
        self.calls.append({"models": models, "memory_required": memory_required, "force_full_load": force_full_load})

    def get_free_memory(self, dev=None, torch_free_too=False):
        return 8 * 2**30

    def soft_empty_cache(self, force=False):
        pass


class CallbacksMP:
    ON_DETACH = "on_detach_after"


class FakePatcher:
    """ComfyUI's ModelPatcher, as far as the node uses it: keyed callbacks."""

    def __init__(self):
        self.callbacks = {}

    def add_callback_with_key(self, call_type, key, fn):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(fn)

    def remove_callbacks_with_key(self, call_type, key):
        self.callbacks.get(call_type, {}).pop(key, None)

    def detach(self):
        for fns in self.callbacks.get(CallbacksMP.ON_DETACH, {}).values():
            for fn in fns:
                fn(self, True)


@pytest.fixture
def mm(monkeypatch):
    fake = FakeModelManagement()
    comfy = types.ModuleType("comfy")
    comfy.__path__ = []
    comfy.model_management = fake
    ext = types.ModuleType("comfy.patcher_extension")
    ext.CallbacksMP = CallbacksMP
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", fake)
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", ext)
    return fake


def module_tree(sd: dict[str, torch.Tensor], groups: int | None = None) -> torch.nn.Module:
    """A module whose state_dict() is `sd` under its own (dotted) names, as ComfyUI's first_stage_model holds its
    weights; its norms are GroupNorms with ComfyUI's group count where `groups` is given."""
    root = torch.nn.Module()
    for key, t in sd.items():
        path, _, attr = key.rpartition(".")
        m = root
        for i, part in enumerate(path.split(".")):
            if not hasattr(m, part):
                leaf = i == len(path.split(".")) - 1
                is_norm = groups and leaf and "norm" in part and t.ndim == 1
                m.add_module(part, torch.nn.GroupNorm(groups, t.shape[0]) if is_norm else torch.nn.Module())
            m = getattr(m, part)
        if isinstance(m, torch.nn.GroupNorm):
            setattr(m, attr, torch.nn.Parameter(t, requires_grad=False))
        else:
            m.register_parameter(attr, torch.nn.Parameter(t, requires_grad=False))
    return root


class FakeVAE:
    """comfy.sd.VAE as the nodes use it."""

    def __init__(self, first_stage_model, decode=None):
        self.first_stage_model = first_stage_model
        self.patcher = FakePatcher()
        self.device = torch.device("cpu")
        self.vae_dtype = torch.float32
        self.output_device = torch.device("cpu")
        self._decode = decode

    def process_output(self, image):
        return torch.clamp((image + 1.0) / 2.0, min=0.0, max=1.0)

    def decode(self, samples):
        if self._decode is None:
            raise AssertionError("ComfyUI's own decode was called")
        return self._decode(samples)


@pytest.fixture(scope="module")
def kl():
    ref = load_vae(SAMPLES / "tiny_kl_image.safetensors")
    z = torch.load(SAMPLES / "tiny_kl_image_latents.pt", weights_only=True)["coffee"][..., :24, :32]
    return ref, ref.family.unscale(z)  # ComfyUI's LATENT holds raw latents


@pytest.fixture(scope="module")
def wan():
    ref = load_vae(SAMPLES / "tiny_wan_video.safetensors")
    z = torch.load(SAMPLES / "tiny_wan_video_latents.pt", weights_only=True)["coffee_zoom"][:, :, :3, :16, :16]
    return ref, ref.family.unscale(z)


def kl_vae(ref, **kw) -> FakeVAE:
    # the sample was trained with 16 groups; ComfyUI's module says so through its GroupNorms
    return FakeVAE(module_tree(to_ldm(ref.model.state_dict()), groups=16), **kw)


def expected(ref, z_raw: torch.Tensor) -> torch.Tensor:
    """vaeopt.decode of the same raw latents, in ComfyUI's IMAGE convention."""
    x = vaeopt.decode(z_raw, load_vae(ref.path), latent_space="raw")
    img = ((x + 1) / 2).clamp(0, 1).movedim(1, -1)
    return img.reshape(-1, *img.shape[-3:])


def ptrs(module: torch.nn.Module) -> set[int]:
    return {p.data_ptr() for p in module.parameters()}


# ----------------------------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------------------------


def test_mappings():
    assert set(NODE_CLASS_MAPPINGS) == set(NODE_DISPLAY_NAME_MAPPINGS)
    assert NODE_DISPLAY_NAME_MAPPINGS["VAEDecodeVaeopt"] == "VAE Decode (vaeopt)"
    assert NODE_DISPLAY_NAME_MAPPINGS["VAEDecodeVideoVaeopt"] == "VAE Decode Video (vaeopt)"
    for cls in NODE_CLASS_MAPPINGS.values():
        types_ = cls.INPUT_TYPES()
        assert types_["required"]["samples"][0] == "LATENT" and types_["required"]["vae"][0] == "VAE"
        assert cls.RETURN_TYPES == ("IMAGE",) and callable(getattr(cls, cls.FUNCTION))
        assert types_["optional"]["fp8"][1]["default"] is False


@pytest.mark.parametrize("which", ["ldm", "wan-original"])
def test_state_dict_is_shared_not_copied(which, kl, wan):
    ref = kl[0] if which == "ldm" else wan[0]
    sd = (to_ldm if which == "ldm" else to_wan_original)(ref.model.state_dict())
    loaded = load_vae_from_state_dict(sd, config={"norm_num_groups": 16} if which == "ldm" else None)
    assert loaded.layout == f"{which} (state dict)"
    assert ptrs(loaded.model) <= {v.data_ptr() for v in sd.values()}  # every parameter is one of the given tensors
    assert next(loaded.model.parameters()).device.type == "cpu"
    z = torch.randn(1, ref.family.latent_channels, *((2, 8, 8) if ref.family.is_video else (8, 8)))
    with torch.no_grad():
        assert torch.equal(loaded.model.decode(z).sample, ref.model.decode(z).sample)


def test_image_node(mm, kl):
    ref, z = kl
    vae = kl_vae(ref)
    node = NODE_CLASS_MAPPINGS["VAEDecodeVaeopt"]()
    (img,) = node.decode({"samples": z}, vae)
    n, _, h, w = z.shape
    assert img.shape == (n, h * 8, w * 8, 3) and img.dtype == torch.float32  # channels last, as IMAGE
    assert img.min() >= 0 and img.max() <= 1 and img.std() > 0.05
    assert psnr(img, expected(ref, z), data_range=1.0) >= 60
    # ComfyUI's weights are vaeopt's: no second copy
    entry = bridge.entry_for(vae)
    assert ptrs(vae.first_stage_model) <= ptrs(entry.loaded.model)
    # the memory ComfyUI was asked to free: the planner's estimate of this decode, less the weights it loads itself
    (call,) = mm.calls
    assert call["models"] == [vae.patcher] and call["force_full_load"] is True
    fresh = load_vae_from_state_dict(to_ldm(ref.model.state_dict()), config={"norm_num_groups": 16})
    want = planner.estimate_whole(ref.family, fresh.model, tuple(z.shape), torch.float32) \
        - bridge.weights_bytes(fresh.model)
    assert call["memory_required"] == want > 0


def test_tiled_under_budget_is_exact(mm, kl):
    ref, z = kl
    vae = kl_vae(ref)
    whole = planner.estimate_whole(ref.family, ref.model, tuple(z.shape), torch.float32)
    budget_gb = whole / 3 / 2**30
    (img,) = NODE_CLASS_MAPPINGS["VAEDecodeVaeopt"]().decode({"samples": z}, vae, vram_budget_gb=budget_gb)
    assert psnr(img, expected(ref, z), data_range=1.0) >= 60  # tiles stitched exactly
    entry = bridge.entry_for(vae)
    assert entry.pipe.plan(tuple(z.shape)).mode == "tiled"
    (call,) = mm.calls
    assert 0 < call["memory_required"] < whole - bridge.weights_bytes(entry.loaded.model)


def test_video_node(mm, wan):
    ref, z = wan
    vae = FakeVAE(module_tree(to_wan_original(ref.model.state_dict())))
    (img,) = NODE_CLASS_MAPPINGS["VAEDecodeVideoVaeopt"]().decode({"samples": z}, vae, chunk=1)
    n, _, t, h, w = z.shape
    assert img.shape == (n * (1 + 4 * (t - 1)), h * 8, w * 8, 3)  # frames in the batch, as VAEDecode
    assert img.min() >= 0 and img.max() <= 1
    assert psnr(img, expected(ref, z), data_range=1.0) >= 60
    assert ptrs(vae.first_stage_model) <= ptrs(bridge.entry_for(vae).loaded.model)
    assert len(mm.calls) == 1 and mm.calls[0]["memory_required"] > 0


def test_follows_comfy_moving_weights(mm, kl):
    ref, z = kl
    z = z[..., :16, :16]
    vae = kl_vae(ref)
    node = NODE_CLASS_MAPPINGS["VAEDecodeVaeopt"]()
    (first,) = node.decode({"samples": z}, vae)
    model = bridge.entry_for(vae).loaded.model
    # ComfyUI offloads the VAE (its ModelPatcher moves the weights: new tensors) and the detach callback fires
    old = ptrs(model)
    for p in vae.first_stage_model.parameters():
        p.data = p.data.clone()
    vae.patcher.detach()
    assert ptrs(model) == ptrs(vae.first_stage_model) and not (ptrs(model) & old)  # nothing of ours holds the old
    # ... and loads it again before the next decode: new tensors once more, which the node follows
    for p in vae.first_stage_model.parameters():
        p.data = p.data.clone()
    (second,) = node.decode({"samples": z}, vae)
    assert bridge.entry_for(vae).loaded.model is model  # refreshed, not rebuilt
    assert ptrs(model) == ptrs(vae.first_stage_model)
    assert torch.equal(first, second)


def test_fallback_for_unknown_vae(mm, caplog):
    audio = torch.nn.Module()
    audio.decoder = torch.nn.Conv1d(8, 2, 3)  # e.g. an audio VAE: vaeopt knows no such layout
    out = torch.rand(1, 2, 100)
    vae = FakeVAE(audio, decode=lambda s: out)
    with caplog.at_level(logging.WARNING, logger="vaeopt.comfyui"):
        (img,) = NODE_CLASS_MAPPINGS["VAEDecodeVaeopt"]().decode({"samples": torch.randn(1, 8, 25)}, vae)
    assert img is out
    assert "using ComfyUI's VAE decode: vaeopt does not know this VAE's weights" in caplog.text
    assert mm.calls == []  # ComfyUI's decode asks its memory manager itself


def test_fallback_for_wrong_latent_rank(mm, wan, caplog):
    ref, z = wan
    vae = FakeVAE(module_tree(to_wan_original(ref.model.state_dict())), decode=lambda s: torch.zeros(1, 8, 8, 3))
    with caplog.at_level(logging.WARNING, logger="vaeopt.comfyui"):
        (img,) = NODE_CLASS_MAPPINGS["VAEDecodeVaeopt"]().decode({"samples": z[:, :, 0]}, vae)
    assert img.shape == (1, 8, 8, 3) and "takes 5-D latents" in caplog.text


def test_rebuilt_for_other_model_options_still_shares(mm, kl):
    """fp8 changes the model in place, so switching it rebuilds from ComfyUI's weights, which the first build had
    re-laid out (channels_last on the CPU too): the new model must take those same tensors again."""
    ref, z = kl
    z = z[..., :8, :8]
    vae = kl_vae(ref)
    node = NODE_CLASS_MAPPINGS["VAEDecodeVaeopt"]()
    node.decode({"samples": z}, vae)
    first = bridge.entry_for(vae)
    relaid = sum(not p.is_contiguous() for p in vae.first_stage_model.parameters())
    (img,) = node.decode({"samples": z}, vae, fp8=True)
    second = bridge.entry_for(vae)
    assert second is not first and second.loaded.model is not first.loaded.model
    n = sum(1 for _ in vae.first_stage_model.parameters())
    assert len(second.pairs) == n  # every ComfyUI weight is tracked by the new model (none copied at the build)
    assert relaid == 0 or any(not p.is_contiguous() for p in vae.first_stage_model.parameters())
    assert psnr(img, expected(ref, z), data_range=1.0) >= 30


def test_fallback_on_other_devices(mm, kl, caplog):
    ref, z = kl
    vae = kl_vae(ref, decode=lambda s: torch.zeros(1, 8, 8, 3))
    vae.device = torch.device("mps")  # ComfyUI on a Mac: vaeopt's stages are for CUDA and the CPU
    with caplog.at_level(logging.WARNING, logger="vaeopt.comfyui"):
        (img,) = NODE_CLASS_MAPPINGS["VAEDecodeVaeopt"]().decode({"samples": z}, vae)
    assert img.shape == (1, 8, 8, 3) and "not on mps" in caplog.text and mm.calls == []
