"""CPU Adam during backward (issue 32): tidal.overlap_step.

Note [CPU Adam during backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Without it the optimizer step starts when backward has ended, so the whole
CPU Adam time is added to each step: the most common complaint of offload
users. With "tidal": {"overlap_step": true}, a chunk's update starts as soon
as backward has landed the gradient of every trainable tensor it holds (the
per-chunk readiness the data-parallel overlap tracks too), on a worker
thread, while backward goes on; engine.step() waits for the updates still
running and updates the rest (chunks with a tensor that got no gradient,
chunks updated on the device) as before.

The worker touches no scheduler: at launch, on the thread that landed the
last gradient, the chunk's 16-bit, master, momentum and variance chunks are
pinned on the host (accessed: COMPUTE, so their payloads cannot move) and the
worker runs cpu_adam's adam_chunk_step over raw chunk views (the GIL is
released inside); the step, or the next forward, waits for it and releases
the pins. Only chunks the step would update on the host are launched (hybrid
Adam keeps device chunks for the step), and none while the host is too small
for the state (Note [One place per chunk]).

The semantics, chosen so that the math is the step's own: the update of a
chunk needs nothing but its own gradients only when nothing global decides
the step. So overlap_step refuses (a ConfigError at initialize)
gradient_clipping > 0 and fp16 (both need the global norm or the overflow
check of every gradient first), gradient accumulation (the sums of later
micro-batches), DTR and recompute (a replay in backward could read a weight
an update already changed) and data parallel (each chunk's update waits for
its reduction). Under these rules the weights are those of the step without
overlap, bit for bit (tests/python/test_step_overlap.py, and against
torch.optim.AdamW). What differs, and the docs say so:
  * a non-finite gradient (bf16, fp32) is applied as torch.optim.AdamW applies
    it; without overlap the engine skips such a step;
  * a backward that fails after some chunks were updated leaves those
    updates (and their step counts); without overlap it leaves the last good
    step;
  * a forward between backward and step (an evaluation) sees the new weights
    of the chunks already updated (it waits for them first), and
    engine.zero_grad() after backward cannot take back an update.
"""
from __future__ import annotations

import collections
import concurrent.futures
import time
import weakref

from .. import _C
from .. import dtr as _dtr
from .store import HOLD, HOST, MOMENTUM, PARAM16, PARAM32, VARIANCE

_KINDS = (PARAM16, PARAM32, MOMENTUM, VARIANCE)


class StepOverlap:
    """Launches each chunk's CPU Adam as its last gradient lands (Note [CPU
    Adam during backward]); the engine calls begin() before a backward,
    landed() from the gradient hook, backward_ended() after it, and finish()
    before the step or a forward."""

    def __init__(self, engine):
        # Weakly: the worker must never outlive the chunks it reads, so a
        # collected engine first waits for it (_abandon, called as the engine
        # goes, before its chunks do); a strong reference would make the
        # engine wait for a cycle collection instead.
        self._engine_ref = weakref.ref(engine)
        weakref.finalize(engine, self._abandon)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-adam")
        self._waiting: dict[int, int] = {}  # chunk -> gradients it still waits for
        self._landed_ids: set[int] = set()    # tensors whose gradient landed in this backward
        self._recs: dict[int, list] = {}     # chunk -> its trainable records
        self._jobs: list[tuple[int, object, list]] = []  # (chunk, future, records)
        self._pinned: list[tuple[int, int]] = []         # (tensor id, chunk kind)
        self._backward_end = None
        self._host_short = False
        self.done: set[int] = set()  # chunks updated since the last step
        # Totals over the run (memory_report()["optimizer"]).
        self.launched_chunks = 0
        self.worker_seconds = 0.0      # CPU Adam on the worker
        self.overlapped_seconds = 0.0  # of which before backward ended

    @property
    def _engine(self):
        return self._engine_ref()

    # ------------------------------------------------------------ backward
    def begin(self):
        """Before a backward: each chunk waits for the gradients of its trainable tensors."""
        e = self._engine
        recs = collections.defaultdict(list)
        for r in e.records:
            if r.trainable and e.store.owns(r):
                recs[r.chunk].append(r)
        self._recs = dict(recs)
        # DTR turned on by hand (tidal.dtr.enable(); the config's is refused):
        # a replay in backward could read weights already updated, so no
        # chunk is updated during this backward.
        self._waiting = {} if _dtr.is_enabled() else {chunk: len(rs) for chunk, rs in recs.items()}
        self._landed_ids = set()
        self._backward_end = None
        # A host too small for the state (Note [One place per chunk]): the
        # step makes room first, so nothing is launched in this backward.
        self._host_short = e._host_short()

    def landed(self, record):
        """A gradient landed (trainable records only): counted once per
        parameter, so a second landing (a reentrant checkpoint in the model,
        Note [Weights while gradients wait]) cannot start its chunk before
        the others' gradients are in. Once the chunk's update started, a
        second use of the parameter in that backward finds its master chunk
        in use (COMPUTE) and fails there, naming the tensor."""
        if record.id in self._landed_ids:
            return
        self._landed_ids.add(record.id)
        left = self._waiting.get(record.chunk)
        if left is None:
            return
        left -= 1
        self._waiting[record.chunk] = left
        if left == 0:
            del self._waiting[record.chunk]
            self._launch(record.chunk)

    def backward_ended(self):
        self._backward_end = time.perf_counter()
        self._waiting = {}

    def _launch(self, chunk: int):
        e = self._engine
        cfg, c = e.config, e.chunks
        if self._host_short or e._update_on_device(chunk, (PARAM32, MOMENTUM, VARIANCE), False,
                                                   cfg.hybrid_adam):
            return  # the step updates it (on the device, or with room made first)
        recs = self._recs[chunk]
        first = recs[0]
        pinned = []
        try:
            for kind in _KINDS:
                c.access(first.id, kind, HOST, [first.numel])
                pinned.append((first.id, kind))
        except BaseException:
            for tid, kind in pinned:
                c.release(tid, kind, HOLD)
            raise
        self._pinned.extend(pinned)
        views = [c.chunk_view(chunk, k) for k in (PARAM32, MOMENTUM, VARIANCE, PARAM16)]
        for r in recs:
            r.step += 1
        calls = []
        for group, members in e._by_group(recs):
            b1, b2 = group["betas"]
            calls.append(dict(ranges=[(c.placement(r.id)[1], r.numel) for r in members],
                              step=[r.step for r in members], lr=group["lr"], beta1=b1, beta2=b2,
                              eps=group["eps"], weight_decay=group["weight_decay"],
                              adamw_mode=cfg.adam_w_mode, bias_correction=cfg.bias_correction,
                              loss_scale=1.0, max_grad_norm=0.0, check_overflow=False,
                              num_threads=cfg.cpu_adam_threads, pool=cfg.cpu_adam_pool))
        self._jobs.append((chunk, self._pool.submit(_run, views, calls), recs))
        self.launched_chunks += 1

    # ---------------------------------------------------------------- step
    def finish(self) -> set:
        """Waits for every launched update and releases the pins; returns the
        chunks updated since the last step (also in self.done). Raises the
        first error a worker met, after every pin is released."""
        error = None
        end = self._backward_end
        for chunk, future, _recs in self._jobs:
            try:
                t0, t1 = future.result()
            except BaseException as ex:  # noqa: BLE001 (re-raised below)
                error = error or ex
                continue
            self.worker_seconds += t1 - t0
            if end is not None:
                self.overlapped_seconds += max(0.0, min(t1, end) - t0)
            else:  # a forward or an error before backward ended: all of it overlapped
                self.overlapped_seconds += t1 - t0
            self.done.add(chunk)
        self._jobs = []
        c = self._engine.chunks
        for tid, kind in self._pinned:
            c.release(tid, kind, HOLD)
        self._pinned = []
        if error is not None:
            raise error
        return self.done

    def take_done(self) -> set:
        done, self.done = self.finish(), set()
        return done

    def _abandon(self):
        """The engine is going: wait for the worker (its chunks are still
        there), forget the pins with the chunks, stop the thread."""
        for _chunk, future, _recs in self._jobs:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 (nobody is left to tell)
                pass
        self._jobs, self._pinned = [], []
        self._pool.shutdown(wait=False)


def _run(views, calls):
    """On the worker: cpu_adam over one chunk, one call per parameter group."""
    t0 = time.perf_counter()
    w, m, v, h = views
    for kw in calls:
        _C.cpu_adam.adam_chunk_step(w, m, v, h, **kw)
    return t0, time.perf_counter()
