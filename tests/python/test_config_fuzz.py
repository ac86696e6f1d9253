"""Property-based fuzzing of the config loader (hypothesis).

Every config either loads into a Config whose values are within the bounds
the docs give, or raises tidal.ConfigError naming the key that is wrong:
never another exception, and never a bad value silently accepted. Configs
are a valid base with random mutations: a random schema key set to a random
JSON value (at and past numeric bounds included), an unknown key at a random
level, a section replaced by a scalar, or DTR / recompute / scheduler blocks
with random contents.
"""
import math
import os
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tidal
from tidal.config import SCHEMA, Config, ConfigError

# Every path to a leaf key of the schema, and every section path.
LEAVES, SECTIONS = [], []


def _walk(schema, prefix=()):
    for key, spec in schema.items():
        path = prefix + (key,)
        if isinstance(spec, dict):
            SECTIONS.append(path)
            _walk(spec, path)
        else:
            LEAVES.append(path)


_walk(SCHEMA)

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "tidal": {"chunk_size": "1MiB"},
}

# Numbers at and past the bounds the loader documents, and the JSON kinds.
NUMBERS = [0, 1, -1, 2, 64, 65, 255, 256, 4095, 4096, 2 ** 31, 2 ** 63, -(2 ** 63),
           0.0, 0.5, -0.5, 0.999, 1.0, 1.5, 1e-12, 1e308, float("inf"), float("-inf"), float("nan")]
STRINGS = ["", "auto", "cpu", "nvme", "sim", "cuda", "opt", "lru", "AdamW", "adamw", "5GB", "1MiB",
           "-1GB", "5 gigs", "0", "WarmupLR", "OneCycle", "linear", "log", "min", "12GB/s", "dtr_eq", "ü"]
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.integers(-10 ** 20, 10 ** 20),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(STRINGS),
                    st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(STRINGS + ["enabled", "lr", "x"]),
                                                 inner, max_size=3)), max_leaves=6)


def _set(cfg, path, value):
    node = cfg
    for k in path[:-1]:
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = node[k] = {}
        node = nxt
    node[path[-1]] = value


mutation = st.one_of(
    st.tuples(st.just("leaf"), st.sampled_from(LEAVES), json_values),
    st.tuples(st.just("unknown"), st.sampled_from([()] + SECTIONS),
              st.sampled_from(["lr_rate", "chunksize", "x", "enable", "Stage", "device_budget"])),
    st.tuples(st.just("section"), st.sampled_from(SECTIONS), scalars),
    st.tuples(st.just("dtr"), st.dictionaries(
        st.sampled_from(["enabled", "eviction_threshold", "evictee_minimum_size", "enable_sqrt_sampling",
                         "scorer", "threshold"]), json_values, max_size=3), st.none()),
    st.tuples(st.just("recompute"), st.dictionaries(
        st.sampled_from(["enabled", "checkpoints", "chain", "memory_target", "prefetch_depth",
                         "offload_bandwidth", "preserve_rng_state", "cpu_checkpointing", "segments"]),
        json_values, max_size=3), st.none()),
    st.tuples(st.just("scheduler"), st.sampled_from(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                                     "OneCycle", "LRRangeTest", "Cosine"]),
              st.dictionaries(st.sampled_from(["warmup_num_steps", "total_num_steps", "warmup_min_lr",
                                               "warmup_max_lr", "warmup_type", "cycle_min_lr",
                                               "cycle_max_lr", "cycle_first_step_size", "cos_min_ratio",
                                               "lr_range_test_min_lr", "decay_lr_rate", "bogus"]),
                              json_values, max_size=3)),
)


def _apply(m):
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    kind = m[0]
    if kind == "leaf":
        _, path, value = m
        _set(cfg, path, value)
        return cfg, path
    if kind == "unknown":
        _, section, key = m
        _set(cfg, section + (key,), 1)
        return cfg, section + (key,)
    if kind == "section":
        _, section, value = m
        _set(cfg, section, value)
        return cfg, section
    if kind == "dtr":
        _set(cfg, ("tidal", "dtr"), m[1])
        return cfg, ("tidal", "dtr")
    if kind == "recompute":
        _set(cfg, ("tidal", "recompute"), m[1])
        return cfg, ("tidal", "recompute")
    _, name, params = m
    cfg["scheduler"] = {"type": name, "params": params}
    return cfg, ("scheduler",)


def _within_bounds(c: Config):
    """What a Config that loaded promises (the key tables of docs/config.md)."""
    assert math.isfinite(c.lr) and c.lr >= 0
    assert len(c.betas) == 2 and all(0 <= b < 1 for b in c.betas)
    assert c.eps > 0 and math.isfinite(c.eps)
    assert c.weight_decay >= 0
    assert c.gradient_clipping >= 0
    assert c.chunk_size >= 4096 and c.chunk_size % 256 == 0
    for v in (c.device_memory_budget, c.host_memory_budget, c.device_margin):
        assert isinstance(v, int) and v >= 0
    assert c.prefetch_depth >= 1 and c.cpu_adam_threads >= 0
    assert 0 < c.warmup_chunk_share <= 1
    assert c.gradient_accumulation_steps >= 1
    assert c.precision in ("fp16", "bf16", "fp32")
    assert c.min_loss_scale > 0 and c.loss_scale >= 0 and c.hysteresis >= 1
    assert c.device in ("auto", "cuda", "sim") and c.eviction_policy in ("opt", "lru")
    for flag in (c.prefetch, c.hybrid_adam, c.pin_memory, c.adam_w_mode, c.bias_correction):
        assert isinstance(flag, bool)


@settings(max_examples=int(os.environ.get("TIDAL_FUZZ_EXAMPLES", "600")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutation)
def test_every_config_loads_within_bounds_or_is_a_config_error_naming_the_key(m):
    cfg, path = _apply(m)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = Config.load(cfg)
    except ConfigError as e:
        message = str(e)
        # The key (or, for a whole block, its section) is named.
        assert any(".".join(path[:n]) in message for n in range(len(path), 0, -1)) or \
            path[-1] in message, (path, message)
        return
    _within_bounds(c)


@pytest.mark.parametrize("path", LEAVES, ids=".".join)
def test_every_key_with_a_wrong_kind_is_a_config_error_naming_it(path):
    # An object where a scalar belongs (and a list where an object does) is
    # never a valid value for a leaf key.
    spec = SCHEMA
    for k in path:
        spec = spec[k]
    kind = spec[0]
    takes_object = kind is dict or (isinstance(kind, tuple) and dict in kind)
    cfg = {"optimizer": {"type": "AdamW", "params": {}}, "scheduler": {"type": "WarmupLR"}}
    _set(cfg, path, [1, 2] if takes_object else {"nested": [1, 2]})
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Config.load(cfg)
    assert ".".join(path) in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=repr)
@pytest.mark.parametrize("path", LEAVES, ids=".".join)
def test_nan_and_infinity_are_a_config_error_for_every_key(path, bad):
    # Found by the fuzz test in CI: fp16.loss_scale = NaN passed its ">= 0"
    # bound (every comparison with NaN is false). Checked for every leaf.
    cfg = {"optimizer": {"type": "AdamW", "params": {}}, "scheduler": {"type": "WarmupLR"}}
    _set(cfg, path, bad)
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Config.load(cfg)
    assert ".".join(path) in str(e.value)


def test_a_config_error_is_a_value_error_the_engine_raises_before_changing_anything():
    with pytest.raises(ValueError):
        tidal.Config.load({"tidal": {"prefetch_depth": 0}})
