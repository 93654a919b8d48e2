"""View of `memplan optimize`: its answer as text, a function of the job's summary (its --json)."""

from __future__ import annotations

from memplan.planner.report.verdict_text import render_budget
from memplan.units import human_bytes

PROOF = {
    "optimal": "optimal within the model: CP-SAT proved no choice of less added time fits it",
    "feasible": "feasible: CP-SAT found it within the time limit but did not prove it least",
    "infeasible": "no assignment fits, within the model (CP-SAT proved it)",
    "unknown": "no answer: CP-SAT found none in the time limit, or every choice's traced plan was too large",
}


def actions_text(actions: list) -> str:
    """A candidate's step-level actions in words: `loss fused, optimizer adamw-8bit` (the step's own: none)."""
    return ", ".join(f"{family} {name}" for family, name in actions) or "none"


def added_text(c: dict, flops: int) -> str:
    """A candidate's added time: seconds at the rate, and its layers' share of the step's FLOPs."""
    return f"+{c['added_seconds'] * 1e3:.3g} ms (layers {100 * c['recompute'] / flops:+.1f}% of the step's FLOPs)"


def pricing_lines(s: dict) -> list[str]:
    """How the modes' added time was priced: the modes priced at step times measured on the GPU (with the
    measurement), or, with a GPU named, that every mode was priced by its FLOPs."""
    pricing = s.get("pricing")
    if pricing is None:
        unmeasured = "none measured on this GPU for this model and shape: planner/cost/measured_times.json"
        return [] if s.get("gpu") is None else [f"step times: every mode priced by its FLOPs ({unmeasured})"]
    m = pricing["measurement"]
    added = ", ".join(f"{mode} {seconds * 1e3:+.3g} ms a layer" for mode, seconds in pricing["added_per_layer"].items())
    return [
        f"step times: {added} ({pricing['label']}: {m['model']} s{m['seq']} b{m['batch']} {m['dtype']}, against its "
        "baseline); the other modes by their FLOPs"
    ]


def render_optimize(summary: dict) -> str:
    """The per-layer assignment and actions, its measured plan against the memory, and the alternatives, as text."""
    s, flops = summary, summary["step_flops"]
    lines = [
        f"{s['model_file']}: batch {s['batch']}{' (the largest that fits)' if s['max_batch'] else ''}, "
        f"seq {s['seq']}, {s['dtype']}; memory {human_bytes(s['memory'])}; {s['capture']} traces",
    ] + ([] if s["gpu"] is None else [render_budget(s["gpu"])])
    c = s["chosen"]
    if c is not None:
        lines += [f"  {path:<24}{mode}" for path, mode in zip(s["layers"], c["assignment"])]
        lines.append(f"  actions: {actions_text(c['actions'])}")
        moved = "" if c["host_moved"] is None else f", {human_bytes(c['host_moved'])} offloaded each way"
        lines.append(
            f"chosen: peak live {human_bytes(c['peak_live'])} (model {human_bytes(c['predicted_peak'])}), plan arena "
            f"{human_bytes(c['plan_arena'])} <= {human_bytes(s['memory'])} ({c['status']}), added time "
            f"{added_text(c, flops)}{moved}"
        )
        if c.get("caching_reserved") is not None:
            lines.append(
                f"  on the GPU's caching allocator the whole program reserves {human_bytes(c['caching_reserved'])} "
                "at most, and runs"
            )
    gap = s.get("gap_seconds")
    lines.append(f"proof: {PROOF[s['status']]}" + (f", at most {gap * 1e3:.3g} ms from the least" if gap else ""))
    if s["rates"] is not None:
        r = s["rates"]
        link = "no host link" if r["host_bandwidth"] is None else f"host link {human_bytes(r['host_bandwidth'])}/s"
        lines.append(f"timed at {r['flops'] / 1e12:.3g} TFLOP/s ({r['flops_source']}), {link}")
    lines += pricing_lines(s)
    lines += [f"note: {note}" for note in s["notes"]]
    lines.append(f"{'alternative':<30}{'plan arena':>12}{'fits':>6}{'added':>12}")
    for c in [*s["uniform"], *([s["megatron"]] if s["megatron"] else [])]:
        lines.append(
            f"{c['name']:<30}{human_bytes(c['plan_arena']):>12}{'yes' if c['fits'] else 'no':>6}"
            f"{c['added_seconds'] * 1e3:>9.3g} ms"
        )
    if s["megatron"] is None:
        lines.append("Megatron: no number of layers checkpointed from the first fits, within the model")
    for c in s["rejected"]:
        lines.append(
            f"rejected by its trace: {', '.join(c['assignment'])}; actions {actions_text(c['actions'])} "
            f"(plan arena {human_bytes(c['plan_arena'])}"
            + (", its program runs out of memory on the caching allocator)" if c.get("caching_fits") is False else ")")
        )
    lines.append(f"wall time {s['seconds']:.1f} s")
    return "\n".join(lines)
