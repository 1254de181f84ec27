"""What the kernel files share: whether Triton can run here, launch-configuration and layout helpers (pure torch),
and the @triton.jit device functions that several kernels inline (SiLU, e4m3 saturation, the GroupNorm partials
a producer writes for the next norm).

Every kernel file imports from here and from no other kernel file's private names, so the kernels form a tree with
this module at its root. Importing it never fails without triton: the device functions are defined only when
triton imports (each kernel file imports triton itself first).
"""

from __future__ import annotations

import functools
import math
import os

import torch


def interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1): kernels on CPU tensors, for tests."""
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
    return _available(device.type, device.index, interpreting())


# --- shared launcher helpers (pure torch; used by the kernel modules) ---------------------------------------------


def interpreter_hint() -> str:
    """How a CPU decode takes the Triton path anyway (the stages' skip reasons): the interpreter, and the settings,
    left as the slot {0} for the caller's hint (vaeopt.stages.Said)."""
    return "TRITON_INTERPRET=1 in the environment plus {0} forces it; slow, for tests"


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


def default_warps(tile: int) -> int:
    """Warps of a program over `tile` elements: 4 up to 4096, 8 above."""
    return 4 if tile <= 4096 else 8


def default_tile(device: torch.device) -> int:
    """Elements per program tile: 4096 suits a GPU SM; the CPU interpreter wants few, big programs."""
    return 4096 if device.type == "cuda" else 1 << 17


def n_programs_target(device: torch.device) -> int:
    """How many programs a split reduction should launch: a few waves of the GPU's SMs; few on the (slow)
    CPU interpreter, where each program costs real time."""
    if device.type == "cuda":
        return 8 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1


# --- the SiLU each kernel inlines (`silu`'s MODE): one policy for the GroupNorm, RMS and tap kernels -------------

OUT8 = (torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ()  # 8-bit float outputs the kernels write
SILU_MODE: int | None = None  # None: silu_mode's policy; 0-3 force that `silu` MODE on CUDA (experiments.md E25, E31)
WAN_RMS_16 = 3  # the MODE of Wan's channels-last RMS kernel for 16-bit outputs on CUDA (silu_mode)


def silu_mode(out_dtype: torch.dtype, device: torch.device, wan_rms: bool = False) -> int:
    """The `common.silu` MODE of a kernel writing out_dtype on device.
    - Exact (0) on the CPU, under the interpreter, on ROCm and for fp32 outputs.
    - tanh.approx (2) for e4m3 outputs on CUDA: there the GroupNorm apply is bound by arithmetic, 7-21% faster per
      call, and its ~2^-11 relative error is far below e4m3's 2^-4 step (H200, experiments.md E25).
    - 16-bit outputs: exact (0) in the GroupNorm kernels, bound by memory (the hardware tanh gained nothing there,
      E25). In Wan's channels-last RMS kernels (`wan_rms`: rms_norm_silu's and tapconv's norm + tap GEMM) WAN_RMS_16:
      3, the exact formula without its range fix-ups: those kernels are bound by instruction issue, and mode 3 was
      bitwise equal to mode 0 on every Wan shape measured and faster (E31). The one input window where they differ is
      y in about (-88.7, -87.3): mode 3 returns -0 for a value of magnitude below ~1e-36."""
    if device.type != "cuda" or torch.version.hip is not None or out_dtype == torch.float32 or interpreting():
        return 0  # modes 2/3 are NVIDIA PTX
    if SILU_MODE is not None:
        return SILU_MODE
    if out_dtype in OUT8 or out_dtype == torch.int8:  # int8: the approximation is far below its step too
        return 2
    return WAN_RMS_16 if wan_rms else 0


# --- argument checks shared by the RMS norm launchers (rms_norm_silu, tapconv) ----------------------------------


def channel_vector(name: str, v, C: int, device) -> torch.Tensor | None:
    """v (None, or a tensor of C values on `device`) as a [C] view; a clear error naming the rms_norm_silu argument
    otherwise."""
    if v is None:
        return None
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"rms_norm_silu: {name} must be a tensor of {C} values")
    if v.numel() != C:
        raise ValueError(f"rms_norm_silu: {name} has {v.numel()} values for {C} channels")
    if v.device != device:
        raise ValueError(f"rms_norm_silu: {name} is on {v.device}, x on {device}")
    return v.reshape(C)


def affine_args(x: torch.Tensor, gamma, bias, x_bias):
    """(gamma [C], bias [C] or a placeholder, has_bias, x_bias [C] or None), checked against x's C channels; a
    nonzero number as bias becomes a [C] vector."""
    C = x.shape[1]
    g = gamma.reshape(-1)
    if g.numel() != C:
        raise ValueError(f"rms_norm_silu: gamma has {g.numel()} values for {C} channels")
    if isinstance(bias, torch.Tensor):
        b, has_bias = bias.reshape(-1), True
        if b.numel() != C:
            raise ValueError(f"rms_norm_silu: bias has {b.numel()} values for {C} channels")
    elif bias:  # a nonzero number
        b, has_bias = torch.full((C,), float(bias), device=x.device, dtype=torch.float32), True
    else:
        b, has_bias = g, False  # placeholder pointer, never read
    return g, b, has_bias, channel_vector("x_bias", x_bias, C, x.device)


# --- device functions inlined by several kernels -----------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except Exception:  # no (working) triton: triton_available() says why; the kernel files are not importable then
    triton = None

if triton is not None:

    @triton.jit
    def silu(y, MODE: tl.constexpr):
        """SiLU of fp32 y. MODE 0: y / (1 + exp(-y)); 1: the same through tl.fdiv(ieee_rounding=False), measured bitwise
        equal and as fast (Triton's fp32 `/` already is the fast division); 2: y * (1 + tanh(y / 2)) / 2 with the
        hardware tanh.approx (one MUFU op; ~2^-11 relative error), CUDA only; 3: y * rcp(1 + ex2(-y log2 e)) with the
        flush-to-zero ex2.approx / rcp.approx (two MUFU ops, ~2^-21 relative error, none of mode 0's range fix-ups),
        CUDA only."""
        if MODE == 2:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [0.5 * y], dtype=tl.float32, is_pure=True,
                                          pack=1)
            return y * (0.5 + 0.5 * t)
        elif MODE == 3:  # y * rcp(1 + 2^(-y log2 e)) with flush-to-zero MUFU ops: no range fix-ups around them
            e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [y * -1.4426950408889634],
                                          dtype=tl.float32, is_pure=True, pack=1)
            return y * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32,
                                                 is_pure=True, pack=1)
        elif MODE == 1:
            return tl.fdiv(y, 1.0 + tl.exp(-y), ieee_rounding=False)
        else:
            return y / (1.0 + tl.exp(-y))

    @triton.jit
    def sat_e4m3(y, EXACT8: tl.constexpr):
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if EXACT8:  # round half up to the e4m3 grid (3 mantissa bits; subnormal spacing 2^-9), so the cast is exact
            e = tl.floor(tl.log2(tl.maximum(tl.abs(y), 0.015625)))
            step = tl.exp2(e - 3.0)
            y = tl.floor(y / step + 0.5) * step
        return y

    @triton.jit
    def cl_store_partials(s1, s2, am, k, cnt, part_ptr, n, chunk, n_chunks, N, G, CG, cols, cm, BLOCK_G: tl.constexpr,
                           CG_POW2: tl.constexpr, MINMAX: tl.constexpr):
        """Store one chunk's partials of sample n from its running [rows, BLOCK_C] tiles of shifted sums (s1: x - k,
        s2: (x - k)^2, am: max |x - k|; k: the per-channel shift, cnt: rows seen): planes count, mean, M2 (and the
        max / min bounds when MINMAX) of each group, at [plane, n * G + g, chunk]. Shared by the stats kernel and the
        residual epilogue that takes the next norm's statistics on its way (kernels/epilogue.py)."""
        t1 = tl.sum(s1, axis=0)
        t2 = tl.sum(s2, axis=0)
        mean_c = k + t1 / cnt  # [BLOCK_C]
        m2_c = tl.maximum(t2 - t1 * t1 / cnt, 0.0)

        # Channels -> groups, once per program: Chan merge of equal-count parts.
        ga = tl.arange(0, BLOCK_G)
        if CG_POW2 > 0:  # CG_POW2 == CG: the groups tile BLOCK_C exactly -> reshape [BLOCK_G, CG] (real decoder widths)
            mean_2d = tl.reshape(mean_c, [BLOCK_G, CG_POW2])
            mean_g = tl.sum(mean_2d, axis=1) / CG_POW2  # [BLOCK_G]
            dev = mean_2d - mean_g[:, None]
            m2_g = tl.sum(tl.reshape(m2_c, [BLOCK_G, CG_POW2]) + cnt * dev * dev, axis=1)
        else:  # odd group sizes: one-hot [BLOCK_G, BLOCK_C] mask
            ohf = (((cols[None, :] // CG) == ga[:, None]) & cm[None, :]).to(tl.float32)
            mean_g = tl.sum(ohf * mean_c[None, :], axis=1) / CG
            dev = mean_c[None, :] - mean_g[:, None]
            m2_g = tl.sum(ohf * (m2_c[None, :] + cnt * dev * dev), axis=1)

        gm = ga < G
        out = part_ptr + (n * G + ga) * n_chunks + chunk
        plane = n_chunks * G * N
        tl.store(out, tl.zeros([BLOCK_G], dtype=tl.float32) + cnt * CG, mask=gm)
        tl.store(out + plane, mean_g, mask=gm)
        tl.store(out + 2 * plane, m2_g, mask=gm)
        if MINMAX:
            # x lies in [k - max|x - k|, k + max|x - k|]: bounds of the channel's max and min. The finalize kernel
            # uses the larger distance of either end from the group mean, which this widens by at most |k - mean|
            # (k is the chunk's first-block mean). Tracking max and min themselves took two more ops and registers
            # per element: the e4m3 stats pass measured 1.4x the bf16 one (H200, sdxl-1024; experiments.md E21).
            am_c = tl.max(am, axis=0)  # [BLOCK_C]
            hi_c = k + am_c
            lo_c = k - am_c
            if CG_POW2 > 0:
                hi_g = tl.max(tl.reshape(hi_c, [BLOCK_G, CG_POW2]), axis=1)
                lo_g = tl.min(tl.reshape(lo_c, [BLOCK_G, CG_POW2]), axis=1)
            else:
                oh = ((cols[None, :] // CG) == ga[:, None]) & cm[None, :]
                hi_g = tl.max(tl.where(oh, hi_c[None, :], float("-inf")), axis=1)
                lo_g = tl.min(tl.where(oh, lo_c[None, :], float("inf")), axis=1)
            tl.store(out + 3 * plane, hi_g, mask=gm)
            tl.store(out + 4 * plane, lo_g, mask=gm)

    @triton.jit
    def first_block_shift(y0, m0, lim, BLOCK_S: tl.constexpr):
        """The per-channel shift of a chunk's sums: the mean of its first row block y0 (masked by m0), as the stats
        kernel takes it (for the kernels that write a norm's input and take its statistics on the way)."""
        return tl.sum(tl.where(m0, y0, 0.0), axis=0) / tl.minimum(lim, BLOCK_S).to(tl.float32)

    @triton.jit
    def accumulate_shifted(y, m, k, s1, s2, am):
        """One row block y (fp32, masked by m) into the running shifted sums, squares and max |y - k|."""
        d = tl.where(m, y - k[None, :], 0.0)
        return s1 + d, s2 + d * d, tl.maximum(am, tl.abs(d))
