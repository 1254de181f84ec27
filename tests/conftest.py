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
