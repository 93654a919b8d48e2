"""Run a function on N processes with torch.distributed, and `memplan trace --nproc N`: one trace per rank.

`launch` starts the ranks with torch.distributed's own launcher (the elastic launcher behind torchrun, on
this machine only: c10d rendezvous on localhost, workers forked from multiprocessing's forkserver, which imported
torch and the tracer once (`forkserver`), no restarts), so every rank sees the
environment torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); each joins one
process group (gloo on the CPU, NCCL on CUDA) and leaves a JSON result in a private temporary folder.
When a rank fails, the launcher stops the others and RankError carries the first failing rank's one-line
error. `trace_ranks` writes FILE.rank{r}.json.gz for every rank, all or none: the ranks write into the
temporary folder and the files are renamed into place only when every rank succeeded. On the fake process group,
ranks alike by construction (traces/ranks/alike.py) are traced once: one file a class, named by its first rank, whose
meta "ranks" lists every rank it stands for (traces/ranks/family.py reads them back).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from memplan.errors import MemplanError
from memplan.files import atomic_write
from memplan.step import StepSpec
from memplan.traces.format import load, save
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.ranks.alike import Layout, propose, same_step, watching
from memplan.traces.ranks.family import rank_path, remove_stale
from memplan.traces.summary import summarize

TIMEOUT_S = 300  # a collective waiting longer than this fails the rank
# The environment this module was imported under. The launcher forks each rank from a forkserver that imported this
# module (torch, the tracer) once, when it started: in a rank, this is that server's environment (`take_environment`).
_IMPORT_ENVIRONMENT = dict(os.environ)


class RankError(MemplanError):
    """A rank of a multi-process run failed; the message is that rank's own one-line error."""


def one_line(exc: BaseException) -> str:
    """The error as one line: memplan's own messages as they are, others prefixed by their type."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if isinstance(exc, MemplanError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def forkserver() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver, its server preloaded with this module (torch and the tracer): a process started
    from it begins with them imported, where a spawned one spends seconds of CPU importing them again. The server
    starts with this process's first such process and serves every later one."""
    multiprocessing.set_forkserver_preload([__name__])  # no effect once the server runs: it already has them
    return multiprocessing.get_context("forkserver")


def take_environment(launching: dict[str, str]) -> None:
    """In a process forked from the forkserver, which inherited the server's environment from when the server
    started: take the launching process's environment of now (the MEMPLAN_* settings model files read), with what a
    launcher set for this process (RANK, MASTER_PORT, ...: what differs from the environment this module was imported
    under, the server's)."""
    launcher = {k: v for k, v in os.environ.items() if _IMPORT_ENVIRONMENT.get(k) != v}
    os.environ.clear()
    os.environ.update(launching)
    os.environ.update(launcher)


def _rank_main(fn: Callable, args: tuple, device: str, workdir: str, environment: dict[str, str]) -> None:
    """One process: join the group, run fn(workdir, *args), leave its result or its error in workdir."""
    take_environment(environment)
    work = Path(workdir)
    rank = int(os.environ.get("RANK", "0"))
    try:
        nproc = int(os.environ["WORLD_SIZE"])
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=TIMEOUT_S))
        torch.manual_seed(0)  # the same stream on every rank: replicated dropouts stay replicated
        result = fn(work, *args)
        atomic_write(work / f"result{rank}.json", json.dumps(result))
        dist.destroy_process_group()
    except BaseException as e:  # the rank's error goes to the parent as one line, never as a traceback
        atomic_write(work / f"error{rank}.json", json.dumps({"time": time.time(), "message": one_line(e)}))
        raise SystemExit(1) from None


def _first_error(work: Path, exitcodes: dict[int, int | None]) -> str:
    errors = []
    for path in work.glob("error*.json"):
        info = json.loads(path.read_text())
        errors.append((info["time"], int(path.stem[len("error") :]), info["message"]))
    if errors:
        _, rank, message = min(errors)
        return f"rank {rank}: {message}"
    failed = {r: c for r, c in exitcodes.items() if c not in (0, None)}
    rank = min(failed) if failed else 0
    return f"rank {rank}: exited with code {failed.get(rank)} without an error message"


def launch(
    fn: Callable,
    args: tuple = (),
    nproc: int = 2,
    device: str = "cpu",
    tmp_parent: str | os.PathLike | None = None,
    keep: Callable[[Path], None] | None = None,
    fake: bool = False,
) -> list[Any]:
    """Run fn(workdir, *args) on `nproc` ranks of one process group and return their JSON results in
    rank order. `keep(workdir)` runs in this process after every rank succeeded, before the private
    folder is removed (to move files out of it). RankError when any rank fails. With `fake`, the ranks
    run in turn in this process on the fake process group (`_fake_ranks`)."""
    with _workdir(tmp_parent) as work:
        results = _run_ranks(fn, args, nproc, device, fake, work)
        if keep is not None:
            keep(work)
        return results


def _run_ranks(fn: Callable, args: tuple, nproc: int, device: str, fake: bool, work: Path) -> list[Any]:
    """fn(work, *args) on every rank, fake (in turn, in this process) or spawned; their results in rank order."""
    if nproc < 1:
        raise RankError(f"--nproc {nproc}: need at least one process")
    if device == "cuda" and not fake and torch.cuda.device_count() < nproc:
        raise RankError(f"--nproc {nproc}: only {torch.cuda.device_count()} CUDA devices on this machine")
    return _fake_ranks(fn, args, nproc, work) if fake else _spawned_ranks(fn, args, nproc, device, work)


@contextlib.contextmanager
def _workdir(parent: str | os.PathLike | None) -> Iterator[Path]:
    """A private temporary folder for the ranks' files, removed afterwards whatever happens."""
    work = Path(tempfile.mkdtemp(prefix=".memplan-ranks-", dir=parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _launcher_quiet() -> Iterator[None]:
    """The launcher logs every start and, after a failure, each rank's traceback; RankError says it all."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _trace_rank(work: Path, step: StepSpec, top: int) -> dict:
    """One rank of `memplan trace --nproc`: build the workload, capture its step, save, summarise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # a real rank has its own GPU; fake ranks run in turn in one process whose (fake) device is cuda:0
    device = f"cuda:{rank}" if step.device == "cuda" and not step.fake else step.device
    meta = {"rank": rank, "ranks": [rank], "world_size": world, "backend": dist.get_backend()}
    trace = trace_step(step.replace(device=device), meta=meta)
    save(trace, work / f"rank{rank}.json.gz")
    return summarize(trace, top=top).to_dict()


def _spawned_ranks(fn: Callable, args: tuple, nproc: int, device: str, work: Path) -> list[Any]:
    """Run fn(work, *args) on `nproc` processes started by torch.distributed's elastic launcher. Each is forked from
    multiprocessing's forkserver, a fresh process that imported this module (torch and the tracer) once, when this
    process first launched ranks (`forkserver`): a spawned rank spent seconds importing them, every rank of every
    launch."""
    forkserver()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"memplan-{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    with _launcher_quiet():
        try:
            elastic_launch(config, _rank_main)(fn, args, device, str(work), dict(os.environ))
        except ChildFailedError as e:
            codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
            raise RankError(_first_error(work, codes)) from None
    return [json.loads((work / f"result{r}.json").read_text()) for r in range(nproc)]


def _fake_rank(fn: Callable, args: tuple, rank: int, nproc: int, work: Path) -> Any:
    """Run fn(work, *args) as `rank` of `nproc`, alone in torch.distributed's fake process group in this process:
    collectives return at once and move nothing, so a rank needs no other process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=nproc)
    try:
        torch.manual_seed(0)  # as the launcher seeds each real rank
        return fn(work, *args)
    except Exception as e:  # as from the launcher: the failing rank's error in one line
        raise RankError(f"rank {rank}: {one_line(e)}") from None
    finally:
        dist.destroy_process_group()


def _fake_ranks(fn: Callable, args: tuple, nproc: int, work: Path) -> list[Any]:
    """Run fn(work, *args) for each rank in turn in this process, each on the fake process group (`_fake_rank`)."""
    return [_fake_rank(fn, args, rank, nproc, work) for rank in range(nproc)]


def _alike_ranks(step: StepSpec, top: int, nproc: int, work: Path) -> list[tuple[list[int], dict]]:
    """Trace the fake ranks once a class of ranks alike by construction (traces/ranks/alike.py): the first rank watched
    while its program builds, the classes proposed from what it built, each class traced by its first rank and
    checked by its last; a class whose two traces differ has every rank traced. Returns (the ranks it stands for,
    summary) per distinct trace, by representative rank; work holds rank{r}.json.gz for each, meta "ranks" set."""
    summaries = {}
    layout = Layout(rank=0, world=nproc)
    with watching(layout):
        summaries[0] = _fake_rank(_trace_rank, (step, top), 0, nproc, work)
    distinct = []
    for members in propose(layout):
        first, witness = members[0], members[-1]
        for r in (first, witness):
            if r not in summaries:
                summaries[r] = _fake_rank(_trace_rank, (step, top), r, nproc, work)
        if first == witness:
            distinct.append(([first], summaries[first]))
            continue
        trace = load(work / f"rank{first}.json.gz")
        if same_step(trace, load(work / f"rank{witness}.json.gz")):
            (work / f"rank{witness}.json.gz").unlink()
            trace.meta["ranks"] = members
            save(trace, work / f"rank{first}.json.gz")
            distinct.append((members, summaries[first]))
            continue
        for r in members:  # not alike: every rank traced, each standing for itself
            if r not in summaries:
                summaries[r] = _fake_rank(_trace_rank, (step, top), r, nproc, work)
            distinct.append(([r], summaries[r]))
    return sorted(distinct)


def trace_ranks(
    step: StepSpec, output: str | os.PathLike, nproc: int, *, top: int = 5, alike: bool = True
) -> list[tuple[Path, list[int], dict]]:
    """Trace one training step on each of `nproc` ranks; returns (file, the ranks it stands for, summary) per
    distinct trace. The files FILE.rank{r}.json.gz appear only when every rank succeeded (RankError otherwise). On
    fake tensors, the ranks run one after another in this process, on the fake process group, and with `alike` the
    ranks alike by construction are traced once (`_alike_ranks`): one file each class, named by its first rank, its
    meta "ranks" every rank it stands for. Real processes write one file a rank, meta "ranks" [r]."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with _workdir(output.parent) as work:
        if step.fake and alike and nproc > 1:
            distinct = _alike_ranks(step, top, nproc, work)
        else:
            summaries = _run_ranks(_trace_rank, (step, top), nproc, step.device, step.fake, work)
            distinct = [([r], summary) for r, summary in enumerate(summaries)]
        moved = []
        try:
            for ranks, _ in distinct:
                moved.append(rank_path(output, ranks[0]))
                os.replace(work / f"rank{ranks[0]}.json.gz", moved[-1])
        except OSError as e:
            for path in moved:
                path.unlink(missing_ok=True)
            raise RankError(f"{output}: cannot write the rank traces ({e.strerror or e})") from None
        remove_stale(moved)
    return [(rank_path(output, ranks[0]), ranks, summary) for ranks, summary in distinct]
