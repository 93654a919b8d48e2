"""Megatron's column- and row-parallel linear layers, with and without sequence parallelism.

Tensors are sequence-first ([s, b, features]). A column-parallel linear holds 1/t of the output
features; a row-parallel one 1/t of the input features and sums the partial outputs over the ranks
(all-reduce, or reduce-scatter along the sequence with sequence parallelism). With sequence
parallelism the column-parallel linear keeps only its sequence shard of the input for backward and
all-gathers it again there, so its saved input is 1/t of the replicated one (Megatron's choice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from memplan.planner.parallel import comm

INIT_STD = 0.02  # GPT-2's initialisation; `load_full` copies a single-process layer's weights instead


def mark_sequence_parallel(param: nn.Parameter) -> nn.Parameter:
    """Flag a replicated parameter used on sequence shards: its gradient is summed over the ranks."""
    param.sequence_parallel = True
    return param


def sync_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """Sum the gradient of every flagged parameter over the ranks as backward produces it (a tensor
    hook, so accumulation over micro-batches stays right); returns how many parameters it newly hooks."""
    if comm.world(group) == 1:
        return 0

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce_(grad.clone(), group)

    hooked = [
        p
        for p in module.parameters()
        if getattr(p, "sequence_parallel", False) and not getattr(p, "_grad_synced", False)
    ]
    for p in hooked:
        p.register_hook(reduce)
        p._grad_synced = True  # hooked once, however many enclosing modules ask
    return len(hooked)


class _GatherLinear(Function):
    """y = all_gather(x) W^T + b, saving only the shard x; backward gathers x again for W's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comm.all_gather_seq(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = comm.reduce_scatter_seq(grad.matmul(weight), ctx.group)
        if ctx.needs_input_grad[1]:
            total = comm.all_gather_seq(x, ctx.group)
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r with W_r this rank's 1/t of the output rows; the output stays split."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        t = comm.world(group)
        if out_features % t:
            raise comm.ParallelError(f"{out_features} output features are not divisible by the parallel size {t}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // t, device=device, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=INIT_STD)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None, rows=None) -> None:
        """Copy this rank's rows of the full layer's weight and bias (`rows`: index tensor, default a
        contiguous 1/t block)."""
        if rows is None:
            n = self.weight.shape[0]
            rows = torch.arange(comm.rank(self.group) * n, (comm.rank(self.group) + 1) * n)
        with torch.no_grad():
            self.weight.copy_(weight[rows])
            if self.bias is not None:
                self.bias.copy_(bias[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and comm.world(self.group) > 1:
            return _GatherLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(comm.copy_to_tensor_parallel(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b with W_r this rank's 1/t of the input columns; the input arrives split."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        t = comm.world(group)
        if in_features % t:
            raise comm.ParallelError(f"{in_features} input features are not divisible by the parallel size {t}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=INIT_STD)
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy this rank's columns of the full layer's weight, and the whole bias."""
        n = self.weight.shape[1]
        r = comm.rank(self.group)
        with torch.no_grad():
            self.weight.copy_(weight[:, r * n : (r + 1) * n])
            if self.bias is not None:
                self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = comm.reduce_scatter_to_sequence_parallel(partial, self.group)
        else:
            out = comm.reduce_from_tensor_parallel(partial, self.group)
        return out if self.bias is None else out + self.bias
