"""Builds (once, with the system C++ compiler) and loads the native placement kernels in csrc/place.cpp.

The shared library is cached under $MEMPLAN_CACHE (default ~/.cache/memplan), keyed by the source's hash,
so the first solve compiles it (about a second) and later ones load it directly.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from traces.errors import MemplanError

SOURCE = Path(__file__).with_name("csrc") / "place.cpp"


class NativeBuildError(MemplanError):
    """The native placement kernels could not be compiled (no C++ compiler?)."""


def _cache_dir() -> Path:
    return Path(os.environ.get("MEMPLAN_CACHE", Path.home() / ".cache" / "memplan"))


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded kernels, compiling them first if this source version has no cached build."""
    src = SOURCE.read_bytes()
    target = _cache_dir() / f"place-{hashlib.sha256(src).hexdigest()[:16]}.so"
    if not target.exists():
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
        if not cxx:
            raise NativeBuildError("no C++ compiler found (set CXX) to build the placement kernels")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        proc = subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", "-o", tmp, str(SOURCE)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            first = (proc.stderr.strip().splitlines() or ["unknown error"])[0]
            raise NativeBuildError(f"building the placement kernels failed: {first}")
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    i64p = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")
    i32p = np.ctypeslib.ndpointer(dtype=np.int32, flags="C_CONTIGUOUS")
    c_int, c_i64 = ctypes.c_int, ctypes.c_longlong
    lib.mp_greedy.restype = c_i64
    lib.mp_greedy.argtypes = [c_int, c_int, i64p, i64p, i64p, i64p, c_int, i32p, i32p, i64p, i32p, c_int, i64p]
    lib.mp_search.restype = c_int
    lib.mp_search.argtypes = [c_int, c_int, i64p, i64p, i64p, i32p, i32p, c_i64, c_int,
                              ctypes.POINTER(ctypes.c_char_p), ctypes.c_double, i64p, ctypes.POINTER(c_i64)]
    return lib
