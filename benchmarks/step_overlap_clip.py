"""Speculative CPU Adam during backward in the configuration people run
(issue 43; Notes [CPU Adam during backward] and [Speculative updates and
their undo] in python/tidal/engine/overlap.py) against the step without
overlap, in the same run. Writes benchmarks/results/step_overlap_clip-<machine>.json.

    python benchmarks/step_overlap_clip.py [--rounds 3] [--steps 8] [--quick]
        [--vocab N] [--cases clip_all,...] [--compute-threads N]

A GPT (TinyGPT vocab 8192, d 256, 8 layers, seq 64, batch 4, 1 MiB chunks)
with the default config: gradient_clipping 1.0, hybrid Adam on, bf16, at a
device budget (48 MiB) where most states are on the host, on the simulated
device. Three cases, each with tidal.overlap_step off and on (the default),
run in alternating order over rounds, a pause before each:
  * "no_clip": every loss scaled by a factor that keeps the gradient norm
    below 1.0 (measured on the first batch), as after the early steps of a
    training run: the clip never fires, the updates made during backward all
    stand;
  * "clip_some": the same, with every fourth step's loss times 20: the clip
    fires on those steps (their speculative updates are undone and made
    again) and the backward after each does not speculate;
  * "fp16_overflow": fp16 (loss scale 2^8), clipping 1.0, every fourth
    step's loss times 1e5: that step overflows and is skipped;
  * "clip_all" (issue 52): every loss times 20, so the clip fires on every
    step, as early in training and in fine-tunes: nothing is speculated, and
    what CPU Adam hides it hides under the next forward (Note [CPU Adam under
    the next forward]); here also "on_backward_only", the overlap with
    tidal.overlap_next_forward false (the engine before issue 52), and
    "on_worker_all_cores", the worker's updates on every core (cpu_adam_threads
    set to the core count), as before Note [The worker leaves a core].
Per engine and step: the whole step (forward + backward + engine.step()),
CPU Adam time (memory_report()["optimizer"]["adam_seconds"], undone updates
included) and its exposed part (what engine.step() spends on the update
after backward ended, and what the forward waits for the updates the last
step left to it). The goal (issue 43): exposed <= 25% of the CPU Adam
time in the default configuration. On this machine backward and CPU Adam
share 2 cores, so the whole step need not get shorter; on a GPU backward
runs on the device. A result on the simulated device checks the scheduling,
not a GPU's speed.

--vocab N: the GPT's vocabulary (8192 by default, where the embedding, the
next forward's first module, holds 25% of the parameters: the floor of
clip_all's exposed share; at 2048, 7.7%, gpt-1.3b's 8%); the file is then
step_overlap_clip-vocabN-<machine>.json. --cases: a comma-separated subset.
--compute-threads N: torch runs on N threads (the simulated device's
compute) and CPU Adam on the other cores (tidal.cpu_adam_threads), as a
GPU's compute and its host's cores are apart (benchmarks/engine_offload.py's
option); by default both use every core, so torch's threads, spinning after
backward, take cores from the step's hand-off and the worker, which a GPU's
host does not pay. The file is then ...-computeN-<machine>.json (no
"on_worker_all_cores" engine then: the config sets the worker's threads).
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

FULL = dict(vocab=8192, d=256, layers=8, heads=4, seq=64, batch=4, budget="48MiB")
QUICK = dict(vocab=512, d=64, layers=2, heads=4, seq=16, batch=2, budget="2MiB")
CASES = {"no_clip": ("bf16", 1.0), "clip_some": ("bf16", 20.0), "fp16_overflow": ("fp16", 1e5),
         "clip_all": ("bf16", 20.0)}


# --compute-threads: CPU Adam's threads beside torch's (empty: tidal's default).
CPU_ADAM_THREADS = {}


def make_engine(shape, precision, overlap, next_forward=True, **tidal_keys):
    tidal_keys = {**CPU_ADAM_THREADS, **tidal_keys}
    return so.gpt_engine(shape, precision, 1.0, chunk_size="1MiB" if shape["d"] >= 256 else "64KiB",
                         device_memory_budget=shape["budget"], overlap_step=overlap,
                         overlap_next_forward=next_forward, **tidal_keys)


def run(engine, batches, factors):
    """Timed steps: (whole step seconds, adam, exposed) per step, the norms,
    and per step the chunk scheduler's waits on the host: (block waits, copy
    waits) (issue 52's goal: none in a steady step)."""
    out, norms, waits = [], [], []
    for (x, y), f in zip(batches, factors):
        before = engine.memory_report()["optimizer"]
        chunks_before = engine.chunks.stats()
        t0 = time.perf_counter()
        engine.backward(engine(x, y) * f)
        engine.step()
        t1 = time.perf_counter()
        after = engine.memory_report()["optimizer"]
        chunks_after = engine.chunks.stats()
        out.append((t1 - t0, *(after[k] - before[k] for k in ("adam_seconds", "exposed_adam_seconds"))))
        norms.append(engine.get_global_grad_norm())
        waits.append(tuple(chunks_after[k] - chunks_before[k] for k in ("block_waits", "copy_waits")))
    return out, norms, waits


def first_module_share(engine, batch) -> tuple[str, float]:
    """(the first module with parameters that a forward of `engine` runs,
    the share of the engine's parameters in that module's chunks): the
    updates a forward after the step waits for before its first module."""
    by_param = {id(r.param): r for r in engine.records}
    first = []

    def note(module, _args):
        if not first and any(id(p) in by_param for p in module.parameters(recurse=False)):
            first.append(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
    try:
        with torch.no_grad():
            engine(*batch)
    finally:
        handle.remove()
    chunks = {by_param[id(p)].chunk for p in first[0].parameters(recurse=False) if id(p) in by_param}
    return type(first[0]).__name__, \
        sum(r.numel for r in engine.records if r.chunk in chunks) / sum(r.numel for r in engine.records)


def main():
    def extra(ap):
        ap.add_argument("--vocab", type=int, default=None, help="the GPT's vocabulary (default 8192)")
        ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
        common.add_compute_threads_arg(ap)

    args = so.parse_args(__doc__, rounds=3, steps=8, extra=extra)
    shape, rounds, steps = so.start(args, FULL, QUICK, quick_steps=4)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise SystemExit(f"--cases {args.cases!r}: expected a comma-separated subset of {', '.join(CASES)}")
    if args.vocab is not None:
        if args.vocab < 2:
            raise SystemExit(f"--vocab {args.vocab}: expected an int >= 2")
        shape = dict(shape, vocab=args.vocab)
    adam_threads = common.split_cores(args.compute_threads)
    if adam_threads:
        CPU_ADAM_THREADS["cpu_adam_threads"] = adam_threads
    data = so.token_batches(shape, steps + 3)
    # The factor that puts the first batch's gradient norm at 0.5.
    probe = make_engine(shape, "bf16", False)
    probe.backward(probe(*data[0]))
    probe.step()
    base = 0.5 / probe.get_global_grad_norm()
    del probe
    out = {"quick": args.quick, "shape": shape, "rounds": rounds, "steps_per_round": steps,
           "gradient_clipping": 1.0, "hybrid_adam": True, "loss_factor": base,
           "cpu_adam_target": tidal._C.cpu_adam.target(), "simulated_device": True,
           "compute_threads": args.compute_threads or None,
           "cpu_adam_threads": CPU_ADAM_THREADS.get("cpu_adam_threads"), "cases": {}}
    for case in cases:
        precision, spike = CASES[case]
        if case == "clip_all":
            factors = [base * spike] * steps
        else:
            factors = [base * (spike if case != "no_clip" and i % 4 == 3 else 1.0) for i in range(steps)]
        engines = {"off": make_engine(shape, precision, False), "on": make_engine(shape, precision, True)}
        if case == "clip_all":
            engines["on_backward_only"] = make_engine(shape, precision, True, next_forward=False)
            if not args.compute_threads:
                # The worker's updates on every core, as before Note [The worker
                # leaves a core] in python/tidal/engine/overlap.py.
                engines["on_worker_all_cores"] = make_engine(shape, precision, True,
                                                             cpu_adam_threads=os.cpu_count() or 1)
        # Warm-up: the trace, the relayout, hybrid Adam's plan. For clip_all
        # with the clip firing already, so the timed steps are the steady
        # state of a run whose every step clips, not the step where the clip
        # starts to fire (whose speculative updates are undone: timed apart,
        # as "transition").
        warm = [base * spike] * 3 if case == "clip_all" else [base] * 3
        for e in engines.values():
            run(e, data[:3], warm)
        samples = {mode: [] for mode in engines}
        waits = {mode: [] for mode in engines}
        norms = {}
        for _, mode in so.alternating(engines, rounds):
            s, norms[mode], w = run(engines[mode], data[3:], factors)
            samples[mode].extend(s)
            waits[mode].extend(w)
        res = {"precision": precision, "factors": factors, "grad_norms_last_round": norms["on"]}
        for mode, s in samples.items():
            r = engines[mode].memory_report()
            common.check_budget(r, f"{case} {mode}")
            o = r["optimizer"]
            whole, adam, exposed = (statistics.median(col) for col in zip(*s))
            res[mode] = {"step_seconds_median": whole, "adam_seconds_median": adam,
                         "exposed_adam_seconds_median": exposed,
                         "exposed_adam_seconds_mean": statistics.mean(x[2] for x in s),
                         "adam_seconds_mean": statistics.mean(x[1] for x in s),
                         "exposed_share_of_adam": exposed / adam if adam else None,
                         "exposed_share_of_adam_mean": (statistics.mean(x[2] for x in s) /
                                                        statistics.mean(x[1] for x in s)),
                         "adam_chunks_on_host": r["adam_chunks_on_host"],
                         "adam_chunks_on_device": r["adam_chunks_on_device"],
                         "chunks_updated_during_backward": o["chunks_updated_during_backward"],
                         "chunks_updated_under_next_forward": o["chunks_updated_under_next_forward"],
                         "next_forward_wait_seconds": o["next_forward_wait_seconds"],
                         "updates_run_by_their_waiter": o["updates_run_by_their_waiter"],
                         "undone_chunk_updates": o["undone_chunk_updates"],
                         "steps_not_speculated": o["steps_not_speculated"],
                         "overlap_undo_bytes": o["overlap_undo_bytes"],
                         "skipped_steps": engines[mode].skipped_steps,
                         "budget_overruns": r["budget_overruns"],
                         "evictions": r["evictions"],
                         "peak_device_bytes": r["peak_device_bytes"],
                         "block_waits_per_step_mean": statistics.mean(w[0] for w in waits[mode]),
                         "copy_waits_per_step_mean": statistics.mean(w[1] for w in waits[mode]),
                         "samples": s}
        params = sum(rec.numel for rec in engines["on"].records)
        res["parameters"] = params
        res["undo_bytes_per_parameter"] = res["on"]["overlap_undo_bytes"] / params
        res["exposed_ratio_on_to_off"] = res["on"]["exposed_adam_seconds_median"] / \
            res["off"]["exposed_adam_seconds_median"]
        res["exposed_mean_ratio_on_to_off"] = res["on"]["exposed_adam_seconds_mean"] / \
            res["off"]["exposed_adam_seconds_mean"]
        # Against CPU Adam as it runs without overlap (on these 2 cores the
        # update under the next forward shares them with it and runs longer).
        res["exposed_on_over_adam_off"] = res["on"]["exposed_adam_seconds_median"] / \
            res["off"]["adam_seconds_median"]
        res["exposed_mean_on_over_adam_mean_off"] = res["on"]["exposed_adam_seconds_mean"] / \
            res["off"]["adam_seconds_mean"]
        res["step_ratio_on_to_off"] = res["on"]["step_seconds_median"] / res["off"]["step_seconds_median"]
        # The same weights both ways (Note [Speculative updates and their undo]).
        a = engines["off"].parameters_fp32()
        res["bitwise_equal_weights"] = all(
            all(torch.equal(a[n], b[n]) for n in a)
            for b in (engines[m].parameters_fp32() for m in engines if m != "off"))
        if case == "clip_all":
            # The floor of the schedule (Note [CPU Adam under the next
            # forward]): the next forward's first module with parameters waits
            # for the updates of its chunks before it can start.
            res["first_module"], res["first_module_share"] = first_module_share(engines["on"], data[0])
            # The step where the clip starts to fire after steps that did not
            # clip: its backward speculated, so its updates are undone and made
            # again in the step (Note [Speculative updates and their undo]).
            e = make_engine(shape, precision, True)
            run(e, data[:3], [base] * 3)
            [(step_s, adam_s, exposed_s)], _, _ = run(e, data[3:4], [base * spike])
            o = e.memory_report()["optimizer"]
            res["transition"] = {"step_seconds": step_s, "adam_seconds": adam_s,
                                 "exposed_adam_seconds": exposed_s,
                                 "undone_chunk_updates": o["undone_chunk_updates"]}
            del e
        out["cases"][case] = res
        on, off = res["on"], res["off"]
        print(f"{case} ({precision}): {params / 1e6:.1f}M params; exposed CPU Adam per step "
              f"{off['exposed_adam_seconds_median'] * 1e3:.1f} ms off -> "
              f"{on['exposed_adam_seconds_median'] * 1e3:.1f} ms on ({on['exposed_share_of_adam']:.0%} of "
              f"{on['adam_seconds_median'] * 1e3:.1f} ms; mean {on['exposed_share_of_adam_mean']:.0%}); step "
              f"{off['step_seconds_median'] * 1e3:.1f} -> {on['step_seconds_median'] * 1e3:.1f} ms; "
              f"host/device chunk updates {on['adam_chunks_on_host']}/{on['adam_chunks_on_device']}, "
              f"{on['chunks_updated_during_backward']} during backward, {on['undone_chunk_updates']} undone; "
              f"undo {on['overlap_undo_bytes'] / 2**20:.1f} MiB ({res['undo_bytes_per_parameter']:.1f} B/param); "
              f"{on['chunks_updated_under_next_forward']} under the next forward; "
              f"block/copy waits per step {on['block_waits_per_step_mean']:.1f}/"
              f"{on['copy_waits_per_step_mean']:.1f}; bitwise {res['bitwise_equal_weights']}", flush=True)
        if "on_backward_only" in res:
            b = res["on_backward_only"]
            print(f"{case}: with overlap_next_forward false, exposed "
                  f"{b['exposed_adam_seconds_median'] * 1e3:.1f} ms ({b['exposed_share_of_adam']:.0%} of "
                  f"{b['adam_seconds_median'] * 1e3:.1f} ms); step {b['step_seconds_median'] * 1e3:.1f} ms",
                  flush=True)
        if "on_worker_all_cores" in res:
            b = res["on_worker_all_cores"]
            print(f"{case}: with the worker's updates on every core, exposed "
                  f"{b['exposed_adam_seconds_median'] * 1e3:.1f} ms ({b['exposed_share_of_adam']:.0%} of "
                  f"{b['adam_seconds_median'] * 1e3:.1f} ms; mean {b['exposed_share_of_adam_mean']:.0%}); "
                  f"step {b['step_seconds_median'] * 1e3:.1f} ms", flush=True)
        if "first_module_share" in res:
            print(f"{case}: the next forward's first module ({res['first_module']}) waits for "
                  f"{res['first_module_share']:.0%} of the parameters' updates before it starts", flush=True)
        if "transition" in res:
            t = res["transition"]
            print(f"{case}: the step where the clip starts to fire: exposed {t['exposed_adam_seconds'] * 1e3:.1f} ms "
                  f"of {t['adam_seconds'] * 1e3:.1f} ms, {t['undone_chunk_updates']} updates undone", flush=True)
    name = "step_overlap_clip" + (f"-vocab{args.vocab}" if args.vocab is not None else "") + (
        f"-compute{args.compute_threads}" if args.compute_threads else "")
    path = common.write_result(name + "-quick" if args.quick else name, out, args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
