"""Bytes a forward pass holds for backward, and the per-layer formulas of REFERENCE §1 they are checked against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memplan.errors import MemplanError
from memplan.modes import BASELINE, REGISTRY, TEMPO, Mode, mode
from memplan.planner.layers.fused_loss import chunk_sizes


class MeasureError(MemplanError):
    """A measurement was asked of something it does not apply to (unknown mode, trace without backward)."""


def saved_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `forward()` runs (the graph is kept
    until return)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    storages: dict[int, int] = {}
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    kept.clear()
    return sum(storages.values())


FORMULA_MODES = tuple(name for name, m in REGISTRY.items() if m.patches)  # as-built: no formula, nothing known of it


@dataclass(frozen=True)
class LayerShape:
    """The symbols of REFERENCE §1: sequence s, micro-batch b, hidden h, heads a, bytes per element p."""

    s: int
    b: int
    h: int
    a: int
    p: int

    def formula(self, name: str) -> int:
        """Activation bytes one Transformer layer holds for backward under the mode `name` (Megatron's accounting,
        REFERENCE §1), from the mode's parts: full keeps the layer's input; tempo keeps sbh(10p + 6) where the
        baseline keeps sbh(16p + 2) outside the attention core; the core keeps as²b(2p + 1), tempo's as²b(p + 1)
        (the dropped-out probabilities rebuilt), and nothing when selective recomputes it. An offloading mode keeps
        nothing on the device: its layer's bytes are on the host (`host_formula`)."""
        chosen = mode(name)
        sbh, as2b, p = self.s * self.b * self.h, self.a * self.s * self.s * self.b, self.p
        if not chosen.patches:
            raise MeasureError(f"no formula for layers mode {name!r}: it is whatever the model file builds")
        if chosen.offloads:
            return 0
        if chosen.checkpoints:
            return sbh * p  # the layer's input; everything else is recomputed in backward
        outside_core = sbh * (10 * p + 6) if chosen.tempo else sbh * (16 * p + 2)
        core = 0 if chosen.recomputes_attention else as2b * (p + 1) if chosen.tempo else as2b * (2 * p + 1)
        return outside_core + core


def host_formula(shape: LayerShape | LlamaLayerShape, name: str) -> int:
    """Bytes one layer of `shape` moves to the host (each way) under the mode `name`: what the mode without offload
    keeps on the device; 0 for a mode that offloads nothing."""
    chosen = mode(name)
    return shape.formula(chosen.resident) if chosen.offloads else 0


GENERATOR_STATE = {"cpu": 5056, "cuda": 16}  # bytes of the RNG state a checkpoint keeps (CPU MT19937; CUDA Philox)


@dataclass(frozen=True)
class ReversibleBytes:
    """What a stack of reversible blocks (`layers.reversible`) costs in activation memory."""

    held: int  # held from forward into backward by the whole stack
    rebuild: int  # at most this much more while backward rebuilds one block (one branch's graph at a time)


def reversible_formula(shape: LayerShape, layers: int, device: str = "cpu", extra: int = 0) -> ReversibleBytes:
    """Activation bytes of `layers` reversible blocks of `shape` on `device`: the two output streams (2·s·b·h·p),
    the generator states before each block's F and G (2·layers·GENERATOR_STATE, the only term growing with the
    layers; on CUDA the CPU's states, kept too, are host memory) and `extra`, the bytes of the extra arguments every
    F takes (GPT-2's causal mask: s·s·p); rebuilding a block holds at most one baseline layer's activations
    (REFERENCE §1) on top."""
    held = 2 * shape.s * shape.b * shape.h * shape.p + 2 * layers * GENERATOR_STATE[device] + extra
    return ReversibleBytes(held=held, rebuild=shape.formula(BASELINE))


@dataclass(frozen=True)
class LlamaLayerShape:
    """The symbols of a Llama-style layer (HuggingFace's LlamaDecoderLayer: two RMSNorms, rotary grouped-query
    attention, SwiGLU MLP): s, b, h, a heads, k key/value heads, f MLP width, p; how attention is computed
    (SDPA, or HuggingFace's written-out "eager") and whether it has dropout in training."""

    s: int
    b: int
    h: int
    a: int
    k: int
    f: int
    p: int
    device: str = "cpu"
    attention: str = "sdpa"  # "sdpa" (SDPA's kernels) or "eager" (HuggingFace's eager_attention_forward)
    dropout: bool = False  # attention dropout in training: on the CPU SDPA then takes its math path

    def formula(self, name: str) -> int:
        """Activation bytes one layer holds for backward under the mode `name` (memplan's derivation, docs/layers.md:
        "Formulas"); as built, the layer is HuggingFace's. An offloading mode keeps nothing on the device."""
        chosen = mode(name)
        if chosen.offloads:
            return 0
        s, b, h, p = self.s, self.b, self.h, self.p
        sbh, sbf = s * b * h, s * b * self.f
        # 1. Per RMSNorm: HuggingFace keeps the fp32 input (4 B), the normalised input and the output (p each)
        #    and rstd (4 B a row); Tempo's keeps the output (the next linear layer's input) and rstd.
        norms = 2 * ((4 + 2 * p) * sbh + 4 * s * b)
        tempo_norms = 2 * (p * sbh + 4 * s * b)
        # 2. SwiGLU: gate, SiLU and up outputs and their product (4 x p, f wide); Tempo keeps the SiLU output
        #    over the gate's, the up output and a 1-byte branch mask, and rebuilds the product in backward.
        mlp, tempo_mlp = 4 * p * sbf, (2 * p + 1) * sbf
        if chosen.checkpoints:  # the layer's input and the generator state to replay its dropout
            return p * sbh + GENERATOR_STATE[self.device]
        attention = self.attention_bytes(chosen)
        return tempo_norms + attention + tempo_mlp if chosen.tempo else norms + attention + mlp

    def attention_bytes(self, chosen: Mode) -> int:
        """What the attention of one layer keeps for backward under the mode `chosen` (not full, whose layer keeps
        its input)."""
        s, b, h, p = self.s, self.b, self.h, self.p
        sbh, kv, square = s * b * h, s * b * h * self.k // self.a, self.b * self.a * s * s
        math_path = self.attention == "sdpa" and self.dropout and self.device == "cpu"
        # 1. SDPA's fused kernels keep no s x s tensor: rotated q and k, v, the output and the fp32
        #    log-sum-exp per head and row; selective has nothing to drop.
        if self.attention == "sdpa" and not math_path:
            return p * (2 * sbh + 2 * kv) + 4 * self.a * s * b
        # 2. Written out (eager, or SDPA's math path): q, k and v repeated to every head, and the output.
        inputs = 4 * p * sbh
        if chosen.recomputes_attention:  # the core recomputed: the generator state replays dropout
            return inputs + GENERATOR_STATE[self.device] * self.dropout
        # 3. memplan's reference core (baseline, tempo): the softmax output; with dropout a 1-byte mask and the
        #    dropped-out probabilities, which tempo rebuilds from the other two.
        if chosen.core == TEMPO:
            return inputs + ((p + 1) * square if self.dropout else p * square)
        if chosen.core == BASELINE:
            return inputs + ((2 * p + 1) * square if self.dropout else p * square)
        # 4. As built, HuggingFace's eager attention: the fp32 softmax output; with dropout (torch's dropout keeps
        #    an input-sized noise tensor on the CPU, a 1-byte mask on CUDA) the dropped-out probabilities, else
        #    their cast to p where p is not fp32. SDPA's math path computes all of it in fp32.
        if math_path:  # in fp32 whatever p: copies of q, k and v, the softmax output, noise, probabilities
            return (p + 3 * 4) * sbh + 3 * 4 * square
        dropped = ((p if self.device == "cpu" else 1) + p) * square
        return inputs + 4 * square + (dropped if self.dropout else p * square * (p != 4))


def held_for_backward(trace) -> int:
    """Bytes a captured step holds from forward into backward: forward-phase buffers still live when backward begins."""
    backward = [i for i, phase in enumerate(trace.phase) if phase == "backward"]
    if not backward:
        raise MeasureError("the trace has no backward phase: nothing is held for backward")
    start = int(trace.alloc[backward].min())
    forward = [i for i, phase in enumerate(trace.phase) if phase == "forward"]
    live = [i for i in forward if trace.alloc[i] < start < trace.free[i]]
    return int(trace.size[live].sum())


@dataclass(frozen=True)
class LossShape:
    """A language model's loss: n tokens, hidden size h, vocabulary v, and bytes per element of the logits as computed
    (p: autocast's dtype under autocast, else the model's), of the hidden states (ph) and of the head's weight (pw)."""

    n: int
    h: int
    v: int
    p: int
    ph: int
    pw: int

    @property
    def casts(self) -> int:
        """Bytes of autocast's copies of the weight and the hidden states in p (none when they are in p already)."""
        return self.v * self.h * self.p * (self.pw != self.p) + self.n * self.h * self.p * (self.ph != self.p)

    def unfused(self) -> int:
        """The most bytes the unfused loss (head, fp32 upcast, cross-entropy) holds above the step's before it: the
        logits, and when log-softmax's backward runs its fp32 output, the gradient coming in and the one going out,
        nv(p + 12); with autocast's copies of the weight and the hidden states."""
        return self.n * self.v * (self.p + 12) + self.casts

    def fused(self) -> int:
        """The most bytes the fused loss (planner/layers/fused_loss.py) holds above the step's before it, in its second
        pass: the gradients of the hidden states and the weight, autocast's copies, and one vocabulary block of
        logits (n x c columns, c = max(h, v / 16): fused_loss.chunk_sizes; in fp32, and in p when p is not fp32); and
        34 bytes a token (the labels' masks and int64 copies, each row's share of the loss, the log-sum-exp)."""
        block = self.n * chunk_sizes(self.n, self.h, self.v)[1] * (4 + self.p * (self.p != 4))
        return self.n * self.h * self.ph + self.v * self.h * self.pw + self.casts + block + 34 * self.n


def loss_bytes(trace) -> int:
    """The most bytes a captured step holds in its forward and backward above those it held when it began, kernels'
    own scratch (internal: a CPU matmul's) left out: a step of a model that is only its head and loss
    (tests/test_fused_loss.py) gives the loss's own."""
    steps = [i for i, phase in enumerate(trace.phase) if phase in ("forward", "backward")]
    if not steps:
        raise MeasureError("the trace has no forward or backward phase")
    start, end = int(trace.alloc[steps].min()), int(trace.alloc[steps].max())
    size = trace.size * (trace.internal == 0)
    held = int(size[(trace.alloc < start) & (trace.free > start)].sum())
    return max(int(size[(trace.alloc <= t) & (trace.free > t)].sum()) for t in range(start, end + 1)) - held
