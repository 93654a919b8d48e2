"""The bundled Llama split into pipeline stages run by torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B),
and the training-step workload of one rank: `schedule.step(...)` over the micro-batches, the loss on the last stage,
then the optimizer's step.

Every rank builds the single-process `planner.workloads.llama.Llama` from the same seed and keeps its stages' layers
(the first stage the embedding, the last the final norm and the head), so every split trains the same model. Each
`PipelineStage` is given its input and output shapes (static metadata): no stage needs its neighbours to tell it
what it receives, which the fake process group (whose receives move nothing) could not do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.nn import functional as F

from memplan.planner.parallel.fsdp import PRECISIONS, shard
from memplan.planner.workloads.blocks import WorkloadConfigError
from memplan.planner.workloads.llama import Llama, LlamaConfig
from memplan.traces.fake.mode import module_to
from memplan.traces.inputs.workload import Workload
from memplan.traces.ranks.communication import COMMUNICATION  # the category of the stages' P2P receive buffers

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}


class LlamaStage(nn.Module):
    """Consecutive layers of a Llama; the first stage also embeds the tokens, the last applies the final norm and the
    head. Takes token ids (first stage) or hidden states, returns hidden states (logits on the last stage)."""

    def __init__(self, full: Llama, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed = full.embed if first else None
        self.layers = nn.ModuleList(full.layers[i] for i in layers)
        self.norm = full.norm if last else None
        self.head = full.head if last else None
        self.register_buffer("inv_freq", full.inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq.float())
        angles = torch.cat((angles, angles), dim=-1)
        h = self.embed(x) if self.embed is not None else x
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.head(self.norm(h)) if self.head is not None else h


def stage_layers(layers: int, stages: int) -> list[range]:
    """The layers of each stage: consecutive, as even as they divide (the first stages take one more)."""
    if layers < stages:
        raise WorkloadConfigError(f"{layers} layers cannot fill {stages} pipeline stages (one layer each at least)")
    per, extra = divmod(layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + per + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a micro-batch's logits (batch, seq, vocab) against its next tokens (batch, seq), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass
class PipelineWorkload(Workload):
    """One rank's share of a pipelined training step. `model` holds the rank's stage modules (a ModuleList of them
    for an interleaved schedule, else the one stage); `step()` runs the schedule over the micro-batches, then the
    optimizer."""

    schedule: object = None
    stages: list = field(default_factory=list)  # this rank's PipelineStages
    targets: torch.Tensor | None = None  # the next tokens, given to the schedule on the rank of the last stage

    def roots(self) -> list[nn.Module]:
        """The modules the schedule calls: a call of one of them outside backward is a forward."""
        return [stage.submod for stage in self.stages]

    def held(self) -> Iterator[tuple[torch.Tensor, str, str]]:
        """The stages' P2P receive buffers (activations from the previous stage, gradients from the next, one per
        micro-batch, made on the first step and kept across steps; named by pipelining's names for them) and the
        targets."""
        for stage in self.stages:
            infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
            for info in (i for chunk in infos for i in chunk):
                if isinstance(info.buffer, torch.Tensor):
                    yield info.buffer, COMMUNICATION, info.input_name
        if self.targets is not None:
            yield self.targets, "input", ""

    def step(self) -> torch.Tensor:
        """schedule.step over the whole batch (the tokens on the first stage's rank, the targets on the last's),
        then the optimizer's step and gradients set to None."""
        first = any(stage.is_first for stage in self.stages)
        last = any(stage.is_last for stage in self.stages)
        losses: list[torch.Tensor] = []
        with self.autocasting():
            self.schedule.step(
                *(self.inputs if first else ()),
                target=self.targets if last else None,
                losses=losses if last else None,
                return_outputs=False,
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())


def build_workload(
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype,
    device: str | torch.device,
    config: LlamaConfig,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    seed: int = 0,
    lr: float = 1e-4,
    dp: int = 1,
    precision: str = "fp32",
) -> PipelineWorkload:
    """This rank's stages of a Llama pipelined over the ranks of the default process group with `schedule`
    (SCHEDULES), the batch cut into `microbatches` equal micro-batches (default: one sample each). With `dp` > 1
    the ranks form a 2-D DeviceMesh ("pp", "dp") of world / dp stages a row: the pipeline runs over the rank's "pp"
    group and each stage is sharded by FSDP2 (`precision`: planner.parallel.fsdp.PRECISIONS) over its "dp" group,
    every layer and the stage's root."""
    if schedule not in SCHEDULES:
        raise WorkloadConfigError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not dist.is_initialized():
        raise WorkloadConfigError("a pipeline runs over the ranks' process group: run it with --nproc N")
    microbatches = batch_size if microbatches is None else microbatches
    if microbatches < 1 or batch_size % microbatches:
        raise WorkloadConfigError(f"batch {batch_size} does not split into {microbatches} equal micro-batches")
    mesh, group = None, None
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp > 1:
        if world % dp:
            raise WorkloadConfigError(f"{dp} data-parallel ranks a stage do not divide the {world} ranks")
        mesh = init_device_mesh(torch.device(device).type, (world // dp, dp), mesh_dim_names=("pp", "dp"))
        group = mesh["pp"].get_group()
        rank, world = mesh["pp"].get_local_rank(), world // dp  # this rank's place in its pipeline, and its length
    per_rank = STAGES_PER_RANK[schedule]
    stages_total = world * per_rank
    if schedule != "gpipe" and microbatches < world:
        raise WorkloadConfigError(f"{schedule} needs at least as many micro-batches as pipeline ranks ({world})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        full = Llama(config)
    split = stage_layers(config.layers, stages_total)
    indices = [rank + k * world for k in range(per_rank)]  # interleaved: this rank's stages are rank, rank + world
    modules = [LlamaStage(full, split[i], i == 0, i == stages_total - 1) for i in indices]
    del full
    modules = [module_to(m, device, dtype).train() for m in modules]
    if mesh is not None:
        for module in modules:
            shard(module, list(module.layers), mesh["dp"], precision)
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(seed)
    )
    size = batch_size // microbatches
    # the shapes a stage receives and sends (a gradient comes back for those that require one)
    computed = PRECISIONS[precision].param_dtype if mesh is not None and PRECISIONS[precision] else dtype
    hidden = torch.empty(size, seq_len, config.hidden, dtype=computed, device="meta", requires_grad=True)
    ids = torch.empty(size, seq_len, dtype=torch.long, device="meta")
    logits = torch.empty(size, seq_len, config.vocab_size, dtype=computed, device="meta", requires_grad=True)
    stages = [
        PipelineStage(
            module,
            i,
            stages_total,
            torch.device(device),
            input_args=ids if i == 0 else hidden,
            output_args=logits if i == stages_total - 1 else hidden,
            group=group,
        )
        for module, i in zip(modules, indices)
    ]
    kind = SCHEDULES[schedule]
    # the schedule calls the workload's loss as it stands (the capture labels it `loss`)
    run = kind(stages if per_rank > 1 else stages[0], microbatches, loss_fn=lambda out, y: workload.loss_fn(out, y))
    model = nn.ModuleList(modules) if per_rank > 1 else modules[0]
    workload = PipelineWorkload(
        model=model,
        inputs=(tokens[:, :-1].contiguous().to(device),),  # contiguous: the stage checks strides
        optimizer=torch.optim.AdamW(model.parameters(), lr=lr),
        loss_fn=next_token_loss,
        name=f"llama-{config.layers}x{config.hidden}-pp{world}-{schedule}"
        + (f"-fsdp{dp}-{precision}" if dp > 1 else ""),
        holds_output=False,
        schedule=run,
        stages=stages,
        targets=tokens[:, 1:].contiguous().to(device),
    )
    return workload
