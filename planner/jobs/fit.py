"""`memplan fit`: the largest batch size whose training step fits a memory size, per layer mode.

Memory is measured on traces: a few batch sizes are traced, memory is fitted as affine in the
batch, the largest fitting batch is predicted, and the boundary is then proven by tracing: batch b
fits and b+1 does not, both under the same allocator model (PyTorch's caching allocator simulated
with the size as its capacity, so its out-of-memory retry applies; or a plan from the solvers).
The traces are real, or fake (fake tensors: any size, in seconds) where the steps near the answer
would be slow or would not fit this machine: `--capture` chooses, the summary says which.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memplan.errors import MemplanError
from memplan.gpus import GPU
from memplan.modes import AS_BUILT, MODES, SWEPT_MODES
from memplan.planner.report.trace_text import describe_loss, describe_patch
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.simulate.measure import measure
from memplan.planner.simulate.verdict import Budget, device_memory, judged
from memplan.solvers import CapacityError, solve
from memplan.step import StepSpec
from memplan.traces.compile import Compile, CompileError, require_real_tensors
from memplan.traces.format import Trace
from memplan.traces.inputs.trace_model import (
    HOST_SHARE,
    CaptureChoice,
    choose_capture,
    host_memory_available,
    rank_capture,
    trace_step,
)
from memplan.traces.ranks.family import load_family, ranks_label
from memplan.traces.ranks.launch import trace_ranks
from memplan.units import format_size

MEASURE_BATCHES = (1, 2, 4)
MAX_BATCH = 4096  # the search stops here (larger batches take too long to trace): fitting, it is a lower bound
GROWTH = 8  # a trace is at most this many times the largest batch known to fit
GUESSES = 2  # traces that may leave the bracket more than half as wide before the search bisects it
ALLOCATORS = ("caching", "plan")


class FitError(MemplanError):
    """A fit request that cannot be answered: memory below what batch 1 needs, or a mode or batch it cannot trace."""


@dataclass
class Point:
    """One traced batch size: caching allocator and plan figures, and whether each fits the memory."""

    batch: int
    caching_peak_reserved: int  # simulated peak reserved without a capacity (what the step asks for)
    caching_fits: bool  # no simulated OOM with capacity = memory (the OOM retry applied)
    plan_arena: int
    bound: int  # the plan's best lower bound
    plan_fits: bool  # a plan with arena <= memory was found
    plan_miss_proven: bool = False  # no plan fits, proven (bound above memory, or the solver's proof)
    ranks: tuple[int, ...] | None = None  # a rank's point: the ranks its trace stands for; None: the job's
    per_rank: list[Point] = field(default_factory=list)  # with --nproc: each distinct rank's point, in rank order

    @classmethod
    def of_ranks(cls, batch: int, per_rank: list[Point]) -> Point:
        """The job's point over its ranks: it fits only where every rank fits, and its figures are the highest
        rank's (a plan miss is proven when one rank's is)."""
        return cls(
            batch,
            max(p.caching_peak_reserved for p in per_rank),
            all(p.caching_fits for p in per_rank),
            max(p.plan_arena for p in per_rank),
            max(p.bound for p in per_rank),
            all(p.plan_fits for p in per_rank),
            any(p.plan_miss_proven for p in per_rank),
            per_rank=per_rank,
        )

    def tightest(self, allocator: str) -> Point:
        """The rank with the least room under `allocator`: the highest figure, then the most bytes live (the
        caching allocator's segments round reserved up), then the first."""
        return max(self.per_rank, key=lambda p: (p.figure(allocator), p.bound))

    def figure(self, allocator: str) -> int:
        return self.caching_peak_reserved if allocator == "caching" else self.plan_arena

    def fits(self, allocator: str) -> bool:
        return self.caching_fits if allocator == "caching" else self.plan_fits

    def as_dict(self) -> dict:
        out = {
            "batch": self.batch,
            "caching_peak_reserved": self.caching_peak_reserved,
            "caching_fits": self.caching_fits,
            "plan_arena": self.plan_arena,
            "bound": self.bound,
            "plan_fits": self.plan_fits,
            "plan_miss_proven": self.plan_miss_proven,
        }
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        if self.per_rank:
            out["per_rank"] = [p.as_dict() for p in self.per_rank]
        return out


@dataclass
class ModeFit:
    """The answer for one layer mode: the largest fitting batch per allocator model and the traced points."""

    mode: str
    patch: dict  # what the mode changed in the model (the traces' meta "patch")
    batch: dict[str, int]  # allocator -> largest batch that fits
    predicted: dict[str, int]  # allocator -> the first prediction from the measured batches
    points: dict[int, Point] = field(default_factory=dict)
    loss_patch: dict | None = None  # what the step's loss choice changed (the traces' meta "loss_patch")

    def runs_out_below(self, allocator: str) -> list[int]:
        """Traced batches below the answer that do not fit under `allocator`: memory is not monotone in the batch
        there (the caching allocator's fragmentation), so a smaller batch is no safer."""
        return sorted(b for b, p in self.points.items() if b < self.batch[allocator] and not p.fits(allocator))

    @property
    def traces(self) -> int:
        return len(self.points)

    def boundary(self, allocator: str) -> tuple[Point | None, Point | None]:
        """The traced points at the answer b (None when even batch 1 does not fit) and at b+1 (None when b is
        MAX_BATCH: the answer is at least b, and b+1 was never traced)."""
        b = self.batch[allocator]
        return self.points.get(b), self.points.get(b + 1)

    def as_dict(self) -> dict:
        out = {
            "mode": self.mode,
            "changed": self.patch["changed"],
            "patch": describe_patch(self.patch),
            "loss_patch": None
            if self.loss_patch is None or self.loss_patch["loss"] == AS_BUILT
            else describe_loss(self.loss_patch),
            "traces": self.traces,
            "points": [p.as_dict() for _, p in sorted(self.points.items())],
        }
        for a in ALLOCATORS:
            at, above = self.boundary(a)
            out[a] = {
                "batch": self.batch[a],
                "at_least": above is None,  # MAX_BATCH fits: a lower bound, the search stopped there
                "predicted": self.predicted[a],
                "at_batch": at.figure(a) if at else None,
                "at_next": above.figure(a) if above else None,
                "runs_out_below": self.runs_out_below(a),
            }
        above = self.boundary("plan")[1]
        out["plan"]["next_bound"] = above.bound if above else None
        out["plan"]["next_proven"] = above.plan_miss_proven if above else None
        if (above or self.boundary("plan")[0]).per_rank:
            out["ranks"] = self.ranks_dict()
        return out

    def ranks_dict(self) -> dict:
        """With --nproc, per allocator: each distinct rank's figure and fit at the answer b and at b+1, and the
        tightest rank (the highest figure at b; at b+1 when no batch fits)."""
        out = {}
        for a in ALLOCATORS:
            at, above = self.boundary(a)
            judged = at or above
            nexts = above.per_rank if above else [None] * len(judged.per_rank)  # none past MAX_BATCH
            out[a] = {
                "tightest": list(judged.tightest(a).ranks),
                "per_rank": [
                    {
                        "ranks": list(p_judged.ranks),
                        "at_batch": None if at is None else p_judged.figure(a),
                        "fits_at_batch": None if at is None else p_judged.fits(a),
                        "at_next": None if p_next is None else p_next.figure(a),
                        "fits_at_next": None if p_next is None else p_next.fits(a),
                    }
                    for p_judged, p_next in zip(judged.per_rank, nexts)
                ],
            }
        return out


@dataclass
class FitResult:
    """Every mode's fit for one model file, memory size and shape."""

    step: StepSpec  # the step fitted: its model file, sequence, dtype and compilation (batch and mode vary)
    memory: int
    alloc_conf: str
    modes: list[ModeFit]
    capture: CaptureChoice
    tie_break: str = "lowest_address"
    budget: Budget | None = None  # with a GPU: its memory, less what it holds outside the allocator, is `memory`
    nproc: int | None = None  # ranks of a distributed model file; None: one process

    @property
    def compile(self) -> Compile | None:
        """How the traced steps were compiled; None: eager."""
        return None if self.step.compile is None else Compile(self.step.compile)

    def summary(self) -> dict:
        """The JSON document of `memplan fit --json`."""
        return {
            "model_file": self.step.model_file,
            "memory": self.memory,
            "gpu": None if self.budget is None else self.budget.as_dict(),
            "seq": self.step.seq,
            "dtype": self.step.dtype,
            "loss": self.step.loss,
            "optimizer": self.step.optimizer,
            "alloc_conf": self.alloc_conf,
            "tie_break": self.tie_break,
            "capture": self.capture.name,
            "capture_reason": self.capture.reason,
            "compile": None if self.compile is None else self.compile.meta(),
            "modes": [m.as_dict() for m in self.modes],
            "world_size": self.nproc,
        }


def affine_prediction(points: list[Point], allocator: str, memory: int) -> int:
    """Largest batch whose memory, fitted as affine in the batch over `points`, is within `memory`."""
    b = np.array([p.batch for p in points], float)
    y = np.array([p.figure(allocator) for p in points], float)
    if len(set(b)) < 2:
        return int(b[0])
    slope, intercept = np.polyfit(b, y, 1)
    if slope <= 0:  # memory did not grow over these batches: look twice as far
        return int(min(2 * b.max(), MAX_BATCH))
    return int(min(max(np.floor((memory - intercept) / slope), 1), MAX_BATCH))


class BatchProbe:
    """Traces one layer mode at any batch size (each at most once) and judges it under both allocator models."""

    def __init__(
        self,
        step: StepSpec,
        memory: int,
        *,
        alloc_conf: str,
        time_limit: float,
        progress: Callable[[str], None],
        tie_break: str = "lowest_address",
        nproc: int | None = None,
        every_rank: bool = False,
    ):
        self.step, self.memory, self.time_limit, self.progress = step, memory, time_limit, progress
        self.nproc = nproc  # ranks of a distributed model file; None: one process
        self.every_rank = every_rank  # with nproc on fake tensors: every rank traced, even those alike
        self.alloc_conf, self.tie_break = alloc_conf, tie_break
        self.conf = parse_alloc_conf(alloc_conf, tie_break)
        self.points: dict[int, Point] = {}
        self.patch: dict = {}  # the traces' meta "patch", once one is traced
        self.loss_patch: dict | None = None  # and their meta "loss_patch"

    @property
    def mode(self) -> str:
        """The layer mode probed."""
        return self.step.mode_name

    def __call__(self, batch: int) -> Point:
        if batch not in self.points:
            self._check_host_memory(batch)
            self.points[batch] = self._measure(batch)
        return self.points[batch]

    def _check_host_memory(self, batch: int) -> None:
        """Refuse a trace whose step, extrapolated from the traced batches, would not fit this machine's RAM."""
        known = list(self.points.values())
        if self.step.fake or len(known) < 2:
            return
        b = np.array([p.batch for p in known], float)
        live = np.array([p.bound for p in known], float)  # bytes live at the peak: what the CPU step holds
        slope, intercept = np.polyfit(b, live, 1)
        need = slope * batch + intercept
        available = host_memory_available()
        if available is not None and need > HOST_SHARE * available:
            raise FitError(
                f"{self.mode}: tracing batch {batch} would need about {format_size(int(need))} of this "
                f"machine's memory ({format_size(available)} available); --memory "
                f"{format_size(self.memory)} holds more than can be traced here: use --capture fake"
            )

    def _measure(self, batch: int) -> Point:
        """Trace `batch` (on every rank with nproc) and judge it: the job's point over its distinct ranks."""
        step = self.step.replace(batch=batch)
        if self.nproc is None:
            return self._judge(trace_step(step, progress=self.progress), batch)
        with tempfile.TemporaryDirectory(prefix=".memplan-fit-") as folder:
            output = Path(folder) / "rank.json.gz"
            trace_ranks(step, output, self.nproc, alike=not self.every_rank)
            members = load_family(output)
        point = Point.of_ranks(batch, [self._judge(m.trace, batch, m.ranks) for m in members])
        oom = [ranks_label(p.ranks) for p in point.per_rank if not p.caching_fits]
        where = f"OOM on {', '.join(oom)}" if oom else "fits on every rank"
        tight = ranks_label(point.tightest("caching").ranks)
        self.progress(f"  {self.mode} batch {batch}: {where} under the caching allocator; tightest {tight}")
        return point

    def _judge(self, trace: Trace, batch: int, ranks: tuple[int, ...] | None = None) -> Point:
        """One trace's point at `batch`: the caching allocator's reserved and fit, and the plan's arena and fit."""
        self.patch, self.loss_patch = trace.meta["patch"], trace.meta.get("loss_patch")
        measured = measure(trace, self.mode, time_limit=self.time_limit, alloc_conf=self.alloc_conf,
                           tie_break=self.tie_break)  # fmt: skip
        figures, problem = measured.figures(), measured.problem
        reserved, arena, bound = figures["caching_peak_reserved"], figures["plan_arena"], figures["bound"]
        # The caching allocator judges the whole program when the trace holds it (the cache the step meets); with a
        # capacity the allocator frees its cache and retries before failing: only that decides a miss.
        program = judged(trace)
        if program is not trace:
            reserved = simulate_caching(program, self.conf).peak_reserved
        caching_fits = reserved <= self.memory or simulate_caching(program, self.conf, self.memory).oom is None
        proven = bound > self.memory
        if bound <= self.memory < arena:
            try:
                arena = solve(problem, time_limit=self.time_limit, capacity=self.memory).arena
            except CapacityError as e:
                proven = e.proven
        point = Point(batch, reserved, caching_fits, arena, bound, arena <= self.memory, proven, ranks)
        where = "" if ranks is None else f" {ranks_label(ranks)}"
        self.progress(
            f"  {self.mode}{where} batch {batch}: caching reserved {format_size(reserved)} "
            f"({'fits' if caching_fits else 'OOM'}), plan arena {format_size(arena)} "
            f"({'fits' if point.plan_fits else 'does not fit'})"
        )
        return point


def boundary_search(probe: BatchProbe, allocator: str, start: int) -> int:
    """Largest b with probe(b) fitting and probe(b+1) not, from a predicted b; needs a traced batch that fits. A batch
    below the largest that fits may run out (fragmentation makes "fits" non-monotone in the batch): the answer is the
    boundary above the largest that fits, and `runs_out_below` names those that do not.

    Until a batch that does not fit is known it extrapolates: the prediction, then the secant through
    the two largest traced batches (at most GROWTH times the largest batch that fits), and at least 1,
    2, 4, ... batches past the largest that fits, doubling with each batch in a row that fits. Once a
    fitting batch lo and a failing one hi bracket the answer it narrows the bracket: the secant's guess
    through lo and hi (the prediction first), kept at least 1, 2, 4, ... batches from an end that moved
    that many times in a row (guesses falling on one side of the answer), and a bisection whenever
    GUESSES traces in a row have not halved the bracket. So the bracket halves at least every GUESSES + 1
    traces and the traces grow as the logarithm of the answer, while a good guess still ends the search
    in one or two. The answer is the one stepping batch by batch would give: b fits, b+1 does not.
    """
    guess, run, since, width = start, 0, 0, 0
    while True:
        points = probe.points
        lo = max((x for x, p in points.items() if p.fits(allocator)), default=0)
        hi = min((x for x, p in points.items() if not p.fits(allocator) and x > lo), default=None)
        if lo >= MAX_BATCH:  # the search stops here: the answer is at least MAX_BATCH (ModeFit.boundary)
            return MAX_BATCH
        if hi == lo + 1:
            return lo
        if hi is None:  # nothing fails yet (run >= 0): extrapolate
            batch = min(max(guess, lo + (1 << max(run - 1, 0))), MAX_BATCH, GROWTH * lo)
        else:
            if 2 * (hi - lo) <= width or not width:  # halved (or just bracketed): a new checkpoint
                since, width = 0, hi - lo
            mid = (lo + hi) // 2
            if since >= GUESSES:
                batch = mid
            elif run > 0:  # lo moved `run` times in a row: at least 2**(run-1) above it (at most to mid)
                batch = max(guess, min(lo + (1 << (run - 1)), mid))
            elif run < 0:  # hi moved -run times in a row: at least 2**(-run-1) below it
                batch = min(guess, max(hi - (1 << (-run - 1)), mid))
            else:
                batch = guess
            batch = min(max(batch, lo + 1), hi - 1)
            since += 1
        fits = probe(batch).fits(allocator)
        run = (max(run, 0) + 1) if fits else (min(run, 0) - 1)
        # next guess: secant through the closest traced batches on both sides (or the two largest)
        points = probe.points
        lo = max(x for x, p in points.items() if p.fits(allocator))
        hi = min((x for x, p in points.items() if not p.fits(allocator) and x > lo), default=None)
        near = [points[lo], points[hi]] if hi is not None else [points[x] for x in sorted(points)[-2:]]
        guess = affine_prediction(near, allocator, probe.memory)


def fit_mode(probe: BatchProbe) -> ModeFit:
    """Measure a few batch sizes, predict the largest fitting batch per allocator model, prove it by tracing."""
    first = probe(1)
    if not (first.caching_fits or first.plan_fits):  # no batch fits: an answer, 0, with batch 1's figures
        probe.progress(f"{probe.mode}: batch 1 does not fit {format_size(probe.memory)}")
        none = dict.fromkeys(ALLOCATORS, 0)
        return ModeFit(probe.mode, probe.patch, none, dict(none), probe.points, probe.loss_patch)
    for b in MEASURE_BATCHES[1:]:
        if not (probe(b).caching_fits or probe(b).plan_fits):
            break
    measured = list(probe.points.values())
    batch, predicted = {}, {}
    for allocator in ALLOCATORS:
        predicted[allocator] = affine_prediction(measured, allocator, probe.memory)
        if not any(p.fits(allocator) for p in probe.points.values()) and not _fitting_above(probe, allocator):
            batch[allocator] = 0
            continue
        batch[allocator] = boundary_search(probe, allocator, predicted[allocator])
        probe.progress(
            f"{probe.mode}: {allocator} batch {batch[allocator]} "
            f"(predicted {predicted[allocator]}, {len(probe.points)} traces so far)"
        )
    return ModeFit(probe.mode, probe.patch, batch, predicted, probe.points, probe.loss_patch)


def _fitting_above(probe: BatchProbe, allocator: str) -> bool:
    """Whether a batch above those traced fits under `allocator` when none traced does: the caching allocator's
    fragmentation can fail a small batch and serve a larger one, so batches double up to the plan's predicted answer
    (where the bytes live still fit) before the answer is 0."""
    plan = affine_prediction(list(probe.points.values()), "plan", probe.memory)
    limit = plan if allocator == "caching" and any(p.plan_fits for p in probe.points.values()) else 0
    batch = max(probe.points) * 2
    while batch <= limit:
        if probe(batch).fits(allocator):
            return True
        batch *= 2
    return limit > max(probe.points) and probe(limit).fits(allocator)


def fit_model(
    step: StepSpec,
    memory: int | None = None,
    *,
    gpu: GPU | None = None,
    modes: tuple[str, ...] = SWEPT_MODES,
    alloc_conf: str = "",
    time_limit: float = 5.0,
    tie_break: str = "lowest_address",
    capture: str = "auto",
    progress: Callable[[str], None] = lambda _: None,
    nproc: int | None = None,
    every_rank: bool = False,
) -> FitResult:
    """The largest batch of `step` fitting `memory` bytes (or `gpu`: its memory less what it holds outside the
    caching allocator) for every mode, under both allocator models, on real or fake traces as `capture` (auto,
    real, fake) chooses for steps near that size; compiled by torch.compile when the step says so (real traces
    only). The step's own batch and mode are not used. With `nproc`, every batch is traced on that many ranks of a
    distributed model file (auto: the fake process group) and fits only where it fits on every distinct rank (on fake
    tensors ranks alike by construction are traced once, unless `every_rank`)."""
    step = step.on_gpu(gpu)  # a CUDA step on that GPU (fake CUDA traces where this machine has none)
    for mode in modes:
        if mode not in MODES:
            raise FitError(f"--layers {mode}: unknown mode (choose from {', '.join(MODES)})")
    if nproc is not None:
        choice = rank_capture(capture, step.device)
    else:
        choice = choose_capture(capture, memory if gpu is None else gpu.memory, step.device)
    memory, budget = device_memory(memory, gpu, step.replace(fake=choice.fake))
    require_real_tensors(step.replace(fake=capture == "fake"))  # before anything is traced
    if nproc is not None and step.compile is not None:
        raise CompileError("--compile traces one process: it does not take --nproc")
    if step.compile is not None and choice.fake:
        raise CompileError(f"--compile needs real tensors, and {choice.reason}: fit it eagerly, or a smaller --memory")
    progress(f"{choice.name} traces ({choice.reason})")
    fits = []
    for mode in dict.fromkeys(modes):
        progress(f"{mode}: tracing batch sizes {', '.join(map(str, MEASURE_BATCHES))} to predict the fit")
        probe = BatchProbe(
            step.replace(mode=mode, fake=choice.fake),
            memory,
            alloc_conf=alloc_conf,
            time_limit=time_limit,
            progress=progress,
            tie_break=tie_break,
            nproc=nproc,
            every_rank=every_rank,
        )
        fits.append(fit_mode(probe))
    return FitResult(step, memory, alloc_conf, fits, choice, tie_break, budget, nproc)
