"""The allocation problem from traces and MiniMalloc CSV: alignment, validation, digest, CSV round trip."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from memplan.planner.jobs.solve_file import load_problem
from memplan.planner.minimalloc_csv import CsvError, read_csv, write_csv
from memplan.planner.problem import ProblemError, build_problem, problem_from_trace
from memplan.traces import make_trace
from memplan.traces.format import trace_digest


def small_trace(**extra):
    cols = {"size": [100, 512, 0, 2000], "alloc": [1, 2, 3, 0], "free": [4, 5, 3, 6]}
    cols.update(extra)
    return make_trace(cols)


def test_sizes_rounded_to_alignment_and_requested_kept():
    p = problem_from_trace(small_trace(), alignment=512)
    assert p.size.tolist() == [512, 512, 0, 2048]
    assert p.requested.tolist() == [100, 512, 0, 2000]
    assert problem_from_trace(small_trace(), alignment=64).size.tolist() == [128, 512, 0, 2048]


def test_one_stream_conflicts_are_interval_overlaps():
    p = problem_from_trace(small_trace())
    assert p.conflict(0, 1) and p.conflict(0, 3)
    assert not p.conflict(0, 2)  # size 0 and empty lifetime: never occupies bytes
    q = build_problem([8, 8], [0, 4], [4, 9], alignment=1)
    assert not q.conflict(0, 1)  # [0,4) and [4,9) touch but do not overlap
    assert q.max_live() == 8


def test_digest_follows_the_columns():
    a, b = small_trace(), small_trace(free=[4, 5, 3, 7])
    assert trace_digest(a) == trace_digest(small_trace()) != trace_digest(b)
    assert problem_from_trace(a).digest == trace_digest(a)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"alignment": 0}, "alignment"),
        ({"groups": [[0, 5]]}, "does not exist"),
        ({"groups": [[0, 1], [1, 3]]}, "more than one group"),
        ({"fixed": {0: 100}}, "multiple of the alignment"),
        ({"fixed": {0: 0, 1: 4096}, "groups": [[0, 1]]}, "back to back"),
        ({"fixed": {0: 0, 3: 0}}, "buffers 0 and 3 overlap while both may be live"),
    ],
)
def test_bad_groups_and_fixed_offsets_are_one_line_errors(kwargs, message):
    with pytest.raises(ProblemError, match=message) as e:
        problem_from_trace(small_trace(), **kwargs)
    assert "\n" not in str(e.value)


def test_csv_round_trip_keeps_every_field(tmp_path):
    src = tmp_path / "in.csv"
    src.write_text("id,lower,upper,size,offset\nb1,0,3,4,0\nb2,3,9,4,0\nx-7,0,9,5,4\n")
    problem, offsets = read_csv(src)
    assert problem.ids == ["b1", "b2", "x-7"] and offsets == [0, 0, 4]
    out = tmp_path / "out.csv"
    write_csv(out, problem, offsets)
    again, offsets2 = read_csv(out)
    assert out.read_text() == src.read_text()
    assert again.ids == problem.ids and offsets2 == offsets
    for col in ("alloc", "free", "requested", "size"):
        assert np.array_equal(getattr(again, col), getattr(problem, col))
    assert again.digest == problem.digest


@pytest.mark.parametrize(
    "text, message",
    [
        ("id,lower,size\n", "header lacks column 'upper'"),
        ("id,lower,upper,size\na,0,3\n", ":2: has 3 fields"),
        ("id,lower,upper,size\na,0,x,4\n", ":2: upper 'x' is not an integer"),
        ("id,lower,upper,size\na,5,3,4\n", "upper 3 is below lower 5"),
        ("id,lower,upper,size\na,0,3,4\na,1,2,4\n", "not unique"),
        ("id,lower,upper,size\na,0,3,99999999999999999999\n", ":2: size 99999999999999999999 is beyond 2"),
        ("id,lower,upper,size\na,0,3,4611686018427387000\nb,0,3,4611686018427387000\n", "add up to about 9.22e"),
    ],
)
def test_bad_csv_is_a_one_line_error(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(CsvError, match=message):
        read_csv(path)


def test_csv_with_a_byte_order_mark_or_gzipped_reads_the_same(tmp_path):
    text = "id,lower,upper,size\na,0,3,4\nb,2,5,8\n"
    (tmp_path / "plain.csv").write_text(text)
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + text.encode())
    (tmp_path / "packed.csv.gz").write_bytes(gzip.compress(text.encode()))
    want = read_csv(tmp_path / "plain.csv")[0]
    for name in ("bom.csv", "packed.csv.gz"):
        got = read_csv(tmp_path / name)[0]
        assert got.ids == want.ids and got.digest == want.digest
    assert load_problem(str(tmp_path / "packed.csv.gz")).digest == want.digest


def test_shared_minimalloc_instances_load(shared):
    problem, offsets = read_csv(shared / "benchmarks/minimalloc/A.1048576.csv")
    assert len(problem) == 154 and offsets is None
    assert problem.max_live() <= 1048576
