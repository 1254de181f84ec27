"""CUDA graphs for Wan clips that decode in one untiled chunk (a Qwen-Image picture: one latent frame): the decision
(vaeopt.stage_table) and the decode path. Such a decode is a pure function of its latents -- the chunk decoder is new
per decode and zeroes its causal caches inside the call -- so it is captured whole, like an image decode.

On the CPU there are no graphs: the capture is a stand-in that replays by running the captured callable again on
its static input, so these tests check the path a decode takes (the whole-decode callable, one decoder call, static
input and output buffers) and that nothing of one decode leaks into the next. The test marked gpu captures a real
graph and compares replays with eager decodes bitwise."""

import dataclasses

import pytest
import torch

from vaeopt import planner, stage_table
from vaeopt.engine.wan import ChunkDecoder
from vaeopt.families import build_model, get_family
from vaeopt.loading import LoadedVAE
from vaeopt.pipeline import DecodeStats, Options, Pipeline
from vaeopt.stage_table import DeviceInfo, decide_call_graphs, decide_graphs
from vaeopt.stages import Hint
from vaeopt.stages import graphs as graphs_stage

H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), triton=(True, ""), graphs=(True, ""), cudnn=(True, ""))
QWEN, WAN = get_family("qwenimage"), get_family("wan21")
PICTURE = (1, 16, 1, 166, 166)  # qwenimage-1328
CLIP = (1, 16, 21, 60, 104)  # wan21-480p


def _plan(mode="chunked", chunk=1):
    return planner.Plan(mode, 80 * 2**30, 2**30, chunk=chunk, tile=(30, 52) if mode == "tiled" else None)


def test_one_chunk_clip_is_a_whole_decode():
    o, on = Options(), Options(graphs="on")
    assert stage_table.one_chunk_clip(QWEN, _plan(), PICTURE)
    assert not stage_table.one_chunk_clip(QWEN, _plan("tiled"), PICTURE)  # per-tile decoders: not one call
    assert not stage_table.one_chunk_clip(WAN, _plan(chunk=2), CLIP)
    assert stage_table.one_chunk_clip(WAN, _plan(chunk=21), CLIP)  # a short clip in one chunk is one too
    assert not stage_table.one_chunk_clip(get_family("sdxl"), _plan("whole"), (1, 4, 128, 128))
    # vaeopt decode / vaeopt.decode (chunks armed for clips) and the benchmark ladder (chunks=False) alike
    for chunks in (True, False):
        assert decide_graphs(on, QWEN, H200, _plan(), PICTURE, 1, chunks).kind == "whole"
        # auto: the measured row (27.1 -> 24.2 ms replayed, ~248 ms capture on an H200) pays from 86 decodes
        d = decide_graphs(o, QWEN, H200, _plan(), PICTURE, 85, chunks)
        assert d.kind is None and "the capture pays from 86 (qwenimage-1328 bf16 on an H200" in d.why
        assert decide_graphs(o, QWEN, H200, _plan(), PICTURE, 86, chunks).kind == "whole"
    d = decide_graphs(o, QWEN, H200, _plan(), (1, 16, 1, 400, 400), 99)  # 10 MP: no row within 4x
    assert d.kind is None and d.why.startswith("no graph measurement for Qwen-Image near 10.24 MP")
    assert d.why.hints == ((Hint("graphs", "on"),),)
    assert decide_graphs(on, QWEN, H200, _plan(), None, 1, chunks=False, ).kind is None  # shape unknown
    assert decide_graphs(Options(graphs="on", decode_shape=PICTURE), QWEN, H200, _plan(), None, 1, False).kind == \
        "whole"  # the benchmark's decode_shape
    # clips of several chunks: per-chunk graphs (armed), or the reason in the benchmark's rows
    assert decide_graphs(on, WAN, H200, _plan(chunk=2), CLIP, 1).kind == "chunks"
    assert decide_graphs(on, QWEN, H200, _plan("tiled"), PICTURE, 1).kind == "chunks"
    assert decide_graphs(on, WAN, H200, _plan(chunk=2), CLIP, 1, chunks=False).why.startswith(
        "chunked decode of several chunks")
    assert decide_graphs(Options(graphs="off"), QWEN, H200, _plan(), PICTURE, 99).why == "off"


def test_call_graphs_and_the_rule_for_one_chunk_clips(monkeypatch):
    est = 10 * 2**30
    assert decide_call_graphs("on", QWEN, PICTURE, 1, est, None, plan=_plan()).kind == "whole"
    assert decide_call_graphs("on", QWEN, PICTURE, 1, est, None).kind is None  # no plan: not known to be one call
    assert decide_call_graphs("on", WAN, CLIP, 1, est, None, plan=_plan(chunk=2)).why.startswith("video decodes")
    assert decide_call_graphs("auto", QWEN, PICTURE, 99, est, 15 * 2**30, plan=_plan()).kind is None  # no room
    # with a measured row, the break-even counts every output frame of the clip
    rule = {"capture_factor": 3.0, "max_pixel_ratio": 4.0, "unmeasured_capture_margin": 4.0,
            "rows": [{"family": "qwenimage", "cls": "AutoencoderKLWan", "workload": "qwenimage-1328",
                      "pixels": 1328 * 1328, "variant": "bf16", "gpu": "NVIDIA H200", "eager_ms": 46.6,
                      "replay_ms": 41.6, "capture_ms": 150.0}]}
    monkeypatch.setattr(planner, "graphs_rule", lambda: rule)
    h200 = dict(gpu="NVIDIA H200", plan=_plan())
    assert decide_call_graphs("auto", QWEN, PICTURE, 30, est, None, **h200).kind == "whole"  # 150 / 5
    assert decide_call_graphs("auto", QWEN, PICTURE, 29, est, None, **h200).kind is None
    assert decide_call_graphs("auto", QWEN, PICTURE, 30, est, None, plan=_plan()).kind is None  # unmeasured GPU
    # 5 latent frames in one chunk: 17 output frames, 30 MP: nothing measured near it
    why = decide_call_graphs("auto", QWEN, (1, 16, 5, 166, 166), 99, est, None, plan=_plan(chunk=5)).why
    assert why.startswith("no graph measurement for Qwen-Image near 29.98 MP")


class StandInGraphs:
    """CPU stand-in for stages.graphs.GraphedDecode: the first call of a shape warms up and 'captures' the callable
    on a static input; every call copies its latents into that buffer, runs the callable again on it (a replay
    recomputes the recorded work from the static input) and hands out a copy of the static output."""

    made: list = []

    def __init__(self, fn, device, warmup: int = 1):
        self.fn, self.entries, self.replays, self.captures, self.inputs = fn, {}, 0, 0, []
        StandInGraphs.made.append(self)

    def __call__(self, z):
        key = (tuple(z.shape), z.dtype, z.stride())
        if key not in self.entries:
            static_in = z.clone()
            self.fn(static_in)  # warm-up
            self.entries[key] = (static_in, self.fn(static_in))
            self.captures += 1
        static_in, static_out = self.entries[key]
        static_in.copy_(z)
        static_out.copy_(self.fn(static_in))
        self.inputs.append(static_in)
        self.replays += 1
        return static_out.clone()

    def reset(self):
        self.entries.clear()

    def report(self):
        return f"{self.captures} captured, {self.replays} replays"


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    m = build_model(QWEN, base_dim=8)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m


def _pipe(model, monkeypatch, graphs="on"):
    monkeypatch.setattr(graphs_stage, "GraphedDecode", StandInGraphs)
    loaded = LoadedVAE(model=model, family=QWEN, layout="benchmark", path=None, notes=[], dtype_on_disk=None)
    pipe = Pipeline(loaded, Options(device="cpu", dtype="fp32", graphs=graphs))
    pipe.info = dataclasses.replace(pipe.info, graphs=(True, ""))  # as on a GPU, for the rules
    return pipe


def _steps(monkeypatch) -> list:
    calls = []
    real = ChunkDecoder.step
    monkeypatch.setattr(ChunkDecoder, "step", lambda self, z: calls.append(tuple(z.shape)) or real(self, z))
    return calls


def test_picture_decodes_through_the_whole_decode_graph(qwen, monkeypatch):
    """vaeopt decode's path: the table says whole, the decode goes through the captured callable, which runs the
    picture as one decoder call on a static input; a second picture replays the same buffers and equals its own
    eager decode bitwise (no causal cache or other state carried over from the first)."""
    g = torch.Generator().manual_seed(3)
    z1, z2 = (torch.randn(1, 16, 1, 6, 5, generator=g) for _ in range(2))
    eager = _pipe(qwen, monkeypatch, graphs="off")
    ref1, ref2 = (eager.decode(z, eager.plan(tuple(z.shape)))[0] for z in (z1, z2))
    pipe = _pipe(qwen, monkeypatch)
    plan = pipe.plan(tuple(z1.shape))
    assert plan.mode == "chunked" and plan.chunk == 1
    assert pipe.setup_graphs(plan, tuple(z1.shape), 2) is None  # no per-chunk policy armed
    g = pipe.graphed
    assert isinstance(g, StandInGraphs) and g.fn == pipe._decode_clip_raw
    assert next(s for s in pipe.stages if s.name == "graphs").detail.endswith("(forced on)")
    steps = _steps(monkeypatch)
    out1 = pipe.decode(z1, plan)[0]
    out2 = pipe.decode(z2, plan)[0]
    assert torch.equal(out1, ref1) and torch.equal(out2, ref2)
    assert g.captures == 1 and g.replays == 2 and g.inputs[0] is g.inputs[1]  # one static input buffer
    assert steps == [tuple(z1.shape)] * 4  # one decoder call each: warm-up, capture, two replays
    # a clip of three latent frames with this pipeline: not one chunk, so eager (the graph is not used)
    z3 = torch.randn(1, 16, 3, 6, 5, generator=torch.Generator().manual_seed(4))
    p3 = eager.plan(tuple(z3.shape))
    assert torch.equal(pipe.decode(z3, p3)[0], eager.decode(z3, p3)[0])
    assert g.replays == 2 and g.captures == 1


def test_counted_calls_capture_one_chunk_pictures(qwen, monkeypatch):
    """vaeopt.decode's path: calls counted per shape, a one-chunk picture captured once the rule says so ("on":
    the first call); a clip of several chunks is not counted in."""
    pipe = _pipe(qwen, monkeypatch)
    z = torch.randn(1, 16, 1, 6, 5, generator=torch.Generator().manual_seed(5))
    plan = pipe.plan(tuple(z.shape))
    pipe.count_decode(tuple(z.shape), plan)
    assert isinstance(pipe.graphed, StandInGraphs) and pipe.graphed.fn == pipe._decode_clip_raw
    out = pipe._decode_video(z, plan, None, DecodeStats())
    assert pipe.graphed.replays == 1 and torch.equal(out, pipe._decode_clip_raw(z))
    clip = (1, 16, 3, 6, 5)
    pipe.count_decode(clip, dataclasses.replace(plan, chunk=1))
    assert clip not in pipe._graph_shapes


def test_benchmark_ladder_times_the_graphs_row_for_a_picture(qwen, monkeypatch):
    """`vaeopt benchmark --workload qwenimage-1328`'s "+ CUDA graphs" row: a one-chunk picture is captured whole
    (the row is timed, through the whole-decode callable), not skipped as a chunked decode."""
    from vaeopt import benchmark as B

    monkeypatch.setattr(graphs_stage, "available", lambda device: (True, ""))
    monkeypatch.setattr(graphs_stage, "GraphedDecode", StandInGraphs)
    StandInGraphs.made.clear()
    res = B.run_benchmark(QWEN, qwen.state_dict(), (1, 16, 1, 6, 5), device=torch.device("cpu"), dtype=torch.float32,
                          peers=(), repeats=1, warmup=0, fp8=False, log=lambda s: None, workload=None, command="x",
                          model_overrides={"base_dim": 8})
    row = next(r for r in res["rows"] if r["name"] == "+ CUDA graphs")
    assert row["status"] == "ok", row["reason"]
    for name in ("+ stacked Conv3d", "+ Triton conv"):  # nothing left for them in a one-frame call
        r = next(r for r in res["rows"] if r["name"] == name)
        assert r["status"] == "skipped" and r["reason"].startswith("one latent frame in one call"), r
    assert StandInGraphs.made[-1].replays == 1 and StandInGraphs.made[-1].captures == 1
    before = [r for r in res["rows"] if r["kind"] == "ladder" and r["status"] == "ok" and r is not row][-1]
    assert row["psnr_db"] == before["psnr_db"]  # the same decode, through the captured callable


def test_benchmark_counts_the_flops_a_picture_needs():
    """TFLOP/s of a qwenimage-1328 row is work done per second: the causal convs' products with the zero history
    (2/3 of diffusers' conv FLOPs: 20.12 TFLOP in all) are not counted; a clip of several frames counts diffusers'."""
    from vaeopt.benchmark import count_flops

    assert round(count_flops(QWEN, PICTURE) / 1e12, 2) == 8.39
    assert count_flops(WAN, (1, 16, 2, 8, 8)) > 1.5 * count_flops(WAN, (1, 16, 1, 8, 8))


def test_optimized_wan_vae_graphs_repeated_pictures(qwen, monkeypatch):
    """vaeopt.optimize on a Wan VAE that a pipeline calls once per picture (one latent frame): counted, captured as a
    whole decode once the rule says it has paid (with a measured row that pays from the 2nd call here), through the
    chunk decoder in one call; a clip of several frames is not counted and decodes as before."""
    import copy

    import vaeopt
    from vaeopt import dropin

    monkeypatch.setattr(planner, "graphs_rule", lambda: {
        "capture_factor": 3.0, "max_pixel_ratio": 4.0, "unmeasured_capture_margin": 4.0,
        "rows": [{"family": "wan21", "cls": "AutoencoderKLWan", "workload": None, "pixels": 48 * 40, "variant": "bf16",
                  "gpu": "test", "eager_ms": 10.0, "replay_ms": 5.0, "capture_ms": 10.0, "source": "test"}]})
    monkeypatch.setattr(graphs_stage, "GraphedDecode", StandInGraphs)
    monkeypatch.setattr(dropin._RepeatGraphs, "_plain", lambda self, z, kw: not set(kw) - {"return_dict"})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "test")  # the row's GPU
    vae = copy.deepcopy(qwen)
    lines = []
    vaeopt.optimize(vae, log=lines.append)

    z = torch.randn(1, 16, 1, 6, 5, generator=torch.Generator().manual_seed(7))
    clip = torch.randn(1, 16, 3, 6, 5, generator=torch.Generator().manual_seed(8))
    StandInGraphs.made.clear()
    with torch.no_grad():
        outs = [vae.decode(z).sample for _ in range(3)]
        clip_out = [vae.decode(clip).sample for _ in range(3)]
    g = StandInGraphs.made[-1]
    assert g.captures == 1 and g.replays == 2  # from the 2nd call: 2 x 5 ms saved >= a 10 ms capture
    assert g.fn.__code__.co_names.count("decode_video") == 1  # the chunk decoder in one call
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert sum("graphs" in ln and "captured" in ln for ln in lines) == 1
    assert (1, 16, 3, 6, 5) not in {k[0] for k in vae.decode.graphs.shapes} and clip_out[0].shape[2] == 9
    assert g.replays == 2 and all(torch.equal(o, clip_out[0]) for o in clip_out)


@pytest.mark.gpu
def test_gpu_one_chunk_replay_equals_eager_bitwise(qwen):
    """A real capture of a tiny Qwen-Image picture decode (bf16, the stages a GPU applies: fused kernels, stacked
    convs): every replay equals the eager decode of its latents bitwise, and a replay after another picture's
    still does (the causal caches are zeroed inside the captured call)."""
    m = build_model(QWEN, base_dim=8)
    m.load_state_dict(qwen.state_dict())
    loaded = LoadedVAE(model=m, family=QWEN, layout="benchmark", path=None, notes=[], dtype_on_disk=None)
    pipe = Pipeline(loaded, Options(device="cuda", dtype="bf16", graphs="on"))
    g = torch.Generator().manual_seed(6)
    zs = [torch.randn(1, 16, 1, 40, 36, generator=g).to("cuda", torch.bfloat16) for _ in range(2)]
    plan = pipe.plan(tuple(zs[0].shape))
    pipe.setup_graphs(plan, tuple(zs[0].shape), 99)
    assert isinstance(pipe.graphed, graphs_stage.GraphedDecode)
    with torch.inference_mode():
        refs = [pipe._decode_clip_raw(z).clone() for z in zs]
        outs = [pipe._decode_video(z, plan, None, DecodeStats()) for z in (zs[0], zs[1], zs[0], zs[1])]
    assert pipe.graphed.captures == 1 and pipe.graphed.replays == 4 and not pipe.graphed.failed
    for out, ref in zip(outs, refs * 2):
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max().item()


# ---- a clip's only call of one frame: each causal conv as the Conv2d of its last temporal tap -----------------------

from test_video_fused import _structure, decode, fused21, stock21, z21  # noqa: E402,F401 (the tiny Wan 2.1 fixtures)


@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_one_frame_convs_skip_the_zero_history(fused21, stock21, z21, layout):
    """One latent frame in one call: the zero history before it meets only each causal conv's last temporal tap, so
    the conv runs as that tap's Conv2d on the frame alone (fused kernel path and torch path), within float rounding
    of diffusers' decode; a clip of several chunks keeps the staged Conv3d."""
    z1 = z21[:, :, :1].contiguous()
    with torch.no_grad():
        ref = stock21.decode(z1).sample
    n_blocks = _structure(fused21[layout])[0]
    for fused in (None, False):
        out, st = decode(fused21[layout], z1, 1, fused=fused)
        assert (out - ref).abs().max().item() <= 1e-4, (layout, fused)
        # conv_in, both convs of every block, and conv_out unless the tap kernel runs it (channels-last, fused)
        head = 0 if layout == "cl" and fused is None else 1
        assert st["single_frame_conv"] == 1 + 2 * n_blocks + head, st
    _, st = decode(fused21[layout], z21[:, :, :2].contiguous(), 1)
    assert "single_frame_conv" not in st


def test_an_optimized_wan_vae_plans_a_clip_of_several_chunks_once(qwen, monkeypatch):
    """A clip that decodes in several chunks is never captured whole (its chunks have their own graphs): the
    drop-in's graphs policy plans it on its first call and remembers, instead of planning again on every call."""
    import copy

    from vaeopt import dropin

    plans = []
    monkeypatch.setattr(dropin._RepeatGraphs, "_plain", lambda self, z, kw: True)
    monkeypatch.setattr(planner, "plan_decode", lambda fam, m, shape, *a, **k: plans.append(shape) or _plan(chunk=2))
    rg = dropin._RepeatGraphs(copy.deepcopy(qwen), QWEN)
    clip, picture = torch.zeros(1, 16, 5, 6, 5), torch.zeros(1, 16, 1, 6, 5)
    assert [rg.decode((clip,), {}) for _ in range(3)] == [None] * 3
    assert plans == [(1, 16, 5, 6, 5)] and rg.never == {((1, 16, 5, 6, 5), torch.float32)}
    monkeypatch.setattr(planner, "plan_decode", lambda fam, m, shape, *a, **k: plans.append(shape) or _plan())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert rg.decode((picture,), {}) is None and rg.decode((picture,), {}) is None  # one chunk: counted, not yet paid
    assert plans[1:] == [(1, 16, 1, 6, 5)] * 2 and rg.calls[((1, 16, 1, 6, 5), torch.float32)] == 2
