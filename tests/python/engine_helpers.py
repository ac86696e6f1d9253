"""What the engine and checkpoint tests share: data, a training loop under
tidal, and a model used in the reverse of its module order."""
import os

import torch

# Long sweeps (more steps, every case of a grid) run in full with
# TIDAL_TEST_FULL=1; scripts/test.sh, and so CI, runs a part of each that
# still makes every path it checks fire (README, "The tests").
FULL = os.environ.get("TIDAL_TEST_FULL", "") == "1"


def gpt_batches(n, vocab=96, seq=8, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),
             torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(n)]


def within_budget(engine):
    """The budget is a promise: no overrun, and the device peak stayed within it
    (Note [Who owns a device byte]): the reserved peak within the budget where
    the allocator's reserved bytes are metered (torch's caching rules), else the
    peak in use within the budget less the margin."""
    r = engine.memory_report()
    assert r["budget_overruns"] == 0
    if r["peak_reserved_device_bytes"]:
        assert r["peak_reserved_device_bytes"] <= r["device_budget"], r
    else:
        assert r["peak_device_bytes"] <= r["device_budget"] - r["device_margin"], r


def moved_within_budget(engine):
    """within_budget, and chunks moved (evictions, or the last step's moves
    down: CPU Adam's gradients, Note [Where a chunk's Adam runs]): for a budget
    below the state, as measured_budget makes, where a test means the chunks
    to move."""
    r = engine.memory_report()
    assert r["evictions"] > 0 or r["bytes_device_to_host_last_step"] > 0, r
    within_budget(engine)


def train_tidal(engine, batches):
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class Reversed(torch.nn.Module):
    """Layers built in one order and used in the other: module order is the
    worst guess of the first-use order, so the engine rebuilds its chunks."""

    def __init__(self, width=32, depth=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, y):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


class Renormed(torch.nn.Module):
    """An embedding that renorms the rows it looks up in place during forward
    (max_norm), then a Linear: a write made by the forward itself."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 64, max_norm=1.0)
        self.out = torch.nn.Linear(64, 64)

    def forward(self, ids, y):
        return torch.nn.functional.mse_loss(self.out(self.emb(ids)), y)


def measured_budget(model, cfg, batches, chunk_share=0.25, slack=1.25):
    """A device budget from what this machine measures, not a constant.

    Non-chunk device memory (activations, and on the simulated device every
    CPU allocation torch makes, oneDNN's scratch included) differs between
    CPUs: a budget tuned on one machine fails on another. So a throwaway copy
    of `model` trains two steps with the whole device as its budget, and the
    budget is the margin + `slack` x that run's peak non-chunk bytes + chunk
    room of `chunk_share` of the 16-bit chunks (at least what the largest
    module needs at once), so the chunks must move. `cfg` is not changed.
    """
    import copy

    import tidal
    from tidal._C.chunks import ChunkKind

    probe_cfg = copy.deepcopy(cfg)
    probe_cfg.setdefault("tidal", {})["device_memory_budget"] = 0
    probe = tidal.initialize(copy.deepcopy(model), probe_cfg)
    try:
        train_tidal(probe, batches[:2])
        nonchunk = probe.memory_report()["peak_nonchunk_device_bytes"]
        c = probe.chunks
        chunk16 = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
        largest = max(sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in {r.chunk for r in recs})
                      for recs in probe._params.module_records.values())
        return probe.store.margin + int(slack * nonchunk) + max(largest, int(chunk_share * chunk16))
    finally:
        probe.remove_hooks()



def raw_numel(p) -> int:
    """The elements a parameter's data holds now: 0 for tidal's placeholder.
    (p.numel() answers the parameter's own count while an engine trains it:
    Note [A parameter object stays the user's] in tidal/engine/user_param.py.)"""
    with torch._C.DisableTorchFunctionSubclass():
        return p.numel()
