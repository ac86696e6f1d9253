"""tidal.optim.CPUAdam and tidal._C.cpu_adam against torch.optim.Adam/AdamW.

Every comparison is elementwise (torch.testing.assert_close or torch.equal),
never a norm. Tests that compare numbers run once per kernel target this
build and CPU offer, the scalar "reference" included.
"""

import functools
import math
import sys
import time
from pathlib import Path

import pytest
import torch

import tidal
from tidal import _C
from tidal.optim import CPUAdam

sys.path.insert(0, str(Path(__file__).parent))
from cpu_adam_reference import (ATOL, HYPER, RTOL, TARGETS, assert_states_close, same_bits,  # noqa: E402
                                assert_ticks_while_stepping, set_grads, target, twin_params)  # noqa: F401  (target: the fixture)


# --- CPUAdam against torch ---------------------------------------------------


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["AdamW", "Adam-L2"])
def test_matches_torch_over_100_steps(target, adamw_mode):
    ours, theirs = twin_params()
    opt = CPUAdam(ours, adamw_mode=adamw_mode, **HYPER)
    ref = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(theirs, **HYPER)
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        set_grads(gen, ours, theirs)
        opt.step()
        ref.step()
    assert_states_close(ours, theirs, opt, ref)


@pytest.mark.parametrize("target", TARGETS, indirect=True)
def test_without_bias_correction_matches_the_formula(target):
    # torch has no switch for it: the reference is Adam written in torch ops.
    ours, theirs = twin_params()
    opt = CPUAdam(ours, bias_correction=False, **HYPER)
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    m = [torch.zeros_like(p) for p in theirs]
    v = [torch.zeros_like(p) for p in theirs]
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(100):
            set_grads(gen, ours, theirs)
            opt.step()
            for p, mi, vi in zip(theirs, m, v):
                p.mul_(1 - lr * wd)
                mi.lerp_(p.grad, 1 - b1)
                vi.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.addcdiv_(mi, vi.sqrt().add_(eps), value=-lr)
    for a, b, mi, vi in zip(ours, theirs, m, v):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(opt.state[a]["exp_avg"], mi, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], vi, rtol=RTOL, atol=ATOL)


def test_param_groups_and_params_without_grads():
    ours, theirs = twin_params()
    groups = lambda ps: [  # noqa: E731
        {"params": ps[:3], "lr": 1e-2},
        {"params": ps[3:], "weight_decay": 0.2, "betas": (0.5, 0.9)},
    ]
    opt = CPUAdam(groups(ours), **HYPER)
    ref = torch.optim.AdamW(groups(theirs), **HYPER)
    gen = torch.Generator().manual_seed(3)
    for i in range(20):
        set_grads(gen, ours, theirs)
        if i % 3 == 0:  # a param without a grad is skipped, its step not counted
            ours[1].grad = None
            theirs[1].grad = None
        opt.step()
        ref.step()
    assert_states_close(ours, theirs, opt, ref)
    assert float(opt.state[ours[1]]["step"]) == 13


def test_closure_is_called_with_grad_enabled():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = CPUAdam([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == pytest.approx(5.0)
    assert torch.all(p.detach().abs() < torch.tensor([1.0, 2.0]))


# --- the low-level entry (chunk buffers) ----------------------------------------


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_16bit_grads_match_torch_fed_the_upcast_grads(target, grad_dtype):
    n = 10007
    gen = torch.Generator().manual_seed(4)
    master = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    copy16 = torch.empty(n, dtype=grad_dtype)
    p = torch.nn.Parameter(master.clone())
    ref = torch.optim.AdamW([p], **HYPER)
    b1, b2 = HYPER["betas"]
    for step in range(1, 101):
        g16 = torch.randn(n, generator=gen).to(grad_dtype)
        _C.cpu_adam.adam_update(master, exp_avg, exp_avg_sq, g16, copy16, step=step, lr=HYPER["lr"],
                                beta1=b1, beta2=b2, eps=HYPER["eps"],
                                weight_decay=HYPER["weight_decay"])
        p.grad = g16.float()
        ref.step()
    torch.testing.assert_close(master, p.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(exp_avg, ref.state[p]["exp_avg"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(exp_avg_sq, ref.state[p]["exp_avg_sq"], rtol=RTOL, atol=ATOL)
    # The 16-bit copy is torch's own round-to-nearest-even of the fp32 master.
    assert torch.equal(copy16, master.to(grad_dtype))


@pytest.mark.parametrize("target", TARGETS, indirect=True)
def test_loss_scale_and_clipping_match_torch_clip_grad_norm(target):
    # Gradient norms of about 71 and 7 in turn, max norm 20: every other step
    # clips, the others keep their gradients (the factor is capped at 1).
    n, loss_scale, max_norm = 5000, 1024.0, 20.0
    gen = torch.Generator().manual_seed(5)
    master = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    copy16 = torch.empty(n, dtype=torch.float16)
    p = torch.nn.Parameter(master.clone())
    ref = torch.optim.AdamW([p], **HYPER)
    b1, b2 = HYPER["betas"]
    clipped = []
    for step in range(1, 31):
        size = 1.0 if step % 2 else 0.1
        scaled = (torch.randn(n, generator=gen) * size * loss_scale).half()  # what fp16 backward leaves
        r = _C.cpu_adam.adam_step(master, exp_avg, exp_avg_sq, scaled, copy16, step=step,
                                  lr=HYPER["lr"], beta1=b1, beta2=b2, eps=HYPER["eps"],
                                  weight_decay=HYPER["weight_decay"], loss_scale=loss_scale,
                                  max_grad_norm=max_norm)
        p.grad = scaled.float() / loss_scale
        total = torch.nn.utils.clip_grad_norm_([p], max_norm)
        ref.step()
        assert not r.overflow
        assert r.grad_norm == pytest.approx(total.item(), rel=1e-5)
        assert r.clip_coef == pytest.approx(min(1.0, max_norm / (total.item() + 1e-6)), rel=1e-5)
        clipped.append(total.item() > max_norm)
    assert any(clipped) and not all(clipped)
    torch.testing.assert_close(master, p.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(exp_avg_sq, ref.state[p]["exp_avg_sq"], rtol=1e-4, atol=ATOL)
    assert torch.equal(copy16, master.half())


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_overflow_leaves_every_buffer_unchanged_and_is_reported(target, bad):
    n = 3 * _C.cpu_adam.block_elements + 11
    gen = torch.Generator().manual_seed(6)
    master = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 100).half()
    copy16 = torch.full((n,), 7.0, dtype=torch.float16)
    for pos in (0, n // 2, n - 1):
        g = grad.clone()
        g[pos] = bad
        before = [t.clone() for t in (master, exp_avg, exp_avg_sq, g, copy16)]
        r = _C.cpu_adam.adam_step(master, exp_avg, exp_avg_sq, g, copy16, step=3, lr=1e-3,
                                  loss_scale=128.0, max_grad_norm=1.0)
        assert r.overflow
        for t, t0 in zip((master, exp_avg, exp_avg_sq, g, copy16), before):
            assert same_bits(t, t0)
        assert not _C.cpu_adam.grad_stats(g).finite
    assert _C.cpu_adam.grad_stats(grad).finite


def _chunk_layout(shapes, pad):
    """(offset, numel) of each tensor in one flat chunk, `pad` elements of
    padding before each, and the chunk's total length."""
    ranges, offset = [], 0
    for shape in shapes:
        offset += pad
        numel = math.prod(shape)
        ranges.append((offset, numel))
        offset += numel
    return ranges, offset + pad


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_chunk_step_matches_torch_adamw_with_global_clipping(target, half_dtype):
    # Two chunks of a model; each step gathers the stats of every chunk, then
    # makes one adam_chunk_step per chunk with them (the one-pass step).
    # float32: the engine's fp32 mode, whose "16-bit" chunk is float32.
    loss_scale, max_norm = 512.0, 5.0
    chunk_shapes = [[(37,), (8, 13), (1,)], [(3, 5, 7), (4099,)]]
    gen = torch.Generator().manual_seed(11)
    chunks, ref_params = [], []
    for i, shapes in enumerate(chunk_shapes):
        ranges, numel = _chunk_layout(shapes, pad=3 + i)
        master = torch.randn(numel, generator=gen)
        c = {"ranges": ranges, "master": master, "m": torch.zeros(numel), "v": torch.zeros(numel),
             "half": torch.full((numel,), 9.0, dtype=half_dtype)}
        chunks.append(c)
        for (off, n), shape in zip(ranges, shapes):
            ref_params.append(torch.nn.Parameter(master[off:off + n].clone().reshape(shape)))
    pads = [[t.clone() for t in (c["master"], c["m"], c["v"])] for c in chunks]
    ref = torch.optim.AdamW(ref_params, **HYPER)
    b1, b2 = HYPER["betas"]
    for step in range(1, 21):
        k = 0
        for c in chunks:
            for off, n in c["ranges"]:
                scaled = (torch.randn(n, generator=gen) * loss_scale).to(half_dtype)
                c["half"][off:off + n] = scaled
                ref_params[k].grad = (scaled.float() / loss_scale).reshape(ref_params[k].shape)
                k += 1
        finite, sum_squares = True, 0.0
        for c in chunks:
            for off, n in c["ranges"]:
                st = _C.cpu_adam.grad_stats(c["half"], grad_scale=1 / loss_scale, offset=off, count=n)
                finite, sum_squares = finite and st.finite, sum_squares + st.sum_squares
        known = _C.cpu_adam.GradStats(finite=finite, sum_squares=sum_squares)
        results = [_C.cpu_adam.adam_chunk_step(
            c["master"], c["m"], c["v"], c["half"], c["ranges"], step=step, lr=HYPER["lr"],
            beta1=b1, beta2=b2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
            loss_scale=loss_scale, max_grad_norm=max_norm, known_stats=known) for c in chunks]
        total = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
        ref.step()
        for r in results:
            assert not r.overflow
            assert r.grad_norm == pytest.approx(total.item(), rel=1e-5)
            assert r.clip_coef == pytest.approx(max_norm / (total.item() + 1e-6), rel=1e-5)
            assert r.clip_coef < 1.0  # the test clips
    k = 0
    for c, before in zip(chunks, pads):
        inside = torch.zeros(c["master"].numel(), dtype=torch.bool)
        for off, n in c["ranges"]:
            p = ref_params[k]
            k += 1
            inside[off:off + n] = True
            torch.testing.assert_close(c["master"][off:off + n], p.detach().reshape(-1),
                                       rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(c["v"][off:off + n], ref.state[p]["exp_avg_sq"].reshape(-1),
                                       rtol=1e-4, atol=ATOL)
            # The 16-bit slot now holds the new params, rounded to nearest even.
            assert torch.equal(c["half"][off:off + n], c["master"][off:off + n].to(half_dtype))
        # Padding: neither read into the result nor written.
        for t, t0 in zip((c["master"], c["m"], c["v"]), before):
            assert same_bits(t[~inside], t0[~inside])
        assert bool((c["half"][~inside] == 9.0).all())


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gradient_accumulation_folds_and_steps_match_torch_adamw(target, half_dtype):
    # Note [Gradient sums in chunks]: each micro-batch's 16-bit gradients are
    # folded into fp32 sums (the first written, the rest added) and the
    # 16-bit chunk takes the master back; the step reads the sums. Reference:
    # torch.optim.AdamW fed the sums of the upcast gradients, unscaled.
    loss_scale, micro = 64.0, 3
    shapes = [(37,), (8, 13), (4099,)]
    ranges, numel = _chunk_layout(shapes, pad=5)
    gen = torch.Generator().manual_seed(5)
    master = torch.randn(numel, generator=gen)
    m, v = torch.zeros(numel), torch.zeros(numel)
    half = master.to(half_dtype, copy=True)  # (a copy in fp32 mode too)
    sums = torch.full((numel,), 7.0)  # stale values a first fold must not add to
    ref_params = [torch.nn.Parameter(master[o:o + n].clone().reshape(s))
                  for (o, n), s in zip(ranges, shapes)]
    ref = torch.optim.AdamW(ref_params, **HYPER)
    b1, b2 = HYPER["betas"]
    for step in range(1, 6):
        want = [torch.zeros(n) for _, n in ranges]
        for k in range(micro):
            for i, (o, n) in enumerate(ranges):
                g = (torch.randn(n, generator=gen) * loss_scale).to(half_dtype)
                half[o:o + n] = g
                want[i] += g.float()
            _C.cpu_adam.fold_gradients(sums, half, master, [(o, n, k == 0) for o, n in ranges])
            # The weights are back in the 16-bit chunk after every fold.
            for o, n in ranges:
                assert torch.equal(half[o:o + n], master[o:o + n].to(half_dtype))
        for i, (o, n) in enumerate(ranges):
            assert torch.equal(sums[o:o + n], want[i])  # fp32 sums, added in order
            ref_params[i].grad = (want[i] / loss_scale).reshape(shapes[i])
        r = _C.cpu_adam.adam_chunk_step(
            master, m, v, half, ranges, step=step, lr=HYPER["lr"], beta1=b1, beta2=b2,
            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], loss_scale=loss_scale,
            max_grad_norm=0.0, check_overflow=True, grad=sums)
        ref.step()
        assert not r.overflow
        for (o, n), p in zip(ranges, ref_params):
            torch.testing.assert_close(master[o:o + n], p.detach().reshape(-1), rtol=RTOL, atol=ATOL)
            assert torch.equal(half[o:o + n], master[o:o + n].to(half_dtype))
    with pytest.raises(TypeError, match="grad must be torch.float32"):
        _C.cpu_adam.adam_chunk_step(master, m, v, half, step=6, lr=1e-3,
                                    grad=torch.zeros(numel, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"ranges\[0\] = \(0, 100000\): out of range"):
        _C.cpu_adam.fold_gradients(sums, half, master, [(0, 100000, True)])


@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_a_measuring_fold_measures_the_sums_it_writes(half_dtype):
    # Note [Measured in the fold] (tidal/engine/overlap.py): fold_gradients
    # with measure gives each range the sum of squares of its new sums, the
    # bits grad_stats finds on them, and torch's float64 sum of squares to
    # the kernel's fp32 lanes; a range whose sums took an inf says so.
    bs = _C.cpu_adam.block_elements
    ranges = [(0, 5, True), (5, bs + 3, False), (bs + 8, 0, False), (bs + 8, 2 * bs - 1, False)]
    numel = 3 * bs + 7
    gen = torch.Generator().manual_seed(21)
    sums = torch.randn(numel, generator=gen) * 10
    master = torch.randn(numel, generator=gen)
    half = (torch.randn(numel, generator=gen) * 100).to(half_dtype)
    half[bs + 8 + 17] = math.inf
    stats = _C.cpu_adam.fold_gradients(sums, half, None, ranges, measure=True)
    assert len(stats) == len(ranges)
    for (o, n, _), st in zip(ranges, stats):
        again = _C.cpu_adam.grad_stats(sums, offset=o, count=n)
        assert st.finite == again.finite
        assert st.sum_squares == again.sum_squares or not st.finite
        if st.finite:
            want = sums[o:o + n].double().square().sum().item()
            assert st.sum_squares == pytest.approx(want, rel=2e-5, abs=0.0)
    assert [st.finite for st in stats] == [True, True, True, False]
    assert stats[2].sum_squares == 0.0
    assert _C.cpu_adam.fold_gradients(sums, half, master, ranges) is None  # (not asked: none)


def test_chunk_step_on_overflow_writes_nothing_and_checks_its_arguments():
    n = _C.cpu_adam.block_elements + 50
    gen = torch.Generator().manual_seed(12)
    master, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    half = (torch.randn(n, generator=gen) * 64).half()
    half[n - 3] = math.inf  # in the second range
    before = [t.clone() for t in (master, m, v, half)]
    r = _C.cpu_adam.adam_chunk_step(master, m, v, half, [(0, 10), (n - 20, 20)], step=[2, 5],
                                    lr=1e-3, loss_scale=64.0)
    assert r.overflow
    for t, t0 in zip((master, m, v, half), before):
        assert same_bits(t, t0)
    # Known stats decide alone: finite=False skips even finite gradients.
    half[n - 3] = 1.0
    before = [t.clone() for t in (master, m, v, half)]
    r = _C.cpu_adam.adam_chunk_step(master, m, v, half, step=1, lr=1e-3,
                                    known_stats=_C.cpu_adam.GradStats(finite=False, sum_squares=0.0))
    assert r.overflow
    for t, t0 in zip((master, m, v, half), before):
        assert same_bits(t, t0)
    with pytest.raises(ValueError, match="overlap"):
        _C.cpu_adam.adam_chunk_step(master, m, v, half, [(0, 10), (5, 10)], step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"elements \[0, 100000\) are out of range"):
        _C.cpu_adam.adam_chunk_step(master, m, v, half, [(0, 100000)], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="step has 1 entries but there are 2 ranges"):
        _C.cpu_adam.adam_chunk_step(master, m, v, half, [(0, 10), (20, 10)], step=[1], lr=1e-3)
    with pytest.raises(ValueError, match="half has 10 elements but param has"):
        _C.cpu_adam.adam_chunk_step(master, m, v, half[:10], step=1, lr=1e-3)
    with pytest.raises(TypeError, match="half has dtype torch.float64"):
        _C.cpu_adam.adam_chunk_step(master, m, v, master.double(), step=1, lr=1e-3)
    for t, t0 in zip((master, m, v, half), before):
        assert same_bits(t, t0)


def test_chunk_step_releases_the_gil():
    # As test_step_releases_the_gil, through adam_chunk_step.
    n = 1 << 24
    master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    half = torch.randn(n).half()
    step = [0]

    def one():
        step[0] += 1
        _C.cpu_adam.adam_chunk_step(master, m, v, half, step=step[0], lr=1e-6, num_threads=1)

    one()
    t0 = time.perf_counter()
    one()
    one_step = time.perf_counter() - t0
    assert_ticks_while_stepping(one, one_step)


def test_offsets_address_one_tensor_inside_a_chunk():
    # Two "tensors" packed in one flat chunk per list, updated one at a time.
    n0, n1 = 1000, 777
    gen = torch.Generator().manual_seed(7)
    master = torch.randn(n0 + n1, generator=gen)
    m, v = torch.zeros(n0 + n1), torch.zeros(n0 + n1)
    g16 = torch.randn(n0 + n1, generator=gen).half()
    copy16 = torch.zeros(n0 + n1, dtype=torch.float16)
    whole = [t.clone() for t in (master, m, v, copy16)]
    _C.cpu_adam.adam_update(*whole[:3], g16, whole[3], step=1, lr=1e-2)
    _C.cpu_adam.adam_update(master, m, v, g16, copy16, step=1, lr=1e-2, offset=0, count=n0)
    assert not torch.equal(master[n0:], whole[0][n0:])  # the second tensor is not updated yet
    _C.cpu_adam.adam_update(master, m, v, g16, copy16, step=1, lr=1e-2, offset=n0, count=n1)
    for a, b in zip((master, m, v, copy16), whole):
        assert torch.equal(a, b)


def test_host_buffers_take_part_through_zero_copy_tensor_views():
    # Chunk memory that is not a tensor (tidal.HostBuffer) is viewed with
    # torch.frombuffer, without a copy, and updated in place.
    host_buffer = tidal.HostBuffer
    n = 2048
    bufs = [host_buffer(n * 4) for _ in range(3)] + [host_buffer(n * 2) for _ in range(2)]
    master, m, v = (torch.frombuffer(b, dtype=torch.float32) for b in bufs[:3])
    g16, copy16 = (torch.frombuffer(b, dtype=torch.float16) for b in bufs[3:])
    gen = torch.Generator().manual_seed(23)
    master.copy_(torch.randn(n, generator=gen))
    m.zero_()
    v.zero_()
    g16.copy_(torch.randn(n, generator=gen))
    expected = [master.clone(), torch.zeros(n), torch.zeros(n)]
    _C.cpu_adam.adam_update(*expected, g16.clone(), step=1, lr=1e-2, offset=100, count=1000)
    _C.cpu_adam.adam_update(master, m, v, g16, copy16, step=1, lr=1e-2, offset=100, count=1000)
    for a, b in zip((master, m, v), expected):
        assert torch.equal(a, b)
    assert torch.equal(copy16[100:1100], master[100:1100].half())
    # The memory behind the views is the buffers' own.
    assert master.data_ptr() == bufs[0].data_ptr


def test_the_copy_may_overwrite_the_16bit_grads_in_place():
    n = 4099
    gen = torch.Generator().manual_seed(8)
    master = torch.randn(n, generator=gen)
    g16 = torch.randn(n, generator=gen).half()
    sep = [master.clone(), torch.zeros(n), torch.zeros(n)]
    copy16 = torch.empty(n, dtype=torch.float16)
    _C.cpu_adam.adam_update(*sep, g16, copy16, step=1, lr=1e-2)
    inplace = [master.clone(), torch.zeros(n), torch.zeros(n)]
    chunk16 = g16.clone()  # grads in, params out
    _C.cpu_adam.adam_update(*inplace, chunk16, chunk16, step=1, lr=1e-2)
    for a, b in zip(sep, inplace):
        assert torch.equal(a, b)
    assert torch.equal(chunk16, copy16)


@pytest.mark.parametrize("target", TARGETS, indirect=True)
def test_bf16_optimizer_state_rounds_like_torch(target):
    # Note [16-bit optimizer state]: fp32 arithmetic, m and v rounded to bf16
    # to nearest, ties to even, as torch's Tensor.bfloat16(). The fp32 moments
    # are computed here in the kernels' order, one fp32 rounding per torch op
    # (m + (1 - b1) (g - m); (v b2) + ((1 - b2) g) g, no FMA), from the same
    # stored bf16 moments, so the stored moments must match bit for bit: one
    # bf16 step is 2^-8 relative, and truncation instead of rounding would
    # change about half of them.
    n = 3001
    gen = torch.Generator().manual_seed(9)
    master = torch.randn(n, generator=gen)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    pr = master.clone()
    lr, b1, b2, eps = 1e-2, 0.9, 0.99, 1e-8
    f32 = functools.partial(torch.tensor, dtype=torch.float32)
    one_minus_b1, beta2, one_minus_b2 = f32(1 - b1), f32(b2), f32(1 - b2)
    rounded = 0
    for step in range(1, 21):
        g = torch.randn(n, generator=gen)
        mr, vr = m16.float(), v16.float()
        m32 = mr + one_minus_b1 * (g - mr)
        v32 = vr * beta2 + (one_minus_b2 * g) * g
        _C.cpu_adam.adam_update(master, m16, v16, g, step=step, lr=lr, beta1=b1, beta2=b2, eps=eps)
        assert same_bits(m16, m32.bfloat16()), step
        assert same_bits(v16, v32.bfloat16()), step
        # Elements whose bf16 value truncation would get wrong.
        rounded += int((m32.bfloat16().float().abs() > m32.abs()).sum())
        # This step's update uses the fp32 moments; only what is stored is rounded.
        denom = v32.sqrt() / math.sqrt(1 - b2**step) + eps
        pr = pr - (lr / (1 - b1**step)) * m32 / denom
    assert rounded > n  # the check could tell rounding from truncation
    torch.testing.assert_close(master, pr, rtol=1e-4, atol=1e-5)


def test_results_do_not_depend_on_the_thread_count():
    n = (1 << 20) + 3
    gen = torch.Generator().manual_seed(10)
    init = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1,
            torch.rand(n, generator=gen)]
    g16 = (torch.randn(n, generator=gen) * 512).half()
    results = []
    for threads in (1, 2, 3):
        bufs = [t.clone() for t in init] + [torch.empty(n, dtype=torch.float16)]
        r = _C.cpu_adam.adam_step(bufs[0], bufs[1], bufs[2], g16, bufs[3], step=5, lr=1e-3,
                                  loss_scale=512.0, max_grad_norm=100.0, num_threads=threads)
        results.append((bufs, r.grad_norm))
    for bufs, norm in results[1:]:
        assert norm == results[0][1]  # bitwise: fixed blocks, fixed-order reduction
        for a, b in zip(bufs, results[0][0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_torch_intra_op_threads_give_the_bytes_of_onetbbs(threads):
    """Note [Whose threads run the update]: the same fixed blocks and reduction
    order on torch's pool (at::parallel_for) as on oneTBB's, through the
    optimizer and the chunk step, and AdamW's result within 1e-5."""
    gen = torch.Generator().manual_seed(12)
    init = [torch.randn(70001, generator=gen), torch.randn(300000, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in init] for _ in range(3)]
    out = {}
    for pool in ("torch", "onetbb"):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = CPUAdam(ps, lr=1e-3, weight_decay=0.05, num_threads=threads, thread_pool=pool)
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
            opt.step()
        out[pool] = [p.detach().clone() for p in ps] + [opt.state[p][k] for p in ps
                                                        for k in ("exp_avg", "exp_avg_sq")]
    for a, b in zip(out["torch"], out["onetbb"]):
        assert torch.equal(a, b)
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    adamw = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.05)
    for g in grads:
        for p, gi in zip(ref, g):
            p.grad = gi.clone()
        adamw.step()
    for a, b in zip(out["torch"], ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    n = (1 << 18) + 5
    chunk = {}
    for pool in ("torch", "onetbb"):
        gen = torch.Generator().manual_seed(13)
        bufs = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n),
                (torch.randn(n, generator=gen) * 64).bfloat16()]
        r = _C.cpu_adam.adam_chunk_step(*bufs, ranges=[(0, 1000), (4096, n - 4096)], step=[1, 2],
                                        lr=1e-3, loss_scale=64.0, max_grad_norm=10.0,
                                        num_threads=threads, pool=pool)
        chunk[pool] = (bufs, r.grad_norm)
    assert chunk["torch"][1] == chunk["onetbb"][1]
    for a, b in zip(chunk["torch"][0], chunk["onetbb"][0]):
        assert torch.equal(a, b)


def test_an_unknown_thread_pool_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'omp'"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], thread_pool="omp")
    with pytest.raises(ValueError, match="'omp'.*'torch' or 'onetbb'"):
        _C.cpu_adam.adam_update_tensors([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)],
                                        [torch.zeros(3)], [1], lr=1e-3, beta1=0.9, beta2=0.999,
                                        eps=1e-8, weight_decay=0.0, pool="omp")
