"""Gradient accumulation in the engine's chunks (Note [Gradient sums in
chunks] in cpu_adam/adam.h) on the simulated device, against plain PyTorch
accumulating in param.grad on the same CPU model. Writes
benchmarks/results/engine_accumulation-<machine>.json.

    python benchmarks/engine_accumulation.py [--rounds 6] [--steps 2] [--quick]

The model is a GPT (tidal.models.gpt.TinyGPT) in fp32. Runs, interleaved in
rounds so machine load hits all alike, each an optimizer step of
`--accumulation` micro-batches:
  * plain   : the model, loss / K backward per micro-batch, torch.optim.AdamW
              (foreach) at the boundary;
  * fits    : tidal with a 2 GiB device budget: no chunk moves; hybrid Adam
              (the default) folds and steps on the device, with cpu_adam's
              kernels on the simulated device;
  * tight   : tidal with the measured activation peak plus a quarter of the
              parameter bytes as device budget, hybrid Adam off: chunks move
              every micro-batch, folds and steps on the host.
and, as the no-accumulation baseline of the same run, plain and fits with
one micro-batch per step (the same micro-batch size).
Per tidal run: time per micro-batch against plain's, the gradient sums' bytes
per parameter (chunk memory held while a step accumulates, counted in the
budgets) and the chunk bytes resident then, and the bytes moved per
micro-batch. On the simulated device "device" memory is host memory and the
copy engine is a thread; these are the engine's bookkeeping and copy costs,
not GPU figures.
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
from tidal._C.chunks import ChunkKind, MemorySpace  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


class Plain:
    def __init__(self, model, lr, k):
        self.model, self.k = model, k
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(self, micro):
        losses = []
        for x, y in micro:
            loss = self.model(x, y)
            (loss / self.k).backward()
            losses.append(loss.item())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return losses


class Tidal:
    def __init__(self, model, lr, k, budget, chunk, hybrid):
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
               "gradient_accumulation_steps": k,
               "tidal": {"device": "sim", "chunk_size": chunk, "device_memory_budget": budget,
                         "device_margin": budget // 20, "hybrid_adam": hybrid}}
        self.engine = tidal.initialize(model, cfg)
        self.during = None  # chunk bytes while the last step accumulated

    def step(self, micro):
        losses = []
        e = self.engine
        for i, (x, y) in enumerate(micro):
            loss = e(x, y)
            e.backward(loss)
            if i == len(micro) - 1:
                c = e.chunks
                s = c.stats()
                sums = sum(c.chunk_capacity_bytes(j, ChunkKind.GRAD32) for j in range(c.num_chunks)
                           if c.chunk_space(j, ChunkKind.GRAD32) != MemorySpace.NONE)
                self.during = (sums, s["resident_bytes_host"], s["resident_bytes_device"])
            e.step()
            losses.append(loss.item())
        return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per run per round")
    ap.add_argument("--accumulation", type=int, default=4)
    common.add_gpt_model_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.d, args.layers, args.vocab = 2, 1, 64, 2, 256
    k = args.accumulation

    tidal.set_device("sim", capacity="4GiB")
    torch.manual_seed(0)
    base = TinyGPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=4, seq=args.seq)
    params = sum(p.numel() for p in base.parameters())
    chunk = (64 << 10) if args.quick else (1 << 20)
    lr = 1e-3
    per_step = 2 * k + args.rounds * args.steps * k
    data = common.token_batches(args.vocab, args.seq, args.batch, per_step)
    warm = [data[:k], data[k:2 * k]]
    runs = {
        "plain": Plain(copy.deepcopy(base), lr, k),
        "fits": Tidal(copy.deepcopy(base), lr, k, budget=2 << 30, chunk=chunk, hybrid=True),
        "plain_k1": Plain(copy.deepcopy(base), lr, 1),
        "fits_k1": Tidal(copy.deepcopy(base), lr, 1, budget=2 << 30, chunk=chunk, hybrid=True),
    }
    for name, run in runs.items():  # warm-up (tidal: trace + first-use relayout)
        for micro in warm:
            if name.endswith("_k1"):
                for m in micro[:2]:
                    run.step([m])
            else:
                run.step(micro)
    activations = runs["fits"].engine.memory_report()["peak_nonchunk_device_bytes"]
    chunk_room = max(4 * params // 4, 6 * chunk)
    runs["tight"] = Tidal(copy.deepcopy(base), lr, k, budget=int((activations + chunk_room) / 0.95),
                          chunk=chunk, hybrid=False)
    for micro in warm:
        runs["tight"].step(micro)
    samples = {name: [] for name in runs}  # seconds per micro-batch
    losses = {name: [] for name in runs}
    for r in range(args.rounds):
        base_i = 2 * k + r * args.steps * k
        steps = [data[base_i + s * k: base_i + (s + 1) * k] for s in range(args.steps)]
        for name, run in runs.items():
            for micro in steps:
                if name.endswith("_k1"):
                    for m in micro:
                        t = time.perf_counter()
                        run.step([m])
                        samples[name].append(time.perf_counter() - t)
                    continue
                t = time.perf_counter()
                losses[name].extend(run.step(micro))
                samples[name].append((time.perf_counter() - t) / k)
        print(f"[engine_accumulation] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {statistics.median(v[-args.steps:]) * 1e3:.1f} ms/micro" for n, v in samples.items()),
            flush=True)

    summary = {n: common.summarize(v) for n, v in samples.items()}
    out = {"model": {"kind": "TinyGPT", "d": args.d, "layers": args.layers, "seq": args.seq,
                     "vocab": args.vocab, "micro_batch": args.batch, "params": params,
                     "precision": "fp32", "chunk_bytes": chunk},
           "accumulation_steps": k, "quick": args.quick,
           "plain_pytorch_micro_batch_s": summary["plain"],
           "plain_pytorch_k1_micro_batch_s": summary["plain_k1"],
           "fits_k1": {"micro_batch_s": summary["fits_k1"],
                       "overhead_vs_plain_k1": summary["fits_k1"]["median"] / summary["plain_k1"]["median"]},
           "runs": {}}
    for name in ("fits", "tight"):
        engine = runs[name].engine
        rep = engine.memory_report()
        sums, host, device = runs[name].during
        h2d, d2h = rep["bytes_host_to_device_last_step"], rep["bytes_device_to_host_last_step"]
        c = engine.chunks
        master_bytes = sum(c.chunk_capacity_bytes(j, ChunkKind.PARAM32) for j in range(c.num_chunks))
        p16_bytes = sum(c.chunk_capacity_bytes(j, ChunkKind.PARAM16) for j in range(c.num_chunks))
        out["runs"][name] = {
            "device_budget": rep["device_budget"],
            "micro_batch_s": summary[name],
            "overhead_vs_plain": summary[name]["median"] / summary["plain"]["median"],
            "gradient_sum_bytes": sums,
            "gradient_sum_bytes_per_param": sums / params,
            # Chunk padding aside, 4 bytes per parameter: the sums' chunks are
            # the masters' chunks, byte for byte.
            "gradient_sum_bytes_over_master_chunk_bytes": sums / master_bytes,
            "chunk_padding_fraction": 1 - 4 * params / master_bytes,
            "chunk_bytes_resident_while_accumulating": {"host": host, "device": device},
            "chunk_bytes_per_param_while_accumulating": (host + device) / params,
            "state_bytes_per_param": rep["state_bytes_per_param"],
            "bytes_host_to_device_per_micro_batch": h2d / k,
            "bytes_device_to_host_per_micro_batch": d2h / k,
            # What a budget that cannot keep the 16-bit chunks must move per
            # micro-batch: each of them up once and (with its gradients) down once.
            "minimum_bytes_each_way_per_micro_batch": p16_bytes,
            "h2d_over_minimum": h2d / k / p16_bytes,
            "d2h_over_minimum": d2h / k / p16_bytes,
            "hybrid_adam": engine.config.hybrid_adam,
            "evictions": rep["evictions"],
            "adam_chunks_on_device": rep["adam_chunks_on_device"],
            "adam_chunks_on_host": rep["adam_chunks_on_host"],
            "cpu_adam_seconds": rep["cpu_adam_seconds"],
        }
    # The same data, the same updates: tidal's losses track plain PyTorch's.
    out["max_rel_loss_diff_vs_plain"] = max(
        abs(a - b) / abs(a) for name in ("fits", "tight")
        for a, b in zip(losses["plain"], losses[name]))
    print(f"[engine_accumulation] no accumulation: fits_k1 "
          f"{out['fits_k1']['overhead_vs_plain_k1']:.2f}x plain", flush=True)
    for name, r in out["runs"].items():
        print(f"[engine_accumulation] {name} (K={k}): {r['micro_batch_s']['median'] * 1e3:.1f} ms per "
              f"micro-batch ({r['overhead_vs_plain']:.2f}x plain "
              f"{summary['plain']['median'] * 1e3:.1f} ms), sums "
              f"{r['gradient_sum_bytes_per_param']:.2f} B/param ({r['gradient_sum_bytes_over_master_chunk_bytes']:.2f}x "
              f"the master chunks; padding {r['chunk_padding_fraction']:.0%}), chunks "
              f"{r['chunk_bytes_per_param_while_accumulating']:.2f} B/param while accumulating, "
              f"H2D {r['h2d_over_minimum']:.2f}x / D2H {r['d2h_over_minimum']:.2f}x the "
              f"{r['minimum_bytes_each_way_per_micro_batch']} bytes each way a micro-batch needs "
              f"when the 16-bit chunks do not fit", flush=True)
    name = "engine_accumulation-quick" if args.quick else "engine_accumulation"
    path = common.write_result(name, {"simulated": True, "result": out}, output=args.output)
    print(f"[engine_accumulation] wrote {path}")


if __name__ == "__main__":
    main()
