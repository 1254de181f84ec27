"""CUDA graph capture of a whole decode for a fixed latent shape, replayed for later decodes of that shape.

Pays where launch overhead matters: small shapes and many same-shape decodes (a batch of files). The first decode
of a shape runs eagerly on a side stream (warm-up, cuDNN autotune, allocator), the second is captured; every later
decode of that shape is a replay. Graph memory comes from one private pool shared by all captured shapes.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from vaeopt.stages import StageResult

NAME = "graphs"


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "no CUDA device: CUDA graphs need a GPU"
    return True, ""


class GraphedDecode:
    """Wraps fn(z) -> Tensor. Not thread-safe; outputs are copies (safe to keep across replays)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device, warmup: int = 1):
        self.fn = fn
        self.device = device
        self.warmup = warmup
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        self.captures = 0
        self.capture_s = 0.0
        self.failed: dict[tuple, str] = {}  # shapes whose capture failed (decoded eagerly from then on): why

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        key = (tuple(z.shape), z.dtype, z.stride())
        if key in self.failed:
            return self.fn(z)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(z)
            except torch.cuda.OutOfMemoryError:
                # the caller's OOM path (a smaller plan) decodes this one; later calls of the shape go straight to
                # the eager decode instead of failing a capture again each time
                self.failed[key] = "out of memory while capturing"
                raise
            except RuntimeError as e:  # e.g. a host sync inside the decode: not capturable, decoded eagerly
                self.failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                torch.cuda.synchronize(self.device)
                return self.fn(z)
            self.graphs[key] = entry
        graph, static_in, static_out = entry
        static_in.copy_(z)
        graph.replay()
        self.replays += 1
        return static_out.clone()

    def _capture(self, z: torch.Tensor):
        t0 = time.perf_counter()
        static_in = z.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up on the capture stream's side, as the CUDA graph docs advise
            for _ in range(self.warmup):
                self.fn(static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = self.fn(static_in)
        torch.cuda.synchronize(self.device)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return graph, static_in, static_out

    def reset(self) -> None:
        self.graphs.clear()
        self.failed.clear()
        self.pool = None
        torch.cuda.empty_cache()

    def report(self) -> str:
        why = "".join(f"; {k[0]} not captured ({v}): eager" for k, v in self.failed.items())
        return (f"{self.captures} shape(s) captured in {self.capture_s * 1e3:.0f} ms (incl. warm-up), "
                f"{self.replays} replays{why}")


def apply(fn: Callable, device: torch.device, **_) -> tuple[GraphedDecode, StageResult]:
    g = GraphedDecode(fn, device)
    # Not "applied" yet: nothing is captured until the first decode; run_jobs reports what really happened.
    return g, StageResult(NAME, "skipped", "nothing captured yet: each latent shape is captured on its first decode")
