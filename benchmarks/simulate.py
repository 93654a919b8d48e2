"""Caching-allocator simulator figures: speed, the address-by-address match on real CUDA snapshots, peaks.

Usage: .venv/bin/python benchmarks/simulate.py [SHARED_DIR] [--trace FILE ...] [--repeat N]
For each snapshot in SHARED_DIR/traces/cuda-snapshots (default ../shared) and each extra trace:
simulated events per second (median of N runs of simulate_caching on the imported trace),
for snapshots the replay against the snapshot's own decisions (addresses, new segments), and
peak allocated, peak reserved and the max-live bound.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.caching_allocator import simulate_caching  # noqa: E402
from planner.snapshot_replay import replay_snapshot  # noqa: E402
from traces.format import Trace, load  # noqa: E402
from traces.snapshot import read_snapshot, snapshot_to_trace  # noqa: E402

GiB = 2**30


def events_of(trace: Trace) -> int:
    """Allocator calls the simulation makes: every allocation plus every free before the end."""
    return len(trace) + int((trace.free < trace.end).sum())


def speed(trace: Trace, repeat: int) -> tuple[float, object]:
    """(events per second over the median of `repeat` runs, the last SimResult)."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = simulate_caching(trace)
        times.append(time.perf_counter() - t0)
    return events_of(trace) / statistics.median(times), result


def row(name: str, trace: Trace, repeat: int, match: str) -> str:
    """One table line: events, speed, snapshot match, peaks, bound, fragmentation."""
    rate, sim = speed(trace, repeat)
    bound = trace.peak()[0]
    return (f"{name:<32} {events_of(trace):>8,} {rate:>12,.0f} {match:>30} "
            f"{sim.peak_allocated / GiB:>9.3f} {sim.peak_reserved / GiB:>9.3f} {bound / GiB:>9.3f} "
            f"{sim.fragmentation_at_peak:>7.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shared", nargs="?", default=str(ROOT.parent / "shared"))
    parser.add_argument("--trace", action="append", default=[], help="an extra trace file (repeatable)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    print(f"{'trace':<32} {'events':>8} {'events/s':>12} {'addresses / new segments':>30} "
          f"{'alloc GiB':>9} {'resv GiB':>9} {'bound GiB':>9} {'frag':>7}")
    snapshots = sorted((Path(args.shared) / "traces" / "cuda-snapshots").glob("*.pickle"))
    if not snapshots and not args.trace:
        sys.exit(f"no snapshots under {args.shared}/traces/cuda-snapshots and no --trace given")
    for path in snapshots:
        snap = read_snapshot(path)
        t0 = time.perf_counter()
        rep = replay_snapshot(snap)
        replay_s = time.perf_counter() - t0
        match = (f"{rep.addr_matches}/{rep.allocs} {rep.segment_matches}/{rep.segment_decisions}"
                 f"{'' if rep.extra_segments == 0 else f' +{rep.extra_segments}'}")
        print(row(path.stem, snapshot_to_trace(snap, path.name), args.repeat, match))
        print(f"{'':<32} replay of {len(snap.entries):,} snapshot entries: {len(snap.entries) / replay_s:,.0f} entries/s, "
              f"real-state peak reserved {rep.peak_reserved / GiB:.3f} GiB, exact={rep.exact}")
    for name in args.trace:
        print(row(Path(name).name, load(name), args.repeat, "-"))


if __name__ == "__main__":
    main()
