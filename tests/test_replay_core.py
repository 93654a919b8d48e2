"""The plan allocator's C++ core driven through its C interface, and the CUDA plugin's exports."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading

import pytest

from planner.replay import build
from planner.replay.native import create_plan, load_library, plan_stats


@pytest.fixture(scope="module")
def lib():
    return load_library(build.core_library())


def in_arena(ptr: int, base: int, arena: int) -> bool:
    return base <= ptr < base + arena


def test_planned_slots_then_refuses_a_range_still_in_use(lib):
    # Two allocations planned at the same offset: legal only if the first is freed in between.
    h = create_plan(lib, offsets=[0, 0], sizes=[256, 256], arena_bytes=256)
    assert lib.memplan_step_begin(h)
    a = lib.memplan_alloc(256)
    lib.memplan_dealloc(a)
    b = lib.memplan_alloc(256)
    assert b == a  # the slot was free again: same bytes reused
    assert lib.memplan_step_end(h)
    lib.memplan_dealloc(b)

    assert lib.memplan_step_begin(h)
    c = lib.memplan_alloc(256)  # held while the next allocation asks for the same slot
    d = lib.memplan_alloc(256)
    assert c == a and d != c and not in_arena(d, a, 256)
    ctypes.memset(d, 0xAB, 256)
    ctypes.memset(c, 0x11, 256)
    assert ctypes.string_at(d, 256) == b"\xab" * 256  # the fallback block is really separate
    assert lib.memplan_step_end(h)
    s = plan_stats(lib, h)
    assert (s["planned_count"], s["fallback_count"], s["refused_in_use"]) == (3, 1, 1)
    assert s["fallback_bytes"] == 256 and s["live_blocks"] == 2
    assert s["peak_bytes"] == 256 + 256 and s["arena_top_peak"] == 256
    for p in (c, d):
        lib.memplan_dealloc(p)
    assert plan_stats(lib, h)["live_blocks"] == 0
    assert lib.memplan_plan_release(h)
    assert lib.memplan_plans_alive() == 0


def test_block_outliving_a_step_blocks_its_slot_in_the_next(lib):
    h = create_plan(lib, offsets=[64], sizes=[128], arena_bytes=192)
    assert lib.memplan_step_begin(h)
    kept = lib.memplan_alloc(128)
    assert lib.memplan_step_end(h)
    assert lib.memplan_step_begin(h)
    again = lib.memplan_alloc(128)
    assert lib.memplan_step_end(h)
    assert again != kept
    assert plan_stats(lib, h)["refused_in_use"] == 1
    lib.memplan_dealloc(kept)
    lib.memplan_dealloc(again)
    assert lib.memplan_plan_release(h)


def test_divergences_are_counted(lib):
    h = create_plan(lib, offsets=[0, 128, 256], sizes=[128, 128, 128], arena_bytes=384)
    assert lib.memplan_step_begin(h)
    a = lib.memplan_alloc(100)   # size differs from the plan's 128
    b = lib.memplan_alloc(128)   # planned
    assert lib.memplan_step_end(h)  # the third planned allocation never came
    assert lib.memplan_step_begin(h)
    blocks = [lib.memplan_alloc(128) for _ in range(4)]  # one more than planned
    assert lib.memplan_step_end(h)
    s = plan_stats(lib, h)
    assert (s["size_mismatch"], s["extra"], s["missing"], s["steps"]) == (1, 1, 1, 2)
    # slot 128 was still held by b: the second step's 2nd allocation is refused
    assert (s["planned_count"], s["refused_in_use"], s["fallback_count"]) == (3, 1, 3)
    assert s["fallback_bytes"] == 100 + 128 + 128
    for p in [a, b, *blocks]:
        lib.memplan_dealloc(p)
    assert lib.memplan_plan_release(h)


def test_reserved_slots_are_never_handed_out(lib):
    # Slot [0, 512) belongs to a buffer that predates the step (e.g. a parameter).
    h = create_plan(lib, offsets=[256, 512], sizes=[256, 256], reserved_offsets=[0], reserved_sizes=[512],
                    arena_bytes=768)
    assert lib.memplan_step_begin(h)
    a, b = lib.memplan_alloc(256), lib.memplan_alloc(256)
    assert lib.memplan_step_end(h)
    s = plan_stats(lib, h)
    assert s["refused_in_use"] == 1 and s["planned_count"] == 1
    assert s["arena_top_peak"] == 768 and s["peak_bytes"] == 768 + 256
    lib.memplan_dealloc(a)
    lib.memplan_dealloc(b)
    assert lib.memplan_plan_release(h)


def test_arena_outlives_the_release_while_blocks_are_live(lib):
    h = create_plan(lib, offsets=[0], sizes=[4096], arena_bytes=4096)
    assert lib.memplan_step_begin(h)
    p = lib.memplan_alloc(4096)
    assert lib.memplan_step_end(h)
    assert lib.memplan_plan_release(h)
    assert lib.memplan_plans_alive() == 1  # the block still needs the arena
    ctypes.memset(p, 0x5A, 4096)
    assert ctypes.string_at(p, 4096) == b"\x5a" * 4096
    assert lib.memplan_step_begin(h) == 0  # a released plan takes no new step
    lib.memplan_dealloc(p)
    assert lib.memplan_plans_alive() == 0


def test_allocations_outside_a_step_go_to_the_system(lib):
    h = create_plan(lib, offsets=[0], sizes=[64], arena_bytes=64)
    p = lib.memplan_alloc(64)
    assert p and plan_stats(lib, h)["planned_count"] == 0 and plan_stats(lib, h)["fallback_count"] == 0
    lib.memplan_dealloc(p)
    assert lib.memplan_plan_release(h)


def test_concurrent_threads_never_share_live_bytes(lib):
    # ctypes drops the GIL during each call, so the threads really race inside the core.
    n_threads, rounds, size = 4, 400, 512
    n = n_threads * rounds
    h = create_plan(lib, offsets=[(k % 8) * size for k in range(n)], sizes=[size] * n, arena_bytes=8 * size)
    assert lib.memplan_step_begin(h)
    errors = []

    def worker(tag: int) -> None:
        pattern = bytes([tag]) * size
        for _ in range(rounds):
            p = lib.memplan_alloc(size)
            ctypes.memset(p, tag, size)
            for _ in range(3):
                if ctypes.string_at(p, size) != pattern:
                    errors.append(tag)
            lib.memplan_dealloc(p)

    threads = [threading.Thread(target=worker, args=(t + 1,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lib.memplan_step_end(h)
    s = plan_stats(lib, h)
    assert errors == []
    assert s["planned_count"] + s["fallback_count"] == n
    assert s["planned_count"] > 0 and s["live_blocks"] == 0
    assert lib.memplan_plan_release(h)
    assert lib.memplan_plans_alive() == 0


@pytest.mark.skipif(build.cuda_home() is None, reason="needs the CUDA toolkit (nvcc) to build the CUDA plugin")
def test_cuda_plugin_compiles_and_exports_the_pluggable_allocator_symbols():
    path = build.cuda_library()
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to list the library's symbols"
    out = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
    assert {"memplan_malloc", "memplan_free", "memplan_plan_create", "memplan_step_begin",
            "memplan_step_end", "memplan_plan_stats", "memplan_plan_release"} <= exported


def test_build_without_a_compiler_says_what_to_install(tmp_path):
    import os
    import sys

    venv_bin = os.path.dirname(sys.executable)
    env = {"PATH": venv_bin, "MEMPLAN_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "planner.replay.build"], capture_output=True, text=True, env=env,
                          cwd=build.CSRC.parents[2])
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["memplan: no C++ compiler found: install g++ "
                                                "(e.g. `apt-get install g++`) or set CXX"]
