"""python -m tidal.train: train a GPT-style model with tidal (the main job).

On a GPU it trains a GPT of the chosen preset in bf16; without one it trains a
small GPT on the simulated device with a device budget below the model's
state size, so chunks move and the CPU Adam runs. Data: synthetic tokens from
a fixed random bigram table, so the loss has something to learn and falls.

    python -m tidal.train                      # auto: GPU preset 'gpt-350m', else 'tiny'
    python -m tidal.train --preset gpt-1.3b --steps 20
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import tidal
from tidal.models.gpt import TinyGPT

PRESETS = {
    # name: (layers, hidden, heads, seq, vocab)
    "tiny": (4, 128, 4, 64, 512),
    "gpt-125m": (12, 768, 12, 1024, 50304),
    "gpt-350m": (24, 1024, 16, 1024, 50304),
    "gpt-1.3b": (24, 2048, 16, 1024, 50304),
    "gpt-2.7b": (32, 2560, 32, 1024, 50304),
    "gpt-4b": (36, 3072, 24, 1024, 50304),
    "gpt-6.7b": (32, 4096, 32, 1024, 50304),
}


def synthetic_batches(vocab, seq, batch, device, seed=0):
    """Tokens from a random sparse bigram table: learnable, no download."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, 4), generator=g)
    while True:
        start = torch.randint(0, vocab, (batch,), generator=g)
        toks = [start]
        for _ in range(seq):
            choice = torch.randint(0, 4, (batch,), generator=g)
            toks.append(nxt[toks[-1], choice])
        t = torch.stack(toks, 1)
        yield t[:, :-1].to(device), t[:, 1:].to(device)


def params_of(layers, d, vocab, seq):
    return 12 * layers * d * d + (vocab + seq) * d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="micro batch size")
    ap.add_argument("--budget", default=None, help="device memory budget, e.g. 20GB")
    ap.add_argument("--config", default=None, help="JSON config file (overrides the defaults)")
    ap.add_argument("--json", default=None, help="write the final report here")
    args = ap.parse_args(argv)

    info = tidal.get_device().info()
    gpu = info["backend"] == "cuda"
    preset = args.preset or ("gpt-350m" if gpu else "tiny")
    layers, d, heads, seq, vocab = PRESETS[preset]
    steps = args.steps or (20 if gpu else 30)
    batch = args.batch or (8 if gpu else 2)
    n_params = params_of(layers, d, vocab, seq)
    if args.config:
        config = json.load(open(args.config))
    else:
        budget = args.budget or (None if gpu else "8MiB")
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4 if gpu else 3e-3, "weight_decay": 0.01}},
            "bf16": {"enabled": gpu},
            "tidal": {"chunk_size": "64MiB" if gpu else "256KiB"},
        }
        if budget:
            config["tidal"]["device_memory_budget"] = budget
    print(f"[tidal.train] device {info['backend']} ({info['name']}), preset {preset}: "
          f"{n_params / 1e6:.1f}M parameters, {layers} layers, hidden {d}, seq {seq}, "
          f"micro batch {batch}, {steps} steps", flush=True)
    t0 = time.perf_counter()
    with tidal.init_context(config):
        model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=seq)
    engine = tidal.initialize(model)
    print(f"[tidal.train] model built into chunks in {time.perf_counter() - t0:.1f} s", flush=True)
    dev = engine.store.torch_device
    data = synthetic_batches(vocab, seq, batch, dev)
    losses, times = [], []
    for step in range(steps):
        x, y = next(data)
        t = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        value = loss.item()
        times.append(time.perf_counter() - t)
        losses.append(value)
        tok_s = batch * seq / times[-1]
        tflops = 6 * n_params * batch * seq / times[-1] / 1e12
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {value:8.4f}  {tok_s:10.0f} tok/s  {tflops:7.2f} TFLOPS  "
                  f"scale {engine.loss_scale:g}", flush=True)
    report = engine.memory_report()
    steady = times[2:] or times
    summary = {
        "preset": preset, "params": n_params, "steps": steps, "micro_batch": batch, "seq": seq,
        "first_loss": losses[0], "last_loss": losses[-1],
        "tokens_per_s": batch * seq * len(steady) / sum(steady),
        "tflops": 6 * n_params * batch * seq * len(steady) / sum(steady) / 1e12,
        "device": info["name"], "backend": info["backend"],
        "memory": {k: v for k, v in report.items() if k not in ("scheduler", "host")},
        "host_bytes": report["host"],
    }
    print("[tidal.train] report: " + json.dumps(summary["memory"], indent=None))
    print(f"[tidal.train] loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"{summary['tokens_per_s']:.0f} tokens/s, {summary['tflops']:.2f} TFLOPS (steady state)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
