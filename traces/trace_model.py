"""Trace one training step of a model file: the one function behind `memplan trace`, `run`, `fit` and
`replay`, so every command records a model file the same way."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from traces.capture import capture_step
from traces.format import Trace
from traces.model_file import build_workload, import_model_file, require_device


def trace_model_file(path: str | os.PathLike, *, batch: int, seq: int, dtype: str | torch.dtype = "float32",
                     device: str = "cpu", layers: str = "baseline", fake: bool = False, warmup: bool = True,
                     meta: dict | None = None) -> Trace:
    """Build `path`'s workload (batch, seq, dtype, device, layer mode) and record one training step; with
    `fake`, under fake tensors (nothing allocated or computed, any size, also a CUDA device on a CPU)."""
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    require_device(device, fake)
    build_function = import_model_file(path)  # before recording: import-time tensors are not the step's

    def build():
        return build_workload(path, build_function, batch=batch, seq=seq, dtype=torch_dtype, device=device,
                              layers=layers, fake=fake)

    info = {"model": Path(path).stem, "layers": layers, "batch": batch, "seq": seq,
            "dtype": str(torch_dtype).replace("torch.", ""), "model_file": str(path)}
    return capture_step(build, device, fake=fake, warmup=warmup, meta={**info, **(meta or {})})
