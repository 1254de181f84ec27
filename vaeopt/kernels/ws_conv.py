"""Wan's bf16 96- and 192-channel causal Conv3d as a warp-specialized Gluon kernel for sm_90 (experiments.md E42).

The GEMM is tma_conv's (one program per BH x BW output tile of one frame, K over 27 taps x Cin, A a TMA box of the
input zero-filled outside H and W, B the K-major weight as two power-of-two boxes so 96 or 192 outputs need no
padding); what Triton could not express is the producer / consumer split: one warp only issues TMA copies into a
ring of `stages` shared-memory buffers, the consumer warpgroups only wait, issue wgmma and release stages. At 96
channels the summation order is the Triton kernel's: outputs are bitwise equal to it.

conv_igemm hands these layers here where `handles` holds; a launch that fails because this Triton cannot build the
kernel switches it off for the process, with a warning: the 96-ch convs then go to the Triton TMA kernel, the 192-ch
ones back to cuDNN (triton_conv.packed_for stops handing them to conv_igemm).

Synchronization: a stage goes back to the producer after `warpgroup_mma_wait(2)`, i.e. once the previous K step's
two wgmma groups are done; Triton puts a barrier over both consumer warpgroups before the (one-thread) mbarrier
arrive, so neither warpgroup can still be reading a released stage (checked in the 3.6 PTX: `bar.sync 0, 256`).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    # Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global; 3.9 async_load /
    # async_store (the old names raise)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except ImportError:  # pragma: no cover - Triton without Gluon
    gluon = None
if gluon is not None:  # Gluon comes with triton, so the TMA kernel (its tile choices, `available`) imports too
    from vaeopt.kernels import tma_conv


@dataclasses.dataclass(frozen=True)
class WsConfig:
    bh: int = 4
    bw: int = 64
    bk: int = 32
    stages: int = 6  # 6 x 22 KB ring (+ the epilogue's boxes, aliased): one program per SM
    warps: int = 8  # consumer warps (the default partition): two warpgroups; the TMA producer is one extra warp
    producer_regs: int = 40
    bn0: int = 64  # Cout as two power-of-two accumulators, bn0 + bn1 (one column tile)
    bn1: int = 32


# per channel count (Cin = Cout), the best of E42's sweeps (benchmarks/results/h100_ws_conv*_2026-11-23*.json)
CONFIGS = {96: WsConfig(), 192: WsConfig(bh=2, bw=64, bk=64, stages=4, bn0=128, bn1=64)}
failed: str | None = None  # why the kernel was switched off in this process (its first failing launch)


if gluon is not None:

    @gluon.jit
    def _producer(x_desc, w0_desc, w1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, fin, h0, w0,
                  CIN: gl.constexpr, BK: gl.constexpr, BN0: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr,
                  KW: gl.constexpr, PH: gl.constexpr, PW: gl.constexpr):
        S: gl.constexpr = a_bufs.type.shape[0]
        CB: gl.constexpr = CIN // BK
        NK: gl.constexpr = KT * KH * KW * CB
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w0_desc.block_type.nbytes + w1_desc.block_type.nbytes
        for it in range(NK):
            s = it % S
            mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)
            tap = it // CB
            cb = it - tap * CB
            dt = tap // (KH * KW)
            rr = tap - dt * (KH * KW)
            dy = rr // KW - PH
            dx = rr % KW - PW
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            _tma_load(x_desc, [fin + dt, h0 + dy, w0 + dx, cb * BK], bar, a_bufs.index(s))
            k = tap * CIN + cb * BK
            _tma_load(w0_desc, [0, k], bar, b0_bufs.index(s))
            _tma_load(w1_desc, [BN0, k], bar, b1_bufs.index(s))

    @gluon.jit
    def _consumer(a_bufs, b0_bufs, b1_bufs, ready, empty, BM: gl.constexpr, BK: gl.constexpr, BN0: gl.constexpr,
                  BN1: gl.constexpr, NK: gl.constexpr, L0: gl.constexpr, L1: gl.constexpr):
        S: gl.constexpr = a_bufs.type.shape[0]
        acc0 = gl.zeros([BM, BN0], gl.float32, L0)
        acc1 = gl.zeros([BM, BN1], gl.float32, L1)
        for it in range(NK):
            s = it % S
            mbarrier.wait(ready.index(s), (it // S) & 1)
            a_s = a_bufs.index(s).reshape([BM, BK])
            acc0 = warpgroup_mma(a_s, b0_bufs.index(s).permute((1, 0)), acc0, is_async=True)
            acc1 = warpgroup_mma(a_s, b1_bufs.index(s).permute((1, 0)), acc1, is_async=True)
            # two wgmma groups left in flight: the previous step's are done, so its stage goes back to the producer
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
            mbarrier.arrive(empty.index((it + S - 1) % S), pred=it > 0)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        return acc0, acc1

    @gluon.jit
    def _ws_conv_kernel(x_desc, w0_desc, w1_desc, y0_desc, y1_desc, b_ptr, T, H, W,
                        CIN: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, PH: gl.constexpr,
                        PW: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr, BK: gl.constexpr, BN0: gl.constexpr,
                        BN1: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = BH * BW
        pid = gl.program_id(0)
        nw = gl.cdiv(W, BW)
        nh = gl.cdiv(H, BH)
        wt = pid % nw
        r = pid // nw
        ht = r % nh
        f = r // nh
        fin = f + (f // T) * (KT - 1)  # history frames in front of each sample
        h0 = ht * BH
        w0 = wt * BW

        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        b0_bufs = gl.allocate_shared_memory(w0_desc.dtype, [STAGES] + w0_desc.block_type.shape, w0_desc.layout)
        b1_bufs = gl.allocate_shared_memory(w1_desc.dtype, [STAGES] + w1_desc.block_type.shape, w1_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)

        L0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN0, 16])
        L1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN1, 16])
        NK: gl.constexpr = KT * KH * KW * (CIN // BK)
        acc0, acc1 = gl.warp_specialize([
            (_consumer, (a_bufs, b0_bufs, b1_bufs, ready, empty, BM, BK, BN0, BN1, NK, L0, L1)),
            (_producer, (x_desc, w0_desc, w1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, fin, h0, w0, CIN, BK,
                         BN0, KT, KH, KW, PH, PW)),
        ], [1], [PRODUCER_REGS])

        if HAS_BIAS:
            c0 = gl.arange(0, BN0, layout=gl.SliceLayout(0, L0))
            acc0 = acc0 + gl.load(b_ptr + c0)[None, :]
            c1 = gl.arange(0, BN1, layout=gl.SliceLayout(0, L1))
            acc1 = acc1 + gl.load(b_ptr + BN0 + c1)[None, :]
        y0_s = gl.allocate_shared_memory(y0_desc.dtype, y0_desc.block_type.shape, y0_desc.layout)
        y1_s = gl.allocate_shared_memory(y1_desc.dtype, y1_desc.block_type.shape, y1_desc.layout)
        y0_s.reshape([BM, BN0]).store(acc0.to(y0_desc.dtype))
        y1_s.reshape([BM, BN1]).store(acc1.to(y1_desc.dtype))
        fence_async_shared()
        _tma_store(y0_desc, [f, h0, w0, 0], y0_s)
        _tma_store(y1_desc, [f, h0, w0, BN0], y1_s)
        tma.store_wait(pendings=0)


def _nvmma(shape: list[int]):
    """The shared layout for a bf16 TMA box: the widest swizzle its rows allow."""
    row_bytes = shape[-1] * 2
    sw = max(s for s in (32, 64, 128) if row_bytes % s == 0)
    return gl.NVMMASharedLayout(swizzle_byte_width=sw, element_bitwidth=16, rank=len(shape))


def descriptors(xd: torch.Tensor, wk: torch.Tensor, yd: torch.Tensor, cfg: WsConfig):
    """Gluon TMA descriptors: xd (frames_in, H, W, Cin) bf16, wk (Cout, K) K-major, yd (frames_out, H, W, Cout)."""
    xb = [1, cfg.bh, cfg.bw, cfg.bk]
    x_desc = GluonDescriptor(xd, list(xd.shape), list(xd.stride()), xb, _nvmma(xb))
    w0_desc = GluonDescriptor(wk, list(wk.shape), list(wk.stride()), [cfg.bn0, cfg.bk], _nvmma([cfg.bn0, cfg.bk]))
    w1_desc = GluonDescriptor(wk, list(wk.shape), list(wk.stride()), [cfg.bn1, cfg.bk], _nvmma([cfg.bn1, cfg.bk]))
    y0b, y1b = [1, cfg.bh, cfg.bw, cfg.bn0], [1, cfg.bh, cfg.bw, cfg.bn1]
    y0_desc = GluonDescriptor(yd, list(yd.shape), list(yd.stride()), y0b, _nvmma(y0b))
    y1_desc = GluonDescriptor(yd, list(yd.shape), list(yd.stride()), y1b, _nvmma(y1b))
    return x_desc, w0_desc, w1_desc, y0_desc, y1_desc


def kernel_args(xd, wk, yd, bias, T: int, cfg: WsConfig):
    """(grid, args, constexpr kwargs) of one launch."""
    frames, H, W = yd.shape[0], yd.shape[1], yd.shape[2]
    grid = (frames * -(-H // cfg.bh) * -(-W // cfg.bw),)
    args = (*descriptors(xd, wk, yd, cfg), bias, T, H, W)
    kw = dict(CIN=xd.shape[-1], KT=3, KH=3, KW=3, PH=1, PW=1, BH=cfg.bh, BW=cfg.bw, BK=cfg.bk, BN0=cfg.bn0, BN1=cfg.bn1,
              STAGES=cfg.stages, HAS_BIAS=bias is not None, PRODUCER_REGS=cfg.producer_regs,
              num_warps=cfg.warps)
    return grid, args, kw


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a GPU where the Triton TMA kernel runs (sm_90), with Gluon in this Triton, not switched off by a failed launch."""
    return (gluon is not None and failed is None and dtype == torch.bfloat16
            and tma_conv.available(device))


def handles(x: torch.Tensor, pw, padding, a) -> bool:
    """Whether conv_igemm's call (x, packed weight pw, padding, checked args a) is one this kernel computes: Wan's
    96 -> 96 or 192 -> 192 3x3x3 causal Conv3d in bf16, 'same' spatial padding, weights packed K-major, and input /
    weight base addresses TMA can take (16-byte aligned; the strides of a channels-last input with 96 or 192
    channels always are)."""
    return (a.video and not a.fp8 and pw.kmajor and pw.kernel == (3, 3, 3) and takes(pw.cin, pw.cout)
            and tuple(padding) == (1, 1) and a.odt == torch.bfloat16 and x.data_ptr() % 16 == 0
            and pw.w.data_ptr() % 16 == 0 and available(x.device, x.dtype))


def takes(cin: int, cout: int) -> bool:
    """Channel counts with a measured config: Wan 2.1's 96 -> 96 and 192 -> 192 causal convs."""
    return cin == cout and cin in CONFIGS


def _launch(xd: torch.Tensor, wk: torch.Tensor, bias: torch.Tensor | None, yd: torch.Tensor, T: int,
            cfg: WsConfig) -> None:
    b = bias.detach().float().contiguous() if bias is not None else None
    grid, args, kw = kernel_args(xd, wk, yd, b, T, cfg)
    _ws_conv_kernel[grid](*args, **kw)


def conv(x: torch.Tensor, wk: torch.Tensor, bias: torch.Tensor | None, cfg: WsConfig | None = None) -> torch.Tensor:
    """Wan's causal C -> C 3x3x3 conv: x (N, C, T + 2, H, W) bf16 channels_last_3d with the causal history in
    front, wk the K-major packed weight (Cout, 27 * C) (`conv.pack_weight(w, kmajor=True).w`), Cout = bn0 + bn1.
    Returns (N * T, H, W, Cout) bf16. cfg: CONFIGS[C] unless given (read at each call: benchmarks swap it)."""
    N, C, Tin, H, W = x.shape
    cfg = cfg or CONFIGS[C]
    co = cfg.bn0 + cfg.bn1
    if C % cfg.bk or tuple(wk.shape) != (co, 27 * C):
        raise ValueError(f"ws_conv.conv: needs {C} input channels in steps of bk={cfg.bk} and weights "
                         f"({co}, {27 * C}), got {tuple(wk.shape)}")
    T = Tin - 2
    yd = torch.empty((N * T, H, W, co), device=x.device, dtype=torch.bfloat16)
    if yd.numel():
        _launch(x.permute(0, 2, 3, 4, 1).reshape(N * Tin, H, W, C), wk, bias, yd, T, cfg)
    return yd


def _api_error(e: Exception) -> bool:
    """An error that says this Triton cannot build or launch the kernel (a Gluon API change, a compile or ptxas
    failure, too many resources), as opposed to a CUDA runtime error or an input the caller should not have sent."""
    try:
        from triton.errors import TritonError
    except ImportError:  # pragma: no cover
        TritonError = ()  # noqa: N806
    return isinstance(e, (TritonError, TypeError, AttributeError, ImportError, NotImplementedError, AssertionError))


def conv_checked(x: torch.Tensor, pw, bias: torch.Tensor | None, a) -> torch.Tensor | None:
    """conv_igemm's call where `handles` held: the output in x's layout, or None when this Triton cannot build or
    launch the kernel (`_api_error`). Then it is switched off for the process, with a warning, and the caller runs
    the Triton kernel (the triton_conv stage sends the 192-ch layers back to cuDNN). Other errors propagate: out of
    memory (the planner retries smaller), CUDA runtime errors, and any error during CUDA graph capture (a fallback
    launched into a failed capture would only hide it)."""
    global failed
    try:
        return a.output_view(conv(x, pw.w, bias))
    except Exception as e:
        if (isinstance(e, torch.OutOfMemoryError) or not _api_error(e)
                or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            raise
        msg = str(e).strip()
        failed = f"{type(e).__name__}: {msg.splitlines()[-1][:200] if msg else ''}"
        warnings.warn(f"vaeopt: the warp-specialized conv kernel failed ({failed}); Wan's 96-channel convs run on "
                      "the Triton TMA kernel instead, the 192-channel ones on cuDNN", RuntimeWarning, stacklevel=2)
        return None
