"""`memplan check --largest NAME`: the largest value of the script's own integer argument NAME (a batch size) whose
program fits the GPU. Each value is checked whole, in a process of its own (a program's run leaves state in its
process), starting from the value the command gives: doubled while it fits (halved while it does not) until the
answer is bracketed, then bisected. The answer is the program's, so whatever the script does with the value
(gradient accumulation, padding, a retry on out-of-memory) is in it."""

from __future__ import annotations

import dataclasses
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from memplan.planner.jobs.check import CheckOptions, CheckResult, checked_apart
from memplan.planner.jobs.check_script import CheckError

MOST = 1 << 20  # the largest value tried: past it, the search says so instead of doubling on


@dataclass(frozen=True)
class Trial:
    """One value checked."""

    value: int
    fits: bool
    peak_reserved: int
    headroom: int  # the GPU's memory less peak reserved and outside (negative: what is missing)
    failure: str | None  # where it ran out: op, phase and part of the program (None when it fits)


@dataclass
class SearchResult:
    """The largest value that fits, every value tried, and the check of the largest (or of the smallest tried when
    none fits)."""

    argument: str  # the option varied, as the command spells it
    largest: int | None = None  # None: not even the smallest value tried fits
    smallest_failing: int | None = None  # the next value up that was tried and ran out (None: none ran out up to MOST)
    trials: list[Trial] = field(default_factory=list)  # in the order tried
    monotone: bool = True  # no value that fits lies above one that ran out
    answer: CheckResult | None = None

    def to_dict(self) -> dict:
        """The JSON document of `memplan check --largest --json` (keys in docs/cli.md)."""
        return {
            "argument": self.argument,
            "largest": self.largest,
            "smallest_failing": self.smallest_failing,
            "trials": [dataclasses.asdict(t) for t in self.trials],
            "monotone": self.monotone,
            "answer": None if self.answer is None else self.answer.to_dict(),
        }


def varied(command: tuple[str, ...], name: str) -> tuple[str, int, Callable[[int], tuple[str, ...]]]:
    """The option `name` (`batch-size` or `--batch-size`; `_` and `-` alike) as the command spells it, the integer it
    gives, and the command with another value (CheckError when the command gives no integer to it)."""
    wanted = "--" + name.lstrip("-").replace("_", "-")
    spelled = [w.partition("=")[0].replace("_", "-") if w.startswith("--") else None for w in command]
    at = spelled.index(wanted) if wanted in spelled else None
    if at is None:
        raise CheckError(f"--largest {name}: the command gives no {wanted} VALUE to vary")
    option, equals, given = command[at].partition("=")
    if not equals:
        given = command[at + 1] if at + 1 < len(command) else ""
    if not re.fullmatch(r"\d+", given) or int(given) < 1:
        raise CheckError(f"--largest {name}: the command gives {option} {given or 'no value'}, not a whole number")
    head, tail = command[:at], command[at + (1 if equals else 2) :]

    def command_with(value: int) -> tuple[str, ...]:
        return (*head, f"{option}={value}", *tail) if equals else (*head, option, str(value), *tail)

    return option, int(given), command_with


def largest(options: CheckOptions, name: str, progress: Callable[[str], None] = lambda _: None) -> SearchResult:
    """The largest value of option `name` whose program fits `options.gpu`, searched from the command's value."""
    option, start, command_with = varied(options.command, name)
    extra = ["--nproc", str(options.nproc)] if options.nproc is not None else []
    result = SearchResult(option)
    checks: dict[int, CheckResult] = {}
    with tempfile.TemporaryDirectory(prefix=".memplan-largest-") as folder:

        def fits(value: int) -> bool:
            progress(f"checking {option} {value}")
            checked = checked_apart(options, Path(folder), f"value{value}", extra, f"{option} {value}: ",
                                    command=command_with(value))  # fmt: skip
            checks[value] = checked
            failure = None if checked.fits else _where(checked)
            result.trials.append(Trial(value, checked.fits, checked.peak_reserved, checked.headroom, failure))
            return checked.fits

        # 1. Bracket: double while the value fits, halve while it does not.
        low, high = (start, None) if fits(start) else (None, start)
        while low is not None and high is None and low < MOST:
            up = min(2 * low, MOST)
            low, high = (up, None) if fits(up) else (low, up)
        while high is not None and low is None and high > 1:
            down = high // 2
            low, high = (down, high) if fits(down) else (None, down)
        # 2. Bisect between the largest that fits and the smallest that ran out.
        while low is not None and high is not None and high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
    result.largest, result.smallest_failing = low, high
    result.monotone = not any(t.fits and high is not None and t.value > high for t in result.trials)
    result.answer = checks[low] if low is not None else checks[min(checks)]
    return result


def _where(checked: CheckResult) -> str:
    """Where a program that did not fit ran out: its op, phase and part of the program."""
    f = checked.failures[-1]
    return f"{f.op or 'an allocation'} in {f.phase}, {f.where}"
