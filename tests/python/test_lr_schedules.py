"""tidal.lr_schedules against hand-written references of DeepSpeed's formulas.

The references below are written from DeepSpeed 0.19.8's documented
behaviour, independently of tidal's classes: closed forms in terms of the
position k = last_batch_iteration (-1 before the first optimizer step), plus
values worked out by hand. The config errors of the `scheduler` section are
at the end.
"""
import math
import warnings

import pytest

import tidal
from tidal.lr_schedules import (LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR,
                                build_scheduler)

REL = 1e-12


def close(a, b):
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-18)


# --------------------------------------------------------------- references
def ref_warmup(k, lo, hi, n, kind):
    """lr of WarmupLR at position k."""
    n = 2 if n < 2 else n
    if k < 0:
        return lo
    if k >= n:
        return hi
    share = math.log(1 + k) / math.log(n) if kind == "log" else k / n
    return lo + share * (hi - lo)


def ref_warmup_decay(k, lo, hi, n, total, kind):
    n_eff = 2 if n < 2 else n
    if k < n_eff:
        return ref_warmup(k, lo, hi, n, kind)
    remaining = (total - k) / (total - n_eff if total - n_eff > 1 else 1)
    return lo + (hi - lo) * (remaining if remaining > 0 else 0.0)


def ref_cosine(k, base, total, wmin, n, cmin, kind):
    n = 2 if n < 2 else n
    if k < 0:
        return 0.0
    if k < n:
        share = math.log(1 + k) / math.log(n) if kind == "log" else k / n
        return base * (wmin + (1 - wmin) * share)
    done = min((k + 1 - n) / max(total - n, 1), 1.0)
    return base * max(cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * done)), 0.0)


def ref_one_cycle_scale(k, first, second, stairs1, stairs2):
    """Triangle position in [0, 1] of 1Cycle at position k (cycle of first + second steps)."""
    total = first + second
    pos = (k + 1) % total
    if pos <= first:
        scale, stairs, span = pos / first, stairs1, first
        offset = pos
    else:
        scale, stairs, span = (total - pos) / second, stairs2, second
        offset = total - pos
    if stairs > 0:
        scale = math.floor(offset * stairs / span) / stairs
    return scale


def ref_one_cycle(k, lo, hi, first, second, stairs1, stairs2, decay_rate, decay_size,
                  mom_lo, mom_hi, mom_rate):
    total = first + second
    if k < total:
        s = ref_one_cycle_scale(k, first, second, stairs1, stairs2)
        lr, mom = lo + s * (hi - lo), mom_hi - s * (mom_hi - mom_lo)
    else:
        after = k - total + 1
        lr = lo if decay_size == 0 or decay_rate == 0 else lo / (1 + decay_rate * after / decay_size)
        mom = mom_hi if decay_size == 0 or mom_rate == 0 else \
            mom_hi * (1 + mom_rate * after / decay_size)
    if k == -1:
        mom = mom_lo  # DeepSpeed sets the lower momentum when it builds the schedule
    return lr, (mom, 0.99)


def ref_range_test(k, lo, size, rate, stairs):
    steps = (k + 1) / size
    return lo * (1 + rate * (math.floor(steps) if stairs else steps))


POSITIONS = list(range(-1, 260)) + [999, 1000, 1001, 5000]


# ------------------------------------------------------------- the formulas
@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n", [1, 2, 3, 10, 100, 1000])
@pytest.mark.parametrize("lo,hi", [(0.0, 1e-3), (1e-5, 3e-4), (2e-3, 1e-3)])
def test_warmup_lr_matches_the_reference(kind, n, lo, hi):
    s = WarmupLR(lo, hi, n, kind)
    for k in POSITIONS:
        assert close(s.lr_at(k), ref_warmup(k, lo, hi, n, kind)), k


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n,total", [(1, 1), (10, 100), (100, 250), (100, 101), (250, 100),
                                     (1000, 5000)])
def test_warmup_decay_lr_matches_the_reference(kind, n, total):
    s = WarmupDecayLR(total, 1e-5, 1e-3, n, kind)
    for k in POSITIONS:
        assert close(s.lr_at(k), ref_warmup_decay(k, 1e-5, 1e-3, n, total, kind)), k


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n,total", [(1, 50), (10, 100), (100, 120), (200, 100)])
@pytest.mark.parametrize("wmin,cmin", [(0.0, 0.0001), (0.1, 0.05)])
def test_warmup_cosine_lr_matches_the_reference(kind, n, total, wmin, cmin):
    s = WarmupCosineLR(3e-4, total, wmin, n, cmin, kind)
    for k in POSITIONS:
        assert close(s.lr_at(k), ref_cosine(k, 3e-4, total, wmin, n, cmin, kind)), k


@pytest.mark.parametrize("first,second", [(10, None), (7, 13), (10, 3)])
@pytest.mark.parametrize("stairs1,stairs2", [(0, None), (4, None), (3, 2), (5, 0)])
@pytest.mark.parametrize("decay_size,decay_rate,mom_rate", [(0, 0.0, 0.0), (5, 0.5, 0.0),
                                                             (4, 0.0, 0.05), (3, 1.0, 0.01)])
def test_one_cycle_matches_the_reference(first, second, stairs1, stairs2, decay_size, decay_rate,
                                         mom_rate):
    s = OneCycle(1e-4, 1e-2, decay_rate, first, second, stairs1, stairs2, decay_size,
                 cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9,
                 decay_mom_rate=mom_rate)
    sec = first if second is None else second
    st2 = stairs1 if stairs2 is None else stairs2
    for k in POSITIONS:
        lr, betas = ref_one_cycle(k, 1e-4, 1e-2, first, sec, stairs1, st2, decay_rate,
                                  decay_size, 0.8, 0.9, mom_rate)
        assert close(s.lr_at(k), lr), k
        got = s.betas_at(k)
        assert close(got[0], betas[0]) and got[1] == 0.99, (k, got, betas)
    off = OneCycle(1e-4, 1e-2, cycle_first_step_size=first, cycle_momentum=False)
    assert off.betas_at(5) is None


@pytest.mark.parametrize("size,rate,stairs", [(1, 1.0, False), (7, 0.5, False), (7, 0.5, True),
                                              (100, 2.0, True)])
def test_lr_range_test_matches_the_reference(size, rate, stairs):
    s = LRRangeTest(1e-4, size, rate, stairs)
    for k in POSITIONS:
        assert close(s.lr_at(k), ref_range_test(k, 1e-4, size, rate, stairs)), k


def test_values_worked_out_by_hand():
    w = WarmupLR(0.0, 1e-3, 1000, "log")
    assert w.lr_at(-1) == 0.0 and w.lr_at(0) == 0.0
    assert close(w.lr_at(9), 1e-3 / 3)          # log 10 / log 1000
    assert close(w.lr_at(99), 2e-3 / 3)         # log 100 / log 1000
    assert w.lr_at(999) == pytest.approx(1e-3, rel=1e-15) and w.lr_at(10**6) == 1e-3
    lin = WarmupLR(0.0, 1e-3, 1000, "linear")
    assert close(lin.lr_at(500), 5e-4) and lin.lr_at(1000) == 1e-3
    d = WarmupDecayLR(2000, 0.0, 1e-3, 1000, "linear")
    assert close(d.lr_at(1000), 1e-3) and close(d.lr_at(1500), 5e-4)
    assert d.lr_at(2000) == 0.0 and d.lr_at(3000) == 0.0
    c = WarmupCosineLR(1e-3, 1100, 0.0, 100, 0.0, "linear")
    assert close(c.lr_at(50), 5e-4)             # half-way up the linear warm-up
    assert close(c.lr_at(599), 5e-4)            # (599 + 1 - 100) / 1000 = half the cosine
    assert c.lr_at(1099) == pytest.approx(0.0, abs=1e-18) and c.lr_at(5000) == 0.0
    o = OneCycle(0.1, 1.1, cycle_first_step_size=10, cycle_second_step_size=10)
    assert close(o.lr_at(4), 0.6) and close(o.lr_at(9), 1.1) and close(o.lr_at(14), 0.6)
    assert close(o.lr_at(18), 0.2) and o.lr_at(25) == 0.1   # after the cycle: no decay by default
    assert o.betas_at(-1) == (0.8, 0.99) and close(o.betas_at(9)[0], 0.8)
    assert close(o.betas_at(4)[0], 0.85) and o.betas_at(30) == (0.9, 0.99)
    r = LRRangeTest(1e-3, 10, 1.0, True)
    assert r.lr_at(8) == 1e-3 and close(r.lr_at(9), 2e-3) and close(r.lr_at(29), 4e-3)


# ------------------------------------------------------ the step protocol
def test_optimizer_steps_see_deepspeeds_sequence_and_skips_do_not_advance():
    # DeepSpeed: lr written at construction (k = -1), then after every applied step.
    s = WarmupLR(0.0, 1.0, 4, "linear")
    used = []
    for overflow in [False, False, True, False, False, True, True, False, False, False]:
        used.append(s.get_lr())             # the lr this optimizer step runs with
        if not overflow:
            s.step()
    assert used == [0.0, 0.0, 0.25, 0.25, 0.5, 0.75, 0.75, 0.75, 1.0, 1.0]
    assert s.last_batch_iteration == 6 and s.get_last_lr() == [1.0]


def test_step_returns_the_next_lr_and_state_dicts_resume_the_schedule():
    a = WarmupDecayLR(300, 1e-5, 1e-3, 50, "log")
    first = [a.step() for _ in range(120)]
    assert all(close(lr, ref_warmup_decay(k, 1e-5, 1e-3, 50, 300, "log"))
               for k, lr in enumerate(first))
    state = a.state_dict()
    assert state == {"last_batch_iteration": 119}   # DeepSpeed's layout
    b = WarmupDecayLR(300, 1e-5, 1e-3, 50, "log")
    b.load_state_dict(state)
    assert [b.step() for _ in range(200)] == [a.step() for _ in range(200)]
    assert close(a.step(10), ref_warmup_decay(10, 1e-5, 1e-3, 50, 300, "log"))   # explicit position
    assert a.last_batch_iteration == 10


def test_constructor_errors_name_the_value():
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 0"):
        WarmupLR(warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear', got 'cos'"):
        WarmupLR(warmup_type="cos")
    with pytest.raises(ValueError, match="cycle step sizes must be positive"):
        OneCycle(0.1, 1.0, cycle_first_step_size=0)


# ----------------------------------------------------------- build_scheduler
def _build(config):
    """build_scheduler takes a loaded Config (lr_schedules does not import config)."""
    return build_scheduler(tidal.Config.load(config))


def test_build_scheduler_without_a_scheduler_section_is_none():
    assert _build({}) is None
    assert _build({"optimizer": {"params": {"lr": 0.1}}}) is None


def test_build_scheduler_uses_the_optimizer_lr_where_deepspeed_does():
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                        "warmup_type": "linear"}}}
    s = _build(cfg)
    assert isinstance(s, WarmupLR)
    assert [s.lr_at(k) for k in (-1, 5, 10)] == [0.0, 0.01, 0.02]   # max = the optimizer's lr
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": 2000}}
    d = _build(cfg)    # WarmupDecayLR's own default max is 0.001, warm-up 1000
    assert close(d.lr_at(999), 0.001) and close(d.lr_at(1500), 0.0005) and d.lr_at(2000) == 0.0
    cfg["scheduler"] = {"type": "WarmupCosineLR",
                        "params": {"total_num_steps": 100, "warmup_num_steps": 10}}
    c = _build(cfg)
    assert close(c.lr_at(9), 0.02) and c.lr_at(-1) == 0.0
    cfg["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                       "cycle_first_step_size": 5}}
    o = _build(cfg)
    assert o.get_lr() == 1e-4 and o.get_betas() == (0.8, 0.99)
    assert close(o.step(), 1e-4 + 0.9e-3 / 5)
    cfg["scheduler"] = {"type": "LRRangeTest", "params": {}}
    r = build_scheduler(tidal.Config.load(cfg))
    assert r.get_lr() == 1e-3 and r.get_betas() is None


def test_resumed_schedule_starts_at_its_position():
    s = _build({"scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear",
        "last_batch_iteration": 2}}})
    assert s.get_lr() == 0.5 and s.step() == 0.75


# --------------------------------------------------------------- config errors
def load(scheduler, **top):
    return tidal.Config.load({"scheduler": scheduler, **top})


def test_scheduler_config_is_resolved_with_deepspeed_defaults():
    c = load({"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5}})
    assert c.scheduler == {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 50, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
        "warmup_num_steps": 5, "warmup_type": "log", "last_batch_iteration": -1}}
    assert load({"type": "WarmupLR"}).scheduler["params"]["warmup_max_lr"] is None
    assert tidal.Config.load({}).scheduler is None


@pytest.mark.parametrize("scheduler,message", [
    ({"params": {}}, "config key 'scheduler.type': missing; expected one of WarmupLR, "
                     "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    ({"type": "WarmupDecay"}, "config key 'scheduler.type': expected one of 'WarmupLR', "
                              "'WarmupDecayLR', 'WarmupCosineLR', 'OneCycle', 'LRRangeTest', got "
                              "'WarmupDecay' (did you mean 'WarmupDecayLR'?)"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
     "config key 'scheduler.params.total_num_steps': required by WarmupDecayLR (the step at "
     "which the lr is back at warmup_min_lr), missing"),
    ({"type": "WarmupCosineLR", "params": {}},
     "config key 'scheduler.params.total_num_steps': required by WarmupCosineLR"),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 0.1}},
     "config key 'scheduler.params.cycle_min_lr': required by OneCycle"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 10}},
     "unknown config key 'scheduler.params.warmup_num_step'; did you mean 'warmup_num_steps'?"),
    ({"type": "WarmupLR", "params": {"total_num_steps": 10}},
     "config key 'scheduler.params.total_num_steps': not a parameter of WarmupLR (it is one of "
     "WarmupDecayLR, WarmupCosineLR); WarmupLR takes last_batch_iteration, warmup_max_lr, "
     "warmup_min_lr, warmup_num_steps, warmup_type"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
     "config key 'scheduler.params.warmup_num_steps': expected an integer >= 1, got 0"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 10.5}},
     "config key 'scheduler.params.warmup_num_steps': expected int, got float 10.5"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "1e-3"}},
     "config key 'scheduler.params.warmup_max_lr': expected float or int or null, got str '1e-3'"),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": -1e-4}},
     "config key 'scheduler.params.warmup_min_lr': expected a finite learning rate >= 0, got -0.0001"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
     "config key 'scheduler.params.warmup_type': expected one of 'log', 'linear', got 'cosine'"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": -2}},
     "config key 'scheduler.params.last_batch_iteration': expected -1 (start) or a step >= 0, got -2"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 1.5}},
     "config key 'scheduler.params.cos_min_ratio': expected a ratio in [0, 1], got 1.5"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_max_mom": 1.0}},
     "config key 'scheduler.params.cycle_max_mom': expected a momentum (Adam's beta1) in [0, 1), "
     "got 1.0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_first_stair_count": -1}},
     "config key 'scheduler.params.cycle_first_stair_count': expected an integer >= 0, got -1"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_rate": -1}},
     "config key 'scheduler.params.lr_range_test_step_rate': expected a finite rate >= 0, got -1"),
    ({"type": "WarmupLR", "params": [1, 2]},
     "config key 'scheduler.params': expected an object, got list [1, 2]"),
    ({"type": "WarmupLR", "parms": {}},
     "unknown config key 'scheduler.parms'; did you mean 'params'?"),
])
def test_scheduler_config_errors_name_key_value_and_allowed(scheduler, message):
    with pytest.raises(tidal.ConfigError) as e:
        load(scheduler)
    assert message in str(e.value)


def test_total_steps_below_warmup_is_reported_like_deepspeed():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = load({"type": "WarmupDecayLR", "params": {"total_num_steps": 10,
                                                      "warmup_num_steps": 100}},
                 optimizer={"type": "AdamW"})
    messages = [str(w.message) for w in caught]
    assert messages == ["config key 'scheduler.params.total_num_steps' = 10 is less than "
                        "'scheduler.params.warmup_num_steps' = 100: the WarmupDecayLR schedule "
                        "ends before its warm-up does"]
    assert caught[0].filename == __file__   # reported where the config was loaded
    assert c.scheduler["params"]["total_num_steps"] == 10
