"""The largest-batch search that dtr_batch.py, engine_batch.py,
engine_dtr_batch.py and engine_arbiter.py share: the search over batch sizes,
the log of its trials, a training trial under the engine that says whether a
batch fits, and the timing rounds in alternating order.

A batch fits when its training steps finish with no tidal.OutOfMemoryError
and the benchmark's own criterion holds (most: common.budget_kept, no overrun
and the engine's peak within the budget less the margin). Fits must be
monotonic in the batch for the search to be right; engine_dtr_batch.py checks
that they are.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Union

import common

__all__ = ["alternating", "engine_trial", "fits_unless_oom", "largest", "logged", "train_engine"]

# What a trial under the engine keeps of memory_report()["dtr"].
DTR_KEYS = ("evictions", "recomputes", "recompute_seconds", "chunk_evictions")


def largest(fits: Callable[[int], bool], cap: int, *, start: int = 1, within: Optional[int] = None) -> int:
    """The largest batch b <= cap with fits(b), fits being monotonic.

    Doubles from `start` while the batch fits (halving from it while it does
    not, when `start` itself fails), then bisects between the last batch that
    fit and the first that did not.

    Args:
        fits: whether a batch trains (each call is one trial).
        cap: the largest batch tried; a result of `cap` or its last doubling
            below it is a lower bound.
        start: the first batch tried.
        within: stop bisecting when the gap is at most 1/within of the batch
            that fits (fewer trials); None bisects to the exact batch.
    """
    lo, hi = 0, None
    b = start
    while b <= cap:
        if fits(b):
            lo = b
            b *= 2
        else:
            hi = b
            break
    if lo == 0:
        hi = start
        b = start // 2
        while b >= 1 and not fits(b):
            hi = b
            b //= 2
        lo = max(b, 0)
    if hi is None:
        return lo  # fits up to the cap
    while hi - lo > (max(1, lo // within) if within else 1):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def logged(trial: Callable[[int], Union[bool, Dict]], trials: List[Dict], label: str) -> Callable[[int], bool]:
    """fits(b) for :func:`largest` from trial(b): a record with "fits" (and
    "why" when it does not fit), or whether it fits (recorded as {"batch": b,
    "fits": ...}). Each record is appended to `trials` and printed after `label`."""
    def fits(b: int) -> bool:
        r = trial(b)
        if isinstance(r, bool):
            r = {"batch": b, "fits": r}
        trials.append(r)
        print(f"{label} batch {b:4d}: {'fits' if r['fits'] else 'does not fit'}"
              + ("" if r["fits"] or "why" not in r else f" ({r['why'][:100]})"), flush=True)
        return r["fits"]
    return fits


def fits_unless_oom(run: Callable[[int], Dict], criterion: Callable[[Dict], bool]) -> Callable[[int], bool]:
    """fits(b): run(b) gives an engine's memory report; False on
    tidal.OutOfMemoryError, else criterion(report)."""
    import tidal

    def fits(b: int) -> bool:
        try:
            report = run(b)
        except tidal.OutOfMemoryError:
            return False
        return criterion(report)
    return fits


def train_engine(make_model: Callable, config: Dict, batches, before_remove: Optional[Callable] = None) -> tuple:
    """Trains make_model() (made after torch.manual_seed(0)) under
    tidal.initialize(model, config), one step per (input, target) batch, in
    this process: (seconds per step, losses, memory_report()). The engine's
    hooks are removed after, `before_remove` called first."""
    import torch

    import tidal
    torch.manual_seed(0)
    engine = tidal.initialize(make_model(), config)
    try:
        times, losses = common.timed_engine_steps(engine, batches)
        return times, losses, engine.memory_report()
    finally:
        if before_remove is not None:
            before_remove()
        engine.remove_hooks()
        gc.collect()


def engine_trial(out: Dict, model, data: list, loss_of: Callable, config: Dict,
                 report_keys: Iterable[str] = (), dtr_keys: Iterable[str] = DTR_KEYS) -> Dict:
    """One trial for a search whose trials run in fresh processes (see
    common.run_child): trains `model` under tidal.initialize(model, config),
    one step per batch of `data` (loss_of(engine, batch) gives the loss), and
    adds to `out` whether it fits (common.budget_kept), the timed steps (all
    but the first) and the memory report's figures: its peak, overruns, budget
    and margin, chunk evictions, `report_keys`, and `dtr_keys` of its "dtr"."""
    import tidal
    try:
        engine = tidal.initialize(model, config)
        times = []
        for b in data:
            t0 = time.perf_counter()
            engine.backward(loss_of(engine, b))
            engine.step()
            times.append(time.perf_counter() - t0)
        r = engine.memory_report()
        ok = common.budget_kept(r)
        out.update(fits=ok, step_seconds=times[1:], peak_device_bytes=r["peak_device_bytes"],
                   budget_overruns=r["budget_overruns"], device_budget=r["device_budget"],
                   device_margin=r["device_margin"], chunk_evictions=r["evictions"],
                   **{k: r[k] for k in report_keys}, dtr={k: r["dtr"][k] for k in dtr_keys})
        if not ok:
            out["why"] = "overrun or peak past the budget"
    except tidal.OutOfMemoryError as e:
        out.update(fits=False, why=str(e)[:300])
    return out


def alternating(modes: Iterable[str], rounds: int, skip: Iterable[str] = (), pause: float = 1.0) -> Iterator[str]:
    """The modes to time, `rounds` times, in reversed order every other round,
    with a pause before each so that no mode pays for the previous one's
    threads; a mode in `skip` (read as the rounds go) is passed over."""
    modes = tuple(modes)
    for k in range(rounds):
        for mode in (modes if k % 2 == 0 else tuple(reversed(modes))):
            if mode in skip:
                continue
            time.sleep(pause)
            yield mode
