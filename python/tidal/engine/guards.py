"""Live engines, and the torch APIs that would do nothing to their parameters.

Note [Torch APIs that see no gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A gradient that lands goes into its parameter's 16-bit slot in a chunk and
param.grad is set to None (Note [One call per hook] in hooks/module_hooks.h).
User code that reads `p.grad` between backward and step is served the
waiting gradient (torch.nn.utils.clip_grad_norm_ however imported included:
Note [Gradients between backward and step] in user_grads.py). A torch
optimizer over the engine's parameters would still step nothing (its step is
not the engine's, and it would keep its own Adam states beside the chunks'):
while an engine lives, every torch.optim.Optimizer step passes a global step
pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook) that looks
its parameters up among the live engines' (the verdict is kept per optimizer
and its group sizes, so an unrelated optimizer pays one lookup per step) and
refuses one over them with a UsageError naming the parameter and the config
block to use. nn.Parameter(p) of a trained p is refused likewise.
Installed when an engine is made, and taken out again when the last live
engine is given back (remove_hooks, which unregisters it) or collected:
nothing of tidal's stays in torch for plain PyTorch code after it.
"""
from __future__ import annotations

import functools
import gc
import threading
import weakref

import torch

from .errors import UsageError

__all__ = ["engine_of", "guard_conversions", "inside_module_apply", "install", "register",
           "unguard_conversions"]

_LIVE: "weakref.WeakSet" = weakref.WeakSet()
_installed = None  # while installed: ([torch's hook handles], [(module, name, torch's function)])
_verdicts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register(engine) -> None:
    install()
    _LIVE.add(engine)
    weakref.finalize(engine, _uninstall_if_idle).atexit = False


def unregister(engine) -> None:
    """The engine no longer trains its model (remove_hooks): its parameters
    are plain PyTorch's again; the last one out takes the guards out of torch."""
    _LIVE.discard(engine)
    _uninstall_if_idle()


def _uninstall_if_idle() -> None:
    global _installed
    if _installed is None or any(True for _ in _LIVE):
        return
    handles, wrapped = _installed
    _installed = None
    for handle in handles:
        handle.remove()
    for module, name, original in wrapped:
        if getattr(getattr(module, name, None), "__wrapped_by_tidal__", False):
            setattr(module, name, original)
    _verdicts.clear()


def _record_of(p):
    """(engine, record) of the live engine that trains parameter `p`, or None."""
    for engine in list(_LIVE):
        r = engine._record_of_param(p)
        if r is not None:
            return engine, r
    return None


def engine_of(p, collect: bool = True):
    """The live engine that trains parameter `p`, or None. An engine the user
    dropped may wait in a reference cycle: with `collect`, one collection is
    run before answering yes."""
    hit = _record_of(p)
    if hit is not None and collect:
        gc.collect()
        hit = _record_of(p)
    return None if hit is None else hit[0]


def install() -> None:
    global _installed
    if _installed is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.nn.modules.module import (register_module_module_registration_hook,
                                         register_module_parameter_registration_hook)
    handles = [register_optimizer_step_pre_hook(_optimizer_step),
               register_module_parameter_registration_hook(_parameter_registered),
               register_module_module_registration_hook(_module_registered)]
    wrapped = []
    # register_parametrization where torch.nn.utils.parametrize holds it
    # (parametrizations.orthogonal and the others call it there): refused
    # before torch's right_inverse writes the parameter; the registration
    # hook above refuses the other ways of calling it, later.
    import torch.nn.utils.parametrize as parametrize
    original = parametrize.register_parametrization
    setattr(parametrize, "register_parametrization", _parametrization_guard(original))
    wrapped.append((parametrize, "register_parametrization", original))
    # nn.Parameter(p) of a parameter an engine trains (Note [Parameters fail
    # closed] in user_param.py).
    original_new = torch.nn.Parameter.__dict__["__new__"]
    torch.nn.Parameter.__new__ = staticmethod(_parameter_guard(original_new.__func__))
    wrapped.append((torch.nn.Parameter, "__new__", original_new))
    _installed = (handles, wrapped)


def _managed(params):
    """The (engine, record) of the first trainable parameter of `params` a live
    engine trains, or None."""
    if not _LIVE:
        return None
    for p in params:
        if isinstance(p, torch.Tensor):
            hit = _record_of(p)
            if hit is not None and hit[1].trainable:
                return hit
    return None


def _optimizer_step(optimizer, args, kwargs):
    if not _LIVE or getattr(optimizer, "_tidal_engine_optimizer", False):
        return
    shape = tuple(len(g["params"]) for g in optimizer.param_groups)
    seen = _verdicts.get(optimizer)
    if seen is not None and seen[0] == shape and seen[1] is None:
        return
    hit = _managed(p for g in optimizer.param_groups for p in g["params"])
    _verdicts[optimizer] = (shape, None if hit is None else True)
    if hit is None:
        return
    _, record = hit
    raise UsageError(
        f"{type(optimizer).__module__}.{type(optimizer).__name__}.step() would update parameters "
        f"that tidal trains (e.g. '{record.name}'): tidal keeps their gradients in its chunks "
        f"until engine.step() and param.grad stays None, so this step would change nothing. "
        f"engine.step() updates them with the optimizer of the config's \"optimizer\" block "
        f"(as DeepSpeed's engine.step() uses the config's optimizer); give a torch optimizer "
        f"only parameters outside the model passed to tidal.initialize")


def _parametrization_refusal(name: str) -> UsageError:
    return UsageError(
        f"torch.nn.utils.parametrize.register_parametrization on '{name}', a parameter tidal "
        f"trains (also through parametrizations.orthogonal, spectral_norm, weight_norm): the "
        f"parametrization would hold the parameter in a module tidal has not hooked and write "
        f"its values past the chunks. Register parametrizations before tidal.initialize (tidal "
        f"then trains the parametrization's own parameters); the layer keeps its parameter")


def _parametrization_guard(original):
    @functools.wraps(original)
    def guarded(module, tensor_name, *args, **kwargs):
        if _LIVE and isinstance(module, torch.nn.Module):
            param = module._parameters.get(tensor_name)
            hit = _record_of(param) if isinstance(param, torch.nn.Parameter) else None
            if hit is not None:
                raise _parametrization_refusal(hit[1].name)
        return original(module, tensor_name, *args, **kwargs)

    guarded.__wrapped_by_tidal__ = True
    return guarded


def _parameter_registered(module, name, param):
    """torch's global parameter registration hook: a parameter an engine
    trains registered into a parametrization (register_parametrization after
    tidal.initialize, by a script that imported the function itself before
    tidal wrapped it) is refused before torch's registration finishes, so
    the module keeps its parameter; a right_inverse returning a new tensor
    has set_ it into the parameter by then (Note [Parameters fail closed]
    in user_param.py)."""
    if not _LIVE or not isinstance(param, torch.nn.Parameter):
        return None
    from torch.nn.utils.parametrize import ParametrizationList
    if isinstance(module, ParametrizationList):
        hit = _record_of(param)
        if hit is None:
            return None
        raise _parametrization_refusal(hit[1].name)
    engine = _engine_of_module(module)
    if engine is None or module._parameters.get(name) is param:
        return None
    old = module._parameters.get(name)
    old_record = None if old is None else engine._record_of_param(old)
    record = engine._record_of_param(param)
    where = f"'{_path(engine, module, name)}'"
    if record is not None:
        raise UsageError(
            f"{where} set to the parameter tidal trains as '{record.name}' after tidal.initialize "
            f"(tying or moving a parameter): tidal laid out its chunks and hooks for the parameters "
            f"where they were at initialize. Tie or move parameters before tidal.initialize "
            f"(Note [Parameters registered after initialize])")
    raise UsageError(
        f"{where}: a parameter of shape {tuple(param.shape)} registered after tidal.initialize" +
        (f", replacing the one tidal trains as '{old_record.name}'" if old_record is not None else "") +
        ". tidal trains the parameters the model had at initialize, so this one would never be "
        "trained, and engine checkpoints would keep " +
        ("the replaced one's state" if old_record is not None else "no state of it") +
        ". Add or replace modules and parameters before tidal.initialize (or call "
        "engine.remove_hooks() and initialize again) (Note [Parameters registered after initialize])")


def _module_registered(module, name, submodule):
    """torch's global module registration hook (Note [Parameters registered
    after initialize]): a submodule put into the model an engine trains may
    hold only parameters the engine trains (a wrapper of its own modules);
    its modules then count as the model's, so a parameter registered into
    them later is refused too."""
    if not _LIVE or submodule is None:
        return None
    engine = _engine_of_module(module)
    if engine is None or module._modules.get(name) is submodule:
        return None
    for pname, p in submodule.named_parameters(remove_duplicate=False):
        if engine._record_of_param(p) is None:
            where = f"'{_path(engine, module, name)}'"
            raise UsageError(
                f"{where} set to a {type(submodule).__name__} with the parameter '{pname}' (shape "
                f"{tuple(p.shape)}) after tidal.initialize: tidal trains the parameters the model had "
                f"then, so it would never be trained, and engine checkpoints would keep no state of it. "
                f"Add or replace modules before tidal.initialize (or call engine.remove_hooks() and "
                f"initialize again) (Note [Parameters registered after initialize])")
    guard_conversions(submodule, engine)
    return None


def _path(engine, module, name: str) -> str:
    """`name` qualified by `module`'s path in the engine's model (an error
    message's; the model's root gives the name alone)."""
    for path, m in engine.module.named_modules(remove_duplicate=False):
        if m is module:
            return f"{path}.{name}" if path else name
    return f"{name} of a {type(module).__name__}"


def _engine_of_module(module):
    """The live engine whose model holds `module` (its conversions guarded
    at initialize: guard_conversions), or None."""
    f = module.__dict__.get("_apply")
    if not isinstance(f, functools.partial) or f.func is not _guarded_apply:
        return None
    engine = f.args[1]()
    return engine if engine is not None and engine in _LIVE else None


def _parameter_guard(original):
    @functools.wraps(original)
    def guarded(cls, data=None, requires_grad=True):
        if _LIVE and isinstance(data, torch.nn.Parameter):
            hit = _record_of(data)
            if hit is not None:
                raise UsageError(
                    f"torch.nn.Parameter(p) of '{hit[1].name}', a parameter tidal trains (as "
                    f"torch.nn.utils.parametrize.register_parametrization does): plain PyTorch's "
                    f"new Parameter shares p's memory, which under tidal is an empty placeholder "
                    f"or a slot of a chunk that moves, and the model would then hold a parameter "
                    f"tidal does not train. Register parametrizations (and make such parameters) "
                    f"before tidal.initialize; for a copy of the values, use p.detach().clone()")
        return original(cls, data, requires_grad)

    guarded.__wrapped_by_tidal__ = True
    return guarded


# Note [Parameters registered after initialize]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An engine trains the parameters its model had at tidal.initialize: their
# chunks, records and hooks are laid out then. A parameter put into the model
# later (a new head, `m.weight = nn.Parameter(...)`, register_parameter, a
# resized embedding, an adapter injected into a layer) was used by the
# forward and never trained, without a word, and engine.save_checkpoint kept
# the state of the parameter it replaced while model.state_dict() showed
# the new one; tying two weights after initialize (`lm_head.weight =
# wte.weight`) failed later in a shape error. So while an engine lives,
# torch's global parameter and module registration hooks refuse, with a
# UsageError naming the attribute, any parameter registered into one of its
# model's modules other than the one already there, and any submodule put
# into one holding a parameter the engine does not train. A submodule of
# the engine's own parameters (a wrapper around its layers) and one without
# parameters (an activation swapped) are let in, and count as the model's
# from then on. Removing a module or a parameter is not refused. Registered
# as the guards are: nothing of it stays in torch once no engine lives.
#
# Note [Conversions of a trained model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# nn.Module's conversions (to, cuda, cpu, half, float, double, bfloat16, type)
# all go through Module._apply(fn). On a model an engine trains they would
# convert the empty placeholders and the buffers and leave the weights in the
# chunks as they were: model.double() changed nothing the model computes with,
# without a word. The engine refuses them by name (Engine.to and the like);
# so does the model: each of its modules gets an _apply that tries `fn` on an
# empty tensor of each parameter's dtype and device, lets a conversion that
# changes neither through (model.to(its own device) is common in scripts) and
# refuses one that would, naming the dtype and device it asked for.
#
# Note [model.apply, as engine state]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# model.apply(init_fn) reads the model module by module; on a model larger
# than the device the parameters it read before go back to their chunks to
# make room (OutsideAccess.read_param). Whether a read is inside an apply is
# a thread-local count that each module's own `apply` (set on the instance
# beside its `_apply`, so a wrapping module's apply reaches it through its
# children) raises while it runs, not a look for Module.apply's frame on the
# stack; it goes with the model's guards.
_APPLYING = threading.local()


def inside_module_apply() -> bool:
    """Whether an apply of a module an engine trains is running on this thread."""
    return getattr(_APPLYING, "depth", 0) > 0


def _counted_apply(module, fn):
    _APPLYING.depth = getattr(_APPLYING, "depth", 0) + 1
    try:
        return type(module).apply(module, fn)
    finally:
        _APPLYING.depth -= 1


def guard_conversions(model: torch.nn.Module, engine) -> None:
    """The model's conversions refused (Note [Conversions of a trained
    model]) and its applies counted (Note [model.apply, as engine state])."""
    ref = weakref.ref(engine)
    for m in model.modules():
        if "_apply" not in m.__dict__:
            m.__dict__["_apply"] = functools.partial(_guarded_apply, m, ref)
        if "apply" not in m.__dict__:
            m.__dict__["apply"] = functools.partial(_counted_apply, m)


def unguard_conversions(model: torch.nn.Module) -> None:
    for m in model.modules():
        f = m.__dict__.get("_apply")
        if isinstance(f, functools.partial) and f.func is _guarded_apply:
            del m.__dict__["_apply"]
        f = m.__dict__.get("apply")
        if isinstance(f, functools.partial) and f.func is _counted_apply:
            del m.__dict__["apply"]


def _guarded_apply(module, ref, fn, recurse=True):
    engine = ref()
    if engine is not None and engine in _LIVE:
        for name, p in module.named_parameters(recurse=recurse):
            if engine._record_of_param(p) is None:
                continue
            out = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if isinstance(out, torch.Tensor) and (out.dtype != p.dtype or out.device != p.device):
                raise UsageError(
                    f"a conversion of the model to {out.dtype} on {out.device} (model.to, .half, "
                    f".float, .double, .bfloat16, .cuda, .cpu or .type): tidal trains its parameters "
                    f"(e.g. '{name}') in chunks, in {p.dtype} as the config's precision says and on "
                    f"the device as the budget allows; converting the model would change only the "
                    f"empty placeholders and the buffers. Choose the dtype with the config's 'bf16' / "
                    f"'fp16' blocks before tidal.initialize, and send inputs to engine.device")
    return type(module)._apply(module, fn, recurse)
