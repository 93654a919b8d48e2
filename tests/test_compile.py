"""`--compile`: a training step whose forward runs under torch.compile (Inductor, AOTAutograd's min-cut
partitioner at an activation memory budget) is traced, checked against eager, and its plan replayed.

Inductor compiles are slow on this machine (tens of seconds per graph from a cold cache), so the model is
the smallest dropout-free one (tiny Llama: eager and compiled compute the same values, no RNG), each
compiled trace is made once per module, and the later compiles of the same graphs hit Inductor's cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from memplan.cli import main
from memplan.modes import AS_BUILT
from memplan.planner.replay.model_replay import replay_model_file
from memplan.planner.replay.schedule import ReplayError
from memplan.planner.report.replay_text import render_replay
from memplan.step import StepSpec
from memplan.traces.compile import Compile, compile_model
from memplan.traces.format import Trace, save, trace_digest
from memplan.traces.inputs.model_file import load_workload
from memplan.traces.inputs.trace_model import trace_step

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "llama.py"
BATCH, SEQ = 2, 64
INDUCTOR = "inductor"  # the op label of what Inductor's own code allocates


def trace(compile: float | None = None, layers: str = AS_BUILT) -> Trace:
    """One traced step of tiny Llama, eager or compiled (at that activation memory budget), under a layer mode."""
    return trace_step(StepSpec(MODEL, batch=BATCH, seq=SEQ, mode=layers, compile=compile))


def activation_bytes(trace: Trace) -> int:
    """Bytes allocated in forward and still held when backward starts: what the step keeps for backward."""
    return sum(int(size) for size, category in zip(trace.size, trace.category) if category == "activation")


def backward_allocations(trace: Trace) -> int:
    """Recorded allocations of the backward phase (recomputation shows here)."""
    return sum(1 for alloc, phase in zip(trace.alloc, trace.phase) if alloc > 0 and phase == "backward")


@pytest.fixture(scope="module", autouse=True)
def tiny_preset():
    """The bundled model files' default preset (tiny), whatever the environment says."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MEMPLAN_PRESET", raising=False)
        yield


@pytest.fixture(scope="module")
def traces(tiny_preset) -> dict:
    """The same step eager, under full checkpointing, and compiled at activation memory budgets 1 and 0."""
    return {"eager": trace(), "full": trace(layers="full"), 1.0: trace(1.0), 0.0: trace(0.0)}


def gradients_of_one_step(budget: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and parameter gradients of the first step of tiny Llama (seeded build), compiled at `budget`."""
    workload = load_workload(StepSpec(MODEL, batch=BATCH, seq=SEQ))
    if budget is not None:
        compile_model(workload.model, Compile(budget))
    loss = workload.loss_fn(workload.forward(), workload.inputs)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in workload.model.named_parameters()}


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
@pytest.mark.parametrize("budget", [1.0, 0.0])
def test_compiled_loss_and_gradients_equal_eager(budget):
    # Inductor fuses and reorders float32 reductions (RMSNorm's mean, softmax, gradient sums over the 128
    # tokens), so a result may move by a few ulps: measured at most 6e-7 of a tensor's largest entry. A
    # tolerance of 1e-5 of it is ~20x that margin and still far below a real error (a lost or doubled term
    # moves a gradient by its own size).
    eager_loss, eager_grads = gradients_of_one_step(None)
    loss, grads = gradients_of_one_step(budget)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0.0)
    assert grads.keys() == eager_grads.keys()
    for name, expected in eager_grads.items():
        scale = float(expected.abs().max())
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_budget_zero_holds_less_for_backward_and_recomputes_in_it(traces):
    kept, recomputed = traces[1.0], traces[0.0]
    assert activation_bytes(recomputed) < activation_bytes(kept)
    assert recomputed.peak()[0] < kept.peak()[0]
    assert backward_allocations(recomputed) > backward_allocations(kept)


def test_budget_zero_holds_no_more_than_full_checkpointing(traces):
    # The partitioner at 0 keeps only the compiled graph's inputs (and the loss's log-softmax outside it),
    # full checkpointing each layer's input: measured 1,050,632 against 1,405,832 bytes at seq 128.
    assert activation_bytes(traces[0.0]) <= 1.10 * activation_bytes(traces["full"])


def test_meta_and_labels_say_compiled(traces):
    assert "compile" not in traces["eager"].meta
    for budget in (1.0, 0.0):
        assert traces[budget].meta["compile"] == {"backend": "inductor", "memory_budget": budget}
        labelled = {(op, module) for op, alloc, module in zip(traces[budget].op, traces[budget].alloc,
                                                              traces[budget].module) if alloc > 0}  # fmt: skip
        assert (INDUCTOR, "model") in labelled
    assert INDUCTOR not in traces["eager"].op
    # Inductor allocates its buffers outside any op: which ones an op returned is not known there
    assert traces["eager"].meta["internal_marked"] and traces["eager"].internal.any()
    assert not traces[1.0].meta["internal_marked"] and not traces[1.0].internal.any()


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_graph_breaking_mode_compiles_only_in_the_warm_up_and_traces_alike_twice():
    # tempo's in-place layers break the graph, so eager code (and the recorder's module hooks) runs between
    # compiled pieces: the recorded step must compile nothing more (trace_step checks it), and the cyclic
    # garbage the compiler leaves must be gone before the step, or the second trace of a process holds it.
    first, second = trace(1.0, "tempo"), trace(1.0, "tempo")
    assert trace_digest(first) == trace_digest(second)
    assert "unknown" not in first.category


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_compiled_trace_replays_with_no_fallback(traces, tmp_path):
    save(traces[0.0], tmp_path / "t.json.gz")
    assert (
        CliRunner().invoke(main, ["solve", str(tmp_path / "t.json.gz"), "-o", str(tmp_path / "p.json")]).exit_code == 0
    )
    report = replay_model_file(
        str(tmp_path / "p.json"),
        StepSpec(MODEL, batch=BATCH, seq=SEQ, compile=0.0),
        trace_file=str(tmp_path / "t.json.gz"),
        steps=2,
    )
    assert report.fallback_count == 0 and report.bitwise_equal, render_replay(report.summary())
    for compile in (None, 1.0):  # the trace's budget is 0: eager or another budget would allocate otherwise
        with pytest.raises(ReplayError, match="replay its plan with --compile --memory-budget 0"):
            replay_model_file(
                str(tmp_path / "p.json"),
                StepSpec(MODEL, seq=SEQ, compile=compile),
                trace_file=str(tmp_path / "t.json.gz"),
            )


def test_cli_trace_json_says_compiled(tmp_path):
    out = tmp_path / "t.json.gz"
    result = CliRunner().invoke(
        main, ["trace", str(MODEL), "--seq", str(SEQ), "--compile", "--memory-budget", "0", "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["compile"] == {"backend": "inductor", "memory_budget": 0.0}


BAD = [
    ["trace", "{m}", "--compile", "--memory-budget", "1.5"],
    ["trace", "{m}", "--memory-budget", "0.5"],
    ["trace", "{m}", "--compile", "--fake"],
    ["run", "{m}", "-o", "{d}/out", "--compile", "--capture", "fake"],
    ["fit", "{m}", "--memory", "1GiB", "--compile", "--capture", "fake"],
    ["fit", "{m}", "--memory", "1GiB", "--memory-budget", "0"],
    ["replay", "{d}/missing.plan.json", "{m}", "--memory-budget", "0"],
]


@pytest.mark.parametrize("args", BAD, ids=" ".join)
def test_bad_compile_options_are_one_line_and_leave_nothing(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, [a.format(m=MODEL, d=tmp_path) for a in args])
    assert result.exit_code not in (0, None) and result.stdout == "", result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert [line for line in result.stderr.splitlines() if line.strip()] == [result.stderr.strip()]
    assert result.stderr.startswith("Error:") and list(tmp_path.iterdir()) == []
