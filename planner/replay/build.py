"""Build the C++ plan allocator: the CPU torch extension, the plain C library and the CUDA plugin.

Builds are cached in planner.cxx.cache_dir() (~/.cache/memplan) keyed by the sources' hash, so only
the first call compiles. `python -m planner.replay.build` builds everything, the solver kernels too
(scripts/setup.sh runs it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from planner.cxx import BuildError, cache_dir, compiler, cxx_shared_library, digest, link_shared

CSRC = Path(__file__).resolve().parent / "csrc"
CORE_SOURCES = ("plan_core.cpp", "c_api.cpp")
HEADERS = ("plan_core.h", "c_api.h")


def _paths(names: tuple[str, ...]) -> list[Path]:
    return [CSRC / n for n in names]


def core_library() -> Path:
    """The core with CPU memory behind its C interface (for ctypes): libmemplan_core-<hash>.so."""
    return cxx_shared_library("libmemplan_core", _paths(CORE_SOURCES + ("cpu_memory.cpp",)),
                              "the plan allocator core", _paths(HEADERS))


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
        cmd = lambda tmp: [nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",  # noqa: E731
                           "--cudart", "static", *srcs, "-o", tmp]
    else:
        cxx = compiler()
        cmd = lambda tmp: [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread",  # noqa: E731
                           f"-I{home / 'include'}", *srcs, f"-L{home / 'lib64'}", "-lcudart", "-o", tmp]
    return link_shared(out, cmd, "the CUDA replay library")


def cpu_extension():
    """The CPU allocator as a torch C++ extension module (compiled once, then loaded from the cache)."""
    compiler()
    import torch
    from torch.utils import cpp_extension

    names = CORE_SOURCES + ("cpu_memory.cpp", "cpu_allocator.cpp")
    build_dir = cache_dir() / f"cpu-torch{torch.__version__}-{digest(_paths(names + HEADERS))}"
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
    from solvers.native import library_path

    built = {"cpu_extension": cpu_extension().__file__, "core_library": str(core_library()),
             "solver_kernels": str(library_path())}
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
