"""Charts as PNG files with no imaging library: a profile's layers x experts heatmap and
its predicted hit rate against cache size, drawn on a numpy canvas with a 5x7 bitmap font
and encoded with zlib."""

import struct
import zlib

import numpy as np

from ..storage.files import write_atomic

# 5x7 glyphs, one byte per column (bit 0 the top row), after the classic glcdfont
GLYPHS = dict(zip(
    " %'()+,-./0123456789:=ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz",
    """0000000000 2313086462 0005030000 001c224100 0041221c00 08083e0808 0050300000 0808080808 0060600000
    2010080402 3e5149453e 00427f4000 4261514946 2141454b31 1814127f10 2745454539 3c4a494930 0171090503
    3649494936 064949291e 0036360000 1414141414 7e1111117e 7f49494936 3e41414122 7f4141221c 7f49494941
    7f09090901 3e4149497a 7f0808087f 00417f4100 2040413f01 7f08142241 7f40404040 7f021c027f 7f0408107f
    3e4141413e 7f09090906 3e4151215e 7f09192946 4649494931 01017f0101 3f4040403f 1f2040201f 3f4038403f
    6314081463 0708700807 6151494543 4040404040 2054545478 7f48444438 3844444420 384444487f 3854545418
    087e090102 0c5252523e 7f08040478 00447d4000 2040443d00 7f10284400 00417f4000 7c04180478 7c08040478
    3844444438 7c14141408 081414187c 7c08040408 4854545420 043f444020 3c4040207c 1c2040201c 3c4030403c
    4428102844 0c5050503c 4464544c44""".split()))
VIRIDIS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (140, 86, 75),
          (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
INK, GRID = (0, 0, 0), (220, 220, 220)


def text_mask(text):
    """`text` as a boolean array 7 pixels high, 6 per character (one without a glyph blank)."""
    cols = []
    for ch in text:
        code = GLYPHS.get(ch, GLYPHS[" "])
        cols += [int(code[i:i + 2], 16) for i in range(0, 10, 2)] + [0]
    return (np.array(cols or [0], dtype=np.uint8)[None, :] >> np.arange(7)[:, None] & 1).astype(bool)


class Canvas:
    """A white RGB image to draw text, rectangles and lines on, saved as a PNG."""

    def __init__(self, width, height):
        self.img = np.full((height, width, 3), 255, dtype=np.uint8)

    def text(self, x, y, text, color=INK, anchor="left", vertical=False):
        """`text` with its top left at (x, y); anchor "center" or "right" moves it left by
        half or all its width; `vertical` turns it to read upwards."""
        m = text_mask(text)
        if vertical:
            m = np.rot90(m)
        h, w = m.shape
        if vertical:
            y -= {"left": h, "center": h // 2, "right": 0}[anchor]
        else:
            x -= {"left": 0, "center": w // 2, "right": w}[anchor]
        x, y = max(0, x), max(0, y)
        region = self.img[y:y + h, x:x + w]
        region[m[:region.shape[0], :region.shape[1]]] = color

    def rect(self, x0, y0, x1, y1, color):
        self.img[max(0, y0):y1, max(0, x0):x1] = color

    def line(self, x0, y0, x1, y1, color, width=2, dash=0):
        """A straight line `width` pixels thick (`dash`: pixels on, then off)."""
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i, t in enumerate(np.linspace(0.0, 1.0, n)):
            if dash and (i // dash) % 2:
                continue
            x, y = int(round(x0 + (x1 - x0) * t)), int(round(y0 + (y1 - y0) * t))
            self.rect(x - width // 2, y - width // 2, x - width // 2 + width, y - width // 2 + width, color)

    def png(self):
        h, w, _ = self.img.shape
        raw = b"".join(b"\x00" + self.img[y].tobytes() for y in range(h))

        def chunk(tag, data):
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def colormap(v):
    """Values in [0, 1] as viridis-like RGB (dark = 0, yellow = 1)."""
    pos = np.clip(v, 0, 1) * (len(VIRIDIS) - 1)
    lo = np.clip(pos.astype(int), 0, len(VIRIDIS) - 2)
    frac = (pos - lo)[..., None]
    return (VIRIDIS[lo] * (1 - frac) + VIRIDIS[lo + 1] * frac).astype(np.uint8)


def tick_step(count, pixels_each, label_pixels):
    """Every how many cells a label fits (1, 2, 5, 10, 20, 50...)."""
    for step in (1, 2, 4, 5, 8, 10, 16, 20, 32, 50, 64, 100, 128, 200, 256, 500, 1000):
        if step * pixels_each >= label_pixels or step >= count:
            return step
    return count


def write_heatmap_png(path, matrix, title="activations per token, by layer and expert"):
    """A layers x experts heatmap of `matrix` (a profile's rates: activations per token) on
    one colour scale from 0 to its largest value, with layer and expert axes, a title and
    the scale beside it."""
    m = np.asarray(matrix, dtype=np.float64)
    layers, experts = m.shape
    cw, ch = max(2, min(24, 768 // experts)), max(2, min(24, 480 // layers))
    left, top, bottom, right = 48, 28, 36, 96
    width, height = left + experts * cw + right, top + max(layers * ch, 80) + bottom
    c = Canvas(max(width, 6 * len(title) + 16), height)
    top_value = float(m.max()) if m.size and m.max() > 0 else 1.0
    rgb = colormap(m / top_value).repeat(ch, axis=0).repeat(cw, axis=1)
    c.img[top:top + layers * ch, left:left + experts * cw] = rgb
    c.text(8, 8, title)
    xs = tick_step(experts, cw, 6 * len(str(experts)) + 6)
    for e in range(0, experts, xs):
        x = left + e * cw + cw // 2
        c.rect(x, top + layers * ch, x + 1, top + layers * ch + 3, INK)
        c.text(x, top + layers * ch + 5, str(e), anchor="center")
    c.text(left + experts * cw // 2, height - 11, "expert", anchor="center")
    ys = tick_step(layers, ch, 9)
    for l in range(0, layers, ys):
        y = top + l * ch + ch // 2
        c.rect(left - 3, y, left, y + 1, INK)
        c.text(left - 5, y - 3, str(l), anchor="right")
    c.text(6, top + layers * ch // 2, "layer", anchor="center", vertical=True)
    # the colour scale: 0 at the bottom, the largest value at the top
    x0, bar = left + experts * cw + 14, max(layers * ch, 80)
    c.img[top:top + bar, x0:x0 + 12] = colormap(np.linspace(1, 0, bar))[:, None, :]
    for frac in (0.0, 0.5, 1.0):
        y = top + int(round((1 - frac) * (bar - 1)))
        c.rect(x0 + 12, y, x0 + 15, y + 1, INK)
        c.text(x0 + 18, min(max(top, y - 3), top + bar - 7), f"{frac * top_value:.2g}")
    c.text(x0 + 70, top + bar // 2, "per token", anchor="center", vertical=True)
    write_atomic(path, c.png())


def write_curve_png(path, curve, total, title="predicted hit rate by cache size", marker=None, width=640,
                    height=400):
    """Each policy's predicted hit rate ({policy: [[experts, hit rate], ...]}) against the
    cache size, 0 to `total` experts, with a legend; `marker` (experts, label) draws a
    dashed line at a cache size (what a budget buys)."""
    write_lines_png(path, curve, total, 1.0, f"experts cached (of {total})", "hit rate", title, marker=marker,
                    x_tick=lambda x: str(round(x)), y_tick=lambda y: f"{100 * y:.0f}%", width=width, height=height)


def write_lines_png(path, lines, x_max, y_max, x_label, y_label, title, marker=None, x_tick=str, y_tick=str,
                    width=640, height=400, x_min=0):
    """Lines ({name: [[x, y], ...]}) on axes from x_min to x_max and 0 to y_max, with a
    legend; `marker` (x, label) draws a dashed line at x."""
    left, top, bottom, right = 48, 28, 40, 16
    pw, ph = width - left - right, height - top - bottom
    c = Canvas(max(width, 6 * len(title) + 16), height)
    c.text(8, 8, title)
    x_min = x_min if x_min < x_max else 0  # (one size: from 0 to it)

    def at(x, y):
        return left + (x - x_min) / (x_max - x_min) * pw, top + (1 - y / y_max) * ph

    for i in range(6):
        y = top + ph - i * ph // 5
        c.rect(left, y, left + pw, y + 1, GRID)
        c.text(left - 5, y - 3, y_tick(y_max * i / 5), anchor="right")
    for i in range(5):
        x, label = left + i * pw // 4, x_tick(x_min + (x_max - x_min) * i / 4)
        c.rect(x, top, x + 1, top + ph, GRID)
        # centred under its tick, but inside the image (the last one would pass its right edge)
        c.text(min(x, c.img.shape[1] - 2 - 3 * len(label)), top + ph + 5, label, anchor="center")
    c.rect(left, top, left + 1, top + ph + 1, INK)
    c.rect(left, top + ph, left + pw + 1, top + ph + 1, INK)
    c.text(left + pw // 2, height - 12, x_label, anchor="center")
    c.text(6, top + ph // 2, y_label, anchor="center", vertical=True)
    if marker is not None:
        x, _ = at(min(max(marker[0], x_min), x_max), 0)
        c.line(x, top, x, top + ph, INK, width=1, dash=4)
        c.text(int(x) + 4 if x < left + pw / 2 else int(x) - 4, top + 4, marker[1],
               anchor="left" if x < left + pw / 2 else "right")
    for i, (name, points) in enumerate(lines.items()):
        color = COLORS[i % len(COLORS)]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            c.line(*at(x0, y0), *at(x1, y1), color)
        if len(points) == 1:  # (no line to draw: a dot)
            x, y = map(int, at(*points[0]))
            c.rect(x - 2, y - 2, x + 3, y + 3, color)
        y = top + ph - 12 - 10 * (len(lines) - 1 - i)  # the legend, bottom right
        c.rect(left + pw - 110, y + 3, left + pw - 98, y + 5, color)
        c.text(left + pw - 94, y, name)
    write_atomic(path, c.png())
