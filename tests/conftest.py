import os
from pathlib import Path

import pytest
import torch

# Triton kernels run through the interpreter on CPU-only machines. Must be set before triton.jit decorates anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
# One intra-op thread: on a small CPU shared by other jobs torch's default of 2 threads made small ops several
# times slower (measured: a 64x64 tiny-VAE decode 0.06 s with 1 thread, 0.37 s with 2 under load).
torch.set_num_threads(1)
# ... and so do the processes the tests start (the CLI, benchmarks/first_call.py): scripts/test.sh runs one pytest
# worker per core, which torch's default of one thread per core in each child would oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _interpreter_without_overflow_checks() -> None:
    """The interpreter checks every int32 add/sub/mul for overflow (InterpreterOptions.sanitize_overflow): measured
    ~40% of an fp8 conv's interpreted time. Test tensors are far too small for int32 offsets to overflow, and the
    kernels' large-tensor offsets are int64 by construction (checked by the GPU tests at real sizes)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import dataclasses

    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    base = getattr(interp, "InterpreterOptions", None)
    if base is None or "sanitize_overflow" not in {f.name for f in dataclasses.fields(base)}:
        return

    @dataclasses.dataclass(frozen=True)
    class _Options(base):
        sanitize_overflow: bool = False

    interp.InterpreterOptions = _Options
    # the interpreter's module-level builder was created at import, with the default options: replace those too
    # (patching the class alone left every check on)
    builder = getattr(interp, "interpreter_builder", None)
    if builder is not None and isinstance(getattr(builder, "options", None), base):
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


_interpreter_without_overflow_checks()


def _interpreter_patches_once_per_launch() -> None:
    """The interpreter swaps triton.language's builtins for interpreted ones around each kernel launch, and again at
    every call of a @triton.jit helper inside the kernel (each program of the grid, each call site), where the
    launch's swap is already in place: measured ~40% of an interpreted group-norm launch. Here a helper's call skips
    the swap when the language modules it sees were swapped by the launch in progress; a helper that sees another
    one (triton.language.core where the kernel saw triton.language) still gets it. What the kernels compute is
    unchanged: only the interpreter's setup work is not repeated."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import inspect
    import threading

    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    real_patch, scope_cls = getattr(interp, "_patch_lang", None), getattr(interp, "_LangPatchScope", None)
    executor = getattr(interp, "GridExecutor", None)
    if real_patch is None or scope_cls is None or executor is None:
        return
    state = threading.local()  # .langs: ids of the language modules the launch in progress swapped

    seen: dict = {}  # helper function -> ids of the language modules in its globals (imports do not change)

    def langs_of(fn) -> set:
        if fn not in seen:
            seen[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return seen[fn]

    def patch_lang(fn):
        done = getattr(state, "langs", None)
        mine = langs_of(fn)
        if done is not None and mine and mine <= done:
            return scope_cls()  # nothing to restore: the launch's own scope restores the swap
        scope = real_patch(fn)
        if done is not None:
            done |= mine
        return scope

    real_call = executor.__call__

    def launch(self, *args, **kwargs):
        outer = getattr(state, "langs", None)
        state.langs = set()
        try:
            return real_call(self, *args, **kwargs)
        finally:
            state.langs = outer

    interp._patch_lang = patch_lang
    executor.__call__ = launch


_interpreter_patches_once_per_launch()

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"


@pytest.fixture(autouse=True)
def _own_vaeopt_cache(tmp_path_factory, monkeypatch):
    """Each test gets an empty vaeopt cache (vaeopt/cache.py): no verdict or plan carried from another test or from
    the user's ~/.cache."""
    monkeypatch.setenv("VAEOPT_CACHE_DIR", str(tmp_path_factory.mktemp("vaeopt-cache")))
    monkeypatch.delenv("VAEOPT_CACHE", raising=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    return SAMPLES


@pytest.fixture(scope="module")
def sample_kl_vae(samples_dir):
    """The bundled trained image VAE as a plain diffusers AutoencoderKL (fp32, eval), one per test module."""
    import json

    import safetensors.torch
    from diffusers import AutoencoderKL
    from safetensors import safe_open

    path = samples_dir / "tiny_kl_image.safetensors"
    with safe_open(str(path), "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    m = AutoencoderKL(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    m.load_state_dict(safetensors.torch.load_file(str(path)))
    return m.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny decodes: on a small shared CPU, thread-pool wake-ups cost more than
    the work (~100x here). A module opts in with pytestmark = pytest.mark.usefixtures("one_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
