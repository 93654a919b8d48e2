"""Capture one training step as a trace: every allocation and free of the device's allocator.

`capture_step` installs the step recorder (traces/recorder.py) before the workload is built, runs a
warm-up step (it creates the optimizer state and settles lazy initialisation; two for DDP: Workload.warmup_steps),
then records exactly
one `workload.step()`; `record` does the same around one step of any training loop. The recorded
buffers, in allocation order, are the allocations the allocator served during that step (0-byte
requests are not served and not recorded). Every storage alive when the step begins is a buffer with
allocation time 0, freed where the program drops its last reference (an optimizer that replaces its
state, a module that rebinds a buffer), or at the end. A model built before `record` began is adopted:
what its parameters, optimizer and inputs hold counts from then on; other tensors made before it are
not seen, and those the step reads are named in the trace's meta "unrecorded" (traces/unrecorded.py;
`record` warns of them).

With `fake=True` the workload is built and stepped under fake tensors (traces/fake/mode.py): nothing is
allocated or computed, and the trace holds every storage the program's ops return, with the same
labels. On CUDA the caching allocator's history of the step gives the requested (unrounded) sizes
and the streams, and `capture_step` keeps the allocator's own peaks of the step in meta `cuda_measured`.
A real CPU capture runs on one intra-op thread (see `one_cpu_thread`).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memplan.errors import MemplanError
from memplan.gpus import GPU, planned_gpu
from memplan.modes import AS_BUILT
from memplan.planner.layers import fusion
from memplan.planner.layers.patch import host_ledger, idle_notes
from memplan.routing import DEFAULT as DEFAULT_ROUTING
from memplan.routing import Routing
from memplan.step import require_fake_for_routing
from memplan.torch_versions import TorchRules, torch_rules
from memplan.traces.cuda.fake_device import DeviceMemory, fake_cuda_runtime
from memplan.traces.cuda.stream_hooks import cuda_stream_hooks
from memplan.traces.cuda.streams import StreamColumns, StreamLedger, stream_columns
from memplan.traces.fake.mode import DATA_RULE, FakeCapture
from memplan.traces.fake.real_cpu import RealCpu
from memplan.traces.format import PHASES, Program, Trace, make_trace, save
from memplan.traces.inputs.record_args import record_target
from memplan.traces.inputs.workload import Workload
from memplan.traces.program import MeasuredStep, StepWindow, assemble_program
from memplan.traces.progress import CaptureProgress, progress_interval
from memplan.traces.ranks.communication import COMMUNICATION, ddp_buckets, fsdp_stream_names, name_buckets
from memplan.traces.recorder import BACKWARD, FORWARD, OPTIMIZER, OTHER, Events, Recorder, recording
from memplan.traces.resident import resident_storages, resident_tensors
from memplan.traces.step_marks import ROOT_MODULE, StepMarks, marked_step
from memplan.traces.unrecorded import UnrecordedWarning, unrecorded, unrecorded_text

SCALAR_OP = "python scalar"  # an allocation outside any op: a Python number wrapped as a tensor


class CaptureError(MemplanError):
    """A workload cannot be captured (no parameters, unsupported device, inconsistent events)."""


@dataclass
class _Buffer:
    """One buffer while the trace is assembled."""

    size: int
    alloc: int
    free: int
    key: int
    phase: str
    module: str
    op: str
    category: str = ""
    stream: int = 0
    internal: bool = False  # never returned by an op fake tensors see: a kernel's scratch, a wrapped Python number


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """CPU steps inside run on one intra-op thread. With more, a kernel that splits its work over threads
    allocates per-thread scratch on worker threads, in an order that changes from run to run, so no two
    steps allocate the same sequence (a GPU step has no such allocations). Capture and replay use it."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def workload_device(workload: Workload) -> torch.device:
    """The device of the workload's parameters (all must share one device type)."""
    types = {p.device.type for p in workload.model.parameters()}
    if not types:
        raise CaptureError(f"{workload.name}: the model has no parameters to train")
    if len(types) > 1:
        raise CaptureError(f"{workload.name}: parameters on several devices ({', '.join(sorted(types))})")
    device = next(workload.model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        raise CaptureError(f"{workload.name}: capture supports cpu and cuda, not {device.type}")
    return device


def run_user_code(what: str, name: str, call: Callable, error: type[MemplanError] = CaptureError):
    """Run user code (build, a step); an exception from it becomes one line of `error`."""
    try:
        return call()
    except MemplanError:
        raise
    except (Exception, SystemExit) as e:  # user code: sys.exit() in a loss or model is an error too
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise error(f"{name}: the {what} raised {type(e).__name__}" + (f": {first}" if first else "")) from None


def _assemble(live: Events, step: Events, names: list[str], resident: dict, marked: bool) -> list[_Buffer]:
    """Buffers from the storages alive at the start (alloc 0) and the step's events (times 1, 2, ...); with
    `marked`, those no op returned are internal."""
    end = len(step) + 1
    buffers: list[_Buffer] = []
    index: dict[int, int] = {}  # storage key -> its buffer, while live
    for key, size, module in zip(live.key.tolist(), live.size.tolist(), live.module.tolist()):
        known = resident.get(key)
        buffers.append(
            _Buffer(
                known.size if known else size,
                0,
                end,
                key,
                "other",
                known.module if known else names[module],
                "",
                known.category if known else "unknown",
            )
        )
        index[key] = len(buffers) - 1
    columns = (step.key, step.size, step.op, step.module, step.phase, step.output)
    for t, (key, size, op, module, phase, output) in enumerate(zip(*(c.tolist() for c in columns)), start=1):
        if size > 0:
            index[key] = len(buffers)
            label = names[op] or SCALAR_OP
            internal = marked and not output
            buffers.append(_Buffer(size, t, end, key, PHASES[phase], names[module], label, internal=internal))
        else:
            buffers[index.pop(key)].free = t
    return buffers


def _categorize(buffers: list[_Buffer], marks: StepMarks) -> None:
    """Label the step's buffers: gradient, optimizer state, a collective's buffer (communication), activation (saved
    across the forward/backward boundary), or temporary."""

    def live(b: _Buffer, t: int | None) -> bool:
        return t is not None and b.alloc <= t < b.free

    def next_backward(b: _Buffer) -> int | None:
        """When the first backward after the buffer's allocation began (its micro-batch's backward)."""
        at = bisect.bisect_left(marks.backward_starts, b.alloc)
        return marks.backward_starts[at] if at < len(marks.backward_starts) else None

    for b in buffers:
        if b.category:
            continue
        if b.key in marks.grad_keys and live(b, marks.optimizer_at):
            b.category = "gradient"
        elif b.key in marks.state_keys and live(b, marks.optimizer_end):
            b.category = "optimizer"
        elif marks.collectives.get(b.alloc, (None,))[0] == b.key:
            b.category, b.op = COMMUNICATION, marks.collectives[b.alloc][1]
        elif b.phase == "forward" and live(b, next_backward(b)):
            b.category = "activation"
        else:
            b.category = "temporary"


def _requested_sizes(buffers: list[_Buffer], history: list[dict]) -> None:
    """On CUDA the allocator reports rounded block sizes: put back the sizes the program requested and
    the streams, taken in order from the caching allocator's history of the same step."""
    allocated = [b for b in buffers if b.alloc > 0]
    entries = [e for e in history if e["action"] == "alloc"]
    if len(allocated) != len(entries):
        raise CaptureError(
            f"the CUDA allocator history holds {len(entries)} allocations but the recorder "
            f"saw {len(allocated)}: cannot recover the requested sizes"
        )
    for b, entry in zip(allocated, entries):
        if int(entry["addr"]) != b.key:
            raise CaptureError(f"the CUDA allocator history and the recorder disagree at address {b.key:#x}")
        b.size, b.stream = int(entry["size"]), int(entry.get("stream", 0))


@contextlib.contextmanager
def _cuda_history(device: torch.device):
    """The caching allocator's history of the block (a list filled in when it ends)."""
    history: list[dict] = []
    torch.cuda.memory._record_memory_history(context=None, max_entries=10_000_000, device=device, clear_history=True)
    try:
        yield history
        torch.cuda.synchronize(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        history.extend(torch.cuda.memory._snapshot()["device_traces"][index])
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def _garbage_generation() -> int:
    """The oldest generation a collection before the step must reach to free the warm-up's cyclic garbage: it is
    young (a full collection costs ~0.1 s in a torch process), unless torch.compile has run (Dynamo has seen a
    frame; merely imported, as every optimizer imports it, it has not): its graph breaks leave cycles holding
    the warm-up's tensors in older generations."""
    dynamo = sys.modules.get("torch._dynamo")
    return 2 if dynamo is not None and dynamo.utils.counters["frames"]["total"] > 0 else 1


def _resident_at_start(workload: Workload, recorder: Recorder, live: Events, device: torch.device, adopt: bool) -> dict:
    """Labels of the storages alive as the step begins. Every storage the workload holds on the device
    must be among them: with `adopt`, those made before recording began are counted from now on; without,
    one such storage would be invisible, so it is an error."""
    alive = set(live.key.tolist())
    outside = (
        []
        if adopt
        else [  # adopted storages are all alive: nothing to look for
            t
            for t, _, _ in resident_tensors(workload, device.type)
            if t.untyped_storage().nbytes() > 0 and recorder.storage_key(t) not in alive
        ]
    )
    if outside:
        raise CaptureError(
            f"{workload.name}: {len(outside)} of its tensors existed before recording began: "
            "pass capture_step a function that builds the workload, not a built one"
        )
    return resident_storages(workload, recorder.storage_key, alive)


class Recording:
    """One capture in progress (see `record`): the recorder is installed, fake mode entered if asked;
    `step(...)` marks the one step it records, and `trace` is that step's Trace once the block ends."""

    def __init__(
        self,
        recorder: Recorder,
        device: torch.device,
        fake: FakeCapture | None,
        meta: dict,
        progress: CaptureProgress | None = None,
        streams: StreamLedger | None = None,
    ):
        self.trace: Trace | None = None  # set when the step's block ends
        self.program: Program | None = None  # the whole program, set when the session ends (`finish`)
        self._recorder, self._device, self._fake, self._meta = recorder, device, fake, meta
        self._progress = progress
        self._streams = streams if streams is not None else StreamLedger()
        self._marks = 0  # marks made on the recorder
        self._windows: list[StepWindow] = []  # the program's training steps, in order
        self._measured: MeasuredStep | None = None
        self._open: int | None = None  # the start mark of a step the program's own calls opened (see `watch_steps`)
        self._marking = False  # memplan marks the step running now itself

    def _mark(self) -> int:
        """Mark the program's time now; returns the mark's index."""
        self._recorder.mark()
        self._marks += 1
        return self._marks - 1

    @contextlib.contextmanager
    def program_step(self, workload: Workload | None = None) -> Iterator[None]:
        """Mark the block as one (unmeasured) training step of the program: a warm-up step. With `workload`, its
        phases and modules are labelled as the measured step's are."""
        self._marking = True
        start = self._mark()
        try:
            if workload is None:
                yield
            else:
                with marked_step(workload, self._recorder):
                    yield
        finally:
            self._windows.append(StepWindow(start, self._mark()))
            self._marking = False

    @contextlib.contextmanager
    def watch_steps(self) -> Iterator[None]:
        """Mark the training steps and phases of a program memplan does not run itself (`record`, `memplan check`): a
        step begins at the first module call after the last step ended (forward), `torch.autograd.backward` runs in
        backward, an optimizer's step() in the optimizer phase, and the step ends when it returns."""
        recorder, backward = self._recorder, torch.autograd.backward
        paths: dict[int, int] = {}  # id(module) -> its label: its dotted path under the first module called around it
        entered: list[nn.Module] = []

        def started(module, _inputs):
            if self._marking:
                return
            if id(module) not in paths:  # a root: the model the program calls (its submodules' paths are known then)
                for name, m in module.named_modules():
                    paths.setdefault(id(m), recorder.intern(f"{ROOT_MODULE}.{name}" if name else ROOT_MODULE))
            recorder.enter_module(paths[id(module)])
            entered.append(module)
            if recorder.phase_now() == BACKWARD:  # a checkpoint's recomputation
                return
            if self._open is None:
                self._open = self._mark()
            if recorder.phase_now() != FORWARD and torch.is_grad_enabled():
                recorder.set_phase(FORWARD)

        def finished(module, _inputs, _output):
            if entered and entered[-1] is module:
                entered.pop()
                recorder.leave_module()

        def backward_phase(*args, **kwargs):
            if self._marking:
                return backward(*args, **kwargs)
            recorder.set_phase(BACKWARD)
            try:
                return backward(*args, **kwargs)
            finally:
                recorder.set_phase(OTHER)

        def stepping(_optimizer, _args, _kwargs):
            if not self._marking:
                recorder.set_phase(OPTIMIZER)

        def stepped(_optimizer, _args, _kwargs):
            if not self._marking:
                recorder.set_phase(OTHER)
                start = self._open if self._open is not None else self._mark()
                self._windows.append(StepWindow(start, self._mark()))
                self._open = None

        handles = [
            nn.modules.module.register_module_forward_pre_hook(started),
            nn.modules.module.register_module_forward_hook(finished, always_call=True),
            register_optimizer_step_pre_hook(stepping),
            register_optimizer_step_post_hook(stepped),
        ]
        torch.autograd.backward = backward_phase
        try:
            yield
        finally:
            torch.autograd.backward = backward
            for h in handles:
                h.remove()
            while entered:
                entered.pop()
                recorder.leave_module()

    def finish(self) -> None:
        """The whole program (`program`), attached to the measured step's trace (`Trace.program`) when one was
        measured, once the session's block ended."""
        self.program = self.program_so_far()  # a step begun and not finished (stopped, out of memory) runs to its end
        if self.trace is not None:
            self.trace.program = self.program

    def program_so_far(self) -> Program:
        """The whole program up to now, its steps so far (one under way runs to now)."""
        windows = list(self._windows)
        if self._open is not None:
            windows.append(StepWindow(self._open, self._mark()))
        events, marks, adopted = self._recorder.program()
        measured = self._measured
        sizes = {} if measured is None else {
            k: int(s) for k, s, a in zip(measured.keys, measured.trace.size, measured.trace.alloc) if a == 0
        }  # fmt: skip
        real_cuda = self._device.type == "cuda" and self._fake is None
        meta = {"sizes": "block sizes outside the measured step" if real_cuda else "requested", **self._meta}
        windows = sorted(windows, key=lambda w: w.start_mark)
        return assemble_program(events, marks, adopted, sizes, self._recorder.names(), windows, measured, meta)

    def names(self) -> list[str]:
        """The recorder's labels by id (ops, modules), for what reports them by id (a live allocator's errors)."""
        return self._recorder.names()

    def data_dependent(self) -> dict[str, int]:
        """A fake capture's reads of values nobody knew, by op (DATA_RULE); {} for a real one."""
        return dict(self._fake.data_dependent) if self._fake is not None else {}

    def branches(self) -> dict[str, int]:
        """Where the program's code branched on a value nobody knew (`file:line` -> times; traces/fake/branches.py)."""
        return dict(self._fake.branches) if self._fake is not None else {}

    def not_run(self) -> list[str]:
        """The ops a fake capture could not run for want of a fake kernel, in order; [] for a real one."""
        return list(self._fake.not_run) if self._fake is not None else []

    def announce(self, stage: str) -> None:
        """Name what runs now, before the recorded step (building the model, a warm-up step), in progress lines."""
        if self._progress is not None:
            self._progress.stage = stage

    @contextlib.contextmanager
    def step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        inputs: Any = None,
        name: str = "model",
        adopt: bool = False,
    ) -> Iterator[None]:
        """Record the block as the training step of `model` and `optimizer` (labels: module, phase,
        category); `inputs` are tensors held before it (the batch). `adopt` counts storages the model,
        optimizer and inputs hold that were made before recording began (a model built outside)."""
        with self.workload_step(Workload(model=model, inputs=inputs, optimizer=optimizer, name=name), adopt):
            yield

    def check_device(self, workload: Workload) -> torch.device:
        """The workload's device; CaptureError unless it is the recording's."""
        device = workload_device(workload)
        if device.type != self._device.type:
            raise CaptureError(f"{workload.name}: the model is on {device.type}, the capture on {self._device.type}")
        return device

    @contextlib.contextmanager
    def workload_step(self, workload: Workload, adopt: bool = False) -> Iterator[None]:
        """`step` for a Workload, whose loss function is labelled `loss` as well."""
        if self.trace is not None:
            raise CaptureError("a recording holds one step: mark one block with step()")
        device = self.check_device(workload)
        if adopt:
            for tensor, _, _ in resident_tensors(workload, device.type):
                self._recorder.adopt(tensor)
        # 1. The storages alive now, labelled; no cycle collection inside, so frees happen where dropped.
        gc.collect(_garbage_generation())
        self._marking, start_mark = True, self._mark()
        live = self._recorder.begin_step()
        resident = _resident_at_start(workload, self._recorder, live, device, adopt)
        host = host_ledger(workload.model)  # offloaded layers' host copies, timed by the step's events
        if host is not None:
            host.begin(self._recorder.step_events)
        gc.disable()
        try:
            # 2. The step, with module, phase and optimizer marks (and on CUDA the allocator's history).
            with contextlib.ExitStack() as stack:
                real_cuda = device.type == "cuda" and self._fake is None
                history = stack.enter_context(_cuda_history(device)) if real_cuda else None
                marks = stack.enter_context(marked_step(workload, self._recorder))
                self._streams.begin(self._recorder.step_events)
                stack.callback(self._streams.end)
                yield
            events = self._recorder.end_step()
            self._windows.append(StepWindow(start_mark, self._mark(), measured=True))
            host_columns = host.end(len(events) + 1) if host is not None else None
        finally:
            self._marking = False
            self._open = None
            gc.enable()
            if host is not None:
                host.stop()  # a step that raised records no more
        missing = unrecorded(self._recorder.unseen(), self._recorder.names(), self._recorder.storage_key)
        # 3. Buffers: the storages alive at the start and the step's events, categorized, sizes as requested.
        marked = self._recorder.outputs_marked()
        buffers = _assemble(live, events, self._recorder.names(), resident, marked)
        workspaces = self._fake.workspace_keys() if self._fake is not None else set()
        for b in buffers:
            if b.key in workspaces:
                b.category = "workspace"
        name_buckets(buffers, ddp_buckets(workload.model))
        _categorize(buffers, marks)
        if history is not None:
            _requested_sizes(buffers, history)
        self._streams.names.update(fsdp_stream_names(workload.model))
        streams = _streams(buffers, self._streams, self._fake is None, len(events) + 1)
        dtype = next(workload.model.parameters()).dtype
        self.trace = _trace(
            buffers,
            self._device,
            self._fake,
            len(events),
            {
                **streams.meta,
                "model": workload.name,
                **({"unrecorded": missing.to_dict()} if missing is not None else {}),
                "dtype": dtype,
                "optimizer": type(workload.optimizer).__name__,
                "internal_marked": marked,
                **(
                    {"patch": with_idle_notes(workload.patch, workload.model, "compile" in self._meta)}
                    if workload.patch is not None
                    else {}
                ),
                **({"loss_patch": workload.loss_patch.to_dict()} if workload.loss_patch is not None else {}),
                **({"host": host_columns} if host is not None else {}),
                **(
                    {"optimizer_state": workload.optimizer_choice.to_dict()}
                    if workload.optimizer_choice is not None
                    else {}
                ),
                **self._meta,
            },
            streams.syncs,
        )
        self._measured = MeasuredStep(self.trace, [b.key for b in buffers], start_mark)


def _streams(buffers: list[_Buffer], ledger: StreamLedger, real: bool, end: int) -> StreamColumns:
    """Each buffer's stream id and the syncs (traces/cuda/streams.py): a real buffer's stream key is the allocator's
    (`_requested_sizes`; 0 on the CPU), a fake one's the stream current when it was allocated; buffers alive when
    the step began are on the default stream. Frees move for `record_stream`."""
    keys = [b.stream if real or b.alloc == 0 else ledger.stream_at(b.alloc) for b in buffers]
    alloc, free, storage = ([getattr(b, f) for b in buffers] for f in ("alloc", "free", "key"))
    columns = stream_columns(keys, alloc, free, storage, ledger, end)
    for b, stream, free in zip(buffers, columns.stream, columns.free):
        b.stream, b.free = stream, free
    return columns


def with_idle_notes(report: dict, model: nn.Module, compiled: bool) -> dict:
    """The patch report (`PatchReport.to_dict()`) with notes on what the step showed saved nothing (a compiled
    step runs no Python of the modules: nothing to say)."""
    compiled = compiled or any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )
    return report if compiled else {**report, "notes": [*report["notes"], *idle_notes(model)]}


def _trace(
    buffers: list[_Buffer], device: torch.device, fake: FakeCapture | None, events: int, meta: dict, syncs=()
) -> Trace:
    """The Trace of assembled buffers, with the meta every capture records."""
    info = {
        "source": "memplan trace",
        "layers": AS_BUILT,
        "device": device.type,
        "torch": torch.__version__,
        "fake": fake is not None,
        "events": events,
        **meta,
        "dtype": str(meta["dtype"]).replace("torch.", ""),
    }
    if fake is not None:
        fake.known.check()
        info.update(data_rule=DATA_RULE, data_dependent=dict(fake.data_dependent), routing=fake.known.meta())
    columns = {
        "size": [b.size for b in buffers],
        "alloc": [b.alloc for b in buffers],
        "free": [b.free for b in buffers],
        "stream": [b.stream for b in buffers],
        "addr": [b.key if fake is None else -1 for b in buffers],
        "category": [b.category for b in buffers],
        "phase": [b.phase for b in buffers],
        "op": [b.op for b in buffers],
        "module": [b.module for b in buffers],
        "internal": [int(b.internal) for b in buffers],
    }
    return make_trace(columns, syncs=syncs, meta=info)


@contextlib.contextmanager
def recording_session(
    device: str | torch.device = "cpu",
    *,
    fake: bool = False,
    meta: dict | None = None,
    gpu: GPU | str | None = None,
    progress: Callable[[str], None] | None = None,
    routing: Routing | str = DEFAULT_ROUTING,
    torch_version: TorchRules | str | None = None,
    memory: DeviceMemory | None = None,
    watch: bool = False,
    real_cpu: RealCpu | None = None,
) -> Iterator[Recording]:
    """Install the step recorder on `device` (and, with `fake`, fake tensors) for the block; what is built
    inside is seen from its first allocation, and `Recording.step` marks the step to record. With `watch`, the
    program's own training steps, phases and modules are marked as it runs them (`Recording.watch_steps`: global
    module and optimizer hooks, which a program memplan runs itself does without: under torch.compile they break
    graphs). A fake CUDA step follows the rules of `gpu` (gpus.py; default gpus.DEFAULT_GPU) and of torch
    `torch_version` (torch_versions.py; default the installed one), a fake mixture of experts routes its tokens by
    `routing` (memplan.routing). With `progress`, a block that runs long is reported through it every few seconds
    (traces/progress.py). With `memory` (a fake CUDA capture), every op's allocations and frees are fed to it as the
    op returns, and it answers the program's memory statistics (memplan check's live allocator). With `real_cpu` (a
    fake capture), CPU work on real tensors runs for real by its rule (traces/fake/real_cpu.py)."""
    if memory is not None and not (fake and torch.device(device).type == "cuda"):
        raise CaptureError("a live device memory needs a fake CUDA capture")
    device = torch.device(device)
    fake_cuda = fake and device.type == "cuda"
    gpu, rules = planned_gpu(gpu), torch_rules(torch_version)
    interval = progress_interval() if progress is not None else 0.0  # a bad setting fails before the work
    streams = StreamLedger()
    # The tempo layers' eager math (planner/layers/fusion.py): a trace holds the ops fake tensors see, and a fused
    # kernel's intermediates only ever lower the peak of the step it runs in.
    runtime = fake_cuda_runtime(gpu, streams, rules, memory) if fake_cuda else contextlib.nullcontext()
    with one_cpu_thread(device), fusion.eager(), runtime:
        with recording(device, fake=fake) as recorder:
            streams.storage_key = recorder.storage_key
            reporting = CaptureProgress(recorder, progress, interval) if progress is not None else None
            with reporting or contextlib.nullcontext():
                workspace = gpu.cublas_workspace(rules) if fake_cuda else 0
                lt_workspace = gpu.cublaslt_workspace_bytes if fake_cuda else 0
                fake_mode = (
                    FakeCapture(recorder, device.type, workspace, lt_workspace, routing, real_cpu) if fake else None
                )
                if memory is not None:
                    fake_mode.after_op = _live_feed(recorder, memory)
                planned = {"gpu": gpu.name, "torch_rules": rules.version, "cublas_workspace": workspace,
                           "cublaslt_workspace": lt_workspace}  # fmt: skip
                planned = planned if fake_cuda else {}
                hooks = cuda_stream_hooks(streams, recorder.storage_key) if device.type == "cuda" else None
                with fake_mode or contextlib.nullcontext(), hooks or contextlib.nullcontext():
                    session = Recording(recorder, device, fake_mode, {**planned, **(meta or {})}, reporting, streams)
                    if memory is not None:
                        memory.attach(session.program_so_far)  # its snapshots are of the program so far
                    with session.watch_steps() if watch else contextlib.nullcontext():
                        yield session
                    session.finish()


def _live_feed(recorder: Recorder, memory: DeviceMemory) -> Callable[[], None]:
    """What a fake capture calls as each op returns: the program's events since the last call, fed to `memory`."""
    position = 0

    def feed() -> None:
        nonlocal position
        events, position = recorder.program_tail(position)
        if len(events):
            memory.feed(events)

    return feed


def capture_step(
    build: Callable[[], Workload],
    device: str | torch.device = "cpu",
    *,
    fake: bool = False,
    warmup: bool = True,
    meta: dict | None = None,
    gpu: GPU | str | None = None,
    progress: Callable[[str], None] | None = None,
    routing: Routing | str = DEFAULT_ROUTING,
    torch_version: TorchRules | str | None = None,
) -> Trace:
    """Build a workload with `build()` and record one `workload.step()` (after its warm-up steps,
    Workload.warmup_steps, unless `warmup=False`) on `device` as a labelled Trace; with `fake`, under fake tensors
    (on CUDA, `gpu`'s and torch `torch_version`'s rules; a mixture of experts routed by `routing`). A capture that
    runs long reports through `progress` every few seconds, when given."""
    meta = {"warmup": warmup, **(meta or {})}
    with recording_session(device, fake=fake, meta=meta, gpu=gpu, progress=progress, routing=routing,
                           torch_version=torch_version) as session:  # fmt: skip
        session.announce("building the model")
        workload = build()
        device = session.check_device(workload)
        for _ in range(workload.warmup_steps() if warmup else 0):
            session.announce("the warm-up step")
            # a compiled step's warm-up compiles it: its graphs must not meet the marks' module hooks (graph breaks)
            with session.program_step(None if "compile" in meta else workload):
                run_user_code("warm-up step", workload.name, workload.step)
        real_cuda = device.type == "cuda" and not fake
        with (
            session.workload_step(workload),
            _measured(device) if real_cuda else contextlib.nullcontext({}) as measured,
        ):
            run_user_code("recorded step", workload.name, workload.step)
        del workload
    if measured:
        session.trace.meta["cuda_measured"] = measured
    return session.trace


@contextlib.contextmanager
def _measured(device: torch.device) -> Iterator[dict[str, int]]:
    """What PyTorch's caching allocator itself counts over the block: requested, allocated (block) and reserved
    bytes at its start and at their peaks, the block started from an emptied cache (as the simulator starts).
    A real CUDA capture keeps them in the trace's meta, so the trace is checked against the GPU it ran on."""
    measured: dict[str, int] = {}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_stats(device)
    yield measured
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    for kind in ("requested", "allocated", "reserved"):
        measured[f"{kind}_at_start"] = int(start[f"{kind}_bytes.all.current"])
        measured[f"peak_{kind}"] = int(stats[f"{kind}_bytes.all.peak"])


@contextlib.contextmanager
def record(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    inputs: Any = None,
    device: str | torch.device | None = None,
    fake: bool = False,
    output: str | os.PathLike | None = None,
    meta: dict | None = None,
    gpu: GPU | str | None = None,
    progress: Callable[[str], None] | None = None,
    routing: Routing | str = DEFAULT_ROUTING,
    torch: TorchRules | str | None = None,
) -> Iterator[Recording]:
    """Record one training step of your own loop. With `model` and `optimizer` (built before, real tensors)
    the block is the step; with neither, build them inside and mark the step with `recording.step(model,
    optimizer)` (so under `fake=True` too; a fake CUDA step follows `gpu`'s rules, gpus.py, and those of the torch
    it will run on, `torch` ("2.11"; default the installed one, torch_versions.py), and a fake mixture of experts
    routes its tokens by `routing`, memplan.routing). The trace is `recording.trace`, written to `output` if given;
    nothing is written when the block raises. An UnrecordedWarning says when the step read tensors made
    before the block that it was not given (a frozen reference model): the trace lacks them. With `progress`
    (print, say), a block that runs long is reported through it every few seconds."""
    if (model is None) != (optimizer is None):
        raise CaptureError("record: give both the model and its optimizer, or neither")
    require_fake_for_routing(routing, fake)
    if model is not None and fake:
        raise CaptureError(
            "record(model, optimizer, fake=True): a fake step needs a model made under fake tensors: build it "
            "inside `with record(fake=True) as recording:` and mark the step with recording.step(model, optimizer)"
        )
    device, gpu = record_target(model, device, fake, gpu, output, progress, meta)  # as the command line checks them
    if device is None:
        device = next(model.parameters()).device if model is not None else "cpu"
    meta = {"source": "memplan.record", **(meta or {})}
    with recording_session(device, fake=fake, meta=meta, gpu=gpu, progress=progress, routing=routing,
                           torch_version=torch, watch=model is None) as session:  # fmt: skip
        if model is None:
            yield session
        else:
            with session.step(model, optimizer, inputs=inputs, adopt=True):
                yield session
    if session.trace is None:
        raise CaptureError("record: no step was recorded: mark one with `with recording.step(model, optimizer):`")
    if "unrecorded" in session.trace.meta:
        warnings.warn(unrecorded_text(session.trace.meta["unrecorded"]), UnrecordedWarning, stacklevel=3)
    if output is not None:
        save(session.trace, output)
