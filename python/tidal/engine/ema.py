"""An exponential moving average of the weights, kept by the engine.

Note [An EMA of the weights]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Scripts keep an EMA of the weights for evaluation (`ema = d * ema + (1 - d)
* p` over `model.parameters()` after each optimizer step, timm's ModelEma,
torch.optim.swa_utils.AveragedModel). Under tidal that loop reads every
parameter outside a forward, and with `torch._foreach_*` over all of them at
once needs the whole model on the device at one time: it is exact where it
fits and an OutOfMemoryError where it does not.

engine.ema(decay) keeps it on the engine's side instead, at any budget: an
fp32 host tensor per trainable parameter, started from its master, and
after each optimizer step that was applied (not one an fp16 overflow
skipped, not a micro-step inside an accumulation window) each is updated
from the master where its chunk is now (no chunk moves for it; a chunk on
disk is read to the host):
    ema.mul_(decay).add_(master, alpha=1 - decay)
which is the loop above in fp32 over the masters. Frozen parameters keep
their values; they are in engine.ema_state_dict() as they are.

Cost: 4 bytes of host memory per trainable parameter, and per step one read
of every master (from the device where hybrid Adam keeps it there).
Not covered: data parallel (the masters live on their owners; refused by
name) and checkpoints (save_checkpoint does not save the EMA: save
engine.ema_state_dict() beside it).
"""
from __future__ import annotations

import torch

from .. import dtr as _dtr
from .errors import UsageError
from .store import PARAM16, PARAM32, uncounted

__all__ = ["WeightEma"]


class WeightEma:
    """The EMA of the weights of one engine (Note [An EMA of the weights]).

    Args:
        params: the engine's ParamTable (the records, their names).
        store: the ParamStore (the masters).
        decay: the EMA's decay, a float in [0, 1).
    """

    def __init__(self, *, params, store, decay: float):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"engine.ema(decay): decay must be a float in [0, 1), got {decay!r}")
        if store.dp is not None:
            raise UsageError("engine.ema() under data parallel: the fp32 masters live on the ranks "
                             "that own their chunks; keep an EMA of engine.state_dict() by hand")
        self.decay = float(decay)
        self.updates = 0
        self._params = params
        self._store = store
        self.values: dict[str, torch.Tensor] = {}
        with torch.no_grad(), uncounted(), _dtr.outside():
            for r in params.records:
                kind = PARAM32 if r.trainable else PARAM16
                with store.slots(r, (kind,)) as (slot,):
                    self.values[r.name] = slot.reshape(r.shape).to("cpu", torch.float32, copy=True)

    def update(self) -> None:
        """After an applied optimizer step: every trainable parameter's EMA
        takes its master."""
        d = self.decay
        with torch.no_grad(), uncounted(), _dtr.outside():
            for r in self._params.records:
                if not r.trainable:
                    continue
                with self._store.slots(r, (PARAM32,)) as (master,):
                    self.values[r.name].mul_(d).add_(master.reshape(r.shape).to("cpu"), alpha=1.0 - d)
        self.updates += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the EMA, by parameter name (the model's state_dict keys)."""
        return {name: v.clone() for name, v in self.values.items()}
