"""deepspeed.initialize, and the names DeepSpeed scripts import, over tidal's engine.

A DeepSpeed training script runs with its imports changed:

    import tidal.deepspeed as deepspeed              # was: import deepspeed
    import tidal.deepspeed.comm as dist              # was: import deepspeed.comm as dist
    from tidal.deepspeed.accelerator import get_accelerator
    from tidal.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=params, training_data=dataset, config=cfg)

and the same line builds a tidal engine. What DeepSpeed 0.19.8 does with
each argument, tidal does, or refuses with an error naming the argument
(never a silent difference). Everything that can be refused is refused
before the model's weights move into chunks, so a refused call leaves the
model as it was.

* config / config_params / args.deepspeed_config (args.deepscale_config):
  where the config comes from, with DeepSpeed's rules (one source only).
* model, model_parameters: as tidal.initialize.
* optimizer: a client optimizer whose update rule tidal's Adam runs
  (DeepSpeedCPUAdam, FusedAdam, torch.optim.Adam/AdamW), with its parameter
  groups and hyperparameters, or a callable that makes one from
  model_parameters; it replaces the config's "optimizer" block, as in
  DeepSpeed. Other classes are refused by name (Note [A client optimizer
  under tidal's engine] in tidal/_deepspeed_compat/client.py).
* training_data (+ collate_fn): DeepSpeedDataLoader's batches: micro batches
  (train_micro_batch_size_per_gpu) drawn by a DistributedSampler over the
  data-parallel ranks (one replica without data parallel): shuffled with
  seed 0, the same order every epoch unless the script calls
  loader.sampler.set_epoch; the last short batch dropped when the config's
  dataloader_drop_last says so. It is also engine.training_dataloader.
* lr_scheduler: a scheduler object built on the client optimizer
  (transformers' get_scheduler(...), torch's LR schedulers), or a callable
  that takes the optimizer and returns a scheduler (called on the client
  optimizer, else on engine.optimizer, a torch.optim.Optimizer whose groups
  the step reads; tried first on a stand-in so that what the engine could not
  step is refused before any weight moves). The engine steps it after each
  applied optimizer step, as DeepSpeed does, and checkpoints keep its state.
  As in DeepSpeed it replaces the config's "scheduler" block, which is then
  not used (a warning says so). A scheduler object without the client
  optimizer it was built on is refused (DeepSpeed asserts one), and so is
  ReduceLROnPlateau: it steps on a metric, which DeepSpeed fills with the
  batch size; step it yourself.
* mpu, mesh_param: refused (tidal has no model or sequence parallelism).
* dist_init_required: as DeepSpeed's initialize, which calls
  init_distributed first: under a launcher (torchrun's or deepspeed's RANK,
  WORLD_SIZE, MASTER_ADDR, MASTER_PORT) torch.distributed is started (the
  backend and timeout of the config's tidal.data_parallel block, nccl on a
  GPU and gloo on the simulated device by default), one rank too; without
  one, tidal trains the one process with no process group (DeepSpeed would
  look for MPI). False asks that it be started already. distributed_port:
  only DeepSpeed's default (DeepSpeed uses it to discover MPI).
* args.local_rank, when args has it, is set to the engine's, as DeepSpeed does.

The engine it returns behaves as DeepSpeed's where tidal's own differs:
load_checkpoint leaves the process's RNG as it is (Note [The RNG on
load_checkpoint] in tidal/engine/checkpoint.py); under ZeRO stage 3 its
parameters carry DeepSpeed's ZeRO-3 attributes (ds_numel, ds_shape, ds_id,
...: Note [DeepSpeed's ZeRO-3 attributes on tidal's parameters]), as
DeepSpeed's do; engine.tput_timer counts epochs; offload_states /
reload_states / destroy move the states off the device and back (Note
[Offloading the engine's states] in tidal/engine/store.py).

Returns (engine, engine.optimizer, the DataLoader or None, the scheduler: the
client's, else the config's engine.lr_scheduler, else None).

Also here, under DeepSpeed's names (tidal/_deepspeed_compat): add_config_arguments,
init_distributed, get_accelerator, and the modules accelerator, comm, ops
(ops.adam; ops.lamb, ops.lion, ops.adagrad refused), moe (MoE refused),
runtime.zero / zero (Init, GatheredParameters, ZeroParamStatus),
runtime.zero.offload_config (OffloadDeviceEnum, OffloadStateTypeEnum),
compression.helper (recursive_getattr, recursive_setattr), utils
(RepeatingLoader, logger, ...). Other DeepSpeed modules (pipe, sparse
attention, inference, ...) are refused when imported, naming the feature
(tidal/_deepspeed_compat/refused.py); DeepSpeed's top-level names for them
(DeepSpeedTransformerLayer, init_inference, ...) when built or called.
Importing this module also makes transformers' DeepSpeed integration
(TrainingArguments(deepspeed=...)), which needs the real DeepSpeed, fail with
an error naming tidal's Trainer (tidal/_deepspeed_compat/hf_guard.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import warnings
from typing import Any

import torch

from . import data_parallel as _dp
from ._deepspeed_compat import alias as _alias
from ._deepspeed_compat import client as _client
from ._deepspeed_compat import hf_guard as _hf_guard
from ._deepspeed_compat.accelerator import get_accelerator
from ._deepspeed_compat.comm import TORCH_DISTRIBUTED_DEFAULT_PORT as _DEFAULT_PORT
from ._deepspeed_compat.comm import init_distributed
from ._deepspeed_compat.refused import REFUSED_MODULES as _REFUSED_MODULES
from ._deepspeed_compat.refused import missing_attribute as _missing_attribute
from ._deepspeed_compat.refused import refused_class as _refused_class
from ._deepspeed_compat.refused import refused_function as _refused_function
from ._deepspeed_compat.runtime.zero.partition_parameters import mark_zero_params as _mark
from ._deepspeed_compat.runtime.zero.partition_parameters import zero_stage as _zero_stage
from ._deepspeed_compat.utils import ThroughputTimer as _ThroughputTimer
from .config import Config, ConfigError
from .engine import initialize as _initialize
from .engine.errors import UsageError
from .engine.store import ParamStore

__all__ = ["DeepSpeedConfig", "DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer",
           "accelerator", "add_config_arguments", "comm", "compression", "get_accelerator",
           "init_distributed", "init_inference", "initialize", "moe", "ops",
           "replace_transformer_layer", "runtime", "tp_model_init", "utils", "zero"]

# DeepSpeed's submodules, importable as tidal.deepspeed.<name> (tidal/_deepspeed_compat);
# the others are refused when imported (an empty __path__ makes Python ask
# refused.RefusedModuleFinder for them).
__path__: list = []
_modules = _alias(__name__)
accelerator = _modules["accelerator"]
comm = _modules["comm"]
compression = _modules["compression"]
moe = _modules["moe"]
ops = _modules["ops"]
runtime = _modules["runtime"]
utils = _modules["utils"]
zero = _modules["zero"]
_hf_guard.install()

# DeepSpeed's top-level names for what tidal does not do: importable, refused
# when built or called (the modules they come from are refused on import).
DeepSpeedTransformerLayer = _refused_class(
    __name__, "DeepSpeedTransformerLayer", _REFUSED_MODULES["ops.transformer"], torch.nn.Module)
DeepSpeedTransformerConfig = _refused_class(
    __name__, "DeepSpeedTransformerConfig", _REFUSED_MODULES["ops.transformer"])
replace_transformer_layer = _refused_function(
    __name__, "replace_transformer_layer", _REFUSED_MODULES["module_inject"])
init_inference = _refused_function(__name__, "init_inference", _REFUSED_MODULES["inference"])
tp_model_init = _refused_function(
    __name__, "tp_model_init", "tidal has no tensor parallelism: one GPU trains the whole model "
    "(its chunks move through device memory), data parallel across GPUs (the config's "
    "tidal.data_parallel)")
DeepSpeedConfig = _refused_class(
    __name__, "DeepSpeedConfig",
    "DeepSpeed's parsed config object is not provided: tidal.config.Config.load(path or dict) "
    "reads the same file (train_batch_size, train_micro_batch_size_per_gpu, "
    "gradient_accumulation_steps, ...), and the engine answers them "
    "(engine.train_batch_size(), engine.train_micro_batch_size_per_gpu())")


def __getattr__(name: str):
    # DeepSpeed's attributes tidal does not have: an AttributeError naming the
    # feature where it is one tidal refuses (deepspeed.checkpointing, deepspeed.pipe).
    raise _missing_attribute(__name__, name)


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


_NO_OPTIMIZER_BLOCK = "the config has no 'optimizer' block"


def _load_config(source, client_optimizer: bool) -> Config:
    """Config.load, less its note about a missing optimizer block when the
    script passes the optimizer (which DeepSpeed then uses, as tidal does)."""
    if not client_optimizer:
        return Config.load(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config.load(source)
    for w in caught:
        if not str(w.message).startswith(_NO_OPTIMIZER_BLOCK):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return cfg


def _start_distributed(cfg: Config, dist_init_required, distributed_port: int) -> None:
    """DeepSpeed's initialize starts torch.distributed first (comm.init_distributed);
    here with the backend and timeout tidal's data parallelism would use."""
    block = cfg.data_parallel
    init_distributed(dist_backend=None if block["backend"] == "auto" else block["backend"],
                     distributed_port=distributed_port, dist_init_required=dist_init_required,
                     timeout=datetime.timedelta(seconds=float(block["timeout"])))


def _settle_zero_init_config(model: torch.nn.Module, cfg: Config) -> None:
    """A model built in zero.Init under this config is adopted with the
    store's Config (tidal.initialize); the client optimizer or scheduler
    changed ours, so the store takes it (its chunk layout, from the same raw
    config, stays)."""
    store = ParamStore.owning(list(model.parameters()))
    if store is not None and store in ParamStore._unadopted and store.config.raw == cfg.raw:
        store.config = cfg


def initialize(args: Any = None, model: "torch.nn.Module | None" = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = _DEFAULT_PORT, mpu: Any = None,
               dist_init_required: "bool | None" = None, collate_fn: Any = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None):
    """deepspeed.initialize over tidal: (engine, optimizer, training_dataloader,
    lr_scheduler). See the module's docstring for each argument."""
    if model is None:
        raise UsageError("tidal.deepspeed.initialize requires a model (model=...)")
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
    cfg = _load_config(_config_source(args, config, config_params), optimizer is not None)
    _start_distributed(cfg, dist_init_required, distributed_port)
    if model_parameters is not None and not isinstance(model_parameters, (torch.Tensor, dict)):
        model_parameters = list(model_parameters)  # (an iterator is read twice below)
    client = None
    if optimizer is not None:
        client = _client.ClientOptimizer(optimizer, model, model_parameters)
        cfg = client.config_for(cfg)
    scheduler = None  # a scheduler object, bound to the client optimizer
    if lr_scheduler is not None:
        if _client.is_scheduler_object(lr_scheduler):
            _client.check_scheduler_object(lr_scheduler, client)
            scheduler = lr_scheduler
        elif client is not None:
            # DeepSpeed calls it on its basic optimizer, the client's: its
            # groups' lr are the scheduler's before the engine reads them.
            scheduler = lr_scheduler(client.optimizer)
            _client.check_made(scheduler, "the scheduler lr_scheduler's callable returned",
                               client.optimizer)
        else:
            _client.check_callable(lr_scheduler, _groups(model_parameters), cfg)
        if cfg.scheduler is not None:
            # DeepSpeed builds the client's and not the config's: the engine
            # gets no schedule of its own (its groups keep the config's lr and
            # betas). cfg.raw stays as given, so a model built in zero.Init
            # with this config is adopted.
            _scheduler_not_used(cfg.scheduler.get("type"))
            cfg = dataclasses.replace(cfg, scheduler=None)
    if client is not None:
        model_parameters = client.groups()
    if training_data is not None:
        _check_data(cfg, training_data)
    _settle_zero_init_config(model, cfg)
    _cast_to_16_bits(model, cfg)
    engine = _initialize(model, cfg, model_parameters)
    if client is not None:
        client.bind(engine)
    if scheduler is not None:
        engine.client_lr_scheduler = scheduler
    elif lr_scheduler is not None:
        engine.client_lr_scheduler = lr_scheduler(engine.optimizer)
    engine.training_dataloader = None if training_data is None else \
        _loader(engine, training_data, collate_fn)
    if _zero_stage(cfg) == 3:  # Note [DeepSpeed's ZeRO-3 attributes on tidal's parameters]
        _mark(engine.records)
    engine.tput_timer = _ThroughputTimer()
    engine.restore_rng_on_load = False  # Note [The RNG on load_checkpoint]
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank
    return engine, engine.optimizer, engine.training_dataloader, \
        engine.client_lr_scheduler or engine.lr_scheduler


def _cast_to_16_bits(model: torch.nn.Module, cfg: Config) -> None:
    """DeepSpeed casts the model's floating-point parameters to the config's
    16-bit dtype before it builds its optimizer (0.19.8, runtime/engine.py
    _configure_distributed_model, _cast_module_mixed_precision; buffers keep
    theirs), so its fp32 masters start from the 16-bit values; cast here, the
    engine's masters start from the same. Parameters in chunks already
    (zero.Init) are the config's dtype, as DeepSpeed's zero.Init ones are."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.precision)
    if dtype is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype and p.numel() > 0 and \
                    ParamStore.owning([p]) is None:
                p.data = p.data.to(dtype)


def _groups(model_parameters) -> int:
    """How many parameter groups engine.optimizer will have."""
    if model_parameters is None or isinstance(model_parameters, (torch.Tensor, dict)):
        return 1
    return sum(1 for g in model_parameters if isinstance(g, dict)) or 1


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
