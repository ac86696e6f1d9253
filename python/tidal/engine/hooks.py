"""Module and autograd hooks that move parameters in and out of use; each
hook's work is one call into hooks/module_hooks.h (Note [One call per hook]).

Forward: a module's pre-hook attaches its parameters (their chunks come to
the device, COMPUTE), its post-hook detaches them (HOLD_AFTER_FWD, or HOLD
under no_grad) and puts a tensor hook on its outputs. Backward: that hook
runs before the module's own backward and attaches its parameters again; a
parameter's post-accumulate-grad hook, which fires once its gradient is
final, writes the gradient into the parameter's 16-bit slot and detaches it
(HOLD_AFTER_BWD). Whatever is still attached when backward returns is
detached by engine.backward().

Saved tensors: a tensor autograd saves for backward that aliases a
parameter's slot (the parameter, or a view like weight.t()) is packed as
(record, geometry) and rebuilt from the parameter's data when backward
unpacks it, so nothing keeps a chunk address across a move (Note [Parameters
keep their TensorImpl] in hooks/param_binding.h).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch.utils._pytree import tree_map


def add_tensor_hook(t, hook):
    """t.register_hook(hook), for a hook that is never removed: the steps of
    Tensor.register_hook without its RemovableHandle and import, ~10 us less
    per module output (the handle was most of the post-hook's cost on small
    modules). The hook is its own key in the tensor's hook dict, so it cannot
    collide with the integer ids of hooks registered through register_hook.
    Tensor subclasses (they may override hooks) take register_hook."""
    if type(t) is not torch.Tensor:
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        hooks = OrderedDict()
        t._backward_hooks = hooks  # installs the dict as the tensor's pre-hook
        if t.grad_fn is not None:
            t.grad_fn._register_hook_dict(t)
    hooks[hook] = hook


def wrap_outputs(engine, module, output):
    """Marks the module's floating-point outputs that require grad: a tensor
    hook on each runs the module's backward pre-hook (its parameters attach)
    when the output's gradient is ready, before the module's own backward.
    (A tensor hook rather than an identity autograd.Function: ~10 us less per
    module in forward, no extra node in backward.) Returns `output`."""
    pre_backward = engine._pre_backward_hook(module)

    def mark(t):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            add_tensor_hook(t, pre_backward)
        return t
    if type(output) is torch.Tensor:  # most modules: no pytree walk (it costs ~8 us)
        return mark(output)
    tree_map(mark, output)
    return output


class _Packed:
    __slots__ = ("record", "size", "stride", "offset")

    def __init__(self, record, size, stride, offset):
        self.record, self.size, self.stride, self.offset = record, size, stride, offset


def saved_tensor_hooks(engine):
    """The (pack, unpack) pair of the engine's parameter aliases: for
    torch.autograd.graph.saved_tensors_hooks in forward, and for
    tidal.recompute's replays (RecomputePlan.parameter_aliases). pack runs for
    every tensor autograd saves (~3 per small module), so it is one frame with
    engine.param_record_of's lookup inlined and the hooks object and records
    bound once (neither is ever replaced)."""
    attached_at = engine._hooks.attached_at
    records = engine._record_list
    tensor, strided = torch.Tensor, torch.strided

    def pack(t):
        if not isinstance(t, tensor) or t.layout != strided:
            return t
        i = attached_at(t)
        if i < 0:
            return t
        return _Packed(records[i], tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(obj):
        if type(obj) is not _Packed:
            return obj
        record = obj.record
        if not engine._is_attached(record):
            engine._attach([record], None, for_backward=True)
        return record.param.data.as_strided(obj.size, obj.stride, obj.offset)

    return pack, unpack
