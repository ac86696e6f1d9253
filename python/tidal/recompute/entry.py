"""The entry point: :func:`recompute` checks its arguments, chooses the
segments and installs a :class:`Recompute` plan."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Union

from torch import nn

from tidal.device import parse_bytes

from .plan import Recompute
from .segments import Segment, even_sizes, find_chain, mark_offload, qual, resolve_name

ByteSize = Union[int, str]
Checkpoints = Union[str, Sequence[Union[str, nn.Module, Sequence[Union[str, nn.Module]]]]]


def parse_bandwidth(value: Any) -> Optional[float]:
    """offload_bandwidth in bytes/s (a number, or a rate such as '12GB/s'); None stays None."""
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
    bandwidth = parse_bandwidth(offload_bandwidth)
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
            for size in even_sizes(n, count):
                idx = range(start, start + size)
                segs.append(Segment(len(segs), [qual(prefix, i) for i in idx], [blocks[i] for i in idx], False))
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
                    m, name = resolve_name(model, modules, item, "checkpoint"), item
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
    mark_offload(segs, offload)
    return Recompute(model, segs, offload=offload, prefetch_depth=prefetch_depth, offload_bandwidth=bandwidth,
                     offload_latency=offload_latency_us * 1e-6, preserve_rng_state=preserve_rng_state,
                     synchronize_boundaries=synchronize_boundaries, trace=trace, chain=chain_info,
                     memory_target=target)
