"""CPU Adam during backward (Notes [CPU Adam during backward] and
[Speculative updates and their undo] in python/tidal/engine/overlap.py), on
the simulated device with chunks moving (a measured budget below the state):
the weights are those of the engine without overlap, bit for bit, where the
clip fires and where it does not, with an fp16 overflow, with gradient
accumulation and with hybrid Adam; and torch.optim.AdamW +
clip_grad_norm_'s within the engine's tolerance. It is on by default; what it
does not cover is refused when asked for and off by default, saying why."""
import copy
import os
import sys
from pathlib import Path

import pytest
import torch

import tidal

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import (gpt_batches, measured_budget, moved_within_budget, train_tidal,  # noqa: E402
                            within_budget)
from engine_reference import LR, assert_close, config, fitted  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


# Loss factors per step: the gradient norm of TinyGPT(d=64) is about 2 at
# factor 1 and about 20 at factor 10, so a max norm of 5 clips on the steps
# with factor 10 only (and 50 on none). Steps 2 and 6 clip after a step that
# did not: their speculative updates are undone.
FACTORS = [1, 1, 10, 1, 1, 1, 10, 10, 1, 1]


def make_config(overlap, precision="fp32", clip=0.0, hybrid=True, accumulation=1):
    cfg = config(budget="64MiB", hybrid_adam=hybrid, overlap_step=overlap)
    cfg["gradient_clipping"] = clip
    cfg["gradient_accumulation_steps"] = accumulation
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine, batches, factors=None):
    """engine.backward(loss * factor) and engine.step() per batch; the losses."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = engine(x, y)
        engine.backward(loss * (factors[i % len(factors)] if factors else 1))
        engine.step()
        losses.append(loss.item())
    return losses


def reference(model, batches, factors, clip, accumulation=1):
    """torch.optim.AdamW and torch.nn.utils.clip_grad_norm_ on `model`; the
    losses and each step's gradient norm before clipping."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for i, (x, y) in enumerate(batches):
        loss = model(x, y)
        (loss * factors[i % len(factors)] / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf")).item())
            opt.step()
            opt.zero_grad()
    return losses, norms


def pair(cfg_of, batches, factors=None, model=None, adjust=None):
    """The engine without overlap and the one with it, trained on the same
    batches from the same weights under the same measured budget;
    adjust(engine) on the one with overlap before it trains."""
    model = model or (torch.manual_seed(0), TinyGPT(d=64, seq=8))[1]
    budget = fitted(cfg_of(False), model, batches)["tidal"]["device_memory_budget"]
    engines = {}
    for overlap in (False, True):
        cfg = cfg_of(overlap)
        cfg["tidal"]["device_memory_budget"] = budget
        engines[overlap] = tidal.initialize(copy.deepcopy(model), cfg)
        if overlap and adjust is not None:
            adjust(engines[overlap])
        train(engines[overlap], batches, factors)
        moved_within_budget(engines[overlap])
    return engines[False], engines[True]


def assert_bitwise(plain, overlapped):
    want = plain.parameters_fp32()
    for name, got in overlapped.parameters_fp32().items():
        assert torch.equal(got, want[name]), name
    assert plain.skipped_steps == overlapped.skipped_steps
    assert plain.get_global_grad_norm() == overlapped.get_global_grad_norm()


def optimizer_report(engine):
    return engine.memory_report()["optimizer"]


@pytest.mark.parametrize("precision, clip, hybrid", [
    ("fp32", 0.0, False), ("fp32", 5.0, True), ("fp32", 50.0, True), ("bf16", 5.0, True),
    ("bf16", 5.0, False), ("fp16", 5.0, True),
])
def test_weights_are_those_of_the_step_without_overlap_bit_for_bit(precision, clip, hybrid):
    batches = gpt_batches(len(FACTORS))
    plain, overlapped = pair(lambda o: make_config(o, precision, clip, hybrid), batches, FACTORS)
    assert_bitwise(plain, overlapped)
    opt = optimizer_report(overlapped)
    assert opt["overlap_step"] and opt["chunks_updated_during_backward"] > 0, opt
    assert opt["overlapped_adam_seconds"] > 0 and opt["overlap_undo_bytes"] > 0, opt
    assert not optimizer_report(plain)["chunks_updated_during_backward"]
    if clip == 5.0:
        # Steps 2 and 6 clipped after a step that did not: undone and made
        # again; step 7 clipped after 6 did, so its backward did not speculate.
        assert opt["undone_chunk_updates"] > 0 and opt["steps_not_speculated"] > 0, opt
    else:
        assert opt["undone_chunk_updates"] == 0 and opt["steps_not_speculated"] == 0, opt


@pytest.mark.parametrize("clip, fires", [(5.0, "some"), (50.0, "never")])
def test_against_adamw_and_clip_grad_norm(clip, fires):
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(len(FACTORS))
    ref_losses, norms = reference(ref, batches, FACTORS, clip)
    clipped = [n > clip for n in norms]
    assert (any(clipped) and not all(clipped)) if fires == "some" else not any(clipped), norms
    engine = tidal.initialize(model, fitted(make_config(True, clip=clip), model, batches))
    losses, seen = [], []
    for i, (x, y) in enumerate(batches):
        loss = engine(x, y)
        engine.backward(loss * FACTORS[i])
        engine.step()
        losses.append(loss.item())
        seen.append(engine.get_global_grad_norm())
    assert seen == pytest.approx(norms, rel=1e-5)
    assert_close(engine, ref, ref_losses, losses)
    opt = optimizer_report(engine)
    assert opt["chunks_updated_during_backward"] > 0
    assert (opt["undone_chunk_updates"] > 0) == (fires == "some"), opt
    moved_within_budget(engine)


def test_fp16_overflow_undoes_the_updates_and_skips_the_step():
    # Factor 1e5 at a loss scale of 256 overflows fp16 gradients.
    factors = [1, 1, 1e5, 1, 1]
    batches = gpt_batches(len(factors))
    plain, overlapped = pair(lambda o: make_config(o, "fp16", 50.0), batches, factors)
    assert overlapped.skipped_steps == 1
    assert_bitwise(plain, overlapped)
    assert plain.loss_scale == overlapped.loss_scale
    opt = optimizer_report(overlapped)
    assert opt["undone_chunk_updates"] > 0 and opt["steps_not_speculated"] == 1, opt


def test_after_a_clipped_step_the_next_backward_waits_and_each_step_is_the_plain_one():
    """Note [Speculative updates and their undo]: a backward after a step
    that clipped launches nothing (speculating there would most often be
    undone, and an undo costs the step about what the update does); one
    that follows a step that did not clip launches again. Every step's
    weights, not only the last, are those of the engine without overlap."""
    batches = gpt_batches(len(FACTORS))
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    budget = fitted(make_config(False, clip=5.0, hybrid=False), model, batches)["tidal"][
        "device_memory_budget"]
    engines = []
    for overlap in (False, True):
        cfg = make_config(overlap, clip=5.0, hybrid=False)
        cfg["tidal"]["device_memory_budget"] = budget
        engines.append(tidal.initialize(copy.deepcopy(model), cfg))
    plain, overlapped = engines
    launched, clipped = [], []
    for i, (x, y) in enumerate(batches):
        before = optimizer_report(overlapped)["chunks_updated_during_backward"]
        for e in engines:
            e.backward(e(x, y) * FACTORS[i])
        launched.append(optimizer_report(overlapped)["chunks_updated_during_backward"] - before)
        for e in engines:
            e.step()
        assert_bitwise(plain, overlapped)
        clipped.append(plain.get_global_grad_norm() > 5.0)
    assert clipped == [f == 10 for f in FACTORS], clipped
    # Step 0 is the warm-up (no launch); then a backward launches exactly when
    # the step before it did not clip.
    assert launched[0] == 0
    for i in range(1, len(FACTORS)):
        assert (launched[i] > 0) == (not clipped[i - 1]), (i, launched, clipped)
    opt = optimizer_report(overlapped)
    assert opt["steps_not_speculated"] == sum(clipped[:-1]), opt
    for e in engines:
        moved_within_budget(e)


@pytest.mark.parametrize("left", [False, True], ids=["", "half-left-to-the-step"])
@pytest.mark.parametrize("hybrid", [False, True])
def test_accumulation_updates_during_the_last_micro_batch(hybrid, left):
    # The third step clips (with hybrid Adam, the first whose backward
    # launches: the plan comes from the second step). Its norm comes from
    # sums measured at their fold in backward and by the step (Note
    # [Measured where folded]); half the chunks left to the step run under
    # the next forward, reading their sums.
    factors = [1, 1, 1, 1, 1, 1, 10, 10, 10, 1, 1, 1, 1, 1, 1]
    batches = gpt_batches(len(factors))
    plain, overlapped = pair(lambda o: make_config(o, "bf16", 5.0, hybrid, accumulation=3),
                             batches, factors, adjust=_leave_every_other_chunk if left else None)
    assert_bitwise(plain, overlapped)
    opt = optimizer_report(overlapped)
    assert opt["chunks_updated_during_backward"] > 0 and opt["undone_chunk_updates"] > 0, opt
    # (Note [Measured in the fold]: the clip factor of the steps that
    # clipped came from measures the worker's folds made.)
    assert opt["sums_measured_in_folds"] > 0, opt
    if left:
        assert opt["chunks_left_to_the_step_by_cost"] > 0, opt
        assert opt["chunks_updated_under_next_forward"] >= opt["chunks_left_to_the_step_by_cost"], opt


def test_accumulation_with_the_clip_firing_every_step_takes_the_norm_from_the_folds():
    # After a step that clipped the window's last backward launches nothing
    # and folds each chunk on the worker; its pass measures the sums (Note
    # [Measured in the fold]) and the step reads none of them again. With
    # the clip firing at every step, every step goes that way: bitwise the
    # engine without overlap, whose step measures every sum.
    factors = [10]
    batches = gpt_batches(12)
    plain, overlapped = pair(lambda o: make_config(o, "bf16", 1.0, hybrid=False, accumulation=2),
                             batches, factors)
    assert_bitwise(plain, overlapped)
    assert plain.get_global_grad_norm() > 1.0  # (the clip fired)
    opt = optimizer_report(overlapped)
    assert opt["chunks_updated_during_backward"] == 0, opt  # (no step was speculated)
    assert opt["sums_measured_in_folds"] > 0, opt
    assert opt["folds_on_worker"] > 0, opt


def test_accumulation_against_adamw_and_clip_grad_norm():
    factors = [1, 1, 1, 10, 10, 10, 1, 1, 1]
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(len(factors))
    ref_losses, norms = reference(ref, batches, factors, 5.0, accumulation=3)
    assert [n > 5.0 for n in norms] == [False, True, False], norms
    cfg = make_config(True, clip=5.0, hybrid=False, accumulation=3)
    cfg["tidal"]["device_memory_budget"] = fitted(make_config(False, clip=5.0, hybrid=False,
                                                              accumulation=3),
                                                  model, batches)["tidal"]["device_memory_budget"]
    engine = tidal.initialize(model, cfg)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = engine(x, y)
        engine.backward(loss * factors[i])
        engine.step()
        losses.append(loss.item())
    assert_close(engine, ref, ref_losses, losses)
    assert optimizer_report(engine)["chunks_updated_during_backward"] > 0
    moved_within_budget(engine)


@pytest.mark.parametrize("cores, threads, want", [(4, 0, 3), (1, 0, 1), (4, 2, 2)])
def test_the_worker_leaves_the_caller_a_core(monkeypatch, cores, threads, want):
    """Note [The worker leaves a core]: with cpu_adam_threads 0 the updates
    on the worker (during backward, and under the next forward where the
    clip fired) take every core the process may run on but one, at least
    one; a count in the config is obeyed. The weights are bitwise those of
    the engine without overlap."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    seen, real = [], tidal._C.cpu_adam.UpdateWorker

    class Worker:
        """The engine's worker, its jobs' thread counts noted."""

        def __init__(self):
            self._worker = real()

        def submit(self, *args, **kwargs):
            seen.append(kwargs["num_threads"])
            return self._worker.submit(*args, **kwargs)

        def run_or_wait(self, ticket):
            return self._worker.run_or_wait(ticket)

    monkeypatch.setattr(tidal._C.cpu_adam, "UpdateWorker", Worker)

    def cfg_of(overlap):
        cfg = make_config(overlap, clip=5.0)
        cfg["tidal"]["cpu_adam_threads"] = threads
        return cfg

    plain, overlapped = pair(cfg_of, gpt_batches(8), FACTORS)
    assert_bitwise(plain, overlapped)
    opt = optimizer_report(overlapped)
    assert opt["chunks_updated_during_backward"] > 0 and opt["chunks_updated_under_next_forward"] > 0, opt
    assert set(seen) == {want}, seen


class _Wide(torch.nn.Module):
    """Four 1024 x 1024 layers at batch 1: backward reads each weight twice,
    while a speculative update writes its undo copy and updates master and
    moments, about ten times the bytes."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


@pytest.mark.parametrize("accumulation, next_forward", [(1, True), (2, True), (1, False)])
def test_speculation_stops_where_backward_cannot_hide_it(accumulation, next_forward):
    """Note [Speculation while backward lasts]: where a chunk's speculative
    update (undo copy included) would not end before backward does, by the
    last step's measures, it is not launched; the step hands it to the
    worker to run under the next forward, without an undo; with
    accumulation too (Note [Measured where folded]), its sums read there.
    Not with overlap_next_forward false (every chunk launched, as before).
    Bitwise the engine without overlap either way."""
    torch.manual_seed(0)
    model = _Wide()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(1, 1024, generator=g), torch.randn(1, 1024, generator=g)) for _ in range(8)]
    # One layer (weight and bias) per chunk.
    chunk = (1024 * 1024 + 1024) * 4

    def cfg_of(overlap):
        cfg = config(budget=0, chunk=chunk, overlap_step=overlap, overlap_next_forward=next_forward)
        cfg["gradient_accumulation_steps"] = accumulation
        return cfg

    budget = measured_budget(model, cfg_of(False), batches, chunk_share=0.5)
    engines = {}
    for overlap in (False, True):
        cfg = cfg_of(overlap)
        cfg["tidal"]["device_memory_budget"] = budget
        engines[overlap] = tidal.initialize(copy.deepcopy(model), cfg)
        train(engines[overlap], batches * accumulation)
        moved_within_budget(engines[overlap])
    plain, overlapped = engines[False], engines[True]
    assert_bitwise(plain, overlapped)
    opt = optimizer_report(overlapped)
    assert opt["chunks_updated_during_backward"] > 0, opt  # (measured before the rule may act)
    if next_forward:
        assert opt["chunks_left_to_the_step_by_cost"] > 0, opt
        assert opt["chunks_updated_under_next_forward"] >= opt["chunks_left_to_the_step_by_cost"], opt
    else:
        assert opt["chunks_left_to_the_step_by_cost"] == 0, opt
        assert opt["chunks_updated_under_next_forward"] == 0, opt


def test_hybrid_adam_updates_the_host_chunks_during_backward():
    """The plan (the chunks the last step updated on the host) launches them
    at their landing: after the first steps, the step itself updates on the
    host only those the cost rule left to it (Note
    [Speculation while backward lasts]), and the device still updates some."""
    batches = gpt_batches(6)
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    cfg = make_config(True, clip=50.0)
    # Room for the device's update of some chunks (the 16-bit chunks' bytes
    # beside the activations), still well below the state.
    cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, batches, chunk_share=1.5)
    engine = tidal.initialize(model, cfg)
    train(engine, batches[:3])
    before = engine.memory_report()
    host_in_step, left_by_cost = [], []
    for x, y in batches[3:]:
        left = optimizer_report(engine)["chunks_left_to_the_step_by_cost"]
        engine.backward(engine(x, y))
        engine.step()
        host_in_step.append(len(engine._overlap.step_host_chunks))
        left_by_cost.append(optimizer_report(engine)["chunks_left_to_the_step_by_cost"] - left)
    after = engine.memory_report()
    launched = after["optimizer"]["chunks_updated_during_backward"] - \
        before["optimizer"]["chunks_updated_during_backward"]
    assert host_in_step == left_by_cost, (host_in_step, left_by_cost)
    assert launched > 0
    assert after["adam_chunks_on_device"] > before["adam_chunks_on_device"], after
    moved_within_budget(engine)


def test_on_by_default_with_deepspeeds_defaults():
    # gradient_clipping 1.0 (DeepSpeed's default value in its configs),
    # hybrid Adam, bf16; the losses scaled so the norm stays below 1.
    cfg = config()  # (tidal.overlap_step not given)
    cfg.update(gradient_clipping=1.0, bf16={"enabled": True})
    assert "overlap_step" not in cfg["tidal"]
    batches = gpt_batches(3)
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    cfg["tidal"]["device_memory_budget"] = fitted(copy.deepcopy(cfg), model, batches)["tidal"][
        "device_memory_budget"]
    engine = tidal.initialize(model, cfg)
    train(engine, batches, [0.1])
    assert engine.get_global_grad_norm() < 1.0
    opt = optimizer_report(engine)
    assert opt["overlap_step"] and opt["overlap_step_off"] is None
    assert opt["chunks_updated_during_backward"] > 0
    moved_within_budget(engine)
    cfg["tidal"]["overlap_step"] = False
    off = tidal.initialize(TinyGPT(d=64, seq=8), cfg)
    train(off, batches, [0.1])
    moved_within_budget(off)
    assert optimizer_report(off)["overlap_step_off"] == "tidal.overlap_step is false"
    assert optimizer_report(off)["chunks_updated_during_backward"] == 0


@pytest.mark.parametrize("key, block, named", [
    ("dtr", {"enabled": True}, "tidal.dtr is enabled"),
    ("dtr", {"evictee_minimum_size": 4096}, "tidal.dtr is enabled"),
])
def test_dtr_and_recompute_refused_when_asked_for_and_off_by_default(key, block, named):
    cfg = make_config(True)
    if key == "dtr":
        cfg["tidal"][key] = block
    else:
        cfg[key] = block
    with pytest.raises(tidal.ConfigError, match=f"tidal.overlap_step.*{named}"):
        tidal.initialize(TinyGPT(d=64, seq=8), cfg)
    del cfg["tidal"]["overlap_step"]
    engine = tidal.initialize(TinyGPT(d=64, seq=8), cfg)
    assert named in optimizer_report(engine)["overlap_step_off"]
    assert engine._overlap is None


def test_dtr_turned_on_by_hand_updates_nothing_during_backward():
    """A replay in backward could read updated weights: with tidal.dtr on by
    hand every chunk waits for engine.step()."""
    batches = gpt_batches(3)
    masters = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(overlap, clip=1.0))
        with tidal.dtr.enabled(eviction_threshold="1GiB"):
            train_tidal(engine, batches)
        assert optimizer_report(engine)["chunks_updated_during_backward"] == 0
        within_budget(engine)
        masters[overlap] = engine.parameters_fp32()
    for name, want in masters[False].items():
        assert torch.equal(masters[True][name], want), name


class _SharedInsideCheckpoint(torch.nn.Module):
    """One weight used outside and inside a reentrant checkpoint: its
    gradient lands twice in one backward (once per autograd graph task)."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(64, 64)
        self.other = torch.nn.Linear(64, 64)

    def forward(self, x, y):
        h = self.shared(x)
        h = torch.utils.checkpoint.checkpoint(lambda t: self.shared(torch.tanh(t)), h, use_reentrant=True)
        return torch.nn.functional.mse_loss(self.other(h), y)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_weight_used_again_after_its_gradient_landed_waits_for_the_step(accumulation):
    """A reentrant checkpoint replays a weight whose gradient already landed:
    the first backward (which launches nothing) finds it, its chunk is never
    updated during backward, and the weights are those without overlap.
    With accumulation the chunk's sums are folded and measured at its first
    landing in the window's last backward (Note [Measured where folded]) and
    the step measures them again after the second; the norm is bitwise
    that of the step without overlap."""
    data = [(torch.randn(4, 64), torch.randn(4, 64)) for _ in range(4 * accumulation)]
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(_SharedInsideCheckpoint(),
                                  make_config(overlap, clip=50.0, hybrid=False, accumulation=accumulation))
        train_tidal(engine, data)
        within_budget(engine)
        runs[overlap] = engine
    shared = runs[True].store.by_param[id(runs[True].module.shared.weight)]
    assert shared in runs[True]._overlap._relanded
    assert optimizer_report(runs[True])["chunks_updated_during_backward"] > 0
    assert_bitwise(runs[False], runs[True])


class _SometimesSharedInsideCheckpoint(_SharedInsideCheckpoint):
    """_SharedInsideCheckpoint with layers between the two uses of the
    shared weight (their chunks' landings drain its fold: _FOLD_LAG), whose
    reentrant checkpoint runs only while `again` is set: the steps before it
    launch the shared weight's chunks."""

    again = False

    def __init__(self):
        super().__init__()
        self.between = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x, y):
        h = self.shared(x)
        for layer in self.between:
            h = torch.tanh(layer(h))
        if self.again:
            h = torch.utils.checkpoint.checkpoint(lambda t: self.shared(torch.tanh(t)), h, use_reentrant=True)
        return torch.nn.functional.mse_loss(self.other(h), y)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_gradient_landing_again_on_a_chunk_taken_up_fails_by_name(accumulation):
    """A weight replayed by a reentrant checkpoint only from some step on:
    in that backward its gradient lands a second time after its chunk's
    update started (with accumulation, its sums folded and measured: Note
    [Measured where folded]). Not silently wrong: the backward fails naming
    the parameter and what to do (without accumulation the second gradient
    used to land on the update's weights, and the step went on with the
    first gradient alone), and after engine.zero_grad() training goes on,
    the checkpoint in every micro-batch from then on, as the engine without
    overlap's where that micro-batch never ran and zero_grad dropped its
    window (a failed backward is no micro-step, as in DeepSpeed), bit for
    bit: the weight's chunks wait for the step."""
    data = [(torch.randn(4, 64), torch.randn(4, 64)) for _ in range(16)]
    fail_at = 9  # (the last micro-batch of a window)
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = _SometimesSharedInsideCheckpoint()
        engine = tidal.initialize(model, make_config(overlap, clip=50.0, hybrid=False,
                                                     accumulation=accumulation))
        for i, (x, y) in enumerate(data):
            model.again = i >= fail_at
            if i != fail_at:
                engine.backward(engine(x, y))
                engine.step()
                continue
            if overlap:
                assert optimizer_report(engine)["chunks_updated_during_backward"] > 0
                with pytest.raises(RuntimeError) as failed:
                    engine.backward(engine(x, y))
                text = "\n".join([str(failed.value), *getattr(failed.value, "__notes__", [])])
                assert "the gradient of 'shared." in text and "landed a second time" in text, text
                assert "use_reentrant=False" in text and "engine.zero_grad()" in text, text
            engine.zero_grad()
        within_budget(engine)
        runs[overlap] = engine
    assert runs[True].global_steps == runs[False].global_steps == 16 // accumulation - 1
    assert_bitwise(runs[False], runs[True])


class _NonReentrantSegments(torch.nn.Module):
    """Three segments under torch.utils.checkpoint(use_reentrant=False), one
    weight used in the first and the last: every recompute in backward runs
    before the gradients of the weights it reads land (one autograd graph:
    a weight's gradient lands once, after all its uses)."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(64, 64)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def _segment(self, i, t):
        t = torch.tanh(self.layers[i](t))
        return torch.tanh(self.shared(t)) if i in (0, 3) else torch.tanh(self.layers[i + 1](t))

    def forward(self, x, y):
        for i in (0, 1, 3):
            x = torch.utils.checkpoint.checkpoint(self._segment, i, x, use_reentrant=False)
        return torch.nn.functional.mse_loss(x, y)


def test_non_reentrant_checkpoints_in_the_model_overlap_exactly():
    """A model's own non-reentrant checkpoints (recompute in backward, one
    weight in two segments): no gradient lands twice, chunks are updated
    during backward, and the weights are those without overlap bit for bit."""
    data = [(torch.randn(4, 64), torch.randn(4, 64)) for _ in range(5)]
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        cfg = make_config(overlap, clip=50.0, hybrid=False)
        cfg["tidal"]["chunk_size"] = "32KiB"  # (two fp32 weights a chunk: several chunks)
        engine = tidal.initialize(_NonReentrantSegments(), cfg)
        train_tidal(engine, data)
        within_budget(engine)
        runs[overlap] = engine
    assert not runs[True]._overlap._relanded
    assert optimizer_report(runs[True])["chunks_updated_during_backward"] > 0
    assert_bitwise(runs[False], runs[True])


@pytest.mark.parametrize("block", [{"number_checkpoints": 2}, {"number_checkpoints": 2, "cpu_checkpointing": True}],
                         ids=["recompute", "recompute-offload"])
def test_tidal_recompute_overlaps_exactly(block):
    """tidal.recompute (activation_checkpointing in the config, offloaded or
    not) with overlap_step on by default: chunks are updated during backward
    and every step's weights are those without overlap, bit for bit."""
    batches = gpt_batches(4)
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        cfg = make_config(overlap, clip=50.0, hybrid=False)
        cfg["activation_checkpointing"] = dict(block)
        if overlap:
            del cfg["tidal"]["overlap_step"]  # the default
        engine = tidal.initialize(TinyGPT(d=64, seq=8), cfg)
        assert engine.recompute_plan is not None
        train(engine, batches, FACTORS)
        within_budget(engine)
        runs[overlap] = engine
    assert optimizer_report(runs[True])["overlap_step_off"] is None
    assert optimizer_report(runs[True])["chunks_updated_during_backward"] > 0
    assert_bitwise(runs[False], runs[True])


def _leave_every_other_chunk(engine):
    """The cost rule (Note [Speculation while backward lasts]) replaced by
    one that leaves every other chunk to the step whatever the timing: their
    pins are held from their landing to the step (Note [Left to the step,
    pinned as if launched]), which what runs between must see through."""
    engine._overlap._fits_in_backward = lambda chunk: chunk % 2 == 0


def _between(engine, batches, act):
    """Train, calling act(engine, x, y) between each backward and step."""
    for i, (x, y) in enumerate(batches):
        engine.backward(engine(x, y) * FACTORS[i])
        act(engine, x, y)
        engine.step()


def _evaluate(engine, x, y):
    with torch.no_grad():
        engine.eval()
        assert torch.isfinite(engine(x, y))
        engine.train()


def _evaluate_the_model(engine, x, y):
    # The model itself, not engine(...) (Note [A forward of the model before
    # the step] in tidal/engine/overlap.py): its modules read the weights.
    model = engine.module
    with torch.no_grad():
        model.eval()
        loss = model(x, y).item()
        model.train()
    return loss


@pytest.mark.parametrize("left", [False, True], ids=["", "half-left-to-the-step"])
@pytest.mark.parametrize("act", [_evaluate, _evaluate_the_model, lambda e, x, y: e.state_dict(),
                                 lambda e, x, y: e.parameters_fp32()])
def test_what_reads_the_weights_between_backward_and_step_sees_the_step_without_overlap(act, left):
    # A forward (an evaluation, through the engine or the model), a
    # state_dict: the speculative updates are undone first (and the chunks
    # left to the step let go), and the step makes them again.
    batches = gpt_batches(4)
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(overlap, clip=5.0, hybrid=False))
        if overlap and left:
            _leave_every_other_chunk(engine)
        got = []
        _between(engine, batches, lambda e, x, y: got.append(act(e, x, y)))
        within_budget(engine)
        runs[overlap] = (engine, got)
    assert_bitwise(runs[False][0], runs[True][0])
    if isinstance(runs[False][1][0], dict):
        for a, b in zip(runs[False][1], runs[True][1]):
            for k in a:
                assert torch.equal(a[k], b[k]), k
    elif runs[False][1][0] is not None:
        assert runs[False][1] == runs[True][1]  # (the evaluation's losses, bit for bit)
    assert optimizer_report(runs[True][0])["undone_chunk_updates"] > 0
    if left:  # (the timed rule itself may leave some too on a loaded machine)
        assert optimizer_report(runs[True][0])["chunks_left_to_the_step_by_cost"] > 0
    # Nothing of the overlap is left hooked into torch once the steps are done.
    assert runs[True][0]._overlap._hook_box[0] is None


@pytest.mark.parametrize("key, value", [("lr", 3e-3), ("lr", 0.0), ("betas", (0.8, 0.9)), ("eps", 1e-3),
                                        ("weight_decay", 0.5)])
def test_hyperparameters_written_between_backward_and_step_are_the_steps(key, value):
    # Note [Hyperparameters written before the step] (tidal/engine/overlap.py):
    # a script that sets a group's lr (betas, eps, weight_decay) after
    # backward gets it in that step, as torch's AdamW; the updates made
    # during backward with the old value are undone and made again.
    batches = gpt_batches(6)
    # Written after the third backward, and written back after the fifth
    # (after the warm-up: speculative updates run then).
    writes = {2: value, 4: {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}[key]}
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(overlap, hybrid=False))
        for i, (x, y) in enumerate(batches):
            engine.backward(engine(x, y))
            if i in writes:
                engine.optimizer.param_groups[0][key] = writes[i]
            engine.step()
        within_budget(engine)
        runs[overlap] = engine
    assert_bitwise(runs[False], runs[True])
    report = optimizer_report(runs[True])
    assert report["chunks_updated_during_backward"] > 0
    assert report["undone_chunk_updates"] > 0  # (the path fires: the writes came after the launches)


@pytest.mark.parametrize("left", [False, True], ids=["", "half-left-to-the-step"])
def test_zero_grad_after_backward_takes_the_updates_back(left):
    batches = gpt_batches(4)
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(overlap, hybrid=False))
        if overlap and left:
            _leave_every_other_chunk(engine)
        train_tidal(engine, batches[:2])
        x, y = batches[2]
        engine.backward(engine(x, y))
        engine.zero_grad()
        engine.step()  # (nothing to update)
        train_tidal(engine, batches[3:])
        runs[overlap] = engine
    assert optimizer_report(runs[True])["undone_chunk_updates"] > 0
    if left:  # (the timed rule itself may leave some too on a loaded machine)
        assert optimizer_report(runs[True])["chunks_left_to_the_step_by_cost"] > 0
    assert_bitwise(runs[False], runs[True])


@pytest.mark.parametrize("left", [False, True], ids=["", "half-left-to-the-step"])
def test_a_failed_backward_takes_the_updates_back_and_the_engine_goes_on(left):
    batches = gpt_batches(4)
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(overlap, hybrid=False))
        if overlap and left:
            _leave_every_other_chunk(engine)
        train_tidal(engine, batches[:1])
        x, y = batches[1]
        # Late in backward (the first block's), after chunks of later blocks were launched.
        boom = engine.module.blocks[0].register_full_backward_hook(
            lambda *a: (_ for _ in ()).throw(RuntimeError("boom in backward")))
        loss = engine(x, y)
        launched = optimizer_report(engine)["chunks_updated_during_backward"]
        with pytest.raises(RuntimeError, match="boom in backward"):
            engine.backward(loss)
        boom.remove()
        assert (optimizer_report(engine)["chunks_updated_during_backward"] > launched) == overlap
        train_tidal(engine, batches[2:])
        within_budget(engine)
        runs[overlap] = engine
    assert optimizer_report(runs[True])["undone_chunk_updates"] > 0
    assert_bitwise(runs[False], runs[True])


def test_a_failed_last_micro_batch_refuses_the_step_until_zero_grad():
    # Its chunks' sums were folded at their landing: they hold part of a
    # failed micro-batch, so the step says so instead of using them.
    batches = gpt_batches(4)
    torch.manual_seed(0)
    engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(True, hybrid=False, accumulation=2))
    train_tidal(engine, batches[:2])
    x, y = batches[2]
    engine.backward(engine(x, y))
    boom = engine.module.blocks[0].register_full_backward_hook(
        lambda *a: (_ for _ in ()).throw(RuntimeError("boom in backward")))
    with pytest.raises(RuntimeError, match="boom in backward") as info:
        engine.backward(engine(*batches[3]))
    boom.remove()
    assert any("zero_grad" in n for n in getattr(info.value, "__notes__", []))
    engine.backward(engine(*batches[3]))  # (the micro-batch again)
    with pytest.raises(tidal.UsageError, match="accumulation sums.*zero_grad"):
        engine.step()
    engine.zero_grad()
    assert all(torch.isfinite(torch.tensor(train_tidal(engine, batches))))
    within_budget(engine)


def test_a_failed_first_micro_batch_drops_the_sums_it_folded_and_the_engine_goes_on():
    # With accumulation the backward that ends no window folds each host
    # chunk during backward and sends its weights up (Note [Gradients down as
    # they land]); where it fails, its early sums hold nothing but its own
    # part, so they go and the micro-batch can run again: the training is
    # bitwise that of the engine without overlap meeting the same failure.
    batches = gpt_batches(8)
    runs = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(overlap, hybrid=False, accumulation=2))
        train_tidal(engine, batches[:4])
        before = optimizer_report(engine)
        boom = engine.module.blocks[0].register_full_backward_hook(
            lambda *a: (_ for _ in ()).throw(RuntimeError("boom in backward")))
        with pytest.raises(RuntimeError, match="boom in backward"):
            engine.backward(engine(*batches[4]))
        boom.remove()
        after = optimizer_report(engine)
        if overlap:  # (the path fired before the failure, its folds on the worker)
            assert after["weights_sent_up_during_backward"] > before["weights_sent_up_during_backward"]
            assert after["folds_on_worker"] > before["folds_on_worker"]
            assert engine._overlap.folded_early
            assert not engine._overlap._fold_jobs  # (every one ended with the backward)
        train_tidal(engine, batches[4:])  # (the failed micro-batch again, and on)
        within_budget(engine)
        runs[overlap] = engine
    assert_bitwise(runs[False], runs[True])


class _FoldFails:
    """Makes the result of the next `count` fold jobs on the worker fail
    (Note [Folds on the worker] in tidal/engine/overlap.py): the pass ran,
    its ticket says it failed, as a fence's error would. With `until_end`,
    no fold job looks done before backward ends, so the first that fails
    is met there, not at a landing."""

    def __init__(self, monkeypatch):
        from tidal.engine import overlap as module
        self.count = 0
        self.until_end = False
        owner = self

        def is_fold(job):
            return isinstance(job._buffers[0], tidal._C.chunks.StartedFold)

        class Job(module._Job):
            def done(self):
                return False if owner.until_end and is_fold(self) else super().done()

            def result(self):
                if owner.count and is_fold(self):
                    self._ticket.wait()
                    owner.count -= 1
                    raise RuntimeError("fold failed on the worker (injected)")
                return super().result()

        ended = module.StepOverlap.backward_ended

        def backward_ended(overlap, failed=False):
            owner.until_end = False
            return ended(overlap, failed)

        monkeypatch.setattr(module, "_Job", Job)
        monkeypatch.setattr(module.StepOverlap, "backward_ended", backward_ended)


@pytest.mark.parametrize("window, met", [("first", "when-done"), ("first", "at-backward-end"),
                                         ("last", "when-done")])
def test_a_fold_that_fails_on_the_worker_fails_its_backward_and_loses_nothing(monkeypatch, window, met):
    # A fold on the worker whose pass fails fails its backward, wherever the
    # engine's thread meets the error (a later landing, or backward's end,
    # after the hooks' end of backward): in the window's first backward its
    # sums and gradients go, and the micro-batch can run again, bitwise the
    # training without the failure; in the window's last the sums hold
    # earlier micro-batches, so the step refuses until engine.zero_grad(),
    # and the engine trains on after it.
    batches = gpt_batches(8)
    torch.manual_seed(0)
    clean = tidal.initialize(TinyGPT(d=64, seq=8), make_config(True, hybrid=False, accumulation=2))
    train_tidal(clean, batches)
    fails = _FoldFails(monkeypatch)
    torch.manual_seed(0)
    engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(True, hybrid=False, accumulation=2))
    train_tidal(engine, batches[:4])
    before = optimizer_report(engine)["folds_on_worker"]
    if window == "last":
        engine.backward(engine(*batches[4]))
    fails.count = 1
    fails.until_end = met == "at-backward-end"
    with pytest.raises(RuntimeError, match="injected"):
        engine.backward(engine(*batches[5 if window == "last" else 4]))
    assert fails.count == 0
    assert optimizer_report(engine)["folds_on_worker"] > before  # (the path fired)
    assert not engine._overlap._fold_jobs  # (every fold of it ended)
    if window == "first":
        train_tidal(engine, batches[4:])  # (the failed micro-batch again, and on)
        assert_bitwise(clean, engine)
    else:
        engine.backward(engine(*batches[5]))
        with pytest.raises(tidal.UsageError, match="accumulation sums.*zero_grad"):
            engine.step()
        engine.zero_grad()
        assert all(torch.isfinite(torch.tensor(train_tidal(engine, batches[6:]))))
    within_budget(engine)


def test_an_engine_dropped_after_backward_waits_for_its_updates_and_goes():
    # The worker reads chunk memory: a collected engine waits for it before
    # its chunks go (weakref.finalize), and nothing of the engine stays.
    import gc
    import weakref

    batches = gpt_batches(3)
    torch.manual_seed(0)
    engine = tidal.initialize(TinyGPT(d=64, seq=8), make_config(True, hybrid=False))
    _leave_every_other_chunk(engine)
    train_tidal(engine, batches[:2])
    x, y = batches[2]
    engine.backward(engine(x, y))
    assert engine._overlap._jobs  # updates launched during backward, not waited for
    assert engine._overlap._held  # and chunks left to the step, pinned
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None
    torch.manual_seed(0)
    again = tidal.initialize(TinyGPT(d=64, seq=8), make_config(True, hybrid=False))
    assert all(torch.isfinite(torch.tensor(train_tidal(again, batches))))
    within_budget(again)


@pytest.mark.parametrize("script", ["step_overlap.py", "step_overlap_clip.py", "step_overlap_idle.py"])
def test_the_benchmarks_quick_mode_runs_and_writes_its_result(script, tmp_path):
    import json
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / script), "--quick", "--output", str(out)],
                   check=True, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    assert result["quick"] and result["git_commit"] and result["machine"]["cpu_cores"]
    if script == "step_overlap_idle.py":
        for case in result["cases"].values():
            assert case["ratio_step_to_cpuadam_paired"]["n"] == len(case["cpuadam"]["samples"]) > 0
            # The same bytes moved are timed again as the link's copies.
            assert all(len(p) == 4 for p in case["step"]["parts"])
        assert result["cases"]["host_fp32"]["step"]["bytes_moved_per_step_median"] > 0
        assert result["cases"]["device_fp32"]["step"]["bytes_moved_per_step_median"] == 0


def test_weights_sent_up_and_evicted_before_their_use_are_not_sent_again():
    """Note [Sent ahead and evicted] (tidal/engine/overlap.py): where the
    room a chunk's weights take when sent up during backward is needed
    before their use (chunk room for 0.65 of the 16-bit chunks beside the
    activations: step_overlap_cost.py's shape), OPT evicts them and they
    come up again. Every chunk launched during backward (the cost rule off,
    so the path is the same at every step): sending every chunk as before
    moves more chunks up per steady step, with sends evicted in each; the
    engine stops sending those (it still sends the others) and moves fewer;
    bitwise the same training."""
    from tidal._C.chunks import ChunkKind
    from tidal.engine.store import PARAM16

    torch.manual_seed(0)
    model = TinyGPT(vocab=8192, d=512, layers=4, heads=4, seq=16)
    g = torch.Generator().manual_seed(1)
    batches = [(t, t) for t in (torch.randint(0, 8192, (1, 16), generator=g) for _ in range(10))]
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
           "gradient_clipping": 0.0,  # (DeepSpeed's 1.0 would fire at every step: nothing speculated)
           # (Planned lowerings keep a send within the budget it will meet
           # before its use, so fewer sends are evicted, and not in every step:
           # off, the path this tests fires every step.)
           "tidal": {"chunk_size": "1MiB", "device_memory_budget": 0, "evict_ahead": False}}
    # The budget from what a run with the whole device measures: its peak
    # non-chunk bytes and chunk room for 0.65 of the 16-bit chunks, a
    # twentieth as margin (on this machine about step_overlap_cost.py's 48 MiB).
    probe = tidal.initialize(copy.deepcopy(model), cfg)
    train_tidal(probe, batches[:2])
    nonchunk = probe.memory_report()["peak_nonchunk_device_bytes"]
    c = probe.chunks
    p16 = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
    probe.remove_hooks()
    budget = int((nonchunk + 0.65 * p16) / 0.95)
    cfg["tidal"].update(device_memory_budget=budget, device_margin=budget // 20)
    runs = {}
    for learn in (False, True):
        engine = tidal.initialize(copy.deepcopy(model), cfg)
        overlap = engine._overlap
        overlap._fits_in_backward = lambda chunk: True
        if not learn:  # (as before the note: every finished update sent up)
            overlap._send_ahead = lambda chunk, e=engine: e.chunks.send_ahead(chunk, PARAM16)
        losses, moves, sent, evicted = [], [], [], []
        for x, y in batches:
            before = engine.chunks.stats()
            losses.append(train_tidal(engine, [(x, y)])[0])
            after = engine.chunks.stats()
            moves.append(after["moves_host_to_device"] - before["moves_host_to_device"])
            sent.append(after["prefetches_ahead"] - before["prefetches_ahead"])
            if not learn:  # (the engine takes them itself at each backward: Note [Sent ahead and evicted])
                evicted.append(len(engine.chunks.take_ahead_wasted(PARAM16)))
        within_budget(engine)
        runs[learn] = losses, moves, sent, evicted, set(overlap._no_ahead)
        engine.remove_hooks()
    (old_losses, old_moves, old_sent, old_evicted, _), (losses, moves, sent, _, no_ahead) = runs[False], runs[True]
    assert losses == old_losses
    assert all(n > 0 for n in old_evicted[-3:]), (old_evicted, old_moves)  # (the path fires)
    assert no_ahead and all(0 < n < m for n, m in zip(sent[-3:], old_sent[-3:])), (no_ahead, sent, old_sent)
    assert sum(moves[-3:]) < sum(old_moves[-3:]), (moves, old_moves)
