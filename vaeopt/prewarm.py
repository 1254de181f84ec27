"""The GPU warmed while the checkpoint loads: what the first decode of a process would otherwise pay for on its own.

A process's first decode pays once for loading its Triton kernels from Triton's cache (each kernel's cache lookup,
its binary into the CUDA context, its launcher), for cuDNN's and cuBLAS's first calls (their libraries and handles)
and for creating the CUDA context (docs/experiments.md E54: 0.80 s over a 20 ms decode at sdxl-1024). None of that
needs the model, so `vaeopt decode` does it on a thread of its own while the main thread reads the checkpoint and
builds the model (`start`), and waits for it before anything else touches the GPU (`Prewarm.join`).

In two parts, because of the GIL (E67): while the main thread imports diffusers (seconds of Python), the thread only
does what runs outside the interpreter: the CUDA context (made through the driver directly, as torch makes it
holding the GIL), cuDNN's and cuBLAS's first calls, and the hash Triton keeps of its own compiler (its first cache
lookup reads and hashes libtriton, ~500 MB). Loading the kernels is Python (cache lookups, launchers): run beside the
imports, every file the importer reads hands the GIL to the thread for up to a switch interval (on an H200 host the
diffusers import took 7.3 s beside it, against about 4.4 s in a plain diffusers script). So the kernels wait until
the caller says its imports are done (`Prewarm.imports_done`), and then load while it reads and checks the weights;
what the join stops short of, the decode loads itself.

Which kernels: the ones the same decode (checkpoint, stage options) loaded last time, as Triton specialized them for
its shapes (alignment, constants, launch options). `Record` collects them through Triton's post-compile hook during
a decode or a `vaeopt warmup`, and stores them in vaeopt's cache (cache.py, kind "kernels", so per GPU, driver and
versions); the thread hands each to Triton's own `JITFunction.preload` and loads its binary, so the decode's first
launch finds it in Triton's in-memory cache. (preload, not `kernel.warmup`: warmup needs arguments that reproduce
each launch's specialization, while preload takes the specialization Triton itself wrote down.)

Why a thread is safe here: Triton is not used by the main thread until the join (the stages, which launch kernels,
are applied after it), so the kernel caches are written by one thread at a time; CUDA's runtime is thread-safe and
torch initializes it under a lock; cuDNN and cuBLAS handles are per thread, and those the thread made return to
torch's pool when it ends, for the main thread to reuse; the thread's own work runs on a side stream. Any error in it
is caught, said once at the join, and costs nothing but the warm-up: the decode loads what it needs as before. On a
CPU, or with VAEOPT_PREWARM=off, no thread starts.

VAEOPT_PREWARM (for measuring one against another): on (the default: as above), libraries (the first part only;
the decode loads its kernels), early (the kernels at once, beside the imports: the earlier behaviour), off.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vaeopt import cache

KIND = "kernels"
ENV_SWITCH = "VAEOPT_PREWARM"  # on (default) | libraries | early | off: see the module's docstring
MODES = ("on", "libraries", "early", "off")
MAX_KERNELS = 256  # kernels kept per key: every shape decoded so far, the newest first
# the Options that decide which kernels run (not the shapes, plans or budgets: the kernels of every shape are kept)
STAGE_FIELDS = ("dtype", "channels_last", "triton", "epilogues", "attention", "upsample_conv", "stack_conv3d",
                "conv_kernel", "fp8", "gate_db")
PACKAGE = "vaeopt.kernels."  # the only modules a stored kernel may name (an entry never imports anything else)


def mode() -> str:
    """VAEOPT_PREWARM as one of MODES (unset or unknown: on; 0/no/false: off)."""
    v = os.environ.get(ENV_SWITCH, "").strip().lower()
    if v in ("0", "no", "false"):
        return "off"
    return v if v in MODES else "on"


def enabled() -> bool:
    return mode() != "off"


def source_id(path: str | Path) -> str:
    """A checkpoint as the key knows it: its resolved path, size and modification time (a file replaced in place is
    another checkpoint)."""
    p = Path(path)
    try:  # (a path that cannot be resolved or read is the loader's to report, not the key's)
        p = p.expanduser().resolve()
        st = p.stat()
        return f"{p}:{st.st_size}:{st.st_mtime_ns}"
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        return str(p)


def key(source: str, opts) -> dict:
    """What the kernel list depends on: the checkpoint (source_id, or a name for random weights) and the stage
    options (vaeopt.Options)."""
    return {"source": source, "options": {f: getattr(opts, f) for f in STAGE_FIELDS}}


def stored(k: dict, device) -> list[dict]:
    """The kernels stored for key k on this device (empty: none yet, or the cache is off)."""
    hit = cache.get(KIND, k, device)
    got = hit.get("kernels") if hit is not None else None
    return [e for e in got if _valid(e)] if isinstance(got, list) else []


def _valid(e) -> bool:
    return (isinstance(e, dict) and all(isinstance(e.get(f), str) for f in ("module", "name", "spec"))
            and e["module"].startswith(PACKAGE))


class Record:
    """Collects the vaeopt kernels Triton compiles or loads from its cache inside the block (its post-compile hook;
    an earlier hook is called too, and put back after), then merges them into the entry for key k: the ones already
    stored stay (a preloaded kernel does not pass the hook again). Without Triton, or a Triton without the hook,
    nothing is recorded. .added: how many kernels the entry gained."""

    def __init__(self, k: dict, device, log: Callable[[str], None] | None = None):
        self.k, self.device, self.log = k, device, log
        self.seen: list[dict] = []
        self.added = 0
        self._runtime = self._prev = None

    def __enter__(self) -> Record:
        try:
            from triton import knobs
        except ImportError:
            return self
        if not hasattr(knobs.runtime, "jit_post_compile_hook"):
            return self
        self._runtime, self._prev = knobs.runtime, knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self.on_compile
        return self

    def on_compile(self, *, fn, compile, **kw):
        spec = compile.get("specialization_data") if isinstance(compile, dict) else None
        e = {"module": str(getattr(fn, "module", "")), "name": str(getattr(fn, "name", "")), "spec": spec}
        if _valid(e) and e not in self.seen:
            self.seen.append(e)
        if self._prev is not None:
            return self._prev(fn=fn, compile=compile, **kw)
        return None

    def __exit__(self, exc_type, *exc) -> None:
        if self._runtime is None:
            return
        self._runtime.jit_post_compile_hook = self._prev
        self._runtime = None
        if exc_type is not None or not self.seen:
            return
        old = stored(self.k, self.device)
        new = [e for e in self.seen if e not in old]
        if new:
            self.added = len(new)
            cache.put(KIND, self.k, {"kernels": (new + old)[:MAX_KERNELS]}, self.device, self.log)


@dataclass
class Prewarm:
    """The warm-up thread of one decode. join() waits for it (once; later calls return at once) and says what it did
    or, once, what went wrong."""
    thread: threading.Thread | None = None  # (the thread fills this handle in)
    kernels: int = 0  # Triton kernels preloaded
    failed: int = 0  # stored kernels that could not be preloaded (first error in .error)
    libraries: bool = False  # cuDNN and cuBLAS initialized
    triton: bool = False  # Triton's hash of its own compiler computed
    error: str | None = None
    seconds: float = 0.0  # the thread's own time
    waited: float = 0.0  # how long the join waited for it
    joined: bool = field(default=False, repr=False)
    # set by join(): the thread stops preloading at the next kernel, so a decode never waits for more than the one in
    # flight (a kernel missing from Triton's disk cache compiles, which can take seconds; the decode loads the rest)
    stop: threading.Event = field(default_factory=threading.Event, repr=False)
    # set by imports_done() (or join): the kernels may load now (the thread waits for it after the libraries)
    go: threading.Event = field(default_factory=threading.Event, repr=False)
    kernels_after: float | None = None  # when the kernels began, seconds after the thread started (None: never)

    def imports_done(self) -> None:
        """The caller's imports are over: the thread may load the kernels (Python, which slowed them down)."""
        self.go.set()

    def join(self, log: Callable[[str], None] | None = None, detail: Callable[[str], None] | None = None) -> None:
        if self.joined:
            return
        t0 = time.perf_counter()
        self.stop.set()
        self.go.set()
        if self.thread is not None:
            self.thread.join()
        self.waited = time.perf_counter() - t0
        self.joined = True
        if self.error is not None and log is not None:
            log(f"! warming the GPU beside the load: {self.error}; the first decode loads what it needs itself")
        if detail is not None:
            what = [f"{self.kernels} Triton kernel{'s' if self.kernels != 1 else ''}"] if self.kernels else []
            what += ["cuDNN and cuBLAS"] if self.libraries else []
            what += ["Triton's compiler hash"] if self.triton else []
            if what:
                detail(f"warmed beside the load: {', '.join(what)} ({self.seconds:.2f} s; the decode waited "
                       f"{self.waited:.2f} s for it)")

    def summary(self) -> dict:
        return {"kernels": self.kernels, "failed": self.failed, "libraries": self.libraries, "triton": self.triton,
                "error": self.error, "seconds": self.seconds, "waited": self.waited,
                "kernels_after": self.kernels_after}


def start(device: torch.device, dtype: torch.dtype, k: dict | None, video: bool = False,
          imports_pending: bool = False) -> Prewarm | None:
    """Start warming `device` for decodes in `dtype` (the kernels stored for key k; video: 3-D convs too) on a thread.
    imports_pending: the caller still imports (diffusers): the kernels wait for its `imports_done()` (or the join).
    None where there is nothing to warm: a CPU device, no CUDA, or VAEOPT_PREWARM=off. The caller joins it before
    its first use of the GPU or of Triton."""
    device = torch.device(device)
    m = mode()
    if device.type != "cuda" or m == "off" or not torch.cuda.is_available():
        return None
    pw = Prewarm()
    if m == "libraries":
        k = None
    if not imports_pending or m == "early":
        pw.go.set()
    pw.thread = threading.Thread(target=_run, args=(pw, device, dtype, k, video), name="vaeopt-prewarm", daemon=True)
    pw.thread.start()
    return pw


def _run(pw: Prewarm, device, dtype, k, video) -> None:
    t0 = time.perf_counter()
    try:
        index = device.index if device.index is not None else 0
        open_context(index)
        torch.cuda.set_device(index)
        warm_libraries(device, dtype, video)
        pw.libraries = True
        pw.triton = not pw.stop.is_set() and warm_triton()  # (joined already: the decode hashes it if it needs it)
        if k is None:
            return
        pw.go.wait()  # (the caller's imports; a join sets it too, and stop with it)
        if pw.stop.is_set():
            return
        pw.kernels_after = time.perf_counter() - t0
        entries, bad = stored(k, device), []
        for e in entries:
            if pw.stop.is_set():
                break
            try:
                load_kernel(e)
                pw.kernels += 1
            except Exception as err:  # noqa: BLE001 (a kernel that will not preload is loaded by the decode)
                bad.append(e)
                if pw.error is None:
                    pw.error = f"{e['name']} not preloaded ({type(err).__name__}: {str(err)[:160]})"
        pw.failed = len(bad)
        if bad:  # dropped from the entry, so the next decode does not try them again (it records what it loads)
            cache.put(KIND, k, {"kernels": [e for e in entries if e not in bad]}, device)
        if pw.failed > 1:
            pw.error += f", and {pw.failed - 1} more kernel(s)"
    except Exception as err:  # noqa: BLE001 (never fails the decode; said once at the join)
        pw.error = f"{type(err).__name__}: {str(err)[:200]}"
    finally:
        pw.seconds = time.perf_counter() - t0


def open_context(index: int) -> bool:
    """The CUDA driver's initialization and device `index`'s primary context (the one torch's runtime uses), made
    through ctypes, which lets go of the GIL for the call: torch.cuda.set_device makes them holding the GIL (CUDA 12
    creates the context in cudaSetDevice), and the main thread's imports would stand still meanwhile. After it,
    set_device finds the context made. False where there is no driver library or a call fails (set_device then does
    it all, as before)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")  # (Linux's driver library; elsewhere torch does it)
    except OSError:
        return False
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    return (lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), index) == 0
            and lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0)


def warm_libraries(device: torch.device, dtype: torch.dtype, video: bool = False) -> None:
    """Small convolutions (channels last, as the decodes run) and GEMMs in `dtype` on `device`, on a side stream: the
    CUDA context, cuDNN's and cuBLAS's libraries and handles, and the first use of the paths a decode takes that
    cost most on their own (E71, H200, each measured as a Wan 2.1 480p decode's first call of it):
    - the exact attention's score GEMM, a bf16 product with fp32 output (`torch.bmm(..., out_dtype=float32)`, in
      stages/fused_epilogues), is a cuBLAS path of its own: ~40 ms at its first use after a plain GEMM, ~4 ms after
      this 64x64 one;
    - a video decoder's wide 3-D convolutions: cuDNN loads their kernels on first use (~15 ms each; ~3 ms after a
      384-channel one here); a 16-channel one does not load the same kernels.
    Those two are extras: if one fails (a GPU nearly full, a cuDNN without the kernel), the rest is warmed all the
    same. Constant operands: values decide no kernel, and the global random generator is left alone."""
    s = torch.cuda.Stream(device)
    with torch.cuda.stream(s), torch.no_grad():
        x = torch.ones(1, 16, 8, 8, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        w = torch.ones(16, 16, 3, 3, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        torch.nn.functional.conv2d(x, w, padding=1)
        a = torch.ones(1, 64, 64, device=device, dtype=dtype)
        torch.mm(a[0], a[0])
        torch.bmm(a, a)
        extras = [lambda: torch.bmm(a, a, out_dtype=torch.float32)] if dtype != torch.float32 else []
        for c, size in ((16, 8), (384, 12)) if video else ():
            extras.append(lambda c=c, size=size: torch.nn.functional.conv3d(
                torch.ones(1, c, 3, size, size, device=device, dtype=dtype).to(memory_format=torch.channels_last_3d),
                torch.ones(c, c, 3, 3, 3, device=device, dtype=dtype).to(memory_format=torch.channels_last_3d),
                padding=(0, 1, 1)))
        for f in extras:
            try:  # (torch < 2.8 has no out_dtype: the attention then upcasts its operands instead)
                f()
            except (TypeError, RuntimeError, NotImplementedError):
                pass
    s.synchronize()


def warm_triton() -> bool:
    """Triton's hash of its own compiler (triton_key: every compiler source file and libtriton, ~500 MB, read and
    hashed), which its first kernel cache lookup in a process computes and keeps. Hashing runs outside the GIL. Only
    where Triton is imported already (importing it here would be seconds of Python beside the caller's imports);
    False where it is not, or has no such function."""
    if "triton" not in sys.modules:
        return False
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return False
    triton_key()
    return True


def load_kernel(e: dict) -> None:
    """Load one stored kernel: Triton's JITFunction.preload (its cache lookup, or a compile where Triton's cache has
    lost it), then its binary into the CUDA context and its launcher (the compiled kernel's `run`)."""
    if not _valid(e):
        raise ValueError(f"not a vaeopt kernel: {e.get('module')}")
    obj = importlib.import_module(e["module"])
    for part in e["name"].split("."):
        obj = getattr(obj, part)
    kernel = obj.preload(e["spec"])
    if kernel is not None:
        kernel.run  # noqa: B018 (the property loads the binary and builds the launcher)
