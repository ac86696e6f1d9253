"""A parameter a script holds reads and writes as its value between steps.

Note [A parameter object stays the user's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Between its module's forward calls a parameter tidal trains holds an empty
placeholder (its values live in the chunks). A read through its module's
attribute brings it in (ParameterReads, Note [External parameters] in
external.py), but a script also reaches parameters as objects it holds:
`model.parameters()` (Hugging Face's num_parameters(), a global norm, an EMA
over `named_parameters()`), a list made before training, `p.data.mul_(...)`.
On the placeholder those read 0 elements and write nothing, silently.

So each parameter an engine trains gets a class of its own for as long as the
engine trains it: a subclass of its class (nn.Parameter, or the subclass it
had) with a `__torch_function__`, which torch calls for every torch function
and Tensor method or property that gets the parameter. Outside a forward and a
backward, called from code that is not tidal's own, on a placeholder:
  * its shape (numel, size, shape, dim, ndim, len, nelement, is_contiguous)
    is answered from the parameter's record, nothing moves;
  * what needs no values (dtype, device, requires_grad, grad, hooks, hashing,
    `p.data = t`, which the engine sees by itself) runs on the placeholder;
  * anything else (values, `.data`, in-place writes, views) first brings the
    parameter in, as a read through the attribute does: its 16-bit weight on
    the device, written back to the chunks where the engine takes the weights
    back (Note [Writes to a parameter] in hooks/module_hooks.cpp), so a read
    gives the value and a write is kept. Parameters read this way make room
    for each other, oldest first, when the device is full (not those the same
    call needs): a held parameter that went back reads again on its next use.
Inside a forward or a backward, inside one of the engine's own calls (its
step, checkpoints, state dicts: `engine_call`, a thread-local count set at the
engine's entry points, never a look at the caller's stack frame) and while the
engine reads or writes a state dict (torch's Module.state_dict /
load_state_dict work on the placeholders, and the engine's hooks fill in the
values), the parameter is an ordinary one; while the root module's forward
runs it even has its own class back (Note [Plain classes inside a forward]),
so a torch call there costs what it does in plain PyTorch. The class goes
when the engine gives the model back (remove_hooks).

Fail closed (Note [Parameters fail closed]): what needs no values and that a
placeholder answers right (dtype, device, flags, hooks, hashing) is the only
thing that runs on the placeholder; the size of its data (`nbytes`) is the
record's; its storage, its data pointer and `==` bring the parameter in
first; pickling, torch.save and copies (copy.copy, deepcopy) make a parameter
of its own class holding a copy of its values (never a view of a slot, whose
memory another parameter reuses once it goes back). The engine's subclass is
importable by name (pickle finds TidalParameter in this module). What tidal
cannot make exact is a `tidal.UsageError` naming the parameter, the
operation and the way that works:
  * setting `requires_grad` on a parameter frozen at tidal.initialize (it
    has no fp32 master nor Adam states in the chunks);
  * nn.Parameter(p) (guards.py: plain PyTorch's would share p's memory);
  * the parameter registered into a parametrization (torch's
    register_parametrization after tidal.initialize; guards.py).
`p.grad` (read or set) between a backward and the step is the gradient
waiting in the chunks (Note [Gradients between backward and step] in
user_grads.py), refused by name only where it cannot be exact.

`p.set_(...)` (torch calls no __torch_function__ for it; the class's own
method) is a `tidal.UsageError` too, outside the engine's own calls: the
parameter's memory is a slot of a chunk, and it cannot take another tensor's.
Not covered: `torch.Tensor.set_(p, t)` called on the base class. A
tensor taken from a parameter and held (`d = p.data`, `v = p.detach()`) past
the next forward or step aliases the 16-bit slot of that moment; once the parameter goes back to its chunks there it is not the
parameter's any more (read it again, or clone). Between steps a held one keeps
its parameter on the device (Note [Parameters fail closed]).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch

from .errors import UsageError
from .external import _HARMLESS, _tensors

__all__ = ["ForwardClasses", "engine_call", "engine_entry", "install", "uninstall"]

# Note [Parameters fail closed]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# How tidal tells "the user's use of a parameter" from its own, and why this
# interception (issue 53; docs/parameters.md has the table, one test a row):
#  * torch's UninitializedParameter fails closed: its __torch_function__ lets
#    a short list of functions through and raises for everything else. A
#    parameter tidal trains does the same, with "bring it in" in place of
#    "raise" where that is exact, and a tidal error where it is not. The
#    list of what runs on the placeholder is short (metadata a placeholder
#    has right); size, storage and values are never answered by it.
#  * Whose call it is, is an engine state: the hooks' own (a forward
#    running, autograd's graph task, a state dict being read or written)
#    and a thread-local count set by the engine's entry points (engine_call,
#    engine_entry). A stack-frame test sees only the direct caller: a torch
#    helper called by tidal, or tidal code called by a torch helper, was
#    judged wrong either way.
#  * DeepSpeed ZeRO-3 refuses nothing: a partitioned parameter reads as an
#    empty tensor outside GatheredParameters, and gradients are read with
#    safe_get_full_grad. FSDP2 keeps a tensor subclass and unshards
#    explicitly. Both ask the script to change; tidal keeps the script and
#    refuses by name what it cannot make exact.
#  * A tensor taken from a parameter brought in (a view, `.data`, a storage
#    torch.save holds until it writes) keeps the parameter's memory in use:
#    a read that needs room never sends such a parameter back to its chunks
#    (OutsideAccess._room_for_outside_read); it is an OutOfMemoryError
#    saying so, not a view of memory another parameter reuses.
_STATE = threading.local()


@contextlib.contextmanager
def engine_call():
    """On this thread, the engine's own work: its parameters are ordinary
    ones (Note [Parameters fail closed])."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1
        note_write()


def engine_entry(method):
    """An engine method that is an entry point: runs under engine_call()."""
    @functools.wraps(method)
    def entry(*args, **kwargs):
        note_write()
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        try:
            return method(*args, **kwargs)
        finally:
            _STATE.depth -= 1
            note_write()
    return entry


# Note [Writes into a state dict] (state_dict_bridge.py): a count raised
# wherever a parameter's value may change (a use of a parameter by user code,
# the engine's entry points, a load, a write through an entry), so that an
# entry of model.state_dict() reads its parameter again only where it may
# have changed since it last did.
_EPOCH = [0]


def note_write() -> None:
    _EPOCH[0] += 1


def epoch() -> int:
    return _EPOCH[0]


# The state dict entries' class and their sync before / push after a torch
# function (state_dict_bridge.py sets them: connect_state_dicts).
_ENTRY_TYPE = None
_sync_entries = None
_push_entries = None


def connect_state_dicts(entry_type, sync, push) -> None:
    global _ENTRY_TYPE, _sync_entries, _push_entries
    _ENTRY_TYPE, _sync_entries, _push_entries = entry_type, sync, push


def _in_engine_call() -> bool:
    return getattr(_STATE, "depth", 0) > 0



# id(param) -> (engine weakref, record index) for every parameter a live engine trains.
_OWNED: dict = {}
# original class -> its tidal subclass
_CLASSES: dict = {}
_SUBCLASSES: set = set()  # the values of _CLASSES


def _shape_answers():
    t = torch.Tensor

    def size(p, shape, dim=None):
        return shape if dim is None else shape[dim]

    return {
        t.numel: lambda p, shape, *a, **k: shape.numel(),
        t.nelement: lambda p, shape, *a, **k: shape.numel(),
        torch.numel: lambda p, shape, *a, **k: shape.numel(),
        t.size: size,
        t.shape.__get__: lambda p, shape, *a, **k: shape,
        t.dim: lambda p, shape, *a, **k: len(shape),
        t.ndimension: lambda p, shape, *a, **k: len(shape),
        t.ndim.__get__: lambda p, shape, *a, **k: len(shape),
        t.__len__: lambda p, shape, *a, **k: _len(shape),
        t.is_contiguous: lambda p, shape, *a, **k: True,
        t.nbytes.__get__: lambda p, shape, *a, **k: shape.numel() * p.element_size(),
    }


def _len(shape):
    if len(shape) == 0:
        raise TypeError("len() of a 0-d tensor")
    return shape[0]


def _passing():
    """Functions that need no values: run on the placeholder as they are."""
    t = torch.Tensor
    # (Not `==`, the storage, the data pointer, pickling nor deep copies: a
    # placeholder answers them wrong. Note [Parameters fail closed].)
    extra = [t.data.__set__, t.register_hook, t.__setstate__, t.element_size, t.itemsize.__get__]
    checked = {t.__eq__, t.grad.__get__, t.grad.__set__, t.requires_grad.__set__, t.requires_grad_}
    return (frozenset(_HARMLESS) - checked) | frozenset(f for f in extra if f is not None)


_SHAPE = _shape_answers()
_PASS = _passing()


def _owner(p):
    """(engine, record index) of the live engine training parameter `p`, or None."""
    hit = _OWNED.get(id(p))
    if hit is None:
        return None
    engine = hit[0]()
    if engine is None or engine._params.record_list[hit[1]].param is not p:
        return None
    return engine, hit[1]


# What a check answers where torch's own function is to run (on the placeholder).
_GO_ON = object()


def _grad(args, kwargs, func):
    """`p.grad` read by the user: between a backward and the step, the
    gradient that waits in the chunks (Note [Gradients between backward and
    step] in user_grads.py)."""
    hit = _owner(args[0])
    if hit is None:
        return _GO_ON
    engine, i = hit
    if not engine._outside.serves_user_reads():
        return _GO_ON
    got = engine._outside.grads.read(i)
    return _GO_ON if got is None else got


def _grad_set(args, kwargs, func):
    """`p.grad = value` by the user: between a backward and the step, the
    gradient the step uses, or none (Note [Gradients between backward and
    step] in user_grads.py)."""
    hit = _owner(args[0])
    if hit is None:
        return _GO_ON
    engine, i = hit
    if not engine._outside.serves_user_reads():
        return _GO_ON
    return None if engine._outside.grads.write(i, args[1]) else _GO_ON


def _unfreeze(args, kwargs, func):
    """`p.requires_grad = True` / `p.requires_grad_()` on a parameter frozen
    at tidal.initialize (Note [Parameters fail closed])."""
    hit = _owner(args[0])
    if hit is None:
        return _GO_ON
    if func == torch.Tensor.requires_grad_:
        on = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    else:
        on = args[1]
    engine, i = hit
    record = engine._params.record_list[i]
    if not on or record.trainable:
        return _GO_ON
    raise UsageError(
        f"tidal: requires_grad set on '{record.name}', which was frozen at tidal.initialize: "
        f"tidal keeps no fp32 master nor Adam states for it in its chunks, so it would never train "
        f"(its gradients would pile up unused); it stays frozen. Ways that work: unfreeze it "
        f"before tidal.initialize; to change what trains during a run, start a new engine: "
        f"new_model.load_state_dict(engine.state_dict()), unfreeze, tidal.initialize(new_model, "
        f"config)")


def _deepcopy(p, memo):
    """copy.deepcopy of a parameter an engine trains: a parameter of its own
    class (not the engine's subclass) holding a copy of its values (`p.data`
    brings them in)."""
    if id(p) in memo:
        return memo[id(p)]
    base = type(p).__bases__[0]
    if _owner(p) is None or _in_engine_call():
        return base.__deepcopy__(p, memo)
    out = base(p.data.clone(memory_format=torch.preserve_format), p.requires_grad)
    memo[id(p)] = out
    return out


def _reduce_ex(p, proto):
    """Pickling, torch.save and copy.copy of a parameter an engine trains:
    they rebuild a parameter of its own class (not the engine's subclass)
    holding a copy of its values, never the placeholder nor a view of a
    chunk's slot (the slot's memory goes to another parameter once it goes
    back: plain PyTorch's copy.copy shares the memory, tidal's cannot)."""
    base = type(p).__bases__[0]
    if _owner(p) is None or _in_engine_call():
        return base.__reduce_ex__(p, proto)
    out = base(p.data.clone(memory_format=torch.preserve_format), p.requires_grad)
    return out.__reduce_ex__(proto)


def _set_(p, *args, **kwargs):
    """`p.set_(...)` of a parameter an engine trains, outside the engine's
    own calls: refused by name (Note [Parameters fail closed]); torch calls
    no __torch_function__ for set_, so the class has the method."""
    base = type(p).__bases__[0]
    hit = _owner(p)
    if hit is None or _in_engine_call():
        return base.set_(p, *args, **kwargs)
    engine, i = hit
    name = engine._params.record_list[i].name
    raise UsageError(
        f"tidal: set_() on '{name}', a parameter the engine trains: its memory is a slot of a "
        f"chunk, which moves between host and device, so it cannot take another tensor's "
        f"storage; plain PyTorch would make it share that storage, tidal cannot and does not. "
        f"Ways that work: copy the values in (`with torch.no_grad(): p.copy_(t)`, kept exactly), "
        f"or change the model before tidal.initialize (torch.nn.utils.parametrize calls set_() "
        f"when it registers a parametrization: register parametrizations before tidal.initialize)")


def _state_dict_entries(args, kwargs) -> list:
    """Before a torch function a parameter an engine trains gets (Note
    [Writes into a state dict] in state_dict_bridge.py): writes into that
    parameter's state dict entries not yet taken go into it, and entries
    among the arguments hold their parameters' values; returns what
    _push_entries looks at after the function."""
    entries = False
    for a in _tensors(args, kwargs):
        if type(a) is _ENTRY_TYPE:
            entries = True
            continue
        hit = _OWNED.get(id(a))
        if hit is None:
            continue
        engine = hit[0]()
        if engine is None or engine._params.record_list[hit[1]].param is not a:
            continue
        bridge = engine._state_dict_bridge
        if (bridge.copies or bridge.dropped_writes) and bridge.syncs():
            bridge.flush(hit[1])
    return _sync_entries(args, kwargs) if entries else []


def _placeholders(args, kwargs):
    """(engine, [(parameter, index)]) of the engine's parameters among the
    arguments that hold their placeholder now and that the engine would serve
    as a user's read; None when there is none (or it is not such a moment).
    Called with torch functions of subclasses disabled."""
    found = None
    for a in _tensors(args, kwargs):
        hit = _OWNED.get(id(a))
        if hit is None:
            continue
        engine = hit[0]()
        if engine is None or a.numel() != 0 or engine._params.record_list[hit[1]].param is not a:
            continue
        if found is None:
            if not engine._outside.serves_user_reads():
                return None
            found = (engine, [])
        elif found[0] is not engine:
            continue
        found[1].append((a, hit[1]))
    return found


class _UserParameter:
    """The __torch_function__ of the classes install() gives (Note [A parameter
    object stays the user's])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(_STATE, "depth", 0):
                return func(*args, **kwargs)
            _EPOCH[0] += 1  # (a use that may write it: Note [Writes into a state dict])
            if func in _PASS:
                return func(*args, **kwargs)
            check = _CHECKED.get(func)
            if check is not None:
                out = check(args, kwargs, func)
                return func(*args, **kwargs) if out is _GO_ON else out
            # Entries of model.state_dict() among the arguments, and writes
            # into the parameters' entries through their views, first (Note
            # [Writes into a state dict] in state_dict_bridge.py).
            tracked = _state_dict_entries(args, kwargs)
            # (Inside a forward the parameters are attached: the placeholder
            # test is the cheapest way out.)
            found = _placeholders(args, kwargs)
            if found is not None:
                engine, held = found
                answer = _SHAPE.get(func)
                if answer is not None and len(held) == 1 and args and args[0] is held[0][0]:
                    record = engine._params.record_list[held[0][1]]
                    return answer(args[0], torch.Size(record.shape), *args[1:], **kwargs)
                engine._outside.read_for_user([i for _, i in held])
            out = func(*args, **kwargs)
            if tracked:
                _push_entries(tracked)
            return out


# Note [Hooks after a gradient accumulates]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch calls a parameter's post-accumulate-grad hooks in the order they were
# registered, with `p.grad` the gradient accumulated. The engine's own hook
# (registered at tidal.initialize) lands that gradient in the parameter's
# 16-bit slot and sets `p.grad` to None, so a hook registered after it found
# None (a hook guarded by `if p.grad is not None` did nothing, silently).
# A hook registered before tidal.initialize already ran before the engine's,
# with `p.grad` the parameter's gradient of this backward. So a hook
# registered on a trained parameter after tidal.initialize goes before the
# engine's hooks in the parameter's ordered dict of hooks: it sees `p.grad` as
# plain PyTorch shows it there, and what it writes into `p.grad` is what lands
# (what the step uses). Where `p.grad` of one backward is not plain PyTorch's
# there, a tidal.UsageError names the parameter, at the registration where the
# config says so (fp16: the gradient of the scaled loss; data parallel: the
# rank's own gradient; gradient_accumulation_steps > 1: plain PyTorch's is the
# window's sum, which tidal keeps in its chunks), and in the backward where a
# gradient lands twice in one step (the hook would see only the second part).
# A hook that sets `p.grad` to None (an optimizer step inside backward) is a
# UsageError too: the engine's step is what trains the parameter. Hooks
# registered before tidal.initialize are checked the same way when they run.
def _hook_refusal(engine) -> str:
    """Why `p.grad` inside a post-accumulate-grad hook cannot be plain
    PyTorch's under `engine`'s config, or ""."""
    if engine.precision == "fp16":
        return ("the engine trains in fp16, where the gradient a backward accumulates is that of "
                "the loss times the loss scale")
    if engine.dp is not None:
        return ("the engine trains data-parallel, where a backward's gradient is the rank's own "
                "until the reduction")
    if engine._accumulation.summing:
        return ("with gradient_accumulation_steps > 1 plain PyTorch's `p.grad` there is the "
                "window's sum so far, which tidal keeps in its chunks, not in `p.grad`")
    return ""


def _hook_error(name: str, why: str) -> UsageError:
    return UsageError(
        f"tidal: a post-accumulate-grad hook on '{name}' (register_post_accumulate_grad_hook): "
        f"{why}, so `p.grad` inside the hook would not be the gradient plain PyTorch shows there. "
        f"Ways that work: p.register_hook(fn) (called with the gradient of each backward, as "
        f"plain PyTorch's); or read and edit p.grad between engine.backward(loss) and "
        f"engine.step() (the step uses what the script leaves there; docs/parameters.md)")


def _checked_hook(engine_ref, i: int, name: str, fn):
    """`fn` as a post-accumulate-grad hook on parameter `i` of the engine
    (Note [Hooks after a gradient accumulates])."""
    def hook(p):
        engine = engine_ref()
        if engine is None or not _is_owned(p, engine, i):
            return fn(p)
        why = _hook_refusal(engine)
        if not why and engine._wiring.hooks.landed(i):
            why = ("its gradient lands a second time in this step (its slot holds the first "
                   "part already)")
        if why:
            raise _hook_error(name, why)
        had = p.grad is not None
        out = fn(p)
        if had and p.grad is None:
            raise UsageError(
                f"tidal: a post-accumulate-grad hook on '{name}' set its `p.grad` to None (an "
                f"optimizer step inside backward?): the engine's step is what trains the "
                f"parameter, from the gradient that lands after the hook. Ways that work: leave "
                f"`p.grad` (edit it in place, or set it to a tensor of its shape); to leave the "
                f"parameter out of a step, set `p.grad = None` between engine.backward(loss) and "
                f"engine.step()")
        return out
    hook._tidal_hook_of = fn  # (the user's own: another engine wraps it again)
    return hook


def _is_owned(p, engine, i) -> bool:
    hit = _OWNED.get(id(p))
    return hit is not None and hit[0]() is engine and hit[1] == i


def _post_accumulate_hook(args, kwargs, func):
    """`p.register_post_accumulate_grad_hook(fn)` by user code on a
    parameter an engine trains (Note [Hooks after a gradient accumulates])."""
    p = args[0]
    hit = _owner(p)
    if hit is None:
        return _GO_ON
    engine, i = hit
    record = engine._params.record_list[i]
    why = _hook_refusal(engine)
    if why:
        raise _hook_error(record.name, why)
    fn = args[1] if len(args) > 1 else kwargs["hook"]
    handle = func(p, _checked_hook(weakref.ref(engine), i, record.name, fn))
    # Before the engine's landing: torch's C++ side walks the dict in its
    # insertion order (not an OrderedDict's own), so the entries go in again.
    hooks = p._post_accumulate_grad_hooks
    rest = [(k, v) for k, v in hooks.items() if k != handle.id]
    mine = hooks[handle.id]
    hooks.clear()
    hooks[handle.id] = mine
    hooks.update(rest)
    return handle


def _check_hooks_of(engine) -> None:
    """Hooks registered before tidal.initialize (they run before the
    engine's): checked when they run (Note [Hooks after a gradient
    accumulates])."""
    own = {getattr(h, "id", None) for h in engine._wiring.handles}
    ref = weakref.ref(engine)
    for i, record in enumerate(engine._params.record_list):
        hooks = getattr(record.param, "_post_accumulate_grad_hooks", None)
        if not hooks:
            continue
        for key, fn in list(hooks.items()):
            if key not in own:
                fn = getattr(fn, "_tidal_hook_of", fn)
                hooks[key] = _checked_hook(ref, i, record.name, fn)


# (A property's __get__ / __set__ is a new method-wrapper at each access: equal
# and hashed alike, never identical.)
_CHECKED = {torch.Tensor.grad.__get__: _grad,
            torch.Tensor.grad.__set__: _grad_set,
            torch.Tensor.requires_grad.__set__: _unfreeze,
            torch.Tensor.requires_grad_: _unfreeze,
            torch.Tensor.register_post_accumulate_grad_hook: _post_accumulate_hook}


def _class_name(cls) -> str:
    """The name of `cls`'s tidal subclass in this module: unique per class,
    the same in every process (pickle finds a class by its module and name)."""
    if cls is torch.nn.Parameter:
        return "TidalParameter"
    path = f"{cls.__module__}.{cls.__qualname__}"
    return "Tidal_" + "".join(c if c.isalnum() else "_" for c in path)


def _class_for(cls):
    sub = _CLASSES.get(cls)
    if sub is None:
        name = _class_name(cls)
        sub = type(name, (cls,), {
            "__torch_function__": _UserParameter.__dict__["__torch_function__"],
            "__deepcopy__": _deepcopy,
            "__reduce_ex__": _reduce_ex,
            "set_": _set_,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"A {cls.__name__} that a tidal engine trains (Note [A parameter object "
                       f"stays the user's] in tidal/engine/user_param.py).",
        })
        _CLASSES[cls] = sub
        _SUBCLASSES.add(sub)
        globals()[name] = sub
    return sub


def __getattr__(name: str):
    """The tidal subclass of a Parameter class by its name (pickle, in a
    process where no engine has made it yet)."""
    if name.startswith("Tidal"):
        todo = [torch.nn.Parameter]
        while todo:
            cls = todo.pop()
            if cls not in _SUBCLASSES:
                if _class_name(cls) == name:
                    return _class_for(cls)
                todo.extend(cls.__subclasses__())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_class_for(torch.nn.Parameter)  # (TidalParameter: importable as any class)


def install(engine) -> None:
    """The engine's parameters get their tidal class (Note [A parameter object
    stays the user's])."""
    ref = weakref.ref(engine)
    for i, record in enumerate(engine._params.record_list):
        p = record.param
        cls = type(p)
        if cls not in _SUBCLASSES:
            try:
                p.__class__ = _class_for(cls)
            except TypeError:
                continue  # (a class whose layout differs: left as it is)
        _OWNED[id(p)] = (ref, i)
    _check_hooks_of(engine)
    weakref.finalize(engine, _forget, [id(r.param) for r in engine._params.record_list], ref)


def uninstall(engine) -> None:
    """The parameters get their own classes back."""
    for record in engine._params.record_list:
        p = record.param
        hit = _OWNED.get(id(p))
        if hit is not None and hit[0]() is engine:
            del _OWNED[id(p)]
            base = type(p).__bases__[0]
            if type(p) in _SUBCLASSES:
                p.__class__ = base


# Note [Plain classes inside a forward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inside a forward the engine's parameters are attached and the hooks are
# running, so the __torch_function__ finds nothing to do; but torch calls it
# for every function that gets a parameter, and that Python call alone cost
# +17.6 us (best) per F.linear over plain nn.Parameter objects
# (benchmarks/results/user_param_overhead-cpu-2c.json before this; issue 53
# asks for <= 1 us). So while the root module's forward runs, the trainable
# parameters have their own classes back (HookWiring.root_pre / root_post,
# the post-hook always called, a forward that raises included): inside a
# forward a parameter is an ordinary one, `type(p) is nn.Parameter`, and a
# torch call costs what it costs in plain PyTorch. What that gives up, only
# inside a forward: `p.set_(t)` by the model's own code is not refused
# (outside a forward it is); a frozen parameter keeps its tidal class, so
# unfreezing it is refused everywhere. A recompute inside backward (a
# checkpointed segment) runs its modules' forwards without the root's hooks:
# there the class stays, which changes nothing but the cost.
class ForwardClasses:
    """Swaps the trainable parameters of `params` (a ParamTable) to their own
    classes while the root's forward runs (Note [Plain classes inside a
    forward]). Nested forwards of the root swap once."""

    def __init__(self, params):
        self._params = params
        self._depth = 0
        self._swapped: list = []

    def enter(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        subclasses = _SUBCLASSES
        swapped = []
        for record in self._params.record_list:
            p = record.param
            cls = type(p)
            if record.trainable and cls in subclasses:
                p.__class__ = cls.__bases__[0]
                swapped.append(p)
        self._swapped = swapped

    def leave(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        swapped, self._swapped = self._swapped, []
        for p in swapped:
            if id(p) in _OWNED:  # (not given back by remove_hooks meanwhile)
                p.__class__ = _CLASSES[type(p)]


def _forget(ids, ref) -> None:
    for k in ids:
        hit = _OWNED.get(k)
        if hit is not None and hit[0] is ref:
            del _OWNED[k]
