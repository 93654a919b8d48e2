"""Third-party tracebacks kept off the user's terminal during a fake capture: torch's fake tensor mode logs the
whole traceback of an op its meta kernel refused (16 lines for a router's top-4 of 2 experts) before raising the
same error, which memplan turns into one line. Records that carry a traceback from the loggers of the libraries a
capture drives (THIRD_PARTY) are dropped while the capture runs, unless MEMPLAN_VERBOSE asks for them (`memplan -v`);
every other record (their warnings, the program's own logging) is left alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

VERBOSE = "MEMPLAN_VERBOSE"  # set to anything but "" or "0": third-party tracebacks shown
THIRD_PARTY = ("torch", "transformers", "accelerate", "huggingface_hub")  # logger names (and their children)


def verbose() -> bool:
    """Whether the user asked for third-party tracebacks (MEMPLAN_VERBOSE set, as `memplan -v` sets it)."""
    return os.environ.get(VERBOSE, "").strip() not in ("", "0")


def _third_party(name: str) -> bool:
    """Whether a logger called `name` belongs to one of THIRD_PARTY's libraries."""
    return any(name == library or name.startswith(library + ".") for library in THIRD_PARTY)


def _without_tracebacks(handle: Callable) -> Callable:
    """Logger.handle that drops a third-party record carrying a traceback."""

    def handle_unless_traceback(self, record):
        if record.exc_info and _third_party(record.name):
            return None
        return handle(self, record)

    return handle_unless_traceback


def patches() -> Iterator[tuple[object, str, Callable]]:
    """(owner, name, replacement) for a capture: Logger.handle without third-party tracebacks; none when verbose."""
    if not verbose():
        yield logging.Logger, "handle", _without_tracebacks(logging.Logger.handle)
