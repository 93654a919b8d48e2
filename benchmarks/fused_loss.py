"""The fused linear cross-entropy (`--loss fused`): its bytes next to memory.LossShape's formulas, and whole steps'
peaks with and without it.

Part 1 traces a step of a model that is only its head (planner/workloads/lm_head.py: the bytes above the step's start
are the loss's own) for a few shapes, fp32, bf16 and bf16 autocast, unfused and fused, next to the formulas.
Part 2 traces whole steps, unfused and fused: memplan's Llama and GPT-2 with a 32,000-token vocabulary and hidden 64
(fp32, the CPU, real tensors), a HuggingFace Llama of that shape (bf16-mixed, fake CUDA), and with --big
Llama-3-8B's config (bf16-mixed, batch 1, sequence 8192, every layer checkpointed, fake CUDA; minutes). It prints
each step's peak and the peak of its forward and backward (the loss's part of the step; AdamW's step may peak above).

    .venv/bin/python benchmarks/fused_loss.py
    .venv/bin/python benchmarks/fused_loss.py --big
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from memplan.modes import AS_BUILT, FUSED, LOSSES
from memplan.planner.layers.memory import LossShape, loss_bytes
from memplan.planner.workloads.lm_head import head_workload
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.cuda import fake_device
from memplan.traces.inputs.trace_model import trace_step

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
}
SHAPES = [(256, 64, 4000), (1024, 128, 32000), (512, 256, 50257)]
MODEL_FILE = """import dataclasses

from memplan.planner.workloads.{kind} import TINY, build_workload


def build(batch_size, seq_len, dtype, device):
    return build_workload(batch_size, seq_len, dtype, device, config=dataclasses.replace(TINY, vocab_size=32000))
"""
HF_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


def loss_of(n: int, h: int, v: int, dtype: torch.dtype, cast: torch.dtype | None, loss: str) -> int:
    """The loss's own bytes in a traced step of a head-only model."""
    return loss_bytes(capture_step(lambda: head_workload(n, h, v, dtype, cast, loss)))


def loss_table() -> None:
    """Part 1: the loss's own bytes, measured and by formula."""
    print(f"{'n':>5} {'h':>4} {'v':>6} {'dtype':>10} {'unfused':>13} {'formula':>13} {'fused':>11} {'formula':>11}")
    for n, h, v in SHAPES:
        for name, (dtype, cast) in PRECISIONS.items():
            measured = {loss: loss_of(n, h, v, dtype, cast, loss) for loss in LOSSES}
            p, pw = (2 if name != "fp32" else 4), torch.finfo(dtype).bits // 8
            shape = LossShape(n, h, v, p, pw, pw)
            print(
                f"{n:>5} {h:>4} {v:>6} {name:>10} {measured[AS_BUILT]:>13,} {shape.unfused():>13,} "
                f"{measured[FUSED]:>11,} {shape.fused():>11,}"
            )


def forward_backward_peak(trace) -> int:
    """The most bytes live at once in the step's forward and backward."""
    steps = [i for i, phase in enumerate(trace.phase) if phase in ("forward", "backward")]
    start, end = int(trace.alloc[steps].min()), int(trace.alloc[steps].max())
    return max(int(trace.size[(trace.alloc <= t) & (trace.free > t)].sum()) for t in range(start, end + 1))


def step_rows(steps: dict[str, StepSpec]) -> None:
    """Part 2: each step's peak and forward-and-backward peak, unfused and fused."""
    print(f"{'step':<44} {'loss':>8} {'peak live':>17} {'fwd+bwd peak':>17}")
    for name, step in steps.items():
        for loss in LOSSES:
            trace = trace_step(step.replace(loss=loss))
            print(f"{name:<44} {loss:>8} {trace.peak()[0]:>17,} {forward_backward_peak(trace):>17,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big", action="store_true", help="also Llama-3-8B at sequence 8192 (fake; minutes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fake_device.install()
    loss_table()
    print()
    with tempfile.TemporaryDirectory() as folder:
        files = {}
        for kind in ("llama", "gpt2"):
            files[kind] = Path(folder) / f"vocab_{kind}.py"
            files[kind].write_text(MODEL_FILE.format(kind=kind))
        (Path(folder) / "config.json").write_text(json.dumps(HF_CONFIG))
        steps = {
            "memplan llama, v 32000, h 64, s 256, fp32": StepSpec(str(files["llama"]), batch=1, seq=256),
            "memplan gpt2, v 32000, h 64, s 256, fp32": StepSpec(str(files["gpt2"]), batch=1, seq=256),
            "HF llama, v 32000, h 64, s 256, bf16-mixed": StepSpec(
                folder, batch=1, seq=256, dtype="bf16-mixed", device="cuda", fake=True
            ),
        }
        if args.big:
            steps["llama-3-8b, s 8192, bf16-mixed, full"] = StepSpec(
                str(ROOT / "examples/configs/llama-3-8b.json"), batch=1, seq=8192, dtype="bf16-mixed",
                device="cuda", fake=True, mode="full",
            )  # fmt: skip
        step_rows(steps)


if __name__ == "__main__":
    main()
