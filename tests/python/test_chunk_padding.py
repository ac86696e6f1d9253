"""Chunk padding of GPT shapes whose big weights are larger than a chunk.

Note [One layout, five lists] (chunk/chunk_layout.h): a dedicated chunk no longer
closes its pool's open chunks. Before, every gpt-6.7b block opened two regular
64 MiB chunks for half a chunk of small tensors, and the padding (chunk bytes the
states do not use) was 41% of gpt-6.7b's states, 23% of gpt-13b's and 22% of
gpt-20b's: the largest model could never come near (host + device) / 14 B. And a
bias beside its half-chunk weight kept the next one out (gpt-1.3b: 33%). The
reference is the states' own size (14 B per parameter of the model, counted by
torch), against the chunks the engine's layout code (the same C++ the engine and
tidal-estimate use) allocates for them.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# gpt-1.3b: weights of half a 64 MiB chunk, each with a bias (33% before small
# tensors went to the fullest open chunk); the others: weights larger than a chunk.
MOST = {"gpt-1.3b": 0.11, "gpt-6.7b": 0.035, "gpt-13b": 0.03, "gpt-20b": 0.01}


def test_dedicated_weights_leave_little_padding(tmp_path):
    # benchmarks/chunk_padding.py: tidal.estimate's layout against 14 B per
    # parameter counted by torch (its result file is the figure in docs/engine.md).
    out = tmp_path / "padding.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chunk_padding.py"), "--presets",
                        ",".join(MOST), "--chunks", "64MiB", "--output", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["preset"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(MOST)
    for preset, most in MOST.items():
        r = rows[preset]
        assert r["chunk_size"] == 64 << 20 and r["dedicated_chunks"] > 0
        assert r["unpadded_state_bytes"] == 14 * r["params"]
        assert r["padding"] == r["state_bytes"] / r["unpadded_state_bytes"] - 1
        assert 0 <= r["padding"] <= most, f"{preset}: chunks hold {r['padding']:.1%} more than the states"


def test_small_tensors_between_dedicated_ones_share_chunks():
    # The shape of the problem at a small size: per block only LayerNorms and a
    # half-chunk projection sit between weights larger than a chunk.
    from tidal import _C
    device = _C.create_device("sim", 1 << 20, None, None)
    chunks = _C.chunks.Chunks(device, chunk_bytes=1 << 12, param_dtype="float32",
                              device_budget=1 << 20, host_budget=1 << 20)
    blocks = 8
    for b in range(blocks):
        for name, numel in [("ln1", 8), ("qkv", 3072), ("proj", 512), ("ln2", 8), ("fc", 4096), ("out", 4096)]:
            chunks.register(f"{b}.{name}", numel)
    chunks.take_warnings()
    regular = [c for c in range(chunks.num_chunks)
               if chunks.chunk_capacity_bytes(c, _C.chunks.ChunkKind.PARAM32) == 1 << 12]
    small = blocks * (8 + 512 + 8) * 4
    # Each regular chunk holds two blocks' small tensors (one was needed per
    # block, twice over, when dedicated chunks closed the open ones).
    assert len(regular) <= -(-small // (1 << 12)) + 1, len(regular)
