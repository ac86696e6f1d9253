"""The one way tidal checks a config block: the bottom of the package.

Every block of the config file (the top level and its sections in
tidal.config, ``tidal.dtr`` in tidal.dtr, ``activation_checkpointing`` and
``tidal.recompute`` in tidal.recompute, a scheduler's ``params`` in
tidal.lr_schedules) is a schema of ``key -> (kind, default, doc)`` checked by
:func:`check_value`, and an unknown key gets :func:`unknown_key` with one
"did you mean" rule. This module imports nothing of tidal but the byte-size
parser, so config, dtr, recompute and lr_schedules all build on it and none
imports another for its checks.

A kind is one of:
  * a type or a tuple of types (``NONE`` allows null; bool is never an int);
  * ``"bytes"``: an int >= 0 or a size string such as "5GB";
  * a tuple of strings: the allowed choices (a wrong case is suggested);
  * ``dict``: an object, checked by its owner;
  * a :class:`Rule`: a predicate with the words that say what it allows.

A config read from a file is read by :func:`read_json_object` (the config
file, tidal.estimate's config and its Hugging Face config.json), so every
such file fails with one ConfigError shape.
"""
from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import _C

__all__ = ["ConfigError", "NONE", "Problems", "Rule", "check_value", "did_you_mean", "fail",
           "read_json_object", "unknown_key"]

NONE = type(None)


class ConfigError(ValueError):
    """A config value tidal cannot use; the message names the key."""


def read_json_object(path: "str | os.PathLike", what: str = "config file") -> dict:
    """The JSON object in the file at `path`.

    Args:
        path: the file.
        what: what the file is, for the errors ("config file", "Hugging Face config").

    Raises:
        ConfigError: the file cannot be read, is not JSON, or holds something
            other than an object; the message names `what` and the file.
    """
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {what} '{name}': {e.strerror or e}") from None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{what} '{name}' is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} '{name}': expected an object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Rule:
    """A kind given by a predicate: `allowed` completes "expected ..."."""

    allowed: str
    ok: Callable[[Any], bool]


def fail(path: str, message: str) -> None:
    raise ConfigError(f"config key '{path}': {message}")


def did_you_mean(word: Any, choices: Iterable[str]) -> str | None:
    """The closest of `choices` to `word` (a different case first), or None."""
    choices = list(choices)
    if isinstance(word, str):
        same = [c for c in choices if c.lower() == word.lower()]
        if same:
            return same[0]
    near = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.5)
    return near[0] if near else None


def unknown_key(path: str, key: Any, valid: Iterable[str], where: str = "", extra: str = "") -> ConfigError:
    """The error for `key` (full path `path`) that the block does not have."""
    valid = list(valid)
    near = did_you_mean(key, valid)
    hint = f"; did you mean '{near}'?" if near else ""
    scope = f" in {where}" if where else ""
    return ConfigError(f"unknown config key '{path}'{hint}{extra} (valid keys{scope}: "
                       f"{', '.join(sorted(valid))})")


def check_value(path: str, kind: Any, value: Any) -> Any:
    """`value` checked against `kind` (see the module doc); returns it parsed
    (byte sizes as ints). Raises ConfigError naming `path`.

    NaN and infinity are never a config value: every comparison with NaN is
    false, so a bound such as "> 0" would let it through."""
    if isinstance(value, float) and not math.isfinite(value):
        fail(path, f"expected a finite number, got {value!r}")
    if isinstance(kind, Rule):
        if not kind.ok(value):
            fail(path, f"expected {kind.allowed}, got {value!r}")
        return value
    if kind == "bytes":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            fail(path, f"expected a byte count (int or a string like '5GB'), got {value!r}")
        if isinstance(value, int):
            if value < 0:
                fail(path, f"expected a byte count >= 0, got {value}")
            return value
        try:
            return int(_C.parse_bytes(value))
        except ValueError as e:
            fail(path, str(e))
    if kind is dict:
        if not isinstance(value, dict):
            fail(path, f"expected an object, got {type(value).__name__} {value!r}")
        return dict(value)
    if isinstance(kind, tuple) and kind and all(isinstance(k, str) for k in kind):
        if value not in kind:
            near = did_you_mean(value, kind)
            hint = f" (did you mean '{near}'?)" if near else ""
            fail(path, f"expected one of {', '.join(repr(k) for k in kind)}, got {value!r}{hint}")
        return value
    types = kind if isinstance(kind, tuple) else (kind,)
    expected = " or ".join("null" if t is NONE else t.__name__ for t in types)
    if isinstance(value, bool) and bool not in types:
        fail(path, f"expected {expected}, got bool {value!r}")
    if not isinstance(value, types):
        fail(path, f"expected {expected}, got {type(value).__name__} {value!r}")
    return value


def check_block(path: str, schema: dict, given: Any, where: str = "") -> dict:
    """A flat block: every key known and checked; returns the given keys, parsed."""
    if not isinstance(given, dict):
        fail(path, f"expected an object, got {type(given).__name__} {given!r}")
    out = {}
    for key, value in given.items():
        full = f"{path}.{key}"
        if key not in schema:
            raise unknown_key(full, key, schema, where or f"'{path}'")
        out[key] = check_value(full, schema[key][0], value)
    return out


@dataclass
class Problems:
    """Every problem of one config, gathered so that one ConfigError names them all.

    A check either records its message with :meth:`add` or raises a
    ConfigError inside :meth:`at`, which records it; either way the key is
    marked bad, so checks that build on it are skipped (:meth:`ok`) instead of
    reporting the same mistake twice. A value "auto" that its key cannot take
    is kept apart (:meth:`add_auto`): it is one problem however many keys have it,
    and its message (given to :meth:`raise_if_any`) says what each one needs.
    """

    messages: list[str] = field(default_factory=list)
    bad: set[str] = field(default_factory=set)
    auto: list[str] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        """Records `message` (a whole sentence naming the key) and marks `path` bad."""
        self.messages.append(message)
        self.bad.add(path)

    def add_auto(self, path: str) -> None:
        self.auto.append(path)
        self.bad.add(path)

    def at(self, *paths: str) -> "_Recording":
        """A context in which a ConfigError is recorded against `paths` instead of raised."""
        return _Recording(self, paths)

    def ok(self, *paths: str) -> bool:
        """True when no key in `paths`, nor a block above one, is bad."""
        for path in paths:
            parts = path.split(".")
            if any(".".join(parts[:n]) in self.bad for n in range(1, len(parts) + 1)):
                return False
        return True

    def raise_if_any(self, auto_message: Callable[[list[str]], str]) -> None:
        """Raises one ConfigError listing every problem (a single one as its own message)."""
        messages = list(self.messages)
        if self.auto:
            messages.append(auto_message(self.auto))
        if not messages:
            return
        if len(messages) == 1:
            raise ConfigError(messages[0])
        lines = "\n".join(f"  - {m}".replace("\n", "\n    ") for m in messages)
        raise ConfigError(f"the config has {len(messages)} problems:\n{lines}")


@dataclass
class _Recording:
    problems: Problems
    paths: tuple[str, ...]

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, ConfigError):
            self.problems.messages.append(str(error))
            self.problems.bad.update(self.paths)
            return True
        return False
