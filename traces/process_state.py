"""What a script run in-process (`memplan check`) leaves in libraries' process-wide state, cleared when it ends, as
its own process's exit would: accelerate's AcceleratorState, PartialState and GradientState singletons (a second
script in the same process would otherwise find the first one's mixed precision and refuse its own)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def as_own_process() -> Iterator[None]:
    """Run the block, then clear the process-wide state the libraries it used keep."""
    try:
        yield
    finally:
        state = sys.modules.get("accelerate.state")
        if state is not None:
            state.AcceleratorState._reset_state(reset_partial_state=True)
            state.GradientState._reset_state()
