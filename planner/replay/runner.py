"""Replay: run a workload's steps with the plan allocator and again with the reference allocator.

Both runs start from the same state: the workload is built afresh (load_workload seeds torch), one
warm-up step runs with the default allocator (it creates the optimizer state), and torch is seeded
again before the measured steps. The planned run first adopts the resident storages into the arena
(planner/replay/adoption.py). Loss, every gradient and the parameters after the steps are compared
bitwise. CPU steps run on one intra-op thread, as capture runs them (traces.capture.one_cpu_thread).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import fields

import torch

from memplan.planner.layers import fusion
from memplan.planner.replay.adoption import adopt_resident
from memplan.planner.replay.fingerprint import (
    RunPrints,
    first_difference,
    record_params,
    tensor_digest,
    watch_gradients,
)
from memplan.planner.replay.native import STATS_FIELDS
from memplan.planner.replay.report import ReplayReport
from memplan.planner.replay.schedule import Schedule
from memplan.traces.capture import one_cpu_thread
from memplan.traces.inputs.workload import Workload

SEED = 1234
# The allocator's counters a report carries as they are (its arena and step count are the replay's own).
COUNTERS = [f.name for f in fields(ReplayReport) if f.name in set(STATS_FIELDS) - {"arena_bytes", "steps"}]


def warm_up(workload: Workload) -> None:
    """One step with the current (default) allocator, then a fixed seed for the measured steps."""
    workload.step()
    torch.manual_seed(SEED)


def run_steps(workload: Workload, steps: int, step_context: Callable, prints: RunPrints, sync=None) -> list[float]:
    """Run `steps` steps, each inside `step_context()`, fingerprinting them; returns each step's seconds
    (the fingerprints' own time left out, so they compare with a plain step's).

    The cycle collector is off during a step, so tensors die where the program drops them (as in capture).
    """
    seconds = []
    hook = watch_gradients(workload, prints, sync or (lambda: None))
    try:
        for _ in range(steps):
            gc.collect()
            gc.disable()
            try:
                start, fingerprinting = time.perf_counter(), prints.seconds
                with step_context():
                    loss = workload.step()
                    if sync is not None:
                        sync()
                seconds.append(time.perf_counter() - start - (prints.seconds - fingerprinting))
            finally:
                gc.enable()
            prints.losses.append(tensor_digest(loss))
            del loss
    finally:
        hook.remove()
    record_params(workload, prints)
    return seconds


def replay(
    schedule: Schedule,
    make_workload: Callable[[], Workload],
    plan_allocator,
    *,
    steps: int = 3,
    device: str = "cpu",
    reference: str = "PyTorch's default CPU allocator",
) -> ReplayReport:
    """Replay `steps` steps under `plan_allocator` (a context manager with adopt(), step() and stats()),
    after adopting the resident storages into its arena, and compare."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    planned, ref = RunPrints(), RunPrints()
    # Both runs do the eager math of the tempo layers, as the trace the plan was made from recorded it
    # (planner/layers/fusion.py): the planned run asks for exactly the trace's buffers, the reference run computes
    # the same bits.
    with one_cpu_thread(torch.device(device)), fusion.eager():
        workload = make_workload()
        name = workload.name
        warm_up(workload)
        with plan_allocator as alloc:
            outside = adopt_resident(workload, alloc, torch.device(device).type)
            plan_seconds = run_steps(workload, steps, alloc.step, planned, sync)
        stats = alloc.stats()
        del workload
        gc.collect()
        workload = make_workload()
        warm_up(workload)
        ref_seconds = run_steps(workload, steps, nullcontext, ref, sync)
        del workload
    diff = first_difference(planned, ref)
    return ReplayReport(
        workload=name,
        device=device,
        steps=steps,
        reference=reference,
        planned_per_step=len(schedule),
        arena_bytes=schedule.arena,
        bound=schedule.bound,
        reserved_count=len(schedule.reserved_sizes),
        reserved_bytes=sum(schedule.reserved_sizes),
        outside_bytes=outside,
        peak_bytes=stats["held_peak"] + outside,
        **{k: stats[k] for k in COUNTERS},
        loss_equal=planned.losses == ref.losses,
        grads_equal=planned.grads == ref.grads,
        params_equal=planned.params == ref.params,
        first_difference=diff,
        plan_step_seconds=plan_seconds,
        reference_step_seconds=ref_seconds,
    )
