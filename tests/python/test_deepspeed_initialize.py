"""tidal.deepspeed.initialize: deepspeed.initialize's signature and 4-tuple
over tidal's engine. A DeepSpeed training loop (its loader, a torch LR
scheduler the engine steps, checkpoints) runs as it is and trains what plain
PyTorch + AdamW + the same scheduler trains; what tidal cannot do is refused
naming the argument. DeepSpeed's behaviour cited is 0.19.8's
(deepspeed/__init__.py initialize, runtime/dataloader.py DeepSpeedDataLoader,
runtime/engine.py _take_model_step)."""
import argparse
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
from engine_helpers import measured_budget, within_budget  # noqa: E402

LR = 2e-3


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(6))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


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
    # DeepSpeedDataLoader: micro batches of the config's size, shuffled, the last short
    # one kept (dataloader_drop_last false): 20 samples -> 7 batches.
    assert loader.batch_size == 3 and len(loader) == 7
    assert isinstance(loader.sampler, torch.utils.data.RandomSampler)
    torch.manual_seed(5)
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [3] * 6 + [2]
    seen = torch.cat([b[0] for b in batches])
    assert sorted(seen[:, 0].tolist()) == sorted(Pairs().x[:, 0].tolist())  # every sample once
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
    ({"optimizer": "adam"}, "optimizer=str: tidal runs its own Adam/AdamW"),
    ({"mpu": object()}, "mpu=.*no model or sequence parallelism"),
    ({"dist_init_required": True}, "dist_init_required=True"),
    ({"distributed_port": 1234}, "distributed_port=1234"),
    ({"lr_scheduler": warmup, "config": config(scheduler={"type": "WarmupLR", "params": {}})},
     "lr_scheduler=function and the config's 'scheduler' block \\('WarmupLR'\\)"),
    ({"lr_scheduler": torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), 1)},
     "bound to another optimizer"),
    ({"model": None}, "requires a model"),
])
def test_what_tidal_cannot_do_is_refused_naming_it(kwargs, message):
    call = {"model": Net(), "config": config()}
    call.update(kwargs)
    if call["config"] is None:
        del call["config"]
    with pytest.raises(UsageError, match=message):
        ds.initialize(**call)


def test_training_data_needs_a_micro_batch_and_the_last_batch_drops_when_asked():
    cfg = config()
    del cfg["train_micro_batch_size_per_gpu"]
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        ds.initialize(model=Net(), training_data=Pairs(), config=cfg)
    _, _, loader, _ = ds.initialize(model=Net(), training_data=Pairs(),
                                    config=config(dataloader_drop_last=True))
    assert len(loader) == 6 and all(len(b[0]) == 3 for b in loader)
    # collate_fn is the DataLoader's, as DeepSpeed passes it.
    _, _, loader, _ = ds.initialize(model=Net(), training_data=Pairs(), config=config(),
                                    collate_fn=lambda items: len(items))
    assert sorted(loader) == [2, 3, 3, 3, 3, 3, 3]
