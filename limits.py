"""The limits on what memplan reads: every input file is bounded here, so a hostile or broken file ends in one
`Error:` line (LimitError) instead of a hang, a traceback or all the machine's memory. docs/limits.md lists them.

Each value is far above what memplan's own files and real training steps need (the figures in the comments),
and low enough that reaching it costs seconds and at most a few GiB.
"""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Iterator

from memplan.errors import MemplanError
from memplan.units import GiB, MiB

# Bytes of any input file (trace, plan, CSV) after gzip decompression, read before parsing. A trace takes about
# 80 B per buffer, so this holds some 13 million buffers (memplan's BERT-Large slice: 1,052 buffers, 87 KB);
# the cap is what stops a gzip bomb or /dev/zero before it takes the machine's memory.
MAX_INPUT_BYTES = 1 * GiB

# Bytes of a CUDA memory snapshot (a pickle). A snapshot decodes to about five times its bytes (a GPT-2 medium
# step's: 22,332 entries, 3.9 MB, 19 MB decoded), so this holds some 3 million entries in a few GiB.
MAX_PICKLE_BYTES = 512 * MiB

# Containers nested in a snapshot: PyTorch's snapshots nest 8 deep (dict, list of devices, list of entries,
# entry, frames, frame ...). Deeper data would overflow the stack of any code that walks it recursively.
MAX_PICKLE_DEPTH = 32

# Containers nested in a trace's free-form `meta` (its patch report nests 4 deep). The JSON decoder itself stops
# at Python's recursion limit (about 1,000) with its own error; this bound keeps writing the meta back safe.
MAX_JSON_DEPTH = 32

# Logical times count a trace's events, at most two per buffer (its allocation and its free), and the simulators
# keep arrays indexed by time. A time may exceed twice the buffer count by this slack, so hand-made traces may
# leave gaps, but event times of 2**40 cannot make the simulator ask for terabytes.
TIME_SLACK = 1 << 20

# Distinct streams in a trace or problem: reuse safety keeps a buffers x streams matrix (and streams x streams
# clocks). A training step uses a handful (compute, NCCL, copies); 256 keeps a million-buffer matrix at 2 GiB.
MAX_STREAMS = 256

# Bytes of a HuggingFace config.json, read before parsing: a causal LM's config is a few KB (Llama-3-8B's: 826 B;
# one with a label map for thousands of classes: some hundreds of KB). A 200 MB config used to be read whole (1.66 GB).
MAX_CONFIG_BYTES = 4 * MiB

# The range of each number in a HuggingFace config that sets a model's shape (under the names configs give it, in
# the config and in its sub-configs such as text_config): each far beyond any published model's, and low enough that
# a config cannot ask for a build that never ends (10**9 layers built for minutes, 10 GiB live) or a model of no
# layers (-2 gave an empty trace), or divide by zero in transformers (0 heads). The model's size as a whole is
# MAX_PARAMETERS'.
_LAYERS = (1, 1024)  # the deepest published LLMs: Llama-3.1-405B's 126 layers, Megatron-Turing NLG's 105
_HEADS = (1, 1 << 16)  # Llama-3.1-405B: 128 query heads
_WIDTH = (1, 1 << 20)  # Llama-3.1-405B: hidden 16,384
_MLP = (0, 1 << 20)  # Llama-3.1-405B: 53,248 (0: no such MLP, as some mixtures of experts' configs say)
_VOCABULARY = (1, 1 << 24)  # Gemma 3: 262,144 tokens
_POSITIONS = (1, 1 << 30)  # Llama 4 Scout: 10,485,760
_EXPERTS = (0, 1 << 16)  # DeepSeek-V3: 256 routed experts, 8 a token (0: a dense model in some configs)
CONFIG_RANGES = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers"), _LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "decoder_attention_heads",
                     "encoder_attention_heads"), _HEADS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "head_dim"), _WIDTH),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "moe_intermediate_size",
                     "shared_expert_intermediate_size"), _MLP),
    **dict.fromkeys(("vocab_size",), _VOCABULARY),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), _POSITIONS),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts"),
                    _EXPERTS),
}  # fmt: skip

# Parameters of the model a HuggingFace config describes, counted by building it on PyTorch's meta device (no memory,
# no compute) before the step is built: the largest open models have about a trillion (Kimi K2: 1.04e12; DeepSeek-V3:
# 6.7e11). `--max-parameters` (StepSpec.max_parameters) raises it.
MAX_PARAMETERS = 2 * 10**12

# Seconds a build of a C++ part waits for another memplan process building the same part (a first build takes
# 30 s to 4 min on a 2-core machine) before giving up with a BuildError instead of hanging.
BUILD_LOCK_WAIT_S = 15 * 60


class LimitError(MemplanError):
    """An input exceeds one of memplan's limits (memplan/limits.py): too big, too deep, too many streams."""


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 40, 40, 40


def short_repr(value) -> str:
    """A repr of at most about a hundred characters, whatever the value's size, depth or sharing (for errors that
    quote a bad value from a file)."""
    return _SHORT.repr(value)


CONTAINERS = (dict, list, tuple)


def _children(container) -> Iterator:
    """What a container holds: a dict's keys and values, a list's or tuple's items."""
    return itertools.chain(container.keys(), container.values()) if type(container) is dict else iter(container)


def check_nesting(obj, max_depth: int, plain: tuple[type, ...] | None = None) -> None:
    """LimitError when containers (dict, list, tuple) in `obj` nest more than `max_depth` deep, ValueError when one
    holds itself, TypeError naming the type of the first value outside `plain` (when given). Iterative, and a
    container shared by many (a pickle's memo) is walked once: a pickle of 2**80 paths costs its own size."""
    if plain is not None and type(obj) not in plain:
        raise TypeError(type(obj).__name__)
    if type(obj) not in CONTAINERS:
        return
    heights: dict[int, int] = {}  # id of a container walked -> containers nested in it, itself included
    path = [[obj, _children(obj), 1]]  # the containers being walked: [container, its items left, its height]
    on_path = {id(obj)}
    while path:
        frame = path[-1]
        for child in frame[1]:
            kind = type(child)
            if plain is not None and kind not in plain:
                raise TypeError(kind.__name__)
            if kind not in CONTAINERS:
                continue
            key = id(child)
            if key in on_path:
                raise ValueError("a container holds itself (a cycle)")
            height = heights.get(key)
            if height is None:
                if len(path) >= max_depth:
                    raise LimitError(f"containers nested more than {max_depth} deep")
                path.append([child, _children(child), 1])
                on_path.add(key)
                break
            if len(path) + height > max_depth:
                raise LimitError(f"containers nested more than {max_depth} deep")
            frame[2] = max(frame[2], height + 1)
        else:
            path.pop()
            on_path.discard(id(frame[0]))
            heights[id(frame[0])] = frame[2]
            if path:
                path[-1][2] = max(path[-1][2], frame[2] + 1)
