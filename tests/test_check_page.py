"""`memplan check --html PAGE`: the whole program on one page, as it ran on the fake GPU (planner/jobs/check_page.py):
its steps, the allocator's limit, each out-of-memory error at its time, reserved bytes as the program met them."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from headless import find_browser, selftest

from memplan.cli import main
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.traces.format import INT_COLUMNS, STR_COLUMNS, load

SCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "scripts"
PLAIN = str(SCRIPTS / "plain_loop.py")
RETRY = str(SCRIPTS / "retry_on_oom.py")
SPAWN = str(SCRIPTS / "spawn_ddp.py")


def embedded(page: str) -> dict:
    """The data the page embeds (its first panel is the program)."""
    found = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    return json.loads(html.unescape(found.group(1)).replace("<\\/", "</"))


def check(tmp_path: Path, *args: str) -> tuple[dict, dict, object]:
    """`memplan check --json --html -o ...`: the answer, the page's first panel and the program written."""
    page, program = tmp_path / "check.html", tmp_path / "program.json.gz"
    result = CliRunner().invoke(
        main, ["check", "--json", "--html", str(page), "-o", str(program), *args], catch_exceptions=False
    )
    assert result.exit_code in (0, 3), result.output
    return json.loads(result.stdout), embedded(page.read_text())["panels"][0], load(program).program


def test_a_fitting_program_is_drawn_whole_with_its_steps_and_the_allocators_limit(tmp_path):
    """Construction and every step the program ran, bracketed where the program's windows are; the reserved bytes
    drawn peak where the check's answer says; the limit is the GPU's memory less what lies outside."""
    answer, panel, program = check(tmp_path, "--gpu", "L4", "--", "python", PLAIN, "--steps", "5")
    assert answer["fits"] and answer["steps_run"] == 3
    assert panel["steps"] == [[s.start, s.end, f"step {k}"] for k, s in enumerate(program.steps, start=1)]
    assert len(panel["steps"]) == 3 and panel["steps"][0][0] > 0  # construction comes before the first step
    assert panel["end"] == program.trace.end and panel["figures"]["buffers"] == len(program.trace)
    assert panel["figures"]["caching_peak_reserved"] == answer["peak_reserved"]
    assert max(panel["series"]["reserved"]) == answer["peak_reserved"]
    assert panel["limit"] == answer["memory"] - answer["budget"]["outside_bytes"]
    assert panel["events"] == [] and panel["text"].startswith("fits L4")


def test_errors_the_program_caught_are_marked_and_the_reserved_bytes_are_those_it_met(tmp_path):
    """retry_on_oom.py halves its batch four times: each error is a mark at its request's time; the refused requests
    are not drawn as held; the reserved bytes are the live allocator's, which released its cache at each error (a
    simulation of the recorded program alone, without the refused requests, would not have)."""
    answer, panel, program = check(tmp_path, "--gpu", "L4", "--", RETRY)
    failures = answer["failures"]
    assert len(failures) == 4 and all(f["caught"] for f in failures)
    assert [e[0] for e in panel["events"]] == [f["time"] for f in failures]
    assert all(label.startswith("out of memory: ") and label.endswith("(caught)") for _, label in panel["events"])
    trace = program.trace
    for f in failures:  # the refused request is in the recorded program, at its time, and not on the page
        assert ((trace.alloc == f["time"]) & (trace.size == f["size"])).sum() == 1
    assert panel["figures"]["buffers"] == len(trace) - len(failures)
    assert panel["peak"] <= answer["peak_allocated"] <= panel["limit"]
    reserved = np.asarray(panel["series"]["reserved"])
    assert reserved.max() == panel["figures"]["caching_peak_reserved"] == answer["peak_reserved"] <= panel["limit"]
    refused = np.zeros(len(trace), dtype=bool)
    for f in failures:
        refused |= (trace.alloc == f["time"]) & (trace.size == f["size"])
    kept = np.flatnonzero(~refused)
    served = dataclasses.replace(trace, **{c: getattr(trace, c)[kept] for c in INT_COLUMNS},
                                 **{c: [getattr(trace, c)[i] for i in kept] for c in STR_COLUMNS})  # fmt: skip
    again = simulate_caching(served, parse_alloc_conf(""), capacity=panel["limit"])
    assert again.peak_reserved != answer["peak_reserved"]  # so the page's figure is the program's, not a re-run's


def test_the_page_draws_in_a_browser_with_its_marks():
    """The page loads in headless Chromium without an error and draws the program with its marks: three steps, one
    error marked, and the limit."""
    browser = find_browser()
    if browser is None:
        pytest.skip("needs Chromium (scripts/setup.sh installs it)")
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        page = Path(folder) / "check.html"
        result = CliRunner().invoke(main, ["check", "--gpu", "L4", "--html", str(page), "--", RETRY],
                                    catch_exceptions=False)  # fmt: skip
        assert result.exit_code == 0, result.output
        seen, _ = selftest(browser, page)
    assert seen["errors"] == [] and seen["panels"] == 1 and seen["drawn"][0] > 0
    assert seen["marks"] == [3 + 4 + 1]  # steps, errors, the limit


def test_a_page_that_is_not_html_is_refused_before_the_program_runs(tmp_path):
    result = CliRunner().invoke(main, ["check", "--html", str(tmp_path / "page.txt"), "--", "python", PLAIN])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"Error: {tmp_path / 'page.txt'}: the page must end in .html"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two rank processes: about 12 s
def test_ranks_run_in_their_own_processes_give_the_tightest_ranks_page(tmp_path):
    """A script spawning its ranks: each rank's process renders its own page (its live allocator is there); the
    page written is the tightest rank's, titled with it."""
    page = tmp_path / "check.html"
    args = ["--world-size", "2", "--hidden", "64", "--vocab", "1024", "--seq", "32"]
    result = CliRunner().invoke(main, ["check", "--nproc", "2", "--json", "--html", str(page), "--", "python", SPAWN,
                                       *args], catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    text = page.read_text()
    panel = embedded(text)["panels"][0]
    assert re.search(r"<h1>memplan check: .* on a fake H100-80GB \(rank (\d)\)</h1>", text)[1] == str(answer["rank"])
    assert len(panel["steps"]) == 3
    assert panel["figures"]["caching_peak_reserved"] == answer["peak_reserved"]
    assert sorted(tmp_path.iterdir()) == [page]
