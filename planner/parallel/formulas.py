"""Per-rank activation bytes of one Transformer layer under tensor (and sequence) parallelism, REFERENCE §1.

With sequence parallelism every region is split over the t ranks, so a rank holds 1/t of the single-
process layer's bytes in every mode. With tensor parallelism alone the LayerNorm inputs, the inputs of
the two column-parallel linears and the two dropout masks after the sub-layers stay replicated: sbh(4p+2)
(Tempo: the two LayerNorm outputs and masks, sbh(2p+2)), and the rest is divided by t. The baseline and
selective rows are REFERENCE §1's; the Tempo rows follow from the same split.
"""

from __future__ import annotations

from memplan.modes import mode as registered
from memplan.planner.layers.memory import LayerShape


def parallel_formula(shape: LayerShape, mode: str, t: int, sequence_parallel: bool) -> float:
    """Bytes one rank holds for backward for one layer (shape: the whole layer's s, b, h, a and p)."""
    if sequence_parallel:
        return shape.formula(mode) / t
    chosen, p = registered(mode), shape.p
    if not chosen.patches or chosen.checkpoints:
        raise ValueError(f"no formula for mode {mode!r}")
    # bytes per sbh replicated on every rank and split over them, and per as²b element of the attention core
    replicated, split = (2 * p + 2, 8 * p + 4) if chosen.tempo else (4 * p + 2, 12 * p)
    attention = 0 if chosen.recomputes_attention else p + 1 if chosen.tempo else 2 * p + 1
    sbh, as2b = shape.s * shape.b * shape.h, shape.a * shape.s * shape.s * shape.b
    return sbh * replicated + (sbh * split + as2b * attention) / t
