"""Checkpoints read by shape under a fake capture: a local checkpoint gives fake tensors of its stored dtypes, shapes,
strides and storages, and none of its tensor data is read, so a script that loads a 16 GB checkpoint before training
runs under `memplan check` in seconds and in little host memory.

- `torch.load` of a file `torch.save` wrote (zip format): the pickle and the storages' records are read, each
  storage becomes one fake tensor on the device `map_location` (or the stored location) names, allocated there as a
  real load allocates it (on fake CUDA the recorder and the live allocator see it), and each tensor is a view of its
  storage at its stored offset and strides, so tensors that shared a storage share it. Everything else in the pickle
  (dicts, step counters, an optimizer's state dict) comes back as stored. A legacy (non-zip) file and a TorchScript
  archive load as torch's own fake tensor mode loads them (shapes only, on the stored device, not allocated).
- safetensors (`safe_open`, `load_file`, `torch.load` of a .safetensors path): the header (8 bytes of length, then
  JSON) is read; `get_tensor`, `get_slice(...)[index]` and `get_tensors` make fake tensors of the stored dtypes and
  shapes on the device asked for. A file shorter than its header says fails as safetensors fails.
- HuggingFace `from_pretrained` of a local folder reads its checkpoint through these (safetensors' `safe_open`, or
  `torch.load` for pytorch_model.bin); transformers' loading threads materialize on the capture's own thread, where
  fake tensors are made (fake tensor mode is a thread's own).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

# Modules whose patches wait for their import (traces/on_import.py): name -> what patches it, given the capture.
SAFETENSORS, SAFETENSORS_TORCH = "safetensors", "safetensors.torch"
HF_MODELING, HF_LOADING = "transformers.modeling_utils", "transformers.core_model_loading"
MAX_HEADER = 100_000_000  # bytes: safetensors refuses a larger header (its MAX_HEADER_SIZE)
LOAD_MODULE_MAPPING = {"torch.tensor": "torch._tensor"}  # torch.serialization's renames for old pickles


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file as its header describes it."""

    dtype: str  # safetensors' name: "BF16", "F32", ...
    shape: tuple[int, ...]
    start: int  # byte offsets in the data region
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header: its tensors in the header's order, its free-form metadata (None when absent)."""

    tensors: dict[str, StoredTensor]
    metadata: dict[str, str] | None


def read_safetensors_header(path: str | os.PathLike, error: type[Exception] = ValueError) -> SafetensorsHeader:
    """The header of the safetensors file at `path`, read without its data; `error` (safetensors' SafetensorError)
    with safetensors' own message for a header it would refuse, or a file shorter than its header says."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise error("Error while deserializing header: HeaderTooSmall")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER:
            raise error("Error while deserializing header: HeaderTooLarge")
        text = f.read(length)
        size = os.fstat(f.fileno()).st_size
    if len(text) < length:
        raise error("Error while deserializing header: InvalidHeaderLength")
    try:
        fields = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"Error while deserializing header: InvalidHeaderDeserialization: {e}") from None
    if not isinstance(fields, dict):
        raise error("Error while deserializing header: InvalidHeaderDeserialization")
    metadata = fields.pop("__metadata__", None)
    tensors, end = {}, 0
    for name, entry in fields.items():
        try:
            start, stop = (int(x) for x in entry["data_offsets"])
            stored = StoredTensor(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]), start, stop)
        except (KeyError, TypeError, ValueError):
            raise error(f"Error while deserializing header: InvalidHeaderDeserialization ({name})") from None
        tensors[name], end = stored, max(end, stop)
    if 8 + length + end > size:
        raise error("Error while deserializing header: MetadataIncompleteBuffer")
    return SafetensorsHeader(tensors, metadata)


def _device(device) -> torch.device:
    """A device as safetensors and torch.load name it (an int is a CUDA device's index)."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _empty(mode, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A fake tensor made in the capture `mode` (on fake CUDA: an allocation it records)."""
    with mode:
        return torch.empty(shape, dtype=dtype, device=device)


class _FakeSlice:
    """safetensors' slice of one stored tensor: its shape and dtype, and indexing makes a fake tensor of the
    indexed shape (safetensors reads only the slice's bytes: a contiguous tensor of that shape)."""

    def __init__(self, mode, stored: StoredTensor, dtype: torch.dtype, device: torch.device):
        self._mode, self._stored, self._dtype, self._device = mode, stored, dtype, device

    def get_shape(self) -> list[int]:
        return list(self._stored.shape)

    def get_dtype(self) -> str:
        return self._stored.dtype

    def __getitem__(self, index) -> torch.Tensor:
        with unset_fake_temporarily():
            shape = torch.empty(self._stored.shape, dtype=self._dtype, device="meta")[index].shape
        return _empty(self._mode, shape, self._dtype, self._device)


class _FakeSafeOpen:
    """safetensors' safe_open for the PyTorch framework, by shape: the header read, tensors made fake."""

    def __init__(self, mode, safetensors: ModuleType, filename, device="cpu"):
        self._mode, self._device = mode, _device(device)
        self._header = read_safetensors_header(filename, safetensors.SafetensorError)
        self._types, self._error = _dtypes(), safetensors.SafetensorError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return sorted(self._header.tensors)

    def offset_keys(self) -> list[str]:
        return sorted(self._header.tensors, key=lambda k: self._header.tensors[k].start)

    def metadata(self) -> dict[str, str] | None:
        return self._header.metadata

    def _stored(self, name: str) -> tuple[StoredTensor, torch.dtype]:
        stored = self._header.tensors.get(name)
        if stored is None:
            raise self._error(f"File does not contain tensor {name}")
        if stored.dtype not in self._types:
            raise self._error(f"dtype {stored.dtype} of {name}: not a torch dtype")
        return stored, self._types[stored.dtype]

    def get_slice(self, name: str) -> _FakeSlice:
        return _FakeSlice(self._mode, *self._stored(name), self._device)

    def get_tensor(self, name: str) -> torch.Tensor:
        stored, dtype = self._stored(name)
        return _empty(self._mode, stored.shape, dtype, self._device)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.get_tensor(name) for name in self.offset_keys()}


def _dtypes() -> dict[str, torch.dtype]:
    """safetensors' dtype names -> torch dtypes (safetensors' own table)."""
    from safetensors.torch import _TYPES

    return dict(_TYPES)


def _safe_open(mode, safetensors: ModuleType, original: Callable) -> Callable:
    """safe_open that reads a file by shape for PyTorch; other frameworks (numpy, flax) read it as safetensors does."""

    def safe_open(filename, framework, device="cpu", **kwargs):
        if framework not in ("pt", "torch", "pytorch"):
            return original(filename, framework, device, **kwargs)
        return _FakeSafeOpen(mode, safetensors, filename, device)

    return safe_open


class _Stored:
    """One storage of a torch.save'd file, made as a fake tensor of its bytes on its device; each tensor of it is a
    view at its own offset and strides (what torch's rebuild functions get where they would get a TypedStorage)."""

    def __init__(self, mode, dtype: torch.dtype, numel: int, device: torch.device):
        self._mode, self.dtype = mode, dtype
        self.base = _empty(mode, (numel,), dtype, device)

    @property
    def device(self) -> torch.device:
        return self.base.device

    def tensor(self, offset: int, size, stride, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor of this storage (in `dtype`: a storage saved untyped), not a view to autograd."""
        with self._mode:
            base = self.base if dtype is None or dtype == self.dtype else self.base.view(dtype)
            return base.as_strided(size, stride, offset).detach()


class _Probe:
    """What a map_location function gets in place of a storage (torch gives it the storage on the CPU): it says where
    the function moves it (`cuda`, `cpu`, `to`), nothing made."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def cuda(self, device=None, non_blocking: bool = False) -> _Probe:
        return _Probe(torch.device("cuda", device) if isinstance(device, int) else device or "cuda")

    def cpu(self) -> _Probe:
        return _Probe("cpu")

    def to(self, device=None, non_blocking: bool = False) -> _Probe:
        return _Probe(self.device if device is None else _device(device))


def _restored_device(map_location, location: str) -> torch.device:
    """Where torch.load puts a storage saved at `location`, by `map_location` (None, a device, a dict of locations,
    or a function of a storage and its location, given a `_Probe`: one that returns None leaves the stored
    location)."""
    if map_location is None:
        return torch.device(location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(location, location))
    if isinstance(map_location, (str, bytes, torch.device)):
        return torch.device(map_location.decode() if isinstance(map_location, bytes) else map_location)
    moved = map_location(_Probe(), location)
    return torch.device(location) if moved is None else torch.device(moved.device)


def _rebuild(original: Callable) -> Callable:
    """torch._utils._rebuild_tensor for a `_Stored` storage too."""

    def rebuild_tensor(storage, storage_offset, size, stride):
        if isinstance(storage, _Stored):
            return storage.tensor(storage_offset, size, stride)
        return original(storage, storage_offset, size, stride)

    return rebuild_tensor


def _rebuild_v3(original: Callable) -> Callable:
    """torch._utils._rebuild_tensor_v3 (the dtypes saved in an untyped storage: float8, uint16 ...) for a `_Stored`
    storage too."""

    def rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
        if not isinstance(storage, _Stored):
            return original(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata)
        tensor = storage.tensor(storage_offset, size, stride, dtype).requires_grad_(requires_grad)
        if metadata:
            torch._utils.set_tensor_metadata(tensor, metadata)
        tensor._backward_hooks = backward_hooks
        return tensor

    return rebuild_tensor_v3


@contextlib.contextmanager
def _rebuilding(weights_only: ModuleType | None) -> Iterator[None]:
    """torch's tensor rebuild functions taking `_Stored` storages while a file is unpickled (`weights_only`: the
    weights-only unpickler, whose allow-list names them)."""
    utils = torch._utils
    rebuild, v3 = utils._rebuild_tensor, utils._rebuild_tensor_v3
    utils._rebuild_tensor, utils._rebuild_tensor_v3 = _rebuild(rebuild), _rebuild_v3(v3)
    allowed = getattr(weights_only, "_get_allowed_globals", None)
    if allowed is not None:
        table = {**allowed(), "torch._utils._rebuild_tensor_v3": utils._rebuild_tensor_v3}
        weights_only._get_allowed_globals = lambda: table
    try:
        yield
    finally:
        utils._rebuild_tensor, utils._rebuild_tensor_v3 = rebuild, v3
        if allowed is not None:
            weights_only._get_allowed_globals = allowed


def _fake_load(mode) -> Callable:
    """torch.serialization._load (what torch.load runs for a zip-format file) by shape: the pickle read, each storage
    a fake tensor on its restored device, nothing read of the storages' records."""
    serialization = torch.serialization

    def _load(zip_file, map_location, pickle_module, pickle_file="data.pkl", overall_storage=None, **load_args):
        storages: dict[str, _Stored] = {}

        def persistent_load(saved_id):
            typename, storage_type, key, location, numel = (serialization._maybe_decode_ascii(x) for x in saved_id)
            if typename != "storage":
                raise RuntimeError(f"Unknown typename for persistent_load, expected 'storage' but got '{typename}'")
            if key not in storages:
                dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
                storages[key] = _Stored(mode, dtype, numel, _restored_device(map_location, location))
            return storages[key]

        class Unpickler(pickle_module.Unpickler):
            def find_class(self, mod_name, name):
                if type(name) is str and "Storage" in name:
                    with contextlib.suppress(KeyError):
                        return serialization.StorageType(name)
                return super().find_class(LOAD_MODULE_MAPPING.get(mod_name, mod_name), name)

        weights_only = pickle_module if pickle_module is torch._weights_only_unpickler else None
        unpickler = Unpickler(io.BytesIO(zip_file.get_record(pickle_file)), **load_args)
        unpickler.persistent_load = persistent_load
        serialization._serialization_tls.map_location = map_location
        try:
            with _rebuilding(weights_only):
                return unpickler.load()
        finally:
            serialization._serialization_tls.map_location = None

    return _load


def patches(mode) -> Iterator[tuple[object, str, Callable]]:
    """(owner, name, replacement) for a capture `mode`: torch.load of a zip-format file by shape."""
    yield torch.serialization, "_load", _fake_load(mode)


def _serial(spawn_materialize: Callable) -> Callable:
    """transformers' spawn_materialize without its thread pool: each tensor made when asked, on the capture's
    thread."""

    def spawn_in_this_thread(thread_pool, *args, **kwargs):
        return spawn_materialize(None, *args, **kwargs)

    return spawn_in_this_thread


def module_patches(mode) -> dict[str, Callable[[ModuleType], Iterator[tuple[object, str, Callable]]]]:
    """Module name -> what patches it for a capture `mode` once imported: safetensors' safe_open (where
    safetensors.torch and transformers hold it too) by shape, transformers' loading on one thread."""

    def safe_open_in(module: ModuleType):
        import safetensors

        original = getattr(module, "safe_open", None)
        if getattr(original, "memplan_original", None) is not None:  # bound by an import inside the capture
            original = original.memplan_original
            module.safe_open = original  # what the capture restores when it ends
        if original is not None:
            replacement = _safe_open(mode, safetensors, original)
            replacement.memplan_original = original
            yield module, "safe_open", replacement

    def loading(module: ModuleType):
        original = getattr(module, "spawn_materialize", None)
        if original is not None:
            yield module, "spawn_materialize", _serial(original)

    return {**dict.fromkeys((SAFETENSORS, SAFETENSORS_TORCH, HF_MODELING), safe_open_in), HF_LOADING: loading}
