"""tidal.optim.CPUAdam's interface against torch.optim.Adam/AdamW: state
dicts both ways, clear errors for what it does not take, the GIL released
during a step, the kernel targets and their selection, the benchmark's
quick mode and hyperparameters as torch takes them."""

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tidal import _C
from tidal.optim import CPUAdam

sys.path.insert(0, str(Path(__file__).parent))
from cpu_adam_reference import (HYPER, ROOT, SUBPROCESS_PYTHONPATH, TARGETS, assert_states_close,  # noqa: E402
                                assert_ticks_while_stepping, make_params, set_grads)


# --- state dicts -------------------------------------------------------------------


def run_steps(opt, params, gen, k):
    for _ in range(k):
        set_grads(gen, params)
        opt.step()


def test_state_dict_round_trip_with_torch_adamw():
    # CPUAdam -> AdamW
    ours = [torch.nn.Parameter(t) for t in make_params(11)]
    opt = CPUAdam(ours, **HYPER)
    run_steps(opt, ours, torch.Generator().manual_seed(12), 5)
    sd = copy.deepcopy(opt.state_dict())
    ref_sd = torch.optim.AdamW([torch.nn.Parameter(t) for t in make_params(11)], **HYPER)
    run_steps(ref_sd, list(ref_sd.param_groups[0]["params"]), torch.Generator().manual_seed(12), 5)
    torch_layout = ref_sd.state_dict()
    assert set(sd["state"]) == set(torch_layout["state"])
    for i, st in sd["state"].items():
        assert set(st) == set(torch_layout["state"][i]) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["step"].dtype == torch_layout["state"][i]["step"].dtype
        assert st["step"].shape == () and float(st["step"]) == 5

    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ref = torch.optim.AdamW(theirs, **HYPER)
    ref.load_state_dict(sd)
    gen_a, gen_b = torch.Generator().manual_seed(13), torch.Generator().manual_seed(13)
    run_steps(opt, ours, gen_a, 5)
    run_steps(ref, theirs, gen_b, 5)
    assert_states_close(ours, theirs, opt, ref)

    # AdamW -> CPUAdam
    theirs2 = [torch.nn.Parameter(t) for t in make_params(14)]
    ref2 = torch.optim.AdamW(theirs2, **HYPER)
    run_steps(ref2, theirs2, torch.Generator().manual_seed(15), 5)
    ours2 = [torch.nn.Parameter(p.detach().clone()) for p in theirs2]
    opt2 = CPUAdam(ours2, lr=1.0)  # hyperparameters come from the state dict
    opt2.load_state_dict(copy.deepcopy(ref2.state_dict()))
    assert opt2.param_groups[0]["adamw_mode"] is True
    assert opt2.param_groups[0]["lr"] == HYPER["lr"]
    run_steps(opt2, ours2, torch.Generator().manual_seed(16), 5)
    run_steps(ref2, theirs2, torch.Generator().manual_seed(16), 5)
    assert_states_close(ours2, theirs2, opt2, ref2)


def test_state_dict_from_torch_adam_keeps_l2_mode_and_cpuadam_to_adam():
    theirs = [torch.nn.Parameter(t) for t in make_params(17)]
    ref = torch.optim.Adam(theirs, **HYPER)
    run_steps(ref, theirs, torch.Generator().manual_seed(18), 3)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    opt = CPUAdam(ours)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert opt.param_groups[0]["adamw_mode"] is False
    run_steps(opt, ours, torch.Generator().manual_seed(19), 3)
    run_steps(ref, theirs, torch.Generator().manual_seed(19), 3)
    assert_states_close(ours, theirs, opt, ref)
    # and back: CPUAdam(adamw_mode=True) into torch.optim.Adam stays decoupled
    opt3 = CPUAdam([torch.nn.Parameter(torch.ones(3))], adamw_mode=True)
    back = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    back.load_state_dict(opt3.state_dict())
    assert back.param_groups[0]["decoupled_weight_decay"] is True


def test_state_dict_round_trip_cpuadam_to_cpuadam_is_exact():
    ours = [torch.nn.Parameter(t) for t in make_params(20)]
    opt = CPUAdam(ours, adamw_mode=False, bias_correction=False, **HYPER)
    run_steps(opt, ours, torch.Generator().manual_seed(21), 4)
    clone = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt2 = CPUAdam(clone)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.param_groups[0]["bias_correction"] is False
    run_steps(opt, ours, torch.Generator().manual_seed(22), 4)
    run_steps(opt2, clone, torch.Generator().manual_seed(22), 4)
    for a, b in zip(ours, clone):
        assert torch.equal(a, b)


def test_amsgrad_state_dicts_are_refused():
    theirs = [torch.nn.Parameter(torch.ones(3))]
    ref = torch.optim.AdamW(theirs, amsgrad=True)
    opt = CPUAdam([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(NotImplementedError, match="amsgrad"):
        opt.load_state_dict(ref.state_dict())


# --- errors ------------------------------------------------------------------------


def test_a_param_not_on_the_cpu_is_a_clear_error():
    p = torch.nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="CPU tensors only"):
        CPUAdam([p])


def test_a_param_of_another_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="torch.float64"):
        CPUAdam([torch.nn.Parameter(torch.ones(3, dtype=torch.float64))])
    with pytest.raises(TypeError, match="torch.float16"):
        CPUAdam([torch.nn.Parameter(torch.ones(3, dtype=torch.float16))])


def test_non_contiguous_params_and_grads_are_clear_errors():
    p = torch.nn.Parameter(torch.randn(4, 3).t())
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdam([p])
    q = torch.nn.Parameter(torch.randn(3, 4))
    opt = CPUAdam([q])
    q.grad = torch.randn(4, 3).t()
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    assert len(opt.state) == 0 or float(opt.state[q]["step"]) == 0


def test_bad_hyperparameters_are_value_errors():
    p = [torch.nn.Parameter(torch.ones(2))]
    for kwargs, word in [({"lr": -1.0}, "learning rate"), ({"eps": -1.0}, "epsilon"),
                         ({"betas": (1.0, 0.9)}, "index 0"), ({"betas": (0.9, -0.1)}, "index 1"),
                         ({"weight_decay": -1.0}, "weight_decay")]:
        with pytest.raises(ValueError, match=word):
            CPUAdam(p, **kwargs)


def test_low_level_errors_name_the_argument():
    n = 16
    f32 = lambda: torch.zeros(n)  # noqa: E731
    with pytest.raises(ValueError, match=r"grad: elements \[0, 16\) are out of range for 8"):
        _C.cpu_adam.adam_update(f32(), f32(), f32(), torch.zeros(8), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="out of range"):
        _C.cpu_adam.adam_update(f32(), f32(), f32(), f32(), step=1, lr=1e-3, offset=10, count=10)
    with pytest.raises(TypeError, match="torch.int32"):
        _C.cpu_adam.adam_update(f32(), f32(), f32(), torch.zeros(n, dtype=torch.int32), step=1,
                                lr=1e-3)
    with pytest.raises(TypeError, match="param must be torch.float32"):
        _C.cpu_adam.adam_update(torch.zeros(n, dtype=torch.half), f32(), f32(), f32(), step=1,
                                lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg is bfloat16 but exp_avg_sq is float32"):
        _C.cpu_adam.adam_update(f32(), torch.zeros(n, dtype=torch.bfloat16), f32(), f32(), step=1,
                                lr=1e-3)
    with pytest.raises(NotImplementedError, match="float16"):
        h = lambda: torch.zeros(n, dtype=torch.half)  # noqa: E731
        _C.cpu_adam.adam_update(f32(), h(), h(), f32(), step=1, lr=1e-3)
    with pytest.raises(NotImplementedError, match="param_copy must be float16 or bfloat16"):
        _C.cpu_adam.adam_update(f32(), f32(), f32(), f32(), f32(), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="lr must be finite and >= 0, got -1"):
        _C.cpu_adam.adam_update(f32(), f32(), f32(), f32(), step=1, lr=-1.0)
    with pytest.raises(ValueError, match="step must be >= 1"):
        _C.cpu_adam.adam_update(f32(), f32(), f32(), f32(), step=0, lr=1e-3)
    with pytest.raises(ValueError, match="loss_scale"):
        _C.cpu_adam.adam_step(f32(), f32(), f32(), f32(), step=1, lr=1e-3, loss_scale=0.0)
    with pytest.raises(ValueError, match="meta"):
        _C.cpu_adam.grad_stats(torch.zeros(n, device="meta"))
    with pytest.raises(ValueError, match="not contiguous"):
        _C.cpu_adam.grad_stats(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="reference"):
        _C.cpu_adam.set_target("no-such-isa")


# --- GIL, targets ------------------------------------------------------------------


def test_step_releases_the_gil():
    # While another thread is inside the C++ step, this thread must keep
    # running Python. A step that held the GIL would let it tick only between
    # steps (one or two ticks per step), not every millisecond. 2^24 params
    # make a step of 10-30 ms on one thread: many ticks each when released.
    n = 1 << 24
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = CPUAdam([p], num_threads=1)
    opt.step()  # allocate the state outside the measurement
    t0 = time.perf_counter()
    opt.step()
    one_step = time.perf_counter() - t0
    assert_ticks_while_stepping(opt.step, one_step)


def test_targets_are_listed_best_first_with_the_reference_last():
    assert TARGETS[-1] == "reference"
    assert _C.cpu_adam.target() in TARGETS


def test_environment_variable_forces_a_target():
    code = "import tidal; from tidal import _C; print(_C.cpu_adam.target())"
    env = dict(os.environ, TIDAL_CPU_ADAM_TARGET="reference", PYTHONPATH=SUBPROCESS_PYTHONPATH)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "reference"
    env["TIDAL_CPU_ADAM_TARGET"] = "avx9000"
    code = ("import torch, tidal; from tidal.optim import CPUAdam\n"
            "p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)\n"
            "CPUAdam([p]).step()")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "ValueError" in out.stderr and "TIDAL_CPU_ADAM_TARGET" in out.stderr


def test_benchmark_quick_mode_runs_and_writes_its_result(tmp_path):
    out = tmp_path / "cpu_adam-test.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_adam.py"), "--quick",
                    "--output", str(out)],
                   env=dict(os.environ, PYTHONPATH=SUBPROCESS_PYTHONPATH), check=True,
                   capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["quick"] is True
    for key in ("command", "git_commit", "date", "machine", "sizes"):
        assert key in result
    size = result["sizes"][0]
    assert size["tidal"]["update"]["median_s"] > 0
    assert size["tidal_python_update"]["copy_matches_master"]
    assert "ratio_vs_foreach" in size
    if "rows" in size["cxx"]:  # tidal_bench_cpu_adam was built: the limits were measured
        assert size["cxx"]["sane"]
        assert size["triad"]["median_GBps"] > 0 and size["streams"]["median_GBps"] > 0
        assert 0 < size["fraction_of_triad"]


def test_hyperparameters_as_torch_takes_them():
    # NumPy scalars and arrays of two betas, as torch.optim.AdamW takes them; the
    # group holds Python floats. Off switches of torch's other rules are taken.
    import numpy as np
    p = torch.nn.Parameter(torch.ones(3))
    opt = CPUAdam([p], lr=np.float32(1e-3), betas=np.array([0.9, 0.99]), eps=np.float64(1e-8),
                  weight_decay=np.array([0.0]), amsgrad=False, maximize=False)
    g = opt.param_groups[0]
    assert g["lr"] == pytest.approx(1e-3) and g["betas"] == (0.9, 0.99) and g["eps"] == 1e-8
    assert all(type(v) is float for v in (g["lr"], g["eps"], g["weight_decay"], *g["betas"]))
    for bad, what in ((dict(lr="0.1"), "Invalid lr: '0.1'"), (dict(lr=True), "Invalid lr: True"),
                      (dict(lr=np.array([1e-3, 1e-3])), "Invalid lr: .* \\(expected one number\\)"),
                      (dict(betas=(0.9,)), "Invalid betas"),
                      (dict(maximize=True), "maximize=True asks for another update rule")):
        with pytest.raises((ValueError, NotImplementedError), match=what):
            CPUAdam([p], **bad)


# --- copies on the worker ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_tensors_copies_every_byte_as_copy_does(dtype):
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=gen).to(dtype) for n in (0, 1, 37, 3 << 18)]
    dsts = [torch.full_like(s, 7) for s in srcs]
    want = [d.clone().copy_(s) for d, s in zip(dsts, srcs)]
    _C.cpu_adam.copy_tensors(dsts, srcs)
    assert all(torch.equal(d.view(torch.uint8) if d.numel() else d, w.view(torch.uint8) if w.numel() else w)
               for d, w in zip(dsts, want))


def test_copy_tensors_refuses_what_it_cannot_copy_and_copies_nothing():
    a, b = torch.zeros(8), torch.ones(8)
    cases = [([a], [b, b], ValueError, "as many tensors"),
             ([a], [torch.ones(8, dtype=torch.bfloat16)], TypeError, "copies bytes"),
             ([a], [torch.ones(9)], ValueError, "9"),
             ([a], [torch.ones(4, 4).t()], ValueError, "not contiguous")]
    for dsts, srcs, error, text in cases:
        with pytest.raises(error, match=text):
            _C.cpu_adam.copy_tensors(dsts, srcs)
        assert torch.equal(a, torch.zeros(8))


def _chunk(seed: int, n: int = 5000) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1,
            torch.rand(n, generator=gen) * 0.01, torch.randn(n, generator=gen).to(torch.bfloat16)]


def test_the_update_worker_updates_as_adam_chunk_step_on_the_callers_thread():
    """_C.cpu_adam.UpdateWorker (Note [The worker without the GIL] in
    cpu_adam/update_worker.h), as the engine's step overlap submits: two
    groups' ranges, a loss scale, the undo copy of a range before the update,
    bitwise the same calls made here; the times in perf_counter seconds."""
    calls = [([(0, 1000), (1500, 700)], [3, 1], 1e-2, 0.9, 0.999, 1e-8, 0.1),
             ([(3000, 1999)], [5], 3e-3, 0.8, 0.99, 1e-6, 0.0)]
    got, want = _chunk(0), _chunk(0)
    before = [t.clone() for t in got]
    undo = [torch.full((2500,), 7, dtype=t.dtype) for t in got]
    worker = _C.cpu_adam.UpdateWorker()
    t0 = time.perf_counter()
    ticket = worker.submit(*got, calls, undo=undo, undo_lo=500, undo_hi=3000, loss_scale=1 / 512,
                           adamw_mode=False, num_threads=1)
    for ranges, steps, lr, b1, b2, eps, wd in calls:
        _C.cpu_adam.adam_chunk_step(*want, ranges, step=steps, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                    weight_decay=wd, adamw_mode=False, loss_scale=1 / 512,
                                    max_grad_norm=0.0, check_overflow=False)
    began, fenced, ended = ticket.result()
    assert ticket.done() and not ticket.failed()
    assert t0 <= began <= fenced <= ended <= time.perf_counter()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0], before[0])
    assert all(torch.equal(u, b[500:3000]) for u, b in zip(undo, before))


def test_the_update_worker_refuses_bad_jobs_by_name_and_reports_a_failed_one():
    worker = _C.cpu_adam.UpdateWorker()
    bufs = _chunk(1, 100)
    one = [([(0, 100)], [1], 1e-3, 0.9, 0.999, 1e-8, 0.0)]
    cases = [(dict(undo=[torch.zeros(100)] * 3, undo_hi=10), ValueError, "undo has 3 buffers"),
             (dict(undo=[torch.zeros(10)] * 4, undo_lo=5, undo_hi=200), ValueError, r"undo range \[5, 200\)"),
             (dict(undo=[torch.zeros(5)] * 4, undo_hi=10), ValueError, "undo\\[0\\] has 5 elements"),
             (dict(undo=[torch.zeros(10, dtype=torch.float64)] * 4, undo_hi=10), TypeError, "undo\\[0\\]"),
             (dict(undo=[torch.zeros(10)] * 4, undo_hi=10), TypeError, "undo\\[3\\] is float32 but .*copies bytes"),
             (dict(grad=torch.zeros(100, dtype=torch.float16)), TypeError, "grad must be torch.float32")]
    for kw, error, text in cases:
        with pytest.raises(error, match=text):
            worker.submit(*bufs, one, **kw)
    with pytest.raises(TypeError, match="param must be torch.float32"):
        worker.submit(bufs[3], *bufs[1:], one)
    # Past the chunk's end: refused on the worker, raised by result().
    ticket = worker.submit(*bufs, [([(90, 20)], [1], 1e-3, 0.9, 0.999, 1e-8, 0.0)])
    with pytest.raises(ValueError, match="90"):
        ticket.result()
    assert ticket.failed() and not ticket.undo_failed()
    assert torch.equal(bufs[0], _chunk(1, 100)[0])


def test_a_waiter_runs_a_job_the_update_worker_has_not_started():
    """Note [A waiter runs the job itself] in cpu_adam/update_worker.h: with
    the worker busy on a long job, run_or_wait runs a later job on the
    calling thread, bitwise as adam_chunk_step."""
    n = 1 << 23
    ballast = [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)]
    calls = [([(0, 5000)], [2], 1e-2, 0.9, 0.999, 1e-8, 0.1)]
    got, want = _chunk(3), _chunk(3)
    worker = _C.cpu_adam.UpdateWorker()
    long_job = worker.submit(*ballast, [([(0, n)], [1], 1e-3, 0.9, 0.999, 1e-8, 0.0)], num_threads=1)
    ticket = worker.submit(*got, calls, loss_scale=1 / 8, num_threads=1)
    assert worker.run_or_wait(ticket)  # (the long job takes tens of ms)
    assert ticket.done() and not long_job.done()
    for ranges, steps, lr, b1, b2, eps, wd in calls:
        _C.cpu_adam.adam_chunk_step(*want, ranges, step=steps, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                    weight_decay=wd, loss_scale=1 / 8, max_grad_norm=0.0,
                                    check_overflow=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    worker.run_or_wait(long_job)  # (here too where the worker had not woken yet)
    assert long_job.done() and not long_job.failed()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="counts the process's threads in /proc; needs torch's intra-op pool")
def test_copy_tensors_on_a_second_thread_starts_no_openmp_team():
    """Note [A second OpenMP team] in cpu_adam/adam.h: a large torch copy_ on
    a second Python thread gives that thread an OpenMP team of its own (which
    slows the script's operators while it lives); copy_tensors there does not.
    The torch copy_ is made last, on a thread of its own, to show the count
    would see a team."""
    import concurrent.futures

    src, dst = torch.randn(1 << 22), torch.empty(1 << 22)
    _C.cpu_adam.copy_tensors([dst], [src])  # oneTBB's workers exist from here on
    dst.copy_(src)  # and this thread's team
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()
        before = _threads()
        pool.submit(_C.cpu_adam.copy_tensors, [dst], [src]).result()
        assert _threads() == before
        assert torch.equal(dst, src)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()
        before = _threads()
        pool.submit(lambda: dst.copy_(src)).result()
        assert _threads() > before, "a torch copy_ on a second thread started no team: the check above sees nothing"
