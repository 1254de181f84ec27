"""vaeopt.video: chunked causal decode == diffusers' one-frame-at-a-time decode.

Real data: the trained tiny Wan 2.1 VAE and its real latents (cropped spatially: CPU time). Wan 2.2 topology
(residual up blocks with DupUp3D, patch_size 2) with random small weights, batch 2. Chunk sizes 1, 2, 3 and the whole
clip on 5 latent frames cover the schedules [1,1,1,1,1], [1,2,2], [2,3] and [5] -- a one-frame first call, a
multi-frame first call, and a single call.
"""

import json
import weakref

import pytest
import torch

from vaeopt import video
from vaeopt.families import build_model, get_family
from vaeopt.engine import wan_ops
from vaeopt.stages.marks import wan_channels_last

CHUNKS = [1, 2, 3, None]
# Latent crops (rows, cols): 5 frames each, small enough for a quick CPU test.
CROPS = {"astronaut_pan": (slice(12, 15), slice(30, 33)), "coffee_zoom": (slice(10, 13), slice(20, 23))}


@pytest.fixture(scope="module")
def wan21(samples_dir):
    from diffusers import AutoencoderKLWan
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = str(samples_dir / "tiny_wan_video.safetensors")
    with safe_open(path, "pt") as f:
        cfg = json.loads(f.metadata()["config"])  # base_dim 16, z_dim 16, Wan 2.1 topology
    vae = AutoencoderKLWan(**cfg).eval().requires_grad_(False)
    vae.load_state_dict({k: v.float() for k, v in load_file(path).items()})
    return vae


@pytest.fixture(scope="module")
def latents(samples_dir):
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    return {k: lat[k].float()[:, :, :, rows, cols].contiguous() for k, (rows, cols) in CROPS.items()}


@pytest.fixture(scope="module")
def refs(wan21, latents):
    with torch.no_grad():
        return {k: wan21.decode(z).sample for k, z in latents.items()}


@pytest.fixture(scope="module")
def wan22():
    torch.manual_seed(0)
    return build_model(get_family("wan22"), base_dim=8, decoder_base_dim=8)


def test_schedule():
    assert video.chunk_schedule(21, 4) == [1, 4, 4, 4, 4, 4]
    assert video.chunk_schedule(21, 8) == [5, 8, 8]  # remainder first: all later calls share one shape
    assert video.chunk_schedule(5, None) == [5] == video.chunk_schedule(5, 99)
    assert video.chunk_schedule(5, [2, 3]) == [2, 3]
    assert video.output_frame_counts([1, 4, 4]) == [1, 16, 16]
    assert video.output_frame_counts([5, 8]) == [17, 32]


@pytest.mark.parametrize("name", ["astronaut_pan", "coffee_zoom"])
def test_wan21_trained_chunks_match_diffusers(wan21, latents, refs, name):
    z, ref = latents[name], refs[name]
    assert ref.shape[2] == 17
    for chunk in CHUNKS:
        out = video.decode_video(wan21, z, chunk)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        err = (out - ref).abs().max().item()
        assert err <= 1e-4, (chunk, err)


def test_frame_group_splitting_is_exact(wan21, latents, refs, monkeypatch):
    """Big chunks run convs and the 2x upsample over frame groups (int32 indexing limits on CUDA); force it here."""
    monkeypatch.setattr(wan_ops, "SPLIT_ELEMS", 2000)
    monkeypatch.setattr(wan_ops, "INT32_ELEMS", 20000)
    monkeypatch.setattr(wan_ops, "NORM_SLICE_ELEMS", 500)
    err = (video.decode_video(wan21, latents["coffee_zoom"], None) - refs["coffee_zoom"]).abs().max().item()
    assert err <= 1e-4, err


def test_diffusers_decoder_takes_k_frames_after_a_single_first_frame(wan21, latents, refs):
    """The semantics the chunking relies on, checked on diffusers' own decoder: after frame 0 alone, calls of K
    frames with the same feat_cache are exact; a first call of several frames is not (its 'Rep' time_conv skip
    applies to all of them)."""

    def run(schedule):
        vae, z = wan21, latents["astronaut_pan"]
        vae.clear_cache()
        x = vae.post_quant_conv(z)
        outs, t0 = [], 0
        for i, k in enumerate(schedule):
            vae._conv_idx = [0]
            outs.append(vae.decoder(x[:, :, t0 : t0 + k], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                    first_chunk=i == 0))
            t0 += k
        vae.clear_cache()
        return torch.cat(outs, 2).clamp(-1, 1)

    with torch.no_grad():
        assert (run([1, 2, 2]) - refs["astronaut_pan"]).abs().max().item() <= 1e-4
        assert run([2, 3]).shape[2] != 17  # the first two latent frames would give 2 frames instead of 5


def test_wan22_topology_batch2_and_channels_last(wan22):
    z = torch.randn(2, 48, 5, 2, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = wan22.decode(z).sample
    assert ref.shape == (2, 3, 17, 32, 32)
    assert (ref.abs() < 0.99).float().mean() > 0.5  # random weights, but not saturated: the check means something
    for chunk in CHUNKS:
        err = (video.decode_video(wan22, z, chunk) - ref).abs().max().item()
        assert err <= 1e-4, (chunk, err)
    # channels_last_3d weights (how a GPU run uses it): same numbers, caches and buffers follow the layout
    cl = build_model(get_family("wan22"), base_dim=8, decoder_base_dim=8)
    cl.load_state_dict(wan22.state_dict())
    for m in cl.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
    assert wan_channels_last(cl, None)
    err = (video.decode_video(cl, z, 2) - ref).abs().max().item()
    assert err <= 1e-4, err


def test_bf16_close(wan21, latents, refs):
    """bf16 chunked vs fp32 diffusers is no worse than bf16 diffusers vs fp32 diffusers (a tiny crop: CPU bf16
    conv3d is slow)."""
    z = latents["coffee_zoom"][:, :, :3, :2, :3]
    with torch.no_grad():
        ref32 = wan21.decode(z).sample
        vb = build_model_like(wan21, torch.bfloat16)
        ref16 = vb.decode(z.bfloat16()).sample.float()
    out16 = video.decode_video(vb, z, 2).float()
    e_torch = (ref16 - ref32).abs().max().item()
    e_ours = (out16 - ref32).abs().max().item()
    assert e_ours <= 2 * e_torch + 1e-2, (e_ours, e_torch)
    assert (out16 - ref16).abs().mean().item() < 1e-2


def build_model_like(vae, dtype):
    from diffusers import AutoencoderKLWan

    m = AutoencoderKLWan(**{k: v for k, v in vae.config.items() if not k.startswith("_")})
    m.load_state_dict(vae.state_dict())
    return m.to(dtype).eval().requires_grad_(False)


def test_iterator_groups_and_bounded_host_buffers(wan21, latents, refs):
    z, ref = latents["coffee_zoom"], refs["coffee_zoom"]
    # float groups, chunk 2 on 5 latent frames: calls of [1, 2, 2] frames -> 1, 8, 8 output frames. By default the
    # groups are fresh tensors and the iterator keeps no reference to those it handed out earlier.
    groups, handed = [], []
    for g in video.iter_decode_video(wan21, z, 2, output="float"):
        assert all(r() is None for r in handed)
        handed.append(weakref.ref(g))
        groups.append(g.clone())
        del g
    assert all(r() is None for r in handed)
    assert [g.shape[2] for g in groups] == [1, 8, 8]
    assert (torch.cat(groups, 2) - ref).abs().max().item() <= 1e-4

    # uint8 (frames, H, W, 3), reused double buffers: never more than two distinct host buffers, whatever the length
    ptrs, frames = set(), []
    for g in video.iter_decode_video(wan21, z, 1, reuse_buffers=True):
        assert g.dtype == torch.uint8 and g.shape[1:] == (ref.shape[3], ref.shape[4], 3)
        ptrs.add(g.untyped_storage().data_ptr())
        frames.append(g.clone())
    assert [f.shape[0] for f in frames] == [1, 4, 4, 4, 4]
    assert len(ptrs) <= 2
    diff = (torch.cat(frames, 0).int() - video.to_uint8_frames(ref)[0].int()).abs()
    assert diff.max().item() <= 1  # float rounding may flip a .5 boundary
    with pytest.raises(Exception, match="per clip"):
        next(video.iter_decode_video(wan21, z.expand(2, -1, -1, -1, -1), 1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_uint8_stream_refuses_nonfinite_frames(wan21, latents, device):
    """uint8 frames would turn NaN/Inf into black pixels: the stream raises DecodeError at the first bad group (on
    CUDA the flag is copied with the frames on the copy stream, so no extra sync), after the good ones."""
    from vaeopt.errors import DecodeError

    vae = wan21.to(device)
    z = latents["coffee_zoom"].to(device).clone()
    z[:, :, 3:] = 3e38  # finite latents, non-finite decode from the frame group that sees them
    got = []
    with pytest.raises(DecodeError, match=r"non-finite values \(NaN/Inf\) in output frames"):
        for g in video.iter_decode_video(vae, z, 1):
            got.append(g.shape[0])
    assert got and got[0] == 1  # the groups before the bad one were handed out
    assert len(list(video.iter_decode_video(vae, latents["coffee_zoom"].to(device), 2))) == 3  # a good clip: no error
    wan21.to("cpu")


def test_estimate_chunk_bytes(wan21):
    small = [video.estimate_chunk_bytes(wan21, (1, 16, 9, 6, 8), k, torch.float32) for k in (1, 2, 4)]
    assert 0 < small[0] < small[1] < small[2]
    with torch.device("meta"):  # the estimate needs only the architecture
        full = build_model(get_family("wan21"))
    one = video.estimate_chunk_bytes(full, (1, 16, 21, 60, 104), 1, torch.bfloat16)
    four = video.estimate_chunk_bytes(full, (1, 16, 21, 60, 104), 4, torch.bfloat16)
    # wan21-480p: diffusers' one-frame bf16 decode peaks at 4.7 GiB on an H200, weights and its
    # whole-clip output included; per chunk we should land in the same range, and grow sub-linearly with K
    assert 2.5 * 2**30 < one < 6 * 2**30, one / 2**30
    assert one < four < 4 * one


def test_rejects_non_wan():
    vae = build_model(get_family("sd15"), block_out_channels=[8, 8, 8, 8], norm_num_groups=4)
    with pytest.raises(Exception, match="AutoencoderKLWan"):
        video.decode_video(vae, torch.zeros(1, 4, 2, 4, 4), 1)


def test_training_mode_decodes_as_diffusers_does(wan21, latents):
    """A drop-in never refuses what diffusers accepts: an AutoencoderKLWan in training mode (built with from_config,
    as diffusers' own model tests build it, or after .train()) decodes after vaeopt.optimize, equal to the stock
    model; with an active dropout (p > 0) the decode is diffusers' own, its random drops included (same seed, same
    output)."""
    import copy

    from diffusers import AutoencoderKLWan

    import vaeopt

    z = latents["astronaut_pan"][:, :, :3]
    built = AutoencoderKLWan.from_config(wan21.config)
    built.load_state_dict(wan21.state_dict())
    assert built.training  # from_config leaves a model in training mode, as nn.Module does
    stock = copy.deepcopy(built)
    fast = vaeopt.optimize(copy.deepcopy(built), log=None)
    assert fast.training and not video.active_dropout(fast)
    with torch.no_grad():
        ref = stock.decode(z).sample
        out = fast.decode(z).sample
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    drop = AutoencoderKLWan.from_config({**wan21.config, "dropout": 0.5})
    drop.load_state_dict(wan21.state_dict())
    stock = copy.deepcopy(drop)
    fast = vaeopt.optimize(copy.deepcopy(drop), log=None)
    assert video.active_dropout(fast)
    with torch.no_grad():
        torch.manual_seed(1)
        ref = stock.decode(z).sample
        torch.manual_seed(1)
        out = fast.decode(z).sample
    # the same drops (other drops would differ by whole units); the optimized layers' float rounding only
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    with pytest.raises(Exception, match="training mode with active dropout"):
        video.decode_video(fast, z)  # the chunk decoder itself says why, and what to call instead
    fast.eval()  # eval: the fast path again, equal to the stock model in eval mode
    with torch.no_grad():
        torch.testing.assert_close(fast.decode(z).sample, stock.eval().decode(z).sample, atol=2e-5, rtol=0)
