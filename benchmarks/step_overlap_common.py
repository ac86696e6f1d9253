"""What the step-overlap benchmarks (step_overlap.py, step_overlap_clip.py,
step_overlap_idle.py) share: their options, the simulated device, the data,
the engines they build and the alternating rounds they time them in."""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tidal  # noqa: E402

__all__ = ["parse_args", "start", "token_batches", "gpt_engine", "alternating"]


def parse_args(doc: str, rounds: int, steps: int, extra=None) -> argparse.Namespace:
    """--rounds, --steps, --quick and --output (and what `extra(parser)` adds)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=steps, help="timed steps per engine and round")
    ap.add_argument("--quick", action="store_true", help="a smoke run of seconds (not tabled)")
    ap.add_argument("--output", default=None)
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def start(args, full: dict, quick: dict, quick_steps: int = 2) -> tuple[dict, int, int]:
    """Warnings off and the simulated device (8 GiB); (shape, rounds, steps):
    one round and `quick_steps` steps with --quick."""
    warnings.simplefilter("ignore")
    tidal.set_device("sim", capacity="8GiB")
    if args.quick:
        return quick, 1, quick_steps
    return full, args.rounds, args.steps


def token_batches(shape: dict, n: int) -> list:
    """`n` (tokens, tokens) pairs for TinyGPT (the targets are the inputs)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g),) * 2
            for _ in range(n)]


def gpt_engine(shape: dict, precision: str, clip: float, accumulation: int = 1, **tidal_keys):
    """A TinyGPT of `shape` (seed 0) under tidal.initialize: AdamW at lr 1e-4,
    gradient_clipping `clip`, `precision` ("fp32", "bf16" or "fp16" at loss
    scale 2^8 with hysteresis 1), `accumulation` micro-batches per step, the
    config's "tidal" block `tidal_keys`."""
    from tidal.models.gpt import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=shape["vocab"], d=shape["d"], layers=shape["layers"], heads=shape["heads"],
                    seq=shape["seq"])
    cfg = {"gradient_clipping": clip, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "gradient_accumulation_steps": accumulation, "tidal": dict(tidal_keys)}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    elif precision != "fp32":
        cfg[precision] = {"enabled": True}
    return tidal.initialize(model, cfg)


def alternating(names, rounds: int, pause: float = 1.0):
    """(round, name) for every name in every round, the order reversed every
    other round, after a pause each (a run timed right after another pays
    for the other's spinning threads)."""
    names = list(names)
    for k in range(rounds):
        for name in (names if k % 2 == 0 else names[::-1]):
            time.sleep(pause)
            yield k, name
