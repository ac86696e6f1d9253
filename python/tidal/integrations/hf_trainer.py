"""TidalTrainer: Hugging Face's transformers.Trainer with the model in tidal's chunks.

Note [The Trainer on tidal]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The Trainer's own loop runs (transformers 4.57.6, Trainer._inner_training_loop):
its data loading, logging, evaluation, callbacks, save_steps and
save_total_limit, resume_from_checkpoint. tidal takes over where the
Trainer's DeepSpeed path (`--deepspeed`) hands work to DeepSpeed's engine:

* Construction. The tidal config is completed from TrainingArguments
  (Note [The Trainer's arguments in a tidal config] in hf_config.py) and
  tidal.initialize puts the model into chunks, in the Trainer's parameter
  groups (Trainer.get_decay_parameter_names: no weight decay for biases and
  norms; DeepSpeed's path decays every parameter when its config has an
  optimizer block). The Trainer's device placement of the model
  (_move_model_to_device) is skipped: tidal places the chunks.
* The accelerator is made without mixed precision and without device
  placement. tidal's chunks hold the 16-bit weights and engine.backward
  scales fp16 losses, so the Trainer's autocast and accelerate's GradScaler
  would be a second mixed precision on top (TrainingArguments' fp16/bf16
  fill the config's fp16/bf16 blocks instead); and accelerate's device
  placement of an optimizer round-trips its state_dict(), which tidal's
  optimizer refuses (its Adam states live in chunks). The batches go to
  args.device through the Trainer's _prepare_inputs as before.
* The loop's model (Trainer.model_wrapped, DeepSpeed's engine in its path)
  is an nn.Module whose forward is engine(...) and which owns no
  parameters: the Trainer's accelerator.clip_grad_norm_ over it has nothing
  to clip (the Trainer's clipping is the config's gradient_clipping, filled
  from max_grad_norm, applied in engine.step()), and the logged grad_norm is
  engine.get_global_grad_norm(), the norm before clipping that the Trainer
  logs. model.zero_grad() is engine.zero_grad().
* training_step computes the loss as the Trainer's and backpropagates it
  with engine.backward. The Trainer's loss is already normalised for
  gradient accumulation (a sum over num_items_in_batch of the whole
  accumulation window, or divided by the window's micro-batches), which is
  why its DeepSpeed path passes scale_wrt_gas=False. engine.backward always
  multiplies the loss by (loss scale) / k, k = gradient_accumulation_steps,
  in float32, so it is given loss / c with c = fl32(1/k): the derivative of
  the chain is c / c, exactly 1 (for every k; times a power-of-two loss
  scale, exactly that scale), so the gradients are those of the Trainer's
  loss bit for bit. (loss * k would give fl32(fl32(1/k) * k), which is not 1
  for k = 41, 47, 55, ...)
  An accumulation window shorter than k (the end of an epoch whose
  micro-batches are not a multiple of k) is refused: engine.step() steps at
  every k-th micro-batch only, as DeepSpeed's engine does.
* The optimizer is engine.optimizer; its step() is engine.step(). The
  schedule is the config's "scheduler" block when there is one (the engine
  steps it after each step it applies; the Trainer's lr_scheduler is then a
  view whose get_last_lr() is the groups' lr for the next step, which is
  what DeepSpeed's scheduler reports there too), else the Trainer's own
  (lr_scheduler_type) over engine.optimizer.param_groups, which is not
  stepped after a step the engine skipped (fp16 overflow, non-finite
  gradients), as under DeepSpeed.
* Checkpoints. checkpoint-N/ holds the Trainer's files (the weights of
  save_model, trainer_state.json, rng_state.pth, scheduler.pt for the
  Trainer's own schedule) and tidal's engine checkpoint in DeepSpeed's
  layout (checkpoint-N/global_stepN/, checkpoint-N/latest): fp32 masters,
  Adam states, loss scaler, the config's schedule. resume_from_checkpoint
  restores that instead of reading the weights file; load_best_model_at_end
  loads the best checkpoint's weights (fp32 masters) the same way.
* save_model writes engine.save_pretrained's folder: the fp32 master
  weights as safetensors (sharded past 5GB, gathered one shard at a time),
  config.json, plus generation_config.json, the tokenizer and
  training_args.bin as the Trainer does; from_pretrained loads it. A peft
  model is saved by peft's save_pretrained (its adapters, read from the
  chunks through model.state_dict()).
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME, _is_peft_model

from .. import engine as _engine
from ..config import Config
from .hf_config import ADAMW_OPTIMS, trainer_config

__all__ = ["TidalTrainer"]

logger = logging.getLogger(__name__)

_SCHEDULE_STEP_KEYS = ("total_num_steps", "warmup_num_steps")


def _float32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


class _EngineModule(torch.nn.Module):
    """The model the Trainer's loop holds (Note [The Trainer on tidal]): calls
    go to the engine, and no parameter is reachable through it, so the
    Trainer's gradient clipping over .parameters() sees none."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine  # (not an nn.Module, so not a submodule)

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        self.engine.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True):
        # As torch's: set_to_none=False zeroes the waiting gradients, so a step
        # still runs (Note [engine.optimizer fails closed] in engine/param_groups.py).
        self.engine.optimizer.zero_grad(set_to_none=set_to_none)

    def _get_name(self):
        # Trainer.compute_loss names the model it is given (label smoothing
        # shifts labels for causal LMs): name the one the engine trains.
        model = self.engine.module
        return model.base_model.model._get_name() if _is_peft_model(model) else model._get_name()


class _SkippingSchedule:
    """The Trainer's LR scheduler, not stepped after an optimizer step the
    engine skipped (fp16 overflow, non-finite gradients), as DeepSpeed's
    engine does not step its scheduler then."""

    def __init__(self, scheduler, engine):
        self.scheduler = scheduler
        self._engine = engine
        self._skipped = engine.skipped_steps

    def step(self, *args, **kwargs):
        skipped = self._engine.skipped_steps
        if skipped != self._skipped:
            self._skipped = skipped
            return None
        return self.scheduler.step(*args, **kwargs)

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state):
        self.scheduler.load_state_dict(state)
        self._skipped = self._engine.skipped_steps

    def __getattr__(self, name):
        if name == "scheduler":  # (not set yet: copy, unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class _ConfigSchedule:
    """The Trainer's lr_scheduler when the tidal config has a "scheduler"
    block: the engine steps that schedule after each step it applies (and
    saves it in its checkpoints); step() is nothing, and get_last_lr() is each
    group's lr for the next step, what DeepSpeed's scheduler reports to the
    Trainer after its engine's step."""

    def __init__(self, engine):
        self._engine = engine

    def step(self, *args, **kwargs):  # noqa: ARG002
        return None

    def get_last_lr(self) -> list:
        return [g["lr"] for g in self._engine.optimizer.param_groups]


class TidalTrainer(transformers.Trainer):
    """transformers.Trainer that trains `model` with tidal's engine (Note [The Trainer on tidal]).

    Takes every argument transformers.Trainer takes, and:

    Args:
        tidal_config: a tidal config dict or JSON file path (DeepSpeed's keys
            and tidal's section); "auto" values and the keys it leaves out
            are taken from `args` (Note [The Trainer's arguments in a tidal
            config]); a key set to a value other than its argument's is an
            error.

    After construction the model is in chunks: `trainer.engine` is its
    tidal.Engine, and `trainer.tidal_config` the completed config.

    Raises:
        ValueError: for what this path does not do (DeepSpeed or FSDP as
            well, torch.compile, model_init, optimizers other than AdamW, ...),
            all listed in one error.
    """

    def __init__(self, model=None, args=None, *trainer_args, tidal_config=None, **trainer_kwargs):
        if tidal_config is None:
            raise TypeError("TidalTrainer needs tidal_config=: a tidal config dict or JSON file path "
                            "(a DeepSpeed config loads as it is; {} for tidal's defaults)")
        if model is None:
            raise ValueError("TidalTrainer needs the model (model_init is not supported: the model "
                             "is put into tidal's chunks when the trainer is made)")
        self.engine = None
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self._refuse_unsupported()
        raw = Config.fill_auto(tidal_config, {})
        self._planned_steps = None
        schedule = raw.get("scheduler")
        if isinstance(schedule, dict) and any(
                (schedule.get("params") or {}).get(k) == "auto" for k in _SCHEDULE_STEP_KEYS):
            self._planned_steps = self._training_steps()
        if isinstance(schedule, dict) and self.args.lr_scheduler_type != "linear":
            warnings.warn(f"TidalTrainer: TrainingArguments.lr_scheduler_type="
                          f"'{self.args.lr_scheduler_type}' is not used: the tidal config's "
                          f"'scheduler' block ({schedule.get('type')}) sets the learning rate, as "
                          f"under --deepspeed", stacklevel=2)
        self.tidal_config = trainer_config(raw, self.args, self._planned_steps, model)
        cfg = Config.load(self.tidal_config)
        self._flops_parameters = (model.num_parameters(exclude_embeddings=True)
                                  if hasattr(model, "num_parameters") else 0)
        self.engine = _engine.initialize(model, cfg, model_parameters=self._groups(model, cfg))
        backend = self.engine.memory_report()["backend"]
        wanted = "cuda" if backend == "cuda" else "cpu"
        if self.args.device.type != wanted:
            raise ValueError(
                f"TidalTrainer: tidal runs on its {backend} device, whose tensors are on "
                f"{wanted}, but the Trainer puts batches on {self.args.device}; "
                + ("pass TrainingArguments(use_cpu=True)" if wanted == "cpu" else
                   "run without use_cpu on the GPU tidal uses"))
        self.model_wrapped = self._engine_module = _EngineModule(self.engine)

    # ------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self):
        # No mixed precision in accelerate (no autocast, no GradScaler) and no
        # device placement of the optimizer: Note [The Trainer on tidal].
        # TrainingArguments passes its fp16/bf16 to accelerate through this
        # variable; it is restored once the accelerator is made.
        previous = os.environ.get("ACCELERATE_MIXED_PRECISION")
        os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
        try:
            super().create_accelerator_and_postprocess()
        finally:
            if previous is None:
                os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
            else:
                os.environ["ACCELERATE_MIXED_PRECISION"] = previous
        self.accelerator.device_placement = False

    def _refuse_unsupported(self) -> None:
        args = self.args
        problems = []
        if self.is_deepspeed_enabled or args.deepspeed:
            problems.append("--deepspeed: tidal's engine takes DeepSpeed's place; pass the DeepSpeed "
                            "config as tidal_config instead (tidal reads DeepSpeed's keys)")
        if self.is_fsdp_enabled or args.fsdp:
            problems.append("--fsdp: tidal's chunks are the sharding; drop fsdp")
        if args.torch_compile:
            problems.append("torch_compile=True: torch.compile over tidal's module hooks is not "
                            "supported")
        if self.model_init is not None:
            problems.append("model_init: the model is put into chunks when the trainer is made; "
                            "pass the model")
        if self.optimizer is not None or self.lr_scheduler is not None or \
                self.optimizer_cls_and_kwargs is not None:
            problems.append("optimizers=/optimizer_cls_and_kwargs=: the optimizer is tidal's Adam "
                            "(the config's optimizer block, filled from TrainingArguments); set the "
                            "schedule with lr_scheduler_type or the config's scheduler block")
        optim = getattr(args.optim, "value", args.optim)
        if optim not in ADAMW_OPTIMS:
            problems.append(f"optim='{optim}': tidal's engine runs AdamW (or the config's Adam); "
                            f"use optim='adamw_torch' or 'adamw_torch_fused'")
        if args.optim_args:
            problems.append(f"optim_args={args.optim_args!r}: tidal's Adam takes its settings from "
                            f"the config's optimizer block")
        if args.fp16_full_eval or args.bf16_full_eval:
            problems.append("fp16_full_eval/bf16_full_eval: the model's weights are tidal's chunks; "
                            "evaluation runs in the training precision")
        if args.half_precision_backend == "apex":
            problems.append("half_precision_backend='apex': tidal does its own mixed precision")
        if args.auto_find_batch_size:
            problems.append("auto_find_batch_size: the micro-batch size is part of the tidal config")
        if args.world_size > 1 or args.n_gpu > 1:
            problems.append(f"world_size={args.world_size}, n_gpu={args.n_gpu}: data parallel "
                            f"under the Trainer is not supported yet (tidal's own data parallel "
                            f"runs under torchrun with tidal.initialize)")
        if getattr(args, "parallelism_config", None) is not None:
            problems.append("parallelism_config: not supported with tidal")
        if args.jit_mode_eval or getattr(args, "use_ipex", False):
            problems.append("jit_mode_eval/use_ipex: not supported with tidal's module hooks")
        if not args.save_safetensors:
            problems.append("save_safetensors=False: tidal writes safetensors only")
        if self.accelerator.mixed_precision != "no" or self.accelerator.scaler is not None:
            problems.append(f"the process's accelerate state already runs mixed precision "
                            f"'{self.accelerator.mixed_precision}' (an AcceleratorState made "
                            f"before this trainer); make a new TrainingArguments for it")
        if problems:
            raise ValueError("TidalTrainer cannot run this:\n" + "\n".join(f"  {p}" for p in problems))

    def _training_steps(self) -> int:
        """The optimizer steps train() will run, as Trainer computes them
        (set_initial_training_values), for the schedule's "auto" keys."""
        if self.train_dataset is None:
            raise ValueError("TidalTrainer: the tidal config's scheduler has \"auto\" "
                             f"{' or '.join(_SCHEDULE_STEP_KEYS)}, which are the run's optimizer "
                             "steps, and there is no train_dataset to count them; write numbers")
        loader = torch.utils.data.DataLoader(self.train_dataset, batch_size=self._train_batch_size,
                                             drop_last=self.args.dataloader_drop_last)
        values = self.set_initial_training_values(self.args, loader,
                                                  self.get_total_train_batch_size(self.args))
        return values[-1]

    def _groups(self, model, cfg) -> list:
        """The parameter groups Trainer.create_optimizer makes: weight decay
        for the parameters get_decay_parameter_names names, none for the rest."""
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": cfg.weight_decay,
                   "name": "decay"},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0,
                   "name": "no_decay"}]
        return [g for g in groups if g["params"]]

    def set_initial_training_values(self, args, dataloader, total_train_batch_size):
        values = super().set_initial_training_values(args, dataloader, total_train_batch_size)
        _, per_epoch, _, _, _, batches, max_steps = values
        steps = args.gradient_accumulation_steps
        if batches is not None and batches % steps and max_steps >= per_epoch:
            raise ValueError(
                f"TidalTrainer: an epoch has {batches} micro-batches, not a multiple of "
                f"gradient_accumulation_steps={steps}, so its last optimizer step would sum "
                f"{batches % steps}; tidal's engine steps every {steps} micro-batches (as "
                f"DeepSpeed's). Make the micro-batches per epoch a multiple of {steps} "
                f"(dataset size, per_device_train_batch_size, dataloader_drop_last), or set "
                f"max_steps below {per_epoch}")
        return values

    def _move_model_to_device(self, model, device):
        pass  # tidal moves the chunks (Note [The Trainer on tidal])

    def _wrap_model(self, model, training=True, dataloader=None):
        return self._engine_module

    def autocast_smart_context_manager(self, cache_enabled=True):
        return contextlib.nullcontext()  # tidal's precision (Note [The Trainer on tidal])

    def create_optimizer(self):
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            if self._planned_steps is not None and num_training_steps != self._planned_steps:
                raise RuntimeError(
                    f"TidalTrainer: the tidal config's scheduler was given {self._planned_steps} "
                    f"training steps when the trainer was made, and train() runs "
                    f"{num_training_steps}; write the scheduler's step counts in the config")
            if self.engine.lr_scheduler is not None:
                self.lr_scheduler = _ConfigSchedule(self.engine)
            else:
                scheduler = super().create_scheduler(num_training_steps, self.engine.optimizer)
                if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    self.lr_scheduler = _SkippingSchedule(scheduler, self.engine)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # ------------------------------------------------------------ training
    def training_step(self, model, inputs, num_items_in_batch=None):
        steps = self.engine.config.gradient_accumulation_steps
        window = getattr(self, "current_gradient_accumulation_steps", steps)
        if window != steps:
            raise RuntimeError(
                f"TidalTrainer: this accumulation window has {window} micro-batches, and tidal's "
                f"engine steps every gradient_accumulation_steps={steps} (as DeepSpeed's); make "
                f"the micro-batches per epoch a multiple of {steps}")
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if (self.args.torch_empty_cache_steps is not None
                and self.state.global_step % self.args.torch_empty_cache_steps == 0
                and torch.cuda.is_available()):
            torch.cuda.empty_cache()
        if (not self.model_accepts_loss_kwargs or num_items_in_batch is None) \
                and self.compute_loss_func is None:
            loss = loss / window
        # The Trainer's loss is already normalised for the window, and
        # engine.backward multiplies by fl32(1/steps) (Note [The Trainer on tidal]).
        self.engine.backward(loss / _float32(1.0 / steps) if steps != 1 else loss)
        return loss.detach()

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                 start_time, learning_rate=None):
        if grad_norm is not None:
            grad_norm = self.engine.get_global_grad_norm()
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch,
                                                ignore_keys_for_eval, start_time,
                                                learning_rate=learning_rate)

    def floating_point_ops(self, inputs) -> int:
        # The model's own count reads its parameters, which hold empty
        # placeholders under tidal; the count was taken before.
        estimate = getattr(self.model, "estimate_tokens", None)
        return 6 * estimate(inputs) * self._flops_parameters if estimate is not None else 0

    # --------------------------------------------------------- checkpoints
    def _save_optimizer_and_scheduler(self, output_dir):
        self.engine.save_checkpoint(output_dir)
        if self.args.should_save and not isinstance(self.lr_scheduler, _ConfigSchedule):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Called by train() before the loop; the weights come with the engine
        # checkpoint, loaded by _load_optimizer_and_scheduler.
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        if not os.path.isfile(os.path.join(checkpoint, "latest")):
            raise ValueError(
                f"TidalTrainer: {checkpoint} holds no tidal engine checkpoint (a 'latest' file and "
                f"its global_step<N>/ folder, written at each save unless save_only_model=True); "
                f"tidal resumes from those, as DeepSpeed's path does from its own")
        self.engine.load_checkpoint(checkpoint)
        if not isinstance(self.lr_scheduler, _ConfigSchedule):
            self.lr_scheduler.load_state_dict(
                torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        path, _ = self.engine.load_checkpoint(best, load_optimizer_states=False,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"TidalTrainer: no tidal engine checkpoint in {best} to load the best "
                             f"model from")

    def _save(self, output_dir=None, state_dict=None):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is not None or _is_peft_model(self.model) or self.engine is None:
            return super()._save(output_dir, state_dict=state_dict)
        os.makedirs(output_dir, exist_ok=True)
        logger.info(f"Saving model checkpoint to {output_dir}")
        self.engine.save_pretrained(output_dir)
        generation = getattr(self.model, "generation_config", None)
        if generation is not None and getattr(self.model, "can_generate", lambda: False)():
            generation.save_pretrained(output_dir)
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        return None
