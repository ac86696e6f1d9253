"""tidal.recompute: static recompute segments and recompute-offload.

The sublinear-memory plan for static graphs (Chen et al., "Training Deep Nets
with Sublinear Memory Cost"; Paddle's recompute and recompute-offload). A
segment is one module, or a run of consecutive blocks of a chain: in forward
only its input (the *checkpoint*) is kept; in backward the segment is run
again from the checkpoint to regenerate what autograd saved::

    plan = tidal.recompute(model, checkpoints="auto")          # ~sqrt(N) segments of the chain
    plan = tidal.recompute(model, ["blocks.0", "blocks.1"])    # one segment per named module
    plan = tidal.recompute(model, "auto", offload=True)        # checkpoints go to host memory
    ...
    plan.remove()                                             # the original forwards again

or from a config file's ``activation_checkpointing`` block (DeepSpeed's names)::

    plan = tidal.recompute.from_config(model, {"number_checkpoints": 4, "cpu_checkpointing": True})

Mechanism (see docs/recompute.md): every block of a segment gets a forward
wrapper; inside it a ``saved_tensors_hooks`` pack hook replaces each tensor
autograd saves by a (run, index) handle, so nothing but the checkpoint stays
alive. The first unpack in backward reruns the segment from the checkpoint,
with the forward's CPU/CUDA RNG states and autocast state, and with batch
norm's running statistics swapped for scratch copies so they are updated
exactly once; the recomputed tensors are handed out in the order they were
saved (their shapes and dtypes are checked against the forward's).

Offload: a segment's checkpoint is copied to host memory on a copy stream as
soon as the segment starts and its device copy is released once the copy is
done; in backward, when a segment's recompute starts, the checkpoints of the
next ``prefetch_depth`` segments (in backward order) are copied back, so the
copies overlap compute. On CUDA this is a ``torch.cuda.Stream``, pinned host
memory and CUDA events (torch's caching allocator must see the side stream,
``record_stream``). Elsewhere the copies go through tidal's device layer: a
stream of the simulated device and its copy engines, the same link the
training engine's chunk copies take (each copy takes latency + bytes /
bandwidth on its direction's engine, behind the copies booked there), or a
link of its own when ``offload_bandwidth`` / ``offload_latency_us`` are
given; host copies are ``tidal.HostBuffer``\\ s, so ``tidal.stats()["host"]``
counts them.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import math
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils._pytree import tree_map

from tidal import dtr as _dtr
from tidal._schema import NONE, ConfigError, Rule, check_value, unknown_key
from tidal.device import get_device, parse_bytes
from tidal import _C
from tidal._C import HostBuffer

__all__ = [
    "CONFIG_KEYS",
    "CopyEvent",
    "Recompute",
    "Segment",
    "find_chain",
    "from_config",
    "plan_for_target",
    "recompute",
    "validate_config",
]

ByteSize = Union[int, str]
Checkpoints = Union[str, Sequence[Union[str, nn.Module, Sequence[Union[str, nn.Module]]]]]

_tls = threading.local()  # .recomputing: > 0 while a segment is being rerun on this thread


def _recomputing() -> bool:
    return getattr(_tls, "recomputing", 0) > 0


@contextlib.contextmanager
def _recompute_guard() -> Iterator[None]:
    _tls.recomputing = getattr(_tls, "recomputing", 0) + 1
    try:
        yield
    finally:
        _tls.recomputing -= 1


# ---------------------------------------------------------------------------
# Segments and how they are chosen.

class Segment:
    """A run of modules recomputed together: in forward only the input of the
    first module is kept. ``names[i]`` is the qualified name of ``modules[i]``."""

    __slots__ = ("index", "names", "modules", "offload")

    def __init__(self, index: int, names: List[str], modules: List[nn.Module], offload: bool):
        self.index, self.names, self.modules, self.offload = index, names, modules, offload

    def __repr__(self) -> str:
        what = self.names[0] if len(self.names) == 1 else f"{self.names[0]}..{self.names[-1]}"
        return f"Segment({self.index}: {what}, {len(self.names)} module(s){', offload' if self.offload else ''})"


def find_chain(model: nn.Module, name: Optional[str] = None) -> Tuple[str, List[nn.Module]]:
    """The chain of repeated blocks that ``checkpoints="auto"`` segments.

    The chain is the ``nn.ModuleList``/``nn.Sequential`` with the most children
    of one class that have parameters (ties: more parameters), e.g. a
    transformer's list of blocks.

    Args:
        model: the model.
        name: take this container instead (a qualified module name).

    Returns:
        (container name, its blocks in order).

    Raises:
        ValueError: no such chain (or ``name`` is not a ModuleList/Sequential).
    """
    modules = dict(model.named_modules())
    if name is not None:
        container = _resolve_name(model, modules, name, what="chain")
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 1:
            raise ValueError(f"chain '{name}' is a {type(container).__name__}; expected an nn.ModuleList "
                             f"or nn.Sequential of blocks")
        return name, list(container)
    best = None
    for qual, m in modules.items():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m)
        by_type: Dict[type, List[nn.Module]] = collections.defaultdict(list)
        for c in children:
            if any(True for _ in c.parameters()):
                by_type[type(c)].append(c)
        if not by_type:
            continue
        same = max(by_type.values(), key=len)
        if len(same) < 2 or len(same) != len([c for c in children if any(True for _ in c.parameters())]):
            continue  # a mixed container (e.g. stem + blocks + head) is not a chain of repeated blocks
        key = (len(same), sum(p.numel() for c in same for p in c.parameters()))
        if best is None or key > best[0]:
            best = (key, qual, children)
    if best is None:
        raise ValueError(
            f"checkpoints='auto' found no chain of repeated blocks in {type(model).__name__}: it needs an "
            f"nn.ModuleList or nn.Sequential whose children with parameters (at least 2) are all of one "
            f"class. Tip: pass chain='name.of.the.list', or name the checkpoints, e.g. "
            f"checkpoints=['layer1', 'layer2'].")
    return best[1] or "<root>", best[2]


def _resolve_name(model: nn.Module, modules: Dict[str, nn.Module], name: Any, what: str) -> nn.Module:
    if not isinstance(name, str):
        raise TypeError(f"a {what} is a module name (str) or an nn.Module, got {type(name).__name__} {name!r}")
    if name in modules:
        return modules[name]
    names = [n for n in modules if n]
    near = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    if not near:  # e.g. "block.3" for "blocks.3": also try the last component
        tail = name.rsplit(".", 1)[-1]
        near = [n for n in names if n.rsplit(".", 1)[-1] == tail][:5]
    hint = f"near matches: {', '.join(repr(n) for n in near)}" if near else "no near match"
    raise ValueError(f"{what} '{name}' matches no module of {type(model).__name__} ({hint}; "
                     f"{len(names)} named modules, list them with model.named_modules())")


def _even_sizes(n: int, parts: int) -> List[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def plan_for_target(act: Sequence[int], inp: Sequence[int], target: Optional[int]
                    ) -> Tuple[int, int, int]:
    """Chooses (m, k, estimate): recompute the first m blocks of the chain in
    segments of k blocks, keep the rest, so that the estimated activation peak
    of the chain is at most ``target`` with as few recomputed blocks as possible
    (``target=None``: the smallest estimate).

    Estimate (Chen et al.'s model with measured sizes): the checkpoints stay
    until their segment's backward; the kept blocks' activations stay until
    theirs; a segment's activations exist only while it is recomputed and
    backpropagated. Kept activations and a segment's are not alive at the same
    time (kept blocks come last, so their backward runs first), but the kept
    ones are alive together with the rest of the network's peak (head, loss),
    which the chain's sizes do not show; so the estimate adds them, an upper
    bound::

        M(m, k) = sum(inp[s] for segment starts s) + sum(act[m:]) + max over segments of sum(act[seg])

    With every block alike (act = inp = a) that is (N / k) a + k a, least at
    k = sqrt(N): Chen et al.'s sqrt(N) segments.

    Args:
        act: per block, bytes autograd saves inside it (no parameters).
        inp: per block, bytes of its input (its checkpoint if a segment starts there).
        target: bytes, or None for the minimum.
    """
    n = len(act)
    best: Optional[Tuple[int, int, int]] = None
    for m in range(n + 1):
        kept = sum(act[m:])
        for k in range(1, max(m, 1) + 1):
            if m == 0 and k > 1:
                break
            starts = range(0, m, k)
            seg_peak = max((sum(act[s:s + k]) for s in starts), default=0)
            est = sum(inp[s] for s in starts) + kept + seg_peak
            if target is None:
                if best is None or est < best[2]:
                    best = (m, k, est)
            elif est <= target and (best is None or est < best[2]):
                best = (m, k, est)
        if target is not None and best is not None:
            return best  # the fewest recomputed blocks that meet the target
    return best  # type: ignore[return-value]


# ---------------------------------------------------------------------------
# Copy engines for offload.

class CopyEvent:
    """Completion of one copy. Times are ``time.perf_counter()`` seconds: issued
    (host); started/completed (when the device layer's stream began and
    finished the copy, read from timing events; None on CUDA)."""

    __slots__ = ("kind", "nbytes", "label", "issued_at", "_link", "_start", "_end", "_cuda")

    def __init__(self, kind: str, nbytes: int, label: Any):
        self.kind, self.nbytes, self.label = kind, nbytes, label
        self.issued_at = time.perf_counter()
        self._link: Optional["_DeviceLink"] = None
        self._start = self._end = None  # timing events on the link's stream
        self._cuda = None

    def query(self) -> bool:
        if self._cuda is not None:
            return self._cuda.query()
        return self._end is None or self._end.query()

    def synchronize(self) -> float:
        """Blocks the host until the copy is done; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._cuda is not None:
            self._cuda.synchronize()
        elif self._end is not None:
            self._end.synchronize()
        return time.perf_counter() - t0

    @property
    def started_at(self) -> Optional[float]:
        return None if self._link is None or not self.query() else self._link.wall_time(self._start)

    @property
    def completed_at(self) -> Optional[float]:
        return None if self._link is None or not self.query() else self._link.wall_time(self._end)


class _DeviceLink:
    """Offload copies of tensors torch keeps in host memory (the simulated
    device's "device" tensors, or a CPU model) through tidal's device layer:
    one stream of `device` (Device.copy_d2h_external / copy_h2d_external: the
    device side is torch's memory), timing events for the copies' times."""

    def __init__(self, device, shared: bool):
        self.device, self.shared = device, shared
        self.stream = device.create_stream("tidal-recompute-offload")
        # Event times are relative; an event recorded on the idle stream just
        # after `t0` anchors them to perf_counter (a little early, by the
        # stream's start-up: completions are never placed late).
        self._base = device.create_event(True)
        t0 = time.perf_counter()
        self._base.record(self.stream)
        self._base.synchronize()
        self._base_wall = t0

    def wall_time(self, event) -> float:
        return self._base_wall + event.elapsed_seconds_since(self._base)

    def _copy(self, kind: str, nbytes: int, label: Any, issue: Callable[[], None]) -> CopyEvent:
        ev = CopyEvent(kind, nbytes, label)
        ev._link = self
        ev._start = self.device.create_event(True)
        ev._end = self.device.create_event(True)
        ev._start.record(self.stream)
        issue()
        ev._end.record(self.stream)
        return ev

    def d2h(self, host: HostBuffer, src: torch.Tensor, label: Any) -> CopyEvent:
        """Queues the copy of dense `src` into `host`; the caller keeps `src` alive until it is done."""
        n = src.numel() * src.element_size()
        return self._copy("d2h", n, label,
                          lambda: self.device.copy_d2h_external(host, src.data_ptr(), n, self.stream))

    def h2d(self, dst: torch.Tensor, host: HostBuffer, label: Any) -> CopyEvent:
        n = dst.numel() * dst.element_size()
        return self._copy("h2d", n, label,
                          lambda: self.device.copy_h2d_external(dst.data_ptr(), host, n, self.stream))

    def info(self) -> Dict[str, Any]:
        i = self.device.info()
        return {"kind": "device", "backend": i.get("backend"), "shared_with_chunks": self.shared,
                "bandwidth_bytes_per_s": i.get("sim_copy_bandwidth"),
                "latency_s": i.get("sim_copy_latency_s")}

    def synchronize(self) -> None:
        self.stream.synchronize()


def _host_tensor(size: torch.Size, stride: Tuple[int, ...], dtype: torch.dtype) -> Tuple[HostBuffer, torch.Tensor]:
    """A tidal.HostBuffer and a host tensor of this (dense) layout over it (the tensor keeps the buffer alive)."""
    numel = math.prod(size)
    nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
    buf = HostBuffer(nbytes)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype)
    return buf, flat.as_strided(size, stride)


def _dense(t: torch.Tensor) -> bool:
    """Strides that are a permutation of contiguous ones: the copy has the same layout."""
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.size()) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True


# ---------------------------------------------------------------------------
# One forward execution of a segment.

_CHAIN = object()  # stands for the previous block's output in a recorded call


def _detach_like(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        d = x.detach()
        if x.requires_grad and (x.is_floating_point() or x.is_complex()):
            d.requires_grad_(True)
        return d
    return x


def _chain_value(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _storage_nbytes(t: torch.Tensor) -> int:
    # Not t.untyped_storage(): see storage_data_ptr in python/csrc/chunk_bindings.cpp.
    if t.layout != torch.strided:
        return t.numel() * t.element_size()
    return _C.chunks.storage_nbytes(t)


class _Run:
    """The state of one forward pass through a segment until its backward is
    done: the checkpoint (or its host copy), the calls to replay, the RNG and
    autocast state, and the metadata of every tensor autograd saved."""

    def __init__(self, plan: "Recompute", seg: Segment):
        self.plan, self.seg = plan, seg
        self.id = plan._next_run_id
        plan._next_run_id += 1
        self.calls: List[Tuple[Any, Any]] = []  # per block: (args, kwargs), detached
        self.chain_out: Any = None              # previous block's output while forward runs
        self.next_block = 0
        self.meta: List[Tuple[torch.Size, torch.dtype, torch.device]] = []
        self.values: Optional[List[Optional[torch.Tensor]]] = None
        self.rng: Optional[Tuple[torch.Tensor, Dict[int, torch.Tensor]]] = None
        self.autocast: List[Tuple[str, bool, torch.dtype]] = []
        # the checkpoint: args[0] of the first call is _CHAIN-free; when offloaded
        # `ckpt` is None while the copy lives on the host.
        self.ckpt: Optional[torch.Tensor] = None
        self.ckpt_version = 0
        self.ckpt_requires_grad = False
        self.host: Optional[torch.Tensor] = None
        self.host_buffer: Optional[HostBuffer] = None  # under `host` (device-layer copies)
        self.d2h: Optional[CopyEvent] = None
        self.d2h_src: Optional[torch.Tensor] = None  # kept alive until d2h is done (device-layer copies)
        self.h2d: Optional[CopyEvent] = None
        self.prefetched: Optional[torch.Tensor] = None
        self.device: Optional[torch.device] = None  # where the offloaded checkpoint came from
        # memory_target's measuring forward: what the block saved, alive until it returns
        # (a freed storage's address can come back, so they are counted then).
        self.measure: Optional[List[torch.Tensor]] = None
        self.param_ptrs: frozenset = frozenset()
        self.done_backward = False

    # -- forward ---------------------------------------------------------------
    def begin(self, args: tuple, kwargs: dict) -> None:
        plan = self.plan
        if plan.preserve_rng_state:
            cuda = {}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                for t in _tensors((args, kwargs)):
                    if t.is_cuda and t.device.index not in cuda:
                        cuda[t.device.index] = torch.cuda.get_rng_state(t.device)
            self.rng = (torch.get_rng_state(), cuda)
        types_ = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in types_]
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            # No positional tensor input: keep every argument as it is (nothing to offload).
            self.calls.append(tree_map(_detach_like, (args, kwargs)))
            return
        self.calls.append((( _CHAIN,) + tuple(tree_map(_detach_like, args[1:])), tree_map(_detach_like, kwargs)))
        self.ckpt_requires_grad = x.requires_grad
        if _dtr.is_enabled():
            # Pinned for DTR: the plan's own copy, made outside DTR's mode, is never
            # evicted (nor counted); DTR manages everything else.
            if x.numel() and _storage_nbytes(x) == 0:
                torch.ops.aten.alias.default(x)  # an evicted input comes back through DTR first
            with torch.no_grad(), _dtr.outside():
                x = x.detach().clone()
        else:
            x = x.detach()  # shares the version counter: in-place updates of the input are caught
        self.ckpt_version = x._version
        if self.seg.offload and x.numel() > 0:
            self.host = plan._offload(self, x)
        else:
            self.ckpt = x

    def add_call(self, j: int, args: tuple, kwargs: dict) -> None:
        if self.next_block != j:
            raise RuntimeError(
                f"tidal.recompute: {self.seg!r}: block '{self.seg.names[j]}' ran before "
                f"'{self.seg.names[self.next_block]}'; the blocks of a segment must run in order, one after "
                f"the other. Tip: give each block its own segment (segments=<number of blocks>).")
        if not args or args[0] is not self.chain_out:
            raise RuntimeError(
                f"tidal.recompute: {self.seg!r}: the first argument of '{self.seg.names[j]}' is not the output "
                f"of '{self.seg.names[j - 1]}', so the segment is not a chain that can be rerun. "
                f"Tip: give each block its own segment (segments=<number of blocks>).")
        self.calls.append(((_CHAIN,) + tuple(tree_map(_detach_like, args[1:])), tree_map(_detach_like, kwargs)))

    def pack(self, t: torch.Tensor) -> Tuple["_Run", int]:
        i = len(self.meta)
        self.meta.append((t.shape, t.dtype, t.device))
        if self.measure is not None:
            self.measure.append(t)
        return (self, i)

    def end(self, out: Any) -> None:
        self.chain_out = None
        ck = self.ckpt if self.ckpt is not None else self.d2h_src
        if ck is not None and ck._version != self.ckpt_version:
            raise RuntimeError(
                f"tidal.recompute: {self.seg!r} modified its input in place during forward; it cannot be "
                f"rerun from that input. Tip: leave this module out of the checkpoints.")

    # -- backward --------------------------------------------------------------
    def unpack(self, i: int) -> torch.Tensor:
        values = self.values
        if values is None or values[i] is None:
            self.plan._before_recompute(self)
            self.recompute()
            values = self.values
        v = values[i]  # type: ignore[index]
        values[i] = None  # type: ignore[index]
        aliases = self.plan.parameter_aliases
        return aliases[1](v) if aliases is not None else v  # type: ignore[return-value]

    def checkpoint(self) -> Optional[torch.Tensor]:
        """The checkpoint on the device, waiting for its prefetch if it was offloaded."""
        if self.host is None:
            return self.ckpt
        plan = self.plan
        if self.h2d is None:
            plan._prefetch(self, late=True)
        waited = plan._wait(self)
        plan._trace("use", self, waited=waited)
        return self.prefetched

    def recompute(self) -> None:
        plan = self.plan
        ck = self.checkpoint()
        if ck is not None and self.host is None and ck._version != self.ckpt_version:
            raise RuntimeError(f"tidal.recompute: the input of {self.seg!r} was modified in place after the "
                               f"forward pass; the segment cannot be recomputed from it.")
        n = len(self.meta)
        values: List[Optional[torch.Tensor]] = [None] * n
        count = [0]
        meta = self.meta
        seg = self.seg
        # Note [Recompute under the training engine]: under tidal.initialize a
        # parameter is a view of a chunk slot only while its module runs, and
        # the chunk may move before the segment's backward reads what the
        # recompute saved. The engine's pack/unpack keeps such a tensor as
        # (parameter record, view geometry) and rebuilds it from the
        # re-attached parameter when backward reads it, as it does for the
        # forward's saved tensors (python/tidal/engine/hooks.py).
        aliases = plan.parameter_aliases
        keep = aliases[0] if aliases is not None else None

        def pack_again(t: torch.Tensor) -> None:
            k = count[0]
            count[0] = k + 1
            if k < n:
                if (t.shape, t.dtype, t.device) != meta[k]:
                    raise RuntimeError(
                        f"tidal.recompute: recomputing {seg!r} saved tensor #{k} as {tuple(t.shape)} "
                        f"{t.dtype} on {t.device}, the forward saved {tuple(meta[k][0])} {meta[k][1]} on "
                        f"{meta[k][2]}: the segment does not run the same ops again (data-dependent control "
                        f"flow?). Leave it out of the checkpoints.")
                values[k] = keep(t) if keep is not None else t
            return None

        t0 = time.perf_counter()
        plan._trace("recompute_begin", self)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_recompute_guard())
            stack.enter_context(torch.enable_grad())
            if self.rng is not None:
                cpu, cuda = self.rng
                stack.enter_context(torch.random.fork_rng(devices=list(cuda), enabled=True))
                torch.set_rng_state(cpu)
                for dev, state in cuda.items():
                    torch.cuda.set_rng_state(state, dev)
            for dev_type, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type=dev_type, dtype=dtype, enabled=enabled))
            stack.enter_context(_scratch_running_stats(seg.modules))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack_again, _never_unpacked))
            y: Any = None
            for j, (module, (args, kwargs)) in enumerate(zip(seg.modules, self.calls)):
                if args and args[0] is _CHAIN:
                    first = y if j > 0 else _detach_like_ckpt(ck, self.ckpt_requires_grad)
                    args = (first,) + tuple(tree_map(_detach_like, args[1:]))
                else:
                    args = tree_map(_detach_like, args)
                y = _chain_value(module(*args, **tree_map(_detach_like, kwargs)))
            del y
        if count[0] != n:
            raise RuntimeError(f"tidal.recompute: recomputing {seg!r} saved {count[0]} tensors, the forward "
                               f"saved {n}: the segment does not run the same ops again. Leave it out of "
                               f"the checkpoints.")
        # The recomputed tensors hold what they need of the checkpoint; a second
        # backward (retain_graph) brings it back again.
        self.prefetched, self.h2d = None, None
        self.values = values
        seconds = time.perf_counter() - t0
        plan._counters["recomputes"] += 1
        plan._counters["recompute_seconds"] += seconds
        plan._trace("recompute_end", self, seconds=seconds)


def _detach_like_ckpt(ck: Optional[torch.Tensor], requires_grad: bool) -> Optional[torch.Tensor]:
    if ck is None:
        return None
    d = ck.detach()
    if requires_grad:
        d.requires_grad_(True)
    return d


def _never_unpacked(_: Any) -> Any:
    raise RuntimeError("tidal.recompute: internal error: a tensor saved during recompute was unpacked")


def _unpack(handle: Tuple[_Run, int]) -> torch.Tensor:
    run, i = handle
    return run.unpack(i)


def _tensors(tree: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    tree_map(lambda x: out.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return out


_NORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _scratch_running_stats(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Batch norm (and instance norm with running stats) in training mode updates
    its running statistics in forward; its output does not depend on them. A
    recompute gets scratch copies, so the originals are updated exactly once."""
    swapped: List[Tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for root in modules:
            for m in root.modules():
                if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats:
                    for name in _NORM_BUFFERS:
                        buf = m._buffers.get(name)
                        if buf is not None:
                            swapped.append((m, name, buf))
                            m._buffers[name] = buf.clone()
        yield
    finally:
        for m, name, buf in swapped:
            m._buffers[name] = buf


# ---------------------------------------------------------------------------
# The plan.

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
        self._link: Optional[_DeviceLink] = None
        self._cuda_streams: Dict[int, Any] = {}
        self._wrapped: Dict[nn.Module, Tuple[Optional[Callable], Callable]] = {}
        self._where: Dict[nn.Module, Tuple[Optional[Segment], int]] = {}
        self._open: Dict[int, _Run] = {}        # segment index -> run whose forward is in progress
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
        self.parameter_aliases: Optional[Tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = None
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
        if (not self._active or _recomputing() or not torch.is_grad_enabled()
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
            run = _Run(self, seg)
            if measuring:
                run.measure = []
                run.param_ptrs = frozenset(_C.chunks.storage_data_ptr(t)
                                           for t in list(module.parameters()) + list(module.buffers()))
            run.begin(args, kwargs)
            self._trace("forward_begin", run)
        else:
            run = self._open.get(seg.index)
            if run is None:
                raise RuntimeError(f"tidal.recompute: {seg!r}: block '{seg.names[j]}' ran without "
                                   f"'{seg.names[0]}' before it; the blocks of a segment must run in order.")
            run.add_call(j, args, kwargs)
        self._open[seg.index] = run
        try:
            with torch.autograd.graph.saved_tensors_hooks(run.pack, _unpack):
                out = orig(*args, **kwargs)
        except BaseException:
            self._open.pop(seg.index, None)
            raise
        run.next_block = j + 1
        if j + 1 < len(seg.modules):
            run.chain_out = _chain_value(out)
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
        return Segment(-1 - i, [_qual(name, i)], [module], False)

    def _record_measurement(self, module: nn.Module, run: _Run) -> None:
        blocks = self.chain[1]  # type: ignore[index]
        if self._measuring is None:
            self._measuring = {"act": [0] * len(blocks), "inp": [0] * len(blocks), "seen": [False] * len(blocks)}
        m = self._measuring
        i = next(k for k, b in enumerate(blocks) if b is module)
        sizes = {_C.chunks.storage_data_ptr(t): _storage_nbytes(t) for t in run.measure or ()}
        m["act"][i] = sum(n for ptr, n in sizes.items() if ptr not in run.param_ptrs)
        run.measure = None
        ck = run.ckpt if run.ckpt is not None else run.d2h_src
        m["inp"][i] = _storage_nbytes(ck) if ck is not None else 0
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
            segs.append(Segment(len(segs), [_qual(name, i) for i in idx], [blocks[i] for i in idx], False))
        # With kept blocks after them, every segment's backward waits for theirs.
        _mark_offload(segs, self.offload, keep_last=m == len(blocks))
        self._set_segments(segs)

    # -- offload -------------------------------------------------------------------
    def _cuda_stream(self, device: torch.device):
        s = self._cuda_streams.get(device.index)
        if s is None:
            s = self._cuda_streams[device.index] = torch.cuda.Stream(device)
        return s

    def _device_link(self) -> _DeviceLink:
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
            self._link = _DeviceLink(device, shared=not own)
        return self._link

    def _offload(self, run: _Run, x: torch.Tensor) -> torch.Tensor:
        """Starts the device->host copy of a checkpoint; returns the host tensor."""
        run.device = x.device
        self._counters["offloaded_bytes"] += x.numel() * x.element_size()
        self._counters["offloads"] += 1
        if x.is_cuda:
            stream = self._cuda_stream(x.device)
            host = torch.empty_strided(x.size(), x.stride() if _dense(x) else _contiguous_strides(x.size()),
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
                if not _dense(x):  # a copy moves bytes in order: make them dense first
                    x = x.contiguous()
                run.host_buffer, host = _host_tensor(x.size(), x.stride(), x.dtype)
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

    def _prefetch(self, run: _Run, late: bool = False) -> None:
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

    def _wait(self, run: _Run) -> float:
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

    def _before_recompute(self, run: _Run) -> None:
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
    def _trace(self, what: str, run: _Run, **info: Any) -> None:
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


def _contiguous_strides(size: torch.Size) -> Tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _mark_offload(segs: List[Segment], offload: bool, keep_last: bool = True) -> None:
    """Offloads every segment's checkpoint but the last one's: its backward runs
    first, so a round trip would only add a copy."""
    for s in segs:
        s.offload = offload and (not keep_last or s.index < len(segs) - 1)


def _qual(prefix: str, i: int) -> str:
    return f"{prefix}.{i}" if prefix else str(i)


# ---------------------------------------------------------------------------
# The entry points.

def _parse_bandwidth(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"offload_bandwidth takes bytes/s as a number or a string such as '12GB/s', "
                        f"got {type(value).__name__} {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not text.endswith("/s"):
            raise ValueError(f"offload_bandwidth: expected a rate such as '12GB/s', got {value!r}")
        try:
            rate = float(parse_bytes(text[:-2].strip()))
        except ValueError as e:
            raise ValueError(f"offload_bandwidth: {value!r} is not a rate ({e}); write it like '12GB/s'") from None
    else:
        rate = float(value)
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"offload_bandwidth: expected a rate > 0, got {value!r}")
    return rate


def recompute(model: nn.Module, checkpoints: Checkpoints = "auto", offload: bool = False, *,
              segments: Optional[int] = None, memory_target: Optional[ByteSize] = None,
              chain: Optional[str] = None, prefetch_depth: int = 1,
              offload_bandwidth: Optional[Union[float, str]] = None, offload_latency_us: float = 0.0,
              preserve_rng_state: bool = True, synchronize_boundaries: bool = False,
              trace: bool = False) -> Recompute:
    """Installs a recompute plan on ``model`` (in place) and returns it.

    Args:
        model: the model; its modules' forwards are wrapped until ``plan.remove()``.
        checkpoints: ``"auto"``: the chain of repeated blocks (see :func:`find_chain`)
            in about sqrt(N) segments of consecutive blocks (Chen et al.), or
            ``segments`` of them, or as ``memory_target`` asks. Or a list: each
            entry (a module name, a module, or a list of consecutive blocks that run
            one after the other) is one segment.
        offload: copy checkpoints to host memory as they are made and prefetch
            them back before their segment's backward (all but the last segment).
        segments: with "auto": the number of segments (1..N).
        memory_target: with "auto": bytes (int or "2GB") the chain's activations
            may take, or "min". The first forward runs one segment per block and
            measures each block; from the next forward the plan recomputes the
            fewest blocks (the first ones) whose estimate meets the target.
        chain: with "auto": the name of the ModuleList/Sequential to segment.
        prefetch_depth: checkpoints brought back ahead of use (>= 1).
        offload_bandwidth: not on CUDA: the offload copies take a simulated link of
            their own at bytes/s (or "12GB/s"); default: the simulated device's
            link, shared with the training engine's chunk copies.
        offload_latency_us: not on CUDA: that link's fixed cost per copy.
        preserve_rng_state: replay random ops with the forward's RNG states.
        synchronize_boundaries: wait for the device and the copy stream at every
            segment boundary (DeepSpeed's synchronize_checkpoint_boundary).
        trace: record timestamped events (forward/recompute/copies) in ``plan.trace``.

    Raises:
        ValueError: a name that matches no module (with near matches), a module not
            in the model, a module in two segments or nested in another segment,
            no chain for "auto", or a bad option value.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"tidal.recompute: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(offload, bool):
        raise TypeError(f"tidal.recompute: offload takes a bool, got {offload!r}")
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
        raise ValueError(f"tidal.recompute: prefetch_depth must be an integer >= 1, got {prefetch_depth!r}")
    if not isinstance(offload_latency_us, (int, float)) or offload_latency_us < 0:
        raise ValueError(f"tidal.recompute: offload_latency_us must be >= 0, got {offload_latency_us!r}")
    bandwidth = _parse_bandwidth(offload_bandwidth)
    target: Optional[Union[int, str]] = None
    if memory_target is not None:
        if memory_target == "min":
            target = "min"
        else:
            try:
                target = parse_bytes(memory_target)
            except (TypeError, ValueError) as e:
                raise ValueError(f"tidal.recompute: memory_target={memory_target!r} is not a byte size or "
                                 f"'min' ({e})") from None
    modules = dict(model.named_modules())
    names_of = {id(m): n for n, m in modules.items()}
    chain_info = None
    if isinstance(checkpoints, str):
        if checkpoints != "auto":
            raise ValueError(f"tidal.recompute: checkpoints={checkpoints!r}; expected 'auto' or a list of module "
                             f"names/modules (for one module: checkpoints=[{checkpoints!r}])")
        chain_name, blocks = find_chain(model, chain)
        n = len(blocks)
        if segments is not None and memory_target is not None:
            raise ValueError("tidal.recompute: give segments or memory_target, not both")
        if segments is not None:
            if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n:
                raise ValueError(f"tidal.recompute: segments={segments!r}; the chain '{chain_name}' has {n} "
                                 f"blocks, so expected an integer in 1..{n}")
            count = segments
        else:
            count = max(1, min(n, round(math.sqrt(n))))
        prefix = "" if chain_name == "<root>" else chain_name
        segs: List[Segment] = []
        if target is None:
            start = 0
            for size in _even_sizes(n, count):
                idx = range(start, start + size)
                segs.append(Segment(len(segs), [_qual(prefix, i) for i in idx], [blocks[i] for i in idx], False))
                start += size
        chain_info = (prefix, blocks)
    else:
        if segments is not None or memory_target is not None or chain is not None:
            raise ValueError("tidal.recompute: segments, memory_target and chain apply to checkpoints='auto' only")
        if isinstance(checkpoints, nn.Module) or not isinstance(checkpoints, Sequence) or not checkpoints:
            raise ValueError(f"tidal.recompute: checkpoints must be 'auto' or a non-empty list of module names "
                             f"or modules, got {checkpoints!r}")
        segs = []
        seen: Dict[int, str] = {}
        for entry in checkpoints:
            group = list(entry) if isinstance(entry, (list, tuple)) else [entry]
            if not group:
                raise ValueError("tidal.recompute: an empty group in checkpoints")
            mods, names = [], []
            for item in group:
                if isinstance(item, nn.Module):
                    if id(item) not in names_of:
                        raise ValueError(f"tidal.recompute: a {type(item).__name__} in checkpoints is not a "
                                         f"module of {type(model).__name__}")
                    m, name = item, names_of[id(item)]
                else:
                    m, name = _resolve_name(model, modules, item, "checkpoint"), item
                if id(m) in seen:
                    raise ValueError(f"tidal.recompute: module '{name or '<root>'}' is in two segments "
                                     f"(also as '{seen[id(m)] or '<root>'}')")
                seen[id(m)] = name
                mods.append(m)
                names.append(name or "<root>")
            segs.append(Segment(len(segs), names, mods, False))
        # No segment may hold another segment's module inside it.
        for seg in segs:
            for m in seg.modules:
                for inner_name, inner in m.named_modules():
                    if inner is not m and id(inner) in seen:
                        raise ValueError(f"tidal.recompute: checkpoint '{seen[id(inner)]}' is inside checkpoint "
                                         f"'{seen[id(m)] or '<root>'}'; nested segments are not supported")
    _mark_offload(segs, offload)
    return Recompute(model, segs, offload=offload, prefetch_depth=prefetch_depth, offload_bandwidth=bandwidth,
                     offload_latency=offload_latency_us * 1e-6, preserve_rng_state=preserve_rng_state,
                     synchronize_boundaries=synchronize_boundaries, trace=trace, chain=chain_info,
                     memory_target=target)


# ---------------------------------------------------------------------------
# The config file's activation_checkpointing block.

def _parses(parse: Callable[[Any], Any]) -> Callable[[Any], bool]:
    def ok(value: Any) -> bool:
        try:
            parse(value)
            return True
        except (TypeError, ValueError):
            return False
    return ok


def _is_count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _is_checkpoint_list(value: Any) -> bool:
    return value == "auto" or (isinstance(value, list) and bool(value) and all(
        isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(u, str) for u in v)) for v in value))


#: key -> (kind, default, what tidal does), kinds as in tidal._schema.check_value.
#: DeepSpeed's keys first, then tidal's.
CONFIG_KEYS: Dict[str, Tuple[Any, Any, str]] = {
    "partition_activations": (bool, False,
                              "not applicable on one GPU: DeepSpeed splits each checkpoint across model-parallel "
                              "ranks; tidal keeps whole checkpoints (cpu_checkpointing moves them off the device)"),
    "cpu_checkpointing": (bool, False, "offload: checkpoints go to pinned host memory and are prefetched "
                                       "back on a copy stream before their segment's backward"),
    "contiguous_memory_optimization": (bool, False,
                                       "not used: tidal does not gather checkpoints into one preallocated buffer; "
                                       "device copies come from the caching allocator, host copies from pinned "
                                       "host memory on CUDA"),
    "number_checkpoints": (Rule("null or an integer >= 1", lambda v: v is None or _is_count(v)), None,
                           "the number of segments of the chain (checkpoints='auto'); default about sqrt(N)"),
    "synchronize_checkpoint_boundary": (bool, False,
                                        "honoured: the device and the copy stream are synchronized at every "
                                        "segment boundary, forward and backward"),
    "profile": (bool, False, "honoured: timestamped forward/recompute/copy events in plan.trace; "
                             "totals in plan.stats()"),
    "enabled": (bool, True, "tidal: install the plan (false: from_config returns None)"),
    "checkpoints": (Rule("'auto' or a non-empty list of module names (a name, or a list of names of "
                         "consecutive blocks, per segment)", _is_checkpoint_list), "auto",
                    "tidal: the segments; 'auto' = the chain of repeated blocks"),
    "chain": ((str, NONE), None, "tidal: the ModuleList/Sequential that 'auto' segments"),
    "memory_target": (Rule("null, 'min' or a byte size such as '2GB'",
                           lambda v: v is None or v == "min" or _parses(parse_bytes)(v)), None,
                      "tidal: measured plan recomputing the fewest blocks that fit this activation budget"),
    "prefetch_depth": (Rule("an integer >= 1", _is_count), 1, "tidal: offloaded checkpoints prefetched ahead of use"),
    "offload_bandwidth": (Rule("null or a rate such as '12GB/s'", _parses(_parse_bandwidth)), None,
                          "tidal, not on CUDA: a simulated link of the offload copies' own (default: "
                          "the simulated device's, shared with the chunk copies)"),
    "preserve_rng_state": (bool, True, "tidal: random ops replay the forward's randomness"),
}

_NOT_HONOURED = ("partition_activations", "contiguous_memory_optimization")
_DEEPSPEED_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                   "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
_TIDAL_KEYS = tuple(k for k in CONFIG_KEYS if k not in _DEEPSPEED_KEYS)
_SECTION = "activation_checkpointing"
_TIDAL_SECTION = "tidal.recompute"


def _config_error(path: str, value: Any, allowed: str, extra: str = "") -> Exception:
    return ConfigError(f"config key '{path}': expected {allowed}, got {value!r}{extra}")


def validate_config(block: Dict[str, Any], tidal_block: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Checks a config file's ``activation_checkpointing`` block (DeepSpeed's keys,
    and tidal's for direct use) and ``tidal.recompute`` block (tidal's keys);
    returns their union with defaults filled in. Errors name the key with its
    section, the value and what is allowed.

    Raises:
        tidal.ConfigError: an unknown key (with the nearest valid one), a wrong
            type or an out-of-range value, a key given in both blocks, or keys
            that contradict each other.
    """
    out = {k: spec[1] for k, spec in CONFIG_KEYS.items()}
    where: Dict[str, str] = {}
    for section, given, keys in ((_SECTION, block, tuple(CONFIG_KEYS)), (_TIDAL_SECTION, tidal_block, _TIDAL_KEYS)):
        if given is None and section == _TIDAL_SECTION:
            continue
        if not isinstance(given, dict):
            raise ConfigError(f"config key '{section}': expected an object, got {type(given).__name__} {given!r}")
        for key, value in given.items():
            path = f"{section}.{key}"
            if key not in keys:
                extra = f" (DeepSpeed's keys go in '{_SECTION}')" if key in _DEEPSPEED_KEYS else ""
                raise unknown_key(path, key, keys, f"'{section}'", extra)
            if key in where:
                raise ConfigError(f"config key '{key}' is given in both '{where[key]}' and '{path}'; give it once")
            check_value(path, CONFIG_KEYS[key][0], value)
            where[key] = path
            out[key] = value
    out["_paths"] = {k: where.get(k, f"{_TIDAL_SECTION if k in _TIDAL_KEYS else _SECTION}.{k}") for k in CONFIG_KEYS}
    paths = out["_paths"]
    if out["checkpoints"] != "auto":
        for key in ("number_checkpoints", "memory_target", "chain"):
            if out[key] is not None:
                raise ConfigError(f"config keys '{paths['checkpoints']}' (a list) and '{paths[key]}' = "
                                  f"{out[key]!r} contradict each other: {key} applies to checkpoints='auto' only")
    if out["number_checkpoints"] is not None and out["memory_target"] is not None:
        raise ConfigError(f"config keys '{paths['number_checkpoints']}' and '{paths['memory_target']}' "
                          f"contradict each other: give one")
    return out


def from_config(model: nn.Module, block: Dict[str, Any],
                tidal_block: Optional[Dict[str, Any]] = None) -> Optional[Recompute]:
    """Installs the plan a config file asks for.

    DeepSpeed's keys keep their meaning where it carries over to one GPU:
    ``cpu_checkpointing`` is offload, ``number_checkpoints`` the number of
    segments, ``synchronize_checkpoint_boundary`` and ``profile`` are honoured;
    ``partition_activations`` and ``contiguous_memory_optimization`` set to true
    give a warning saying what tidal does instead. tidal's own keys (see
    :data:`CONFIG_KEYS`) go in ``tidal_block``, or in ``block`` when calling
    this directly. ``plan.report`` says what tidal does with each key given.

    Args:
        model: the model.
        block: the mapping under ``activation_checkpointing``.
        tidal_block: the mapping under ``tidal`` -> ``recompute``, if any.

    Returns:
        The plan, or None when ``"enabled": false``.
    """
    c = validate_config(block, tidal_block)
    paths = c["_paths"]
    for key in _NOT_HONOURED:
        if c[key]:
            warnings.warn(f"config key '{paths[key]}' = true is not used by tidal: {CONFIG_KEYS[key][2]}",
                          stacklevel=2)
    if not c["enabled"]:
        return None
    number = c["number_checkpoints"]
    if number is not None:
        _, blocks = find_chain(model, c["chain"])
        if number > len(blocks):
            raise _config_error(paths["number_checkpoints"], number, f"an integer in 1..{len(blocks)}",
                                f" (the chain has {len(blocks)} blocks)")
    checkpoints = c["checkpoints"]
    if checkpoints != "auto":
        checkpoints = [list(v) if isinstance(v, list) else v for v in checkpoints]
    try:
        plan = recompute(model, checkpoints, c["cpu_checkpointing"], segments=number,
                         memory_target=c["memory_target"], chain=c["chain"], prefetch_depth=c["prefetch_depth"],
                         offload_bandwidth=c["offload_bandwidth"], preserve_rng_state=c["preserve_rng_state"],
                         synchronize_boundaries=c["synchronize_checkpoint_boundary"], trace=c["profile"])
    except ValueError as e:  # a name that matches no module, no chain: the key that named it
        key = "chain" if checkpoints == "auto" and c["chain"] is not None else "checkpoints"
        raise ConfigError(f"config key '{paths[key]}': {e}") from None
    given = set(block) | set(tidal_block or ())
    plan.report = {paths[k]: f"{c[k]!r}: {CONFIG_KEYS[k][2]}" for k in CONFIG_KEYS if k in given}
    return plan


class _RecomputeModule(types.ModuleType):
    """Makes the module callable: ``tidal.recompute(model, ...)`` is
    :func:`recompute`, and ``tidal.recompute.from_config`` stays reachable."""

    def __call__(self, *args, **kwargs) -> Recompute:
        return recompute(*args, **kwargs)


sys.modules[__name__].__class__ = _RecomputeModule
