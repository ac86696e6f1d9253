"""Parameters in chunks: registration, initial data, the parameter records.

A ParamStore owns the chunk scheduler (tidal._C.chunks.Chunks) of one model.
init_context() creates one before the model exists and fills it module by
module; initialize() adopts that store, or creates one for an already-built
model. Each registered parameter keeps its Python object (module attributes,
autograd and user references stay valid); its data becomes a 0-element
placeholder while it is not in use (Note [Parameters keep their TensorImpl]
in hooks/param_binding.h).
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
import weakref

import torch

from .. import _C
from .. import data_parallel as _dp
from ..config import Config, ConfigError
from ..device import get_device, set_device
from .placement import AdamPlacement

_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_CHUNK_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


# The host budget when the config gives none (tidal.host_memory_budget 0):
# this share of the memory the host can give (docs/config.md).
HOST_BUDGET_SHARE = 0.85


def available_memory_bytes() -> int:
    """The host memory the kernel can give without swapping (MemAvailable), or
    the physical memory where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def usable_device_bytes(info) -> int:
    """The device memory an engine can have (Note [The whole GPU is what is
    free]): on CUDA what the driver says is free plus what torch's caching
    allocator holds on that device already (its cache and the tensors a
    model moving into chunks gives back; none with a CPU build of torch),
    at most the device's capacity; elsewhere the capacity. `info`: the
    device's info()."""
    capacity = info["capacity"]
    if info["backend"] != "cuda":
        return capacity
    held = torch.cuda.memory_reserved(info["ordinal"]) if torch.cuda.is_available() else 0
    return min(capacity, info["free_memory"] + held)


# Note [The whole GPU is what is free]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Without tidal.device_memory_budget an engine on a GPU took the device's
# total memory as its budget. Part of that is never the process's: the CUDA
# context (0.74 GiB on the H200 run) and whatever other processes hold. So
# torch's cap (Note [torch's cap belongs to the live engines]) sat above what
# the driver could give, a cache miss asked for room "under the cap" that was
# not there, and the margin alone stood between the allocator's rounding and
# an out-of-memory error (gpt-18b on the H200 ran out with 135 GiB allocated,
# 3.9 GiB cached and a 3 GiB margin:
# benchmarks/results/engine_largest-nvidia-h200.json). The default budget is
# now what is free when the engine starts plus what torch holds already, and
# a budget set above that is refused by name: a budget is a promise the
# device must be able to keep.
def default_host_budget(host_memory: int | None = None) -> int:
    """The host budget an engine takes when its config gives none: HOST_BUDGET_SHARE
    of `host_memory` (None: of what the host can give now, available_memory_bytes())."""
    return int(HOST_BUDGET_SHARE * (available_memory_bytes() if host_memory is None else host_memory))


@contextlib.contextmanager
def uncounted():
    """Allocations in this block are not non-chunk device memory (sim device)."""
    was = _C.chunks.host_allocation_counting()
    _C.chunks.set_host_allocation_counting(False)
    try:
        yield
    finally:
        _C.chunks.set_host_allocation_counting(was)


# Chunk kinds, memory spaces and slot states cross the binding as its enums
# (chunk/chunk_id.h, chunk/memory_space.h, chunk/tensor_state.h); checkpoint
# manifests name kinds by KIND_NAMES.
_KIND, _SPACE, _STATE = _C.chunks.ChunkKind, _C.chunks.MemorySpace, _C.chunks.TensorState
PARAM16, PARAM32, MOMENTUM, VARIANCE, GRAD32 = (_KIND.PARAM16, _KIND.PARAM32, _KIND.MOMENTUM,
                                                _KIND.VARIANCE, _KIND.GRAD32)
HOST, DEVICE, NOWHERE = _SPACE.HOST, _SPACE.DEVICE, _SPACE.NONE
HOLD, FREE = _STATE.HOLD, _STATE.FREE
KIND_NAMES = {PARAM16: "param16", PARAM32: "param32", MOMENTUM: "momentum", VARIANCE: "variance",
              GRAD32: "grad32"}
KIND_BY_NAME = {name: kind for kind, name in KIND_NAMES.items()}

SLOT_KINDS = (PARAM16, PARAM32, MOMENTUM, VARIANCE)


def slot_kinds(record: "ParamRecord") -> tuple:
    """The chunk lists holding a record: frozen parameters have a 16-bit slot only."""
    return SLOT_KINDS if record.trainable else (PARAM16,)


def _pool(trainable: bool) -> int:
    """Trainable and frozen parameters never share a chunk (Note [Pools keep
    frozen tensors apart] in chunk/chunk_layout.h)."""
    return 0 if trainable else 1


def _held_only_by_its_record(record: "ParamRecord") -> bool:
    """True when nothing but `record` references its parameter: the model
    replaced it."""
    # Referrers, not sys.getrefcount: reference counts of arguments differ
    # across CPython versions. Runs once per candidate at initialize().
    return all(o is record for o in gc.get_referrers(record.param))


class RelayoutError(RuntimeError):
    """The first-use relayout failed; the old layout is intact."""


class ParamRecord:
    """One parameter in chunks."""

    __slots__ = ("param", "name", "id", "shape", "numel", "trainable", "chunk",
                 "step", "provisional", "group", "__weakref__")

    def __init__(self, param: torch.nn.Parameter, name: str, tensor_id: int, chunk: int):
        self.param = param
        self.name = name
        self.id = tensor_id
        self.shape = list(param.shape)
        self.numel = param.numel()
        self.trainable = param.requires_grad
        self.chunk = chunk
        self.step = 0             # Adam steps taken (torch's state['step'])
        self.provisional = False  # named by init_context; initialize() renames it
        self.group = 0            # its parameter group (Note [Parameter groups])


class SlotPin:
    """Slots of one record held in use (COMPUTE) beyond a `with` block:
    ParamStore.pin()'s answer. Their chunks cannot move (nor their payloads)
    until release(), so a view taken while pinned stays valid, also on
    another thread. The pin releases on the scheduler that pinned."""

    __slots__ = ("_chunks", "_id", "_kinds")

    def __init__(self, chunks, tensor_id: int, kinds: tuple):
        self._chunks, self._id, self._kinds = chunks, tensor_id, kinds

    def release(self) -> None:
        """Each slot back to HOLD, in the order they were pinned. A second
        call releases nothing; a release that fails leaves the pin as it was."""
        for kind in self._kinds:
            self._chunks.release(self._id, kind, HOLD)
        self._kinds = ()


class Offloaded:
    """What ParamStore.offload_to_host() did, for reload(): the device budget
    before it, and (tensor id, kind, numel) of one tensor of each chunk it
    moved, in the order moved."""

    __slots__ = ("budget", "moved")

    def __init__(self, budget: int):
        self.budget = budget
        self.moved: list = []


class ParamStore:
    _live: "weakref.WeakSet[ParamStore]" = weakref.WeakSet()
    # Stores filled by init_context() that no engine has adopted yet: the
    # model's parameters do not reference their store, so this does.
    _unadopted: "list[ParamStore]" = []

    def __init__(self, config: Config):
        self.config = config
        if config.device != "auto" or get_device().info()["backend"] not in ("sim", "cuda"):
            set_device(config.device)
        device = get_device()
        info = device.info()
        self.device = device
        self.backend = info["backend"]
        self.torch_device = torch.device(f"cuda:{info['ordinal']}") if self.backend == "cuda" \
            else torch.device("cpu")
        # Testing switch, for tests/python/test_fake_cuda.py only: TIDAL_TORCH_DEVICE=cpu
        # with the CUDA backend (under the fake libcudart of tests/fake_cuda, device memory
        # made CPU-readable) runs tidal's CUDA device layer while torch computes on the CPU
        # over chunk views. There is then no compute stream, and the engine measures
        # non-chunk memory with the host counter, as on the simulated device.
        torch_override = os.environ.get("TIDAL_TORCH_DEVICE", "")
        if torch_override and self.backend == "cuda":
            if torch_override != "cpu":
                raise ConfigError(f"environment variable TIDAL_TORCH_DEVICE={torch_override!r}: "
                                  "expected 'cpu' (a testing switch) or unset")
            self.torch_device = torch.device("cpu")
        capacity = info["capacity"]
        usable = usable_device_bytes(info)
        budget = config.device_memory_budget or usable
        if budget > capacity:
            raise ConfigError(
                f"config key 'tidal.device_memory_budget': {budget} bytes is more than the "
                f"{self.backend} device has ({capacity} bytes)")
        if budget > usable:
            raise ConfigError(
                f"config key 'tidal.device_memory_budget': {budget} bytes is more than the "
                f"{self.backend} device can give this process now ({usable} bytes: "
                f"{info['free_memory']} free and {usable - info['free_memory']} held by torch "
                f"already, of {info['total_memory']}; the rest is the CUDA context's and other "
                f"processes'); give at most {usable} bytes, or leave the key out for all of it")
        self.device_budget = budget
        self.margin = config.device_margin or max(budget // 20, 1 << 20)
        if self.margin >= budget:
            raise ConfigError(
                f"config key 'tidal.device_margin': {self.margin} bytes leaves nothing of the "
                f"device budget of {budget} bytes for chunks")
        if self.torch_device.type == "cuda" and \
                not isinstance(device.memory_provider(), _C.TorchMemoryProvider):
            # Chunk blocks from torch's caching allocator, one provider per device
            # (Note [Chunk memory and torch's caching allocator] in
            # hooks/torch_memory_provider.h; the engine's accounting: Note [The
            # memory tracer] in runtime/tracer/memory_tracer.h).
            stream = torch.cuda.current_stream(self.torch_device).cuda_stream
            try:
                device.set_memory_provider(_C.torch_cuda_memory_provider(info["ordinal"], stream))
            except NotImplementedError as e:
                warnings.warn(f"tidal: chunk memory comes from cudaMalloc, not from torch's "
                              f"caching allocator ({e}); the engine counts torch's reserved "
                              f"memory as non-chunk memory")
        # Chunks beyond this much host memory spill to free device room (Note
        # [One place per chunk] in runtime/scheduler/chunk_scheduler.h).
        self.host_budget = config.host_memory_budget or default_host_budget()
        # Host room kept for evictions from the device (two fp32 chunks: twice
        # the chunk size in 16-bit training, where an fp32 chunk holds as many
        # elements in twice the bytes; the chunk size itself in fp32), so a
        # full host and a full device can still swap chunks.
        fp32_chunk = config.chunk_size * (1 if config.precision == "fp32" else 2)
        self.host_reserve = min(2 * fp32_chunk, self.host_budget // 4)
        self.precision = config.precision
        self.dtype = _TORCH_DTYPES[config.precision]
        # Data parallel (Note [Data parallel by chunk] in tidal/data_parallel.py):
        # the optimizer states of a chunk live on its owner only.
        self.dp = None
        if _dp.wanted(config.data_parallel):
            self.dp = _dp.DataParallel(config.data_parallel, self.torch_device.type == "cuda")
        self.chunks = self._new_chunks()
        # Hybrid Adam's plan (Note [Where a chunk's Adam runs] in placement.py).
        self.adam_placement = AdamPlacement(self, config.hybrid_adam, disk=config.nvme_path is not None)
        self.records: list[ParamRecord] = []
        self._warnings: list[str] = []
        self._last_module: dict = {}  # pool -> the module of its last registered parameter
        self.by_param: dict[int, ParamRecord] = {}
        self._stale16: dict[int, ParamRecord] = {}  # masters materialized() exposed
        self._held32: set[int] = set()  # records whose master a materialized() holds now
        # Note [Offloading the engine's states]: what offload_to_host() moved
        # and the device budget it lowered, until reload().
        self.offloaded: "Offloaded | None" = None
        # Where registration's time went (add): bookkeeping and host chunk
        # memory as it is first touched (allocated, and pinned on a GPU), and
        # writing the values and zeroed moments into the slots. tidal-train
        # reports them beside the model's own initialisation.
        self.seconds = {"register": 0.0, "chunk_memory": 0.0, "write": 0.0}
        ParamStore._live.add(self)

    def _new_chunks(self):
        config = self.config
        stream = None
        if self.torch_device.type == "cuda":
            stream = torch.cuda.current_stream(self.torch_device).cuda_stream
        disk = {}
        if config.nvme_path is not None:
            # Note [Chunks on NVMe: the tier] in runtime/scheduler/disk_tier.h.
            kinds = self.disk_kinds()
            disk = dict(disk_path=config.nvme_path, disk_budget=config.nvme_budget, disk_kinds=kinds,
                        disk_threads=config.aio_queue_depth,
                        disk_request_bytes=config.aio_block_size,
                        disk_allow_buffered=config.nvme_allow_buffered, disk_backend=config.nvme_io,
                        disk_skip_clean_writes=config.nvme_skip_clean_writes)
        chunks = _C.chunks.Chunks(
            self.device, chunk_bytes=config.chunk_size,
            param_dtype=self._list_dtypes()[PARAM16],
            device_budget=self.device_budget - self.margin, host_budget=self.host_budget,
            prefetch=config.prefetch, prefetch_depth=config.prefetch_depth, evict_ahead=config.evict_ahead,
            skip_clean_copies=config.skip_clean_copies,
            policy=config.eviction_policy, pin_host_memory=config.pin_memory,
            compute_stream=stream, torch_device=str(self.torch_device),
            host_reserve=self.host_reserve,
            state_dtype=self._list_dtypes()[MOMENTUM], **disk)
        info = chunks.disk
        if info is not None:
            if info["removed_stale"]:
                warnings.warn(f"tidal: removed {len(info['removed_stale'])} NVMe file(s) a killed "
                              f"process left in {config.nvme_path}: "
                              f"{', '.join(info['removed_stale'])}", stacklevel=3)
            if info["memory_backed"]:
                warnings.warn(f"tidal: {config.nvme_path} is on tmpfs (tidal.nvme_allow_buffered): "
                              f"chunks of the NVMe tier stay in host memory there, beyond "
                              f"tidal.host_memory_budget", stacklevel=3)
            elif not info["direct"]:
                warnings.warn(f"tidal: {config.nvme_path} has no direct I/O (O_DIRECT): the NVMe "
                              f"tier uses buffered I/O, and the page cache holds a second copy of "
                              f"every chunk on it", stacklevel=3)
        return chunks

    def release_if_empty(self) -> bool:
        """After a failed initialize gave every parameter back: the chunks go
        now, and an NVMe tier's file with them (an exception's traceback may
        keep the store alive long after)."""
        if self.records or self.chunks is None:
            return False
        try:
            self.chunks.close_disk()
        except Exception:  # a chunk still on disk: the file goes with the chunks, or at exit
            return False
        self.chunks = None
        return True

    def disk_kinds(self) -> list:
        """The chunk lists that may live on the NVMe tier (none without one)."""
        lists = self.config.nvme_lists if self.config.nvme_path is not None else ()
        return ([PARAM16] if "param" in lists else []) + \
            ([PARAM32, MOMENTUM, VARIANCE] if "optimizer" in lists else [])

    def relayout(self, order: "list[ParamRecord]", keys: "list | None" = None) -> dict:
        """Moves every parameter into new chunks, registered in `order`.

        Note [Chunks in first-use order]: registration decides which tensors
        share a chunk. Module order is a guess; the warm-up step learns the
        order in which forward first uses each parameter, and placing them in
        that order makes each chunk's tensors be needed together, so a chunk
        comes to the device once per pass instead of once per user. Every slot
        (16-bit, fp32 master, momentum, variance) is copied on the host; an old
        slot is released FREE as soon as it is copied, so an old chunk's memory
        goes when its last tensor has moved and at most the chunks in flight
        exist twice. The new scheduler has no trace yet: the next step records
        one. Call only between steps (no slot in use). Returns the replaced
        scheduler's final counters. Raises RelayoutError with every record
        back in the old chunks when a copy fails (e.g. the host budget).
        """
        assert sorted(id(r) for r in order) == sorted(id(r) for r in self.records), \
            "relayout: the order must hold every record once"
        assert self.dp is None, "relayout would move records between data-parallel owners"
        old, new = self.chunks, self._new_chunks()
        last = {}
        ids = []
        for i, r in enumerate(order):
            pool, key = _pool(r.trainable), (keys[i] if keys is not None else None)
            ids.append(new.register(f"{i}:{r.name}", r.numel, pool=pool,
                                    with_previous=key is not None and last.get(pool) == key))
            last[pool] = key
        new.take_warnings()  # said once, at the first registration

        def copy(src_chunks, src_id, dst_chunks, dst_id, r, kind, src_state):
            src = src_chunks.access(src_id, kind, HOST, [r.numel])
            try:
                dst = dst_chunks.access(dst_id, kind, HOST, [r.numel])
                try:
                    dst.copy_(src)
                finally:
                    dst_chunks.release(dst_id, kind, HOLD)
            finally:
                src_chunks.release(src_id, kind, src_state)

        moved = 0
        with uncounted(), torch.no_grad():
            try:
                for r, new_id in zip(order, ids):
                    # The whole record first, then its old slots go (FREE):
                    # a failure leaves every record whole in one of the two.
                    for kind in slot_kinds(r):
                        copy(old, r.id, new, new_id, r, kind, HOLD)
                    for kind in slot_kinds(r):
                        old.set_state(r.id, kind, FREE)
                    moved += 1
            except BaseException as e:
                # Put the moved records back (their old chunks re-materialize).
                for r, new_id in list(zip(order, ids))[:moved]:
                    for kind in slot_kinds(r):
                        copy(new, new_id, old, r.id, r, kind, FREE)
                raise RelayoutError(f"rebuilding the chunks in first-use order failed ({e}); "
                                    f"the parameters stay in their chunks of before") from e
        for r, new_id in zip(order, ids):
            r.id = new_id
            r.chunk = new.placement(new_id)[0]
        self.records = list(order)
        self.chunks = new
        self.adam_placement.forget()
        return old.stats()

    def owns(self, record: "ParamRecord") -> bool:
        """Whether this rank holds `record`'s optimizer states (always on one process)."""
        return self.dp is None or self.dp.owns(record.chunk)

    def kinds_of(self, record: "ParamRecord") -> tuple:
        """The chunk lists holding `record` on this rank: its 16-bit slot, and
        the optimizer states where this rank owns its chunk."""
        return slot_kinds(record) if self.owns(record) else (PARAM16,)

    @classmethod
    def owning(cls, params) -> "ParamStore | None":
        for store in list(cls._live):
            for p in params:
                record = store.by_param.get(id(p))
                if record is not None and record.param is p:
                    return store
        return None

    def adopted(self) -> None:
        if self in ParamStore._unadopted:
            ParamStore._unadopted.remove(self)

    def placeholder(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.torch_device)

    def add(self, param: torch.nn.Parameter, name: str, provisional: bool = False,
            module=None, model_params: "tuple[int, int] | None" = None) -> ParamRecord:
        """Registers `param`, copies its values into its chunk slots (host) and
        leaves a placeholder as its data. `module`: the module it belongs to;
        a module's parameters share a chunk where they can (Note [One layout,
        five lists] in chunk/chunk_layout.h). `model_params`: (trainable,
        frozen) elements of the whole model being registered, for the error
        when the states do not fit (the bytes the run needs in all)."""
        if not param.is_floating_point():
            raise TypeError(f"parameter '{name}' has dtype {param.dtype}; tidal keeps floating-"
                            f"point parameters (float16/bfloat16/float32) in chunks")
        if param.is_meta:
            raise ValueError(f"parameter '{name}' is on the meta device and has no values; "
                             f"materialize and initialise it (e.g. module.to_empty(device='cpu') "
                             f"and its reset_parameters()) before tidal.initialize")
        if param.dtype == torch.float64:
            raise TypeError(f"parameter '{name}' is float64; tidal supports float32, float16 and "
                            f"bfloat16 parameters (convert the model with .float() first)")
        t_start = time.perf_counter()
        pool = _pool(param.requires_grad)
        key = None if module is None else id(module)
        with_previous = key is not None and self._last_module.get(pool) == key
        tensor_id = self.chunks.register(f"{len(self.records)}:{name}", param.numel(),
                                         pool=pool, with_previous=with_previous)
        self._last_module[pool] = key
        self._warnings.extend(self.chunks.take_warnings())  # e.g. a tensor larger than a chunk
        record = ParamRecord(param, name, tensor_id, self.chunks.placement(tensor_id)[0])
        src = param.detach().reshape(-1)
        c = self.chunks
        if self.dp is not None:
            self.dp.assign(record.chunk, c.chunk_capacity_bytes(record.chunk, PARAM16))
        kinds = self.kinds_of(record)
        t_memory = t_write = 0.0
        t = time.perf_counter()
        seconds = self.seconds
        seconds["register"] += t - t_start
        try:
            with uncounted(), torch.no_grad():
                for kind in kinds:
                    view = c.access(tensor_id, kind, HOST, [record.numel])
                    t_accessed = time.perf_counter()
                    if kind in (PARAM16, PARAM32):
                        view.copy_(src)
                    else:
                        view.zero_()
                    c.release(tensor_id, kind, HOLD)
                    t_memory += t_accessed - t
                    t = time.perf_counter()
                    t_write += t - t_accessed
        except _C.OutOfMemoryError as e:
            # The parameter keeps its data; its slots give their room back.
            for kind in kinds:
                c.set_state(tensor_id, kind, FREE)
            raise _C.OutOfMemoryError(self._no_room_message(name, record.numel, e, model_params)) from e
        finally:
            seconds["chunk_memory"] += t_memory
            seconds["write"] += t_write
        param.data = self.placeholder()
        record.provisional = provisional
        self.records.append(record)
        self.by_param[id(param)] = record
        return record

    # ------------------------------------------------------------ capacity
    def state_bytes_per_param(self, trainable: bool = True) -> int:
        """Chunk bytes per parameter: the 16-bit copy (fp32 in fp32 training) and,
        when trainable, the fp32 master, momentum and variance: 14 in mixed
        precision, 16 in fp32 (chunk padding aside), 4 less with bf16 moments
        (tidal.optimizer_state_dtype); with gradient accumulation 4 more for
        the fp32 gradient sums a step holds while its micro-batches run (Note
        [Gradient sums in chunks] in cpu_adam/adam.h)."""
        extra = 0
        if trainable:
            moments = 4 if self.config.optimizer_state_dtype == "bf16" else 8
            extra = 4 + moments + (4 if self.config.gradient_accumulation_steps > 1 else 0)
            if self.dp is not None:
                extra = -(-extra // self.dp.world)  # partitioned by chunk over the ranks
        return torch.empty(0, dtype=self.dtype).element_size() + extra

    def capacity_bytes(self) -> tuple[int, int]:
        """(host, device) bytes the chunks may occupy. A chunk lives in one place
        at a time (Note [One place per chunk] in runtime/scheduler/chunk_scheduler.h),
        so the two add up: tidal.host_memory_budget (85% of the memory available
        at start when 0) less the room kept for evictions, and the device budget
        less the margin."""
        return self.host_budget - self.host_reserve, self.device_budget - self.margin

    def disk_bytes_per_param(self) -> int:
        """Of state_bytes_per_param(), the bytes of a trainable parameter that
        may live on the NVMe tier (Note [Chunks on NVMe: the tier]): the 16-bit
        copy with offload_param, the fp32 master and moments with
        offload_optimizer (not the gradient sums of accumulation); 0 without
        a tier."""
        kinds = self.disk_kinds() if self.chunks is not None and self.chunks.disk is not None else []
        states = (4 + (4 if self.config.optimizer_state_dtype == "bf16" else 8)) \
            if PARAM32 in kinds else 0
        if states and self.dp is not None:
            states = -(-states // self.dp.world)  # partitioned by chunk over the ranks
        return (torch.empty(0, dtype=self.dtype).element_size() if PARAM16 in kinds else 0) + states

    def largest_model_params(self) -> int:
        """The most trainable parameters whose states fit host + device, and
        the NVMe tier for the bytes that may go there: an upper bound, since
        activations and the parameters in use share the device."""
        host, device = self.capacity_bytes()
        per_param = self.state_bytes_per_param()
        on_disk = self.disk_bytes_per_param()
        if not on_disk:
            return (host + device) // per_param
        # The tier adds its budget, but the bytes kept off disk still need memory.
        disk = self.chunks.disk["budget_bytes"]
        largest = (host + device + disk) // per_param
        return largest if on_disk >= per_param else min(largest, (host + device) // (per_param - on_disk))

    def _no_room_message(self, name: str, numel: int, error: Exception,
                         model_params: "tuple[int, int] | None" = None) -> str:
        host, device = self.capacity_bytes()
        params = sum(r.numel for r in self.records)
        per_param = self.state_bytes_per_param()
        disk = self.chunks.disk
        where = "host + device memory"
        capacity = (f"chunks may hold {host} bytes on the host (tidal.host_memory_budget"
                    f"{'' if self.config.host_memory_budget else ' = 0: 85% of the available memory'}) "
                    f"plus {device} bytes on the device (tidal.device_memory_budget less the margin)")
        tip = "Raise tidal.host_memory_budget or tidal.device_memory_budget, or train a smaller model"
        if disk is not None:
            where += f" and the NVMe tier in {self.config.nvme_path}"
            capacity += (f" plus {disk['budget_bytes']} bytes on the NVMe tier (tidal.nvme_budget"
                         f"{'' if self.config.nvme_budget else ' = 0: the free space less 10%'}; "
                         f"{self.disk_bytes_per_param()} of the {per_param} bytes per trainable "
                         f"parameter may go there)")
            tip = ("Raise tidal.nvme_budget (or free disk space), tidal.host_memory_budget or "
                   "tidal.device_memory_budget, offload the 16-bit parameters too (offload_param "
                   "'nvme'), or train a smaller model")
        need = ""
        if model_params is not None:
            trainable, frozen = model_params
            element = torch.empty(0, dtype=self.dtype).element_size()
            total = trainable * per_param + frozen * element
            need = (f"; the model's {trainable + frozen} parameters need about {total} bytes of "
                    f"chunks in all ({trainable} trainable at {per_param} bytes, {frozen} frozen at "
                    f"{element}; chunk padding aside)")
        return (f"the model's states do not fit in {where}: parameter '{name}' "
                f"({numel} elements) found no room after {len(self.records)} parameters of "
                f"{params} elements ({per_param} bytes per trainable parameter in "
                f"{self.precision}){need}; {capacity}, room for at most about "
                f"{self.largest_model_params()} parameters. {tip}. The chunk scheduler said: {error}")

    def give_back(self, added: "list[tuple[ParamRecord, torch.dtype]]") -> None:
        """Undoes add(): each parameter gets its values back as a tensor of its
        own dtype, read where its chunk is (no move, so no room is needed), and
        its slots are freed. For a failed initialize: nothing is lost."""
        c = self.chunks
        gone = set()
        with uncounted(), torch.no_grad():
            for r, dtype in reversed(added):
                kind = PARAM32 if r.trainable and self.owns(r) else PARAM16
                space = c.chunk_space(r.chunk, kind)
                if space != NOWHERE:
                    view = c.access(r.id, kind, space, r.shape)
                    try:
                        r.param.data = view.to("cpu", dtype, copy=True)
                    finally:
                        c.release(r.id, kind, HOLD)
                for k in self.kinds_of(r):
                    c.set_state(r.id, k, FREE)
                self.by_param.pop(id(r.param), None)
                gone.add(id(r))
        self.records = [r for r in self.records if id(r) not in gone]

    def discard(self, records: "list[ParamRecord]") -> None:
        """Gives up records whose parameters the model no longer holds.

        Note [Records the model dropped]: init_context registers a module's
        parameters when its __init__ returns, before the enclosing model may
        replace one (a tied lm_head takes the embedding's weight; Hugging
        Face's post_init ties weights too). The replaced parameter's record
        would keep host memory (fp32 master, m, v: 14 bytes per element,
        688 MiB for gpt-350m's lm_head) and travel through every relayout and
        checkpoint. Its slots become FREE, so a chunk whose slots are all
        FREE (a dedicated one) gives its memory back at once, and the record
        leaves the store. Records whose parameter something else still
        references (another model built in the same context) are kept. Call
        before any step (no slot in use).
        """
        records = [r for r in records if _held_only_by_its_record(r)]
        gone = {id(r) for r in records}
        for r in records:
            for kind in self.kinds_of(r):
                self.chunks.set_state(r.id, kind, FREE)
            self.by_param.pop(id(r.param), None)
        self.records = [r for r in self.records if id(r) not in gone]

    @contextlib.contextmanager
    def slots(self, record: "ParamRecord", kinds, space=None, state=None):
        """Views of `record`'s slots of `kinds` in `space` (None: each where
        its chunk is now, with no move; a chunk on disk is read to the host),
        in that order, in use (COMPUTE) while inside; each slot accessed is
        released to `state`
        (HOLD by default) on the way out, also when an access or the block
        fails part way. The engine's way to a slot outside the hooks, instead
        of calling the scheduler itself (Note [The Python package's layers] in
        tests/cpp/check_layers.py)."""
        c = self.chunks
        held = []
        try:
            for kind in kinds:
                where = c.chunk_space(record.chunk, kind) if space is None else space
                held.append((kind, c.access(record.id, kind, where, [record.numel])))
            yield [view for _, view in held]
        finally:
            for kind, _ in reversed(held):
                c.release(record.id, kind, HOLD if state is None else state)

    def pin(self, record: "ParamRecord", kinds, space=HOST, wait: bool = True) -> SlotPin:
        """Pins `record`'s slots of `kinds` in `space`, in that order (each
        accessed over the record's elements: in use, COMPUTE, its chunk
        brought there and unable to move) until the answer's release(). A
        record pins its whole chunk of each kind, so this is the way to hold
        chunks across more than one block (CPU Adam on a worker thread while
        backward goes on). When an access fails the slots already pinned are
        released, in the order pinned, and the error goes on. See slots() for
        views held inside one block. wait=False (host only): the pin returns
        while copies into the chunks may still run; copy_fences() gives what
        to wait on before reading them (Note [A pin that does not wait] in
        runtime/scheduler/chunk_scheduler.h)."""
        c = self.chunks
        pinned = []
        try:
            for kind in kinds:
                c.access(record.id, kind, space, [record.numel], wait=wait)
                pinned.append(kind)
        except BaseException:
            for kind in pinned:
                c.release(record.id, kind, HOLD)
            raise
        return SlotPin(c, record.id, tuple(pinned))

    def send_to_host(self, record: "ParamRecord", kind) -> bool:
        """Starts the copy of `record`'s chunk of `kind` to the host and
        returns without waiting for it (Note [A pin that does not wait]); the
        slot keeps its state (a gradient waiting for its fold stays one). A
        later access of the chunk waits for the copy if it has not landed.
        False, with nothing changed, when the host has no room for it now
        (Note [Gradients down as they land] in overlap.py)."""
        c = self.chunks
        state = c.state(record.id, kind)
        try:
            # (Moving it writes nothing: Note [The weights' image instead of
            # the restore] in hooks/gradient_sums.h counts the writes since
            # the chunk came up.)
            c.access(record.id, kind, HOST, [record.numel], wait=False, write=False)
        except _C.OutOfMemoryError:
            return False
        c.release(record.id, kind, state)
        return True

    def copy_fences(self, chunk: int, kinds) -> list:
        """Callables that wait for the copies into `chunk`'s chunks of `kinds`
        still running (none for those landed); the chunks must be pinned
        (pin(..., wait=False)) until the callables have run. Any thread."""
        c = self.chunks
        return [f for f in (c.copy_fence(chunk, k) for k in kinds) if f is not None]

    def _list_dtypes(self) -> dict:
        """Each chunk list's dtype name, as _new_chunks makes the lists: the
        16-bit list's precision, fp32 masters and sums, the moments'
        tidal.optimizer_state_dtype."""
        param = _CHUNK_DTYPES[self.config.precision]
        moments = "bfloat16" if self.config.optimizer_state_dtype == "bf16" else "float32"
        return {PARAM16: param, PARAM32: "float32", GRAD32: "float32", MOMENTUM: moments, VARIANCE: moments}

    def kind_dtypes(self, kinds) -> list:
        """The torch dtype of the chunks of each of `kinds`, with no access:
        an access is an entry in the scheduler's trace (Note [Left to the
        step, pinned as if launched] in overlap.py)."""
        names = self._list_dtypes()
        return [getattr(torch, names[k]) for k in kinds]

    def in_use(self, records, kind) -> bool:
        """Whether the slot of `kind` of any of `records` is in use (COMPUTE)
        now: its chunk cannot move while it is (Note [Chunk state machine] in
        chunk/tensor_state.h)."""
        c = self.chunks
        return any(c.state(r.id, kind) == _STATE.COMPUTE for r in records)

    @contextlib.contextmanager
    def materialized(self, module: torch.nn.Module):
        """The registered parameters of `module` and its submodules hold their
        values while inside.

        For code that re-initialises parameters after their module's __init__
        returned (Hugging Face's post_init, whose _init_weights may reach into
        submodules): each parameter's data is a host view of its fp32 master
        slot (its 16-bit slot when frozen), no copy. The 16-bit slots of the
        masters exposed are brought up to date by sync_param16(), once, when
        init_context ends. Parameters this store does not hold, or that an
        enclosing materialized() holds already, are left as they are. Not for
        use during training (the slots must be idle).
        """
        with self.materialized_params(module.parameters()):
            yield

    @contextlib.contextmanager
    def materialized_params(self, params):
        """materialized() for the parameters `params` (those this store holds)."""
        c = self.chunks
        held = []
        try:
            for p in params:
                r = self.by_param.get(id(p))
                if r is None or r.param is not p or p.numel() != 0:
                    continue  # not ours, or materialized already
                # (Data parallel: the 16-bit slot where another rank owns the master.)
                kind = PARAM32 if r.trainable and self.owns(r) else PARAM16
                p.data = c.access(r.id, kind, HOST, r.shape)
                held.append((r, kind))
                if kind == PARAM32:
                    self._stale16[id(r)] = r
                    self._held32.add(id(r))
            yield
        finally:
            for r, kind in held:
                c.release(r.id, kind, HOLD)
                r.param.data = self.placeholder()
                self._held32.discard(id(r))

    def sync_param16(self) -> None:
        """Copies the fp32 masters materialized() exposed into their 16-bit
        slots (rounded), as registration does; those an enclosing
        materialized() still holds stay for a later call."""
        c = self.chunks
        stale = {k: r for k, r in self._stale16.items() if k not in self._held32}
        self._stale16 = {k: r for k, r in self._stale16.items() if k in self._held32}
        with uncounted(), torch.no_grad():
            for r in stale.values():
                src = c.access(r.id, PARAM32, HOST, [r.numel])
                try:
                    dst = c.access(r.id, PARAM16, HOST, [r.numel])
                    try:
                        dst.copy_(src)
                    finally:
                        c.release(r.id, PARAM16, HOLD)
                finally:
                    c.release(r.id, PARAM32, HOLD)

    def write_values(self, values) -> None:
        """Writes (record, value) pairs into the chunks, as a script's write to
        its parameter between steps is kept: the 16-bit slot takes `value`
        (cast to its dtype), and the fp32 master takes it where the 16-bit
        value changed (elsewhere the master keeps its bits, which the slot
        holds rounded; in fp32 training the two are the same). `value` is the
        parameter's whole value (its shape); a record whose slot is in use
        (attached for an outside read: its parameter's data is a view of the
        slot) is written through that view, given as `attached_view`.

        Args:
            values: (record, value, attached_view or None) triples.
        """
        with torch.no_grad(), uncounted():
            for r, value, attached_view in values:
                if list(value.shape) != list(r.shape):
                    raise ValueError(f"writing '{r.name}': expected a value of shape "
                                     f"{tuple(r.shape)}, got {tuple(value.shape)}")
                flat = value.detach().reshape(-1)
                if attached_view is not None:
                    # (Not an access that says it writes: Note [Chunks on NVMe: clean chunks].)
                    self.chunks.mark_written(r.id, PARAM16)
                    attached_view.copy_(value.detach().to(attached_view.device))
                    written = attached_view.detach().reshape(-1)
                else:
                    with self.slots(r, (PARAM16,)) as (slot,):
                        slot.copy_(flat.to(slot.device))
                        written = slot.clone()
                if r.trainable and self.owns(r):
                    with self.slots(r, (PARAM32,)) as (master,):
                        written = written.to(master.device)
                        changed = written != master.to(written.dtype)
                        if bool(changed.any()):
                            master[changed] = written[changed].to(master.dtype)

    # Note [Offloading the engine's states]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # DeepSpeed's engine.offload_states() moves its ZeRO buffers (16-bit and
    # fp32 parameters, gradients, Adam states) to the host so that something
    # else (RLHF generation, another model's evaluation) can use the device,
    # and reload_states() brings them back. Every one of those states is a
    # chunk here, so offloading is the scheduler's own move: each chunk of
    # the lists asked for that is on the device goes to the host (an access
    # there and a release to the state its tensor had), then the device
    # budget comes down to the chunk bytes left there, which frees the
    # pooled blocks too (set_budget frees cached blocks before it evicts), so
    # the device memory the chunks held goes back: allocated (resident
    # payloads) and reserved (cached blocks) both drop. Before the moves the
    # budget is set to the bytes held then, so no move up can happen meanwhile
    # (a host short of room spills only into free device room, and there is
    # none). The lowered budget stays until reload(), which restores it and
    # moves the same chunks back to the device, in the order they left, so
    # the next step finds every chunk where it was: a copy is exact, and the
    # training that follows is the one without the offload, bit for bit. No
    # slot may be in use (COMPUTE) meanwhile: the engine settles its outside
    # reads and its overlapped CPU Adam first, and refuses a forward while
    # its states are offloaded. A host that cannot take a chunk fails the
    # offload with OutOfMemoryError; the chunks moved so far stay on the host
    # (they come back on use, or at reload) and the budget is restored.
    def offload_to_host(self, kinds) -> dict:
        """Note [Offloading the engine's states]: moves every chunk of the
        chunk lists `kinds` that is on the device to the host and frees the
        device blocks they held. Returns the chunk bytes on the device
        before and after: {"resident": (before, after), "held": (before, after)}.

        Args:
            kinds: chunk kinds (PARAM16, PARAM32, MOMENTUM, VARIANCE, GRAD32).
        """
        c = self.chunks
        before = c.stats()
        if self.offloaded is None:
            self.offloaded = Offloaded(c.budget(DEVICE))
        off = self.offloaded
        by_chunk: dict = {}
        for r in self.records:
            by_chunk.setdefault(r.chunk, []).append(r)
        c.set_budget(DEVICE, before["held_bytes_device"])
        try:
            with uncounted():
                for kind in kinds:
                    for chunk, records in sorted(by_chunk.items()):
                        if c.chunk_space(chunk, kind) != DEVICE:
                            continue
                        holders = [r for r in records if kind == PARAM16 or r.trainable]
                        if not holders:
                            continue
                        r = holders[0]
                        state = c.state(r.id, kind)
                        if state == _STATE.COMPUTE:
                            raise ValueError(f"offloading: the {KIND_NAMES[kind]} slot of "
                                             f"'{r.name}' is in use; offload between steps")
                        c.access(r.id, kind, HOST, [r.numel])
                        c.release(r.id, kind, state)
                        off.moved.append((r.id, kind, r.numel))
            c.set_budget(DEVICE, c.stats()["resident_bytes_device"])
        except BaseException:
            c.set_budget(DEVICE, max(off.budget, c.stats()["held_bytes_device"]))
            if not off.moved:
                self.offloaded = None
            raise
        after = c.stats()
        return {key: (before[f"{key}_bytes_device"], after[f"{key}_bytes_device"])
                for key in ("resident", "held")}

    def reload(self) -> int:
        """Note [Offloading the engine's states]: the device budget as it was
        before offload_to_host(), and the chunks it moved back on the device,
        in the order they left. Returns how many chunks came back (0 when
        nothing was offloaded)."""
        off, c = self.offloaded, self.chunks
        if off is None:
            return 0
        c.set_budget(DEVICE, off.budget)
        self.offloaded = None
        with uncounted():
            for tensor_id, kind, numel in off.moved:
                if c.chunk_space(c.placement(tensor_id)[0], kind) == HOST:
                    state = c.state(tensor_id, kind)
                    c.access(tensor_id, kind, DEVICE, [numel])
                    c.release(tensor_id, kind, state)
        return len(off.moved)

    def flush_warnings(self) -> None:
        """Says what registration found (e.g. tensors larger than a chunk), once."""
        pending, self._warnings = self._warnings, []
        if not pending:
            return
        message = pending[0]
        if len(pending) > 1:
            message += f" [and {len(pending) - 1} more such warning(s) for this model]"
        warnings.warn(f"tidal: {message}", stacklevel=3)

    def gather(self, record: ParamRecord, kind=PARAM32) -> torch.Tensor:
        """A host copy of one slot, shaped like the parameter (fp32 for the master).
        Data parallel: the master comes from its owner, so every rank calls
        this for the same records in the same order (a broadcast)."""
        if kind == PARAM32 and not record.trainable:
            kind = PARAM16
        if self.dp is not None and kind != PARAM16:
            owner = self.dp.owner(record.chunk)
            if self.owns(record):
                out = self._read(record, kind)
            else:
                out = torch.empty(record.shape, dtype=torch.float32)
            self.dp.broadcast(out, owner, f"broadcast the master of '{record.name}'")
            return out
        return self._read(record, kind)

    def _read(self, record: ParamRecord, kind) -> torch.Tensor:
        view = self.chunks.access(record.id, kind, HOST, record.shape)
        try:
            with uncounted():
                return view.clone()
        finally:
            self.chunks.release(record.id, kind, HOLD)
