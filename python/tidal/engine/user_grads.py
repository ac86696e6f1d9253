"""A parameter's gradient read and written by user code between a backward
and the step.

Note [Gradients between backward and step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A landed gradient waits for the step in its parameter's 16-bit slot (with
gradient accumulation, in its fp32 sum in the GRAD32 chunks, Note [Gradient
sums in chunks] in cpu_adam/adam.h), and `param.grad` stays None (Note [One
call per hook] in hooks/module_hooks.h). Scripts read gradients there: a norm
logged by hand, torch.nn.utils.clip_grad_norm_ (however it was imported, so
no wrapper of torch's function can be the way), get_total_norm +
clip_grads_with_norm_, `p.grad = None` to leave a parameter out of a step.

So the user's `p.grad` (seen by the parameter's __torch_function__, Note [A
parameter object stays the user's] in user_param.py) is served here:
  * a read hands out a copy of the gradient the step would use, made once
    per parameter and step, on the parameter's device and in the slot's
    dtype: the landed 16-bit gradient, or the window's fp32 sum so far (of
    the losses engine.backward divided by the accumulation steps);
    None where nothing waits (a parameter that got no gradient, after the
    step), as plain PyTorch;
  * the copy is the parameter's gradient until the engine next takes the
    chunks (a forward's start, engine.backward, the step, state dicts,
    checkpoints: OutsideAccess.settle): there each copy goes back into its
    slot, so what the script wrote into it (clip_grad_norm_'s in-place
    multiply) is what the step uses, and with the 16-bit gradients the
    landing's measure of the norm is taken again (the config's clipping and
    get_global_grad_norm() then see the written values);
  * `p.grad = t` (t of the parameter's shape) is the gradient the step uses;
    `p.grad = None` drops it: its slot gets its weight back and the step
    leaves the parameter as it is, as torch's AdamW skips a parameter
    without a gradient.
Speculative CPU Adam updates made during backward (Note [Speculative updates
and their undo] in overlap.py) are taken back before a gradient is read:
the 16-bit slot holds the updated weight by then, and the step redoes them
from the values the script leaves.

Refused by name, where the copy cannot be exact: fp16 (the slot holds the
gradient times the loss scale; unscaled by hand and scaled back it is not
the same bits once the scale is not a power of two, and an overflow skips
the step in a way plain PyTorch does not) and data parallel (a rank's slot
holds its own gradient until the reduction, and only the owner the reduced
one). Both are told to use the config's "gradient_clipping".

Not covered: a copy kept past the point where it went back (`g = p.grad`,
then a forward, then `g.mul_(0.5)`) is not the gradient any more; read
`p.grad` again.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import dtr as _dtr
from .errors import UsageError
from .store import GRAD32, PARAM16, PARAM32, uncounted

__all__ = ["UserGradients"]


class UserGradients:
    """The copies of waiting gradients handed to user code (Note [Gradients
    between backward and step]); an object of the engine's OutsideAccess.

    State it owns: `handed`, record index -> the tensor `p.grad` answers
    until write_back() or drop_all().

    Args:
        params: the engine's ParamTable.
        store: the ParamStore (the slots; its precision and data parallel).
        hooks: the engine's ModuleHooks (which gradients landed or are
            summed; the landing's norm measure).
        accumulation: the engine's GradientAccumulation (whether it sums).
        settle_overlap: takes back CPU Adam's updates made during backward.
        settle_raw_backward: what engine.backward does after its backward,
            for a loss.backward() the script ran (the accumulation's fold).
    """

    def __init__(self, *, params, store, hooks, accumulation, settle_overlap: Callable[[], None],
                 settle_raw_backward: Callable[[], None]):
        self._params = params
        self._store = store
        self._hooks = hooks
        self._accumulation = accumulation
        self._settle_overlap = settle_overlap
        self._settle_raw_backward = settle_raw_backward
        self.handed: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------ queries
    def _kind(self, i: int):
        """The slot kind holding parameter `i`'s waiting gradient, or None."""
        if self._accumulation.summing:
            return GRAD32 if i in set(self._hooks.summed_params()) else None
        return PARAM16 if self._hooks.landed(i) else None

    def _check_exact(self, i: int, what: str) -> None:
        store = self._store
        why = None
        if store.precision == "fp16":
            why = ("the engine trains in fp16, where the waiting gradient is multiplied by the "
                   "loss scale and an overflow skips the step")
        elif store.dp is not None:
            why = ("the engine trains data-parallel, where a rank's slot holds its own gradient "
                   "until the reduction, and the reduced one only on the chunk's owner")
        if why is None:
            return
        name = self._params.record_list[i].name
        raise UsageError(
            f"tidal: '{name}'.grad {what} between engine.backward() and engine.step(): {why}, so "
            f"tidal cannot hand out the gradient plain PyTorch would hold. Ways that work: set "
            f"\"gradient_clipping\": <max norm> in the config (engine.step() clips by the global "
            f"norm of all gradients, as clip_grad_norm_ does); engine.get_global_grad_norm() "
            f"returns that norm after the step (docs/parameters.md)")

    # ------------------------------------------------------------ p.grad
    def read(self, i: int):
        """`p.grad` of parameter `i` read by user code outside a forward and a
        backward: the copy handed out, or None where no gradient waits."""
        got = self.handed.get(i)
        if got is not None:
            return got
        self._settle_raw_backward()  # (a loss.backward()'s fold, as the step would make it)
        kind = self._kind(i)
        if kind is None:
            return None
        self._check_exact(i, "read")
        self._settle_overlap()
        record = self._params.record_list[i]
        with torch.no_grad(), uncounted(), _dtr.outside():
            with self._store.slots(record, (kind,)) as (slot,):
                got = slot.reshape(record.shape).to(device=record.param.device, copy=True)
        self.handed[i] = got
        return got

    def write(self, i: int, value) -> bool:
        """`p.grad = value` by user code on parameter `i`: True where a
        gradient waited (it is handed or dropped here), False where none did
        (the set is torch's, on the placeholder)."""
        self._settle_raw_backward()
        kind = self._kind(i)
        if kind is None:
            self.handed.pop(i, None)
            return False
        self._check_exact(i, "set")
        record = self._params.record_list[i]
        if value is None:
            self._drop(i, kind)
            return True
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(record.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise UsageError(f"tidal: '{record.name}'.grad set to {got}; expected a tensor of the "
                             f"parameter's shape {tuple(record.shape)} (or None)")
        self._settle_overlap()
        self.handed[i] = value
        return True

    def _drop(self, i: int, kind) -> None:
        """`p.grad = None` between backward and step: the step leaves the
        parameter as it is (torch's AdamW skips it)."""
        self._settle_overlap()
        self.handed.pop(i, None)
        record = self._params.record_list[i]
        hooks = self._hooks
        if kind == GRAD32:
            hooks.drop_sums([i])
            # (Measured already where its window's last backward folded it:
            # Note [Measured where folded] in overlap.py.)
            hooks.measure_grad(i, torch.zeros(0))
            return
        with torch.no_grad(), uncounted(), _dtr.outside():
            with self._store.slots(record, (PARAM16, PARAM32)) as (weight, master):
                weight.copy_(master)
        hooks.clear_landed([i])
        hooks.measure_grad(i, torch.zeros(0))  # (its landing's measure no longer counts)

    # ------------------------------------------------------------ the engine's
    def write_back(self) -> None:
        """Where the engine takes the chunks (OutsideAccess.settle): each copy
        handed out goes back into its slot, with what user code wrote to it;
        a 16-bit gradient is measured again for the step's norm."""
        if not self.handed:
            return
        handed, self.handed = self.handed, {}
        records = self._params.record_list
        with torch.no_grad(), uncounted(), _dtr.outside():
            for i, value in handed.items():
                kind = self._kind(i)
                if kind is None:
                    continue  # (dropped by the engine since: zero_grad)
                with self._store.slots(records[i], (kind,)) as (slot,):
                    slot.copy_(value.detach().reshape(-1))
                    if kind == PARAM16:
                        self._hooks.measure_grad(i, slot)
                if kind == GRAD32:
                    # A sum measured where the window's last backward folded
                    # it (Note [Measured where folded] in overlap.py) is
                    # measured again; the step measures the others anyway.
                    self._hooks.measure_sums([i])

    def drop_all(self) -> None:
        """engine.zero_grad(), remove_hooks(): the copies go with the gradients."""
        self.handed = {}
