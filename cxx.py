"""Compiling memplan's C++ parts with the system compiler into a cache, so only the first use compiles.

The step recorder (traces/csrc), the solver kernels (solvers/csrc) and the plan allocator
(planner/replay/csrc) are built here; each library is named after a hash of its sources and written
under a temporary name, then renamed, so a cached library is complete or absent.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from memplan.errors import MemplanError


class BuildError(MemplanError):
    """A C++ part cannot be compiled (missing compiler or toolkit, or a compile error)."""


def cache_dir() -> Path:
    """Where compiled parts are kept: $MEMPLAN_CACHE, else $XDG_CACHE_HOME/memplan, else ~/.cache/memplan."""
    if os.environ.get("MEMPLAN_CACHE"):
        return Path(os.environ["MEMPLAN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memplan"


def digest(paths: Iterable[Path]) -> str:
    """A short hash of the files' names and contents: a cached build is reused only for the same sources."""
    h = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def compiler() -> str:
    """The C++ compiler: $CXX, else c++, g++ or clang++ on the PATH; BuildError says what to install."""
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError("no C++ compiler found: install g++ (e.g. `apt-get install g++`) or set CXX")


def _run_compiler(cmd: list[str], what: str) -> None:
    """Run one compile command; a failure becomes a BuildError naming `what` and the first error line."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        first = next(
            (ln for ln in done.stderr.splitlines() if "error" in ln.lower()),
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output",
        )
        raise BuildError(f"compiling {what} failed: {first.strip()}")


def link_shared(out: Path, cmd_for: Callable[[str], list[str]], what: str) -> Path:
    """Build `out` with the command `cmd_for(temporary_path)` unless it is cached; returns `out`."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        _run_compiler(cmd_for(tmp), what)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def cxx_shared_library(name: str, sources: list[Path], what: str, headers: Iterable[Path] = ()) -> Path:
    """`sources` compiled with the C++ compiler (C++17, -O2, pthreads) into cache_dir()/name-<hash>.so."""
    out = cache_dir() / f"{name}-{digest([*sources, *headers])}.so"
    if out.exists():
        return out
    cxx = compiler()
    return link_shared(
        out, lambda tmp: [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", *map(str, sources), "-o", tmp], what
    )


def torch_extension(name: str, sources: list[Path], what: str, headers: Iterable[Path] = ()):
    """`sources` compiled as the torch C++ extension module `name` (once per torch version and sources)."""
    compiler()
    import torch
    from torch.utils import cpp_extension

    # ninja's build file records absolute paths (the sources, this Python's headers): a folder per checkout and
    # environment, or two of them sharing the cache rebuild each other's module on every first use.
    includes = sorted({str(p.parent.resolve()) for p in sources})
    where = hashlib.sha256("\n".join([sys.prefix, *includes]).encode()).hexdigest()[:8]
    build_dir = cache_dir() / f"{name}-torch{torch.__version__}-{digest([*sources, *headers])}-{where}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not shutil.which("ninja"):
        raise BuildError(f"building {what} needs ninja: `pip install ninja`")
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources],
            extra_include_paths=includes,
            extra_cflags=["-O2"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        lines = [ln for ln in str(e).splitlines() if "error:" in ln.lower()]
        raise BuildError(f"compiling {what} failed: {(lines or [str(e)])[0].strip()}") from None
