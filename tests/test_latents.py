"""Latent files: every format, scaled vs raw, validation errors."""

import json
import re
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vaeopt import latents as lat
from vaeopt.errors import LatentError
from vaeopt.families import get_family

SDXL = get_family("sdxl")
FLUX = get_family("flux")
WAN = get_family("wan21")


def test_pt_tensor_and_dict(tmp_path):
    t = torch.randn(1, 4, 8, 8)
    torch.save(t, tmp_path / "a.pt")
    lf = lat.read_latents(tmp_path / "a.pt")
    assert lf.format == "pt" and lf.default_space == "scaled"
    assert torch.equal(lf.entries[0].tensor, t)
    torch.save({"x": t, "y": {"z": t * 2}}, tmp_path / "b.pth")
    lf = lat.read_latents(tmp_path / "b.pth")
    assert [e.name for e in lf.entries] == ["x", "y.z"]
    assert torch.equal(lat.read_latents(tmp_path / "b.pth", key="y.z").entries[0].tensor, t * 2)
    with pytest.raises(LatentError, match="no tensor named 'nope'"):
        lat.read_latents(tmp_path / "b.pth", key="nope")


def test_numpy_scalars_beside_the_latents(tmp_path):
    t = torch.randn(1, 4, 8, 8)
    torch.save({"latents": t, "seed": np.int64(42), "guidance": np.float32(7.5)}, tmp_path / "a.pt")
    lf = lat.read_latents(tmp_path / "a.pt")
    assert [e.name for e in lf.entries] == ["latents"] and torch.equal(lf.entries[0].tensor, t)


def test_cuda_saved_file_loads_on_cpu(samples_dir):
    # saved from a CUDA device; must load with map_location="cpu"
    lf = lat.read_latents(samples_dir / "wan21_real_latents.pth")
    t = lf.entries[0].tensor
    assert t.device.type == "cpu" and t.shape == (1, 16, 16, 40, 64) and t.dtype == torch.bfloat16
    z = lat.validate(lf.entries[0], WAN, lf.path)
    assert z.shape == (1, 16, 16, 40, 64)


def test_safetensors_and_metadata_space(tmp_path):
    t = torch.randn(2, 4, 8, 8)
    lat.save_latents(tmp_path / "l.safetensors", {"latents": t}, latent_space="raw")
    lf = lat.read_latents(tmp_path / "l.safetensors")
    assert lf.format == "safetensors" and lf.default_space == "raw"
    assert torch.equal(lf.entries[0].tensor, t)


def test_comfyui_latent_is_raw(tmp_path):
    t = torch.randn(1, 4, 8, 8)
    save_file({"latent_tensor": t, "latent_format_version_0": torch.tensor([])}, str(tmp_path / "x.latent"))
    lf = lat.read_latents(tmp_path / "x.latent")
    assert lf.format == "comfyui-latent" and lf.default_space == "raw"
    assert torch.equal(lf.entries[0].tensor, t)
    # legacy ComfyUI files (no version marker) stored latents * 0.18215
    save_file({"latent_tensor": t}, str(tmp_path / "old.latent"))
    lf = lat.read_latents(tmp_path / "old.latent")
    assert torch.allclose(lf.entries[0].tensor, t / 0.18215)
    assert "legacy" in lf.notes[0]


def test_npy(tmp_path):
    a = np.random.randn(1, 16, 8, 8).astype("float32")
    np.save(tmp_path / "x.npy", a)
    lf = lat.read_latents(tmp_path / "x.npy")
    assert torch.equal(lf.entries[0].tensor, torch.from_numpy(a))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(LatentError, match="pickled"):
        lat.read_latents(tmp_path / "obj.npy")


def test_scaling_matches_diffusers_pipelines():
    z = torch.randn(1, 4, 8, 8)
    assert torch.allclose(lat.to_raw(z, SDXL, "scaled"), z / 0.13025)
    z16 = torch.randn(1, 16, 8, 8)
    assert torch.allclose(lat.to_raw(z16, FLUX, "scaled"), z16 / 0.3611 + 0.1159)
    zw = torch.randn(1, 16, 3, 8, 8)
    mean = torch.tensor(WAN.config["latents_mean"]).view(1, 16, 1, 1, 1)
    std = torch.tensor(WAN.config["latents_std"]).view(1, 16, 1, 1, 1)
    # WanPipeline: latents / (1 / std) + mean
    assert torch.allclose(lat.to_raw(zw, WAN, "scaled"), zw / (1.0 / std) + mean, atol=1e-6)
    assert torch.equal(lat.to_raw(zw, WAN, "raw"), zw)
    for fam, t in ((SDXL, z), (FLUX, z16), (WAN, zw)):
        assert torch.allclose(fam.scale(fam.unscale(t)), t, atol=1e-5)


@pytest.mark.parametrize("tensor,fam,match", [
    (torch.randn(1, 16, 8, 8), SDXL, "16 latent channels, but the Stable Diffusion XL VAE takes 4"),
    (torch.randn(1, 8, 8, 4), SDXL, "channels look last"),
    (torch.randn(2, 1, 4, 8, 8), SDXL, "expected \\(N,C,H,W\\) image"),
    (torch.randn(16, 3, 8, 8), WAN, None),  # 4-D for video: (C,T,H,W)
    (torch.randn(2, 16, 8, 8), WAN, None),  # 4-D for video: (N,C,H,W) single latent frames
    # (16,16,H,W) for a 16-channel video VAE: a 16-frame clip or 16 one-frame latents; refused, not guessed
    (torch.randn(16, 16, 8, 8), WAN, r"reads two ways.*one clip of 16 latent frames.*16 one-frame latents.*"
                                     r"\(1, 16, 16, H, W\) or \(16, 16, 1, H, W\)"),
    (torch.randn(2, 4, 3, 8, 8), SDXL, r"is 3 latent frames \(N,C,T,H,W\), but Stable Diffusion XL is an image VAE"),
    (torch.zeros(1, 4, 8, 8, dtype=torch.int64), SDXL, "floating point"),
    (torch.randn(1, 4, 0, 8), SDXL, "empty"),
    (torch.randn(1, 128, 0, 8), get_family("flux2"), "empty"),  # FLUX.2's patchified layout too
    (torch.randn(1, 4, 4096, 4096), SDXL, "beyond what vaeopt decodes"),
])
def test_validation_errors(tensor, fam, match, tmp_path):
    e = lat.LatentEntry("x", tensor)
    if match is None:
        assert lat.validate(e, fam, tmp_path / "f.pt").ndim == 5
        return
    with pytest.raises(LatentError, match=match):
        lat.validate(e, fam, tmp_path / "f.pt")


def test_packed_flux_latents_are_refused_not_guessed(tmp_path):
    """FluxPipeline(output_type="latent") returns (B, seq, 64): the image size is not in them (1152x512 packs to a
    square 48*48 sequence), so they are refused with how to unpack them, never reshaped by a guess."""
    for shape in ((1, 48 * 48, 64), (2, 256, 64), (256, 64), (16, 4096, 64), (16, 1024, 64)):  # a batch of 16 too
        with pytest.raises(LatentError, match=r"looks like packed FLUX latents.*image size is not stored.*"
                                              r"pipe\._unpack_latents\(latents, height, width, pipe\.vae_scale_factor\)"
                                              r" and save that \(B, 16, H/8, W/8\) tensor"):
            lat.validate(lat.LatentEntry("", torch.randn(shape)), FLUX, tmp_path / "f.pt")
    # an unbatched (C, H, W) latent 64 wide is not packed (nor a 4:1 one)
    assert lat.validate(lat.LatentEntry("", torch.randn(16, 8, 64)), FLUX, tmp_path / "f.pt").shape == (1, 16, 8, 64)
    assert lat.validate(lat.LatentEntry("", torch.randn(16, 256, 64)), FLUX, tmp_path / "f.pt").shape[2:] == (256, 64)
    with pytest.raises(LatentError, match=r"one \(C,H,W\) latent with 4 channels"):  # others: not FLUX's packing
        lat.validate(lat.LatentEntry("", torch.randn(1, 8, 16)), SDXL, tmp_path / "f.pt")


def test_packed_flux_latents_unpack_with_the_image_size(tmp_path):
    """Given the image size (--height/--width, or the file's metadata), packed FLUX latents are unpacked exactly as
    FluxPipeline does before vae.decode: its own _pack_latents undone, a non-square image of a square token count
    (1152x512: 48*48 tokens) too; a size that does not fit the tokens is refused."""
    from diffusers import FluxPipeline

    from vaeopt.server.protocol import unpack

    for b, hgt, wid in ((1, 1152, 512), (2, 256, 384)):
        z = torch.randn(b, 16, hgt // 8, wid // 8)
        packed = FluxPipeline._pack_latents(z, b, 16, hgt // 8, wid // 8)
        got = lat.validate(lat.LatentEntry("", packed, size=(hgt, wid)), FLUX, tmp_path / "f.pt")
        assert torch.equal(got, z), (b, hgt, wid)
        assert torch.equal(got, unpack(packed, hgt, wid, 8))  # as `vaeopt serve` unpacks them
    with pytest.raises(LatentError, match=r"2304 packed tokens do not fit a 1024x1024 image"):
        lat.validate(lat.LatentEntry("", packed_sq := torch.randn(1, 48 * 48, 64), size=(1024, 1024)), FLUX,
                     tmp_path / "f.pt")
    assert packed_sq.shape == (1, 2304, 64)


def test_channel_layout_hints_only_when_they_fit(tmp_path):
    """'channels look last' was said of a (1,4,16,16) SD latent given to a 16-channel VAE (its last dim is 16 by
    chance); it is said only when the last dim is the channel count and smaller than the others. Video latents
    stored (N,T,C,H,W) are told the order to use."""
    def msg(t, fam):
        with pytest.raises(LatentError) as e:
            lat.validate(lat.LatentEntry("", t), fam, tmp_path / "f.pt")
        return str(e.value)

    assert "channels look last" not in msg(torch.randn(1, 4, 16, 16), FLUX)
    assert "channels look last" not in msg(torch.randn(1, 4, 16, 16), WAN)
    assert "channels look last" in msg(torch.randn(1, 32, 32, 16), FLUX)
    assert msg(torch.randn(1, 3, 16, 8, 8), WAN).endswith("takes 16 (looks like (N,T,C,H,W): save video latents as "
                                                          "(N,C,T,H,W))")


def test_nan_and_inf_named(tmp_path):
    t = torch.randn(1, 4, 8, 8)
    t[0, 0, 0, :3] = float("nan")
    t[0, 1, 0, 0] = float("inf")
    with pytest.raises(LatentError, match=r"f.pt \[x\]: 4 non-finite values \(3 NaN, 1 Inf\)"):
        lat.validate(lat.LatentEntry("x", t), SDXL, tmp_path / "f.pt")
    one = torch.randn(1, 4, 8, 8)
    one[0, 0, 0, 0] = float("nan")  # one bad value: said in the singular
    with pytest.raises(LatentError, match=r"f.pt \[x\]: 1 non-finite value \(1 NaN, 0 Inf\) in"):
        lat.validate(lat.LatentEntry("x", one), SDXL, tmp_path / "f.pt")


def test_bad_files(tmp_path):
    with pytest.raises(LatentError, match="no such file"):
        lat.read_latents(tmp_path / "missing.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(LatentError, match="empty"):
        lat.read_latents(tmp_path / "empty.pt")
    (tmp_path / "junk.safetensors").write_bytes(b"\x89PNG not a safetensors file at all")
    with pytest.raises(LatentError, match="corrupt or truncated"):
        lat.read_latents(tmp_path / "junk.safetensors")
    good = tmp_path / "good.safetensors"
    save_file({"x": torch.randn(1, 4, 32, 32)}, str(good))
    (tmp_path / "trunc.safetensors").write_bytes(good.read_bytes()[:-100])
    with pytest.raises(LatentError, match="corrupt or truncated"):
        lat.read_latents(tmp_path / "trunc.safetensors")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(LatentError, match="unknown latent format"):
        lat.read_latents(tmp_path / "x.txt")


class Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /tmp/vaeopt_pwned",))


def test_pickle_that_runs_code_is_refused(tmp_path, recwarn):
    import os
    import pickle

    p = tmp_path / "evil.pt"
    torch.save({"latents": torch.randn(1, 4, 8, 8), "x": Evil()}, p)
    if os.path.exists("/tmp/vaeopt_pwned"):
        os.remove("/tmp/vaeopt_pwned")
    with pytest.raises(LatentError, match="refusing to unpickle"):
        lat.read_latents(p)
    assert not os.path.exists("/tmp/vaeopt_pwned")
    # a raw pickle (not a torch zip file) too
    p2 = tmp_path / "evil2.pt"
    p2.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(LatentError):
        lat.read_latents(p2)
    assert not os.path.exists("/tmp/vaeopt_pwned")
    # torch's "Detected pickle protocol" warning is not printed before our one-line error
    assert not [w for w in recwarn.list if "pickle" in str(w.message)], [str(w.message) for w in recwarn.list]


def test_pickled_pipeline_output_named_with_what_to_save(tmp_path, monkeypatch):
    """torch.save(pipe(..., output_type="latent")) pickles the output object: the message was cut at 160 characters
    ('...was not an allowed global '). The class is named in full and the user told to save the tensor itself."""
    import types

    mod = types.ModuleType("diffusers.pipelines.vaeopt_test_output")  # stands in for diffusers' own output module
    mod.StableDiffusionPipelineOutput = type("StableDiffusionPipelineOutput", (), {"__module__": mod.__name__})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    for parent in ("diffusers", "diffusers.pipelines"):  # pickling imports the parents: not seconds of diffusers
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    out = mod.StableDiffusionPipelineOutput()
    out.images = torch.randn(1, 4, 8, 8)
    torch.save(out, tmp_path / "out.pt")
    with pytest.raises(LatentError, match=r"out.pt: refusing to unpickle arbitrary objects \(loaded with weights_only="
                                          r"True\): it refers to diffusers\.pipelines\.vaeopt_test_output\."
                                          r"StableDiffusionPipelineOutput, which is not a tensor; .*save the tensor "
                                          r"itself, e\.g\. torch\.save\(out\.images, path\) for a pipeline called "
                                          r"with output_type=\"latent\""):
        lat.read_latents(tmp_path / "out.pt")


def test_manifest_hints(samples_dir):
    lf = lat.read_latents(samples_dir / "tiny_wan_video_latents.pt")
    assert lf.default_space == "raw"
    assert lf.manifest["model"].endswith("tiny_wan_video.safetensors")


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 in this torch")
def test_empty_tensors_in_safetensors_are_said_as_in_a_pt_dict(tmp_path):
    """A .safetensors holding an empty latent is refused in the words a .pt gives ("empty latent tensor"), not as
    "contains no tensors"; --key finds an empty tensor by its name; an empty mask beside a latent stays a non-latent."""
    from vaeopt import api

    save_file({"latent": torch.empty(0, 4, 8, 8)}, str(tmp_path / "e.safetensors"))
    f = lat.read_latents(tmp_path / "e.safetensors")
    assert [e.name for e in f.entries] == ["latent"]
    with pytest.raises(LatentError, match=r"e.safetensors \[latent\]: empty latent tensor \(0, 4, 8, 8\)"):
        api.check_latents_early([f], None)
    save_file({"z": torch.randn(1, 4, 8, 8), "mask": torch.empty(0, 1, 8, 8)}, str(tmp_path / "m.safetensors"))
    assert [e.name for e in lat.read_latents(tmp_path / "m.safetensors", key="mask").entries] == ["mask"]
    both = lat.read_latents(tmp_path / "m.safetensors")
    assert sorted(e.name for e in both.entries) == ["mask", "z"]
    with pytest.raises(LatentError):  # a one-channel empty tensor is no SDXL latent: not decoded as one
        lat.validate(next(e for e in both.entries if e.name == "mask"), SDXL, tmp_path / "m.safetensors",
                     values=False)


def test_float8_latents_are_upcast(tmp_path):
    t = torch.randn(1, 4, 8, 8).to(torch.float8_e4m3fn)
    z = lat.validate(lat.LatentEntry("", t), SDXL, tmp_path / "f.pt")
    assert z.dtype == torch.float32 and torch.equal(z, t.float())


def test_dict_with_non_latent_tensors_keeps_the_latents(tmp_path):
    """A dict with extra small tensors (an index vector, a scalar): the latents are decoded and the skipped tensors
    are named in a note, instead of failing on the first one that cannot be latents."""
    p = tmp_path / "d.pt"
    torch.save({"z": torch.randn(2, 4, 8, 8), "batch_index": torch.arange(2), "scale": torch.tensor(1.0)}, p)
    lf = lat.read_latents(p)
    assert [e.name for e in lf.entries] == ["z"] and lf.default_space == "scaled"
    assert any("skipped 2 tensor(s)" in n and "batch_index (2,)" in n for n in lf.notes), lf.notes
    only_small = tmp_path / "small.pt"
    torch.save({"a": torch.arange(3)}, only_small)
    assert [e.name for e in lat.read_latents(only_small).entries] == ["a"]  # nothing else: validate() says why


def test_comfyui_latent_dict_is_raw_and_only_samples_decode(tmp_path):
    """torch.save of a ComfyUI LATENT ({"samples": raw VAE latents, "noise_mask": (N,1,H,W), "batch_index"}): raw by
    default (ComfyUI never scales them), only 'samples' decoded -- a 4-D 1-channel mask used to fail validation --
    with a note naming what was left out; --key and --latent-space still override."""
    p = tmp_path / "comfy.pt"
    z = torch.randn(2, 4, 8, 8)
    torch.save({"samples": z, "noise_mask": torch.ones(2, 1, 8, 8), "batch_index": [0, 1]}, p)
    lf = lat.read_latents(p)
    assert [e.name for e in lf.entries] == ["samples"] and torch.equal(lf.entries[0].tensor, z)
    assert lf.default_space == "raw" and lf.format == "comfyui-dict"
    assert any("ComfyUI LATENT" in n and "noise_mask" in n for n in lf.notes), lf.notes
    assert [e.name for e in lat.read_latents(p, key="noise_mask").entries] == ["noise_mask"]


# regression tests: hostile inputs

def test_hostile_latent_files_get_true_messages(tmp_path):
    import gzip
    import os

    import numpy as np

    np.save(tmp_path / "ok.npy", np.zeros((1, 4, 8, 8), dtype=np.float32))
    full = (tmp_path / "ok.npy").read_bytes()
    (tmp_path / "trunc.npy").write_bytes(full[: len(full) // 2])
    (tmp_path / "rand.npy").write_bytes(os.urandom(300))
    np.save(tmp_path / "c.npy", np.zeros((1, 4, 8, 8), dtype=complex))
    hdr = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4, 1000000, 1000000), }"
    hdr += b" " * (118 - len(hdr)) + b"\n"
    (tmp_path / "huge.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(hdr).to_bytes(2, "little") + hdr)
    (tmp_path / "g.pt").write_bytes(gzip.compress(b"x" * 100))
    (tmp_path / "t.pt").write_text("just text\n")
    os.mkfifo(tmp_path / "fifo.pt")
    (tmp_path / "loop.pt").symlink_to(tmp_path / "loop.pt")
    cases = {"trunc.npy": "more than the file holds", "rand.npy": "not a readable .npy file",
             "c.npy": "must be real floating point", "huge.npy": "more than the file holds",
             "g.pt": "not a readable torch file (a gzip archive)",
             "t.pt": "not a readable torch file: a text file, not a tensor file (it starts 'just text')",
             "fifo.pt": "not a regular file", "loop.pt": "a broken or looping symlink"}
    for name, expect in cases.items():
        with pytest.raises(lat.LatentError, match=re.escape(expect)):
            lat.read_latents(tmp_path / name)
    assert lat.read_latents(tmp_path / "ok.npy").entries[0].tensor.shape == (1, 4, 8, 8)


def test_deep_and_self_holding_pt_files_are_refused(tmp_path):
    """Regression: 300 nested dicts, or a 40-byte list inside itself, crashed the reader with a
    RecursionError ("this is a vaeopt bug"). Refused with the path of keys; ordinary nesting still reads in order."""
    d = torch.randn(1, 4, 8, 8)
    for _ in range(300):
        d = {"k": d}
    torch.save(d, tmp_path / "deep.pt")
    with pytest.raises(LatentError, match=r"deep.pt: nested more than 16 levels deep at k\.k\.k"):
        lat.read_latents(tmp_path / "deep.pt")
    y = []
    y.append(y)
    torch.save(y, tmp_path / "cyc.pt")
    with pytest.raises(LatentError, match=r"cyc.pt: 0 holds itself"):
        lat.read_latents(tmp_path / "cyc.pt")
    a, b = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    size = (1024, 1024)  # pickle writes a shared tuple once: met twice, not a cycle
    torch.save({"x": {"y": [a, b]}, "z": (a,), "original_size": size, "target_size": size}, tmp_path / "ok.pt")
    f = lat.read_latents(tmp_path / "ok.pt")
    assert [e.name for e in f.entries] == ["x.y.0", "x.y.1", "z.0"]


def test_one_frame_5d_latents_decode_as_images(tmp_path):
    """(N, C, 1, H, W) for an image VAE, as video-style pipelines hand out image latents: the frame axis is dropped."""
    t = torch.randn(2, 4, 1, 8, 6)
    v = lat.validate(lat.LatentEntry("x", t), SDXL, tmp_path / "f.pt")
    assert v.shape == (2, 4, 8, 6) and torch.equal(v, t[:, :, 0])


def test_npz(tmp_path):
    """numpy.savez / savez_compressed: every float array is an entry by name (dtype kept), non-float arrays (a seed)
    are skipped with a note; pickled object arrays, corrupt zips and truncated members are refused clearly."""
    import zipfile

    a = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float16)
    np.savez_compressed(tmp_path / "x.npz", latents=a, seed=np.array([7]), cond=np.zeros((1, 77, 8), np.float32))
    lf = lat.read_latents(tmp_path / "x.npz")
    assert lf.format == "npz" and lf.default_space == "scaled"
    names = {e.name: e.tensor for e in lf.entries}
    assert set(names) == {"latents", "cond"} and names["latents"].dtype == torch.float16
    assert torch.equal(names["latents"], torch.from_numpy(a))
    assert any("skipped non-float arrays: seed" in n for n in lf.notes)
    assert lat.read_latents(tmp_path / "x.npz", key="latents").entries[0].name == "latents"

    np.savez(tmp_path / "only_int.npz", idx=np.arange(4))
    with pytest.raises(LatentError, match=r"only_int.npz \[idx\]: latents must be real floating point"):
        lat.read_latents(tmp_path / "only_int.npz")
    np.savez(tmp_path / "obj.npz", o=np.array([{"a": 1}], dtype=object))
    with pytest.raises(LatentError, match="refusing a pickled .npy of Python objects"):
        lat.read_latents(tmp_path / "obj.npz")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(LatentError, match="not a readable .npz file"):
        lat.read_latents(tmp_path / "junk.npz")
    full = (tmp_path / "x.npz").read_bytes()
    (tmp_path / "trunc.npz").write_bytes(full[: len(full) // 2])
    with pytest.raises(LatentError, match="npz"):
        lat.read_latents(tmp_path / "trunc.npz")
    # a member whose header declares more than the member holds (no huge allocation first)
    hdr = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4, 100000, 100000), }"
    hdr += b" " * (63 - len(hdr) % 64) + b"\n"
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:
        z.writestr("x.npy", b"\x93NUMPY\x01\x00" + len(hdr).to_bytes(2, "little") + hdr)
    with pytest.raises(LatentError, match="more than the file holds"):
        lat.read_latents(tmp_path / "huge.npz")


def test_zip_bombs_are_refused_before_unpacking(tmp_path, monkeypatch):
    """Regression: a 1 MB deflated .npz or .pt declaring a (1,4,8192,8192) tensor took 1.5 GB of RAM
    before the size check refused it (a 20 MB one could be OOM-killed). Refused from the zip directory or the .npy
    header now, before any data is unpacked; ordinary savez_compressed files still read."""
    import zipfile

    def member(z, name, shape, dtype="<f2"):  # a deflated .npy of zeros, written in pieces (no big buffer here)
        hdr = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {shape}, }}".encode()
        hdr += b" " * (63 - (len(hdr) + 10) % 64) + b"\n"
        with z.open(name, "w", force_zip64=True) as fh:
            fh.write(b"\x93NUMPY\x01\x00" + len(hdr).to_bytes(2, "little") + hdr)
            left = 2 * int(np.prod(shape))
            while left:
                fh.write(bytes(min(left, 1 << 22)))
                left -= min(left, 1 << 22)

    def unread(*a, **k):
        raise AssertionError("the array data was read")

    monkeypatch.setattr(np.lib.format, "read_array", unread)
    # the header names a latent larger than any VAE decodes: refused unread (33 MB of zeros in a 33 KB file)
    with zipfile.ZipFile(tmp_path / "wide.npz", "w", zipfile.ZIP_DEFLATED) as z:
        member(z, "latents.npy", (1, 1, 4097, 4096))
    with pytest.raises(LatentError, match=re.escape(
            "wide.npz [latents]: header declares (1, 1, 4097, 4096) float16: latent 4097x4096 would decode to at least "
            "16388x16384 pixels per frame — beyond what vaeopt decodes (16384² max); refused before reading its data")):
        lat.read_latents(tmp_path / "wide.npz")
    # more unpacked than MAX_INFLATION beyond the file's size: refused from the zip's directory
    monkeypatch.setattr(lat, "MAX_INFLATION", 1 << 20)
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as z:
        member(z, "latents.npy", (1, 4, 512, 512))
    with pytest.raises(LatentError, match=r"bomb.npz: its members unpack to 2 MiB from a [\d.]+ KiB file, more than "
                                          r"vaeopt unpacks from a latent file \(1 MiB beyond its size\): refused before "
                                          r"unpacking \(a zip bomb\?\)"):
        lat.read_latents(tmp_path / "bomb.npz")
    monkeypatch.undo()
    np.savez_compressed(tmp_path / "ok.npz", latents=np.zeros((1, 4, 64, 64), np.float32))  # 64 KiB in ~100 bytes
    assert lat.read_latents(tmp_path / "ok.npz").entries[0].tensor.shape == (1, 4, 64, 64)

    # a .pt: torch.save stores its members uncompressed; compressed tensor data is refused before torch.load
    torch.save(torch.zeros(1, 4, 8, 8), tmp_path / "ok.pt")
    with zipfile.ZipFile(tmp_path / "ok.pt") as src, zipfile.ZipFile(tmp_path / "z.pt", "w", zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info))
    monkeypatch.setattr(torch, "load", unread)
    with pytest.raises(LatentError, match=r"z.pt: its tensor data is stored compressed \(ok/data/0: 1 KiB packed "
                                          r"into \d+ bytes\), which torch.save never writes: refused before "
                                          r"unpacking \(a zip bomb\?\)"):
        lat.read_latents(tmp_path / "z.pt")
    monkeypatch.undo()
    assert lat.read_latents(tmp_path / "ok.pt").entries[0].tensor.shape == (1, 4, 8, 8)


def test_text_files_and_torch_internal_errors_say_what_the_file_is(tmp_path):
    """Regression: "hello world" as a latent file said "corrupt or truncated? (101)", "abc" said "(pop
    from empty list)": torch's legacy reader's KeyError / IndexError. A text file is named as one; binary garbage is
    "corrupt or truncated?" without a bare exception text."""
    for name, text in (("h.pt", b"hello world\n"), ("abc.pt", b"abc"), ("u.pt", "héllo wörld, ünïcode".encode())):
        (tmp_path / name).write_bytes(text)
        first = text.decode().splitlines()[0][:24]
        with pytest.raises(LatentError, match=re.escape(f"{name}: not a readable torch file: a text file, not a tensor "
                                                        f"file (it starts {first!r})")):
            lat.read_latents(tmp_path / name)
    (tmp_path / "bin.pt").write_bytes(bytes([1, 2, 0, 7]))
    with pytest.raises(LatentError) as e:
        lat.read_latents(tmp_path / "bin.pt")
    assert str(e.value).endswith("not a readable torch file (corrupt or truncated?)") or str(e.value).endswith(
        "not a readable torch file: corrupt or truncated?"), str(e.value)


def test_unbatched_non_latents_are_not_counted_in_channels(tmp_path):
    """Regression: prompt embeddings (1, 77, 768) were "skipped (1 channel, not 4)": a batch dim is
    added to 3-D tensors before channels are counted. They are not a latent shape at all, and say so."""
    with pytest.raises(lat.NotALatent) as e:
        lat.validate(lat.LatentEntry("emb", torch.randn(1, 77, 768)), SDXL, tmp_path / "f.npz")
    assert e.value.reason == "3 dims, not a 4-channel (C,H,W) latent"
    assert str(e.value) == (f"{tmp_path / 'f.npz'} [emb]: shape (1, 77, 768) does not fit Stable Diffusion XL: "
                            "expected (N,C,H,W) image latents, or one (C,H,W) latent with 4 channels (read so, it "
                            "would have 1)")
    with pytest.raises(lat.NotALatent, match="16 latent channels, but the Stable Diffusion XL VAE takes 4") as e:
        lat.validate(lat.LatentEntry("", torch.randn(1, 16, 8, 8)), SDXL, tmp_path / "f.pt")  # 4-D: real channels
    assert e.value.reason == "16 channels, not 4"
    with pytest.raises(lat.NotALatent, match="16 latent channels, but the Stable Diffusion XL VAE takes 4"):
        lat.validate(lat.LatentEntry("", torch.randn(16, 8, 8)), SDXL, tmp_path / "f.pt")  # one FLUX latent: real
    assert lat.validate(lat.LatentEntry("", torch.randn(4, 8, 8)), SDXL, tmp_path / "f.pt").shape == (1, 4, 8, 8)


# ---- hostile files: input faults are one-line LatentErrors naming the file, never crashes ------------------------------

def _npz_bytes(tmp_path):
    import io
    import zipfile

    buf = io.BytesIO()
    np.save(buf, np.random.randn(1, 4, 4, 4).astype("float32"))
    with zipfile.ZipFile(tmp_path / "ok.npz", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.npy", buf.getvalue())
    raw = (tmp_path / "ok.npz").read_bytes()
    return raw, raw.find(b"PK\x03\x04"), raw.find(b"PK\x01\x02")


def test_npz_members_encrypted_unknown_compression_or_damaged(tmp_path):
    raw, local, central = _npz_bytes(tmp_path)
    enc = bytearray(raw)
    enc[local + 6] |= 1  # the "encrypted" flag bit, in the local and the central header
    enc[central + 8] |= 1
    comp = bytearray(raw)
    comp[local + 8] = comp[central + 10] = 99  # compression method 99 (AES): zipfile cannot unpack it
    dmg = bytearray(raw)
    start = local + 30 + len("a.npy") + 10
    for i in range(start, start + 20):
        dmg[i] ^= 0x5A  # a damaged deflate stream
    for name, data, expect in (("enc", enc, "encrypted member"), ("comp", comp, "compression method"),
                               ("dmg", dmg, "corrupt member")):
        p = tmp_path / f"{name}.npz"
        p.write_bytes(bytes(data))
        with pytest.raises(LatentError, match=expect) as e:
            lat.read_latents(p)
        assert str(e.value).startswith(f"{p} [a]") and "\n" not in str(e.value)


def test_deeply_nested_manifest_is_an_input_error_and_not_read_when_not_needed(tmp_path):
    torch.save(torch.randn(1, 4, 4, 4), tmp_path / "l.pt")
    (tmp_path / "vaeopt.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(LatentError, match="unreadable manifest .nested more than"):
        lat.read_latents(tmp_path / "l.pt")
    (tmp_path / "vaeopt.json").write_text(json.dumps({"files": {"l.pt": {"model": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[
        ]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}}))
    with pytest.raises(LatentError, match="nested more than"):
        lat.read_latents(tmp_path / "l.pt")
    # --model and --latent-space given: the manifest is not read at all
    lf = lat.read_latents(tmp_path / "l.pt", manifest_needed=False)
    assert lf.manifest == {} and not any("vaeopt.json" in n for n in lf.notes)


def test_float4_latents_and_parameters(tmp_path, recwarn):
    fam = get_family("sd15")
    if hasattr(torch, "float4_e2m1fn_x2"):
        t = torch.zeros(1, 4, 4, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        torch.save(t, tmp_path / "f4.pt")
        lf = lat.read_latents(tmp_path / "f4.pt")
        with pytest.raises(LatentError, match="float4_e2m1fn_x2 cannot be decoded") as e:
            lat.validate(lf.entries[0], fam, lf.path)
        assert str(e.value).startswith(str(tmp_path / "f4.pt"))
    # an nn.Parameter (what a training script saves): read as plain data, and no torch warning on the way
    torch.save({"z": torch.nn.Parameter(torch.randn(1, 4, 8, 8))}, tmp_path / "p.pt")
    lf = lat.read_latents(tmp_path / "p.pt")
    t = lf.entries[0].tensor
    assert type(t) is torch.Tensor and not t.requires_grad
    z = lat.validate(lf.entries[0], fam, lf.path)
    lat.space_hint(z, fam, "scaled")
    lat.to_raw(z, fam, "scaled")
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)], [str(w.message) for w in recwarn]


def test_absurd_safetensors_header_length_reads_the_same_in_both_readers(tmp_path, samples_dir):
    import struct

    from vaeopt.errors import CheckpointError
    from vaeopt.loading import read_state_dict

    save_file({"x": torch.randn(1, 4, 4, 4)}, str(tmp_path / "l.safetensors"))
    for src, dst in ((tmp_path / "l.safetensors", tmp_path / "bad_l.safetensors"),
                     (samples_dir / "tiny_kl_image.safetensors", tmp_path / "bad_m.safetensors")):
        dst.write_bytes(struct.pack("<Q", 10**12) + src.read_bytes()[8:])
    with pytest.raises(LatentError, match=r"header too large") as e1:
        lat.read_latents(tmp_path / "bad_l.safetensors")
    with pytest.raises(CheckpointError, match=r"header too large") as e2:
        read_state_dict(tmp_path / "bad_m.safetensors")
    strip = lambda e: str(e.value).split(": ", 1)[1]  # noqa: E731  (past the file name)
    assert strip(e1) == strip(e2)


def test_a_file_repeating_one_tensor_is_bounded_before_any_decode(tmp_path):
    """A small .pt whose list holds one 1x1 latent 20,000 times: refused when read, naming the bound and how to
    allow it; shared references count each time."""
    one = torch.randn(1, 4, 1, 1)
    torch.save([one] * 20000, tmp_path / "many.pt")
    assert (tmp_path / "many.pt").stat().st_size < 200_000
    with pytest.raises(LatentError) as e:
        lat.read_latents(tmp_path / "many.pt")
    msg = str(e.value)
    assert "20000 tensors (1 distinct" in msg and "--max-outputs 20000" in msg and "\n" not in msg
    assert len(lat.read_latents(tmp_path / "many.pt", max_tensors=20000).entries) == 20000
    assert len(lat.read_latents(tmp_path / "many.pt", key="7").entries) == 1  # --key: one tensor


def test_a_latent_file_saved_with_torch_save_is_read_as_one(tmp_path):
    """A script that saves ComfyUI's LATENT dict with torch.save under ComfyUI's .latent suffix: read as the torch
    file it is (weights_only), its 'samples' raw as ComfyUI's, not refused as a corrupt safetensors file."""
    z = torch.randn(1, 4, 8, 8)
    torch.save({"samples": z}, tmp_path / "x.latent")
    lf = lat.read_latents(tmp_path / "x.latent")
    assert lf.format == "comfyui-dict" and lf.default_space == "raw"
    assert torch.equal(lf.entries[0].tensor, z)
    assert any("torch.save file despite its '.latent' suffix" in n for n in lf.notes), lf.notes


def test_key_on_a_file_of_one_bare_tensor(tmp_path):
    # --key picks a tensor of a dict; a file that is one bare tensor has no names: say so, not "found: <tensor>"
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "a.pt")
    with pytest.raises(LatentError) as e:
        lat.read_latents(tmp_path / "a.pt", key="nope")
    assert str(e.value) == (f"{tmp_path / 'a.pt'}: holds one tensor with no name (not a dict of tensors), so "
                            "--key nope has nothing to pick: leave --key out")
