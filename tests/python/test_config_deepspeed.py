"""DeepSpeed's meaning for DeepSpeed's keys (issue 29).

Every expected value below is what DeepSpeed 0.19.8's own source resolves,
cited by file and function (the PyPI sdist, deepspeed/...); the "auto" map is
transformers 4.57.6's (src/transformers/integrations/deepspeed.py).

Fixtures in configs/ used here:
- deepspeed_autotuning_template_zero3.json: DeepSpeed 0.19.8's
  deepspeed/autotuning/config_templates/template_zero3.json, verbatim.
- deepspeed_format_examples.json: the example blocks DeepSpeed 0.19.8 prints
  as the expected format of a key (the *_FORMAT strings of
  runtime/constants.py, runtime/precision_config.py, comm/constants.py,
  profiling/constants.py, utils/config.py, runtime/swap_tensor/constants.py,
  runtime/model_checkpointing/constants.py), put together in one config
  ("dataloader_drop_last": True written as JSON's true).
- hf_ds_config_zero2.json / hf_ds_config_zero3.json: transformers' ZeRO-2 and
  ZeRO-3 templates (tests/deepspeed/ds_config_zero{2,3}.json, also in its
  DeepSpeed docs), written out by hand. No copy of them was reachable when
  they were written, so they are from memory; their "auto" keys are the ones
  HfTrainerDeepSpeedConfig fills, 16 in the ZeRO-3 one as issue 29 counted.
"""
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

import tidal
from tidal.config import AUTO_FILLED_BY, SCHEMA
from tidal._deepspeed_keys import DEEPSPEED_SCHEMA, NOT_HONOURED

from engine_helpers import Reversed, train_tidal

CONFIGS = Path(__file__).parent / "configs"


def load(config):
    """(Config, warning messages); every warning must point at this file."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = tidal.Config.load(config)
    for w in caught:
        assert w.filename == __file__, f"warning attributed to {w.filename}, not the caller"
    return c, [str(w.message) for w in caught]


def reported(messages):
    """The config keys named in 'not used by tidal' warnings."""
    keys = set()
    for m in messages:
        if "not used by tidal" in m:
            keys |= set(re.findall(r"'([A-Za-z0-9_.]+)' = ", m))
    return keys


def error(config) -> str:
    with pytest.raises(tidal.ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tidal.Config.load(config)
    return str(e.value)


# ---------------------------------------------------------------- optimizer
# DeepSpeed 0.19.8 resolves "Adam"/"AdamW" in deepspeed/runtime/engine.py,
# DeepSpeedEngine._configure_basic_optimizer: it pops params.adam_w_mode with
# the default ADAM_W_MODE_DEFAULT = True (deepspeed/runtime/config.py), and the
# mode it builds with is true when the (lower-cased) name is "adamw" or that
# adam_w_mode is true. DeepSpeedEngine.get_optimizer_configuration then picks
# the class: torch.optim.AdamW / torch.optim.Adam by that mode when
# params.torch_adam is true; DeepSpeedCPUAdam when zero_use_cpu_optimizer()
# (offload_optimizer.device "cpu" or "nvme"); FusedAdam otherwise. The type is
# lower-cased first when it is one of DEEPSPEED_OPTIMIZERS
# (DeepSpeedConfig._initialize_params), so "adam" and "ADAMW" are Adam and AdamW.
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("name,params,extra,decoupled,built", [
    ("Adam", {}, {}, True, "FusedAdam"),
    ("Adam", {"adam_w_mode": True}, {}, True, "FusedAdam"),
    ("Adam", {"adam_w_mode": False}, {}, False, "FusedAdam"),
    ("AdamW", {}, {}, True, "FusedAdam"),
    ("AdamW", {"adam_w_mode": True}, {}, True, "FusedAdam"),
    ("AdamW", {"adam_w_mode": False}, {}, True, "FusedAdam"),
    ("adam", {}, {}, True, "FusedAdam"),
    ("ADAM", {"adam_w_mode": False}, {}, False, "FusedAdam"),
    ("adamw", {"adam_w_mode": False}, {}, True, "FusedAdam"),
    ("Adam", {}, OFFLOAD, True, "DeepSpeedCPUAdam"),
    ("Adam", {"adam_w_mode": False}, OFFLOAD, False, "DeepSpeedCPUAdam"),
    ("AdamW", {"adam_w_mode": False}, OFFLOAD, True, "DeepSpeedCPUAdam"),
    # The deprecated zero_optimization.cpu_offload: true is offload_optimizer.device "cpu"
    # (runtime/zero/config.py, DeepSpeedZeroConfig.cpu_offload's new_param_fn).
    ("Adam", {}, {"zero_optimization": {"cpu_offload": True}}, True, "DeepSpeedCPUAdam"),
    ("Adam", {"torch_adam": True}, {}, True, "torch.optim.AdamW"),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, {}, False, "torch.optim.Adam"),
    ("AdamW", {"torch_adam": True, "adam_w_mode": False}, {}, True, "torch.optim.AdamW"),
    ("Adam", {"torch_adam": True}, OFFLOAD, True, "torch.optim.AdamW"),
    # torch.optim.Adam built with its own decoupled_weight_decay=True runs AdamW's rule.
    ("Adam", {"torch_adam": True, "adam_w_mode": False, "decoupled_weight_decay": True}, {},
     True, "torch.optim.Adam"),
])
def test_adam_w_mode_resolves_as_deepspeed_does(name, params, extra, decoupled, built):
    c = tidal.Config.load({"optimizer": {"type": name, "params": {"weight_decay": 0.1, **params}},
                           **extra})
    assert c.adam_w_mode is decoupled
    assert c.deepspeed_optimizer == built
    assert c.optimizer_type == ("AdamW" if name.lower() == "adamw" else "Adam")
    assert c.weight_decay == 0.1


@pytest.mark.parametrize("params,built,default", [
    # The class's own default: FusedAdam(weight_decay=0.) in ops/adam/fused_adam.py,
    # DeepSpeedCPUAdam(weight_decay=0) in ops/adam/cpu_adam.py, torch 2.13's
    # AdamW(weight_decay=0.01) and Adam(weight_decay=0).
    ({}, "FusedAdam", 0.0),
    ({"torch_adam": True}, "torch.optim.AdamW", 0.01),
    ({"torch_adam": True, "adam_w_mode": False}, "torch.optim.Adam", 0.0),
])
def test_weight_decay_default_is_that_of_the_class_deepspeed_builds(params, built, default):
    c = tidal.Config.load({"optimizer": {"type": "Adam", "params": params}})
    assert (c.deepspeed_optimizer, c.weight_decay) == (built, default)


def test_adamw_with_adam_w_mode_false_stays_decoupled_and_says_so():
    c, messages = load({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert c.adam_w_mode is True
    assert messages == [
        "config key 'optimizer.params.adam_w_mode' = False is not used by tidal: with type "
        "'AdamW' DeepSpeed 0.19.8 decouples the weight decay whatever adam_w_mode says, and so "
        "does tidal; for L2 decay write type 'Adam' with adam_w_mode false"]


def _train(cfg, model, batches):
    engine = tidal.initialize(model, cfg)
    try:
        train_tidal(engine, batches)
        return {n: p.detach().clone() for n, p in engine.parameters_fp32().items()}
    finally:
        engine.remove_hooks()


def _reference(opt_class, model, batches, lr, wd):
    opt = opt_class(model.parameters(), lr=lr, weight_decay=wd)
    for x, y in batches:
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("params,rule", [({}, torch.optim.AdamW),
                                         ({"adam_w_mode": False}, torch.optim.Adam)])
def test_the_engine_runs_the_rule_deepspeed_resolves_for_type_adam(sim_device, params, rule):
    # "Adam" alone trains as AdamW (decoupled decay); "Adam" with adam_w_mode
    # false as torch's Adam (L2 decay added to the gradient).
    lr, wd = 0.05, 0.2
    torch.manual_seed(0)
    model = Reversed(width=8, depth=2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(4)]
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": lr, "weight_decay": wd, **params}},
           "tidal": {"chunk_size": 4096}}
    got = _train(cfg, model, batches)
    other = torch.optim.Adam if rule is torch.optim.AdamW else torch.optim.AdamW
    results = {}
    for cls in (rule, other):
        ref = Reversed(width=8, depth=2)
        ref.load_state_dict(start)
        results[cls] = _reference(cls, ref, batches, lr, wd)
    for n in got:
        torch.testing.assert_close(got[n], results[rule][n], rtol=1e-5, atol=1e-6)
    # The two rules differ by far more than that here, so the match means something.
    assert max((results[rule][n] - results[other][n]).abs().max().item() for n in got) > 1e-3


@pytest.mark.parametrize("name,message", [
    ("Lamb", "'Lamb' is DeepSpeed's FusedLamb (LAMB) optimizer, which tidal cannot run"),
    ("lion", "'lion' is DeepSpeed's Lion optimizer, which tidal cannot run"),
    ("Adagrad", "'Adagrad' is DeepSpeed's Adagrad optimizer, which tidal cannot run"),
    ("MuAdamW", "'MuAdamW' is DeepSpeed's mup's MuAdamW optimizer, which tidal cannot run"),
    ("Muon", "'Muon' is DeepSpeed's Muon (with an auxiliary Adam) optimizer, which tidal cannot run"),
    ("SGD", "DeepSpeed builds torch.optim.SGD for 'SGD', which tidal cannot run"),
    ("RMSprop", "DeepSpeed builds torch.optim.RMSprop for 'RMSprop', which tidal cannot run"),
    ("OneBitAdam", "'OneBitAdam' is neither one of DeepSpeed 0.19.8's optimizer names nor a class "
                   "of torch.optim (DeepSpeed 0.19.8 has no 1-bit optimizers), so DeepSpeed fails "
                   "on it too"),
    ("FusedAdam", "'FusedAdam' is a class DeepSpeed picks itself for type 'Adam' or 'AdamW' "
                  "(DeepSpeedCPUAdam when zero_optimization.offload_optimizer.device is 'cpu', "
                  "FusedAdam otherwise); write 'Adam' or 'AdamW'"),
    ("CPUAdam", "'CPUAdam' is a class DeepSpeed picks itself"),
])
def test_optimizers_tidal_cannot_run_are_errors_naming_the_type(name, message):
    text = error({"optimizer": {"type": name, "params": {"lr": 0.1}}})
    assert text.startswith("config key 'optimizer.type': ")
    assert message in text
    if "DeepSpeed picks" not in message:
        assert "; tidal runs 'Adam' and 'AdamW' (any case, as DeepSpeed reads them)" in text


@pytest.mark.parametrize("params,message", [
    # torch.optim.AdamW (torch_adam) takes no bias_correction or set_grad_none.
    ({"torch_adam": True, "bias_correction": False},
     "config key 'optimizer.params.bias_correction': not a parameter of torch.optim.AdamW, the "
     "optimizer DeepSpeed 0.19.8 builds for this config, so DeepSpeed fails on it; "
     "torch.optim.AdamW takes lr, betas, eps, weight_decay, amsgrad, foreach, maximize, "
     "capturable, differentiable, fused"),
    ({"torch_adam": True, "set_grad_none": True},
     "config key 'optimizer.params.set_grad_none': not a parameter of torch.optim.AdamW"),
    # FusedAdam takes no foreach (DeepSpeed pops it only under torch_adam).
    ({"foreach": True}, "config key 'optimizer.params.foreach': not a parameter of FusedAdam"),
    ({"decoupled_weight_decay": True},
     "config key 'optimizer.params.decoupled_weight_decay': not a parameter of FusedAdam"),
    ({"amsgrad": True}, "config key 'optimizer.params.amsgrad' = True asks for another update "
                        "rule: tidal's Adam has no AMSGrad variant"),
    ({"torch_adam": True, "maximize": True},
     "config key 'optimizer.params.maximize' = True asks for another update rule: tidal's Adam "
     "minimizes the loss"),
    ({"max_grad_norm": 1.0}, "config key 'optimizer.params.max_grad_norm': 'max_grad_norm' is not "
                             "an optimizer parameter (DeepSpeed rejects it too)"),
    ({"weight_decy": 0.1},
     "unknown config key 'optimizer.params.weight_decy'; did you mean 'weight_decay'?"),
])
def test_optimizer_params_are_those_of_the_class_deepspeed_builds(params, message):
    assert message in error({"optimizer": {"type": "Adam", "params": params}})


def test_optimizer_switches_tidal_does_not_need_are_reported():
    c, messages = load({"optimizer": {"type": "Adam", "legacy_fusion": True, "params": {
        "torch_adam": True, "fp32_optimizer_states": False, "fused": True, "foreach": False,
        "amsgrad": False, "maximize": False}}})
    assert c.adam_w_mode is True and c.deepspeed_optimizer == "torch.optim.AdamW"
    assert reported(messages) == {"optimizer.params.torch_adam",
                                  "optimizer.params.fp32_optimizer_states",
                                  "optimizer.params.fused", "optimizer.legacy_fusion"}
    assert ("config key 'optimizer.params.torch_adam' = True is not used by tidal: tidal runs its "
            "own fused Adam on the CPU and the device, with the update rule of the "
            "torch.optim.Adam or AdamW DeepSpeed builds for it") in messages


def test_a_missing_optimizer_block_is_a_warning_naming_the_default():
    c, messages = load({"train_micro_batch_size_per_gpu": 2})
    assert (c.optimizer_type, c.adam_w_mode, c.lr, c.betas, c.eps, c.weight_decay) == \
        ("AdamW", True, 1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert messages == [
        "the config has no 'optimizer' block: tidal trains with AdamW (lr 0.001, betas (0.9, "
        "0.999), eps 1e-08, weight_decay 0.0, decoupled weight decay, bias correction on). "
        "DeepSpeed builds no optimizer from such a config (it takes one from "
        "deepspeed.initialize); write an 'optimizer' block to choose"]
    # No config at all is tidal's defaults, asked for: no warning.
    _, none = load(None)
    assert none == []
    c, typeless = load({"optimizer": {"params": {"lr": 0.1}}})
    assert c.optimizer_type == "AdamW" and c.adam_w_mode is True and c.lr == 0.1
    assert typeless == [
        "the config's 'optimizer' block has no 'type': tidal trains with AdamW (decoupled weight "
        "decay) and the block's params. DeepSpeed builds no optimizer from a block without a type "
        "(it takes one from deepspeed.initialize); write 'AdamW' or 'Adam'"]


# ---------------------------------------------------------- DeepSpeed's keys
def test_the_keys_issue_29_found_rejected_are_accepted_and_reported():
    c, messages = load({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
        "cuda_visible_devices": "0",
        "communication_data_type": "fp32",
        "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": -1},
        "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert c.precision == "bf16" and c.adam_w_mode is True and c.weight_decay == 0.01
    assert reported(messages) == {
        "optimizer.params.torch_adam", "bf16.bf16_master_weights_and_grads",
        "cuda_visible_devices", "communication_data_type", "flops_profiler.enabled",
        "flops_profiler.profile_step", "zero_optimization.stage",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save"}
    assert ("config key 'cuda_visible_devices' = '0' is not used by tidal: DeepSpeed 0.19.8 does "
            "not read it either; the devices a process sees come from the CUDA_VISIBLE_DEVICES "
            "environment variable") in messages
    assert ("config key 'communication_data_type' = 'fp32' is not used by tidal: tidal reduces "
            "gradients in the parameters' dtype, bf16 here (Note [Data parallel by chunk] in "
            "tidal/data_parallel.py)") in messages
    assert ("config key 'bf16.bf16_master_weights_and_grads' = True is not used by tidal: tidal "
            "keeps fp32 master weights and fp32 Adam states in chunks") in messages
    assert ("config keys 'flops_profiler.enabled' = True, 'flops_profiler.profile_step' = 2 are "
            "not used by tidal: tidal has no FLOPS profiler; engine.memory_report() gives its "
            "memory and CPU Adam figures") in messages
    # The parameters' own dtype is what tidal reduces in: honoured, no warning.
    _, quiet = load({"optimizer": {"type": "AdamW"}, "bf16": {"enabled": True},
                     "communication_data_type": "BF16"})
    assert quiet == []


def test_the_old_bfloat16_block_is_read_only_without_bf16():
    # deepspeed/runtime/precision_config.py, get_bfloat16_config: "bfloat16" is
    # read when "bf16" is absent.
    c, messages = load({"optimizer": {"type": "AdamW"}, "bfloat16": {"enabled": True}})
    assert c.precision == "bf16" and messages == []
    c, messages = load({"optimizer": {"type": "AdamW"}, "bf16": {"enabled": False},
                        "bfloat16": {"enabled": True}})
    assert c.precision == "fp32"
    assert messages == ["config key 'bfloat16' = {'enabled': True} is not used by tidal: DeepSpeed "
                        "reads its old name of 'bf16' only when 'bf16' is absent, and 'bf16' is "
                        "given"]


def test_deepspeeds_own_format_examples_load_and_what_tidal_lacks_is_reported():
    c, messages = load(CONFIGS / "deepspeed_format_examples.json")
    # dataloader_drop_last is used: tidal.deepspeed.initialize(training_data=...)'s loader.
    assert c.raw["dataloader_drop_last"] is True
    assert c.precision == "bf16" and c.gradient_clipping == 1.0
    # Values that are DeepSpeed's defaults (gradient_predivide_factor 1.0,
    # gradient_allreduce_op "mean", bf16.check_grad_overflow true, timers on,
    # aio's defaults, ...) ask for nothing and are not reported.
    assert reported(messages) == {
        "communication_data_type", "prescale_gradients", "disable_allgather", "dump_state",
        "disable_python_gc", "vocabulary_size", "wall_clock_breakdown",
        "comms_logger.enabled", "comms_logger.prof_ops", "flops_profiler.enabled",
        "flops_profiler.top_modules", "checkpoint.checkpoint_serialization"}
    assert ("config keys 'comms_logger.enabled' = True, 'comms_logger.prof_ops' = ['all_reduce', "
            "'custom_all_reduce_name'] are not used by tidal: tidal logs no collectives") in messages
    assert ("config keys 'prescale_gradients' = True, 'disable_allgather' = True are not used by "
            "tidal: they tune DeepSpeed's bucketed data-parallel communication; tidal reduces and "
            "broadcasts whole chunks (Note [Data parallel by chunk] in "
            "tidal/data_parallel.py)") in messages


def test_deepspeeds_autotuning_zero3_template_loads():
    c, messages = load(CONFIGS / "deepspeed_autotuning_template_zero3.json")
    assert c.optimizer_type == "AdamW" and messages[0].startswith(
        "the config has no 'optimizer' block")
    assert reported(messages) == {
        "zero_optimization." + k for k in (
            "stage", "allgather_partitions", "allgather_bucket_size", "overlap_comm",
            "reduce_scatter", "reduce_bucket_size", "contiguous_gradients",
            "stage3_max_live_parameters", "stage3_max_reuse_distance",
            "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "sub_group_size")}


@pytest.mark.parametrize("config,keys,what", [
    ({"tensorboard": {"enabled": True, "output_path": "logs/"}, "wandb": {"enabled": False,
                                                                          "project": "x"}},
     {"tensorboard.enabled", "tensorboard.output_path"},
     "tidal writes no TensorBoard, W&B, CSV or Comet logs"),
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
     {"torch_autocast.enabled", "torch_autocast.dtype"}, "tidal runs no torch.autocast"),
    ({"autotuning": {"enabled": True, "fast": False}}, {"autotuning.enabled", "autotuning.fast"},
     "tidal has no autotuner"),
    ({"zero_optimization": {"zero_quantized_weights": True, "zero_hpz_partition_size": 8}},
     {"zero_optimization.zero_quantized_weights", "zero_optimization.zero_hpz_partition_size"},
     "tidal has no ZeRO++"),
    ({"zero_optimization": {"prefetch_bucket_size": 1000}},   # the field name behind the alias
     {"zero_optimization.prefetch_bucket_size"}, "ZeRO-3's fetch"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, {"data_types.grad_accum_dtype"},
     "tidal sums gradients over micro batches in fp32 chunks"),
    ({"compile": {"deepcompile": True}}, {"compile.deepcompile"}, "no DeepCompile"),
    ({"pipeline": {"stages": 2}}, {"pipeline"}, "tidal has no pipeline parallelism"),
    ({"tensor_parallel": {"autotp_size": 2}}, {"tensor_parallel"}, "tidal has no tensor "
                                                                   "parallelism"),
    ({"data_efficiency": {"enabled": True}}, {"data_efficiency"}, "no data-efficiency"),
    ({"hybrid_engine": {"enabled": True}}, {"hybrid_engine.enabled"}, "inference (hybrid) engine"),
    ({"gradient_allreduce_op": "SUM"}, {"gradient_allreduce_op"},
     "one process has no gradients to sum"),
    ({"sequence_parallel_size": 2}, {"sequence_parallel_size"}, "no sequence parallelism"),
])
def test_deepspeed_key_groups_are_reported_with_what_tidal_does(config, keys, what):
    _, messages = load({"optimizer": {"type": "AdamW"}, **config})
    assert reported(messages) == keys
    assert any(what in m for m in messages), messages
    # The same blocks switched off, or at DeepSpeed's defaults, ask for nothing.
    _, quiet = load({"optimizer": {"type": "AdamW"}, "tensorboard": {"enabled": False},
                     "autotuning": {"enabled": False, "fast": False},
                     "zero_optimization": {"zero_quantized_weights": False},
                     "data_types": {"grad_accum_dtype": "fp32", "keep_in_fp32_modules": "auto"},
                     "pipeline": {}, "tensor_parallel": {"autotp_size": 0},
                     "data_efficiency": {"enabled": False}, "gradient_allreduce_op": "mean"})
    assert quiet == []


@pytest.mark.parametrize("config,message", [
    ({"elasticity": {"enabled": True}},
     "config key 'elasticity': DeepSpeed 0.19.8 removed this feature and rejects the key too: "
     "elastic training; write train_batch_size, train_micro_batch_size_per_gpu and "
     "gradient_accumulation_steps directly"),
    ({"amp": {"enabled": True}}, "config key 'amp': DeepSpeed 0.19.8 removed this feature"),
    ({"zero_optimization": {"mics_shard_size": 8}},
     "config key 'zero_optimization.mics_shard_size': DeepSpeed 0.19.8 removed this feature"),
    ({"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}},
     "config key 'zero_optimization.zenflow': ZenFlow updates the less important gradients later"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
     "config key 'zero_optimization.offload_param.nvme_path': expected the folder for the NVMe "
     "tier's file"),
    ({"communication_data_type": "int8"},
     "config key 'communication_data_type': expected 'fp16', 'bf16' or 'fp32' (any case) or null, "
     "got 'int8'"),
    ({"tensorboard": {"enable": True}},
     "unknown config key 'tensorboard.enable'; did you mean 'enabled'?"),
    # DeepSpeed's own ACTIVATION_CHKPT_FORMAT example misspells the key its reader reads.
    ({"activation_checkpointing": {"partitioned_activations": True}},
     "unknown config key 'activation_checkpointing.partitioned_activations'; did you mean "
     "'partition_activations'?"),
    ({"cuda_visible_device": "0"},
     "unknown config key 'cuda_visible_device'; did you mean 'cuda_visible_devices'?"),
])
def test_what_deepspeed_rejects_or_tidal_cannot_do_is_an_error(config, message):
    assert message in error({"optimizer": {"type": "AdamW"}, **config})


def test_gradients_summed_over_ranks_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    text = error({"train_batch_size": 4, "gradient_allreduce_op": "sum",
                  "tidal": {"data_parallel": {"enabled": True}}})
    assert text == ("config key 'gradient_allreduce_op' = 'sum' asks for the ranks' gradients "
                    "summed, not averaged; tidal averages them ('mean')")


# Keys tidal acts on (so no "not used" warning is due when they change).
HONOURED = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "steps_per_print", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "optimizer.type", "optimizer.params.lr",
    "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "optimizer.params.bias_correction", "fp16.enabled", "fp16.loss_scale",
    "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis",
    "fp16.min_loss_scale", "bf16.enabled", "bfloat16.enabled", "scheduler.type",
    "scheduler.params", "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_param.pin_memory", "gradient_allreduce_op",
    "dataloader_drop_last",  # tidal.deepspeed.initialize's loader (test_deepspeed_initialize.py)
    "aio.block_size", "aio.queue_depth",  # the NVMe tier's requests (test_engine_nvme.py)
}


def _put(cfg, path, value):
    node = cfg
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value
    return cfg


def _leaves(schema, prefix=()):
    for key, spec in schema.items():
        if isinstance(spec, dict):
            yield from _leaves(spec, prefix + (key,))
        else:
            yield prefix + (key,), spec


def _changed(path, spec):
    """A value of the key's kind that is not its default (and not DeepSpeed's default)."""
    kind, default = spec[0], spec[1]
    special = {"communication_data_type": "fp16", "seq_parallel_communication_data_type": "bf16",
               "gradient_allreduce_op": "sum", "tag_validation": "Fail",
               "keep_in_fp32_modules": ["lm_head"], "grad_accum_dtype": "bf16",
               "param_dtype": "bf16", "buffer_dtype": "bf16", "device": "cpu",
               "fp32_optimizer_states": False,
               "stage": 2, "type": "Adam", "datastates_ckpt": {"path": "x"},
               "tensor_parallel": {"autotp_size": 2}}
    if path[-1] in special:
        return special[path[-1]]
    types = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(kind, tuple) and all(isinstance(k, str) for k in kind):
        return next(k for k in kind if k != default)
    if bool in types:
        return not default if isinstance(default, bool) else True
    if dict in types or kind is dict:
        return {"enabled": True}
    if list in types:
        return ["x"]
    if int in types or float in types:
        return (default or 1) + 1
    if str in types:
        return "x"
    raise AssertionError(f"no changed value for {path}: {spec}")


DEEPSPEED_LEAVES = [(p, s) for p, s in _leaves(SCHEMA) if p[0] not in ("tidal",)
                    and p[:2] != ("scheduler", "params") and p[0] != "activation_checkpointing"]


@pytest.mark.parametrize("path,spec", DEEPSPEED_LEAVES, ids=[".".join(p) for p, _ in DEEPSPEED_LEAVES])
def test_no_deepspeed_key_is_silently_ignored(path, spec):
    # Every DeepSpeed key (activation_checkpointing and the scheduler's params
    # have their own tests) loads at DeepSpeed's default, and a value that asks
    # for something is honoured, reported by name, or an error naming it.
    base = {"optimizer": {"type": "AdamW", "params": {}}}
    # A key behind a block's switch is looked at with the switch on.
    for row in NOT_HONOURED:
        if row.path == path and row.switch is not None:
            _put(base, row.switch[0], True)

    def with_value(v):
        return _put(json.loads(json.dumps(base)), path, v)
    kinds = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    # (The optimizer's params depend on the class DeepSpeed builds: their own test.)
    if (spec[1] is not None or type(None) in kinds) and path[:2] != ("optimizer", "params"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tidal.Config.load(with_value(spec[1]))
    name = ".".join(path)
    try:
        _, messages = load(with_value(_changed(path, spec)))
    except tidal.ConfigError as e:
        assert name in str(e), str(e)
        return
    assert name in HONOURED or name in reported(messages) or \
        any(f"'{name}'" in m for m in messages), (name, messages)


def test_the_deepspeed_schema_has_what_deepspeed_0_19_8_reads_at_the_top_level():
    # The top-level keys DeepSpeedConfig._initialize_params and deepspeed.initialize
    # read (deepspeed/runtime/config.py, deepspeed/__init__.py), written out here.
    read = {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "managed_gradient_accumulation", "steps_per_print", "dump_state", "disable_python_gc",
        "disable_allgather", "communication_data_type", "seq_parallel_communication_data_type",
        "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op",
        "zero_optimization", "activation_checkpointing", "comms_logger", "tensorboard", "wandb",
        "csv_monitor", "comet", "gradient_clipping", "fp16", "bf16", "bfloat16", "torch_autocast",
        "optimizer", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "scheduler",
        "flops_profiler", "wall_clock_breakdown", "memory_breakdown", "autotuning",
        "use_data_before_expert_parallelism", "hybrid_engine", "pipeline", "data_efficiency",
        "checkpoint", "data_types", "aio", "dataloader_drop_last", "log_level", "datastates_ckpt",
        "weight_quantization", "compile", "timers", "tensor_parallel", "expert_parallel",
        "vocabulary_size", "sequence_parallel_size", "data_parallel_size", "allgather_size"}
    assert read <= set(SCHEMA)
    assert set(SCHEMA) - read == {"tidal"}
    assert set(DEEPSPEED_SCHEMA) <= read


# ------------------------------------------------------------------- "auto"
HF_Z3_AUTO = [
    "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
    "optimizer.params.eps", "optimizer.params.weight_decay",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "gradient_accumulation_steps",
    "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps"]


def test_hf_zero3_template_is_one_error_listing_every_auto_key():
    text = error(CONFIGS / "hf_ds_config_zero3.json")
    assert text.startswith(
        '16 config keys are "auto", the Hugging Face Trainer\'s placeholder, which its DeepSpeed '
        "integration fills from TrainingArguments and the model before training. Outside the "
        "Trainer write a value for each (or fill them with tidal.Config.fill_auto(config, "
        "values)); the Trainer would write:\n")
    listed = re.findall(r"^  '([a-z0-9_.]+)': ", text, flags=re.M)
    assert listed == HF_Z3_AUTO
    assert "  'optimizer.params.betas': [TrainingArguments.adam_beta1, " \
           "TrainingArguments.adam_beta2]\n" in text
    assert "  'train_micro_batch_size_per_gpu': TrainingArguments.per_device_train_batch_size" \
        in text
    assert "  'zero_optimization.reduce_bucket_size': hidden_size * hidden_size of the model's " \
           "config; tidal does not use it: write a number or drop the key" in text


def _trainer_values(hidden=64):
    # What the Trainer's integration would write for TrainingArguments(
    # per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-4,
    # weight_decay=0.01, warmup_steps=10, bf16=True) on one process and a model of hidden size 64.
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "train_batch_size": 8, "gradient_clipping": 1.0, "optimizer.params.lr": 3e-4,
            "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
            "optimizer.params.weight_decay": 0.01, "scheduler.params.warmup_min_lr": 0,
            "scheduler.params.warmup_max_lr": 3e-4, "scheduler.params.warmup_num_steps": 10,
            "fp16.enabled": False, "bf16.enabled": True,
            "zero_optimization.reduce_bucket_size": hidden * hidden,
            "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "zero_optimization.stage3_param_persistence_threshold": 10 * hidden}


@pytest.mark.parametrize("name", ["hf_ds_config_zero2.json", "hf_ds_config_zero3.json"])
def test_fill_auto_fills_the_hf_templates_and_they_load(name):
    raw = json.loads((CONFIGS / name).read_text())
    filled = tidal.Config.fill_auto(CONFIGS / name, _trainer_values())
    assert json.loads((CONFIGS / name).read_text()) == raw   # the file is not changed
    assert "auto" not in json.dumps(filled)
    assert filled["steps_per_print"] == 2000
    if name.endswith("zero2.json"):  # keys the template does not have are not added
        assert "stage3_prefetch_bucket_size" not in filled["zero_optimization"]
    c, messages = load(filled)
    assert (c.micro_batch_size, c.gradient_accumulation_steps, c.train_batch_size) == (4, 2, 8)
    assert (c.lr, c.betas, c.eps, c.weight_decay) == (3e-4, (0.9, 0.999), 1e-8, 0.01)
    assert c.precision == "bf16" and c.gradient_clipping == 1.0 and c.adam_w_mode is True
    assert c.scheduler == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10, "warmup_type": "log",
        "last_batch_iteration": -1}}
    assert c.deepspeed_optimizer == "DeepSpeedCPUAdam"
    assert "zero_optimization.reduce_bucket_size" in reported(messages)


def test_fill_auto_fills_only_auto_and_leaves_the_rest_to_load():
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
           "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": "auto"}},
           "tidal": {"device": "auto"}}
    filled = tidal.Config.fill_auto(cfg, {"train_micro_batch_size_per_gpu": 8,
                                          "optimizer.params.lr": 0.01, "gradient_clipping": 2.0,
                                          "tidal.device": "sim"})
    # A given value stays; a key the config lacks is not added; tidal.device's
    # "auto" is its own value, but fill_auto fills what it is told to fill.
    assert filled["train_micro_batch_size_per_gpu"] == 2 and "gradient_clipping" not in filled
    assert filled["optimizer"]["params"] == {"lr": 0.01, "eps": "auto"}
    assert cfg["optimizer"]["params"]["lr"] == "auto"    # the input is not changed
    text = error(filled)
    assert text.startswith("the config has 2 problems:\n"
                           "  - config key 'steps_per_print': expected an integer >= 1, got 0\n"
                           "  - 2 config keys are \"auto\"")
    assert "config key 'gradient_accumulation_steps' is" not in text
    assert "2 config keys are \"auto\"" in text
    assert re.findall(r"^      '([a-z0-9_.]+)': ", text, flags=re.M) == [
        "gradient_accumulation_steps", "optimizer.params.eps"]
    with pytest.raises(TypeError, match="fill_auto: expected dotted config keys"):
        tidal.Config.fill_auto(cfg, {3: 1})


def test_auto_where_it_is_a_real_value_is_no_placeholder():
    c, messages = load({"optimizer": {"type": "AdamW"}, "tidal": {"device": "auto",
                                                                 "data_parallel": {"enabled": "auto"}},
                        "data_types": {"keep_in_fp32_modules": "auto"}})
    assert c.device == "auto" and messages == []


def test_every_key_the_trainer_fills_is_a_schema_key():
    for key in AUTO_FILLED_BY:
        if key.startswith("scheduler.params."):
            assert any(key.rsplit(".", 1)[1] in ps for ps in tidal.lr_schedules.PARAMS.values())
            continue
        node = SCHEMA
        for k in key.split("."):
            node = node[k]
        assert isinstance(node, tuple), key


# ----------------------------------------------------------- one pass
def test_every_problem_of_a_config_is_in_one_error():
    text = error({"train_micro_batch_size_per_gpu": "4", "gradient_cliping": 1.0,
                  "optimizer": {"type": "Lamb", "params": {"lr": -1}},
                  "fp16": {"enabled": True, "hysteresis": 0}, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 4, "offload_optimizer": {"device": "nvme"}},
                  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}},
                  "tidal": {"chunk_size": 100, "eviction_policy": "lfu"}})
    problems = re.findall(r"^  - (.*)$", text, flags=re.M)
    assert text.startswith(f"the config has {len(problems)} problems:\n")
    expected = [
        "config key 'train_micro_batch_size_per_gpu': expected int, got str '4'",
        "unknown config key 'gradient_cliping'; did you mean 'gradient_clipping'?",
        "config key 'tidal.eviction_policy': expected one of 'opt', 'lru', got 'lfu'",
        "config key 'zero_optimization.stage': expected 0, 1, 2 or 3, got 4",
        "config key 'zero_optimization.offload_optimizer.nvme_path': expected the folder for the "
        "NVMe tier's file when device is 'nvme', got None",
        "config key 'optimizer.type': 'Lamb' is DeepSpeed's FusedLamb (LAMB) optimizer",
        "config key 'optimizer.params.lr': expected a finite learning rate >= 0, got -1",
        "config keys 'fp16.enabled' and 'bf16.enabled' are both true",
        "config key 'fp16.hysteresis': expected >= 1, got 0",
        "config key 'scheduler.params.total_num_steps': required by WarmupDecayLR",
        "config key 'tidal.chunk_size': expected at least 4 KiB and a multiple of 256 bytes",
        "config key 'scheduler.params.warmup_num_steps' is \"auto\"",
    ]
    assert len(problems) == len(expected)
    for part in expected:
        assert sum(part in p for p in problems) == 1, (part, problems)
