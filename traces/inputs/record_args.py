"""`memplan.record`'s arguments checked as `memplan trace` checks the same options (its device, the GPU a fake CUDA
step is planned for, and how the two go together), each refusal one line of a MemplanError subclass."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from memplan.errors import MemplanError
from memplan.gpus import GPU, gpu
from memplan.limits import short_repr
from memplan.traces.inputs.model_file import DeviceError, require_device


class RecordError(MemplanError):
    """memplan.record was called with an argument it cannot take."""


def record_target(
    model: Any, device: Any, fake: Any, named_gpu: Any, output: Any = None, progress: Any = None, meta: Any = None
) -> tuple[torch.device, GPU | None]:
    """The device `record` captures on and the GPU it plans a fake CUDA step for, checked as the command line checks
    --device and --gpu: a device torch knows and memplan captures (cpu or cuda[:n]; a real CUDA step needs a GPU), a
    GPU of the catalogue (a name, or a GPU: an empty or unknown name is refused, not taken for the default). A GPU
    makes a step without a device a CUDA step, as `--gpu` implies `--device cuda`; with a CPU device (given, or the
    model's) it is refused: the two contradict each other, and `trace --device cpu --gpu` cannot tell a default
    --device from one given, while record can. The other arguments' types are checked too."""
    if not isinstance(fake, bool):
        raise RecordError(f"record: fake={short_repr(fake)}: True or False")
    if model is not None and not isinstance(model, nn.Module):
        raise RecordError(f"record: model is a {type(model).__name__}, not a torch.nn.Module")
    if output is not None and not isinstance(output, (str, os.PathLike)):
        raise RecordError(f"record: output={short_repr(output)}: a file's path, or None")
    if progress is not None and not callable(progress):
        raise RecordError(f"record: progress={short_repr(progress)}: a function of one string (print), or None")
    if meta is not None and not isinstance(meta, dict):
        raise RecordError(f"record: meta={short_repr(meta)}: a dict, or None")
    planned = named_gpu if named_gpu is None or isinstance(named_gpu, GPU) else gpu(named_gpu)
    if device is None:
        whose = "the model's"
        if model is not None:
            first = next(iter(model.parameters()), None)
            if first is None:
                raise RecordError("record: the model has no parameters to train")
            device = first.device
        else:
            device = "cpu" if planned is None else "cuda"
    else:
        whose = "given"
        if not isinstance(device, (str, torch.device)):
            raise DeviceError(f"--device {short_repr(device)}: a device's name (cpu or cuda[:n]) or a torch.device")
    checked = require_device(device, fake)
    if planned is not None and checked.type != "cuda":
        raise RecordError(
            f"record: gpu={planned.name!r} plans a CUDA step, but the device ({whose}) is {checked}: give "
            "device='cuda', or no gpu"
        )
    return checked, planned
