"""deepspeed.initialize's optimizer= and lr_scheduler= over tidal's engine.

Note [A client optimizer under tidal's engine]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DeepSpeed 0.19.8's initialize takes optimizer=, a torch Optimizer or a
callable that makes one from model_parameters (runtime/engine.py,
_configure_optimizer), in place of the config's "optimizer" block. DeepSpeed
wraps it (ZeRO, bf16/fp16) and runs its step over DeepSpeed's fp32 masters;
the wrapper shares the client's param_groups, so a scheduler the script built
on the client (lr_scheduler=, an object) steps the learning rate DeepSpeed
uses. tidal's engine cannot run a client's step (its states would not move
with the chunks), but its own Adam is the update rule of five classes:
DeepSpeed's DeepSpeedCPUAdam and FusedAdam (tidal.deepspeed.ops.adam: Adam,
or AdamW by adamw_mode), torch.optim.Adam (L2 weight decay, or decoupled with
decoupled_weight_decay), torch.optim.AdamW, and tidal.optim.CPUAdam. A client
of one of these becomes the engine's optimizer:
 * its parameter groups are the engine's (model_parameters): each group's
   parameters, lr (the value now: a scheduler built on it has set it),
   initial_lr, betas, eps and weight decay;
 * its class, decay mode and bias correction (and its defaults' lr, betas,
   eps, weight decay, against which the config's scheduler scales each group)
   replace the config's optimizer block, which is then not used (a warning
   says so), as in DeepSpeed;
 * once the engine is built, the client's param_groups are the engine's
   list (the same dicts, keeping the client groups' other keys, such as a
   OneCycleLR's max_lr): a scheduler built on the client steps the engine's
   learning rate, and reading the lr from either gives the same value. The
   engine's step is the client's step (torch's "scheduler stepped before the
   optimizer" check is told so); the client's own step() is refused by
   tidal's optimizer guard (engine/guards.py), since tidal keeps the
   gradients in its chunks.
Refused by name, before any weight moves: any other class, a subclass of
these (its step may do anything), amsgrad, maximize or differentiable on,
groups that differ in decay mode or bias correction (the engine runs one
rule), a client that has stepped (its Adam states would be lost), a
parameter that is not the model's, and, as DeepSpeed refuses it, a class
other than DeepSpeedCPUAdam under ZeRO-Offload (offload_optimizer.device cpu
or nvme) unless zero_force_ds_cpu_optimizer is false.

A scheduler object must be bound to the client optimizer (DeepSpeed asserts a
client optimizer for an instantiated scheduler); a callable is called on the
client optimizer, as DeepSpeed calls it on its basic optimizer, or, without
one, on engine.optimizer (tried first on a stand-in: see check_callable).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from ..engine.errors import UsageError
from ..optim import CPUAdam
from .ops.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["ClientOptimizer", "check_callable", "check_made", "check_scheduler_object",
           "is_scheduler_object"]

_CLASSES = {DeepSpeedCPUAdam: "DeepSpeedCPUAdam", FusedAdam: "FusedAdam",
            CPUAdam: "tidal.optim.CPUAdam", torch.optim.Adam: "torch.optim.Adam",
            torch.optim.AdamW: "torch.optim.AdamW"}
# Group keys that say how the client steps; the engine's rule settles them.
_HOW = ("params", "lr", "initial_lr", "betas", "eps", "weight_decay", "name", "amsgrad",
        "maximize", "foreach", "capturable", "differentiable", "fused",
        "decoupled_weight_decay", "adamw_mode", "bias_correction")
_ASKS_ANOTHER_RULE = {"amsgrad": "tidal's Adam has no AMSGrad variant",
                      "maximize": "tidal's Adam minimizes the loss",
                      "differentiable": "tidal's step is not differentiable"}


def _where(gi: int) -> str:
    return f"param_groups[{gi}]"


class ClientOptimizer:
    """A client optimizer taken apart for the engine (Note [A client optimizer
    under tidal's engine]): groups() for tidal.initialize's model_parameters
    (read when called: a scheduler built on the client sets the lr first),
    config_for(cfg) for its config, bind(engine) once the engine exists."""

    def __init__(self, optimizer, model: torch.nn.Module, model_parameters):
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model_parameters)  # (DeepSpeed's call)
            origin = f"optimizer's callable returned a {type(optimizer).__name__}, which"
        else:
            origin = f"optimizer={type(optimizer).__name__}"
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(
                f"tidal.deepspeed.initialize: {origin} is not a torch.optim.Optimizer (nor a "
                f"callable that returns one); pass tidal.deepspeed.ops.adam.DeepSpeedCPUAdam or "
                f"FusedAdam, torch.optim.Adam or AdamW, or no optimizer and the config's "
                f"'optimizer' block")
        cls = type(optimizer)
        if cls not in _CLASSES:
            base = next((c for c in cls.__mro__ if c in _CLASSES), None)
            why = (f"a subclass of {_CLASSES[base]}, whose step may be anything" if base
                   else "an optimizer whose update rule tidal's engine does not run")
            raise UsageError(
                f"tidal.deepspeed.initialize: {origin} is {why}; tidal's engine runs Adam/AdamW "
                f"over its chunks: pass tidal.deepspeed.ops.adam.DeepSpeedCPUAdam or FusedAdam, "
                f"torch.optim.Adam or AdamW (their parameter groups and hyperparameters are "
                f"kept), or no optimizer and the config's 'optimizer' block")
        self.optimizer, self.name = optimizer, _CLASSES[cls]
        if any(len(s) for s in optimizer.state.values()):
            raise UsageError(
                f"tidal.deepspeed.initialize: optimizer={self.name} has stepped already (it holds "
                f"Adam states for {sum(1 for s in optimizer.state.values() if s)} parameters), "
                f"which tidal's engine would start afresh; pass an optimizer that has not "
                f"stepped, or resume with engine.load_checkpoint")
        self.decoupled, self.bias_correction = self._rule()
        self._check_members(model)
        if model_parameters is not None:
            given = model_parameters if isinstance(model_parameters, (list, tuple)) else \
                [model_parameters]
            flat = {id(p) for g in given
                    for p in (_as_list(g["params"]) if isinstance(g, dict) else [g])}
            if flat != {id(p) for g in optimizer.param_groups for p in g["params"]}:
                warnings.warn(f"tidal.deepspeed.initialize: model_parameters is not used: the "
                              f"parameter groups of optimizer={self.name} say what trains, as "
                              f"in DeepSpeed's initialize", stacklevel=3)

    def _rule(self) -> tuple:
        """(decoupled weight decay, bias correction), one for every group."""
        opt = self.optimizer
        rules = []
        for gi, g in enumerate(opt.param_groups):
            for key, why in _ASKS_ANOTHER_RULE.items():
                if g.get(key, False):
                    raise UsageError(f"tidal.deepspeed.initialize: optimizer={self.name} "
                                     f"{_where(gi)} has {key}=True, another update rule: {why}")
            if isinstance(opt, CPUAdam):
                decoupled = bool(g["adamw_mode"])
            else:
                decoupled = bool(g.get("decoupled_weight_decay",
                                       type(opt) is torch.optim.AdamW))
            rules.append((decoupled, bool(g.get("bias_correction", True))))
        if len(set(rules)) > 1:
            words = [f"{_where(i)}: {'decoupled' if d else 'L2'} weight decay, bias correction "
                     f"{'on' if b else 'off'}" for i, (d, b) in enumerate(rules)]
            raise UsageError(f"tidal.deepspeed.initialize: optimizer={self.name}'s groups step by "
                             f"different rules ({'; '.join(words)}), and tidal's engine runs one "
                             f"for every group; give every group the same")
        return rules[0] if rules else (True, True)

    def _check_members(self, model: torch.nn.Module) -> None:
        mine = {id(p) for p in model.parameters()}
        for gi, g in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                if id(p) not in mine:
                    raise UsageError(f"tidal.deepspeed.initialize: optimizer={self.name} "
                                     f"{_where(gi)}['params'][{pi}] (shape {list(p.shape)}) is "
                                     f"not a parameter of the model")

    def groups(self) -> list:
        """The client's groups as tidal.initialize's model_parameters."""
        groups = []
        for g in self.optimizer.param_groups:
            out = {"params": list(g["params"]), "lr": _number(g["lr"]),
                   "initial_lr": _number(g.get("initial_lr", g["lr"])),
                   "betas": tuple(_number(b) for b in g["betas"]), "eps": _number(g["eps"]),
                   "weight_decay": _number(g["weight_decay"])}
            if "name" in g:
                out["name"] = g["name"]
            groups.append(out)
        return groups

    def config_for(self, cfg):
        """`cfg` with this optimizer's rule in place of its optimizer block."""
        given = cfg.raw["optimizer"].get("type")
        if given is not None:
            warnings.warn(f"config key 'optimizer' ({given!r}) is not used: the optimizer passed "
                          f"to tidal.deepspeed.initialize ({self.name}) trains the model, as "
                          f"DeepSpeed's initialize does", stacklevel=3)
        zero = cfg.raw["zero_optimization"]
        offload = (zero.get("offload_optimizer") or {}).get("device")
        if zero.get("cpu_offload"):
            offload = "cpu"  # (DeepSpeed's deprecated spelling of the same)
        if offload in ("cpu", "nvme") and not isinstance(self.optimizer, CPUAdam) and \
                cfg.raw.get("zero_force_ds_cpu_optimizer", True):
            raise UsageError(
                f"tidal.deepspeed.initialize: optimizer={self.name} with ZeRO-Offload "
                f"(zero_optimization.offload_optimizer.device {offload!r}): DeepSpeed refuses a "
                f"client optimizer other than DeepSpeedCPUAdam there, and so does tidal, so the "
                f"script means the same under both; use "
                f"tidal.deepspeed.ops.adam.DeepSpeedCPUAdam, or set "
                f"\"zero_force_ds_cpu_optimizer\": false in the config")
        d = self.optimizer.defaults
        return dataclasses.replace(
            cfg, optimizer_type="AdamW" if self.decoupled else "Adam",
            deepspeed_optimizer=self.name, lr=_number(d["lr"]),
            betas=tuple(_number(b) for b in d["betas"]), eps=_number(d["eps"]),
            weight_decay=_number(d["weight_decay"]), adam_w_mode=self.decoupled,
            bias_correction=self.bias_correction)

    def bind(self, engine) -> None:
        """The client's param_groups become the engine's (see the Note)."""
        theirs = self.optimizer.param_groups
        mine = engine.optimizer.param_groups
        for g, t in zip(mine, theirs, strict=True):
            for key, value in t.items():
                if key not in _HOW:
                    g.setdefault(key, value)
        self.optimizer.param_groups = mine
        # torch's LR schedulers warn when their optimizer's (wrapped) step was
        # not called before their first step: the engine's step is this step.
        self.optimizer._opt_called = True


def _number(value) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _as_list(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def check_made(made, what: str, optimizer) -> None:
    """`what` (a noun phrase naming the scheduler) can be stepped by the engine."""
    if isinstance(made, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UsageError(
            f"tidal.deepspeed.initialize: {what} is a ReduceLROnPlateau, which steps on a metric "
            f"(DeepSpeed passes it the batch size); pass no lr_scheduler and call its "
            f"step(metric) yourself after each evaluation")
    if getattr(made, "optimizer", optimizer) is not optimizer:
        raise UsageError(f"tidal.deepspeed.initialize: {what} schedules another optimizer than "
                         f"the {type(optimizer).__name__} it was given")
    for method in ("step", "state_dict", "load_state_dict"):
        if not callable(getattr(made, method, None)):
            raise UsageError(f"tidal.deepspeed.initialize: {what} (a {type(made).__name__}) has "
                             f"no {method}(); DeepSpeed needs step(), state_dict() and "
                             f"load_state_dict()")


def is_scheduler_object(value) -> bool:
    return hasattr(value, "step") and not isinstance(value, type)


def check_scheduler_object(scheduler, client: "ClientOptimizer | None") -> None:
    """A scheduler object: bound to the client optimizer, steppable by the engine."""
    name = type(scheduler).__name__
    if client is None:
        raise UsageError(
            f"tidal.deepspeed.initialize: lr_scheduler={name} is a scheduler object, bound to an "
            f"optimizer the engine does not run; pass that optimizer as optimizer= too (as "
            f"DeepSpeed-Chat does; DeepSpeed asserts a client optimizer for a scheduler object), "
            f"or a callable that takes the optimizer: "
            f"lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, ...)")
    if getattr(scheduler, "optimizer", None) is not client.optimizer:
        raise UsageError(
            f"tidal.deepspeed.initialize: lr_scheduler={name} is bound to "
            f"{type(getattr(scheduler, 'optimizer', None)).__name__} "
            f"{'(another one)' if hasattr(scheduler, 'optimizer') else '(none)'}, not to the "
            f"optimizer passed as optimizer= ({client.name}); build it on that optimizer")
    check_made(scheduler, f"lr_scheduler={name}", client.optimizer)


def check_callable(make, groups: "list | int", cfg) -> None:
    """Refuses, before any weight moves, a scheduler callable the engine could
    not step: `make` is tried on a stand-in AdamW with the engine's groups'
    hyperparameters (so it is called twice: here, and on engine.optimizer)."""
    if not callable(make):
        raise UsageError(f"tidal.deepspeed.initialize: lr_scheduler={make!r} is neither a "
                         f"scheduler nor a callable that takes the optimizer and returns one")
    if isinstance(groups, int):
        groups = [{} for _ in range(groups)]
    stand_in = torch.optim.AdamW(
        [{"params": [torch.nn.Parameter(torch.zeros(1))],
          "lr": g.get("lr", cfg.lr), "betas": tuple(g.get("betas", cfg.betas)),
          "eps": g.get("eps", cfg.eps), "weight_decay": g.get("weight_decay", cfg.weight_decay)}
         for g in groups], lr=cfg.lr)
    check_made(make(stand_in), "the scheduler lr_scheduler's callable returned", stand_in)

