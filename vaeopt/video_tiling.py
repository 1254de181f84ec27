"""Exact spatial tiling of causal video decodes (Wan 2.1 / 2.2), with one causal cache per tile for the whole clip
(docs/video.md, "Spatial tiles for small cards"): for when one chunk of latent frames does not fit.

Per chunk (vaeopt.video's schedule), the *front* -- post_quant_conv, conv_in, the mid-block (its per-frame attention
is global, so never tiled) and up_blocks[:split] -- runs once on the whole frame (`ChunkDecoder.front`); the *back*
-- up_blocks[split:], norm_out, conv_out -- runs tile by tile (`ChunkDecoder.back`) on a crop of the front's output
widened by the back's receptive field (`receptive_field`, counted from its modules), keeping the interior. Every op
in the back is per pixel, a nearest 2x upsample / DupUp3D, or a conv of known radius, and no statistics cross pixels
(no GroupNorm), so the interior equals the untiled decode and nothing is merged or blended. Each tile owns a
`ChunkDecoder` whose causal caches persist across the clip's chunks, so chunking and tiling compose exactly.

The caches are most of the memory and tiling does not shrink them: they stay on the device (storage="device") or
live in pinned host memory (storage="host"), prefetched while the previous tile computes; either way they are
carved from one allocation made up front (_Arena). `estimate_tiled_video_bytes` is a dry run of this decode on meta
tensors, which vaeopt.planner searches plans with; `iter_raw` with a `replan` restarts the clip with the next plan
after a CUDA out-of-memory error, skipping the frames already handed out.
"""

from __future__ import annotations

import collections
import functools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vaeopt import video_graphs
from vaeopt.engine import memory
from vaeopt.engine.stats import OOM_ERRORS
from vaeopt.engine.regions import (TilingError, band_tiles, default_split, front_scale, halo_region, min_tile_rows,
                                   receptive_field, resolve_tile, spatial_factor, tile_grid)
from vaeopt.engine.wan import ChunkDecoder
from vaeopt.engine.wan_ops import Chunk, check_vae, chunk_schedule, prepare_latents
from vaeopt.errors import VaeoptError
from vaeopt.stages.marks import wan_channels_last

__all__ = ["TiledVideoPlan", "band_tiles", "cache_floor_bytes", "check_tile", "default_split",
           "estimate_tiled_video_bytes", "iter_raw", "min_tile_rows", "receptive_field", "resolve_tile"]

MAX_INFLIGHT_WRITES = 1  # host cache storage: tiles whose device caches may still be on their way to the host


@dataclass(frozen=True)
class TiledVideoPlan:
    """One way to decode a clip: latent frames per call, tile (latent rows, cols) or None (untiled), the split
    (first tiled up block) and where the tiles' causal caches live ("device" / "host")."""

    chunk: int
    tile: tuple[int, int] | None
    split: int
    storage: str = "device"

    def describe(self, vae=None, latent_hw: tuple[int, int] | None = None) -> str:
        """'tile 1280x360px (2 tiles), chunk 1, split at up block 3, caches on device' (px given the VAE)."""
        if self.tile is None:
            return f"untiled, chunk {self.chunk}"
        s = f"tile {self.tile[0]}x{self.tile[1]} latent"
        if vae is not None:
            f = spatial_factor(vae)
            s = f"tile {self.tile[1] * f}x{self.tile[0] * f}px"
            if latent_hw is not None:
                s += f" ({len(tile_grid(*latent_hw, *self.tile))} tiles)"
        return f"{s}, chunk {self.chunk}, split at up block {self.split}, caches on {self.storage}"



# ---------------------------------------------------------------------------------------------------------------
# Causal caches carved from one allocation
#
# Reserved up front (sized by a dry run): caches allocated one by one between transient buffers fragment the
# caching allocator (docs/video.md, "Spatial tiles for small cards").

_ALIGN = 512


class _Arena:
    """One device allocation handed out as cache tensors by bump allocation (512-byte aligned); reset() reuses it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.buf = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
        self.off = 0

    def reset(self) -> None:
        self.off = 0

    def take(self, shape, dtype: torch.dtype, stride=None, memory_format=torch.contiguous_format) -> Tensor | None:
        """An uninitialised tensor of `shape` (dense: `stride`, or that of `memory_format`), None when full."""
        nb = math.prod(shape) * dtype.itemsize
        if self.off + nb > self.buf.numel():
            return None
        if stride is None:
            stride = torch.empty(shape, device="meta", memory_format=memory_format).stride()
        t = self.buf[self.off : self.off + nb].view(dtype).as_strided(shape, stride)
        self.off += _aligned(nb)
        return t


def _config_json(vae) -> str:
    """The model's config as the key of the dry-run caches below."""
    return json.dumps(dict(vae.config), sort_keys=True, default=str)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def cache_bytes_per_decoder(vae, latent_shape: Sequence[int], plan: TiledVideoPlan,
                            channels_last: bool = False) -> tuple[int, ...]:
    """Bytes (each cache 512-byte aligned) of the causal caches of every decoder of `plan`: the front's, then each
    tile's; one entry for an untiled plan. From a dry run on meta tensors, in the model's dtype (an upper bound where
    a cache ends up in fp8)."""
    dtype = vae.post_quant_conv.weight.dtype
    shape = tuple(int(s) for s in latent_shape)
    config = _config_json(vae)
    return _decoder_cache_bytes(type(vae), config, shape, plan.chunk, plan.tile, plan.split, dtype,
                                bool(channels_last))


@functools.lru_cache(maxsize=64)
def _decoder_cache_bytes(cls, config_json: str, shape: tuple, K: int, tile, split: int, dtype,
                         channels_last: bool) -> tuple[int, ...]:
    N, C, T, h, w = shape
    sched = [min(K, T)] + ([K] if T > K else [])
    skel = memory.meta_skeleton(cls, config_json, dtype)
    with memory.MemEfficientSDPA(), torch.no_grad():
        z = torch.empty((N, C, sum(sched), h, w), device="meta", dtype=dtype)
        if tile is None:
            runner = ChunkDecoder(skel, channels_last, fused=True)
            decs = [runner]
        else:
            runner = _TiledClip(skel, (h, w), TiledVideoPlan(K, tile, split, "device"), channels_last, True,
                                device="meta")
            decs = [runner.front, *runner.tiles]
        t0 = 0
        for k in sched:
            runner.step(z[:, :, t0 : t0 + k])
            t0 += k
        return tuple(sum(_aligned(v.nbytes) for v in d.cache.values()) for d in decs)


# ---------------------------------------------------------------------------------------------------------------
# Where the tiles' caches live between their calls


class _CacheStore:
    """Per-tile causal caches ({conv: (N, C, 2, h, w)}) between a tile's calls.

    "device": they stay in the tile's decoder (nothing to do). "host": after each call the caches are copied to
    pinned host tensors on a device->host stream (the device copies are kept alive, and the allocator fenced by
    record_stream, until the copy is done; at most MAX_INFLIGHT_WRITES tiles in flight), and before a tile runs its
    caches come back on a host->device stream, prefetched while the previous tile computes. On CUDA everything is
    ordered by events; elsewhere (CPU tests with `force_copy`) the copies are synchronous. On meta tensors (dry runs)
    only the device-side allocations are made, with the same lifetimes, so the estimate counts what the GPU holds."""

    def __init__(self, n: int, storage: str, device: torch.device, overlap: bool = True, force_copy: bool = False,
                 slot_bytes: int = 0):
        if storage not in ("device", "host"):
            raise ValueError(f"storage must be 'device' or 'host', not {storage!r}")
        self.host_mode = storage == "host"
        self.device = device
        self.meta = device.type == "meta"
        self.cuda = device.type == "cuda"
        self.async_ = self.cuda and overlap
        if self.host_mode and not (self.cuda or self.meta or force_copy):
            raise ValueError("host cache storage needs a CUDA device (or force_copy for tests)")
        self.host: list[dict | None] = [None] * n  # tile -> {conv: host tensor} (meta: {conv: (shape, stride)})
        self.ready: dict[int, tuple[dict, object]] = {}  # prefetched: tile -> (device caches, h2d event)
        self.written: list[object] = [None] * n  # tile -> d2h event of its last write
        self.inflight: collections.deque = collections.deque()  # (event, device caches) of writes in flight
        self.bytes_h2d = self.bytes_d2h = 0
        self.prefetch_hits = 0
        if self.async_:
            self.h2d = torch.cuda.Stream(device=device)
            self.d2h = torch.cuda.Stream(device=device)
        # Host storage with slot_bytes: the tiles' device caches live in min(n, 3) fixed slots (tile i in slot i % 3:
        # the tile computing, the one prefetched, the one being written back), not in fresh allocations per call.
        self.slots = [_Arena(slot_bytes, device) for _ in range(min(n, 3))] \
            if self.host_mode and slot_bytes and not self.meta else []
        self.slot_read: list[object] = [None] * len(self.slots)  # slot -> event of the last write-back from it

    def _slot(self, i: int) -> tuple[int, _Arena] | tuple[None, None]:
        return (i % len(self.slots), self.slots[i % len(self.slots)]) if self.slots else (None, None)

    def _load(self, i: int) -> tuple[dict, object]:
        host = self.host[i]
        if self.meta:
            return {k: torch.empty_strided(sh, st, dtype=dt, device="meta") for k, (sh, st, dt) in host.items()}, None
        si, slot = self._slot(i)
        if slot is not None:
            slot.reset()
        dev = {k: (slot.take(v.shape, v.dtype, v.stride()) if slot is not None else None) for k, v in host.items()}
        dev = {k: t if t is not None else torch.empty_strided(host[k].shape, host[k].stride(), dtype=host[k].dtype,
                                                                device=self.device) for k, t in dev.items()}
        self.bytes_h2d += sum(v.nbytes for v in host.values())
        if not self.async_:
            for k, v in host.items():
                dev[k].copy_(v)
            return dev, None
        free = torch.cuda.Event()  # the new tensors' memory may have been in use by the compute stream
        free.record(torch.cuda.current_stream(self.device))
        self.h2d.wait_event(free)
        if self.written[i] is not None:
            self.h2d.wait_event(self.written[i])  # the host copy is complete
        if si is not None and self.slot_read[si] is not None:
            self.h2d.wait_event(self.slot_read[si])  # the slot's previous tile has been written back
        with torch.cuda.stream(self.h2d):
            for k, v in host.items():
                dev[k].copy_(v, non_blocking=True)
                dev[k].record_stream(self.h2d)  # should the prefetch be dropped unused (an error), its memory waits
            done = torch.cuda.Event()
            done.record(self.h2d)
        return dev, done

    def prefetch(self, i: int) -> None:
        if self.host_mode and self.host[i] is not None and i not in self.ready:
            self.ready[i] = self._load(i)

    def acquire(self, i: int, dec: ChunkDecoder) -> None:
        """Give tile i's decoder its caches for the next call."""
        if not self.host_mode:
            return
        si, slot = self._slot(i)
        if self.host[i] is None:  # the clip's first call: the decoder creates its caches, in the tile's slot
            if slot is not None:
                slot.reset()
                if self.async_ and self.slot_read[si] is not None:
                    torch.cuda.current_stream(self.device).wait_event(self.slot_read[si])
                dec.arena = slot
            return
        if slot is not None:
            dec.arena = slot  # a cache first needed in this call (time_conv in the clip's 2nd call) goes there too
        if i in self.ready:
            self.prefetch_hits += 1
            dev, ev = self.ready.pop(i)
        else:
            dev, ev = self._load(i)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        dec.cache = dev

    def release(self, i: int, dec: ChunkDecoder) -> None:
        """Tile i has finished a call: write its caches back (host storage) and drop the device copies."""
        if not self.host_mode:
            return
        dev, dec.cache = dec.cache, {}
        dec.arena = None
        if self.meta:
            self.host[i] = {k: (tuple(v.shape), v.stride(), v.dtype) for k, v in dev.items()}
            self._retire(None, dev)
            return
        if self.host[i] is None:
            self.host[i] = {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu",
                                                   pin_memory=self.cuda) for k, v in dev.items()}
        host = self.host[i]
        self.bytes_d2h += sum(v.nbytes for v in dev.values())
        if not self.async_:
            for k, v in dev.items():
                host[k].copy_(v)
            return
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        self.d2h.wait_event(computed)
        with torch.cuda.stream(self.d2h):
            for k, v in dev.items():
                host[k].copy_(v, non_blocking=True)
                v.record_stream(self.d2h)
            done = torch.cuda.Event()
            done.record(self.d2h)
        self.written[i] = done
        si, _ = self._slot(i)
        if si is not None:
            self.slot_read[si] = done
        self._retire(done, dev)

    def _retire(self, event, dev: dict) -> None:
        """Keep `dev` alive until its write is done, with at most MAX_INFLIGHT_WRITES writes in flight."""
        self.inflight.append((event, dev))
        self._drain(MAX_INFLIGHT_WRITES)

    def _drain(self, keep: int) -> None:
        while len(self.inflight) > keep:
            ev, _ = self.inflight.popleft()
            if ev is not None:
                ev.synchronize()

    def finish(self) -> None:
        self._drain(0)
        self.ready.clear()


# ---------------------------------------------------------------------------------------------------------------
# The tiled clip decoder


class _TiledClip:
    """Decodes consecutive chunks of one clip: the front once per chunk on the whole frame, the back per tile, each
    tile with its own ChunkDecoder (own causal caches) for the whole clip. step() returns the decoder's raw output
    for the chunk, like ChunkDecoder.step."""

    def __init__(self, vae, latent_hw: tuple[int, int], plan: TiledVideoPlan, channels_last: bool,
                 fused: bool | None, overlap: bool = True, force_copy: bool = False, device=None,
                 arena_bytes: Sequence[int] | None = None):
        self.vae = vae
        self.split = plan.split
        n_up = len(vae.decoder.up_blocks)
        if not 0 <= self.split <= n_up:
            raise TilingError(f"split {self.split}: the decoder has {n_up} up blocks")
        self.halo, self.out_scale = receptive_field(vae, self.split)
        self.scale = front_scale(vae, self.split)  # front output / latent resolution
        h, w = latent_hw
        th, tw = plan.tile if plan.tile is not None else (h, w)
        s = self.scale
        # interior regions at the front's output resolution, aligned to latent pixels
        self.regions = [(y0 * s, y1 * s, x0 * s, x1 * s) for y0, y1, x0, x1 in tile_grid(h, w, th, tw)]
        H, W = h * s, w * s
        self.ext = [halo_region((H, W), *r, self.halo, self.halo) for r in self.regions]
        # a tile's convs run on the 5-D staged input: a time-stacked Conv2d's 3x input is not in the tiled estimate
        self.front = ChunkDecoder(vae, channels_last, fused, stack=False)
        self.tiles = [ChunkDecoder(vae, channels_last, fused, stack=False) for _ in self.regions]
        self.mf = self.front.mf
        dev = torch.device(device or vae.post_quant_conv.weight.device)
        # arena_bytes (real runs; cache_bytes_per_decoder): the front's and, with device storage, all tiles' caches
        # in one block; with host storage the tiles' device caches in the store's slots.
        host = plan.storage == "host"
        slot = max(arena_bytes[1:], default=0) if arena_bytes and host else 0
        self.store = _CacheStore(len(self.regions), plan.storage, dev, overlap, force_copy, slot_bytes=slot)
        if arena_bytes and dev.type != "meta":
            arena = _Arena(arena_bytes[0] if host else sum(arena_bytes), dev)
            for d in [self.front] + ([] if host else self.tiles):
                d.arena = arena
        # Dry runs (meta tensors): a tile whose crop has the same shape as an earlier tile's needs exactly the same
        # memory, so only the first tile of each shape runs its layers; the others get storage of that tile's output
        # and caches (cache_like), with the same lifetimes. Bands have <= 3 distinct shapes: the estimate's cost
        # does not grow with the number of tiles.
        first: dict[tuple[int, int], int] = {}
        self.clone_of = [first.setdefault((e[1] - e[0], e[3] - e[2]), i) for i, e in enumerate(self.ext)] \
            if self.store.meta else list(range(len(self.ext)))
        self._shapes: dict[int, tuple] = {}  # representative tile -> (output (shape, stride), {conv: (shape, stride)})

    @property
    def stats(self) -> collections.Counter:
        c = collections.Counter(self.front.stats)
        for t in self.tiles:
            c.update(t.stats)
        return c

    def cache_bytes(self) -> int:
        """Bytes of all tiles' causal caches (wherever they are) after a call."""
        if self.store.host_mode:
            return sum(sum(math.prod(v[0]) * v[2].itemsize if self.store.meta else v.nbytes for v in h.values())
                       for h in self.store.host if h)
        return sum(v.nbytes for t in self.tiles for v in t.cache.values())

    def step(self, z: Tensor) -> Tensor:
        """z: the next k latent frames -> the decoder's raw output for them (N, C_out, f, H, W), assembled from the
        tiles' interiors; the front's output (the input of up_blocks[split]) lives until the last tile is done."""
        with torch.no_grad():
            self.store.prefetch(0)  # overlaps the front
            box, xb = self.front.front(z, self.split)
            self.front.first = False
            x = box.pop()
            N, C, f = x.shape[:3]
            whole = len(self.regions) == 1
            y_full = None
            for i, ((y0, y1, x0, x1), (ey0, ey1, ex0, ex1)) in enumerate(zip(self.regions, self.ext)):
                dec = self.tiles[i]
                self.store.acquire(i, dec)
                if i + 1 < len(self.regions):
                    self.store.prefetch(i + 1)
                if whole:
                    crop = x
                else:  # a dense copy of the crop in the decode's layout: what the kernels and convs expect
                    crop = torch.empty((N, C, f, ey1 - ey0, ex1 - ex0), dtype=x.dtype, device=x.device,
                                       memory_format=self.mf)
                    crop.copy_(x[:, :, :, ey0:ey1, ex0:ex1])
                box = [crop]
                del crop
                if whole:
                    del x
                j = self.clone_of[i]
                if j == i:
                    y = dec.back(box, xb, self.split)
                    if self.store.meta:
                        self._shapes[i] = ((y.shape, y.stride()), {k: (v.shape, v.stride(), v.dtype)
                                                                   for k, v in dec.cache.items()})
                else:  # dry run: tile i has tile j's shapes
                    box.clear()
                    (ysh, yst), cache_like = self._shapes[j]
                    if not dec.cache:  # the clip's first call (device storage keeps them; host storage reloads)
                        dec.cache = {k: torch.empty_strided(sh, st, dtype=dt, device="meta")
                                     for k, (sh, st, dt) in cache_like.items()}
                    y = torch.empty_strided(ysh, yst, dtype=x.dtype, device="meta")
                self.store.release(i, dec)
                F_ = self.out_scale
                if whole:
                    y_full = y
                else:
                    if y_full is None:
                        y_full = torch.empty((N, y.shape[1], y.shape[2], x.shape[3] * F_, x.shape[4] * F_),
                                             dtype=y.dtype, device=y.device, memory_format=self.mf)
                    oy, ox = (y0 - ey0) * F_, (x0 - ex0) * F_
                    y_full[:, :, :, y0 * F_ : y1 * F_, x0 * F_ : x1 * F_].copy_(
                        y[:, :, :, oy : oy + (y1 - y0) * F_, ox : ox + (x1 - x0) * F_])
                del y
            return y_full

    def close(self) -> None:
        self.store.finish()


# ---------------------------------------------------------------------------------------------------------------
# Running a plan, with OOM fallback


def check_tile(vae, plan: TiledVideoPlan, latent_hw: tuple[int, int]) -> None:
    """VaeoptError, naming the halo, for a tile smaller than min_tile_rows on a side the frame is larger than."""
    if plan.tile is None:
        return
    m = min_tile_rows(vae, plan.split)
    th, tw = plan.tile
    h, w = latent_hw
    if th < min(m, h) or tw < min(m, w):
        halo, _ = receptive_field(vae, plan.split)
        f = spatial_factor(vae)
        raise VaeoptError(
            f"tile {tw * f}x{th * f}px ({th}x{tw} latent): tiling from up block {plan.split} on needs a halo of "
            f"{halo}px at {front_scale(vae, plan.split)}x the latent resolution (the receptive field of the layers "
            f"after it), so tiles must be at least {m} latent px ({m * f} output px) on each side; smaller tiles "
            "would spend more than 3x their compute on halos")


def iter_raw(
    vae, z: Tensor, chunk: Chunk, tile: int | Sequence[int] | None = None, *,
    channels_last: bool | None = None, fused: bool | None = None, split: int | None = None,
    storage: str = "device", overlap: bool = True, replan: Callable | None = None, info: dict | None = None,
    arena: bool = True, graphs=None, _force_copy: bool = False,
) -> Iterator[tuple[int, Tensor]]:
    """(first output frame index, raw decoder output) per call, like vaeopt.video's untiled loop, for a tiled plan.

    tile: None = untiled (vaeopt.video's decoder); an int (square side in latent px -> full-width bands of that
    area) or (rows, cols) in latent px. split: first tiled up block (None: default_split). storage: "device" or
    "host" (pinned; CUDA) for the tiles' causal caches. replan: after a CUDA out-of-memory error, free, ask it for
    the next plan (vaeopt.planner.smaller_video_plan's arguments: the model, the latent shape, the failed plan, the
    plans tried, dtype, channels_last, fused, whether host caches are possible) and decode the clip again from its
    first frame, skipping the frames already handed out; the events go to info["oom_events"] (None: the error is the
    caller's). arena: the causal caches come from one allocation made at the
    start (see _Arena; False: allocated one by one, as vaeopt.video does). graphs: per-chunk CUDA graphs for untiled
    plans (vaeopt.video_graphs; None: the model's policy, if any); each attempt gets a record (info["graphs"]).
    `info` (a dict, filled in): plan, tiles, halo, shrinks, ..."""
    z = prepare_latents(vae, z)
    N, _, T, h, w = z.shape
    cl = wan_channels_last(vae, channels_last)
    kern = ChunkDecoder(vae, cl, fused)._kernels_on(z)  # what the decoders will run: for the estimates
    split = default_split(vae) if split is None else int(split)
    sched0 = chunk_schedule(T, chunk)
    K = max(sched0)
    plan = TiledVideoPlan(K, resolve_tile(tile, (h, w)) if tile is not None else None, split, storage)
    check_tile(vae, plan, (h, w))
    info = info if info is not None else {}
    info.update(planned=plan, plan=plan, oom_events=[], shrinks=0)
    tried: set = set()
    delivered = 0  # output frames handed out so far
    cuda = z.device.type == "cuda"
    while True:
        tried.add(plan)
        info["plan"] = plan
        sched = sched0 if plan.chunk == K else chunk_schedule(T, plan.chunk)
        runner = y = None
        try:
            arena_bytes = cache_bytes_per_decoder(vae, z.shape, plan, cl) if arena else None
            if plan.tile is None:
                runner = ChunkDecoder(vae, cl, fused, stack=True)  # as the untiled estimate assumes
                runner.one_call = len(sched) == 1  # (then it keeps no causal history: no block reserved for it)
                if arena_bytes and not runner.one_call:
                    runner.arena = _Arena(arena_bytes[0], z.device)
                info.update(tiles=1, halo=0)
                runner = video_graphs.wrap(runner, vae, z, sched, graphs, info=info)
            else:
                runner = _TiledClip(vae, (h, w), plan, cl, fused, overlap, _force_copy, arena_bytes=arena_bytes)
                info.update(tiles=len(runner.regions), halo=runner.halo, split=plan.split)
                video_graphs.wrap(runner, vae, z, sched, graphs, tiles=len(runner.regions), info=info)  # reason
            t0 = f0 = 0
            for k in sched:
                y = runner.step(z[:, :, t0 : t0 + k])
                t0 += k
                f1 = f0 + y.shape[2]
                if f1 > delivered:  # after a restart, the frames already handed out are decoded again but skipped
                    if f0 < delivered:
                        y = y[:, :, delivered - f0 :]
                    yield max(f0, delivered), y
                    delivered = f1
                y = None
                f0 = f1
            if isinstance(runner, video_graphs.GraphedSteps):
                runner.finish()
            if isinstance(runner, _TiledClip):
                runner.close()
                info.update(bytes_h2d=runner.store.bytes_h2d, bytes_d2h=runner.store.bytes_d2h,
                            prefetch_hits=runner.store.prefetch_hits, cache_bytes=runner.cache_bytes())
            info["stats"] = dict(runner.stats)
            return
        except OOM_ERRORS as e:
            if replan is None:
                raise
            failed = str(e).splitlines()[0] if str(e) else type(e).__name__
        # Outside the except clause the exception's traceback (and the failed call's tensors in its frames) is gone.
        runner = y = None
        if cuda:
            torch.cuda.synchronize(z.device)
            torch.cuda.empty_cache()
        nxt = replan(vae, z.shape, plan, tried, z.dtype, cl, kern, cuda)
        info["oom_events"].append({"plan": plan, "next": nxt, "frames_done": delivered, "error": failed})
        if nxt is None:
            raise VaeoptError(f"out of memory decoding the clip, and no plan needs less memory than "
                              f"{plan.describe(vae, (h, w))} (tried {len(tried)} plan(s)): {failed}")
        info["shrinks"] += 1
        plan = nxt


# ---------------------------------------------------------------------------------------------------------------
# Memory estimate: a dry run of the tiled decode on meta tensors


def estimate_tiled_video_bytes(
    vae, latent_shape: Sequence[int], chunk: Chunk, tile: int | Sequence[int] | None,
    dtype: torch.dtype | None = None, channels_last: bool = False, fused: bool = False, split: int | None = None,
    storage: str = "device",
) -> int:
    """Peak device bytes of decoding with this plan (steady state: a first chunk and a full one after it, all tiles),
    excluding weights and decode_video's whole-clip output, like vaeopt.video.estimate_chunk_bytes (same counter:
    the bytes of all live tensor storages, SDPA as a fused kernel). Includes the front's caches and output, every
    tile's caches (device storage) or those of the tiles in flight (host storage), the crop, the back's working set
    and the chunk's raw output. Cached per argument set; ~0.05 s per tile on a CPU at 720p."""
    check_vae(vae)
    dtype = dtype or vae.post_quant_conv.weight.dtype
    shape = tuple(int(s) for s in latent_shape)
    K = max(chunk_schedule(shape[2], chunk))
    t = None if tile is None else resolve_tile(tile, shape[-2:])
    split = default_split(vae) if split is None else int(split)
    config = _config_json(vae)
    stacked = memory.stacked_names(vae) if t is None and fused else ()  # tiles never run stacked (stack=False)
    return _estimate(type(vae), config, shape, K, t, dtype, bool(channels_last), bool(fused), split, storage,
                     stacked)


@functools.lru_cache(maxsize=1024)
def _estimate(cls, config_json: str, shape: tuple, K: int, tile, dtype, channels_last: bool, fused: bool,
              split: int, storage: str, stacked: tuple[str, ...] = ()) -> int:
    if tile is None:
        return memory.estimate_peak(cls, config_json, shape, K, dtype, channels_last, fused, stacked)
    skel = memory.meta_skeleton(cls, config_json, dtype)
    plan = TiledVideoPlan(K, tile, split, storage)
    return memory.meta_peak(lambda: _TiledClip(skel, shape[-2:], plan, channels_last, fused, device="meta"),
                            shape, K, dtype)


def cache_floor_bytes(vae, latent_shape: Sequence[int], dtype: torch.dtype | None = None,
                      channels_last: bool = False) -> int:
    """Bytes of the untiled decode's causal caches (2 frames of every causal conv's input, the whole frame): no
    plan with the caches on the device needs less (tiles add their halo rings), which lets the planner skip those
    plans without a dry run each."""
    check_vae(vae)
    dtype = dtype or vae.post_quant_conv.weight.dtype
    N, C, T, h, w = (int(s) for s in latent_shape)
    config = _config_json(vae)
    return _cache_floor(type(vae), config, (N, C, min(T, 2), h, w), dtype, bool(channels_last))


@functools.lru_cache(maxsize=64)
def _cache_floor(cls, config_json: str, shape: tuple, dtype, channels_last: bool) -> int:
    skel = memory.meta_skeleton(cls, config_json, dtype)
    with memory.MemEfficientSDPA(), torch.no_grad():
        z = torch.empty(shape, device="meta", dtype=dtype)
        dec = ChunkDecoder(skel, channels_last, fused=False)
        for t in range(shape[2]):
            dec.step(z[:, :, t : t + 1])
        return int(sum(v.nbytes for v in dec.cache.values()))

