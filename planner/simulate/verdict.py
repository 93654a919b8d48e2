"""Does a training step fit a GPU? The step's caching allocator simulated with the GPU's memory less what the GPU
holds outside PyTorch's allocator (the CUDA context, the cuBLAS workspaces a trace does not hold, NCCL's buffers per
process group) as its capacity: it fits with the headroom left, or it runs out of memory at the allocation the
allocator (with its alloc conf and out-of-memory retry) could not serve, named by op, phase and module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from memplan.gpus import CUDA_CONTEXT_SOURCE, GPU, NCCL_PER_PROCESS_GROUP, NCCL_SOURCE, GPUError
from memplan.planner.simulate.alloc_conf import AllocConf
from memplan.planner.simulate.caching_allocator import SimResult, simulate_caching
from memplan.step import StepSpec
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


def outside_terms(gpu: GPU, meta: Mapping, handles: int = STEP_HANDLES, lt: bool = True) -> tuple[OutsideTerm, ...]:
    """What `gpu` holds outside the caching allocator for a step whose trace has `meta`: the CUDA context; what
    the trace does not hold of the cuBLAS workspaces of `handles` handles and (`lt`: the step runs cuBLASLt) of
    cuBLASLt's; NCCL's buffers for each process group when the trace is a rank's (meta `world_size`;
    `process_groups`, 1 unless it says)."""
    terms = [OutsideTerm("CUDA context", gpu.cuda_context, CUDA_CONTEXT_SOURCE)]
    cublas_held, lt_held = held_workspaces(meta)
    cublas = 0 if cublas_held else handles * gpu.cublas_workspace_bytes
    lt_bytes = gpu.cublaslt_workspace_bytes if lt and not lt_held else 0
    if cublas or lt_bytes:
        parts = [f"{handles} handles x {gpu.cublas_workspace_bytes:,} B"] if cublas else []
        parts += [f"cuBLASLt's {lt_bytes:,} B"] if lt_bytes else []
        source = (f"PyTorch's defaults for compute capability {gpu.capability[0]}.{gpu.capability[1]}, absent "
                  f"from the trace: {' + '.join(parts)}")  # fmt: skip
        terms.append(OutsideTerm("cuBLAS workspaces" if cublas else "cuBLASLt workspace", cublas + lt_bytes, source))
    if meta.get("world_size") is not None:
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
                                             "cublas_workspace": held, "cublaslt_workspace": held}))  # fmt: skip
    if budget.capacity <= 0:
        raise GPUError(f"{gpu.name}: its memory is all taken outside the caching allocator")
    return budget.capacity, budget


@dataclass(frozen=True)
class OutOfMemoryAt:
    """The allocation the simulated allocator could not serve on the GPU, even after releasing its cache."""

    time: int  # logical time of the allocation
    buffer: int  # its index in the trace
    size: int  # bytes it requested
    op: str  # the op that made it ("" when the trace does not say)
    phase: str  # forward, backward, optimizer, other
    module: str  # the module it ran in ("" when the trace does not say)
    allocated: int  # the allocator's allocated bytes then
    reserved: int  # its reserved bytes then


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

    def to_dict(self) -> dict:
        """The verdict as the commands' --json gives it (keys in docs/cli.md)."""
        return asdict(self)


def judge(trace: Trace, budget: Budget, conf: AllocConf, alloc_conf: str = "",
          unlimited: SimResult | None = None) -> Verdict:  # fmt: skip
    """The verdict for `trace` on `budget`'s GPU: the caching allocator (with `conf`) simulated at the budget's
    capacity. `unlimited` is the trace simulated without a capacity when the caller has it: when it never reserves
    more than the capacity (and no garbage-collection threshold acts) it is the same run, and it is not run twice."""
    capacity = budget.capacity
    same = unlimited is not None and unlimited.oom is None and not conf.garbage_collection_threshold
    on_gpu = unlimited if same and unlimited.peak_reserved <= capacity else simulate_caching(trace, conf, capacity)
    oom, whole = None, on_gpu
    if on_gpu.oom is not None:
        whole = unlimited if same else simulate_caching(trace, conf)
        i, t = on_gpu.oom.buffer, on_gpu.oom.time
        oom = OutOfMemoryAt(t, i, on_gpu.oom.size, trace.op[i], trace.phase[i], trace.module[i],
                            int(on_gpu.allocated[t]), int(on_gpu.reserved[t]))  # fmt: skip
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
    )
