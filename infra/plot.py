"""A job's curves drawn as a small SVG, by hand: the run page redraws its curve ~20 times a job
and MLflow keeps the last one, and matplotlib cost the job's process ~30 MB and ~0.45 CPU s at
its first drawing and ~65 ms a drawing after (docs/benchmarks/cpu_tax.md), for a few lines,
two axes and a legend. An SVG is text: MLflow's UI and the Prefect UI (as a ``data:`` image)
show it, and it stays sharp at any size."""

from __future__ import annotations

import math
from collections.abc import Iterable
from html import escape

Series = dict[str, list[tuple[int, float]]]
"""Curves to draw: name → ``[(step, value), ...]``."""

SPARSE_POINTS = 60
"""A series with at most this many points is drawn with a dot at each (a single point of a
line is otherwise invisible)."""

MAX_POINTS = 1000
"""A longer series is drawn through this many of its points, evenly spread, its last among
them (a 10k-step job's curve stays ~20 KB)."""

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
"""Line colours, one per series in order (matplotlib's first seven, which users know)."""

Y_MARGIN = 0.05
"""The values' range is widened by this share on each side before the ticks are chosen."""

LEFT, RIGHT, TOP, BOTTOM = 56, 16, 12, 44
"""Margins of the plot area, px: tick labels on the left, the x label below."""

LEGEND_ROW, CHAR_WIDTH = 16, 6.5
"""A legend row's height and a character's width at the font size, px (the legend sits at the
plot area's top right, as wide as its longest name)."""


def curve_svg(series: Series, xlabel: str = "step", size: tuple[int, int] = (480, 280)) -> str:
    """``series`` against step as an SVG document: a line per series (split where a value is
    not finite), a dot at each point of a sparse one, ~5 round ticks on each axis, a grid and
    a legend with every series that has a point. Names are escaped: they may come from a
    user's config."""
    width, height = size
    plot_w, plot_h = width - LEFT - RIGHT, height - TOP - BOTTOM
    drawn = {name: _finite(points) for name, points in series.items()}
    drawn = {name: points for name, points in drawn.items() if points}
    xs = [x for points in drawn.values() for x, _ in points] or [0.0, 1.0]
    ys = [y for points in drawn.values() for _, y in points] or [0.0, 1.0]
    x_lo, x_hi = _span(min(xs), max(xs))
    y_lo, y_hi = _span(min(ys), max(ys))
    margin = (y_hi - y_lo) * Y_MARGIN  # a line along the top or bottom stays off the frame
    y_lo, y_hi = y_lo - margin, y_hi + margin
    x_ticks, y_ticks = _ticks(x_lo, x_hi), _ticks(y_lo, y_hi)
    x_lo, x_hi = min(x_lo, x_ticks[0]), max(x_hi, x_ticks[-1])
    y_lo, y_hi = min(y_lo, y_ticks[0]), max(y_hi, y_ticks[-1])

    def px(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return TOP + (1 - (y - y_lo) / (y_hi - y_lo)) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for x in x_ticks:
        out.append(_line(px(x), TOP, px(x), TOP + plot_h, "#e5e5e5"))
        out.append(_text(px(x), TOP + plot_h + 14, _label(x), "middle"))
    for y in y_ticks:
        out.append(_line(LEFT, py(y), LEFT + plot_w, py(y), "#e5e5e5"))
        out.append(_text(LEFT - 5, py(y) + 4, _label(y), "end"))
    out.append(
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>'
    )
    out.append(_text(LEFT + plot_w / 2, height - 8, xlabel, "middle"))
    for i, (name, points) in enumerate(drawn.items()):
        color = COLORS[i % len(COLORS)]
        for run in points_runs(series[name]):
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>'
            )
        if len(points) <= SPARSE_POINTS:
            out += [
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>'
                for x, y in points
            ]
    legend_w = 36 + CHAR_WIDTH * max((len(name) for name in drawn), default=0)
    legend_x = LEFT + plot_w - legend_w - 6
    if drawn:
        out.append(
            f'<rect x="{legend_x:.1f}" y="{TOP + 6}" width="{legend_w:.1f}" '
            f'height="{len(drawn) * LEGEND_ROW + 4}" fill="white" fill-opacity="0.85" '
            'stroke="#ccc"/>'
        )
    for i, name in enumerate(drawn):
        row = TOP + 8 + (i + 0.5) * LEGEND_ROW
        color = COLORS[i % len(COLORS)]
        out.append(_line(legend_x + 6, row, legend_x + 24, row, color, 2))
        out.append(_text(legend_x + 28, row + 4, name, "start"))
    out.append("</svg>")
    return "\n".join(out)


def points_runs(points: Iterable[tuple[int, float]]) -> list[list[tuple[float, float]]]:
    """``points`` by step (at most ``MAX_POINTS``), cut into runs of finite values (a NaN or
    an infinity breaks the line, as in matplotlib)."""
    ordered = sorted(points)
    if len(ordered) > MAX_POINTS:
        last = len(ordered) - 1
        ordered = [ordered[round(k * last / (MAX_POINTS - 1))] for k in range(MAX_POINTS)]
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in ordered:
        if math.isfinite(y):
            runs[-1].append((float(x), float(y)))
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


def _finite(points: Iterable[tuple[int, float]]) -> list[tuple[float, float]]:
    return [point for run in points_runs(points) for point in run]


def _span(lo: float, hi: float) -> tuple[float, float]:
    """An axis range around ``lo..hi``, widened where they are equal."""
    if hi > lo:
        return lo, hi
    pad = abs(lo) * 0.1 or 0.5
    return lo - pad, hi + pad


def _ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """About ``target`` round ticks (1, 2 or 5 times a power of ten apart) covering lo..hi."""
    raw = (hi - lo) / target
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step + 1e-9) * step
    count = math.ceil((hi - first) / step - 1e-9)
    return [round(first + k * step, 12) for k in range(count + 1)]


def _label(value: float) -> str:
    return f"{value:g}" if abs(value) < 1e6 else f"{value:.2g}"


def _line(x1: float, y1: float, x2: float, y2: float, color: str, width: float = 1) -> str:
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
        f'stroke="{color}" stroke-width="{width}"/>'
    )


def _text(x: float, y: float, text: str, anchor: str) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{escape(text)}</text>'
