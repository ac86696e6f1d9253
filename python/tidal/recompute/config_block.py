"""The config file's ``activation_checkpointing`` block (DeepSpeed's keys)
and ``tidal.recompute`` block (tidal's): their schema, validation, and the
plan they ask for."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional, Tuple

from torch import nn

from tidal._schema import NONE, ConfigError, Rule, check_value, unknown_key
from tidal.device import parse_bytes

from .entry import parse_bandwidth, recompute
from .plan import Recompute
from .segments import find_chain


def _parses(parse: Callable[[Any], Any]) -> Callable[[Any], bool]:
    def ok(value: Any) -> bool:
        try:
            parse(value)
            return True
        except (TypeError, ValueError):
            return False
    return ok


def _is_count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _is_checkpoint_list(value: Any) -> bool:
    return value == "auto" or (isinstance(value, list) and bool(value) and all(
        isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(u, str) for u in v)) for v in value))


#: key -> (kind, default, what tidal does), kinds as in tidal._schema.check_value.
#: DeepSpeed's keys first, then tidal's.
CONFIG_KEYS: Dict[str, Tuple[Any, Any, str]] = {
    "partition_activations": (bool, False,
                              "not applicable on one GPU: DeepSpeed splits each checkpoint across model-parallel "
                              "ranks; tidal keeps whole checkpoints (cpu_checkpointing moves them off the device)"),
    "cpu_checkpointing": (bool, False, "offload: checkpoints go to pinned host memory and are prefetched "
                                       "back on a copy stream before their segment's backward"),
    "contiguous_memory_optimization": (bool, False,
                                       "not used: tidal does not gather checkpoints into one preallocated buffer; "
                                       "device copies come from the caching allocator, host copies from pinned "
                                       "host memory on CUDA"),
    "number_checkpoints": (Rule("null or an integer >= 1", lambda v: v is None or _is_count(v)), None,
                           "the number of segments of the chain (checkpoints='auto'); default about sqrt(N)"),
    "synchronize_checkpoint_boundary": (bool, False,
                                        "honoured: the device and the copy stream are synchronized at every "
                                        "segment boundary, forward and backward"),
    "profile": (bool, False, "honoured: timestamped forward/recompute/copy events in plan.trace; "
                             "totals in plan.stats()"),
    "enabled": (bool, True, "tidal: install the plan (false: from_config returns None)"),
    "checkpoints": (Rule("'auto' or a non-empty list of module names (a name, or a list of names of "
                         "consecutive blocks, per segment)", _is_checkpoint_list), "auto",
                    "tidal: the segments; 'auto' = the chain of repeated blocks"),
    "chain": ((str, NONE), None, "tidal: the ModuleList/Sequential that 'auto' segments"),
    "memory_target": (Rule("null, 'min' or a byte size such as '2GB'",
                           lambda v: v is None or v == "min" or _parses(parse_bytes)(v)), None,
                      "tidal: measured plan recomputing the fewest blocks that fit this activation budget"),
    "prefetch_depth": (Rule("an integer >= 1", _is_count), 1, "tidal: offloaded checkpoints prefetched ahead of use"),
    "offload_bandwidth": (Rule("null or a rate such as '12GB/s'", _parses(parse_bandwidth)), None,
                          "tidal, not on CUDA: a simulated link of the offload copies' own (default: "
                          "the simulated device's, shared with the chunk copies)"),
    "preserve_rng_state": (bool, True, "tidal: random ops replay the forward's randomness"),
}

_NOT_HONOURED = ("partition_activations", "contiguous_memory_optimization")
_DEEPSPEED_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                   "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
_TIDAL_KEYS = tuple(k for k in CONFIG_KEYS if k not in _DEEPSPEED_KEYS)
_SECTION = "activation_checkpointing"
_TIDAL_SECTION = "tidal.recompute"


def _config_error(path: str, value: Any, allowed: str, extra: str = "") -> Exception:
    return ConfigError(f"config key '{path}': expected {allowed}, got {value!r}{extra}")


def validate_config(block: Dict[str, Any], tidal_block: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Checks a config file's ``activation_checkpointing`` block (DeepSpeed's keys,
    and tidal's for direct use) and ``tidal.recompute`` block (tidal's keys);
    returns their union with defaults filled in. Errors name the key with its
    section, the value and what is allowed.

    Raises:
        tidal.ConfigError: an unknown key (with the nearest valid one), a wrong
            type or an out-of-range value, a key given in both blocks, or keys
            that contradict each other.
    """
    out = {k: spec[1] for k, spec in CONFIG_KEYS.items()}
    where: Dict[str, str] = {}
    for section, given, keys in ((_SECTION, block, tuple(CONFIG_KEYS)), (_TIDAL_SECTION, tidal_block, _TIDAL_KEYS)):
        if given is None and section == _TIDAL_SECTION:
            continue
        if not isinstance(given, dict):
            raise ConfigError(f"config key '{section}': expected an object, got {type(given).__name__} {given!r}")
        for key, value in given.items():
            path = f"{section}.{key}"
            if key not in keys:
                extra = f" (DeepSpeed's keys go in '{_SECTION}')" if key in _DEEPSPEED_KEYS else ""
                raise unknown_key(path, key, keys, f"'{section}'", extra)
            if key in where:
                raise ConfigError(f"config key '{key}' is given in both '{where[key]}' and '{path}'; give it once")
            check_value(path, CONFIG_KEYS[key][0], value)
            where[key] = path
            out[key] = value
    out["_paths"] = {k: where.get(k, f"{_TIDAL_SECTION if k in _TIDAL_KEYS else _SECTION}.{k}") for k in CONFIG_KEYS}
    paths = out["_paths"]
    if out["checkpoints"] != "auto":
        for key in ("number_checkpoints", "memory_target", "chain"):
            if out[key] is not None:
                raise ConfigError(f"config keys '{paths['checkpoints']}' (a list) and '{paths[key]}' = "
                                  f"{out[key]!r} contradict each other: {key} applies to checkpoints='auto' only")
    if out["number_checkpoints"] is not None and out["memory_target"] is not None:
        raise ConfigError(f"config keys '{paths['number_checkpoints']}' and '{paths['memory_target']}' "
                          f"contradict each other: give one")
    return out


def from_config(model: nn.Module, block: Dict[str, Any],
                tidal_block: Optional[Dict[str, Any]] = None) -> Optional[Recompute]:
    """Installs the plan a config file asks for.

    DeepSpeed's keys keep their meaning where it carries over to one GPU:
    ``cpu_checkpointing`` is offload, ``number_checkpoints`` the number of
    segments, ``synchronize_checkpoint_boundary`` and ``profile`` are honoured;
    ``partition_activations`` and ``contiguous_memory_optimization`` set to true
    give a warning saying what tidal does instead. tidal's own keys (see
    :data:`CONFIG_KEYS`) go in ``tidal_block``, or in ``block`` when calling
    this directly. ``plan.report`` says what tidal does with each key given.

    Args:
        model: the model.
        block: the mapping under ``activation_checkpointing``.
        tidal_block: the mapping under ``tidal`` -> ``recompute``, if any.

    Returns:
        The plan, or None when ``"enabled": false``.
    """
    c = validate_config(block, tidal_block)
    paths = c["_paths"]
    for key in _NOT_HONOURED:
        if c[key]:
            warnings.warn(f"config key '{paths[key]}' = true is not used by tidal: {CONFIG_KEYS[key][2]}",
                          stacklevel=2)
    if not c["enabled"]:
        return None
    number = c["number_checkpoints"]
    if number is not None:
        _, blocks = find_chain(model, c["chain"])
        if number > len(blocks):
            raise _config_error(paths["number_checkpoints"], number, f"an integer in 1..{len(blocks)}",
                                f" (the chain has {len(blocks)} blocks)")
    checkpoints = c["checkpoints"]
    if checkpoints != "auto":
        checkpoints = [list(v) if isinstance(v, list) else v for v in checkpoints]
    try:
        plan = recompute(model, checkpoints, c["cpu_checkpointing"], segments=number,
                         memory_target=c["memory_target"], chain=c["chain"], prefetch_depth=c["prefetch_depth"],
                         offload_bandwidth=c["offload_bandwidth"], preserve_rng_state=c["preserve_rng_state"],
                         synchronize_boundaries=c["synchronize_checkpoint_boundary"], trace=c["profile"])
    except ValueError as e:  # a name that matches no module, no chain: the key that named it
        key = "chain" if checkpoints == "auto" and c["chain"] is not None else "checkpoints"
        raise ConfigError(f"config key '{paths[key]}': {e}") from None
    given = set(block) | set(tidal_block or ())
    plan.report = {paths[k]: f"{c[k]!r}: {CONFIG_KEYS[k][2]}" for k in CONFIG_KEYS if k in given}
    return plan
