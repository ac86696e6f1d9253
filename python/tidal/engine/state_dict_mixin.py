"""model.state_dict() and load_state_dict() through the engine's chunks: the
hooks torch's Module calls, reading and writing the chunk slots.

A mixin of Engine (engine.py), split from it along its sections; it uses
the engine's attributes set in Engine.__init__."""
from __future__ import annotations

import sys
import weakref

import torch

from .. import dtr as _dtr
from . import checkpoint as _checkpoint
from . import param_groups as _param_groups
from .errors import UsageError
from .store import PARAM16, PARAM32, uncounted


class StateDictEntry(torch.Tensor):
    """A tensor of model.state_dict() under a tidal engine (Note [Writes into a
    state dict] in external_mixin.py): an ordinary tensor (torch functions
    return plain tensors; it pickles and deep-copies as one) that, when it dies
    after a write, hands its value to the engine, as plain PyTorch's entries,
    which share the parameters' memory, would have written the model."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrap(copy: torch.Tensor, engine, index: int) -> "StateDictEntry":
        entry = torch.Tensor._make_subclass(StateDictEntry, copy)
        entry._tidal_engine = weakref.ref(engine)
        entry._tidal_index = index
        entry._tidal_version = entry._version
        return entry

    def __del__(self):
        if sys.is_finalizing() or self._version == self._tidal_version:
            return  # (at interpreter exit there is no model left to write to)
        engine = self._tidal_engine()
        if engine is None:
            return
        with uncounted():  # (tidal's own bytes, also when collected inside a forward)
            value = torch.Tensor._make_subclass(torch.Tensor, self).clone()
        engine._dropped_state_writes.append((self._tidal_index, value))

    def __reduce_ex__(self, protocol):
        return torch.Tensor._make_subclass(torch.Tensor, self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return torch.Tensor._make_subclass(torch.Tensor, self).__deepcopy__(memo)


class StateDictMixin:
    def _install_state_dict_hooks(self):
        """model.state_dict() and model.load_state_dict() read and write the
        chunks: the module itself holds empty placeholders (a torch.save of
        them would lose the model without a word)."""
        ref = weakref.ref(self)
        self._state_copies = []  # weakrefs of the StateDictEntry tensors handed out: Note [Writes into a state dict]
        self._dropped_state_writes = []  # (index, value) of entries written, then dropped
        self._state_io = None  # the module whose state_dict() is running (Note [A parameter object stays the user's])

        def saving(module, prefix, keep_vars):
            engine = ref()
            if engine is not None and engine._state_io is None:
                engine._state_io = module

        def saved(module, state, prefix, local_metadata):
            engine = ref()
            if engine is not None and engine._state_io is module:
                engine._state_io = None
        for m in self.module.modules():
            # (torch's Module.state_dict runs on the placeholders; the values
            # come from the hooks below.)
            self._handles.append(m.register_state_dict_pre_hook(saving))
        for m, names in self._param_names_by_module().items():
            def save(module, state, prefix, local_metadata, names=names):
                engine = ref()
                if engine is not None:
                    engine._fill_state_dict(state, prefix, names)

            def load(module, state, prefix, local_metadata, strict, missing, unexpected, errors,
                     names=names):
                engine = ref()
                if engine is not None:
                    engine._load_own_state(state, prefix, names, errors)

            def loaded(module, incompatible):
                # torch copied the emptied entries into the placeholders after
                # the engine wrote the chunks: no user write (Note [Writes to a
                # parameter] in hooks/module_hooks.cpp). The root's hook runs last.
                engine = ref()
                if engine is not None:
                    engine._hooks.sync_param_writes()
                    if module is engine.module:
                        engine._loading_state = False
            self._handles.append(m.register_state_dict_post_hook(save))
            self._handles.append(m.register_load_state_dict_pre_hook(load))
            self._handles.append(m.register_load_state_dict_post_hook(loaded))
        for m in self.module.modules():
            self._handles.append(m.register_state_dict_post_hook(saved))  # (after the values)

    def _fill_state_dict(self, state, prefix, names):
        """A module's state_dict entries for its parameters: their weights (CPU
        copies in the parameter's dtype), not the placeholders. keep_vars=True
        keeps the Parameter objects (tidal's own checkpoints map keys by them)."""
        self._settle_between_steps()
        for pname, i in names.items():
            key = prefix + pname
            value = state.get(key)
            if value is None or isinstance(value, torch.nn.Parameter):
                continue
            # Note [Writes into a state dict]: plain PyTorch's entries share the
            # parameters' memory, so a write into one is a write to the model.
            entry = StateDictEntry.wrap(self._weight_copy(self._params.record_list[i]), self, i)
            state[key] = entry
            self._state_copies.append(weakref.ref(entry))

    def _weight_copy(self, record) -> torch.Tensor:
        """A host copy of `record`'s weight in its 16-bit dtype: the slot, or
        the master while the slot holds a landed gradient."""
        i = self._params.record_index[id(record)]
        with torch.no_grad(), _dtr.outside():
            if not self._hooks.landed(i):
                return self.store.gather(record, PARAM16)
            if not self.store.owns(record):
                raise UsageError(
                    f"model.state_dict() between backward and step under data parallel: the "
                    f"16-bit slot of '{record.name}' holds its gradient and another rank owns its "
                    f"master; call it after engine.step() (or use engine.state_dict() on every rank)")
            return self.store._read(record, PARAM32).to(self.dtype)

    def _load_own_state(self, state, prefix, names, errors):
        """model.load_state_dict(): a module's parameters are written into the
        chunks (fp32 master and 16-bit copy); the entry given to torch's own
        copy becomes an empty tensor, which fits the empty placeholder."""
        # The writes made before this load go in once, at its first module:
        # the copies torch makes into the placeholders of the modules loaded
        # so far are the load's own, not writes (the root's post-hook syncs).
        if not getattr(self, "_loading_state", False):
            self._settle_between_steps()
            self._loading_state = True
        for pname, i in names.items():
            key = prefix + pname
            if key not in state:
                continue
            record = self._params.record_list[i]
            value = state[key]
            if not isinstance(value, torch.Tensor):
                continue  # torch's own loader reports it
            if list(value.shape) != list(record.shape):
                errors.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(value.shape)} from checkpoint, the shape in current model "
                              f"is {tuple(record.shape)}.")
                state[key] = value.new_empty(0)
                continue
            if self._hooks.landed(i):
                raise UsageError(
                    f"model.load_state_dict() between backward and step: the slot of "
                    f"'{record.name}' holds its gradient; call engine.step() or engine.zero_grad() "
                    f"first")
            with _dtr.outside():
                _checkpoint._write_param(self, record, value)
            state[key] = value.new_empty(0)

    def _settle_between_steps(self):
        """_settle_outside() where no forward or backward is running (a
        state_dict inside one reads the parameters as they are)."""
        if not self._hooks.running() and torch._C._current_graph_task_id() == -1:
            self._settle_outside()

    def _group_state(self) -> list:
        """The parameter groups as a checkpoint keeps them (Note [Parameter groups])."""
        return _param_groups.state(self.optimizer.param_groups,
                                   lambda p: self.store.by_param[id(p)].name)

    def _record_of_param(self, p):
        """The record of parameter `p` if this engine trains it, else None."""
        r = self.store.by_param.get(id(p))
        if r is None or r.param is not p or r not in self._params.record_set:
            return None
        return r
