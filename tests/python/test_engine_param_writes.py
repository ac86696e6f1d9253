"""What a script does to a parameter outside forward, against plain PyTorch
(Note [Writes to a parameter] in hooks/module_hooks.cpp; the table in
docs/parameters.md, one test per row).

Each case trains a TanhChain two steps, does the same thing between them to a
plain PyTorch copy (torch.optim.AdamW) and to the model tidal trains, trains
on, and compares the weights: a write tidal keeps must give plain PyTorch's
weights; a write it cannot keep must be a tidal.UsageError naming the
parameter, with the weights as if the write had not been made. Every case
runs at a budget where chunks move and at one where everything fits.
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal.models.gpt import TanhChain

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import Renormed  # noqa: E402

LR = 1e-2
BUDGETS = {"chunks-move": "160KiB", "all-fits": 0}


def _engine(model, budget):
    return tidal.initialize(model, {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "tidal": {"device": "sim", "chunk_size": "16KiB", "device_memory_budget": budget,
                  "device_margin": "4KiB", "simulated_allocator": "exact"}})


def _data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)) for _ in range(3)]


class Pair:
    """A TanhChain trained by tidal and its plain PyTorch twin."""

    def __init__(self, budget):
        torch.manual_seed(0)
        self.model = TanhChain(width=64, depth=6)
        self.ref = copy.deepcopy(self.model)
        self.opt = torch.optim.AdamW(self.ref.parameters(), lr=LR, weight_decay=0.0)
        self.engine = _engine(self.model, budget)
        self.data = _data()

    def step(self, i):
        x, y = self.data[i]
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        loss = self.ref(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def assert_same(self):
        got = self.engine.state_dict()
        for k, v in self.ref.state_dict().items():
            torch.testing.assert_close(got[k].float(), v.float(), rtol=1e-4, atol=5e-5,
                                       msg=lambda m, k=k: f"{k}: {m}")


def _moved(engine, budget):
    # Where the case says chunks move, they did.
    if budget:
        assert engine.memory_report()["evictions"] > 0


KEPT = {
    # in-place through the module's attribute (it brings the parameter in)
    "attribute mul_": lambda m: m.layers[0].weight.mul_(0.5),
    "attribute copy_": lambda m: m.layers[2].bias.copy_(torch.linspace(-1, 1, 64)),
    "init through the attribute": lambda m: torch.nn.init.zeros_(m.layers[1].weight),
    # through .data (no version count: the slot is compared with the master)
    "attribute .data clamp_": lambda m: m.layers[3].weight.data.clamp_(-0.01, 0.01),
    # a tensor set as the data, through a held Parameter
    "held parameter .data =": lambda m: setattr(dict(m.named_parameters())["layers.4.weight"], "data",
                                                torch.full((64, 64), 0.003)),
    # model.apply(init_fn), module by module (over the device budget at the small one)
    "model.apply(init)": lambda m: m.apply(
        lambda mod: torch.nn.init.constant_(mod.weight, 0.01) if isinstance(mod, torch.nn.Linear) else None),
    "model.apply(reset_parameters)": lambda m: (torch.manual_seed(5), m.apply(
        lambda mod: mod.reset_parameters() if isinstance(mod, torch.nn.Linear) else None)),
}


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
@pytest.mark.parametrize("case", list(KEPT))
def test_a_write_between_steps_is_kept_as_in_plain_pytorch(case, budget):
    pair = Pair(budget)
    pair.step(0)
    with torch.no_grad():
        KEPT[case](pair.model)
        KEPT[case](pair.ref)
    pair.step(1)
    pair.step(2)
    pair.assert_same()
    _moved(pair.engine, budget)


def test_engine_apply_is_model_apply():
    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    init = lambda mod: torch.nn.init.constant_(mod.bias, -0.02) if isinstance(mod, torch.nn.Linear) else None  # noqa: E731
    with torch.no_grad():
        assert pair.engine.apply(init) is pair.engine
        pair.ref.apply(init)
    pair.step(1)
    pair.assert_same()


# Through a Parameter object the script holds (model.parameters(), a list made
# earlier): Note [A parameter object stays the user's] in tidal/engine/user_param.py.
HELD = {
    "held parameter mul_": lambda m: dict(m.named_parameters())["layers.1.weight"].mul_(0.5),
    "held parameter init": lambda m: torch.nn.init.ones_(list(m.parameters())[3]),
    # (a statement per parameter: a list of every `.data` would hold them all
    # at once, which the small budget refuses by name: Note [Parameters fail
    # closed] in tidal/engine/user_param.py)
    "held parameter .data.mul_": lambda m: [None for p in m.parameters() if p.data.mul_(0.5) is None],
    "EMA over named_parameters": lambda m: [p.mul_(0.9).add_(torch.ones_like(p), alpha=0.1)
                                            for _, p in m.named_parameters()],
    "held parameter copy_ of another": lambda m: list(m.parameters())[0].copy_(list(m.parameters())[2]),
}


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
@pytest.mark.parametrize("case", list(HELD))
def test_a_write_through_a_held_parameter_is_kept_as_in_plain_pytorch(case, budget):
    pair = Pair(budget)
    pair.step(0)
    with torch.no_grad():
        HELD[case](pair.model)
        HELD[case](pair.ref)
    pair.step(1)
    pair.step(2)
    pair.assert_same()
    _moved(pair.engine, budget)
    assert pair.engine.memory_report()["budget_overruns"] == 0


READS = {  # (exact: the shapes; the values as assert_same compares them)
    "count": lambda m: sum(p.numel() for p in m.parameters()),
    "shapes": lambda m: [tuple(p.shape) + tuple(p.size()) + (p.dim(), len(p), p.ndim) for p in m.parameters()],
    "global norm": lambda m: torch.sqrt(sum(p.detach().float().pow(2).sum() for p in m.parameters())),
    "values of a list made before": lambda m: [p.detach().clone() for p in m._held],
    "norm of each": lambda m: torch.stack([p.norm() for p in m.parameters()]),
}


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
def test_reads_through_held_parameters_give_the_values_as_in_plain_pytorch(budget):
    pair = Pair(budget)
    pair.model._held = list(pair.model.parameters())  # held across a step: placeholders by then
    pair.ref._held = list(pair.ref.parameters())
    pair.step(0)
    for name, read in READS.items():
        got, want = read(pair.model), read(pair.ref)
        if name in ("count", "shapes"):
            assert got == want, name
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")
    pair.step(1)  # (the reads went back to their chunks unchanged)
    pair.step(2)
    pair.assert_same()
    _moved(pair.engine, budget)


def test_a_write_between_backward_and_step_is_refused():
    pair = Pair(BUDGETS["chunks-move"])
    x, y = pair.data[0]
    pair.engine.backward(pair.engine(x, y))
    with torch.no_grad():
        pair.model.layers[0].weight.mul_(0.5)  # a weight made from the master: the slot holds a gradient
    with pytest.raises(tidal.UsageError, match=r"'layers\.0\.weight'.*between backward and step"):
        pair.engine.step()


def test_a_data_tensor_of_another_shape_is_refused_by_name():
    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    dict(pair.model.named_parameters())["layers.2.weight"].data = torch.zeros(3, 3)
    with pytest.raises(tidal.UsageError, match=r"'layers\.2\.weight'\.data was set to a tensor of shape \(3, 3\)"):
        pair.step(1)


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
def test_reads_outside_forward_leave_saving_working(budget, tmp_path):
    pair = Pair(budget)
    pair.step(0)
    m = pair.model
    assert tuple(m.layers[0].weight.shape) == (64, 64)
    norm = float(m.layers[5].weight.detach().norm())
    assert norm == pytest.approx(float(pair.ref.layers[5].weight.detach().norm()), rel=1e-5)
    state = m.state_dict()  # (raised "illegal state transition COMPUTE -> COMPUTE")
    torch.testing.assert_close(state["layers.5.weight"], pair.ref.layers[5].weight.detach(), rtol=1e-5, atol=1e-6)
    _ = m.layers[1].bias.sum()
    pair.engine.save_checkpoint(tmp_path, tag="t")
    pair.step(1)
    pair.assert_same()


def test_load_state_dict_is_not_taken_for_a_write():
    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    state = {k: v * 0.5 for k, v in pair.ref.state_dict().items()}
    pair.model.load_state_dict(state)
    pair.ref.load_state_dict(state)
    pair.step(1)
    pair.assert_same()


@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.half(), lambda m: m.to(torch.float64),
                                     lambda m: m.layers[0].bfloat16()],
                         ids=["double", "half", "to-float64", "submodule-bfloat16"])
def test_conversions_of_the_trained_model_are_refused_by_name(convert):
    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    with pytest.raises(tidal.UsageError, match=r"a conversion of the model to torch\.(float64|float16|bfloat16)"):
        convert(pair.model)
    assert pair.model.to("cpu") is pair.model  # its own device and dtype: nothing to do
    assert pair.model.float() is pair.model
    pair.step(1)
    pair.assert_same()


def test_a_forward_without_backward_leaves_nothing_running():
    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    x, y = pair.data[1]
    pair.engine(x, y)  # grad on, no backward (evaluation without no_grad)
    big = torch.randn(1000, 1000)  # 4 MB: far past the 160 KiB "device"; plain PyTorch code
    assert big.numel() == 10 ** 6
    pair.engine.remove_hooks()
    assert not tidal._C.chunks.host_allocation_counting()


def test_num_parameters_counts_the_chunks_and_so_do_the_parameters():
    pair = Pair(BUDGETS["chunks-move"])
    expected = sum(p.numel() for p in pair.ref.parameters())
    assert sum(p.numel() for p in pair.model.parameters()) == expected  # (their shapes, nothing moved)
    assert pair.engine.num_parameters() == expected
    assert pair.engine.num_parameters(only_trainable=True) == expected


def _renormed_pair(budget):
    torch.manual_seed(0)
    model = Renormed()
    with torch.no_grad():
        model.emb.weight.mul_(3.0)  # rows above max_norm, so the forward renorms them
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 100, (4, 8), generator=g), torch.randn(4, 8, 64, generator=g)) for _ in range(3)]
    return model, ref, _engine(model, budget), data


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
def test_a_write_made_by_the_forward_is_kept(budget):
    model, ref, engine, data = _renormed_pair(budget)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    for ids, y in data:
        engine.backward(engine(ids, y))
        engine.step()
        ref(ids, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_a_write_made_by_the_forward_before_loss_backward_is_named():
    model, ref, engine, data = _renormed_pair(BUDGETS["chunks-move"])
    ids, y = data[0]
    engine(ids, y).backward()  # (loss.backward(): nothing carries the forward's write first)
    with pytest.raises(tidal.UsageError, match=r"'emb\.weight'.*engine\.backward\(loss\) rather than loss\.backward\(\)"):
        engine.step()


def test_a_lost_write_still_keeps_the_other_writes():
    # Between backward and step a write reaches nothing (the slots hold the
    # gradients); a parameter that got no gradient in that backward keeps its
    # write, and the step raises naming the lost one.
    torch.manual_seed(0)
    model, ref = TwoHeads(), None
    ref = copy.deepcopy(model)
    engine = _engine(model, BUDGETS["chunks-move"])
    x = torch.randn(4, 64)
    engine.backward(engine(x, torch.zeros(4, 64)))  # head b unused: no gradient lands there
    with torch.no_grad():
        model.a.weight.mul_(0.5)  # lost: its slot holds its gradient
        model.b.weight.zero_()  # kept
    with pytest.raises(tidal.UsageError, match=r"'a\.weight'"):
        engine.step()
    assert float(engine.state_dict()["b.weight"].abs().sum()) == 0.0
    assert torch.equal(engine.state_dict()["a.weight"], ref.a.weight.detach())


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.a(x), y)


def test_a_partial_load_keeps_a_write_to_what_it_does_not_load():
    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    with torch.no_grad():
        torch.nn.init.zeros_(pair.model.layers[0].weight)
        torch.nn.init.zeros_(pair.ref.layers[0].weight)
    part = {"layers.2.bias": torch.full((64,), 0.25)}
    pair.model.load_state_dict(part, strict=False)
    pair.ref.load_state_dict(part, strict=False)
    pair.step(1)
    pair.assert_same()


def test_parameters_held_across_reads_never_turn_empty():
    # Outside model.apply, a read that finds the device full is an error saying
    # so; it never empties a parameter the script still holds (docs/parameters.md).
    pair = Pair("64KiB")
    pair.step(0)
    ws = []
    try:
        for layer in pair.model.layers:
            ws.append(layer.weight)
    except tidal.OutOfMemoryError:
        pass
    assert 0 < len(ws) < len(pair.model.layers), "the budget was meant to hold some weights, not all"
    for w, layer in zip(ws, pair.ref.layers):
        assert w.numel() == 64 * 64
        torch.testing.assert_close(w.detach().norm(), layer.weight.detach().norm(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
def test_gathered_copies_dropped_as_deepspeed_drops_them(budget):
    # DeepSpeed's GatheredParameters(params) with modifier_rank=None hands out
    # copies and drops what is written to them (DeepSpeed-Chat's
    # save_zero_three_model reads this way; an EMA might write). Under tidal the
    # write bumps the parameter's version count (set_data keeps it): unless the
    # context settles it, the next forward takes it for a write to a placeholder
    # (a UsageError) or carries the 16-bit values of an attached one into the
    # master. Training goes on as if nothing had been written.
    from tidal.deepspeed import zero

    pair = Pair(budget)
    pair.step(0)
    _ = pair.model.layers[1].weight.shape  # one parameter attached by a read, the others placeholders
    params = list(pair.model.parameters())
    with torch.no_grad(), zero.GatheredParameters(params, modifier_rank=None):
        norms = [p.norm().item() for p in params]
        for p in params:
            p.mul_(0.0)
    want = [p.norm().item() for p in pair.ref.parameters()]
    assert norms == pytest.approx(want, rel=1e-6)
    pair.step(1)
    pair.step(2)
    pair.assert_same()
    _moved(pair.engine, budget)


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
def test_a_write_into_a_state_dict_entry_is_kept_as_in_plain_pytorch(budget):
    # Plain PyTorch's entries share the parameters' memory (Note [Writes into a
    # state dict]): a write into one, while the dict lives, is a write to the model.
    pair = Pair(budget)
    pair.step(0)
    got, want = pair.model.state_dict(), pair.ref.state_dict()
    with torch.no_grad():
        for sd in (got, want):
            sd["layers.0.weight"].mul_(0.5)
            sd["layers.2.bias"].copy_(torch.linspace(-1, 1, 64))
    pair.step(1)
    pair.step(2)
    pair.assert_same()
    _moved(pair.engine, budget)
    # The writes were taken at step 1: the dicts dying now hand nothing over
    # again (a stale value would overwrite two steps of training).
    del got, want
    pair.step(0)
    pair.assert_same()


def test_a_write_into_a_state_dict_entry_between_backward_and_step_is_named():
    pair = Pair(BUDGETS["chunks-move"])
    sd = pair.model.state_dict()
    x, y = pair.data[0]
    pair.engine.backward(pair.engine(x, y))
    sd["layers.1.weight"].zero_()
    with pytest.raises(tidal.UsageError, match=r"'layers\.1\.weight'"):
        pair.engine.step()


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
def test_reads_between_backward_and_step_see_the_weights_as_without_overlap(budget):
    # CPU Adam during backward (on by default) holds the chunks it updates; a
    # read of a held parameter or an attribute between backward and step takes
    # those updates back first (Note [Speculative updates and their undo]) and
    # reads the weights of before the step, as plain PyTorch does. (It crashed
    # with an illegal state transition COMPUTE -> COMPUTE.)
    pair = Pair(budget)
    for i in range(3):
        x, y = pair.data[i]
        pair.engine.backward(pair.engine(x, y))
        got = torch.stack([p.detach().float().norm() for p in pair.model.parameters()])
        attribute = pair.model.layers[0].weight.detach().clone()
        pair.engine.step()
        pair.ref(x, y).backward()
        want = torch.stack([p.detach().float().norm() for p in pair.ref.parameters()])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(attribute, pair.ref.layers[0].weight.detach(), rtol=1e-4, atol=5e-5)
        pair.opt.step()
        pair.opt.zero_grad(set_to_none=True)
    pair.assert_same()
    _moved(pair.engine, budget)
    assert pair.engine.memory_report()["budget_overruns"] == 0


def test_gathered_copies_between_backward_and_step_are_the_weights_before_it():
    from tidal.deepspeed import zero

    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    x, y = pair.data[1]
    pair.engine.backward(pair.engine(x, y))
    params = list(pair.model.parameters())
    with torch.no_grad(), zero.GatheredParameters(params, modifier_rank=None):
        got = [p.detach().clone() for p in params]
    pair.engine.step()
    for g, want in zip(got, pair.ref.parameters()):
        torch.testing.assert_close(g, want.detach(), rtol=1e-4, atol=5e-5)
    pair.ref(x, y).backward()
    pair.opt.step()
    pair.opt.zero_grad(set_to_none=True)
    pair.step(2)
    pair.assert_same()


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
def test_a_write_into_a_dropped_state_dict_is_kept_as_in_plain_pytorch(budget):
    # model.state_dict()[k].mul_(m) in one statement: the dict dies at once.
    pair = Pair(budget)
    pair.step(0)
    with torch.no_grad():
        for m in (pair.model, pair.ref):
            m.state_dict()["layers.3.weight"].mul_(0.25)
            m.state_dict()["layers.4.bias"].zero_()
    pair.step(1)
    pair.step(2)
    pair.assert_same()


def test_state_dict_entries_are_plain_tensors_to_torch(tmp_path):
    import copy as copy_module
    import pickle

    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    sd = pair.model.state_dict()
    value = sd["layers.0.weight"]
    assert isinstance(value, torch.Tensor)
    assert type(value * 2) is torch.Tensor and type(value.detach()) is torch.Tensor
    torch.save(sd, tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert type(loaded["layers.0.weight"]) is torch.Tensor
    assert torch.equal(loaded["layers.0.weight"], value)
    assert type(pickle.loads(pickle.dumps(value))) is torch.Tensor
    # A deep copy is the user's own: writing into it leaves the model alone.
    best = copy_module.deepcopy(sd)
    assert type(best["layers.0.weight"]) is torch.Tensor
    best["layers.0.weight"].zero_()
    del best
    pair.step(1)
    pair.step(2)
    pair.assert_same()
