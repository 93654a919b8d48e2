"""FakeTensorMode's dispatch cache under a fake capture, with every storage's reference count as without it.

The cache answers an op it has seen with the same metadata from that metadata, without running the op's meta kernel
or decomposition (most of a fake step's time). As PyTorch writes it, it reads each input's and output's storage size
through `untyped_storage()`, and makes a cached view on its input's storage through the same, and a storage once
made a Python object keeps a reference from that object for good (PyTorch's PyObject preservation): every tensor the
cache looked at would have a storage reference more, and the autograd engine's in-place gradient sum, which a
capture decides from reference counts (fake.DISPATCH_REFERENCES), would depend on what the cache had seen before.
`ExactCache` does both in C++ (through the recorder), so what the cache makes and reads holds no reference a real
kernel's would not: a trace is the same whether the cache was empty or full. tests/test_capture_fidelity.py pins
it (fake and real traces of every bundled model allocate and free the same buffers in the same order), and
tests/test_fake_cache.py that a hit and a miss leave the same counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    TensorMetadata,
    in_kernel_invocation_manager,
    is_sparse_any,
    suggest_memory_format,
)

from memplan.traces.recorder import Recorder


@dataclass(slots=True)
class StridedMetadata(TensorMetadata):
    """TensorMetadata of a dense strided tensor with sizes of plain ints, flattened into a cache key as one tuple
    (FakeTensorMode flattens it field by field, each size through its walk of an op's arguments: most of a lookup's
    time); its memory format is left out, as it follows from the sizes and strides."""

    def _flatten_into(self, result: list, mode: FakeTensorMode, state) -> None:
        result.append(StridedMetadata)  # a class no op argument is: never equal to FakeTensorMode's flattening
        result.append(
            (
                self.dtype,
                self.shape,
                self.stride,
                self.device,
                self.storage_offset,
                self.storage_bytes,
                self.requires_grad,
                self.is_quantized,
                self.is_conj,
                self.is_neg,
                self.is_inference,
            )
        )


def metadata(storage_nbytes: Callable[[torch.Tensor], int]) -> Callable[[torch.Tensor], TensorMetadata]:
    """fake_tensor.extract_tensor_metadata with the storage's size from `storage_nbytes` (read in C++), a dense
    strided tensor's as StridedMetadata."""

    def extract_tensor_metadata(t: torch.Tensor) -> TensorMetadata:
        sparse = is_sparse_any(t)
        if not (sparse or t._has_symbolic_sizes_strides) and t.layout == torch.strided:
            return StridedMetadata(
                t.dtype,
                t.shape,
                t.stride(),
                t.device,
                torch.strided,
                None,
                t.storage_offset(),
                storage_nbytes(t),
                t.requires_grad,
                t.is_quantized,
                t.is_conj(),
                t.is_neg(),
                t.is_inference(),
                False,
                None,
                None,
                None,
            )
        memory_format = suggest_memory_format(t)
        if t._has_symbolic_sizes_strides or sparse or not t.is_contiguous(memory_format=memory_format):
            memory_format = None
        return TensorMetadata(
            t.dtype,
            t.shape,
            t.stride() if t.layout == torch.strided else (),
            t.device,
            t.layout,
            memory_format,
            t.storage_offset(),
            None if sparse else storage_nbytes(t),
            t.requires_grad,
            t.is_quantized,
            t.is_conj(),
            t.is_neg(),
            t.is_inference(),
            t.is_sparse,
            t.is_coalesced() if t.is_sparse else None,
            t.dense_dim() if sparse else None,
            t.sparse_dim() if sparse else None,
        )

    return extract_tensor_metadata


class ExactCache(FakeTensorMode):
    """FakeTensorMode with its dispatch cache on, reading and sharing storages through `recorder` (in C++); its
    `patches()` are installed while it is active."""

    def __init__(self, recorder: Recorder, **kwargs):
        super().__init__(**kwargs)
        self.cache_enabled = True
        self._storages = recorder

    def patches(self) -> Iterator[tuple[object, str, object]]:
        """(owner, name, replacement): the cache's reading of a tensor's metadata."""
        yield fake_tensor, "extract_tensor_metadata", metadata(self._storages.storage_nbytes)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        """A cached view made on its input's storage in C++; any other output as FakeTensorMode makes it."""
        found = entry.metadata
        if entry.view_idx is None or found is None or self.shape_env is not None:
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        with in_kernel_invocation_manager(self):
            view = torch.empty(0, dtype=found.dtype, device="meta", requires_grad=found.requires_grad)
            torch._C._set_conj(view, found.is_conj)
            torch._C._set_neg(view, found.is_neg)
            self._storages.share_storage(view, args[entry.view_idx], found.storage_offset, found.shape, found.stride)
        return FakeTensor(self, view, found.device)
