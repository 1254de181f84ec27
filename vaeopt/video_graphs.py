"""Per-chunk CUDA graphs for Wan's chunked video decode (vaeopt.engine.wan's `ChunkDecoder`).

Every decoder call after a clip's first has one static shape by the chunk schedule's construction ([1, K, K, ...]
for Wan's usual T = 1 + 4n), and all state a call carries to the next -- the causal caches -- lives in static
buffers updated in place. So one such call can be captured once per clip and replayed for the others:

    call 0 (the first chunk: other shape, 'Rep' frame)      eager
    call 1 (first steady chunk)                            eager, on the capture stream: the warm-up (Triton
                                                           compiles, packed weights, cuDNN plans, caches created)
    call 2                                                 captured (nothing runs), then replayed with its data
    calls 3..                                              replayed; a chunk of another shape runs eagerly

Replays read the latent chunk from a static input buffer (copied in on the compute stream) and hand out a copy of
the graph's static output, so a consumer may keep what it got across later replays. The replayed kernels are the
eager path's own, so replayed output equals eager output bitwise (tests/test_video_graphs.py; on the GPU in
benchmarks/decode_video.py's graphs variant; docs/experiments.md E14).

Memory: the graph's intermediates live in a private pool about the size of one eager call's reserved transient
segments (POOL_FACTOR). Cached segments are returned to the device (empty_cache) before the warm-up (the capture
stream cannot reuse the compute stream's segments) and before the capture, so the warm-up's and the pool's memory
take the place of the eager transients instead of adding to them. The capture is skipped when reserved memory + the
estimated pool would exceed the decode's VRAM budget (the planner's, vaeopt.planner); a graph whose pool pushed
reserved memory over the budget is dropped. An out-of-memory error (or any other error) during capture ends the
capture and the clip goes on eagerly, with the reason recorded. The graph and its pool are freed at the end of the
clip; the capture stream is one per device for the process (each new stream would keep its own cuBLAS workspace).

Which clips are captured is the stage table's rule (vaeopt.stage_table.decide_chunk_graphs: not CPU decodes,
spatially tiled plans, clips with too few steady chunks, decodes already inside a capture; in auto mode not clips
too large to gain); a `ChunkGraphs` carries it, bound to the mode and the device (stage_table.chunk_graphs).

A `ChunkGraphs` attached to the model (`enable`, by Pipeline.setup_graphs) is read by vaeopt.video at each clip; it
keeps one record per clip and renders the graphs stage line. Measurements: docs/video.md, docs/experiments.md E14.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vaeopt.engine.memory import estimate_chunk_bytes
from vaeopt.engine.regions import spatial_factor
from vaeopt.engine.stats import OOM_ERRORS
from vaeopt.engine.wan_ops import temporal_factor
from vaeopt.stages import join

__all__ = ["ChunkGraphs", "GraphedSteps", "disable", "enable", "resolve"]

ATTR = "_vaeopt_chunk_graphs"
# The graph's pool measured 2.0-2.5x the dry run's live bytes (minus caches) on the H200 at 128x128 to 480p (E14):
# the caching allocator's segments, as for eager decodes. The budget check before capture uses this factor.
POOL_FACTOR = 2.5


class ChunkGraphs:
    """Per-chunk graphs for a model's video decodes and what they did: one record per clip (decode attempt).

    mode: "on", "auto" or "off"; rule(sched, tiles, chunk_pixels, capturing) -> (capture this clip?, why): the
    table's (stage_table.chunk_graphs). budget_bytes: the VRAM budget the planner planned the decode for (None: not
    checked beyond the device's own limit)."""

    def __init__(self, mode: str, rule: Callable, budget_bytes: int | None = None):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"graphs mode must be auto, on or off, not {mode!r}")
        self.mode = mode
        self.rule = rule
        self.budget_bytes = budget_bytes
        self.clips: list[dict] = []

    def new_record(self, z: Tensor, sched: Sequence[int], tiles: int, use: bool, why: str) -> dict:
        k = sched[1] if len(sched) > 1 else sched[0]
        rec = {"latent_chunk": [int(z.shape[0]), int(z.shape[1]), int(k), int(z.shape[3]), int(z.shape[4])],
               "chunks": len(sched), "tiles": tiles, "status": "armed" if use else "skipped", "reason": why,
               "captures": 0, "replays": 0, "eager_chunks": 0, "capture_ms": None, "pool_bytes": None,
               "reserved_after_capture": None, "budget_bytes": self.budget_bytes}
        self.clips.append(rec)
        return rec

    # -- the stage line ------------------------------------------------------------------------------------------
    def report(self) -> tuple[str, str, dict]:
        """(status, detail, data) for the graphs stage line: applied with measured numbers when a clip was
        captured, else skipped / fallback with the reason(s)."""
        cap = [r for r in self.clips if r["captures"]]
        data = {"clips": len(self.clips), "captures": sum(r["captures"] for r in self.clips),
                "replays": sum(r["replays"] for r in self.clips),
                "eager_chunks": sum(r["eager_chunks"] for r in self.clips)}
        if not self.clips:
            return "skipped", "no Wan video clip was decoded", data
        others = collections.Counter(r["reason"] for r in self.clips if not r["captures"])
        why = join(*(p for i, (r, n) in enumerate(others.items())
                     for p in (("; " if i else ""), r, f" ({n} clips)" if n > 1 else "")))
        if not cap:
            failed = any(r["status"] == "fallback" for r in self.clips)
            return ("fallback" if failed else "skipped"), "per-chunk graphs: " + why, data
        ms = [r["capture_ms"] for r in cap]
        pool = max(r["pool_bytes"] or 0 for r in cap)
        res = max(r["reserved_after_capture"] or 0 for r in cap)
        budget = next((r["budget_bytes"] for r in cap if r["budget_bytes"]), None)
        shapes = sorted({tuple(r["latent_chunk"]) for r in cap})
        data.update(capture_ms=ms, pool_bytes=pool, reserved_after_capture=res, budget_bytes=budget)
        detail: str = (f"per-chunk: {len(cap)} of {len(self.clips)} clip(s) captured (chunk "
                  f"{', '.join(str(s) for s in shapes)}), capture {_fmt_ms(ms)} ms, "
                  f"{data['replays']} replays, {data['eager_chunks']} eager chunks (first + warm-up per clip); "
                  f"graph pool {pool / 2**30:.2f} GiB, reserved {res / 2**30:.1f} GiB after capture"
                  + (f" of the {budget / 2**30:.1f} GiB budget" if budget else ""))
        if others:
            detail = join(detail, "; not captured: ", why)
        return "applied", detail, data


def _fmt_ms(ms: list[float]) -> str:
    return f"{ms[0]:.0f}" if len(ms) == 1 else f"{min(ms):.0f}-{max(ms):.0f}"


def enable(vae, pol: ChunkGraphs) -> ChunkGraphs:
    """Attach a per-chunk graph policy to a Wan VAE: its later decodes through vaeopt.video / the pipeline use it."""
    setattr(vae, ATTR, pol)
    return pol


def disable(vae) -> None:
    if hasattr(vae, ATTR):
        delattr(vae, ATTR)


def resolve(vae, graphs) -> ChunkGraphs | None:
    """The policy for a decode call: `graphs` None -> the model's (enable()), else off; "off"/False -> None; a
    ChunkGraphs (stage_table.chunk_graphs: what it did goes to info["graphs"]) as is."""
    if graphs is None:
        return getattr(vae, ATTR, None)
    if isinstance(graphs, ChunkGraphs):
        return graphs
    if graphs is False or graphs == "off":
        return None
    raise ValueError(f"graphs must be None, 'off' or a ChunkGraphs (vaeopt.stage_table.chunk_graphs), not {graphs!r}")


# ---------------------------------------------------------------------------------------------------------------
# Capture / replay backend (CUDA); tests substitute a CPU stand-in through backend_for


class _CudaBackend:
    cuda = True

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = _capture_stream(device)  # warm-up and capture stream

    def main(self):
        return torch.cuda.current_stream(self.device)

    def warmup(self, fn, dec) -> Tensor:
        """fn() on the capture stream, ordered after the compute stream's work and before its later work."""
        main = self.main()
        before = {id(t) for t in dec.cache.values()}
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            y = fn()
        main.wait_stream(self.stream)
        y.record_stream(main)  # allocated on the capture stream, consumed on the compute stream
        for t in dec.cache.values():  # caches created by this call live on, used by the compute stream
            if id(t) not in before:
                t.record_stream(main)
        return y

    def drain(self) -> None:
        """Wait for the queued work and return the cached free segments (the eager transients), so the graph's
        pool takes their place instead of adding to them."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def capture(self, fn, dec):
        """-> (graph, static output). Records fn() on the capture stream into a graph with its own memory pool;
        nothing runs. Errors (out of memory, ...) end the capture first and are raised."""
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        self.stream.wait_stream(self.main())
        err = out = None
        with torch.cuda.stream(self.stream):
            # thread_local: the MP4 writer's thread may call into CUDA (pinned host memory) meanwhile
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException as e:  # noqa: BLE001 - the capture must be ended whatever happened
                err = e
            try:
                graph.capture_end()
            except BaseException as e:  # noqa: BLE001
                err = err or e
        self.main().wait_stream(self.stream)
        if err is not None:
            del graph, out
            raise err
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()

    def release(self) -> None:
        """After the graph is destroyed: a dead pool's segments stay reserved (unusable by other pools) until the
        allocator's cache is emptied."""
        torch.cuda.empty_cache()

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device):
    """One warm-up/capture stream per device for the process: every new stream gets its own cuBLAS workspace
    (32 MiB on Hopper) that PyTorch keeps for good; a stream per clip made reserved memory grow by that much per
    clip on the H200 (run 2 of h200_wan_graphs_2026-11-21*.json)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _STREAMS.get(idx)
    if s is None:
        s = _STREAMS[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
    return s


def backend_for(device: torch.device):
    """The capture backend for a device: CUDA only (None elsewhere: the clip decodes eagerly)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _CudaBackend(device)




# ---------------------------------------------------------------------------------------------------------------
# The graphed decoder


class GraphedSteps:
    """Wraps a `ChunkDecoder` (same `step` / `stats`): the clip's first call and calls of another shape run eagerly,
    the first steady call is the warm-up on the capture stream, the second is captured and every steady call from
    then on is a replay. `finish()` ends the clip: totals into the record, the graph and its pool freed."""

    def __init__(self, dec, vae, z: Tensor, sched: Sequence[int], policy: ChunkGraphs, record: dict, use: bool):
        self.dec = dec
        self.vae = vae
        self.policy = policy
        self.rec = record
        self.sched = list(sched)
        self.K = self.sched[1] if len(self.sched) > 1 else self.sched[0]
        self.full_shape = tuple(z.shape)
        self.backend = backend_for(z.device) if use else None
        self.state = "cold" if use and self.backend is not None else "off"
        self.calls = 0
        self.key = None
        self.graph = self.static_in = self.static_out = None
        self.delta: collections.Counter = collections.Counter()

    @property
    def stats(self) -> collections.Counter:
        return self.dec.stats

    def __getattr__(self, name):  # everything else (cache, first, mf, arena, ...) is the decoder's
        if name == "dec":
            raise AttributeError(name)
        return getattr(self.dec, name)

    def step(self, z: Tensor) -> Tensor:
        i = self.calls
        self.calls += 1
        key = (tuple(z.shape), z.dtype, z.device)
        if i == 1:
            self.key = key
        if self.state == "off" or i == 0 or key != self.key:
            self.rec["eager_chunks"] += 1
            return self.dec.step(z)
        if self.state == "cold":
            self.rec["eager_chunks"] += 1
            # The capture stream cannot reuse the compute stream's cached segments (the caching allocator keeps
            # them per stream): return them first, or the warm-up's transients would stack on top of them
            # (measured on the H200: 7.1 -> 11.6 GiB peak reserved at wan21-480p).
            t = time.perf_counter()
            self.backend.drain()
            self.rec["warmup_drain_ms"] = round((time.perf_counter() - t) * 1e3, 2)
            y = self.backend.warmup(lambda: self.dec.step(z), self.dec)
            self.state = "warm"
            return y
        if self.state == "warm":
            if not self._capture(z):
                self.state = "off"
                self.rec["eager_chunks"] += 1
                return self.dec.step(z)
            self.state = "graphed"
        self.static_in.copy_(z)
        self.backend.replay(self.graph)
        self.stats.update(self.delta)  # what the captured call counted, once per replay
        self.rec["replays"] += 1
        return self.static_out.clone()  # the next replay overwrites static_out

    def _capture(self, z: Tensor) -> bool:
        """Capture one steady call; False (reason recorded, graph memory freed) when it cannot be."""
        be, rec, budget = self.backend, self.rec, self.policy.budget_bytes
        need = self._pool_estimate(z)  # (cached dry run: the planner made it) before the GPU is drained
        t0 = time.perf_counter()
        be.drain()
        t1 = time.perf_counter()
        r0 = be.reserved()
        if budget is not None and r0 + need > budget:
            rec.update(status="skipped", reason=(
                f"graph pool (est. {need / 2**30:.2f} GiB) on top of {r0 / 2**30:.2f} GiB reserved would exceed "
                f"the {budget / 2**30:.2f} GiB budget: eager"))
            return False
        static_in = torch.empty_like(z, memory_format=self.dec.mf).copy_(z)
        before = collections.Counter(self.dec.stats)
        first = self.dec.first
        try:
            graph, out = be.capture(lambda: self.dec.step(static_in), self.dec)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager, with its reason
            self._restore(before, first)
            be.drain()
            what = "out of memory during capture" if isinstance(e, OOM_ERRORS) else \
                f"capture failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
            rec.update(status="fallback", reason=f"{what}: eager")
            return False
        self.delta = collections.Counter({k: v - before.get(k, 0) for k, v in self.dec.stats.items()
                                          if v - before.get(k, 0) > 0})
        self._restore(before, first)  # nothing ran: the replays will count
        be.sync()
        t2 = time.perf_counter()
        r1 = be.reserved()
        # capture_ms: the GPU sits idle meanwhile (drain_ms: waiting for the queued chunks + returning segments)
        rec.update(pool_bytes=max(0, r1 - r0), reserved_after_capture=r1, capture_ms=round((t2 - t1) * 1e3, 2),
                   drain_ms=round((t1 - t0) * 1e3, 2), pool_estimate_bytes=need)
        if budget is not None and r1 > budget:
            del graph, out
            be.drain()
            rec.update(status="skipped", reason=(f"graph pool of {(r1 - r0) / 2**30:.2f} GiB put reserved memory at "
                                                 f"{r1 / 2**30:.2f} GiB, over the {budget / 2**30:.2f} GiB budget: "
                                                 "dropped, eager"))
            return False
        self.graph, self.static_in, self.static_out = graph, static_in, out
        rec.update(status="captured", captures=rec["captures"] + 1)
        return True

    def _restore(self, before: collections.Counter, first: bool) -> None:
        self.dec.stats.clear()
        self.dec.stats.update(before)
        self.dec.first = first

    def _pool_estimate(self, z: Tensor) -> int:
        """The graph's pool by the dry run: POOL_FACTOR x (the steady call's peak live bytes minus the causal
        caches, which exist already). 0 when no estimate can be made (the post-capture check still applies)."""
        try:
            dec = self.dec
            est = estimate_chunk_bytes(self.vae, self.full_shape, self.K, z.dtype,
                                             channels_last=dec.mf is torch.channels_last_3d,
                                             fused=dec._kernels_on(z))
        except Exception:  # noqa: BLE001 - an estimate is a convenience here
            return 0
        return int(POOL_FACTOR * max(0, est - sum(t.nbytes for t in self.dec.cache.values())))

    def finish(self) -> dict:
        """End of the clip: graph and static buffers freed. -> the clip's record."""
        if self.rec["status"] == "armed":  # never got to capture (e.g. the schedule changed shape)
            self.rec.update(status="skipped", reason="no second steady chunk reached: eager")
        if self.graph is not None:
            self.graph = self.static_in = self.static_out = None
            self.backend.release()  # the pool's segments go back to the device now, not at the next OOM
        return self.rec


def _chunk_pixels(vae, z: Tensor, sched: Sequence[int]) -> int | None:
    """Output pixels of one steady call: batch x 4K frames x H x W."""
    try:
        k = sched[1] if len(sched) > 1 else sched[0]
        f = spatial_factor(vae)
        return int(z.shape[0] * temporal_factor(vae) * k * z.shape[3] * f * z.shape[4] * f)
    except Exception:  # noqa: BLE001 - a module layout the tiler does not know: no size bound
        return None


def wrap(dec, vae, z: Tensor, sched: Sequence[int], graphs=None, tiles: int = 1, info: dict | None = None):
    """`dec` itself when no graph policy applies to this decode, else a GraphedSteps around it. The decision and,
    later, what happened go to the policy's record for this clip (and to info["graphs"])."""
    pol = resolve(vae, graphs)
    if pol is None:
        return dec
    capturing = z.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    use, why = pol.rule(sched, tiles, _chunk_pixels(vae, z, sched), capturing)
    rec = pol.new_record(z, sched, tiles, use, why)
    if info is not None:
        info["graphs"] = rec
    if not use:
        return dec
    return GraphedSteps(dec, vae, z, sched, pol, rec, use)


# ---------------------------------------------------------------------------------------------------------------
# The graphs stage for Wan video in the pipeline (Pipeline.setup_graphs arms it; vaeopt.api runs the decodes)


def applies(pipe) -> bool:
    """Wan video: vaeopt.video's chunk decoder runs, so graphs are per chunk (not the whole-decode GraphedDecode)."""
    return pipe.family.cls_name == "AutoencoderKLWan"


def report_to(pipe, pol: ChunkGraphs) -> None:
    """Replace the armed graphs stage line by what happened (measured numbers or the reasons) and log it."""
    status, detail, data = pol.report()
    for s in pipe.stages:
        if s.name == "graphs":
            s.status, s.detail, s.data = status, detail, data
            pipe.log(s.line(pipe.spell))
            return
