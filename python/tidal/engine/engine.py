"""The training engine: tidal.initialize(model, config) -> Engine.

See ../shared/ARCHITECTURE.md, "Data flow of one training step", and
python/tidal/engine/hooks.py for the hook protocol. One step:

    loss = engine(batch)        # forward: chunks come to the device per module
    engine.backward(loss)       # gradients land in the 16-bit slots
    engine.step()               # Adam per chunk: on the device (hybrid) or CPU

The engine's meters (Note [The memory tracer] in hooks/tracer/memory_tracer.h)
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every hook is a trace point: one call into the C++ memory tracer measures
non-chunk device memory (N), records the interval's peak and sets the chunk
budget (the warm-up cap, then the recorded trace: Note [The warm-up budget]
there). What N is depends on the device (Engine._new_tracer):
* CUDA with chunk blocks from torch's caching allocator (the store installs
  that provider; Note [Chunk memory and torch's caching allocator] in
  hooks/torch_memory_provider.h): chunk blocks are in torch's own stats, so
  N = torch's allocated bytes - H, H = what torch counted for the chunk
  blocks the provider holds (resident chunks and the scheduler's cached
  blocks alike). The peak is exact: H is constant between two chunk-block
  calls, the provider folds (torch's peak - H) into its window at each call
  and restarts torch's peak, and at the point the peak is max(window,
  torch's peak now - H). Allocated, not reserved: what torch's cache keeps
  free serves chunk blocks too (torch frees its cached segments and retries
  before a chunk block fails), so it is room for chunks, not a cost of
  activations.
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

import collections
import math
import time
import warnings
import weakref
import zlib

import torch

from .. import _C
from .. import dtr as _dtr
from .. import recompute as _recompute
from ..config import Config, ConfigError
from ..data_parallel import IN_FLIGHT, DataParallelError
from ..lr_schedules import build_scheduler
from . import checkpoint as _checkpoint
from . import external as _external
from . import guards as _guards
from . import hooks as _hooks
from . import param_groups as _param_groups
from .dtr_link import DtrLink
from .errors import UnsupportedModelError, UsageError
from .loss_scaler import DynamicLossScaler, StaticLossScaler
from .store import (DEVICE, GRAD32, HOLD, HOST, MOMENTUM, NOWHERE, PARAM16, PARAM32, VARIANCE,
                    ParamStore, RelayoutError, uncounted)

OutOfMemoryError = _C.OutOfMemoryError


_PLACEHOLDER_HINT = (
    " [tidal: if this op read a parameter outside the forward of the module that owns it (e.g. "
    "`other_module.weight` in another module's forward), that parameter is an empty placeholder "
    "there: tidal brings a module's parameters to the device only while that module runs. Use it "
    "through its module, or move the code into the owning module's forward]")



_FWD = _C.chunks.PointKind.FORWARD
_BWD = _C.chunks.PointKind.BACKWARD
_HOLD = _C.chunks.TensorState.HOLD


def _weak_method(bound):
    """`bound` (an engine method) called through a weak reference.

    Note [Gradient hooks hold the engine weakly]: a tensor's post-accumulate-
    grad hooks live in its C++ autograd meta, which Python's garbage
    collector cannot see through. A hook holding the engine strongly made the
    cycle parameter -> hook -> engine -> model -> parameter uncollectable, so a
    dropped engine kept its chunks (and their pinned host memory) until the
    process exited. Module hooks live in Python dicts and need no such care.
    """
    ref = weakref.WeakMethod(bound)

    def call(*args):
        method = ref()
        if method is not None:
            method(*args)

    return call

# tidal keys each rank of a data-parallel run may set for its own machine.
_PER_MACHINE_KEYS = frozenset({"device_memory_budget", "host_memory_budget", "device_margin",
                               "cpu_adam_threads", "prefetch", "prefetch_depth", "eviction_policy",
                               "hybrid_adam", "warmup_chunk_share", "device"})


class Engine:
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
        # Gradient sums in chunks (Note [Gradient sums in chunks] in cpu_adam/adam.h).
        self._accumulating = cfg.gradient_accumulation_steps > 1
        # The config's activation_checkpointing / tidal.recompute block: the
        # plan is made first, so a bad checkpoint name fails before anything
        # moves into chunks (Note [Recompute under the training engine]).
        self.recompute_plan = None
        if cfg.activation_checkpointing_given:
            self.recompute_plan = _recompute.from_config(model, cfg.activation_checkpointing,
                                                         cfg.recompute)
        try:
            self._setup(model, cfg, store)
        except BaseException:
            if self.recompute_plan is not None:
                self.recompute_plan.remove()
            raise
        if self.recompute_plan is not None:
            self.recompute_plan.parameter_aliases = self._saved_tensor_pair

    def _setup(self, model, cfg, store):
        store.adopted()
        self.store = store
        self.chunks = store.chunks
        self.dtype = store.dtype
        self.precision = store.precision

        # Registration in module order (the first use order of most models);
        # names are the qualified names of the first module owning a param.
        self._module_records: dict[torch.nn.Module, list] = {}
        self._names: dict[torch.nn.Module, str] = {}
        added = []  # (record, the parameter's dtype) registered here
        inside_leaf = set()  # descendants of leaf modules: no hooks of their own
        try:
            for mname, m in model.named_modules(remove_duplicate=True):
                self._names[m] = mname or type(m).__name__
                if getattr(m, "sparse", False) is True and any(
                        p.requires_grad for p in m.parameters(recurse=False)):
                    raise UnsupportedModelError(
                        f"module '{self._names[m]}' ({type(m).__name__}) has sparse=True: its "
                        f"gradients are sparse tensors, and tidal's chunks hold dense gradients "
                        f"in the parameters' 16-bit slots; build it with sparse=False (or "
                        f"freeze its parameters)")
                if id(m) in inside_leaf:
                    continue
                if _external.is_leaf(m):
                    # One unit (tidal.set_leaf_modules): its subtree's parameters.
                    inside_leaf.update(id(d) for d in m.modules() if d is not m)
                    owned = m.named_parameters(prefix=mname)
                else:
                    owned = ((f"{mname}.{pname}" if mname else pname, p)
                             for pname, p in m.named_parameters(recurse=False))
                recs = []
                for full, p in owned:
                    rec = store.by_param.get(id(p))
                    if rec is None:
                        if p.numel() == 0:
                            continue  # nothing to keep; stays an ordinary tensor
                        dtype = p.dtype
                        rec = store.add(p, full, module=m)
                        added.append((rec, dtype))
                    elif rec.provisional:
                        rec.name, rec.provisional = full, False
                    recs.append(rec)
                if recs:
                    self._module_records[m] = recs
            # Parameters registered by hand (tidal.register_external_parameter),
            # and the root, hooked even without parameters of its own, so that
            # a parameter read in any forward has a module to serve it for
            # (Note [External parameters] in hooks/module_hooks.h).
            known = {id(r) for recs in self._module_records.values() for r in recs}
            for m in model.modules():
                for p in _external.marked_external(m):
                    rec = store.by_param.get(id(p))
                    if rec is None or id(rec) not in known:
                        raise ValueError(
                            f"tidal.register_external_parameter: a parameter registered for module "
                            f"'{self._names.get(m, type(m).__name__)}' is not a parameter of the "
                            f"model passed to tidal.initialize")
                    recs = self._module_records.setdefault(m, [])
                    if all(rec is not r for r in recs):
                        recs.append(rec)
            self._module_records.setdefault(model, [])
        except BaseException:
            store.give_back(added)  # the model keeps its values
            raise
        # Stable indexes for the tracer's timeline (record ids change at relayout).
        self._module_list = list(self._module_records)
        self._module_index = {m: i for i, m in enumerate(self._module_list)}
        mine = {id(r) for recs in self._module_records.values() for r in recs}
        store.discard([r for r in store.records if id(r) not in mine])
        self.records = [r for r in store.records if id(r) in mine]
        self._record_set = set(self.records)
        self._record_list = list(self.records)
        for r in self.records:
            r.group = self._group_of.get(id(r.param), 0)
        self._record_index = {id(r): i for i, r in enumerate(self._record_list)}
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
        self.dp = store.dp
        self._dp_broken: str | None = None
        self._dp_sumsq = 0.0
        if self.dp is not None:
            self._setup_data_parallel(model, cfg)

        # Optimizer, loss scaling.
        # DeepSpeed's LR schedules; stepped after each optimizer step that
        # was not skipped by an fp16 overflow.
        self.lr_scheduler = build_scheduler(cfg)
        self.lr, self.betas = cfg.lr, cfg.betas
        self.apply_lr_schedule()
        self.global_steps = 0
        self.micro_steps = 0
        self._forced_boundary: "bool | None" = None
        self.skipped_steps = 0
        self._last_grad_norm: float | None = None
        if self.precision == "fp16":
            self.scaler = StaticLossScaler(cfg.loss_scale) if cfg.loss_scale > 0 else \
                DynamicLossScaler(cfg.initial_scale_power, cfg.loss_scale_window, cfg.hysteresis,
                                  cfg.min_loss_scale)
        else:
            self.scaler = StaticLossScaler(1.0)

        # Hook state (the parameters' use counts and attached flags are in
        # self._hooks, made below).
        self._saved_hooks = None
        self._pre_backward_hooks: dict = {}
        self._handles = []

        # Memory tracer and budget arbiter (Note [The memory tracer] in
        # hooks/tracer/memory_tracer.h): one C++ call per trace point.
        self._cuda = store.torch_device.type == "cuda"
        self._tracer = self._new_tracer()
        # Note [The simulated device's budget is a hard limit]: with torch's
        # CPU allocations as the meter (not the CPU stand-in of the provider,
        # whose chunk blocks torch counts too).
        self._enforce_budget = not self._cuda and not isinstance(
            store.device.memory_provider(), _C.TorchMemoryProvider)
        if self._cuda and isinstance(store.device.memory_provider(), _C.TorchMemoryProvider):
            # On a GPU whose chunk blocks come from torch's caching allocator,
            # torch's own per-process cap makes the budget the same promise:
            # an allocation past it fails in its op (DTR evicts and retries),
            # as past the card's memory. (Not yet run on a GPU.)
            dev = store.torch_device
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, (store.device_budget - store.margin) / total), dev)
        self._stats_at_step = self.chunks.stats()
        self._retired_stats: dict | None = None  # counters of a scheduler replaced by relayout
        self._relayout_done = False
        self.relayouts = 0
        self.relayout_skipped: str | None = None
        if self.dp is not None:
            # It would move records between owners (Note [Data parallel by chunk]).
            self._relayout_done = True
            self.relayout_skipped = "data parallel: the chunk layout decides each chunk's owner"

        self._bytes_per_step: list[tuple[int, int]] = []
        self._adam_seconds = 0.0
        self._adam_device_chunks = 0
        self._adam_host_chunks = 0
        # The optimizer step of a chunk on the device (_adam_chunk): torch's
        # fused kernel on a GPU; cpu_adam's SIMD kernel on the simulated
        # device, whose memory is host memory.
        self._device_adam_kernel = "fused" if self._cuda else "simd"
        # DTR of activations (Note [DTR under the training engine]).
        self.dtr = DtrLink(self, cfg.dtr)
        self._hooks = self._new_hooks()
        # Saved tensors that alias a parameter's slot are packed as (parameter,
        # geometry) and rebuilt from its data in backward, so nothing keeps a
        # chunk address across a move (Note [Parameters keep their TensorImpl]
        # in hooks/param_binding.h); the same pair serves tidal.recompute's
        # replays (RecomputePlan.parameter_aliases).
        self._saved_tensor_pair = self._hooks.saved_tensor_hooks(self._unpack_attach)
        # Note [External parameters]: readers found in a forward are hooked
        # at the start of the next (module -> record indexes to add).
        self._pending_readers: dict = {}
        self._check_reads = True  # the first forward runs under PlaceholderCheck
        self._reads_mode = None
        self._install_hooks()
        self._hooks.set_raw_backward(self._raw_backward_refusal())
        _external.install(model, self, self._param_names_by_module())
        self._install_state_dict_hooks()
        _guards.register(self)
        if not self._cuda:
            # An engine collected mid-step (its forward or backward counting
            # the simulated device's allocations) leaves no count running.
            weakref.finalize(self, _C.chunks.set_host_allocation_counting, False)
        self.dtr.start(self._hooks)
        self.dtr.rebalance()

    # ------------------------------------------------------------------ setup
    def _setup_data_parallel(self, model, cfg):
        """Note [Data parallel by chunk] in tidal/data_parallel.py: every rank
        must hold the same model in the same chunks, with the same config."""
        if cfg.dtr and cfg.dtr.get("enabled", True):
            raise ConfigError(
                "config keys 'tidal.dtr' and data parallel: DTR under the engine is not supported "
                "with data parallel yet (a recompute in backward may read the master weights of a "
                "chunk another rank owns); turn one off (tidal.dtr.enabled: false, or "
                "tidal.data_parallel.enabled: false)")
        c = self.chunks
        layout = [[r.name, list(r.shape), bool(r.trainable), list(c.placement(r.id))]
                  for r in self.records]
        # Memory budgets and tuning may differ between machines; the rest may not.
        raw = dict(cfg.raw)
        raw["tidal"] = {k: v for k, v in cfg.raw["tidal"].items() if k not in _PER_MACHINE_KEYS}
        # The initial 16-bit values too: DDP would broadcast rank 0's, but a
        # rank that built other weights has a seeding bug worth hearing of.
        weights = []
        with torch.no_grad(), uncounted():
            for r in self.records:
                view = c.access(r.id, PARAM16, HOST, [r.numel])
                try:
                    weights.append(zlib.crc32(view.view(torch.uint8).numpy()))
                finally:
                    c.release(r.id, PARAM16, HOLD)
        self.dp.check_same({"config": raw, "model and chunk layout": layout,
                            "parameter groups": self._group_state(), "initial weights": weights})
        # The unit of the gradient reductions: each chunk's trainable records,
        # reduced in one fixed order by every rank (the last chunk first, as
        # backward reaches them), so the ranks' collectives match whenever
        # each rank's chunks become final.
        members = collections.defaultdict(list)
        for r in self.records:
            if r.trainable:
                members[r.chunk].append(r)
        self._dp_members = dict(sorted(members.items()))
        # The unit of the broadcasts: (first record, start, end) of the span
        # of each such chunk's trainable records.
        self._dp_spans = {}
        for chunk, recs in self._dp_members.items():
            offs = [c.placement(r.id)[1] for r in recs]
            self._dp_spans[chunk] = (recs[0], min(offs),
                                     max(o + r.numel for o, r in zip(offs, recs, strict=True)))
        self._dp_order = sorted(members, reverse=True)
        self._dp_pos = {chunk: i for i, chunk in enumerate(self._dp_order)}
        self._dp_left: dict[int, int] = {}
        self._dp_counted: set[int] = set()  # records counted in this backward
        self._dp_sq: list = []  # sums of squares of the owner's reduced gradients (0-d tensors)
        self._dp_warned_unused = False
        self._dp_next = len(self._dp_order)
        self._dp_flight = collections.deque()  # reductions: (chunk, landed, buffer, work)
        self._dp_sending = collections.deque()  # broadcasts after the update: (chunk, buffer, work)
        self._dp_in_backward = 0

    def _check_budget(self):
        limit = self.store.device_budget - self.store.margin
        largest = 0
        for m, recs in self._module_records.items():
            chunks = {r.chunk for r in recs}
            need = sum(self.chunks.chunk_capacity_bytes(c, PARAM16) for c in chunks)
            largest = max(largest, need)
            if need > limit:
                raise OutOfMemoryError(
                    f"module '{self._names[m]}' ({type(m).__name__}) needs its parameters on the "
                    f"device at once: {len(recs)} parameters in {len(chunks)} chunk(s) of "
                    f"{need} bytes, but the device budget leaves {limit} bytes for chunks "
                    f"(budget {self.store.device_budget} - margin {self.store.margin}); raise "
                    f"tidal.device_memory_budget or lower tidal.chunk_size")
        # Chunks the host budget cannot hold live on the device all the time
        # (Note [One place per chunk]): a floor under the chunk room.
        s = self.chunks.stats()
        self._spilled_floor = max(0, s["resident_bytes_host"] + s["resident_bytes_device"]
                                  - self.store.capacity_bytes()[0])
        if self._spilled_floor + largest > limit:
            host = self.store.capacity_bytes()[0]
            state = s["resident_bytes_host"] + s["resident_bytes_device"]
            raise OutOfMemoryError(
                f"the model's chunks ({state} bytes of states, {len(self.records)} parameters) "
                f"fit host + device only with no room to compute: the host holds {host} bytes of "
                f"them (tidal.host_memory_budget {self.store.host_budget} less "
                f"{self.store.host_reserve} kept for chunks moving down), so {self._spilled_floor} "
                f"bytes stay on the device, and the largest module needs {largest} bytes of chunks "
                f"there at once, more than the {limit} bytes the device budget leaves for chunks "
                f"(tidal.device_memory_budget {self.store.device_budget} - margin "
                f"{self.store.margin}); activations need room too. Raise "
                f"tidal.host_memory_budget or tidal.device_memory_budget, or train a smaller model "
                f"(about {self.store.largest_model_params()} parameters at "
                f"{self.store.state_bytes_per_param()} bytes each fit these budgets)")
        # Note [The warm-up budget]: chunks get this much while no trace is known.
        self._warmup_chunk_room = min(limit, max(largest + self._spilled_floor,
                                                 int(self.config.warmup_chunk_share * limit)))
        tracer = getattr(self, "_tracer", None)
        if tracer is not None and not tracer.warmed_up:
            tracer.set_warmup_room(self._warmup_chunk_room)

    def _install_hooks(self):
        """The module and gradient hooks: C++ callables (Note [Hooks torch
        calls into C++] in python/csrc/hook_callables.cpp) that fall back to
        the Python methods below under a Python dispatch mode. With DTR on,
        the callables keep the engine's own ops out of it (OutsideGuard) and
        ModuleHooks keeps DTR's threshold in step with the chunks
        (rebalance_dtr)."""
        root = self.module
        self._handles.append(root.register_forward_pre_hook(self._root_pre))
        self._handles.append(root.register_forward_hook(self._root_post, always_call=True))
        hooks = self._hooks
        for m in self._module_records:
            self._hook_module(m)
        seen = set()
        for r in self.records:
            if r.trainable and id(r.param) not in seen:
                seen.add(id(r.param))
                hook = hooks.grad_hook(self._record_index[id(self.store.by_param[id(r.param)])],
                                       _weak_method(self._grad_ready))
                self._handles.append(r.param.register_post_accumulate_grad_hook(hook))
                if self.dp is not None and self.dp.overlap:
                    # After the landing (hooks run in order): a chunk whose
                    # gradients are all in starts its reduction.
                    self._handles.append(r.param.register_post_accumulate_grad_hook(
                        _weak_method(self._dp_grad_ready)))

    def _hook_module(self, m):
        """Module `m`'s forward pre and post hooks (C++ callables)."""
        i = self._module_index[m]
        hooks = self._hooks
        pre = hooks.forward_pre_hook(i, self._pre_forward, self._forward_pre_failed)
        post = hooks.forward_post_hook(i, self._post_forward, self._wrap_outputs,
                                       _weak_method(self._backward_pre_failed))
        self._handles.append(m.register_forward_pre_hook(pre))
        self._handles.append(m.register_forward_hook(post))

    def _param_names_by_module(self) -> dict:
        """module -> {name in its _parameters: record index} for the parameters this engine keeps."""
        out = {}
        for m in self.module.modules():
            names = {}
            for pname, p in m.__dict__.get("_parameters", {}).items():
                r = self._record_of_param(p) if p is not None else None
                if r is not None:
                    names[pname] = self._record_index[id(r)]
            if names:
                out[m] = names
        return out

    def _install_state_dict_hooks(self):
        """model.state_dict() and model.load_state_dict() read and write the
        chunks: the module itself holds empty placeholders (a torch.save of
        them would lose the model without a word)."""
        ref = weakref.ref(self)
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
            self._handles.append(m.register_state_dict_post_hook(save))
            self._handles.append(m.register_load_state_dict_pre_hook(load))

    def _fill_state_dict(self, state, prefix, names):
        """A module's state_dict entries for its parameters: their weights (CPU
        copies in the parameter's dtype), not the placeholders. keep_vars=True
        keeps the Parameter objects (tidal's own checkpoints map keys by them)."""
        for pname, i in names.items():
            key = prefix + pname
            value = state.get(key)
            if value is None or isinstance(value, torch.nn.Parameter):
                continue
            state[key] = self._weight_copy(self._record_list[i])

    def _weight_copy(self, record) -> torch.Tensor:
        """A host copy of `record`'s weight in its 16-bit dtype: the slot, or
        the master while the slot holds a landed gradient."""
        i = self._record_index[id(record)]
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
        for pname, i in names.items():
            key = prefix + pname
            if key not in state:
                continue
            record = self._record_list[i]
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

    def _group_state(self) -> list:
        """The parameter groups as a checkpoint keeps them (Note [Parameter groups])."""
        return _param_groups.state(self.optimizer.param_groups,
                                   lambda p: self.store.by_param[id(p)].name)

    def _record_of_param(self, p):
        """The record of parameter `p` if this engine trains it, else None."""
        r = self.store.by_param.get(id(p))
        if r is None or r.param is not p or r not in self._record_set:
            return None
        return r

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

    def remove_hooks(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        _external.uninstall(self.module)
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
        # backward run, less what was live when the engine was made.
        return _C.chunks.MemoryTracer(self.chunks, device_budget=store.device_budget,
                                      margin=store.margin, warmup_room=self._warmup_chunk_room,
                                      **kwargs)

    def _end_trace_step(self):
        self._tracer.end_step()
        self.dtr.rebalance()

    # ----------------------------------------------------------------- hooks
    # Each hook is one call into hooks/module_hooks.h (Note [One call per
    # hook]); Python adds the DTR context and the error messages.
    def _new_hooks(self):
        hooks = _C.chunks.ModuleHooks(self.chunks, self._tracer)
        for r in self._record_list:
            hooks.add_param(r.param, r.id, r.shape)
        index = self._record_index
        for m in self._module_list:
            hooks.add_module([index[id(r)] for r in self._module_records[m]])
        hooks.set_make_room(self.dtr.enabled_by_config)
        hooks.set_track_first_use(True)
        hooks.set_accumulating(self._accumulating)
        return hooks

    def _count(self, on: bool):
        # Simulated device: torch's CPU allocations during forward and
        # backward are the non-chunk "device" memory (Note [The memory
        # tracer]), limited to what the budget leaves beside the chunks while
        # they are counted (Note [The simulated device's budget is a hard
        # limit]; the limit and the room maker are this engine's for that
        # window only, so another engine never meets them).
        if self._cuda:
            return
        if on:
            _C.chunks.set_host_allocation_counting(True)
            if self._enforce_budget:
                self._tracer.set_enforce(True)
                self._hooks.set_device_room_maker(True)
        else:
            if self._enforce_budget:
                self._tracer.set_enforce(False)
                self._hooks.set_device_room_maker(False)
            _C.chunks.set_host_allocation_counting(False)

    def _root_pre(self, module, args):
        if torch._C._current_graph_task_id() == -1:  # (not a recompute inside backward)
            self._settle_raw_backward()
            # Parameters read outside any forward since the last (Note
            # [External parameters]) go back to their chunks.
            with _dtr.outside():
                self._hooks.end_backward()
        if self._pending_readers:
            self._hook_readers()
        if torch._C._current_graph_task_id() == -1:
            self.dtr.begin()  # Note [DTR belongs to the engine's cycle]
        self._count(True)
        if self._saved_hooks is None:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(*self._saved_tensor_pair)
            self._saved_hooks.__enter__()
        if self._check_reads and self._reads_mode is None:
            self._reads_mode = _external.PlaceholderCheck(self)
            self._reads_mode.__enter__()

    def _root_post(self, module, args, output):
        if self._reads_mode is not None:
            mode, self._reads_mode = self._reads_mode, None
            mode.__exit__(None, None, None)
            self._check_reads = False
        if not torch.is_grad_enabled():
            self._count(False)
            if torch._C._current_graph_task_id() == -1:
                self.dtr.end()  # no backward follows a no_grad forward
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _is_attached(self, record) -> bool:
        """Whether `record`'s parameter is a view of its slot (COMPUTE)."""
        return self._hooks.attached(self._record_index[id(record)])

    def _uses(self, record) -> int:
        """Forward uses of `record`'s parameter in flight (nested or shared modules)."""
        return self._hooks.uses(self._record_index[id(record)])

    def _attach(self, records, module, replay=False, for_backward=False):
        """Attaches `records` (those not attached) outside the hooks' own path:
        a saved tensor unpacked in backward, a DTR recompute's read."""
        if not records:
            return
        index = self._record_index
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
        self._attach([self._record_list[i]], None, for_backward=True)

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
        where = f"module '{self._names.get(module, '?')}'" if module is not None else \
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
        if self._spilled_floor > 0:
            # Host and device as one pool: what the host cannot hold stays on
            # the device, and with activations beside it nothing can swap.
            host = self.store.capacity_bytes()[0]
            pool = (f". The model's states fill the host's share ({host} bytes: "
                    f"tidal.host_memory_budget {self.store.host_budget} less "
                    f"{self.store.host_reserve} kept for swaps), so {self._spilled_floor} bytes of "
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
        return None if i < 0 else self._record_list[i]

    def _detach(self, records, state):
        if not records:
            return
        index = self._record_index
        with _dtr.outside():
            self._hooks.detach([index[id(r)] for r in records], state)
        self.dtr.rebalance()

    def _pre_forward(self, module, args):
        i = self._module_index[module]
        try:
            with _dtr.outside():
                self._hooks.forward_pre(i)
        except OutOfMemoryError as e:
            self._forward_pre_failed(i, e)
        self.dtr.rebalance()

    def _forward_pre_failed(self, i, e):
        """Module `i`'s forward pre-hook raised `e` (out of memory). A retry
        (after torch.cuda.empty_cache) only attaches: the trace point was taken."""
        module = self._module_list[i]
        self._attach_failed(e, module, self._module_records[module],
                            lambda: self._hooks.forward_pre(i, trace_point=False))

    def _post_forward(self, module, args, output):
        grad = torch.is_grad_enabled()
        with _dtr.outside():
            self._hooks.forward_post(self._module_index[module], grad)
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
        i = self._module_index[module]
        try:
            with _dtr.outside():
                self._hooks.backward_pre(i)
        except OutOfMemoryError as e:
            self._backward_pre_failed(i, e)
        self.dtr.rebalance()

    def _backward_pre_failed(self, i, e):
        """Module `i`'s backward pre-hook raised `e` (out of memory)."""
        module = self._module_list[i]
        index = self._record_index
        ids = [index[id(r)] for r in self._module_records[module]]
        self._attach_failed(e, module, self._module_records[module],
                            lambda: self._hooks.attach(ids, for_backward=True))

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
        i = self._record_index[id(r)]
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

    # ------------------------------------------------------------- user API
    def __call__(self, *args, **kwargs):
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
            if self._saved_hooks is not None:
                hooks, self._saved_hooks = self._saved_hooks, None
                hooks.__exit__(None, None, None)
            if self._reads_mode is not None:
                mode, self._reads_mode = self._reads_mode, None
                mode.__exit__(None, None, None)
            self._count(False)
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

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagates `loss`, scaled for fp16 and divided by the accumulation
        steps (DeepSpeed's engine.backward).

        Args:
            loss: the scalar loss.
            retain_graph: as torch's; a later engine.backward before the step
                is still an error with gradient_accumulation_steps 1.
            scale_wrt_gas: False when the loss is already divided by the
                accumulation steps (the Hugging Face Trainer does that).
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got "
                             f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
        self._dp_check()
        self._settle_raw_backward()
        if not self._accumulating:
            landed = self._hooks.landed_params()
            if landed:
                raise UsageError(
                    f"engine.backward() called again before engine.step(): the gradients of the "
                    f"last backward ({len(landed)} parameters, e.g. "
                    f"'{self._record_list[landed[0]].name}') wait for the step, and "
                    f"gradient_accumulation_steps is 1. Call engine.step() after each backward; "
                    f"to sum several backward passes into one step, set "
                    f"\"gradient_accumulation_steps\" to their number (engine.step() then steps "
                    f"at each boundary); engine.zero_grad() drops the waiting gradients")
        if self.dp is not None:
            self._dp_begin_backward()
        scale = self.scaler.scale
        if scale_wrt_gas:
            scale = scale / self.config.gradient_accumulation_steps
        scaled = loss.float() * scale if scale != 1.0 else loss
        self._count(True)
        self._hooks.set_engine_backward(True)
        try:
            try:
                scaled.backward(retain_graph=retain_graph)
            except RuntimeError as e:
                # Autograd checks gradient shapes against the tensors of the
                # forward: a gradient of shape [0] is a parameter that was read
                # as its empty placeholder, outside the forward of its module.
                text = str(e)
                if "invalid gradient" in text and "got [0]" in text:
                    raise UnsupportedModelError(
                        f"a parameter was used outside the forward of the module that owns it "
                        f"({text}): there it is an empty placeholder, so the forward's result was "
                        f"wrong. tidal brings a module's parameters to the device only while that "
                        f"module runs (Note [Parameters keep their TensorImpl]). Use the parameter "
                        f"through its module (call the module), or move the code that reads it into "
                        f"the owning module's forward") from e
                raise
        except BaseException as e:
            # The error is what the user sees; the slots this backward left in
            # use are released without raising another one over it.
            oom = self._out_of_memory(e, "backward")
            self._count(False)  # (bringing DTR's tensors back is no step's memory)
            self._release_after_error()
            self.dtr.end(failed=True)
            if self.dp is not None:
                # Gradients overwrote weights whose masters other ranks own;
                # only collectives could restore them, and the other ranks are
                # in their own backward (Note [Data parallel by chunk]).
                self._dp_broken = "a backward on this rank failed"
                self._dp_flight.clear()
                raise
            # The gradients this backward landed are dropped (their slots get
            # their weights back; a step on part of them would be wrong);
            # earlier micro-batches' sums stay.
            self._drop_landed_gradients()
            if oom is not None:
                raise oom from e
            raise
        finally:
            self._hooks.set_engine_backward(False)
            self._count(False)
        try:
            with _dtr.outside():
                self._hooks.end_backward()
            self.dtr.end()  # Note [DTR belongs to the engine's cycle]
        except BaseException:
            if self.dp is not None:  # (the other ranks go on with their reductions)
                self._dp_broken = "ending a backward on this rank failed"
                self._dp_flight.clear()
            raise
        if self.dp is not None:
            self._dp_after_backward()
        elif self._accumulating:
            self._fold_gradients()
        self.micro_steps += 1

    def _out_of_memory(self, e, phase: str):
        """A tidal.OutOfMemoryError saying what the device held when torch's
        allocator refused an op in `phase` (on the simulated device, the
        budget's hard limit: Note [The simulated device's budget is a hard
        limit] in hooks/host_allocation_counter.h), or None for other errors."""
        if not isinstance(e, torch.OutOfMemoryError) or isinstance(e, OutOfMemoryError):
            return None
        running = [self._names.get(self._module_list[i], "?") for i in self._hooks.running()]
        held = self.chunks.held_bytes(DEVICE)
        live = self._tracer.live()
        what = f"; DTR tracks {_dtr.stats().get('tracked_bytes', 0)} bytes of them" \
            if _dtr.is_enabled() else ""
        return OutOfMemoryError(
            f"tidal: the {phase} ran out of the device budget of {self.store.device_budget} bytes "
            f"(margin {self.store.margin}): {e}. Chunks hold {held} bytes on the device"
            f"{' (modules running: ' + ', '.join(running[-4:]) + ')' if running else ''}; "
            f"activations and other tensors {live} bytes{what}. Use a smaller batch, turn on DTR "
            f"(tidal.dtr) or recompute (activation_checkpointing), or raise "
            f"tidal.device_memory_budget; the engine goes on with the next batch")

    def _release_after_error(self):
        """After a failed forward or backward: every parameter this engine has
        attached goes back to its chunk (HOLD), whatever state the hooks got to.
        The step's partial trace is dropped: the next step records afresh (the
        scheduler's own trace diverges once and is adopted again)."""
        self._tracer.drop_step()
        with _dtr.outside():
            failed = self._hooks.release_all()
        for message in failed:  # never mask the error being raised
            warnings.warn(f"tidal: releasing a parameter after an error failed too: {message}",
                          stacklevel=3)

    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of the unscaled gradients of the last optimizer step,
        before clipping (inf after an fp16 overflow); None before the first
        step. DeepSpeed's name."""
        return self._last_grad_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether engine.step() steps now: every gradient_accumulation_steps
        backward passes, or as set_gradient_accumulation_boundary() says."""
        if self._forced_boundary is not None:
            return self._forced_boundary
        return self.micro_steps % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: "bool | None"):
        """Overrides where the accumulation windows end (DeepSpeed's method of
        the name): True makes the next engine.step() step with the gradients
        summed so far (a short last window of an epoch), False holds it back;
        None goes back to every gradient_accumulation_steps backward passes.
        Set before each micro-batch, as with DeepSpeed.

        Args:
            is_boundary: True, False, or None.
        """
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary expects True, False or None, got "
                            f"{is_boundary!r}")
        self._forced_boundary = is_boundary

    def zero_grad(self):
        """Drops pending gradients (those in 16-bit slots are restored from
        fp32) and the gradient sums of an unfinished accumulation."""
        self._hooks.take_backward_ended()  # (a loss.backward() whose gradients go now)
        self._drop_landed_gradients()
        summed = [r for r in self.records if r.accumulated]
        if summed:
            index = self._record_index
            self._hooks.drop_sums([index[id(r)] for r in summed])
            for r in summed:
                r.accumulated = False
        self._hooks.clear_grad_norm()
        self._dp_sumsq = 0.0  # (data parallel: the norm of the reduced gradients)
        for r in self.records:
            r.param.grad = None

    def _landed(self):
        """The records whose 16-bit slot holds a landed gradient, in record order."""
        landed = self._hooks.landed_params()
        if not landed:
            return []
        landed = set(landed)
        index = self._record_index
        return [r for r in self.records if index[id(r)] in landed]

    def _drop_landed_gradients(self):
        pending = self._landed()
        if pending:
            with _dtr.outside():
                self._restore_params([r for r in pending if self.store.owns(r)])
                if self.dp is not None:
                    # Other ranks' masters give this rank its weights back.
                    self._dp_broadcast({r.chunk for r in pending if r.trainable})
            index = self._record_index
            self._hooks.clear_landed([index[id(r)] for r in pending])

    def _fold_gradients(self):
        """Gradient accumulation, after each backward: each chunk's landed
        gradients go into their fp32 sums in one call, where the chunk is, and
        the 16-bit slots get their weights back (Note [Gradient sums in
        chunks] in cpu_adam/adam.h)."""
        by_chunk = collections.defaultdict(list)
        for r in self._landed():
            by_chunk[r.chunk].append(r)
        if not by_chunk:
            return
        index = self._record_index
        host_short = self._host_short()
        try:
            self._fold_chunks(by_chunk, index, host_short)
        except BaseException as e:
            # The slots still holding gradients get their weights back, so the
            # model stays usable; the sums have this micro-batch's gradients
            # only for the chunks folded before the error.
            self._drop_landed_gradients()
            e.add_note("tidal: folding this micro-batch's gradients into the accumulation sums "
                       "failed part-way; call engine.zero_grad() to start the step afresh")
            raise

    def _fold_chunks(self, by_chunk, index, host_short):
        with torch.no_grad(), uncounted(), _dtr.outside():
            for chunk in sorted(by_chunk):
                recs = by_chunk[chunk]
                # Where the step will run (hybrid Adam: on the device when it
                # has room), so the sums are where the step reads them. A fold
                # on the host moves the 16-bit chunk down (its gradients) and
                # up again for the next forward: the bytes a budget too small
                # for the 16-bit chunks moves anyway.
                on_device = self._update_on_device(chunk, (PARAM32, GRAD32), host_short,
                                                   self.config.hybrid_adam)
                self._hooks.fold_gradients(
                    [index[id(r)] for r in recs], [not r.accumulated for r in recs],
                    DEVICE if on_device else HOST,
                    num_threads=self.config.cpu_adam_threads)
                for r in recs:  # (no longer landed: the fold says so)
                    r.accumulated = True

    # ------------------------------------------------------- data parallel
    def _dp_check(self):
        if self._dp_broken is not None:
            raise DataParallelError(
                f"tidal data parallel: {self._dp_broken}, so this rank's 16-bit chunks hold "
                f"gradients where weights should be and the ranks are out of step; restart the "
                f"run from the last checkpoint")

    def _dp_begin_backward(self):
        self._dp_left = {chunk: len(recs) for chunk, recs in self._dp_members.items()}
        self._dp_counted.clear()
        self._dp_next = 0
        self._dp_flight.clear()
        self._dp_sq.clear()

    def _dp_here(self, chunk: int):
        """Where chunk `chunk`'s 16-bit values are now (during backward and the
        step they are read and written there, never moved: a slot of the chunk
        may still be attached); the buffers move to the backend's device."""
        space = self.chunks.chunk_space(chunk, PARAM16)
        return HOST if space == NOWHERE else space

    def _dp_grad_ready(self, param):
        """After a gradient landed (a hook on every trainable parameter, with
        overlap_comm): the chunks whose gradients are now all in, and every
        one before them in the reduction order, start their reductions while
        backward goes on."""
        r = self.store.by_param[id(param)]
        i = self._record_index[id(r)]
        if not self._hooks.landed(i) or not self._dp_left:
            return
        if self._dp_pos[r.chunk] < self._dp_next:
            # Its chunk's reduction started without this gradient: it would be
            # lost on the owner (a parameter reached twice in one backward, as
            # reentrant activation checkpointing does).
            raise DataParallelError(
                f"tidal data parallel: parameter '{r.name}' got a gradient after the reduction of "
                f"its chunk had started (a parameter reached twice in one backward, e.g. by "
                f"reentrant activation checkpointing); set tidal.data_parallel.overlap_comm to "
                f"false, or use torch.utils.checkpoint with use_reentrant=False")
        if i in self._dp_counted:
            return
        self._dp_counted.add(i)
        self._dp_left[r.chunk] -= 1
        order, left = self._dp_order, self._dp_left
        while self._dp_next < len(order) and left[order[self._dp_next]] <= 0:
            self._dp_launch(order[self._dp_next])
            self._dp_in_backward += 1

    def _dp_launch(self, chunk: int):
        """Starts the reduction of chunk `chunk`'s gradients into its owner
        (the next in the order): its trainable records' slots packed into one
        buffer (frozen weights and padding never travel; a record without a
        gradient on this rank sends zeros, so every rank sends the same
        sizes). At most IN_FLIGHT run at once (the oldest is waited for before
        another starts); finished ones are written back."""
        dp, c = self.dp, self.chunks
        recs = self._dp_members[chunk]
        index = self._record_index
        first = recs[0]
        flight = self._dp_flight
        while len(flight) >= IN_FLIGHT or (flight and flight[0][3].is_completed()):
            self._dp_finish(*flight.popleft())
        with torch.no_grad(), uncounted(), _dtr.outside():
            c.access(first.id, PARAM16, self._dp_here(chunk), [first.numel])  # pins the chunk
            try:
                view = c.chunk_view(chunk, PARAM16)
                landed = [self._hooks.landed(index[id(r)]) for r in recs]
                parts = []
                for r, has in zip(recs, landed, strict=True):
                    off = c.placement(r.id)[1]
                    parts.append(view[off:off + r.numel] if has else
                                 torch.zeros(r.numel, dtype=view.dtype, device=view.device))
                buf = torch.cat(parts).to(dp.device)
            finally:
                c.release(first.id, PARAM16, HOLD)
            work = dp.reduce_async(buf, dp.owner(chunk), f"reduce the gradients of chunk {chunk}")
            flight.append((chunk, landed, buf, work))
            self._dp_next += 1

    def _dp_finish(self, chunk: int, landed, buf, work):
        """Waits for chunk `chunk`'s reduction; on its owner divides the sum by
        the number of ranks and copies it into the slots of the records that
        landed gradients, and adds its sum of squares to the global norm's share."""
        dp, c = self.dp, self.chunks
        dp.wait(work, f"reduce the gradients of chunk {chunk}")
        if dp.rank != dp.owner(chunk):
            return
        recs = self._dp_members[chunk]
        buf.div_(dp.world)
        pieces = buf.split([r.numel for r in recs])
        with torch.no_grad(), uncounted(), _dtr.outside():
            first = recs[0]
            c.access(first.id, PARAM16, self._dp_here(chunk), [first.numel])
            try:
                view = c.chunk_view(chunk, PARAM16)
                dst, src = [], []
                for r, has, piece in zip(recs, landed, pieces, strict=True):
                    if has:
                        off = c.placement(r.id)[1]
                        dst.append(view[off:off + r.numel])
                        src.append(piece.to(view.device))
                if dst:
                    torch._foreach_copy_(dst, src)
                    # (A 0-d tensor: no device sync inside backward's hooks.)
                    self._dp_sq.append(sum(t.float().square().sum() for t in src))
            finally:
                c.release(first.id, PARAM16, HOLD)

    def _dp_after_backward(self):
        """Note [Data parallel by chunk], steps 2 and 3: the chunks whose
        reductions did not start during backward start now, in the same order;
        every rank waits for all. Then the ranks check they landed the same
        parameters; under accumulation the owners fold the reduced gradients
        into their sums and broadcast the weights back."""
        dp = self.dp
        try:
            started_in_backward = self._dp_next
            while self._dp_next < len(self._dp_order):
                self._dp_launch(self._dp_order[self._dp_next])
            while self._dp_flight:
                self._dp_finish(*self._dp_flight.popleft())
            sumsq = sum(float(x) for x in self._dp_sq)
            self._dp_sq.clear()
            self._dp_left = {}
            landed = self._landed()
            index = self._record_index
            flags = torch.zeros(len(self._record_list), dtype=torch.int32)
            if landed:
                flags[[index[id(r)] for r in landed]] = 1
            dp.all_reduce_flags(flags, "compare which parameters got gradients")
            odd = ((flags != 0) & (flags != dp.world)).nonzero().flatten().tolist()
            if odd:
                names = ", ".join(f"'{self._record_list[i].name}' ({int(flags[i])} of {dp.world} "
                                  f"ranks)" for i in odd[:4])
                raise DataParallelError(
                    f"tidal data parallel: parameters got gradients on some ranks only: {names}"
                    f"{' ...' if len(odd) > 4 else ''}; every rank's backward must reach the same "
                    f"parameters (unused parameters that differ between ranks are not supported: "
                    f"freeze them, or make the graph the same on every rank)")
            if dp.overlap and started_in_backward < len(self._dp_order) and not self._dp_warned_unused:
                # A chunk waits for all its trainable parameters, and the later
                # chunks wait for it: a parameter that never gets a gradient
                # holds every reduction after it until the end of backward.
                unused = [r.name for r in self.records if r.trainable and int(flags[index[id(r)]]) == 0]
                if unused:
                    self._dp_warned_unused = True
                    warnings.warn(
                        f"tidal data parallel: trainable parameters got no gradient in this backward "
                        f"({', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}); the gradient "
                        f"reductions of their chunks and of every chunk after them wait for the end "
                        f"of backward instead of overlapping it (overlap_comm). Freeze parameters the "
                        f"model does not use (requires_grad=False before tidal.initialize)",
                        stacklevel=3)
            if self._accumulating:
                with torch.no_grad(), uncounted(), _dtr.outside():
                    owned = collections.defaultdict(list)
                    for r in landed:
                        if self.store.owns(r):
                            owned[r.chunk].append(r)
                    if owned:
                        self._fold_chunks(owned, index, self._host_short())
                    theirs = [index[id(r)] for r in landed if not self.store.owns(r)]
                    self._dp_broadcast({r.chunk for r in landed})
                    self._hooks.clear_landed(theirs)
            else:
                self._dp_sumsq += sumsq
        except BaseException as e:
            self._dp_flight.clear()
            self._dp_broken = f"reducing gradients failed ({type(e).__name__})"
            raise

    def _dp_broadcast(self, chunks):
        """Each of `chunks`' 16-bit values (the span of its trainable
        parameters) from its owner to every rank, waited for (the step's
        overlapped broadcasts, one chunk after another). A failure leaves
        the ranks' weights apart: the engine is broken."""
        try:
            for chunk in sorted(chunks):
                if chunk in self._dp_spans:
                    self._dp_share(chunk)
            self._dp_shared()
        except BaseException as e:
            self._dp_sending.clear()
            self._dp_broken = f"broadcasting parameters failed ({type(e).__name__})"
            raise

    def _dp_share(self, chunk: int):
        """Starts broadcasting chunk `chunk`'s 16-bit span from its owner
        (every rank calls this for every chunk with a trainable parameter, in
        the same order, the owner after its update of the chunk). The owner
        sends a copy and the others receive into a buffer, so the chunk is
        free to move meanwhile; at most IN_FLIGHT run at once."""
        dp, c = self.dp, self.chunks
        first, lo, hi = self._dp_spans[chunk]
        owner = dp.owner(chunk)
        flight = self._dp_sending
        while len(flight) >= IN_FLIGHT or (flight and flight[0][2].is_completed()):
            self._dp_shared_one(*flight.popleft())
        with torch.no_grad(), uncounted(), _dtr.outside():
            if dp.rank == owner:
                c.access(first.id, PARAM16, self._dp_here(chunk), [first.numel])
                try:
                    buf = c.chunk_view(chunk, PARAM16)[lo:hi].to(dp.device, copy=True)
                finally:
                    c.release(first.id, PARAM16, HOLD)
            else:
                buf = torch.empty(hi - lo, dtype=self.dtype, device=dp.device)
            work = dp.broadcast_async(buf, owner, f"broadcast the parameters of chunk {chunk}")
        flight.append((chunk, buf, work))

    def _dp_shared_one(self, chunk: int, buf, work):
        """Waits for chunk `chunk`'s broadcast; a rank that does not own it
        copies the values into its chunk."""
        dp, c = self.dp, self.chunks
        dp.wait(work, f"broadcast the parameters of chunk {chunk}")
        if dp.rank == dp.owner(chunk):
            return
        first, lo, hi = self._dp_spans[chunk]
        with torch.no_grad(), uncounted(), _dtr.outside():
            c.access(first.id, PARAM16, self._dp_here(chunk), [first.numel])
            try:
                view = c.chunk_view(chunk, PARAM16)
                view[lo:hi].copy_(buf)
            finally:
                c.release(first.id, PARAM16, HOLD)

    def _dp_shared(self):
        """Waits for every broadcast _dp_share started."""
        while self._dp_sending:
            self._dp_shared_one(*self._dp_sending.popleft())

    def step(self):
        """The optimizer step, at gradient accumulation boundaries (as DeepSpeed)."""
        self._settle_raw_backward()
        if self.micro_steps == 0 or not self.is_gradient_accumulation_boundary():
            return
        with self.dtr.weights_change():
            return self._step()

    def _step(self):
        self._dp_check()
        # Parameters still attached from a backward run without
        # engine.backward (loss.backward()), or read outside any forward; and
        # the simulated device's meter, which engine.backward would have
        # stopped.
        with _dtr.outside():
            self._hooks.end_backward()
        self._count(False)
        accumulating = self._accumulating
        pending = [r for r in self.records if r.accumulated] if accumulating else self._landed()
        # Data parallel: the update runs where the masters are; every rank
        # holds the gradients it reduced into the chunks it owns.
        owned = pending if self.dp is None else [r for r in pending if self.store.owns(r)]
        norm, finite = self._grad_norm(owned)
        scale = self.scaler.scale
        overflow = not finite
        if self.precision == "fp16":
            self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            if not accumulating:  # (folds restored the weights already)
                self._restore_params(owned)
        else:
            clip = 1.0
            if self.config.gradient_clipping > 0:
                clip = min(1.0, self.config.gradient_clipping / (norm + 1e-6))
            if self.dp is None:
                self._adam(owned, clip / scale)
            else:
                # The all-gather: each chunk's updated 16-bit values from its
                # owner, started as its update ends, while the owners go on
                # with their next chunks.
                try:
                    self._adam(owned, clip / scale, order=list(self._dp_spans),
                               after_chunk=self._dp_share)
                    self._dp_shared()
                except BaseException as e:
                    self._dp_sending.clear()
                    self._dp_broken = f"the step failed part-way ({type(e).__name__})"
                    raise
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
                self.apply_lr_schedule()
        if self.dp is not None and overflow:
            # The owners' weights came back from their masters: the others'
            # from the owners.
            self._dp_broadcast(self._dp_spans)
        index = self._record_index
        if accumulating:
            self._hooks.drop_sums([index[id(r)] for r in owned])
        else:
            self._hooks.clear_landed([index[id(r)] for r in pending])
        for r in pending:
            r.accumulated = False
        self._hooks.clear_grad_norm()
        self._last_grad_norm = norm
        self.global_steps += 1
        self.chunks.end_step()
        self._end_trace_step()
        now = self.chunks.stats()
        self._bytes_per_step.append(
            (now["bytes_host_to_device"] - self._stats_at_step["bytes_host_to_device"],
             now["bytes_device_to_host"] - self._stats_at_step["bytes_device_to_host"]))
        self._stats_at_step = now
        if not self._relayout_done:
            self._relayout()
        return not overflow

    def apply_lr_schedule(self):
        """lr (and OneCycle's betas) for the next step from the LR scheduler's
        position, for every parameter group in proportion (Note [Parameter groups])."""
        if self.lr_scheduler is not None:
            self.lr = self.lr_scheduler.get_lr()
            betas = self.lr_scheduler.get_betas()
            self.betas = betas or self.config.betas
            _param_groups.apply_schedule(self.optimizer.param_groups, self.lr, self.config.lr, betas)

    def _relayout(self):
        """After the warm-up step: chunks in first-use order (Note [Chunks in first-use order])."""
        self._relayout_done = True
        self._hooks.set_track_first_use(False)
        used = [self._record_list[i] for i in self._hooks.take_first_use()]
        seen = set(map(id, used))
        order = used + [r for r in self.store.records if id(r) not in seen]
        if [r.id for r in order] == [r.id for r in self.store.records]:
            return  # registration order was already the first-use order
        s = self.chunks.stats()
        state = s["resident_bytes_host"] + s["resident_bytes_device"]
        # The new chunks are filled on the host while the old ones go: only
        # when the whole state fits the host budget beside both schedulers'
        # cached blocks (host_cache_blocks = 4 each, fp32 chunks of up to 2x
        # chunk_size). Otherwise the registration order stays.
        host = self.store.capacity_bytes()[0]
        if state + 16 * self.config.chunk_size > host:
            self.relayout_skipped = (f"the chunk state ({state} bytes) and the blocks of a "
                                     f"rebuild do not fit the host budget of {host} bytes")
            return
        try:
            owner = {}
            for m, recs in self._module_records.items():
                for r in recs:
                    owner.setdefault(id(r), id(m))
            final = self.store.relayout(order, [owner.get(id(r)) for r in order])
        except RelayoutError as e:
            warnings.warn(f"tidal: {e}", stacklevel=3)
            return
        # The replaced scheduler's counters (its relayout copies included)
        # stay in the reports.
        self._retired_stats = _merge_stats(final, self._retired_stats)
        self.chunks = self.store.chunks
        self._tracer.set_chunks(self.chunks)
        self._hooks.set_chunks(self.chunks, [r.id for r in self._record_list])
        self.records = [r for r in self.store.records if r in self._record_set]
        self._stats_at_step = self.chunks.stats()
        self._check_budget()
        self.relayouts += 1

    def _scheduler_stats(self) -> dict:
        """The scheduler's counters, including those of schedulers replaced by relayout."""
        return _merge_stats(self.chunks.stats(), self._retired_stats)

    # ----------------------------------------------------------- optimizer
    def _grad_norm(self, pending) -> tuple[float, bool]:
        """Global L2 norm of the unscaled gradients and whether all are finite."""
        scale = self.scaler.scale
        if self._accumulating:
            # The sums, once, where their chunks are (Note [Gradient sums in
            # chunks]; landings measured nothing).
            index = self._record_index
            with uncounted(), _dtr.outside():
                self._hooks.measure_sums([index[id(r)] for r in pending])
        sum_squares, finite = self._hooks.take_grad_norm()
        if self.dp is not None:
            # The landings measured this rank's own gradients; the norm is of
            # the reduced ones, each measured by its owner, summed over ranks.
            if not self._accumulating:
                sum_squares, finite = self._dp_sumsq, math.isfinite(self._dp_sumsq)
                self._dp_sumsq = 0.0
            sum_squares, bad = self.dp.all_reduce_sum(
                [sum_squares if finite else 0.0, 0.0 if finite else 1.0], "sum the gradient norm")
            finite = bad == 0
        total = math.sqrt(sum_squares) if finite else float("inf")
        return total / scale, finite and math.isfinite(total)

    def _weight_from_master(self, record) -> torch.Tensor:
        """A temporary device tensor holding `record`'s 16-bit weight, made from
        its fp32 master (while its 16-bit slot holds a gradient)."""
        c = self.chunks
        with torch.no_grad(), _dtr.outside():
            src = c.access(record.id, PARAM32, HOST, [record.numel])
            try:
                return src.to(self.store.torch_device, self.dtype, copy=True)
            finally:
                c.release(record.id, PARAM32, HOLD)

    def _restore_params(self, records):
        """Gradients overwrote the 16-bit params: copy them back from fp32."""
        c = self.chunks
        with torch.no_grad(), uncounted():
            for r in records:
                if not r.trainable:
                    continue
                dst = c.access(r.id, PARAM16, HOST, [r.numel])
                src = c.access(r.id, PARAM32, HOST, [r.numel])
                dst.copy_(src)
                c.release(r.id, PARAM32, HOLD)
                c.release(r.id, PARAM16, HOLD)

    def _host_short(self) -> bool:
        """The host budget is too small for the state (Note [One place per chunk])."""
        return self._spilled_floor > 0 or self.chunks.stats()["spills"] > 0

    def _update_on_device(self, chunk: int, kinds, host_short: bool, prefer_device: bool) -> bool:
        """Whether the update of `chunk` (the optimizer step, or a gradient
        fold) runs on the device, where it then needs the chunks of `kinds`
        beside its 16-bit chunk. prefer_device: run there whenever the device
        has room for them (else only when the host is too full to take the
        16-bit chunk)."""
        c = self.chunks
        # A master the host budget spilled to the device (Note [One place per
        # chunk]) is updated there: moving it down would only spill another
        # chunk up.
        if host_short and c.chunk_space(chunk, PARAM32) == DEVICE:
            return True
        if c.chunk_space(chunk, PARAM16) != DEVICE:
            return False
        free = c.budget(DEVICE) - c.held_bytes(DEVICE)
        # The chunk's own capacity: a tensor larger than the chunk size has a
        # dedicated, larger chunk.
        need = sum(c.chunk_capacity_bytes(chunk, k) for k in kinds)
        host_full = c.budget(HOST) - c.held_bytes(HOST) < \
            c.chunk_capacity_bytes(chunk, PARAM16)
        return (prefer_device or host_full) and free >= need

    def _adam(self, pending, grad_scale: float, order=None, after_chunk=None):
        """Adam on `pending`'s chunks, one chunk at a time: in `order` when
        given (which may name chunks without pending records), calling
        `after_chunk(chunk)` after each (data parallel: the broadcasts)."""
        by_chunk = collections.defaultdict(list)
        for r in pending:
            by_chunk[r.chunk].append(r)
        t0 = time.perf_counter()
        outside = 0.0
        # The chunks the update needs beside the 16-bit one.
        kinds = (PARAM32, MOMENTUM, VARIANCE) + ((GRAD32,) if self._accumulating else ())
        host_short = self._host_short()
        if host_short:
            # A host too small for the state (Note [One place per chunk]): the
            # step needs device room to move chunks through, and forward and
            # backward are over, so chunks may use what live tensors leave.
            # (Not otherwise: the budget of backward's last point already
            # plans for the next step's first interval.)
            limit = self.store.device_budget - self.store.margin
            self._tracer.make_room(max(0, limit - self._tracer.live()))
        with torch.no_grad(), uncounted():
            for chunk in sorted(by_chunk) if order is None else order:
                if chunk in by_chunk:
                    self._adam_update(chunk, by_chunk[chunk], grad_scale, kinds, host_short)
                if after_chunk is not None:
                    t1 = time.perf_counter()
                    after_chunk(chunk)
                    outside += time.perf_counter() - t1
        self._adam_seconds += time.perf_counter() - t0 - outside

    def _adam_update(self, chunk, recs, grad_scale: float, kinds, host_short: bool):
        cfg, c = self.config, self.chunks
        # Hybrid Adam: on the device when it has room.
        on_device = self._update_on_device(chunk, kinds, host_short, cfg.hybrid_adam)
        space = DEVICE if on_device else HOST
        if on_device:
            self._adam_device_chunks += 1
        else:
            self._adam_host_chunks += 1
        # One pass per chunk, except on a GPU where torch's fused
        # kernel cannot compute what the config asks.
        if space == HOST or self._device_adam_kernel == "simd" or cfg.bias_correction:
            self._adam_chunk(chunk, recs, grad_scale, space, (PARAM16,) + kinds)
            return
        groups = self.optimizer.param_groups
        for r in recs:
            group = groups[r.group]
            r.step += 1
            g16 = c.access(r.id, PARAM16, space, [r.numel])
            w = c.access(r.id, PARAM32, space, [r.numel])
            m = c.access(r.id, MOMENTUM, space, [r.numel])
            v = c.access(r.id, VARIANCE, space, [r.numel])
            # The gradient sum (accumulation) or the 16-bit slot.
            grad = c.access(r.id, GRAD32, space, [r.numel]) if self._accumulating else g16
            if space == HOST:
                b1, b2 = group["betas"]
                _C.cpu_adam.adam_update(
                    w, m, v, grad, g16 if self.precision != "fp32" else None,
                    step=r.step, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw_mode=cfg.adam_w_mode,
                    bias_correction=cfg.bias_correction, grad_scale=grad_scale,
                    num_threads=cfg.cpu_adam_threads)
                if self.precision == "fp32":
                    g16.copy_(w)
            else:
                self._device_adam(w, m, v, grad.to(w.device), r.step, grad_scale, group)
                g16.copy_(w)
            for kind in (PARAM16,) + kinds:
                c.release(r.id, kind, HOLD)

    def _adam_chunk(self, chunk, recs, grad_scale: float, space: str, kinds):
        """The step of one chunk's tensors in one call over the chunk, in
        `space`: cpu_adam's adam_chunk_step (SIMD, GIL released: unscale and
        clip factor, Adam/AdamW and the write-back over the ranges of `recs`)
        on the host and on the simulated device, whose memory is host memory;
        torch's fused Adam/AdamW (one multi-tensor kernel) on a GPU. A few chunk
        calls per chunk instead of 10 per parameter. The 16-bit chunk holds
        the gradients, or with gradient accumulation the fp32 sum chunk does
        (Note [Gradient sums in chunks]), and the 16-bit chunk takes the new
        weights (in fp32 mode it is float32: an exact copy). `kinds`: the
        chunks the step uses."""
        cfg = self.config
        c = self.chunks
        first = recs[0]
        held = []
        try:
            # Accessing one tensor of each of the chunks pins them in `space`.
            for kind in kinds:
                c.access(first.id, kind, space, [first.numel])
                held.append(kind)
            for r in recs:
                r.step += 1
            views = [c.chunk_view(chunk, k) for k in (PARAM32, MOMENTUM, VARIANCE, PARAM16)]
            sums = c.chunk_view(chunk, GRAD32) if GRAD32 in kinds else None
            # One call per parameter group in the chunk (Note [Parameter groups]).
            by_group = collections.defaultdict(list)
            for r in recs:
                by_group[r.group].append(r)
            for gi, members in sorted(by_group.items()):
                group = self.optimizer.param_groups[gi]
                ranges = [(c.placement(r.id)[1], r.numel) for r in members]
                steps = [r.step for r in members]
                if space == HOST or self._device_adam_kernel == "simd":
                    b1, b2 = group["betas"]
                    _C.cpu_adam.adam_chunk_step(
                        *views, ranges, step=steps,
                        lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                        weight_decay=group["weight_decay"],
                        adamw_mode=cfg.adam_w_mode, bias_correction=cfg.bias_correction,
                        loss_scale=1.0 / grad_scale, max_grad_norm=0.0, check_overflow=False,
                        grad=sums, num_threads=cfg.cpu_adam_threads)
                else:
                    self._fused_chunk_step(views, ranges, steps, grad_scale, group, sums)
        finally:
            for kind in held:
                c.release(first.id, kind, HOLD)

    def _fused_chunk_step(self, views, ranges, steps, grad_scale: float, group, sums=None):
        """torch's fused Adam/AdamW over the tensors of one device chunk, in
        groups of at most a quarter of the chunk (the fp32 copies of 16-bit
        gradients are temporary device memory), then the 16-bit write-back.
        `sums`: the chunk of fp32 gradient sums (accumulation), read in place
        of the 16-bit gradients and consumed. With bias correction only
        (torch's fused kernels always correct). bf16 moments
        (tidal.optimizer_state_dtype) go through fp32 temporaries: torch's
        fused kernels take fp32 moments only, so on a GPU this path moves
        more bytes than fp32 moments would (not yet a kernel of our own)."""
        cfg = self.config
        w, m, v, h = views
        b1, b2 = group["betas"]
        fused = torch._fused_adamw_ if cfg.adam_w_mode else torch._fused_adam_
        step_of = torch.tensor(steps, dtype=torch.float32, device=w.device).unbind()
        group_cap = max(1, w.numel() // 4)
        start = 0
        while start < len(ranges):
            end, size = start, 0
            while end < len(ranges) and (end == start or size + ranges[end][1] <= group_cap):
                size += ranges[end][1]
                end += 1
            part = ranges[start:end]
            ws = [w[o:o + n] for o, n in part]
            hs = [h[o:o + n] for o, n in part]
            if sums is not None:
                grads = [sums[o:o + n] for o, n in part]
            else:
                grads = hs if h.dtype == torch.float32 else [g.float() for g in hs]
            if grad_scale != 1.0:
                torch._foreach_mul_(grads, grad_scale)  # temporaries, or slots overwritten below
            ms = [m[o:o + n] for o, n in part]
            vs = [v[o:o + n] for o, n in part]
            m32 = ms if m.dtype == torch.float32 else [t.float() for t in ms]
            v32 = vs if v.dtype == torch.float32 else [t.float() for t in vs]
            fused(ws, grads, m32, v32, [],
                  list(step_of[start:end]), amsgrad=False, lr=group["lr"], beta1=b1, beta2=b2,
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            if m32 is not ms:
                torch._foreach_copy_(ms, m32)  # rounded to nearest even
                torch._foreach_copy_(vs, v32)
            torch._foreach_copy_(hs, ws)
            start = end

    def _device_adam(self, w, m, v, g, step, grad_scale, group):
        """torch.optim.AdamW's single-tensor update on device tensors (bf16
        moments widened to fp32 and rounded back)."""
        if m.dtype != torch.float32:
            m32, v32 = m.float(), v.float()
            self._device_adam(w, m32, v32, g, step, grad_scale, group)
            m.copy_(m32)
            v.copy_(v32)
            return
        cfg = self.config
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        g = g.float()
        if grad_scale != 1.0:
            g = g * grad_scale
        if wd:
            if cfg.adam_w_mode:
                w.mul_(1 - lr * wd)
            else:
                g = g.add(w, alpha=wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        if cfg.bias_correction:
            bc1 = 1 - b1 ** step
            bc2 = 1 - b2 ** step
        else:
            bc1 = bc2 = 1.0
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / bc1)

    # ---------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """Writes model, fp32 master, Adam state, loss scaler, LR scheduler, step
        and RNG state to <save_dir>/<tag>/ atomically (Note [Checkpoint format])."""
        with _dtr.outside():
            return _checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True,
                        load_lr_scheduler_states=True):
        """Restores a save_checkpoint(); tag None reads <load_dir>/latest.
        Returns (path, client_state), as DeepSpeed's."""
        with self.dtr.weights_change(), _dtr.outside():
            return _checkpoint.load_checkpoint(self, load_dir, tag, load_optimizer_states,
                                               load_lr_scheduler_states)

    def state_dict(self) -> dict:
        """fp32 weights and buffers keyed like the model's own state_dict."""
        with _dtr.outside():
            return _checkpoint.state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Loads weights (fp32 master and 16-bit copy); Adam state is kept."""
        with self.dtr.weights_change(), _dtr.outside():
            return _checkpoint.load_state_dict(self, state_dict, strict)

    def load_pretrained(self, path, strict: bool = True):
        """Loads Hugging Face save_pretrained weights, tensor by tensor."""
        with self.dtr.weights_change(), _dtr.outside():
            return _checkpoint.load_pretrained(self, path, strict)

    def save_pretrained(self, save_dir, max_shard_size="5GB", dtype=None):
        """Writes Hugging Face `save_pretrained`-compatible weights (safetensors,
        sharded past `max_shard_size`) and config.json, shard by shard."""
        with _dtr.outside():
            return _checkpoint.save_pretrained(self, save_dir, max_shard_size, dtype)

    # -------------------------------------------------------------- reports
    def memory_timeline(self) -> list[tuple]:
        """Device memory at every hook of the last completed step: tuples of
        (point, hook name, chunk bytes held, non-chunk peak since the previous
        point, device budget). Hook names start with fwd/bwd/grad/step."""
        budget = self.store.device_budget
        out = []
        for k, kind, what, held, peak, _ in self._tracer.timeline:
            out.append((k, self._hook_name(kind, what), held, peak, budget))
        return out

    def _hook_name(self, kind, what) -> str:
        if what < 0:
            return kind
        if kind == "grad":
            return f"{kind} {self._record_list[what].name}"
        module = self._module_list[what]
        return f"{kind} {self._names.get(module, type(module).__name__)}"

    def memory_profile(self) -> list[dict]:
        """memory_timeline() as dicts, with the chunk traffic of each interval:
        the moves host->device and device->host and the evictions since the
        previous trace point (the first point counts from the previous step's
        last one)."""
        budget = self.store.device_budget
        out = []
        prev = None
        for k, kind, what, held, peak, moves in self._tracer.timeline:
            base = prev if prev is not None else moves
            out.append({"moment": k, "hook": self._hook_name(kind, what), "chunk_bytes": held,
                        "non_chunk_bytes": peak, "budget": budget,
                        "h2d_moves": moves[0] - base[0], "d2h_moves": moves[1] - base[1],
                        "evictions": moves[2] - base[2]})
            prev = moves
        return out

    def export_memory_profile(self, directory, title=None) -> dict:
        """Writes the last step's memory profile to `directory`: memory_profile.json
        (memory_profile() with the budget, margin and report) and memory_profile.png
        (chunks / non-chunk / free per hook, the budget line, chunk moves and
        evictions marked). Returns {"json": path, "png": path, ...drawing facts}."""
        import json
        import pathlib

        from ..profile import plot_memory_profile

        profile = self.memory_profile()
        if not profile:
            raise ValueError("no memory profile yet: train at least one step (engine.step()) first")
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        report = {k: v for k, v in self.memory_report().items() if k not in ("scheduler", "host")}
        doc = {"device_budget": self.store.device_budget, "device_margin": self.store.margin,
               "backend": self.store.backend, "points": profile, "report": report}
        json_path = directory / "memory_profile.json"
        json_path.write_text(json.dumps(doc, indent=1, default=str))
        png = directory / "memory_profile.png"
        drawn = plot_memory_profile(profile, png, title=title or
                                    f"tidal: device memory over one step ({self.store.backend})")
        return {"json": str(json_path), "png": str(png), **drawn}

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Host copies of the fp32 master weights (16-bit values for frozen params), by name."""
        with _dtr.outside():
            return {r.name: self.store.gather(r) for r in self.records}

    def memory_report(self) -> dict:
        s = self._scheduler_stats()
        hits = s["prefetch_hits"]
        misses = s["misses"]
        steps = self._bytes_per_step
        return {
            "backend": self.store.backend,
            "device_budget": self.store.device_budget,
            "device_margin": self.store.margin,
            "peak_chunk_device_bytes": s["peak_resident_bytes_device"],
            "peak_nonchunk_device_bytes": self._tracer.peak_nonchunk,
            "peak_device_bytes": self._tracer.peak_total,
            "peak_chunk_host_bytes": s["peak_resident_bytes_host"],
            "host_chunk_capacity_bytes": self.store.capacity_bytes()[0],
            "chunk_spills_to_device": s["spills"],
            "state_bytes_per_param": self.store.state_bytes_per_param(),
            "largest_model_params": self.store.largest_model_params(),
            "host": _C.host_memory_stats(),
            "bytes_host_to_device_last_step": steps[-1][0] if steps else 0,
            "bytes_device_to_host_last_step": steps[-1][1] if steps else 0,
            "evictions": s["evictions"],
            "prefetches": s["prefetches"],
            "prefetch_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "budget_overruns": self._tracer.overruns,
            "cpu_adam_seconds": self._adam_seconds,
            "adam_chunks_on_device": self._adam_device_chunks,
            "adam_chunks_on_host": self._adam_host_chunks,
            "trace_adoptions": s["trace_adoptions"],
            "trace_divergences": s["trace_divergences"],
            "steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "loss_scale": self.scaler.scale,
            "dtr": self.dtr.report(),
            "data_parallel": None if self.dp is None else {
                "rank": self.dp.rank, "world_size": self.dp.world, "backend": self.dp.backend,
                "owned_chunks": sorted({r.chunk for r in self.records if self.store.owns(r)}),
                "bytes_sent": self.dp.bytes_sent, "collectives": self.dp.collectives,
                "overlap_comm": self.dp.overlap, "reduces_in_backward": self._dp_in_backward,
                "seconds_in_collectives": self.dp.seconds_blocked},
            "scheduler": s,
        }


def _merge_stats(now: dict, retired: "dict | None") -> dict:
    """A live scheduler's counters plus a replaced one's (peaks: the larger)."""
    if retired is None:
        return now
    out = {}
    for k, v in now.items():
        if k.startswith("peak_"):
            out[k] = max(v, retired[k])
        elif k.startswith(("resident_", "held_", "budget_")):
            out[k] = v
        else:
            out[k] = v + retired[k]
    return out


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
