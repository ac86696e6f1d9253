"""tidal-estimate (or tidal.estimate(...)): whether a model fits, and how fast it
would train, before anything is allocated.

    tidal-estimate gpt-13b --precision bf16 --device-memory 80GB --host-memory 128GB
    tidal-estimate my_llama/config.json --precision bf16 --micro-batch 4 --seq 2048 --json
    tidal-estimate tiny --measure          # rates measured on this machine (a few seconds)

The model is a tidal-train preset, a Hugging Face config.json (or a transformers
config object), or an nn.Module built on the meta device (resolved, laid out
in chunks and traced by _estimate_model.py). The model is built (or stays)
on the meta device and nothing of its size is allocated; measured rates
(--measure, the default on the simulated device) allocate a 64 MiB probe on
host and device and run CPU Adam over 2^24 parameters.

Note [The pre-flight estimate]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Memory. The engine's own objects decide what they can:
* the chunk layout is the engine's: the model's tensors are registered, in
  the order tidal.initialize registers a built model (module order, each
  module's own parameters, a module's next tensor "with the previous", frozen
  tensors in their own pool), with a tidal._C.chunks.Chunks over a throwaway
  1 MiB simulated device, which places tensors without allocating anything
  (Note [One layout, five lists] in chunk/chunk_layout.h). So the chunk
  count, the padding and the state bytes (the sum of the chunks' capacities
  in the lists a chunk uses) are the engine's for these shapes;
* state_bytes_per_param, the budgets (device budget less the margin; host
  budget less the two-fp32-chunk reserve) and largest_model_params are
  ParamStore's formulas (python/tidal/engine/store.py), repeated here because
  ParamStore needs a device and a model in chunks; tests check them equal.
* activations: one forward and backward of the model on the meta device at
  the micro batch and sequence length, counting the bytes of live non-parameter
  tensors (parameter gradients dropped as they are made: they land in chunks),
  with scaled_dot_product_attention run as the fused kernel (output and
  logsumexp saved, no score matrix), as it runs on the CPU and on a GPU. The
  same pass counts the FLOPs (torch.utils.flop_counter).

Traffic per step, in steady state (after the warm-up steps; measured on the
simulated device, benchmarks/estimate.py). With P the 16-bit chunk bytes, S
all chunk bytes (P times 1 + e: e = 6 at 14 B/param, 4 at 10 B, 3 in fp32),
L = device budget - margin, A the activation peak, R = L - A:
* tidal.hybrid_adam false: Adam runs on the host for every chunk whose states
  the host holds, so their P - H 16-bit bytes go down and back each step
  (H = spilled / e), plus max(P - R, 0) fetched again in backward.
* S <= R: every chunk stays on the device, nothing moves, Adam runs there.
* otherwise hybrid Adam's plan (Note [Where a chunk's Adam runs] in
  tidal/engine/placement.py) keeps on the device the states that fit the
  chunk room left at the activation peak beside every 16-bit chunk: H bytes
  of 16-bit chunks, H = clamp((R - P) / e, 0, P) (at least what the host
  budget spilled to the device, spilled / e), whose chunks are updated there
  and never move. The other P - H 16-bit bytes send their gradients down to
  the CPU Adam and their new weights up for the next forward, once per
  micro-batch (each micro-batch's gradient fold moves them); where the 16-bit
  chunks alone do not fit (P > R), backward fetches P - R bytes again. So
  each way:
      bytes = accumulation x (P - H) + max(P - R, 0)
  States never come up to be updated and go down again (the rule before
  issue 52 did that, and moved 6-7x this on an H100). Down, the chunks
  forward evicts for the activations (P > R) were only read since their
  copy up and take back their host blocks without a copy (Note [A clean
  chunk goes down without a copy] in runtime/scheduler/chunk_scheduler.h;
  tidal.skip_clean_copies, not with the NVMe tier), except those updated
  on the device (H: the step wrote them there) and frozen ones (their only
  copy, always copied): of the P - R bytes going down in forward, the share
  of host-updated trainable bytes is skipped, none where the host budget
  spilled states to the device (its cached blocks go first for room):
      bytes down = bytes - max(P - R, 0) x (trainable P - H) / P.

Time per step. The copies run on the link's own engines (a copy stream on
a GPU, the simulated link's threads), ahead of their use (prefetch) and, for
CPU Adam's gradients, without stopping backward (Note [A pin that does not
wait]); what they cannot hide is where one direction's bytes take longer
than the compute they run beside. The streamed 16-bit chunks go up in
forward and their gradients down in backward; the chunks fetched again
(P > R) go up in backward and down in forward. Per micro-batch, with
forward a third of the compute (2 of the 6 FLOPs per parameter and token):
    forward  = max(compute/3, streamed up, fetched-again down less the clean)
    backward = max(2 compute/3, streamed down, fetched-again up)
    compute = FLOPs / device FLOP/s + modules x seconds per module hook,
    a direction's time = its bytes / its rate.
With the step overlap (tidal.overlap_step, the default), where nothing is
fetched again, the host holds the state and no disk tier is on, each
streamed chunk's new weights go up as soon as its update is done (or,
between micro-batches, its fold): during backward, or while the step waits
for the updates still running (Note [Weights up as they are updated] in
tidal/engine/overlap.py). The host-updated chunks are the last in first-use
order, so their gradients go down from the start of backward, and each
direction's copies run beside the other's; the next forward waits only for
the last chunk's copy up (the first it needs):
    link     = max(streamed up, streamed down) + one 16-bit chunk up
    forward  = max(compute/3, one 16-bit chunk up)
    backward = max(2 compute/3, link - forward)    (the step's wait included)
so a micro-batch takes max(compute, link) where it took compute/3 + 2
compute/3 or streamed up + streamed down, whichever bound each phase. Only
chunks whose undo buffers (14 bytes per parameter at fp32 moments: Note
[Speculative updates and their undo]) fit the host budget beside the chunks
it holds are updated during backward; for a share b of the streamed bytes,
    link = b max(up, down) + (1 - b)(up + down) + one 16-bit chunk up,
and the forward waits for the rest's (1 - b) up. Those are the chunks the
forward needs first (after the ones updated on the device): it computes on
each as its copy lands, and runs the share updated during backward (up
already) only after the last of them, so
    forward  = max(compute/3, one 16-bit chunk up,
                   (1 - b) up + b x host-updated share of compute/3)
(the compute split by parameters; where the link is well under compute the
first term holds, where the link takes about as long it is the third:
benchmarks/results/estimate-link250mb-cpu-2c.json). The micro-batches before a
window's last fold during backward and need no undo buffers: b = 1 there.
(The clip firing stops the speculation, and with it this: not modelled.)
With gradient accumulation every micro-batch folds the gradients of the
host-updated chunks into their fp32 sums on the host: fold = parameters in
host-updated chunks / fold rate. Where the fold's chunk takes back the block
of its weights (Note [The weights' image instead of the restore] in
hooks/gradient_sums.h: tidal.fold_images and tidal.skip_clean_copies on, no
NVMe tier) that is the rate of the fold without the weights' rewrite (10
bytes of host memory traffic per parameter), else the fold's (16 bytes).
Every fold is charged so: the engine's host pool keeps the blocks folds
will take back (Note [Images someone still wants] in
runtime/scheduler/chunk_scheduler.cpp; all 46 folds a step took theirs in
estimate-link1gb-cpu-2c.json's accumulating shape, 37 before it), a host
without room for them rewrites the weights. The window's last fold's
measure of its sums is not charged (docs/estimate.md). A window's first fold
writes the sums without reading them, but the stores still bring the lines
in, so it is charged as the others (0.8-1.2x a later one in a scratch check,
no result file). Beside a GPU every backward folds on the update worker while it
runs (Note [Folds on the worker] in tidal/engine/overlap.py), backward =
max(backward, fold), and in the
window's last backward CPU Adam's speculative updates have only what the
folds leave of it (backward - fold, in the formulas below for backward);
where the step overlap is off, the NVMe tier is on or the host is too
small for the state, the end of each backward folds on the thread that
launches the kernels: backward + fold.
On the simulated device CPU Adam, the device's Adam and the folds (all on
the host's cores, which compute shares) add to that:
    step = accumulation x (forward + backward + fold) + CPU Adam + device Adam + disk
    CPU Adam = parameters in host-updated chunks / CPU Adam rate (the device
    part likewise at the device Adam rate).
On a GPU CPU Adam runs beside the device: during the last backward (Note
[CPU Adam during backward]) and under the next forward (Note [CPU Adam
under the next forward]). An update made during backward is a speculation
whose undo copy makes it cost s plain ones (the speculation factor,
measured: Note [Speculation while backward lasts]), so backward hides
backward / s of CPU Adam (the engine speculates only what ends within it)
and the next forward the rest; with accumulation the window's last
backward and the forward after its step (Note [Measured where folded]):
    exposed = max(0, CPU Adam - backward / s - forward)
    exposed = max(0, s x CPU Adam - backward)     (overlap_next_forward false,
                                                   or the NVMe tier)
(all of CPU Adam with overlap_step false, or a host too small for the
state, where nothing is launched)
and step_s_overlapped = accumulation x (forward + backward) + max(exposed,
disk - (forward + backward)) + device Adam (a lower bound: not yet checked
on a GPU). The bottleneck is the largest term.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import sys
import time

import torch

from . import _C
from ._schema import read_json_object
from .config import Config, ConfigError
from .device import parse_bytes
from ._estimate_model import _ELEMENT, _TORCH, _layout, _module_tensors, _resolve_model, _trace

__all__ = ["estimate", "measure_rates", "format_estimate", "DEFAULT_RATES", "main"]

# Rates used when neither given nor measured, with where they come from.
DEFAULT_RATES = {
    "h2d_bytes_per_s": (54.5e9, "measured on an H100 80GB HBM3 (PCIe Gen5, pinned 64 MiB copies): "
                                "benchmarks/results/device_bandwidth-nvidia-h100-80gb-hbm3.json"),
    "d2h_bytes_per_s": (55.0e9, "measured on an H100 80GB HBM3: "
                                "benchmarks/results/device_bandwidth-nvidia-h100-80gb-hbm3.json"),
    "device_flops_per_s": (395.8e12, "plain PyTorch gpt-1.3b, bf16, batch 8 x 1024, on an H100 "
                                     "80GB HBM3 (model TFLOPS 6 N T / t): "
                                     "benchmarks/results/engine-nvidia-h100-80gb-hbm3.json"),
    "cpu_adam_params_per_s": (1.34e9, "tidal's CPU Adam, 2^26 parameters, 2 threads of a 2-core "
                                      "AMD EPYC: benchmarks/results/cpu_adam-cpu-2c.json as run at "
                                      "commit 7a0b380 (later runs there measured 1.9e9-3.6e9 as the "
                                      "machine's memory bandwidth moved between ~52 and ~100 GB/s; a "
                                      "host with more cores and memory channels is faster)"),
    "fold_params_per_s": (3.3e9, "tidal's fold (16 bytes of host memory traffic per parameter), "
                                 "2^26 parameters, 2 threads of the 2-core AMD EPYC: measure_rates "
                                 "there (CPU Adam 1.86e9 in the same run: the fold 1.79x its rate); "
                                 "benchmarks/results/cpu_adam-cpu-2c.json (an AVX2 host at about "
                                 "21 GB/s) has the fold at 1.88x and 1.79x CPU Adam's rate in the "
                                 "same repeats at 2^26 and 2^28, and the fold that leaves the "
                                 "weights' rewrite out (10 bytes: Note [The weights' image instead "
                                 "of the restore]) at 1.46x and 1.59x the fold's rate (1.70x and "
                                 "1.67x on the AVX-512 host of the run before): "
                                 "fold_image_params_per_s"),
    "fold_image_params_per_s": (4.8e9, "tidal's fold leaving the weights' rewrite out (10 bytes of "
                                       "host memory traffic per parameter: Note [The weights' image "
                                       "instead of the restore]): fold_params_per_s x 1.46, the "
                                       "lower of its ratios to the fold in "
                                       "benchmarks/results/cpu_adam-cpu-2c.json (1.46x at 2^26, "
                                       "1.59x at 2^28 parameters, 2 threads of a 2-core AVX2 host)"),
    "speculation_factor": (2.9, "a speculative CPU Adam update (its undo copy, 14 B/param, then "
                                "the update) over the update alone: 16.8M parameters on the 2-core "
                                "AMD EPYC, 29 ms + 15 ms against 15 ms (Note [Speculation while "
                                "backward lasts])"),
    "device_adam_params_per_s": (1.0e11, "assumed: an H100's 3.35 TB/s over the 32 bytes per "
                                         "parameter torch's fused Adam reads and writes (not "
                                         "measured)"),
    "seconds_per_module": (13.8e-6, "tidal's hooks per module per forward + backward: "
                                    "benchmarks/results/engine_overhead-cpu-2c.json"),
    "disk_read_bytes_per_s": (6.0e9, "assumed: a PCIe Gen5 NVMe drive's read rate as DeepSpeed "
                                     "publishes it (tidal's O_DIRECT file reaches dd's rate: "
                                     "benchmarks/results/nvme_bandwidth-cpu-2c.json)"),
    "disk_write_bytes_per_s": (3.3e9, "assumed: a PCIe Gen5 NVMe drive's write rate as DeepSpeed "
                                      "publishes it (benchmarks/results/nvme_bandwidth-cpu-2c.json)"),
}
_RATE_KEYS = tuple(DEFAULT_RATES)



# --------------------------------------------------------------------------- rates
def _median_rate(n: int, run, repeats: int = 5) -> float:
    """n / seconds of run(i), i = 0 .. repeats - 1: the median of the calls
    after the first (a warm-up)."""
    samples = []
    for i in range(repeats):
        t = time.perf_counter()
        run(i)
        samples.append(n / (time.perf_counter() - t))
    rest = sorted(samples[1:])
    return rest[len(rest) // 2]


def measure_rates(link: bool = True, adam_params: int = 1 << 24, precision: str = "bf16",
                  optimizer_state_dtype: str = "fp32", device=None) -> dict:
    """Rates measured on this machine, for estimate(rates=...): the link of
    tidal's current device (64 MiB copies each way), tidal's CPU Adam kernel
    over one chunk of `adam_params` parameters (the engine's adam_chunk_step),
    and, on the simulated device, the CPU's matrix-multiply FLOP/s in the
    precision (a 1024 x 1024 x 1024 product: the compute of the simulated
    device). Returns {rate: (value, source)}."""
    from .device import get_device
    out = {}
    dev = device or get_device()
    info = dev.info()
    if link:
        size = 64 << 20
        host = _C.HostBuffer(size, pin_with=dev)
        buf = dev.allocate(size)
        stream = dev.create_stream("estimate")
        done = dev.create_event()
        for name, copy_fn in (("h2d", lambda: dev.copy_h2d(buf, host, stream)),
                              ("d2h", lambda: dev.copy_d2h(host, buf, stream))):
            samples = []
            for _ in range(4):
                t = time.perf_counter()
                copy_fn()
                done.record(stream)
                done.synchronize()
                samples.append(size / (time.perf_counter() - t))
            out[f"{name}_bytes_per_s"] = (sorted(samples)[len(samples) // 2],
                                          f"measured: 64 MiB copies on tidal's {info['name']}")
        del buf, host
    dtype = _TORCH[precision]
    moments = torch.bfloat16 if optimizer_state_dtype == "bf16" else torch.float32
    n = adam_params
    w, m, v = torch.zeros(n), torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    half = torch.full((n,), 1e-3, dtype=dtype)
    rate = _median_rate(n, lambda i: _C.cpu_adam.adam_chunk_step(
        w, m, v, half, [(0, n)], step=[i + 1], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, adamw_mode=True, bias_correction=True, loss_scale=1.0, max_grad_norm=0.0,
        check_overflow=False, grad=None, num_threads=0))
    threads = torch.get_num_threads()
    out["cpu_adam_params_per_s"] = (rate, f"measured: tidal's CPU Adam over {n} parameters, "
                                          f"{threads} threads")
    # Gradient accumulation's fold of one micro-batch's gradients into their
    # sums, on the host (Note [Gradient sums in chunks] in cpu_adam/adam.h);
    # and the same fold leaving the weights' rewrite out (master None: Note
    # [The weights' image instead of the restore]).
    sums = torch.zeros(n)
    out["fold_params_per_s"] = (
        _median_rate(n, lambda i: _C.cpu_adam.fold_gradients(sums, half, w, [(0, n, i == 0)], num_threads=0)),
        f"measured: tidal's fold over {n} parameters, {threads} threads")
    out["fold_image_params_per_s"] = (
        _median_rate(n, lambda i: _C.cpu_adam.fold_gradients(sums, half, None, [(0, n, False)], num_threads=0)),
        f"measured: tidal's fold without the weights' rewrite over {n} parameters, {threads} threads")
    del sums
    # The undo copy a speculative update makes first (Note [Speculative
    # updates and their undo]): the same views, into buffers of their own.
    views = [w, m, v, half]
    undo = [torch.empty_like(t) for t in views]
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        _C.cpu_adam.copy_tensors(undo, views, num_threads=0)
        samples.append(time.perf_counter() - t)
    copy_s = sorted(samples[1:])[len(samples[1:]) // 2]
    out["speculation_factor"] = (1.0 + copy_s * rate / n,
                                 f"measured: the undo copy of {n} parameters over their update")
    del undo
    if info["backend"] == "sim":
        out["device_adam_params_per_s"] = (rate, "the simulated device updates its chunks with "
                                                 "the same CPU kernel")
        a = torch.randn(1024, 1024, dtype=dtype)
        b = torch.randn(1024, 1024, dtype=dtype)
        samples = []
        for _ in range(6):
            t = time.perf_counter()
            a @ b
            samples.append(2 * 1024 ** 3 / (time.perf_counter() - t))
        out["device_flops_per_s"] = (sorted(samples[1:])[len(samples[1:]) // 2],
                                     f"measured: a 1024^3 {precision} matmul on this CPU (the "
                                     f"simulated device computes on the host)")
    return out


def _rates(given: dict, measured: dict) -> dict:
    rates = {}
    for key in _RATE_KEYS:
        if given.get(key) is not None:
            value, source = given[key], "given"
            if isinstance(value, tuple):
                value, source = value
        elif key in measured:
            value, source = measured[key]
        else:
            value, source = DEFAULT_RATES[key]
        floor_ok = key == "seconds_per_module" and value == 0  # no hook cost: allowed
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and
                                           math.isfinite(value) and (value > 0 or floor_ok)):
            raise ValueError(f"rate '{key}' must be a positive number, got {value!r}")
        rates[key] = {"value": float(value), "source": source}
    unknown = set(given) - set(_RATE_KEYS)
    if unknown:
        raise ValueError(f"unknown rate(s) {sorted(unknown)}; known: {', '.join(_RATE_KEYS)}")
    return rates


# ------------------------------------------------------------------------ the model
def _traffic(layout: dict, limit: int, activations: int, host_capacity: int,
             accumulation: int, hybrid: bool = True, skip_clean: bool = True) -> dict:
    """Bytes each way per step (Note [The pre-flight estimate]); down, less
    the copies of clean chunks skipped (`skip_clean`)."""
    out = _traffic_each_way(layout, limit, activations, host_capacity, accumulation, hybrid)
    # The churned bytes of trainable chunks updated on the host (frozen
    # chunks always copy: they are their tensors' only copy), and none where
    # the host holds its budget in live chunks (its cached blocks, the
    # images, go first when it needs room).
    P = layout["param16_bytes"]
    churn = out["refetch_or_churn_bytes"]
    host_updated = layout["param16_trainable_bytes"] - out["hybrid_param16_bytes"]
    clean = int(churn * max(0, host_updated) / P) if skip_clean and P and not out["spilled_bytes"] else 0
    return {**out, "bytes_down_skipped": clean, "bytes_down": out["bytes_each_way"] - clean}


def _traffic_each_way(layout: dict, limit: int, activations: int, host_capacity: int,
                      accumulation: int, hybrid: bool) -> dict:
    """_traffic's bytes moved each way, clean copies counted."""
    P = layout["param16_trainable_bytes"]
    frozen = layout["param16_bytes"] - P
    S = layout["state_bytes"]
    e = (S - layout["param16_bytes"]) / P if P else 0.0
    R = limit - activations
    spilled = max(0, S - host_capacity)
    if not hybrid:
        # tidal.hybrid_adam false: every chunk's Adam runs on the host (but the
        # states the host cannot hold, updated where they are), so each step
        # every other 16-bit chunk goes down for the update and back up; those
        # that do not fit beside the activations are fetched again in backward.
        H = min(P, spilled / e) if e else 0.0
        churn = max(P + frozen - R, 0)
        return {"regime": "hybrid Adam off: every 16-bit chunk goes to the host's CPU Adam",
                "bytes_each_way": int(accumulation * (P - H) + churn), "hybrid_param16_bytes": int(H),
                "host_param16_bytes": int(P - H), "refetch_or_churn_bytes": int(churn),
                "spilled_bytes": spilled, "chunk_room_bytes": R}
    if S <= R:
        return {"regime": "all states stay on the device", "bytes_each_way": 0,
                "hybrid_param16_bytes": P, "host_param16_bytes": 0, "refetch_or_churn_bytes": 0,
                "spilled_bytes": spilled, "chunk_room_bytes": R}
    # Note [Where a chunk's Adam runs] (tidal/engine/placement.py): the states
    # that fit the chunk room left at the activation peak beside every 16-bit
    # chunk stay on the device and are updated there; the rest on the host.
    H = min(P, max(0.0, (R - P - frozen) / e if e else 0.0))
    if e:
        H = min(P, max(H, spilled / e))
    churn = max(P + frozen - R, 0)
    streaming = P - H
    each_way = accumulation * streaming + churn
    regime = ("16-bit chunks stream, some chunks updated on the device" if P + frozen <= R else
              "16-bit chunks do not fit beside the activations: fetched again in backward")
    return {"regime": regime, "bytes_each_way": int(each_way), "hybrid_param16_bytes": int(H),
            "host_param16_bytes": int(streaming), "refetch_or_churn_bytes": int(churn),
            "spilled_bytes": spilled, "chunk_room_bytes": R}


def _config(config, *, precision, optimizer_state_dtype, gradient_accumulation_steps,
            micro_batch, chunk_size, device_memory_budget, host_memory_budget) -> Config:
    """The Config the engine would load: the user's config (dict, JSON file or
    Config) with the estimate's overrides written into it, so the config's
    own validation applies to them."""
    if precision is not None and precision not in _ELEMENT:
        raise ValueError(f"precision must be one of fp32, bf16, fp16, got {precision!r}")
    if optimizer_state_dtype is not None and optimizer_state_dtype not in ("fp32", "bf16"):
        raise ValueError(f"optimizer_state_dtype must be 'fp32' or 'bf16', got "
                         f"{optimizer_state_dtype!r}")
    for name, value in (("gradient_accumulation_steps", gradient_accumulation_steps),
                        ("micro_batch", micro_batch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(config, Config):
        d = copy.deepcopy(config.raw)
    elif isinstance(config, (str, os.PathLike)):
        d = read_json_object(config)
    elif config is None:
        d = {}
    elif isinstance(config, dict):
        d = copy.deepcopy(config)
    else:
        raise TypeError(f"config: expected a dict, a JSON file path or a tidal.Config, got "
                        f"{type(config).__name__}")
    # The optimizer does not change the estimate; a config without one would
    # only warn that tidal picks AdamW.
    d.setdefault("optimizer", {"type": "AdamW"})
    if gradient_accumulation_steps is not None or micro_batch is not None:
        # The figure not overridden keeps what the config makes of it (from
        # train_batch_size too); then train_batch_size goes, which the
        # override would contradict.
        base = Config.load(copy.deepcopy(d))
        d.pop("train_batch_size", None)
        d["gradient_accumulation_steps"] = gradient_accumulation_steps or base.gradient_accumulation_steps
        if (micro_batch or base.micro_batch_size) is not None:
            d["train_micro_batch_size_per_gpu"] = micro_batch or base.micro_batch_size
    if precision is not None:
        d.pop("bfloat16", None)
        for key in ("fp16", "bf16"):
            block = dict(d.get(key) or {})
            block["enabled"] = precision == key
            d[key] = block
    t = d.setdefault("tidal", {})
    if optimizer_state_dtype is not None:
        t["optimizer_state_dtype"] = optimizer_state_dtype
    if chunk_size is not None:
        t["chunk_size"] = parse_bytes(chunk_size)
    for key, value in (("device_memory_budget", device_memory_budget),
                       ("host_memory_budget", host_memory_budget)):
        if value is not None:
            t[key] = parse_bytes(value)
    cfg = Config.load(d)
    if cfg.world_size > 1:
        raise ValueError("tidal.estimate covers one process; data parallel partitions the "
                         "optimizer states over the ranks (Note [Data parallel by chunk])")
    return cfg


def estimate(model, config=None, *, precision=None, optimizer_state_dtype=None,
             gradient_accumulation_steps=None, micro_batch=None, seq=None, chunk_size=None,
             device_memory=None, host_memory=None, device_memory_budget=None,
             host_memory_budget=None, rates=None, measure=None, inputs=None,
             activation_bytes=None, nvme=None, nvme_param=None) -> dict:
    """What training `model` with tidal would need and how fast it would go.

    Args:
        model: a tidal-train preset name ("gpt-13b"), a Hugging Face config.json
            path (or its folder), a transformers config object, or an nn.Module
            (on the meta device to have its activations and FLOPs counted).
        config: a tidal/DeepSpeed config (dict, JSON path or tidal.Config): its
            precision, optimizer-state dtype, accumulation, micro batch,
            chunk size and budgets, which the keyword arguments override.
        precision: "fp32", "bf16" or "fp16".
        optimizer_state_dtype: "fp32" or "bf16" (tidal.optimizer_state_dtype).
        gradient_accumulation_steps, micro_batch, seq: the batch shape (seq
            defaults to the model's positions, at most 1024; micro_batch to 1).
        chunk_size: bytes of a 16-bit chunk (tidal.chunk_size).
        device_memory, host_memory: the machine (bytes or "80GB"); None: this
            machine's (tidal's device capacity; the host's available memory).
        device_memory_budget, host_memory_budget: as the config keys (0 or
            None: the device's memory; 85% of the host's).
        rates: {name: value} over DEFAULT_RATES (link bytes/s each way, CPU
            and device Adam parameters/s, device FLOP/s, seconds per module).
        measure: measure on this machine the rates `rates` does not give
            (None: when the device is detected and is tidal's simulated
            device, whose rates are this host's; the defaults are a GPU's).
        inputs: for an nn.Module that is neither a TinyGPT nor a causal LM:
            its forward's arguments, or a callable (micro_batch, seq) -> args.
        activation_bytes: the activation peak, instead of the meta-device count.
        nvme: bytes the NVMe tier may use (Note [Chunks on NVMe: the tier]);
            None: the config's (tidal.nvme_budget, or the free space of its
            nvme_path less 10%) where it offloads to "nvme", else no tier.
        nvme_param: the 16-bit parameters go to the tier too (offload_param
            "nvme"); None: as the config says (with `nvme` alone: no).

    Returns:
        A dict (JSON-serialisable); format_estimate() prints it.

    Raises:
        ValueError: an unknown preset, a missing config file, a bad size or rate.
    """
    cfg = _config(config, precision=precision, optimizer_state_dtype=optimizer_state_dtype,
                  gradient_accumulation_steps=gradient_accumulation_steps,
                  micro_batch=micro_batch, chunk_size=chunk_size,
                  device_memory_budget=device_memory_budget,
                  host_memory_budget=host_memory_budget)
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise ValueError(f"seq must be a positive integer, got {seq!r}")

    net, source, facts = _resolve_model(model)
    tensors, owned_by = _module_tensors(net)
    if not tensors:
        raise ValueError(f"{source} has no parameters to train")
    layout = _layout(tensors, owned_by, cfg)
    # The padding other chunk sizes would give these tensors (the chunk-size
    # advisor's question, with the same layout code).
    by_size = {}
    for shift in range(24, 31):  # 16 MiB .. 1 GiB
        size = 1 << shift
        if size != cfg.chunk_size and size >= cfg.chunk_size // 4:
            other = _layout(tensors, owned_by, dataclasses.replace(cfg, chunk_size=size))
            by_size[size] = other["state_bytes"]
    by_size[cfg.chunk_size] = layout["state_bytes"]
    params = sum(n for _, n, _, _ in tensors)
    trainable = sum(n for _, n, tr, _ in tensors if tr)

    # The machine and the budgets (ParamStore.__init__).
    from .engine.store import available_memory_bytes, default_host_budget
    if device_memory is None:
        from .device import get_device
        from .engine.store import usable_device_bytes
        info = get_device().info()
        device_memory = usable_device_bytes(info)
        device_source = f"detected: {info['name']} ({info['backend']})" + \
            (", free now" if info["backend"] == "cuda" else "")
        backend = info["backend"]
    else:
        device_memory, device_source = parse_bytes(device_memory), "given"
        backend = "given"
    if host_memory is None:
        host_memory, host_source = available_memory_bytes(), "detected: available memory"
    else:
        host_memory, host_source = parse_bytes(host_memory), "given"
    for name, value in (("device memory", device_memory), ("host memory", host_memory)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value} bytes")
    budget = cfg.device_memory_budget or device_memory
    if budget > device_memory:
        raise ValueError(f"config key 'tidal.device_memory_budget': {budget} bytes is more than "
                         f"the device has ({device_memory} bytes)")
    margin = cfg.device_margin or max(budget // 20, 1 << 20)
    if margin >= budget:
        raise ValueError(f"config key 'tidal.device_margin': {margin} bytes leaves nothing of the "
                         f"device budget of {budget} bytes for chunks")
    host_budget = cfg.host_memory_budget or default_host_budget(host_memory)
    fp32_chunk = cfg.chunk_size * (1 if cfg.precision == "fp32" else 2)
    host_reserve = min(2 * fp32_chunk, host_budget // 4)
    host_capacity, limit = host_budget - host_reserve, budget - margin
    moments = 4 if cfg.optimizer_state_dtype == "bf16" else 8
    per_param = _ELEMENT[cfg.precision] + 4 + moments + \
        (4 if cfg.gradient_accumulation_steps > 1 else 0)

    # Activations and FLOPs.
    micro = cfg.micro_batch_size or 1
    positions = facts.get("positions")
    length = seq or min(positions or 1024, 1024)
    if positions and length > positions:
        raise ValueError(f"seq {length} is longer than the model's {positions} positions")
    traced = _trace(net, facts, cfg.precision, micro, length, inputs) \
        if activation_bytes is None else {"activation_bytes": parse_bytes(activation_bytes)}
    notes = []
    if "error" in traced:
        notes.append(f"activations not estimated ({traced['error']}); counted as 0")
    activations = traced.get("activation_bytes", 0)
    tokens = micro * length * cfg.gradient_accumulation_steps
    flops = traced.get("flops")
    if flops is None:
        flops = 6 * trainable * micro * length
        notes.append("FLOPs: 6 x parameters x tokens (no meta-device count)")
    flops *= cfg.gradient_accumulation_steps

    # The NVMe tier: what may go there, and how much room it has.
    lists = cfg.nvme_lists if cfg.nvme_path is not None else ()
    if nvme is None and cfg.nvme_path is not None:
        nvme = cfg.nvme_budget or int(0.9 * shutil.disk_usage(cfg.nvme_path).free)
    nvme = parse_bytes(nvme) if nvme is not None else 0
    if nvme < 0:
        raise ValueError(f"nvme must be a size >= 0, got {nvme} bytes")
    if nvme and not lists:
        lists = ("optimizer",)
    if nvme_param is not None:
        lists = tuple(x for x in lists if x != "param") + (("param",) if nvme_param else ())
    disk_per_param = ((_ELEMENT[cfg.precision] if "param" in lists else 0) +
                      (4 + moments if "optimizer" in lists else 0)) if nvme else 0

    # Fit.
    state = layout["state_bytes"]
    eligible = int(state * disk_per_param / per_param)  # the padding shared pro rata
    on_disk = min(nvme, eligible, max(0, state - host_capacity))
    spilled = max(0, state - host_capacity - on_disk)
    fits_states = state <= host_capacity + limit + on_disk
    need_on_device = spilled + layout["largest_module_param16_bytes"] + activations
    fits = fits_states and need_on_device <= limit
    largest = (host_capacity + limit + nvme) // per_param
    if disk_per_param:
        largest = min(largest, (host_capacity + limit) // (per_param - disk_per_param)
                      if per_param > disk_per_param else largest)
    padded = state / max(1, trainable)  # chunk bytes per parameter with the padding
    room = host_capacity + limit - activations - layout["largest_module_param16_bytes"]
    largest_trainable = int(max(0, room) / padded) if padded else 0
    if disk_per_param:
        in_memory = padded * (per_param - disk_per_param) / per_param
        largest_trainable = int(min(max(0, room + nvme) / padded,
                                    max(0, room) / in_memory if in_memory else float("inf")))

    # Traffic and time.
    # (Chunks that leave the device unchanged take back their host block, and
    # folds the block of their weights: not with the NVMe tier.)
    skip_clean = cfg.skip_clean_copies and not nvme
    traffic = _traffic(layout, limit, activations, host_capacity, cfg.gradient_accumulation_steps,
                       hybrid=cfg.hybrid_adam, skip_clean=skip_clean)
    if not fits:
        notes.append("it does not fit: the bytes moved and the step time are what they would be "
                     "with the room")
    if measure is None:
        measure = backend == "sim"
    measured = measure_rates(precision=cfg.precision,
                             optimizer_state_dtype=cfg.optimizer_state_dtype) if measure else {}
    r = _rates(dict(rates or {}), measured)
    value = {k: v["value"] for k, v in r.items()}
    modules = len(owned_by) + 1
    hybrid_share = traffic["hybrid_param16_bytes"] / max(1, layout["param16_trainable_bytes"])
    compute_s = flops / value["device_flops_per_s"]
    hooks_s = cfg.gradient_accumulation_steps * modules * value["seconds_per_module"]
    link_s = traffic["bytes_each_way"] / value["h2d_bytes_per_s"] + \
        traffic["bytes_down"] / value["d2h_bytes_per_s"]
    # Per micro-batch (the docstring): the streamed bytes up in forward and
    # down in backward, the ones fetched again the other way round.
    accum = cfg.gradient_accumulation_steps
    streamed = max(0, traffic["bytes_each_way"] - traffic["refetch_or_churn_bytes"]) / accum
    again = traffic["refetch_or_churn_bytes"] / accum
    again_down = (traffic["refetch_or_churn_bytes"] - traffic["bytes_down_skipped"]) / accum
    per_micro = (compute_s + hooks_s) / accum
    # The weights going up as each chunk's update (or fold) is done, beside
    # the gradients going down (the docstring): with the step overlap, when
    # nothing is fetched again, the host holds the state and no disk tier.
    # Only the chunks whose undo buffers fit the host budget beside the
    # chunks it holds are updated during backward (StepOverlap._undo_buffers):
    # a share `beside` of the streamed bytes.
    beside = 0.0
    if cfg.overlap_step and streamed and not again and not spilled and not on_disk:
        # (At the launches the host holds every chunk but those updated on
        # the device: their 16-bit chunks and their states.)
        P = layout["param16_trainable_bytes"]
        e = (state - layout["param16_bytes"]) / P if P else 0.0
        host_held = max(0, state - traffic["hybrid_param16_bytes"] * (1 + e))
        undo = traffic["host_param16_bytes"] * (_ELEMENT[cfg.precision] + 4 + moments) / _ELEMENT[cfg.precision]
        beside = min(1.0, max(0, host_capacity - host_held) / undo) if undo else 1.0
    if beside:
        tail = layout["param16_bytes"] / max(1, layout["chunks"]) / value["h2d_bytes_per_s"]
        up, down = streamed / value["h2d_bytes_per_s"], streamed / value["d2h_bytes_per_s"]

        def phases(b):
            link_micro = b * max(up, down) + (1 - b) * (up + down) + tail
            # (The forward needs the chunks updated after backward first:
            # it computes past the last of them only once its copy has
            # landed, then runs the rest, the share b of the host-updated
            # chunks' compute, which went up during backward.)
            host_compute = b * (1 - hybrid_share) * per_micro / 3
            f = max(per_micro / 3, tail, (1 - b) * up + host_compute)
            return f, max(2 * per_micro / 3, link_micro - f)
        # The micro-batches before the window's last fold each chunk during
        # backward and need no undo buffers: all of theirs go up beside.
        (f1, b1), (fb, bb) = phases(1.0), phases(beside)
        forward_s = ((accum - 1) * f1 + fb) / accum
        # (The window's last backward, and the forward after its step.)
        last_backward_s, next_forward_s = bb, fb
    else:
        forward_s = max(per_micro / 3, streamed / value["h2d_bytes_per_s"],
                        again_down / value["d2h_bytes_per_s"])
        b1 = bb = max(2 * per_micro / 3, streamed / value["d2h_bytes_per_s"],
                      again / value["h2d_bytes_per_s"])
        last_backward_s, next_forward_s = bb, forward_s
    link_exposed_s = accum * forward_s + (accum - 1) * b1 + bb - (compute_s + hooks_s)
    # The folds (the module docstring): with accumulation each micro-batch
    # folds the host-updated chunks' gradients into their sums on the host.
    # Beside a GPU every backward folds on the update worker while it runs
    # (Note [Folds on the worker] in tidal/engine/overlap.py), the window's
    # last before the worker's speculative updates, which then have the rest
    # of that backward; without that path (the step overlap off, the NVMe
    # tier, a host too small) the end of each backward folds on the thread
    # that launches the kernels. On the simulated device they take the cores
    # compute runs on.
    # (Each micro-batch's, at the rate of the fold kind the engine runs: the
    # docstring.)
    fold_images = accum > 1 and cfg.fold_images and skip_clean
    fold_rate = value["fold_image_params_per_s" if fold_images else "fold_params_per_s"]
    fold_s = (trainable * (1 - hybrid_share) / fold_rate) if accum > 1 else 0.0
    fold_step_s = 0.0
    hiding_s = last_backward_s  # the window's last backward's time the worker has for CPU Adam
    if fold_s and backend == "sim":
        fold_step_s = accum * fold_s
    elif fold_s:
        if cfg.overlap_step and not spilled and cfg.nvme_path is None:
            b1, bb = max(b1, fold_s), max(bb, fold_s)
            hiding_s = bb - fold_s
        else:
            b1, bb = b1 + fold_s, bb + fold_s
            hiding_s = bb
        last_backward_s = bb
    backward_s = ((accum - 1) * b1 + bb) / accum
    phases_s = accum * (forward_s + backward_s)
    # Chunks on disk are updated on the host, where they are read to.
    host_adam = max(trainable * (1 - hybrid_share),
                    min(trainable, on_disk / disk_per_param if disk_per_param else 0))
    cpu_adam_s = host_adam / value["cpu_adam_params_per_s"]
    spec = value["speculation_factor"]
    device_adam_s = (trainable - host_adam) / value["device_adam_params_per_s"]
    # Every chunk on disk between steps is read once and written once a step
    # (Adam updates it); reads run ahead and writes behind, beside CPU Adam.
    # What stays off disk at rest is the host budget and the device's chunk
    # room beside the activations, in whole chunks: with hybrid Adam the states
    # it updates on the device stay there, without it only 16-bit chunks do.
    room = max(0, limit - activations) // cfg.chunk_size * cfg.chunk_size
    kept = host_budget // cfg.chunk_size * cfg.chunk_size + \
        (room if cfg.hybrid_adam else min(room, layout["param16_bytes"]))
    disk_bytes = max(0, min(on_disk, state - kept))
    disk_s = disk_bytes / value["disk_read_bytes_per_s"] + disk_bytes / value["disk_write_bytes_per_s"]
    step_s = phases_s + cpu_adam_s + device_adam_s + disk_s + fold_step_s
    # CPU Adam beside a GPU (the module docstring): the window's last
    # backward hides its speculative share at the speculation factor's cost,
    # the next forward the rest.
    if not cfg.overlap_step or spilled:
        # (A host too small for the state launches nothing: Note [One place
        # per chunk].)
        adam_exposed = cpu_adam_s
    elif not cfg.overlap_next_forward or cfg.nvme_path is not None:
        # (The step updates what backward left itself: with the NVMe tier too.)
        adam_exposed = max(0.0, spec * cpu_adam_s - hiding_s)
    else:
        adam_exposed = max(0.0, cpu_adam_s - hiding_s / spec - next_forward_s)
    overlapped = phases_s + max(adam_exposed, disk_s - (forward_s + backward_s)) + device_adam_s + fold_step_s
    parts = {"compute": compute_s + hooks_s, "link": link_exposed_s, "cpu_adam": cpu_adam_s,
             "device_adam": device_adam_s, "disk": disk_s, "fold": accum * fold_s}
    bottleneck = max(parts, key=parts.get)

    return {
        "model": {"source": source, "parameters": params, "trainable_parameters": trainable,
                  "tensors": len(tensors), "modules_with_parameters": len(owned_by),
                  **({"note": facts["note"]} if facts.get("note") else {})},
        "precision": cfg.precision,
        "optimizer_state_dtype": cfg.optimizer_state_dtype,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "micro_batch": micro, "seq": length,
        "state_bytes_per_param": per_param,
        "state_bytes": state,
        "state_bytes_unpadded": trainable * per_param + (params - trainable) * _ELEMENT[cfg.precision],
        "largest_model_params": largest,
        "largest_trainable_params_estimate": largest_trainable,
        "fits": fits,
        "fits_states": fits_states,
        "chunk": {"chunk_size": cfg.chunk_size, **layout,
                  "padding_fraction": layout["padding_elements"] / max(1, params),
                  "state_bytes_by_chunk_size": {str(k): v for k, v in sorted(by_size.items())},
                  "least_padding_chunk_size": min(sorted(by_size), key=by_size.get)},
        "device": {"memory": device_memory, "memory_source": device_source, "backend": backend,
                   "budget": budget, "margin": margin, "chunk_limit": limit,
                   "activations": activations, "activations_forward": traced.get("forward_peak_bytes"),
                   "chunk_room": limit - activations, "spilled_states": spilled,
                   "needs_at_once": need_on_device},
        "host": {"memory": host_memory, "memory_source": host_source, "budget": host_budget,
                 "reserve": host_reserve, "chunk_capacity": host_capacity,
                 "states_on_host": min(state, host_capacity)},
        "nvme": {"budget": nvme, "lists": list(lists), "bytes_per_param": disk_per_param,
                 "eligible_states": eligible if nvme else 0, "states_on_disk": on_disk},
        "traffic": {**traffic, "bytes_host_to_device": traffic["bytes_each_way"],
                    "bytes_device_to_host": traffic["bytes_down"],
                    "bytes_disk_read": disk_bytes, "bytes_disk_write": disk_bytes},
        "rates": r,
        "time": {"flops": flops, "tokens": tokens, "compute_s": compute_s, "hooks_s": hooks_s,
                 "link_s": link_s, "link_exposed_s": link_exposed_s, "link_both_ways_at_once_share": beside,
                 "forward_s": forward_s,
                 "backward_s": backward_s, "cpu_adam_s": cpu_adam_s,
                 "cpu_adam_exposed_s_overlapped": adam_exposed, "device_adam_s": device_adam_s,
                 "disk_s": disk_s, "fold_s": accum * fold_s, "fold_takes_images": fold_images,
                 "step_s": step_s, "step_s_overlapped": overlapped, "bottleneck": bottleneck,
                 # From the model of the backend estimated for: CPU Adam on
                 # the compute's cores (the simulated device) or beside it.
                 "tokens_per_s": tokens / (step_s if backend == "sim" else overlapped),
                 "model_tflops": 6 * trainable * tokens / (step_s if backend == "sim" else overlapped) / 1e12},
        "notes": notes,
    }


# --------------------------------------------------------------------------- output
def _b(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def format_estimate(e: dict) -> str:
    """The estimate as the text tidal-estimate prints."""
    m, c, d, h, t, tr = e["model"], e["chunk"], e["device"], e["host"], e["time"], e["traffic"]
    lines = [
        f"model: {m['source']}: {m['parameters'] / 1e6:,.1f}M parameters "
        f"({m['trainable_parameters'] / 1e6:,.1f}M trainable) in {m['tensors']} tensors",
        f"  {e['precision']}, optimizer states {e['optimizer_state_dtype']}, micro batch "
        f"{e['micro_batch']} x seq {e['seq']} x {e['gradient_accumulation_steps']} accumulation",
        f"states: {e['state_bytes_per_param']} bytes per parameter; {_b(e['state_bytes'])} in "
        f"{c['chunks']} chunks of {_b(c['chunk_size'])} ({c['padding_fraction']:.1%} padding, "
        f"{c['dedicated_chunks']} dedicated)" + (
            "" if c["least_padding_chunk_size"] == c["chunk_size"] else
            f"; chunks of {_b(c['least_padding_chunk_size'])} would hold them in "
            f"{_b(c['state_bytes_by_chunk_size'][str(c['least_padding_chunk_size'])])}"),
        f"device: {_b(d['memory'])} ({d['memory_source']}); budget {_b(d['budget'])} = margin "
        f"{_b(d['margin'])} + activations {_b(d['activations'])} + chunk room "
        f"{_b(d['chunk_room'])}",
        f"host: {_b(h['memory'])} ({h['memory_source']}); budget {_b(h['budget'])} = reserve "
        f"{_b(h['reserve'])} + chunks {_b(h['chunk_capacity'])}",
        f"largest_model_params: {e['largest_model_params'] / 1e6:,.1f}M (host + device" +
        (" + NVMe" if e["nvme"]["budget"] else "") + f" chunk capacity / {e['state_bytes_per_param']} B" +
        (f", the {e['state_bytes_per_param'] - e['nvme']['bytes_per_param']} B kept off disk within "
         f"host + device" if e["nvme"]["budget"] else "") + "); with padding, activations and the largest "
        f"module: about {e['largest_trainable_params_estimate'] / 1e6:,.1f}M",
        f"fits: {'yes' if e['fits'] else 'no'} (states {_b(e['state_bytes'])} vs host "
        f"{_b(h['chunk_capacity'])} + device {_b(d['chunk_limit'])}" +
        (f" + NVMe {_b(e['nvme']['states_on_disk'])} of {_b(e['nvme']['budget'])}"
         if e["nvme"]["budget"] else "") +
        f"; on the device at once: {_b(d['needs_at_once'])} of {_b(d['chunk_limit'])})",
        *([f"NVMe: {', '.join(e['nvme']['lists'])} lists ({e['nvme']['bytes_per_param']} B per "
           f"parameter) may go to disk: {_b(e['nvme']['states_on_disk'])} there; a steady step "
           f"reads and writes {_b(tr['bytes_disk_read'])}, what the host budget and the device's "
           f"chunk room do not keep"] if e["nvme"]["budget"] else []),
        f"per step: {_b(tr['bytes_each_way'])} each way ({tr['regime']})",
        f"step time (simulated device): {_s(t['step_s'])} = compute {_s(t['compute_s'])} + hooks "
        f"{_s(t['hooks_s'])} + link not hidden {_s(t['link_exposed_s'])} (of {_s(t['link_s'])}) + CPU "
        f"Adam {_s(t['cpu_adam_s'])} + device Adam {_s(t['device_adam_s'])}" +
        (f" + disk {_s(t['disk_s'])}" if t["disk_s"] else "") +
        (f" + folds {_s(t['fold_s'])}" if t["fold_s"] else "") + f"; bottleneck: {t['bottleneck']}",
        f"  with CPU Adam" + (" and the disk" if t["disk_s"] else "") + " beside the device (a GPU)"
        f": {_s(t['step_s_overlapped'])}; "
        f"{t['tokens_per_s']:,.0f} tokens/s, {t['model_tflops']:.3g} model TFLOPS",
        "rates:",
    ]
    units = {"h2d_bytes_per_s": ("GB/s", 1e9), "d2h_bytes_per_s": ("GB/s", 1e9),
             "device_flops_per_s": ("TFLOP/s", 1e12), "cpu_adam_params_per_s": ("G params/s", 1e9),
             "speculation_factor": ("x the update", 1.0), "fold_params_per_s": ("G params/s", 1e9),
             "fold_image_params_per_s": ("G params/s", 1e9),
             "device_adam_params_per_s": ("G params/s", 1e9), "seconds_per_module": ("us", 1e-6),
             "disk_read_bytes_per_s": ("GB/s", 1e9), "disk_write_bytes_per_s": ("GB/s", 1e9)}
    for k, v in e["rates"].items():
        unit, scale = units[k]
        lines.append(f"  {k}: {v['value'] / scale:.4g} {unit} ({v['source']})")
    lines += [f"note: {n}" for n in e["notes"]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from .train import CommandLineParser  # (tidal.train imports the package, which imports us)
    ap = CommandLineParser(prog="tidal-estimate", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a preset (nano, tiny, gpt-125m ... gpt-30b) or a Hugging Face "
                                   "config.json (or its folder)")
    ap.add_argument("--config", default=None, metavar="JSON", help="a tidal/DeepSpeed config file")
    ap.add_argument("--precision", choices=sorted(_ELEMENT), default=None)
    ap.add_argument("--optimizer-state-dtype", choices=["fp32", "bf16"], default=None)
    ap.add_argument("--gradient-accumulation", type=int, default=None, metavar="N")
    ap.add_argument("--micro-batch", type=int, default=None, metavar="N")
    ap.add_argument("--seq", type=int, default=None, metavar="N")
    ap.add_argument("--chunk-size", default=None, help="e.g. 64MiB")
    ap.add_argument("--device-memory", default=None, help="the device's memory, e.g. 80GB "
                                                          "(default: tidal's device)")
    ap.add_argument("--host-memory", default=None, help="the host's memory, e.g. 128GB "
                                                        "(default: available memory here)")
    ap.add_argument("--device-budget", default=None, help="tidal.device_memory_budget")
    ap.add_argument("--host-budget", default=None, help="tidal.host_memory_budget")
    ap.add_argument("--link", default=None, help="link bandwidth each way, e.g. 54.5GB/s")
    ap.add_argument("--link-d2h", default=None, help="device-to-host bandwidth, if not --link's")
    ap.add_argument("--tflops", type=float, default=None, help="device TFLOP/s the model reaches")
    ap.add_argument("--cpu-adam", type=float, default=None, metavar="PARAMS_PER_S",
                    help="CPU Adam parameters per second")
    ap.add_argument("--device-adam", type=float, default=None, metavar="PARAMS_PER_S",
                    help="device Adam parameters per second")
    ap.add_argument("--fold", type=float, default=None, metavar="PARAMS_PER_S",
                    help="gradient accumulation's host fold, parameters per second")
    ap.add_argument("--fold-image", type=float, default=None, metavar="PARAMS_PER_S",
                    help="the same fold leaving the weights' rewrite out (tidal.fold_images), "
                         "parameters per second")
    ap.add_argument("--measure", action=argparse.BooleanOptionalAction, default=None,
                    help="measure the rates not given on this machine (link, CPU Adam; CPU "
                         "FLOP/s on the simulated device); default: when the device is "
                         "detected and is the simulated device")
    ap.add_argument("--nvme", default=None, help="disk the NVMe tier may use, e.g. 2TB (default: "
                                                 "the config's, where it offloads to 'nvme')")
    ap.add_argument("--nvme-param", action=argparse.BooleanOptionalAction, default=None,
                    help="the 16-bit parameters go to the NVMe tier too (offload_param 'nvme')")
    ap.add_argument("--disk-read", default=None, help="the disk's read rate, e.g. 6GB/s")
    ap.add_argument("--disk-write", default=None, help="the disk's write rate, e.g. 3.3GB/s")
    ap.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return ap


def _bandwidth(text: str, flag: str) -> float:
    s = text.strip()
    if s.endswith("/s"):
        s = s[:-2]
    try:
        value = parse_bytes(s)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{flag} {text!r}: expected a bandwidth such as 54.5GB/s ({e})") from None
    if value <= 0:
        raise ValueError(f"{flag} {text!r}: the bandwidth must be positive")
    return float(value)


def main(argv=None) -> int:
    """The tidal-estimate console script: a failure is one line on stderr, exit
    status 2 (Note [One line per failure] in tidal/train.py)."""
    from .train import one_line_warnings
    with one_line_warnings("tidal-estimate"):
        return _main(argv)


def _main(argv) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        rates = {}
        if args.link is not None:
            rates["h2d_bytes_per_s"] = rates["d2h_bytes_per_s"] = _bandwidth(args.link, "--link")
        if args.link_d2h is not None:
            rates["d2h_bytes_per_s"] = _bandwidth(args.link_d2h, "--link-d2h")
        if args.tflops is not None:
            rates["device_flops_per_s"] = args.tflops * 1e12
        if args.cpu_adam is not None:
            rates["cpu_adam_params_per_s"] = args.cpu_adam
        if args.device_adam is not None:
            rates["device_adam_params_per_s"] = args.device_adam
        if args.fold is not None:
            rates["fold_params_per_s"] = args.fold
        if args.fold_image is not None:
            rates["fold_image_params_per_s"] = args.fold_image
        if args.disk_read is not None:
            rates["disk_read_bytes_per_s"] = _bandwidth(args.disk_read, "--disk-read")
        if args.disk_write is not None:
            rates["disk_write_bytes_per_s"] = _bandwidth(args.disk_write, "--disk-write")
        e = estimate(args.model, args.config, precision=args.precision,
                     optimizer_state_dtype=args.optimizer_state_dtype,
                     gradient_accumulation_steps=args.gradient_accumulation,
                     micro_batch=args.micro_batch, seq=args.seq, chunk_size=args.chunk_size,
                     device_memory=args.device_memory, host_memory=args.host_memory,
                     device_memory_budget=args.device_budget, host_memory_budget=args.host_budget,
                     rates=rates, measure=args.measure, nvme=args.nvme, nvme_param=args.nvme_param)
    except (ValueError, TypeError, ConfigError) as err:
        ap.error(str(err))
    print(json.dumps(e, indent=2) if args.json else format_estimate(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
