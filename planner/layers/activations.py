"""Which invertible activation a module computes (SiLU, or GELU in its erf or tanh form), and the in-place layer
that replaces it: recognised by what the module computes, proven by a probe, not by its class name.

An activation module has no parameters, buffers or children; its output on a probe input spanning both
branches, the minimum and the tails, in fp32, bf16 and fp16, must equal torch's own activation within ULPS
units in the last place: the same function, rounded its own way (HuggingFace's `GELUActivation`, `GELUTanh`,
`NewGELUActivation` (GPT-2's formula), `SiLUActivation`, nn.GELU, nn.SiLU pass; `QuickGELUActivation`,
`ClippedGELUActivation` and ReLU², other functions, do not). The in-place layer then computes torch's.
"""

from __future__ import annotations

import torch
from torch import nn

from memplan.planner.layers import inverse, probe
from memplan.planner.layers.gelu import GELU, InplaceGELU
from memplan.planner.layers.silu import SILU, InplaceSiLU

INVERTIBLE = (SILU, GELU["none"], GELU["tanh"])
PROBE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ULPS = 4.0  # how far, in units in the last place, an activation may round otherwise than torch's
PROBE_VALUES = torch.cat([torch.linspace(-12.0, 12.0, 241), torch.tensor([-100.0, -30.0, 30.0, 100.0, 0.0])])


def activation_of(module: nn.Module) -> inverse.Activation | None:
    """The invertible activation `module` computes, or None."""
    if isinstance(module, InplaceSiLU):
        return SILU
    if isinstance(module, InplaceGELU):
        return GELU[module.approximate]
    if next(module.children(), None) is not None or module._parameters or module._buffers:
        return None
    if not probe.takes_one_input(module):
        return None
    with probe.isolated():
        for activation in INVERTIBLE:
            if all(
                probe.agree(
                    lambda x=x: module.forward(x.clone()), lambda x=x, f=activation.function: f(x.clone()), ULPS
                )
                for x in (PROBE_VALUES.to(dtype) for dtype in PROBE_DTYPES)
            ):
                return activation
    return None


def inplace(activation: inverse.Activation) -> nn.Module:
    """memplan's in-place layer for `activation` (one of INVERTIBLE)."""
    if activation is SILU:
        return InplaceSiLU()
    form = next(form for form, gelu in GELU.items() if gelu is activation)
    return InplaceGELU(form)
