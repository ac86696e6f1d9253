"""What user code does to the parameters outside the engine's forward and
step: parameters read outside the forward of the module that owns them
(Note [External parameters] in hooks/module_hooks.h; the Python side in
external.py), writes to parameters between steps (Note [Writes to a
parameter] in hooks/module_hooks.cpp) and a raw loss.backward() (Note [The
end of a backward] in hooks/backward_end.h).

OutsideAccess is an object of the engine (engine._outside), made in
Engine._setup and given what it reads at construction."""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from .. import dtr as _dtr
from . import external as _external
from . import guards as _guards
from .errors import UnsupportedModelError, UsageError
from .loss_scaler import StaticLossScaler
from .params import ParamTable
from .store import HOLD, PARAM16, PARAM32, uncounted
from .user_grads import UserGradients

from .common import OutOfMemoryError

__all__ = ["OutsideAccess", "raw_backward_refusal"]


def raw_backward_refusal(precision: str, scaler, dp) -> str:
    """Why a backward must go through engine.backward() (Note [The end of a
    backward] in hooks/backward_end.h), or "" where loss.backward() works.

    Args:
        precision: the engine's precision ("fp16", "bf16" or "fp32").
        scaler: the optimizer step's loss scaler.
        dp: the data-parallel process group, or None.
    """
    if precision == "fp16" and not (isinstance(scaler, StaticLossScaler) and scaler.scale == 1.0):
        return ("tidal: loss.backward() on a model that tidal trains in fp16: the loss must be "
                "multiplied by the loss scale first, or small gradients underflow and the step "
                "divides them by the scale all the same. Call engine.backward(loss) instead "
                "(DeepSpeed: model_engine.backward(loss)); no gradient has landed")
    if dp is not None:
        return ("tidal: loss.backward() on a model that tidal trains data-parallel: the "
                "gradients are reduced across ranks by engine.backward(loss). Call "
                "engine.backward(loss) instead; no gradient has landed")
    return ""


def _held_elsewhere(param) -> bool:
    """Whether a tensor other than `param` holds its data's memory (a view, a
    `.data` taken, a storage torch.save keeps until it writes)."""
    with torch._C.DisableTorchFunctionSubclass():
        storage = param.untyped_storage()
        # (the parameter's own reference, and `storage` here)
        return torch._C._storage_Use_Count(storage._cdata) > 2


class OutsideAccess:
    """Reads of and writes to the parameters outside the engine's own path,
    and a backward the script ran itself.

    State it owns:
        grads:           the UserGradients serving `p.grad` between backward
            and step (Note [Gradients between backward and step]).
        pending_readers: module -> record indexes it was found reading (or was
            registered for by hand) in a forward; hooked at the start of the
            next (Note [External parameters]).
        outside_reads:   record indexes of the parameters attached by reads
            outside a forward, oldest first (Note [Writes to a parameter]).
        check_reads:     whether the next forward runs under PlaceholderCheck
            (the first one does, until one finishes).
        check_mode:      the PlaceholderCheck of the forward running, or None.

    What it needs of the engine is passed in: the ParamTable (`params`), the
    ParamStore (`store`: the slots and masters a write goes into), the
    ModuleHooks (`hooks`: reads, attaches, detaches, the writes taken and the
    end of a backward), the DtrLink (`dtr`), the GradientAccumulation
    (`accumulation`: a raw backward's fold and micro-step) and callables:
    `record_of_param(p)` (the record of a parameter the engine trains, or
    None), `settle_overlap(chunks=None)` (CPU Adam's updates since backward taken back:
    Note [Speculative updates and their undo]; with `chunks`, only those
    chunks' updates a step left to the forward waited for: Note [CPU Adam
    under the next forward]), `attach(records, module,
    for_backward=...)` and `attach_failed(e, module, records, retry)` (the
    hook wiring's attach and its out-of-memory report), `hook_module(m)` (a
    newly found reader's forward hooks), and of the StateDictBridge,
    `state_dict_busy()` and `settle_state_dict_copies(lost)` (Note [Writes
    into a state dict]).
    """

    def __init__(self, params: ParamTable, store, hooks, dtr, accumulation, *,
                 record_of_param: Callable, settle_overlap: Callable[..., None],
                 attach: Callable[..., None], attach_failed: Callable[..., None],
                 hook_module: Callable[[torch.nn.Module], None],
                 state_dict_busy: Callable[[], bool],
                 settle_state_dict_copies: Callable[[set], None]):
        self._params = params
        self._store = store
        self._hooks = hooks
        self._dtr = dtr
        self._accumulation = accumulation
        self._record_of_param = record_of_param
        self._settle_overlap = settle_overlap
        self._attach = attach
        self._attach_failed = attach_failed
        self._hook_module = hook_module
        self._state_dict_busy = state_dict_busy
        self._settle_state_dict_copies = settle_state_dict_copies
        # Note [External parameters]: readers found in a forward are hooked
        # at the start of the next (module -> record indexes to add).
        self.pending_readers: dict = {}
        # Parameters attached by reads outside a forward, oldest first (Note
        # [Writes to a parameter] in hooks/module_hooks.cpp).
        self.outside_reads: list = []
        self.check_reads = True  # the first forward runs under PlaceholderCheck
        self.check_mode = None
        # Gradients read and written by user code between backward and step
        # (Note [Gradients between backward and step] in user_grads.py).
        self.grads = UserGradients(params=params, store=store, hooks=hooks, accumulation=accumulation,
                                   settle_overlap=settle_overlap,
                                   settle_raw_backward=self.settle_raw_backward)

    # ------------------------------------------------ external parameters
    def serves_user_reads(self) -> bool:
        """Whether a use of a held parameter's placeholder is a read to serve
        now (Note [A parameter object stays the user's] in user_param.py): not
        inside a forward or a backward, nor while a state dict is read or
        written through the placeholders."""
        return not (self._hooks.running() or torch._C._current_graph_task_id() != -1
                    or self._state_dict_busy())

    def read_for_user(self, indexes):
        """Parameters `indexes`, held by a script and used outside a forward,
        come in as reads through their attributes do; they make room for each
        other, oldest first, but not for those of the same call."""
        keep = set()
        for i in indexes:
            self.read_param(i, room=True, keep=keep)
            keep.add(i)

    def read_param(self, i: int, room: bool = False, keep=()):
        """A read of parameter `i` found its placeholder (ParameterReads;
        Note [External parameters] in hooks/module_hooks.h). room: reads
        outside a forward before it go back to their chunks when the device is
        full (those in `keep` stay), as under model.apply."""
        hooks = self._hooks
        record = self._params.record_list[i]
        running = hooks.running()
        if not running:
            # Between backward and step, the CPU Adam updates made during
            # backward hold their chunks: taken back first, as for any other
            # use of the chunks there (Note [Speculative updates and their undo]).
            self._settle_overlap()
        else:
            # Its chunk's update may still run under this forward (Note [CPU
            # Adam under the next forward]).
            self._settle_overlap(chunks=(record.chunk,))
        learn, module = True, None
        if running:
            module = self._params.module_list[running[-1]]
            reader = _external.innermost_module()
            if reader is not None and reader is not module and reader in self._params.names:
                # Not hooked yet: served for `module` this time, hooked from
                # the next forward on.
                learn = False
                self.pending_readers.setdefault(reader, []).append(i)
            elif all(record is not r for r in self._params.module_records[module]):
                self._params.module_records[module].append(record)
        try:
            with _dtr.outside():
                hooks.read_param(i, learn)
        except OutOfMemoryError as e:
            # (Only under model.apply(fn), which reads module by module: elsewhere
            # a parameter the script holds would turn empty behind its back.)
            if running or not (room or _guards.inside_module_apply()) or \
                    not self._room_for_outside_read(i, keep):
                held = [] if running else [
                    j for j in self.outside_reads if hooks.attached(j)
                    and _held_elsewhere(self._params.record_list[j].param)]
                try:
                    self._attach_failed(e, module, [record], lambda: hooks.read_param(i, learn))
                except OutOfMemoryError as failed:
                    if not held:
                        raise
                    names = [self._params.record_list[j].name for j in held]
                    raise OutOfMemoryError(
                        f"tidal: parameter '{record.name}' was read outside a forward while "
                        f"{len(held)} parameters read before it ('{names[0]}'"
                        f"{' .. ' + repr(names[-1]) if len(names) > 1 else ''}) are still held by "
                        f"tensors made from them (views, `.data`, a storage being saved: "
                        f"parameters_to_vector(model.parameters()), torch.save of the parameter "
                        f"list), so they cannot go back to their chunks to make room, and the "
                        f"device budget does not hold them all at once. Ways that work: host "
                        f"copies of every weight with engine.state_dict() (fp32) or "
                        f"engine.parameters_fp32(); saving with engine.save_checkpoint(); or "
                        f"reading fewer parameters at once (one at a time, each used and dropped "
                        f"before the next). {failed}") from None
        if not running:
            self.outside_reads.append(i)
        elif not learn:
            self._attach_for_this_backward(record)
        self._dtr.rebalance()

    def _attach_for_this_backward(self, record):
        """A read the engine learns only for the next forward: in this step's
        backward no module's backward hook brings the parameter in, and
        autograd would accumulate its gradient against the empty placeholder
        (torch's "size of tensor a (0) must match" for a parameter used only
        through expand or view: Reformer's axial position embeddings). A
        one-time hook on the parameter attaches it before its gradient
        accumulates."""
        ref = weakref.ref(self)
        handle = None

        def attach(grad):
            outside = ref()
            if handle is not None:
                handle.remove()
            if outside is not None and not outside._hooks.attached(
                    outside._params.index(record)):
                outside._attach([record], None, for_backward=True)
            return grad

        if record.trainable:
            handle = record.param.register_hook(attach)

    def _room_for_outside_read(self, i: int, keep=()) -> bool:
        """A read outside a forward found no device room: the parameters read
        outside a forward before it go back to their chunks, oldest first,
        each with what was written to it (model.apply(init_fn) over a model
        larger than the device reads one module at a time), until parameter
        `i` fits. False when none is left to go."""
        hooks = self._hooks
        # A tensor set as the data of one of them (`p.data = p.data * 0.5`
        # over model.parameters()) goes into its chunks first: a detach would
        # put the placeholder over it.
        self.settle(end_reads=False, grads=False)
        k = 0
        while k < len(self.outside_reads):
            j = self.outside_reads[k]
            if j in keep or _held_elsewhere(self._params.record_list[j].param):
                # (A view of it, its `.data` or its storage is held: sent back
                # to its chunks, that would alias memory another parameter
                # reuses. Note [Parameters fail closed] in user_param.py.)
                k += 1
                continue
            del self.outside_reads[k]
            if not hooks.attached(j) or hooks.served(j):
                continue
            with _dtr.outside():
                hooks.detach([j], HOLD)
            self._carry_slot(self._params.record_list[j])
            try:
                with _dtr.outside():
                    hooks.read_param(i, True)
                return True
            except OutOfMemoryError:
                continue
        return False

    def register_external(self, module, param):
        """tidal.register_external_parameter after initialize."""
        r = self._record_of_param(param)
        if module not in self._params.names:
            raise ValueError(f"tidal.register_external_parameter: the module ({type(module).__name__}) "
                             f"is not part of the model this engine trains")
        self.pending_readers.setdefault(module, []).append(self._params.index(r))

    def hook_readers(self):
        """Hooks the modules found reading parameters (and those registered by
        hand) before this forward starts: from now on their forward brings the
        parameters in."""
        if not self.pending_readers:
            return
        pending, self.pending_readers = self.pending_readers, {}
        for m, ids in pending.items():
            records = self._params.module_records.setdefault(m, [])
            for i in ids:
                if all(self._params.record_list[i] is not r for r in records):
                    records.append(self._params.record_list[i])
            if m in self._params.module_index:
                for i in ids:
                    self._hooks.add_to_module(self._params.module_index[m], i)
                continue
            index = self._hooks.add_module(sorted(set(ids)))
            self._params.module_list.append(m)
            self._params.module_index[m] = index
            self._hook_module(m)

    def start_check(self):
        """The root's forward starts: until a forward has finished, it runs
        under PlaceholderCheck."""
        if self.check_reads and self.check_mode is None:
            self.check_mode = _external.PlaceholderCheck(self)
            self.check_mode.__enter__()

    def stop_check(self, finished: bool):
        """The root's forward ended (`finished`; later forwards run without the
        check) or raised."""
        if self.check_mode is not None:
            mode, self.check_mode = self.check_mode, None
            mode.__exit__(None, None, None)
            if finished:
                self.check_reads = False

    def check_read(self, p, func):
        """PlaceholderCheck: parameter `p` reached torch function `func`."""
        r = self._record_of_param(p)
        if r is None or self._hooks.attached(self._params.index(r)):
            return
        reader = _external.innermost_module()
        where = (f"module '{self._params.name(reader)}' "
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

    # ------------------------------------------------ writes between steps
    def settle(self, end_reads: bool = True, grads: bool = True):
        """Where the engine takes the weights back (a forward's start, the step,
        state_dict, saving and loading) and before a backward overwrites the
        16-bit slots with gradients: what user code wrote to the parameters
        since goes into the chunks, and a write nothing holds is a UsageError
        naming the parameter, raised after every write that could be kept was
        (Note [Writes to a parameter] in hooks/module_hooks.cpp). end_reads:
        the parameters read outside a forward go back to their chunks (not
        before a backward: the graph may hold views of them). grads: the
        gradients handed to user code go back to their slots (Note
        [Gradients between backward and step]; not when a parameter read
        makes room: the script may still be writing them)."""
        # Gradients handed to user code go back into their slots first.
        if grads:
            self.grads.write_back()
        hooks = self._hooks
        records = self._params.record_list
        written, assigned, lost = hooks.take_param_writes()
        lost = set(lost)
        # Brought in by a read outside a forward: a write through `p.data`
        # bumps no version, so their 16-bit values are compared with the masters.
        reads = [i for i in range(len(records)) if hooks.attached(i) and not hooks.served(i)] \
            if end_reads else []
        for i in sorted(set(written) | set(reads)):
            if hooks.landed(i):
                if i in written:
                    lost.add(i)  # (the slot holds the gradient now)
                continue
            self._carry_slot(records[i], records[i].param.detach() if hooks.attached(i) else None)
        problems = []
        for i, value in assigned:
            r = records[i]
            if list(value.shape) != list(r.shape):
                problems.append(
                    f"'{r.name}'.data was set to a tensor of shape {tuple(value.shape)}; the parameter "
                    f"has shape {tuple(r.shape)}. tidal keeps a parameter's shape; the value was not "
                    f"taken (the parameter keeps its previous one)")
                continue
            if hooks.landed(i):
                lost.add(i)
                continue
            self.write_value(r, value, attached=hooks.attached(i))
        self._settle_state_dict_copies(lost)  # Note [Writes into a state dict]
        if end_reads:
            with _dtr.outside():
                hooks.end_backward()
            self.outside_reads.clear()
        if lost:
            problems.insert(0, self._lost_writes_message(sorted(lost)))
        if problems:
            raise UsageError("; ".join(problems))

    def _carry_slot(self, record, value=None):
        """The 16-bit value of `record` (`value`, the attached parameter's; else
        its slot) holds what user code wrote: the fp32 master takes it where
        the two differ (elsewhere it keeps its own bits, which the 16-bit copy
        holds rounded)."""
        store = self._store
        if not (record.trainable and store.owns(record)):
            return  # (no master here: the slot is the value)
        # Both where they are: another tensor of the slot's chunk may be in use.
        with torch.no_grad(), uncounted(), _dtr.outside():
            if value is None:
                with store.slots(record, (PARAM16,)) as (slot,):
                    value = slot.clone()
            value = value.reshape(-1)
            with store.slots(record, (PARAM32,)) as (master,):
                value = value.to(master.device)
                changed = value != master.to(value.dtype)
                if bool(changed.any()):
                    master[changed] = value[changed].to(master.dtype)

    def write_value(self, record, value, attached: bool):
        """`p.data = value`: the 16-bit copy (through the attached parameter,
        whose data is its slot again) and the fp32 master take `value`."""
        store = self._store
        flat = value.detach().reshape(-1)
        with torch.no_grad(), uncounted(), _dtr.outside():
            if attached:
                # (Not an access that says it writes: Note [Chunks on NVMe: clean chunks].)
                store.chunks.mark_written(record.id, PARAM16)
                record.param.data.copy_(value.detach().reshape(record.shape))
            else:
                with store.slots(record, (PARAM16,)) as (slot,):
                    slot.copy_(flat)
            if record.trainable and store.owns(record):
                with store.slots(record, (PARAM32,)) as (master,):
                    master.copy_(flat)

    def _lost_writes_message(self, lost) -> str:
        names = [self._params.record_list[i].name for i in lost]
        shown = ", ".join(f"'{n}'" for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        first = names[0]
        owner, _, attr = first.rpartition(".")
        path = f"model.{first}" if owner else first
        return (f"tidal: an in-place write to {shown} made while its module's forward did not hold it "
                f"(outside a forward, in a forward pre-hook before the module takes its parameters, or "
                f"between backward and step) reached nothing: there the parameter object held an empty "
                f"placeholder (its values live in tidal's chunks), or between backward and step a weight "
                f"made from its master, so the write is lost and training would go on without it. Ways "
                f"that keep it: write through the module's "
                f"attribute, which brings the parameter in (under torch.no_grad(): "
                f"{path}.mul_(...), torch.nn.init.zeros_({path}), model.apply(init_fn) that uses "
                f"module.weight); set {path}.data = new_tensor; or load values with "
                f"model.load_state_dict(...). Between backward and step, write after engine.step(); "
                f"a write during a forward, with engine.backward(loss) rather than loss.backward(). "
                f"These parameters keep their previous values (docs/parameters.md)")

    # ------------------------------------------------ loss.backward() itself
    def settle_raw_backward(self):
        """What engine.backward() does after its backward, for a backward the
        script ran itself (loss.backward()): gradient accumulation's fold,
        and the micro-step counted (the loss is the script's own: not divided
        by gradient_accumulation_steps, as in plain PyTorch)."""
        if not self._hooks.take_backward_ended():
            return
        self._dtr.end()
        if self._accumulation.summing:
            self._accumulation.fold()
        self._accumulation.backward_done()
