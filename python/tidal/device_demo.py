"""Device-layer demo: chunk-sized buffers past the device's capacity, moved both ways.

Run ``python -m tidal.device_demo --help``. On a machine with a GPU it uses
CUDA (pinned host buffers, real copies); otherwise the simulated device, whose
copies take the time the configured link bandwidth says they take.

What it does:
  1. allocates chunk-sized device buffers until the device's capacity is
     reached and shows the out-of-memory error tidal gives for the next one;
  2. keeps a few of them as device "slots" and streams more host chunks than
     the device can hold through them: all uploads, all downloads (each timed
     with device events), then a pipelined round trip on two streams whose
     every byte is checked;
  3. frees everything and shows the counters back at their baseline.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import numpy as np

import tidal

__all__ = ["main"]


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _fill(buf: tidal.HostBuffer, index: int) -> None:
    words = np.frombuffer(buf, dtype=np.uint32)
    words[:] = np.arange(words.size, dtype=np.uint32) * np.uint32(2654435761) + np.uint32(index)


def _timed(device: tidal.Device, stream: tidal.Stream, issue) -> float:
    """Seconds the work issued by ``issue()`` on ``stream`` took, by device events."""
    start = device.create_event(enable_timing=True)
    end = device.create_event(enable_timing=True)
    start.record(stream)
    issue()
    end.record(stream)
    end.synchronize()
    return end.elapsed_seconds_since(start)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tidal.device_demo", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "sim"))
    p.add_argument("--chunk-size", default="64MiB", help="bytes per chunk (default 64MiB)")
    p.add_argument("--capacity", default=None,
                   help="device memory to use: the simulated device's size (default 1GiB) or a "
                        "budget on the GPU (default 4GiB)")
    p.add_argument("--bandwidth", default="12GB/s",
                   help="simulated device only: link bandwidth each way (default 12GB/s, PCIe 3 x16)")
    p.add_argument("--slots", type=int, default=4, help="device chunks the host chunks stream through")
    p.add_argument("--host-chunks", type=int, default=None,
                   help="host chunks to move (default: two more than fit on the device)")
    p.add_argument("--quick", action="store_true", help="16MiB chunks, 256MiB capacity: a few seconds")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.chunk_size, args.capacity = "16MiB", args.capacity or "256MiB"
    chunk = tidal.parse_bytes(args.chunk_size)
    if chunk <= 0:
        raise SystemExit(f"--chunk-size must be positive, got {args.chunk_size!r}")
    if args.slots < 1:
        raise SystemExit(f"--slots must be >= 1, got {args.slots}")

    probe = tidal.device_info(args.device)
    on_sim = probe["backend"] == "sim"
    capacity = args.capacity or ("1GiB" if on_sim else "4GiB")
    device = tidal.set_device(args.device, capacity=capacity,
                              bandwidth=args.bandwidth if on_sim else None)
    info = tidal.device_info(device)
    print(f"tidal {tidal.__version__} device demo")
    print(f"  device      : {info['backend']} ({info['name']}), capacity {_fmt(info['capacity'])}"
          f" of {_fmt(info['total_memory'])}")
    if on_sim:
        bw = info["sim_copy_bandwidth"]
        print(f"  simulated   : link {bw / 1e9:.1f} GB/s each way" if bw else "  simulated   : unlimited link")
        print(f"  why no GPU  : {info['cuda_unavailable_reason']}")
    print(f"  pinned host : {info['pinned_memory']}; CPU SIMD target {info['cpu_simd_target']}")
    print(f"  chunk size  : {_fmt(chunk)}")

    # 1. Fill the device to capacity.
    held = []
    try:
        while True:
            held.append(device.allocate(chunk))
    except tidal.OutOfMemoryError as e:
        oom = str(e)
    fits = len(held)
    print(f"\n[capacity] {fits} chunks fit; allocating one more raised tidal.OutOfMemoryError:\n  {oom}")
    if fits == 0:
        print("no chunk fits on the device: lower --chunk-size or raise --capacity", file=sys.stderr)
        return 1

    # 2. Stream more host chunks than fit through a few device slots.
    slots = held[: min(args.slots, fits)]
    del held
    n = args.host_chunks if args.host_chunks is not None else fits + 2
    host = [tidal.HostBuffer(chunk, pin_with=device) for _ in range(n)]
    for i in range(n):
        _fill(host[i], i)
    back = [tidal.HostBuffer(chunk, pin_with=device) for _ in slots]
    up = device.create_stream("upload")
    down = device.create_stream("download")
    moved = n * chunk
    print(f"\n[traffic] {n} host chunks ({_fmt(moved)}, {n / max(fits, 1):.2f}x the device's capacity) "
          f"through {len(slots)} device slots; host buffers pinned: {host[0].pinned}")

    def uploads() -> None:
        for i in range(n):
            device.copy_h2d(slots[i % len(slots)], host[i], up)

    def downloads() -> None:
        for i in range(n):
            device.copy_d2h(back[i % len(slots)], slots[i % len(slots)], down)

    _timed(device, up, uploads)  # warm-up: first touch of every page
    _timed(device, down, downloads)
    h2d_s = _timed(device, up, uploads)
    d2h_s = _timed(device, down, downloads)
    print(f"  host->device: {moved / h2d_s / 1e9:7.2f} GB/s  ({h2d_s * 1e3:.1f} ms)")
    print(f"  device->host: {moved / d2h_s / 1e9:7.2f} GB/s  ({d2h_s * 1e3:.1f} ms)")

    # Pipelined round trip: upload chunk i while chunk i-1 comes back; events
    # order each slot's download after its upload and its next upload after
    # its download. Every byte is compared when it is back.
    uploaded = [device.create_event() for _ in slots]
    downloaded = [device.create_event() for _ in slots]
    pending = [None] * len(slots)  # host chunk whose copy is in back[slot]
    bad = []

    def check(slot: int) -> None:
        if pending[slot] is not None:
            downloaded[slot].synchronize()
            if not np.array_equal(np.frombuffer(back[slot], np.uint8), np.frombuffer(host[pending[slot]], np.uint8)):
                bad.append(pending[slot])
            pending[slot] = None

    def round_trip() -> None:
        for i in range(n):
            s = i % len(slots)
            check(s)  # back[s] is free again, and so is slots[s]
            up.wait(downloaded[s])
            device.copy_h2d(slots[s], host[i], up)
            uploaded[s].record(up)
            down.wait(uploaded[s])
            device.copy_d2h(back[s], slots[s], down)
            downloaded[s].record(down)
            pending[s] = i

    rt_s = _timed(device, down, round_trip)
    for s in range(len(slots)):
        check(s)
    print(f"  round trip  : {2 * moved / rt_s / 1e9:7.2f} GB/s both ways together ({rt_s * 1e3:.1f} ms); "
          f"{n - len(bad)}/{n} chunks byte-exact (time includes checking them on the host)")

    # 3. Release everything; the counters return to their baseline.
    del slots, host, back, uploaded, downloaded, up, down
    st = tidal.stats()
    print(f"\n[released] device in use {st['device']['in_use']} B (peak {_fmt(st['device']['peak_in_use'])}, "
          f"{st['device']['failed_allocations']} failed allocation); host buffers {st['host']['allocated']} B "
          f"(peak {_fmt(st['host']['peak_allocated'])})")
    if bad:
        print(f"ERROR: chunks {bad} came back different", file=sys.stderr)
        return 1
    if st["device"]["in_use"] != 0 or st["host"]["allocated"] != 0:
        print("ERROR: memory still held after release", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
