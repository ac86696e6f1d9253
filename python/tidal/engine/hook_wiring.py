"""The module hooks, the memory tracer and the parameter hooks: where the
engine meets torch's forward and backward (one C++ call per hook, Note
[One call per hook] in hooks/module_hooks.h).

HookWiring is an object of the engine (engine._wiring), made in
Engine._setup and given what it reads at construction. It owns the
ModuleHooks, the MemoryTracer, the saved-tensor pair, the hook handles and
the meter's switches; the engine hands the ModuleHooks and the tracer on to
its other objects.

The engine's meters (Note [The memory tracer] in runtime/tracer/memory_tracer.h)
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every hook is a trace point: one call into the C++ memory tracer measures
non-chunk device memory (N), records the interval's peak and sets the chunk
budget (the warm-up cap, then the recorded trace: Note [The warm-up budget]
there). What N is depends on the device (new_tracer below):
* CUDA with chunk blocks from torch's caching allocator (the store installs
  that provider; Note [Chunk memory and torch's caching allocator] in
  hooks/torch_memory_provider.h): chunk blocks come from torch's allocator,
  so N = the bytes it has allocated - H, H = what it allocated for the chunk
  blocks the provider holds (resident chunks and the scheduler's cached
  blocks alike). The counts are tidal's own, kept from torch's allocator
  trace, so torch's memory statistics stay the user's. The peak is exact: H
  is constant between two chunk-block calls, the provider folds (peak - H)
  into its window at each call and restarts its peak, and at the point the
  peak is max(window, peak now - H). N, in allocated bytes, plans the
  chunks; the budget itself is kept in reserved bytes, what torch's cache
  keeps free included: torch's cap at the device budget refuses past it, and
  a point whose reserved peak passed the budget counts as an overrun (Note
  [Who owns a device byte] in runtime/memory/caching_allocator_model.h).
* CUDA without the provider (torch's allocator could not be reached):
  chunk blocks are cudaMalloc'ed and can never use torch's cache, so N =
  torch's reserved bytes, and its peak torch's peak reserved.
* The simulated device: torch's "device" tensors are CPU tensors, and N is
  torch's CPU allocations counted by hooks/host_allocation_counter (while
  forward and backward run), less what was counted when the engine was
  created. A test may install the CPU stand-in of the provider
  (tidal._C.torch_cpu_memory_provider): chunk blocks then come from torch's
  CPU allocator, always counted, and N and its peak are computed as on
  CUDA with the provider, less the same at engine creation.
"""
from __future__ import annotations

import gc
import weakref
from typing import Callable

import torch

from .. import _C
from .. import dtr as _dtr
from . import hooks as _hooks
from . import user_param as _user_param
from .errors import UnsupportedModelError, UsageError

from .common import OutOfMemoryError
from .params import ParamTable
from .store import HOST, PARAM32

__all__ = ["HookWiring", "new_tracer", "stop_count_of"]


# Note [One engine's window is its own] (hooks/host_allocation_counter.h):
# the simulated device's count is one per process; the token of the wiring
# that started it, so a dropped engine's finalizer stops only its own.
_COUNT_OWNER: list = [None]


def stop_count_of(token) -> None:
    """An engine's finalizer: the count stops if that engine started it (an
    engine collected in its own forward leaves no count running), and runs on
    if another engine's window is open."""
    if _COUNT_OWNER[0] is token:
        _COUNT_OWNER[0] = None
        _C.chunks.set_host_allocation_counting(False)


def _collection_uncounted(phase: str, _info) -> None:
    # What finalizers allocate while the cycle collector runs (a dropped
    # engine giving its model's weights back) is not the device memory of the
    # engine whose forward tripped the collection.
    if phase == "start":
        _C.chunks.enter_uncounted()
    else:
        _C.chunks.exit_uncounted()


if _collection_uncounted not in gc.callbacks:
    gc.callbacks.append(_collection_uncounted)


def new_tracer(store, cuda: bool, sim_caching: bool, warmup_room: int):
    """The tracer with the meter of Note [The memory tracer] for this device.

    Args:
        store: the ParamStore (its device, budget, margin and chunks).
        cuda: whether the compute device is a GPU.
        sim_caching: on the simulated device, whether its non-chunk
            allocations are placed by torch's caching rules.
        warmup_room: the warm-up budget's chunk room (budget.check).
    """
    provider = store.device.memory_provider()
    kwargs = {}
    if isinstance(provider, _C.TorchMemoryProvider):
        # Chunk blocks from torch's allocator: torch's allocated bytes less
        # the blocks the provider holds (on the simulated device's CPU
        # stand-in, less what was there before this engine).
        kwargs = {"provider": provider, "provider_baseline": not cuda}
    elif cuda:
        # Chunk blocks from cudaMalloc never use torch's cache: torch's
        # reserved bytes are the non-chunk memory.
        dev = store.torch_device
        kwargs = {"read": lambda: (torch.cuda.memory_reserved(dev), torch.cuda.max_memory_reserved(dev)),
                  "restart": lambda: torch.cuda.reset_peak_memory_stats(dev)}
    # Else the simulated device: torch's CPU allocations while forward and
    # backward run, less what was live when the engine was made; placed by
    # torch's caching allocator's rules where tidal.simulated_allocator says
    # (Note [Who owns a device byte] in runtime/memory/caching_allocator_model.h).
    elif sim_caching:
        kwargs = {"torch_caching": True}
    return _C.chunks.MemoryTracer(store.chunks, device_budget=store.device_budget,
                                  margin=store.margin, warmup_room=warmup_room,
                                  **kwargs)


class HookWiring:
    """The engine's hooks into torch's forward and backward, its memory
    tracer, and the attaches and detaches made outside the hooks' own path
    (a saved tensor unpacked in backward, DTR's replays).

    State it owns:
        hooks:            the ModuleHooks (the parameters' use counts,
            attached and landed flags, Note [One call per hook]).
        tracer:           the MemoryTracer (Note [The memory tracer]).
        handles:          the removable handles of every hook on the model
            (the StateDictBridge adds its own).
        saved_tensor_pair: the (pack, unpack) pair that packs saved aliases
            of a parameter's slot as (parameter, geometry); it serves
            tidal.recompute's replays too (RecomputePlan.parameter_aliases).
        cuda, cuda_room, sim_caching, enforce_budget: how the device's
            non-chunk memory is metered and limited (Note [The memory
            tracer], Note [Room on a cache miss] in hooks/cuda_room.h, Note
            [The simulated device's budget is a hard limit]).
        _saved_hooks:     the saved_tensors_hooks context of the forward
            running, or None.
        _pre_backward_hooks: module -> the tensor hook its outputs get.

    What it needs of the engine is passed in, in two steps. At construction:
    the ParamStore (`store`), the ParamTable (`params`), the Config
    (`config`), the tracer made earlier in Engine._setup (`tracer`), the
    DtrLink (`dtr`), the StepOverlap or None (`overlap`), the 16-bit dtype
    (`dtype`) and `budget()` (the engine's budget.check result, replaced when
    the chunks are relaid). Then connect(), once the objects a forward's
    root hooks call exist (the OutsideAccess and the StateDictBridge are
    built after it, as they need its ModuleHooks): `before_forward()` (what
    a forward that is not a recompute settles first: a raw backward, a state
    dict's copies, outside writes), `hook_readers()`, `start_check()` and
    `stop_check(finished)` (the OutsideAccess's readers and
    PlaceholderCheck). No hook is on the model before connect().

    Torch holds its hooks: the module hooks (C++ callables the collector can
    traverse) hold it strongly, the gradient hooks and the output tensor
    hooks weakly (Note [Gradient hooks hold the engine weakly] in common.py).
    It holds the engine only through the callables above, so it lives and
    dies with the engine.
    """

    def __init__(self, *, store, params: ParamTable, config, tracer, dtr, overlap, dtype,
                 cuda: bool, cuda_room: bool, sim_caching: bool, enforce_budget: bool,
                 budget: Callable):
        self._store = store
        self._params = params
        self._config = config
        self._dtr = dtr
        self._overlap = overlap
        self._dtype = dtype
        self._budget = budget
        self._before_forward: "Callable[[], None] | None" = None  # (connect())
        self._hook_readers: "Callable[[], None] | None" = None
        self._start_check: "Callable[[], None] | None" = None
        self._stop_check: "Callable[..., None] | None" = None
        self.cuda = cuda
        self.cuda_room = cuda_room
        self.sim_caching = sim_caching
        self.enforce_budget = enforce_budget
        self.tracer = tracer
        self._saved_hooks = None
        self._pre_backward_hooks: dict = {}
        self.count_token = object()  # (stop_count_of; holds nothing of the engine)
        self.handles = []
        self.hooks = self._new_hooks()
        # Note [Plain classes inside a forward] in user_param.py.
        self.forward_classes = _user_param.ForwardClasses(params)
        # Saved tensors that alias a parameter's slot are packed as (parameter,
        # geometry) and rebuilt from its data in backward, so nothing keeps a
        # chunk address across a move (Note [Parameters keep their TensorImpl]
        # in hooks/param_binding.h); the same pair serves tidal.recompute's
        # replays (RecomputePlan.parameter_aliases).
        self.saved_tensor_pair = self.hooks.saved_tensor_hooks(self._unpack_attach)

    def connect(self, *, before_forward: Callable[[], None], hook_readers: Callable[[], None],
                start_check: Callable[[], None], stop_check: Callable[..., None]) -> None:
        """The second step of the construction: what the root's forward hooks
        call, from objects built after this one (the class docstring).

        Args:
            before_forward: what a forward that is not a recompute settles first.
            hook_readers: hooks the modules found reading parameters outside their forward.
            start_check: the root's forward starts (PlaceholderCheck).
            stop_check: stop_check(finished=...): the root's forward ended or raised.
        """
        self._before_forward = before_forward
        self._hook_readers = hook_readers
        self._start_check = start_check
        self._stop_check = stop_check

    def remove_handles(self):
        """Removes every hook on the model (engine.remove_hooks())."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------- the tracer
    def end_trace_step(self):
        """The step's trace is complete (the optimizer step calls this)."""
        self.tracer.end_step()
        self._dtr.rebalance()
        if self.cuda_room:
            _C.chunks.roll_cuda_request_window()

    # ----------------------------------------------------------------- hooks
    # Each hook is one call into hooks/module_hooks.h (Note [One call per
    # hook]); Python adds the DTR context and the error messages.
    def _new_hooks(self):
        hooks = _C.chunks.ModuleHooks(self._store.chunks, self.tracer)
        for r in self._params.record_list:
            hooks.add_param(r.param, r.id, r.shape)
        for m in self._params.module_list:
            hooks.add_module(self._params.indexes(self._params.module_records[m]))
        hooks.set_make_room(self._dtr.enabled_by_config)
        if self.cuda_room:
            # Note [Room on a cache miss] (hooks/cuda_room.h): torch's cache
            # misses make room under the engine's budget, torch's cap.
            dev = self._store.torch_device
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            hooks.set_cuda_room(index, self._store.device_budget)
        hooks.set_track_first_use(True)
        hooks.set_accumulating(self._config.gradient_accumulation_steps > 1)
        hooks.set_fold_images(self._config.fold_images)  # Note [The weights' image instead of the restore]
        return hooks

    def count(self, on: bool):
        """Starts (`on`) or stops the meter's counting and limits while
        forward and backward run."""
        # Simulated device: torch's CPU allocations during forward and
        # backward are the non-chunk "device" memory (Note [The memory
        # tracer]), limited to what the budget leaves beside the chunks while
        # they are counted (Note [The simulated device's budget is a hard
        # limit]; the limit and the room maker are this engine's for that
        # window only, so another engine never meets them).
        if self.cuda:
            # The same room maker, answering torch's cache misses while
            # forward and backward run (Note [Room on a cache miss]).
            if self.cuda_room and self._config.room_on_miss:
                self.hooks.set_device_room_maker(on)
            return
        if on:
            _COUNT_OWNER[0] = self.count_token
            _C.chunks.set_host_allocation_counting(True)
            if self.enforce_budget:
                self.tracer.set_enforce(True)
                if self._config.room_on_miss:
                    self.hooks.set_device_room_maker(True)
        else:
            if self.enforce_budget:
                self.tracer.set_enforce(False)
                self.hooks.set_device_room_maker(False)
            _C.chunks.set_host_allocation_counting(False)

    def _hold_count(self):
        """Between a forward and its backward the simulated device's count goes
        on (the backward frees what the forward saved) but nothing is limited:
        code there is the script's own, and a forward whose backward never
        comes (evaluation with grad on) must leave nothing that plain PyTorch
        code can meet. engine.backward() limits again."""
        if self.cuda or not self.enforce_budget:
            return
        self.tracer.set_enforce(False)
        self.hooks.set_device_room_maker(False)

    def root_pre(self, module, args):
        _refuse_function_transforms()  # (first: nothing started yet)
        if torch._C._current_graph_task_id() == -1:  # (not a recompute inside backward)
            self._before_forward()  # (a raw backward, a state dict's copies, outside writes)
        self._hook_readers()
        if torch._C._current_graph_task_id() == -1:
            self._dtr.begin()  # Note [DTR belongs to the engine's cycle]
        self.count(True)
        if self._saved_hooks is None:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(*self.saved_tensor_pair)
            self._saved_hooks.__enter__()
        self._start_check()
        self.forward_classes.enter()  # (last: a pre-hook that raised swapped nothing)

    def root_post(self, module, args, output):
        self.forward_classes.leave()  # (first: also when the forward raised)
        self._stop_check(finished=True)
        if not torch.is_grad_enabled():
            self.count(False)
            if torch._C._current_graph_task_id() == -1:
                self._dtr.end()  # no backward follows a no_grad forward
        elif torch._C._current_graph_task_id() == -1:
            self._hold_count()
        self.leave_saved_tensor_hooks()

    def leave_saved_tensor_hooks(self):
        """Ends the forward's saved_tensors_hooks context, if one is open (the
        root's post-hook, or a forward that raised)."""
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def is_attached(self, record) -> bool:
        """Whether `record`'s parameter is a view of its slot (COMPUTE)."""
        return self.hooks.attached(self._params.index(record))

    def uses(self, record) -> int:
        """Forward uses of `record`'s parameter in flight (nested or shared modules)."""
        return self.hooks.uses(self._params.index(record))

    def attach(self, records, module, replay=False, for_backward=False):
        """Attaches `records` (those not attached) outside the hooks' own path:
        a saved tensor unpacked in backward, a DTR recompute's read."""
        if not records:
            return
        ids = self._params.indexes(records)
        try:
            with _dtr.outside():
                self.hooks.attach(ids, for_backward=for_backward, replay=replay)
        except OutOfMemoryError as e:
            self.attach_failed(e, module, records, lambda: self.hooks.attach(
                ids, for_backward=for_backward, replay=replay))
        self._dtr.rebalance()

    def _unpack_attach(self, i):
        """A saved parameter alias is unpacked in backward while its
        parameter (record index `i`) is not attached."""
        self.attach([self._params.record_list[i]], None, for_backward=True)

    def attach_failed(self, e, module, records, retry):
        """An attach of `records` (for `module`, or None) raised `e`: retried
        once where torch's cache may hold the memory, else `e` with the
        device's side of the story."""
        # Without the provider, torch's cached free memory is out of the
        # chunks' reach until torch gives it back. With it, torch's own
        # OOM path already freed its cache and retried inside the chunk
        # block's allocation, and the scheduler trimmed and evicted: a
        # retry would fail the same way.
        provider = self._store.device.memory_provider()
        if not isinstance(provider, _C.TorchMemoryProvider):
            provider = None
        if self.cuda and provider is None:
            torch.cuda.empty_cache()
            try:
                with _dtr.outside():
                    retry()
                return
            except OutOfMemoryError as e2:
                e = e2
        where = f"module '{self._params.names.get(module, '?')}'" if module is not None else \
            f"parameter '{records[0].name}'"
        live = self.tracer.live()
        torch_side = ""
        if self.cuda:
            dev = self._store.torch_device
            torch_side = (f"; torch has {torch.cuda.memory_allocated(dev)} bytes "
                          f"allocated and {torch.cuda.memory_reserved(dev)} reserved")
            if provider is not None:
                torch_side += (f", of which {provider.held_bytes()} are chunk "
                               f"blocks ({provider.name})")
        pool = ""
        if self._budget().spilled_floor > 0:
            # Host and device as one pool: what the host cannot hold stays on
            # the device, and with activations beside it nothing can swap.
            host = self._store.capacity_bytes()[0]
            pool = (f". The model's states fill the host's share ({host} bytes: "
                    f"tidal.host_memory_budget {self._store.host_budget} less "
                    f"{self._store.host_reserve} kept for swaps), so {self._budget().spilled_floor} bytes of "
                    f"them stay on the device: with the activations beside them the device has "
                    f"no room left for the chunks in use. Raise tidal.host_memory_budget or "
                    f"tidal.device_memory_budget, or use a smaller batch or model")
        raise OutOfMemoryError(
            f"tidal could not bring the parameters of {where} onto the device: {e}. "
            f"Non-chunk device memory (activations and other torch tensors) is "
            f"{live} bytes now, of the device budget of {self._store.device_budget} bytes "
            f"(margin {self._store.margin}){torch_side}; chunks get what is "
            f"left{pool}") from None

    def param_record_of(self, t):
        """The record of the attached parameter whose slot `t` views, or None
        (the saved-tensor pack hook and DTR's parameter provider ask this)."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        i = self.hooks.attached_at(t)
        return None if i < 0 else self._params.record_list[i]

    # ------------------------------------ DTR's replays (engine/dtr_link.py)
    # What the engine offers tidal.dtr's replays, as three calls (and
    # param_record_of above), so the link touches none of the engine's internals.
    def replay_record(self, i: int):
        """The record of parameter index `i` (ModuleHooks' numbering)."""
        return self._params.record_list[i]

    def replay_view(self, record, size, stride, offset):
        """(`record`'s weight as this view, whether this call attached it).
        After its gradient hook its 16-bit slot holds the gradient: the view
        is then of a temporary weight made from the fp32 master (Note [Weights
        while gradients wait]); else the parameter is attached for the replay
        (its chunk comes to the device through the scheduler)."""
        if self.hooks.landed(self._params.index(record)):
            return self._weight_from_master(record).as_strided(size, stride, offset), False
        attached = not self.is_attached(record)
        if attached:
            self.attach([record], None, replay=True)
        return record.param.data.as_strided(size, stride, offset), attached

    def _weight_from_master(self, record) -> torch.Tensor:
        """A temporary device tensor holding `record`'s 16-bit weight, made from
        its fp32 master (while its 16-bit slot holds a gradient)."""
        with torch.no_grad(), _dtr.outside(), self._store.slots(record, (PARAM32,), HOST) as (src,):
            return src.to(self._store.torch_device, self._dtype, copy=True)

    def release_replayed(self, records):
        """Detaches what replay_view() attached once no forward uses it."""
        done = [r for r in records if self.is_attached(r) and self.uses(r) == 0]
        self._detach(done, _C.chunks.TensorState.HOLD)

    def _detach(self, records, state):
        if not records:
            return
        with _dtr.outside():
            self.hooks.detach(self._params.indexes(records), state)
        self._dtr.rebalance()

    def pre_forward(self, module, args):
        i = self._params.module_index[module]
        try:
            with _dtr.outside():
                self.hooks.forward_pre(i)
        except OutOfMemoryError as e:
            self.forward_pre_failed(i, e)
        self._dtr.rebalance()

    def forward_pre_failed(self, i, e):
        """Module `i`'s forward pre-hook raised `e` (out of memory). A retry
        (after torch.cuda.empty_cache) only attaches: the trace point was taken."""
        module = self._params.module_list[i]
        self.attach_failed(e, module, self._params.module_records[module],
                           lambda: self.hooks.forward_pre(i, trace_point=False))

    def post_forward(self, module, args, output):
        grad = torch.is_grad_enabled()
        with _dtr.outside():
            self.hooks.forward_post(self._params.module_index[module], grad)
        self._dtr.rebalance()
        if grad:
            return _hooks.wrap_outputs(self, module, output)
        return output

    def wrap_outputs(self, module, output):
        return _hooks.wrap_outputs(self, module, output)

    def pre_backward_hook(self, module):
        """The tensor hook hooks.wrap_outputs puts on `module`'s outputs (made
        once per module; it holds this wiring weakly, as the gradient hooks)."""
        hook = self._pre_backward_hooks.get(module)
        if hook is None:
            ref = weakref.ref(self)

            def hook(grad, module=module):
                wiring = ref()
                if wiring is not None:
                    wiring.pre_backward(module)
            self._pre_backward_hooks[module] = hook
        return hook

    def pre_backward(self, module):
        i = self._params.module_index[module]
        try:
            with _dtr.outside():
                self.hooks.backward_pre(i)
        except OutOfMemoryError as e:
            self.backward_pre_failed(i, e)
        self._dtr.rebalance()

    def backward_pre_failed(self, i, e):
        """Module `i`'s backward pre-hook raised `e` (out of memory)."""
        module = self._params.module_list[i]
        ids = self._params.indexes(self._params.module_records[module])
        self.attach_failed(e, module, self._params.module_records[module],
                           lambda: self.hooks.attach(ids, for_backward=True))

    def overlap_grad_ready(self, param):
        """After the landing (hooks run in order): a chunk whose gradients are
        all in starts its CPU Adam (Note [CPU Adam during backward])."""
        self._overlap.landed(self._store.by_param[id(param)])

    def grad_ready(self, param):
        """The gradient hook's path under a Python dispatch mode (and for a
        gradient that is not dense): the same landing as the C++ GradHook
        (Note [Hooks torch calls into C++], "One gradient hook"), with what
        only this path needs: the error for a non-strided gradient, and under
        tidal.dtr's TorchDispatchMode an alias run inside the mode first."""
        r = self._store.by_param[id(param)]
        g = param.grad
        if g is None:
            return
        if g.layout != torch.strided:
            raise UnsupportedModelError(
                f"parameter '{r.name}' got a gradient of layout {g.layout}; tidal's chunks hold "
                f"dense gradients in the parameters' 16-bit slots (an embedding read with "
                f"sparse=True?)")
        i = self._params.index(r)
        if _dtr.is_enabled():
            # Under DTR an op in DTR's mode brings an evicted gradient back; no
            # op runs between it and the landing, so it stays resident.
            torch.ops.aten.alias.default(g)
            with _dtr.outside():
                self.hooks.land_gradient(i, g)
        else:
            self.hooks.land_gradient(i, g)
        # (DTR's threshold: the landing set it, ModuleHooks' DeviceRoom::chunks_moved.)
        param.grad = None


# torch.func's transforms that differentiate (grad, vjp, jacrev, jacfwd,
# hessian, jvp), by their interpreters' keys; vmap and functionalize are not
# among them (a vmap over the model runs its forwards as any other).
_DIFFERENTIATING = {"Grad", "Jvp"}


try:  # (resolved once: the check runs at every root forward)
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters as _interpreters
except ImportError:  # (a torch without it: torch's own error follows)
    _interpreters = None


def _refuse_function_transforms() -> None:
    """A forward under torch.func.grad (vjp, jacrev, hessian, jvp, jacfwd) is a
    tidal UsageError before anything starts: the engine's forward keeps its
    saved tensors through saved-tensor hooks (the saved-tensor pair), which
    torch's function transforms refuse, and the chunks' gradients land in
    their slots, where a transform would not see them."""
    if _interpreters is None:
        return
    found = [i.key().name for i in _interpreters() if i.key().name in _DIFFERENTIATING]
    if not found:
        return
    raise UsageError(
        f"a forward of a model tidal trains under torch.func's {found[0].lower()} transform "
        f"(torch.func.grad, vjp, jacrev, jacfwd, hessian or jvp): tidal keeps the forward's saved "
        f"tensors through saved-tensor hooks, which those transforms do not support, and its "
        f"gradients land in its chunks. What works: torch.func.functional_call(model, params, "
        f"args) with the loss's own backward (loss.backward() or torch.autograd.grad with respect "
        f"to the tensors passed in), or engine.backward(loss) to train")
