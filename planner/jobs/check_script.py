"""How `memplan check` runs a user's command in this process: the script's argv and path as python gives them, a
launcher's command read for its script and ranks, a rank's environment and its process group (the fake one), the
hub offline, and the stop after K optimizer steps."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from memplan.errors import MemplanError
from memplan.traces.patches import patched

PYTHONS = ("python", "python3", Path(sys.executable).name)
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # HuggingFace's switches for its hub (the first is set here)


class CheckError(MemplanError):
    """A command `memplan check` cannot run: not a Python script, a script that fails on its own."""


class Stopped(BaseException):
    """Thrown from an optimizer's step when the program has run its steps: a BaseException, so the script's own
    `except Exception` does not catch it."""


@contextlib.contextmanager
def arguments(command: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """sys.argv and sys.path as the script would have them; yields ("path", script) or ("module", name)."""
    words = list(command)
    if Path(words[0]).name in PYTHONS:
        words = words[1:]
        while words and words[0] in ("-u", "-B", "-O"):
            words = words[1:]
    if not words:
        raise CheckError(f"{' '.join(command)}: no script to run")
    argv, path = sys.argv, list(sys.path)
    if words[0] == "-m":
        if len(words) < 2:
            raise CheckError(f"{' '.join(command)}: -m names no module")
        target = ("module", words[1])
        sys.argv = [words[1], *words[2:]]
        sys.path.insert(0, os.getcwd())
    else:
        script = Path(words[0])
        if script.suffix != ".py" or not script.is_file():
            raise CheckError(f"{words[0]}: not a Python script file; memplan check runs python SCRIPT.py ARGS")
        target = ("path", str(script))
        sys.argv = [str(script), *words[1:]]
        sys.path.insert(0, str(script.resolve().parent))
    try:
        yield target
    finally:
        sys.argv, sys.path[:] = argv, path


NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node", "--num_processes", "--num-processes")


def launched(command: tuple[str, ...]) -> tuple[tuple[str, ...], int | None]:
    """The script command a launcher runs and its number of ranks (`torchrun --nproc-per-node N SCRIPT ARGS`,
    `python -m torch.distributed.run ...`, `accelerate launch --num_processes N SCRIPT ARGS`); a command without a
    launcher is itself, with None."""
    words = list(command)
    if Path(words[0]).name in PYTHONS and words[1:3] == ["-m", "torch.distributed.run"]:
        words = ["torchrun", *words[3:]]
    if Path(words[0]).name == "accelerate" and words[1:2] == ["launch"]:
        words = ["accelerate", *words[2:]]
    if Path(words[0]).name not in ("torchrun", "accelerate"):
        return command, None
    nproc, rest = 1, words[1:]
    while rest and rest[0].startswith("-"):
        flag, _, value = rest.pop(0).partition("=")
        if flag in ("--standalone", "--no-python", "--multi_gpu", "--multi-gpu", "--no_python"):
            continue
        value = value or (rest.pop(0) if rest else "")
        if flag in NPROC_FLAGS:
            if not value.isdigit() or int(value) < 1:
                raise CheckError(f"{flag} {value!r}: a number of processes (memplan check runs them on the fake "
                                 "process group)")  # fmt: skip
            nproc = int(value)
        elif flag in ("--nnodes", "--num_machines", "--num-machines") and value not in ("1", "1:1"):
            raise CheckError(f"{flag} {value}: memplan check runs one node's ranks; give the ranks per node")
    if not rest:
        raise CheckError(f"{' '.join(command)}: the launcher names no script")
    return ("python", *rest), nproc


@contextlib.contextmanager
def rank_environment(rank: int, world: int) -> Iterator[None]:
    """The environment a launcher gives rank `rank` of `world`, each rank on its own node's one GPU (LOCAL_RANK 0:
    the fake GPU is device 0), and torch.distributed.init_process_group on the fake process group whatever backend the
    script asks for (collectives move nothing; what they hold is traced)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers the "fake" backend

    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    original = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("init_method", "store", "rank", "world_size")}
        return original("fake", store=FakeStore(), rank=rank, world_size=world, **kwargs)

    os.environ.update(env)
    try:
        with patched((dist, "init_process_group", init_process_group)):
            yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """HuggingFace's hub offline while the script runs, unless the user set HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE:
    a script that would download a model fails at once with the hub's own error, never waiting on a network (its local
    files and cache are read as usual). huggingface_hub reads the setting once, when imported: set there too."""
    if any(name in os.environ for name in OFFLINE):
        yield
        return
    os.environ[OFFLINE[0]] = "1"
    if (constants := sys.modules.get("huggingface_hub.constants")) is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        os.environ.pop(OFFLINE[0], None)
        if (constants := sys.modules.get("huggingface_hub.constants")) is not None:
            constants.HF_HUB_OFFLINE = False  # what it reads with neither set


@contextlib.contextmanager
def stop_after(steps: int, counter: list[int]) -> Iterator[None]:
    """Count optimizer steps as they return; stop the program after `steps`."""

    def stepped(_optimizer, _args, _kwargs):
        counter[0] += 1
        if counter[0] >= steps:
            raise Stopped

    handle = register_optimizer_step_post_hook(stepped)
    try:
        yield
    finally:
        handle.remove()
