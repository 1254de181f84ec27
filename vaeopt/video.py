"""Decoding Wan 2.1 / 2.2 clips: the public calls. `decode_video` fills one clip tensor, `iter_decode_video` streams
frame groups to the host, `estimate_chunk_bytes` says what a chunk needs on the device.

The decoder itself, and why a chunk of several latent frames decodes exactly, is vaeopt.engine.wan (ChunkDecoder).
This module chooses how it runs: untiled, or in spatial tiles with one causal cache per tile (vaeopt.video_tiling),
with or without per-chunk CUDA graphs (vaeopt.video_graphs), and finishes each chunk's output the way diffusers
does (unpatchify for Wan 2.2, clamp to [-1, 1]; uint8 frames rounded from fp32) straight into its destination.
Notes and measurements: docs/video.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from vaeopt import video_tiling
from vaeopt.engine.memory import estimate_chunk_bytes
from vaeopt.engine.wan_ops import (Chunk, active_dropout, chunk_schedule, output_frame_counts, patch_size,
                                   prepare_latents, temporal_factor)
from vaeopt.errors import DecodeError, LatentError

__all__ = ["active_dropout", "chunk_schedule", "decode_video", "estimate_chunk_bytes", "iter_decode_video",
           "output_frame_counts", "to_uint8_frames"]


def _raw(vae, z: Tensor, sched: list[int], channels_last: bool | None, fused: bool | None, tile,
         tiling: dict, graphs=None) -> Iterator[tuple[int, Tensor]]:
    """(first output frame index, raw decoder output) per call (vaeopt.video_tiling.iter_raw: untiled, tiled, or
    restarted after an out-of-memory error). Untiled without tiling options, the causal caches are allocated one by
    one, not reserved up front by a dry run."""
    tiling.setdefault("arena", tile is not None or bool(tiling))
    return video_tiling.iter_raw(vae, z, sched, tile, channels_last=channels_last, fused=fused, graphs=graphs,
                                 **tiling)


def _unpatch7(y: Tensor, p: int) -> Tensor:
    """Decoder output (N, C*p*p, f, h, w) -> a view equal to diffusers' unpatchify, as (N, C, f, h, p, w, p)."""
    N, Cp, f, h, w = y.shape
    return y.unflatten(1, (Cp // (p * p), p, p)).permute(0, 1, 4, 5, 3, 6, 2)


def final_shape(y: Tensor, p: int, frames: int | None = None) -> tuple[int, int, int, int, int]:
    N, Cp, f, h, w = y.shape
    return N, Cp // (p * p), f if frames is None else frames, h * p, w * p


def finish_float(y: Tensor, p: int, dst: Tensor) -> None:
    """dst (N, C, f, H, W) <- clamp(unpatchify(y), -1, 1), diffusers' last two steps, without intermediate copies."""
    if p == 1:
        torch.clamp(y, -1.0, 1.0, out=dst)
    else:
        N, Cp, f, h, w = y.shape
        torch.clamp(_unpatch7(y, p), -1.0, 1.0, out=dst.unflatten(4, (w, p)).unflatten(3, (h, p)))


def _finish_uint8(y: Tensor, p: int, dst: Tensor) -> None:
    """dst (N, f, H, W, C) uint8 <- round((clamp(unpatchify(y), -1, 1) + 1) * 127.5), computed in fp32."""
    N, Cp, f, h, w = y.shape
    if p == 1:
        src, d = y, dst.permute(0, 4, 1, 2, 3)
    else:
        src = _unpatch7(y, p)
        d = dst.unflatten(3, (w, p)).unflatten(2, (h, p)).permute(0, 6, 1, 2, 3, 4, 5)
    d.copy_(torch.clamp(src.float(), -1.0, 1.0).add_(1.0).mul_(127.5).round_())


def to_uint8_frames(video: Tensor) -> Tensor:
    """(N, C, T, H, W) float video in [-1, 1] (e.g. diffusers' `decode(z).sample`) -> (N, T, H, W, C) uint8, with the
    same rounding as iter_decode_video(output="uint8"): round((clamp(x, -1, 1) + 1) * 127.5)."""
    out = torch.empty((video.shape[0], *video.shape[2:], video.shape[1]), dtype=torch.uint8, device=video.device)
    _finish_uint8(video, 1, out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Public decode APIs


def decode_video(
    vae, z_raw: Tensor, chunk: Chunk = 4, *, channels_last: bool | None = None, out: Tensor | None = None,
    fused: bool | None = None, tile=None, graphs=None, progress: Callable[[int, int], None] | None = None, **tiling,
) -> Tensor:
    """Decode a whole clip like diffusers' `vae.decode(z_raw).sample`: (N, C, T_out, H, W) in the VAE's dtype on its
    device, clamped to [-1, 1], T_out = 1 + 4(T-1). `chunk` latent frames per decoder call (see chunk_schedule);
    peak memory grows with it (estimate_chunk_bytes). The clip is written into one preallocated tensor (or `out`).
    `channels_last` None follows the decoder's Conv3d weights. `fused`: the Triton kernel path (conv biases folded,
    one-pass residual epilogues, kernel upsampling; see ChunkDecoder): None = when the kernels can run and the
    fused_norms stage is applied (or as $VAEOPT_VIDEO_FUSED says), True = required, False = torch ops only.
    `tile` (latent px: an int side -> row bands of that area, or (rows, cols)) decodes in spatial tiles with one causal
    cache per tile; `tiling` keywords (split, storage, replan, info, ...) go to vaeopt.video_tiling.iter_raw.
    `graphs`: per-chunk CUDA graphs (vaeopt.video_graphs): None = the policy attached to the model by
    vaeopt.video_graphs.enable (the pipeline's --graphs), else none; "off"; a ChunkGraphs (stage_table.chunk_graphs).
    `progress(frames done, total frames)` after each chunk."""
    z = prepare_latents(vae, z_raw)
    p = patch_size(vae)
    sched = chunk_schedule(z.shape[2], chunk)
    total = sum(output_frame_counts(sched, temporal_factor(vae)))
    for f0, y in _raw(vae, z, sched, channels_last, fused, tile, tiling, graphs):
        if out is None:
            out = torch.empty(final_shape(y, p, total), dtype=y.dtype, device=y.device)
        elif tuple(out.shape) != final_shape(y, p, total):
            raise LatentError(f"`out` has shape {tuple(out.shape)}, the clip needs {final_shape(y, p, total)}")
        finish_float(y, p, out[:, :, f0 : f0 + y.shape[2]])
        if progress is not None:
            progress(f0 + y.shape[2], total)
    return out


class _HostSlots:
    """A ring of `n` host buffers (pinned when the decode runs on CUDA); call i gets slot i % n."""

    def __init__(self, n: int, numel: int, dtype: torch.dtype, pin: bool):
        self.bufs = [torch.empty(numel, dtype=dtype, pin_memory=pin) for _ in range(n)]
        self.i = 0

    def take(self, shape) -> Tensor:
        buf = self.bufs[self.i % len(self.bufs)]
        self.i += 1
        return buf[: math.prod(shape)].view(shape)


def iter_decode_video(vae, z_raw: Tensor, chunk: Chunk = 4, copy_stream: bool = True, *, output: str = "uint8",
                      reuse_buffers: bool = False, channels_last: bool | None = None, fused: bool | None = None,
                      tile=None, graphs=None, **tiling) -> Iterator[Tensor]:
    """Decode a clip chunk by chunk, yielding consecutive groups of output frames on the CPU.

    output="uint8" (default): frames of one clip (z_raw.shape[0] == 1) as (f, H, W, 3) uint8, round((x + 1) * 127.5)
    of the clamped values: what a video writer takes. output="float": (N, 3, f, H, W) in the VAE's dtype, clamped to
    [-1, 1]: the matching slice of decode_video's result. The first group holds 1 + 4(k-1) frames, later ones 4k
    (k = latent frames of that call, see chunk_schedule).

    The iterator holds at most two chunks. By default each group is a fresh tensor the caller owns (on CUDA from
    torch's caching pinned-memory allocator): safe for consumers that queue groups, like outputs.Mp4Writer.
    reuse_buffers=True writes into two fixed host buffers alternately: a yielded tensor is then valid only until the
    iterator advances. On CUDA with copy_stream=True, chunk i's copy to the host runs on a side stream while chunk
    i+1 decodes, so the caller's work on chunk i overlaps the GPU; otherwise decode, copy, yield.
    `fused`, `tile`, `graphs`, `tiling`: as in decode_video.
    """
    if output not in ("uint8", "float"):
        raise ValueError(f"output must be 'uint8' or 'float', not {output!r}")
    z = prepare_latents(vae, z_raw)
    if output == "uint8" and z.shape[0] != 1:
        raise LatentError(f"uint8 frames are per clip: got a batch of {z.shape[0]}; pass z_raw[i:i+1] or "
                          "output='float'")
    p = patch_size(vae)
    sched = chunk_schedule(z.shape[2], chunk)
    counts = output_frame_counts(sched, temporal_factor(vae))
    cuda = z.device.type == "cuda"
    overlap = cuda and copy_stream
    side = torch.cuda.Stream(device=z.device) if overlap else None
    slots: _HostSlots | None = None
    # (host view, copy done, device source, host copy of the chunk's "has NaN/Inf" flag, its first frame)
    pending: tuple[Tensor, torch.cuda.Event, Tensor, Tensor | None, int] | None = None
    check = output == "uint8"  # uint8 frames would turn NaN/Inf into black pixels: raise DecodeError instead

    def _check(bad, f0: int, f: int) -> None:
        if bad is not None and bool(bad):
            raise DecodeError(f"the decoder produced non-finite values (NaN/Inf) in output frames {f0}-{f0 + f - 1}")

    for f0, y in _raw(vae, z, sched, channels_last, fused, tile, tiling, graphs):
        N, C, f, H, W = final_shape(y, p)
        bad = torch.isfinite(y).all().logical_not() if check else None  # on the device, no sync here
        shape = (f, H, W, C) if output == "uint8" else (N, C, f, H, W)
        dtype = torch.uint8 if output == "uint8" else y.dtype
        if reuse_buffers and slots is None:
            slots = _HostSlots(2, math.prod(shape) // f * max(counts), dtype, pin=cuda)
        host_buf = (lambda: slots.take(shape)) if reuse_buffers else (
            lambda: torch.empty(shape, dtype=dtype, pin_memory=cuda))
        if output == "uint8":
            finish = lambda y, p, dst: _finish_uint8(y, p, dst.unsqueeze(0))  # noqa: E731
        else:
            finish = finish_float
        if not cuda:  # finish straight into the host buffer
            _check(bad, f0, f)
            host = host_buf()
            finish(y, p, host)
            del y
            yield host
            del host  # the iterator keeps no reference to what it handed out
            continue
        dev = torch.empty(shape, dtype=dtype, device=y.device)
        finish(y, p, dev)
        del y
        if not overlap:
            host = host_buf()
            host.copy_(dev)  # blocking: waits for this chunk's compute
            del dev
            _check(bad, f0, f)
            yield host
            del host
            continue
        # Slot reuse is safe: the slot written now was handed out two chunks ago, and the caller has advanced since.
        host = host_buf()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(z.device))
        side.wait_event(ready)
        bad_host = torch.empty((), dtype=torch.bool, pin_memory=True) if check else None
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)
            if check:
                bad_host.copy_(bad, non_blocking=True)  # read once `done` has passed: no extra sync
            done = torch.cuda.Event()
            done.record(side)
        dev.record_stream(side)  # should the caller stop early and drop `dev` mid-copy, its memory waits for `side`
        if check:
            bad.record_stream(side)
        del bad
        if pending is not None:
            p_host, p_done, p_dev, p_bad, p_f0 = pending
            pending = None
            p_done.synchronize()  # the copy finished; only now may the allocator reuse p_dev's memory
            del p_dev
            _check(p_bad, p_f0, p_host.shape[0] if check else 0)
            yield p_host
            del p_host
        pending = (host, done, dev, bad_host, f0)
        del host, dev
    if pending is not None:
        p_host, p_done, p_dev, p_bad, p_f0 = pending
        pending = None
        p_done.synchronize()
        del p_dev
        _check(p_bad, p_f0, p_host.shape[0] if check else 0)
        yield p_host
