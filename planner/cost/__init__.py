"""The cost side of a memory/compute trade-off: FLOPs of a training step (matmul, elementwise, per module), its
measured time, for every layer mode, full checkpointing and compile budget, and the time activation offload's host
transfers add."""

from memplan.planner.cost.flops import CostError, StepFlops, count_step_flops
from memplan.planner.cost.timing import StepTime, time_step, time_workloads, timed_workload
from memplan.planner.cost.transfer import HostTransfer, host_transfer

__all__ = [
    "CostError",
    "HostTransfer",
    "StepFlops",
    "StepTime",
    "count_step_flops",
    "host_transfer",
    "time_step",
    "time_workloads",
    "timed_workload",
]
