"""vaeopt.video_tiling: spatially tiled video decode == the untiled chunked decode, one causal cache per tile.

Real data: the trained tiny Wan 2.1 VAE and its real latents (a 6x6 latent crop of 'astronaut_pan': 48x48 px, 17 frames; the
tiny decoder has the full Wan 2.1 topology, so the halos are the real ones: 7 px at the last up block, 10 px at 4x
latent resolution). Tiles that divide the frame and tiles that do not, bands and 2D tiles, chunk sizes 1 / 2 / all
(schedules [1,1,1,1,1], [1,2,2], [5]); the Wan 2.2 topology (residual up blocks with DupUp3D, patch 2) with random
weights, batch 2; the fused Triton path under the interpreter; host cache storage; OOM fallback; the planner.
"""

import json
import math

import pytest
import torch

from vaeopt import planner, video
from vaeopt import video_tiling as vt
from vaeopt.engine import wan_ops
from vaeopt.engine.regions import tile_grid
from vaeopt.errors import VaeoptError
from vaeopt.families import build_model, get_family
from vaeopt.tiling import TilingError
from vaeopt.engine.memory import LiveBytes, MemEfficientSDPA
from vaeopt.engine.wan import ChunkDecoder
from vaeopt.engine.wan_ops import Pending

CROP = (slice(10, 16), slice(30, 36))  # astronaut_pan, 6x6 latent pixels -> 48x48 output frames


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR over the [-1, 1] range (peak-to-peak 2)."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(4.0 / mse)


def _wan21(samples_dir):
    from diffusers import AutoencoderKLWan
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = str(samples_dir / "tiny_wan_video.safetensors")
    with safe_open(path, "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    vae = AutoencoderKLWan(**cfg).eval().requires_grad_(False)
    vae.load_state_dict({k: v.float() for k, v in load_file(path).items()})
    return vae


@pytest.fixture(scope="module")
def wan21(samples_dir):
    return _wan21(samples_dir)


@pytest.fixture(scope="module")
def z21(samples_dir):
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    return lat["astronaut_pan"].float()[:, :, :, CROP[0], CROP[1]].contiguous()


@pytest.fixture(scope="module")
def refs21(wan21, z21):
    """The untiled chunked decode per chunk size (itself == diffusers to 1e-6, tests/test_video.py)."""
    return {c: video.decode_video(wan21, z21, c) for c in (1, 2, None)}


def test_receptive_field_counted_from_modules(wan21):
    # Wan 2.1: up_blocks 0-2 end in a 2x upsample + 3x3 conv; 3 resnets (two 3x3x3 convs each) per block; conv_out.
    # From the output back: block 3 + head = 6 + 1 = 7 px at full res; block 2's upsample conv +1 -> 8 -> 4 at half
    # res, + 6 = 10; block 1: +1 -> 11 -> 6, + 6 = 12; block 0: +1 -> 13 -> 7, + 6 = 13 at latent resolution.
    assert [vt.receptive_field(wan21, s) for s in range(5)] == [(13, 8), (12, 4), (10, 2), (7, 1), (1, 1)]
    assert [vt.min_tile_rows(wan21, s) for s in range(5)] == [13, 6, 3, 1, 1]
    assert vt.default_split(wan21) == 3
    # a norm with spatial statistics cannot be tiled with halos: refused by name, not silently wrong
    bad = _swap_norm(wan21)
    with pytest.raises(TilingError, match="norm1"):
        vt.receptive_field(bad, 3)


def _swap_norm(vae):
    import copy

    m = copy.deepcopy(vae)
    blk = m.decoder.up_blocks[3].resnets[0]
    blk.norm1 = torch.nn.GroupNorm(1, blk.norm1.gamma.shape[0])
    return m


@pytest.mark.parametrize("split,tiles", [
    (3, [(1, 6), (4, 6), (4, 4)]),  # 6 one-row bands; 2 uneven bands (4+2); 2D tiles, uneven both ways
    (2, [(3, 6), (4, 4)]),  # tiled from 4x latent resolution (halo 10 px there)
])
def test_wan21_trained_tiles_equal_untiled(wan21, z21, refs21, split, tiles):
    for i, tile in enumerate(tiles):
        for chunk in ((1, 2, None) if i == 0 else (2,)):  # all schedules for the first tile, [1,2,2] for the rest
            info = {}
            out = video.decode_video(wan21, z21, chunk, tile=tile, split=split, info=info)
            ref = refs21[chunk]
            assert out.shape == ref.shape == (1, 3, 17, 48, 48)
            err, db = (out - ref).abs().max().item(), psnr(out, ref)
            assert err <= 2e-6 and db >= 130, (split, tile, chunk, err, db)
            assert info["tiles"] > 1 and info["split"] == split and info["shrinks"] == 0


def test_int_tile_is_bands_of_that_area():
    assert vt.resolve_tile(4, (6, 6)) == (2, 6)  # 16 latent px -> 2 full-width rows
    assert vt.resolve_tile(64, (90, 160)) == (25, 160) and vt.resolve_tile(8, (90, 160)) == (1, 160)
    assert vt.resolve_tile((200, 40), (90, 160)) == (90, 40) and vt.band_tiles((90, 160), 4) == (23, 160)


def test_halo_is_needed_and_enough(wan21, z21, refs21, monkeypatch):
    """The counted halo is exact; with less, the error appears exactly at the seam between the two bands (output
    row 24) and grows as the halo shrinks: the halo is tight and the exactness checks are not vacuous. (A zero-padded
    pixel's influence fades through the layers, so one pixel short is only ~2e-5 off on the trained model.)"""
    ref = refs21[2]

    def seam_error(short: int):
        real = vt.receptive_field
        monkeypatch.setattr(vt, "receptive_field", lambda vae, s: (real(vae, s)[0] - short, real(vae, s)[1]))
        out = video.decode_video(wan21, z21, 2, tile=(3, 6), split=3)
        monkeypatch.setattr(vt, "receptive_field", real)
        e = (out - ref).abs()
        rows = (e.amax(dim=(0, 1, 2, 4)) > 1e-6).nonzero().flatten().tolist()
        return e.max().item(), rows

    e0, rows0 = seam_error(0)  # bands at split 3: bit-identical on Intel CPUs; 2.4e-7 on an AMD EPYC (oneDNN's
    assert e0 <= 2e-6 and rows0 == [], (e0, rows0)  # kernels round differently per band shape there)
    e1, rows1 = seam_error(1)
    e3, rows3 = seam_error(3)
    assert e1 > 1e-5 and rows1 == [23, 24], (e1, rows1)
    assert e3 > 10 * e1 and rows3 == list(range(21, 27)), (e3, rows3)


def test_wan22_topology_batch2():
    torch.manual_seed(0)
    vae = build_model(get_family("wan22"), base_dim=8, decoder_base_dim=8)
    z = torch.randn(2, 48, 5, 6, 4, generator=torch.Generator().manual_seed(1))
    assert vt.receptive_field(vae, 3) == (7, 1) and vt.receptive_field(vae, 2) == (10, 2)
    for chunk in (1, 2, None):
        ref = video.decode_video(vae, z, chunk)
        assert ref.shape == (2, 3, 17, 96, 64) and (ref.abs() < 0.99).float().mean() > 0.5
        for split, tile in ((3, (1, 4)), (3, (2, 3)), (2, (3, 4))):
            out = video.decode_video(vae, z, chunk, tile=tile, split=split)
            err = (out - ref).abs().max().item()
            assert err <= 2e-6 and psnr(out, ref) >= 130, (chunk, split, tile, err)


@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_fused_kernel_path_in_tiles(samples_dir, layout):
    """The fused Triton path (folded conv biases, one-pass epilogues, kernel upsampling; here under the interpreter)
    runs inside every tile, including a bias owed across the split, and the tiles equal the untiled fused decode."""
    from vaeopt.kernels import triton_available
    from vaeopt.stages import fused_epilogues, fused_norms

    ok, why = triton_available("cpu")
    if not ok:
        pytest.skip(why)
    vae = _wan21(samples_dir)
    assert fused_norms.apply(vae).status == "applied" and fused_epilogues.apply(vae).status == "applied"
    if layout == "cl":
        for m in vae.modules():
            if isinstance(m, torch.nn.Conv3d):
                m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")["astronaut_pan"].float()
    z = lat[:, :, :3, 10:16, 30:32].contiguous()  # 6x2 latent -> 48x16 px, 9 frames: the interpreter is slow
    ref = video.decode_video(vae, z, 2)
    stock = video.decode_video(vae, z, 2, fused=False)
    assert (ref - stock).abs().max().item() <= 1e-5
    cases = [((1, 2), 3, 2), ((3, 2), 2, 2)] + ([((2, 1), 3, None)] if layout == "cf" else [])
    for tile, split, chunk in cases:
        info = {}
        out = video.decode_video(vae, z, chunk, tile=tile, split=split, info=info)
        r = ref if chunk == 2 else video.decode_video(vae, z, chunk)
        err = (out - r).abs().max().item()
        assert err <= 2e-6 and psnr(out, r) >= 130, (tile, split, chunk, err)
        st = info["stats"]
        blocks = sum(type(m).__name__ == "WanResidualBlock" for m in vae.decoder.modules())
        calls = len(video.chunk_schedule(3, chunk))
        # every block fused: the front's once per call, the back's once per tile and call
        back = sum(len(ub.resnets) for ub in vae.decoder.up_blocks[split:])
        assert st["fused_blocks"] == calls * (blocks - back + info["tiles"] * back), st
        assert "bias_materialized" not in st


def test_streams_chunk_by_chunk(wan21, z21, refs21):
    groups = [g.clone() for g in video.iter_decode_video(wan21, z21, 2, output="float", tile=(2, 6))]
    assert [g.shape[2] for g in groups] == [1, 8, 8]  # a chunk comes out once all its tiles are done
    assert (torch.cat(groups, 2) - refs21[2]).abs().max().item() <= 2e-6
    u8 = torch.cat(list(video.iter_decode_video(wan21, z21, 1, tile=(3, 3))), 0)
    assert u8.shape == (17, 48, 48, 3) and u8.dtype == torch.uint8
    assert (u8.int() - video.to_uint8_frames(refs21[1])[0].int()).abs().max().item() <= 1


def test_host_cache_storage_bookkeeping(wan21, z21, refs21):
    """Caches written back after every call and read before the next (simulated on CPU with plain copies): the
    traffic is exactly the caches per call, every load after the first is a prefetch hit, the result is exact."""
    for chunk, calls in ((1, 5), (2, 3)):
        info = {}
        out = video.decode_video(wan21, z21, chunk, tile=(3, 6), storage="host", _force_copy=True, info=info)
        assert (out - refs21[chunk]).abs().max().item() <= 2e-6
        cb = info["cache_bytes"]
        assert cb > 0 and info["bytes_d2h"] == calls * cb and info["bytes_h2d"] == (calls - 1) * cb
        assert info["prefetch_hits"] == (calls - 1) * info["tiles"]
    with pytest.raises(ValueError, match="CUDA"):
        video.decode_video(wan21, z21, 1, tile=(3, 6), storage="host")


def test_caches_come_from_one_allocation(wan21, z21, refs21, monkeypatch):
    """All causal caches of a decode are carved from one block sized by a dry run (fragmentation, see _Arena): with
    GPU storage one block for the front and every tile, exactly filled; with host storage the tiles' device caches
    reuse min(tiles, 3) fixed slots. Same output."""
    for storage, tile in (("device", (2, 6)), ("host", (1, 6))):
        plan = vt.TiledVideoPlan(2, tile, 3, storage)
        sizes = vt.cache_bytes_per_decoder(wan21, z21.shape, plan)
        assert len(sizes) == 1 + len(tile_grid(6, 6, *tile)) and min(sizes) > 0
        clip = vt._TiledClip(wan21, (6, 6), plan, False, None, force_copy=True, arena_bytes=sizes)
        out = []
        for t0, k in ((0, 1), (1, 2), (3, 2)):
            out.append(clip.step(z21[:, :, t0 : t0 + k]).clamp(-1, 1))
        assert (torch.cat(out, 2) - refs21[2]).abs().max().item() <= 2e-6
        arena = clip.front.arena
        assert all(c.untyped_storage().data_ptr() == arena.buf.untyped_storage().data_ptr()
                   for c in clip.front.cache.values())
        if storage == "device":
            assert arena.off == arena.buf.numel() == sum(sizes)  # every cache of every decoder, nothing else
            assert all(c.untyped_storage().data_ptr() == arena.buf.untyped_storage().data_ptr()
                       for d in clip.tiles for c in d.cache.values())
        else:
            assert arena.off == arena.buf.numel() == sizes[0] and len(clip.store.slots) == 3
            assert all(sl.buf.numel() == max(sizes[1:]) for sl in clip.store.slots)
            assert all(d.cache == {} for d in clip.tiles)  # between calls the caches are on the host
    # the untiled decoder of iter_raw (the pipeline's path) takes its caches from one block as well
    (untiled,) = vt.cache_bytes_per_decoder(wan21, z21.shape, vt.TiledVideoPlan(2, None, 3))
    floor = vt.cache_floor_bytes(wan21, z21.shape, torch.float32)
    assert floor <= untiled < floor + 64 * 512  # the same caches, each rounded up to 512 bytes
    made = []
    real_init = vt._Arena.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(vt._Arena, "__init__", init)
    out = video.decode_video(wan21, z21, 2, replan=planner.smaller_video_plan)
    assert (out - refs21[2]).abs().max().item() <= 2e-6
    assert len(made) == 1 and made[0].off == made[0].buf.numel() == untiled


def test_estimate_matches_a_real_run(wan21, z21):
    """The dry run (meta tensors, one tile per distinct shape run for real) against the live-storage counter over
    a real CPU run of the same plan, fp32: the estimate is the same code path, so it should be close."""
    for tile, split, storage in (((2, 6), 3, "device"), ((3, 6), 2, "device"), ((2, 6), 3, "host")):
        plan = vt.TiledVideoPlan(2, tile, split, storage)
        counter = LiveBytes()
        with MemEfficientSDPA(), counter, torch.no_grad():
            clip = vt._TiledClip(wan21, (6, 6), plan, False, None, force_copy=storage == "host")
            for k, t0 in ((2, 0), (2, 2)):
                y = clip.step(z21[:, :, t0 : t0 + k])
                del y
            measured = counter.peak
            del clip
        est = vt.estimate_tiled_video_bytes(wan21, z21.shape, 2, tile, torch.float32, split=split, storage=storage)
        # host storage on CPU: the pinned host copies are real CPU tensors the counter sees, the estimate does not
        if storage == "device":
            assert 0.95 * measured <= est <= 1.1 * measured, (tile, split, est, measured)
        else:
            assert est <= measured


def test_estimates_at_720p():
    """wan21-720p bf16: tiling with device caches barely lowers the peak (the causal caches, ~4 GiB, are most of it
    and every tile keeps its own); pinned host caches do."""
    with torch.device("meta"):
        full = build_model(get_family("wan21"))
    shape = (1, 16, 21, 90, 160)
    gib = 2**30
    untiled = vt.estimate_tiled_video_bytes(full, shape, 1, None, torch.bfloat16, True, True)
    floor = vt.cache_floor_bytes(full, shape, torch.bfloat16, True)
    dev = vt.estimate_tiled_video_bytes(full, shape, 1, (30, 160), torch.bfloat16, True, True, 2, "device")
    host = vt.estimate_tiled_video_bytes(full, shape, 1, (12, 160), torch.bfloat16, True, True, 2, "host")
    assert 3.5 * gib < floor < 4.5 * gib and 6 * gib < untiled < 7 * gib
    assert floor < dev < untiled and host < 0.7 * untiled, (floor / gib, dev / gib, host / gib, untiled / gib)


def test_oom_shrinks_and_output_matches(wan21, z21, refs21, monkeypatch):
    """An out-of-memory error in the 3rd call of the untiled decode: the clip is decoded again with a smaller plan,
    frames already handed out are not repeated, the result equals the untiled decode."""
    real_back = ChunkDecoder.back
    calls = {"n": 0}

    def back(self, box, xb, start):
        if not box[0].is_meta and box[0].shape[3] >= 40:  # an untiled call (48 rows); tiles have <= 38
            calls["n"] += 1
            if calls["n"] == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real_back(self, box, xb, start)

    monkeypatch.setattr(ChunkDecoder, "back", back)
    info = {}
    groups = list(video.iter_decode_video(wan21, z21, 1, output="float", replan=planner.smaller_video_plan, info=info))
    assert [g.shape[2] for g in groups] == [1, 4, 4, 4, 4]  # 2 calls out before the OOM, 3 after: none repeated
    out = torch.cat(groups, 2)
    assert (out - refs21[1]).abs().max().item() <= 2e-6
    assert info["shrinks"] == 1 and len(info["oom_events"]) == 1
    ev = info["oom_events"][0]
    assert ev["plan"].tile is None and ev["next"].tile is not None and ev["frames_done"] == 5
    assert "injected" in ev["error"] and info["plan"] == ev["next"]

    # OOM in a tiled plan: the tile shrinks (never a plan twice); every call out of memory: a clear error
    calls["n"] = 0
    info = {}
    out = video.decode_video(wan21, z21, 2, tile=(6, 6), replan=planner.smaller_video_plan, info=info)  # a 6-row "band" = 48 rows
    assert (out - refs21[2]).abs().max().item() <= 2e-6 and info["shrinks"] == 1
    assert info["plan"].tile[0] < 6

    def always(self, box, xb, start):
        if not box[0].is_meta:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_back(self, box, xb, start)

    monkeypatch.setattr(ChunkDecoder, "back", always)
    info = {}
    with pytest.raises(VaeoptError, match="out of memory"):
        video.decode_video(wan21, z21, 2, replan=planner.smaller_video_plan, info=info)
    plans = [e["plan"] for e in info["oom_events"]]
    assert len(plans) == len(set(plans)) >= 3  # tile, chunk, ...: every plan tried once
    with pytest.raises(torch.OutOfMemoryError):  # without replan the error is the caller's
        video.decode_video(wan21, z21, 2, tile=(3, 6))


def test_impossible_requests(wan21, z21):
    with pytest.raises(VaeoptError, match="halo of 10px"):
        video.decode_video(wan21, z21, 1, tile=(2, 6), split=2)  # 2 latent rows < 10 px / 4 at split 2


def test_hunyuan_tile_is_diffusers_tiles_and_long_clips_plan_one_temporal_tile():
    """HunyuanVideo takes --tile as diffusers' own spatial tiles (it has no exact tiler), and the estimate of a long
    clip is that of one of diffusers' temporal tiles (5 latent frames), not of the whole clip."""
    spec = get_family("hunyuanvideo")
    with torch.device("meta"):
        m = build_model(spec)
    p = planner.plan_decode(spec, m, (1, 16, 5, 32, 32), torch.bfloat16, torch.device("cpu"), tile=16)
    assert p.mode == "tiled" and p.tile == 16 and "diffusers' spatial tiles of 128px" in p.reason
    short = planner.plan_decode(spec, m, (1, 16, 5, 60, 106), torch.bfloat16, torch.device("cpu"),
                                vram_budget_gb=70)
    long = planner.plan_decode(spec, m, (1, 16, 31, 60, 106), torch.bfloat16, torch.device("cpu"),
                               vram_budget_gb=70)
    assert short.mode == long.mode == "whole" and short.chunk == long.chunk == 5
    assert "temporal tiles of 5 latent frames" in long.reason
    # measured on an H100 (h100_hunyuan_2026-11-22.json): 21.98 / 22.52 GiB above the weights at 5 / 31 latent frames
    w = planner._weights_bytes(m, torch.bfloat16)
    assert 21.0 < (short.est_bytes - w) / 2**30 < 24.0 and 21.5 < (long.est_bytes - w) / 2**30 < 24.5
    tight = planner.plan_decode(spec, m, (1, 16, 31, 60, 106), torch.bfloat16, torch.device("cpu"),
                                vram_budget_gb=8)
    assert tight.mode == "tiled" and tight.tile == 32 and tight.est_bytes <= 8 * 2**30
    # diffusers' 256 px tiles over 121 frames peaked at 4.18 GiB above the weights (h100_hunyuan_2026-11-22.json)
    assert 3.9 < (tight.est_bytes - w) / 2**30 < 4.6


# --- planner ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan21_full():
    spec = get_family("wan21")
    with torch.device("meta"):
        return spec, build_model(spec)


def test_planner_tiles_only_when_the_budget_needs_it(wan21_full, monkeypatch):
    spec, m = wan21_full
    shape = (1, 16, 21, 90, 160)  # wan21-720p
    cuda = torch.device("cuda")  # only the device type matters: budgets are given
    monkeypatch.setenv(wan_ops.FUSED_ENV, "1")  # estimate the fused kernel path, as the GPU pipeline runs it

    def plan(gb, **kw):
        return planner.plan_decode(spec, m, shape, torch.bfloat16, cuda, vram_budget_gb=gb, **kw)

    big = plan(40)
    assert big.mode == "chunked" and big.chunk == planner.MAX_CHUNK and big.tile is None
    p8 = plan(8)  # the untiled chunk-1 decode is est. 7.9 GB: no tiling while it fits
    assert p8.mode == "chunked" and p8.chunk == 1 and p8.est_bytes <= 8 * 2**30
    p75 = plan(7.5)
    assert p75.mode == "tiled" and p75.storage == "device" and p75.chunk == 1
    assert p75.est_bytes <= 7.5 * 2**30 and p75.tile[1] == 160 and p75.tile[0] < 90
    assert p75.reason.startswith(f"tile 1280x{p75.tile[0] * 8}px") and "of 7.5 GB budget" in p75.reason
    assert "untiled chunk 1 would need 7.9 GB" in p75.reason
    p5 = plan(5)  # below the causal caches (~4 GiB + 15%, weights and output): they go to pinned host memory
    assert p5.mode == "tiled" and p5.storage == "host" and p5.est_bytes <= 5 * 2**30
    assert "pinned host memory" in p5.reason
    assert plan(5, tiling="off").mode == "chunked"
    # overrides: --tile keeps its tile (bands of that area), --chunk its chunk
    pt = plan(40, tile=64)
    assert pt.mode == "tiled" and pt.tile == (64 * 64 // 160, 160) and "requested" in pt.reason
    pc = plan(7.5, chunk=1)
    assert (pc.chunk, pc.tile, pc.storage) == (1, p75.tile, "device")
    # the same budget on a CPU device: no host storage to fall back to, and no device-cache plan fits
    p5cpu = planner.plan_decode(spec, m, shape, torch.bfloat16, torch.device("cpu"), vram_budget_gb=5)
    assert p5cpu.storage != "host" and "may run out of memory" in p5cpu.reason


def test_planner_forced_tiling_small_clip(wan21):
    spec = planner.FamilySpec("wan21", "Wan 2.1", {"_class_name": "AutoencoderKLWan", **dict(wan21.config)})
    p = planner.plan_decode(spec, wan21, (1, 16, 5, 6, 6), torch.float32, torch.device("cpu"), tiling="on")
    assert p.mode == "tiled" and p.tile == (3, 6) and p.split == 3 and "tiling forced" in p.reason


# --- pipeline / CLI --------------------------------------------------------------------------------------------


def test_cli_tile(tmp_path, samples_dir):
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from vaeopt.cli import app

    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")["astronaut_pan"].float()
    torch.save(lat[:, :, :3, 10:16, 28:48].contiguous(), tmp_path / "clip.pt")  # 6x20 latent: --tile 8 -> 3 rows
    model = samples_dir / "tiny_wan_video.safetensors"
    outs = {}
    for name, extra in (("plain", []), ("tiled", ["--tile", "8", "-v"])):  # -v: the plan's own line
        r = CliRunner().invoke(app, [str(a) for a in ("decode", tmp_path / "clip.pt", "--model", model,
                                                      "--latent-space", "raw", "-o", tmp_path / f"{name}.safetensors",
                                                      "--chunk", "2", *extra)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        outs[name] = load_file(str(tmp_path / f"{name}.safetensors"))["sample"]
        if extra:
            assert "tile 160x24px requested (2 bands), chunk 2" in " ".join(r.output.split())
    assert outs["plain"].shape == (1, 3, 9, 48, 160)
    assert (outs["tiled"] - outs["plain"]).abs().max().item() <= 2e-6


def test_pipeline_reports_oom_retry(samples_dir, z21, refs21, monkeypatch):
    from vaeopt.loading import load_vae
    from vaeopt.pipeline import DecodeStats, Options, Pipeline

    lines = []
    pipe = Pipeline(load_vae(samples_dir / "tiny_wan_video.safetensors"), Options(device="cpu", chunk=2),
                    log=lines.append)
    real_back = ChunkDecoder.back
    state = {"failed": False}

    def back(self, box, xb, start):
        x = box[0].h if isinstance(box[0], Pending) else box[0]  # (channels_last_3d: a pending block output)
        if not x.is_meta and x.shape[3] >= 40 and not state["failed"]:
            state["failed"] = True
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_back(self, box, xb, start)

    monkeypatch.setattr(ChunkDecoder, "back", back)
    out, stats = pipe.decode(z21)
    assert (out - refs21[2]).abs().max().item() <= 2e-6
    assert len(stats.retries) == 1 and "out of memory in the video decode (untiled, chunk 2)" in stats.retries[0]
    assert "decoded again with tile" in stats.retries[0] and any(s.startswith("↩ out of memory") for s in lines)
    state["failed"] = False
    vstats = DecodeStats()
    frames = list(pipe.iter_video(z21, pipe.plan(tuple(z21.shape)), vstats))
    assert sum(f.shape[0] for f in frames) == 17 and len(vstats.retries) == 1
