"""torch.distributed's wrappers under a fake capture on the fake process group: what they would read from data or
from a collective's result, answered as the real ranks' would be, so a user's FSDP2 or DDP program runs unchanged.

- DeviceMesh: its rank map is a small CPU tensor it reads to find this rank's coordinates; made under fake tensors
  it has no values (DATA_RULE would put the rank in no mesh, every local shard empty), so a mesh is built on real
  tensors, and init_device_mesh's rank map (a fake arange) is that arange.
- DistributedDataParallel: its check that every rank holds parameters of the same shapes reads their data (the
  ranks are one program here: skipped), and the fake process group's all-reduce gives its gradient reducer no
  result, so a DDP model without a communication hook of its own gets DDP's default one (the bucket divided by the
  world size, then all-reduced, in place) written in Python, with the bucket as the result.
- torch.distributed.pipelining: a schedule's first step has its stages vote, over P2P, whether every stage was given
  its shapes (static metadata) or they must be sent between stages; the fake process group's receives move nothing
  (the vote would read 0: send the shapes, which cannot arrive), so each stage decides from its own metadata, and a
  stage given none is refused with a one-line error. Its receive buffers are then made from that metadata, as on
  real ranks, and hold nothing.
- isend and irecv: a real backend's request holds its tensor until the request is dropped (a 1F1B schedule keeps its
  last activation send's request through the steady phase, so the activation outlives its backward); the fake process
  group's holds nothing, so each is wrapped in a request that does.
- DTensor's sharding propagation runs each new op once on fake tensors of the global shape to learn its output's
  layout, in the program's fake tensor mode if there is one, else in a fresh one: on a GPU nothing is allocated, but
  in memplan's mode the capture would record those tensors, and only in the process's first program (the propagation
  is cached). It runs in a fresh mode under a capture, as it does on a GPU.
- accelerate's synchronize_rng_state (a prepared DataLoader's first batch): rank 0's generator state broadcast to
  every rank and set; on the fake process group the broadcast moves nothing and a fake state cannot be set, so each
  rank keeps its own state (patched when accelerate is imported: `ACCELERATE_RNG`, `accelerate_patches`).
"""

import functools
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.parallel.distributed as ddp
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from memplan.errors import MemplanError


class FakeMeshError(MemplanError):
    """A DeviceMesh built from a tensor made under fake tensors: its rank numbers are unknown."""


def _real_mesh(original):
    def __init__(self, *args, _rank_map=None, **kwargs):
        with unset_fake_temporarily():
            if isinstance(_rank_map, FakeTensor):  # init_device_mesh's torch.arange(world size)
                _rank_map = torch.arange(_rank_map.numel(), dtype=_rank_map.dtype)
            mesh = kwargs.get("mesh", args[1] if len(args) > 1 else None)
            if isinstance(mesh, FakeTensor):
                raise FakeMeshError(
                    "a DeviceMesh made from a tensor built under fake tensors: its rank numbers are unknown; "
                    "give the mesh as a list of ranks, or use init_device_mesh"
                )
            original(self, *args, _rank_map=_rank_map, **kwargs)

    return __init__


def _same_shapes(process_group, tensors, logger=None) -> None:
    """_verify_param_shape_across_processes on one program: every rank's parameters are this rank's."""


def allreduce_in_place(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default communication for a gradient bucket: divided by the world size and all-reduced, in place."""
    buffer = bucket.buffer()
    group = process_group if process_group is not None else dist.group.WORLD
    buffer.div_(dist.get_world_size(group))
    dist.all_reduce(buffer, group=group)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _default_hook_first(original):
    def forward(self, *args, **kwargs):
        if not self._comm_hooks:  # the model file registered none: DDP's default, as a hook that gives a result
            self.register_comm_hook(None, allreduce_in_place)
        return original(self, *args, **kwargs)

    return forward


def _keep_buckets(reducer) -> bool:
    """Reducer._rebuild_buckets: the buckets stay in their first order (rebuilding them reads the new order from a
    CPU tensor's data)."""
    return False


def _no_runtime_stats(logger) -> None:
    """Logger.set_runtime_stats_and_log: DDP's sampled timing needs a device timer a fake device does not have."""


class FakePipelineError(MemplanError):
    """A pipeline stage without its shapes under fake tensors: what it receives cannot be sent to it."""


def _own_metadata(original):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import InferenceMode

    def _warmup_p2p(self, stages, has_backward, p2p_done):
        if not all(isinstance(stage, PipelineStage) for stage in stages):
            return original(self, stages, has_backward, p2p_done)
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise FakePipelineError(
                    f"pipeline stage {stage.stage_index} was given no input_args and output_args: on the fake process "
                    "group the shapes it receives cannot be sent to it; give PipelineStage both"
                )
            stage._inference_mode = InferenceMode.STATIC
        return None

    return _warmup_p2p


class HeldWork:
    """A point-to-point request that keeps its tensor, as a real backend's does, until it is dropped."""

    def __init__(self, work, tensor: torch.Tensor):
        self._work, self._tensor = work, tensor

    def __getattr__(self, name):
        return getattr(self._work, name)


def _holding(original):
    def p2p(tensor, *args, **kwargs):
        work = original(tensor, *args, **kwargs)
        return None if work is None else HeldWork(work, tensor)

    return p2p


SHARDING = "torch.distributed.tensor._sharding_prop"  # DTensor's sharding propagation, patched once it is imported


def _fresh_fake_mode(propagate):
    @functools.wraps(propagate)
    def propagate_tensor_meta(self, op_schema):
        with unset_fake_temporarily():  # detect_fake_mode() finds none: DTensor makes a fresh FakeTensorMode
            return propagate(self, op_schema)

    return propagate_tensor_meta


def sharding_patches(module: ModuleType) -> Iterator[tuple[object, str, object]]:
    """(owner, name, replacement) for DTensor's sharding propagation, once `SHARDING` is imported."""
    name = "_propagate_tensor_meta_non_cached"
    yield module.ShardingPropagator, name, _fresh_fake_mode(getattr(module.ShardingPropagator, name))


def patches() -> Iterator[tuple[object, str, object]]:
    """(owner, name, replacement) for each wrapper above."""
    yield DeviceMesh, "__init__", _real_mesh(DeviceMesh.__init__)
    yield ddp, "_verify_param_shape_across_processes", _same_shapes
    DDP = ddp.DistributedDataParallel
    yield DDP, "forward", _default_hook_first(DDP.forward)
    yield dist.Reducer, "_rebuild_buckets", _keep_buckets
    yield dist.Logger, "set_runtime_stats_and_log", _no_runtime_stats
    if dist.is_initialized():  # pipelining (2 s to import: it loads Dynamo) only for a distributed program
        from torch.distributed.pipelining.schedules import _PipelineSchedule

        if hasattr(_PipelineSchedule, "_warmup_p2p"):  # torch 2.13's; 2.11 infers shapes elsewhere and has none
            yield _PipelineSchedule, "_warmup_p2p", _own_metadata(_PipelineSchedule._warmup_p2p)
    for name in ("isend", "irecv"):  # the same function under both names: P2POp and the schedules read either
        held = _holding(getattr(c10d, name))
        yield c10d, name, held
        yield dist, name, held


ACCELERATE_RNG = "accelerate.utils.random"


def _own_rng_state(original):
    def synchronize_rng_state(*args, **kwargs):
        if dist.is_available() and dist.is_initialized():  # broadcast over the fake process group: nothing moves
            return None
        return original(*args, **kwargs)

    return synchronize_rng_state


def accelerate_patches(module) -> Iterator[tuple[object, str, object]]:
    """(owner, name, replacement) for accelerate's random-state helpers (module `ACCELERATE_RNG`), once imported."""
    yield module, "synchronize_rng_state", _own_rng_state(module.synchronize_rng_state)
