"""Megatron's tensor- and sequence-parallel collectives as autograd functions; dim 0 is the sequence.

Each function pairs a forward collective with its adjoint in backward: copy (identity / all-reduce),
reduce (all-reduce / identity), gather (all-gather / split), reduce-scatter (reduce-scatter /
all-gather) and scatter (split / all-gather). Every collective runs on contiguous
tensors of the given process group (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.autograd import Function

from memplan.errors import MemplanError


class ParallelError(MemplanError):
    """A shape or option that tensor or sequence parallelism cannot split over the ranks."""


RELEASE_TIMEOUT_S = 60.0


def _collective(group, op, *tensors: torch.Tensor) -> None:
    """Run a blocking collective op(*tensors) on `group` and return only once the backend has let go of them.

    gloo runs collectives on its own worker threads, and a worker can hold the last reference to a
    tensor for a moment after the collective completed; a tensor freed there is freed when that thread
    gets to it, not where the program dropped it. So the collective gets fresh views (their own
    TensorImpls, each counted by the storage) and this waits until those are gone.
    """
    if dist.get_backend(group) != "gloo":
        op(*tensors)
        return
    storages = [t.untyped_storage() for t in tensors]
    held = [torch._C._storage_Use_Count(s._cdata) for s in storages]
    views = [t.view_as(t) for t in tensors]
    op(*views)
    del views
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while any(torch._C._storage_Use_Count(s._cdata) > n for s, n in zip(storages, held)):
        if time.monotonic() > deadline:
            raise ParallelError(
                f"the gloo backend still holds a tensor {RELEASE_TIMEOUT_S:.0f} s after its collective completed"
            )
        time.sleep(0)


def world(group) -> int:
    """The size of the tensor-parallel group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group) -> int:
    """This process's rank in the tensor-parallel group (0 when not initialised)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's x along dim 0 (a new tensor t times as long)."""
    t = world(group)
    if t == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * t,) + tuple(x.shape[1:]))
    _collective(group, lambda o, i: dist.all_gather_single(o, i, group=group), out, x)
    return out


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Sum x over the ranks and keep this rank's 1/t slice of dim 0; x is scratch (callers pass partial
    sums they drop) and may be overwritten.

    On gloo this is an in-place all-reduce of x followed by a copy of the slice: gloo's own
    reduce-scatter leaves internal temporaries to its worker threads, freed when those threads get to
    them. Memory is the same as a reduce-scatter's (x, then the slice); the traffic is twice.
    """
    t = world(group)
    if t == 1:
        return x
    if x.shape[0] % t:
        raise ParallelError(f"sequence length {x.shape[0]} is not divisible by the parallel size {t}")
    x = x.contiguous()
    if dist.get_backend(group) == "gloo":
        return all_reduce_(x, group).chunk(t, dim=0)[rank(group)].clone()
    out = x.new_empty((x.shape[0] // t,) + tuple(x.shape[1:]))
    _collective(group, lambda o, i: dist.reduce_scatter_single(o, i, group=group), out, x)
    return out


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/t slice of dim 0, as its own tensor (a view would keep the whole input alive)."""
    t = world(group)
    if t == 1:
        return x
    if x.shape[0] % t:
        raise ParallelError(f"sequence length {x.shape[0]} is not divisible by the parallel size {t}")
    return x.chunk(t, dim=0)[rank(group)].clone(memory_format=torch.contiguous_format)


def all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """Sum x over the ranks in place."""
    if world(group) > 1:
        _collective(group, lambda t: dist.all_reduce(t, group=group), x)
    return x


class _CopyToTensorParallel(Function):
    """Enter a tensor-parallel region with a replicated input: identity, all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.clone(), ctx.group), None


class _ReduceFromTensorParallel(Function):
    """Leave a tensor-parallel region to a replicated output: all-reduce, identity gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)  # the partial sums are summed in place, as Megatron does
        return all_reduce_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallel(Function):
    """All-gather along the sequence for a replicated consumer; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_seq(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(Function):
    """Leave a tensor-parallel region into the sequence-parallel one: reduce-scatter, all-gather back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)  # x: the row-parallel linear's partial sums

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


class _ScatterToSequenceParallel(Function):
    """Enter the sequence-parallel region from a replicated tensor: keep this rank's slice, gather back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, gradient all-reduced: the input of a column-parallel linear without SP."""
    return _CopyToTensorParallel.apply(x, group) if world(group) > 1 else x


def reduce_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce forward, identity gradient: the output of a row-parallel linear without SP."""
    return _ReduceFromTensorParallel.apply(x, group) if world(group) > 1 else x


def gather_from_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the sequence shards for a consumer every rank computes alike (the model's head): the
    gradient of the whole is the same on every rank, so backward keeps this rank's slice. (Before a
    column-parallel linear the gather is fused into the linear, whose backward reduce-scatters.)"""
    return _GatherFromSequenceParallel.apply(x, group) if world(group) > 1 else x


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter forward, all-gather gradient: the output of a row-parallel linear with SP."""
    return _ReduceScatterToSequenceParallel.apply(x, group) if world(group) > 1 else x


def scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Split forward, all-gather gradient: the embeddings entering the sequence-parallel region."""
    return _ScatterToSequenceParallel.apply(x, group) if world(group) > 1 else x
