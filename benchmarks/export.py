"""`memplan export` figures: entries, file size, seconds and peak memory of the snapshot of a trace.

Usage: .venv/bin/python benchmarks/export.py [SHARED_DIR] [--buffers N]
For each trace bundled in traces/data/, each real CUDA snapshot in SHARED_DIR/traces/cuda-snapshots (default
../shared; imported first) and a synthetic trace of N buffers (default 1,000,000; 0 for none): the snapshot's
entries and segments, the pickle's size, the seconds to build it and to write it, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

from memplan.planner.simulate.snapshot_export import make_snapshot, snapshot_summary, write_snapshot
from memplan.traces.format import Trace, load, make_trace
from memplan.traces.inputs.snapshot import import_snapshot

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from large_trace import step_like  # noqa: E402  the generated trace the solver's large tests use


def synthetic(n: int, seed: int = 0) -> Trace:
    """A step-like trace of `n` buffers: one allocation per two events, log-normal sizes, geometric lifetimes."""
    return make_trace(step_like(n, seed))


def row(name: str, trace: Trace, folder: Path) -> str:
    """One table line: buffers, entries, segments, file bytes, build and write seconds, peak RSS so far."""
    t0 = time.perf_counter()
    snapshot = make_snapshot(trace, name=name)
    t1 = time.perf_counter()
    path = folder / f"{name}.pickle"
    write_snapshot(snapshot, path)
    t2 = time.perf_counter()
    s = snapshot_summary(snapshot)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return (
        f"{name:<44} {len(trace):>9,} {s['entries']:>10,} {s['segments']:>8,} {path.stat().st_size / 1e6:>9.1f} "
        f"{t1 - t0:>8.2f} {t2 - t1:>8.2f} {rss:>8.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shared", nargs="?", default=str(ROOT.parent / "shared"))
    parser.add_argument("--buffers", type=int, default=1_000_000, help="buffers of the synthetic trace (0: none)")
    args = parser.parse_args()
    print(f"{'trace':<44} {'buffers':>9} {'entries':>10} {'segments':>8} {'MB':>9} {'build s':>8} {'write s':>8} "
          f"{'RSS GiB':>8}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted((ROOT / "traces" / "data").glob("*.json.gz")):
            print(row(path.name.removesuffix(".json.gz"), load(path), Path(tmp)))
        for path in sorted((Path(args.shared) / "traces" / "cuda-snapshots").glob("*.pickle")):
            print(row(path.stem, import_snapshot(path), Path(tmp)))
        if args.buffers:
            print(row(f"synthetic-{args.buffers}", synthetic(args.buffers), Path(tmp)))


if __name__ == "__main__":
    main()
