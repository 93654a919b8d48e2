"""Byte counts for people: the binary units and the one formatter every summary, report and plot uses."""

from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SCALES = {"GiB": GiB, "MiB": MiB, "KiB": KiB, "B": 1}  # largest first


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
