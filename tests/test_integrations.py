"""memplan.integrations: the HuggingFace Trainer callback records one whole optimizer step, the trace
`memplan.record` gives around the same step of a loop that does what Trainer does; likewise for Accelerate."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import memplan
from memplan.errors import MemplanError

pytest.importorskip("accelerate", reason="transformers' Trainer and Accelerate's loop need accelerate installed")

from memplan.integrations.huggingface import (  # noqa: E402
    SOURCE,
    MemplanCallback,
    dry_run,
    record_accelerate,
    unwrap_optimizer,
)

transformers.logging.set_verbosity_error()
COLUMNS = ("size", "alloc", "free", "category", "phase", "op", "module")
VOCAB, SEQ, BATCH = 64, 16, 2


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences as a causal LM's examples (input_ids, labels)."""

    def __init__(self, n: int = 32):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer(tmp_path, steps: int, accumulation: int = 1, callbacks=(), **options) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=accumulation,
        max_steps=steps, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, max_grad_norm=1.0, **{"use_cpu": True, **options},
    )  # fmt: skip
    return transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=list(callbacks))


def rows(trace) -> tuple[list, list]:
    """The step's buffers in allocation order, and those alive at its start (in no particular order)."""
    table = list(zip(*(getattr(trace, c).tolist() if c in ("size", "alloc", "free") else getattr(trace, c)
                       for c in COLUMNS)))  # fmt: skip
    return [r for r in table if r[1] > 0], sorted(r for r in table if r[1] == 0)


def trainer_step(trainer: transformers.Trainer, batches: list, items) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step as Trainer's loop runs it (transformers 5, `Trainer._run_epoch`): every micro-batch's
    forward and backward with the loss checked and summed, clipping, the optimizer, the scheduler, zero_grad."""
    model = trainer.model
    for inputs in batches:
        loss = trainer.training_step(model, inputs, items)
        if not (torch.isnan(loss) or torch.isinf(loss)):
            trainer._tr_loss += loss
    grad_norm = trainer._clip_grad_norm(model)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    return loss, grad_norm  # Trainer holds both past the step's end (the last micro-batch's loss, the norm it logs)


def trained_to(tmp_path, step: int, accumulation: int):
    """A Trainer trained through steps 0..K-1, and step K's micro-batches and item count as Trainer fetches them."""
    hand = trainer(tmp_path, steps=step, accumulation=accumulation)
    hand.train()
    batches_left = iter(hand.get_train_dataloader())
    for _ in range(step * accumulation):
        next(batches_left)
    batches, items = hand.get_batch_samples(batches_left, accumulation, hand.args.device)
    return hand, batches, items


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_callbacks_trace_is_memplan_records_of_the_same_step(tmp_path, accumulation):
    step = 2
    callback = MemplanCallback(step=step, output=tmp_path / "callback.json.gz")
    with callback:
        trainer(tmp_path, steps=step + 1, accumulation=accumulation, callbacks=[callback]).train()
    by_callback = memplan.load_trace(tmp_path / "callback.json.gz")
    assert rows(by_callback) == rows(callback.trace)

    # The same run by hand: Trainer trains steps 0..K-1, then step K is Trainer's loop body under memplan.record.
    hand, batches, items = trained_to(tmp_path, step, accumulation)
    optimizer = unwrap_optimizer(hand.optimizer)
    with memplan.record(hand.model, optimizer, inputs=(batches, items)) as recording:
        held = trainer_step(hand, batches, items)
    del held
    assert rows(by_callback) == rows(recording.trace)

    trace = by_callback
    assert trace.meta["source"] == SOURCE and trace.meta["step"] == step
    assert trace.meta["gradient_accumulation_steps"] == accumulation
    categories = set(trace.category)
    assert {"parameter", "gradient", "optimizer", "activation", "input"} <= categories
    assert {"forward", "backward", "optimizer"} <= set(trace.phase)
    inputs = sum(int(s) for s, c in zip(trace.size, trace.category) if c == "input")
    assert inputs == accumulation * 2 * BATCH * SEQ * 8 + items.nbytes  # ids and labels of each micro-batch, the count
    # every micro-batch ran its backward inside the window
    backwards = [
        i for i, p in enumerate(trace.phase) if p == "backward" and trace.op[i] == "aten::embedding_dense_backward"
    ]
    assert len(backwards) == accumulation


class Broken(RuntimeError):
    pass


def test_an_error_inside_the_step_writes_nothing_and_removes_the_recorder(tmp_path):
    out = tmp_path / "step.trace.json.gz"
    callback = MemplanCallback(step=1, output=out)
    run = trainer(tmp_path, steps=3, accumulation=2, callbacks=[callback])
    calls = []

    def fail_in_step_1s_second_micro_batch(_module, _args):
        calls.append(1)
        if len(calls) == 4:
            raise Broken("out of memory, say")

    run.model.register_forward_pre_hook(fail_in_step_1s_second_micro_batch)
    with pytest.raises(Broken), callback:
        run.train()
    assert len(calls) == 4 and not out.exists() and callback.trace is None
    assert gc.isenabled() and "get_batch_samples" not in vars(run)
    # the recorder is gone: a new recording starts and records
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with memplan.record(model, optimizer, inputs=ids) as recording:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    assert recording.trace.meta["source"] == "memplan.record"


def test_without_with_a_raised_step_stays_open_until_closed(tmp_path):
    """Trainer calls no hook when training raises: the recording is open until close() (or the next train())."""
    out = tmp_path / "step.trace.json.gz"
    callback = MemplanCallback(step=1, output=out)
    run = trainer(tmp_path, steps=3, callbacks=[callback])
    calls = []

    def fail_in_step_1(_module, _args):
        calls.append(1)
        if len(calls) == 2:
            raise Broken("out of memory, say")

    handle = run.model.register_forward_pre_hook(fail_in_step_1)
    with pytest.raises(Broken):
        run.train()
    assert not gc.isenabled()  # the recording is still open
    callback.close()
    assert gc.isenabled() and not out.exists() and callback.trace is None
    handle.remove()
    run.train()  # the same callback in a new run records its step 1
    assert out.exists() and callback.trace.meta["step"] == 1


def test_a_step_past_the_run_records_nothing_and_a_bad_step_is_refused(tmp_path):
    callback = MemplanCallback(step=5, output=tmp_path / "never.json.gz")
    with callback:
        trainer(tmp_path, steps=2, callbacks=[callback]).train()
    assert callback.trace is None and not (tmp_path / "never.json.gz").exists()
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(MemplanError, match="step must be an integer"):
            MemplanCallback(step=bad)


def test_an_accelerate_loops_step_is_recorded_as_memplan_record_records_it(tmp_path):
    """Two micro-batches under `accelerator.accumulate`: record_accelerate around the step's iterations gives the
    trace memplan.record gives around the same step of the plain PyTorch loop it stands for."""
    from accelerate import Accelerator

    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def accelerate_step(accelerator, model, optimizer, pair):
        for ids in pair:
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=ids, labels=ids).loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
                optimizer.step()
                optimizer.zero_grad()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerate_step(accelerator, model, optimizer, batches[:2])
    with record_accelerate(accelerator, model, optimizer, inputs=batches[2:], output=tmp_path / "a.json.gz") as rec:
        accelerate_step(accelerator, model, optimizer, batches[2:])
    assert memplan.load_trace(tmp_path / "a.json.gz").meta["framework"] == "accelerate"

    def plain_step(model, optimizer, pair):
        for ids in pair:
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    plain_step(model, optimizer, batches[:2])
    with memplan.record(model, optimizer, inputs=batches[2:]) as expected:
        plain_step(model, optimizer, batches[2:])
    assert rows(rec.trace) == rows(expected.trace)


def events_of_the_step(trace) -> list[tuple]:
    """Every allocation (+size) and free (-size) with its labels in time order, the state first, less the storages
    of Trainer's own loop (the last loss, the logged norm: `unknown`), which a fake run sees from their making."""
    timed = []
    for i in range(len(trace)):
        if trace.category[i] != "unknown":
            label = (trace.op[i], trace.module[i], trace.phase[i], trace.category[i])
            timed.append((int(trace.alloc[i]), int(trace.size[i]), label))
            if trace.free[i] < trace.end:
                timed.append((int(trace.free[i]), -int(trace.size[i]), label))
    return [(size, label) for _, size, label in sorted(timed, key=lambda event: event[0])]


def state_bytes(trace) -> dict[str, int]:
    """Bytes alive as the step begins, per category."""
    totals: dict[str, int] = {}
    for size, alloc, category in zip(trace.size.tolist(), trace.alloc.tolist(), trace.category):
        if alloc == 0 and category != "unknown":
            totals[category] = totals.get(category, 0) + size
    return totals


def test_a_dry_run_is_memplan_records_fake_step_and_holds_the_real_runs_state(tmp_path):
    """dry_run builds and trains the Trainer under fake tensors to step K: the trace memplan.record(fake=True) gives
    around Trainer's loop body for that step, with the real run's parameters, gradients, optimizer state and inputs."""
    step, accumulation = 2, 2
    out = tmp_path / "dry.json.gz"
    fake = dry_run(lambda: trainer(tmp_path, steps=10, accumulation=accumulation), step=step, output=out)
    assert memplan.load_trace(out).meta == fake.meta
    assert fake.meta["fake"] and fake.meta["dry_run"] and fake.meta["source"] == SOURCE and fake.meta["step"] == step
    # the whole program: construction, Trainer's steps before the measured one (each ended at the optimizer's step)
    program = memplan.load_trace(out).program
    assert program.measured == step and [s.measured for s in program.steps[: step + 1]] == [False] * step + [True]
    with memplan.record(fake=True) as recording:
        hand, batches, items = trained_to(tmp_path, step, accumulation)
        with recording.step(hand.model, unwrap_optimizer(hand.optimizer), inputs=(batches, items)):
            held = trainer_step(hand, batches, items)
        del held
    assert events_of_the_step(fake) == events_of_the_step(recording.trace)

    real = MemplanCallback(step=step, output=None)
    with real:
        trainer(tmp_path, steps=step + 1, accumulation=accumulation, callbacks=[real]).train()
    assert state_bytes(fake) == state_bytes(real.trace)


def test_a_dry_run_on_a_fake_cuda_gpu_with_bf16_autocast(tmp_path):
    """On a machine without a GPU: Trainer picks the (fake) CUDA device, pins its batches, autocasts to bf16."""
    build = lambda: trainer(tmp_path, steps=4, use_cpu=False, bf16=True)  # noqa: E731
    trace = dry_run(build, step=1, device="cuda", gpu="A100-80GB")
    assert trace.meta["device"] == "cuda" and trace.meta["gpu"] == "A100-80GB" and trace.meta["fake"]
    parameters = sum(p.numel() * 4 for p in tiny_llama().parameters())
    totals = state_bytes(trace)
    assert totals["parameter"] - 2 * 16 == parameters  # fp32 weights (and the rotary table, a buffer of 2 x 16 B)
    assert totals["optimizer"] == 2 * parameters + 4 * len(list(tiny_llama().parameters()))  # moments, step counts
    assert "workspace" in set(trace.category)  # cuBLAS's, as on the GPU
    assert "aten::_to_copy" in set(trace.op)  # bf16 copies of the weights under autocast


def test_a_dry_run_says_what_is_wrong_in_one_line(tmp_path):
    def broken():
        raise ValueError("no such model")

    made_before = trainer(tmp_path, steps=2)  # real tensors, outside the dry run

    for build, message in (
        (broken, "Trainer's build raised ValueError: no such model"),
        (tiny_llama, "build\\(\\) returned LlamaForCausalLM, not a transformers.Trainer"),
        (lambda: trainer(tmp_path, steps=2), "the run ended before step 5"),
        (lambda: made_before, "the model holds real tensors: make it inside build"),
    ):
        with pytest.raises(MemplanError, match=message) as error:
            dry_run(build, step=5, output=tmp_path / "never.json.gz")
        assert "\n" not in str(error.value)
    assert not (tmp_path / "never.json.gz").exists()


@pytest.mark.slow
def test_the_example_runs_as_printed(tmp_path):
    """examples/hf_trainer_callback.py, as its docstring says to run it (about 20 s on a busy 2-core machine)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_callback.py"
    done = subprocess.run([sys.executable, str(example)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dry run, step 2 on an H100 in bf16" in done.stdout and "fits: True" in done.stdout
    assert memplan.load_trace(tmp_path / "hf-step2.trace.json.gz").meta["step"] == 2
