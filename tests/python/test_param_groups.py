"""Parameter groups (Note [Parameter groups] in python/tidal/engine/param_groups.py):
tidal.initialize(model, config, model_parameters=groups) against
torch.optim.AdamW over the same groups of a reference copy, on the host side
and on the device side of the hybrid Adam."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, measured_budget, train_tidal, raw_numel  # noqa: E402
from engine_reference import assert_close  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

LR = 2e-3


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def config(budget="64MiB", **tidal_keys):
    t = {"chunk_size": 16384, "device_memory_budget": budget, "device_margin": 1024}
    t.update(tidal_keys)
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}, "tidal": t}


def no_decay(model):
    """nanoGPT's and the Hugging Face Trainer's recipe: no decay for biases
    and norm weights (every parameter of fewer than two dimensions)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def two_rates(model):
    """A fine-tuning recipe: the head at ten times the body's rate, its own betas and eps."""
    head = [p for n, p in model.named_parameters() if n.startswith(("ln_f", "blocks.1"))]
    ids = {id(p) for p in head}
    body = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": body}, {"params": head, "lr": 10 * LR, "betas": (0.8, 0.95), "eps": 1e-6,
                               "weight_decay": 0.0}]


def train_reference(model, groups, batches):
    opt = torch.optim.AdamW(groups, lr=LR, weight_decay=0.1)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", [no_decay, two_rates])
@pytest.mark.parametrize("side", ["host", "device-simd", "device-fused"])
def test_groups_match_torch_adamw_over_20_steps(recipe, side):
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(20)
    ref_losses = train_reference(ref, recipe(ref), batches)
    if side == "host":   # chunks move; every update on the host
        cfg = config(hybrid_adam=False)
        cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, batches)
    else:                # everything fits; every update on the (simulated) device
        cfg = config(hybrid_adam=True)
    engine = tidal.initialize(model, cfg, model_parameters=recipe(model))
    if side == "device-fused":
        # torch's fused AdamW per group, the kernel of the device side on a
        # GPU, here over the simulated device's CPU tensors.
        engine._step.device_adam_kernel = "fused"
    losses = train_tidal(engine, batches)
    assert_close(engine, ref, ref_losses, losses)
    report = engine.memory_report()
    if side == "host":
        assert report["adam_chunks_on_device"] == 0 and report["evictions"] > 0
    else:
        assert report["adam_chunks_on_host"] == 0 and report["adam_chunks_on_device"] > 0
    # Some chunk holds tensors of both groups.
    mixed = {}
    for r in engine.records:
        mixed.setdefault(r.chunk, set()).add(r.group)
    assert any(len(g) > 1 for g in mixed.values())


def test_the_schedule_scales_every_group_in_proportion():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    cfg = config()
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                       "warmup_num_steps": 4}}
    engine = tidal.initialize(model, cfg, model_parameters=two_rates(model))
    groups = engine.optimizer.param_groups
    for _ in range(3):
        train_tidal(engine, gpt_batches(1))
        assert groups[0]["lr"] == pytest.approx(engine.lr)
        assert groups[1]["lr"] == pytest.approx(10 * engine.lr)
    assert 0 < engine.lr < LR


def test_a_learning_rate_the_script_writes_is_obeyed():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(6)
    opt = torch.optim.AdamW(no_decay(ref), lr=LR)
    engine = tidal.initialize(model, config(), model_parameters=no_decay(model))
    for i, (x, y) in enumerate(batches):
        for g_ref, g in zip(opt.param_groups, engine.optimizer.param_groups):
            g_ref["lr"] = g["lr"] = LR / (i + 1)
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
        train_tidal(engine, [(x, y)])
    assert_close(engine, ref, [], [])


def test_a_plain_list_trains_only_those_parameters():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    only = list(model.blocks[0].parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = tidal.initialize(model, config(), model_parameters=only)
    train_tidal(engine, gpt_batches(3))
    after = engine.parameters_fp32()
    for n, p in before.items():
        changed = not torch.equal(after[n], p)
        assert changed == n.startswith("blocks.0."), n
    frozen = [r for r in engine.records if not r.name.startswith("blocks.0.")]
    assert frozen and not any(r.trainable for r in frozen)  # 16-bit copy only, no Adam states


def test_checkpoints_keep_the_groups(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    twin = copy.deepcopy(model)
    batches = gpt_batches(4)
    engine = tidal.initialize(model, config(), model_parameters=two_rates(model))
    train_tidal(engine, batches[:2])
    engine.optimizer.param_groups[1]["lr"] = 3e-4
    engine.save_checkpoint(tmp_path, tag="t")
    other = tidal.initialize(twin, config(), model_parameters=two_rates(twin))
    other.load_checkpoint(tmp_path, tag="t")
    assert other.optimizer.param_groups[1]["lr"] == 3e-4
    assert other.optimizer.param_groups[1]["betas"] == (0.8, 0.95)
    assert train_tidal(other, batches[2:]) == train_tidal(engine, batches[2:])
    # Other groups: an error before anything is loaded.
    third = TinyGPT(d=64, seq=8)
    mismatched = tidal.initialize(third, config(), model_parameters=no_decay(third))
    with pytest.raises(tidal.engine.checkpoint.CheckpointError,
                       match=r"parameter group\(s\) of .* the engine has 2 of"):
        mismatched.load_checkpoint(tmp_path, tag="t")


def test_bad_groups_are_one_clear_error():
    model = TinyGPT(d=64, seq=8)
    w = model.blocks[0].qkv.weight
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError) as e:
        tidal.initialize(model, config(), model_parameters=[
            {"params": [w, stranger], "amsgrad": True, "momentum": 0.9},
            {"params": [w], "lr": -1.0}])
    text = str(e.value)
    for part in ("group 0 has key(s) ['momentum']", "amsgrad=True",
                 "is not a parameter of the model", "'blocks.0.qkv.weight' is in group 0 and in group 1",
                 "expected lr >= 0, got -1.0"):
        assert part in text, (part, text)
    assert all(raw_numel(p) > 0 for p in model.parameters())  # nothing was put into chunks


def test_the_engine_optimizer_works_as_a_torch_optimizer_with_torch_schedulers():
    # engine.optimizer is a torch.optim.Optimizer: a torch LR scheduler drives
    # its groups, its step() is engine.step(); its state_dict is refused
    # (the Adam states live in chunks).
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(6)
    opt_ref = torch.optim.AdamW(two_rates(ref), lr=LR, weight_decay=0.1)
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, lambda s: 1.0 / (1 + s))
    engine = tidal.initialize(model, config(), model_parameters=two_rates(model))
    opt = engine.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for x, y in batches:
        for m, o, s in ((ref, opt_ref, sched_ref), (model, opt, sched)):
            o.zero_grad()
            loss = m(x, y)
            if m is model:
                engine.backward(loss)
            else:
                loss.backward()
            o.step()
            s.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt_ref.param_groups]
    assert engine.global_steps == len(batches)
    assert_close(engine, ref, [], [])
    with pytest.raises(tidal.UsageError, match=r"engine.save_checkpoint"):
        opt.state_dict()
