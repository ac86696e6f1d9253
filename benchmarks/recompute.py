"""Recompute benchmark: the largest batch at a fixed activation-memory budget and
the time per sample, for no recompute, tidal.recompute (sqrt(N) segments and
the measured minimum-memory plan), tidal.recompute + offload, DTR, and
torch.utils.checkpoint per block, on a GPT-2-small-shaped and a
BERT-Large-shaped transformer (random init).

    python benchmarks/recompute.py --quick    # seconds: proves it runs (tiny models)
    python benchmarks/recompute.py            # the measurement (minutes on 2 cores)

CPU proxy (no GPU here). What "fits" means: the peak of the bytes the CPU
allocator holds during one training step, minus what it held before the step
(parameters and their gradient buffers exist before, so this is activations,
temporaries and the checkpoints kept on the "device"), read from
torch.profiler's allocation records. Host copies made by offload live in
tidal.HostBuffers, which the CPU allocator does not serve, so they do not
count, as host memory would not on a GPU. The allocations of a step are the
same at every batch >= 2, each batch-independent or proportional to the batch,
so two measured steps (batch 2 and 3) give the exact peak at any batch (see
MemoryLine; checked against a measured batch-4 step, "prediction_check") and
the largest batch under the budget. The budget is what no recompute needs at
--budget-batch samples.

Times are measured at a small batch (--time-batch); on a CPU the time per
sample hardly depends on the batch. DTR cannot be read off a line (it trades
time for memory at any batch), so it runs at the largest batch of tidal's
recompute plan with the budget as its eviction threshold (and, if its peak
passes the budget, again with its largest op working set taken off the
threshold): whether its peak stays inside the budget, and its time against
the static plan's at that same batch ("dtr_at_recompute_min_memory_batch").

Offload on the CPU uses tidal.recompute's modelled copy engine; its link
bandwidth is scaled so that copy time : compute time is what a V100 on
PCIe 3 sees in Paddle's BERT-Large figure (see "link_model" in the result).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, summarize, write_result  # noqa: E402
from dtr import GPT  # noqa: E402  -- the same transformer the DTR benchmark uses

import tidal.dtr as dtr  # noqa: E402
import tidal.recompute as rc  # noqa: E402

# Paddle's BERT-Large on one V100 32 GB (seeds/003): 23.94 sents/s x 512 tokens, AMP.
V100_BERT_LARGE_FLOPS = 23.94 * 512 * 6 * 335e6
PCIE3_BYTES_PER_S = 12e9


def workloads(quick):
    if quick:
        return {
            "gpt2_small": dict(d=64, layers=4, heads=4, vocab=256, seq=16,
                               shape="GPT 4x64, 4 heads, vocab 256, seq 16 (quick)"),
            "bert_large": dict(d=64, layers=9, heads=4, vocab=256, seq=16,
                               shape="9x64, 4 heads, vocab 256, seq 16 (quick)"),
        }
    return {
        "gpt2_small": dict(d=768, layers=12, heads=12, vocab=8192, seq=64,
                           shape="GPT-2 small shape (12 layers, d=768, 12 heads, 4x MLP), vocab 8192, seq 64"),
        "bert_large": dict(d=1024, layers=24, heads=16, vocab=8192, seq=32,
                           shape="BERT-Large shape (24 layers, d=1024, 16 heads, 4x MLP), vocab 8192, seq 32 "
                                 "(causal-mask block of benchmarks/dtr.py: same FLOPs and memory as an encoder "
                                 "block)"),
    }


def make_step(model, idx, peer_checkpoint=False):
    def step():
        model.zero_grad(set_to_none=False)  # gradient buffers exist before the step: not counted
        out = model(idx, checkpoint=peer_checkpoint)
        loss = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
    return step


def allocator_timeline(step):
    """The CPU allocator's allocations (+bytes) and frees (-bytes) during step(), in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        step()
    return [n for _, n in sorted((e.start_ns(), e.nbytes()) for e in p.profiler.kineto_results.events()
                                 if e.name() == "[memory]")]


def peak_of(timeline):
    live = peak = 0
    for n in timeline:
        live += n
        peak = max(peak, live)
    return peak


class MemoryLine:
    """Live bytes after each allocator event as fixed + batch x per-sample.

    From batch 2 and 3 the steps make the same allocations in the same order
    (batch 1 is different: some ops skip a copy there), each either the same
    size or proportional to the batch (checked on three batches in --quick), so
    event i's size at batch B is f_i + B s_i and the peak at B is
    max_i sum_{j<=i} (f_j + B s_j): exact, not a fit of two peaks (a peak can
    move from a batch-independent moment, e.g. the tied embedding's gradient,
    to an activation-bound one as the batch grows)."""

    def __init__(self, tl2, tl3):
        if len(tl2) != len(tl3):
            raise ValueError(f"the allocations at batch 2 and 3 differ ({len(tl2)} vs {len(tl3)} events)")
        self.fixed, self.per_sample = [], []
        f = s = 0
        for a, b in zip(tl2, tl3):
            f += 3 * a - 2 * b
            s += b - a
            self.fixed.append(f)
            self.per_sample.append(s)

    def peak(self, batch):
        return max([0] + [f + batch * s for f, s in zip(self.fixed, self.per_sample)])

    def fixed_at_peak(self, batch):
        i = max(range(len(self.fixed)), key=lambda i: self.fixed[i] + batch * self.per_sample[i])
        return self.fixed[i]

    def largest_batch(self, budget):
        """The largest batch whose peak is within budget (0 if none)."""
        if any(f > budget and s <= 0 for f, s in zip(self.fixed, self.per_sample)):
            return 0
        return max(0, min(int((budget - f) // s) for f, s in zip(self.fixed, self.per_sample) if s > 0))


class Config:
    """Installs one configuration on the model for the duration of a step.
    ``measure_install`` (offload): the plan used when memory is measured."""

    def __init__(self, name, install=None, peer_checkpoint=False, dtr_threshold=None, measure_install=None):
        self.name, self.install, self.peer_checkpoint, self.dtr_threshold = name, install, peer_checkpoint, \
            dtr_threshold
        self.measure_install = measure_install or install
        self.last_stats = None

    def run(self, model, idx, measure=False):
        """One step: its time, or with measure=True its allocator timeline."""
        install = self.measure_install if measure else self.install
        plan = install(model) if install else None
        try:
            step = make_step(model, idx, self.peer_checkpoint)
            with (dtr.enabled(eviction_threshold=self.dtr_threshold, evictee_minimum_size="16KiB")
                  if self.dtr_threshold is not None else contextlib.nullcontext()):
                t0 = time.perf_counter()
                timeline = allocator_timeline(step) if measure else step()
                dt = time.perf_counter() - t0
                if self.dtr_threshold is not None:
                    self.last_stats = dtr.stats()
            if plan is not None:
                self.last_stats = plan.stats()
        finally:
            if plan is not None:
                plan.remove()
        return timeline if measure else dt


def min_memory_groups(model, idx):
    """The segments tidal.recompute(memory_target="min") picks, measured on one step."""
    plan = rc(model, "auto", memory_target="min")
    try:
        make_step(model, idx)()
        return [list(s.names) for s in plan.segments], plan.stats()
    finally:
        plan.remove()


def run_workload(name, spec, args):
    torch.manual_seed(0)
    model = GPT(vocab=spec["vocab"], d=spec["d"], layers=spec["layers"], heads=spec["heads"], ctx=spec["seq"],
                dropout=0.1)
    n, tb = spec["layers"], args.time_batch
    g = torch.Generator().manual_seed(1)
    data = {b: torch.randint(0, spec["vocab"], (b, spec["seq"]), generator=g) for b in sorted({2, 3, 4, tb})}
    params = sum(p.numel() for p in model.parameters())
    make_step(model, data[tb])()  # gradient buffers (and a warm-up)
    groups, measured = min_memory_groups(model, data[tb])

    # The link model: this machine's compute rate on this model, scaled to a V100's.
    t0 = time.perf_counter()
    make_step(model, data[tb])()
    t_plain = time.perf_counter() - t0
    cpu_flops = 6 * params * tb * spec["seq"] / t_plain  # the tied head's matmul stands in for the embedding
    link = PCIE3_BYTES_PER_S * 2 * cpu_flops / V100_BERT_LARGE_FLOPS  # x2: fp32 here, fp16 there
    link_model = {"bytes_per_s": link, "cpu_model_flops_per_s": cpu_flops,
                  "rule": "12 GB/s (PCIe 3 x16) x (CPU model FLOP/s, 6 x params x tokens / one plain step, / "
                          "V100 BERT-Large FLOP/s in Paddle's figure, 23.94 sents/s x 512 tokens x 6 x 335M) "
                          "x 2 (fp32 here vs fp16 there)"}
    print(f"  {name}: plain step {t_plain:.2f}s at batch {tb} ({cpu_flops / 1e9:.1f} GFLOP/s), modelled link "
          f"{link / 1e6:.1f} MB/s, min-memory plan {len(groups)} segment(s)", flush=True)

    def offload_plan(sync):
        return lambda m: rc(m, "auto", offload=True, segments=n, offload_bandwidth=link,
                            synchronize_boundaries=sync)
    static = [
        Config("none"),
        Config("torch_checkpoint_per_block", peer_checkpoint=True),
        Config("tidal_recompute_sqrt_n", install=lambda m: rc(m, "auto")),
        Config("tidal_recompute_min_memory", install=(lambda m: rc(m, groups)) if groups else None),
        # Memory is measured with the copies synchronized at segment boundaries, so the
        # allocations come in the same order at every batch; asynchronous copies free a
        # checkpoint's device copy at the first boundary after its copy ends instead.
        Config("tidal_recompute_offload", install=offload_plan(False), measure_install=offload_plan(True)),
    ]
    out = {"shape": spec["shape"], "params": params, "seq": spec["seq"], "layers": n, "time_batch": tb,
           "min_memory_plan": {"segments": groups, "measured_at_time_batch": measured.get("measured"),
                               "estimate_bytes": measured.get("target_estimate")},
           "sqrt_n_segments": max(1, round(math.sqrt(n))), "link_model": link_model, "configs": {}}

    # Memory: allocator timelines at batch 2 and 3 -> exact peak at any batch.
    lines = {}
    for cfg in static:
        tl = {b: cfg.run(model, data[b], measure=True) for b in (2, 3)}
        lines[cfg.name] = MemoryLine(tl[2], tl[3])
        out["configs"][cfg.name] = {"peak_bytes": {str(b): peak_of(v) for b, v in tl.items()}}
    budget = lines["none"].peak(args.budget_batch)
    out["budget_bytes"] = budget
    out["budget_rule"] = f"no recompute's peak at batch {args.budget_batch}"
    for cfg in static:
        out["configs"][cfg.name]["largest_batch"] = lines[cfg.name].largest_batch(budget)
    if args.quick or name == args.check:
        check = "tidal_recompute_min_memory"
        measured4 = peak_of(static[3].run(model, data[4], measure=True))
        out["prediction_check"] = {"config": check, "batch": 4, "predicted_peak_bytes": lines[check].peak(4),
                                   "measured_peak_bytes": measured4, "exact": lines[check].peak(4) == measured4}

    # Time: round-robin so load drift on a shared machine hits all alike (the memory
    # runs above were every configuration's warm-up).
    samples = {c.name: [] for c in static}
    for _ in range(args.repeat):
        for cfg in static:
            samples[cfg.name].append(cfg.run(model, data[tb]))
    t_none, t_none_min = statistics.median(samples["none"]), min(samples["none"])
    b_none = out["configs"]["none"]["largest_batch"]
    for cfg in static:
        c = out["configs"][cfg.name]
        s = samples[cfg.name]
        c["step_s"] = {"samples": s, **summarize(s)}
        c["time_per_sample_s"] = c["step_s"]["median"] / tb
        c["speed_vs_none"] = t_none / c["step_s"]["median"]
        c["speed_vs_none_of_minimums"] = t_none_min / c["step_s"]["min"]  # robust to load bursts
        c["batch_growth_vs_none"] = c["largest_batch"] / b_none if b_none else None
        if cfg.last_stats is not None:
            c["plan_stats"] = {k: v for k, v in cfg.last_stats.items() if k != "measured"}
        print(f"  {name} {cfg.name}: largest batch {c['largest_batch']} ({c['batch_growth_vs_none']:.2f}x), "
              f"{c['time_per_sample_s']:.3f} s/sample ({c['speed_vs_none']:.2f}x speed; "
              f"{c['speed_vs_none_of_minimums']:.2f}x on minimums)", flush=True)
    # DTR at tidal's recompute batch under the same budget, against the static plan at
    # that same batch: does it fit there, and how fast is it.
    ref = "tidal_recompute_min_memory"
    batch = out["configs"][ref]["largest_batch"]
    if batch > tb:
        data[batch] = torch.randint(0, spec["vocab"], (batch, spec["seq"]), generator=g)
        dcfg = Config("dtr", dtr_threshold=budget)
        same = next(c for c in static if c.name == ref)
        c = {"batch": batch, "static_plan": ref, "attempts": []}
        try:
            # DTR keeps tracked bytes <= threshold + the working set of the op running
            # (inputs and outputs it pins). First the budget as threshold; if the peak
            # passes the budget, again with the working set taken off.
            for _ in range(2):
                peak = peak_of(dcfg.run(model, data[batch], measure=True))  # also the warm-up
                st = dcfg.last_stats
                c["attempts"].append(dict(
                    eviction_threshold=dcfg.dtr_threshold, peak_bytes=peak, fits=peak <= budget,
                    dtr_peak_tracked_bytes=st["peak_tracked_bytes"], max_op_working_set=st["max_op_working_set"],
                    evictions=st["evictions"], recomputes=st["recomputes"],
                    recompute_seconds=st["recompute_seconds"]))
                if peak <= budget or budget - st["max_op_working_set"] <= 0:
                    break
                dcfg.dtr_threshold = budget - st["max_op_working_set"]
            c.update(c["attempts"][-1])
            ds, ss = [], []
            for _ in range(args.dtr_repeat):
                ds.append(dcfg.run(model, data[batch]))
                ss.append(same.run(model, data[batch]))
            c.update(step_s={"samples": ds, **summarize(ds)}, time_per_sample_s=statistics.median(ds) / batch,
                     static_plan_step_s={"samples": ss, **summarize(ss)},
                     static_plan_time_per_sample_s=statistics.median(ss) / batch,
                     time_vs_static_plan=statistics.median(ds) / statistics.median(ss))
        except Exception as e:  # noqa: BLE001  DTR may not keep inside the threshold: a result
            c.update(fits=False, error=f"{type(e).__name__}: {e}")
        out["configs"][f"dtr_at_{ref.replace('tidal_', '')}_batch"] = c
        print(f"  {name} DTR at batch {batch}: "
              + (f"threshold {c['eviction_threshold'] / 2**20:.1f} MiB, peak {c['peak_bytes'] / 2**20:.1f} MiB of "
                 f"{budget / 2**20:.1f} "
                 f"({'fits' if c['fits'] else 'does not fit'}), {c['time_per_sample_s']:.3f} s/sample, "
                 f"{c['time_vs_static_plan']:.2f}x the static plan's time at that batch" if "step_s" in c
                 else c["error"][:200]), flush=True)
    cs = out["configs"]
    rec, off = cs["tidal_recompute_min_memory"], cs["tidal_recompute_offload"]
    out["paddle_comparison"] = {
        "paddle_bert_large_v100": {"recompute_batch_growth": 180 / 18, "offload_batch_growth_over_recompute": 258 / 180,
                                   "recompute_speed": 17.82 / 23.94, "offload_speed": 15.47 / 23.94},
        "tidal_cpu_proxy": {"recompute_batch_growth": rec["batch_growth_vs_none"],
                            "offload_batch_growth_over_recompute":
                                off["largest_batch"] / rec["largest_batch"] if rec["largest_batch"] else None,
                            "recompute_speed": rec["speed_vs_none"], "offload_speed": off["speed_vs_none"],
                            "recompute_speed_of_minimums": rec["speed_vs_none_of_minimums"],
                            "offload_speed_of_minimums": off["speed_vs_none_of_minimums"]},
    }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, one repeat (seconds)")
    parser.add_argument("--output", default=None,
                        help="result path (default benchmarks/results/recompute-<machine>.json)")
    parser.add_argument("--only", default=None, help="run one workload: gpt2_small or bert_large")
    parser.add_argument("--repeat", type=int, default=4, help="timed rounds (full mode)")
    parser.add_argument("--time-batch", type=int, default=2, help="batch of the timed steps (>= 2)")
    parser.add_argument("--budget-batch", type=int, default=2, help="the budget is no recompute's peak at this batch")
    parser.add_argument("--check", default="gpt2_small",
                        help="workload whose batch-4 peak is measured against the prediction (--quick: all)")
    parser.add_argument("--dtr-repeat", type=int, default=2,
                        help="timed DTR steps (and as many of the static plan) at the recompute batch")
    args = parser.parse_args()
    if args.quick:
        args.repeat = args.dtr_repeat = 1
    info = machine_info()
    payload = {
        "proxy_note": ("CPU proxy: no GPU on this machine. 'Fits' = peak bytes held by the CPU allocator during "
                       "a training step minus what it held before (parameters and gradient buffers exist before: "
                       "activations, temporaries and device-side checkpoints count; offloaded host copies live in "
                       "tidal.HostBuffers and do not), from torch.profiler's allocation records at batch 2 and 3, "
                       "from which the peak at any batch follows event by event (prediction_check: a measured "
                       "batch-4 step). Times "
                       "are CPU step times at the timing batch, where a recompute costs far more relative to "
                       "memory traffic than on a GPU. Offload runs on tidal.recompute's modelled copy engine "
                       "(a worker thread; link bandwidth in link_model).") if not info["gpus"] else "GPU run",
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "workloads": {},
    }
    t0 = time.perf_counter()
    for name, spec in workloads(args.quick).items():
        if args.only and name != args.only:
            continue
        print(f"{name} ...", flush=True)
        payload["workloads"][name] = run_workload(name, spec, args)
    payload["total_seconds"] = time.perf_counter() - t0
    path = write_result("recompute-quick" if args.quick else "recompute", payload, args.output, info)
    print(f"wrote {path} ({payload['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
