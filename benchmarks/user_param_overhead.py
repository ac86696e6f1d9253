"""What Note [A parameter object stays the user's] costs a torch call that gets
a parameter: F.linear over an nn.Linear's weight and bias as plain
nn.Parameter objects (the peer), and as the subclass an engine gives them
(tidal/engine/user_param.py), in the same run.

The subclass's parameters are owned by no engine here, so every call takes
the path a call inside a forward takes (the __torch_function__ runs, finds
nothing to bring in, and calls torch). Each sample times `--calls` calls after
a pause; the contenders alternate, over `--rounds` rounds. One thread.
Writes benchmarks/results/user_param_overhead-<machine>.json.

  python benchmarks/user_param_overhead.py [--quick]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import summarize, write_result  # noqa: E402

from tidal.engine import user_param  # noqa: E402


def sample(layer, x, calls: int) -> float:
    f = torch.nn.functional.linear
    t0 = time.perf_counter()
    for _ in range(calls):
        f(x, layer.weight, layer.bias)
    return (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--pause", type=float, default=0.05)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls = 3, 50
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    plain = torch.nn.Linear(64, 64)
    tidal_class = torch.nn.Linear(64, 64)
    for p in (tidal_class.weight, tidal_class.bias):
        p.__class__ = user_param._class_for(type(p))
    contenders = {"plain_parameter": plain, "tidal_parameter_class": tidal_class}
    samples = {k: [] for k in contenders}
    for layer in contenders.values():
        sample(layer, x, args.calls)  # warm-up
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            time.sleep(args.pause)
            samples[name].append(sample(contenders[name], x, args.calls))
    us = {k: {m: (v * 1e6 if m != "n" else v) for m, v in summarize(s).items()} for k, s in samples.items()}
    result = {
        "quick": args.quick, "op": "torch.nn.functional.linear(x[8, 64], weight[64, 64], bias[64])",
        "threads": 1, "rounds": args.rounds, "calls_per_sample": args.calls, "pause_s": args.pause,
        "order": "alternating, a pause before each sample",
        "microseconds_per_call": us,
        "best_microseconds_per_call": {k: min(s) * 1e6 for k, s in samples.items()},
        "added_microseconds_median": us["tidal_parameter_class"]["median"] - us["plain_parameter"]["median"],
        "ratio_median": us["tidal_parameter_class"]["median"] / us["plain_parameter"]["median"],
    }
    path = write_result("user_param_overhead", result, args.output)
    print({k: round(v["median"], 2) for k, v in us.items()}, f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
