"""Exact layer-streamed tiled decoding for diffusers ``AutoencoderKL`` (SD 1.x/2.x, SDXL, SD3, FLUX topology).

Why not diffusers' ``enable_tiling()``: it decodes overlapping latent tiles *independently* and blends them. Every
GroupNorm inside a tile then normalizes with that tile's own statistics, so tiles come out with different tones; on
the trained ``tiny_kl_image`` VAE that is only 26-28 dB PSNR against the untiled decode (see docs/tiling.md),
and the overlap costs ~2.4x the compute at 1024^2.

What this module does instead ("layer streaming"): the whole decode is run *layer by layer* over the full image, but
each layer is evaluated tile by tile, so that the accelerator only ever holds one tile's working set:

* ``post_quant_conv``, ``conv_in`` and the mid-block (resnets + global attention) run untiled at latent resolution
  (1/64 of the output pixels, so cheap; attention over all latent tokens stays exact).
* Every up-block layer and the output head is a tiled *pass*: a 3x3 conv reads its tile plus a 1-pixel halo of the
  full input activation (zeros only at true image borders), so conv results are exact, not approximated.
* Every GroupNorm uses the statistics of the WHOLE activation: the pass that produces an activation also records
  per-tile moments and merges them exactly (Chan et al.'s parallel variance).
* Nearest upsampling, residual adds and the 1x1 shortcut convs are pointwise per tile.
* Full-size intermediate activations live in buffers on a *storage* device (the compute device when they fit, else
  CPU, pinned when CUDA is present and ``pin``; when only some fit, those stay on the compute device and the rest go
  to the host, buffer by buffer). Only tiles travel to the compute device.

Two implementations of the per-tile math, same structure:

* **Kernel path** (CUDA, or CPU under TRITON_INTERPRET=1; ``kernels=None`` picks it when the Triton kernels can run):
  the norms use ``kernels/group_norm_silu.py``'s split API. A pass records each tile's ``group_norm_partials`` (the
  split-stats kernel's per-chunk (count, mean, M2), with the pending conv bias added on load); the consumer merges
  all tiles' chunks exactly in one ``group_norm_finalize`` launch and every tile is normalized by
  ``group_norm_apply``: one kernel reads the halo'd region *in place* from the storage buffer (any strides), applies
  (x + bias - mean) * scale + beta and SiLU in fp32, and writes the model dtype once -- already zero-padded to the
  conv's full halo, so every conv runs with ``padding=0`` and returns exactly its tile (no crops). Convs run WITHOUT
  their bias: the bias stays *pending* on the activation (``Activation.bias``) and is added where the value is next
  read -- inside the next norm's stats/apply (``x_bias``), in the residual epilogue (``residual_bias``; through a 1x1
  shortcut conv as ``W @ bias``), or in the nearest-2x upsample kernel. Resnet outputs are one ``bias_residual``
  kernel (conv2 bias + residual + shortcut bias + output scale), written straight into the storage buffer when the
  region is addressable (row bands of an NHWC buffer). Nothing is materialised in fp32.
* **Torch path** (anything else: plain CPU, MPS, no Triton): per-channel (count, mean, M2) per tile merged in fp64,
  ``addcmul`` in fp32 + cast + SiLU, convs with their bias.

Tile shape: ``shape="tiles"`` cuts each layer into (th*s, tw*s) rectangles; ``shape="bands"`` into full-width row
bands with the same area (th*tw/w latent rows). Bands are the default on the kernel path and on CUDA: every region
of an NHWC buffer is then one contiguous block (reads are views, the residual epilogue writes in place, host<->device
copies are single DMA transfers). ``tile`` keeps its meaning (the per-tile area budget, in latent px).

Storage on CPU (CUDA compute): buffers are NHWC and, with ``pin``, pinned; region reads of pinned buffers go through a
copy stream (host->device) and are prefetched one tile ahead, writes through a second stream (device->host), both overlapping compute; at most two
tiles' writes are in flight. ``info["bytes_h2d"]`` / ``info["bytes_d2h"]`` report the traffic.

The result equals the untiled decode up to rounding (>100 dB PSNR in fp32 on tiny_kl_image), for 1x the
convolution FLOPs plus a 1-pixel halo ring per tile ((t+2)^2/t^2: 1.6% at a 256-px tile).

Modules are *called*, not re-implemented, wherever that keeps the result exact: a plain ``nn.Conv2d`` (no hooks, no
overridden ``forward``) is evaluated as ``F.conv2d`` with its own weights and ``padding=0`` on the halo'd tile (same
math, no wasted ring); any other conv / upsampler module (fused, quantized, hooked, ...) is called on the halo'd tile
and the interior of its output is cropped, which is exact for any padding-preserving local operator of radius <= the
halo (its bias is then applied by the module). The nonlinearities and dropout of the model are called as modules
unless they are plain SiLU/Identity. Only GroupNorm must be applied by hand (with the global statistics); any norm
module exposing ``num_groups``, ``eps``, ``weight`` and ``bias`` is accepted.

OOM handling: every tile computes into fresh tensors and commits (buffer write + statistics) only at its very end
(the in-place residual write is the last operation, after every allocation of the tile). If a tile raises
``torch.cuda.OutOfMemoryError`` (or ``torch.OutOfMemoryError``) the tile side is halved for all remaining work, the
failed tile is re-split and the pass resumes; completed tiles are never recomputed. How often that happened is
reported in the info dict (``shrinks``).

Public API: :func:`tiled_decode`, :class:`TiledDecoder`, :func:`tile_from_pixels`. The memory model (what a decode
needs where: :func:`estimate_tiled_bytes`, :func:`storage_bytes`, :func:`storage_buffers`) lives in
vaeopt/tiling_memory.py and is re-exported here.

Not covered: video VAEs (AutoencoderKLWan / HunyuanVideo: causal 3D convs with temporal caches; Wan has its own
tiler, vaeopt/video_tiling.py), AutoencoderTiny, decoders with SpatialNorm (MoVQ) or attention inside up-blocks;
those raise :class:`TilingError`.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vaeopt.engine.fold import shortcut_bias
from vaeopt.engine.image import Pass, is_plain_upsampler, kl_decoder, plan_passes, up_conv, walk
from vaeopt.engine.regions import (TilingError, conv_region, halo_region, is_plain_conv, pair, tile_geometry,
                                   tile_grid)
from vaeopt.engine.stats import OOM_ERRORS, KernelStats, Moments, affine_act
from vaeopt.engine.store import (Activation, PinAhead, RegionStore, fast_pinning, host_blocks, layout_of,
                                 pin_ahead_enabled, place)
from vaeopt.kernels import flat_layout
from vaeopt.stages import unhooked, upsample_conv
from vaeopt.tiling_memory import (decoder_weights_bytes, estimate_tiled_bytes, kernels_usable, storage_buffers,
                                  storage_bytes, use_bands)

__all__ = [
    "TilingError",
    "TiledDecoder",
    "tiled_decode",
    "estimate_tiled_bytes",
    "storage_bytes",
    "storage_buffers",
    "tile_from_pixels",
]

PLACEMENT_ENV = "VAEOPT_PLACEMENT"  # "halves": the earlier tile choice for a decode with some buffers on the host
_STATS_MAX_NUMEL = 2**31  # the stats kernels use int32 in-sample offsets: bigger tiles are reduced in row pieces


# ----------------------------------------------------------------------------------------------------------- plan


def _factor(vae: nn.Module) -> int:
    return plan_passes(vae)[-1].scale


def tile_from_pixels(vae: nn.Module, tile_px: int | Sequence[int]) -> tuple[int, int]:
    """Output-pixel tile side(s) -> latent-pixel tile (what :func:`tiled_decode` takes), rounded down to the VAE's
    spatial factor (8 for SD/SDXL/SD3/FLUX), at least 1 latent px."""
    f = _factor(vae)
    th, tw = pair(tile_px)
    return max(1, th // f), max(1, tw // f)


# ------------------------------------------------------------------------------------------------ module helpers


def _memory_format(dec: nn.Module) -> torch.memory_format:
    """channels_last when the decoder's convs were converted to NHWC (stages/channels_last.py): the buffers then use
    it too, so tiles reach cuDNN without relayouts."""
    w = getattr(getattr(dec, "conv_out", None), "weight", None)
    if isinstance(w, torch.Tensor) and w.ndim == 4 and w.is_contiguous(memory_format=torch.channels_last):
        if not w.is_contiguous():
            return torch.channels_last
    return torch.contiguous_format


def _act_mode(norm: nn.Module, nonlin: nn.Module) -> tuple[bool, Callable | None]:
    """How norm -> nonlinearity runs on the kernel path: (SiLU inside the apply kernel?, module to call after)."""
    fused = getattr(norm, "silu", False) is True  # FusedGroupNormSiLU (stages/fused_norms.py)
    if type(nonlin) is nn.Identity and unhooked(nonlin):
        return fused, None
    if type(nonlin) is nn.SiLU and unhooked(nonlin):
        return True, (None if not fused else (lambda t: F.silu(t, inplace=True)))
    return fused, nonlin


def _flat(t: torch.Tensor) -> bool:
    return flat_layout(t) is not None


def _tile_ladder(tile: tuple[int, int], smallest: tuple[int, int], step: int = 8) -> list[tuple[int, int]]:
    """`tile`, then tiles of the same aspect whose first side is `step` latent px smaller each time (on multiples of
    `step`), down to `smallest`; largest first."""
    th, tw = tile
    out = [tuple(tile)]
    s = (th - 1) // step * step
    while s > smallest[0]:
        out.append((s, max(1, round(tw * s / th))))
        s -= step
    if tuple(smallest) != out[-1]:
        out.append(tuple(smallest))
    return out










# ------------------------------------------------------------------------------------------------------ decoder


class TiledDecoder:
    """Exact layer-streamed tiled decoding of one diffusers AutoencoderKL.

    Args:
        vae: the AutoencoderKL (any dtype/device; eval mode). Its submodules may be swapped for optimized ones as
            long as convs stay stride-1 padding-preserving and norms expose num_groups/eps/weight/bias.
        tile: tile side in LATENT pixels (int or (h, w)); the output tile is ``tile * 8`` px for SD/SDXL/SD3/FLUX.
            At a layer that runs at ``s`` times the latent resolution the tile is ``tile * s`` px of that layer.
            With ``shape="bands"`` the tile is a full-width row band of the same area. Use
            :func:`tile_from_pixels` to convert from output pixels.
        storage: where the full-size intermediate activations live. ``None``: the compute device if they fit (in
            its free memory and ``vram_budget``) next to the working set of ``tile`` -- or of ``tile/2``, ``tile/4``
            (a smaller tile with device storage beats host transfers) -- else as many buffers as fit beside the
            working set stay on the compute device and the others go to the CPU (pinned if CUDA is available;
            :func:`vaeopt.engine.store.place`), at the largest tile from ``tile`` down to ``tile/4`` (8-px steps) that
            leaves the fewest bytes on the host (each is pinned in the first decode and crosses the bus in every one).
        progress: ``progress(done, total)`` after every tile of every pass (``total`` grows if tiles are split).
        min_tile: smallest latent tile the OOM fallback may shrink to.
        vram_budget: bytes the decode may use on a CUDA device (e.g. the planner's budget; weights included).
        kernels: use the Triton kernel path (None: when the kernels can run on the model's device and dtype).
        shape: "tiles", "bands" or "auto" (bands on the kernel path and on CUDA, else tiles).
        overlap: with CPU storage and CUDA compute, overlap host<->device copies with compute (copy streams,
            one-tile prefetch); False: synchronous copies on the compute stream.
        pin: with CPU storage and CUDA compute, page-lock the host buffers (True, the default: copies run at full
            bus speed and overlap compute) or not (False). Pageable buffers were far slower in a 4096² SDXL decode
            (45 s against 15 s, synchronous copies into freshly faulted pages: docs/experiments.md E54).
    """

    def __init__(
        self,
        vae: nn.Module,
        tile: int | Sequence[int] = 64,
        storage: torch.device | str | None = None,
        progress: Callable[[int, int], None] | None = None,
        min_tile: int = 2,
        vram_budget: int | None = None,
        kernels: bool | None = None,
        shape: str = "auto",
        overlap: bool = True,
        pin: bool = True,
    ):
        self.vae = vae
        self.pin = pin
        self.vram_budget = vram_budget
        self.dec = kl_decoder(vae)
        self.passes = plan_passes(vae)
        self.factor = self.passes[-1].scale
        self.tile = pair(tile)
        if min(self.tile) < 1:
            raise ValueError("tile must be >= 1 latent pixel")
        if shape not in ("auto", "bands", "tiles"):
            raise ValueError(f"shape must be 'auto', 'bands' or 'tiles', got {shape!r}")
        self.storage_arg = storage
        self.progress = progress
        self.min_tile = max(1, int(min_tile))
        self.kernels_arg = kernels
        self.shape_arg = shape
        self.overlap = overlap
        self._force_copy = False  # tests: exercise the remote-storage bookkeeping on one device
        self._device_store_bytes: int | None = None  # tests: place the buffers as if this much device memory were left
        self._pins: PinAhead | None = None
        self.info: dict = {}

    # -- public ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Raw (unscaled) latents (N, C, h, w) -> images (N, 3, h*f, w*f) in the model's dtype, on its device."""
        if z.ndim != 4:
            raise ValueError(f"expected latents of shape (N, C, h, w), got {tuple(z.shape)}")
        p = next(p for p in self.dec.parameters() if p.is_floating_point())
        self.device, self.dtype = p.device, p.dtype
        self.memory_format = _memory_format(self.dec)
        ok, why = kernels_usable(self.device, self.dtype)
        if self.kernels_arg and not ok:
            raise ValueError(f"kernels=True but the Triton kernels cannot run here: {why}")
        self.kernels = ok if self.kernels_arg is None else bool(self.kernels_arg)
        if self.kernels:
            from vaeopt.kernels.epilogue import bias_residual
            from vaeopt.kernels.group_norm_silu import group_norm_apply, group_norm_partials, group_norm_partials_shape

            self._k = dict(apply=group_norm_apply, partials=group_norm_partials, shape=group_norm_partials_shape,
                           epilogue=bias_residual)
        self.bands = use_bands(self.shape_arg, self.kernels, self.device)
        n, _, h, w = z.shape
        self.lat_hw = (h, w)
        self.storage, self.start_tile, self.placement = self._choose_storage((h, w), n)
        self.mover = RegionStore(self.device, self.storage, self.overlap, self._force_copy)
        # NHWC buffers whenever they are remote: a row band is then one contiguous block (one DMA per region)
        remote = self.mover.remote
        self.storage_format = torch.channels_last if (remote or self.memory_format is torch.channels_last) else (
            torch.contiguous_format)
        self._pins = None
        self.cur_tile = self.start_tile
        self.done = 0
        self.total = n * sum(len(tile_grid(h * ps.scale, w * ps.scale, *self._tile_px(ps.scale))) for ps in self.passes)
        self.info = {
            "tile": self.start_tile,
            "planned_tile": self.tile,
            "final_tile": self.start_tile,
            "shrinks": 0,
            "oom_events": [],
            "tiles": 0,
            "passes": len(self.passes),
            "storage": str(self.storage) if self.placement is None or not any(self.placement) else (
                f"{self.device}+{self.storage}" if not all(self.placement) else str(self.device)),
            "host_store_bytes": 0,
            "pinned": self.pin and self.storage.type == "cpu" and self.device.type == "cuda",
            "factor": self.factor,
            "kernels": self.kernels,
            "shape": "bands" if self.bands else "tiles",
            "overlap": self.mover.async_,
            "bias_folded": 0,
            "upsample_phase": 0,
            "bytes_h2d": 0,
            "bytes_d2h": 0,
            "pin_ahead": None,
        }
        f, c_out = self.factor, self.passes[-1].cout
        out = torch.empty(n, c_out, h * f, w * f, device=self.device, dtype=self.dtype,
                          memory_format=self.memory_format)
        self._pins = self._pin_ahead((h, w))
        try:
            for i in range(n):
                self._nbuf = 0  # the next buffer's index in the placement
                self._decode_one(z[i : i + 1], out[i : i + 1])
        finally:
            if self._pins is not None:
                self._pins.wait()  # (done long before: the host buffers waited for it)
        self.info["tiles"] = self.done
        self.info["final_tile"] = self.cur_tile
        self.info["bytes_h2d"] = self.mover.bytes_h2d
        self.info["bytes_d2h"] = self.mover.bytes_d2h
        self.info["prefetch_hits"] = self.mover.prefetch_hits
        if self._pins is not None:
            self.info["pin_ahead"] = self._pins.summary()
        self.info["bias_folded"] //= max(1, n)
        return out

    # -- setup ---------------------------------------------------------------------------------------------------

    def _choose_storage(self, latent_hw: tuple[int, int], batch: int = 1):
        """-> (storage device, tile, placement): placement None puts every buffer on the storage device, else
        placement[i] says whether buffer i (storage_buffers order) stays on the compute device instead."""
        if self._device_store_bytes is not None:
            return self.device, self.tile, place(storage_buffers(self.vae, latent_hw, self.dtype),
                                                 self._device_store_bytes)
        if self.storage_arg is not None:
            st = torch.device(self.storage_arg)
            if st.type == self.device.type and st.index is None:
                st = self.device
            return st, self.tile, None
        if self.device.type != "cuda":
            return self.device, self.tile, None
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        weights = decoder_weights_bytes(self.vae)  # already resident: counts against the budget, not free memory
        cands, t = [self.tile], self.tile
        for _ in range(2):  # a 2-4x smaller tile with device storage is still far faster than PCIe traffic
            t = (t[0] // 2, t[1] // 2)
            if min(t) < max(self.min_tile, 8):
                break
            cands.append(t)
        for t in cands:
            need = estimate_tiled_bytes(self.vae, latent_hw, t, self.dtype, storage_on_device=True, batch=batch,
                                        include_weights=False, kernels=self.kernels,
                                        shape="bands" if self.bands else "tiles", device=self.device)
            if need <= 0.9 * free and (self.vram_budget is None or need + weights <= self.vram_budget):
                return self.device, t, None
        # not all of them: the buffers that fit beside a tile's working set (host storage's, the larger) stay on the
        # device, the others go to the host. Every host byte is paid for twice: page-locked in the first decode of
        # the process (about 1 s per 8 GiB) and carried over the bus in every decode. So the tile is the largest one
        # that leaves the fewest bytes there, out of every 8-px step from the planned tile down to a quarter of it
        # (the tiled passes' working set only: the untiled latent-resolution part has come and gone before the
        # first full-size buffer exists). PLACEMENT_ENV=halves: the planned tile, its half and its quarter, each
        # with the untiled part counted (the earlier rule, for A/B runs).
        room = 0.9 * free if self.vram_budget is None else min(0.9 * free, self.vram_budget - weights)
        bufs = storage_buffers(self.vae, latent_hw, self.dtype)
        halves = os.environ.get(PLACEMENT_ENV, "").strip().lower() == "halves"

        def at(t):  # -> (host bytes, tile, placement)
            need = estimate_tiled_bytes(self.vae, latent_hw, t, self.dtype, batch=batch, include_weights=False,
                                        untiled=halves, kernels=self.kernels,
                                        shape="bands" if self.bands else "tiles", device=self.device)
            placement = place(bufs, room - need)
            return sum(b for (b, _, _), dev in zip(bufs, placement) if not dev), t, placement

        if halves:
            best = None
            for t in cands:
                r = at(t)
                if best is None or r[0] < best[0]:
                    best = r
            return torch.device("cpu"), best[1], best[2]
        # a smaller tile leaves at least as much room, so the fewest host bytes are the smallest tile's: bisect the
        # ladder for the largest tile that leaves as few (a handful of estimates per decode, not one per step).
        # `place` keeps the costliest buffers first, which for an arbitrary buffer list can leave more bytes on the
        # host with more room; the KL decoder's schedule does not (tests/test_store_placement.py checks this search
        # against a scan of every step over shapes, tiles, budgets and both kernel paths)
        ladder = _tile_ladder(self.tile, cands[-1])
        best = at(ladder[-1])
        lo, hi = 0, len(ladder) - 1  # ladder[hi] leaves best[0]; the answer lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            r = at(ladder[mid])
            if r[0] <= best[0]:
                best, hi = r, mid
            else:
                lo = mid + 1
        return torch.device("cpu"), best[1], best[2]

    def _pin_ahead(self, latent_hw: tuple[int, int]) -> PinAhead | None:
        """Page-lock the blocks of this decode's host buffers on a thread (engine.store.PinAhead) when some buffers
        go to pinned host memory; None otherwise, or with VAEOPT_PIN_AHEAD=off."""
        if not (self.pin and self.mover.remote and self.storage.type == "cpu" and self.device.type == "cuda"
                and pin_ahead_enabled()):
            return None
        bufs = storage_buffers(self.vae, latent_hw, self.dtype)
        on_host = [True] * len(bufs) if self.placement is None else [not d for d in self.placement]
        blocks = host_blocks(bufs, on_host)
        return PinAhead(blocks, self.device) if blocks else None

    def _where(self) -> bool:
        """Whether the next full-size buffer lives on the compute device (else on the storage device)."""
        i, self._nbuf = self._nbuf, self._nbuf + 1
        if self.placement is not None:
            return i < len(self.placement) and self.placement[i]
        return not self.mover.remote

    def _alloc(self, c: int, h: int, w: int, local: bool | None = None) -> torch.Tensor:
        local = self._where() if local is None else local
        where = self.device if local else self.storage
        shape = (1, h, w, c) if self.storage_format is torch.channels_last else (1, c, h, w)
        try:
            if not local and self.pin and where.type == "cpu" and self.device.type == "cuda":
                if self._pins is not None:
                    self._pins.wait()  # its blocks are in torch's host cache now
                with fast_pinning():
                    t = torch.empty(shape, dtype=self.dtype, device=where, pin_memory=True)
            else:
                t = torch.empty(shape, dtype=self.dtype, device=where)
        except OOM_ERRORS:
            if not local or self.storage == self.device:
                raise
            torch.cuda.empty_cache()  # the device could not hold it after all (another user, fragmentation):
            if "+" not in self.info["storage"]:
                self.info["storage"] = f"{self.device}+{self.storage}"
            return self._alloc(c, h, w, local=False)  # this buffer goes to the host
        if self.storage_format is torch.channels_last:
            t = t.permute(0, 3, 1, 2)
        if not local:
            self.info["host_store_bytes"] += t.numel() * t.element_size()
            if self._force_copy:
                self.mover.mark_remote(t)
        return t

    def _new_stats(self, c: int, norm: nn.Module | None) -> Moments | KernelStats | None:
        if self.kernels:
            return KernelStats(c, int(norm.num_groups)) if norm is not None else None
        return Moments(c, self.device)

    def _consumer(self, i: int) -> nn.Module | None:
        """The norm that pass i applies to its main input (the output of pass i-1, or of the mid-block)."""
        if i >= len(self.passes):
            return None
        ps = self.passes[i]
        if ps.kind == "res1":
            return ps.module.norm1
        if ps.kind == "res2":
            return ps.module.norm2
        if ps.kind == "head":
            return self.dec.conv_norm_out
        return None

    def _hw(self, ps: Pass) -> tuple[int, int]:
        return self.lat_hw[0] * ps.scale, self.lat_hw[1] * ps.scale

    def _tile_px(self, scale: int) -> tuple[int, int]:
        return tile_geometry(self.lat_hw, self.cur_tile, scale, self.bands)

    # -- per-tile building blocks ----------------------------------------------------------------------------------

    @staticmethod
    def _stat_pieces(t: torch.Tensor) -> list[torch.Tensor]:
        """t itself, or row slices of it each below the stats kernels' int32 limit (their partials concatenate)."""
        if t[0].numel() < _STATS_MAX_NUMEL:
            return [t]
        rows = max(1, (_STATS_MAX_NUMEL - 1) // (t.shape[1] * t.shape[3]))
        return [t[:, :, r : r + rows] for r in range(0, t.shape[2], rows)]

    def _stats_buffers(self, view: torch.Tensor, norm: nn.Module) -> list[torch.Tensor]:
        """Preallocated partials buffers for `_stats(view, ..., out=)`."""
        return [torch.empty(self._k["shape"](p, int(norm.num_groups)), device=self.device, dtype=torch.float32)
                for p in self._stat_pieces(view)]

    def _stats(self, o: torch.Tensor, bias: torch.Tensor | None, norm: nn.Module | None, out=None):
        """Tile statistics of o (+ pending bias) for the norm that will read it (None: nobody will): kernel path, a
        list of partials (one per row piece); torch path, per-channel moments."""
        if norm is None:
            return None
        if not self.kernels:
            return Moments.of_tile(o)
        if not _flat(o):
            o = o.contiguous(memory_format=layout_of(o))
        pieces = self._stat_pieces(o)
        outs = out if out is not None else [None] * len(pieces)
        return [self._k["partials"](p, int(norm.num_groups), x_bias=bias, out=b) for p, b in zip(pieces, outs)]

    def _to_storage(self, x: torch.Tensor, norm: nn.Module | None) -> Activation:
        part = self._stats(x, None, norm)
        x = x.contiguous(memory_format=self.storage_format)
        if self._where():
            # an allocated buffer's strides (x's may differ in size-1 dims): a region is then the same view whichever
            # device holds the buffer, and the decode bitwise the same (CPU kernels vectorize by the strides)
            c, h, w = x.shape[1:]
            cl = self.storage_format is torch.channels_last
            t = x.as_strided(x.shape, (c * h * w, 1, w * c, c) if cl else (c * h * w, h * w, w, 1))
        else:
            t = self._alloc(*x.shape[1:], local=False)
            self.mover.put(t, 0, x.shape[2], 0, x.shape[3], x)
        a = Activation(t, self._new_stats(x.shape[1], norm))
        a.stats.add(part) if a.stats is not None else None
        return a

    def _read(self, act: Activation, y0: int, y1: int, x0: int, x1: int, hy: int, hx: int | None = None):
        """Tile [y0:y1, x0:x1] of `act` plus up to (hy, hx) px of context, clamped to the image, on the compute
        device (a view when storage is the compute device). Returns (region, oy, ox): the tile's offset in it."""
        hx = hy if hx is None else hx
        ya, yb, xa, xb = halo_region(act.hw, y0, y1, x0, x1, hy, hx)
        return self.mover.get(act.t, ya, yb, xa, xb), y0 - ya, x0 - xa

    def _norm_act(self, x: torch.Tensor, act: Activation, norm: nn.Module, nonlin: nn.Module) -> torch.Tensor:
        """Torch path: GroupNorm with the statistics of the whole activation, then the model's nonlinearity."""
        return affine_act(x, *act.stats.affine(norm, self.device), norm, nonlin)

    def _folds(self, conv: nn.Module, norm: nn.Module, nonlin: nn.Module) -> bool:
        """Kernel path, norm -> act -> conv with the conv's bias left pending (and padding done by the apply)."""
        return self.kernels and is_plain_conv(conv) and _act_mode(norm, nonlin)[1] is None

    def _halo(self, conv: nn.Module, norm: nn.Module, nonlin: nn.Module) -> tuple[int, int]:
        if self._folds(conv, norm, nonlin):
            return conv.kernel_size[0] // 2, conv.kernel_size[1] // 2
        return 1, 1

    def _norm_conv(self, src: Activation, norm, nonlin, conv, y0, y1, x0, x1, drop=None):
        """conv(drop(act(norm(src)))) on tile [y0:y1, x0:x1] -> (output tile, bias still to add or None)."""
        h, w = y1 - y0, x1 - x0
        hy, hx = self._halo(conv, norm, nonlin)
        t, oy, ox = self._read(src, y0, y1, x0, x1, hy, hx)
        if not self.kernels:
            a = self._norm_act(t, src, norm, nonlin)
            del t
            if drop is not None:
                a = drop(a)
            return conv_region(conv, a, oy, ox, h, w), None
        mean, scale = src.stats.affine(norm)
        silu, post = _act_mode(norm, nonlin)
        if self._folds(conv, norm, nonlin):
            ya, xa = y0 - oy, x0 - ox
            pad = (hy - oy, y1 + hy - (ya + t.shape[-2]), hx - ox, x1 + hx - (xa + t.shape[-1]))
            a = self._k["apply"](t, mean, scale, norm.bias, silu, x_bias=src.bias, pad=pad)  # zero ring = padding
            del t
            if drop is not None:
                a = drop(a)
            return F.conv2d(a, conv.weight, None, 1, 0, 1, conv.groups), conv.bias
        a = self._k["apply"](t, mean, scale, norm.bias, silu, x_bias=src.bias)
        del t
        if post is not None:
            a = post(a)
        if drop is not None:
            a = drop(a)
        o = conv_region(conv, a, oy, ox, h, w)
        return (o if _flat(o) else o.contiguous(memory_format=layout_of(o))), None

    # -- the tile loop -----------------------------------------------------------------------------------------------

    def _run(self, ps: Pass, hw: tuple[int, int], fn: Callable[[int, int, int, int], None],
             reads: Callable[[int, int, int, int], list] | None = None) -> None:
        """Run `fn` on every tile of a pass; on OOM halve the tile and resume without redoing finished tiles.
        `reads(tile)` lists the regions a tile reads ((tensor, ya, yb, xa, xb)): with remote storage the current
        tile's and the next tile's regions are requested before the tile runs (the copies overlap its compute)."""
        self.mover.begin_pass()
        queue = deque(tile_grid(*hw, *self._tile_px(ps.scale)))
        while queue:
            y0, y1, x0, x1 = queue.popleft()
            th, tw = self._tile_px(ps.scale)
            if y1 - y0 > th or x1 - x0 > tw:  # tile shrank since this one was queued: split it
                sub = [
                    (y0 + a, min(y0 + b, y1), x0 + c, min(x0 + d, x1))
                    for a, b, c, d in tile_grid(y1 - y0, x1 - x0, th, tw)
                ]
                self.total += len(sub) - 1
                queue.extendleft(reversed(sub))
                continue
            oom = False
            try:
                if reads is not None and self.mover.remote:
                    for r in reads(y0, y1, x0, x1):
                        self.mover.prefetch(*r)
                    if queue:
                        ny0, ny1, nx0, nx1 = queue[0]
                        if ny1 - ny0 <= th and nx1 - nx0 <= tw:
                            for r in reads(ny0, ny1, nx0, nx1):
                                self.mover.prefetch(*r)
                fn(y0, y1, x0, x1)
            except OOM_ERRORS:
                if max(self.cur_tile) <= self.min_tile:
                    raise
                oom = True  # handled below, once the traceback (and the tile's tensors it holds) is released
            if oom:
                self.mover.drop()
                self.cur_tile = tuple(max(self.min_tile, t // 2) for t in self.cur_tile)
                self.info["shrinks"] += 1
                self.info["oom_events"].append((ps.name, (y0, y1, x0, x1), self.cur_tile))
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                queue.appendleft((y0, y1, x0, x1))
                continue
            self.done += 1
            if self.progress is not None:
                self.progress(self.done, self.total)

    def _decode_one(self, z: torch.Tensor, out: torch.Tensor) -> None:
        # ---- tiled passes; each returns its output activation (the head writes into `out`). The stored mid-block
        # output goes straight into the walk, so that no reference here keeps it alive once its pass has replaced it.
        self._out = out
        walk(self.passes, self, self._stored_mid(z))
        self._out = None
        self.mover.finish()

    def _stored_mid(self, z: torch.Tensor) -> Activation:
        """Untiled at latent resolution: post_quant_conv, conv_in, mid-block (incl. global attention), stored."""
        x = z.to(self.device, self.dtype)
        pqc = getattr(self.vae, "post_quant_conv", None)
        if pqc is not None:
            x = pqc(x)
        x = self.dec.mid_block(self.dec.conv_in(x), None)
        return self._to_storage(x, self._consumer(0))

    # -- passes ------------------------------------------------------------------------------------------------------

    def _reads(self, act: Activation, hy: int, hx: int, extra: Activation | None = None):
        """The `reads` callback of a pass that reads `act` with a (hy, hx) halo (+ `extra` at the tile itself)."""

        def reads(y0, y1, x0, x1):
            r = [(act.t, *halo_region(act.hw, y0, y1, x0, x1, hy, hx))]
            if extra is not None:
                r.append((extra.t, y0, y1, x0, x1))
            return r

        return reads

    @staticmethod
    def _release(act: Activation) -> None:
        """Let a pass's input go once the pass has read it: the walk drops its own reference to the activation when
        the pass returns, but a caller may still hold the object (Python keeps a frame's arguments alive until it
        returns while torch's compiler hooks frames, e.g. after a torch.compile that failed in the same process),
        and a full-size buffer kept there is memory the storage plan counted as free."""
        act.t = None

    def res1(self, i: int, ps: Pass, src: Activation) -> Activation:
        """h1 = conv1(act(norm1(x))) -- x is kept (it is the residual)."""
        hw = self._hw(ps)
        blk = ps.module
        norm_next = self._consumer(i + 1)
        fold = self._folds(blk.conv1, blk.norm1, blk.nonlinearity) and blk.conv1.bias is not None
        dst = Activation(self._alloc(ps.cout, *hw), self._new_stats(ps.cout, norm_next),
                   blk.conv1.bias.detach() if fold else None)
        self.info["bias_folded"] += int(fold)

        def fn(y0, y1, x0, x1):
            o, ob = self._norm_conv(src, blk.norm1, blk.nonlinearity, blk.conv1, y0, y1, x0, x1)
            part = self._stats(o, ob, norm_next)
            self.mover.put(dst.t, y0, y1, x0, x1, o)
            if dst.stats is not None:
                dst.stats.add(part)

        self._run(ps, hw, fn, self._reads(src, *self._halo(blk.conv1, blk.norm1, blk.nonlinearity)))
        return dst

    def res2(self, i: int, ps: Pass, res: Activation, src: Activation) -> Activation:
        """out = (shortcut(x) + conv2(dropout(act(norm2(h1))))) / output_scale_factor."""
        hw = self._hw(ps)
        blk = ps.module
        sc_conv = getattr(blk, "conv_shortcut", None)
        drop = getattr(blk, "dropout", None)
        osf = float(getattr(blk, "output_scale_factor", 1.0))
        norm_next = self._consumer(i + 1)
        k = self.kernels
        res_t, res_bias = res.t, res.bias
        # The block output may overwrite its input in place: a tile reads the residual only at its own pixels.
        inplace = sc_conv is None and ps.cout == ps.sc_cin
        dst = Activation(res_t if inplace else self._alloc(ps.cout, *hw), self._new_stats(ps.cout, norm_next))
        res.t = None  # (see _release)
        del res
        sc_plain = (k and sc_conv is not None and is_plain_conv(sc_conv) and tuple(sc_conv.kernel_size) == (1, 1)
                    and sc_conv.groups == 1)
        sc_bias = shortcut_bias(sc_conv, res_bias) if sc_plain else None  # fp32 where a bias was folded in
        sc_bias = sc_bias.detach().float() if sc_bias is not None else None
        if k:
            self.info["bias_folded"] += int(self._folds(blk.conv2, blk.norm2, blk.nonlinearity)
                                            and blk.conv2.bias is not None) + int(sc_plain and sc_conv.bias is not None)

        def fn(y0, y1, x0, x1):
            o, ob = self._norm_conv(src, blk.norm2, blk.nonlinearity, blk.conv2, y0, y1, x0, x1, drop=drop)
            r = self.mover.get(res_t, y0, y1, x0, x1)
            if not k:  # torch path
                if sc_conv is not None:
                    r = conv_region(sc_conv, r, 0, 0, y1 - y0, x1 - x0)
                o = r + o
                del r
                if osf != 1.0:
                    o = o / osf
                st = self._stats(o, None, norm_next)
                self.mover.put(dst.t, y0, y1, x0, x1, o)
                dst.stats.add(st)
                return
            rb = res_bias
            if sc_plain:
                r, rb = F.conv2d(r, sc_conv.weight, None), sc_bias
            elif sc_conv is not None:
                if res_bias is not None:
                    r = r + res_bias.to(r.dtype).view(1, -1, 1, 1)
                r, rb = conv_region(sc_conv, r, 0, 0, y1 - y0, x1 - x0), None
            view = dst.t[:, :, y0:y1, x0:x1]
            if not self.mover.is_remote(dst.t) and _flat(view):
                # straight into the buffer (in place over the residual when there is no shortcut). Every allocation
                # of the tile comes first, so an OOM can never follow a partial overwrite of the residual.
                pbuf = self._stats_buffers(view, norm_next) if norm_next is not None else None
                self._k["epilogue"](o, ob, r, osf, residual_bias=rb, out=view)
                del o, r
                dst.stats.add(self._stats(view, None, norm_next, out=pbuf)) if norm_next is not None else None
                return
            y = self._k["epilogue"](o, ob, r, osf, residual_bias=rb)
            del o, r
            part = self._stats(y, None, norm_next)
            self.mover.put(dst.t, y0, y1, x0, x1, y)
            if dst.stats is not None:
                dst.stats.add(part)

        self._run(ps, hw, fn, self._reads(src, *self._halo(blk.conv2, blk.norm2, blk.nonlinearity),
                                          extra=Activation(res_t, None)))
        self._release(src)
        return dst

    def up(self, i: int, ps: Pass, src: Activation) -> Activation:
        """2x nearest upsampling + 3x3 conv, computed per output tile from a source tile with a 1-px halo."""
        hw = self._hw(ps)
        up = ps.module
        plain = is_plain_upsampler(up)
        conv = up_conv(up) if plain else None
        k = self.kernels
        fold = bool(k and plain and is_plain_conv(conv) and tuple(conv.kernel_size) == (3, 3))
        phase = fold and upsample_conv.applies(conv, self.dtype, self.device)  # the tiles compute in self.dtype
        norm_next = self._consumer(i + 1)
        dst = Activation(self._alloc(ps.cout, *hw), self._new_stats(ps.cout, norm_next),
                   conv.bias.detach() if fold and conv.bias is not None else None)
        self.info["bias_folded"] += int(fold and conv.bias is not None)
        H, W = hw

        def fn(y0, y1, x0, x1):
            # output tile [y0, y1) at 2x <- source rows [y0/2 - 1, y1/2 + 1), clamped to the image
            t, sy, sx = self._read(src, y0 // 2, (y1 + 1) // 2, x0 // 2, (x1 + 1) // 2, 1)
            uy0, ux0 = 2 * (y0 // 2 - sy), 2 * (x0 // 2 - sx)  # upsampled coords of t's first pixel
            h, w = y1 - y0, x1 - x0
            if phase:  # 2x2 phase convs on t itself (stages/upsample_conv): rows of the result at distance >= 1
                # from a non-border edge of t's upsampled extent are exact, as for any padding-preserving operator
                if src.bias is not None:
                    t = self._k["epilogue"](t if _flat(t) else t.contiguous(memory_format=layout_of(t)), src.bias)
                u = upsample_conv.run(conv, t, bias=False)
                del t
                self.info["upsample_phase"] += 1
                o, ob = u[:, :, y0 - uy0 : y1 - uy0, x0 - ux0 : x1 - ux0], conv.bias
            elif plain:
                if k:  # one kernel: (t + pending bias) written 2x nearest-upsampled, in t's layout
                    if not _flat(t):
                        t = t.contiguous(memory_format=layout_of(t))
                    u = self._k["epilogue"](t, src.bias, upsample2x=True)
                else:
                    u = F.interpolate(t, scale_factor=2.0, mode="nearest")
                del t
                # keep the upsampled rows [y0 - 1, y1 + 1) that exist in the image
                ya, yb, xa, xb = max(y0 - 1, 0), min(y1 + 1, H), max(x0 - 1, 0), min(x1 + 1, W)
                u = u[:, :, ya - uy0 : yb - uy0, xa - ux0 : xb - ux0]
                if fold:
                    ph = 0 if (ya == y0 - 1 and yb == y1 + 1) else 1  # pad only where the image ends
                    pw = 0 if (xa == x0 - 1 and xb == x1 + 1) else 1
                    o = F.conv2d(u, conv.weight, None, 1, (ph, pw), 1, conv.groups)
                    oy, ox = y0 - ya - 1 + ph, x0 - xa - 1 + pw
                    if o.shape[-2:] != (h, w):
                        o = o[:, :, oy : oy + h, ox : ox + w]  # rows only for bands: still one dense block
                    ob = conv.bias
                else:
                    o, ob = conv_region(conv, u, y0 - ya, x0 - xa, h, w), None
            else:
                if src.bias is not None:  # (a pending bias reaches an upsampler only in unusual decoders)
                    t = t + src.bias.to(t.dtype).view(1, -1, 1, 1)
                u = up(t)
                if u.shape[-2:] != (2 * t.shape[-2], 2 * t.shape[-1]):
                    raise TilingError(f"{ps.name}: upsampler is not a 2x size-preserving module")
                del t
                # u's rows at distance >= 1 from a non-border edge are exact
                o, ob = u[:, :, y0 - uy0 : y1 - uy0, x0 - ux0 : x1 - ux0], None
            del u
            part = self._stats(o, ob, norm_next)
            self.mover.put(dst.t, y0, y1, x0, x1, o)
            if dst.stats is not None:
                dst.stats.add(part)

        def reads(y0, y1, x0, x1):
            return [(src.t, *halo_region(src.hw, y0 // 2, (y1 + 1) // 2, x0 // 2, (x1 + 1) // 2, 1, 1))]

        self._run(ps, hw, fn, reads)
        self._release(src)
        return dst

    def head(self, i: int, ps: Pass, src: Activation) -> None:
        """conv_norm_out -> conv_act -> conv_out, written straight into the output image."""
        hw = self._hw(ps)
        out = self._out
        dec = self.dec
        if self._folds(dec.conv_out, dec.conv_norm_out, dec.conv_act) and dec.conv_out.bias is not None:
            self.info["bias_folded"] += 1

        def fn(y0, y1, x0, x1):
            o, ob = self._norm_conv(src, dec.conv_norm_out, dec.conv_act, dec.conv_out, y0, y1, x0, x1)
            view = out[:, :, y0:y1, x0:x1]
            if ob is not None:
                self._k["epilogue"](o, ob, out=view)  # conv_out's bias added on the way into the image
            else:
                view.copy_(o)

        self._run(ps, hw, fn, self._reads(src, *self._halo(dec.conv_out, dec.conv_norm_out, dec.conv_act)))


def tiled_decode(
    vae: nn.Module,
    z_raw: torch.Tensor,
    tile: int | Sequence[int] = 64,
    storage: torch.device | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    return_info: bool = False,
    min_tile: int = 2,
    vram_budget: int | None = None,
    kernels: bool | None = None,
    shape: str = "auto",
    overlap: bool = True,
    pin: bool = True,
):
    """Decode raw (unscaled) latents ``z_raw`` (N, C, h, w) with exact layer-streamed tiling.

    ``tile`` is the tile side in LATENT pixels (int or (h, w)); an output tile is ``tile * factor`` px (factor 8
    for SD/SDXL/SD3/FLUX), so tiles are always aligned to the VAE's factor. Sizes need not be multiples of the tile.
    Returns images (N, 3, h*factor, w*factor) in [-1, 1] (model dtype, model device, model memory format); with
    ``return_info=True`` returns ``(images, info)``: ``tile`` (the tile used: the planned one or, for device storage
    under a budget, a halved one), ``planned_tile``, ``final_tile``, ``shrinks`` (OOM tile halvings),
    ``oom_events``, ``tiles``, ``passes``, ``storage``, ``factor``, ``kernels``, ``shape``, ``overlap``,
    ``bias_folded`` (conv biases folded per decode), ``bytes_h2d`` / ``bytes_d2h`` (host<->device tile traffic),
    ``prefetch_hits``. ``storage``, ``progress``, ``min_tile``, ``vram_budget``, ``kernels``, ``shape``,
    ``overlap``, ``pin``: see :class:`TiledDecoder`.
    """
    td = TiledDecoder(vae, tile=tile, storage=storage, progress=progress, min_tile=min_tile, vram_budget=vram_budget,
                      kernels=kernels, shape=shape, overlap=overlap, pin=pin)
    img = td.decode(z_raw)
    return (img, td.info) if return_info else img
