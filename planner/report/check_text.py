"""`memplan check`'s text, a function of its JSON document (planner/jobs/check.py's `CheckResult.to_dict`): whether
the script's program ran on the fake GPU, with its headroom, or the out-of-memory error it did not catch."""

from __future__ import annotations

from memplan.planner.report.verdict_text import terms_text
from memplan.units import format_size


def render_check(d: dict) -> str:
    """The answer first, then how the program ran: its steps, its peaks, each error raised, what it read by rule and
    where it branched on it, the CPU tensors the limit made fake."""
    gpu = f"{d['gpu']} ({format_size(d['memory'])})"
    conf = f" with alloc-conf {d['alloc_conf']}" if d["alloc_conf"] else ""
    ran = {"stopped": f"ran {d['steps_run']} optimizer steps (stopped there)",
           "exited": f"ended by itself after {d['steps_run']} optimizer steps",
           "out of memory": f"ran out of memory after {d['steps_run']} optimizer steps"}[d["finished"]]  # fmt: skip
    parts = f"peak reserved {format_size(d['peak_reserved'])} + {terms_text(d['budget']['outside'])}"
    if d["fits"]:
        head = f"fits {gpu}{conf}: the program {ran}; {parts}, headroom {format_size(d['headroom'])}"
    else:
        f = d["failures"][-1]
        module = f" (module {f['module']})" if f["module"] else ""
        head = (f"runs out of memory on {gpu}{conf} at {f['op'] or 'an allocation'} in {f['phase']}{module}, "
                f"{f['where']}: a request of {format_size(f['size'])}\n  {f['message']}")  # fmt: skip
    lines = [
        head,
        f"peak allocated {format_size(d['peak_allocated'])}, peak reserved {format_size(d['peak_reserved'])}",
    ]
    if d.get("world_size"):
        run = ", ".join(map(str, d["ranks"]))
        alike = "; the first and last ran the same program, the rest taken as alike" if d["alike"] else ""
        lines.append(f"{d['world_size']} ranks on the fake process group: ran rank{'s' * (len(d['ranks']) > 1)} "
                     f"{run}{alike}; this is rank {d['rank']}'s answer, the tightest")  # fmt: skip
    for f in d["failures"]:
        if f["caught"]:
            lines.append(f"the program caught an out-of-memory error at {f['op'] or 'an allocation'} ({f['where']}, "
                         f"a request of {format_size(f['size'])}) and went on")  # fmt: skip
    if d.get("compiled_eager"):
        lines.append(f"torch.compile ran eager (compiled graphs need real tensors): {', '.join(d['compiled_eager'])}")
    if d.get("not_run"):
        lines.append(f"not run on fake tensors, and the program went on without: {', '.join(d['not_run'])}")
    if d["data_dependent"]:
        taken = ", ".join(f"{op} x{n}" for op, n in sorted(d["data_dependent"].items()))
        lines.append(f"values nobody knows on a fake GPU, read by rule (a scalar reads 0): {taken}")
    for b in d.get("branches", []):
        times = "once" if b["times"] == 1 else f"{b['times']} times"
        lines.append(f"the program branched on such a value at {b['where']} ({times}): it took the branch a 0 takes")
    over = d.get("cpu", {}).get("over_limit", {})
    if over:
        made = ", ".join(f"{op} x{n}" for op, n in sorted(over.items()))
        lines.append(f"CPU tensors over the limit of {format_size(d['cpu']['limit'])} made fake (--cpu-limit): {made}")
    return "\n".join(lines)


def render_search(d: dict) -> str:
    """`memplan check --largest`: the largest value that fits first, then each value tried, then the check of that
    value (of the smallest tried when none fits)."""
    option, answer = d["argument"], d["answer"]
    gpu = f"{answer['gpu']} ({format_size(answer['memory'])})"
    if d["largest"] is None:
        head = f"no {option} tried fits {gpu}: {d['smallest_failing']} runs out of memory"
    elif d["smallest_failing"] is None:
        head = f"{option} {d['largest']} fits {gpu}, the largest tried (not searched further)"
    else:
        head = f"largest {option} that fits {gpu}: {d['largest']} ({d['smallest_failing']} runs out of memory)"
    lines = [head, f"{'value':>9}  {'fits':4}  {'peak reserved':>13}  {'headroom':>10}  where it ran out"]
    for t in sorted(d["trials"], key=lambda t: t["value"]):
        room = format_size(t["headroom"]) if t["fits"] else ""  # a program that ran out has none
        lines.append(f"{t['value']:>9}  {'yes' if t['fits'] else 'no':4}  {format_size(t['peak_reserved']):>13}  "
                     f"{room:>10}  {t['failure'] or ''}".rstrip())  # fmt: skip
    if not d["monotone"]:
        lines.append(f"a larger {option} fit where a smaller one ran out: the program's memory is not monotone in it")
    label = d["largest"] if d["largest"] is not None else min(t["value"] for t in d["trials"])
    lines += ["", f"{option} {label}:", render_check(answer)]
    return "\n".join(lines)
