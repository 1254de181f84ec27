"""Triton kernels, one file per op (`group_norm_silu.py`, `rms_norm_silu.py`), each with one launcher.

Importing this package imports triton when it can (kernels are decorated then: set TRITON_INTERPRET=1 before, for
CPU tests); without triton the package still imports and `triton_available()` says why.
"""

from __future__ import annotations

import functools
import math
import os

import torch

_EXPORTS = ["group_norm_silu", "group_norm_silu_reference", "rms_norm_silu", "rms_norm_silu_reference"]


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _available(dev_type: str, dev_index: int | None, interpret: bool) -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        return False, f"triton not importable ({type(e).__name__}: {e})"
    if dev_type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA not available"
        major, minor = torch.cuda.get_device_capability(dev_index)
        if major < 7:
            return False, f"GPU compute capability {major}.{minor} < 7.0 (triton's minimum)"
        return True, f"triton {triton.__version__} on {torch.cuda.get_device_name(dev_index)}" + (
            " (TRITON_INTERPRET=1: interpreted)" if interpret else ""
        )
    if dev_type == "cpu":
        if interpret:
            return True, f"triton {triton.__version__} interpreter on CPU (TRITON_INTERPRET=1; slow, for tests)"
        return False, "CPU tensors need a CUDA GPU (or TRITON_INTERPRET=1 for tests)"
    return False, f"no triton backend for device type '{dev_type}'"


def triton_available(device: torch.device | str | torch.Tensor | None = None) -> tuple[bool, str]:
    """Can our Triton kernels run on `device` (a device, its name, or a tensor on it)? -> (ok, reason).

    CUDA needs an importable triton and a GPU; CPU works only through the interpreter (TRITON_INTERPRET=1).
    With no device: the default one (CUDA if present, else CPU).
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return _available(device.type, device.index, _interpret())


# --- shared launcher helpers (pure torch; used by the kernel modules) ---------------------------------------------


def interpreter_hint(flags: str) -> str:
    """How a CPU decode takes the Triton path anyway (the stages' skip reasons): the interpreter, and the switches."""
    return f"TRITON_INTERPRET=1 in the environment plus {flags} forces it; slow, for tests"


def triton_cache_entries() -> tuple[str, int]:
    """(Triton's on-disk kernel cache folder, how many compiled kernels it holds): the CLI compares the count before
    and after a decode to say when a first run's time includes compiling the kernels."""
    try:
        from triton import knobs

        d = str(knobs.cache.dir)
    except Exception:  # older Triton: its documented default
        d = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        return d, sum(1 for e in os.scandir(d) if e.is_dir())
    except OSError:  # not made yet: nothing compiled
        return d, 0


def flat_layout(x: torch.Tensor) -> tuple[str, int, int] | None:
    """View x (N, C, *spatial) as (N, C, S). -> ("cf", S, stride_n) when each sample is a contiguous [C, S] block
    (NCHW, NCDHW), ("cl", S, stride_n) when it is a contiguous [S, C] block (NHWC, NDHWC), None otherwise."""
    N, C = x.shape[:2]
    S = math.prod(x.shape[2:])
    st = x.stride()
    dims = [(n, s) for n, s in zip(x.shape[2:], st[2:]) if n != 1]  # size-1 dims have meaningless strides
    if all(s0 == s1 * n1 for (_, s0), (n1, s1) in zip(dims, dims[1:])):
        ss = dims[-1][1] if dims else None  # stride of the merged spatial dim (None: S == 1)
    else:
        return None
    if (ss is None or ss == 1) and (C == 1 or st[1] == S):
        return "cf", S, st[0]
    if (C == 1 or st[1] == 1) and (ss is None or ss == C):
        return "cl", S, st[0]
    return None


def new_like(x: torch.Tensor, kind: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A dense output of x's shape and dtype (or `dtype`) in layout `kind` ("cf": contiguous, "cl": channels last)."""
    dtype = dtype or x.dtype
    if kind == "cf":
        return torch.empty(x.shape, device=x.device, dtype=dtype)
    shape = (x.shape[0], *x.shape[2:], x.shape[1])
    return torch.empty(shape, device=x.device, dtype=dtype).movedim(-1, 1)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_tile(device: torch.device) -> int:
    """Elements per program tile: 4096 suits a GPU SM; the CPU interpreter wants few, big programs."""
    return 4096 if device.type == "cuda" else 1 << 17


def n_programs_target(device: torch.device) -> int:
    """How many programs a split reduction should launch: a few waves of the GPU's SMs; few on the (slow)
    CPU interpreter, where each program costs real time."""
    if device.type == "cuda":
        return 8 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1


# Re-exports. Imported here, after the helpers the kernel modules need, and bound last: a function named like its
# module would otherwise be shadowed by the submodule once something imports `vaeopt.kernels.group_norm_silu`.
try:
    import triton as _triton  # noqa: F401
except Exception:  # no (working) triton: triton_available() says why; the kernels are simply absent
    _triton = None
if _triton is not None:  # our own import errors must surface, so only triton's import is guarded
    from vaeopt.kernels.group_norm_silu import group_norm_silu, group_norm_silu_reference
    from vaeopt.kernels.rms_norm_silu import rms_norm_silu, rms_norm_silu_reference

__all__ = ["triton_available", "flat_layout", "new_like", "default_tile", "n_programs_target", *_EXPORTS]
