"""A time limit on a block of a test: a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def within(seconds: float):
    """Raise TimeoutError in this thread when the block runs longer than `seconds` (a hang fails the test)."""

    def expire(_signum, _frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
