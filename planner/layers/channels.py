"""Which channels of a tempo norm keep their exact x̂ (|γ| tiny, or |β| large next to |γ|), found without making a
training step's host wait for the device.

Their number sizes what the norm keeps, so the host must know it: `nonzero` reads it, and on a GPU that waits for
the device's queue (25 waits a GPT-2-small step on an H200). Real weights found to have none keep that answer
until they or the bias change (`NONE_FOUND`, per version of both). What changes them in training is the
optimizer's step: after each step of any optimizer, the weights the norms met are searched at once
(`search_after_step`, a kernel each and one copy of all counts to the host, not blocking; a CUDA event marks its
end), so the next forward finds the answer on the host, waiting only if the GPU is still stepping the optimizer.
With the fused kernels off (captures, `fusion.eager()`, MEMPLAN_FUSED=0) nothing is searched after a step and the
mask is computed at every call as before, so a trace, fake or real, holds the same ops either way.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from memplan.planner.layers import fusion

# A channel keeps its exact x̂ when |β| > RATIO·|γ|: recovering x̂ from y there would cost about RATIO ulps.
RECOVERY_RATIO = {torch.float64: 64.0, torch.float32: 64.0, torch.bfloat16: 4.0, torch.float16: 4.0}


def hard_math(weight: torch.Tensor, bias: torch.Tensor | None, tiny: float, ratio: float) -> torch.Tensor:
    """The mask of hard channels, flattened: |γ| < tiny, or |β| > ratio·|γ| (pure: one fused kernel)."""
    w = weight.flatten().float().abs()
    hard = w < tiny
    if bias is not None:
        hard = hard | (bias.flatten().float().abs() > ratio * w)
    return hard


def count_math(weight: torch.Tensor, bias: torch.Tensor | None, tiny: float, ratio: float) -> torch.Tensor:
    """The number of hard channels, as a tensor (pure: one fused kernel)."""
    return hard_math(weight, bias, tiny, ratio).sum()


HARD = fusion.fused(hard_math)
COUNT = fusion.fused(count_math)


def limits(dtype: torch.dtype) -> tuple[float, float]:
    """(tiny, ratio) of an output of `dtype`: its smallest normal number, and its RECOVERY_RATIO."""
    return torch.finfo(dtype).tiny, RECOVERY_RATIO.get(dtype, 4.0)


def hard_channels(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The mask (flattened) of `exact_channels`: |γ| below the smallest normal number of `dtype`, or
    |β| > RATIO·|γ|; one fused kernel where `fusion.runs_fused` allows, else the eager ops of a trace."""
    tiny, ratio = limits(dtype)
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    if fusion.runs_fused([weight] if bias is None else [weight, bias]):
        return HARD.run(weight, bias, tiny, ratio)
    w = weight.flatten().float().abs()
    hard = w < tiny
    if bias is not None:
        hard |= bias.flatten().float().abs() > ratio * w
    return hard


def exact_channels(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Indices (flattened) of the channels whose x̂ cannot be recovered accurately from an output of `dtype`
    (default the weight's).

    Real weights that had none keep that answer until they or the bias change (`NONE_FOUND`), and an optimizer's
    step searches them again at once (`search_after_step`), so a forward reads nothing from the device unless a
    weight changed otherwise or has hard channels. With the fused kernels off the mask is computed at every call
    all the same: a trace, fake or real, allocates the search's buffers at every call (a fake search cannot
    remember), and a real capture must allocate what its fake trace does; an empty answer allocates nothing."""
    dtype = dtype or weight.dtype
    model = fusion.model()
    if model is not None:  # a launch count: the answer a real step would have, counted as it would cost
        KNOWN[weight] = (bias, dtype, model)
        with model.uncounted():
            channels = hard_channels(weight, bias, dtype).nonzero().flatten()
        return hard_channels(weight, bias, dtype).nonzero().flatten() if channels.numel() else channels
    if not remembered(weight, bias):
        return hard_channels(weight, bias, dtype).nonzero().flatten()
    stamp = (stamp_of(weight), stamp_of(bias), dtype)
    KNOWN[weight] = (bias, dtype, None)
    searched = PENDING.pop(weight, None)
    if NONE_FOUND.get(weight) != stamp and searched is not None and searched.stamp == stamp and not searched.count():
        NONE_FOUND[weight] = stamp
    eager = not fusion.enabled()
    hard = hard_channels(weight, bias, dtype) if eager else None  # a trace's ops, as before
    if NONE_FOUND.get(weight) == stamp:
        return weight.new_empty(0, dtype=torch.long)
    channels = (hard if hard is not None else hard_channels(weight, bias, dtype)).nonzero().flatten()
    if channels.numel():
        NONE_FOUND.pop(weight, None)
    else:
        NONE_FOUND[weight] = stamp
    return channels


# weight -> the stamps (`stamp_of` its and its bias's, the output dtype) at which it had no exact channel
NONE_FOUND = WeakIdKeyDictionary()
# weight -> (its bias, the output dtype, the launch count that met it or None) of its last search: what
# `search_after_step` searches
KNOWN = WeakIdKeyDictionary()


@dataclasses.dataclass
class Searched:
    """A weight's hard channels counted after an optimizer's step: at its stamp then, the count's place in the
    host copy of the step's counts, and the event the copy ends at (None on the CPU: the copy was made)."""

    stamp: tuple
    index: int
    host: torch.Tensor
    event: object = None

    def count(self) -> int:
        """The count, from the host copy (waiting for its event first, on a GPU that has not reached it)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()[self.index]  # a host buffer read: no device op


PENDING = WeakIdKeyDictionary()  # weight -> Searched, until its next forward takes it


def remembered(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether an answer for `weight` and `bias` may be remembered: real plain tensors, no dispatch mode watching
    (fake tracing, FLOP counting: they see the search each time), no model compiling."""
    return type(weight) in fusion.PLAIN and (bias is None or type(bias) in fusion.PLAIN) and not fusion.watched()


def stamp_of(t: torch.Tensor | None) -> tuple | None:
    """What changes when a tensor's values may have: its identity, version (in-place writes), storage (`.data`
    swapped), dtype, shape and device."""
    return None if t is None else (id(t), t._version, t.data_ptr(), t.dtype, t.shape, t.device)


def search_after_step(optimizer=None, args=None, kwargs=None) -> None:
    """After an optimizer's step (a global post hook): count the hard channels of every weight a norm met whose
    stamp changed, a fused kernel each, and copy the counts of each device to the host at once, not blocking (on
    CUDA into pinned memory, an event recorded after the copy). Only where the fused kernels run (real tensors,
    fusion on) or a launch count models them; a weight that met no forward since keeps its last answer."""
    model = fusion.model()
    if model is None and (not fusion.enabled() or fusion.watched()):
        return
    stale: dict[torch.device, list] = {}
    for weight, (bias, dtype, count) in list(KNOWN.items()):
        if count is not model or (model is None and not remembered(weight, bias)):  # a count: its own weights
            continue
        stamp = None if model is not None else (stamp_of(weight), stamp_of(bias), dtype)
        if stamp is not None and (NONE_FOUND.get(weight) == stamp or getattr(PENDING.get(weight), "stamp", 0) == stamp):
            continue
        stale.setdefault(weight.device, []).append((weight, bias, dtype, stamp))
    with torch.no_grad():
        for weights in stale.values():
            counts = torch.stack([_count(weight, bias, dtype) for weight, bias, dtype, _ in weights])
            host, event = _to_host(counts)
            if model is None:
                for i, (weight, _, _, stamp) in enumerate(weights):
                    PENDING[weight] = Searched(stamp, i, host, event)


def _count(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The number of hard channels of `weight` and `bias` for an output of `dtype`, on their device."""
    tiny, ratio = limits(dtype)
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    if fusion.runs_fused([weight] if bias is None else [weight, bias]):
        return COUNT.run(weight, bias, tiny, ratio)
    return count_math(weight, bias, tiny, ratio)


def _to_host(counts: torch.Tensor) -> tuple[torch.Tensor, object]:
    """`counts` copied to the host without blocking: into pinned memory with an event after the copy on CUDA; a
    copy on the CPU."""
    if counts.device.type != "cuda" or fusion.model() is not None:
        return counts.to("cpu", copy=True), None
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


register_optimizer_step_post_hook(search_after_step)
