"""engine.optimizer fails closed (Note [engine.optimizer fails closed] in
python/tidal/engine/param_groups.py): what a script does through the torch
optimizer API of engine.optimizer is exact, as plain torch.optim.AdamW, or a
clear tidal.UsageError naming what it touched and the way that works, with
nothing changed; never a silent wrong result.

  * engine.optimizer.state (Adam's states live in the chunks): every read,
    write, reset or replacement is refused;
  * engine.optimizer.zero_grad(set_to_none=False) between backward and step
    zeroes the waiting gradients and the step still runs, as torch's;
  * a change of the groups' members (a parameter taken out, put in, moved, a
    group added or removed) is refused at the write; freezing a parameter is
    the way that works.

Each case trains a TanhChain under tidal, in two parameter groups, and its
plain PyTorch twin with torch.optim.AdamW over the same groups (weight decay
on, so a step with zero gradients moves the weights), at a budget where
chunks move and at one where everything fits.
"""
import collections
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal.models.gpt import TanhChain

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import measured_budget, within_budget  # noqa: E402

LR = 1e-2
WD = 0.05
# "measured": engine_helpers.measured_budget, a budget below the state from what this machine measures.
BUDGETS = {"chunks-move": "measured", "all-fits": 0}
budgets = pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def _groups(model):
    """Two groups: the weights, and the biases at half the rate without decay."""
    weights = [m.weight for m in model.layers]
    biases = [m.bias for m in model.layers]
    return [{"params": weights, "name": "weights"},
            {"params": biases, "lr": LR / 2, "weight_decay": 0.0, "name": "biases"}]


class Pair:
    """A TanhChain trained by tidal and its plain PyTorch twin (AdamW, same groups)."""

    def __init__(self, budget, overlap=True, accumulation=1, fp16=False):
        torch.manual_seed(0)
        self.model = TanhChain(width=64, depth=6)
        self.ref = copy.deepcopy(self.model)
        self.opt = torch.optim.AdamW(_groups(self.ref), lr=LR, weight_decay=WD)
        self.accumulation = accumulation
        g = torch.Generator().manual_seed(3)
        self.data = [(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g))
                     for _ in range(8)]
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
               "gradient_accumulation_steps": accumulation,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
               "tidal": {"device": "sim", "chunk_size": "16KiB", "device_memory_budget": budget,
                         "device_margin": "4KiB", "simulated_allocator": "exact",
                         "overlap_step": overlap}}
        if fp16:
            cfg["fp16"] = {"enabled": True}
        if budget == "measured":
            # (Half the 16-bit chunks as room: measured without the groups, whose
            # weights and biases lie in separate chunks, so a module needs two.)
            budget = cfg["tidal"]["device_memory_budget"] = measured_budget(self.model, cfg, self.data[:2], chunk_share=0.5)
        self.budget = budget
        self.engine = tidal.initialize(self.model, cfg, model_parameters=_groups(self.model))

    def backward(self, i):
        x, y = self.data[i]
        self.engine.backward(self.engine(x, y))
        (self.ref(x, y) / self.accumulation).backward()

    def step(self, ref_zero_grad=True):
        self.engine.step()
        self.opt.step()
        if ref_zero_grad:
            self.opt.zero_grad(set_to_none=True)

    def train(self, i):
        self.backward(i)
        self.step()

    def assert_same(self, atol=1e-6):
        got = self.engine.state_dict()
        for k, v in self.ref.state_dict().items():
            torch.testing.assert_close(got[k].float(), v.float(), rtol=0, atol=atol,
                                       msg=lambda m, k=k: f"{k}: {m}")

    def check_budget(self):
        r = self.engine.memory_report()
        assert r["budget_overruns"] == 0, r
        within_budget(self.engine)
        if self.budget:
            assert r["evictions"] > 0, r  # (chunks moved where the case says so)


def _group_ids(opt):
    return [(id(g), [id(p) for p in g["params"]]) for g in opt.param_groups]


# ------------------------------------------------------------ optimizer.state
STATE_USES = {
    "state[p]": lambda o, p: o.state[p],
    "state[p]['exp_avg'].zero_()": lambda o, p: o.state[p]["exp_avg"].zero_(),
    "state.clear()": lambda o, p: o.state.clear(),
    "len(state)": lambda o, p: len(o.state),
    "bool(state)": lambda o, p: bool(o.state),
    "p in state": lambda o, p: p in o.state,
    "state.get(p)": lambda o, p: o.state.get(p),
    "state.values()": lambda o, p: [s.clear() for s in o.state.values()],
    "state.items()": lambda o, p: dict(o.state.items()),
    "iter(state)": lambda o, p: list(o.state),
    "state[p] = {}": lambda o, p: o.state.__setitem__(p, {}),
    "del state[p]": lambda o, p: o.state.__delitem__(p),
    "state.pop(p)": lambda o, p: o.state.pop(p),
    "state.update(...)": lambda o, p: o.state.update({p: {}}),
    "state = defaultdict(dict)": lambda o, p: setattr(o, "state", collections.defaultdict(dict)),
    "copy.deepcopy(state)": lambda o, p: copy.deepcopy(o.state),
}


@budgets
@pytest.mark.parametrize("use", list(STATE_USES))
def test_optimizer_state_is_refused_by_name_and_nothing_changes(use, budget):
    pair = Pair(budget)
    pair.train(0)
    pair.train(1)
    p = pair.model.layers[2].weight
    with pytest.raises(tidal.UsageError) as e:
        STATE_USES[use](pair.engine.optimizer, p)
    msg = str(e.value)
    assert "engine.optimizer.state" in msg and "chunks" in msg
    assert "engine.save_checkpoint" in msg and "engine.load_checkpoint" in msg
    if "[p]" in use or "(p)" in use or "p in" in use:
        assert "'layers.2.weight'" in msg  # (the parameter, by name)
    # The Adam states were not touched: training goes on as plain AdamW's
    # (whose state the script did not reset either).
    for i in range(2, 4):
        pair.train(i)
    pair.assert_same()
    pair.check_budget()


def test_optimizer_state_keeps_torch_machinery_working():
    pair = Pair(0)
    opt = pair.engine.optimizer
    assert "chunks" in repr(opt.state) and "parameter group" in repr(opt)
    # torch's LR schedulers still drive the engine's groups.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(pair.opt, step_size=1, gamma=0.5)
    for i in range(3):
        pair.train(i)
        sched.step()
        ref_sched.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in pair.opt.param_groups]
    pair.assert_same()
    # A copy of the groups (to log them) is plain lists and dicts.
    copied = copy.copy(opt.param_groups)
    assert type(copied) is list and copied[0] is opt.param_groups[0]
    logged = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert logged[1]["name"] == "biases" and logged[1]["lr"] == pytest.approx(LR / 2 / 8)


# ------------------------------------------------------------ zero_grad(set_to_none=False)
@budgets
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_zero_grad_keeping_the_gradients_steps_with_zeros_as_adamw(overlap, budget):
    """Between backward and step: plain AdamW steps with zero gradients
    (momentum and weight decay move the weights); so does tidal."""
    pair = Pair(budget, overlap=overlap)
    for i in range(4):
        pair.backward(i)
        before = pair.engine.state_dict()
        if i in (1, 2):
            pair.engine.optimizer.zero_grad(set_to_none=False)
            pair.opt.zero_grad(set_to_none=False)
            assert all(p.grad is not None and not p.grad.any() for p in pair.model.parameters())
        pair.step()
        pair.assert_same()
        if i in (1, 2):  # (the step ran: the weights moved)
            after = pair.engine.state_dict()
            assert not torch.equal(after["layers.0.weight"], before["layers.0.weight"])
    pair.check_budget()


@budgets
def test_zero_grad_keeping_the_gradients_mid_accumulation_zeroes_the_sum(budget):
    pair = Pair(budget, overlap=False, accumulation=2)
    for i in range(6):
        pair.backward(i)
        if i in (2, 5):  # (after the window's first micro-batch, and after its last)
            pair.engine.optimizer.zero_grad(set_to_none=False)
            pair.opt.zero_grad(set_to_none=False)
        if i % 2 == 1:
            pair.step()
            pair.assert_same()
        else:
            pair.engine.step()  # (not a boundary: the engine does not step)
    pair.check_budget()


@budgets
def test_zero_grad_after_the_step_and_dropping_gradients_are_adamws(budget):
    """set_to_none=False with nothing waiting changes nothing; set_to_none=True
    (the default) drops the gradients and the step leaves the weights, as
    AdamW skips parameters without a gradient."""
    pair = Pair(budget)
    for i in range(4):
        pair.backward(i)
        if i == 2:
            pair.engine.optimizer.zero_grad()
            pair.opt.zero_grad()
        pair.step(ref_zero_grad=False)
        pair.engine.optimizer.zero_grad(set_to_none=False)
        pair.opt.zero_grad(set_to_none=True)  # (tidal's p.grad is None after a step)
        assert all(p.grad is None for p in pair.model.parameters())
        pair.assert_same()
    pair.check_budget()


def test_zero_grad_keeping_the_gradients_under_fp16_is_refused_and_nothing_changes():
    runs = []
    for refused in (True, False):
        pair = Pair(0, fp16=True)
        for i in range(3):
            pair.engine.backward(pair.engine(*pair.data[i]))
            if refused and i == 1:
                said = r"zero_grad\(set_to_none=False\).*fp16.*Nothing was changed"
                with pytest.raises(tidal.UsageError, match=said):
                    pair.engine.optimizer.zero_grad(set_to_none=False)
            pair.engine.step()
        runs.append(pair.engine.state_dict())
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


# ------------------------------------------------------------ param_groups' members
def _take_out(opt, model):
    g = opt.param_groups[0]
    g["params"] = [p for p in g["params"] if p is not model.layers[2].weight]


def _move(opt, model):
    # (the first half of a move between groups is refused already)
    opt.param_groups[0]["params"].remove(model.layers[2].weight)
    opt.param_groups[1]["params"].append(model.layers[2].weight)


MEMBER_CHANGES = {
    'g["params"] = [... without p]': (_take_out, "take out 'layers.2.weight'"),
    'g["params"].remove(p)': (_move, "take out 'layers.2.weight'"),
    'g["params"].pop()': (lambda o, m: o.param_groups[0]["params"].pop(),
                          "take out 'layers.5.weight'"),
    'del g["params"][0]': (lambda o, m: o.param_groups[0]["params"].__delitem__(0),
                           "take out 'layers.0.weight'"),
    'g["params"][0] = a bias': (
        lambda o, m: o.param_groups[0]["params"].__setitem__(0, m.layers[0].bias),
        "take out 'layers.0.weight' and put in 'layers.0.bias'"),
    'g["params"] += [p] (twice)': (
        lambda o, m: o.param_groups[0]["params"].__iadd__([m.layers[1].weight]),
        "list 'layers.1.weight' twice"),
    'g["params"].append(foreign)': (
        lambda o, m: o.param_groups[1]["params"].append(torch.nn.Parameter(torch.zeros(3))),
        r"put in a tensor of shape \[3\] that is not a parameter"),
    'g["params"].clear()': (lambda o, m: o.param_groups[1]["params"].clear(),
                            "take out 'layers.0.bias'"),
    'g.pop("params")': (lambda o, m: o.param_groups[0].pop("params"), "take out 'layers.0.weight'"),
    'g.update(params=[])': (lambda o, m: o.param_groups[0].update(params=[]),
                            "take out 'layers.0.weight'"),
    "param_groups.append({...})": (
        lambda o, m: o.param_groups.append({"params": [m.layers[2].weight], "lr": 0.0}),
        r"param_groups.append\(...\) \(a group of 'layers.2.weight'\)"),
    "param_groups.pop()": (lambda o, m: o.param_groups.pop(), r"param_groups.pop\(-1\)"),
    "del param_groups[0]": (lambda o, m: o.param_groups.__delitem__(0),
                            r"param_groups\[0\] deleted"),
    "param_groups[0] = dict(...)": (
        lambda o, m: o.param_groups.__setitem__(0, dict(o.param_groups[0], lr=0.0)),
        r"param_groups\[0\] = \.\.\."),
    "param_groups.reverse()": (lambda o, m: o.param_groups.reverse(), r"param_groups.reverse\(\)"),
    "param_groups = [...]": (lambda o, m: setattr(o, "param_groups", list(o.param_groups)),
                             r"param_groups = <a list>"),
}


@budgets
@pytest.mark.parametrize("change", list(MEMBER_CHANGES))
def test_a_change_of_the_groups_members_is_refused_by_name_and_nothing_changes(change, budget):
    pair = Pair(budget)
    pair.train(0)
    opt = pair.engine.optimizer
    before = _group_ids(opt)
    fn, said = MEMBER_CHANGES[change]
    with pytest.raises(tidal.UsageError, match=said) as e:
        fn(opt, pair.model)
    msg = str(e.value)
    assert "fixed at tidal.initialize" in msg and "requires_grad_(False)" in msg
    assert "Nothing was changed" in msg
    assert _group_ids(opt) == before
    for i in range(1, 4):
        pair.train(i)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_writes_that_keep_the_members_are_obeyed(budget):
    """A group's hyperparameters, and its "params" in another order, as AdamW."""
    pair = Pair(budget)
    pair.train(0)
    for opt in (pair.engine.optimizer, pair.opt):
        g0, g1 = opt.param_groups
        g0["params"] = list(reversed(g0["params"]))
        g0["params"].reverse()
        g1.update(lr=LR / 4, weight_decay=0.01)
        g0["betas"] = (0.8, 0.99)
        g0.setdefault("params", [])
    for i in range(1, 4):
        pair.train(i)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_freezing_is_the_way_to_stop_training_a_parameter(budget):
    """What the refusal points to: a parameter frozen mid-run (tidal) ends as
    one taken out of its group (plain AdamW), and requires_grad_(True) resumes
    it as plain AdamW resumes a parameter that had no gradient."""
    pair = Pair(budget)
    p, q = pair.model.layers[2].weight, pair.ref.layers[2].weight
    pair.train(0)
    p.requires_grad_(False)
    g = pair.opt.param_groups[0]
    g["params"] = [x for x in g["params"] if x is not q]
    for i in range(1, 3):
        pair.train(i)
    pair.assert_same()
    p.requires_grad_(True)
    q.grad = None  # (plain AdamW's zero_grad left out the parameter outside its groups)
    g["params"].append(q)
    for i in range(3, 5):
        pair.train(i)
    pair.assert_same()
    pair.check_budget()
