import os
import socket
import time

import pytest
import torch


def _low_precision_gemm_is_slow() -> bool:
    """Whether torch's CPU bf16 GEMM is its reference loop (no AVX-512: no oneDNN for
    it), measured: a bf16 product over 8x the time of the same product in fp32."""
    a, b = torch.randn(64, 256), torch.randn(256, 256)
    def best(x, y):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - start)
        return min(times)
    return best(a.bfloat16(), b.bfloat16()) > 8 * best(a, b)


# On such a host every bf16 model the suite trains spends most of its time in that loop
# (95x fp32's time on a 2-core AVX2 host). TIDAL_TEST_FP32_GEMM=1 makes `import tidal`
# compute bf16 / fp16 CPU matrix products through fp32 GEMM, in this process and in every
# subprocess a test starts (tidal/_testing.py). Set TIDAL_TEST_FP32_GEMM=0 to test on
# torch's own kernel anyway; the decision is made once, by the first process, and passed
# on in the environment (xdist's workers and the subprocesses inherit it).
if "TIDAL_TEST_FP32_GEMM" not in os.environ:
    os.environ["TIDAL_TEST_FP32_GEMM"] = "1" if _low_precision_gemm_is_slow() else "0"

import tidal  # noqa: E402  -- after the switch: importing tidal reads it


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
