"""The engine's public face as DeepSpeed's engine and nn.Module show it: the
queries a DeepSpeed training loop logs (global_steps, get_lr(),
is_gradient_accumulation_boundary(), ...), the step's counters as
attributes, and nn.Module's methods that would move, convert or write the
parameters (to(), half(), apply(), ...).

DeepSpeedEngineAPI holds no state: every member reads or sets the state of
the engine's objects (the OptimizerStep self._step, GradientAccumulation
self._accumulation, the config, the store, the data-parallel group), so the
names stay where a DeepSpeed user looks for them and the state stays with
its owner."""
from __future__ import annotations

import os
import warnings

import torch

from .errors import UsageError
from .store import GRAD32, MOMENTUM, PARAM16, PARAM32, VARIANCE

# DeepSpeed's OffloadStateTypeEnum values -> the chunk lists holding them
# (Note [Offloading the engine's states] in store.py). The 16-bit slots take
# the gradients after backward, so lp_params and lp_grads move the same chunks.
OFFLOAD_STATE_KINDS = {
    "optim_states": (MOMENTUM, VARIANCE),
    "hp_params": (PARAM32,),
    "lp_params": (PARAM16,),
    "lp_grads": (PARAM16, GRAD32),
    "contiguous_grad_buffer": (GRAD32,),
}


class _Owned:
    """An engine attribute that one of the engine's objects owns:
    engine.<name> reads (and where settable, writes) engine.<owner>.<name>."""

    def __init__(self, owner: str, settable: bool = False, doc: str = ""):
        self._owner, self._settable, self.__doc__ = owner, settable, doc

    def __set_name__(self, cls, name: str):
        self._name = name

    def __get__(self, engine, cls=None):
        if engine is None:
            return self
        return getattr(getattr(engine, self._owner), self._name)

    def __set__(self, engine, value):
        if not self._settable:
            raise AttributeError(f"engine.{self._name} is read-only")
        setattr(getattr(engine, self._owner), self._name, value)


class DeepSpeedEngineAPI:
    """Engine's DeepSpeed- and nn.Module-compatible members (a base class of
    Engine, engine.py; no attributes of its own)."""

    def num_parameters(self, only_trainable: bool = False) -> int:
        """Elements of the parameters the engine keeps in chunks (trainable
        and frozen, or only trainable), as Hugging Face's
        model.num_parameters() counts them: iterating model.parameters()
        outside a forward counts the empty placeholders (docs/parameters.md)."""
        return sum(r.numel for r in self._params.records if r.trainable or not only_trainable)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    # nn.Module's methods that move or convert parameters, or write to them:
    # the model's would act on placeholders (the values live in chunks) and
    # return the model, not the engine, so they are the engine's, and refuse
    # what they cannot do rather than do nothing.
    def to(self, *args, **kwargs):
        """Returns the engine when asked for its own device and dtype."""
        shown = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        try:
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            raise UsageError(f"engine.to({shown}): {e}") from None
        if (dtype is None or dtype == self.dtype) and (device is None or
                                                       _same_device(device, self.device)):
            return self
        raise UsageError(
            f"engine.to({shown}): the parameters live in chunks, on {self.device} as the "
            f"budget allows and in {self.precision} as the config says (bf16/fp16 keys); "
            f"inputs go to engine.device, and a dtype is chosen in the config")

    def cuda(self, device=None):
        return self.to(torch.device("cuda", device) if isinstance(device, int) else device or "cuda")

    def cpu(self):
        return self.to("cpu")

    def _refuse_conversion(self, name: str):
        raise UsageError(f"engine.{name}(): the parameters' dtype is the config's precision "
                         f"({self.precision}: the 'bf16' / 'fp16' blocks), fixed when "
                         f"tidal.initialize put them into chunks")

    def half(self):
        return self if self.precision == "fp16" else self._refuse_conversion("half")

    def bfloat16(self):
        return self if self.precision == "bf16" else self._refuse_conversion("bfloat16")

    def float(self):
        return self if self.precision == "fp32" else self._refuse_conversion("float")

    def double(self):
        self._refuse_conversion("double")

    def type(self, dst_type=None):
        self._refuse_conversion("type")

    def apply(self, fn):
        """model.apply(fn), returning the engine: what fn writes through a
        module's attributes (module.weight) is kept, as any write between
        steps is (Note [Writes to a parameter] in hooks/module_hooks.cpp)."""
        self.module.apply(fn)
        return self

    def requires_grad_(self, requires_grad: bool = True):
        raise UsageError(
            "engine.requires_grad_(): which parameters train is fixed by tidal.initialize (the "
            "frozen ones keep only their 16-bit copy in chunks); set requires_grad on the model "
            "before it, or pass model_parameters")

    def eval(self):
        return self.train(False)

    @property
    def loss_scale(self) -> float:
        return self._step.scaler.scale

    # ------------------------------------------------------ the step's state
    # DeepSpeed's names for what the optimizer step owns (OptimizerStep,
    # self._step); settable where a checkpoint's load or
    # tidal.deepspeed.initialize sets them.
    @property
    def chunks(self):
        """The chunk scheduler (tidal._C.chunks.Chunks): the store's, which
        the relayout after the warm-up step replaces."""
        return self.store.chunks

    scaler = _Owned("_step", doc="The loss scaler (StaticLossScaler, or DynamicLossScaler in fp16 "
                    "with loss_scale 0).")
    lr_scheduler = _Owned("_step", doc="The config's LR schedule (tidal.lr_schedules), or None.")
    client_lr_scheduler = _Owned("_step", settable=True,
                                 doc="deepspeed.initialize's lr_scheduler (tidal.deepspeed), or None.")
    lr = _Owned("_step", settable=True,
                doc="The LR schedule's learning rate for the next step (the config's without one).")
    betas = _Owned("_step", doc="Adam's betas for the next step (OneCycle cycles them).")
    global_steps = _Owned("_step", settable=True,
                          doc="Optimizer steps taken, skipped ones included (DeepSpeed's count).")
    global_samples = _Owned("_step", settable=True,
                            doc="Samples of the steps taken, as DeepSpeed counts them.")
    skipped_steps = _Owned("_step", settable=True, doc="Steps skipped by an fp16 overflow.")
    relayouts = _Owned("_step", doc="Relayouts into first-use order done (Note [Chunks in first-use "
                       "order]).")
    relayout_skipped = _Owned("_step", doc="Why the relayout after the warm-up step was skipped, or None.")
    micro_steps = _Owned("_accumulation", settable=True,
                         doc="The backward passes run so far (DeepSpeed's count).")
    restore_rng_on_load = _Owned("_checkpoints", settable=True,
                                 doc="Whether load_checkpoint restores the saved RNG state (Note [The RNG "
                                 "on load_checkpoint]; tidal.deepspeed.initialize sets it False).")

    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of the unscaled gradients of the last optimizer step,
        before clipping (inf after an fp16 overflow); None before the first
        step. DeepSpeed's name."""
        return self._step.last_grad_norm

    # DeepSpeed's engine queries, with DeepSpeedEngine's names and results, so
    # a DeepSpeed training loop's logging runs as it is.
    @property
    def device(self) -> torch.device:
        """Where the model computes: inputs go here (x.to(engine.device))."""
        return self.store.torch_device

    @property
    def local_rank(self) -> int:
        """The launcher's LOCAL_RANK (0 without one), as DeepSpeed's."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return 0 if self.dp is None else self.dp.rank

    @property
    def world_size(self) -> int:
        """The data-parallel ranks (1 without data parallel)."""
        return 1 if self.dp is None else self.dp.world

    def get_lr(self) -> list:
        """The learning rate of each parameter group for the next step."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Adam's (beta1, beta2) of each parameter group (OneCycle cycles them)."""
        return [g["betas"] for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last engine.step() changed the weights: False between
        accumulation boundaries, after an fp16 overflow and before any step."""
        return self._step.applied

    def train_micro_batch_size_per_gpu(self) -> "int | None":
        """The config's micro batch (None when it names none)."""
        return self.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> "int | None":
        """Samples per optimizer step over every rank (micro batch x accumulation
        x data-parallel ranks; None when the config names no batch)."""
        return self.config.train_batch_size

    def fp16_enabled(self) -> bool:
        return self.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.precision == "bf16"

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether engine.step() steps now: every gradient_accumulation_steps
        backward passes, or as set_gradient_accumulation_boundary() says."""
        return self._accumulation.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: "bool | None"):
        """Overrides where the accumulation windows end (DeepSpeed's method of
        the name): True makes the next engine.step() step with the gradients
        summed so far (a short last window of an epoch), False holds it back;
        None goes back to every gradient_accumulation_steps backward passes.
        Set before each micro-batch, as with DeepSpeed.

        Args:
            is_boundary: True, False, or None.
        """
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary expects True, False or None, got "
                            f"{is_boundary!r}")
        self._accumulation.forced_boundary = is_boundary

    # ------------------------------------------------ states off the device
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> "dict | None":
        """DeepSpeed's engine.offload_states: the engine's states leave the
        device for the host, and the device memory they held is freed, until
        reload_states() (Note [Offloading the engine's states] in store.py).
        Between steps; a forward before reload_states() is refused.

        Args:
            include: DeepSpeed's OffloadStateTypeEnum members (or their
                values) to move; None: all. optim_states: Adam's moments;
                hp_params: the fp32 masters; lp_params and lp_grads: the
                16-bit slots (which take the gradients), lp_grads also the
                fp32 gradient sums of accumulation; contiguous_grad_buffer:
                those sums.
            device: OffloadDeviceEnum.cpu (or "cpu"); none moves nothing
                (DeepSpeed warns and returns too); nvme is refused, as
                DeepSpeed refuses it.
            pin_memory: accepted; tidal's host chunks are pinned or not as
                the config's tidal.pin_memory says, once, at their allocation.
            non_blocking: accepted; the moves finish before this returns
                (a device block is freed only once its chunk is on the host).

        Returns the chunk bytes on the device before and after, as
        {"resident": (before, after), "held": (before, after)} (resident:
        payloads; held: payloads and pooled blocks); None for device none
        (DeepSpeed returns None).
        """
        where = str(getattr(device, "value", device))
        if where == "none":
            warnings.warn("engine.offload_states(device=none): no device given, nothing moves "
                          "(as DeepSpeed's)", stacklevel=2)
            return
        if where != "cpu":
            raise ValueError(f"engine.offload_states(device={device!r}): expected "
                             f"OffloadDeviceEnum.cpu ('cpu'); tidal moves the states to host "
                             f"memory (DeepSpeed refuses nvme here too)")
        names = list(OFFLOAD_STATE_KINDS) if include is None else \
            [str(getattr(x, "value", x)) for x in include]
        unknown = [n for n in names if n not in OFFLOAD_STATE_KINDS]
        if unknown:
            raise ValueError(f"engine.offload_states(include=...): unknown state(s) {unknown}; "
                             f"expected OffloadStateTypeEnum members: "
                             f"{', '.join(OFFLOAD_STATE_KINDS)}")
        kinds = list(dict.fromkeys(k for n in names for k in OFFLOAD_STATE_KINDS[n]))
        self.settle_overlap()  # (CPU Adam of a backward holds chunks: Note [Speculative updates and their undo])
        self._outside.settle()  # (parameters read outside a forward hold their slots)
        moved = self.store.offload_to_host(kinds)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # (DeepSpeed empties the accelerator's cache too)
        return moved

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's engine.reload_states: the states offload_states() moved
        come back to the device, as they were (Note [Offloading the engine's
        states] in store.py); nothing happens when none are offloaded.

        Args:
            non_blocking: accepted; the moves finish before this returns.
        """
        del non_blocking
        self.store.reload()

    def destroy(self) -> None:
        """DeepSpeed's engine.destroy, which its offload_states example calls
        when done with an engine: the engine's hooks go (remove_hooks()) and
        every chunk leaves the device, whose blocks are freed; the weights and
        optimizer states stay readable (parameters_fp32(), state_dict()), and
        the engine does not train again."""
        self.offload_states()  # (what an earlier offload left on the device too)
        self.remove_hooks()


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index is None or b.index is None:
        return True
    return a.index == b.index
