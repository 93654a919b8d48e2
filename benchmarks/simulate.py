"""Caching-allocator simulator figures: speed, the address-by-address match on real CUDA snapshots, peaks.

Usage: .venv/bin/python benchmarks/simulate.py [SHARED_DIR] [--trace FILE ...] [--repeat N] [--time-limit S]
For each snapshot in SHARED_DIR/traces/cuda-snapshots (default ../shared), each trace bundled in
traces/data/ and each extra trace: simulated events per second (median of N runs of simulate_caching),
for snapshots the replay against the snapshot's own decisions (addresses, new segments), peak
allocated, peak reserved, the max-live bound (sizes rounded to 512 B) and the arena of a plan solved
for it (auto portfolio, verified), with the fragmentation at the reserved peak.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from memplan.planner.problem import problem_from_trace
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.simulate.snapshot_check import replay_snapshot
from memplan.solvers import solve
from memplan.traces.format import Trace, load
from memplan.traces.inputs.snapshot import read_snapshot, snapshot_to_trace

ROOT = Path(__file__).resolve().parents[1]

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


def row(name: str, trace: Trace, repeat: int, match: str, time_limit: float) -> str:
    """One table line: events, speed, snapshot match, peaks, bound, plan arena, fragmentation."""
    rate, sim = speed(trace, repeat)
    plan = solve(problem_from_trace(trace), time_limit=time_limit)  # verified inside solve()
    status = "opt" if plan.status == "optimal" else f"+{plan.gap:.2%}"
    return (
        f"{name:<44} {events_of(trace):>8,} {rate:>10,.0f} {match:>22} "
        f"{sim.peak_allocated / GiB:>9.3f} {sim.peak_reserved / GiB:>9.3f} {plan.bound / GiB:>9.3f} "
        f"{plan.arena / GiB:>9.3f} {status:>6} {sim.fragmentation_at_peak:>6.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shared", nargs="?", default=str(ROOT.parent / "shared"))
    parser.add_argument("--trace", action="append", default=[], help="an extra trace file (repeatable)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds to solve each plan")
    args = parser.parse_args()

    print(
        f"{'trace':<44} {'events':>8} {'events/s':>10} {'addresses / segments':>22} "
        f"{'alloc GiB':>9} {'resv GiB':>9} {'bound GiB':>9} {'plan GiB':>9} {'status':>6} {'frag':>6}"
    )
    snapshots = sorted((Path(args.shared) / "traces" / "cuda-snapshots").glob("*.pickle"))
    bundled = sorted((ROOT / "traces" / "data").glob("*.json.gz"))
    for path in snapshots:
        snap = read_snapshot(path)
        t0 = time.perf_counter()
        rep = replay_snapshot(snap)
        replay_s = time.perf_counter() - t0
        match = (
            f"{rep.addr_matches}/{rep.allocs} {rep.segment_matches}/{rep.segment_decisions}"
            f"{'' if rep.extra_segments == 0 else f' +{rep.extra_segments}'}"
        )
        print(row(path.stem, snapshot_to_trace(snap, path.name), args.repeat, match, args.time_limit))
        print(
            f"{'':<44} replay of {len(snap.entries):,} snapshot entries: "
            f"{len(snap.entries) / replay_s:,.0f} entries/s, "
            f"real-state peak reserved {rep.peak_reserved / GiB:.3f} GiB, exact={rep.exact}"
        )
    for path in bundled + [Path(name) for name in args.trace]:
        print(
            row(
                path.name.removesuffix(".json.gz").removesuffix(".trace"), load(path), args.repeat, "-", args.time_limit
            )
        )


if __name__ == "__main__":
    main()
