"""The plan allocator's C++ core driven through its C interface, and the CUDA plugin's exports."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading

import pytest

from memplan.planner.replay import build
from memplan.planner.replay.native import INVALID_PLAN, create_plan, load_library, plan_stats


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
    assert s["held_peak"] == 256 + 256 and s["arena_top_peak"] == 256
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
    a = lib.memplan_alloc(100)  # size differs from the plan's 128
    b = lib.memplan_alloc(128)  # planned
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


def test_unadopted_reserved_slots_are_free(lib):
    # Slot [256, 768) belongs to a buffer that predates the step but was never adopted: it holds nothing.
    h = create_plan(
        lib, offsets=[0, 512], sizes=[256, 256], reserved_offsets=[256], reserved_sizes=[512], arena_bytes=768
    )
    assert lib.memplan_step_begin(h)
    a = lib.memplan_alloc(256)
    s = plan_stats(lib, h)
    assert s["arena_top_peak"] == s["held_peak"] == 256 < 768  # the arena top is where the step's blocks reach
    b = lib.memplan_alloc(256)  # planned inside the unadopted slot: served from the plan
    assert lib.memplan_step_end(h)
    s = plan_stats(lib, h)
    assert (s["planned_count"], s["fallback_count"], s["adopted_count"]) == (2, 0, 0)
    assert s["arena_top_peak"] == 768 and s["live_blocks"] == 2
    assert lib.memplan_adopt_begin(h)
    c = lib.memplan_alloc(512)  # the slot overlaps the live block b: refused
    assert lib.memplan_adopt_end(h)
    s = plan_stats(lib, h)
    assert (s["adopted_count"], s["refused_in_use"], s["fallback_count"]) == (0, 1, 1)
    for p in (a, b, c):
        lib.memplan_dealloc(p)
    assert lib.memplan_plan_release(h)


def test_adoption_takes_reserved_slots_by_exact_size(lib):
    # Reserved slots: 256 B at 0, 128 B at 256, 256 B at 384 (alignment 64); one planned block at 640.
    h = create_plan(
        lib,
        offsets=[640],
        sizes=[64],
        reserved_offsets=[0, 256, 384],
        reserved_sizes=[256, 128, 256],
        arena_bytes=704,
        alignment=64,
    )
    base = lib.memplan_plan_arena(h)
    assert base and plan_stats(lib, h)["arena_top_peak"] == 0  # reserved slots are not live at creation
    assert lib.memplan_adopt_begin(h)
    assert lib.memplan_step_begin(h) == 0  # one phase at a time
    assert lib.memplan_step_end(h) == 0  # the open phase is an adoption, not a step
    small = lib.memplan_alloc(128)
    first, second = lib.memplan_alloc(256), lib.memplan_alloc(256)
    third = lib.memplan_alloc(256)  # both 256 B slots are taken
    odd = lib.memplan_alloc(200)  # no slot of that size
    assert lib.memplan_adopt_end(h)
    assert (small, first, second) == (base + 256, base, base + 384)
    assert not in_arena(third, base, 704) and not in_arena(odd, base, 704)
    s = plan_stats(lib, h)
    assert (s["adopted_count"], s["adopted_bytes"]) == (3, 640)
    assert (s["no_slot"], s["fallback_count"], s["fallback_bytes"]) == (2, 2, 456)
    assert s["planned_count"] == s["steps"] == 0 and s["arena_top_peak"] == 640
    lib.memplan_dealloc(third)
    lib.memplan_dealloc(odd)
    ctypes.memset(first, 0x42, 256)
    assert lib.memplan_step_begin(h)
    planned = lib.memplan_alloc(64)  # the step's block sits next to the adopted ones
    assert lib.memplan_step_end(h)
    assert planned == base + 640 and ctypes.string_at(first, 256) == b"\x42" * 256
    s = plan_stats(lib, h)
    assert s["arena_top_peak"] == 704 and s["live_blocks"] == 4
    assert s["held_peak"] == 640 + 456  # the adoption's fallbacks were live next to the adopted slots
    lib.memplan_dealloc(first)
    assert lib.memplan_adopt_begin(h)
    again = lib.memplan_alloc(256)  # a slot is adopted at most once, even after its block was freed
    assert lib.memplan_adopt_end(h)
    assert not in_arena(again, base, 704) and plan_stats(lib, h)["no_slot"] == 3
    assert lib.memplan_plan_release(h)
    assert lib.memplan_plans_alive() == 1  # the adopted blocks still need the arena
    assert lib.memplan_plan_arena(h) == base
    for p in (small, second, planned, again):
        lib.memplan_dealloc(p)
    assert lib.memplan_plans_alive() == 0 and lib.memplan_plan_arena(h) is None


def test_adoption_skips_a_slot_overlapping_a_live_block(lib):
    # Two 128 B slots; a block kept from a step still covers the first one.
    h = create_plan(
        lib, offsets=[0], sizes=[128], reserved_offsets=[0, 128], reserved_sizes=[128, 128], arena_bytes=256
    )
    base = lib.memplan_plan_arena(h)
    assert lib.memplan_step_begin(h)
    kept = lib.memplan_alloc(128)
    assert lib.memplan_step_end(h)
    assert lib.memplan_adopt_begin(h)
    a, b = lib.memplan_alloc(128), lib.memplan_alloc(128)
    assert lib.memplan_adopt_end(h)
    assert kept == base and a == base + 128 and not in_arena(b, base, 256)
    s = plan_stats(lib, h)
    assert (s["adopted_count"], s["refused_in_use"], s["no_slot"]) == (1, 1, 0)
    lib.memplan_dealloc(kept)
    assert lib.memplan_adopt_begin(h)
    c = lib.memplan_alloc(128)  # the first slot is clear now
    assert lib.memplan_adopt_end(h)
    assert c == base and plan_stats(lib, h)["adopted_count"] == 2
    for p in (a, b, c):
        lib.memplan_dealloc(p)
    assert lib.memplan_plan_release(h)
    assert lib.memplan_plans_alive() == 0


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


@pytest.mark.parametrize(
    "offsets, sizes, reserved, arena, alignment",
    [
        ([2**63 - 100], [64], ([], []), 4096, 64),  # offset + size wraps past 2**63 (it crashed the process)
        ([0, 0], [128, 128], ([], []), 4096, 2**63 - 64),  # size + alignment - 1 wraps: every block got 0 bytes
        ([4032], [128], ([], []), 4096, 64),  # ends past the 4 KiB arena
        ([0], [64], ([2**63 - 64], [64]), 4096, 64),  # a reserved slot wrapping around
        ([0], [-64], ([], []), 4096, 64),  # a negative size
        ([-64], [64], ([], []), 4096, 64),  # a negative offset
        ([0], [64], ([], []), 4096, 0),  # no alignment
        ([0], [64], ([], []), -4096, 64),  # a negative arena
    ],
)
def test_a_plan_whose_slots_leave_the_arena_is_refused(lib, offsets, sizes, reserved, arena, alignment):
    """Checked arithmetic: creation returns INVALID_PLAN, no arena is taken and no allocation is served."""
    alive = lib.memplan_plans_alive()
    h = create_plan(lib, offsets, sizes, *reserved, arena_bytes=arena, alignment=alignment)
    assert h == INVALID_PLAN
    assert lib.memplan_plans_alive() == alive and lib.memplan_step_begin(h) == 0
    good = create_plan(lib, offsets=[0, 0], sizes=[128, 128], arena_bytes=4096, alignment=64)
    assert good > 0 and lib.memplan_plan_release(good)


def test_a_slot_ending_exactly_at_the_arena_top_is_served(lib):
    h = create_plan(lib, offsets=[4032], sizes=[1], arena_bytes=4096, alignment=64)  # 1 byte takes 64: ends at 4096
    assert h > 0 and lib.memplan_step_begin(h)
    p = lib.memplan_alloc(1)
    assert lib.memplan_step_end(h) and p == lib.memplan_plan_arena(h) + 4032
    lib.memplan_dealloc(p)
    assert lib.memplan_plan_release(h)


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
    assert {
        "memplan_malloc",
        "memplan_free",
        "memplan_plan_create",
        "memplan_step_begin",
        "memplan_step_end",
        "memplan_adopt_begin",
        "memplan_adopt_end",
        "memplan_plan_arena",
        "memplan_plan_stats",
        "memplan_plan_release",
    } <= exported


def test_build_without_a_compiler_says_what_to_install(tmp_path):
    import os
    import sys

    venv_bin = os.path.dirname(sys.executable)
    env = {"PATH": venv_bin, "MEMPLAN_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "memplan.planner.replay.build"],
        capture_output=True,
        text=True,
        env=env,
        cwd=build.CSRC.parents[2],
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "memplan: no C++ compiler found: install g++ (e.g. `apt-get install g++`) or set CXX"
    ]
