"""The fast lane (`-m "not slow"`) runs a diagonal of a large parametrized product, the full suite all of it.

`diagonal(*axes)` gives the product of the axes as pytest params, each axis a dict of id -> value (a tuple
spreads over several argument names); case k of the diagonal takes the (k mod length)-th value of every axis,
so the fast lane still meets every value of every axis, and the rest of the product is marked slow.
"""

from __future__ import annotations

import itertools

import pytest


def diagonal(*axes: dict) -> list:
    lengths = [len(axis) for axis in axes]
    on_diagonal = {tuple(k % n for n in lengths) for k in range(max(lengths))}
    params = []
    for index in itertools.product(*(range(n) for n in lengths)):
        chosen = [list(axis.items())[i] for axis, i in zip(axes, index)]
        values = [v for _, value in chosen for v in (value if isinstance(value, tuple) else (value,))]
        marks = () if index in on_diagonal else (pytest.mark.slow,)
        params.append(pytest.param(*values, marks=marks, id="-".join(key for key, _ in chosen)))
    return params


def named(values) -> dict:
    """An axis whose ids are its values (strings)."""
    return {str(v): v for v in values}


def some(values, fast) -> list:
    """`values` as pytest params, those not in `fast` marked slow: the fast lane runs `fast`, the full suite all."""
    return [pytest.param(v, marks=() if v in fast else (pytest.mark.slow,)) for v in values]
