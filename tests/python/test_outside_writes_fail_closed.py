"""Writes and reads outside the forward that once gave silent wrong results,
against plain PyTorch: entries of `model.state_dict()` read and written
beside the parameters (Note [Writes into a state dict] in
python/tidal/engine/state_dict_bridge.py), tied weights in a state dict, and
post-accumulate-grad hooks (Note [Hooks after a gradient accumulates] in
python/tidal/engine/user_param.py).

Each case does the same thing to a model tidal trains and to a deep copy
trained by plain PyTorch (torch.optim.AdamW, same seeds and batches), at a
budget where chunks move and at one where everything fits, and compares; or
asserts the tidal.UsageError that names what cannot be exact.
"""
import copy
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tidal
from tidal.models.gpt import TanhChain, TinyGPT

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import measured_budget, within_budget  # noqa: E402

LR = 1e-2
# (TanhChain: 6 x Linear(64, 64); TinyGPT: vocab 256, d 64, 2 layers, tied wte/lm_head.)
# "measured": engine_helpers.measured_budget, a budget below the state from what this machine measures.
CHAIN_BUDGETS = {"chunks-move": "measured", "all-fits": 0}
GPT_BUDGETS = {"chunks-move": "measured", "all-fits": 0}


def _config(budget, accumulation=1, precision=None):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "gradient_accumulation_steps": accumulation,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
           "tidal": {"device": "sim", "chunk_size": 16384, "device_memory_budget": budget,
                     "device_margin": "4KiB"}}
    if precision:
        cfg[precision] = {"enabled": True}
    return cfg


class Pair:
    """A model tidal trains and its plain PyTorch twin."""

    def __init__(self, kind, budget, accumulation=1, before=None):
        tidal.set_device("sim", capacity="1GiB")
        torch.manual_seed(0)
        if kind == "gpt":
            self.model = TinyGPT(vocab=256, d=64, layers=2, heads=4, seq=16)
            assert self.model.wte.weight is self.model.lm_head.weight
        else:
            self.model = TanhChain(width=64, depth=6)
        self.ref = copy.deepcopy(self.model)
        if before is not None:
            before(self.model, self.ref)
        self.opt = torch.optim.AdamW(self.ref.parameters(), lr=LR, weight_decay=0.0)
        g = torch.Generator().manual_seed(1)
        if kind == "gpt":
            self.data = [(torch.randint(0, 256, (2, 16), generator=g),
                          torch.randint(0, 256, (2, 16), generator=g)) for _ in range(4)]
        else:
            self.data = [(torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g))
                         for _ in range(4)]
        if budget == "measured":
            # (On a fresh model of the kind: `before` may have hooked this one.)
            torch.manual_seed(0)
            fresh = TinyGPT(vocab=256, d=64, layers=2, heads=4, seq=16) if kind == "gpt" else \
                TanhChain(width=64, depth=6)
            budget = measured_budget(fresh, _config(0, accumulation), self.data[:2])
        self.engine = tidal.initialize(self.model, _config(budget, accumulation))
        self.budget = budget

    def step(self, i):
        x, y = self.data[i]
        self.engine.backward(self.engine(x, y))
        self.engine.step()
        self.ref(x, y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def both(self):
        return ((self.model, False), (self.ref, True))

    def assert_same(self):
        got = self.engine.state_dict()
        for k, v in self.ref.state_dict().items():
            torch.testing.assert_close(got[k].float(), v.float(), rtol=1e-4, atol=5e-5, msg=k)
        within_budget(self.engine)
        if self.budget:
            r = self.engine.memory_report()
            assert r["evictions"] > 0 or r["bytes_device_to_host_last_step"] > 0, r


def _close(a, b):
    torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=1e-4, atol=5e-5)


chain_budgets = pytest.mark.parametrize("budget", list(CHAIN_BUDGETS.values()), ids=list(CHAIN_BUDGETS))
gpt_budgets = pytest.mark.parametrize("budget", list(GPT_BUDGETS.values()), ids=list(GPT_BUDGETS))


# ------------------------------------------------ (A) state dict entries and the parameter
@chain_budgets
def test_an_entry_write_is_seen_by_the_parameter_and_a_later_parameter_write_is_kept(budget):
    pair = Pair("chain", budget)
    pair.step(0)
    reads = []
    for m, _ in pair.both():
        sd = m.state_dict()
        sd["layers.0.weight"].mul_(0.5)
        w = m.layers[0].weight
        reads.append(w.detach().clone())
        with torch.no_grad():
            w.add_(1.0)
        reads.append(sd["layers.0.weight"].clone())  # the entry sees the parameter's write
    _close(reads[0], reads[2])
    _close(reads[1], reads[3])
    pair.step(1)
    pair.step(2)
    pair.assert_same()


@chain_budgets
def test_a_state_dict_taken_before_a_parameter_write_reads_and_writes_the_new_value(budget):
    pair = Pair("chain", budget)
    pair.step(0)
    seen = []
    for m, _ in pair.both():
        sd = m.state_dict()
        p = list(m.parameters())[2]  # a held parameter (layers.1.weight)
        with torch.no_grad():
            p.add_(1.0)
            m.layers[3].bias.zero_()
        seen.append((sd["layers.1.weight"].clone(), sd["layers.3.bias"].clone()))
        sd["layers.1.weight"].mul_(0.5)
        seen.append(p.detach().clone())
    _close(seen[0][0], seen[2][0])
    _close(seen[0][1], seen[2][1])
    _close(seen[1], seen[3])
    pair.step(1)
    pair.step(2)
    pair.assert_same()


@chain_budgets
def test_writes_through_views_of_an_entry_reach_the_parameter(budget):
    pair = Pair("chain", budget)
    pair.step(0)
    got = []
    for m, _ in pair.both():
        sd = m.state_dict()
        sd["layers.2.weight"][0].zero_()          # a view: no torch function of the entry sees it
        got.append(m.layers[2].weight[0].detach().clone())
        for row in sd["layers.4.weight"]:
            row.mul_(0.5)
        sd["layers.4.weight"].view(-1)[:7].fill_(0.25)
        sd["layers.5.bias"][sd["layers.5.bias"] > 0] = 0.0   # __setitem__ on the entry
        got.append(m.layers[4].weight.detach().clone())
        with torch.no_grad():
            m.layers[4].weight.add_(0.125)         # after the view writes: kept, not overwritten
        got.append(sd["layers.4.weight"].clone())
        del sd
    for a, b in zip(got[:3], got[3:]):
        _close(a, b)
    pair.step(1)
    pair.step(2)
    pair.assert_same()


@chain_budgets
def test_a_numpy_array_of_an_entry_reads_the_parameter_and_refuses_writes(budget):
    """A write into entry.numpy() reaches no torch function of the entry (it
    was lost without a word): the array is read-only, so numpy refuses it;
    a read gives the parameter's value, and a converted copy stays writable
    as in plain PyTorch (the model untouched)."""
    pair = Pair("chain", budget)
    pair.step(0)
    sd, ref_sd = pair.model.state_dict(), pair.ref.state_dict()
    for key in ("layers.1.weight", "layers.4.bias"):
        torch.testing.assert_close(torch.tensor(sd[key].numpy()), ref_sd[key], rtol=1e-4, atol=5e-5)
        with pytest.raises(ValueError, match="read-only"):
            sd[key].numpy()[0] = 1.0
        with pytest.raises(ValueError, match="read-only"):
            np.asarray(sd[key])[...] = 0.0
        for state in (sd, ref_sd):
            np.asarray(state[key], dtype=np.float64)[...] = 0.0  # (a copy: the model untouched)
    pair.step(1)
    pair.step(2)
    pair.assert_same()


@chain_budgets
def test_an_entry_held_across_steps_reads_and_writes_the_current_parameter(budget, tmp_path):
    pair = Pair("chain", budget)
    sds = [m.state_dict() for m, _ in pair.both()]
    pair.step(0)
    pair.step(1)
    # Plain PyTorch's entries share the parameters' memory: after training
    # they hold the trained weights, and a load of them changes nothing.
    _close(sds[0]["layers.1.weight"], sds[1]["layers.1.weight"])
    _close(sds[0]["layers.1.weight"], pair.ref.layers[1].weight)
    for sd in sds:
        sd["layers.1.weight"][0, 0] = 3.0  # (a write into one element, not the old copy)
    for (m, _), sd in zip(pair.both(), sds):
        m.load_state_dict(sd)
    saved = []
    for sd in sds:
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        saved.append(torch.load(buf, weights_only=True))
    for k in saved[1]:
        _close(saved[0][k], saved[1][k])
    deep = copy.deepcopy(sds[0])
    _close(deep["layers.1.weight"], pair.ref.layers[1].weight)
    pair.step(2)
    # engine.load_state_dict of the kept dict: its entries' values now (no-op).
    pair.engine.load_state_dict(sds[0])
    pair.ref.load_state_dict(sds[1])
    pair.step(3)
    pair.assert_same()


@chain_budgets
def test_writes_through_an_alias_of_a_dropped_entry_reach_the_parameter(budget):
    import gc

    pair = Pair("chain", budget)
    pair.step(0)
    got = []
    for m, _ in pair.both():
        row = m.state_dict()["layers.0.weight"][0]
        data = m.state_dict()["layers.0.bias"].data
        alias = m.state_dict()["layers.2.bias"].detach()
        gc.collect()
        row.zero_()
        data.fill_(1.0)
        alias.mul_(-1.0)
        held = dict(m.named_parameters())  # (read one at a time: each makes room for the next)
        got.append([held[n].detach().clone()
                    for n in ("layers.0.weight", "layers.0.bias", "layers.2.bias")])
    for a, b in zip(*got):
        _close(a, b)
    pair.step(1)
    pair.assert_same()


@chain_budgets
def test_a_held_parameter_reads_its_loaded_value_after_load_state_dict(budget):
    # (TanhChain's root holds no parameter of its own: the load stayed
    # "running" until the next forward, and a held parameter read zeros.)
    pair = Pair("chain", budget)
    pair.step(0)
    with torch.no_grad():
        loaded = {k: v * 0.5 for k, v in pair.ref.state_dict().items()}
    got = []
    for m, _ in pair.both():
        m.load_state_dict(loaded)
        got.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*got):
        _close(a, b)
    pair.step(1)
    pair.assert_same()


@chain_budgets
def test_two_state_dicts_of_one_model_see_each_others_writes(budget):
    pair = Pair("chain", budget)
    pair.step(0)
    got = []
    for m, _ in pair.both():
        a, b = m.state_dict(), m.state_dict()
        a["layers.0.bias"].zero_()
        got.append(b["layers.0.bias"].clone())
        b["layers.0.bias"].add_(2.0)
        got.append(a["layers.0.bias"].clone())
    _close(got[0], got[2])
    _close(got[1], got[3])
    pair.step(1)
    pair.assert_same()


def test_an_entry_write_between_backward_and_step_is_named_and_the_weights_kept():
    pair = Pair("chain", CHAIN_BUDGETS["chunks-move"])
    pair.step(0)
    sd = pair.model.state_dict()
    x, y = pair.data[1]
    pair.engine.backward(pair.engine(x, y))
    sd["layers.1.weight"].zero_()
    with pytest.raises(tidal.UsageError, match=r"'layers\.1\.weight'"):
        pair.engine.step()
    # The write reached nothing; the parameter kept its value: tidal's step
    # raised before updating, so the twin skips this step too.
    pair.opt.zero_grad(set_to_none=True)
    pair.engine.zero_grad()
    pair.step(2)
    pair.assert_same()


# ------------------------------------------------ (B) tied weights
@gpt_budgets
def test_writing_every_entry_scales_a_tied_weight_twice_as_in_plain_pytorch(budget):
    pair = Pair("gpt", budget)
    pair.step(0)
    for m, _ in pair.both():
        sd = m.state_dict()
        assert sd["wte.weight"].data_ptr() == sd["lm_head.weight"].data_ptr()
        for v in sd.values():
            if v.is_floating_point():
                v.mul_(0.9)
    _close(pair.model.wte.weight, pair.ref.wte.weight)
    pair.step(1)
    pair.step(2)
    pair.assert_same()


@gpt_budgets
def test_one_tied_entry_written_the_other_read(budget):
    pair = Pair("gpt", budget)
    got = []
    for m, _ in pair.both():
        sd = m.state_dict()
        sd["lm_head.weight"].zero_()
        got.append(sd["wte.weight"].abs().sum().item())
        got.append(m.wte.weight.abs().sum().item())
        sd = m.state_dict()
        sd["wte.weight"].normal_(generator=torch.Generator().manual_seed(5))
        sd["lm_head.weight"].mul_(2.0)
        got.append(m.wte.weight.detach().clone())
        del sd
    assert got[0] == got[3] == 0.0 and got[1] == got[4] == 0.0
    _close(got[2], got[5])
    pair.step(0)
    pair.step(1)
    pair.assert_same()


# ------------------------------------------------ (C) post-accumulate-grad hooks
def _tweak_hook(seen):
    def hook(p):
        seen.append(p.grad is not None)
        if p.grad is not None:
            p.grad.add_(1e-2)  # a per-parameter gradient tweak
    return hook


@chain_budgets
def test_a_post_accumulate_grad_hook_sees_and_edits_the_gradient(budget):
    pair = Pair("chain", budget)
    seen = {True: [], False: []}
    for m, is_ref in pair.both():
        m.layers[2].weight.register_post_accumulate_grad_hook(_tweak_hook(seen[is_ref]))
    for i in range(3):
        pair.step(i)
    assert seen[False] == seen[True] == [True] * 3
    pair.assert_same()


@gpt_budgets
def test_post_accumulate_grad_hooks_before_and_after_initialize_on_a_tied_weight(budget):
    norms = {True: [], False: []}

    def register(m, is_ref):
        def hook(p):
            norms[is_ref].append(float(p.grad.norm()))
            p.grad.mul_(0.5)
        m.wte.weight.register_post_accumulate_grad_hook(hook)

    pair = Pair("gpt", budget, before=lambda m, r: (register(m, False), register(r, True)))
    handles = [m.blocks[0].fc.weight.register_post_accumulate_grad_hook(_tweak_hook([]))
               for m, _ in pair.both()]
    for i in range(2):
        pair.step(i)
    for h in handles:
        h.remove()
    pair.step(2)
    torch.testing.assert_close(norms[False], norms[True], rtol=1e-4, atol=1e-6)
    assert len(norms[False]) == 3
    pair.assert_same()


def test_a_post_accumulate_grad_hook_under_gradient_accumulation_is_refused_by_name():
    pair = Pair("chain", 0, accumulation=2)
    with pytest.raises(tidal.UsageError, match=r"'layers\.2\.weight'.*register_hook"):
        pair.model.layers[2].weight.register_post_accumulate_grad_hook(_tweak_hook([]))
    assert not any(type(h).__name__ == "function" and h.__name__ == "hook"
                   for h in pair.model.layers[2].weight._post_accumulate_grad_hooks.values())
    # Registered before tidal.initialize: refused when it would run.
    pair = Pair("chain", 0, accumulation=2, before=lambda m, r: m.layers[1].weight
                .register_post_accumulate_grad_hook(_tweak_hook([])))
    x, y = pair.data[0]
    with pytest.raises(tidal.UsageError, match=r"'layers\.1\.weight'.*accumulation"):
        pair.engine.backward(pair.engine(x, y))


def test_a_post_accumulate_grad_hook_that_drops_the_gradient_is_refused_by_name():
    pair = Pair("chain", 0)

    def step_in_backward(p):
        p.grad = None
    pair.model.layers[3].bias.register_post_accumulate_grad_hook(step_in_backward)
    x, y = pair.data[0]
    with pytest.raises(tidal.UsageError, match=r"'layers\.3\.bias'.*None"):
        pair.engine.backward(pair.engine(x, y))
