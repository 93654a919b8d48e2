"""A step's memory as memplan measures it, from its trace: one Measurement that every command embeds (run, fit,
tradeoff, optimize, compare, simulate, plot), so each figure is computed one way and named one way."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from memplan.gpus import GPU
from memplan.planner.plan import Plan
from memplan.planner.problem import DEFAULT_ALIGNMENT, Problem, problem_from_trace
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.caching_allocator import SimResult, simulate_caching
from memplan.planner.simulate.plan_footprint import PlanMemory, simulate_plan
from memplan.planner.simulate.verdict import Verdict, judge, trace_budget
from memplan.solvers import solve
from memplan.traces.format import Trace

# The figures' JSON keys, the same in every command's --json: see Measurement.figures.
FIGURES = (
    "buffers",
    "peak_live",
    "caching_peak_reserved",
    "caching_peak_allocated",
    "plan_arena",
    "bound",
    "status",
    "gap",
    "solver",
)


@dataclass
class Measurement:
    """One trace measured: its max-live bound, PyTorch's caching allocator simulated on it and, when it has one,
    its plan (checked to be the trace's) with the plan's footprint."""

    name: str  # what the user called the trace (its path, or the mode it was traced under)
    trace: Trace
    problem: Problem  # the trace's allocation problem (every buffer, sizes aligned as the plan's, 512 without one)
    bound: int  # its max-live lower bound on any plan's arena (at that alignment)
    caching: SimResult  # the caching allocator simulated: peaks, series, out-of-memory
    alloc_conf: str  # the PYTORCH_CUDA_ALLOC_CONF string simulated ("" for the defaults)
    capacity: int | None  # the device capacity simulated, None for unlimited
    tie_break: str = "lowest_address"  # which of equal free blocks the simulated allocator takes
    plan: Plan | None = None  # the plan, verified against the trace; None when the trace was not planned
    plan_name: str | None = None  # where the plan came from (its file)
    plan_memory: PlanMemory | None = None  # the plan's footprint over time; None without a plan
    verdict: Verdict | None = None  # whether the step fits a GPU (planner/simulate/verdict.py); None without one

    @cached_property
    def live(self) -> np.ndarray:
        """Requested bytes live at each logical time."""
        return self.trace.live_bytes()

    @cached_property
    def peak_live(self) -> int:
        """The most bytes held by live tensors at once (requested sizes)."""
        return int(self.trace.peak()[0])

    def figures(self) -> dict:
        """The figures every command reports under the same keys (FIGURES): buffers, peak live, the caching
        allocator's peak reserved and allocated, and the plan's arena, best lower bound (never below max-live),
        proof status, gap and solver (None without a plan)."""
        plan = self.plan
        return {
            "buffers": len(self.trace),
            "peak_live": self.peak_live,
            "caching_peak_reserved": int(self.caching.peak_reserved),
            "caching_peak_allocated": int(self.caching.peak_allocated),
            "plan_arena": None if plan is None else plan.arena,
            "bound": self.bound if plan is None else max(self.bound, plan.bound),
            "status": None if plan is None else plan.status,
            "gap": None if plan is None else plan.gap,
            "solver": None if plan is None else plan.solver,
        }


def simulate_trace(
    trace: Trace,
    name: str,
    plan: Plan | None = None,
    plan_name: str | None = None,
    alloc_conf: str = "",
    capacity: int | None = None,
    tie_break: str = "lowest_address",
    problem: Problem | None = None,
    gpu: GPU | None = None,
) -> Measurement:
    """Simulate `trace` on the caching allocator and, when given, on `plan` (verified against it first), and judge
    whether it fits `gpu` when given; `problem` is the trace's allocation problem when the caller has built it. The
    max-live bound is taken at the plan's alignment, so it is never above a valid plan's arena."""
    conf = parse_alloc_conf(alloc_conf, tie_break)
    alignment = DEFAULT_ALIGNMENT if plan is None else plan.alignment
    if problem is None or problem.alignment != alignment or problem.scope != "all":
        problem = problem_from_trace(trace, alignment=alignment)
    plan_memory = simulate_plan(trace, plan, name, plan_name or "plan") if plan is not None else None
    caching = simulate_caching(trace, conf, capacity=capacity)
    unlimited = caching if capacity is None else None
    verdict = None if gpu is None else judge(trace, trace_budget(gpu, trace), conf, alloc_conf, unlimited)
    return Measurement(
        name=name,
        trace=trace,
        problem=problem,
        bound=problem.max_live(),
        caching=caching,
        alloc_conf=alloc_conf,
        capacity=capacity,
        tie_break=tie_break,
        plan=plan,
        plan_name=plan_name,
        plan_memory=plan_memory,
        verdict=verdict,
    )


def measure(
    trace: Trace,
    name: str = "trace",
    *,
    plan: Plan | None = None,
    plan_name: str | None = None,
    time_limit: float = 10.0,
    method: str = "auto",
    alloc_conf: str = "",
    capacity: int | None = None,
    tie_break: str = "lowest_address",
    gpu: GPU | None = None,
) -> Measurement:
    """`trace` measured with a plan: `plan` (checked to be the trace's), or one solved here by the solver portfolio
    (`method`, `time_limit` seconds; verified before it is returned); judged against `gpu` when given."""
    problem = problem_from_trace(trace)
    if plan is None:
        plan = solve(problem, method=method, time_limit=time_limit)
    return simulate_trace(trace, name, plan, plan_name, alloc_conf, capacity, tie_break, problem, gpu)
