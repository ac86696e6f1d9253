"""The training engine: tidal.initialize(model, config) -> Engine.

See docs/architecture.md ("One training step") and
python/tidal/engine/hooks.py for the hook protocol. One step:

    loss = engine(batch)        # forward: chunks come to the device per module
    engine.backward(loss)       # gradients land in the 16-bit slots
    engine.step()               # Adam per chunk: on the device (hybrid) or CPU

Engine is this file (set-up, forward, zero_grad, checkpoint entry points),
engine_backward.py (backward and the release after a failed forward or
backward) and engine_api.py (DeepSpeed's engine queries and nn.Module's
methods); both are base classes without state of their own. Every other concern is an
object of its own, owning its state and given what it reads at construction
(Note [The engine's objects, in the order they are built], below):
  HookWiring (hook_wiring.py, self._wiring): the module and parameter hooks,
    the ModuleHooks, the memory tracer, the saved-tensor pair, attaches and
    detaches outside the hooks' path (DTR's replays among them) and the
    simulated device's allocation counting;
  ParamTable (params.py, self._params): the modules, records and their indexes;
  budget.check (budget.py, self._budget): the device room the model needs;
  GradientAccumulation (accumulation.py, self._accumulation): the window, the
    landed gradients and their folds into sums;
  OptimizerStep (optimizer_step.py, self._step): the step, its counters, loss
    scaler, LR schedules and the relayout;
  StepMeters (meters.py, self._meters): what the steps measure;
  ChunkDataParallel (chunk_data_parallel.py, self._dp_step): data parallel;
  StateDictBridge (state_dict_bridge.py, self._state_dict_bridge):
    model.state_dict() and load_state_dict() through the chunks;
  Checkpoints (checkpoint.py, self._checkpoints): save_checkpoint and
    load_checkpoint, state_dict, load_pretrained and save_pretrained;
  EngineReports (reports.py, self._reports): memory_report(), the timeline
    and profile;
  OutsideAccess (outside_access.py, self._outside): parameters read outside
    their module, writes to parameters between steps, a raw loss.backward(),
    and (UserGradients, user_grads.py, self._outside.grads) gradients read
    and written by user code between backward and step;
  WeightEma (ema.py, self._ema): engine.ema()'s EMA of the weights, or None;
  StepOverlap (overlap.py), DtrLink (dtr_link.py) and the ParamStore
    (store.py), which lays the parameters out in chunks.
"""
from __future__ import annotations

import functools
import weakref

import torch

from .. import _C
from .. import dtr as _dtr
from .. import recompute as _recompute
from ..config import Config
from ..lr_schedules import build_scheduler
from . import budget as _budget
from . import checkpoint as _checkpoint
from . import device_cap as _device_cap
from . import ema as _ema
from . import external as _external
from . import user_param as _user_param
from . import guards as _guards
from . import param_groups as _param_groups
from .dtr_link import DtrLink
from .errors import UsageError
from .accumulation import GradientAccumulation
from .overlap import StepOverlap
from .meters import StepMeters
from .optimizer_step import OptimizerStep
from .params import ParamTable
from .outside_access import OutsideAccess, raw_backward_refusal
from .reports import EngineReports
from .state_dict_bridge import StateDictBridge
from .store import ParamStore
from .common import _PLACEHOLDER_HINT, _weak_method
from .chunk_data_parallel import ChunkDataParallel, check_ranks_agree
from .hook_wiring import HookWiring, new_tracer, stop_count_of
from .engine_api import DeepSpeedEngineAPI
from .engine_backward import EngineBackward

# tidal.simulated_allocator "auto": torch's caching rules from this device
# budget on (its 2 and 20 MiB segments are too coarse below).
SIM_CACHING_MIN_BUDGET = 1 << 30


class Engine(EngineBackward, DeepSpeedEngineAPI):
    """Trains `module` with its model states in chunks. Build with tidal.initialize()."""

    def __init__(self, model: torch.nn.Module, config=None, model_parameters=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"tidal.initialize expects a torch.nn.Module, got {type(model).__name__}")
        params = list(model.parameters())
        for p in params:
            first = _guards.engine_of(p)
            if first is not None:
                raise UsageError(
                    f"tidal.initialize: this {type(model).__name__} (or a module of it) is already "
                    f"trained by a tidal engine ({first!r}, which owns its parameter "
                    f"'{first._record_of_param(p).name}'): a second engine over the same "
                    f"parameters would move the same chunks under both. Use the engine the first "
                    f"tidal.initialize returned; to start over, build a new model")
        cfg = Config.load(config)
        self.config = cfg
        self.module = model
        store = ParamStore.owning(params)
        if store is None:
            store = ParamStore(cfg)
        elif config is not None and cfg.raw != store.config.raw:
            raise ValueError("the model was built in tidal.init_context with another config; "
                             "pass the same config to tidal.initialize, or none")
        else:
            cfg = self.config = store.config
        # Note [Parameter groups]: before registration, which freezes the
        # parameters in no group.
        groups, group_of = _param_groups.build_groups(
            model, model_parameters, cfg, lambda p: id(p) in store.by_param)
        self.optimizer = _param_groups.EngineOptimizer(self, groups)
        self._group_of = group_of
        # The config's activation_checkpointing / tidal.recompute block: the
        # plan is made first, so a bad checkpoint name fails before anything
        # moves into chunks (Note [Recompute under the training engine]).
        # Note [CPU Adam during backward]: what it does not cover. Refused
        # before anything moves into chunks where the config asks for it;
        # with the default, the step is not overlapped and the report says why.
        self.overlap_step_off = cfg.overlap_step_off
        self.recompute_plan = None
        if cfg.activation_checkpointing_given:
            self.recompute_plan = _recompute.from_config(model, cfg.activation_checkpointing,
                                                         cfg.recompute)
        try:
            self._setup(model, cfg, store)
        except BaseException:
            if self.recompute_plan is not None:
                self.recompute_plan.remove()
            store.release_if_empty()  # an NVMe tier's file goes now, not with the traceback
            raise
        if self.recompute_plan is not None:
            self.recompute_plan.parameter_aliases = self._wiring.saved_tensor_pair

    # Note [The engine's objects, in the order they are built]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # _setup builds the engine's objects one after another, each from what
    # exists when it is built, passed by keyword; none is handed a closure
    # over an attribute set later. Where two objects call each other, the one
    # built first takes the other in an explicit second step, connect():
    #   ParamTable, budget.check, the tracer, StepMeters, DtrLink, StepOverlap
    #   HookWiring          (its ModuleHooks are what the rest are given)
    #   GradientAccumulation
    #   StateDictBridge
    #   OutsideAccess       (given the bridge's busy() and settle_copies())
    #     -> StateDictBridge.connect(OutsideAccess.settle, write_value)
    #     -> HookWiring.connect(before_forward, the OutsideAccess's readers and check)
    #   ChunkDataParallel
    #   OptimizerStep
    #     -> GradientAccumulation.connect(give_weights_back: through the step)
    #   Checkpoints, EngineReports (given the step; they read it when asked)
    # Only then do the hooks go on the model (_install_hooks, the state-dict
    # and outside-read hooks), so no hook runs before every connect() is done.
    # The ParamStore holds no reference up to the engine: code beside the
    # engine that needs it (GatheredParameters) finds it by its parameters
    # (guards.engine_of).
    def _setup(self, model, cfg, store):
        store.adopted()
        self.store = store
        self.dtype = store.dtype
        self.precision = store.precision

        # Registration in module order (the first use order of most models).
        self._params = ParamTable.register(model, store)
        for r in self._params.records:
            r.group = self._group_of.get(id(r.param), 0)
        store.flush_warnings()
        # Buffers are ordinary tensors on the compute device (16-bit like the
        # params in mixed precision, as DeepSpeed's module.half()).
        with torch.no_grad():
            for m in model.modules():
                for bname, b in list(m._buffers.items()):
                    if b is None:
                        continue
                    if b.is_floating_point() and self.precision != "fp32":
                        b = b.to(self.dtype)
                    m._buffers[bname] = b.to(store.torch_device)
        self._check_budget()
        self.dp = store.dp  # the process group (tidal.data_parallel.DataParallel), or None
        # The reductions and broadcasts, made once the hooks exist (below).
        self._dp_step: ChunkDataParallel | None = None
        if self.dp is not None:
            check_ranks_agree(self.dp, cfg, store, self.records, self._group_state())

        # DeepSpeed's LR schedule from the config, built here so that a bad
        # one fails before anything is hooked; the step (self._step, below)
        # owns it.
        lr_scheduler = build_scheduler(cfg)
        self.training_dataloader = None  # tidal.deepspeed.initialize(training_data=...)

        # Memory tracer and budget arbiter (Note [The memory tracer] in
        # runtime/tracer/memory_tracer.h): one C++ call per trace point.
        # The hook wiring (self._wiring, below) owns the tracer and these
        # switches of the meter.
        cuda = store.torch_device.type == "cuda"
        # Note [Who owns a device byte]: the simulated device fails where a GPU
        # would, its non-chunk allocations placed by torch's caching rules.
        sim_caching = not cuda and not isinstance(
            store.device.memory_provider(), _C.TorchMemoryProvider) and (
            cfg.simulated_allocator == "torch_caching"
            or (cfg.simulated_allocator == "auto" and store.device_budget >= SIM_CACHING_MIN_BUDGET))
        tracer = new_tracer(store, cuda, sim_caching, self._budget.warmup_chunk_room)
        # Note [The simulated device's budget is a hard limit]: with torch's
        # CPU allocations as the meter (not the CPU stand-in of the provider,
        # whose chunk blocks torch counts too).
        enforce_budget = not cuda and not isinstance(
            store.device.memory_provider(), _C.TorchMemoryProvider)
        if cuda and isinstance(store.device.memory_provider(), _C.TorchMemoryProvider):
            # On a GPU whose chunk blocks come from torch's caching allocator,
            # torch's own per-process cap makes the budget the same promise:
            # an allocation past it fails in its op (DTR evicts and retries),
            # as past the card's memory. The cap is the whole budget: the
            # chunks plan within the budget less the margin, and the margin is
            # the allocator's room for what the trace does not see (block
            # rounding, fragmentation, library workspaces). On an H200 a cap
            # at the budget less the margin failed gpt-6.7b's forward and
            # gpt-1.3b's backward with 0.6-1.2 GiB reserved but unallocated
            # (benchmarks/results/engine*-nvidia-h200.json).
            # The cap lasts while this engine lives (Note [torch's cap belongs
            # to the live engines] in device_cap.py).
            dev = store.torch_device
            total = torch.cuda.get_device_properties(dev).total_memory
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            _device_cap.CAPS.claim(self, index, store.device_budget / total)
        # Note [Room on a cache miss] in hooks/cuda_room.h: with chunk blocks in
        # torch's cache, a miss past the cap first moves chunks off the device.
        cuda_room = cuda and isinstance(store.device.memory_provider(), _C.TorchMemoryProvider)
        if cuda_room:
            _C.chunks.reset_cuda_room_counts()

        # Note [The engine's objects, in the order they are built]: each is
        # given, with keywords, only objects that exist when it is built; what
        # it needs of an object built later comes in an explicit connect().
        # What the steps measure (memory_report()).
        self._meters = StepMeters()
        self._meters.start(self.chunks.stats())
        # DTR of activations (Note [DTR under the training engine]).
        self.dtr = DtrLink(cfg.dtr)
        # CPU Adam during backward (Note [CPU Adam during backward] in overlap.py).
        self._overlap = None
        if cfg.overlap_step and self.overlap_step_off is None:
            self._overlap = StepOverlap(store, self._params, cfg, self.optimizer, self.dp is not None)
            # The worker must never outlive the chunks it reads: a collected
            # engine first waits for it, before its chunks go.
            self._overlap.abandon_with(self)
        # The module and parameter hooks, the tracer and the saved-tensor pair
        # (the hooks go on the model below, once the objects they call exist
        # and are connected).
        wiring = self._wiring = HookWiring(
            store=store, params=self._params, config=cfg, tracer=tracer, dtr=self.dtr,
            overlap=self._overlap, dtype=self.dtype, cuda=cuda, cuda_room=cuda_room,
            sim_caching=sim_caching, enforce_budget=enforce_budget, budget=self._current_budget)
        hooks = wiring.hooks
        # The accumulation window and the gradients waiting for the step
        # (Note [Gradient sums in chunks] in cpu_adam/adam.h).
        self._accumulation = GradientAccumulation(
            steps=cfg.gradient_accumulation_steps, params=self._params, hooks=hooks, store=store,
            config=cfg, host_short=self._host_short)
        # model.state_dict() and load_state_dict() through the chunks (its
        # hooks go on the modules below, with the others).
        self._state_dict_bridge = StateDictBridge(
            module=model, store=store, params=self._params, hooks=hooks, dtype=self.dtype,
            write_param=functools.partial(_checkpoint.write_param, store))
        # Parameters read outside their module, writes to them between steps
        # and a raw loss.backward() (its reads go through the ParameterReads
        # installed below).
        self._outside = OutsideAccess(
            self._params, store, hooks, self.dtr, self._accumulation,
            record_of_param=self._record_of_param, settle_overlap=self.settle_overlap,
            attach=wiring.attach, attach_failed=wiring.attach_failed,
            hook_module=self._hook_module,
            state_dict_busy=self._state_dict_bridge.busy,
            settle_state_dict_copies=self._state_dict_bridge.settle_copies)
        self._state_dict_bridge.connect(settle_outside=self._outside.settle,
                                        write_value=self._outside.write_value)
        wiring.connect(before_forward=self._before_forward, hook_readers=self._outside.hook_readers,
                       start_check=self._outside.start_check, stop_check=self._outside.stop_check)
        if self.dp is not None:
            self._dp_step = ChunkDataParallel(
                group=self.dp, store=store, params=self._params, hooks=hooks, overlap=self._overlap,
                accumulating=self._accumulation.summing)
        # The optimizer step, its counters, loss scaler and LR schedule.
        self._step = OptimizerStep(
            config=cfg, store=store, params=self._params, optimizer=self.optimizer,
            lr_scheduler=lr_scheduler, accumulation=self._accumulation, hooks=hooks, tracer=tracer,
            meters=self._meters, dtr=self.dtr, overlap=self._overlap, dp_step=self._dp_step,
            settle_outside=self._outside.settle, stop_counting=functools.partial(wiring.count, False),
            end_trace_step=wiring.end_trace_step, check_budget=self._check_budget,
            host_short=self._host_short)
        # An EMA of the weights, once engine.ema() asks for one (Note [An EMA of the weights]).
        self._ema = None
        # Dropped gradients get their weights back through the step (and data parallel).
        self._accumulation.connect(give_weights_back=self._give_weights_back)
        # Checkpoints and state dicts (Note [Checkpoint format]).
        self._checkpoints = _checkpoint.Checkpoints(
            module=model, store=store, params=self._params, hooks=hooks, step=self._step,
            accumulation=self._accumulation, optimizer=self.optimizer, config=cfg)
        # What the engine reports (memory_report() and the others); the step's
        # counts are read when a report is made.
        self._reports = EngineReports(
            store=store, params=self._params, tracer=tracer, meters=self._meters, step=self._step,
            overlap=self._overlap, overlap_step_off=self.overlap_step_off, dp=self.dp,
            dp_step=self._dp_step, dtr=self.dtr, cuda=cuda, cuda_room=cuda_room,
            sim_caching=sim_caching, settle_overlap=self.settle_overlap)
        self._install_hooks()
        hooks.set_raw_backward(raw_backward_refusal(self.precision, self.scaler, self.dp))
        hooks.set_raw_backward_limits(enforce_budget, enforce_budget and self.config.room_on_miss)
        _external.install(model, self._outside, self._param_names_by_module())
        _user_param.install(self)  # Note [A parameter object stays the user's]
        _guards.guard_conversions(model, self)  # Note [Conversions of a trained model]
        self._state_dict_bridge.install(self._wiring.handles, self._param_names_by_module())
        _guards.register(self)
        if not cuda:
            # An engine collected mid-step (its forward or backward counting
            # the simulated device's allocations) leaves no count running.
            # (Only a count it started: Note [One engine's window is its own].)
            weakref.finalize(self, stop_count_of, self._wiring.count_token)
        self.dtr.start(hooks=hooks, wiring=self._wiring, store=store)
        self.dtr.abandon_with(self)
        self.dtr.rebalance()

    def remove_hooks(self):
        """Gives the model back to plain PyTorch: the engine's hooks, its
        parameter and conversion guards and the recompute plan go."""
        if self._overlap is not None:
            self._overlap.settle_deferred()  # (the step's updates left to a next forward)
        self._wiring.remove_handles()
        _external.uninstall(self.module)
        _user_param.uninstall(self)
        _guards.unguard_conversions(self.module)
        _guards.unregister(self)  # (torch's clip and optimizers are the user's again)
        self._wiring.count(False)  # (nothing of the engine's stays running for plain PyTorch code)
        if self.recompute_plan is not None:
            self.recompute_plan.remove()
            self.recompute_plan = None

    # ------------------------------------------------------------------ setup
    def _check_budget(self):
        """The device room the model needs against the budgets (Note [One
        place per chunk]); raises OutOfMemoryError naming what does not fit."""
        self._budget = _budget.check(self._params, self.store, self.config)
        wiring = getattr(self, "_wiring", None)
        if wiring is not None and not wiring.tracer.warmed_up:
            wiring.tracer.set_warmup_room(self._budget.warmup_chunk_room)

    def _current_budget(self) -> "_budget.DeviceRoom":
        """The last budget.check (_check_budget replaces it after a relayout)."""
        return self._budget

    def _host_short(self) -> bool:
        """The host budget is too small for the state (Note [One place per chunk])."""
        return self._budget.spilled_floor > 0 or self.chunks.stats()["spills"] > 0

    def _before_forward(self):
        """What a forward (not a recompute inside backward) settles first, at
        the root's forward pre-hook (HookWiring.root_pre)."""
        if self.store.offloaded is not None:
            raise UsageError("a forward while the engine's states are offloaded "
                             "(engine.offload_states()): call engine.reload_states() first")
        self._outside.settle_raw_backward()
        # (a load_state_dict or state_dict that raised midway)
        self._state_dict_bridge.forward_started()
        # Parameters read outside any forward since the last (Note
        # [External parameters]) go back to their chunks, with what user
        # code wrote to them (Note [Writes to a parameter]).
        self._outside.settle()

    def _install_hooks(self):
        """The module and gradient hooks: C++ callables (Note [Hooks torch
        calls into C++] in python/csrc/hook_callables.cpp) that fall back to
        the Python methods below under a Python dispatch mode. With DTR on,
        the callables keep the engine's own ops out of it (OutsideGuard) and
        ModuleHooks keeps DTR's threshold in step with the chunks
        (rebalance_dtr)."""
        root = self.module
        wiring = self._wiring
        handles = wiring.handles
        handles.append(root.register_forward_pre_hook(wiring.root_pre))
        handles.append(root.register_forward_hook(wiring.root_post, always_call=True))
        hooks = wiring.hooks
        for m in self._params.module_records:
            self._hook_module(m)
        seen = set()
        for r in self._params.records:
            if r.trainable and id(r.param) not in seen:
                seen.add(id(r.param))
                hook = hooks.grad_hook(self._params.index(r), _weak_method(wiring.grad_ready))
                handles.append(r.param.register_post_accumulate_grad_hook(hook))
                if self._dp_step is not None and self.dp.overlap:
                    # After the landing (hooks run in order): a chunk whose
                    # gradients are all in starts its reduction.
                    handles.append(r.param.register_post_accumulate_grad_hook(
                        _weak_method(self._dp_step.grad_ready)))
                if self._overlap is not None and self.dp is None:
                    # (Data parallel: a landing is not final; the owner
                    # launches a chunk when its reduction lands,
                    # ChunkDataParallel._finish.)
                    handles.append(r.param.register_post_accumulate_grad_hook(
                        _weak_method(wiring.overlap_grad_ready)))

    def _hook_module(self, m):
        """Module `m`'s forward pre and post hooks (C++ callables)."""
        i = self._params.module_index[m]
        wiring = self._wiring
        hooks = wiring.hooks
        pre = hooks.forward_pre_hook(i, wiring.pre_forward, wiring.forward_pre_failed)
        post = hooks.forward_post_hook(i, wiring.post_forward, wiring.wrap_outputs,
                                       _weak_method(wiring.backward_pre_failed))
        wiring.handles.append(m.register_forward_pre_hook(pre))
        wiring.handles.append(m.register_forward_hook(post))

    def _param_names_by_module(self) -> dict:
        """module -> {name in its _parameters: record index} for the parameters this engine keeps."""
        out = {}
        for m in self.module.modules():
            names = {}
            for pname, p in m.__dict__.get("_parameters", {}).items():
                r = self._record_of_param(p) if p is not None else None
                if r is not None:
                    names[pname] = self._params.index(r)
            if names:
                out[m] = names
        return out

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

    # ------------------------------------------------------------- user API
    def settle_overlap(self, keep_deferred: bool = False, chunks=None):
        """Waits for the CPU Adam updates running since backward and takes back
        every one no step has validated (Note [Speculative updates and their
        undo]): what reads the chunks before the step sees them as without
        overlap. The updates a step left to the next forward are waited for
        too (Note [CPU Adam under the next forward]), unless keep_deferred
        (the forward: each module waits for its own); `chunks`: only those
        chunks' updates left to the next forward are waited for (a parameter
        read inside a forward)."""
        if self._overlap is not None:
            if chunks is not None:
                self._overlap.settle_deferred(chunks)
            else:
                self._overlap.undo(keep_deferred=keep_deferred)

    # ---------------------------------------------------------------- reports
    def memory_report(self) -> dict:
        """What the device and host held at their peaks, the chunk traffic, the
        optimizer's time, the step counts, DTR, data parallel and the NVMe tier
        (EngineReports.memory_report in reports.py)."""
        return self._reports.memory_report()

    def memory_timeline(self) -> list[tuple]:
        """Device memory at every hook of the last completed step (EngineReports.memory_timeline)."""
        return self._reports.memory_timeline()

    def memory_profile(self) -> list[dict]:
        """memory_timeline() as dicts, with the chunk traffic of each interval
        (EngineReports.memory_profile)."""
        return self._reports.memory_profile()

    def export_memory_profile(self, directory, title=None) -> dict:
        """Writes the last step's memory profile (json and png) to `directory`
        (EngineReports.export_memory_profile)."""
        return self._reports.export_memory_profile(directory, title)

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Host copies of the fp32 master weights (16-bit values for frozen params), by name."""
        return self._reports.parameters_fp32()

    def _refuse_after_disk_failure(self):
        """RuntimeError with the NVMe tier's first failed read or write once one
        failed: the chunks on disk may have lost their data, so every later
        forward, backward and step is refused (Note [Chunks on NVMe: after a
        failure] in runtime/scheduler/disk_tier.h); no-op without a tier."""
        self.chunks.check_disk()

    def __call__(self, *args, **kwargs):
        self._refuse_after_disk_failure()
        self.settle_overlap(keep_deferred=True)
        if self.precision != "fp32":
            def cast(t):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    return t.to(self.dtype)
                return t
            args = torch.utils._pytree.tree_map(cast, args)
            kwargs = torch.utils._pytree.tree_map(cast, kwargs)
        try:
            return self.module(*args, **kwargs)
        except BaseException as e:
            # Whatever failed (an OutOfMemoryError, the model's own error), the
            # forward's hooks did not finish: give their slots back, so the
            # engine can go on with the next batch.
            oom = self._out_of_memory(e, "forward")
            self._wiring.leave_saved_tensor_hooks()
            self._outside.stop_check(finished=False)
            self._wiring.count(False)
            self._release_after_error()
            self.dtr.end(failed=True)
            # A shape error involving an empty tensor is what a parameter read
            # outside its module's forward gives; say so (the error stays).
            text = str(e)
            if oom is not None:
                raise oom from e
            if isinstance(e, RuntimeError) and _PLACEHOLDER_HINT not in text and any(
                    s in text for s in ("(0)", "[0]", "x0)", "0 elements", "size 0", "(0x", "[0,", ", 0]")):
                e.args = (text + _PLACEHOLDER_HINT,) + e.args[1:]
            raise

    forward = __call__

    def __getattr__(self, name):
        # As DeepSpeed's engine: what the engine does not define is the
        # model's (engine.generate(...), engine.gradient_checkpointing_enable(),
        # engine.config is still the engine's). Private names stay the
        # engine's own: copy, pickle and a half-built engine look them up.
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("_"):
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', "
                                     f"nor has its model (a {type(module).__name__})") from None
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def holding_gradients(self, records) -> list:
        """The names of `records` whose 16-bit slot holds a gradient now
        (between backward and step): a value written there would be lost."""
        index = self._params.record_index
        hooks = self._wiring.hooks
        return [r.name for r in records if id(r) in index and hooks.landed(index[id(r)])]

    def forget_writes(self, records) -> None:
        """Writes to `records`' parameters so far were not the user's (copies put
        in and taken back, as GatheredParameters does): their version counts are
        taken as they are now (Note [Writes to a parameter] in hooks/module_hooks.cpp).

        Args:
            records: ParamStore records; those this engine does not train are skipped.
        """
        if getattr(self, "_wiring", None) is None:
            return
        index = [self._params.record_index[id(r)] for r in records if id(r) in self._params.record_index]
        if index:
            self._wiring.hooks.sync_param_writes(index)

    @property
    def records(self) -> list:
        """The ParamStore records of the parameters this engine trains, in
        chunk order (engine._params, a ParamTable, has the modules and stable indexes)."""
        return self._params.records

    def step(self):
        """The optimizer step, at gradient accumulation boundaries (as DeepSpeed)."""
        self._refuse_after_disk_failure()
        self._outside.settle_raw_backward()
        applied = self._step.step()
        if applied and self._ema is not None:
            if self._overlap is not None:
                # The EMA reads every master: the updates this step left to
                # the next forward (Note [CPU Adam under the next forward])
                # hold theirs until they are done.
                self._overlap.settle_deferred()
            self._ema.update()
        return applied

    def ema(self, decay: float = 0.999) -> None:
        """Keeps an EMA of the weights from now on, on the host, updated after
        each applied step (Note [An EMA of the weights] in engine/ema.py);
        calling it again starts a new one from the weights as they are.

        Args:
            decay: the EMA's decay, in [0, 1): ema = decay * ema + (1 - decay) * weight.
        """
        self.settle_overlap()
        self._outside.settle()
        self._ema = _ema.WeightEma(params=self._params, store=self.store, decay=decay)

    def ema_state_dict(self) -> dict:
        """Copies of the EMA of the weights (fp32, by parameter name, as the
        model's state_dict keys them); UsageError before engine.ema()."""
        if self._ema is None:
            raise UsageError("engine.ema_state_dict() before engine.ema(decay): no EMA is kept; "
                             "call engine.ema(decay) once, before the steps to average")
        return self._ema.state_dict()

    def apply_lr_schedule(self):
        """lr (and OneCycle's betas) for the next step from the LR scheduler's
        position, for every parameter group in proportion (Note [Parameter groups])."""
        self._step.apply_lr_schedule()

    def zero_grad(self):
        """Drops pending gradients (those in 16-bit slots are restored from
        fp32) and the gradient sums of an unfinished accumulation."""
        self._wiring.hooks.take_backward_ended()  # (a loss.backward() whose gradients go now)
        if self._overlap is not None and self._overlap.raw_backward_refused:
            # (That backward stopped with parameters attached: StepOverlap.landed.)
            self._overlap.raw_backward_refused = False
            self._release_after_error()
        self.settle_overlap()  # (updates made during backward are taken back)
        self._accumulation.reset()
        self._outside.grads.drop_all()
        self._wiring.hooks.clear_grad_norm()
        if self._overlap is not None:
            self._overlap.take_sums_measured()  # (their measures just went)
        if self._dp_step is not None:
            self._dp_step.drop_gradient_norm()
        for r in self._params.records:
            r.param.grad = None

    def _give_weights_back(self, records):
        """Slots of `records` holding gradients being dropped get their
        weights back: from the masters this rank owns, and (data parallel)
        the others from their owners."""
        self._step.restore_params([r for r in records if self.store.owns(r)])
        if self._dp_step is not None:
            self._dp_step.broadcast({r.chunk for r in records if r.trainable})

    # ---------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """Writes model, fp32 master, Adam state, loss scaler, LR scheduler, step
        and RNG state to <save_dir>/<tag>/ atomically (Note [Checkpoint format])."""
        self.settle_overlap()
        self._outside.settle()
        with _dtr.outside():
            return self._checkpoints.save_checkpoint(save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True,
                        load_lr_scheduler_states=True):
        """Restores a save_checkpoint(); tag None reads <load_dir>/latest.
        Returns (path, client_state), as DeepSpeed's."""
        self.settle_overlap()
        self._outside.settle()
        with self.dtr.weights_change(), _dtr.outside():
            result = self._checkpoints.load_checkpoint(load_dir, tag, load_optimizer_states,
                                                           load_lr_scheduler_states)
        self._wiring.hooks.sync_param_writes()  # (the load wrote the chunks, not the parameters)
        return result

    def state_dict(self) -> dict:
        """fp32 weights and buffers keyed like the model's own state_dict."""
        self.settle_overlap()
        self._outside.settle()
        with _dtr.outside():
            return self._checkpoints.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True):
        """Loads weights (fp32 master and 16-bit copy); Adam state is kept."""
        self.settle_overlap()
        self._outside.settle()
        with self.dtr.weights_change(), _dtr.outside():
            result = self._checkpoints.load_state_dict(state_dict, strict)
        self._wiring.hooks.sync_param_writes()  # (the load wrote the chunks, not the parameters)
        return result

    def load_pretrained(self, path, strict: bool = True):
        """Loads Hugging Face save_pretrained weights, tensor by tensor."""
        self.settle_overlap()
        self._outside.settle()
        with self.dtr.weights_change(), _dtr.outside():
            result = self._checkpoints.load_pretrained(path, strict)
        self._wiring.hooks.sync_param_writes()  # (the load wrote the chunks, not the parameters)
        return result

    def save_pretrained(self, save_dir, max_shard_size="5GB", dtype=None):
        """Writes Hugging Face `save_pretrained`-compatible weights (safetensors,
        sharded past `max_shard_size`) and config.json, shard by shard."""
        self.settle_overlap()
        self._outside.settle()
        with _dtr.outside():
            return self._checkpoints.save_pretrained(save_dir, max_shard_size, dtype)


# The engine's entry points: inside them its parameters are its own (Note
# [Parameters fail closed] in user_param.py).
for _name in ("backward", "step", "zero_grad", "remove_hooks", "state_dict", "load_state_dict", "ema",
              "ema_state_dict",
              "save_checkpoint", "load_checkpoint", "load_pretrained", "save_pretrained",
              "parameters_fp32", "memory_report", "apply_lr_schedule"):
    setattr(Engine, _name, _user_param.engine_entry(getattr(Engine, _name)))
del _name


def initialize(model: torch.nn.Module, config=None, model_parameters=None) -> Engine:
    """Puts `model`'s parameters into chunks and returns the Engine that trains it.

    Args:
        model: the model (an nn.Module).
        config: a dict, a path to a JSON file, or a tidal.Config.
        model_parameters: as deepspeed.initialize's: None (every parameter
            with requires_grad trains, with the config's optimizer settings),
            an iterable of parameters (only those train), or torch-style
            parameter groups ([{"params": [...], "weight_decay": 0.0},
            {"params": [...], "lr": 1e-4}]; Note [Parameter groups]).
    """
    return Engine(model, config, model_parameters)
