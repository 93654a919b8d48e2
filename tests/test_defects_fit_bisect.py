"""`memplan fit` narrows the bracket between a batch that fits and one that does not by secant guesses and
bisection: the traces it takes grow as the logarithm of the answer, not linearly, when the affine
prediction is off by many batches, and the answer is the one stepping batch by batch gives."""

from pathlib import Path

import pytest

import memplan.planner.jobs.fit as fit
from memplan.planner.jobs.fit import MAX_BATCH, Point, fit_model
from memplan.step import StepSpec

GPT2 = str(Path(__file__).resolve().parents[1] / "examples" / "gpt2.py")
MEMORY = 1 << 20


def synthetic(caching_limit: int, quadratic_plan: bool):
    """A step whose caching reserved peak grows linearly, predicting about 29, while the OOM retry lets
    batches up to `caching_limit` fit; and whose plan arena is affine (predicted right, 180) or quadratic
    (predicted 143 where 50 fit): predictions off by tens or hundreds of batches."""

    def point(batch: int) -> Point:
        reserved = MEMORY // 10 + batch * (MEMORY // 33)
        arena = MEMORY // 10 + batch * (MEMORY // 200) + quadratic_plan * batch * batch * (MEMORY // 4000)
        return Point(batch, reserved, batch <= caching_limit, arena, arena, arena <= MEMORY, arena > MEMORY)

    return point


def stepping(point, allocator: str) -> int:
    """The answer by exhaustive stepping: the last batch before the first that does not fit."""
    b = 1
    while b < MAX_BATCH and point(b + 1).fits(allocator):
        b += 1
    return b


# (caching answer, plan quadratic, most traces allowed); the search stepping batch by batch took 27, 35, 176, 976
CASES = [(8, False, 12), (57, False, 20), (200, True, 32), (1000, False, 40)]


@pytest.mark.parametrize("caching_limit,quadratic_plan,most", CASES)
def test_fit_bisects_between_a_fitting_and_a_failing_batch(monkeypatch, caching_limit, quadratic_plan, most):
    point = synthetic(caching_limit, quadratic_plan)
    traced: list[int] = []

    def measure(self, batch):
        traced.append(batch)
        return point(batch)

    monkeypatch.setattr(fit.BatchProbe, "_measure", measure)
    (mode,) = fit_model(StepSpec("unused.py"), MEMORY, modes=("baseline",), capture="real").modes
    assert mode.batch == {"caching": stepping(point, "caching"), "plan": stepping(point, "plan")}
    assert abs(mode.predicted["caching"] - caching_limit) >= 20  # the prediction is off by many batches
    assert len(traced) == len(set(traced)) == mode.traces <= most, traced
    for allocator in ("caching", "plan"):  # b fits and b+1 does not, each by its own trace
        b = mode.batch[allocator]
        assert mode.points[b].fits(allocator) and not mode.points[b + 1].fits(allocator)


def test_fit_of_gpt2_gives_the_answer_of_stepping_batch_by_batch(monkeypatch):
    monkeypatch.delenv("MEMPLAN_PRESET", raising=False)  # tiny
    traced: list[int] = []
    trace = fit.trace_step

    def counted(step):
        traced.append(step.batch)
        return trace(step)

    monkeypatch.setattr(fit, "trace_step", counted)
    memory, seq = 8 << 20, 16
    (mode,) = fit_model(StepSpec(GPT2, seq=seq), memory, modes=("baseline",), time_limit=2.0).modes
    assert len(traced) == mode.traces <= 14, traced
    every = fit.BatchProbe(
        StepSpec(GPT2, seq=seq, mode="baseline"), memory, alloc_conf="", time_limit=2.0, progress=lambda _: None
    )
    for allocator in ("caching", "plan"):
        assert mode.batch[allocator] == stepping(every, allocator) >= 4
