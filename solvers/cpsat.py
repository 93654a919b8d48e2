"""Exact placement with OR-Tools CP-SAT: minimise the arena, or decide whether it fits in a capacity.

NoOverlap2D over fixed lifetimes equals one NoOverlap per maximal set of buffers live at one time (the
maximal cliques of the interval graph); with several streams, conflicting pairs never live at one time
(no sync orders them) get a NoOverlap each.
Sizes are divided by their GCD, buffers that conflict with every other one are stacked at the bottom
outside the model, the lower bound is in the arena variable's domain, the greedy plan is the hint, and
identical buffers are ordered to break symmetry. Contiguous groups are rigid blocks, fixed offsets constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from memplan.planner.problem import Problem
from memplan.solvers.items import make_items

MAX_TERMS = 400_000  # clique memberships beyond which the model is too big to help within seconds
MAX_PAIRWISE_BUFFERS = 5000  # several streams: beyond this, listing unordered pairs costs too much


@dataclass
class CpResult:
    """What CP-SAT achieved: status optimal|feasible|infeasible|unknown, a placement if any, a proven bound."""

    status: str
    offsets: np.ndarray | None
    arena: int | None
    bound: int


def _live_cliques(p: Problem, active: np.ndarray) -> list[np.ndarray]:
    """Maximal sets of buffers live at one time; they conflict pairwise on any number of streams."""
    events = sorted([(int(p.free[i]), 0, i) for i in active] + [(int(p.alloc[i]), 1, i) for i in active])
    live: set[int] = set()
    out, grew = [], False
    for _, kind, i in events:
        if kind == 1:
            live.add(i)
            grew = True
        else:
            if grew:
                out.append(np.fromiter(live, dtype=np.int64))
            grew = False
            live.discard(i)
    return out


def _unordered_pairs(p: Problem, active: np.ndarray, limit: int) -> list[np.ndarray] | None:
    """Conflicting pairs never live at one time (several streams without a sync); None beyond `limit`."""
    out: list[np.ndarray] = []
    if p.nstreams == 1:
        return out
    if len(active) > MAX_PAIRWISE_BUFFERS:
        return None
    for k, i in enumerate(active):
        others = active[k + 1 :]
        apart = (p.alloc[others] >= p.free[i]) | (p.alloc[i] >= p.free[others])
        for j in others[apart & p.conflicts_with(int(i), others)]:
            out.append(np.array([i, j], dtype=np.int64))
        if len(out) > limit:
            return None
    return out


def _cliques(p: Problem, active: np.ndarray) -> list[np.ndarray]:
    """Sets of mutually conflicting buffers that together cover every conflicting pair."""
    pairs = _unordered_pairs(p, active, MAX_TERMS)
    if pairs is None:  # callers check model_terms first; dropping pairs would allow overlaps
        raise ValueError("too many unordered pairs for a CP-SAT model (check model_terms first)")
    return _live_cliques(p, active) + pairs


def model_terms(p: Problem) -> int:
    """Clique memberships the model would hold (a size estimate, to skip hopeless models)."""
    active = np.nonzero(p.active)[0]
    times = np.concatenate([p.alloc[active], p.free[active]])
    delta = np.concatenate([np.ones(len(active)), -np.ones(len(active))])
    order = np.lexsort((delta, times))
    live = np.cumsum(delta[order])
    rising = np.nonzero(np.diff(np.concatenate([[-1], delta[order]])) < 0)[0]  # alloc followed by a free
    terms = int(live[rising - 1].sum()) if len(rising) else int(live.max(initial=0))
    pairs = _unordered_pairs(p, active, MAX_TERMS // 2) if terms <= MAX_TERMS else None
    return MAX_TERMS + 1 if pairs is None else terms + 2 * len(pairs)


def cpsat_place(
    p: Problem,
    bound: int,
    seconds: float,
    hint: np.ndarray | None = None,
    capacity: int | None = None,
    workers: int = 2,
    on_solution=None,
) -> CpResult:
    """Minimise the arena (or find one within `capacity`) in `seconds`; on_solution(arena) as it improves.

    The arena is the top of every buffer of positive size, as the verifier counts it: buffers with an
    empty lifetime conflict with nothing but still sit inside it (a group's holes, fixed offsets)."""
    items, preset = make_items(p)
    act = p.active
    positive = p.size > 0
    offsets = np.where(preset >= 0, preset, 0).astype(np.int64)
    # Buffers that conflict with every other active buffer go to the bottom, outside the model; not when
    # a buffer that conflicts with nothing could share their bytes (positive size, empty lifetime).
    active = np.nonzero(act)[0]
    bottom: list[int] = []
    if p.nstreams == 1 and not p.fixed and len(active) > 1 and not (positive & ~act).any():
        single = np.zeros(len(p), dtype=bool)
        one = np.diff(items.start) == 1
        single[items.members[items.start[:-1][one]]] = True
        whole = single & act & (p.alloc <= p.alloc[active].min()) & (p.free >= p.free[active].max())
        bottom = np.nonzero(whole)[0].tolist()
    base = int(p.size[bottom].sum())  # 0 whenever a buffer is fixed or inactive (no bottom then)
    cursor = 0
    for i in bottom:
        offsets[i] = cursor
        cursor += int(p.size[i])
    in_bottom = np.zeros(len(p), dtype=bool)
    in_bottom[bottom] = True
    model_active = np.nonzero(act & ~in_bottom)[0]
    placed_items = [
        k for k in range(len(items)) if not in_bottom[items.members[items.start[k] : items.start[k + 1]]].any()
    ]
    pinned = np.nonzero((preset >= 0) & positive)[0]
    # Every offset of a canonical placement is a sum of sizes and fixed offsets: a multiple of their GCD.
    g = max(int(np.gcd.reduce(np.concatenate([p.size[~in_bottom], items.rel, items.size, preset[pinned]]))), 1)
    fixed_top = int((preset + p.size)[pinned].max(initial=0))
    ub = int(items.size[placed_items].sum()) + fixed_top
    hint_y = None
    if hint is not None:
        # Squeeze the bottom buffers' bytes out of the hint (they overlap nothing), keeping it valid.
        hint = np.asarray(hint, dtype=np.int64)
        below = np.sort(hint[bottom])
        shift = np.concatenate([[0], np.cumsum(p.size[bottom][np.argsort(hint[bottom])])])
        hint_y = hint - shift[np.searchsorted(below, hint, side="left")]
        ub = min(ub, int((hint_y + p.size)[positive & ~in_bottom].max(initial=0)))
    lo = max(bound - base, fixed_top, 0)
    ub = max(ub, lo)
    hi = ub if capacity is None else min(ub, capacity - base)
    if hi < lo:
        return CpResult("infeasible", None, None, bound if capacity is None else capacity + 1)
    m = cp_model.CpModel()
    arena = m.new_int_var(-(-lo // g), hi // g, "arena")
    x = {}
    for k in placed_items:
        x[k] = m.new_int_var(0, max(hi // g - int(items.size[k]) // g, 0), f"x{k}")
        m.add(x[k] + int(items.size[k]) // g <= arena)
    interval = {}
    for k in placed_items:
        for pos in range(items.start[k], items.start[k + 1]):
            b = int(items.members[pos])
            if act[b]:
                interval[b] = m.new_fixed_size_interval_var(
                    x[k] + int(items.rel[pos]) // g, int(p.size[b]) // g, f"b{b}"
                )
    for i in model_active:
        if preset[i] >= 0:
            interval[int(i)] = m.new_fixed_size_interval_var((int(preset[i]) - base) // g, int(p.size[i]) // g, f"f{i}")
    for clique in _cliques(p, model_active):
        if len(clique) > 1:
            m.add_no_overlap([interval[int(b)] for b in clique])
    # Symmetry: identical single buffers keep their order.
    key_of = {}
    for k in placed_items:
        if items.start[k + 1] - items.start[k] == 1:
            b = int(items.members[items.start[k]])
            key_of.setdefault((int(p.alloc[b]), int(p.free[b]), int(p.stream[b]), int(p.size[b])), []).append(k)
    hint_x = None
    if hint_y is not None and all(int(hint_y[items.members[items.start[k]]]) % g == 0 for k in placed_items):
        hint_x = {k: int(hint_y[items.members[items.start[k]]]) // g for k in placed_items}
    for same in key_of.values():
        if len(same) > 1:
            for a, b in zip(same, same[1:]):
                m.add(x[a] <= x[b])
            if hint_x is not None:
                for k, v in zip(same, sorted(hint_x[k] for k in same)):
                    hint_x[k] = v
    if hint_x is not None:
        for k in placed_items:
            m.add_hint(x[k], hint_x[k])
        m.add_hint(arena, max((hint_x[k] + int(items.size[k]) // g for k in placed_items), default=-(-lo // g)))
    if capacity is None:
        m.minimize(arena)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(seconds, 0.01)
    solver.parameters.num_workers = workers

    class Report(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self):
            if on_solution is not None:
                on_solution(int(self.value(arena)) * g + base)

    status = solver.solve(m, Report())
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT rejected the placement model: {m.validate()}")
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        for k in placed_items:
            for pos in range(items.start[k], items.start[k + 1]):
                offsets[int(items.members[pos])] = int(solver.value(x[k])) * g + int(items.rel[pos]) + base
        arena_bytes = int((offsets + p.size)[positive].max(initial=0))  # the placement's own top
        if capacity is not None:
            proven = bound
        elif status == cp_model.OPTIMAL:
            proven = arena_bytes
        else:
            proven = max(bound, int(math.ceil(solver.best_objective_bound)) * g + base)
        return CpResult(
            "optimal" if proven >= arena_bytes else "feasible", offsets, arena_bytes, min(proven, arena_bytes)
        )
    if status == cp_model.INFEASIBLE:
        return CpResult("infeasible", None, None, bound if capacity is None else capacity + 1)
    return CpResult("unknown", None, None, bound)
