"""Chunks that a trace point's lowered budget evicts in every steady step
(Note [Blocks leaving over a lowered budget] in
runtime/scheduler/chunk_scheduler.h): step_overlap_clip's GPT (vocab 8192,
d 256, 8 layers, 1 MiB chunks, room for a quarter of the 16-bit chunks
beside the measured activation peak: about 48 MiB) on a simulated link
slow enough (200 MB/s) that every copy down is still running when the
lowering returns. The lowering no longer waits for those copies: it leaves
the evicted chunks' blocks cached over the budget until an activation or a
chunk needs their room, and a prefetch that finds only those blocks to free
stops instead of waiting for them (Note [Prefetch]). Before, the lowering
freed each block at once, waiting on the hook's thread for its copy (issue
52: 12 of the 16 evictions of a steady step waited, on the default link),
and a prefetch right after it waited for the same copies.

With the lowerings planned (Note [Chunks leave ahead of a lowering]), the
chunks a lowering evicts leave at their last use before it instead, on a
link (1 GB/s) where the step's compute could hide their copies: the same
chunks move, the same bytes, as with the plan off.

The reference is the same model trained where everything fits: nothing
moves there, so the losses and weights must be the same bits.
"""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal._C.chunks import ChunkKind
from tidal.models.gpt import TinyGPT

from engine_helpers import gpt_batches, train_tidal, within_budget

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from evict_ahead import BATCH, D, LAYERS, SEQ, config  # noqa: E402  (the benchmark's shape)
from evict_ahead import TEST_VOCAB as VOCAB  # noqa: E402

STEPS, STEADY = 8, 3
COUNTERS = ("evictions", "evictions_ahead", "bytes_left_leaving", "prefetches_put_off", "prefetch_hits",
            "misses", "bytes_host_to_device", "bytes_device_to_host")




def train(engine, batches):
    """Losses, and the scheduler's counters after each step."""
    losses, counters = [], []
    for batch in batches:
        losses += train_tidal(engine, [batch])
        s = engine.chunks.stats()
        counters.append({k: s[k] for k in COUNTERS})
    return losses, counters


@pytest.fixture(scope="module")
def reference():
    """The model, its batches, what training it where everything fits gives
    (losses, fp32 weights), and the budget from what that run measured:
    beside the activation peak, chunk room for a quarter of the 16-bit
    chunks (the margin a twentieth), so the chunks that fit while the
    activations are small leave at the trace points where they grow, in
    every step."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d=D, layers=LAYERS, heads=4, seq=SEQ)
    batches = gpt_batches(STEPS, vocab=VOCAB, seq=SEQ, batch=BATCH)
    tidal.set_device("sim", capacity="8GiB")
    fits = tidal.initialize(copy.deepcopy(model), config(0))
    losses, _ = train(fits, batches)
    weights = fits.parameters_fp32()
    activations = fits.memory_report()["peak_nonchunk_device_bytes"]
    c = fits.chunks
    p16 = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
    fits.remove_hooks()
    return model, batches, losses, weights, int((activations + p16 // 4) / 0.95)


def train_checked(reference, bandwidth, evict_ahead=True, **tidal_keys):
    """Trains on a link of `bandwidth` within the reference's budget, with
    `tidal_keys` added to the config; checks the bits against the reference
    and the budget; returns the counters of each steady step."""
    model, batches, ref_losses, ref_weights, budget = reference
    tidal.set_device("sim", capacity="8GiB", bandwidth=bandwidth)
    cfg = config(budget, evict_ahead)
    cfg["tidal"].update(tidal_keys)
    engine = tidal.initialize(copy.deepcopy(model), cfg)
    losses, counters = train(engine, batches)
    assert losses == ref_losses  # bitwise: copies change no bits
    weights = engine.parameters_fp32()
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)
    within_budget(engine)
    engine.remove_hooks()
    return [{k: b[k] - a[k] for k in COUNTERS} for a, b in zip(counters[-STEADY - 1:], counters[-STEADY:])]


def test_chunks_evicted_at_a_trace_point_leave_their_blocks_to_whoever_needs_the_room(reference):
    # (With the lowerings planned, the chunks leave ahead of the points:
    # the test below. Here they leave at the points, as with the plan off,
    # and each with a copy: the 16-bit chunks forward evicts would otherwise
    # take back their host blocks, Note [A clean chunk goes down without a
    # copy], and leave no copy running.)
    steady = train_checked(reference, "200MB/s", evict_ahead=False, skip_clean_copies=False)
    for step in steady:
        # The path fires: every steady step evicts at its trace points, and
        # the lowerings leave blocks still being copied out of.
        assert step["evictions"] > 0 and step["bytes_left_leaving"] > 0, step
        copies = step["prefetch_hits"] + step["misses"]
        assert copies > 0 and step["prefetch_hits"] >= 0.9 * copies, step
    # A prefetch found only those blocks to free, and stopped instead of
    # waiting for their copies.
    assert sum(step["prefetches_put_off"] for step in steady) > 0, steady


def test_chunks_a_lowering_evicts_leave_ahead_of_it_and_move_no_more(reference):
    at_points = train_checked(reference, "1GB/s", evict_ahead=False)
    ahead = train_checked(reference, "1GB/s")
    for on, off in zip(ahead, at_points):
        # The path fires in every steady step: the lowerings' victims leave
        # ahead of them (with the plan off, none does).
        assert off["evictions"] > 0 and off["evictions_ahead"] == 0, off
        assert on["evictions_ahead"] > 0 and on["evictions_ahead"] <= on["evictions"], on
        # The same chunks move: a chunk leaves early only where its lowering
        # would evict it, and no prefetch brings it back before that.
        assert on["evictions"] == off["evictions"], (on, off)
        assert on["bytes_device_to_host"] == off["bytes_device_to_host"], (on, off)
        assert on["bytes_host_to_device"] == off["bytes_host_to_device"], (on, off)
        copies = on["prefetch_hits"] + on["misses"]
        assert copies > 0 and on["prefetch_hits"] >= 0.9 * copies, on


def test_the_benchmark_quick_mode_runs_and_writes_its_result(tmp_path):
    """benchmarks/evict_ahead.py, the measurement of the test above (its
    result file, with every figure beside the engine with the plan off)."""
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "evict_ahead.py"), "--quick", "--output", str(out)],
                       timeout=600, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] and result["git_commit"] and result["machine"]["cpu_cores"]
    (link,) = result["links"].values()
    for name in ("ahead", "at_points"):
        assert link[name]["bitwise"] and link[name]["budget_overruns"] == 0
        assert link[name]["evictions_per_step"] > 0 and link[name]["step_s"]["n"] == 2
    assert link["ahead"]["evictions_ahead_per_step"] > 0 and link["at_points"]["evictions_ahead_per_step"] == 0
    assert link["ahead"]["bytes_host_to_device_per_step"] == link["at_points"]["bytes_host_to_device_per_step"]
