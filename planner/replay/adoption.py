"""Adoption: move the storages that exist for the whole step into the arena slots the plan gave them.

After the warm-up step (it creates the optimizer state), every resident storage on the replay device
(parameters, optimizer state, inputs, in traces/resident.py's order) asks for a block of its size
while the adoption is open; the plan allocator hands it the reserved slot of that exact size. Its
bytes are copied and every tensor on the old storage is re-pointed to the new one, so values stay
bitwise the same and the old storage is freed. A storage asks only while the plan has a slot of its
size left (none for another shape, none for a plan of scope `step`), so nothing is allocated in vain;
one that gets no slot stays where it is.
"""

from __future__ import annotations

import gc
from collections import Counter

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.traces.inputs.workload import Workload
from memplan.traces.resident import resident_tensors


def resident_groups(workload: Workload, device_type: str) -> list[list[torch.Tensor]]:
    """The workload's resident tensors on `device_type` grouped by storage, storages in first-seen order.

    A view's base tensor joins its group: the view keeps it alive, and with it the storage.
    """
    groups: dict[int, list[torch.Tensor]] = {}
    for t, _, _ in resident_tensors(workload, device_type):
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        group = groups.setdefault(storage.data_ptr(), [])
        group.append(t)
        if t._base is not None and t._base.untyped_storage().data_ptr() == storage.data_ptr():
            group.append(t._base)
    return list(groups.values())


def _move(tensors: list[torch.Tensor], new: torch.UntypedStorage) -> StorageWeakRef:
    """Copy the tensors' storage into `new` and re-point every tensor to it; a weak reference to the old one."""
    old = tensors[0].untyped_storage()
    new.copy_(old)
    with torch.no_grad():
        for t in tensors:
            t.set_(new, t.storage_offset(), t.size(), t.stride())
    return StorageWeakRef(old)


def adopt_resident(workload: Workload, alloc, device_type: str) -> int:
    """Move the workload's resident storages into `alloc`'s arena (a CPUPlanAllocator or CUDAPlanAllocator
    inside its context); returns the bytes of resident storages still held outside the arena.

    Outside are the storages that got no slot, and any old storage something else still holds (a view
    the workload does not expose), which keeps its bytes alive next to the arena's copy.
    """
    groups = resident_groups(workload, device_type)
    sizes = [g[0].untyped_storage().nbytes() for g in groups]
    left = Counter(alloc.schedule.reserved_sizes)  # slots not asked for yet, by size
    asks = []
    for size in sizes:
        asks.append(left[size] > 0)
        left[size] -= asks[-1]
    with alloc.adopt():
        fresh = [
            torch.empty(size, dtype=torch.uint8, device=g[0].device).untyped_storage() if ask else None
            for g, size, ask in zip(groups, sizes, asks)
        ]
    begin, end = alloc.arena_base, alloc.arena_base + alloc.schedule.arena
    fresh = [s if s is not None and begin <= s.data_ptr() < end else None for s in fresh]  # fallbacks freed now
    old = [_move(g, s) if s is not None else None for g, s in zip(groups, fresh)]
    del groups, fresh
    gc.collect()
    return sum(size for size, ref in zip(sizes, old) if ref is None or not ref.expired())
