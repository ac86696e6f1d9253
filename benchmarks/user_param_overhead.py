"""What the engine's parameter classes cost a torch call that gets a
parameter (issue 53: <= 1 us over plain nn.Parameter objects inside a forward).

Inside a forward (the case that matters: every layer's every call): a model
whose forward calls F.linear(x, self.weight, self.bias) n times, as plain
PyTorch (the peer) and trained by a tidal engine (everything fits, the
simulated device), both under no_grad. The per-call cost is the slope
between n = --calls and n = 2 x --calls, so the hooks' cost per forward,
which is not per call, drops out. (Note [Plain classes inside a forward] in
tidal/engine/user_param.py: the parameters have their own class there.) A
third contender runs the engine's loop with the simulated device's
allocation meter off, to tell its cost (the simulated device counts torch's
CPU allocations while a forward runs; a GPU's meter reads torch's
allocator instead) from the parameters'.

Outside a forward, for reference: the same F.linear over parameters of the
engine's subclass owned by no engine, the path a script's call between
steps takes before it finds nothing to bring in.

Each sample times one forward after a pause; the contenders alternate, over
`--rounds` rounds. One thread. Writes
benchmarks/results/user_param_overhead-<machine>.json.

  python benchmarks/user_param_overhead.py [--quick]
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import summarize, write_result  # noqa: E402

import tidal  # noqa: E402
from tidal import _C  # noqa: E402
from tidal.engine import user_param  # noqa: E402


class Repeat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x, n: int, uncounted: bool = False):
        f = torch.nn.functional.linear
        w, b = self.lin.weight, self.lin.bias
        self.seen_class = type(w).__name__
        if uncounted:  # (the simulated device's allocation meter off for the loop)
            _C.chunks.enter_uncounted()
        try:
            for _ in range(n):
                f(x, w, b)
        finally:
            if uncounted:
                _C.chunks.exit_uncounted()
        return x


def time_forward(call, x, n: int) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        call(x, n)
        return time.perf_counter() - t0


class MeterOff:
    """The engine's forward with the simulated device's meter off for the loop."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, x, n):
        return self.engine(x, n, True)


def outside_sample(layer, x, calls: int) -> float:
    f = torch.nn.functional.linear
    t0 = time.perf_counter()
    for _ in range(calls):
        f(x, layer.weight, layer.bias)
    return (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--pause", type=float, default=0.05)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls = 3, 50
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    tidal.set_device("sim", capacity="1GiB")
    plain = Repeat()
    engine = tidal.initialize(copy.deepcopy(plain), {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "tidal": {"device": "sim"}})
    with torch.no_grad():
        engine(x, 1)
    contenders = {"plain_parameter": plain, "tidal_engine": engine,
                  "tidal_engine_sim_meter_off": MeterOff(engine)}
    n1, n2 = args.calls, 2 * args.calls
    forwards = {k: {n1: [], n2: []} for k in contenders}
    for call in contenders.values():
        time_forward(call, x, n2)  # warm-up
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(list(contenders)))
        for name in order:
            for n in (n1, n2):
                time.sleep(args.pause)
                forwards[name][n].append(time_forward(contenders[name], x, n))
    # The per-call cost: the slope, from each round's pair of forwards.
    slopes = {k: [(b - a) / (n2 - n1) for a, b in zip(v[n1], v[n2])] for k, v in forwards.items()}
    us = {k: {m: (v * 1e6 if m != "n" else v) for m, v in summarize(s).items()} for k, s in slopes.items()}

    outside = torch.nn.Linear(64, 64)
    for p in (outside.weight, outside.bias):
        p.__class__ = user_param._class_for(type(p))
    out_samples = {"plain_parameter": [], "tidal_parameter_class": []}
    layers = {"plain_parameter": plain.lin, "tidal_parameter_class": outside}
    for r in range(args.rounds):
        for name in (list(layers) if r % 2 == 0 else list(reversed(layers))):
            time.sleep(args.pause)
            out_samples[name].append(outside_sample(layers[name], x, args.calls))
    out_us = {k: {m: (v * 1e6 if m != "n" else v) for m, v in summarize(s).items()}
              for k, s in out_samples.items()}
    result = {
        "quick": args.quick, "op": "torch.nn.functional.linear(x[8, 64], weight[64, 64], bias[64])",
        "threads": 1, "rounds": args.rounds, "calls_per_forward": [n1, n2], "pause_s": args.pause,
        "order": "alternating, a pause before each sample",
        "inside_forward": {
            "what": "per-call slope between forwards of n1 and n2 calls, under no_grad",
            "parameter_class_inside_forward": engine.module.seen_class,
            "microseconds_per_call": us,
            # The fastest forward of n2 calls, per call (the hooks' cost per
            # forward included, spread over n2 calls): the least noisy figure.
            "best_microseconds_per_call": {k: min(v[n2]) / n2 * 1e6 for k, v in forwards.items()},
            "added_microseconds_median": us["tidal_engine"]["median"] - us["plain_parameter"]["median"],
            "ratio_median": us["tidal_engine"]["median"] / us["plain_parameter"]["median"],
            # The simulated device counts torch's CPU allocations while a
            # forward runs (its memory meter; hooks/host_allocation_counter.h):
            # a cost per allocating call that a GPU's meter does not have.
            "added_microseconds_median_sim_meter_off":
                us["tidal_engine_sim_meter_off"]["median"] - us["plain_parameter"]["median"],
            "best_added_microseconds": (min(forwards["tidal_engine"][n2]) -
                                        min(forwards["plain_parameter"][n2])) / n2 * 1e6,
            "goal_added_microseconds": 1.0,
        },
        "outside_forward_subclass_no_engine": {
            "microseconds_per_call": out_us,
            "added_microseconds_median":
                out_us["tidal_parameter_class"]["median"] - out_us["plain_parameter"]["median"],
        },
    }
    engine.remove_hooks()
    path = write_result("user_param_overhead", result, args.output)
    print({k: round(v["median"], 2) for k, v in us.items()},
          f"added {result['inside_forward']['added_microseconds_median']:.2f} us inside a forward "
          f"({result['inside_forward']['added_microseconds_median_sim_meter_off']:.2f} us with the "
          f"simulated device's meter off; best {result['inside_forward']['best_added_microseconds']:.2f} us); "
          f"outside {result['outside_forward_subclass_no_engine']['added_microseconds_median']:.2f} us; "
          f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
