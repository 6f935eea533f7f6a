"""Line charts written as SVG text: a run's training curves without a plotting library.

Every ``trellis train`` draws its curves once at the end. With matplotlib that cost about 0.9 s per run (importing
pyplot, building its artist classes, rasterizing and encoding a PNG), as long as training Cora itself, paid by every
run, rank 0 of every distributed job and every test that trains through the command. A chart of a few lines is a
few kilobytes of SVG text: written in about 10 ms, opened by any browser, and sharp at any zoom.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

# matplotlib's default colour cycle ("tab10"), so the curves look as they did when matplotlib drew them.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")


@dataclass
class Series:
    """One line: ``ys[i]`` at ``xs[i]``; a NaN or None value breaks the line there."""

    xs: Sequence[float]
    ys: Sequence[float | None]
    label: str | None = None
    color: str = COLORS[0]
    dashed: bool = False

    @property
    def stroke(self) -> str:
        """The SVG attributes of the line (its legend sample uses the same)."""
        return f'stroke="{self.color}" stroke-width="1.2"' + (' stroke-dasharray="5 3"' if self.dashed else "")


@dataclass
class Panel:
    """One chart: its lines, axis labels and title; ``legend`` draws the labelled lines' key inside it."""

    series: list[Series] = field(default_factory=list)
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    legend: bool = True


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (steps of 1, 2 or 5 times a power of ten) covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        raise ValueError(f"nice_ticks needs finite lo < hi, got {lo}, {hi}")
    raw = (hi - lo) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step + 1e-9) * step
    n = math.ceil((hi - first) / step - 1e-9)
    digits = max(0, 1 - math.floor(math.log10(step)))  # rounding removes float noise (2.9999999999999997e-05)
    return [round(first + i * step, digits) for i in range(n + 1)]


def _fmt(v: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    text = f"{v:.{decimals}f}"
    return "0" if text.strip("-0.") == "" else text


def _range(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    if hi == lo:  # one value: a band around it, so the line sits in the middle
        pad = abs(lo) * 0.05 or 0.5
        return lo - pad, hi + pad
    return lo, hi


def _points(s: Series) -> list[tuple[float, float] | None]:
    """The series' points, None where a value is missing or not finite (the line breaks there)."""
    return [(float(x), float(y)) if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)
            else None for x, y in zip(s.xs, s.ys)]


def _panel(p: Panel, left: float, top: float, width: float, height: float) -> list[str]:
    lines = [_points(s) for s in p.series]
    points = [q for line in lines for q in line if q is not None]
    xt = nice_ticks(*_range([x for x, _ in points]))
    yt = nice_ticks(*_range([y for _, y in points]))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * width

    def sy(y: float) -> float:
        return top + height - (y - y0) / (y1 - y0) * height

    out = []
    for x in xt:
        out.append(f'<line x1="{sx(x):.1f}" y1="{top:.1f}" x2="{sx(x):.1f}" y2="{top + height:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{sx(x):.1f}" y="{top + height + 14:.1f}" text-anchor="middle">'
                   f'{_fmt(x, xt[1] - xt[0])}</text>')
    for y in yt:
        out.append(f'<line x1="{left:.1f}" y1="{sy(y):.1f}" x2="{left + width:.1f}" y2="{sy(y):.1f}" '
                   'stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 5:.1f}" y="{sy(y) + 4:.1f}" text-anchor="end">{_fmt(y, yt[1] - yt[0])}</text>')
    for s, line in zip(p.series, lines):
        segment: list[tuple[float, float]] = []
        for q in [*line, None]:  # the sentinel ends the last segment
            if q is not None:
                segment.append((sx(q[0]), sy(q[1])))
                continue
            if len(segment) > 1:
                coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in segment)
                out.append(f'<polyline points="{coords}" fill="none" {s.stroke}/>')
            elif segment:  # a single evaluated point: a dot, or it would not show
                out.append(f'<circle cx="{segment[0][0]:.1f}" cy="{segment[0][1]:.1f}" r="2" fill="{s.color}"/>')
            segment = []
    cx = left + width / 2
    out.append(f'<text x="{cx:.1f}" y="{top - 8:.1f}" text-anchor="middle" font-size="13">{escape(p.title)}</text>')
    out.append(f'<text x="{cx:.1f}" y="{top + height + 32:.1f}" text-anchor="middle">{escape(p.xlabel)}</text>')
    ly = top + height / 2
    out.append(f'<text x="{left - 44:.1f}" y="{ly:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 {left - 44:.1f} {ly:.1f})">{escape(p.ylabel)}</text>')
    out.append(f'<rect x="{left:.1f}" y="{top:.1f}" width="{width:.1f}" height="{height:.1f}" fill="none" '
               'stroke="#333"/>')
    labelled = [s for s in p.series if s.label] if p.legend else []
    if labelled:
        w, h = 24 + 6.2 * max(len(s.label or "") for s in labelled), 6 + 13 * len(labelled)
        corners = [(left + width - w - 6, top + 6), (left + 6, top + 6), (left + width - w - 6, top + height - h - 6),
                   (left + 6, top + height - h - 6)]
        drawn = [(sx(x), sy(y)) for x, y in points]

        def covered(corner: tuple[float, float]) -> int:
            return sum(corner[0] <= a <= corner[0] + w and corner[1] <= b <= corner[1] + h for a, b in drawn)

        bx, by = min(corners, key=covered)  # the corner that hides the fewest points (top right on a tie)
        out.append(f'<rect x="{bx:.1f}" y="{by:.1f}" width="{w:.1f}" height="{h}" '
                   'fill="white" fill-opacity="0.85" stroke="#ccc"/>')
        for i, s in enumerate(labelled):
            yy = by + 12 + 13 * i
            out.append(f'<line x1="{bx + 4:.1f}" y1="{yy - 3:.1f}" x2="{bx + 18:.1f}" y2="{yy - 3:.1f}" {s.stroke}/>')
            out.append(f'<text x="{bx + 21:.1f}" y="{yy:.1f}" font-size="9">{escape(s.label or "")}</text>')
    return out


def line_chart(panels: Sequence[Panel], *, panel_width: int = 480, panel_height: int = 300) -> str:
    """The SVG document of ``panels`` side by side, each with round-number ticks and its legend."""
    ml, mr, mt, mb = 62, 16, 30, 46  # each panel's margins: tick labels and y label, title, x label
    cell = ml + panel_width + mr
    width, height = cell * len(panels), mt + panel_height + mb
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="11">',
            f'<rect width="{width}" height="{height}" fill="white"/>']
    for i, p in enumerate(panels):
        body += _panel(p, i * cell + ml, mt, panel_width, panel_height)
    body.append("</svg>")
    return "\n".join(body) + "\n"


__all__ = ["COLORS", "Panel", "Series", "line_chart", "nice_ticks"]
