"""tidal.Config: DeepSpeed's tutorial configs load, and every error names its key.

The files in configs/ next to this test:

- getting_started.json: the sample config of DeepSpeed's Getting Started page,
  verbatim (its legacy "zero_optimization": true included).
- bing_bert_bsz4096.json: deepspeed_bsz4096_adam_config.json of DeepSpeed's
  BERT pre-training tutorial, verbatim. Its optimizer.params.max_grad_norm is
  rejected, as DeepSpeed itself rejects it today.
- cifar10_fp16_warmuplr.json / cifar10_bf16_zero2.json: the ds_config of
  DeepSpeedExamples' training/cifar/cifar10_deepspeed.py (DeepSpeed's CIFAR-10
  tutorial) for --dtype fp16 --stage 0 and --dtype bf16 --stage 2.
- zero_offload_gpt2_10b.json: the zero_optimization block of DeepSpeed's
  ZeRO-Offload tutorial (10B GPT-2 on one V100; its missing commas fixed),
  with the tutorial's batch size of 10 and Megatron GPT-2's Adam/fp16 keys.
- warmup_decay_bf16_zero3_offload.json: written for this test from the keys of
  DeepSpeed's config-json documentation: WarmupDecayLR, bf16, ZeRO-3 with CPU
  offload of parameters and optimizer, activation_checkpointing.

The expected values and messages are written out by hand below.
"""
import json
import re
import warnings
from pathlib import Path

import pytest

import tidal

CONFIGS = Path(__file__).parent / "configs"

_COMM = ("not used by tidal: they tune DeepSpeed's bucketed data-parallel communication; tidal "
         "reduces and broadcasts whole chunks (Note [Data parallel by chunk] in "
         "tidal/data_parallel.py)")


def load_with_warnings(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = tidal.Config.load(config)
    for w in caught:
        assert w.filename == __file__, f"warning attributed to {w.filename}, not the caller"
    return c, [str(w.message) for w in caught]


def reported_keys(messages):
    """The config keys named in 'not used by tidal' warnings."""
    keys = set()
    for m in messages:
        if "not used by tidal" in m:
            keys |= set(re.findall(r"'([a-z0-9_.]+)' = ", m))
    return keys


# ------------------------------------------------------ the tutorial configs
def test_zero_offload_tutorial_config_loads_and_reports_what_tidal_does_instead():
    c, messages = load_with_warnings(CONFIGS / "zero_offload_gpt2_10b.json")
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (10, 10, 1)
    assert c.precision == "fp16" and c.loss_scale == 0.0 and c.loss_scale_window == 1000
    assert c.optimizer_type == "Adam" and c.lr == 0.00015 and c.betas == (0.9, 0.95)
    # "Adam" without adam_w_mode decouples the weight decay, as DeepSpeed 0.19.8 resolves it
    # (runtime/engine.py, DeepSpeedEngine._configure_basic_optimizer: ADAM_W_MODE_DEFAULT is
    # true); with offload_optimizer.device "cpu" DeepSpeed builds DeepSpeedCPUAdam for it.
    assert c.adam_w_mode is True and c.deepspeed_optimizer == "DeepSpeedCPUAdam"
    assert c.weight_decay == 0.01 and c.gradient_clipping == 1.0
    assert c.scheduler is None and c.pin_memory is True
    assert messages == [
        "config key 'zero_optimization.stage' = 2 is not used by tidal: tidal has no ZeRO stages "
        "on one GPU; chunks decide placement",
        "config key 'zero_optimization.offload_optimizer.device' = 'cpu' is not used by tidal: "
        "tidal keeps optimizer states in chunks in host memory and on the device as the budget "
        "allows",
        "config key 'zero_optimization.overlap_comm' = True is not used by tidal: tidal's key is "
        "tidal.data_parallel.overlap_comm (on by default: each chunk's gradient reduction starts "
        "during backward as soon as its gradients are final)",
        "config key 'zero_optimization.contiguous_gradients' = True is " + _COMM,
    ]


@pytest.mark.parametrize("name,precision,stage", [("cifar10_fp16_warmuplr.json", "fp16", 0),
                                                  ("cifar10_bf16_zero2.json", "bf16", 2)])
def test_cifar10_tutorial_configs_load_with_their_warmup_lr(name, precision, stage):
    c, messages = load_with_warnings(CONFIGS / name)
    assert c.precision == precision
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (16, 16, 1)
    assert c.steps_per_print == 2000 and c.gradient_clipping == 1.0
    assert c.optimizer_type == "Adam" and c.lr == 0.001 and c.betas == (0.8, 0.999)
    assert c.eps == 1e-8 and c.weight_decay == 3e-7
    assert (c.initial_scale_power, c.loss_scale_window, c.hysteresis, c.min_loss_scale) == \
        (15, 500, 2, 1.0)
    assert c.scheduler == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
        "warmup_type": "log", "last_batch_iteration": -1}}
    # prescale_gradients, wall_clock_breakdown, fp16_master_weights_and_grads and
    # cpu_offload are false: they ask for nothing tidal lacks, so no warning.
    assert reported_keys(messages) == {
        "zero_optimization.stage", "zero_optimization.allgather_partitions",
        "zero_optimization.reduce_scatter", "zero_optimization.allgather_bucket_size",
        "zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients"}
    assert f"config key 'zero_optimization.stage' = {stage} is not used by tidal" in messages[0]
    assert len(messages) == 3   # stage, overlap_comm, one warning for the five communication keys
    sched = tidal.lr_schedules.build_scheduler(c)
    assert sched.lr_at(-1) == 0 and sched.lr_at(999) == pytest.approx(0.001, rel=1e-15)


def test_warmup_decay_zero3_config_loads_with_activation_checkpointing():
    c, messages = load_with_warnings(CONFIGS / "warmup_decay_bf16_zero3_offload.json")
    assert c.precision == "bf16"
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (64, 8, 8)
    assert c.optimizer_type == "AdamW" and c.adam_w_mode is True and c.lr == 2e-5
    assert c.scheduler == {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 500,
        "total_num_steps": 10000, "warmup_type": "linear", "last_batch_iteration": -1}}
    assert c.activation_checkpointing == {
        "partition_activations": False, "cpu_checkpointing": True,
        "contiguous_memory_optimization": False, "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": False, "profile": False}
    assert reported_keys(messages) == {
        "zero_optimization.stage", "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_param.device", "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients", "zero_optimization.sub_group_size",
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"}
    assert len(messages) == 7   # one per reason
    s = tidal.lr_schedules.build_scheduler(c)
    assert s.lr_at(250) == pytest.approx(1e-5, rel=1e-12)           # linear warm-up half-way
    assert s.lr_at(5250) == pytest.approx(1e-5, rel=1e-12)          # decay half-way
    assert s.lr_at(10000) == 0.0


def test_getting_started_config_reads_legacy_zero_true_as_stage_1():
    c, messages = load_with_warnings(CONFIGS / "getting_started.json")
    assert c.precision == "fp16" and c.lr == 0.00015 and c.micro_batch_size == 8
    assert c.raw["zero_optimization"]["stage"] == 1
    assert messages == [
        "config key 'zero_optimization' = True is DeepSpeed's deprecated form; read as "
        "{\"stage\": 1} (write an object such as {\"stage\": 2})",
        "config key 'zero_optimization.stage' = 1 is not used by tidal: tidal has no ZeRO stages "
        "on one GPU; chunks decide placement"]
    _, quiet = load_with_warnings({"zero_optimization": False})
    assert quiet[0].startswith("config key 'zero_optimization' = False is DeepSpeed's deprecated "
                               "form; read as {\"stage\": 0}")


def test_bert_tutorial_max_grad_norm_is_rejected_with_deepspeeds_advice():
    with pytest.raises(tidal.ConfigError) as e:
        tidal.Config.load(CONFIGS / "bing_bert_bsz4096.json")
    assert str(e.value) == ("config key 'optimizer.params.max_grad_norm': 'max_grad_norm' is not an "
                            "optimizer parameter (DeepSpeed rejects it too); use the top-level "
                            "'gradient_clipping' instead")
    fixed = json.loads((CONFIGS / "bing_bert_bsz4096.json").read_text())
    fixed["gradient_clipping"] = fixed["optimizer"]["params"].pop("max_grad_norm")
    c = tidal.Config.load(fixed)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (4096, 64, 64)
    assert c.gradient_clipping == 1.0 and c.bias_correction is False


def test_values_that_ask_for_something_tidal_lacks_are_reported():
    _, messages = load_with_warnings({
        "wall_clock_breakdown": True, "prescale_gradients": True, "gradient_predivide_factor": 2,
        "fp16": {"enabled": True, "consecutive_hysteresis": True,
                 "fp16_master_weights_and_grads": True},
        "zero_optimization": {"cpu_offload": True, "offload_optimizer": {
            "device": "cpu", "nvme_path": "/local_nvme", "ratio": 0.5}}})
    assert reported_keys(messages) == {
        "wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
        "fp16.consecutive_hysteresis", "fp16.fp16_master_weights_and_grads",
        "zero_optimization.cpu_offload", "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_optimizer.ratio"}
    assert "config keys 'prescale_gradients' = True, 'gradient_predivide_factor' = 2 are " + _COMM \
        in messages
    _, none = load_with_warnings({"wall_clock_breakdown": False, "prescale_gradients": False,
                                  "gradient_predivide_factor": 1.0,
                                  "zero_allow_untested_optimizer": True,
                                  "optimizer": {"type": "AdamW"},
                                  "fp16": {"enabled": True, "auto_cast": False}})
    assert none == []


def test_activation_checkpointing_defaults_are_deepspeeds():
    c, messages = load_with_warnings({"optimizer": {"type": "AdamW"}})
    # deepspeed/runtime/activation_checkpointing/config.py, ACT_CHKPT_DEFAULT
    assert c.activation_checkpointing == {
        "partition_activations": False, "contiguous_memory_optimization": False,
        "cpu_checkpointing": False, "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False, "profile": False}
    assert messages == []
    c = tidal.Config.load({"activation_checkpointing": {"partition_activations": True,
                                                        "number_checkpoints": None}})
    assert c.activation_checkpointing["partition_activations"] is True
    assert c.activation_checkpointing["number_checkpoints"] is None


def test_equivalent_configs_resolve_to_the_same_raw_dict():
    a = tidal.Config.load({"scheduler": {"type": "WarmupLR"}})
    b = tidal.Config.load({"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_num_steps": 1000, "warmup_type": "log"}}})
    assert a.raw == b.raw and a.scheduler == b.scheduler
    assert tidal.Config.load(a) is a


def test_byte_sizes_parse_with_decimal_and_binary_units():
    c = tidal.Config.load({"tidal": {"device_memory_budget": "5GB", "chunk_size": "64MiB",
                                     "host_memory_budget": 123456, "device_margin": "1.5 KiB"}})
    assert c.device_memory_budget == 5_000_000_000 and c.chunk_size == 64 << 20
    assert c.host_memory_budget == 123456 and c.device_margin == 1536


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("config,message", [
    ({"gradient_cliping": 1.0},
     "unknown config key 'gradient_cliping'; did you mean 'gradient_clipping'? (the top level has "),
    ({"fp16": {"enable": True}}, "unknown config key 'fp16.enable'; did you mean 'enabled'? "
                                 "(valid keys in section 'fp16': auto_cast,"),
    ({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}},
     "unknown config key 'zero_optimization.offload_optimizer.devise'; did you mean 'device'?"),
    ({"activation_checkpointing": {"partition_activation": True}},
     "unknown config key 'activation_checkpointing.partition_activation'; did you mean "
     "'partition_activations'?"),
    ({"tidal": {"mystery": "1GB"}}, "unknown config key 'tidal.mystery' (valid keys in section "
                                    "'tidal': chunk_size, cpu_adam_pool, cpu_adam_threads, data_parallel, device,"),
    ({"optimizer": {"type": "AdamX"}},
     "config key 'optimizer.type': 'AdamX' is neither one of DeepSpeed 0.19.8's optimizer names nor "
     "a class of torch.optim, so DeepSpeed fails on it too; tidal runs 'Adam' and 'AdamW' (any "
     "case, as DeepSpeed reads them); did you mean 'Adam'?"),
    ({"train_micro_batch_size_per_gpu": "4"},
     "config key 'train_micro_batch_size_per_gpu': expected int, got str '4'"),
    ({"gradient_clipping": True}, "config key 'gradient_clipping': expected float or int, got bool True"),
    ({"fp16": {"enabled": "yes"}}, "config key 'fp16.enabled': expected bool, got str 'yes'"),
    ({"fp16": "on"}, "config key 'fp16': expected an object, got str 'on'"),
    ({"activation_checkpointing": {"number_checkpoints": False}},
     "config key 'activation_checkpointing.number_checkpoints': expected int or null, got bool False"),
    ({"activation_checkpointing": {"number_checkpoints": 0}},
     "config key 'activation_checkpointing.number_checkpoints': expected an integer >= 1 or null, "
     "got 0"),
    ({"activation_checkpointing": {"cpu_checkpointing": "true"}},
     "config key 'activation_checkpointing.cpu_checkpointing': expected bool, got str 'true'"),
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}},
     "config key 'zero_optimization.reduce_bucket_size': expected int or float, got str '5e8'"),
    ({"optimizer": {"params": {"betas": [0.9, 1.5]}}},
     "config key 'optimizer.params.betas': expected two numbers in [0, 1), got [0.9, 1.5]"),
    ({"gradient_clipping": -1}, "config key 'gradient_clipping': expected a norm >= 0 (0 = off), got -1.0"),
    ({"optimizer": {"params": {"lr": -0.1}}},
     "config key 'optimizer.params.lr': expected a finite learning rate >= 0, got -0.1"),
    ({"optimizer": {"params": {"eps": 0}}}, "config key 'optimizer.params.eps': expected eps > 0, got 0"),
    ({"fp16": {"initial_scale_power": 65}}, "config key 'fp16.initial_scale_power': expected 0..64, got 65"),
    ({"steps_per_print": 0}, "config key 'steps_per_print': expected an integer >= 1, got 0"),
    ({"tidal": {"chunk_size": 1000}},
     "config key 'tidal.chunk_size': expected at least 4 KiB and a multiple of 256 bytes, got 1000"),
    ({"tidal": {"prefetch_depth": 0}}, "config key 'tidal.prefetch_depth': expected an integer >= 1, got 0"),
    ({"tidal": {"eviction_policy": "lfu"}},
     "config key 'tidal.eviction_policy': expected one of 'opt', 'lru', got 'lfu' (did you mean 'lru'?)"),
    ({"zero_optimization": {"stage": 4}}, "config key 'zero_optimization.stage': expected 0, 1, 2 or 3, got 4"),
    ({"train_micro_batch_size_per_gpu": 0},
     "config key 'train_micro_batch_size_per_gpu': expected an integer >= 1, got 0"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
     "inconsistent batch sizes: train_batch_size=8 but train_micro_batch_size_per_gpu * "
     "gradient_accumulation_steps * ranks = 3 * 2 * 1 = 6 (one GPU)"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     "train_batch_size=10 is not a multiple of train_micro_batch_size_per_gpu * ranks = 4 * 1 "
     "(one GPU)"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 4},
     "train_batch_size=10 is not a multiple of gradient_accumulation_steps * ranks = 4 * 1 "
     "(one GPU)"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "config keys 'fp16.enabled' and 'bf16.enabled' are both true; enable at most one"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                              "nvme_path": "/no/such/nvme"}}},
     "config key 'zero_optimization.offload_optimizer.nvme_path': '/no/such/nvme' is not an "
     "existing folder; expected a folder on the disk to use"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
     "config key 'zero_optimization.offload_param.nvme_path': expected the folder for the NVMe "
     "tier's file when device is 'nvme', got None"),
    ({"aio": {"block_size": 1000}},
     "config key 'aio.block_size': expected a multiple of 4096 bytes (direct I/O's unit), got 1000"),
    ({"aio": {"queue_depth": 0}},
     "config key 'aio.queue_depth': expected 1 to 1024 requests in flight, got 0"),
    ({"zero_optimization": {"offload_param": {"device": "disk"}}},
     "config key 'zero_optimization.offload_param.device': expected one of 'cpu', 'none', 'nvme', "
     "got 'disk'"),
    ({"tidal": {"device_memory_budget": "5 gigs"}},
     "config key 'tidal.device_memory_budget': invalid byte size \"5 gigs\": unknown unit \"gigs\"; "
     "expected a non-negative number with an optional unit: B, KB/MB/GB/TB (powers of 1000) or "
     "KiB/MiB/GiB/TiB (powers of 1024)"),
    ({"tidal": {"host_memory_budget": "-3GB"}},
     "config key 'tidal.host_memory_budget': invalid byte size \"-3GB\""),
    ({"tidal": {"chunk_size": 5.5}},
     "config key 'tidal.chunk_size': expected a byte count (int or a string like '5GB'), got 5.5"),
    ({"tidal": {"device_margin": -1}}, "config key 'tidal.device_margin': expected a byte count >= 0, got -1"),
    ([1, 2], "config key '<root>': expected an object, got list [1, 2]"),
])
def test_errors_name_the_key_the_value_and_what_is_allowed(config, message):
    with pytest.raises(tidal.ConfigError) as e:
        tidal.Config.load(config)
    assert message in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,}')
    with pytest.raises(tidal.ConfigError, match=r"config file '.*bad\.json' is not valid JSON: "
                                                r"Expecting property name"):
        tidal.Config.load(bad)
    with pytest.raises(tidal.ConfigError, match=r"cannot read config file '.*missing\.json': "
                                                r"No such file or directory"):
        tidal.Config.load(tmp_path / "missing.json")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(tidal.ConfigError, match=r"config file '.*list\.json': expected an object, got list"):
        tidal.Config.load(str(listed))
