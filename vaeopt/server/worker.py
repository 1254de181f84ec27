"""One decode worker per device: its own copy of every model, one thread, one queue (docs/serve.md, "Throughput").

A worker decodes one job (or one batch of same-shape image jobs) at a time, so what the planner sees free is what the
decode gets; an out-of-memory error vaeopt's own retries did not absorb is retried once tiled, then answered 503.
On a GPU each answer tensor is made there and its copy to the host queued behind it, not waited for: the worker
starts the next decode at once, and the encode threads wait for the copy.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import math
import threading
import time
from typing import Callable

import torch

import vaeopt
from vaeopt.errors import VaeoptError
from vaeopt.options import spell_flags
from vaeopt.server.protocol import ProtocolError
from vaeopt.stages import Hint

log = logging.getLogger("vaeopt.server")

# The decode call; a module attribute so that tests can stand a failing one in (out of memory, a crash).
decode: Callable = vaeopt.decode


def spell_serve(group: tuple[Hint, ...]) -> str:
    """A setting a stage line suggests, as the server's log writes it: `vaeopt serve` takes --dtype and no stage
    options (it decodes with the defaults), so a line names the `vaeopt decode` flags that set the others, never
    vaeopt.Options(...)."""
    if all(h.option == "dtype" for h in group):
        return " ".join(f"--dtype {h.value}" for h in group)
    return f"`vaeopt decode {spell_flags(group)}` (vaeopt serve decodes with the defaults)"


def is_oom(e: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError (torch reports a failed host allocation so)."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


# Answers up to this size cross to the host through pinned memory without blocking the worker (torch keeps freed
# pinned blocks for reuse); larger ones (a long clip's float32 frames) are copied plainly, rather than pinning GBs.
PINNED_MAX_BYTES = 256 * 2**20


class Answer:
    """A job's answer tensor on its way to the host; wait() (on an encode thread) returns it there."""

    def __init__(self, t: torch.Tensor, prepare: Callable | None):
        self.event = None
        if t.device.type == "cuda":
            t = prepare(t) if prepare is not None else t
            self._prepare = None
            if t.numel() * t.element_size() <= PINNED_MAX_BYTES:
                self.t = t.to("cpu", non_blocking=True)  # into pinned host memory: a queued copy, not a wait
                self.event = torch.cuda.Event()
                self.event.record(torch.cuda.current_stream(t.device))
            else:
                self.t = t.cpu()
        else:  # a CPU worker: the conversion is CPU work too, done on the encode threads rather than the worker's
            self.t, self._prepare = t, prepare

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if self._prepare is not None:
            self.t, self._prepare = self._prepare(self.t), None
        return self.t


class Job:
    """One request's decode: raw float32 latents on the CPU, the model's name, the future the HTTP side awaits, and
    `prepare`, which turns the decoder's float32 output into the tensor its answer is made of (on the device)."""

    def __init__(self, model: str, z: torch.Tensor, loop, batchable: bool, prepare: Callable | None = None):
        self.model = model
        self.z = z
        self.prepare = prepare
        self.loop = loop
        self.future = loop.create_future()
        self.batch_key = (model, tuple(z.shape[1:])) if batchable else None
        self.seconds = 0.0  # decode time (shared by a batch)
        self.batch = 1
        self.retries: list[str] = []

    def resolve(self, result=None, error: BaseException | None = None) -> None:
        def set_it():
            if self.future.done():  # timed out or the client went away meanwhile
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(set_it)
        except RuntimeError:  # the event loop has closed (shutdown)
            pass


class Worker(threading.Thread):
    def __init__(self, device: torch.device, models: dict[str, str], options: vaeopt.Options, max_queue: int = 64,
                 max_batch: int = 1):
        super().__init__(name=f"vaeopt-decode-{device}", daemon=True)
        self.device = device
        self.label = str(device)  # in /health and /metrics (Pool numbers workers that share a device)
        self.model_paths = models
        self.options = dataclasses.replace(options, device=str(device))
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.models: dict = {}  # name -> vaeopt.load_vae(...) result, optimized by its first decode
        self.state = "loading"
        self.error: str | None = None
        self.families: dict = {}
        self._q: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running = 0
        self._stop = False
        self.decode_ewma = 0.0  # seconds per decode, for Retry-After
        self.done = 0
        self.oom_retries = 0
        self.dropped = 0  # jobs whose client had gone (timeout, disconnect) before their decode began

    # ---------------------------------------------------------------------------------------------- HTTP side
    @property
    def depth(self) -> int:
        return len(self._q) + self._running

    def submit(self, job: Job) -> bool:
        """Queue the job; False when this worker's queue is full."""
        with self._cv:
            if len(self._q) >= self.max_queue:
                return False
            self._q.append(job)
            self._cv.notify()
            return True

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    # ---------------------------------------------------------------------------------------------- its thread
    def load(self) -> None:
        """Every model on this device, each optimized by one small warm-up decode (so /health means ready)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        for name, path in self.model_paths.items():
            t0 = time.perf_counter()
            # (first: the stage lines of its warm-up decode follow, and with several models say whose they are)
            log.info("model %s: loading %s on %s", name or "/", path, self.device)
            loaded = vaeopt.load_vae(path)
            fam = loaded.family
            c = fam.latent_channels
            warm = torch.zeros((1, c, 1, 8, 8) if fam.is_video else (1, c, 8, 8))
            decode(warm, loaded, latent_space="raw", options=self.options, log=lambda m: log.info("  %s", m),
                   spell=spell_serve)
            self.models[name] = loaded
            self.families[name] = fam
            log.info("model %s: %s (%s) ready on %s in %.1f s", name or "/", path, fam.title, self.device,
                     time.perf_counter() - t0)

    def run(self) -> None:
        try:
            self.load()
        except BaseException as e:  # a bad checkpoint: the server reports it and stops
            self.error = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.state = "failed"
            log.error("worker %s: loading failed: %s", self.device, self.error)
            return
        self.state = "ready"
        while True:
            with self._cv:
                while not self._q and not self._stop:
                    self._cv.wait()
                if self._stop:
                    for j in self._q:
                        j.resolve(error=ProtocolError(503, "the server is shutting down", {"Retry-After": "5"}))
                    self._q.clear()
                    return
                batch = self._take()
                self._running = len(batch)
            try:
                self._serve(batch)
            finally:
                with self._cv:
                    self._running = 0

    def _take(self) -> list[Job]:
        """The next live job, and (with --batch) the queued jobs of the same model and latent shape behind it."""
        while self._q:
            job = self._q.popleft()
            if job.future.done():
                self.dropped += 1
                continue
            batch, n = [job], job.z.shape[0]
            if job.batch_key is not None and self.max_batch > 1:
                for other in list(self._q):
                    if other.batch_key == job.batch_key and not other.future.done() \
                            and n + other.z.shape[0] <= self.max_batch:
                        self._q.remove(other)
                        batch.append(other)
                        n += other.z.shape[0]
            return batch
        return []

    def _serve(self, batch: list[Job]) -> None:
        if not batch:
            return
        loaded = self.models[batch[0].model]
        t0 = time.perf_counter()
        if len(batch) > 1:
            try:
                out = self._decode(loaded, torch.cat([j.z for j in batch]), batch[0])
                answers = [Answer(part, j.prepare) for j, part in zip(batch, out.split([j.z.shape[0] for j in batch]))]
                del out
            except BaseException as e:
                if not isinstance(e, ProtocolError):
                    log.warning("batched decode of %d failed (%s): decoding them one by one", len(batch), e)
                answers = None
            if answers is not None:
                dt = time.perf_counter() - t0
                self._timed(dt)
                for j, a in zip(batch, answers):  # each job its own slice, in the order they were concatenated
                    j.seconds, j.batch = dt, len(batch)
                    self._answer(j, a)
                return
        for j in batch:
            t1 = time.perf_counter()
            try:
                out = Answer(self._decode(loaded, j.z, j), j.prepare)
            except ProtocolError as e:
                self._answer(j, error=e)
            except VaeoptError as e:  # latents the model cannot decode, a NaN/Inf output
                self._answer(j, error=ProtocolError(422, str(e)))
            except Exception as e:  # noqa: BLE001 — a bug: this request fails, the worker goes on
                if is_oom(e):  # making its answer tensor (a large pt answer on a nearly full GPU)
                    self._free()
                    self._answer(j, error=ProtocolError(503, f"out of memory on {self.device} converting the decoded "
                                                             f"{list(j.z.shape)}: retry later or send a smaller batch",
                                                        {"Retry-After": str(self.retry_after())}))
                    continue
                log.exception("decode failed on %s", self.device)
                self._answer(j, error=ProtocolError(500, f"decode failed: {type(e).__name__}: "
                                                         f"{(str(e).splitlines() or [''])[0][:200]}"))
            else:
                j.seconds = time.perf_counter() - t1
                self._timed(j.seconds)
                self._answer(j, out)

    def _answer(self, job: Job, result=None, error: BaseException | None = None) -> None:
        with self._cv:  # off the queue depth before the client can see its answer (and read /metrics)
            self._running = max(0, self._running - 1)
        job.resolve(result, error)

    def _timed(self, dt: float) -> None:
        self.done += 1
        self.decode_ewma = dt if self.decode_ewma == 0 else 0.8 * self.decode_ewma + 0.2 * dt

    def _free(self) -> None:
        """After an out-of-memory error: what the failed attempt held back to the device (a collection first, for
        tensors kept alive by reference cycles through its traceback)."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def _decode(self, loaded, z: torch.Tensor, job: Job) -> torch.Tensor:
        """vaeopt.decode; on an out-of-memory error it did not absorb, once more tiled; then 503."""
        failed = None
        try:
            return decode(z, loaded, latent_space="raw", options=self.options, on_device=True)
        except BaseException as e:
            if not is_oom(e):
                raise
            failed = f"{type(e).__name__}"
        # (retried outside the except block: its traceback would keep the failed attempt's tensors alive)
        self._free()
        self.oom_retries += 1
        job.retries.append(f"out of memory ({failed}): retried tiled")
        log.warning("out of memory decoding %s on %s: retrying tiled", tuple(z.shape), self.device)
        try:
            return decode(z, loaded, latent_space="raw", options=dataclasses.replace(self.options, tiling="on"),
                          on_device=True)
        except BaseException as e:
            if not (is_oom(e) or isinstance(e, VaeoptError)):
                raise
        self._free()
        raise ProtocolError(503, f"out of memory on {self.device} decoding {list(z.shape)}, also tiled: retry later "
                                 "or send a smaller batch", {"Retry-After": str(self.retry_after())})

    def retry_after(self) -> int:
        return int(min(60, max(1, math.ceil(self.decode_ewma * max(1, self.depth)))))


class Pool:
    """Every worker; a job goes to the ready worker with the shortest queue."""

    def __init__(self, workers: list[Worker]):
        self.workers = workers
        names = [str(w.device) for w in workers]
        for i, w in enumerate(workers):  # several workers on one device (CPU tests of a multi-GPU server)
            if names.count(names[i]) > 1:
                w.label = f"{names[i]}#{i}"

    @property
    def ready(self) -> bool:
        return bool(self.workers) and all(w.state == "ready" for w in self.workers)

    @property
    def failed(self) -> str | None:
        return next((f"{w.label}: {w.error}" for w in self.workers if w.state == "failed"), None)

    def family(self, model: str):
        for w in self.workers:
            if model in w.families:
                return w.families[model]
        return None

    def submit(self, job: Job) -> None:
        ready = [w for w in self.workers if w.state == "ready"]
        if not ready:
            raise ProtocolError(503, "the models are still loading", {"Retry-After": "5"})
        for w in sorted(ready, key=lambda w: w.depth):
            if w.submit(job):
                return
        wait = min(w.retry_after() for w in ready)
        raise ProtocolError(503, f"the decode queue is full ({sum(w.depth for w in ready)} requests waiting): retry "
                                 f"in {wait} s", {"Retry-After": str(wait)})

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
