"""Chunks that a trace point's lowered budget evicts, leaving at their last
use before it (Note [Chunks leave ahead of a lowering] in
runtime/scheduler/chunk_scheduler.h; issue 52, "no synchronous waits in a
steady step") against leaving at the point (tidal.evict_ahead false: the
scheduler before), in the same run. Writes
benchmarks/results/evict_ahead-<machine>.json.

    python benchmarks/evict_ahead.py [--rounds 3] [--steps 10]
        [--links 2GB/s,1GB/s,500MB/s] [--quick]

The shape of step_overlap_clip.py and tests/python/test_blocks_leaving.py:
a GPT (TinyGPT vocab 8192, d 256, 8 layers, seq 64, batch 4, 1 MiB chunks,
bf16, gradient clipping 1.0) on the simulated device, at a budget derived
from a run where everything fits (its measured activation peak, plus room
for a quarter of the 16-bit chunks, the margin a twentieth), so that the
chunks that fit while the activations are small leave at the trace points
where they grow, in every step. On each simulated link rate (each way), the
two engines run in alternating order over rounds, beside the engine where
everything fits (nothing moves: the step's compute and CPU Adam).

Per engine and steady step (the steps after the fourth): the step time;
the seconds the hook's thread waited for a block's copy down before its room
could be reused (block_wait_seconds: the synchronous part of the evictions)
and for a chunk's copy up (copy_wait_seconds); the evictions, those ahead,
the bytes each way and the prefetch hits. Every engine's losses and fp32
weights must be the bits of the engine where everything fits, and its budget
kept (0 overruns), or the benchmark fails. A result on the simulated device
checks the scheduling (what waits, and for how long on this link), not a
GPU's speed.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch

from common import budget_kept, check_budget, summarize, timed_engine_steps, token_batches, write_result
from step_overlap_common import alternating

import tidal
from tidal._C.chunks import ChunkKind
from tidal.models.gpt import TinyGPT

VOCAB, D, LAYERS, SEQ, BATCH, WARM = 8192, 256, 8, 64, 4, 4
# The vocabulary of the tests that train this shape (tests/python/
# test_clean_down.py, test_blocks_leaving.py): with VOCAB a step is 1.35x as
# long where torch's bf16 matmul is slow (a CPU without AVX-512).
TEST_VOCAB = 2048
COUNTERS = ("block_waits", "block_wait_seconds", "copy_waits", "copy_wait_seconds", "evictions",
            "evictions_ahead", "bytes_host_to_device", "bytes_device_to_host", "prefetch_hits", "misses",
            "host_pins", "copies_down_skipped", "bytes_down_skipped")


def config(budget: int, evict_ahead: bool = True, **tidal_keys) -> dict:
    t = {"chunk_size": "1MiB", "device_memory_budget": budget, "evict_ahead": evict_ahead, **tidal_keys}
    if budget:
        t["device_margin"] = budget // 20
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "tidal": t}


def train(engine, batches):
    """Seconds per step, losses, and the scheduler's counters after each step."""
    times, losses, counters = [], [], []
    for batch in batches:
        t, loss = timed_engine_steps(engine, [batch])
        times += t
        losses += loss
        s = engine.chunks.stats()
        counters.append({k: s[k] for k in COUNTERS})
    return times, losses, counters


def run_engine(model, batches, budget, bandwidth, evict_ahead, reference, label, **tidal_keys):
    tidal.set_device("sim", capacity="8GiB", **({"bandwidth": bandwidth} if bandwidth else {}))
    engine = tidal.initialize(copy.deepcopy(model), config(budget, evict_ahead, **tidal_keys))
    times, losses, counters = train(engine, batches)
    report = engine.memory_report()
    check_budget(report, label)
    ref_losses, ref_weights = reference
    weights = engine.parameters_fp32()
    bitwise = losses == ref_losses and all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)
    if not bitwise:
        raise SystemExit(f"{label}: the losses or weights differ from the run where everything fits")
    engine.remove_hooks()
    steady = [{k: b[k] - a[k] for k in COUNTERS} for a, b in zip(counters[WARM - 1:], counters[WARM:])]
    return {"step_s": times[WARM:], "steady": steady, "budget_kept": budget_kept(report),
            "budget_overruns": report["budget_overruns"], "bitwise": bitwise}


def the_shape(steps, vocab=VOCAB):
    """The model, `steps` batches, the run where everything fits (its losses
    and fp32 weights), the budget from what that run measured, its
    activation peak and the 16-bit chunk bytes. (`vocab`: the tests'
    TEST_VOCAB.)"""
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab, d=D, layers=LAYERS, heads=4, seq=SEQ)
    batches = token_batches(vocab, SEQ, BATCH, steps)
    tidal.set_device("sim", capacity="8GiB")
    fits = tidal.initialize(copy.deepcopy(model), config(0))
    _, ref_losses, _ = train(fits, batches)
    reference = (ref_losses, fits.parameters_fp32())
    activations = fits.memory_report()["peak_nonchunk_device_bytes"]
    c = fits.chunks
    p16 = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
    budget = int((activations + p16 // 4) / 0.95)
    fits.remove_hooks()
    return model, batches, reference, budget, activations, p16


def fits_step_seconds(model, batches):
    """Steady step times of the engine where everything fits."""
    tidal.set_device("sim", capacity="8GiB")
    engine = tidal.initialize(copy.deepcopy(model), config(0))
    times, _, _ = train(engine, batches)
    engine.remove_hooks()
    return times[WARM:]


def per_step(runs, key):
    return statistics.mean(step[key] for run in runs for step in run["steady"])


def summary(runs):
    steps = [t for run in runs for t in run["step_s"]]
    out = {"step_s": summarize(steps)}
    for key in COUNTERS:
        out[f"{key}_per_step"] = per_step(runs, key)
    copies = out["prefetch_hits_per_step"] + out["misses_per_step"]
    out["steady_prefetch_hit_rate"] = out["prefetch_hits_per_step"] / copies if copies else None
    out["budget_overruns"] = sum(run["budget_overruns"] for run in runs)
    out["bitwise"] = all(run["bitwise"] for run in runs)
    return out


def parse_args(doc: str):
    """The command line of this benchmark and of those that run its shape
    (benchmarks/clean_down.py): the arguments, and the links as a list."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--links", default="2GB/s,1GB/s,500MB/s",
                    help="comma-separated simulated link rates, each way")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (not tabled)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.links = 1, WARM + 2, "1GB/s"
    if args.steps <= WARM:
        raise SystemExit(f"--steps {args.steps}: expected more than the {WARM} warm-up steps")
    return args, [link.strip() for link in args.links.split(",") if link.strip()]


def measure(args, links, engines: dict):
    """Trains the shape on each link with each of `engines` (name -> the
    tidal keys it adds to the config), and the engine where everything
    fits, in alternating order over args.rounds rounds. Returns each link's
    summary() per engine, with each engine's step over the fitting one and
    its runs ("raw"), and what the result file records besides."""
    model, batches, reference, budget, activations, p16 = the_shape(args.steps)
    fits_steps = []
    runs = {link: {name: [] for name in engines} for link in links}
    contenders = ["fits"] + [(link, name) for link in links for name in engines]
    for r, contender in alternating(contenders, args.rounds):
        if contender == "fits":
            fits_steps += fits_step_seconds(model, batches)
            continue
        link, name = contender
        keys = dict(engines[name])
        runs[link][name].append(run_engine(model, batches, budget, link, keys.pop("evict_ahead", True), reference,
                                           f"{link} {name} round {r}", **keys))
    fits_median = statistics.median(fits_steps)
    results = {}
    for link in links:
        results[link] = {name: summary(runs[link][name]) for name in engines}
        for name in engines:
            results[link][f"{name}_over_fits"] = results[link][name]["step_s"]["median"] / fits_median
        results[link]["raw"] = runs[link]
    record = {
        "quick": args.quick,
        "shape": {"vocab": VOCAB, "d": D, "layers": LAYERS, "seq": SEQ, "batch": BATCH, "chunk_size": "1MiB",
                  "dtype": "bf16", "gradient_clipping": 1.0, "device_budget": budget,
                  "activation_peak_bytes": activations, "param16_chunk_bytes": p16},
        "rounds": args.rounds, "steps": args.steps, "warmup_steps": WARM,
        "fits_step_s": summarize(fits_steps), "fits_step_s_raw": fits_steps,
        "links": results,
    }
    return results, fits_median, record


def main():
    args, links = parse_args(__doc__)
    results, fits_median, record = measure(args, links, {"at_points": {"evict_ahead": False}, "ahead": {}})
    for link in links:
        p = results[link]
        at_points, ahead = p["at_points"], p["ahead"]
        p["step_ahead_over_at_points"] = ahead["step_s"]["median"] / at_points["step_s"]["median"]
        print(f"{link}: step {ahead['step_s']['median'] * 1e3:.0f} ms ahead, "
              f"{at_points['step_s']['median'] * 1e3:.0f} ms at the points ({fits_median * 1e3:.0f} ms where "
              f"everything fits); block waits per step {ahead['block_waits_per_step']:.1f} "
              f"({ahead['block_wait_seconds_per_step'] * 1e3:.1f} ms) against "
              f"{at_points['block_waits_per_step']:.1f} ({at_points['block_wait_seconds_per_step'] * 1e3:.1f} ms); "
              f"evictions {ahead['evictions_per_step']:.1f}, ahead {ahead['evictions_ahead_per_step']:.1f}; "
              f"MB up per step {ahead['bytes_host_to_device_per_step'] / 1e6:.1f} against "
              f"{at_points['bytes_host_to_device_per_step'] / 1e6:.1f}", flush=True)
    print(f"wrote {write_result('evict_ahead', record, output=args.output)}")


if __name__ == "__main__":
    sys.exit(main())
