"""Data-parallel training over torch.distributed, partitioned by chunk.

Note [Data parallel by chunk]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank runs the whole model on its own micro-batches. The optimizer
states are partitioned by chunk, as PatrickStar does: chunk c (its fp32
master, momentum and variance chunks; the gradient-sum chunk under
accumulation) lives on one rank only, its *owner*: the rank that owned the
fewest bytes when c's first tensor registered (DataParallel.assign). The 16-bit parameter
chunks are NOT partitioned: every rank keeps all of them.

Why not partition the 16-bit chunks too (ZeRO-3)? tidal already keeps only
the chunks a module needs on the device, and the host holds the rest. On
one machine the host memory is what limits the model: per parameter a rank
holds 2 bytes (16-bit) + 12/N bytes (master, m, v) instead of 14, so two
ranks fit 1.75x the model of one rank's host share, four ranks 2.8x, and
partitioning the 16-bit chunks as well would reach 14/N at the price of
an all-gather of every chunk before each use, forward and backward (3x the
communication of this design: 2 x 2 bytes per parameter gathered per step
against 2 bytes reduced + 2 gathered), which over PCIe or Ethernet costs
more than the host memory it saves. Per step and rank this design moves
the ring minimum of a reduce-scatter plus an all-gather of the 16-bit
model: 2 (N-1)/N x 2 bytes per parameter (benchmarks/data_parallel.py
counts it).

A step, with gradients in the 16-bit slots (Note [Gradient sums in chunks]):
  1. backward lands each gradient in its 16-bit slot, as on one process;
  2. each chunk's gradients are reduced (summed) into its owner and divided
     by N there, then copied back into the owner's slots. With overlap_comm
     (the default) a chunk's reduction starts during backward, as soon as
     every trainable parameter in it has landed its gradient (a second
     post-accumulate-grad hook, ChunkDataParallel.grad_ready in
     tidal/engine/chunk_data_parallel.py), while autograd goes
     on with the layers below; at most IN_FLIGHT run at once. The
     ranks must issue their collectives in the same order with the same
     sizes, whatever order their chunks become final in: every rank reduces
     every chunk holding a trainable parameter once per backward, in one
     fixed order (the last chunk first: the order backward reaches them
     when the modules registered in the order forward runs them); a chunk
     waits for the ones before it, and the chunks not final by the end of
     backward go then (ChunkDataParallel.after_backward). A trainable parameter
     that never gets a gradient holds back every chunk after it (a warning
     names it), and a parameter that gets a second gradient after its
     chunk's reduction started (reentrant checkpointing) is an error. The buffer of a chunk
     packs its trainable parameters' slots (frozen weights and padding
     never travel); a parameter without a gradient on this rank sends
     zeros, so the sizes always match. After the reductions one all-reduce
     of flags checks that every rank landed the same parameters (a
     parameter with a gradient on some ranks only is an error, as in DDP
     without find_unused_parameters, and cannot hang the reductions before
     it). On CUDA with NCCL the reductions would run on NCCL's own stream,
     the side stream, and the compute stream wait for them at the
     write-back (not run yet: no GPU so far);
  3. under gradient accumulation the owner folds the reduced gradients into
     its fp32 sums and gets its weights back from the master, and the
     owners broadcast their chunks, so every rank has its weights for the
     next micro-batch, whether step() or zero_grad() comes next (at the
     accumulation boundary the step broadcasts them again: one broadcast
     per step more than needed); otherwise the slots keep the gradients
     until step();
  4. step(): the global gradient norm is one all-reduce of each owner's sum
     of squares (clipping and the fp16 overflow check use it); the ranks
     walk the chunks in one order, each owner running Adam on its chunk and
     then starting the broadcast of the chunk's 16-bit values (the
     all-gather), so a chunk's broadcast runs while its owner updates the
     next chunks it owns; the other ranks receive into a buffer and copy it
     into their chunk when it arrives (ChunkDataParallel.share). With
     tidal.overlap_step (the default) an owner starts a chunk's CPU Adam as
     soon as the chunk's reduction has landed in step 2 (the sum over the
     ranks is final then), during backward with overlap_comm; the step
     validates it on the global norm and still broadcasts every chunk in
     the one order (Note [CPU Adam during backward] in
     tidal/engine/overlap.py; not under accumulation).
Reductions run in the parameters' dtype, as DeepSpeed's do.

Not done: the broadcasts after the step are all waited for before step()
returns (they could overlap the next forward, each chunk waited for before
its first use); the first-use relayout is skipped (it would move records
between owners); DTR under the engine is refused with data parallel (a
recompute in backward may need the master of a chunk this rank does not
own).

Faults: tidal's collectives run on a process group of their own, made with
the config's timeout, so a rank that hangs makes the others fail after at
most that long. Each rank also beats a heartbeat into the process group's
store; when a collective fails (a peer died: its sockets closed) the error
names the ranks whose heartbeat stopped.
"""
from __future__ import annotations

import atexit
import datetime
import hashlib
import json
import os
import threading
import time

import torch

from ._schema import ConfigError, Rule, check_block, fail

SCHEMA = {
    "enabled": (Rule('true, false or "auto"', lambda v: v in (True, False, "auto")), "auto",
                "data parallel over torch.distributed; \"auto\": on when a process group is "
                "initialized or torchrun's WORLD_SIZE is set"),
    "timeout": (Rule("seconds > 0", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                     and v > 0), 600, "seconds a collective may wait for the other ranks before "
                                      "the run fails"),
    "backend": (("auto", "gloo", "nccl"), "auto", "process group of tidal's collectives: auto = "
                                                  "nccl on CUDA, else gloo"),
    "overlap_comm": (Rule("true or false", lambda v: isinstance(v, bool)), True,
                     "reduce each chunk's gradients as soon as they are final during backward, "
                     "overlapped with the rest of backward (false: all at the end of backward)"),
}

# Chunk reductions (during backward) or broadcasts (during the step) in
# flight at once; each holds a copy of one chunk's 16-bit values, so at most
# this many chunks of extra memory.
IN_FLIGHT = 2

_HEARTBEAT_S = 0.5


class DataParallelError(RuntimeError):
    """A data-parallel run cannot go on: another rank died, hung or disagrees."""


def validate_config(block: dict) -> dict:
    """The tidal.data_parallel block with defaults filled in."""
    given = check_block("tidal.data_parallel", SCHEMA, block, "section 'tidal.data_parallel'")
    return {key: given.get(key, spec[1]) for key, spec in SCHEMA.items()}


def wanted(block: dict) -> bool:
    """Whether this process trains data-parallel under `block` (validated)."""
    import torch.distributed as dist
    enabled = block.get("enabled", "auto")
    if enabled is False:
        return False
    if enabled is True:
        return True
    if dist.is_available() and dist.is_initialized():
        return True
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def world_size(block: dict) -> int:
    """The number of ranks this process trains with under `block` (1 when
    not data-parallel): DeepSpeed's train_batch_size counts all of them."""
    if not wanted(block):
        return 1
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


class DataParallel:
    """tidal's collectives for one ParamStore: ownership, reductions, broadcasts."""

    def __init__(self, block: dict, cuda: bool):
        import torch.distributed as dist
        if not dist.is_available():
            raise ConfigError("config key 'tidal.data_parallel.enabled': data parallel needs "
                              "torch.distributed, which this torch build lacks")
        self.dist = dist
        timeout = datetime.timedelta(seconds=float(block["timeout"]))
        self.timeout_s = float(block["timeout"])
        backend = block["backend"]
        if backend == "auto":
            backend = "nccl" if cuda else "gloo"
        if backend == "nccl" and not cuda:
            fail("tidal.data_parallel.backend", "nccl needs the CUDA device; the simulated "
                                                "device's chunks are host memory: use gloo")
        self._made_default = False
        if not dist.is_initialized():
            if "MASTER_ADDR" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
                raise ConfigError(
                    "config key 'tidal.data_parallel.enabled': data parallel is on but no "
                    "torch.distributed process group is initialized and the environment has no "
                    "MASTER_ADDR/RANK/WORLD_SIZE; launch with torchrun, or call "
                    "torch.distributed.init_process_group first")
            dist.init_process_group(backend=backend, timeout=timeout)
            self._made_default = True
        # Registered before anything below can fail: the groups are destroyed
        # at exit whatever happens next.
        self.group = None
        self._stop = threading.Event()
        self._beat_thread = None
        atexit.register(self.close)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.backend = backend
        self.overlap = bool(block["overlap_comm"])
        # NCCL reduces device tensors only: small host tensors go through it.
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")
        # tidal's own group: its backend and its timeout, whatever the user's is.
        self.group = dist.new_group(backend=backend, timeout=timeout)
        self._owners: dict[int, int] = {}
        self._owned_bytes = [0] * self.world
        # Bytes this rank sends, on average over the ranks, when each
        # collective runs a bandwidth-optimal (ring or pipelined) algorithm:
        # (N-1)/N of the tensor per reduce or broadcast. The wire count of
        # the backend's own algorithms is measured by benchmarks/data_parallel.py.
        self.bytes_sent = 0
        self.collectives = 0
        # Seconds the training thread spent in collectives (waiting for them
        # or starting them): the communication that did not overlap compute.
        self.seconds_blocked = 0.0
        self._store = None
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 -- a private accessor; naming lost ranks is a bonus
            self._store = None
        self._beat_prefix = None
        if self._store is not None:
            # A run id per process group: reruns with the same store never
            # read an old run's beats.
            run = [f"{time.time_ns()}-{os.getpid()}"] if self.rank == 0 else [None]
            self._call("agree on a run id", lambda: dist.broadcast_object_list(run, src=0,
                                                                                 group=self.group))
            self._beat_prefix = f"tidal_dp/{run[0]}/beat/"
            self._beat()
            self._beat_thread = threading.Thread(target=self._beats, name="tidal-dp-heartbeat",
                                                 daemon=True)
            self._beat_thread.start()

    # ------------------------------------------------------------ faults
    def _beat(self) -> None:
        self._store.set(self._beat_prefix + str(self.rank), repr(time.time()))

    def _beats(self) -> None:
        while not self._stop.wait(_HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 -- the store is gone: the run is ending
                return

    def _silent_ranks(self) -> list[tuple[int, float]]:
        """Ranks whose heartbeat is older than four beats, waiting a little for
        a dead peer's beat to age: (rank, seconds since its last beat)."""
        if self._store is None:
            return []
        deadline = time.time() + 8 * _HEARTBEAT_S
        while True:
            now, silent = time.time(), []
            for r in range(self.world):
                if r == self.rank:
                    continue
                try:
                    self._store.wait([self._beat_prefix + str(r)], datetime.timedelta(seconds=1))
                    age = now - float(self._store.get(self._beat_prefix + str(r)).decode())
                except Exception:  # noqa: BLE001 -- a store that is gone: no names
                    return []
                if age > 4 * _HEARTBEAT_S:
                    silent.append((r, age))
            if silent or time.time() > deadline:
                return silent
            time.sleep(_HEARTBEAT_S)

    def _call(self, what: str, fn):
        """Runs collective `fn`; a failure becomes a DataParallelError naming
        the ranks that stopped beating."""
        self.collectives += 1
        started = time.perf_counter()
        try:
            return fn()
        except DataParallelError:
            raise
        except Exception as e:  # noqa: BLE001 -- gloo and NCCL raise RuntimeError and others
            silent = self._silent_ranks()
            if silent:
                who = ", ".join(f"rank {r} (no heartbeat for {age:.1f} s)" for r, age in silent)
                cause = f"lost {who}"
            else:
                cause = ("no rank stopped beating: one raised or hangs, or the network failed "
                         f"(timeout {self.timeout_s:g} s, config key 'tidal.data_parallel.timeout')")
            raise DataParallelError(
                f"tidal data parallel: rank {self.rank} of {self.world} could not {what}: {cause}. "
                f"The run stops; resume from the last checkpoint. ({type(e).__name__}: {e})") from e
        finally:
            self.seconds_blocked += time.perf_counter() - started

    def close(self) -> None:
        """At exit, while the interpreter is whole: stops the heartbeat and
        waits for its thread (a daemon thread inside a store call when the
        interpreter goes can abort the process), and destroys tidal's process
        group and the default one if tidal made it. A gloo group left to the
        interpreter's teardown can abort the process too ("terminate called
        without an active exception": its worker threads still hold finished
        work whose tensors need the GIL, pytorch/pytorch#190489)."""
        self._stop.set()
        if self._beat_thread is not None and self._beat_thread is not threading.current_thread():
            self._beat_thread.join(timeout=5)
        dist = self.dist
        try:
            if dist.is_initialized() and self.group is not None:
                dist.destroy_process_group(self.group)
            if self._made_default and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 -- the user destroyed the groups first
            pass
        self.group = None

    # --------------------------------------------------------- ownership
    def assign(self, chunk: int, nbytes: int) -> int:
        """The owner of `chunk` (of `nbytes` per chunk list), chosen when its
        first tensor registers: the rank owning the fewest bytes so far (the
        lowest on ties). Every rank registers the same tensors in the same
        order, so every rank makes the same choices; the most a rank owns is
        within one chunk of 1/N."""
        owner = self._owners.get(chunk)
        if owner is None:
            owner = min(range(self.world), key=lambda r: (self._owned_bytes[r], r))
            self._owners[chunk] = owner
            self._owned_bytes[owner] += nbytes
        return owner

    def owner(self, chunk: int) -> int:
        return self._owners[chunk]

    def owns(self, chunk: int) -> bool:
        return self._owners[chunk] == self.rank

    # ------------------------------------------------------------ checks
    def check_same(self, what: dict) -> None:
        """Raises DataParallelError when another rank's `what` (the config, the
        model's parameters) differs from this rank's, naming the first key."""
        digest = {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()
                  for k, v in what.items()}
        gathered = [None] * self.world
        self._call("compare configs and models",
                   lambda: self.dist.all_gather_object(gathered, digest, group=self.group))
        for r, theirs in enumerate(gathered):
            for k in digest:
                if theirs.get(k) != digest[k]:
                    raise DataParallelError(
                        f"tidal data parallel: {k}: rank {r} differs from rank {self.rank}; "
                        f"every rank must build the same model with the same config")

    # ------------------------------------------------------- collectives
    def _run(self, t: torch.Tensor, what: str, op) -> torch.Tensor:
        """op(tensor) on this backend's device; `t` gets the result."""
        if t.device == self.device:
            self._call(what, lambda: op(t))
            return t
        moved = t.to(self.device)
        self._call(what, lambda: op(moved))
        t.copy_(moved)
        return t

    def all_reduce_sum(self, values: list[float], what: str) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self.bytes_sent += t.numel() * t.element_size()
        return self._run(t, what, lambda x: self.dist.all_reduce(x, group=self.group)).tolist()

    def all_reduce_flags(self, flags: torch.Tensor, what: str) -> torch.Tensor:
        self.bytes_sent += flags.numel() * flags.element_size()
        return self._run(flags, what, lambda x: self.dist.all_reduce(x, group=self.group))

    def reduce_async(self, t: torch.Tensor, owner: int, what: str):
        """Starts summing `t` into rank `owner`'s `t` (on this backend's
        device); returns the handle wait() takes. `t` must stay untouched
        until then."""
        assert t.device == self.device, (t.device, self.device)
        self.bytes_sent += t.numel() * t.element_size() * (self.world - 1) // self.world
        return self._call(what, lambda: self.dist.reduce(t, dst=owner, group=self.group,
                                                         async_op=True))

    def broadcast_async(self, t: torch.Tensor, owner: int, what: str):
        """Starts sending `t` from rank `owner` into every rank's `t` (on this
        backend's device); returns the handle wait() takes."""
        assert t.device == self.device, (t.device, self.device)
        self.bytes_sent += t.numel() * t.element_size() * (self.world - 1) // self.world
        return self._call(what, lambda: self.dist.broadcast(t, src=owner, group=self.group,
                                                            async_op=True))

    def wait(self, work, what: str) -> None:
        """Waits for a collective reduce_async or broadcast_async started (its
        failures named as the blocking collectives' are)."""
        self.collectives -= 1  # (counted when it started)
        self._call(what, work.wait)

    def broadcast(self, t: torch.Tensor, owner: int, what: str) -> None:
        self.bytes_sent += t.numel() * t.element_size() * (self.world - 1) // self.world
        self._run(t, what, lambda x: self.dist.broadcast(x, src=owner, group=self.group))

    def broadcast_object(self, obj, src: int, what: str):
        box = [obj]
        self._call(what, lambda: self.dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]

    def all_gather_object(self, obj, what: str) -> list:
        out = [None] * self.world
        self._call(what, lambda: self.dist.all_gather_object(out, obj, group=self.group))
        return out
