"""Patches that do not depend on import order: `on_import(name, patch)` patches module `name` now if the program has
imported it, or else the moment it is imported, so a library the program imports inside a capture gets the same
treatment as one imported before it began.

The hook is a finder at the front of `sys.meta_path`, there only while some patch waits: for a waited-for name it
asks the finders after it for the module's spec and wraps the spec's loader, which runs the module's code as it
would, then the patches, before any importer sees the module. The module keeps its own loader (`__loader__`,
`__spec__.loader`). A module imported some other way (already in `sys.modules` under another name, built by a
finder without a loader) is not seen.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType

Patch = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    """A module's own loader, then the patches waiting for it."""

    def __init__(self, loader, finder: _Finder, name: str):
        self._loader, self._finder, self._name = loader, finder, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._finder.imported(self._name, module)

    def __getattr__(self, name):  # the rest of the loader's protocol (is_package, get_resource_reader, ...)
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """The finder at the front of sys.meta_path while some patch waits for its module."""

    def __init__(self):
        self.waiting: dict[str, list[Patch]] = {}
        self.lock = threading.RLock()

    def find_spec(self, name, path, target=None):
        with self.lock:
            if not self.waiting.get(name):
                return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self, name)
        return spec

    def imported(self, name: str, module: ModuleType) -> None:
        """Run the patches waiting for `name`, just imported."""
        with self.lock:
            patches = list(self.waiting.get(name, ()))
        for patch in patches:
            patch(module)


_FINDER = _Finder()


class Waiting:
    """A patch waiting for its module's import (`on_import`); `remove()` stops the wait."""

    def __init__(self, name: str, patch: Patch):
        self.name, self.patch = name, patch

    def remove(self) -> None:
        """Stop waiting; the finder leaves sys.meta_path with the last patch that waited."""
        with _FINDER.lock:
            patches = _FINDER.waiting.get(self.name, [])
            if self.patch in patches:
                patches.remove(self.patch)
            if not patches:
                _FINDER.waiting.pop(self.name, None)
            if not _FINDER.waiting and _FINDER in sys.meta_path:
                sys.meta_path.remove(_FINDER)


def on_import(name: str, patch: Patch) -> Waiting:
    """Call `patch(module)` for the module `name`: now if it is imported, else the first time it is imported until
    the returned wait is removed (each import of it then: a module imported again after being dropped from
    sys.modules is patched again)."""
    waiting = Waiting(name, patch)
    with _FINDER.lock:
        _FINDER.waiting.setdefault(name, []).append(patch)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    return waiting


@contextlib.contextmanager
def patched_on_import(name: str, patch: Patch) -> Iterator[None]:
    """`on_import(name, patch)` for the block."""
    waiting = on_import(name, patch)
    try:
        yield
    finally:
        waiting.remove()
