"""Exact placement with OR-Tools CP-SAT: minimise the arena, or decide whether it fits in a capacity.

NoOverlap2D over fixed lifetimes equals one NoOverlap per maximal set of buffers live at one time (the
maximal cliques of the interval graph); with several streams, conflicting pairs never live at one time
(no sync orders them) get a NoOverlap each.
Sizes are divided by their GCD, buffers that conflict with every other one are stacked at the bottom
outside the model, the lower bound is in the arena variable's domain, the greedy plan is the hint, and
identical buffers are ordered to break symmetry. Contiguous groups are rigid blocks, fixed offsets constants.
Given a deterministic-time budget, one worker searches (its path does not depend on thread timing) until
that budget is spent; the wall-clock limit is then a ceiling only. Two interleaved workers (OR-Tools'
deterministic parallel mode) overshot their budget up to 3.5x on MiniMalloc's G, so they are not used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from memplan.planner.problem import Problem
from memplan.solvers.items import Items, make_items

MAX_TERMS = 400_000  # clique memberships beyond which the model is too big to help within seconds
MAX_PAIRWISE_BUFFERS = 5000  # several streams: beyond this, listing unordered pairs costs too much


@dataclass
class CpResult:
    """What CP-SAT achieved: status optimal|feasible|infeasible|unknown, a placement if any, a proven bound."""

    status: str
    offsets: np.ndarray | None
    arena: int | None
    bound: int
    work: float = 0.0  # CP-SAT's deterministic time spent (its unit is close to a second)


def _live_cliques(problem: Problem, buffers: np.ndarray) -> list[np.ndarray]:
    """Maximal sets of buffers live at one time; they conflict pairwise on any number of streams."""
    FREE, ALLOC = 0, 1  # at equal times frees come first: a buffer freed at t and one allocated at t never meet
    events = sorted(
        [(int(problem.free[buffer]), FREE, buffer) for buffer in buffers]
        + [(int(problem.alloc[buffer]), ALLOC, buffer) for buffer in buffers]
    )
    live: set[int] = set()
    cliques, grew = [], False
    for _, kind, buffer in events:
        if kind == ALLOC:
            live.add(buffer)
            grew = True
        else:
            if grew:  # the first free after allocations: the live set is maximal
                cliques.append(np.fromiter(live, dtype=np.int64))
            grew = False
            live.discard(buffer)
    return cliques


def _unordered_pairs(problem: Problem, buffers: np.ndarray, limit: int) -> list[np.ndarray] | None:
    """Conflicting pairs never live at one time (several streams without a sync); None beyond `limit`."""
    pairs: list[np.ndarray] = []
    if problem.nstreams == 1:
        return pairs
    if len(buffers) > MAX_PAIRWISE_BUFFERS:
        return None
    for position, buffer in enumerate(buffers):
        later = buffers[position + 1 :]
        apart = (problem.alloc[later] >= problem.free[buffer]) | (problem.alloc[buffer] >= problem.free[later])
        for other in later[apart & problem.conflicts_with(int(buffer), later)]:
            pairs.append(np.array([buffer, other], dtype=np.int64))
        if len(pairs) > limit:
            return None
    return pairs


def _cliques(problem: Problem, buffers: np.ndarray) -> list[np.ndarray]:
    """Sets of mutually conflicting buffers that together cover every conflicting pair."""
    pairs = _unordered_pairs(problem, buffers, MAX_TERMS)
    if pairs is None:  # callers check model_terms first; dropping pairs would allow overlaps
        raise ValueError("too many unordered pairs for a CP-SAT model (check model_terms first)")
    return _live_cliques(problem, buffers) + pairs


def model_terms(problem: Problem) -> int:
    """Clique memberships the model would hold (a size estimate, to skip hopeless models)."""
    buffers = np.nonzero(problem.active)[0]
    if len(buffers) > MAX_TERMS:  # every buffer is in at least one clique
        return MAX_TERMS + 1
    times = np.concatenate([problem.alloc[buffers], problem.free[buffers]])
    change = np.concatenate([np.ones(len(buffers)), -np.ones(len(buffers))])
    order = np.lexsort((change, times))
    live = np.cumsum(change[order])
    rising = np.nonzero(np.diff(np.concatenate([[-1], change[order]])) < 0)[0]  # alloc followed by a free
    terms = int(live[rising - 1].sum()) if len(rising) else int(live.max(initial=0))
    pairs = _unordered_pairs(problem, buffers, MAX_TERMS // 2) if terms <= MAX_TERMS else None
    return MAX_TERMS + 1 if pairs is None else terms + 2 * len(pairs)


def _positions(items: Items, item: int) -> range:
    """Where item's members sit in items.members (and their offsets inside the item in items.rel)."""
    return range(items.start[item], items.start[item + 1])


def _members(items: Items, item: int) -> np.ndarray:
    """The buffers of one item (a single buffer, or a contiguous group in its order)."""
    return items.members[items.start[item] : items.start[item + 1]]


def _bottom_buffers(problem: Problem, items: Items) -> np.ndarray:
    """Single buffers that conflict with every other one, to stack from offset 0 with no variable; none on
    several streams, with fixed offsets, or when a buffer never live could share their bytes."""
    active = problem.active
    buffers = np.nonzero(active)[0]
    if problem.nstreams > 1 or problem.fixed or len(buffers) <= 1 or ((problem.size > 0) & ~active).any():
        return np.zeros(0, dtype=np.int64)
    single = np.zeros(len(problem), dtype=bool)
    alone = np.diff(items.start) == 1
    single[items.members[items.start[:-1][alone]]] = True
    earliest, latest = problem.alloc[buffers].min(), problem.free[buffers].max()
    return np.nonzero(single & active & (problem.alloc <= earliest) & (problem.free >= latest))[0]


def _grid_unit(problem: Problem, items: Items, preset: np.ndarray, pinned: np.ndarray, in_bottom: np.ndarray) -> int:
    """The GCD of every size and fixed offset: every offset of a canonical placement is a multiple of it."""
    values = np.concatenate([problem.size[~in_bottom], items.rel, items.size, preset[pinned]])
    return max(int(np.gcd.reduce(values)), 1)


def _hint_above_bottom(problem: Problem, hint: np.ndarray, bottom: np.ndarray) -> np.ndarray:
    """The hint with the bottom buffers' bytes squeezed out (they overlap nothing), so it stays valid."""
    bottom_offsets = np.sort(hint[bottom])
    below = np.concatenate([[0], np.cumsum(problem.size[bottom][np.argsort(hint[bottom])])])
    return hint - below[np.searchsorted(bottom_offsets, hint, side="left")]


def _buffer_intervals(
    model: cp_model.CpModel,
    problem: Problem,
    items: Items,
    model_items: list[int],
    item_offsets: dict[int, cp_model.IntVar],
    preset: np.ndarray,
    model_buffers: np.ndarray,
    base: int,
    unit: int,
) -> dict[int, cp_model.IntervalVar]:
    """One interval (in grid units) per live buffer in the model: its item's offset plus its place inside, or fixed."""
    active = problem.active
    intervals = {}
    for item in model_items:
        for position in _positions(items, item):
            buffer = int(items.members[position])
            if active[buffer]:
                start = item_offsets[item] + int(items.rel[position]) // unit
                intervals[buffer] = model.new_fixed_size_interval_var(
                    start, int(problem.size[buffer]) // unit, f"b{buffer}"
                )
    for buffer in model_buffers:
        if preset[buffer] >= 0:
            start = (int(preset[buffer]) - base) // unit
            intervals[int(buffer)] = model.new_fixed_size_interval_var(
                start, int(problem.size[buffer]) // unit, f"f{buffer}"
            )
    return intervals


def _identical_singles(problem: Problem, items: Items, model_items: list[int]) -> list[list[int]]:
    """Sets of single-buffer items with the same lifetime, stream and size: interchangeable in any placement."""
    by_key: dict[tuple[int, int, int, int], list[int]] = {}
    for item in model_items:
        if len(_positions(items, item)) == 1:
            buffer = int(items.members[items.start[item]])
            key = (problem.alloc[buffer], problem.free[buffer], problem.stream[buffer], problem.size[buffer])
            by_key.setdefault(tuple(int(value) for value in key), []).append(item)
    return [same for same in by_key.values() if len(same) > 1]


class _ArenaReport(cp_model.CpSolverSolutionCallback):
    """Tells on_solution the arena in bytes of every improving solution CP-SAT finds."""

    def __init__(self, arena: cp_model.IntVar, unit: int, base: int, on_solution: Callable[[int], None] | None):
        super().__init__()
        self.arena, self.unit, self.base, self.on_solution = arena, unit, base, on_solution

    def on_solution_callback(self) -> None:
        """Called by CP-SAT on each solution."""
        if self.on_solution is not None:
            self.on_solution(int(self.value(self.arena)) * self.unit + self.base)


def cpsat_place(
    problem: Problem,
    bound: int,
    seconds: float,
    hint: np.ndarray | None = None,
    capacity: int | None = None,
    workers: int = 2,
    on_solution: Callable[[int], None] | None = None,
    deterministic_time: float | None = None,
) -> CpResult:
    """Minimise the arena (or find one within `capacity`) in `seconds` with `workers` threads, or with one
    worker in `deterministic_time` and `seconds` as a ceiling; on_solution(arena) as it improves. The arena
    is every positive-size buffer's top, as the verifier counts it: buffers never live sit inside it too."""
    items, preset = make_items(problem)
    positive = problem.size > 0
    offsets = np.where(preset >= 0, preset, 0).astype(np.int64)

    # 1. Stack the buffers that conflict with every other one at the bottom; the model places the rest above.
    bottom = _bottom_buffers(problem, items)
    base = int(problem.size[bottom].sum())  # 0 whenever a buffer is fixed or inactive (no bottom then)
    offsets[bottom] = np.cumsum(problem.size[bottom]) - problem.size[bottom]
    in_bottom = np.zeros(len(problem), dtype=bool)
    in_bottom[bottom] = True
    model_buffers = np.nonzero(problem.active & ~in_bottom)[0]
    model_items = [item for item in range(len(items)) if not in_bottom[_members(items, item)].any()]

    # 2. Count bytes in grid units, the GCD of every size and fixed offset (smaller numbers, same placements).
    pinned = np.nonzero((preset >= 0) & positive)[0]
    unit = _grid_unit(problem, items, preset, pinned, in_bottom)

    # 3. Bound the arena above the bottom: at least the lower bound and the fixed tops, at most every item
    #    stacked (or the hint's top), within the capacity if one is given.
    fixed_top = int((preset + problem.size)[pinned].max(initial=0))
    highest = int(items.size[model_items].sum()) + fixed_top
    hint_offsets = None
    if hint is not None:
        hint_offsets = _hint_above_bottom(problem, np.asarray(hint, dtype=np.int64), bottom)
        highest = min(highest, int((hint_offsets + problem.size)[positive & ~in_bottom].max(initial=0)))
    lowest = max(bound - base, fixed_top, 0)
    highest = max(highest, lowest)
    if capacity is not None:
        highest = min(highest, capacity - base)
    if highest < lowest:
        return CpResult("infeasible", None, None, bound if capacity is None else capacity + 1)

    # 4. One offset variable per item, and the arena variable above every item's top.
    model = cp_model.CpModel()
    lowest_units = -(-lowest // unit)  # rounded up
    arena = model.new_int_var(lowest_units, highest // unit, "arena")
    item_offsets = {}
    for item in model_items:
        height = int(items.size[item]) // unit
        item_offsets[item] = model.new_int_var(0, max(highest // unit - height, 0), f"x{item}")
        model.add(item_offsets[item] + height <= arena)

    # 5. One interval per live buffer; buffers that conflict share no byte.
    intervals = _buffer_intervals(model, problem, items, model_items, item_offsets, preset, model_buffers, base, unit)
    for clique in _cliques(problem, model_buffers):
        if len(clique) > 1:
            model.add_no_overlap([intervals[int(buffer)] for buffer in clique])

    # 6. The hint in grid units, one base per item; none unless every base lies on the grid.
    hint_units = None
    if hint_offsets is not None:
        item_hints = [int(hint_offsets[_members(items, item)[0]]) for item in model_items]
        if all(offset % unit == 0 for offset in item_hints):
            hint_units = {item: offset // unit for item, offset in zip(model_items, item_hints)}

    # 7. Break symmetry: identical single buffers keep their order, in the model and in the hint.
    for same in _identical_singles(problem, items, model_items):
        for earlier, later in zip(same, same[1:]):
            model.add(item_offsets[earlier] <= item_offsets[later])
        if hint_units is not None:
            for item, offset in zip(same, sorted(hint_units[item] for item in same)):
                hint_units[item] = offset

    # 8. Hint the best plan so far, and minimise the arena unless deciding a capacity.
    if hint_units is not None:
        for item in model_items:
            model.add_hint(item_offsets[item], hint_units[item])
        tops = (hint_units[item] + int(items.size[item]) // unit for item in model_items)
        model.add_hint(arena, max(tops, default=lowest_units))
    if capacity is None:
        model.minimize(arena)

    # 9. Solve within the budget, reporting each improving arena.
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(seconds, 0.01)
    solver.parameters.num_workers = workers if deterministic_time is None else 1
    if deterministic_time is not None:
        solver.parameters.max_deterministic_time = max(deterministic_time, 0.001)
    status = solver.solve(model, _ArenaReport(arena, unit, base, on_solution))
    spent = solver.response_proto.deterministic_time
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT rejected the placement model: {model.validate()}")
    if status == cp_model.INFEASIBLE:
        return CpResult("infeasible", None, None, bound if capacity is None else capacity + 1, spent)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpResult("unknown", None, None, bound, spent)

    # 10. Read the offsets back in bytes; the arena is the placement's own top, the bound what was proven.
    for item in model_items:
        item_base = int(solver.value(item_offsets[item])) * unit + base
        for position in _positions(items, item):
            offsets[int(items.members[position])] = item_base + int(items.rel[position])
    arena_bytes = int((offsets + problem.size)[positive].max(initial=0))
    if capacity is not None:
        proven = bound
    elif status == cp_model.OPTIMAL:
        proven = arena_bytes
    else:
        proven = max(bound, int(math.ceil(solver.best_objective_bound)) * unit + base)
    status_name = "optimal" if proven >= arena_bytes else "feasible"
    return CpResult(status_name, offsets, arena_bytes, min(proven, arena_bytes), spent)
