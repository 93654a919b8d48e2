"""Whether memplan's attention core computes what a HuggingFace attention module computes, before a mode routes
the module through it.

A module may pass its attention function keywords memplan's cores do not read (Gemma 2's `softcap`), or its own
eager function may read the module (GPT-OSS's attention sinks). The module's call is read from its source (the
keywords it passes and, where they are the module's attributes, their values), then its own eager function and
memplan's reference core are run on one small random input with those keywords: the module is left as built,
with the reason, unless they agree. The check is a probe (probe.py): real CPU tensors of its own, outside fake
tensors, on stand-ins for the module's small parameters.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from torch import nn

from memplan.modes import BASELINE
from memplan.planner.layers import hf_attention, probe

SEQUENCE = 6  # the probe's tokens
SPREAD = 4.0  # the probe's query scale: scores of order ten, where a soft cap or a sink shows
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # the agreement asked of the two in fp32 (memplan's tests: 1e-4)
UNKNOWN = object()  # a keyword whose value is known only when the module runs


def call_keywords(module: nn.Module) -> dict[str, object]:
    """The keywords `module`'s forward passes its attention function, with their values where they are constants
    or the module's attributes (`self.attn_logit_softcapping`), UNKNOWN otherwise; the dropout is left out."""
    return {name: value_of(node, module) for name, node in keyword_nodes(type(module))}


@functools.cache
def keyword_nodes(module_type: type) -> tuple[tuple[str, ast.expr], ...]:
    """The keywords (name, expression) `module_type`'s forward passes the function it takes from the registry."""
    try:
        source = textwrap.dedent(inspect.getsource(hf_attention.unwrapped_forward(module_type)))
    except (OSError, TypeError):
        return ()
    tree = ast.parse(source)
    interfaces = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and hf_attention.REGISTRY_NAME in ast.unparse(node.value)
    }
    return tuple(
        (keyword.arg, keyword.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in interfaces
        for keyword in node.keywords
        if keyword.arg is not None and keyword.arg != "dropout"
    )


def value_of(node: ast.expr, module: nn.Module) -> object:
    """The value of a constant or of `self.a.b` on `module`, UNKNOWN for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "self" and names):
        return UNKNOWN
    value = module
    for name in reversed(names):
        value = getattr(value, name, UNKNOWN)
        if value is UNKNOWN:
            break
    return value


def shapes(module: nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of `module`, from its attributes or its config."""
    config = module.config
    heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
    head_dim = head_dim or config.hidden_size // heads
    groups = getattr(module, "num_key_value_groups", 1)
    return heads, max(heads // groups, 1), head_dim


def mismatch(module: nn.Module, core: str = BASELINE) -> str | None:
    """Why memplan's `core` would not compute what `module` computes (one line), or None when it would."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = type(module).__name__
    keywords = call_keywords(module)
    try:
        eager = hf_attention.attention_function(module, hf_attention.EAGER)
    except hf_attention.AttentionPatchError as error:
        return str(error)
    # 1. Keywords the eager function reads that memplan's cores do not, given at run time or not None.
    read = set(hf_attention.extra_parameters(type(module)))
    late = sorted(k for k, v in keywords.items() if v is UNKNOWN and k in read)
    if late:
        return f"{name} passes its attention {', '.join(late)} at run time, which memplan's cores do not compute"
    given = sorted(f"{k}={v!r}" for k, v in keywords.items() if k in read and v is not UNKNOWN and v is not None)
    if given:
        return f"{name}'s attention computes {', '.join(given)}, which memplan's cores do not"
    known = {k: v for k, v in keywords.items() if v is not UNKNOWN}
    # 2. Both functions on one small random input, outside fake tensors.
    with probe.isolated() as generator:
        heads, kv_heads, head_dim = shapes(module)
        stand_in = probe.stand_in(module, generator)
        query = SPREAD * torch.randn(1, heads, SEQUENCE, head_dim, generator=generator)
        key, value = (torch.randn(1, kv_heads, SEQUENCE, head_dim, generator=generator) for _ in range(2))
        mask = torch.full((SEQUENCE, SEQUENCE), torch.finfo(torch.float32).min).triu(1)[None, None]
        arguments = (query, key, value, mask)
        options = {"scaling": getattr(module, "scaling", head_dim**-0.5), **known, "dropout": 0.0}
        try:
            expected = eager(stand_in, *arguments, **options)[0]
            got = ALL_ATTENTION_FUNCTIONS[hf_attention.register(core)](stand_in, *arguments, **options)[0]
        except Exception as error:  # noqa: BLE001 - any failure of the probe leaves the module as built
            return f"{name}'s attention could not be compared with memplan's core ({type(error).__name__}: {error})"
        agree = got.shape == expected.shape and torch.allclose(got, expected, **TOLERANCE)
    if not agree:
        return f"{name}'s own eager attention is not memplan's softmax(q·kᵀ·scale + mask)·v (on a random input)"
    return None
