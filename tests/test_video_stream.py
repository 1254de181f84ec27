"""HunyuanVideo 1.5 and LTX-2: exact chunks in time and exact tiles in space (vaeopt.engine.stream, video_stream),
against diffusers' own whole-clip decode on tiny models of the real classes (fp32, CPU)."""

import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_families import tiny
from vaeopt import planner
from vaeopt import video_stream as vs
from vaeopt.engine.stream import StreamDecoder, back_halo, chunk_schedule

LAT = {"hunyuanvideo15": (1, 32, 3, 4, 3), "ltx2": (1, 128, 4, 6, 5)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def case(request):
    fam = request.param
    m = tiny(fam)
    z = torch.randn(*LAT[fam], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m.decode(z).sample
    return fam, m, z, ref


def psnr(a, b) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(4.0 / mse)).item()


BOTH = pytest.mark.parametrize("case", ["hunyuanvideo15", "ltx2"], indirect=True)


@BOTH
def test_chunks_equal_the_whole_decode(case):
    """Every chunk size gives diffusers' whole-clip decode; the frames come out as the chunks complete them (LTX-2's
    non-causal convs hold frames back until the clip's end, HunyuanVideo 1.5's causal ones do not)."""
    fam, m, z, ref = case
    t = z.shape[2]
    for k in (t, 1, 2):
        sd = StreamDecoder(m, cap=k)
        sched = chunk_schedule(t, k)
        outs = [sd.step(z[:, :, a:b], final=i == len(sched) - 1) for i, (a, b) in enumerate(sched)]
        y = torch.cat(outs, dim=2)
        assert y.shape == ref.shape
        assert psnr(y, ref) >= 100, (fam, k)
        if fam == "hunyuanvideo15" and k == 1:
            assert [o.shape[2] for o in outs] == [1, 4, 4]
        if fam == "ltx2" and k == t:
            assert torch.equal(y, ref)  # one call over the clip: diffusers' ops in diffusers' order


@BOTH
def test_a_stage_never_runs_on_more_than_a_chunk(case, monkeypatch):
    """LTX-2's held-back frames are released at the clip's end in pieces of the chunk's size, not all at once."""
    fam, m, z, ref = case
    sd = StreamDecoder(m, cap=1)
    seen = []
    real = sd.conv

    def spy(wrapper, x, final, **kw):
        seen.append(x.shape[2] / (x.shape[-1] / z.shape[-1]) ** 0)  # frames at that conv
        return real(wrapper, x, final, **kw)

    monkeypatch.setattr(sd, "conv", spy)
    sched = chunk_schedule(z.shape[2], 1)
    rate_cap = max(vs.output_frames(m, 2) - 1, 1)  # one latent frame's worth at the output rate
    y = torch.cat([sd.step(z[:, :, a:b], final=i == len(sched) - 1) for i, (a, b) in enumerate(sched)], dim=2)
    assert psnr(y, ref) >= 100
    assert max(seen) <= rate_cap


@BOTH
def test_tiles_equal_the_untiled_decode(case):
    fam, m, z, ref = case
    untiled = vs.decode_clip(m, z, 2)
    assert psnr(untiled, ref.clamp(-1, 1)) >= 100
    for k, tile in ((1, 3), (2, (2, 4))):
        info = {}
        y = vs.decode_clip(m, z, k, tile=tile, info=info)
        assert info["tiles"] > 1 and info["halo"] == back_halo(m, info["split"])
        assert psnr(y, untiled) >= 100, (fam, tile)


@BOTH
def test_a_smaller_halo_is_not_exact(case):
    """The halo is what makes the tiles exact (the test above would pass with any halo if it were not needed): without
    it, the convs' padding at a tile's edge shows."""
    fam, m, z, ref = case
    import vaeopt.video_stream as mod

    untiled = vs.decode_clip(m, z, 2)
    real = mod.back_halo
    try:
        mod.back_halo = lambda vae, s: 0
        y = vs.decode_clip(m, z, 2, tile=2)
    finally:
        mod.back_halo = real
    assert psnr(y, untiled) < 80


@BOTH
def test_out_of_memory_retries_with_a_smaller_plan(case, monkeypatch):
    fam, m, z, ref = case
    calls = []
    real = vs._decode

    def flaky(vae, z_, chunk, tile, *a, **kw):
        calls.append((chunk, tile))
        if len(calls) < 3:
            raise torch.cuda.OutOfMemoryError("test")
        return real(vae, z_, chunk, tile, *a, **kw)

    monkeypatch.setattr(vs, "_decode", flaky)
    info = {}
    y = vs.decode_clip(m, z, 2, replan=planner.smaller_stream_plan, info=info)
    assert calls[:2] == [(2, None), (1, None)] and calls[2][1] is not None  # half the chunk, then tiles
    assert len(info["oom_events"]) == 2
    assert psnr(y, ref.clamp(-1, 1)) >= 100


@BOTH
def test_optimize_decodes_through_the_chunk_decoder(case, monkeypatch):
    """vaeopt.optimize(pipe.vae): vae.decode runs video_stream (planned chunks) and returns diffusers' unclamped
    output, with each class's own return type; enable_tiling() hands the decode back to diffusers."""
    import copy

    import vaeopt

    fam, m, z, ref = case
    model = copy.deepcopy(m)
    vaeopt.optimize(model, device="cpu", log=None)
    calls = []
    real = vs.decode_clip
    monkeypatch.setattr(vs, "decode_clip", lambda *a, **k: calls.append(k) or real(*a, **k))
    with torch.no_grad():
        got = model.decode(z).sample
        assert calls and calls[0]["clamp"] is False
        assert psnr(got, ref) >= 100
        if fam == "ltx2":
            assert torch.equal(model.decode(z, None, return_dict=False)[0], got)
        model.enable_tiling()
        n = len(calls)
        model.decode(z)
        assert len(calls) == n  # diffusers' own tiles, as asked


@BOTH
def test_a_vae_vaeopt_stepped_aside_for_decodes_as_diffusers(case, monkeypatch):
    """Once vaeopt steps aside (the VAE now runs where optimize did not plan, or others place its layers), vae.decode
    is diffusers' own: the chunk decoder is not called again."""
    import copy

    import vaeopt
    from vaeopt import dropin

    fam, m, z, ref = case
    model = copy.deepcopy(m)
    vaeopt.optimize(model, device="cpu", log=None)
    monkeypatch.setattr(dropin, "_off_plan", lambda v: "moved (a test)")
    calls = []
    monkeypatch.setattr(vs, "decode_clip", lambda *a, **k: calls.append(k))
    with pytest.warns(UserWarning), torch.no_grad():
        got = model.decode(z).sample
    assert not calls and getattr(model, "_vaeopt_stood_down", None) is not None
    assert psnr(got, ref) >= 100


@BOTH
def test_planner_chunks_then_exact_tiles_within_the_budget(case):
    from vaeopt import planner
    from vaeopt.families import get_family

    fam, m, z, ref = case
    spec = get_family(fam)
    shape, cpu = tuple(z.shape), torch.device("cpu")
    big = planner.plan_decode(spec, m, shape, torch.float32, cpu, vram_budget_gb=64)
    assert (big.mode, big.chunk) == ("chunked", shape[2]) and "exact chunk decoder" in big.reason
    assert "the whole clip in one call" in big.reason
    # the largest chunk that fits, evened out over the clip
    two = planner.estimate_stream(spec, m, shape, torch.float32, 2)
    mid = planner.plan_decode(spec, m, shape, torch.float32, cpu, vram_budget_gb=two * 1.001 / 2**30)
    assert mid.chunk == 2 and mid.est_bytes <= mid.budget_bytes
    one = planner.estimate_stream(spec, m, shape, torch.float32, 1)
    small = planner.plan_decode(spec, m, shape, torch.float32, cpu, vram_budget_gb=one * 0.999 / 2**30)
    assert small.mode == "tiled" and small.chunk == 1 and small.tile < max(shape[-2:]) and "exact" in small.reason
    if fam == "hunyuanvideo15":  # its tiles shrink the activations; LTX-2's measured no smaller than chunk 1
        assert small.est_bytes <= small.budget_bytes
    else:
        assert "may run out of memory" in small.reason
    forced = planner.plan_decode(spec, m, shape, torch.float32, cpu, vram_budget_gb=64, tiling="on")
    assert forced.mode == "tiled" and forced.tile <= -(-max(shape[-2:]) // 2)  # at least two tiles
    asked = planner.plan_decode(spec, m, shape, torch.float32, cpu, tile=2)
    assert (asked.mode, asked.tile) == ("tiled", 2)


@pytest.mark.parametrize("fam", ["hunyuanvideo15", "ltx2"])
def test_rms_norms_run_the_fused_kernel(fam):
    """HunyuanVideo 1.5's RMS norm is Wan's formula and LTX-2's weight-free one is it with a unit gamma: the
    fused_norms stage swaps their norm + SiLU pairs (and HunyuanVideo 1.5's attention norm) for the rms_norm_silu
    kernel (the Triton interpreter here), and the chunked decode still equals diffusers' stock decode."""
    import copy
    import importlib

    from vaeopt.kernels import triton_available
    from vaeopt.stages import fused_norms

    if not triton_available("cpu")[0]:
        pytest.skip(triton_available("cpu")[1])
    kern = importlib.import_module("vaeopt.kernels.rms_norm_silu")
    m = tiny(fam)
    z = torch.randn(*LAT[fam][:2], 2, 3, 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m.decode(z).sample
    f = copy.deepcopy(m)
    r = fused_norms.apply(f, device="cpu")
    # HunyuanVideo 1.5: 12 resnets, the head, the attention; LTX-2: 1 + 3 resnets and the head
    assert r.status == "applied" and (r.data["rms_silu"], r.data["rms"]) == ((25, 1) if fam == "hunyuanvideo15" else
                                                                             (9, 0))
    calls = []
    real = kern.rms_norm_silu
    try:
        kern.rms_norm_silu = lambda *a, **k: calls.append(id(a[1])) or real(*a, **k)  # (a[1]: the module's gamma)
        y = vs.decode_clip(f, z, 1, clamp=False)
    finally:
        kern.rms_norm_silu = real
    if fam == "hunyuanvideo15":  # every norm, in each of the two chunks
        assert len(calls) == 2 * (r.data["rms_silu"] + r.data["rms"])
    else:  # LTX-2's held-back frames reach the later norms in other pieces than the chunks (none run on 0 frames)
        assert len(set(calls)) == r.data["rms_silu"] and len(calls) > r.data["rms_silu"]
    assert psnr(y, ref) >= 100


def test_a_peer_that_raises_is_a_failed_row_not_a_crash():
    """A diffusers peer that cannot run a workload's size (a one-call decode of a long clip) fails its row; the
    benchmark goes on."""
    from vaeopt.benchmark import Bench
    from vaeopt.families import get_family

    b = Bench(get_family("ltx2"), {}, (1, 128, 2, 2, 2), torch.device("cpu"), torch.float32, 1, 0, lambda s: None,
              model_overrides=dict(block_out_channels=[16, 32, 32, 32], decoder_block_out_channels=[16, 32, 64],
                                   layers_per_block=[1, 1, 1, 1, 1], decoder_layers_per_block=[1, 1, 1, 1]))

    def make():
        def fn():
            raise RuntimeError("Expected canUse32BitIndexMath(input) to be true\nmore")
        return fn

    row = b.run("diffusers bf16 eager", "peer", make)
    assert row.status == "failed" and "canUse32BitIndexMath" in row.reason and "more" not in row.reason


def test_cli_chunk_and_tile_flags_reach_the_chunk_decoder(tmp_path):
    """`vaeopt decode --chunk 1 --tile 8` on an LTX-2 checkpoint: the run says it decoded in those chunks and tiles,
    and the output equals diffusers' decode (the tiles are exact, not diffusers' blended ones)."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from vaeopt.cli import app

    m = tiny("ltx2")
    m.save_pretrained(tmp_path / "vae")
    z = torch.randn(1, 128, 2, 12, 12, generator=torch.Generator().manual_seed(3))
    save_file({"samples": z}, str(tmp_path / "lat.safetensors"))
    r = CliRunner().invoke(app, ["decode", str(tmp_path / "lat.safetensors"), "--model", str(tmp_path / "vae"),
                                 "--latent-space", "raw", "--device", "cpu", "--dtype", "fp32", "--chunk", "1",
                                 "--tile", "8", "-o", str(tmp_path / "out.safetensors")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "chunks of 1 latent frame, tiles of 8 latent px" in r.output, r.output
    with torch.no_grad():
        ref = m.decode(z).sample.clamp(-1, 1)
    assert psnr(load_file(str(tmp_path / "out.safetensors"))["sample"], ref) >= 100


@BOTH
def test_the_clip_state_is_freed_when_the_decode_returns(case, monkeypatch):
    """The conv histories and keys/values go when decode_clip returns, not at Python's next cycle collection (the
    stage closures refer back to the decoder): a next decode must not find them still on the device."""
    import gc
    import weakref

    fam, m, z, ref = case
    made = []
    real = vs.StreamDecoder

    def track(*a, **k):
        d = real(*a, **k)
        made.append(weakref.ref(d))
        return d

    monkeypatch.setattr(vs, "StreamDecoder", track)
    gc.disable()
    try:
        y = vs.decode_clip(m, z, 2, clamp=False)
        assert made and all(r() is None for r in made)
    finally:
        gc.enable()
    assert psnr(y, ref) >= 100


# Measured on an H200, bf16 (benchmarks/results/h200_*_2026-11-29.json): (workload family, latent shape, chunk, tile
# or None, GiB above the start of the timed decode). decode_video.py's rows ("budget" and "tiled" variants at the
# emulated budgets, "vaeopt" in the profiled runs: peak_above_start_gib), whose start held the model's weights (the
# outputs go to the host): the decode's own peak is the weights plus that. The variants run's rows give only the
# absolute peak (peak_gib, the harness's tensors included): less the weights, an upper bound of the same quantity.
LTX2_WEIGHTS_GIB = 2.277045698836446  # (the full model's bf16 weights, as _full counts them)
MEASURED = [
    ("ltx2", (1, 128, 16, 24, 40), 16, None, 23.186884880065918),  # h200_ltx2-768_prof_2026-11-29.json, the clip
    ("ltx2", (1, 128, 16, 24, 40), 4, None, 10.09 - LTX2_WEIGHTS_GIB),  # h200_ltx2-768_variants_2026-11-29, chunk4
    ("ltx2", (1, 128, 16, 24, 40), 2, None, 4.662479877471924),  # h200_ltx2-768_budget16_before_2026-11-29 (and 8)
    ("ltx2", (1, 128, 16, 24, 40), 1, None, 5.54 - LTX2_WEIGHTS_GIB),  # h200_ltx2-768_variants_2026-11-29, chunk1
    ("ltx2", (1, 128, 16, 24, 40), 1, 20, 3.345097064971924),  # h200_ltx2-768_budget8_before_..., tiled 640px
    ("hunyuanvideo15", (1, 32, 31, 30, 53), 16, None, 69.95178747177124),  # h200_hunyuan15-480p_prof_2026-11-29
    ("hunyuanvideo15", (1, 32, 31, 30, 53), 1, None, 7.512186527252197),  # h200_hunyuan15-480p_budget8_before_...
    ("hunyuanvideo15", (1, 32, 31, 30, 53), 2, None, 11.546297550201416),  # h200_hunyuan15-480p_budget16_before_...
    ("hunyuanvideo15", (1, 32, 31, 30, 53), 1, 27, 5.976278781890869),  # ..._budget8_before_..., tiled 432px
]


def _full(fam):
    from vaeopt.families import build_model, get_family

    with torch.device("meta"):
        return get_family(fam), build_model(get_family(fam))


@pytest.mark.parametrize("fam,shape,chunk,tile,above", MEASURED)
def test_stream_estimate_covers_the_measured_peaks(fam, shape, chunk, tile, above):
    """planner.estimate_stream (configs/memory_model.json) against the measured peaks of the real-size models: at or
    above each, and no more than 20% above (the 1.05 / 1.07 margins plus the clip's output, which the estimate
    counts on the device for vae.decode's callers), so budgets hold without wasting the card: the whole LTX-2 clip
    is planned at 27.7 GB for its 25.5 GB peak (31.3 GB before the refit), HunyuanVideo 1.5's 16-frame chunk at 76.1
    for 72.3 (80.5)."""
    from vaeopt import planner

    spec, m = _full(fam)
    weights = sum(p.numel() for p in m.parameters()) * 2
    measured = weights + above * 2**30
    est = planner.estimate_stream(spec, m, shape, torch.bfloat16, chunk, tile)
    assert measured <= est <= 1.2 * measured, (fam, chunk, tile, est / 2**30, measured / 2**30)


def test_the_h200_plans_take_the_largest_chunk_and_hold_the_budgets():
    """With an H200's free memory LTX-2 decodes its 121 frames in one call (it was capped at 2 latent frames);
    HunyuanVideo 1.5 in two even chunks; an emulated 16 GB / 8 GB card gets a plan whose estimate fits it."""
    from vaeopt import planner

    cuda = torch.device("cuda")
    for fam, shape in (("ltx2", (1, 128, 16, 24, 40)), ("hunyuanvideo15", (1, 32, 31, 30, 53))):
        spec, m = _full(fam)
        p = planner.plan_decode(spec, m, shape, torch.bfloat16, cuda, vram_budget_gb=123.1)
        assert p.mode == "chunked" and p.chunk == {"ltx2": 16, "hunyuanvideo15": 16}[fam], p.reason
        for gb in (16, 8):
            p = planner.plan_decode(spec, m, shape, torch.bfloat16, cuda, vram_budget_gb=gb)
            assert p.est_bytes <= gb * 2**30, (fam, gb, p.reason)
    # the plans whose peaks were measured at those budgets (the decode's own peak, weights included): LTX-2 chunk 2
    # at 8 GB (6.9 GiB), chunk 6 at 16 GB (13.1 GiB, the variants run's budget16 row), HunyuanVideo 1.5 chunk 2 at
    # 16 GB (13.9 GiB); and a 32 GB card (28 GB after the reserve) now takes LTX-2's whole clip in one call
    for fam, shape, gb, chunk in (("ltx2", (1, 128, 16, 24, 40), 8, 2), ("ltx2", (1, 128, 16, 24, 40), 16, 6),
                                  ("hunyuanvideo15", (1, 32, 31, 30, 53), 16, 2),
                                  ("ltx2", (1, 128, 16, 24, 40), 28, 16)):
        spec, m = _full(fam)
        p = planner.plan_decode(spec, m, shape, torch.bfloat16, cuda, vram_budget_gb=gb)
        assert p.mode == "chunked" and p.chunk == chunk, (fam, gb, p.reason)
    assert planner.stream_chunks(31)[:4] == [31, 16, 11, 8]


def test_the_variant_benchmark_parses_its_variants():
    """benchmarks/decode_video.py (run on a GPU by benchmarks/video_families.sh): every variant it lists has its
    pipeline options, and the video-family command line parses (its --tiny CPU run is a manual smoke test)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import decode_video
    import harness

    assert set(decode_video.VARIANTS) - {"diffusers"} == set(decode_video.OPTIONS)
    assert decode_video.OPTIONS["budget8"]["vram_budget_gb"] == 8 and decode_video.OPTIONS["chunk4"]["chunk"] == 4
    # the chunk decoder's switch variants name switches StreamDecoder has (a typo would set a new attribute)
    assert set(decode_video.STREAM_SWITCHES) <= set(decode_video.VARIANTS)
    assert all(isinstance(getattr(StreamDecoder, k), bool) for sw in decode_video.STREAM_SWITCHES.values() for k in sw)
    names = "diffusers,vaeopt,whole,chunk1,chunk4,cl,nofused,cl_nofused,budget16,budget8"
    args = harness.parse("decode_video", ["--workload", "ltx2-768", "--tiny", "--variants", names])
    assert args.tiny and len(args.variants) == 10


@BOTH
def test_the_preallocated_pad_equals_diffusers_padding(case, monkeypatch):
    """The conv inputs built in one buffer (interior copy, then borders) give bit for bit what torch.cat + F.pad /
    the conv's own reflect padding give, in every chunking, and no replicate/reflect F.pad runs at all."""
    import torch.nn.functional as F

    fam, m, z, ref = case
    t = z.shape[2]
    real_pad, modes = F.pad, []

    def spy(x, pad, mode="constant", value=None):
        modes.append(mode)
        return real_pad(x, pad, mode=mode, value=value)

    monkeypatch.setattr(F, "pad", spy)
    for k in (t, 1, 2):
        outs = {}
        for fast in (True, False):
            modes.clear()
            sd = StreamDecoder(m, cap=k)
            sd.fast_pad = fast
            sched = chunk_schedule(t, k)
            outs[fast] = torch.cat([sd.step(z[:, :, a:b], final=i == len(sched) - 1)
                                    for i, (a, b) in enumerate(sched)], dim=2)
            if fast:
                assert not [md for md in modes if md != "constant"], (fam, k, set(modes))
            else:
                assert {"replicate" if fam == "hunyuanvideo15" else "reflect"} <= set(modes)
        assert torch.equal(outs[True], outs[False]), (fam, k)


@BOTH
def test_channels_last_weights_get_channels_last_conv_inputs(case, monkeypatch):
    """With the channels_last stage's weights, every 3x3x3 conv input is built channels_last_3d (cuDNN reads it
    without a transpose) and the decode is unchanged."""
    import copy

    import torch.nn.functional as F

    from vaeopt.stages import channels_last

    fam, m, z, ref = case
    mc = copy.deepcopy(m)
    channels_last.apply(mc)
    seen, real = [], F.conv3d

    def spy(x, w, *a, **k):
        if w.shape[-1] > 1:  # (1x1x1 convs read whatever layout their producer left)
            seen.append(x.is_contiguous(memory_format=torch.channels_last_3d))
        return real(x, w, *a, **k)

    monkeypatch.setattr(F, "conv3d", spy)
    sd = StreamDecoder(mc, cap=2)
    sched = chunk_schedule(z.shape[2], 2)
    y = torch.cat([sd.step(z[:, :, a:b], final=i == len(sched) - 1) for i, (a, b) in enumerate(sched)], dim=2)
    assert psnr(y, ref) >= 100
    assert seen and all(seen), (fam, seen.count(False), len(seen))


@BOTH
def test_fused_norms_write_the_conv_buffers(case, monkeypatch):
    """With the fused RMS norm + SiLU modules (Triton; the interpreter here), each resnet's norms and the head's write
    their output straight into the interior of the next conv's padded buffer: the decode equals the one that builds
    the buffers from separate norm outputs (the torch-pad path) bit for bit."""
    import copy

    from vaeopt.stages import fused_norms

    fam, m, z, ref = case
    mf = copy.deepcopy(m)
    assert fused_norms.apply(mf, device="cpu").status == "applied"
    fused = [x for x in mf.decoder.modules() if fused_norms.writes_into(x) and x.silu]  # (not the attention's norm)
    calls = []
    for f in fused:
        real = f.forward
        monkeypatch.setattr(f, "forward", lambda x, out=None, real=real: calls.append(out is not None) or real(x, out))
    # (the spy above makes them hooked-looking to `unhooked`: let writes_into see them as the stage left them)
    monkeypatch.setattr(fused_norms, "unhooked", lambda mod: True)
    outs = {}
    for fast in (True, False):
        calls.clear()
        sd = StreamDecoder(mf, cap=2)
        sd.fast_pad = fast
        sched = chunk_schedule(z.shape[2], 2)
        outs[fast] = torch.cat([sd.step(z[:, :, a:b], final=i == len(sched) - 1) for i, (a, b) in enumerate(sched)],
                               dim=2)
        if fast:
            assert calls and all(calls)  # every fused norm fed a conv buffer directly
        else:
            assert calls and not any(calls)
    assert torch.equal(outs[True], outs[False])
    assert psnr(outs[True], ref) >= 60


def test_hv_upsample_in_one_add_equals_diffusers():
    """HunyuanVideo 1.5's upsamplers (with and without the temporal step): conv, channel-to-space of the conv output
    and of the repeated shortcut, summed in one add written into the upsampled layout, give the module's own forward
    bit for bit, over the whole clip and when the clip comes in two pieces (frame 0 special in the first only), in
    both layouts."""
    m = tiny("hunyuanvideo15")
    ups = [u for u in m.decoder.modules() if type(u).__name__ == "HunyuanVideo15Upsample"]
    assert {u.add_temporal_upsample for u in ups} == {True, False}
    g = torch.Generator().manual_seed(5)
    for u in ups:
        x = torch.randn(1, u.conv.conv.in_channels, 3, 4, 5, generator=g)
        with torch.no_grad():
            ref = u(x)
            for cl in (False, True):
                xin = x.contiguous(memory_format=torch.channels_last_3d) if cl else x
                sd = StreamDecoder(m)
                assert torch.equal(sd.hv_upsample(u, xin, True), ref)
                sd = StreamDecoder(m)
                a = sd.hv_upsample(u, xin[:, :, :2], False)
                b = sd.hv_upsample(u, xin[:, :, 2:], True)
                assert torch.equal(torch.cat([a, b], dim=2), ref), (u.add_temporal_upsample, cl)


def test_ltx_upsample_in_one_add_equals_diffusers():
    """LTX-2's residual upsamplers: the conv output and the repeated shortcut summed in one add written into the
    upsampled layout give the module's own forward bit for bit (non-causal: the conv's output lags its input, the
    shortcut waits for it), whole or in two pieces, in both layouts."""
    m = tiny("ltx2")
    ups = [u for u in m.decoder.modules() if type(u).__name__ == "LTX2VideoUpsampler3d" and u.residual]
    assert ups
    g = torch.Generator().manual_seed(6)
    for u in ups:
        x = torch.randn(1, u.conv.conv.in_channels, 3, 4, 5, generator=g)
        with torch.no_grad():
            ref = u(x, causal=m.decoder.is_causal)
            for cl in (False, True):
                xin = x.contiguous(memory_format=torch.channels_last_3d) if cl else x
                sd = StreamDecoder(m)
                assert torch.equal(sd.ltx_upsample(u, xin, True), ref)
                sd = StreamDecoder(m)
                a = sd.ltx_upsample(u, xin[:, :, :2], False)
                b = sd.ltx_upsample(u, xin[:, :, 2:], True)
                assert torch.equal(torch.cat([a, b], dim=2), ref), cl


@BOTH
def test_every_switch_off_decodes_the_same(case):
    """StreamDecoder's measurement switches (fast_pad, fused_upsample) off: diffusers' own padding and upsampler ops,
    the same decode bit for bit, chunked as well as whole."""
    fam, m, z, ref = case
    t = z.shape[2]
    for k in (t, 1):
        outs = []
        for on in (True, False):
            sd = StreamDecoder(m, cap=k)
            sd.fast_pad = sd.fused_upsample = on
            sched = chunk_schedule(t, k)
            outs.append(torch.cat([sd.step(z[:, :, a:b], final=i == len(sched) - 1)
                                   for i, (a, b) in enumerate(sched)], dim=2))
        assert torch.equal(outs[0], outs[1]), (fam, k)


def test_a_hooked_reflect_conv_still_runs_its_forward():
    """LTX-2's reflect-padded convs run unpadded on the buffer's borders only when they are plain nn.Conv3d: one with
    a forward hook gets the time-padded buffer through its own forward (which pads itself), so the hook fires and
    sees what it would under diffusers, and the decode is unchanged."""
    m = tiny("ltx2")
    z = torch.randn(*LAT["ltx2"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m.decode(z).sample
    conv = m.decoder.conv_in.conv
    assert conv.padding_mode == "reflect"
    seen = []
    h = conv.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    try:
        y = StreamDecoder(m, cap=z.shape[2]).step(z, final=True)
    finally:
        h.remove()
    assert seen == [(1, 128, z.shape[2] + 2, *z.shape[3:])]  # time-padded (non-causal: 1 + 1 frames), not in space
    assert torch.equal(y, ref)


class _ConvCopies(TorchDispatchMode):
    """Counts the aten copy_ calls whose innermost vaeopt or diffusers caller is a function named `conv`
    (StreamDecoder.conv copying a conv's input into its padded buffer)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.copy_:
            f = sys._getframe(1)
            while f is not None and not any(d in f.f_code.co_filename for d in _LIBS):
                f = f.f_back
            self.n += f is not None and f.f_code.co_name == "conv"
        return func(*args, **(kwargs or {}))


_LIBS = (os.sep + "vaeopt" + os.sep, os.sep + "diffusers" + os.sep)


@BOTH
def test_sums_go_into_the_conv_buffers_and_reordered_channels_change_nothing(case):
    """The resnet sums written straight into the upsampler convs' padded input buffers (feed_buffers) and LTX-2's
    upsampler convs with their output channels in sub-position-major order (sub_major): the decode bit for bit as
    with either switched off, whole and chunked. Both paths are taken: the upsampler convs copy no input into their
    buffers (one interior copy fewer per fed conv, counted by _ConvCopies) and the reordered weights were made."""
    fam, m, z, ref = case
    t = z.shape[2]
    copies = {}
    for k in (t, 1):
        outs = {}
        for feed, sub in ((True, True), (False, True), (True, False)):
            sd = StreamDecoder(m, cap=k)
            sd.feed_buffers, sd.sub_major = feed, sub
            sched = chunk_schedule(t, k)
            with _ConvCopies() as counted:
                outs[feed, sub] = torch.cat([sd.step(z[:, :, a:b], final=i == len(sched) - 1)
                                             for i, (a, b) in enumerate(sched)], dim=2)
            copies[feed, sub] = counted.n
            assert sd.feeds and not [w for w in sd.feeds.values() if (w, "fed") in sd.state]  # every buffer taken
            ups = [u for u in m.decoder.modules() if type(u).__name__ == "LTX2VideoUpsampler3d" and u.residual]
            assert all(((u, "w") in sd.state) == sub for u in ups)
        assert torch.equal(outs[True, True], outs[False, True]) and torch.equal(outs[True, True], outs[True, False])
        assert psnr(outs[True, True], ref) >= 100, (fam, k)
        if k == t:  # one call per conv (LTX-2: diffusers' ops in diffusers' order; HV1.5's attention splits keys)
            assert torch.equal(outs[True, True], ref) or fam == "hunyuanvideo15"
            assert copies[False, True] - copies[True, True] == len(sd.feeds), copies


def test_the_reordered_upsampler_weights_are_one_copy_per_clip():
    """The spatial tiles' decoders of one clip share one reordered copy of each LTX-2 upsampler conv's weight (a
    tiled decode runs within a memory budget), and it is freed with the last decoder that holds it."""
    import gc

    from vaeopt.engine import stream

    m = tiny("ltx2")
    up = next(u for u in m.decoder.modules() if type(u).__name__ == "LTX2VideoUpsampler3d" and u.residual)
    a, b = StreamDecoder(m), StreamDecoder(m)
    wa, wb = a._sub_major_weight(up)[0], b._sub_major_weight(up)[0]
    assert wa is wb and wa.shape == up.conv.conv.weight.shape and not torch.equal(wa, up.conv.conv.weight)
    del wa, wb
    a.close()
    assert len(stream._SUB_MAJOR) >= 1
    b.close()
    gc.collect()
    assert len(stream._SUB_MAJOR) == 0


def test_the_shared_reordered_weights_follow_refresh_and_inference_tensors():
    """A weight edited where torch counts no version (param.data) is picked up after vaeopt.refresh(), as every
    derived weight is, even while another decoder still holds the old reordered copy; a model built under
    torch.inference_mode (ComfyUI) has weights without version counters and is reordered all the same."""
    import vaeopt

    m = tiny("ltx2")
    up = next(u for u in m.decoder.modules() if type(u).__name__ == "LTX2VideoUpsampler3d" and u.residual)
    w = up.conv.conv.weight
    a = StreamDecoder(m)
    old = a._sub_major_weight(up)[0].clone()
    with torch.no_grad():
        w.data.mul_(2)  # no version counted
    vaeopt.refresh()
    new = StreamDecoder(m)._sub_major_weight(up)[0]
    assert torch.equal(new, old * 2)
    a.close()
    with torch.inference_mode():
        mi = tiny("ltx2")
    upi = next(u for u in mi.decoder.modules() if type(u).__name__ == "LTX2VideoUpsampler3d" and u.residual)
    assert upi.conv.conv.weight.is_inference()
    wi = StreamDecoder(mi)._sub_major_weight(upi)[0]
    assert wi.shape == upi.conv.conv.weight.shape and torch.equal(wi.flatten().sort().values,
                                                                 upi.conv.conv.weight.flatten().sort().values)
