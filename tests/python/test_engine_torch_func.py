"""torch.func over a model tidal trains (issue 53): functional_call with the
model's own parameters or the caller's tensors, vmap, and the differentiating
transforms, each against plain PyTorch at a budget where chunks move and one
where everything fits (the Pair of test_engine_params_fail_closed.py)."""
import pytest
import torch

import tidal
from test_engine_params_fail_closed import Pair, _close, budgets


@budgets
def test_functional_call_with_the_models_own_parameters_is_a_forward_that_trains(budget):
    """Note [Reads that only move a parameter] in tidal/engine/external.py:
    torch.func.functional_call reads every module's parameters to swap them,
    and those reads attach nothing (at the budget where chunks move, attaching
    them all was an out-of-memory error); the forward between the swaps is
    the engine's."""
    pair = Pair(budget)
    pair.step(0)
    x, y = pair.data[1]
    with torch.no_grad():
        got = torch.func.functional_call(pair.model, dict(pair.model.named_parameters()), (x, y))
        want = pair.ref(x, y)
    _close(got, want)
    loss = torch.func.functional_call(pair.model, dict(pair.model.named_parameters()), (x, y))
    pair.engine.backward(loss)
    pair.engine.step()
    torch.func.functional_call(pair.ref, dict(pair.ref.named_parameters()), (x, y)).backward()
    pair.opt.step()
    pair.opt.zero_grad(set_to_none=True)
    pair.assert_same()
    pair.step(2)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_functional_call_with_other_tensors_runs_the_model_on_them(budget):
    """Tensors of the caller's swapped in for a layer: the forward uses them,
    their gradients are plain PyTorch's, and the engine's own parameters are
    untouched (the next steps train as plain PyTorch)."""
    pair = Pair(budget)
    pair.step(0)
    x, y = pair.data[1]

    def layer1(model):
        return {k: v.detach().clone().add_(0.1).requires_grad_()
                for k, v in model.named_parameters() if k.startswith("layers.1.")}

    mine, theirs = layer1(pair.ref), layer1(pair.ref)
    got = torch.func.functional_call(pair.model, mine, (x, y))
    got.backward()
    want = torch.func.functional_call(pair.ref, theirs, (x, y))
    want.backward()
    _close(got, want)
    assert set(mine) == {"layers.1.weight", "layers.1.bias"}
    for k in mine:
        _close(mine[k].grad, theirs[k].grad)
    # The other layers' own parameters got gradients, in both models: dropped.
    pair.engine.zero_grad()
    pair.opt.zero_grad(set_to_none=True)
    for i in (1, 2):
        pair.step(i)
    pair.assert_same()
    pair.check_budget()


@budgets
def test_a_forward_under_a_differentiating_function_transform_is_refused_by_name(budget):
    """torch.func.grad (vjp, jacrev, jvp, ...) over the model: torch refuses
    the engine's saved-tensor hooks with an error of its own; tidal says so
    first, names what works, and training goes on as plain PyTorch's. vmap
    differentiates nothing and runs."""
    pair = Pair(budget)
    pair.step(0)
    x, y = pair.data[1]
    params = {k: v.detach() for k, v in pair.ref.named_parameters() if k.startswith("layers.1.")}
    with pytest.raises(tidal.UsageError, match=r"torch\.func's grad transform.*functional_call"):
        torch.func.grad(lambda ps: torch.func.functional_call(pair.model, ps, (x, y)))(params)
    with pytest.raises(tidal.UsageError, match=r"torch\.func's grad transform"):
        torch.func.grad(lambda ps: torch.vmap(
            lambda xi, yi: torch.func.functional_call(pair.model, ps, (xi[None], yi[None])))(x, y).sum())(
            params)
    with torch.no_grad():
        per_example = torch.vmap(lambda xi, yi: pair.model(xi[None], yi[None]), randomness="same")(x, y)
        want = torch.stack([pair.ref(xi[None], yi[None]) for xi, yi in zip(x, y)])
    _close(per_example, want)
    for i in (1, 2):
        pair.step(i)
    pair.assert_same()
    pair.check_budget()
