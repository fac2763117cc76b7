"""The curve a job's run page and MLflow run show (``infra.plot.curve_svg``): every series
with a point is a line and a legend entry, on axes that cover its values."""

from __future__ import annotations

import math
from xml.etree import ElementTree

from flowrl.infra.plot import MAX_POINTS, curve_svg

SVG = "{http://www.w3.org/2000/svg}"


def _parsed(series: dict) -> ElementTree.Element:
    return ElementTree.fromstring(curve_svg(series))


def _labels(svg: ElementTree.Element) -> list[str]:
    return [t.text or "" for t in svg.iter(f"{SVG}text")]


def _polylines(svg: ElementTree.Element) -> list[list[tuple[float, float]]]:
    return [
        [tuple(map(float, xy.split(","))) for xy in line.get("points", "").split()]
        for line in svg.iter(f"{SVG}polyline")
    ]


def test_each_series_with_points_is_a_line_and_a_legend_entry():
    series = {
        "reward/mean": [(s, s / 30) for s in range(1, 31)],
        "accuracy": [(0, 0.41), (15, 0.6), (30, 0.77)],
        "not evaluated yet": [],
    }
    svg = _parsed(series)
    labels = _labels(svg)
    assert {"reward/mean", "accuracy", "step"} <= set(labels)
    assert "not evaluated yet" not in labels
    lines = _polylines(svg)
    assert [len(line) for line in lines] == [30, 3]
    # a higher value is drawn higher (smaller y): the reward rises left to right
    xs, ys = zip(*lines[0], strict=True)
    assert list(xs) == sorted(xs) and list(ys) == sorted(ys, reverse=True)
    # sparse series get a dot at each point (a 1-point series is otherwise invisible)
    assert len(list(svg.iter(f"{SVG}circle"))) == 33


def test_the_axes_ticks_are_round_and_cover_the_values():
    svg = _parsed({"loss": [(1, 2.31), (50, 0.42), (100, 0.07)]})

    def ticks(anchor: str) -> list[float]:  # y labels end at the axis, x labels centre on it
        texts = [t for t in svg.iter(f"{SVG}text") if t.get("text-anchor") == anchor]
        return sorted(float(t.text or "") for t in texts if t.text != "step")

    cases = ((ticks("end"), 0.07, 2.31, {0.5}), (ticks("middle"), 1, 100, {20}))
    for axis, lo, hi, round_steps in cases:
        assert axis[0] <= lo and axis[-1] >= hi, axis
        assert {round(b - a, 9) for a, b in zip(axis, axis[1:], strict=False)} == round_steps, axis


def test_a_value_that_is_not_finite_breaks_the_line_and_a_flat_series_still_draws():
    svg = _parsed({"loss": [(1, 1.0), (2, math.nan), (3, 0.5), (4, math.inf), (5, 0.25)]})
    assert [len(line) for line in _polylines(svg)] == [1, 1, 1]
    flat = _parsed({"accuracy": [(s, 0.5) for s in range(10)]})
    assert len(_polylines(flat)[0]) == 10  # a constant still gets an axis around it


def test_names_are_text_not_markup_and_a_long_job_stays_small():
    name = '<script>alert("x")</script>&'
    text = curve_svg({name: [(1, 1.0), (2, 2.0)]})
    assert "<script>" not in text
    assert name in _labels(ElementTree.fromstring(text))
    long = curve_svg({"reward/mean": [(s, math.sin(s / 50)) for s in range(50_000)]})
    line = _polylines(ElementTree.fromstring(long))[0]
    assert len(line) == MAX_POINTS and len(long) < 40_000
