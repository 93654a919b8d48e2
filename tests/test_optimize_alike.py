"""Alike layers measured on walks (planner/optimize/alike.py): the walks show every pair of modes, the model they give
bounds every context the alternating pairs measure and every traced assignment, a model whose layers differ is
told apart, and `optimize` uses the walks end to end."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from shared_steps import shared_steps

import memplan.planner.jobs.optimize as optimize_job
from memplan.modes import AS_BUILT
from memplan.planner.jobs.optimize import (
    OptimizeError,
    OptimizeOptions,
    every_layer,
    measure_batch,
    model_layers,
    optimize,
    step_of,
)
from memplan.planner.optimize.alike import EDGE, alike_terms, layers_alike, walks_to_trace
from memplan.planner.optimize.choose import choose_modes
from memplan.planner.optimize.terms import assignments_to_trace, memory_terms, owner_of
from memplan.planner.problem import align_up
from memplan.step import StepSpec
from memplan.traces.format import live_bytes

pytestmark = pytest.mark.slow  # about a minute: some 60 real traces of an 8-layer model
MODES = (AS_BUILT, "tempo", "selective", "full", "tempo+offload")  # in place, recompute, checkpoint, offload
LAYERS = 8
BANDWIDTH = 25_000_000_000  # 25 GB/s one way: offloading costs time
MODEL = """
from dataclasses import replace

from memplan.planner.workloads.blocks import language_model_workload
from memplan.planner.workloads.llama import Llama, LlamaConfig, LlamaLayer

CONFIG = LlamaConfig(layers={layers})


def model():
    built = Llama(CONFIG)
    for index in {wider}:  # a layer unlike the others: a wider MLP
        built.layers[index] = LlamaLayer(replace(CONFIG, ffn_hidden=4 * CONFIG.ffn_hidden))
    return built


def build(batch_size, seq_len, dtype, device):
    return language_model_workload(model, CONFIG.vocab_size, batch_size, seq_len, dtype, device, 0, 1e-4, "llama")
"""


def model_file(folder, wider=()) -> str:
    path = folder / f"llama_{len(wider)}.py"
    path.write_text(MODEL.format(layers=LAYERS, wider=tuple(wider)))
    return str(path)


def traced_peak(trace) -> int:
    size = align_up(trace.size.astype(np.int64), 512)
    return int(live_bytes(size, trace.alloc, trace.free, trace.end).max())


@pytest.fixture(scope="module", autouse=True)
def steps():
    """Each step traced and counted once in this module: by the tests, and by the optimize runs that trace the
    same assignments again (the uniform ones, the walks, the pairs) at the same batch and shape."""
    with shared_steps(optimize_job) as steps:
        yield steps


class Traces:
    """Real traces of one model file's steps at batch 2, s 64, each taken once (in `steps`)."""

    def __init__(self, path: str, steps):
        torch.set_num_threads(1)
        self.opts = OptimizeOptions(StepSpec(path, batch=2, seq=64), memory=1 << 40, capture="real")
        self.layers = model_layers(self.opts)
        self.steps = steps

    def __call__(self, assignment):
        return self.steps.trace(step_of(self.opts, self.layers, assignment, 2, False))

    def of(self, assignments):
        return {a: self(a) for a in assignments}


@pytest.fixture(scope="module")
def alike(tmp_path_factory, steps):
    return Traces(model_file(tmp_path_factory.mktemp("alike")), steps)


def uniform(layers):
    return [every_layer(layers, m) for m in MODES]


def test_walks_show_every_pair_of_distinct_modes_inside_the_edges():
    for modes, count in [(MODES, 8), (MODES, 32), (MODES[:2], 6), (MODES + ("a", "b", "c"), 32)]:
        walks = walks_to_trace(modes, count)
        shown = [(w[j], w[j + 1]) for w in walks for j in range(EDGE, count - EDGE)]
        pairs = {(m, n) for m in modes for n in modes if m != n}
        assert pairs <= set(shown), (modes, count)
        assert all(len(w) == count and set(w) <= set(modes) for w in walks)
        assert len(walks) == -(-len(pairs) // (count - 2 * EDGE))  # each walk shows count - 2 EDGE new pairs
    assert walks_to_trace(MODES, 2 * EDGE) is None  # too short for a walk
    assert walks_to_trace(MODES, 8) and len(walks_to_trace(MODES, 8)) < len(MODES) * (len(MODES) - 1)


def test_the_walks_model_bounds_the_pairs_model_and_every_traced_assignment(alike):
    layers = alike.layers
    assert layers_alike(alike.of(uniform(layers)), layers)
    walks = walks_to_trace(MODES, len(layers))
    model = alike_terms(alike.of(uniform(layers) + walks), layers)
    exact = memory_terms(alike.of(assignments_to_trace(MODES, len(layers))), layers)
    # 1. Every term the alternating pairs measure, the walks' model has at least: the same contexts, read elsewhere.
    assert set(model.own) == set(exact.own)
    assert all(model.own[key] >= value for key, value in exact.own.items())
    used = [key for key in exact.held if owner_of(key[1]) != key[0]]  # a layer's bytes in its own segment are own's
    assert all(model.held[key] >= exact.held[key] for key in used)
    # 2. Assignments neither model traced: the walks' model bounds the traced peak, within 1% of it.
    rng = random.Random(0)
    for _ in range(12):
        assignment = tuple(rng.choice(MODES) for _ in layers)
        traced = traced_peak(alike(assignment))
        assert traced <= model.peak(assignment) <= traced * 1.01, assignment


def test_layers_that_differ_are_told_apart(tmp_path, steps):
    unlike = Traces(model_file(tmp_path, wider=(3,)), steps)
    assert not layers_alike(unlike.of(uniform(unlike.layers)[:2]), unlike.layers)


def test_optimize_measures_alike_layers_on_walks_and_its_choice_fits(alike):
    layers, opts = alike.layers, alike.opts
    tempo = traced_peak(alike(every_layer(layers, "tempo")))  # the cheapest mode that saves memory
    least = min(traced_peak(alike(a)) for a in uniform(layers))
    memory = tempo - (tempo - least) // 3  # tempo does not fit: a mix of it and dearer modes does
    options = OptimizeOptions(opts.step, memory, capture="real", time_limit=5, actions=False, modes=MODES,
                              host_bandwidth=BANDWIDTH)  # fmt: skip
    result = optimize(options)
    assert any("walks through the modes" in note for note in result.notes)
    assert result.chosen is not None and result.chosen.fits and result.chosen.plan_arena <= memory
    assert result.choice.status == "optimal" and result.choice.least_work == result.choice.work
    assert result.gap_seconds() == 0 and result.summary()["gap_seconds"] == 0
    assert len(set(result.chosen.assignment)) > 1, result.chosen.assignment
    every = optimize(replace(options, alike=False))
    assert not any("walks" in note for note in every.notes)
    assert every.chosen.work <= result.chosen.work  # the pairs' model is tighter or equal, never looser


def test_offloading_modes_without_a_host_link_are_refused_before_any_trace(alike):
    with pytest.raises(OptimizeError, match="host link"):
        OptimizeOptions(alike.opts.step, 1 << 30, modes=MODES)


def test_work_at_an_h100s_scale_is_chosen_as_at_a_cpus(alike):
    """Costs a billion times larger (a host optimizer's 72 s at an H100's rate is 7e16 FLOPs): CP-SAT counts work in
    coarser units then, and answers as at 1x; it refused such a model before, which read as no answer."""
    options = OptimizeOptions(alike.opts.step, 1 << 40, capture="real", modes=MODES, host_bandwidth=BANDWIDTH)
    measured = measure_batch(options, alike.layers, 2, False, lambda _: None)
    memory = measured.terms.peak(every_layer(alike.layers, "tempo")) - 64 * 1024  # tempo alone does not fit
    scale = 10**9
    small = choose_modes(measured.terms, measured.cost, memory, (), 10, measured.action_cost)
    large = choose_modes(measured.terms, {k: v * scale for k, v in measured.cost.items()}, memory, (), 10,
                         {a: v * scale for a, v in measured.action_cost.items()})  # fmt: skip
    assert small.status == "optimal" and large.status in ("optimal", "feasible")
    assert (large.assignment, large.actions) == (small.assignment, small.actions)
    assert large.work == small.work * scale and large.least_work <= large.work


def test_a_plan_above_the_models_peak_narrows_the_memory_of_the_next_choice(alike, monkeypatch):
    """Plans that take 1 MiB beyond their peak (a packing that leaves room, as near a full GPU): the first choice
    is rejected by its trace, and the next is asked for the memory less what it took beyond the model's peak, so
    it fits at once rather than after its neighbours are cut one by one."""
    import memplan.planner.jobs.optimize as optimize_job

    room, measure = 1 << 20, optimize_job.measure

    class Roomy:
        def __init__(self, measurement):
            self.measurement = measurement

        def figures(self):
            return {**self.measurement.figures(), "plan_arena": self.measurement.figures()["plan_arena"] + room}

    monkeypatch.setattr(optimize_job, "measure", lambda *args, **kwargs: Roomy(measure(*args, **kwargs)))
    memory = traced_peak(alike(every_layer(alike.layers, "tempo"))) - (1 << 18)
    result = optimize(OptimizeOptions(alike.opts.step, memory, capture="real", time_limit=5, actions=False,
                                      modes=MODES, host_bandwidth=BANDWIDTH))  # fmt: skip
    assert len(result.rejected) == 1 and result.rejected[0].plan_arena > memory
    margin = result.rejected[0].plan_arena - result.rejected[0].predicted_peak
    assert result.chosen.fits and result.chosen.predicted_peak <= memory - margin
