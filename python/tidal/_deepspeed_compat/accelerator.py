"""deepspeed.accelerator: get_accelerator() for the device tidal trains on.

DeepSpeed scripts ask the accelerator where to put their batches
(`torch.device(get_accelerator().device_name(), local_rank)`), how to seed,
synchronize and read memory. Here it answers for tidal's device
(tidal.get_device()), the one engine.device computes on:

* a GPU (backend "cuda"): DeepSpeed's CUDA accelerator, over torch.cuda
  (device "cuda:<i>", backend "nccl");
* the simulated device (backend "sim"): its tensors are host tensors, so it is
  DeepSpeed's CPU accelerator (device "cpu", backend "gloo"), one device,
  whose synchronize() waits for the simulated device's copies and whose memory
  figures are the simulated device's (tidal.get_device().memory_stats()).

Only methods with a meaning here exist; any other name is an AttributeError
that says so.
"""
from __future__ import annotations

import torch

__all__ = ["get_accelerator"]


class _Accelerator:
    """What both accelerators answer alike."""

    _name = ""
    _communication_backend_name = ""

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_available(self) -> bool:
        return True

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def random(self):
        return torch.random

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def is_bf16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [torch.float32, torch.float16, torch.bfloat16]

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def __getattr__(self, name):
        raise AttributeError(
            f"tidal.deepspeed.accelerator: get_accelerator().{name} is not provided: tidal's "
            f"accelerator ({self._name}) answers device_name, current_device_name, "
            f"device_count, is_available, set_device, synchronize, manual_seed(_all), "
            f"empty_cache, memory_allocated, max_memory_allocated, total_memory, "
            f"available_memory, is_bf16_supported, is_fp16_supported, "
            f"communication_backend_name, pin_memory, on_accelerator and the RNG methods")


class _Cuda(_Accelerator):
    """DeepSpeed's CUDA_Accelerator (accelerator/cuda_accelerator.py), over torch.cuda."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_synchronized_device(self) -> bool:
        return False

    def device_name(self, device_index: "int | None" = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: "int | None" = None):
        return torch.cuda.device(device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: "int | None" = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, device_index: "int | None" = None):
        return torch.cuda.get_rng_state() if device_index is None else \
            torch.cuda.get_rng_state(device_index)

    def set_rng_state(self, new_state, device_index: "int | None" = None):
        return torch.cuda.set_rng_state(new_state) if device_index is None else \
            torch.cuda.set_rng_state(new_state, device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: "int | None" = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: "int | None" = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: "int | None" = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: "int | None" = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: "int | None" = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"


class _Simulated(_Accelerator):
    """DeepSpeed's CPU_Accelerator (accelerator/cpu_accelerator.py) for tidal's
    simulated device: models compute on host tensors, one device."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    @staticmethod
    def _device():
        from ..device import get_device
        return get_device()

    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index: "int | None" = None) -> str:
        return "cpu"

    def set_device(self, device_index: int) -> None:
        # DeepSpeed's CPU accelerator takes any index (a rank's local rank);
        # every rank's tensors are host tensors.
        del device_index

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def synchronize(self, device_index: "int | None" = None) -> None:
        del device_index
        self._device().synchronize()

    def manual_seed(self, seed: int):
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.manual_seed(seed)

    def get_rng_state(self, device_index: "int | None" = None):
        return torch.get_rng_state()

    def set_rng_state(self, new_state, device_index: "int | None" = None):
        return torch.set_rng_state(new_state)

    def empty_cache(self) -> None:
        """Nothing to free: the simulated device has no cache of its own."""

    def memory_allocated(self, device_index: "int | None" = None) -> int:
        return int(self._device().memory_stats()["in_use"])

    def max_memory_allocated(self, device_index: "int | None" = None) -> int:
        return int(self._device().memory_stats()["peak_in_use"])

    def reset_peak_memory_stats(self, device_index: "int | None" = None) -> None:
        self._device().reset_peak_memory()

    def total_memory(self, device_index: "int | None" = None) -> int:
        return int(self._device().memory_stats()["capacity"])

    def available_memory(self, device_index: "int | None" = None) -> int:
        stats = self._device().memory_stats()
        return int(stats["capacity"] - stats["in_use"])

    def is_fp16_supported(self) -> bool:
        return True  # (tidal trains fp16 on the simulated device: loss scaling and all)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor  # as DeepSpeed's CPU accelerator: nothing to copy to

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"


_BY_BACKEND = {"cuda": _Cuda(), "sim": _Simulated()}


def get_accelerator() -> _Accelerator:
    """deepspeed.accelerator.get_accelerator(): the accelerator of tidal's
    device (tidal.get_device(), created from TIDAL_DEVICE on first use)."""
    from ..device import get_device
    backend = get_device().info()["backend"]
    accelerator = _BY_BACKEND.get(backend)
    if accelerator is None:  # (a backend added to runtime/device without one here)
        raise RuntimeError(f"tidal.deepspeed.accelerator: no accelerator for tidal's device "
                           f"backend {backend!r}; expected one of {sorted(_BY_BACKEND)}")
    return accelerator
