"""The module hooks, the memory tracer and the parameter hooks: where the
engine meets torch's forward and backward (one C++ call per hook, Note
[One call per hook] in hooks/module_hooks.h).

A mixin of Engine (engine.py), split from it along its sections; it uses
the engine's attributes set in Engine.__init__.

The engine's meters (Note [The memory tracer] in runtime/tracer/memory_tracer.h)
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every hook is a trace point: one call into the C++ memory tracer measures
non-chunk device memory (N), records the interval's peak and sets the chunk
budget (the warm-up cap, then the recorded trace: Note [The warm-up budget]
there). What N is depends on the device (_new_tracer below):
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

import weakref

import torch

from .. import _C
from .. import dtr as _dtr
from . import external as _external
from . import user_param as _user_param
from . import guards as _guards
from . import hooks as _hooks
from .errors import UnsupportedModelError

from .common import OutOfMemoryError
from .store import HOST, PARAM32


class HookWiringMixin:
    def remove_hooks(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        _external.uninstall(self.module)
        _user_param.uninstall(self)
        _guards.unguard_conversions(self.module)
        self._count(False)  # (nothing of the engine's stays running for plain PyTorch code)
        if self.recompute_plan is not None:
            self.recompute_plan.remove()
            self.recompute_plan = None

    # ------------------------------------------------------------- the tracer
    def _new_tracer(self):
        """The tracer with the meter of Note [The memory tracer] for this device."""
        store = self.store
        provider = store.device.memory_provider()
        kwargs = {}
        if isinstance(provider, _C.TorchMemoryProvider):
            # Chunk blocks from torch's allocator: torch's allocated bytes less
            # the blocks the provider holds (on the simulated device's CPU
            # stand-in, less what was there before this engine).
            kwargs = {"provider": provider, "provider_baseline": not self._cuda}
        elif self._cuda:
            # Chunk blocks from cudaMalloc never use torch's cache: torch's
            # reserved bytes are the non-chunk memory.
            dev = store.torch_device
            kwargs = {"read": lambda: (torch.cuda.memory_reserved(dev), torch.cuda.max_memory_reserved(dev)),
                      "restart": lambda: torch.cuda.reset_peak_memory_stats(dev)}
        # Else the simulated device: torch's CPU allocations while forward and
        # backward run, less what was live when the engine was made; placed by
        # torch's caching allocator's rules where tidal.simulated_allocator says
        # (Note [Who owns a device byte] in runtime/memory/caching_allocator_model.h).
        elif self._sim_caching:
            kwargs = {"torch_caching": True}
        return _C.chunks.MemoryTracer(self.chunks, device_budget=store.device_budget,
                                      margin=store.margin, warmup_room=self._budget.warmup_chunk_room,
                                      **kwargs)

    def _end_trace_step(self):
        self._tracer.end_step()
        self.dtr.rebalance()
        if self._cuda_room:
            _C.chunks.roll_cuda_request_window()

    # ----------------------------------------------------------------- hooks
    # Each hook is one call into hooks/module_hooks.h (Note [One call per
    # hook]); Python adds the DTR context and the error messages.
    def _new_hooks(self):
        hooks = _C.chunks.ModuleHooks(self.chunks, self._tracer)
        for r in self._params.record_list:
            hooks.add_param(r.param, r.id, r.shape)
        index = self._params.record_index
        for m in self._params.module_list:
            hooks.add_module([index[id(r)] for r in self._params.module_records[m]])
        hooks.set_make_room(self.dtr.enabled_by_config)
        if self._cuda_room:
            # Note [Room on a cache miss] (hooks/cuda_room.h): torch's cache
            # misses make room under the engine's budget, torch's cap.
            dev = self.store.torch_device
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            hooks.set_cuda_room(index, self.store.device_budget)
        hooks.set_track_first_use(True)
        hooks.set_accumulating(self.config.gradient_accumulation_steps > 1)
        return hooks

    def _count(self, on: bool):
        # Simulated device: torch's CPU allocations during forward and
        # backward are the non-chunk "device" memory (Note [The memory
        # tracer]), limited to what the budget leaves beside the chunks while
        # they are counted (Note [The simulated device's budget is a hard
        # limit]; the limit and the room maker are this engine's for that
        # window only, so another engine never meets them).
        if self._cuda:
            # The same room maker, answering torch's cache misses while
            # forward and backward run (Note [Room on a cache miss]).
            if self._cuda_room and self.config.room_on_miss:
                self._hooks.set_device_room_maker(on)
            return
        if on:
            _C.chunks.set_host_allocation_counting(True)
            if self._enforce_budget:
                self._tracer.set_enforce(True)
                if self.config.room_on_miss:
                    self._hooks.set_device_room_maker(True)
        else:
            if self._enforce_budget:
                self._tracer.set_enforce(False)
                self._hooks.set_device_room_maker(False)
            _C.chunks.set_host_allocation_counting(False)

    def _hold_count(self):
        """Between a forward and its backward the simulated device's count goes
        on (the backward frees what the forward saved) but nothing is limited:
        code there is the script's own, and a forward whose backward never
        comes (evaluation with grad on) must leave nothing that plain PyTorch
        code can meet. engine.backward() limits again."""
        if self._cuda or not self._enforce_budget:
            return
        self._tracer.set_enforce(False)
        self._hooks.set_device_room_maker(False)

    def _root_pre(self, module, args):
        if torch._C._current_graph_task_id() == -1:  # (not a recompute inside backward)
            self._outside.settle_raw_backward()
            # (a load_state_dict or state_dict that raised midway)
            self._state_dict_bridge.forward_started()
            # Parameters read outside any forward since the last (Note
            # [External parameters]) go back to their chunks, with what user
            # code wrote to them (Note [Writes to a parameter]).
            self._outside.settle()
        self._outside.hook_readers()
        if torch._C._current_graph_task_id() == -1:
            self.dtr.begin()  # Note [DTR belongs to the engine's cycle]
        self._count(True)
        if self._saved_hooks is None:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(*self._saved_tensor_pair)
            self._saved_hooks.__enter__()
        self._outside.start_check()

    def _root_post(self, module, args, output):
        self._outside.stop_check(finished=True)
        if not torch.is_grad_enabled():
            self._count(False)
            if torch._C._current_graph_task_id() == -1:
                self.dtr.end()  # no backward follows a no_grad forward
        elif torch._C._current_graph_task_id() == -1:
            self._hold_count()
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _is_attached(self, record) -> bool:
        """Whether `record`'s parameter is a view of its slot (COMPUTE)."""
        return self._hooks.attached(self._params.record_index[id(record)])

    def _uses(self, record) -> int:
        """Forward uses of `record`'s parameter in flight (nested or shared modules)."""
        return self._hooks.uses(self._params.record_index[id(record)])

    def _attach(self, records, module, replay=False, for_backward=False):
        """Attaches `records` (those not attached) outside the hooks' own path:
        a saved tensor unpacked in backward, a DTR recompute's read."""
        if not records:
            return
        index = self._params.record_index
        ids = [index[id(r)] for r in records]
        try:
            with _dtr.outside():
                self._hooks.attach(ids, for_backward=for_backward, replay=replay)
        except OutOfMemoryError as e:
            self._attach_failed(e, module, records, lambda: self._hooks.attach(
                ids, for_backward=for_backward, replay=replay))
        self.dtr.rebalance()

    def _unpack_attach(self, i):
        """A saved parameter alias is unpacked in backward while its
        parameter (record index `i`) is not attached."""
        self._attach([self._params.record_list[i]], None, for_backward=True)

    def _attach_failed(self, e, module, records, retry):
        """An attach of `records` (for `module`, or None) raised `e`: retried
        once where torch's cache may hold the memory, else `e` with the
        device's side of the story."""
        # Without the provider, torch's cached free memory is out of the
        # chunks' reach until torch gives it back. With it, torch's own
        # OOM path already freed its cache and retried inside the chunk
        # block's allocation, and the scheduler trimmed and evicted: a
        # retry would fail the same way.
        provider = self.store.device.memory_provider()
        if not isinstance(provider, _C.TorchMemoryProvider):
            provider = None
        if self._cuda and provider is None:
            torch.cuda.empty_cache()
            try:
                with _dtr.outside():
                    retry()
                return
            except OutOfMemoryError as e2:
                e = e2
        where = f"module '{self._params.names.get(module, '?')}'" if module is not None else \
            f"parameter '{records[0].name}'"
        live = self._tracer.live()
        torch_side = ""
        if self._cuda:
            dev = self.store.torch_device
            torch_side = (f"; torch has {torch.cuda.memory_allocated(dev)} bytes "
                          f"allocated and {torch.cuda.memory_reserved(dev)} reserved")
            if provider is not None:
                torch_side += (f", of which {provider.held_bytes()} are chunk "
                               f"blocks ({provider.name})")
        pool = ""
        if self._budget.spilled_floor > 0:
            # Host and device as one pool: what the host cannot hold stays on
            # the device, and with activations beside it nothing can swap.
            host = self.store.capacity_bytes()[0]
            pool = (f". The model's states fill the host's share ({host} bytes: "
                    f"tidal.host_memory_budget {self.store.host_budget} less "
                    f"{self.store.host_reserve} kept for swaps), so {self._budget.spilled_floor} bytes of "
                    f"them stay on the device: with the activations beside them the device has "
                    f"no room left for the chunks in use. Raise tidal.host_memory_budget or "
                    f"tidal.device_memory_budget, or use a smaller batch or model")
        raise OutOfMemoryError(
            f"tidal could not bring the parameters of {where} onto the device: {e}. "
            f"Non-chunk device memory (activations and other torch tensors) is "
            f"{live} bytes now, of the device budget of {self.store.device_budget} bytes "
            f"(margin {self.store.margin}){torch_side}; chunks get what is "
            f"left{pool}") from None

    def param_record_of(self, t):
        """The record of the attached parameter whose slot `t` views, or None
        (the saved-tensor pack hook and DTR's parameter provider ask this)."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        i = self._hooks.attached_at(t)
        return None if i < 0 else self._params.record_list[i]

    # ------------------------------------ DTR's replays (engine/dtr_link.py)
    # What the engine offers tidal.dtr's replays, as three calls, so the link
    # touches none of the engine's internals.
    def replay_record(self, i: int):
        """The record of parameter index `i` (ModuleHooks' numbering)."""
        return self._params.record_list[i]

    def replay_view(self, record, size, stride, offset):
        """(`record`'s weight as this view, whether this call attached it).
        After its gradient hook its 16-bit slot holds the gradient: the view
        is then of a temporary weight made from the fp32 master (Note [Weights
        while gradients wait]); else the parameter is attached for the replay
        (its chunk comes to the device through the scheduler)."""
        if self._hooks.landed(self._params.record_index[id(record)]):
            return self._weight_from_master(record).as_strided(size, stride, offset), False
        attached = not self._is_attached(record)
        if attached:
            self._attach([record], None, replay=True)
        return record.param.data.as_strided(size, stride, offset), attached

    def _weight_from_master(self, record) -> torch.Tensor:
        """A temporary device tensor holding `record`'s 16-bit weight, made from
        its fp32 master (while its 16-bit slot holds a gradient)."""
        with torch.no_grad(), _dtr.outside(), self.store.slots(record, (PARAM32,), HOST) as (src,):
            return src.to(self.store.torch_device, self.dtype, copy=True)

    def release_replayed(self, records):
        """Detaches what replay_view() attached once no forward uses it."""
        done = [r for r in records if self._is_attached(r) and self._uses(r) == 0]
        self._detach(done, _C.chunks.TensorState.HOLD)

    def _detach(self, records, state):
        if not records:
            return
        index = self._params.record_index
        with _dtr.outside():
            self._hooks.detach([index[id(r)] for r in records], state)
        self.dtr.rebalance()

    def _pre_forward(self, module, args):
        i = self._params.module_index[module]
        try:
            with _dtr.outside():
                self._hooks.forward_pre(i)
        except OutOfMemoryError as e:
            self._forward_pre_failed(i, e)
        self.dtr.rebalance()

    def _forward_pre_failed(self, i, e):
        """Module `i`'s forward pre-hook raised `e` (out of memory). A retry
        (after torch.cuda.empty_cache) only attaches: the trace point was taken."""
        module = self._params.module_list[i]
        self._attach_failed(e, module, self._params.module_records[module],
                            lambda: self._hooks.forward_pre(i, trace_point=False))

    def _post_forward(self, module, args, output):
        grad = torch.is_grad_enabled()
        with _dtr.outside():
            self._hooks.forward_post(self._params.module_index[module], grad)
        self.dtr.rebalance()
        if grad:
            return _hooks.wrap_outputs(self, module, output)
        return output

    def _wrap_outputs(self, module, output):
        return _hooks.wrap_outputs(self, module, output)

    def _pre_backward_hook(self, module):
        """The tensor hook hooks.wrap_outputs puts on `module`'s outputs (made
        once per module; it holds the engine weakly, as the gradient hooks)."""
        hook = self._pre_backward_hooks.get(module)
        if hook is None:
            ref = weakref.ref(self)

            def hook(grad, module=module):
                engine = ref()
                if engine is not None:
                    engine._pre_backward(module)
            self._pre_backward_hooks[module] = hook
        return hook

    def _pre_backward(self, module):
        i = self._params.module_index[module]
        try:
            with _dtr.outside():
                self._hooks.backward_pre(i)
        except OutOfMemoryError as e:
            self._backward_pre_failed(i, e)
        self.dtr.rebalance()

    def _backward_pre_failed(self, i, e):
        """Module `i`'s backward pre-hook raised `e` (out of memory)."""
        module = self._params.module_list[i]
        index = self._params.record_index
        ids = [index[id(r)] for r in self._params.module_records[module]]
        self._attach_failed(e, module, self._params.module_records[module],
                            lambda: self._hooks.attach(ids, for_backward=True))

    def _overlap_grad_ready(self, param):
        """After the landing (hooks run in order): a chunk whose gradients are
        all in starts its CPU Adam (Note [CPU Adam during backward])."""
        self._overlap.landed(self.store.by_param[id(param)])

    def _grad_ready(self, param):
        r = self.store.by_param[id(param)]
        g = param.grad
        if g is None:
            return
        if g.layout != torch.strided:
            raise UnsupportedModelError(
                f"parameter '{r.name}' got a gradient of layout {g.layout}; tidal's chunks hold "
                f"dense gradients in the parameters' 16-bit slots (an embedding read with "
                f"sparse=True?)")
        i = self._params.record_index[id(r)]
        if _dtr.is_enabled():
            # Under DTR an op in DTR's mode brings an evicted gradient back; no
            # op runs between it and the landing, so it stays resident.
            torch.ops.aten.alias.default(g)
            with _dtr.outside():
                self._hooks.land_gradient(i, g)
        else:
            self._hooks.land_gradient(i, g)
        self.dtr.rebalance()
        param.grad = None
