"""A capture's patches do not depend on import order: a library the program imports inside
`memplan.record(fake=True)` is patched as one imported before the capture began (traces/on_import.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from memplan.traces.on_import import on_import, patched_on_import

TESTS = Path(__file__).resolve().parent

# An HF training step on fake CUDA: transformers imported before the capture (`first`) or inside it.
PROGRAM = """
import json, sys
sys.path.insert(0, {tests!r})
import torch, memplan
if sys.argv[1] == "first":
    from transformers import LlamaForCausalLM  # its masking helpers imported before the capture
assert ("transformers" in sys.modules) == (sys.argv[1] == "first")
with memplan.record(fake=True, device="cuda") as recording:
    import hf_tiny
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(hf_tiny.tiny_config("llama")).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 256, (hf_tiny.BATCH, hf_tiny.SEQUENCE), device="cuda")
    with recording.step(model, optimizer):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
        optimizer.step()
trace = recording.trace
assert all(type(f).__module__ != 'memplan.traces.on_import' for f in sys.meta_path)  # gone with the capture
print(json.dumps({{"peak": trace.peak()[0], "buffers": len(trace), "bytes": sum(map(int, trace.size)),
                  "ops": sorted(set(trace.op))}}))
"""


def _traced(order: str) -> dict:
    """The trace's figures of PROGRAM run in a fresh process with transformers imported `order`."""
    program = PROGRAM.format(tests=str(TESTS))
    done = subprocess.run([sys.executable, "-c", program, order], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _traced_here(monkeypatch, capsys) -> dict:
    """The trace's figures of PROGRAM run in this process, where transformers is imported before the capture (the
    order needs no fresh process: a process that imported it already is the case)."""
    monkeypatch.setattr(sys, "argv", ["-c", "first"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # PROGRAM puts tests/ first
    capsys.readouterr()
    exec(PROGRAM.format(tests=str(TESTS)), {"__name__": "__program__"})
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh process that imports transformers: ~10 s
def test_transformers_imported_inside_the_capture_gives_the_trace_of_transformers_imported_first(monkeypatch, capsys):
    """The issue's loops: HF built inside `memplan.record(fake=True)` built the full 4-D mask and repeated keys and
    values (its mask helpers were wrapped only when imported before the capture), 0.08% to 5.1% high."""
    first, inside = _traced_here(monkeypatch, capsys), _traced("inside")
    assert inside == first


def test_a_patch_waits_for_its_module_and_the_module_keeps_its_own_loader(tmp_path, monkeypatch):
    """A module imported after the wait began is patched once its code has run, before the importer sees it; one
    imported already is patched at once; the finder leaves sys.meta_path with the last wait."""
    (tmp_path / "memplan_late_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[types.ModuleType] = []

    def patch(module):
        seen.append(module)
        module.VALUE += 1

    finders = list(sys.meta_path)
    try:
        with patched_on_import("memplan_late_module", patch):
            import memplan_late_module

            assert memplan_late_module.VALUE == 2 and seen == [memplan_late_module]
            assert type(memplan_late_module.__loader__).__name__ == "SourceFileLoader"
            assert memplan_late_module.__spec__.loader is memplan_late_module.__loader__
        assert sys.meta_path == finders
        on_import("memplan_late_module", patch).remove()  # imported already: patched now
        assert memplan_late_module.VALUE == 3 and sys.meta_path == finders
    finally:
        sys.modules.pop("memplan_late_module", None)
