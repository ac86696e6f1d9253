"""Data parallel (Note [Data parallel by chunk] in tidal/data_parallel.py) on
gloo and the simulated device, 2 and 3 processes, against plain PyTorch.

Each run launches tests/python/dp_worker.py once per rank with torchrun's
environment; tidal.initialize makes the process group from it. The reference
is one process training a copy of the same TinyGPT with torch.optim.AdamW on
the whole global batch: N ranks with micro-batch b must match it with batch
N x b (losses and weights within 1e-5 relative, as the engine tests).
"""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches  # noqa: E402
from engine_reference import assert_clip_fires, config, train_reference  # noqa: E402
import tidal  # noqa: E402
from tidal.data_parallel import DataParallelError  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

WORKER = Path(__file__).parent / "dp_worker.py"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch build has no torch.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world, spec, tmp_path, timeout=240):
    """Runs `world` ranks of dp_worker.py; returns (return codes, outputs, seconds)."""
    spec = dict(spec, out=str(tmp_path / f"out-{world}-{time.monotonic_ns()}.json"))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    seconds = time.monotonic() - started
    result = json.loads(Path(spec["out"]).read_text()) if Path(spec["out"]).exists() else None
    return [p.returncode for p in procs], outs, seconds, result


def run_ok(world, spec, tmp_path):
    codes, outs, _, result = launch(world, spec, tmp_path)
    assert codes == [0] * world, "\n".join(f"--- rank {r}\n{o[-4000:]}" for r, o in enumerate(outs))
    return result


class Reference(NamedTuple):
    model: torch.nn.Module
    losses: list
    floor: dict  # tensor name -> the reference's own relative L2 spread (below)


@contextlib.contextmanager
def _threads(n):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _train_reference(spec, start, norms):
    torch.manual_seed(0)
    model = TinyGPT(d=spec.get("width", 64), seq=8)
    accumulation = spec.get("accumulation", 1)
    batches = gpt_batches(spec["steps"] * accumulation + start, batch=spec["global_batch"],
                          seed=3)[start:]
    losses = train_reference(model, batches, clip=spec.get("clip", 0.0), accumulation=accumulation,
                             norms=norms)
    return model, losses


def reference(spec, start=0, norms=None):
    """One process, plain PyTorch + AdamW, the whole global batch per micro-step
    (`norms`, a list, gets each step's gradient norm before clipping).

    Trained with one intra-op thread, as the ranks are, whatever an earlier
    test left set; and again with two, to measure the reference's own
    floating-point floor: a different summation order alone moves a
    zero-initialised LayerNorm bias by up to 1.4e-5 relative after two Adam
    steps here (Adam divides tiny gradients by their own size), which is the
    size of the tolerance. `assert_matches` allows each tensor a few times
    its floor, never less than the tolerance."""
    with _threads(1):
        model, losses = _train_reference(spec, start, norms)
    with _threads(2):
        other, _ = _train_reference(spec, start, None)
    theirs = other.state_dict()
    floor = {name: ((theirs[name] - p).norm() / p.norm().clamp_min(1e-12)).item()
             for name, p in model.state_dict().items()}
    return Reference(model, losses, floor)


def assert_matches(result, model, losses, floor=None, rtol=1e-5):
    """Losses within `rtol`; each weight within `rtol` relative L2, or within
    3x the reference's own floor for that tensor where that is larger (a
    third summation order, the ranks', may land past either reference's; a
    wrong result, a lost micro-batch or a stale chunk, is off by 1e-3 or more)."""
    for a, b in zip(losses, result["losses"], strict=True):
        assert abs(a - b) <= rtol * abs(a), (losses, result["losses"])
    for name, p in model.state_dict().items():
        got = torch.tensor(result["weights"][name])
        err = (got - p).norm() / p.norm().clamp_min(1e-12)
        allowed = max(rtol, 3 * (floor or {}).get(name, 0.0))
        assert err <= allowed, f"{name}: relative L2 error {err:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_match_one_process_with_the_whole_batch(world, tmp_path):
    spec = {"steps": 4, "global_batch": 2 * world}
    result = run_ok(world, spec, tmp_path)
    assert_matches(result, *reference(spec))
    # The measured budget is below the chunk state: chunks moved every step.
    assert all(r["evictions"] > 0 and r["prefetches"] > 0 for r in result["reports"])
    # Every chunk has one owner.
    owned = [c for r in result["reports"] for c in r["data_parallel"]["owned_chunks"]]
    assert len(owned) == len(set(owned))
    assert_same_weights_on_every_rank(result)
    # overlap_comm (the default): chunks started their reductions while
    # backward went on, the same number on every rank (the same order).
    started = {r["data_parallel"]["reduces_in_backward"] for r in result["reports"]}
    assert len(started) == 1 and started.pop() > 0, result["reports"]


def test_ranks_with_their_optimizer_states_on_nvme_match_one_process(tmp_path):
    # Each rank's own file in one folder (a file per process); a host budget
    # of a few chunks sends the states each rank owns to its disk tier.
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    spec = {"steps": 4, "global_batch": 4, "nvme": str(nvme), "host_budget": 1024 * 1024}
    result = run_ok(2, spec, tmp_path)
    assert_matches(result, *reference(spec))
    assert all(r["nvme_chunks_written"] > 0 for r in result["reports"]), result["reports"]
    assert_same_weights_on_every_rank(result)
    assert list(nvme.glob("tidal-*.slots")) == []


def assert_same_weights_on_every_rank(result):
    crcs = [r["weights_crc"] for r in result["reports"]]
    assert len(set(crcs)) == 1, crcs


@pytest.mark.parametrize("overlap", [True, False])
def test_accumulation_and_clipping_match(overlap, tmp_path):
    spec = {"steps": 3, "global_batch": 4, "accumulation": 2, "clip": 0.05, "overlap": overlap}
    result = run_ok(2, spec, tmp_path)
    assert result["steps"] == 3
    assert_matches(result, *reference(spec))
    in_backward = [r["data_parallel"]["reduces_in_backward"] for r in result["reports"]]
    assert all(n > 0 for n in in_backward) if overlap else in_backward == [0, 0]


@pytest.mark.parametrize("precision, tol", [("bf16", 5e-2), ("fp16", 2e-2)])
def test_mixed_precision_tracks_the_fp32_reference(precision, tol, tmp_path):
    """16-bit chunks, gradients reduced in 16 bits (as DeepSpeed's): the loss
    curve agrees with fp32 plain PyTorch to the format's precision, and the
    ranks' 16-bit weights stay bitwise equal."""
    spec = {"steps": 4, "global_batch": 4, "precision": precision}
    result = run_ok(2, spec, tmp_path)
    losses = reference(spec).losses
    for a, b in zip(losses, result["losses"], strict=True):
        assert abs(a - b) <= tol * abs(a), (losses, result["losses"])
    assert_same_weights_on_every_rank(result)
    assert all(r["skipped_steps"] == 0 for r in result["reports"])


@pytest.mark.parametrize("clip, fires", [(1.25, "some"), (50.0, "never")])
def test_clipping_by_the_global_norm_fires_where_clip_grad_norm_does(clip, fires, tmp_path):
    """Each rank holds the gradients of its own chunks; the norm is global
    (about 1.1-1.3 here, for the sums of two micro-batches): 1.25 clips the
    first step only, 50 none. A clip factor not capped at 1 would scale the
    gradients of the other steps up."""
    spec = {"steps": 4, "global_batch": 4, "accumulation": 2, "clip": clip}
    norms = []
    model, losses, _ = reference(spec, norms=norms)
    assert_clip_fires(norms, clip, fires)
    result = run_ok(2, spec, tmp_path)
    assert result["norms"] == pytest.approx(norms, rel=1e-5)
    assert_matches(result, model, losses)
    assert all(r["evictions"] > 0 for r in result["reports"])
    assert_same_weights_on_every_rank(result)


def test_fp16_overflow_is_global(tmp_path):
    """A loss scale of 2^30 overflows: every rank skips the same steps with the
    same scale (the overflow check reads the global norm), and no rank's
    weights move apart from the others'."""
    spec = {"steps": 5, "global_batch": 4, "precision": "fp16", "scale_power": 30}
    result = run_ok(2, spec, tmp_path)
    reports = result["reports"]
    assert reports[0]["skipped_steps"] > 0
    assert len({(r["skipped_steps"], r["loss_scale"]) for r in reports}) == 1, reports
    assert_same_weights_on_every_rank(result)


def test_a_parameter_without_a_gradient_on_one_rank_is_named(tmp_path):
    """Rank 1's backward never reaches one parameter: both ranks fail at the
    end of that backward with the parameter's name (the reductions, each
    rank sending the same sizes, cannot hang on it)."""
    spec = {"steps": 2, "global_batch": 4, "budget": 1 << 30,
            "unused": {"rank": 1, "param": "blocks.1.fc.weight"}}
    codes, outs, seconds, _ = launch(2, spec, tmp_path, timeout=120)
    for out, code in zip(outs, codes, strict=True):
        assert code != 0
        assert ("parameters got gradients on some ranks only: 'blocks.1.fc.weight' "
                "(1 of 2 ranks)") in out, out[-3000:]


def test_a_backward_that_failed_on_a_rank_refuses_every_later_backward(one_rank_launcher):
    """A backward that fails part-way leaves this rank's 16-bit chunks with
    gradients where the other ranks' masters hold the weights: no later
    backward or step runs (they would issue collectives out of step with the
    other ranks); the error says what failed and to restart. One rank, in
    this process."""
    tidal.set_device("sim", capacity="1GiB")
    torch.manual_seed(0)
    cfg = config("64MiB")
    cfg["tidal"]["data_parallel"] = {"enabled": True}
    engine = tidal.initialize(TinyGPT(d=32, seq=8), cfg)
    one_rank_launcher.append(engine)
    assert engine.dp is not None and engine.dp.world == 1
    x, y = gpt_batches(1, batch=2)[0]
    engine.backward(engine(x, y))
    engine.step()
    assert engine.global_steps == 1

    def fail(grad):
        raise RuntimeError("this rank's backward fails")

    loss = engine(x, y)
    loss.register_hook(fail)
    with pytest.raises(RuntimeError, match="this rank's backward fails"):
        engine.backward(loss)
    for _ in range(2):  # (the refusal itself changes nothing)
        with pytest.raises(DataParallelError, match="a backward on this rank failed, so this "
                                                    "rank's 16-bit chunks hold gradients .* restart"):
            engine.backward(engine(x, y))
    assert engine.global_steps == 1


def test_zero_grad_between_backward_and_step_drops_the_gradients_and_their_norm(tmp_path):
    """A dropped micro-batch leaves nothing behind: not its gradients (the
    non-owners get their weights back from the owners), not its share of the
    global norm that clipping uses."""
    spec = {"steps": 3, "global_batch": 4, "clip": 0.05, "redo": 1}
    assert_matches(run_ok(2, spec, tmp_path), *reference(spec))


def test_a_gradient_read_between_backward_and_step_is_refused_by_name(tmp_path):
    """`p.grad` between backward and step under data parallel: a rank's slot
    holds its own gradient until the reduction, so every rank refuses it by
    name (Note [Gradients between backward and step]), and training goes on
    as if nothing had been asked."""
    spec = {"steps": 3, "global_batch": 4, "read_grad": 1}
    result = run_ok(2, spec, tmp_path)
    for report in result["reports"]:
        read = report["grad_read"]
        assert read["refused"] is not None, f"rank {report['rank']} handed out {read['param']}.grad"
        assert f"'{read['param']}'.grad read between engine.backward() and engine.step()" in read["refused"]
        assert "data-parallel" in read["refused"] and "gradient_clipping" in read["refused"]
    assert_matches(result, *reference(spec))


def test_optimizer_states_are_partitioned_by_chunk(tmp_path):
    """Each rank holds about 1/N of the fp32 master, momentum and variance
    bytes one process holds, and together exactly those bytes."""
    spec = {"steps": 1, "global_batch": 6}
    one = run_ok(1, spec, tmp_path)["reports"][0]["optimizer_state_bytes"]
    for world in (2, 3):
        parts = [r["optimizer_state_bytes"] for r in run_ok(world, spec, tmp_path)["reports"]]
        assert sum(parts) == one
        # By chunk: within one (dedicated, largest) chunk's states of 1/N.
        assert max(parts) <= one / world + 3 * 4 * 6144, (world, parts, one)


def test_checkpoint_saved_by_two_ranks_resumes_on_three_and_on_one(tmp_path):
    """Global batch 6: 3 x 2 per rank, 2 x 3, or 1 x 6. A run of 4 steps saved
    after step 2 by two ranks, resumed for steps 3-4 by three ranks or one
    process, ends where the uninterrupted run does."""
    ckpt = tmp_path / "ckpt"
    whole = {"steps": 4, "global_batch": 6}
    uninterrupted = run_ok(2, dict(whole, save={"after": 2, "dir": str(ckpt)}), tmp_path)
    model, losses, floor = reference(whole)
    assert_matches(uninterrupted, model, losses, floor)
    assert sorted(p.name for p in (ckpt / "ckpt").iterdir()) == [
        "extra.pt", "meta.json", "states-rank00000.bin", "states-rank00001.bin"]
    rest = {"steps": 2, "global_batch": 6, "start": 2, "load": str(ckpt)}
    for world in (3, 1):
        resumed = run_ok(world, rest, tmp_path)
        assert resumed["steps"] == 4
        assert_matches(resumed, model, losses[2:], floor)


def test_a_killed_rank_is_named_by_the_others_within_a_minute(tmp_path):
    spec = {"steps": 6, "global_batch": 6, "kill": {"rank": 1, "step": 2}}
    codes, outs, seconds, _ = launch(3, spec, tmp_path, timeout=120)
    assert codes[1] == -9
    for r in (0, 2):
        assert codes[r] != 0
        assert "DataParallelError" in outs[r] and "lost rank 1" in outs[r], outs[r][-3000:]
    assert seconds < 60


@pytest.mark.parametrize("differ, says", [({"width_of": {"1": 32}}, "model and chunk layout"),
                                          ({"model_seed": {"1": 5}}, "initial weights")])
def test_different_models_on_the_ranks_fail_at_initialize(differ, says, tmp_path):
    spec = dict({"steps": 1, "global_batch": 4, "budget": 1 << 30}, **differ)
    codes, outs, _, _ = launch(2, spec, tmp_path)
    assert codes[0] != 0 and codes[1] != 0
    for out in outs:
        assert "DataParallelError" in out and f"{says}: rank" in out, out[-3000:]


def test_tidal_train_runs_under_torchrun_and_rank_0_reports(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tidal.train", "--quick", "--steps", "3", "--no-progress", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    assert report["global_batch"] == 2 * report["micro_batch"] * report["gradient_accumulation_steps"]
    assert report["memory"]["data_parallel"]["world_size"] == 2
    assert report["last_loss"] < report["first_loss"]
    # One report, from rank 0.
    assert done.stdout.count("[tidal-train] report:") == 1


def test_a_parameter_no_rank_reaches_is_named_and_training_goes_on(tmp_path):
    """A trainable parameter without a gradient anywhere: the chunks after it
    in the reduction order wait for the end of backward (overlap_comm), so
    a warning names it; the ranks still agree on every weight."""
    spec = {"steps": 2, "global_batch": 4, "budget": 1 << 30,
            "unused": {"rank": "all", "param": "blocks.1.fc.weight"}}
    codes, outs, _, result = launch(2, spec, tmp_path)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    for out in outs:
        assert "trainable parameters got no gradient in this backward (blocks.1.fc.weight)" in out, \
            out[-3000:]
    assert_same_weights_on_every_rank(result)


def _bitwise(a, b):
    """Two runs' results: the same losses, norms and weights, bit for bit."""
    assert a["losses"] == b["losses"]
    assert a["norms"] == b["norms"]
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        assert a["weights"][name] == b["weights"][name], name
    assert [r["weights_crc"] for r in a["reports"]] == [r["weights_crc"] for r in b["reports"]]
    assert [r["skipped_steps"] for r in a["reports"]] == [r["skipped_steps"] for r in b["reports"]]


# Loss factors per step (TinyGPT(d=64): a global norm of about 2 at factor 1,
# 20 at factor 10): clipping at 5 fires on the factor-10 steps only, and
# steps 2 and 5 clip after a step that did not (their speculative updates
# are undone and made again).
DP_FACTORS = [1, 1, 10, 1, 1, 10, 1, 1]


@pytest.mark.parametrize("precision, clip, overlap_comm", [
    (None, 0.0, True), (None, 5.0, True), ("bf16", 5.0, True), (None, 5.0, False), ("fp16", 0.0, True),
])
def test_cpu_adam_during_backward_equals_the_step_without_it(precision, clip, overlap_comm, tmp_path):
    """Note [CPU Adam during backward] under data parallel: each owner
    launches a chunk's update as its reduction lands (during backward with
    overlap_comm, right after it without); the weights, losses and global
    norms are those of tidal.overlap_step false bit for bit, where the clip
    fires and where it does not. fp16 starts at a loss scale of 2^20, which
    overflows and is lowered step by step: the overflowing steps undo."""
    spec = {"steps": len(DP_FACTORS), "global_batch": 4, "clip": clip, "factors": DP_FACTORS,
            "overlap": overlap_comm}
    if precision:
        spec.update(precision=precision, scale_power=20)
    off = run_ok(2, dict(spec, overlap_step=False), tmp_path)
    on = run_ok(2, dict(spec, overlap_step=True), tmp_path)
    _bitwise(off, on)
    assert_same_weights_on_every_rank(on)
    opt = [r["optimizer"] for r in on["reports"]]
    assert all(o["overlap_step"] and o["overlap_step_off"] is None for o in opt), opt
    # Every rank owns chunks and updated some during backward.
    assert all(o["chunks_updated_during_backward"] > 0 for o in opt), opt
    assert all(r["optimizer"]["chunks_updated_during_backward"] == 0 for r in off["reports"])
    fired = [n > clip for n in off["norms"]] if clip else [False]
    if clip:
        assert any(fired) and not all(fired), off["norms"]
    undone = sum(o["undone_chunk_updates"] for o in opt)
    if any(fired) or precision == "fp16":
        assert undone > 0, opt
    else:
        assert undone == 0, opt
    if precision == "fp16":
        assert on["reports"][0]["skipped_steps"] > 0


def test_cpu_adam_during_backward_waits_under_accumulation(tmp_path):
    """Data parallel with gradient accumulation: the end of backward folds
    the owners' reduced gradients and broadcasts the weights back, which an
    update in flight would race, so nothing is launched; the result is the
    reference's."""
    spec = {"steps": 2, "global_batch": 4, "accumulation": 2}
    result = run_ok(2, spec, tmp_path)
    assert_matches(result, *reference(spec))
    assert all(r["optimizer"]["overlap_step"] and r["optimizer"]["chunks_updated_during_backward"] == 0
               for r in result["reports"])


def test_zero_grad_after_a_backward_that_updated_chunks_takes_them_back(tmp_path):
    """Data parallel, overlap_step on: at batch 4 the owners' updates made
    during backward are taken back by zero_grad (the redone micro-batch is
    what the step uses); every rank ends bitwise where overlap_step false does."""
    spec = {"steps": 6, "global_batch": 4, "clip": 50.0, "redo": 4}
    off = run_ok(2, dict(spec, overlap_step=False), tmp_path)
    on = run_ok(2, dict(spec, overlap_step=True), tmp_path)
    _bitwise(off, on)
    assert_same_weights_on_every_rank(on)
    opt = [r["optimizer"] for r in on["reports"]]
    # The path under test fired: updates made during backward were taken
    # back. Not asserted per rank: a rank's updates start as its owners'
    # reductions land, which on a loaded machine may all come after its
    # backward ended (seen once in a loaded run); the weights above are
    # bitwise on every rank either way.
    assert sum(o["undone_chunk_updates"] for o in opt) > 0, opt
    assert sum(o["chunks_updated_during_backward"] for o in opt) > 0, opt
