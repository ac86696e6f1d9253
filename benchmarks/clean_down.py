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

import sys

from common import write_result
from evict_ahead import measure, parse_args


def main():
    args, links = parse_args(__doc__)
    results, fits_median, record = measure(args, links, {"copies": {"skip_clean_copies": False}, "clean": {}})
    for link in links:
        p = results[link]
        copies, clean = p["copies"], p["clean"]
        p["step_clean_over_copies"] = clean["step_s"]["median"] / copies["step_s"]["median"]
        p["bytes_down_clean_over_copies"] = (clean["bytes_device_to_host_per_step"]
                                             / copies["bytes_device_to_host_per_step"])
        print(f"{link}: step {clean['step_s']['median'] * 1e3:.0f} ms clean, "
              f"{copies['step_s']['median'] * 1e3:.0f} ms copying ({fits_median * 1e3:.0f} ms where everything "
              f"fits); MB down per step {clean['bytes_device_to_host_per_step'] / 1e6:.1f} against "
              f"{copies['bytes_device_to_host_per_step'] / 1e6:.1f} ({clean['copies_down_skipped_per_step']:.1f} "
              f"copies skipped), up {clean['bytes_host_to_device_per_step'] / 1e6:.1f} against "
              f"{copies['bytes_host_to_device_per_step'] / 1e6:.1f}; block waits per step "
              f"{clean['block_waits_per_step']:.1f} ({clean['block_wait_seconds_per_step'] * 1e3:.1f} ms) against "
              f"{copies['block_waits_per_step']:.1f} ({copies['block_wait_seconds_per_step'] * 1e3:.1f} ms)",
              flush=True)
    print(f"wrote {write_result('clean_down', record, output=args.output)}")


if __name__ == "__main__":
    sys.exit(main())
