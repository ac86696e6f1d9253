"""deepspeed.comm over torch.distributed.

DeepSpeed's comm module wraps torch.distributed; so does this one, with
DeepSpeed's names and arguments. Two cases:

* torch.distributed is initialized (a launcher: torchrun's or deepspeed's
  RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, which init_distributed and
  tidal.deepspeed.initialize start it from, as DeepSpeed's do): every call is
  torch.distributed's.
* it is not (one process without a launcher, where DeepSpeed would look for
  MPI and tidal trains without a process group): this process is the whole
  world, rank 0 of 1, and each collective is what it is over one rank: the
  tensor as it is (a sum, mean, min or max of one value; a broadcast from
  rank 0; a gather of one). A group, a source rank other than 0, or async_op
  are refused there, naming what was asked.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as _dist

from ..engine.errors import UsageError

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier",
           "broadcast", "broadcast_object_list", "all_gather_object", "destroy_process_group",
           "get_global_rank", "get_local_rank", "get_rank", "get_world_group", "get_world_size",
           "init_distributed", "is_available", "is_initialized", "new_group", "reduce",
           "reduce_scatter_tensor"]

ReduceOp = _dist.ReduceOp
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's (deepspeed/constants.py)
# What torchrun and DeepSpeed's launcher set (DeepSpeed also wants LOCAL_RANK;
# tidal reads it where it is, 0 where it is not).
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def is_available() -> bool:
    return _dist.is_available()


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def init_distributed(dist_backend: "str | None" = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout: "datetime.timedelta | None" = None, init_method: "str | None" = None,
                     dist_init_required: "bool | None" = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """deepspeed.init_distributed: starts torch.distributed where a launcher
    (or init_method with rank and world_size) says how; does nothing when it
    is already started, or in one process without a launcher (DeepSpeed
    would try MPI there; tidal needs no process group for one process).
    dist_init_required=False asks that it be started already. The backend is
    dist_backend, else the accelerator's (nccl when tidal trains on a GPU,
    gloo on the simulated device); the timeout DeepSpeed's 30 minutes."""
    del auto_mpi_discovery, verbose, config  # (MPI discovery, logging, comms profiling: none here)
    if is_initialized():
        return
    if dist_init_required is False:
        raise UsageError("tidal.deepspeed: dist_init_required=False, but torch.distributed is "
                         "not initialized; initialize it first, or pass dist_init_required=None")
    launched = all(k in os.environ for k in _LAUNCHER_ENV)
    if not launched and not (init_method and rank >= 0 and world_size >= 1):
        return
    if not _dist.is_available():
        raise UsageError("tidal.deepspeed.init_distributed: this torch build has no "
                         "torch.distributed")
    if not launched and distributed_port != TORCH_DISTRIBUTED_DEFAULT_PORT:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if dist_backend is None:
        from .accelerator import get_accelerator
        dist_backend = get_accelerator().communication_backend_name()
    kwargs = {"backend": dist_backend, "timeout": timeout or datetime.timedelta(minutes=30)}
    if init_method:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 1:
        kwargs["world_size"] = world_size
    _dist.init_process_group(**kwargs)


def _alone(what: str, group=None, async_op: bool = False) -> bool:
    """True when there is no process group: this process is the world."""
    if is_initialized():
        return False
    if group is not None:
        raise UsageError(f"tidal.deepspeed.comm.{what}(group={group!r}): torch.distributed is not "
                         f"initialized, so there are no groups; this process is the only rank")
    if async_op:
        raise UsageError(f"tidal.deepspeed.comm.{what}(async_op=True): torch.distributed is not "
                         f"initialized (one process); call it with async_op=False")
    return True


def get_rank(group=None) -> int:
    return 0 if _alone("get_rank", group) else _dist.get_rank(group)


def get_world_size(group=None) -> int:
    return 1 if _alone("get_world_size", group) else _dist.get_world_size(group)


def get_local_rank() -> int:
    """The launcher's LOCAL_RANK (0 without one), as DeepSpeed's."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    if _alone("get_global_rank", group):
        if group_rank != 0:
            raise UsageError(f"tidal.deepspeed.comm.get_global_rank(group_rank={group_rank}): "
                             f"one process without torch.distributed has only rank 0")
        return 0
    return _dist.get_global_rank(group if group is not None else _dist.group.WORLD, group_rank)


def get_world_group():
    if _alone("get_world_group"):
        raise UsageError("tidal.deepspeed.comm.get_world_group(): torch.distributed is not "
                         "initialized (one process, no launcher), so there is no group object")
    return _dist.group.WORLD


def new_group(ranks):
    if _alone("new_group"):
        raise UsageError(f"tidal.deepspeed.comm.new_group({ranks!r}): torch.distributed is not "
                         f"initialized (one process, no launcher); launch with torchrun")
    return _dist.new_group(ranks)


def destroy_process_group(group=None) -> None:
    if is_initialized():
        _dist.destroy_process_group(group)


def barrier(group=None, async_op: bool = False, device_ids=None):
    if _alone("barrier", group, async_op):
        return None
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def _check_rank(what: str, name: str, rank: int) -> None:
    if rank != 0:
        raise UsageError(f"tidal.deepspeed.comm.{what}({name}={rank}): one process without "
                         f"torch.distributed has only rank 0")


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Over one rank the tensor is its own sum, mean, product, min and max."""
    if _alone("all_reduce", group, async_op):
        return None
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if _alone("reduce", group, async_op):
        _check_rank("reduce", "dst", dst)
        return None
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if _alone("broadcast", group, async_op):
        _check_rank("broadcast", "src", src)
        return None
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list, src: int, group=None, device=None):
    if _alone("broadcast_object_list", group):
        _check_rank("broadcast_object_list", "src", src)
        return None
    return _dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False):
    if _alone("all_gather", group, async_op):
        if len(tensor_list) != 1:
            raise UsageError(f"tidal.deepspeed.comm.all_gather: tensor_list has "
                             f"{len(tensor_list)} tensors; one process gathers into 1")
        tensor_list[0].copy_(tensor)
        return None
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj, group=None):
    if _alone("all_gather_object", group):
        if len(object_list) != 1:
            raise UsageError(f"tidal.deepspeed.comm.all_gather_object: object_list has "
                             f"{len(object_list)} entries; one process gathers into 1")
        object_list[0] = obj
        return None
    return _dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    if _alone("all_gather_into_tensor", group, async_op):
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return _dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM,
                          group=None, async_op: bool = False):
    if _alone("reduce_scatter_tensor", group, async_op):
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return _dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group,
                                       async_op=async_op)
