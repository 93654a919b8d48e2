"""The whole-program snapshots of ../shared/traces/h200-programs (one HuggingFace Llama-3.2-1B training loop at
sequence 4096 on an H200, recorded from before the model was built; PROGRAMS.md) imported and simulated from an
empty cache at the H200's memory less what the process held outside the allocator: the simulation's max reserved
is the real one to the byte, and where the real run ran out of memory the simulation fails at the same request with
PyTorch's figures. Every expected figure is read from PROGRAMS.md, as measured on the GPU."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.planner.simulate.snapshot_check import SEGMENT_CHANGE, capacity_at_oom, check_program
from memplan.traces.format import load
from memplan.traces.inputs.snapshot import load_plain_pickle, read_snapshot
from memplan.units import torch_size

FOLDER = "traces/h200-programs"
SHRINKS = {action for action, sign in SEGMENT_CHANGE.items() if sign < 0}  # segment_free, segment_unmap


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def programs(shared) -> dict:
    """PROGRAMS.md's facts: the GPU's total_memory, each run's row of its table, and the out-of-memory message."""
    text = (shared / FOLDER / "PROGRAMS.md").read_text()
    total = _number(re.search(r"`total_memory` ([\d,]+) B", text).group(1))
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].endswith(".pickle"):
            rows[cells[0].removesuffix(".pickle")] = {
                "result": cells[3],
                "max_allocated": _number(cells[4]),
                "max_reserved": _number(cells[5]),
                "outside": _number(cells[6]),
            }
    message = re.search(r'error: "(CUDA out of memory\..*?unallocated\.)"', " ".join(text.split())).group(1)
    return {"total": total, "runs": rows, "message": message}


RUNS = ("llama1b_s4096_b7_default", "llama1b_s4096_b8_expandable", "llama1b_s4096_b9_expandable_oom")


@pytest.mark.parametrize("name", RUNS)
def test_a_whole_program_simulates_to_its_real_max_reserved(shared, name):
    """torch's max_memory_reserved of step 3 (read after reset_peak_memory_stats before step 3) is the whole
    program's: b7 and b8 never return memory to CUDA (no segment_free or segment_unmap entry), so reserved never
    shrinks and its maximum is reached by the end, step 3 included; b9 ran out of memory in its first step, before
    any reset. So the whole simulation must reserve at most exactly that figure, which is also what the snapshot's own
    segment entries add up to. max_memory_allocated of step 3 is the program's too: steps 2 and 3 hold AdamW's state
    from their start and peak above step 1. The capacity is total_memory less what the process held outside the
    allocator (measured after the run)."""
    facts = programs(shared)
    run = facts["runs"][name]
    snap = read_snapshot(shared / FOLDER / f"{name}.pickle")
    check = check_program(snap, facts["total"] - run["outside"])
    assert check.from_start  # recorded from before the program's first allocation
    if run["result"] == "ran":
        assert not any(e.action in SHRINKS for e in snap.entries)
    assert check.real_max_reserved == run["max_reserved"]  # the snapshot's entries agree with torch's counter
    assert check.simulated.peak_reserved == run["max_reserved"]
    assert check.simulated.peak_allocated == run["max_allocated"]
    assert (check.simulated.oom is None) == (run["result"] == "ran")
    assert check.exact


def test_the_out_of_memory_run_fails_at_the_same_request_with_pytorch_s_figures(shared):
    """b9 with expandable segments: the simulation fails at the request PyTorch could not serve (17.61 GiB, the
    whole-vocabulary fp32 logits), its retries done (free pages unmapped), with the allocated and reserved-but-
    unallocated bytes PyTorch printed, and the free bytes it read from CUDA (capacity less reserved)."""
    facts = programs(shared)
    name = RUNS[2]
    capacity = facts["total"] - facts["runs"][name]["outside"]
    snap = read_snapshot(shared / FOLDER / f"{name}.pickle")
    check = check_program(snap, capacity)
    oom = check.simulated.oom
    assert check.fails_at_the_same_request and oom.buffer == check.requests[0]
    assert oom.size == check.real_oom_size and capacity - oom.reserved == check.real_oom_free
    assert capacity_at_oom(snap) == capacity  # the outside figure measured after the run held at the failure too
    printed = dict(
        tried=torch_size(oom.size),
        total=torch_size(facts["total"]),
        free=torch_size(capacity - oom.reserved),
        allocated=torch_size(oom.allocated),
        cached=torch_size(oom.reserved - oom.allocated),
    )
    expected = re.search(
        r"Tried to allocate (?P<tried>[\d.]+ \w+)\. GPU 0 has a total capacity of (?P<total>[\d.]+ \w+) of which "
        r"(?P<free>[\d.]+ \w+) is free\..* Of the allocated memory (?P<allocated>[\d.]+ \w+) is allocated by PyTorch, "
        r"and (?P<cached>[\d.]+ \w+) is reserved by PyTorch but unallocated\.",
        facts["message"],
    ).groupdict()
    assert printed == expected


def test_memplan_import_reads_the_snapshot_that_ends_in_an_out_of_memory_error(shared, tmp_path):
    """The b9 snapshot ends in PyTorch's `oom` entry (no address) and the frees that follow it: it imports, the error
    in the trace's meta (written and read back) and in the summary."""
    out = tmp_path / "b9.trace.json.gz"
    r = CliRunner().invoke(main, ["import", str(shared / FOLDER / f"{RUNS[2]}.pickle"), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    raw = load_plain_pickle((shared / FOLDER / f"{RUNS[2]}.pickle").read_bytes())["device_traces"][0]
    entry = next(k for k, e in enumerate(raw) if e["action"] == "oom")
    assert summary["ooms"] == 1 and summary["allocated_in_trace"] == sum(e["action"] == "alloc" for e in raw)
    assert (summary["oom"]["entry"], summary["oom"]["size"], summary["oom"]["device_free"]) == (
        entry, raw[entry]["size"], raw[entry]["device_free"])  # fmt: skip
    assert load(out).meta["ooms"] == [summary["oom"]]
    assert "out of memory at entry" in CliRunner().invoke(main, ["import", str(shared / FOLDER / f"{RUNS[2]}.pickle"),
                                                                 "-o", str(out)]).stdout  # fmt: skip
