"""torch's per-process cap on a GPU, held while an engine lives.

Note [torch's cap belongs to the live engines]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An engine on a GPU whose chunk blocks come from torch's caching allocator
caps torch at its budget (torch.cuda.set_per_process_memory_fraction; why,
in Engine.__init__). The cap is process-wide state, and an engine has no
close(): it ends when it is collected. Left behind, the cap would limit
whatever the process does afterwards: plain evaluation, a second model, a
peer benchmark in the same process.

So each engine holds a claim on its device, and the cap is always the claim
of the newest live engine there; when the last claim goes, the device gets
back the fraction it had before the first (1.0, torch's default, where this
torch cannot read it). A claim ends when its engine is collected
(weakref.finalize); not at interpreter exit, where the cap no longer matters
and torch may be half torn down. A fraction somebody else set
while claims were live is theirs: it is kept when the claims end, and a
claim ending re-applies the newest remaining claim only while the current
fraction is still one tidal set.

An engine sits in reference cycles (its model's hooks hold it), so it is
freed by the cycle collector, which runs at any allocation, also inside
claim() on the same thread. So the finalizer never waits for the lock: it
queues its claim's end and applies it when the lock is free (at once, or when
the claim() under way, or the next, is done).
"""
from __future__ import annotations

import collections
import threading
import warnings
import weakref

import torch


class DeviceCaps:
    """The live claims per device. `get(index) -> float` and
    `set(fraction, index)` reach torch (swapped out by the tests)."""

    def __init__(self, get=None, set=None):
        self._get = get or _torch_get
        self._set = set or _torch_set
        self._lock = threading.Lock()
        self._claims: dict[int, list] = {}  # device -> [[token, fraction], ...], oldest first
        self._before: dict[int, float] = {}  # device -> the fraction before its first claim
        self._ended: collections.deque = collections.deque()  # (device, token) to release

    def claim(self, owner, device: int, fraction: float) -> None:
        """Caps `device` at `fraction` until `owner` is collected."""
        if not float(fraction) > 0.0:
            raise ValueError(f"torch's per-process cap: expected a fraction in (0, 1], got "
                             f"{fraction!r}")
        fraction = min(1.0, float(fraction))
        token = object()
        with self._lock:
            self._release_ended()
            claims = self._claims.setdefault(device, [])
            before = self._get(device) if not claims else None
            self._set(fraction, device)  # (a refusal leaves no claim behind)
            if not claims:
                self._before[device] = before
            claims.append([token, fraction])
        weakref.finalize(owner, self._ended_claim, device, token).atexit = False
        self._release_when_free()

    def _ended_claim(self, device: int, token) -> None:
        # (the finalizer: never waits for the lock, see the Note)
        self._ended.append((device, token))
        self._release_when_free()

    def _release_when_free(self) -> None:
        while self._ended and self._lock.acquire(blocking=False):
            try:
                self._release_ended()
            finally:
                self._lock.release()

    def _release_ended(self) -> None:
        """Ends the queued claims; the lock is held. A failure to give a
        fraction back is a warning, not an error of the claim under way."""
        while self._ended:
            device, token = self._ended.popleft()
            try:
                self._release(device, token)
            except Exception as e:  # noqa: BLE001 -- torch refused the fraction
                warnings.warn(f"tidal: giving torch's memory fraction of device {device} back "
                              f"failed: {e}", stacklevel=2)

    def _release(self, device: int, token) -> None:
        claims = self._claims.get(device, [])
        ours = [f for _, f in claims]
        remaining = [c for c in claims if c[0] is not token]
        if len(remaining) == len(claims):
            return
        self._claims[device] = remaining
        current = self._get(device)
        if not any(_same(current, f) for f in ours):
            if not remaining:
                self._before.pop(device, None)
            return  # set by somebody else since: theirs
        target = remaining[-1][1] if remaining else self._before.pop(device)
        if not _same(target, current):
            self._set(target, device)

    def claims(self, device: int) -> list[float]:
        """The live claims' fractions on `device`, oldest first."""
        with self._lock:
            self._release_ended()
            out = [f for _, f in self._claims.get(device, [])]
        self._release_when_free()
        return out


def _same(a: float, b: float) -> bool:
    # torch keeps the cap in bytes (the fraction times the card's memory,
    # rounded down) and reads it back as bytes / memory, so a fraction read
    # back differs from the one set by at most 1 / memory.
    return abs(a - b) <= 1e-9


def _torch_get(device: int) -> float:
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if get is None else float(get(device))


def _torch_set(fraction: float, device: int) -> None:
    torch.cuda.set_per_process_memory_fraction(fraction, device)


CAPS = DeviceCaps()
