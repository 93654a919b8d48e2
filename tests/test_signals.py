"""SIGTERM, as Ctrl-C's SIGINT, stops a command without leaving a half-written file: the real command line in a
subprocess, held (by an audit hook, not a sleep) at the moment its output's hidden temporary file is on disk, is
sent the signal there, and must exit with nothing beside the target and no target."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from memplan.traces import make_trace, save

SECONDS = 10

# The child: memplan's command line, with an audit hook that holds it (a blocking read of its stdin, which the test
# never writes) at one point of the output's atomic write, after saying so on stderr. The signal interrupts the read.
CHILD = """
import os, sys
POINT = sys.argv.pop(1)
created = []
def hold(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].endswith(".tmp"):
        created.append(args[0])  # os.open of the temporary file: it exists once the next open (of its fd) comes
    elif created and ((POINT == "created" and event == "open" and isinstance(args[0], int))
                      or (POINT == "written" and event == "os.rename" and str(args[0]).endswith(".tmp"))):
        created.clear()
        name = args[0] if POINT == "written" else os.readlink(f"/proc/self/fd/{args[0]}")
        print("holding", POINT, os.path.getsize(name), file=sys.stderr, flush=True)
        os.read(0, 1)
sys.addaudithook(hold)
import memplan.cli, memplan.planner.jobs.export
sys.argv = ["memplan", *sys.argv[1:]]
memplan.cli.main()
"""


@pytest.fixture(scope="module")
def big_trace(tmp_path_factory):
    """A generated trace of 20,000 buffers: its snapshot pickle is some megabytes."""
    n = 20_000
    path = tmp_path_factory.mktemp("trace") / "big.json"
    save(make_trace({"size": [4096 + i for i in range(n)], "alloc": list(range(1, n + 1)),
                     "free": list(range(n + 1, 2 * n + 1))}), path)  # fmt: skip
    return path


@pytest.mark.parametrize("point", ["created", "written"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_write_leaves_no_temporary_file(big_trace, tmp_path, point, signum):
    """Held with the temporary file just created (empty) or written whole and not yet renamed: SIGTERM ends in one
    `Error:` line and exit code 143 (128 + SIGTERM, as a shell reports it), SIGINT in click's "Aborted!" and exit 1,
    and neither leaves the temporary file or the target."""
    out = tmp_path / "out"
    out.mkdir()
    target = out / "big.pickle"
    args = [sys.executable, "-c", CHILD, point, "export", str(big_trace), "-o", str(target)]
    pipe = subprocess.PIPE
    proc = subprocess.Popen(args, stdin=pipe, stdout=pipe, stderr=pipe, text=True)
    try:
        lines = []
        for line in proc.stderr:  # progress lines, then the hold
            lines.append(line)
            if line.startswith("holding"):
                break
        assert lines and lines[-1].startswith(f"holding {point}"), "".join(lines)
        written = int(lines[-1].split()[-1])
        assert (written > 1_000_000) if point == "written" else written == 0
        assert [p.name for p in out.iterdir()][0].startswith(".big.pickle.")  # the temporary file, on disk
        proc.send_signal(signum)
        code = proc.wait(timeout=SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert proc.stdout.read() == ""
    assert "Traceback" not in err, err[-2000:]
    if signum == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM, err
        errors = [line for line in err.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and err.rstrip().endswith(errors[0]) and "SIGTERM" in errors[0], err
    else:
        assert code == 1 and err.rstrip().endswith("Aborted!"), err
    assert list(out.iterdir()) == []
