"""Does the arbiter earn its place? Chunks and activations competing for one
device budget under the engine with DTR, three rules side by side. Writes
benchmarks/results/engine_arbiter-<machine>.json.

    python benchmarks/engine_arbiter.py [--quick]

The model makes them compete: a GPT whose chunks and activations are of a
size (TinyGPT vocab 2048 untied, d 256, 8 layers, seq 256, fp32: 7.4M
parameters, 28 MiB of fp32 weights in 1 MiB chunks; 2 MiB logits and 256 KiB
to 1 MiB activations per sequence), at a 24 MiB device budget, less than the
weights alone. (With a vocabulary of 8192 the logits' op alone decided the
largest batch whatever the rule.) The rules, for each eviction DTR
needs while the engine runs (Note [The arbiter between chunks and
activations] in hooks/dtr/storage_runtime.h):
  * arbiter            the cheaper per byte: an activation's regeneration
                       time over its bytes, or a chunk's round trip over the
                       link (the simulated device's link, --link);
  * chunks_first       DTR never evicts a chunk; chunks give way only through
                       the tracer's plan at the hooks (the rule before the
                       arbiter: tidal.engine.dtr_link.ARBITER = False);
  * activations_first  the arbiter with the link priced at 1 byte/s, so an
                       activation is always the cheaper.
For each rule: the largest batch that trains (two steps, no error, no
overrun, the engine's peak within the budget less the margin; every trial in
a fresh process; doubling then bisection: benchmarks/batch_search.py)
and the step time at the largest batch all three train (median of the timed
steps over rounds in alternating order), with the chunk bytes moved and the
recomputes. CPU times: the simulated device's compute is the CPU's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
import batch_search  # noqa: E402
import common  # noqa: E402

RULES = ("arbiter", "chunks_first", "activations_first")
FULL = {"shape": dict(vocab=2048, d=256, layers=8, heads=4, seq=256), "budget": 24 << 20, "cap": 16,
        "rounds": 3}
QUICK = {"shape": dict(vocab=2048, d=64, layers=2, heads=4, seq=128), "budget": 8 << 20, "cap": 8,
         "rounds": 1}


def trial(rule: str, batch: int, spec: dict, link: str) -> dict:
    import warnings

    import torch

    import tidal
    from tidal.engine import dtr_link
    from tidal.models.gpt import TinyGPT
    warnings.simplefilter("ignore")
    if rule == "chunks_first":
        dtr_link.ARBITER = False
    elif rule == "activations_first":
        dtr_link._link_bytes_per_s = lambda store: 1.0
    tidal.set_device("sim", capacity="8GiB", bandwidth=link)
    torch.manual_seed(0)
    shape = spec["shape"]
    model = TinyGPT(**shape, tied=False)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, shape["vocab"], (batch, shape["seq"]), generator=g),) * 2 for _ in range(3)]
    cfg = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "tidal": {"chunk_size": 1 << 20, "device_memory_budget": spec["budget"], "hybrid_adam": False,
                     "dtr": {"enabled": True}}}
    return batch_search.engine_trial(
        {"rule": rule, "batch": batch}, model, data, lambda m, b: m(*b), cfg,
        report_keys=("bytes_host_to_device_last_step", "bytes_device_to_host_last_step"),
        dtr_keys=batch_search.DTR_KEYS + ("chunk_bytes_freed",))


def run_trial(rule, batch, spec, link) -> dict:
    return common.run_child(__file__, [rule, batch, spec, link], {"rule": rule, "batch": batch})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--link", default="12GB/s")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        rule, batch, spec, link = json.loads(args.child)
        print(json.dumps(trial(rule, batch, spec, link)), flush=True)
        return 0
    spec = QUICK if args.quick else FULL
    trials = []

    def fits_for(rule):
        return batch_search.logged(lambda b: run_trial(rule, b, spec, args.link), trials, f"  {rule:17s}")

    best = {rule: batch_search.largest(fits_for(rule), spec["cap"]) for rule in RULES}
    at = min(best.values())
    times = {rule: [] for rule in RULES}
    moved = {}
    if at > 0:
        for rule in batch_search.alternating(RULES, spec["rounds"]):
            r = run_trial(rule, at, spec, args.link)
            trials.append({**r, "timing": True})
            if r["fits"]:
                times[rule].extend(r["step_seconds"])
                moved[rule] = {k: r[k] for k in ("chunk_evictions", "bytes_host_to_device_last_step",
                                                  "bytes_device_to_host_last_step", "dtr")}
    out = {
        "quick": args.quick,
        "link": args.link,
        "model": {**spec["shape"], "tied": False, "dtype": "fp32", "chunk_size": 1 << 20},
        "device_budget_bytes": spec["budget"],
        "batch_cap": spec["cap"],
        "largest": best,
        "timed_batch": at,
        "step_seconds_median": {r: (statistics.median(t) if t else None) for r, t in times.items()},
        "at_timed_batch": moved,
        "trials": trials,
    }
    path = common.write_result("engine_arbiter-quick" if args.quick else "engine_arbiter", out)
    print(f"largest batch {best}; step at batch {at}: "
          f"{ {r: v for r, v in out['step_seconds_median'].items()} }")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
