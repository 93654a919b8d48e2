"""What a recorded step read but its trace lacks: storages alive before recording began that no one adopted.

`record(model, optimizer)` adopts what the model, its optimizer and the inputs hold, and a model file's
workload is built while the recorder runs; any other tensor made before (a frozen reference model built
outside the `record` block, a tensor cached in a global at import) is invisible to the recorder, so the
trace's peak is low by its bytes. The recorder notes every such storage a step's op reads, once; this
module turns them into the trace's meta "unrecorded" (how many, how many bytes, the largest named by the
module parameter or buffer that holds them where one does) and the one sentence every view warns with.
The inverse tables memplan's own tempo activations share across the process (64 KiB per activation and
device, planner/layers/inverse.py) are left out: made once, no capture after the first can hold them.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from memplan.planner.layers.inverse import shared_tables
from memplan.traces.recorder import Unseen
from memplan.traces.resident import local_tensor
from memplan.units import human_bytes

LARGEST = 5  # how many of the missing storages are listed by name


class UnrecordedWarning(UserWarning):
    """`memplan.record`'s trace lacks storages its step read (made before the block and not passed to it)."""


@dataclass(frozen=True)
class MissingStorage:
    """One storage the step read and the trace lacks."""

    name: str  # the parameter or buffer holding it (ModuleClass.path.weight), or "" when no module holds it
    bytes: int
    op: str  # the op that read it first
    module: str  # the module (of the recorded model) running when it was first read, "" outside one


@dataclass(frozen=True)
class Unrecorded:
    """Storages alive before recording began that the step read and the trace lacks (trace meta "unrecorded")."""

    storages: int
    bytes: int
    largest: list[MissingStorage]

    def to_dict(self) -> dict:
        """The trace meta's "unrecorded" (and the JSON of the commands that show it)."""
        return asdict(self)


def module_tensor_names(keys: set[int], key: Callable[[torch.Tensor], int]) -> dict[int, str]:
    """Storage key -> the parameter or buffer that holds it, for the keys held by an nn.Module alive now: named from
    its outermost module, `ClassName.path.to.weight`. Walks the garbage collector's objects: called only when a
    trace lacks something."""
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), nn.Module)]  # type(): no __class__ property
    inner = {id(child) for m in modules for child in m.children()}
    names: dict[int, str] = {}
    for root in (m for m in modules if id(m) not in inner):
        tensors = (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False))
        for path, tensor in tensors:
            if tensor.layout != torch.strided:  # a sparse tensor has no one storage
                continue
            k = key(local_tensor(tensor))
            if k in keys and k not in names:
                names[k] = f"{type(root).__name__}.{path}"
    return names


def unrecorded(unseen: Unseen, labels: list[str], key: Callable[[torch.Tensor], int]) -> Unrecorded | None:
    """The recorder's unseen storages (but memplan's shared tables) as the trace's meta "unrecorded", the LARGEST
    named; None when it lacks none."""
    if not unseen.key:
        return None
    shared = {key(t) for t in shared_tables()}
    rows = [row for row in zip(unseen.key, unseen.size, unseen.op, unseen.module) if row[0] not in shared]
    if not rows:
        return None
    names = module_tensor_names({k for k, *_ in rows[:LARGEST]}, key)
    largest = [MissingStorage(names.get(k, ""), size, labels[op], labels[module]) for k, size, op, module in rows]
    return Unrecorded(len(rows), sum(size for _, size, _, _ in rows), largest[:LARGEST])


def unrecorded_text(missing: dict | None) -> str:
    """The sentence every view warns with for a trace's meta "unrecorded" (Unrecorded's dict): what the trace lacks
    and how to put it in; "" when it lacks nothing (None or {})."""
    if not missing:
        return ""
    named = ", ".join(
        f"{m['name'] or m['op'] + (' in ' + m['module'] if m['module'] else '')} {human_bytes(m['bytes'])}"
        for m in missing["largest"]
    )
    more = "" if missing["storages"] <= len(missing["largest"]) else ", ..."
    return (
        f"the step read {missing['storages']:,} storages ({human_bytes(missing['bytes'], grouped=True)}, "
        f"{missing['bytes']:,} bytes) made before recording began that this trace lacks, so its peak is low by up to "
        f"that much: {named}{more}. Make them inside the record block (or a model file's build()), or pass them to "
        "memplan.record (inputs=...)"
    )
