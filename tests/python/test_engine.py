"""The training engine against plain PyTorch (simulated device, small models).

Every test trains a reference copy with torch.optim.AdamW first, then the same
model under tidal with a device budget below its state size, and compares
losses and the fp32 master weights. Parameter agreement is measured as the
relative L2 error per tensor: elementwise, Adam amplifies last-bit
differences (tidal's CPU Adam rounds like DeepSpeed's, not like torch) on
elements whose gradient is near zero.
"""
import contextlib
import copy
import math
import sys
from pathlib import Path

import pytest
import torch

import tidal

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import (raw_numel, gpt_batches, measured_budget, moved_within_budget,  # noqa: E402
                            train_tidal, within_budget)
from engine_reference import LR, assert_clip_fires, assert_close, config, fitted, train_reference  # noqa: E402
from tidal.models.gpt import TinyGPT, TinyResNet  # noqa: E402

@pytest.fixture(autouse=True)
def simulated_device():
    """These tests are about the engine's logic on CPU tensors: simulated device."""
    tidal.set_device("sim", capacity="1GiB")


def state_bytes(model):
    return 16 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("hybrid", [False, True])
def test_gpt_fp32_matches_adamw_under_a_small_budget(hybrid):
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(20)
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, fitted(config(hybrid_adam=hybrid), model, batches))
    losses = train_tidal(engine, batches)
    assert_close(engine, ref, ref_losses, losses)
    report = engine.memory_report()
    assert report["device_budget"] < state_bytes(ref)
    assert report["evictions"] > 0 and report["prefetches"] > 0
    # The budget holds: chunk + non-chunk bytes at their peak within it, and
    # no overrun counted, the warm-up included.
    within_budget(engine)
    if hybrid:
        # Beside the activations the budget holds a quarter of the 16-bit
        # chunks and no states: hybrid Adam's plan updates every chunk on the
        # host rather than pull its states up and push them down again (Note
        # [Where a chunk's Adam runs]; test_engine_offload_shape.py has a
        # budget whose room keeps some states on the device).
        assert report["adam_chunks_on_host"] > 0


@pytest.mark.parametrize("kernel", ["simd", "fused"])
def test_device_chunk_steps_match_adamw_with_clipping(kernel):
    # Hybrid Adam updates the chunks on the device one chunk per call: with
    # cpu_adam's SIMD kernel on the simulated device, with torch's fused AdamW
    # on a GPU ("fused" runs that path here on the simulated device's CPU
    # tensors, as it runs on CUDA ones).
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(12)
    ref_losses = train_reference(ref, batches, clip=0.05)
    cfg = config(hybrid_adam=True, budget="64MiB")
    cfg["gradient_clipping"] = 0.05
    engine = tidal.initialize(model, cfg)
    engine._step.device_adam_kernel = kernel
    losses = train_tidal(engine, batches)
    assert_close(engine, ref, ref_losses, losses)
    report = engine.memory_report()
    assert report["adam_chunks_on_device"] > 0 and report["adam_chunks_on_host"] == 0


def trained_with_both_device_kernels(edit_config, batches: int) -> dict:
    """kernel -> an engine trained on `batches` GPT batches with hybrid Adam
    and that device kernel ("simd": cpu_adam's; "fused": torch's, a GPU's,
    run here on the simulated device's CPU tensors), each from the same
    start; `edit_config(cfg)` changes the config first. Each engine updated
    chunks on the device, within its budget."""
    engines = {}
    for kernel in ("simd", "fused"):
        torch.manual_seed(0)
        model = TinyGPT(d=64, seq=8)
        cfg = config(hybrid_adam=True, budget="64MiB", chunk=1 << 16)
        edit_config(cfg)
        engine = tidal.initialize(model, cfg)
        engine._step.device_adam_kernel = kernel
        train_tidal(engine, gpt_batches(batches))
        assert engine.memory_report()["adam_chunks_on_device"] > 0
        within_budget(engine)
        engines[kernel] = engine
    return engines


@pytest.mark.parametrize("accumulation", [1, 2])
def test_device_steps_without_bias_correction_agree_between_the_kernels(accumulation):
    # Without bias correction torch's fused kernel (a GPU's chunk step) runs
    # with each tensor's step at +inf, which makes both corrections exactly 1
    # (hooks/chunk_step.cpp); cpu_adam's kernel leaves them out. fp32: the
    # masters agree to fp32 rounding, within 1e-5 absolute: without bias
    # correction the first steps divide by sqrt(v) of a few thousandths of
    # the gradient, so an element whose gradient is near eps amplifies the
    # two kernels' rounding (one of 12288 here, 1e-6 apart after two steps).
    def edit(cfg):
        cfg["optimizer"]["params"]["bias_correction"] = False
        cfg["gradient_accumulation_steps"] = accumulation
    engines = trained_with_both_device_kernels(edit, 2 * accumulation)  # two steps
    masters = {k: e.parameters_fp32() for k, e in engines.items()}
    for name, want in masters["simd"].items():
        torch.testing.assert_close(masters["fused"][name], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["simd", "fused"])
def test_device_steps_without_bias_correction_match_a_plain_reference(kernel):
    # The reference is AdamW without bias correction written out in torch ops
    # over a plain copy of the model: m and v as AdamW keeps them, the step
    # lr * m / (sqrt(v) + eps), decoupled weight decay first. Both device
    # kernels (cpu_adam's, and torch's fused one run with step +inf) agree
    # with it to fp32 rounding over three steps.
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(3)
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
    params = [p for p in ref.parameters() if p.requires_grad]
    state = {id(p): (torch.zeros_like(p), torch.zeros_like(p)) for p in params}
    ref_losses = []
    for x, y in batches:
        loss = ref(x, y)
        loss.backward()
        ref_losses.append(loss.item())
        with torch.no_grad():
            for p in params:
                m, v = state[id(p)]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - LR * wd)
                p.sub_(LR * m / (v.sqrt() + eps))
                p.grad = None
    cfg = config(hybrid_adam=True, budget="64MiB", chunk=1 << 16)
    cfg["optimizer"]["params"]["bias_correction"] = False
    engine = tidal.initialize(model, cfg)
    engine._step.device_adam_kernel = kernel
    losses = train_tidal(engine, batches)
    assert engine.memory_report()["adam_chunks_on_device"] > 0
    within_budget(engine)
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    masters = engine.parameters_fp32()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_device_chunk_steps_in_16_bit_agree_between_the_kernels(precision):
    # With 16-bit gradients the fused path steps fp32 copies of them and writes
    # the new 16-bit weights back; cpu_adam's kernel (tested against a scalar
    # reference and torch AdamW) does the same in one pass. Same batches, same
    # start: the fp32 masters agree to fp32 rounding after two steps (the
    # second runs on the 16-bit weights the first wrote back; later, a master
    # an ulp apart can round to another 16-bit weight and the runs drift).
    def edit(cfg):
        cfg["gradient_clipping"] = 0.05
        cfg[precision] = {"enabled": True}
    engines = trained_with_both_device_kernels(edit, 2)
    assert all(e.skipped_steps == 0 for e in engines.values())
    masters = {k: e.parameters_fp32() for k, e in engines.items()}
    for name, want in masters["simd"].items():
        torch.testing.assert_close(masters["fused"][name], want, rtol=1e-5, atol=1e-7)


class _Wide(torch.nn.Module):
    """Two weights of 131072 elements each, four times a 64 KiB chunk of
    bf16: each gets a dedicated chunk (as gpt-18b's 5120 x 20480 weights do
    at the default chunk size)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 512)
        self.down = torch.nn.Linear(512, 256)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.down(torch.relu(self.up(x))), y)


@pytest.mark.parametrize("margin", [3 << 20, 64 << 10], ids=["quarter-chunk-parts", "margin-bound-parts"])
def test_the_fused_device_step_keeps_its_temporaries_to_a_quarter_chunk_and_half_the_margin(margin, monkeypatch):
    # hooks/chunk_step.cpp fused_step: a GPU's chunk step makes fp32 copies
    # of 16-bit gradients (and of bf16 moments). gpt-18b on an H200 asked for
    # a 400 MiB copy of one weight's gradient at once and ran out of memory
    # with 3.9 GiB cached in chunk-sized blocks. Every call now updates at
    # most a quarter of a standard chunk (here 8192 elements: three 32 KiB
    # copies, far below one 512 KiB fp32 gradient), and no more than half
    # the device margin's worth of copies (a 64 KiB margin: 2730 elements),
    # so the step keeps within the budget whatever room the activations
    # leave. The step's torch allocations are counted on the simulated
    # device. Both kernels agree to fp32 rounding (cpu_adam's is tested
    # against a scalar reference), so the parts are the whole.
    torch.manual_seed(0)
    batches = [(torch.randn(4, 256), torch.randn(4, 256)) for _ in range(2)]
    chunk = 1 << 16
    part = min(chunk // 2 // 4, margin // 2 // 12)
    engines, peaks = {}, {}
    # The step's allocations are left out of the engine's count (they are not
    # the activations'); here they are what is measured.
    counter = tidal._C.chunks
    seen = []

    @contextlib.contextmanager
    def counted():
        was = counter.host_allocation_counting()
        counter.set_host_allocation_counting(True)
        counter.reset_host_allocation_peak()
        base = counter.host_allocation_counts().live_bytes
        try:
            yield
        finally:
            seen.append(counter.host_allocation_counts().peak_bytes - base)
            counter.set_host_allocation_counting(was)
    from tidal.engine import optimizer_step
    monkeypatch.setattr(optimizer_step, "uncounted", counted)
    for kernel in ("simd", "fused"):
        torch.manual_seed(0)
        model = _Wide()
        cfg = config(hybrid_adam=True, budget="64MiB", chunk=chunk, optimizer_state_dtype="bf16",
                     overlap_step=False, device_margin=margin)  # the whole update inside engine.step()
        cfg["bf16"] = {"enabled": True}
        with pytest.warns(UserWarning, match="dedicated chunk"):
            engine = tidal.initialize(model, cfg)
        engine._step.device_adam_kernel = kernel
        peaks[kernel] = []
        for x, y in batches:
            engine.backward(engine(x, y))
            seen.clear()
            engine.step()
            peaks[kernel].append(max(seen))
        report = engine.memory_report()
        assert report["adam_chunks_on_device"] > 0 and report["adam_chunks_on_host"] == 0, report
        within_budget(engine)
        engines[kernel] = engine
    # (The scalars of the steps: a few bytes beside the copies.)
    assert max(peaks["fused"]) <= 3 * part * 4 + 64, (peaks, part)
    assert max(peaks["fused"]) <= margin // 2 + 64, (peaks, margin)
    assert max(peaks["fused"]) >= 3 * part * 4, (peaks, part)  # (the copies are counted)
    masters = {k: e.parameters_fp32() for k, e in engines.items()}
    for name, want in masters["simd"].items():
        torch.testing.assert_close(masters["fused"][name], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_global_grad_norm_is_torchs_norm_of_the_landed_gradients(precision):
    # Each gradient is measured as it lands in its slot (on the simulated
    # device by cpu_adam's grad_stats, no torch op): the step's norm is torch's
    # norm of the same gradients, captured by hooks of our own.
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    cfg = config(budget="64MiB", chunk=1 << 16)
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = tidal.initialize(model, cfg)
    seen = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: seen.__setitem__(name, g.detach().float().clone()))
    assert engine.get_global_grad_norm() is None
    for x, y in gpt_batches(2):
        seen.clear()
        engine.backward(engine(x, y))
        engine.step()
        want = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen.values()])).item()
        assert len(seen) == len(list(model.parameters()))
        assert engine.get_global_grad_norm() == pytest.approx(want, rel=1e-5)


def test_fp16_one_nan_element_skips_the_step():
    # One element of one gradient is nan, every other gradient finite.
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    cfg = config(budget="64MiB", chunk=1 << 16)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine = tidal.initialize(model, cfg)
    batches = gpt_batches(2)
    train_tidal(engine, batches[:1])
    assert engine.skipped_steps == 0 and math.isfinite(engine.get_global_grad_norm())
    before = {k: v.clone() for k, v in engine.parameters_fp32().items()}
    name, param = list(model.named_parameters())[3]
    one_nan = torch.tensor([1])
    handle = param.register_hook(
        lambda g: g.flatten().index_fill(0, one_nan, float("nan")).view_as(g))
    x, y = batches[1]
    engine.backward(engine(x, y))
    handle.remove()
    assert engine.step() is False, name
    assert engine.skipped_steps == 1 and engine.get_global_grad_norm() == float("inf")
    after = engine.parameters_fp32()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)


def test_sparse_embedding_is_a_clear_error_and_loses_nothing():
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(tidal.UnsupportedModelError,
                       match=r"module '0' \(Embedding\) has sparse=True"):
        tidal.initialize(model, config(budget="64MiB"))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # A frozen sparse embedding has no gradient: the rest of the model trains.
    model[0].weight.requires_grad_(False)
    engine = tidal.initialize(model, config(budget="64MiB"))
    loss = engine(torch.tensor([[1, 2, 3]])).sum()
    engine.backward(loss)
    assert engine.step() is True
    after = engine.parameters_fp32()
    torch.testing.assert_close(after["0.weight"], before["0.weight"], rtol=0, atol=0)
    assert not torch.equal(after["1.weight"], before["1.weight"])


class FunctionalSparseEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(50, 8))

    def forward(self, x):
        return torch.nn.functional.embedding(x, self.weight, sparse=True)


def test_a_sparse_gradient_is_a_clear_error_naming_the_parameter():
    model = torch.nn.Sequential(FunctionalSparseEmbedding(), torch.nn.Linear(8, 2))
    engine = tidal.initialize(model, config(budget="64MiB"))
    x = torch.tensor([[1, 2, 3]])
    for _ in range(2):  # the failed backward gave back what it held
        with pytest.raises(tidal.UnsupportedModelError,
                           match=r"parameter '0.weight' got a gradient of layout torch.sparse_coo"):
            engine.backward(engine(x).sum())


def test_resnet_with_batchnorm_fp32_matches_adamw():
    torch.manual_seed(0)
    ref = TinyResNet()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
               for _ in range(20)]
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, config(budget="8MiB", chunk=4096))
    losses = train_tidal(engine, batches)
    assert_close(engine, ref, ref_losses, losses)
    # Running statistics stay ordinary buffers and match.
    torch.testing.assert_close(model.bn1.running_mean, ref.bn1.running_mean, rtol=1e-5, atol=1e-6)
    within_budget(engine)  # (8 MiB holds the whole state: nothing moves)


def test_eval_under_no_grad_matches_and_leaves_no_gradients():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    engine = tidal.initialize(model, fitted(config(), model, gpt_batches(2)))
    x, _ = gpt_batches(1)[0]
    engine.eval()
    with torch.no_grad():
        got = engine(x)
    torch.testing.assert_close(got, ref(x), rtol=0, atol=0)
    assert all(raw_numel(p) == 0 for p in model.parameters())  # back in chunks
    engine.train()
    moved_within_budget(engine)


def test_untied_frozen_and_unused_parameters():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8, tied=False)
    ref.unused = torch.nn.Linear(4, 4)       # never called: no gradient, no update
    ref.blocks[0].qkv.weight.requires_grad_(False)  # frozen
    model = copy.deepcopy(ref)
    batches = gpt_batches(10)
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, fitted(config(), model, batches))
    losses = train_tidal(engine, batches)
    assert_close(engine, ref, ref_losses, losses)
    moved_within_budget(engine)


def test_shared_module_called_twice():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 32)
            self.layer = torch.nn.Linear(32, 32)
            self.head = torch.nn.Linear(32, 50)

        def forward(self, x, y):
            h = self.emb(x)
            h = torch.tanh(self.layer(torch.tanh(self.layer(h))))
            return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, 50), y.reshape(-1))

    torch.manual_seed(0)
    ref = Twice()
    model = copy.deepcopy(ref)
    batches = gpt_batches(10, vocab=50)
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, fitted(config(chunk=4096), model, batches))
    assert_close(engine, ref, ref_losses, train_tidal(engine, batches))
    moved_within_budget(engine)


@pytest.mark.parametrize("leaf", [False, True])
@pytest.mark.parametrize("tidal_first", [False, True])
def test_the_output_hook_runs_as_register_hook_beside_user_hooks(leaf, tidal_first):
    # The engine's pre-backward hook goes into the tensor's hook dict without
    # a RemovableHandle (hooks.add_tensor_hook): it runs once, in order with
    # hooks users add and remove through Tensor.register_hook.
    from tidal.engine.hooks import add_tensor_hook
    w = torch.randn(3, requires_grad=True)
    t = w if leaf else w * 2
    seen = []
    if tidal_first:
        add_tensor_hook(t, lambda g: seen.append(("tidal", g.clone())))
    gone = t.register_hook(lambda g: seen.append(("gone", None)))
    if not tidal_first:
        add_tensor_hook(t, lambda g: seen.append(("tidal", g.clone())))
    t.register_hook(lambda g: seen.append(("user", None)))
    gone.remove()
    (t * torch.arange(3.0)).sum().backward()
    assert [name for name, _ in seen] == ["tidal", "user"]
    torch.testing.assert_close(seen[0][1], torch.arange(3.0))
    torch.testing.assert_close(w.grad, torch.arange(3.0) * (1 if leaf else 2))


def test_modules_returning_tuples_their_input_and_nested_outputs():
    # The backward pre-hook is a tensor hook on each output (hooks.wrap_outputs):
    # a module may return a tuple holding one tensor twice, a tensor another
    # module already returned (an identity), or a dict; every module's
    # parameters must still be attached for its backward.
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, h):
            out = torch.tanh(self.lin(h))
            return out, out

    class Keep(torch.nn.Module):  # returns its input: no op of its own
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))

        def forward(self, h):
            return h if self.scale.numel() == 1 else h * self.scale

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 50)
            self.b = torch.nn.Linear(32, 50)

        def forward(self, h):
            return {"a": self.a(h), "b": [self.b(h)]}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 32)
            self.pair = Pair()
            self.keep = Keep()
            self.heads = Heads()

        def forward(self, x, y):
            u, v = self.pair(self.emb(x))
            out = self.heads(self.keep(u + 2 * v))
            logits = out["a"] + out["b"][0]
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 50), y.reshape(-1))

    torch.manual_seed(0)
    ref = Model()
    ref.keep.scale.requires_grad_(False)  # unused in forward: no gradient either way
    model = copy.deepcopy(ref)
    batches = gpt_batches(8, vocab=50)
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, fitted(config(chunk=4096), model, batches))
    assert_close(engine, ref, ref_losses, train_tidal(engine, batches))
    assert not any(engine._wiring.is_attached(r) or engine._wiring.uses(r) for r in engine.records)
    moved_within_budget(engine)


def test_gradient_accumulation_and_clipping():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(12)
    ref_losses = train_reference(ref, batches, clip=0.05, accumulation=3)
    cfg = config()
    cfg.update(gradient_accumulation_steps=3, gradient_clipping=0.05)
    engine = tidal.initialize(model, fitted(cfg, model, batches))
    losses = train_tidal(engine, batches)
    assert engine.global_steps == 4
    assert_close(engine, ref, ref_losses, losses)
    moved_within_budget(engine)


def test_clipping_without_accumulation():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(8)
    ref_losses = train_reference(ref, batches, clip=0.1)
    cfg = config()
    cfg["gradient_clipping"] = 0.1
    engine = tidal.initialize(model, fitted(cfg, model, batches))
    assert_close(engine, ref, ref_losses, train_tidal(engine, batches))
    moved_within_budget(engine)


@pytest.mark.parametrize("clip, fires", [(2.2, "some"), (50.0, "never")])
def test_clipping_that_fires_on_some_steps_only_matches_clip_grad_norm(clip, fires):
    # The max norms above clip on every step (0.05, 0.1: far below TinyGPT's
    # gradient norms of about 2). Here the norm crosses the max norm: steps
    # above it scale their gradients down by max_norm / norm, steps below it
    # keep theirs (the factor is capped at 1, as clip_grad_norm_'s); 50 is
    # above every step's norm, so nothing is clipped. Adam is nearly
    # invariant to one constant gradient scale, not to a scale that changes
    # from step to step, so a factor left uncapped shows in the weights.
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(10)
    norms = []
    ref_losses = train_reference(ref, batches, clip=clip, norms=norms)
    assert_clip_fires(norms, clip, fires)
    cfg = config()
    cfg["gradient_clipping"] = clip
    # Room beside the activations for every 16-bit chunk and the states of
    # about a sixth of the chunks: hybrid Adam updates those on the device,
    # the others on the host (Note [Where a chunk's Adam runs]).
    cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, batches, chunk_share=1.5)
    engine = tidal.initialize(model, cfg)
    losses, seen = [], []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        seen.append(engine.get_global_grad_norm())
    # The norm the engine clipped by is torch's norm of the same gradients.
    assert seen == pytest.approx(norms, rel=1e-5)
    assert_close(engine, ref, ref_losses, losses)
    report = engine.memory_report()
    # Chunks moved (the host's gradients down, their weights up), and the
    # clipped update ran on the device (hybrid Adam) and on the host.
    assert report["bytes_device_to_host_last_step"] > 0 and report["bytes_host_to_device_last_step"] > 0
    assert report["adam_chunks_on_device"] > 0 and report["adam_chunks_on_host"] > 0, report
    within_budget(engine)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_tracks_autocast_reference(precision):
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(1) * 20  # one batch, memorised: the loss must fall
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_losses = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=dtype):
            loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    cfg = config()
    cfg[precision] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"]["initial_scale_power"] = 8  # no overflow at the start
    engine = tidal.initialize(model, fitted(cfg, model, batches))
    assert engine.memory_report()["device_budget"] < state_bytes(ref)
    losses = train_tidal(engine, batches)
    # All-16-bit compute (DeepSpeed's module.half()) vs autocast: the loss
    # curves agree to the 16-bit format's precision.
    tol = 2e-2 if precision == "fp16" else 5e-2
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= tol * abs(a), (ref_losses, losses)
    assert losses[-1] < losses[0]
    assert engine.skipped_steps == 0
    moved_within_budget(engine)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    cfg = config()
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    batches = gpt_batches(3)
    engine = tidal.initialize(model, fitted(cfg, model, batches))
    train_tidal(engine, batches[:1])
    before = {k: v.clone() for k, v in engine.parameters_fp32().items()}
    scale = engine.loss_scale
    x, y = batches[1]
    loss = engine(x, y)
    engine.backward(loss * float("inf"))   # every gradient inf/nan
    assert engine.step() is False
    assert engine.skipped_steps == 1
    assert engine.loss_scale == scale / 2
    after = engine.parameters_fp32()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    # The 16-bit params were restored from fp32: training goes on normally.
    losses = train_tidal(engine, batches[2:])
    assert all(torch.isfinite(torch.tensor(losses)))
    moved_within_budget(engine)


def test_impossible_budget_names_the_module():
    model = TinyGPT(d=64, seq=8)
    # wte (a 24 KiB chunk) fits; the first block's qkv weight (a dedicated 48 KiB
    # chunk) does not.
    with pytest.raises(tidal.OutOfMemoryError, match=r"module 'blocks\.0\.qkv' \(Linear\)"):
        tidal.initialize(model, config(budget="40KiB", chunk=16384))


def test_an_out_of_memory_batch_raises_and_leaves_the_engine_usable():
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    small = gpt_batches(3, batch=2)
    engine = tidal.initialize(model, fitted(config(), model, small))
    train_tidal(engine, small[:1])
    x, y = gpt_batches(1, batch=256)[0]   # activations far beyond the measured budget

    def fail():
        # The traceback (and the activations its frames hold) goes with the
        # call, as after a user's `except OutOfMemoryError:` block.
        try:
            engine.backward(engine(x, y))
        except tidal.OutOfMemoryError as e:
            return str(e)
        return None

    # The allocation that would pass the budget fails (Note [The simulated
    # device's budget is a hard limit]), or the chunks cannot come in.
    message = fail() or ""
    assert "ran out of the device budget" in message or "could not bring the parameters" in message
    assert not any(engine._wiring.is_attached(r) or engine._wiring.uses(r) for r in engine.records)
    assert all(raw_numel(p) == 0 for p in model.parameters())   # all back in their chunks
    losses = train_tidal(engine, small[1:])
    assert all(torch.isfinite(torch.tensor(losses)))
    within_budget(engine)
    engine.chunks.validate()


def test_bad_config_is_a_clear_error():
    with pytest.raises(tidal.ConfigError, match="did you mean 'gradient_clipping'"):
        tidal.initialize(TinyGPT(), {"gradient_clip": 1.0})
    with pytest.raises(tidal.ConfigError, match="tidal.device_memory_budget"):
        tidal.initialize(TinyGPT(), {"tidal": {"device_memory_budget": "5 gigs"}})
    with pytest.raises(tidal.ConfigError, match="train_batch_size=8 but"):
        tidal.Config.load({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3,
                           "gradient_accumulation_steps": 2})
