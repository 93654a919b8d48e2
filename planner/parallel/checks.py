"""Rank-side checks of the parallel GPT-2 layer, run under `traces.ranks.launch.launch` by tests and benchmarks.

`layer_bytes` counts what one rank's share of a layer saves for backward (autograd's saved tensors) and
`traced_layer_bytes` measures it with the tracer (two layers minus one), each next to the formula;
`layer_errors` compares the parallel layer's output and gradients with the single-process layer's
on the same weights and input. Both return JSON-ready dicts.
"""

from __future__ import annotations

import torch
from torch import nn

from memplan.planner.layers.memory import LayerShape, held_for_backward, saved_bytes
from memplan.planner.layers.patch import patch
from memplan.planner.parallel import comm
from memplan.planner.parallel.formulas import parallel_formula
from memplan.planner.parallel.layer import ParallelGPT2Layer
from memplan.planner.parallel.model import build_workload as build_parallel
from memplan.planner.workloads import gpt2
from memplan.planner.workloads.gpt2 import GPT2Config, GPT2Layer
from memplan.traces.capture import capture_step
from memplan.traces.recorder import recording

DTYPES = {4: torch.float32, 2: torch.bfloat16}


def _full_layer(shape: LayerShape, dropout: float, seed: int) -> GPT2Layer:
    torch.manual_seed(seed)
    layer = GPT2Layer(GPT2Config(hidden=shape.h, heads=shape.a, dropout=dropout, attn_dropout=dropout))
    with torch.no_grad():  # non-trivial LayerNorm affine parameters, so their gradients are tested too
        for ln in (layer.ln1, layer.ln2):
            ln.weight.normal_(1.0, 0.2)
            ln.bias.normal_(0.0, 0.2)
    return layer.to(DTYPES[shape.p])


def _causal(s: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((s, s), float("-inf"), dtype=dtype).triu(1)


def layer_bytes(
    shape: LayerShape, mode: str, sequence_parallel: bool, dropout: float = 0.1, group=None, seed: int = 0
) -> dict:
    """Bytes this rank's share of one layer holds for backward (the causal mask, a buffer, not counted)."""
    t, dtype = comm.world(group), DTYPES[shape.p]
    layer = ParallelGPT2Layer.from_layer(_full_layer(shape, dropout, seed), group, sequence_parallel).train()
    patch(layer, mode)
    holder = nn.Module()
    holder.layer = layer
    holder.register_buffer("causal", _causal(shape.s, dtype))
    s_local = shape.s // t if sequence_parallel else shape.s
    x = torch.randn(s_local, shape.b, shape.h, dtype=dtype, requires_grad=True)
    measured = saved_bytes(holder, lambda: layer(x, holder.causal))
    formula = parallel_formula(shape, mode, t, sequence_parallel)
    return {
        "rank": comm.rank(group),
        "t": t,
        "mode": mode,
        "sequence_parallel": sequence_parallel,
        "measured": measured,
        "formula": formula,
        "ratio": measured / formula,
    }


def traced_layer_bytes(shape: LayerShape, mode: str, sequence_parallel: bool, group=None) -> dict:
    """Bytes one layer holds for backward on this rank, from the tracer: what a captured training step of
    the parallel GPT-2 holds into backward with two layers minus with one (REFERENCE §1's measure)."""

    def build(layers: int):
        config = GPT2Config(hidden=shape.h, heads=shape.a, layers=layers)
        workload = build_parallel(
            shape.b, shape.s, DTYPES[shape.p], config=config, sequence_parallel=sequence_parallel, group=group
        )
        patch(workload.model, mode)
        return workload

    held = [held_for_backward(capture_step(lambda layers=layers: build(layers))) for layers in (1, 2)]
    t = comm.world(group)
    formula = parallel_formula(shape, mode, t, sequence_parallel)
    return {
        "rank": comm.rank(group),
        "t": t,
        "mode": mode,
        "sequence_parallel": sequence_parallel,
        "measured": held[1] - held[0],
        "formula": formula,
        "ratio": (held[1] - held[0]) / formula,
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def layer_errors(shape: LayerShape, mode: str, sequence_parallel: bool, group=None, seed: int = 0) -> dict:
    """Largest relative difference between the parallel layer (this rank's share, under `mode`) and the
    plain single-process layer: output, input gradient and every parameter gradient (dropout 0)."""
    t, r = comm.world(group), comm.rank(group)
    full = _full_layer(shape, 0.0, seed).train()
    causal = _causal(shape.s, DTYPES[shape.p])
    x = torch.randn(shape.b, shape.s, shape.h, dtype=DTYPES[shape.p])
    grad_y = torch.randn_like(x)
    x_full = x.clone().requires_grad_()
    y = full(x_full, causal)
    y.backward(grad_y)

    layer = ParallelGPT2Layer.from_layer(full, group, sequence_parallel).train()
    patch(layer, mode)
    seq = lambda z: z.transpose(0, 1).chunk(t if sequence_parallel else 1, dim=0)[r if sequence_parallel else 0]  # noqa: E731
    x_par = seq(x).contiguous().requires_grad_()
    y_par = layer(x_par, causal)
    y_par.backward(seq(grad_y).contiguous())

    h, n4 = shape.h // t, layer.mlp.fc1.weight.shape[0]
    qkv_rows = torch.cat([torch.arange(i * shape.h + r * h, i * shape.h + (r + 1) * h) for i in range(3)])
    pairs = {
        "output": (y_par, seq(y)),
        "input_grad": (x_par.grad, seq(x_full.grad)),
        "ln1.weight": (layer.ln1.weight.grad, full.ln1.weight.grad),
        "ln1.bias": (layer.ln1.bias.grad, full.ln1.bias.grad),
        "ln2.weight": (layer.ln2.weight.grad, full.ln2.weight.grad),
        "ln2.bias": (layer.ln2.bias.grad, full.ln2.bias.grad),
        "qkv.weight": (layer.attention.qkv.weight.grad, full.attention.qkv.weight.grad[qkv_rows]),
        "qkv.bias": (layer.attention.qkv.bias.grad, full.attention.qkv.bias.grad[qkv_rows]),
        "proj.weight": (layer.attention.proj.weight.grad, full.attention.proj.weight.grad[:, r * h : (r + 1) * h]),
        "proj.bias": (layer.attention.proj.bias.grad, full.attention.proj.bias.grad),
        "fc1.weight": (layer.mlp.fc1.weight.grad, full.mlp.fc1.weight.grad[r * n4 : (r + 1) * n4]),
        "fc1.bias": (layer.mlp.fc1.bias.grad, full.mlp.fc1.bias.grad[r * n4 : (r + 1) * n4]),
        "fc2.weight": (layer.mlp.fc2.weight.grad, full.mlp.fc2.weight.grad[:, r * n4 : (r + 1) * n4]),
        "fc2.bias": (layer.mlp.fc2.bias.grad, full.mlp.fc2.bias.grad),
    }
    return {
        "rank": r,
        "t": t,
        "mode": mode,
        "sequence_parallel": sequence_parallel,
        "errors": {name: _rel(a.detach(), b.detach()) for name, (a, b) in pairs.items()},
    }


def model_errors(sequence_parallel: bool, seq_len: int = 16, group=None) -> dict:
    """Relative difference of the loss and of the (replicated) embedding gradients between the tiny
    parallel GPT-2 and the single-process one built from the same seed (dropout 0)."""

    config = GPT2Config(dropout=0.0, attn_dropout=0.0)
    plain = gpt2.build_workload(2, seq_len, config=config)
    plain.loss_fn(plain.forward(), plain.inputs).backward()
    par = build_parallel(2, seq_len, config=config, sequence_parallel=sequence_parallel, group=group)
    loss = par.loss_fn(par.forward(), par.inputs)
    loss.backward()
    reference = plain.loss_fn(plain.forward(), plain.inputs).detach()
    return {
        "rank": comm.rank(group),
        "loss": _rel(loss.detach(), reference),
        "wte": _rel(par.model.wte.weight.grad, plain.model.wte.weight.grad),
        "wpe": _rel(par.model.wpe.weight.grad, plain.model.wpe.weight.grad),
        "ln_f": _rel(par.model.ln_f.weight.grad, plain.model.ln_f.weight.grad),
    }


def collective_frees(repeats: int = 20, group=None) -> dict:
    """Record `repeats` rounds of every collective on fresh temporaries and count the allocations the
    recorder saw and the frees it saw: equal when every free is seen, the backend's own threads' included."""

    with recording(torch.device("cpu")) as recorder:
        recorder.begin_step()
        for _ in range(repeats):
            comm.all_gather_seq(torch.randn(8, 2, 16), group)
            comm.reduce_scatter_seq(torch.randn(8, 2, 16), group)
            comm.all_reduce_(torch.randn(8, 2, 16), group)
        events = recorder.end_step()
    return {
        "rank": comm.rank(group),
        "allocations": int((events.size > 0).sum()),
        "frees": int((events.size < 0).sum()),
    }


def run_cases(work, cases: list[dict]) -> list[dict]:
    """The rank function for `launch`: each case is {"check": "bytes"|"traced"|"errors"|"model"|"frees",
    "shape": [s, b, h, a, p], "mode": ..., "sequence_parallel": ...} ("model" needs only the last, "frees"
    nothing); returns one result per case."""
    checks = {"bytes": layer_bytes, "traced": traced_layer_bytes, "errors": layer_errors}
    special = {"model": lambda c: model_errors(c["sequence_parallel"]), "frees": lambda c: collective_frees()}
    return [
        special[c["check"]](c)
        if c["check"] in special
        else checks[c["check"]](LayerShape(*c["shape"]), c["mode"], c["sequence_parallel"])
        for c in cases
    ]
