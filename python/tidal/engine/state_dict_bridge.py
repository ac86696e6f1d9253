"""model.state_dict() and load_state_dict() through the engine's chunks: the
hooks torch's Module calls, reading and writing the chunk slots, and the
entries handed out, whose later writes go into the model (Note [Writes into a
state dict]).

StateDictBridge owns that state; the Engine builds it in _setup and the
engine's OutsideAccess (outside_access.py) asks it what it needs."""
from __future__ import annotations

import sys
import weakref
from typing import Callable

import torch

from .. import dtr as _dtr
from .errors import UsageError
from .store import PARAM16, PARAM32, uncounted

__all__ = ["StateDictBridge", "StateDictEntry"]


class StateDictEntry(torch.Tensor):
    """A tensor of model.state_dict() under a tidal engine (Note [Writes into a
    state dict]): an ordinary tensor (torch functions return plain tensors; it
    pickles and deep-copies as one) that, when it dies after a write, hands its
    value to the engine's StateDictBridge, as plain PyTorch's entries, which
    share the parameters' memory, would have written the model."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrap(copy: torch.Tensor, bridge: "StateDictBridge", index: int) -> "StateDictEntry":
        entry = torch.Tensor._make_subclass(StateDictEntry, copy)
        entry._tidal_bridge = weakref.ref(bridge)
        entry._tidal_index = index
        entry._tidal_version = entry._version
        return entry

    def __del__(self):
        if sys.is_finalizing() or self._version == self._tidal_version:
            return  # (at interpreter exit there is no model left to write to)
        bridge = self._tidal_bridge()
        if bridge is None:
            return
        with uncounted():  # (tidal's own bytes, also when collected inside a forward)
            value = torch.Tensor._make_subclass(torch.Tensor, self).clone()
        bridge.dropped_writes.append((self._tidal_index, value))

    def __reduce_ex__(self, protocol):
        return torch.Tensor._make_subclass(torch.Tensor, self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        # Keyed by this entry: a plain alias made here dies at once, and the
        # next entry's alias may get its id, and with it this entry's copy
        # from the memo (deepcopy(model.state_dict()) handed out one entry's
        # values under another's key).
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            out = torch.Tensor._make_subclass(torch.Tensor, self).clone(memory_format=torch.preserve_format)
        out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out


# Note [Writes into a state dict]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Plain PyTorch's model.state_dict() holds the parameters' own memory
# (detached views), so a script that writes into an entry (clamping,
# pruning by mask, loading by hand into the dict it got) writes into the
# model. tidal's entries are copies of the chunks' 16-bit weights; each one
# is remembered with its version count, and where the engine takes the
# weights back (OutsideAccess.settle, in outside_access.py, which calls
# StateDictBridge.settle_copies) an entry
# written since goes into the parameter, 16-bit copy and fp32 master, as
# `p.data = entry` would (after the writes to the parameters themselves);
# between backward and step it is a write that reaches nothing (a UsageError
# naming it). An entry is a StateDictEntry: a plain tensor to torch (its
# functions return plain tensors; it pickles and deep-copies as one) whose
# __del__, after a write, hands a copy of its value to the bridge, so a dict
# dropped right after the write (`model.state_dict()[k].mul_(m)`) is not lost
# either. Nothing is copied back otherwise.
class StateDictBridge:
    """model.state_dict() and model.load_state_dict() of the model an engine
    trains: the module itself holds empty placeholders (a torch.save of them
    would lose the model without a word), so hooks on every module read and
    write the chunks instead.

    State it owns:
        copies:         weakrefs of the StateDictEntry tensors handed out
            (Note [Writes into a state dict]).
        dropped_writes: (record index, value) of entries written, then dropped.
        loading:        whether a model.load_state_dict() is between its first
            module and the root's post-hook.
        saving_module:  the module whose state_dict() is running, or None
            (Note [A parameter object stays the user's]).

    What it needs of the engine is passed in, in two steps. At construction:
    the root module, the ParamStore, the ParamTable (`params`), the
    ModuleHooks (`hooks`: landed, attached and running parameters, the sync
    of parameter writes), the 16-bit dtype and `write_param(record, value)`
    (a loaded value into the chunks, as a checkpoint load writes it). Then
    connect(), once the engine's OutsideAccess exists (built after this
    bridge, whose busy() and settle_copies() it calls):
    `settle_outside()` (OutsideAccess.settle: Note [Writes to a parameter]
    in hooks/module_hooks.cpp) and `write_value(record, value, attached)`
    (`p.data = value` into the 16-bit copy and the master). Its hooks go on
    the modules (install()) after connect().
    """

    def __init__(self, *, module: torch.nn.Module, store, params, hooks, dtype: torch.dtype,
                 write_param: Callable[..., None]):
        self._module = module
        self._store = store
        self._params = params
        self._hooks = hooks
        self._dtype = dtype
        self._write_param = write_param
        self._settle_outside: "Callable[[], None] | None" = None  # (connect())
        self._write_value: "Callable[..., None] | None" = None
        self.copies: list = []
        self.dropped_writes: list = []
        self.loading = False
        self.saving_module = None

    def connect(self, *, settle_outside: Callable[[], None], write_value: Callable[..., None]) -> None:
        """The second step of the construction (the class docstring).

        Args:
            settle_outside: OutsideAccess.settle.
            write_value: OutsideAccess.write_value(record, value, attached).
        """
        self._settle_outside = settle_outside
        self._write_value = write_value

    def busy(self) -> bool:
        """Whether a state dict is being read or written through the placeholders."""
        return self.loading or self.saving_module is not None

    def forward_started(self) -> None:
        """A forward starts: a load_state_dict or state_dict that raised midway is over."""
        self.loading = False
        self.saving_module = None

    def install(self, handles: list, names_by_module: dict) -> None:
        """The state-dict hooks on every module of the model, their handles
        appended to `handles`. names_by_module: module -> {name in its
        _parameters: record index} of the parameters the engine keeps."""
        ref = weakref.ref(self)

        def saving(module, prefix, keep_vars):
            bridge = ref()
            if bridge is not None and bridge.saving_module is None:
                bridge.saving_module = module

        def saved(module, state, prefix, local_metadata):
            bridge = ref()
            if bridge is not None and bridge.saving_module is module:
                bridge.saving_module = None
        for m in self._module.modules():
            # (torch's Module.state_dict runs on the placeholders; the values
            # come from the hooks below.)
            handles.append(m.register_state_dict_pre_hook(saving))
        for m, names in names_by_module.items():
            def save(module, state, prefix, local_metadata, names=names):
                bridge = ref()
                if bridge is not None:
                    bridge.fill(state, prefix, names)

            def load(module, state, prefix, local_metadata, strict, missing, unexpected, errors,
                     names=names):
                bridge = ref()
                if bridge is not None:
                    # load_state_dict(sd, assign=True) would set new Parameters
                    # made from the emptied entries in place of the engine's:
                    # the values go into the chunks, the parameters stay.
                    local_metadata["assign_to_params_buffers"] = False
                    bridge.load(state, prefix, names, errors)

            def loaded(module, incompatible):
                # torch copied the emptied entries into the placeholders after
                # the engine wrote the chunks: no user write (Note [Writes to a
                # parameter] in hooks/module_hooks.cpp). The root's hook runs last.
                bridge = ref()
                if bridge is not None:
                    bridge._hooks.sync_param_writes()
                    if module is bridge._module:
                        bridge.loading = False
            handles.append(m.register_state_dict_post_hook(save))
            handles.append(m.register_load_state_dict_pre_hook(load))
            handles.append(m.register_load_state_dict_post_hook(loaded))
        for m in self._module.modules():
            handles.append(m.register_state_dict_post_hook(saved))  # (after the values)

    def fill(self, state, prefix, names):
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
            entry = StateDictEntry.wrap(self.weight_copy(self._params.record_list[i]), self, i)
            state[key] = entry
            self.copies.append(weakref.ref(entry))

    def weight_copy(self, record) -> torch.Tensor:
        """A host copy of `record`'s weight in its 16-bit dtype: the slot, or
        the master while the slot holds a landed gradient."""
        i = self._params.index(record)
        with torch.no_grad(), _dtr.outside():
            if not self._hooks.landed(i):
                return self._store.gather(record, PARAM16)
            if not self._store.owns(record):
                raise UsageError(
                    f"model.state_dict() between backward and step under data parallel: the "
                    f"16-bit slot of '{record.name}' holds its gradient and another rank owns its "
                    f"master; call it after engine.step() (or use engine.state_dict() on every rank)")
            return self._store._read(record, PARAM32).to(self._dtype)

    def load(self, state, prefix, names, errors):
        """model.load_state_dict(): a module's parameters are written into the
        chunks (fp32 master and 16-bit copy); the entry given to torch's own
        copy becomes an empty tensor, which fits the empty placeholder."""
        # The writes made before this load go in once, at its first module:
        # the copies torch makes into the placeholders of the modules loaded
        # so far are the load's own, not writes (the root's post-hook syncs).
        if not self.loading:
            self._settle_between_steps()
            self.loading = True
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
                self._write_param(record, value)
            state[key] = value.new_empty(0)

    def _settle_between_steps(self):
        """settle_outside() where no forward or backward is running (a
        state_dict inside one reads the parameters as they are)."""
        if not self._hooks.running() and torch._C._current_graph_task_id() == -1:
            self._settle_outside()

    def settle_copies(self, lost: set) -> None:
        """Note [Writes into a state dict]: the entries written since they were
        handed out (and those dropped after a write) go into their parameters;
        the index of one whose slot holds a landed gradient goes into `lost`."""
        hooks = self._hooks
        records = self._params.record_list
        dropped, self.dropped_writes = self.dropped_writes, []
        for i, value in dropped:
            if hooks.landed(i):
                lost.add(i)
            else:
                self._write_value(records[i], value, attached=hooks.attached(i))
        kept = []
        for ref in self.copies:
            t = ref()
            if t is None:
                continue
            if t._version != t._tidal_version:
                if hooks.landed(t._tidal_index):
                    lost.add(t._tidal_index)
                else:
                    self._write_value(records[t._tidal_index], t,
                                      attached=hooks.attached(t._tidal_index))
                t._tidal_version = t._version  # (taken: its death hands nothing over again)
            kept.append(ref)
        self.copies = kept
