"""What turns a choice's work into step seconds: the device's FLOP rate (a GPU's dense peak from the catalogue, else
a matmul measured on this machine), the host link's bandwidth (given, or the GPU's), and the host's AdamW step per
parameter (measured on this machine: the host that steps a CPU-offloaded optimizer is a CPU like this one)."""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

import torch

from memplan.gpus import GPU
from memplan.planner.cost.transfer import host_link, host_transfer

MATMUL_SIZE = 1024  # the measured matmul's square side: large enough to run at the machine's matmul rate
HOST_ELEMENTS = 1 << 20  # elements of the measured host AdamW step
REPEATS = 5  # timings of each measurement; the fastest counts (the least disturbed by other work)


@dataclass(frozen=True)
class Rates:
    """The rates a step's added work is timed at."""

    flops: int  # FLOP/s the step's matmuls run at
    flops_source: str  # "H100-80GB's dense bf16 peak", "measured here: a float32 matmul"
    host_bandwidth: int | None  # bytes/s one way over the host link; None when unknown (no GPU, none given)
    host_link: str | None  # the link's name ("PCIe gen5 x16", "given"); None when unknown
    host_adamw: float  # seconds per parameter of an fp32 AdamW step on the host, measured here

    def to_dict(self) -> dict:
        """The rates as plain data (a command's --json)."""
        return asdict(self)

    def transfer_seconds(self, moved: int) -> float:
        """Seconds `moved` bytes take to the host and back over the link (transfer.HostTransfer.seconds)."""
        return host_transfer(moved, bandwidth=self.host_bandwidth).seconds

    def host_optimizer_seconds(self, elements: int, parameter_bytes: int) -> float:
        """Seconds the host optimizer adds a step: the gradients down and the parameters up over the link, and the
        host's AdamW step over `elements` parameters."""
        return self.transfer_seconds(parameter_bytes) + elements * self.host_adamw


def _fastest(run) -> float:
    """The least of REPEATS timings of `run()`, after one untimed call."""
    run()
    timings = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        timings.append(time.perf_counter() - start)
    return min(timings)


@functools.cache
def measured_matmul_rate(dtype: str) -> int:
    """FLOP/s of a square matmul on this machine's CPU in the dtype a step of `dtype` multiplies in."""
    compute = torch.float32 if dtype == "float32" else torch.bfloat16
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(compute) for _ in range(2))
    return int(2 * MATMUL_SIZE**3 / _fastest(lambda: torch.mm(a, b)))


@functools.cache
def measured_host_adamw() -> float:
    """Seconds per parameter of torch.optim.AdamW's step on fp32 tensors of this machine's CPU."""
    parameter = torch.nn.Parameter(torch.randn(HOST_ELEMENTS))
    parameter.grad = torch.randn(HOST_ELEMENTS)
    optimizer = torch.optim.AdamW([parameter])
    return _fastest(optimizer.step) / HOST_ELEMENTS


def step_rates(dtype: str, gpu: GPU | None, bandwidth: int | None) -> Rates:
    """The rates for a step of `dtype`: `gpu`'s dense peak, or a matmul measured here; the host link at `bandwidth`
    (which wins) or `gpu`'s, None without either."""
    if gpu is not None:
        flops, source = gpu.flop_rate(dtype), f"{gpu.name}'s dense {'fp32' if dtype == 'float32' else 'bf16'} peak"
    else:
        flops, source = measured_matmul_rate(dtype), f"measured here: a {MATMUL_SIZE}x{MATMUL_SIZE} matmul"
    link_rate, link = host_link(gpu, bandwidth) if gpu is not None or bandwidth is not None else (None, None)
    return Rates(flops, source, link_rate, link, measured_host_adamw())
