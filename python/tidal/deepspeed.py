"""deepspeed.initialize's signature and return value, over tidal's engine.

A DeepSpeed training script starts with

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=params, training_data=dataset, config=cfg)

and with `from tidal import deepspeed` the same line builds a tidal engine.
What DeepSpeed 0.19.8 does with each argument, tidal does, or refuses with an
error naming the argument (never a silent difference). Everything that can
be refused is refused before the model's weights move into chunks, so a
refused call leaves the model as it was.

* config / config_params / args.deepspeed_config (args.deepscale_config):
  where the config comes from, with DeepSpeed's rules (one source only).
* model, model_parameters: as tidal.initialize.
* optimizer: refused. tidal runs its own Adam over the chunks, from the
  config's "optimizer" block; a client optimizer would hold a second copy of
  states that never move.
* training_data (+ collate_fn): DeepSpeedDataLoader's batches: micro batches
  (train_micro_batch_size_per_gpu) drawn by a DistributedSampler over the
  data-parallel ranks (one replica without data parallel): shuffled with
  seed 0, the same order every epoch unless the script calls
  loader.sampler.set_epoch; the last short batch dropped when the config's
  dataloader_drop_last says so. It is also engine.training_dataloader.
* lr_scheduler: a callable that takes the optimizer and returns a scheduler
  (torch's LR schedulers work: engine.optimizer is a torch.optim.Optimizer
  whose groups the step reads). The engine steps it after each applied
  optimizer step, as DeepSpeed does, and checkpoints keep its state (the
  callable is called twice: first on a stand-in optimizer, to refuse before
  any weight moves what the engine could not step). As in
  DeepSpeed it replaces the config's "scheduler" block, which is then not
  used (a warning says so). A scheduler object is refused: it is bound to an
  optimizer made before the engine's, which tidal would not step.
  ReduceLROnPlateau is refused too: it steps on a metric, which DeepSpeed
  fills with the batch size; step it yourself.
* mpu, mesh_param: refused (tidal has no model or sequence parallelism).
* dist_init_required: None (DeepSpeed's default) leaves torch.distributed to
  tidal's data parallelism (the config's tidal.data_parallel block, or
  torchrun's environment); True starts it as init_distributed does; False
  asks that it be started already. distributed_port: only DeepSpeed's
  default (DeepSpeed uses it to discover MPI, which tidal does not).
* args.local_rank, when args has it, is set to the engine's, as DeepSpeed does.

add_config_arguments(parser) adds DeepSpeed's --deepspeed and
--deepspeed_config (and the deprecated --deepscale, --deepscale_config);
init_distributed(...) starts torch.distributed under a launcher
(torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as DeepSpeed's does;
without a launcher DeepSpeed would look for MPI, and tidal trains the one
process with no process group.

Returns (engine, engine.optimizer, the DataLoader or None, the scheduler: the
client's, else the config's engine.lr_scheduler, else None).

deepspeed.zero.Init and deepspeed.zero.GatheredParameters, for scripts that
build models larger than memory (see the Note below their code), are
zero.Init and zero.GatheredParameters here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import warnings
from typing import Any

import torch

from . import data_parallel as _dp
from .config import Config, ConfigError
from .engine import initialize as _initialize
from .engine.errors import UsageError
from .engine.store import _TORCH_DTYPES, ParamStore

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


def _scheduler_not_used(kind) -> None:
    warnings.warn(f"config key 'scheduler' ({kind!r}) is not used: the lr_scheduler passed to "
                  f"tidal.deepspeed.initialize schedules the learning rate, as DeepSpeed's "
                  f"initialize does", stacklevel=3)


def _groups(model_parameters) -> int:
    """How many parameter groups engine.optimizer will have."""
    if model_parameters is None or isinstance(model_parameters, (torch.Tensor, dict)):
        return 1
    return sum(1 for g in model_parameters if isinstance(g, dict)) or 1


def _check_scheduler(make, groups: int, cfg: Config):
    """Refuses, before any weight moves, a scheduler the engine could not step:
    `make` is tried on a stand-in AdamW with the engine's number of groups and
    the config's hyperparameters (so it is called twice: here, and on
    engine.optimizer)."""
    if not callable(make) or (hasattr(make, "step") and not isinstance(make, type)):
        raise UsageError(
            f"tidal.deepspeed.initialize: lr_scheduler={type(make).__name__} is a scheduler "
            f"object, bound to an optimizer made before the engine's (which tidal would not "
            f"step); pass a callable that takes the optimizer: "
            f"lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, ...)")
    stand_in = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]}
                                  for _ in range(groups)], lr=cfg.lr, betas=tuple(cfg.betas),
                                 eps=cfg.eps, weight_decay=cfg.weight_decay)
    made = make(stand_in)
    if isinstance(made, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UsageError(
            "tidal.deepspeed.initialize: lr_scheduler makes a ReduceLROnPlateau, which steps on "
            "a metric (DeepSpeed passes it the batch size); pass no lr_scheduler and call its "
            "step(metric) yourself after each evaluation, on engine.optimizer")
    if getattr(made, "optimizer", stand_in) is not stand_in:
        raise UsageError("tidal.deepspeed.initialize: lr_scheduler's callable returned a "
                         "scheduler of another optimizer than the one it was given")
    for method in ("step", "state_dict", "load_state_dict"):
        if not callable(getattr(made, method, None)):
            raise UsageError(f"tidal.deepspeed.initialize: lr_scheduler's callable returned a "
                             f"{type(made).__name__} without {method}(); DeepSpeed needs "
                             f"step(), state_dict() and load_state_dict()")


def _check_data(cfg: Config, dataset) -> None:
    from torch.utils.data import IterableDataset
    if cfg.micro_batch_size is None:
        raise ConfigError("tidal.deepspeed.initialize(training_data=...) batches by the config's "
                          "train_micro_batch_size_per_gpu (or train_batch_size), and the config "
                          "names neither")
    if isinstance(dataset, IterableDataset) and _dp.wanted(cfg.data_parallel):
        raise UsageError("tidal.deepspeed.initialize: an IterableDataset cannot be sharded over "
                         "the data-parallel ranks by a sampler; shard it yourself and build the "
                         "DataLoader")


def _loader(engine, dataset, collate_fn):
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset
    micro = engine.train_micro_batch_size_per_gpu()
    drop_last = bool(engine.config.raw.get("dataloader_drop_last", False))
    pin = engine.device.type == "cuda"
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=micro, collate_fn=collate_fn, drop_last=drop_last,
                          pin_memory=pin)
    # DeepSpeedDataLoader's sampler under its launcher (local_rank >= 0): distributed over the
    # data-parallel ranks, one replica without them.
    sampler = DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.global_rank)
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
    if distributed_port != _DEFAULT_PORT:
        raise UsageError(
            f"tidal.deepspeed.initialize: distributed_port={distributed_port!r}: DeepSpeed uses "
            f"it to discover MPI, which tidal does not; torch.distributed takes MASTER_PORT from "
            f"the launcher (torchrun --master_port)")
    if dist_init_required is not None:
        init_distributed(dist_init_required=dist_init_required)
    cfg = Config.load(_config_source(args, config, config_params))
    if model_parameters is not None and not isinstance(model_parameters, (torch.Tensor, dict)):
        model_parameters = list(model_parameters)  # (an iterator is read twice below)
    if lr_scheduler is not None:
        _check_scheduler(lr_scheduler, _groups(model_parameters), cfg)
        if cfg.scheduler is not None:
            # DeepSpeed builds the client's and not the config's: the engine
            # gets no schedule of its own (its groups keep the config's lr and
            # betas). cfg.raw stays as given, so a model built in zero.Init
            # with this config is adopted.
            _scheduler_not_used(cfg.scheduler.get("type"))
            cfg = dataclasses.replace(cfg, scheduler=None)
    if training_data is not None:
        _check_data(cfg, training_data)
    engine = _initialize(model, cfg, model_parameters)
    if lr_scheduler is not None:
        engine.client_lr_scheduler = lr_scheduler(engine.optimizer)
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
        raise UsageError("tidal.deepspeed: dist_init_required=False, but torch.distributed is "
                         "not initialized; initialize it first, or pass dist_init_required=None")
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


# Note [zero.Init and GatheredParameters over init_context]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeepSpeed's ZeRO-3 scripts build a large model under zero.Init(config), so no
# module's parameters are ever whole in memory, and reach a parameter's values
# in code that runs after its module's __init__ (weight init, tying, loading)
# through GatheredParameters(params, modifier_rank=0). tidal.init_context is
# zero.Init's counterpart: each module's parameters go into host chunks when
# its __init__ returns. GatheredParameters maps to ParamStore's
# materialized_params: inside it, each parameter this store holds has its
# values; with modifier_rank given (one process: rank 0 is this one) they are
# the fp32 master slot itself, so what the code writes is kept (the 16-bit
# slot follows at the exit); with modifier_rank None they are a copy in the
# parameter's dtype, and what the code writes is dropped, as DeepSpeed drops
# it. Once an engine trains the parameters (between steps), reading is a copy
# of what forward computes with; writing is refused (engine.load_state_dict
# writes into chunks). Parameters
# no store holds are left as they are, as DeepSpeed leaves non-ZeRO ones.


class _Init:
    """deepspeed.zero.Init: a tidal.init_context with DeepSpeed's arguments."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, **rest):
        for name, value in (("module", module), ("data_parallel_group", data_parallel_group),
                            ("mpu", mpu), *rest.items()):
            if value not in (None, False):
                raise UsageError(
                    f"tidal.deepspeed.zero.Init: {name}={value!r} is not supported: it builds "
                    f"new modules into chunks (an existing module: tidal.deepspeed.initialize "
                    f"puts it into chunks), in one process group")
        if remote_device not in (None, "none", "cpu"):
            raise UsageError(f"tidal.deepspeed.zero.Init: remote_device={remote_device!r}: tidal "
                             f"keeps chunks in host memory and on the device, not on NVMe")
        if config is not None and config_dict_or_path is not None:
            raise UsageError("tidal.deepspeed.zero.Init: both config and config_dict_or_path "
                             "(DeepSpeed's names for the same): pass one")
        self.config = Config.load(config if config is not None else config_dict_or_path)
        wanted = _TORCH_DTYPES[self.config.precision]
        if dtype is not None and dtype != wanted:
            raise UsageError(f"tidal.deepspeed.zero.Init: dtype={dtype} but the config trains in "
                             f"{self.config.precision} ({wanted}); the config's precision decides")
        self.enabled = enabled
        self._context = None

    def __enter__(self):
        if self.enabled:
            from .engine.init_context import init_context
            self._context = init_context(self.config)
            self.store = self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self._context is not None:
            context, self._context = self._context, None
            return context.__exit__(*exc)
        return False


@contextlib.contextmanager
def _gathered_parameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """deepspeed.zero.GatheredParameters (Note [zero.Init and GatheredParameters
    over init_context])."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in (params or []) if p is not None]
    with contextlib.ExitStack() as stack:
        for store, held in (_by_store(params) if enabled else {}).items():
            if modifier_rank is None:
                stack.enter_context(_copies(store, held))
            elif store not in ParamStore._unadopted:
                raise UsageError(
                    "tidal.deepspeed.zero.GatheredParameters(..., modifier_rank=...): these "
                    "parameters are trained by an engine; write new values with "
                    "engine.load_state_dict({name: tensor}, strict=False) between steps")
            else:
                # (callbacks run last first: the 16-bit slots follow once the
                # masters are released)
                stack.callback(store.sync_param16)
                stack.enter_context(store.materialized_params(held))
        yield


def _by_store(params) -> dict:
    out: dict = {}
    for p in params:
        store = ParamStore.owning([p])
        if store is not None:
            out.setdefault(store, []).append(p)
    return out


@contextlib.contextmanager
def _copies(store, params):
    """Each parameter holds a copy of its values (its dtype, its device) while
    inside; what is written to them is dropped at the exit, where each gets back
    the data it had (a placeholder; or, under an engine between steps, or an
    enclosing context, a view of its slot)."""
    done = []
    try:
        for p in params:
            old = p.data
            if p.numel() == 0:
                p.data = store.gather(store.by_param[id(p)]).to(p.dtype)
            else:
                p.data = old.clone()
            done.append((p, old))
        yield
    finally:
        for p, old in reversed(done):
            p.data = old


zero = types.SimpleNamespace(Init=_Init, GatheredParameters=_gathered_parameters)
