"""The native kernels' interface: native.py's ctypes structures match csrc/place.h field for field (names,
order, offsets and size as the C++ compiler lays them out), and a change to the header rebuilds the library."""

from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest

from memplan.cxx import compiler, digest
from memplan.solvers import native

STRUCTS = (native.GreedyProblem, native.SearchProblem)


def header_fields(struct: str) -> list[str]:
    """The field names of `struct` in place.h, in declaration order."""
    body = re.search(rf"struct {struct} \{{(.*?)\n\}};", native.HEADER.read_text(), re.S).group(1)
    return re.findall(r"^\s+[\w:*\s]+?\b(\w+);", body, re.M)


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_structures_name_the_header_fields_in_order(struct):
    assert [name for name, _ in struct._fields_] == header_fields(struct.__name__)


def test_structures_have_the_compiled_layout(tmp_path):
    """offsetof and sizeof as the C++ compiler sees place.h, against ctypes' layout."""
    lines = [
        f'std::printf("{s.__name__} {name} %zu\\n", offsetof({s.__name__}, {name}));'
        for s in STRUCTS
        for name, _ in s._fields_
    ] + [f'std::printf("{s.__name__} sizeof %zu\\n", sizeof({s.__name__}));' for s in STRUCTS]
    program = tmp_path / "layout.cpp"
    program.write_text(
        f'#include <cstddef>\n#include <cstdio>\n#include "{native.HEADER}"\nint main() {{\n'
        + "\n".join(lines)
        + "\n}\n"
    )
    subprocess.run([compiler(), "-std=c++17", str(program), "-o", str(tmp_path / "layout")], check=True)
    compiled = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split()
    expected = [(s.__name__, name, str(getattr(s, name).offset)) for s in STRUCTS for name, _ in s._fields_] + [
        (s.__name__, "sizeof", str(ctypes.sizeof(s))) for s in STRUCTS
    ]
    assert list(zip(compiled[0::3], compiled[1::3], compiled[2::3])) == expected


def test_the_header_is_part_of_the_cached_library_name():
    assert native.library_path().name == f"place-{digest([native.SOURCE, native.HEADER])}.so"
    assert digest([native.SOURCE, native.HEADER]) != digest([native.SOURCE])


def test_struct_pointers_refuse_arrays_of_another_type_or_layout():
    with pytest.raises(TypeError):
        native.as_pointer(np.zeros(3, dtype=np.int32), native.Bytes)
    with pytest.raises(TypeError):
        native.as_pointer(np.zeros((3, 2), dtype=np.int64)[:, 0], native.Bytes)
    assert native.as_pointer(np.arange(3, dtype=np.int32), native.BufferIndex)[2] == 2
