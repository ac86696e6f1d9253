"""The optimizer step: the gradient norm, clipping and fp16 overflow, Adam per
chunk on the host (cpu_adam, SIMD) or the device (hybrid Adam), the
learning-rate schedule and the relayout after the warm-up step.

OptimizerStep owns the step's state (the counters DeepSpeed's engine
exposes, the loss scaler, the LR schedulers, the relayout's outcome); the
Engine keeps DeepSpeed's names for them as properties that read and write
it (engine.global_steps, engine.lr, ...)."""
from __future__ import annotations

import collections
import math
import time
import warnings
from typing import Callable

import torch

from .. import dtr as _dtr
from . import param_groups as _param_groups
from .errors import UsageError
from .loss_scaler import DynamicLossScaler, StaticLossScaler
from .store import GRAD32, HOST, DEVICE, MOMENTUM, PARAM16, PARAM32, VARIANCE, RelayoutError, uncounted

__all__ = ["OptimizerStep", "by_group"]


def by_group(param_groups: list, recs) -> list:
    """[(param group, its records among `recs`)] in group order: one update
    call per group of a chunk (Note [Parameter groups]); the step's and
    StepOverlap's updates alike.

    Args:
        param_groups: the engine optimizer's param_groups.
        recs: records of one chunk.
    """
    groups = collections.defaultdict(list)
    for r in recs:
        groups[r.group].append(r)
    return [(param_groups[gi], members) for gi, members in sorted(groups.items())]


class OptimizerStep:
    """engine.step(): at an accumulation boundary, the gradient norm over
    the waiting gradients, the clip, the fp16 overflow check and the loss
    scale's update, Adam chunk by chunk (Note [The step of a chunk in one
    call] in hooks/chunk_step.h), the LR schedule, and after the warm-up
    step the relayout into first-use order (Note [Chunks in first-use
    order]). Made by the engine once its hooks, accumulation and data
    parallel exist, one per engine.

    It owns the step's state: global_steps, global_samples, skipped_steps,
    whether the last step was applied and its gradient norm, the loss
    scaler, the LR (lr, betas) and its schedulers (the config's, and a
    client's from tidal.deepspeed.initialize), the relayout's outcome
    (relayouts, relayout_skipped) and which kernel a device update uses
    (device_adam_kernel: "fused", torch's kernel on a GPU, or "simd",
    cpu_adam's over the simulated device's host memory). It writes the
    chunks through the scheduler (read from store.chunks at each use: the
    relayout replaces it), the optimizer's param_groups (the LR schedule),
    the records' step counts, and the meters.

    It holds no reference to the engine: the engine's pieces it calls are
    passed in as callables.

    Args:
        config: the engine's Config.
        store: the ParamStore holding the chunks.
        params: the engine's ParamTable (the relayout reorders it).
        optimizer: the engine's EngineOptimizer (its param_groups).
        lr_scheduler: the config's LR schedule (tidal.lr_schedules), or None.
        accumulation: the engine's GradientAccumulation (the window, the
            gradients waiting for the step).
        hooks: the engine's ModuleHooks (the gradient norm, the first-use
            order, the scheduler the hooks use).
        tracer: the engine's MemoryTracer (room before a host-short step;
            the scheduler it meters).
        meters: the engine's StepMeters.
        dtr: the engine's DtrLink (the step changes the weights).
        overlap: the engine's StepOverlap, or None without tidal.overlap_step.
        dp_step: the engine's ChunkDataParallel, or None without data parallel.
        settle_outside: the engine's OutsideAccess.settle (writes and reads of
            parameters outside a forward go back to their chunks).
        stop_counting: stops the simulated device's meter (HookWiring.count(False)).
        end_trace_step: ends the tracer's step (HookWiring.end_trace_step).
        check_budget: the device-room check, again after the relayout
            (engine._check_budget).
        host_short: whether the host budget is too small for the state
            (engine._host_short; Note [One place per chunk]).
    """

    def __init__(self, *, config, store, params, optimizer, lr_scheduler, accumulation, hooks, tracer,
                 meters, dtr, overlap, dp_step, settle_outside: Callable[[], None],
                 stop_counting: Callable[[], None], end_trace_step: Callable[[], None],
                 check_budget: Callable[[], None], host_short: Callable[[], bool]):
        self._config = config
        self._store = store
        self._params = params
        self._optimizer = optimizer
        self._accumulation = accumulation
        self._hooks = hooks
        self._tracer = tracer
        self._meters = meters
        self._dtr = dtr
        self._overlap = overlap
        self._dp_step = dp_step
        self._settle_outside = settle_outside
        self._stop_counting = stop_counting
        self._end_trace_step = end_trace_step
        self._check_budget = check_budget
        self._host_short = host_short
        # DeepSpeed's LR schedules; stepped after each optimizer step that
        # was not skipped by an fp16 overflow.
        self.lr_scheduler = lr_scheduler
        # deepspeed.initialize's lr_scheduler argument (tidal.deepspeed): a
        # scheduler over the engine's optimizer, stepped after each applied step.
        self.client_lr_scheduler = None
        self.lr, self.betas = config.lr, config.betas
        self.apply_lr_schedule()
        self.global_steps = 0
        self.global_samples = 0  # samples of the steps taken, as DeepSpeed counts them
        self.applied = False
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        if store.precision == "fp16":
            self.scaler = StaticLossScaler(config.loss_scale) if config.loss_scale > 0 else \
                DynamicLossScaler(config.initial_scale_power, config.loss_scale_window,
                                  config.hysteresis, config.min_loss_scale)
        else:
            self.scaler = StaticLossScaler(1.0)
        self._relayout_done = False
        self.relayouts = 0
        self.relayout_skipped: str | None = None
        if dp_step is not None:
            # It would move records between owners (Note [Data parallel by chunk]).
            self._relayout_done = True
            self.relayout_skipped = "data parallel: the chunk layout decides each chunk's owner"
        # The optimizer step of a chunk on the device (hooks/chunk_step.h): torch's
        # fused kernel on a GPU; cpu_adam's SIMD kernel on the simulated
        # device, whose memory is host memory.
        self.device_adam_kernel = "fused" if store.torch_device.type == "cuda" else "simd"

    def step(self):
        """engine.step() once the engine settled a backward the script ran
        itself: at an accumulation boundary after a backward, the update,
        then the sample count and the client's LR scheduler. Returns whether
        the step was applied (None where it did not step)."""
        self.applied = False
        if self._accumulation.micro_steps == 0 or not self._accumulation.is_boundary():
            return
        with self._dtr.weights_change():
            applied = self._run()
        self.applied = bool(applied)
        # DeepSpeed's count (managed accumulation, its default): the config's
        # train_batch_size per step, a window set_gradient_accumulation_boundary
        # cut short included.
        self.global_samples += self._config.train_batch_size or 0
        # A client LR scheduler (tidal.deepspeed.initialize), after each applied
        # step as DeepSpeed's; last, so a scheduler that raises leaves a step
        # whose bookkeeping is done.
        if applied and self.client_lr_scheduler is not None:
            self.client_lr_scheduler.step()
        return applied

    def _run(self):
        if self._overlap is not None and self._accumulation.broken:
            # (Before the settles below, which would fold what broke it.)
            raise UsageError(f"engine.step(): {self._accumulation.broken}; call engine.zero_grad() "
                             f"and run this step's micro-batches again")
        if self._dp_step is not None:
            self._dp_step.check()
        # Parameters still attached from a backward run without
        # engine.backward (loss.backward()), or read outside any forward; and
        # the simulated device's meter, which engine.backward would have
        # stopped.
        self._settle_outside()
        self._stop_counting()
        accumulating = self._accumulation.summing
        overlap = self._overlap
        if overlap is not None:
            # The last step's updates no forward took (Note [CPU Adam under the
            # next forward]; their wait is metered there).
            overlap.settle_deferred()
        t_exposed = time.perf_counter()
        if overlap is not None:
            # Chunks CPU Adam updated while backward went on (Note [CPU Adam
            # during backward]): waited for here; validated below.
            overlap.finish(send_up=True)
        pending = self._accumulation.pending()
        # Data parallel: the update runs where the masters are; every rank
        # holds the gradients it reduced into the chunks it owns.
        owned = pending if self._dp_step is None else [r for r in pending if self._store.owns(r)]
        # (Those whose sums backward measured already: Note [Measured where
        # folded] in overlap.py.)
        early = set() if overlap is None else overlap.take_sums_measured()
        norm, finite = self._grad_norm([r for r in owned if r.chunk not in early] if early else owned)
        scale = self.scaler.scale
        overflow = not finite
        clip = 1.0
        if not overflow and self._config.gradient_clipping > 0:
            clip = min(1.0, self._config.gradient_clipping / (norm + 1e-6))
        # Note [Speculative updates and their undo]: the updates made during
        # backward stand where the step would have made them the same way,
        # and are undone (to be made here) where it clips or skips.
        done = set() if overlap is None else overlap.validate(not overflow and clip == 1.0)
        self._meters.adam_host_chunks += len(done)
        if self._store.precision == "fp16":
            self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            if not accumulating:  # (folds restored the weights already)
                self.restore_params(owned)
        else:
            dps = self._dp_step
            todo = [r for r in owned if r.chunk not in done] if done else owned
            # Note [CPU Adam under the next forward]: the host chunks' updates
            # may run under the next forward.
            defer = overlap is not None and overlap.may_defer(
                global_steps=self.global_steps, data_parallel=dps is not None,
                host_short=self._host_short())
            if dps is None:
                self._adam(todo, clip / scale, defer=defer)
            else:
                # The all-gather: each chunk's updated 16-bit values from its
                # owner, started as its update ends, while the owners go on
                # with their next chunks.
                try:
                    # (Every chunk is broadcast, those updated during
                    # backward too: after_chunk runs for each of `order`.)
                    self._adam(todo, clip / scale, order=list(dps.chunks), after_chunk=dps.share)
                    dps.shared()
                except BaseException as e:
                    dps.mark_broken(f"the step failed part-way ({type(e).__name__})")
                    raise
            self._meters.exposed_adam_seconds += time.perf_counter() - t_exposed
            if overlap is not None and self.global_steps > 0:
                # Hybrid Adam: where this step's chunks were updated is the
                # plan of the next backward (Note [CPU Adam during backward]);
                # not the warm-up step's, which ran without a trace.
                overlap.plan = overlap.step_host_chunks | done
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
                self.apply_lr_schedule()
            # torch's LR schedulers check that the optimizer stepped before
            # them (optimizer.step, wrapped, sets this flag); the engine's step
            # is that step, so a scheduler stepped after it does not warn.
            self._optimizer._opt_called = True
        if overlap is not None:
            overlap.release_held()  # (those of chunks with no update in this step)
        if self._dp_step is not None and overflow:
            # The owners' weights came back from their masters: the others'
            # from the owners.
            self._dp_step.broadcast(self._dp_step.chunks)
        self._accumulation.stepped(pending, owned)
        self._hooks.clear_grad_norm()
        self.last_grad_norm = norm
        self.global_steps += 1
        self._store.chunks.end_step()
        self._end_trace_step()
        self._meters.end_step(self._store.chunks.stats())
        if not self._relayout_done:
            self._relayout()
        # Hybrid Adam's plan for the next step, from the trace as it is now
        # (Note [Where a chunk's Adam runs]).
        if self._tracer.warmed_up:
            self._store.adam_placement.replan(self._tracer.limit, self._tracer.trace)
        return not overflow

    def apply_lr_schedule(self):
        """lr (and OneCycle's betas) for the next step from the LR scheduler's
        position, for every parameter group in proportion (Note [Parameter groups])."""
        if self.lr_scheduler is not None:
            self.lr = self.lr_scheduler.get_lr()
            betas = self.lr_scheduler.get_betas()
            self.betas = betas or self._config.betas
            _param_groups.apply_schedule(self._optimizer.param_groups, self.lr, self._config.lr, betas)

    def _relayout(self):
        """After the warm-up step: chunks in first-use order (Note [Chunks in first-use order])."""
        self._relayout_done = True
        self._hooks.set_track_first_use(False)
        used = [self._params.record_list[i] for i in self._hooks.take_first_use()]
        seen = set(map(id, used))
        order = used + [r for r in self._store.records if id(r) not in seen]
        if [r.id for r in order] == [r.id for r in self._store.records]:
            return  # registration order was already the first-use order
        s = self._store.chunks.stats()
        state = s["resident_bytes_host"] + s["resident_bytes_device"]
        # The new chunks are filled on the host while the old ones go: only
        # when the whole state fits the host budget beside both schedulers'
        # cached blocks (host_cache_blocks = 4 each, fp32 chunks of up to 2x
        # chunk_size). Otherwise the registration order stays.
        host = self._store.capacity_bytes()[0]
        if state + 16 * self._config.chunk_size > host:
            self.relayout_skipped = (f"the chunk state ({state} bytes) and the blocks of a "
                                     f"rebuild do not fit the host budget of {host} bytes")
            return
        try:
            owner = {}
            for m, recs in self._params.module_records.items():
                for r in recs:
                    owner.setdefault(id(r), id(m))
            final = self._store.relayout(order, [owner.get(id(r)) for r in order])
        except RelayoutError as e:
            warnings.warn(f"tidal: {e}", stacklevel=4)  # (the frame of Engine.step)
            return
        # The store holds the new scheduler (engine.chunks reads it there);
        # the replaced one's counters (its relayout copies included) stay in
        # the reports.
        chunks = self._store.chunks
        self._tracer.set_chunks(chunks)
        self._hooks.set_chunks(chunks, [r.id for r in self._params.record_list])
        self._params.reorder(self._store.records)
        self._meters.relayout(final, chunks.stats())
        chunks.reserve_disk()
        self._check_budget()
        self.relayouts += 1

    # ----------------------------------------------------------- optimizer
    def _grad_norm(self, pending) -> tuple[float, bool]:
        """Global L2 norm of the unscaled gradients and whether all are finite."""
        scale = self.scaler.scale
        if self._accumulation.summing:
            # The sums where their chunks are (Note [Gradient sums in
            # chunks]; landings measured nothing), but those the window's last
            # backward measured at their fold (Note [Measured where folded]).
            with uncounted(), _dtr.outside():
                self._hooks.measure_sums(self._params.indexes(pending))
        sum_squares, finite = self._hooks.take_grad_norm()
        if self._dp_step is not None:
            # The landings measured this rank's own gradients; the norm is of
            # the reduced ones, each measured by its owner, summed over ranks.
            sum_squares, finite = self._dp_step.global_sum_squares(sum_squares, finite)
        total = math.sqrt(sum_squares) if finite else float("inf")
        return total / scale, finite and math.isfinite(total)

    def restore_params(self, records):
        """Gradients overwrote the 16-bit params of `records`: copy them back
        from fp32 (the trainable ones; the masters must be this rank's)."""
        with torch.no_grad(), uncounted():
            for r in records:
                if not r.trainable:
                    continue
                with self._store.slots(r, (PARAM16, PARAM32), HOST) as (dst, src):
                    dst.copy_(src)

    def _adam(self, pending, grad_scale: float, order=None, after_chunk=None, defer: bool = False):
        """Adam on `pending`'s chunks, one chunk at a time: in `order` when
        given (which may name chunks without pending records), calling
        `after_chunk(chunk)` after each (data parallel: the broadcasts).
        defer: the chunks updated on the host go to the worker, to run under
        the next forward (Note [CPU Adam under the next forward])."""
        by_chunk = collections.defaultdict(list)
        for r in pending:
            by_chunk[r.chunk].append(r)
        t0 = time.perf_counter()
        outside = 0.0
        # The chunks the update needs beside the 16-bit one.
        kinds = (PARAM32, MOMENTUM, VARIANCE) + ((GRAD32,) if self._accumulation.summing else ())
        host_short = self._host_short()
        if self._overlap is not None:
            self._overlap.step_host_chunks = set()
        if host_short:
            # A host too small for the state (Note [One place per chunk]): the
            # step needs device room to move chunks through, and forward and
            # backward are over, so chunks may use what live tensors leave.
            # (Not otherwise: the budget of backward's last point already
            # plans for the next step's first interval.)
            limit = self._store.device_budget - self._store.margin
            self._tracer.make_room(max(0, limit - self._tracer.live()))
        with torch.no_grad(), uncounted():
            for chunk in sorted(by_chunk) if order is None else order:
                if chunk in by_chunk:
                    self._adam_update(chunk, by_chunk[chunk], grad_scale, kinds, host_short, defer)
                if after_chunk is not None:
                    t1 = time.perf_counter()
                    after_chunk(chunk)
                    outside += time.perf_counter() - t1
        self._meters.adam_seconds += time.perf_counter() - t0 - outside

    def _adam_update(self, chunk, recs, grad_scale: float, kinds, host_short: bool, defer: bool = False):
        cfg, c = self._config, self._store.chunks
        prefer_device = self._store.adam_placement.prefer_device(chunk, GRAD32 in kinds)
        for r in recs:
            r.step += 1
        if defer and not c.update_on_device(chunk, list(kinds), host_short, prefer_device):
            # Note [CPU Adam under the next forward]: where step_chunk would
            # update it (the host), on the worker, after this step returns.
            try:
                self._overlap.defer(chunk, recs, grad_scale, sums=GRAD32 in kinds)
            except BaseException:
                for r in recs:
                    r.step -= 1
                raise
            if GRAD32 in kinds:
                # Its sums are the update's now (a step failing later must
                # not update the chunk again: Note [Measured where folded]).
                self._hooks.hand_over_sums(self._params.indexes(recs))
            self._meters.adam_host_chunks += 1
            self._overlap.step_host_chunks.add(chunk)
            return
        if self._overlap is not None:
            # (A chunk left to the step pinned at its landing: Note [Left to
            # the step, pinned as if launched] in overlap.py.)
            self._overlap.release_held([chunk])
        # Note [The step of a chunk in one call] (hooks/chunk_step.h): where
        # it runs, the pins, Adam per group and the releases, in one call.
        groups = [(g["lr"], *g["betas"], g["eps"], g["weight_decay"], [r.id for r in members],
                   [r.step for r in members])
                  for g, members in by_group(self._optimizer.param_groups, recs)]
        space = c.step_chunk(chunk, groups, adamw_mode=cfg.adam_w_mode,
                             bias_correction=cfg.bias_correction, grad_scale=grad_scale,
                             use_sums=GRAD32 in kinds,
                             prefer_device=prefer_device,
                             host_short=host_short, device_simd=self.device_adam_kernel == "simd",
                             num_threads=cfg.cpu_adam_threads, pool=cfg.cpu_adam_pool,
                             # (torch's fused kernel on a GPU: its fp32 temporaries
                             # within half the margin, whatever the activations leave)
                             max_temporary_bytes=self._store.margin // 2)
        if space == DEVICE:
            self._meters.adam_device_chunks += 1
        else:
            self._meters.adam_host_chunks += 1
            if self._overlap is not None:
                self._overlap.step_host_chunks.add(chunk)
