"""The engine's data-parallel side (docs/data_parallel.md): the ranks' check at
initialize (check_ranks_agree) and ChunkDataParallel, which owns the
per-chunk gradient reductions overlapping backward and the broadcasts of the
owners' updated chunks (Note [Data parallel by chunk] in tidal/data_parallel.py).

The process group itself is tidal.data_parallel.DataParallel (the store's
`dp`, kept as engine.dp); this module decides what travels over it, when,
and in which order."""
from __future__ import annotations

import collections
import math
import warnings
import zlib

import torch

from .. import dtr as _dtr
from ..config import ConfigError
from ..data_parallel import IN_FLIGHT, DataParallelError
from .params import ParamTable
from .store import HOST, NOWHERE, PARAM16, uncounted

from .common import _PER_MACHINE_KEYS

__all__ = ["ChunkDataParallel", "check_ranks_agree"]


def check_ranks_agree(group, cfg, store, records, group_state: list):
    """Note [Data parallel by chunk]: every rank must hold the same model in
    the same chunks, with the same config; one collective (group.check_same)
    compares them, so it runs on every rank at the same point of initialize.

    Args:
        group: the process group (tidal.data_parallel.DataParallel).
        cfg: the engine's Config.
        store: the ParamStore the records are laid out in.
        records: the engine's records, in record order.
        group_state: the parameter groups (Engine._group_state()).
    """
    if cfg.dtr and cfg.dtr.get("enabled", True):
        raise ConfigError(
            "config keys 'tidal.dtr' and data parallel: DTR under the engine is not supported "
            "with data parallel yet (a recompute in backward may read the master weights of a "
            "chunk another rank owns); turn one off (tidal.dtr.enabled: false, or "
            "tidal.data_parallel.enabled: false)")
    c = store.chunks
    layout = [[r.name, list(r.shape), bool(r.trainable), list(c.placement(r.id))]
              for r in records]
    # Memory budgets and tuning may differ between machines; the rest may not.
    raw = dict(cfg.raw)
    raw["tidal"] = {k: v for k, v in cfg.raw["tidal"].items() if k not in _PER_MACHINE_KEYS}
    # The initial 16-bit values too: DDP would broadcast rank 0's, but a
    # rank that built other weights has a seeding bug worth hearing of.
    weights = []
    with torch.no_grad(), uncounted():
        for r in records:
            with store.slots(r, (PARAM16,), HOST) as (view,):
                weights.append(zlib.crc32(view.view(torch.uint8).numpy()))
    group.check_same({"config": raw, "model and chunk layout": layout,
                      "parameter groups": group_state, "initial weights": weights})


class ChunkDataParallel:
    """One rank's part in data parallel by chunk (Note [Data parallel by
    chunk]): each backward's gradient reductions, chunk by chunk in one fixed
    order, into the chunks' owners; the broadcasts of the owners' chunks back
    to every rank; and the share of the global gradient norm the owner's
    reduced gradients make. Made by the engine once its hooks exist, one per
    engine; the engine calls it at the start and end of each backward, from
    a gradient hook (grad_ready, with overlap_comm), in the step and in
    zero_grad.

    It owns the reductions' and broadcasts' state: which chunks reduce, in
    which order, how far this backward's reductions got, the collectives in
    flight, and whether a failure left the ranks out of step (then every
    later backward and step refuses, check()). It reads and writes the
    16-bit chunks it reduces and broadcasts, each pinned by a store slot
    meanwhile, and tells `overlap` when an owned chunk's gradients are
    final. It holds no reference to the engine: the engine's pieces it
    needs at the end of a backward (which gradients landed, their fold into
    the accumulation sums) are handed to after_backward, and its gradient
    hook holds it weakly (Note [Gradient hooks hold the engine weakly] in
    common.py).

    The chunk layout stays fixed under data parallel (the relayout is
    skipped: it would move records between owners), so the records and
    their indexes given here hold for the engine's life.

    Args:
        group: the process group (tidal.data_parallel.DataParallel).
        store: the ParamStore holding the chunks.
        params: the engine's ParamTable (the records and their indexes, the
            hooks' numbering).
        hooks: the engine's ModuleHooks (which gradients landed; under
            accumulation, after_backward clears the landings of the chunks
            other ranks own).
        overlap: the engine's StepOverlap, or None without tidal.overlap_step.
        accumulating: gradient_accumulation_steps > 1.
    """

    def __init__(self, group, store, params: ParamTable, hooks, overlap, accumulating: bool):
        self.group = group
        self._store = store
        self._params = params
        self._hooks = hooks
        self._overlap = overlap
        self._accumulating = accumulating
        c = store.chunks
        # The unit of the gradient reductions: each chunk's trainable records,
        # reduced in one fixed order by every rank (the last chunk first, as
        # backward reaches them), so the ranks' collectives match whenever
        # each rank's chunks become final.
        members = collections.defaultdict(list)
        for r in params.record_list:
            if r.trainable:
                members[r.chunk].append(r)
        self._members = dict(sorted(members.items()))
        # The unit of the broadcasts: (first record, start, end) of the span
        # of each such chunk's trainable records.
        self._spans = {}
        for chunk, recs in self._members.items():
            offs = [c.placement(r.id)[1] for r in recs]
            self._spans[chunk] = (recs[0], min(offs),
                                  max(o + r.numel for o, r in zip(offs, recs, strict=True)))
        # The chunks holding a trainable parameter, in ascending order: the
        # order the step updates and broadcasts them in on every rank.
        self.chunks: tuple[int, ...] = tuple(self._spans)
        self._order = sorted(members, reverse=True)
        self._pos = {chunk: i for i, chunk in enumerate(self._order)}
        self._left: dict[int, int] = {}  # chunk -> its gradients still to land in this backward
        self._counted: set[int] = set()  # records counted in this backward
        self._sq: list = []  # sums of squares of the owner's reduced gradients (0-d tensors)
        self._sumsq = 0.0  # their total since the last step (without accumulation)
        self._warned_unused = False
        self._next = len(self._order)  # position in _order of the next reduction to start
        self._flight = collections.deque()  # reductions: (chunk, landed, buffer, work)
        self._sending = collections.deque()  # broadcasts after the update: (chunk, buffer, work)
        self._broken: str | None = None  # why the ranks are out of step, None while they are not
        self.reduces_in_backward = 0  # reductions started during backward (overlap_comm)

    # ------------------------------------------------------------ failures
    def check(self):
        """Raises DataParallelError once a failure left the ranks out of step."""
        if self._broken is not None:
            raise DataParallelError(
                f"tidal data parallel: {self._broken}, so this rank's 16-bit chunks hold "
                f"gradients where weights should be and the ranks are out of step; restart the "
                f"run from the last checkpoint")

    def mark_broken(self, reason: str):
        """A failure left the ranks out of step (`reason` says which): the
        collectives in flight are never waited for, and check() refuses from
        now on."""
        self._flight.clear()
        self._sending.clear()
        self._broken = reason

    # ----------------------------------------------------------- reductions
    def begin_backward(self):
        self._left = {chunk: len(recs) for chunk, recs in self._members.items()}
        self._counted.clear()
        self._next = 0
        self._flight.clear()
        self._sq.clear()

    def _here(self, chunk: int):
        """Where chunk `chunk`'s 16-bit values are now (during backward and the
        step they are read and written there, never moved: a slot of the chunk
        may still be attached); the buffers move to the backend's device."""
        space = self._store.chunks.chunk_space(chunk, PARAM16)
        return HOST if space == NOWHERE else space

    def grad_ready(self, param):
        """After a gradient landed (a hook on every trainable parameter, with
        overlap_comm): the chunks whose gradients are now all in, and every
        one before them in the reduction order, start their reductions while
        backward goes on."""
        r = self._store.by_param[id(param)]
        i = self._params.index(r)
        if not self._hooks.landed(i) or not self._left:
            return
        if self._pos[r.chunk] < self._next:
            # Its chunk's reduction started without this gradient: it would be
            # lost on the owner (a parameter reached twice in one backward, as
            # reentrant activation checkpointing does).
            raise DataParallelError(
                f"tidal data parallel: parameter '{r.name}' got a gradient after the reduction of "
                f"its chunk had started (a parameter reached twice in one backward, e.g. by "
                f"reentrant activation checkpointing); set tidal.data_parallel.overlap_comm to "
                f"false, or use torch.utils.checkpoint with use_reentrant=False")
        if i in self._counted:
            return
        self._counted.add(i)
        self._left[r.chunk] -= 1
        order, left = self._order, self._left
        while self._next < len(order) and left[order[self._next]] <= 0:
            self._launch(order[self._next])
            self.reduces_in_backward += 1

    def _launch(self, chunk: int):
        """Starts the reduction of chunk `chunk`'s gradients into its owner
        (the next in the order): its trainable records' slots packed into one
        buffer (frozen weights and padding never travel; a record without a
        gradient on this rank sends zeros, so every rank sends the same
        sizes). At most IN_FLIGHT run at once (the oldest is waited for before
        another starts); finished ones are written back."""
        dp, c = self.group, self._store.chunks
        recs = self._members[chunk]
        first = recs[0]
        flight = self._flight
        while len(flight) >= IN_FLIGHT or (flight and flight[0][3].is_completed()):
            self._finish(*flight.popleft())
        with torch.no_grad(), uncounted(), _dtr.outside():
            with self._store.slots(first, (PARAM16,), self._here(chunk)):  # pins the chunk
                view = c.chunk_view(chunk, PARAM16)
                landed = [self._hooks.landed(i) for i in self._params.indexes(recs)]
                parts = []
                for r, has in zip(recs, landed, strict=True):
                    off = c.placement(r.id)[1]
                    parts.append(view[off:off + r.numel] if has else
                                 torch.zeros(r.numel, dtype=view.dtype, device=view.device))
                buf = torch.cat(parts).to(dp.device)
            work = dp.reduce_async(buf, dp.owner(chunk), f"reduce the gradients of chunk {chunk}")
            flight.append((chunk, landed, buf, work))
            self._next += 1

    def _finish(self, chunk: int, landed, buf, work):
        """Waits for chunk `chunk`'s reduction; on its owner divides the sum by
        the number of ranks and copies it into the slots of the records that
        landed gradients, and adds its sum of squares to the global norm's share."""
        dp, c = self.group, self._store.chunks
        dp.wait(work, f"reduce the gradients of chunk {chunk}")
        if dp.rank != dp.owner(chunk):
            return
        recs = self._members[chunk]
        buf.div_(dp.world)
        pieces = buf.split([r.numel for r in recs])
        with torch.no_grad(), uncounted(), _dtr.outside():
            first = recs[0]
            with self._store.slots(first, (PARAM16,), self._here(chunk)):  # pins the chunk
                view = c.chunk_view(chunk, PARAM16)
                dst, src = [], []
                for r, has, piece in zip(recs, landed, pieces, strict=True):
                    if has:
                        off = c.placement(r.id)[1]
                        dst.append(view[off:off + r.numel])
                        src.append(piece.to(view.device))
                if dst:
                    torch._foreach_copy_(dst, src)
                    # (A 0-d tensor: no device sync inside backward's hooks.)
                    self._sq.append(sum(t.float().square().sum() for t in src))
        if self._overlap is not None:
            # Note [CPU Adam during backward]: the chunk's gradients are final.
            self._overlap.reduced(chunk, landed)

    def after_backward(self, landed_records, fold):
        """Note [Data parallel by chunk], steps 2 and 3: the chunks whose
        reductions did not start during backward start now, in the same order;
        every rank waits for all. Then the ranks check they landed the same
        parameters; under accumulation the owners fold the reduced gradients
        into their sums and broadcast the weights back.

        Args:
            landed_records: () -> the records whose 16-bit slot holds a
                landed gradient, in chunk order (GradientAccumulation.landed).
            fold: (chunk -> its owned records) -> None, the engine's fold of
                landed gradients into their accumulation sums; called under
                accumulation only, with the chunks this rank owns.
        """
        dp = self.group
        try:
            started_in_backward = self._next
            while self._next < len(self._order):
                self._launch(self._order[self._next])
            while self._flight:
                self._finish(*self._flight.popleft())
            sumsq = sum(float(x) for x in self._sq)
            self._sq.clear()
            self._left = {}
            landed = landed_records()
            records = self._params.record_list
            flags = torch.zeros(len(records), dtype=torch.int32)
            if landed:
                flags[self._params.indexes(landed)] = 1
            dp.all_reduce_flags(flags, "compare which parameters got gradients")
            odd = ((flags != 0) & (flags != dp.world)).nonzero().flatten().tolist()
            if odd:
                names = ", ".join(f"'{records[i].name}' ({int(flags[i])} of {dp.world} "
                                  f"ranks)" for i in odd[:4])
                raise DataParallelError(
                    f"tidal data parallel: parameters got gradients on some ranks only: {names}"
                    f"{' ...' if len(odd) > 4 else ''}; every rank's backward must reach the same "
                    f"parameters (unused parameters that differ between ranks are not supported: "
                    f"freeze them, or make the graph the same on every rank)")
            if dp.overlap and dp.world > 1 and started_in_backward < len(self._order) and \
                    not self._warned_unused:
                # A chunk waits for all its trainable parameters, and the later
                # chunks wait for it: a parameter that never gets a gradient
                # holds every reduction after it until the end of backward.
                # (One rank, under a one-process launcher: no reduction is
                # held, nothing to overlap, so nothing to say.)
                unused = [r.name for i, r in enumerate(records) if r.trainable and int(flags[i]) == 0]
                if unused:
                    self._warned_unused = True
                    warnings.warn(
                        f"tidal data parallel: trainable parameters got no gradient in this backward "
                        f"({', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}); the gradient "
                        f"reductions of their chunks and of every chunk after them wait for the end "
                        f"of backward instead of overlapping it (overlap_comm). Freeze parameters the "
                        f"model does not use (requires_grad=False before tidal.initialize)",
                        stacklevel=3)
            if self._accumulating:
                with torch.no_grad(), uncounted(), _dtr.outside():
                    owned = collections.defaultdict(list)
                    for r in landed:
                        if self._store.owns(r):
                            owned[r.chunk].append(r)
                    if owned:
                        fold(owned)
                    theirs = self._params.indexes([r for r in landed if not self._store.owns(r)])
                    self.broadcast({r.chunk for r in landed})
                    self._hooks.clear_landed(theirs)
            else:
                self._sumsq += sumsq
        except BaseException as e:
            self.mark_broken(f"reducing gradients failed ({type(e).__name__})")
            raise

    # ----------------------------------------------------- the global norm
    def global_sum_squares(self, sum_squares: float, finite: bool) -> tuple[float, bool]:
        """The global gradient norm's square and whether every gradient is
        finite, one all-reduce over the ranks. The landings measured this
        rank's own gradients (`sum_squares`, `finite`); the norm is of the
        reduced ones, each measured by its owner: without accumulation the
        owner's share is what the reductions measured, taken here; under
        accumulation the engine measured the owner's sums."""
        if not self._accumulating:
            sum_squares, finite = self._sumsq, math.isfinite(self._sumsq)
            self._sumsq = 0.0
        sum_squares, bad = self.group.all_reduce_sum(
            [sum_squares if finite else 0.0, 0.0 if finite else 1.0], "sum the gradient norm")
        return sum_squares, bad == 0

    def drop_gradient_norm(self):
        """zero_grad: the reduced gradients' share of the norm goes with them."""
        self._sumsq = 0.0

    # ----------------------------------------------------------- broadcasts
    def broadcast(self, chunks):
        """Each of `chunks`' 16-bit values (the span of its trainable
        parameters) from its owner to every rank, waited for (the step's
        overlapped broadcasts, one chunk after another). A failure leaves
        the ranks' weights apart: the ranks are out of step (mark_broken)."""
        try:
            for chunk in sorted(chunks):
                if chunk in self._spans:
                    self.share(chunk)
            self.shared()
        except BaseException as e:
            self.mark_broken(f"broadcasting parameters failed ({type(e).__name__})")
            raise

    def share(self, chunk: int):
        """Starts broadcasting chunk `chunk`'s 16-bit span from its owner
        (every rank calls this for every chunk of `chunks`, in the same order,
        the owner after its update of the chunk). The owner sends a copy and
        the others receive into a buffer, so the chunk is free to move
        meanwhile; at most IN_FLIGHT run at once."""
        dp, c = self.group, self._store.chunks
        first, lo, hi = self._spans[chunk]
        owner = dp.owner(chunk)
        flight = self._sending
        while len(flight) >= IN_FLIGHT or (flight and flight[0][2].is_completed()):
            self._shared_one(*flight.popleft())
        with torch.no_grad(), uncounted(), _dtr.outside():
            if dp.rank == owner:
                with self._store.slots(first, (PARAM16,), self._here(chunk)):  # pins the chunk
                    buf = c.chunk_view(chunk, PARAM16)[lo:hi].to(dp.device, copy=True)
            else:
                buf = torch.empty(hi - lo, dtype=self._store.dtype, device=dp.device)
            work = dp.broadcast_async(buf, owner, f"broadcast the parameters of chunk {chunk}")
        flight.append((chunk, buf, work))

    def _shared_one(self, chunk: int, buf, work):
        """Waits for chunk `chunk`'s broadcast; a rank that does not own it
        copies the values into its chunk."""
        dp, c = self.group, self._store.chunks
        dp.wait(work, f"broadcast the parameters of chunk {chunk}")
        if dp.rank == dp.owner(chunk):
            return
        first, lo, hi = self._spans[chunk]
        with torch.no_grad(), uncounted(), _dtr.outside():
            with self._store.slots(first, (PARAM16,), self._here(chunk)):  # pins the chunk
                view = c.chunk_view(chunk, PARAM16)
                view[lo:hi].copy_(buf)

    def shared(self):
        """Waits for every broadcast share() started."""
        while self._sending:
            self._shared_one(*self._sending.popleft())
