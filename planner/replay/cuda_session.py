"""The plan allocator behind CUDA: the plugin installed with CUDAPluggableAllocator before CUDA starts.

PyTorch cannot swap its CUDA allocator once CUDA is initialised, so `install_plugin()` must run
first in the process; from then on every CUDA allocation goes through memplan_malloc, served by the
plan inside an open step or adoption and by plain cudaMalloc outside one. Plans replay on device 0.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

import torch

from memplan.planner.layers import fusion
from memplan.planner.replay import build
from memplan.planner.replay.native import INVALID_PLAN, INVALID_PLAN_MESSAGE, create_plan, load_library, plan_stats
from memplan.planner.replay.schedule import ReplayError, Schedule

_installed: dict[str, ctypes.CDLL] = {}


def install_plugin() -> ctypes.CDLL:
    """Make the plan plugin PyTorch's CUDA allocator (once per process); returns its C interface."""
    if "lib" in _installed:
        return _installed["lib"]
    if not torch.cuda.is_available():
        build_kind = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ReplayError(f"--device cuda: no CUDA GPU is available (torch {torch.__version__}, {build_kind})")
    path = build.cuda_library()
    plugin = torch.cuda.memory.CUDAPluggableAllocator(str(path), "memplan_malloc", "memplan_free")
    try:
        torch.cuda.memory.change_current_allocator(plugin)
    except RuntimeError:
        raise ReplayError(
            "CUDA was initialised before the plan allocator could be installed: replay in a fresh process"
        ) from None
    _installed["lib"] = load_library(path)
    return _installed["lib"]


class CUDAPlanAllocator:
    """One plan's arena on device 0, with the same interface as CPUPlanAllocator."""

    def __init__(self, lib: ctypes.CDLL, schedule: Schedule):
        self.lib = lib
        self.schedule = schedule
        self.handle = 0
        self.arena_base = 0  # address of the arena's first byte while the plan is alive
        self.final_stats: dict[str, int] | None = None

    def __enter__(self) -> CUDAPlanAllocator:
        s = self.schedule
        torch.cuda.set_device(0)
        self.handle = create_plan(
            self.lib, s.offsets, s.sizes, s.reserved_offsets, s.reserved_sizes, s.arena, s.alignment
        )
        if self.handle == INVALID_PLAN:
            raise ReplayError(INVALID_PLAN_MESSAGE)
        if self.handle == 0:
            raise ReplayError(f"cannot allocate an arena of {s.arena} bytes on cuda:0")
        self.arena_base = self.lib.memplan_plan_arena(self.handle) or 0
        return self

    def step(self):
        """The block inside is one planned step (its kernels finished before the step closes)."""
        return self._open(self.lib.memplan_step_begin, self.lib.memplan_step_end, torch.cuda.synchronize)

    def adopt(self):
        """Allocations in the block inside take the reserved slots of their exact size."""
        return self._open(self.lib.memplan_adopt_begin, self.lib.memplan_adopt_end)

    @contextmanager
    def _open(self, begin, end, before_end=lambda: None):
        if not begin(self.handle):
            raise ReplayError("a planned step or adoption is already open")
        try:
            with fusion.eager():  # the eager math, as the trace recorded it (planner/layers/fusion.py)
                yield
        finally:
            before_end()
            end(self.handle)

    def stats(self) -> dict[str, int]:
        return dict(self.final_stats) if self.final_stats is not None else plan_stats(self.lib, self.handle)

    def __exit__(self, *exc) -> None:
        self.final_stats = self.stats()
        self.lib.memplan_plan_release(self.handle)
