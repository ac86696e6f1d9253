"""Pinned host<->device bandwidth for chunk-sized copies: tidal vs a plain copy loop.

Runs the C++ program tidal_bench_device_bandwidth (built in build/cpp by
scripts/test.sh, or by scripts/gpu_run.sh on a GPU machine), which times, in
one run on one machine:
  * tidal: Device::copy_async of 64 MiB buffers on a tidal stream, timed with
    tidal events;
  * the peer: on CUDA a plain cudaMemcpyAsync loop on cudaMallocHost memory
    (the limit chunk traffic can reach); on the simulated device a plain
    memcpy loop (what the simulation itself costs).
Writes benchmarks/results/device_bandwidth-<machine>.json. A result from the
simulated device says so ("simulated": true): it checks the machinery, it is
no GPU performance claim.

  python benchmarks/device_bandwidth.py [--quick] [--device auto|cuda|sim]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import ROOT, summarize, write_result  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 MiB copies, 3 samples: seconds")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "sim"))
    p.add_argument("--bytes", default="64MiB")
    p.add_argument("--binary", default=None, help="path of tidal_bench_device_bandwidth")
    p.add_argument("--output", default=None, help="result file (default benchmarks/results/...)")
    args = p.parse_args()

    build = pathlib.Path(os.environ.get("TIDAL_CPP_BUILD", ROOT / "build" / "cpp"))
    binary = pathlib.Path(args.binary) if args.binary else build / "benchmarks" / "tidal_bench_device_bandwidth"
    if not binary.exists():
        sys.exit(f"{binary} not found: build it first (bash scripts/test.sh, or cmake --build build/cpp)")
    cmd = [str(binary), "--device", args.device]
    cmd += ["--quick"] if args.quick else ["--bytes", args.bytes]
    raw = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    directions = {}
    for name, d in raw["directions"].items():
        ours, peer = summarize(d["tidal_bytes_per_s"]), summarize(d["peer_bytes_per_s"])
        directions[name] = {
            **d,
            "samples": ours["n"],
            "tidal_gb_per_s": {k: v / 1e9 for k, v in ours.items() if k != "n"},
            "peer_gb_per_s": {k: v / 1e9 for k, v in peer.items() if k != "n"},
            "median_ratio_tidal_to_peer": ours["median"] / peer["median"],
        }
    raw["directions"] = directions
    simulated = raw["backend"] == "sim"
    path = write_result(
        "device_bandwidth" + ("-quick" if args.quick else ""),
        {
            "simulated": simulated,
            "note": ("simulated device: copies are host memcpy on a worker thread, throttled to the "
                     "configured link bandwidth if any; the peer is a plain memcpy loop. Not a GPU figure.")
            if simulated else "CUDA: pinned memory both sides; the peer is a plain cudaMemcpyAsync loop.",
            "limit": "the peer's bandwidth (pinned cudaMemcpyAsync on CUDA)",
            "results": raw,
        },
        output=args.output,
    )
    for name, d in directions.items():
        print(f"{name}: tidal {d['tidal_gb_per_s']['median']:.2f} GB/s, peer {d['peer_gb_per_s']['median']:.2f} GB/s, "
              f"ratio {d['median_ratio_tidal_to_peer']:.3f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
