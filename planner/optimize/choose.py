"""Choose a mode per layer, and the step-level actions, with CP-SAT: the least added work whose modelled peak fits a
memory size.

One Boolean per (layer, mode), exactly one mode per layer, and one per (layer, context): the layer's
mode and the next layer's, tied to the modes by flow constraints. Each segment of the step (terms.py)
is a linear constraint: the bytes the other layers hold in it (by their contexts), plus the segment's
own bytes under its owner's context, fit the memory; for a segment owned by a layer it is one
term per context of that layer (exactly one of which is chosen). A step-level action (terms.Action: the loss
fused, an optimizer choice) is one Boolean, at most one per family, adding its delta to every segment. The
objective is the added work summed over layers and actions, in FLOPs at the device's rate (recompute as counted,
a transfer's seconds times the rate), and among choices of equal work the one that changes the least: the fewest
parts of modes over the layers, then the fewest actions, then the earlier choice of a family (a mode that
recomputes nothing there, such as selective over fused attention, is not chosen over as-built, nor tempo+selective
over tempo; 8-bit state over 4-bit). Choices already traced and found not to fit are excluded by a cut each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from memplan.errors import MemplanError
from memplan.modes import BASELINE, mode
from memplan.planner.optimize.terms import PREFIX, Action, Assignment, Bytes, Context, MemoryTerms, Mode, owner_of

Flops = int  # work: FLOPs, or seconds at the device's FLOP rate
# the most the objective may reach: CP-SAT's integers are 64-bit, its LP's doubles exact to 2^53
OBJECTIVE_LIMIT = 2**50


class ChooseError(MemplanError):
    """CP-SAT refused the model built from the terms (a defect of this module, said as one line)."""


@dataclass(frozen=True)
class Choice:
    """CP-SAT's answer: the assignment and actions, their modelled peak and added work, and whether it is proven
    optimal."""

    assignment: Assignment | None  # None when no assignment fits
    peak: Bytes | None  # the model's peak of the assignment
    recompute: Flops | None  # its added work over every layer as built (recompute, transfers)
    status: str  # optimal | feasible | infeasible | unknown (no answer in the time limit)
    actions: tuple[Action, ...] = ()  # the step-level actions chosen (none: the step's own loss and optimizer)
    work: Flops | None = None  # the added work of the layers and the actions together
    least_work: Flops | None = None  # CP-SAT's bound: no choice that fits the model adds less (= work when optimal)


def recompute_of(assignment: Assignment, cost: dict[tuple[int, Mode], Flops]) -> Flops:
    """The added work of an assignment's layers: the sum of their costs."""
    return sum(cost[layer, mode] for layer, mode in enumerate(assignment))


def work_of(
    assignment: Assignment, actions: tuple[Action, ...], cost: dict[tuple[int, Mode], Flops], action_cost: dict
) -> Flops:
    """The added work of an assignment with step-level actions: its layers' and its actions' costs."""
    return recompute_of(assignment, cost) + sum(action_cost[a] for a in actions)


def changes(name: str) -> int:
    """How much a layer mode changes a layer, for ties: its parts beyond baseline (as-built 0, tempo 1,
    tempo+selective 2)."""
    return len(mode(name).parts - {BASELINE})


def families(actions) -> dict[str, list[Action]]:
    """Offered actions by family, in the order given (a family's earlier choice wins ties)."""
    grouped: dict[str, list[Action]] = {}
    for action in actions:
        grouped.setdefault(action[0], []).append(action)
    return grouped


def choose_modes(
    terms: MemoryTerms,
    cost: dict[tuple[int, Mode], Flops],
    memory: Bytes,
    excluded: Iterable[tuple[Assignment, tuple[Action, ...]]] = (),
    time_limit: float = 10.0,
    action_cost: dict[Action, Flops] | None = None,
    hint: tuple[Assignment, tuple[Action, ...]] | None = None,
) -> Choice:
    """The assignment (and step-level actions, those of `action_cost` that `terms` has deltas for) of least added work
    whose modelled peak is at most `memory`, other than the `excluded` (assignment, actions) pairs. A `hint` that
    fits (a uniform choice, say) starts the search: many alike layers make a first solution slow to find."""
    action_cost = {a: c for a, c in (action_cost or {}).items() if a in terms.deltas}
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

    # 2. At most one action of each family (none: the step's own).
    act = {a: model.NewBoolVar(f"{a[0]}_{a[1]}") for a in action_cost}
    grouped = families(action_cost)
    for members in grouped.values():
        model.AddAtMostOne(act[a] for a in members)

    # 3. Every segment fits: the other layers' held bytes and the actions' deltas within what its own bytes leave.
    def held_by_others(segment, owner):
        held = sum(terms.held[j, segment, c] * chosen for (j, c), chosen in context.items() if j != owner)
        return held + sum(terms.deltas[a][segment] * act[a] for a in act)

    for segment in terms.segments:
        owner = owner_of(segment)
        if owner is None:
            model.Add(held_by_others(segment, owner) <= memory - terms.own[segment, None])
            continue
        # the owner's own bytes under its one chosen context: one constraint, not one per context enforced by it
        # (64 contexts of 8 modes made a 32-layer model of millions of terms CP-SAT could not start on in 10 s)
        own = sum(terms.own[segment, c] * chosen for (j, c), chosen in context.items() if j == owner)
        model.Add(held_by_others(segment, owner) + own <= memory)
    # 4. Choices known not to fit.
    for assignment, actions in excluded:
        chosen = [act[a].Not() for a in actions if a in act]
        chosen += [act[a] for a in act if a not in actions]
        model.AddBoolOr([pick[j, m].Not() for j, m in enumerate(assignment)] + chosen)
    # 5. The least work; then the fewest changes (all of them together worth less than one unit of work). Work is
    #    counted in units of `unit` FLOPs, rounded up, where in FLOPs the objective would pass what CP-SAT's integers
    #    hold (a host optimizer's 72 s at an H100's rate is 7e16 FLOPs): a unit is then nanoseconds' work.
    most_changed = count * max(changes(m) for m in modes) + sum(len(members) for members in grouped.values())
    most_work = sum(max(cost[j, m] for m in modes) for j in range(count)) + sum(action_cost.values())
    unit = max(1, math.ceil(most_work * (most_changed + 1) / OBJECTIVE_LIMIT))
    work = sum(math.ceil(cost[j, m] / unit) * pick[j, m] for j in range(count) for m in modes)
    work += sum(math.ceil(action_cost[a] / unit) * act[a] for a in act)
    changed = sum(changes(m) * pick[j, m] for j in range(count) for m in modes)
    changed += sum((1 + members.index(a)) * act[a] for members in grouped.values() for a in members)
    model.Minimize((most_changed + 1) * work + changed)
    # 6. The hint, where given: its layers' modes, their contexts and its actions.
    if hint is not None:
        hinted, hinted_actions = hint
        for (j, m), var in pick.items():
            model.AddHint(var, hinted[j] == m)
        for (j, c), var in context.items():
            if j >= 0 and j + 1 < count:
                model.AddHint(var, (hinted[j], hinted[j + 1]) == c)
        for a, var in act.items():
            model.AddHint(var, a in hinted_actions)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1  # the same answer on every run
    solver.parameters.linearization_level = 2  # the LP of every constraint: on 32 alike layers of 8 modes it proves
    #                                             or bounds within a FLOP what level 1 left at a bound of 0 in 10 s
    status = solver.Solve(model)
    if status == cp_model.MODEL_INVALID:  # a defect here, never "no answer in the time limit"
        raise ChooseError(f"CP-SAT refused the model: {model.Validate()}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Choice(None, None, None, "infeasible" if status == cp_model.INFEASIBLE else "unknown")
    assignment = tuple(next(m for m in modes if solver.Value(pick[j, m])) for j in range(count))
    actions = tuple(a for a in act if solver.Value(act[a]))
    added = work_of(assignment, actions, cost, action_cost)
    bound = math.ceil(solver.BestObjectiveBound()) // (most_changed + 1)  # in units, each term rounded up (< 1 each)
    rounded = 0 if unit == 1 else count + len(act)
    least = added if status == cp_model.OPTIMAL and unit == 1 else min(added, max(0, bound - rounded) * unit)
    return Choice(
        assignment,
        terms.peak(assignment, actions),
        recompute_of(assignment, cost),
        "optimal" if status == cp_model.OPTIMAL else "feasible",
        actions,
        added,
        least,
    )
