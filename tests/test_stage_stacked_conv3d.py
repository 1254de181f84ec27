"""Wan's causal Conv3d as a Conv2d over time-stacked channels (stages/stacked_conv3d.py, rms_norm_silu(taps=3)).

The RMS-norm kernel writes each new frame into its (up to) three places of the stack (checked against the reference
norm, history blocks left to the caller); the trained tiny Wan 2.1 with every causal 3x3x3 conv stacked decodes what
diffusers decodes (fp32, chunk sizes 1-3, with and without the phase upsample convs); the planner's dry run counts
the stack; the stage's skip reasons; triton_conv yields the convs stacking took.
"""

import importlib
import json

import pytest
import torch

from vaeopt import planner, video
from vaeopt.families import build_model, get_family
from vaeopt.kernels import triton_available
from vaeopt.pipeline import Options
from vaeopt.stage_table import DeviceInfo, decide_stages
from vaeopt.stages import Hint, channels_last, fused_epilogues, fused_norms, stacked_conv3d, triton_conv, upsample_conv
from vaeopt.engine.memory import estimate_peak
from vaeopt.engine.wan_ops import copy_lastdim, wan_module

from test_video_fused import decode as _decode_stats  # noqa: E402 (decode_video + its chunk decoder's stats)
from test_video_tiling import _wan21  # noqa: E402 (the trained tiny Wan 2.1, fp32)

CPU = torch.device("cpu")
R = importlib.import_module("vaeopt.kernels.rms_norm_silu")  # (the package re-exports a function of that name)


@pytest.fixture(autouse=True)
def _backend():
    ok, why = triton_available("cpu")
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("shape", [(2, 8, 3, 4, 5), (1, 16, 1, 3, 3), (1, 4, 5, 2, 3)])
def test_norm_writes_the_time_stack(shape):
    N, C, K, H, W = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).contiguous(memory_format=torch.channels_last_3d)
    gamma, beta, xb = (torch.randn(C, generator=g) for _ in range(3))
    ref = R.rms_norm_silu_reference(x, gamma, beta, 1e-12, True, x_bias=xb)
    out = torch.full((N * K, 3 * C, H, W), float("nan")).contiguous(memory_format=torch.channels_last)
    assert R.rms_norm_silu(x, gamma, beta, 1e-12, True, x_bias=xb, out=out, taps=3) is out
    for n in range(N):
        for t in range(K):
            for dt in range(3):
                blk = out[n * K + t, dt * C : (dt + 1) * C]
                f = t + dt - 2  # stream frame t + dt; the first two are the history
                if f >= 0:
                    torch.testing.assert_close(blk, ref[n, :, f], atol=1e-5, rtol=1e-5)
                else:
                    assert torch.isnan(blk).all(), "history blocks are the caller's"
    with pytest.raises(ValueError, match="channels_last"):
        R.rms_norm_silu(x, gamma, beta, out=out.contiguous(), taps=3)
    # cache_out: the next history (the stream's last two frames) written by the same pass; with one new frame only
    # slot 1 (slot 0 is the caller's shift of the old history)
    cache = torch.full((N, C, 2, H, W), float("nan")).contiguous(memory_format=torch.channels_last_3d)
    R.rms_norm_silu(x, gamma, beta, 1e-12, True, x_bias=xb, out=out, taps=3, cache_out=cache)
    for slot in range(2):
        f = K - 2 + slot
        if f >= 0:
            torch.testing.assert_close(cache[:, :, slot], ref[:, :, f], atol=1e-5, rtol=1e-5)
        else:
            assert torch.isnan(cache[:, :, slot]).all()
    with pytest.raises(ValueError, match="cache_out"):
        R.rms_norm_silu(x, gamma, beta, out=out, taps=3, cache_out=cache.contiguous())


@pytest.fixture(scope="module")
def z21(samples_dir):
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    return lat["coffee_zoom"].float()[:, :, :, 10:12, 20:22].contiguous()


@pytest.mark.parametrize("phase", [False, True], ids=["plain-upsample", "phase-upsample"])
def test_tiny_wan_stacked_equals_diffusers(samples_dir, z21, phase):
    vae = _wan21(samples_dir)
    with torch.no_grad():
        ref = vae.decode(z21).sample
    fused_norms.apply(vae)
    channels_last.apply(vae)
    assert stacked_conv3d.apply(vae, device=CPU, force=True).status == "skipped"  # needs the fused chunk decoder
    fused_epilogues.apply(vae)
    # auto on the CPU (the stage table's rule): the Conv3d stays
    auto = {r.name: r for r in decide_stages(Options(triton="on"), get_family("wan21"), torch.float32,
                                             DeviceInfo("cpu", triton=(True, "")))}["stacked_conv3d"]
    assert auto.status == "skipped" and (Hint("triton", "on"), Hint("stack_conv3d", "on")) in auto.hints
    r = stacked_conv3d.apply(vae, device=CPU, force=True)
    n = sum(type(m).__name__ == "WanCausalConv3d" and m.kernel_size == (3, 3, 3) for m in vae.decoder.modules())
    assert r.status == "applied" and r.data["layers"] == n
    if phase:
        upsample_conv.apply(vae, device=CPU, force=True)
    for chunk in (1, 2, 3):
        out, st = _decode_stats(vae, z21, chunk)
        steps = len(video.chunk_schedule(z21.shape[2], chunk))
        assert (out - ref).abs().max().item() <= 1e-4, chunk
        # every 3x3x3 conv of every step whose input a norm kernel writes: all but conv_in (the latents)
        assert st["stacked_conv"] == (n - 1) * steps
        assert st.get("upsample_phase", 0) == (3 * steps if phase else 0)
    # the pipeline's path (`vaeopt decode`: video_tiling's OOM-retrying runner, untiled plan) stacks too
    info: dict = {}
    with torch.no_grad():
        out = video.decode_video(vae, z21, 2, replan=planner.smaller_video_plan, info=info)
    assert info["stats"]["stacked_conv"] == (n - 1) * len(video.chunk_schedule(z21.shape[2], 2))
    assert (out - ref.clamp(-1, 1)).abs().max().item() <= 1e-4
    stacked_conv3d.revert(vae)
    out, st = _decode_stats(vae, z21, 2)
    assert "stacked_conv" not in st and (out - ref).abs().max().item() <= 1e-4


def test_auto_policy_and_triton_conv_handover():
    """Auto stacks the measured widths (96, 384: Wan 2.1's 21 such convs); triton_conv then says why it has no
    layers instead of claiming the 96-channel ones."""
    with torch.device("meta"):
        full = build_model(get_family("wan21"))
    convs = stacked_conv3d.candidates(full)
    assert len(convs) == 21 and {m.in_channels for m in convs} == {96, 384}
    stacked_conv3d.mark(convs)
    r = triton_conv.apply(full, device=CPU, force=True)
    assert r.status == "skipped" and "stacked" in r.detail
    assert stacked_conv3d.apply(build_model(get_family("sdxl"), block_out_channels=[8, 8, 8, 8], norm_num_groups=4),
                                device=CPU, force=True).status == "skipped"


def test_bf16_on_the_tma_kernel_leaves_the_96_channel_convs_unstacked(monkeypatch):
    """Where the TMA conv runs bf16 (sm_90; faked here) and triton_conv will run, auto stacks only the 384-channel
    convs and says where the 96-channel ones went; triton_conv then takes exactly those six, packed K-major for that
    kernel (only they: other widths and fp16 keep the pointer kernel's layout). Without triton_conv, in fp16 and
    with --stack-conv3d on the 96-channel convs stay stacked."""
    from vaeopt.kernels import tma_conv

    monkeypatch.setattr(tma_conv, "available", lambda d: True)
    with torch.device("meta"):
        full = build_model(get_family("wan21"))
    full._vaeopt_fused_epilogues = True
    r = stacked_conv3d.apply(full, device=CPU, dtype=torch.bfloat16)  # triton_conv not running (--conv-kernel off)
    assert r.data["channels"] == [96, 384] and r.data["left_to_triton_conv"] == 0, r.detail
    stacked_conv3d.revert(full)
    r = stacked_conv3d.apply(full, device=CPU, dtype=torch.bfloat16, triton_conv_runs=True)
    assert r.status == "applied" and r.data["channels"] == [384] and r.data["layers"] == 15, r.detail
    assert r.data["left_to_triton_conv"] == 6 and "6 with 96 ch left to triton_conv" in r.detail
    from vaeopt.kernels import ws_conv

    gluon = ws_conv.gluon
    monkeypatch.setattr(ws_conv, "gluon", None)  # a Triton without Gluon: the 96-ch convs on the TMA variant
    r = triton_conv.apply(full, device=CPU, force=True, dtype=torch.bfloat16)
    assert r.status == "applied" and r.data["layers"] == 6 and r.data["shapes"] == ["96->96"], r.detail
    assert "TMA variant" in r.detail and "warp-specialized" not in r.detail
    if gluon is not None:  # with Gluon the 192-ch convs join, on the warp-specialized kernel (E42)
        triton_conv.revert(full)
        monkeypatch.setattr(ws_conv, "gluon", gluon)
        r = triton_conv.apply(full, device=CPU, force=True, dtype=torch.bfloat16)
        assert r.data["layers"] == 12 and r.data["shapes"] == ["96->96", "192->192"], r.detail
        assert r.data["ws_channels"] == [96, 192]
        assert "12 causal Conv3d (96->96, 192->192 ch, 3x3x3) on the warp-specialized Gluon TMA kernel" in r.detail
    def packed(c):
        conv = wan_module().WanCausalConv3d(c, c, 3, padding=1).to(torch.bfloat16)
        conv._vaeopt_igemm = True
        x = torch.zeros(1, c, 3, 2, 2, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
        return conv, x

    conv, x = packed(96)
    assert triton_conv.packed_for(conv, x).kmajor  # the TMA kernel's weight layout
    assert not triton_conv.packed_for(*packed(64)).kmajor  # no bf16 tile at 64 ch: the pointer kernel's layout
    assert not triton_conv.packed_for(conv, x.to(torch.float16)).kmajor  # fp16: no TMA
    monkeypatch.setattr(tma_conv, "available", lambda d: False)
    assert not triton_conv.packed_for(conv, x).kmajor  # repacked in the pointer kernel's default layout
    monkeypatch.setattr(tma_conv, "available", lambda d: True)
    for kw in (dict(dtype=torch.float16), dict(dtype=torch.bfloat16, force=True)):
        stacked_conv3d.revert(full)
        triton_conv.revert(full)
        r = stacked_conv3d.apply(full, device=CPU, triton_conv_runs=True, **kw)
        assert r.data["left_to_triton_conv"] == 0 and 96 in r.data["channels"], (kw, r.detail)


def test_tma_96_implies_triton_conv_runs_there():
    """stacked_conv3d leaves the 96-ch convs unstacked where the TMA kernel runs; triton_conv must take them on every
    such GPU, or they would fall to cuDNN's slow Conv3d."""
    from vaeopt.kernels import tma_conv

    assert set(tma_conv.MEASURED_SM) <= set(triton_conv.MEASURED_SM)
    assert triton_conv.MIN_COUT <= 96 <= triton_conv.MAX_COUT


def test_estimate_counts_the_stack():
    """The dry run marks the same convs on its skeleton: at wan21-480p with 1 latent frame per call the stacked
    96-channel input (3x the staged frames) is the peak, and the estimate grows by it."""
    with torch.device("meta"):
        full = build_model(get_family("wan21"))
    cfg = json.dumps(dict(full.config), sort_keys=True, default=str)
    names = tuple(n for n, m in full.decoder.named_modules() if m in set(stacked_conv3d.candidates(full)))
    shape = (1, 16, 21, 60, 104)
    plain = estimate_peak(type(full), cfg, shape, 1, torch.bfloat16, True, True, ())
    stacked = estimate_peak(type(full), cfg, shape, 1, torch.bfloat16, True, True, names)
    # the 96-ch stack of 4 output frames at 480x832 in bf16 is 3 * 4 * 96 * 399360 * 2 B = 0.92 GB
    assert 0.2 * 2**30 < stacked - plain < 1.0 * 2**30, ((stacked - plain) / 2**30)
    # the dry run's cached skeleton keeps no marks: the unstacked estimate afterwards is the same as before
    assert estimate_peak(type(full), cfg, shape, 2, torch.bfloat16, True, True, ()) == estimate_peak.__wrapped__(
        type(full), cfg, shape, 2, torch.bfloat16, True, True, ())


def test_history_copy_is_bitwise():
    """The stack's history copies move channel rows as int64 words: bitwise equal to copy_ (NaN payloads, -0.0
    included), and the plain copy where the rows do not split into words."""
    bits = torch.randint(-(2**15), 2**15, (2, 3, 5, 8), dtype=torch.int16)
    src = bits.view(torch.bfloat16)  # arbitrary bit patterns, NaNs among them
    dst = torch.zeros(2, 3, 5, 12, dtype=torch.bfloat16)[..., 2:10]  # a row slice: strided, 4-aligned offset
    copy_lastdim(dst, src)
    assert torch.equal(dst.view(torch.int16), bits)
    odd = torch.zeros(2, 3, 5, 12, dtype=torch.bfloat16)[..., 1:9]  # offset 1: not word-aligned -> plain copy
    copy_lastdim(odd, src)
    assert torch.equal(odd.view(torch.int16), bits)
