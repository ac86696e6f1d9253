"""torch's per-process cap on a GPU lasts while an engine lives (Note
[torch's cap belongs to the live engines] in engine/device_cap.py): claims
against a stand-in for torch's cap that keeps it in bytes, as torch does."""
import gc
import weakref

import pytest

from tidal.engine.device_cap import DeviceCaps

MEMORY = 150_000_000_000  # an H200's bytes, near enough


class Torch:
    """torch's cap per device: bytes = floor(fraction * memory); read back as
    bytes / memory (1.0 until one is set)."""

    def __init__(self):
        self.bytes = {}
        self.sets = 0

    def get(self, device):
        return self.bytes[device] / MEMORY if device in self.bytes else 1.0

    def set(self, fraction, device):
        assert 0.0 <= fraction <= 1.0
        self.bytes[device] = int(fraction * MEMORY)
        self.sets += 1


class Engine:
    pass


def near(a, b):
    return abs(a - b) < 1e-9


def test_one_engine_caps_its_device_and_gives_back_what_was_there():
    t = Torch()
    t.set(0.9, 0)  # the user's own cap
    caps = DeviceCaps(t.get, t.set)
    e = Engine()
    caps.claim(e, 0, 0.3)
    assert near(t.get(0), 0.3) and near(t.get(1), 1.0)
    del e
    gc.collect()
    assert near(t.get(0), 0.9)
    assert caps.claims(0) == []


def test_the_newest_live_engine_holds_the_cap():
    t = Torch()
    caps = DeviceCaps(t.get, t.set)
    a, b, c = Engine(), Engine(), Engine()
    caps.claim(a, 0, 0.5)
    caps.claim(b, 0, 0.25)
    caps.claim(c, 0, 0.75)
    assert near(t.get(0), 0.75)
    del b  # not the newest: the cap stays c's
    gc.collect()
    assert near(t.get(0), 0.75) and caps.claims(0) == [0.5, 0.75]
    del c
    gc.collect()
    assert near(t.get(0), 0.5)
    del a
    gc.collect()
    assert near(t.get(0), 1.0) and caps.claims(0) == []


def test_a_cap_set_by_somebody_else_is_theirs():
    t = Torch()
    caps = DeviceCaps(t.get, t.set)
    a, b = Engine(), Engine()
    caps.claim(a, 0, 0.5)
    caps.claim(b, 0, 0.25)
    t.set(0.6, 0)  # the user, while both engines live
    sets = t.sets
    del b
    gc.collect()
    del a
    gc.collect()
    assert near(t.get(0), 0.6) and t.sets == sets


def test_devices_are_apart_and_a_budget_over_the_card_caps_at_one():
    t = Torch()
    caps = DeviceCaps(t.get, t.set)
    a, b = Engine(), Engine()
    caps.claim(a, 0, 0.4)
    caps.claim(b, 1, 1.7)
    assert near(t.get(0), 0.4) and near(t.get(1), 1.0)
    del a
    gc.collect()
    assert near(t.get(0), 1.0) and near(t.get(1), 1.0) and caps.claims(1) == [1.0]


@pytest.mark.parametrize("bad", [0.0, -0.2, float("nan")])
def test_a_fraction_that_is_no_cap_is_refused(bad):
    t = Torch()
    caps = DeviceCaps(t.get, t.set)
    with pytest.raises(ValueError, match="fraction in \\(0, 1\\]"):
        caps.claim(Engine(), 0, bad)
    assert t.sets == 0 and caps.claims(0) == []


def test_an_engine_collected_inside_a_claim_does_not_deadlock_and_still_gives_back():
    # Engines sit in reference cycles (their model's hooks hold them): the cycle
    # collector frees them, at any allocation, here inside torch's get() during
    # another engine's claim on the same thread.
    import threading
    t = Torch()
    collect = []

    def get(device):
        if collect:
            gc.collect()
        return t.get(device)
    caps = DeviceCaps(get, t.set)
    gc.disable()  # (the collector runs only where the test says)
    try:
        a = Engine()
        a.self = a  # a cycle: only the collector frees it
        alive = weakref.ref(a)
        caps.claim(a, 0, 0.5)
        del a
        assert alive() is not None
    finally:
        gc.enable()
    collect.append(True)
    b = Engine()
    done = threading.Event()

    def claim_b():
        caps.claim(b, 1, 0.25)
        done.set()
    threading.Thread(target=claim_b, daemon=True).start()
    assert done.wait(30), "claim() deadlocked on the finalizer of a collected engine"
    assert near(t.get(0), 1.0) and caps.claims(0) == []  # a's claim ended, device 0 back
    assert near(t.get(1), 0.25) and caps.claims(1) == [0.25]


def test_a_cap_torch_refuses_leaves_no_claim_behind():
    t = Torch()

    def refuse(fraction, device):
        raise RuntimeError("no")
    caps = DeviceCaps(t.get, refuse)
    with pytest.raises(RuntimeError, match="no"):
        caps.claim(Engine(), 0, 0.5)
    assert caps.claims(0) == []
