"""Typed errors shared by every memplan stage; cli.py turns them into one-line messages."""


class MemplanError(Exception):
    """Base of every error caused by bad input; the message is one line, shown as is."""


class TraceError(MemplanError):
    """A trace file (or data meant to become one) is missing, unreadable or invalid."""


class SnapshotError(MemplanError):
    """A CUDA memory snapshot cannot be read safely or has an unexpected shape."""


class PlanError(MemplanError):
    """A plan is invalid, unreadable, or does not match its trace."""


class ModelFileError(MemplanError):
    """A model file for `memplan trace` breaks the model-file protocol."""


class PatchError(MemplanError):
    """A layer mode that does not exist, or a model that cannot be patched with the mode asked for."""


class CompileError(MemplanError):
    """A step cannot be compiled as asked (budget outside [0, 1], fake tensors, ...)."""
