"""The HTML report's size and load time in headless Chromium: for the main job's model (the four bundled BERT-Large
slice traces side by side, each with a plan solved here) and for a generated trace of about a million buffers.

Usage: .venv/bin/python benchmarks/html_report.py [--buffers N] [--time-limit S]
The large trace repeats the recorded buffers of the bundled BERT-Large baseline step, one copy after another in
logical time (the resident parameters and optimizer state once), until it holds N buffers. Load time is the page's
own (decoding the embedded buffers and drawing every panel, performance.now()) and the browser's wall time from
start to the dumped page (start-up included, and the page's self-test: a hover and a zoom). Python's time is
render_html's alone. Needs chromium on PATH.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from memplan.planner.report.html_report import render_html
from memplan.planner.simulate.measure import measure, simulate_trace
from memplan.traces.format import Trace, load, make_trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from headless import find_browser, selftest  # noqa: E402  the browser test's driver

DATA = ROOT / "traces" / "data"
MODES = ("baseline", "selective", "tempo", "tempo+selective")


def tiled(trace: Trace, buffers: int) -> Trace:
    """`trace`'s recorded buffers repeated one step after another until there are `buffers` in all."""
    rec = np.nonzero(trace.alloc > 0)[0]
    resident = np.nonzero(trace.alloc == 0)[0]
    copies = -(-(buffers - len(resident)) // len(rec))
    span = int(trace.end)
    shift = np.repeat(np.arange(copies, dtype=np.int64) * span, len(rec))
    idx = np.tile(rec, copies)
    end = copies * span + 1
    free = np.where(trace.free[idx] >= trace.end, end - 1, trace.free[idx] + shift)  # never freed: to the end
    columns = {
        "size": np.concatenate((trace.size[resident], trace.size[idx])),
        "alloc": np.concatenate((trace.alloc[resident], trace.alloc[idx] + shift)),
        "free": np.concatenate((np.full(len(resident), end), free)),
    }
    for name in ("category", "phase", "op", "module"):
        col = getattr(trace, name)
        columns[name] = [col[i] for i in resident] + [col[i] for i in idx]
    return make_trace(columns, meta={"model": f"{trace.meta.get('model', 'trace')} x{copies}"})


def measure_page(name: str, page: str, browser: str, seconds: float) -> None:
    """Write the page, load it in the browser, print its size and load times."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.html"
        path.write_text(page, encoding="utf-8")
        seen, wall = selftest(browser, path, timeout=300)
    assert not seen["errors"], seen["errors"]
    print(
        f"{name}: {len(page.encode()) / 2**20:.2f} MiB, rendered by Python in {seconds:.1f} s; "
        f"in headless Chromium: page ready in {seen['load_ms'] / 1000:.2f} s, browser wall {wall:.2f} s "
        f"(start-up included); {sum(seen['drawn']):,} timeline points, {sum(seen['rects']):,} rectangles drawn"
    )


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buffers", type=int, default=1_000_000)
    ap.add_argument("--time-limit", type=float, default=2.0)
    args = ap.parse_args()
    browser = find_browser()
    if browser is None:
        sys.exit("no chromium on PATH: scripts/setup.sh installs it (as root)")

    traces = {m: load(DATA / f"bert_large_slice.b2s512.{m}.trace.json.gz") for m in MODES}
    reports = [measure(t, m, time_limit=args.time_limit) for m, t in traces.items()]
    solved = time.monotonic()
    page = render_html(reports, ["memplan run"])
    measure_page(f"main job's model ({len(MODES)} modes, plans)", page, browser, time.monotonic() - solved)

    big = tiled(traces["baseline"], args.buffers)
    measured = simulate_trace(big, "tiled")
    start = time.monotonic()
    page = render_html([measured], ["benchmarks/html_report.py"])
    measure_page(f"{len(big):,} buffers, {big.end:,} events", page, browser, time.monotonic() - start)


if __name__ == "__main__":
    main()
