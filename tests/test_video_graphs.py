"""vaeopt.video_graphs: per-chunk CUDA graphs for Wan's chunk decoder.

On the CPU there are no CUDA graphs, so the bookkeeping is tested with a stand-in backend (`StandIn`) that keeps
the two properties of a real capture that the wrapper must respect: capturing runs nothing (the stand-in runs the
call and then restores the causal caches), and a replay recomputes the recorded call from the static input buffer
into the same static output tensor (so a missing input copy gives a wrong chunk, and a missing output copy lets a
later replay overwrite what a consumer holds). The fallback reasons (CPU, tiled plans, too few steady chunks,
budget, OOM during capture) and the pipeline's stage line are tested for real. Tests marked gpu capture real CUDA
graphs and compare replayed with eager output bitwise.

Data: the trained tiny Wan 2.1 and its real latents ('astronaut_pan', 6x6 latent crop, 5 latent frames -> 17 frames).
"""

import json

import pytest
import torch

from vaeopt import planner, video, video_graphs
from vaeopt import video_tiling as vt
from vaeopt.engine.wan import ChunkDecoder
from vaeopt.stage_table import DeviceInfo, chunk_graphs

from test_video_tiling import _wan21, wan21, z21  # noqa: F401 (the same tiny Wan, 6x6 crop and fixtures)


# the stand-in backend captures on the CPU: the table is told the device has CUDA graphs
STAND_IN = DeviceInfo("cpu", graphs=(True, ""))


def policy(mode, info=STAND_IN, **kw):
    return chunk_graphs(mode, info, **kw)


def gpu():
    return DeviceInfo.of(torch.device("cuda"))


@pytest.fixture(scope="module")
def refs(wan21, z21):
    return {c: video.decode_video(wan21, z21, c) for c in (1, 2)}


class StandIn:
    """CPU stand-in for video_graphs._CudaBackend (see the module docstring)."""

    cuda = False

    def __init__(self, reserved_after_capture: int = 0, fail: BaseException | None = None):
        self.captures = self.replays = self.warmups = self.drains = self.releases = 0
        self._reserved = 0
        self.reserved_after_capture = reserved_after_capture
        self.fail = fail

    def warmup(self, fn, dec):
        self.warmups += 1
        return fn()

    def drain(self):
        self.drains += 1

    def reserved(self):
        return self._reserved

    def capture(self, fn, dec):
        keys = set(dec.cache)
        snap = {k: v.clone() for k, v in dec.cache.items()}
        first = dec.first
        try:
            out = fn()
        finally:  # a real capture runs nothing: the caches must not have moved, whatever happened
            for k, v in snap.items():
                dec.cache[k].copy_(v)
            dec.first = first
        if self.fail is not None:
            raise self.fail
        assert set(dec.cache) == keys, "a cache was created during capture (the warm-up must create them all)"
        self.captures += 1
        self._reserved = self.reserved_after_capture
        return (fn, out, dec), out

    def replay(self, graph):
        fn, out, dec = graph
        self.replays += 1
        stats = dict(dec.stats)  # a replay runs kernels, not the Python step: it counts nothing
        out.copy_(fn())
        dec.stats.clear()
        dec.stats.update(stats)

    def release(self):
        self.releases += 1

    def sync(self):
        pass


class _Made(list):
    kw: dict


@pytest.fixture
def stand_in(monkeypatch):
    """video_graphs.backend_for -> a new StandIn(**made.kw) per clip; -> the list of those made."""
    made = _Made()
    made.kw = {}

    def backend_for(device):
        made.append(StandIn(**made.kw))
        return made[-1]

    monkeypatch.setattr(video_graphs, "backend_for", backend_for)
    return made


# --- replays == eager, bookkeeping ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk,replays", [(1, 3), (2, 1)])
def test_replays_equal_eager_and_are_counted(wan21, z21, refs, stand_in, chunk, replays):
    pol = policy("on")
    out = video.decode_video(wan21, z21, chunk, graphs=pol)
    assert torch.equal(out, refs[chunk])
    (rec,) = pol.clips
    # schedule [1,1,1,1,1] / [1,2,2]: first eager, the first steady chunk is the warm-up, then capture + replays
    assert rec["status"] == "captured" and rec["captures"] == 1
    assert rec["replays"] == replays and rec["eager_chunks"] == 2
    assert rec["latent_chunk"] == [1, 16, chunk, 6, 6]
    be = stand_in[-1]
    assert (be.warmups, be.captures, be.replays, be.releases) == (1, 1, replays, 1)
    # cached segments are returned before the warm-up (other stream) and before the capture (the pool)
    assert be.drains == 2


def test_pipeline_path_with_arena(wan21, z21, refs, stand_in):
    """The pipeline's route (video_tiling.iter_raw: caches from one block, OOM fallback armed) with graphs; the raw
    chunks are held by the caller across later replays and must not change (each is a copy of the static output)."""
    pol = policy("on")
    info: dict = {}
    held = [(f0, y) for f0, y in vt.iter_raw(wan21, z21, 1, replan=planner.smaller_video_plan, info=info, graphs=pol)]
    assert info["graphs"]["replays"] == 3 and info["graphs"] is pol.clips[-1]
    assert len({y.data_ptr() for _, y in held}) == len(held)
    out = torch.cat([y for _, y in held], 2).clamp(-1, 1)
    assert torch.equal(out, refs[1])


def test_streaming_iterator(wan21, z21, refs, stand_in):
    frames = list(video.iter_decode_video(wan21, z21, 1, output="float", graphs=policy("on")))
    assert torch.equal(torch.cat(frames, 2), refs[1])


def test_fused_path_stats_match_eager(samples_dir, stand_in):
    """The fused kernel path (interpreter): replayed chunks add the captured call's kernel counts, so the decoder's
    stats equal the eager decode's; the output is identical."""
    from vaeopt.kernels import triton_available
    from vaeopt.stages import fused_epilogues, fused_norms

    ok, why = triton_available("cpu")
    if not ok:
        pytest.skip(why)
    vae = _wan21(samples_dir)
    if fused_norms.apply(vae).status != "applied":
        pytest.skip("fused norms not applied")
    assert fused_epilogues.apply(vae).status == "applied"
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    z = lat["coffee_zoom"].float()[:, :, :, 10:12, 20:22].contiguous()
    runs = {}
    for name, g in (("eager", "off"), ("graphs", policy("on"))):
        info: dict = {}
        out = video.decode_video(vae, z, 1, graphs=g, replan=planner.smaller_video_plan, info=info)
        runs[name] = (out, info["stats"])
    assert torch.equal(runs["graphs"][0], runs["eager"][0])
    assert runs["eager"][1]["fused_blocks"] == 14 * 5
    assert runs["graphs"][1] == runs["eager"][1]


# --- fallbacks and their reasons ---------------------------------------------------------------------------------


def test_cpu_decodes_eagerly_with_the_reason(wan21, z21, refs):
    pol = policy("on", DeviceInfo.of(torch.device("cpu")))
    out = video.decode_video(wan21, z21, 1, graphs=pol)
    assert torch.equal(out, refs[1])
    (rec,) = pol.clips
    assert rec["status"] == "skipped" and rec["reason"] == "CPU decode: CUDA graphs need a GPU"
    assert rec["captures"] == rec["replays"] == 0
    status, detail, data = pol.report()
    assert status == "skipped" and "CPU decode: CUDA graphs need a GPU" in detail and data["captures"] == 0


def test_policies(stand_in):
    assert video_graphs.resolve(object(), "off") is None and video_graphs.resolve(object(), None) is None
    with pytest.raises(ValueError, match="stage_table.chunk_graphs"):
        video_graphs.resolve(object(), "on")


def test_tiled_plan_runs_eagerly_with_the_reason(wan21, z21, refs, stand_in):
    pol = policy("on")
    info: dict = {}
    out = video.decode_video(wan21, z21, 1, tile=(3, 6), split=3, graphs=pol, info=info)
    assert (out - refs[1]).abs().max().item() <= 2e-6
    assert info["graphs"]["status"] == "skipped" and "spatially tiled plan (2 tiles)" in info["graphs"]["reason"]
    assert not stand_in or stand_in[-1].captures == 0


def test_budget_is_checked_before_and_after_capture(wan21, z21, refs, stand_in):
    # before: the dry-run estimate of the graph's working set does not fit the budget -> no capture
    pol = policy("on", budget_bytes=1)
    assert torch.equal(video.decode_video(wan21, z21, 1, graphs=pol), refs[1])
    rec = pol.clips[-1]
    assert rec["status"] == "skipped" and "would exceed the 0.00 GiB budget: eager" in rec["reason"]
    assert stand_in[-1].captures == 0 and rec["eager_chunks"] == 5
    # after: the pool the capture made pushed reserved memory over the budget -> graph dropped
    stand_in.kw["reserved_after_capture"] = 2**40
    pol = policy("on", budget_bytes=2**39)
    assert torch.equal(video.decode_video(wan21, z21, 1, graphs=pol), refs[1])
    rec = pol.clips[-1]
    assert rec["status"] == "skipped" and "over the 512.00 GiB budget: dropped, eager" in rec["reason"]
    assert rec["pool_bytes"] == 2**40 and rec["replays"] == 0 and rec["eager_chunks"] == 5


def test_oom_during_capture_falls_back_to_eager(wan21, z21, refs, stand_in):
    stand_in.kw["fail"] = torch.OutOfMemoryError("CUDA out of memory (injected)")
    pol = policy("on")
    info: dict = {}
    out = video.decode_video(wan21, z21, 1, graphs=pol, replan=planner.smaller_video_plan, info=info)
    assert torch.equal(out, refs[1])  # the chunk whose capture failed ran eagerly, and so did the rest
    rec = pol.clips[-1]
    assert rec["status"] == "fallback" and rec["reason"] == "out of memory during capture: eager"
    assert rec["captures"] == rec["replays"] == 0 and rec["eager_chunks"] == 5
    assert not info["oom_events"]  # a capture OOM is not a decode OOM: no re-plan
    status, detail, _ = pol.report()
    assert status == "fallback" and "out of memory during capture" in detail


# --- the pipeline's stage line --------------------------------------------------------------------------------


def _cli(tmp_path, samples_dir, z21, name, *extra):
    from typer.testing import CliRunner

    from vaeopt.cli import app

    torch.save(z21, tmp_path / "clip.pt")
    r = CliRunner().invoke(app, [str(a) for a in ("decode", tmp_path / "clip.pt", "--model",
                                                  samples_dir / "tiny_wan_video.safetensors", "--latent-space",
                                                  "raw", "-o", tmp_path / f"{name}.safetensors", "--json", "-v", *extra)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    j = json.loads(r.stdout)
    stage = next(s for s in j["stages"] if s["name"] == "graphs")
    return load_file(str(tmp_path / f"{name}.safetensors"))["sample"], stage, r.output


def test_cli_stage_line_on_cpu(tmp_path, samples_dir, z21):
    _, stage, _ = _cli(tmp_path, samples_dir, z21, "cpu", "--chunk", "1", "--device", "cpu")  # (GPU machines too)
    assert stage["status"] == "skipped" and stage["detail"] == "no CUDA device: CUDA graphs need a GPU"


def test_cli_stage_line_with_graphs(tmp_path, samples_dir, z21, stand_in, monkeypatch):
    from vaeopt.stages import graphs as graphs_stage

    monkeypatch.setattr(graphs_stage, "available", lambda device: (True, ""))
    off, stage_off, _ = _cli(tmp_path, samples_dir, z21, "off", "--chunk", "1", "--graphs", "off")
    assert stage_off["status"] == "skipped" and stage_off["detail"] == "off"
    on, stage, out = _cli(tmp_path, samples_dir, z21, "on", "--chunk", "1", "--graphs", "on")  # 4 steady chunks
    assert torch.equal(on, off)
    assert stage["status"] == "applied", stage
    d = stage["detail"]
    assert "1 of 1 clip(s) captured (chunk (1, 16, 1, 6, 6))" in d and "3 replays, 2 eager chunks" in d
    assert "graph pool 0.00 GiB" in d and "GiB budget" in d
    assert "per-chunk graphs armed (on" in " ".join(out.split())  # the line before the decodes
    _, stage2, out2 = _cli(tmp_path, samples_dir, z21, "auto", "--chunk", "1")  # auto: 4 steady chunks < 8
    assert "per-chunk graphs armed (auto" in " ".join(out2.split())
    assert stage2["status"] == "skipped" and "auto captures from 8" in stage2["detail"]


# --- CUDA -------------------------------------------------------------------------------------------------------


def _gpu_tiny(samples_dir, dtype):
    from vaeopt.stages import fused_epilogues, fused_norms

    vae = _wan21(samples_dir).to("cuda").to(dtype)
    assert fused_norms.apply(vae).status == "applied"
    assert fused_epilogues.apply(vae).status == "applied"
    for m in vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
    return vae


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_replayed_equals_eager_bitwise(samples_dir, dtype):
    vae = _gpu_tiny(samples_dir, dtype)
    z = torch.load(samples_dir / "tiny_wan_video_latents.pt")["astronaut_pan"].to("cuda", dtype)  # (1,16,5,h,w)
    for chunk in (1, 2):
        with torch.inference_mode():
            ref = video.decode_video(vae, z, chunk, graphs="off", replan=planner.smaller_video_plan, info={})
            pol = policy("on", gpu())
            info: dict = {}
            out = video.decode_video(vae, z, chunk, graphs=pol, replan=planner.smaller_video_plan, info=info)
            frames = list(video.iter_decode_video(vae, z, chunk, graphs=policy("on", gpu()),
                                                 replan=planner.smaller_video_plan, info={}))
            eager = list(video.iter_decode_video(vae, z, chunk, graphs="off", replan=planner.smaller_video_plan,
                                                 info={}))
        rec = pol.clips[-1]
        assert rec["status"] == "captured" and rec["replays"] == (3 if chunk == 1 else 1), rec
        assert rec["pool_bytes"] > 0 and rec["capture_ms"] is not None
        assert torch.equal(out, ref), (chunk, (out.float() - ref.float()).abs().max().item())
        assert all(torch.equal(a, b) for a, b in zip(frames, eager))
        assert info["stats"]["fused_blocks"] == 14 * len(video.chunk_schedule(5, chunk))


@pytest.mark.gpu
def test_gpu_capture_failure_and_budget(samples_dir, monkeypatch):
    vae = _gpu_tiny(samples_dir, torch.bfloat16)
    z = torch.load(samples_dir / "tiny_wan_video_latents.pt")["astronaut_pan"].to("cuda", torch.bfloat16)
    with torch.inference_mode():
        ref = video.decode_video(vae, z, 1, graphs="off")
        # the pool would not fit: no capture
        pol = policy("on", gpu(), budget_bytes=1)
        assert torch.equal(video.decode_video(vae, z, 1, graphs=pol), ref)
        assert pol.clips[-1]["status"] == "skipped" and "budget" in pol.clips[-1]["reason"]
        # an OOM inside the capture: the capture is ended, the stream usable, the clip finished eagerly
        real = ChunkDecoder.step

        def step(self, zc):
            if torch.cuda.is_current_stream_capturing():
                raise torch.OutOfMemoryError("CUDA out of memory (injected during capture)")
            return real(self, zc)

        monkeypatch.setattr(ChunkDecoder, "step", step)
        pol = policy("on", gpu())
        assert torch.equal(video.decode_video(vae, z, 1, graphs=pol), ref)
    assert pol.clips[-1]["status"] == "fallback" and "out of memory during capture" in pol.clips[-1]["reason"]
