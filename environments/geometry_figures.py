"""Synthetic geometry problems with exact integer answers, drawn with Pillow.

A problem is a key ``(kind, p, q)``: two integers that fix the figure. Every kind has a finite,
enumerable set of keys (bounded by ``max_length``), so a held-out split can be drawn from it
like arithmetic's. ``problem_row(key, ...)`` renders the key as a row in the Geometry3K layout
(``images``: one PNG, ``problem``, ``choices``, ``answer``) plus ``kind`` and ``params``.

| kind | p, q | figure | answer |
|---|---|---|---|
| ``hypotenuse`` | legs | right triangle, legs labelled, hypotenuse ``x`` | ``sqrt(p² + q²)`` |
| ``leg`` | hypotenuse, leg | right triangle, other leg ``x`` | ``sqrt(p² - q²)`` |
| ``third_angle`` | two angles (degrees) | triangle, third angle ``x`` | ``180 - p - q`` |
| ``complement`` | angle, 0 | right angle split by a ray | ``90 - p`` |
| ``rectangle_area`` | sides | rectangle | ``p * q`` |
| ``triangle_area`` | legs | right triangle | ``p * q / 2`` |
"""

from __future__ import annotations

import io
import math
import random
from functools import lru_cache
from typing import Any, Literal

from PIL import Image, ImageDraw, ImageFont

Kind = Literal["hypotenuse", "leg", "third_angle", "complement", "rectangle_area", "triangle_area"]
KINDS: tuple[str, ...] = (
    "hypotenuse",
    "leg",
    "third_angle",
    "complement",
    "rectangle_area",
    "triangle_area",
)
LETTERS = "ABCDEFGH"
"""Choice letters, in order."""

_PRIMITIVE_TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29), (9, 40, 41))
Key = tuple[str, int, int]


def _triples(max_length: int) -> list[tuple[int, int, int]]:
    """Pythagorean triples ``(a, b, c)`` with ``c <= max_length``, both leg orders."""
    out = []
    for a, b, c in _PRIMITIVE_TRIPLES:
        for k in range(1, max_length // c + 1):
            out += [(k * a, k * b, k * c), (k * b, k * a, k * c)]
    return sorted(out)


def _params(kind: str, max_length: int) -> list[tuple[int, int]]:
    sides = range(2, max_length + 1)
    if kind == "hypotenuse":
        return [(a, b) for a, b, _ in _triples(max_length)]
    if kind == "leg":
        return [(c, a) for a, _, c in _triples(max_length)]
    if kind == "third_angle":  # multiples of 5, every angle at least 20 degrees
        angles = range(20, 125, 5)
        return [(a, b) for a in angles for b in angles if 180 - a - b >= 20]
    if kind == "complement":
        return [(a, 0) for a in range(10, 81)]
    if kind == "rectangle_area":
        return [(w, h) for w in sides for h in sides]
    if kind == "triangle_area":
        return [(a, b) for a in sides for b in sides if a * b % 2 == 0]
    raise ValueError(f"unknown geometry kind {kind!r}; known: {KINDS}")


@lru_cache(maxsize=32)
def problem_space(kinds: tuple[str, ...], max_length: int) -> tuple[Key, ...]:
    """Every problem key of ``kinds`` with lengths up to ``max_length``, in a fixed order."""
    return tuple((kind, p, q) for kind in kinds for p, q in _params(kind, max_length))


def answer_value(key: Key) -> int:
    """The exact answer of problem ``key``."""
    kind, p, q = key
    values = {
        "hypotenuse": lambda: math.isqrt(p * p + q * q),
        "leg": lambda: math.isqrt(p * p - q * q),
        "third_angle": lambda: 180 - p - q,
        "complement": lambda: 90 - p,
        "rectangle_area": lambda: p * q,
        "triangle_area": lambda: p * q // 2,
    }
    return values[kind]()


def _plausible_mistake(key: Key) -> int:
    """A wrong answer a careless solver gives (a distractor)."""
    kind, p, q = key
    return {
        "hypotenuse": p + q,
        "leg": p + q,
        "third_angle": 180 - p,
        "complement": 180 - p,
        "rectangle_area": 2 * (p + q),
        "triangle_area": p * q,
    }[kind]


def _problem_text(key: Key, numbers_in_text: bool) -> str:
    kind, p, q = key
    if not numbers_in_text:
        return "Find x."
    return {
        "hypotenuse": f"Right triangle, legs {p} and {q}. Find the hypotenuse x.",
        "leg": f"Right triangle, hypotenuse {p}, leg {q}. Find the other leg x.",
        "third_angle": f"Triangle with angles {p} and {q}. Find the third angle x.",
        "complement": f"A right angle is split into {p} and x. Find x.",
        "rectangle_area": f"Rectangle {p} by {q}. Find its area x.",
        "triangle_area": f"Right triangle, legs {p} and {q}. Find its area x.",
    }[kind]


def choices_for(key: Key, num_choices: int, seed: int) -> tuple[list[str], str]:
    """``num_choices`` distinct positive options (the answer among them) and the answer's
    letter; deterministic in ``(key, num_choices, seed)``. No choices: ``([], value)``."""
    value = answer_value(key)
    if num_choices == 0:
        return [], str(value)
    rng = random.Random(f"flowrl.geometry.choices:{seed}:{key}")
    near = {value + d for d in range(-10, 11)} | {2 * value}
    pool = sorted(v for v in near | {_plausible_mistake(key)} if v > 0 and v != value)
    options = rng.sample(pool, num_choices - 1)
    position = rng.randrange(num_choices)
    options.insert(position, value)
    return [str(v) for v in options], LETTERS[position]


def problem_row(
    key: Key,
    image_size: int = 64,
    num_choices: int = 4,
    numbers_in_text: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Problem ``key`` as a Geometry3K-layout row (one PNG image) plus ``kind`` and ``params``."""
    choices, answer = choices_for(key, num_choices, seed)
    return {
        "images": [render_png(key, image_size)],
        "problem": _problem_text(key, numbers_in_text),
        "choices": choices,
        "answer": answer,
        "kind": key[0],
        "params": [key[1], key[2]],
    }


# --- drawing ----------------------------------------------------------------------------------

Point = tuple[float, float]


def _figure(key: Key) -> tuple[list[list[Point]], list[tuple[Point, str]]]:
    """Polylines and text labels of ``key`` in figure coordinates (y up)."""
    kind, p, q = key
    if kind in ("hypotenuse", "leg", "triangle_area"):
        a, b = (p, q) if kind != "leg" else (q, math.isqrt(p * p - q * q))
        s = 1.0 / max(a, b)
        A, B, C = (0.0, 0.0), (a * s, 0.0), (0.0, b * s)
        m = 0.08  # right-angle marker
        lines = [[A, B, C, A], [(m, 0.0), (m, m), (0.0, m)]]
        hyp_label = (B[0] / 2 + 0.08, C[1] / 2 + 0.08)
        base, side = ((B[0] / 2, -0.12), (-0.12, C[1] / 2))
        labels = {
            "hypotenuse": [(base, str(a)), (side, str(b)), (hyp_label, "x")],
            "leg": [(base, str(a)), (side, "x"), (hyp_label, str(p))],
            "triangle_area": [(base, str(a)), (side, str(b)), ((B[0] / 4, C[1] / 4), "x")],
        }[kind]
        return lines, labels
    if kind == "third_angle":
        ta, tb = math.tan(math.radians(p)), math.tan(math.radians(q))
        apex = (tb / (ta + tb), tb / (ta + tb) * ta)
        corners = [(0.0, 0.0), (1.0, 0.0), apex]
        labels = [(_inside_angle(corners, i), text) for i, text in enumerate((str(p), str(q), "x"))]
        return [[*corners, corners[0]]], labels
    if kind == "complement":
        ray = (math.cos(math.radians(p)), math.sin(math.radians(p)))
        m = 0.08
        lines = [[(1.0, 0.0), (0.0, 0.0), (0.0, 1.0)], [(0.0, 0.0), ray], [(m, 0), (m, m), (0, m)]]

        def at(degrees: float) -> Point:
            return (0.6 * math.cos(math.radians(degrees)), 0.6 * math.sin(math.radians(degrees)))

        return lines, [(at(p / 2), str(p)), (at((p + 90) / 2), "x")]
    if kind == "rectangle_area":
        s = 1.0 / max(p, q)
        w, h = p * s, q * s
        lines = [[(0.0, 0.0), (w, 0.0), (w, h), (0.0, h), (0.0, 0.0)]]
        return lines, [((w / 2, -0.12), str(p)), ((w + 0.12, h / 2), str(q)), ((w / 2, h / 2), "x")]
    raise ValueError(f"unknown geometry kind {kind!r}; known: {KINDS}")


def _inside_angle(corners: list[Point], i: int, share: float = 0.6) -> Point:
    """A point inside corner ``i``'s angle of a triangle: ``share`` of the way from the corner to
    the incentre (which lies on every angle's bisector)."""
    sides = [math.dist(corners[(j + 1) % 3], corners[(j + 2) % 3]) for j in range(3)]
    total = sum(sides)
    incentre = tuple(
        sum(w * c[axis] for w, c in zip(sides, corners, strict=True)) / total for axis in (0, 1)
    )
    x, y = corners[i]
    return (x + share * (incentre[0] - x), y + share * (incentre[1] - y))


def render_png(key: Key, size: int = 64) -> bytes:
    """The figure of ``key`` on a white ``size``×``size`` canvas, as PNG bytes (deterministic)."""
    lines, labels = _figure(key)
    points = [pt for line in lines for pt in line] + [pt for pt, _ in labels]
    x0, x1 = min(x for x, _ in points), max(x for x, _ in points)
    y0, y1 = min(y for _, y in points), max(y for _, y in points)
    margin = 0.12 * size
    scale = (size - 2 * margin) / max(x1 - x0, y1 - y0, 1e-9)

    def pixel(pt: Point) -> tuple[float, float]:
        return (margin + (pt[0] - x0) * scale, size - margin - (pt[1] - y0) * scale)

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    width = max(1, size // 64)
    for line in lines:
        draw.line([pixel(pt) for pt in line], fill="black", width=width)
    font = ImageFont.load_default(size=max(6, size // 7))
    for pt, text in labels:
        draw.text(
            pixel(pt), text, fill=(200, 0, 0) if text == "x" else "blue", font=font, anchor="mm"
        )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()
