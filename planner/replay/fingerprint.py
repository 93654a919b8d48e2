"""Bitwise fingerprints of training steps: the loss, every gradient, and the parameters after the steps.

Gradients are read by an optimizer step pre-hook (the moment they are complete, before the update
and before Workload.step() sets them to None). Bytes are read with ctypes, so taking a fingerprint
allocates no tensor memory and leaves the allocation sequence of the step unchanged.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memplan.traces.inputs.workload import Workload


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes (its whole storage span when not contiguous), read on the host: a device
    tensor is copied there first (as raw bytes, so every dtype, bf16 too, which numpy has not)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    if t.is_contiguous():
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    else:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    return hashlib.sha256(ctypes.string_at(ptr, nbytes) if nbytes else b"").hexdigest()


@dataclass
class RunPrints:
    """Per step: the loss digest and each named gradient's digest; at the end: each parameter's digest."""

    losses: list[str] = field(default_factory=list)
    grads: list[dict[str, str]] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # spent digesting gradients inside the steps: left out of their step times


def watch_gradients(workload: Workload, prints: RunPrints, sync: Callable[[], None] = lambda: None):
    """Record every gradient's digest at each optimizer step, timed from after `sync()` (the device's kernels
    so far count as the step's) into `prints.seconds`; returns the hook handle (remove() it)."""
    names = {id(p): n for n, p in workload.model.named_parameters()}

    def hook(optimizer, args, kwargs):
        sync()
        start = time.perf_counter()
        prints.grads.append(
            {
                names.get(id(p), f"param{i}"): tensor_digest(p.grad)
                for group in optimizer.param_groups
                for i, p in enumerate(group["params"])
                if p.grad is not None
            }
        )
        prints.seconds += time.perf_counter() - start

    return workload.optimizer.register_step_pre_hook(hook)


def record_params(workload: Workload, prints: RunPrints) -> None:
    prints.params = {n: tensor_digest(p.detach()) for n, p in workload.model.named_parameters()}


def first_difference(a: RunPrints, b: RunPrints) -> str | None:
    """Where two runs first differ ('step 2 loss', 'step 1 gradient of x', 'parameter x'), None if bitwise equal."""
    if len(a.losses) != len(b.losses) or len(a.grads) != len(b.grads):
        return "number of steps"
    for k, (la, lb) in enumerate(zip(a.losses, b.losses), start=1):
        if la != lb:
            return f"step {k} loss"
    for k, (ga, gb) in enumerate(zip(a.grads, b.grads), start=1):
        if ga.keys() != gb.keys():
            return f"step {k} set of gradients"
        for name in ga:
            if ga[name] != gb[name]:
                return f"step {k} gradient of {name}"
    for name in a.params:
        if a.params[name] != b.params.get(name):
            return f"parameter {name}"
    return None
