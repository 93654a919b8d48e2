"""Tensor and sequence parallelism on 2 gloo processes (fp32): equality with the single-process layer,
per-rank bytes against REFERENCE §1's formulas, and `memplan trace --nproc` (one trace per rank, all or none)."""

from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner
from step_traces import buffer_events

from memplan.cli import main
from memplan.planner.layers.memory import LayerShape
from memplan.planner.parallel.checks import run_cases
from memplan.planner.parallel.comm import ParallelError
from memplan.planner.parallel.formulas import parallel_formula
from memplan.planner.parallel.model import build_workload
from memplan.traces.format import load
from memplan.traces.ranks.family import traces_by_rank
from memplan.traces.ranks.launch import launch, rank_path

MODES = ("baseline", "tempo", "selective", "tempo+selective")
SMALL = [16, 2, 32, 4, 4]  # s, b, h, a, p: equality checks
SHAPE = [64, 2, 64, 4, 4]  # bytes: as/h = 4, large enough that the selective core's saved RNG state is < 1%
BYTE_CASES = [(m, sp) for m in MODES for sp in (False, True)]
TRACED_CASES = [
    ("baseline", False),
    ("baseline", True),
    ("selective", True),
    ("tempo", True),
    ("tempo+selective", False),
]


@pytest.fixture(scope="module")
def ranks():
    """Every rank-side check in one 2-process run (starting processes is the slow part)."""
    cases = [
        {"check": "errors", "shape": SMALL, "mode": m, "sequence_parallel": sp} for m in MODES for sp in (False, True)
    ]
    cases += [{"check": "model", "sequence_parallel": sp} for sp in (False, True)]
    cases += [{"check": "frees"}]
    cases += [{"check": "bytes", "shape": SHAPE, "mode": m, "sequence_parallel": sp} for m, sp in BYTE_CASES]
    cases += [{"check": "traced", "shape": SHAPE, "mode": m, "sequence_parallel": sp} for m, sp in TRACED_CASES]
    results = launch(run_cases, (cases,), nproc=2)
    return [list(zip(cases, per_rank)) for per_rank in results]


def _results(ranks, check):
    return [(case, result) for per_rank in ranks for case, result in per_rank if case["check"] == check]


@pytest.mark.slow
def test_parallel_layer_equals_single_process_layer(ranks):
    checked = _results(ranks, "errors")
    assert len(checked) == 2 * len(MODES) * 2
    for case, result in checked:
        assert len(result["errors"]) == 14  # output, input gradient and all 12 parameter gradients
        # Tempo's GELU recovers its input from float64-built inverse tables: exact to about 1e-5, not to rounding.
        tolerance = 1e-4 if case["mode"].startswith("tempo") else 1e-5
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] < tolerance, (case, worst, result["errors"][worst])


@pytest.mark.slow
def test_parallel_model_equals_single_process_model(ranks):
    for case, result in _results(ranks, "model"):
        assert result["loss"] < 1e-6 and result["wte"] < 1e-5 and result["wpe"] < 1e-5 and result["ln_f"] < 1e-5, (
            case,
            result,
        )


@pytest.mark.slow
@pytest.mark.parametrize("check", ["bytes", "traced"])
def test_per_rank_layer_bytes_within_3_percent_of_formulas(ranks, check):
    measured = _results(ranks, check)
    assert len(measured) == 2 * len(BYTE_CASES if check == "bytes" else TRACED_CASES)
    for case, result in measured:
        # LayerNorm's mean and rstd (and, traced, the selective core's RNG state) are the allowed excess.
        assert result["formula"] <= result["measured"] <= 1.03 * result["formula"], (case, result)


@pytest.mark.slow
def test_every_free_of_a_collective_s_tensors_is_recorded(ranks):
    """Whichever thread drops a collective's last reference (the traced one, or gloo's worker, which the recorder
    sees through its wrapped CPU allocator), each temporary the rounds allocate is seen freed."""
    counted = _results(ranks, "frees")
    assert len(counted) == 2
    for _, result in counted:
        assert result["allocations"] == result["frees"] > 0, result


def test_sequence_parallel_divides_the_tensor_parallel_remainder():
    shape = LayerShape(*SHAPE)
    for mode in MODES:
        assert parallel_formula(shape, mode, 1, False) == parallel_formula(shape, mode, 1, True) == shape.formula(mode)
    tp, sp = parallel_formula(shape, "baseline", 2, False), parallel_formula(shape, "baseline", 2, True)
    sbh = shape.s * shape.b * shape.h
    assert tp - sp == sbh * (4 * shape.p + 2) / 2  # the replicated part, now split too


def test_rank_file_names():
    assert str(rank_path("out/g.json.gz", 1)) == "out/g.rank1.json.gz"
    assert str(rank_path("g.json", 0)) == "g.rank0.json"
    assert str(rank_path("g.trace", 3)) == "g.trace.rank3"


def test_parallel_options_that_cannot_work_are_refused():
    with pytest.raises(ParallelError, match="tensor_parallel=2 but the process group has 1 ranks"):
        build_workload(tensor_parallel=2)


MODEL_FILE = """
import os
import torch.distributed as dist
from memplan.planner.parallel.model import build_workload
from step_traces import bytes_by_category

def build(batch_size, seq_len, dtype, device):
    workload = build_workload(batch_size, seq_len, dtype, device, sequence_parallel=True)
    if os.environ.get("FAIL_RANK") == str(dist.get_rank()):
        def failing(output, inputs):  # fails in the middle of the step, the other rank goes on
            raise RuntimeError("rank broke in its loss")
        workload.loss_fn = failing
    return workload
"""


@pytest.fixture(scope="module")
def gloo_traced(tmp_path_factory):
    """`memplan trace --nproc 2` of the TP x SP model file on two gloo processes: (the CLI's result, the output path),
    traced once for the tests that read it (they only read the files)."""
    folder = tmp_path_factory.mktemp("gloo")
    model = folder / "tp_sp.py"
    model.write_text(textwrap.dedent(MODEL_FILE))
    out = folder / "out" / "g.json.gz"
    result = CliRunner().invoke(main, ["trace", str(model), "--nproc", "2", "--seq", "16", "-o", str(out), "--json"])
    return result, out


@pytest.mark.slow
def test_trace_nproc_writes_one_trace_per_rank(tmp_path, gloo_traced):
    result, out = gloo_traced
    assert result.exit_code == 0, result.output
    traces = [load(rank_path(out, r)) for r in range(2)]
    for r, trace in enumerate(traces):
        assert trace.meta["rank"] == r and trace.meta["world_size"] == 2 and trace.meta["backend"] == "gloo"
        assert trace.meta["ranks"] == [r]  # real processes: one trace a rank
        assert trace.peak()[0] > 0
    # Same program on both ranks: the same sequence of buffer sizes.
    assert list(traces[0].size[traces[0].recorded]) == list(traces[1].size[traces[1].recorded])
    assert sorted(p.name for p in out.parent.iterdir()) == ["g.rank0.json.gz", "g.rank1.json.gz"]
    # the rank traces go through solve and plot as any trace; plot puts the ranks side by side
    ranks = [str(rank_path(out, r)) for r in range(2)]
    for r, name in enumerate(ranks):
        solved = CliRunner().invoke(main, ["solve", name, "-o", str(tmp_path / f"plan{r}.json"), "--json"])
        assert solved.exit_code == 0, solved.output
        assert json.loads(solved.stdout)["arena"] >= traces[r].peak()[0]
    plans = [a for r in range(2) for a in ("--plan", str(tmp_path / f"plan{r}.json"))]
    plotted = CliRunner().invoke(main, ["plot", *ranks, *plans, "-o", str(tmp_path / "ranks.png")])
    assert plotted.exit_code == 0, plotted.output
    assert (tmp_path / "ranks.png").stat().st_size > 10_000


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_a_failing_rank_fails_the_command_and_leaves_no_files(tmp_path, monkeypatch):
    model = tmp_path / "tp_sp.py"
    model.write_text(textwrap.dedent(MODEL_FILE))
    monkeypatch.setenv("FAIL_RANK", "1")
    out = tmp_path / "out" / "g.json.gz"
    out.parent.mkdir()
    result = CliRunner().invoke(main, ["trace", str(model), "--nproc", "2", "--seq", "16", "-o", str(out)])
    assert result.exit_code == 1
    lines = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: rank 1: ") and lines[0].endswith("RuntimeError: rank broke in its loss")
    assert list(out.parent.iterdir()) == []


@pytest.mark.slow
def test_fake_ranks_hold_what_the_gloo_ranks_hold(tmp_path, gloo_traced):
    """--nproc --fake: every rank in this process on the fake process group, under fake tensors; each
    rank holds the gloo rank's buffers in the same order with the same sizes and labels but for the op
    of a reduce-scatter (on gloo an all-reduce and a clone of the slice, on the others a new_empty
    written by the collective). The gloo rank also holds its CPU kernels' scratch and gloo's staging
    buffers on its worker threads, marked internal."""
    traced, real = gloo_traced
    assert traced.exit_code == 0, traced.output
    model = tmp_path / "tp_sp.py"
    model.write_text(textwrap.dedent(MODEL_FILE))
    fake = tmp_path / "fake" / "g.json.gz"
    result = CliRunner().invoke(main, ["trace", str(model), "--nproc", "2", "--seq", "16", "-o", str(fake), "--fake"])
    assert result.exit_code == 0, result.output
    for r, faked in enumerate(traces_by_rank(fake)):
        gloo = load(rank_path(real, r))
        assert faked.meta["backend"] == "fake" and faked.meta["fake"] and faked.meta["ranks"] == [0, 1]
        assert faked.meta["world_size"] == 2 and gloo.meta["backend"] == "gloo"
        without_op = [[(size, *rest) for size, _, *rest in buffer_events(trace)] for trace in (gloo, faked)]
        assert without_op[0] == without_op[1]
        assert gloo.internal.any() and gloo.peak()[0] > faked.peak()[0]
    assert [p.name for p in fake.parent.iterdir()] == ["g.rank0.json.gz"]  # the two ranks are alike: traced once


def test_a_failing_fake_rank_is_one_line_and_leaves_no_files(tmp_path, monkeypatch):
    model = tmp_path / "tp_sp.py"
    model.write_text(textwrap.dedent(MODEL_FILE))
    monkeypatch.setenv("FAIL_RANK", "1")
    out = tmp_path / "out" / "g.json.gz"
    result = CliRunner().invoke(main, ["trace", str(model), "--nproc", "2", "--fake", "--seq", "16", "-o", str(out)])
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: rank 1: ") and last.endswith("RuntimeError: rank broke in its loss")
    assert list(out.parent.iterdir()) == []
