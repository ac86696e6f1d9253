"""Optimizers that run on the CPU at memory-bandwidth speed.

:class:`CPUAdam` is a drop-in :class:`torch.optim.Optimizer` for parameters
that live in host memory: Adam or AdamW computed by tidal's SIMD kernels
(``tidal._C.cpu_adam``), one multi-threaded pass per parameter group, with
the GIL released while it runs. Its ``state_dict()`` has the layout of
:class:`torch.optim.AdamW` (``step``, ``exp_avg``, ``exp_avg_sq`` per
parameter), so checkpoints move between the two in both directions.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from tidal import _C

__all__ = ["CPUAdam"]

_TORCH_ONLY_FLAGS = ("amsgrad", "maximize")


def _refuse_torch_only(settings: dict, where: str = "") -> None:
    """NotImplementedError for amsgrad/maximize turned on in `settings`."""
    for flag in _TORCH_ONLY_FLAGS:
        if settings.get(flag, False):
            raise NotImplementedError(
                f"CPUAdam: {where}{flag}=True asks for another update rule, which CPUAdam does "
                f"not implement; train with torch.optim.AdamW(..., {flag}=True) instead.")


def _number(name: str, value: Any) -> float:
    """A hyperparameter as a float: a real number (Python's, NumPy's, anything
    float() takes but a string or a bool) or a one-element tensor, as torch's
    optimizers take; else ValueError naming it."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"Invalid {name}: a tensor of shape {tuple(value.shape)} (Tensor "
                             f"{name} must be 1-element)")
        if value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"Invalid {name}: a {value.dtype} tensor (expected a real number)")
        return float(value.item())
    if isinstance(value, (bool, str, bytes)) or getattr(value, "dtype", None) == bool:
        raise ValueError(f"Invalid {name}: {value!r} (expected a real number)")
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (int, float)):  # NumPy's scalars and arrays
        try:
            value = item()
        except (TypeError, ValueError):
            raise ValueError(f"Invalid {name}: {value!r} (expected one number)") from None
        if isinstance(value, (bool, str, bytes)):
            raise ValueError(f"Invalid {name}: {value!r} (expected a real number)")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Invalid {name}: {value!r} (expected a real number)") from None


def _check_param(p: torch.Tensor, where: str) -> None:
    if p.device.type != "cpu":
        raise ValueError(
            f"CPUAdam: {where} is on {p.device}; CPUAdam updates CPU tensors only. "
            "Tip: keep the master params on the CPU, or use torch.optim.AdamW for device params."
        )
    if p.dtype != torch.float32:
        raise TypeError(
            f"CPUAdam: {where} has dtype {p.dtype}, expected torch.float32 "
            "(CPUAdam keeps fp32 params, exp_avg and exp_avg_sq)."
        )
    if p.layout != torch.strided or not p.is_contiguous():
        raise ValueError(
            f"CPUAdam: {where} (shape {tuple(p.shape)}, strides {p.stride()}) is not a "
            "contiguous dense tensor. Tip: param.data = param.data.contiguous() before "
            "building the optimizer."
        )


class CPUAdam(torch.optim.Optimizer):
    r"""Adam / AdamW on CPU parameters, computed by tidal's SIMD kernels.

    With ``adamw_mode=True`` it computes what :class:`torch.optim.AdamW` does
    (decoupled weight decay ``p *= 1 - lr * weight_decay``), with
    ``adamw_mode=False`` what :class:`torch.optim.Adam` does (L2:
    ``grad += weight_decay * p``), in fp32 and in the same operation order, so
    results agree with torch's to a few ulps per step.

    Args:
        params: iterable of parameters or of parameter-group dicts, as for any
            torch optimizer. Every parameter must be a contiguous float32 CPU
            tensor; its ``.grad`` likewise.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and of
            its square.
        eps: added to the denominator.
        weight_decay: decay coefficient (decoupled or L2, see ``adamw_mode``).
        adamw_mode: True for AdamW's decoupled decay, False for Adam's L2.
        bias_correction: False drops Adam's bias correction (step size
            ``lr``, denominator ``sqrt(v) + eps``); torch has no such switch.
        num_threads: threads per step; 0 uses every core of the pool.
        thread_pool: whose threads run the update: "onetbb" or "torch"
            (torch's intra-op pool, the threads that just ran backward);
            the results are bitwise the same (Note [Whose threads run the
            update] in cpu_adam/adam.h).

    ``amsgrad`` and ``maximize`` are not supported; a state dict that turns
    them on is refused with NotImplementedError rather than ignored.
    """

    # The parameters are checked when the optimizer is built and again at each
    # step. DeepSpeed's DeepSpeedCPUAdam (tidal.deepspeed.ops.adam), built on
    # the model's parameters whatever their dtype (DeepSpeed's engine hands it
    # fp32 host masters), checks them at the step only.
    _checks_params_when_built = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        *,
        num_threads: int = 0,
        thread_pool: str = "onetbb",
        amsgrad: bool = False,
        maximize: bool = False,
    ) -> None:
        # torch's switches for other update rules: taken when off (a call written
        # for torch.optim.AdamW passes them), refused when on.
        _refuse_torch_only({"amsgrad": amsgrad, "maximize": maximize})
        lr, eps, weight_decay = (_number(n, v) for n, v in (("lr", lr), ("eps", eps),
                                                             ("weight_decay", weight_decay)))
        try:
            beta1, beta2 = betas
        except (TypeError, ValueError):
            raise ValueError(f"Invalid betas: {betas!r} (expected two numbers in [0, 1))") from None
        betas = (_number("betas[0]", beta1), _number("betas[1]", beta2))
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr} (expected >= 0)")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps} (expected >= 0)")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]} (expected [0, 1))")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]} (expected [0, 1))")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (expected >= 0)")
        if int(num_threads) < 0:
            raise ValueError(f"num_threads must be >= 0 (0: all cores), got {num_threads}")
        if thread_pool not in ("torch", "onetbb"):
            raise ValueError(f"thread_pool must be 'torch' or 'onetbb', got {thread_pool!r}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=bool(adamw_mode),
            bias_correction=bool(bias_correction),
            # Mirrors adamw_mode under torch.optim.Adam's name, so a CPUAdam
            # state dict loaded into torch.optim.Adam keeps its decay mode.
            decoupled_weight_decay=bool(adamw_mode),
        )
        super().__init__(params, defaults)
        self.num_threads = int(num_threads)
        self.thread_pool = thread_pool
        if self._checks_params_when_built:
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    _check_param(p, f"param_groups[{gi}]['params'][{pi}]")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("num_threads", 0)
        self.__dict__.setdefault("thread_pool", "onetbb")
        for group in self.param_groups:
            self._adopt_group(group)

    @staticmethod
    def _adopt_group(group: dict[str, Any]) -> None:
        """Fills CPUAdam's keys into a group that came from torch.optim.Adam/AdamW."""
        _refuse_torch_only(group, "a parameter group with ")
        if "adamw_mode" not in group:
            group["adamw_mode"] = bool(group.get("decoupled_weight_decay", False))
        group.setdefault("bias_correction", True)
        group["decoupled_weight_decay"] = bool(group["adamw_mode"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a CPUAdam, torch.optim.AdamW or torch.optim.Adam state dict.

        Groups from torch take ``adamw_mode`` from ``decoupled_weight_decay``
        (True for AdamW) and ``bias_correction=True``.
        """
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            self._adopt_group(group)
        for p, state in self.state.items():
            step = state.get("step")
            if step is not None and not torch.is_tensor(step):
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                t = state.get(key)
                if t is not None and not t.is_contiguous():
                    state[key] = t.contiguous()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Performs one optimization step.

        Args:
            closure: optional callable that re-evaluates the model and
                returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._adopt_group(group)
            params, grads, exp_avgs, exp_avg_sqs, steps, step_tensors = [], [], [], [], [], []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}]"
                _check_param(p, where)
                grad = p.grad
                if grad.is_sparse:
                    raise ValueError(f"CPUAdam: {where} has a sparse gradient; CPUAdam is dense only.")
                if grad.dtype != torch.float32:
                    raise TypeError(
                        f"CPUAdam: the gradient of {where} has dtype {grad.dtype}, expected "
                        "torch.float32 like the param."
                    )
                if not grad.is_contiguous():
                    raise ValueError(
                        f"CPUAdam: the gradient of {where} (strides {grad.stride()}) is not "
                        "contiguous. Tip: p.grad = p.grad.contiguous() before step()."
                    )
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                params.append(p)
                grads.append(grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                step_tensors.append(state["step"])
                steps.append(int(state["step"].item()) + 1)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            _C.cpu_adam.adam_update_tensors(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                adamw_mode=bool(group["adamw_mode"]),
                bias_correction=bool(group["bias_correction"]),
                num_threads=self.num_threads,
                pool=self.thread_pool,
            )
            # Count the step only once it has been made.
            for t in step_tensors:
                t += 1
        return loss
