"""PYTORCH_CUDA_ALLOC_CONF for the caching-allocator simulator: the knobs it honours and their parser.

Parsing follows c10's AllocatorConfig: `key:value` pairs separated by commas, spaces ignored,
`roundup_power2_divisions` either one power of two or a list `[256:1,512:2,>:4]` keyed by MiB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from memplan.errors import MemplanError
from memplan.units import MiB

LARGE_BUFFER = 20 * MiB
N_INTERVALS = 16  # roundup_power2_divisions intervals: [1 MiB, 2 MiB), ..., [32 GiB, inf)
TIE_BREAKS = ("lowest_address", "oldest_segment")


class AllocConfError(MemplanError):
    """A PYTORCH_CUDA_ALLOC_CONF string the simulator cannot accept."""


@dataclass(frozen=True)
class AllocConf:
    """Allocator settings; sizes in bytes, None = no limit / off (PyTorch's defaults)."""

    max_split_size: int | None = None
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * N_INTERVALS)
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    tie_break: str = "lowest_address"  # among free blocks of equal size
    max_non_split_rounding: int = LARGE_BUFFER  # an oversize block may serve a request this much smaller

    def __post_init__(self):
        if self.tie_break not in TIE_BREAKS:
            raise AllocConfError(f"tie_break: {self.tie_break!r} is not one of {', '.join(TIE_BREAKS)}")
        if len(self.roundup_power2_divisions) != N_INTERVALS:
            raise AllocConfError(f"roundup_power2_divisions: expected {N_INTERVALS} intervals")

    def divisions_for(self, size: int) -> int:
        """Power-of-two divisions that apply to a request of `size` bytes (0 or 1 = plain 512 B rounding)."""
        index = min(max(size.bit_length() - 1 - 20, 0), N_INTERVALS - 1)
        return self.roundup_power2_divisions[index]


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"([,:\[\]])", text.replace(" ", "")) if t]


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _int_value(key: str, tok: str) -> int:
    if not re.fullmatch(r"\d+", tok):
        raise AllocConfError(f"{key}: expected a whole number, got {tok!r}")
    return int(tok)


def _parse_divisions(tokens: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """Parse the value of roundup_power2_divisions starting at tokens[i]; returns (divisions, next index)."""
    key = "roundup_power2_divisions"
    if i >= len(tokens):
        raise AllocConfError(f"{key}: missing value")
    if tokens[i] != "[":
        v = _int_value(key, tokens[i])
        if not _power_of_two(v):
            raise AllocConfError(f"{key}: divisions must be a power of two, got {v}")
        return (v,) * N_INTERVALS, i + 1
    div, last, first, i = [0] * N_INTERVALS, 0, True, i + 1
    while True:
        if i >= len(tokens):
            raise AllocConfError(f"{key}: missing ']'")
        if tokens[i] == "]":
            return tuple(div), i + 1
        interval = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise AllocConfError(f"{key}: expected 'MiB:divisions' entries, got {interval!r}")
        v = _int_value(key, tokens[i + 2])
        if v != 0 and not _power_of_two(v):
            raise AllocConfError(f"{key}: divisions must be 0 or a power of two, got {v}")
        if interval == ">":
            div[last:] = [v] * (N_INTERVALS - last)
        else:
            mib = _int_value(key, interval)
            if not _power_of_two(mib):
                raise AllocConfError(f"{key}: interval {mib} MiB is not a power of two")
            index = min(mib.bit_length() - 1, N_INTERVALS - 1)
            if first:
                div[:index] = [v] * index
                first = False
            div[index] = v
            last = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1


def parse_alloc_conf(text: str, tie_break: str = "lowest_address") -> AllocConf:
    """Parse a PYTORCH_CUDA_ALLOC_CONF string ('' = defaults); unknown keys or bad values raise AllocConfError."""
    tokens = _tokens(text or "")
    values: dict = {"tie_break": tie_break}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if i + 1 >= len(tokens) or tokens[i + 1] != ":":
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: expected 'key:value' at {key!r}")
        i += 2
        if key == "roundup_power2_divisions":
            values[key], i = _parse_divisions(tokens, i)
        else:
            if i >= len(tokens):
                raise AllocConfError(f"{key}: missing value")
            tok = tokens[i]
            i += 1
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                mb = _int_value(key, tok)
                if mb < LARGE_BUFFER // MiB:
                    raise AllocConfError(f"{key}: {mb} is too small, must be >= {LARGE_BUFFER // MiB}")
                values["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = mb * MiB
            elif key == "garbage_collection_threshold":
                try:
                    v = float(tok)
                except ValueError:
                    raise AllocConfError(f"{key}: expected a number, got {tok!r}") from None
                if not 0.0 < v < 1.0:
                    raise AllocConfError(f"{key}: {v} is outside (0.0, 1.0)")
                values[key] = v
            elif key == "expandable_segments":
                if tok not in ("True", "False"):
                    raise AllocConfError(f"{key}: expected True or False, got {tok!r}")
                values[key] = tok == "True"
            elif key == "backend":
                if tok != "native":
                    raise AllocConfError(f"backend: only the native caching allocator is simulated, got {tok!r}")
            elif key in (
                "release_lock_on_cudamalloc",
                "pinned_use_cuda_host_register",
                "pinned_num_register_threads",
                "pinned_use_background_threads",
                "pinned_reserve_segment_size_mb",
                "graph_capture_record_stream_reuse",
            ):
                pass  # accepted by PyTorch, no effect on device memory placement
            else:
                raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: unknown option {key!r}")
        if i < len(tokens):
            if tokens[i] != ",":
                raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: expected ',' before {tokens[i]!r}")
            i += 1
    return AllocConf(**values)


def conf_from_snapshot_settings(settings: dict, tie_break: str = "lowest_address") -> AllocConf:
    """The AllocConf a snapshot's `allocator_settings` records (max_split_size -1 or huge = off)."""
    mss = settings.get("max_split_size", -1)
    divisions = settings.get("roundup_power2_divisions", {})
    div = [0] * N_INTERVALS
    if isinstance(divisions, dict):
        for mib, v in divisions.items():
            if str(mib).isdigit() and int(mib) > 0 and isinstance(v, int):
                div[min(int(mib).bit_length() - 1, N_INTERVALS - 1)] = v
    gc = settings.get("garbage_collection_threshold", 0.0)
    return AllocConf(
        max_split_size=mss if isinstance(mss, int) and 0 < mss < (1 << 62) else None,
        roundup_power2_divisions=tuple(div),
        expandable_segments=bool(settings.get("expandable_segments", False)),
        garbage_collection_threshold=float(gc) if isinstance(gc, (int, float)) else 0.0,
        tie_break=tie_break,
    )
