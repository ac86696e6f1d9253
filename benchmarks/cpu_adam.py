"""CPU Adam throughput against the memory-bandwidth limit and against peers.

  python benchmarks/cpu_adam.py --quick          # seconds; proves it runs (tests call it)
  python benchmarks/cpu_adam.py                  # full: 2^26 and 2^28 params
  python benchmarks/cpu_adam.py --deepspeed-python /tmp/dsvenv/bin/python   # + DeepSpeed

What one run measures, on the same machine:

* ``cxx``: benchmarks/cpu_adam_bench.cpp (``tidal_bench_cpu_adam``), one
  process, per thread count 1..N, every repeat running back to back
    - the limits: a triad ``a = b + s*c`` and an axpy ``a = a + s*b`` (fp32,
      12 bytes/element each), and ``streams``, Adam's own access pattern with
      trivial arithmetic (reads fp16 g and fp32 p, m, v; writes p, m, v and an
      fp16 copy: 28 bytes/param);
    - tidal, the chunk engine's case (fp32 master/m/v, fp16 grads, fp16 copy):
      ``update`` (28 bytes/param: reads grad 2 + param 4 + m 4 + v 4, writes
      param 4 + m 4 + v 4 + copy 2), ``stats`` (the inf/nan + sum-of-squares
      pass, 2 bytes/param) and ``step`` (both, as a loss-scaled clipped step
      runs them, 30 bytes/param); ``update_cached`` (the update with the
      write-only copy stored through the cache instead of streamed, see Note
      [Streaming the param copy] in cpu_adam/adam.h) and ``step_known`` (a
      step whose gradient stats are already known: one pass, 28 bytes/param).
  Bytes are counted like STREAM (no write-allocate read of write-only data).
  ``fraction_of_triad`` etc. are medians of per-repeat ratios of tidal's
  effective GB/s to the limit's, so both sides of each ratio saw the same
  moment of a shared machine.
* the fold of gradient accumulation (16 bytes/param: a micro-batch's fp16
  gradients added into fp32 sums, the fp16 slot rewritten from the fp32
  master), tidal's kernel against the same two passes as torch operators,
  timed in turn with the update; ``over_update_rate`` is the estimate's
  fold rate over its CPU Adam rate (tidal.estimate's fold_params_per_s).
  ``tidal_fold_image``: the same fold without the rewrite (10 bytes/param),
  the engine's where its chunk takes back the block of its weights (Note
  [The weights' image instead of the restore] in hooks/gradient_sums.h);
  ``over_fold_rate`` its rate over the fold's, paired.
  ``tidal_fold_image_measured``: that fold measuring the sums it writes
  (the window's last fold, whose measure the clip needs: Note [Measured in
  the fold] in tidal/engine/overlap.py), against ``tidal_fold_image_then_measure``,
  the fold and then grad_stats over the sums (14 bytes/param), as the
  engine did before; ``over_separate_rate`` is the one pass's rate over the
  two passes', paired.
* peers, timed in turn with tidal's update (through tidal._C) within each
  repeat: torch.optim.AdamW(foreach=True) and (fused=True), which take fp32
  gradients and write no 16-bit copy (so they move 28 bytes/param as well:
  grads are 4 bytes), and DeepSpeed's DeepSpeedCPUAdam (fp32 grads; with its
  fp16 param copy where its step() still offers one) in its own interpreter
  (``--deepspeed-python``), with tidal imported there too when it can be.
  ``ratio_vs_*`` = median over repeats of peer time / tidal update time.
  Within a repeat each contender runs after a 50 ms pause, in alternating
  order from repeat to repeat (_timed_in_turn).

The result goes to benchmarks/results/cpu_adam-<machine>.json (see
benchmarks/common.py for the header every result carries).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

BYTES_UPDATE = 28  # grad 2 + param 4 + m 4 + v 4 read; param 4 + m 4 + v 4 + copy 2 written
BYTES_STATS = 2    # grad read
BYTES_STEP = BYTES_UPDATE + BYTES_STATS
BYTES_TRIAD = 12   # b 4 + c 4 read, a 4 written (fp32)
BYTES_TORCH_ADAMW = 28  # grad 4 + param 4 + m 4 + v 4 read; param 4 + m 4 + v 4 written
BYTES_FOLD = 16  # grad 2 + sum 4 + master 4 read; sum 4 + 16-bit weight 2 written
BYTES_FOLD_IMAGE = 10  # grad 2 + sum 4 read; sum 4 written (the weights' block taken back)
BYTES_STATS_F32 = 4  # the fp32 sums read again (grad_stats after the fold)
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _timed(fn: Callable[[], object], repeats: int, warmup: int) -> List[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


PAUSE_S = 0.05  # before each timed call: the last contender's threads stop spinning


def _timed_in_turn(fns: Dict[str, Callable[[], object]], samples: Dict[str, List[float]], warmup: int,
                   repeats: int) -> None:
    """Each of `fns` once per repeat, after a pause, in the order of `fns` on
    even repeats and the reverse on odd ones (so no contender always runs
    right after the same other); the times after `warmup` into `samples`."""
    names = list(fns)
    for r in range(warmup + repeats):
        for name in names if r % 2 == 0 else reversed(names):
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            fns[name]()
            if r >= warmup:
                samples[name].append(time.perf_counter() - t0)


def _stats(samples: List[float], params: int, bytes_per_param: float) -> Dict:
    median = statistics.median(samples)
    return {
        "samples_s": samples,
        "median_s": median,
        "min_s": min(samples),
        "max_s": max(samples),
        "params_per_s": params / median,
        "bytes_per_param": bytes_per_param,
        "median_GBps": params * bytes_per_param / median / 1e9,
        "min_max_GBps": [params * bytes_per_param / max(samples) / 1e9,
                         params * bytes_per_param / min(samples) / 1e9],
    }


def _available_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _free_memory() -> None:
    gc.collect()


# --- the limit and tidal's kernels, interleaved in C++ ------------------------------


def find_bench_exe(explicit: Optional[str]) -> Optional[Path]:
    if explicit:
        return Path(explicit)
    cpp_build = os.environ.get("TIDAL_CPP_BUILD")  # set by scripts/test.sh
    if cpp_build and (Path(cpp_build) / "benchmarks" / "tidal_bench_cpu_adam").exists():
        return Path(cpp_build) / "benchmarks" / "tidal_bench_cpu_adam"
    root = Path(__file__).resolve().parents[1]
    found = sorted(root.glob("build/*/benchmarks/tidal_bench_cpu_adam"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def bench_cxx(exe: Optional[Path], n: int, repeats: int, thread_counts: List[int]) -> Dict:
    """Runs benchmarks/cpu_adam_bench.cpp: triad, axpy, streams and tidal's
    passes interleaved repeat by repeat, per thread count."""
    if exe is None or not exe.exists():
        return {"skipped": "tidal_bench_cpu_adam not built (cmake --build <dir> --target "
                           "tidal_bench_cpu_adam), or pass --bench-exe"}
    need = n * (12 + 16) * 1.05
    avail = _available_bytes()
    if avail is not None and need > avail:
        return {"skipped": f"needs about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"}
    cmd = [str(exe), "--params", str(n), "--repeats", str(repeats), "--threads",
           ",".join(str(t) for t in thread_counts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"skipped": f"{exe.name} exited {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    raw = json.loads(proc.stdout)
    bpp = raw["bytes_per_param"]
    rows = []
    for r in raw["results"]:
        row = {"threads": r["threads"]}
        for key in ("triad", "axpy", "streams", "update", "stats", "step", "update_cached",
                    "step_known"):
            row[key] = _stats(r[key + "_s"], n, bpp[key])
        # Paired per repeat (same moment, same machine state), then the median.
        for limit in ("triad", "axpy", "streams"):
            ratios = [(bpp["update"] / tu) / (bpp[limit] / tl)
                      for tu, tl in zip(r["update_s"], r[limit + "_s"])]
            row["fraction_of_" + limit] = statistics.median(ratios)
        row["step_over_update"] = statistics.median(
            [ts / tu for ts, tu in zip(r["step_s"], r["update_s"])])
        # > 1: streaming the write-only copy is faster (Note [Streaming the param copy]).
        row["cached_copy_over_update"] = statistics.median(
            [tc / tu for tc, tu in zip(r["update_cached_s"], r["update_s"])])
        row["step_known_over_update"] = statistics.median(
            [tk / tu for tk, tu in zip(r["step_known_s"], r["update_s"])])
        rows.append(row)
    return {"command": " ".join(cmd), "kernel_target": raw["kernel_target"],
            "huge_pages": raw["huge_pages"], "sane": raw["sane"], "rows": rows}


# --- peers ---------------------------------------------------------------------------


def bench_python_level(n: int, repeats: int, warmup: int, interleave: bool) -> Dict:
    """tidal's update through tidal._C and torch.optim.AdamW(foreach / fused),
    timed in turn within each repeat so that each ratio compares one moment."""
    import torch

    from tidal import _C

    ca = _C.cpu_adam
    loss_scale = 1024.0
    gen = torch.Generator().manual_seed(0)
    bufs = {"master": torch.randn(n, generator=gen) * 0.01, "m": torch.zeros(n), "v": torch.zeros(n),
            "grad16": (torch.randn(n, generator=gen) * (1e-3 * loss_scale)).half(),
            "copy16": torch.empty(n, dtype=torch.float16)}
    step = [0]

    def tidal_update():
        step[0] += 1
        ca.adam_update(bufs["master"], bufs["m"], bufs["v"], bufs["grad16"], bufs["copy16"],
                       step=step[0], lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                       eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                       grad_scale=1.0 / loss_scale)

    # Gradient accumulation's fold (Note [Gradient sums in chunks] in
    # cpu_adam/adam.h): a micro-batch's 16-bit gradients added into their fp32
    # sums, then the 16-bit slot given its weight back from the master, on
    # buffers of its own. The peer is the same two passes as torch operators.
    fold = {"sums": torch.zeros(n), "half": (torch.randn(n, generator=gen) * 1e-3).half(),
            "master": bufs["master"].clone()}

    def tidal_fold():
        ca.fold_gradients(fold["sums"], fold["half"], fold["master"], [(0, n, False)], num_threads=0)

    def tidal_fold_image():
        ca.fold_gradients(fold["sums"], fold["half"], None, [(0, n, False)], num_threads=0)

    def tidal_fold_image_measured():
        return ca.fold_gradients(fold["sums"], fold["half"], None, [(0, n, False)], num_threads=0,
                                 measure=True)

    def tidal_fold_image_then_measure():
        ca.fold_gradients(fold["sums"], fold["half"], None, [(0, n, False)], num_threads=0)
        return ca.grad_stats(fold["sums"], num_threads=0)

    def torch_fold():
        fold["sums"].add_(fold["half"])
        fold["half"].copy_(fold["master"])

    peers: Dict[str, Dict] = {}
    fns: Dict[str, Callable[[], object]] = {"tidal_update": tidal_update, "tidal_fold": tidal_fold,
                                            "tidal_fold_image": tidal_fold_image,
                                            "tidal_fold_image_measured": tidal_fold_image_measured,
                                            "tidal_fold_image_then_measure": tidal_fold_image_then_measure,
                                            "torch_fold_ops": torch_fold}
    for name, flags in (("torch_adamw_foreach", {"foreach": True}), ("torch_adamw_fused", {"fused": True})):
        need = n * 4 * 4 * 1.6  # param, grad, m, v + foreach temporaries
        avail = _available_bytes()
        if avail is not None and need > avail:
            peers[name] = {"skipped": f"needs about {need / 2**30:.1f} GiB, "
                                      f"{avail / 2**30:.1f} GiB available"}
            continue
        try:
            p = torch.nn.Parameter(torch.randn(n, generator=gen) * 0.01)
            p.grad = torch.randn(n, generator=gen) * 1e-3
            opt = torch.optim.AdamW([p], **HYPER, **flags)
            opt.step()  # creates the state; raises here if unsupported
        except (RuntimeError, ValueError) as e:
            peers[name] = {"skipped": f"{type(e).__name__}: {e}"}
            continue
        peers[name] = {"flags": flags, "_param": p}
        fns[name] = opt.step
        if not interleave:
            break  # one peer at a time when memory is short: measured below
    samples: Dict[str, List[float]] = {k: [] for k in fns}
    _timed_in_turn(fns, samples, warmup, repeats)
    out = {"tidal_update": _stats(samples["tidal_update"], n, BYTES_UPDATE)}
    out["tidal_update"]["copy_matches_master"] = bool(torch.equal(bufs["copy16"], bufs["master"].half()))
    out["tidal_fold"] = _stats(samples["tidal_fold"], n, BYTES_FOLD)
    out["tidal_fold"]["over_update_rate"] = statistics.median(
        [tu / tf for tu, tf in zip(samples["tidal_update"], samples["tidal_fold"])])
    out["tidal_fold_image"] = _stats(samples["tidal_fold_image"], n, BYTES_FOLD_IMAGE)
    out["tidal_fold_image"]["over_fold_rate"] = statistics.median(
        [tf / ti for tf, ti in zip(samples["tidal_fold"], samples["tidal_fold_image"])])
    out["tidal_fold_image_measured"] = _stats(samples["tidal_fold_image_measured"], n, BYTES_FOLD_IMAGE)
    out["tidal_fold_image_measured"]["over_separate_rate"] = statistics.median(
        [ts / tm for ts, tm in zip(samples["tidal_fold_image_then_measure"],
                                   samples["tidal_fold_image_measured"])])
    out["tidal_fold_image_then_measure"] = _stats(samples["tidal_fold_image_then_measure"], n,
                                                  BYTES_FOLD_IMAGE + BYTES_STATS_F32)
    out["torch_fold_ops"] = _stats(samples["torch_fold_ops"], n, BYTES_FOLD)
    out["torch_fold_ops"]["ops"] = "sums.add_(half); half.copy_(master)"
    out["torch_fold_ops"]["ratio_to_tidal_paired"] = statistics.median(
        [tp / tt for tp, tt in zip(samples["torch_fold_ops"], samples["tidal_fold"])])
    del fold
    for name, peer in peers.items():
        if name not in samples:
            out[name] = peer
            continue
        st = _stats(samples[name], n, BYTES_TORCH_ADAMW)
        st["flags"] = peer["flags"]
        st["finite_after"] = bool(torch.isfinite(peer["_param"]).all())
        st["ratio_to_tidal_paired"] = statistics.median(
            [tp / tt for tp, tt in zip(samples[name], samples["tidal_update"])])
        out[name] = st
    return out


def deepspeed_worker(n: int, repeats: int, warmup: int) -> None:
    """Runs inside the DeepSpeed interpreter; prints one JSON line. When this
    checkout's tidal imports there too (same torch build), tidal's update is
    timed in turn with DeepSpeed's step."""
    import inspect

    import torch

    t0 = time.perf_counter()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(n) * 0.01)
    p.grad = torch.randn(n) * 1e-3
    opt = DeepSpeedCPUAdam([p], lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                           weight_decay=HYPER["weight_decay"], adamw_mode=True)
    opt.step()  # JIT-builds the op on first use
    build_s = time.perf_counter() - t0
    signature = str(inspect.signature(opt.step))
    copy = None
    if "fp16_param_groups" in signature:
        copy = torch.empty(n, dtype=torch.float16)
        ds_step = lambda: opt.step(fp16_param_groups=[[copy]])  # noqa: E731
    else:
        ds_step = opt.step
    fns = {"deepspeed": ds_step}
    tidal_error = None
    try:
        from tidal import _C

        master, m, v = torch.randn(n) * 0.01, torch.zeros(n), torch.zeros(n)
        g16, c16 = (torch.randn(n) * 1.024).half(), torch.empty(n, dtype=torch.float16)
        step = [0]

        def tidal_update():
            step[0] += 1
            _C.cpu_adam.adam_update(master, m, v, g16, c16, step=step[0], lr=HYPER["lr"],
                                    weight_decay=HYPER["weight_decay"], grad_scale=1 / 1024)

        fns["tidal_update"] = tidal_update
    except Exception as e:  # noqa: BLE001 -- any import failure: DeepSpeed alone
        tidal_error = f"{type(e).__name__}: {e}"
    samples = {k: [] for k in fns}
    _timed_in_turn(fns, samples, warmup, repeats)
    print(json.dumps({
        "samples_s": samples["deepspeed"],
        "tidal_update_samples_s": samples.get("tidal_update"),
        "tidal_in_same_process": tidal_error is None,
        "tidal_import_error": tidal_error,
        "deepspeed_version": __import__("deepspeed").__version__,
        "torch_version": torch.__version__,
        "step_signature": signature,
        "writes_fp16_copy": copy is not None,
        "omp_threads": torch.get_num_threads(),
        "first_step_incl_build_s": build_s,
        "finite_after": bool(torch.isfinite(p).all()),
    }))


def bench_deepspeed(python: Optional[str], n: int, repeats: int, warmup: int) -> Dict:
    if not python:
        return {"skipped": "no --deepspeed-python given (DeepSpeed lives in its own venv; see the "
                           "module docstring)"}
    need = n * (4 * 4 + 16) * 1.2
    avail = _available_bytes()
    if avail is not None and need > avail:
        return {"skipped": f"needs about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"}
    root = Path(__file__).resolve().parents[1]
    cmd = [python, str(Path(__file__).resolve()), "--deepspeed-worker", str(n), "--repeats",
           str(repeats), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ, PYTHONPATH=str(root / "python")))
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return {"skipped": "DeepSpeedCPUAdam failed: " + " | ".join(tail)}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out = _stats(result.pop("samples_s"), n, BYTES_TORCH_ADAMW + (2 if result["writes_fp16_copy"] else 0))
    tidal_samples = result.pop("tidal_update_samples_s")
    if tidal_samples:
        out["paired_tidal_update"] = _stats(tidal_samples, n, BYTES_UPDATE)
        out["ratio_to_tidal_paired"] = statistics.median(
            [tp / tt for tp, tt in zip(out["samples_s"], tidal_samples)])
    out.update(result)
    return out


def bench_size(n: int, repeats: int, warmup: int, thread_counts: List[int], args) -> Dict:
    out: Dict = {"params": n}
    cxx = bench_cxx(find_bench_exe(args.bench_exe), n, repeats, thread_counts)
    out["cxx"] = cxx
    if "rows" in cxx:
        best = max(cxx["rows"], key=lambda row: row["threads"])
        for key in ("triad", "axpy", "streams"):
            out[key] = best[key]
        out["tidal"] = {"kernel_target": cxx["kernel_target"], "threads": best["threads"],
                        "update": best["update"], "stats_pass": best["stats"], "step": best["step"],
                        "step_over_update": best["step_over_update"],
                        "update_cached_copy": best["update_cached"],
                        "cached_copy_over_update": best["cached_copy_over_update"],
                        "step_known_stats": best["step_known"],
                        "step_known_over_update": best["step_known_over_update"]}
        for key in ("triad", "axpy", "streams"):
            out["fraction_of_" + key] = best["fraction_of_" + key]
        out["thread_scaling"] = [
            {"threads": row["threads"], "tidal_update_GBps": row["update"]["median_GBps"],
             "tidal_update_params_per_s": row["update"]["params_per_s"],
             "triad_GBps": row["triad"]["median_GBps"], "axpy_GBps": row["axpy"]["median_GBps"],
             "streams_GBps": row["streams"]["median_GBps"],
             "fraction_of_triad": row["fraction_of_triad"],
             "fraction_of_streams": row["fraction_of_streams"]}
            for row in cxx["rows"]]
    _free_memory()

    need_all = n * (16 + 16 * 1.6 * 2) * 1.05
    avail = _available_bytes()
    interleave = avail is None or need_all < avail
    py = bench_python_level(n, repeats, warmup, interleave)
    out["tidal_python_update"] = py["tidal_update"]
    out["tidal_fold"] = py["tidal_fold"]
    out["tidal_fold_image"] = py["tidal_fold_image"]
    out["tidal_fold_image_measured"] = py["tidal_fold_image_measured"]
    out["tidal_fold_image_then_measure"] = py["tidal_fold_image_then_measure"]
    out["torch_fold_ops"] = py["torch_fold_ops"]
    if "tidal" not in out:  # no C++ program: the Python-level timing stands in
        out["tidal"] = {"update": py["tidal_update"]}
    for name in ("torch_adamw_foreach", "torch_adamw_fused"):
        out[name] = py.get(name) or {"skipped": "not enough memory to hold it beside tidal's "
                                                "buffers and the other peer"}
    _free_memory()
    out["deepspeed_cpu_adam"] = bench_deepspeed(args.deepspeed_python, n, repeats, warmup)
    for key, peer in (("ratio_vs_foreach", "torch_adamw_foreach"), ("ratio_vs_fused", "torch_adamw_fused"),
                      ("ratio_vs_deepspeed", "deepspeed_cpu_adam")):
        out[key] = out[peer].get("ratio_to_tidal_paired")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2^20 params, few repeats (seconds)")
    p.add_argument("--sizes", default=None, help="comma-separated log2 param counts (default 26,28)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--deepspeed-python", default=None,
                   help="interpreter with deepspeed installed, e.g. /tmp/dsvenv/bin/python")
    p.add_argument("--bench-exe", default=None,
                   help="path of tidal_bench_cpu_adam (default: newest build/*/benchmarks/ one)")
    p.add_argument("--output", default=None, help="result path (default benchmarks/results/...)")
    p.add_argument("--deepspeed-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.deepspeed_worker is not None:
        deepspeed_worker(args.deepspeed_worker, args.repeats or 5, args.warmup or 1)
        return 0

    import torch  # noqa: F401  -- before tidal._C

    from common import machine_info, write_result
    from tidal import _C

    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = [20] if args.quick else [26, 28]
    repeats = args.repeats or (3 if args.quick else 9)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    thread_counts = [1, cores] if args.quick else list(range(1, cores + 1))
    thread_counts = sorted(set(thread_counts))

    info = machine_info()
    load_before = os.getloadavg()
    results = []
    for log2 in sizes:
        n = 1 << log2
        print(f"[cpu_adam] 2^{log2} params ...", file=sys.stderr, flush=True)
        results.append(bench_size(n, repeats if log2 < 28 else max(3, repeats * 2 // 3), warmup,
                                  thread_counts, args))
        r = results[-1]
        u = r["tidal"]["update"]

        def fmt(x):
            return "n/a" if x is None else f"{x:.2f}"

        f = r["tidal_fold"]
        print(f"[cpu_adam]   tidal fold {f['params_per_s'] / 1e9:.2f} Gparam/s {f['median_GBps']:.1f} GB/s; "
              f"torch ops/tidal {r['torch_fold_ops']['ratio_to_tidal_paired']:.2f}; without the rewrite "
              f"{r['tidal_fold_image']['params_per_s'] / 1e9:.2f} Gparam/s "
              f"({r['tidal_fold_image']['over_fold_rate']:.2f}x); measuring in it "
              f"{r['tidal_fold_image_measured']['over_separate_rate']:.2f}x the fold then grad_stats",
              file=sys.stderr, flush=True)
        print(f"[cpu_adam]   tidal update {u['params_per_s'] / 1e9:.2f} Gparam/s {u['median_GBps']:.1f} GB/s;"
              f" fraction of triad {fmt(r.get('fraction_of_triad'))}, of streams "
              f"{fmt(r.get('fraction_of_streams'))}; peer/tidal: foreach {fmt(r['ratio_vs_foreach'])}, "
              f"fused {fmt(r['ratio_vs_fused'])}, DeepSpeed {fmt(r['ratio_vs_deepspeed'])}",
              file=sys.stderr, flush=True)

    payload = {
        "quick": bool(args.quick),
        "kernel_targets": _C.cpu_adam.available_targets(),
        "kernel_target": _C.cpu_adam.target(),
        "cores_used": cores,
        "hyperparameters": {k: list(v) if isinstance(v, tuple) else v for k, v in HYPER.items()},
        "bytes_per_param": {
            "update": BYTES_UPDATE, "stats_pass": BYTES_STATS, "step": BYTES_STEP, "fold": BYTES_FOLD,
            "fold_image": BYTES_FOLD_IMAGE, "fold_image_then_measure": BYTES_FOLD_IMAGE + BYTES_STATS_F32,
            "triad_per_element": BYTES_TRIAD, "torch_adamw": BYTES_TORCH_ADAMW,
            "counting": "bytes the algorithm must read + write, STREAM-style (no write-allocate "
                        "read of write-only outputs)",
        },
        "sizes": results,
        # Other processes share this machine; a load above the core count
        # means the samples competed for cores and memory bandwidth.
        "load_average_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())},
    }
    path = write_result("cpu_adam", payload, output=args.output, info=info)
    print(f"[cpu_adam] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
