"""tidal.deepspeed.initialize(optimizer=..., lr_scheduler=<object>): a client
optimizer whose rule tidal's Adam runs (DeepSpeed's DeepSpeedCPUAdam and
FusedAdam, torch's Adam and AdamW) trains what that optimizer trains in plain
PyTorch, with its groups, hyperparameters and mode; a scheduler built on it
steps the engine's learning rate; what tidal cannot express is refused by
name before any weight moves (Note [A client optimizer under tidal's engine]
in tidal/_deepspeed_compat/client.py). Also DeepSpeed's load_checkpoint RNG
and dist_init_required. DeepSpeed behaviour cited is 0.19.8's
(runtime/engine.py _configure_optimizer, _configure_lr_scheduler)."""
import copy
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tidal
import tidal.deepspeed as deepspeed
from tidal.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from tidal.engine.errors import UsageError

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import within_budget  # noqa: E402
from tidal.models.gpt import TanhChain  # noqa: E402


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def config(**top):
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0,
           "tidal": {"chunk_size": 4096, "device_margin": 1024}}
    cfg.update(top)
    return cfg


def batches(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)) for _ in range(n)]


def two_groups(model, lr=1e-2):
    """DeepSpeed-Chat's shape: weights decayed, biases not, one group at its own lr."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0,
                                                       "lr": lr / 2}]


def train_engine(engine, data):
    losses = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_plain(model, opt, data, sched=None):
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def assert_same_training(engine, losses, ref, ref_losses):
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
               for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    weights = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        torch.testing.assert_close(weights[key], p.detach(), rtol=1e-5, atol=1e-6, msg=key)


# (client optimizer over the model's groups, torch's reference class and its
# keyword arguments, the engine's adam_w_mode)
CLASSES = [
    (lambda g: DeepSpeedCPUAdam(g, lr=1e-2, betas=(0.9, 0.95)), torch.optim.AdamW, {}, True),
    (lambda g: DeepSpeedCPUAdam(g, lr=1e-2, betas=(0.9, 0.95), adamw_mode=False),
     torch.optim.Adam, {}, False),
    (lambda g: FusedAdam(g, lr=1e-2, betas=(0.9, 0.95)), torch.optim.AdamW, {}, True),
    (lambda g: FusedAdam(g, lr=1e-2, betas=(0.9, 0.95), adam_w_mode=False),
     torch.optim.Adam, {}, False),
    (lambda g: torch.optim.Adam(g, lr=1e-2, betas=(0.9, 0.95)), torch.optim.Adam, {}, False),
    (lambda g: torch.optim.Adam(g, lr=1e-2, betas=(0.9, 0.95), decoupled_weight_decay=True),
     torch.optim.AdamW, {}, True),
    (lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.9, 0.95), eps=1e-6),
     torch.optim.AdamW, {"eps": 1e-6}, True),
    (lambda g: tidal.optim.CPUAdam(g, lr=1e-2, betas=(0.9, 0.95), adamw_mode=False),
     torch.optim.Adam, {}, False),
]


@pytest.mark.parametrize("make,ref_cls,ref_kwargs,decoupled", CLASSES)
def test_each_adam_class_trains_as_its_update_rule_in_plain_pytorch(make, ref_cls, ref_kwargs,
                                                                    decoupled):
    torch.manual_seed(0)
    model = TanhChain(16, 4)
    ref = copy.deepcopy(model)
    client = make(two_groups(model))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config())
    assert engine.config.adam_w_mode is decoupled
    assert engine.config.optimizer_type == ("AdamW" if decoupled else "Adam")
    assert optimizer is engine.optimizer and client.param_groups is optimizer.param_groups
    # Each group keeps its own lr and weight decay (the biases' group: lr / 2, no decay).
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in optimizer.param_groups] == \
        [(1e-2, 0.1, (0.9, 0.95)), (5e-3, 0.0, (0.9, 0.95))]
    data = batches(4)
    losses = train_engine(engine, data)
    ref_opt = ref_cls(two_groups(ref), lr=1e-2, betas=(0.9, 0.95), **ref_kwargs)
    assert_same_training(engine, losses, ref, train_plain(ref, ref_opt, data))
    within_budget(engine)


def test_l2_and_decoupled_decay_part_within_these_steps():
    # (What makes the test above tell the two modes apart.)
    torch.manual_seed(0)
    a = TanhChain(16, 4)
    b = copy.deepcopy(a)
    train_plain(a, torch.optim.Adam(two_groups(a), lr=1e-2, betas=(0.9, 0.95)), batches(4))
    train_plain(b, torch.optim.AdamW(two_groups(b), lr=1e-2, betas=(0.9, 0.95)), batches(4))
    gap = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert gap > 1e-4, gap


def test_bias_correction_off_is_the_engines_rule_too():
    # Reference: Adam without bias correction, written out (DeepSpeed's CPU Adam
    # with bias_correction=False: step size lr, denominator sqrt(v) + eps).
    torch.manual_seed(0)
    model = TanhChain(16, 3)
    ref = copy.deepcopy(model)
    client = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.05,
                              bias_correction=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=config())
    assert engine.config.bias_correction is False
    data = batches(3)
    losses = train_engine(engine, data)
    m = [torch.zeros_like(p) for p in ref.parameters()]
    v = [torch.zeros_like(p) for p in ref.parameters()]
    ref_losses = []
    for x, y in data:
        loss = ref(x, y)
        loss.backward()
        with torch.no_grad():
            for p, mi, vi in zip(ref.parameters(), m, v):
                p.mul_(1 - 1e-2 * 0.05)
                mi.mul_(0.9).add_(p.grad, alpha=0.1)
                vi.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.sub_(1e-2 * mi / (vi.sqrt() + 1e-8))
                p.grad = None
        ref_losses.append(loss.item())
    assert_same_training(engine, losses, ref, ref_losses)


# (torch's "scheduler.step() before optimizer.step()" warning too)
@pytest.mark.filterwarnings("error::UserWarning")
def test_a_scheduler_object_built_on_the_client_steps_the_engines_lr(tmp_path):
    from transformers import get_scheduler
    torch.manual_seed(0)
    model = TanhChain(16, 4)
    ref = copy.deepcopy(model)
    client = FusedAdam(two_groups(model), lr=1e-2, betas=(0.9, 0.95))
    sched = get_scheduler("cosine", optimizer=client, num_warmup_steps=2, num_training_steps=8)
    engine, optimizer, _, returned = deepspeed.initialize(model=model, optimizer=client,
                                                          lr_scheduler=sched, config=config())
    assert returned is sched is engine.client_lr_scheduler and sched.optimizer is client
    assert engine.get_lr() == [0.0, 0.0]  # the warm-up's first value, set when it was built
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=1e-2, betas=(0.9, 0.95))
    ref_sched = get_scheduler("cosine", optimizer=ref_opt, num_warmup_steps=2,
                              num_training_steps=8)
    data = batches(5)
    lrs, ref_lrs, losses, ref_losses = [], [], [], []
    for x, y in data:
        lrs.append(engine.get_lr())
        ref_lrs.append([g["lr"] for g in ref_opt.param_groups])
        losses += train_engine(engine, [(x, y)])
        ref_losses += train_plain(ref, ref_opt, [(x, y)], ref_sched)
    assert lrs == [pytest.approx(r) for r in ref_lrs] and lrs[2] == [1e-2, 5e-3]
    # Read from the client or the engine: the same groups, as DeepSpeed's wrapper shares them.
    assert [g["lr"] for g in client.param_groups] == engine.get_lr()
    assert_same_training(engine, losses, ref, ref_losses)
    # A checkpoint keeps the scheduler; a fresh script resumes it.
    engine.save_checkpoint(tmp_path)
    torch.manual_seed(1)
    again = TanhChain(16, 4)
    client2 = FusedAdam(two_groups(again), lr=1e-2, betas=(0.9, 0.95))
    sched2 = get_scheduler("cosine", optimizer=client2, num_warmup_steps=2, num_training_steps=8)
    engine2, *_ = deepspeed.initialize(model=again, optimizer=client2, lr_scheduler=sched2,
                                       config=config())
    engine2.load_checkpoint(tmp_path)
    assert sched2.last_epoch == sched.last_epoch == 5
    assert engine2.get_lr() == engine.get_lr() == [pytest.approx(r) for r in
                                                   [g["lr"] for g in ref_opt.param_groups]]
    x, y = batches(1, seed=9)[0]
    assert train_engine(engine2, [(x, y)]) == pytest.approx(train_plain(ref, ref_opt, [(x, y)]),
                                                           rel=1e-5)
    within_budget(engine)


def test_a_callable_optimizer_and_scheduler_are_called_as_deepspeed_calls_them():
    # DeepSpeed calls optimizer(model_parameters), and lr_scheduler(the client optimizer).
    torch.manual_seed(0)
    model = TanhChain(16, 3)
    ref = copy.deepcopy(model)
    made = {}

    def make_optimizer(params):
        made["optimizer"] = DeepSpeedCPUAdam(params, lr=1e-2)
        return made["optimizer"]

    def make_scheduler(opt):
        made["given"] = opt
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    engine, _, _, sched = deepspeed.initialize(
        model=model, model_parameters=two_groups(model), optimizer=make_optimizer,
        lr_scheduler=make_scheduler, config=config())
    assert made["given"] is made["optimizer"] and sched.optimizer is made["optimizer"]
    ref_opt = torch.optim.AdamW(two_groups(ref), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    data = batches(5)
    losses = train_engine(engine, data)
    assert_same_training(engine, losses, ref, train_plain(ref, ref_opt, data, ref_sched))
    assert engine.get_lr() == [pytest.approx(2.5e-3), pytest.approx(1.25e-3)]


def test_the_configs_optimizer_gives_way_and_its_scheduler_steps_the_clients_groups():
    # DeepSpeed: the client optimizer overrides the config's "optimizer"; without a
    # client scheduler the config's WarmupLR is built over the client's optimizer and
    # sets each group to warmup_max_lr * gamma (logarithmic warm-up; its iteration
    # starts at -1, warmup_min_lr, and counts applied steps).
    cfg = config(optimizer={"type": "Adam", "params": {"lr": 0.5, "weight_decay": 0.3}},
                 scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                           "warmup_max_lr": 4e-3,
                                                           "warmup_num_steps": 4}})
    torch.manual_seed(0)
    model = TanhChain(16, 3)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="config key 'optimizer' \\('Adam'\\) is not used: the "
                                         "optimizer passed to tidal.deepspeed.initialize "
                                         "\\(torch.optim.AdamW\\)"):
        engine, _, _, sched = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=4e-3,
                                                     weight_decay=0.01), config=cfg)
    assert sched is engine.lr_scheduler is not None
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=4e-3, weight_decay=0.01)
    lrs, ref_lrs, losses, ref_losses = [], [], [], []
    for k, (x, y) in enumerate(batches(6)):
        i = k - 1
        ref_opt.param_groups[0]["lr"] = 0.0 if i < 0 else \
            4e-3 * (math.log(i + 1) / math.log(4) if i < 4 else 1.0)
        lrs.append(engine.get_lr()[0])
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        losses += train_engine(engine, [(x, y)])
        ref_losses += train_plain(ref, ref_opt, [(x, y)])
    assert lrs == pytest.approx(ref_lrs) and lrs[-1] == pytest.approx(4e-3)
    assert engine.config.weight_decay == 0.01 and engine.config.lr == 4e-3
    assert_same_training(engine, losses, ref, ref_losses)


def test_a_model_built_in_zero_init_trains_with_a_client_optimizer_and_one_schedule():
    # The client optimizer's rule (here L2 decay) and the client scheduler replace
    # the config's; a model built in zero.Init under that config takes them too.
    cfg = config(optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.2}},
                 scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}})
    torch.manual_seed(0)
    ref = TanhChain(16, 3)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TanhChain(16, 3)
    client = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.8)
    with pytest.warns(UserWarning, match="is not used"):
        engine, *_ = deepspeed.initialize(model=model, optimizer=client, lr_scheduler=sched,
                                          config=cfg)
    assert engine.lr_scheduler is None and not engine.config.adam_w_mode
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.8)
    data = batches(4)
    losses = train_engine(engine, data)
    assert_same_training(engine, losses, ref, train_plain(ref, ref_opt, data, ref_sched))


def test_model_parameters_beside_an_optimizer_is_not_used_and_says_so():
    torch.manual_seed(0)
    model = TanhChain(16, 3)
    count = sum(p.numel() for p in model.parameters())
    with pytest.warns(UserWarning, match="model_parameters is not used: the parameter groups of "
                                         "optimizer=torch.optim.AdamW say what trains"):
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[model.layers[0].weight],
            optimizer=torch.optim.AdamW(model.parameters()), config=config())
    assert engine.num_parameters(only_trainable=True) == count  # the optimizer's: all of them
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same parameters: nothing to say
        model = TanhChain(16, 3)
        deepspeed.initialize(model=model, model_parameters=model.parameters(),
                             optimizer=torch.optim.AdamW(model.parameters()), config=config())


class MyAdam(torch.optim.AdamW):
    pass


def _stepped(model):
    opt = torch.optim.AdamW(model.parameters())
    model(*batches(1)[0]).backward()
    opt.step()
    opt.zero_grad()
    return opt


def _another_models(model):
    return torch.optim.AdamW(list(model.parameters()) + [torch.nn.Parameter(torch.ones(3))])


def _mixed_modes(model):
    return tidal.optim.CPUAdam([{"params": [model.layers[0].weight], "adamw_mode": False},
                                {"params": [model.layers[0].bias]}])


def _mixed_correction(model):
    return FusedAdam([{"params": [model.layers[0].weight], "bias_correction": False},
                      {"params": [model.layers[0].bias]}])


def _scheduler_of_another(model):
    other = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    return torch.optim.lr_scheduler.StepLR(other, 1)


_OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize("optimizer,extra,message", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), {},
     "optimizer=SGD is an optimizer whose update rule tidal's engine does not run"),
    (lambda m: MyAdam(m.parameters()), {},
     "optimizer=MyAdam is a subclass of torch.optim.AdamW, whose step may be anything"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), {},
     "param_groups\\[0\\] has amsgrad=True, another update rule"),
    (lambda m: torch.optim.Adam(m.parameters(), maximize=True), {},
     "param_groups\\[0\\] has maximize=True"),
    (_mixed_modes, {}, "groups step by different rules \\(param_groups\\[0\\]: L2 weight decay"),
    (_mixed_correction, {}, "param_groups\\[0\\]: decoupled weight decay, bias correction off"),
    (_stepped, {}, "has stepped already \\(it holds Adam states for 6 parameters\\)"),
    (_another_models, {}, "param_groups\\[0\\]\\['params'\\]\\[6\\] \\(shape \\[3\\]\\) is "
                          "not a parameter of the model"),
    (lambda m: torch.optim.AdamW(m.parameters()),
     {"config": lambda m, o: config(zero_optimization=_OFFLOAD)},
     "optimizer=torch.optim.AdamW with ZeRO-Offload .*DeepSpeed refuses a client optimizer other "
     "than DeepSpeedCPUAdam there"),
    (lambda m: torch.optim.AdamW(m.parameters()),
     {"lr_scheduler": lambda m, o: _scheduler_of_another(m)},
     "lr_scheduler=StepLR is bound to AdamW \\(another one\\), not to the optimizer passed"),
    (lambda m: torch.optim.AdamW(m.parameters()),
     {"lr_scheduler": lambda m, o: lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)},
     "ReduceLROnPlateau, which steps on a metric"),
    (lambda m: "adamw", {}, "optimizer=str is not a torch.optim.Optimizer"),
])
def test_what_a_client_optimizer_cannot_express_is_refused_before_weights_move(optimizer, extra,
                                                                                message):
    torch.manual_seed(0)
    model = TanhChain(16, 3)
    opt = optimizer(model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    call = {"model": model, "optimizer": opt, "config": config()}
    call.update({key: make(model, opt) for key, make in extra.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tidal's notes on ZeRO keys)
        with pytest.raises(UsageError, match=message):
            deepspeed.initialize(**call)
    for k, v in model.named_parameters():
        assert torch.equal(v.detach(), before[k]), k
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                      config=config())
    assert train_engine(engine, batches(1)) and engine.global_steps == 1


def test_zero_force_ds_cpu_optimizer_false_lets_another_optimizer_offload_as_in_deepspeed():
    torch.manual_seed(0)
    model = TanhChain(16, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tidal's notes on the ZeRO keys)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters()),
            config=config(zero_optimization=_OFFLOAD, zero_force_ds_cpu_optimizer=False))
    assert engine.config.deepspeed_optimizer == "torch.optim.AdamW"
    assert train_engine(engine, batches(1)) and engine.global_steps == 1


def test_the_clients_own_step_is_refused_the_engines_step_is_its_step():
    torch.manual_seed(0)
    model = TanhChain(16, 3)
    client = torch.optim.AdamW(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=config())
    train_engine(engine, batches(1))
    with pytest.raises(UsageError, match="would update parameters that tidal trains"):
        client.step()


# --- load_checkpoint and the RNG (Note [The RNG on load_checkpoint]) -----------

def test_load_checkpoint_leaves_the_rng_as_deepspeeds_does(tmp_path):
    cfg = config(optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=TanhChain(16, 3), config=cfg)
    train_engine(engine, batches(1))
    torch.manual_seed(1)
    saved = torch.get_rng_state()
    engine.save_checkpoint(tmp_path)
    torch.manual_seed(2)
    expected = torch.get_rng_state()
    engine.load_checkpoint(tmp_path)
    assert torch.equal(torch.get_rng_state(), expected)
    assert not torch.equal(saved, expected)
    # tidal.initialize's own engine restores it (a bit-exact resume of tidal's runs).
    plain = tidal.initialize(TanhChain(16, 3), cfg)
    torch.manual_seed(2)
    plain.load_checkpoint(tmp_path)
    assert torch.equal(torch.get_rng_state(), saved)
