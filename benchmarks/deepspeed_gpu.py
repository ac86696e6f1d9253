"""DeepSpeed ZeRO-Offload, the peer of tidal on a GPU (issue 14, phase 5).

The same GPT (tidal.models.gpt.TinyGPT), the same synthetic data, bf16, AdamW
with tidal-train's hyperparameters, on one GPU:
  zero2: ZeRO-2 + offload_optimizer to the CPU (DeepSpeedCPUAdam, JIT-built)
  zero3: ZeRO-3 + offload_param and offload_optimizer to the CPU, the model
         built under deepspeed.zero.Init (partitioned as it is created)
For each stage the shapes are tried smallest first until one fails: the first
gives tokens/s next to tidal's (engine-<machine>.json, same shape and batch),
the last that trains is the largest DeepSpeed trains here. Every run is its own
process (engine_gpu.child); a failure is recorded with its error.

    python benchmarks/deepspeed_gpu.py [--shapes gpt-1.3b,gpt-6.7b,gpt-13b] [--stages 2,3]
    python benchmarks/deepspeed_gpu.py --quick     # tiny GPT on the CPU (gloo), seconds

Writes benchmarks/results/deepspeed-<machine>.json (deepspeed-quick-... with
--quick). When deepspeed cannot be imported the file says why (the import
error) and the script exits 1. scripts/fetch_gpu_wheels.sh makes the wheel that
scripts/gpu_run.sh installs on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import engine_gpu  # noqa: E402  -- the shapes, the FLOP counts and the child-process runner

HERE = os.path.abspath(__file__)


def ds_config(stage, batch, cuda):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": cuda}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer(args):
    """One DeepSpeed run in this process."""
    import faulthandler
    faulthandler.enable()
    import torch
    cuda = torch.cuda.is_available() and not args.quick
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                 ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import deepspeed
    from tidal.data import synthetic_batches
    from tidal.models.gpt import TinyGPT
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    layers, d, heads, seq, vocab = engine_gpu.shape_of(args.shape)
    cfg = ds_config(args.stage, args.batch, cuda)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if args.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="cpu", pin_memory=cuda):
            model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=seq)
        n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    else:
        model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=seq)
        n = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    build_s = time.perf_counter() - t0
    dev = engine.device
    data = synthetic_batches(vocab, seq, args.batch, dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(args.steps):
        x, y = next(data)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    steady = times[2:] or times
    tok_s = args.batch * seq * len(steady) / sum(steady)
    return {"peer": f"deepspeed_zero{args.stage}", "deepspeed": deepspeed.__version__, "shape": args.shape,
            "params": n, "micro_batch": args.batch, "seq": seq, "device": str(dev), "build_seconds": build_s,
            "step_seconds": times, "losses": losses, "first_loss": losses[0], "last_loss": losses[-1],
            "tokens_per_s": tok_s, "tflops": 6 * n * tok_s / 1e12,
            "tflops_with_attention": (6 * n + engine_gpu.attn_flops_per_token(args.shape, seq)) * tok_s / 1e12,
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "zero_config": cfg["zero_optimization"]}


def _clear_stale_locks():
    """torch.utils.cpp_extension leaves `lock` in an op's build folder when its process is
    killed mid-build (a timed-out run), and the next run then waits on it forever. The runs
    here are sequential, so between two of them any lock under TORCH_EXTENSIONS_DIR (set
    by gpu_run.sh to a folder of its own) is stale."""
    d = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not d:
        return
    for root, _, files in os.walk(d):
        if "lock" in files:
            os.unlink(os.path.join(root, "lock"))
            print(f"[deepspeed_gpu] removed a stale build lock in {root}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny GPT on the CPU (proves the script runs)")
    ap.add_argument("--shapes", default=None, help="comma-separated, smallest first "
                                                    "(default gpt-1.3b,gpt-6.7b,gpt-13b; --quick: nano)")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="micro batch (default 8, as engine_gpu bench)")
    ap.add_argument("--timeout", type=float, default=400, help="seconds per run")
    ap.add_argument("--time-limit", type=float, default=540, help="start no run after this many seconds")
    ap.add_argument("--output", default=None)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 6)
    args.batch = args.batch or (2 if args.quick else 8)
    if args.peer:
        r = peer(args)
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
        return 0

    name = "deepspeed-quick" if args.quick else "deepspeed"
    result = {"quick": args.quick, "steps": args.steps, "micro_batch": args.batch, "runs": []}
    try:
        import deepspeed
        result["deepspeed"] = deepspeed.__version__
    except Exception as e:  # noqa: BLE001 -- any import failure is the reason it cannot run
        result["available"] = False
        result["why_not"] = f"import deepspeed failed: {type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        path = common.write_result(name, result, output=engine_gpu.result_path(name, args.output))
        print(f"[deepspeed_gpu] {result['why_not']}; wrote {path}", flush=True)
        return 1
    result["available"] = True
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    shapes = (args.shapes or ("nano" if args.quick else "gpt-1.3b,gpt-6.7b,gpt-13b")).split(",")
    deadline = time.monotonic() + args.time_limit
    result["largest"] = {}
    for stage in (int(s) for s in args.stages.split(",")):
        for s in shapes:
            left = deadline - time.monotonic()
            if left < 30:
                result.setdefault("stopped", []).append(f"zero{stage} {s}: time limit ({left:.0f} s left)")
                break
            _clear_stale_locks()
            argv_ = [sys.executable, HERE, "--peer", "--json", "{json}", "--shape", s, "--stage", str(stage),
                     "--steps", str(args.steps), "--batch", str(args.batch)] + (["--quick"] if args.quick else [])
            rec = engine_gpu.child(f"zero{stage} {s}", argv_, min(args.timeout, left), log_dir=args.log_dir)
            rec.update(stage=stage, shape=s)
            if rec["ok"]:
                rep = rec["report"]
                rec["trained"] = rep["last_loss"] < rep["first_loss"]
                if rec["trained"]:
                    result["largest"][f"zero{stage}"] = {"shape": s, "params": rep["params"],
                                                        "tokens_per_s": rep["tokens_per_s"], "tflops": rep["tflops"]}
            else:
                rec["trained"] = False
            result["runs"].append(rec)
            common.write_result(name, result, output=engine_gpu.result_path(name, args.output))
            if not rec["trained"]:
                break
    path = common.write_result(name, result, output=engine_gpu.result_path(name, args.output))
    print(f"[deepspeed_gpu] wrote {path}: largest {json.dumps(result['largest'])}", flush=True)
    return 0 if all(r["ok"] for r in result["runs"]) and result["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
