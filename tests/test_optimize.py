"""`memplan optimize` against a brute force: every per-layer assignment of a 3-layer GPT-2 traced for real,
its plan solved, its recompute counted; the least-recompute assignment that fits must be optimize's."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from click.testing import CliRunner
from shared_steps import shared_steps

import memplan
import memplan.planner.jobs.optimize as optimize_job
from memplan.cli import main
from memplan.planner.cost import count_step_flops
from memplan.planner.jobs.optimize import OPTIMIZE_MODES, OptimizeError, OptimizeOptions, optimize
from memplan.planner.layers.patch import STATE as PATCHED
from memplan.planner.optimize.choice_file import ChoiceError
from memplan.planner.optimize.choose import recompute_of
from memplan.planner.problem import problem_from_trace
from memplan.planner.simulate.measure import measure
from memplan.solvers import solve
from memplan.step import StepSpec
from memplan.traces.format import trace_digest
from memplan.traces.inputs.model_file import import_model_file
from memplan.traces.inputs.trace_model import trace_step

LAYERS = tuple(f"layers.{i}" for i in range(3))
SHAPE = {"batch": 1, "seq": 128, "dtype": "float32"}
MODEL = """
from memplan.planner.workloads.gpt2 import GPT2Config, build_workload


def build(batch_size, seq_len, dtype, device):
    return build_workload(batch_size, seq_len, dtype, device, config=GPT2Config(layers=3, vocab_size=256))
"""


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("optimize") / "gpt2_3.py"
    path.write_text(MODEL)
    return str(path)


def step_of(model_file, assignment):
    return StepSpec(model_file, mode=dict(zip(LAYERS, assignment)), **SHAPE)


@pytest.fixture(scope="module", autouse=True)
def steps():
    """Each step traced and counted once in this module: the brute force's traces are those optimize takes of the
    same assignments, and the FLOP counts per mode are its too (the test's own check of a choice file traces afresh)."""
    with shared_steps(optimize_job) as steps:
        yield steps


@pytest.fixture(scope="module", autouse=True)
def measured_once(steps):
    """optimize measures a batch (its traces and FLOP counts) from the model file and shape alone, not from the
    memory size: each batch is measured once here for all the sizes and commands this module asks (a traced
    step is the same every time), and everything after the measurement runs afresh for each."""
    measured = {}
    measure = optimize_job.measure_batch

    def once(opts, layers, batch, fake, progress, earlier=None):
        key = (opts.step.model_file, opts.step.seq, opts.step.dtype, batch, fake, opts.actions)
        if key not in measured:
            measured[key] = measure(opts, layers, batch, fake, progress, earlier)
        return measured[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimize_job, "measure_batch", once)
        yield measured


@pytest.fixture(scope="module", autouse=True)
def plans():
    """Each trace's plan solved once in this module, by its digest and time limit: the brute force solves the
    traces that optimize verifies and offers as alternatives at every memory size, at the same time limit."""
    solved = {}

    def plan(trace, time_limit):
        key = (trace_digest(trace), time_limit)
        if key not in solved:
            solved[key] = solve(problem_from_trace(trace), time_limit=time_limit)
        return solved[key]

    def measured(trace, name="trace", *, time_limit=10.0, **options):
        return measure(trace, name, plan=plan(trace, time_limit), **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimize_job, "measure", measured)
        yield plan


@pytest.fixture(scope="module")
def brute(model_file, steps, plans):
    """Plan arena of every one of the 5^3 assignments, each traced for real and solved. Three layers, not more:
    optimize measures only the uniform and alternating (m, n, m) assignments (25), so the other 100 test its
    memory model where it predicts; four layers (625 traces and solves) took 7.5 minutes."""
    arenas = {}
    for assignment in itertools.product(OPTIMIZE_MODES, repeat=len(LAYERS)):
        trace = steps.trace(step_of(model_file, assignment))
        arenas[assignment] = plans(trace, 2).arena
    return arenas


@pytest.fixture(scope="module")
def layer_costs(model_file, steps):
    """Recompute FLOPs per (layer, mode), from one count per mode on every layer."""
    counts = {m: steps.count(step_of(model_file, (m,) * len(LAYERS))) for m in OPTIMIZE_MODES}
    return {
        (j, m): counts[m].by_module[path] - counts["as-built"].by_module[path]
        for j, path in enumerate(LAYERS)
        for m in OPTIMIZE_MODES
    }, counts["as-built"].total


def test_recompute_adds_up_over_layers(model_file, layer_costs):
    """The brute force may sum the per-layer costs: a mixed assignment's counted FLOPs are that sum exactly."""
    cost, as_built = layer_costs
    for assignment in [
        ("full", "tempo", "tempo+selective"),
        ("selective", "full", "tempo"),
        ("as-built", "full", "full"),
    ]:
        counted = count_step_flops(step_of(model_file, assignment)).total
        assert counted - as_built == recompute_of(assignment, cost)


def least_recompute(brute, cost, memory, choices=None):
    """The least recompute of the assignments (all, or `choices`) whose traced plan fits `memory`."""
    fitting = [recompute_of(a, cost) for a in choices or brute if brute[a] <= memory]
    return min(fitting) if fitting else None


@pytest.mark.slow
def test_optimize_agrees_with_brute_force(model_file, brute, layer_costs):
    cost, _ = layer_costs
    uniform = [(m,) * len(LAYERS) for m in OPTIMIZE_MODES]
    low, high = min(brute[a] for a in uniform), max(brute[a] for a in uniform)
    grid = [low + (high - low) * k // 40 for k in range(41)]
    # 1. Somewhere a per-layer mix needs less recompute than every uniform choice that fits.
    mixed_wins = [m for m in grid if least_recompute(brute, cost, m) < least_recompute(brute, cost, m, uniform)]
    assert mixed_wins
    # 2. optimize agrees with the brute force there, and between the uniform choices' arenas.
    arenas = sorted(brute[a] for a in uniform)
    sizes = [mixed_wins[len(mixed_wins) // 2], *((a + b) // 2 for a, b in zip(arenas, arenas[1:]))]
    for memory in sizes:
        # the plan solver's time limit is the brute force's: like-for-like arenas
        step = StepSpec(model_file, **SHAPE)
        result = optimize(OptimizeOptions(step, memory=memory, capture="real", time_limit=2, actions=False))
        assert result.choice.status == "optimal"
        assert result.chosen.recompute == least_recompute(brute, cost, memory), memory
        assert result.chosen.plan_arena <= memory and brute[result.chosen.assignment] <= memory
        for candidate in result.uniform:  # the alternatives' figures are their traces'
            assert candidate.plan_arena == brute[candidate.assignment]


@pytest.mark.slow
def test_nothing_fits_is_an_error(model_file, brute):
    least = min(brute.values())
    result = CliRunner().invoke(
        main, ["optimize", model_file, "--memory", str(least // 2), "--batch", "1", "--seq", "128", "--capture", "real"]
    )
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines()[-1].startswith("Error: no assignment of modes and actions fits batch 1")


@pytest.mark.slow
def test_max_batch_json(model_file):
    # 6.5 MiB: batch 3, found by doubling (1, 2, 4) and bisection (3), at the other tests' shape so that batch 1 is
    # their measurement (4.4 MiB at s 32 took six batches' traces: batch 5, its activations small beside the state)
    memory = int(6.5 * (1 << 20))
    args = ["optimize", model_file, "--memory", "6.5MiB", "--max-batch", "--seq", "128", "--capture", "real", "--json"]
    result = CliRunner().invoke(main, [*args, "--time-limit", "2"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    batch = summary["batch"]
    assert batch >= 1 and summary["chosen"]["fits"] and summary["chosen"]["plan_arena"] <= memory
    # one more sample does not fit with any assignment, by the model
    with pytest.raises(OptimizeError, match=f"no assignment of modes and actions fits batch {batch + 1}"):
        optimize(OptimizeOptions(StepSpec(model_file, batch=batch + 1, seq=128), memory=memory, capture="real"))


def step_columns(trace) -> tuple[list, list]:
    """The step's buffers in allocation order, and those alive at its start in no particular order."""
    rows = list(zip(trace.size.tolist(), trace.alloc.tolist(), trace.free.tolist(), trace.category, trace.phase))
    return [r for r in rows if r[1] > 0], sorted(r for r in rows if r[1] == 0)


@pytest.mark.slow
def test_apply_of_the_choice_file_gives_the_trace_optimize_verified(model_file, tmp_path):
    """Issue 34's acceptance: `memplan optimize -o FILE` writes the chosen modes with their verified trace's
    digest, and `memplan.apply` of FILE on a fresh model gives the trace optimize verified (the same buffers in
    the same order; those alive at the step's start, adopted by `record`, in any order)."""
    # 1. A memory size between the two smallest uniform plans, where the choice mixes modes.
    loose = optimize(OptimizeOptions(StepSpec(model_file, **SHAPE), memory=1 << 40, capture="real", time_limit=2))
    smallest, next_smallest = sorted(c.plan_arena for c in loose.uniform)[:2]
    memory = (smallest + next_smallest) // 2
    choice_path = tmp_path / "choice.json"
    args = ["optimize", model_file, "--memory", str(memory), "--batch", "1", "--seq", "128", "--capture", "real"]
    result = CliRunner().invoke(main, [*args, "--time-limit", "2", "-o", str(choice_path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    choice = memplan.load_choice(choice_path)
    assert [mode for _, mode in choice.layers] == summary["chosen"]["assignment"]
    assert choice.plan_arena == summary["chosen"]["plan_arena"] <= memory == choice.memory
    # 2. The user's own loop: a fresh model from the same file, the choice applied in one line, a step recorded.
    torch.manual_seed(0)
    workload = import_model_file(model_file)(batch_size=1, seq_len=128, dtype=torch.float32, device="cpu")
    model, optimizer = memplan.apply(workload.model, workload.optimizer, choice_path, loss=workload.loss_fn)
    assert model is workload.model
    workload.optimizer = optimizer  # the loop steps the optimizer apply returns (rebuilt where the choice says)
    workload.step()  # the warm-up step optimize's traces run
    with memplan.record(model, optimizer, inputs=workload.inputs) as recording:
        workload.step()
    verified = trace_step(choice.step())  # the step the choice describes is the one optimize verified
    assert trace_digest(verified) == choice.trace_digest
    assert step_columns(recording.trace) == step_columns(verified)
    # 3. A choice for another model is refused, the model unchanged.
    other = import_model_file(model_file)(batch_size=1, seq_len=128, dtype=torch.float32, device="cpu")
    del other.model.layers[2]
    with pytest.raises(ChoiceError, match="this model has layers.0, layers.1"):
        memplan.apply(other.model, other.optimizer, choice_path)
    assert PATCHED not in vars(other.model)
