"""`memplan check -- python train.py ARGS`: the user's own script, unmodified, run on a fake GPU for its first steps.

The script runs in this process (check_script.py: its argv, a launcher's ranks, the hub offline) with CUDA as
memplan's fake device of a GPU (traces/cuda/fake_device.py): CUDA tensors are fake, so nothing is computed there and
any size runs, while CPU work is real (traces/fake/real_cpu.py) and checkpoints are read by shape
(traces/fake/checkpoints.py). It is recorded from its first allocation as a whole program (traces/program.py).
PyTorch's caching allocator is simulated live at the GPU's memory less what lies outside it
(planner/simulate/live.py): `torch.cuda`'s memory statistics answer from it, and a request it cannot serve raises
`torch.OutOfMemoryError` in the script with PyTorch's message, so the script's own handling (a retry with a smaller
batch) runs as it would there. After `steps` optimizer steps the script is stopped, and the answer is whether the
program ran: fits with its headroom, or the out-of-memory error it did not catch, at its op, module, phase and step.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from memplan.errors import MemplanError
from memplan.gpus import GPU
from memplan.planner.jobs.check_script import (
    CheckError,
    Stopped,
    arguments,
    hub_offline,
    launched,
    rank_environment,
    stop_after,
)
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.live import LiveDevice
from memplan.planner.simulate.verdict import Budget, outside_terms
from memplan.traces.capture import recording_session
from memplan.traces.fake.real_cpu import DEFAULT_LIMIT, REAL_CPU_RULE, RealCpu
from memplan.traces.fake.unfollowed import ExtensionNotBuilt, NoFakeKernel, Unfollowed, not_followed
from memplan.traces.format import PHASES, Program, load, save
from memplan.traces.process_state import as_own_process
from memplan.traces.program import step_view
from memplan.traces.ranks.launch import forkserver, take_environment
from memplan.traces.ranks.spawned import spawned_here


@dataclass(frozen=True)
class CheckOptions:
    """What to check: the command, the GPU (its outside bytes given or known), the steps, the allocator's settings."""

    command: tuple[str, ...]  # `python train.py ARGS`, `train.py ARGS` or `python -m module ARGS`
    gpu: GPU
    steps: int = 3  # optimizer steps the program runs before it is stopped
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF simulated
    torch_version: str | None = None  # the torch whose rules the fake GPU follows (None: the installed one)
    nproc: int | None = None  # ranks of a distributed script that starts its own (torchrun's are read from its command)
    rank: tuple[int, int] | None = None  # (rank, world): run this one rank in this process (how ranks are started)
    cpu_limit: int = DEFAULT_LIMIT  # bytes: a real CPU tensor larger than this is fake (traces/fake/real_cpu.py)
    html: bool = False  # ranks run in processes of their own render the page there (check_page.py)

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise CheckError(f"--steps {self.steps!r}: a whole number of at least 1")
        if not self.command:
            raise CheckError("give the command to check after --: memplan check -- python train.py ARGS")
        if isinstance(self.cpu_limit, bool) or not isinstance(self.cpu_limit, int) or self.cpu_limit < 0:
            raise CheckError(f"--cpu-limit {self.cpu_limit!r}: a number of bytes")


@dataclass(frozen=True)
class Failure:
    """An out-of-memory error the simulated GPU raised in the program."""

    size: int  # bytes requested
    op: str
    module: str
    phase: str
    where: str  # construction, step 2, ... (steps counted at the optimizer's step)
    time: int  # the program's logical time of the request
    allocated: int
    reserved: int
    message: str  # PyTorch's error
    caught: bool  # the program went on after it


@dataclass
class CheckResult:
    """What the program did on the fake GPU, and the answer."""

    command: tuple[str, ...]
    gpu: str
    memory: int
    alloc_conf: str
    budget: dict  # the GPU's memory, the outside terms with their sources, the allocator's capacity
    steps_run: int  # optimizer steps the program ran
    steps_asked: int
    finished: str  # "stopped" (ran its steps), "exited" (ended by itself), "out of memory" (an error it did not catch)
    peak_allocated: int  # over the whole program, on the simulated allocator
    peak_reserved: int
    failures: list[Failure] = field(default_factory=list)  # every error raised, in order
    data_dependent: dict[str, int] = field(default_factory=dict)  # values nobody knew, read by DATA_RULE
    branches: list[dict] = field(default_factory=list)  # {"where": file:line, "times": n}: the code branched on one
    cpu: dict = field(default_factory=dict)  # real CPU work (REAL_CPU_RULE): the limit, ops run, tensors made fake
    seconds: float = 0.0
    program: Program | None = None  # the whole program as a trace (not in the JSON: save it with -o)
    world_size: int | None = None  # ranks of a distributed program (the fake process group), None for one process
    rank: int | None = None  # the rank this answer is (the tightest of those run)
    ranks_run: list[int] = field(default_factory=list)  # the ranks run, each a program of its own
    alike: bool | None = None  # the first and last ranks ran the same program (so the rest are taken as alike)
    compiled_eager: list[str] = field(default_factory=list)  # what torch.compile was given, run eager instead
    not_run: list[str] = field(default_factory=list)  # extensions not built, ops with no fake kernel ("op NAME")
    series: tuple | None = None  # (allocated, reserved) at each logical time of the program, as it ran (not in JSON)
    page: str | None = None  # the HTML page a rank's own process rendered (not in JSON)

    @property
    def fits(self) -> bool:
        """Whether the program ran on the GPU: no out-of-memory error it did not catch."""
        return self.finished != "out of memory"

    @property
    def headroom(self) -> int:
        """The GPU's memory less the program's peak reserved and the outside bytes (negative: what is missing)."""
        return self.memory - self.peak_reserved - self.budget["outside_bytes"]

    def to_dict(self) -> dict:
        """The JSON document of `memplan check --json` (keys in docs/cli.md)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("program", "series", "page")}
        out["ranks"] = out.pop("ranks_run")
        return {**out, "command": list(self.command), "fits": self.fits, "headroom": self.headroom}


def save_program(result: CheckResult, path: str | os.PathLike) -> None:
    """Write the program as a trace file: its last step the program ran whole as the trace, the whole program with it
    (CheckError when it ran no step)."""
    program = result.program
    if program is None or not program.steps:
        raise CheckError(f"{os.fspath(path)}: the program ran no training step, so no trace is written")
    save(step_view(program, len(program.steps) - 1), path)


def _budget(options: CheckOptions, meta: dict) -> Budget:
    """The GPU's budget for a fake CUDA program whose capture holds the cuBLAS workspaces (meta)."""
    return Budget(options.gpu, outside_terms(options.gpu, meta, lt=False))


def check_program(options: CheckOptions) -> CheckResult:
    """Run the command's script on the fake GPU for `options.steps` optimizer steps, the caching allocator simulated
    live; what it did and whether it fits. A distributed script (a launcher's command, or `nproc`) runs its first
    and last ranks on the fake process group, each a program of its own; when they ran the same program the ranks
    between are taken as alike, else every rank runs. The answer is the tightest rank's."""
    started = time.perf_counter()
    command, world = launched(options.command)
    if options.rank is not None:
        world = options.rank[1]
    elif options.nproc is not None:
        if world is not None and world != options.nproc:
            raise CheckError(f"--nproc {options.nproc}: the launcher starts {world} processes")
        world = options.nproc
    if world is None or options.rank is not None:
        rank, world = options.rank or (None, None)
        result = _run(options, command, rank, world)
        result.seconds = time.perf_counter() - started
        return result
    # each rank in a process of its own, as a launcher starts them: what one rank's script leaves in its process
    # (a seed, a global, an imported module's state) is not the next rank's
    with tempfile.TemporaryDirectory(prefix=".memplan-check-") as folder:
        results = {rank: _spawn(options, rank, world, Path(folder)) for rank in dict.fromkeys((0, world - 1))}
        alike = _same_program(results[0], results[world - 1])
        if not alike:
            results.update({rank: _spawn(options, rank, world, Path(folder)) for rank in range(1, world - 1)})
    tightest = min(results.values(), key=lambda r: (r.fits, -r.peak_reserved))
    tightest.ranks_run, tightest.alike, tightest.seconds = sorted(results), alike, time.perf_counter() - started
    return tightest


def _spawn(options: CheckOptions, rank: int, world: int, folder: Path) -> CheckResult:
    """Rank `rank` of `world` checked by `memplan check --rank` in a process of its own; its answer and program."""
    return checked_apart(options, folder, f"rank{rank}", ["--rank", f"{rank}/{world}"], f"rank {rank} of {world}: ")


def checked_apart(options: CheckOptions, folder: Path, tag: str, extra: list[str] = (), said: str = "",
                  command: tuple[str, ...] | None = None) -> CheckResult:  # fmt: skip
    """`command` (the options' by default) checked by `memplan check EXTRA` in a process of its own, its files named
    `tag` in `folder`; its answer, program and page. Its error is a CheckError prefixed with `said`."""
    output, page, answer = folder / f"{tag}.json.gz", folder / f"{tag}.html", folder / f"{tag}.json"
    child = ["check", "--gpu", options.gpu.name, "--steps", str(options.steps), "--alloc-conf", options.alloc_conf,
             *extra, "--cpu-limit", str(options.cpu_limit), "--json", "-o", str(output)]  # fmt: skip
    child += ["--outside", str(options.gpu.outside)] if options.gpu.outside is not None else []
    child += ["--torch", options.torch_version] if options.torch_version else []
    child += ["--html", str(page)] if options.html else []
    context = forkserver()
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_check_process, args=([*child, "--", *(command or options.command)],
                                                           dict(os.environ), str(answer), writer))  # fmt: skip
    process.start()
    writer.close()
    with reader, open(reader.fileno(), closefd=False) as stderr:
        errors = _relay(stderr)
    process.join()
    code = process.exitcode
    if code not in (0, 3):
        raise CheckError(said + (errors[-1] if errors else f"memplan check failed (exit code {code})"))
    data = json.loads(answer.read_text())
    failures = [Failure(**f) for f in data.pop("failures")]
    known = {f.name for f in fields(CheckResult)}
    values = {k: v for k, v in data.items() if k in known}
    values.update(command=tuple(data["command"]), failures=failures, ranks_run=data["ranks"])
    result = CheckResult(**values)
    result.program = load(output).program if output.exists() else None
    result.page = page.read_text(encoding="utf-8") if page.exists() else None
    return result


def _check_process(argv: list[str], environment: dict[str, str], answer: str, stderr: Connection) -> None:
    """`python -m memplan.cli ARGV` in a process of its own, forked from the forkserver (torch and the tracer imported
    there once, where a new interpreter imported them again for each rank): the launching process's environment, the
    standard output into `answer`, the standard error into the pipe the launching process relays."""
    take_environment(environment)
    out = os.open(answer, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(stderr.fileno(), 2)
    os.close(out)
    stderr.close()
    sys.argv = ["memplan", *argv]  # run_module puts the module's path first, as `python -m` does
    runpy.run_module("memplan.cli", run_name="__main__", alter_sys=True)


def _relay(stream) -> list[str]:
    """A checking process's stderr (a rank's, a value's of --largest) passed on as it comes (the script's output), but
    for its `Error:` lines: those are returned, so its error is said once, as the check's own."""
    errors = []
    for line in stream:
        if line.startswith("Error: "):
            errors.append(line.removeprefix("Error: ").rstrip("\n"))
        else:
            sys.stderr.write(line)
    return errors


def _same_program(a: CheckResult, b: CheckResult) -> bool:
    """Whether two ranks ran the same program: the same allocations and frees, in order."""
    if a.program is None or b.program is None:
        return a is b
    x, y = a.program.trace, b.program.trace
    return len(x) == len(y) and bool(
        (x.size == y.size).all() and (x.alloc == y.alloc).all() and (x.free == y.free).all()
    )


def _run(options: CheckOptions, command: tuple[str, ...], rank: int | None, world: int | None) -> CheckResult:
    """One process of the program (rank `rank` of `world` on the fake process group, or the only one)."""
    conf = parse_alloc_conf(options.alloc_conf)
    counter, finished, escaped, unfollowed = [0], "exited", None, Unfollowed()
    live: LiveDevice | None = None
    # 1. The budget: a fake CUDA capture allocates the cuBLAS workspaces itself; what lies outside is the GPU's
    # (with NCCL's buffers for a rank).
    with arguments(command) as (kind, target), rank_environment(rank, world) if world else contextlib.nullcontext():
        meta = {"device": "cuda", "fake": True, "cublas_workspace": 1, "cublaslt_workspace": 1,
                "torch_rules": options.torch_version, **({"world_size": world} if world else {})}  # fmt: skip
        budget = _budget(options, meta)
        live = LiveDevice(options.gpu.memory, budget.outside_bytes, conf)
        # 2. The script, run as __main__ on the fake GPU with the live allocator, until it has run its steps.
        session_meta = {"source": "memplan check", "command": list(options.command)}
        session_meta.update({"rank": rank, "world_size": world} if world else {})
        real_cpu = RealCpu(options.cpu_limit)
        with recording_session("cuda", fake=True, gpu=options.gpu, torch_version=options.torch_version,
                               memory=live, meta=session_meta, watch=True, real_cpu=real_cpu) as session:  # fmt: skip
            with (
                stop_after(options.steps, counter),
                hub_offline(),
                spawned_here(world),
                not_followed(unfollowed),
                as_own_process(),
            ):
                try:
                    if kind == "path":
                        runpy.run_path(target, run_name="__main__")
                    else:
                        runpy.run_module(target, run_name="__main__", alter_sys=True)
                except Stopped:
                    finished = "stopped"
                except torch.OutOfMemoryError as e:
                    finished, escaped = "out of memory", e
                except SystemExit as e:
                    if e.code not in (None, 0):
                        raise CheckError(f"{target}: the script exited with status {e.code}") from None
                except (ExtensionNotBuilt, NoFakeKernel) as e:  # named, not run
                    raise CheckError(f"{target}: {e}") from None
                except MemplanError:
                    raise
                except Exception as e:  # the script's own error, in one line
                    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
                    raise CheckError(f"{target}: {type(e).__name__}" + (f": {first}" if first else "")) from None
    if finished == "exited" and counter[0] == 0:
        raise CheckError(f"{target}: ended without an optimizer step, so no training step ran to judge (a script "
                         "that trains calls a torch.optim optimizer's step())")  # fmt: skip
    # 3. The answer: each error raised, where in the program; the program itself.
    program, names = session.program, session.names()
    failures = [
        Failure(oom.size, names[oom.op], names[oom.module], PHASES[oom.phase], program.where(oom.event), oom.event,
                oom.allocated, oom.reserved, oom.message, caught=escaped is None or k < len(live.raised) - 1)
        for k, oom in enumerate(live.raised)
    ]  # fmt: skip
    return CheckResult(
        command=options.command,
        gpu=options.gpu.name,
        memory=options.gpu.memory,
        alloc_conf=options.alloc_conf,
        budget=budget.as_dict(),
        steps_run=counter[0],
        steps_asked=options.steps,
        finished=finished,
        peak_allocated=live.peak_allocated,
        peak_reserved=live.peak_reserved,
        failures=failures,
        data_dependent=session.data_dependent(),
        branches=[{"where": w, "times": n} for w, n in sorted(session.branches().items())],
        cpu={**real_cpu.summary(), "rule": REAL_CPU_RULE},
        program=program,
        series=live.series(program.trace.end),
        world_size=world,
        rank=rank,
        ranks_run=[] if rank is None else [rank],
        compiled_eager=unfollowed.compiled_eager,
        not_run=list(dict.fromkeys(unfollowed.not_run)) + [f"op {op}" for op in session.not_run()],
    )
