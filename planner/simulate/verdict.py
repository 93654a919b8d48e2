"""Does a training program fit a GPU? Its caching allocator simulated with the GPU's memory less what the GPU holds
outside PyTorch's allocator (the CUDA context, the cuBLAS workspaces a trace does not hold, NCCL's buffers per
process group) as its capacity: it fits with the headroom left, or it runs out of memory at the allocation the
allocator (with its alloc conf and out-of-memory retry) could not serve, named by op, phase, module and step, with
the figures PyTorch's error prints. A trace that holds its whole program (`Trace.program`) is judged over all of it
(construction, the first step that makes the optimizer's state, the warm-ups), since that shapes the cache the
measured step meets; a trace of one step alone, over that step from an empty cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from memplan.gpus import (
    CUDA_CONTEXT_SOURCE,
    GIVEN_SOURCE,
    GPU,
    NCCL_PER_PROCESS_GROUP,
    NCCL_SOURCE,
    GPUError,
    outside_measurement,
)
from memplan.planner.simulate.alloc_conf import AllocConf
from memplan.planner.simulate.caching_allocator import SimResult, gpu_out_of_memory, simulate_caching
from memplan.step import StepSpec
from memplan.torch_versions import INSTALLED, TorchRules, TorchVersionError, torch_rules
from memplan.traces.format import Trace

STEP_HANDLES = 2  # cuBLAS handles of a training step: its own thread's and the autograd engine's backward thread's
LT_OPS = ("aten::addmm",)  # ops that run through cuBLASLt (a fused bias), so take its workspace too


@dataclass(frozen=True)
class OutsideTerm:
    """Memory a GPU holds outside the caching allocator while the step runs, by name."""

    name: str  # "CUDA context", "cuBLAS workspaces", "NCCL"
    bytes: int
    source: str  # where the figure comes from; "estimate: ..." for an estimate


def held_workspaces(meta: Mapping) -> tuple[bool, bool]:
    """Whether a trace holds (cuBLAS's, cuBLASLt's) workspaces among its allocations: a real CUDA trace (captured,
    or imported from a snapshot) holds both; a fake CUDA trace holds each when its capture allocated it (meta
    `cublas_workspace` and `cublaslt_workspace`: bytes per handle, as traces/capture.py records them; older fake
    traces name cuBLAS's alone); a CPU trace holds neither."""
    cuda, fake = meta.get("device") == "cuda", bool(meta.get("fake"))
    return cuda and (not fake or bool(meta.get("cublas_workspace"))), cuda and (
        not fake or bool(meta.get("cublaslt_workspace"))
    )


def target_torch(meta: Mapping) -> TorchRules | None:
    """The torch a trace's step runs on: the rules a fake CUDA capture followed (meta `torch_rules`), else the torch
    that recorded it (meta `torch`) when memplan has its rules, else the installed torch's for a trace that names
    none; None for a torch memplan has no rules for (a real snapshot's older torch)."""
    try:
        return torch_rules(meta.get("torch_rules") or meta.get("torch"))
    except TorchVersionError:
        return None


def outside_terms(gpu: GPU, meta: Mapping, handles: int = STEP_HANDLES, lt: bool = True) -> tuple[OutsideTerm, ...]:
    """What `gpu` holds outside the caching allocator for a step whose trace has `meta`, each term named with its
    source: the bytes given by hand (`gpu.outside`, --outside) instead of the CUDA context's and NCCL's; else the
    CUDA context as measured on that GPU with the step's torch (gpus.OUTSIDE_MEASURED), or estimated; what the trace
    does not hold of the cuBLAS workspaces of `handles` handles and (`lt`: the step runs cuBLASLt) of cuBLASLt's, at
    the step's torch's sizes (they live in the caching allocator, so no measurement of the outside counts them); NCCL's
    buffers for each process group when the trace is a rank's (meta `world_size`; `process_groups`, 1 unless it
    says)."""
    rules = target_torch(meta)
    measured = None if rules is None else outside_measurement(gpu, rules)
    if gpu.outside is not None:
        terms = [OutsideTerm("outside the caching allocator", gpu.outside, GIVEN_SOURCE)]
    elif measured is not None:
        terms = [OutsideTerm("CUDA context", measured.bytes, measured.source)]
    else:
        terms = [OutsideTerm("CUDA context", gpu.cuda_context, CUDA_CONTEXT_SOURCE)]
    cublas_held, lt_held = held_workspaces(meta)
    workspace = gpu.cublas_workspace(rules or INSTALLED)
    cublas = 0 if cublas_held else handles * workspace
    lt_bytes = gpu.cublaslt_workspace_bytes if lt and not lt_held else 0
    if cublas or lt_bytes:
        parts = [f"{handles} handles x {workspace:,} B"] if cublas else []
        parts += [f"cuBLASLt's {lt_bytes:,} B"] if lt_bytes else []
        source = (f"torch {(rules or INSTALLED).version}'s defaults for compute capability "
                  f"{gpu.capability[0]}.{gpu.capability[1]}, absent from the trace: {' + '.join(parts)}")  # fmt: skip
        terms.append(OutsideTerm("cuBLAS workspaces" if cublas else "cuBLASLt workspace", cublas + lt_bytes, source))
    if meta.get("world_size") is not None and gpu.outside is None:
        groups = int(meta.get("process_groups", 1))
        terms.append(OutsideTerm(f"NCCL ({groups} process group{'s' * (groups != 1)})",
                                 groups * NCCL_PER_PROCESS_GROUP, NCCL_SOURCE))  # fmt: skip
    return tuple(terms)


@dataclass(frozen=True)
class Budget:
    """A GPU's memory and what it holds outside the caching allocator: the rest is the allocator's capacity."""

    gpu: GPU
    outside: tuple[OutsideTerm, ...]

    @property
    def outside_bytes(self) -> int:
        """The outside terms' sum."""
        return sum(t.bytes for t in self.outside)

    @property
    def capacity(self) -> int:
        """Bytes the caching allocator may reserve: the GPU's memory less the outside terms."""
        return self.gpu.memory - self.outside_bytes

    def as_dict(self) -> dict:
        """The budget as the commands' --json gives it: the GPU, the outside terms, their sum, the capacity."""
        return {
            "gpu": self.gpu.as_dict(),
            "outside": [asdict(t) for t in self.outside],
            "outside_bytes": self.outside_bytes,
            "capacity": self.capacity,
        }


def trace_budget(gpu: GPU, trace: Trace) -> Budget:
    """`gpu`'s budget for the step of `trace` (one cuBLAS handle when it has no backward pass; a cuBLASLt workspace
    when it runs an op of LT_OPS)."""
    handles = STEP_HANDLES if "backward" in trace.phase else 1
    lt = not set(LT_OPS).isdisjoint(trace.op)
    return Budget(gpu, outside_terms(gpu, trace.meta, handles, lt))


def require_memory_or_gpu(memory: int | None, gpu: GPU | None) -> None:
    """GPUError unless exactly one of the device memory and a GPU is given (`fit`, `optimize`)."""
    if (memory is None) == (gpu is None):
        raise GPUError("give the device memory as a size (--memory) or as a GPU (--gpu): exactly one of the two")


def device_memory(memory: int | None, gpu: GPU | None, step: StepSpec) -> tuple[int, Budget | None]:
    """The memory a fit or an optimize works in: `memory` bytes, or the GPU's memory less what it holds outside
    the caching allocator for a trace of `step` (and the budget); exactly one of the two."""
    require_memory_or_gpu(memory, gpu)
    if gpu is None:
        return memory, None
    cuda = step.device.split(":")[0] == "cuda"  # a fake CUDA capture allocates the workspaces itself
    held = cuda and step.fake
    budget = Budget(gpu, outside_terms(gpu, {"device": "cuda" if cuda else "cpu", "fake": step.fake,
                                             "cublas_workspace": held, "cublaslt_workspace": held,
                                             "torch_rules": step.torch.version}))  # fmt: skip
    if budget.capacity <= 0:
        raise GPUError(f"{gpu.name}: its memory is all taken outside the caching allocator")
    return budget.capacity, budget


@dataclass(frozen=True)
class OutOfMemoryAt:
    """The allocation the simulated allocator could not serve on the GPU, even after releasing its cache."""

    time: int  # logical time of the allocation (in the program's time when the whole program was judged)
    buffer: int  # its index in the trace judged (the program's when the whole program was)
    size: int  # bytes it requested
    op: str  # the op that made it ("" when the trace does not say)
    phase: str  # forward, backward, optimizer, other
    module: str  # the module it ran in ("" when the trace does not say)
    allocated: int  # the allocator's allocated bytes then
    reserved: int  # its reserved bytes then
    where: str = "the step"  # the part of the program: construction, step 2 (measured), between steps 1 and 2
    tried: int = 0  # what PyTorch's error says it tried to allocate: the request's segment size
    free: int = 0  # the GPU's free bytes then, as PyTorch reads them: its memory less reserved and outside bytes
    message: str = ""  # PyTorch's error for it, as torch.OutOfMemoryError would print it


@dataclass(frozen=True)
class Verdict:
    """Whether a step fits a GPU: its peaks, the outside terms, their sum against the GPU's memory; where it runs
    out of memory when it does not fit."""

    gpu: str  # the catalogue's name
    memory: int  # the GPU's memory (total_memory)
    alloc_conf: str  # the PYTORCH_CUDA_ALLOC_CONF simulated ("" for the defaults)
    peak_live: int  # the step's most requested bytes live at once
    peak_allocated: int  # the caching allocator's peak allocated bytes (block sizes, as max_memory_allocated)
    peak_reserved: int  # its peak reserved bytes: on the GPU when it fits, with no limit when it does not
    outside: tuple[OutsideTerm, ...]
    outside_bytes: int  # the outside terms' sum
    capacity: int  # memory - outside_bytes: what the caching allocator was given
    total: int  # peak_reserved + outside_bytes: what the step needs of the GPU
    fits: bool
    headroom: int  # memory - total: what is left when it fits, what is missing (negative) when not
    oom: OutOfMemoryAt | None  # where it runs out of memory; None when it fits
    program: bool = False  # the whole program was judged (the trace held it), not the measured step alone
    steps: int = 1  # training steps judged (the program's), the measured one included
    step_peak_allocated: int = 0  # the measured step's peak allocated, in the cache the program left it
    step_peak_reserved: int = 0  # ... and its peak reserved: what max_memory_reserved() reads after a reset before it

    def to_dict(self) -> dict:
        """The verdict as the commands' --json gives it (keys in docs/cli.md)."""
        return asdict(self)


def judged(trace: Trace) -> Trace:
    """What a verdict simulates of `trace`: its whole program when it holds one, else the step itself."""
    return trace.program.trace if trace.program is not None else trace


def step_peaks(trace: Trace, result: SimResult) -> tuple[int, int]:
    """The measured step's peak allocated and reserved within a simulation of `judged(trace)`: over its window in the
    program (from the event before it, where a reset of the peak statistics would read), else over the whole run."""
    program = trace.program
    step = None if program is None or program.measured is None else program.steps[program.measured]
    if step is None:
        return int(result.peak_allocated), int(result.peak_reserved)
    window = slice(max(step.start - 1, 0), step.end)
    return int(result.allocated[window].max()), int(result.reserved[window].max())


def judge(trace: Trace, budget: Budget, conf: AllocConf, alloc_conf: str = "",
          unlimited: SimResult | None = None) -> Verdict:  # fmt: skip
    """The verdict for `trace` on `budget`'s GPU: the caching allocator (with `conf`) simulated at the budget's
    capacity over the whole program when the trace holds it (else the step). `unlimited` is the step simulated without
    a capacity when the caller has it: when the step is what is judged, never reserves more than the capacity and no
    garbage-collection threshold acts, it is the same run, and it is not run twice."""
    capacity, subject = budget.capacity, judged(trace)
    same = subject is trace and unlimited is not None and unlimited.oom is None
    same = same and not conf.garbage_collection_threshold
    on_gpu = unlimited if same and unlimited.peak_reserved <= capacity else simulate_caching(subject, conf, capacity)
    oom, whole = None, on_gpu
    if on_gpu.oom is not None:
        whole = unlimited if same else simulate_caching(subject, conf)
        oom = _out_of_memory(trace, subject, on_gpu, budget, conf)
    step_allocated, step_reserved = step_peaks(trace, whole)
    total = int(whole.peak_reserved) + budget.outside_bytes
    return Verdict(
        gpu=budget.gpu.name,
        memory=budget.gpu.memory,
        alloc_conf=alloc_conf,
        peak_live=int(trace.peak()[0]),
        peak_allocated=int(whole.peak_allocated),
        peak_reserved=int(whole.peak_reserved),
        outside=budget.outside,
        outside_bytes=budget.outside_bytes,
        capacity=capacity,
        total=total,
        fits=oom is None,
        headroom=budget.gpu.memory - total,
        oom=oom,
        program=subject is not trace,
        steps=len(trace.program.steps) if subject is not trace else 1,
        step_peak_allocated=step_allocated,
        step_peak_reserved=step_reserved,
    )


def _out_of_memory(trace: Trace, subject: Trace, on_gpu: SimResult, budget: Budget, conf: AllocConf) -> OutOfMemoryAt:
    """The failed request of `on_gpu` (a simulation of `subject`, the step or its program), labelled, with the figures
    PyTorch's error gives: the segment it tried to allocate, the GPU's free bytes, allocated and reserved."""
    i, t = on_gpu.oom.buffer, on_gpu.oom.time
    allocated, reserved = int(on_gpu.allocated[t]), int(on_gpu.reserved[t])
    error = gpu_out_of_memory(on_gpu.oom.size, conf, budget.gpu.memory, budget.outside_bytes, allocated, reserved)
    where = trace.program.where(t) if subject is not trace else "the step"
    return OutOfMemoryAt(t, i, on_gpu.oom.size, subject.op[i], subject.phase[i], subject.module[i], allocated,
                         reserved, where, error.tried, error.free, error.message)  # fmt: skip
