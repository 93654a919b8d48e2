"""Ranks alike by construction, for `memplan trace --nproc N --fake`: the classes of ranks proposed from what the
first traced rank's program builds, and the test that a class's witness traced the same step as its representative.

The first rank's program is watched while it builds (`watching`): every DeviceMesh it creates (its shape, dimension
names and rank grid) and every pipeline stage (its index, the number of stages and the ranks of its pipeline group).
Ranks that hold the same pipeline coordinate build the same stages (`propose`): one class each coordinate, read off
the mesh dimension whose line through the first rank is its pipeline group; with no pipeline, every rank is one
class. A proposal is only that: each class is traced by its first rank and its last (the witness, where uneven
shards, padding or ZeRO's partition would differ), and `same_step` decides whether the class stands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from memplan.traces.format import INT_COLUMNS, STR_COLUMNS, Trace


@dataclass(frozen=True)
class MeshRecord:
    """A DeviceMesh the program created: its shape, dimension names (None when unnamed) and ranks, row-major."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class StageRecord:
    """A pipeline stage the program built: its index, the number of stages, its pipeline group's ranks in order."""

    index: int
    count: int
    group: tuple[int, ...]


@dataclass
class Layout:
    """What one rank's program built that tells the ranks apart: its meshes and its pipeline stages."""

    rank: int
    world: int
    meshes: list[MeshRecord] = field(default_factory=list)
    stages: list[StageRecord] = field(default_factory=list)


def _mesh_init(original, layout: Layout):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        with unset_fake_temporarily():
            ranks = self.mesh.detach().cpu()
        names = tuple(self.mesh_dim_names) if self.mesh_dim_names else None
        layout.meshes.append(MeshRecord(tuple(ranks.shape), names, tuple(int(r) for r in ranks.flatten().tolist())))

    return __init__


def _stage_init(original, layout: Layout):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        group = self.group if self.group is not None else dist.group.WORLD
        layout.stages.append(StageRecord(self.stage_index, self.num_stages, tuple(dist.get_process_group_ranks(group))))

    return __init__


@contextlib.contextmanager
def watching(layout: Layout) -> Iterator[Layout]:
    """Record into `layout` every DeviceMesh and pipeline stage created inside the block (pipelining is imported
    here: a fake distributed capture imports it anyway)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    originals = [(DeviceMesh, DeviceMesh.__init__), (_PipelineStageBase, _PipelineStageBase.__init__)]
    DeviceMesh.__init__ = _mesh_init(DeviceMesh.__init__, layout)
    _PipelineStageBase.__init__ = _stage_init(_PipelineStageBase.__init__, layout)
    try:
        yield layout
    finally:
        for owner, init in originals:
            owner.__init__ = init


def _coordinates(layout: Layout, group: tuple[int, ...]) -> dict[int, int] | None:
    """Each rank's position in its pipeline group, read off a mesh over every rank whose line through the watched
    rank is that group (None when no mesh shows it)."""
    everyone = set(range(layout.world))
    for mesh in layout.meshes:
        if set(mesh.ranks) != everyone or len(mesh.ranks) != layout.world:
            continue
        grid = np.asarray(mesh.ranks).reshape(mesh.shape)
        here = tuple(int(i) for i in np.argwhere(grid == layout.rank)[0])
        for d in range(grid.ndim):
            line = grid[here[:d] + (slice(None),) + here[d + 1 :]]
            if tuple(int(r) for r in line) == group:
                positions = np.indices(grid.shape)[d]
                return {int(r): int(p) for r, p in zip(grid.flatten(), positions.flatten())}
    return None


def propose(layout: Layout) -> list[list[int]]:
    """The classes of ranks alike by construction, each sorted, ordered by their first rank: the ranks of one
    pipeline coordinate (every rank alone when the pipeline group is the world, or when no mesh over every rank
    shows the group), or every rank when the program built no pipeline stage."""
    world = list(range(layout.world))
    if not layout.stages:
        return [world]
    groups = {stage.group for stage in layout.stages}
    coordinates = _coordinates(layout, groups.pop()) if len(groups) == 1 else None
    if coordinates is None:
        return [[r] for r in world]
    classes: dict[int, list[int]] = {}
    for r in world:
        classes.setdefault(coordinates[r], []).append(r)
    return sorted(classes.values())


def same_step(a: Trace, b: Trace) -> bool:
    """Whether two ranks' traces are the same step buffer for buffer: every column (sizes, allocation and free
    times, streams, categories, phases, ops, modules; addresses aside) and the syncs."""
    if len(a) != len(b) or list(a.syncs) != list(b.syncs):
        return False
    columns = [c for c in INT_COLUMNS if c != "addr"]
    return all(np.array_equal(getattr(a, c), getattr(b, c)) for c in columns) and all(
        getattr(a, c) == getattr(b, c) for c in STR_COLUMNS
    )
