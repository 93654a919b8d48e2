"""A generated step-like trace of any size (a million buffers in about a second), for the tests and benchmarks
that need a large one: built with numpy and written straight to memplan-trace/1 JSON, no Python loop over its
buffers. One allocation every two events, log-normal sizes, geometric lifetimes (about 200 buffers live).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from memplan.traces.format import FORMAT


def step_like(n: int, seed: int = 0) -> dict[str, Any]:
    """The columns of `n` buffers: integer columns as int64 arrays, labels as lists."""
    rng = np.random.default_rng(seed)
    size = (rng.lognormal(11, 2.5, n).astype(np.int64) + 1).clip(1, 1 << 30)
    alloc = np.arange(1, n + 1, dtype=np.int64) * 2 - 1
    free = np.minimum(alloc + rng.geometric(1 / 200, n) * 2, 2 * n + 1)
    category = np.array(["activation", "temporary", "gradient"])[rng.integers(0, 3, n)].tolist()
    return {"size": size, "alloc": alloc, "free": free, "category": category, "op": ["aten::mm"] * n}


def write_trace(path: str | os.PathLike, columns: dict[str, Any]) -> None:
    """Write the columns as an uncompressed memplan-trace/1 file (memplan reads and checks it as any other)."""
    buffers = {name: col.tolist() if isinstance(col, np.ndarray) else col for name, col in columns.items()}
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "meta": {"model": "generated"}, "buffers": buffers}, f, separators=(",", ":"))
