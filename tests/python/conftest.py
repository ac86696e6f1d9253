import pytest

import tidal


@pytest.fixture
def sim_device():
    """A fresh small simulated device as the process-wide device; the previous one is restored after."""
    previous = tidal.get_device()
    device = tidal.set_device("sim", capacity="64MiB")
    try:
        yield device
    finally:
        tidal._C.set_default_device(previous)
