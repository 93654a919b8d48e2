"""Shared test set-up: single-threaded torch, and the ../shared data folder (skipped when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from memplan.traces import fake_cuda

torch.set_num_threads(1)
# A worker runs many tests' backwards before a fake CUDA one: the autograd engine sizes its device queues at the
# first, so the fake CUDA device (traces/fake_cuda.py) must exist before it, as it does in memplan's commands.
fake_cuda.install()

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEMPLAN_SHARED", ROOT.parent / "shared"))


@pytest.fixture
def shared() -> Path:
    """The ../shared folder of real snapshots and benchmark instances; skips the test when absent."""
    if not SHARED.is_dir():
        pytest.skip(f"needs the shared data folder {SHARED} (absent in a fresh clone without it)")
    return SHARED
