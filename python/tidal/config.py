"""The engine's configuration: a DeepSpeed-comparable JSON dict.

A DeepSpeed config means in tidal what it means in DeepSpeed 0.19.8, and a
DeepSpeed config loads as it is. Every key DeepSpeed 0.19.8 reads is known
here (Note [DeepSpeed's keys in a tidal config] in tidal/_deepspeed_keys.py):
tidal honours it, or accepts it with a warning naming the key, its value and
what tidal does instead, or, where the value asks for a training result tidal
cannot give, rejects it saying so. What is tidal's own lives in the "tidal"
section. A key that is neither DeepSpeed's nor tidal's is an error naming the
closest valid key; a wrong type or an out-of-range value names the key, the
value and what is allowed. A config's problems are listed in one ConfigError,
not one per load; "auto" values (the Hugging Face Trainer's placeholder) are
one problem listing every such key and what fills it (Note [The "auto"
placeholder]).

    config = tidal.Config.load({"train_micro_batch_size_per_gpu": 4,
                                "fp16": {"enabled": True},
                                "tidal": {"device_memory_budget": "6GB"}})
"""
from __future__ import annotations

import copy
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from . import data_parallel as _dp
from ._config_schema import _LISTED_KEYS, _OPTIMIZER_PARAMS, _REJECTED, _TIDAL_SCHEMA, SCHEMA  # noqa: F401
from ._deepspeed_rules import (_CLASS_PARAMS, _POPPED_BY_DEEPSPEED, _WEIGHT_DECAY_DEFAULT,
                               AUTO_FILLED_BY, _adam_class, _auto_message, _unsupported_type)
from ._deepspeed_keys import (NOT_HONOURED, NOT_HONOURED_ERRORS, NOT_READ_BY_DEEPSPEED,
                              NULLABLE_BLOCKS, REMOVED)
from ._schema import ConfigError, Problems, check_value, did_you_mean, read_json_object, unknown_key
from .dtr import config_enables as _dtr_enabled
from .dtr import validate_config as _validate_dtr
from .lr_schedules import PARAMS as _SCHEDULER_PARAMS
from .lr_schedules import REQUIRED
from .recompute import validate_config as _validate_recompute

__all__ = ["AUTO_FILLED_BY", "Config", "ConfigError", "SCHEMA"]


# The optimizer block as DeepSpeed resolves it and the "auto" placeholder:
# _deepspeed_rules.py (Note [Optimizer types as DeepSpeed resolves them], Note
# [The "auto" placeholder]). The schema every config is resolved against:
# tidal/_config_schema.py.


# ---------------------------------------------------------------------------
# Reading a config: resolution against the schema, collecting problems
# ---------------------------------------------------------------------------
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_MISSING = object()


def _stacklevel() -> int:
    """warnings.warn's stacklevel, in the caller of this, that names the first frame outside tidal."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PKG_DIR):
        frame = frame.f_back
        level += 1
    return level


def _lookup(node: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        node = node.get(k, _MISSING) if isinstance(node, dict) else _MISSING
    return node


def _unknown(full: str, key: Any, schema: dict, path: str) -> str:
    where = f"section '{path}'" if path else "the top level"
    if len(schema) <= _LISTED_KEYS:
        return str(unknown_key(full, key, schema, where))
    near = did_you_mean(key, [*schema, *(NOT_READ_BY_DEEPSPEED if not path else ())])
    hint = f"; did you mean '{near}'?" if near else ""
    return (f"unknown config key '{full}'{hint} ({where} has {len(schema)} keys, DeepSpeed's and "
            f"tidal's: see docs/config.md in tidal's repository)")


def _resolve(schema: dict, given: Any, path: str, problems: Problems) -> dict:
    """`given` checked against `schema`, defaults filled in; each problem is
    recorded in `problems` and the key's default used instead."""
    if given is None and path in NULLABLE_BLOCKS:
        given = {}
    if not isinstance(given, dict):
        if isinstance(given, str) and given == "auto":
            problems.add_auto(path)
        else:
            problems.add(path, f"config key '{path}': expected an object, got "
                               f"{type(given).__name__} {given!r}")
        given = {}
    out: dict[str, Any] = {}
    for key, value in given.items():
        full = f"{path}.{key}" if path else key
        if full in _REJECTED:
            problems.add(full, f"config key '{full}': {_REJECTED[full]}")
        elif full in REMOVED:
            problems.add(full, f"config key '{full}': DeepSpeed 0.19.8 removed this feature and "
                               f"rejects the key too: {REMOVED[full]}")
        elif not path and key in NOT_READ_BY_DEEPSPEED:
            continue  # reported by _report_not_honoured
        elif key not in schema:
            problems.add(full, _unknown(full, key, schema, path))
        elif isinstance(schema[key], dict):
            out[key] = _resolve(schema[key], value, full, problems)
        else:
            try:
                out[key] = check_value(full, schema[key][0], value)
            except ConfigError as e:
                if isinstance(value, str) and value == "auto":
                    problems.add_auto(full)
                else:
                    problems.add(full, str(e))
    for key, spec in schema.items():
        if key not in out:
            if isinstance(spec, dict):
                out[key] = _resolve(spec, {}, f"{path}.{key}" if path else key, problems)
            else:  # a fresh list or dict; other defaults (REQUIRED too) as they are
                out[key] = copy.deepcopy(spec[1]) if isinstance(spec[1], (list, dict)) else spec[1]
    return out


def _report_not_honoured(given: dict, notes: list[str]) -> None:
    """Adds to `notes` one warning per reason naming each key of `given` tidal does not act on."""
    groups: dict[str, list[str]] = {}
    both_bf16 = "bf16" in given and "bfloat16" in given
    for row in NOT_HONOURED:
        if both_bf16 and row.path[0] == "bfloat16":
            continue  # the whole block is reported below
        value = _lookup(given, row.path)
        if value is _MISSING or row.asks_nothing(value):
            continue
        if row.when is not None and not row.when(given):
            continue
        if row.switch is not None:
            switch_path, default = row.switch
            on = _lookup(given, switch_path)
            if not (default if on is _MISSING else on):
                continue
        groups.setdefault(row.what, []).append(f"'{'.'.join(row.path)}' = {value!r}")
    for key, what in NOT_READ_BY_DEEPSPEED.items():
        if key in given:
            groups.setdefault(what, []).append(f"'{key}' = {given[key]!r}")
    if both_bf16:
        groups.setdefault("DeepSpeed reads its old name of 'bf16' only when 'bf16' is absent, and "
                          "'bf16' is given", []).append(f"'bfloat16' = {given['bfloat16']!r}")
    for what, keys in groups.items():
        subject = f"config key {keys[0]} is" if len(keys) == 1 else \
            f"config keys {', '.join(keys)} are"
        notes.append(f"{subject} not used by tidal: {what}")


@dataclass
class Config:
    """A validated config. `raw` keeps the resolved nested dict."""

    raw: dict = field(default_factory=dict)
    micro_batch_size: int | None = None
    train_batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 1.0
    steps_per_print: int = 10
    # "Adam" or "AdamW" (DeepSpeed reads the name in any case); the update
    # rule is adam_w_mode (Note [Optimizer types as DeepSpeed resolves them]).
    optimizer_type: str = "AdamW"
    # The optimizer DeepSpeed 0.19.8 would build for this config: FusedAdam,
    # DeepSpeedCPUAdam, torch.optim.Adam or torch.optim.AdamW.
    deepspeed_optimizer: str = "FusedAdam"
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
    evict_ahead: bool = True
    skip_clean_copies: bool = True
    fold_images: bool = True
    eviction_policy: str = "opt"
    hybrid_adam: bool = True
    simulated_allocator: str = "auto"
    room_on_miss: bool = True
    optimizer_state_dtype: str = "fp32"
    cpu_adam_threads: int = 0
    cpu_adam_pool: str = "onetbb"
    overlap_step: bool = True
    overlap_next_forward: bool = True
    # Whether the config file set tidal.overlap_step, and why the default is
    # off for this config (None: it is on).
    overlap_step_given: bool = False
    overlap_step_off: str | None = None
    pin_memory: bool = True
    # The NVMe tier (Note [Chunks on NVMe: the tier] in runtime/scheduler/disk_tier.h):
    # the folder, which lists go there ("optimizer": fp32 master and Adam's
    # moments; "param": the 16-bit parameters), and the aio block's I/O shape.
    nvme_path: str | None = None
    nvme_lists: tuple = ()
    nvme_budget: int = 0
    nvme_allow_buffered: bool = False
    nvme_io: str = "threads"
    nvme_skip_clean_writes: bool = True
    aio_block_size: int = 1 << 20
    aio_queue_depth: int = 8
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
        """From a Config, a dict, or a path to a JSON file (None: tidal's
        defaults, without the warning a config with no optimizer block gets).

        Raises:
            ConfigError: naming every problem of the config at once.
        """
        if isinstance(config, Config):
            return config
        asked_for_defaults = config is None
        config = _read(config)
        notes: list[str] = []
        config = _legacy_forms(config, notes)
        problems = Problems()
        r = _resolve(SCHEMA, config, "", problems)
        c = cls(raw=r)
        with problems.at("tidal.data_parallel"):
            c.data_parallel = _dp.validate_config(r["tidal"]["data_parallel"])
        c.world_size = _dp.world_size(c.data_parallel)
        if problems.ok("train_batch_size", "train_micro_batch_size_per_gpu",
                       "gradient_accumulation_steps"):
            with problems.at("train_batch_size"):
                c._batch_sizes(r)
        c.gradient_clipping = float(r["gradient_clipping"])
        _require(problems, c.gradient_clipping >= 0, "gradient_clipping",
                 f"expected a norm >= 0 (0 = off), got {c.gradient_clipping}")
        c.steps_per_print = r["steps_per_print"]
        _require(problems, c.steps_per_print >= 1, "steps_per_print",
                 f"expected an integer >= 1, got {c.steps_per_print}")
        c._zero(r["zero_optimization"], config.get("zero_optimization", {}), problems)
        c._aio(r["aio"], problems)
        c._optimizer(r, config, problems, notes)
        c._precision(r, config, problems)
        c._scheduler(r, config, problems, notes)
        c._deepspeed_values(r, config, problems, notes)
        c.activation_checkpointing = dict(r["activation_checkpointing"])
        n = c.activation_checkpointing["number_checkpoints"]
        _require(problems, n is None or n >= 1, "activation_checkpointing.number_checkpoints",
                 f"expected an integer >= 1 or null, got {n}")
        c._tidal(r["tidal"], config, problems)
        problems.raise_if_any(_auto_message)
        if "optimizer" not in config and not asked_for_defaults:
            notes.append(
                "the config has no 'optimizer' block: tidal trains with AdamW (lr 0.001, betas "
                "(0.9, 0.999), eps 1e-08, weight_decay 0.0, decoupled weight decay, bias "
                "correction on). DeepSpeed builds no optimizer from such a config (it takes one "
                "from deepspeed.initialize); write an 'optimizer' block to choose")
        _report_not_honoured(config, notes)
        for note in notes:
            warnings.warn(note, stacklevel=_stacklevel())
        return c

    @staticmethod
    def fill_auto(config: "dict | str | os.PathLike", values: dict[str, Any]) -> dict:
        """The config with each "auto" value replaced by the value given for its key.

        For a Hugging Face Trainer path (Note [The "auto" placeholder]): it
        resolves what the Trainer's DeepSpeed integration would write
        (AUTO_FILLED_BY says what fills each key) and passes the result to
        Config.load. Only "auto" values are replaced: a key the config gives a
        value keeps it, and a key of `values` the config does not have is not
        added. An "auto" key `values` does not name stays "auto", so
        Config.load reports it.

        Args:
            config: a config dict or the path of a JSON file (not changed).
            values: dotted key -> value, e.g. {"optimizer.params.lr": 3e-4,
                "train_micro_batch_size_per_gpu": 8}.

        Returns:
            a new config dict.
        """
        for key in values:
            if not isinstance(key, str) or not key:
                raise TypeError(f"fill_auto: expected dotted config keys such as "
                                f"'optimizer.params.lr', got {key!r}")
        filled = copy.deepcopy(_read(config))

        def walk(node: dict, prefix: str) -> None:
            for key, value in node.items():
                full = f"{prefix}.{key}" if prefix else key
                if isinstance(value, dict):
                    walk(value, full)
                elif isinstance(value, str) and value == "auto" and full in values:
                    node[key] = copy.deepcopy(values[full])
        walk(filled, "")
        return filled

    def _batch_sizes(self, r: dict) -> None:
        tb, mb, ga = r["train_batch_size"], r["train_micro_batch_size_per_gpu"], \
            r["gradient_accumulation_steps"]
        for key, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                       ("gradient_accumulation_steps", ga)):
            if v is not None and v < 1:
                raise ConfigError(f"config key '{key}': expected an integer >= 1, got {v}")
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

    def _optimizer(self, r: dict, given: dict, problems: Problems, notes: list[str]) -> None:
        """The update rule DeepSpeed 0.19.8 resolves (Note [Optimizer types as DeepSpeed resolves them])."""
        o, p = r["optimizer"], r["optimizer"]["params"]
        given_o = given.get("optimizer", {})
        given_o = given_o if isinstance(given_o, dict) else {}
        given_p = given_o.get("params", {})
        given_p = given_p if isinstance(given_p, dict) else {}
        name = o["type"]
        if "optimizer" in given and problems.ok("optimizer.type"):
            if name is None:
                notes.append("the config's 'optimizer' block has no 'type': tidal trains with "
                             "AdamW (decoupled weight decay) and the block's params. DeepSpeed "
                             "builds no optimizer from a block without a type (it takes one from "
                             "deepspeed.initialize); write 'AdamW' or 'Adam'")
            elif name.lower() not in ("adam", "adamw"):
                problems.add("optimizer.type", f"config key 'optimizer.type': {_unsupported_type(name)}")
        runnable = name is None or name.lower() in ("adam", "adamw")
        named_adamw = name is None or name.lower() == "adamw"
        self.optimizer_type = "AdamW" if named_adamw else "Adam"
        # Step 2: DeepSpeed's effective adam_w_mode.
        decoupled = named_adamw or p["adam_w_mode"]
        offload = r["zero_optimization"]["offload_optimizer"]["device"]
        if r["zero_optimization"]["cpu_offload"]:
            offload = "cpu"   # DeepSpeed's deprecated spelling of the same
        cls = _adam_class(p["torch_adam"], decoupled, offload)
        if cls == "torch.optim.Adam" and p["decoupled_weight_decay"]:
            decoupled = True  # torch's Adam, told to decouple, is AdamW's rule
        self.deepspeed_optimizer = cls
        self.adam_w_mode = bool(decoupled)
        if named_adamw and given_p.get("adam_w_mode") is False and name is not None:
            notes.append("config key 'optimizer.params.adam_w_mode' = False is not used by tidal: "
                         "with type 'AdamW' DeepSpeed 0.19.8 decouples the weight decay whatever "
                         "adam_w_mode says, and so does tidal; for L2 decay write type 'Adam' with "
                         "adam_w_mode false")
        # Step 3: the class's own keyword arguments.
        takes = _CLASS_PARAMS[cls]
        for key in given_p if runnable else ():
            if key in _OPTIMIZER_PARAMS and key not in takes and key not in _POPPED_BY_DEEPSPEED:
                problems.add(f"optimizer.params.{key}",
                             f"config key 'optimizer.params.{key}': not a parameter of {cls}, the "
                             f"optimizer DeepSpeed 0.19.8 builds for this config, so DeepSpeed "
                             f"fails on it; {cls} takes {', '.join(takes)}")
        for key, what in (("amsgrad", "tidal's Adam has no AMSGrad variant"),
                          ("maximize", "tidal's Adam minimizes the loss")):
            if p[key]:
                problems.add(f"optimizer.params.{key}",
                             f"config key 'optimizer.params.{key}' = True asks for another update "
                             f"rule: {what}")
        self.lr = float(p["lr"])
        _require(problems, self.lr >= 0 and math.isfinite(self.lr), "optimizer.params.lr",
                 f"expected a finite learning rate >= 0, got {p['lr']!r}")
        betas = p["betas"]
        if len(betas) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                   and 0 <= b < 1 for b in betas):
            self.betas = (float(betas[0]), float(betas[1]))
        else:
            _require(problems, False, "optimizer.params.betas",
                     f"expected two numbers in [0, 1), got {betas!r}")
        self.eps = float(p["eps"])
        _require(problems, self.eps > 0, "optimizer.params.eps", f"expected eps > 0, got {p['eps']!r}")
        wd = p["weight_decay"]
        self.weight_decay = float(_WEIGHT_DECAY_DEFAULT.get(cls, 0.0) if wd is None else wd)
        _require(problems, self.weight_decay >= 0, "optimizer.params.weight_decay",
                 f"expected >= 0, got {wd!r}")
        self.bias_correction = p["bias_correction"]

    def _precision(self, r: dict, given: dict, problems: Problems) -> None:
        fp16 = r["fp16"]
        # DeepSpeed reads its old block name "bfloat16" only when "bf16" is absent.
        bf16 = r["bfloat16"] if "bfloat16" in given and "bf16" not in given else r["bf16"]
        if fp16["enabled"] and bf16["enabled"]:
            problems.add("fp16.enabled", "config keys 'fp16.enabled' and 'bf16.enabled' are both "
                                         "true; enable at most one")
        self.precision = "fp16" if fp16["enabled"] else "bf16" if bf16["enabled"] else "fp32"
        self.loss_scale = float(fp16["loss_scale"])
        _require(problems, self.loss_scale >= 0, "fp16.loss_scale",
                 f"expected >= 0 (0 = dynamic), got {self.loss_scale}")
        self.initial_scale_power = fp16["initial_scale_power"]
        _require(problems, 0 <= self.initial_scale_power <= 64, "fp16.initial_scale_power",
                 f"expected 0..64, got {self.initial_scale_power}")
        self.loss_scale_window = fp16["loss_scale_window"]
        _require(problems, self.loss_scale_window >= 1, "fp16.loss_scale_window",
                 f"expected >= 1, got {self.loss_scale_window}")
        self.hysteresis = fp16["hysteresis"]
        _require(problems, self.hysteresis >= 1, "fp16.hysteresis",
                 f"expected >= 1, got {self.hysteresis}")
        self.min_loss_scale = float(fp16["min_loss_scale"])
        _require(problems, self.min_loss_scale > 0, "fp16.min_loss_scale",
                 f"expected > 0, got {self.min_loss_scale}")

    def _zero(self, z: dict, given: Any, problems: Problems) -> None:
        if not isinstance(given, dict):
            return
        if "stage" in given:
            _require(problems, z["stage"] in (0, 1, 2, 3), "zero_optimization.stage",
                     f"expected 0, 1, 2 or 3, got {z['stage']}")
        self._nvme(z, problems)
        for path, bad, what in NOT_HONOURED_ERRORS:
            value = _lookup({"zero_optimization": given}, path)
            if value is not _MISSING and bad(value):
                problems.add(".".join(path), f"config key '{'.'.join(path)}': {what}")
        pins = [z[s]["pin_memory"] for s in ("offload_optimizer", "offload_param")
                if isinstance(given.get(s), dict) and "pin_memory" in given[s]]
        self.pin_memory = all(pins) if pins else True

    def _nvme(self, z: dict, problems: Problems) -> None:
        # Note [Chunks on NVMe: the tier]: offload_optimizer "nvme" puts the
        # fp32 master and Adam's moments on the disk tier when the host is
        # full, offload_param "nvme" the 16-bit parameters too; one folder.
        paths = {}
        lists = []
        for sub, what in (("offload_optimizer", "optimizer"), ("offload_param", "param")):
            block = z[sub]
            if block["device"] != "nvme":
                continue
            lists.append(what)
            path = block["nvme_path"]
            if not isinstance(path, str) or not path:
                problems.add(f"zero_optimization.{sub}.nvme_path",
                             f"config key 'zero_optimization.{sub}.nvme_path': expected the folder "
                             f"for the NVMe tier's file when device is 'nvme', got {path!r}")
                continue
            if not os.path.isdir(path):
                problems.add(f"zero_optimization.{sub}.nvme_path",
                             f"config key 'zero_optimization.{sub}.nvme_path': {path!r} is not an "
                             f"existing folder; expected a folder on the disk to use")
                continue
            paths[sub] = os.path.abspath(path)
        if len(set(paths.values())) > 1:
            problems.add("zero_optimization.offload_param.nvme_path",
                         f"config keys 'zero_optimization.offload_optimizer.nvme_path' "
                         f"({paths['offload_optimizer']!r}) and 'zero_optimization.offload_param."
                         f"nvme_path' ({paths['offload_param']!r}) differ; tidal keeps every chunk "
                         f"on disk in one file: give both the same folder")
        self.nvme_lists = tuple(lists)
        self.nvme_path = next(iter(paths.values())) if paths else None

    def _aio(self, a: dict, problems: Problems) -> None:
        # DeepSpeed's aio block shapes the NVMe tier's I/O: block_size bytes
        # per request, queue_depth requests in flight (threads of O_DIRECT
        # pread/pwrite, Note [Chunks on NVMe: the file]).
        if a is None:  # "aio": null
            return
        self.aio_block_size = a["block_size"]
        _require(problems, self.aio_block_size >= 4096 and self.aio_block_size % 4096 == 0,
                 "aio.block_size", f"expected a multiple of 4096 bytes (direct I/O's unit), got "
                                   f"{self.aio_block_size}")
        self.aio_queue_depth = a["queue_depth"]
        _require(problems, 1 <= self.aio_queue_depth <= 1024, "aio.queue_depth",
                 f"expected 1 to 1024 requests in flight, got {self.aio_queue_depth}")

    def _scheduler(self, r: dict, given: dict, problems: Problems, notes: list[str]) -> None:
        s = r["scheduler"]
        self.scheduler = None
        if "scheduler" not in given or not problems.ok("scheduler.type", "scheduler.params"):
            return
        kind = s["type"]
        if kind is None:
            problems.add("scheduler.type", f"config key 'scheduler.type': missing; expected one of "
                                           f"{', '.join(_SCHEDULER_PARAMS)}")
            return
        schema = _SCHEDULER_PARAMS[kind]
        params = dict(s["params"])
        for key in list(params):
            owners = [t for t, ps in _SCHEDULER_PARAMS.items() if key in ps]
            if key not in schema and owners:
                problems.add(f"scheduler.params.{key}",
                             f"config key 'scheduler.params.{key}': not a parameter of {kind} (it "
                             f"is one of {', '.join(owners)}); {kind} takes "
                             f"{', '.join(sorted(schema))}")
                del params[key]
        p = _resolve(schema, params, "scheduler.params", problems)
        for key, value in p.items():
            path = f"scheduler.params.{key}"
            if not problems.ok(path):
                continue
            if value is REQUIRED:
                problems.add(path, f"config key '{path}': required by {kind} ({schema[key][2]}), "
                                   f"missing")
                continue
            with problems.at(path):
                _check_scheduler_range(path, value)
        total, warm = p.get("total_num_steps"), p.get("warmup_num_steps")
        if isinstance(total, int) and isinstance(warm, int) and total < warm:
            # DeepSpeed logs the same and goes on: the schedule is still defined.
            notes.append(f"config key 'scheduler.params.total_num_steps' = {total} is less than "
                         f"'scheduler.params.warmup_num_steps' = {warm}: the {kind} schedule "
                         f"ends before its warm-up does")
        s["params"] = p  # resolved, so raw compares equal across equivalent configs
        self.scheduler = {"type": kind, "params": dict(p)}

    def _deepspeed_values(self, r: dict, given: dict, problems: Problems,
                          notes: list[str]) -> None:
        """DeepSpeed keys whose meaning depends on the rest of the config."""
        comm = r["communication_data_type"]
        if comm is not None and comm.lower() != self.precision:
            notes.append(f"config key 'communication_data_type' = {comm!r} is not used by tidal: "
                         f"tidal reduces gradients in the parameters' dtype, {self.precision} "
                         f"here (Note [Data parallel by chunk] in tidal/data_parallel.py)")
        op = r["gradient_allreduce_op"]
        if isinstance(op, str) and op.lower() == "sum":
            if self.world_size > 1:
                problems.add("gradient_allreduce_op",
                             f"config key 'gradient_allreduce_op' = {op!r} asks for the ranks' "
                             f"gradients summed, not averaged; tidal averages them ('mean')")
            else:
                notes.append(f"config key 'gradient_allreduce_op' = {op!r} is not used by "
                             f"tidal: one process has no gradients to sum; with data parallel "
                             f"ranks tidal averages them ('mean')")

    def _tidal(self, t: dict, given: dict, problems: Problems) -> None:
        self.device = t["device"]
        self.chunk_size = t["chunk_size"]
        _require(problems, self.chunk_size >= 4096 and self.chunk_size % 256 == 0,
                 "tidal.chunk_size", f"expected at least 4 KiB and a multiple of 256 bytes, got "
                                     f"{self.chunk_size}")
        self.device_memory_budget = t["device_memory_budget"]
        self.host_memory_budget = t["host_memory_budget"]
        self.device_margin = t["device_margin"]
        self.warmup_chunk_share = float(t["warmup_chunk_share"])
        _require(problems, 0 < self.warmup_chunk_share <= 1, "tidal.warmup_chunk_share",
                 f"expected a number in (0, 1], got {t['warmup_chunk_share']!r}")
        self.prefetch = t["prefetch"]
        self.prefetch_depth = t["prefetch_depth"]
        _require(problems, self.prefetch_depth >= 1, "tidal.prefetch_depth",
                 f"expected an integer >= 1, got {self.prefetch_depth}")
        self.evict_ahead = t["evict_ahead"]
        self.skip_clean_copies = t["skip_clean_copies"]
        self.fold_images = t["fold_images"]
        self.eviction_policy = t["eviction_policy"]
        self.hybrid_adam = t["hybrid_adam"]
        self.simulated_allocator = t["simulated_allocator"]
        self.room_on_miss = t["room_on_miss"]
        self.optimizer_state_dtype = t["optimizer_state_dtype"]
        self.nvme_budget = t["nvme_budget"]
        self.nvme_allow_buffered = t["nvme_allow_buffered"]
        self.nvme_io = t["nvme_io"]
        self.nvme_skip_clean_writes = t["nvme_skip_clean_writes"]
        self.cpu_adam_threads = t["cpu_adam_threads"]
        self.cpu_adam_pool = t["cpu_adam_pool"]
        _require(problems, self.cpu_adam_threads >= 0, "tidal.cpu_adam_threads",
                 f"expected an integer >= 0, got {self.cpu_adam_threads}")
        self.dtr = t["dtr"]
        if self.dtr:
            with problems.at("tidal.dtr"):
                _validate_dtr(self.dtr)
        self.recompute = t["recompute"]
        self.activation_checkpointing_given = "activation_checkpointing" in given or \
            bool(self.recompute)
        if self.activation_checkpointing_given and \
                problems.ok("activation_checkpointing", "tidal.recompute"):
            with problems.at("activation_checkpointing"):
                _validate_recompute(self.activation_checkpointing, self.recompute)
        self.overlap_step = t["overlap_step"]
        self.overlap_next_forward = t["overlap_next_forward"]
        self.overlap_step_given = isinstance(given.get("tidal"), dict) and \
            "overlap_step" in given["tidal"]
        self.overlap_step_off = None if self.overlap_step else "tidal.overlap_step is false"
        if self.overlap_step and problems.ok("tidal.overlap_step"):
            # Note [CPU Adam during backward]: what it does not cover.
            conflicts = []
            if _dtr_enabled(self.dtr):
                conflicts.append("tidal.dtr is enabled (a replay in backward may read weights an "
                                 "update already changed)")
            if conflicts and self.overlap_step_given:
                problems.add("tidal.overlap_step", "config key 'tidal.overlap_step': true needs "
                                                   "every gradient of a chunk to be final when it "
                                                   "lands, but " + "; ".join(conflicts) +
                                                   "; set it to false")
            elif conflicts:
                self.overlap_step_off = "; ".join(conflicts)


def _require(problems: Problems, ok: bool, path: str, message: str) -> None:
    """Records "config key `path`: `message`" unless `ok` or `path` is bad already."""
    if not ok and problems.ok(path):
        problems.add(path, f"config key '{path}': {message}")


def _read(config: "dict | str | os.PathLike | None") -> dict:
    """The config as a dict: a JSON file read (read_json_object), None as {}."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        return read_json_object(config)
    if not isinstance(config, dict):
        raise ConfigError(f"config key '<root>': expected an object, got "
                          f"{type(config).__name__} {config!r}")
    return config


# Ranges of the schedules' parameters, by name (names are shared across types).
_AT_LEAST_1 = {"warmup_num_steps", "total_num_steps", "cycle_first_step_size",
               "cycle_second_step_size", "lr_range_test_step_size"}
_AT_LEAST_0 = {"cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size"}
_UNIT = {"warmup_min_ratio", "cos_min_ratio"}
_MOMENTUM = {"cycle_min_mom", "cycle_max_mom"}
_RATE = {"decay_lr_rate", "decay_mom_rate", "lr_range_test_step_rate"}


def _check_scheduler_range(path: str, value: Any) -> None:
    name = path.rsplit(".", 1)[1]

    def fail(message: str) -> None:
        raise ConfigError(f"config key '{path}': {message}")
    if value is None or isinstance(value, bool):
        return
    if name.endswith("_lr"):
        if not (math.isfinite(value) and value >= 0):
            fail(f"expected a finite learning rate >= 0, got {value!r}")
    elif name in _AT_LEAST_1 and value < 1:
        fail(f"expected an integer >= 1, got {value}")
    elif name in _AT_LEAST_0 and value < 0:
        fail(f"expected an integer >= 0, got {value}")
    elif name == "last_batch_iteration" and value < -1:
        fail(f"expected -1 (start) or a step >= 0, got {value}")
    elif name in _UNIT and not 0 <= value <= 1:
        fail(f"expected a ratio in [0, 1], got {value!r}")
    elif name in _MOMENTUM and not 0 <= value < 1:
        fail(f"expected a momentum (Adam's beta1) in [0, 1), got {value!r}")
    elif name in _RATE and not (math.isfinite(value) and value >= 0):
        fail(f"expected a finite rate >= 0, got {value!r}")


def _legacy_forms(config: dict, notes: list[str]) -> dict:
    """DeepSpeed's old "zero_optimization": true/false, as DeepSpeed reads it
    (read_zero_config_deprecated: stage 1 or 0); the note says so."""
    z = config.get("zero_optimization")
    if not isinstance(z, bool):
        return config
    notes.append(f"config key 'zero_optimization' = {z!r} is DeepSpeed's deprecated form; read as "
                 f"{{\"stage\": {int(z)}}} (write an object such as {{\"stage\": 2}})")
    return {**config, "zero_optimization": {"stage": 1 if z else 0}}
