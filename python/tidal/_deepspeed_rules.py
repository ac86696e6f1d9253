"""How DeepSpeed reads two parts of a config, for tidal.config: the optimizer
block as DeepSpeed 0.19.8 resolves it to an update rule (Note [Optimizer
types as DeepSpeed resolves them]) and the Hugging Face Trainer's "auto"
placeholder (Note [The "auto" placeholder])."""
from __future__ import annotations


from ._schema import did_you_mean



# ---------------------------------------------------------------------------
# The optimizer, as DeepSpeed resolves it
# ---------------------------------------------------------------------------
# Note [Optimizer types as DeepSpeed resolves them]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeepSpeed 0.19.8 turns the optimizer block into an optimizer in three steps;
# tidal resolves a config to the update rule that optimizer runs:
#  1. the name (runtime/config.py, DeepSpeedConfig._initialize_params): it is
#     lower-cased when it is one of DeepSpeed's own (DEEPSPEED_OPTIMIZERS: adam,
#     adamw, lamb, adagrad, lion, muadam, muadamw, musgd, muon); any other name
#     is looked up in torch.optim as written (runtime/engine.py,
#     DeepSpeedEngine._configure_basic_optimizer, its last branch). A block
#     without a type builds no optimizer from the config.
#  2. for adam and adamw (_configure_basic_optimizer): params.adam_w_mode is
#     popped with the default true (ADAM_W_MODE_DEFAULT in runtime/config.py),
#     and the weight decay is decoupled when the name is adamw or adam_w_mode
#     is true. So "Adam" without adam_w_mode is AdamW, and "AdamW" is AdamW
#     whatever adam_w_mode says.
#  3. the class (DeepSpeedEngine.get_optimizer_configuration): params.torch_adam
#     (popped, default false) picks torch.optim.AdamW or torch.optim.Adam by the
#     mode; otherwise zero_optimization.offload_optimizer.device "cpu" or
#     "nvme" picks DeepSpeedCPUAdam (ops/adam/cpu_adam.py), anything else
#     FusedAdam (ops/adam/fused_adam.py); fp32_optimizer_states is popped too.
#     The other params are that class's keyword arguments: one it does not
#     take fails there, and a default is that class's (weight_decay: 0.01 for
#     torch.optim.AdamW, 0 for the others).
# tidal runs that rule with its own Adam; the names of other optimizers are
# errors that say what DeepSpeed would have built.

# DeepSpeed's own optimizer names (runtime/config.py) and what they are.
_DEEPSPEED_OPTIMIZERS = {
    "adam": "Adam", "adamw": "AdamW", "lamb": "FusedLamb (LAMB)", "adagrad": "Adagrad",
    "lion": "Lion", "muadam": "mup's MuAdam", "muadamw": "mup's MuAdamW", "musgd": "mup's MuSGD",
    "muon": "Muon (with an auxiliary Adam)",
}
# The keyword arguments of each class DeepSpeed builds for adam/adamw, less
# the ones DeepSpeed passes itself (adam_w_mode / adamw_mode,
# fp32_optimizer_states). Signatures: ops/adam/fused_adam.py FusedAdam.__init__,
# ops/adam/cpu_adam.py DeepSpeedCPUAdam.__init__, torch 2.13's Adam and AdamW.
_CLASS_PARAMS = {
    "FusedAdam": ("lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad",
                  "set_grad_none"),
    "DeepSpeedCPUAdam": ("lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad"),
    "torch.optim.Adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize",
                         "capturable", "differentiable", "fused", "decoupled_weight_decay"),
    "torch.optim.AdamW": ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize",
                          "capturable", "differentiable", "fused"),
}
_POPPED_BY_DEEPSPEED = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")
_WEIGHT_DECAY_DEFAULT = {"torch.optim.AdamW": 0.01}  # 0 for the other classes
_SUPPORTED = "tidal runs 'Adam' and 'AdamW' (any case, as DeepSpeed reads them)"


def _unsupported_type(name: str) -> str:
    """Why optimizer type `name` (not adam/adamw) cannot run, in DeepSpeed's terms."""
    low = name.lower()
    if low in _DEEPSPEED_OPTIMIZERS:
        return (f"{name!r} is DeepSpeed's {_DEEPSPEED_OPTIMIZERS[low]} optimizer, which tidal "
                f"cannot run; {_SUPPORTED}")
    if low in ("fusedadam", "cpuadam", "deepspeedcpuadam"):
        return (f"{name!r} is a class DeepSpeed picks itself for type 'Adam' or 'AdamW' "
                f"(DeepSpeedCPUAdam when zero_optimization.offload_optimizer.device is 'cpu', "
                f"FusedAdam otherwise); write 'Adam' or 'AdamW'")
    import torch.optim
    cls = getattr(torch.optim, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        return (f"DeepSpeed builds torch.optim.{name} for {name!r}, which tidal cannot run; "
                f"{_SUPPORTED}")
    near = did_you_mean(name, ("Adam", "AdamW"))
    hint = f"; did you mean '{near}'?" if near else ""
    onebit = " (DeepSpeed 0.19.8 has no 1-bit optimizers)" if "onebit" in low or \
        "zeroone" in low else ""
    return (f"{name!r} is neither one of DeepSpeed 0.19.8's optimizer names nor a class of "
            f"torch.optim{onebit}, so DeepSpeed fails on it too; {_SUPPORTED}{hint}")


def _adam_class(torch_adam: bool, decoupled: bool, offload_device: str) -> str:
    if torch_adam:
        return "torch.optim.AdamW" if decoupled else "torch.optim.Adam"
    return "DeepSpeedCPUAdam" if offload_device in ("cpu", "nvme") else "FusedAdam"


# ---------------------------------------------------------------------------
# "auto"
# ---------------------------------------------------------------------------
# Note [The "auto" placeholder]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# "auto" is the Hugging Face Trainer's placeholder: its DeepSpeed integration
# replaces it from TrainingArguments and the model before DeepSpeed reads the
# config (transformers 4.57.6, integrations/deepspeed.py,
# HfTrainerDeepSpeedConfig.trainer_config_process and trainer_config_finalize).
# AUTO_FILLED_BY is that map. Outside the Trainer, a key that cannot take the
# string "auto" is a problem; all of them make one entry of the config's error,
# naming what each needs. A Trainer path fills them with Config.fill_auto first.
# Keys whose value may really be "auto" (tidal.device,
# data_types.keep_in_fp32_modules, ...) are checked as usual.
AUTO_FILLED_BY: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "TrainingArguments.per_device_train_batch_size",
    "gradient_accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
    "train_batch_size": "world_size * per_device_train_batch_size * gradient_accumulation_steps "
                        "(TrainingArguments)",
    "gradient_clipping": "TrainingArguments.max_grad_norm",
    "optimizer.params.lr": "TrainingArguments.learning_rate",
    "optimizer.params.betas": "[TrainingArguments.adam_beta1, TrainingArguments.adam_beta2]",
    "optimizer.params.eps": "TrainingArguments.adam_epsilon",
    "optimizer.params.weight_decay": "TrainingArguments.weight_decay",
    "scheduler.params.warmup_min_lr": "0 (the Trainer writes 0)",
    "scheduler.params.warmup_max_lr": "TrainingArguments.learning_rate",
    "scheduler.params.warmup_num_steps": "TrainingArguments.get_warmup_steps(the run's optimizer "
                                         "steps): warmup_steps, or warmup_ratio of the steps",
    "scheduler.params.total_num_steps": "the run's optimizer steps (TrainingArguments.max_steps, "
                                        "or the epochs' steps)",
    "fp16.enabled": "TrainingArguments.fp16 or fp16_full_eval (true or false)",
    "bf16.enabled": "TrainingArguments.bf16 or bf16_full_eval (true or false)",
    "zero_optimization.reduce_bucket_size": "hidden_size * hidden_size of the model's config; "
                                            "tidal does not use it: write a number or drop the key",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9 * hidden_size * hidden_size under "
                                                     "ZeRO-3; tidal does not use it: write a "
                                                     "number or drop the key",
    "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size under ZeRO-3; tidal "
                                                            "does not use it: write a number or "
                                                            "drop the key",
}


def _auto_message(paths: list[str]) -> str:
    lines = [f"'{p}': {AUTO_FILLED_BY.get(p, 'the Trainer does not fill this key: write a value')}"
             for p in paths]
    subject = f"config key '{paths[0]}' is" if len(paths) == 1 else \
        f"{len(paths)} config keys are"
    return (f'{subject} "auto", the Hugging Face Trainer\'s placeholder, which its DeepSpeed '
            f"integration fills from TrainingArguments and the model before training. Outside "
            f"the Trainer write a value for each (or fill them with tidal.Config.fill_auto("
            f"config, values)); the Trainer would write:\n" + "\n".join(f"  {l}" for l in lines))
