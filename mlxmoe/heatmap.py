"""A layers x experts heatmap as a PNG, encoded with zlib (no imaging library)."""

import struct
import zlib

import numpy as np

from .files import write_atomic


def write_heatmap_png(path, matrix, scale=None):
    """A layers x experts heatmap (dark = cold, yellow = hot), each layer on its own
    scale; one cell is `scale` pixels (default: about 768 pixels wide)."""
    m = np.asarray(matrix, dtype=np.float64)
    scale = scale or max(2, min(24, 768 // m.shape[1]))
    rows_max = m.max(axis=1, keepdims=True)
    v = np.divide(m, rows_max, out=np.zeros_like(m), where=rows_max > 0)  # each layer on its own scale
    stops = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)
    pos = v * (len(stops) - 1)
    lo = np.clip(pos.astype(int), 0, len(stops) - 2)
    frac = (pos - lo)[..., None]
    rgb = (stops[lo] * (1 - frac) + stops[lo + 1] * frac).astype(np.uint8)
    rgb = rgb.repeat(scale, axis=0).repeat(scale, axis=1)
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    write_atomic(path, png)
