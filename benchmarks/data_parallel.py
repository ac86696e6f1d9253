"""Data parallel on the CPU: bytes communicated per rank per step, and step time.

  python benchmarks/data_parallel.py            # 1, 2 and 3 ranks, GPT of 3.7M params
  python benchmarks/data_parallel.py --quick    # smoke run (not tabled)

A machinery check of Note [Data parallel by chunk] (tidal/data_parallel.py),
not a GPU claim: ranks are processes on this machine talking gloo over the
loopback interface, on the simulated device, in fp32 (the "16-bit" chunks
hold fp32, 4 bytes per parameter). For each world size the same TinyGPT
trains with a fixed micro-batch per rank (weak scaling: the global batch
grows with the ranks).

Bytes per rank per step, three ways:
  * minimum: a ring reduce-scatter plus all-gather of the 16-bit model,
    2 (N-1)/N x its bytes;
  * tidal's count: what tidal's collectives send per rank under
    bandwidth-optimal algorithms ((N-1)/N of each reduce and broadcast, plus
    the small all-reduces), from engine.memory_report()["data_parallel"];
  * on the wire: the loopback interface's transmitted bytes over the
    measured steps (/proc/net/dev, every process on the machine; this
    benchmark is the only talker) divided by N: gloo's own algorithms and
    TCP framing included.

With 2 and 3 ranks it runs twice: overlap_comm on (each chunk's reduction
starts during backward, as soon as its gradients are final) and off (all at
the end of backward); the time each step's slowest rank spent blocked in
collectives is what did not overlap compute, and the part of it before
step() is the gradient reductions' (the rest is the broadcasts after the
step, which overlap nothing either way).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _lo_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def worker(spec: dict) -> None:
    import torch

    import tidal
    from tidal.models.gpt import TinyGPT

    warnings.simplefilter("ignore")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    tidal.set_device("sim", capacity="8GiB")
    torch.manual_seed(0)
    model = TinyGPT(vocab=spec["vocab"], d=spec["d"], layers=spec["layers"], heads=4, seq=spec["seq"])
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "train_micro_batch_size_per_gpu": spec["batch"],
           "tidal": {"chunk_size": spec["chunk"],
                     "data_parallel": {"enabled": True, "overlap_comm": spec["overlap"]}}}
    engine = tidal.initialize(model, cfg)
    batches = common.token_batches(spec["vocab"], spec["seq"], spec["batch"], spec["steps"], seed=rank)
    times, sent, wire, blocked, in_step = [], [], [], [], []
    for i, (x, y) in enumerate(batches):
        torch.distributed.barrier()
        lo0, sent0, blocked0 = _lo_tx_bytes(), engine.dp.bytes_sent, engine.dp.seconds_blocked
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        before_step = engine.dp.seconds_blocked
        engine.step()
        times.append(time.perf_counter() - t0)
        blocked.append(engine.dp.seconds_blocked - blocked0)
        in_step.append(engine.dp.seconds_blocked - before_step)
        torch.distributed.barrier()
        # (The barriers' own bytes count on the wire: a few hundred.)
        wire.append((_lo_tx_bytes() - lo0) / world)
        sent.append(engine.dp.bytes_sent - sent0)
    warm = spec["warmup"]
    params16 = sum(r.numel for r in engine.records) * (torch.finfo(engine.dtype).bits // 8)
    mine = {"rank": rank, "step_s": times[warm:], "sent": sent[warm:], "wire": wire[warm:],
            "blocked_s": blocked[warm:], "blocked_in_step_s": in_step[warm:],
            "params": sum(r.numel for r in engine.records), "param16_bytes": params16,
            "chunks_owned": len(engine.memory_report()["data_parallel"]["owned_chunks"]),
            "chunks": engine.chunks.num_chunks}
    out = [None] * world
    torch.distributed.all_gather_object(out, mine)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(out, f)


def run_world(world: int, spec: dict, tmp: str) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = dict(spec, out=os.path.join(tmp, f"dp-{world}-{spec['overlap']}.json"))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"world {world}: ranks exited with {codes}")
    with open(spec["out"]) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_gpt_model_args(ap)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1 << 20, help="chunk bytes")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    import tempfile
    spec = {"d": args.d, "layers": args.layers, "seq": args.seq, "batch": args.batch,
            "vocab": args.vocab, "chunk": args.chunk, "steps": args.steps, "warmup": 2}
    if args.quick:
        spec.update(d=64, layers=2, vocab=256, seq=16, batch=2, chunk=65536, steps=4, warmup=1)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2, 3):
            for overlap in (True, False) if world > 1 else (True,):
                ranks = run_world(world, dict(spec, overlap=overlap), tmp)
                p16 = ranks[0]["param16_bytes"]
                minimum = 2 * (world - 1) / world * p16
                sent = [sum(r["sent"]) / len(r["sent"]) for r in ranks]
                wire = sum(ranks[0]["wire"]) / len(ranks[0]["wire"])
                steps = range(len(ranks[0]["step_s"]))
                step = common.summarize(max(r["step_s"][i] for r in ranks) for i in steps)
                blocked = common.summarize(max(r["blocked_s"][i] for r in ranks) for i in steps)
                # (The same slowest rank's share before step(): the reductions.)
                slowest = [max(ranks, key=lambda r: r["blocked_s"][i]) for i in steps]
                backward = common.summarize(s["blocked_s"][i] - s["blocked_in_step_s"][i]
                                            for i, s in zip(steps, slowest))
                runs[str(world) if overlap else f"{world}-no-overlap"] = {
                    "world_size": world, "overlap_comm": overlap, "global_batch": world * spec["batch"],
                    "step_s": step,
                    "seconds_in_collectives_per_step": blocked,
                    "seconds_in_collectives_before_step": backward,
                    "tokens_per_s": world * spec["batch"] * spec["seq"] / step["median"],
                    "minimum_bytes_per_rank_step": minimum,
                    "tidal_bytes_per_rank_step": sent,
                    "wire_bytes_per_rank_step": wire,
                    "tidal_over_minimum": (sum(sent) / len(sent)) / minimum if minimum else None,
                    "wire_over_minimum": wire / minimum if minimum else None,
                    "chunks_owned": [r["chunks_owned"] for r in ranks], "chunks": ranks[0]["chunks"],
                }
                print(f"{world} rank(s), overlap_comm {overlap}: step {step['median'] * 1e3:.0f} ms "
                      f"({blocked['median'] * 1e3:.0f} ms in collectives, "
                      f"{backward['median'] * 1e3:.0f} ms of them before step()), per rank per step: "
                      f"minimum {minimum / 2**20:.2f} MiB, tidal {sum(sent) / len(sent) / 2**20:.2f} "
                      f"MiB, wire {wire / 2**20:.2f} MiB", flush=True)
    payload = {"quick": args.quick, "model": {"params": ranks[0]["params"], "param16_bytes": p16,
                                              **{k: spec[k] for k in ("d", "layers", "seq", "vocab", "batch", "chunk")}},
               "precision": "fp32", "backend": "gloo over loopback, simulated device", "runs": runs,
               "note": "weak scaling (micro-batch per rank fixed); 2 cores shared by all ranks, "
                       "so step time grows with the ranks and the communication thread competes "
                       "with compute: a machinery check, not a GPU claim"}
    path = common.write_result("data_parallel-quick" if args.quick else "data_parallel", payload,
                               args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
