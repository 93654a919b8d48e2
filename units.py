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
