"""Choose a mode per layer with CP-SAT: the least recompute whose modelled peak fits a memory size.

One Boolean per (layer, mode), exactly one mode per layer, and one per (layer, context): the layer's
mode and the next layer's, tied to the modes by flow constraints. Each segment of the step (terms.py)
is a linear constraint: the bytes the other layers hold in it (by their contexts), plus the segment's
own bytes under its owner's context, fit the memory; for a segment owned by a layer it is one
constraint per context of that layer, enforced when the layer has it. The objective is the recompute
FLOPs summed over layers, and among assignments of equal recompute the one that changes the fewest layers
(a mode that recomputes nothing there, such as selective over fused attention, is not chosen over as-built).
Assignments already traced and found not to fit are excluded by a cut each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from memplan.modes import AS_BUILT
from memplan.planner.optimize.terms import PREFIX, Assignment, Bytes, Context, MemoryTerms, Mode, owner_of

Flops = int


@dataclass(frozen=True)
class Choice:
    """CP-SAT's answer: the assignment, its modelled peak and recompute, and whether it is proven optimal."""

    assignment: Assignment | None  # None when no assignment fits
    peak: Bytes | None  # the model's peak of the assignment
    recompute: Flops | None  # its recompute FLOPs over every layer as built
    status: str  # optimal | feasible | infeasible | unknown (no answer in the time limit)


def recompute_of(assignment: Assignment, cost: dict[tuple[int, Mode], Flops]) -> Flops:
    """The recompute FLOPs of an assignment: the sum of its layers' costs."""
    return sum(cost[layer, mode] for layer, mode in enumerate(assignment))


def choose_modes(
    terms: MemoryTerms,
    cost: dict[tuple[int, Mode], Flops],
    memory: Bytes,
    excluded: Iterable[Assignment] = (),
    time_limit: float = 10.0,
) -> Choice:
    """The assignment of least recompute whose modelled peak is at most `memory`, other than `excluded`."""
    model = cp_model.CpModel()
    count, modes = len(terms.layers), terms.modes
    # 1. One mode per layer, and each layer's context (its mode, the next layer's) as one Boolean each.
    pick = {(j, m): model.NewBoolVar(f"layer{j}_{m}") for j in range(count) for m in modes}
    for j in range(count):
        model.AddExactlyOne(pick[j, m] for m in modes)
    context: dict[tuple[int, Context], cp_model.IntVar] = {(PREFIX, (None, m)): pick[0, m] for m in modes}
    for j in range(count):
        if j + 1 == count:
            context.update({(j, (m, None)): pick[j, m] for m in modes})
            continue
        for m in modes:
            for n in modes:
                context[j, (m, n)] = model.NewBoolVar(f"layer{j}_{m}_then_{n}")
            model.Add(sum(context[j, (m, n)] for n in modes) == pick[j, m])
        for n in modes:
            model.Add(sum(context[j, (m, n)] for m in modes) == pick[j + 1, n])

    # 2. Every segment fits: the other layers' held bytes within what its own bytes leave.
    def held_by_others(segment, owner):
        return sum(terms.held[j, segment, c] * chosen for (j, c), chosen in context.items() if j != owner)

    for segment in terms.segments:
        owner = owner_of(segment)
        if owner is None:
            model.Add(held_by_others(segment, owner) <= memory - terms.own[segment, None])
            continue
        for (j, c), chosen in context.items():
            if j == owner:
                model.Add(held_by_others(segment, owner) <= memory - terms.own[segment, c]).OnlyEnforceIf(chosen)
    # 3. Assignments known not to fit.
    for assignment in excluded:
        model.AddBoolOr([pick[j, m].Not() for j, m in enumerate(assignment)])
    # 4. The least recompute; then the fewest layers changed (worth less than one FLOP).
    recompute = sum(cost[j, m] * pick[j, m] for j in range(count) for m in modes)
    changed = sum(pick[j, m] for j in range(count) for m in modes if m != AS_BUILT)
    model.Minimize((count + 1) * recompute + changed)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1  # the same answer on every run
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Choice(None, None, None, "infeasible" if status == cp_model.INFEASIBLE else "unknown")
    assignment = tuple(next(m for m in modes if solver.Value(pick[j, m])) for j in range(count))
    return Choice(
        assignment,
        terms.peak(assignment),
        recompute_of(assignment, cost),
        "optimal" if status == cp_model.OPTIMAL else "feasible",
    )
