"""A script that spawns its own ranks (`torch.multiprocessing.spawn` / `start_processes`) under `memplan check --nproc
N`: each rank is a process memplan starts, so the script's spawn runs this rank's function here instead of starting
processes (its process index 0: each rank is on its own node's one fake GPU, as with a launcher's LOCAL_RANK 0;
torch.distributed gives the rank)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch.multiprocessing as mp

from memplan.errors import MemplanError
from memplan.traces.patches import patched

mp_spawn = importlib.import_module("torch.multiprocessing.spawn")  # the module (the package's `spawn` is its function)


class SpawnError(MemplanError):
    """A script that spawns a number of ranks memplan was not told (`--nproc` missing or different)."""


class _Joined:
    """What `start_processes(..., join=False)` returns, for a rank that has already run: joining it is done."""

    @property
    def processes(self) -> list:
        """No process was started."""
        return []

    def join(self, timeout=None, grace_period=None) -> bool:
        """Every process has finished (the one rank ran in this process)."""
        return True

    def pids(self) -> list[int]:
        """No process was started."""
        return []


@contextlib.contextmanager
def spawned_here(world: int | None) -> Iterator[None]:
    """While a checked script runs: its spawn of `world` ranks runs the rank's function in this process; a spawn of
    another number (or any spawn when `world` is None) is a SpawnError naming the number to give."""

    def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        if nprocs != world:
            given = f" (--nproc {world} was given)" if world is not None else ""
            raise SpawnError(f"this script spawns {nprocs} ranks; give --nproc {nprocs}{given}")
        fn(0, *args)
        return None if join else _Joined()

    def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        return start_processes(fn, args, nprocs, join, daemon, start_method)

    with patched(*((owner, name, spawn if name == "spawn" else start_processes)
                   for owner in (mp, mp_spawn) for name in ("spawn", "start_processes"))):  # fmt: skip
        yield
