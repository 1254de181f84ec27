"""Where a tiled decode keeps its full activations: a store of regions, local or on the host, buffer by buffer.

The image tiler computes one pass over a whole activation tile by tile. Each tile reads a region of the
activation it depends on, widened by the conv's halo (vaeopt.engine.regions), from the store. The store is the
"local store and crop" halo source: a band-parallel decode instead gets the rows beyond a band's edges from the
neighbour ranks (vaeopt.engine.halo). An activation carries its GroupNorm statistics (vaeopt.engine.stats) and
the bias its producer still owes.

Placement (:func:`place`): which buffers stay on the compute device when not all of them fit. A buffer the device
cannot hold goes to pinned host memory; the store moves regions of host buffers and hands out views of device ones,
so one decode may mix both. :func:`fast_pinning` makes the page-locking of new host buffers cheaper, and
:class:`PinAhead` moves it off the decode's path: the host blocks are page-locked on a thread of their own while the
first passes (which need none of them) run.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from contextlib import ExitStack, contextmanager
from typing import Iterator, Sequence

import torch

from vaeopt.engine.stats import KernelStats, Moments

MAX_INFLIGHT_WRITES = 2  # device->host tile writes allowed in flight before the host waits (bounds memory)
PIN_THREADS = 8  # threads that fault in a new pinned buffer's pages before cudaHostRegister (torch's own option)
PIN_AHEAD_ENV = "VAEOPT_PIN_AHEAD"  # "off": each host buffer is page-locked when the decode allocates it


def place(buffers: Sequence[tuple[int, int, int]], device_bytes: float) -> list[bool]:
    """Which buffers live on the compute device (True) and which on the host (False).

    ``buffers``: (bytes, step allocated, step freed) of each full-size buffer of a decode, in allocation order.
    Costliest first, a buffer stays on the device when the device buffers alive at every step of its life still fit
    ``device_bytes``. A host buffer costs its bytes in pinning time once and in bus traffic on every pass that
    writes or reads it: its bytes times its lifetime in steps (the longer it lives, the more passes touch it). A
    buffer that does not fit beside the costlier ones may still fit at other steps, when they are gone."""
    placed: list[tuple[int, int, int]] = []
    out = [False] * len(buffers)
    for i in sorted(range(len(buffers)), key=lambda j: -buffers[j][0] * (buffers[j][2] - buffers[j][1])):
        nb, a, f = buffers[i]
        points = [a] + [pa for _, pa, _ in placed if a < pa < f]
        worst = max(sum(pb for pb, pa, pf in placed if pa <= s < pf) for s in points)
        if worst + nb <= device_bytes:
            placed.append((nb, a, f))
            out[i] = True
    return out


_PIN_KEYS = ("pinned_use_cuda_host_register", "pinned_num_register_threads")


def _user_pinning_settings() -> bool:
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return any(k in conf for k in _PIN_KEYS)


def _allocator_settings():
    """torch's run-time allocator settings (getter, setter): the accelerator API, or the CUDA one before it."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if put is None:
        put = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    return get, put


@contextmanager
def fast_pinning(threads: int = PIN_THREADS) -> Iterator[bool]:
    """Page-lock the host buffers allocated inside with torch's ``pinned_use_cuda_host_register`` option: malloc,
    the pages faulted in by ``threads`` threads, one cudaHostRegister -- instead of cudaHostAlloc, which faults and
    locks every page on one thread under the driver's lock (about 12 s for the 32 GB a 4096² SDXL decode once kept on
    the host). torch reads the option at each allocation and frees each buffer the way it was allocated, so the
    option is switched on for these allocations only and then back to torch's defaults. Left alone where the user
    set either option (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF) or torch has no run-time setter. Yields whether
    it switched."""
    get, put = _allocator_settings()
    if put is None or not torch.cuda.is_available() or _user_pinning_settings():
        yield False
        return
    prev = (get() if get is not None else None) or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get(
        "PYTORCH_ALLOC_CONF") or ""
    prev = ",".join(k for k in prev.split(",") if k and not k.startswith(_PIN_KEYS))  # (ours, from the last time)
    head = prev + "," if prev else ""  # the user's settings again: a setter may reset what it is not given
    try:
        put(f"{head}pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}")
    except (RuntimeError, ValueError):  # an older torch without the option
        yield False
        return
    try:
        yield True
    finally:
        put(f"{head}pinned_use_cuda_host_register:False,pinned_num_register_threads:1")


def pin_ahead_enabled() -> bool:
    return os.environ.get(PIN_AHEAD_ENV, "").strip().lower() not in ("off", "0", "no", "false")


def host_blocks(buffers: Sequence[tuple[int, int, int]], on_host: Sequence[bool]) -> list[int]:
    """The page-locked blocks (bytes each) torch's host cache needs for the host buffers of one decode: ``buffers``
    as :func:`place` takes them, ``on_host[i]`` whether buffer i lives on the host. torch rounds a request up to a
    power of two and reuses a freed block of that size once the copies that used it are done, so a size needs as
    many blocks as its buffers alive at once -- a buffer counted as alive one step past its free, since the copies
    of a buffer freed just before the next one of its size are still in flight then. In order of first use."""
    out: list[int] = []
    for size in dict.fromkeys(1 << max(0, int(b) - 1).bit_length() for (b, _, _), h in zip(buffers, on_host) if h):
        spans = [(a, f + 2) for (b, a, f), h in zip(buffers, on_host)
                 if h and 1 << max(0, int(b) - 1).bit_length() == size]
        out += [size] * max(sum(1 for a, f in spans if a <= s < f) for s, _ in spans)
    return out


class PinAhead:
    """Page-locks, on a thread of its own, the host blocks a tiled decode will take (:func:`host_blocks`), then hands
    them to torch's host cache (frees them), where the decode's own pinned allocations find them. A decode's host
    buffers are the large ones at full resolution, which it needs only in its last passes: the ~0.13 s per GiB of
    page-locking then runs beside the first passes instead of inside the decode. The decode calls :meth:`wait`
    before its first host allocation (so the two never page-lock at once; an allocation the thread did not foresee
    pins as before) and once it ends. torch's pinning option (:func:`fast_pinning`) is switched on and back by the
    thread that makes the PinAhead and waits for it, never beside another thread's allocations; torch frees the
    thread's tensors without the GIL, and any error is kept in ``error`` and costs only the head start."""

    def __init__(self, blocks: Sequence[int], device: torch.device, threads: int = PIN_THREADS):
        self.blocks, self.device = list(blocks), device
        self.seconds = self.waited = 0.0
        self.error: str | None = None
        self._pinning = ExitStack()
        self._pinning.enter_context(fast_pinning(threads))
        self.thread = threading.Thread(target=self._run, name="vaeopt-pin-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.device.index is not None:  # (the decode's device: CUDA's context current on this thread)
                torch.cuda.set_device(self.device)
            held = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in self.blocks]
            del held  # into torch's host cache
        except Exception as e:  # noqa: BLE001 (the decode pins what it needs itself)
            self.error = f"{type(e).__name__}: {str(e)[:160]}"
        finally:
            self.seconds = time.perf_counter() - t0

    def wait(self) -> None:
        t0 = time.perf_counter()
        self.thread.join()
        self.waited += time.perf_counter() - t0
        self._pinning.close()  # torch's pinning option back (once)

    def summary(self) -> dict:
        return {"blocks": len(self.blocks), "bytes": sum(self.blocks), "seconds": self.seconds, "waited": self.waited,
                "error": self.error}


def is_dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def layout_of(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if (t.dim() == 4 and t.stride(1) == 1 and t.shape[1] > 1) else torch.contiguous_format


def same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


class Activation:
    """A full-size activation (1, C, H, W) on the storage device, its statistics, and its pending per-channel bias
    (kernel path: the true activation is ``t + bias[c]``; the producing conv ran without its bias)."""

    def __init__(self, t: torch.Tensor, stats: Moments | KernelStats | None, bias: torch.Tensor | None = None):
        self.t = t
        self.stats = stats
        self.bias = bias

    @property
    def hw(self) -> tuple[int, int]:
        return self.t.shape[-2], self.t.shape[-1]


class RegionStore:
    """Tile regions between the storage device and the compute device.

    Local storage: a region is a view of the buffer, a write one in-place copy. Remote storage (CPU buffers, CUDA
    compute): dense regions of pinned buffers are copied by a host->device stream (prefetched one tile ahead, so the
    copy overlaps the current tile's kernels) and written back by a device->host stream (in parallel: PCIe is full
    duplex). Ordering is by CUDA events, never by host waits: the compute stream waits for the read of its region;
    the device->host stream waits for the compute stream; a read waits only for the in-flight writes that overlap its
    rows (so the first band of a pass does not wait for the last band of the previous one); ``record_stream`` keeps
    the allocator from reusing a tile's memory while a copy still uses it. At most MAX_INFLIGHT_WRITES writes are in
    flight (the host waits on the oldest), which bounds the device memory they hold. Non-dense regions (2D tiles of a
    buffer) take torch's synchronous path. Whether a buffer is remote is decided per buffer: a decode may keep some
    on the compute device (placement). ``force_copy`` (tests): treat the same-device buffers passed to
    :meth:`mark_remote` as remote, with plain copies."""

    def __init__(self, device: torch.device, storage: torch.device, overlap: bool = True, force_copy: bool = False):
        self.device = device
        self.remote = force_copy or storage != device  # some buffers may be remote
        self.forced: dict[int, weakref.ref] = {}  # force_copy: same-device buffers treated as remote
        self.async_ = bool(overlap and self.remote and device.type == "cuda" and storage.type == "cpu")
        self.h2d = torch.cuda.Stream(device) if self.async_ else None
        self.d2h = torch.cuda.Stream(device) if self.async_ else None
        self.cache: dict[tuple, tuple[torch.Tensor, object]] = {}
        self.inflight: deque = deque()  # events of device->host writes, oldest first (throttle)
        self.writes: list[tuple] = []  # (buffer ptr, y0, y1, x0, x1, event) of writes that may be in flight
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.prefetch_hits = 0

    def mark_remote(self, t: torch.Tensor) -> None:
        self.forced[id(t)] = weakref.ref(t)

    def is_remote(self, t: torch.Tensor) -> bool:
        if t.device != self.device:
            return True
        r = self.forced.get(id(t))
        return r is not None and r() is t

    def begin_pass(self) -> None:
        self.cache.clear()

    def drop(self) -> None:
        self.cache.clear()

    def _fetch(self, t: torch.Tensor, ya: int, yb: int, xa: int, xb: int) -> tuple[torch.Tensor, object]:
        view = t[:, :, ya:yb, xa:xb]
        self.bytes_h2d += view.numel() * view.element_size()
        if self.async_ and is_dense(view) and view.is_pinned():
            ptr = t.data_ptr()
            for wp, y0, y1, x0, x1, ev in self.writes:  # read-after-write: only the overlapping writes
                if wp == ptr and y0 < yb and ya < y1 and x0 < xb and xa < x1:
                    self.h2d.wait_event(ev)
            with torch.cuda.stream(self.h2d):
                dev = torch.empty_like(view, device=self.device)  # dense: keeps the view's strides
                dev.copy_(view, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.h2d)
            return dev, ev
        if self.async_:  # host-side gather of a non-dense region: pending writes must have landed
            self.d2h.synchronize()
        if view.device == self.device:  # force_copy
            return view.clone(memory_format=torch.preserve_format), None
        return view.to(self.device, memory_format=layout_of(view)), None

    def prefetch(self, t: torch.Tensor, ya: int, yb: int, xa: int, xb: int) -> None:
        if not self.is_remote(t):
            return
        key = (t.data_ptr(), ya, yb, xa, xb)
        if key not in self.cache:
            self.cache[key] = self._fetch(t, ya, yb, xa, xb)

    def get(self, t: torch.Tensor, ya: int, yb: int, xa: int, xb: int) -> torch.Tensor:
        if not self.is_remote(t):
            return t[:, :, ya:yb, xa:xb]
        hit = self.cache.pop((t.data_ptr(), ya, yb, xa, xb), None)
        if hit is not None:
            self.prefetch_hits += 1
        dev, ev = hit if hit is not None else self._fetch(t, ya, yb, xa, xb)
        if ev is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            dev.record_stream(cur)  # allocated on the copy stream, used on this one
        return dev

    def put(self, t: torch.Tensor, y0: int, y1: int, x0: int, x1: int, val: torch.Tensor) -> None:
        view = t[:, :, y0:y1, x0:x1]
        if not self.is_remote(t):
            view.copy_(val)
            return
        self.bytes_d2h += val.numel() * val.element_size()
        if self.async_ and is_dense(view) and view.is_pinned():
            if not same_strides(val, view):
                val = val.contiguous(memory_format=layout_of(view))  # same strides: one DMA, no host staging
            cur = torch.cuda.current_stream(self.device)
            self.d2h.wait_stream(cur)
            with torch.cuda.stream(self.d2h):
                view.copy_(val, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.d2h)
            val.record_stream(self.d2h)
            self.inflight.append(ev)
            self.writes.append((t.data_ptr(), y0, y1, x0, x1, ev))
            while len(self.inflight) > MAX_INFLIGHT_WRITES:  # bound the device memory held by pending writes
                self.inflight.popleft().synchronize()
            if len(self.writes) > 4 * MAX_INFLIGHT_WRITES:
                self.writes = [w for w in self.writes if not w[5].query()]
            return
        if self.async_:
            self.d2h.synchronize()
        view.copy_(val)

    def finish(self) -> None:
        self.cache.clear()
        self.forced = {k: r for k, r in self.forced.items() if r() is not None}
        if self.async_:
            torch.cuda.current_stream(self.device).wait_stream(self.d2h)
            self.d2h.synchronize()
            self.inflight.clear()
            self.writes.clear()
