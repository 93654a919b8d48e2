"""A solve's budget in deterministic work, so that its answer does not depend on how busy the machine is.

`--time-limit T` buys the work this machine (2 cores, idle) does in WORK_SHARE x T seconds, counted in each
method's own deterministic unit: search and greedy steps (solvers/csrc/place.cpp counts them) and CP-SAT's
deterministic time, converted at rates measured here (benchmarks/solvers.py --calibrate prints them). The
wall clock T is a ceiling only: the answer changes only on a machine about 2x slower than this one is when
idle (1 / WORK_SHARE, less the wall time no work counts: starting each search's threads, Python between
the probes, a quarter of the work on MiniMalloc's D), where the ceiling strikes before the work is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

WORK_SHARE = 0.4  # the share of the time limit an idle machine needs for the whole budget
SEARCH_STEPS_PER_SECOND = 4.5e8  # exact-search steps, all threads together: 4.5e8-7.7e8 on long runs
GREEDY_STEPS_PER_SECOND = 3.0e7  # greedy placement steps, one thread: 1.1e7-9e7 measured
CPSAT_TIME_PER_SECOND = 0.1  # CP-SAT deterministic time, one worker: 0.09-0.21 measured


@dataclass
class Budget:
    """Work left, in seconds of this machine when idle, and the wall-clock ceiling."""

    seconds: float  # idle-machine seconds of work not yet spent
    deadline: float  # time.monotonic() at which every method stops, work left or not

    @classmethod
    def for_time_limit(cls, time_limit: float, start: float) -> Budget:
        """The budget that --time-limit buys, counted from `start` (time.monotonic())."""
        return cls(WORK_SHARE * time_limit, start + time_limit)

    def wall_left(self) -> float:
        """Seconds until the ceiling."""
        return max(self.deadline - time.monotonic(), 0.0)

    def exhausted(self, floor: float = 0.0) -> bool:
        """Whether the work left is down to `floor` (kept for the methods after this one) or the ceiling passed."""
        return self.seconds <= floor or self.wall_left() <= 0

    def search_steps(self, seconds: float, threads: int) -> int:
        """Each search thread's step limit for `seconds` of work."""
        return int(max(seconds, 0.0) * SEARCH_STEPS_PER_SECOND / threads)

    def greedy_steps(self, seconds: float) -> int:
        """Greedy steps for `seconds` of work."""
        return int(max(seconds, 0.0) * GREEDY_STEPS_PER_SECOND)

    def cpsat_time(self, seconds: float) -> float:
        """CP-SAT deterministic time for `seconds` of work."""
        return max(seconds, 0.0) * CPSAT_TIME_PER_SECOND

    def spend_search(self, steps: int) -> None:
        """Count search steps (all threads together) against the budget."""
        self.seconds -= steps / SEARCH_STEPS_PER_SECOND

    def spend_greedy(self, steps: int) -> None:
        """Count greedy steps against the budget."""
        self.seconds -= steps / GREEDY_STEPS_PER_SECOND

    def spend_cpsat(self, deterministic_time: float) -> None:
        """Count CP-SAT's deterministic time against the budget."""
        self.seconds -= deterministic_time / CPSAT_TIME_PER_SECOND
