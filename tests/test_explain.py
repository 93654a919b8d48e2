"""`memplan explain`: a real out-of-memory snapshot explained (PyTorch's message, what was live, fragmentation, each
allocator change simulated) and a snapshot without one (its peak and headroom); a hand-made one where fragmentation
is the cause and expandable segments the cure, and the H200 program that ran out of memory (../shared)."""

from __future__ import annotations

import json
import pickle
import re

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.gpus import gpu
from memplan.planner.jobs.explain import ALLOCATOR_CHANGES, WHOLE_GPU, explain_snapshot
from memplan.planner.report.explain_text import pytorch_oom_message
from memplan.units import MiB, torch_size

BASE = 1 << 32


def _e(action: str, addr: int, size: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0}


def fragmented(path) -> str:
    """A program under the default allocator that fails for fragmentation: a 40 MiB block, freed, split into a
    20 MiB and a 12 MiB one; the 20 MiB freed; a 24 MiB request finds 28 MiB cached in a segment still in use and
    20 MiB free on the device. Recorded from its start; the snapshot ends in the error."""
    entries = [
        _e("segment_alloc", BASE, 40 * MiB),
        _e("alloc", BASE, 40 * MiB),
        _e("free_requested", BASE, 40 * MiB), _e("free_completed", BASE, 40 * MiB),
        _e("alloc", BASE, 20 * MiB),
        _e("alloc", BASE + 20 * MiB, 12 * MiB),
        _e("free_requested", BASE, 20 * MiB), _e("free_completed", BASE, 20 * MiB),
        {"action": "oom", "size": 24 * MiB, "device_free": 20 * MiB, "stream": 0, "time_us": 0},
    ]  # fmt: skip
    blocks = [
        {"address": BASE, "size": 20 * MiB, "requested_size": 0, "state": "inactive"},
        {"address": BASE + 20 * MiB, "size": 12 * MiB, "requested_size": 12 * MiB, "state": "active_allocated"},
        {"address": BASE + 32 * MiB, "size": 8 * MiB, "requested_size": 0, "state": "inactive"},
    ]
    segment = {"device": 0, "address": BASE, "total_size": 40 * MiB, "stream": 0, "segment_type": "large",
               "blocks": blocks}  # fmt: skip
    path.write_bytes(pickle.dumps({"segments": [segment], "device_traces": [entries]}))
    return str(path)


def test_fragmentation_is_explained_and_expandable_segments_checked_to_cure_it(tmp_path):
    d = explain_snapshot(fragmented(tmp_path / "oom.pickle"), memory=64 * MiB).to_dict()
    o = d["oom"]
    assert d["from_start"] and d["capacity"] == 60 * MiB  # reserved 40 MiB + 20 MiB free when it failed
    assert (o["request"], o["reserved"], o["allocated"], o["cached"], o["largest_free"]) == (
        24 * MiB, 40 * MiB, 12 * MiB, 28 * MiB, 20 * MiB)  # fmt: skip
    assert o["reproduced"] and o["allocations_after"] == 0
    assert pytorch_oom_message(o, 0) == (
        "CUDA out of memory. Tried to allocate 24.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which 20.00 MiB "
        "is free. Of the allocated memory 12.00 MiB is allocated by PyTorch, and 28.00 MiB is reserved by PyTorch but "
        "unallocated."
    )
    assert d["live"]["bytes"] == 12 * MiB and d["live"]["buffers"] == 1
    outcome = {c["change"]: c["runs"] for c in d["changes"]}
    assert outcome == {ALLOCATOR_CHANGES[0][0]: True, ALLOCATOR_CHANGES[1][0]: False, ALLOCATOR_CHANGES[2][0]: False,
                       WHOLE_GPU: True}  # fmt: skip
    assert all(c["failed_at_same"] for c in d["changes"] if not c["runs"])
    assert [m["command"].split()[:4] for m in d["needs_model"]][0] == ["memplan", "fit", "MODEL", "--memory"]


def test_the_command_prints_the_error_and_each_change_s_outcome(tmp_path):
    r = CliRunner().invoke(main, ["explain", fragmented(tmp_path / "oom.pickle"), "--memory", "64MiB"])
    assert r.exit_code == 0, r.output
    assert "Tried to allocate 24.00 MiB." in r.stdout
    assert "the cache held enough, in pieces inside segments still in use (fragmentation)" in r.stdout
    assert re.search(r"expandable_segments:True +runs", r.stdout)
    assert re.search(r"max_split_size_mb:512 +still fails .* at the same request of 24.0 MiB", r.stdout)
    assert "a smaller batch: memplan fit MODEL --memory 67108864" in r.stdout
    assert list(tmp_path.iterdir()) == [tmp_path / "oom.pickle"]  # explain writes nothing


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--gpu", "H200", "--memory", "80GB"], "give --gpu NAME or --memory SIZE, not both"),
        (["--memory", "64MiB", "--outside", "64MiB"], "leaves the allocator nothing of the GPU's 67,108,864 B"),
        (["--gpu", "H9000"], "--gpu H9000: unknown GPU"),
    ],
)
def test_options_explain_cannot_use_are_one_error_line(tmp_path, args, error):
    r = CliRunner().invoke(main, ["explain", fragmented(tmp_path / "oom.pickle"), *args])
    assert r.exit_code != 0 and r.stdout == ""
    assert error in r.stderr and r.stderr.strip().splitlines()[-1].startswith("Error:")


def test_the_h200_program_that_ran_out_of_memory(shared):
    """The b9 run of ../shared/traces/h200-programs: PyTorch's own message (less its per-process sentence, which
    comes from NVML and is not in a snapshot), what was live (no frames were recorded: no op names, said so), and no
    allocator change gets past it: it lacked 1.12 GiB more than all of the cache; the model must change."""
    folder = shared / "traces/h200-programs"
    text = " ".join((folder / "PROGRAMS.md").read_text().split())
    total = int(re.search(r"`total_memory` ([\d,]+) B", text).group(1).replace(",", ""))
    message = re.search(r'error: "(CUDA out of memory\..*?unallocated\.)"', text).group(1)
    nvml = re.search(r" Including non-PyTorch memory, this process has [\d.]+ GiB memory in use\.", message).group(0)
    r = CliRunner().invoke(main, ["explain", str(folder / "llama1b_s4096_b9_expandable_oom.pickle"),
                                  "--memory", str(total), "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert pytorch_oom_message(d["oom"], 0) == message.replace(nvml, "")
    assert d["oom"]["reproduced"] and d["check"]["exact"]
    assert d["already"] == ["expandable_segments:True"]
    assert not any(c["runs"] for c in d["changes"]) and d["changes"]
    assert d["oom"]["request"] - d["oom"]["device_free"] > d["oom"]["cached"]  # more than the cache could give
    assert d["live"]["op_bytes"] == 0 and d["live"]["bytes"] <= d["oom"]["allocated"]
    assert d["live"]["largest"][0]["size"] == d["oom"]["request"]  # a buffer of the failed request's size was live
    text_out = CliRunner().invoke(main, ["explain", str(folder / "llama1b_s4096_b9_expandable_oom.pickle"),
                                         "--gpu", "H200"]).stdout  # fmt: skip
    assert "by op: not known (recorded without stack frames" in text_out
    assert f"{torch_size(total)}" == "139.80 GiB" and "total capacity of 139.80 GiB" in text_out


def test_without_an_error_explain_gives_the_peak_and_the_headroom(shared):
    """The b7 run (batch 7, default allocator) on an H200 with the outside bytes it measured: the headroom is the
    GPU's memory less them less the snapshot's max reserved, and the program simulated there runs."""
    path = shared / "traces/h200-programs/llama1b_s4096_b7_default.pickle"
    d = explain_snapshot(path, gpu=gpu("H200"), outside=804_061_184).to_dict()
    assert d["oom"] is None and d["changes"] == []
    assert d["headroom"] == gpu("H200").memory - 804_061_184 - d["max_reserved"] > 0
    assert d["check"]["simulated_oom_size"] is None and d["check"]["exact"]
