"""What the engine reports: memory_report(), the memory timeline and profile,
parameters_fp32().

EngineReports reads the engine's parts and changes none of them: the Engine
builds it in _setup and its public methods of these names delegate to it."""
from __future__ import annotations

from typing import Callable

import torch

from .. import _C
from .. import dtr as _dtr

__all__ = ["EngineReports"]


class EngineReports:
    """The engine's reports, over the parts it reads.

    What it reads is passed in, never the engine.

    Args:
        store: the ParamStore (its chunk scheduler is read through it, as a
            relayout replaces it).
        params: the ParamTable (the names of modules and records).
        tracer: the memory tracer (the timeline and peaks).
        meters: the StepMeters.
        step: the OptimizerStep (its step counts and loss scale, read when a
            report is made).
        overlap: the StepOverlap, None without tidal.overlap_step.
        overlap_step_off: why the step is not overlapped, or None.
        dp, dp_step: the process group and the ChunkDataParallel; None
            without data parallel.
        dtr: the DtrLink.
        cuda, cuda_room, sim_caching: the device facts.
        settle_overlap: takes back the chunk updates no step has validated
            before the masters are read (Note [Speculative updates and their
            undo]).
    """

    def __init__(self, *, store, params, tracer, meters, step, overlap,
                 overlap_step_off: "str | None", dp, dp_step, dtr, cuda: bool, cuda_room: bool,
                 sim_caching: bool, settle_overlap: Callable[[], None]):
        self._store = store
        self._params = params
        self._tracer = tracer
        self._meters = meters
        self._overlap = overlap
        self._overlap_step_off = overlap_step_off
        self._dp = dp
        self._dp_step = dp_step
        self._dtr = dtr
        self._cuda = cuda
        self._cuda_room = cuda_room
        self._sim_caching = sim_caching
        self._step = step
        self._settle_overlap = settle_overlap

    def memory_timeline(self) -> list[tuple]:
        """Device memory at every hook of the last completed step: tuples of
        (point, hook name, chunk bytes held, non-chunk peak since the previous
        point, device budget). Hook names start with fwd/bwd/grad/step."""
        budget = self._store.device_budget
        out = []
        for k, kind, what, held, peak, _ in self._tracer.timeline:
            out.append((k, self.hook_name(kind, what), held, peak, budget))
        return out

    def hook_name(self, kind, what) -> str:
        """The name of a trace point: its kind, and the record or module it was at."""
        if what < 0:
            return kind
        if kind == "grad":
            return f"{kind} {self._params.record_list[what].name}"
        module = self._params.module_list[what]
        return f"{kind} {self._params.name(module)}"

    def memory_profile(self) -> list[dict]:
        """memory_timeline() as dicts, with the chunk traffic of each interval:
        the moves host->device and device->host and the evictions since the
        previous trace point (the first point counts from the previous step's
        last one, which closes that step after its optimizer step: the
        intervals hold every move of the step)."""
        budget = self._store.device_budget
        out = []
        prev = self._tracer.timeline_base
        for k, kind, what, held, peak, moves in self._tracer.timeline:
            out.append({"moment": k, "hook": self.hook_name(kind, what), "chunk_bytes": held,
                        "non_chunk_bytes": peak, "budget": budget,
                        "h2d_moves": moves[0] - prev[0], "d2h_moves": moves[1] - prev[1],
                        "evictions": moves[2] - prev[2]})
            prev = moves
        return out

    def export_memory_profile(self, directory, title=None) -> dict:
        """Writes the last step's memory profile to `directory`: memory_profile.json
        (memory_profile() with the budget, margin and report) and memory_profile.png
        (chunks / non-chunk / free per hook, the budget line, chunk moves and
        evictions marked). Returns {"json": path, "png": path, ...drawing facts}."""
        import json
        import pathlib

        from ..profile import plot_memory_profile

        store = self._store
        profile = self.memory_profile()
        if not profile:
            raise ValueError("no memory profile yet: train at least one step (engine.step()) first")
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        report = {k: v for k, v in self.memory_report().items() if k not in ("scheduler", "host")}
        doc = {"device_budget": store.device_budget, "device_margin": store.margin,
               "backend": store.backend, "points": profile, "report": report}
        json_path = directory / "memory_profile.json"
        json_path.write_text(json.dumps(doc, indent=1, default=str))
        png = directory / "memory_profile.png"
        drawn = plot_memory_profile(profile, png, title=title or
                                    f"tidal: device memory over one step ({store.backend})")
        return {"json": str(json_path), "png": str(png), **drawn}

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Host copies of the fp32 master weights (16-bit values for frozen params), by name."""
        self._settle_overlap()
        with _dtr.outside():
            return {r.name: self._store.gather(r) for r in self._params.records}

    def memory_report(self) -> dict:
        store = self._store
        tracer = self._tracer
        meters = self._meters
        overlap = self._overlap
        # The scheduler's counters, including those of schedulers replaced by relayout.
        s = meters.scheduler_stats(store.chunks.stats())
        hits = s["prefetch_hits"]
        misses = s["misses"]
        steps = meters.bytes_per_step
        step = self._step
        global_steps, skipped_steps, loss_scale = step.global_steps, step.skipped_steps, step.scaler.scale
        dp = self._dp
        disk = store.chunks.disk
        return {
            "backend": store.backend,
            "device_budget": store.device_budget,
            "device_margin": store.margin,
            "peak_chunk_device_bytes": s["peak_resident_bytes_device"],
            "peak_nonchunk_device_bytes": tracer.peak_nonchunk,
            "peak_device_bytes": tracer.peak_total,
            # Note [Who owns a device byte]: what the device's allocator held
            # at its worst moment (torch's reserved bytes on a GPU; the caching
            # allocator model's on the simulated device with
            # tidal.simulated_allocator on), chunk blocks included; 0 where
            # nothing reserves beyond what is allocated (the exact simulated
            # device, whose peak_device_bytes is both).
            "peak_reserved_device_bytes": tracer.peak_reserved,
            "room_on_cache_miss": dict(_C.chunks.cuda_room_counts()) if self._cuda_room else
            dict(_C.chunks.host_allocation_model_use()) if self._sim_caching else None,
            "simulated_allocator": None if self._cuda else
            "torch_caching" if self._sim_caching else "exact",
            "peak_chunk_host_bytes": s["peak_resident_bytes_host"],
            "host_chunk_capacity_bytes": store.capacity_bytes()[0],
            "chunk_spills_to_device": s["spills"],
            "state_bytes_per_param": store.state_bytes_per_param(),
            "largest_model_params": store.largest_model_params(),
            "host": dict(_C.host_memory_stats()),
            "bytes_host_to_device_last_step": steps[-1][0] if steps else 0,
            "bytes_device_to_host_last_step": steps[-1][1] if steps else 0,
            "evictions": s["evictions"],
            # Note [A clean chunk goes down without a copy]: moves down that
            # took back the host block instead of copying, over the run.
            "copies_down_skipped": s["copies_down_skipped"],
            "bytes_down_skipped": s["bytes_down_skipped"],
            # Note [The weights' image instead of the restore]: gradient folds
            # whose chunk took back the block of its weights, over the run.
            "images_taken_back": s["images_taken_back"],
            "prefetches": s["prefetches"],
            "prefetch_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "budget_overruns": tracer.overruns,
            "cpu_adam_seconds": meters.adam_seconds,
            # Note [CPU Adam during backward]: the update's time in all,
            # the part spent after backward ended (in engine.step()), and the
            # part of the worker's that ran while backward went on.
            "optimizer": {
                "adam_seconds": meters.adam_seconds + (0.0 if overlap is None
                                                       else overlap.worker_seconds),
                # (The forwards' waits for the updates a step left them
                # included: Note [CPU Adam under the next forward].)
                "exposed_adam_seconds": meters.exposed_adam_seconds + (
                    0.0 if overlap is None else overlap.deferred_wait_seconds),
                "chunks_updated_under_next_forward": 0 if overlap is None
                else overlap.deferred_chunks,
                # Note [Speculation while backward lasts]: the chunks not
                # launched during backward because their speculative update
                # would not have ended before it (the step updated them, or
                # left them to the next forward: then counted above too).
                "chunks_left_to_the_step_by_cost": 0 if overlap is None
                else overlap.left_to_step,
                "next_forward_wait_seconds": 0.0 if overlap is None
                else overlap.deferred_wait_seconds,
                # Note [A waiter runs the job itself] (cpu_adam/update_worker.h):
                # updates the thread that needed them ran itself, the worker
                # not having started them.
                "updates_run_by_their_waiter": 0 if overlap is None else overlap.run_by_waiter,
                "overlapped_adam_seconds": 0.0 if overlap is None
                else overlap.overlapped_seconds,
                # Note [Folds on the worker]: the accumulation folds made
                # during backward that ran there, their passes' time, and what
                # the ends of those backwards waited for them.
                "folds_on_worker": 0 if overlap is None else overlap.folds_on_worker,
                "fold_worker_seconds": 0.0 if overlap is None else overlap.fold_worker_seconds,
                "fold_wait_seconds": 0.0 if overlap is None else overlap.fold_wait_seconds,
                # Note [Measured in the fold]: chunks of the window's last
                # backward whose sums' measure (the clip) their fold made.
                "sums_measured_in_folds": 0 if overlap is None else overlap.sums_measured_in_folds,
                "overlap_step": overlap is not None,
                # Why the step is not overlapped (None: it is).
                "overlap_step_off": self._overlap_step_off,
                "chunks_updated_during_backward": 0 if overlap is None
                else overlap.launched_chunks,
                # Note [Gradients down as they land]: chunks whose gradients
                # went down during a backward that ends no window.
                "gradients_sent_down_during_backward": 0 if overlap is None
                else overlap.grads_sent_down_early,
                # Note [Weights up as they are updated]: chunks whose new
                # 16-bit weights went up during the backward that updated them
                # (with accumulation also those whose fold gave their weights
                # back during a backward that ends no window).
                "weights_sent_up_during_backward": 0 if overlap is None
                else overlap.weights_sent_up_early,
                # ... and those whose update was still running when backward
                # ended, each sent up once done while the step waits for the rest.
                "weights_sent_up_while_the_step_waits": 0 if overlap is None
                else overlap.weights_sent_up_at_step,
                # Note [Speculative updates and their undo]: the updates made
                # during backward that a step (or anything before it) took
                # back, the backwards that did not speculate because the last
                # step clipped or overflowed, and the host bytes of the undo
                # buffers.
                "undone_chunk_updates": 0 if overlap is None else overlap.undone_chunks,
                "steps_not_speculated": 0 if overlap is None
                else overlap.steps_not_speculated,
                "overlap_undo_bytes": 0 if overlap is None else overlap.undo_bytes},
            "adam_chunks_on_device": meters.adam_device_chunks,
            "adam_chunks_on_host": meters.adam_host_chunks,
            "trace_adoptions": s["trace_adoptions"],
            "trace_divergences": s["trace_divergences"],
            "steps": global_steps,
            "skipped_steps": skipped_steps,
            "loss_scale": loss_scale,
            "dtr": self._dtr.report(),
            "data_parallel": None if dp is None else {
                "rank": dp.rank, "world_size": dp.world, "backend": dp.backend,
                "owned_chunks": sorted({r.chunk for r in self._params.records if store.owns(r)}),
                "bytes_sent": dp.bytes_sent, "collectives": dp.collectives,
                "overlap_comm": dp.overlap,
                "reduces_in_backward": self._dp_step.reduces_in_backward,
                "seconds_in_collectives": dp.seconds_blocked},
            # The NVMe tier (Note [Chunks on NVMe: the tier]), None without one.
            "nvme": None if disk is None else {
                **{k: disk[k] for k in ("path", "backend", "direct", "file_bytes")},
                "bytes_on_disk": s["resident_bytes_disk"],
                "peak_bytes_on_disk": s["peak_resident_bytes_disk"],
                "bytes_read": s["bytes_disk_to_host"], "bytes_written": s["bytes_host_to_disk"],
                "chunks_read": s["moves_disk_to_host"], "chunks_written": s["moves_host_to_disk"],
                # Chunks that went back to disk unchanged, without a write
                # (Note [Chunks on NVMe: clean chunks]).
                "writes_skipped": s["disk_writes_skipped"],
                "bytes_writes_skipped": s["bytes_disk_writes_skipped"],
                # The last step's: the first steps fill the file, steady steps
                # read and write what is on disk once (docs/nvme.md).
                "bytes_read_last_step": meters.disk_bytes_per_step[-1][0]
                if meters.disk_bytes_per_step else 0,
                "bytes_written_last_step": meters.disk_bytes_per_step[-1][1]
                if meters.disk_bytes_per_step else 0,
                "failure": disk["failure"]},
            "scheduler": s,
        }
