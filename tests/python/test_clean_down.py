"""16-bit chunks that forward only read leave the device without a copy
(Note [A clean chunk goes down without a copy] in
runtime/scheduler/chunk_scheduler.h): in benchmarks/evict_ahead.py's shape
(step_overlap_clip's GPT, chunk room for a quarter of the 16-bit chunks
beside the measured activation peak) forward brings up every 16-bit chunk
the host updated and evicts most of them again as the activations grow.
Each takes back the host block it came up from, so only the gradients go
down, and the training is the same bits as where everything fits.

A write into a parameter during forward (a forward pre-hook scaling a
weight in place, which tidal keeps: docs/parameters.md) changes its chunk on
the device: that chunk must go down with a copy, or the write is lost. And
a frozen parameter's chunk, its only copy, always goes down with a copy: a
write through its `.data` inside forward shows in no version counter.
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal.models.gpt import TinyGPT

from engine_helpers import within_budget

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from evict_ahead import D, LAYERS, SEQ, config, the_shape, train  # noqa: E402  (the benchmark's shape)
from evict_ahead import TEST_VOCAB as VOCAB  # noqa: E402

STEPS, STEADY = 8, 3
COUNTERS = ("evictions", "copies_down_skipped", "bytes_down_skipped", "bytes_device_to_host",
            "bytes_host_to_device", "moves_device_to_host", "prefetch_hits", "misses")


def scale_in_forward(model):
    """A forward pre-hook on the first block's fc that scales its weight in
    place (under no_grad), as a user's hook might."""
    def hook(module, args):
        with torch.no_grad():
            module.weight.mul_(0.999)
    model.blocks[0].fc.register_forward_pre_hook(hook)
    return model


@pytest.fixture(scope="module")
def shape():
    model, batches, _, budget, _, _ = the_shape(STEPS, VOCAB)
    return model, batches, budget


@pytest.fixture(scope="module")
def reads(shape):
    """steady_counters of the shape's model at its budget (forward only
    reads its weights), the default config."""
    return steady_counters(*shape)


def steady_counters(model, batches, budget, **tidal_keys):
    """Losses, fp32 weights and the counters of each steady step of `model`
    trained at `budget` on a 1 GB/s link (budget 0: everything fits)."""
    tidal.set_device("sim", capacity="8GiB", bandwidth="1GB/s")
    engine = tidal.initialize(copy.deepcopy(model), config(budget, **tidal_keys))
    losses, counters = [], []
    for batch in batches:
        _, loss, _ = train(engine, [batch])
        losses += loss
        s = engine.chunks.stats()
        counters.append({k: s[k] for k in COUNTERS})
    weights = engine.parameters_fp32()
    within_budget(engine)
    engine.remove_hooks()
    steady = [{k: b[k] - a[k] for k in COUNTERS} for a, b in zip(counters[-STEADY - 1:], counters[-STEADY:])]
    return losses, weights, steady


def assert_same_bits(a, b):
    (losses_a, weights_a), (losses_b, weights_b) = a, b
    assert losses_a == losses_b
    assert all(torch.equal(weights_a[n], weights_b[n]) for n in weights_b)


@pytest.mark.parametrize("write_in_forward", [False, True], ids=["forward-reads", "forward-writes-a-weight"])
def test_chunks_forward_only_read_go_down_without_a_copy_and_train_the_same_bits(shape, reads, write_in_forward):
    model, batches, budget = shape
    if write_in_forward:
        model = scale_in_forward(copy.deepcopy(model))
    fits = steady_counters(model, batches, 0)
    clean = steady_counters(model, batches, budget) if write_in_forward else reads
    copies = steady_counters(model, batches, budget, skip_clean_copies=False)
    assert_same_bits(clean[:2], fits[:2])  # bitwise: no write lost, none made up
    assert_same_bits(copies[:2], fits[:2])
    for on, off in zip(clean[2], copies[2]):
        # The path fires in every steady step, and the same chunks move: the
        # copies skipped are exactly the bytes down saved.
        assert on["copies_down_skipped"] > 0 and off["copies_down_skipped"] == 0, (on, off)
        assert on["evictions"] == off["evictions"] and on["moves_device_to_host"] == off["moves_device_to_host"]
        assert on["bytes_host_to_device"] == off["bytes_host_to_device"], (on, off)
        assert on["bytes_device_to_host"] + on["bytes_down_skipped"] == off["bytes_device_to_host"], (on, off)
        copied = on["prefetch_hits"] + on["misses"]
        assert copied > 0 and on["prefetch_hits"] >= 0.9 * copied, on
    if write_in_forward:
        # The written chunk went down with a copy: fewer skipped than where
        # forward only reads (the chunk holding blocks.0.fc.weight is among
        # those forward evicts).
        assert sum(s["copies_down_skipped"] for s in clean[2]) < sum(s["copies_down_skipped"] for s in reads[2])


@pytest.mark.parametrize("skip", [True, False], ids=["clean-skipped", "every-copy"])
def test_the_estimate_counts_the_copies_down_skipped(shape, skip):
    """tidal.estimate's bytes down (Note [The pre-flight estimate]): the
    16-bit chunks forward evicts (fetched again in backward) were only read,
    so they go down without a copy; with skip_clean_copies off, they copy."""
    from tidal.estimate import estimate
    model, batches, budget = shape
    cfg = config(budget, skip_clean_copies=skip)
    with torch.device("meta"):
        meta = TinyGPT(vocab=VOCAB, d=D, layers=LAYERS, heads=4, seq=SEQ)
        predicted = estimate(meta, cfg, device_memory="8GiB", seq=SEQ, rates={}, measure=False)["traffic"]
    tidal.set_device("sim", capacity="8GiB")
    engine = tidal.initialize(copy.deepcopy(model), cfg)
    train(engine, batches[:6])
    r = engine.memory_report()
    within_budget(engine)
    engine.remove_hooks()
    assert predicted["refetch_or_churn_bytes"] > 0  # (the regime where forward evicts 16-bit chunks)
    assert (predicted["bytes_down_skipped"] > 0) == skip
    assert (r["copies_down_skipped"] > 0) == skip and (r["bytes_down_skipped"] > 0) == skip  # (the report's)
    assert predicted["bytes_device_to_host"] == pytest.approx(r["bytes_device_to_host_last_step"], rel=0.05)
    assert predicted["bytes_host_to_device"] == pytest.approx(r["bytes_host_to_device_last_step"], rel=0.05)


class ScaledEmbedding(torch.nn.Embedding):
    """An embedding whose output a frozen parameter scales, and which
    updates that parameter through `.data` at every forward, before using
    it (as an EMA codebook's update does): a write into the attached chunk
    that no version counter shows."""

    def __init__(self, weight):
        super().__init__(*weight.shape)
        self.weight = weight  # (the same Parameter: a tie to the head stays)
        self.scale = torch.nn.Parameter(torch.ones(weight.shape[1]), requires_grad=False)

    def forward(self, idx):
        self.scale.data.mul_(1.01)
        return super().forward(idx) * self.scale


def test_a_frozen_chunk_written_through_data_in_forward_always_goes_down_with_its_copy(shape):
    """A frozen parameter's chunk is its only copy: where forward evicts it,
    it goes down with a copy even though no write was seen, so the run with
    chunks moving is the same bits as where everything fits."""
    model, batches, budget = shape
    model = copy.deepcopy(model)
    model.wte = ScaledEmbedding(model.wte.weight)
    fits = steady_counters(model, batches, 0)
    moving = steady_counters(model, batches, budget)
    assert all(s["copies_down_skipped"] > 0 for s in moving[2])  # (the trainable chunks still skip)
    assert_same_bits(moving[:2], fits[:2])
