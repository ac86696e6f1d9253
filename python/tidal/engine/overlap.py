"""CPU Adam during backward (issues 32 and 43): tidal.overlap_step.

Note [CPU Adam during backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Without it the optimizer step starts when backward has ended, so the whole
CPU Adam time is added to each step: the most common complaint of offload
users. With "tidal": {"overlap_step": true} (the default), a chunk's update
starts as soon as backward has landed the gradient of every trainable tensor
it holds, on a worker thread, while backward goes on; engine.step() waits for
the updates still running, validates them (Note [Speculative updates and
their undo]) and updates the rest (chunks with a tensor that got no gradient,
chunks updated on the device) as before.

The worker touches no scheduler: at launch, on the thread that landed the
last gradient, the chunk's 16-bit, master, momentum and variance chunks (and
with accumulation its fp32 gradient sums) are pinned on the host by the
store (ParamStore.pin: accessed, COMPUTE, so their payloads cannot move) and
the worker, a thread of tidal's that never takes the GIL (Note [The worker
without the GIL] in cpu_adam/update_worker.h), runs cpu_adam's
adam_chunk_step over raw chunk views; the step, or whatever else needs the
chunks first, waits for it and releases the pins. An update done while backward goes on has its
pins released at a later landing, and its new 16-bit weights start up then
(Note [Weights up as they are updated]).
None is launched while the host is too small for the state (Note [One place
per chunk]).

Which chunks (hybrid Adam). The step updates a chunk on the device when its
16-bit chunk is there with room for the rest at the end of backward, and on
the host otherwise. At a gradient's landing the chunk is usually still on the
device (backward just wrote it), so asking where it is now would send nearly
every chunk to the step. The access sequence repeats every step, so where a
chunk was updated in the last step is where it will be at the end of this
backward: before each backward the plan is the set of chunks the last step
updated on the host (during backward or after it), and exactly those are
launched, moved to the host at their landing (the copy their eviction makes
later anyway). The device's Adam takes the rest in the step; moving the
planned chunks early only leaves it more room, so the plan is stable. Until
a step has been recorded (the warm-up step, which runs without a trace,
does not count; nor do steps before a relayout renumbers the chunks)
nothing is launched: the step decides, as without overlap, and its choice
becomes the plan. (Deciding at the landing instead
sends every chunk to the host, since none is known to have room then, and
the device's share is lost for good.) On the simulated device both spaces
run the same SIMD kernel, so the weights are bitwise those of the step
without overlap; on a GPU a chunk's space decides which kernel (cpu_adam or
torch's fused Adam) updates it, as hybrid Adam always did.

Gradient accumulation: only the last micro-batch's backward (the one before
the boundary the step consumes) launches updates; at a chunk's last landing
its gradients are folded into their fp32 sums on the host (on the hook's
thread, the fold the end of backward would make) and the worker updates from
the sums.

Two facts, two owners. ModuleHooks (hooks/module_hooks.h) owns whether a
parameter's 16-bit slot holds a gradient (`landed`: set by its landing,
cleared by a fold, the step or a drop; the step, the guards and DTR's
replays ask it). This object owns a count of the backward running: how many
of a chunk's trainable tensors have not had their first landing in this
backward yet (`_waiting`, from the set `_counted`), made at begin() and
spent when the chunk launches. They differ where it matters: a second
backward before the step without accumulation (its gradients add to the
first's in the slots) finds `landed` already set, so the C++ flag cannot
tell the first landing of this backward from a later one, and a chunk
would launch before its other tensors' gradients are in; and the hook that
counts runs after the landing, when the flag is set whichever it was. Nor is the
count a C++ fact: it exists only for the launch, which is Python's (the
plan, the undo buffers, the worker).

A parameter used again after its gradient landed (a reentrant checkpoint
replays it, Note [Weights while gradients wait]) lands twice; its chunk's
update would race the replay. The engine's first backward launches nothing
and notes such parameters; from then on their chunks wait for the step. (A
graph that starts to do so later finds the chunk's master in use and fails,
naming the tensor, while the update runs; where its pins were let go
already, or the chunk was not pinned, the step undoes the update and makes
it itself.)

Data parallel (Note [Data parallel by chunk] in tidal/data_parallel.py): a
landing is one rank's gradient, not the chunk's; the sum over the ranks is
final when the chunk's reduction lands on its owner. So the owner launches
a chunk there (ChunkDataParallel._finish calls reduced()), during backward with
overlap_comm and right after it without; the step updates the owner's other
chunks and broadcasts every chunk, those updated during backward included,
in the same order on every rank. The global norm and the fp16 overflow are
the ranks' together, so every rank validates or undoes alike. Not with
gradient accumulation: there the end of backward folds the owners' reduced
gradients into their sums and broadcasts the weights back
(ChunkDataParallel.after_backward), which an update in flight would race; nothing is
launched.

What stays out, and why (a ConfigError when tidal.overlap_step is set to
true; with the default, the step is not overlapped and
memory_report()["optimizer"]["overlap_step_off"] says why; the config
decides, tidal/config.py): DTR. Recompute is in:
  * Recompute (tidal.recompute, and torch.utils.checkpoint with
    use_reentrant=False in a model) runs in the one autograd graph: a
    segment is recomputed when backward first unpacks one of its saved
    tensors, before any node of the segment runs backward, and a weight's
    gradient lands once, after the backward of all its uses. So no
    recompute reads a weight whose gradient has landed, and a chunk is
    launched only when all its gradients have: the order alone makes the
    overlap exact (test_step_overlap.py checks it bit for bit for
    checkpoints in a model, a weight in two segments included, and for
    tidal.recompute from the config, offloaded or not).
  * DTR replays single ops, in whatever order its evictions ask, and a
    replay may read a weight whose gradient has landed: a tensor that
    depends on the weight through no gradient (an integer index, a mask, a
    detached value) can be needed by a backward node that runs after the
    weight's uses did (a mixture-of-experts router's top-k indices, needed
    by the dispatch's backward after the router's gradient landed). Its
    chunk is pinned on the host and its master under update then: the
    replay would fail on the pin or read a master being rewritten. Which
    replays happen depends on what was evicted, which changes from step to
    step, so no plan from an earlier backward can tell; making it exact
    needs the replay to wait for and undo that chunk's update before it
    reads.
tidal.dtr turned on by hand updates nothing during the backwards it covers.

Note [Speculative updates and their undo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Gradient clipping and the fp16 overflow check need every gradient before any
update: the clip factor is min(1, max_norm / (norm + 1e-6)) of the global
norm, and an overflow skips the step. A chunk's update during backward is
therefore a speculation that the clip will not fire (factor exactly 1.0) and
that every gradient is finite; it uses the step's own grad scale (1 / loss
scale), so where the speculation holds the result is the step's, bit for
bit. Before it updates a chunk the worker copies what the update overwrites
(the span of the chunk's trainable tensors in the master, momentum, variance
and 16-bit chunks: the 16-bit slot holds the gradient, or with accumulation
the weights) into undo buffers. engine.step() validates: where the clip
fires or a gradient is not finite, each speculative update is undone (the
buffers copied back, the steps counted back) and the step goes on as the
step without overlap does, from the same bits, so a clipped step too equals
the non-overlapped one. Anything else that needs the chunks between backward
and step (a forward, zero_grad, a checkpoint, a state_dict, a failed
backward) undoes them the same way: an update counts only once a step has
validated it.

An undone update costs the step more than no speculation: the copy back,
in the step, reads and writes as many bytes as Adam itself (the master,
both moments and the 16-bit slot), and then the step updates the chunk
anyway. Nor can the update be made right without an undo: the clip
factor scales the gradient inside both moments (v takes its square), and it
is known only when the last gradient has landed. So speculation is predicted: a backward speculates only when
the last step neither clipped nor overflowed (steps that clip tend to come
in runs, early in training or at a loss spike; an fp16 overflow lowers the
scale, and the next step usually passes). The backward after a step that
clipped updates nothing and its step updates every chunk, as without
overlap (test_step_overlap.py checks both, step by step). Counted in
memory_report()["optimizer"]: chunks_updated_during_backward,
undone_chunk_updates, steps_not_speculated.

The cost is host memory: undo buffers as large as the spans of the chunks
updated during backward (14 bytes per parameter with 16-bit weights and
fp32 moments, 16 in fp32), kept from step to step so the copies run on
mapped pages (memory_report()["optimizer"]["overlap_undo_bytes"]). A chunk
whose buffers would not fit the host budget beside the chunks it holds is
left to the step.

Note [Speculation while backward lasts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The undo copy is not free in time either: it is a memcpy of 14 bytes per
parameter whose stores read each destination line first, so it moves more
bytes than the update it protects (on the 2-core machine, 16.8M parameters:
the copy 29 ms, the update 15 ms, on one thread or two). A speculative
update therefore costs about three plain ones of the memory bandwidth CPU
Adam is bound by, which pays only while backward hides it. Where CPU Adam
takes longer than backward (a GPU's backward is short, the host's CPU Adam
long), updates launched late in backward end after it, and the step waits
for their triple cost, where the same updates left to the next forward
(Note [CPU Adam under the next forward]) cost one and run under it.
So where the step may leave its host updates to the next forward
(may_defer), a chunk whose gradients are all in is launched only if its
speculative update, started behind the worker's unfinished ones, ends
before backward does, by the last step's measures: each chunk's last
speculative update time on the worker, and how long the last speculating
backward went on after the chunk's landing. A chunk without both measures
is launched (and so measured), and so is every chunk where the last
speculating step's worker waited for the gradients' copies down longer
than it updated: the link binds there, each update ends as its copy
lands, hidden behind the next copy, and its weights go up beside the
copies down while the step waits (Note [Weights up as they are updated]);
deferring them put those copies up into the next forward, which then
waited for most of the link time (1 MB/s in test_engine_offload_shape.py:
two of four steady steps took 1.5 s against 0.87). The others are left
to the step, which knows the clip factor and needs no undo
(memory_report()["optimizer"]["chunks_left_to_the_step_by_cost"]) and
hands them to the worker to run under the next forward; with gradient
accumulation too, in the window's last backward, the sums measured at the
fold (Note [Measured where folded]). Not with overlap_next_forward false
or data parallel, where every chunk is launched as before. (With
accumulation, an earlier try left the chunks to the step to be folded by
the end of backward and updated by the step itself: steady steps moved up
to 1.37x the minimum and departed from the trace wherever the rule's
decisions changed.) The
measures come from this machine's own timing, so which chunks speculate
may change from step to step; either way the weights are the step's bit
for bit.

Note [CPU Adam under the next forward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What backward could not hide (every host chunk when the clip fires, the
speculation being off then; otherwise the chunks whose gradients landed
last) the step would run while the script waits in engine.step(). With
tidal.overlap_next_forward (the default, with overlap_step) the step, once
it has the clip factor, computes each device chunk's update itself and
hands each host chunk's to the worker in chunk order, which is the next
forward's order (Note [Chunks in first-use order]), then returns. Each
launched chunk is pinned on the host (its 16-bit, master and moment chunks,
accessed in the order step_chunk accesses them, so the trace is the step's)
and the worker runs cpu_adam over it with the step's own arguments
(loss_scale = 1 / grad_scale, grad_scale = clip / loss scale): the weights
are the step's bit for bit.

A global forward pre-hook (torch's register_module_forward_pre_hook, which
runs before every module's own hooks, installed while any update is out)
makes the next forward wait where it must: before a module's own hooks
attach its parameters, the updates of its parameters' chunks are waited for
and their pins released, and every finished update's pins are released too,
in order, so the scheduler's prefetch (blocked at the first pinned chunk)
moves each chunk up as soon as its update is done, while the forward
computes on the chunks before it. A parameter read from outside its module
(Note [External parameters]) waits for its chunk the same way. Anything
else that needs the chunks (a backward, the step, zero_grad, a state_dict,
a checkpoint, a read of a parameter outside a forward, remove_hooks) waits
for every update first: nothing sees a chunk between its step and its
update. The time the forward waited counts as exposed CPU Adam.

With gradient accumulation each update reads its chunk's fp32 sums, which
the step hands over (pinned with the chunk; no longer counted as sums) and
whose memory goes once the update is done.
Not under data parallel (the step broadcasts each chunk as its update ends),
nor with DTR, nor while the host is short (Note [One place per chunk]), nor
with the NVMe tier (every host-updated chunk would be pinned on the host at once,
read from disk, where the step takes them one at a time within a host
budget that holds a few), nor before a step has been recorded for the
layout: there the step updates every chunk itself, as before.
"""
from __future__ import annotations

import collections
import os
import time
import weakref

import torch

from .. import _C
from .. import dtr as _dtr
from .errors import UsageError
from .optimizer_step import by_group
from .store import DEVICE, GRAD32, HOST, MOMENTUM, PARAM16, PARAM32, VARIANCE, uncounted

_KINDS = (PARAM16, PARAM32, MOMENTUM, VARIANCE)
# What an update overwrites, in the order of the worker's views and of the undo buffers.
_UNDO_KINDS = (PARAM32, MOMENTUM, VARIANCE, PARAM16)
# With accumulation, a chunk sent down at its last landing is folded (and
# launched) this many chunks' launches later (Note [Gradients down as they land]).
_FOLD_LAG = 2


class StepOverlap:
    """Launches each chunk's CPU Adam as its last gradient lands, as a
    speculation the step validates or undoes (Notes [CPU Adam during
    backward], [Speculative updates and their undo]); the engine calls
    begin() before a backward, landed() from the gradient hook (under data
    parallel reduced() when a chunk's reduction lands on its owner),
    backward_ended() after it, validate() in the step and undo() before
    anything else that needs the chunks.

    It holds no reference to the engine. What it reads for good is given at
    construction; what a backward decides with (the steps taken, the loss
    scale, whether the host is short, the accumulation's fold) is given to
    begin(). The worker must never outlive the chunks it reads: the engine
    registers abandon_with(engine) (a weakref.finalize of the worker alone),
    so a collected engine first waits for it, before its chunks go.

    Args:
        store: the ParamStore (its pins, and the scheduler, read from
            store.chunks at each use: a relayout replaces it).
        params: the engine's ParamTable (the records in chunk order).
        config: the engine's Config.
        optimizer: the engine's EngineOptimizer (its param_groups).
        data_parallel: whether the engine runs data parallel (a landing is
            then not final: reduced() launches).
    """

    def __init__(self, store, params, config, optimizer, data_parallel: bool):
        self._store = store
        self._params = params
        self._config = config
        self._optimizer = optimizer
        self._data_parallel = data_parallel
        self._fold_chunk = None  # the accumulation's fold, from begin()
        self._measure_sums = None  # its measure of one chunk's sums, from begin()
        self._free_sums = None  # its free of handed-over sums, from begin()
        self._break_window = None  # its break_window, from begin()
        self._threads = worker_threads(config.cpu_adam_threads)  # Note [The worker leaves a core]
        # Its host work is never the simulated device's (Note [tidal's own
        # host allocations]); it never takes the GIL (Note [The worker
        # without the GIL] in cpu_adam/update_worker.h).
        self._pool = _C.cpu_adam.UpdateWorker()
        self._waiting: dict[int, int] = {}  # chunk -> gradients it still waits for
        self._all_landed = self._launch  # what a chunk whose gradients are all in gets (begin())
        self._counted: set[int] = set()  # tensors whose first landing in this backward was counted
        self._in_backward = False  # between begin() and backward_ended(): an engine.backward
        self.raw_backward_refused = False  # landed() stopped a backward the script ran itself
        self._recs: dict[int, list] = {}     # chunk -> its trainable records
        self._chunk_records: dict[int, list] = {}  # chunk -> all its records (begin())
        self._jobs: list[tuple[int, _Job]] = []  # (chunk, job); cleared, never replaced
        self._pinned: list = []  # the launched chunks' pins (store.SlotPin), released by finish()
        # Note [Weights up as they are updated]: each job's pin, in _jobs'
        # order; the jobs before _ahead_from have had theirs released.
        self._job_pins: list = []
        self._ahead_from = 0
        self._ahead = False  # this backward sends finished chunks up
        self._backward_end = None
        self._speculating = False  # this backward (and its reductions) may launch updates
        self._window_end = False  # this backward is the last of its accumulation window
        self._host_short = False
        self._grad_scale = 1.0
        self._use_sums = False
        # chunk -> (records, lo, hi, hyperparameters): updated speculatively,
        # not yet validated (Note [Hyperparameters written before the step]).
        self._pending: dict[int, tuple[list, int, int, tuple]] = {}
        # chunk -> undo buffers (Note [Speculative updates and their undo]).
        self._undo: dict[int, list] = {}
        self._layout = None  # the scheduler the plan and the buffers are for
        # Hybrid Adam: the chunks the last step updated on the host (None: no
        # step recorded for this layout yet).
        self.plan: set[int] | None = None
        self.step_host_chunks: set[int] = set()  # filled by the step
        self._last_invalid = False  # the last step clipped or overflowed
        self.folded_early: set[int] = set()  # chunks whose sums this backward folded
        # Note [Measured where folded]: chunks whose final sums this backward
        # measured for the step's norm.
        self.sums_measured: set[int] = set()
        # Records whose gradient landed twice in one backward (Note [Weights
        # while gradients wait]): their chunks wait for the step.
        self._relanded: set = set()
        # Totals over the run (memory_report()["optimizer"]).
        self.launched_chunks = 0
        self.grads_sent_down_early = 0  # Note [Gradients down as they land]
        self.weights_sent_up_early = 0  # Note [Weights up as they are updated]
        self.weights_sent_up_at_step = 0  # the same, while the step waits (finish())
        self._fold_queue: list[int] = []  # launched chunks whose fold waits for their copy
        # Note [Folds on the worker]: (chunk, job) of the folds on the worker,
        # in submission order, and their StartedFold, in the same order.
        self._fold_jobs: list[tuple[int, _Job]] = []
        self._folds_started: list = []
        # The window's last backward: chunks folded on the worker whose
        # measure and launch wait (_measure_and_start).
        self._measure_queue: list[int] = []
        # Note [Measured in the fold]: chunk -> its fold of the window's last
        # backward that ended having measured its sums, until its measure.
        self._measured_folds: dict = {}
        self._start_fold = None  # the accumulation's start_fold, from begin()
        self._end_fold = None    # its end_fold
        self.folds_on_worker = 0       # folds made during backward on the worker
        self.sums_measured_in_folds = 0  # chunks whose sums' measure their fold made (Note [Measured in the fold])
        self.fold_worker_seconds = 0.0  # their passes' time there
        self.fold_wait_seconds = 0.0   # the engine's thread's wait for them (backward's end)
        self.undone_chunks = 0
        self.steps_not_speculated = 0
        self.worker_seconds = 0.0      # CPU Adam on the worker, undone updates included
        self.overlapped_seconds = 0.0  # of which before backward ended
        self.undo_bytes = 0
        # Note [CPU Adam under the next forward]: chunk -> (job, pins, sums),
        # in launch order; the jobs also in a list the finalizer waits on;
        # the global forward pre-hook's handle while any is out.
        self._deferred: dict[int, tuple] = {}
        self._deferred_jobs: list = []
        self._hook_box: list = [None]
        self.deferred_chunks = 0          # chunk updates run under a next forward
        self.deferred_wait_seconds = 0.0  # what those forwards (or others) waited for them
        # Updates the thread waiting for them ran itself, the worker not having
        # started them (Note [A waiter runs the job itself] in cpu_adam/update_worker.h).
        self.run_by_waiter = 0
        # Note [Speculation while backward lasts]: chunk -> the seconds its
        # last speculative update took on the worker (undo copy included),
        # and -> the seconds the last speculating backward went on after the
        # chunk's last gradient landed; this backward's landing times; the
        # launches left to the step (and so to the next forward) by them.
        self._spec_seconds: dict[int, float] = {}
        self._left_after: dict[int, float] = {}
        self._landing_times: dict[int, float] = {}
        self._cost_rule = False  # this backward launches by Note [Speculation while backward lasts]
        self._link_bound = False  # the last speculating step's worker waited on copies more
        self._running_from = 0  # _jobs before it have finished (_fits_in_backward)
        self.left_to_step = 0
        # Note [Left to the step, pinned as if launched]: chunk -> the pin
        # of a chunk the rule left to the step, held from its landing until
        # the step hands it to the worker (defer) or the update runs elsewhere.
        self._held: dict = {}
        # Note [Sent ahead and evicted]: chunks whose weights are not sent
        # up ahead any more (for this layout).
        self._no_ahead: set[int] = set()

    # ------------------------------------------------------------ backward
    def begin(self, last_micro_batch: bool, *, global_steps: int, loss_scale: float, host_short: bool,
              fold_chunk, measure_sums=None, free_sums=None, break_window=None,
              start_fold=None, end_fold=None):
        """Before a backward: each chunk waits for the gradients of its
        trainable tensors, when this backward may launch updates.

        Args:
            last_micro_batch: the backward is the last of its accumulation window.
            global_steps: the optimizer steps taken (none in the warm-up).
            loss_scale: the loss scale this backward runs with.
            host_short: the host is too small for the state (Note [One place
                per chunk]).
            fold_chunk: (chunk, records, space) -> None, the accumulation's
                fold of one chunk's landed gradients into their sums.
            measure_sums: (records, fold) -> None, its measure of one chunk's
                final sums for the step's norm (Note [Measured where folded]),
                taken from `fold` where not None (Note [Measured in the fold]).
            free_sums: (records) -> None, its free of the sums the step
                handed over to an update under the next forward, once that
                update has read them.
            break_window: (why) -> None, what makes engine.step() refuse
                until engine.zero_grad() (landed()).
            start_fold, end_fold: the accumulation's fold in two, for a
                pass on the worker between them (Note [Folds on the worker]);
                None: folds run on the engine's thread.
        """
        self.settle_deferred()
        self.release_held()  # (a backward again without a step between)
        self._forget_layout_if_changed()
        # Note [Sent ahead and evicted]: the sends the room did not keep
        # since the last backward, once here rather than at every landing.
        self._no_ahead.update(self._store.chunks.take_ahead_wasted(PARAM16))
        recs = collections.defaultdict(list)
        # Every tensor of each chunk, frozen ones too: whether another is in
        # use where a chunk would move (_send_down, _launch).
        everyone = collections.defaultdict(list)
        for r in self._params.records:
            everyone[r.chunk].append(r)
            if r.trainable and self._store.owns(r):
                recs[r.chunk].append(r)
        self._chunk_records = dict(everyone)
        self._recs = dict(recs)
        self._counted = set()
        self._measure_queue = []
        self._measured_folds = {}
        if self._fold_jobs:
            # (A backward whose end failed before backward_ended: Note
            # [Folds on the worker].)
            self._end_folds(send_up=False)
        self._in_backward = True
        self._backward_end = None
        self.folded_early = set()
        self.sums_measured = set()
        # Not in the engine's first backward (the warm-up, which records the
        # trace and finds the parameters whose gradients land twice).
        accumulating = self._config.gradient_accumulation_steps > 1
        speculate = last_micro_batch and not _dtr.is_enabled() and global_steps > 0
        if self._data_parallel and accumulating:
            # Data parallel with accumulation: the end of backward folds the
            # owners' reduced gradients and broadcasts the weights back
            # (ChunkDataParallel.after_backward), which an update in flight would race.
            speculate = False
        if speculate and self._last_invalid:
            speculate = False
            self.steps_not_speculated += 1
        # DTR turned on by hand (tidal.dtr.enable(); the config's turns
        # overlap off): a replay in backward could read weights already
        # updated, so no chunk is updated during this backward.
        self._speculating = speculate
        self._window_end = last_micro_batch
        # (Data parallel: a landing is not final; the owner launches a chunk
        # when its reduction lands, reduced().)
        # Note [Gradients down as they land]: a backward that launches nothing
        # and is followed by a fold on the host sends each host-updated
        # chunk's gradients down once they are all in.
        early = accumulating and not speculate and not self._data_parallel and \
            not _dtr.is_enabled() and not host_short and global_steps > 0
        # chunk -> its gradients still to land; when none is left, the
        # chunk's update is launched (speculating) or its gradients go down.
        self._waiting = {chunk: len(rs) for chunk, rs in recs.items()
                         if not any(r in self._relanded for r in rs)} \
            if (speculate and not self._data_parallel) or early else {}
        self._all_landed = self._launch if speculate else self._send_down_and_queue
        self._drain = self._start if speculate else self._fold_and_send_up
        # Note [Weights up as they are updated]: not under data parallel (the
        # step broadcasts from the owner's chunks) nor with the NVMe tier
        # (whose host budget the step's order is measured for).
        # (With accumulation, the backwards that end no window fold each
        # chunk sent down early and send its weights up the same way: Note
        # [Gradients down as they land].)
        self._ahead = (speculate or early) and not self._data_parallel and \
            self._config.nvme_path is None
        # A host too small for the state (Note [One place per chunk]): the
        # step makes room first, so nothing is launched in this backward.
        self._host_short = host_short
        # The grad scale the step uses where the clip does not fire.
        self._grad_scale = 1.0 / loss_scale
        self._use_sums = accumulating
        self._fold_chunk = fold_chunk
        self._measure_sums = measure_sums
        self._free_sums = free_sums
        self._break_window = break_window
        self._start_fold, self._end_fold = start_fold, end_fold
        self._landing_times = {}
        self._cost_rule = speculate and not self._data_parallel and self.may_defer(
            global_steps=global_steps, data_parallel=self._data_parallel,
            host_short=host_short)

    def landed(self, record):
        """A gradient landed (trainable records only): counted once per
        parameter, so a second landing (a reentrant checkpoint in the model,
        Note [Weights while gradients wait]) cannot start its chunk before
        the others' gradients are in. Once the chunk's update started, a
        second use of the parameter in that backward finds its master chunk
        in use (COMPUTE) and fails there, naming the tensor."""
        if not self._in_backward:
            # A backward the script ran itself (loss.backward()): nothing is
            # launched there, and its landings are not second ones (counting
            # them so made every parameter "used again" and stopped the
            # overlap for good after one such backward). But one between an
            # engine.backward() and its step (a graph kept with retain_graph)
            # lands on a chunk this object took up: its 16-bit slot may hold
            # the update's weights, or its sums were measured for the step. No
            # step can be exact then: it is refused until zero_grad.
            chunk = record.chunk
            if not self._speculating:
                # (Measured at the end of a backward that launched nothing,
                # Note [Measured in the fold], nothing taken up: the step
                # measures it again, as it did before that measure was made
                # there.)
                self.sums_measured.discard(chunk)
            if chunk in self._pending or chunk in self._held or chunk in self.sums_measured:
                why = (f"a backward the script ran itself (loss.backward()) between engine.backward() and "
                       f"engine.step() landed a gradient of '{record.name}', whose chunk CPU Adam had "
                       f"taken up during engine.backward() (tidal.overlap_step)")
                if self._break_window is not None:
                    self._break_window(why)
                # (The backward stops here with parameters attached for it:
                # engine.zero_grad() releases them first.)
                self.raw_backward_refused = True
                raise UsageError(
                    f"tidal: {why}, so the step cannot add it exactly. Run engine.step() before another "
                    f"backward, or engine.backward() for every micro-batch with gradient_accumulation_steps "
                    f"set to their number, or set \"overlap_step\": false; engine.zero_grad() drops this "
                    f"step's gradients")
            return
        if self._ahead and self._speculating:
            self._send_up_finished()
        if self._fold_jobs and not self._speculating:
            self._end_finished_folds()
        if record.id in self._counted:
            # Used again after its gradient landed (a reentrant checkpoint
            # replays it): its chunk is never launched again (below), and
            # its sums, which the end of backward folds again, are measured
            # by the step (Note [Measured where folded]).
            self._relanded.add(record)
            self.sums_measured.discard(record.chunk)
            if record.chunk in self._pending or record.chunk in self._held:
                # But this backward started its update (or kept it for the
                # step): where the update had ended and let its slots go
                # (Note [Weights up as they are updated]), this gradient was
                # added to its new weights, and an undo would bring back the
                # first gradient alone, a wrong step without a word. (Where
                # the slots were still in use the landing failed before this,
                # on them: second_landing_on_taken_chunk.)
                self._mark_module_relanded(record)
                raise UsageError("tidal: " + _second_landing(record.name))
            return
        self._counted.add(record.id)
        left = self._waiting.get(record.chunk)
        if left is None:
            return
        left -= 1
        self._waiting[record.chunk] = left
        if left == 0:
            del self._waiting[record.chunk]
            self._all_landed(record.chunk)

    def second_landing_on_taken_chunk(self, error: BaseException) -> str | None:
        """Why `error`, raised by a failed engine.backward, is this object's:
        a gradient that landed before in this backward landed again (a
        reentrant checkpoint replaying a weight, where the steps before had
        not) on a chunk whose update it had started or kept for the step,
        whose slots are in use then (Note [Weights while gradients wait]);
        None for any other error. The parameter's module then lands twice
        (_mark_module_relanded), as landed() records it."""
        text = str(error)
        if "COMPUTE -> COMPUTE" not in text:
            return None
        taken = set(self._pending) | set(self._held) | {chunk for chunk, _ in self._fold_jobs}
        for chunk in taken:
            for r in self._recs.get(chunk, ()):
                if r.id in self._counted and (f"'{r.name}'" in text or f":{r.name}'" in text):
                    self._mark_module_relanded(r)
                    return _second_landing(r.name)
        return None

    def _mark_module_relanded(self, record) -> None:
        """A backward failed on `record`'s second landing: it and every other
        record of a module that holds it land twice from now on (their chunks
        wait for the step). The module's: the backward stopped at the first
        second landing, and a replay (a reentrant checkpoint) reruns whole
        modules, whose other parameters would fail the next backward."""
        self._relanded.add(record)
        for recs in self._params.module_records.values():
            if record in recs:
                self._relanded.update(r for r in recs if r.trainable)

    def reduced(self, chunk: int, landed):
        """Data parallel, on the chunk's owner: its reduced gradients are in
        its 16-bit slots (ChunkDataParallel._finish, during backward or right after it);
        `landed` flags the chunk's trainable records that got a gradient.
        Their sum over the ranks is final, so the update may start."""
        if self._speculating and chunk in self._recs and all(landed):
            self._launch(chunk)

    def backward_ended(self, failed: bool = False):
        """After a backward: the folds still queued run now (their updates
        launch), unless the backward failed (its gradients are dropped)."""
        queued, self._fold_queue = self._fold_queue, []
        self._in_backward = False
        measured = {}
        try:
            if not failed:
                for chunk in queued:
                    self._drain(chunk)
                while self._measure_queue:  # (in the order the folds were queued)
                    self._measure_and_start(self._measure_queue.pop(0))
                if self._ahead and self._speculating:
                    self._send_up_finished()
        finally:
            self._measure_queue = []
            # Note [Folds on the worker]: every fold of this backward ends
            # here (a failed backward's too, without raising over its error:
            # its sums then hold them; in the window's last, the updates
            # send the weights up).
            try:
                self._end_folds(send_up=not failed and not self._speculating, raise_error=not failed)
            finally:
                measured, self._measured_folds = self._measured_folds, {}
        if not failed and not self._speculating:
            # Note [Measured in the fold]: the window's last backward that
            # launched nothing folded its chunks on the worker measuring
            # their sums; the step measures only the others.
            for chunk, fold in measured.items():
                recs = self._recs[chunk]
                if any(r in self._relanded for r in recs):
                    continue  # (landed again: folded again at the end of backward, measured by the step)
                self._measure_folded(chunk, recs, fold)
        self._backward_end = time.perf_counter()
        if not failed:
            for chunk, t in self._landing_times.items():
                self._left_after[chunk] = self._backward_end - t
        self._landing_times = {}
        self._waiting = {}

    # Note [Gradients down as they land]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # With gradient accumulation each backward's gradients are folded into
    # their fp32 sums where the step will run. For a chunk updated on the host
    # the fold reads the 16-bit chunk there, and its access waited for the
    # chunk's copy down:
    # * after a backward that ends no window (GradientAccumulation.fold), for
    #   every such chunk, with backward over and the next forward waiting;
    # * in the backward that ends it, in the grad hook before each chunk's
    #   update is launched (Note [CPU Adam during backward]), stopping
    #   backward once per chunk.
    # At the H100's ratios (engine_offload.py's shape, accumulation 2) each
    # backward waited about as long as all those copies take. Now:
    # * the first: the copy of a chunk whose gradients are all in starts at the
    #   landing of the last one, on the copy stream, without waiting (as the
    #   update's pin: Note [A pin that does not wait] in
    #   runtime/scheduler/chunk_scheduler.h); the slot keeps its state (its
    #   gradients wait for the fold), whose access waits only for a copy that
    #   has not landed;
    # * the second: the launch sends the chunk down the same way, and its fold
    #   and update start _FOLD_LAG chunks' launches later or at the end of
    #   backward, by when the copy has usually landed (a failed backward
    #   drops the queue with its gradients). A count of launches, not whether
    #   the copy has landed: a fold's accesses are in the trace, and an order
    #   that followed the copies' timing would change from step to step and
    #   stop the prefetch (it did: a quarter of a steady step's copies missed);
    # * the first, too, where the weights may go up early (Note [Weights up
    #   as they are updated]): each chunk is folded on the host in the same
    #   queue, and its 16-bit slots, which hold the weights again, are sent
    #   up right after, for the next micro-batch's forward. Before, the fold
    #   after backward restored them and that forward's prefetch fetched them
    #   in its order, prefetch_depth at a time, as the step's weights were.
    # Only where the last step updated the chunk on the host (the plan), its
    # master is on the host, no other tensor of the chunk is in use, the host
    # has room, and nothing in this backward could bring the chunk back (no
    # DTR, no data parallel, not the warm-up): otherwise the fold moves it as
    # before. The bytes are the same; only when they move changes. The access
    # is part of the scheduler's trace, so from the next step on its prefetch
    # may send the chunk down there itself.
    def _send_down(self, chunk: int) -> bool:
        """Whether `chunk`'s 16-bit chunk was sent to the host (its copy started)."""
        c = self._store.chunks
        # (Whether the chunk is on the device yet is not asked: where the
        # scheduler follows its trace, its prefetch may have sent it down at
        # this very access, and skipping the access then would depart from
        # the trace, which stops the prefetch for the rest of the step.)
        if not self._on_host_by_plan(chunk) or c.chunk_space(chunk, PARAM32) != HOST:
            return False
        if self._store.in_use(self._chunk_records.get(chunk, ()), PARAM16):
            return False
        if self._store.send_to_host(self._recs[chunk][0], PARAM16):
            self.grads_sent_down_early += 1
            return True
        return False  # no host room now: the fold moves it

    def _send_down_and_queue(self, chunk: int) -> None:
        """A backward that ends no window: the gradients go down, and where
        the weights may go up early (Note [Weights up as they are updated]),
        the chunk's fold follows _FOLD_LAG launches later (_queue_fold)."""
        if self._send_down(chunk) and self._ahead:
            self._queue_fold(chunk)

    def _queue_fold(self, chunk: int) -> None:
        """`chunk`'s copy down has just started: the chunk queued _FOLD_LAG
        launches before it, whose copy has had that many chunks' backward to
        land, is folded (and launched) now; the rest wait for later launches
        or the end of backward. A count, not whether the copy has landed: the
        accesses of a fold are in the scheduler's trace, and an order that
        followed the copies' timing would differ from step to step, which
        stops the prefetch (Note [Prefetch])."""
        self._fold_queue.append(chunk)
        while len(self._fold_queue) > _FOLD_LAG:
            self._drain(self._fold_queue.pop(0))

    def _fold_and_send_up(self, chunk: int) -> None:
        """A backward that ends no window: `chunk`'s gradients into their
        sums on the host (the fold the end of backward would make there), and
        its 16-bit slots, which hold the weights again, sent up for the next
        micro-batch's forward."""
        recs = self._recs[chunk]
        if any(r in self._relanded for r in recs):
            return  # (landed again since it was queued: the end of backward folds it)
        if self._store.in_use(self._chunk_records.get(chunk, ()), PARAM16):
            return  # (another tensor of it is in use again, a recomputation: the end of backward folds it)
        if self._start_fold is not None:
            # (In the window's last backward its pass measures the sums too:
            # Note [Measured in the fold].)
            self._fold_on_worker(chunk, recs, measure=self._window_end)
            return
        self._fold_chunk(chunk, recs, HOST)
        self.folded_early.add(chunk)
        if self._send_ahead(chunk):
            self.weights_sent_up_early += 1

    # Note [Folds on the worker]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # In a backward that ends no window each host-updated chunk's gradients
    # are folded into their sums on the host _FOLD_LAG launches after their
    # copy down started (Note [Gradients down as they land]). That fold ran
    # on the thread of the gradient hook, which on a GPU is the thread that
    # launches backward's kernels: it first waited for the chunk's copy down,
    # so for the device to finish the chunk's gradients (the CPU, which
    # normally runs ahead of the device, fell back to two chunks ahead of
    # it), then made a pass of 16 bytes per parameter (the 16-bit gradient
    # and the sum read, the sum written, the master read and rounded into
    # the 16-bit slot) while the device could run out of queued kernels. At
    # the H200's gpt-1.3b with a quarter of the states and 4 micro-batches
    # (engine-nvidia-h200.json) that is 2.7 GB of gradients a micro-batch,
    # about 20 GB of host memory traffic, and the step took 1.31 s against
    # plain PyTorch's 0.60 s (0.461x); that run timed no phase, so how much
    # of the difference this was is not known. So the fold is split: on the hook's
    # thread the chunk's slots are accessed as the fold accesses them, in the
    # same order (so the scheduler's trace is unchanged), without waiting for
    # the copy down (Note [A pin that does not wait]); the pass runs on the
    # worker after the copy's fence; and at each later landing the folds done
    # in submission order have their slots released, their parameters count
    # as folded, and their 16-bit slots, which hold the weights again, are
    # sent up for the next forward (Note [Weights up as they are updated]).
    # Backward's end waits for the rest (fold_wait_seconds) and sends them up
    # the same way, before the end-of-backward fold of the chunks not folded
    # early. The pass is the same elementwise arithmetic on any thread, so
    # the sums and weights are bitwise those of the fold on the hook's
    # thread. A pass that fails leaves its slots as they were (its gradients
    # stay, still landed; the chunk counts as folded early, since a pass may
    # fail part-way) and its error fails the backward, as the fold's did,
    # wherever the engine's thread meets it (a landing, backward's end:
    # Engine._drop_what_the_overlap_took either way). Until a fold ends its
    # slots are in use: a module run again in backward (a recomputation)
    # first ends the folds of its chunks (the global forward pre-hook of
    # Note [CPU Adam under the next forward]), and a chunk with a tensor in
    # use when its fold would start is left to the end of backward.
    # The window's last backward folds each launched chunk on the worker the
    # same way (_start), and _FOLD_LAG launches later (or at backward's end)
    # ends the fold, waiting for it only where the worker has not finished
    # it, takes the measure of its sums the pass made (Note [Measured where
    # folded], Note [Measured in the fold]) and starts its update as before
    # (_measure_and_start). A count of launches again,
    # not the fold's timing, so the accesses keep the trace's order; the
    # weights go up as the updates end (Note [Weights up as they are
    # updated]), not as the folds do.
    def _fold_on_worker(self, chunk: int, recs: list, measure: bool = False) -> None:
        """`chunk`'s fold begun here and passed to the worker (Note [Folds on
        the worker]); `measure`: its pass also measures the sums (Note
        [Measured in the fold])."""
        fold = self._start_fold(recs, measure)
        try:
            job = _Job(self._pool, fold.submit(self._pool, num_threads=self._threads), (fold,))
        except BaseException:
            self._end_fold(fold, False)
            raise
        self._fold_jobs.append((chunk, job))
        self._folds_started.append(fold)
        self.folded_early.add(chunk)
        self.folds_on_worker += 1
        self._hook_forwards()  # (a module run again in this backward waits for its chunks' folds)

    def _end_finished_folds(self) -> None:
        """The folds on the worker done so far, in submission order, end and
        send their weights up; the first failure raises (Note [Folds on the worker])."""
        while self._fold_jobs and self._fold_jobs[0][1].done():
            self._end_next_fold(send_up=True)
        self._unhook_forwards_if_idle()

    def _end_folds(self, send_up: bool, raise_error: bool = True) -> None:
        """Waits for every fold on the worker and ends each (sending its
        weights up where `send_up`); raises the first error after all ended,
        where `raise_error`."""
        error = None
        t = time.perf_counter()
        while self._fold_jobs:
            try:
                self._end_next_fold(send_up=send_up and error is None)
            except BaseException as ex:  # noqa: BLE001 (re-raised below)
                error = error or ex
        self.fold_wait_seconds += time.perf_counter() - t
        self._unhook_forwards_if_idle()
        if error is not None and raise_error:
            raise error

    def _end_folds_of(self, chunks, send_up: "bool | None" = None) -> None:
        """The folds of `chunks` end, and those queued before them, waited
        for where the worker has not finished them (its slots are in use
        until then: Note [Folds on the worker]); sending their weights up
        where `send_up` (None: outside the window's last backward, whose
        updates send them). For a module of the model that runs (a
        recomputation in backward), and for a chunk's measure and launch."""
        if send_up is None:
            send_up = not self._speculating
        while any(chunk in chunks for chunk, _ in self._fold_jobs):
            self._end_next_fold(send_up=send_up)
        self._unhook_forwards_if_idle()

    def _end_next_fold(self, send_up: bool) -> None:
        chunk, job = self._fold_jobs.pop(0)
        fold = self._folds_started.pop(0)
        try:
            job.wait()
            _tf, t0, t1 = job.result()
        except BaseException as ex:
            if not job.done():
                # (The wait itself was interrupted: the worker may still
                # write the slots, so the fold stays in flight.)
                self._fold_jobs.insert(0, (chunk, job))
                self._folds_started.insert(0, fold)
                raise
            # The slots go back as they were; the chunk stays in
            # folded_early (a pass that failed part-way may have written
            # some sums), so a failed backward drops or refuses them.
            self._end_fold(fold, False)
            raise (ex.__cause__ or ex) if isinstance(ex, _UndoCopyFailed) else ex
        self.fold_worker_seconds += t1 - t0
        self._end_fold(fold, True)
        if fold.measures:
            self._measured_folds[chunk] = fold
        if send_up and self._send_ahead(chunk):
            self.weights_sent_up_early += 1

    # Note [Weights up as they are updated]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A chunk updated on the host during backward sends its new 16-bit
    # weights up for the next forward. They used to wait for the step, whose
    # finish() released the update's pins; then the scheduler's prefetch took
    # them in the next forward's order, prefetch_depth at a time. The host-
    # updated chunks are the last in first-use order (Note [Where a chunk's
    # Adam runs]), so that forward reached them soon after it started, and
    # the copies up of nearly every moving byte had only part of one forward
    # to hide in: at the H100's ratios (engine_offload.py) the link time of
    # the minimum bytes each way is 0.28 of a step and a forward a fifth to a
    # third of one, so the forward waited for the link while backward's link
    # up sat idle. Now, at each landing and at the end of backward (the hook's
    # thread, which drives the scheduler), the launched updates that have
    # finished, in launch order (the worker's order), have their pins
    # released and their 16-bit chunk sent where its next use wants it
    # (ChunkScheduler::send_ahead, Note [Sent ahead of the cursor]): up,
    # during backward, at the link's otherwise idle direction, within the
    # room a prefetch may take. The update is still a speculation the step
    # validates: an undo pins the chunk on the host again (_restore), which
    # brings it back down first, so the step after an undo reads what it
    # reads without this. Nothing waits: an update not finished yet is taken
    # at a later landing, or by the step and the prefetch as before; no
    # access is recorded, so the trace (and its prefetch) is the same at
    # every step. Not under data parallel (the step broadcasts from the
    # owner's chunks) nor with the NVMe tier. With gradient accumulation the
    # backwards that end no window send up each chunk's weights once its fold
    # is done (Note [Gradients down as they land]).
    # Where the link, not compute, bounds the step, backward ends long before
    # the gradients are down and most updates end while the step waits for
    # them (finish()): there each sends its weights up as soon as it is done,
    # so the copies up run beside the copies down still queued (each into a
    # device block whose copy down has landed: Note [A cached block whose
    # copy is done] in runtime/scheduler/block_pool.cpp). At 5 MB/s in the
    # quarter-budget shape the next forward then waited for about none of the
    # link time up, against two thirds with the weights going up after the
    # step (test_engine_offload_shape.py).
    def _send_up_finished(self) -> None:
        jobs = self._jobs
        while self._ahead_from < len(jobs):
            chunk, future = jobs[self._ahead_from]
            if not future.done() or future.failed():
                return  # (the worker runs them in launch order; a failure is finish()'s)
            if self._send_up_next(chunk):
                self.weights_sent_up_early += 1

    def _send_up_next(self, chunk: int) -> bool:
        """The job at _ahead_from (done, of `chunk`): its pins go (finish()'s
        second release is a no-op) and its 16-bit chunk is sent up. Whether
        it was."""
        self._job_pins[self._ahead_from].release()
        self._ahead_from += 1
        return self._send_ahead(chunk)

    # Note [Sent ahead and evicted]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A chunk's weights sent up ahead (Note [Weights up as they are updated])
    # take room that is free when they go, but the rest of backward, the
    # step and the next forward up to the chunk's use may need it: the
    # budget then shrinks, and OPT evicts first the chunk used last, which is
    # the one just sent for the next forward. Its copy up was wasted and it
    # comes up again: in step_overlap_cost's shape (48 MiB budget, 16
    # 16-bit chunks of 1 MiB) a steady step sent 15 ahead, 7 were evicted
    # before their use, and the step moved 23 chunks up against 16 without
    # sending any (1.4x the bytes each way). So a chunk whose weights
    # were sent up and evicted for room before the use they were sent for
    # (the scheduler says which: take_ahead_wasted, read at each backward's
    # start; not a move an access made, as an undo's or a state_dict's) is
    # not sent ahead again
    # for this layout; the prefetch takes it in the forward's order, as
    # without the path. Whether a send is wasted depends on the trace's
    # room, not on timing, so the set settles within a step or two; no
    # access is recorded either way, so the trace does not change.
    def _send_ahead(self, chunk: int) -> bool:
        """ChunkScheduler::send_ahead of `chunk`'s 16-bit chunk unless an
        earlier send of it was wasted (Note [Sent ahead and evicted])."""
        if chunk in self._no_ahead:
            return False
        return self._store.chunks.send_ahead(chunk, PARAM16)

    def _on_host_by_plan(self, chunk: int) -> bool:
        if not self._config.hybrid_adam:
            return True  # (the host is too small for the state: nothing launched)
        # No step recorded for this layout: the step decides, and its choice is the plan.
        return self.plan is not None and chunk in self.plan

    def _launch(self, chunk: int):
        c = self._store.chunks
        if self._host_short or not self._on_host_by_plan(chunk):
            return  # the step updates it (on the device, or with room made first)
        if self._cost_rule:
            self._landing_times[chunk] = time.perf_counter()
        recs = self._recs[chunk]
        if any(r in self._relanded for r in recs):
            return
        if c.chunk_space(chunk, PARAM16) == DEVICE and self._store.in_use(
                self._chunk_records.get(chunk, ()), PARAM16):
            return  # another tensor of the chunk is in use on the device: it cannot move now
        if self._use_sums:
            # Note [Gradients down as they land]: the fold reads the gradients
            # on the host; their copy starts now and the fold (and the
            # update) follows _FOLD_LAG launches later or at backward's end.
            self._send_down(chunk)
            self._queue_fold(chunk)
            return
        self._start(chunk)

    def _fits_in_backward(self, chunk: int) -> bool:
        """Whether `chunk`'s speculative update, started now behind the
        worker's unfinished ones, ends before backward does, by the last
        step's measures (Note [Speculation while backward lasts]); True where
        a measure is missing (the update then runs, and is measured) and
        where the link bound the last speculating step."""
        need = self._spec_seconds.get(chunk)
        left = self._left_after.get(chunk)
        landed = self._landing_times.get(chunk)
        if need is None or left is None or landed is None or self._link_bound:
            return True
        left -= time.perf_counter() - landed
        # The worker runs the jobs in launch order: the finished ones are a
        # prefix, skipped once (each landing would walk them all again).
        jobs = self._jobs
        while self._running_from < len(jobs) and jobs[self._running_from][1].done():
            self._running_from += 1
        need += sum(self._spec_seconds.get(queued, 0.0) for queued, _ in jobs[self._running_from:])
        return need <= left

    # Note [Measured where folded]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # With gradient accumulation the step's global norm is of the fp32 sums,
    # which the step used to measure for every chunk (GRAD32 accessed once
    # per tensor, GradientSums::measure). A chunk launched during the
    # window's last backward was folded at its last landing, its sums final
    # then; a chunk the cost rule leaves to the step (Note [Speculation while
    # backward lasts]) is pinned there as if launched, its sums with it
    # (Note [Left to the step, pinned as if launched]), and the step's
    # measure would access a slot the pin holds. So every chunk folded in
    # that backward has its sums measured right after its fold, whichever
    # way the rule decides, and the step measures only the others (those the
    # end of backward folded, on the device or where no fold ran early; after
    # a step that clipped the backward folds early without launching, Note
    # [Gradients down as they land], and those folds on the worker measure
    # the sums too: Note [Measured in the fold]): the accesses,
    # and so the trace, are the same however the decisions fall. A chunk
    # with a gradient landing again after its fold is measured by the step
    # (its sums fold again at the end of backward); the measures are
    # forgotten wherever the norms are cleared (the step, zero_grad, a
    # failed backward).
    # The measures are added in parameter order (Note [Gradient norms as
    # they land] in hooks/grad_norms.h), so the clip factor is the same bits
    # as the step without overlap's. The chunks left to the step then run
    # under the next forward (Note [CPU Adam under the next forward]) reading
    # their sums, which the step hands over: they no longer count as sums
    # (nothing between the step and the forward sees a gradient waiting), and
    # their memory goes once each update is done. Before, with accumulation
    # every chunk whose gradients were in was launched and nothing was left
    # to the next forward: tidal.estimate
    # put gpt-1.3b at a quarter budget with 4 micro-batches on an H100 at
    # 2.82 s a step, 2.16 s of it CPU Adam exposed (the speculative updates
    # at the speculation factor's cost), against 1.35 s and 0.69 s with the
    # updates backward cannot hide left to the next forward (and 1.45 s
    # without overlap).
    #
    # Note [Measured in the fold]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # With folds on the worker (Note [Folds on the worker]) that measure was
    # still a pass of its own on the hook's thread: each chunk's fp32 sums
    # read again (4 bytes a parameter: 5.2 GB a step at gpt-1.3b) right
    # after the worker wrote them, on the thread that on a GPU launches
    # backward's kernels, beside the worker's folds and updates on the same
    # memory. Now the window's last fold of each chunk on the worker is
    # started with measure: its pass (cpu_adam::fold_gradients with stats)
    # measures each block of sums right after folding it, while the block is
    # in cache, and _measure_and_start takes the measures from the ended
    # fold (ModuleHooks::measured_in_fold) instead of reading the sums. The
    # blocks are grad_stats' blocks and their partials are added in the same
    # order (Note [Deterministic blocks] in cpu_adam/adam.h), so each measure
    # is the bits GradientSums::measure would find, and the clip factor is
    # the step without overlap's. A window's last backward that launches
    # nothing (after a step that clipped: with the clip firing at every
    # step, every step) folds on the worker too (_fold_and_send_up), and
    # those folds measure as well: at backward's end each chunk whose fold
    # measured and got no gradient again is measured from it and counts in
    # sums_measured, so the step reads none of those sums again (it measured
    # every sum there, after backward, with nothing beside it to hide
    # under). A loss.backward() the script runs before the step that lands
    # on such a chunk drops that measure (landed(): the step measures it
    # again), where it would otherwise be refused as a chunk taken up: it
    # was allowed before these measures were made there. The folds made
    # elsewhere (the engine's thread without a worker, the end of backward)
    # are measured as before. The trace no longer has the measure's access
    # to the sums' chunk, in every steady step of a kind alike: the fold's
    # own access comes just before it.
    def _start(self, chunk: int):
        """The launch of `chunk`'s update, from its undo buffers on (the
        checks are _launch's; a fold queued since, rechecked here)."""
        recs = self._recs[chunk]
        if any(r in self._relanded for r in recs):
            return  # (landed again since it was queued: the step updates it)
        kinds = _KINDS + ((GRAD32,) if self._use_sums else ())
        if self._use_sums:
            if self._store.in_use(self._chunk_records.get(chunk, ()), PARAM16):
                return  # (another tensor of it is in use again: the end of backward folds it, the step updates it)
            # Note [Gradient sums in chunks]: the fold the end of backward
            # would make, for this chunk, on the host where it is updated;
            # the sums are final, and measured (Note [Measured where
            # folded]), whichever way the rule below decides.
            if self._start_fold is not None:
                # Note [Folds on the worker]: on the worker; the measure and
                # the launch follow _FOLD_LAG launches later (the measure
                # made by the pass: Note [Measured in the fold]).
                self._fold_on_worker(chunk, recs, measure=True)
                self._measure_queue.append(chunk)
                while len(self._measure_queue) > _FOLD_LAG:
                    self._measure_and_start(self._measure_queue.pop(0))
                return
            self._fold_chunk(chunk, recs, HOST)
            self.folded_early.add(chunk)
            self.sums_measured.add(chunk)  # (first: a measure that fails part-way is cleared)
            self._measure_sums(recs)
        self._start_update(chunk, recs, kinds)

    def _measure_and_start(self, chunk: int) -> None:
        """The window's last backward, Note [Folds on the worker]: `chunk`'s
        fold ends (waited for if the worker has not finished it), its sums
        are measured and its update launched, as _start does after a fold."""
        recs = self._recs[chunk]
        self._end_folds_of({chunk}, send_up=False)
        fold = self._measured_folds.pop(chunk, None)
        if any(r in self._relanded for r in recs):
            return  # (a gradient landed again: the end of backward folds it again, the step takes it)
        self._measure_folded(chunk, recs, fold)
        self._start_update(chunk, recs, _KINDS + (GRAD32,))

    def _measure_folded(self, chunk: int, recs: list, fold=None) -> None:
        """`chunk`'s final sums measured for the step (Note [Measured where
        folded]): from `fold` where its pass measured them (Note [Measured
        in the fold]), else read where they are."""
        self.sums_measured.add(chunk)  # (first: a measure that fails part-way is cleared)
        self._measure_sums(recs, fold)
        if fold is not None:
            self.sums_measured_in_folds += 1

    def _start_update(self, chunk: int, recs: list, kinds: tuple) -> None:
        """_start from the cost rule on: `chunk`'s update left to the step
        or launched on the worker (its sums, with accumulation, final and
        measured)."""
        c = self._store.chunks
        if self._cost_rule and not self._fits_in_backward(chunk):
            # Note [Speculation while backward lasts]: the step hands it to
            # the next forward with the clip factor known, no undo needed;
            # pinned now as a launch pins it (Note [Left to the step, pinned
            # as if launched]).
            try:
                self._held[chunk] = self._store.pin(recs[0], kinds, HOST, wait=False)
            except _C.OutOfMemoryError:
                pass  # (no host room for it now: the step pins it)
            self.left_to_step += 1
            self._hook_forwards()
            return
        spans = [c.placement(r.id)[1] for r in recs]
        lo = min(spans)
        hi = max(off + r.numel for off, r in zip(spans, recs))
        undo = self._undo_buffers(chunk, hi - lo)
        if undo is None:
            return  # no host room for the undo buffers: the step updates it
        # A record's slots pin its whole chunk of each kind.
        # The pin starts the copy of the gradients down; the worker waits for
        # it, not backward (Note [A pin that does not wait]).
        pin = self._store.pin(recs[0], kinds, HOST, wait=False)
        self._pinned.append(pin)
        fences = self._store.copy_fences(chunk, kinds)
        views = [c.chunk_view(chunk, k) for k in _UNDO_KINDS]
        grad = c.chunk_view(chunk, GRAD32) if self._use_sums else None
        for r in recs:
            r.step += 1
        # grad_scale = clip / scale at clip 1.
        job = self._submit(views, recs, self._grad_scale, grad, fences, undo, lo, hi)
        self._pending[chunk] = (recs, lo, hi, _hyperparameters(self._optimizer.param_groups, recs))
        self._jobs.append((chunk, job))
        self._job_pins.append(pin)
        self.launched_chunks += 1
        self._hook_forwards()  # (Note [A forward of the model before the step])

    def _submit(self, views: list, recs: list, grad_scale: float, grad, fences: list, undo=None,
                lo: int = 0, hi: int = 0) -> _Job:
        """The update of `recs` (one chunk's, their step counts already
        advanced) on the worker: the copies into the chunk (`fences`) waited
        for, then (`undo` given) the undo copy of [lo, hi), then one
        adam_chunk_step per parameter group, the step's own arithmetic
        (hooks/chunk_step.cpp's simd_step: loss_scale = 1 / grad_scale).
        views: the chunk's _UNDO_KINDS views; grad: the fp32 sums' view, or None."""
        cfg, c = self._config, self._store.chunks
        calls = []
        for group, members in by_group(self._optimizer.param_groups, recs):
            b1, b2 = group["betas"]
            calls.append(([(c.placement(r.id)[1], r.numel) for r in members], [r.step for r in members],
                          group["lr"], b1, b2, group["eps"], group["weight_decay"]))
        ticket = self._pool.submit(*views, calls, fences=fences, undo=undo, undo_lo=lo, undo_hi=hi,
                                   grad=grad, adamw_mode=cfg.adam_w_mode,
                                   bias_correction=cfg.bias_correction, loss_scale=1.0 / grad_scale,
                                   # On the worker torch's pool would be an
                                   # OpenMP team of its own, not the threads that
                                   # ran backward (Note [A second OpenMP team] in
                                   # cpu_adam/adam.h): oneTBB's, whatever the config.
                                   num_threads=self._threads, pool="onetbb")
        return _Job(self._pool, ticket, (views, grad, undo))

    def _undo_buffers(self, chunk: int, numel: int):
        """The chunk's undo buffers (one per kind of _UNDO_KINDS, at least
        `numel` long), kept across steps; None where new ones would not fit
        the host budget beside the chunks it holds."""
        bufs = self._undo.get(chunk)
        if bufs is not None and bufs[0].numel() >= numel:
            return bufs
        store = self._store
        c = store.chunks
        # (Not from accesses of the slots: a chunk launched for the first
        # time would add them to the trace, a departure from the last step's.)
        dtypes = store.kind_dtypes(_UNDO_KINDS)
        size = sum(numel * d.itemsize for d in dtypes)
        old = 0 if bufs is None else sum(b.numel() * b.element_size() for b in bufs)
        if c.held_bytes(HOST) + self.undo_bytes - old + size > store.capacity_bytes()[0]:
            return None
        with uncounted():  # (host memory, not the simulated device's)
            bufs = [torch.empty(numel, dtype=d) for d in dtypes]
        self._undo[chunk] = bufs
        self.undo_bytes += size - old
        return bufs

    def _forget_layout_if_changed(self):
        """A relayout renumbers the chunks: the plan and the buffers were for the old ones."""
        chunks = self._store.chunks
        if self._layout is not chunks:
            self._layout = chunks
            self.plan = None
            self._undo = {}
            self.undo_bytes = 0
            self._spec_seconds = {}
            self._left_after = {}
            self._no_ahead = set()

    # ---------------------------------------------------------------- step
    def finish(self, send_up: bool = False):
        """Waits for every launched update and releases the pins. Raises the
        first error a worker met, after every pin is released (the chunks it
        updated stay pending, so an undo can still take them back).

        Args:
            send_up: the step's wait: where this backward sent finished
                chunks up (Note [Weights up as they are updated]), each one
                still running when backward ended sends its weights up as
                soon as it is done, while the later ones still wait for their
                gradients' copies down.
        """
        error = None
        end = self._backward_end
        send_up = send_up and self._ahead
        fenced = updating = 0.0
        for i, (chunk, future) in enumerate(self._jobs):
            try:
                if not future.done() and future.wait():
                    self.run_by_waiter += 1
                tf, t0, t1 = future.result()
            except _UndoCopyFailed as ex:
                # Nothing was updated: the chunk is as backward left it.
                recs = self._pending.pop(chunk)[0]
                for r in recs:
                    r.step -= 1
                error = error or ex.__cause__ or ex
                continue
            except BaseException as ex:  # noqa: BLE001 (re-raised below)
                error = error or ex
                continue
            if send_up and error is None and i == self._ahead_from:
                if self._send_up_next(chunk):
                    self.weights_sent_up_at_step += 1
            self.worker_seconds += t1 - t0
            self._spec_seconds[chunk] = t1 - t0
            fenced, updating = fenced + t0 - tf, updating + t1 - t0
            if end is not None:
                self.overlapped_seconds += max(0.0, min(t1, end) - t0)
            else:  # a forward or an error before backward ended: all of it overlapped
                self.overlapped_seconds += t1 - t0
        if self._jobs:
            # (Note [Speculation while backward lasts]: the worker waited for
            # the gradients' copies down longer than it updated.)
            self._link_bound = fenced > updating
        self._jobs.clear()
        self._job_pins = []
        self._ahead_from = 0
        self._running_from = 0
        self._speculating = False
        for pin in self._pinned:
            pin.release()
        self._pinned = []
        if error is not None:
            raise error

    # Note [Hyperparameters written before the step]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # An update launched during backward reads its group's lr, betas, eps
    # and weight_decay then; a script may write them after backward and
    # before engine.step() (a warm-up written by hand, a DeepSpeed client
    # optimizer's lr), and torch's AdamW steps with what the groups hold at
    # its step. So the step compares each speculative update's
    # hyperparameters with its groups' at the step, and undoes those that
    # differ (Note [Speculative updates and their undo]): the step makes them
    # again with the values it reads, bit for bit the step without overlap.
    def validate(self, valid: bool) -> set:
        """In the step, after finish(): the chunks whose speculative update
        stands (valid: the clip factor is 1.0 and every gradient finite, and
        the update's hyperparameters are still its groups'); the others are
        undone and the step updates them as if none had run. Also the
        prediction for the next backward."""
        self._last_invalid = not valid
        if not valid:
            self.undo()
        else:
            groups = self._optimizer.param_groups
            # (Also an update whose chunk had a gradient land again after it
            # ran: its pins were let go early, Note [Weights up as they are
            # updated], so the landing did not fail on them.)
            stale = [chunk for chunk, (recs, _lo, _hi, hyper) in self._pending.items()
                     if hyper != _hyperparameters(groups, recs)
                     or any(r in self._relanded for r in recs)]
            if stale:
                self._restore(stale)
        done = set(self._pending)
        self._pending = {}
        self._unhook_forwards_if_idle()
        return done

    def undo(self, keep_deferred: bool = False):
        """Waits for the updates running and takes back every one not yet
        validated: the undo buffers go back into the chunks, the steps are
        counted back (Note [Speculative updates and their undo]). The
        updates a step left to the next forward are waited for first, unless
        keep_deferred (the forward itself: its modules wait for theirs)."""
        if not keep_deferred:
            self.settle_deferred()
        try:
            self.finish()
        finally:
            try:
                if self._pending:
                    self._restore()
            finally:
                self.release_held()

    # Note [Left to the step, pinned as if launched]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The scheduler follows a trace of the last step's chunk accesses, and a
    # step whose accesses depart from it loses the prefetch for the rest of
    # that step (Note [Prefetch] in runtime/scheduler/chunk_scheduler.h). A
    # launch during backward pins the chunk's 16-bit, master and moment
    # chunks (and with accumulation its sums) on the host, where the step
    # then accesses nothing of it; a
    # chunk left to the step by Note [Speculation while backward lasts] was
    # pinned in the step instead (defer). Which chunks the rule leaves comes
    # from timing and may change from step to step, and each change moved
    # accesses between backward and the step: a departure. Forcing the rule
    # to leave each chunk at random in test_engine_offload_shape.py's
    # quarter-budget shape, every steady step departed in backward, and about
    # half its copies missed (27 of 58: the gradients of the chunks left to
    # the step went down at the step, on demand, after backward). So a chunk
    # left to the step is pinned at its landing exactly as a launch pins it
    # (its gradients start down then, beside backward), and the pin is held
    # until the step hands it to the worker (defer takes it, accessing
    # nothing more) or the update runs elsewhere (release_held: the step
    # updating it itself, an undo, a forward before the step). The trace is
    # then the same whichever way the rule decides.
    def release_held(self, chunks=None) -> None:
        """Releases the pins held for chunks left to the step (`chunks`;
        every one when None)."""
        targets = list(self._held) if chunks is None else [ch for ch in chunks if ch in self._held]
        for chunk in targets:
            self._held.pop(chunk).release()
        self._unhook_forwards_if_idle()

    def _restore(self, chunks=None):
        """The undo buffers back into the chunks of `chunks` (None: every
        pending one), which leave _pending."""
        store = self._store
        c = store.chunks
        if chunks is None:
            pending, self._pending = self._pending, {}
        else:
            pending = {chunk: self._pending.pop(chunk) for chunk in chunks}
        with torch.no_grad():
            for chunk, (recs, lo, hi, _hyper) in pending.items():
                pin = store.pin(recs[0], _UNDO_KINDS, HOST)
                try:
                    for kind, buf in zip(_UNDO_KINDS, self._undo[chunk]):
                        c.chunk_view(chunk, kind)[lo:hi].copy_(buf[:hi - lo])
                finally:
                    pin.release()
                for r in recs:
                    r.step -= 1
                self.undone_chunks += 1
        self._unhook_forwards_if_idle()

    def abandon_with(self, owner) -> None:
        """When `owner` (the engine) goes, the worker is waited for (its
        chunks are still there) and stopped, before the chunks go. The
        finalizer holds the worker and the job lists, never this
        object: what it holds (the store, the records) leads to the model
        and from its hooks to the engine, which would then never go."""
        weakref.finalize(owner, _abandon_worker, self._pool, self._jobs, self._deferred_jobs,
                         self._hook_box, self._fold_jobs)

    # ------------------------------------------------ under the next forward
    def may_defer(self, *, global_steps: int, data_parallel: bool, host_short: bool) -> bool:
        """Whether this step may leave its host updates to the next forward
        (Note [CPU Adam under the next forward])."""
        # Not with the NVMe tier: the pins would hold every host-updated
        # chunk read from disk at once, where the step reads and writes them
        # one at a time within a host budget that holds a few.
        return (self._config.overlap_next_forward and global_steps > 0
                and not data_parallel and not host_short and not _dtr.is_enabled()
                and self._config.nvme_path is None
                and self.plan is not None and self._layout is self._store.chunks)

    def take_sums_measured(self) -> set:
        """The step: the chunks whose sums this window's last backward
        measured (Note [Measured where folded]), once; the norms they went
        into are the step's to take or clear."""
        taken, self.sums_measured = self.sums_measured, set()
        return taken

    def defer(self, chunk: int, recs: list, grad_scale: float, sums: bool = False):
        """In the step: the update of `chunk`'s records `recs` (their step
        counts already advanced) at `grad_scale` goes to the worker; the
        chunk stays pinned on the host until settle_deferred takes it.
        sums: the update reads the records' gradient sums (accumulation),
        whose memory settle_deferred then frees."""
        c = self._store.chunks
        kinds = _KINDS + ((GRAD32,) if sums else ())
        # As step_chunk pins: the 16-bit chunk, then the master and moments
        # (and the sums) (held since its landing where the rule left it to
        # the step: Note [Left to the step, pinned as if launched]).
        pin = self._held.pop(chunk, None)
        if pin is None:
            pin = self._store.pin(recs[0], kinds, HOST, wait=False)
        try:
            fences = self._store.copy_fences(chunk, kinds)
            views = [c.chunk_view(chunk, k) for k in _UNDO_KINDS]
            future = self._submit(views, recs, grad_scale, c.chunk_view(chunk, GRAD32) if sums else None,
                                  fences)
        except BaseException:
            pin.release()
            raise
        self._deferred[chunk] = (future, pin, recs if sums else None)
        self._deferred_jobs.append(future)
        self.deferred_chunks += 1
        self._hook_forwards()

    # Note [A forward of the model before the step]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # engine(...) takes back the updates made during backward before its
    # forward runs (Engine.settle_overlap), but a script may call the model
    # itself between backward and engine.step() (an evaluation, a metric): its
    # modules would read weights under update on the worker (a wrong loss
    # without a word) or find a chunk pinned by one (an illegal state
    # transition). So while any update made during backward waits for its
    # step, the global forward pre-hook of Note [CPU Adam under the next
    # forward] is installed too, and the first module of this engine's model
    # that runs after backward ended takes them all back, as engine(...)
    # would; the step makes them again. Not during backward, whose
    # recomputations (checkpointing) run forwards of modules whose updates
    # have not started (Note [CPU Adam during backward]).
    def _hook_forwards(self) -> None:
        """Installs the global forward pre-hook (before_module) unless it is."""
        if self._hook_box[0] is None:
            ref = weakref.ref(self)

            def before_forward(module, _args):
                overlap = ref()
                if overlap is not None and (overlap._deferred or overlap._pending or overlap._held
                                            or overlap._fold_jobs):
                    overlap.before_module(module)

            self._hook_box[0] = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)

    def _unhook_forwards_if_idle(self) -> None:
        """Removes the global forward pre-hook once nothing waits for it."""
        if self._hook_box[0] is not None and not self._deferred and not self._pending and not self._held \
                and not self._fold_jobs:
            self._hook_box[0].remove()
            self._hook_box[0] = None

    def before_module(self, module):
        """The global forward pre-hook: an update made during backward that
        waits for its step is taken back at a forward of the model's
        (Note [A forward of the model before the step]); the finished
        deferred updates' pins go (so prefetch moves their chunks up), then
        `module`'s chunks are waited for."""
        recs = self._params.module_records.get(module)
        if self._fold_jobs and recs:
            self._end_folds_of({r.chunk for r in recs})
        if (self._pending or self._held) and recs and self._backward_end is not None:
            self.undo(keep_deferred=True)
        if not self._deferred:
            return
        self._release_finished()
        if recs:
            chunks = [r.chunk for r in recs if r.chunk in self._deferred]
            if chunks:
                self.settle_deferred(chunks)

    def _release_finished(self):
        done = []
        for chunk, (future, _pin, _sums) in self._deferred.items():
            if not future.done():
                # (The worker runs them in launch order; settle_deferred
                # takes those a waiter ran out of it.)
                break
            done.append(chunk)
        if done:
            self.settle_deferred(done)

    def settle_deferred(self, chunks=None):
        """Waits for the updates left to the next forward of `chunks` (every
        one when None) and releases their pins; raises the first error a
        worker met, after every pin is released."""
        if not self._deferred:
            return
        targets = list(self._deferred) if chunks is None else \
            [ch for ch in dict.fromkeys(chunks) if ch in self._deferred]
        error = None
        for chunk in targets:
            future, pin, sums = self._deferred.pop(chunk)
            try:
                if not future.done():
                    t = time.perf_counter()
                    if future.wait():
                        self.run_by_waiter += 1
                    self.deferred_wait_seconds += time.perf_counter() - t
                _tf, t0, t1 = future.result()
                self.worker_seconds += t1 - t0
            except BaseException as ex:  # noqa: BLE001 (re-raised below)
                error = error or ex
            finally:
                pin.release()
                if sums is not None:
                    # (The step handed them over: GradientAccumulation.stepped.)
                    try:
                        self._free_sums(sums)
                    except BaseException as ex:  # noqa: BLE001 (re-raised below)
                        error = error or ex
        if not self._deferred:
            self._deferred_jobs.clear()
            self._unhook_forwards_if_idle()
        if error is not None:
            raise error


# Note [The worker leaves a core]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The worker's updates run beside compute: during backward, and under the
# next forward. The thread that drives compute (the caller's: it runs the
# forward's hooks, backward's landings and the step's launches, and on a GPU
# it launches every kernel; on the simulated device it is also one of torch's
# threads) then needs a core of its own, or each of its launches waits for a
# time slice behind CPU Adam's threads. So with tidal.cpu_adam_threads 0 the
# worker's updates take every core the process may run on but one (at least
# one); the step's own updates, which run while the script waits, still take
# them all, and a cpu_adam_threads > 0 is obeyed everywhere. On 2 cores,
# the clip firing every step (benchmarks/step_overlap_clip.py, clip_all:
# every update under the next forward), the step's launches took 2.7 ms
# with the worker on both cores and 1.4 ms with it on one, and the forward
# and backward beside it 44 / 85 ms against 37 / 64: oneTBB's workers spin
# a while after each update, on the cores torch's threads wanted. Where
# the step waits for the worker (the link or CPU Adam binding) one core of
# many is what this costs; on 2 cores the engine_offload shape, whose
# updates run during backward, did not change (93.8 ms a step against
# 92.9 with the worker on both, in one run).
def worker_threads(cpu_adam_threads: int) -> int:
    """The threads of one update on the worker (Note [The worker leaves a core])."""
    if cpu_adam_threads > 0:
        return cpu_adam_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on Linux)
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def _hyperparameters(param_groups: list, recs: list) -> tuple:
    """What an update of `recs` (one chunk's) reads from its groups
    (StepOverlap._submit): lr, betas, eps, weight_decay per group."""
    return tuple((g["lr"], *g["betas"], g["eps"], g["weight_decay"]) for g, _ in by_group(param_groups, recs))


def _abandon_worker(pool, jobs: list, deferred_jobs: list, hook_box: list, fold_jobs: list) -> None:
    # (`pool`, the worker, is held until here; its thread ends with its last
    # reference, each job run: UpdateWorker's destructor.)
    if hook_box[0] is not None:
        hook_box[0].remove()
        hook_box[0] = None
    for _chunk, future in jobs:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 (nobody is left to tell)
            pass
    for future in deferred_jobs:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 (nobody is left to tell)
            pass
    for _chunk, future in list(fold_jobs):
        try:
            future.result()
        except BaseException:  # noqa: BLE001 (nobody is left to tell)
            pass
    jobs.clear()
    fold_jobs.clear()
    deferred_jobs.clear()


def _second_landing(name: str) -> str:
    """The error of a gradient landing a second time in one backward on a
    chunk whose update that backward had started (StepOverlap.landed)."""
    return (f"the gradient of '{name}' landed a second time in one backward (a reentrant "
            f"torch.utils.checkpoint replaying a weight used before it, which the backwards before had not "
            f"done) after tidal.overlap_step had started its chunk's CPU Adam update; tidal cannot add it "
            f"exactly. Use torch.utils.checkpoint(use_reentrant=False), or set \"overlap_step\": false for "
            f"this model; engine.zero_grad() drops this step's gradients")


class _UndoCopyFailed(Exception):
    """The worker could not copy a chunk into its undo buffers; it updated nothing."""


class _Job:
    """One update on the worker (_C.cpu_adam.UpdateTicket), with what it
    reads and writes kept alive until it is dropped (after it is done)."""

    __slots__ = ("_worker", "_ticket", "_buffers")

    def __init__(self, worker, ticket, buffers):
        self._worker = worker
        self._ticket = ticket
        self._buffers = buffers

    def done(self) -> bool:
        return self._ticket.done()

    def failed(self) -> bool:
        return self._ticket.failed()

    def wait(self) -> bool:
        """Waits until done, running the update on this thread where the
        worker has not started it (Note [A waiter runs the job itself] in
        cpu_adam/update_worker.h); True where it ran here."""
        return self._worker.run_or_wait(self._ticket)

    def result(self) -> tuple:
        """Waits (on the worker); (began, fences passed, ended) in
        time.perf_counter() seconds. Raises the job's error:
        _UndoCopyFailed (its cause the error) where it failed before
        updating anything."""
        try:
            return self._ticket.result()
        except BaseException as e:
            if self._ticket.undo_failed():
                raise _UndoCopyFailed(str(e)) from e
            raise
