"""Byte counts for people: the binary units and the one formatter every summary, report and plot uses."""

from __future__ import annotations

import re

from memplan.errors import MemplanError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1 << 40,
}  # what a size given by a person may end in, lower-cased
SCALES = {"GiB": GiB, "MiB": MiB, "KiB": KiB, "B": 1}  # largest first


class SizeError(MemplanError):
    """A memory size given by a person that is not a positive number of bytes."""


def parse_size(text: str) -> int:
    """Bytes in a size such as '11GiB', '16GB', '512MiB', '1.5 GiB' or '4096'; SizeError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in SIZE_UNITS:
        raise SizeError(f"{text!r} is not a size (use e.g. 11GiB, 16GB, 512MiB or a number of bytes)")
    size = int(float(m.group(1)) * SIZE_UNITS[unit])
    if size <= 0:
        raise SizeError(f"{text!r}: a size must be positive")
    return size


def parse_bandwidth(text: str) -> int:
    """Bytes per second in a bandwidth such as '25GB/s', '31.5 GB/s' or '64GiB/s' (a size, '/s' optional);
    SizeError otherwise."""
    size = re.sub(r"\s*/\s*s\s*$", "", str(text))
    try:
        return parse_size(size)
    except SizeError:
        raise SizeError(f"{text!r} is not a bandwidth (use e.g. 25GB/s, 64GiB/s or bytes per second)") from None


def byte_unit(n: int | float, smallest: str = "B") -> tuple[str, int]:
    """(unit, bytes per unit): the largest unit, down to `smallest`, in which |n| reads at least 1 (else `smallest`)."""
    units = list(SCALES)
    for unit in units[: units.index(smallest)]:
        if abs(n) >= SCALES[unit]:
            return unit, SCALES[unit]
    return smallest, SCALES[smallest]


def human_bytes(n: int | float, unit: str | None = None, digits: int = 2, grouped: bool = False) -> str:
    """`n` bytes in `unit` (default: byte_unit's) with `digits` decimals, thousands grouped with commas when
    `grouped`; whole bytes have no decimals."""
    unit = unit or byte_unit(n)[0]
    if unit == "B":
        return f"{int(n)} B"
    return f"{n / SCALES[unit]:{',' if grouped else ''}.{digits}f} {unit}"


def format_size(n: int) -> str:
    """Bytes as GiB with two decimals, or MiB with one below a GiB: a memory size in a sentence or a table."""
    return human_bytes(n, unit="GiB") if n >= GiB else human_bytes(n, unit="MiB", digits=1)


def torch_size(n: int) -> str:
    """Bytes as PyTorch's caching allocator prints them in its messages (c10's format_size): two decimals of bytes,
    KiB, MiB or GiB, each unit up to and including its next power of 1024."""
    if n <= 1024:
        return f"{n} bytes"
    for limit, divisor, unit in ((1 << 20, 1 << 10, "KiB"), (1 << 30, 1 << 20, "MiB")):
        if n <= limit:
            return f"{n / divisor:.2f} {unit}"
    return f"{n / (1 << 30):.2f} GiB"


def cuda_oom_message(tried: int, total: int | None, free: int, allocated: int, reserved: int, device: int = 0,
                     process: int | None = None) -> str:  # fmt: skip
    """PyTorch's CUDA out-of-memory error as c10/cuda/CUDACachingAllocator.cpp words it: the segment it tried to
    allocate, the GPU's total and free bytes, the process's use (NVML's line; left out when not known), allocated and
    reserved-but-unallocated bytes."""
    capacity = torch_size(total) if total is not None else "(not known: give --gpu or --memory)"
    used = (
        ""
        if process is None
        else f"Including non-PyTorch memory, this process has {torch_size(process)} memory in use. "
    )
    return (
        f"CUDA out of memory. Tried to allocate {torch_size(tried)}. GPU {device} has a total capacity of {capacity} "
        f"of which {torch_size(free)} is free. {used}Of the allocated memory {torch_size(allocated)} is allocated by "
        f"PyTorch, and {torch_size(reserved - allocated)} is reserved by PyTorch but unallocated."
    )
