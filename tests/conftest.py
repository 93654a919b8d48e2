"""Shared test set-up: single-threaded torch, and the ../shared data folder (skipped when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEMPLAN_SHARED", ROOT.parent / "shared"))


@pytest.fixture
def shared() -> Path:
    """The ../shared folder of real snapshots and benchmark instances; skips the test when absent."""
    if not SHARED.is_dir():
        pytest.skip(f"needs the shared data folder {SHARED} (absent in a fresh clone without it)")
    return SHARED
