"""The engine on a GPU: plain PyTorch vs tidal on a GPT in the same run, then
the largest GPT tried, with host/device memory against the
(host + device) / 14-byte limit. Writes benchmarks/results/engine-<machine>.json.

    python benchmarks/engine_gpu.py [--large gpt-4b] [--steps 6]
"""
import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import tidal  # noqa: E402
from tidal import train as ttrain  # noqa: E402
from tidal.data import synthetic_batches  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


def plain(preset, steps, batch):
    layers, d, heads, seq, vocab = ttrain.PRESETS[preset]
    n = ttrain.ModelShape(layers, d, heads, seq, vocab).params()
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
    data = synthetic_batches(vocab, seq, batch, "cuda")
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        x, y = next(data)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    steady = times[2:]
    out = {"preset": preset, "params": n, "micro_batch": batch, "seq": seq,
           "tokens_per_s": batch * seq * len(steady) / sum(steady),
           "tflops": 6 * n * batch * seq * len(steady) / sum(steady) / 1e12,
           "peak_device_bytes": torch.cuda.max_memory_allocated(),
           "first_loss": losses[0], "last_loss": losses[-1]}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-1.3b")
    ap.add_argument("--large", default="gpt-4b")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    result = {"machine": common.machine_info(), "commit": common.git_commit(), "runs": []}
    name = "engine"

    def save():
        common.write_result(name, result)

    def attempt(label, fn):
        t = time.perf_counter()
        try:
            r = fn()
            r["label"] = label
            r["wall_s"] = time.perf_counter() - t
            result["runs"].append(r)
            print(f"[engine_gpu] {label}: {json.dumps(r)}", flush=True)
        except Exception as e:  # noqa: BLE001 -- record the failure, go on
            traceback.print_exc()
            result["runs"].append({"label": label, "error": f"{type(e).__name__}: {e}"[:2000]})
        save()
        gc.collect()
        torch.cuda.empty_cache()

    def tidal_run(preset, budget=None):
        argv = ["--preset", preset, "--steps", str(args.steps), "--batch", str(args.batch),
                "--data", "synthetic", "--no-progress"]
        if budget:
            argv += ["--budget", budget]
        r = ttrain.run(argv)
        r["budget"] = budget
        return r

    attempt(f"plain {args.preset}", lambda: plain(args.preset, args.steps, args.batch))
    attempt(f"tidal {args.preset} (whole GPU)", lambda: tidal_run(args.preset))
    attempt(f"tidal {args.preset} (16GB budget)", lambda: tidal_run(args.preset, "16GB"))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    dev = torch.cuda.get_device_properties(0).total_memory
    result["limit_params_14B"] = (host + dev) / 14
    attempt(f"tidal {args.large} (largest tried)", lambda: tidal_run(args.large))
    save()


if __name__ == "__main__":
    main()
