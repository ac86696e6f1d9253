"""One forward execution of a segment until its backward is done (Run):
what autograd saved is packed as (run, index) handles, and the first unpack in
backward reruns the segment from its checkpoint with the forward's RNG and
autocast state and scratch batch-norm statistics.

A run knows nothing of the plan that made it: the plan (plan.py) hands it its
id and settings, moves its checkpoint to the host and back, and decides when it
reruns (``Recompute._unpack``); the run records the forward and replays it
(:meth:`Run.replay`) from the checkpoint it is given."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_map

from tidal import _C
from tidal import dtr as _dtr
from tidal._C import HostBuffer

from .copies import CopyEvent
from .segments import Segment

__all__ = ["ParameterAliases", "Run", "chain_value", "recomputing", "storage_nbytes"]

# (pack, unpack) of the training engine's parameter aliases; see
# Note [Recompute under the training engine].
ParameterAliases = Tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]

_tls = threading.local()  # .recomputing: > 0 while a segment is being rerun on this thread


def recomputing() -> bool:
    """Whether a segment is being rerun on this thread."""
    return getattr(_tls, "recomputing", 0) > 0


@contextlib.contextmanager
def _recompute_guard() -> Iterator[None]:
    _tls.recomputing = getattr(_tls, "recomputing", 0) + 1
    try:
        yield
    finally:
        _tls.recomputing -= 1


@contextlib.contextmanager
def _packed_recompute() -> Iterator[None]:
    """Under an engine: this replay keeps parameter views as (parameter,
    geometry) (plan.parameter_aliases), so the engine lets the parameters go
    after the replay's forward (Note [A recompute inside backward] in
    hooks/module_hooks.cpp)."""
    from .. import _C
    _C.chunks.enter_packed_recompute()
    try:
        yield
    finally:
        _C.chunks.exit_packed_recompute()


_CHAIN = object()  # stands for the previous block's output in a recorded call


def _detach_like(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        d = x.detach()
        if x.requires_grad and (x.is_floating_point() or x.is_complex()):
            d.requires_grad_(True)
        return d
    return x


def chain_value(out: Any) -> Any:
    """What the next block of a chain takes as its first argument."""
    return out[0] if isinstance(out, (tuple, list)) and out else out


def storage_nbytes(t: torch.Tensor) -> int:
    """The bytes under a tensor (0 for a storage DTR has evicted)."""
    # Not t.untyped_storage(): see storage_data_ptr in python/csrc/chunk_bindings.cpp.
    if t.layout != torch.strided:
        return t.numel() * t.element_size()
    return _C.chunks.storage_nbytes(t)


class Run:
    """The state of one forward pass through a segment until its backward is
    done: the checkpoint (or its host copy), the calls to replay, the RNG and
    autocast state, and the metadata of every tensor autograd saved.

    Args:
        seg: the segment this run goes through.
        run_id: the plan's number for it (in traces and copy events).
    """

    def __init__(self, seg: Segment, run_id: int):
        self.seg = seg
        self.id = run_id
        self.calls: List[Tuple[Any, Any]] = []  # per block: (args, kwargs), detached
        self.chain_out: Any = None              # previous block's output while forward runs
        self.next_block = 0
        self.meta: List[Tuple[torch.Size, torch.dtype, torch.device]] = []
        self.values: Optional[List[Optional[torch.Tensor]]] = None
        self.rng: Optional[Tuple[torch.Tensor, Dict[int, torch.Tensor]]] = None
        self.autocast: List[Tuple[str, bool, torch.dtype]] = []
        # the checkpoint: args[0] of the first call is _CHAIN-free; when the plan
        # offloads it, `ckpt` is None while the copy lives on the host.
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
    def begin(self, args: tuple, kwargs: dict, preserve_rng_state: bool) -> None:
        """The segment's first block starts: keeps its input as the checkpoint
        (``ckpt``; the plan may then move it to the host) and the RNG and
        autocast state a replay restores."""
        if preserve_rng_state:
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
            if x.numel() and storage_nbytes(x) == 0:
                torch.ops.aten.alias.default(x)  # an evicted input comes back through DTR first
            with torch.no_grad(), _dtr.outside():
                x = x.detach().clone()
        else:
            x = x.detach()  # shares the version counter: in-place updates of the input are caught
        self.ckpt_version = x._version
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

    def pack(self, t: torch.Tensor) -> Tuple["Run", int]:
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
    def take(self, i: int) -> Optional[torch.Tensor]:
        """Saved tensor ``i`` once a replay made it (handed out once), or None
        when the segment must be replayed first."""
        values = self.values
        if values is None or values[i] is None:
            return None
        v = values[i]
        values[i] = None
        return v

    def check_input(self, ck: Optional[torch.Tensor]) -> None:
        """Raises when the checkpoint kept on the device was modified in place
        after the forward pass (a host copy is the forward's own)."""
        if ck is not None and self.host is None and ck._version != self.ckpt_version:
            raise RuntimeError(f"tidal.recompute: the input of {self.seg!r} was modified in place after the "
                               f"forward pass; the segment cannot be recomputed from it.")

    def replay(self, ck: Optional[torch.Tensor], aliases: Optional[ParameterAliases]) -> None:
        """Reruns the segment from its checkpoint ``ck`` (on the device) and
        keeps what autograd saved, for :meth:`take`.

        Args:
            ck: the checkpoint (None when the segment had no tensor input).
            aliases: the training engine's parameter aliases, or None.
        """
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
        # forward's saved tensors (PackHook and UnpackHook in
        # python/csrc/hook_callables.cpp; plan.parameter_aliases is that pair).
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

        with contextlib.ExitStack() as stack:
            stack.enter_context(_recompute_guard())
            if aliases is not None:
                stack.enter_context(_packed_recompute())
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
                y = chain_value(module(*args, **tree_map(_detach_like, kwargs)))
            del y
        if count[0] != n:
            raise RuntimeError(f"tidal.recompute: recomputing {seg!r} saved {count[0]} tensors, the forward "
                               f"saved {n}: the segment does not run the same ops again. Leave it out of "
                               f"the checkpoints.")
        self.values = values


def _detach_like_ckpt(ck: Optional[torch.Tensor], requires_grad: bool) -> Optional[torch.Tensor]:
    if ck is None:
        return None
    d = ck.detach()
    if requires_grad:
        d.requires_grad_(True)
    return d


def _never_unpacked(_: Any) -> Any:
    raise RuntimeError("tidal.recompute: internal error: a tensor saved during recompute was unpacked")


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
