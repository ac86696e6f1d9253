"""torch's own optimizer test inputs (torch.testing._internal.common_optimizers,
shipped in the wheel) for torch.optim.Adam and AdamW, put to tidal.

Each input torch trains with is either computed by tidal as torch computes it
(tidal.optim.CPUAdam, and the training engine from the DeepSpeed config that
means the same update rule), or refused with an error naming the key: never
run as something else. Each input torch refuses, tidal refuses too, with
torch's error type, or takes it as the same numbers torch would take.
"""
import copy
import math
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal.config import ConfigError
from tidal.optim import CPUAdam

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import measured_budget, train_tidal, within_budget  # noqa: E402
from tidal.models.gpt import TanhChain  # noqa: E402

ADAMS = (torch.optim.Adam, torch.optim.AdamW)
CPUADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
FLAGS = ("amsgrad", "maximize")  # other update rules, which tidal does not run
RTOL, ATOL = 1e-5, 1e-6  # as tests/python/test_cpu_adam.py: a few ulps per step


def _infos():
    return {o.optim_cls: o for o in common_optimizers.optim_db if o.optim_cls in ADAMS}


def _inputs():
    out = []
    for cls, info in _infos().items():
        for i in info.optim_inputs_func(device="cpu"):
            assert i.params is None, i.desc  # the Adam inputs are all hyperparameters
            out.append(pytest.param(cls, dict(i.kwargs), id=f"{cls.__name__}-{i.desc}"))
    return out


def _error_inputs():
    out = []
    for cls, info in _infos().items():
        for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            out.append(pytest.param(cls, e, id=f"{cls.__name__}-{e.optimizer_error_input.desc}"))
    return out


def _holds_a_tensor(value):
    return torch.is_tensor(value) or (isinstance(value, (tuple, list)) and
                                      any(torch.is_tensor(v) for v in value))


INPUTS, ERROR_INPUTS = _inputs(), _error_inputs()
# The refusals a JSON config can say: numbers, no parameters, no tensors.
CONFIG_ERROR_INPUTS = [p for p in ERROR_INPUTS if p.values[1].optimizer_error_input.params is None
                       and not any(_holds_a_tensor(v) for v in
                                   p.values[1].optimizer_error_input.kwargs.values())]


def test_torch_still_ships_the_inputs():
    # The tests below must not pass by running nothing.
    descs = {p.id for p in INPUTS}
    assert len(INPUTS) >= 8 and len(ERROR_INPUTS) >= 10, (descs, len(ERROR_INPUTS))
    assert len(CONFIG_ERROR_INPUTS) >= 2, [p.id for p in ERROR_INPUTS]
    assert any(k.get("weight_decay") for _, k in (p.values for p in INPUTS))
    assert any(k.get("amsgrad") for _, k in (p.values for p in INPUTS))


# --- tidal.optim.CPUAdam ------------------------------------------------------

def _twins(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g) for s in [(37,), (8, 13), (1,), (4099,)]]
    return ([torch.nn.Parameter(t.clone()) for t in base],
            [torch.nn.Parameter(t.clone()) for t in base])


@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_cpu_adam_on_torchs_inputs(cls, kwargs):
    ours, theirs = _twins()
    ref = cls(theirs, **kwargs)
    flags = [k for k in FLAGS if kwargs.get(k)]
    if flags:
        with pytest.raises(NotImplementedError, match=f"CPUAdam: {flags[0]}=True asks for another "
                                                       f"update rule"):
            CPUAdam(ours, adamw_mode=cls is torch.optim.AdamW, **kwargs)
        return
    # torch's defaults written out: CPUAdam's are DeepSpeedCPUAdam's (no
    # weight decay), not AdamW's 0.01.
    opt = CPUAdam(ours, adamw_mode=cls is torch.optim.AdamW, **_resolved(ref))
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(opt.state[a]["exp_avg"], ref.state[b]["exp_avg"],
                                   rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"],
                                   rtol=RTOL, atol=ATOL)


def _resolved(torch_optimizer):
    """The hyperparameters torch's optimizer runs with, its defaults filled in."""
    return {k: torch_optimizer.defaults[k] for k in CPUADAM_KEYS}


def _as_float(x):
    return float(x) if isinstance(x, (int, float)) or (torch.is_tensor(x) and x.numel() == 1) \
        else None


def _refused(error):
    """pytest's context for torch's refusal: an exception, or a warning where
    torch only warns (a duplicate parameter in one group)."""
    if issubclass(error.error_type, Warning):
        return pytest.warns(error.error_type, match=error.error_regex)
    return pytest.raises(error.error_type, match=error.error_regex)


@pytest.mark.parametrize("cls,error", ERROR_INPUTS)
def test_cpu_adam_refuses_what_torch_refuses(cls, error):
    i = error.optimizer_error_input
    assert error.error_on == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR

    def params():
        return i.params if i.params is not None else [torch.nn.Parameter(torch.ones(2))]
    with _refused(error):
        cls(params(), **i.kwargs)
    unknown = [k for k in i.kwargs if k not in CPUADAM_KEYS + FLAGS]
    if unknown:  # torch's own switches (foreach): not CPUAdam's
        with pytest.raises(TypeError, match=unknown[0]):
            CPUAdam(params(), **i.kwargs)
        return
    if i.params is not None or issubclass(error.error_type, Warning):
        # torch.optim.Optimizer's own checks of the parameters, inherited.
        with _refused(error):
            CPUAdam(params(), **i.kwargs)
        return
    try:
        opt = CPUAdam(params(), **i.kwargs)
    except error.error_type as e:
        # The message names the hyperparameter (betas as "beta").
        assert any(k.rstrip("s") in str(e) for k in i.kwargs), str(e)
        return
    # Accepted: only where torch refuses a representation (a 1-element tensor
    # beside a float), never a value; the group holds the numbers torch would.
    group = opt.param_groups[0]
    for key, value in i.kwargs.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        held = group[key] if isinstance(group[key], (tuple, list)) else (group[key],)
        floats = [_as_float(v) for v in values]
        assert None not in floats, f"CPUAdam took {key}={value!r}, which torch refuses"
        assert list(held) == floats and all(isinstance(h, float) for h in held), (key, held)


# --- the engine, from a DeepSpeed config ----------------------------------------

def _Net():
    return TanhChain(48, 6)


def _batches(n=6):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 48, generator=g), torch.randn(4, 48, generator=g)) for _ in range(n)]


def _deepspeed_optimizer(cls, kwargs):
    """The DeepSpeed block for torch's `cls(**kwargs)`: DeepSpeed's "Adam" is
    AdamW unless adam_w_mode is false (Note [Optimizer types as DeepSpeed
    resolves them] in config.py)."""
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    if cls is torch.optim.Adam:
        return {"type": "Adam", "params": {**params, "adam_w_mode": False}}
    return {"type": "AdamW", "params": params}


def _config(optimizer):
    return {"gradient_clipping": 0.0, "optimizer": optimizer,
            "tidal": {"chunk_size": 16384, "device_margin": 1024}}


@pytest.fixture
def simulated_device():
    tidal.set_device("sim", capacity="256MiB")


@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_engine_on_torchs_inputs(simulated_device, cls, kwargs):
    torch.manual_seed(0)
    ref = _Net()
    model = copy.deepcopy(ref)
    opt = cls(ref.parameters(), **kwargs)
    flags = [k for k in FLAGS if kwargs.get(k)]
    if flags:
        cfg = _config(_deepspeed_optimizer(cls, kwargs))
        with pytest.raises(ConfigError, match=f"optimizer.params.{flags[0]}"):
            tidal.initialize(model, cfg)
        return
    # torch's defaults written out (DeepSpeed's differ: no weight decay).
    cfg = _config(_deepspeed_optimizer(cls, _resolved(opt)))
    data = _batches()
    cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, data)
    engine = tidal.initialize(model, cfg)
    losses = train_tidal(engine, data)
    ref_losses = []
    for x, y in data:
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, ref_losses)), \
        (losses, ref_losses)
    weights = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        torch.testing.assert_close(weights[key], p.detach(), rtol=RTOL, atol=ATOL, msg=key)
    within_budget(engine)
    assert engine.memory_report()["evictions"] > 0  # chunks moved: both Adam paths ran


def test_deepspeeds_adam_is_torchs_adamw(simulated_device):
    # torch's "weight_decay" input under DeepSpeed's "Adam" without
    # adam_w_mode: DeepSpeed decouples the decay, so the reference is AdamW.
    kwargs = {"weight_decay": 0.1, "lr": 0.01}
    torch.manual_seed(0)
    ref = _Net()
    engine = tidal.initialize(copy.deepcopy(ref), _config({"type": "Adam", "params": kwargs}))
    data = _batches(3)
    train_tidal(engine, data)
    opt = torch.optim.AdamW(ref.parameters(), **kwargs)
    for x, y in data:
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    weights = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        torch.testing.assert_close(weights[key], p.detach(), rtol=RTOL, atol=ATOL, msg=key)
    within_budget(engine)


@pytest.mark.parametrize("cls,error", CONFIG_ERROR_INPUTS)
def test_engine_config_refuses_what_torch_refuses(simulated_device, cls, error):
    i = error.optimizer_error_input
    cfg = _config(_deepspeed_optimizer(cls, i.kwargs))
    bad = next(k for k in i.kwargs if k != "lr")  # lr 0.01 is fine; the other key is not
    with pytest.raises(ConfigError, match=f"optimizer.params.{bad}"):
        tidal.initialize(_Net(), cfg)
