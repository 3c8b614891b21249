"""Dependency-free plotting primitives for the HTML report: SVG line charts and PNG heat maps.

Nothing here needs a browser, a CDN or matplotlib: line charts are inline SVG and heat maps are
PNG images encoded with :mod:`zlib` and embedded as ``data:`` URIs, so a report is one
self-contained file that works offline.
"""

from __future__ import annotations

import base64
import html
import math
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, NDArray

#: categorical colours (colour-blind friendly, Okabe-Ito)
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
#: alarm-kind colours on the timeline
KIND_COLOURS = {
    "nonfinite": "#000000",
    "loss_spike": "#D55E00",
    "grad_explosion": "#CC79A7",
    "activation_shift": "#009E73",
    "train_val_divergence": "#E69F00",
    "lr_loss_anomaly": "#0072B2",
    "level_shift": "#56B4E9",
    "stall": "#999999",
}

# viridis, 9 anchor colours, interpolated linearly
_VIRIDIS = np.array(
    [
        [68, 1, 84],
        [72, 40, 120],
        [62, 74, 137],
        [49, 104, 142],
        [38, 130, 142],
        [31, 158, 137],
        [53, 183, 121],
        [109, 205, 89],
        [253, 231, 37],
    ],
    dtype=np.float64,
)


def encode_png(rgb: NDArray[np.uint8]) -> bytes:
    """Encode an ``(h, w, 3)`` uint8 image as PNG bytes (no dependencies).

    >>> png = encode_png(np.zeros((2, 3, 3), dtype=np.uint8))
    >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(
            f"encode_png expects an (h, w, 3) uint8 array; got {rgb.shape} {rgb.dtype}"
        )
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return (
            struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def colormap(values: NDArray[np.float64]) -> NDArray[np.uint8]:
    """Map values in ``[0, 1]`` (NaN = grey) to viridis RGB.

    >>> colormap(np.array([[0.0, 1.0, np.nan]])).tolist()
    [[[68, 1, 84], [253, 231, 37], [200, 200, 200]]]
    """
    v = np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    lo = np.floor(v).astype(np.int64)
    hi = np.minimum(lo + 1, len(_VIRIDIS) - 1)
    f = (v - lo)[..., None]
    rgb = _VIRIDIS[lo] * (1.0 - f) + _VIRIDIS[hi] * f
    rgb[np.isnan(values)] = 200.0
    return np.round(rgb).astype(np.uint8)


def bin_columns(
    steps: NDArray[np.int64], values: NDArray[np.float64], max_bins: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Reduce ``(n_steps, k)`` values to at most ``max_bins`` step bins (nan-aware mean).

    Returns the bin centre steps and the binned values ``(n_bins, k)``.

    >>> s, v = bin_columns(np.arange(4), np.array([[1.0], [3.0], [np.nan], [5.0]]), 2)
    >>> s.tolist(), v[:, 0].tolist()
    ([0.5, 2.5], [2.0, 5.0])
    """
    n = len(steps)
    if n == 0:
        return np.zeros(0), np.zeros((0, values.shape[1]))
    n_bins = min(max_bins, n)
    edges = np.linspace(0, n, n_bins + 1).astype(np.int64)
    out = np.full((n_bins, values.shape[1]), np.nan)
    centres = np.empty(n_bins)
    for b in range(n_bins):
        lo, hi = edges[b], max(edges[b + 1], edges[b] + 1)
        block = values[lo:hi]
        finite = np.isfinite(block)
        cnt = finite.sum(axis=0)
        tot = np.where(finite, block, 0.0).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[b] = np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)
        centres[b] = steps[lo:hi].mean()
    return centres, out


def fmt(v: object, digits: int = 3) -> str:
    """A number rounded to ``digits`` significant digits (``inf``/``nan`` kept; text as is).

    >>> fmt(20.41736418816288), fmt(0.000123456), fmt(1234567.0), fmt("inf"), fmt(7)
    ('20.4', '0.000123', '1.23e+06', 'inf', '7')
    """
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def ffill_sparse(values: NDArray[np.float64], present: NDArray[np.bool_]
                 ) -> NDArray[np.float64]:
    """Forward-fill the not-logged rows of each column of ``(n_steps, k)`` values.

    A column logged every ``m`` steps (activations every 10 steps) is held at its last logged
    value for up to ``2 m`` rows (``m``: the median gap between its logged rows), so a heat map
    shows it as a band instead of stripes.  Longer gaps (the metric really stopped) and NaN
    *values* stay NaN.

    >>> v = np.array([[1.0], [np.nan], [np.nan], [4.0], [np.nan], [np.nan]])
    >>> ffill_sparse(v, ~np.isnan(v))[:, 0].tolist()
    [1.0, 1.0, 1.0, 4.0, 4.0, 4.0]
    """
    out = np.array(values, dtype=np.float64, copy=True)
    n = out.shape[0]
    for c in range(out.shape[1]):
        idx = np.flatnonzero(present[:, c])
        if idx.size < 2 or idx.size == n:
            continue
        limit = 2 * int(np.median(np.diff(idx)))
        if limit <= 2:
            continue
        last = np.maximum.accumulate(np.where(present[:, c], np.arange(n), -1))
        fill = (~present[:, c]) & (last >= 0) & (np.arange(n) - last < limit)
        out[fill, c] = out[last[fill], c]
    return out


def heatmap_png(matrix: NDArray[np.float64], log: bool = True, cell_h: int = 4) -> str:
    """Encode a ``(rows, cols)`` matrix as a base64 PNG ``data:`` URI (rows = layers).

    Each row is scaled on its own robust range (1st-99th percentile, in log10 if ``log``), so
    layers of very different magnitudes remain readable.
    """
    m = np.asarray(matrix, dtype=np.float64)
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            m = np.where(m > 0, np.log10(np.where(m > 0, m, 1.0)), np.nan)
    scaled = np.full_like(m, np.nan)
    for r in range(m.shape[0]):
        row = m[r]
        fin = row[np.isfinite(row)]
        if fin.size == 0:
            continue
        lo, hi = np.percentile(fin, 1), np.percentile(fin, 99)
        span = hi - lo if hi > lo else 1.0
        scaled[r] = (row - lo) / span
    rgb = colormap(scaled)
    rgb = np.repeat(rgb, cell_h, axis=0)
    return "data:image/png;base64," + base64.b64encode(encode_png(rgb)).decode("ascii")


@dataclass
class Marker:
    """A vertical marker on the timeline (an alarm or an intervention)."""

    step: float
    colour: str
    label: str
    dashed: bool = False
    end: float | None = None  #: last step of a span (an alarm episode); ``None``: a line


@dataclass
class LineChart:
    """An SVG line chart with optional log-scaled y axis and step markers."""

    title: str
    log_y: bool = False
    width: int = 900
    height: int = 220
    series: list[tuple[str, NDArray[np.float64], NDArray[np.float64]]] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    points: set[str] = field(default_factory=set)

    def add(self, name: str, x: ArrayLike, y: ArrayLike, points: bool = False) -> None:
        """Add a series; non-finite points (and non-positive ones on a log axis) are gaps.

        ``points``: also draw a dot at every point (sparse series: an eval every 100 steps).
        """
        self.series.append((name, np.asarray(x, dtype=float), np.asarray(y, dtype=float)))
        if points:
            self.points.add(name)

    def to_svg(self) -> str:
        """Render to an inline ``<svg>`` element."""
        ml, mr, mt, mb = 64, 12, 24, 28
        w, h = self.width, self.height
        pw, ph = w - ml - mr, h - mt - mb
        xs = [s[1] for s in self.series if len(s[1])]
        ys = []
        for _, _, y in self.series:
            yy = np.log10(y[y > 0]) if self.log_y else y[np.isfinite(y)]
            ys.append(yy[np.isfinite(yy)])
        parts = [
            f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}" role="img" aria-label="{html.escape(self.title)}" '
            f'data-yscale="{"log" if self.log_y else "linear"}">',
            f'<text x="{ml}" y="15" class="title">{html.escape(self.title)}'
            f"{' (log scale)' if self.log_y else ''}</text>",
        ]
        if not xs or not any(len(y) for y in ys):
            parts.append(f'<text x="{w / 2}" y="{h / 2}" class="empty">no data</text></svg>')
            return "".join(parts)
        x0 = min(float(x.min()) for x in xs)
        x1 = max(float(x.max()) for x in xs)
        allv = np.concatenate([y for y in ys if len(y)])
        y0, y1 = float(allv.min()), float(allv.max())
        if y1 <= y0:
            y0, y1 = y0 - 1.0, y1 + 1.0
        pad = 0.05 * (y1 - y0)
        y0, y1 = y0 - pad, y1 + pad
        x1 = x1 if x1 > x0 else x0 + 1.0

        def px(x: float) -> float:
            return ml + (x - x0) / (x1 - x0) * pw

        def py(v: float) -> float:
            return mt + ph - (min(max(v, y0), y1) - y0) / (y1 - y0) * ph

        parts.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" class="plot"/>')
        for k in range(5):
            v = y0 + (y1 - y0) * k / 4
            label = f"{10**v:.3g}" if self.log_y else f"{v:.3g}"
            parts.append(
                f'<line x1="{ml}" x2="{ml + pw}" y1="{py(v):.1f}" y2="{py(v):.1f}" class="grid"/>'
                f'<text x="{ml - 4}" y="{py(v) + 4:.1f}" class="ytick">{label}</text>'
            )
        for k in range(6):
            xv = x0 + (x1 - x0) * k / 5
            parts.append(f'<text x="{px(xv):.1f}" y="{h - 8}" class="xtick">{xv:.0f}</text>')
        for mk in self.markers:
            if mk.end is not None and mk.end >= x0 and mk.step <= x1:
                a, b = px(max(mk.step, x0)), px(min(mk.end, x1))
                parts.append(
                    f'<rect x="{a - 1:.1f}" y="{mt}" width="{max(b - a + 2, 2.5):.1f}" '
                    f'height="{ph}" fill="{mk.colour}" class="episode"><title>'
                    f"{html.escape(mk.label)}</title></rect>"
                )
                continue
            if not (x0 <= mk.step <= x1):
                continue
            dash = ' stroke-dasharray="4 3"' if mk.dashed else ""
            parts.append(
                f'<line x1="{px(mk.step):.1f}" x2="{px(mk.step):.1f}" y1="{mt}" y2="{mt + ph}" '
                f'stroke="{mk.colour}" class="marker"{dash}><title>{html.escape(mk.label)}'
                "</title></line>"
            )
        for idx, (name, x, y) in enumerate(self.series):
            colour = PALETTE[idx % len(PALETTE)]
            yy = np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), np.nan) if self.log_y else y
            segs: list[str] = []
            cur: list[str] = []
            for xi, yi in zip(x, yy, strict=True):
                if math.isfinite(yi):
                    cur.append(f"{px(float(xi)):.1f},{py(float(yi)):.1f}")
                elif cur:
                    segs.append(" ".join(cur))
                    cur = []
            if cur:
                segs.append(" ".join(cur))
            dots = name in self.points
            for seg in segs:
                pts = seg.split(" ")
                if len(pts) > 1:
                    parts.append(
                        f'<polyline points="{seg}" fill="none" stroke="{colour}" class="line"/>'
                    )
                if dots or len(pts) == 1:
                    for pt in pts:
                        cx, cy = pt.split(",")
                        parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.2" fill="{colour}"/>')
            parts.append(
                f'<text x="{ml + 8 + 120 * idx}" y="{mt + 14}" fill="{colour}" class="legend">'
                f"{html.escape(name)}</text>"
            )
        parts.append("</svg>")
        return "".join(parts)


def stacked_bar(title: str, parts: list[tuple[str, float]], unit: str = "",
                width: int = 900) -> str:
    """One horizontal bar split into ``(label, value)`` parts, as inline SVG with a legend.

    Zero parts are left out of the bar but kept in the legend (which wraps).

    >>> svg = stacked_bar("time", [("productive", 30.0), ("checkpoint", 5.0)], "s")
    >>> svg.count("<rect"), "85.7%" in svg
    (2, True)
    """
    total = sum(max(v, 0.0) for _, v in parts)
    ml, bar_h = 8, 22
    body: list[str] = []
    x, pw = float(ml), width - 2 * ml
    lx, ly = float(ml), 62
    for k, (label, v) in enumerate(parts):
        colour = PALETTE[k % len(PALETTE)]
        frac = max(v, 0.0) / total if total > 0 else 0.0
        tip = f"{label}: {fmt(v)}{unit} ({100 * frac:.1f}%)"
        if frac > 0:
            body.append(f'<rect x="{x:.1f}" y="22" width="{frac * pw:.1f}" height="{bar_h}" '
                        f'fill="{colour}"><title>{html.escape(tip)}</title></rect>')
            x += frac * pw
        tw = 12 + 6.2 * len(tip)
        if lx + tw > width and lx > ml:
            lx, ly = float(ml), ly + 15
        body.append(f'<text x="{lx:.0f}" y="{ly}" fill="{colour}" class="legend">'
                    f"{html.escape(tip)}</text>")
        lx += tw
    h = ly + 8
    out = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
        f'viewBox="0 0 {width} {h}" role="img" aria-label="{html.escape(title)}">',
        f'<text x="{ml}" y="15" class="title">{html.escape(title)}</text>',
    ]
    if total <= 0:
        out.append(f'<text x="{ml}" y="40" class="empty">no data</text></svg>')
        return "".join(out)
    return "".join(out + body) + "</svg>"
