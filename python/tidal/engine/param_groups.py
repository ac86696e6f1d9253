"""Parameter groups: torch-style groups with their own Adam hyperparameters.

Note [Parameter groups]
~~~~~~~~~~~~~~~~~~~~~~~
tidal.initialize(model, config, model_parameters=...) takes what
torch.optim.AdamW and deepspeed.initialize(model_parameters=...) take: an
iterable of parameters (only those train) or of group dicts
({"params": [...], "lr": ..., "weight_decay": ..., "betas": ..., "eps": ...}).
A key a group leaves out takes the config's optimizer value. Parameters of
the model in no group do not train: they are frozen (requires_grad False)
before they are put into chunks, so they keep only their 16-bit copy.

Each record knows its group (ParamRecord.group). A chunk may hold tensors of
several groups: its step is one cpu_adam call per group present in the chunk
(the chunk pinned once), each over that group's ranges with that group's
hyperparameters; the device paths do the same per group.

engine.optimizer (an EngineOptimizer, a torch.optim.Optimizer whose step()
is engine.step()) has param_groups, the live list of dicts, as any torch
optimizer's: "params", "lr", "initial_lr", "weight_decay", "betas", "eps",
"name". The step reads "lr", "weight_decay", "betas" and "eps" from it, so a
script that writes group["lr"] itself is obeyed. The config's scheduler
scales every group in proportion, as torch's schedulers do: after each step
group["lr"] = group["initial_lr"] * (scheduled lr / the config's lr), so the
group that takes the config's lr follows the schedule exactly (DeepSpeed's
meaning) and a group at a tenth of it stays at a tenth. A scheduler that
cycles momentum (OneCycle) sets every group's betas.

Note [engine.optimizer fails closed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The rest of torch's Optimizer API either is the engine's, exactly, or is
refused by name where a script would otherwise get a silent wrong result:
  * state: the Adam states live in the chunks, so engine.optimizer.state is
    an object that holds nothing and refuses every use (indexing, `in`,
    len, iteration, clear, assignment, replacing it): a script that reads
    state[p]["exp_avg"], or resets Adam by state.clear() or by zeroing an
    entry, is told so instead of resetting nothing. state_dict() and
    load_state_dict() are refused the same way; checkpoints are
    engine.save_checkpoint/load_checkpoint.
  * zero_grad(set_to_none=True) is engine.zero_grad() (the waiting
    gradients go; the step leaves the weights, as torch's AdamW skips a
    parameter without a gradient); zero_grad(set_to_none=False) zeroes each
    waiting gradient through `p.grad` as torch's Optimizer.zero_grad does
    (Note [Gradients between backward and step] in user_grads.py, the path
    of model.zero_grad(set_to_none=False)), so the step still runs with
    zero gradients: momentum and weight decay move the weights, as torch's.
  * the groups and their members are fixed at tidal.initialize: each record
    knows its group index, and the step never reads the "params" lists. So
    param_groups is a list (_Groups) whose group dicts (_Group) and "params"
    lists (_GroupParams) refuse, at the write and before anything changes, a
    change of membership (a parameter removed, added, repeated or moved
    between groups; a group added, removed, replaced by another dict or
    reordered; param_groups itself replaced), naming the parameters and the
    group. Writes that keep the members (a key such as "lr", or "params" set
    to the same parameters in another order) are taken. This costs nothing
    in the step. Freezing a parameter (requires_grad_(False)) is how a
    script stops training one: the step leaves a parameter without a
    gradient, as torch's AdamW does.
"""
from __future__ import annotations

import collections.abc
import math
import weakref

import torch

from .errors import UsageError

__all__ = ["EngineOptimizer", "build_groups"]

# Keys a group may set, and those torch.optim.AdamW also accepts that tidal
# honours only at their default (anything else is an error, not ignored).
_HYPER = ("lr", "weight_decay", "betas", "eps")
_DEFAULT_ONLY = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False,
                 "foreach": None, "fused": None}


# What a refusal of a change of the groups says (Note [engine.optimizer fails closed]).
_FIXED = ("tidal's parameter groups and their parameters are fixed at tidal.initialize: it laid "
          "out each group's parameters, with their fp32 masters and Adam states, in its chunks "
          "there, and every step updates them by those groups, so the change would be ignored")
_WAYS = ("To stop training a parameter, freeze it (p.requires_grad_(False): the step leaves a "
         "parameter without a gradient, as torch's AdamW does; requires_grad_(True) resumes "
         "it); change a group's \"lr\", \"weight_decay\", \"betas\" or \"eps\" by setting that "
         "key of the group (param_groups[i][\"lr\"] = ...); give other parameters or groups to "
         "tidal.initialize (model_parameters=...). Nothing was changed.")


class EngineOptimizer(torch.optim.Optimizer):
    """engine.optimizer: the engine's Adam as a torch optimizer (Note
    [Parameter groups]), so code written for one works: its param_groups are
    the engine's groups (the step reads them), torch's LR schedulers drive
    them, step() is engine.step() and zero_grad() engine.zero_grad() (with
    set_to_none=False, the waiting gradients are zeroed, as torch's). The
    Adam states live in the engine's chunks: `state`, state_dict() and a
    change of the groups' members are refused by name (Note [engine.optimizer
    fails closed]); checkpoints are engine.save_checkpoint()."""

    def __init__(self, engine, groups: list):
        # (build_groups gives at least one group; its dicts become param_groups.)
        self._built = False
        super().__init__(groups, {k: groups[0][k] for k in _HYPER})
        self._engine = weakref.ref(engine)
        me = weakref.ref(self)
        plain = self.__dict__.pop("_tidal_groups")
        self.__dict__["_tidal_groups"] = _Groups(me, [_Group(me, g) for g in plain])
        self.__dict__["_tidal_state"] = _AdamStateInChunks(me)
        self._built = True

    # torch's Optimizer.__init__ sets both; once built, they are the engine's.
    @property
    def param_groups(self) -> list:
        return self.__dict__["_tidal_groups"]

    @param_groups.setter
    def param_groups(self, value) -> None:
        if not self.__dict__.get("_built", True):
            self.__dict__["_tidal_groups"] = value
            return
        if value is self.__dict__.get("_tidal_groups"):
            return
        raise UsageError(f"engine.optimizer.param_groups = <a {type(value).__name__}>: {_FIXED}, "
                         f"and the step reads the engine's list of group dicts. {_WAYS}")

    @property
    def state(self):
        return self.__dict__.get("_tidal_state")

    @state.setter
    def state(self, value) -> None:
        if not self.__dict__.get("_built", True):
            self.__dict__["_tidal_state"] = value
            return
        if value is self.__dict__.get("_tidal_state"):
            return
        _AdamStateInChunks.refuse("engine.optimizer.state = <a new state>")

    def add_param_group(self, param_group: dict) -> None:
        """Refused once the engine is built: tidal lays out the parameters it
        trains (and their Adam states) in chunks at tidal.initialize, so a
        parameter added later would never move (issue 53)."""
        if not getattr(self, "_built", True):
            return super().add_param_group(param_group)
        params = param_group.get("params", []) if isinstance(param_group, dict) else []
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        shapes = ", ".join(str(tuple(p.shape)) for p in params[:3] if isinstance(p, torch.Tensor))
        raise UsageError(
            f"engine.optimizer.add_param_group() with {len(params)} parameter(s) ({shapes}): tidal "
            f"lays out the parameters it trains, with their fp32 masters and Adam states, in its "
            f"chunks at tidal.initialize, so a group added later would never be stepped. Give "
            f"every parameter to tidal.initialize (as part of the model, or in model_parameters' "
            f"groups), or train the new parameters with a torch optimizer of their own")

    _tidal_engine_optimizer = True  # (the torch-optimizer guard lets it step)

    def __repr__(self):
        return f"tidal engine Adam over {len(self.param_groups)} parameter group(s)"

    def _live(self):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("tidal: the engine of this optimizer is gone")
        return engine

    def _describe(self, p) -> str:
        """A parameter by its name in the engine's model (error messages)."""
        if not isinstance(p, torch.Tensor):
            return f"a {type(p).__name__}"
        engine = self._engine() if "_engine" in self.__dict__ else None
        if engine is not None:
            for name, q in engine.module.named_parameters():
                if q is p:
                    return f"'{name}'"
        return f"a tensor of shape {list(p.shape)} that is not a parameter of the engine's model"

    def step(self, closure=None):
        """engine.step() (at gradient-accumulation boundaries, as DeepSpeed's)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._live().step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """set_to_none (the default): engine.zero_grad(), the gradients that
        wait for a step go. set_to_none=False: each waiting gradient is
        zeroed, as torch's Optimizer.zero_grad zeroes them, so the step still
        runs (momentum and weight decay move the weights): through `p.grad`,
        as model.zero_grad(set_to_none=False) (Note [engine.optimizer fails
        closed])."""
        engine = self._live()
        if set_to_none:
            engine.zero_grad()
            return
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    grad = p.grad
                    if grad is None:
                        continue
                    if grad.grad_fn is not None:
                        grad.detach_()
                    else:
                        grad.requires_grad_(False)
                    grad.zero_()
        except UsageError as e:
            # (fp16 loss scaling, data parallel: refused at the first waiting
            # gradient, before any is zeroed.)
            why = ("the engine trains in fp16, where the waiting gradients are multiplied by the "
                   "loss scale and an overflow skips the step"
                   if engine.store.precision == "fp16" else
                   "the engine trains data-parallel, where a rank's slots hold its own gradients "
                   "until the reduction")
            raise UsageError(
                f"engine.optimizer.zero_grad(set_to_none=False) between engine.backward() and "
                f"engine.step(): {why}, so tidal cannot zero the waiting gradients as plain "
                f"PyTorch would (the step with zero gradients). engine.optimizer.zero_grad() "
                f"(set_to_none=True) drops them: the step then leaves the weights as they are, as "
                f"torch's AdamW skips a parameter without a gradient. Nothing was changed.") from e

    def state_dict(self):
        raise UsageError(
            "engine.optimizer.state_dict(): the Adam states (fp32 master, momentum, variance) "
            "live in tidal's chunks, not in this object; save and resume them with "
            "engine.save_checkpoint(dir) and engine.load_checkpoint(dir) (as DeepSpeed's "
            "engine does), which keep the parameter groups too")

    def load_state_dict(self, state_dict):
        self.state_dict()


class _AdamStateInChunks(collections.abc.MutableMapping):
    """engine.optimizer.state: holds nothing and refuses every use (Note
    [engine.optimizer fails closed]), so no script reads an empty state or
    resets one that is not there."""

    __slots__ = ("_owner",)

    def __init__(self, owner):
        self._owner = owner  # (a weakref to the EngineOptimizer)

    @staticmethod
    def refuse(what: str):
        raise UsageError(
            f"{what}: tidal keeps Adam's states (each parameter's fp32 master, exp_avg, "
            f"exp_avg_sq and step count) in its chunks, not in engine.optimizer.state, which "
            f"holds none, so reading, editing or clearing it would read or change nothing. Save "
            f"and restore them with engine.save_checkpoint(dir) and engine.load_checkpoint(dir); "
            f"tidal has no call that reads or resets one parameter's Adam state in place: to "
            f"start Adam afresh, tidal.initialize a new engine on a model loaded with "
            f"engine.state_dict(). Nothing was changed.")

    def _key(self, key) -> str:
        owner = self._owner()
        if isinstance(key, torch.Tensor) and owner is not None:
            return owner._describe(key)
        return repr(key) if isinstance(key, (str, int)) else f"<a {type(key).__name__}>"

    def __getitem__(self, key):
        self.refuse(f"engine.optimizer.state[{self._key(key)}]")

    def __setitem__(self, key, value):
        self.refuse(f"engine.optimizer.state[{self._key(key)}] = ...")

    def __delitem__(self, key):
        self.refuse(f"del engine.optimizer.state[{self._key(key)}]")

    def __contains__(self, key):
        self.refuse(f"{self._key(key)} in engine.optimizer.state")

    def __iter__(self):
        self.refuse("iter(engine.optimizer.state)")

    def __len__(self):
        self.refuse("len(engine.optimizer.state)")

    def __bool__(self):
        self.refuse("bool(engine.optimizer.state)")

    def __eq__(self, other):
        self.refuse("engine.optimizer.state == ...")

    __hash__ = None

    def __reduce_ex__(self, protocol):
        self.refuse("a copy or pickle of engine.optimizer.state")

    def __repr__(self):
        return "<engine.optimizer.state: none here; tidal keeps Adam's states in its chunks>"

    def get(self, key, default=None):
        self.refuse(f"engine.optimizer.state.get({self._key(key)})")

    def keys(self):
        self.refuse("engine.optimizer.state.keys()")

    def values(self):
        self.refuse("engine.optimizer.state.values()")

    def items(self):
        self.refuse("engine.optimizer.state.items()")

    def clear(self):
        self.refuse("engine.optimizer.state.clear()")

    def pop(self, key, *default):
        self.refuse(f"engine.optimizer.state.pop({self._key(key)})")

    def popitem(self):
        self.refuse("engine.optimizer.state.popitem()")

    def setdefault(self, key, default=None):
        self.refuse(f"engine.optimizer.state.setdefault({self._key(key)}, ...)")

    def update(self, *args, **kwargs):
        self.refuse("engine.optimizer.state.update(...)")


def _where(owner, group) -> str:
    """'engine.optimizer.param_groups[i]' of `group` (error messages)."""
    opt = owner()
    groups = opt.__dict__.get("_tidal_groups", []) if opt is not None else []
    gi = next((i for i, g in enumerate(groups) if g is group), "?")
    return f"engine.optimizer.param_groups[{gi}]"


def _members_refused(owner, group, what: str, old: list, new: list) -> UsageError:
    """The refusal of a change of a group's members, naming them."""
    opt = owner()
    name = (lambda p: opt._describe(p)) if opt is not None else (lambda p: f"a {type(p).__name__}")
    old_ids = {id(p) for p in old}
    new_ids = {id(p) for p in new}
    seen, twice = set(), []
    for p in new:
        if id(p) in seen and id(p) in old_ids:
            twice.append(p)
        seen.add(id(p))
    out = [p for p in old if id(p) not in new_ids]
    into = [p for p in new if id(p) not in old_ids]
    def names(ps):
        return ", ".join(name(p) for p in ps[:4]) + (" ..." if len(ps) > 4 else "")

    parts = []
    if out:
        parts.append(f"take out {names(out)}")
    if into:
        parts.append(f"put in {names(into)}")
    if twice:
        parts.append(f"list {names(twice)} twice")
    label = f" ('{group['name']}')" if isinstance(dict.get(group, "name"), str) else ""
    return UsageError(f"{what} would change the members of {_where(owner, group)}{label}: "
                      f"{' and '.join(parts) or 'another list of parameters'}; {_FIXED}. {_WAYS}")


class _GroupParams(list):
    """A group's "params" (Note [engine.optimizer fails closed]): a change
    that keeps the members (an order) is taken; any other is refused."""

    def __init__(self, owner, group, params):
        super().__init__(params)
        self._owner = owner
        self._group = group

    def __reduce_ex__(self, protocol):
        return (list, (list(self),))  # (a copy is a plain list)

    def _change(self, what: str, op: str, *args):
        trial = list(self)
        result = getattr(list, op)(trial, *args)
        if len(trial) != len(self) or {id(p) for p in trial} != {id(p) for p in self}:
            raise _members_refused(self._owner, self._group, f"{_where(self._owner, self._group)}"
                                   f"[\"params\"]{what}", list(self), trial)
        getattr(list, op)(self, *args)
        return result

    def append(self, p):
        self._change(".append(...)", "append", p)

    def extend(self, ps):
        self._change(".extend(...)", "extend", list(ps))

    def __iadd__(self, ps):
        self._change(" += ...", "extend", list(ps))
        return self

    def __imul__(self, n):
        self._change(f" *= {n!r}", "__imul__", n)
        return self

    def insert(self, i, p):
        self._change(".insert(...)", "insert", i, p)

    def pop(self, i=-1):
        return self._change(f".pop({i!r})", "pop", i)

    def remove(self, p):
        # (by identity: list.remove would compare tensors with ==)
        trial = [q for q in self if q is not p]
        if len(trial) == len(self):
            raise ValueError("list.remove(x): x not in list")
        raise _members_refused(self._owner, self._group,
                               f"{_where(self._owner, self._group)}[\"params\"].remove(...)",
                               list(self), trial)

    def clear(self):
        self._change(".clear()", "clear")

    def __setitem__(self, i, value):
        value = list(value) if isinstance(i, slice) else value
        self._change("[...] = ...", "__setitem__", i, value)

    def __delitem__(self, i):
        self._change("[...] deleted", "__delitem__", i)


class _Group(dict):
    """A group of engine.optimizer.param_groups (Note [engine.optimizer fails
    closed]): its hyperparameters are the script's to set; its "params" keep
    their members."""

    def __init__(self, owner, group: dict):
        super().__init__(group)
        self._owner = owner
        dict.__setitem__(self, "params", _GroupParams(owner, self, group["params"]))

    def __reduce_ex__(self, protocol):
        return (dict, (dict(self),))  # (a copy is a plain dict)

    def _params(self, value, what: str) -> "_GroupParams":
        old = list(dict.__getitem__(self, "params"))
        if isinstance(value, torch.Tensor):
            value = [value]
        try:
            new = list(value)
        except TypeError:
            raise UsageError(f"{what} = <a {type(value).__name__}>: expected the group's "
                             f"parameters (an iterable). {_FIXED}. {_WAYS}") from None
        if len(new) != len(old) or {id(p) for p in new} != {id(p) for p in old}:
            raise _members_refused(self._owner, self, what, old, new)
        return _GroupParams(self._owner, self, new)

    def __setitem__(self, key, value):
        if key == "params":
            value = self._params(value, f"{_where(self._owner, self)}[\"params\"] = ...")
        dict.__setitem__(self, key, value)

    def update(self, *args, **kwargs):
        items = dict(*args, **kwargs)
        if "params" in items:
            items["params"] = self._params(items["params"],
                                           f"{_where(self._owner, self)}.update(params=...)")
        dict.update(self, items)

    def __ior__(self, other):
        self.update(other)
        return self

    def _refuse_drop(self, what: str):
        old = list(dict.__getitem__(self, "params"))
        raise _members_refused(self._owner, self, f"{_where(self._owner, self)}{what}", old, [])

    def __delitem__(self, key):
        if key == "params":
            self._refuse_drop("[\"params\"] deleted")
        dict.__delitem__(self, key)

    def pop(self, key, *default):
        if key == "params":
            self._refuse_drop(".pop(\"params\")")
        return dict.pop(self, key, *default)

    def popitem(self):
        if self and next(reversed(self)) == "params":
            self._refuse_drop(".popitem()")
        return dict.popitem(self)

    def clear(self):
        self._refuse_drop(".clear()")


class _Groups(list):
    """engine.optimizer.param_groups (Note [engine.optimizer fails closed]):
    the engine's group dicts, in their order; a change of them is refused."""

    def __init__(self, owner, groups):
        super().__init__(groups)
        self._owner = owner

    def __reduce_ex__(self, protocol):
        return (list, (list(self),))  # (a copy is a plain list)

    def _refused(self, what: str, added=()):
        opt = self._owner()
        names = ", ".join(f"'{dict.get(g, 'name')}' ({len(dict.get(g, 'params', ()))} parameters)"
                          for g in self)
        extra = ""
        params = [p for g in added if isinstance(g, dict)
                  for p in ([g.get("params")] if isinstance(g.get("params"), torch.Tensor)
                            else list(g.get("params") or ()))]
        if params and opt is not None:
            extra = (f" (a group of {', '.join(opt._describe(p) for p in params[:4])}"
                     f"{' ...' if len(params) > 4 else ''})")
        raise UsageError(f"engine.optimizer.param_groups{what}{extra}: the engine has "
                         f"{len(self)} parameter group(s), {names}, and the step reads each by "
                         f"its place in this list; {_FIXED}. {_WAYS}")

    def _change(self, what: str, op: str, *args, added=()):
        trial = list(self)
        result = getattr(list, op)(trial, *args)
        if [id(g) for g in trial] != [id(g) for g in self]:
            self._refused(what, added)
        return result

    def append(self, g):
        self._change(".append(...)", "append", g, added=(g,))

    def extend(self, gs):
        gs = list(gs)
        self._change(".extend(...)", "extend", gs, added=gs)

    def __iadd__(self, gs):
        gs = list(gs)
        self._change(" += ...", "extend", gs, added=gs)
        return self

    def __imul__(self, n):
        self._change(f" *= {n!r}", "__imul__", n)
        return self

    def insert(self, i, g):
        self._change(".insert(...)", "insert", i, g, added=(g,))

    def pop(self, i=-1):
        return self._change(f".pop({i!r})", "pop", i)

    def remove(self, g):
        self._refused(".remove(...)")

    def clear(self):
        self._change(".clear()", "clear")

    def sort(self, *args, **kwargs):
        self._refused(".sort()")

    def reverse(self):
        self._change(".reverse()", "reverse")

    def __setitem__(self, i, value):
        value = list(value) if isinstance(i, slice) else value
        self._change(f"[{i!r}] = ...", "__setitem__", i, value,
                     added=value if isinstance(i, slice) else (value,))

    def __delitem__(self, i):
        self._change(f"[{i!r}] deleted", "__delitem__", i)


def _fail(problems: list) -> None:
    if problems:
        raise ValueError("tidal.initialize: model_parameters: " + "; ".join(problems))


def build_groups(model: torch.nn.Module, model_parameters, cfg, registered) -> tuple[list, dict]:
    """(groups, id(param) -> group index) for `model_parameters` (None: one
    group of every trainable parameter). Parameters in no group are frozen
    here; `registered(p)` tells whether a parameter is in chunks already
    (tidal.init_context), where freezing it would come too late."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), name)
    defaults = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": tuple(cfg.betas),
                "eps": cfg.eps}
    if model_parameters is None:
        params = [p for p in model.parameters() if p.requires_grad]
        group = dict(defaults, params=params, initial_lr=cfg.lr, name="default")
        return [group], {id(p): 0 for p in params}
    if isinstance(model_parameters, torch.Tensor) or isinstance(model_parameters, dict):
        model_parameters = [model_parameters]
    given = list(model_parameters)
    if not given:
        _fail(["empty: expected parameters or parameter-group dicts"])
    problems = []
    if all(isinstance(g, dict) for g in given):
        raw = given
    elif any(isinstance(g, dict) for g in given):
        _fail(["mixes parameter-group dicts and bare parameters; give one or the other"])
    else:
        raw = [{"params": given}]
    groups, where = [], {}
    for gi, g in enumerate(raw):
        label = f"group {gi}" + (f" ('{g['name']}')" if isinstance(g.get("name"), str) else "")
        unknown = sorted(set(g) - {"params", "name", "initial_lr", *_HYPER, *_DEFAULT_ONLY,
                                   "decoupled_weight_decay"})
        if unknown:
            problems.append(f"{label} has key(s) {unknown}; tidal's Adam takes "
                            f"{['params', 'name', *_HYPER]}")
        for key, default in _DEFAULT_ONLY.items():
            if key in g and g[key] not in (default, None, False):
                problems.append(f"{label} sets {key}={g[key]!r}, which tidal's Adam does not "
                                f"support (leave it out)")
        if "decoupled_weight_decay" in g and bool(g["decoupled_weight_decay"]) != cfg.adam_w_mode:
            problems.append(f"{label} sets decoupled_weight_decay={g['decoupled_weight_decay']!r}, "
                            f"but the config's optimizer uses "
                            f"{'decoupled (AdamW)' if cfg.adam_w_mode else 'L2 (Adam)'} weight "
                            f"decay for every group")
        params = g.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        try:
            params = list(params)
        except TypeError:
            problems.append(f"{label}: 'params' must be an iterable of parameters, got "
                            f"{type(params).__name__}")
            continue
        group = dict(defaults)
        for key in _HYPER:
            if key in g:
                group[key] = g[key]
        try:
            group["lr"] = float(group["lr"])
            group["weight_decay"] = float(group["weight_decay"])
            group["eps"] = float(group["eps"])
            b1, b2 = (float(b) for b in group["betas"])
            group["betas"] = (b1, b2)
        except (TypeError, ValueError):
            problems.append(f"{label}: lr, weight_decay, eps must be numbers and betas a pair of "
                            f"numbers, got lr={group['lr']!r} weight_decay={group['weight_decay']!r} "
                            f"eps={group['eps']!r} betas={group['betas']!r}")
            continue
        if not (group["lr"] >= 0 and math.isfinite(group["lr"])):
            problems.append(f"{label}: expected lr >= 0, got {group['lr']}")
        if not (group["weight_decay"] >= 0 and math.isfinite(group["weight_decay"])):
            problems.append(f"{label}: expected weight_decay >= 0, got {group['weight_decay']}")
        if not (group["eps"] >= 0 and math.isfinite(group["eps"])):
            problems.append(f"{label}: expected eps >= 0, got {group['eps']}")
        if not all(0.0 <= b < 1.0 for b in group["betas"]):
            problems.append(f"{label}: expected betas in [0, 1), got {group['betas']}")
        group["initial_lr"] = float(g.get("initial_lr", group["lr"]))
        group["name"] = g.get("name", f"group {gi}")
        kept = []
        for pi, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                problems.append(f"{label}: params[{pi}] is a {type(p).__name__}, not a parameter")
                continue
            if id(p) not in names:
                problems.append(f"{label}: params[{pi}] (shape {list(p.shape)}) is not a parameter "
                                f"of the model passed to tidal.initialize")
                continue
            if id(p) in where:
                problems.append(f"parameter '{names[id(p)]}' is in group {where[id(p)]} and in "
                                f"group {gi}; a parameter belongs to one group")
                continue
            where[id(p)] = gi
            if p.requires_grad:
                kept.append(p)
        group["params"] = kept
        groups.append(group)
    _fail(problems)
    # Parameters in no group do not train.
    late = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in where:
            if registered(p):
                late.append(names.get(id(p), "?"))
            else:
                p.requires_grad_(False)
    if late:
        _fail([f"parameters {late[:4]}{' ...' if len(late) > 4 else ''} are in no group, so they "
               f"would not train, but tidal.init_context put them into chunks as trainable "
               f"already (with Adam states); set requires_grad=False on them before building the "
               f"model in tidal.init_context, or list them in a group"])
    return groups, {k: v for k, v in where.items()}


def apply_schedule(groups: list, scheduled_lr: "float | None", base_lr: float,
                   betas: "tuple | None") -> None:
    """Every group's lr from the scheduler's, in proportion to its initial lr."""
    if scheduled_lr is not None:
        for g in groups:
            if base_lr > 0:
                g["lr"] = g["initial_lr"] * (scheduled_lr / base_lr)
            else:
                g["lr"] = scheduled_lr
    if betas is not None:
        for g in groups:
            g["betas"] = tuple(betas)


def state(groups: list, name_of) -> list:
    """The groups for a checkpoint: hyperparameters and member names."""
    return [{"name": g["name"], "lr": g["lr"], "initial_lr": g["initial_lr"],
             "weight_decay": g["weight_decay"], "betas": list(g["betas"]), "eps": g["eps"],
             "params": sorted(name_of(p) for p in g["params"])} for g in groups]
