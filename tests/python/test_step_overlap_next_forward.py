"""CPU Adam under the next forward (Note [CPU Adam under the next forward] in
python/tidal/engine/overlap.py), on the simulated device with chunks moving
(a measured budget below the state): with the clip firing on every step, so
that no update is speculated during backward, engine.step() leaves each host
chunk's update to the worker and returns; the next forward waits module by
module. The weights, the losses and what anything between the step and the
forward reads are those of the engine without overlap, bit for bit."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal.engine import overlap as _overlap
from tidal._C.chunks import TensorState
from tidal.engine.store import GRAD32

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, moved_within_budget  # noqa: E402
from engine_reference import fitted  # noqa: E402
from test_step_overlap import assert_bitwise, make_config, optimizer_report  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

# TinyGPT(d=64)'s gradient norm is about 2: a max norm of 0.01 clips every step.
CLIP = 0.01


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def global_pre_hooks() -> int:
    return len(torch.nn.modules.module._global_forward_pre_hooks)


def has_hook(engine) -> bool:
    """Whether `engine`'s global forward pre-hook is installed. (Counting all
    of torch's global hooks is not enough: an earlier test's engine, alive or
    being collected, removes its own hook when its updates are settled, which
    our forwards or the garbage collector may do at any point of this test.)"""
    handle = engine._overlap._hook_box[0]
    return handle is not None and handle.id in torch.nn.modules.module._global_forward_pre_hooks


def engines(precision="fp32", hybrid=True, next_forward=True, batches=None, accumulation=1):
    """(the engine without overlap, the one with it) from the same weights
    under the same measured budget."""
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    budget = fitted(make_config(False, precision, CLIP, hybrid, accumulation), model, batches)["tidal"][
        "device_memory_budget"]
    out = []
    for overlap in (False, True):
        cfg = make_config(overlap, precision, CLIP, hybrid, accumulation)
        cfg["tidal"]["device_memory_budget"] = budget
        cfg["tidal"]["overlap_next_forward"] = next_forward
        out.append(tidal.initialize(copy.deepcopy(model), cfg))
    return out


@pytest.mark.parametrize("precision, hybrid, slow", [("fp32", True, False), ("fp32", False, False),
                                                     ("bf16", True, False), ("fp32", True, True)])
def test_clip_on_every_step_updates_under_the_next_forward_bit_for_bit(precision, hybrid, slow,
                                                                        monkeypatch):
    if slow:
        # A worker slower than the forward: each module waits for its own
        # chunks (on this small model the updates are otherwise done before
        # the forward's first module, which releases them all).
        # A job of 2^21 elements queued on the worker before each update.
        submit = _overlap.StepOverlap._submit
        ballast = [torch.zeros(1 << 21) for _ in range(3)] + [torch.zeros(1 << 21, dtype=torch.bfloat16)]

        def slow_submit(self, views, recs, grad_scale, grad, fences, *args):
            self._pool.submit(*ballast, [([(0, 1 << 21)], [1], 1e-3, 0.9, 0.999, 1e-8, 0.0)])
            return submit(self, views, recs, grad_scale, grad, fences, *args)

        monkeypatch.setattr(_overlap.StepOverlap, "_submit", slow_submit)
    batches = gpt_batches(8)
    plain, overlapped = engines(precision, hybrid, batches=batches)
    hooks_before = global_pre_hooks()
    left, losses = [], {plain: [], overlapped: []}
    # Each engine alone over every batch (they share the device), the
    # overlapped one first: each of its forwards follows its own step at
    # once, as in a training loop (with the other engine's whole step in
    # between, a loaded machine finished the slow worker's updates before
    # the forward came, and nothing waited).
    for e in (overlapped, plain):
        for x, y in batches:
            loss = e(x, y)
            e.backward(loss)
            e.step()
            losses[e].append(loss.detach())
            if e is overlapped:
                left.append(optimizer_report(overlapped)["chunks_updated_under_next_forward"])
            else:
                assert plain.get_global_grad_norm() > CLIP
        if e is overlapped:
            assert has_hook(overlapped)  # (the last step's updates are out)
    # The forwards saw the weights of the steps without overlap.
    assert all(torch.equal(a, b) for a, b in zip(losses[plain], losses[overlapped], strict=True))
    opt = optimizer_report(overlapped)
    # Every step after the warm-up (and the one that laid the chunks out again)
    # left host updates to the next forward; none was speculated (the clip fires).
    assert left[-1] > left[2] > 0, left
    assert opt["chunks_updated_during_backward"] == 0, opt
    if slow:
        assert opt["next_forward_wait_seconds"] > 0, opt
        # The forward ran updates queued behind a ballast job itself (Note [A
        # waiter runs the job itself] in cpu_adam/update_worker.h), bit for
        # bit as above.
        assert opt["updates_run_by_their_waiter"] > 0, opt
    assert_bitwise(plain, overlapped)  # (parameters_fp32 waits for them)
    assert not has_hook(overlapped) and global_pre_hooks() <= hooks_before
    moved_within_budget(overlapped)


def test_what_runs_between_the_step_and_the_forward_sees_the_step():
    """state_dict, an evaluation forward under no_grad, the model called
    directly (not through the engine), a parameter read, zero_grad and
    remove_hooks: each sees the step's weights, and no hook is left."""
    batches = gpt_batches(7)
    plain, overlapped = engines(batches=batches)
    hooks_before = global_pre_hooks()
    pair = (plain, overlapped)

    def train(i):
        x, y = batches[i]
        for e in pair:
            e.backward(e(x, y))
            e.step()

    for i in range(3):  # the warm-up, the relayout, one step with a plan
        train(i)
    train(3)
    a, b = plain.state_dict(), overlapped.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    train(4)
    x, _ = batches[5]
    with torch.no_grad():
        outs = [e.module(x) for e in pair]  # the model itself, under no_grad
    assert torch.equal(outs[0], outs[1])
    train(5)
    name, p = next(iter(overlapped.module.named_parameters()))
    want = dict(plain.module.named_parameters())[name]
    assert torch.equal(p.detach().clone(), want.detach().clone())
    train(6)
    for e in pair:
        e.zero_grad()
    assert_bitwise(plain, overlapped)
    train(0)
    assert has_hook(overlapped)
    for e in pair:
        e.remove_hooks()
    assert not has_hook(overlapped) and global_pre_hooks() <= hooks_before
    for (n, p), q in zip(plain.module.named_parameters(), overlapped.module.parameters()):
        assert torch.equal(p, q), n


def test_off_by_config_the_step_updates_every_chunk_itself():
    batches = gpt_batches(5)
    plain, overlapped = engines(next_forward=False, batches=batches)
    for x, y in batches:
        for e in (plain, overlapped):
            e.backward(e(x, y))
            e.step()
    assert optimizer_report(overlapped)["chunks_updated_under_next_forward"] == 0
    assert_bitwise(plain, overlapped)


def test_with_gradient_accumulation_the_updates_read_their_sums_under_the_next_forward(tmp_path):
    """Accumulation 2, the clip firing on every step: the step hands each
    host chunk's update to the worker with its fp32 sums, which it keeps
    until the update is done (Note [Measured where folded] in
    tidal/engine/overlap.py). The losses and weights are the engine's
    without overlap, bit for bit; what runs between a step and the next
    forward (a checkpoint, which refuses pending gradients; p.grad) sees no
    sum left; a zero_grad there drops nothing the next window needs."""
    batches = gpt_batches(16)
    plain, overlapped = engines(batches=batches, accumulation=2)
    losses = {plain: [], overlapped: []}
    left = []
    for e in (overlapped, plain):
        for i, (x, y) in enumerate(batches):
            loss = e(x, y)
            e.backward(loss)
            e.step()
            losses[e].append(loss.detach())
            if i % 2 == 0:
                continue
            if e is overlapped:
                left.append(optimizer_report(overlapped)["chunks_updated_under_next_forward"])
            if i == 9:
                e.save_checkpoint(tmp_path / ("o" if e is overlapped else "p"))
            if i == 11:
                assert all(p.grad is None for p in e.module.parameters())
            if i == 13:
                e.zero_grad()
            assert not e._accumulation.has_sums()  # (the step's: handed over to the updates)
    assert all(torch.equal(a, b) for a, b in zip(losses[plain], losses[overlapped], strict=True))
    assert left[-1] > left[2] > 0, left
    assert optimizer_report(overlapped)["chunks_updated_during_backward"] == 0
    assert_bitwise(plain, overlapped)
    # The last step's sums, handed over, freed once their updates were done
    # (parameters_fp32 waited for them), as the step without overlap freed its.
    for r in overlapped.records:
        assert overlapped.chunks.state(r.id, GRAD32) == plain.chunks.state(r.id, GRAD32), r.name
    moved_within_budget(overlapped)


def test_a_step_failing_after_some_updates_went_to_the_next_forward_leaves_the_engine_usable():
    """With accumulation, a chunk's sums are handed over as its update is
    left to the next forward: a step that fails after some were (here the
    third hand-off raises) raises that error, and zero_grad and the next
    steps run (before, the sums of the chunks already handed off still
    counted as sums: the next settle failed inside, 'has a sum again')."""
    batches = gpt_batches(12)
    _plain, overlapped = engines(batches=batches, accumulation=2)
    del _plain
    overlap = overlapped._overlap
    defer = overlap.defer
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a hand-off failed")
        return defer(*args, **kwargs)

    failed = False
    for i, (x, y) in enumerate(batches):
        overlapped.backward(overlapped(x, y))
        if i == 7:
            overlap.defer = failing
            with pytest.raises(RuntimeError, match="a hand-off failed"):
                overlapped.step()
            failed = True
            overlap.defer = defer
            overlapped.zero_grad()
            continue
        overlapped.step()
    assert failed and calls[0] == 3
    assert optimizer_report(overlapped)["chunks_updated_under_next_forward"] > 0
    assert not overlapped._accumulation.has_sums()
    overlapped.parameters_fp32()  # (waits for the last step's updates)
    for r in overlapped.records:  # (their sums freed once read, the others at their step)
        assert overlapped.chunks.state(r.id, GRAD32) == TensorState.FREE, r.name
    moved_within_budget(overlapped)
