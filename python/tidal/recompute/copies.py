"""The copies of offloaded checkpoints that do not run on CUDA: through
tidal's device layer (a stream of the simulated device, or a simulated link of
their own), with timing events for when each copy ran. On CUDA the plan uses
a torch.cuda.Stream and CUDA events (plan.py)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from tidal._C import HostBuffer


class CopyEvent:
    """Completion of one copy. Times are ``time.perf_counter()`` seconds: issued
    (host); started/completed (when the device layer's stream began and
    finished the copy, read from timing events; None on CUDA)."""

    __slots__ = ("kind", "nbytes", "label", "issued_at", "_link", "_start", "_end", "_cuda")

    def __init__(self, kind: str, nbytes: int, label: Any):
        self.kind, self.nbytes, self.label = kind, nbytes, label
        self.issued_at = time.perf_counter()
        self._link: Optional["DeviceLink"] = None
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


class DeviceLink:
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


def host_tensor(size: torch.Size, stride: Tuple[int, ...], dtype: torch.dtype) -> Tuple[HostBuffer, torch.Tensor]:
    """A tidal.HostBuffer and a host tensor of this (dense) layout over it (the tensor keeps the buffer alive)."""
    numel = math.prod(size)
    nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
    buf = HostBuffer(nbytes)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype)
    return buf, flat.as_strided(size, stride)


def dense(t: torch.Tensor) -> bool:
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


def contiguous_strides(size: torch.Size) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of `size`."""
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
