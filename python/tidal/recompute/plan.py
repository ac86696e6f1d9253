"""The plan installed on a model (Recompute): the wrapped forwards, the
memory-target plan chosen after the first forward measured every block, when
a run is replayed in backward, the offload copies and their prefetch in
backward order, and the counters.

The plan drives its runs (run.py) through their public methods; a run never
calls back into the plan."""

from __future__ import annotations

import collections
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from tidal import _C
from tidal import dtr as _dtr
from tidal.device import get_device

from .copies import CopyEvent, DeviceLink, contiguous_strides, dense, host_tensor
from .run import ParameterAliases, Run, chain_value, recomputing, storage_nbytes
from .segments import Segment, mark_offload, plan_for_target, qual


class Recompute:
    """A recompute plan installed on a model; made by :func:`recompute`.

    Attributes:
        model: the model.
        segments: the segments now in force (a memory-target plan changes them
            after the first forward, which measures).
        chain: (name, blocks) of the chain when the plan was made from one.
        report: for a plan made by :func:`from_config`, what tidal does with each key.
    """

    def __init__(self, model: nn.Module, segments: List[Segment], *, offload: bool, prefetch_depth: int,
                 offload_bandwidth: Optional[float], offload_latency: float, preserve_rng_state: bool,
                 synchronize_boundaries: bool, trace: bool, chain: Optional[Tuple[str, List[nn.Module]]],
                 memory_target: Optional[Union[int, str]]):
        self.model = model
        self.segments: List[Segment] = []
        self.chain = chain
        self.offload = offload
        self.prefetch_depth = prefetch_depth
        self.preserve_rng_state = preserve_rng_state
        self.synchronize_boundaries = synchronize_boundaries
        self.memory_target = memory_target
        self.report: Dict[str, str] = {}
        self._bandwidth = offload_bandwidth
        self._latency = offload_latency
        self._link: Optional[DeviceLink] = None
        self._cuda_streams: Dict[int, Any] = {}
        self._wrapped: Dict[nn.Module, Tuple[Optional[Callable], Callable]] = {}
        self._where: Dict[nn.Module, Tuple[Optional[Segment], int]] = {}
        self._open: Dict[int, Run] = {}        # segment index -> run whose forward is in progress
        self._order: List[weakref.ref] = []     # runs in forward order (backward walks it backwards)
        self._pending: collections.deque = collections.deque()  # runs whose d2h may still run
        self._next_run_id = 0
        self._active = True
        self._trace_on = trace
        self.trace: List[Dict[str, Any]] = []
        self._counters: Dict[str, float] = collections.Counter()
        self._measuring: Optional[Dict[str, List[Any]]] = None  # per block, filled by the first forward
        self._measured: Optional[Dict[str, List[int]]] = None
        self.target_estimate: Optional[int] = None
        # (pack, unpack) of the training engine's parameter aliases, or None.
        # See Note [Recompute under the training engine].
        self.parameter_aliases: Optional[ParameterAliases] = None
        self._lock = threading.Lock()
        self._set_segments(segments)
        todo = [m for seg in segments for m in seg.modules]
        if memory_target is not None:  # every block: the first forward measures them all
            todo += chain[1]  # type: ignore[index]
        try:
            for m in todo:
                self._wrap(m)
        except BaseException:
            self.remove()  # a failed call installs nothing
            raise

    # -- installing ------------------------------------------------------------
    def _set_segments(self, segments: List[Segment]) -> None:
        self.segments = segments
        where: Dict[nn.Module, Tuple[Optional[Segment], int]] = {}
        for seg in segments:
            for j, m in enumerate(seg.modules):
                where[m] = (seg, j)
        self._where = where

    def _wrap(self, module: nn.Module) -> None:
        if module in self._wrapped:
            return
        if getattr(module.__dict__.get("forward"), "_tidal_recompute_plan", None) is not None:
            raise ValueError(f"module {type(module).__name__} is already in a tidal.recompute plan; "
                             f"call plan.remove() on that plan first")
        had = module.__dict__.get("forward")
        orig = module.forward
        plan = self  # the model keeps its plan alive until plan.remove()

        def forward(*args, **kwargs):
            return plan._forward(module, orig, args, kwargs)

        forward._tidal_recompute_plan = plan  # type: ignore[attr-defined]
        module.forward = forward
        self._wrapped[module] = (had, orig)

    def remove(self) -> None:
        """Restores every wrapped module's original forward. Graphs built before
        still backpropagate (their runs keep what they need)."""
        for module, (had, _) in self._wrapped.items():
            if had is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = had
        self._wrapped.clear()
        self._active = False
        self._drain(wait=True)

    def __enter__(self) -> "Recompute":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @property
    def active(self) -> bool:
        """Whether the wrapped forwards recompute (False after ``remove()``)."""
        return self._active

    def __repr__(self) -> str:
        return (f"<tidal.Recompute {len(self.segments)} segment(s){' + offload' if self.offload else ''} "
                f"on {type(self.model).__name__}{'' if self._active else ' (removed)'}>")

    # -- forward ---------------------------------------------------------------
    def _forward(self, module: nn.Module, orig: Callable, args: tuple, kwargs: dict) -> Any:
        if (not self._active or recomputing() or not torch.is_grad_enabled()
                or torch.is_inference_mode_enabled()):
            return orig(*args, **kwargs)
        seg, j = self._where.get(module, (None, 0))
        measuring = self.memory_target is not None and self._measured is None
        if seg is None and not measuring:
            return orig(*args, **kwargs)
        if measuring:
            seg, j = self._measure_segment(module), 0
        self._drain()
        if j == 0:
            if self.synchronize_boundaries:
                self.synchronize()
            stale = self._open.pop(seg.index, None)
            if stale is not None and len(seg.modules) > 1:
                raise RuntimeError(f"tidal.recompute: {seg!r} started again before its last block "
                                   f"'{seg.names[-1]}' ran; the blocks of a segment must run in order.")
            run = Run(seg, self._next_run_id)
            self._next_run_id += 1
            if measuring:
                run.measure = []
                run.param_ptrs = frozenset(_C.chunks.storage_data_ptr(t)
                                           for t in list(module.parameters()) + list(module.buffers()))
            run.begin(args, kwargs, self.preserve_rng_state)
            x = run.ckpt
            if seg.offload and x is not None and x.numel() > 0:
                run.ckpt = None
                run.host = self._offload(run, x)
            self._trace("forward_begin", run)
        else:
            run = self._open.get(seg.index)
            if run is None:
                raise RuntimeError(f"tidal.recompute: {seg!r}: block '{seg.names[j]}' ran without "
                                   f"'{seg.names[0]}' before it; the blocks of a segment must run in order.")
            run.add_call(j, args, kwargs)
        self._open[seg.index] = run
        try:
            with torch.autograd.graph.saved_tensors_hooks(run.pack, self._unpack):
                out = orig(*args, **kwargs)
        except BaseException:
            self._open.pop(seg.index, None)
            raise
        run.next_block = j + 1
        if j + 1 < len(seg.modules):
            run.chain_out = chain_value(out)
            return out
        self._open.pop(seg.index, None)
        run.end(out)
        if run.meta:
            with self._lock:
                if len(self._order) >= 64:
                    self._order = [w for w in self._order if w() is not None]
                self._order.append(weakref.ref(run))
            self._counters["forward_runs"] += 1
        self._trace("forward_end", run)
        if measuring:
            self._record_measurement(module, run)
        return out

    # -- memory target: measure on the first forward, then choose ------------------
    def _measure_segment(self, module: nn.Module) -> Segment:
        name, blocks = self.chain  # type: ignore[misc]
        i = next(k for k, b in enumerate(blocks) if b is module)
        return Segment(-1 - i, [qual(name, i)], [module], False)

    def _record_measurement(self, module: nn.Module, run: Run) -> None:
        blocks = self.chain[1]  # type: ignore[index]
        if self._measuring is None:
            self._measuring = {"act": [0] * len(blocks), "inp": [0] * len(blocks), "seen": [False] * len(blocks)}
        m = self._measuring
        i = next(k for k, b in enumerate(blocks) if b is module)
        sizes = {_C.chunks.storage_data_ptr(t): storage_nbytes(t) for t in run.measure or ()}
        m["act"][i] = sum(n for ptr, n in sizes.items() if ptr not in run.param_ptrs)
        run.measure = None
        ck = run.ckpt if run.ckpt is not None else run.d2h_src
        m["inp"][i] = storage_nbytes(ck) if ck is not None else 0
        m["seen"][i] = True
        if all(m["seen"]):
            self._measured = {"act": m["act"], "inp": m["inp"]}
            self._choose_for_target()

    def _choose_for_target(self) -> None:
        act, inp = self._measured["act"], self._measured["inp"]  # type: ignore[index]
        target = None if self.memory_target == "min" else int(self.memory_target)  # type: ignore[arg-type]
        choice = plan_for_target(act, inp, target)
        if choice is None:
            choice = plan_for_target(act, inp, None)
            warnings.warn(f"tidal.recompute: memory_target={target} bytes cannot be met: the smallest "
                          f"estimate for this chain is {choice[2]} bytes (checkpoints + one segment); "
                          f"using that plan", stacklevel=4)
        m, k, est = choice
        self.target_estimate = est
        name, blocks = self.chain  # type: ignore[misc]
        segs = []
        for s in range(0, m, k):
            idx = list(range(s, min(s + k, m)))
            segs.append(Segment(len(segs), [qual(name, i) for i in idx], [blocks[i] for i in idx], False))
        # With kept blocks after them, every segment's backward waits for theirs.
        mark_offload(segs, self.offload, keep_last=m == len(blocks))
        self._set_segments(segs)

    # -- backward: the first unpack of a run replays it ---------------------------
    def _unpack(self, handle: Tuple[Run, int]) -> torch.Tensor:
        run, i = handle
        v = run.take(i)
        if v is None:
            self._before_recompute(run)
            self._recompute(run)
            v = run.take(i)
        aliases = self.parameter_aliases
        return aliases[1](v) if aliases is not None else v  # type: ignore[return-value]

    def _checkpoint(self, run: Run) -> Optional[torch.Tensor]:
        """A run's checkpoint on the device, waiting for its prefetch if it was offloaded."""
        if run.host is None:
            return run.ckpt
        if run.h2d is None:
            self._prefetch(run, late=True)
        waited = self._wait(run)
        self._trace("use", run, waited=waited)
        return run.prefetched

    def _recompute(self, run: Run) -> None:
        ck = self._checkpoint(run)
        run.check_input(ck)
        t0 = time.perf_counter()
        self._trace("recompute_begin", run)
        run.replay(ck, self.parameter_aliases)
        # The recomputed tensors hold what they need of the checkpoint; a second
        # backward (retain_graph) brings it back again.
        run.prefetched, run.h2d = None, None
        seconds = time.perf_counter() - t0
        self._counters["recomputes"] += 1
        self._counters["recompute_seconds"] += seconds
        self._trace("recompute_end", run, seconds=seconds)

    # -- offload -------------------------------------------------------------------
    def _cuda_stream(self, device: torch.device):
        s = self._cuda_streams.get(device.index)
        if s is None:
            s = self._cuda_streams[device.index] = torch.cuda.Stream(device)
        return s

    def _device_link(self) -> DeviceLink:
        """The link of copies that are not on CUDA: the simulated device's own
        (shared with the chunk copies), or a simulated link of their own when
        offload_bandwidth / offload_latency_us were given or the process-wide
        device is not simulated (a CPU model beside a GPU: unlimited)."""
        if self._link is None:
            device = get_device()
            own = self._bandwidth is not None or self._latency > 0 or device.backend != "sim"
            if own:
                bandwidth = None if self._bandwidth is None else f"{max(1, round(self._bandwidth))}B/s"
                device = _C.create_device("sim", "1MiB", bandwidth, self._latency * 1e6)
            self._link = DeviceLink(device, shared=not own)
        return self._link

    def _offload(self, run: Run, x: torch.Tensor) -> torch.Tensor:
        """Starts the device->host copy of a checkpoint; returns the host tensor."""
        run.device = x.device
        self._counters["offloaded_bytes"] += x.numel() * x.element_size()
        self._counters["offloads"] += 1
        if x.is_cuda:
            stream = self._cuda_stream(x.device)
            host = torch.empty_strided(x.size(), x.stride() if dense(x) else contiguous_strides(x.size()),
                                       dtype=x.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            ev = CopyEvent("d2h", x.numel() * x.element_size(), run.id)
            with torch.cuda.stream(stream):
                host.copy_(x, non_blocking=True)
                ev._cuda = torch.cuda.Event()
                ev._cuda.record(stream)
            x.record_stream(stream)  # the allocator reuses x's memory only after the copy
            run.d2h = ev
        else:
            with _dtr.outside():
                if not dense(x):  # a copy moves bytes in order: make them dense first
                    x = x.contiguous()
                run.host_buffer, host = host_tensor(x.size(), x.stride(), x.dtype)
            run.d2h = self._device_link().d2h(run.host_buffer, x, run.id)
            run.d2h_src = x  # released by _drain() once the copy is done, as a GPU frees it
            with self._lock:
                self._pending.append(run)
        self._trace("d2h_issued", run, nbytes=run.d2h.nbytes)
        return host

    def _drain(self, wait: bool = False) -> None:
        """Releases the device copies of checkpoints whose device->host copy is done."""
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        keep = []
        for run in pending:
            if run.d2h is not None and (wait or run.d2h.query()):
                if wait:
                    run.d2h.synchronize()
                run.d2h_src = None
                self._trace("d2h_done", run, started=run.d2h.started_at, completed=run.d2h.completed_at)
            else:
                keep.append(run)
        if keep:
            with self._lock:
                self._pending.extendleft(reversed(keep))

    def _prefetch(self, run: Run, late: bool = False) -> None:
        """Starts the host->device copy of an offloaded checkpoint."""
        if run.host is None or run.h2d is not None:
            return
        host = run.host
        self._counters["prefetches"] += 1
        self._counters["late_prefetches"] += int(late)
        if run.device is not None and run.device.type == "cuda":
            stream = self._cuda_stream(run.device)
            ev = CopyEvent("h2d", host.numel() * host.element_size(), run.id)
            with torch.cuda.stream(stream):
                dst = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=run.device)
                dst.copy_(host, non_blocking=True)
                ev._cuda = torch.cuda.Event()
                ev._cuda.record(stream)
        else:
            with _dtr.outside():
                dst = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype)
            ev = self._device_link().h2d(dst, run.host_buffer, run.id)
        run.prefetched, run.h2d = dst, ev
        self._trace("h2d_issued", run, nbytes=ev.nbytes, late=late)

    def _wait(self, run: Run) -> float:
        ev = run.h2d
        assert ev is not None
        if ev._cuda is not None:
            cur = torch.cuda.current_stream(run.prefetched.device)  # type: ignore[union-attr]
            cur.wait_event(ev._cuda)
            run.prefetched.record_stream(cur)  # type: ignore[union-attr]
            waited = 0.0
        else:
            waited = ev.synchronize()
        self._counters["copy_wait_seconds"] += waited
        self._trace("h2d_done", run, started=ev.started_at, completed=ev.completed_at)
        return waited

    def _before_recompute(self, run: Run) -> None:
        """A segment's backward begins: prefetch the next ones in backward order."""
        if self.synchronize_boundaries:
            self.synchronize()
        self._drain()
        if not self.offload:
            return
        with self._lock:
            runs = [r() for r in self._order]
            self._order = [w for w, r in zip(self._order, runs) if r is not None and not r.done_backward]
        alive = [r for r in runs if r is not None]
        run.done_backward = True
        try:
            pos = alive.index(run)
        except ValueError:
            return
        if run.host is not None and run.h2d is None:
            self._prefetch(run, late=True)
        issued = 0
        for earlier in reversed(alive[:pos]):
            if issued >= self.prefetch_depth:
                break
            if earlier.host is not None and not earlier.done_backward:
                self._prefetch(earlier)
                issued += 1

    def synchronize(self) -> None:
        """Waits for the device and the copy stream, and releases the device copies
        of checkpoints whose offload is done (otherwise released at the next
        segment boundary)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if self._link is not None:
            self._link.synchronize()
        self._drain(wait=True)

    # -- reporting -----------------------------------------------------------------
    def _trace(self, what: str, run: Run, **info: Any) -> None:
        if self._trace_on:
            self.trace.append({"event": what, "segment": run.seg.index, "run": run.id,
                               "t": time.perf_counter(), **info})

    def stats(self) -> Dict[str, Any]:
        """Counters since the plan was made: forward_runs, recomputes,
        recompute_seconds, offloads, offloaded_bytes, prefetches,
        late_prefetches (issued only when the segment needed its checkpoint),
        copy_wait_seconds (host time spent waiting for prefetches), and
        copy_engine ("cuda"; the device layer's link: its backend, whether the
        chunk copies share it, bandwidth and latency; or None before a copy)."""
        out: Dict[str, Any] = {k: self._counters.get(k, 0) for k in (
            "forward_runs", "recomputes", "recompute_seconds", "offloads", "offloaded_bytes", "prefetches",
            "late_prefetches", "copy_wait_seconds")}
        out["segments"] = len(self.segments)
        if self._cuda_streams:
            out["copy_engine"] = "cuda"
        elif self._link is not None:
            out["copy_engine"] = self._link.info()
        else:
            out["copy_engine"] = None
        if self._measured is not None:
            out["measured"] = dict(self._measured)
            out["target_estimate"] = self.target_estimate
        return out

    def stored_checkpoints(self) -> List[torch.Tensor]:
        """The checkpoints live runs keep on the device now (offloaded ones only
        while their copy runs or once prefetched)."""
        with self._lock:
            runs = [r() for r in self._order]
        out = []
        for r in runs:
            if r is None:
                continue
            for t in (r.ckpt, r.d2h_src, r.prefetched):
                if t is not None:
                    out.append(t)
        return out
