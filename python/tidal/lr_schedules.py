"""Learning-rate schedules with DeepSpeed's names, parameters and semantics.

A config's ``scheduler`` section picks one, exactly as in a DeepSpeed config:

    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                             "warmup_num_steps": 100, "total_num_steps": 10000}}

The formulas, defaults and step convention follow
``deepspeed/runtime/lr_schedules.py`` of DeepSpeed 0.19.8 (read and checked
against it value for value). See Note [Scheduler step convention].

Note [Scheduler step convention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A schedule holds ``last_batch_iteration``, -1 before the first optimizer
step. ``lr_at(k)`` is DeepSpeed's ``get_lr()`` with
``last_batch_iteration == k``. DeepSpeed writes ``get_lr()`` into the
optimizer when the scheduler is built and after every ``scheduler.step()``,
and its engine calls ``scheduler.step()`` after each optimizer step that was
*not* skipped by an fp16 overflow. So the n-th applied optimizer step
(n = 0, 1, ...) runs with ``lr_at(n - 1)``: for WarmupLR the first step uses
``warmup_min_lr`` (``lr_at(-1)``), and with the log warm-up so does the
second (``lr_at(0)``, log(1) = 0). A skipped step does not advance the
schedule.

Deviations from DeepSpeed, on purpose:
- an unknown ``warmup_type`` is a config error (DeepSpeed logs a warning and
  uses "log");
- a schedule resumed with ``last_batch_iteration = k >= 0`` starts at
  ``lr_at(k)`` (DeepSpeed leaves the optimizer's configured lr in place until
  the first ``step()``);
- one parameter group: every method returns one float, not a list per group
  (``get_last_lr()`` keeps DeepSpeed's list form).
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["PARAMS", "REQUIRED", "Schedule", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
           "OneCycle", "LRRangeTest", "build_scheduler"]


class _Required:
    def __repr__(self) -> str:
        return "<required>"


# The default of a parameter the schedule cannot do without.
REQUIRED: Any = _Required()

_NUMBER = (float, int)
_NONE = type(None)

# type -> {param: (kind, default, doc)}, kinds as in tidal._schema.check_value.
# Defaults are DeepSpeed 0.19.8's constructor defaults.
PARAMS: dict[str, dict[str, tuple]] = {
    "WarmupLR": {
        "warmup_min_lr": (_NUMBER, 0.0, "lr at the start of the warm-up"),
        "warmup_max_lr": (_NUMBER + (_NONE,), None,
                          "lr at the end of the warm-up; null = optimizer.params.lr"),
        "warmup_num_steps": (int, 1000, "warm-up length in optimizer steps (at least 2 are used)"),
        "warmup_type": (("log", "linear"), "log", "shape of the warm-up"),
        "last_batch_iteration": (int, -1, "schedule position to resume from; -1 = start"),
    },
    "WarmupDecayLR": {
        "total_num_steps": (int, REQUIRED, "the step at which the lr is back at warmup_min_lr"),
        "warmup_min_lr": (_NUMBER, 0.0, "lr at the start of the warm-up and the end of the decay"),
        # NB: 0.001 here, not the optimizer's lr as in WarmupLR (DeepSpeed's defaults
        # differ); an explicit null still means the optimizer's lr, as in DeepSpeed.
        "warmup_max_lr": (_NUMBER + (_NONE,), 0.001, "lr at the end of the warm-up"),
        "warmup_num_steps": (int, 1000, "warm-up length in optimizer steps (at least 2 are used)"),
        "warmup_type": (("log", "linear"), "log", "shape of the warm-up"),
        "last_batch_iteration": (int, -1, "schedule position to resume from; -1 = start"),
    },
    "WarmupCosineLR": {
        "total_num_steps": (int, REQUIRED, "the step at which the cosine reaches cos_min_ratio"),
        "warmup_min_ratio": (_NUMBER, 0.0, "lr / optimizer lr at the start of the warm-up"),
        "warmup_num_steps": (int, 1000, "warm-up length in optimizer steps (at least 2 are used)"),
        "cos_min_ratio": (_NUMBER, 0.0001, "lr / optimizer lr at the end of the cosine"),
        "warmup_type": (("log", "linear"), "log", "shape of the warm-up"),
        "last_batch_iteration": (int, -1, "schedule position to resume from; -1 = start"),
    },
    "OneCycle": {
        "cycle_min_lr": (_NUMBER, REQUIRED, "lr at the ends of the cycle"),
        "cycle_max_lr": (_NUMBER, REQUIRED, "lr at the peak of the cycle"),
        "decay_lr_rate": (_NUMBER, 0.0, "post-cycle decay: lr = cycle_min_lr / (1 + rate * k / decay_step_size)"),
        "cycle_first_step_size": (int, 2000, "steps of the rising half"),
        "cycle_second_step_size": ((int, _NONE), None, "steps of the falling half; null = first"),
        "cycle_first_stair_count": (int, 0, "stairs in the rising half; 0 = continuous"),
        "cycle_second_stair_count": ((int, _NONE), None, "stairs in the falling half; null = first"),
        "decay_step_size": (int, 0, "post-cycle decay interval; 0 = no decay"),
        "cycle_momentum": (bool, True, "cycle Adam's beta1 inversely to the lr (beta2 becomes 0.99)"),
        "cycle_min_mom": (_NUMBER, 0.8, "beta1 at the lr peak"),
        "cycle_max_mom": (_NUMBER, 0.9, "beta1 at the ends of the cycle"),
        "decay_mom_rate": (_NUMBER, 0.0, "post-cycle beta1 growth rate"),
        "last_batch_iteration": (int, -1, "schedule position to resume from; -1 = start"),
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": (_NUMBER, 1e-3, "starting lr"),
        "lr_range_test_step_size": (int, 2000, "steps per lr increase"),
        "lr_range_test_step_rate": (_NUMBER, 1.0, "lr = min_lr * (1 + rate * steps / step_size)"),
        "lr_range_test_staircase": (bool, False, "increase in whole steps of step_size"),
        "last_batch_iteration": (int, -1, "schedule position to resume from; -1 = start"),
    },
}


class Schedule:
    """Base of the schedules: DeepSpeed's scheduler protocol for one parameter group.

    Subclasses define ``lr_at(k)`` (and ``betas_at(k)`` when they move Adam's
    betas); see Note [Scheduler step convention].
    """

    def __init__(self, last_batch_iteration: int = -1):
        self.last_batch_iteration = int(last_batch_iteration)

    def lr_at(self, last_batch_iteration: int) -> float:
        raise NotImplementedError

    def betas_at(self, last_batch_iteration: int) -> tuple[float, float] | None:
        """Adam's (beta1, beta2) at that position; None = the optimizer's own."""
        return None

    def get_lr(self) -> float:
        """The lr for the next optimizer step."""
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        return [self.get_lr()]

    def get_betas(self) -> tuple[float, float] | None:
        return self.betas_at(self.last_batch_iteration)

    def step(self, last_batch_iteration: int | None = None) -> float:
        """Advances after an applied optimizer step; returns the lr for the next one."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        return self.get_lr()

    def state_dict(self) -> dict:
        # DeepSpeed's layout, so scheduler states move between the two.
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_batch_iteration={self.last_batch_iteration})"


def _check_warmup(warmup_num_steps, warmup_type) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) \
            or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


def _warmup_gamma(k: int, num_steps: int, kind: str) -> float:
    # DeepSpeed: inverse_log_warm_up * log(k + 1), or k / num_steps.
    if kind == "log":
        return (1.0 / math.log(num_steps)) * math.log(k + 1)
    return k / num_steps


class WarmupLR(Schedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps, then constant.

    Args:
        warmup_min_lr: lr before and at the start of the warm-up.
        warmup_max_lr: lr after the warm-up.
        warmup_num_steps: warm-up length; values below 2 act as 2 (as DeepSpeed).
        warmup_type: "log" (lr rises with log(k + 1)) or "linear".
        last_batch_iteration: -1 to start from the beginning.
    """

    def __init__(self, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(last_batch_iteration)
        self.min_lr = float(warmup_min_lr)
        self.max_lr = float(warmup_max_lr)
        self.delta_lr = self.max_lr - self.min_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type

    def _gamma(self, k: int) -> float:
        if k < self.warmup_num_steps:
            return _warmup_gamma(k, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, last_batch_iteration: int) -> float:
        if last_batch_iteration < 0:
            return self.min_lr
        return self.min_lr + self.delta_lr * self._gamma(last_batch_iteration)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay back to warmup_min_lr at total_num_steps.

    Args:
        total_num_steps: where the decay ends (the lr stays at warmup_min_lr after).
        others: as WarmupLR.
    """

    def __init__(self, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        self.total_num_steps = int(total_num_steps)

    def _gamma(self, k: int) -> float:
        if k < self.warmup_num_steps:
            return _warmup_gamma(k, self.warmup_num_steps, self.warmup_type)
        return max(0.0, float(self.total_num_steps - k)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(Schedule):
    """A warm-up of the ratio lr / base_lr from warmup_min_ratio to 1, then a cosine to cos_min_ratio.

    Args:
        base_lr: the optimizer's lr (DeepSpeed's ``org_lrs``).
        total_num_steps: where the cosine ends (the ratio stays at cos_min_ratio after).
        warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type: DeepSpeed's.
    """

    def __init__(self, base_lr: float, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(last_batch_iteration)
        self.base_lr = float(base_lr)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type

    def ratio_at(self, k: int) -> float:
        if k < 0:
            return 0.0  # DeepSpeed: the lr is 0 until the first scheduler step
        if k < self.warmup_num_steps:
            r = _warmup_gamma(k, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        real_last_step = k - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def lr_at(self, last_batch_iteration: int) -> float:
        return self.base_lr * self.ratio_at(last_batch_iteration)


class OneCycle(Schedule):
    """DeepSpeed's 1Cycle: lr up from cycle_min_lr to cycle_max_lr and back, then decay.

    With cycle_momentum, beta1 moves inversely between cycle_max_mom and
    cycle_min_mom and beta2 is set to 0.99, as DeepSpeed does (it writes
    ``(momentum, 0.99)`` into the optimizer's betas, whatever beta2 was).
    """

    def __init__(self, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):
        super().__init__(last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if not (first > 0 and second > 0):
            raise ValueError(f"cycle step sizes must be positive, got {cycle_first_step_size!r} "
                             f"and {cycle_second_step_size!r}")
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = self.first_stair_count if cycle_second_stair_count is None \
            else int(cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lr = float(cycle_min_lr)
        self.max_lr = float(cycle_max_lr)
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum)
        self.min_mom = float(cycle_min_mom)
        self.max_mom = float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        self._initial = self.last_batch_iteration

    def _scale(self, k: int) -> float:
        batch_iteration = k + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantised from the integer offset in the cycle, as DeepSpeed 0.19.8.
            it = batch_iteration % self.total_size
            if it <= self.first_step_size:
                position = it * stairs / self.first_step_size
            else:
                position = (self.total_size - it) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lr_at(self, last_batch_iteration: int) -> float:
        k = last_batch_iteration
        if k < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self._scale(k)
        if self.skip_lr_decay:
            return self.min_lr
        decay = (k - self.total_size + 1) / self.decay_step_size
        return self.min_lr / (1 + self.decay_lr_rate * decay)

    def betas_at(self, last_batch_iteration: int) -> tuple[float, float] | None:
        if not self.cycle_momentum:
            return None
        k = last_batch_iteration
        if k == -1 and self._initial == -1:
            return (self.min_mom, 0.99)  # DeepSpeed's constructor sets the min momentum
        if k < self.total_size:
            return (self.max_mom - (self.max_mom - self.min_mom) * self._scale(k), 0.99)
        if self.skip_mom_decay:
            return (self.max_mom, 0.99)
        decay = (k - self.total_size + 1) / self.decay_step_size
        return (self.max_mom * (1 + self.decay_mom_rate * decay), 0.99)


class LRRangeTest(Schedule):
    """lr = min_lr * (1 + step_rate * (k + 1) / step_size), floored to whole intervals in staircase mode."""

    def __init__(self, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        super().__init__(last_batch_iteration)
        self.min_lr = float(lr_range_test_min_lr)
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)

    def lr_at(self, last_batch_iteration: int) -> float:
        interval = float(last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return self.min_lr * (1 + self.step_rate * interval)


def build_scheduler(cfg) -> Schedule | None:
    """The schedule a config asks for, or None when it has no ``scheduler`` section.

    Args:
        cfg: a loaded tidal.Config (``tidal.Config.load(...)``); its
            ``scheduler`` is ``{"type": ..., "params": {...}}`` with every
            parameter resolved, and ``lr`` is the optimizer's lr (the
            default warmup_max_lr of WarmupLR, the base of WarmupCosineLR).
    """
    if not hasattr(cfg, "scheduler") or not hasattr(cfg, "lr"):
        raise TypeError(f"build_scheduler expects a loaded tidal.Config (tidal.Config.load(...)), "
                        f"got {type(cfg).__name__}")
    spec = cfg.scheduler
    if spec is None:
        return None
    kind, p = spec["type"], dict(spec["params"])
    if kind in ("WarmupLR", "WarmupDecayLR") and p["warmup_max_lr"] is None:
        p["warmup_max_lr"] = cfg.lr
    if kind == "WarmupLR":
        return WarmupLR(**p)
    if kind == "WarmupDecayLR":
        return WarmupDecayLR(**p)
    if kind == "WarmupCosineLR":
        return WarmupCosineLR(cfg.lr, **p)
    if kind == "OneCycle":
        return OneCycle(**p)
    if kind == "LRRangeTest":
        return LRRangeTest(**p)
    raise ValueError(f"unknown scheduler type {kind!r}; expected one of {', '.join(PARAMS)}")
