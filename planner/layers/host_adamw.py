"""An optimizer whose state and step live on the host (CPU offload, as DeepSpeed's ZeRO-Offload and torchao's
CPUOffloadOptimizer do): the device holds the parameters and their gradients only.

The host holds, per parameter, an fp32 master copy (made when the optimizer is), an fp32 gradient buffer and the
inner optimizer's state (AdamW's two fp32 moments and its step counter), the last three made at the first step as
an optimizer's state is. A step copies each gradient to the host, steps the inner optimizer (the model file's own
class, AdamW or Adam, with its groups' hyperparameters) on the master copies in fp32, and copies them back into the
device's parameters in their dtype. Host buffers are pinned on a real CUDA device, so that the copies can overlap.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

HOST = "cpu"
FP32_BYTES = 4


def _host_buffer(p: Tensor) -> Tensor:
    """An empty fp32 host tensor shaped as `p`, pinned when `p` is on a real CUDA device."""
    pin = p.is_cuda and not isinstance(p, FakeTensor)
    return torch.empty(p.shape, dtype=torch.float32, device=HOST, pin_memory=pin)


class HostAdamW(torch.optim.Optimizer):
    """`inner` (torch.optim.AdamW or Adam) stepped on the host over fp32 master copies of `params` (module
    docstring); each group's hyperparameters are the inner optimizer's, read again at every step."""

    def __init__(self, params, inner: type[torch.optim.Optimizer] = torch.optim.AdamW, **defaults) -> None:
        super().__init__(params, defaults)
        host_groups = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                master = _host_buffer(p)
                master.copy_(p.detach())
                self.state[p]["master"] = master
                masters.append(master)
            host_groups.append({**_hyperparameters(group), "params": masters})
        self.inner = inner(host_groups)

    @torch.no_grad()
    def step(self, closure=None):
        """Copy the gradients to the host, step the inner optimizer there, copy the parameters back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = []
        for group, host_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            host_group.update(_hyperparameters(group))
            for p in group["params"]:
                state, master = self.state[p], self.state[p]["master"]
                if p.grad is None:
                    master.grad = None
                    continue
                if "grad" not in state:
                    state["grad"] = _host_buffer(p)
                state["grad"].copy_(p.grad)
                master.grad = state["grad"]
                stepped.append((p, master))
        self.inner.step()
        for p, master in stepped:
            self.state[p].update(self.inner.state[master])  # the moments and step counter, named as the optimizer's
            p.detach().copy_(master if master.dtype == p.dtype else master.to(p.dtype))
        return loss

    def host_bytes(self) -> int:
        """Bytes this optimizer holds on the host now (master copies, gradient buffers, the inner state)."""
        seen, total = set(), 0
        for state in self.state.values():
            for t in state.values():
                if isinstance(t, Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total


def _hyperparameters(group: dict) -> dict:
    """A parameter group's settings without its parameters, for tensors on the host (not CUDA-graph capturable)."""
    settings = {key: value for key, value in group.items() if key != "params"}
    return settings | ({"capturable": False} if "capturable" in settings else {})


def host_state_bytes(numel: int) -> int:
    """Bytes HostAdamW holds on the host for one parameter of `numel` elements after a step: fp32 master,
    gradient and two moments, and AdamW's 4-byte step counter."""
    return 4 * FP32_BYTES * numel + FP32_BYTES
