"""A trace's summary: peak live bytes, when it happens, what is live then, and the largest buffers."""

from __future__ import annotations

from typing import Any

import numpy as np

from memplan.modes import AS_BUILT
from memplan.traces.format import CATEGORIES, Trace
from memplan.units import human_bytes


def _buffer(trace: Trace, i: int) -> dict[str, Any]:
    return {
        "index": int(i),
        "size": int(trace.size[i]),
        "alloc": int(trace.alloc[i]),
        "free": int(trace.free[i]),
        "category": trace.category[i],
        "phase": trace.phase[i],
        "module": trace.module[i],
        "op": trace.op[i],
    }


def bytes_by_category(trace: Trace, t: int) -> dict[str, int]:
    """Requested bytes live at logical time t, for every category of CATEGORIES (0 where none)."""
    out = {c: 0 for c in CATEGORIES}
    for i in trace.live_at(t):
        out[trace.category[i]] += int(trace.size[i])
    return out


def summarize(trace: Trace, top: int = 5) -> dict[str, Any]:
    """Peak live bytes and its time, the phase, module and op of the allocation that reached it,
    bytes by category live at the peak, totals by category, the kernels' own buffers (internal), and the `top`
    largest buffers."""
    peak, t = trace.peak()
    live = trace.live_at(t)
    at_peak = bytes_by_category(trace, t)
    reached_by = np.nonzero(trace.alloc == t)[0] if t > 0 else np.zeros(0, dtype=np.int64)
    largest = np.argsort(-trace.size, kind="stable")[:top]
    return {
        "model": trace.meta.get("model", ""),
        "layers": trace.meta.get("layers", ""),
        "device": trace.meta.get("device", ""),
        "dtype": trace.meta.get("dtype", ""),
        "fake": bool(trace.meta.get("fake", False)),
        "data_dependent": trace.meta.get("data_dependent", {}),
        "buffers": len(trace),
        "recorded": int(len(trace.recorded)),
        "end": trace.end,
        "peak_bytes": peak,
        "peak_time": t,
        "peak_phase": trace.phase[reached_by[0]] if len(reached_by) else "other",
        "peak_module": trace.module[reached_by[0]] if len(reached_by) else "",
        "peak_op": trace.op[reached_by[0]] if len(reached_by) else "",
        "at_peak_by_category": {c: b for c, b in at_peak.items() if b},
        "internal": int(trace.internal.sum()),
        "internal_at_peak": int(trace.size[live][trace.internal[live] == 1].sum()),
        "largest": [_buffer(trace, int(i)) for i in largest],
        "cuda_measured": trace.meta.get("cuda_measured", {}),
        "patch": trace.meta.get("patch"),
    }


def describe_patch(report: dict) -> str:
    """What a layer mode did to the model, in one paragraph (meta "patch": planner.layers.PatchReport's dict)."""
    mode = report["mode"]
    if mode == AS_BUILT:
        text = "layers as-built: the model as its file builds it, nothing patched"
    elif not report["changed"]:
        text = f"layers {mode} changes nothing in this model: its trace is the model as built"
    else:
        swaps = ", ".join(f"{s['original']} -> {s['replacement']} x{s['count']}" for s in report["swapped"])
        text = f"layers {mode}: {swaps}"
    if report["left_alone"]:
        text += f"; left as built: {', '.join(report['left_alone'])}"
    return "; ".join([text, *report["notes"]])


def no_change_mark(mode: str, changed: bool) -> str:
    """' (changes nothing)' for a layer mode (not as-built) that left the model as built, else ''."""
    return "" if changed or mode == AS_BUILT else " (changes nothing)"


def render(summary: dict[str, Any]) -> str:
    """The summary as a few lines of text for the terminal."""
    s = summary
    lines = [
        f"trace of {s['model']} ({s['layers']}, {s['device']}, {s['dtype']}{', fake tensors' if s['fake'] else ''}): "
        f"{s['buffers']} buffers, "
        f"{s['recorded']} allocated during the step, {s['end'] - 1} events",
        f"peak live: {human_bytes(s['peak_bytes'], grouped=True)} ({s['peak_bytes']:,} bytes) "
        f"at time {s['peak_time']}, "
        f"phase {s['peak_phase']}, module {s['peak_module'] or '-'}, op {s['peak_op'] or '-'}",
        "live at the peak by category:",
    ]
    if s["cuda_measured"]:
        measured = s["cuda_measured"]["peak_requested"]
        lines.insert(
            2,
            f"PyTorch measured the same step's peak at {human_bytes(measured, grouped=True)} ({measured:,} bytes "
            f"requested; the trace's peak is {s['peak_bytes'] - measured:+,} bytes from it)",
        )
    if s["patch"]:
        lines.insert(1, describe_patch(s["patch"]))
    if s["data_dependent"]:
        lines.insert(
            1,
            "data-dependent values taken by rule (a scalar reads 0, a selection selects nothing): "
            + ", ".join(f"{op} x{n}" for op, n in sorted(s["data_dependent"].items())),
        )
    if s["internal"]:
        lines.insert(
            1,
            f"{s['internal']:,} buffers are kernels' own (internal: scratch, wrapped Python numbers; a --fake trace "
            f"cannot hold them), {human_bytes(s['internal_at_peak'], grouped=True)} live at the peak",
        )
    for cat, b in sorted(s["at_peak_by_category"].items(), key=lambda kv: -kv[1]):
        share = 100.0 * b / s["peak_bytes"] if s["peak_bytes"] else 0.0
        lines.append(f"  {cat:<11} {human_bytes(b, grouped=True):>14}  {share:5.1f}%")
    lines.append("largest buffers:")
    for b in s["largest"]:
        lines.append(
            f"  {human_bytes(b['size'], grouped=True):>14}  {b['category']:<10} {b['phase']:<9} "
            f"[{b['alloc']}, {b['free']})  {b['module'] or '-'}  {b['op'] or '-'}"
        )
    return "\n".join(lines)
