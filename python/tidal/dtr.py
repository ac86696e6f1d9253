"""tidal.dtr: dynamic tensor rematerialization (DTR) of activations.

Two lines turn it on, with MegEngine's names and meanings::

    tidal.dtr.eviction_threshold = "5GB"   # evict while tracked memory is above this
    tidal.dtr.enable()

or, restoring the previous state on exit::

    with tidal.dtr.enabled(eviction_threshold="5GB"):
        loss = model(x).sum(); loss.backward()

Every aten op is intercepted in C++, by a fallback on a dispatch key below
autograd (Note [DTR on a dispatch key] in hooks/dtr/interceptor.h; a Python
``TorchDispatchMode`` where that key is not available); the C++ core records
how each storage was computed, evicts the storage with the lowest h_DTR^eq
score when tracked bytes exceed the threshold, and rematerializes evicted
storages in place when an op needs them again (see docs/dtr.md). Tracked bytes are the storages produced while DTR is on by
ops run with grad mode on or in a backward pass; what ops under torch.no_grad() make (an optimizer's step, evaluation)
is not DTR's (Note [What DTR tracks] in hooks/dtr/storage_runtime.h). Parameters and inputs made before enable() are
not counted and never evicted.

Options (module attributes; assigning a bad value raises ValueError/TypeError):
    eviction_threshold: bytes (int or "5GB"); 0 = evict only when an
        allocation fails (CUDA ``OutOfMemoryError`` raised by an op).
    evictee_minimum_size: tensors smaller than this are never evicted
        (default 1 MiB).
    enable_sqrt_sampling: score sqrt(n) random candidates instead of all.
    scorer: "dtr_eq" (default), "local", "lru" or "size".
    max_recompute_ratio: DTR gives up (tidal.OutOfMemoryError naming the
        recomputes, the ops and the threshold) rather than thrash when the
        ops it replays in a training step would exceed this many times the
        step's ops (default 10; 0: no bound). See Note [DTR gives up rather
        than thrash] in hooks/dtr/storage_runtime.h.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import types
import warnings
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from tidal import _C
from tidal._schema import Rule, check_block, fail
from tidal.device import parse_bytes

__all__ = [
    "enable",
    "disable",
    "enabled",
    "is_enabled",
    "stats",
    "configure",
    "from_config",
    "reset_peak",
    "eviction_threshold",
    "evictee_minimum_size",
    "enable_sqrt_sampling",
    "scorer",
    "max_recompute_ratio",
]

ByteSize = Union[int, str]

_SCORERS = ("dtr_eq", "local", "lru", "size")
# >= 0 while the autograd engine runs a backward pass on this thread.
_graph_task_id = torch._C._current_graph_task_id

# Ops whose outputs must never be recomputed: collectives and ops that read
# data out of the tensor world. Their outputs are locked (never evicted).
_NEVER_REPLAY_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
_NEVER_REPLAY_OPS = frozenset({"aten._local_scalar_dense.default", "aten.set_.source_Storage",
                               "aten.set_.source_Storage_storage_offset", "aten.set_.source_Tensor"})
# Batch norm in training mode updates running_mean/var in place (native_batch_norm
# does not even declare it) but its outputs do not depend on them: replays get
# scratch copies so the update is not applied twice.
_BATCH_NORM_OPS = frozenset({"aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
                             "aten._batch_norm_with_update.default", "aten.cudnn_batch_norm.default",
                             "aten.miopen_batch_norm.default"})


def _check_bytes(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"tidal.dtr.{name} takes an int or a size string such as '5GB', "
                        f"got {type(value).__name__} {value!r}")
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"tidal.dtr.{name}: {value!r} is not a byte size ({e}). "
                         f"Tip: write it like 5GB, 512MiB or 1073741824.") from None


def _check_ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"tidal.dtr.max_recompute_ratio takes a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"tidal.dtr.max_recompute_ratio: expected a finite number >= 0 (0: no bound), got {value!r}. "
                         f"Tip: the default is 10 (replays up to 10x a training step's ops).")
    return float(value)


def _check_scorer(value: Any) -> str:
    if value not in _SCORERS:
        raise ValueError(f"tidal.dtr.scorer: expected one of {_SCORERS}, got {value!r}")
    return value


class _Slot:
    """Stands for the i-th tensor input in a recorded recipe."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _Scratch:
    """A running statistic that a replayed batch norm writes into: replays get a copy."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


class _ParamRef:
    """Stands for a view of a chunk-managed parameter in a recorded recipe
    (Note [DTR with chunk-managed parameters])."""

    __slots__ = ("provider", "record", "size", "stride", "offset", "epoch")

    def __init__(self, provider, record, t: torch.Tensor):
        self.provider, self.record = provider, record
        self.size, self.stride, self.offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()
        self.epoch = provider.weights_epoch


# Note [DTR with chunk-managed parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under the training engine a parameter's data is a view of its chunk slot
# only while its module runs, and the slot moves between host and device.
# A recipe must not keep such a view (its address goes stale), and DTR must
# not record a view of a slot as an activation of its own (evicting it would
# empty the slot). Each engine registers itself as a parameter provider:
#   * alias(t) -> the parameter record whose attached slot `t` views, or None;
#   * view(record, size, stride, offset) -> that view now, attaching the
#     parameter (bringing its chunk to the device) if needed;
#   * end_replay_step() -> detaches what view() attached;
#   * weights_epoch: bumped whenever the weights change (optimizer step,
#     loaded checkpoints); a replay from an older epoch is an internal error
#     (the engine restarts the DTR session at every step, which brings back
#     every evicted tensor first, so it is not reached);
#   * cpp: a _C.dtr.ParamProvider, the same three for the C++ interception
#     (alias() there is ModuleHooks::attached_at, with no Python per op), and
#     the engine's side of the arbiter and of the session in C++ (Note in
#     hooks/engine_dtr.h): each session or runtime is given every provider's
#     cpp, in either interception.
# Inputs that alias a parameter are templated as _ParamRef instead of
# slots: they are not recipe inputs for the core (parameters are never
# evicted), and replays rebuild them through the provider. Outputs that
# alias a parameter (views such as weight.t()) are not recorded.
_providers: "List[Any]" = []


def register_param_provider(provider) -> None:
    """Called by the training engine (Note [DTR with chunk-managed parameters])."""
    if provider not in _providers:
        _providers.append(provider)
        if _runtime is not None:
            _runtime.add_provider(provider.cpp)


def unregister_param_provider(provider) -> None:
    if provider in _providers:
        _providers.remove(provider)
        if _runtime is not None:
            _runtime.remove_provider(provider.cpp)


def _param_alias(t: torch.Tensor):
    for p in _providers:
        r = p.alias(t)
        if r is not None:
            return p, r
    return None


def _template(x: Any, inputs: List[torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        if _providers:
            hit = _param_alias(x)
            if hit is not None:
                return _ParamRef(hit[0], hit[1], x)
        inputs.append(x)
        return _Slot(len(inputs) - 1)
    if isinstance(x, (list, tuple)) and x:
        out = [_template(y, inputs) for y in x]
        return out if isinstance(x, list) else tuple(out)
    if isinstance(x, dict):  # keyword-only tensors (searchsorted's sorter, attention's attn_mask)
        return {k: _template(v, inputs) for k, v in x.items()}
    return x


def _fill(x: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(x, _Slot):
        return tensors[x.i]
    if isinstance(x, _Scratch):
        return x.t.clone()
    if isinstance(x, _ParamRef):
        p = x.provider
        if x.epoch != p.weights_epoch:
            raise _C.InternalError(
                f"tidal.dtr: a recipe read parameter '{x.record.name}' before the weights changed "
                f"(epoch {x.epoch}, now {p.weights_epoch}); replaying it would compute a different value")
        return p.view(x.record, x.size, x.stride, x.offset)
    if isinstance(x, (list, tuple)) and x:
        out = [_fill(y, tensors) for y in x]
        return out if isinstance(x, list) else tuple(out)
    if isinstance(x, dict):
        return {k: _fill(v, tensors) for k, v in x.items()}
    return x


def _flat_outputs(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    flat: List[torch.Tensor] = []
    if isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                flat.append(o)
            elif isinstance(o, (list, tuple)):
                flat.extend(t for t in o if isinstance(t, torch.Tensor))
    return flat


class _OpInfo:
    """What DTR needs to know about one OpOverload, computed once."""

    __slots__ = ("name", "written", "random", "replayable", "batch_norm", "alias_only")

    def __init__(self, func):
        schema = func._schema
        self.name = str(func)
        # An in-place view op (squeeze_, t_) writes sizes and strides, not data
        # (hooks/dtr/interceptor.cpp, Session::info_of); resize_ may reallocate.
        metadata_only = torch.Tag.inplace_view in func.tags and not self.name.startswith("aten.resize")
        self.written = [] if metadata_only else [(i, a.name) for i, a in enumerate(schema.arguments)
                                                 if a.alias_info is not None and a.alias_info.is_write]
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        ns = func.namespace
        self.replayable = ns not in _NEVER_REPLAY_NAMESPACES and self.name not in _NEVER_REPLAY_OPS
        self.batch_norm = self.name in _BATCH_NORM_OPS
        # An in-place op whose results all alias its arguments has no fresh output.
        self.alias_only = all(r.alias_info is not None for r in schema.returns)


@contextlib.contextmanager
def _host_side():
    """Generator states are host-side bookkeeping, not device memory (Note
    [tidal's own host allocations] in runtime/core/uncounted.h)."""
    _C.chunks.enter_uncounted()
    try:
        yield
    finally:
        _C.chunks.exit_uncounted()


def _rng_get(args, kwargs, inputs):
    with _host_side():
        return _rng_get_now(args, kwargs, inputs)


def _rng_get_now(args, kwargs, inputs):
    gen = kwargs.get("generator")
    if gen is None:
        gen = next((a for a in args if isinstance(a, torch.Generator)), None)
    if gen is not None:
        return (gen, gen.get_state())
    device = next((t.device for t in inputs if t.device.type != "meta"), None)
    if device is None:
        device = kwargs.get("device")
        device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return (device, torch.cuda.get_rng_state(device))
    return (None, torch.get_rng_state())


def _rng_set(saved) -> Any:
    """Installs a saved generator state; returns what to restore afterwards."""
    with _host_side():
        return _rng_set_now(saved)


def _rng_set_now(saved) -> Any:
    where, state = saved
    if isinstance(where, torch.Generator):
        old = (where, where.get_state())
        where.set_state(state)
    elif isinstance(where, torch.device):
        old = (where, torch.cuda.get_rng_state(where))
        torch.cuda.set_rng_state(state, where)
    else:
        old = (None, torch.get_rng_state())
        torch.set_rng_state(state)
    return old


class _DtrMode(TorchDispatchMode):
    """Routes every aten op through the rematerializer."""

    def __init__(self, runtime):
        super().__init__()
        self.rt = runtime
        self.info: Dict[Any, _OpInfo] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = self.info.get(func)
        if info is None:
            info = self.info[func] = _OpInfo(func)
        rt = self.rt
        scratch: List[torch.Tensor] = []
        recorded_args = args
        if info.batch_norm and len(args) > 5 and args[5] is True and args[3] is not None:
            # Running stats are written, not read: not inputs of the recipe.
            scratch = [args[3], args[4]]
            recorded_args = (*args[:3], _Scratch(args[3]), _Scratch(args[4]), *args[5:])
        inputs: List[torch.Tensor] = []
        targs = _template(recorded_args, inputs)
        tkw = _template(kwargs, inputs) if kwargs else kwargs
        ids, missing = rt.begin_op(inputs)
        try:
            if missing:
                self.regenerate(missing)
            mutations = []
            declared = self._written(info, recorded_args, kwargs)
            written = declared + scratch
            if written:
                rt.set_hold_evictions(True)  # released by run_mutation, then by end_op after commit_mutation
                wids = []
                for w in written:
                    wid = next((ids[i] for i, t in enumerate(inputs) if t is w), -1)
                    if wid < 0:
                        wid = rt.lookup(w)
                    if wid >= 0 and wid not in wids:
                        wids.append(wid)
                chain_ok = info.replayable and info.alias_only and len(wids) == 1 and not scratch
                regen: List[int] = []
                for wid in wids:
                    chain, todo = rt.prepare_mutation(wid, chain_ok)
                    mutations.append((wid, chain))
                    regen.extend(todo)
                if regen:
                    self.regenerate(regen)
            rng = _rng_get(args, kwargs, inputs) if info.random else None
            if written:  # Note [Evictions while an in-place op runs]
                rt.run_mutation([wid for wid, _ in mutations])
            t0 = time.perf_counter()
            while True:
                try:
                    out = func(*args, **kwargs)
                    break
                except torch.OutOfMemoryError:
                    # The allocator ran out (CUDA): free the best candidate and retry.
                    if not rt.evict_one():
                        raise
                    if rng is not None:
                        _rng_set(rng)  # the retry draws what a replay will draw
            seconds = time.perf_counter() - t0
            if written:
                rt.set_hold_evictions(True)  # until the commits below
            recipe = (func, targs, tkw, rng, torch.is_grad_enabled())
            outs = _flat_outputs(out)
            if _providers and outs:
                outs = [o for o in outs if _param_alias(o) is None]  # views of parameters
            if outs and _C.dtr.records_outputs_now():  # Note [What DTR tracks]
                # Fresh outputs of an op that updates its arguments are not replayed
                # (the update would be applied twice), except batch norm's (scratch).
                rt.record(inputs, ids, outs, seconds, info.replayable and not declared, recipe,
                          _graph_task_id() != -1)
            for wid, chain in mutations:
                rt.commit_mutation(wid, chain, inputs, ids, seconds, recipe if chain else None)
        except BaseException:
            rt.set_hold_evictions(False)
            with contextlib.suppress(Exception):
                rt.end_op(info.name)
            raise
        rt.set_hold_evictions(False)
        rt.end_op(info.name)
        if _after_op is not None:
            _after_op()
        return out

    @staticmethod
    def _written(info: _OpInfo, args, kwargs) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []
        for i, name in info.written:
            v = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(t for t in v if isinstance(t, torch.Tensor))
        return out

    def regenerate(self, targets: List[int], bounded: bool = True) -> None:
        """Replays recipes until every target is resident (rt.plan uses an explicit stack);
        bounded: the replays count against max_recompute_ratio (not when DTR is turned off)."""
        rt = self.rt
        try:
            for step, recipe in rt.plan(targets, bounded):
                func, targs, tkw, rng, grad_mode = recipe
                tensors = rt.replay_inputs(step)
                a = _fill(targs, tensors)
                k = _fill(tkw, tensors) if tkw else {}
                old = _rng_set(rng) if rng is not None else None
                # The kernel sees the grad mode it saw when the op ran, below autograd
                # (Note [What a replay restores] in hooks/dtr/interceptor.h).
                old_grad_mode = torch.is_grad_enabled()
                torch._C._set_grad_enabled(grad_mode)
                t0 = time.perf_counter()
                try:
                    with torch._C._AutoDispatchBelowAutograd():
                        while True:
                            try:
                                out = func(*a, **k)
                                break
                            except torch.OutOfMemoryError:
                                if not rt.evict_one():  # never takes what the plan pinned
                                    raise
                finally:
                    torch._C._set_grad_enabled(old_grad_mode)
                    if old is not None:
                        _rng_set(old)
                    for p in _providers:
                        p.end_replay_step()
                seconds = time.perf_counter() - t0
                del a, k, tensors  # inputs no later step needs can be dropped at once
                rt.replayed(step, _flat_outputs(out), seconds)
                del out
        finally:
            rt.end_plan()


# ---------------------------------------------------------------------------
# Module state and the public switch.

_options: Dict[str, Any] = {
    "eviction_threshold": 0,
    "evictee_minimum_size": 1 << 20,
    "enable_sqrt_sampling": False,
    "scorer": "dtr_eq",
    "max_recompute_ratio": 10.0,
}
_runtime = None  # _C.dtr.Session (C++ interception) or _C.dtr.Runtime (Python mode)
_mode: Any = None  # _CPP, or the _DtrMode entered; None while DTR is off
_last_stats: Dict[str, Any] = {}
_CPP = "cpp"
# How ops are intercepted: None picks C++ where the dispatch key is free
# (_C.dtr.interception_status()), else the Python mode with a warning;
# "python" forces the TorchDispatchMode (the peer of benchmarks/dtr.py --only overhead).
_interception: Optional[str] = None
_after_op = None  # tests: called after every intercepted op (both interceptions)


_key_checked = False  # the key passed _C.dtr.interception_status() once in this process


def _interception_kind() -> str:
    global _key_checked
    if _interception is not None:
        return _interception
    if not _key_checked:
        why = _C.dtr.interception_status()
        if why:
            warnings.warn(f"tidal.dtr intercepts ops with a Python TorchDispatchMode (slower): {why}", stacklevel=3)
            return "python"
        _key_checked = True
    return _CPP


def _set_after_op(fn) -> None:
    """Tests: fn() runs after every op DTR intercepts, in C++ or in the Python
    mode (None removes it)."""
    global _after_op
    _after_op = fn
    if _mode is _CPP:
        _runtime.set_after_op(fn)


def _checked(**given) -> Dict[str, Any]:
    """The given options (None: not given), checked and parsed; nothing applied."""
    out: Dict[str, Any] = {}
    for name in ("eviction_threshold", "evictee_minimum_size"):
        if given.get(name) is not None:
            out[name] = _check_bytes(name, given[name])
    flag = given.get("enable_sqrt_sampling")
    if flag is not None:
        if not isinstance(flag, bool):
            raise TypeError(f"tidal.dtr.enable_sqrt_sampling takes a bool, got {flag!r}")
        out["enable_sqrt_sampling"] = flag
    if given.get("scorer") is not None:
        out["scorer"] = _check_scorer(given["scorer"])
    if given.get("max_recompute_ratio") is not None:
        out["max_recompute_ratio"] = _check_ratio(given["max_recompute_ratio"])
    return out


def configure(eviction_threshold: Optional[ByteSize] = None, evictee_minimum_size: Optional[ByteSize] = None,
              enable_sqrt_sampling: Optional[bool] = None, scorer: Optional[str] = None,
              max_recompute_ratio: Optional[float] = None) -> None:
    """Sets options (all checked before any is applied). The threshold applies at once
    to a running session; the others from the next ``enable()``.

    Args:
        eviction_threshold: bytes, int or a string such as "5GB"; 0 = no threshold.
        evictee_minimum_size: bytes; smaller tensors are never evicted.
        enable_sqrt_sampling: score sqrt(n) sampled candidates.
        scorer: "dtr_eq", "local", "lru" or "size".
        max_recompute_ratio: give up rather than replay more than this many times
            a training step's ops (0: no bound).
    """
    _options.update(_checked(eviction_threshold=eviction_threshold, evictee_minimum_size=evictee_minimum_size,
                             enable_sqrt_sampling=enable_sqrt_sampling, scorer=scorer,
                             max_recompute_ratio=max_recompute_ratio))
    if _runtime is not None:
        _runtime.set_eviction_threshold(_options["eviction_threshold"])


# The config file's tidal.dtr block: key -> (kind, default, doc) (tidal._schema).
CONFIG_SCHEMA: Dict[str, tuple] = {
    "enabled": (bool, True, "turn DTR on under the engine (false leaves it as it is)"),
    "eviction_threshold": ("bytes", None, "evict above this many tracked bytes; caps the engine's"),
    "evictee_minimum_size": ("bytes", None, "smaller tensors are never evicted"),
    "enable_sqrt_sampling": (bool, None, "score sqrt(n) sampled candidates"),
    "scorer": (_SCORERS, None, "the eviction heuristic"),
    "max_recompute_ratio": (Rule("a finite number >= 0 (0: no bound)",
                                 lambda v: not isinstance(v, bool) and isinstance(v, (int, float))
                                 and math.isfinite(v) and v >= 0),
                            None, "give up rather than replay more than this many times a step's ops"),
}


def validate_config(block: Dict[str, Any]) -> Dict[str, Any]:
    """Checks a config file's ``tidal.dtr`` block without applying it; returns
    the options it sets (``enabled`` excluded, values parsed). A key DTR does
    not know is an error, never silently ignored.

    Raises:
        tidal.ConfigError: an unknown key (with the nearest valid one), a bad
            byte size, scorer or flag, each naming the key and the value.
    """
    for key, value in block.items() if isinstance(block, dict) else ():
        if value is None and key in CONFIG_SCHEMA:
            fail(f"tidal.dtr.{key}", "expected a value, got null")
    options = check_block("tidal.dtr", CONFIG_SCHEMA, block)
    options.pop("enabled", None)
    return options


def from_config(block: Dict[str, Any]) -> None:
    """Applies a config file's ``tidal.dtr`` block, e.g.
    ``{"enabled": true, "eviction_threshold": "5GB"}`` (checked first by
    ``validate_config``; nothing is applied when a key is bad).

    Args:
        block: the mapping under ``tidal`` -> ``dtr``.
    """
    options = validate_config(block)
    if block.get("enabled", True):
        enable(**options)
    else:
        configure(**options)
        disable()


def config_enables(block: Dict[str, Any]) -> bool:
    """Whether an engine config's "tidal": {"dtr": block} turns DTR on: a
    non-empty block does unless it says "enabled": false."""
    return bool(block) and bool(block.get("enabled", True))


def is_enabled() -> bool:
    """Whether DTR intercepts ops now."""
    return _mode is not None


def enable(**options) -> None:
    """Turns DTR on for this thread (after ``configure(**options)``).

    Calling it while enabled restarts the session with the new options
    (evicted tensors are brought back first).
    """
    global _runtime, _mode
    configure(**options)
    if _mode is not None:
        disable()
    args = (_options["eviction_threshold"], _options["evictee_minimum_size"], _options["enable_sqrt_sampling"],
            _options["scorer"])
    kwargs = {"max_recompute_ratio": _options["max_recompute_ratio"]}
    if _interception_kind() == _CPP:
        session = _C.dtr.Session(*args, **kwargs)
        for p in _providers:
            session.add_provider(p.cpp)
        if _after_op is not None:
            session.set_after_op(_after_op)
        session.activate()
        _runtime, _mode = session, _CPP
    else:
        _runtime = _C.dtr.Runtime(*args, **kwargs)
        for p in _providers:
            _runtime.add_provider(p.cpp)
        _mode = _DtrMode(_runtime)
        _mode.__enter__()
        _runtime.activate()  # engines may ask it for room from now on


def disable() -> None:
    """Turns DTR off: brings back every evicted tensor that is still reachable,
    then forgets all records. A no-op when DTR is off."""
    global _runtime, _mode, _last_stats
    if _mode is None:
        return
    mode, rt = _mode, _runtime
    if mode is _CPP:
        rt.deactivate()
        _mode = None
        try:
            with torch.no_grad():
                rt.regenerate_evicted()
            _last_stats = rt.stats()
            rt.clear()
        finally:
            _runtime = None
        return
    if _get_current_dispatch_mode() is not mode:
        raise RuntimeError("tidal.dtr.disable(): another TorchDispatchMode was entered after "
                           "tidal.dtr.enable() and is still active; exit it first")
    rt.deactivate()
    mode.__exit__(None, None, None)
    _mode = None
    try:
        rt.set_eviction_threshold(0)  # bringing tensors back must not evict others
        with torch.no_grad():
            todo = rt.evicted_alive()
            if todo:
                mode.regenerate(todo, bounded=False)
        left = rt.evicted_alive()
        if left:
            raise _C.InternalError(f"tidal.dtr.disable(): tensors {left} are still evicted")
        _last_stats = rt.stats()
        rt.clear()
    finally:
        _runtime = None


@contextlib.contextmanager
def enabled(**options) -> Iterator[None]:
    """``with tidal.dtr.enabled(eviction_threshold="2GB"):`` runs the block with DTR on
    and restores the previous options and on/off state afterwards, also on error."""
    saved = dict(_options)
    was_on = is_enabled()
    enable(**options)
    try:
        yield
    except BaseException:
        # The block's error wins over one from bringing tensors back.
        try:
            disable()
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"tidal.dtr.disable() failed after an error in the block: {e}", stacklevel=3)
            _force_off()
        raise
    else:
        disable()
    finally:
        _options.clear()
        _options.update(saved)
        if was_on and not is_enabled():
            enable()


def _set_eviction_threshold(nbytes: int) -> None:
    """The training engine's arbiter sets the live threshold (not the option)."""
    if _runtime is not None:
        _runtime.set_eviction_threshold(max(0, int(nbytes)))


def _suspend() -> Dict[str, Any]:
    """Ends the session (every evicted tensor still reachable comes back, all
    records are forgotten) and returns its counters; ``enable()`` starts the
    next one with the same options. The training engine does this around
    every change of the weights (Note [DTR with chunk-managed parameters])."""
    if _mode is None:
        return {}
    disable()
    return dict(_last_stats)


_NO_MODE = contextlib.nullcontext()  # reusable; what outside() is while DTR is off


def outside():
    """Runs the block outside DTR's dispatch mode (a no-op when DTR is off):
    DTR neither records nor evicts what the block does. Used by tidal's own
    bookkeeping (the engine's slot copies and optimizer, tidal.recompute's plan).
    While DTR is off this is a shared null context: the engine enters it a few
    times per module hook, where a generator-based one cost microseconds."""
    if _mode is None:
        return _NO_MODE
    if _mode is _CPP:
        return _C.dtr.Outside()
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


def _force_off() -> None:
    global _runtime, _mode
    if _runtime is not None:
        _runtime.deactivate()
    if _mode is not _CPP and _mode is not None and _get_current_dispatch_mode() is _mode:
        _mode.__exit__(None, None, None)
    if _runtime is not None:
        _runtime.clear()
    _runtime, _mode = None, None


def stats() -> Dict[str, Any]:
    """Live counters of the session (or of the last one when DTR is off):
    evictions, recomputes (ops replayed), recompute_seconds, tracked_bytes,
    peak_tracked_bytes, max_op_working_set, live_tensors, live_ops,
    fake_deleted, locked_bytes, held_storages, recipes."""
    out = dict(_runtime.stats() if _runtime is not None else _last_stats)
    out["enabled"] = is_enabled()
    return out


def reset_peak() -> None:
    """Restarts peak_tracked_bytes and max_op_working_set from now."""
    if _runtime is not None:
        _runtime.reset_peak()


def _evict_all() -> int:
    """Tests: evicts every candidate now; returns how many. With
    ``_set_after_op(_evict_all)`` every op's results are evicted as soon as
    it returns, so every later read replays them (the op-table tests)."""
    return _runtime.evict_all() if _runtime is not None else 0


def _validate() -> None:
    """Checks every invariant of the records (tests)."""
    if _runtime is not None:
        _runtime.validate()


class _DtrModule(types.ModuleType):
    """Makes ``tidal.dtr.eviction_threshold = "5GB"`` a checked assignment."""

    def __getattr__(self, name):
        if name in _options:
            return _options[name]
        raise AttributeError(f"module 'tidal.dtr' has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in _options:
            configure(**{name: value})
        else:
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _DtrModule
