"""Build the C++ plan allocator: the CPU torch extension, the plain C library and the CUDA plugin.

Builds are cached in memplan.cxx.cache_dir() (~/.cache/memplan) keyed by the sources' hash, so only
the first call compiles. `python -m memplan.planner.replay.build` builds everything, the step
recorder, the solver kernels and (on a CPU-only torch) the fake CUDA device too (scripts/setup.sh runs it).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from memplan.cxx import BuildError, cache_dir, compiler, cxx_shared_library, digest, link_shared, torch_extension
from memplan.solvers.native import library_path
from memplan.traces.cuda import fake_device
from memplan.traces.recorder import extension as recorder_extension

CSRC = Path(__file__).resolve().parent / "csrc"
CORE_SOURCES = ("plan_core.cpp", "c_api.cpp")
HEADERS = ("plan_core.h", "c_api.h")


def _paths(names: tuple[str, ...]) -> list[Path]:
    return [CSRC / n for n in names]


def core_library() -> Path:
    """The core with CPU memory behind its C interface (for ctypes): libmemplan_core-<hash>.so."""
    return cxx_shared_library(
        "libmemplan_core", _paths(CORE_SOURCES + ("cpu_memory.cpp",)), "the plan allocator core", _paths(HEADERS)
    )


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
    out = cache_dir() / f"libmemplan_cuda-{digest(_paths(names + HEADERS))}.so"
    if out.exists():
        return out
    home = cuda_home()
    if home is None:
        raise BuildError("the CUDA replay library needs the CUDA toolkit: install it (nvcc) or set CUDA_HOME")
    srcs = [str(CSRC / n) for n in names]
    nvcc = shutil.which("nvcc") or (str(home / "bin" / "nvcc") if (home / "bin" / "nvcc").exists() else None)
    if nvcc:
        flags = [nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "--cudart", "static", *srcs]
    else:
        flags = [compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", f"-I{home / 'include'}", *srcs,
                 f"-L{home / 'lib64'}", "-lcudart"]  # fmt: skip

    def command(tmp: str) -> list[str]:
        return [*flags, "-o", tmp]

    return link_shared(out, command, "the CUDA replay library")


def cpu_extension():
    """The CPU allocator as a torch C++ extension module (compiled once, then loaded from the cache)."""
    names = CORE_SOURCES + ("cpu_memory.cpp", "cpu_allocator.cpp")
    return torch_extension("memplan_cpu_alloc", _paths(names), "the CPU plan allocator", _paths(HEADERS))


def build_all() -> dict[str, str]:
    """Build every part; returns what was built (path) or why CUDA was skipped."""

    built = {
        "recorder": recorder_extension().__file__,
        "cpu_extension": cpu_extension().__file__,
        "core_library": str(core_library()),
        "solver_kernels": str(library_path()),
    }
    if fake_device.needs_runtime():  # a CPU-only torch: the CUDA device of fake CUDA steps
        built["fake_cuda"] = fake_device.extension().__file__
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
