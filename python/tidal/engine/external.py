"""Parameters read outside the forward of the module that owns them.

Note [External parameters] in hooks/module_hooks.h has the design. This file
holds the Python side:

* ParameterReads replaces the `_parameters` dict of every module an engine
  trains. Attribute access (`module.weight`, `self.out_proj.weight`) goes
  through nn.Module.__getattr__ to `_parameters[name]`, so every such read
  of a detached parameter (an empty placeholder) reaches the engine's
  OutsideAccess (outside_access.py), which attaches the parameter and learns
  who read it. Iteration
  (`named_parameters`, `state_dict`) does not go through it.
* PlaceholderCheck, a torch function mode over the engine's first forward:
  a parameter that reaches a torch function while detached was read some
  other way (a list or closure holding the Parameter itself); it is an
  UnsupportedModelError naming the module, the parameter and the ways out,
  instead of torch's error about an empty tensor (or a silently wrong result).
* register_external_parameter and set_leaf_modules: the by-hand fallbacks
  DeepSpeed ZeRO-3 users know (deepspeed.zero.register_external_parameter,
  deepspeed.utils.set_z3_leaf_modules).
"""
from __future__ import annotations

import sys
import weakref

import torch

from .errors import UnsupportedModelError
from .guards import engine_of

__all__ = ["ParameterReads", "PlaceholderCheck", "innermost_module", "register_external_parameter",
           "set_leaf_modules"]

# Marks set on modules before tidal.initialize (read by the engine's setup).
_EXTERNAL_ATTR = "_tidal_external_params"
_LEAF_ATTR = "_tidal_leaf_module"

_CALL_IMPL = torch.nn.Module._call_impl.__code__

_COPY_ERROR = (
    "{what} a model that tidal trains: its parameters live in tidal's chunks, and the module "
    "holds only empty placeholders for them. For the weights, build a new model and load "
    "engine.state_dict() into it (fp32 values, keyed like model.state_dict()); to save, use "
    "engine.save_checkpoint() (to resume) or engine.save_pretrained() (Hugging Face)")


# Note [Reads that only move a parameter]: torch.func.functional_call (and
# torch.nn.utils.stateless.functional_call) swaps the tensors it is given into
# the modules and the originals back afterwards, through
# torch.nn.utils._named_member_accessor.swap_tensor, which reads
# `module._parameters[name]` only to keep the object it puts back. Attaching
# every parameter the swap reads would pin the whole model on the device at
# once (an out-of-memory error at a budget where chunks move); the object is
# all it needs, so those reads are served as they are. The forward that runs
# between the swaps uses what was swapped in: the engine's own parameters are
# attached by their modules' hooks as in any forward; other tensors are the
# caller's. (The code object is compared, so a copy of swap_tensor elsewhere
# gets the attaching read: never a placeholder's values, at most the error.)
def _move_only_codes() -> frozenset:
    try:
        from torch.nn.utils import _named_member_accessor as accessor
        return frozenset({accessor.swap_tensor.__code__})
    except (ImportError, AttributeError):  # (a torch without it: every read attaches)
        return frozenset()


_MOVE_ONLY = _move_only_codes()


class ParameterReads(dict):
    """A module's `_parameters` under a tidal engine: a read of a detached
    parameter asks the engine's OutsideAccess to attach it (Note [External
    parameters])."""

    __slots__ = ("_outside", "_index")

    def __init__(self, params: dict, outside, index: dict):
        super().__init__(params)
        self._outside = weakref.ref(outside)
        self._index = index  # parameter name -> the engine's record index

    def __getitem__(self, name):
        p = dict.__getitem__(self, name)
        # A placeholder is empty; an attached parameter never is (tidal keeps
        # no empty parameters in chunks). (Its raw size: to the user a
        # parameter's numel() is its record's.)
        if p is not None:
            with torch._C.DisableTorchFunctionSubclass():
                empty = p.numel() == 0
        if p is not None and empty and sys._getframe(1).f_code not in _MOVE_ONLY:
            i = self._index.get(name)
            if i is not None:
                outside = self._outside()
                if outside is not None:
                    outside.read_param(i)
        return p

    def __deepcopy__(self, memo):
        raise UnsupportedModelError(_COPY_ERROR.format(what="copy.deepcopy of"))

    def __reduce_ex__(self, protocol):
        raise UnsupportedModelError(_COPY_ERROR.format(what="pickling (torch.save) of"))


def install(model: torch.nn.Module, outside, index_of: dict) -> None:
    """Every module of `model` gets a ParameterReads serving its reads through
    `outside` (the engine's OutsideAccess); `index_of(module)` maps its
    parameter names to record indexes (those the engine keeps)."""
    for m in model.modules():
        params = m.__dict__.get("_parameters")
        if params is None or isinstance(params, ParameterReads):
            continue
        m.__dict__["_parameters"] = ParameterReads(params, outside, index_of.get(m, {}))


def uninstall(model: torch.nn.Module) -> None:
    for m in model.modules():
        params = m.__dict__.get("_parameters")
        if isinstance(params, ParameterReads):
            m.__dict__["_parameters"] = dict(params)


def innermost_module(depth: int = 2):
    """The module whose call (nn.Module._call_impl) is innermost on this
    thread's Python stack, or None. Slow (a frame walk): for first reads only."""
    f = sys._getframe(depth)
    while f is not None:
        if f.f_code is _CALL_IMPL:
            module = f.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                return module
        f = f.f_back
    return None


# Torch functions that read a tensor's metadata a placeholder has right
# (dtype, device, flags): harmless on a detached parameter. Anything else
# (its shape, its values) is a read of nothing.
def _harmless():
    t = torch.Tensor
    names = ("dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "is_cuda",
             "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "name",
             "_backward_hooks", "_post_accumulate_grad_hooks", "is_floating_point",
             "is_complex", "requires_grad_", "get_device", "__hash__", "__eq__")
    out = set()
    for n in names:
        attr = getattr(t, n, None)
        if attr is None:
            continue
        out.add(attr)  # a method: torch passes the method itself
        if hasattr(attr, "__set__"):  # a property: torch passes its __get__ / __set__
            out.add(attr.__get__)
            out.add(attr.__set__)
    return frozenset(out)


_HARMLESS = _harmless()


_GETITEM = ParameterReads.__getitem__.__code__


class PlaceholderCheck(torch.overrides.TorchFunctionMode):
    """Over the engine's first forward: a detached parameter of the engine
    reaching a torch function is an UnsupportedModelError (raised by
    `outside`, the engine's OutsideAccess)."""

    def __init__(self, outside):
        super().__init__()
        self._outside = weakref.ref(outside)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outside = self._outside()
        # (ParameterReads' own placeholder test is not a read.)
        if outside is not None and func not in _HARMLESS and \
                sys._getframe(1).f_code is not _GETITEM:
            for a in _tensors(args, kwargs):
                if isinstance(a, torch.nn.Parameter):
                    outside.check_read(a, func)
        return func(*args, **kwargs)


def _tensors(args, kwargs):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Tells tidal that `module`'s forward uses `parameter`, which another
    module owns (DeepSpeed: deepspeed.zero.register_external_parameter).
    tidal learns such reads by itself when they go through the owner's
    attribute (`owner.weight`); this is for a forward that holds the
    Parameter some other way. Before or after tidal.initialize; after, it
    takes effect from the module's next forward.

    Args:
        module: the module whose forward reads `parameter`.
        parameter: a parameter of the model, owned by another module.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register_external_parameter expects a torch.nn.Module, got "
                        f"{type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter expects a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}")
    engine = engine_of(parameter)
    if engine is not None:
        engine._outside.register_external(module, parameter)
        return
    marks = module.__dict__.setdefault(_EXTERNAL_ATTR, {})
    marks[id(parameter)] = parameter


def set_leaf_modules(model: torch.nn.Module, classes) -> list:
    """Modules of `model` of these classes become one unit for tidal: all the
    parameters of the module and of its descendants come to the device when
    its forward starts and leave when it ends; its descendants get no hooks
    (DeepSpeed: deepspeed.utils.set_z3_leaf_modules). For models whose
    modules read each other's parameters in ways tidal cannot follow. Call
    before tidal.initialize. Returns the modules marked.

    Args:
        model: the model (not yet passed to tidal.initialize).
        classes: a module class or a list of them (types, or class names).
    """
    if any(engine_of(p) is not None for p in model.parameters()):
        raise ValueError("tidal.set_leaf_modules: the model is already trained by a tidal engine; "
                         "call set_leaf_modules before tidal.initialize")
    if isinstance(classes, (type, str)):
        classes = [classes]
    classes = list(classes)
    for c in classes:
        if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, torch.nn.Module))):
            raise TypeError(f"tidal.set_leaf_modules: expected nn.Module classes or class names, "
                            f"got {c!r}")
    marked = []
    for m in model.modules():
        if any(type(m).__name__ == c if isinstance(c, str) else isinstance(m, c) for c in classes):
            m.__dict__[_LEAF_ATTR] = True
            marked.append(m)
    if not marked:
        names = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"tidal.set_leaf_modules: no module of {classes} in the model; its "
                         f"module classes are {names}")
    return marked


def is_leaf(module: torch.nn.Module) -> bool:
    return bool(module.__dict__.get(_LEAF_ATTR, False))


def owned_parameters(model: torch.nn.Module):
    """(name, module, its parameters as [(full name, parameter)] or None) for
    every module of `model`, in the order tidal.initialize registers them: a
    module owns its own parameters, a leaf module (tidal.set_leaf_modules)
    its whole subtree's, and a module inside a leaf owns none (None). The
    engine's registration and tidal.estimate's layout both walk this."""
    inside_leaf = set()
    for mname, m in model.named_modules(remove_duplicate=True):
        if id(m) in inside_leaf:
            yield mname, m, None
            continue
        if is_leaf(m):
            inside_leaf.update(id(d) for d in m.modules() if d is not m)
            yield mname, m, list(m.named_parameters(prefix=mname))
        else:
            yield mname, m, [(f"{mname}.{pname}" if mname else pname, p)
                             for pname, p in m.named_parameters(recurse=False)]


def marked_external(module: torch.nn.Module) -> list:
    return list(module.__dict__.get(_EXTERNAL_ATTR, {}).values())
