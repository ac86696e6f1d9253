"""Parameters read outside their module (Note [External parameters] in
external.py) and a raw loss.backward() (Note [The end of a backward]).

A mixin of Engine (engine.py), split from it along its sections; it uses
the engine's attributes set in Engine.__init__."""
from __future__ import annotations



from .. import dtr as _dtr
from . import external as _external
from .errors import UnsupportedModelError
from .loss_scaler import StaticLossScaler

from .common import OutOfMemoryError


class ExternalMixin:
    # ------------------------------------------------ external parameters
    def _read_param(self, i: int):
        """A read of parameter `i` found its placeholder (ParameterReads;
        Note [External parameters] in hooks/module_hooks.h)."""
        hooks = self._hooks
        record = self._record_list[i]
        running = hooks.running()
        learn, module = True, None
        if running:
            module = self._module_list[running[-1]]
            reader = _external.innermost_module()
            if reader is not None and reader is not module and reader in self._names:
                # Not hooked yet: served for `module` this time, hooked from
                # the next forward on.
                learn = False
                self._pending_readers.setdefault(reader, []).append(i)
            elif all(record is not r for r in self._module_records[module]):
                self._module_records[module].append(record)
        try:
            with _dtr.outside():
                hooks.read_param(i, learn)
        except OutOfMemoryError as e:
            self._attach_failed(e, module, [record], lambda: hooks.read_param(i, learn))
        self.dtr.rebalance()

    # ------------------------------------------------ loss.backward() itself
    def _raw_backward_refusal(self) -> str:
        """Why a backward must go through engine.backward() (Note [The end of
        a backward] in hooks/module_hooks.h), or "" where loss.backward() works."""
        if self.precision == "fp16" and not (isinstance(self.scaler, StaticLossScaler)
                                             and self.scaler.scale == 1.0):
            return ("tidal: loss.backward() on a model that tidal trains in fp16: the loss must be "
                    "multiplied by the loss scale first, or small gradients underflow and the step "
                    "divides them by the scale all the same. Call engine.backward(loss) instead "
                    "(DeepSpeed: model_engine.backward(loss)); no gradient has landed")
        if self.dp is not None:
            return ("tidal: loss.backward() on a model that tidal trains data-parallel: the "
                    "gradients are reduced across ranks by engine.backward(loss). Call "
                    "engine.backward(loss) instead; no gradient has landed")
        return ""

    def _settle_raw_backward(self):
        """What engine.backward() does after its backward, for a backward the
        script ran itself (loss.backward()): gradient accumulation's fold,
        and the micro-step counted (the loss is the script's own: not divided
        by gradient_accumulation_steps, as in plain PyTorch)."""
        if not self._hooks.take_backward_ended():
            return
        self.dtr.end()
        if self._accumulating:
            self._fold_gradients()
        self.micro_steps += 1

    def _register_external(self, module, param):
        """tidal.register_external_parameter after initialize."""
        r = self._record_of_param(param)
        if module not in self._names:
            raise ValueError(f"tidal.register_external_parameter: the module ({type(module).__name__}) "
                             f"is not part of the model this engine trains")
        self._pending_readers.setdefault(module, []).append(self._record_index[id(r)])

    def _hook_readers(self):
        """Hooks the modules found reading parameters (and those registered by
        hand) before this forward starts: from now on their forward brings the
        parameters in."""
        pending, self._pending_readers = self._pending_readers, {}
        for m, ids in pending.items():
            records = self._module_records.setdefault(m, [])
            for i in ids:
                if all(self._record_list[i] is not r for r in records):
                    records.append(self._record_list[i])
            if m in self._module_index:
                for i in ids:
                    self._hooks.add_to_module(self._module_index[m], i)
                continue
            index = self._hooks.add_module(sorted(set(ids)))
            self._module_list.append(m)
            self._module_index[m] = index
            self._hook_module(m)

    def _check_read(self, p, func):
        """PlaceholderCheck: parameter `p` reached torch function `func`."""
        r = self._record_of_param(p)
        if r is None or self._hooks.attached(self._record_index[id(r)]):
            return
        reader = _external.innermost_module()
        where = (f"module '{self._names.get(reader, type(reader).__name__)}' "
                 f"({type(reader).__name__})") if reader is not None else "code outside any module"
        owner = r.name.rsplit(".", 1)
        attr = f"model.{r.name}" if len(owner) == 2 else r.name
        name = getattr(func, "__name__", str(func))
        leaf = (f"; or tidal.set_leaf_modules(model, [{type(reader).__name__}]) before "
                f"tidal.initialize (the module and its children become one unit)"
                if reader is not None else "")
        raise UnsupportedModelError(
            f"{where} used parameter '{r.name}' while it was not on the device ({name} got its "
            f"empty placeholder): tidal brings a parameter in when a forward reads it as an "
            f"attribute of its module ({attr}), and this forward reached the Parameter some other "
            f"way (a list, a dict or a closure holding it). Ways out: read it through its module's "
            f"attribute inside the forward; or tidal.register_external_parameter(module, "
            f"parameter) for the module that uses it{leaf}")
