"""Offload at the speed of the link (issue 52), on the simulated device at an
H100's ratios: what a steady step with chunks moving costs against plain
PyTorch in the same run, against the link time of the minimum bytes, and
against the placement rule of before. Writes
benchmarks/results/engine_offload-<machine>.json.

    python benchmarks/engine_offload.py [--rounds 3] [--steps 4] [--quick]

The shape is the H100 run's (benchmarks/results/engine-nvidia-h100-80gb-hbm3.json:
gpt-1.3b, bf16, a quarter of the model states as chunk room beside the
activation peak): a TinyGPT in bf16, hybrid Adam and the step overlap on (the
defaults), budget = (activation peak + a quarter of the chunk bytes) / 0.95,
margin a twentieth. The simulated device is given what a GPU pays, in
proportion to the compute this CPU does at this shape (the decisions and the
stalls depend on these ratios, not on absolute rates):
  * the link: on the H100 the minimum bytes of that run (about 2.45 GB each
    way) take 45 ms at 54.5 GB/s (pinned copies), 0.28 of plain PyTorch's
    161 ms step; here the link is set so that this shape's minimum bytes
    take the same 0.28 of plain PyTorch's step;
  * pinning host memory: 6 GB/s on that host (cudaHostRegister), so pinning
    the minimum bytes would take 2.5 plain steps there; scaled alike.
Runs, a step of each in turn (in alternating order; each step timed until
the copies it started have landed), over the same batches, in rounds after a
pause each:
  * plain  : the model, torch.optim.AdamW (foreach); the compute of a step;
  * tidal  : the engine at the budget above;
  * before : the same engine with hybrid Adam's placement rule of before issue 52
             (every chunk updated on the device wherever the step finds room:
             the states come up for the update and the next peak pushes them
             down). The prefetch, host-block and weights-up (Note [Weights up
             as they are updated]) changes of issue 52 are in both;
  * grads_at_fold (with --accumulation > 1): the engine with each
             host-updated chunk's gradients going down when the fold reads
             them, as before Note [Gradients down as they land];
  * restore_at_fold (with --accumulation > 1): the engine with every fold
             rounding the masters back into the 16-bit slots (tidal.fold_images
             false), as before Note [The weights' image instead of the restore]
             (hooks/gradient_sums.h; 16 bytes of host memory traffic per
             parameter instead of 10);
  * weights_at_step: the engine with the weights of the chunks updated
             during backward going up after the step, in the next forward's
             order, as before Note [Weights up as they are updated] (with
             accumulation, also the weights the fold after a backward that
             ends no window gives back);
  * no_overlap: the engine with tidal.overlap_step false (CPU Adam in
             engine.step(), after backward): on this machine CPU Adam and
             its undo copies share the cores with backward's compute, which a
             GPU's backward does not use; this run shows what that costs here.
With --compute-threads N, torch runs on N threads (the simulated device's
compute: plain PyTorch's whole step, tidal's forward and backward) and CPU
Adam on the other cores, as a GPU's compute and its host's cores are apart;
by default both use every core, so the engine's copies, CPU Adam and its
worker take cores from the compute, which no GPU pays.
Per tidal run, per steady step (the last --steps of each round): time, bytes
each way against the minimum (every 16-bit chunk resident, the states that
fit the rest of the chunk room stay, the other chunks send gradients down and
weights up once per micro-batch), prefetch hits and misses, host blocks
allocated (each one pinned on a GPU), waits on running copies, exposed CPU
Adam. The limit of the schedule: max(plain compute, link time of the minimum
bytes each way, CPU Adam not hidden). On the simulated device the compute and
CPU Adam share this machine's cores; these are checks of the schedule, not
GPU figures.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import tidal  # noqa: E402
from tidal._C.chunks import ChunkKind  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402
from tidal.train import STEP_COUNTERS  # noqa: E402

H100_LINK = 54.5e9  # bytes/s, pinned 64 MiB copies (device_bandwidth-nvidia-h100-80gb-hbm3.json)
H100_PLAIN_STEP = 0.1612  # s, plain PyTorch's steady step, gpt-1.3b (engine-nvidia-h100-80gb-hbm3.json)
H100_MINIMUM = 2.45e9  # bytes each way per step at the quarter budget (issue 52: 2.3-2.6 GB)
H100_PIN = 6e9  # bytes/s cudaHostRegister on that host (issue 52)
LINK_SHARE = H100_MINIMUM / H100_LINK / H100_PLAIN_STEP  # link time of the minimum / compute: 0.28
PIN_SHARE = H100_MINIMUM / H100_PIN / H100_PLAIN_STEP  # pinning the minimum / compute: 2.5
# A step's scheduler counters, as tidal-train records them (Note [What a
# steady step costs] in tidal/train.py).
COUNTERS = STEP_COUNTERS


class Plain:
    def __init__(self, model, lr):
        self.model = model.to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)

    def step(self, batches):
        """One optimizer step over `batches`; self.phases: its forward,
        backward and optimizer seconds (summed over the micro-batches)."""
        fwd = bwd = 0.0
        for x, y in batches:
            t0 = time.perf_counter()
            loss = self.model(x, y)
            t1 = time.perf_counter()
            loss.backward()
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.phases = (fwd, bwd, time.perf_counter() - t2)


class Tidal:
    def __init__(self, model, cfg, rule_of_before: bool, grads_at_fold: bool = False,
                 weights_at_step: bool = False):
        t = time.perf_counter()
        self.engine = tidal.initialize(model, cfg)
        self.initialize_s = time.perf_counter() - t
        # (Note [Pinned at the second crossing]: what initialize pinned.)
        self.initialize_bytes_pinned = self.engine.chunks.stats()["host_bytes_pinned"]
        if rule_of_before:
            # Before issue 52: hybrid Adam preferred the device for every chunk.
            self.engine.store.adam_placement.prefer_device = lambda chunk, summing: True
        if grads_at_fold:
            # Before Note [Gradients down as they land]: each host-updated
            # chunk's gradients go down when its fold reads them.
            self.engine._overlap._send_down = lambda chunk: None
        if weights_at_step:
            # Before Note [Weights up as they are updated]: the weights a
            # chunk's update made during backward go up after the step, and
            # with accumulation those a fold gave back go up in the next
            # forward (the fold after backward, not one per chunk during it).
            overlap = self.engine._overlap
            overlap._send_up_finished = lambda: None
            overlap._send_down_and_queue = overlap._send_down
            finish = overlap.finish
            overlap.finish = lambda send_up=False: finish()  # (nor while the step waits)

    def step(self, batches):
        """As Plain.step: the engine's step() runs after the window's last
        backward (engine.step() between micro-batches only counts them)."""
        fwd = bwd = opt = 0.0
        for x, y in batches:
            t0 = time.perf_counter()
            loss = self.engine(x, y)
            t1 = time.perf_counter()
            self.engine.backward(loss)
            t2 = time.perf_counter()
            self.engine.step()
            fwd, bwd, opt = fwd + t1 - t0, bwd + t2 - t1, opt + time.perf_counter() - t2
        self.phases = (fwd, bwd, opt)

    def counters(self):
        s = self.engine.chunks.stats()
        r = self.engine.memory_report()
        return {**{k: s[k] for k in COUNTERS},
                "exposed_adam_seconds": r["optimizer"]["exposed_adam_seconds"],
                "adam_seconds": r["optimizer"]["adam_seconds"],
                "fold_worker_seconds": r["optimizer"]["fold_worker_seconds"],
                "fold_wait_seconds": r["optimizer"]["fold_wait_seconds"],
                "folds_on_worker": r["optimizer"]["folds_on_worker"],
                "sums_measured_in_folds": r["optimizer"]["sums_measured_in_folds"]}


# --compute-threads: the CPU Adam threads beside them (0: tidal's default, every core).
CPU_ADAM_THREADS = [0]


def config(batch, accumulation, chunk, budget, overlap=True):
    # (No "device" key: the engines use the simulated device set below, with its link.)
    t = {"chunk_size": chunk, "device_memory_budget": budget, "overlap_step": overlap}
    if CPU_ADAM_THREADS[0]:
        t["cpu_adam_threads"] = CPU_ADAM_THREADS[0]
    if budget:
        t["device_margin"] = budget // 20
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": accumulation,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "tidal": t}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per run per round")
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds of quiet before each round")
    common.add_compute_threads_arg(ap)
    common.add_gpt_model_args(ap)
    args = ap.parse_args()
    CPU_ADAM_THREADS[0] = common.split_cores(args.compute_threads)
    args.vocab = 1024 if args.vocab == 2048 else args.vocab
    if args.quick:
        args.rounds, args.steps, args.d, args.layers, args.vocab, args.pause = 1, 2, 64, 4, 256, 0.0
    chunk = 16 << 10 if args.quick else 64 << 10
    accum = args.accumulation

    tidal.set_device("sim", capacity="4GiB")
    torch.manual_seed(0)
    base = TinyGPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=4, seq=args.seq)
    params = sum(p.numel() for p in base.parameters())
    n_batches = accum * (3 + args.rounds * (args.steps + 3))
    data = common.token_batches(args.vocab, args.seq, args.batch, n_batches)

    # The activation peak and the chunk bytes, with everything fitting.
    probe = tidal.initialize(copy.deepcopy(base), config(args.batch, accum, chunk, 0))
    for x, y in data[:2 * accum]:
        probe.backward(probe(x, y))
        probe.step()
    activations = probe.memory_report()["peak_nonchunk_device_bytes"]
    c = probe.chunks
    p16 = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
    states = sum(c.chunk_capacity_bytes(i, k) for i in range(c.num_chunks)
                 for k in (ChunkKind.PARAM32, ChunkKind.MOMENTUM, ChunkKind.VARIANCE))
    n_chunks = c.num_chunks
    probe.remove_hooks()
    del probe
    budget = int((activations + (p16 + states) // 4) / 0.95)
    room = budget - budget // 20 - activations
    minimum = accum * (p16 - max(0, room - p16) * p16 / states)

    # The compute: plain PyTorch's step here, and the link in proportion.
    plain = Plain(copy.deepcopy(base), 1e-3)
    for i in range(2):
        plain.step(data[i * accum:(i + 1) * accum])
    # (The fastest of five: a step slowed by another process's load would set
    # the link too slow for the quiet steps that follow.)
    steps = []
    for i in range(2, 7):
        t = time.perf_counter()
        plain.step(data[i * accum:(i + 1) * accum])
        steps.append(time.perf_counter() - t)
    compute = min(steps)

    def measure(compute):
        """The contenders at the link and pinning rates set from `compute`:
        warm-up, then the timed rounds."""
        link = minimum / (LINK_SHARE * compute)
        pin = minimum / (PIN_SHARE * compute)
        device = tidal.set_device("sim", capacity="4GiB", bandwidth=f"{link:.0f}B/s", pin_bandwidth=f"{pin:.0f}B/s")
        runs = {"plain": plain,
                "tidal": Tidal(copy.deepcopy(base), config(args.batch, accum, chunk, budget), False),
                "before": Tidal(copy.deepcopy(base), config(args.batch, accum, chunk, budget), True)}
        if accum > 1:
            runs["grads_at_fold"] = Tidal(copy.deepcopy(base), config(args.batch, accum, chunk, budget),
                                          False, grads_at_fold=True)
            restoring = config(args.batch, accum, chunk, budget)
            restoring["tidal"]["fold_images"] = False
            runs["restore_at_fold"] = Tidal(copy.deepcopy(base), restoring, False)
        runs["weights_at_step"] = Tidal(copy.deepcopy(base), config(args.batch, accum, chunk, budget), False,
                                        weights_at_step=True)
        runs["no_overlap"] = Tidal(copy.deepcopy(base), config(args.batch, accum, chunk, budget, overlap=False),
                                   False)
        contenders = [k for k in runs if k != "plain"]
        first_steps, first_pinned = {}, {}
        for name in contenders:  # warm-up: the trace, the relayout, the plan, the trace again
            first_steps[name], first_pinned[name] = [], []
            for i in range(3):
                before = runs[name].counters()["host_bytes_pinned"]
                t = time.perf_counter()
                runs[name].step(data[i * accum:(i + 1) * accum])
                first_steps[name].append(time.perf_counter() - t)
                first_pinned[name].append(runs[name].counters()["host_bytes_pinned"] - before)
        samples = {k: [] for k in runs}
        phases = {k: [] for k in runs}
        steady = {k: [] for k in contenders}
        at = 3
        order = list(runs)
        for r in range(args.rounds):
            # Step by step in turn (in alternating order), not one contender's
            # steps after another's: this machine's speed drifts within a
            # run, and a drift then lands on every contender alike.
            time.sleep(args.pause)
            for s in range(args.steps + 3):
                batches = data[(at + s) * accum:(at + s + 1) * accum]
                for name in order if (r + s) % 2 == 0 else reversed(order):
                    run = runs[name]
                    before = run.counters() if name != "plain" else None
                    t0 = time.perf_counter()
                    run.step(batches)
                    # The copies the step left running (its prefetch for the
                    # next forward) land within its time, not during another
                    # contender's step: this charges an engine what its next
                    # forward might have hidden, and never flatters it.
                    device.synchronize()
                    dt = time.perf_counter() - t0
                    if s < 3:
                        continue  # the first steps of a round settle the trace again after the pause
                    samples[name].append(dt)
                    phases[name].append(run.phases)
                    if before is not None:
                        after = run.counters()
                        steady[name].append({k: after[k] - before[k] for k in after})
            at += args.steps + 3
            print(f"[engine_offload] round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {statistics.median(v[-args.steps:]) * 1e3:.1f} ms" for k, v in samples.items()),
                flush=True)
        return link, pin, runs, contenders, first_steps, first_pinned, samples, steady, phases

    # The link is set from plain PyTorch's step before the engines exist.
    # Where the rounds' plain steps run much slower or faster than that (the
    # link time of the minimum bytes outside 0.8-1.25 of LINK_SHARE of them:
    # both were seen on this machine, whose speed drifts between runs), the
    # engines go and the rounds run again with the link set from the rounds'
    # own plain median; both calibrations are recorded. (Until the step overlap's
    # worker stopped calling torch's operators, its OpenMP team slowed every
    # operator in the process once the engines existed: Note [A second
    # OpenMP team] in cpu_adam/adam.h.)
    calibrations = [{"compute_s": compute}]
    link, pin, runs, contenders, first_steps, first_pinned, samples, steady, phases = measure(compute)
    share = minimum / link / statistics.median(samples["plain"])
    calibrations[-1]["link_share_in_rounds"] = share
    if not args.quick and not 0.8 * LINK_SHARE <= share <= 1.25 * LINK_SHARE:
        compute = statistics.median(samples["plain"])
        print(f"[engine_offload] the link came out at {share:.2f} of the rounds' plain step (wanted "
              f"{LINK_SHARE:.2f}): again with the link set from the rounds' plain median "
              f"{compute * 1e3:.1f} ms", flush=True)
        for name in contenders:
            runs[name].engine.remove_hooks()
        del runs
        calibrations.append({"compute_s": compute})
        link, pin, runs, contenders, first_steps, first_pinned, samples, steady, phases = measure(compute)
        calibrations[-1]["link_share_in_rounds"] = minimum / link / statistics.median(samples["plain"])

    plain_s = common.summarize(samples["plain"])

    def phase_medians(name):
        f, b, o = (statistics.median(col) for col in zip(*phases[name]))
        return {"forward_s": f, "backward_s": b, "optimizer_step_s": o}
    link_min_s = minimum / link  # (one copy engine each way, as PCIe)
    out = {"model": {"kind": "TinyGPT", "d": args.d, "layers": args.layers, "seq": args.seq,
                     "vocab": args.vocab, "batch": args.batch, "params": params, "precision": "bf16",
                     "chunk_bytes": chunk, "chunks": n_chunks, "gradient_accumulation_steps": accum},
           "shape": {"activation_peak": activations, "param16_chunk_bytes": p16, "state_chunk_bytes": states,
                     "device_budget": budget, "chunk_room_at_peak": room,
                     "minimum_bytes_each_way": minimum},
           "simulated_link_bytes_per_s": link, "simulated_pin_bytes_per_s": pin,
           "link_share_of_compute": LINK_SHARE, "pin_share_of_compute": PIN_SHARE,
           "plain_step_s": plain_s, "plain_phases": phase_medians("plain"),
           "link_s_of_minimum": link_min_s, "calibrations": calibrations, "runs": {}, "quick": args.quick,
           "compute_threads": args.compute_threads or None, "cpu_adam_threads": CPU_ADAM_THREADS[0] or None}
    # The limit of the schedule: compute, the link time of the minimum bytes,
    # and the CPU Adam the new schedule leaves exposed.
    exposed_tidal = statistics.median(d["exposed_adam_seconds"] for d in steady["tidal"])
    limit = max(plain_s["median"], link_min_s, exposed_tidal)
    out["limit_s"] = limit
    for name in contenders:
        engine = runs[name].engine
        rep = engine.memory_report()
        common.check_budget(rep, name)
        st = steady[name]
        s = common.summarize(samples[name])
        med = {k: statistics.median(d[k] for d in st) for k in st[0]}
        hits, misses = med["prefetch_hits"], med["misses"]
        exposed = statistics.median(d["exposed_adam_seconds"] for d in st)
        out["runs"][name] = {
            "step_s": s, "over_plain": s["median"] / plain_s["median"],
            "over_limit": s["median"] / limit,
            "bytes_host_to_device_per_step": med["bytes_host_to_device"],
            "bytes_device_to_host_per_step": med["bytes_device_to_host"],
            "h2d_over_minimum": med["bytes_host_to_device"] / minimum,
            "d2h_over_minimum": med["bytes_device_to_host"] / minimum,
            "steady_prefetch_hits": hits, "steady_misses": misses,
            "steady_prefetch_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "steady_host_block_allocations": med["host_block_allocations"],
            "steady_host_bytes_pinned": med["host_bytes_pinned"], "steady_host_pins": med["host_pins"],
            "steady_pageable_copies": med["pageable_copies"],
            "steady_block_waits": med["block_waits"], "steady_copy_waits": med["copy_waits"],
            "steady_copy_wait_s": med["copy_wait_seconds"],
            "initialize_s": runs[name].initialize_s, "first_steps_s": first_steps[name],
            "initialize_bytes_pinned": runs[name].initialize_bytes_pinned,
            "first_steps_bytes_pinned": first_pinned[name],
            "step1_over_steady": first_steps[name][0] / s["median"],
            "steady_evictions": med["evictions"],
            "steady_prefetches_ahead": med["prefetches_ahead"],
            "exposed_adam_s": exposed, "adam_s": statistics.median(d["adam_seconds"] for d in st),
            "steady_images_taken_back": med["images_taken_back"],
            # Note [Images someone still wants]: host blocks made because every
            # cached one of the size was an image a fold would take back.
            "steady_blocks_for_images": med["blocks_for_images"],
            "blocks_for_images": engine.chunks.stats()["blocks_for_images"],
            "steady_folds_on_worker": med["folds_on_worker"],
            # Note [Measured in the fold]: chunks whose clip measure their fold made.
            "steady_sums_measured_in_folds": med["sums_measured_in_folds"],
            "steady_fold_worker_s": med["fold_worker_seconds"],
            "steady_fold_wait_s": med["fold_wait_seconds"],
            "budget_overruns": rep["budget_overruns"], "steady_samples": st,
            "phases": phase_medians(name),
        }
        r = out["runs"][name]
        print(f"[engine_offload] {name}: {s['median'] * 1e3:.1f} ms/step ({r['over_plain']:.2f}x plain "
              f"{plain_s['median'] * 1e3:.1f} ms, {r['over_limit']:.2f}x the limit {limit * 1e3:.1f} ms); "
              f"H2D {r['h2d_over_minimum']:.2f}x / D2H {r['d2h_over_minimum']:.2f}x the minimum; steady "
              f"prefetch hit rate {r['steady_prefetch_hit_rate']:.2f}; host blocks made "
              f"{r['steady_host_block_allocations']}, pinned {r['steady_host_bytes_pinned']:.0f} B, block waits "
              f"{r['steady_block_waits']}, copy waits "
              f"{r['steady_copy_waits']:.0f} ({r['steady_copy_wait_s'] * 1e3:.0f} ms); initialize "
              f"{r['initialize_s']:.2f} s (pinned {r['initialize_bytes_pinned']} B), step 1 "
              f"{r['step1_over_steady']:.1f}x a steady step (pinned {first_pinned[name]} B in steps 1-3)"
              + (f"; folds on the worker {r['steady_folds_on_worker']:.0f} ({r['steady_fold_worker_s'] * 1e3:.1f} ms "
                 f"there, waited {r['steady_fold_wait_s'] * 1e3:.1f} ms), images taken back "
                 f"{r['steady_images_taken_back']:.0f} (host blocks made for images {r['blocks_for_images']}, "
                 f"{r['steady_blocks_for_images']:.0f} in a steady step), sums measured in their fold "
                 f"{r['steady_sums_measured_in_folds']:.0f}" if accum > 1 else ""),
              flush=True)
        ph, pp = r["phases"], out["plain_phases"]
        print(f"[engine_offload] {name}: forward / backward / optimizer step " + " / ".join(
            f"{ph[k] * 1e3:.1f}" for k in ph) + " ms (plain " + " / ".join(f"{pp[k] * 1e3:.1f}" for k in pp) +
            " ms)", flush=True)
    name = "engine_offload" + ("-quick" if args.quick else "") + (f"-accum{accum}" if accum > 1 else "") + \
        (f"-compute{args.compute_threads}" if args.compute_threads else "")
    path = common.write_result(name, {"simulated": True, "result": out}, output=args.output)
    print(f"[engine_offload] wrote {path}")


if __name__ == "__main__":
    main()
