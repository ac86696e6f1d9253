"""Module and autograd hooks that move parameters in and out of use; each
hook's work is one call into hooks/module_hooks.h (Note [One call per hook]).
The hooks torch calls are C++ objects (Note [Hooks torch calls into C++] in
python/csrc/hook_callables.cpp), with DTR in the engine's config too (they
keep the engine's own ops out of DTR in C++); this file holds their Python
path: under a Python dispatch mode (a user's, or tidal.dtr's where its
dispatch key is not available) and for outputs that are not tensors or tuples
or lists of them.

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
(parameter, geometry) and rebuilt from the parameter's data when backward
unpacks it, so nothing keeps a chunk address across a move (Note [Parameters
keep their TensorImpl] in hooks/param_binding.h; the pack and unpack hooks
are C++, ModuleHooks.saved_tensor_hooks).
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


def wrap_outputs(wiring, module, output):
    """Marks the module's floating-point outputs that require grad: a tensor
    hook on each runs the module's backward pre-hook (its parameters attach)
    when the output's gradient is ready, before the module's own backward.
    (A tensor hook rather than an identity autograd.Function: ~10 us less per
    module in forward, no extra node in backward.) `wiring` is the engine's
    HookWiring. Returns `output`."""
    pre_backward = wiring.pre_backward_hook(module)

    def mark(t):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            add_tensor_hook(t, pre_backward)
        return t
    if type(output) is torch.Tensor:  # most modules: no pytree walk (it costs ~8 us)
        return mark(output)
    tree_map(mark, output)
    return output
