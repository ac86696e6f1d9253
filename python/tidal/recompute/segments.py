"""Segments and how they are chosen: the chain of repeated blocks that
``checkpoints="auto"`` segments, the names of the modules a plan wraps, and
the measured plan for a memory target (Chen et al.'s estimate)."""

from __future__ import annotations

import collections
import difflib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn


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
        container = resolve_name(model, modules, name, what="chain")
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 1:
            raise ValueError(f"chain '{name}' is a {type(container).__name__}; expected an nn.ModuleList "
                             f"or nn.Sequential of blocks")
        return name, list(container)
    best = None
    for path, m in modules.items():
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
            best = (key, path, children)
    if best is None:
        raise ValueError(
            f"checkpoints='auto' found no chain of repeated blocks in {type(model).__name__}: it needs an "
            f"nn.ModuleList or nn.Sequential whose children with parameters (at least 2) are all of one "
            f"class. Tip: pass chain='name.of.the.list', or name the checkpoints, e.g. "
            f"checkpoints=['layer1', 'layer2'].")
    return best[1] or "<root>", best[2]


def resolve_name(model: nn.Module, modules: Dict[str, nn.Module], name: Any, what: str) -> nn.Module:
    """The module of `modules` (model.named_modules()) called `name`; an error
    that names near matches when none is, calling it a `what`."""
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


def even_sizes(n: int, parts: int) -> List[int]:
    """`n` split into `parts` sizes that differ by at most one, the larger first."""
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


def mark_offload(segs: List[Segment], offload: bool, keep_last: bool = True) -> None:
    """Offloads every segment's checkpoint but the last one's: its backward runs
    first, so a round trip would only add a copy."""
    for s in segs:
        s.offload = offload and (not keep_last or s.index < len(segs) - 1)


def qual(prefix: str, i: int) -> str:
    """The qualified name of block `i` of the chain called `prefix` ("" when the chain is the model itself)."""
    return f"{prefix}.{i}" if prefix else str(i)
