"""Values a fake step knows, so that a mixture of experts routes its tokens as a real step would under a rule.

Fake tensors have sizes and no values, and a mixture of experts turns its router's choices into sizes: how many
tokens each expert takes (`torch.where` on an expert mask, `nonzero`, a loop over the experts hit) and the group
sizes of grouped GEMMs (`histc`, `cumsum`). So under a fake capture:
- a router's choice is set by the routing rule (memplan.routing): the indices of a top-k over the last dimension
  (`topk`, `argmax`, `max` over it) of scores with no known values are the rule's choices for those tokens;
- constants are known: factories that take no data (`arange`, `zeros`, `ones`, `full`, ...), data given to
  `torch.tensor`, fake tensor mode's own constants;
- an op whose inputs are all known is computed for real on the CPU, beside the fake step (only its outputs' values;
  the fake op still allocates what the step does), so every size and scalar derived from the choices alone is the
  one a real step with those choices gets.
What derives from a router's choice is computed as the step runs, whatever its size. A constant is computed only
when it is needed (a factory's output and views of it, when an op takes it with a router's choice or reads its
values), and what is computed from constants alone only up to CONSTANT_LIMIT elements (a long sequence's mask is
never a router's business). A data-dependent op (`nonzero`, `.item()`, a boolean index) on known values is answered
from them; on values nobody knows, by the old rule (read as 0: a selection of them selects nothing), counted in
`data_dependent`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_leaves, tree_map

from memplan.routing import DEFAULT, Routing, RoutingError

aten = torch.ops.aten
ATTRIBUTE = "_memplan_known"  # a fake tensor's Known, when it has one
CONSTANT_LIMIT = 1 << 16  # elements: an op on constants alone is computed up to this size (a factory's at any size)
# Factories whose values follow from their arguments alone (no data, no random state): constants.
FACTORIES = frozenset(
    {aten.arange, aten.zeros, aten.ones, aten.full, aten.scalar_tensor, aten.eye, aten.linspace, aten.logspace}
)
LIFTS = frozenset({aten.lift_fresh, aten.lift_fresh_copy})  # torch.tensor(data): the data, made a tensor
# Ops whose outputs hold no values of their inputs' (memory as allocated, or random): never known.
UNINITIALISED = frozenset({aten.empty_like, aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided})
COMPUTED_NAMESPACES = ("aten", "prims")  # never a collective's or a custom op's (they would run for real)
ROUTERS = frozenset({aten.topk.default, aten.argmax.default, aten.max.dim})  # a router's choice, over the last dim


class Known:
    """The values of a fake tensor, as a real CPU tensor (made when first asked for, for a constant not yet
    needed); `routed` when they derive from a router's choice."""

    def __init__(self, value: torch.Tensor | None, routed: bool, make: Callable | None = None, numel: int = 0):
        self._value, self.routed, self._make, self._numel = value, routed, make, numel

    @property
    def value(self) -> torch.Tensor:
        """The values (a constant's made now if it was waiting); RuntimeError where the CPU could not make them."""
        if self._value is None:
            self._value = self._make() if self._make is not None else None
            self._make = None
        if self._value is None:
            raise RuntimeError("a constant the CPU could not make")
        return self._value

    @property
    def numel(self) -> int:
        """How many values (without making a constant waiting to be made)."""
        return self._numel if self._value is None else self._value.numel()


class Slot:
    """A tensor argument of an op, kept as its size and dtype only (a fake tensor kept alive would change the
    trace): the computation puts the tensor's known values in its place."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = tuple(t.shape), t.dtype


@dataclass(frozen=True)
class RouterCall:
    """A kind of router call the rule answered: the op, how many experts it chose among, how many per token, how
    many tokens, and the rule applied (a `loads` rule applies to routers among as many experts as it has loads)."""

    op: str
    experts: int
    k: int
    tokens: int
    rule: str


def known(t) -> Known | None:
    """What is known of `t`'s values: a fake tensor's Known or fake tensor mode's constant, a real tensor itself."""
    if isinstance(t, FakeTensor):
        found = t.__dict__.get(ATTRIBUTE)
        if found is None and t.constant is not None:  # a copy: fake tensor mode updates its constants itself
            found = Known(t.constant.clone(), False)
        return found
    return Known(t, False) if isinstance(t, torch.Tensor) else None


def forget(t) -> None:
    """`t`'s values are no longer known (an op wrote into it what nobody knows)."""
    if isinstance(t, FakeTensor):
        t.__dict__.pop(ATTRIBUTE, None)


def tensor_arguments(args, kwargs) -> list[torch.Tensor]:
    """The op's tensor arguments in order (an aten op takes tensors and lists of them, never deeper): the order
    `_replace_tensors` takes them in."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [t for t in value if isinstance(t, torch.Tensor)]
    return found


def _replace_tensors(args, kwargs, replace, kind=torch.Tensor) -> tuple[tuple, dict]:
    """The op's arguments with each `kind` (a tensor, a Slot) replaced by `replace(it)`, in `tensor_arguments`'
    order."""

    def one(value):
        if isinstance(value, kind):
            return replace(value)
        if isinstance(value, (list, tuple)):
            return type(value)(replace(t) if isinstance(t, kind) else t for t in value)
        return value

    return tuple(one(v) for v in args), {k: one(v) for k, v in kwargs.items()}


def _on_cpu(value):
    """An op's argument as the CPU computation takes it: devices are the CPU, nothing pinned."""
    return torch.device("cpu") if isinstance(value, torch.device) else value


def _histc(values: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """histc as CUDA computes it for integers (the CPU kernel takes floating values only)."""
    if values.is_floating_point():
        return aten.histc.default(values, *args, **kwargs)
    return aten.histc.default(values.double(), *args, **kwargs).to(values.dtype)


STANDINS = {aten.histc.default: _histc}  # op -> its CPU computation where the CPU kernel refuses what CUDA takes


def _compute(func, args, kwargs, found: list, stand_in: bool = False):
    """`func` run for real on the CPU on the known values of its tensor arguments, given as Slots (with `stand_in`,
    an input nobody knows is zeros of its size); None when the CPU refuses it."""
    values = iter(found)

    def real(slot: Slot):
        k = next(values)
        if k is not None:
            return k.value
        if not stand_in:
            raise RuntimeError("an input nobody knows")
        return torch.zeros((), dtype=slot.dtype).expand(slot.shape)

    try:
        with unset_fake_temporarily():
            real_args, real_kwargs = _replace_tensors(args, kwargs, real, kind=Slot)
            real_kwargs = {k: (False if k == "pin_memory" else _on_cpu(v)) for k, v in real_kwargs.items()}
            return STANDINS.get(func, func)(*(_on_cpu(a) for a in real_args), **real_kwargs)
    except Exception:  # the CPU kernel refuses it (a dtype, a device-only op): the values stay unknown
        return None


def _router_dim(func, args, kwargs) -> int | None:
    """The number of experts when `func` is a router's choice (a top-k over the last dimension of floating scores
    whose values nobody knows), else None."""
    scores = args[0] if args else None
    if func not in ROUTERS or not isinstance(scores, FakeTensor) or not scores.is_floating_point():
        return None
    if scores.dim() == 0 or known(scores) is not None:
        return None
    if func is aten.topk.default:
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    else:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or dim % scores.dim() != scores.dim() - 1:
        return None
    return scores.shape[-1]


def _written(func, args, kwargs) -> list:
    """The tensors the op writes into (an in-place op's self, an out= argument)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


# Ops that read a tensor at given indices, and whose real kernels refuse an index out of range (an IndexError or, for
# gather, a RuntimeError on the CPU; a device-side assert on CUDA): op -> (the indexed tensor's argument, the
# dimension's argument or a fixed dimension, the indices' argument), by position.
INDEXED = {
    aten.embedding.default: (0, 0, 1),  # weight, rows, indices
    aten.index_select.default: (0, "1", 2),  # self, dim, index
    aten.gather.default: (0, "1", 2),  # self, dim, index
}
BOUNDS_LIMIT = 1 << 22  # elements: indices up to this many are checked (a constant's made for it: position ids)


def _known_indices(t) -> torch.Tensor | None:
    """The values of an index tensor when they are known (and not too many to check), else None."""
    found = known(t) if isinstance(t, torch.Tensor) else None
    if found is None or found.numel > BOUNDS_LIMIT or found.numel == 0:
        return None
    try:
        value = found.value
    except RuntimeError:
        return None
    return value if not value.is_floating_point() and value.dtype != torch.bool else None


def check_bounds(func, args, kwargs) -> None:
    """Raise what the real op raises when `func` (INDEXED, or advanced indexing `aten.index`) reads at indices known
    to be out of range for the tensor it reads (position ids from `arange` past an embedding's rows: GPT-2 at a
    sequence longer than its `n_positions`); nothing when the indices are unknown or in range."""
    if func is aten.index.Tensor:
        _check_advanced(args[0], args[1] if len(args) > 1 else kwargs["indices"])
        return
    where = INDEXED.get(func)
    if where is None:
        return
    tensor_at, dim_at, index_at = where
    values = args[:3] if len(args) >= 3 else (*args, *kwargs.values())
    tensor, index = values[tensor_at], values[index_at]
    dim = int(values[int(dim_at)]) if isinstance(dim_at, str) else dim_at
    indices = _known_indices(index)
    if indices is None:
        return
    size = tensor.shape[dim % tensor.dim()] if tensor.dim() else 1
    low, high = int(indices.min()), int(indices.max())
    if low >= 0 and high < size:
        return
    bad = high if high >= size else low
    name = str(func.overloadpacket).replace("aten.", "aten::")
    if func is aten.gather.default:
        raise RuntimeError(f"index {bad} is out of bounds for dimension {dim} with size {size} ({name})")
    raise IndexError(f"index out of range in self: {name} reads index {bad} of a dimension of size {size}")


def _check_advanced(tensor: torch.Tensor, indices) -> None:
    """`tensor[indices]` (aten.index) with integer indices known out of [-size, size): IndexError as torch raises."""
    dim = 0
    for index in indices:
        if index is None:
            dim += 1
            continue
        if index.dtype in (torch.bool, torch.uint8):  # a mask over as many dimensions as it has
            dim += index.dim()
            continue
        values = _known_indices(index)
        if values is not None and dim < tensor.dim():
            size = tensor.shape[dim]
            low, high = int(values.min()), int(values.max())
            if low < -size or high >= size:
                bad = high if high >= size else low
                raise IndexError(f"index {bad} is out of bounds for dimension {dim} with size {size}")
        dim += 1


class KnownValues:
    """The values one fake capture knows (see the module docstring), and what it answered from them."""

    def __init__(self, routing: Routing | str = DEFAULT):
        self.routing = Routing.parse(routing)
        self.routers: Counter[RouterCall] = Counter()  # router calls answered by the rule
        self.computed: Counter[str] = Counter()  # op -> data-dependent results computed from known values
        self.lost: Counter[str] = Counter()  # op -> times a router's choice could not be followed through it

    def inputs(self, func, tensors: list[torch.Tensor]) -> list | None:
        """The known values of the op's tensor inputs (`tensor_arguments`; None for one nobody knows), or None when
        the op touches nothing known and makes nothing known (the common case: nothing to do)."""
        found = [known(t) for t in tensors]
        if any(k is not None for k in found) or func.overloadpacket in FACTORIES or func in ROUTERS:
            return found
        return None

    def answer(self, mode, func, args, kwargs, found: list):
        """A data-dependent op's output from the known values (inputs nobody knows read as zeros, which is
        DATA_RULE), as fake tensors of `mode` with the real output's sizes; None when it cannot be computed."""
        if not any(k is not None for k in found):
            return None
        real = _compute(func, *_replace_tensors(args, kwargs, Slot), found, stand_in=True)
        if real is None:
            if any(k is not None and k.routed for k in found):
                self.lost[str(func.overloadpacket)] += 1
            return None
        complete = all(k is not None for k in found)
        if complete:
            self.computed[str(func.overloadpacket)] += 1
        if not isinstance(real, (torch.Tensor, tuple, list)):
            return real  # a scalar (.item())
        device = next(t.device for t in tensor_arguments(args, kwargs) if isinstance(t, FakeTensor))
        with mode:
            fake_out = tree_map(
                lambda r: (
                    torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device)
                    if isinstance(r, torch.Tensor)
                    else r
                ),
                real,
            )
        if complete:
            self._attach(fake_out, real, any(k.routed for k in found))
        return fake_out

    def after(self, func, args, kwargs, found: list, out) -> None:
        """Mark what the op's outputs hold: a router's choice by the rule, or values computed from known inputs (a
        constant's when needed); forget what it overwrote with values nobody knows."""
        experts = _router_dim(func, args, kwargs)
        if experts is not None:
            self._route(func, args, kwargs, experts, out)
            return
        if not all(k is not None for k in found) or not self._computable(func, args, kwargs, found, out):
            self._forget_written(func, args, kwargs)
            return
        skeleton = _replace_tensors(args, kwargs, Slot)
        routed = any(k.routed for k in found)
        if not routed:  # constants alone: a factory's output and views of it made when needed, the rest if small
            written = _written(func, args, kwargs)
            if not written and (func.overloadpacket in FACTORIES or (func.is_view and isinstance(out, FakeTensor))):
                out.__dict__[ATTRIBUTE] = Known(None, False, lambda: _compute(func, *skeleton, found), out.numel())
                return
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, FakeTensor)] + [k.numel for k in found]
            if max(sizes) > CONSTANT_LIMIT:
                self._forget_written(func, args, kwargs)
                return
        real = _compute(func, *skeleton, found)
        if real is None:
            if routed:
                self.lost[str(func.overloadpacket)] += 1
            self._forget_written(func, args, kwargs)
            return
        self._attach(out, real, routed)

    def meta(self) -> dict:
        """What the trace's meta keeps of it: the rule, the router calls it answered (with each expert's token
        choices), the data-dependent values computed from known values, and where a choice was lost."""
        routers = []
        for call, n in self.routers.items():
            per_expert = Routing.parse(call.rule).counts(call.tokens, call.k, call.experts)
            routers.append({**call.__dict__, "calls": n, "per_expert": per_expert})
        return {"rule": str(self.routing), "routers": routers, "computed": dict(self.computed), "lost": dict(self.lost)}

    def check(self) -> None:
        """RoutingError when a `loads` rule met no router among as many experts as it has loads."""
        if self.routing.rule != "loads" or not self.routers:
            return
        if not any(call.experts == len(self.routing.loads) for call in self.routers):
            seen = ", ".join(sorted({f"top-{c.k} of {c.experts} ({c.op})" for c in self.routers}))
            raise RoutingError(
                f"--routing {self.routing}: {len(self.routing.loads)} loads, and no router of the step chooses among "
                f"{len(self.routing.loads)} experts (its routers: {seen})"
            )

    def _route(self, func, args, kwargs, experts: int, out) -> None:
        """Set the chosen indices of a router call by the rule."""
        scores = args[0]
        leading = tuple(scores.shape[:-1])
        if func is aten.topk.default:
            k = args[1] if len(args) > 1 else kwargs["k"]
            indices = out[1]
        else:
            k, indices = 1, out if func is aten.argmax.default else out[1]
        if k < 1 or k > experts:
            return
        with unset_fake_temporarily():  # real tensors, also where the program entered fake tensor mode twice
            chosen = self.routing.choices(leading, k, experts).view(indices.shape).to(indices.dtype)
        rule = str(self.routing) if self.routing.applies_to(experts) else DEFAULT
        self.routers[RouterCall(str(func.overloadpacket), experts, k, math.prod(leading), rule)] += 1
        indices.__dict__[ATTRIBUTE] = Known(chosen, True)

    @staticmethod
    def _computable(func, args, kwargs, found: list, out) -> bool:
        """Whether the op's outputs follow from its known inputs: an aten op, not random, not uninitialised memory;
        with no tensor input, a factory of constants."""
        if func.namespace not in COMPUTED_NAMESPACES or torch.Tag.nondeterministic_seeded in func.tags:
            return False
        if func.overloadpacket in UNINITIALISED or not any(isinstance(t, FakeTensor) for t in tree_leaves(out)):
            return False
        if any(t.__dict__.get(ATTRIBUTE) is None for t in _written(func, args, kwargs)):
            return False  # an op never writes into a real tensor or fake tensor mode's constant here
        return bool(found) or func.overloadpacket in FACTORIES or func.overloadpacket in LIFTS

    @staticmethod
    def _attach(out, real, routed: bool) -> None:
        """Give each fake output its computed values (same sizes), or forget what it held."""
        fakes, reals = tree_leaves(out), tree_leaves(real)
        if len(fakes) != len(reals):
            return
        for f, r in zip(fakes, reals):
            if isinstance(f, FakeTensor):
                if isinstance(r, torch.Tensor) and tuple(r.shape) == tuple(f.shape):
                    f.__dict__[ATTRIBUTE] = Known(r, routed)
                else:
                    forget(f)

    @staticmethod
    def _forget_written(func, args, kwargs) -> None:
        """Forget the values of the inputs the op writes into (their values are no longer known)."""
        for t in _written(func, args, kwargs):
            forget(t)
