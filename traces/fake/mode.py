"""Fake tensors for a capture: the model is built and its step run with no memory and no arithmetic.

`FakeCapture` is PyTorch's FakeTensorMode with these additions.
- Every fake tensor an op returns claims its storage in the recorder, so the trace holds the storages
  the program saw (not the meta storages fake tensor mode makes for its own work); one claimed by an op
  run inside another op (autograd's copy of an in-place op's input, autocast's cast) is internal to that
  op, as a real trace marks it.
- In-place random fills (`uniform_`, `normal_`, ...) return their input untouched: they allocate
  nothing on a real device, their values do not matter here, and on a machine without CUDA fake
  tensor mode cannot run them for a fake CUDA tensor.
- Optimizers take fake tensors for the tensors they stand for: on CUDA they pick their foreach kernels
  (AdamW's default there), as with real CUDA tensors, where a fake tensor would send them to the
  per-tensor loop.
- A functional all-reduce (`_c10d_functional.all_reduce`: DTensor's, tensor parallelism's) allocates a contiguous
  clone, as its kernel does before reducing it in place, and its `wait_tensor` hands that back (the meta kernels
  allocate a result for each).
- `native_dropout` allocates its mask before its output, as the CPU and CUDA kernels do (the
  meta kernel allocates them the other way round).
- The autograd engine sums two gradients of one input in place where it would for real tensors (it
  holds the last reference to the first, which is dense); for a fake tensor, a Python subclass, it
  never does, so each such sum would allocate a gradient more.
- Composite ops and backward formulas that take another path for tensor subclasses (fake tensors
  are one) take the real tensors' path (SUBCLASS_PATHS): the math attention adds its mask in place,
  the backward of gather, max and indexing write into their zeros in place.
- Fake tensor mode's dispatch cache is on (an op seen before is answered from its metadata), and leaves every
  storage's reference count as without it (traces/fake/dispatch_cache.py), so a trace never depends on what
  the process ran before it.
- Only what an op returns is claimed, its new storages allocated in the order it returns them, as
  kernels allocate their outputs: what fake tensor mode makes inside an op (a decomposition) is the
  op's own work, in the decomposition's order, as a real kernel's scratch is.
- Values that depend on data get a rule instead of an error (DATA_RULE). A router's choice (a top-k over
  the last dimension) is the routing rule's, and what is computed from its choices and from constants alone
  is computed for real beside the step (traces/fake/known_values.py), so a mixture of experts routes its tokens
  as a real step would under that rule; counted per op in the routing's `computed`. Any other value is read
  as 0: a scalar read from a tensor (`.item()`, `bool(t)`) is 0 (False), and a selection whose size depends
  on the data (`nonzero`, `masked_select`) selects nothing, counted per op in `data_dependent`. The trace's
  meta keeps both.
- An op whose indices are known (position ids from `arange`, constants) and out of range for the tensor it reads
  (`embedding`, `index_select`, `gather`, advanced indexing) raises what the real op raises (IndexError; gather's
  RuntimeError), so a fake step fails where the real one would (known_values.check_bounds).
- Tracebacks that torch's loggers print before raising an error memplan reports anyway stay off the terminal
  (traces/fake/quiet_logs.py; `MEMPLAN_VERBOSE` shows them).
- Composite functions that ATen runs another way for fake tensors run as the kernels do: `F.one_hot`
  (the CPU's `aminmax` check, then `zeros` and `scatter_`, where ATen takes `arange` and `eq`), and a
  one-element fake tensor formats as its value (`f"expert_{i}"`), as a real one does.
- While it is active, `Tensor.to`/`.cuda` of a fake tensor go straight to `aten._to_copy`, so a fake model moves
  to a CUDA device on a machine without one (the Python bindings would ask for the device first), and
  `Module._apply` (`Module.to`, `.cuda`, `.half`, ...) converts a module of fake tensors as PyTorch converts real
  ones: each parameter stays the same object (PyTorch sets `param.data`; fake tensors cannot be swapped), so an
  optimizer made before `model.to("cuda")` keeps its parameters, and each buffer is replaced;
  `torch.tensor(data, device="cuda")` is made on the CPU and moved there, and pinning (a data loader's
  `pin_memory`, in its own thread too) copies in host memory.
- Local checkpoints are read by shape (traces/fake/checkpoints.py): `torch.load`, safetensors and HuggingFace's
  `from_pretrained` give fake tensors of the stored dtypes and shapes, allocated where they are loaded, and read
  no tensor data.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as numpy_module
import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    _DISPATCH_META_HANDLERS,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    unset_fake_temporarily,
)
from torch.optim import optimizer
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from memplan.errors import MemplanError
from memplan.routing import DEFAULT, Routing
from memplan.traces.fake import checkpoints, hf_masks, quiet_logs
from memplan.traces.fake.branches import branch_site
from memplan.traces.fake.dispatch_cache import ExactCache
from memplan.traces.fake.known_values import ATTRIBUTE, INDEXED, KnownValues, check_bounds, forget, tensor_arguments
from memplan.traces.fake.real_cpu import RealCpu
from memplan.traces.fake.unfollowed import no_fake_kernel
from memplan.traces.on_import import Waiting, on_import
from memplan.traces.patches import Patches
from memplan.traces.ranks import fake_wrappers
from memplan.traces.recorder import Recorder

aten = torch.ops.aten
# The tensor types for which torch.optim picks its foreach (multi-tensor) kernels on a device that has them.
FOREACH_TYPES = optimizer._foreach_supported_types
RANDOM_FILLS = frozenset(
    {
        aten.uniform_,
        aten.normal_,
        aten.bernoulli_,
        aten.random_,
        aten.exponential_,
        aten.cauchy_,
        aten.log_normal_,
        aten.geometric_,
    }
)  # every overload: all in place
# The autograd engine sums gradients in place when it holds the only reference to the first and to its storage.
# Seen from fake tensor mode, that first gradient has 4 references more (the engine's call, boxed and handed
# to Python), its storage none (the dispatch cache adds none: traces/fake/dispatch_cache.py).
# tests/test_capture_fidelity.py pins it: fake and real traces of every bundled model allocate the same sequence.
DISPATCH_REFERENCES = 4
# Composite ops and backward formulas that call an op out of place for tensor subclasses and in place for real
# tensors: (caller: composite op or autograd node, op it calls) -> the in-place op real tensors get.
SUBCLASS_PATHS = {
    ("aten::_scaled_dot_product_attention_math", aten.add.Tensor): aten.add_.Tensor,  # the mask
    ("aten::gather_backward", aten.scatter_add.default): aten.scatter_add_.default,  # into zeros
    ("aten::value_selecting_reduction_backward", aten.scatter.src): aten.scatter_.src,  # max, min, ... into zeros
    ("IndexBackward0", aten.index_put.default): aten.index_put_.default,  # index_backward, into zeros
}
SUBCLASS_CALLED = frozenset(op for _, op in SUBCLASS_PATHS)  # the ops a caller may want in place
# The ops whose CUDA kernels run through a cuBLAS handle: the first on a thread makes the thread's handle, and the
# handle's workspace comes from the caching allocator and stays for the process (ATen's CublasHandlePool.cpp).
CUBLAS_OPS = frozenset(
    {
        aten.mm,
        aten.bmm,
        aten.addmm,
        aten.addbmm,
        aten.baddbmm,
        aten.addmv,
        aten.mv,
        aten.dot,
        aten.vdot,
        aten._addmm_activation,
        aten._scaled_mm,
    }
)
# Outputs (by position) that an op's CUDA kernel makes in host memory, not on the GPU: memory-efficient attention's
# philox seed and offset are CPU scalars outside CUDA graph capture (ATen's attention.cu), so a real step's trace
# holds neither (an H200 step of HF GPT-2 with attention dropout: 4 x 8 B fewer than the fake one held).
HOST_OUTPUTS = {aten._scaled_dot_product_efficient_attention.default: (2, 3)}
# The ops whose CUDA kernel runs through cuBLASLt when its bias is a vector (addmm's fused bias, as nn.Linear with a
# bias makes it): the first on a thread takes that handle's own cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE,
# gpus.CUBLASLT_WORKSPACE), beside cuBLAS's (ATen's Blas.cpp; measured with torch 2.11, docs/gpu-validation.md).
CUBLASLT_OPS = frozenset({aten.addmm.default, aten._addmm_activation.default})
LT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DATA_RULE = (
    "a router's top-k chooses by the routing rule, and values computed from its choices and constants alone are "
    "computed; any other value read from a fake tensor is 0 (False), so a selection of it selects nothing"
)


class DataDependentError(MemplanError):
    """An op's output size depends on tensor values in a way DATA_RULE does not cover."""


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a fake tensor (its sizes are real, its values are not)."""
    return isinstance(tensor, FakeTensor)


def _set_data(tensor: torch.Tensor, converted: torch.Tensor) -> None:
    """`tensor.data = converted` for a fake tensor too: the object keeps its autograd state, gradient hooks and the
    program's attributes; its storage, sizes, dtype and device (fake tensor mode's own attributes, its known values)
    become the converted copy's."""
    if converted is tensor:
        return
    tensor.data = converted
    if is_fake(converted):
        tensor.__dict__.pop(ATTRIBUTE, None)
        tensor.__dict__.update(converted.__dict__)


def _swap(tensor: torch.Tensor, fresh: torch.Tensor) -> bool:
    """`torch.utils.swap_tensors(tensor, fresh)` as seen from `tensor`, for a fake tensor too (fake tensor mode holds
    weak references to its tensors, which swap_tensors refuses): the object stays, everything else is `fresh`'s, its
    Python attributes and its (no) gradient hooks included. False where a fake tensor cannot take `fresh`'s storage
    in place (another kind of tensor: a move to the meta device)."""
    if fresh is tensor:  # a gradient converted already (a tied parameter's second visit): nothing to swap
        return True
    if not is_fake(tensor):
        torch.utils.swap_tensors(tensor, fresh)
        return True
    if not torch._has_compatible_shallow_copy_type(tensor, fresh):
        return False
    if tensor._backward_hooks:
        tensor._backward_hooks = None
    tensor.data = fresh
    attributes = dict(fresh.__dict__)
    tensor.__dict__.clear()
    tensor.__dict__.update(attributes)
    return True


def _set_data_allowed(tensor: torch.Tensor, converted: torch.Tensor) -> bool:
    """Whether Module._apply sets `tensor.data` to `converted` (PyTorch's compute_should_use_set_data for real
    tensors: tensors of one kind, dense on the CPU or CUDA alike, unless `torch.__future__` says overwrite)."""
    compatible = torch._has_compatible_shallow_copy_type(tensor, converted)
    return compatible and not torch.__future__.get_overwrite_module_params_on_conversion()


def _convert_parameters(module: nn.Module, fn) -> None:
    """Each parameter of `module` (not its children's) and its gradient converted by `fn` as PyTorch's Module._apply
    converts real ones: swapped with `torch.__future__`'s swap (the object kept, its contents new), else set in place
    (`param.data =`: the object kept with its attributes and hooks, so an optimizer made before the move keeps it),
    else replaced by a new Parameter (overwrite, or a move to another kind of tensor)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    for key, param in module._parameters.items():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        grad = param.grad
        swapped = False
        if swap or is_traceable_wrapper_subclass(applied):
            param.grad = None  # as PyTorch: a reference more to the gradient's tensor would prevent swapping
            swapped = _swap(param, nn.Parameter(applied, requires_grad=param.requires_grad))
            param.grad = grad if not swapped else None
        if swapped or _set_data_allowed(param, applied):
            if not swapped:
                _set_data(param, applied)
            out = param
        else:
            out = nn.Parameter(applied, param.requires_grad)
            module._parameters[key] = out
        if grad is None:
            continue
        with torch.no_grad():
            grad_applied = fn(grad)
        if swapped and _swap(grad, grad_applied.requires_grad_(grad.requires_grad)):
            out.grad = grad
        elif not swapped and _set_data_allowed(grad, grad_applied):
            _set_data(grad, grad_applied)
        else:
            out.grad = grad_applied.requires_grad_(grad.requires_grad)


def _apply_fake(original):
    """Module._apply that converts a module holding fake tensors as PyTorch's converts real ones: its children first
    (through their own `_apply`), then its parameters (`_convert_parameters`), then each buffer, replaced by its
    converted tensor."""

    def apply(self, fn, recurse=True):
        if not any(is_fake(t) for t in (*self._parameters.values(), *self._buffers.values())):
            return original(self, fn, recurse)  # its children through their own _apply, then this one
        if recurse:
            for child in self.children():
                child._apply(fn)
        _convert_parameters(self, fn)
        for key, buffer in self._buffers.items():
            if buffer is not None:
                self._buffers[key] = fn(buffer)
        return self

    apply.memplan_fake = True
    return apply


@contextlib.contextmanager
def fake_module_apply() -> Iterator[None]:
    """While the block runs, `Module._apply` converts modules of fake tensors as PyTorch converts real ones
    (`_apply_fake`); nothing changes when it does so already (inside a FakeCapture)."""
    original = nn.Module._apply
    if getattr(original, "memplan_fake", False):
        yield
        return
    nn.Module._apply = _apply_fake(original)
    try:
        yield
    finally:
        nn.Module._apply = original


def module_to(model: nn.Module, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """`model.to(device, dtype)`, also for a model of fake tensors (outside a FakeCapture too), as PyTorch's
    `Module.to` treats real tensors: each parameter stays the same object (an optimizer made before the move keeps
    it), its gradient hooks and attributes with it (unless `torch.__future__` says otherwise), and each buffer is
    replaced by its converted copy."""
    with fake_module_apply():
        return model.to(device=device, dtype=dtype)


def _tensor_to(original):
    """Tensor.to that moves a fake tensor with aten._to_copy (no device is asked for), and a real one to CUDA as a
    fake tensor of its layout moved so (fake tensor mode would move it for real: on a CPU-only torch, to a CUDA backend
    there is none of; on a GPU, into memory the trace does not see)."""

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.Tensor):  # to(other): its device and dtype
            args = (args[0].device, args[0].dtype, *args[1:])
        copy = kwargs.pop("copy", False)  # to(..., copy=True): _parse_to takes every argument but this one
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if not is_fake(self):
            mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            if mode is not None and device is not None and device.type == "cuda":
                return to(mode.from_tensor(self), *args, copy=copy, **kwargs)  # aten::_to_copy, as a GPU's is
            return original(self, *args, copy=copy, **kwargs)
        device, dtype = device or self.device, dtype or self.dtype
        if device == self.device and dtype == self.dtype and not copy:
            return self
        return torch.ops.aten._to_copy(
            self, dtype=dtype, device=device, memory_format=memory_format or torch.preserve_format
        )

    return to


def _tensor_from_data(original):
    """torch.tensor that makes a fake CUDA tensor on a torch built without CUDA: made on the CPU, then copied to an
    empty CUDA one (the factory itself would ask the missing CUDA backend for its storage, below fake tensor mode)."""

    def tensor(data, *args, device=None, requires_grad=False, **kwargs):
        if device is None or torch.device(device).type != "cuda" or torch.backends.cuda.is_built():
            return original(data, *args, device=device, requires_grad=requires_grad, **kwargs)
        made = original(data, *args, **kwargs)  # a constant fake tensor mode would move for real: copied instead
        with torch.no_grad():
            moved = torch.empty(made.shape, dtype=made.dtype, device=device).copy_(made)
        return moved.requires_grad_(requires_grad)

    return tensor


def _host_pin(original):
    """Tensor.pin_memory that copies a real tensor in host memory on a torch built without CUDA, as pinning makes a
    copy (a data loader's pinning thread runs outside the capture, where the CPU build has no pinned allocator)."""

    def pin_memory(self, *args, **kwargs):
        if is_fake(self) or torch.backends.cuda.is_built():
            return original(self, *args, **kwargs)
        return self.clone()

    return pin_memory


def _one_hot(original):
    """F.one_hot that runs a fake tensor as the CPU and CUDA kernels do (ATen's Onehot.cpp): on the CPU, `aminmax`
    to check the classes; then `zeros` and `scatter_` (for fake tensors ATen takes its traceable path, `arange`,
    `eq` and a copy to int64: other buffers)."""

    def one_hot(tensor, num_classes=-1):
        if not is_fake(tensor) or tensor.dtype != torch.long or tensor.numel() == 0:
            return original(tensor, num_classes)
        if tensor.device.type == "cpu":
            low, high = torch.aminmax(tensor)
            if int(low) < 0:
                raise RuntimeError("Class values must be non-negative.")
            if num_classes != -1 and num_classes <= int(high):
                raise RuntimeError("Class values must be smaller than num_classes.")
            num_classes = int(high) + 1 if num_classes == -1 else num_classes
            del low, high
        elif num_classes == -1:
            num_classes = int(tensor.max()) + 1
        elif num_classes < 1:
            raise RuntimeError("num_classes should be positive")
        encoded = torch.zeros((*tensor.shape, num_classes), dtype=torch.long, device=tensor.device)
        return encoded.scatter_(-1, tensor.unsqueeze(-1), 1)

    return one_hot


def _tensor_format(original):
    """Tensor.__format__ that formats a one-element fake tensor as its value, as for a real tensor (f"expert_{i}"
    names a module; a tensor subclass would be formatted as its repr)."""

    def format_(self, spec):
        if is_fake(self) and self.dim() == 0:
            return self.item().__format__(spec)
        return original(self, spec)

    return format_


def _tensor_numpy(original, capture: FakeCapture):
    """Tensor.numpy that reads a fake CPU tensor by the data rule (its values are 0: a read-only array of zeros of its
    shape and dtype that takes no memory, counted as a read), and refuses what PyTorch refuses (a tensor that needs
    grad, one on a GPU, a dtype numpy lacks) with PyTorch's error; a real tensor is itself."""

    def numpy(self, *, force=False):
        if not is_fake(self):
            return original(self, force=force)
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        if self.device.type != "cpu" and not force:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")  # fmt: skip
        with unset_fake_temporarily():
            zero = original(torch.zeros((), dtype=self.dtype))  # a dtype numpy lacks (bfloat16) fails as a real one
        capture.read_unknown("Tensor.numpy")
        return numpy_module.broadcast_to(zero, tuple(self.shape))

    return numpy


def _recorded_resize(original, recorder: Recorder):
    """UntypedStorage.resize_ that tells the recorder: a fake tensor's (meta) storage changes its size in place, past
    the allocator that reports real ones (FSDP2 frees an unsharded parameter with resize_(0), then takes it back)."""

    def resize_(storage, size):
        old = storage.nbytes()
        result = original(storage, size)
        if storage.device.type == "meta" and storage.nbytes() != old:
            with unset_fake_temporarily():
                view = torch.empty(0, dtype=torch.uint8, device="meta").set_(storage)
            recorder.resized(view, old)
        return result

    return resize_


def _cuda(to):
    """`.cuda(device=None)` as `.to("cuda[:device]")`."""

    def cuda(self, device=None, *args, **kwargs):
        if isinstance(device, int):
            device = f"cuda:{device}"
        return to(self, torch.device(device or "cuda"))

    return cuda


def _leaves(out) -> list:
    """What an op returned, flattened in order (an op returns a tensor, a scalar, or tuples and lists of them)."""
    if not isinstance(out, (tuple, list)):
        return [out]
    return [leaf for o in out for leaf in _leaves(o)]


def _bf16_or(dtype: torch.dtype) -> torch.dtype:
    """bf16 for a floating dtype (what _grouped_mm's meta function takes), any other (offsets' int32) unchanged."""
    return torch.bfloat16 if dtype.is_floating_point else dtype


def _to_fake_cuda(tensor, kwargs) -> bool:
    """Whether _to_copy moves a fake tensor that holds a constant (torch.tensor(2.0), a scale a model keeps as a
    buffer) to CUDA on a torch built without CUDA."""
    device = (kwargs or {}).get("device")
    return (
        isinstance(tensor, FakeTensor)
        and getattr(tensor, "constant", None) is not None
        and device is not None
        and torch.device(device).type == "cuda"
        and not torch.backends.cuda.is_built()
    )


def _runs_cublaslt(bias, mat1, mat2, *rest, beta=1, **_) -> bool:
    """Whether CUDA's addmm takes cuBLASLt's fused-bias path: a contiguous vector bias as wide as the product, a
    product of two matrices each larger than 1 on both sides, beta 1, a floating dtype (ATen's Blas.cpp)."""
    return (
        bias.dim() == 1
        and mat1.dim() == mat2.dim() == 2
        and bias.shape[0] == mat2.shape[1]
        and bias.is_contiguous()
        and bias.dtype in LT_DTYPES
        and min(*mat1.shape, *mat2.shape) > 1
        and beta == 1
    )


def _dropout_mask_first(x: torch.Tensor, p: float, train: bool | None = None) -> bool:
    """Whether native_dropout's kernel allocates its mask before its output: on the CPU always (measured: also
    for train=False, p=0 and p=1), on CUDA unless it takes its shortcuts for train=False and p=1."""
    if x.device.type == "cpu":
        return x.numel() > 0
    return x.device.type == "cuda" and train is not False and p != 1 and x.numel() > 0


DEVICE = torch.ops.prim.device.default  # how C++ asks a tensor subclass for its device
# torch.distributed's functional collectives (DTensor's redistributions, tensor parallelism's all-reduces)
FUNCTIONAL_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
FUNCTIONAL_WAIT = torch.ops._c10d_functional.wait_tensor.default


class FakeCapture(ExactCache):
    """FakeTensorMode whose op outputs on the captured device type claim their storages in `recorder` (an
    optimizer's step counters on the CPU are not a CUDA step's), with DATA_RULE."""

    def __init__(
        self,
        recorder: Recorder,
        device_type: str,
        cublas_workspace: int = 0,
        cublaslt_workspace: int = 0,
        routing: Routing | str = DEFAULT,
        real_cpu: RealCpu | None = None,
    ):
        # with the dispatch cache on, every reference count as without it (traces/fake/dispatch_cache.py)
        super().__init__(recorder, allow_non_fake_inputs=True)
        self._recorder, self._claim, self._device_type = recorder, recorder.claim, device_type
        self._key = recorder.storage_key
        self.data_dependent: Counter[str] = Counter()  # op -> times DATA_RULE read values nobody knows as 0
        self.branches: Counter[str] = Counter()  # file:line -> times the program branched on such a value
        self.real_cpu = real_cpu  # CPU ops on real tensors run for real (traces/fake/real_cpu.py); None: all fake
        self.not_run: Counter[str] = Counter()  # op -> times it was called with no fake kernel to run it
        self.known = KnownValues(routing)  # the values the step knows: constants, the routing rule's choices
        self._patches = Patches()
        self._waiting: list[Waiting] = []  # patches of modules the program has not imported yet
        self._hooks: list = []  # module registration hooks while the capture runs (real_cpu's)
        self._depth = 0  # fake tensor mode enters itself again inside ops: patch once, on the outermost
        self._dispatching = 0  # ops under way: those inside one are fake tensor mode's own (a decomposition)
        self._cublas_workspace = cublas_workspace  # bytes per cuBLAS handle on a fake CUDA step (0: none)
        self._cublaslt_workspace = cublaslt_workspace  # bytes per cuBLASLt handle on a fake CUDA step (0: none)
        self.workspaces: dict[tuple[str, int], torch.Tensor] = {}  # (library, thread id) -> its workspace, kept
        self.after_op: Callable[[], None] | None = None  # called as each op the program runs returns (a live feed)

    def __deepcopy__(self, memo) -> FakeCapture:
        """The mode itself: a fake tensor copied inside the capture (`copy.deepcopy(model)`, an EMA or a DPO reference
        model) belongs to the same capture, as its `fake_mode` attribute says."""
        return self

    def __enter__(self):
        if self._depth == 0:
            to = _tensor_to(torch.Tensor.to)
            for owner, name, method in (
                (torch.Tensor, "to", to),
                (torch.Tensor, "cuda", _cuda(to)),
                (nn.Module, "_apply", _apply_fake(nn.Module._apply)),
                (torch, "tensor", _tensor_from_data(torch.tensor)),
                (torch.Tensor, "pin_memory", _host_pin(torch.Tensor.pin_memory)),
                (nn.functional, "one_hot", _one_hot(nn.functional.one_hot)),
                (torch.Tensor, "__format__", _tensor_format(torch.Tensor.__format__)),
                (torch.Tensor, "numpy", _tensor_numpy(torch.Tensor.numpy, self)),
                (torch.UntypedStorage, "resize_", _recorded_resize(torch.UntypedStorage.resize_, self._recorder)),
                *self.patches(),
                *fake_wrappers.patches(),
                *quiet_logs.patches(),
                *checkpoints.patches(self),
            ):
                self._patches.set(owner, name, method)
            waiting = {hf_masks.MASKING: hf_masks.patches, fake_wrappers.SHARDING: fake_wrappers.sharding_patches,
                       fake_wrappers.ACCELERATE_RNG: fake_wrappers.accelerate_patches,
                       **checkpoints.module_patches(self)}  # fmt: skip
            self._waiting = [on_import(name, self._patch_module(patches)) for name, patches in waiting.items()]
            self._hooks = self.real_cpu.module_tensors_fake(self) if self.real_cpu is not None else []
            FOREACH_TYPES.append(FakeTensor)
        self._depth += 1
        return super().__enter__()

    def _patch_module(self, patches: Callable) -> Callable:
        """What patches a module when it is (or once it is) imported: each of `patches(module)` until the capture
        ends."""

        def patch(module) -> None:
            for owner, name, replacement in patches(module):
                self._patches.set(owner, name, replacement)

        return patch

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            while self._waiting:
                self._waiting.pop().remove()
            while self._hooks:
                self._hooks.pop().remove()
            self._patches.undo()
            FOREACH_TYPES.remove(FakeTensor)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE:  # C++ asking a fake tensor its device (the autograd engine, for each gradient)
            return _DISPATCH_META_HANDLERS[func](args)  # answered as FakeTensorMode answers it, first of all
        if func is aten._pin_memory.default:  # a pinned batch, real or fake: a copy in host memory, as pinning makes
            func, args, kwargs = aten.clone.default, args[:1], {}
        if self.real_cpu is not None and not self._dispatching:
            kwargs = kwargs or {}
            tensors = tensor_arguments(args, kwargs)
            if self.real_cpu.runs_real(func, args, kwargs, tensors):
                return self.real_cpu.run(self, func, args, kwargs, tensors)
            if not all(is_fake(t) for t in tensors):  # a fake op: its real CPU inputs as fake tensors of their layout
                args, kwargs = self.real_cpu.as_fake(self, args, kwargs)
        if func.overloadpacket in RANDOM_FILLS:
            forget(args[0])
            return args[0]
        if func is FUNCTIONAL_WAIT:  # the real wait hands back the collective's result; the meta kernel makes another
            return args[0]
        if func is FUNCTIONAL_ALL_REDUCE:  # the real kernel: a contiguous clone, reduced in place
            with self:  # called as an op, so its output is labelled aten::clone, as the kernel's is
                return aten.clone.default(args[0], memory_format=torch.contiguous_format)
        if self._dispatching:  # what a decomposition makes is the op's own work, as a real kernel's scratch
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func is aten.native_dropout.default and _dropout_mask_first(*args):
            return self._mask_first_dropout(args[0])
        if func is aten._to_copy.default and _to_fake_cuda(args[0], kwargs):
            args[0].constant = None  # a constant would be copied for real, and a CPU build has no CUDA kernel
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return self._grouped_mm_fallback(*args, **(kwargs or {}))
        if func is aten._fused_rms_norm.default and args[0].device.type == "cuda":
            return self._fused_rms_norm(*args, **(kwargs or {}))
        if func is aten.add.Tensor and self._recorder.accumulating() and self._sums_in_place(args[0]):
            func = aten.add_.Tensor
        if func in SUBCLASS_CALLED:
            func = SUBCLASS_PATHS.get((self._recorder.caller(), func), func)
        kwargs = kwargs or {}
        inputs = tensor_arguments(args, kwargs)
        known = self.known.inputs(func, inputs)
        if known is not None and (func in INDEXED or func is aten.index.Tensor):
            check_bounds(func, args, kwargs)  # indices known out of range: the real op raises
        self._dispatching += 1
        try:
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException):
                answer = None if known is None else self.known.answer(self, func, args, kwargs, known)
                if answer is None:
                    out = self._by_rule(func, args)
                else:
                    if any(k is None for k in known):  # some inputs nobody knows, read as 0
                        self.read_unknown(func.overloadpacket)
                    if not isinstance(answer, (torch.Tensor, tuple, list)):
                        return answer  # a scalar read from known values
                    out, known = answer, None  # its values attached already
            except RuntimeError as e:  # an op with no fake kernel (a custom op's, an extension's): named, not run
                refused = no_fake_kernel(func, e)
                if refused is None:
                    raise
                self.not_run[refused.op] += 1
                raise refused from None
            if known is not None:
                self.known.after(func, args, kwargs, known, out)
        finally:
            self._dispatching -= 1
        aliased = self._allocated_in_return_order(out, inputs)
        host = HOST_OUTPUTS.get(func, ()) if self._device_type == "cuda" else ()
        for t in _leaves([o for i, o in enumerate(out) if i not in host] if host else out):
            if isinstance(t, FakeTensor) and t.device.type == self._device_type:
                self._claim(t, self._key(t) in aliased)  # a view: the op that made its storage decided if internal
        if func.overloadpacket in CUBLAS_OPS and self._cublas_workspace:
            self._handle_workspace("cublas", self._cublas_workspace, out)
        if func in CUBLASLT_OPS and self._cublaslt_workspace and _runs_cublaslt(*args, **(kwargs or {})):
            self._handle_workspace("cublaslt", self._cublaslt_workspace, out)
        if self.after_op is not None:
            self.after_op()
        return out

    def _handle_workspace(self, library: str, size: int, out) -> None:
        """A CUDA matmul's first use of `library` (cuBLAS or cuBLASLt) on this thread: the thread's handle takes its
        workspace of `size` bytes from the caching allocator, after the op's output is allocated, and keeps it."""
        key = (library, threading.get_ident())
        if key in self.workspaces:
            return
        device = next((t.device for t in tree_leaves(out) if isinstance(t, FakeTensor)), None)
        if device is None or device.type != "cuda":
            return
        with self:
            workspace = torch.empty(size, dtype=torch.uint8, device=device)
        self._claim(workspace)
        self.workspaces[key] = workspace

    def workspace_keys(self) -> set[int]:
        """The storage keys of the cuBLAS and cuBLASLt workspaces made so far."""
        return {self._recorder.storage_key(t) for t in self.workspaces.values()}

    def _allocated_in_return_order(self, out, inputs: list[torch.Tensor]) -> set[int]:
        """Put the allocations of the op's new storages in the order it returns them, as kernels allocate their
        outputs (fake tensor mode may have run a decomposition, which makes them in its own order); returns the
        storage keys of the op's tensor inputs (an output among them is a view or written in place, not new)."""
        keys = self._key
        aliased = {keys(t) for t in inputs if isinstance(t, FakeTensor)}
        fresh = [keys(t) for t in _leaves(out) if isinstance(t, FakeTensor) and t.device.type == self._device_type]
        fresh = list(dict.fromkeys(key for key in fresh if key not in aliased))
        if len(fresh) > 1:
            self._recorder.in_order(fresh)
        return aliased

    def _sums_in_place(self, first: torch.Tensor) -> bool:
        """Whether the autograd engine, summing a gradient into `first`, would add in place for real tensors: with
        grad mode off, `first` dense, and the engine holding the only reference to it and to its storage."""
        uses, storage_uses, dense = self._recorder.references(first)
        last = uses == 1 + DISPATCH_REFERENCES and storage_uses == 1
        return not torch.is_grad_enabled() and last and dense

    def _mask_first_dropout(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """native_dropout as the CPU and CUDA kernels allocate it: the mask first, then the output (meta: the
        reverse)."""
        with self:
            mask = torch.empty_like(x, dtype=torch.bool)
            output = torch.empty_like(x)
        self._claim(mask)
        self._claim(output)
        return output, mask

    def _fused_rms_norm(self, x: torch.Tensor, normalized_shape, weight=None, eps=None):
        """_fused_rms_norm as CUDA's kernel allocates it: the output, then the reciprocal standard deviation (one
        per row, in the input's accumulation type: fp32 for fp16 and bf16), nothing between (a fake tensor mode
        would decompose it into the composite's pow, mean and rsqrt)."""
        rows = x.shape[: x.dim() - len(normalized_shape)]
        accumulate = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        with self:
            output = torch.empty_like(x, memory_format=torch.contiguous_format)
            rstd = torch.empty(rows + (1,) * len(normalized_shape), dtype=accumulate, device=x.device)
        self._claim(output)
        self._claim(rstd)
        return output, rstd

    def _grouped_mm_fallback(self, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        """_grouped_mm in another dtype than bf16, as ATen's fallback runs it on CUDA and the CPU (one mm a group
        into slices of one output): the output alone, its shape the bf16 kernel's (whose meta function refuses
        other dtypes)."""

        def meta(t):
            return None if t is None else torch.empty(t.shape, dtype=_bf16_or(t.dtype), device="meta")

        with unset_fake_temporarily():  # the shape only: nothing of it is the step's
            shape = aten._grouped_mm.default(meta(mat_a), meta(mat_b), offs=meta(offs)).shape
        with self:
            output = torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)
        self._claim(output)
        return output

    def read_unknown(self, packet) -> None:
        """Count a read of values nobody knows (DATA_RULE), and a scalar read's branch where the program's code
        branches on it (traces/fake/branches.py)."""
        self.data_dependent[str(packet)] += 1
        if packet is aten._local_scalar_dense:
            site = branch_site()
            if site is not None:
                self.branches[site] += 1

    def _by_rule(self, func, args):
        """DATA_RULE's output for `func`; DataDependentError for an op it does not cover."""
        packet = func.overloadpacket
        self.read_unknown(packet)
        if packet is aten._local_scalar_dense:
            return False if args[0].dtype == torch.bool else 0.0 if args[0].is_floating_point() else 0
        if packet is aten.nonzero:
            with self:
                return torch.empty((0, args[0].dim()), dtype=torch.long, device=args[0].device)
        if packet is aten.masked_select:
            with self:
                return torch.empty(0, dtype=args[0].dtype, device=args[0].device)
        raise DataDependentError(
            f"{packet}: its output size depends on tensor values, which fake tensors do not have (trace without --fake)"
        )
