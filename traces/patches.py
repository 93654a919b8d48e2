"""Attributes replaced for a while and put back: the one way memplan swaps a function of torch, or of a library the
program uses, for as long as a capture or a check runs; originals come back latest first, and a name the owner did
not have is removed again."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_ABSENT = object()  # what an owner without the name had


class Patches:
    """Replacements in force until `undo()`; each `set` remembers what it replaced."""

    def __init__(self) -> None:
        self._originals: list[tuple[object, str, object]] = []

    def set(self, owner: object, name: str, replacement: object) -> None:
        """Set `owner.name` to `replacement` until undo()."""
        self._originals.append((owner, name, getattr(owner, name, _ABSENT)))
        setattr(owner, name, replacement)

    def undo(self) -> None:
        """Put every original back, the latest first."""
        while self._originals:
            owner, name, original = self._originals.pop()
            if original is _ABSENT:
                if hasattr(owner, name):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def patched(*replacements: tuple[object, str, object]) -> Iterator[Patches]:
    """Each (owner, name, replacement) set while the block runs (more may be set on the Patches it yields), all put
    back when it ends."""
    patches = Patches()
    try:
        for owner, name, replacement in replacements:
            patches.set(owner, name, replacement)
        yield patches
    finally:
        patches.undo()
