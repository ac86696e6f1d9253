"""The engine's data-parallel side: the process group set up at initialize,
the per-chunk gradient reductions overlapping backward and the step's
broadcasts of the owners' updated chunks (docs/data_parallel.md).

A mixin of Engine (engine.py), split from it along its sections; it uses
the engine's attributes set in Engine.__init__."""
from __future__ import annotations

import collections
import warnings
import zlib

import torch

from .. import dtr as _dtr
from ..config import ConfigError
from ..data_parallel import IN_FLIGHT, DataParallelError
from .store import HOST, NOWHERE, PARAM16, uncounted

from .common import _PER_MACHINE_KEYS


class DataParallelMixin:
    def _setup_data_parallel(self, model, cfg):
        """Note [Data parallel by chunk] in tidal/data_parallel.py: every rank
        must hold the same model in the same chunks, with the same config."""
        if cfg.dtr and cfg.dtr.get("enabled", True):
            raise ConfigError(
                "config keys 'tidal.dtr' and data parallel: DTR under the engine is not supported "
                "with data parallel yet (a recompute in backward may read the master weights of a "
                "chunk another rank owns); turn one off (tidal.dtr.enabled: false, or "
                "tidal.data_parallel.enabled: false)")
        c = self.chunks
        layout = [[r.name, list(r.shape), bool(r.trainable), list(c.placement(r.id))]
                  for r in self._params.records]
        # Memory budgets and tuning may differ between machines; the rest may not.
        raw = dict(cfg.raw)
        raw["tidal"] = {k: v for k, v in cfg.raw["tidal"].items() if k not in _PER_MACHINE_KEYS}
        # The initial 16-bit values too: DDP would broadcast rank 0's, but a
        # rank that built other weights has a seeding bug worth hearing of.
        weights = []
        with torch.no_grad(), uncounted():
            for r in self._params.records:
                with self.store.slots(r, (PARAM16,), HOST) as (view,):
                    weights.append(zlib.crc32(view.view(torch.uint8).numpy()))
        self.dp.check_same({"config": raw, "model and chunk layout": layout,
                            "parameter groups": self._group_state(), "initial weights": weights})
        # The unit of the gradient reductions: each chunk's trainable records,
        # reduced in one fixed order by every rank (the last chunk first, as
        # backward reaches them), so the ranks' collectives match whenever
        # each rank's chunks become final.
        members = collections.defaultdict(list)
        for r in self._params.records:
            if r.trainable:
                members[r.chunk].append(r)
        self._dp_members = dict(sorted(members.items()))
        # The unit of the broadcasts: (first record, start, end) of the span
        # of each such chunk's trainable records.
        self._dp_spans = {}
        for chunk, recs in self._dp_members.items():
            offs = [c.placement(r.id)[1] for r in recs]
            self._dp_spans[chunk] = (recs[0], min(offs),
                                     max(o + r.numel for o, r in zip(offs, recs, strict=True)))
        self._dp_order = sorted(members, reverse=True)
        self._dp_pos = {chunk: i for i, chunk in enumerate(self._dp_order)}
        self._dp_left: dict[int, int] = {}
        self._dp_counted: set[int] = set()  # records counted in this backward
        self._dp_sq: list = []  # sums of squares of the owner's reduced gradients (0-d tensors)
        self._dp_warned_unused = False
        self._dp_next = len(self._dp_order)
        self._dp_flight = collections.deque()  # reductions: (chunk, landed, buffer, work)
        self._dp_sending = collections.deque()  # broadcasts after the update: (chunk, buffer, work)
        self._dp_in_backward = 0

    # ------------------------------------------------------- data parallel
    def _dp_check(self):
        if self._dp_broken is not None:
            raise DataParallelError(
                f"tidal data parallel: {self._dp_broken}, so this rank's 16-bit chunks hold "
                f"gradients where weights should be and the ranks are out of step; restart the "
                f"run from the last checkpoint")

    def _dp_begin_backward(self):
        self._dp_left = {chunk: len(recs) for chunk, recs in self._dp_members.items()}
        self._dp_counted.clear()
        self._dp_next = 0
        self._dp_flight.clear()
        self._dp_sq.clear()

    def _dp_here(self, chunk: int):
        """Where chunk `chunk`'s 16-bit values are now (during backward and the
        step they are read and written there, never moved: a slot of the chunk
        may still be attached); the buffers move to the backend's device."""
        space = self.chunks.chunk_space(chunk, PARAM16)
        return HOST if space == NOWHERE else space

    def _dp_grad_ready(self, param):
        """After a gradient landed (a hook on every trainable parameter, with
        overlap_comm): the chunks whose gradients are now all in, and every
        one before them in the reduction order, start their reductions while
        backward goes on."""
        r = self.store.by_param[id(param)]
        i = self._params.record_index[id(r)]
        if not self._hooks.landed(i) or not self._dp_left:
            return
        if self._dp_pos[r.chunk] < self._dp_next:
            # Its chunk's reduction started without this gradient: it would be
            # lost on the owner (a parameter reached twice in one backward, as
            # reentrant activation checkpointing does).
            raise DataParallelError(
                f"tidal data parallel: parameter '{r.name}' got a gradient after the reduction of "
                f"its chunk had started (a parameter reached twice in one backward, e.g. by "
                f"reentrant activation checkpointing); set tidal.data_parallel.overlap_comm to "
                f"false, or use torch.utils.checkpoint with use_reentrant=False")
        if i in self._dp_counted:
            return
        self._dp_counted.add(i)
        self._dp_left[r.chunk] -= 1
        order, left = self._dp_order, self._dp_left
        while self._dp_next < len(order) and left[order[self._dp_next]] <= 0:
            self._dp_launch(order[self._dp_next])
            self._dp_in_backward += 1

    def _dp_launch(self, chunk: int):
        """Starts the reduction of chunk `chunk`'s gradients into its owner
        (the next in the order): its trainable records' slots packed into one
        buffer (frozen weights and padding never travel; a record without a
        gradient on this rank sends zeros, so every rank sends the same
        sizes). At most IN_FLIGHT run at once (the oldest is waited for before
        another starts); finished ones are written back."""
        dp, c = self.dp, self.chunks
        recs = self._dp_members[chunk]
        index = self._params.record_index
        first = recs[0]
        flight = self._dp_flight
        while len(flight) >= IN_FLIGHT or (flight and flight[0][3].is_completed()):
            self._dp_finish(*flight.popleft())
        with torch.no_grad(), uncounted(), _dtr.outside():
            with self.store.slots(first, (PARAM16,), self._dp_here(chunk)):  # pins the chunk
                view = c.chunk_view(chunk, PARAM16)
                landed = [self._hooks.landed(index[id(r)]) for r in recs]
                parts = []
                for r, has in zip(recs, landed, strict=True):
                    off = c.placement(r.id)[1]
                    parts.append(view[off:off + r.numel] if has else
                                 torch.zeros(r.numel, dtype=view.dtype, device=view.device))
                buf = torch.cat(parts).to(dp.device)
            work = dp.reduce_async(buf, dp.owner(chunk), f"reduce the gradients of chunk {chunk}")
            flight.append((chunk, landed, buf, work))
            self._dp_next += 1

    def _dp_finish(self, chunk: int, landed, buf, work):
        """Waits for chunk `chunk`'s reduction; on its owner divides the sum by
        the number of ranks and copies it into the slots of the records that
        landed gradients, and adds its sum of squares to the global norm's share."""
        dp, c = self.dp, self.chunks
        dp.wait(work, f"reduce the gradients of chunk {chunk}")
        if dp.rank != dp.owner(chunk):
            return
        recs = self._dp_members[chunk]
        buf.div_(dp.world)
        pieces = buf.split([r.numel for r in recs])
        with torch.no_grad(), uncounted(), _dtr.outside():
            first = recs[0]
            with self.store.slots(first, (PARAM16,), self._dp_here(chunk)):  # pins the chunk
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
                    self._dp_sq.append(sum(t.float().square().sum() for t in src))
        if self._overlap is not None:
            # Note [CPU Adam during backward]: the chunk's gradients are final.
            self._overlap.reduced(chunk, landed)

    def _dp_after_backward(self):
        """Note [Data parallel by chunk], steps 2 and 3: the chunks whose
        reductions did not start during backward start now, in the same order;
        every rank waits for all. Then the ranks check they landed the same
        parameters; under accumulation the owners fold the reduced gradients
        into their sums and broadcast the weights back."""
        dp = self.dp
        try:
            started_in_backward = self._dp_next
            while self._dp_next < len(self._dp_order):
                self._dp_launch(self._dp_order[self._dp_next])
            while self._dp_flight:
                self._dp_finish(*self._dp_flight.popleft())
            sumsq = sum(float(x) for x in self._dp_sq)
            self._dp_sq.clear()
            self._dp_left = {}
            landed = self._accumulation.landed()
            index = self._params.record_index
            flags = torch.zeros(len(self._params.record_list), dtype=torch.int32)
            if landed:
                flags[[index[id(r)] for r in landed]] = 1
            dp.all_reduce_flags(flags, "compare which parameters got gradients")
            odd = ((flags != 0) & (flags != dp.world)).nonzero().flatten().tolist()
            if odd:
                names = ", ".join(f"'{self._params.record_list[i].name}' ({int(flags[i])} of {dp.world} "
                                  f"ranks)" for i in odd[:4])
                raise DataParallelError(
                    f"tidal data parallel: parameters got gradients on some ranks only: {names}"
                    f"{' ...' if len(odd) > 4 else ''}; every rank's backward must reach the same "
                    f"parameters (unused parameters that differ between ranks are not supported: "
                    f"freeze them, or make the graph the same on every rank)")
            if dp.overlap and started_in_backward < len(self._dp_order) and not self._dp_warned_unused:
                # A chunk waits for all its trainable parameters, and the later
                # chunks wait for it: a parameter that never gets a gradient
                # holds every reduction after it until the end of backward.
                unused = [r.name for r in self._params.records if r.trainable and int(flags[index[id(r)]]) == 0]
                if unused:
                    self._dp_warned_unused = True
                    warnings.warn(
                        f"tidal data parallel: trainable parameters got no gradient in this backward "
                        f"({', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}); the gradient "
                        f"reductions of their chunks and of every chunk after them wait for the end "
                        f"of backward instead of overlapping it (overlap_comm). Freeze parameters the "
                        f"model does not use (requires_grad=False before tidal.initialize)",
                        stacklevel=3)
            if self._accumulation.summing:
                with torch.no_grad(), uncounted(), _dtr.outside():
                    owned = collections.defaultdict(list)
                    for r in landed:
                        if self.store.owns(r):
                            owned[r.chunk].append(r)
                    if owned:
                        self._accumulation.fold_chunks(owned, self._host_short())
                    theirs = [index[id(r)] for r in landed if not self.store.owns(r)]
                    self._dp_broadcast({r.chunk for r in landed})
                    self._hooks.clear_landed(theirs)
            else:
                self._dp_sumsq += sumsq
        except BaseException as e:
            self._dp_flight.clear()
            self._dp_broken = f"reducing gradients failed ({type(e).__name__})"
            raise

    def _dp_broadcast(self, chunks):
        """Each of `chunks`' 16-bit values (the span of its trainable
        parameters) from its owner to every rank, waited for (the step's
        overlapped broadcasts, one chunk after another). A failure leaves
        the ranks' weights apart: the engine is broken."""
        try:
            for chunk in sorted(chunks):
                if chunk in self._dp_spans:
                    self._dp_share(chunk)
            self._dp_shared()
        except BaseException as e:
            self._dp_sending.clear()
            self._dp_broken = f"broadcasting parameters failed ({type(e).__name__})"
            raise

    def _dp_share(self, chunk: int):
        """Starts broadcasting chunk `chunk`'s 16-bit span from its owner
        (every rank calls this for every chunk with a trainable parameter, in
        the same order, the owner after its update of the chunk). The owner
        sends a copy and the others receive into a buffer, so the chunk is
        free to move meanwhile; at most IN_FLIGHT run at once."""
        dp, c = self.dp, self.chunks
        first, lo, hi = self._dp_spans[chunk]
        owner = dp.owner(chunk)
        flight = self._dp_sending
        while len(flight) >= IN_FLIGHT or (flight and flight[0][2].is_completed()):
            self._dp_shared_one(*flight.popleft())
        with torch.no_grad(), uncounted(), _dtr.outside():
            if dp.rank == owner:
                with self.store.slots(first, (PARAM16,), self._dp_here(chunk)):  # pins the chunk
                    buf = c.chunk_view(chunk, PARAM16)[lo:hi].to(dp.device, copy=True)
            else:
                buf = torch.empty(hi - lo, dtype=self.dtype, device=dp.device)
            work = dp.broadcast_async(buf, owner, f"broadcast the parameters of chunk {chunk}")
        flight.append((chunk, buf, work))

    def _dp_shared_one(self, chunk: int, buf, work):
        """Waits for chunk `chunk`'s broadcast; a rank that does not own it
        copies the values into its chunk."""
        dp, c = self.dp, self.chunks
        dp.wait(work, f"broadcast the parameters of chunk {chunk}")
        if dp.rank == dp.owner(chunk):
            return
        first, lo, hi = self._dp_spans[chunk]
        with torch.no_grad(), uncounted(), _dtr.outside():
            with self.store.slots(first, (PARAM16,), self._dp_here(chunk)):  # pins the chunk
                view = c.chunk_view(chunk, PARAM16)
                view[lo:hi].copy_(buf)

    def _dp_shared(self):
        """Waits for every broadcast _dp_share started."""
        while self._dp_sending:
            self._dp_shared_one(*self._dp_sending.popleft())
