"""Text views of one trace: `memplan trace`'s summary for the terminal, and what a layer mode did to a model."""

from __future__ import annotations

from memplan.modes import AS_BUILT
from memplan.planner.cost.transfer import GIVEN
from memplan.planner.layers.patch import PatchReport
from memplan.traces.compile import describe_compile
from memplan.traces.format import CATEGORIES
from memplan.traces.ranks.family import ranks_label
from memplan.traces.summary import TraceSummary
from memplan.traces.unrecorded import unrecorded_text
from memplan.units import human_bytes


def describe_patch(report: dict) -> str:
    """What a layer mode did to the model, in one paragraph (a trace's meta "patch": PatchReport's data)."""
    patch = PatchReport.from_dict(report)
    if patch.mode == AS_BUILT:
        text = "layers as-built: the model as its file builds it, nothing patched"
    elif not patch.changed:
        text = f"layers {patch.mode} changes nothing in this model: its trace is the model as built"
    else:
        swaps = ", ".join(f"{s.original} -> {s.replacement} x{s.count}" for s in patch.swapped)
        text = f"layers {patch.mode}: {swaps}"
    if patch.left_alone:
        text += f"; left as built: {', '.join(patch.left_alone)}"
    return "; ".join([text, *patch.notes])


def describe_loss(report: dict) -> str:
    """What the step's loss choice did, in one line (a trace's meta "loss_patch": LossPatch's data)."""
    if not report["patched"]:
        return "; ".join(report["notes"]) or f"loss {report['loss']}: the model's own loss"
    text = f"loss {report['loss']}: {report['replaced']}"
    if report["calls"]:
        text += (
            f" ({report['tokens']:,} tokens: chunks of {report['chunk_rows']:,} rows, then vocabulary blocks of "
            f"{report['block_columns']:,} columns)"
        )
    return "; ".join([text, *report["notes"]])


def describe_optimizer(report: dict) -> str:
    """What the step's optimizer choice made, in one line (a trace's meta "optimizer_state": OptimizerChoice's data)."""
    text = (
        f"optimizer {report['optimizer']}: the model file's {report['built']} rebuilt over {report['parameters']:,} "
        f"parameters; state on the device {human_bytes(report['device_bytes'], grouped=True)} (as built: "
        f"{human_bytes(report['built_bytes'], grouped=True)})"
    )
    return text + (f", on the host {human_bytes(report['host_bytes'], grouped=True)}" if report["host_bytes"] else "")


def loss_words(summary: dict) -> str:
    """`, loss fused` for a command's summary whose step's loss is not as built, else ''."""
    loss = summary.get("loss", AS_BUILT)
    return "" if loss == AS_BUILT else f", loss {loss}"


def no_change_mark(mode: str, changed: bool) -> str:
    """' (changes nothing)' for a layer mode (not as-built) that left the model as built, else ''."""
    return "" if changed or mode == AS_BUILT else " (changes nothing)"


WIDEST = max(map(len, CATEGORIES))  # the category column's width: `communication` too lines up
SELECTIONS = frozenset({"aten.nonzero", "aten.masked_select", "aten.index"})  # ops whose output size is a selection


def describe_routing(routing: dict) -> list[str]:
    """A fake trace's routing in lines: each kind of router call the rule answered with its token choices per
    expert, and any op through which a choice was lost (a trace's meta "routing"; none without routers)."""
    lines = []
    for call in routing.get("routers", []):
        per_expert = ", ".join(str(n) for n in call["per_expert"])
        lines.append(
            f"routing {call['rule']} (fake tensors): {call['op']} top-{call['k']} of {call['experts']} experts over "
            f"{call['tokens']:,} tokens x{call['calls']}, token choices per expert {per_expert}"
        )
    if routing.get("lost"):
        lost = ", ".join(f"{op} x{n}" for op, n in sorted(routing["lost"].items()))
        lines.append(f"routing not followed through (the CPU could not compute its values): {lost}")
    return lines


def render_trace(s: TraceSummary) -> str:
    """The summary as a few lines of text for the terminal: what the step is, what it read and lacks, what it holds
    that a fake trace cannot, what was taken by rule, what its mode changed, its peak, and what is live then."""
    tensors = ", fake tensors" if s.fake else ""
    loss = "" if s.loss == AS_BUILT else f", loss {s.loss}"
    loss += f", optimizer {s.optimizer_state['optimizer']}" if s.optimizer_state else ""
    lines = [
        f"trace of {s.model} ({s.layers}{loss}, {s.device}, {s.dtype}{tensors}): {s.buffers} buffers, "
        f"{s.recorded} allocated during the step, {s.end - 1} events"
    ]
    if s.program:
        p = s.program
        measured = f", step {p['measured']} measured" if p["measured"] else ""
        lines.append(
            f"the whole program: construction and {p['steps']} training step{'s' * (p['steps'] != 1)}{measured}; "
            f"{p['buffers']:,} buffers, {p['events']:,} events, peak live {human_bytes(p['peak_bytes'], grouped=True)}"
            " (what a GPU verdict judges)"
        )
    if s.unrecorded:
        lines.append(f"warning: {unrecorded_text(s.unrecorded)}")
    if s.internal:
        lines.append(
            f"{s.internal:,} buffers are kernels' own (internal: scratch, wrapped Python numbers, copies an op makes "
            f"inside another, such as autograd's of an in-place op's input; a --fake trace holds only those copies), "
            f"{human_bytes(s.internal_at_peak, grouped=True)} live at the peak"
        )
    if s.streams:
        each = ", ".join(f"{x['stream']} {x['name'] or 'unnamed'} ({x['buffers']:,} buffers)" for x in s.streams)
        lines.append(f"streams: {each}; {s.syncs:,} syncs between them")
    lines += describe_routing(s.routing)
    if s.data_dependent:
        taken = ", ".join(f"{op} x{n}" for op, n in sorted(s.data_dependent.items()))
        selections = set(s.data_dependent) & SELECTIONS
        warning = ": a mixture of experts whose router memplan does not follow runs no expert" if selections else ""
        lines.append(
            f"data-dependent values nobody knows, taken by rule (a scalar reads 0, a selection selects "
            f"nothing{warning}): {taken}"
        )
    if s.patch:
        lines.append(describe_patch(s.patch))
    if s.loss_patch and s.loss != AS_BUILT:
        lines.append(describe_loss(s.loss_patch))
    if s.optimizer_state:
        lines.append(describe_optimizer(s.optimizer_state))
    lines.append(
        f"peak live: {human_bytes(s.peak_bytes, grouped=True)} ({s.peak_bytes:,} bytes) at time {s.peak_time}, "
        f"phase {s.peak_phase}, module {s.peak_module or '-'}, op {s.peak_op or '-'}"
    )
    if s.host:
        lines.append(
            f"host memory (offloaded layers): {s.host['copies']:,} copies, {human_bytes(s.host['moved'], grouped=True)}"
            f" moved each way, {human_bytes(s.host['peak_bytes'], grouped=True)} at the host's peak, "
            f"{human_bytes(s.host['at_device_peak'], grouped=True)} at the device's peak (not in the device's figures)"
        )
    if s.cuda_measured:
        measured = s.cuda_measured["peak_requested"]
        lines.append(
            f"PyTorch measured the same step's peak at {human_bytes(measured, grouped=True)} ({measured:,} bytes "
            f"requested; the trace's peak is {s.peak_bytes - measured:+,} bytes from it)"
        )
    lines.append("live at the peak by category:")
    for category, size in sorted(s.at_peak_by_category.items(), key=lambda kv: -kv[1]):
        share = 100.0 * size / s.peak_bytes if s.peak_bytes else 0.0
        lines.append(f"  {category:<{WIDEST}} {human_bytes(size, grouped=True):>14}  {share:5.1f}%")
    lines.append("largest buffers:")
    for b in s.largest:
        lines.append(
            f"  {human_bytes(b.size, grouped=True):>14}  {b.category:<{WIDEST}} {b.phase:<9} "
            f"[{b.alloc}, {b.free})  {b.module or '-'}  {b.op or '-'}"
        )
    return "\n".join(lines)


def render_trace_file(summary: dict) -> str:
    """`memplan trace`'s text from its summary (its --json): each rank's trace, or the one trace, with how it was
    compiled and where it was written."""
    if "ranks" in summary:
        n = summary["world_size"]
        return "\n\n".join(
            f"{stood_for(r.get('ranks', [r['rank']]), n)}:\n{render_trace(TraceSummary.from_dict(r))}\n"
            f"written to {r['output']}"
            for r in summary["ranks"]
        )
    compiled = "" if summary["compile"] is None else f"\ncompiled: {describe_compile(summary['compile'])}"
    transfer = describe_transfer(summary["host_transfer"]) if summary.get("host_transfer") else ""
    return f"{render_trace(TraceSummary.from_dict(summary))}{compiled}{transfer}\nwritten to {summary['output']}"


def stood_for(ranks: list[int], world: int) -> str:
    """The ranks one trace stands for, in words: `rank 3 of 4`, `ranks 0-511 of 512 (512 ranks alike, one trace)`."""
    alike = f" ({len(ranks)} ranks alike, one trace)" if len(ranks) > 1 else ""
    return f"{ranks_label(ranks)} of {world}{alike}"


def describe_transfer(transfer: dict) -> str:
    """A line (after a newline) on the time offload's host transfers add (planner.cost.transfer.HostTransfer's dict)."""
    link = "the bandwidth given" if transfer["link"] == GIVEN else transfer["link"]
    rate = human_bytes(transfer["bandwidth"])
    return (
        f"\noffload's transfers over {link} ({rate}/s one way): {transfer['seconds_each_way'] * 1e3:.3f} ms each way, "
        f"{transfer['seconds'] * 1e3:.3f} ms a step where nothing overlaps them"
    )


def render_import(s: dict) -> str:
    """`memplan import`'s text from its summary (its --json): counts, device, streams, the peak, the file."""
    return (
        f"buffers: {s['buffers']} ({s['allocated_in_trace']} allocated while recording, "
        f"{s['before_recording']} alive before, {s['never_freed']} never freed)\n"
        f"device cuda:{s['cuda_device']}, streams {s['streams']}, {s['events_end'] - 1} events\n"
        f"peak live: {s['peak_live_bytes']} bytes ({human_bytes(s['peak_live_bytes'], unit='GiB')}) "
        f"at time {s['peak_time']}\n{_import_oom(s)}written to {s['output']}"
    )


def _import_oom(s: dict) -> str:
    """A line for a snapshot that recorded out-of-memory errors: the last one, and where to look further."""
    o = s.get("oom")
    if not o:
        return ""
    count = f" (the last of {s['ooms']})" if s["ooms"] > 1 else ""
    return (
        f"out of memory at entry {o['entry']}{count}: a request of {human_bytes(o['size'], unit='GiB')} with "
        f"{human_bytes(o['device_free'], unit='GiB')} free on the device (memplan explain SNAPSHOT: why, and what "
        "would have run)\n"
    )
