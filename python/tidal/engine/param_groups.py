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
"""
from __future__ import annotations

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


class EngineOptimizer(torch.optim.Optimizer):
    """engine.optimizer: the engine's Adam as a torch optimizer (Note
    [Parameter groups]), so code written for one works: its param_groups are
    the engine's groups (the step reads them), torch's LR schedulers drive
    them, step() is engine.step() and zero_grad() engine.zero_grad(). The
    Adam states live in the engine's chunks: state_dict() is refused (a dict
    without them would lose them without a word); checkpoints are
    engine.save_checkpoint()."""

    def __init__(self, engine, groups: list):
        # (build_groups gives at least one group; its dicts become param_groups.)
        self._built = False
        super().__init__(groups, {k: groups[0][k] for k in _HYPER})
        self._engine = weakref.ref(engine)
        self._built = True

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

    def step(self, closure=None):
        """engine.step() (at gradient-accumulation boundaries, as DeepSpeed's)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._live().step()
        return loss

    def zero_grad(self, set_to_none: bool = True):  # noqa: ARG002 -- gradients live in chunks
        """engine.zero_grad(): drops gradients that wait for a step."""
        self._live().zero_grad()

    def state_dict(self):
        raise UsageError(
            "engine.optimizer.state_dict(): the Adam states (fp32 master, momentum, variance) "
            "live in tidal's chunks, not in this object; save and resume them with "
            "engine.save_checkpoint(dir) and engine.load_checkpoint(dir) (as DeepSpeed's "
            "engine does), which keep the parameter groups too")

    def load_state_dict(self, state_dict):
        self.state_dict()


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
