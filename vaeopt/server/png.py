"""Lossless PNG encoding fast enough to sit behind a ~20 ms GPU decode.

Pillow's encoder tries every row filter on every row and deflates on one thread (0.17 to 0.46 s for a 1024x1024 RGB
image on one core). Here every row gets the Up filter (one vectorized subtraction), and the filtered bytes are
deflated in bands on several threads with zlib's run-length strategy, as pigz does: each band a raw deflate stream
flushed to a byte boundary, joined into one zlib stream. Any PNG reader reads it; the pixels are the input's.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
import zlib

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type (grey, grey+alpha, RGB, RGBA)
BAND_BYTES = 256 * 1024  # filtered bytes per deflate band: smaller bands cost ratio, larger ones parallelism
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _bands_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for the bands alone (zlib releases the GIL). Never the caller's pool: a caller waiting on its own
    pool's threads could wait forever."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)),
                                                          thread_name_prefix="vaeopt-png")
        return _pool


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _deflate(data: memoryview, level: int, final: bool) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -15, 9, zlib.Z_RLE)
    return c.compress(data) + c.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)


def encode(image: np.ndarray, level: int = 1, threads: bool = True) -> bytes:
    """(H, W, C) or (H, W) uint8 -> PNG file bytes (8 bits per channel, C = 1..4)."""
    a = np.ascontiguousarray(image)
    if a.dtype != np.uint8 or a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in _COLOR_TYPES):
        raise ValueError(f"expected (H, W[, 1-4]) uint8, got {a.shape} {a.dtype}")
    h, w = a.shape[:2]
    c = 1 if a.ndim == 2 else a.shape[2]
    rows = a.reshape(h, w * c)
    filtered = np.empty((h, w * c + 1), np.uint8)
    filtered[:, 0] = 2  # Up: each byte minus the one above (the row above the first is zeros)
    filtered[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])  # (uint8 wraps modulo 256, as PNG's filter does)
    data = memoryview(filtered.reshape(-1))
    n = max(1, min(64, len(data) // BAND_BYTES))
    step = -(-h // n) * (w * c + 1)  # whole rows per band
    parts = [data[i:i + step] for i in range(0, len(data), step)]
    if len(parts) > 1 and threads:
        deflated = list(_bands_pool().map(_deflate, parts, [level] * len(parts),
                                          [i == len(parts) - 1 for i in range(len(parts))]))
    else:
        deflated = [_deflate(p, level, i == len(parts) - 1) for i, p in enumerate(parts)]
    stream = b"\x78\x01" + b"".join(deflated) + struct.pack(">I", zlib.adler32(data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, _COLOR_TYPES[c], 0, 0, 0)
    return _SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", stream) + _chunk(b"IEND", b"")
