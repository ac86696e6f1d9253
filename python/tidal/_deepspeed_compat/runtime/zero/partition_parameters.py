"""deepspeed.runtime.zero.partition_parameters: zero.Init, GatheredParameters,
ZeroParamStatus, and the ZeRO-3 attributes DeepSpeed scripts read on a
parameter (Note [DeepSpeed's ZeRO-3 attributes on tidal's parameters])."""
from __future__ import annotations

import contextlib
import itertools
from enum import Enum

import torch

from ....config import Config
from ....engine.errors import UsageError
from ....engine import guards as _guards
from ....engine.external import register_external_parameter
from ....engine.store import _TORCH_DTYPES, PARAM16, ParamStore
from ....engine.user_param import engine_call

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType",
           "mark_zero_params", "register_external_parameter", "zero_stage"]


class ZeroParamType(Enum):
    """DeepSpeed's: how a parameter is held."""
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class ZeroParamStatus(Enum):
    """DeepSpeed's: whether a parameter's values are in its .data."""
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


# Note [DeepSpeed's ZeRO-3 attributes on tidal's parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A parameter tidal keeps in chunks is an empty placeholder outside forward,
# as a ZeRO-3 parameter is under DeepSpeed, at every ZeRO stage. DeepSpeed's
# ZeRO-3 (partition_parameters.py, Init._convert_to_deepspeed_param) marks
# each parameter it partitions with ds_shape and ds_numel (the whole
# parameter's), ds_id, ds_status, ds_param_type, ds_persist and ds_tensor (its
# rank's partition, None until partitioned), and scripts read them to count
# and to fetch: DeepSpeed-Chat and the SuperOffload fine-tune count
# `p.ds_numel if hasattr(p, "ds_tensor") else p.numel()`, transformers' and
# peft's counters take ds_numel where numel() is 0, and DeepSpeed-Chat's
# saving gathers the parameters with ds_id whose ds_status is NOT_AVAILABLE.
# DeepSpeed sets them under ZeRO stage 3 only, and scripts branch on
# `hasattr(p, "ds_id")` (DeepSpeed-Chat's LoRA fuse gathers with
# modifier_rank=0 only then; at stages 0-2 it writes `weight.data` directly),
# so tidal sets them where DeepSpeed does: on the parameters zero.Init builds
# (at its exit) and on those a tidal.deepspeed.initialize engine trains under
# a config with zero_optimization.stage 3 (at its start), not at stages 0-2,
# though tidal keeps every parameter in chunks at every stage. ds_shape/ds_numel
# its shape and element count, a ds_id of its own, ds_status NOT_AVAILABLE
# (the values come through GatheredParameters, even at the moments the
# parameter holds a view), ds_param_type PARTITIONED, ds_persist False, and
# ds_tensor None: there is no partition tensor to hand out (the values live in
# chunk slots; read them through GatheredParameters). A plain
# `sum(p.numel() ...)` counts the same (Note [A parameter object stays the
# user's] in tidal/engine/user_param.py), as does engine.num_parameters().
_ids = itertools.count()


def zero_stage(config) -> int:
    """The ZeRO stage of a tidal Config read from a DeepSpeed config (0 without
    a zero_optimization block; its deprecated true/false form is stage 1/0)."""
    z = config.raw.get("zero_optimization", {})
    if isinstance(z, bool):
        return int(z)
    return int(z.get("stage", 0)) if isinstance(z, dict) else 0


def mark_zero_params(records) -> None:
    """Sets Note [DeepSpeed's ZeRO-3 attributes on tidal's parameters] on the
    parameter of each ParamRecord in `records` (one marked already keeps its
    ds_id)."""
    for r in records:
        p = r.param
        if not hasattr(p, "ds_id"):
            p.ds_id = next(_ids)
        p.ds_shape = torch.Size(r.shape)
        p.ds_numel = r.numel
        p.ds_param_type = ZeroParamType.PARTITIONED
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        p.ds_persist = False
        p.ds_tensor = None


# Note [zero.Init and GatheredParameters over init_context]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeepSpeed's ZeRO-3 scripts build a large model under zero.Init(config), so no
# module's parameters are ever whole in memory, and reach a parameter's values
# in code that runs after its module's __init__ (weight init, tying, loading)
# through GatheredParameters(params, modifier_rank=0). tidal.init_context is
# zero.Init's counterpart: each module's parameters go into host chunks when
# its __init__ returns. GatheredParameters maps to ParamStore's
# materialized_params: inside it, each parameter this store holds has its
# values; with modifier_rank given (one process: rank 0 is this one) they are
# the fp32 master slot itself, so what the code writes is kept (the 16-bit
# slot follows at the exit); with modifier_rank None they are a copy in the
# parameter's dtype, and what the code writes is dropped, as DeepSpeed drops
# it. Once an engine trains the parameters (between steps), reading is a copy
# of what forward computes with (the 16-bit weight); with modifier_rank given
# it is a copy too, whose value goes into the chunks at the exit, as
# DeepSpeed copies the modifier's values into its partitions: the 16-bit slot
# takes it, and the fp32 master where the 16-bit value changed (so a script's
# init, `.data.copy_`, embedding rows or LoRA fuse is trained on from there;
# DeepSpeed's ZeRO-3 leaves its fp32 partitions as they were until
# refresh_fp32_params, and the next step starts from those). Between backward
# and step such a write is refused (the 16-bit slots hold the gradients), and
# so is one under data parallel (no broadcast of the modifier's values yet).
# Parameters no store holds are left as they are, as DeepSpeed leaves
# non-ZeRO ones.


class Init:
    """deepspeed.zero.Init: a tidal.init_context with DeepSpeed's arguments
    (Note [zero.Init and GatheredParameters over init_context]); the
    parameters built inside get DeepSpeed's ZeRO-3 attributes (Note
    [DeepSpeed's ZeRO-3 attributes on tidal's parameters])."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, **rest):
        for name, value in (("module", module), ("data_parallel_group", data_parallel_group),
                            ("mpu", mpu), *rest.items()):
            if value not in (None, False):
                raise UsageError(
                    f"tidal.deepspeed.zero.Init: {name}={value!r} is not supported: it builds "
                    f"new modules into chunks (an existing module: tidal.deepspeed.initialize "
                    f"puts it into chunks), in one process group")
        if remote_device not in (None, "none", "cpu"):
            raise UsageError(f"tidal.deepspeed.zero.Init: remote_device={remote_device!r}: tidal "
                             f"keeps chunks in host memory and on the device, not on NVMe")
        if config is not None and config_dict_or_path is not None:
            raise UsageError("tidal.deepspeed.zero.Init: both config and config_dict_or_path "
                             "(DeepSpeed's names for the same): pass one")
        self.config = Config.load(config if config is not None else config_dict_or_path)
        wanted = _TORCH_DTYPES[self.config.precision]
        if dtype is not None and dtype != wanted:
            raise UsageError(f"tidal.deepspeed.zero.Init: dtype={dtype} but the config trains in "
                             f"{self.config.precision} ({wanted}); the config's precision decides")
        self.enabled = enabled
        self._context = None

    def __enter__(self):
        if self.enabled:
            from ....engine.init_context import init_context
            self._context = init_context(self.config)
            self.store = self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self._context is not None:
            context, self._context = self._context, None
            swallowed = context.__exit__(*exc)
            if exc[0] is None:
                mark_zero_params(self.store.by_param.values())
            return swallowed
        return False


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """deepspeed.zero.GatheredParameters: inside, `params` (one or a list) hold
    their values (Note [zero.Init and GatheredParameters over init_context]).

    Args:
        params: parameters; None entries and parameters no store holds are skipped.
        modifier_rank: None: copies to read (writes dropped); a rank: the
            masters to write (only before an engine trains them).
        fwd_module: a module whose forward reads `params`: they are registered as
            its external parameters, as DeepSpeed registers them
            (tidal.register_external_parameter).
        enabled: False: nothing happens.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in (params or []) if p is not None]
    if enabled and fwd_module is not None:
        for p in params:
            register_external_parameter(fwd_module, p)
    with contextlib.ExitStack() as stack:
        for store, held in (_by_store(params) if enabled else {}).items():
            if modifier_rank is None:
                stack.enter_context(_copies(store, held))
            elif store not in ParamStore._unadopted:
                stack.enter_context(_written_back(store, held, modifier_rank))
            else:
                # (callbacks run last first: the 16-bit slots follow once the
                # masters are released)
                stack.callback(store.sync_param16)
                stack.enter_context(store.materialized_params(held))
        yield


@contextlib.contextmanager
def _written_back(store, params, modifier_rank):
    """Note [zero.Init and GatheredParameters over init_context], under an
    engine with modifier_rank: each parameter holds a copy of its 16-bit
    weight (its dtype, on the engine's device) while inside; at the exit, also
    when the block raised (DeepSpeed partitions the modifier's values on any
    exit), what the copies hold goes into the chunks: the 16-bit slot takes
    it, and the fp32 master where the 16-bit value changed
    (ParamStore.write_values)."""
    if store.dp is not None:
        raise UsageError(
            f"tidal.deepspeed.zero.GatheredParameters(..., modifier_rank={modifier_rank!r}) under "
            f"data parallel: tidal does not broadcast the modifier's writes yet; load the same "
            f"values on every rank with engine.load_state_dict({{name: tensor}}, strict=False)")
    engine = _engine_of(params)
    if engine is not None:
        engine.settle_overlap()  # (between backward and step: before the chunks are read)
    records = [store.by_param[id(p)] for p in params]
    holding = engine.holding_gradients(records) if engine is not None else []
    if holding:
        raise UsageError(
            f"tidal.deepspeed.zero.GatheredParameters(..., modifier_rank={modifier_rank!r}) "
            f"between backward and step: the 16-bit slots of {', '.join(holding[:4])}"
            f"{' ...' if len(holding) > 4 else ''} hold their gradients, and a write there would "
            f"be lost; write after engine.step() (or engine.zero_grad())")
    done = []
    try:
        # (The copies are the engine's work; the block's body is the user's.)
        with torch.no_grad(), engine_call():
            for p, r in zip(params, records):
                old = p.data
                if old.numel() == 0:
                    value = store.gather(r, PARAM16).to(store.torch_device, p.dtype)
                else:  # (read outside a forward: its data is a view of its 16-bit slot)
                    value = old.clone()
                p.data = value
                done.append((p, r, old))
        yield
    finally:
        with engine_call():
            writes = []
            for p, r, old in reversed(done):
                value = p.data
                p.data = old
                writes.append((r, value, old if old.numel() != 0 else None))
            store.write_values(reversed(writes))
        # (Assigning the copies and back bumped the version counts: the
        # engine's record of user writes takes them as they are now.)
        if engine is not None:
            engine.forget_writes([r for _, r, _ in done])


def _engine_of(params):
    """The engine that trains `params` (a store has one at most), asked here:
    the store holds no reference up to it."""
    return next((e for e in (_guards.engine_of(p, collect=False) for p in params) if e is not None), None)


def _by_store(params) -> dict:
    out: dict = {}
    seen = set()
    for p in params:
        store = ParamStore.owning([p])
        if store is not None and id(p) not in seen:  # (DeepSpeed drops duplicates too)
            seen.add(id(p))
            out.setdefault(store, []).append(p)
    return out


@contextlib.contextmanager
def _copies(store, params):
    """Each parameter holds a copy of its values (its dtype, its device) while
    inside; what is written to them is dropped at the exit, where each gets back
    the data it had (a placeholder; or, under an engine between steps, or an
    enclosing context, a view of its slot)."""
    done = []
    engine = _engine_of(params)
    if engine is not None:
        # Between backward and step: the CPU Adam updates made during backward
        # are waited for and taken back before the chunks are read (Note
        # [Speculative updates and their undo] in overlap.py).
        engine.settle_overlap()
    try:
        with engine_call():  # (the copies are the engine's work; the block's body is the user's)
            for p in params:
                old = p.data
                if p.numel() == 0:
                    p.data = store.gather(store.by_param[id(p)]).to(p.dtype)
                else:
                    p.data = old.clone()
                done.append((p, old))
        yield
    finally:
        with engine_call():
            for p, old in reversed(done):
                p.data = old
        # (A write to a copy bumped its parameter's version count: dropped, as
        # DeepSpeed drops it, not a write the engine must keep or name.)
        # The engine takes these parameters' version counts as they are now
        # (Note [Writes to a parameter] in hooks/module_hooks.cpp).
        if engine is not None:
            engine.forget_writes([store.by_param[id(p)] for p, _ in done])
