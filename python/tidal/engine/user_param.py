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
Inside a forward or a backward, in tidal's own code (a frame of the `tidal`
package calls the function) and while the engine reads or writes a state dict
(torch's Module.state_dict / load_state_dict work on the placeholders, and the
engine's hooks fill in the values), the parameter is an ordinary one. The
class goes when the engine gives the model back (remove_hooks).

Not covered: a tensor taken from a parameter and held (`d = p.data`, `v =
p.detach()`) aliases the 16-bit slot of that moment; once the parameter goes
back to its chunks it is not the parameter's any more (read it again, or
clone). Writes into the tensors of `model.state_dict()` are not seen (they are
copies; docs/parameters.md).
"""
from __future__ import annotations

import sys
import weakref

import torch

from .external import _HARMLESS, _tensors

__all__ = ["install", "uninstall"]

# id(param) -> (engine weakref, record index) for every parameter a live engine trains.
_OWNED: dict = {}
# original class -> its tidal subclass
_CLASSES: dict = {}


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
    }


def _len(shape):
    if len(shape) == 0:
        raise TypeError("len() of a 0-d tensor")
    return shape[0]


def _passing():
    """Functions that need no values: run on the placeholder as they are."""
    t = torch.Tensor
    extra = [t.data.__set__, t.register_hook, t.register_post_accumulate_grad_hook, t.__reduce_ex__,
             t.__setstate__, t.__deepcopy__, t.storage_offset, t.untyped_storage, t.data_ptr,
             t.is_shared, t.element_size, t.itemsize.__get__, t.nbytes.__get__]
    return frozenset(_HARMLESS) | frozenset(f for f in extra if f is not None)


_SHAPE = _shape_answers()
_PASS = _passing()
_TIDAL_PREFIX = __name__.split(".")[0] + "."


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
            # (The placeholder test first: inside a forward the parameters are
            # attached, and it is the cheapest way out.)
            if func not in _PASS:
                found = _placeholders(args, kwargs)
                if found is not None and not sys._getframe(1).f_globals.get("__name__", "").startswith(
                        _TIDAL_PREFIX):
                    engine, held = found
                    answer = _SHAPE.get(func)
                    if answer is not None and len(held) == 1 and args and args[0] is held[0][0]:
                        record = engine._params.record_list[held[0][1]]
                        return answer(args[0], torch.Size(record.shape), *args[1:], **kwargs)
                    engine._outside.read_for_user([i for _, i in held])
            return func(*args, **kwargs)


def _class_for(cls):
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = type(f"Tidal{cls.__name__}", (cls,), {
            "__torch_function__": _UserParameter.__dict__["__torch_function__"],
            "__module__": __name__,
            "__doc__": f"A {cls.__name__} that a tidal engine trains (Note [A parameter object "
                       f"stays the user's] in tidal/engine/user_param.py).",
        })
        _CLASSES[cls] = sub
    return sub


def install(engine) -> None:
    """The engine's parameters get their tidal class (Note [A parameter object
    stays the user's])."""
    ref = weakref.ref(engine)
    for i, record in enumerate(engine._params.record_list):
        p = record.param
        cls = type(p)
        if cls not in _CLASSES.values():
            try:
                p.__class__ = _class_for(cls)
            except TypeError:
                continue  # (a class whose layout differs: left as it is)
        _OWNED[id(p)] = (ref, i)
    weakref.finalize(engine, _forget, [id(r.param) for r in engine._params.record_list], ref)


def uninstall(engine) -> None:
    """The parameters get their own classes back."""
    for record in engine._params.record_list:
        p = record.param
        hit = _OWNED.get(id(p))
        if hit is not None and hit[0]() is engine:
            del _OWNED[id(p)]
            base = type(p).__bases__[0]
            if type(p) in _CLASSES.values():
                p.__class__ = base


def _forget(ids, ref) -> None:
    for k in ids:
        hit = _OWNED.get(k)
        if hit is not None and hit[0] is ref:
            del _OWNED[k]
