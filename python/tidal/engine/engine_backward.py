"""Engine.backward and what follows a failed forward or backward: a base
class of Engine (engine.py) without state of its own, as engine_api.py is.

engine.backward(loss) scales the loss (fp16's loss scale, the accumulation
steps), runs torch's backward with the engine's hooks counting, and on an
error releases every slot the backward left in use, drops the gradients it
landed and raises the error the user should see (a tidal.OutOfMemoryError
naming what the device held, where torch's allocator refused).
"""
from __future__ import annotations

import warnings

import torch

from .. import dtr as _dtr
from .common import OutOfMemoryError, _weak_method
from .errors import UnsupportedModelError, UsageError
from .store import DEVICE


class EngineBackward:
    """engine.backward() and the error paths the forward shares with it."""

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagates `loss`, scaled for fp16 and divided by the accumulation
        steps (DeepSpeed's engine.backward).

        Args:
            loss: the scalar loss.
            retain_graph: as torch's; a later engine.backward before the step
                is still an error with gradient_accumulation_steps 1.
            scale_wrt_gas: False when the loss is already divided by the
                accumulation steps (the Hugging Face Trainer does that).
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got "
                             f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
        self._refuse_after_disk_failure()
        if self._dp_step is not None:
            self._dp_step.check()
        self._outside.settle_raw_backward()
        # A write since the forward began (nn.Embedding's max_norm, a clamp in a
        # hook) goes into the master before the gradients take the slots.
        self._outside.settle(end_reads=False)
        if not self._accumulation.summing:
            landed = self._wiring.hooks.landed_params()
            if landed:
                raise UsageError(
                    f"engine.backward() called again before engine.step(): the gradients of the "
                    f"last backward ({len(landed)} parameters, e.g. "
                    f"'{self._params.record_list[landed[0]].name}') wait for the step, and "
                    f"gradient_accumulation_steps is 1. Call engine.step() after each backward; "
                    f"to sum several backward passes into one step, set "
                    f"\"gradient_accumulation_steps\" to their number (engine.step() then steps "
                    f"at each boundary); engine.zero_grad() drops the waiting gradients")
        if self._dp_step is not None:
            self._dp_step.begin_backward()
        scale = self.scaler.scale
        if scale_wrt_gas:
            scale = scale / self.config.gradient_accumulation_steps
        scaled = loss.float() * scale if scale != 1.0 else loss
        # (A failed backward that folded gradients early drops the sums where
        # they hold nothing else: below.)
        sums_before = self._accumulation.summing and self._accumulation.has_sums()
        if self._overlap is not None:
            # Only the backward before the step's boundary launches updates.
            self._overlap.begin(self._accumulation.next_backward_ends_window(),
                                global_steps=self.global_steps, loss_scale=self.scaler.scale,
                                host_short=self._host_short(),
                                fold_chunk=_weak_method(self._accumulation.fold_chunk),
                                measure_sums=_weak_method(self._accumulation.measure_chunk),
                                free_sums=_weak_method(self._accumulation.free_sums_of),
                                break_window=_weak_method(self._accumulation.break_window),
                                start_fold=_weak_method(self._accumulation.start_fold),
                                end_fold=_weak_method(self._accumulation.end_fold))
        self._wiring.count(True)
        self._wiring.hooks.set_engine_backward(True)
        try:
            try:
                scaled.backward(retain_graph=retain_graph)
            except RuntimeError as e:
                # Autograd checks gradient shapes against the tensors of the
                # forward: a gradient of shape [0] is a parameter that was read
                # as its empty placeholder, outside the forward of its module.
                text = str(e)
                if "invalid gradient" in text and "got [0]" in text:
                    raise UnsupportedModelError(
                        f"a parameter was used outside the forward of the module that owns it "
                        f"({text}): there it is an empty placeholder, so the forward's result was "
                        f"wrong. tidal brings a module's parameters to the device only while that "
                        f"module runs (Note [Parameters keep their TensorImpl]). Use the parameter "
                        f"through its module (call the module), or move the code that reads it into "
                        f"the owning module's forward") from e
                raise
        except BaseException as e:
            # The error is what the user sees; the slots this backward left in
            # use are released without raising another one over it.
            oom = self._out_of_memory(e, "backward")
            self._wiring.count(False)  # (bringing DTR's tensors back is no step's memory)
            self._release_after_error()
            self.dtr.end(failed=True)
            if self._dp_step is not None:
                # Gradients overwrote weights whose masters other ranks own;
                # only collectives could restore them, and the other ranks are
                # in their own backward (Note [Data parallel by chunk]).
                self._dp_step.mark_broken("a backward on this rank failed")
                raise
            # The gradients this backward landed are dropped (their slots get
            # their weights back; a step on part of them would be wrong);
            # earlier micro-batches' sums stay. Chunks CPU Adam updated
            # meanwhile are taken back (Note [Speculative updates and their
            # undo]); sums it folded early hold part of this backward: they
            # go where they hold nothing else (the window's first backward),
            # and otherwise the window cannot be stepped on.
            if self._overlap is not None:
                why = self._overlap.second_landing_on_taken_chunk(e)
                if why is not None:
                    e.add_note("tidal: " + why)
                self._drop_what_the_overlap_took(e, sums_before)
            self._accumulation.drop_landed()
            if oom is not None:
                raise oom from e
            raise
        finally:
            self._wiring.hooks.set_engine_backward(False)
            self._wiring.count(False)
        try:
            with _dtr.outside():
                self._wiring.hooks.end_backward()
            self.dtr.end()  # Note [DTR belongs to the engine's cycle]
        except BaseException:
            if self._dp_step is not None:  # (the other ranks go on with their reductions)
                self._dp_step.mark_broken("ending a backward on this rank failed")
            raise
        if self._overlap is not None:
            try:
                self._overlap.backward_ended()
            except BaseException as e:
                # A fold on the worker failed (Note [Folds on the worker] in
                # overlap.py): the backward failed, as where the fold ran in
                # its gradient hook.
                self._drop_what_the_overlap_took(e, sums_before)
                self._accumulation.drop_landed()
                raise
        if self._dp_step is not None:
            self._dp_step.after_backward(
                self._accumulation.landed,
                lambda owned: self._accumulation.fold_chunks(owned, self._host_short()))
        elif self._accumulation.summing:
            self._accumulation.fold()
        self._accumulation.backward_done()

    def _drop_what_the_overlap_took(self, e: BaseException, sums_before: bool) -> None:
        """A backward failed (`e`): the overlap's folds and updates of it end
        and are taken back; sums it folded early go where they hold nothing
        else (`sums_before` false: the window's first backward), and
        otherwise the window cannot be stepped on (a note on `e` says so)."""
        self._overlap.backward_ended(failed=True)
        self.settle_overlap()
        if self._overlap.take_sums_measured() or self._overlap.folded_early:
            # (Measured for a step that will not take them: Note
            # [Measured where folded].)
            self._wiring.hooks.clear_grad_norm()
        if self._overlap.folded_early and not sums_before:
            self._accumulation.drop_sums()
        elif self._overlap.folded_early:
            self._accumulation.break_window(
                f"the backward that failed had folded the gradients of "
                f"{len(self._overlap.folded_early)} chunks into their accumulation sums "
                f"(tidal.overlap_step), which now hold part of a failed micro-batch")
            e.add_note("tidal: " + self._accumulation.broken + "; call engine.zero_grad() to "
                       "start the step afresh")

    def _out_of_memory(self, e, phase: str):
        """A tidal.OutOfMemoryError saying what the device held when torch's
        allocator refused an op in `phase` (on the simulated device, the
        budget's hard limit: Note [The simulated device's budget is a hard
        limit] in hooks/host_allocation_counter.h), or None for other errors."""
        if not isinstance(e, torch.OutOfMemoryError) or isinstance(e, OutOfMemoryError):
            return None
        running = [self._params.names.get(self._params.module_list[i], "?") for i in self._wiring.hooks.running()]
        held = self.chunks.held_bytes(DEVICE)
        live = self._wiring.tracer.live()
        what = f"; DTR tracks {_dtr.stats().get('tracked_bytes', 0)} bytes of them" \
            if _dtr.is_enabled() else ""
        return OutOfMemoryError(
            f"tidal: the {phase} ran out of the device budget of {self.store.device_budget} bytes "
            f"(margin {self.store.margin}): {e}. Chunks hold {held} bytes on the device"
            f"{' (modules running: ' + ', '.join(running[-4:]) + ')' if running else ''}; "
            f"activations and other tensors {live} bytes{what}. Use a smaller batch, turn on DTR "
            f"(tidal.dtr) or recompute (activation_checkpointing), or raise "
            f"tidal.device_memory_budget; the engine goes on with the next batch")

    def _release_after_error(self):
        """After a failed forward or backward: every parameter this engine has
        attached goes back to its chunk (HOLD), whatever state the hooks got to.
        The step's partial trace is dropped: the next step records afresh (the
        scheduler's own trace diverges once and is adopted again)."""
        self._wiring.tracer.drop_step()
        with _dtr.outside():
            failed = self._wiring.hooks.release_all()
        for message in failed:  # never mask the error being raised
            warnings.warn(f"tidal: releasing a parameter after an error failed too: {message}",
                          stacklevel=3)
