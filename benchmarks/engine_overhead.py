"""What the training engine costs per module and per optimizer step when
everything fits, against plain PyTorch + torch.optim.AdamW on the same CPU
model (issue 15's figures). Writes benchmarks/results/engine_overhead-<machine>.json.

    python benchmarks/engine_overhead.py [--rounds 5] [--steps 6] [--quick]

Two models, fp32, on the simulated device with the whole device as budget
(no chunk moves: what is measured is the engine's own work):
  * many_small : 200 x nn.Linear(16, 16) in a chain (67 K parameters, 400
                 tensors): the hooks' cost per module dominates;
  * few_large  : 4 x nn.Linear(1024, 1024) (4.2 M parameters, 8 tensors):
                 the optimizer's bandwidth dominates.
Per model, interleaved in rounds so machine load hits all alike:
  * plain        : forward + backward + torch.optim.AdamW(foreach) step;
  * plain_fused  : the same with AdamW(fused=True) (the optimizer-step peer);
  * plain_hooks  : plain with no-op Python hooks of every kind the engine
                   installs (module forward pre/post, a tensor hook on each
                   output, post-accumulate-grad, saved-tensor pack/unpack):
                   what torch's hook machinery costs before a hook does
                   anything, the floor under the engine's hooks;
  * tidal        : tidal.initialize with the default config (hybrid Adam:
                   every chunk is updated on the device, where it is; on the
                   simulated device that is the SIMD CPU Adam kernel).
  * cpuadam      : plain with tidal.optim.CPUAdam (the same SIMD kernels as
                   the engine's step, standalone: the engine step's peer);
  * tidal_bf16   : (few_large only) the engine in bf16, whose optimizer step
                   is set beside CPUAdam alone on as many fp32 parameters;
  * tidal_torch, cpuadam_torch : (few_large only) the engine and CPUAdam
                   with torch's intra-op threads running the update instead
                   of oneTBB's, the default (tidal.cpu_adam_pool,
                   Note [Whose threads run the update] in cpu_adam/adam.h).
Each step is timed whole and its optimizer step alone (engine.step() against
opt.step()), and for the engine the part of engine.step() spent in its chunk
loop (memory_report()["optimizer"]["adam_seconds"]: one C++ update call per
chunk and the Python around each call; the rest is the step's bookkeeping). Every run of a round is preceded by a pause (a peer timed right
before another charges it for the other's spinning threads) and the order of
the runs alternates between rounds. --target forces cpu_adam's SIMD target
(tidal._C.cpu_adam.available_targets()); the target used is in the file. The
engine's binding calls per updated chunk in one step (Note [The step of a
chunk in one call] in hooks/chunk_step.h) are counted too. The per-module overhead is (tidal - plain) / modules of the
whole step, minus the step-time difference, i.e. what the hooks cost; the
hook floor is the same for plain_hooks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import tidal  # noqa: E402
from tidal.models.gpt import TanhChain  # noqa: E402


MODELS = {
    "many_small": dict(width=16, depth=200, batch=32),
    "few_large": dict(width=1024, depth=4, batch=32),
}
QUICK = {
    "many_small": dict(width=16, depth=40, batch=8),
    "few_large": dict(width=256, depth=4, batch=8),
}


def make(shape, seed=0):
    torch.manual_seed(seed)
    return TanhChain(shape["width"], shape["depth"])


def data(shape, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape["batch"], shape["width"], generator=g),
             torch.randn(shape["batch"], shape["width"], generator=g)) for _ in range(n)]


def _noop_output_hook(grad):
    return None


def _noop_hooks(model):
    """No-op Python hooks of every kind the engine installs, on `model`."""
    from tidal.engine.hooks import add_tensor_hook
    for m in model.modules():
        if next(m.parameters(recurse=False), None) is None:
            continue
        m.register_forward_pre_hook(lambda mod, args: None)
        m.register_forward_hook(lambda mod, args, out: add_tensor_hook(out, _noop_output_hook))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda param: None)


class Plain:
    def __init__(self, shape, fused, hooks=False):
        self.model = make(shape)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01,
                                     **({"fused": True} if fused else {"foreach": True}))
        self.saved = None
        if hooks:
            _noop_hooks(self.model)
            self.saved = lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def run(self, x, y):
        t0 = time.perf_counter()
        if self.saved is not None:
            with self.saved():
                loss = self.model(x, y)
        else:
            loss = self.model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1


class PlainCPUAdam(Plain):
    def __init__(self, shape, pool="onetbb"):
        super().__init__(shape, False)
        from tidal.optim import CPUAdam
        self.opt = CPUAdam(self.model.parameters(), lr=1e-3, weight_decay=0.01, thread_pool=pool)


class _Counting:
    """The engine's Chunks object with every method call counted."""

    def __init__(self, chunks):
        self._chunks, self.calls = chunks, 0

    def __getattr__(self, name):
        attr = getattr(self._chunks, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            self.calls += 1
            return attr(*a, **k)
        return call


def step_calls_per_chunk(engine, x, y) -> float:
    """Binding calls of engine.step() per chunk it updated, in one step."""
    loss = engine(x, y)
    engine.backward(loss)
    counting = _Counting(engine.chunks)
    before = engine._meters.adam_device_chunks + engine._meters.adam_host_chunks
    engine.store.chunks = counting  # (engine.chunks is the store's)
    try:
        engine.step()
    finally:
        engine.store.chunks = counting._chunks
    chunks = engine._meters.adam_device_chunks + engine._meters.adam_host_chunks - before
    return counting.calls / max(chunks, 1)


class Tidal:
    def __init__(self, shape, precision="fp32", pool="onetbb"):
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "tidal": {"device": "sim", "chunk_size": "4MiB", "cpu_adam_pool": pool}}
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        self.engine = tidal.initialize(make(shape), cfg)
        self.adam = []  # per step: the part of engine.step() in its chunk loop

    def run(self, x, y):
        # (read before the timed window: backward changes no adam_seconds here)
        before = self.engine.memory_report()["optimizer"]["adam_seconds"]
        t0 = time.perf_counter()
        loss = self.engine(x, y)
        self.engine.backward(loss)
        t1 = time.perf_counter()
        self.engine.step()
        t2 = time.perf_counter()
        self.adam.append(self.engine.memory_report()["optimizer"]["adam_seconds"] - before)
        return t2 - t0, t2 - t1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run and round")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", default=None)
    ap.add_argument("--target", default="auto", help="cpu_adam's SIMD target (default: the best)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    tidal._C.cpu_adam.set_target(args.target)
    torch.set_num_threads(os.cpu_count() or 1)
    tidal.set_device("sim", capacity="8GiB")
    shapes = QUICK if args.quick else MODELS
    rounds = 2 if args.quick else args.rounds
    out = {"quick": args.quick, "rounds": rounds, "steps_per_round": args.steps,
           "cpu_adam_target": tidal._C.cpu_adam.target(), "cpu_adam_pool": "onetbb (default); "
           "*_torch runs: torch",
           # How torch's OpenMP threads wait between parallel regions (ACTIVE:
           # they spin, as Intel's OpenMP does for 200 ms by default).
           "omp_environment": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                             "OMP_NUM_THREADS")},
           "models": {}}
    for name, shape in shapes.items():
        params = sum(p.numel() for p in make(shape).parameters())
        runs = {"plain": Plain(shape, False), "plain_fused": Plain(shape, True),
                "plain_hooks": Plain(shape, False, hooks=True), "cpuadam": PlainCPUAdam(shape),
                "tidal": Tidal(shape)}
        if name == "few_large":
            # The engine's bf16 step (bf16 gradients in, bf16 weights out, fp32
            # master and moments) against CPUAdam alone on as many fp32 parameters.
            runs["tidal_bf16"] = Tidal(shape, "bf16")
            runs["tidal_torch"] = Tidal(shape, pool="torch")
            runs["cpuadam_torch"] = PlainCPUAdam(shape, pool="torch")
        batches = data(shape, args.steps + 2)
        for r in runs.values():  # warm-up (tidal: the trace and the relayout)
            for x, y in batches[:2]:
                r.run(x, y)
        whole = {k: [] for k in runs}
        step = {k: [] for k in runs}
        for i in range(rounds):
            for k in (list(runs) if i % 2 == 0 else list(reversed(runs))):
                r = runs[k]
                time.sleep(0.5)  # no run pays for the previous one's spinning threads
                for x, y in batches[2:]:
                    w, s = r.run(x, y)
                    whole[k].append(w)
                    step[k].append(s)
        med = {k: statistics.median(v) for k, v in whole.items()}
        med_step = {k: statistics.median(v) for k, v in step.items()}
        modules = shape["depth"]
        def fwd_bwd(k):
            return med[k] - med_step[k]
        hooks_us = (fwd_bwd("tidal") - fwd_bwd("plain")) / modules * 1e6
        floor_us = (fwd_bwd("plain_hooks") - fwd_bwd("plain")) / modules * 1e6
        out["models"][name] = {
            "shape": shape, "parameters": params, "tensors": 2 * modules, "modules": modules,
            "median_step_seconds": med, "median_optimizer_step_seconds": med_step,
            "step_seconds": whole, "optimizer_step_seconds": step,
            "ratio_tidal_to_plain": med["tidal"] / med["plain"],
            "optimizer_step_ratio_tidal_to_fused": med_step["tidal"] / med_step["plain_fused"],
            "optimizer_step_ratio_tidal_to_foreach": med_step["tidal"] / med_step["plain"],
            "optimizer_step_ratio_tidal_to_cpuadam": med_step["tidal"] / med_step["cpuadam"],
            **({"optimizer_step_ratio_tidal_bf16_to_cpuadam": med_step["tidal_bf16"] / med_step["cpuadam"]}
               if "tidal_bf16" in runs else {}),
            **({"optimizer_step_ratio_tidal_torch_to_cpuadam_torch":
                med_step["tidal_torch"] / med_step["cpuadam_torch"],
                "optimizer_step_ratio_tidal_torch_to_tidal": med_step["tidal_torch"] / med_step["tidal"],
                "optimizer_step_ratio_cpuadam_torch_to_cpuadam": med_step["cpuadam_torch"] / med_step["cpuadam"]}
               if "tidal_torch" in runs else {}),
            "step_binding_calls_per_chunk": step_calls_per_chunk(runs["tidal"].engine, *batches[0]),
            "hook_overhead_us_per_module": hooks_us,
            "hook_floor_us_per_module": floor_us,
            "forward_backward_ratio_tidal_to_plain": fwd_bwd("tidal") / fwd_bwd("plain"),
            "forward_backward_ratio_tidal_to_plain_hooks": fwd_bwd("tidal") / fwd_bwd("plain_hooks"),
        }
        for k in ("tidal", "tidal_bf16", "tidal_torch"):
            if k in runs:
                # The chunk loop (one C++ update call per chunk and the Python
                # around it) within engine.step(): the timed steps only.
                out["models"][name][f"{k}_median_adam_seconds"] = statistics.median(runs[k].adam[-len(step[k]):])
                r = runs[k].engine.memory_report()
                common.check_budget(r, f"{name} {k}")
                out["models"][name][f"{k}_budget_overruns"] = r["budget_overruns"]
                runs[k].engine.remove_hooks()
        print(f"{name}: {params} params; step tidal {med['tidal'] * 1e3:.2f} ms vs plain "
              f"{med['plain'] * 1e3:.2f} ms ({med['tidal'] / med['plain']:.2f}x); optimizer step tidal "
              f"{med_step['tidal'] * 1e3:.2f} ms vs AdamW fused {med_step['plain_fused'] * 1e3:.2f} ms, "
              f"CPUAdam {med_step['cpuadam'] * 1e3:.2f} ms, "
              f"foreach {med_step['plain'] * 1e3:.2f} ms; hooks {hooks_us:.1f} us/module (no-op hooks "
              f"of the same kinds: {floor_us:.1f})", flush=True)
    path = common.write_result("engine_overhead-quick" if args.quick else "engine_overhead", out,
                               args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
