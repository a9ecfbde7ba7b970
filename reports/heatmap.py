"""The mismatch map (ep_harness.compare._map) as inline SVG: its cells a small PNG drawn with
Pillow, its names, ticks and scale SVG text. A report holds one map per check that differs
(dozens in a run); drawing each as a matplotlib figure took most of the report's time."""
from __future__ import annotations

import base64
import io
from html import escape

from PIL import Image

# ColorBrewer's sequential "Reds" (9 classes), the ramp matplotlib's "Reds" map is built on.
RAMP = ("#fff5f0", "#fee0d2", "#fcbba1", "#fc9272", "#fb6a4a", "#ef3b2c", "#cb181d", "#a50f15", "#67000d")
# pixels: a row at most, at least, a row that can carry its name, the rows together at most
CELL_H, MIN_CELL_H, LABEL_H, MAX_PLOT_H = 16, 2, 12, 480
PLOT_W, LABEL_CHAR_W, AXIS_H, SCALE_W, TOP = 560, 6.2, 30, 70, 6
LABELLED_CELLS = 64  # at most this many cells: each one also shows its percentage


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[k:k + 2], 16) for k in (1, 3, 5))


def colour(t: float) -> tuple[int, int, int]:
    """The ramp at t in [0, 1], interpolated between its classes (RGB)."""
    t = min(max(t, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(t), len(RAMP) - 2)
    lo, hi = map(_rgb, RAMP[i:i + 2])
    return tuple(round(a + (b - a) * (t - i)) for a, b in zip(lo, hi))


def map_svg(mismatch_map: dict) -> str:
    """Rows (the compared copies) x column bins, the fraction of elements that differ: the
    scale ends at the largest fraction, so a 5 % difference is as dark as a 100 % one would
    be, and each cell is labelled when there are few. The cells are one pixel each of a PNG
    stretched over the plot (a map of 69 copies is a few kB); rows get thinner past
    MAX_PLOT_H, and then only every few rows is named, while each row's tooltip names it."""
    fraction = mismatch_map["fraction"]
    rows, bins = len(fraction), len(fraction[0]) if fraction else 0
    peak = max((v for row in fraction for v in row), default=0.0) or 1.0
    labels = ([str(x) for x in mismatch_map["rows"]] + [""] * rows)[:rows]
    columns = int(mismatch_map["columns"])
    width = -(-columns // max(bins, 1))
    cell_h = max(MIN_CELL_H, min(CELL_H, MAX_PLOT_H / max(rows, 1)))
    named_every = int(-(-LABEL_H // cell_h))
    left = 8 + LABEL_CHAR_W * max((len(s) for s in labels[::named_every]), default=0)
    cell_w, plot_h = PLOT_W / max(bins, 1), rows * cell_h
    total_w, total_h = left + PLOT_W + SCALE_W, plot_h + AXIS_H
    out = [f'<svg class="map" xmlns="http://www.w3.org/2000/svg" role="img" width="{total_w:.0f}" '
           f'height="{total_h + 2 * TOP:.0f}" viewBox="0 {-TOP} {total_w:.0f} {total_h + 2 * TOP:.0f}" '
           f'font-family="sans-serif" font-size="10">',
           "<title>mismatch map: fraction of elements whose bits differ, per copy and element bin</title>",
           f'<image x="{left:.1f}" y="0" width="{PLOT_W}" height="{plot_h:.1f}" preserveAspectRatio="none" '
           f'style="image-rendering:pixelated" href="data:image/png;base64,{_cells_png(fraction, peak)}"/>']
    labelled = rows * bins <= LABELLED_CELLS
    for i, (label, row) in enumerate(zip(labels, fraction)):
        y = i * cell_h
        if i % named_every == 0:
            out.append(f'<text x="{left - 4:.1f}" y="{y + cell_h / 2:.1f}" text-anchor="end" '
                       f'dominant-baseline="central">{escape(label)}</text>')
        differ = sum(1 for v in row if v)
        out.append(f'<rect x="{left:.1f}" y="{y:.1f}" width="{PLOT_W}" height="{cell_h:.1f}" fill="transparent">'
                   f'<title>{escape(label)}: {differ} of {bins} bins differ, at most {100 * max(row, default=0):.1f}%'
                   f'</title></rect>')
        if labelled:
            for j, v in enumerate(row):
                ink = "white" if v > 0.6 * peak else "black"
                out.append(f'<text x="{left + (j + 0.5) * cell_w:.1f}" y="{y + cell_h / 2:.1f}" text-anchor="middle" '
                           f'dominant-baseline="central" fill="{ink}" font-size="8">{100 * v:.0f}%</text>')
    for t in range(0, bins, max(1, bins // 8)):  # about 8 ticks, at bin edges, in element indices
        x = left + t * cell_w
        out.append(f'<line x1="{x:.1f}" y1="{plot_h:.1f}" x2="{x:.1f}" y2="{plot_h + 4:.1f}" stroke="#555"/>'
                   f'<text x="{x:.1f}" y="{plot_h + 14:.1f}" text-anchor="middle">{t * width:,}</text>')
    out.append(f'<text x="{left + PLOT_W / 2:.1f}" y="{total_h - 2:.1f}" text-anchor="middle">element index '
               f'(bins of {width:,} elements)</text>')
    out.append(_scale(left + PLOT_W + 12, max(plot_h, 3 * CELL_H), peak))
    out.append("</svg>")
    return "".join(out)


def _cells_png(fraction: list[list[float]], peak: float) -> str:
    """One pixel per cell, its colour on the ramp, as base64 PNG."""
    image = Image.new("RGB", (max(len(fraction[0]) if fraction else 0, 1), max(len(fraction), 1)), _rgb(RAMP[0]))
    image.putdata([colour(v / peak) for row in fraction for v in row] or [_rgb(RAMP[0])])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _scale(x: float, height: int, peak: float) -> str:
    """The colour scale beside the map, one band per class of the ramp: 0 at the bottom, the
    peak fraction at the top (bands, not a gradient: an SVG gradient is a shared id, and one
    inside a closed <details> draws nothing in Chromium)."""
    band = height / len(RAMP)
    bands = "".join(f'<rect x="{x:.1f}" y="{height - (k + 1) * band:.2f}" width="10" height="{band:.2f}" fill="{c}"/>'
                    for k, c in enumerate(RAMP))
    return (f'{bands}<rect x="{x:.1f}" y="0" width="10" height="{height}" fill="none" stroke="#999"/>'
            f'<text x="{x + 14:.1f}" y="9">{100 * peak:.1f}%</text>'
            f'<text x="{x + 14:.1f}" y="{height}">0%</text>')
