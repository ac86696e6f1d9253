"""DeepSpeed's config keys that tidal accepts but does not act on, and why.

tidal.config holds the keys tidal honours; this module holds the rest of
DeepSpeed 0.19.8's keys: their schema (so a DeepSpeed config loads as it is
and a misspelt key is still an error), what tidal does instead of each (the
warning a config that sets one gets), the keys DeepSpeed itself now rejects,
and the few keys public configs carry that DeepSpeed never reads. See Note
[DeepSpeed's keys in a tidal config].
"""
from __future__ import annotations

from typing import Any, Callable

from ._schema import NONE, Rule

__all__ = ["BF16_EXTRA", "DEEPSPEED_SCHEMA", "NOT_HONOURED", "NOT_HONOURED_ERRORS",
           "NOT_READ_BY_DEEPSPEED", "NULLABLE_BLOCKS", "REMOVED", "Unused"]

# Note [DeepSpeed's keys in a tidal config]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The list is DeepSpeed 0.19.8's, read from its source (the PyPI sdist):
# what DeepSpeedConfig.__init__ and _initialize_params (deepspeed/runtime/config.py)
# and deepspeed.initialize (deepspeed/__init__.py: data_parallel_size,
# sequence_parallel_size) read at the top level, and the blocks they hand on:
# runtime/zero/config.py (DeepSpeedZeroConfig, with its aliases and deprecated
# fields), runtime/zero/offload_config.py, runtime/precision_config.py (fp16, bf16
# and its old name bfloat16), runtime/activation_checkpointing/config.py,
# comm/config.py (comms_logger), monitor/config.py (tensorboard, wandb,
# csv_monitor, comet), profiling/config.py (flops_profiler),
# autotuning/config.py, runtime/swap_tensor/aio_config.py,
# runtime/model_checkpointing/config.py with the checkpoint keys of
# runtime/config.py, utils/config.py (timers), compile/config.py and the
# hybrid_engine, pipeline, data_types and torch_autocast readers of
# runtime/config.py. The optimizer's params are the keyword arguments of the
# class DeepSpeed builds (Note [Optimizer types as DeepSpeed resolves them] in
# tidal/config.py).
#
# Each key is one of:
#  - honoured: tidal does what DeepSpeed does (tidal/config.py);
#  - accepted and reported (NOT_HONOURED below): a warning names the key, its
#    value and what tidal does instead, unless the value asks for nothing tidal
#    lacks (mostly DeepSpeed's own default; a block behind an `enabled` switch
#    that is off asks for nothing). The keys of one reason share one warning;
#  - an error, where the value asks for a different training result that
#    tidal cannot give (an optimizer it cannot run, AMSGrad, NVMe offload,
#    ZenFlow's delayed updates, gradients summed over ranks).
# Blocks whose insides DeepSpeed hands whole to a feature tidal lacks, and
# checks loosely or not at all (data_efficiency, pipeline, tensor_parallel,
# expert_parallel, weight_quantization, datastates_ckpt), are checked here as
# objects only: their keys are reported with the block, not spelt out.
# DeepSpeed 0.19.8 rejects the keys of removed features itself
# (_REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS in
# runtime/config.py): they are errors here too (REMOVED).

_NUM = (float, int)
_COUNT = (int, float)  # element counts; JSON configs write them as 5e8
_STR = (str, NONE)
_DTYPE_NAMES = ("fp16", "bf16", "fp32")


def _dtype_name(allowed_null: bool) -> Rule:
    # DeepSpeed lower-cases these (get_communication_data_type) and rejects others.
    return Rule("'fp16', 'bf16' or 'fp32' (any case)" + (" or null" if allowed_null else ""),
                lambda v: (v is None and allowed_null) or
                          (isinstance(v, str) and v.lower() in _DTYPE_NAMES))


_ANY_CASE_MEAN_SUM = Rule("'mean' or 'sum' (any case)",
                          lambda v: isinstance(v, str) and v.lower() in ("mean", "sum"))
_TAG_VALIDATION = Rule("'Warn', 'Ignore' or 'Fail' (any case)",
                       lambda v: isinstance(v, str) and v.upper() in ("WARN", "IGNORE", "FAIL"))
_FP32_MODULES = Rule("'auto' or a list of module-name patterns",
                     lambda v: v == "auto" or (isinstance(v, list) and
                                               all(isinstance(n, str) for n in v)))


def _doc(kind: Any, default: Any) -> tuple:
    return (kind, default, "DeepSpeed's; see the warning tidal gives")


# ---------------------------------------------------------------------------
# The schema of DeepSpeed's keys that tidal does not act on, with DeepSpeed's
# defaults. tidal.config merges it into its own SCHEMA.
# ---------------------------------------------------------------------------
_OFFLOAD_COMMON = {
    "device": (("cpu", "none", "nvme"), "none", "where DeepSpeed offloads (tidal: chunks decide)"),
    "nvme_path": (_STR, None, "the NVMe tier's folder (device 'nvme'): chunks go to a file there "
                              "when the host budget is full"),
    "pin_memory": (bool, True, "pin host chunks"),
}
_ZERO = {
    "stage": (int, 0, "accepted for compatibility; tidal's chunks place every state"),
    "offload_optimizer": {
        **_OFFLOAD_COMMON,
        "buffer_count": (int, 4, "NVMe offload buffers"),
        "pipeline_read": (bool, False, "NVMe reads ahead of use (tidal: always, along the trace)"),
        "pipeline_write": (bool, False, "NVMe writes behind (tidal: always)"),
        "fast_init": (bool, False, "NVMe offload fast initialisation"),
        "ratio": (_NUM, 1.0, "share of optimizer states offloaded"),
        "super_offload": _doc(bool, False),
        "cpuadam_cores_perc": _doc(_NUM, 0.8),
    },
    "offload_param": {
        **_OFFLOAD_COMMON,
        "buffer_count": (int, 5, "NVMe offload buffers"),
        "buffer_size": (_COUNT, 1e8, "NVMe offload buffer elements"),
        "max_in_cpu": (_COUNT, 1e9, "parameter elements kept in host memory with NVMe"),
    },
    "cpu_offload": ((bool, NONE), None, "deprecated spelling of offload_optimizer.device=cpu"),
    "cpu_offload_param": ((bool, NONE), None, "deprecated spelling of offload_param.device=cpu"),
    "cpu_offload_use_pin_memory": ((bool, NONE), None, "deprecated; DeepSpeed ignores it"),
    "contiguous_gradients": (bool, True, "data parallel: gradients into one buffer"),
    "overlap_comm": ((bool, NONE), None, "data parallel: overlap reduction with backward"),
    "reduce_scatter": (bool, True, "data parallel: reduce-scatter gradients"),
    "reduce_bucket_size": (_COUNT, 5e8, "data parallel: elements reduced at once"),
    "use_multi_rank_bucket_allreduce": _doc(bool, True),
    "allgather_partitions": (bool, True, "data parallel: all-gather the updated partitions"),
    "allgather_bucket_size": (_COUNT, 5e8, "data parallel: elements all-gathered at once"),
    "round_robin_gradients": (bool, False, "data parallel: gradient copy partitioning"),
    "compute_grad_norm": _doc(bool, True),
    "load_from_fp32_weights": _doc(bool, True),
    "elastic_checkpoint": _doc(bool, False),
    "zenflow": ((dict, NONE), None, "ZenFlow's delayed updates (not supported)"),
    "sub_group_size": (_COUNT, 1e9, "ZeRO-3 optimizer step tile"),
    "ignore_unused_parameters": _doc(bool, True),
    "legacy_stage1": _doc(bool, False),
    "parameter_alignment": _doc(bool, False),
    "zero_hpz_partition_size": _doc(int, 1),
    "zero_quantized_weights": _doc(bool, False),
    "zero_quantized_nontrainable_weights": _doc(bool, False),
    "zero_quantized_gradients": _doc(bool, False),
    "memory_efficient_linear": _doc(bool, True),
    "pipeline_loading_checkpoint": _doc(bool, False),
    "override_module_apply": _doc(bool, True),
    "log_trace_cache_warnings": _doc(bool, False),
    "enable_sanity_checks": _doc(bool, False),
    "save_muon_momentum_buffer_in_memory": _doc(bool, False),
    "leaf_module": {"classes": _doc(list, [
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]),
                    "names": _doc(list, []),
                    "name_suffixes": _doc(list, [])},
    "stage3_gather_fp16_weights_on_model_save": (bool, False, "deprecated spelling of "
                                                 "stage3_gather_16bit_weights_on_model_save"),
}
# DeepSpeedZeroConfig's fields with an alias: pydantic takes either name
# (populate_by_name), so a config may use either.
_ZERO3_ALIASED = {
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size", _COUNT, 5e7),
    "stage3_param_persistence_threshold": ("param_persistence_threshold", _COUNT, 1e5),
    "stage3_model_persistence_threshold": ("model_persistence_threshold", _COUNT, 2 ** 63 - 1),
    "stage3_max_live_parameters": ("max_live_parameters", _COUNT, 1e9),
    "stage3_max_reuse_distance": ("max_reuse_distance", _COUNT, 1e9),
    "stage3_gather_16bit_weights_on_model_save": ("gather_16bit_weights_on_model_save", bool, False),
    "stage3_module_granularity_threshold": ("module_granularity_threshold", _COUNT, 0),
    "stage3_use_all_reduce_for_fetch_params": ("use_all_reduce_for_fetch_params", bool, False),
    "stage3_allgather_sequential": ("allgather_sequential", bool, False),
}
for _alias, (_name, _kind, _default) in _ZERO3_ALIASED.items():
    _ZERO[_alias] = (_kind, _default, "ZeRO-3 tuning")
    _ZERO[_name] = (_kind, _default, f"DeepSpeed's field name for {_alias}")

# bf16's keys besides "enabled" (which tidal.config's SCHEMA holds).
BF16_EXTRA = {
    "immediate_grad_update": _doc(bool, False),
    "check_grad_overflow": (bool, True, "skip a step whose gradients are not finite"),
    "bf16_master_weights_and_grads": _doc(bool, False),
    "bf16_optimizer_states": _doc(bool, False),
}


def _monitor(**extra: tuple) -> dict:
    return {"enabled": _doc(bool, False), **extra}


DEEPSPEED_SCHEMA: dict[str, Any] = {
    # Top-level switches (runtime/config.py DeepSpeedConfig._initialize_params).
    "managed_gradient_accumulation": _doc(bool, True),
    "dump_state": _doc(bool, False),
    "disable_python_gc": _doc(bool, False),
    "disable_allgather": _doc(bool, False),
    "communication_data_type": _doc(_dtype_name(True), None),
    "seq_parallel_communication_data_type": _doc(_dtype_name(False), "fp32"),
    "gradient_allreduce_op": (_ANY_CASE_MEAN_SUM, "mean", "data parallel: average ('mean') the "
                                                          "gradients of the ranks"),
    "vocabulary_size": _doc((int, NONE), None),
    "zero_force_ds_cpu_optimizer": (bool, True, "accepted; tidal always uses its own Adam"),
    "use_data_before_expert_parallelism": _doc(bool, False),
    "dataloader_drop_last": (bool, False, "the loader tidal.deepspeed.initialize(training_data=...) "
                                          "builds drops the last short batch"),
    "log_level": _doc(_STR, None),
    "sequence_parallel_size": _doc(int, 1),
    "data_parallel_size": _doc((int, NONE), None),
    # Read with the old "zero_optimization": true form only (read_zero_config_deprecated).
    "allgather_size": _doc(_COUNT, 5e8),
    "prescale_gradients": (bool, False, "data parallel: scale gradients before the all-reduce"),
    "gradient_predivide_factor": (_NUM, 1.0, "data parallel: divide before the all-reduce"),
    "wall_clock_breakdown": (bool, False, "DeepSpeed's per-phase timers (not in tidal)"),
    "memory_breakdown": (bool, False, "DeepSpeed's memory logging (engine.memory_report() instead)"),
    "zero_optimization": _ZERO,
    "bf16": dict(BF16_EXTRA),
    # The old name of "bf16", read only when "bf16" is absent (get_bfloat16_config).
    "bfloat16": {"enabled": (bool, False, "bfloat16 parameters, no loss scaling"), **BF16_EXTRA},
    "torch_autocast": {"enabled": _doc(bool, False), "dtype": _doc(_STR, None),
                       "lower_precision_safe_modules": _doc((list, NONE), None)},
    "comms_logger": {"enabled": _doc(bool, False), "prof_all": _doc(bool, True),
                     "prof_ops": _doc(list, []), "verbose": _doc(bool, False),
                     "debug": _doc(bool, False)},
    "tensorboard": _monitor(output_path=_doc(str, ""), job_name=_doc(str, "DeepSpeedJobName")),
    "csv_monitor": _monitor(output_path=_doc(str, ""), job_name=_doc(str, "DeepSpeedJobName")),
    "wandb": _monitor(group=_doc(_STR, None), team=_doc(_STR, None),
                      project=_doc(str, "deepspeed")),
    "comet": _monitor(samples_log_interval=_doc(int, 100), project=_doc(_STR, None),
                      workspace=_doc(_STR, None), api_key=_doc(_STR, None),
                      experiment_name=_doc(_STR, None), experiment_key=_doc(_STR, None),
                      online=_doc((bool, NONE), None), mode=_doc(_STR, None)),
    "flops_profiler": {"enabled": _doc(bool, False), "recompute_fwd_factor": _doc(_NUM, 0.0),
                       "profile_step": _doc(int, 1), "module_depth": _doc(int, -1),
                       "top_modules": _doc(int, 1), "detailed": _doc(bool, True),
                       "output_file": _doc(_STR, None)},
    "autotuning": {
        "enabled": _doc(bool, False), "fast": _doc(bool, True),
        "results_dir": _doc(str, "autotuning_results"), "exps_dir": _doc(str, "autotuning_exps"),
        "overwrite": _doc(bool, True), "start_profile_step": _doc(int, 3),
        "end_profile_step": _doc(int, 5), "metric": _doc(str, "throughput"),
        "metric_path": _doc(_STR, None), "tuner_type": _doc(str, "gridsearch"),
        "tuner_early_stopping": _doc(int, 5), "tuner_num_trials": _doc(int, 50),
        "arg_mappings": _doc((dict, NONE), None), "model_info": _doc((dict, NONE), None),
        "model_info_path": _doc(_STR, None), "mp_size": _doc(int, 1),
        "max_train_batch_size": _doc((int, NONE), None), "min_train_batch_size": _doc(int, 1),
        "max_train_micro_batch_size_per_gpu": _doc(int, 1024),
        "min_train_micro_batch_size_per_gpu": _doc(int, 1),
        "num_tuning_micro_batch_sizes": _doc(int, 3)},
    "hybrid_engine": {"enabled": _doc(bool, False), "max_out_tokens": _doc(int, 512),
                      "inference_tp_size": _doc(int, 1),
                      "release_inference_cache": _doc(bool, False),
                      "pin_parameters": _doc(bool, True), "tp_gather_partition_size": _doc(int, 8),
                      "enable_cuda_graph": _doc(bool, False)},
    "checkpoint": {"tag_validation": _doc(_TAG_VALIDATION, "Warn"),
                   "load_universal": _doc(bool, False),
                   "use_node_local_storage": _doc(bool, False),
                   "parallel_write": {"pipeline_stage": _doc(bool, False)},
                   "checkpoint_serialization": _doc(bool, True),
                   "writer": _doc((dict, NONE), None)},
    "data_types": {"grad_accum_dtype": _doc(_dtype_name(True), None),
                   "param_dtype": _doc(_dtype_name(True), None),
                   "buffer_dtype": _doc(_dtype_name(True), None),
                   "keep_in_fp32_modules": _doc(_FP32_MODULES, "auto")},
    "aio": {"block_size": (int, 1048576, "bytes per NVMe read or write request"),
            "queue_depth": (int, 8, "NVMe requests in flight (threads of O_DIRECT pread/pwrite)"),
            "intra_op_parallelism": _doc(int, 1), "single_submit": _doc(bool, False),
            "overlap_events": _doc(bool, True), "use_gds": _doc(bool, False)},
    "timers": {"throughput": {"enabled": _doc(bool, True), "synchronized": _doc(bool, True)}},
    "compile": {"deepcompile": _doc(bool, False), "autoep_non_moe": _doc(bool, False),
                "free_activation": _doc(bool, False),
                "free_activation_threshold": _doc(int, 10 * 1024 * 1024),
                "offload_activation": _doc(bool, False),
                "offload_activation_pin_memory": _doc(bool, True),
                "offload_opt_states": _doc(bool, False), "double_buffer": _doc(bool, True),
                "symmetric_memory": _doc(bool, False), "debug_log": _doc(bool, False),
                "offload_parameters": _doc(bool, False),
                "sync_before_reduce": _doc(bool, False), "sync_after_reduce": _doc(bool, False),
                "sync_before_allgather": _doc(bool, False),
                "sync_after_allgather": _doc(bool, False),
                "keep_int_input_tensors": _doc(bool, True),
                "keep_all_input_tensors": _doc(bool, False),
                "passes": _doc((list, NONE), None)},
    # Handed whole to features tidal lacks; checked as objects only.
    "data_efficiency": _doc(dict, {}),
    "pipeline": _doc(dict, {}),
    "tensor_parallel": _doc(dict, {}),
    "expert_parallel": _doc(dict, {}),
    "weight_quantization": _doc(dict, {}),
    "datastates_ckpt": _doc((dict, bool), False),
}

# Blocks DeepSpeed reads as "absent" when they are null (Optional fields, or
# `if block is not None`).
NULLABLE_BLOCKS = frozenset({"aio", "zero_optimization.offload_optimizer",
                             "zero_optimization.offload_param"})


# ---------------------------------------------------------------------------
# What tidal does instead: one row per key (or object block).
# ---------------------------------------------------------------------------
class Unused:
    """A DeepSpeed key tidal does not act on.

    Args:
        path: the key's path.
        what: what tidal does instead (completes "not used by tidal: ...").
        quiet: values that ask for nothing tidal lacks (never reported): a
            tuple, a predicate, or None when every value is reported.
        switch: (path, DeepSpeed's default) of the `enabled` key the block's
            other keys depend on; while it is off, they are not reported.
        when: a predicate of the whole given config; the key is reported only
            where it holds (None: always).
    """

    __slots__ = ("path", "what", "quiet", "switch", "when")

    def __init__(self, path: tuple[str, ...], what: str,
                 quiet: tuple | Callable[[Any], bool] | None = None,
                 switch: tuple[tuple[str, ...], Any] | None = None,
                 when: Callable[[dict], bool] | None = None):
        self.path, self.what, self.quiet, self.switch, self.when = path, what, quiet, switch, when

    def asks_nothing(self, value: Any) -> bool:
        if self.quiet is None:
            return False
        if callable(self.quiet):
            return bool(self.quiet(value))
        # Types are checked before this runs; True == 1 must still not match.
        return any(value == q and isinstance(value, bool) == isinstance(q, bool) for q in self.quiet)


_STAGE = "tidal has no ZeRO stages on one GPU; chunks decide placement"
_COMM = ("they tune DeepSpeed's bucketed data-parallel communication; tidal reduces and "
         "broadcasts whole chunks (Note [Data parallel by chunk] in tidal/data_parallel.py)")
_ZERO3 = ("tidal's chunk scheduler decides what stays on the device (OPT eviction over the step's "
          "trace, prefetch), so ZeRO-3's fetch, persistence and module-hook settings do not apply")
_NVME = ("tidal's NVMe tier stages chunks through host chunk memory (tidal.chunk_size, within "
         "tidal.host_memory_budget), not separate swap buffers")
_AIO = ("tidal's NVMe tier issues O_DIRECT pread/pwrite from a thread pool (aio.block_size bytes "
        "each, aio.queue_depth in flight); it has no other aio settings")
_STATES = "tidal keeps optimizer states in chunks in host memory and on the device as the budget allows"
_MASTER = "tidal keeps fp32 master weights and fp32 Adam states in chunks"
_LOGS = ("tidal writes no TensorBoard, W&B, CSV or Comet logs; log the loss engine(...) returns, "
         "and engine.memory_report()")
_ZEROPP = "tidal has no ZeRO++: its data parallelism communicates whole chunks in their own dtype"


def _block_rows(block: str, schema: dict, what: str, switch: str | None = "enabled") -> list[Unused]:
    rows = []
    sw = ((block, switch), schema[switch][1]) if switch else None

    def walk(node: dict, prefix: tuple[str, ...]) -> None:
        for key, spec in node.items():
            if isinstance(spec, dict):
                walk(spec, prefix + (key,))
            else:
                rows.append(Unused(prefix + (key,), what, (spec[1],), None if key == switch else sw))
    walk(schema, (block,))
    return rows


S = DEEPSPEED_SCHEMA


def _offload_device(given: dict, sub: str) -> Any:
    block = given.get("zero_optimization")
    block = block.get(sub) if isinstance(block, dict) else None
    return block.get("device") if isinstance(block, dict) else None


NOT_HONOURED: list[Unused] = [
    # --- zero_optimization
    Unused(("zero_optimization", "stage"), _STAGE),
    Unused(("zero_optimization", "offload_optimizer", "device"), _STATES, ("nvme",)),
    Unused(("zero_optimization", "offload_param", "device"),
           "tidal moves parameter chunks between host and device as the budget requires",
           ("nvme",)),
    Unused(("zero_optimization", "cpu_offload"), _STATES, (False, None)),
    Unused(("zero_optimization", "cpu_offload_param"),
           "tidal moves parameter chunks between host and device as the budget requires",
           (False, None)),
    Unused(("zero_optimization", "cpu_offload_use_pin_memory"),
           "DeepSpeed ignores this deprecated key too; tidal pins the host memory of chunks that "
           "cross the link again and again unless offload_optimizer.pin_memory or "
           "offload_param.pin_memory is false", (None,)),
    Unused(("zero_optimization", "overlap_comm"),
           "tidal's key is tidal.data_parallel.overlap_comm (on by default: each chunk's gradient "
           "reduction starts during backward as soon as its gradients are final)", (None,)),
    *[Unused(("zero_optimization", k), _COMM) for k in (
        "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size", "round_robin_gradients")],
    Unused(("zero_optimization", "use_multi_rank_bucket_allreduce"), _COMM, (True,)),
    Unused(("zero_optimization", "parameter_alignment"), _COMM, (False,)),
    *[Unused(("zero_optimization", k), _ZERO3) for k in (
        "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
        "max_live_parameters", "max_reuse_distance", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")],
    *[Unused(("zero_optimization", k), _ZERO3, (S["zero_optimization"][k][1],)) for k in (
        "memory_efficient_linear", "override_module_apply", "log_trace_cache_warnings",
        "enable_sanity_checks")],
    *[Unused(("zero_optimization", "leaf_module", k), _ZERO3) for k in
      ("classes", "names", "name_suffixes")],
    *[Unused(("zero_optimization", k),
             "tidal gathers whole weights from its chunks (engine.parameters_fp32(), "
             "engine.save_pretrained()); there are no shards", (False,))
      for k in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save")],
    *[Unused(("zero_optimization", sub, k), _NVME)
      for sub in ("offload_optimizer", "offload_param")
      for k in ("buffer_count", "buffer_size", "max_in_cpu", "fast_init")
      if k in S["zero_optimization"][sub]],
    *[Unused(("zero_optimization", sub, key),
             f"it is read only with zero_optimization.{sub}.device 'nvme'" +
             ("" if key == "nvme_path" else " (tidal's NVMe tier always reads ahead along the "
                                           "trace and writes behind)"),
             when=lambda given, sub=sub: _offload_device(given, sub) != "nvme")
      for sub in ("offload_optimizer", "offload_param")
      for key in ("nvme_path", "pipeline_read", "pipeline_write") if key in S["zero_optimization"][sub]],
    Unused(("zero_optimization", "offload_optimizer", "ratio"),
           "tidal offloads optimizer states by chunk as the device budget requires, not by a "
           "fixed share", (1, 1.0)),
    Unused(("zero_optimization", "offload_optimizer", "super_offload"), _STATES, (False,)),
    Unused(("zero_optimization", "offload_optimizer", "cpuadam_cores_perc"),
           "tidal's CPU Adam uses tidal.cpu_adam_threads threads (0 = all cores, all but one "
           "beside forward or backward)"),
    Unused(("zero_optimization", "compute_grad_norm"),
           "tidal computes the global gradient norm every step (clipping and the overflow check "
           "use it)", (True,)),
    Unused(("zero_optimization", "load_from_fp32_weights"),
           "tidal's checkpoints hold the fp32 master weights and load them", (True,)),
    Unused(("zero_optimization", "elastic_checkpoint"),
           "tidal's checkpoints load on any number of ranks already (slots are found by name)",
           (False,)),
    Unused(("zero_optimization", "ignore_unused_parameters"),
           "tidal trains on when a parameter gets no gradient (its update is skipped)", (True,)),
    Unused(("zero_optimization", "legacy_stage1"), _STAGE, (False,)),
    Unused(("zero_optimization", "zero_hpz_partition_size"), _ZEROPP, (1,)),
    *[Unused(("zero_optimization", k), _ZEROPP, (False,)) for k in (
        "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")],
    Unused(("zero_optimization", "pipeline_loading_checkpoint"),
           "tidal has no pipeline parallelism; checkpoints load slot by slot", (False,)),
    Unused(("zero_optimization", "save_muon_momentum_buffer_in_memory"),
           "tidal runs no Muon optimizer", (False,)),
    # --- the optimizer (what DeepSpeed builds: Note [Optimizer types as DeepSpeed resolves
    # them] in tidal/config.py; the update rule is honoured there)
    Unused(("optimizer", "params", "torch_adam"),
           "tidal runs its own fused Adam on the CPU and the device, with the update rule of the "
           "torch.optim.Adam or AdamW DeepSpeed builds for it", (False,)),
    Unused(("optimizer", "params", "fp32_optimizer_states"), _MASTER, (True, None)),
    Unused(("optimizer", "params", "set_grad_none"),
           "tidal lands gradients in chunk slots and leaves no .grad tensors", (True,)),
    *[Unused(("optimizer", "params", k),
             "it chooses an implementation of torch's optimizer; tidal runs its own fused Adam",
             (None, False)) for k in ("foreach", "fused", "capturable", "differentiable")],
    Unused(("optimizer", "legacy_fusion"),
           "tidal's fp16 path has one loss scaler for every optimizer", (False,)),
    # --- top level
    Unused(("prescale_gradients",), _COMM, (False,)),
    Unused(("gradient_predivide_factor",), _COMM, (1, 1.0)),
    Unused(("disable_allgather",), _COMM, (False,)),
    Unused(("allgather_size",), _COMM),
    # communication_data_type: tidal.config (honoured when it is the parameters' dtype).
    Unused(("seq_parallel_communication_data_type",), "tidal has no sequence parallelism",
           lambda v: v.lower() == "fp32"),
    Unused(("sequence_parallel_size",), "tidal has no sequence parallelism", (1,)),
    Unused(("data_parallel_size",),
           "tidal takes the data-parallel size from the process group (torchrun's WORLD_SIZE)",
           (None,)),
    Unused(("use_data_before_expert_parallelism",), "tidal has no expert parallelism", (False,)),
    Unused(("managed_gradient_accumulation",),
           "tidal accumulates gradients itself over gradient_accumulation_steps micro batches "
           "(engine.step() applies at the boundary)", (True,)),
    Unused(("dump_state",), "tidal prints no engine state; tidal.stats() and "
                            "engine.memory_report() give it", (False,)),
    Unused(("disable_python_gc",), "tidal leaves Python's garbage collector as it is", (False,)),
    Unused(("vocabulary_size",),
           "tidal does not check the vocabulary's alignment (DeepSpeed only logs a hint)",
           (None,)),
    Unused(("log_level",), "tidal reports through Python's warnings and exceptions", (None,)),
    Unused(("wall_clock_breakdown",), "tidal has no per-phase timers; engine.memory_report() gives "
                                      "cpu_adam_seconds", (False,)),
    Unused(("memory_breakdown",), "engine.memory_report() gives tidal's memory figures", (False,)),
    # --- precision
    Unused(("fp16", "consecutive_hysteresis"),
           "tidal's loss scaler refills the hysteresis only when the scale grows (DeepSpeed's "
           "default)", (False,)),
    Unused(("fp16", "auto_cast"),
           "tidal casts floating-point inputs to the parameters' 16-bit dtype already", (False,)),
    Unused(("fp16", "fp16_master_weights_and_grads"), _MASTER, (False,)),
    *[Unused((b, "bf16_master_weights_and_grads"), _MASTER, (False,)) for b in ("bf16", "bfloat16")],
    *[Unused((b, "bf16_optimizer_states"), _MASTER, (False,)) for b in ("bf16", "bfloat16")],
    *[Unused((b, "immediate_grad_update"),
             "tidal lands each gradient in its chunk slot as soon as it is ready already",
             (False,)) for b in ("bf16", "bfloat16")],
    *[Unused((b, "check_grad_overflow"),
             "tidal skips a step whose gradients are not finite in every precision", (True,))
      for b in ("bf16", "bfloat16")],
    *_block_rows("torch_autocast", S["torch_autocast"],
                 "tidal runs no torch.autocast; fp16.enabled or bf16.enabled train with 16-bit "
                 "parameters and fp32 master weights"),
    # --- logging, profiling, tuning
    *[row for b in ("tensorboard", "csv_monitor", "wandb", "comet")
      for row in _block_rows(b, S[b], _LOGS)],
    *_block_rows("comms_logger", S["comms_logger"], "tidal logs no collectives"),
    *_block_rows("flops_profiler", S["flops_profiler"],
                 "tidal has no FLOPS profiler; engine.memory_report() gives its memory and "
                 "CPU Adam figures"),
    *_block_rows("autotuning", S["autotuning"],
                 "tidal has no autotuner; its memory tracer sizes the chunk budget in the "
                 "warm-up step"),
    *_block_rows("timers", S["timers"], "tidal has no throughput timers", None),
    *_block_rows("hybrid_engine", S["hybrid_engine"], "tidal has no inference (hybrid) engine"),
    *_block_rows("compile", S["compile"],
                 "tidal runs the module as it is (no DeepCompile); chunks, DTR and recompute "
                 "manage its memory", None),
    # --- checkpoints and data types
    *[Unused(("checkpoint",) + k, "tidal writes its own checkpoints (engine.save_checkpoint: "
                                  "slots found by name, loadable on any number of ranks)", (d,))
      for k, d in ((("tag_validation",), "Warn"), (("use_node_local_storage",), False),
                   (("parallel_write", "pipeline_stage"), False),
                   (("checkpoint_serialization",), True), (("writer",), None))],
    Unused(("checkpoint", "load_universal"),
           "tidal's checkpoints load on any number of ranks already (slots are found by name)",
           (False,)),
    Unused(("data_types", "grad_accum_dtype"),
           "tidal sums gradients over micro batches in fp32 chunks (Note [Gradient sums in "
           "chunks] in cpu_adam/adam.h)", lambda v: v is None or v.lower() == "fp32"),
    Unused(("data_types", "param_dtype"),
           "the parameters' dtype follows fp16.enabled / bf16.enabled", (None,)),
    Unused(("data_types", "buffer_dtype"), "tidal leaves buffers in the dtype the model gives them",
           (None,)),
    Unused(("data_types", "keep_in_fp32_modules"),
           "tidal keeps no modules in fp32 by name", ("auto",)),
    *[r for r in _block_rows("aio", S["aio"], _AIO, None)
      if r.path[-1] not in ("block_size", "queue_depth")],
    # --- features handed whole to DeepSpeed components tidal lacks
    Unused(("data_efficiency",), "tidal has no data-efficiency pipeline (curriculum learning, "
                                 "random-LTD); feed batches in the order you want",
           lambda v: not v.get("enabled", False)),
    Unused(("pipeline",), "tidal has no pipeline parallelism (DeepSpeed reads this block only "
                          "for a PipelineModule)", ({},)),
    Unused(("tensor_parallel",), "tidal has no tensor parallelism; each rank trains the whole "
                                 "model in chunks", lambda v: not v.get("autotp_size", 0)),
    Unused(("expert_parallel",), "tidal has no expert parallelism",
           lambda v: not v.get("enabled", False)),
    Unused(("weight_quantization",), "tidal does not quantize weights (DeepSpeed reads this "
                                     "block for inference)", ({},)),
    Unused(("datastates_ckpt",), "tidal writes its own checkpoints (engine.save_checkpoint)",
           (False,)),
]
del S

# Keys whose value asks for a training result tidal cannot give: (path, the
# predicate for a bad value, the message).
NOT_HONOURED_ERRORS: list[tuple[tuple[str, ...], Callable[[Any], bool], str]] = [
    (("zero_optimization", "zenflow"), lambda v: v is not None,
     "ZenFlow updates the less important gradients later, on the CPU; tidal updates every "
     "parameter at every step and has no ZenFlow: remove the block"),
]

# Keys of features DeepSpeed 0.19.8 removed: it rejects them itself
# (runtime/config.py, _reject_removed_config_keys). What each was, in our words.
REMOVED: dict[str, str] = {
    "nebula": "Nebula checkpointing; tidal saves with engine.save_checkpoint",
    "compression_training": "the compression library; remove the block",
    "amp": "NVIDIA Apex AMP; use fp16 or bf16 instead",
    "quantize_training": "MoQ quantized training; remove the block",
    "sparse_gradients": "sparse embedding-gradient compression; remove the key",
    "eigenvalue": "eigenvalue-based MoQ; remove the block",
    "sparse_attention": "Sparse Attention; remove the block",
    "elasticity": "elastic training; write train_batch_size, train_micro_batch_size_per_gpu and "
                  "gradient_accumulation_steps directly",
    "graph_harvesting": "graph harvesting; remove the key",
    "curriculum_learning": "the top-level curriculum learning block (DeepSpeed reads it only under "
                           "data_efficiency.data_sampling now, and tidal has none): remove it",
    "progressive_layer_drop": "Progressive Layer Dropping; remove the block",
    "zero_optimization.mics_shard_size": "MiCS sharding; remove the key",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS sharding; remove the key",
    "zero_optimization.zeropp_loco_param": "LoCo-ZeRO++; remove the key",
}

# Keys public DeepSpeed configs carry that DeepSpeed 0.19.8 never reads (its
# top level ignores keys it does not know): accepted with a warning, since a
# config that has one runs under DeepSpeed.
NOT_READ_BY_DEEPSPEED: dict[str, str] = {
    "cuda_visible_devices": "DeepSpeed 0.19.8 does not read it either; the devices a process "
                            "sees come from the CUDA_VISIBLE_DEVICES environment variable",
}
