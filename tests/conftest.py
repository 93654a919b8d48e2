"""Shared test set-up: single-threaded torch, and the ../shared data folder (skipped when absent)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from memplan.traces.cuda import fake_device

torch.set_num_threads(1)
# The tempo layers' fused kernels (planner/layers/fusion.py) compile with Inductor on first use in each process:
# on a fresh machine that made the suite minutes longer (12 architecture tests: 35 s fused, 10 s eager). The suite
# runs the eager math, the reference the fused kernels are checked against; tests/test_layers_fusion.py turns them
# on and checks that they agree with it and hold no more memory.
os.environ.setdefault("MEMPLAN_FUSED", "0")
# A worker runs many tests' backwards before a fake CUDA one: the autograd engine sizes its device queues at the
# first, so the fake CUDA device (traces/cuda/fake_device.py) must exist before it, as it does in memplan's commands.
fake_device.install()

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEMPLAN_SHARED", ROOT.parent / "shared"))


@pytest.fixture
def shared() -> Path:
    """The ../shared folder of real snapshots and benchmark instances; skips the test when absent."""
    if not SHARED.is_dir():
        pytest.skip(f"needs the shared data folder {SHARED} (absent in a fresh clone without it)")
    return SHARED


@pytest.fixture(scope="session")
def traced_ranks(tmp_path_factory):
    """Each rank's trace of a distributed step (tests/rank_traces.py), traced once a session (in each worker) for
    every test that asks for the same step, ranks and MEMPLAN_* settings."""
    from rank_traces import RankTraces

    return RankTraces(lambda: tmp_path_factory.mktemp("ranks"))


def pytest_collection_finish(session):
    """Moves everything alive after collection (torch, transformers, memplan and the test modules: ~370,000
    objects) out of the cycle collector's sight. Capture and replay collect garbage before and between steps
    (planner/replay/runner.py, traces/capture.py); each full collection walked every one of them, ~0.5 s, so a
    plan-serves case spent most of its time there. What tests make afterwards is collected as before; frozen
    objects are also out of gc.get_objects(), which capture walks for modules outside a workload, and none of them
    holds a storage a step records (tests build their models inside the test)."""
    gc.collect()
    gc.freeze()
