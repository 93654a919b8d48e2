"""memplan: a static memory planner and allocator simulator for training Transformers.

The public API is in memplan/api.py and listed in `__all__`; it is loaded on first use, so that
`import memplan` (and the `memplan` command) does not import torch, OR-Tools and matplotlib until needed.
"""

from __future__ import annotations

__all__ = [
    "MODES",
    "CompareRow",
    "FitResult",
    "GPU",
    "GPUS",
    "Measurement",
    "MemplanError",
    "OptimizeResult",
    "Plan",
    "Recording",
    "StepChoice",
    "RunResult",
    "Trace",
    "TradeoffResult",
    "Verdict",
    "apply",
    "compare",
    "export_snapshot",
    "fit",
    "gpu",
    "import_snapshot",
    "load_choice",
    "load_plan",
    "load_trace",
    "optimize",
    "patch",
    "plot",
    "record",
    "run",
    "save_choice",
    "save_plan",
    "save_trace",
    "simulate",
    "solve",
    "trace_model_file",
    "tradeoff",
    "transformer_layers",
    "unpatch",
    "verify",
]


def __getattr__(name: str):
    """`memplan.NAME` for a name of the public API: import memplan.api on first use (PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    from memplan import api

    return getattr(api, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
