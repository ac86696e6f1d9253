"""tidal.estimate against the engine on the simulated device: the predicted
bytes moved per step and step time beside the measured ones, for four shapes
of one GPT family with different ratios of model state to device budget (one
with gradient accumulation).
Writes benchmarks/results/estimate-<machine>.json.

    python benchmarks/estimate.py [--rounds 3] [--bandwidth 2GB/s] [--quick]
    python benchmarks/estimate.py --h100    # the H100 + 128 GB prediction, no training

The rates the prediction needs are measured in the same run, on the same
simulated device, before and after each round of shapes:
  * link: 64 MiB copies each way on the simulated device at --bandwidth;
  * CPU Adam: the engine's kernel (cpu_adam.adam_chunk_step) over 2^22
    parameters; gradient accumulation's fold (cpu_adam.fold_gradients) over
    the same, with the weights' rewrite and without it (Note [The weights'
    image instead of the restore]);
  * CPU compute: plain PyTorch forward + backward of a calibration GPT (the
    shapes' width, sequence, batch and precision, 2 layers), FLOPs counted by
    the estimate's own meta-device pass: the FLOP/s this CPU reaches on these
    matrix shapes (a GPU's would be its measured model TFLOPS);
  * hooks: the engine's seconds per module, from the calibration GPT in
    tidal with every state on the device (nothing moves), less its plain
    forward + backward and its Adam time.
No rate comes from the shapes being predicted. Each shape trains in a fresh
process (--worker): warm-up steps until the trace and the relayout settle,
then timed steps; the bytes are the scheduler's counters of each step.
A result measured here is a check of the estimate's model of the engine on
the simulated device, not a GPU performance claim.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.abspath(__file__)

# The GPT family: TinyGPT, width 256, 4 heads, vocabulary 256, sequence 64,
# micro batch 4, bf16, 256 KiB chunks (many chunks: see Note [The pre-flight
# estimate] on chunks whose states are as large as the activations).
FAMILY = {"d": 256, "heads": 4, "vocab": 256, "seq": 64, "batch": 4, "precision": "bf16",
          "chunk": 256 << 10}
SHAPES = {
    "fits": {"layers": 8, "device": 256 << 20, "host": 1 << 30,
             "what": "every state fits beside the activations: nothing moves"},
    "streams": {"layers": 8, "device": 64 << 20, "host": 1 << 30,
                "what": "states twice the device budget: 16-bit chunks stream, some chunks "
                        "updated on the device"},
    "host_short": {"layers": 16, "device": 80 << 20, "host": 224 << 20,
                   "what": "states 3x the device budget and more than the host budget: states "
                           "spilled to the device, 16-bit chunks fetched again in backward"},
    "accumulates": {"layers": 8, "device": 64 << 20, "host": 1 << 30, "accumulation": 2,
                    "what": "the streaming shape with 2 micro-batches a step: every backward "
                            "sends the host-updated chunks' gradients down and folds them into "
                            "their fp32 sums"},
}
QUICK = {"d": 64, "heads": 4, "vocab": 256, "seq": 32, "batch": 2, "precision": "bf16",
         "chunk": 64 << 10}
QUICK_SHAPES = {"fits": {"layers": 2, "device": 64 << 20, "host": 1 << 30, "what": "smoke"},
                "streams": {"layers": 4, "device": 3 << 20, "host": 1 << 30, "what": "smoke"},
                "accumulates": {"layers": 4, "device": 3 << 20, "host": 1 << 30, "accumulation": 2,
                                "what": "smoke"}}


def config(family, shape, states="fp32"):
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0,
           "train_micro_batch_size_per_gpu": family["batch"],
           "tidal": {"chunk_size": family["chunk"],
                     "device_memory_budget": shape["device"],
                     "host_memory_budget": shape["host"], "optimizer_state_dtype": states}}
    if family["precision"] != "fp32":
        cfg[family["precision"]] = {"enabled": True}
    if shape.get("accumulation", 1) > 1:
        cfg["gradient_accumulation_steps"] = shape["accumulation"]
    return cfg


def build(family, layers, meta=False):
    import torch
    from tidal.models.gpt import TinyGPT
    kw = dict(vocab=family["vocab"], d=family["d"], layers=layers, heads=family["heads"],
              seq=family["seq"])
    if meta:
        with torch.device("meta"):
            return TinyGPT(**kw)
    return TinyGPT(**kw)


# ------------------------------------------------------------------ samples
def _busy_seconds() -> float:
    """CPU seconds all processes spent in user and system mode (this VM books
    softirq time on idle cores, so it is left out)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return sum(fields[:3]) / os.sysconf("SC_CLK_TCK")


class Sample:
    """Times a block: .seconds, and .others, the CPU seconds other processes
    used meanwhile (all processes' busy time less this process's, whose
    process_time counts all its threads, the simulated device's copy workers
    included). Recorded, not filtered on: the shared 2-core machine rarely
    has a quiet moment, so rates and steps are measured interleaved instead
    (Note [Rates beside the steps])."""

    def __enter__(self):
        self.t, self.busy, self.own = time.perf_counter(), _busy_seconds(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t
        self.others = max(0.0, _busy_seconds() - self.busy - (time.process_time() - self.own))
        return False


# ------------------------------------------------------------------ the worker
# Note [Rates beside the steps]: other work on this machine takes a varying
# share of its two cores, so a rate measured a minute before a step can be
# off by 2x. Each shape's process therefore measures the compute and CPU Adam
# rates between its own steps, alternating: a plain PyTorch forward + backward
# of the 2-layer calibration GPT, a training step of the shape, a CPU Adam
# pass over 2^22 parameters with the engine's kernel. The prediction for a
# round uses that round's rates: both sides see the same load. The link is
# probed there too, with copies of one fp32 chunk each way on the device the
# engine uses: the simulated link is a clock (bytes / bandwidth), but its copy
# threads must be scheduled to land each copy, so a loaded CPU slows it too.
# The copies a step leaves in flight (the next forward's weights, gradients
# still going down) must land before the probes: they would otherwise run
# during them, and the link probe would queue behind them and measure the
# link at half its rate (it did, at 2 MB/s: 1.07 MB/s for the shape whose
# states stream, so the prediction came out 53% high). So each round of the
# loop ends by synchronizing the device, untimed (its time is recorded as the
# step's tail). Note [A step of the loop] says what is timed.
#
# Note [A step of the loop]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The estimate predicts a training loop's step: tokens/s of steps run back to
# back, where the copies one step leaves in flight run under the next
# forward. So each timed step follows a lead step run just before it (not
# timed, nothing between them but two counter snapshots of microseconds),
# and is timed from its call until it returns: it starts with the lead
# step's copies in flight and leaves its own to the tail, as every step of a
# loop does. Timing a step after a synchronized device until its own copies
# had landed (as before, kept in the result as step_with_copies_landed_s)
# charged it the tail that a loop hides: host_short at 250 MB/s took 311 ms
# so against 212 ms predicted, and 214-220 ms a step in 8 steps run back to
# back (one synchronize at the end) in a scratch probe.
ADAM_PROBE = 1 << 22
LINK_PROBE_COPIES = 4


def _link_probe(dev, host, buf, stream, done) -> tuple:
    """(h2d, d2h) bytes/s of LINK_PROBE_COPIES copies of `buf`'s size each way."""
    rates = []
    for copy in (lambda: dev.copy_h2d(buf, host, stream), lambda: dev.copy_d2h(host, buf, stream)):
        t = time.perf_counter()
        for _ in range(LINK_PROBE_COPIES):
            copy()
        done.record(stream)
        done.synchronize()
        rates.append(LINK_PROBE_COPIES * buf.nbytes / (time.perf_counter() - t))
    return tuple(rates)


def worker(spec: dict) -> dict:
    """One shape on the simulated device, its steps interleaved with the rate
    probes (or, with spec["calibration"], the hooks' cost: the 2-layer GPT in
    tidal with every state on the device, beside its plain twin)."""
    import torch
    import tidal
    from tidal import _C
    family, shape = spec["family"], spec["shape"]
    tidal.set_device("sim", capacity="2GiB", bandwidth=spec["bandwidth"])
    cfg = config(family, shape)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[family["precision"]]
    torch.manual_seed(0)
    twin = build(family, CALIBRATION_LAYERS).to(dtype)
    torch.manual_seed(0)
    with tidal.init_context(cfg):
        model = build(family, shape["layers"])
    engine = tidal.initialize(model, cfg)
    n = ADAM_PROBE
    w, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    half = torch.full((n,), 1e-3, dtype=dtype)
    dev = tidal.get_device()
    size = 2 * family["chunk"] * (2 if family["precision"] == "fp32" else 1)  # an fp32 chunk
    host, buf = tidal.HostBuffer(size, pin_with=dev), dev.allocate(size)
    stream, done = dev.create_stream("link-probe"), dev.create_event()
    g = torch.Generator().manual_seed(0)
    sums = torch.zeros(n)
    accumulation = shape.get("accumulation", 1)
    out = {"seconds": [], "h2d": [], "d2h": [], "adam_seconds": [], "losses": [], "plain_s": [],
           "adam_probe_params_per_s": [], "fold_probe_params_per_s": [],
           "fold_image_probe_params_per_s": [], "link_probe_h2d": [],
           "link_probe_d2h": [], "others_cpu_seconds": [], "copy_waits": [], "copy_wait_s": [],
           "misses": [], "folds": [], "images_taken_back": [], "fold_worker_s": [],
           "tail_s": []}

    def micro_batches():
        out = []
        for _ in range(accumulation):
            x = torch.randint(0, family["vocab"], (family["batch"], family["seq"]), generator=g)
            out.append((x, torch.roll(x, -1, 1)))
        return out

    def train(batches):
        for x, y in batches:  # (the engine steps at the last micro-batch)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return loss

    for i in range(spec["warmup"] + spec["steps"]):
        lead, batches = micro_batches(), micro_batches()
        x, y = batches[0]
        # The twin runs twice and the second is timed: the first op after the
        # link probe's idle wait ran 25-30% slower than usual at 2 MB/s. One
        # micro-batch: it gives the compute rate.
        twin(x, y).backward()
        with Sample() as plain:
            twin(x, y).backward()
        # Note [A step of the loop]: the lead step, then the timed one, then
        # the tail (the copies the timed step left running) untimed.
        train(lead)
        before, r = engine.chunks.stats(), engine.memory_report()
        adam, opt = r["cpu_adam_seconds"], r["optimizer"]
        with Sample() as step:
            loss = train(batches)
        with Sample() as tail:
            dev.synchronize()
        with Sample() as probe:
            _C.cpu_adam.adam_chunk_step(w, m, v, half, [(0, n)], step=[i + 1], lr=1e-3, beta1=0.9,
                                        beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
                                        bias_correction=True, loss_scale=1.0, max_grad_norm=0.0,
                                        check_overflow=False, grad=None, num_threads=0)
        # Gradient accumulation's fold, as the engine runs it on the host
        # (cpu_adam.fold_gradients: Note [Gradient sums in chunks]).
        with Sample() as fold:
            _C.cpu_adam.fold_gradients(sums, half, w, [(0, n, False)], num_threads=0)
        with Sample() as fold_image:  # (master None: the 16-bit slots keep the gradients)
            _C.cpu_adam.fold_gradients(sums, half, None, [(0, n, False)], num_threads=0)
        up, down = _link_probe(dev, host, buf, stream, done)
        r, now = engine.memory_report(), engine.chunks.stats()
        if i >= spec["warmup"]:
            # The folds the engine made on its update worker (every one
            # beside the simulated device), those that took back the block
            # of their weights, and the worker's time in their passes.
            out["folds"].append(r["optimizer"]["folds_on_worker"] - opt["folds_on_worker"])
            out["images_taken_back"].append(now["images_taken_back"] - before["images_taken_back"])
            out["fold_worker_s"].append(r["optimizer"]["fold_worker_seconds"] - opt["fold_worker_seconds"])
            out["copy_waits"].append(now["copy_waits"] - before["copy_waits"])
            out["copy_wait_s"].append(now["copy_wait_seconds"] - before["copy_wait_seconds"])
            out["misses"].append(now["misses"] - before["misses"])
            out["link_probe_h2d"].append(up)
            out["link_probe_d2h"].append(down)
            out["seconds"].append(step.seconds)
            out["tail_s"].append(tail.seconds)
            out["others_cpu_seconds"].append(step.others)
            out["h2d"].append(r["bytes_host_to_device_last_step"])
            out["d2h"].append(r["bytes_device_to_host_last_step"])
            out["adam_seconds"].append(r["cpu_adam_seconds"] - adam)
            out["plain_s"].append(plain.seconds)
            out["adam_probe_params_per_s"].append(n / probe.seconds)
            out["fold_probe_params_per_s"].append(n / fold.seconds)
            out["fold_image_probe_params_per_s"].append(n / fold_image.seconds)
        out["losses"].append(loss.item())
    r = engine.memory_report()
    common.check_budget(r, "estimate worker")
    out.update(peak_nonchunk_device_bytes=r["peak_nonchunk_device_bytes"],
               peak_device_bytes=r["peak_device_bytes"], budget_overruns=r["budget_overruns"],
               peak_chunk_host_bytes=r["peak_chunk_host_bytes"],
               chunk_spills_to_device=r["chunk_spills_to_device"],
               adam_chunks_on_device=r["adam_chunks_on_device"],
               adam_chunks_on_host=r["adam_chunks_on_host"], chunks=engine.chunks.num_chunks,
               relayouts=engine.relayouts, state_bytes_per_param=r["state_bytes_per_param"],
               largest_model_params=r["largest_model_params"])
    s = engine.chunks.stats()
    out["resident_state_bytes"] = s["resident_bytes_host"] + s["resident_bytes_device"]
    return out


def run_worker(spec: dict, timeout: float = 900) -> dict:
    proc = subprocess.run([sys.executable, HERE, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------- the rates
CALIBRATION_LAYERS = 2


def calibration_flops(family) -> int:
    """FLOPs of the calibration GPT's forward + backward, as the estimate counts them."""
    from tidal.estimate import estimate
    est = estimate(build(family, CALIBRATION_LAYERS, meta=True),
                   config(family, {"device": 1 << 30, "host": 1 << 30}),
                   device_memory="2GiB", host_memory="2GiB", measure=False, rates={})
    return est["time"]["flops"], est["model"]["modules_with_parameters"] + 1


def link_rates(bandwidth: str) -> dict:
    import tidal
    from tidal.estimate import measure_rates
    device = tidal.set_device("sim", capacity="2GiB", bandwidth=bandwidth)
    r = measure_rates(device=device)
    return {"h2d_bytes_per_s": r["h2d_bytes_per_s"][0], "d2h_bytes_per_s": r["d2h_bytes_per_s"][0]}


def hook_cost(family, bandwidth, warmup, steps) -> dict:
    """Seconds per module of tidal's hooks: the calibration GPT in tidal with
    every state on the device (nothing moves) against its plain twin, less
    the Adam time, interleaved in one process."""
    flops, modules = calibration_flops(family)
    shape = {"layers": CALIBRATION_LAYERS, "device": 1 << 30, "host": 1 << 30}
    r = run_worker({"family": family, "shape": shape, "bandwidth": bandwidth, "warmup": warmup,
                    "steps": steps})
    if "error" in r:
        raise SystemExit(f"[estimate] calibration failed: {r['error']}")
    extra = statistics.median(t - p - a for t, p, a in
                              zip(r["seconds"], r["plain_s"], r["adam_seconds"]))
    return {"seconds_per_module": max(0.0, extra) / modules, "modules": modules,
            "tidal_step_s": r["seconds"], "plain_s": r["plain_s"], "adam_s": r["adam_seconds"],
            "h2d": r["h2d"]}


def round_rates(run: dict, hooks: float, flops: int) -> dict:
    cpu_adam = statistics.median(run["adam_probe_params_per_s"])
    return {"h2d_bytes_per_s": statistics.median(run["link_probe_h2d"]),
            "d2h_bytes_per_s": statistics.median(run["link_probe_d2h"]),
            "cpu_adam_params_per_s": cpu_adam, "device_adam_params_per_s": cpu_adam,
            "fold_params_per_s": statistics.median(run["fold_probe_params_per_s"]),
            "fold_image_params_per_s": statistics.median(run["fold_image_probe_params_per_s"]),
            "device_flops_per_s": flops / statistics.median(run["plain_s"]),
            "seconds_per_module": hooks}


# --------------------------------------------------------------------- compare
def predict(family, shape, rates: dict) -> dict:
    from tidal.estimate import estimate
    return estimate(build(family, shape["layers"], meta=True), config(family, shape),
                    device_memory="2GiB", host_memory="64GiB", rates=rates, measure=False)


def _err(pred, meas):
    if meas == 0:
        return 0.0 if pred == 0 else float("inf")
    return pred / meas - 1


# The machine of benchmarks/results/*-nvidia-h100-80gb-hbm3.json: one H100
# 80GB HBM3 and 128 GB of host memory (the "H100 + 128 GB"); and the
# shapes of issue 52: that run's quarter budget, with and without
# accumulation, and a 7B model on a 24 GB card.
H100_RUN = "engine-nvidia-h100-80gb-hbm3.json"
H100_CASES = [
    {"model": "gpt-1.3b", "optimizer_state_dtype": "fp32", "micro_batch": 8, "seq": 1024,
     "why": "the batch of the measured plain PyTorch run on the H100, the whole GPU as the budget"},
    {"model": "gpt-1.3b", "optimizer_state_dtype": "fp32", "micro_batch": 8, "seq": 1024,
     "device_memory_budget": "26.8GB", "measured_run": "tidal_quarter",
     "why": "the H100 run with chunks moving (issue 52): a quarter of the model states beside the "
            "activations as the budget"},
    {"model": "gpt-1.3b", "optimizer_state_dtype": "fp32", "micro_batch": 8, "seq": 1024,
     "device_memory_budget": "26.8GB", "gradient_accumulation_steps": 4,
     "why": "the same with 4 micro-batches per step (accumulation that covers CPU Adam)"},
    {"model": "gpt-6.7b", "optimizer_state_dtype": "fp32", "micro_batch": 1, "seq": 1024,
     "device_memory": "24GB", "why": "a 7B model on a 24 GB card with 128 GB of host memory"},
    {"model": "gpt-13b", "optimizer_state_dtype": "fp32", "micro_batch": 1, "seq": 1024,
     "why": "14 B/param"},
    {"model": "gpt-13b", "optimizer_state_dtype": "bf16", "micro_batch": 1, "seq": 1024,
     "why": "10 B/param (bf16 Adam moments)"},
]


def _measured_on_h100(run: str) -> dict:
    """Bytes each way and the step time of `run` in the H100 result file (the
    code before issue 52), to set beside the prediction."""
    with open(common.RESULTS / H100_RUN) as f:
        r = json.load(f)
    report = r["runs"][run]["report"]
    memory = report["memory"]
    tokens = report["micro_batch"] * report["seq"] * report["gradient_accumulation_steps"]
    return {"file": H100_RUN, "git_commit": r["git_commit"], "device_budget": memory["device_budget"],
            "bytes_host_to_device_last_step": memory["bytes_host_to_device_last_step"],
            "bytes_device_to_host_last_step": memory["bytes_device_to_host_last_step"],
            "tokens_per_s": report["tokens_per_s"], "step_s": tokens / report["tokens_per_s"],
            "prefetch_hit_rate": memory["prefetch_hit_rate"]}


def h100_prediction(output=None) -> None:
    """tidal.estimate for the GPTs of H100_CASES on an H100 80GB (or the card a
    case names) with a 128 GB host, bf16, 64 MiB chunks (configs/gpt_gpu.json),
    with the rates the estimate's defaults name (the H100's measured link and
    plain PyTorch TFLOPS; this CPU's CPU Adam: the H100 host's was not
    measured). A prediction: no GPU run has checked it; where the H100 ran a
    case before issue 52, what it measured is set beside it."""
    from tidal.estimate import DEFAULT_RATES, estimate
    cases = []
    for case in H100_CASES:
        device_memory = case.get("device_memory", "80GB")
        e = estimate(case["model"], str(common.ROOT / "configs" / "gpt_gpu.json"),
                     precision="bf16", optimizer_state_dtype=case["optimizer_state_dtype"],
                     gradient_accumulation_steps=case.get("gradient_accumulation_steps", 1),
                     micro_batch=case["micro_batch"], seq=case["seq"], device_memory=device_memory,
                     device_memory_budget=case.get("device_memory_budget"),
                     host_memory="128GB", rates={}, measure=False)
        row = {**case, "device_memory": device_memory, "estimate": e}
        if "measured_run" in case:
            row["measured_before_issue_52"] = _measured_on_h100(case["measured_run"])
        cases.append(row)
        t = e["time"]
        print(f"[estimate] {device_memory} card (budget {case.get('device_memory_budget', 'all')}) + 128 GB, "
              f"{case['model']} bf16, {e['state_bytes_per_param']} B/param, micro batch "
              f"{case['micro_batch']} x {case['seq']} x {e['gradient_accumulation_steps']}: fits {e['fits']}; "
              f"{e['traffic']['bytes_each_way'] / 2**30:.2f} GiB each way; step on a GPU "
              f"{t['step_s_overlapped']:.3f} s (bottleneck {t['bottleneck']})", flush=True)
    path = common.write_result("estimate_h100_prediction", {
        "simulated": False, "prediction": True,
        "target": {"device": "NVIDIA H100 80GB HBM3", "device_memory": "80GB",
                   "host_memory": "128GB", "precision": "bf16", "config": "configs/gpt_gpu.json"},
        "rates": {k: {"value": v, "source": src} for k, (v, src) in DEFAULT_RATES.items()},
        "cases": cases}, output=output)
    print(f"[estimate] wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bandwidth", default="2GB/s")
    ap.add_argument("--quick", action="store_true", help="smoke run (not tabled)")
    ap.add_argument("--output", default=None)
    ap.add_argument("--h100", action="store_true",
                    help="write the H100 80GB + 128 GB host prediction for gpt-1.3b and gpt-13b "
                         "instead (no training; estimate_h100_prediction-<machine>.json)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.h100:
        return h100_prediction(args.output)
    family, shapes = (QUICK, QUICK_SHAPES) if args.quick else (FAMILY, SHAPES)
    if args.quick:
        args.rounds, args.warmup, args.steps = 1, 3, 2
    flops, _ = calibration_flops(family)
    links, hooks, runs = [], [], {name: [] for name in shapes}
    for rnd in range(args.rounds):
        links.append(link_rates(args.bandwidth))
        hooks.append(hook_cost(family, args.bandwidth, args.warmup, args.steps))
        for name, shape in shapes.items():
            res = run_worker({"family": family, "shape": shape, "bandwidth": args.bandwidth,
                              "warmup": args.warmup, "steps": args.steps})
            if "error" in res:
                raise SystemExit(f"[estimate] shape {name} failed: {res['error']}")
            runs[name].append(res)
            print(f"[estimate] round {rnd + 1}/{args.rounds} {name}: "
                  f"{statistics.median(res['seconds']) * 1e3:.1f} ms/step (plain calibration "
                  f"GPT {statistics.median(res['plain_s']) * 1e3:.1f} ms), "
                  f"{statistics.median(res['h2d']) / 2**20:.2f} MiB up", flush=True)
    link = {k: statistics.median(l[k] for l in links) for k in links[0]}
    hook = statistics.median(h["seconds_per_module"] for h in hooks)
    print(f"[estimate] link {link['h2d_bytes_per_s'] / 1e9:.3f} / "
          f"{link['d2h_bytes_per_s'] / 1e9:.3f} GB/s, hooks {hook * 1e6:.1f} us per module",
          flush=True)

    out = {"family": family, "bandwidth": args.bandwidth, "calibration_layers": CALIBRATION_LAYERS,
           "calibration_flops": flops, "link": link, "link_samples": links,
           "seconds_per_module": hook, "hook_samples": hooks, "shapes": {}}
    worst = {"bytes": 0.0, "time": 0.0}
    for name, shape in shapes.items():
        rounds = []
        for res in runs[name]:
            rates = round_rates(res, hook, flops)
            est = predict(family, shape, rates)
            rounds.append({"rates": rates, "predicted_step_s": est["time"]["step_s"],
                           "measured_step_s": statistics.median(res["seconds"]),
                           "time": est["time"]})
        est = predict(family, shape, rounds[len(rounds) // 2]["rates"])
        seconds = [s for r in runs[name] for s in r["seconds"]]
        landed = [s + t for r in runs[name] for s, t in zip(r["seconds"], r["tail_s"])]
        h2d = [b for r in runs[name] for b in r["h2d"]]
        d2h = [b for r in runs[name] for b in r["d2h"]]
        adam = [b for r in runs[name] for b in r["adam_seconds"]]
        last = runs[name][-1]
        m = {"step_s": common.summarize(seconds),
             # (Note [A step of the loop]: the step and then its tail, the
             # measure of the runs before that Note.)
             "step_with_copies_landed_s": common.summarize(landed),
             "bytes_host_to_device": common.summarize(h2d),
             "bytes_device_to_host": common.summarize(d2h), "adam_s": common.summarize(adam),
             "samples": {"step_s": seconds, "h2d": h2d, "d2h": d2h, "adam_s": adam,
                         "others_cpu_s": [s for r in runs[name] for s in r["others_cpu_seconds"]],
                         **{k: [s for r in runs[name] for s in r[k]]
                            for k in ("tail_s", "copy_waits", "copy_wait_s", "misses", "folds",
                                      "images_taken_back", "fold_worker_s")}},
             **{k: v for k, v in last.items() if not isinstance(v, list)}}
        predicted_step = statistics.median(r["predicted_step_s"] for r in rounds)
        folds = sum(m["samples"]["folds"])
        # Note [The weights' image instead of the restore]: the share of the
        # folds whose chunk took back the block of its weights (the estimate
        # charges every fold so where tidal.fold_images is on).
        m["fold_image_share"] = sum(m["samples"]["images_taken_back"]) / folds if folds else None
        m["fold_worker_s"] = statistics.median(m["samples"]["fold_worker_s"])
        p = {"bytes_host_to_device": est["traffic"]["bytes_host_to_device"],
             "fold_s": statistics.median(r["time"]["fold_s"] for r in rounds),
             "fold_takes_images": est["time"]["fold_takes_images"],
             "bytes_device_to_host": est["traffic"]["bytes_device_to_host"],
             "step_s": predicted_step, "traffic": est["traffic"], "time_median_round": est["time"],
             "state_bytes": est["state_bytes"], "chunks": est["chunk"]["chunks"],
             "activations": est["device"]["activations"], "fits": est["fits"],
             "largest_model_params": est["largest_model_params"]}
        e = {"bytes_host_to_device": _err(p["bytes_host_to_device"], m["bytes_host_to_device"]["median"]),
             "bytes_device_to_host": _err(p["bytes_device_to_host"], m["bytes_device_to_host"]["median"]),
             "step_s": _err(predicted_step, m["step_s"]["median"]),
             "step_s_per_round": [_err(r["predicted_step_s"], r["measured_step_s"]) for r in rounds],
             "step_with_copies_landed_s": _err(predicted_step, m["step_with_copies_landed_s"]["median"]),
             "activations": _err(p["activations"], m["peak_nonchunk_device_bytes"]),
             "state_bytes": _err(p["state_bytes"], m["resident_state_bytes"]),
             # (With accumulation: the folds' time a step against the update
             # worker's passes: the median prediction against the median step.)
             "fold_s": _err(p["fold_s"], m["fold_worker_s"]) if shape.get("accumulation", 1) > 1 else None,
             "chunks": _err(p["chunks"], m["chunks"])}
        worst["bytes"] = max(worst["bytes"], abs(e["bytes_host_to_device"]), abs(e["bytes_device_to_host"]))
        worst["time"] = max(worst["time"], abs(e["step_s"]))
        out["shapes"][name] = {"shape": shape, "state_over_device_budget": est["state_bytes"] / shape["device"],
                               "predicted": p, "measured": m, "relative_error": e, "rounds": rounds}
        print(f"[estimate] {name} (states {est['state_bytes'] / shape['device']:.2f}x the device "
              f"budget): bytes up {p['bytes_host_to_device'] / 2**20:.2f} MiB predicted vs "
              f"{m['bytes_host_to_device']['median'] / 2**20:.2f} MiB measured "
              f"({e['bytes_host_to_device']:+.0%}); step {predicted_step * 1e3:.1f} ms vs "
              f"{m['step_s']['median'] * 1e3:.1f} ms ({e['step_s']:+.0%}; per round "
              f"{', '.join(f'{x:+.0%}' for x in e['step_s_per_round'])}; against the step until "
              f"its copies landed {m['step_with_copies_landed_s']['median'] * 1e3:.1f} ms, "
              f"{e['step_with_copies_landed_s']:+.0%}); bottleneck "
              f"{est['time']['bottleneck']}" +
              (f"; folds {p['fold_s'] * 1e3:.1f} ms predicted vs {m['fold_worker_s'] * 1e3:.1f} "
               f"ms on the worker ({e['fold_s']:+.0%}), {m['fold_image_share']:.0%} of them taking back "
               f"their weights' block" if e["fold_s"] is not None and m["fold_image_share"] is not None else ""),
              flush=True)
    out["worst_relative_error"] = worst
    out["within_25_percent"] = worst["bytes"] <= 0.25 and worst["time"] <= 0.25
    out["load_average"] = os.getloadavg()
    out["quick"] = args.quick
    name = "estimate-quick" if args.quick else "estimate"
    path = common.write_result(name, {"simulated": True, "result": out}, output=args.output)
    print(f"[estimate] worst relative error: bytes {worst['bytes']:.1%}, step time "
          f"{worst['time']:.1%}; wrote {path}")


if __name__ == "__main__":
    main()
