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
a fresh process; doubling then bisection, as benchmarks/engine_dtr_batch.py)
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
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
from engine_dtr_batch import largest  # noqa: E402

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
    out = {"rule": rule, "batch": batch}
    try:
        engine = tidal.initialize(model, cfg)
        times = []
        for b in data:
            t0 = time.perf_counter()
            engine.backward(engine(*b))
            engine.step()
            times.append(time.perf_counter() - t0)
        r = engine.memory_report()
        ok = common.budget_kept(r)
        out.update(fits=ok, step_seconds=times[1:], peak_device_bytes=r["peak_device_bytes"],
                   budget_overruns=r["budget_overruns"], device_budget=r["device_budget"],
                   device_margin=r["device_margin"], chunk_evictions=r["evictions"],
                   bytes_host_to_device_last_step=r["bytes_host_to_device_last_step"],
                   bytes_device_to_host_last_step=r["bytes_device_to_host_last_step"],
                   dtr={k: r["dtr"][k] for k in ("evictions", "recomputes", "recompute_seconds",
                                                 "chunk_evictions", "chunk_bytes_freed")})
        if not ok:
            out["why"] = "overrun or peak past the budget"
    except tidal.OutOfMemoryError as e:
        out.update(fits=False, why=str(e)[:300])
    return out


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
        def f(b):
            r = run_trial(rule, b, spec, args.link)
            trials.append(r)
            print(f"  {rule:17s} batch {b:3d}: {'fits' if r['fits'] else 'does not fit'}"
                  + ("" if r["fits"] else f" ({r.get('why', '')[:100]})"), flush=True)
            return r["fits"]
        return f

    best = {rule: largest(fits_for(rule), spec["cap"]) for rule in RULES}
    at = min(best.values())
    times = {rule: [] for rule in RULES}
    moved = {}
    if at > 0:
        for k in range(spec["rounds"]):
            order = RULES if k % 2 == 0 else tuple(reversed(RULES))
            for rule in order:
                time.sleep(1.0)  # a pause: no rule pays for the previous one's threads
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
