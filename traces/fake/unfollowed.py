"""What a checked program asks that fake tensors cannot run: `torch.compile` (compiled graphs need real tensors: the
model or function is returned unchanged and runs eager, each call named), C++/CUDA extensions built with
`torch.utils.cpp_extension.load`/`load_inline` (not built: named, an ImportError the script may catch) and ops with
no fake or meta kernel (named in one error)."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import UnsupportedOperatorException

from memplan.errors import MemplanError
from memplan.traces.on_import import on_import
from memplan.traces.patches import patched

_NO_FAKE_IMPL = re.compile(r"There was no fake impl registered for <CustomOpDef\((?P<op>[^)]+)\)>")


class ExtensionNotBuilt(MemplanError, ImportError):
    """A C++/CUDA extension a checked script builds: its kernels would need real tensors, so it is not built."""


class NoFakeKernel(MemplanError, NotImplementedError):
    """An op with no fake (meta) kernel: nothing says what it makes from fake tensors, so it cannot run."""

    def __init__(self, op: str):
        super().__init__(f"op {op} has no fake (meta) kernel, so it cannot run on fake tensors under memplan check "
                         "(give it one with torch.library.register_fake)")  # fmt: skip
        self.op = op


@dataclass
class Unfollowed:
    """What the program asked that was not followed: torch.compile calls run eager, extensions and ops not run."""

    compiled_eager: list[str] = field(default_factory=list)  # what torch.compile was given, by name, per call
    not_run: list[str] = field(default_factory=list)  # "extension NAME" for each load refused, in order


def no_fake_kernel(func, error: BaseException) -> NoFakeKernel | None:
    """The error to raise for op `func`'s dispatch on fake tensors failing with `error` for want of a fake or meta
    kernel; None when `error` is something else."""
    custom = _NO_FAKE_IMPL.search(str(error)) if isinstance(error, RuntimeError) else None
    if not isinstance(error, UnsupportedOperatorException) and custom is None:
        return None
    return NoFakeKernel(custom["op"] if custom else str(func.overloadpacket))


def _name(compiled: object) -> str:
    """What torch.compile was given, as a person names it: a module's class, a function's qualified name."""
    owner = getattr(compiled, "__self__", None)
    if isinstance(owner, nn.Module):  # Module.compile(): torch.compile of its bound _call_impl
        return type(owner).__name__
    if isinstance(compiled, nn.Module):
        return type(compiled).__name__
    return getattr(compiled, "__qualname__", None) or type(compiled).__name__


def _eager(record: Unfollowed) -> Callable:
    def compile(model=None, **options):
        if model is None:  # @torch.compile(mode=...): the decorator
            return lambda fn: compile(fn, **options)
        record.compiled_eager.append(_name(model))
        return model

    return compile


def _unbuilt(record: Unfollowed, how: str, original: Callable) -> Callable:
    def load(name, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == "memplan.cxx":  # memplan's own (the recorder's) are built
            return original(name, *args, **kwargs)
        record.not_run.append(f"extension {name}")
        raise ExtensionNotBuilt(f"extension {name} (torch.utils.cpp_extension.{how}) is not built under memplan check: "
                                "its kernels would need real tensors")  # fmt: skip

    return load


@contextlib.contextmanager
def not_followed(record: Unfollowed) -> Iterator[None]:
    """While a checked script runs: torch.compile returns what it is given (eager), and cpp_extension's load and
    load_inline (patched once the script imports it) raise ExtensionNotBuilt, each noted in `record`."""
    with patched((torch, "compile", _eager(record))) as patches:

        def unbuilt(module) -> None:
            for how in ("load", "load_inline"):
                patches.set(module, how, _unbuilt(record, how, getattr(module, how)))

        waiting = on_import("torch.utils.cpp_extension", unbuilt)
        try:
            yield
        finally:
            waiting.remove()
