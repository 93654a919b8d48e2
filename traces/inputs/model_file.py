"""The model-file protocol of `memplan trace`: a Python file whose `build()` returns the workload.

A model file defines

    def build(batch_size: int, seq_len: int, dtype: torch.dtype, device: str):
        return {"model": nn.Module, "inputs": batch,          # required
                "loss": callable(output, inputs) -> scalar,    # optional, default: mean of the output
                "optimizer": Optimizer or callable(params),    # optional, default: AdamW(lr=1e-3)
                "name": str,                                   # optional, default: the file's name
                "holds_output": bool}                          # optional, default True: the step keeps its
                                                               # output and loss until it ends, as a loop does

or returns a `traces.inputs.workload.Workload` (its `name` left at the default is the file's name too). The
name is the workload's everywhere: the trace's meta "model" and replay's report. `inputs` is a tensor,
a tuple (passed positionally) or a dict (passed by keyword). memplan seeds torch with 0 before calling
build(), casts a dict's model to `dtype` and `device`, and applies the step's layer mode (planner.layers.patch) and
loss (planner.layers.patch_loss) before the optimizer is made, and then its optimizer choice
(planner.layers.choose_optimizer: the optimizer rebuilt with smaller state, when not as built).
Every breach of the protocol raises ModelFileError with one line naming what is wrong. The file is
imported with its own folder first on sys.path, so it can import its sibling modules (`_model_folder_on_path`).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memplan.errors import MemplanError, ModelFileError
from memplan.planner.layers.loss_patch import patch_loss
from memplan.planner.layers.optimizer_choice import choose_optimizer
from memplan.planner.layers.patch import patch
from memplan.step import StepSpec
from memplan.traces.fake.mode import module_to
from memplan.traces.inputs.hf_config import check_model_size, config_build, config_file
from memplan.traces.inputs.workload import Workload, default_loss

BUILD = "build"
BUILD_ARGS = ("batch_size", "seq_len", "dtype", "device")
DICT_KEYS = ("model", "inputs", "loss", "optimizer", "name", "holds_output")
DEFAULT_NAME = next(f.default for f in fields(Workload) if f.name == "name")  # a Workload built without a name


class DeviceError(MemplanError):
    """The requested device cannot be used on this machine."""


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _describe(exc: BaseException) -> str:
    message = _one_line(str(exc))
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def require_device(device: str, fake: bool = False) -> torch.device:
    """Check that `device` ('cpu' or 'cuda[:n]') is usable here; DeviceError otherwise. Fake tensors need
    no GPU: on a torch built without CUDA, traces/cuda/fake_device.py gives them a CUDA device."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"--device {device}: not a device name (use cpu or cuda)") from None
    if dev.type == "cuda" and not fake and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {device}: only cpu and cuda are supported")
    return dev


def _model_folder_on_path(path: Path) -> None:
    """Put the model file's folder first on sys.path, as `python model.py` would, so that it can import
    its sibling modules (`from mynet import Net`). It is inserted once and stays for the rest of the
    process: build() may import lazily, at call time, and a fake capture or another command of the same
    process imports the file again. It cannot shadow memplan: memplan's own modules are all under the
    `memplan.` namespace, so a `cli.py`, `traces.py` or `planner.py` beside the model file is never
    imported in their place. As with `python model.py`, a sibling module named like an installed one
    (and not yet imported) is found first, and a sibling already imported from another model file's
    folder (same name) is the one in sys.modules."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _import(path: Path) -> Any:
    if not path.is_file():
        raise ModelFileError(f"{path}: no such model file")
    name = f"memplan_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path}: cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(spec)
    _model_folder_on_path(path)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # the file is user code: any failure is reported in one line
        sys.modules.pop(name, None)
        raise ModelFileError(f"{path}: importing it raised {_describe(e)}") from None
    return module


def _build_function(path: Path, module: Any):
    build = getattr(module, BUILD, None)
    if build is None or not callable(build):
        raise ModelFileError(f"{path}: defines no function {BUILD}({', '.join(BUILD_ARGS)})")
    try:
        inspect.signature(build).bind(**{a: None for a in BUILD_ARGS})
    except TypeError:
        raise ModelFileError(f"{path}: {BUILD}() must accept the arguments {', '.join(BUILD_ARGS)}") from None
    except ValueError:
        pass  # no signature available (builtin): let the call decide
    return build


def _optimizer(path: Path, spec: Any, model: nn.Module) -> torch.optim.Optimizer:
    if spec is None:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if isinstance(spec, torch.optim.Optimizer):
        return spec
    if callable(spec):
        try:
            opt = spec(model.parameters())
        except (Exception, SystemExit) as e:
            raise ModelFileError(f"{path}: {BUILD}()['optimizer'](params) raised {_describe(e)}") from None
        if isinstance(opt, torch.optim.Optimizer):
            return opt
        raise ModelFileError(
            f"{path}: {BUILD}()['optimizer'](params) returned {type(opt).__name__}, not a torch.optim.Optimizer"
        )
    raise ModelFileError(
        f"{path}: {BUILD}()['optimizer'] is {type(spec).__name__}; expected a "
        "torch.optim.Optimizer or a callable taking the parameters"
    )


def _from_dict(path: Path, built: dict, dtype: torch.dtype, device: torch.device, step: StepSpec) -> Workload:
    for key in ("model", "inputs"):
        if key not in built:
            raise ModelFileError(f"{path}: {BUILD}() returned a dict without the key '{key}'")
    unknown = sorted(set(built) - set(DICT_KEYS))
    if unknown:
        raise ModelFileError(
            f"{path}: {BUILD}() returned an unknown key '{unknown[0]}' (allowed: {', '.join(DICT_KEYS)})"
        )
    model = built["model"]
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{path}: {BUILD}()['model'] is {type(model).__name__}, not a torch.nn.Module")
    loss = built.get("loss") or default_loss
    if not callable(loss):
        raise ModelFileError(f"{path}: {BUILD}()['loss'] is {type(loss).__name__}, not callable")
    module_to(model, device=device, dtype=dtype)
    report = patch(model, step.assignment).to_dict()
    loss_patch = patch_loss(model, step.loss, built.get("loss"))
    optimizer = _optimizer(path, built.get("optimizer"), model)
    name = str(built.get("name") or path.stem)
    holds = built.get("holds_output", True)
    if not isinstance(holds, bool):
        raise ModelFileError(f"{path}: {BUILD}()['holds_output'] is {type(holds).__name__}, not True or False")
    workload = Workload(model, built["inputs"], optimizer, loss, name, report, holds)
    workload.loss_patch = loss_patch
    return workload


def _check_placement(path: Path, workload: Workload, dtype: torch.dtype, device: torch.device) -> None:
    params = list(workload.model.parameters())
    if not params:
        raise ModelFileError(f"{path}: the model has no parameters")
    for name, p in workload.model.named_parameters():
        if p.device.type != device.type:
            raise ModelFileError(f"{path}: parameter {name} is on {p.device}, expected {device}")
        if p.is_floating_point() and p.dtype != dtype:
            raise ModelFileError(f"{path}: parameter {name} is {p.dtype}, expected {dtype}")


def import_model_file(path: str | os.PathLike) -> Callable[..., Any]:
    """Import a model file and return its build(). Run it before recording: what a module makes at import
    (constants, memplan's GELU tables) is not part of the step, and never fake."""
    path = Path(path)
    config = config_file(path)
    if config is not None:
        return config_build(config)
    return _build_function(path, _import(path))


def build_workload(step: StepSpec, build: Callable[..., Any]) -> Workload:
    """Call the step's model file's build() (imported by `import_model_file`) and return the Workload with the
    step's layer mode, loss and optimizer choice applied; under fake tensors when `step.fake` (a CUDA device then
    needs no GPU, but a CUDA build of torch)."""
    path, dtype = Path(step.model_file), getattr(torch, step.parameters_dtype)
    dev = require_device(step.device, step.fake)
    check_model_size(build, step.max_parameters)
    torch.manual_seed(0)
    try:
        built = build(batch_size=step.batch, seq_len=step.seq, dtype=dtype, device=str(dev))
    except MemplanError:
        raise
    except (Exception, SystemExit) as e:
        raise ModelFileError(f"{path}: {BUILD}() raised {_describe(e)}") from None
    if isinstance(built, Workload):
        if built.name == DEFAULT_NAME:  # the file gave no name: the file's, as for a dict
            built.name = path.stem
        built.patch = patch(built.model, step.assignment).to_dict()
        built.loss_patch = patch_loss(built.model, step.loss, built.loss_fn)
        workload = built
    elif isinstance(built, dict):
        workload = _from_dict(path, built, dtype, dev, step)
    else:
        raise ModelFileError(
            f"{path}: {BUILD}() returned {type(built).__name__}; expected a dict with "
            "'model' and 'inputs', or a traces.inputs.workload.Workload"
        )
    _check_placement(path, workload, dtype, dev)
    workload.optimizer, workload.optimizer_choice = choose_optimizer(workload.optimizer, step.optimizer)
    workload.autocast = getattr(torch, step.autocast) if step.autocast else None
    return workload


def load_workload(step: StepSpec) -> Workload:
    """Import the step's model file, call its build(), and return the Workload with the step's mode applied."""
    require_device(step.device, step.fake)
    return build_workload(step, import_model_file(step.model_file))
