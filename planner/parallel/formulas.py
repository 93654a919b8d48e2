"""Per-rank activation bytes of one Transformer layer under tensor (and sequence) parallelism, REFERENCE §1.

With sequence parallelism every region is split over the t ranks, so a rank holds 1/t of the single-
process layer's bytes in every mode. With tensor parallelism alone the LayerNorm inputs, the inputs of
the two column-parallel linears and the two dropout masks after the sub-layers stay replicated: sbh(4p+2)
(Tempo: the two LayerNorm outputs and masks, sbh(2p+2)), and the rest is divided by t. The baseline and
selective rows are REFERENCE §1's; the Tempo rows follow from the same split.
"""

from __future__ import annotations

from memplan.planner.layers.memory import LayerShape

# mode -> (replicated bytes per sbh, split bytes per sbh, as²b bytes per element) as functions of p
_TENSOR_PARALLEL = {
    "baseline": (lambda p: 4 * p + 2, lambda p: 12 * p, lambda p: 2 * p + 1),
    "selective": (lambda p: 4 * p + 2, lambda p: 12 * p, lambda p: 0),
    "tempo": (lambda p: 2 * p + 2, lambda p: 8 * p + 4, lambda p: p + 1),
    "tempo+selective": (lambda p: 2 * p + 2, lambda p: 8 * p + 4, lambda p: 0),
}


def parallel_formula(shape: LayerShape, mode: str, t: int, sequence_parallel: bool) -> float:
    """Bytes one rank holds for backward for one layer (shape: the whole layer's s, b, h, a and p)."""
    if sequence_parallel:
        return shape.formula(mode) / t
    if mode not in _TENSOR_PARALLEL:
        raise ValueError(f"no formula for mode {mode!r}")
    replicated, split, attention = (f(shape.p) for f in _TENSOR_PARALLEL[mode])
    sbh, as2b = shape.s * shape.b * shape.h, shape.a * shape.s * shape.s * shape.b
    return sbh * replicated + (sbh * split + as2b * attention) / t
