"""`memplan plot`: figures are written, not blank, show every category, and large traces are pooled."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner
from matplotlib.image import imread
from step_traces import step_trace
from test_simulate_cli import side_by_side_plan

from memplan.cli import main
from memplan.planner.plan import save_plan
from memplan.planner.problem import problem_from_trace
from memplan.planner.report.plots import (
    CATEGORY_COLORS,
    MAX_POINTS,
    PLAN_COLOR,
    plot_reports,
    pool_max,
    pool_points,
)
from memplan.planner.simulate.measure import simulate_trace
from memplan.traces import save


def colours(png) -> set[tuple[int, int, int]]:
    """The distinct RGB colours of an image, as 0-255 triples."""
    rgb = (imread(png)[..., :3] * 255).round().astype(np.int64)
    packed = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])
    return {(int(p >> 16), int(p >> 8 & 255), int(p & 255)) for p in packed}


def rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[k : k + 2], 16) for k in (1, 3, 5))


def test_side_by_side_png_shows_every_category_and_plan(tmp_path):
    a = step_trace(layers=6, seed=0, meta={"model": "bert-small", "layers": "baseline"})
    b = step_trace(layers=6, seed=1, activation=2 << 20, meta={"model": "bert-small", "layers": "tempo"})
    save(a, tmp_path / "a.json")
    save(b, tmp_path / "b.json")
    save_plan(side_by_side_plan(a), problem_from_trace(a), tmp_path / "a.plan.json")
    r = CliRunner().invoke(
        main,
        [
            "plot",
            str(tmp_path / "a.json"),
            str(tmp_path / "b.json"),
            "--plan",
            str(tmp_path / "a.plan.json"),
            "--address-space",
            "-o",
            str(tmp_path / "m.png"),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["output"] == str(tmp_path / "m.png")
    image = imread(tmp_path / "m.png")
    assert image.shape[0] > 600 and image.shape[1] > 1000
    seen = colours(tmp_path / "m.png")
    assert len(seen) > 50
    for cat in set(a.category):
        assert rgb(CATEGORY_COLORS[cat]) in seen, cat
    assert rgb(PLAN_COLOR) in seen
    white = (image[..., :3] > 0.98).all(axis=-1).mean()
    assert white < 0.8


def test_svg_is_written(tmp_path):
    trace = step_trace(layers=3)
    save(trace, tmp_path / "a.json")
    r = CliRunner().invoke(main, ["plot", str(tmp_path / "a.json"), "-o", str(tmp_path / "m.svg")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "m.svg").read_text()
    assert "<svg" in text and CATEGORY_COLORS["activation"] in text


def test_pooling_keeps_every_peak():
    rng = np.random.default_rng(0)
    total = rng.integers(0, 1 << 30, size=5 * MAX_POINTS + 17)
    keep, w = pool_points(total, MAX_POINTS)
    assert len(keep) <= MAX_POINTS and w == 6
    assert np.argmax(total) in keep
    bins = [total[k : k + w].max() for k in range(0, len(total), w)]
    assert total[keep].tolist() == bins
    assert pool_max(total, w).tolist() == bins
    assert pool_points(total[:100], MAX_POINTS)[1] == 1


def test_large_trace_is_pooled_and_drawn(tmp_path):
    trace = step_trace(layers=6000, activation=1 << 14, param=1 << 12)
    assert trace.end > 2 * MAX_POINTS
    report = simulate_trace(trace, "big.json")
    plot_reports([report], tmp_path / "big.png")
    seen = colours(tmp_path / "big.png")
    assert rgb(CATEGORY_COLORS["activation"]) in seen and rgb(CATEGORY_COLORS["optimizer"]) in seen


def test_titles_come_from_meta_with_rank():
    from memplan.planner.report.memory_report import trace_title

    meta = {"model": "gpt2_parallel", "layers": "tempo", "rank": 1, "world_size": 2}
    assert trace_title(step_trace(layers=2, meta=meta), "x.json") == "gpt2_parallel · tempo · rank 1/2"
    assert trace_title(step_trace(layers=2, meta={}), "/some/dir/x.json.gz") == "x.json.gz"
