"""Placement items: each contiguous group is one rigid block, every other free buffer its own item.

Fixed offsets are applied up front (a group with a fixed member is fixed as a whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.planner.problem import Problem


@dataclass
class Items:
    """m items in CSR form: members[start[k]:start[k+1]] at offsets rel[...] relative to the item's base."""

    start: np.ndarray  # int32, m + 1
    members: np.ndarray  # int32 buffer indices
    rel: np.ndarray  # int64 offset of each member inside its item
    size: np.ndarray  # int64 bytes of each item
    alloc: np.ndarray  # int64 earliest allocation among the members
    free: np.ndarray  # int64 latest time a member still blocks another stream (its free on one stream)

    def __len__(self) -> int:
        return len(self.size)


def make_items(p: Problem) -> tuple[Items, np.ndarray]:
    """(items to place, preset offsets with -1 for every buffer the items will place)."""
    preset = np.full(len(p), -1, dtype=np.int64)
    grouped = np.zeros(len(p), dtype=bool)
    blocks: list[list[int]] = []
    for members in p.groups:
        grouped[members] = True
        rel = np.concatenate([[0], np.cumsum(p.size[members])[:-1]]).astype(np.int64)
        pinned = [k for k, i in enumerate(members) if i in p.fixed]
        if pinned:
            base = p.fixed[members[pinned[0]]] - int(rel[pinned[0]])
            preset[members] = base + rel
        else:
            blocks.append(list(members))
    for i, off in p.fixed.items():
        if not grouped[i]:
            preset[i] = off
    singles = np.nonzero((preset < 0) & ~grouped)[0]  # every other buffer is an item of its own
    lengths = np.concatenate([np.array([len(b) for b in blocks], dtype=np.int64), np.ones(len(singles), np.int64)])
    members = np.concatenate([np.array([i for b in blocks for i in b], dtype=np.int64), singles]).astype(np.int32)
    start = np.zeros(len(lengths) + 1, dtype=np.int32)
    start[1:] = np.cumsum(lengths)
    sizes = p.size[members] if len(members) else np.zeros(0, dtype=np.int64)
    csum = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rel = (csum[:-1] - np.repeat(csum[start[:-1]], np.diff(start))).astype(np.int64)
    size = (csum[start[1:]] - csum[start[:-1]]).astype(np.int64)
    if len(lengths):
        alloc = np.minimum.reduceat(p.alloc[members], start[:-1]) if len(members) else np.zeros(0, np.int64)
        free = np.maximum.reduceat(p.release.max(axis=1)[members], start[:-1])
    else:
        alloc = free = np.zeros(0, dtype=np.int64)
    return Items(start, members, rel, size, alloc.astype(np.int64), free.astype(np.int64)), preset
