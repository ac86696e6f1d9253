"""Training beyond host memory on the NVMe tier (issue 44's proof on the
machines we have): a GPT whose optimizer states need at least three times the
host budget trains with DeepSpeed's offload_optimizer "nvme" on the simulated
device, against the same model with enough host memory, and dd with O_DIRECT
on the same folder, in the same run.

Runs, alternating over `--rounds` rounds, each contender in a fresh process:
  * nvme: tidal with tidal.host_memory_budget = states / --host-share and
    zero_optimization.offload_optimizer {"device": "nvme", "nvme_path": DIR};
  * nvme_param: the same with offload_param "nvme" too (the 16-bit chunks may
    go to disk), where a chunk read from disk and not changed goes back
    without a write (Note [Chunks on NVMe: clean chunks]);
  * nvme_param_noskip: the same with tidal.nvme_skip_clean_writes off, so
    every chunk going to disk is written (the tier before the skip);
  * memory: the same model and data with an unlimited host budget;
  * dd: dd bs=1M oflag=direct conv=fsync, then iflag=direct, over as many
    bytes as the nvme run moves in a step, on the same folder.
Reports per step (after the first, which records the trace): seconds, disk
bytes read, written and (nvme_param) not written for being unchanged, against
the minimum (every chunk that lives on disk
between steps is read once and written once, since Adam updates every
chunk), the disk rate over the step against dd's, the host peak against the
budget, the device budget's overruns, and whether the losses equal the
in-memory run's (they must: the tier moves bytes, it computes nothing).

  python benchmarks/nvme_train.py [--dir /path/on/disk] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import budget_kept, run_child, summarize, timed_engine_steps, token_batches, write_result  # noqa: E402
from nvme_bandwidth import dd_rates  # noqa: E402


def child(payload: dict) -> dict:
    import gc
    import time
    import warnings

    import torch

    import tidal
    from tidal.models.gpt import TinyGPT

    tidal.set_device("sim", capacity=payload["device_capacity"])
    torch.manual_seed(0)
    m = payload["model"]
    model = TinyGPT(vocab=m["vocab"], d=m["d"], layers=m["layers"], heads=m["heads"], seq=m["seq"])
    n = sum(p.numel() for p in model.parameters())
    state = n * payload["bytes_per_param"]
    share = payload["param_host_share"] if payload.get("param") else payload["host_share"]
    host = 0 if payload["folder"] is None else int(state / share)
    cfg = {"gradient_clipping": 1.0, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "tidal": {"chunk_size": payload["chunk_size"], "device_memory_budget": payload["device_budget"],
                     "host_memory_budget": host}}
    if payload["folder"] is not None:
        nvme = {"device": "nvme", "nvme_path": payload["folder"]}
        cfg["zero_optimization"] = {"offload_optimizer": nvme}
        if payload.get("param"):
            cfg["zero_optimization"]["offload_param"] = nvme
        cfg["tidal"]["nvme_skip_clean_writes"] = payload.get("skip", True)
    gc.collect()
    host_before = tidal._C.host_memory_stats()["allocated"]
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = tidal.initialize(model, cfg)
    init_seconds = time.perf_counter() - t0
    # One batch again and again: the loss must fall within the few steps run.
    batches = token_batches(m["vocab"], m["seq"], m["batch"], 1) * payload["steps"]
    per_step = []
    times, losses = [], []
    for x, y in batches:
        before = engine.chunks.stats()
        t, loss = timed_engine_steps(engine, [(x, y)])
        after = engine.chunks.stats()
        times += t
        losses += loss
        per_step.append({
            "read": after["bytes_disk_to_host"] - before["bytes_disk_to_host"],
            "written": after["bytes_host_to_disk"] - before["bytes_host_to_disk"],
            "skipped": after["bytes_disk_writes_skipped"] - before["bytes_disk_writes_skipped"],
            "on_disk_after": after["resident_bytes_disk"],
            "on_disk_before": before["resident_bytes_disk"],
            "prefetch_hits": after["prefetch_hits"] - before["prefetch_hits"],
            "copy_waits": after["copy_waits"] - before["copy_waits"],
        })
    report = engine.memory_report()
    host_held = tidal._C.host_memory_stats()["peak_allocated"] - host_before
    return {"params": n, "state_bytes": state, "host_budget": host, "init_seconds": init_seconds,
            "step_seconds": times, "losses": losses, "per_step": per_step,
            "peak_chunk_host_bytes": report["peak_chunk_host_bytes"],
            "host_allocated_peak_delta": host_held,
            "budget_overruns": report["budget_overruns"], "budget_kept": budget_kept(report),
            "disk": engine.chunks.disk}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="folder on the disk (default: a temporary one)")
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--host-share", type=float, default=3.0, help="states / host budget")
    p.add_argument("--param-host-share", type=float, default=10.0,
                   help="states / host budget of the offload_param runs (10: the host holds 1.4 bytes per "
                        "parameter, less than the 16-bit list's 2)")
    p.add_argument("--chunk-size", type=int, default=4 << 20)
    p.add_argument("--device-budget", type=int, default=256 << 20)
    p.add_argument("--quick", action="store_true", help="a small model, 1 round (not tabled)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.quick:
        args.d, args.layers, args.heads, args.seq, args.vocab, args.rounds = 128, 2, 4, 32, 1024, 1
        args.chunk_size, args.device_budget = 128 << 10, 6 << 20
        args.param_host_share = min(args.param_host_share, 3.0)  # (the embedding has chunks of its own)
    model = {"vocab": args.vocab, "d": args.d, "layers": args.layers, "heads": args.heads, "seq": args.seq,
             "batch": args.batch}
    base = {"model": model, "steps": args.steps, "host_share": args.host_share,
            "param_host_share": args.param_host_share, "chunk_size": args.chunk_size,
            "device_budget": args.device_budget, "device_capacity": "64GiB", "bytes_per_param": 14}
    script = str(pathlib.Path(__file__).resolve())
    load_start = os.getloadavg()
    runs = {"nvme": [], "nvme_param": [], "nvme_param_noskip": [], "memory": []}
    dd = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for _ in range(args.rounds):
            for name, extra in (("nvme", {}), ("nvme_param", {"param": True, "skip": True}),
                                ("nvme_param_noskip", {"param": True, "skip": False})):
                run = run_child(script, {**base, "folder": tmp, **extra}, {}, timeout=3600)
                if "losses" not in run:
                    raise SystemExit(f"the {name} run failed: {run.get('why')}")
                runs[name].append(run)
            nv = runs["nvme"][-1]
            mem = run_child(script, {**base, "folder": None}, {}, timeout=3600)
            if "losses" not in mem:
                raise SystemExit(f"the in-memory run failed: {mem.get('why')}")
            runs["memory"].append(mem)
            moved = max(s["read"] for s in nv["per_step"][1:]) or (64 << 20)
            w, r = dd_rates(pathlib.Path(tmp), max(1, moved >> 20))
            dd.append({"write": (moved >> 20 << 20) / w, "read": (moved >> 20 << 20) / r})
    nv, mem = runs["nvme"][-1], runs["memory"][-1]
    every = [r for rs in runs.values() for r in rs]
    for run in every:
        if run["budget_overruns"] or not run["budget_kept"]:
            raise SystemExit(f"a run overran its device budget: {run['budget_overruns']} overruns")
    steady = lambda r, k: [s[k] for s in r["per_step"][1:]]  # noqa: E731
    nv_steps = [t for r in runs["nvme"] for t in r["step_seconds"][1:]]
    mem_steps = [t for r in runs["memory"] for t in r["step_seconds"][1:]]
    read = summarize(steady(nv, "read"))["median"]
    written = summarize(steady(nv, "written"))["median"]
    minimum = summarize(steady(nv, "on_disk_before"))["median"]
    step = summarize(nv_steps)["median"]

    def param_run(name):
        # Note [Chunks on NVMe: clean chunks]: the 16-bit list on disk too,
        # with the skip of unchanged chunks' writes on or off.
        rs = runs[name]
        steps = [t for r in rs for t in r["step_seconds"][1:]]
        per = [s for r in rs for s in r["per_step"][1:]]
        return {"step_seconds": summarize(steps),
                "disk_read_bytes_per_step": summarize([s["read"] for s in per])["median"],
                "disk_written_bytes_per_step": summarize([s["written"] for s in per])["median"],
                "disk_write_skipped_bytes_per_step": summarize([s["skipped"] for s in per])["median"],
                "disk_min_bytes_per_step_each_way": summarize([s["on_disk_before"] for s in per])["median"],
                "per_step": rs[-1]["per_step"], "losses": rs[-1]["losses"],
                "peak_chunk_host_bytes": rs[-1]["peak_chunk_host_bytes"]}

    skip, noskip = param_run("nvme_param"), param_run("nvme_param_noskip")
    param = {
        "host_budget": runs["nvme_param"][-1]["host_budget"], "states_over_host_budget": args.param_host_share,
        "skip": skip, "no_skip": noskip,
        "written_ratio_skip_to_no_skip": (skip["disk_written_bytes_per_step"] / noskip["disk_written_bytes_per_step"]
                                          if noskip["disk_written_bytes_per_step"] else None),
        "step_ratio_skip_to_no_skip": skip["step_seconds"]["median"] / noskip["step_seconds"]["median"],
        "step_ratio_skip_to_memory": skip["step_seconds"]["median"] / summarize(mem_steps)["median"],
        "paired_step_ratio_skip_to_no_skip": summarize([
            statistics.median(a["step_seconds"][1:]) / statistics.median(b["step_seconds"][1:])
            for a, b in zip(runs["nvme_param"], runs["nvme_param_noskip"])]),
    }
    result = {
        "model": {**model, "params": nv["params"], "precision": "bf16",
                  "state_bytes": nv["state_bytes"], "bytes_per_param": base["bytes_per_param"]},
        "host_budget": nv["host_budget"], "states_over_host_budget": nv["state_bytes"] / nv["host_budget"],
        "device_budget": args.device_budget, "chunk_size": args.chunk_size, "rounds": args.rounds,
        "order": "alternating: nvme, nvme_param, nvme_param_noskip, memory, dd, each round, each engine "
                 "in a fresh process",
        "nvme_step_seconds": summarize(nv_steps), "memory_step_seconds": summarize(mem_steps),
        "step_ratio_nvme_to_memory": step / summarize(mem_steps)["median"],
        "disk_read_bytes_per_step": read, "disk_written_bytes_per_step": written,
        "disk_min_bytes_per_step_each_way": minimum,
        "read_over_min": read / minimum if minimum else None,
        "written_over_min": written / minimum if minimum else None,
        "disk_rate_over_step_gb_per_s": (read + written) / step / 1e9,
        "dd_read_gb_per_s": summarize([x["read"] for x in dd])["median"] / 1e9,
        "dd_write_gb_per_s": summarize([x["write"] for x in dd])["median"] / 1e9,
        "losses_nvme": nv["losses"], "losses_memory": mem["losses"],
        "losses_equal": all(r["losses"] == mem["losses"] for r in every),
        "offload_param": param,
        "loss_fell": nv["losses"][-1] < nv["losses"][0],
        "peak_chunk_host_bytes": nv["peak_chunk_host_bytes"],
        "host_allocated_peak_delta": nv["host_allocated_peak_delta"],
        "budget_overruns": sum(r["budget_overruns"] for r in every),
        "per_step_nvme": nv["per_step"], "disk": nv["disk"],
        "init_seconds": {"nvme": nv["init_seconds"], "memory": mem["init_seconds"]},
        # The machine's 1, 5 and 15 minute load averages as the run began and ended (other jobs).
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "note": "simulated device on this machine's CPU: the step is compute on the CPU plus the "
                "simulated link's copies; the disk rate over the step is bytes moved / step time "
                "(a lower bound on the rate the I/O ran at, which overlaps compute); the minimum "
                "each way is the bytes on disk at the step's start, each read once and written "
                "once; dd moves one step's read bytes; offload_param: both lists on disk, with "
                "tidal.nvme_skip_clean_writes on (skip) and off (no_skip); every step trains on the same batch "
                "(so the loss must fall in 5 steps). Other jobs shared the machine's 2 cores.",
    }
    if not result["losses_equal"]:
        raise SystemExit(f"losses differ with NVMe: {nv['losses']} vs {mem['losses']}")
    path = write_result("nvme_train", result, args.output) if not args.quick else None
    summary = {k: result[k] for k in ("states_over_host_budget", "step_ratio_nvme_to_memory",
                                      "read_over_min", "written_over_min", "disk_rate_over_step_gb_per_s",
                                      "dd_read_gb_per_s", "dd_write_gb_per_s", "losses_equal",
                                      "loss_fell", "budget_overruns")}
    summary["offload_param"] = {k: v for k, v in param.items() if k not in ("skip", "no_skip")}
    summary["offload_param"]["written_per_step"] = {k: param[k]["disk_written_bytes_per_step"]
                                                    for k in ("skip", "no_skip")}
    summary["offload_param"]["skipped_per_step"] = param["skip"]["disk_write_skipped_bytes_per_step"]
    print(json.dumps(summary, indent=1))
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
