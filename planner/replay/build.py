"""Build the C++ plan allocator: the CPU torch extension, the plain C library and the CUDA plugin.

Builds are cached under ~/.cache/memplan (or $MEMPLAN_CACHE) keyed by the sources' hash, so only
the first call compiles. `python -m planner.replay.build` builds everything (scripts/setup.sh runs it).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from traces.errors import MemplanError

CSRC = Path(__file__).resolve().parent / "csrc"
CORE_SOURCES = ("plan_core.cpp", "c_api.cpp")
HEADERS = ("plan_core.h", "c_api.h")


class BuildError(MemplanError):
    """A part of the plan allocator cannot be compiled (missing compiler or toolkit)."""


def cache_dir() -> Path:
    """Where compiled parts are kept: $MEMPLAN_CACHE, else $XDG_CACHE_HOME/memplan, else ~/.cache/memplan."""
    if os.environ.get("MEMPLAN_CACHE"):
        return Path(os.environ["MEMPLAN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memplan"


def _digest(names: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:12]


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError("no C++ compiler found: install g++ (e.g. `apt-get install g++`) or set CXX")


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        first = next((ln for ln in done.stderr.splitlines() if "error" in ln.lower()),
                     done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
        raise BuildError(f"compiling {what} failed: {first.strip()}")


def _link_shared(out: Path, cmd_for: callable, what: str) -> Path:
    """Compile into a temporary name then rename, so a cached library is complete or absent."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        _run(cmd_for(tmp), what)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def core_library() -> Path:
    """The core with CPU memory behind its C interface (for ctypes): libmemplan_core-<hash>.so."""
    names = CORE_SOURCES + ("cpu_memory.cpp",)
    out = cache_dir() / f"libmemplan_core-{_digest(names + HEADERS)}.so"
    if out.exists():
        return out
    cxx = _compiler()
    srcs = [str(CSRC / n) for n in names]
    return _link_shared(out, lambda tmp: [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread",
                                          *srcs, "-o", tmp], "the plan allocator core")


def cuda_home() -> Path | None:
    """The CUDA toolkit: $CUDA_HOME / $CUDA_PATH, the folder above nvcc, or /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").is_file():
            return Path(c)
    return None


def cuda_library() -> Path:
    """The CUDA plugin exporting memplan_malloc/memplan_free: libmemplan_cuda-<hash>.so.

    Compiled with nvcc (cudart linked statically), else with the C++ compiler against the toolkit's
    headers and libcudart.
    """
    names = CORE_SOURCES + ("cuda_memory.cpp",)
    out = cache_dir() / f"libmemplan_cuda-{_digest(names + HEADERS)}.so"
    if out.exists():
        return out
    home = cuda_home()
    if home is None:
        raise BuildError("the CUDA replay library needs the CUDA toolkit: install it (nvcc) or set CUDA_HOME")
    srcs = [str(CSRC / n) for n in names]
    nvcc = shutil.which("nvcc") or (str(home / "bin" / "nvcc") if (home / "bin" / "nvcc").exists() else None)
    if nvcc:
        cmd = lambda tmp: [nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",  # noqa: E731
                           "--cudart", "static", *srcs, "-o", tmp]
    else:
        cxx = _compiler()
        cmd = lambda tmp: [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread",  # noqa: E731
                           f"-I{home / 'include'}", *srcs, f"-L{home / 'lib64'}", "-lcudart", "-o", tmp]
    return _link_shared(out, cmd, "the CUDA replay library")


def cpu_extension():
    """The CPU allocator as a torch C++ extension module (compiled once, then loaded from the cache)."""
    _compiler()
    import torch
    from torch.utils import cpp_extension

    names = CORE_SOURCES + ("cpu_memory.cpp", "cpu_allocator.cpp")
    build_dir = cache_dir() / f"cpu-torch{torch.__version__}-{_digest(names + HEADERS)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not shutil.which("ninja"):
        raise BuildError("building the CPU plan allocator needs ninja: `pip install ninja`")
    try:
        return cpp_extension.load(name="memplan_cpu_alloc", sources=[str(CSRC / n) for n in names],
                                  extra_include_paths=[str(CSRC)], extra_cflags=["-O2"],
                                  build_directory=str(build_dir), verbose=False)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        lines = [ln for ln in str(e).splitlines() if "error" in ln.lower()]
        raise BuildError(f"compiling the CPU plan allocator failed: {(lines or [str(e)])[0].strip()}") from None


def build_all() -> dict[str, str]:
    """Build every part; returns what was built (path) or why CUDA was skipped."""
    built = {"cpu_extension": cpu_extension().__file__, "core_library": str(core_library())}
    try:
        built["cuda_library"] = str(cuda_library())
    except BuildError as e:
        built["cuda_library"] = f"skipped: {e}"
    return built


def main() -> int:
    try:
        built = build_all()
    except BuildError as e:
        print(f"memplan: {e}", file=sys.stderr)
        return 1
    for part, where in built.items():
        print(f"{part}: {where}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
