#!/usr/bin/env python3
"""Runs the chunk-scheduler benchmark program and writes its result file.

The measurement is done by the C++ program tidal_bench_chunk_bookkeeping
(benchmarks/chunk_bookkeeping.cpp): bookkeeping ns per access()+release()
with 10k tensors in 200 chunks (against a floor loop in the same run), chunk
move bandwidth (against plain copies in the same run) and a repeated trace
with prefetch on vs off. This script adds what ../shared/BENCHMARKS.md asks of
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
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["main", "machine_info", "find_binary"]

ROOT = Path(__file__).resolve().parent.parent
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


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    """CPU, cores, memory, GPU (name, memory, driver) and torch version."""
    cpuinfo = _read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    meminfo = _read("/proc/meminfo")
    mem_kb = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.M)
    info = {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "logical_cores": os.cpu_count(),
        "memory_bytes": int(mem_kb.group(1)) * 1024 if mem_kb else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "gpu": None,
        "torch": None,
    }
    if shutil.which("nvidia-smi"):
        out = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                    "--format=csv,noheader"])
        if out:
            name, memory, driver = [x.strip() for x in out.splitlines()[0].split(",")]
            info["gpu"] = {"name": name, "memory": memory, "driver": driver}
    try:
        import torch  # noqa: PLC0415 - optional, only for the record

        info["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - torch is optional here
        pass
    return info


def git_info() -> dict:
    commit = _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    dirty = bool(_run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]))
    return {"commit": commit or None, "dirty": dirty}


def machine_slug(info: dict, result: dict) -> str:
    if not result.get("simulated", True) and info.get("gpu"):
        name = info["gpu"]["name"]
    else:
        name = "sim-" + (info.get("cpu_model") or "cpu")
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:60]


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

    info = machine_info()
    record = {
        "benchmark": "chunk_bookkeeping",
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "program_command": shlex.join(cmd),
        "git": git_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "quick": args.quick,
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

    output = args.output
    if output is None and not args.quick:
        output = ROOT / "benchmarks" / "results" / f"chunk_bookkeeping-{machine_slug(info, result)}.json"
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {output}", file=sys.stderr)
    else:
        print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
