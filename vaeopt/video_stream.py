"""HunyuanVideo 1.5 and LTX-2 clips: exact chunks in time, exact tiles in space (vaeopt.engine.stream;
docs/video.md, "HunyuanVideo 1.5 and LTX-2").

`decode_clip` streams a clip through `StreamDecoder` a chunk of latent frames at a time into one preallocated clip
tensor. With `tile`, the front (up to up_blocks[split]) runs on whole frames and the back per spatial tile, each tile
with its own StreamDecoder and a halo covering the back's reach (`engine.stream.back_halo`): every norm of these
decoders is per position, so the tiles' interiors are the untiled decode's. An out-of-memory error restarts the clip
with the plan `replan` gives, where one is given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from vaeopt.engine.regions import halo_region, tile_grid
from vaeopt.engine.stream import STREAM_CLASSES, StreamDecoder, back_halo, chunk_schedule, unsupported
from vaeopt.errors import VaeoptError

__all__ = ["STREAM_CLASSES", "applies", "decode_clip", "default_split", "output_frames", "split_scale"]


def applies(vae) -> bool:
    """Whether this VAE's decode runs here (a HunyuanVideo 1.5 / LTX-2 decoder without timestep conditioning,
    noise injection or active dropout)."""
    return type(vae).__name__ in STREAM_CLASSES and unsupported(vae) is None


def temporal_factor(vae) -> int:
    """Output frames per latent frame after the first, from the decoder's upsamplers (a config's
    temporal_compression_ratio may describe the encoder, or be unset)."""
    f = int(getattr(vae.decoder, "patch_size_t", 1) or 1)
    for ub in vae.decoder.up_blocks:
        for up in ub.upsamplers or ():
            f *= up.stride[0] if hasattr(up, "stride") else (2 if up.add_temporal_upsample else 1)
    return f


def output_frames(vae, t_lat: int) -> int:
    return 1 + (t_lat - 1) * temporal_factor(vae)


def default_split(vae) -> int:
    """The first up block of the per-tile back: the last two up blocks (where the frames are largest) run per tile."""
    return max(1, len(vae.decoder.up_blocks) - 2)


def split_scale(vae, split: int) -> int:
    """Spatial scale of up_blocks[split]'s input against the latents."""
    s = 1
    for ub in list(vae.decoder.up_blocks)[:split]:
        for up in ub.upsamplers or ():
            s *= up.stride[1] if hasattr(up, "stride") else 2
    return s


def _tiles(h: int, w: int, tile) -> list[tuple[int, int, int, int]]:
    th, tw = (tile, tile) if isinstance(tile, int) else tile
    return tile_grid(h, w, max(1, min(th, h)), max(1, min(tw, w)))


def decode_clip(vae, z: Tensor, chunk: int = 2, *, tile=None, split: int | None = None, replan: Callable | None = None,
                info: dict | None = None, progress: Callable[[int, int], None] | None = None,
                causal: bool | None = None, clamp: bool = True) -> Tensor:
    """Decode raw latents (N, C, T, h, w) like `vae.decode(z).sample` (clamped to [-1, 1]), `chunk` latent frames
    per call. `tile`: latent px per tile side (int or (rows, cols)); the back part from up_blocks[split] on runs per
    tile. replan(latent shape, chunk, tile) -> the (chunk, tile) to restart with after an out-of-memory error, or
    None (None: the error is the caller's). `info` gets the plan actually used and any out-of-memory retries.
    clamp=False: diffusers' unclamped `vae.decode` output (vaeopt.optimize)."""
    why = unsupported(vae)
    if why:
        raise VaeoptError(f"vaeopt's chunked decode does not apply to this {type(vae).__name__}: {why}")
    info = {} if info is None else info
    info.setdefault("oom_events", [])
    while True:
        try:
            return _decode(vae, z, chunk, tile, split, info, progress, causal, clamp)
        except torch.cuda.OutOfMemoryError:
            nxt = replan(tuple(z.shape), chunk, tile) if replan is not None else None
            if nxt is None:
                raise
        torch.cuda.empty_cache()  # outside the except block: its traceback would keep the attempt's tensors alive
        info["oom_events"].append({"chunk": chunk, "tile": tile, "next": nxt})
        chunk, tile = nxt


def _decode(vae, z, chunk, tile, split, info, progress, causal, clamp=True) -> Tensor:
    _, _, t_lat, h, w = z.shape
    sched = chunk_schedule(t_lat, chunk)
    info.update(chunk=chunk, tile=tile)
    front = StreamDecoder(vae, causal=causal, cap=chunk)
    backs, regions, halo = [], None, 0
    if tile is not None:
        split = default_split(vae) if split is None else split
        sc = split_scale(vae, split)
        halo = back_halo(vae, split)
        regions = _tiles(h * sc, w * sc, (tile * sc, tile * sc) if isinstance(tile, int) else
                         (tile[0] * sc, tile[1] * sc))
        info.update(split=split, halo=halo, tiles=len(regions))
        backs = [StreamDecoder(vae, causal=causal, cap=chunk) for _ in regions]
    z = z.to(next(vae.decoder.parameters()).dtype)
    try:
        return _stream(front, backs, regions, halo, split, z, sched, output_frames(vae, t_lat), progress, clamp)
    finally:  # the decoders' state refers back to them: freed now, not at Python's next cycle collection
        for d in [front, *backs]:
            d.close()


def _stream(front, backs, regions, halo, split, z, sched, total, progress, clamp) -> Tensor:
    n = z.shape[0]
    out = None
    done = 0
    for i, (a, b) in enumerate(sched):
        final = i == len(sched) - 1
        pieces = (front.pieces(z[:, :, a:b], final) if regions is None
                  else _tiled_pieces(front, backs, regions, halo, split, z[:, :, a:b], final))
        for y in pieces:
            if out is None:
                out = torch.empty((n, y.shape[1], total, *y.shape[-2:]), dtype=y.dtype, device=y.device)
            f = y.shape[2]
            if f:
                out[:, :, done:done + f].copy_(y.clamp_(-1, 1) if clamp else y)
            done += f
            del y
        if progress is not None:
            progress(done, total)
    if done != total:
        raise VaeoptError(f"internal: the chunked decode gave {done} frames, the clip has {total}")
    return out


def _tiled_pieces(front, backs, regions, halo, split, z, final):
    """Each piece of the front's output at up_blocks[split], decoded per tile (a halo'd crop, cropped back)."""
    for x, last in front.front(z, split, final):
        _, _, _, H, W = x.shape
        y = None
        for dec, (y0, y1, x0, x1) in zip(backs, regions):
            c0, c1, d0, d1 = halo_region((H, W), y0, y1, x0, x1, halo, halo)
            part = dec.back(x[:, :, :, c0:c1, d0:d1], split, last)
            s = part.shape[-1] // (d1 - d0)  # output px per px at the split
            if y is None:
                y = torch.empty((*part.shape[:3], H * s, W * s), dtype=part.dtype, device=part.device)
            y[..., y0 * s:y1 * s, x0 * s:x1 * s] = part[..., (y0 - c0) * s:(y1 - c0) * s, (x0 - d0) * s:(x1 - d0) * s]
            del part
        yield y
