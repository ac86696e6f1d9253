"""deepspeed.utils (and deepspeed.utils.logging): set_z3_leaf_modules,
logger, log_dist, RepeatingLoader, and the ThroughputTimer behind
engine.tput_timer."""
from __future__ import annotations

import logging

from ..engine.external import set_leaf_modules

__all__ = ["RepeatingLoader", "ThroughputTimer", "log_dist", "logger", "set_z3_leaf_modules"]

logger = logging.getLogger("DeepSpeed")


def set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True) -> list:
    """deepspeed.utils.set_z3_leaf_modules: tidal.set_leaf_modules (every
    parameter of such a module and of its descendants comes to the device as
    one unit). Returns the modules marked."""
    try:
        return set_leaf_modules(model, leaf_module_classes)
    except ValueError as e:
        if raise_if_not_found or "no module of" not in str(e):
            raise
        return []


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """deepspeed.utils.log_dist: logs `message` on the ranks listed (all with
    None or -1 among them)."""
    from .comm import get_rank
    rank = get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


class RepeatingLoader:
    """deepspeed.utils.RepeatingLoader (deepspeed.runtime.dataloader's): an
    endless iterator over `loader`, which starts over (a new iter(loader):
    a DataLoader reshuffles as for a new epoch) each time it runs out. An
    empty loader raises StopIteration, as DeepSpeed's does.

    Args:
        loader: any iterable (a DataLoader, a list of batches).
    """

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class ThroughputTimer:
    """engine.tput_timer, as far as tidal keeps it: the epoch count a DeepSpeed
    loop advances (DeepSpeed-Chat calls update_epoch_count() after each
    epoch). DeepSpeed's engine also times its steps here; tidal does not, so
    the throughput readings are not provided (engine.memory_report() and
    tidal.profile measure tidal's runs)."""

    def __init__(self):
        self.epoch_count = 0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1

    def __getattr__(self, name):
        raise AttributeError(f"tidal.deepspeed: engine.tput_timer.{name} is not provided: tidal's "
                             f"engine does not time its steps here (engine.memory_report() and "
                             f"tidal.profile measure tidal's runs); it counts epochs only "
                             f"(update_epoch_count(), epoch_count)")
