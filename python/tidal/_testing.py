"""Testing switch: bf16 / fp16 matrix products on the CPU through fp32 GEMM.

For the test suite only (tests/python/conftest.py turns it on), never for training.

Without AVX-512, torch (2.13 included) does not hand bf16 or fp16 GEMM to oneDNN and
falls back to a reference loop: measured on a 2-core AVX2 host, a bf16 product runs at
0.29 GFLOP/s against 27.8 for the same product in fp32, 95x slower (a known upstream
problem, pytorch/pytorch#146508). Every bf16 model the suite trains on the simulated
device pays it, and it is most of the suite's time there.

With TIDAL_TEST_FP32_GEMM=1 in the environment, `import tidal` replaces torch's CPU
kernels of aten::mm, addmm, bmm and baddbmm: a product of bf16 (or fp16) operands is
computed as the fp32 product of their exact fp32 values, rounded once to the operands'
dtype, which is what torch's reference loop does in exact arithmetic (it accumulates in
fp32 too) with another order of the sums. Every other dtype goes to torch's own kernel
through the op's out= variant (the same structured kernel as the functional op, writing
into a fresh contiguous tensor as it does), so fp32 results are torch's, bit for bit.

On the simulated device torch's CPU allocations are the device memory the engine meters
and limits (Note [Counting CPU allocations] in hooks/host_allocation_counter.h). The fp32
copies of the operands and the fp32 product are made uncounted (Note [tidal's own host
allocations] in runtime/core/uncounted.h): only the result, the one tensor torch's own
kernel allocates, is counted, so the peaks, the budgets measured from them and every
eviction are what they are without the switch.

The switch is process-wide and is in the environment, so the subprocesses a test starts
(the fake libcudart's children, the scripts, the benchmarks' quick modes) compute as the
test process does: a comparison between the two stays a comparison of the same kernels.
"""
from __future__ import annotations

import os
import warnings

import torch

from tidal import _C

__all__ = ["ENV", "install_from_environment", "route_low_precision_gemm_through_fp32"]

ENV = "TIDAL_TEST_FP32_GEMM"
_LOW = (torch.bfloat16, torch.float16)
_library = None


def _low(*tensors: torch.Tensor) -> bool:
    return tensors[0].dtype in _LOW and all(t.dtype == tensors[0].dtype for t in tensors)


def _in_fp32(op, *tensors, **scalars) -> torch.Tensor:
    """op over the fp32 values of `tensors`, rounded once to their dtype; only the
    rounded result is a counted allocation."""
    _C.chunks.enter_uncounted()
    try:
        product = op(*(t.float() for t in tensors), **scalars)
    finally:
        _C.chunks.exit_uncounted()
    return product.to(tensors[0].dtype)


def _kernel(name: str, op):
    """aten::`name`'s CPU kernel: `op` in fp32 for bf16 / fp16 operands, else torch's
    own kernel through the out= variant, which resizes an empty tensor to the result's
    shape, contiguous, as the functional op allocates it."""
    torch_kernel = getattr(torch.ops.aten, name).out

    def kernel(*tensors, **scalars):
        if _low(*tensors):
            return _in_fp32(op, *tensors, **scalars)
        # (The operands share one dtype, or the kernel refuses them as the op does.)
        return torch_kernel(*tensors, **scalars, out=tensors[-1].new_empty(0))
    return kernel


_OPS = (("mm", torch.mm), ("bmm", torch.bmm), ("addmm", torch.addmm), ("baddbmm", torch.baddbmm))


def route_low_precision_gemm_through_fp32() -> None:
    """Installs the CPU kernels of _OPS (once per process)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns that a kernel is overridden: that is the point of the switch.
        warnings.simplefilter("ignore", UserWarning)
        for name, op in _OPS:
            library.impl(name, _kernel(name, op), "CPU")
    _library = library


def install_from_environment() -> None:
    """Installs the kernels where TIDAL_TEST_FP32_GEMM=1; refuses any value but 1, 0 or unset."""
    value = os.environ.get(ENV, "")
    if value == "1":
        route_low_precision_gemm_through_fp32()
    elif value not in ("", "0"):
        raise ValueError(f"environment variable {ENV}={value!r}: expected '1' (bf16 / fp16 CPU "
                         "matrix products through fp32 GEMM, a testing switch) or '0' / unset")
