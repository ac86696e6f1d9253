"""Parameters fail closed (issue 53): whatever a script does to a parameter
outside forward is exact, as plain PyTorch, or a clear tidal error naming the
parameter, the operation and the way that works; never a silent result from
an empty placeholder, never a crash from deep inside tidal or torch.

Each case trains a TanhChain of Linear(64, 64) layers under tidal and its
plain PyTorch twin with torch.optim.AdamW (same Adam, weight decay 0), at a
budget where chunks move and at one where everything fits (the budgets and
engine config of tests/python/test_engine_param_writes.py), does the same
thing to both, and compares. The table in docs/parameters.md lists them.
"""
import copy
import gc
import io

import pytest
import torch
from torch.nn.utils import clip_grad_norm_ as clip_imported_early
from torch.nn.utils import parameters_to_vector

import tidal
from tidal.models.gpt import TanhChain

# A script that imported clip_grad_norm_ before any engine existed holds
# torch's own function (tidal may have wrapped the module attribute since:
# other tests in this process made engines first).
clip_imported_early = getattr(clip_imported_early, "__wrapped__", clip_imported_early)

LR = 1e-2
BUDGETS = {"chunks-move": "160KiB", "all-fits": 0}
ids = list(BUDGETS)
budgets = pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=ids)


def _engine(model, budget):
    return tidal.initialize(model, {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "tidal": {"device": "sim", "chunk_size": "16KiB", "device_memory_budget": budget,
                  "device_margin": "4KiB", "simulated_allocator": "exact"}})


def _data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)) for _ in range(4)]


class Pair:
    """A TanhChain trained by tidal and its plain PyTorch twin."""

    def __init__(self, budget, frozen=()):
        torch.manual_seed(0)
        self.model = TanhChain(width=64, depth=6)
        for i in frozen:
            self.model.layers[i].requires_grad_(False)
        self.ref = copy.deepcopy(self.model)
        self.opt = torch.optim.AdamW([p for p in self.ref.parameters() if p.requires_grad], lr=LR,
                                     weight_decay=0.0)
        self.budget = budget
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

    def check_budget(self):
        r = self.engine.memory_report()
        assert r["budget_overruns"] == 0, r
        if self.budget:
            assert r["evictions"] > 0, r  # (chunks moved where the case says so)


def _close(a, b):
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=5e-5)


# ------------------------------------------------------------ held views
def _exact_or_held_refusal(pair, fn):
    """fn() where the device holds every parameter at once; where chunks move
    (the device holds two of the model's chunks), a tidal.OutOfMemoryError
    saying that the parameters read before are held and what works, never a
    view of memory another parameter reuses."""
    if not pair.budget:
        return fn()
    with pytest.raises(tidal.OutOfMemoryError,
                       match=r"(?s)parameter 'layers\..*still held by tensors made from them.*"
                             r"engine\.state_dict\(\)"):
        fn()
    return None


@budgets
def test_parameters_to_vector_reads_every_parameter_or_says_they_do_not_fit(budget):
    pair = Pair(budget)
    pair.step(0)
    with torch.no_grad():
        got = _exact_or_held_refusal(pair, lambda: parameters_to_vector(pair.model.parameters()))
    if got is not None:
        _close(got, parameters_to_vector(pair.ref.parameters()).detach())
    # Either way training goes on as plain PyTorch's.
    pair.step(1)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_torch_save_of_the_parameter_list_saves_their_values_or_says_they_do_not_fit(budget):
    pair = Pair(budget)
    pair.step(0)
    buf = io.BytesIO()
    if _exact_or_held_refusal(pair, lambda: torch.save(list(pair.model.parameters()), buf)) is None \
            and pair.budget:
        pair.step(1)
        pair.assert_same()
        pair.check_budget()
        return
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    want = list(pair.ref.parameters())
    assert len(loaded) == len(want)
    for a, b in zip(loaded, want):
        assert type(a) is torch.nn.Parameter
        _close(a.detach(), b.detach())
    pair.step(1)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_parameters_used_one_at_a_time_read_every_value(budget):
    # (what fits: a norm per parameter, each dropped before the next read)
    pair = Pair(budget)
    pair.step(0)
    with torch.no_grad():
        got = [float(p.norm()) for p in pair.model.parameters()]
        want = [float(p.norm()) for p in pair.ref.parameters()]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    pair.step(1)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_data_set_from_its_own_data_in_a_loop_is_kept(budget):
    pair = Pair(budget)
    pair.step(0)
    for m in (pair.model, pair.ref):
        for p in m.parameters():
            p.data = p.data * 0.5
    pair.step(1)
    pair.step(2)
    pair.assert_same()
    pair.check_budget()


# ------------------------------------------------ reads a placeholder would answer
READS = {
    "p.nbytes": lambda p: torch.tensor(p.nbytes),
    "(p == p).sum()": lambda p: (p == p).sum(),
    "(p == 0).float().mean()": lambda p: (p == 0).float().mean(),
    "p.untyped_storage().nbytes()": lambda p: torch.tensor(p.untyped_storage().nbytes()),
    "p.abs().sum()": lambda p: p.abs().sum(),
}


@budgets
@pytest.mark.parametrize("case", list(READS))
def test_a_read_of_a_held_parameter_is_its_value(case, budget):
    pair = Pair(budget)
    pair.step(0)
    with torch.no_grad():
        for p, q in zip(pair.model.parameters(), pair.ref.parameters()):
            _close(READS[case](p), READS[case](q))
    pair.step(1)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_deepcopy_of_the_state_dict_is_a_snapshot(budget):
    pair = Pair(budget)
    pair.step(0)
    snap = copy.deepcopy(pair.model.state_dict())
    want = copy.deepcopy(pair.ref.state_dict())
    assert list(snap) == list(want)
    for k in want:
        assert type(snap[k]) is torch.Tensor, k
        _close(snap[k], want[k])
    pair.step(1)
    pair.step(2)
    # still as taken: the snapshot is the user's own memory
    for k in want:
        _close(snap[k], want[k])
    pair.assert_same()
    pair.check_budget()


# ------------------------------------------------ gradients between backward and step
def _backward_only(pair, i):
    x, y = pair.data[i]
    pair.engine.backward(pair.engine(x, y))


GRAD_READS = {
    "clip_grad_norm_ imported before initialize": lambda m: clip_imported_early(m.parameters(), 0.1),
    "torch.nn.utils.clip_grad_norm_": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1),
    "get_total_norm + clip_grads_with_norm_": lambda m: torch.nn.utils.clip_grads_with_norm_(
        list(m.parameters()), 0.1, torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])),
    "p.grad norm by hand": lambda m: sum(p.grad.norm() ** 2 for p in m.parameters()),
    "p.grad is None": lambda m: [p.grad is None for p in m.parameters()],
}


@budgets
@pytest.mark.parametrize("case", list(GRAD_READS))
def test_a_gradient_read_between_backward_and_step_is_refused_by_name(case, budget):
    pair = Pair(budget)
    pair.step(0)
    _backward_only(pair, 1)
    with pytest.raises(tidal.UsageError) as e:
        GRAD_READS[case](pair.model)
    text = str(e.value)
    assert "layers.0.weight" in text and "gradient_clipping" in text and ".grad" in text
    # The refusal changed nothing: the step trains as plain PyTorch.
    pair.engine.step()
    x, y = pair.data[1]
    pair.ref(x, y).backward()
    pair.opt.step()
    pair.opt.zero_grad(set_to_none=True)
    pair.step(2)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_a_gradient_read_after_the_step_is_none_as_in_plain_pytorch(budget):
    pair = Pair(budget)
    pair.step(0)
    assert all(p.grad is None for p in pair.model.parameters())
    assert clip_imported_early(pair.model.parameters(), 0.1) == 0


# ------------------------------------------------ freezing, groups
@budgets
@pytest.mark.parametrize("how", ["requires_grad_(True)", "requires_grad = True"])
def test_unfreezing_a_layer_frozen_at_initialize_is_refused_by_name(how, budget):
    pair = Pair(budget, frozen=(2,))
    pair.step(0)
    layer = pair.model.layers[2]
    with pytest.raises(tidal.UsageError) as e:
        if how == "requires_grad_(True)":
            layer.requires_grad_(True)
        else:
            layer.weight.requires_grad = True
    text = str(e.value)
    assert "layers.2." in text and "tidal.initialize" in text
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    # The frozen layer stays frozen, and training goes on as plain PyTorch's.
    pair.step(1)
    pair.assert_same()
    pair.check_budget()
    layer.requires_grad_(False)  # (a no-op is no unfreeze)


@budgets
def test_add_param_group_is_refused_by_name(budget):
    pair = Pair(budget)
    pair.step(0)
    new = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(tidal.UsageError) as e:
        pair.engine.optimizer.add_param_group({"params": [new]})
    assert "add_param_group" in str(e.value) and "tidal.initialize" in str(e.value)
    assert len(pair.engine.optimizer.param_groups) == 1
    pair.step(1)
    pair.assert_same()


# ------------------------------------------------ a failed backward
def test_a_failed_autograd_grad_leaves_plain_pytorch_free_to_allocate():
    gc.collect()  # (an earlier test's engine collected mid-test stops the simulated device's count)
    pair = Pair(BUDGETS["chunks-move"])
    pair.step(0)
    x, y = pair.data[1]
    loss = pair.engine(x, y)
    big = loss * torch.ones(2048, 1024)  # (the backward of this product needs 8 MiB)
    with pytest.raises(torch.OutOfMemoryError):
        torch.autograd.grad(big.sum(), list(pair.model.parameters()), create_graph=True)
    del big, loss
    t = torch.ones(1000, 1000)  # plain PyTorch, after the error
    assert float(t.sum()) == 1e6
    # The engine goes on with the next batch.
    pair.engine.zero_grad()
    pair.step(2)
    pair.engine.remove_hooks()


# ------------------------------------------------ loading, new parameters
@budgets
def test_load_state_dict_with_assign_loads_the_values(budget):
    pair = Pair(budget)
    pair.step(0)
    torch.manual_seed(7)
    sd = {k: torch.randn_like(v) for k, v in pair.ref.state_dict().items()}
    before = list(pair.model.parameters())
    pair.model.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    pair.ref.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    # (plain PyTorch's assign gives the module new Parameter objects: its
    # optimizer must be made again; tidal keeps its parameters and loads the
    # values into them)
    pair.opt = torch.optim.AdamW(pair.ref.parameters(), lr=LR, weight_decay=0.0)
    assert all(a is b for a, b in zip(before, pair.model.parameters()))
    for k, v in sd.items():
        _close(pair.engine.state_dict()[k], v)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_a_parameter_made_from_a_trained_one_is_refused_by_name(budget):
    pair = Pair(budget)
    pair.step(0)
    with pytest.raises(tidal.UsageError, match=r"torch.nn.Parameter\(p\) of 'layers.1.weight'.*"
                                               r"before tidal.initialize"):
        torch.nn.Parameter(pair.model.layers[1].weight)
    # other parameters are made as before, and a copy of the values is the user's
    copy_ = torch.nn.Parameter(pair.model.layers[1].weight.detach().clone())
    assert type(copy_) is torch.nn.Parameter
    _close(copy_.detach(), pair.ref.layers[1].weight.detach())
    assert type(torch.nn.Parameter(torch.ones(2))) is torch.nn.Parameter
    pair.step(1)
    pair.assert_same()
    pair.check_budget()


# ------------------------------------------------ remove_hooks leaves nothing
def test_remove_hooks_takes_tidal_out_of_torch():
    gc.collect()  # (engines of earlier tests)
    pair = Pair(0)
    pair.step(0)
    assert getattr(torch.nn.utils.clip_grad_norm_, "__wrapped_by_tidal__", False)
    params = list(pair.model.parameters())
    grads = [torch.zeros_like(p) for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    for p, g in zip(params, grads):
        p.grad = g
    with pytest.raises(tidal.UsageError):
        opt.step()
    pair.engine.remove_hooks()
    # torch's own functions and classes again, and nothing refuses the parameters
    assert not getattr(torch.nn.utils.clip_grad_norm_, "__wrapped_by_tidal__", False)
    assert not getattr(torch.nn.utils.clip_grad.clip_grad_value_, "__wrapped_by_tidal__", False)
    assert not getattr(torch.nn.Parameter.__new__, "__wrapped_by_tidal__", False)
    assert all(type(p) is torch.nn.Parameter for p in params)
    opt.step()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.nn.Parameter(params[0])


@budgets
def test_deepcopy_of_a_parameter_is_a_parameter_holding_its_values(budget):
    pair = Pair(budget)
    pair.step(0)
    for p, q in zip(pair.model.parameters(), pair.ref.parameters()):
        c = copy.deepcopy(p)
        assert type(c) is torch.nn.Parameter and c.requires_grad
        _close(c.detach(), q.detach())
    pair.step(1)
    pair.assert_same()
    pair.check_budget()
