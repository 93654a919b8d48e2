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
    parts = f"peak reserved {format_size(v['peak_reserved'])} + {terms_text(v['outside'])}"
    if v["fits"]:
        return f"fits {gpu}{conf}: {parts} = {format_size(v['total'])}, headroom {format_size(v['headroom'])}"
    o = v["oom"]
    module = f" (module {o['module']})" if o["module"] else ""
    where = f"at {o['op'] or 'buffer ' + str(o['buffer'])} in {o['phase']}{module}"
    return (
        f"runs out of memory on {gpu}{conf} {where}: a request of {format_size(o['size'])} with "
        f"{format_size(o['reserved'])} of the allocator's {format_size(v['capacity'])} reserved\n"
        f"  needs {format_size(v['total'])} = {parts}: {format_size(-v['headroom'])} more than the GPU has"
    )


def render_budget(b: dict) -> str:
    """A GPU as a memory size: its memory less what it holds outside the caching allocator."""
    g = b["gpu"]
    return (
        f"{g['name']}: {format_size(g['memory'])} less {terms_text(b['outside'])} outside the caching allocator "
        f"= {format_size(b['capacity'])}"
    )
