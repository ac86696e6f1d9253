"""Gradient accumulation: the window of micro-batches one optimizer step
sums, and the gradients between a backward and the step.

After each backward the gradients sit in the parameters' 16-bit slots
("landed", flagged by ModuleHooks). Without accumulation the step reads them
there. With gradient_accumulation_steps > 1 each backward folds them into
fp32 sums in chunks (the GRAD32 list), where the step will run, and the
16-bit slots get their weights back (Note [Gradient sums in chunks] in
cpu_adam/adam.h). Which parameters have a gradient landed, and which a sum,
is ModuleHooks' to know (landed_params, summed_params): nothing here keeps
a copy of it.
"""
from __future__ import annotations

import collections
from typing import Callable

import torch

from .. import dtr as _dtr
from .params import ParamTable
from .store import DEVICE, GRAD32, HOST, PARAM32, uncounted


class GradientAccumulation:
    """The accumulation window and the gradients waiting for the step.

    steps:          gradient_accumulation_steps; `summing` is steps > 1.
    micro_steps:    the backward passes finished so far (DeepSpeed's count).
    forced_boundary: set_gradient_accumulation_boundary's override, or None.
    broken:         why the sums cannot be stepped on (a failed backward
        folded part of its gradients: Note [CPU Adam during backward]), or
        None; cleared by reset() (engine.zero_grad()).

    What it needs of the engine is passed in, in two steps. At construction:
    the ParamTable (`params`), the ModuleHooks (`hooks`, the landed flags,
    the folds and the sums' drop), the store (where a chunk is updated), the
    Config and whether the host is short of room (`host_short`). Then
    connect(), once the optimizer step (and data parallel) exist, which are
    built after it: `give_weights_back(records)`, which puts the weights back
    into slots that hold gradients being dropped (from the masters; with
    data parallel, from the owners). Nothing drops gradients before that:
    no hook is on the model yet.

    Args:
        steps: gradient_accumulation_steps.
        params: the engine's ParamTable.
        hooks: the engine's ModuleHooks.
        store: the ParamStore.
        config: the engine's Config (the CPU Adam threads, hybrid Adam).
        host_short: whether the host budget is too small for the state.
    """

    def __init__(self, *, steps: int, params: ParamTable, hooks, store, config,
                 host_short: Callable[[], bool]):
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"gradient accumulation steps must be an int >= 1, got {steps!r}")
        self.steps = steps
        self.summing = steps > 1
        self.micro_steps = 0
        self.forced_boundary: "bool | None" = None
        self.broken: "str | None" = None
        self._params = params
        self._hooks = hooks
        self._store = store
        self._config = config
        self._host_short = host_short
        self._give_weights_back: "Callable[[list], None] | None" = None  # (connect())

    def connect(self, *, give_weights_back: Callable[[list], None]) -> None:
        """The second step of the construction (the class docstring).

        Args:
            give_weights_back: give_weights_back(records) puts the weights back
                into the slots of `records`, which hold gradients being dropped.
        """
        self._give_weights_back = give_weights_back

    # ------------------------------------------------------------ the counts
    def backward_done(self) -> None:
        """A backward pass finished (its fold, if any, done): one micro-step more."""
        self.micro_steps += 1

    def break_window(self, why: str) -> None:
        """The sums cannot be stepped on (`why`: a failed backward folded part
        of its gradients); engine.step() refuses until reset()."""
        self.broken = why

    def load_count(self, micro_steps: int) -> None:
        """A checkpoint's load sets the micro-step count it saved."""
        if not isinstance(micro_steps, int) or micro_steps < 0:
            raise ValueError(f"micro_steps must be an int >= 0, got {micro_steps!r}")
        self.micro_steps = micro_steps

    # ------------------------------------------------------------ the window
    def is_boundary(self) -> bool:
        """Whether engine.step() steps now: every `steps` backward passes, or
        as set_gradient_accumulation_boundary() says."""
        if self.forced_boundary is not None:
            return self.forced_boundary
        return self.micro_steps % self.steps == 0

    def next_backward_ends_window(self) -> bool:
        """Whether the backward about to run is the last of its window (the
        one whose gradients the next step takes)."""
        if self.forced_boundary is not None:
            return self.forced_boundary
        return (self.micro_steps + 1) % self.steps == 0

    # ------------------------------------------------------------ gradients
    def landed(self) -> list:
        """The records whose 16-bit slot holds a landed gradient, in chunk order."""
        return self._params.in_record_order(self._hooks.landed_params())

    def summed(self) -> list:
        """The records whose gradient sum holds something, in chunk order."""
        return self._params.in_record_order(self._hooks.summed_params())

    def pending(self) -> list:
        """The records the step updates: those with a sum, or with a landed gradient."""
        return self.summed() if self.summing else self.landed()

    def drop_landed(self) -> None:
        """The landed gradients go; their slots get their weights back."""
        pending = self.landed()
        if pending:
            with _dtr.outside():
                self._give_weights_back(pending)
            self._hooks.clear_landed(self._params.indexes(pending))

    def has_sums(self) -> bool:
        """Whether any gradient sum holds something (a window under way)."""
        return bool(self._hooks.summed_params())

    def drop_sums(self) -> None:
        """Every gradient sum goes (their chunks give their memory back)."""
        summed = self._hooks.summed_params()
        if summed:
            self._hooks.drop_sums(summed)

    def reset(self) -> None:
        """engine.zero_grad(): the landed gradients and the sums of an
        unfinished window go."""
        self.broken = None
        self.drop_landed()
        self.drop_sums()

    def stepped(self, pending: list, owned: list) -> None:
        """After the step over `pending` (of which this rank updated `owned`):
        the sums, or the landed flags, are cleared. (Sums the step handed
        over to an update under the next forward are not sums any more, and
        stay until it is done: free_sums_of; Note [Measured where folded] in
        overlap.py.)"""
        if self.summing:
            # (Data parallel: only the owners' sums were folded.)
            self._hooks.drop_sums(self._params.indexes(owned))
        else:
            self._hooks.clear_landed(self._params.indexes(pending))

    # ------------------------------------------------------------ the folds
    def fold(self) -> None:
        """After each backward: each chunk's landed gradients go into their
        fp32 sums in one call, where the chunk is, and the 16-bit slots get
        their weights back."""
        by_chunk = collections.defaultdict(list)
        for r in self.landed():
            by_chunk[r.chunk].append(r)
        if not by_chunk:
            return
        try:
            self.fold_chunks(by_chunk, self._host_short())
        except BaseException as e:
            # The slots still holding gradients get their weights back, so the
            # model stays usable; the sums have this micro-batch's gradients
            # only for the chunks folded before the error.
            self.drop_landed()
            e.add_note("tidal: folding this micro-batch's gradients into the accumulation sums "
                       "failed part-way; call engine.zero_grad() to start the step afresh")
            raise

    def fold_chunk(self, chunk: int, recs: list, space) -> None:
        """One chunk's landed gradients into their sums in `space` (the
        overlapped step folds a chunk at its last landing)."""
        cfg = self._config
        with torch.no_grad(), uncounted(), _dtr.outside():
            self._hooks.fold_gradients(self._params.indexes(recs), space,
                                       num_threads=cfg.cpu_adam_threads, pool=cfg.cpu_adam_pool)

    def start_fold(self, recs: list, measure: bool = False):
        """fold_chunk's first part on the host, for a pass on the worker
        (Note [Folds on the worker] in overlap.py): `recs` (one chunk's)
        have their slots accessed without waiting for the copies into them;
        the answer's submit() runs the pass, then end_fold. `measure`: the
        pass also measures the new sums (Note [Measured in the fold])."""
        with torch.no_grad(), uncounted(), _dtr.outside():
            return self._hooks.start_fold(self._params.indexes(recs), measure=measure)

    def end_fold(self, fold, folded: bool) -> None:
        """A started fold's slots released: as fold_chunk leaves them where
        its pass ran (`folded`), as they were otherwise."""
        with torch.no_grad(), uncounted(), _dtr.outside():
            self._hooks.end_fold(fold, folded)

    def measure_chunk(self, recs: list, fold=None) -> None:
        """The sums of `recs` (one chunk's, final: the window's last fold)
        measured for the step's norm, where they are (Note [Measured where
        folded] in overlap.py); `fold`, that last fold where its pass
        measured them (Note [Measured in the fold]): taken from it."""
        if fold is not None:
            self._hooks.measured_in_fold(fold)
            return
        with torch.no_grad(), uncounted(), _dtr.outside():
            self._hooks.measure_sums(self._params.indexes(recs))

    def free_sums_of(self, recs: list) -> None:
        """The memory of the sums of `recs` goes: an update the step left to
        the next forward has read them (handed over by the step)."""
        self._hooks.free_sums(self._params.indexes(recs))

    def fold_chunks(self, by_chunk: dict, host_short: bool) -> None:
        """The chunks of `by_chunk` (chunk -> its landed records), each where
        its step will run (hybrid Adam: on the device when it has room), so
        the sums are where the step reads them. A fold on the host moves the
        16-bit chunk down (its gradients) and up again for the next forward:
        the bytes a budget too small for the 16-bit chunks moves anyway."""
        cfg = self._config
        with torch.no_grad(), uncounted(), _dtr.outside():
            for chunk in sorted(by_chunk):
                recs = by_chunk[chunk]
                on_device = self._store.adam_placement.on_device(chunk, (PARAM32, GRAD32), host_short)
                self._hooks.fold_gradients(self._params.indexes(recs), DEVICE if on_device else HOST,
                                           num_threads=cfg.cpu_adam_threads, pool=cfg.cpu_adam_pool)
