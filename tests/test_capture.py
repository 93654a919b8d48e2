"""Capture of a real training step: exact bytes of model state, peak against an independent counter,
determinism of the allocation sequence, and labels (phase, category, module, op)."""

from __future__ import annotations

import textwrap
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memplan.planner.report.trace_text import render_trace
from memplan.planner.workloads import bert
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.inputs.model_file import load_workload
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.inputs.workload import Workload
from memplan.traces.summary import summarize

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class TinyNet(nn.Module):
    """Embedding, two residual MLP blocks with LayerNorm and dropout, and a head tied to the embedding."""

    def __init__(self, vocab: int = 50, hidden: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, 4 * hidden),
                nn.GELU(),
                nn.Dropout(0.1),
                nn.Linear(4 * hidden, hidden),
            )
            for _ in range(2)
        )
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def tiny_workload() -> Workload:
    torch.manual_seed(0)
    model = TinyNet()
    ids = torch.randint(0, 50, (2, 8))
    return Workload(model, (ids,), torch.optim.AdamW(model.parameters()), name="tiny")


def model_state_bytes(model: nn.Module) -> tuple[int, int, int]:
    """(parameter + buffer bytes, parameter bytes, number of parameters), tied parameters counted once."""
    params = list(model.parameters())  # unique Parameter objects
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return param_bytes + buffer_bytes, param_bytes, len(params)


def bytes_by_category(trace) -> Counter:
    totals: Counter = Counter()
    for size, cat in zip(trace.size, trace.category):
        totals[cat] += int(size)
    return totals


class LiveStorageCounter(TorchDispatchMode):
    """Independent live-byte count: every storage an op returns, dropped when its weak reference expires."""

    def __init__(self, resident: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in resident:  # in-place ops return these storages: they must not count twice
            self._add(t)
        self.peak = self._live_bytes()

    def _add(self, t: torch.Tensor) -> None:
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata not in self.live:
            self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())

    def _live_bytes(self) -> int:
        return sum(n for _, n in self.live.values())

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._add(t)
        self.peak = max(self.peak, self._live_bytes())
        return out


def warm(w: Workload) -> Workload:
    """The workload after one step (its optimizer state exists)."""
    w.step()
    return w


def resident_tensors(w: Workload) -> list[torch.Tensor]:
    tensors = list(w.model.parameters()) + list(w.model.buffers())
    tensors += [t for s in w.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tensors += [t for t in tree_leaves(w.inputs) if isinstance(t, torch.Tensor)]
    tensors += (
        [t for t in vars(w.loss_fn).values() if isinstance(t, torch.Tensor)] if hasattr(w.loss_fn, "__dict__") else []
    )
    return tensors


@pytest.fixture(scope="module")
def bert_trace():
    return bert.build_workload(batch_size=2, seq_len=16), capture_step(lambda: bert.build_workload(2, 16))


def test_model_state_bytes_match_the_model():
    w = tiny_workload()  # tied head: the shared weight counts once everywhere
    trace = capture_step(tiny_workload)
    state, param_bytes, n_params = model_state_bytes(w.model)
    got = bytes_by_category(trace)
    assert got["parameter"] == state
    assert got["gradient"] == param_bytes  # one gradient per parameter, same size
    # AdamW: exp_avg and exp_avg_sq per parameter, plus one fp32 scalar `step` tensor per parameter.
    assert got["optimizer"] == 2 * param_bytes + 4 * n_params
    # every gradient buffer is freed by zero_grad(set_to_none=True) within the step
    grads = [i for i, c in enumerate(trace.category) if c == "gradient"]
    assert sorted(int(trace.size[i]) for i in grads) == sorted(
        p.numel() * p.element_size() for p in w.model.parameters()
    )
    assert all(trace.free[i] < trace.end and trace.phase[i] == "backward" for i in grads)


def test_peak_agrees_with_an_independent_counter(bert_trace):
    w, trace = bert_trace
    counter = LiveStorageCounter(resident_tensors(w))
    with counter:
        w.step()
    traced, _ = trace.peak()
    assert abs(traced - counter.peak) <= 0.02 * counter.peak, (traced, counter.peak)


def test_two_captures_allocate_the_same_sizes_in_the_same_order():
    first = capture_step(lambda: bert.build_workload(2, 16))
    second = capture_step(lambda: bert.build_workload(2, 16))
    third = capture_step(lambda: warm(bert.build_workload(2, 16)), warmup=False)  # the step after a warm-up
    sizes = first.size[first.recorded].tolist()
    assert len(sizes) > 100
    for other in (second, third):
        assert other.size[other.recorded].tolist() == sizes
        assert other.alloc.tolist() == first.alloc.tolist()
        assert other.free.tolist() == first.free.tolist()


def test_phases_follow_the_step_and_labels_name_modules_and_ops(bert_trace):
    w, trace = bert_trace
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    rec = trace.recorded
    phases = [trace.phase[i] for i in rec if trace.phase[i] in order]
    assert phases == sorted(phases, key=order.get)
    assert set(phases) == set(order)
    modules = {f"model.{n}" if n else "model" for n, _ in w.model.named_modules()} | {"loss"}
    labelled = {trace.module[i] for i in rec if trace.module[i]}
    assert labelled <= modules and len(labelled) > 5
    assert all(trace.op[i].startswith("aten::") or trace.op[i] == "python scalar" for i in rec)
    # saved activations: allocated in forward and still live when backward starts
    acts = [i for i in rec if trace.category[i] == "activation"]
    assert acts and all(trace.phase[i] == "forward" for i in acts)
    first_backward = min(trace.alloc[i] for i in rec if trace.phase[i] == "backward")
    assert all(trace.free[i] >= first_backward for i in acts)
    # the attention output projection of layer 0 holds a forward buffer named after its module
    assert any(m.startswith("model.layers.0") for m in labelled)


def test_the_kernels_own_buffers_are_marked_and_counted_in_the_summary(bert_trace):
    _, trace = bert_trace
    internal = [i for i in trace.recorded if trace.internal[i]]
    assert trace.meta["internal_marked"] and internal
    assert all(trace.internal[i] for i in trace.recorded if trace.op[i] == "python scalar")  # never an op's output
    summary = summarize(trace)
    assert summary.internal == len(internal) and 0 <= summary.internal_at_peak <= summary.peak_bytes
    assert f"{len(internal):,} buffers are kernels' own" in render_trace(summary)


def test_a_trace_with_measured_cuda_peaks_shows_them_beside_its_own(bert_trace):
    """A trace carrying PyTorch's measured CUDA peak (a GPU capture's) shows it in the summary next to its own."""
    _, trace = bert_trace
    peak = trace.peak()[0]
    trace.meta["cuda_measured"] = {"peak_requested": peak - 512}
    try:
        text = render_trace(summarize(trace))
    finally:
        del trace.meta["cuda_measured"]  # the module's trace, shared
    assert "PyTorch measured the same step's peak at" in text and "+512 bytes from it" in text
    assert "PyTorch measured" not in render_trace(summarize(trace))


@pytest.mark.parametrize("mode", ["tempo", "tempo+selective"])
def test_backward_buffers_of_custom_autograd_functions_name_their_module(mode):
    from memplan.planner.layers import patch

    def build():
        w = bert.build_workload(2, 16)
        patch(w.model, mode)
        return w

    trace = capture_step(build)
    backward = [i for i in trace.recorded if trace.phase[i] == "backward"]
    unnamed = [trace.op[i] for i in backward if not trace.module[i]]
    # only the seed gradient of loss.backward() is made outside any module
    assert unnamed == ["aten::ones_like"], unnamed
    assert {trace.module[i] for i in backward} >= {"loss", "model.layers.0.mlp.act", "model.layers.1.attention.core"}


def test_untrained_optimizer_state_is_labelled_when_created_during_the_step():
    w = tiny_workload()
    trace = capture_step(tiny_workload, warmup=False)  # the first step creates AdamW's moments and counters
    _, param_bytes, n_params = model_state_bytes(w.model)
    created = [i for i in trace.recorded if trace.category[i] == "optimizer"]
    assert sum(int(trace.size[i]) for i in created) == 2 * param_bytes + 4 * n_params
    assert all(trace.phase[i] == "optimizer" and trace.free[i] == trace.end for i in created)


def test_optimizer_state_on_another_device_is_not_the_captured_devices():
    """A tensor the optimizer keeps on another device (here `meta`, as a CUDA AdamW keeps `step` on the CPU)
    is neither an error nor a buffer of the trace (the first GPU run refused every model for it)."""

    def build():
        torch.manual_seed(0)
        model = nn.Linear(16, 16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.state[model.weight]["elsewhere"] = torch.empty(1000, device="meta")
        return Workload(model, torch.randn(4, 16), optimizer, name="elsewhere")

    trace = capture_step(build)
    assert 4000 not in trace.size.tolist()
    parameter_bytes = sorted(int(s) for s, c in zip(trace.size, trace.category) if c == "parameter")
    assert parameter_bytes == [16 * 4, 16 * 16 * 4]


@pytest.mark.parametrize("name", ["bert", "gpt2", "hf_bert", "hf_gpt2"])
def test_example_model_files_capture_with_exact_state_bytes(name):
    def build():
        return load_workload(StepSpec(EXAMPLES / f"{name}.py", batch=2, seq=16))

    w = build()
    trace = capture_step(build)
    state, param_bytes, n_params = model_state_bytes(w.model)
    got = bytes_by_category(trace)
    assert got["parameter"] == state
    assert got["gradient"] == param_bytes
    assert got["optimizer"] == 2 * param_bytes + 4 * n_params
    assert got["activation"] > 0 and got["temporary"] > 0


def test_a_plain_step_allocates_exactly_the_recorded_sequence():
    """The k-th allocation of a plain (unprofiled) step is the k-th recorded buffer, with its exact size:
    the replay allocator, given one slot per recorded buffer, sees no size mismatch, extra or missing request."""
    from memplan.planner.replay.cpu_session import CPUPlanAllocator
    from memplan.planner.replay.schedule import CPU_ALIGNMENT, Schedule

    def build():
        return load_workload(StepSpec(EXAMPLES / "gpt2.py", batch=2, seq=16, mode="tempo"))

    trace = capture_step(build)
    w = build()
    w.step()  # warm, as the captured step was
    sizes = [int(trace.size[i]) for i in trace.recorded]
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + -(-size // CPU_ALIGNMENT) * CPU_ALIGNMENT)
    arena = offsets[-1] + -(-sizes[-1] // CPU_ALIGNMENT) * CPU_ALIGNMENT
    schedule = Schedule(
        offsets=offsets,
        sizes=sizes,
        reserved_offsets=[],
        reserved_sizes=[],
        arena=arena,
        bound=arena,
        alignment=CPU_ALIGNMENT,
    )
    with CPUPlanAllocator(schedule) as allocator:
        for _ in range(2):
            with allocator.step():
                w.step()
        stats = allocator.stats()
    assert stats["planned_count"] == 2 * len(sizes)
    assert stats["size_mismatch"] == stats["extra"] == stats["missing"] == stats["fallback_count"] == 0


TIED = """
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two modules

    def forward(self, ids):
        return self.head(torch.relu(self.body(self.emb(ids))))


def build(batch_size, seq_len, dtype, device):
    ids = torch.randint(0, 64, (batch_size, seq_len), device=device)
    return {"model": Tied(), "inputs": ids}  # default optimizer: AdamW
"""
EMB = 64 * 16 * 4  # bytes of the tied fp32 weight


@pytest.mark.parametrize("fake", [False, True])
def test_a_tied_parameter_and_its_optimizer_state_share_one_module_label(tmp_path, fake):
    """A parameter held by two modules (a tied embedding and output head) has one module label in the trace:
    the first name `named_parameters()` gives it, for the parameter and for its optimizer state alike."""
    path = tmp_path / "tied.py"
    path.write_text(textwrap.dedent(TIED))
    trace = trace_step(StepSpec(path, batch=2, seq=4, fake=fake))
    resident = [(c, m, int(s)) for c, m, s, a in zip(trace.category, trace.module, trace.size, trace.alloc) if a == 0]
    tied = {(c, m) for c, m, s in resident if s == EMB and c in ("parameter", "optimizer")}
    # the weight once, and AdamW's exp_avg and exp_avg_sq for it: all under model.emb, its named_parameters() name
    assert tied == {("parameter", "model.emb"), ("optimizer", "model.emb")}
    assert sum(1 for c, m, s in resident if s == EMB and c == "optimizer") == 2
    params = {m for c, m, _ in resident if c == "parameter"}
    state = {m for c, m, _ in resident if c == "optimizer"}
    assert params == state == {"model.emb", "model.body"}  # model.head holds nothing of its own


def test_a_free_on_another_thread_is_recorded_where_it_happens():
    """A storage whose last reference goes on another thread (as a gloo worker thread drops a collective's tensors
    after the program dropped its own) is freed in the trace there, not kept alive to the step's end: that thread
    reports to no memory reporter, so the recorder's wrapper of the CPU allocator reports the free itself."""
    from memplan.traces.recorder import recording

    with recording(torch.device("cpu")) as recorder:
        recorder.begin_step()
        held = [torch.empty(1000)]
        worker = threading.Thread(target=held.clear)
        worker.start()
        worker.join()
        torch.empty(2000)
        events = recorder.end_step()
    assert events.size.tolist() == [4000, -4000, 8000, -8000]
