"""Gradient accumulation inside the chunks (Note [Gradient sums in chunks] in
cpu_adam/adam.h), on the simulated device, against plain PyTorch.

The references accumulate the way torch users do: fp32 training sums
`param.grad` over micro-batches and steps torch.optim.AdamW; mixed precision
keeps an fp32 master model, runs a 16-bit copy of it, adds each micro-batch's
16-bit gradients into fp32 sums and copies the masters back after the step.
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal._C.chunks import ChunkKind, MemorySpace

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import Renormed, gpt_batches, measured_budget, moved_within_budget, within_budget  # noqa: E402
# DeepSpeed's loop (step() acts at accumulation boundaries only), and plain
# PyTorch accumulating in param.grad with torch.optim.AdamW.
from engine_helpers import train_tidal as train  # noqa: E402
from engine_reference import LR, assert_clip_fires, train_reference as reference_fp32  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def config(accumulation, budget="64MiB", chunk=16384, precision=None, clip=0.0, **tidal_keys):
    t = {"chunk_size": chunk, "device_memory_budget": budget, "device_margin": 1024}
    t.update(tidal_keys)
    cfg = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "gradient_accumulation_steps": accumulation, "tidal": t}
    if clip:
        cfg["gradient_clipping"] = clip
    if precision is not None:
        cfg[precision] = {"enabled": True}
        if precision == "fp16":
            cfg["fp16"].update(initial_scale_power=8, hysteresis=1)
    return cfg


def reference_mixed(model, batches, accumulation, dtype, clip=0.0, loss_scale=1.0):
    """fp32 masters, a `dtype` working copy, fp32 sums of its gradients of the
    loss times loss_scale / accumulation, unscaled before the step."""
    master = copy.deepcopy(model)
    work = copy.deepcopy(model).to(dtype)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.01)
    pairs = list(zip(master.parameters(), work.parameters()))
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = work(x, y)
        (loss.float() * (loss_scale / accumulation)).backward()
        losses.append(loss.item())
        with torch.no_grad():
            for m, w in pairs:
                if w.grad is not None:
                    g = w.grad.float()
                    m.grad = g if m.grad is None else m.grad + g
                    w.grad = None
        if (i + 1) % accumulation == 0:
            for m in master.parameters():
                m.grad /= loss_scale
            if clip:
                torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for m, w in pairs:
                    w.copy_(m)
    return master, losses


def relative_errors(engine, ref):
    weights = engine.parameters_fp32()
    out = {}
    for name, p in ref.named_parameters():
        out[name] = ((weights[name] - p.detach()).norm() / p.detach().norm().clamp_min(1e-12)).item()
    return out


@pytest.mark.parametrize("where", ["moving", "device-simd", "device-fused"])
def test_fp32_accumulation_matches_adamw(where):
    # "moving": a budget measured on this machine with a quarter of the chunks
    # resident, so chunks move every micro-batch and the folds run on the
    # host; "device-*": everything fits, the folds and the steps run on the
    # device (cpu_adam's kernel, or the torch ops and fused AdamW a GPU runs).
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(12)
    ref_losses = reference_fp32(ref, batches, accumulation=3, clip=0.05)
    cfg = config(3, clip=0.05, hybrid_adam=True)
    if where == "moving":
        cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, batches)
    engine = tidal.initialize(model, cfg)
    if where != "moving":
        engine._step.device_adam_kernel = where.split("-")[1]
    losses = train(engine, batches)
    assert engine.global_steps == 4
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    errors = relative_errors(engine, ref)
    assert max(errors.values()) <= 1e-5, errors
    report = engine.memory_report()
    if where == "moving":
        assert report["evictions"] > 0
        assert report["adam_chunks_on_host"] > 0
    else:
        assert report["adam_chunks_on_host"] == 0
    within_budget(engine)


@pytest.mark.parametrize("clip, fires", [(1.3, "some"), (50.0, "never")])
def test_clipping_of_the_summed_gradients_fires_where_clip_grad_norm_does(clip, fires):
    # The norm is that of the sums over the micro-batches (about 1.2-1.7
    # here): 1.3 clips the first steps and not the last ones, 50 none. With
    # a factor not capped at 1, the unclipped steps would scale up.
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(12)
    norms = []
    ref_losses = reference_fp32(ref, batches, accumulation=3, clip=clip, norms=norms)
    assert_clip_fires(norms, clip, fires)
    cfg = config(3, clip=clip)
    cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, batches)
    engine = tidal.initialize(model, cfg)
    losses, seen = [], []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        steps = engine.global_steps
        engine.step()
        losses.append(loss.item())
        if engine.global_steps > steps:
            seen.append(engine.get_global_grad_norm())
    assert engine.global_steps == 4
    assert seen == pytest.approx(norms, rel=1e-5)
    for a, b in zip(ref_losses, losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    errors = relative_errors(engine, ref)
    assert max(errors.values()) <= 1e-5, errors
    moved_within_budget(engine)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_accumulation_matches_fp32_sums_of_16_bit_gradients(precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(6)
    cfg = config(3, precision=precision, clip=0.05)
    cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, batches)
    engine = tidal.initialize(model, cfg)
    # fp16: the engine's loss scale (2^8, no overflow here, so it stays).
    master, ref_losses = reference_mixed(ref, batches, accumulation=3, dtype=dtype, clip=0.05,
                                         loss_scale=engine.loss_scale)
    losses = train(engine, batches)
    assert engine.global_steps == 2 and engine.skipped_steps == 0
    # The first step's forward and backward are the same ops on the same
    # 16-bit weights: the same losses. After it, tidal's CPU Adam and torch's
    # round differently in the last fp32 bit, and a master one ulp apart can
    # round to another 16-bit weight, so the second step's losses agree only
    # to 16-bit precision.
    assert losses[:3] == ref_losses[:3]
    for a, b in zip(ref_losses[3:], losses[3:]):
        assert abs(a - b) <= 2e-2 * abs(a), (ref_losses, losses)
    errors = relative_errors(engine, master)
    assert max(errors.values()) <= 2e-3, errors
    moved_within_budget(engine)


def _train_images(ref, batches, cfg, images, hooks_wrapper=None):
    cfg = copy.deepcopy(cfg)
    cfg["tidal"]["fold_images"] = images  # (tidal.fold_images false: every fold restores)
    engine = tidal.initialize(copy.deepcopy(ref), cfg)
    hooks = engine._accumulation._hooks
    if hooks_wrapper is not None:
        engine._accumulation._hooks = hooks_wrapper(engine, hooks)
    losses = train(engine, batches)
    return engine, hooks, losses


@pytest.mark.parametrize("overlap", [True, False], ids=["folds-on-the-worker", "folds-after-backward"])
def test_a_fold_that_takes_back_the_weights_image_trains_bit_for_bit_as_the_restore(overlap):
    # Note [The weights' image instead of the restore] in hooks/gradient_sums.h:
    # with chunks moving, a fold on the host leaves the masters' rounding out
    # and the 16-bit chunk takes back the block it went up from. The losses,
    # masters and 16-bit weights must be those of every fold restoring from
    # the masters, bit for bit, and the run must match plain PyTorch's
    # mixed-precision accumulation as the restoring one does.
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    batches = gpt_batches(8)
    cfg = config(2, precision="bf16", clip=0.05, overlap_step=overlap)
    cfg["tidal"]["device_memory_budget"] = measured_budget(copy.deepcopy(ref), cfg, batches)
    runs = {images: _train_images(ref, batches, cfg, images) for images in (True, False)}
    (image, _, image_losses), (restore, _, restore_losses) = runs[True], runs[False]
    assert image.chunks.stats()["images_taken_back"] > 0
    assert image.memory_report()["images_taken_back"] == image.chunks.stats()["images_taken_back"]
    assert restore.chunks.stats()["images_taken_back"] == 0
    assert image_losses == restore_losses
    a, b = image.parameters_fp32(), restore.parameters_fp32()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    sa, sb = image.module.state_dict(), restore.module.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    master, ref_losses = reference_mixed(ref, batches, accumulation=2, dtype=torch.bfloat16, clip=0.05)
    assert image_losses[:2] == ref_losses[:2]
    for x, y in zip(ref_losses[2:], image_losses[2:]):
        assert abs(x - y) <= 2e-2 * abs(x), (ref_losses, image_losses)
    assert max(relative_errors(image, master).values()) <= 2e-3
    moved_within_budget(image)


class _CacheEmptiedBeforeEachFoldEnds:
    """The engine's hooks, except that the host's cached blocks are freed
    before a fold on the worker that would take back its chunk's image ends:
    the image is gone then."""

    def __init__(self, engine, hooks):
        self._engine, self._hooks = engine, hooks

    def __getattr__(self, name):
        return getattr(self._hooks, name)

    def end_fold(self, fold, folded):
        if not fold.takes_image:
            return self._hooks.end_fold(fold, folded)
        c = self._engine.chunks
        s = c.stats()
        budget = c.budget(MemorySpace.HOST)
        c.set_budget(MemorySpace.HOST, s["resident_bytes_host"])
        c.set_budget(MemorySpace.HOST, budget)
        return self._hooks.end_fold(fold, folded)


def test_a_fold_whose_image_is_gone_at_its_end_restores_from_the_masters():
    # The pass on the worker left the restore out; by its end the image went
    # (here: the host cache emptied). The fold restores then, and the run is
    # the restoring one's, bit for bit.
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    batches = gpt_batches(8)
    cfg = config(2, precision="bf16", clip=0.05)
    cfg["tidal"]["device_memory_budget"] = measured_budget(copy.deepcopy(ref), cfg, batches)
    late, late_hooks, late_losses = _train_images(ref, batches, cfg, True, _CacheEmptiedBeforeEachFoldEnds)
    restore, _, restore_losses = _train_images(ref, batches, cfg, False)
    # (Folds the end of backward makes in one call still take theirs back.)
    assert late_hooks.fold_late_restores > 0
    assert late_losses == restore_losses
    a, b = late.parameters_fp32(), restore.parameters_fp32()
    assert all(torch.equal(a[k], b[k]) for k in a)
    moved_within_budget(late)


def test_a_write_the_forward_makes_is_kept_where_folds_take_back_images():
    # The embedding's chunk is written after it goes up (the renorm), so the
    # block it went up from no longer holds its weights and its folds must
    # restore from the masters, which hold the write (Note [Writes to a
    # parameter]); other chunks' folds take their images back. As plain PyTorch accumulating in param.grad, and bit for
    # bit as with every fold restoring.
    torch.manual_seed(0)
    model = Renormed()
    with torch.no_grad():
        model.emb.weight.mul_(3.0)  # rows above max_norm: the forward renorms them
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 100, (4, 8), generator=g), torch.randn(4, 8, 64, generator=g)) for _ in range(8)]
    cfg = config(2, chunk="16KiB")
    cfg["tidal"].update(device_margin="4KiB", simulated_allocator="exact")
    cfg["tidal"]["device_memory_budget"] = measured_budget(copy.deepcopy(model), cfg, data)
    runs = {}
    for images in (True, False):
        cfg["tidal"]["fold_images"] = images
        engine = tidal.initialize(copy.deepcopy(model), cfg)
        for ids, y in data:
            engine.backward(engine(ids, y))
            engine.step()
        runs[images] = engine
    assert runs[True].chunks.stats()["images_taken_back"] > 0
    a, b = runs[True].parameters_fp32(), runs[False].parameters_fp32()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    for i, (ids, y) in enumerate(data):
        (ref(ids, y) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(a[k], v, rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")
    moved_within_budget(runs[True])


class Branchy(torch.nn.Module):
    """A parameter that only some micro-batches use (a dynamic graph)."""

    def __init__(self, width=24):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.extra = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        self.use_extra = False

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        if self.use_extra:
            h = torch.tanh(self.extra(h))
        return torch.nn.functional.mse_loss(self.b(h), y)


def test_a_parameter_used_by_some_micro_batches_only():
    # `extra` gets a gradient in the 2nd micro-batch of the first step only
    # and in the 1st of the second: its sum starts at whichever micro-batch
    # first reaches it, and a step where it got none leaves it out.
    torch.manual_seed(0)
    ref = Branchy()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 24, generator=g), torch.randn(4, 24, generator=g)) for _ in range(9)]
    uses = [False, True, False, True, False, False, False, False, False]
    engine = tidal.initialize(model, config(3, chunk=4096))

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    for i, ((x, y), use) in enumerate(zip(batches, uses)):
        ref.use_extra = model.use_extra = use
        (ref(x, y) / 3).backward()
        if (i + 1) % 3 == 0:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)  # AdamW skips a parameter without grad
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 3
    errors = relative_errors(engine, ref)
    assert max(errors.values()) <= 1e-5, errors


def test_gradient_sums_are_chunk_memory_given_back_at_the_step():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    trainable = sum(p.numel() for p in model.parameters())
    engine = tidal.initialize(model, config(2, precision="bf16", budget="64MiB"))
    assert engine.memory_report()["state_bytes_per_param"] == 18
    assert engine.store.state_bytes_per_param(trainable=False) == 2
    c = engine.chunks

    def resident():
        s = c.stats()
        return s["resident_bytes_host"] + s["resident_bytes_device"]

    def sum_chunk_bytes():  # the grad32 chunks that have memory, wherever it is
        return sum(c.chunk_capacity_bytes(i, ChunkKind.GRAD32) for i in range(c.num_chunks)
                   if c.chunk_space(i, ChunkKind.GRAD32) != MemorySpace.NONE)

    x, y = gpt_batches(1)[0]
    before = resident()
    assert sum_chunk_bytes() == 0
    engine.backward(engine(x, y))
    sums = sum_chunk_bytes()
    # Every trainable element has its fp32 sum in a chunk shaped like its
    # master's, counted with the other chunks; no tensor outside them.
    assert sums >= 4 * trainable
    assert sums == sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM32) for i in range(c.num_chunks))
    assert resident() == before + sums
    engine.backward(engine(x, y))
    assert sum_chunk_bytes() == sums
    engine.step()
    assert engine.global_steps == 1
    assert sum_chunk_bytes() == 0 and resident() == before


def test_zero_grad_drops_the_sums_of_an_unfinished_step():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    (xa, ya), (xb, yb) = gpt_batches(2)
    engine = tidal.initialize(model, config(2))
    engine.backward(engine(xa, ya))
    engine.zero_grad()            # micro-batch a is dropped
    engine.backward(engine(xb, yb))
    engine.step()                 # the boundary: b alone, divided by 2
    assert engine.global_steps == 1
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    (ref(xb, yb) / 2).backward()
    opt.step()
    errors = relative_errors(engine, ref)
    assert max(errors.values()) <= 1e-5, errors


def test_fp16_overflow_in_one_micro_batch_skips_the_step_and_the_next_one_trains():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    engine = tidal.initialize(model, config(2, precision="fp16"))
    batches = gpt_batches(4)
    before = {k: v.clone() for k, v in engine.parameters_fp32().items()}
    scale = engine.loss_scale
    param = list(model.parameters())[3]
    one_nan = torch.tensor([1])
    handle = param.register_hook(
        lambda g: g.flatten().index_fill(0, one_nan, float("nan")).view_as(g))
    x, y = batches[0]
    engine.backward(engine(x, y))   # the nan goes into a sum
    handle.remove()
    x, y = batches[1]
    engine.backward(engine(x, y))
    assert engine.step() is False
    assert engine.skipped_steps == 1 and engine.loss_scale == scale / 2
    after = engine.parameters_fp32()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    # The skipped step's sums are gone: the next step starts afresh.
    losses = train(engine, batches[2:])
    assert engine.skipped_steps == 1 and engine.global_steps == 2
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(engine.parameters_fp32()[k], before[k]) for k in before)


def test_a_failed_backward_keeps_the_earlier_micro_batches():
    # Micro-batch 2's backward raises after some of its gradients landed:
    # those are dropped (their slots get their weights back), micro-batch 1's
    # sums stay, and a retried micro-batch 2 finishes the step as if nothing
    # had failed.
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(2)
    reference_fp32(ref, batches, accumulation=2)
    engine = tidal.initialize(model, config(2))
    x, y = batches[0]
    engine.backward(engine(x, y))
    x, y = batches[1]
    loss = engine(x, y)
    first_block = engine.module.blocks[0]
    fired = []

    def fail_once(grad):
        if not fired:
            fired.append(True)
            raise RuntimeError("injected backward failure")
        return grad
    handle = first_block.qkv.weight.register_hook(fail_once)
    with pytest.raises(RuntimeError, match="injected backward failure"):
        engine.backward(loss)
    assert fired
    assert engine._wiring.hooks.summed_params()
    assert engine._wiring.hooks.landed_params() == []
    engine.backward(engine(x, y))
    handle.remove()
    engine.step()
    assert engine.global_steps == 1
    errors = relative_errors(engine, ref)
    assert max(errors.values()) <= 1e-5, errors


def test_a_checkpoint_in_the_middle_of_an_accumulation_is_refused(tmp_path):
    torch.manual_seed(0)
    engine = tidal.initialize(TinyGPT(d=64, seq=8), config(2))
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="gradients of an unfinished step are pending"):
        engine.save_checkpoint(tmp_path)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(tmp_path)


def test_the_accumulation_benchmark_quick_mode_runs_and_writes_its_result(tmp_path):
    import json
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "acc.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "engine_accumulation.py"), "--quick",
                    "--output", str(out)], check=True, cwd=root, capture_output=True, timeout=600)
    r = json.loads(out.read_text())["result"]
    fits, tight = r["runs"]["fits"], r["runs"]["tight"]
    # Everything fits: the folds and steps run where the chunks are, nothing moves.
    assert fits["bytes_host_to_device_per_micro_batch"] == 0
    assert fits["bytes_device_to_host_per_micro_batch"] == 0
    assert tight["bytes_host_to_device_per_micro_batch"] > 0 and tight["evictions"] > 0
    for run in (fits, tight):
        assert run["gradient_sum_bytes_per_param"] >= 4 and run["state_bytes_per_param"] == 20
    assert r["max_rel_loss_diff_vs_plain"] < 1e-4


def test_a_fold_that_fails_part_way_leaves_the_weights_and_says_what_to_do():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(3)
    engine = tidal.initialize(model, config(2, chunk=4096))
    real = engine._wiring.hooks

    class FailSecondFold:
        calls = 0

        def __getattr__(self, name):
            return getattr(real, name)

        def fold_gradients(self, *args, **kwargs):
            FailSecondFold.calls += 1
            if FailSecondFold.calls == 2:
                raise tidal.OutOfMemoryError("injected: no room for a gradient sum chunk")
            return real.fold_gradients(*args, **kwargs)

    # The folds are the accumulation's calls into the hooks.
    engine._accumulation._hooks = FailSecondFold()
    x, y = batches[0]
    with pytest.raises(tidal.OutOfMemoryError, match="injected") as info:
        engine.backward(engine(x, y))
    assert any("engine.zero_grad()" in n for n in info.value.__notes__)
    assert engine._wiring.hooks.landed_params() == []
    engine._accumulation._hooks = real
    # The weights are intact: after zero_grad the run matches plain PyTorch
    # on the micro-batches that followed.
    engine.zero_grad()
    losses = train(engine, batches[1:])
    ref_losses = reference_fp32(ref, batches[1:], accumulation=2)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    errors = relative_errors(engine, ref)
    assert max(errors.values()) <= 1e-5, errors


def test_a_short_last_window_steps_when_the_boundary_is_set():
    # DeepSpeed's set_gradient_accumulation_boundary: 3 micro-batches a step,
    # then a window of 2 that the script ends itself (an epoch's last
    # batches). The script divides its losses (scale_wrt_gas=False), as the
    # Hugging Face Trainer does; the reference sums param.grad and steps AdamW.
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(5)
    windows = [3, 3, 3, 2, 2]  # each micro-batch's window length
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    for i, (x, y) in enumerate(batches):
        (ref(x, y) / windows[i]).backward()
        if i in (2, 4):
            opt.step()
            opt.zero_grad()
    engine = tidal.initialize(model, config(3))
    for i, (x, y) in enumerate(batches):
        engine.set_gradient_accumulation_boundary(True if i == 4 else None)
        engine.backward(engine(x, y) / windows[i], scale_wrt_gas=False)
        engine.step()
    assert engine.global_steps == 2
    weights = engine.parameters_fp32()
    for name, p in ref.named_parameters():
        err = (weights[name] - p.detach()).norm() / p.detach().norm()
        assert err <= 1e-5, f"{name}: relative L2 error {err:.3g}"
    with pytest.raises(TypeError, match=r"True, False or None, got 1"):
        engine.set_gradient_accumulation_boundary(1)
