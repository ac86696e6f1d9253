"""The engine's life around training, against plain PyTorch (simulated
device, small models): models built under tidal.init_context, the relayout
after the warm-up, the memory timeline and profile, the LR schedule, a
dropped engine giving its memory back, DeepSpeed's engine queries, and the
module methods that would act on placeholders."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import (Reversed, raw_numel, gpt_batches, moved_within_budget, train_tidal,  # noqa: E402
                            within_budget)
from engine_reference import LR, assert_close, config, fitted, train_reference  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


@pytest.fixture(autouse=True)
def simulated_device():
    """These tests are about the engine's logic on CPU tensors: simulated device."""
    tidal.set_device("sim", capacity="1GiB")


def reversed_twins(n: int):
    """A Reversed model (its layers used in reverse module order), its copy
    and `n` batches of random inputs and targets."""
    torch.manual_seed(0)
    ref = Reversed()
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)) for _ in range(n)]
    return ref, copy.deepcopy(ref), batches


def test_init_context_builds_into_chunks_and_trains():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    batches = gpt_batches(5)
    cfg = fitted(config(), ref, batches)
    torch.manual_seed(0)
    with tidal.init_context(cfg):
        model = TinyGPT(d=64, seq=8)
    assert all(raw_numel(p) == 0 for p in model.parameters())
    engine = tidal.initialize(model)
    ref_losses = train_reference(ref, batches)
    assert_close(engine, ref, ref_losses, train_tidal(engine, batches))
    moved_within_budget(engine)


class LateTied(torch.nn.Module):
    """Builds its head with a weight of its own, then ties it to the embedding
    (as Hugging Face's post_init does): init_context has registered both."""

    def __init__(self, vocab=96, d=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.mix = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.mix(self.emb(x))))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def test_init_context_keeps_no_copy_of_a_weight_the_model_replaced():
    torch.manual_seed(0)
    ref = LateTied()
    batches = gpt_batches(4)
    cfg = fitted(config(chunk=16384), ref, batches)
    torch.manual_seed(0)
    with tidal.init_context(cfg) as store:
        model = LateTied()
    # The replaced head weight (96 x 64 floats, a dedicated chunk) was registered.
    assert len(store.records) == 4
    resident = store.chunks.stats()["resident_bytes_host"]
    engine = tidal.initialize(model)
    assert [r.name for r in engine.store.records] == ["emb.weight", "mix.weight", "mix.bias"]
    # Its four slots (16-bit copy, which is fp32 here, master, m, v) are gone.
    assert resident - engine.chunks.stats()["resident_bytes_host"] == 96 * 64 * 4 * 4
    ref_losses = train_reference(ref, batches)
    assert_close(engine, ref, ref_losses, train_tidal(engine, batches))
    moved_within_budget(engine)


def test_init_context_keeps_a_model_built_beside_it():
    with tidal.init_context(config()) as store:
        first, second = LateTied(), LateTied()
    tidal.initialize(first)
    # The second model's parameters are still its own: nothing was dropped.
    assert {id(p) for p in second.parameters()} <= {id(r.param) for r in store.records}


def test_a_meta_parameter_left_in_the_model_is_a_clear_error():
    model = TinyGPT(d=64, seq=8, tied=False)
    model.lm_head = torch.nn.Linear(64, 96, bias=False, device="meta")
    with pytest.raises(ValueError, match=r"'lm_head.weight' is on the meta device"):
        tidal.initialize(model, config())


def test_chunks_are_rebuilt_in_first_use_order_after_the_warm_up():
    ref, model, batches = reversed_twins(12)
    ref_losses = train_reference(ref, batches)
    # 3 layers (weight + bias: 1056 floats each) per 4096-float chunk.
    engine = tidal.initialize(model, config(budget="64KiB", chunk=4096 * 4))
    before = [engine.chunks.placement(r.id)[0] for r in engine.records]
    assert before == sorted(before)  # module order
    moved = 0
    losses = []
    for x, y in batches:
        chunks = engine.chunks  # the relayout replaces the scheduler after step 1
        before = chunks.stats()["bytes_host_to_device"]
        losses.append(train_tidal(engine, [(x, y)])[0])
        # (Updates a step left to the next forward, Note [Speculation while
        # backward lasts], go up when they are released: within the count.)
        engine.settle_overlap()
        moved += chunks.stats()["bytes_host_to_device"] - before
    assert engine.relayouts == 1
    assert_close(engine, ref, ref_losses, losses)
    # In the new layout chunks open in the forward's first-use order: the last
    # layer, used first, is in chunk 0, and each parameter sits in one of the
    # two chunks opened last (Note [One layout, five lists]: the tensors after
    # one that opened a chunk may fill the previous chunk's tail).
    use_order = [r for layer in reversed(model.layers) for r in engine._params.module_records[layer]]
    chunks = [engine.chunks.placement(r.id)[0] for r in use_order]
    assert chunks[0] == 0
    assert all(c >= max(chunks[:i + 1]) - 1 for i, c in enumerate(chunks)), chunks
    assert engine.chunks.num_tensors == len(engine.records)
    engine.chunks.validate()
    # Counters survive the new scheduler: every step's copies are reported.
    assert moved > 0 and engine.memory_report()["scheduler"]["bytes_host_to_device"] == moved
    moved_within_budget(engine)


def test_a_model_used_in_module_order_keeps_its_chunks():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8, tied=False)
    engine = tidal.initialize(model, fitted(config(), model, gpt_batches(2)))
    train_tidal(engine, gpt_batches(2))
    assert engine.relayouts == 0
    moved_within_budget(engine)


def test_cpu_adam_overlaps_the_next_chunks_gradient_copy():
    """After the warm-up the optimizer's host accesses are in the trace, so the
    gradient chunk k+1 needs is copied down (prefetched) while CPU Adam works
    on chunk k: no access in the optimizer step misses."""
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    batches = gpt_batches(4)
    # overlap_step off: the step's own host updates (with it on they run
    # during backward, test_step_overlap.py).
    engine = tidal.initialize(model, fitted(config(hybrid_adam=False, overlap_step=False), model,
                                            batches))
    misses_in_step = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        before = engine.chunks.stats()
        engine.step()
        after = engine.chunks.stats()
        misses_in_step.append((after["misses"] - before["misses"],
                               after["prefetch_hits"] - before["prefetch_hits"],
                               after["moves_device_to_host"] - before["moves_device_to_host"]))
    warm_misses = misses_in_step[0][0]
    assert warm_misses > 0  # the warm-up copies each gradient chunk on demand
    for misses, hits, downs in misses_in_step[2:]:
        assert downs > 0 and misses == 0 and hits >= downs, misses_in_step
    moved_within_budget(engine)


def test_warmup_decay_schedule_matches_adamw_with_the_same_lr_per_step():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(10)
    warm, total = 4, 10

    def lr_of_step(n):  # DeepSpeed: the n-th step runs with get_lr() at iteration n - 1
        k = n - 1
        if k < 0:
            return 0.0
        if k < warm:
            return LR * k / warm
        return LR * max(0.0, (total - k) / (total - warm))

    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_losses = []
    for n, (x, y) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr_of_step(n)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    cfg = config()
    cfg["scheduler"] = {"type": "WarmupDecayLR",
                        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": warm,
                                   "total_num_steps": total, "warmup_type": "linear"}}
    engine = tidal.initialize(model, fitted(cfg, model, batches))
    lrs = []
    losses = []
    for x, y in batches:
        lrs.append(engine.lr)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert lrs == pytest.approx([lr_of_step(n) for n in range(len(batches))], rel=1e-12, abs=0)
    assert_close(engine, ref, ref_losses, losses)
    moved_within_budget(engine)


def test_memory_timeline_covers_every_hook_of_a_step():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8, layers=2)
    engine = tidal.initialize(model, fitted(config(), model, gpt_batches(2)))
    train_tidal(engine, gpt_batches(2))
    timeline = engine.memory_timeline()
    kinds = [hook.split()[0] for _, hook, *_ in timeline]
    assert kinds[0] == "fwd" and kinds[-1] == "step" and "bwd" in kinds and "grad" in kinds
    assert [p for p, *_ in timeline] == list(range(len(timeline)))
    budget = engine.store.device_budget - engine.store.margin
    assert all(0 <= chunks <= budget for _, _, chunks, _, _ in timeline)
    moved_within_budget(engine)


def test_memory_profile_counts_the_chunk_traffic_of_each_interval():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8, layers=2)
    batches = gpt_batches(3)
    engine = tidal.initialize(model, fitted(config(), model, batches))
    train_tidal(engine, batches[:2])
    before = engine.chunks.stats()
    train_tidal(engine, batches[2:])
    after = engine.chunks.stats()
    profile = engine.memory_profile()
    assert [(p["moment"], p["hook"], p["chunk_bytes"], p["non_chunk_bytes"], p["budget"])
            for p in profile] == engine.memory_timeline()
    # The intervals of the last step add up to the scheduler's own counters.
    for key, counter in (("h2d_moves", "moves_host_to_device"), ("d2h_moves", "moves_device_to_host"),
                         ("evictions", "evictions")):
        assert sum(p[key] for p in profile) == after[counter] - before[counter] > 0, key
    moved_within_budget(engine)


def test_memory_profile_after_the_relayout_counts_the_new_schedulers_moves():
    # The relayout after the warm-up replaces the scheduler, whose counters start
    # again: the next step's intervals count from the new one's, not the old one's.
    torch.manual_seed(0)
    model = Reversed()
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)) for _ in range(3)]
    engine = tidal.initialize(model, fitted(config(chunk=4096 * 4), model, batches))
    train_tidal(engine, batches[:1])
    assert engine.relayouts == 1
    before = engine.chunks.stats()
    train_tidal(engine, batches[1:2])
    after = engine.chunks.stats()
    profile = engine.memory_profile()
    for key, counter in (("h2d_moves", "moves_host_to_device"), ("d2h_moves", "moves_device_to_host"),
                         ("evictions", "evictions")):
        assert all(p[key] >= 0 for p in profile), key
        assert sum(p[key] for p in profile) == after[counter] - before[counter] > 0, key
    within_budget(engine)


def test_an_fp16_overflow_does_not_advance_the_lr_schedule():
    torch.manual_seed(0)
    cfg = config()
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                       "warmup_num_steps": 10,
                                                       "warmup_type": "linear"}}
    model = TinyGPT(d=64, seq=8)
    batches = gpt_batches(4)
    engine = tidal.initialize(model, fitted(cfg, model, batches))
    train_tidal(engine, batches[:2])
    lr = engine.lr
    assert lr == pytest.approx(LR * 1 / 10)  # two applied steps: lr at iteration 1
    x, y = batches[2]
    engine.backward(engine(x, y) * float("inf"))
    assert engine.step() is False
    assert engine.lr == lr  # skipped: the schedule stays
    train_tidal(engine, batches[3:])
    assert engine.lr == pytest.approx(LR * 2 / 10)
    moved_within_budget(engine)


def test_a_failed_relayout_keeps_the_old_chunks_whole(monkeypatch):
    """A copy failing halfway (e.g. host memory) puts every moved record back."""
    ref, model, batches = reversed_twins(6)
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, config(budget="64KiB", chunk=4096 * 4))
    store = engine.store
    real_new_chunks = store._new_chunks

    class Failing:
        """The new scheduler, whose 20th access fails."""

        def __init__(self):
            self.inner, self.calls = real_new_chunks(), 0

        def access(self, *args):
            self.calls += 1
            if self.calls == 20:
                raise tidal.OutOfMemoryError("injected: host memory exhausted")
            return self.inner.access(*args)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(store, "_new_chunks", Failing)
    with pytest.warns(UserWarning, match="first-use order failed .*injected.*stay in their chunks"):
        losses = train_tidal(engine, batches)
    assert engine.relayouts == 0
    engine.chunks.validate()
    assert_close(engine, ref, ref_losses, losses)
    moved_within_budget(engine)


def test_a_dropped_engine_is_collected_and_gives_its_memory_back():
    # Gradient hooks live in C++ autograd meta, out of the garbage collector's
    # sight; an engine they held strongly stayed alive with all its chunks
    # (Note [Gradient hooks hold the engine weakly]).
    import gc
    import weakref

    gc.collect()
    before = tidal.stats()
    model = TinyGPT(d=64, seq=8)
    batches = gpt_batches(2)
    engine = tidal.initialize(model, config(budget="1GiB"))
    train_tidal(engine, batches)
    assert tidal.stats()["host"]["allocated"] > before["host"]["allocated"]
    ref = weakref.ref(engine)
    del engine, model
    gc.collect()
    assert ref() is None
    after = tidal.stats()
    # At most the baseline: an earlier test's leftovers may go meanwhile.
    assert after["host"]["allocated"] <= before["host"]["allocated"], (before, after)
    assert after["device"]["in_use"] <= before["device"]["in_use"], (before, after)


def test_deepspeeds_engine_queries_answer_as_deepspeed_does():
    # A DeepSpeed loop's logging: get_lr / get_mom per parameter group, the
    # batch sizes, was_step_applied, global_samples. The reference for the lr
    # is DeepSpeed's WarmupLR written out: linear, min + (max - min) * i / n
    # at iteration i, which starts at -1 (the min) and goes up by one after
    # each applied step, so the first two steps run at the min.
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    cfg = config(budget=0, chunk=1 << 16)  # (0: the whole simulated device)
    cfg.update({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
                "scheduler": {"type": "WarmupLR", "params": {
                    "warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4,
                    "warmup_type": "linear"}}})
    cfg["optimizer"]["params"]["betas"] = [0.8, 0.95]
    head = [p for n, p in model.named_parameters() if n.startswith("ln_f")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("ln_f")]
    engine = tidal.initialize(model, cfg, model_parameters=[
        {"params": rest}, {"params": head, "lr": LR / 2}])
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.train_batch_size()) == (2, 2, 4)
    assert engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert not engine.was_step_applied() and engine.global_samples == 0
    assert engine.get_mom() == [(0.8, 0.95), (0.8, 0.95)]
    batches = gpt_batches(8)

    def warmup_lr(applied):
        return LR * max(applied - 1, 0) / 4
    applied = 0
    for k in range(4):
        lr = warmup_lr(applied)
        assert engine.get_lr() == pytest.approx([lr, lr / 2]), k
        for i, (x, y) in enumerate(batches[2 * k:2 * k + 2]):
            loss = engine(x, y)
            engine.backward(loss * float("inf") if k == 2 else loss)  # step 2 overflows
            engine.step()
            boundary = i == 1
            assert engine.was_step_applied() == (boundary and k != 2), (k, i)
        applied += k != 2
        assert engine.global_samples == 4 * (k + 1)
    assert engine.skipped_steps == 1 and engine.global_steps == 4
    # The overflow did not advance the schedule: three applied steps.
    assert applied == 3 and engine.get_lr() == pytest.approx([LR * 2 / 4, LR * 2 / 8])
    # A window cut short at one backward pass: DeepSpeed (managed accumulation, its
    # default) still counts train_batch_size() for the step.
    engine.set_gradient_accumulation_boundary(True)
    x, y = batches[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.set_gradient_accumulation_boundary(None)
    assert engine.was_step_applied() and engine.global_samples == 20
    # A config with no batch named: DeepSpeed's None.
    within_budget(engine)
    other = tidal.initialize(TinyGPT(d=32, seq=8), config(budget=0, chunk=1 << 16))
    assert other.train_micro_batch_size_per_gpu() is None and other.train_batch_size() is None
    assert other.gradient_accumulation_steps() == 1 and not other.fp16_enabled()


def test_module_methods_that_would_act_on_placeholders_are_the_engines_and_refuse():
    # What the engine lacks is the model's (engine.generate, ...), but nn.Module's
    # conversions would act on placeholders and return the model: the engine's
    # own return the engine where they are no-ops and refuse the rest by name.
    torch.manual_seed(0)
    engine = tidal.initialize(TinyGPT(d=32, seq=8), config(budget=0, chunk=1 << 16))
    assert engine.to(engine.device) is engine and engine.to("cpu") is engine
    assert engine.cpu() is engine and engine.float() is engine  # fp32 on the simulated device
    with pytest.raises(tidal.UsageError, match="engine.to\\('cuda'\\): the parameters live in chunks"):
        engine.to("cuda")
    with pytest.raises(tidal.UsageError, match="engine.to\\(torch.float16\\)"):
        engine.to(torch.float16)
    assert engine.to(torch.float32) is engine and engine.to(dtype=torch.float32) is engine
    with pytest.raises(tidal.UsageError, match="engine.to\\(dtype=torch.float64\\)"):
        engine.to(dtype=torch.float64)
    with pytest.raises(tidal.UsageError, match="engine.to\\(0\\)"):
        engine.to(0)
    for name in ("half", "bfloat16", "double"):
        with pytest.raises(tidal.UsageError, match=f"engine.{name}\\(\\): the parameters' dtype is "
                                                    f"the config's precision \\(fp32"):
            getattr(engine, name)()
    # engine.apply(fn) is model.apply(fn): what fn writes through module attributes is
    # kept (tests/python/test_engine_param_writes.py).
    assert engine.apply(lambda m: None) is engine
    with pytest.raises(tidal.UsageError, match="engine.requires_grad_\\(\\)"):
        engine.requires_grad_(False)
    # Still passed through: the model's own queries.
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in engine.module.named_parameters()]
    # ... and training still works after the refusals.
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    assert engine.step() is True
    within_budget(engine)
