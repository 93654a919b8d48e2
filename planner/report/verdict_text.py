"""Views of the GPU verdict (planner/simulate/verdict.py) and of a GPU's budget: a line or two each, functions of
their JSON documents (`Verdict.to_dict`, `Budget.as_dict`)."""

from __future__ import annotations

from memplan.units import format_size


def terms_text(outside: list[dict]) -> str:
    """The memory outside the caching allocator, term by term: "CUDA context 512.0 MiB + cuBLAS workspaces 64.0 MiB"."""
    return " + ".join(f"{t['name']} {format_size(t['bytes'])}" for t in outside)


def render_verdict(v: dict) -> str:
    """Whether the step fits the GPU, with the sum that says so; where it runs out of memory when it does not."""
    gpu = f"{v['gpu']} ({format_size(v['memory'])})"
    conf = f" with alloc-conf {v['alloc_conf']}" if v["alloc_conf"] else ""
    what = program_text(v)
    parts = f"peak reserved {format_size(v['peak_reserved'])} + {terms_text(v['outside'])}"
    if v["fits"]:
        return (f"{what} fits {gpu}{conf}: {parts} = {format_size(v['total'])}, headroom "
                f"{format_size(v['headroom'])}")  # fmt: skip
    o = v["oom"]
    module = f" (module {o['module']})" if o["module"] else ""
    where = f"at {o['op'] or 'buffer ' + str(o['buffer'])} in {o['phase']}{module}, {o.get('where', 'the step')}"
    lines = [
        f"{what} runs out of memory on {gpu}{conf} {where}: a request of {format_size(o['size'])} with "
        f"{format_size(o['reserved'])} of the allocator's {format_size(v['capacity'])} reserved",
        f"  needs {format_size(v['total'])} = {parts}: {format_size(-v['headroom'])} more than the GPU has",
    ]
    if o.get("message"):
        lines.append(f"  PyTorch would say: {o['message']}")
    return "\n".join(lines)


def program_text(v: dict) -> str:
    """What was judged, in words: the whole program (its steps) or the step alone."""
    steps = v.get("steps", 1)
    if v.get("program"):
        return f"the whole program ({steps} training step{'s' * (steps != 1)}, construction included)"
    return "the step (from an empty cache)"


def render_budget(b: dict) -> str:
    """A GPU as a memory size: its memory less what it holds outside the caching allocator."""
    g = b["gpu"]
    return (
        f"{g['name']}: {format_size(g['memory'])} less {terms_text(b['outside'])} outside the caching allocator "
        f"= {format_size(b['capacity'])}"
    )
