"""Largest batch the training engine trains at a fixed device budget, with and
without recompute under the engine (the config's activation_checkpointing
block). Writes benchmarks/results/engine_batch-<machine>.json.

    python benchmarks/engine_batch.py [--quick]

The model is a GPT (tidal.models.gpt.TinyGPT, fp32) on the simulated device,
whose chunks must share the budget with the activations. Three configs:
  * none      : the engine alone;
  * recompute : one recompute segment per block (only block inputs are kept;
                each block reruns in backward, its parameters through the chunks);
  * offload   : the same with cpu_checkpointing (the block inputs go to host memory).
A batch fits when two steps train with the strict criterion of
benchmarks/dtr_batch.py: no OutOfMemoryError, and the engine's peak of chunk
bytes plus non-chunk bytes at the same moment (memory_report's
peak_device_bytes) within the budget. The search doubles, then bisects
(batch_search.largest, within 1/8, as dtr_batch.py). Also the step time at each config's largest batch and at
the largest batch of `none` (CPU times, the simulated device: a check of the
mechanism, not a GPU figure). The peer is the engine without recompute in the
same run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import batch_search  # noqa: E402
import common  # noqa: E402
import tidal  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

PLANS = {
    "none": None,
    "recompute": {"number_checkpoints": None},
    "offload": {"cpu_checkpointing": True},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model (seconds)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # oversize-tensor notices of small chunk sizes
    torch.set_num_threads(os.cpu_count() or 1)
    tidal.set_device("sim", capacity="8GiB")
    quick = args.quick
    shape = dict(vocab=256, d=64, layers=4, heads=4, seq=32) if quick else \
        dict(vocab=2048, d=256, layers=8, heads=4, seq=64)
    budget = (3 << 20) if quick else (48 << 20)
    chunk = (64 << 10) if quick else (1 << 20)
    cap = 64 if quick else 256
    layers = shape["layers"]

    def config(plan):
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "tidal": {"device": "sim", "chunk_size": chunk, "device_memory_budget": budget,
                         "hybrid_adam": False}}
        if PLANS[plan] is not None:
            block = dict(PLANS[plan])
            block["number_checkpoints"] = layers  # one segment per block
            cfg["activation_checkpointing"] = block
        return cfg

    def batches(b, n):
        return common.token_batches(shape["vocab"], shape["seq"], b, n)

    def train(b, plan, n=2):
        return batch_search.train_engine(lambda: TinyGPT(**shape), config(plan), batches(b, n))

    def fits(plan):
        return batch_search.fits_unless_oom(lambda b: train(b, plan)[2],
                                            lambda report: report["peak_device_bytes"] <= budget)

    params = sum(p.numel() for p in TinyGPT(**shape).parameters())
    print(f"engine_batch: {params} parameters, device budget {budget} bytes", flush=True)
    out = {"quick": quick, "model": f"TinyGPT {shape}, fp32, {params} parameters",
           "device_budget_bytes": budget, "chunk_bytes": chunk, "batch_cap": cap,
           "criterion": "two steps without OutOfMemoryError and peak_device_bytes <= budget",
           "configs": {}}
    start = 4
    for plan in PLANS:
        print(f"  {plan}:", flush=True)
        trials: list = []
        best = batch_search.largest(batch_search.logged(fits(plan), trials, f"    {plan}"), cap, start=start,
                                    within=8)
        out["configs"][plan] = {"largest_batch": best, "trials": trials}
    base = out["configs"]["none"]["largest_batch"]
    if base == 0:
        raise SystemExit(f"engine_batch: not even batch 1 trains at {budget} bytes; raise the budget")
    for plan, r in out["configs"].items():
        times, losses, report = train(r["largest_batch"], plan, 4)
        same, _, _ = train(base, plan, 4)
        r.update({
            "ratio_to_none": r["largest_batch"] / base,
            "step_seconds_at_largest": times[1:], "median_step_seconds_at_largest": statistics.median(times[1:]),
            "seconds_per_sample_at_largest": statistics.median(times[1:]) / r["largest_batch"],
            "step_seconds_at_none_batch": same[1:], "median_step_seconds_at_none_batch": statistics.median(same[1:]),
            "losses_at_largest": losses,
            "peak_device_bytes_at_largest": report["peak_device_bytes"],
            "peak_nonchunk_device_bytes_at_largest": report["peak_nonchunk_device_bytes"],
            "chunk_evictions_at_largest": report["evictions"],
        })
        print(f"  {plan}: largest batch {r['largest_batch']} ({r['ratio_to_none']:.2f}x none), "
              f"{r['seconds_per_sample_at_largest'] * 1e3:.1f} ms/sample", flush=True)
    path = common.write_result("engine_batch-quick" if quick else "engine_batch", out, args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
