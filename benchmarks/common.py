"""What every tidal benchmark records next to its numbers (see docs/benchmarks.md).

Result files are ``benchmarks/results/<name>-<machine>.json`` and hold the
command, git commit, date, a machine description, every raw sample, and the
medians with their min-max spread.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
from typing import Dict, Iterable, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

__all__ = ["ROOT", "RESULTS", "git_commit", "machine_info", "machine_tag", "summarize", "write_result",
           "add_gpt_model_args", "token_batches"]


def git_commit() -> str:
    """HEAD's hash, with "-dirty" when the work tree differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> Optional[int]:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gpus() -> list:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, mem_mib, driver = (part.strip() for part in line.split(","))
        gpus.append({"name": name, "memory_bytes": int(float(mem_mib)) * 2**20, "driver": driver})
    return gpus


def machine_info() -> Dict:
    info = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "gpus": _gpus(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    except ImportError:
        info["torch"] = None
    if os.environ.get("TIDAL_TEST_FP32_GEMM") == "1":
        # The testing switch (python/tidal/_testing.py) was on: bf16 / fp16 CPU matrix
        # products ran as fp32 GEMM rounded once, not through torch's own kernel. Every
        # peer of the run computed the same way; the tables say so (table_rows.machine_of).
        info["low_precision_gemm"] = "fp32 GEMM, rounded once (TIDAL_TEST_FP32_GEMM=1)"
    return info


def machine_tag(info: Optional[Dict] = None) -> str:
    """Short name of the machine for file names: "nvidia-h100-80gb-hbm3" or "cpu-2c"."""
    info = info or machine_info()
    if info["gpus"]:
        return re.sub(r"[^a-z0-9]+", "-", info["gpus"][0]["name"].lower()).strip("-")
    return f"cpu-{info['cpu_cores']}c"


def summarize(samples: Iterable[float]) -> Dict[str, float]:
    values = list(samples)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def write_result(name: str, payload: Dict, output: Optional[os.PathLike] = None,
                 info: Optional[Dict] = None) -> pathlib.Path:
    """Writes the result JSON with the standard header; returns its path."""
    info = info or machine_info()
    record = {
        "benchmark": name,
        "command": " ".join([pathlib.Path(sys.executable).name] + sys.argv),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        **payload,
    }
    path = pathlib.Path(output) if output else RESULTS / f"{name}-{machine_tag(info)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path


def add_gpt_model_args(ap) -> None:
    """The TinyGPT shape, --quick and --output options of the engine benchmarks
    (engine_sim.py, engine_accumulation.py): a 3.7M-parameter GPT by default."""
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (not tabled)")
    ap.add_argument("--output", default=None)


def add_compute_threads_arg(ap) -> None:
    """--compute-threads N (engine_offload.py, step_overlap_clip.py): torch on
    N threads (the simulated device's compute), CPU Adam on the other cores,
    as a GPU's compute and its host's cores are apart; 0: both on every core."""
    ap.add_argument("--compute-threads", type=int, default=0,
                    help="torch's threads (the simulated device's compute), the other cores CPU Adam's "
                         "(0: both use every core)")


def split_cores(compute_threads: int) -> int:
    """Applies --compute-threads: torch's threads set, and CPU Adam's count
    (tidal.cpu_adam_threads) returned; 0 (tidal's default) where not split."""
    if not compute_threads:
        return 0
    import torch

    cores = os.cpu_count() or 1
    if not 0 < compute_threads < cores:
        raise SystemExit(f"--compute-threads {compute_threads}: expected 1 to {cores - 1} on this "
                         f"machine's {cores} cores (the others run CPU Adam)")
    torch.set_num_threads(compute_threads)
    return cores - compute_threads


def token_batches(vocab: int, seq: int, batch: int, n: int, seed: int = 0) -> list:
    """`n` (input, target) pairs of random token ids, the same for a seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),
             torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(n)]


def timed_engine_steps(engine, batches) -> tuple:
    """One training step of `engine` per batch: (seconds per step, losses)."""
    import time

    times, losses = [], []
    for x, y in batches:
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return times, losses


def budget_kept(report: Dict) -> bool:
    """The budget is a promise: an engine's memory_report() with no overrun
    and a device peak within the budget less the margin."""
    return (report["budget_overruns"] == 0
            and report["peak_device_bytes"] <= report["device_budget"] - report["device_margin"])


def reserved_budget_kept(report: Dict) -> bool:
    """The budget's promise where the allocator's reserved bytes are metered
    (Note [Who owns a device byte]): no overrun, and the reserved peak within
    the whole budget where the report has one, else the peak in use within
    the budget less the margin (budget_kept)."""
    if report["budget_overruns"] != 0:
        return False
    reserved = report.get("peak_reserved_device_bytes") or 0
    if reserved > 0:
        return reserved <= report["device_budget"]
    return budget_kept(report)


def check_budget(report: Dict, label: str) -> None:
    """Fails the benchmark (a run with an overrun is a failure) unless budget_kept(report)."""
    if not budget_kept(report):
        raise SystemExit(f"{label}: the device budget was overrun: {report['budget_overruns']} overruns, "
                         f"peak {report['peak_device_bytes']} of {report['device_budget']} bytes "
                         f"(margin {report['device_margin']})")


def run_child(script: str, payload, failed: Dict, timeout: float = 900) -> Dict:
    """Runs `script --child JSON(payload)` in a fresh Python process and
    returns the last JSON object it printed; on a crash or no output,
    `failed` with fits False and the process's error tail as "why"."""
    cmd = [sys.executable, script, "--child", json.dumps(payload)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {**failed, "fits": False, "why": f"process failed ({p.returncode}): {p.stderr[-400:]}"}
    return json.loads(lines[-1])

