"""Bytes per Transformer layer of each memory-saving mode next to the formulas, and step-time ratios.

Part 1 measures the BERT-Large layer shape (h=1024, a=16) at s = 128 and 512: the bytes held for
backward by a stack of 2 layers minus a stack of 1 (captured with memplan's tracer, or counted
with saved-tensor hooks with --method saved), per mode and dtype, next to REFERENCE §1's formula.
Part 2 times training steps of a BERT per mode (median of several, interleaved), on the CPU or with
--device cuda on a GPU (both parts then run there).
Part 3 (--llama) measures a HuggingFace Llama layer at Llama 2 7B's shape (h 4096, 32 heads, 32 and 8
key/value heads, MLP 11008, s 4096, bf16) with fake traces next to LlamaLayerShape's formula, and
times each mode's training step of a reduced Llama (median of several, interleaved).
Part 4 (--peaks) gives the peak live bytes of a whole training step under baseline and tempo for a small MLP
with a GELU right after a LayerNorm, the shape where tempo once cost memory (+26.9%).

    .venv/bin/python benchmarks/layers.py
    .venv/bin/python benchmarks/layers.py --seqs 128 --dtypes bf16 --method saved --steps 5
    .venv/bin/python benchmarks/layers.py --llama
    .venv/bin/python benchmarks/layers.py --peaks
    python benchmarks/layers.py --device cuda --seqs 512 --time-shape 512 8 1024 16 24 --time-dtype bf16
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from memplan.planner.cost import time_workloads
from memplan.planner.layers import MODES, patch
from memplan.planner.layers.memory import FORMULA_MODES, LayerShape, LlamaLayerShape, held_for_backward, saved_bytes
from memplan.planner.workloads import bert
from memplan.traces.capture import capture_step
from memplan.traces.fake.mode import module_to
from memplan.traces.inputs.workload import Workload

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def held(mode: str, layers: int, seq: int, batch: int, dtype: torch.dtype, method: str, device: str) -> int:
    """Bytes one BERT-Large-shaped stack of `layers` holds for backward under `mode` (small vocabulary: it cancels)."""
    config = dataclasses.replace(bert.LARGE, vocab_size=1024, layers=layers)

    def build():
        workload = bert.build_workload(batch_size=batch, seq_len=seq, dtype=dtype, device=device, config=config)
        patch(workload.model, mode)
        return workload

    if method == "saved":
        workload = build()
        return saved_bytes(workload.model, workload.forward)
    return held_for_backward(capture_step(build, device))


def memory_table(seqs, dtypes, batch: int, method: str, device: str) -> None:
    print(
        f"bytes per layer, BERT-Large shape (h=1024, a=16), b={batch}, {device}, measured by {method} (L=2 minus L=1)"
    )
    print(
        f"{'s':>4} {'dtype':>5} {'mode':>16} {'measured':>12} {'formula':>12} {'meas/form':>9} {'saving':>7} "
        f"{'formula saving':>14}"
    )
    for seq in seqs:
        for name in dtypes:
            dtype = DTYPES[name]
            shape = LayerShape(s=seq, b=batch, h=1024, a=16, p=torch.finfo(dtype).bits // 8)
            base = None
            for mode in FORMULA_MODES:
                stacks = [held(mode, layers, seq, batch, dtype, method, device) for layers in (2, 1)]
                per_layer = stacks[0] - stacks[1]
                formula = shape.formula(mode)
                base = per_layer if base is None else base
                saving, formula_saving = 1 - per_layer / base, 1 - formula / shape.formula("baseline")
                ratio = f"{per_layer / formula:>9.4f}" if formula else f"{'-':>9}"  # offloaded: 0 B on the device
                print(
                    f"{seq:>4} {name:>5} {mode:>16} {per_layer:>12,} {formula:>12,} {ratio} "
                    f"{saving:>7.1%} {formula_saving:>14.1%}",
                    flush=True,
                )


def time_modes(workloads: dict, steps: int, device: str) -> None:
    """Median step time of each mode's workload over `steps` interleaved steps, against the baseline's."""
    times = time_workloads(workloads, device=device, repeats=steps)
    base = times["baseline"].median
    tokens = next(iter(workloads.values())).inputs
    tokens = (tokens["input_ids"] if isinstance(tokens, dict) else tokens).numel()
    for mode in workloads:
        median = times[mode].median
        print(f"{mode:>16} {median * 1e3:8.1f} ms  {median / base:6.3f}x baseline  {tokens / median:10,.0f} tokens/s")


def step_times(seq: int, batch: int, hidden: int, heads: int, layers: int, steps: int, dtype: str, device: str):
    config = dataclasses.replace(bert.TINY, hidden=hidden, heads=heads, layers=layers, max_positions=max(seq, 512))
    threads = f", {torch.get_num_threads()} thread(s)" if device == "cpu" else ""
    print(
        f"\n{device} step time, BERT h={hidden} a={heads} L={layers} s={seq} b={batch} {dtype}{threads}, "
        f"median of {steps} interleaved steps"
    )
    workloads = {}
    for mode in MODES:
        workloads[mode] = bert.build_workload(
            batch_size=batch, seq_len=seq, dtype=DTYPES[dtype], device=device, config=config
        )
        patch(workloads[mode].model, mode)
    time_modes(workloads, steps, device)


def llama_workload(shape: LlamaLayerShape, layers: int, mode: str, dtype: torch.dtype, device: str) -> Workload:
    """A HuggingFace LlamaForCausalLM of `layers` layers at `shape` (vocabulary 1024: it cancels), under `mode`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=shape.h,
        intermediate_size=shape.f,
        num_hidden_layers=layers,
        num_attention_heads=shape.a,
        num_key_value_heads=shape.k,
        max_position_embeddings=shape.s,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    module_to(model, device=torch.device(device), dtype=dtype)
    patch(model, mode)
    ids = torch.randint(0, 1024, (shape.b, shape.s)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    return Workload(model, {"input_ids": ids, "labels": ids}, optimizer, lambda out, _: out.loss, "llama")


def fake_llama_trace(shape: LlamaLayerShape, layers: int, mode: str, device: str):
    """The fake trace of one bf16 training step of `llama_workload`."""
    return capture_step(lambda: llama_workload(shape, layers, mode, torch.bfloat16, device), device, fake=True)


def llama_table(device: str) -> None:
    """Part 3: a Llama 2 7B-shaped layer per mode, fake traces (L=2 minus L=1), next to LlamaLayerShape."""
    print("\nbytes per layer, HF Llama at Llama 2 7B's shape (h=4096, a=32, f=11008), s=4096 b=1 bf16, fake traces")
    print(f"{'k/v heads':>9} {'mode':>16} {'measured':>14} {'formula':>14} {'meas/form':>9} {'saving':>7}")
    for kv_heads in (32, 8):
        shape = LlamaLayerShape(s=4096, b=1, h=4096, a=32, k=kv_heads, f=11008, p=2, device=device)
        base = None
        for mode in MODES:
            stacks = [held_for_backward(fake_llama_trace(shape, n, mode, device)) for n in (2, 1)]
            per_layer = stacks[0] - stacks[1]
            base = per_layer if base is None else base
            formula = shape.formula(mode)
            print(
                f"{kv_heads:>9} {mode:>16} {per_layer:>14,} {formula:>14,} {per_layer / formula:>9.4f} "
                f"{1 - per_layer / base:>7.1%}",
                flush=True,
            )


def llama_step_times(steps: int, device: str) -> None:
    """Part 3's timing: each mode's training step of a reduced Llama (h 1024, 8 heads, 4 k/v heads, MLP 2816)."""
    shape = LlamaLayerShape(s=512, b=2, h=1024, a=8, k=4, f=2816, p=4, device=device)
    print(
        f"\n{device} step time, HF Llama h={shape.h} a={shape.a} k={shape.k} f={shape.f} L=2 s={shape.s} "
        f"b={shape.b} fp32, median of {steps} interleaved steps"
    )
    time_modes({mode: llama_workload(shape, 2, mode, torch.float32, device) for mode in MODES}, steps, device)


def mlp_peaks() -> None:
    """Part 4: Linear(64, w), LayerNorm(w), GELU, Linear(w, 64) with AdamW, rows x 64 inputs; peak live per mode."""
    print("MLP with a GELU right after a LayerNorm, peak live bytes of a training step")
    print(f"{'dtype':>5} {'rows':>5} {'width':>5} {'baseline':>12} {'tempo':>12}  tempo/baseline")
    for name, dtype in DTYPES.items():
        for rows, width in ((64, 256), (512, 1024)):
            peaks = {}
            for mode in ("baseline", "tempo"):

                def build(mode=mode, rows=rows, width=width, dtype=dtype):
                    torch.manual_seed(0)
                    layers = [torch.nn.Linear(64, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
                    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 64)).to(dtype)
                    patch(model, mode)
                    inputs = torch.randn(rows, 64, dtype=dtype)
                    return Workload(model, inputs, torch.optim.AdamW(model.parameters()), name="mlp")

                peaks[mode] = capture_step(build).peak()[0]
            ratio = peaks["tempo"] / peaks["baseline"]
            print(f"{name:>5} {rows:>5} {width:>5} {peaks['baseline']:>12,} {peaks['tempo']:>12,}  {ratio:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--batch", type=int, default=1, help="micro-batch of the memory part")
    parser.add_argument("--method", choices=["tracer", "saved"], default="tracer")
    parser.add_argument("--steps", type=int, default=9, help="timed steps per mode (0 skips the timing part)")
    parser.add_argument(
        "--time-shape", type=int, nargs=5, default=[128, 4, 256, 4, 2], metavar=("S", "B", "H", "A", "L")
    )
    parser.add_argument("--time-dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--llama", action="store_true", help="part 3 only: the Llama layer at the 7B shape")
    parser.add_argument("--peaks", action="store_true", help="part 4 only: tempo's peak on an MLP, LayerNorm + GELU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peaks:
        mlp_peaks()
        return
    if args.llama:
        llama_table(args.device)
        if args.steps:
            llama_step_times(args.steps, args.device)
        return
    memory_table(args.seqs, args.dtypes, args.batch, args.method, args.device)
    if args.steps:
        step_times(*args.time_shape, steps=args.steps, dtype=args.time_dtype, device=args.device)


if __name__ == "__main__":
    main()
