"""Progress of a long capture: a line every few seconds of wall time while a step is built and recorded.

A fake trace of a large model (a Mamba-1.4B shape) can run for minutes; without a word it looks hung.
While a capture runs, a background thread reads the recorder's counters (traces/recorder.py `progress`:
ops run, allocations and frees recorded, bytes live, the phase, the module of the latest allocation)
every MEMPLAN_PROGRESS_SECONDS (default 10) and hands one line to the caller's progress function (the
command line prints it on stderr, never on stdout, which carries --json). A capture shorter than the
interval says nothing.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType

from memplan.errors import MemplanError
from memplan.traces.recorder import Recorder
from memplan.units import human_bytes

INTERVAL_ENV = "MEMPLAN_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 10.0  # seconds between two lines


def progress_interval() -> float:
    """Seconds between two progress lines: $MEMPLAN_PROGRESS_SECONDS, else DEFAULT_INTERVAL; MemplanError for a
    value that is not a positive number."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise MemplanError(f"{INTERVAL_ENV}={text!r}: give a number of seconds above 0")
    return seconds


class CaptureProgress:
    """A context manager: while it is entered, a daemon thread reports the capture's progress every `interval`
    seconds through `report` (one line each)."""

    def __init__(self, recorder: Recorder, report: Callable[[str], None], interval: float):
        self._recorder, self._report, self._interval = recorder, report, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memplan capture progress", daemon=True)
        self._start = time.monotonic()
        self.stage = "preparing the step"  # what runs before the recorded step, as the capture announces it
        self._stepped = False  # whether the recorded step has begun
        self._events = 0  # the step's allocations and frees, as last seen while it ran

    def __enter__(self) -> CaptureProgress:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._report(self.line())

    def line(self) -> str:
        """The capture's state now, in one line: how long it has run, its stage, ops, events, bytes live, module."""
        p = self._recorder.progress()
        if p.stepping:
            self._stepped, self._events = True, p.events
        if p.stepping:
            stage = f"recording the step ({p.phase})"
        else:
            stage = "assembling the trace" if self._stepped else self.stage
        events = f", {self._events:,} allocations and frees recorded" if self._stepped else ""
        module = f", latest allocation in {p.module}" if p.module else ""
        return (
            f"still tracing after {time.monotonic() - self._start:.0f} s: {stage}; {p.ops:,} ops run{events}, "
            f"{human_bytes(p.live_bytes)} live{module}"
        )
