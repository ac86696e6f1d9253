"""Speculative CPU Adam where backward cannot hide it (issue 52 item 5: weigh
the speculation's own price; Note [Speculation while backward lasts] in
python/tidal/engine/overlap.py), against speculating every chunk and
against no overlap, in the same run. Writes
benchmarks/results/step_overlap_cost-<machine>.json.

    python benchmarks/step_overlap_cost.py [--rounds 3] [--steps 8] [--accumulation N] [--quick]

A GPT whose CPU Adam is large beside its backward (speculated, with its
undo copies and on cores backward shares here, about as long as backward),
as a GPU's short backward beside the host's CPU Adam: TinyGPT vocab 8192, d 512, 4 layers,
seq 16, micro batch 1 (17M parameters), bf16, 1 MiB chunks, a device
budget of 48 MiB (hybrid Adam updates the states on the host),
gradient_clipping 1.0 with every loss scaled so the first batch's gradient
norm is 0.5 (the clip does not fire, so backward speculates), on the
simulated device. Three engines, one step each in turn (the order reversed
every other step), a pause before each round:
  * "default": a chunk's speculative update (undo copy included) is
    launched during backward only where it ends before backward does, by
    the last step's measures; the others run under the next forward;
  * "speculate_all": every chunk whose gradients are in is launched, as
    before the rule;
  * "off": tidal.overlap_step false (CPU Adam in engine.step()).
Per engine and step: the whole step (forward + backward + engine.step()),
its phases, CPU Adam time and its exposed part (memory_report()
["optimizer"]), the chunks launched during backward, left to the next
forward by the rule, undone; over the measured steps the scheduler's
departures from the last step's trace, prefetch hits and misses, and chunk
bytes each way; the weights compared bitwise with "off". On
this machine backward and CPU Adam share 2 cores, so work moved into
backward slows backward; on a GPU it runs on the device. A result on the
simulated device checks the schedule, not a GPU's speed.

--accumulation N: N micro-batches per optimizer step (the window's last
backward speculates; Note [Measured where folded]); a step is then the N
forwards and backwards and the step, and the file
step_overlap_cost-accumN-<machine>.json. "speculate_all" is there what
the engine did with accumulation before that Note (every chunk launched).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import step_overlap_common as so  # noqa: E402
import tidal  # noqa: E402

FULL = dict(vocab=8192, d=512, layers=4, heads=4, seq=16, batch=1, budget="48MiB")
QUICK = dict(vocab=512, d=64, layers=2, heads=4, seq=16, batch=1, budget="2MiB")
ENGINES = ("default", "speculate_all", "off")
COUNTS = ("chunks_updated_during_backward", "chunks_left_to_the_step_by_cost",
          "chunks_updated_under_next_forward", "undone_chunk_updates")
# The scheduler's counters over the measured steps: whether each step followed
# the last one's trace (Note [Left to the step, pinned as if launched]), its
# prefetch, the chunk bytes each way.
SCHEDULER = ("trace_divergences", "prefetch_hits", "misses", "bytes_host_to_device", "bytes_device_to_host")


def make_engine(shape, name, accumulation=1):
    e = so.gpt_engine(shape, "bf16", 1.0, accumulation, chunk_size="1MiB" if shape["d"] >= 256 else "64KiB",
                      device_memory_budget=shape["budget"], overlap_step=name != "off")
    if name == "speculate_all":
        # Before Note [Speculation while backward lasts]: every chunk whose
        # gradients are in is launched.
        e._overlap._fits_in_backward = lambda chunk: True
    return e


def step(engine, batches, factor):
    """One optimizer step over `batches` (its micro-batches): (whole,
    forward, backward, engine.step()) seconds (the phases summed over the
    micro-batches), and the CPU Adam and exposed seconds this step added."""
    before = engine.memory_report()["optimizer"]
    fwd = bwd = opt = 0.0
    for batch in batches:
        t0 = time.perf_counter()
        loss = engine(*batch)
        t1 = time.perf_counter()
        engine.backward(loss * factor)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        fwd, bwd, opt = fwd + t1 - t0, bwd + t2 - t1, opt + t3 - t2
    after = engine.memory_report()["optimizer"]
    return (fwd + bwd + opt, fwd, bwd, opt,
            after["adam_seconds"] - before["adam_seconds"],
            after["exposed_adam_seconds"] - before["exposed_adam_seconds"])


def main():
    args = so.parse_args(__doc__, rounds=3, steps=8, extra=lambda ap: ap.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches per optimizer step"))
    shape, rounds, steps = so.start(args, FULL, QUICK, quick_steps=3)
    accum = args.accumulation
    if accum < 1:
        raise SystemExit(f"--accumulation {accum}: expected an int >= 1")
    flat = so.token_batches(shape, accum * (3 + rounds * steps))
    data = [flat[i:i + accum] for i in range(0, len(flat), accum)]
    probe = make_engine(shape, "off", accum)
    step(probe, data[0], 1.0)
    factor = 0.5 / probe.get_global_grad_norm()
    del probe
    engines = {name: make_engine(shape, name, accum) for name in ENGINES}
    for e in engines.values():  # warm-up: the trace, the relayout, the plan, the measures
        for batches in data[:3]:
            step(e, batches, factor)
    counts0 = {n: {k: e.memory_report()["optimizer"][k] for k in COUNTS} for n, e in engines.items()}
    sched0 = {n: {k: e.chunks.stats()[k] for k in SCHEDULER} for n, e in engines.items()}
    samples = {n: [] for n in engines}
    at = 3
    for r in range(rounds):
        time.sleep(0 if args.quick else 1.0)
        for s in range(steps):
            for name in ENGINES if (r + s) % 2 == 0 else ENGINES[::-1]:
                samples[name].append(step(engines[name], data[at + s], factor))
        at += steps
    keys = ("step_seconds", "forward_seconds", "backward_seconds", "engine_step_seconds", "adam_seconds",
            "exposed_adam_seconds")
    out = {"quick": args.quick, "shape": shape, "rounds": rounds, "steps_per_round": steps,
           "gradient_accumulation_steps": accum,
           "gradient_clipping": 1.0, "loss_factor": factor, "precision": "bf16", "hybrid_adam": True,
           "cpu_adam_target": tidal._C.cpu_adam.target(), "simulated_device": True,
           "parameters": sum(r.numel for r in engines["off"].records), "engines": {}}
    want = engines["off"].parameters_fp32()
    for name, e in engines.items():
        report = e.memory_report()
        common.check_budget(report, name)
        opt = report["optimizer"]
        got = e.parameters_fp32()
        res = {f"{k}_median": statistics.median(col) for k, col in zip(keys, zip(*samples[name]))}
        res["exposed_share_of_adam"] = res["exposed_adam_seconds_median"] / res["adam_seconds_median"]
        res.update({k: opt[k] - counts0[name][k] for k in COUNTS})
        stats = e.chunks.stats()
        res["scheduler"] = {k: stats[k] - sched0[name][k] for k in SCHEDULER}
        res["steps_measured"] = rounds * steps
        copies = res["scheduler"]["prefetch_hits"] + res["scheduler"]["misses"]
        res["prefetch_hit_rate"] = res["scheduler"]["prefetch_hits"] / copies if copies else None
        res.update(budget_overruns=report["budget_overruns"], overlap_undo_bytes=opt["overlap_undo_bytes"],
                   bitwise_equal_to_off=all(torch.equal(want[n], got[n]) for n in want),
                   samples=samples[name])
        out["engines"][name] = res
    base = out["engines"]["speculate_all"]
    for name, res in out["engines"].items():
        res["step_over_speculate_all"] = res["step_seconds_median"] / base["step_seconds_median"]
        print(f"{name}: step {res['step_seconds_median'] * 1e3:.1f} ms ({res['step_over_speculate_all']:.2f}x "
              f"speculate_all; forward / backward / engine.step() "
              f"{res['forward_seconds_median'] * 1e3:.1f} / {res['backward_seconds_median'] * 1e3:.1f} / "
              f"{res['engine_step_seconds_median'] * 1e3:.1f} ms); CPU Adam "
              f"{res['adam_seconds_median'] * 1e3:.1f} ms, exposed {res['exposed_adam_seconds_median'] * 1e3:.1f} "
              f"ms ({res['exposed_share_of_adam']:.0%}); chunks launched during backward "
              f"{res['chunks_updated_during_backward']}, left to the step by the rule "
              f"{res['chunks_left_to_the_step_by_cost']}, under the next forward "
              f"{res['chunks_updated_under_next_forward']}; departures from the trace "
              f"{res['scheduler']['trace_divergences']} in {res['steps_measured']} steps, prefetch hit rate "
              f"{res['prefetch_hit_rate'] if res['prefetch_hit_rate'] is None else round(res['prefetch_hit_rate'], 2)}; "
              f"bitwise {res['bitwise_equal_to_off']}; "
              f"overruns {res['budget_overruns']}", flush=True)
    name = "step_overlap_cost" + (f"-accum{accum}" if accum > 1 else "")
    path = common.write_result(name + "-quick" if args.quick else name, out, args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
