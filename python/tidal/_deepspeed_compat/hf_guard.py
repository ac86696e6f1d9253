"""A clear error where transformers would need the real DeepSpeed package.

`TrainingArguments(deepspeed=...)` builds transformers' HfTrainerDeepSpeedConfig,
and DeepSpeed-Chat's ZeRO-3 model loading builds HfDeepSpeedConfig(ds_config);
both check DeepSpeed's installed version first (transformers 4.57,
integrations/deepspeed.py) and, with only tidal.deepspeed in place of it, die
with "PackageNotFoundError: No package metadata was found for The
'deepspeed>=0.9.3' distribution was not found". tidal cannot stand in for
DeepSpeed inside transformers (its Trainer calls DeepSpeed's engine
internals), and does not change transformers; importing tidal.deepspeed
wraps HfDeepSpeedConfig.__init__ so that, when no `deepspeed` package is
installed (the only case the wrapper acts in), it raises a UsageError that
names tidal's ways instead: tidal.integrations.TidalTrainer for the
Trainer (docs/hf_trainer.md), and for a model built under HfDeepSpeedConfig,
building it as it is (tidal.deepspeed.initialize puts it into chunks) or
under tidal.deepspeed.zero.Init.

transformers.integrations.deepspeed is wrapped when it is imported (a
one-shot import hook) or at once if it is imported already.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

from ..engine.errors import UsageError

__all__ = ["install"]

_MODULE = "transformers.integrations.deepspeed"
_MESSAGE = (
    "transformers' DeepSpeed integration (TrainingArguments(deepspeed=...), "
    "HfDeepSpeedConfig) needs the real DeepSpeed package, which is not installed; "
    "tidal.deepspeed does not stand in for it inside transformers. With tidal: train with "
    "tidal.integrations.TidalTrainer(model=..., args=TrainingArguments(...) without "
    "deepspeed=, tidal_config=<the same DeepSpeed config>) (docs/hf_trainer.md); for a model "
    "built under HfDeepSpeedConfig (ZeRO-3 loading), drop it and build the model as it is "
    "(tidal.deepspeed.initialize puts it into chunks) or under "
    "tidal.deepspeed.zero.Init(config_dict_or_path=...)")


def _wrap(module) -> None:
    cls = getattr(module, "HfDeepSpeedConfig", None)
    if cls is None or getattr(cls.__init__, "_tidal_guard", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if importlib.util.find_spec("deepspeed") is None:
            raise UsageError(_MESSAGE)
        original(self, *args, **kwargs)

    __init__._tidal_guard = True
    cls.__init__ = __init__


class _Loader(importlib.abc.Loader):
    """The module's own loader, which wraps the class once the module ran."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _wrap(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the module's loader's
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)  # one shot
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Wraps HfDeepSpeedConfig now, or when transformers imports it."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
