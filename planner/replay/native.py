"""ctypes access to the plan allocator's C interface (the core library and the CUDA plugin)."""

from __future__ import annotations

import ctypes
from pathlib import Path

# PlanStats' fields, in the order memplan_plan_stats writes them (see csrc/plan_core.h).
STATS_FIELDS = (
    "arena_bytes",
    "adopted_count",
    "adopted_bytes",
    "planned_count",
    "fallback_count",
    "fallback_bytes",
    "fallback_peak",
    "refused_in_use",
    "size_mismatch",
    "extra",
    "no_slot",
    "missing",
    "arena_top_peak",
    "held_peak",
    "steps",
    "live_blocks",
)

INVALID_PLAN = -1  # what plan creation returns for a plan whose slots do not fit its arena (csrc/c_api.h)
INVALID_PLAN_MESSAGE = (
    "the plan allocator refused the plan: a slot (offset, size rounded up to the alignment) does not end inside "
    "the arena, or its bounds overflow 64 bits"
)
_I64 = ctypes.c_int64
_P = ctypes.POINTER(ctypes.c_int64)


def load_library(path: str | Path) -> ctypes.CDLL:
    """Open a library exporting the C interface and declare its signatures."""
    lib = ctypes.CDLL(str(path))
    lib.memplan_stats_fields.restype = _I64
    lib.memplan_plan_create.restype = _I64
    lib.memplan_plan_create.argtypes = [_P, _P, _I64, _P, _P, _I64, _I64, _I64]
    lib.memplan_step_begin.argtypes = [_I64]
    lib.memplan_step_end.argtypes = [_I64]
    lib.memplan_adopt_begin.argtypes = [_I64]
    lib.memplan_adopt_end.argtypes = [_I64]
    lib.memplan_alloc.restype = ctypes.c_void_p
    lib.memplan_alloc.argtypes = [_I64]
    lib.memplan_dealloc.argtypes = [ctypes.c_void_p]
    lib.memplan_plan_stats.argtypes = [_I64, _P]
    lib.memplan_plan_arena.restype = ctypes.c_void_p
    lib.memplan_plan_arena.argtypes = [_I64]
    lib.memplan_plan_release.argtypes = [_I64]
    lib.memplan_plans_alive.restype = _I64
    if lib.memplan_stats_fields() != len(STATS_FIELDS):
        raise RuntimeError(f"{path}: reports {lib.memplan_stats_fields()} counters, expected {len(STATS_FIELDS)}")
    return lib


def _array(values) -> ctypes.Array:
    values = [int(v) for v in values]
    return (ctypes.c_int64 * max(len(values), 1))(*values)


def create_plan(
    lib: ctypes.CDLL, offsets, sizes, reserved_offsets=(), reserved_sizes=(), arena_bytes=0, alignment=1
) -> int:
    """A plan handle (> 0) over a new arena; 0 when the arena cannot be allocated, INVALID_PLAN (-1) when a slot
    does not end inside the arena or its bounds overflow 64 bits (csrc/c_api.h)."""
    return lib.memplan_plan_create(
        _array(offsets),
        _array(sizes),
        len(sizes),
        _array(reserved_offsets),
        _array(reserved_sizes),
        len(reserved_sizes),
        int(arena_bytes),
        int(alignment),
    )


def plan_stats(lib: ctypes.CDLL, handle: int) -> dict[str, int]:
    """The plan's counters by name."""
    out = (ctypes.c_int64 * len(STATS_FIELDS))()
    if not lib.memplan_plan_stats(handle, out):
        raise KeyError(f"unknown plan handle {handle}")
    return dict(zip(STATS_FIELDS, (int(v) for v in out)))
