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
from torch.nn.utils.parametrize import register_parametrization as register_imported_early

import tidal
from tidal.models.gpt import TanhChain

# (A script that imported clip_grad_norm_ before any engine existed holds
# torch's own function: tidal wraps nothing of torch's clipping.)

LR = 1e-2
BUDGETS = {"chunks-move": "160KiB", "all-fits": 0}
ids = list(BUDGETS)
budgets = pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=ids)


def _engine(model, budget, overlap=True, accumulation=1, clipping=0.0):
    return tidal.initialize(model, {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": clipping,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "tidal": {"device": "sim", "chunk_size": "16KiB", "device_memory_budget": budget,
                  "device_margin": "4KiB", "simulated_allocator": "exact", "overlap_step": overlap}})


def _data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)) for _ in range(4)]


class Pair:
    """A TanhChain trained by tidal and its plain PyTorch twin."""

    def __init__(self, budget, frozen=(), overlap=True, accumulation=1, clipping=0.0):
        torch.manual_seed(0)
        self.model = TanhChain(width=64, depth=6)
        for i in frozen:
            self.model.layers[i].requires_grad_(False)
        self.ref = copy.deepcopy(self.model)
        self.opt = torch.optim.AdamW([p for p in self.ref.parameters() if p.requires_grad], lr=LR,
                                     weight_decay=0.0)
        self.budget = budget
        self.engine = _engine(self.model, budget, overlap, accumulation, clipping)
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
def test_torch_save_of_the_parameter_list_saves_their_values(budget):
    # (each parameter pickles as a plain Parameter holding a copy of its
    # values: torch.save holds no view of a slot, so at any budget)
    pair = Pair(budget)
    pair.step(0)
    buf = io.BytesIO()
    torch.save(list(pair.model.parameters()), buf)
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


def _ref_backward(pair, i):
    x, y = pair.data[i]
    pair.ref(x, y).backward()


def _ref_step(pair):
    pair.opt.step()
    pair.opt.zero_grad(set_to_none=True)


def _grads_equal(pair):
    for (name, p), q in zip(pair.model.named_parameters(), pair.ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert p.grad.shape == q.grad.shape, name
            _close(p.grad, q.grad)


# What scripts do to gradients between backward and step; each returns
# what it computed (a norm, or nothing). Max norm 0.05: the clip fires.
def _norm_by_hand(m):
    return torch.stack([p.grad.norm() for p in m.parameters()]).norm()


GRAD_USES = {
    "clip_grad_norm_ imported before initialize": lambda m: clip_imported_early(m.parameters(), 0.05),
    "torch.nn.utils.clip_grad_norm_": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05),
    "get_total_norm + clip_grads_with_norm_": lambda m: torch.nn.utils.clip_grads_with_norm_(
        list(m.parameters()), 0.05, torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])),
    "clip_grad_value_": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3),
    "a norm logged by hand": _norm_by_hand,
    "p.grad.mul_ by hand": lambda m: [p.grad.mul_(0.5) for p in m.parameters()] and None,
    "p.grad = 2 * p.grad": lambda m: [setattr(p, "grad", 2 * p.grad) for p in m.parameters()] and None,
    "p.grad = None on one layer": lambda m: setattr(m.layers[3].weight, "grad", None),
    "model.zero_grad()": lambda m: m.zero_grad(),
}


@budgets
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("case", list(GRAD_USES))
def test_a_gradient_used_between_backward_and_step_is_plain_pytorchs(case, overlap, budget):
    # (tidal.overlap_step: the backward updates chunks on the host speculatively;
    # a gradient read takes them back)
    pair = Pair(budget, overlap=overlap)
    for i in range(3):
        _backward_only(pair, i)
        _ref_backward(pair, i)
        _grads_equal(pair)
        got = GRAD_USES[case](pair.model)
        want = GRAD_USES[case](pair.ref)
        if want is not None:
            _close(torch.as_tensor(got), torch.as_tensor(want))
        _grads_equal(pair)  # (the clipped, written or dropped gradients)
        pair.engine.step()
        _ref_step(pair)
        assert all(p.grad is None for p in pair.model.parameters())
        pair.assert_same()
    pair.check_budget()


@budgets
def test_gradients_read_with_accumulation_are_the_window_sum(budget):
    # gradient_accumulation_steps 2: engine.backward divides the loss by 2,
    # p.grad is the sum so far; clipping it clips what the step uses.
    pair = Pair(budget, accumulation=2)
    for i in range(4):
        x, y = pair.data[i]
        pair.engine.backward(pair.engine(x, y))
        (pair.ref(x, y) / 2).backward()
        _grads_equal(pair)
        if i == 3:  # (a sum dropped: the step leaves the parameter as it is)
            pair.model.layers[3].weight.grad = None
            pair.ref.layers[3].weight.grad = None
        if i % 2 == 1:
            _close(torch.nn.utils.clip_grad_norm_(pair.model.parameters(), 0.05),
                   torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), 0.05))
            _grads_equal(pair)
        pair.engine.step()
        if i % 2 == 1:
            _ref_step(pair)
            pair.assert_same()
    pair.check_budget()


def _windows_against_plain_pytorch(raw=lambda i: False, edit=None, clipping=1e6):
    """Accumulation 2 on a moving budget, clip 1e6 (it never fires, so every
    window's last backward speculates; a clip that fires at every step: none
    does, and each folds its chunks measuring them, Note [Measured in the
    fold]): 8 micro-batches, engine.backward (or loss.backward() where
    raw(i)) beside plain PyTorch (clip_grad_norm_ at the same max norm);
    edit(module) on both models before each window's step. Each step's norm
    and weights are plain PyTorch's; returns how many chunks the windows'
    last backwards measured early (Note [Measured where folded])."""
    pair = Pair(BUDGETS["chunks-move"], accumulation=2, clipping=clipping)
    measured_early = 0
    for i in range(8):
        x, y = pair.data[i % 4]
        if raw(i):
            (pair.engine(x, y) / 2).backward()
        else:
            pair.engine.backward(pair.engine(x, y))
            measured_early += len(pair.engine._overlap.sums_measured) if i % 2 == 1 else 0
        (pair.ref(x, y) / 2).backward()
        if i % 2 == 1:
            if edit is not None:
                for m in (pair.model, pair.ref):
                    edit(m, i)
            want = float(torch.nn.utils.clip_grad_norm_([p for p in pair.ref.parameters()
                                                         if p.grad is not None], clipping))
        pair.engine.step()
        if i % 2 == 1:
            _ref_step(pair)
            assert pair.engine.get_global_grad_norm() == pytest.approx(want, rel=1e-5), (i, raw(i))
            pair.assert_same()
    pair.check_budget()
    return measured_early


_CLIPS = pytest.mark.parametrize("clipping", [1e6, 1e-4], ids=["speculating", "clip-fires"])


@_CLIPS
def test_gradients_written_after_backward_measured_their_sums_are_measured_again(clipping):
    # Note [Measured where folded] (tidal/engine/overlap.py): with
    # accumulation, the window's last backward measures each chunk's sums
    # for the step's norm as it folds them on the host. A script that then
    # scales the gradients, or drops one, changes what the step must
    # measure: the norm and the weights are plain PyTorch's on the written
    # gradients.
    def edit(m, i):
        for p in m.parameters():
            p.grad.mul_(0.5)
        m.layers[i % 6].bias.grad = None

    assert _windows_against_plain_pytorch(edit=edit, clipping=clipping) > 0  # (the path fired)


@_CLIPS
def test_a_window_of_raw_backwards_after_one_measured_early_is_measured_whole(clipping):
    # Note [Measured where folded]: a window ended by engine.backward has its
    # host chunks' sums measured in that backward, the step the rest. The
    # next window's micro-batches run loss.backward() (no engine.backward, so
    # nothing is measured early): its step measures every sum, not only
    # those the last window's backward did not. The norm and the weights are
    # plain PyTorch's, window after window.
    assert _windows_against_plain_pytorch(raw=lambda i: (i // 2) % 2 == 1, clipping=clipping) > 0  # (the path fired)


def test_a_raw_backward_after_a_window_measured_in_its_folds_is_what_it_was_without_overlap():
    # The clip fires at every step, so a window's last engine.backward
    # launches nothing and its folds measure the sums (Note [Measured in the
    # fold]); nothing was taken up, so a loss.backward() on the same graph
    # before the step is not refused, as it was not before those measures
    # were made there: its landings drop them (the step would measure
    # again). Whatever the engine then does with such a window, it does the
    # same with and without tidal.overlap_step, bit for bit.
    runs = {}
    for overlap in (False, True):
        pair = Pair(BUDGETS["chunks-move"], overlap=overlap, accumulation=2, clipping=1e-4)
        measured, steps = 0, []
        for i in range(8):
            x, y = pair.data[i % 4]
            loss = pair.engine(x, y)
            pair.engine.backward(loss, retain_graph=True)
            if i % 2 == 1 and i > 2:
                if overlap:
                    measured += len(pair.engine._overlap.sums_measured)
                loss.backward()
            pair.engine.step()
            steps.append((pair.engine.global_steps, pair.engine.get_global_grad_norm()))
        pair.check_budget()
        runs[overlap] = (steps, pair.engine.parameters_fp32())
    assert measured > 0  # (the path fired)
    assert runs[True][0] == runs[False][0]
    for name, want in runs[False][1].items():
        assert torch.equal(runs[True][1][name], want), name


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_raw_backward_between_engine_backward_and_step_is_refused_by_name(accumulation):
    # engine.backward(loss, retain_graph=True), then loss.backward() before the
    # step: with tidal.overlap_step the first backward took chunks up (CPU
    # Adam on them, their sums measured), where the second's gradients cannot
    # be added exactly. Where the update is done and its pins were let go (as
    # Note [Weights up as they are updated] lets them go during backward;
    # forced here, so the case does not hang on the worker's timing), the
    # overlap refuses it by name and the step refuses until zero_grad
    # (before, the gradient landed on the updated weights, and the step went
    # on). zero_grad drops the window, and training goes on as plain
    # PyTorch's with that window dropped.
    pair = Pair(BUDGETS["chunks-move"], accumulation=accumulation)
    overlap = pair.engine._overlap
    refused = False
    for i in range(16):
        x, y = pair.data[i % 4]
        loss = pair.engine(x, y)
        pair.engine.backward(loss, retain_graph=True)
        (pair.ref(x, y) / accumulation).backward()
        ends_window = (i + 1) % accumulation == 0
        if ends_window and not refused and overlap._pending:
            overlap.finish()  # (every update done, its pins let go; still to be validated)
            overlap.release_held()  # (and those of chunks left to the step: none held)
            with pytest.raises(tidal.UsageError,
                               match=r"loss\.backward\(\).*'layers\.\d+\.(weight|bias)'.*zero_grad"):
                loss.backward()
            with pytest.raises(tidal.UsageError, match="zero_grad"):
                pair.engine.step()
            pair.engine.zero_grad()
            pair.opt.zero_grad(set_to_none=True)
            refused = True
            continue
        pair.engine.step()
        if ends_window:
            _ref_step(pair)
    assert refused  # (the path fired)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_a_gradient_read_after_a_raw_backward_is_plain_pytorchs(budget):
    pair = Pair(budget)
    for i in range(2):
        x, y = pair.data[i]
        pair.engine(x, y).backward()  # (loss.backward(), not engine.backward)
        _ref_backward(pair, i)
        _close(torch.nn.utils.clip_grad_norm_(pair.model.parameters(), 0.05),
               torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), 0.05))
        pair.engine.step()
        _ref_step(pair)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_the_configs_clipping_and_norm_see_the_gradients_the_script_wrote(budget):
    # gradient_clipping in the config on top of a scale by hand: the step's
    # global norm is the norm of the written gradients.
    pair = Pair(budget, clipping=0.05)
    _backward_only(pair, 0)
    _ref_backward(pair, 0)
    for p in pair.model.parameters():
        p.grad.mul_(0.5)
    with torch.no_grad():
        for q in pair.ref.parameters():
            q.grad.mul_(0.5)
    want = float(torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), 0.05))
    pair.engine.step()
    _ref_step(pair)
    assert pair.engine.get_global_grad_norm() == pytest.approx(want, rel=1e-5)
    pair.assert_same()
    pair.check_budget()


def test_a_gradient_under_fp16_is_refused_by_name():
    torch.manual_seed(0)
    model = TanhChain(width=64, depth=2)
    engine = tidal.initialize(model, {
        "train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "tidal": {"device": "sim", "chunk_size": "16KiB"}})
    x, y = _data()[0]
    engine.backward(engine(x, y))
    with pytest.raises(tidal.UsageError, match=r"'layers.0.weight'.grad read between .*fp16.*"
                                               r"gradient_clipping"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    engine.step()
    assert model.layers[0].weight.grad is None
    engine.remove_hooks()


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
def test_a_trained_layer_frozen_and_unfrozen_at_run_time_trains_as_plain_pytorch(budget):
    """A layer trained from initialize, frozen for some steps (its weights
    and Adam states stay; with chunks moving its chunks go back to the host
    as any others) and unfrozen again: plain PyTorch's steps throughout."""
    pair = Pair(budget)
    pair.step(0)
    for model in (pair.model, pair.ref):
        model.layers[2].requires_grad_(False)
    pair.step(1)
    pair.step(2)
    pair.assert_same()
    for model in (pair.model, pair.ref):
        model.layers[2].requires_grad_(True)
    pair.step(3)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_autograd_grad_with_respect_to_every_parameter(budget):
    """torch.autograd.grad(loss, model.parameters()) returns gradients as
    tensors of their own, outside the chunks, together the model's size: plain
    PyTorch's where the device holds them beside the chunks, and where chunks
    move (the device holds two of the model's chunks) torch's out-of-memory
    error of the budget, after which the engine goes on."""
    pair = Pair(budget)
    pair.step(0)
    x, y = pair.data[1]
    loss = pair.model(x, y)
    if pair.budget:
        with pytest.raises(torch.OutOfMemoryError, match="device budget"):
            torch.autograd.grad(loss, list(pair.model.parameters()))
        del loss
    else:
        got = torch.autograd.grad(loss, list(pair.model.parameters()))
        want = torch.autograd.grad(pair.ref(x, y), list(pair.ref.parameters()))
        for g, w in zip(got, want, strict=True):
            _close(g, w)
    pair.step(2)
    pair.assert_same()
    pair.check_budget()


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


@budgets
@pytest.mark.parametrize("source", ["same shape", "other shape", "storage"])
def test_torch_tensors_own_set_on_a_trained_parameter_is_a_data_set(source, budget):
    """torch.Tensor.set_(p, t) (the base class's method, past the engine's
    refusal) between steps: seen as `p.data = t` at the next forward. A tensor
    of p's shape is taken, as plain PyTorch's set_; any other shape (a flat
    storage too) is refused by name and p keeps its value."""
    pair = Pair(budget)
    pair.step(0)
    p = pair.model.layers[1].weight
    make = {"same shape": lambda: torch.full((64, 64), 0.5), "other shape": lambda: torch.ones(3),
            "storage": lambda: torch.full((64, 64), 0.5).untyped_storage()}[source]
    with torch.no_grad():
        torch.Tensor.set_(p, make())
    if source == "same shape":
        with torch.no_grad():
            torch.Tensor.set_(pair.ref.layers[1].weight, make())
        pair.step(1)
    else:
        with pytest.raises(tidal.UsageError, match=r"'layers.1.weight'.data was set to a tensor of "
                                                   r"shape \((3|4096),\).*keeps its previous one"):
            pair.step(1)
        pair.engine.zero_grad()  # (the reference never ran step 1)
        _close(pair.model.layers[1].weight.detach(), pair.ref.layers[1].weight.detach())
        pair.step(2)
    pair.assert_same()
    pair.check_budget()


@budgets
@pytest.mark.parametrize("how", ["p.set_(t)", "torch.Tensor.set_(p, t)"])
def test_set_inside_a_forward_is_refused_by_name(how, budget):
    """set_ in a forward pre-hook, on the parameter the module is about to
    use (attached: its memory is a chunk's slot): refused naming it; the
    next steps train as plain PyTorch's."""
    pair = Pair(budget)
    pair.step(0)

    def hook(module, args):
        with torch.no_grad():
            t = torch.full((64, 64), 0.5)
            module.weight.set_(t) if how == "p.set_(t)" else torch.Tensor.set_(module.weight, t)

    handle = pair.model.layers[1].register_forward_pre_hook(hook)
    with pytest.raises(tidal.UsageError, match="layers.1.weight"):
        pair.step(1)
    handle.remove()
    pair.engine.zero_grad()
    pair.step(2)
    pair.assert_same()
    pair.check_budget()


@budgets
@pytest.mark.parametrize("source", ["same shape", "other shape", "storage"])
def test_set_on_a_trained_parameter_is_refused_by_name(source, budget):
    pair = Pair(budget)
    pair.step(0)
    p = pair.model.layers[2].weight
    t = {"same shape": torch.ones(64, 64), "other shape": torch.ones(3),
         "storage": torch.ones(64, 64).untyped_storage()}[source]
    with torch.no_grad(), pytest.raises(tidal.UsageError,
                                        match=r"set_\(\) on 'layers.2.weight'.*p.copy_\(t\)"):
        p.set_(t)
    # nothing changed: the parameter still reads its trained value, and what
    # the message offers is exact, in both
    _close(p.detach(), pair.ref.layers[2].weight.detach())
    with torch.no_grad():
        p.copy_(torch.full((64, 64), 0.01))
        pair.ref.layers[2].weight.copy_(torch.full((64, 64), 0.01))
    pair.step(1)
    pair.assert_same()
    pair.check_budget()
    pair.engine.remove_hooks()  # given back: set_ is plain PyTorch's again
    with torch.no_grad():
        p.set_(torch.ones(3))
    assert p.shape == (3,)


# ------------------------------------------------ remove_hooks leaves nothing
def test_remove_hooks_takes_tidal_out_of_torch():
    gc.collect()  # (engines of earlier tests)
    pair = Pair(0)
    pair.step(0)
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
    assert not getattr(torch.nn.Parameter.__new__, "__wrapped_by_tidal__", False)
    assert not getattr(torch.nn.utils.parametrize.register_parametrization, "__wrapped_by_tidal__", False)
    assert not torch.nn.modules.module._global_parameter_registration_hooks
    assert all("apply" not in m.__dict__ and "_apply" not in m.__dict__ for m in pair.model.modules())
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


# ------------------------------------------------ identity, pickling, copies
@budgets
@pytest.mark.parametrize("how", ["copy.copy", "pickle", "torch.save"])
def test_a_copy_or_a_pickle_of_a_parameter_is_a_plain_parameter_holding_its_values(how, budget):
    import pickle

    def roundtrip(p):
        if how == "copy.copy":
            return copy.copy(p)
        if how == "pickle":
            return pickle.loads(pickle.dumps(p))
        buf = io.BytesIO()
        torch.save(p, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    pair = Pair(budget)
    pair.step(0)
    for p, q in zip(pair.model.parameters(), pair.ref.parameters()):
        c = roundtrip(p)
        assert type(c) is torch.nn.Parameter and c.requires_grad
        _close(c.detach(), q.detach())
    # The copies are the user's: training goes on and they stay as taken.
    kept = [roundtrip(p) for p in pair.model.layers[0].parameters()]
    want = [q.detach().clone() for q in pair.ref.layers[0].parameters()]
    pair.step(1)
    for c, w in zip(kept, want):
        _close(c.detach(), w)
    pair.assert_same()
    pair.check_budget()


def test_the_parameters_class_pickles_by_name_and_is_given_back():
    import pickle
    pair = Pair(0)
    p = pair.model.layers[0].weight
    cls = type(p)
    # (type(p) is nn.Parameter is False while the engine trains it: docs/parameters.md)
    assert cls is not torch.nn.Parameter and isinstance(p, torch.nn.Parameter)
    assert pickle.loads(pickle.dumps(cls)) is cls
    import tidal.engine.user_param as user_param
    assert getattr(user_param, cls.__qualname__) is cls
    pair.engine.remove_hooks()
    assert type(p) is torch.nn.Parameter


# ------------------------------------------------ parametrize after initialize
class _Symmetric(torch.nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


PARAMETRIZATIONS = {
    "register_parametrization": lambda layer: torch.nn.utils.parametrize.register_parametrization(
        layer, "weight", _Symmetric()),
    "register_parametrization imported before initialize": lambda layer: getattr(
        register_imported_early, "__wrapped__", register_imported_early)(layer, "weight", _Symmetric()),
    "orthogonal": lambda layer: torch.nn.utils.parametrizations.orthogonal(layer),
    "weight_norm": lambda layer: torch.nn.utils.parametrizations.weight_norm(layer),
}


@budgets
@pytest.mark.parametrize("case", list(PARAMETRIZATIONS))
def test_a_parametrization_after_initialize_is_refused_by_name(case, budget):
    pair = Pair(budget)
    pair.step(0)
    layer = pair.model.layers[2]
    weight = layer.weight
    with pytest.raises(tidal.UsageError, match=r"'layers\.2\.weight'.*before tidal\.initialize"):
        PARAMETRIZATIONS[case](layer)
    # torch's own registration did not finish: the layer keeps its parameter and trains on.
    assert not torch.nn.utils.parametrize.is_parametrized(layer)
    assert layer.weight is weight
    pair.step(1)
    pair.assert_same()
    pair.check_budget()


# ------------------------------------------------ parameters registered after initialize
def _replace_layer(model):
    model.layers[2] = torch.nn.Linear(64, 64)


def _replace_weight(model):
    model.layers[2].weight = torch.nn.Parameter(torch.zeros(64, 64))


def _new_parameter(model):
    model.layers[2].register_parameter("scale", torch.nn.Parameter(torch.ones(64)))


def _tie(model):
    model.layers[2].weight = model.layers[1].weight


def _into_a_new_module(model):
    model.add_module("extra", torch.nn.Module())  # (no parameters: let in, and guarded from then on)
    model.extra.register_parameter("w", torch.nn.Parameter(torch.zeros(3)))


REGISTRATIONS = {
    "a new layer": (_replace_layer, r"'layers\.2' set to a Linear with the parameter 'weight'"),
    "a new weight": (_replace_weight, r"'layers\.2\.weight': a parameter of shape \(64, 64\).*replacing "
                                      r"the one tidal trains as 'layers\.2\.weight'"),
    "register_parameter": (_new_parameter, r"'layers\.2\.scale': a parameter of shape \(64,\)"),
    "tying after initialize": (_tie, r"'layers\.2\.weight' set to the parameter tidal trains as "
                                     r"'layers\.1\.weight'"),
    "into a module added later": (_into_a_new_module, r"'extra\.w': a parameter of shape \(3,\)"),
}


@budgets
@pytest.mark.parametrize("case", list(REGISTRATIONS))
def test_a_parameter_registered_after_initialize_is_refused_by_name(case, budget):
    """Note [Parameters registered after initialize]: the new parameter was
    used by the forward and never trained, without a word, and
    engine.save_checkpoint kept the replaced one's state. Refused, naming
    it; the model keeps what it had and trains on as plain PyTorch does."""
    pair = Pair(budget)
    pair.step(0)
    before = dict(pair.model.named_parameters())
    fn, message = REGISTRATIONS[case]
    with pytest.raises(tidal.UsageError, match=f"(?s){message}.*before tidal\\.initialize"):
        fn(pair.model)
    after = dict(pair.model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    pair.step(1)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_modules_without_new_parameters_may_be_put_into_the_model(budget):
    """An activation swapped, a layer wrapped in a container of its own, a
    layer dropped: no parameter the engine does not train comes in, so
    torch's registration goes through; training equals plain PyTorch's
    with the same change."""
    pair = Pair(budget)
    pair.step(0)
    for m in (pair.model, pair.ref):
        m.layers[3] = torch.nn.Sequential(m.layers[3])
        m.extra = torch.nn.Tanh()
    pair.step(1)
    pair.step(2)
    got = pair.engine.state_dict()
    assert "layers.3.0.weight" in got
    pair.assert_same()
    pair.check_budget()
    pair.engine.remove_hooks()
    pair.model.layers[2] = torch.nn.Linear(64, 64)  # (the model is plain PyTorch's again)


# ------------------------------------------------ an EMA of the weights
@budgets
@pytest.mark.parametrize("accumulation, clipping", [(1, 0.0), (2, 0.0), (1, 1e-3)])
def test_the_engines_ema_is_the_ema_by_hand_of_plain_pytorch(accumulation, clipping, budget):
    """Also where the clip fires on every step, so each step leaves its host
    updates to the next forward (Note [CPU Adam under the next forward]):
    the EMA waits for them (it read masters a worker's update held)."""
    decay = 0.8
    pair = Pair(budget, accumulation=accumulation, clipping=clipping)
    ref_ema = None
    for i in range(4):
        x, y = pair.data[i]
        pair.engine.backward(pair.engine(x, y))
        pair.engine.step()
        (pair.ref(x, y) / accumulation).backward()
        if (i + 1) % accumulation:
            continue
        if clipping:
            torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), clipping)
        _ref_step(pair)
        if ref_ema is None:
            # started after the first step, from the weights then
            pair.engine.ema(decay)
            ref_ema = {k: q.detach().clone() for k, q in pair.ref.named_parameters()}
            continue
        with torch.no_grad():
            for k, q in pair.ref.named_parameters():
                ref_ema[k].mul_(decay).add_(q, alpha=1 - decay)
    got = pair.engine.ema_state_dict()
    assert sorted(got) == sorted(ref_ema)
    for k in ref_ema:
        _close(got[k], ref_ema[k])
    pair.assert_same()
    pair.check_budget()


def test_ema_refuses_a_bad_decay_and_a_read_before_it_starts():
    pair = Pair(0)
    with pytest.raises(tidal.UsageError, match=r"before engine\.ema\(decay\)"):
        pair.engine.ema_state_dict()
    for bad in (1.0, -0.1, "0.9", True):
        with pytest.raises(ValueError, match=r"decay must be a float in \[0, 1\)"):
            pair.engine.ema(bad)


@budgets
def test_inside_a_forward_the_trained_parameters_have_their_own_class(budget):
    """Note [Plain classes inside a forward]: while the root's forward runs,
    trainable parameters are plain nn.Parameter objects (no __torch_function__
    per torch call); frozen ones keep the engine's class; outside, and after a
    forward that raised, every parameter has the engine's class again, and
    reads and training stay plain PyTorch's."""
    pair = Pair(budget, frozen=(2,))
    seen = {}

    def record(module, args):
        seen[module] = [type(q) for q in module.parameters(recurse=False)]

    handles = [layer.register_forward_pre_hook(record) for layer in pair.model.layers]
    pair.step(0)
    for i, layer in enumerate(pair.model.layers):
        inside = seen[layer]
        if i == 2:
            assert all(t is not torch.nn.Parameter for t in inside), (i, inside)
        else:
            assert inside and all(t is torch.nn.Parameter for t in inside), (i, inside)
    params = list(pair.model.parameters())
    assert all(type(q) is not torch.nn.Parameter and isinstance(q, torch.nn.Parameter) for q in params)

    def boom(module, args):
        raise RuntimeError("a forward that raises")

    failing = pair.model.layers[3].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="a forward that raises"):
        pair.engine(*pair.data[1])
    failing.remove()
    for h in handles:
        h.remove()
    assert all(type(q) is not torch.nn.Parameter for q in params)
    # Outside a forward the engine's class serves a held parameter's read.
    for q, r in zip(params, pair.ref.parameters(), strict=True):
        _close(q, r)
    for i in (1, 2):
        pair.step(i)
    pair.assert_same()
    pair.check_budget()

