"""Builds (once, with the system C++ compiler) and loads the native placement kernels in csrc/place.cpp.

The shared library is cached in traces.cxx.cache_dir() (default ~/.cache/memplan), keyed by the source's hash,
so the first solve compiles it (about a second) and later ones load it directly.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np

from memplan.traces.cxx import cxx_shared_library

SOURCE = Path(__file__).with_name("csrc") / "place.cpp"


def library_path() -> Path:
    """The compiled kernels (built on the first call for this source version)."""
    return cxx_shared_library("place", [SOURCE], "the placement kernels")


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded kernels, compiling them first if this source version has no cached build."""
    lib = ctypes.CDLL(str(library_path()))
    i64p = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")
    i32p = np.ctypeslib.ndpointer(dtype=np.int32, flags="C_CONTIGUOUS")
    c_int, c_i64 = ctypes.c_int, ctypes.c_longlong
    lib.mp_greedy.restype = c_i64
    lib.mp_greedy.argtypes = [c_int, c_int, i64p, i64p, i64p, i64p, c_int, i32p, i32p, i64p, i32p, c_int, i64p]
    lib.mp_search.restype = c_int
    lib.mp_search.argtypes = [
        c_int,
        c_int,
        i64p,
        i64p,
        i64p,
        i32p,
        i32p,
        c_i64,
        c_int,
        ctypes.POINTER(ctypes.c_char_p),
        ctypes.c_double,
        i64p,
        ctypes.POINTER(c_i64),
    ]
    return lib
