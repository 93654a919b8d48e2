"""units.py: the unit chosen for a byte count and the text every report prints for it."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.traces.format import live_bytes, make_trace
from memplan.units import GiB, KiB, MiB, SizeError, byte_unit, human_bytes, parse_size


def test_unit_follows_magnitude_down_to_the_smallest_asked():
    assert byte_unit(3 << 30) == ("GiB", GiB)
    assert byte_unit(5 << 20) == ("MiB", MiB)
    assert byte_unit(4000) == ("KiB", KiB)
    assert byte_unit(1023) == ("B", 1)
    assert byte_unit(-2048) == ("KiB", KiB)
    assert byte_unit(4000, smallest="KiB") == ("KiB", KiB)  # a plot axis never goes below KiB
    assert byte_unit(10, smallest="KiB") == ("KiB", KiB)
    assert byte_unit(5 << 20, smallest="GiB") == ("GiB", GiB)


def test_human_bytes_reads_best_by_default():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, MiB - 1, MiB, 5.5 * GiB, -2048, 2.7)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "1.50 KiB",
        "1024.00 KiB",
        "1.00 MiB",
        "5.50 GiB",
        "-2.00 KiB",
        "2 B",
    ]


def test_human_bytes_in_a_given_unit_precision_and_grouping():
    assert human_bytes(5000, unit="MiB") == "0.00 MiB"
    assert human_bytes(3 * GiB, unit="MiB") == "3072.00 MiB"
    assert human_bytes(300 * MiB, unit="MiB", digits=1) == "300.0 MiB"
    assert human_bytes(1500 * GiB) == "1500.00 GiB"
    assert human_bytes(1500 * GiB, grouped=True) == "1,500.00 GiB"
    assert human_bytes(999, grouped=True) == "999 B"


def test_live_bytes_sums_sizes_over_alloc_to_free():
    size, alloc, free = np.array([100, 200, 50]), np.array([0, 1, 3]), np.array([5, 3, 4])
    assert live_bytes(size, alloc, free, 5).tolist() == [100, 300, 300, 150, 100]
    trace = make_trace({"size": size.tolist(), "alloc": alloc.tolist(), "free": free.tolist()})
    assert trace.live_bytes().tolist() == live_bytes(size, alloc, free, trace.end).tolist()
    assert live_bytes(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 0).tolist() == []


@pytest.mark.parametrize(
    "text,expected",
    [
        ("11GiB", 11 << 30),
        ("16GB", 16 * 10**9),
        ("512MiB", 512 << 20),
        ("4096", 4096),
        ("1.5 KiB", 1536),
        ("2gib", 2 << 30),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "11 parsecs", "-3GiB", "0", "1e9", "12 GiB extra"])
def test_parse_size_rejects(text):
    with pytest.raises(SizeError):
        parse_size(text)
