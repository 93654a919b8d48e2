"""A model that is only a language-model head, its hidden states a parameter: a training step of it holds, above
what it held when it began, the loss's own bytes (planner/layers/memory.py: LossShape, loss_bytes)."""

from __future__ import annotations

import torch
from torch import nn

from memplan.modes import AS_BUILT
from memplan.planner.layers.fused_loss import TokenLoss
from memplan.planner.layers.loss_patch import patch_loss
from memplan.traces.inputs.workload import Workload


class HeadOnly(nn.Module):
    """n hidden states of size h (a parameter, so their gradient is kept as a step's) and a head to v logits."""

    def __init__(self, n: int, h: int, v: int):
        super().__init__()
        self.hidden = nn.Parameter(torch.randn(1, n, h))
        self.head = nn.Linear(h, v, bias=False)

    def get_output_embeddings(self) -> nn.Linear:
        """The head (HuggingFace's name for it)."""
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden)


def head_workload(
    n: int, h: int, v: int, dtype: torch.dtype, autocast: torch.dtype | None = None, loss: str = AS_BUILT
) -> Workload:
    """A training step of HeadOnly in `dtype` (forward and loss under `autocast` when given) on TokenLoss, with the
    step's `loss` (modes.LOSSES) applied; SGD at learning rate 0, which keeps no state."""
    torch.manual_seed(0)
    model = HeadOnly(n, h, v).to(dtype)
    labels = torch.randint(0, v, (1, n), generator=torch.Generator().manual_seed(0))
    workload = Workload(model, (labels,), torch.optim.SGD(model.parameters(), lr=0.0), TokenLoss(labels))
    workload.loss_patch = patch_loss(model, loss, workload.loss_fn)
    workload.autocast = autocast
    return workload
