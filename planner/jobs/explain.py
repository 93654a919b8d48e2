"""`memplan explain`: a post-mortem of a real CUDA memory snapshot. For one that ends in an out-of-memory error: the
failure with PyTorch's figures, what was live then, how much was reserved but of no use to the request, and which
allocator changes would have got the program past it, each checked by simulating the program (the snapshot's
imported trace with its failed request) with the change. For one that does not: its peak and the headroom on a GPU.
planner/report/explain_text.py renders it.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np

from memplan.errors import MemplanError
from memplan.gpus import GPU
from memplan.modes import ADAMW_8BIT, FULL, FUSED, SELECTIVE
from memplan.planner.simulate.alloc_conf import AllocConf, conf_from_snapshot_settings
from memplan.planner.simulate.caching_allocator import SimResult, allocation_size, simulate_caching
from memplan.planner.simulate.snapshot_check import ProgramCheck, capacity_at_oom, check_program, oom_entries
from memplan.planner.simulate.verdict import trace_budget
from memplan.traces.format import Trace
from memplan.traces.inputs.snapshot import read_snapshot_trace, with_failed_requests
from memplan.units import MiB

TOP = 8  # ops listed by name among the live bytes; the rest are summed
LARGEST = 5  # the largest live buffers listed
GC_THRESHOLD = 0.8  # the garbage_collection_threshold tried (PyTorch's docs' example)
MAX_SPLIT_MB = 512  # the max_split_size_mb tried
# Allocator changes tried on the snapshot's own program: (PYTORCH_CUDA_ALLOC_CONF fragment, AllocConf fields).
ALLOCATOR_CHANGES = (
    ("expandable_segments:True", {"expandable_segments": True}),
    (f"garbage_collection_threshold:{GC_THRESHOLD}", {"garbage_collection_threshold": GC_THRESHOLD}),
    (f"max_split_size_mb:{MAX_SPLIT_MB}", {"max_split_size": MAX_SPLIT_MB * MiB}),
)
WHOLE_GPU = "the whole GPU"  # the change of capacity: the GPU's memory less this process's own outside terms
# Changes a snapshot cannot be re-run with (it holds allocations, not the model), with the command that checks them.
NEEDS_MODEL = (  # {device}: --gpu NAME or --memory BYTES
    ("a smaller batch", "memplan fit MODEL {device}"),
    (
        "a layer mode (recomputation, Tempo's layers)",
        f"memplan fit MODEL {{device}} --layers {SELECTIVE} --layers {FULL}",
    ),
    ("the fused loss (no whole logits)", f"memplan fit MODEL {{device}} --loss {FUSED}"),
    ("a smaller optimizer state", f"memplan fit MODEL {{device}} --optimizer {ADAMW_8BIT}"),
    ("all of them, layer by layer", "memplan optimize MODEL {device} --batch B --actions"),
)


class ExplainError(MemplanError):
    """Options `memplan explain` cannot work with."""


@dataclass(frozen=True)
class Group:
    """Bytes live at one moment with one label (a category, a phase, an op)."""

    name: str
    bytes: int
    buffers: int


@dataclass(frozen=True)
class LiveBuffer:
    """One of the largest buffers live at that moment."""

    size: int
    op: str
    phase: str
    category: str
    alloc: int  # its logical allocation time; 0: allocated before recording began


@dataclass(frozen=True)
class Live:
    """What was live at one logical time, by label: requested bytes (the allocator's blocks round them up)."""

    time: int
    bytes: int
    buffers: int
    by_category: list[Group]
    by_phase: list[Group]
    by_op: list[Group]  # the TOP largest ops, then "(other ops)", then "(no op)" for buffers without one
    largest: list[LiveBuffer]
    op_bytes: int  # of `bytes`, those whose op the snapshot names (frames were recorded)
    category_bytes: int  # of `bytes`, those with a known category (a snapshot memplan exported)


@dataclass(frozen=True)
class Failure:
    """An out-of-memory error as PyTorch raised it, with the figures of its message."""

    entry: int  # the `oom` entry's index in the device's trace
    time: int  # its logical time in the imported trace
    time_us: int
    request: int  # the request, rounded as the allocator rounds it
    tried: int  # "Tried to allocate": the segment size PyTorch asked for (the request, 2 MiB-rounded or 2/20 MiB)
    stream: int
    op: str  # where the request came from, when the snapshot has frames
    device_free: int  # cudaMemGetInfo's free bytes then
    total: int | None  # the GPU's memory (--gpu or --memory), None when not given
    reserved: int  # the allocator's reserved bytes then, its retries done (the snapshot's segment entries)
    allocated: int  # its allocated bytes then (the simulation)
    largest_free: int  # the largest cached block the request could have used (the simulation)
    reproduced: bool  # the simulation failed at this request with the same reserved bytes
    ooms: int  # the snapshot's out-of-memory errors: this is the first
    allocations_after: int  # allocations the program made after it (0: the snapshot ends in it)

    @property
    def cached(self) -> int:
        """Reserved but unallocated: cached by the allocator and of no use to the request."""
        return self.reserved - self.allocated


@dataclass(frozen=True)
class Change:
    """The program simulated with one change: whether it gets past the failure (or runs, without one)."""

    change: str  # a PYTORCH_CUDA_ALLOC_CONF fragment, or WHOLE_GPU
    kind: str  # "alloc_conf" (the allocator's settings changed) or "capacity" (its memory)
    capacity: int  # the allocator's capacity simulated
    runs: bool  # every request served, the failed ones included
    peak_reserved: int
    failed_request: int | None  # the first request it could not serve
    failed_at_same: bool  # that request is the snapshot's failed one (not an earlier one)
    failed_op: str  # the op of that request ("" when unknown)


@dataclass(frozen=True)
class Explanation:
    """`memplan explain`'s data (its --json; keys in docs/cli.md)."""

    snapshot: str
    cuda_device: int
    alloc_conf: str  # PYTORCH_CUDA_ALLOC_CONF as the snapshot recorded it
    from_start: bool  # recorded from the program's first allocation
    buffers: int
    before_recording: int  # buffers allocated before recording began (a snapshot of a ring buffer or a step)
    peak_live: int  # the most requested bytes live at once
    max_reserved: int  # the most the snapshot's own segment entries reserved (up to its first error)
    gpu: str | None  # the catalogue's name with --gpu
    memory: int | None  # the GPU's memory (--gpu or --memory)
    outside: int | None  # what this process holds outside the allocator (--outside, else the GPU's estimate)
    outside_source: str
    capacity: int | None  # the capacity simulated: as it ran (an error), or memory - outside
    headroom: int | None  # without an error: capacity - max_reserved
    check: dict  # ProgramCheck.summary(): the simulation against the snapshot's own figures
    oom: Failure | None
    live: Live  # at the failure, else at the peak of live bytes
    changes: list[Change] = field(default_factory=list)
    already: list[str] = field(default_factory=list)  # ALLOCATOR_CHANGES the snapshot's alloc conf has already
    needs_model: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The JSON document (Failure's `cached` included)."""
        d = asdict(self)
        if self.oom is not None:
            d["oom"]["cached"] = self.oom.cached
        return d


def _groups(keys: list[str], sizes: np.ndarray, top: int | None = None) -> list[Group]:
    """Bytes and buffers per label, largest first; past `top` labels, the rest as one '(other ops)' group."""
    total: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for key, size in zip(keys, sizes.tolist()):
        total[key] += size
        count[key] += 1
    named = sorted((k for k in total if k), key=lambda k: (-total[k], k))
    groups = [Group(k, total[k], count[k]) for k in (named if top is None else named[:top])]
    if top is not None and len(named) > top:
        rest = named[top:]
        groups.append(Group("(other ops)", sum(total[k] for k in rest), sum(count[k] for k in rest)))
    if "" in total:
        groups.append(Group("(no op)" if top is not None else "", total[""], count[""]))
    return groups


def live_at(trace: Trace, t: int) -> Live:
    """What was live at logical time `t`, by category, phase and op, and the largest buffers."""
    idx = trace.live_at(t)
    sizes = trace.size[idx]
    ops = [trace.op[i] for i in idx]
    cats = [trace.category[i] for i in idx]
    order = idx[np.argsort(-trace.size[idx], kind="stable")][:LARGEST]
    largest = [LiveBuffer(int(trace.size[i]), trace.op[i], trace.phase[i], trace.category[i], int(trace.alloc[i]))
               for i in order]  # fmt: skip
    return Live(
        time=t,
        bytes=int(sizes.sum()),
        buffers=len(idx),
        by_category=_groups(cats, sizes),
        by_phase=_groups([trace.phase[i] for i in idx], sizes),
        by_op=_groups(ops, sizes, TOP),
        largest=largest,
        op_bytes=int(sum(s for s, o in zip(sizes.tolist(), ops) if o)),
        category_bytes=int(sum(s for s, c in zip(sizes.tolist(), cats) if c != "unknown")),
    )


def _change(name: str, sim: SimResult, program: Trace, requests: list[int], capacity: int) -> Change:
    oom = sim.oom
    return Change(
        change=name,
        kind="capacity" if name == WHOLE_GPU else "alloc_conf",
        capacity=capacity,
        runs=oom is None,
        peak_reserved=sim.peak_reserved,
        failed_request=None if oom is None else oom.size,
        failed_at_same=oom is not None and oom.buffer in requests,
        failed_op="" if oom is None else program.op[oom.buffer],
    )


def allocator_changes(conf: AllocConf) -> list[tuple[str, AllocConf]]:
    """The ALLOCATOR_CHANGES `conf` does not have already, each as the conf with it."""
    out = []
    for name, fields in ALLOCATOR_CHANGES:
        if any(getattr(conf, k) != v for k, v in fields.items()):
            out.append((name, dataclasses.replace(conf, **fields)))
    return out


def own_outside(gpu: GPU | None, memory: int | None, outside: int | None, trace: Trace) -> tuple[int | None, str]:
    """What this process holds outside the allocator: `outside` when given; else the GPU's estimated terms for an
    imported trace (its CUDA context: a real trace holds its cuBLAS workspaces); else 0 beside --memory."""
    if outside is not None:
        return outside, "--outside"
    if gpu is not None:
        budget = trace_budget(gpu, trace)
        return budget.outside_bytes, "; ".join(f"{t.name}: {t.source}" for t in budget.outside)
    if memory is not None:
        return 0, "--memory is the allocator's capacity unless --outside says what else the GPU holds"
    return None, ""


def explain_snapshot(path: str | os.PathLike, gpu: GPU | None = None, memory: int | None = None,
                     outside: int | None = None, cuda_device: int | None = None) -> Explanation:  # fmt: skip
    """Explain a CUDA memory snapshot: its out-of-memory error, what was live, and the allocator changes that would
    have let it run, each simulated; or, without an error, its peak and headroom on `gpu` (or `memory` bytes)."""
    if gpu is not None and memory is not None:
        raise ExplainError("give the GPU as --gpu NAME or its memory as --memory SIZE, not both")
    if outside is not None and outside < 0:
        raise ExplainError(f"--outside {outside}: a number of bytes, not negative")
    snap, trace = read_snapshot_trace(path, cuda_device)
    total = gpu.memory if gpu is not None else memory
    own, source = own_outside(gpu, memory, outside, trace)
    if total is not None and own is not None and own >= total:
        raise ExplainError(f"--outside {own:,} B leaves the allocator nothing of the GPU's {total:,} B")
    full = None if total is None or own is None else total - own
    conf = conf_from_snapshot_settings(snap.settings)
    as_ran = capacity_at_oom(snap)
    capacity = as_ran if as_ran is not None else full
    check: ProgramCheck = check_program(snap, capacity, conf, trace)
    program, requests = with_failed_requests(trace)
    base = dict(
        snapshot=os.path.basename(os.fspath(path)),
        cuda_device=snap.device,
        alloc_conf=trace.meta.get("alloc_conf", ""),
        from_start=check.from_start,
        buffers=len(trace),
        before_recording=int((trace.alloc == 0).sum()),
        peak_live=trace.peak()[0],
        max_reserved=check.real_max_reserved,
        gpu=gpu.name if gpu is not None else None,
        memory=total,
        outside=own,
        outside_source=source,
        capacity=capacity,
        check=check.summary(),
    )
    if as_ran is None:  # no error: the peak, and the headroom on the GPU
        return Explanation(**base, headroom=None if full is None else full - check.real_max_reserved, oom=None,
                           live=live_at(trace, trace.peak()[1]))  # fmt: skip
    entries = oom_entries(snap)
    first = trace.meta["ooms"][0]
    device = f"--gpu {gpu.name}" if gpu is not None else f"--memory {total}" if total is not None else "--gpu GPU"
    sim = check.simulated
    if check.fails_at_the_same_request:
        allocated, largest = sim.oom.allocated, sim.oom.largest_free
    else:  # the simulation did not fail there: the allocator's allocated bytes before it, from an empty cache
        allocated, largest = int(simulate_caching(trace, conf).allocated[first["time"]]), 0
    failure = Failure(
        entry=first["entry"],
        time=first["time"],
        time_us=first["time_us"],
        request=first["size"],
        tried=allocation_size(first["size"]),
        stream=first["stream"],
        op=first["op"],
        device_free=first["device_free"],
        total=total,
        reserved=check.real_oom_reserved,
        allocated=allocated,
        largest_free=largest,
        reproduced=check.fails_at_the_same_request,
        ooms=len(entries),
        allocations_after=sum(1 for e in snap.entries[entries[0] + 1 :] if e.action == "alloc"),
    )
    changes = [_change(name, simulate_caching(program, changed, as_ran), program, requests, as_ran)
               for name, changed in allocator_changes(conf)]  # fmt: skip
    if full is not None and full > as_ran:
        changes.append(_change(WHOLE_GPU, simulate_caching(program, conf, full), program, requests, full))
    return Explanation(
        **base,
        headroom=None,
        oom=failure,
        live=live_at(trace, first["time"]),
        changes=changes,
        already=[name for name, _ in ALLOCATOR_CHANGES if name not in {c.change for c in changes}],
        needs_model=[{"change": what, "command": command.format(device=device)} for what, command in NEEDS_MODEL],
    )
