"""Compiling memplan's C++ parts with the system compiler into a cache, so only the first use compiles.

The step recorder (traces/csrc), the solver kernels (solvers/csrc) and the plan allocator
(planner/replay/csrc) are built here; each library is named after a hash of its sources and written
under a temporary name, then renamed, so a cached library is complete or absent. A torch extension's
build folder is held with a lock the system drops when its holder dies (flock), so a killed build never
leaves the next one waiting: the lock file torch's own builder leaves behind is then removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from memplan.errors import MemplanError
from memplan.limits import BUILD_LOCK_WAIT_S


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


def extension_build_dir(name: str, sources: list[Path], headers: Iterable[Path] = ()) -> Path:
    """The cache folder torch_extension builds `name` in: one per torch version, sources (by content) and Python
    headers. The sources are built from a copy inside it (ninja's build file records absolute paths), so every
    checkout, clone and installed wheel of the same sources shares one build."""
    import torch

    python = hashlib.sha256(sysconfig.get_paths()["include"].encode()).hexdigest()[:8]
    return cache_dir() / f"{name}-torch{torch.__version__}-{digest([*sources, *headers])}-{python}"


def _copied(folder: Path, files: Iterable[Path]) -> list[Path]:
    """`files` copied into `folder` (their includes are of each other, by name), unless a copy is there already."""
    folder.mkdir(parents=True, exist_ok=True)
    copies = []
    for path in files:
        copy = folder / path.name
        if not copy.exists() or copy.read_bytes() != path.read_bytes():
            shutil.copyfile(path, copy)
        copies.append(copy)
    return copies


def torch_extension(name: str, sources: list[Path], what: str, headers: Iterable[Path] = ()):
    """`sources` compiled as the torch C++ extension module `name` (once per torch version and sources)."""
    compiler()
    from torch.utils import cpp_extension

    headers = list(headers)
    build_dir = extension_build_dir(name, sources, headers)
    build_dir.mkdir(parents=True, exist_ok=True)
    if not shutil.which("ninja"):
        raise BuildError(f"building {what} needs ninja: `pip install ninja`")
    with build_lock(build_dir, what):
        copies = _copied(build_dir / "src", [*sources, *headers])[: len(sources)]
        try:
            return cpp_extension.load(
                name=name,
                sources=[str(p) for p in copies],
                extra_include_paths=[str(build_dir / "src")],
                extra_cflags=["-O2"],
                build_directory=str(build_dir),
                verbose=False,
            )
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            lines = [ln for ln in str(e).splitlines() if "error:" in ln.lower()]
            raise BuildError(f"compiling {what} failed: {(lines or [str(e)])[0].strip()}") from None


LOCK_NAME = "memplan.lock"  # memplan's own lock in a build folder, holding its holder's process id
TORCH_BATON = "lock"  # the file torch.utils.cpp_extension's builder creates there and waits on while it exists
QUIET_WAIT_S = 2.0  # a wait shorter than this (another process loading the built module) says nothing


@contextlib.contextmanager
def build_lock(build_dir: Path, what: str, wait_s: float = BUILD_LOCK_WAIT_S) -> Iterator[None]:
    """Hold `build_dir` for this process while `what` is built or loaded there: another memplan process building it
    is waited for, with a line on stderr, for at most `wait_s` seconds (then BuildError); once held, a torch lock
    file left by a killed build is removed (its builder is gone: it would have held this lock)."""
    with open(build_dir / LOCK_NAME, "a+") as lock:
        _acquire(lock, build_dir, what, wait_s)
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(f"{os.getpid()}\n")
            lock.flush()
            baton = build_dir / TORCH_BATON
            if baton.exists():
                print(f"memplan: removing {baton}, left by a build of {what} that was killed", file=sys.stderr)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _acquire(lock, build_dir: Path, what: str, wait_s: float) -> None:
    """Take the exclusive lock on the open file `lock`, waiting at most `wait_s` seconds (told on stderr)."""
    start, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        lock.seek(0)
        holder = lock.read().strip() or "?"
        if waited >= wait_s:
            raise BuildError(
                f"gave up after {waited:.0f} s waiting for process {holder} to finish building {what} in {build_dir}"
            )
        if waited >= QUIET_WAIT_S and not told:
            print(f"memplan: waiting for process {holder} to finish building {what} in {build_dir} (at most "
                  f"{wait_s:.0f} s)", file=sys.stderr)  # fmt: skip
            told = True
        time.sleep(0.2)
