"""Apply a step's loss (modes.LOSSES) to a model: `fused` defers the language-model head's matmul to the loss, which
fuses it with cross-entropy in chunks (planner/layers/fused_loss.py), so the logits never exist whole.

It applies where memplan can read in the model's code that the head's output goes to the loss unchanged:
- a HuggingFace causal LM: `get_output_embeddings()` an nn.Linear child, `loss_function` transformers' ForCausalLMLoss,
  and a forward that names the head's output and gives it to `self.loss_function` with nothing done to it in between
  (Gemma 2's softcap, Cohere's and Granite's logit scales are done to it: those are left as built). Called with labels,
  its head returns a stand-in, its loss is the fused one (label shift, ignore_index, num_items_in_batch, as
  ForCausalLMLoss), and its output's logits are None; called without labels, it computes its logits as built;
- memplan's own decoders (planner/workloads: GPT-2 and Llama, whose forward returns `self.head(...)`) trained on
  memplan's TokenLoss: the head always returns a stand-in, which TokenLoss computes the fused loss of.
Anywhere else it changes nothing and the report says why. The stand-in holds one NaN: anything other than the fused
loss that reads it gets NaN, never a plausible wrong number. Parameters are not moved or copied; `unpatch_loss` puts
back every attribute it set.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.nn import functional as F

from memplan.errors import PatchError
from memplan.modes import AS_BUILT, FUSED, check_loss
from memplan.planner.layers.fused_loss import (
    IGNORE_INDEX,
    FusedUse,
    TokenLoss,
    defer,
    fused_cross_entropy,
    take_deferred,
)

STATE = "_memplan_loss_patch"
HF_LOSSES = "transformers.loss.loss_utils"  # where transformers defines ForCausalLMLoss
FUSED_NAME = "fused linear cross-entropy"


@dataclass
class LossPatch:
    """What `patch_loss` did to a model, and how the fused loss ran since (a trace's meta "loss_patch")."""

    loss: str  # the choice, one of modes.LOSSES
    replaced: str = ""  # what computes differently now, in words; "" when nothing does
    notes: list[str] = field(default_factory=list)  # why it changed nothing, when it did not
    use: FusedUse = field(default_factory=FusedUse)
    undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def patched(self) -> bool:
        """Whether the model computes its loss fused when it is called for one."""
        return bool(self.replaced)

    def to_dict(self) -> dict:
        """The report as plain data; `notes` says also when a patched model's loss never ran fused."""
        notes = list(self.notes)
        if self.patched and not self.use.calls:
            notes.append("the fused loss has not run: the model was not called for a loss (no labels given)")
        return {
            "loss": self.loss,
            "patched": self.patched,
            "changed": self.patched and self.use.calls > 0,
            "replaced": self.replaced,
            "calls": self.use.calls,
            "tokens": self.use.tokens,
            "chunk_rows": self.use.rows,
            "block_columns": self.use.columns,
            "notes": notes,
        }


def _forward_tree(cls: type) -> tuple[ast.FunctionDef, list[str]] | None:
    """The syntax tree of `cls.forward` and its source lines, None when its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return (node, source.splitlines()) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None


def _self_calls(tree: ast.AST, attribute: str) -> list[ast.Call]:
    """The calls `self.<attribute>(...)` in `tree`."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
        and node.func.attr == attribute
    ]


def hf_forward_reason(cls: type, head: str) -> str | None:
    """Why `cls.forward` may not give `self.<head>`'s output to `self.loss_function` unchanged; None when its code
    shows it does: one call of each, the head's output named, that name given as the logits, and not read or
    assigned in between."""
    read = _forward_tree(cls)
    if read is None:
        return f"the source of {cls.__name__}.forward cannot be read"
    tree, lines = read
    heads, losses = _self_calls(tree, head), _self_calls(tree, "loss_function")
    if len(heads) != 1 or len(losses) != 1:
        return f"its forward calls self.{head} {len(heads)} times and self.loss_function {len(losses)} times, not once"
    named = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.value is heads[0]]
    if len(named) != 1 or len(named[0].targets) != 1 or not isinstance(named[0].targets[0], ast.Name):
        line = lines[heads[0].lineno - 1].strip()
        return f"its forward does more with self.{head}'s output than name it (`{line}`)"
    name, call = named[0].targets[0].id, losses[0]
    given = next((k.value for k in call.keywords if k.arg == "logits"), call.args[0] if call.args else None)
    if not (isinstance(given, ast.Name) and given.id == name):
        return f"its forward does not give self.loss_function the head's output {name} as the logits"
    after, before = (named[0].end_lineno, named[0].end_col_offset), (call.lineno, call.col_offset)
    between = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and n.id == name and after < (n.lineno, n.col_offset) < before
    ]
    if between:
        return f"its forward changes the logits before its loss (`{lines[between[0].lineno - 1].strip()}`)"
    return None


def decoder_forward_reason(cls: type, head: str) -> str | None:
    """Why `cls.forward` may not return `self.<head>(...)` as it is; None when its last statement does."""
    read = _forward_tree(cls)
    if read is None:
        return f"the source of {cls.__name__}.forward cannot be read"
    last = read[0].body[-1]
    value = last.value if isinstance(last, ast.Return) else None
    if not (isinstance(value, ast.Call) and value in _self_calls(last, head) and len(value.args) == 1):
        return f"its forward does not end by returning self.{head}(...) as it is"
    return None


def head_of(model: nn.Module) -> tuple[str, nn.Linear] | str:
    """(attribute name, module) of the model's output embeddings, an nn.Linear child; or why there is none."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return "it has no language-model head (no get_output_embeddings())"
    if type(head) is not nn.Linear or "forward" in vars(head):
        return f"its head is a {type(head).__name__}, not an nn.Linear as built"
    name = next((n for n, child in model.named_children() if child is head), None)
    if name is None:
        return "its head is not a module of its own (get_output_embeddings() is not a child of the model)"
    return name, head


def _set(undo: list, owner: object, name: str, value: object) -> None:
    """owner.name = value, with how to put back what was there in `undo`."""
    missing = object()
    before = vars(owner).get(name, missing)
    setattr(owner, name, value)
    undo.append(lambda: delattr(owner, name) if before is missing else setattr(owner, name, before))


def _without_logits(output):
    """A HuggingFace output without its logits (the stand-in): the same output class, logits None."""
    if hasattr(output, "keys") and "logits" in output.keys():
        return type(output)(**{key: value for key, value in output.items() if key != "logits"})
    return output


def _patch_causal_lm(model: nn.Module, name: str, head: nn.Linear, report: LossPatch) -> None:
    """The HuggingFace causal LM's fused loss: the head deferred while a call with labels runs, its loss fused."""
    original_loss = model.loss_function
    forward = model.forward
    signature = inspect.signature(forward)
    with_labels = [0]  # calls with labels running now

    def head_forward(hidden):
        return defer(head, hidden, report.use) if with_labels[0] else nn.Linear.forward(head, hidden)

    def model_forward(*args, **kwargs):
        try:
            labels = signature.bind_partial(*args, **kwargs).arguments.get("labels")
        except TypeError:  # arguments forward does not take: its own error
            labels = None
        if labels is None:
            return forward(*args, **kwargs)
        with_labels[0] += 1
        try:
            return _without_logits(forward(*args, **kwargs))
        finally:
            with_labels[0] -= 1

    def loss_function(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                      shift_labels=None, **kwargs):  # fmt: skip
        deferred = take_deferred(logits)
        if deferred is None:
            return original_loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)  # fmt: skip
        if shift_labels is None:  # tokens < n predict n, as ForCausalLMLoss shifts them
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return fused_cross_entropy(deferred, shift_labels, ignore_index, num_items_in_batch)

    _set(report.undo, head, "forward", head_forward)
    _set(report.undo, model, "forward", model_forward)
    _set(report.undo, model, "_loss_function", loss_function)  # what HuggingFace's loss_function setter sets
    report.undo.reverse()  # put back in the reverse order of setting
    report.replaced = f"{type(model).__name__}.{name} + {original_loss.__name__} -> {FUSED_NAME}"


def _patch_decoder(model: nn.Module, name: str, head: nn.Linear, report: LossPatch) -> None:
    """memplan's decoder's fused loss: the head always deferred, TokenLoss resolving it."""
    _set(report.undo, head, "forward", lambda hidden: defer(head, hidden, report.use))
    report.replaced = f"{type(model).__name__}.{name} + TokenLoss -> {FUSED_NAME}"


def why_not_fused(model: nn.Module, loss_fn: object) -> str | None:
    """Why the fused loss cannot apply to `model` trained on `loss_fn` (its model file's loss; None: its own); None
    when it can."""
    found = head_of(model)
    if isinstance(found, str):
        return found
    name, head = found
    if "forward" in vars(model):
        return "its forward is wrapped already (an instance attribute)"
    if hasattr(type(model), "loss_function"):  # a HuggingFace model: the loss inside forward
        losses = sys.modules.get(HF_LOSSES)
        own = model.loss_function
        if own is not getattr(losses, "ForCausalLMLoss", None):
            return f"its loss_function is {getattr(own, '__name__', type(own).__name__)}, not ForCausalLMLoss"
        return hf_forward_reason(type(model), name)
    if not isinstance(loss_fn, TokenLoss):
        return "its loss is not memplan's TokenLoss on its head's output"
    return decoder_forward_reason(type(model), name)


def patch_loss(model: nn.Module, choice: str, loss_fn: object = None) -> LossPatch:
    """Apply the loss `choice` (modes.LOSSES) to `model`, trained on `loss_fn` (its model file's loss; None: the
    model's own): `fused` where the module docstring says it applies; a report saying what changed, or why nothing."""
    report = LossPatch(check_loss(choice))
    if getattr(model, STATE, None) is not None:
        raise PatchError("the model's loss is patched already; unpatch_loss it first")
    if choice == AS_BUILT:
        return report
    assert choice == FUSED
    reason = why_not_fused(model, loss_fn)
    if reason is not None:
        report.notes.append(f"--loss {choice} changes nothing in this model: {reason}")
        return report
    name, head = head_of(model)
    (_patch_causal_lm if hasattr(type(model), "loss_function") else _patch_decoder)(model, name, head, report)
    setattr(model, STATE, report)
    return report


def unpatch_loss(model: nn.Module) -> None:
    """Undo `patch_loss`: the model computes its logits and loss as built again."""
    report = vars(model).pop(STATE, None)
    for undo in report.undo if report is not None else ():
        undo()
