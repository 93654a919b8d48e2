"""DTensor's sharding propagation under a fake capture: the fake tensors it makes to learn an op's output layout are
not the program's (a GPU allocates none), so a process's first FSDP2 program records what every later one does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "scripts" / "fsdp2_train.py"
TWICE = """
import torch
torch.set_num_threads(1)
from memplan.gpus import gpu
from memplan.planner.jobs.check import CheckOptions, check_program
command = ("python", {script!r}, "--hidden", "128", "--layers", "2", "--seq", "32", "--vocab", "512")
for _ in range(2):
    result = check_program(CheckOptions(command, gpu("H100"), steps=2, rank=(0, 2)))
    trace = result.program.trace
    print(len(trace), result.peak_allocated, sum(phase == "optimizer" for phase in trace.phase))
"""


@pytest.mark.slow
def test_the_first_fsdp2_program_of_a_process_records_what_later_ones_do():
    done = subprocess.run([sys.executable, "-c", TWICE.format(script=str(SCRIPT))], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.split("\n")[:2]
    assert first == second
