"""DTR benchmark: per-op interception overhead, slowdown vs budget, and DTR vs
torch.utils.checkpoint at matched memory.

    python benchmarks/dtr.py --quick      # seconds: proves it runs (tiny models)
    python benchmarks/dtr.py              # the measurement (minutes on 2 cores)

On a machine without a GPU this is a CPU proxy: budgets are enforced by DTR's
own accounting (tracked bytes: storages made while DTR is on: activations,
temporaries, gradients, optimizer-free), times are CPU times. The result file
says so. "No-DTR peak" is the peak of tracked bytes with an unlimited
threshold, i.e. what the same step keeps alive without eviction.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, summarize, write_result  # noqa: E402

import tidal  # noqa: E402
import tidal.dtr as dtr  # noqa: E402
from tidal.models.gpt import Block  # noqa: E402


# --------------------------------------------------------------------------- models

class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layout (3-4-6-3 bottlenecks, 64..2048 channels), random init."""

    def __init__(self, layers=(3, 4, 6, 3), classes=1000, base=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], base
        for i, n in enumerate(layers):
            width = base * 2**i
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x, checkpoint=False):
        x = self.stem(x)
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if checkpoint else b(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class GPT(nn.Module):
    """GPT-2 small's shape (12 layers, d=768, 12 heads, 4x MLP, dropout 0.1)."""

    def __init__(self, vocab=8192, d=768, layers=12, heads=12, ctx=1024, dropout=0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        # tidal.models.gpt's block with GPT-2's qkv bias and the attention
        # written out (dropout on its probabilities): the ops DTR sees one by one.
        self.blocks = nn.ModuleList(Block(d, heads, dropout, qkv_bias=True, attention="explicit")
                                    for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, checkpoint=False):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if checkpoint else b(x)
        return self.head(self.ln(x))


def workloads(quick):
    if quick:
        return {
            "resnet50": dict(make=lambda: ResNet50(layers=(1, 1, 1, 1), classes=10, base=8),
                             data=lambda: (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))),
                             shape="ResNet layout (1,1,1,1), base 8, batch 2, 32x32 (quick)"),
            "gpt2_small": dict(make=lambda: GPT(vocab=256, d=64, layers=2, heads=4, ctx=64),
                               data=lambda: (torch.randint(0, 256, (2, 32)), None),
                               shape="GPT 2 layers d=64 (quick)"),
        }
    return {
        "resnet50": dict(make=lambda: ResNet50(),
                         data=lambda: (torch.randn(16, 3, 96, 96), torch.randint(0, 1000, (16,))),
                         shape="ResNet-50 (3,4,6,3 bottlenecks, 25.6M params), batch 16, 96x96"),
        "gpt2_small": dict(make=lambda: GPT(),
                           data=lambda: (torch.randint(0, 8192, (2, 256)), None),
                           shape="GPT-2 small shape (12x768, 12 heads), vocab 8192, batch 2, seq 256"),
    }


def step_fn(model, data, checkpoint=False):
    x, y = data

    def step():
        model.zero_grad(set_to_none=True)
        out = model(x, checkpoint=checkpoint)
        if y is None:  # language model: next-token loss
            loss = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
        else:
            loss = F.cross_entropy(out, y)
        loss.backward()
        return loss.item()
    return step


def timed(step, repeat, warmup=1):
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return samples


# --------------------------------------------------------------------------- per-op overhead

class _PassDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Wrapper(torch.Tensor):
    """A wrapper subclass holding its payload (the CheckpointTensor shape of the DTR prototype)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   strides=inner.stride(), requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.inner if isinstance(a, _Wrapper) else a  # noqa: E731
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return _Wrapper(out) if isinstance(out, torch.Tensor) else out


@contextlib.contextmanager
def _dtr_on(interception):
    """DTR on with nothing evicted, ops intercepted in C++ (the default) or by
    the Python TorchDispatchMode (the implementation before issue 16)."""
    saved = dtr._interception
    dtr._interception = interception
    try:
        with dtr.enabled(eviction_threshold=1 << 50):
            yield
    finally:
        dtr._interception = saved


def _count_ops(fn):
    """The ops one call of fn runs, as DTR's interception counts them."""
    n = [0]
    dtr._set_after_op(lambda: n.__setitem__(0, n[0] + 1))
    try:
        with dtr.enabled(eviction_threshold=1 << 50):
            fn()
    finally:
        dtr._set_after_op(None)
    return n[0]


def _mlp_step(width=64, batch=16):
    """One training step (forward, backward, no optimizer) of a 3-layer MLP."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, width))
    x = torch.randn(batch, width)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
    return step


def overhead(n_ops):
    """Per-op cost with DTR on and nothing evicted, against plain PyTorch and
    the pass-through costs of torch's extension points, in one run."""
    results = {}
    variants = {
        "plain": lambda: contextlib.nullcontext(),
        "torch_function_mode": _PassFunction,
        "torch_dispatch_mode": _PassDispatch,
        "tidal_dtr": lambda: _dtr_on(None),
        "tidal_dtr_python_mode": lambda: _dtr_on("python"),
    }
    for name, shape in (("add_4", (4,)), ("mm_64", (64, 64)), ("mlp3_step", None)):
        if name == "mlp3_step":
            step = _mlp_step()
            ops_per_call = _count_ops(step)
            n = max(n_ops // (20 * ops_per_call), 20)
            calls = {v: (step, None, None) for v in variants}
        else:
            a = torch.randn(*shape)
            b = torch.randn(*shape)
            op = (lambda x, y: x + y) if name == "add_4" else (lambda x, y: x @ y)
            ops_per_call = 1
            n = n_ops if name == "add_4" else max(n_ops // 20, 50)
            calls = {v: (op, a, b) for v in variants}
            calls["wrapper_subclass"] = (op, _Wrapper(a), _Wrapper(b))

        # Round-robin over the variants (7 rounds after a warm-up round), so
        # drift on a shared machine hits them alike.
        samples = {v: [] for v in calls}
        for r in range(8):
            for vname, (fn, x, y) in calls.items():
                ctx = variants.get(vname, lambda: contextlib.nullcontext())
                with ctx():
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn() if x is None else fn(x, y)
                    dt = time.perf_counter() - t0
                if r > 0:
                    samples[vname].append(dt / (n * ops_per_call) * 1e6)
        per = {v: {"us_per_op": summarize(s), "samples_us": s} for v, s in samples.items()}
        base = per["plain"]["us_per_op"]["median"]
        for vname, v in per.items():
            v["overhead_us_per_op"] = v["us_per_op"]["median"] - base
        per["ops_per_call"] = ops_per_call
        results[name] = per
    return results


def session_restart(n=200):
    """What the training engine pays at every step when no evicted tensor
    survives it: ending the DTR session (bring back what is evicted, forget
    the records) and starting the next (Note [DTR under the training
    engine])."""
    x = torch.randn(64, 64)
    samples = []
    for _ in range(6):
        with dtr.enabled(eviction_threshold=1 << 50):
            y = x.sin()  # one live record, as a step's kept outputs
            t0 = time.perf_counter()
            for _ in range(n):
                dtr._suspend()
                dtr.enable()
            samples.append((time.perf_counter() - t0) / n * 1e6)
            del y
    return {"us_per_restart": summarize(samples[1:]), "samples_us": samples[1:]}


# --------------------------------------------------------------------------- budgets

def measure_peak(make, data, checkpoint=False):
    torch.manual_seed(0)
    model = make()
    step = step_fn(model, data, checkpoint)
    with dtr.enabled(eviction_threshold=1 << 50, evictee_minimum_size=dtr.evictee_minimum_size):
        step()
        dtr.reset_peak()
        step()
        return dtr.stats()["peak_tracked_bytes"]


def _top_ops(counters, n=8):
    """The ops whose replays took longest: where the recompute time goes."""
    top = sorted(counters.items(), key=lambda kv: -kv[1]["replay_seconds"])[:n]
    return {name: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()} for name, c in top}


def run_workload(name, spec, fractions, repeat):
    """Every configuration runs one step per round, round-robin, on one model (no
    optimizer step, so the parameters never change): load drift on a shared
    machine hits all configurations alike."""
    data = spec["data"]()
    peak = measure_peak(spec["make"], data)
    ck_peak = measure_peak(spec["make"], data, checkpoint=True)
    torch.manual_seed(0)
    model = spec["make"]()
    out = {"shape": spec["shape"], "params": sum(p.numel() for p in model.parameters()),
           "no_dtr_peak_tracked_bytes": peak}
    configs = [("plain", None, False)] + [(f"dtr_{int(f * 100)}", int(peak * f), False) for f in fractions]
    configs += [("checkpoint_per_block", None, True), ("dtr_at_checkpoint_peak", ck_peak, False)]
    samples = {c[0]: [] for c in configs}
    stats = {}

    def one(cfg):
        label, threshold, ckpt = cfg
        step = step_fn(model, data, checkpoint=ckpt)
        if threshold is None:
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0
        with dtr.enabled(eviction_threshold=threshold, evictee_minimum_size=dtr.evictee_minimum_size):
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            stats[label] = dtr.stats()
            if hasattr(dtr._runtime, "op_counters"):
                ops, plans = dtr._runtime.op_counters()
                stats[label]["op_counters"], stats[label]["plans"] = ops, dict(plans)
        return dt

    for cfg in configs:  # warm-up round
        one(cfg)
    for r in range(repeat):
        for cfg in configs:
            samples[cfg[0]].append(one(cfg))
            if r == repeat - 1 and cfg[1] is not None:
                s = stats[cfg[0]]
                print(f"  {name} {cfg[0]}: {statistics.median(samples[cfg[0]]):.3f}s "
                      f"(plain {statistics.median(samples['plain']):.3f}s) "
                      f"peak {s['peak_tracked_bytes'] / 2**20:.1f} MiB / no-DTR {peak / 2**20:.1f} MiB, "
                      f"recomputes {s['recomputes']}", flush=True)
    t_plain = statistics.median(samples["plain"])
    out["plain_pytorch_s"] = {"samples": samples["plain"], **summarize(samples["plain"])}
    rows = []
    for frac in fractions:
        label = f"dtr_{int(frac * 100)}"
        s = stats[label]
        rows.append({"fraction": frac, "eviction_threshold": int(peak * frac), "samples_s": samples[label],
                     **summarize(samples[label]),
                     "slowdown_vs_plain": statistics.median(samples[label]) / t_plain,
                     "peak_tracked_bytes": s["peak_tracked_bytes"], "max_op_working_set": s["max_op_working_set"],
                     "evictions": s["evictions"], "recomputes": s["recomputes"],
                     "recompute_seconds": s["recompute_seconds"], "stats_of": "last timed step",
                     "regenerations": s.get("plans"), "by_op": _top_ops(s.get("op_counters", {}))})
    full = next((r for r in rows if r["fraction"] == 1.0), None)
    if full is not None:
        for r in rows:
            r["slowdown_vs_dtr_100"] = r["median"] / full["median"]
    out["budgets"] = rows
    ck, matched = samples["checkpoint_per_block"], samples["dtr_at_checkpoint_peak"]
    s = stats["dtr_at_checkpoint_peak"]
    out["matched_memory"] = {
        "checkpoint_per_block_s": {"samples": ck, **summarize(ck)},
        "checkpoint_peak_tracked_bytes": ck_peak,
        "checkpoint_fraction_of_no_dtr_peak": ck_peak / peak,
        "dtr_at_checkpoint_peak_s": {"samples": matched, **summarize(matched)},
        "dtr_peak_tracked_bytes": s["peak_tracked_bytes"],
        "dtr_recomputes": s["recomputes"],
        "dtr_over_checkpoint": statistics.median(matched) / statistics.median(ck),
        "checkpoint_over_plain": statistics.median(ck) / t_plain,
    }
    return out


# glibc returns freed blocks above its mmap threshold to the OS and faults
# fresh pages in on the next allocation; a step that frees and allocates
# tensors in a different order (DTR frees a dead tensor at the next op, not
# at once) then pays page faults that a caching allocator (CUDA's, the
# machine DTR is for) never pays: measured on the GPT shape, ~10% of a step
# in page faults for DTR against ~6% for plain PyTorch. Every configuration
# runs with freed memory kept in the process, as a caching allocator does.
_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def _with_caching_allocator():
    """Re-executes this script with _ALLOCATOR_ENV unless it is set (--system-malloc keeps glibc's defaults)."""
    if "--system-malloc" in sys.argv or all(os.environ.get(k) == v for k, v in _ALLOCATOR_ENV.items()):
        return
    os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **_ALLOCATOR_ENV})


def main():
    _with_caching_allocator()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, one repeat (seconds)")
    parser.add_argument("--output", default=None, help="result path (default benchmarks/results/dtr-<machine>.json)")
    parser.add_argument("--only", default=None, help="run one part: resnet50, gpt2_small or overhead (the per-op part alone)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (full mode)")
    parser.add_argument("--skip-overhead", action="store_true", help="skip the per-op overhead part")
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc's default mmap/trim thresholds (see _ALLOCATOR_ENV)")
    parser.add_argument("--evictee-minimum-size", default=None,
                        help="DTR's evictee_minimum_size (default 1MiB; --quick uses 1KiB for its tiny tensors)")
    args = parser.parse_args()
    dtr.evictee_minimum_size = args.evictee_minimum_size or ("1KiB" if args.quick else "1MiB")
    torch.manual_seed(0)
    repeat = 1 if args.quick else args.repeat
    fractions = [1.0, 0.7, 0.5, 0.3]
    info = machine_info()
    payload = {
        "proxy_note": ("CPU proxy: no GPU on this machine. Budgets are DTR's own accounting of tracked bytes "
                       "(storages produced while DTR is on); times are CPU step times, so recompute is far "
                       "more expensive relative to memory traffic than on a GPU.") if not info["gpus"] else
                      "GPU run",
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "allocator": ("glibc defaults" if args.system_malloc else
                      "glibc with " + ", ".join(f"{k}={v}" for k, v in _ALLOCATOR_ENV.items()) +
                      ": freed memory stays in the process, as with a caching allocator; every configuration "
                      "alike"),
        "interception": "C++ (DispatchKey::Fake)" if not tidal._C.dtr.interception_status() else "python",
        "options": {"evictee_minimum_size": dtr.evictee_minimum_size, "scorer": dtr.scorer,
                    "enable_sqrt_sampling": dtr.enable_sqrt_sampling},
    }
    payload["per_op_overhead"] = {} if args.skip_overhead else overhead(300 if args.quick else 10000)
    if not args.skip_overhead:
        payload["session_restart"] = session_restart(20 if args.quick else 200)
        print(f"  session end + start: {payload['session_restart']['us_per_restart']['median']:.1f}us")
    for k, v in payload["per_op_overhead"].items():
        print("  " + k + ": " + ", ".join(f"{n} {x['us_per_op']['median']:.2f}us" for n, x in v.items()
                                          if isinstance(x, dict)))
    payload["workloads"] = {}
    for name, spec in workloads(args.quick).items():
        if args.only and name != args.only:  # "overhead": no workload
            continue
        print(f"{name} ...", flush=True)
        payload["workloads"][name] = run_workload(name, spec, fractions, repeat)
    name = "dtr-quick" if args.quick else "dtr"
    if args.only:
        name += "-" + args.only
    path = write_result(name, payload, args.output, info)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
