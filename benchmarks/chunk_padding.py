"""How much of the chunks the GPT presets' states fill: the engine's chunk layout
(chunk/chunk_layout.cpp, run through tidal.estimate, which lays the model out
with the same C++ and allocates nothing of its size) against the states' own
bytes (14 B per parameter in bf16 with fp32 moments, counted by torch on the
meta device). Writes benchmarks/results/chunk_padding-<machine>.json.

    python benchmarks/chunk_padding.py [--presets gpt-1.3b,gpt-6.7b] [--chunks 64MiB,256MiB]

padding = chunk bytes / state bytes - 1: what the host and device give the
layout beyond the states (Note [One layout, five lists]). Deterministic: no
timing, one run.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PRESETS = "gpt-125m,gpt-350m,gpt-1.3b,gpt-2.7b,gpt-6.7b,gpt-13b,gpt-20b,gpt-30b"
QUICK_PRESETS = "nano,gpt-125m"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=None, help=f"comma-separated (default {PRESETS})")
    ap.add_argument("--chunks", default="64MiB", help="comma-separated chunk sizes")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK_PRESETS}")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    from tidal import estimate
    from tidal._estimate_model import _resolve_model
    presets = (args.presets or (QUICK_PRESETS if args.quick else PRESETS)).split(",")
    rows = []
    for preset in presets:
        net, _, _ = _resolve_model(preset)
        params = sum(p.numel() for p in net.parameters())
        for chunk in args.chunks.split(","):
            e = estimate(preset, config={"bf16": {"enabled": True}, "tidal": {"chunk_size": chunk}},
                         device_memory=80 << 30, host_memory=512 << 30, measure=False, micro_batch=1)
            c = e["chunk"]
            row = {"preset": preset, "params": params, "chunk_size": c["chunk_size"], "chunks": c["chunks"],
                   "dedicated_chunks": c["dedicated_chunks"], "state_bytes": e["state_bytes"],
                   "unpadded_state_bytes": 14 * params, "padding": e["state_bytes"] / (14 * params) - 1}
            rows.append(row)
            print(f"{preset} at {chunk}: {row['padding']:.1%} padding ({c['chunks']} chunks, "
                  f"{c['dedicated_chunks']} dedicated)", flush=True)
    path = common.write_result("chunk_padding-quick" if args.quick else "chunk_padding",
                               {"quick": args.quick, "simulated": False, "rows": rows}, args.output)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
