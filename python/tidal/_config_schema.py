"""The config's schema: every key tidal reads, with its kind, default and
documentation, merged with DeepSpeed's keys (tidal._deepspeed_keys).
tidal.config resolves and checks a config against it."""
from __future__ import annotations

from typing import Any

from ._deepspeed_keys import DEEPSPEED_SCHEMA
from ._schema import NONE as _NONE
from .lr_schedules import PARAMS as _SCHEDULER_PARAMS

__all__ = ["SCHEMA"]

# ---------------------------------------------------------------------------
# The schema: key -> (kind, default, doc). kind is a type tuple, "bytes", a
# tuple of choices (strings), a Rule, or a nested dict (see tidal._schema).
# The keys tidal acts on are here; DeepSpeed's others are merged in from
# tidal._deepspeed_keys. Documented key by key in docs/config.md, whose tables
# scripts/config_doc.py writes from these schemas (tests/python/test_config_doc.py
# fails when they differ).
# ---------------------------------------------------------------------------

# optimizer.params: the keyword arguments of every class DeepSpeed may build
# for "Adam"/"AdamW", and the keys it pops first (Note [Optimizer types as
# DeepSpeed resolves them]).
_OPTIMIZER_PARAMS = {
    "lr": ((float, int), 1e-3, "learning rate"),
    "betas": ((list, tuple), [0.9, 0.999], "Adam's (beta1, beta2)"),
    "eps": ((float, int), 1e-8, "Adam's epsilon"),
    "weight_decay": ((float, int, _NONE), None, "weight decay; default that of the class "
                                                "DeepSpeed builds (0, or 0.01 for torch's AdamW)"),
    "adam_w_mode": (bool, True, "decoupled (AdamW) weight decay for type Adam; DeepSpeed's "
                                "default true"),
    "bias_correction": (bool, True, "Adam's bias correction"),
    "torch_adam": (bool, False, "DeepSpeed: build torch.optim.Adam(W) (same update rule)"),
    "fp32_optimizer_states": ((bool, _NONE), None, "DeepSpeed's CPU Adam: fp32 m and v"),
    "amsgrad": (bool, False, "the AMSGrad variant (not supported)"),
    "set_grad_none": (bool, True, "DeepSpeed's FusedAdam: zero_grad sets None"),
    "foreach": ((bool, _NONE), None, "torch's optimizer implementation switch"),
    "fused": ((bool, _NONE), None, "torch's optimizer implementation switch"),
    "capturable": (bool, False, "torch's optimizer implementation switch"),
    "differentiable": (bool, False, "torch's optimizer implementation switch"),
    "maximize": (bool, False, "gradient ascent (not supported)"),
    "decoupled_weight_decay": (bool, False, "torch.optim.Adam's own decoupled-decay switch"),
}

_TIDAL_SCHEMA: dict[str, Any] = {
    "train_batch_size": (int, None, "samples per optimizer step (micro batch x accumulation)"),
    "train_micro_batch_size_per_gpu": (int, None, "samples per forward/backward"),
    "gradient_accumulation_steps": (int, None, "micro batches per optimizer step"),
    # DeepSpeed 0.19.8's default (runtime/constants.py GRADIENT_CLIPPING_DEFAULT):
    # a DeepSpeed config without the key clips at 1.0 there, and so here.
    "gradient_clipping": ((float, int), 1.0, "clip gradients to this global L2 norm; 0 = off"),
    "steps_per_print": (int, 10, "log every N optimizer steps"),
    # A permission DeepSpeed needs for client optimizers under ZeRO; tidal
    # always runs its own Adam, so either value means the same here.
    "zero_allow_untested_optimizer": (bool, False, "accepted; tidal always uses its own Adam"),
    "optimizer": {
        "type": ((str, _NONE), None, "Adam or AdamW (any case, as DeepSpeed reads it)"),
        "params": _OPTIMIZER_PARAMS,
        "legacy_fusion": (bool, False, "DeepSpeed's legacy fused fp16 optimizer"),
    },
    "fp16": {
        "enabled": (bool, False, "16-bit float parameters with dynamic loss scaling"),
        "loss_scale": ((float, int), 0.0, "static loss scale; 0 = dynamic"),
        "initial_scale_power": (int, 16, "dynamic scaling starts at 2**this"),
        "loss_scale_window": (int, 1000, "steps without overflow before the scale doubles"),
        "hysteresis": (int, 2, "overflows tolerated before the scale halves"),
        "min_loss_scale": ((float, int), 1.0, "the scale never drops below this"),
        "consecutive_hysteresis": (bool, False, "refill the hysteresis on every good step"),
        "auto_cast": (bool, False, "cast the module's floating-point inputs to fp16"),
        "fp16_master_weights_and_grads": (bool, False, "fp16 master weights (tidal keeps fp32)"),
    },
    "bf16": {"enabled": (bool, False, "bfloat16 parameters, no loss scaling")},
    "scheduler": {
        "type": (tuple(_SCHEDULER_PARAMS), None, "learning-rate schedule (tidal.lr_schedules)"),
        "params": (dict, {}, "the schedule's parameters, DeepSpeed's names"),
    },
    # DeepSpeed's activation checkpointing block, validated here and
    # interpreted by tidal.recompute.
    "activation_checkpointing": {
        "partition_activations": (bool, False, "split checkpoints across model-parallel ranks"),
        "cpu_checkpointing": (bool, False, "keep checkpoints in host memory"),
        "contiguous_memory_optimization": (bool, False, "checkpoints in one contiguous buffer"),
        "number_checkpoints": ((int, _NONE), None, "checkpoints per forward (for the buffer)"),
        "synchronize_checkpoint_boundary": (bool, False, "synchronize at checkpoint boundaries"),
        "profile": (bool, False, "time the checkpointed forward and recomputation"),
    },
    "tidal": {
        "device": (("auto", "cuda", "sim"), "auto", "device backend"),
        "chunk_size": ("bytes", 64 << 20, "bytes of a 16-bit parameter chunk"),
        "device_memory_budget": ("bytes", 0, "device bytes tidal may use in all; 0 = what the device can give: on a GPU, free memory + torch's cache at start"),
        "host_memory_budget": ("bytes", 0, "host bytes for chunks; 0 = 85% of the host memory "
                                            "available when the engine starts"),
        "device_margin": ("bytes", 0, "device bytes kept free for surprises; 0 = 5% of the budget, at least 1 MiB"),
        "warmup_chunk_share": ((float, int), 0.2, "share of the device budget (less the margin) chunks "
                                                  "may hold in the warm-up step, before the memory "
                                                  "trace is known; in (0, 1]"),
        "prefetch": (bool, True, "prefetch chunks ahead of use along the trace"),
        "prefetch_depth": (int, 4, "prefetched chunks that may wait for their use"),
        "evict_ahead": (bool, True, "a chunk that a trace point's lowered budget (the activations "
                                    "growing) will evict leaves at its last use before that point, "
                                    "so its copy down runs under the compute between (docs/engine.md); "
                                    "off: it leaves at the point, to measure what this saves"),
        "skip_clean_copies": (bool, True, "a chunk of trainable parameters leaving the device "
                                          "unchanged since it came up (a 16-bit chunk that forward "
                                          "only read) takes back the host block it came from, still "
                                          "cached, without a copy "
                                          "(docs/engine.md); off: every move down copies, to measure "
                                          "what this saves. Not with the NVMe tier"),
        "fold_images": (bool, True, "with gradient accumulation, a fold on the host whose 16-bit chunk "
                                    "still has, cached, the host block it came up from (the weights) "
                                    "takes that block back instead of writing the weights again from "
                                    "the fp32 masters: 10 bytes of host memory traffic per parameter "
                                    "instead of 16 (docs/engine.md); off: every fold writes them, to "
                                    "measure what this saves. Needs skip_clean_copies; not with the "
                                    "NVMe tier"),
        "eviction_policy": (("opt", "lru"), "opt", "OPT over the trace, or LRU"),
        "hybrid_adam": (bool, True, "update on the device the chunks whose states fit the chunk room left at the activation peak (they stay there); the others on the host"),
        "room_on_miss": (bool, True, "an allocation the device's allocator cannot serve within the "
                                     "budget (torch's caching allocator on a GPU, its model or the exact "
                                     "count on the simulated device) first moves chunks not in use off "
                                     "the device (or, under DTR, evicts an activation); off: it fails"),
        "simulated_allocator": (("auto", "torch_caching", "exact"), "auto",
                                "the simulated device's non-chunk allocations: placed by torch's CUDA "
                                "caching allocator's rules (segments, a cache; the budget held in the "
                                "bytes they reserve, so it fails where a GPU would), in exact bytes "
                                "(the budget less the margin held in live bytes), or auto: torch's "
                                "rules when the device budget is at least 1 GiB (below, torch's 2 and "
                                "20 MiB segments are too coarse for the budget)"),
        "nvme_budget": ("bytes", 0, "bytes the NVMe tier's file may grow to (offload to 'nvme'); "
                                    "0 = the free space of nvme_path's file system less 10%"),
        "nvme_io": (("threads", "io_uring", "auto"), "threads",
                    "how the NVMe tier issues its O_DIRECT requests: a thread pool of pread/pwrite "
                    "(faster on the disk measured, benchmarks/results/nvme_bandwidth-cpu-2c.json), "
                    "io_uring (where tidal was built with liburing and the kernel allows it), or "
                    "auto: io_uring when it can, else the threads"),
        "nvme_skip_clean_writes": (bool, True, "a chunk read from the NVMe tier and not changed since "
                                               "goes back to disk without a write (its file place still "
                                               "holds it; docs/nvme.md); off: every chunk is written, "
                                               "to measure what the skip saves"),
        "nvme_allow_buffered": (bool, False, "nvme_path on tmpfs (host memory) or on a file system "
                                             "without direct I/O: go on with a warning (buffered I/O) "
                                             "instead of an error"),
        "optimizer_state_dtype": (("fp32", "bf16"), "fp32",
                                  "Adam momentum and variance in fp32 (14 B/param in mixed "
                                  "precision) or bf16 (10 B/param; arithmetic stays fp32)"),
        "cpu_adam_threads": (int, 0, "CPU Adam threads; 0 = all cores (all but one for its updates "
                                     "beside forward or backward, overlap_step)"),
        "cpu_adam_pool": (("onetbb", "torch"), "onetbb",
                          "whose threads run the step's CPU Adam: oneTBB's, or torch's intra-op "
                          "pool (the threads that just ran backward); results are bitwise the same "
                          "(Note [Whose threads run the update] in cpu_adam/adam.h). The updates "
                          "tidal.overlap_step runs on its worker (during backward, under the next "
                          "forward) use oneTBB's either way: torch's pool, called from that thread, "
                          "would be an OpenMP team of its own (Note [A second OpenMP team])"),
        "overlap_step": (bool, True, "run the CPU Adam of a chunk as soon as backward has landed "
                                     "all its gradients, while backward goes on, as a speculation "
                                     "the step validates (clipping, fp16 overflow) and undoes "
                                     "where it must (Notes [CPU Adam during backward], "
                                     "[Speculative updates and their undo]); with accumulation in "
                                     "the last micro-batch's backward; under data parallel an owner "
                                     "starts a chunk's update when its reduction lands. Not with "
                                     "DTR: true there is an error, the default turns it off "
                                     "(memory_report()['optimizer']['overlap_step_off'] says why)"),
        "overlap_next_forward": (bool, True, "with overlap_step: the CPU Adam the step has left "
                                             "(all of it when the clip fires) runs after "
                                             "engine.step() returns, under the next forward, chunk "
                                             "by chunk in the order that forward needs them; each "
                                             "module's forward waits for its chunks' updates, so "
                                             "the weights are the step's bit for bit (Note [CPU "
                                             "Adam under the next forward]; with gradient "
                                             "accumulation the updates read their sums: Note "
                                             "[Measured where folded]). Not under data "
                                             "parallel, with DTR or the NVMe tier"),
        "dtr": (dict, {}, "DTR of activations under the engine (docs/dtr.md): enabled, "
                          "eviction_threshold, evictee_minimum_size, enable_sqrt_sampling, scorer"),
        "recompute": (dict, {}, "tidal.recompute's own keys (tidal.recompute.from_config; "
                                "docs/recompute.md)"),
        "data_parallel": (dict, {}, "data parallel over torch.distributed (docs/data_parallel.md): "
                                    "enabled, timeout, backend"),
    },
}


def _merged(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, spec in b.items():
        if key in out:
            assert isinstance(out[key], dict) and isinstance(spec, dict), key
            out[key] = _merged(out[key], spec)
        else:
            out[key] = spec
    return out


SCHEMA: dict[str, Any] = _merged(_TIDAL_SCHEMA, DEEPSPEED_SCHEMA)

# Keys DeepSpeed itself rejects, with its advice.
_REJECTED = {
    "optimizer.params.max_grad_norm":
        "'max_grad_norm' is not an optimizer parameter (DeepSpeed rejects it too); use the "
        "top-level 'gradient_clipping' instead",
}

# A block with more keys than this is not listed whole in an unknown-key error.
_LISTED_KEYS = 30

