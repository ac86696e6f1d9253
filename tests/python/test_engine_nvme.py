"""The NVMe tier under the engine (Note [Chunks on NVMe: the tier] in
runtime/scheduler/disk_tier.h): DeepSpeed's offload_optimizer / offload_param
"nvme" puts chunks in a file when the host budget is full. A model trains to
the same losses and weights with and without it (exact in fp32 and bf16), a
model whose states need three times the host budget trains with the loss
falling, and the faults the issue names are clear errors that lose nothing."""
import copy
import errno
import functools
import gc
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tidal
from tidal._C.chunks import ChunkKind, MemorySpace

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, measured_budget, train_tidal, within_budget  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

CHUNK = 8192
MARGIN = 4096


@functools.lru_cache(maxsize=None)
def device_budget() -> int:
    """Room for TinyGPT's activations as this machine measures them, and
    half its 16-bit chunks (engine_helpers.measured_budget)."""
    tidal.set_device("sim", capacity="1GiB")
    return measured_budget(make_model(), config(device=0), gpt_batches(2, vocab=96, seq=16, batch=4),
                           chunk_share=0.5)


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def config(nvme=None, host=0, device=None, precision="fp32", param=False, **tidal_keys):
    t = {"chunk_size": CHUNK, "device_memory_budget": device_budget() if device is None else device,
         "device_margin": MARGIN,
         "host_memory_budget": host}
    t.update(tidal_keys)
    c = {"gradient_clipping": 1.0, "tidal": t,
         "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}}}
    if nvme is not None:
        z = {"offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}
        if param:
            z["offload_param"] = {"device": "nvme", "nvme_path": str(nvme)}
        c["zero_optimization"] = z
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    return c


def make_model():
    torch.manual_seed(0)
    return TinyGPT(vocab=96, d=64, layers=3, heads=4, seq=16)


def state_bytes(model):
    return 16 * sum(p.numel() for p in model.parameters())


def initialize(model, cfg):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*dedicated chunk.*")
        return tidal.initialize(model, cfg)


def slots_files(folder):
    return sorted(p.name for p in Path(folder).glob("tidal-*.slots"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_twin_trains_to_the_same_losses_and_weights_with_and_without_nvme(tmp_path, precision):
    ref = make_model()
    batches = gpt_batches(5, vocab=96, seq=16, batch=4)
    plain = initialize(copy.deepcopy(ref), config(precision=precision))
    plain_losses = train_tidal(plain, batches)
    host = state_bytes(ref) // 4
    engine = initialize(copy.deepcopy(ref), config(tmp_path, host=host, precision=precision))
    losses = train_tidal(engine, batches)
    assert losses == plain_losses
    want, got = plain.parameters_fp32(), engine.parameters_fp32()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    s = engine.chunks.stats()
    assert s["moves_host_to_disk"] > 0 and s["moves_disk_to_host"] > 0, s
    assert s["bytes_host_to_disk"] == engine.chunks.disk["bytes_written"]
    assert s["bytes_disk_to_host"] == engine.chunks.disk["bytes_read"]
    report = engine.memory_report()
    assert report["peak_chunk_host_bytes"] <= host, report
    n = report["nvme"]
    assert n["bytes_read"] == engine.chunks.disk["bytes_read"] and n["chunks_written"] > 0, n
    assert 0 < n["peak_bytes_on_disk"] <= n["file_bytes"] and n["backend"] == "threads", n
    assert plain.memory_report()["nvme"] is None
    within_budget(engine)


def test_states_three_times_the_host_budget_train_with_the_loss_falling(tmp_path):
    model = make_model()
    state = state_bytes(model)
    host = state // 3
    gc.collect()
    baseline = tidal._C.host_memory_stats()["allocated"]
    engine = initialize(model, config(tmp_path, host=host))
    batch = gpt_batches(1, vocab=96, seq=16, batch=4)
    losses = train_tidal(engine, batch * 5)  # one batch again and again: the loss must fall
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    s = engine.chunks.stats()
    # Most of the state is not in host memory: on disk, and on the device.
    assert s["resident_bytes_disk"] + s["resident_bytes_device"] >= state - host, s
    assert s["resident_bytes_disk"] > 0, s
    assert engine.memory_report()["peak_chunk_host_bytes"] <= host
    # What the process holds for chunk payloads stays within the host budget.
    assert tidal._C.host_memory_stats()["allocated"] - baseline <= host
    # The file holds one home per chunk of the lists on disk: 12 of the 16 bytes per parameter.
    assert engine.chunks.disk["file_bytes"] <= state * 12 // 16 + 64 * 4096
    within_budget(engine)


def test_offload_param_puts_the_16_bit_chunks_on_disk_too(tmp_path):
    model = make_model()
    engine = initialize(model, config(tmp_path, host=state_bytes(model) // 8, param=True,
                                      hybrid_adam=False))
    train_tidal(engine, gpt_batches(2, vocab=96, seq=16, batch=4))
    c = engine.chunks
    kinds = {k for k in (ChunkKind.PARAM16, ChunkKind.PARAM32, ChunkKind.MOMENTUM, ChunkKind.VARIANCE)
             for i in range(c.num_chunks) if c.chunk_space(i, k) == MemorySpace.DISK}
    assert ChunkKind.PARAM16 in kinds, kinds
    # And without offload_param they stay off it.
    other = initialize(make_model(), config(tmp_path, host=state_bytes(model) // 3))
    train_tidal(other, gpt_batches(2, vocab=96, seq=16, batch=4))
    c = other.chunks
    assert all(c.chunk_space(i, ChunkKind.PARAM16) != MemorySpace.DISK for i in range(c.num_chunks))


def make_narrow_model():
    """Many small modules (no chunk of its own for any tensor): with little
    chunk room on the device and a host smaller than the 16-bit list, the
    16-bit chunks forward reads from disk go back to disk before backward."""
    torch.manual_seed(0)
    return TinyGPT(vocab=96, d=32, layers=8, heads=4, seq=16)


@functools.lru_cache(maxsize=None)
def narrow_device_budget(precision) -> int:
    """The activations' room as measured, and chunk room for the largest
    module only (engine_helpers.measured_budget)."""
    tidal.set_device("sim", capacity="1GiB")
    return measured_budget(make_narrow_model(), config(device=0, precision=precision),
                           gpt_batches(2, vocab=96, seq=16, batch=4), chunk_share=0.0)


def _param_run(folder, ref, batches, precision, skip, between=None, in_forward=False):
    """Trains a copy of `ref` (make_narrow_model) with both lists on disk
    (offload_param), a host budget of 30% of the 16-bit list and
    tidal.nvme_skip_clean_writes = `skip`. between(model, step): a write the
    script makes between steps; in_forward: every forward of the first
    block's qkv writes its weight in place (a forward pre-hook, under no_grad)."""
    model = copy.deepcopy(ref)
    if in_forward:
        def scale(module, args):
            with torch.no_grad():
                module.weight.mul_(0.999)
        model.blocks[0].qkv.register_forward_pre_hook(scale)
    bytes16 = (2 if precision == "bf16" else 4) * sum(p.numel() for p in ref.parameters())
    engine = initialize(model, config(folder, host=int(0.3 * bytes16), device=narrow_device_budget(precision),
                                      precision=precision, param=True, hybrid_adam=False,
                                      nvme_skip_clean_writes=skip))
    losses = []
    for step, (x, y) in enumerate(batches):
        if between is not None and step > 0:
            between(model, step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunks_only_read_go_back_to_disk_unwritten_and_train_bitwise_the_same(tmp_path, precision):
    """Note [Chunks on NVMe: clean chunks]: with the 16-bit list on disk, the
    chunks forward reads go back without a write; losses and weights equal
    the in-memory run's and the run that writes every chunk, which moves the
    same chunks and writes exactly the skipped bytes more."""
    ref = make_narrow_model()
    batches = gpt_batches(5, vocab=96, seq=16, batch=4)
    plain = initialize(copy.deepcopy(ref), config(precision=precision))
    plain_losses = train_tidal(plain, batches)
    runs = {}
    for skip in (True, False):
        folder = tmp_path / str(skip)
        folder.mkdir()
        runs[skip] = _param_run(folder, ref, batches, precision, skip)
    want = plain.parameters_fp32()
    for skip, (engine, losses) in runs.items():
        assert losses == plain_losses, (skip, losses, plain_losses)
        got = engine.parameters_fp32()
        for name in want:
            assert torch.equal(want[name], got[name]), (skip, name)
        within_budget(engine)
    on, off = runs[True][0].memory_report()["nvme"], runs[False][0].memory_report()["nvme"]
    assert off["writes_skipped"] == 0 and off["bytes_writes_skipped"] == 0, off
    assert on["writes_skipped"] > 0, on
    assert on["bytes_written"] == runs[True][0].chunks.disk["bytes_written"], on
    assert on["bytes_read"] == off["bytes_read"], (on, off)
    assert on["bytes_written"] + on["bytes_writes_skipped"] == off["bytes_written"], (on, off)
    # (Over the run, not its last step: in a steady step here every chunk
    # read is updated and so written. The chunks steady steps read and gave
    # back unwritten were those StepOverlap's undo buffers read their dtypes
    # from, at each launch the host had no room for: a read from disk of
    # each for nothing, which doubled the bytes read per steady step, 3.78 MB
    # against 1.87 MB here; the dtypes come from the config now.)
    assert on["bytes_written"] < off["bytes_written"], (on, off)
    assert on["bytes_read_last_step"] <= on["file_bytes"], on


def test_writes_to_parameters_reach_disk_with_the_skip(tmp_path):
    """Fail closed: a parameter written in place inside a forward (read from
    disk for that forward), by the script between steps, and set with
    `p.data = ...` between steps keeps its write with the skip as without it."""
    ref = make_narrow_model()
    batches = gpt_batches(5, vocab=96, seq=16, batch=4)

    def between(model, step):
        with torch.no_grad():
            model.blocks[1].fc.weight.mul_(0.5)  # (through the module: brought in)
        w = model.blocks[2].out.weight
        w.data = torch.full(tuple(w.shape), 0.01 * step, dtype=w.dtype, device=w.device)

    runs = {}
    for skip in (True, False):
        folder = tmp_path / str(skip)
        folder.mkdir()
        runs[skip] = _param_run(folder, ref, batches, "bf16", skip, between=between, in_forward=True)
    (on, on_losses), (off, off_losses) = runs[True], runs[False]
    assert on_losses == off_losses
    want, got = off.parameters_fp32(), on.parameters_fp32()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert on.memory_report()["nvme"]["writes_skipped"] > 0
    # The writes did something: the model differs from one trained without them.
    plain = initialize(copy.deepcopy(ref), config(precision="bf16"))
    assert train_tidal(plain, batches) != on_losses


def test_the_file_goes_with_the_engine(tmp_path):
    engine = initialize(make_model(), config(tmp_path, host=state_bytes(make_model()) // 3))
    train_tidal(engine, gpt_batches(1, vocab=96, seq=16, batch=4))
    path = engine.chunks.disk["path"]
    assert os.path.exists(path) and Path(path).parent == tmp_path
    engine.remove_hooks()
    del engine
    gc.collect()
    assert not os.path.exists(path)
    assert slots_files(tmp_path) == []


def test_a_file_a_killed_process_left_is_removed_with_a_warning(tmp_path):
    stale = tmp_path / "tidal-999999-3.slots"
    stale.write_bytes(b"\0" * 4096)
    with pytest.warns(UserWarning, match=r"removed 1 NVMe file\(s\) a killed process left in .*"
                                         r"tidal-999999-3\.slots"):
        engine = tidal.initialize(make_model(), config(tmp_path))
    assert not stale.exists()
    engine.remove_hooks()


def test_a_disk_too_small_fails_at_initialize_and_loses_nothing(tmp_path):
    model = make_model()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(tidal.OutOfMemoryError) as info:
        initialize(model, config(tmp_path, host=state_bytes(model) // 3, nvme_budget="64KiB"))
    message = str(info.value)
    assert "NVMe" in message and str(tmp_path) in message, message
    assert "64.00 KiB" in message and "free" in message, message
    # The bytes the whole run needs, counted from the model (fp32: 16 per parameter) ...
    n = sum(p.numel() for p in model.parameters())
    assert f"the model's {n} parameters need about {16 * n} bytes of chunks in all" in message, message
    # ... and the room, the disk's budget in it: host + device + 64 KiB, 12 of the 16 bytes there.
    host, device = (int(x) for x in re.search(r"chunks may hold (\d+) bytes on the host .*? plus "
                                              r"(\d+) bytes on the device", message).groups())
    assert "plus 65536 bytes on the NVMe tier" in message and "12 of the 16 bytes" in message, message
    assert f"room for at most about {(host + device + 65536) // 16} parameters" in message, message
    assert "Raise tidal.nvme_budget" in message, message
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    gc.collect()
    assert slots_files(tmp_path) == []  # the failed engine's file is gone too


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_a_folder_on_tmpfs_is_refused_or_allowed_with_a_warning():
    shm = Path(os.environ.get("TIDAL_TEST_TMPFS", "/dev/shm")) / f"tidal-nvme-test-{os.getpid()}"
    shm.mkdir()
    try:
        with pytest.raises(ValueError) as info:
            initialize(make_model(), config(shm))
        assert "is on tmpfs, whose files are host memory" in str(info.value), str(info.value)
        assert str(shm) in str(info.value), str(info.value)
        with pytest.warns(UserWarning, match="is on tmpfs .* stay in host memory"):
            engine = tidal.initialize(make_model(), config(shm, host=state_bytes(make_model()) // 3,
                                                           nvme_allow_buffered=True))
        train_tidal(engine, gpt_batches(2, vocab=96, seq=16, batch=4))
        assert engine.chunks.stats()["moves_host_to_disk"] > 0
        engine.remove_hooks()
    finally:
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()


def test_a_checkpoint_of_an_nvme_engine_saves_and_loads_like_any_other(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    host = state_bytes(make_model()) // 3
    batches = gpt_batches(4, vocab=96, seq=16, batch=4)
    first = initialize(make_model(), config(nvme, host=host))
    train_tidal(first, batches[:2])
    first.save_checkpoint(tmp_path / "ckpt")
    assert first.chunks.stats()["resident_bytes_disk"] > 0
    rest = train_tidal(first, batches[2:])
    second = initialize(make_model(), config(nvme, host=host))
    second.load_checkpoint(tmp_path / "ckpt")
    assert train_tidal(second, batches[2:]) == rest
    want, got = first.parameters_fp32(), second.parameters_fp32()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    # And into an engine without NVMe: the same state.
    third = initialize(make_model(), config())
    third.load_checkpoint(tmp_path / "ckpt")
    assert train_tidal(third, batches[2:]) == rest


def test_config_keys_of_the_nvme_tier(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(tidal.ConfigError, match="differ; tidal keeps every chunk on disk in one file"):
        tidal.Config.load({"zero_optimization": {
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_param": {"device": "nvme", "nvme_path": str(other)}}})
    with pytest.warns(UserWarning) as record:
        c = tidal.Config.load({"aio": {"block_size": 262144, "queue_depth": 32, "single_submit": True},
                               "zero_optimization": {"offload_optimizer": {
                                   "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 8,
                                   "pipeline_read": True}}})
    text = "\n".join(str(w.message) for w in record)
    assert c.nvme_path == str(tmp_path) and c.nvme_lists == ("optimizer",)
    assert c.aio_block_size == 262144 and c.aio_queue_depth == 32
    assert "'zero_optimization.offload_optimizer.buffer_count' = 8 is not used by tidal" in text
    assert "'aio.single_submit' = True is not used by tidal" in text
    assert "pipeline_read" not in text and "'aio.block_size'" not in text
    with pytest.warns(UserWarning, match="'zero_optimization.offload_optimizer.nvme_path' = .* is "
                                         "not used by tidal: it is read only with"):
        tidal.Config.load({"zero_optimization": {"offload_optimizer": {
            "device": "cpu", "nvme_path": str(tmp_path)}}})


def test_the_estimate_knows_the_tier(tmp_path):
    model = make_model()
    host = state_bytes(model) // 3
    kw = dict(device_memory="1GiB", host_memory="64GiB", measure=False, micro_batch=4, seq=16)
    without = tidal.estimate(make_model().to("meta"), config(host=host), **kw)
    with_nvme = tidal.estimate(make_model().to("meta"), config(tmp_path, host=host), **kw)
    assert not without["fits_states"] and with_nvme["fits_states"], (without, with_nvme)
    assert with_nvme["nvme"]["lists"] == ["optimizer"] and with_nvme["nvme"]["bytes_per_param"] == 12
    assert with_nvme["largest_model_params"] > without["largest_model_params"]
    # And the engine trains what the estimate says fits, moving at most what it says.
    engine = initialize(make_model(), config(tmp_path, host=host))
    train_tidal(engine, gpt_batches(3, vocab=96, seq=16, batch=4))
    s = engine.chunks.stats()
    assert s["resident_bytes_disk"] <= with_nvme["nvme"]["states_on_disk"]
    assert with_nvme["time"]["disk_s"] > 0


def test_both_io_backends_train_to_the_same_losses(tmp_path):
    batches = gpt_batches(3, vocab=96, seq=16, batch=4)
    host = state_bytes(make_model()) // 3
    runs = {}
    for io in ("threads", "io_uring", "auto"):
        try:
            engine = initialize(make_model(), config(tmp_path, host=host, nvme_io=io))
        except ValueError as e:
            # Built without liburing, or a kernel that forbids io_uring: a clear error naming it.
            assert io == "io_uring" and "io_uring" in str(e), str(e)
            continue
        runs[io] = (train_tidal(engine, batches), engine.chunks.disk["backend"])
        assert engine.chunks.stats()["moves_host_to_disk"] > 0
        engine.remove_hooks()
    assert runs["threads"][1] == "threads"
    assert runs["auto"][1] == ("io_uring" if "io_uring" in runs else "threads")
    for io, (losses, backend) in runs.items():
        assert losses == runs["threads"][0], io
    with pytest.raises(tidal.ConfigError, match="tidal.nvme_io"):
        tidal.Config.load({"tidal": {"nvme_io": "aio"}})


_CHILD = """
import os, signal, sys, warnings
sys.path.insert(0, {tests!r})
import tidal
from test_engine_nvme import config, make_model, state_bytes, initialize
tidal.set_device("sim", capacity="1GiB")
engine = initialize(make_model(), config({folder!r}, host=state_bytes(make_model()) // 3))
keep = [engine]
keep.append(keep)  # a cycle: nothing guarantees the engine is destroyed at exit
print(engine.chunks.disk["path"], flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_file_goes_at_exit_and_a_killed_process_file_at_the_next_start(tmp_path):
    import subprocess
    code = _CHILD.format(tests=str(Path(__file__).parent), folder=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code, "exit"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip().splitlines()[-1]
    assert Path(path).parent == tmp_path
    assert slots_files(tmp_path) == [], "the file outlived a normal exit"
    killed = subprocess.run([sys.executable, "-c", code, "kill"], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    left = killed.stdout.strip().splitlines()[-1]
    assert slots_files(tmp_path) == [Path(left).name]  # SIGKILL runs nothing
    with pytest.warns(UserWarning, match="removed 1 NVMe file"):
        engine = tidal.initialize(make_model(), config(tmp_path))
    assert not Path(left).exists()
    engine.remove_hooks()


def test_frozen_parameters_with_the_tier(tmp_path):
    # Frozen tensors live in a pool of their own (16-bit chunks, no master):
    # the tier takes only what exists, and a twin trains to the same losses.
    runs = []
    for nvme in (None, tmp_path):
        model = make_model()
        for name, p in model.named_parameters():
            if name.startswith(("wte", "blocks.0")):
                p.requires_grad_(False)
        host = state_bytes(model) // 4
        engine = initialize(model, config(nvme, host=host if nvme else 0))
        runs.append(train_tidal(engine, gpt_batches(3, vocab=96, seq=16, batch=4)))
        if nvme is not None:
            assert engine.chunks.stats()["moves_host_to_disk"] > 0
            within_budget(engine)
    assert runs[0] == runs[1]


# ---- a disk that fails (Note [Chunks on NVMe: after a failure]) -------------
PHASES = ("forward", "backward", "step")


def fault_config(tmp_path):
    # The 16-bit parameters go to disk too and the host holds an eighth of the
    # states: forward, backward and the step each read chunks and write others.
    return config(tmp_path, host=state_bytes(make_model()) // 8, param=True, hybrid_adam=False)


def io_counts(engine):
    s = engine.chunks.stats()
    return {"read": s["moves_disk_to_host"], "write": s["moves_host_to_disk"]}


def phased_step(engine, batch, log: list):
    """One training step; appends (phase, the tier's reads and writes so far)
    as each phase ends, and for the phase that raises, before it re-raises."""
    x, y = batch
    phase = "forward"
    try:
        loss = engine(x, y)
        log.append((phase, io_counts(engine)))
        phase = "backward"
        engine.backward(loss)
        log.append((phase, io_counts(engine)))
        phase = "step"
        engine.step()
        log.append((phase, io_counts(engine)))
    except BaseException:
        log.append((phase, io_counts(engine)))
        raise


def steady_io_by_phase(folder) -> dict:
    """direction -> phase -> the reads (writes) a steady step makes in it."""
    engine = initialize(make_model(), fault_config(folder))
    batches = gpt_batches(3, vocab=96, seq=16, batch=4)
    train_tidal(engine, batches[:2])
    last, log = io_counts(engine), []
    phased_step(engine, batches[2], log)
    out = {d: {} for d in last}
    for phase, counts in log:
        for d in out:
            out[d][phase] = counts[d] - last[d]
        last = counts
    engine.remove_hooks()
    return out


@pytest.mark.parametrize("direction", ["read", "write"])
def test_a_failed_read_or_write_anywhere_in_a_step_is_refused_with_the_first_error(tmp_path, direction):
    # Injected EIO (DirectFile::fail_nth, as a broken disk answers) at the
    # first and the last read or write of each part of a steady step: the
    # error is the disk's, never an internal one; the scheduler's state stays
    # whole; every later forward, backward and step is refused with it; the
    # file still goes with the engine.
    reference = tmp_path / "reference"
    reference.mkdir()
    counts = steady_io_by_phase(reference)[direction]
    assert all(counts[p] > 0 for p in PHASES), counts
    points, before = [], 0
    for phase in PHASES:
        points += sorted({before + 1, before + counts[phase]})
        before += counts[phase]
    batches = gpt_batches(4, vocab=96, seq=16, batch=4)
    injected = set()
    for n in points:
        folder = tmp_path / f"run{n}"
        folder.mkdir()
        engine = initialize(make_model(), fault_config(folder))
        train_tidal(engine, batches[:2])
        engine.chunks._fail_disk_io(direction, n)
        start, log, first = io_counts(engine)[direction], [], None
        for batch in batches[2:]:
            try:
                phased_step(engine, batch, log)
            except RuntimeError as e:
                first = e
                break
        assert first is not None, f"{direction} {n}: the injected failure never surfaced"
        assert not isinstance(first, tidal._C.InternalError), first
        # Where the failed request was issued (its error may surface later).
        injected.add(next(phase for phase, c in log if c[direction] - start >= n))
        failure = engine.chunks.disk["failure"]
        assert failure is not None and str(folder) in failure, failure
        assert os.strerror(errno.EIO) in failure, failure
        assert ("writing " if direction == "write" else "reading ") in failure, failure
        assert failure in str(first), (str(first), failure)
        engine.chunks.validate()
        x, y = batches[0]
        for refused in (lambda: engine(x, y),
                        lambda: engine.backward(torch.zeros((), requires_grad=True)),
                        engine.step):
            with pytest.raises(RuntimeError, match="the NVMe tier failed earlier") as info:
                refused()
            assert failure in str(info.value) and not isinstance(info.value, tidal._C.InternalError)
            engine.chunks.validate()
        assert engine.memory_report()["nvme"]["failure"] == failure
        engine.remove_hooks()
        del engine, first, info, refused
        gc.collect()
        assert slots_files(folder) == [], "the file outlived the failed engine"
    assert injected == set(PHASES), (direction, points, injected)


@pytest.mark.parametrize("share", [3, 6])
def test_the_estimates_steady_disk_traffic_is_the_engines_in_bf16(tmp_path, share):
    # Measured against the engine: a bf16 GPT whose states need `share` times
    # the host budget, with hybrid Adam keeping the states it updates on the
    # device (which the estimate once counted as read and written too).
    def build():
        return TinyGPT(vocab=4096, d=256, layers=4, heads=4, seq=64)

    torch.manual_seed(0)
    model = build()
    n = sum(p.numel() for p in model.parameters())
    cfg = {"gradient_clipping": 1.0, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "tidal": {"chunk_size": "512KiB", "device_memory_budget": "48MiB",
                     "host_memory_budget": n * 14 // share},
           "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with torch.device("meta"):
        meta = build()  # (built on meta, so the tied head stays one tensor)
    est = tidal.estimate(meta, cfg, device_memory="1GiB", host_memory="64GiB", measure=False,
                         micro_batch=4, seq=64)
    engine = initialize(model, cfg)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 4096, (4, 64), generator=g) for _ in range(2))
    per_step = []
    for _ in range(4):
        before = engine.chunks.stats()
        engine.backward(engine(x, y))
        engine.step()
        after = engine.chunks.stats()
        per_step.append((after["bytes_disk_to_host"] - before["bytes_disk_to_host"],
                         after["bytes_host_to_disk"] - before["bytes_host_to_disk"]))
    read, written = per_step[-1]  # a steady step (the first fill the file)
    assert read > 0 and written > 0, per_step
    t = est["traffic"]
    assert t["bytes_disk_read"] == t["bytes_disk_write"]
    assert abs(t["bytes_disk_read"] - read) <= 0.05 * read, (t["bytes_disk_read"], per_step)
    assert abs(t["bytes_disk_write"] - written) <= 0.05 * written, (t["bytes_disk_write"], per_step)
    within_budget(engine)
