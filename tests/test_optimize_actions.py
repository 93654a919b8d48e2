"""Issue 34's acceptance for `memplan optimize` with the actions: on a 4-layer decoder with four layer modes (one of
them offloading), the fused loss and each optimizer choice, CP-SAT's least added work equals a brute force over every
assignment and combination of actions within the model; the chosen configuration's own trace fits; and the model's
step-level deltas do not predict less than the traces of mixed configurations show."""

from __future__ import annotations

import itertools

import pytest

import memplan.planner.jobs.optimize as optimize_job
from memplan.modes import ADAMW_HOST, AS_BUILT, FUSED
from memplan.planner.jobs.optimize import (
    LOSS,
    OFFLOAD_MODES,
    OPTIMIZER,
    OptimizeOptions,
    choose,
    combinations,
    every_layer,
    measure_batch,
    model_layers,
    optimize,
    step_of,
)
from memplan.planner.optimize.choose import work_of
from memplan.planner.simulate.measure import measure
from memplan.step import StepSpec
from memplan.traces.inputs.trace_model import trace_step

pytestmark = pytest.mark.slow  # 16 fake traces of the 4 layer modes' assignments, and the actions'

MODEL = """
from dataclasses import replace

from memplan.planner.workloads.llama import TINY, build_workload


def build(batch_size, seq_len, dtype, device):
    return build_workload(batch_size, seq_len, dtype, device, config=replace(TINY, layers=4, vocab_size=512))
"""
SHAPE = {"batch": 1, "seq": 128, "dtype": "float32"}
CUDA = {"device": "cuda", "fake": True}  # fake CUDA traces: the host optimizer's host is not the device, as on a CPU
BANDWIDTH = 25_000_000_000  # 25 GB/s: offloading a layer costs less than checkpointing it, more than tempo
MODES = (AS_BUILT, "tempo", "full", "tempo+offload")  # every kind of layer choice: 16 traces, where all 8 take 64


@pytest.fixture(scope="module")
def opts(tmp_path_factory):
    path = tmp_path_factory.mktemp("optimize_actions") / "llama_4.py"
    path.write_text(MODEL)
    step = StepSpec(str(path), **SHAPE, **CUDA)
    return OptimizeOptions(step, memory=1 << 40, capture="fake", host_bandwidth=BANDWIDTH, modes=MODES)


@pytest.fixture(scope="module")
def measured(opts):
    layers = model_layers(opts)
    return layers, measure_batch(opts, layers, SHAPE["batch"], True, lambda m: None)


def test_every_action_is_offered(measured):
    layers, m = measured
    assert m.terms.modes == MODES
    assert set(m.action_cost) == {(LOSS, FUSED), (OPTIMIZER, "adamw-8bit"), (OPTIMIZER, "adamw-4bit"),
                                  (OPTIMIZER, ADAMW_HOST)}, m.notes  # fmt: skip
    # the fused loss saves bytes where the logits were; the optimizer choices wherever their state is held but
    # their own step (whose temporaries may be larger: 8-bit's dequantized blocks)
    assert min(m.terms.deltas[LOSS, FUSED].values()) < 0
    for name in ("adamw-8bit", "adamw-4bit", ADAMW_HOST):
        deltas = m.terms.deltas[OPTIMIZER, name]
        assert all(delta < 0 for segment, delta in deltas.items() if segment[0] != "optimizer"), deltas
    # offloading costs its transfers on top of its resident mode's recompute, on every layer
    for j in range(len(layers)):
        assert m.cost[j, "tempo+offload"] > m.cost[j, "tempo"] > m.cost[j, AS_BUILT] == 0


def test_choice_agrees_with_a_brute_force_over_every_assignment_and_action(measured, opts):
    layers, m = measured
    combos = combinations(m)
    every = [
        (assignment, actions, m.terms.peak(assignment, actions), work_of(assignment, actions, m.cost, m.action_cost))
        for assignment in itertools.product(m.terms.modes, repeat=len(layers))
        for actions in combos
    ]
    low, high = min(e[2] for e in every), m.terms.peak(every_layer(layers, AS_BUILT))
    chose_actions = chose_offload = False
    for k in range(12):
        memory = low + (high - low) * k // 12
        least = min(e[3] for e in every if e[2] <= memory)
        choice = choose(m, memory, time_limit=30)
        assert choice.status == "optimal", memory
        assert choice.work == least, memory
        assert m.terms.peak(choice.assignment, choice.actions) <= memory
        chose_actions |= bool(choice.actions)
        chose_offload |= any(mode in OFFLOAD_MODES for mode in choice.assignment)
    assert chose_actions and chose_offload  # the sizes exercise both kinds of action


def test_the_deltas_do_not_predict_less_than_mixed_traces(measured, opts):
    """The step-level deltas were measured with every layer as built; under other layer modes, and combined, the
    model still bounds the traced peak."""
    layers, m = measured
    checks = [
        (("tempo", "full", "tempo+offload", "as-built"), ((LOSS, FUSED), (OPTIMIZER, "adamw-8bit"))),
        (every_layer(layers, "tempo"), ((LOSS, FUSED), (OPTIMIZER, ADAMW_HOST))),
        (every_layer(layers, "full"), ((OPTIMIZER, "adamw-4bit"),)),
        (("tempo+offload", "tempo+offload", "as-built", "full"), ((LOSS, FUSED),)),
    ]
    for assignment, actions in checks:
        trace = trace_step(step_of(opts, layers, assignment, SHAPE["batch"], True, actions))
        assert measure(trace, "mixed").figures()["peak_live"] <= m.terms.peak(assignment, actions), (
            assignment,
            actions,
        )


def test_optimize_verifies_its_choice_of_actions(measured, opts, monkeypatch):
    """End to end at a size where actions are needed: the chosen configuration is traced, its plan fits, and the
    choice file carries its loss and optimizer."""
    layers, m = measured
    monkeypatch.setattr(optimize_job, "measure_batch", lambda *args, **kwargs: m)
    as_built = m.terms.peak(every_layer(layers, AS_BUILT))
    tightest = min(m.terms.peak(every_layer(layers, mode), c) for mode in m.terms.modes for c in combinations(m))
    memory = tightest + (as_built - tightest) // 4
    again = OptimizeOptions(
        opts.step, memory=memory, capture="fake", host_bandwidth=BANDWIDTH, modes=MODES, time_limit=5
    )
    result = optimize(again)
    chosen = result.chosen
    assert chosen is not None and chosen.fits and chosen.plan_arena <= memory
    assert chosen.actions, "at a quarter of the way from the least peak, an action is needed"
    written = result.step_choice()
    assert (LOSS, written.loss) in chosen.actions or written.loss == AS_BUILT
    assert (OPTIMIZER, written.optimizer) in chosen.actions or written.optimizer == AS_BUILT
    assert written.plan_arena == chosen.plan_arena
