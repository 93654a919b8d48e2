"""`memplan report` and report.html: one self-contained page whose embedded buffers are the trace's, that loads in
a real headless Chromium without a console error, draws its timelines and shows a buffer's details on hover."""

from __future__ import annotations

import base64
import gzip
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from headless import find_browser, selftest
from step_traces import step_trace
from test_simulate_cli import side_by_side_plan

from memplan.cli import main
from memplan.planner.plan import save_plan
from memplan.planner.problem import problem_from_trace
from memplan.traces import save
from memplan.traces.format import CATEGORIES, PHASES


@pytest.fixture
def report(tmp_path):
    """Two traces side by side, the first with its plan: the page, the traces and the command's summary."""
    a = step_trace(layers=6, seed=0, meta={"model": "bert-small", "layers": "baseline"})
    b = step_trace(layers=6, activation=1 << 20, seed=1, meta={"model": "bert-small", "layers": "tempo"})
    save(a, tmp_path / "a.trace.json")
    save(b, tmp_path / "b.trace.json")
    save_plan(side_by_side_plan(a), problem_from_trace(a), tmp_path / "a.plan.json")
    out = tmp_path / "r.html"
    args = ["report", str(tmp_path / "a.trace.json"), str(tmp_path / "b.trace.json")]
    r = CliRunner().invoke(main, [*args, "--plan", str(tmp_path / "a.plan.json"), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    return out, (a, b), json.loads(r.stdout)


def embedded(page: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1))


def test_page_is_offline_and_embeds_every_buffer(report):
    out, traces, summary = report
    page = out.read_text()
    assert summary["bytes"] == len(page.encode()) and summary["output"] == str(out)
    assert not re.search(r"(src|href)=|https?://|@import|fetch\(", page)  # nothing to load: it opens offline
    assert "memplan report" in page and "--plan" in page  # the command that reproduces it
    data = embedded(page)
    assert [p["figures"]["plan_arena"] is not None for p in data["panels"]] == [True, False]
    for panel, trace in zip(data["panels"], traces):
        b = panel["buffers"]
        raw = gzip.decompress(base64.b64decode(b["blob"]))
        n = len(trace)
        cols = np.frombuffer(raw[: 20 * n], dtype="<u4").reshape(5, n)
        kind = np.frombuffer(raw[20 * n :], dtype=np.uint8)
        assert (cols[0] == trace.alloc).all() and (cols[1] == trace.free).all()
        assert (np.array(b["sizes"])[cols[2]] == trace.size).all()
        assert [b["ops"][k] for k in cols[3]] == trace.op and [b["modules"][k] for k in cols[4]] == trace.module
        assert [CATEGORIES[k >> 2] for k in kind] == trace.category and [PHASES[k & 3] for k in kind] == trace.phase
        assert panel["peak"] == trace.peak()[0] and panel["largest"][0] in trace.live_at(panel["peak_t"])


def test_per_module_table_holds_forward_buffers_for_backward(report):
    _, (a, _), _ = report
    panel = embedded(report[0].read_text())["panels"][0]
    b0 = min(int(a.alloc[i]) for i in range(len(a)) if a.phase[i] == "backward")
    held = sum(int(a.size[i]) for i in range(len(a)) if a.phase[i] == "forward" and a.alloc[i] <= b0 < a.free[i])
    assert held > 0 and sum(m["held"] for m in panel["modules"]) == held


def test_bad_plan_or_name_is_one_error_line_and_no_page(tmp_path):
    a, b = step_trace(seed=0), step_trace(seed=1)
    save(a, tmp_path / "a.trace.json")
    save_plan(side_by_side_plan(b), problem_from_trace(b), tmp_path / "b.plan.json")
    trace = str(tmp_path / "a.trace.json")
    for extra, message in (
        (["--plan", str(tmp_path / "b.plan.json"), "-o", str(tmp_path / "r.html")], "made for none of the given"),
        (["-o", str(tmp_path / "r.png")], "must end in .html"),
    ):
        r = CliRunner().invoke(main, ["report", trace, *extra])
        assert r.exit_code == 1 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.trace.json", "b.plan.json"]


@pytest.mark.skipif(find_browser() is None, reason="no chromium on PATH (scripts/setup.sh installs it as root)")
def test_page_loads_draws_and_shows_a_buffer_on_hover_in_chromium(report):
    out, (a, b), _ = report
    seen, _ = selftest(find_browser(), out)
    assert seen["errors"] == [] and seen["panels"] == 2
    assert all(n > 0 for n in seen["drawn"]) and seen["rects"][0] == len(a) and seen["rects"][1] == 0
    hover = seen["hover"]  # at the first panel's peak, half way up: exact bytes per category and the buffer there
    t = hover["time"]
    live = a.live_at(t)
    by_category = {c: int(a.size[[i for i in live if a.category[i] == c]].sum()) for c in CATEGORIES}
    assert hover["live"] == {c: v for c, v in by_category.items() if v}
    i = hover["buffer"]
    assert i in live and f"buffer #{i}:" in hover["tooltip"]
    assert f"module {a.module[i]}" in hover["tooltip"] and f"{a.category[i]}, {a.phase[i]} phase" in hover["tooltip"]
    assert f"allocated at {a.alloc[i]:,}, freed at {a.free[i]:,}" in hover["tooltip"]
    zoomed = seen["zoomed"]
    assert 0 <= zoomed["range"][0] < zoomed["range"][1] < a.end and zoomed["drawn"] > 0
    assert seen["reset"] == [0, a.end]
