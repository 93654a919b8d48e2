"""MiniMalloc's CSV instances (`id,lower,upper,size` and optional `offset`): read into a Problem, write back.

Buffer `id` is live on [lower, upper) on one stream. An `offset` column holds a placement (a solution);
it is read back as offsets, not as constraints.
"""

from __future__ import annotations

import csv
import io
import os

import numpy as np

from memplan.errors import MemplanError
from memplan.files import atomic_write, read_input
from memplan.limits import short_repr
from memplan.planner.problem import MAX_BYTES, Problem, ProblemError, build_problem
from memplan.traces.format import columns_digest

REQUIRED = ("id", "lower", "upper", "size")


class CsvError(MemplanError):
    """A MiniMalloc CSV file is missing, malformed or inconsistent."""


def read_csv(path: str | os.PathLike, alignment: int = 1) -> tuple[Problem, list[int] | None]:
    """Parse a MiniMalloc CSV into (problem, offsets or None); errors name the file and line."""
    name = os.fspath(path)
    try:
        text = read_input(path, CsvError).decode("utf-8-sig")  # a byte-order mark is not part of the header
    except UnicodeDecodeError as e:
        raise CsvError(f"{name}: cannot read ({type(e).__name__})") from None
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as e:  # a field past the csv module's limit, a NUL byte, ...
        raise CsvError(f"{name}: not a readable CSV ({e})") from None
    if not rows:
        raise CsvError(f"{name}: empty file (expected a header id,lower,upper,size)")
    header = [h.strip() for h in rows[0]]
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise CsvError(f"{name}: header lacks column {missing[0]!r} (expected id,lower,upper,size[,offset])")
    has_offset = "offset" in header
    col = {c: header.index(c) for c in header}
    ids, cols = [], {c: [] for c in ("lower", "upper", "size", "offset")}
    for line, row in enumerate(rows[1:], start=2):
        if not row or all(not x.strip() for x in row):
            continue
        if len(row) != len(header):
            raise CsvError(f"{name}:{line}: has {len(row)} fields, the header has {len(header)}")
        ids.append(row[col["id"]].strip())
        for c in ("lower", "upper", "size") + (("offset",) if has_offset else ()):
            try:
                v = int(row[col[c]])
            except ValueError:
                raise CsvError(f"{name}:{line}: {c} {short_repr(row[col[c]])} is not an integer") from None
            if not 0 <= v < MAX_BYTES:
                raise CsvError(f"{name}:{line}: {c} {v} is {'negative' if v < 0 else 'beyond 2**62'}")
            cols[c].append(v)
        if cols["upper"][-1] < cols["lower"][-1]:
            raise CsvError(f"{name}:{line}: upper {cols['upper'][-1]} is below lower {cols['lower'][-1]}")
    if len(set(ids)) != len(ids):
        raise CsvError(f"{name}: buffer ids are not unique")
    size, lower, upper = (np.asarray(cols[c], dtype=np.int64) for c in ("size", "lower", "upper"))
    digest = columns_digest(size, lower, upper, np.zeros(len(size), dtype=np.int64))
    try:
        problem = build_problem(size, lower, upper, alignment=alignment, digest=digest, ids=ids)
    except ProblemError as e:
        raise CsvError(f"{name}: {e}") from None
    return problem, (cols["offset"] if has_offset else None)


def write_csv(path: str | os.PathLike, problem: Problem, offsets=None) -> None:
    """Write the problem (requested sizes) as MiniMalloc CSV, with an offset column when offsets are given."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(REQUIRED + (("offset",) if offsets is not None else ()))
    for i in range(len(problem)):
        row = [problem.ids[i], int(problem.alloc[i]), int(problem.free[i]), int(problem.requested[i])]
        w.writerow(row + ([int(offsets[i])] if offsets is not None else []))
    atomic_write(path, out.getvalue())
