"""The cost side of a memory/compute trade-off: FLOPs of a training step (matmul, elementwise, per module) and
its measured time, for every layer mode, full checkpointing and compile budget."""

from memplan.planner.cost.flops import CostError, StepFlops, count_step_flops
from memplan.planner.cost.timing import StepTime, time_step, time_workloads, timed_workload

__all__ = [
    "CostError",
    "StepFlops",
    "StepTime",
    "count_step_flops",
    "time_step",
    "time_workloads",
    "timed_workload",
]
