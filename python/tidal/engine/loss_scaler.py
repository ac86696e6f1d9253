"""Loss scaling for fp16 training, with DeepSpeed's semantics.

DynamicLossScaler follows deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler:
the scale starts at 2**initial_scale_power; an overflow (inf/nan gradient)
skips the step and, once `hysteresis` overflows have been seen, divides the
scale by 2 (never below min_loss_scale); after `loss_scale_window` steps
without an overflow since the last one, the scale doubles and the hysteresis
budget refills.
"""
from __future__ import annotations


class StaticLossScaler:
    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    def __init__(self, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0, scale_factor: float = 2.0):
        self.scale = float(2 ** initial_scale_power)
        self.window = int(loss_scale_window)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_loss_scale)
        self.factor = float(scale_factor)
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
            self.cur_hysteresis = self.hysteresis
            self.scale *= self.factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis,
                "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
