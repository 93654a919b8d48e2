"""`memplan compare`: one table across traces (baseline against tempo, or one row per rank).

Per trace: peak live bytes and what is live at that peak by category, the caching allocator's peak
reserved, the plan's arena (a given plan, or one solved on the spot under a short time limit) and
the best lower bound known.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memplan.planner.plan import Plan
from memplan.planner.report.memory_report import phase_at, trace_title
from memplan.planner.report.tables import text_table
from memplan.planner.simulate.measure import FIGURES, Measurement, measure
from memplan.planner.simulate.plan_footprint import match_plans
from memplan.traces.format import CATEGORIES, Trace
from memplan.traces.summary import bytes_by_category
from memplan.units import human_bytes


@dataclass
class CompareRow:
    """The figures of one trace in the comparison; bytes unless said otherwise."""

    name: str
    title: str  # model · layers · rank, from the trace's meta
    buffers: int
    peak_live: int
    peak_live_time: int
    peak_live_phase: str
    at_peak: dict[str, int]  # bytes live at the peak, by category (every category of any trace)
    caching_peak_allocated: int
    caching_peak_reserved: int
    plan_arena: int
    plan_outside: int  # bytes a step plan leaves outside its arena (0 for a plan of every buffer)
    status: str  # the plan's proof: optimal or feasible
    gap: float  # arena / the solver's bound - 1
    solver: str  # the method that found the plan
    plan_source: str  # the plan file, or "solved: METHOD" when solved here
    bound: int  # the best lower bound known: max-live, or the solver's if higher


def row_from_measurement(measured: Measurement, categories: list[str], plan_source: str) -> CompareRow:
    """The comparison row of one measured trace (which must have a plan)."""
    trace, figures = measured.trace, measured.figures()
    peak_t = trace.peak()[1]
    by_category = bytes_by_category(trace, peak_t)
    return CompareRow(
        **{key: figures[key] for key in FIGURES if key != "plan_arena"},
        name=measured.name,
        title=trace_title(trace, measured.name),
        peak_live_time=peak_t,
        peak_live_phase=phase_at(trace, peak_t),
        at_peak={c: by_category[c] for c in categories},
        plan_arena=measured.plan_memory.arena,  # a step plan's arena holds only the step's own buffers
        plan_outside=measured.plan_memory.peak_outside,
        plan_source=plan_source,
    )


def compare_traces(
    traces: list[tuple[str, Trace]],
    plans: list[tuple[str, Plan]] = (),
    alloc_conf: str = "",
    method: str = "auto",
    time_limit: float = 5.0,
    progress=lambda msg: None,
    tie_break: str = "lowest_address",
) -> list[CompareRow]:
    """Compare `traces` (name, trace); each uses the plan made for it among `plans`, else one solved here."""
    matched = match_plans(traces, list(plans))
    categories = [c for c in CATEGORIES if any(c in t.category for _, t in traces)]
    rows = []
    for (name, trace), given in zip(traces, matched):
        plan_name, plan = given or (None, None)
        how = "simulating the caching allocator" if given else f"solving a plan ({method}, at most {time_limit:g} s)"
        progress(f"{name}: {how}")
        measured = measure(trace, name, plan=plan, plan_name=plan_name, time_limit=time_limit, method=method,
                           alloc_conf=alloc_conf, tie_break=tie_break)  # fmt: skip
        rows.append(row_from_measurement(measured, categories, plan_name or f"solved: {method}"))
    return rows


def compare_summary(rows: list[CompareRow]) -> dict:
    """The JSON document of `memplan compare`: one object per trace, in the order given."""
    return {"traces": [asdict(r) for r in rows]}


def _change(value: int, first: int) -> str:
    return f" ({(value - first) / first:+.1%})" if first else ""


def plan_cell(r: CompareRow) -> str:
    gap = "" if r.status == "optimal" else f" (gap {r.gap:.2%})"
    return f"{r.status}{gap}, {r.plan_source}"


def compare_text(rows: list[CompareRow]) -> str:
    """The comparison as a text table: one column per trace, changes relative to the first trace."""

    def bytes_row(label, get):
        return [label] + [
            human_bytes(get(r)) + (_change(get(r), get(rows[0])) if k else "") for k, r in enumerate(rows)
        ]

    table = [
        [""] + [r.name for r in rows],
        ["workload"] + [r.title for r in rows],
        ["buffers"] + [f"{r.buffers:,}" for r in rows],
        bytes_row("peak live", lambda r: r.peak_live),
        ["  at event"] + [f"{r.peak_live_time:,} ({r.peak_live_phase})" for r in rows],
    ]
    table += [bytes_row(f"  {c}", lambda r, c=c: r.at_peak[c]) for c in rows[0].at_peak]
    table += [
        bytes_row("caching peak allocated", lambda r: r.caching_peak_allocated),
        bytes_row("caching peak reserved", lambda r: r.caching_peak_reserved),
        bytes_row("plan arena", lambda r: r.plan_arena),
    ]
    if any(r.plan_outside for r in rows):
        table += [bytes_row("  + outside the plan", lambda r: r.plan_outside)]
    table += [bytes_row("lower bound", lambda r: r.bound), ["plan"] + [plan_cell(r) for r in rows]]
    return "\n".join(text_table(table, strip=True))
