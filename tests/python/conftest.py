import socket

import pytest
import torch

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


@pytest.fixture
def one_rank_launcher(monkeypatch):
    """The environment torchrun (or deepspeed's launcher) gives one rank; the
    process groups started under it are destroyed after the test. Yields a list
    the test appends its engines to (their data-parallel groups are closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(key, value)
    engines = []
    yield engines
    for engine in engines:
        if engine.dp is not None:
            engine.dp.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
