"""The engine's configuration: a DeepSpeed-comparable JSON dict.

Keys that mean the same as in a DeepSpeed config use DeepSpeed's names and
semantics; what is tidal's own lives in the "tidal" section. Every key is
checked: an unknown key is a ValueError naming the closest valid key, a
wrong type or an out-of-range value names the key, the value and what is
allowed, and a DeepSpeed key that tidal does not honour is reported (a
warning saying what tidal does instead), never silently ignored.

    config = tidal.Config.load({"train_micro_batch_size_per_gpu": 4,
                                "fp16": {"enabled": True},
                                "tidal": {"device_memory_budget": "6GB"}})

Besides tidal's own keys, the schema accepts the DeepSpeed keys that
DeepSpeed's tutorial configs use (ZeRO, communication and profiling
switches), so such a config loads as it is; each one tidal does not honour
is named in one warning per reason (Note [Keys tidal does not honour]).
"""
from __future__ import annotations

import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from ._schema import NONE as _NONE
from ._schema import ConfigError, check_value, fail, unknown_key
from . import data_parallel as _dp
from .dtr import validate_config as _validate_dtr
from .lr_schedules import PARAMS as _SCHEDULER_PARAMS
from .lr_schedules import REQUIRED
from .recompute import validate_config as _validate_recompute

__all__ = ["Config", "ConfigError", "SCHEMA"]


# ---------------------------------------------------------------------------
# The schema: key -> (kind, default, doc). kind is a type tuple, "bytes", a
# tuple of choices (strings), or a nested dict. Documented in docs/config.md.
# ---------------------------------------------------------------------------
_OPTIMIZER_PARAMS = {
    "lr": ((float, int), 1e-3, "learning rate"),
    "betas": ((list, tuple), [0.9, 0.999], "Adam's (beta1, beta2)"),
    "eps": ((float, int), 1e-8, "Adam's epsilon"),
    "weight_decay": ((float, int), 0.0, "weight decay (decoupled for AdamW)"),
    "adam_w_mode": (bool, None, "AdamW (decoupled) weight decay; default by type"),
    "bias_correction": (bool, True, "Adam's bias correction"),
}

_COUNT = (int, float)  # DeepSpeed's element counts; JSON configs write them as 5e8

SCHEMA: dict[str, Any] = {
    "train_batch_size": (int, None, "samples per optimizer step (micro batch x accumulation)"),
    "train_micro_batch_size_per_gpu": (int, None, "samples per forward/backward"),
    "gradient_accumulation_steps": (int, None, "micro batches per optimizer step"),
    "gradient_clipping": ((float, int), 0.0, "clip gradients to this global L2 norm; 0 = off"),
    "steps_per_print": (int, 10, "log every N optimizer steps"),
    "wall_clock_breakdown": (bool, False, "DeepSpeed's per-phase timers (not in tidal)"),
    "memory_breakdown": (bool, False, "DeepSpeed's memory logging (engine.memory_report() instead)"),
    "prescale_gradients": (bool, False, "data parallel: scale gradients before the all-reduce"),
    "gradient_predivide_factor": ((float, int), 1.0, "data parallel: divide before the all-reduce"),
    # A permission DeepSpeed needs for client optimizers under ZeRO; tidal
    # always runs its own Adam, so either value means the same here.
    "zero_allow_untested_optimizer": (bool, False, "accepted; tidal always uses its own Adam"),
    "optimizer": {
        "type": (("Adam", "AdamW"), "AdamW", "Adam or AdamW"),
        "params": _OPTIMIZER_PARAMS,
    },
    "fp16": {
        "enabled": (bool, False, "16-bit float parameters with dynamic loss scaling"),
        "loss_scale": ((float, int), 0.0, "static loss scale; 0 = dynamic"),
        "initial_scale_power": (int, 16, "dynamic scaling starts at 2**this"),
        "loss_scale_window": (int, 1000, "steps without overflow before the scale doubles"),
        "hysteresis": (int, 2, "overflows tolerated before the scale halves"),
        "min_loss_scale": ((float, int), 1.0, "the scale never drops below this"),
        "consecutive_hysteresis": (bool, False, "refill the hysteresis on every good step"),
        "auto_cast": (bool, False, "cast the module's floating-point inputs to fp16"),
        "fp16_master_weights_and_grads": (bool, False, "fp16 master weights (tidal keeps fp32)"),
    },
    "bf16": {"enabled": (bool, False, "bfloat16 parameters, no loss scaling")},
    "zero_optimization": {
        "stage": (int, 0, "accepted for compatibility; tidal's chunks place every state"),
        "offload_optimizer": {
            "device": (("cpu", "none", "nvme"), "cpu", "where optimizer states may live"),
            "pin_memory": (bool, True, "pin host chunks"),
            "nvme_path": ((str, _NONE), None, "NVMe offload folder (not supported)"),
            "buffer_count": (int, 4, "NVMe offload buffers"),
            "pipeline_read": (bool, False, "NVMe offload read pipelining"),
            "pipeline_write": (bool, False, "NVMe offload write pipelining"),
            "fast_init": (bool, False, "NVMe offload fast initialisation"),
            "ratio": ((float, int), 1.0, "share of optimizer states offloaded"),
        },
        "offload_param": {
            "device": (("cpu", "none", "nvme"), "cpu", "where parameters may live"),
            "pin_memory": (bool, True, "pin host chunks"),
            "nvme_path": ((str, _NONE), None, "NVMe offload folder (not supported)"),
            "buffer_count": (int, 5, "NVMe offload buffers"),
            "buffer_size": (_COUNT, 1e8, "NVMe offload buffer elements"),
            "max_in_cpu": (_COUNT, 1e9, "parameter elements kept in host memory with NVMe"),
        },
        "cpu_offload": (bool, False, "deprecated DeepSpeed spelling of offload_optimizer.device=cpu"),
        "contiguous_gradients": (bool, True, "data parallel: gradients into one buffer"),
        "overlap_comm": (bool, False, "data parallel: overlap reduction with backward"),
        "reduce_scatter": (bool, True, "data parallel: reduce-scatter gradients"),
        "reduce_bucket_size": (_COUNT, 5e8, "data parallel: elements reduced at once"),
        "allgather_partitions": (bool, True, "data parallel: all-gather the updated partitions"),
        "allgather_bucket_size": (_COUNT, 5e8, "data parallel: elements all-gathered at once"),
        "round_robin_gradients": (bool, False, "data parallel: gradient copy partitioning"),
        "sub_group_size": (_COUNT, 1e9, "ZeRO-3 optimizer step tile"),
        "stage3_prefetch_bucket_size": (_COUNT, 5e7, "ZeRO-3 parameter prefetch size"),
        "stage3_param_persistence_threshold": (_COUNT, 1e5, "ZeRO-3: params kept whole below this"),
        "stage3_max_live_parameters": (_COUNT, 1e9, "ZeRO-3 resident parameter limit"),
        "stage3_max_reuse_distance": (_COUNT, 1e9, "ZeRO-3 release distance"),
        "stage3_gather_16bit_weights_on_model_save": (bool, False, "ZeRO-3 checkpoint gathering"),
    },
    "scheduler": {
        "type": (tuple(_SCHEDULER_PARAMS), None, "learning-rate schedule (tidal.lr_schedules)"),
        "params": (dict, {}, "the schedule's parameters, DeepSpeed's names"),
    },
    # DeepSpeed's activation checkpointing block, validated here and
    # interpreted by tidal.recompute.
    "activation_checkpointing": {
        "partition_activations": (bool, False, "split checkpoints across model-parallel ranks"),
        "cpu_checkpointing": (bool, False, "keep checkpoints in host memory"),
        "contiguous_memory_optimization": (bool, False, "checkpoints in one contiguous buffer"),
        "number_checkpoints": ((int, _NONE), None, "checkpoints per forward (for the buffer)"),
        "synchronize_checkpoint_boundary": (bool, False, "synchronize at checkpoint boundaries"),
        "profile": (bool, False, "time the checkpointed forward and recomputation"),
    },
    "tidal": {
        "device": (("auto", "cuda", "sim"), "auto", "device backend"),
        "chunk_size": ("bytes", 64 << 20, "bytes of a 16-bit parameter chunk"),
        "device_memory_budget": ("bytes", 0, "device bytes tidal may use in all; 0 = device capacity"),
        "host_memory_budget": ("bytes", 0, "host bytes for chunks; 0 = 85% of the host memory "
                                            "available when the engine starts"),
        "device_margin": ("bytes", 0, "device bytes kept free for surprises; 0 = 5% of the budget, at least 1 MiB"),
        "warmup_chunk_share": ((float, int), 0.2, "share of the device budget (less the margin) chunks "
                                                  "may hold in the warm-up step, before the memory "
                                                  "trace is known; in (0, 1]"),
        "prefetch": (bool, True, "prefetch chunks ahead of use along the trace"),
        "prefetch_depth": (int, 4, "prefetched chunks that may wait for their use"),
        "eviction_policy": (("opt", "lru"), "opt", "OPT over the trace, or LRU"),
        "hybrid_adam": (bool, True, "update chunks resident on the device there"),
        "cpu_adam_threads": (int, 0, "CPU Adam threads; 0 = all cores"),
        "dtr": (dict, {}, "DTR of activations under the engine (docs/dtr.md): enabled, "
                          "eviction_threshold, evictee_minimum_size, enable_sqrt_sampling, scorer"),
        "recompute": (dict, {}, "tidal.recompute's own keys (tidal.recompute.from_config; "
                                "docs/recompute.md)"),
        "data_parallel": (dict, {}, "data parallel over torch.distributed (docs/data_parallel.md): "
                                    "enabled, timeout, backend"),
    },
}

# Note [Keys tidal does not honour]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeepSpeed keys that are accepted but that tidal does not act on: (path,
# values that ask for nothing tidal lacks, what tidal does instead). A key
# given with another value is reported; the keys of one reason share one
# warning. A key's default is never reported: only what the config file says.
_STAGE = "tidal has no ZeRO stages on one GPU; chunks decide placement"
_COMM = ("they tune DeepSpeed's bucketed data-parallel communication; tidal reduces and "
         "broadcasts whole chunks (Note [Data parallel by chunk] in tidal/data_parallel.py)")
_ZERO3 = ("tidal's chunk scheduler decides what stays on the device (OPT eviction over the step's "
          "trace, prefetch), so ZeRO-3's fetch and persistence thresholds do not apply")
_NVME = ("they configure NVMe offload, which tidal does not have; host buffering follows "
         "tidal.chunk_size and tidal.host_memory_budget")
_NOT_HONOURED: list[tuple[tuple[str, ...], tuple | None, str]] = [
    (("zero_optimization", "stage"), None, _STAGE),
    (("zero_optimization", "offload_optimizer", "device"), None,
     "tidal keeps optimizer states in chunks in host memory and on the device as the budget allows"),
    (("zero_optimization", "offload_param", "device"), None,
     "tidal moves parameter chunks between host and device as the budget requires"),
    (("zero_optimization", "cpu_offload"), (False,),
     "tidal keeps optimizer states in chunks in host memory and on the device as the budget allows"),
    (("zero_optimization", "overlap_comm"), None,
     "tidal's key is tidal.data_parallel.overlap_comm (on by default: each chunk's gradient "
     "reduction starts during backward as soon as its gradients are final)"),
    *[(("zero_optimization", k), None, _COMM) for k in (
        "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size", "round_robin_gradients")],
    *[(("zero_optimization", k), None, _ZERO3) for k in (
        "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance")],
    (("zero_optimization", "stage3_gather_16bit_weights_on_model_save"), (False,),
     "tidal gathers whole weights from its chunks (engine.parameters_fp32()); there are no shards"),
    *[(("zero_optimization", sub, k), None, _NVME)
      for sub in ("offload_optimizer", "offload_param")
      for k in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read",
                "pipeline_write", "fast_init")],
    (("zero_optimization", "offload_optimizer", "ratio"), (1, 1.0),
     "tidal offloads optimizer states by chunk as the device budget requires, not by a fixed share"),
    (("prescale_gradients",), (False,), _COMM),
    (("gradient_predivide_factor",), (1, 1.0), _COMM),
    (("wall_clock_breakdown",), (False,),
     "tidal has no per-phase timers; engine.memory_report() gives cpu_adam_seconds"),
    (("memory_breakdown",), (False,), "engine.memory_report() gives tidal's memory figures"),
    (("fp16", "consecutive_hysteresis"), (False,),
     "tidal's loss scaler refills the hysteresis only when the scale grows (DeepSpeed's default)"),
    (("fp16", "auto_cast"), (False,),
     "tidal casts floating-point inputs to the parameters' 16-bit dtype already"),
    (("fp16", "fp16_master_weights_and_grads"), (False,),
     "tidal keeps fp32 master weights and Adam states in chunks"),
]

# Keys DeepSpeed itself rejects, with its advice.
_REJECTED = {
    "optimizer.params.max_grad_norm":
        "'max_grad_norm' is not an optimizer parameter (DeepSpeed rejects it too); use the "
        "top-level 'gradient_clipping' instead",
}

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _stacklevel() -> int:
    """warnings.warn's stacklevel, in the caller of this, that names the first frame outside tidal."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PKG_DIR):
        frame = frame.f_back
        level += 1
    return level


def _report_not_honoured(given: dict) -> None:
    groups: dict[str, list[str]] = {}
    for path, quiet, what in _NOT_HONOURED:
        node: Any = given
        for k in path:
            node = node.get(k) if isinstance(node, dict) else None
        # Types are checked before this runs: a bool here is a bool key's value.
        if node is None or (quiet is not None and node in quiet):
            continue
        groups.setdefault(what, []).append(f"'{'.'.join(path)}' = {node!r}")
    for what, keys in groups.items():
        subject = f"config key {keys[0]} is" if len(keys) == 1 else \
            f"config keys {', '.join(keys)} are"
        warnings.warn(f"{subject} not used by tidal: {what}", stacklevel=_stacklevel())


def _resolve(schema: dict, given: dict, path: str) -> dict:
    if not isinstance(given, dict):
        fail(path or "<root>", f"expected an object, got {type(given).__name__} {given!r}")
    out: dict[str, Any] = {}
    for key, value in given.items():
        full = f"{path}.{key}" if path else key
        if full in _REJECTED:
            raise ConfigError(f"config key '{full}': {_REJECTED[full]}")
        if key not in schema:
            raise unknown_key(full, key, schema, f"section '{path}'" if path else "the top level")
        spec = schema[key]
        if isinstance(spec, dict):
            out[key] = _resolve(spec, value, full)
        else:
            out[key] = check_value(full, spec[0], value)
    for key, spec in schema.items():
        if key in out:
            continue
        out[key] = _resolve(spec, {}, f"{path}.{key}" if path else key) if isinstance(spec, dict) \
            else spec[1]
    return out


@dataclass
class Config:
    """A validated config. `raw` keeps the resolved nested dict."""

    raw: dict = field(default_factory=dict)
    micro_batch_size: int | None = None
    train_batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    optimizer_type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True
    bias_correction: bool = True
    precision: str = "fp32"  # "fp16", "bf16" or "fp32"
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    device: str = "auto"
    chunk_size: int = 64 << 20
    device_memory_budget: int = 0
    host_memory_budget: int = 0
    device_margin: int = 0
    warmup_chunk_share: float = 0.2
    prefetch: bool = True
    prefetch_depth: int = 4
    eviction_policy: str = "opt"
    hybrid_adam: bool = True
    cpu_adam_threads: int = 0
    pin_memory: bool = True
    dtr: dict = field(default_factory=dict)
    recompute: dict = field(default_factory=dict)
    data_parallel: dict = field(default_factory=lambda: _dp.validate_config({}))
    # Ranks training together (1 unless data parallel): train_batch_size counts them all.
    world_size: int = 1
    # True when the file asked for recompute (activation_checkpointing or
    # tidal.recompute given): only then is a plan built from these blocks.
    activation_checkpointing_given: bool = False
    # {"type": name, "params": {every parameter resolved}} or None; see
    # tidal.lr_schedules.build_scheduler.
    scheduler: dict | None = None
    # DeepSpeed's six activation_checkpointing keys, defaults filled in.
    activation_checkpointing: dict = field(default_factory=lambda: {
        k: spec[1] for k, spec in SCHEMA["activation_checkpointing"].items()})

    @classmethod
    def load(cls, config: "Config | dict | str | os.PathLike | None") -> "Config":
        """From a Config, a dict, or a path to a JSON file (None: defaults)."""
        if isinstance(config, Config):
            return config
        if config is None:
            config = {}
        elif isinstance(config, (str, os.PathLike)):
            try:
                with open(config, encoding="utf-8") as f:
                    config = json.load(f)
            except OSError as e:
                raise ConfigError(f"cannot read config file '{config}': {e.strerror}") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"config file '{config}' is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            fail("<root>", f"expected an object, got {type(config).__name__} {config!r}")
        config = _legacy_zero(config)
        r = _resolve(SCHEMA, config, "")
        c = cls(raw=r)
        c.data_parallel = _dp.validate_config(r["tidal"]["data_parallel"])
        c.world_size = _dp.world_size(c.data_parallel)
        c._batch_sizes(r)
        c.gradient_clipping = float(r["gradient_clipping"])
        if c.gradient_clipping < 0:
            fail("gradient_clipping", f"expected a norm >= 0 (0 = off), got {c.gradient_clipping}")
        c.steps_per_print = r["steps_per_print"]
        if c.steps_per_print < 1:
            fail("steps_per_print", f"expected an integer >= 1, got {c.steps_per_print}")
        c._optimizer(r["optimizer"])
        c._precision(r["fp16"], r["bf16"])
        c._zero(r["zero_optimization"], config.get("zero_optimization", {}))
        c._scheduler(r, config)
        c.activation_checkpointing = dict(r["activation_checkpointing"])
        n = c.activation_checkpointing["number_checkpoints"]
        if n is not None and n < 1:
            fail("activation_checkpointing.number_checkpoints",
                  f"expected an integer >= 1 or null, got {n}")
        t = r["tidal"]
        c.device = t["device"]
        c.chunk_size = t["chunk_size"]
        if c.chunk_size < 4096 or c.chunk_size % 256:
            fail("tidal.chunk_size", f"expected at least 4 KiB and a multiple of 256 bytes, got "
                                      f"{c.chunk_size}")
        c.device_memory_budget = t["device_memory_budget"]
        c.host_memory_budget = t["host_memory_budget"]
        c.device_margin = t["device_margin"]
        c.warmup_chunk_share = float(t["warmup_chunk_share"])
        if not 0 < c.warmup_chunk_share <= 1:
            fail("tidal.warmup_chunk_share", f"expected a number in (0, 1], got "
                                             f"{t['warmup_chunk_share']!r}")
        c.prefetch = t["prefetch"]
        c.prefetch_depth = t["prefetch_depth"]
        if c.prefetch_depth < 1:
            fail("tidal.prefetch_depth", f"expected an integer >= 1, got {c.prefetch_depth}")
        c.eviction_policy = t["eviction_policy"]
        c.hybrid_adam = t["hybrid_adam"]
        c.cpu_adam_threads = t["cpu_adam_threads"]
        if c.cpu_adam_threads < 0:
            fail("tidal.cpu_adam_threads", f"expected an integer >= 0, got {c.cpu_adam_threads}")
        c.dtr = t["dtr"]
        if c.dtr:
            _validate_dtr(c.dtr)
        c.recompute = t["recompute"]
        c.activation_checkpointing_given = "activation_checkpointing" in config or bool(c.recompute)
        if c.activation_checkpointing_given:
            _validate_recompute(c.activation_checkpointing, c.recompute)
        _report_not_honoured(config)
        return c

    def _batch_sizes(self, r: dict) -> None:
        tb, mb, ga = r["train_batch_size"], r["train_micro_batch_size_per_gpu"], \
            r["gradient_accumulation_steps"]
        for key, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                       ("gradient_accumulation_steps", ga)):
            if v is not None and v < 1:
                fail(key, f"expected an integer >= 1, got {v}")
        # DeepSpeed's rule: train_batch_size = micro batch x accumulation x ranks.
        n = self.world_size
        ranks = "one GPU" if n == 1 else f"{n} data-parallel ranks"
        if tb is not None and mb is not None and ga is not None:
            if tb != mb * ga * n:
                raise ConfigError(
                    f"inconsistent batch sizes: train_batch_size={tb} but "
                    f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * ranks = "
                    f"{mb} * {ga} * {n} = {mb * ga * n} ({ranks})")
        elif tb is not None and mb is not None:
            if tb % (mb * n):
                raise ConfigError(f"train_batch_size={tb} is not a multiple of "
                                  f"train_micro_batch_size_per_gpu * ranks = {mb} * {n} ({ranks})")
            ga = tb // (mb * n)
        elif tb is not None and ga is not None:
            if tb % (ga * n):
                raise ConfigError(f"train_batch_size={tb} is not a multiple of "
                                  f"gradient_accumulation_steps * ranks = {ga} * {n} ({ranks})")
            mb = tb // (ga * n)
        elif tb is not None:
            if tb % n:
                raise ConfigError(f"train_batch_size={tb} is not a multiple of the {n} "
                                  f"data-parallel ranks")
            mb, ga = tb // n, 1
        elif mb is not None:
            ga = ga or 1
            tb = mb * ga * n
        self.train_batch_size, self.micro_batch_size = tb, mb
        self.gradient_accumulation_steps = ga or 1

    def _optimizer(self, o: dict) -> None:
        p = o["params"]
        self.optimizer_type = o["type"]
        self.lr = float(p["lr"])
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            fail("optimizer.params.lr", f"expected a finite learning rate >= 0, got {p['lr']!r}")
        betas = p["betas"]
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            fail("optimizer.params.betas", f"expected two numbers in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(p["eps"])
        if not self.eps > 0:
            fail("optimizer.params.eps", f"expected eps > 0, got {p['eps']!r}")
        self.weight_decay = float(p["weight_decay"])
        if self.weight_decay < 0:
            fail("optimizer.params.weight_decay", f"expected >= 0, got {p['weight_decay']!r}")
        mode = p["adam_w_mode"]
        self.adam_w_mode = (self.optimizer_type == "AdamW") if mode is None else mode
        self.bias_correction = p["bias_correction"]

    def _precision(self, fp16: dict, bf16: dict) -> None:
        if fp16["enabled"] and bf16["enabled"]:
            raise ConfigError("config keys 'fp16.enabled' and 'bf16.enabled' are both true; "
                              "enable at most one")
        self.precision = "fp16" if fp16["enabled"] else "bf16" if bf16["enabled"] else "fp32"
        self.loss_scale = float(fp16["loss_scale"])
        if self.loss_scale < 0:
            fail("fp16.loss_scale", f"expected >= 0 (0 = dynamic), got {self.loss_scale}")
        self.initial_scale_power = fp16["initial_scale_power"]
        if not 0 <= self.initial_scale_power <= 64:
            fail("fp16.initial_scale_power", f"expected 0..64, got {self.initial_scale_power}")
        self.loss_scale_window = fp16["loss_scale_window"]
        if self.loss_scale_window < 1:
            fail("fp16.loss_scale_window", f"expected >= 1, got {self.loss_scale_window}")
        self.hysteresis = fp16["hysteresis"]
        if self.hysteresis < 1:
            fail("fp16.hysteresis", f"expected >= 1, got {self.hysteresis}")
        self.min_loss_scale = float(fp16["min_loss_scale"])
        if not self.min_loss_scale > 0:
            fail("fp16.min_loss_scale", f"expected > 0, got {self.min_loss_scale}")

    def _zero(self, z: dict, given: dict) -> None:
        if not isinstance(given, dict):
            return
        if "stage" in given and z["stage"] not in (0, 1, 2, 3):
            fail("zero_optimization.stage", f"expected 0, 1, 2 or 3, got {z['stage']}")
        for sub in ("offload_optimizer", "offload_param"):
            if z[sub]["device"] == "nvme":
                fail(f"zero_optimization.{sub}.device",
                      "NVMe offload is not supported by tidal; use 'cpu' (chunks in host memory)")
        pins = [z[s]["pin_memory"] for s in ("offload_optimizer", "offload_param")
                if "pin_memory" in given.get(s, {})]
        self.pin_memory = all(pins) if pins else True

    def _scheduler(self, r: dict, given: dict) -> None:
        s = r["scheduler"]
        if "scheduler" not in given:
            self.scheduler = None
            return
        kind = s["type"]
        if kind is None:
            fail("scheduler.type", f"missing; expected one of {', '.join(_SCHEDULER_PARAMS)}")
        schema = _SCHEDULER_PARAMS[kind]
        for key in s["params"]:
            owners = [t for t, params in _SCHEDULER_PARAMS.items() if key in params]
            if key not in schema and owners:
                fail(f"scheduler.params.{key}",
                      f"not a parameter of {kind} (it is one of {', '.join(owners)}); {kind} "
                      f"takes {', '.join(sorted(schema))}")
        p = _resolve(schema, s["params"], "scheduler.params")
        for key, value in p.items():
            if value is REQUIRED:
                fail(f"scheduler.params.{key}", f"required by {kind} ({schema[key][2]}), missing")
            _check_scheduler_range(f"scheduler.params.{key}", value)
        total, warm = p.get("total_num_steps"), p.get("warmup_num_steps")
        if total is not None and warm is not None and total < warm:
            # DeepSpeed logs the same and goes on: the schedule is still defined.
            warnings.warn(f"config key 'scheduler.params.total_num_steps' = {total} is less than "
                          f"'scheduler.params.warmup_num_steps' = {warm}: the {kind} schedule "
                          f"ends before its warm-up does", stacklevel=_stacklevel())
        s["params"] = p  # resolved, so raw compares equal across equivalent configs
        self.scheduler = {"type": kind, "params": dict(p)}


# Ranges of the schedules' parameters, by name (names are shared across types).
_AT_LEAST_1 = {"warmup_num_steps", "total_num_steps", "cycle_first_step_size",
               "cycle_second_step_size", "lr_range_test_step_size"}
_AT_LEAST_0 = {"cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size"}
_UNIT = {"warmup_min_ratio", "cos_min_ratio"}
_MOMENTUM = {"cycle_min_mom", "cycle_max_mom"}
_RATE = {"decay_lr_rate", "decay_mom_rate", "lr_range_test_step_rate"}


def _check_scheduler_range(path: str, value: Any) -> None:
    name = path.rsplit(".", 1)[1]
    if value is None or isinstance(value, bool):
        return
    if name.endswith("_lr"):
        if not (math.isfinite(value) and value >= 0):
            fail(path, f"expected a finite learning rate >= 0, got {value!r}")
    elif name in _AT_LEAST_1 and value < 1:
        fail(path, f"expected an integer >= 1, got {value}")
    elif name in _AT_LEAST_0 and value < 0:
        fail(path, f"expected an integer >= 0, got {value}")
    elif name == "last_batch_iteration" and value < -1:
        fail(path, f"expected -1 (start) or a step >= 0, got {value}")
    elif name in _UNIT and not 0 <= value <= 1:
        fail(path, f"expected a ratio in [0, 1], got {value!r}")
    elif name in _MOMENTUM and not 0 <= value < 1:
        fail(path, f"expected a momentum (Adam's beta1) in [0, 1), got {value!r}")
    elif name in _RATE and not (math.isfinite(value) and value >= 0):
        fail(path, f"expected a finite rate >= 0, got {value!r}")


def _legacy_zero(config: dict) -> dict:
    """DeepSpeed's old "zero_optimization": true/false, as DeepSpeed reads it (stage 1 or 0)."""
    z = config.get("zero_optimization")
    if not isinstance(z, bool):
        return config
    warnings.warn(f"config key 'zero_optimization' = {z!r} is DeepSpeed's deprecated form; read as "
                  f"{{\"stage\": {int(z)}}} (write an object such as {{\"stage\": 2}})",
                  stacklevel=_stacklevel())
    return {**config, "zero_optimization": {"stage": 1 if z else 0}}
