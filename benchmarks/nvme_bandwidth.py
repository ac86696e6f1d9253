"""Disk rates of DirectFile (the file under chunks on NVMe) against dd with
O_DIRECT on the same folder, in the same run (issue 44's measure).

Runs, alternating, over `--rounds` rounds on one machine:
  * tidal, each backend: tidal_bench_direct_io (built in build/cpp): every slot of a
    DirectFile written, then read back three slots ahead and checked, with
    `--threads` requests of 1 MiB in flight (Note [Chunks on NVMe: the file]);
  * the peer: dd if=/dev/zero of=DIR/... bs=1M oflag=direct conv=fsync, then
    dd of=/dev/null bs=1M iflag=direct, over the same bytes.
Writes benchmarks/results/nvme_bandwidth-<machine>.json with both rates and
tidal's over dd's (the issue's goal: >= 0.85 for reads, >= 0.8 for writes).
Both backends (a thread pool of pread/pwrite, and io_uring where tidal was built
with liburing) are measured, with the CPU time each costs per GB. This is the
I/O layer alone; benchmarks/nvme_train.py measures the engine on it.

  python benchmarks/nvme_bandwidth.py [--dir /path/on/disk] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import ROOT, summarize, write_result  # noqa: E402


def dd_rates(folder: pathlib.Path, total_mib: int) -> tuple:
    """Seconds to write then read `total_mib` MiB with dd and O_DIRECT."""
    path = folder / "dd-peer.bin"
    try:
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={total_mib}", "oflag=direct",
                        "conv=fsync"], check=True, capture_output=True)
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"], check=True,
                       capture_output=True)
        read = time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)
    return write, read


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temporary one)")
    p.add_argument("--slot-mib", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="8 slots of 8 MiB, 2 rounds")
    p.add_argument("--backend", choices=["both", "threads"], default="both",
                   help="both: the threads and io_uring (where built and allowed); threads: those alone")
    p.add_argument("--binary", default=None)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if args.quick:
        args.slot_mib, args.slots, args.rounds = 8, 8, 2
    build = pathlib.Path(os.environ.get("TIDAL_CPP_BUILD", ROOT / "build" / "cpp"))
    binary = pathlib.Path(args.binary) if args.binary else build / "benchmarks" / "tidal_bench_direct_io"
    if not binary.exists():
        sys.exit(f"{binary} not found: build it first (bash scripts/test.sh, or cmake --build build/cpp)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = pathlib.Path(tmp)
        backends = ["threads"]
        if args.backend == "both":
            probe = subprocess.run([str(binary), str(folder), "--slot-mib", "1", "--slots", "1", "--rounds", "1",
                                    "--backend", "io_uring"], capture_output=True, text=True)
            if probe.returncode == 0:
                backends.append("io_uring")
            else:
                print(f"io_uring not measured: {probe.stderr.strip()}", file=sys.stderr)
        total_mib = args.slot_mib * args.slots
        ours = {b: {"write": [], "read": [], "write_cpu": [], "read_cpu": []} for b in backends}
        peer_w, peer_r = [], []
        raw = None
        for _ in range(args.rounds):
            for b in backends:
                out = subprocess.run([str(binary), str(folder), "--slot-mib", str(args.slot_mib), "--slots",
                                      str(args.slots), "--threads", str(args.threads), "--rounds", "1",
                                      "--backend", b], capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"tidal_bench_direct_io --backend {b} failed: {out.stderr.strip()}")
                raw = json.loads(out.stdout)
                if raw["backend"] != b:
                    sys.exit(f"asked for the {b} backend, got {raw['backend']}")
                gb = raw["bytes"] / 1e9
                ours[b]["write"].append(raw["bytes"] / raw["write_seconds"][0])
                ours[b]["read"].append(raw["bytes"] / raw["read_seconds"][0])
                ours[b]["write_cpu"].append(raw["write_cpu_seconds"][0] / gb)
                ours[b]["read_cpu"].append(raw["read_cpu_seconds"][0] / gb)
            w, r = dd_rates(folder, total_mib)
            peer_w.append(total_mib * 2**20 / w)
            peer_r.append(total_mib * 2**20 / r)
    gbps = lambda xs: {k: (v / 1e9 if k != "n" else v) for k, v in summarize(xs).items()}  # noqa: E731
    result = {
        "folder": str(pathlib.Path(args.dir).resolve()) if args.dir else tempfile.gettempdir(),
        "direct": raw["direct"], "slot_bytes": raw["slot_bytes"], "slots": raw["slots"],
        "threads": args.threads, "request_bytes": raw["request_bytes"], "rounds": args.rounds,
        "backends": backends,
        "order": "alternating: tidal's backends then dd, each round, each backend in a fresh process",
        "dd_write_gb_per_s": gbps(peer_w), "dd_read_gb_per_s": gbps(peer_r),
        "goal": "read >= 0.85, write >= 0.8 of dd with O_DIRECT (issue 44)",
        "note": "the I/O layer alone (runtime/memory/direct_file.h); dd writes with conv=fsync, "
                "tidal's writes are O_DIRECT without a final fsync; tidal reads three slots "
                "ahead and checks one stamp byte per 4 KiB page as each lands (counted in the read "
                "CPU time); CPU seconds are the process's user + system time per GB moved; "
                "`threads` is both the thread count and the io_uring ring's depth",
    }
    for b in backends:
        result[f"{b}_write_gb_per_s"] = gbps(ours[b]["write"])
        result[f"{b}_read_gb_per_s"] = gbps(ours[b]["read"])
        result[f"{b}_write_cpu_s_per_gb"] = summarize(ours[b]["write_cpu"])
        result[f"{b}_read_cpu_s_per_gb"] = summarize(ours[b]["read_cpu"])
        result[f"{b}_write_ratio_to_dd"] = summarize(ours[b]["write"])["median"] / summarize(peer_w)["median"]
        result[f"{b}_read_ratio_to_dd"] = summarize(ours[b]["read"])["median"] / summarize(peer_r)["median"]
    path = write_result("nvme_bandwidth", result, args.output)
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k or "cpu" in k}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
