"""The bundled GPT-2 with Megatron's tensor and sequence parallelism, and its training-step workload.

`ParallelGPT2` takes this rank's share of a single-process `planner.workloads.gpt2.GPT2` built from
the same seed, so every parallel size trains the same model. Embeddings, the final LayerNorm and the
tied head are replicated; with sequence parallelism the embeddings are split along the sequence before
the first layer and gathered after the final LayerNorm. Every rank must draw the same random stream
(the launcher seeds each rank alike) so that dropouts on replicated tensors stay replicated.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from memplan.planner.parallel import comm
from memplan.planner.parallel.comm import ParallelError
from memplan.planner.parallel.layer import ParallelGPT2Layer
from memplan.planner.parallel.linear import mark_sequence_parallel, sync_sequence_parallel_grads
from memplan.planner.workloads import gpt2
from memplan.planner.workloads.blocks import Dropout
from memplan.traces.inputs.workload import Workload


class ParallelGPT2(nn.Module):
    """GPT-2 whose layers are split over the ranks of `group` (tensor parallel, optionally sequence parallel)."""

    def __init__(self, full: gpt2.GPT2, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.config, self.group, self.sequence_parallel = full.config, group, sequence_parallel
        self.wte, self.wpe, self.ln_f = full.wte, full.wpe, full.ln_f
        self.dropout = Dropout(full.dropout.p)
        self.layers = nn.ModuleList(
            ParallelGPT2Layer.from_layer(layer, group, sequence_parallel) for layer in full.layers
        )
        if sequence_parallel:
            for p in self.ln_f.parameters():
                mark_sequence_parallel(p)
        sync_sequence_parallel_grads(self, group)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq), the same on every rank -> next-token logits (batch, seq, vocab)."""
        s = input_ids.size(1)
        positions = torch.arange(s, device=input_ids.device)
        x = (self.wte(input_ids) + self.wpe(positions)).transpose(0, 1)  # [s, b, h]
        x = comm.scatter_to_sequence_parallel(x, self.group) if self.sequence_parallel else x.contiguous()
        x = self.dropout(x)
        causal = torch.full((s, s), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        for layer in self.layers:
            x = layer(x, causal)
        x = self.ln_f(x)
        if self.sequence_parallel:
            x = comm.gather_from_sequence_parallel(x, self.group)
        return F.linear(x.transpose(0, 1), self.wte.weight)


def build_workload(
    batch_size: int = 2,
    seq_len: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: gpt2.GPT2Config = gpt2.TINY,
    seed: int = 0,
    lr: float = 1e-4,
    tensor_parallel: int | None = None,
    sequence_parallel: bool = False,
    group=None,
) -> Workload:
    """GPT-2's training step with this rank's share of the model (same weights and tokens as
    `planner.workloads.gpt2.build_workload` with the same seed). `tensor_parallel` defaults to the
    group's size and must equal it; sequence parallelism needs a sequence divisible by it."""
    t = comm.world(group)
    if tensor_parallel is not None and tensor_parallel != t:
        raise ParallelError(
            f"tensor_parallel={tensor_parallel} but the process group has {t} ranks "
            f"(start {tensor_parallel} processes, e.g. memplan trace --nproc {tensor_parallel})"
        )
    if config.heads % t or (config.ffn_mult * config.hidden) % t:
        raise ParallelError(
            f"{config.heads} heads and {config.ffn_mult * config.hidden} MLP features cannot be split over {t} ranks"
        )
    if sequence_parallel and seq_len % t:
        raise ParallelError(f"sequence length {seq_len} is not divisible by the parallel size {t}")
    full = gpt2.build_workload(batch_size, seq_len, dtype, device, config, seed, lr)
    model = ParallelGPT2(full.model, group, sequence_parallel).train()
    kind = f"tp{t}" + ("-sp" if sequence_parallel else "")
    return Workload(
        model=model,
        inputs=full.inputs,
        optimizer=torch.optim.AdamW(model.parameters(), lr=lr),
        loss_fn=full.loss_fn,
        name=f"{full.name}-{kind}",
    )
