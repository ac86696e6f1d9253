"""What the engine's steps measure, for memory_report() and the benchmarks:
the optimizer's time and where it ran, and the chunk bytes each step moved.

StepMeters is written by the step (OptimizerStep, optimizer_step.py) and read by
the reports (EngineReports, reports.py); nothing else changes it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepMeters:
    """adam_seconds: time in the step's chunk updates (CPU Adam and the
        device's), the data-parallel broadcasts between them excluded.
    exposed_adam_seconds: engine.step()'s wait for the optimizer, from the
        overlap's finish to the last update (Note [CPU Adam during backward]).
    adam_device_chunks / adam_host_chunks: chunk updates run on the device /
        on the host (those made during backward counted when validated).
    bytes_per_step: (host -> device, device -> host) chunk bytes of each step.
    disk_bytes_per_step: (read from, written to) the NVMe tier's file in each
        step, chunk bytes (Note [Chunks on NVMe: the tier]); zeros without one.
    """
    adam_seconds: float = 0.0
    exposed_adam_seconds: float = 0.0
    adam_device_chunks: int = 0
    adam_host_chunks: int = 0
    bytes_per_step: list = field(default_factory=list)
    disk_bytes_per_step: list = field(default_factory=list)
    # The scheduler's counters at the end of the last step, and those of
    # schedulers a relayout replaced (their relayout copies included).
    _at_step: "dict | None" = None
    _retired: "dict | None" = None

    def start(self, stats: dict) -> None:
        """The scheduler's counters when the engine starts."""
        self._at_step = stats

    def end_step(self, stats: dict) -> None:
        """A step ended with the scheduler's counters at `stats`."""
        self.bytes_per_step.append((stats["bytes_host_to_device"] - self._at_step["bytes_host_to_device"],
                                    stats["bytes_device_to_host"] - self._at_step["bytes_device_to_host"]))
        self.disk_bytes_per_step.append(
            (stats["bytes_disk_to_host"] - self._at_step["bytes_disk_to_host"],
             stats["bytes_host_to_disk"] - self._at_step["bytes_host_to_disk"]))
        self._at_step = stats

    def relayout(self, final: dict, stats: dict) -> None:
        """A relayout replaced the scheduler: its `final` counters stay in the
        reports, and the new one's `stats` start the next step's count."""
        self._retired = merge_stats(final, self._retired)
        self._at_step = stats

    def scheduler_stats(self, stats: dict) -> dict:
        """The live scheduler's counters `stats`, including those of
        schedulers replaced by relayout."""
        return merge_stats(stats, self._retired)


def merge_stats(now: dict, retired: "dict | None") -> dict:
    """A live scheduler's counters plus a replaced one's (peaks: the larger)."""
    if retired is None:
        return dict(now)
    out = {}
    for k, v in now.items():
        if k.startswith("peak_"):
            out[k] = max(v, retired[k])
        elif k.startswith(("resident_", "held_", "budget_")):
            out[k] = v
        else:
            out[k] = v + retired[k]
    return out
