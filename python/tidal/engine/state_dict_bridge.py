"""model.state_dict() and load_state_dict() through the engine's chunks: the
hooks torch's Module calls, reading and writing the chunk slots, and the
entries handed out, which read and write as their parameters' memory (Note
[Writes into a state dict]).

StateDictBridge owns that state; the Engine builds it in _setup and the
engine's OutsideAccess (outside_access.py) asks it what it needs."""
from __future__ import annotations

import sys
import weakref
from typing import Callable

import torch

from .. import dtr as _dtr
from . import user_param as _user_param
from .errors import UsageError
from .external import _HARMLESS, _tensors
from .outside_access import _held_elsewhere
from .store import PARAM16, PARAM32, uncounted

__all__ = ["StateDictBridge", "StateDictEntry"]


class StateDictEntry(torch.Tensor):
    """A tensor of model.state_dict() under a tidal engine (Note [Writes into a
    state dict]): a host copy of its parameter's 16-bit weight that reads and
    writes as the parameter's own memory would. Before a torch function reads
    it, it takes the parameter's value again where that may have changed; a
    write through it goes into the parameter at once. Torch functions return
    plain tensors; it pickles and deep-copies as one."""

    @staticmethod
    def wrap(copy: torch.Tensor, bridge: "StateDictBridge", index: int,
             alias_of: "StateDictEntry | None" = None) -> "StateDictEntry":
        """An entry holding `copy` for record `index`; alias_of: an entry of
        the same record in the same state dict (a tied weight's second key),
        whose memory, version count and bookkeeping it shares."""
        if alias_of is not None:
            with torch._C.DisableTorchFunctionSubclass():
                base = alias_of.detach()  # (shares the memory and the version count)
            entry = torch.Tensor._make_subclass(StateDictEntry, base)
            entry._tidal_state = alias_of._tidal_state
        else:
            entry = torch.Tensor._make_subclass(StateDictEntry, copy)
            # [version synced, epoch synced]: shared by the aliases of one entry.
            entry._tidal_state = [entry._version, _user_param.epoch()]
        entry._tidal_bridge = weakref.ref(bridge)
        entry._tidal_index = index
        return entry

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func in _ENTRY_META:
                return func(*args, **kwargs)
            if any(type(a) in _user_param._SUBCLASSES for a in _tensors(args, kwargs)):
                # (A parameter an engine trains among the arguments: its
                # class's __torch_function__ brings it in, and takes care of
                # the entries too.)
                return NotImplemented
            tracked = sync_entries(args, kwargs)
            if func in _ALIASES and len(args) == 1 and not kwargs:
                # `.data` and detach(): a view of the entry (plain PyTorch's
                # would be an alias with a version count of its own, or none
                # keeping the entry alive; a view shares its version count and
                # keeps it alive, so writes through it are seen).
                out = args[0].view(args[0].shape)
            else:
                out = func(*args, **kwargs)
                if func in _NUMPY and args and out.__array_interface__["data"][0] == args[0].data_ptr():
                    # A write into the array would bypass every torch
                    # function and the version count: refused by numpy
                    # ("assignment destination is read-only"), not lost
                    # (Note [Writes into a state dict]).
                    out.flags.writeable = False
            if tracked:
                push_entries(tracked)
            return out

    @property
    def _tidal_dirty(self) -> bool:
        return self._version != self._tidal_state[0]

    def __del__(self):
        if sys.is_finalizing() or not self._tidal_dirty:
            return  # (at interpreter exit there is no model left to write to)
        bridge = self._tidal_bridge()
        if bridge is None:
            return
        with uncounted(), torch._C.DisableTorchFunctionSubclass():  # (tidal's own bytes)
            value = self.detach().clone()
        self._tidal_state[0] = self._version  # (its aliases hand nothing over again)
        bridge.dropped_writes.append((self._tidal_index, value))

    def __reduce_ex__(self, protocol):
        sync_entries((self,), {})
        return torch.Tensor._make_subclass(torch.Tensor, self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        # Keyed by this entry: a plain alias made here dies at once, and the
        # next entry's alias may get its id, and with it this entry's copy
        # from the memo (deepcopy(model.state_dict()) handed out one entry's
        # values under another's key).
        if id(self) in memo:
            return memo[id(self)]
        sync_entries((self,), {})
        with torch.no_grad():
            out = torch.Tensor._make_subclass(torch.Tensor, self).clone(memory_format=torch.preserve_format)
        out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out


def _entry_meta():
    """Torch functions that read only an entry's metadata: no sync."""
    t = torch.Tensor
    out = set(_HARMLESS) - {t.__eq__}
    for name in ("size", "dim", "numel", "nelement", "element_size", "is_contiguous", "stride",
                 "storage_offset", "ndimension", "__len__", "data_ptr"):
        out.add(getattr(t, name))
    for name in ("shape", "ndim", "nbytes", "itemsize", "_version"):
        out.add(getattr(t, name).__get__)
    out.add(torch.numel)
    return frozenset(out)


_ENTRY_META = _entry_meta()
_ALIASES = frozenset((torch.Tensor.data.__get__, torch.Tensor.detach))
_NUMPY = frozenset((torch.Tensor.numpy, torch.Tensor.__array__))


def _entries_in(args, kwargs):
    return [a for a in _tensors(args, kwargs) if type(a) is StateDictEntry]


def sync_entries(args, kwargs) -> list:
    """Before a torch function runs on them: each StateDictEntry among the
    arguments holds its parameter's value (a write through a view of it made
    since goes into the parameter first). Returns (entry, version) of those
    to look at after the function (push_entries)."""
    entries = _entries_in(args, kwargs)
    if not entries:
        return []
    tracked = []
    for e in entries:
        bridge = e._tidal_bridge()
        if bridge is not None and bridge.syncs():
            bridge.sync(e)
            tracked.append((e, e._version))
    return tracked


def push_entries(tracked) -> None:
    """After a torch function: an entry it wrote goes into its parameter."""
    for e, version in tracked:
        if e._version != version:
            bridge = e._tidal_bridge()
            if bridge is not None:
                bridge.push(e)


# Note [Writes into a state dict]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Plain PyTorch's model.state_dict() holds the parameters' own memory
# (detached views), so a script that writes into an entry (clamping,
# pruning by mask, loading by hand into the dict it got) writes into the
# model, a write to the parameter shows in the entry, a tied weight's two
# keys are one memory, and an entry kept across steps holds the trained
# weights. tidal's entries are host copies of the chunks' 16-bit weights, so
# each one (a StateDictEntry) keeps itself equal to its parameter:
#   * before a torch function reads it (its __torch_function__; the
#     parameter class's too, where both are arguments: user_param.py), it
#     takes the parameter's value again where that may have changed since it
#     last did. "May have changed" is a count (user_param.epoch()) raised by
#     every use of a parameter by user code, the engine's entry points, a
#     load and an entry's write; and always where the parameter's memory is
#     held by another tensor (a view, `.data`, a tensor set as its data) or
#     its class is not tidal's (writes there are not seen);
#   * a torch function that writes it (an in-place op, `out=`, __setitem__)
#     puts its value into the parameter at once, 16-bit copy and fp32 master,
#     as `p.data.copy_(entry)` would (push);
#   * a write through a view of it (`sd[k][0].zero_()`), which no torch
#     function of the entry sees, bumps the entry's version count (views
#     share it): it goes into the parameter before the parameter or the entry
#     is next used (flush), and at the latest where the engine takes the
#     weights back (OutsideAccess.settle calls settle_copies). Its `__del__`
#     hands such a write over too, so a dict dropped right after it
#     (`model.state_dict()[k][0].zero_()`) is not lost.
# The keys of a tied weight in one state dict share one entry's memory (and
# data_ptr, as Hugging Face's tied-weight checks expect). Between backward and
# step (the slot holds the gradient) a write waits and is a UsageError naming
# it at the step, as a write to the parameter there. Inside a forward or a
# backward, and while a state dict is read or loaded, entries neither read
# nor write the parameters (their writes wait for settle_copies); a load of
# entries loads their parameters' values at that moment. To torch an entry
# is a plain tensor: its functions return plain tensors, `.data` is an alias
# sharing its version count, it pickles, torch.save's and deep-copies as one
# (after taking the parameter's value). Its numpy() (and np.asarray of it)
# is read-only: a write into the array would reach neither a torch function
# nor the version count, so numpy refuses it ("assignment destination is
# read-only") where it would be lost. Not covered: a view of an entry
# written after the view outlived every other reference to the entry and
# the entry was collected (its memory is then the user's alone); a write
# through untyped_storage() (Hugging Face's safetensors reads entries'
# storages to find shared ones, so it cannot be refused); and an array or
# storage of an entry read after a later step (plain PyTorch's would show
# the trained weights; an entry's shows them only through torch functions).
class StateDictBridge:
    """model.state_dict() and model.load_state_dict() of the model an engine
    trains: the module itself holds empty placeholders (a torch.save of them
    would lose the model without a word), so hooks on every module read and
    write the chunks instead.

    State it owns:
        copies:         record index -> weakrefs of the StateDictEntry
            tensors handed out (Note [Writes into a state dict]).
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
        self._settle_overlap: "Callable[[], None] | None" = None
        self.copies: dict = {}
        self.dropped_writes: list = []
        self._filling: dict = {}
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
        # The OutsideAccess whose write_value this is: its settle_overlap
        # (CPU Adam's updates taken back before an entry reads or writes a
        # chunk). (Engine._setup passes the bound method; a keyword of its own
        # would be the cleaner way.)
        outside = getattr(write_value, "__self__", None)
        self._settle_overlap = getattr(outside, "_settle_overlap", None) or (lambda: None)

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
                bridge._filling = {}

        def saved(module, state, prefix, local_metadata):
            bridge = ref()
            if bridge is not None and bridge.saving_module is module:
                bridge.saving_module = None
                bridge._filling = {}
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
                    _user_param.note_write()  # (the entries take the loaded values)
            handles.append(m.register_state_dict_post_hook(save))
            handles.append(m.register_load_state_dict_pre_hook(load))
            handles.append(m.register_load_state_dict_post_hook(loaded))
        for m in self._module.modules():
            handles.append(m.register_state_dict_post_hook(saved))  # (after the values)

        def load_done(module, incompatible):
            # The root's post-hook runs last: the load is over. (Also where the
            # root holds no parameter of its own: `loading` stayed on until the
            # next forward, and a held parameter read its empty placeholder.)
            bridge = ref()
            if bridge is not None and bridge.loading:
                bridge._hooks.sync_param_writes()
                bridge.loading = False
                _user_param.note_write()
        handles.append(self._module.register_load_state_dict_post_hook(load_done))

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
            # parameters' memory, so a write into one is a write to the model;
            # a tied weight's keys share one entry's memory, as they share the
            # parameter's there.
            tied = self._filling.get(i)
            if tied is not None:
                entry = StateDictEntry.wrap(None, self, i, alias_of=tied)
            else:
                entry = StateDictEntry.wrap(self.weight_copy(self._params.record_list[i]), self, i)
                if self.saving_module is not None:
                    self._filling[i] = entry
            state[key] = entry
            self.copies.setdefault(i, []).append(weakref.ref(entry))

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
            owner = value._tidal_bridge() if type(value) is StateDictEntry else None
            if owner is not None:
                # An entry: its parameter's value now, as plain PyTorch's
                # entry, which shares the parameter's memory, holds (also one
                # loaded earlier in this load; this engine's entries were
                # settled when the load began).
                if owner is not self and owner.syncs():
                    owner.flush(value._tidal_index)
                value = owner.current(value)
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
        last taken (through a view of one, which no torch function of the
        entry sees; and those dropped after such a write) go into their
        parameters; the index of one whose slot holds a landed gradient goes
        into `lost`."""
        hooks = self._hooks
        records = self._params.record_list
        dropped, self.dropped_writes = self.dropped_writes, []
        for i, value in dropped:
            if hooks.landed(i):
                lost.add(i)
            else:
                self._write_value(records[i], value, attached=hooks.attached(i))
        for i in list(self.copies):
            for t in self._live(i):
                if t._tidal_dirty:
                    if hooks.landed(i):
                        lost.add(i)
                    else:
                        with torch._C.DisableTorchFunctionSubclass():
                            value = t.detach()
                        self._write_value(records[i], value, attached=hooks.attached(i))
                    t._tidal_state[0] = t._version  # (taken: its death hands nothing over again)
        # (The engine takes the weights back: an entry reads them again.)
        _user_param.note_write()

    # ------------------------------------------------ entries as the parameters' memory
    def _live(self, i: int) -> list:
        """The entries of record `i` still alive (the dead ones forgotten)."""
        refs = self.copies.get(i)
        if not refs:
            return []
        live = [t for t in (r() for r in refs) if t is not None]
        if len(live) != len(refs):
            if live:
                self.copies[i] = [weakref.ref(t) for t in live]
            else:
                del self.copies[i]
        return live

    def syncs(self) -> bool:
        """Whether an entry takes and gives its parameter's value now: not
        inside a forward or a backward, nor while a state dict is read or
        written (there the writes wait for settle_copies)."""
        return not (self._hooks.running() or torch._C._current_graph_task_id() != -1
                    or self.busy())

    def _placeholder(self, i: int) -> bool:
        """Whether parameter `i` holds its empty placeholder (its values in
        the chunks), not its 16-bit weight (read outside a forward) nor a
        tensor set as its data."""
        record = self._params.record_list[i]
        with torch._C.DisableTorchFunctionSubclass():
            return record.param.numel() == 0 and record.numel != 0

    def _volatile(self, i: int) -> bool:
        """Whether parameter `i`'s value may change with nothing tidal sees (a
        view, `.data` or a tensor set as its data, written): an entry then
        reads it again at each use."""
        p = self._params.record_list[i].param
        if type(p) not in _user_param._SUBCLASSES:
            return True  # (a class tidal could not give its own: its uses are not seen)
        return not self._placeholder(i) and _held_elsewhere(p)

    def current(self, entry) -> torch.Tensor:
        """The value of `entry`'s parameter now (16-bit, shaped like it): the
        chunks' (its slot, or the master while the slot holds a landed
        gradient), or the tensor the parameter holds."""
        i = entry._tidal_index
        record = self._params.record_list[i]
        if self._placeholder(i):
            self._settle_overlap()
            return self.weight_copy(record)
        with torch._C.DisableTorchFunctionSubclass():
            return record.param.detach()

    def sync(self, entry) -> None:
        """Before a torch function uses `entry`: a write into it (or a view of
        it) not yet taken goes into the parameter; else it reads the
        parameter's value again where that may have changed since it last
        did (Note [Writes into a state dict])."""
        self.flush(entry._tidal_index)
        if entry._tidal_dirty:
            return  # (the slot holds a landed gradient: the write waits, named at the step)
        state = entry._tidal_state
        if state[1] == _user_param.epoch() and not self._volatile(entry._tidal_index):
            return
        value = self.current(entry)
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass(), uncounted(), _dtr.outside():
            entry.copy_(value.reshape(entry.shape))
        state[0], state[1] = entry._version, _user_param.epoch()

    def push(self, entry) -> None:
        """A torch function wrote `entry`: its value goes into the parameter at
        once, as plain PyTorch's entry writes the parameter's memory. Between
        backward and step (the slot holds the gradient) it waits and is named
        at the step (settle_copies)."""
        i = entry._tidal_index
        if self._hooks.landed(i):
            return
        record = self._params.record_list[i]
        with torch._C.DisableTorchFunctionSubclass():
            value = entry.detach()
        if self._placeholder(i) or self._hooks.attached(i):
            self._settle_overlap()
            self._write_value(record, value, attached=self._hooks.attached(i))
        else:
            # A tensor set as its data (`p.data = t`), which the engine takes
            # where it takes the weights back: written there, as plain
            # PyTorch's entry of `p` is `t`'s memory.
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass(), uncounted():
                record.param.data.copy_(value.reshape(record.shape))
        entry._tidal_state[0] = entry._version
        _user_param.note_write()  # (the other entries of the parameter read it again)
        entry._tidal_state[1] = _user_param.epoch()

    def flush(self, i: int) -> None:
        """Before parameter `i` or one of its entries is used: writes into its
        entries that no torch function of theirs saw (through a view), and
        those of entries dropped since, go into it."""
        if self.dropped_writes and any(j == i for j, _ in self.dropped_writes) \
                and not self._hooks.landed(i):
            mine = [v for j, v in self.dropped_writes if j == i]
            self.dropped_writes = [(j, v) for j, v in self.dropped_writes if j != i]
            record = self._params.record_list[i]
            self._settle_overlap()
            for value in mine:
                self._write_value(record, value, attached=self._hooks.attached(i))
            _user_param.note_write()
        for t in self._live(i):
            if t._tidal_dirty:
                self.push(t)


_user_param.connect_state_dicts(StateDictEntry, sync_entries, push_entries)
