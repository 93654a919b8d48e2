"""The memory/compute trade-off on a BERT-Large-shaped model and a Llama-style decoder, and `optimize` at three
memory sizes between the every-layer tempo+selective and as-built plans.

For each model: `planner.jobs.tradeoff.tradeoff` (every layer mode, torch.compile at each budget, and for BERT its
reversible variant: plan arena, caching reserved, FLOPs, CPU step time, the Pareto frontiers) with its figure in
docs/, then
`planner.jobs.optimize.optimize` at three sizes, each printed against the uniform choices and Megatron's
first-k-layers recipe. Target: at some size a per-layer mix fits with less recompute than every uniform
mode that fits.

Both at batch 2, s = 512 (real traces on this machine).

`--only llama3-8b` (issue 34's benchmark): Llama-3-8B from its HuggingFace config (fake CUDA traces, bf16 mixed
precision, s = 8192) on an H100 80GB. The largest batch each family of actions fits alone (every layer in a
recompute or offload mode, the fused loss, each optimizer choice: `memplan fit` of that configuration, its plan)
with the time it adds, then `optimize --max-batch` over every layer mode and action (the 32 layers are alike: 8
uniform traces and 2 walks through the modes measure them). Target: optimize fits a larger batch than every single
action at less added time than full checkpointing.

Example: .venv/bin/python benchmarks/tradeoff.py                   # both models (cold Inductor cache: ~40 minutes)
         .venv/bin/python benchmarks/tradeoff.py --only llama --no-compile
         .venv/bin/python benchmarks/tradeoff.py --only llama3-8b     # fake traces of 8B at s = 8192
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from memplan.gpus import gpu
from memplan.modes import ADAMW_4BIT, ADAMW_8BIT, ADAMW_HOST, AS_BUILT, FULL, FUSED, OPTIMIZE_MODES
from memplan.planner.cost import count_step_flops
from memplan.planner.cost.rates import step_rates
from memplan.planner.jobs.fit import fit_model
from memplan.planner.jobs.optimize import (
    OptimizeError,
    OptimizeOptions,
    every_layer,
    measure_batch,
    model_layers,
    optimize,
)
from memplan.planner.jobs.optimize import answer as optimize_answer
from memplan.planner.jobs.tradeoff import DEFAULT_BUDGETS, TradeoffOptions, tradeoff
from memplan.planner.report.optimize_text import render_optimize
from memplan.planner.report.tradeoff_table import render_tradeoff
from memplan.planner.simulate.measure import measure
from memplan.planner.simulate.verdict import device_memory
from memplan.step import StepSpec
from memplan.traces.host import host_bytes
from memplan.traces.inputs.trace_model import CaptureChoice, sized_capture, trace_step
from memplan.units import human_bytes

ROOT = Path(__file__).resolve().parents[1]
BERT_LARGE_4 = '''
from dataclasses import replace

from memplan.planner.workloads.bert import LARGE, build_workload


def build(batch_size, seq_len, dtype, device):
    """BERT-Large's shape with 4 of its 24 layers."""
    return build_workload(batch_size, seq_len, dtype, device, config=replace(LARGE, layers=4))
'''
BERT_LARGE_4_REVERSIBLE = '''
from dataclasses import replace

from memplan.planner.workloads.bert import LARGE
from memplan.planner.workloads.reversible import build_bert_workload


def build(batch_size, seq_len, dtype, device):
    """BERT-Large's shape with 4 of its 24 layers as a reversible stack."""
    return build_bert_workload(batch_size, seq_len, dtype, device, config=replace(LARGE, layers=4))
'''
LLAMA_4 = '''
from memplan.planner.workloads.llama import LlamaConfig, build_workload

CONFIG = LlamaConfig(vocab_size=32000, hidden=1024, heads=16, kv_heads=8, layers=4, ffn_hidden=2816)


def build(batch_size, seq_len, dtype, device):
    """A Llama-style decoder (RMSNorm, SwiGLU, rotary positions, grouped-query SDPA) of 4 layers, hidden 1024."""
    return build_workload(batch_size, seq_len, dtype, device, config=CONFIG)
'''
MODELS = {"bert-large": BERT_LARGE_4, "llama": LLAMA_4}  # name: model file text
VARIANTS = {"bert-large": {"bert_large_4_reversible": BERT_LARGE_4_REVERSIBLE}}  # name: {file name: text}
SHAPE = {"batch": 2, "seq": 512}  # activations decide the peak here: at s = 128 AdamW's step does, in every mode


def log(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def run_model(name: str, folder: Path, budgets: tuple[float, ...], repeats: int, tradeoff_too: bool) -> None:
    model_file = folder / f"{name.replace('-', '_')}_4.py"
    model_file.write_text(MODELS[name])
    variants = []
    for file_name, text in VARIANTS.get(name, {}).items():
        variants.append(folder / f"{file_name}.py")
        variants[-1].write_text(text)
    # 1. The trade-off table and figure, variants included.
    if tradeoff_too:
        figure = ROOT / "docs" / f"tradeoff-{name}.png"
        options = {"budgets": budgets, "repeats": repeats, "output": str(figure), "variants": tuple(map(str, variants))}
        opts = TradeoffOptions(StepSpec(model_file, **SHAPE), **options)
        result = tradeoff(opts, log)
        print(f"\n## {name}: trade-off, {SHAPE}\n{render_tradeoff(result.summary())}", flush=True)
    # 2. optimize at three sizes between every layer tempo+selective and every layer as built, on one measurement.
    opts = OptimizeOptions(StepSpec(model_file, **SHAPE), memory=0, actions=False)  # the layer modes alone
    layers = model_layers(opts)
    capture = sized_capture(opts.capture, opts.step)
    start = time.monotonic()
    measured = measure_batch(opts, layers, opts.step.batch, capture.fake, log)
    seconds = time.monotonic() - start
    print(f"\n## {name}: optimize's model, {SHAPE}: {len(measured.traces)} traces, {seconds:.0f} s")
    arenas = {m: measure(measured.traces[every_layer(layers, m), ()], time_limit=10).plan.arena for m in OPTIMIZE_MODES}
    low, high = arenas["tempo+selective"], arenas["as-built"]
    for fraction in (0.25, 0.5, 0.75):
        start = time.monotonic()
        opts = replace(opts, memory=int(low + fraction * (high - low)))
        answer = optimize_answer(opts, layers, measured, capture, log, start)
        print(f"\n## {name}: optimize at {fraction:.0%} of the way from tempo+selective to as-built, {SHAPE}")
        print(render_optimize(answer.summary()), flush=True)
        uniform = [c.recompute for c in answer.uniform if c.fits]
        beats = answer.chosen is not None and all(answer.chosen.recompute < r for r in uniform)
        print(
            f"per-layer mix beats every uniform mode that fits: {'yes' if beats else 'no'} "
            f"({time.monotonic() - start:.0f} s)",
            flush=True,
        )


LLAMA3_8B = ROOT / "examples" / "configs" / "llama-3-8b.json"
LLAMA3_8B_STEP = {"seq": 8192, "dtype": "bf16-mixed", "device": "cuda", "fake": True}
H100 = gpu("H100-80GB")
ALONE = {  # each family of actions alone: (layer mode, loss, optimizer)
    "every layer full (checkpointing)": (FULL, AS_BUILT, AS_BUILT),
    "every layer tempo+selective": ("tempo+selective", AS_BUILT, AS_BUILT),
    "every layer tempo+offload": ("tempo+offload", AS_BUILT, AS_BUILT),
    "loss fused": (AS_BUILT, FUSED, AS_BUILT),
    "optimizer adamw-8bit": (AS_BUILT, AS_BUILT, ADAMW_8BIT),
    "optimizer adamw-4bit": (AS_BUILT, AS_BUILT, ADAMW_4BIT),
    "optimizer adamw-host": (AS_BUILT, AS_BUILT, ADAMW_HOST),
}


def added_seconds(step: StepSpec, trace, base_flops: int, rates) -> float:
    """The time a configuration adds at the H100's rates, as optimize counts it: its extra FLOPs (layer modes and
    loss: optimizer choices count none), its offload's transfers, the host optimizer's copies and host step."""
    seconds = 0.0
    if step.optimizer == AS_BUILT:
        seconds += max(0, count_step_flops(step).total - base_flops) / rates.flops
    host = host_bytes(trace)
    seconds += 0 if host is None else rates.transfer_seconds(host.moved)
    if step.optimizer == ADAMW_HOST:
        state = trace.meta["optimizer_state"]
        seconds += rates.host_optimizer_seconds(state["elements"], state["parameter_bytes"])
    return seconds


def measured_at(opts, layers, batch: int, earlier, cache: Path | None):
    """optimize's measurement of the 8B step at `batch` (its traces: 20 minutes and more here), kept in `cache` as a
    pickle when given, so that the choice can be asked again without tracing."""
    path = None if cache is None else cache / f"llama3-8b-{opts.step.seq}-b{batch}.pickle"
    if path is not None and path.exists():
        log(f"[batch {batch}] the measurement from {path}")
        return pickle.loads(path.read_bytes())
    measured = measure_batch(opts, layers, batch, True, log, earlier)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(measured))
    return measured


def run_llama3_8b(alone: bool = True, batches: list[int] | None = None, cache: Path | None = None) -> None:
    """Issue 34's benchmark (the module docstring); without `alone`, optimize's part only; with `batches`, optimize
    at each of them instead of its --max-batch search (each batch's measurement kept in `cache` when given)."""
    step = StepSpec(str(LLAMA3_8B), batch=1, **LLAMA3_8B_STEP).on_gpu(H100)
    memory, _ = device_memory(None, H100, step)
    rates = step_rates(step.dtype, H100, None)
    base_flops = count_step_flops(step).total
    print(f"\n## Llama-3-8B, {LLAMA3_8B_STEP}, on {H100.name} ({memory:,} B for the plan): each action alone")
    print(f"{'configuration':<36}{'peak live b=1':>16}{'largest batch':>15}{'added s/step b=1':>18}", flush=True)
    for name, (mode, loss, optimizer) in ALONE.items() if alone else ():
        start = time.monotonic()
        alone = step.replace(mode=mode, loss=loss, optimizer=optimizer)
        trace = trace_step(alone, progress=log)
        batch = 0
        if measure(trace, name, time_limit=5).plan.arena <= memory:  # batch 1 fits: how far does it go
            batch = fit_model(alone, gpu=H100, modes=(mode,), capture="fake", progress=log).modes[0].batch["plan"]
        print(f"{name:<36}{human_bytes(trace.peak()[0]):>16}{batch:>15}"
              f"{added_seconds(alone, trace, base_flops, rates):>18.3f}   ({time.monotonic() - start:.0f} s)",
              flush=True)  # fmt: skip
    # optimize at each batch in turn (each answer printed as it comes; an optimizer choice measured once), or with
    # --max-batch its own search
    opts = OptimizeOptions(step, max_batch=batches is None, capture="fake", gpu=H100)  # every mode: the layers are
    #                                                   alike, so 8 uniform traces and 2 walks measure them, not 64
    if batches is None:
        start = time.monotonic()
        print(render_optimize(optimize(opts, log).summary()), f"\n({time.monotonic() - start:.0f} s)", flush=True)
        return
    layers, earlier = model_layers(opts), None
    for batch in batches:
        start = time.monotonic()
        measured = measured_at(opts, layers, batch, earlier, cache)
        earlier = earlier or measured
        print(f"\n## Llama-3-8B: optimize at batch {batch}, every mode and action ({time.monotonic() - start:.0f} s "
              "to measure)")  # fmt: skip
        try:
            answer = optimize_answer(opts, layers, measured, CaptureChoice(True, "--capture fake"), log, start)
            print(render_optimize(answer.summary()), flush=True)
        except OptimizeError as e:
            print(f"nothing fits: {e} ({time.monotonic() - start:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted([*MODELS, "llama3-8b"]), help="one model only")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out of the trade-off")
    parser.add_argument("--optimize-only", action="store_true", help="only the optimize part")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per trade-off point")
    parser.add_argument("--batches", help="llama3-8b: optimize at these batches (1,2) instead of --max-batch")
    parser.add_argument("--cache", type=Path, help="llama3-8b with --batches: keep each batch's traces here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    budgets = () if args.no_compile else DEFAULT_BUDGETS
    if args.only == "llama3-8b":
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
        run_llama3_8b(not args.optimize_only, batches, args.cache)
        return
    with tempfile.TemporaryDirectory() as folder:
        for name in [args.only] if args.only else MODELS:
            run_model(name, Path(folder), budgets, args.repeats, not args.optimize_only)


if __name__ == "__main__":
    main()
