"""The training engine on the simulated device: what tidal costs per step
against plain PyTorch on the same CPU model, and how many bytes it moves per
step against the minimum. Writes benchmarks/results/engine_sim-<machine>.json.

    python benchmarks/engine_sim.py [--rounds 5] [--steps 4] [--quick]

The model is a GPT (tidal.models.gpt.TinyGPT) in fp32, small enough that
plain PyTorch + torch.optim.AdamW runs it on the CPU. Runs, interleaved in
rounds so machine load hits all alike:
  * plain   : the model, torch.optim.AdamW (foreach), no tidal.
  * fits    : tidal with a 2 GiB device budget (every state fits): what the
              hooks, the chunk views and the tracer cost. Hybrid Adam on (the
              default): every chunk is updated where it is, on the device, so
              nothing moves; on the simulated device the device-side update
              is the same SIMD kernel as CPU Adam.
  * tight   : tidal with a device budget of the measured activation peak plus
              a quarter of the 16-bit (here fp32) parameter bytes: chunks
              move every step, CPU Adam.
Per tidal run the result also has the bytes moved each way in a steady step
and the minimum: every 16-bit chunk down once (forward; backward reuses what
is resident or fetches again) and every gradient chunk up once, i.e. the
16-bit chunk bytes each way. On the simulated device "device" memory is host
memory and the copy engine is a thread; the figures are the bookkeeping and
copy costs of the engine, not GPU figures.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import tidal  # noqa: E402
from tidal._C.chunks import ChunkKind  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


class Plain:
    def __init__(self, model, lr):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class Tidal:
    def __init__(self, model, lr, budget, chunk, hybrid):
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
               "tidal": {"device": "sim", "chunk_size": chunk, "device_memory_budget": budget,
                         "device_margin": budget // 20, "hybrid_adam": hybrid}}
        self.engine = tidal.initialize(model, cfg)

    def step(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run per round")
    common.add_gpt_model_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.d, args.layers, args.vocab = 2, 2, 64, 2, 256

    tidal.set_device("sim", capacity="4GiB")
    torch.manual_seed(0)
    base = TinyGPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=4, seq=args.seq)
    params = sum(p.numel() for p in base.parameters())
    param_bytes = 4 * params  # fp32: the "16-bit" list holds fp32
    # 1 MiB chunks (64 MiB is the GPU default); 64 KiB for the smoke run.
    chunk = (64 << 10) if args.quick else (1 << 20)
    lr = 1e-3
    data = common.token_batches(args.vocab, args.seq, args.batch, 2 + args.rounds * args.steps)
    warm = data[:2]
    runs = {
        "plain": Plain(copy.deepcopy(base), lr),
        "fits": Tidal(copy.deepcopy(base), lr, budget=2 << 30, chunk=chunk, hybrid=True),
    }
    for run in runs.values():  # warm-up steps (tidal: trace + first-use relayout)
        for x, y in warm:
            run.step(x, y)
    # The tight run's budget: the activations (the non-chunk peak the fits
    # run measured) plus room for a quarter of the parameter chunks.
    activations = runs["fits"].engine.memory_report()["peak_nonchunk_device_bytes"]
    chunk_room = max(param_bytes // 4, 6 * chunk)
    runs["tight"] = Tidal(copy.deepcopy(base), lr, budget=int((activations + chunk_room) / 0.95),
                          chunk=chunk, hybrid=False)
    for x, y in warm:
        runs["tight"].step(x, y)
    samples = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    for r in range(args.rounds):
        chunk_of_data = data[2 + r * args.steps: 2 + (r + 1) * args.steps]
        for name, run in runs.items():
            for x, y in chunk_of_data:
                t = time.perf_counter()
                losses[name].append(run.step(x, y))
                samples[name].append(time.perf_counter() - t)
        print(f"[engine_sim] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {statistics.median(v[-args.steps:]) * 1e3:.1f} ms" for k, v in samples.items()),
            flush=True)

    plain = common.summarize(samples["plain"])
    out = {"model": {"kind": "TinyGPT", "d": args.d, "layers": args.layers, "seq": args.seq,
                     "vocab": args.vocab, "batch": args.batch, "params": params,
                     "precision": "fp32", "chunk_bytes": chunk},
           "plain_pytorch_step_s": plain, "runs": {}, "quick": args.quick}
    for name in ("fits", "tight"):
        engine = runs[name].engine
        rep = engine.memory_report()
        c = engine.chunks
        p16_bytes = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
        h2d, d2h = rep["bytes_host_to_device_last_step"], rep["bytes_device_to_host_last_step"]
        s = common.summarize(samples[name])
        out["runs"][name] = {
            "device_budget": rep["device_budget"],
            "step_s": s,
            "overhead_vs_plain": s["median"] / plain["median"],
            "bytes_host_to_device_per_step": h2d,
            "bytes_device_to_host_per_step": d2h,
            "minimum_bytes_each_way": p16_bytes,
            "h2d_over_minimum": h2d / p16_bytes,
            "d2h_over_minimum": d2h / p16_bytes,
            "evictions": rep["evictions"],
            "prefetch_hit_rate": rep["prefetch_hit_rate"],
            "adam_chunks_on_device": rep["adam_chunks_on_device"],
            "adam_chunks_on_host": rep["adam_chunks_on_host"],
            "cpu_adam_seconds": rep["cpu_adam_seconds"],
            "relayouts": engine.relayouts,
            "last_loss": losses[name][-1],
        }
    # The same data, the same updates: tidal's losses track plain PyTorch's.
    out["max_rel_loss_diff_vs_plain"] = max(
        abs(a - b) / abs(a) for name in ("fits", "tight")
        for a, b in zip(losses["plain"], losses[name]))
    for name, r in out["runs"].items():
        print(f"[engine_sim] {name}: {r['step_s']['median'] * 1e3:.1f} ms/step "
              f"({r['overhead_vs_plain']:.2f}x plain {plain['median'] * 1e3:.1f} ms), "
              f"H2D {r['h2d_over_minimum']:.2f}x / D2H {r['d2h_over_minimum']:.2f}x the minimum "
              f"of {r['minimum_bytes_each_way']} bytes", flush=True)
    name = "engine_sim-quick" if args.quick else "engine_sim"
    path = common.write_result(name, {"simulated": True, "result": out}, output=args.output)
    print(f"[engine_sim] wrote {path}")


if __name__ == "__main__":
    main()
