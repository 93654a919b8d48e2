"""The time activation offload adds: the bytes offloaded layers move to the host in forward and back in backward,
over the host link (a GPU's from the catalogue, gpus.py, or a bandwidth given): transfer time = bytes moved each
way / the link's bandwidth one way, once each way. What overlaps with compute is hidden in a real step; this is
the time when nothing overlaps, the most offload can add."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memplan.gpus import GPU
from memplan.planner.cost.flops import CostError

GIVEN = "given"  # the link's name when the bandwidth was given, not read from a GPU


@dataclass(frozen=True)
class HostTransfer:
    """Offload's traffic over the host link and the time it takes when nothing overlaps it."""

    moved: int  # bytes moved each way (to the host in forward, back in backward)
    bandwidth: int  # bytes/s one way over the link
    link: str  # "PCIe gen5 x16", "NVLink-C2C", or GIVEN

    @property
    def seconds_each_way(self) -> float:
        """Seconds to move `moved` bytes one way."""
        return self.moved / self.bandwidth

    @property
    def seconds(self) -> float:
        """Seconds added to a step when nothing overlaps: to the host, then back."""
        return 2 * self.seconds_each_way

    def to_dict(self) -> dict:
        """The figures as plain data (a command's --json)."""
        return {**asdict(self), "seconds_each_way": self.seconds_each_way, "seconds": self.seconds}


def host_link(gpu: GPU | None, bandwidth: int | None) -> tuple[int, str]:
    """The host link's bandwidth one way (bytes/s) and its name: `bandwidth` when given, else `gpu`'s; CostError when
    there is neither."""
    if bandwidth is not None:
        if bandwidth <= 0:
            raise CostError(f"--host-bandwidth {bandwidth}: a bandwidth must be positive")
        return bandwidth, GIVEN
    if gpu is None:
        raise CostError("offload's transfer time needs the host link: name a GPU (--gpu) or give --host-bandwidth")
    return gpu.host_bandwidth, gpu.host_link


def host_transfer(moved: int, gpu: GPU | None = None, bandwidth: int | None = None) -> HostTransfer:
    """The transfer of `moved` bytes each way over the host link of `gpu`, or at `bandwidth` bytes/s (which wins)."""
    rate, link = host_link(gpu, bandwidth)
    return HostTransfer(moved, rate, link)
