"""Replay of plans through the C++ allocator behind PyTorch's CPU allocator, on the bundled workloads."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from lanes import some

from memplan.cli import main
from memplan.errors import PlanError
from memplan.planner.plan import save_plan
from memplan.planner.problem import problem_from_trace
from memplan.planner.replay import build
from memplan.planner.replay.adoption import adopt_resident, resident_groups
from memplan.planner.replay.cpu_session import CPUPlanAllocator
from memplan.planner.replay.fingerprint import RunPrints, first_difference, tensor_digest
from memplan.planner.replay.runner import replay, run_steps, warm_up
from memplan.planner.replay.schedule import ReplayError, Schedule, schedule_from
from memplan.planner.workloads import bert
from memplan.solvers import solve
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.format import load, save
from memplan.traces.inputs.model_file import load_workload

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"bert": ROOT / "examples" / "bert.py", "gpt2": ROOT / "examples" / "gpt2.py"}
SEQ = 32


def maker(model: str, batch: int):
    return lambda: load_workload(StepSpec(MODELS[model], batch=batch, seq=SEQ))


@pytest.fixture(scope="module", params=some(sorted(MODELS), fast=("bert",)))  # gpt2: the full suite only
def planned(request):
    """(model name, trace, problem, plan) for the model's step at batch 2, solved by the portfolio."""
    trace = capture_step(maker(request.param, 2))
    problem = problem_from_trace(trace)
    return request.param, trace, problem, solve(problem, method="auto", time_limit=5.0)


def test_three_steps_served_by_the_plan_alone_and_bitwise_equal(planned):
    model, trace, _, plan = planned
    schedule = schedule_from(plan, trace)
    report = replay(schedule, maker(model, 2), CPUPlanAllocator(schedule), steps=3)
    assert report.fallback_count == 0 and report.fallback_bytes == 0 and report.missing == 0
    assert report.planned_count == 3 * len(schedule) > 0
    assert report.adopted_count == report.reserved_count == len(schedule.reserved_sizes) > 0
    assert report.adopted_bytes == report.reserved_bytes == sum(schedule.reserved_sizes)
    assert report.outside_bytes == 0 and report.no_slot == 0
    assert report.peak_bytes == report.arena_top_peak == plan.arena
    assert report.loss_equal and report.grads_equal and report.params_equal and report.bitwise_equal
    assert report.first_difference is None
    assert not build.cpu_extension().installed()  # the default CPU allocator is back


def test_plan_for_another_batch_size_falls_back_and_stays_bitwise_equal(planned):
    model, trace, _, plan = planned
    schedule = schedule_from(plan, trace)
    report = replay(schedule, maker(model, 3), CPUPlanAllocator(schedule), steps=2)
    assert report.fallback_count > 0 and report.fallback_bytes > 0
    assert report.outside_bytes > 0 and 0 < report.adopted_count < report.reserved_count  # inputs: no slot
    assert report.no_slot == 0  # a storage with no slot of its size left never asks
    assert report.peak_bytes > report.arena_top_peak
    assert report.bitwise_equal, report.first_difference


def test_step_scope_plan_adopts_nothing_and_counts_the_resident_state_outside(planned):
    model, trace, _, _ = planned
    plan = solve(problem_from_trace(trace, scope="step"), method="greedy", time_limit=5.0)
    schedule = schedule_from(plan, trace)
    resident = sum(int(trace.size[i]) for i in range(len(trace)) if plan.offsets[i] < 0)
    assert schedule.reserved_sizes == [] and resident > 0
    report = replay(schedule, maker(model, 2), CPUPlanAllocator(schedule), steps=2)
    assert report.adopted_count == report.fallback_count == 0
    assert report.outside_bytes == resident
    assert report.arena_top_peak == plan.arena and report.peak_bytes == plan.arena + resident
    assert report.bitwise_equal, report.first_difference


def storage_bytes(groups: list[list[torch.Tensor]]) -> list[bytes]:
    return [ctypes.string_at(g[0].untyped_storage().data_ptr(), g[0].untyped_storage().nbytes()) for g in groups]


def all_inside(groups: list[list[torch.Tensor]], alloc: CPUPlanAllocator) -> bool:
    """Every tensor's data lies in the plan's arena."""
    base, top = alloc.arena_base, alloc.arena_base + alloc.schedule.arena
    return all(base <= t.data_ptr() < top for g in groups for t in g)


def test_resident_storages_move_into_the_arena_and_outlive_the_plan(planned):
    model, trace, _, plan = planned
    schedule = schedule_from(plan, trace)
    workload = maker(model, 2)()
    warm_up(workload)
    groups = resident_groups(workload, "cpu")
    before = storage_bytes(groups)
    ext = build.cpu_extension()
    alive_before = ext.plans_alive()
    with CPUPlanAllocator(schedule) as alloc:
        assert not all_inside(groups, alloc)
        assert adopt_resident(workload, alloc, "cpu") == 0
        assert all_inside(groups, alloc) and storage_bytes(groups) == before  # moved, bitwise unchanged
        assert alloc.stats()["adopted_count"] == len(groups) == len(schedule.reserved_sizes)
        run_steps(workload, 2, alloc.step, RunPrints())
        assert all_inside(groups, alloc) and alloc.stats()["fallback_count"] == 0
        trained = {n: tensor_digest(p.detach()) for n, p in workload.model.named_parameters()}
    assert ext.plans_alive() == alive_before + 1  # released, but its arena still holds the resident storages
    assert all_inside(groups, alloc)
    assert trained == {n: tensor_digest(p.detach()) for n, p in workload.model.named_parameters()}
    workload.step()  # the default allocator trains on, over the adopted storages
    assert all_inside(groups, alloc)
    del workload, groups
    gc.collect()
    assert ext.plans_alive() == alive_before


def test_plan_does_not_replay_on_a_different_trace(planned):
    model, trace, _, plan = planned
    other = capture_step(maker(model, 1))
    with pytest.raises(ReplayError, match="different trace"):
        schedule_from(plan, other)


def test_a_plan_the_verifier_refuses_is_never_replayed(planned):
    """Two buffers live together moved onto the same bytes: schedule_from refuses the plan (the replay's gate)."""
    _, trace, problem, plan = planned
    i, j = next((i, j) for i in range(len(trace)) for j in range(i) if problem.conflict(i, j) and problem.size[j])
    shared = dataclasses.replace(plan, offsets=[plan.offsets[j] if k == i else o for k, o in enumerate(plan.offsets)])
    with pytest.raises(PlanError, match="may be live together but share bytes"):
        schedule_from(shared, trace)


def test_the_cpu_allocator_refuses_a_schedule_outside_its_arena():
    """Past the verifier (a Schedule made by hand), the C++ core still refuses slots whose bounds overflow."""
    for offsets, alignment in (([2**63 - 128], 64), ([0, 0], 2**63 - 64)):
        schedule = Schedule(offsets=offsets, sizes=[64] * len(offsets), reserved_offsets=[], reserved_sizes=[],
                            arena=4096, bound=0, alignment=alignment)  # fmt: skip
        with pytest.raises(ReplayError, match="the plan allocator refused the plan"):
            with CPUPlanAllocator(schedule):
                pass
        assert not build.cpu_extension().installed()


def test_fingerprints_tell_different_runs_apart():
    runs = []
    for seed in (1, 2):
        workload = maker("bert", 1)()
        warm_up(workload)
        torch.manual_seed(seed)  # different dropout masks from the first step on
        prints = RunPrints()
        run_steps(workload, 1, nullcontext, prints)
        runs.append(prints)
    assert first_difference(runs[0], runs[0]) is None
    assert first_difference(runs[0], runs[1]) == "step 1 loss"


def test_replay_step_times_leave_out_the_gradient_digests():
    """run_steps times each step and counts the time of its gradient digests (for the bitwise comparison)
    apart, in prints.seconds: the first GPU run's step times included the digests."""
    workload = bert.build_workload(2, 16)
    workload.step()
    prints = RunPrints()
    seconds = run_steps(workload, 2, nullcontext, prints)
    assert len(prints.grads) == 2 and prints.seconds > 0
    assert all(s > 0 for s in seconds)


def test_tensors_made_in_a_step_outlive_the_plan_and_the_allocator_is_restored():
    ext = build.cpu_extension()
    default = torch.empty(16)  # made by the default allocator before the swap
    schedule = Schedule(
        offsets=[0], sizes=[4096], reserved_offsets=[], reserved_sizes=[], arena=4096, bound=4096, alignment=64
    )
    alive_before = ext.plans_alive()
    with CPUPlanAllocator(schedule) as alloc:
        assert ext.installed()
        with alloc.step():
            kept = torch.full((1024,), 7.0)  # 4096 bytes: the planned slot
            extra = torch.full((10,), 3.0)  # beyond the plan: served by the fallback
        between = torch.ones(3)  # outside a step: the previous allocator
    assert not ext.installed()
    stats = alloc.stats()
    assert (stats["planned_count"], stats["fallback_count"], stats["extra"]) == (1, 1, 1)
    assert ext.plans_alive() == alive_before + 1  # released, but its arena still holds `kept`
    assert torch.equal(kept, torch.full((1024,), 7.0)) and torch.equal(extra, torch.full((10,), 3.0))
    kept += 1
    del kept, extra, between, default
    assert ext.plans_alive() == alive_before


@pytest.fixture(scope="module")
def bert_files(tmp_path_factory):
    """A BERT batch-2 trace and its saved plan, written as `memplan trace` and `memplan solve` would."""
    folder = tmp_path_factory.mktemp("replay")
    trace = capture_step(maker("bert", 2))
    problem = problem_from_trace(trace)
    plan = solve(problem, method="greedy", time_limit=5.0)
    save(trace, folder / "bert.trace.json.gz")
    save_plan(plan, problem, folder / "bert.plan.json")
    return folder, plan


def test_cli_replay_json(bert_files):
    folder, plan = bert_files
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(folder / "bert.plan.json"),
            str(MODELS["bert"]),
            "--batch",
            "2",
            "--seq",
            str(SEQ),
            "--steps",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["fallback_count"] == 0 and summary["bitwise_equal"] is True
    assert summary["adopted_bytes"] == summary["reserved_bytes"] > 0 and summary["outside_bytes"] == 0
    assert summary["arena_bytes"] == plan.arena == summary["arena_top_peak"] == summary["peak_bytes"]


def test_cli_replay_other_batch_needs_the_trace_then_falls_back(bert_files):
    folder, _ = bert_files
    args = [
        "replay",
        str(folder / "bert.plan.json"),
        str(MODELS["bert"]),
        "--batch",
        "3",
        "--seq",
        str(SEQ),
        "--steps",
        "1",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "pass the plan's trace with --trace" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, args + ["--trace", str(folder / "bert.trace.json.gz"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["fallback_count"] > 0 and summary["bitwise_equal"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when no GPU is present")
def test_cli_replay_cuda_without_gpu_fails_in_one_line(bert_files):
    folder, _ = bert_files
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(folder / "bert.plan.json"),
            str(MODELS["bert"]),
            "--device",
            "cuda",
            "--trace",
            str(folder / "bert.trace.json.gz"),
        ],
    )
    assert result.exit_code == 1
    assert "no CUDA GPU is available" in result.output and len(result.output.strip().splitlines()) == 1


def test_cli_replay_refuses_edited_plans_before_running_them(bert_files):
    """A plan edited so two live buffers share bytes, or to claim an arena of 2**70 or a bound above its arena:
    one Error line and exit code 1, with the plan's trace given and with the step captured to check it."""
    folder, plan = bert_files
    problem = problem_from_trace(load(folder / "bert.trace.json.gz"))
    i, j = next((i, j) for i in range(len(plan.offsets)) for j in range(i) if problem.conflict(i, j))
    doc = json.loads((folder / "bert.plan.json").read_text())
    edits = {
        "shared": ({"offsets": [plan.offsets[j] if k == i else o for k, o in enumerate(plan.offsets)]}, "share bytes"),
        "huge": ({"arena": 2**70}, "outside [0, 2**62)"),
        "bound": ({"bound": plan.arena + 512}, "is not between 0 and the arena"),
    }
    for name, (edit, message) in edits.items():
        (folder / f"{name}.plan.json").write_text(json.dumps({**doc, **edit}))
        for extra in (["--trace", str(folder / "bert.trace.json.gz")], []):
            args = ["replay", str(folder / f"{name}.plan.json"), str(MODELS["bert"]), "--batch", "2", "--seq", str(SEQ)]
            result = CliRunner().invoke(main, args + extra)
            assert result.exit_code == 1 and result.stdout == "", (name, result.output)
            errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
            assert len(errors) == 1 and message in errors[0] and result.stderr.endswith(errors[0] + "\n"), result.stderr


def test_a_digest_reads_raw_bytes_of_any_dtype():
    """bf16 (which numpy lacks) and 0-dim tensors digest; equal values give equal digests, one flipped bit another."""
    a = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert tensor_digest(a) == tensor_digest(a.clone()) != tensor_digest(a + 1)
    assert tensor_digest(torch.tensor(1.5, dtype=torch.bfloat16)) != tensor_digest(
        torch.tensor(2.5, dtype=torch.bfloat16)
    )
    assert tensor_digest(a.t()) == tensor_digest(a.clone().t())  # a transposed view: its storage's span
