"""Which of a step's buffers are there to be communicated (trace category `communication`), beside a pipeline's
receive buffers (Workload.held); the `op` label says for which collective:

- FSDP2's all-gather and reduce-scatter buffers (`all_gather`, `reduce_scatter`): every one is made by its
  collective's `allocate` (FSDP2's `AllGather` and `ReduceScatter` comms, in
  torch.distributed.fsdp._fully_shard._fsdp_collectives), watched during the step; the allocation's time and
  storage name the buffer. A reduce-scatter output that FSDP2 views as the sharded gradient stays a gradient.
- DDP's gradient buckets (`all_reduce`): its reducer makes them in C++ (at construction, and again when it rebuilds
  them in the second step) and keeps them across steps, out of Python's reach; their sizes are in DDP's own logging
  data (`rebuilt_bucket_sizes` once rebuilt, else `bucket_sizes`), so the unnamed storages alive when the step
  begins with those sizes are the buckets.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memplan.traces.on_import import patched_on_import
from memplan.traces.recorder import Recorder

COMMUNICATION = "communication"
# what a communication buffer is for, in its `op` label (a pipeline's receive buffers are named by their module)
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
# FSDP2's allocators of collective buffers (its default, the process group's, symmetric memory's), in the module a
# program that shards with fully_shard loads: watched when it is imported, never imported by memplan (about 0.9 s
# more for every capture of a program that never uses FSDP2)
_FSDP_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
_FSDP_ALLOCATORS = ("DefaultAllocMixin", "ProcessGroupAllocMixin", "SymmMemAllocMixin")


@contextlib.contextmanager
def collective_buffers(recorder: Recorder, found: dict[int, tuple[int, str]]) -> Iterator[None]:
    """While the block runs, note each buffer FSDP2 allocates for an all-gather or a reduce-scatter in `found`:
    its allocation time (the step's events so far once it is made) -> its storage key and its collective
    (ALL_GATHER or REDUCE_SCATTER). FSDP2's allocators are watched from when its module is imported, before the
    block or inside it (traces/on_import.py)."""
    originals = {}

    def watched(allocate, all_gather: type):
        def allocate_and_note(self, *args, **kwargs):
            tensor = allocate(self, *args, **kwargs)
            if tensor.untyped_storage().nbytes() > 0:
                collective = ALL_GATHER if isinstance(self, all_gather) else REDUCE_SCATTER
                found[recorder.step_events()] = (recorder.storage_key(tensor), collective)
            return tensor

        return allocate_and_note

    def watch(fsdp_collectives: ModuleType) -> None:
        all_gather = fsdp_collectives.AllGather  # the all-gather protocol, as the module imports it
        for name in _FSDP_ALLOCATORS:
            owner = getattr(fsdp_collectives, name, None)
            if owner is not None and "allocate" in vars(owner) and owner not in originals:
                originals[owner] = owner.allocate
                owner.allocate = watched(owner.allocate, all_gather)

    try:
        with patched_on_import(_FSDP_COLLECTIVES, watch):
            yield
    finally:
        for owner, allocate in originals.items():
            owner.allocate = allocate


def ddp_buckets(model: nn.Module) -> list[tuple[int, str]]:
    """(bytes, module) of every gradient bucket of each DistributedDataParallel in `model`, as its logging data
    gives them now (after a step: the buckets it keeps)."""
    paths = {id(m): f"model.{path}" if path else "model" for path, m in model.named_modules()}
    buckets = []
    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            data = module._get_ddp_logging_data()
            sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
            buckets += [(int(size), paths[id(module)]) for size in str(sizes).split(",") if size.strip()]
    return buckets


def name_buckets(buffers: list, buckets: list[tuple[int, str]]) -> None:
    """Label as `communication` the last-made unnamed buffer alive at the start (`alloc` 0, category unknown) of each
    bucket's size, with the DDP module's path and the op ALL_REDUCE: the latest, as a real rank may still hold the
    buckets it replaced when it rebuilt them (a gloo thread's, released when that thread lets go)."""
    for size, module in buckets:
        for b in reversed(buffers):
            if b.alloc == 0 and b.category == "unknown" and b.size == size:
                b.category, b.module, b.op = COMMUNICATION, module, ALL_REDUCE
                break


# FSDP2's streams (its FSDPCommContext's attributes) and the names a trace's meta "streams" gives them
_FSDP_STREAMS = {
    "all_gather_copy_in_stream": "fsdp all-gather copy-in",
    "all_gather_stream": "fsdp all-gather",
    "reduce_scatter_stream": "fsdp reduce-scatter",
    "all_reduce_stream": "fsdp all-reduce",
}


def fsdp_stream_names(model: nn.Module) -> dict[int, str]:
    """The stream key (`cuda_stream`) -> name of each stream FSDP2 made for the modules of `model` sharded with
    fully_shard (traces/cuda/streams.py names a trace's streams by them); empty without FSDP2 or CUDA streams."""
    names: dict[int, str] = {}
    for module in model.modules() if _FSDP_COLLECTIVES in sys.modules else ():
        state = getattr(module, "_get_fsdp_state", None)
        context = getattr(state(), "_comm_ctx", None) if callable(state) else None
        for attribute, name in _FSDP_STREAMS.items():
            stream = getattr(context, attribute, None)
            key = getattr(stream, "cuda_stream", None)
            if isinstance(key, int) and key != 0:
                names.setdefault(key, name)
    return names
