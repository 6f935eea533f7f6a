from __future__ import annotations

import math
from xml.etree import ElementTree

import pytest

from trellis.utils.svgplot import Panel, Series, line_chart, nice_ticks

NS = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ElementTree.Element:
    return ElementTree.fromstring(svg)


def polyline_points(el: ElementTree.Element) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in el.get("points", "").split()]  # type: ignore[misc]


@pytest.mark.parametrize(("lo", "hi"), [(0.0, 1.0), (0.83, 0.97), (-3.2, 250.0), (1e-5, 3e-5), (0, 199)])
def test_ticks_are_round_steps_that_cover_the_range(lo, hi):
    ticks = nice_ticks(lo, hi)
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert min(abs(mantissa - m) for m in (1, 2, 5, 10)) < 1e-6
    assert ticks[0] <= lo and ticks[-1] >= hi
    assert 3 <= len(ticks) <= 12


def test_bad_tick_range_is_refused():
    with pytest.raises(ValueError, match="finite lo < hi"):
        nice_ticks(1.0, 1.0)


def test_lines_map_data_into_their_panel_with_y_up():
    svg = parse(line_chart([Panel([Series([0, 1, 2], [0.0, 0.5, 1.0], "a")], title="t")]))
    (line,) = svg.iter(f"{NS}polyline")
    pts = polyline_points(line)
    assert [x for x, _ in pts] == sorted(x for x, _ in pts)
    assert pts[0][1] > pts[1][1] > pts[2][1]  # larger values are higher (smaller SVG y)
    frame = [r for r in svg.iter(f"{NS}rect") if r.get("stroke") == "#333"][0]
    x0, y0 = float(frame.get("x")), float(frame.get("y"))
    x1, y1 = x0 + float(frame.get("width")), y0 + float(frame.get("height"))
    assert all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in pts)


def test_missing_values_break_the_line_and_a_lone_point_is_a_dot():
    s = Series([0, 1, 2, 3, 4, 5], [1.0, 2.0, None, 3.0, math.nan, 4.0], "gaps", dashed=True)
    svg = parse(line_chart([Panel([s])]))
    lines = list(svg.iter(f"{NS}polyline"))
    assert [len(polyline_points(el)) for el in lines] == [2]
    assert lines[0].get("stroke-dasharray")
    assert len(list(svg.iter(f"{NS}circle"))) == 2  # x = 3 and x = 5 stand alone


def test_labels_are_escaped_and_panels_sit_side_by_side():
    a = Panel([Series([0, 1], [1.0, 1.0], "<run & 0>")], title="a < b", xlabel="epoch", ylabel="loss")
    b = Panel([Series([0, 1], [2.0, 3.0])], title="second", legend=False)
    svg = parse(line_chart([a, b], panel_width=300))
    texts = [t.text for t in svg.iter(f"{NS}text")]
    assert "<run & 0>" in texts and "a < b" in texts and "second" in texts
    frames = [r for r in svg.iter(f"{NS}rect") if r.get("stroke") == "#333"]
    assert len(frames) == 2 and float(frames[1].get("x")) >= float(frames[0].get("x")) + 300


def test_an_empty_panel_still_draws_its_axes():
    svg = parse(line_chart([Panel(title="nothing yet")]))
    assert not list(svg.iter(f"{NS}polyline"))
    assert "nothing yet" in [t.text for t in svg.iter(f"{NS}text")]
