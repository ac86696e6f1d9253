"""The optimizer step: the gradient norm, clipping and fp16 overflow, Adam per
chunk on the host (cpu_adam, SIMD) or the device (hybrid Adam), the
learning-rate schedule and the relayout after the warm-up step.

A mixin of Engine (engine.py), split from it along its sections; it uses
the engine's attributes set in Engine.__init__."""
from __future__ import annotations

import collections
import math
import time
import warnings

import torch

from .. import dtr as _dtr
from . import param_groups as _param_groups
from .store import (DEVICE, GRAD32, HOST, MOMENTUM, PARAM16, PARAM32, VARIANCE, RelayoutError,
                    uncounted)

from .errors import UsageError


class StepMixin:
    def step(self):
        """The optimizer step, at gradient accumulation boundaries (as DeepSpeed)."""
        self._settle_raw_backward()
        self._step_applied = False
        if self.micro_steps == 0 or not self.is_gradient_accumulation_boundary():
            return
        with self.dtr.weights_change():
            applied = self._step()
        self._step_applied = bool(applied)
        # DeepSpeed's count (managed accumulation, its default): the config's
        # train_batch_size per step, a window set_gradient_accumulation_boundary
        # cut short included.
        self.global_samples += self.train_batch_size() or 0
        # A client LR scheduler (tidal.deepspeed.initialize), after each applied
        # step as DeepSpeed's; last, so a scheduler that raises leaves a step
        # whose bookkeeping is done.
        if applied and self.client_lr_scheduler is not None:
            self.client_lr_scheduler.step()
        return applied

    def _step(self):
        if self._dp_step is not None:
            self._dp_step.check()
        # Parameters still attached from a backward run without
        # engine.backward (loss.backward()), or read outside any forward; and
        # the simulated device's meter, which engine.backward would have
        # stopped.
        self._settle_outside()
        self._count(False)
        accumulating = self._accumulation.summing
        t_exposed = time.perf_counter()
        overlap = self._overlap
        if overlap is not None:
            # Chunks CPU Adam updated while backward went on (Note [CPU Adam
            # during backward]): waited for here; validated below.
            if self._accumulation.broken:
                raise UsageError(f"engine.step(): {self._accumulation.broken}; call engine.zero_grad() "
                                 f"and run this step's micro-batches again")
            overlap.finish()
        pending = self._accumulation.pending()
        # Data parallel: the update runs where the masters are; every rank
        # holds the gradients it reduced into the chunks it owns.
        owned = pending if self.dp is None else [r for r in pending if self.store.owns(r)]
        norm, finite = self._grad_norm(owned)
        scale = self.scaler.scale
        overflow = not finite
        clip = 1.0
        if not overflow and self.config.gradient_clipping > 0:
            clip = min(1.0, self.config.gradient_clipping / (norm + 1e-6))
        # Note [Speculative updates and their undo]: the updates made during
        # backward stand where the step would have made them the same way,
        # and are undone (to be made here) where it clips or skips.
        done = set() if overlap is None else overlap.validate(not overflow and clip == 1.0)
        self._meters.adam_host_chunks += len(done)
        if self.precision == "fp16":
            self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            if not accumulating:  # (folds restored the weights already)
                self._restore_params(owned)
        else:
            dps = self._dp_step
            if dps is None:
                self._adam([r for r in owned if r.chunk not in done] if done else owned, clip / scale)
            else:
                # The all-gather: each chunk's updated 16-bit values from its
                # owner, started as its update ends, while the owners go on
                # with their next chunks.
                try:
                    # (Every chunk is broadcast, those updated during
                    # backward too: after_chunk runs for each of `order`.)
                    self._adam([r for r in owned if r.chunk not in done] if done else owned,
                               clip / scale, order=list(dps.chunks), after_chunk=dps.share)
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
            self.optimizer._opt_called = True
        if self._dp_step is not None and overflow:
            # The owners' weights came back from their masters: the others'
            # from the owners.
            self._dp_step.broadcast(self._dp_step.chunks)
        self._accumulation.stepped(pending, owned)
        self._hooks.clear_grad_norm()
        self._last_grad_norm = norm
        self.global_steps += 1
        self.chunks.end_step()
        self._end_trace_step()
        self._meters.end_step(self.chunks.stats())
        if not self._relayout_done:
            self._relayout()
        return not overflow

    def apply_lr_schedule(self):
        """lr (and OneCycle's betas) for the next step from the LR scheduler's
        position, for every parameter group in proportion (Note [Parameter groups])."""
        if self.lr_scheduler is not None:
            self.lr = self.lr_scheduler.get_lr()
            betas = self.lr_scheduler.get_betas()
            self.betas = betas or self.config.betas
            _param_groups.apply_schedule(self.optimizer.param_groups, self.lr, self.config.lr, betas)

    def _relayout(self):
        """After the warm-up step: chunks in first-use order (Note [Chunks in first-use order])."""
        self._relayout_done = True
        self._hooks.set_track_first_use(False)
        used = [self._params.record_list[i] for i in self._hooks.take_first_use()]
        seen = set(map(id, used))
        order = used + [r for r in self.store.records if id(r) not in seen]
        if [r.id for r in order] == [r.id for r in self.store.records]:
            return  # registration order was already the first-use order
        s = self.chunks.stats()
        state = s["resident_bytes_host"] + s["resident_bytes_device"]
        # The new chunks are filled on the host while the old ones go: only
        # when the whole state fits the host budget beside both schedulers'
        # cached blocks (host_cache_blocks = 4 each, fp32 chunks of up to 2x
        # chunk_size). Otherwise the registration order stays.
        host = self.store.capacity_bytes()[0]
        if state + 16 * self.config.chunk_size > host:
            self.relayout_skipped = (f"the chunk state ({state} bytes) and the blocks of a "
                                     f"rebuild do not fit the host budget of {host} bytes")
            return
        try:
            owner = {}
            for m, recs in self._params.module_records.items():
                for r in recs:
                    owner.setdefault(id(r), id(m))
            final = self.store.relayout(order, [owner.get(id(r)) for r in order])
        except RelayoutError as e:
            warnings.warn(f"tidal: {e}", stacklevel=3)
            return
        # The replaced scheduler's counters (its relayout copies included)
        # stay in the reports.
        self.chunks = self.store.chunks
        self._tracer.set_chunks(self.chunks)
        self._hooks.set_chunks(self.chunks, [r.id for r in self._params.record_list])
        self._params.reorder(self.store.records)
        self._meters.relayout(final, self.chunks.stats())
        self.chunks.reserve_disk()
        self._check_budget()
        self.relayouts += 1

    def _scheduler_stats(self) -> dict:
        """The scheduler's counters, including those of schedulers replaced by relayout."""
        return self._meters.scheduler_stats(self.chunks.stats())

    # ----------------------------------------------------------- optimizer
    def _grad_norm(self, pending) -> tuple[float, bool]:
        """Global L2 norm of the unscaled gradients and whether all are finite."""
        scale = self.scaler.scale
        if self._accumulation.summing:
            # The sums, once, where their chunks are (Note [Gradient sums in
            # chunks]; landings measured nothing).
            index = self._params.record_index
            with uncounted(), _dtr.outside():
                self._hooks.measure_sums([index[id(r)] for r in pending])
        sum_squares, finite = self._hooks.take_grad_norm()
        if self._dp_step is not None:
            # The landings measured this rank's own gradients; the norm is of
            # the reduced ones, each measured by its owner, summed over ranks.
            sum_squares, finite = self._dp_step.global_sum_squares(sum_squares, finite)
        total = math.sqrt(sum_squares) if finite else float("inf")
        return total / scale, finite and math.isfinite(total)

    def _weight_from_master(self, record) -> torch.Tensor:
        """A temporary device tensor holding `record`'s 16-bit weight, made from
        its fp32 master (while its 16-bit slot holds a gradient)."""
        with torch.no_grad(), _dtr.outside(), self.store.slots(record, (PARAM32,), HOST) as (src,):
            return src.to(self.store.torch_device, self.dtype, copy=True)

    def _restore_params(self, records):
        """Gradients overwrote the 16-bit params: copy them back from fp32."""
        with torch.no_grad(), uncounted():
            for r in records:
                if not r.trainable:
                    continue
                with self.store.slots(r, (PARAM16, PARAM32), HOST) as (dst, src):
                    dst.copy_(src)

    def _host_short(self) -> bool:
        """The host budget is too small for the state (Note [One place per chunk])."""
        return self._budget.spilled_floor > 0 or self.chunks.stats()["spills"] > 0

    def _update_on_device(self, chunk: int, kinds, host_short: bool, prefer_device: bool) -> bool:
        """Whether the update of `chunk` (the optimizer step, or a gradient
        fold) runs on the device, where it then needs the chunks of `kinds`
        beside its 16-bit chunk; prefer_device: whenever the device has room
        (else only when the host is too full to take the 16-bit chunk). The
        rule is C++'s, one call (hooks/chunk_step.h, update_on_device)."""
        return self.chunks.update_on_device(chunk, list(kinds), host_short, prefer_device)

    def _adam(self, pending, grad_scale: float, order=None, after_chunk=None):
        """Adam on `pending`'s chunks, one chunk at a time: in `order` when
        given (which may name chunks without pending records), calling
        `after_chunk(chunk)` after each (data parallel: the broadcasts)."""
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
            limit = self.store.device_budget - self.store.margin
            self._tracer.make_room(max(0, limit - self._tracer.live()))
        with torch.no_grad(), uncounted():
            for chunk in sorted(by_chunk) if order is None else order:
                if chunk in by_chunk:
                    self._adam_update(chunk, by_chunk[chunk], grad_scale, kinds, host_short)
                if after_chunk is not None:
                    t1 = time.perf_counter()
                    after_chunk(chunk)
                    outside += time.perf_counter() - t1
        self._meters.adam_seconds += time.perf_counter() - t0 - outside

    def _adam_update(self, chunk, recs, grad_scale: float, kinds, host_short: bool):
        cfg, c = self.config, self.chunks
        for r in recs:
            r.step += 1
        # Note [The step of a chunk in one call] (hooks/chunk_step.h): where
        # it runs, the pins, Adam per group and the releases, in one call.
        groups = [(g["lr"], *g["betas"], g["eps"], g["weight_decay"], [r.id for r in members],
                   [r.step for r in members]) for g, members in self._by_group(recs)]
        space = c.step_chunk(chunk, groups, adamw_mode=cfg.adam_w_mode,
                             bias_correction=cfg.bias_correction, grad_scale=grad_scale,
                             use_sums=GRAD32 in kinds, prefer_device=cfg.hybrid_adam,
                             host_short=host_short, device_simd=self._device_adam_kernel == "simd",
                             num_threads=cfg.cpu_adam_threads, pool=cfg.cpu_adam_pool)
        if space == DEVICE:
            self._meters.adam_device_chunks += 1
        else:
            self._meters.adam_host_chunks += 1
            if self._overlap is not None:
                self._overlap.step_host_chunks.add(chunk)

    def _by_group(self, recs):
        """[(param group, its records among `recs`)] in group order: one
        update call per group of a chunk (Note [Parameter groups])."""
        by_group = collections.defaultdict(list)
        for r in recs:
            by_group[r.group].append(r)
        return [(self.optimizer.param_groups[gi], members) for gi, members in sorted(by_group.items())]
