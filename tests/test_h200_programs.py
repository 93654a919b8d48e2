"""The whole-program verdict against real H200 runs at the edge of its memory (../shared/traces/h200-programs: an HF
Llama-3.2-1B-shaped training loop at sequence 4096, recorded from before the model was built). The program is rebuilt
here as examples/configs/llama-3.2-1b.json, traced on fake CUDA from this CPU, and judged on the H200 as the real run
had it: its total memory and the memory it measured outside the caching allocator. The real figures are read from
the folder's PROGRAMS.md, never written here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from memplan.gpus import gpu
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.verdict import Budget, OutsideTerm, judge
from memplan.step import StepSpec
from memplan.traces.inputs.trace_model import trace_step

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "llama-3.2-1b.json"
ROW = re.compile(r"^\| (llama1b_\S+\.pickle) \| (\d+) \| ([^|]+) \| ([^|]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$")


def programs(shared: Path) -> dict[int, dict]:
    """PROGRAMS.md's runs by batch: alloc conf, result, max allocated and reserved, the bytes outside the allocator;
    and the GPU's total memory and the out-of-memory error's text."""
    text = (shared / "traces" / "h200-programs" / "PROGRAMS.md").read_text()
    total = int(re.search(r"`total_memory` ([\d,]+) B", text).group(1).replace(",", ""))
    runs = {}
    for line in text.splitlines():
        match = ROW.match(line.strip())
        if match:
            name, batch, conf, result, allocated, reserved, outside = match.groups()
            runs[int(batch)] = {
                "conf": "" if conf.strip() == "(default)" else conf.strip(),
                "ran": result.strip() == "ran",
                "allocated": int(allocated.replace(",", "")),
                "reserved": int(reserved.replace(",", "")),
                "outside": int(outside.replace(",", "")),
                "total": total,
                "error": re.search(r'error: "(CUDA out of memory[^"]+)"', text.replace("\n", " ")).group(1),
            }
    assert set(runs) == {7, 8, 9}, "PROGRAMS.md's table changed"
    return runs


def verdict(batch: int, run: dict):
    """The fake H200 trace of the program at `batch`, judged on the H200 with the run's alloc conf and outside bytes."""
    step = StepSpec(str(CONFIG), batch=batch, seq=4096, dtype="bf16-mixed", fake=True).on_gpu("H200")
    trace = trace_step(step)
    h200 = gpu("H200")
    assert h200.memory == run["total"]  # the catalogue's H200 is the one the runs had
    budget = Budget(h200, (OutsideTerm("measured outside the allocator", run["outside"], "PROGRAMS.md"),))
    return trace, judge(trace, budget, parse_alloc_conf(run["conf"]), run["conf"])


@pytest.mark.slow
@pytest.mark.parametrize("batch", [7, 8])
def test_a_run_that_fit_the_h200_is_predicted_to_fit_with_its_peaks(shared, batch):
    """b7 (default allocator) and b8 (expandable segments) ran: the whole program fits, and the measured step's peak
    allocated and max reserved (after a reset before it) are the real ones within 0.1% and 1%."""
    run = programs(shared)[batch]
    trace, v = verdict(batch, run)
    assert run["ran"] and v.fits and v.program and v.steps == 2, v.oom
    assert abs(v.step_peak_allocated - run["allocated"]) <= 0.001 * run["allocated"]
    assert abs(v.step_peak_reserved - run["reserved"]) <= 0.01 * run["reserved"]


@pytest.mark.slow
def test_the_run_that_ran_out_of_memory_fails_at_the_same_request_with_pytorchs_figures(shared):
    """b9 with expandable segments ran out of memory: the verdict fails at the request PyTorch's error names, with
    its allocated and reserved-but-unallocated figures, in the first step (the one making AdamW's state)."""
    run = programs(shared)[9]
    trace, v = verdict(9, run)
    assert not run["ran"] and not v.fits and v.oom.where == "step 1"
    error = run["error"]
    for figure in ("Tried to allocate", "Of the allocated memory", "is reserved by PyTorch but unallocated"):
        said = re.search(re.escape(figure) + r" ([\d.]+ [KMG]iB)", error) or re.search(
            r"([\d.]+ [KMG]iB) " + re.escape(figure), error
        )
        assert said.group(1) in v.oom.message, (figure, v.oom.message)
    assert "GPU 0 has a total capacity of 139.80 GiB" in v.oom.message and "139.80 GiB" in error
