"""Views of `memplan run`: its table for the terminal and report.md, both functions of the run's summary (the
JSON document of `memplan run --json`), apart from the job that made it."""

from __future__ import annotations

from pathlib import Path

from memplan.planner.report.tables import markdown_table, text_table
from memplan.planner.report.trace_text import loss_words, no_change_mark
from memplan.planner.report.verdict_text import render_verdict
from memplan.traces.compile import describe_compile
from memplan.traces.ranks.family import ranks_label
from memplan.units import human_bytes


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def row_name(row: dict) -> str:
    """A row's name: its mode, and with ranks the ranks its trace stands for (`tempo · ranks 1-3`)."""
    return row["mode"] if row.get("ranks") is None else f"{row['mode']} · {ranks_label(row['ranks'])}"


def table_rows(summary: dict) -> list[list[str]]:
    """The report's table: header, then one row per mode (per mode and distinct rank, side by side, with ranks)."""
    by_rank = summary.get("ranks") is not None
    header = [
        "layers",
        *(["ranks"] if by_rank else []),
        "peak live",
        "caching reserved",
        "plan arena",
        "bound",
        "proof",
        f"saving vs {summary['reference']}",
    ]
    rows = [header]
    for r in summary["rows"]:
        proof = "optimal" if r["status"] == "optimal" else f"feasible, gap {100 * r['gap']:.2g}%"
        saving = r["saving"]
        rows.append(
            [
                r["mode"] + no_change_mark(r["mode"], r["changed"]),
                *([ranks_label(r["ranks"]).split(" ", 1)[1]] if by_rank else []),
                human_bytes(r["peak_live"]),
                human_bytes(r["caching_peak_reserved"]),
                human_bytes(r["plan_arena"]),
                human_bytes(r["bound"]),
                proof,
                percent(saving) + (" (costs memory)" if saving is not None and saving < 0 else ""),
            ]
        )
    return rows


def replay_sentence(summary: dict) -> str:
    """What the replay of one mode's plan showed, in a sentence; why there was none on fake traces."""
    r = summary["replay"]
    if r is None and summary.get("world_size") is not None:
        return f"no replay: a replay runs one process's step, and this run traced {summary['world_size']} ranks"
    if r is None:
        return (
            "no replay: the traces are fake, and a replay runs the real step on this machine "
            "(--capture real replays it)"
        )
    equal = "bitwise equal to" if r["bitwise_equal"] else f"DIFFERENT from ({r['first_difference']})"
    return (
        f"replay of the {r['mode']} plan: {r['steps']} steps; {r['adopted_count']:,} of "
        f"{r['reserved_count']:,} resident storages adopted into the {human_bytes(r['arena_bytes'])} arena "
        f"({human_bytes(r['outside_bytes'])} left outside), {r['planned_count']:,} allocations from it, "
        f"{r['fallback_count']} fallbacks; measured peak {human_bytes(r['peak_bytes'])}: arena top + fallback + "
        f"outside; loss and gradients {equal} the default allocator's run"
    )


def step_sentence(summary: dict) -> str:
    """report.md's first sentence: the step traced (naming its optimizer only when the trace did), its shape
    and how it was captured."""
    s = summary
    step = "forward, backward" + (f", {s['optimizer']}" if s["optimizer"] else "")
    compiled = "" if s["compile"] is None else f", the forward compiled by {describe_compile(s['compile'])}"
    ranks = "" if s.get("world_size") is None else f" on each of {s['world_size']} ranks"
    return (
        f"One training step ({step}) of `{s['model_file']}` at batch {s['batch']}, sequence {s['seq']}, "
        f"{s['dtype']}{loss_words(s)}{compiled}, traced under each layer mode{ranks} with {s['capture']} tensors "
        f"({s['capture_reason']})."
    )


def ranks_sentence(summary: dict) -> str:
    """A run over ranks in a sentence: how many distinct traces stand for the world, and each mode's highest rank."""
    groups, world = summary["ranks"], summary["world_size"]
    highest = {}
    for r in summary["rows"]:
        if r["mode"] not in highest or r["peak_live"] > highest[r["mode"]]["peak_live"]:
            highest[r["mode"]] = r
    peaks = "; ".join(f"{mode}: {ranks_label(r['ranks'])}" for mode, r in highest.items())
    return f"{world} ranks, {len(groups)} distinct traces; the highest peak live per mode: {peaks}"


def verdict_lines(summary: dict) -> list[str]:
    """Each mode's verdict on the run's GPU, a line or two each; none without a GPU."""
    return [f"{row_name(r)}: {render_verdict(r['verdict'])}" for r in summary["rows"] if r["verdict"] is not None]


def render_text(summary: dict) -> str:
    """The table as aligned text, each mode's verdict on the GPU, then the replay and the files, for the terminal."""
    rows = table_rows(summary)
    lines = text_table(rows, right=[False] + [True] * (len(rows[0]) - 1))
    lines += [] if summary.get("ranks") is None else ["", ranks_sentence(summary)]
    lines += ([""] + verdict_lines(summary)) if summary["gpu"] is not None else []
    lines += [
        "",
        f"traces: {summary['capture']} tensors ({summary['capture_reason']})",
        replay_sentence(summary),
        "",
        f"report         {summary['report']}",
        f"html report    {summary['html_report']}",
        f"timeline       {summary['timeline']}",
        f"address space  {summary['address_space']}",
        f"wall time      {summary['seconds']:.1f} s",
    ]
    return "\n".join(lines)


def gpu_section(summary: dict) -> list[str]:
    """report.md's section on the run's GPU: each mode's verdict (none without a GPU)."""
    if summary["gpu"] is None:
        return []
    items = [f"- **{row_name(r)}**: " + render_verdict(r["verdict"]).replace("\n  ", " ") for r in summary["rows"]]
    return [f"## On {summary['gpu']['name']}", "", *items, ""]


def render_markdown(summary: dict) -> str:
    """report.md: the table, what each column means, the replay, and the command behind each row."""
    md = [
        f"# memplan report: {Path(summary['model_file']).stem}",
        "",
        step_sentence(summary),
        "",
        *markdown_table(table_rows(summary)),
        "",
        *([] if summary.get("ranks") is None else [ranks_sentence(summary) + ".", ""]),
        "- **peak live**: the most bytes held by live tensors at once (requested sizes).",
        "- **caching reserved**: peak bytes PyTorch's CUDA caching allocator would reserve (simulated).",
        "- **plan arena**: the arena of memplan's plan, checked by the independent verifier.",
        "- **bound**: the max-live lower bound (sizes rounded to 512 B); **proof** says whether the arena equals it.",
        f"- **saving vs {summary['reference']}**: 1 - peak live / its peak live, like with like "
        "(negative: the mode costs memory).",
        "",
        "## What each mode changed",
        "",
        *[f"- **{mode}**: {patch}" for mode, patch in {r["mode"]: r["patch"] for r in summary["rows"]}.items()],
        "",
        *gpu_section(summary),
        "## Replay",
        "",
        replay_sentence(summary) + ".",
        "",
        "![timeline](timeline.png)",
        "",
        "![address space](address_space.png)",
        "",
        "Open report.html in a browser for the same timelines, zoomable, with every buffer's details on hover.",
        "",
        "## Reproduce each row",
        "",
    ]
    for r in summary["rows"]:
        md += [f"**{row_name(r)}**", "", "```", r["command"], "```", ""]
    md.append(f"Wall time of the whole run: {summary['seconds']:.1f} s.")
    return "\n".join(md) + "\n"
