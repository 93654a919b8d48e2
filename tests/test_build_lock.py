"""The C++ build lock: a killed first-use build never leaves the next one waiting, and a wait is told and bounded."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from memplan.cxx import LOCK_NAME, TORCH_BATON, BuildError, build_lock

PROBE = """
#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", []() { return 42; }); }
"""


@pytest.mark.slow  # compiles a small torch extension (about 20 s on the project's machine)
def test_a_build_after_a_killed_one_removes_its_lock_and_proceeds(tmp_path):
    """torch's builder leaves its lock file when killed mid-build and every later build waited on it forever; the
    next build finds it stale (its builder does not hold memplan's lock), says so, removes it and builds."""
    (tmp_path / "probe.cpp").write_text(PROBE)
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from memplan.cxx import extension_build_dir, torch_extension
        sources = [Path({str(tmp_path / "probe.cpp")!r})]
        folder = extension_build_dir("memplan_lock_probe", sources)
        folder.mkdir(parents=True)
        (folder / {TORCH_BATON!r}).write_text("")  # what a build killed inside torch's load() leaves
        print(torch_extension("memplan_lock_probe", sources, "the probe").answer(), flush=True)
        assert not (folder / {TORCH_BATON!r}).exists()
        """
    )
    env = {**os.environ, "MEMPLAN_CACHE": str(tmp_path / "cache")}
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("the build waited on the stale lock")
    assert done.returncode == 0 and done.stdout.strip() == "42", done.stderr
    assert "removing" in done.stderr and "left by a build of the probe that was killed" in done.stderr


def test_a_build_waits_for_a_live_builder_saying_so_and_gives_up_in_time(tmp_path, capsys):
    """Another process building (here: this test holding the lock) is waited for with a line on stderr; past the
    bound the wait ends in a one-line BuildError naming the holder, and once the holder lets go the build goes on."""
    with open(tmp_path / LOCK_NAME, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        with pytest.raises(
            BuildError, match=r"gave up after 3 s waiting for process 4242 to finish building the probe"
        ):
            with build_lock(tmp_path, "the probe", wait_s=3):
                pass
        assert "memplan: waiting for process 4242 to finish building the probe" in capsys.readouterr().err
        threading.Timer(0.5, fcntl.flock, (held, fcntl.LOCK_UN)).start()
        with build_lock(tmp_path, "the probe", wait_s=60):
            assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    with build_lock(tmp_path, "the probe", wait_s=0):  # free again: taken at once
        pass
