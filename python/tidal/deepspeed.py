"""deepspeed.initialize's signature and return value, over tidal's engine.

A DeepSpeed training script starts with

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=params, training_data=dataset, config=cfg)

and with `from tidal import deepspeed` the same line builds a tidal engine.
What DeepSpeed does with each argument, tidal does, or refuses with an error
naming the argument (never a silent difference):

* config / config_params / args.deepspeed_config (args.deepscale_config):
  where the config comes from, with DeepSpeed's rules (one source only).
* model, model_parameters: as tidal.initialize.
* optimizer: refused. tidal runs its own Adam over the chunks, from the
  config's "optimizer" block; a client optimizer would hold a second copy of
  states that never move.
* training_data (+ collate_fn): a DataLoader of micro batches
  (train_micro_batch_size_per_gpu), shuffled, sharded over the
  data-parallel ranks (DistributedSampler) or over this process
  (RandomSampler), dropping the last short batch when the config's
  dataloader_drop_last says so, as DeepSpeedDataLoader; it is also
  engine.training_dataloader.
* lr_scheduler: a scheduler, or a callable that takes the optimizer and
  returns one (torch's LR schedulers work: engine.optimizer is a
  torch.optim.Optimizer whose groups the step reads). The engine steps it
  after each optimizer step that was applied, as DeepSpeed does, and
  checkpoints keep its state. A config "scheduler" block as well is refused
  (DeepSpeed would quietly use the config's).
* mpu, mesh_param: refused (tidal has no model or sequence parallelism).
* dist_init_required, distributed_port: only their defaults; tidal's data
  parallelism starts torch.distributed from the config's tidal.data_parallel
  block.
* args.local_rank, when args has it, is set to the engine's, as DeepSpeed does.

add_config_arguments(parser) adds DeepSpeed's --deepspeed and
--deepspeed_config (and the deprecated --deepscale, --deepscale_config);
init_distributed(...) starts torch.distributed under a launcher
(torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as DeepSpeed's does;
without a launcher DeepSpeed would look for MPI, and tidal trains the one
process with no process group.

Returns (engine, engine.optimizer, the DataLoader or None, the scheduler: the
client's, else the config's engine.lr_scheduler, else None).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from .config import Config, ConfigError
from .engine import initialize as _initialize
from .engine.errors import UsageError

__all__ = ["initialize", "add_config_arguments", "init_distributed"]

_DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT


def _config_source(args, config, config_params):
    if config is None and config_params is not None:
        config = config_params
    elif config is not None and config_params is not None:
        raise UsageError("tidal.deepspeed.initialize: both config and config_params are given; "
                         "config_params is DeepSpeed's old name for config: pass one")
    from_args = None
    if getattr(args, "deepscale_config", None) is not None:
        if getattr(args, "deepspeed_config", None) is not None:
            raise UsageError("tidal.deepspeed.initialize: args has both deepscale_config and "
                             "deepspeed_config (DeepSpeed refuses that too): keep deepspeed_config")
        from_args = args.deepscale_config
    elif getattr(args, "deepspeed_config", None) is not None:
        from_args = args.deepspeed_config
    if from_args is not None:
        if config is not None:
            raise UsageError(f"tidal.deepspeed.initialize: a config in args.deepspeed_config "
                             f"({from_args!r}) and one in the call: DeepSpeed refuses to choose, "
                             f"and so does tidal; pass one")
        config = from_args
    if config is None:
        raise UsageError("tidal.deepspeed.initialize needs a config: config=<dict or JSON path>, "
                         "or args.deepspeed_config (DeepSpeed's --deepspeed_config)")
    return config


def _read(config):
    """The config as a dict (a path is read here, so its scheduler block can be seen)."""
    if isinstance(config, Config):
        return config.raw, config
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return json.load(f), config
    return config, config


def _loader(engine, dataset, collate_fn):
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler
    micro = engine.train_micro_batch_size_per_gpu()
    if micro is None:
        raise ConfigError("tidal.deepspeed.initialize(training_data=...) batches by the config's "
                          "train_micro_batch_size_per_gpu (or train_batch_size), and the config "
                          "names neither")
    drop_last = bool(engine.config.raw.get("dataloader_drop_last", False))
    pin = engine.store.torch_device.type == "cuda"
    if isinstance(dataset, IterableDataset):
        if engine.dp is not None:
            raise UsageError("tidal.deepspeed.initialize: an IterableDataset cannot be sharded over "
                             "the data-parallel ranks by a sampler; shard it yourself and build "
                             "the DataLoader")
        return DataLoader(dataset, batch_size=micro, collate_fn=collate_fn, drop_last=drop_last,
                          pin_memory=pin)
    if engine.dp is not None:
        sampler = DistributedSampler(dataset, num_replicas=engine.dp.world, rank=engine.dp.rank)
    else:
        sampler = RandomSampler(dataset)
    return DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, pin_memory=pin)


def initialize(args: Any = None, model: "torch.nn.Module | None" = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = _DEFAULT_PORT, mpu: Any = None,
               dist_init_required: "bool | None" = None, collate_fn: Any = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None):
    """deepspeed.initialize over tidal: (engine, optimizer, training_dataloader,
    lr_scheduler). See the module's docstring for each argument."""
    if model is None:
        raise UsageError("tidal.deepspeed.initialize requires a model (model=...)")
    if optimizer is not None:
        raise UsageError(
            f"tidal.deepspeed.initialize: optimizer={type(optimizer).__name__}: tidal runs its own "
            f"Adam/AdamW over the chunks (parameters, gradients and states move together), so a "
            f"client optimizer cannot train them; describe it in the config's 'optimizer' block "
            f"(type Adam or AdamW, params lr, betas, eps, weight_decay)")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise UsageError(f"tidal.deepspeed.initialize: {name}={value!r}: tidal has no model or "
                             f"sequence parallelism (one GPU, or data parallel over "
                             f"tidal.data_parallel)")
    if dist_init_required is not None or distributed_port != _DEFAULT_PORT:
        raise UsageError(
            f"tidal.deepspeed.initialize: dist_init_required={dist_init_required!r}, "
            f"distributed_port={distributed_port!r}: tidal's data parallelism starts "
            f"torch.distributed itself from the config's tidal.data_parallel block (under "
            f"torchrun, from its environment); leave these at DeepSpeed's defaults")
    raw, config = _read(_config_source(args, config, config_params))
    if lr_scheduler is not None and isinstance(raw, dict) and raw.get("scheduler"):
        raise UsageError(
            f"tidal.deepspeed.initialize: lr_scheduler={type(lr_scheduler).__name__} and the "
            f"config's 'scheduler' block ({raw['scheduler'].get('type')!r}): DeepSpeed would use "
            f"the config's and drop yours without a word; keep one")
    engine = _initialize(model, config, model_parameters)
    if lr_scheduler is not None:
        scheduler = lr_scheduler(engine.optimizer) if callable(lr_scheduler) and \
            not hasattr(lr_scheduler, "step") else lr_scheduler
        if getattr(scheduler, "optimizer", engine.optimizer) is not engine.optimizer:
            raise UsageError(
                "tidal.deepspeed.initialize: lr_scheduler is bound to another optimizer; tidal's "
                "optimizer exists only once the engine does, so pass a callable: "
                "lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, ...)")
        for method in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(scheduler, method, None)):
                raise UsageError(f"tidal.deepspeed.initialize: lr_scheduler "
                                 f"({type(scheduler).__name__}) has no {method}(); DeepSpeed "
                                 f"needs step(), state_dict() and load_state_dict() too")
        engine.client_lr_scheduler = scheduler
    engine.training_dataloader = None if training_data is None else \
        _loader(engine, training_data, collate_fn)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank
    scheduler = engine.client_lr_scheduler or engine.lr_scheduler
    return engine, engine.optimizer, engine.training_dataloader, scheduler


def add_config_arguments(parser):
    """DeepSpeed's command-line arguments on an argparse parser (returned)."""
    import argparse
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="accepted, as DeepSpeed's flag (tidal trains either way)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(dist_backend: "str | None" = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = _DEFAULT_PORT, verbose: bool = True, timeout=None,
                     init_method: "str | None" = None, dist_init_required: "bool | None" = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """deepspeed.init_distributed: starts torch.distributed where a launcher
    (or init_method with rank and world_size) says how; does nothing when it
    is already started, or in one process without a launcher (DeepSpeed
    would try MPI there; tidal needs no process group for one process).
    dist_init_required=False asks that it be started already."""
    import datetime

    import torch.distributed as dist
    del auto_mpi_discovery, verbose, config  # (MPI discovery, logging, comms profiling: none here)
    if dist.is_available() and dist.is_initialized():
        return
    if dist_init_required is False:
        raise UsageError("tidal.deepspeed.init_distributed(dist_init_required=False): "
                         "torch.distributed is not initialized; initialize it first, or pass "
                         "dist_init_required=None")
    launched = all(k in os.environ for k in _LAUNCHER_ENV)
    if not launched and not (init_method and rank >= 0 and world_size >= 1):
        return
    if not dist.is_available():
        raise UsageError("tidal.deepspeed.init_distributed: this torch build has no "
                         "torch.distributed")
    if not launched and distributed_port != _DEFAULT_PORT:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {"backend": backend, "timeout": timeout or datetime.timedelta(minutes=30)}
    if init_method:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 1:
        kwargs["world_size"] = world_size
    dist.init_process_group(**kwargs)
