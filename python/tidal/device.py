"""The device tidal moves memory to, and what it can tell about it.

tidal runs on a CUDA GPU when there is one and on the *simulated device*
otherwise: a capacity-limited host arena whose copies run asynchronously at a
configurable bandwidth, so every scheduling path runs without a GPU. Pick one
with ``TIDAL_DEVICE=auto|cuda|sim`` or :func:`set_device`.
"""

from __future__ import annotations

from typing import Optional, Union

from tidal import _C

Device = _C.Device
DeviceBuffer = _C.DeviceBuffer
Event = _C.Event
HostBuffer = _C.HostBuffer
Stream = _C.Stream

ByteSize = Union[int, str]

__all__ = [
    "Device",
    "DeviceBuffer",
    "Event",
    "HostBuffer",
    "Stream",
    "device_info",
    "get_device",
    "parse_bytes",
    "set_device",
    "stats",
]

def parse_bytes(size: ByteSize) -> int:
    """Bytes in ``size``: an int, or a string such as ``"64MiB"`` or ``"5GB"``.

    KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024.

    Raises:
        ValueError: the string is not a size; the message names it.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"expected a byte size as int or str such as '64MiB', got {type(size).__name__}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"expected a non-negative byte size, got {size}")
        return size
    return _C.parse_bytes(size)


def _create(kind: str, capacity, bandwidth, latency_us, pin_bandwidth=None) -> Device:
    return _C.create_device(
        kind,
        None if capacity is None else parse_bytes(capacity),
        bandwidth,
        latency_us,
        pin_bandwidth,
    )


def set_device(
    kind: str = "auto",
    *,
    capacity: Optional[ByteSize] = None,
    bandwidth: Optional[str] = None,
    latency_us: Optional[float] = None,
    pin_bandwidth: Optional[str] = None,
) -> Device:
    """Create the device tidal uses from now on, and return it.

    Args:
        kind: ``"auto"`` (a GPU if there is one, else simulated), ``"cuda"`` or ``"sim"``.
        capacity: device memory tidal may use (int bytes or ``"4GiB"``). On the
            simulated device this is its size; on CUDA a budget below the GPU's memory.
        bandwidth: simulated device only: link bandwidth each way, e.g. ``"12GB/s"``.
            Unset: unlimited (copies run at memcpy speed, still asynchronously).
        latency_us: simulated device only: fixed cost per copy in microseconds.
        pin_bandwidth: simulated device only: what pinning a host block costs,
            e.g. ``"6GB/s"`` (about an H100 host's ``cudaHostRegister``). Unset: free.

    Raises:
        ValueError: an unknown kind, ``"cuda"`` without a usable GPU (the message
            says why), or a bad size.
    """
    device = _create(kind, capacity, bandwidth, latency_us, pin_bandwidth)
    _C.set_default_device(device)
    return device


def get_device() -> Device:
    """The device tidal uses: created on first use from ``TIDAL_DEVICE`` (default ``auto``)."""
    return _C.default_device()


def device_info(device: Union[None, str, Device] = None) -> dict:
    """What tidal runs on: backend, capacity, pinned memory, CPU SIMD target.

    Args:
        device: None for the current device, a kind (``"sim"``, ``"cuda"``,
            ``"auto"``) to describe a fresh device of that kind, or a Device.

    Returns:
        A dict with ``backend`` ("cuda" or "sim"), ``name``, ``ordinal``,
        ``total_memory`` and ``capacity`` (bytes), ``pinned_memory`` (whether host
        buffers get page-locked), ``sim_copy_bandwidth`` (bytes/s, 0 = unlimited),
        ``sim_copy_latency_s`` (fixed cost per copy), ``sim_pin_bandwidth`` (bytes/s pinning
        costs, 0 = free),
        ``cuda_compiled``, ``cuda_devices``, ``cuda_unavailable_reason``,
        ``cpu_simd_target`` (what the CPU kernels dispatch to) and
        ``cpu_simd_targets`` (all runnable targets compiled in, best first).
    """
    if device is None:
        device = get_device()
    elif isinstance(device, str):
        device = _create(device, None, None, None)
    elif not isinstance(device, Device):
        raise TypeError(f"expected None, a device kind or a tidal.Device, got {type(device).__name__}")
    info = dict(device.info())
    gpus, why = _C.cuda_device_count()
    info.update(
        version=_C.__version__,
        cuda_compiled=_C.cuda_backend_compiled(),
        cuda_devices=gpus,
        cuda_unavailable_reason=why or None,
        cpu_simd_target=_C.cpu_simd_target(),
        cpu_simd_targets=_C.runnable_simd_targets(),
    )
    return info


def stats() -> dict:
    """Live counters: host buffers (bytes, pinned, huge pages) and device memory."""
    return {"host": dict(_C.host_memory_stats()), "device": dict(get_device().memory_stats())}
