"""Where a program branches on a value nobody knows: a scalar read from a fake tensor (`if loss.item() > x:`,
`bool(t)`, `assert not t.isnan()`) that decides a conditional jump in the program's own code.

The read is found at the nearest frame outside torch and memplan (the code that asked for the value); it is a branch
when that frame's bytecode, from the read on, meets a conditional jump before the value is stored, discarded or
returned (`print(loss.item())` and `x = loss.item()` are reads, not branches; a branch on `x` later is not seen).
"""

from __future__ import annotations

import bisect
import dis
import os
import sys
from types import CodeType, FrameType

LIBRARIES = frozenset({"torch", "memplan"})  # packages whose frames are not the program's (by module name)
# Instructions after which the value is no longer the one read: stored, discarded, returned, formatted into a string,
# handed to a call or put in a container (a jump after them tests something else: `f"{x.item()} {a if b else c}"`).
ENDS = frozenset({"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF", "STORE_ATTR", "STORE_SUBSCR", "POP_TOP",
                  "RETURN_VALUE", "RETURN_CONST", "YIELD_VALUE", "FORMAT_VALUE", "BUILD_STRING", "CALL", "PRECALL",
                  "CALL_FUNCTION_EX", "BUILD_LIST", "BUILD_TUPLE", "BUILD_SET", "BUILD_MAP", "LIST_APPEND",
                  "SET_ADD", "MAP_ADD"})  # fmt: skip
_instructions: dict[CodeType, tuple[list[int], list[str]]] = {}  # code -> its instructions' offsets and names


def _caller() -> FrameType | None:
    """The nearest frame outside torch's and memplan's own code."""
    frame = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] in LIBRARIES:
        frame = frame.f_back
    return frame


def _jumps_on(frame: FrameType) -> bool:
    """Whether the value the frame's current instruction produces meets a conditional jump before it is stored,
    discarded or returned."""
    code = frame.f_code
    if code not in _instructions:
        found = list(dis.get_instructions(code))
        _instructions[code] = ([i.offset for i in found], [i.opname for i in found])
    offsets, names = _instructions[code]
    start = bisect.bisect_right(offsets, frame.f_lasti) - 1  # f_lasti may point into the instruction's inline caches
    if start < 0:
        return False
    if _conditional(names[start]):  # `if t:`: the jump itself asked for the value
        return True
    for name in names[start + 1 :]:  # the call that read it (`.item()`, `float(t)`) done: what the value meets next
        if _conditional(name):
            return True
        if name in ENDS:
            return False
    return False


def _conditional(name: str) -> bool:
    """Whether an instruction jumps on the value it pops (POP_JUMP_IF_FALSE, POP_JUMP_FORWARD_IF_TRUE, ...)."""
    return "JUMP" in name and "IF" in name


def branch_site() -> str | None:
    """`file:line` of the program's code whose conditional jump the value read now decides; None for a plain read."""
    frame = _caller()
    if frame is None or not _jumps_on(frame):
        return None
    path = frame.f_code.co_filename
    relative = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{relative}:{frame.f_lineno}"
