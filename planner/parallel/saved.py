"""Bytes a forward pass keeps for backward, counted from autograd's saved tensors (one count per storage).

An accounting independent of the tracer: every tensor autograd saves (including those a custom
Function saves with save_for_backward) is seen through torch.autograd.graph.saved_tensors_hooks;
storages shared by several saved tensors count once and parameters do not count.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class SavedBytes:
    """Distinct storages saved for backward during one call: total bytes and bytes by dtype."""

    total: int = 0
    by_dtype: dict[str, int] = field(default_factory=dict)


def saved_for_backward(fn: Callable[[], object], exclude: nn.Module | None = None) -> tuple[object, SavedBytes]:
    """Run fn() and count the bytes autograd saves during it, leaving out `exclude`'s parameters."""
    skip = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()
    seen: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and storage.nbytes() > 0:
            seen[ptr] = (storage.nbytes(), str(t.dtype).replace("torch.", ""))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    result = SavedBytes()
    for nbytes, dtype in seen.values():
        result.total += nbytes
        result.by_dtype[dtype] = result.by_dtype.get(dtype, 0) + nbytes
    return out, result
