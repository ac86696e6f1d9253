#!/usr/bin/env python3
"""Runs the chunk-scheduler benchmark program and writes its result file.

The measurement is done by the C++ program tidal_bench_chunk_bookkeeping
(benchmarks/chunk_bookkeeping.cpp): bookkeeping ns per access()+release()
with 10k tensors in 200 chunks (against a floor loop in the same run), chunk
move bandwidth (against plain copies in the same run) and a repeated trace
with prefetch on vs off. This script adds what docs/benchmarks.md asks of
a result: the command, git commit, date, the machine, and writes
benchmarks/results/chunk_bookkeeping-<machine>.json.

Usage:
  python benchmarks/chunk_bookkeeping.py [--quick] [--device sim|cuda|auto]
      [--binary PATH] [--output PATH] [-- extra program arguments]

--quick runs in seconds (used by tests to prove it runs) and writes no file
unless --output is given. Build the program in a Release build first, e.g.
  cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build build/release --target tidal_bench_chunk_bookkeeping
On the simulated device the move and prefetch figures check the scheduling
logic at a configured link speed; only --device cuda measures a GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, write_result  # noqa: E402

__all__ = ["main", "find_binary"]

PROGRAM = "tidal_bench_chunk_bookkeeping"
# Build folders searched for the program, fastest build first.
BUILD_DIRS = ["build/release", "build/chunk-release", "build/cpp", "build/chunk"]


def find_binary(explicit: str | None) -> Path:
    """Returns the benchmark program: `explicit`, or the first one built.

    Args:
      explicit: a path given on the command line, or None.
    """
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SystemExit(f"--binary {explicit}: no such file")
        return path
    for folder in BUILD_DIRS:
        path = ROOT / folder / "benchmarks" / PROGRAM
        if path.is_file():
            return path
    raise SystemExit(
        f"{PROGRAM} not found under {', '.join(BUILD_DIRS)}; build it first "
        "(cmake --build <build dir> --target tidal_bench_chunk_bookkeeping) or pass --binary")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seconds-long run; writes no file by default")
    parser.add_argument("--device", default="sim", choices=["sim", "cuda", "auto"])
    parser.add_argument("--binary", help=f"path of {PROGRAM}")
    parser.add_argument("--output", help="result file (default benchmarks/results/chunk_bookkeeping-<machine>.json)")
    parser.add_argument("--allow-debug-build", action="store_true",
                        help="accept a program built without NDEBUG or with TIDAL_DEBUG_FULL")
    parser.add_argument("extra", nargs="*", help="more arguments for the program (after --)")
    args = parser.parse_args(argv)

    binary = find_binary(args.binary)
    cmd = [str(binary), "--device", args.device] + (["--quick"] if args.quick else []) + args.extra
    print("running:", shlex.join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return proc.returncode
    result = json.loads(proc.stdout)
    build = result.get("build", {})
    if (build.get("tidal_debug_full") or not build.get("ndebug")) and not args.allow_debug_build:
        raise SystemExit(f"{binary} is a debug build ({build}); its times are not the library's. "
                         "Use a Release build or pass --allow-debug-build")

    payload = {
        "program_command": shlex.join(cmd),
        "quick": args.quick,
        "simulated": bool(result.get("simulated")),
        "note": ("simulated device: the bookkeeping figure is the scheduler's own CPU cost; the "
                 "moves and prefetch figures check scheduling logic at a simulated link speed and "
                 "are not GPU claims") if result.get("simulated") else "measured on a GPU",
        "result": result,
    }
    book = result.get("bookkeeping")
    if book:
        print(f"bookkeeping: {book['resident_trace_opt_prefetch']['median']:.1f} ns per access+release "
              f"(trace followed; min {book['resident_trace_opt_prefetch']['min']:.1f}, max "
              f"{book['resident_trace_opt_prefetch']['max']:.1f}), "
              f"{book['resident_no_trace_lru']['median']:.1f} ns without trace, "
              f"floor {book['peer_floor']['median']:.2f} ns", file=sys.stderr)
    moves = result.get("moves")
    if moves:
        print(f"moves: h2d {moves['ratio_h2d']:.3f}x, d2h {moves['ratio_d2h']:.3f}x of '{moves['peer']}'",
              file=sys.stderr)
    if result.get("prefetch"):
        print(f"prefetch: on/off speedup {result['prefetch']['speedup_on_over_off']:.3f}", file=sys.stderr)

    if args.quick and args.output is None:
        print(json.dumps(payload, indent=2))  # a smoke run writes no result file
    else:
        path = write_result("chunk_bookkeeping", payload, output=args.output)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
