"""Triton kernels, one file per op (`group_norm_silu.py`, `rms_norm_silu.py`, ...), each with one launcher; what
they share lives in `common.py`.

Importing this package imports triton when it can (kernels are decorated then: set TRITON_INTERPRET=1 before, for
CPU tests); without triton the package still imports and `triton_available()` says why.
"""

from __future__ import annotations

from vaeopt.kernels.common import (default_tile, default_warps, flat_layout, interpreter_hint, interpreting, n_programs_target,
                                   new_like, triton_available, triton_cache_entries)

_EXPORTS = ["group_norm_silu", "group_norm_silu_reference", "rms_norm_silu", "rms_norm_silu_reference"]

# Re-exports, bound last: a function named like its module would otherwise be shadowed by the submodule once
# something imports `vaeopt.kernels.group_norm_silu`.
try:
    import triton as _triton  # noqa: F401
except Exception:  # no (working) triton: triton_available() says why; the kernels are simply absent
    _triton = None
if _triton is not None:  # our own import errors must surface, so only triton's import is guarded
    from vaeopt.kernels.group_norm_silu import group_norm_silu, group_norm_silu_reference
    from vaeopt.kernels.rms_norm_silu import rms_norm_silu, rms_norm_silu_reference

__all__ = ["triton_available", "interpreting", "interpreter_hint", "triton_cache_entries", "flat_layout", "new_like",
           "default_tile", "default_warps", "n_programs_target", *_EXPORTS]
