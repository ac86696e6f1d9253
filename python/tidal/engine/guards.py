"""Live engines, and the torch APIs that would do nothing to their parameters.

Note [Torch APIs that see no gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A gradient that lands goes into its parameter's 16-bit slot in a chunk and
param.grad is set to None (Note [One call per hook] in hooks/module_hooks.h).
A torch optimizer over the engine's parameters then steps nothing, and
torch.nn.utils.clip_grad_norm_ clips nothing and returns 0: the script
trains without its clipping, or without training at all, and says nothing.
DeepSpeed ZeRO behaves the same and documents the config's optimizer and
gradient_clipping instead. While an engine lives, tidal refuses both with a
UsageError naming the parameter and the config key to use:
  * every torch.optim.Optimizer step passes a global step pre-hook
    (torch.optim.optimizer.register_optimizer_step_pre_hook) that looks its
    parameters up among the live engines' (the verdict is kept per optimizer
    and its group sizes, so an unrelated optimizer pays one lookup per step);
  * torch.nn.utils.clip_grad_norm_ and clip_grad_value_ are wrapped where
    torch.nn.utils and torch.nn.utils.clip_grad hold them (a script that
    imported the function itself before tidal was imported keeps torch's).
Installed when an engine is made, and taken out again when the last live
engine is given back (remove_hooks, which unregisters it) or collected:
nothing of tidal's stays in torch for plain PyTorch code after it.
"""
from __future__ import annotations

import functools
import gc
import weakref

import torch

from .errors import UsageError

__all__ = ["engine_of", "guard_conversions", "install", "register", "unguard_conversions"]

_LIVE: "weakref.WeakSet" = weakref.WeakSet()
_installed = None  # while installed: (the optimizer hook's handle, [(module, name, torch's function)])
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
    handle, wrapped = _installed
    _installed = None
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
    handle = register_optimizer_step_pre_hook(_optimizer_step)
    import torch.nn.utils.clip_grad as clip_grad
    wrapped = []
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        original = getattr(clip_grad, name)
        guarded = _clip_guard(original, name)
        setattr(clip_grad, name, guarded)
        wrapped.append((clip_grad, name, original))
        if getattr(torch.nn.utils, name, None) is original:
            setattr(torch.nn.utils, name, guarded)
            wrapped.append((torch.nn.utils, name, original))
    # nn.Parameter(p) of a parameter an engine trains (Note [Parameters fail
    # closed] in user_param.py).
    original_new = torch.nn.Parameter.__dict__["__new__"]
    torch.nn.Parameter.__new__ = staticmethod(_parameter_guard(original_new.__func__))
    wrapped.append((torch.nn.Parameter, "__new__", original_new))
    _installed = (handle, wrapped)


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


def _clip_guard(original, name):
    @functools.wraps(original)
    def guarded(parameters, *args, **kwargs):
        if _LIVE:
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            else:
                parameters = list(parameters)
            hit = _managed(parameters)
            if hit is not None:
                _, record = hit
                raise UsageError(
                    f"torch.nn.utils.{name} over parameters that tidal trains (e.g. "
                    f"'{record.name}'): tidal keeps their gradients in its chunks until "
                    f"engine.step() and param.grad is None, so it would clip nothing"
                    f"{' and return 0' if name == 'clip_grad_norm_' else ''}. Set "
                    f"\"gradient_clipping\": <max norm> in the config instead (as DeepSpeed "
                    f"does): engine.step() clips by the global norm of all gradients, which "
                    f"engine.get_global_grad_norm() returns after the step")
        return original(parameters, *args, **kwargs)

    guarded.__wrapped_by_tidal__ = True
    return guarded


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
def guard_conversions(model: torch.nn.Module, engine) -> None:
    ref = weakref.ref(engine)
    for m in model.modules():
        if "_apply" not in m.__dict__:
            m.__dict__["_apply"] = functools.partial(_guarded_apply, m, ref)


def unguard_conversions(model: torch.nn.Module) -> None:
    for m in model.modules():
        f = m.__dict__.get("_apply")
        if isinstance(f, functools.partial) and f.func is _guarded_apply:
            del m.__dict__["_apply"]


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
