"""Range maxima over a time profile, used to rank buffers by the pressure over their lifetime."""

from __future__ import annotations

import numpy as np


def range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(values[lo[k]:hi[k]]) for every k (0 for empty ranges), via a sparse table."""
    out = np.zeros(len(lo), dtype=values.dtype)
    if len(values) == 0:
        return out
    table = [values]
    k = 1
    while 2 * k <= len(values):
        prev = table[-1]
        table.append(np.maximum(prev[:-k], prev[k:]))
        k *= 2
    width = hi - lo
    ok = width > 0
    level = np.zeros(len(lo), dtype=np.int64)
    level[ok] = np.floor(np.log2(width[ok])).astype(np.int64)
    for lv in np.unique(level[ok]):
        sel = np.nonzero(ok & (level == lv))[0]
        t = table[lv]
        out[sel] = np.maximum(t[lo[sel]], t[hi[sel] - (1 << int(lv))])
    return out
