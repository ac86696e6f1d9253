"""One rank of a data-parallel test run (tests/python/test_data_parallel.py).

Launched N times with torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE); tidal.initialize finds WORLD_SIZE and makes the process group
itself. Trains TinyGPT on the simulated device over a fixed list of global
batches: rank r takes its slice of each. Rank 0 writes, to the spec's "out":
the global mean loss of each micro-batch (averaged over the ranks), the global
gradient norm of each step (engine.get_global_grad_norm()), the fp32 weights
(engine.state_dict(), gathered from the owners) and each rank's memory figures.

The spec (JSON in argv[1]): steps, global_batch, accumulation, clip, budget
("measured" or bytes), width, save (dir, after step k), load (dir),
start (first batch index), kill (rank, step: that rank kills itself in
backward), redo (at that batch: backward, zero_grad, forward and backward
again, as a loop that drops a micro-batch), model_seed and width_of (per-rank overrides that make the models
differ), overlap (tidal.data_parallel.overlap_comm), precision ("bf16" or
"fp16", with scale_power), unused (rank, param: that rank's backward never
reaches the parameter; "all": no rank's does), overlap_step (tidal.overlap_step;
absent: the default), factors (step i's loss times factors[i % len]).
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tidal  # noqa: E402
from engine_helpers import gpt_batches, measured_budget, within_budget  # noqa: E402
from engine_reference import LR  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


def config(spec, budget):
    cfg = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "gradient_accumulation_steps": spec.get("accumulation", 1),
           "tidal": {"chunk_size": 16384, "device_memory_budget": budget, "device_margin": 1024,
                     "data_parallel": {"enabled": True, "timeout": spec.get("timeout", 120),
                                       "overlap_comm": spec.get("overlap", True)}}}
    if spec.get("clip"):
        cfg["gradient_clipping"] = spec["clip"]
    if spec.get("nvme"):
        cfg["zero_optimization"] = {"offload_optimizer": {"device": "nvme", "nvme_path": spec["nvme"]}}
        cfg["tidal"]["host_memory_budget"] = spec["host_budget"]
    if "overlap_step" in spec:
        cfg["tidal"]["overlap_step"] = spec["overlap_step"]
    if spec.get("precision"):
        cfg[spec["precision"]] = {"enabled": True}
        if spec["precision"] == "fp16":
            cfg["fp16"].update(initial_scale_power=spec.get("scale_power", 8), hysteresis=1)
    return cfg


def model_of(spec, rank):
    torch.manual_seed(spec.get("model_seed", {}).get(str(rank), 0))
    return TinyGPT(d=spec.get("width_of", {}).get(str(rank), spec.get("width", 64)), seq=8)


def main():
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    tidal.set_device("sim", capacity="1GiB")
    accumulation = spec.get("accumulation", 1)
    steps = spec["steps"]
    gb = spec["global_batch"]
    assert gb % world == 0, (gb, world)
    micro = gb // world
    batches = gpt_batches(steps * accumulation + spec.get("start", 0), batch=gb, seed=3)
    batches = batches[spec.get("start", 0):]
    budget = spec.get("budget", "measured")
    if budget == "measured":
        probe = config(spec, 0)
        probe["tidal"]["data_parallel"] = {"enabled": False}
        probe.pop("zero_optimization", None)
        probe["tidal"].pop("host_memory_budget", None)
        budget = measured_budget(model_of(spec, rank), probe,
                                 [(x[:micro], y[:micro]) for x, y in batches[:2]])
    engine = tidal.initialize(model_of(spec, rank), config(spec, budget))
    assert engine.dp is not None and engine.dp.world == world
    if spec.get("load"):
        path, _ = engine.load_checkpoint(spec["load"])
        assert path is not None
    unused = spec.get("unused")
    if unused and unused["rank"] in ("all", rank):
        # This rank's backward never reaches that parameter.
        dict(engine.module.named_parameters())[unused["param"]].requires_grad_(False)
    kill = spec.get("kill")
    grad_read = None
    losses, norms = [], []
    started = time.time()
    for i, (x, y) in enumerate(batches):
        xs, ys = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
        loss = engine(xs, ys)
        if kill and rank == kill["rank"] and i == kill["step"]:
            # Dies in the middle of backward, without a word to the others.
            loss.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        factors = spec.get("factors")
        engine.backward(loss * factors[i % len(factors)] if factors else loss)
        if i == spec.get("redo"):
            engine.zero_grad()
            loss = engine(xs, ys)
            engine.backward(loss)
        if spec.get("read_grad") == i:
            # A script's p.grad between backward and step (a rank's slot holds
            # its own gradient until the reduction): refused by name.
            name, p = next((n, q) for n, q in engine.module.named_parameters() if q.requires_grad)
            try:
                _ = p.grad
                grad_read = {"param": name, "refused": None}
            except tidal.UsageError as e:
                grad_read = {"param": name, "refused": str(e)}
        steps = engine.global_steps
        engine.step()
        if engine.global_steps > steps:
            norms.append(engine.get_global_grad_norm())
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        if spec.get("save") and engine.global_steps == spec["save"]["after"] and \
                engine.is_gradient_accumulation_boundary():
            engine.save_checkpoint(spec["save"]["dir"], tag="ckpt")
    weights = {k: v.tolist() for k, v in engine.state_dict().items()}
    within_budget(engine)  # every rank: no overrun, the peak within its budget
    report = engine.memory_report()
    mine = {"rank": rank, "evictions": report["evictions"], "prefetches": report["prefetches"],
            "optimizer_state_bytes": optimizer_state_bytes(engine),
            "data_parallel": report["data_parallel"], "seconds": time.time() - started,
            "skipped_steps": report["skipped_steps"], "loss_scale": report["loss_scale"],
            "optimizer": report["optimizer"],
            "weights_crc": weights_crc(engine), "grad_read": grad_read,
            "nvme_chunks_written": (report["nvme"] or {}).get("chunks_written", 0)}
    reports = [None] * world
    torch.distributed.all_gather_object(reports, mine)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"losses": losses, "norms": norms, "weights": weights,
                                                 "reports": reports, "steps": engine.global_steps}))
    torch.distributed.barrier()


def weights_crc(engine):
    """CRC-32 of this rank's 16-bit weights: the ranks' copies must agree."""
    import zlib

    from tidal.engine.store import HOLD, HOST, PARAM16
    crc, c = 0, engine.chunks
    with torch.no_grad():
        for r in engine.records:
            view = c.access(r.id, PARAM16, HOST, [r.numel])
            try:
                crc = zlib.crc32(view.view(torch.uint8).numpy().tobytes(), crc)
            finally:
                c.release(r.id, PARAM16, HOLD)
    return crc


def optimizer_state_bytes(engine):
    """Bytes of fp32 master, momentum and variance chunks this rank holds."""
    from tidal._C.chunks import ChunkKind, MemorySpace
    c = engine.chunks
    return sum(c.chunk_capacity_bytes(i, k) for i in range(c.num_chunks)
               for k in (ChunkKind.PARAM32, ChunkKind.MOMENTUM, ChunkKind.VARIANCE)
               if c.chunk_space(i, k) != MemorySpace.NONE)


if __name__ == "__main__":
    main()
