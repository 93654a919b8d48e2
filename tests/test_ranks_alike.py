"""Ranks alike by construction traced once under --fake (traces/ranks/alike.py): the classes proposed from what the
first rank builds, each class's one trace equal to every member's own trace, and ZeRO-1's ranks, which differ,
each traced. Also PP x FSDP2 on a ("pp", "dp") mesh (examples/llama_pipeline.py with MEMPLAN_DP)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from memplan.cli import main
from memplan.step import StepSpec
from memplan.traces.format import Trace, load
from memplan.traces.ranks.alike import Layout, MeshRecord, StageRecord, propose, same_step
from memplan.traces.ranks.family import traces_by_rank
from memplan.traces.ranks.launch import rank_path, trace_ranks

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SEQ = 16


def columns(trace: Trace) -> tuple:
    """Every buffer's size, times, stream and labels, and the syncs: what two traces of one step share."""
    rows = zip(trace.size, trace.alloc, trace.free, trace.stream, trace.internal, *(
        getattr(trace, c) for c in ("category", "phase", "op", "module")))  # fmt: skip
    return [tuple(int(x) if isinstance(x, np.integer) else x for x in row) for row in rows], list(trace.syncs)


def traced(model_file: str, nproc: int, folder: Path, batch: int = 2) -> tuple[list, list[Trace]]:
    """(the ranks each distinct trace stands for, every rank's own trace traced without the dedup)."""
    step = StepSpec(str(EXAMPLES / model_file), batch, SEQ, fake=True)
    distinct = trace_ranks(step, folder / "alike" / "t.json.gz", nproc)
    trace_ranks(step, folder / "every" / "t.json.gz", nproc, alike=False)
    return [ranks for _, ranks, _ in distinct], each_alone(folder, [(p, ranks) for p, ranks, _ in distinct], nproc)


def each_alone(folder: Path, distinct: list[tuple[Path, list[int]]], nproc: int) -> list[Trace]:
    """Every rank's own trace from folder/every, asserted equal to the trace in folder/alike that stands for it
    (one file a distinct trace, named by its first rank, meta "ranks" its ranks)."""
    each = [load(rank_path(folder / "every" / "t.json.gz", r)) for r in range(nproc)]
    for path, ranks in distinct:
        trace = load(path)
        assert path == rank_path(folder / "alike" / "t.json.gz", ranks[0])
        assert trace.meta["ranks"] == ranks and trace.meta["rank"] == ranks[0] and trace.meta["world_size"] == nproc
        for r in ranks:  # the class's one trace is every member's
            assert columns(trace) == columns(each[r])
    assert sorted(p.name for p in (folder / "alike").iterdir()) == sorted(p.name for p, *_ in distinct)
    assert all(each[r].meta["ranks"] == [r] for r in range(nproc))
    return each


@pytest.mark.parametrize(
    ("model_file", "env"),
    [("llama_fsdp2.py", {"MEMPLAN_TP": "2"}), ("gpt2_ddp.py", {})],
    ids=["fsdp2-tp-2x2", "ddp"],
)
def test_fsdp_tp_and_ddp_ranks_are_one_class(tmp_path, monkeypatch, model_file, env):
    """FSDP2 x TP on a 2 x 2 mesh and DDP over 4 ranks: one trace stands for all four ranks, and it equals each rank's
    own trace buffer for buffer (FSDP2 alone: through the CLI, below)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    classes, _ = traced(model_file, 4, tmp_path)
    assert classes == [[0, 1, 2, 3]]


def test_pipeline_stages_over_fsdp2_are_classes(tmp_path, monkeypatch):
    """1F1B over 2 stages, each FSDP2-sharded over 2 ranks (a ("pp", "dp") mesh of 4): a class per stage, each
    equal to its ranks' own traces; the first stage holds more activations in flight than the last."""
    monkeypatch.setenv("MEMPLAN_DP", "2")
    monkeypatch.setenv("MEMPLAN_MICROBATCHES", "2")
    monkeypatch.setenv("MEMPLAN_LAYERS", "4")
    classes, each = traced("llama_pipeline.py", 4, tmp_path, batch=2)
    assert classes == [[0, 1], [2, 3]]
    assert activations_in_flight(each[0]) > activations_in_flight(each[2])


def activations_in_flight(trace: Trace) -> int:
    """Activation bytes the stage holds when its first backward begins."""
    first_backward = min(int(a) for a, phase in zip(trace.alloc, trace.phase) if a > 0 and phase == "backward")
    activations = [i for i in range(len(trace)) if trace.category[i] == "activation"]
    return sum(int(trace.size[i]) for i in activations if trace.alloc[i] < first_backward <= trace.free[i])


def test_zero_ranks_differ_and_are_each_traced(tmp_path, monkeypatch):
    """ZeRO-1 over 4 ranks: proposed as one class, but the witness (rank 3) holds another partition's AdamW state
    than rank 0, so every rank is traced and stands for itself: four files, meta "ranks" [r] each."""
    monkeypatch.setenv("MEMPLAN_DDP_OPTIMIZER", "zero")
    output = tmp_path / "t.json.gz"
    distinct = trace_ranks(StepSpec(str(EXAMPLES / "gpt2_ddp.py"), 2, SEQ, fake=True), output, 4)
    assert [ranks for *_, ranks, _ in distinct] == [[0], [1], [2], [3]]
    traces = [load(rank_path(output, r)) for r in range(4)]
    assert [trace.meta["ranks"] for trace in traces] == [[0], [1], [2], [3]]
    assert not same_step(traces[0], traces[3])


def test_fsdp2_ranks_are_one_class_and_the_cli_says_so(tmp_path, monkeypatch):
    """`memplan trace --nproc 4 --fake` of FSDP2 over 4 ranks prints the ranks its one file stands for; that trace
    equals each rank's own, traced with --every-rank (four files); traces_by_rank gives every rank its trace."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    args = ["trace", str(EXAMPLES / "llama_fsdp2.py"), "--nproc", "4", "--fake", "--seq", str(SEQ), "-o"]
    result = CliRunner().invoke(main, [*args, str(tmp_path / "alike" / "t.json.gz")])
    assert result.exit_code == 0, result.output
    assert "ranks 0-3 of 4 (4 ranks alike, one trace):" in result.output
    assert [t.meta["ranks"] for t in traces_by_rank(tmp_path / "alike" / "t.json.gz")] == [[0, 1, 2, 3]] * 4
    result = CliRunner().invoke(main, [*args, str(tmp_path / "every" / "t.json.gz"), "--every-rank"])
    assert result.exit_code == 0, result.output
    assert "rank 3 of 4:" in result.output
    each_alone(tmp_path, [(rank_path(tmp_path / "alike" / "t.json.gz", 0), [0, 1, 2, 3])], 4)


def grid_layout(rank: int, shape: tuple[int, int], group: tuple[int, ...] | None) -> Layout:
    """A watched rank of a (pp, dp) mesh over every rank, with a stage whose pipeline group is `group`."""
    ranks = tuple(range(shape[0] * shape[1]))
    layout = Layout(rank, len(ranks), meshes=[MeshRecord(shape, ("pp", "dp"), ranks)])
    if group is not None:
        layout.stages.append(StageRecord(group.index(rank), len(group), group))
    return layout


def test_proposed_classes():
    """No pipeline: one class. A pipeline over a mesh's "pp" dimension: a class per position along it. A pipeline
    over every rank, or over a group no mesh shows: every rank alone."""
    assert propose(grid_layout(0, (2, 4), None)) == [list(range(8))]
    assert propose(grid_layout(0, (2, 4), (0, 4))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert propose(grid_layout(0, (4, 2), (0, 2, 4, 6))) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    world = Layout(0, 3, stages=[StageRecord(0, 3, (0, 1, 2))])
    assert propose(world) == [[0], [1], [2]]
    assert propose(grid_layout(0, (2, 4), (0, 5))) == [[r] for r in range(8)]
