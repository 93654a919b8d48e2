"""HuggingFace's attention-mask helpers under a fake capture: answered as a real step of a batch without padding
and without packed sequences, as memplan's model files and HF configs build it.

transformers takes a FakeTensor for a sign of graph tracing (`utils.import_utils.is_tracing`) and then never lets
SDPA apply its own causal mask: it builds the full mask (and for grouped-query attention repeats the keys and values
instead of passing `enable_gqa`), so a fake step chose another attention kernel, with other buffers, than the real
one (an H200 step of a Llama config in fp32: math attention, 64 MiB a layer, against the fake step's
memory-efficient kernel; tests/test_cuda_snapshots.py). Under the capture these helpers see no tracing, and the two
questions they would answer from the data (any padding? several sequences packed in a row?) are answered no. The
helpers are patched whether the program imported transformers before the capture began or imports it inside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType

from torch._subclasses.fake_tensor import FakeTensor

MASKING = "transformers.masking_utils"


def _untraced(is_tracing: Callable) -> Callable:
    """transformers' is_tracing, for which a fake tensor is an eager step's tensor, not a graph being traced."""

    def is_tracing_eagerly(tensor=None) -> bool:
        return is_tracing(None if isinstance(tensor, FakeTensor) else tensor)

    return is_tracing_eagerly


def _unpacked(find_packed_sequence_indices: Callable) -> Callable:
    """The helper run as it is (its tensors allocated as in a real step), its answer for a fake batch: not packed."""

    def no_packed_sequences(position_ids):
        found = find_packed_sequence_indices(position_ids)
        return None if isinstance(found, FakeTensor) else found

    return no_packed_sequences


def _unpadded(fast_all: Callable) -> Callable:
    """The helper run as it is, its answer for a fake mask: every token attends."""

    def all_tokens_attend(tensor):
        answer = fast_all(tensor)
        return True if isinstance(answer, FakeTensor) else answer

    return all_tokens_attend


WRAPPERS = {"is_tracing": _untraced, "find_packed_sequence_indices": _unpacked, "fast_all": _unpadded}


def patches(masking: ModuleType) -> Iterator[tuple[object, str, Callable]]:
    """(module, name, replacement) for each helper of transformers' masking module `masking` (MASKING), which a
    capture patches whenever it is imported, before the capture or inside it (traces/on_import.py)."""
    for name, wrap in WRAPPERS.items():
        original = getattr(masking, name, None)
        if original is not None:
            yield masking, name, wrap(original)
