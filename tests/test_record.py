"""memplan.record: one step of a user's own training loop, recorded as capture_step records a model file's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import memplan
from memplan.errors import MemplanError
from memplan.planner.report.trace_text import render_trace
from memplan.planner.workloads import gpt2
from memplan.traces.capture import capture_step
from memplan.traces.summary import summarize
from memplan.traces.unrecorded import UnrecordedWarning

COLUMNS = ("size", "alloc", "free", "category", "phase")


def build():
    return gpt2.build_workload(batch_size=2, seq_len=16)


def columns(trace) -> tuple[list, list]:
    """The step's buffers in allocation order, and those alive at its start (in no particular order)."""
    rows = list(
        zip(*(getattr(trace, c).tolist() if c in ("size", "alloc", "free") else getattr(trace, c) for c in COLUMNS))
    )
    return [r for r in rows if r[1] > 0], sorted(r for r in rows if r[1] == 0)


def accumulation_loop(model, optimizer, scheduler, batches) -> None:
    """A loop as people write it: two micro-batches, bf16 autocast, clipping, a scheduler."""
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()) / len(batches)
        loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def test_a_built_models_step_is_recorded_as_capture_step_records_it():
    """The model, its optimizer state and inputs were made before record began: adopted, the same buffers."""
    expected = capture_step(build)
    workload = build()
    workload.step()  # the warm-up capture_step runs
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnrecordedWarning)  # the model, its optimizer and inputs are all adopted
        with memplan.record(workload.model, workload.optimizer, inputs=workload.inputs) as recording:
            workload.step()
    assert columns(recording.trace) == columns(expected)
    assert recording.trace.meta["source"] == "memplan.record"
    assert "unrecorded" not in recording.trace.meta and summarize(recording.trace).unrecorded == {}


def test_an_existing_loop_with_accumulation_autocast_clipping_and_a_scheduler(tmp_path):
    torch.manual_seed(0)
    model = gpt2.build_workload(batch_size=2, seq_len=16).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    batches = [torch.randint(0, 100, (2, 16)) for _ in range(2)]
    accumulation_loop(model, optimizer, scheduler, batches)  # the optimizer state exists from here on
    traces = []
    for name in ("a", "b"):
        with memplan.record(model, optimizer, inputs=batches, output=tmp_path / f"{name}.json.gz") as recording:
            accumulation_loop(model, optimizer, scheduler, batches)
        traces.append(memplan.load_trace(tmp_path / f"{name}.json.gz"))
    assert columns(traces[0]) == columns(traces[1]) == columns(recording.trace)
    trace = traces[0]
    by_category = {c: int(trace.size[np.array(trace.category) == c].sum()) for c in set(trace.category)}
    parameter_bytes = sum(p.nbytes for p in model.parameters())
    assert by_category["parameter"] == parameter_bytes
    assert by_category["optimizer"] == 2 * parameter_bytes + 4 * len(list(model.parameters()))  # moments, steps
    assert by_category["input"] == sum(b.nbytes for b in batches)
    # two micro-batches: the gradients are made in the first backward and live until zero_grad
    gradients = [i for i, c in enumerate(trace.category) if c == "gradient"]
    assert sum(int(trace.size[i]) for i in gradients) == parameter_bytes
    assert {"forward", "backward", "optimizer"} <= set(trace.phase)
    plan = memplan.solve(trace, time_limit=2)
    memplan.verify(plan, trace)


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_a_fake_step_is_built_inside_and_marked():
    expected = capture_step(build, fake=True)
    with memplan.record(fake=True) as recording:
        workload = build()
        workload.step()
        with recording.step(workload.model, workload.optimizer, inputs=workload.inputs):
            workload.step()
    assert recording.trace.meta["fake"] is True
    assert columns(recording.trace) == columns(expected)


def test_misuse_is_one_line_and_writes_nothing(tmp_path):
    workload = build()
    out = tmp_path / "t.json.gz"
    with pytest.raises(MemplanError, match="build it inside") as error:
        with memplan.record(workload.model, workload.optimizer, fake=True):
            pass
    assert "\n" not in str(error.value)
    with pytest.raises(MemplanError, match="no step was recorded"):
        with memplan.record(output=out):
            pass
    with pytest.raises(ValueError, match="the loop failed"):
        with memplan.record(workload.model, workload.optimizer, output=out):
            raise ValueError("the loop failed")
    assert not out.exists()


def test_every_micro_batch_of_gradient_accumulation_is_a_forward_with_its_activations():
    """Each micro-batch's call of the model is a forward, and what it keeps for its own backward is an activation
    (after the first backward they were labelled 'other' and 'temporary')."""
    import torch
    from torch import nn

    import memplan

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    optimizer = torch.optim.SGD(model.parameters())
    batches = [torch.randn(8, 32) for _ in range(2)]
    with memplan.record(model, optimizer, inputs=batches) as recording:
        for x in batches:
            model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    trace = recording.trace
    hidden = [i for i in range(len(trace)) if trace.size[i] == 8 * 64 * 4 and trace.op[i] == "aten::addmm"]
    assert len(hidden) == 2  # the first linear's output, once per micro-batch
    assert [trace.phase[i] for i in hidden] == ["forward", "forward"]
    assert [trace.category[i] for i in hidden] == ["activation", "activation"]


def tiny_lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 100))


def log_prob(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(ids), -1).gather(-1, ids.unsqueeze(-1)).sum()


def test_a_frozen_reference_model_built_before_the_block_is_named_in_a_warning():
    """A DPO step: the policy and its optimizer are given to record, the frozen reference model built beside them
    is not. The trace lacks the reference's weights (its peak low by their bytes): record warns, the trace's meta,
    summary, text and --json name them; given as inputs, they are in the trace and nothing is said."""
    torch.manual_seed(0)
    policy, reference = tiny_lm(), tiny_lm().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    chosen, rejected = torch.randint(0, 100, (4, 16)), torch.randint(0, 100, (4, 16))

    def dpo_step():
        with torch.no_grad():
            ref = log_prob(reference, chosen) - log_prob(reference, rejected)
        margin = log_prob(policy, chosen) - log_prob(policy, rejected) - ref
        nn.functional.logsigmoid(0.1 * margin).neg().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    dpo_step()  # AdamW's state
    reference_bytes = sum(p.nbytes for p in reference.parameters())
    with pytest.warns(UnrecordedWarning, match=f"5 storages .*{reference_bytes:,} bytes.*Sequential.0.weight"):
        with memplan.record(policy, optimizer, inputs=[chosen, rejected]) as recording:
            dpo_step()
    missing = recording.trace.meta["unrecorded"]
    assert missing["storages"] == 5 and missing["bytes"] == reference_bytes  # the policy's own are all there
    assert sorted(m["name"] for m in missing["largest"]) == sorted(
        f"Sequential.{n}" for n, _ in reference.named_parameters()
    )
    assert [m["bytes"] for m in missing["largest"]] == sorted((p.nbytes for p in reference.parameters()), reverse=True)
    summary = summarize(recording.trace)
    assert summary.to_dict()["unrecorded"] == missing  # memplan trace --json
    assert f"warning: the step read 5 storages ({reference_bytes / 1024:,.2f} KiB" in render_trace(summary)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UnrecordedWarning)
        with memplan.record(policy, optimizer, inputs=[chosen, rejected, reference.state_dict()]) as whole:
            dpo_step()
    assert "unrecorded" not in whole.trace.meta
    assert whole.trace.peak()[0] == recording.trace.peak()[0] + reference_bytes
