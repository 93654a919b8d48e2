"""View of `memplan fit`: its table for the terminal, a function of the job's summary (its --json)."""

from __future__ import annotations

from memplan.planner.report.tables import text_table
from memplan.planner.report.trace_text import loss_words, no_change_mark
from memplan.planner.report.verdict_text import render_budget
from memplan.traces.compile import describe_compile
from memplan.traces.ranks.family import ranks_label
from memplan.units import format_size


def _fit_word(fits: bool | None, miss: str = "OOM") -> str:
    return "-" if fits is None else "fits" if fits else miss


def rank_lines(summary: dict) -> list[str]:
    """With --nproc: per mode, each distinct rank's figures at the job's batch b and at b+1 side by side, whether it
    fits at each, and the tightest rank under each allocator model."""
    s = summary
    lines = [f"on {s['world_size']} ranks: a batch fits only if it fits on every rank"]
    cols = ("mode", "ranks", "reserved* b / b+1", "caching b / b+1", "arena b / b+1", "plan b / b+1")
    rows = []
    for m in s["modes"]:
        caching, plan = m["ranks"]["caching"]["per_rank"], m["ranks"]["plan"]["per_rank"]
        for c, p in zip(caching, plan):
            rows.append(
                (
                    m["mode"],
                    ranks_label(c["ranks"]).split(" ", 1)[1],
                    f"{_size(c['at_batch'])} / {_size(c['at_next'])}",
                    f"{_fit_word(c['fits_at_batch'])} / {_fit_word(c['fits_at_next'])}",
                    f"{_size(p['at_batch'])} / {_size(p['at_next'])}",
                    f"{_fit_word(p['fits_at_batch'], 'no plan')} / {_fit_word(p['fits_at_next'], 'no plan')}",
                )
            )
    lines += text_table([cols, *rows])
    for m in s["modes"]:
        tight = {a: ranks_label(m["ranks"][a]["tightest"]) for a in ("caching", "plan")}
        caching, plan = tight["caching"], tight["plan"]
        lines.append(f"{m['mode']}: tightest {caching} under the caching allocator, {plan} under a plan")
    return lines


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def _batch(answer: dict) -> str:
    """An allocator's answer: the batch, or `>=B` where B, the search's last batch, fits (a lower bound)."""
    return f">={answer['batch']}" if answer.get("at_least") else str(answer["batch"])


def render_fit(summary: dict) -> str:
    """Per mode, the batch under each allocator model and the figures at b and b+1; what b means."""
    s = summary
    head = (
        f"largest batch fitting {format_size(s['memory'])} ({s['memory']} bytes), "
        f"{s['model_file']}, seq {s['seq']}, {s['dtype']}{loss_words(s)}; {s['capture']} traces ({s['capture_reason']})"
        + ("" if s["compile"] is None else f"; compiled: {describe_compile(s['compile'])}")
    )
    cols = ("mode", "caching batch", "reserved* b / b+1", "plan batch", "arena b / b+1", "traces")
    rows = []
    for m in s["modes"]:
        caching, plan = m["caching"], m["plan"]
        rows.append(
            (
                m["mode"] + no_change_mark(m["mode"], m["changed"]),
                _batch(caching),
                f"{_size(caching['at_batch'])} / {_size(caching['at_next'])}",
                _batch(plan),
                f"{_size(plan['at_batch'])} / {_size(plan['at_next'])}",
                str(m["traces"]),
            )
        )
    lines = [head] + ([] if s["gpu"] is None else [render_budget(s["gpu"])]) + text_table([cols, *rows])
    if s.get("world_size") is not None:
        lines += rank_lines(s)
    if loss_words(s):  # the loss is the same under every mode: what it did, once
        lines.append(next((m["loss_patch"] for m in s["modes"] if m["loss_patch"]), ""))
    lines.append(
        "each batch b is checked by direct traces: b fits and b+1 does not (caching: simulated OOM "
        "at capacity; plan: no plan within the memory, proven by the lower bound or the solver)\n"
        "* peak reserved without a capacity, over the whole program (construction and warm-up steps included) "
        "when traced; at the capacity the allocator's OOM retry frees cached blocks, so b may fit above it"
    )
    for m in s["modes"]:
        below = m["caching"].get("runs_out_below") or []
        if below:
            lines.append(
                f"! {m['mode']}: memory is not monotone in the batch under the caching allocator: batch "
                f"{m['caching']['batch']} runs, but batch{'es' * (len(below) > 1)} {', '.join(map(str, below))} "
                "(traced) run out of memory (fragmentation): choose among the batches that run"
            )
    none = [m["mode"] for m in s["modes"] if m["caching"]["batch"] == 0 and m["plan"]["batch"] == 0]
    if none:
        lines.append(f"! {', '.join(none)}: no batch fits; the b+1 columns are batch 1's figures")
    at_least = [m["mode"] for m in s["modes"] if any(m[a].get("at_least") for a in ("caching", "plan"))]
    if at_least:
        top = max(m[a]["batch"] for m in s["modes"] for a in ("caching", "plan") if m[a].get("at_least"))
        lines.append(
            f"! {', '.join(at_least)}: >={top} is a lower bound: batch {top} fits and the search stops there "
            "(b+1 is not traced; a larger batch may fit too)"
        )
    unproven = [m["mode"] for m in s["modes"] if m["plan"]["next_proven"] is False]
    if unproven:
        lines.append(
            f"! {', '.join(unproven)}: at b+1 no plan within the memory was found in the time limit, "
            "but none was proven impossible either (a longer --time-limit may raise b)"
        )
    return "\n".join(lines)
