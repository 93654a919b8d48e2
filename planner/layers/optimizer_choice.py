"""Apply a step's optimizer choice (modes.OPTIMIZERS): the model file's AdamW (or Adam) rebuilt, with the same
parameter groups and hyperparameters, as one whose state is smaller on the device: quantized moments in torchao's
8-bit or 4-bit layout (planner/layers/lowbit_adamw.py), or the state and the step on the host
(planner/layers/host_adamw.py). Any other optimizer, or one that cannot be converted as it is set up (amsgrad,
maximize for the quantized ones; state already made), is refused in one line. Gradients are untouched: only the
update changes, the quantized ones' within their blocks' rounding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from memplan.errors import PatchError
from memplan.modes import ADAMW_4BIT, ADAMW_8BIT, ADAMW_HOST, AS_BUILT, check_optimizer
from memplan.planner.layers.host_adamw import HostAdamW, host_state_bytes
from memplan.planner.layers.lowbit_adamw import LowBitAdamW, state_bytes

BITS = {ADAMW_8BIT: 8, ADAMW_4BIT: 4}
CONVERTIBLE = (torch.optim.AdamW, torch.optim.Adam)
STEP_BYTES = 4  # a 0-d fp32 step counter per parameter


@dataclass(frozen=True)
class OptimizerChoice:
    """What `choose_optimizer` made of the model file's optimizer, and what its state holds once made (a trace's
    meta "optimizer_choice")."""

    optimizer: str  # the choice, one of modes.OPTIMIZERS
    built: str  # the class of the model file's optimizer
    parameters: int  # parameters it steps
    elements: int  # their elements
    parameter_bytes: int  # their bytes on the device (what the host choice copies each way at every step)
    device_bytes: int  # bytes of optimizer state on the device (the step counters, on the CPU, not counted)
    host_bytes: int  # bytes on the host: the host choice's master copies, gradient buffers and state
    built_bytes: int  # the model file's optimizer's moments on the device, for comparison

    def to_dict(self) -> dict:
        """The report as plain data."""
        return asdict(self)


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _refuse(choice: str, optimizer: torch.optim.Optimizer) -> None:
    """PatchError in one line when `optimizer` cannot be rebuilt as `choice`."""
    name = type(optimizer).__name__
    if type(optimizer) not in CONVERTIBLE:
        raise PatchError(f"--optimizer {choice}: the model file's optimizer is {name}; only AdamW and Adam convert")
    if optimizer.state:
        raise PatchError(f"--optimizer {choice}: the model file's {name} has state already (it has stepped)")
    for flag in ("amsgrad", "maximize", "differentiable") if choice in BITS else ():  # the host steps the class itself
        if any(group.get(flag) for group in optimizer.param_groups):
            raise PatchError(f"--optimizer {choice}: the model file's {name} is set with {flag}=True, which the "
                             "quantized AdamW lacks")  # fmt: skip


def choose_optimizer(
    optimizer: torch.optim.Optimizer, choice: str
) -> tuple[torch.optim.Optimizer, OptimizerChoice | None]:
    """(the optimizer to step, what was made of it) for the choice: the model file's own as built (None), or its
    AdamW/Adam rebuilt with the same parameter groups and hyperparameters; PatchError when it cannot be."""
    if check_optimizer(choice) == AS_BUILT:
        return optimizer, None
    _refuse(choice, optimizer)
    groups = [dict(group) for group in optimizer.param_groups]
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(g.get("decoupled_weight_decay") for g in groups)
    params = _parameters(optimizer)
    built = sum(2 * p.numel() * p.element_size() for p in params)
    if choice == ADAMW_HOST:
        chosen = HostAdamW(groups, inner=type(optimizer))
        device, host = 0, sum(host_state_bytes(p.numel()) for p in params)
    else:
        bits = BITS[choice]
        keep = ("params", "lr", "betas", "eps", "weight_decay")
        chosen = LowBitAdamW([{k: g[k] for k in keep} for g in groups], bits=bits, decoupled=decoupled)
        device = sum(state_bytes(p.numel(), p.element_size(), bits) - STEP_BYTES for p in params)
        host = 0
    elements, nbytes = sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)
    report = OptimizerChoice(choice, type(optimizer).__name__, len(params), elements, nbytes, device, host, built)
    return chosen, report
