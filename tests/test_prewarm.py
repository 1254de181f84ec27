"""The GPU warmed beside the checkpoint load (vaeopt/prewarm.py): a thread only where there is a CUDA device, joined
before the stages touch the GPU, its errors said once and never fatal; the kernels a decode loaded are stored for
the next one. (CPU: the CUDA-only calls are stand-ins; the thread, the joins, the hook and the cache are real.)"""

import threading

import pytest
import torch

from typer.testing import CliRunner

from vaeopt import cache, prewarm
from vaeopt.cli import app
from vaeopt.pipeline import Options


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)

KEY = prewarm.key("ckpt:1:2", Options())


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda says yes; the cache keys by a named GPU; the thread's CUDA calls are recorded, not made."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(prewarm, "open_context", lambda i: False)
    monkeypatch.setattr(cache, "environment", lambda device=None: {"format": cache.FORMAT, "gpu": "Test GPU"})
    monkeypatch.setattr(prewarm, "warm_libraries", lambda dev, dt, video=False: calls.append(("libs", dt, video)))
    monkeypatch.setattr(prewarm, "warm_triton", lambda: (calls.append(("triton",)), True)[1])
    monkeypatch.setattr(prewarm, "load_kernel", lambda e: calls.append(("kernel", e["name"])))
    monkeypatch.delenv("VAEOPT_PREWARM", raising=False)
    return calls


def _entry(name, module="vaeopt.kernels.conv"):
    return {"module": module, "name": name, "spec": '{"name": "%s"}' % name}


def test_no_thread_without_a_gpu(monkeypatch):
    """A CPU device, a CUDA device on a machine without CUDA, or VAEOPT_PREWARM=off: no thread is made."""
    monkeypatch.setattr(prewarm.threading, "Thread", None)  # any thread would fail here
    assert prewarm.start(torch.device("cpu"), torch.float32, KEY) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prewarm.start(torch.device("cuda"), torch.bfloat16, KEY) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("VAEOPT_PREWARM", "off")
    assert prewarm.start(torch.device("cuda:1"), torch.bfloat16, KEY) is None


def test_thread_warms_the_libraries_and_the_stored_kernels_and_is_joined(fake_gpu, monkeypatch):
    """The thread sets its own device, warms cuDNN/cuBLAS in the decode's dtype (3-D convs for video), then loads the
    kernels stored for the key; join waits for it and says what it did, once."""
    cache.put(prewarm.KIND, KEY, {"kernels": [_entry("_a"), _entry("_b"), _entry("_x", module="os")]}, "cuda")
    gate = threading.Event()
    real = prewarm.warm_libraries
    monkeypatch.setattr(prewarm, "warm_libraries", lambda *a, **k: (gate.wait(5), real(*a, **k)))
    pw = prewarm.start(torch.device("cuda:1"), torch.bfloat16, KEY, video=True)
    assert pw.thread.name == "vaeopt-prewarm" and pw.thread.is_alive()  # still warming: the join must wait
    threading.Timer(0.2, gate.set).start()
    lines, details = [], []
    pw.join(lines.append, details.append)
    assert not pw.thread.is_alive() and pw.waited >= 0.1
    # the join came while the libraries warmed: the thread stops before Triton's hash and the kernels (the decode
    # does what it needs itself)
    assert fake_gpu == [("set_device", 1), ("libs", torch.bfloat16, True)]
    assert lines == [] and details == ["warmed beside the load: cuDNN and cuBLAS (%.2f s; the decode waited %.2f s "
                                       "for it)" % (pw.seconds, pw.waited)]
    pw.join(lines.append, details.append)  # a second join: nothing again
    assert lines == [] and len(details) == 1
    # a load that outlasts the warm-up: every stored vaeopt kernel is preloaded before the join
    fake_gpu.clear()
    pw = prewarm.start(torch.device("cuda:1"), torch.bfloat16, KEY, video=True)
    gate.set()
    pw.thread.join(5)
    details = []
    pw.join(lines.append, details.append)
    # ("os" is not a vaeopt kernel module: a stored entry never makes the thread import anything else)
    assert fake_gpu == [("set_device", 1), ("libs", torch.bfloat16, True), ("triton",), ("kernel", "_a"),
                        ("kernel", "_b")]
    assert lines == [] and details[0].startswith("warmed beside the load: 2 Triton kernels, cuDNN and cuBLAS, "
                                                 "Triton's compiler hash (")


def test_kernels_wait_for_the_callers_imports(fake_gpu, monkeypatch):
    """imports_pending: the libraries and Triton's hash at once (outside the GIL, beside the caller's imports), the
    kernels (Python) only after imports_done(); a join before it ends the thread without them."""
    cache.put(prewarm.KIND, KEY, {"kernels": [_entry("_a"), _entry("_b")]}, "cuda")
    pw = prewarm.start(torch.device("cuda"), torch.bfloat16, KEY, imports_pending=True)
    pw.thread.join(0.5)
    assert pw.thread.is_alive() and fake_gpu == [("set_device", 0), ("libs", torch.bfloat16, False), ("triton",)]
    pw.imports_done()
    pw.thread.join(5)
    assert fake_gpu[3:] == [("kernel", "_a"), ("kernel", "_b")] and pw.kernels == 2 and pw.kernels_after > 0
    pw.join()
    assert pw.summary()["kernels_after"] == pw.kernels_after and pw.summary()["triton"] is True
    # never told: the join ends it before any kernel, at once
    fake_gpu.clear()
    pw = prewarm.start(torch.device("cuda"), torch.bfloat16, KEY, imports_pending=True)
    pw.thread.join(0.5)
    pw.join()
    assert not pw.thread.is_alive() and pw.waited < 1 and ("kernel", "_a") not in fake_gpu
    assert (pw.kernels, pw.kernels_after, pw.libraries) == (0, None, True)


@pytest.mark.parametrize("value, expect", [("", "on"), ("on", "on"), ("bogus", "on"), ("libraries", "libraries"),
                                           (" Early", "early"), ("off", "off"), ("0", "off"), ("false", "off")])
def test_the_switch_and_its_modes(value, expect, fake_gpu, monkeypatch):
    """VAEOPT_PREWARM: libraries warms the libraries and Triton's hash but loads no kernel; early loads the kernels
    at once even while the caller imports (the earlier behaviour, for measurements); off makes no thread."""
    monkeypatch.setenv("VAEOPT_PREWARM", value)
    assert prewarm.mode() == expect and prewarm.enabled() == (expect != "off")
    cache.put(prewarm.KIND, KEY, {"kernels": [_entry("_a")]}, "cuda")
    pw = prewarm.start(torch.device("cuda"), torch.bfloat16, KEY, imports_pending=True)
    if expect == "off":
        assert pw is None
        return
    pw.thread.join(0.5)
    pw.join()
    kernels = [c for c in fake_gpu if c[0] == "kernel"]
    assert kernels == ([("kernel", "_a")] if expect == "early" else [])
    assert ("triton",) in fake_gpu and pw.libraries


def test_open_context_through_the_driver(monkeypatch):
    """cuInit, the device by its index, its primary context retained: in that order, through ctypes (which lets go
    of the GIL); False at the first failing call, or without a driver library (then torch makes it, as before)."""
    import ctypes

    calls = []

    class Lib:
        def __init__(self, fail=None):
            self.fail = fail

        def __getattr__(self, name):
            def f(*a):
                calls.append((name, a[-1] if name != "cuDevicePrimaryCtxRetain" else None))
                return 100 if name == self.fail else 0
            return f

    libs = {}
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libs[name])
    libs["libcuda.so.1"] = Lib()
    assert prewarm.open_context(3) is True
    assert calls == [("cuInit", 0), ("cuDeviceGet", 3), ("cuDevicePrimaryCtxRetain", None)]
    calls.clear()
    libs["libcuda.so.1"] = Lib(fail="cuDeviceGet")
    assert prewarm.open_context(1) is False and [c[0] for c in calls] == ["cuInit", "cuDeviceGet"]
    del libs["libcuda.so.1"]
    monkeypatch.setattr(ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    assert prewarm.open_context(0) is False


def test_warm_triton_computes_tritons_own_hash_only_where_triton_is_imported(monkeypatch):
    import sys

    import triton.runtime.cache as tc

    calls = []
    monkeypatch.setattr(tc, "triton_key", lambda: calls.append(1) or "k")
    assert prewarm.warm_triton() is True and calls == [1]
    monkeypatch.delitem(sys.modules, "triton")  # (a process that has not imported it: not imported here either)
    assert prewarm.warm_triton() is False and calls == [1]


def test_errors_in_the_thread_are_said_once_and_never_raised(fake_gpu, monkeypatch):
    cache.put(prewarm.KIND, KEY, {"kernels": [_entry("_a"), _entry("_b"), _entry("_c")]}, "cuda")

    def bad(e):
        if e["name"] != "_b":
            raise RuntimeError(f"{e['name']}: no such specialization")

    monkeypatch.setattr(prewarm, "load_kernel", bad)
    pw = prewarm.start(torch.device("cuda"), torch.float16, KEY)
    pw.thread.join(5)  # (a join before the thread reaches the kernels stops it there: none would be tried)
    lines = []
    pw.join(lines.append)
    pw.join(lines.append)
    assert (pw.kernels, pw.failed, pw.libraries) == (1, 2, True)
    assert lines == ["! warming the GPU beside the load: _a not preloaded (RuntimeError: _a: no such "
                     "specialization), and 1 more kernel(s); the first decode loads what it needs itself"]
    assert [e["name"] for e in prewarm.stored(KEY, "cuda")] == ["_b"]  # not tried again by the next decode

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(prewarm, "warm_libraries", oom)
    pw = prewarm.start(torch.device("cuda"), torch.float16, KEY)
    pw.thread.join(5)  # (a join before the thread reaches the kernels stops it there: none would be tried)
    lines = []
    pw.join(lines.append)
    assert pw.kernels == 0 and not pw.libraries and len(lines) == 1 and "OutOfMemoryError" in lines[0]


def test_record_stores_the_vaeopt_kernels_a_decode_loads(fake_gpu):
    """Triton's post-compile hook during the block: vaeopt's kernels are stored (another module's are not), merged
    with those already stored (newest first), an earlier hook still called and put back; a failed block stores
    nothing."""
    from triton import knobs

    class Fn:
        def __init__(self, module, name):
            self.module, self.name = module, name

    def fire(module, name):
        knobs.runtime.jit_post_compile_hook(key="k", repr="r", fn=Fn(module, name), is_manual_warmup=False,
                                            already_compiled=False,
                                            compile={"key": "k", "specialization_data": '{"name": "%s"}' % name})

    earlier = []
    prev = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw["fn"].name)
    try:
        with prewarm.Record(KEY, "cuda") as rec:
            fire("vaeopt.kernels.conv", "_a")
            fire("vaeopt.kernels.conv", "_a")  # (the same specialization again: once)
            fire("torch._inductor.x", "_t")
        assert rec.added == 1 and [e["name"] for e in prewarm.stored(KEY, "cuda")] == ["_a"]
        assert earlier == ["_a", "_a", "_t"] and knobs.runtime.jit_post_compile_hook.__name__ == "<lambda>"
        with prewarm.Record(KEY, "cuda") as rec:
            fire("vaeopt.kernels.epilogue", "_b")
            fire("vaeopt.kernels.conv", "_a")
        assert rec.added == 1 and [e["name"] for e in prewarm.stored(KEY, "cuda")] == ["_b", "_a"]
        with pytest.raises(RuntimeError):
            with prewarm.Record(KEY, "cuda"):
                fire("vaeopt.kernels.conv", "_c")
                raise RuntimeError("the decode failed")
        assert [e["name"] for e in prewarm.stored(KEY, "cuda")] == ["_b", "_a"]
        assert prewarm.stored(prewarm.key("other:1:2", Options()), "cuda") == []  # per checkpoint
        assert prewarm.stored(prewarm.key("ckpt:1:2", Options(fp8="on")), "cuda") == []  # per stage options
    finally:
        knobs.runtime.jit_post_compile_hook = prev


def test_load_kernel_preloads_through_triton_and_loads_the_binary(monkeypatch):
    """A stored kernel is found by module and name among vaeopt's kernels, handed to its preload, and the compiled
    kernel's `run` is touched (Triton loads the binary and builds the launcher there)."""
    import vaeopt.kernels.conv as conv

    got = []

    class Compiled:
        @property
        def run(self):
            got.append("run")

    class Jit:
        def preload(self, spec):
            got.append(spec)
            return Compiled()

    monkeypatch.setattr(conv, "_igemm_kernel", Jit())
    prewarm.load_kernel(_entry("_igemm_kernel"))
    assert got == ['{"name": "_igemm_kernel"}', "run"]
    with pytest.raises(ValueError, match="not a vaeopt kernel"):
        prewarm.load_kernel(_entry("system", module="os"))


def test_decode_starts_the_warmup_before_the_load_and_joins_it_before_the_stages(tmp_path, samples_dir,
                                                                                  monkeypatch):
    """`vaeopt decode`: the warm-up starts before the checkpoint loads (with the decode's device, dtype and a key of
    the checkpoint and options) and is joined before the pipeline applies its stages; its error is one line, and the
    decode still writes its output."""
    import vaeopt.loading
    import vaeopt.pipeline

    order, started, handles = [], [], []
    real_load, real_pipe = vaeopt.loading.load_vae, vaeopt.pipeline.Pipeline

    class Handle(prewarm.Prewarm):
        def join(self, log=None, detail=None):
            order.append("join")
            super().join(log, detail)

    def start(device, dtype, k, video=False, imports_pending=False):
        order.append("start")
        started.append((device, dtype, k, video, imports_pending))
        return handles.append(Handle(error="stand-in failure")) or handles[-1]

    def load(*a, **k):  # the warm-up was told the imports are done, and diffusers' VAE classes are imported
        import sys

        order.append(("load", handles[0].go.is_set(), "diffusers.models.autoencoders" in sys.modules))
        return real_load(*a, **k)

    class Pipe(real_pipe):
        def __init__(self, *a, **k):
            order.append("stages")
            super().__init__(*a, **k)

    monkeypatch.setattr(prewarm, "start", start)
    monkeypatch.setattr(vaeopt.loading, "load_vae", load)
    monkeypatch.setattr(vaeopt.pipeline, "Pipeline", Pipe)
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"][:, :, :16, :16]
    torch.save(lat, tmp_path / "l.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    r = run("decode", tmp_path / "l.pt", "-m", model, "-o", tmp_path / "o.png", "--device", "cpu")
    assert r.exit_code == 0, r.output
    # (the later join of the error path: a no-op)
    assert order[:4] == ["start", ("load", True, True), "join", "stages"]
    (device, dtype, k, video, pending), = started
    assert (device, dtype, video, pending) == (torch.device("cpu"), torch.float32, False, True)
    assert k == prewarm.key(prewarm.source_id(model), Options(device="cpu"))
    assert r.output.count("stand-in failure") == 1 and (tmp_path / "o.png").is_file()


def test_cpu_decode_makes_no_thread_and_stores_no_kernels(tmp_path, samples_dir, monkeypatch):
    monkeypatch.setattr(prewarm.threading, "Thread", None)
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"][:, :, :16, :16]
    torch.save(lat, tmp_path / "l.pt")
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", tmp_path / "o.png",
            "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert cache.entries(prewarm.KIND) == []


def test_warmup_records_under_the_key_decode_reads(samples_dir, monkeypatch):
    """`vaeopt warmup CHECKPOINT` records the kernels its decodes load (on a GPU) under the key that `vaeopt decode`
    of the same checkpoint and options warms from, around the stages and the decodes."""
    from vaeopt import warmup
    from vaeopt.loading import load_vae

    seen = []

    class Rec:
        def __init__(self, k, device, log=None):
            seen.append((k, device))

        def __enter__(self):
            seen.append("enter")

        def __exit__(self, *exc):
            seen.append("exit")

    monkeypatch.setattr(prewarm, "Record", Rec)
    monkeypatch.setattr(warmup, "resolve_device", lambda d: torch.device("cuda"))  # (the stages still run on the CPU)
    model = samples_dir / "tiny_kl_image.safetensors"
    rep = warmup.run(load_vae(model), [(1, 4, 16, 16)], Options(device="cpu"))
    assert len(rep.shapes) == 1
    assert seen == [(prewarm.key(prewarm.source_id(model), Options(device="cpu")), torch.device("cuda")), "enter",
                    "exit"]


def test_imports_without_gc_pauses_the_collector_and_freezes_what_was_imported(monkeypatch):
    """`vaeopt decode`'s import blocks: no cyclic collection inside, the collector back on after (also after an
    error), what a block imported frozen out of later collections; a block that imports nothing freezes nothing, and
    a collector the caller had turned off stays off."""
    import gc
    import sys
    import types

    from vaeopt.cli.decode import imports_without_gc

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    assert gc.isenabled()
    with imports_without_gc():
        assert not gc.isenabled()
        monkeypatch.setitem(sys.modules, "vaeopt_test_imported", types.ModuleType("vaeopt_test_imported"))
    assert gc.isenabled() and frozen == [1]
    with pytest.raises(ImportError):
        with imports_without_gc():
            raise ImportError("no such module")
    assert gc.isenabled() and frozen == [1]  # (nothing imported: nothing frozen)
    monkeypatch.setenv("VAEOPT_IMPORT_GC", "on")  # the collector left alone
    with imports_without_gc():
        assert gc.isenabled()
        monkeypatch.setitem(sys.modules, "vaeopt_test_imported3", types.ModuleType("vaeopt_test_imported3"))
    assert frozen == [1]
    monkeypatch.delenv("VAEOPT_IMPORT_GC")
    gc.disable()
    try:
        with imports_without_gc():
            monkeypatch.setitem(sys.modules, "vaeopt_test_imported2", types.ModuleType("vaeopt_test_imported2"))
        assert not gc.isenabled() and frozen == [1]
    finally:
        gc.enable()
