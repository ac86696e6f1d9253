"""16-bit chunks that forward only read, leaving the device without a copy
(Note [A clean chunk goes down without a copy] in
runtime/scheduler/chunk_scheduler.h; issue 52, bytes each way and waits)
against every move down copying (tidal.skip_clean_copies false: the
scheduler before), in the same run. Writes
benchmarks/results/clean_down-<machine>.json.

    python benchmarks/clean_down.py [--rounds 3] [--steps 10]
        [--links 2GB/s,1GB/s,500MB/s] [--quick]

The shape of benchmarks/evict_ahead.py (step_overlap_clip's GPT: TinyGPT
vocab 8192, d 256, 8 layers, 1 MiB chunks, bf16, clipping 1.0, chunk room
beside the measured activation peak for a quarter of the 16-bit chunks):
in every steady step forward brings up all the 16-bit chunks the host
updated and evicts most of them again as the activations grow; backward
brings those back and sends their gradients down. On each simulated link
rate (each way) the two engines run in alternating order over rounds,
beside the engine where everything fits.

Per engine and steady step (the steps after the fourth): the step time, the
bytes each way, the copies down skipped and their bytes, the evictions, and
the seconds the hook's thread waited for a block's copy down
(block_wait_seconds) and for a copy up (copy_wait_seconds). Every engine's
losses and fp32 weights must be the bits of the engine where everything
fits, and its budget kept (0 overruns), or the benchmark fails. A result on
the simulated device checks the scheduling (bytes, and what waits on this
link), not a GPU's speed.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from common import summarize, write_result
from evict_ahead import BATCH, D, LAYERS, SEQ, VOCAB, WARM, fits_step_seconds, run_engine, summary, the_shape
from step_overlap_common import alternating


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    links = [link.strip() for link in args.links.split(",") if link.strip()]
    model, batches, reference, budget, activations, p16 = the_shape(args.steps)

    fits_steps = []
    runs = {link: {"copies": [], "clean": []} for link in links}
    contenders = ["fits"] + [(link, name) for link in links for name in ("copies", "clean")]
    for r, contender in alternating(contenders, args.rounds):
        if contender == "fits":
            fits_steps += fits_step_seconds(model, batches)
            continue
        link, name = contender
        runs[link][name].append(run_engine(model, batches, budget, link, True, reference,
                                           f"{link} {name} round {r}", skip_clean_copies=name == "clean"))

    fits_median = statistics.median(fits_steps)
    results = {}
    for link in links:
        copies, clean = summary(runs[link]["copies"]), summary(runs[link]["clean"])
        results[link] = {
            "copies": copies, "clean": clean,
            "step_clean_over_copies": clean["step_s"]["median"] / copies["step_s"]["median"],
            "clean_over_fits": clean["step_s"]["median"] / fits_median,
            "copies_over_fits": copies["step_s"]["median"] / fits_median,
            "bytes_down_clean_over_copies": clean["bytes_device_to_host_per_step"]
            / copies["bytes_device_to_host_per_step"],
            "raw": runs[link],
        }
        print(f"{link}: step {clean['step_s']['median'] * 1e3:.0f} ms clean, "
              f"{copies['step_s']['median'] * 1e3:.0f} ms copying ({fits_median * 1e3:.0f} ms where everything "
              f"fits); MB down per step {clean['bytes_device_to_host_per_step'] / 1e6:.1f} against "
              f"{copies['bytes_device_to_host_per_step'] / 1e6:.1f} ({clean['copies_down_skipped_per_step']:.1f} "
              f"copies skipped), up {clean['bytes_host_to_device_per_step'] / 1e6:.1f} against "
              f"{copies['bytes_host_to_device_per_step'] / 1e6:.1f}; block waits per step "
              f"{clean['block_waits_per_step']:.1f} ({clean['block_wait_seconds_per_step'] * 1e3:.1f} ms) against "
              f"{copies['block_waits_per_step']:.1f} ({copies['block_wait_seconds_per_step'] * 1e3:.1f} ms)",
              flush=True)
    path = write_result("clean_down", {
        "quick": args.quick,
        "shape": {"vocab": VOCAB, "d": D, "layers": LAYERS, "seq": SEQ, "batch": BATCH, "chunk_size": "1MiB",
                  "dtype": "bf16", "gradient_clipping": 1.0, "device_budget": budget,
                  "activation_peak_bytes": activations, "param16_chunk_bytes": p16},
        "rounds": args.rounds, "steps": args.steps, "warmup_steps": WARM,
        "fits_step_s": summarize(fits_steps), "fits_step_s_raw": fits_steps,
        "links": results,
    }, output=args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
