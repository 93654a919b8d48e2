"""`memplan run`: the main job. Trace one model under every layer mode, solve, simulate, replay, report.

Each stage is the same function its own command uses (trace, solve, simulate, plot, replay), and every
file it writes is one a user could have made with those commands: report.md says which command.
All files are made in a private folder beside the output folder and moved into it only when the whole
run succeeded, so a failed run leaves nothing behind (and other files in the output folder alone).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from memplan.errors import MemplanError
from memplan.files import atomic_write
from memplan.gpus import GPU
from memplan.modes import AS_BUILT, REPLAYED_MODE, SWEPT_MODES
from memplan.planner.plan import save_plan
from memplan.planner.replay.model_replay import replay_model_file
from memplan.planner.replay.report import ReplayReport
from memplan.planner.report.html_report import render_html
from memplan.planner.report.plots import plot_reports
from memplan.planner.report.run_report import render_markdown
from memplan.planner.report.trace_text import describe_loss, describe_patch
from memplan.planner.simulate.measure import Measurement, measure
from memplan.step import StepSpec
from memplan.traces.compile import Compile, CompileError, require_real_tensors
from memplan.traces.format import Trace, save
from memplan.traces.inputs.trace_model import (
    CaptureChoice,
    as_built_patch,
    as_built_trace,
    choose_capture,
    rank_capture,
    trace_step,
)
from memplan.traces.ranks.family import load_family, rank_path, ranks_label, remove_stale
from memplan.traces.ranks.launch import trace_ranks

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "workloads" / "bert_large_slice.py"  # ships in the wheel


@dataclass(frozen=True)
class RunOptions:
    """What to run: the step (its model file, shape and compilation; every mode is run, so its own mode is not
    used), the output folder, the layer modes, the solver's time and the replay's steps."""

    step: StepSpec
    out_dir: str
    modes: tuple[str, ...] = SWEPT_MODES
    time_limit: float = 10.0
    replay_mode: str = REPLAYED_MODE
    replay_steps: int = 2
    capture: str = "auto"  # real or fake traces: auto, real, fake
    gpu: GPU | None = None  # a GPU each mode's step is judged against (planner/simulate/verdict.py); None: none
    nproc: int | None = None  # ranks of a distributed model file (traces/ranks/launch.py); None: one process
    every_rank: bool = False  # with nproc on fake tensors: trace every rank, even those alike by construction

    def __post_init__(self) -> None:
        # a CUDA step on that GPU (fake CUDA traces where this machine has none)
        object.__setattr__(self, "step", self.step.on_gpu(self.gpu))

    def compiled(self) -> Compile | None:
        """How the traced and replayed steps are compiled; None when they run eagerly."""
        return None if self.step.compile is None else Compile(self.step.compile)


@dataclass
class ModeRow:
    """One layer mode's figures; every byte count is measured on its own trace."""

    mode: str
    trace_file: str
    plan_file: str
    buffers: int  # the figures of its Measurement (planner.simulate.measure.FIGURES)
    peak_live: int
    caching_peak_reserved: int
    caching_peak_allocated: int
    plan_arena: int
    bound: int
    status: str
    gap: float
    solver: str
    changed: bool  # whether the mode changed the model at all (as-built: False)
    patch: str  # what the mode swapped and left as built (planner.report.trace_text.describe_patch)
    saving: float | None  # 1 - peak live / the reference row's peak live (as-built's when run); < 0 costs memory
    command: str
    verdict: dict | None = None  # whether the step fits the GPU of RunOptions.gpu (Verdict.to_dict); None without
    ranks: list[int] | None = None  # with --nproc: the ranks this row's trace stands for; None: one process


@dataclass
class RunResult:
    """The whole run: the step's optimizer, one row per mode, the replay of one plan, the files and the wall time."""

    options: RunOptions
    capture: CaptureChoice
    optimizer: str | None  # the traced step's optimizer class, from the trace's meta; None when it does not say
    rows: list[ModeRow]
    reference: str  # the mode the savings are measured against: as-built when it was run, else the first
    replay: ReplayReport | None  # of the replay_mode's plan; None for fake traces (a replay runs the real step)
    report_md: str
    timeline_png: str
    address_space_png: str
    seconds: float
    html_report: str = ""  # report.html: the interactive page (planner/report/html_report.py)

    def summary(self) -> dict:
        return {
            "model_file": self.options.step.model_file,
            "batch": self.options.step.batch,
            "seq": self.options.step.seq,
            "dtype": self.options.step.dtype,
            "loss": self.options.step.loss,
            "capture": self.capture.name,
            "capture_reason": self.capture.reason,
            "optimizer": self.optimizer,
            "compile": None if self.options.step.compile is None else self.options.compiled().meta(),
            "gpu": None if self.options.gpu is None else self.options.gpu.as_dict(),
            "rows": [asdict(r) for r in self.rows],
            "world_size": self.options.nproc,
            "ranks": rank_groups(self.rows),
            "reference": self.reference,
            "replay": None if self.replay is None else {**self.replay.summary(), "mode": self.options.replay_mode},
            "report": self.report_md,
            "timeline": self.timeline_png,
            "address_space": self.address_space_png,
            "html_report": self.html_report,
            "seconds": round(self.seconds, 1),
        }


def run_modes(modes: tuple[str, ...]) -> dict:
    """RunOptions' modes and replayed mode for the modes asked for (the replayed one among them: tempo, else the
    first); {} for none asked, every mode."""
    if not modes:
        return {}
    modes = tuple(dict.fromkeys(modes))
    return {"modes": modes, "replay_mode": REPLAYED_MODE if REPLAYED_MODE in modes else modes[0]}


def rank_groups(rows: list[ModeRow]) -> list[list[int]] | None:
    """The distinct ranks' groups of a run over ranks (each the ranks one trace stands for), in rank order; None for
    a run of one process."""
    groups = {tuple(r.ranks): None for r in rows if r.ranks is not None}
    return [list(g) for g in sorted(groups)] if groups else None


def reproduce_command(
    step: StepSpec,
    time_limit: float,
    trace_file: str,
    plan_file: str,
    gpu: GPU | None,
    nproc: int | None = None,
    rank_file: str | None = None,
) -> str:
    """The memplan commands that rebuild one row of the report by hand (its verdict too, with a GPU); with `nproc`,
    the trace of every rank and the solve of the row's rank file."""
    q = shlex.quote
    ranks = "" if nproc is None else f" --nproc {nproc}"
    solved = trace_file if rank_file is None else rank_file
    return (
        f"memplan trace {q(step.model_file)} {step.arguments()}{ranks} -o {q(trace_file)} && "
        f"memplan solve {q(solved)} -o {q(plan_file)} "
        f"--time-limit {time_limit:g} && memplan simulate {q(solved)} --plan {q(plan_file)}"
        + ("" if gpu is None else f" --gpu {gpu.name}")
    )


def loss_lines(meta: dict) -> list[str]:
    """What a trace's loss choice did, in a line, when the step's loss is not as built; none otherwise."""
    report = meta.get("loss_patch")
    return [] if report is None or report["loss"] == AS_BUILT else [describe_loss(report)]


def choose_run_capture(opts: RunOptions, progress: Callable[[str], None]) -> tuple[CaptureChoice, dict[str, Trace]]:
    """Real or fake traces for the run, and the traces already made: auto sizes the step on a fake trace of
    the first mode (eager: a compiled step cannot run on fake tensors), which the run then keeps when it
    chose fake. A compiled run needs real traces."""
    if opts.nproc is not None:
        return rank_capture(opts.capture, opts.step.device), {}
    if opts.capture != "auto":
        return choose_capture(opts.capture, 0, opts.step.device), {}
    progress(f"[{opts.modes[0]}] sizing the step on a fake trace")
    sizing = trace_step(opts.step.replace(mode=opts.modes[0], fake=True, compile=None), progress=progress)
    choice = choose_capture("auto", sizing.peak()[0], opts.step.device)
    if choice.fake and opts.step.compile is not None:
        raise CompileError(
            f"--compile needs real tensors, and {choice.reason}: trace it eagerly, or on a larger machine"
        )
    return choice, {opts.modes[0]: sizing} if choice.fake else {}


def mode_files(mode: str, rank: int | None = None) -> tuple[Path, Path]:
    """Where one mode's trace and plan go, relative to the output folder; a rank's (the first rank its trace stands
    for) under its rank file's name, FILE.rank{r}.json.gz."""
    trace, plan = Path("traces") / f"{mode}.trace.json.gz", Path("plans") / f"{mode}.plan.json"
    return (trace, plan) if rank is None else (rank_path(trace, rank), rank_path(plan, rank))


def run_mode(
    opts: RunOptions,
    mode: str,
    work: Path,
    out: Path,
    fake: bool,
    traced: Trace | None,
    progress: Callable[[str], None],
    ranks: tuple[int, ...] | None = None,
) -> tuple[Measurement, ModeRow]:
    """Trace (unless `traced` is this mode's trace already), solve and simulate one layer mode, writing
    into `work`; the row names the files in `out`. With `ranks`, `traced` is the trace of those ranks (a rank
    family's member, already written under its rank file's name)."""

    trace_rel, plan_rel = mode_files(mode, None if ranks is None else ranks[0])
    trace_file, plan_file = out / trace_rel, out / plan_rel
    if traced is None:
        progress(f"[{mode}] tracing one training step ({'fake' if fake else 'real'} tensors)")
    step = opts.step.replace(mode=mode, fake=fake)
    trace = traced or trace_step(step, progress=progress)
    if ranks is None:
        save(trace, work / trace_rel)
    where = "" if ranks is None else f", {ranks_label(ranks)}"
    progress(f"[{mode}{where}] solving {len(trace):,} buffers and simulating the caching allocator")
    name = f"{mode} · {ranks_label(ranks)}" if ranks is not None else mode
    measured = measure(trace, name, plan_name=str(plan_file), time_limit=opts.time_limit, gpu=opts.gpu)
    save_plan(measured.plan, measured.problem, work / plan_rel)  # verified again as it is written
    row = ModeRow(
        mode=mode,
        trace_file=str(trace_file),
        plan_file=str(plan_file),
        **measured.figures(),
        changed=bool(trace.meta["patch"]["changed"]),
        patch="; ".join([describe_patch(trace.meta["patch"]), *loss_lines(trace.meta)]),
        saving=None,
        command=reproduce_command(
            step,
            opts.time_limit,
            str(out / mode_files(mode)[0]) if ranks is not None else str(trace_file),
            str(plan_file),
            opts.gpu,
            opts.nproc,
            None if ranks is None else str(trace_file),
        ),
        verdict=None if measured.verdict is None else measured.verdict.to_dict(),
        ranks=None if ranks is None else list(ranks),
    )
    return measured, row


def as_built_again(
    opts: RunOptions, mode: str, fake: bool, as_built: Trace | None, progress: Callable[[str], None]
) -> Trace | None:
    """The as-built trace, as `mode`'s, when the mode leaves the model exactly as built (baseline on a model built
    with baseline's layers): the same step, so it is not traced again; None when it changes the model, the traces are
    fake (trace_model.as_built_patch), or as-built was not traced before it."""
    if as_built is None or mode == AS_BUILT:
        return None
    patch = as_built_patch(opts.step.replace(mode=mode, fake=fake))
    if patch is None:
        return None
    progress(f"[{mode}] leaves the model as built: its trace is the as-built step's")
    return as_built_trace(as_built, mode, patch)


def run_mode_ranks(
    opts: RunOptions, mode: str, work: Path, out: Path, fake: bool, progress: Callable[[str], None]
) -> list[tuple[Measurement, ModeRow]]:
    """Trace one layer mode on opts.nproc ranks into `work` (one file per distinct rank), then solve and simulate
    each distinct rank's trace as run_mode does one process's: a row per distinct rank, in rank order."""
    trace_rel = mode_files(mode)[0]
    step = opts.step.replace(mode=mode, fake=fake)
    how = "fake process group" if fake else "gloo" if step.device == "cpu" else "nccl"
    progress(f"[{mode}] tracing one training step on {opts.nproc} ranks ({how})")
    trace_ranks(step, work / trace_rel, opts.nproc, alike=not opts.every_rank)
    members = load_family(work / trace_rel)
    return [run_mode(opts, mode, work, out, fake, m.trace, progress, ranks=m.ranks) for m in members]


def run(opts: RunOptions, progress: Callable[[str], None] = lambda m: None) -> RunResult:
    """Run the main job and write report.md, report.html, timeline.png and address_space.png into opts.out_dir."""

    if not Path(opts.step.model_file).is_file():
        raise MemplanError(f"{opts.step.model_file}: no such model file")
    if opts.nproc is None and opts.replay_mode not in opts.modes:  # ranks are not replayed
        raise MemplanError(f"the replayed mode {opts.replay_mode!r} is not among the modes run")
    require_real_tensors(opts.step.replace(fake=opts.capture == "fake"))  # before any work
    if opts.nproc is not None and opts.step.compile is not None:
        raise CompileError("--compile traces one process: it does not take --nproc")
    start = time.monotonic()
    out = Path(opts.out_dir)
    if out.exists() and not out.is_dir():
        raise MemplanError(f"-o {out}: exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        capture, traced = choose_run_capture(opts, progress)
        progress(f"{capture.name} traces ({capture.reason})")
        reports, rows = [], []
        for mode in opts.modes:
            if opts.nproc is None:
                trace = traced.get(mode)
                if trace is None:
                    trace = as_built_again(opts, mode, capture.fake, traced.get(AS_BUILT), progress)
                measured = [run_mode(opts, mode, work, out, capture.fake, trace, progress)]
                if mode == AS_BUILT:
                    traced[AS_BUILT] = measured[0][0].trace
            else:
                measured = run_mode_ranks(opts, mode, work, out, capture.fake, progress)
            reports += [report for report, _ in measured]
            rows += [row for _, row in measured]
        for row in rows:  # like with like: a rank's row against the same rank's reference
            reference = reference_row([r for r in rows if r.ranks == row.ranks])
            row.saving = 1 - row.peak_live / reference.peak_live
        reference = reference_row(rows)

        progress("drawing timeline.png and address_space.png")
        plot_reports(reports, work / "timeline.png")
        drawn = opts.replay_mode if opts.replay_mode in opts.modes else opts.modes[0]  # ranks: no replay
        plot_reports([r for r, row in zip(reports, rows) if row.mode == drawn], work / "address_space.png",
                     address_space=True)  # fmt: skip
        progress("writing report.html")
        commands = [f"# {row.mode}\n{row.command}" for row in rows]
        title = f"memplan report: {Path(opts.step.model_file).stem}"
        atomic_write(work / "report.html", render_html(reports, commands, title))

        result = RunResult(
            options=opts,
            capture=capture,
            optimizer=reports[0].trace.meta.get("optimizer"),
            rows=rows,
            reference=reference.mode,
            replay=None if capture.fake or opts.nproc is not None else replay_plan(opts, work, progress),
            report_md=str(out / "report.md"),
            timeline_png=str(out / "timeline.png"),
            address_space_png=str(out / "address_space.png"),
            seconds=time.monotonic() - start,
            html_report=str(out / "report.html"),
        )
        atomic_write(work / "report.md", render_markdown(result.summary()))
        move_into(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def replay_plan(opts: RunOptions, work: Path, progress: Callable[[str], None]) -> ReplayReport:
    """Replay the replayed mode's plan through the C++ plan allocator."""

    trace_rel, plan_rel = mode_files(opts.replay_mode)
    progress(f"[{opts.replay_mode}] replaying its plan for {opts.replay_steps} steps through the C++ plan allocator")
    return replay_model_file(
        str(work / plan_rel),
        opts.step.replace(mode=opts.replay_mode, fake=False),
        trace_file=str(work / trace_rel),
        steps=opts.replay_steps,
        progress=progress,
    )


def move_into(work: Path, out: Path) -> None:
    """Move every file of `work` to the same place under `out` (replacing older ones of the same name, and an
    older rank family's files the new one does not hold)."""
    moved = []
    for path in sorted(p for p in work.rglob("*") if p.is_file()):
        moved.append(out / path.relative_to(work))
        moved[-1].parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, moved[-1])
    remove_stale(moved)


def reference_row(rows: list[ModeRow]) -> ModeRow:
    """The row savings are measured against: the model as built when it was run, else the first."""
    return next((r for r in rows if r.mode == AS_BUILT), rows[0])
