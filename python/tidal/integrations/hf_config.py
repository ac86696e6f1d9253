"""A tidal config for a Hugging Face Trainer run, completed from its TrainingArguments.

Note [The Trainer's arguments in a tidal config]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' DeepSpeed integration (4.57.6, integrations/deepspeed.py,
HfTrainerDeepSpeedConfig.trainer_config_process and trainer_config_finalize)
writes TrainingArguments into the config before DeepSpeed reads it: a key
set to "auto" takes the argument's value, and a key set to anything else
must equal the argument (every mismatch is listed in one error, before
training). trainer_config does the same, with the same keys and the same
values (AUTO_FILLED_BY in tidal/config.py names them), and one difference:
a key the config leaves out takes the argument's value too. Under DeepSpeed
such a key falls to DeepSpeed's default, which for these keys agrees with
the Trainer's (gradient clipping at 1.0) or is set by accelerate's plugin;
tidal's defaults do not agree (no clipping where the Trainer clips at
max_grad_norm 1.0, lr 1e-3 where TrainingArguments says 5e-5), so a config
that says nothing would train other than the arguments say, silently.
Added when absent: train_micro_batch_size_per_gpu,
gradient_accumulation_steps, gradient_clipping, the optimizer block (AdamW)
or its lr, betas, eps and weight_decay, and fp16/bf16 "enabled" when the
argument is true. The scheduler block's keys are filled only where they say
"auto" (a key one schedule type takes is an error in another), and with no
scheduler block the Trainer's own lr_scheduler_type runs.
"""
from __future__ import annotations

import copy
import os
from typing import Any

from ..config import Config

__all__ = ["trainer_config"]

_MISSING = object()

# The optimizers of TrainingArguments.optim that are the update rule tidal's
# engine runs (torch.optim.AdamW); any other is refused, not replaced.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")

_HIDDEN_SIZE_KEYS = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _get(node: dict, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _set(node: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _hidden_size(model) -> "int | None":
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None) is not None:
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None


def trainer_config(config: "dict | str | os.PathLike", args, num_training_steps: "int | None" = None,
                   model=None) -> dict:
    """The tidal config `config` completed from Hugging Face TrainingArguments.

    What TidalTrainer trains with (Note [The Trainer's arguments in a tidal
    config]); call it yourself to build a model straight into chunks with the
    same config: ``with tidal.init_context(trainer_config(cfg, args, steps)):``.
    Idempotent: a completed config comes back unchanged.

    Args:
        config: a tidal (DeepSpeed-style) config dict or JSON file path; not changed.
        args: the run's transformers.TrainingArguments.
        num_training_steps: the run's optimizer steps, for the scheduler
            block's "auto" total_num_steps and warmup_num_steps (None: left
            "auto", which tidal.Config.load reports).
        model: the model, for the "auto" ZeRO bucket sizes the Hugging Face
            templates carry (tidal does not use them; they are filled as the
            Trainer fills them so that such a config loads).

    Returns:
        a new config dict.

    Raises:
        ValueError: listing every key whose value differs from its TrainingArguments value.
    """
    raw = Config.fill_auto(config, {})  # (a fresh copy of the dict, or the file's contents)
    if not isinstance(raw, dict):
        raise TypeError(f"trainer_config: expected a config dict or JSON file path, got "
                        f"{type(config).__name__}")
    micro = args.per_device_train_batch_size
    steps = args.gradient_accumulation_steps
    clip = float(args.max_grad_norm) if args.max_grad_norm is not None else 0.0
    optimizer = {
        "optimizer.params.lr": (args.learning_rate, "learning_rate"),
        "optimizer.params.betas": ([args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2"),
        "optimizer.params.eps": (args.adam_epsilon, "adam_epsilon"),
        "optimizer.params.weight_decay": (args.weight_decay, "weight_decay"),
    }
    # key -> (value, argument named in a mismatch, added when absent)
    matched: dict[str, tuple[Any, str, bool]] = {
        "train_micro_batch_size_per_gpu": (micro, "per_device_train_batch_size", True),
        "gradient_accumulation_steps": (steps, "gradient_accumulation_steps", True),
        "train_batch_size": (args.world_size * micro * steps,
                             "world_size * per_device_train_batch_size * "
                             "gradient_accumulation_steps", False),
        "gradient_clipping": (clip, "max_grad_norm", True),
        **{k: (v, name, True) for k, (v, name) in optimizer.items()},
        "fp16.enabled": (bool(args.fp16 or args.fp16_full_eval), "fp16 or fp16_full_eval",
                         bool(args.fp16)),
        "bf16.enabled": (bool(args.bf16 or args.bf16_full_eval), "bf16 or bf16_full_eval",
                         bool(args.bf16)),
        "scheduler.params.warmup_max_lr": (args.learning_rate, "learning_rate", False),
    }
    if num_training_steps is not None:
        matched["scheduler.params.total_num_steps"] = (
            int(num_training_steps), "the run's optimizer steps (max_steps, or the epochs' steps)",
            False)
        matched["scheduler.params.warmup_num_steps"] = (
            args.get_warmup_steps(num_training_steps), "warmup_steps (or warmup_ratio of the steps)",
            False)
    filled_only: dict[str, Any] = {"scheduler.params.warmup_min_lr": 0}
    hidden = _hidden_size(model) if model is not None else None
    if hidden is not None:
        filled_only.update({k: f(hidden) for k, f in _HIDDEN_SIZE_KEYS.items()})

    mismatches = []
    for key, (value, name, add) in matched.items():
        given = _get(raw, key)
        if isinstance(given, str) and given == "auto":
            _set(raw, key, copy.deepcopy(value))
        elif given is _MISSING:
            if add and (not key.startswith("optimizer.") or isinstance(raw.get("optimizer", {}),
                                                                       dict)):
                _set(raw, key, copy.deepcopy(value))
        elif not _same(given, value):
            mismatches.append(f"  '{key}' = {given!r} in the tidal config, TrainingArguments "
                              f"{name} = {value!r}")
    for key, value in filled_only.items():
        if _get(raw, key) == "auto":
            _set(raw, key, value)
    if "optimizer" in raw and isinstance(raw["optimizer"], dict):
        raw["optimizer"].setdefault("type", "AdamW")
    if mismatches:
        raise ValueError(
            "TidalTrainer: the tidal config and the TrainingArguments disagree (as DeepSpeed's "
            "Trainer integration, tidal takes each from the arguments only where the config says "
            "\"auto\" or leaves the key out):\n" + "\n".join(mismatches) +
            "\nSet these config values to \"auto\", or pass the same values to TrainingArguments")
    return raw
