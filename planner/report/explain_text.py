"""`memplan explain`'s text, a function of its JSON document (planner/jobs/explain.py's `Explanation.to_dict`):
the out-of-memory error as PyTorch words it, what was live, the fragmentation, and each change checked by simulation;
or the peak and the headroom."""

from __future__ import annotations

from memplan.units import cuda_oom_message, format_size


def pytorch_oom_message(oom: dict, device: int) -> str:
    """The error PyTorch raised, as its CUDACachingAllocator words it, from an out-of-memory error's figures (its
    per-process line, read from NVML, is not in a snapshot and is left out)."""
    reserved = oom["allocated"] + oom["cached"]
    return cuda_oom_message(oom["tried"], oom["total"], oom["device_free"], oom["allocated"], reserved, device)


def _groups(title: str, groups: list[dict]) -> str:
    return f"  {title}: " + ", ".join(f"{g['name'] or '(none)'} {format_size(g['bytes'])} ({g['buffers']})"
                                      for g in groups)  # fmt: skip


def _live(live: dict, when: str) -> list[str]:
    """What was live: by category, phase and op, with what the snapshot does not say, and the largest buffers."""
    lines = [f"live {when}: {format_size(live['bytes'])} requested in {live['buffers']:,} buffers"]
    if live["category_bytes"]:
        lines.append(_groups("by category", live["by_category"]))
    else:
        lines.append("  by category: not known (a PyTorch snapshot does not say what a tensor holds)")
    lines.append(_groups("by phase", live["by_phase"]))
    if live["op_bytes"]:
        lines.append(_groups("by op", live["by_op"]))
    else:
        lines.append("  by op: not known (recorded without stack frames: _record_memory_history(context=None))")
    largest = []
    for b in live["largest"]:
        made = "before recording" if b["alloc"] == 0 else f"at time {b['alloc']:,}"
        largest.append(f"{format_size(b['size'])} ({b['op'] or 'op not known'}, {b['phase']}, allocated {made})")
    lines.append("  largest: " + "; ".join(largest))
    return lines


def _change(c: dict) -> str:
    given = f"the allocator given {format_size(c['capacity'])}"
    if c["runs"]:
        return f"runs ({given}): peak reserved {format_size(c['peak_reserved'])}"
    where = "at the same request" if c["failed_at_same"] else f"earlier, at {c['failed_op'] or 'a request'}"
    return f"still fails ({given}) {where} of {format_size(c['failed_request'])}"


def _fragmentation(o: dict) -> str:
    """How much of what the request lacked the allocator's cache held, and whether in one piece."""
    missing = o["request"] - o["device_free"]
    head = (f"fragmentation: {format_size(o['cached'])} reserved but unallocated, its largest free block "
            f"{format_size(o['largest_free'])}, against a request of {format_size(o['request'])} that lacked "
            f"{format_size(missing)} of the free memory")  # fmt: skip
    if o["cached"] >= missing:
        return head + ": the cache held enough, in pieces inside segments still in use (fragmentation)"
    return head + (f": the cache could not have covered it even whole (short by {format_size(missing - o['cached'])}"
                   "): only less memory live, or more memory, gets past it")  # fmt: skip


def render_explain(d: dict) -> str:
    """`memplan explain`'s text from its JSON document."""
    start = ("recorded from the program's start" if d["from_start"] else
             f"recorded mid-program ({d['before_recording']:,} buffers from before it, which a simulation starts in "
             "an empty cache)")  # fmt: skip
    conf = d["alloc_conf"] or "PyTorch's defaults"
    lines = [f"{d['snapshot']}: device {d['cuda_device']}, {d['buffers']:,} buffers, {start}, alloc conf {conf}"]
    check = d["check"]
    o = d["oom"]
    if o is None:
        lines.append(f"no out-of-memory error; peak live {format_size(d['peak_live'])}, max reserved "
                     f"{format_size(d['max_reserved'])} (the snapshot's own; simulated "
                     f"{format_size(check['simulated_max_reserved'])})")  # fmt: skip
        if d["capacity"] is None:
            lines.append("headroom: give --gpu NAME or --memory SIZE")
        else:
            gpu = d["gpu"] or "the GPU"
            sim = check["simulated_oom_size"]
            verdict = "runs" if sim is None else f"runs out of memory at a request of {format_size(sim)}"
            lines.append(f"on {gpu} ({format_size(d['memory'])} less {format_size(d['outside'])} outside the "
                         f"allocator = {format_size(d['capacity'])}): headroom {format_size(d['headroom'])}; the "
                         f"program simulated there {verdict}")  # fmt: skip
        return "\n".join(lines + _live(d["live"], f"at the peak (time {d['live']['time']:,})"))
    after = ("the snapshot ends in it" if not o["allocations_after"]
             else f"the program went on for {o['allocations_after']:,} allocations")  # fmt: skip
    lines.append(f"out of memory at entry {o['entry']:,} of the trace (the first of {o['ooms']} errors; {after}):"
                 if o["ooms"] > 1 else f"out of memory at entry {o['entry']:,} of the trace ({after}):")  # fmt: skip
    lines.append("  " + pytorch_oom_message(o, d["cuda_device"]))
    same = "reproduces it: the same request fails" if o["reproduced"] else "does NOT reproduce it"
    lines.append(f"  the program simulated at the allocator's capacity then ({format_size(d['capacity'])}: "
                 f"reserved + free) {same} (max reserved {format_size(check['simulated_max_reserved'])}, the "
                 f"snapshot's {format_size(d['max_reserved'])})")  # fmt: skip
    lines.append(f"request: {format_size(o['request'])} on stream {o['stream']}"
                 + (f", from {o['op']}" if o["op"] else ""))  # fmt: skip
    lines += _live(d["live"], "then")
    lines.append(_fragmentation(o))
    lines.append("would it have run? each change simulated on the program (runs: gets past this error; what the "
                 "program did after it is not in the snapshot):")  # fmt: skip
    width = max((len(c["change"]) for c in d["changes"]), default=0)
    for c in d["changes"]:
        lines.append(f"  {c['change']:<{width}}  {_change(c)}")
    lines += [f"  {name}: on already" for name in d["already"]]
    if d["memory"] is None:
        lines.append("  more memory: give the GPU (--gpu NAME or --memory SIZE) to simulate it with all of it")
    elif not any(c["kind"] == "capacity" for c in d["changes"]):
        lines.append(f"  more memory: the program had the whole GPU already (the allocator could have reserved "
                     f"{format_size(d['capacity'])} of its {format_size(d['memory'])}; "
                     f"{format_size(d['outside'])} counted outside the allocator)")  # fmt: skip
    lines.append("needs the model (a snapshot holds allocations, not the model, so it cannot be re-run with these):")
    lines += [f"  {m['change']}: {m['command']}" for m in d["needs_model"]]
    return "\n".join(lines)
