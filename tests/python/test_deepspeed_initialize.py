"""tidal.deepspeed.initialize: deepspeed.initialize's signature and 4-tuple
over tidal's engine. A DeepSpeed training loop (its loader, a torch LR
scheduler the engine steps, checkpoints) runs as it is and trains what plain
PyTorch + AdamW + the same scheduler trains; what tidal cannot do is refused
naming the argument. DeepSpeed's behaviour cited is 0.19.8's
(deepspeed/__init__.py initialize, runtime/dataloader.py DeepSpeedDataLoader,
runtime/engine.py _take_model_step)."""
import argparse
import contextlib
import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal import deepspeed as ds
from tidal.config import ConfigError
from tidal.engine.errors import UsageError

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import measured_budget, within_budget, raw_numel  # noqa: E402
from tidal.models.gpt import TanhChain  # noqa: E402

LR = 2e-3


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def Net():
    return TanhChain(32, 6)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=20, seed=4):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 32, generator=g), torch.randn(n, 32, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def config(**top):
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "tidal": {"chunk_size": 8192, "device_margin": 1024}}
    cfg.update(top)
    return cfg


def warmup(opt):  # a torch scheduler, passed as DeepSpeed's callable form
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))


@pytest.mark.filterwarnings("error::UserWarning")  # torch's "scheduler before optimizer" too
def test_a_deepspeed_loop_trains_as_plain_pytorch_with_the_same_scheduler():
    torch.manual_seed(0)
    ref = Net()
    cfg = config()
    data = [(x, y) for x, y in torch.utils.data.DataLoader(Pairs(), batch_size=3)][:3]
    cfg["tidal"]["device_memory_budget"] = measured_budget(ref, cfg, data)
    engine, optimizer, loader, scheduler = ds.initialize(
        model=copy.deepcopy(ref), model_parameters=None, training_data=Pairs(),
        lr_scheduler=warmup, config=cfg)
    assert optimizer is engine.optimizer and loader is engine.training_dataloader
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert scheduler is engine.client_lr_scheduler and scheduler.optimizer is engine.optimizer
    # DeepSpeedDataLoader: micro batches of the config's size from a DistributedSampler
    # (one replica here): shuffled with seed 0, the same order each epoch whatever
    # torch's seed; the last short batch kept (dataloader_drop_last false).
    assert loader.batch_size == 3 and len(loader) == 7
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    torch.manual_seed(5)
    batches = list(loader)
    torch.manual_seed(6)
    again = list(loader)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    assert [len(b[0]) for b in batches] == [3] * 6 + [2]
    seen = torch.cat([b[0] for b in batches])
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0))  # DistributedSampler's
    assert torch.equal(seen, Pairs().x[order])
    # The loop, and plain PyTorch + AdamW + the same scheduler over the same batches.
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_sched = warmup(opt)
    lrs, ref_lrs, losses, ref_losses = [], [], [], []
    for x, y in batches:
        lrs.append(engine.get_lr()[0])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_lrs.append(opt.param_groups[0]["lr"])
        ref_loss = ref(x, y)
        ref_loss.backward()
        opt.step()
        ref_sched.step()
        opt.zero_grad()
        ref_losses.append(ref_loss.item())
    assert lrs == pytest.approx(ref_lrs) and lrs[0] == pytest.approx(LR / 4)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, ref_losses)), \
        (losses, ref_losses)
    weights = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        torch.testing.assert_close(weights[key], p.detach(), rtol=1e-5, atol=1e-6, msg=key)
    within_budget(engine)
    assert engine.memory_report()["evictions"] > 0
    # DeepSpeed counts train_batch_size() per step, the short last batch too: 7 x 3.
    assert engine.global_samples == 21


def test_the_client_scheduler_is_saved_and_resumed(tmp_path):
    torch.manual_seed(0)
    model = Net()
    cfg = config()
    engine, _, _, sched = ds.initialize(model=copy.deepcopy(model), lr_scheduler=warmup, config=cfg)
    x, y = Pairs()[0:3]
    for _ in range(2):
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(tmp_path)
    other, _, _, other_sched = ds.initialize(model=copy.deepcopy(model), lr_scheduler=warmup,
                                             config=cfg)
    assert other_sched.last_epoch == 0
    other.load_checkpoint(tmp_path)
    assert other_sched.state_dict() == sched.state_dict() and other_sched.last_epoch == 2
    assert other.get_lr() == engine.get_lr() == [pytest.approx(LR * 3 / 4)]
    within_budget(engine)


def test_the_config_comes_from_where_deepspeed_takes_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(train_micro_batch_size_per_gpu=5)))
    args = argparse.Namespace(local_rank=-1, deepspeed_config=str(path))
    engine, *_ = ds.initialize(args=args, model=Net())
    assert engine.train_micro_batch_size_per_gpu() == 5
    engine, *_ = ds.initialize(model=Net(), config_params=config(train_micro_batch_size_per_gpu=4))
    assert engine.train_micro_batch_size_per_gpu() == 4
    old = argparse.Namespace(deepscale_config=str(path), deepspeed_config=None)
    assert ds.initialize(args=old, model=Net())[0].train_micro_batch_size_per_gpu() == 5
    # The config's scheduler is the fourth value when the script gives none.
    sched = {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 3}}
    engine, _, loader, scheduler = ds.initialize(model=Net(), config=config(scheduler=sched))
    assert loader is None and scheduler is engine.lr_scheduler is not None
    assert ds.initialize(model=Net(), config=config())[3] is None


@pytest.mark.parametrize("kwargs,message", [
    ({"config": None}, "needs a config"),
    ({"args": argparse.Namespace(deepspeed_config="x.json")},
     "a config in args.deepspeed_config \\('x.json'\\) and one in the call"),
    ({"args": argparse.Namespace(deepscale_config="a.json", deepspeed_config="b.json"),
      "config": None}, "both deepscale_config and deepspeed_config"),
    ({"config_params": {}}, "both config and config_params"),
    ({"optimizer": "adam"}, "optimizer=str is not a torch.optim.Optimizer"),
    ({"mpu": object()}, "mpu=.*no model or sequence parallelism"),
    ({"dist_init_required": False}, "dist_init_required=False, but torch.distributed is not "
                                    "initialized"),
    ({"distributed_port": 1234}, "distributed_port=1234: DeepSpeed uses it to discover MPI"),
    ({"lr_scheduler": torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), 1)},
     "lr_scheduler=StepLR is a scheduler object, bound to an optimizer the engine does not run; "
     "pass that optimizer as optimizer= too"),
    ({"lr_scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)},
     "ReduceLROnPlateau, which steps on a metric"),
    ({"lr_scheduler": lambda opt: object()}, "callable returned \\(a object\\) has no step\\(\\)"),
    ({"model": None}, "requires a model"),
])
def test_what_tidal_cannot_do_is_refused_naming_it_and_the_model_keeps_its_weights(kwargs, message):
    torch.manual_seed(0)
    model = Net()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    call = {"model": model, "config": config()}
    call.update(kwargs)
    if call["config"] is None:
        del call["config"]
    with pytest.raises(UsageError, match=message):
        ds.initialize(**call)
    # Refused before anything moved into chunks: the same model trains after.
    for k, v in model.named_parameters():
        assert torch.equal(v.detach(), before[k]), k
    engine, *_ = ds.initialize(model=model, config=config())
    x, y = Pairs()[0:3]
    engine.backward(engine(x, y))
    assert engine.step() is True
    within_budget(engine)


@pytest.mark.parametrize("block", [
    {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
    # OneCycle cycles beta1 too: none of it may stay behind.
    {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-2,
                                    "cycle_first_step_size": 3}},
])
def test_the_client_scheduler_replaces_the_configs_as_in_deepspeed(block):
    # DeepSpeed's _configure_lr_scheduler builds the client's and never the config's:
    # the groups keep the config's betas, and the lr is the client's alone.
    cfg = config(scheduler=block)
    cfg["optimizer"]["params"]["betas"] = [0.85, 0.995]
    with pytest.warns(UserWarning, match=f"config key 'scheduler' \\('{block['type']}'\\) is not "
                                         f"used: the lr_scheduler passed"):
        engine, _, _, sched = ds.initialize(model=Net(), lr_scheduler=warmup, config=cfg)
    assert engine.lr_scheduler is None and sched is engine.client_lr_scheduler
    x, y = Pairs()[0:3]
    for k in range(3):
        assert engine.get_lr() == [pytest.approx(LR * min(1.0, (k + 1) / 4))], k  # LambdaLR's
        assert engine.get_mom() == [(0.85, 0.995)], k
        engine.backward(engine(x, y))
        engine.step()
    within_budget(engine)


def test_scheduler_classes_and_callables_that_read_the_optimizers_groups_are_taken():
    class Halving(torch.optim.lr_scheduler.LambdaLR):
        def __init__(self, opt):
            super().__init__(opt, lambda k: 0.5 ** k)

    def by_betas(opt):  # reads Adam's own keys, which a stand-in SGD would lack
        beta1 = opt.param_groups[0]["betas"][0]
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: beta1)
    engine, _, _, sched = ds.initialize(model=Net(), lr_scheduler=Halving, config=config())
    assert isinstance(sched, Halving) and sched.optimizer is engine.optimizer
    engine, _, _, sched = ds.initialize(model=Net(), lr_scheduler=by_betas, config=config())
    assert engine.get_lr() == [pytest.approx(LR * 0.9)]


def test_model_parameters_as_one_group_dict_or_one_tensor():
    net = Net()
    engine, *_ = ds.initialize(model=net, config=config(), model_parameters={
        "params": list(net.parameters()), "lr": LR / 2}, lr_scheduler=warmup)
    assert engine.get_lr() == [pytest.approx(LR / 8)]
    net = Net()
    engine, *_ = ds.initialize(model=net, config=config(),
                               model_parameters=net.layers[0].weight)
    assert len(engine.optimizer.param_groups) == 1
    assert engine.optimizer.param_groups[0]["params"] == [net.layers[0].weight]


def test_training_data_needs_a_micro_batch_and_the_last_batch_drops_when_asked():
    cfg = config()
    del cfg["train_micro_batch_size_per_gpu"]
    model = Net()
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        ds.initialize(model=model, training_data=Pairs(), config=cfg)
    assert all(raw_numel(p) > 0 for p in model.parameters())  # refused before the chunks
    _, _, loader, _ = ds.initialize(model=Net(), training_data=Pairs(),
                                    config=config(dataloader_drop_last=True))
    assert len(loader) == 6 and all(len(b[0]) == 3 for b in loader)
    # collate_fn is the DataLoader's, as DeepSpeed passes it.
    _, _, loader, _ = ds.initialize(model=Net(), training_data=Pairs(), config=config(),
                                    collate_fn=lambda items: len(items))
    assert sorted(loader) == [2, 3, 3, 3, 3, 3, 3]


class SmallCNN(torch.nn.Module):
    """A CIFAR-10 tutorial-shaped net (conv, pool, conv, three linears), shrunk, with
    smooth activations and average pooling, so that a last-bit difference between two
    Adam implementations (which differs by CPU) cannot flip a ReLU or a max-pool's
    choice and part the runs."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 3)
        self.conv2 = torch.nn.Conv2d(6, 8, 3)
        self.fc1 = torch.nn.Linear(8 * 2 * 2, 24)
        self.fc2 = torch.nn.Linear(24, 16)
        self.fc3 = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.avg_pool2d(torch.tanh(self.conv1(x)), 2)
        x = torch.tanh(self.conv2(x)).flatten(1)
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Images(torch.utils.data.Dataset):
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 3, 10, 10, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_the_deepspeed_cifar_tutorials_loop_runs_as_it_is(tmp_path):
    # The shape of DeepSpeedExamples' training/cifar script: its own argparse with
    # DeepSpeed's arguments, the config file from --deepspeed_config, initialize with
    # training_data, inputs moved to model_engine.device, the loss outside the
    # engine. The reference is plain PyTorch over the same batches with what that
    # config means in DeepSpeed: "Adam" with weight decay is AdamW, and WarmupLR's
    # default warm-up is logarithmic, lr = max * log(i + 1) / log(n) at iteration i < n
    # and max from n on (i starts at -1, the min, and counts applied steps).
    cfg = {"train_batch_size": 4, "steps_per_print": 2000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999],
                                                    "eps": 1e-8, "weight_decay": 3e-7}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 6}},
           "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 0},
           "tidal": {"chunk_size": 4096, "device_margin": 1024}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = ds.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    ds.init_distributed()  # no launcher: one process, no process group
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    net = SmallCNN()
    ref = copy.deepcopy(net)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    with pytest.warns(UserWarning, match="'zero_optimization.stage' = 0 is not used by tidal"):
        model_engine, optimizer, trainloader, _ = ds.initialize(
            args=args, model=net, model_parameters=parameters, training_data=Images())
    assert args.local_rank == model_engine.local_rank == 0
    assert model_engine.device == torch.device("cpu") and model_engine.world_size == 1
    assert model_engine.global_rank == 0 and not model_engine.fp16_enabled()
    criterion = torch.nn.CrossEntropyLoss()
    torch.manual_seed(1)
    seen, losses = [], []
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        seen.append((inputs, labels))
        losses.append(loss.item())
    assert len(seen) == 10 and model_engine.global_steps == 10
    opt = torch.optim.AdamW(ref.parameters(), lr=0.0, betas=(0.8, 0.999), eps=1e-8,
                            weight_decay=3e-7)
    ref_losses = []
    for k, (x, y) in enumerate(seen):
        i = k - 1  # WarmupLR's iteration before step k: -1, then one more per step
        gamma = 0.0 if i < 0 else math.log(i + 1) / math.log(6) if i < 6 else 1.0
        opt.param_groups[0]["lr"] = 0.01 * gamma
        loss = criterion(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, ref_losses)), \
        (losses, ref_losses)
    weights = model_engine.parameters_fp32()
    for key, p in ref.named_parameters():
        err = (weights[key] - p.detach()).norm() / p.norm()
        assert err <= 1e-5, f"{key}: relative L2 error {err:.3g}"
    within_budget(model_engine)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_16_bit_config_casts_the_model_before_its_masters_are_made(precision, dtype):
    # DeepSpeed casts the parameters to the config's 16-bit dtype, then builds its fp32
    # masters from them (runtime/engine.py _configure_distributed_model before
    # _configure_optimizer): the masters start from the rounded values.
    torch.manual_seed(0)
    model = Net()
    values = {k: v.detach().clone() for k, v in model.named_parameters()}
    engine, *_ = ds.initialize(model=model, config=config(**{precision: {"enabled": True}}))
    masters = engine.parameters_fp32()
    for key, value in values.items():
        assert torch.equal(masters[key], value.to(dtype).float()), key
    assert all(p.dtype == dtype for p in model.parameters())


def test_local_rank_is_the_launchers_and_init_distributed_wants_what_it_is_told(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    engine, *_ = ds.initialize(model=Net(), config=config())
    assert engine.local_rank == 3 and engine.world_size == 1
    with pytest.raises(UsageError, match="dist_init_required=False"):
        ds.init_distributed(dist_init_required=False)
    ds.init_distributed(dist_init_required=True)  # no launcher: one process, no process group
    assert not torch.distributed.is_initialized()


_UNDER_A_LAUNCHER = """
import os, socket, sys, torch, tidal
from tidal import deepspeed as ds
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
tidal.set_device("sim", capacity="1GiB")
ds.init_distributed()
assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
engine, *_ = ds.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
x = torch.randn(2, 8)
engine.backward(engine(x).sum())
engine.step()
print("ranks", engine.global_rank, engine.world_size, engine.train_batch_size())
torch.distributed.destroy_process_group()
"""


def test_init_distributed_under_a_launcher_starts_the_process_group():
    import subprocess
    proc = subprocess.run([sys.executable, "-c", _UNDER_A_LAUNCHER], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ranks 0 1 2" in proc.stdout


def test_a_scheduler_that_raises_leaves_the_step_done_once():
    # The client scheduler steps last: when it raises, the optimizer step's
    # bookkeeping is done, and stepping again applies nothing twice.
    class Broken(torch.optim.lr_scheduler.LambdaLR):
        def step(self, *a, **k):
            if getattr(self, "armed", False):
                raise RuntimeError("the scheduler broke")
            super().step(*a, **k)

    def make(opt):
        return Broken(opt, lambda k: 1.0)
    engine, _, _, sched = ds.initialize(model=Net(), lr_scheduler=make, config=config())
    sched.armed = True
    x, y = Pairs()[0:3]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="the scheduler broke"):
        engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    after = {k: v.clone() for k, v in engine.parameters_fp32().items()}
    sched.armed = False
    engine.step()  # no new gradients: nothing to apply
    for k, v in engine.parameters_fp32().items():
        assert torch.equal(v, after[k]), k
    within_budget(engine)


# --- zero.Init and GatheredParameters (Note [zero.Init and GatheredParameters over
# init_context] in tidal/_deepspeed_compat/runtime/zero/partition_parameters.py) ----

class Tied(torch.nn.Module):
    """Code that reaches a parameter after its module's __init__, as ZeRO-3 scripts
    write it: a custom init of the first layer and a copy into the second, under
    GatheredParameters(modifier_rank=0); a read under modifier_rank=None."""

    def __init__(self, gathered, seen):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        with gathered([self.a.weight, self.b.weight], modifier_rank=0):
            torch.nn.init.orthogonal_(self.a.weight)
            self.b.weight.data.copy_(self.a.weight.data * 0.5)
        with gathered(self.a.bias):  # read only: what is written here is dropped
            seen.append(self.a.bias.detach().clone())
            self.a.bias.data.zero_()

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def _plain_gathered(params, modifier_rank=None):
    # What GatheredParameters is without ZeRO: the parameters as they are (the
    # read-only block's write is kept here, so the reference undoes it).
    return contextlib.nullcontext()


def test_zero_init_builds_into_chunks_and_gathered_parameters_writes_or_reads():
    cfg = config()
    torch.manual_seed(0)
    seen_ref = []
    ref = Tied(_plain_gathered, seen_ref)
    with torch.no_grad():
        ref.a.bias.copy_(seen_ref[0])  # (undo the write the read-only block drops)
    torch.manual_seed(0)
    seen = []
    with ds.zero.Init(config_dict_or_path=cfg):
        model = Tied(ds.zero.GatheredParameters, seen)
    assert all(raw_numel(p) == 0 for p in model.parameters())  # in chunks, built there
    assert torch.equal(seen[0], seen_ref[0])
    engine, *_ = ds.initialize(model=model, config=cfg)
    weights = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        assert torch.equal(weights[key], p.detach()), key
    # With an engine: the values to read (its parameter as the engine keeps it between
    # steps, or a copy); with modifier_rank the writes go into the chunks at the exit
    # (test_deepspeed_scripts_rest.py checks them in bf16 and fp32).
    before = model.a.weight.data
    with ds.zero.GatheredParameters([model.a.weight, torch.nn.Parameter(torch.ones(2))]):
        assert torch.equal(model.a.weight, weights["a.weight"])
        model.a.weight.data.zero_()  # dropped, as DeepSpeed drops it
    assert model.a.weight.data.data_ptr() == before.data_ptr()
    assert torch.equal(engine.parameters_fp32()["a.weight"], weights["a.weight"])
    assert torch.equal(model.a.weight.detach(), weights["a.weight"])
    with ds.zero.GatheredParameters(model.a.weight, modifier_rank=0):
        assert torch.equal(model.a.weight, weights["a.weight"])
        model.a.weight.data.mul_(2)
    assert torch.equal(engine.parameters_fp32()["a.weight"], weights["a.weight"] * 2)
    assert torch.equal(model.state_dict()["a.weight"], weights["a.weight"] * 2)
    assert model.a.weight.data.data_ptr() == before.data_ptr()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    engine.backward(engine(x, y))
    assert engine.step() is True
    # After a step too (the parameter a placeholder or the engine's own view).
    before = (model.a.weight.numel(), model.a.weight.data.data_ptr())
    with ds.zero.GatheredParameters(model.a.weight):
        assert torch.equal(model.a.weight, engine.parameters_fp32()["a.weight"])
    assert (model.a.weight.numel(), model.a.weight.data.data_ptr()) == before
    within_budget(engine)


def test_gathered_parameters_nest_and_keep_every_write():
    # Nested, on other parameters, and under init_context's own materialized():
    # each exit syncs only what it released; the outer writes after it land too.
    cfg = config()
    with ds.zero.Init(config_dict_or_path=cfg) as init:
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        with ds.zero.GatheredParameters(a.weight, modifier_rank=0):
            with ds.zero.GatheredParameters(b.weight, modifier_rank=0):
                b.weight.data.fill_(2.0)
            a.weight.data.fill_(1.0)
        with init.store.materialized(a):
            with ds.zero.GatheredParameters(b.bias, modifier_rank=0):
                b.bias.data.fill_(3.0)
            a.bias.data.fill_(4.0)
        model = torch.nn.Sequential(a, b)
    engine, *_ = ds.initialize(model=model, config=cfg)
    w = engine.parameters_fp32()
    for key, value in (("0.weight", 1.0), ("1.weight", 2.0), ("1.bias", 3.0), ("0.bias", 4.0)):
        assert torch.equal(w[key], torch.full_like(w[key], value)), key
    # ... the 16-bit copies too (forward computes with them): fp32 here, so equal.
    out = engine(torch.ones(1, 4))
    assert torch.allclose(out, torch.full((1, 4), 2.0 * (4.0 * 1.0 + 4.0) * 4 + 3.0))
    within_budget(engine)


def test_zero_init_under_a_config_scheduler_and_a_client_one():
    # The DeepSpeed ZeRO-3 pattern: one config for zero.Init and initialize; the
    # client scheduler replaces the config's, and the model built in zero.Init
    # is adopted under the same config.
    cfg = config(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}})
    with ds.zero.Init(config=cfg):
        model = Net()
    with pytest.warns(UserWarning, match="config key 'scheduler' \\('WarmupLR'\\) is not used"):
        engine, _, _, sched = ds.initialize(model=model, config=cfg, lr_scheduler=warmup)
    assert sched is engine.client_lr_scheduler and engine.get_lr() == [pytest.approx(LR / 4)]
    assert engine.lr_scheduler is None  # one schedule: the client's (not also zero.Init's config's)


@pytest.mark.parametrize("kwargs,message", [
    ({"module": torch.nn.Linear(2, 2)}, "module=Linear"),
    ({"remote_device": "nvme"}, "remote_device='nvme'"),
    ({"dtype": torch.float16}, "dtype=torch.float16 but the config trains in fp32"),
    ({"config": {}, "config_dict_or_path": {}}, "both config and config_dict_or_path"),
])
def test_zero_init_refuses_what_it_cannot_do(kwargs, message):
    with pytest.raises(UsageError, match=message):
        ds.zero.Init(**kwargs)


def test_zero_init_disabled_builds_an_ordinary_model():
    with ds.zero.Init(enabled=False):
        model = Net()
    assert all(raw_numel(p) > 0 for p in model.parameters())
