"""A fused, chunked linear + cross-entropy: the loss of `F.linear(hidden, weight, bias)` then `F.cross_entropy` in
fp32 (ignore_index, the mean over the labelled tokens or a sum over num_items_in_batch, as HuggingFace's
ForCausalLMLoss and memplan's TokenLoss compute it) without ever holding the logits whole.

Forward computes the loss and every gradient at once, in two passes over chunks whose logits hold no more elements
than the hidden states or a sixteenth of the logits, whichever is more (`chunk_sizes`):
1. rows of the hidden states: their logits, log-sum-exp and loss, and the gradient of those rows,
   ((softmax - one-hot) x the row's share of the loss) @ W;
2. columns of the vocabulary, when the weight needs a gradient: the logits of every row for those columns made again,
   softmax from pass 1's log-sum-exp, and the weight's gradient rows for them in one matmul over all the rows (rounded
   once, as the unfused matmul's are; a sum over row chunks in bf16 would be rounded once per chunk).
Backward scales the saved gradients by the incoming one, in place. The logits are computed in the dtype F.linear gives
(autocast's under autocast, from one cast copy of the weight) and the softmax in fp32, as the unfused loss upcasts
them; the gradient of the logits is rounded to that dtype before its matmuls, as the upcast's backward rounds it.
The price is one more matmul of the head's size than the unfused three (pass 2 makes the logits again).

A head call can be deferred (`defer`): it returns a stand-in shaped as the logits that `take_deferred` turns back
into the hidden states and the head, so a loss given the stand-in runs fused (`token_cross_entropy`, TokenLoss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

IGNORE_INDEX = -100  # the label of a token without a loss, as in torch's and HuggingFace's cross-entropy
DEFERRED = "_memplan_deferred_logits"  # the stand-in's attribute holding its Deferred
CHUNKS = 16  # a chunk's logits may hold a CHUNKS-th of the whole logits' elements (or the hidden states', if more)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) gives here: autocast's when it is on for the device, else the inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def chunk_sizes(tokens: int, hidden: int, vocab: int) -> tuple[int, int]:
    """(rows per chunk of pass 1, vocabulary columns per block of pass 2): each chunk's logits hold at most the larger
    of the hidden states' elements (tokens x hidden) and a CHUNKS-th of the logits', and at least one row or column.
    So the loss holds, on top of its gradients, a few bytes per element of that budget whatever the vocabulary, and a
    pass runs at most about CHUNKS matmuls (none too small to run well)."""
    budget = max(tokens * hidden, -(-tokens * vocab // CHUNKS))
    return max(1, min(tokens, budget // max(vocab, 1))), max(1, min(vocab, budget // max(tokens, 1)))


@dataclass
class FusedUse:
    """How often a patched model's loss ran fused and how it was chunked the last time (the patch report's)."""

    calls: int = 0
    tokens: int = 0  # rows of the hidden states of the last call
    rows: int = 0  # its rows per chunk of pass 1
    columns: int = 0  # its vocabulary columns per block of pass 2


def _loss_and_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    divisor: torch.Tensor,
    ignore_index: int,
    dtype: torch.dtype,
    sizes: tuple[int, int],
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The loss and the gradients of (hidden, weight, bias) for a gradient of 1, as the module docstring says."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    rows, columns = sizes
    valid = labels != ignore_index
    target = labels.masked_fill(~valid, 0)
    share = valid.to(torch.float32) / divisor  # each row's share of the loss: its gradient's scale
    w = weight.to(dtype)  # a copy only under autocast (as autocast's own cast of the weight)
    b = None if bias is None else bias.to(dtype)
    lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if needs[0] else None
    for start in range(0, tokens, rows):  # pass 1: rows
        end = min(tokens, start + rows)
        x = F.linear(hidden[start:end].to(dtype), w, b).float()  # (rows, vocab) fp32, changed in place below
        top = x.amax(1, keepdim=True)
        x.sub_(top)
        picked = x.gather(1, target[start:end, None]).squeeze(1)
        x.exp_()
        sums = x.sum(1)
        logs = sums.log()
        lse[start:end] = logs + top.squeeze(1)
        total += ((logs - picked) * valid[start:end]).sum()
        if grad_hidden is None:
            continue
        x.div_(sums[:, None])
        x.scatter_add_(1, target[start:end, None], -valid[start:end, None].to(x.dtype))
        x.mul_(share[start:end, None])
        g = x.to(dtype)
        del x
        if grad_hidden.dtype == dtype:
            torch.mm(g, w, out=grad_hidden[start:end])
        else:
            grad_hidden[start:end] = g @ w
        del g
    grad_weight = torch.empty_like(weight) if needs[1] else None
    grad_bias = torch.empty_like(bias) if needs[2] else None
    if needs[1] or needs[2]:
        h = hidden.to(dtype)
        for start in range(0, vocab, columns):  # pass 2: vocabulary columns
            end = min(vocab, start + columns)
            x = F.linear(h, w[start:end], None if b is None else b[start:end]).float()  # (tokens, columns) fp32
            x.sub_(lse[:, None]).exp_()
            inside = valid & (target >= start) & (target < end)
            x.scatter_add_(1, (target - start).clamp(0, end - start - 1)[:, None], -inside[:, None].to(x.dtype))
            x.mul_(share[:, None])
            g = x.to(dtype)
            del x
            if grad_weight is not None:
                if grad_weight.dtype == dtype:
                    torch.mm(g.t(), h, out=grad_weight[start:end])
                else:
                    grad_weight[start:end] = g.t() @ h
            if grad_bias is not None:
                grad_bias[start:end] = g.sum(0)
            del g
    return total / divisor, [grad_hidden, grad_weight, grad_bias]


class _LinearCrossEntropy(torch.autograd.Function):
    """The fused loss as one autograd node: forward computes the gradients, backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, divisor, ignore_index, dtype, sizes, grads):
        needs = tuple(grads and need for need in ctx.needs_input_grad[:3])  # none without grad mode (evaluation)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are explicit here
            loss, ctx.grads = _loss_and_gradients(
                hidden, weight, bias, labels, divisor, ignore_index, dtype, sizes, needs
            )
        return loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.grads is None:
            raise RuntimeError("the fused loss hands its gradients to backward once (no retain_graph)")
        grads, ctx.grads = ctx.grads, None  # no reference kept: autograd takes the tensors as the .grad
        scaled = [None if g is None else g.mul_(grad) for g in grads]
        return (*scaled, None, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: torch.Tensor | int | None = None,
    use: FusedUse | None = None,
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index)` flattened over the tokens
    (the mean over labelled tokens, or the sum / `num_items_in_batch`), fused in chunks: the same loss and gradients
    without the logits whole. `use` counts the call and keeps its chunking."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    if num_items_in_batch is None:
        divisor = (y != ignore_index).sum().to(torch.float32)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=h.device).to(torch.float32)
    sizes = chunk_sizes(h.shape[0], h.shape[1], weight.shape[0])
    if use is not None:
        use.calls += 1
        use.tokens, (use.rows, use.columns) = h.shape[0], sizes
    dtype, grads = compute_dtype(h, weight), torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(h, weight, bias, y, divisor, ignore_index, dtype, sizes, grads)


@dataclass
class Deferred:
    """A deferred head call: the hidden states it was given and the head (an nn.Linear, or one with its weight and
    bias) to apply to them, with the patch's FusedUse."""

    hidden: torch.Tensor
    head: nn.Module
    use: FusedUse | None = None


def defer(head: nn.Module, hidden: torch.Tensor, use: FusedUse | None = None) -> torch.Tensor:
    """A stand-in for `head(hidden)`: shaped and typed as its logits, one NaN expanded (no logits' bytes; anything but
    the fused loss that reads it gets NaN), holding the call for `take_deferred`."""
    dtype = compute_dtype(hidden, head.weight)
    nan = torch.full((), float("nan"), dtype=dtype, device=hidden.device)
    stand_in = nan.expand(*hidden.shape[:-1], head.weight.shape[0])
    setattr(stand_in, DEFERRED, Deferred(hidden, head, use))
    return stand_in


def take_deferred(logits) -> Deferred | None:
    """The deferred call behind a stand-in, taken from it (so it no longer holds the hidden states); None for anything
    else."""
    deferred = getattr(logits, DEFERRED, None) if isinstance(logits, torch.Tensor) else None
    if deferred is not None:
        delattr(logits, DEFERRED)
    return deferred


def fused_cross_entropy(
    deferred: Deferred,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """The cross-entropy of a deferred head call's logits against `labels` (aligned with its rows), fused."""
    head = deferred.head
    return linear_cross_entropy(
        deferred.hidden, head.weight, head.bias, labels, ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch, use=deferred.use,
    )  # fmt: skip


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy of logits (..., vocab) against labels (...) in fp32, the mean over labels other than
    `ignore_index`; fused when `logits` is a deferred head call's stand-in."""
    deferred = take_deferred(logits)
    if deferred is not None:
        return fused_cross_entropy(deferred, labels, ignore_index)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=ignore_index)


class TokenLoss:
    """Cross-entropy of logits (batch, seq, vocab) against labels, ignoring label -100; computed in fp32 (fused when
    the model's head was deferred: planner/layers/loss_patch.py)."""

    def __init__(self, labels: torch.Tensor):
        self.labels = labels

    def __call__(self, logits: torch.Tensor, inputs) -> torch.Tensor:
        return token_cross_entropy(logits, self.labels)
