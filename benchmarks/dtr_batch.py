"""Largest batch that trains at a fixed memory, with and without DTR.
Writes benchmarks/results/dtr_batch-<machine>.json.

    python benchmarks/dtr_batch.py [--quick]

Two parts, each a search over batch sizes (doubling, then bisection, within
1/8: benchmarks/batch_search.py) for the largest batch whose training steps
succeed:

  * resnet50 (tidal.dtr alone): ResNet-50 (benchmarks/dtr.py's, random init)
    on 32x32 images. The memory is fixed at the no-DTR peak of batch
    --base-batch (DTR's tracked bytes with no eviction: activations,
    temporaries and gradients). Without DTR a batch fits when its no-DTR
    peak is within that memory; with DTR when a step's tracked peak,
    the running op's working set included, stays within that memory (the
    threshold starts at the memory and is lowered by any overshoot, as a GPU
    allocator's failure would force). MegEngine's headline
    for DTR is 3x the batch on ResNet-50.
  * engine_gpt (the training engine on the simulated device): a GPT
    (tidal.models.gpt.TinyGPT) under tidal.initialize with a fixed device
    budget, with and without the config's tidal.dtr block. Without DTR a
    batch fits while its activations leave room for a module's parameter
    chunks (else the engine raises tidal.OutOfMemoryError naming the module);
    with DTR when the peak chunk bytes plus DTR's peak tracked bytes (the
    running op's working set included) stay within the budget.

For each part the result also has the step time at the largest no-DTR batch
with and without DTR, and at DTR's largest batch (CPU times; a proxy for a
GPU, where recomputation is cheaper against memory traffic).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import batch_search  # noqa: E402
import common  # noqa: E402
import tidal  # noqa: E402
from tidal import dtr  # noqa: E402
from tidal.engine import dtr_link  # noqa: E402
from dtr import ResNet50, measure_peak, step_fn  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


def _search(fits, start: int, cap: int, label: str) -> tuple[int, list]:
    """The largest batch in [1, cap] for which fits(batch) holds, within 1/8
    (batch_search.largest from `start`), and its trials."""
    trials: list = []
    best = batch_search.largest(batch_search.logged(fits, trials, label), cap, start=start, within=8)
    return best, trials


# ------------------------------------------------------------------ resnet50
def resnet_part(quick: bool) -> dict:
    layers, base, size = ((1, 1, 1, 1), 8, 32) if quick else ((3, 4, 6, 3), 64, 32)
    base_batch = 4 if quick else 8
    cap = base_batch * (16 if quick else 8)

    def make():
        return ResNet50(layers=layers, base=base, classes=10)

    def data(b):
        g = torch.Generator().manual_seed(0)
        return torch.randn(b, 3, size, size, generator=g), torch.randint(0, 10, (b,), generator=g)

    dtr.evictee_minimum_size = "64KiB" if quick else "1MiB"
    memory = measure_peak(make, data(base_batch))
    print(f"  resnet50: fixed memory {memory} bytes (no-DTR peak at batch {base_batch})", flush=True)

    def fits_plain(b):
        return measure_peak(make, data(b)) <= memory

    def fits_dtr(b):
        # Fits when the tracked peak, the running op's working set included,
        # stays within the memory: DTR's threshold is lowered by what the
        # last try overshot (a GPU allocator would fail the allocation there).
        threshold = memory
        for _ in range(4):
            torch.manual_seed(0)
            step = step_fn(make(), data(b))
            try:
                with dtr.enabled(eviction_threshold=threshold):
                    step()
                    dtr.reset_peak()
                    step()
                    peak = dtr.stats()["peak_tracked_bytes"]
            except tidal.OutOfMemoryError:
                return False
            finally:
                gc.collect()
            peaks[b] = (peak, threshold)
            if peak <= memory:
                return True
            threshold -= peak - memory
            if threshold <= 0:
                return False
        return False

    peaks: dict = {}
    plain_batch, plain_trials = _search(fits_plain, base_batch, cap, "    resnet50 without DTR")
    dtr_batch, dtr_trials = _search(fits_dtr, plain_batch, cap, "    resnet50 with DTR")

    def seconds(b, on):
        torch.manual_seed(0)
        step = step_fn(make(), data(b))
        ctx = dtr.enabled(eviction_threshold=peaks[b][1]) if on else _null()
        with ctx:
            step()
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0

    times = {"plain_at_plain_batch": seconds(plain_batch, False),
             "dtr_at_plain_batch": seconds(plain_batch, True),
             "dtr_at_dtr_batch": seconds(dtr_batch, True)}
    return {"model": f"ResNet layout {layers}, base width {base}, {size}x{size} images, 10 classes",
            "fixed_memory_bytes": memory, "memory_is": f"no-DTR tracked peak at batch {base_batch}",
            "evictee_minimum_size": dtr.evictee_minimum_size, "batch_cap": cap,
            "largest_batch_without_dtr": plain_batch, "largest_batch_with_dtr": dtr_batch,
            "ratio": dtr_batch / plain_batch if plain_batch else None,
            "trials_without_dtr": plain_trials, "trials_with_dtr": dtr_trials, "step_seconds": times,
            "with_dtr_peak_and_threshold": {str(k): {"peak_tracked_bytes": v[0], "threshold": v[1]}
                                            for k, v in sorted(peaks.items())}}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- engine_gpt
def engine_part(quick: bool, link: str) -> dict:
    shape = dict(vocab=512, d=64, layers=2, heads=4, seq=64) if quick else \
        dict(vocab=2048, d=256, layers=4, heads=4, seq=64)
    budget = (4 << 20) if quick else (32 << 20)
    chunk = (64 << 10) if quick else (1 << 20)
    cap = 64 if quick else 128
    # Activations of a model this small are far below MegEngine's default
    # 1 MiB minimum (a GPU-sized default): candidates from 4/64 KiB.
    minimum = "4KiB" if quick else "64KiB"

    def config(with_dtr):
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "tidal": {"device": "sim", "chunk_size": chunk, "device_memory_budget": budget,
                         "hybrid_adam": False}}
        if with_dtr:
            cfg["tidal"]["dtr"] = {"enabled": True, "evictee_minimum_size": minimum}
        return cfg

    def batches(b, n):
        return common.token_batches(shape["vocab"], shape["seq"], b, n)

    def train(b, with_dtr, n=2):
        return batch_search.train_engine(lambda: TinyGPT(**shape), config(with_dtr), batches(b, n),
                                         before_remove=dtr.disable)

    def fits(with_dtr):
        # The peaks of chunks and of DTR's tracked bytes (working sets
        # included), summed although they need not coincide: a batch
        # fits only if they stay within the device budget.
        return batch_search.fits_unless_oom(
            lambda b: train(b, with_dtr)[2],
            lambda report: not with_dtr or
            report["peak_chunk_device_bytes"] + report["dtr"]["peak_tracked_bytes"] <= budget)

    params = sum(p.numel() for p in TinyGPT(**shape).parameters())
    print(f"  engine_gpt: {params} parameters, device budget {budget} bytes", flush=True)
    plain_batch, plain_trials = _search(fits(False), 4, cap, "    engine_gpt without DTR")
    dtr_batch, dtr_trials = _search(fits(True), max(plain_batch, 1), cap, "    engine_gpt with DTR")
    # The same search with DTR's evictions never given to a chunk (chunks give
    # way only through the tracer's plan): the rule before the arbiter.
    dtr_link.ARBITER = False
    try:
        first_batch, first_trials = _search(fits(True), max(plain_batch, 1), cap,
                                            "    engine_gpt with DTR, chunks first")
    finally:
        dtr_link.ARBITER = True
    if plain_batch == 0:
        raise SystemExit(f"engine_gpt: not even batch 1 trains without DTR at {budget} bytes; raise the budget")
    t_plain, l_plain, _ = train(plain_batch, False, 3)
    t_dtr, l_dtr, rep_same = train(plain_batch, True, 3)
    t_big, _, rep_big = train(dtr_batch, True, 3)
    return {"model": f"TinyGPT {shape}, fp32, {params} parameters", "device_budget_bytes": budget,
            "chunk_bytes": chunk, "batch_cap": cap, "evictee_minimum_size": minimum,
            "link": link,
            "largest_batch_without_dtr": plain_batch, "largest_batch_with_dtr": dtr_batch,
            "largest_batch_with_dtr_chunks_first": first_batch, "trials_with_dtr_chunks_first": first_trials,
            "ratio": dtr_batch / plain_batch if plain_batch else None,
            "trials_without_dtr": plain_trials, "trials_with_dtr": dtr_trials,
            "step_seconds": {"without_dtr_at_plain_batch": t_plain[1:], "dtr_at_plain_batch": t_dtr[1:],
                             "dtr_at_dtr_batch": t_big[1:]},
            "losses_at_plain_batch": {"without_dtr": l_plain, "dtr": l_dtr},
            "dtr_report_at_plain_batch": rep_same["dtr"], "dtr_report_at_dtr_batch": rep_big["dtr"],
            "chunk_evictions_at_dtr_batch": rep_big["evictions"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (seconds)")
    parser.add_argument("--only", choices=("resnet50", "engine_gpt"), default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--link", default="12GB/s",
                        help="simulated host-device link (each way), e.g. 12GB/s, a PCIe 3 x16 figure")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # oversize-tensor notices of tiny chunk sizes
    torch.set_num_threads(os.cpu_count() or 1)
    # A link bandwidth makes the engine's arbiter weigh chunk copies against
    # recomputes (Note [The arbiter between chunks and activations]).
    tidal.set_device("sim", capacity="8GiB", bandwidth=args.link)
    out = {"quick": args.quick}
    if args.only in (None, "resnet50"):
        out["resnet50"] = resnet_part(args.quick)
    if args.only in (None, "engine_gpt"):
        out["engine_gpt"] = engine_part(args.quick, args.link)
    name = "dtr_batch-quick" if args.quick else "dtr_batch"
    path = common.write_result(name, out, args.output)
    for part in ("resnet50", "engine_gpt"):
        if part in out:
            r = out[part]
            print(f"{part}: largest batch {r['largest_batch_without_dtr']} without DTR, "
                  f"{r['largest_batch_with_dtr']} with DTR ({r['ratio']:.2f}x)"
                  + (f", {r['largest_batch_with_dtr_chunks_first']} with DTR and chunks first"
                     if "largest_batch_with_dtr_chunks_first" in r else ""))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
