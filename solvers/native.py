"""Builds (once, with the system C++ compiler) and loads the native placement kernels in csrc/place.cpp.

The shared library is cached in memplan.cxx.cache_dir() (default ~/.cache/memplan), keyed by the hash of
place.cpp and place.h, so the first solve compiles it (about a second) and later ones load it directly.
The structures below mirror csrc/place.h field by field; callers keep the arrays they point to alive.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np

from memplan.cxx import cxx_shared_library

SOURCE = Path(__file__).with_name("csrc") / "place.cpp"
HEADER = SOURCE.with_name("place.h")

# place.h's vocabulary: what each integer counts.
Bytes = ctypes.c_int64  # a size or an offset in the arena, in bytes
Time = ctypes.c_int64  # a point on the problem's clock (allocations, frees, releases)
StreamId = ctypes.c_int64  # a dense stream index, 0 .. streams - 1
BufferIndex = ctypes.c_int32  # a buffer's position in the problem's columns
ItemIndex = ctypes.c_int32  # an item's position: a single buffer, or a contiguous group placed as one block
MemberIndex = ctypes.c_int32  # a position in GreedyProblem.members (an item's members are consecutive)
SectionIndex = ctypes.c_int32  # a section: the span between two consecutive distinct times of the problem
Work = ctypes.c_int64  # elementary steps of a kernel: the deterministic measure of effort (busy or idle machine)

GREEDY_INTERRUPTED = -1  # mp_greedy's answer when work_limit or the ceiling stopped it before the last item
# SearchOutcome: what mp_search decided.
SEARCH_TIMEOUT, SEARCH_INFEASIBLE, SEARCH_FITS = -2, 0, 1


class GreedyProblem(ctypes.Structure):
    """mp_greedy's and mp_sweep's input: the buffers of a problem on any number of streams, and the items to place."""

    _fields_ = [
        ("buffers", ctypes.c_int32),  # how many buffers
        ("streams", ctypes.c_int32),  # how many streams
        ("alloc", ctypes.POINTER(Time)),  # alloc[i]: when buffer i is allocated
        ("stream", ctypes.POINTER(StreamId)),  # stream[i]: the stream that allocates and frees buffer i
        ("release", ctypes.POINTER(Time)),  # release[i * streams + s]: first time on stream s ordered after i's free
        ("size", ctypes.POINTER(Bytes)),  # size[i]: buffer i's bytes (0: it takes no room, conflicts with nothing)
        ("items", ctypes.c_int32),  # how many items to place
        ("item_start", ctypes.POINTER(MemberIndex)),  # item k's members: members[item_start[k] : item_start[k + 1]]
        ("members", ctypes.POINTER(BufferIndex)),  # every item's buffers, item after item
        ("member_offset", ctypes.POINTER(Bytes)),  # member_offset[j]: where members[j] starts inside its item
        ("order", ctypes.POINTER(ItemIndex)),  # order[q]: the q-th item to place
        ("best_fit", ctypes.c_int32),  # 1: the tightest gap that fits (best fit); 0: the lowest one (first fit)
        ("work_limit", Work),  # mp_greedy stops before an item once it has spent more steps than this
        ("seconds", ctypes.c_double),  # a wall-clock ceiling for the call: mp_greedy stops when it passes too
    ]


class SearchProblem(ctypes.Structure):
    """mp_search's input: active buffers on one stream, their section ranges, the capacity, orders and time limit."""

    _fields_ = [
        ("buffers", ctypes.c_int32),  # how many buffers
        ("sections", ctypes.c_int32),  # how many sections (distinct times minus one)
        ("size", ctypes.POINTER(Bytes)),  # size[i]: buffer i's bytes
        ("lower", ctypes.POINTER(Time)),  # lower[i]: when buffer i is allocated
        ("upper", ctypes.POINTER(Time)),  # upper[i]: when buffer i is freed
        ("first_section", ctypes.POINTER(SectionIndex)),  # first_section[i]: the first section buffer i is live in
        ("end_section", ctypes.POINTER(SectionIndex)),  # end_section[i]: one past the last section it is live in
        ("capacity", Bytes),  # every buffer must end at or below this many bytes
        ("prefix_length", ctypes.c_int32),  # how many buffers the prefix places before the search starts (0: none)
        ("prefix", ctypes.POINTER(BufferIndex)),  # prefix[k]: the k-th placed, at the lowest offset left to it
        ("heuristics", ctypes.c_int32),  # how many static buffer orders to search with, one thread each
        ("heuristic", ctypes.POINTER(ctypes.c_char_p)),  # heuristic[h]: its sort keys, e.g. b"TWA" (see search.py)
        ("work_limit", Work),  # each thread stops after this many steps (the deterministic budget)
        ("seconds", ctypes.c_double),  # a wall-clock ceiling for the whole search, all threads together
    ]


def as_pointer(array: np.ndarray, ctype: type) -> ctypes._Pointer:
    """A struct field's pointer to `array`'s data; refuses anything but a C-contiguous array of `ctype`."""
    if array.dtype != np.dtype(ctype) or not array.flags.c_contiguous:
        raise TypeError(f"expected a C-contiguous {np.dtype(ctype)} array, got {array.dtype}")
    return array.ctypes.data_as(ctypes.POINTER(ctype))


def library_path() -> Path:
    """The compiled kernels (built on the first call for this version of place.cpp and place.h)."""
    return cxx_shared_library("place", [SOURCE], "the placement kernels", headers=[HEADER])


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded kernels, compiling them first if this source version has no cached build."""
    lib = ctypes.CDLL(str(library_path()))
    offsets = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")
    lib.mp_greedy.restype = Bytes
    lib.mp_greedy.argtypes = [ctypes.POINTER(GreedyProblem), offsets, ctypes.POINTER(Work)]
    lib.mp_sweep.restype = Bytes
    lib.mp_sweep.argtypes = [ctypes.POINTER(GreedyProblem), offsets, ctypes.POINTER(Work)]
    lib.mp_search.restype = ctypes.c_int32
    lib.mp_search.argtypes = [ctypes.POINTER(SearchProblem), offsets, ctypes.POINTER(Work)]
    return lib
