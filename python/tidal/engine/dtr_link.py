"""The training engine's side of DTR: parameters for replays, and the arbiter.

Note [DTR under the training engine]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A config with ``"tidal": {"dtr": {"enabled": true, ...}}`` turns DTR on when
the engine is built (tidal.dtr.from_config); DTR turned on by hand
(tidal.dtr.enable()) is handled the same way, except for the threshold.

Parameters: the engine is a parameter provider for tidal.dtr (Note [DTR with
chunk-managed parameters] in tidal/dtr.py). A recipe that reads a parameter
keeps (record, geometry); a replay attaches the parameter again (its chunk
comes to the device through the scheduler, as for a module's use) and
detaches it after the replayed op. After a parameter's gradient hook and
before the step its 16-bit slot holds the gradient: a replay then reads a
temporary copy of the fp32 master cast to 16 bits, which is the weight the
slot held (CPU Adam writes the 16-bit weights from the master; the
optimizer-step restart below brings back user-held tensors this way).

Weights change: engine.step() (and loading weights) ends the DTR session
first (every evicted tensor still reachable comes back, records are
forgotten) and starts a new one afterwards, so no recipe spans a change of
the weights; weights_epoch guards it.

The arbiter (when the config enables DTR): activations and chunks share the
device budget B less the margin M. At each hook the chunk budget is B - M -
the non-chunk memory expected before the next hook (Note [The memory
tracer]). DTR's eviction threshold is B - M - the bytes of chunks held on the
device (ModuleHooks::dtr_threshold), set at every hook and after every attach,
detach and landed gradient, and capped by the block's eviction_threshold when
one is given. When DTR has to evict, the arbiter compares per byte, for each
eviction (Note [The arbiter between chunks and activations] in
hooks/dtr/storage_runtime.h): the activation DTR would evict costs its
regeneration (measured op times) over its bytes, a chunk moved off the device
costs its copy out now and back later (2 / link bandwidth per byte). The
cheaper goes: a chunk the running module does not use leaves (the scheduler
picks which), raising DTR's threshold by what it freed, or the activation is
evicted. The link is the simulated device's configured bandwidth, or on CUDA
one chunk copied each way at start (measure_link). With no link known
(ARBITER = False, or a link that measured 0) a chunk never wins, and chunks
give way only through the tracer's budgets: "chunks before activations".
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

from .. import _C
from .. import dtr as _dtr


# False: DTR's evictions never go to chunks (chunks give way only through
# the tracer's plan: the rule before the arbiter); benchmarks/dtr_batch.py's
# peer for the arbiter.
ARBITER = True

_COUNTERS = ("evictions", "recomputes", "recompute_seconds", "chunk_evictions", "chunk_bytes_freed")
_PEAKS = ("peak_tracked_bytes", "max_op_working_set")


def _live(ref):
    link = ref()
    if link is None:
        raise _C.InternalError("tidal.dtr: a recipe reads a parameter of an engine that is gone")
    return link


class DtrLink:
    """Registered with tidal.dtr as a parameter provider for one engine.

    It holds no reference to the engine, nor to its store: tidal.dtr keeps
    it registered until the engine is collected, and a store reachable from
    here would outlive that collection. What it reads is given: at
    construction the config's dtr block; at start(), once they exist, the
    ModuleHooks, the HookWiring and the ParamStore (read there only: the
    device budget, the margin, the link the arbiter prices a chunk's round
    trip with). The engine registers abandon_with(engine), so a collected
    engine's provider goes and a DTR session of its cycle ends.

    Args:
        block: the config's "dtr" block (may be empty).
    """

    def __init__(self, block: dict):
        self._epoch = 0
        self._replay_attached: list = []
        self._block = block
        self.enabled_by_config = _dtr.config_enables(block)
        self.cap = _dtr.validate_config(block).get("eviction_threshold", 0) if block else 0
        self.replay_attaches = 0
        self._ended = {k: 0 for k in _COUNTERS + _PEAKS}
        self.cpp = None
        self._hooks = None  # the engine's ModuleHooks, from start()
        self._wiring = None  # its HookWiring (weakly), from start()
        self._owns = False  # the DTR session running is this engine's cycle's
        self._effective_block = block

    def start(self, *, hooks, wiring, store):
        """Registers the engine with tidal.dtr once its ModuleHooks exist, and
        applies the config's dtr block ("enabled": false leaves DTR as it is).

        Args:
            hooks: the engine's ModuleHooks (the arbiter's formula, the replays' aliases).
            wiring: the engine's HookWiring, held weakly (it lives as long as
                the engine): it answers the replays' reads of parameters.
            store: the engine's ParamStore: its device budget, margin and link.
        """
        self._hooks = hooks
        self._wiring = weakref.ref(wiring)
        # The C++ interception's view of the parameters: alias lookups in C++
        # (ModuleHooks::attached_at), replays through view() below. The
        # callbacks hold this link weakly (it holds them).
        me = weakref.ref(self)
        self.cpp = _C.dtr.ParamProvider(
            hooks,
            lambda i, size, stride, offset: _live(me).view(_live(me).record(i), size, stride, offset),
            lambda: _live(me).end_replay_step(),
            lambda i: _live(me).record(i).name)
        self.cpp.weights_epoch = self._epoch
        # The arbiter's formula lives in ModuleHooks, which applies it at
        # every attach, detach and landed gradient (rebalance() below for
        # the engine's Python paths).
        # With a known link bandwidth (the simulated device's configured one,
        # or on CUDA the one measure_link times at start), each of DTR's
        # evictions goes to a chunk or an activation by cost (Note [The
        # arbiter between chunks and activations] in
        # hooks/dtr/storage_runtime.h); with none, chunks give way first.
        link = _link_bytes_per_s(store) if ARBITER and self.enabled_by_config else 0.0
        self.link_bytes_per_s = link
        hooks.set_dtr_arbiter(bool(self.enabled_by_config), store.device_budget - store.margin, self.cap, link)
        _dtr.register_param_provider(self)
        if self.enabled_by_config:
            block = dict(self._block)
            if "evictee_minimum_size" not in block:
                # Note [DTR's defaults under the engine]: MegEngine's 1 MiB is
                # a GPU-sized default; in a budget of a few MiB no activation
                # is that large and DTR could evict nothing. Under the engine
                # the default follows the budget: (budget - margin) / 1024,
                # between 4 KiB and 1 MiB.
                limit = store.device_budget - store.margin
                block["evictee_minimum_size"] = min(1 << 20, max(4096, limit // 1024))
            _dtr.validate_config(block)  # (a bad key fails at initialize)
            self._effective_block = block

    def abandon_with(self, owner) -> None:
        """When `owner` (the engine) is collected, this provider goes and a DTR
        session of its cycle ends (Note [DTR belongs to the engine's cycle]).
        The finalizer holds this link weakly."""
        weakref.finalize(owner, _engine_gone, weakref.ref(self))

    # ------------------------------------------------------------- the cycle
    # Note [DTR belongs to the engine's cycle]: with DTR in the config, DTR
    # intercepts ops from the start of a forward (begin(), at the root's
    # forward pre-hook) to the end of that forward's backward, or of the
    # forward itself under no_grad (end()); the step, checkpoints and
    # anything the script does between cycles run without it. An error in
    # forward, backward or the step ends the cycle (end(failed=True)), and so
    # does the engine being collected: plain PyTorch code in the same process
    # never meets a session the engine left behind, and the next (smaller)
    # batch starts a fresh one. DTR turned on by hand (tidal.dtr.enable())
    # stays the script's: the engine only pauses it around weight changes.
    def begin(self):
        if self.enabled_by_config and not _dtr.is_enabled():
            _dtr.from_config(self._effective_block)
            self._owns = True
            self.rebalance()

    def end(self, failed: bool = False):
        if not self._owns:
            return
        self._owns = False
        if not _dtr.is_enabled():
            return
        try:
            self._add(_dtr._suspend())
        except Exception as e:  # noqa: BLE001 -- bringing tensors back after a failure
            if not failed:
                raise
            warnings.warn(f"tidal.dtr: ending the failed step's DTR session could not bring every "
                          f"evicted tensor back ({e}); tensors of that step are gone", stacklevel=3)
            _dtr._force_off()

    @property
    def weights_epoch(self) -> int:
        return self._epoch

    @weights_epoch.setter
    def weights_epoch(self, value: int):
        self._epoch = value
        if self.cpp is not None:
            self.cpp.weights_epoch = value

    # -------------------------------------------------- provider protocol
    def _live_wiring(self):
        w = None if self._wiring is None else self._wiring()
        if w is None:
            raise _C.InternalError("tidal.dtr: a recipe reads a parameter of an engine that is gone")
        return w

    def alias(self, t):
        w = None if self._wiring is None else self._wiring()
        return None if w is None else w.param_record_of(t)

    def record(self, i: int):
        return self._live_wiring().replay_record(i)

    def view(self, record, size, stride, offset):
        t, attached = self._live_wiring().replay_view(record, size, stride, offset)
        if attached:
            self._replay_attached.append(record)
            self.replay_attaches += 1
        return t

    def end_replay_step(self):
        if not self._replay_attached:
            return
        w = None if self._wiring is None else self._wiring()
        replayed, self._replay_attached = self._replay_attached, []
        if w is not None:
            w.release_replayed(replayed)

    # ------------------------------------------------------------ arbiter
    def rebalance(self):
        """DTR's threshold = device budget - margin - chunks held on the device."""
        if not self.enabled_by_config or not _dtr.is_enabled():
            return
        _dtr._set_eviction_threshold(self._hooks.dtr_threshold())

    # ----------------------------------------------------- weights change
    @contextlib.contextmanager
    def weights_change(self):
        """Ends the DTR session for a block that changes the weights (the
        optimizer step, loading a checkpoint): the engine's cycle ends there
        (the next forward starts a session); DTR turned on by hand is paused
        and goes on after."""
        self.end()
        on = _dtr.is_enabled()
        if on:
            self._add(_dtr._suspend())
        try:
            yield
        finally:
            self.weights_epoch += 1
            if on:
                _dtr.enable()
                self.rebalance()

    def _add(self, s: dict):
        for k in _COUNTERS:
            self._ended[k] += s.get(k, 0)
        for k in _PEAKS:
            self._ended[k] = max(self._ended[k], s.get(k, 0))

    def report(self) -> dict:
        """DTR counters over every session this engine ran (sessions end at each step)."""
        out = dict(self._ended)
        if _dtr.is_enabled():
            live = _dtr.stats()
            for k in _COUNTERS:
                out[k] += live.get(k, 0)
            for k in _PEAKS:
                out[k] = max(out[k], live.get(k, 0))
        out["enabled"] = _dtr.is_enabled()
        out["managed_threshold"] = self.enabled_by_config
        out["replay_attaches"] = self.replay_attaches
        return out


def _engine_gone(ref):
    """weakref.finalize of the engine: its provider goes, and a DTR session of
    its cycle ends (Note [DTR belongs to the engine's cycle])."""
    link = ref()
    if link is None:
        return
    _dtr.unregister_param_provider(link)
    link.end(failed=True)


def _link_bytes_per_s(store) -> float:
    """The host-device link the arbiter prices a chunk's round trip with: the
    simulated device's configured bandwidth, or on CUDA one chunk copied each
    way once, timed with the device layer's events (the slower direction)."""
    info = store.device.info()
    if info.get("backend") != "cuda":
        return float(info.get("sim_copy_bandwidth", 0.0))
    return measure_link(store.device, store.config.chunk_size)


def measure_link(device, nbytes: int) -> float:
    """Bytes per second of one `nbytes` copy host->device and one back (the
    slower of the two), after a warm-up copy each way; 0.0 when the device
    cannot time copies."""
    from ..device import HostBuffer
    buf = device.allocate(nbytes)
    host = HostBuffer(nbytes, pin_with=device)
    stream = device.create_stream("tidal-link-probe")
    try:
        rates = []
        for copy, args in ((device.copy_h2d, (buf, host)), (device.copy_d2h, (host, buf))):
            copy(*args, stream)  # warm-up
            start, end = device.create_event(True), device.create_event(True)
            start.record(stream)
            copy(*args, stream)
            end.record(stream)
            end.synchronize()
            seconds = end.elapsed_seconds_since(start)
            if seconds <= 0:
                return 0.0
            rates.append(nbytes / seconds)
        return min(rates)
    finally:
        stream.synchronize()
        del buf, host
