"""The engine on a GPU (issue 14): the measurements scripts/gpu_run.sh runs.

Every run of a model is its own process (a crash, an out-of-memory or a hang in
one loses nothing else, and each has its own peak host memory); this script
starts them, collects what they report and writes the result file.

    python benchmarks/engine_gpu.py bench   [--preset gpt-1.3b --steps 8 --batch 8]
        plain PyTorch + torch.optim.AdamW(fused) vs tidal with the whole GPU as
        budget vs tidal with a quarter of the model states as budget (and once
        at that budget with --quarter-accum micro-batches per step, default 4:
        the accumulation case, Note [Measured where folded]), and the bf16
        matmul rate measured in the same run           -> engine-<machine>.json
    python benchmarks/engine_gpu.py largest [--shapes gpt-6.7b,gpt-8b,...]
        the largest GPT shape that trains 5 steps with the loss falling, against
        (host + device) / 14 B: starts at the largest tidal.estimate predicts to
        fit this machine, then steps up while shapes train, or down until one
        does (each try of a 13-20B model costs minutes of registration)
                                                       -> engine_largest-<machine>.json
    python benchmarks/engine_gpu.py crash
        the gpt-350m crash: tidal-train as is, then (only when that fails, or
        with --all-cases) without pinning, with 256 MiB chunks, and pinned
        HostBuffers of the dedicated-chunk sizes up to ~6 GB, each its own
        process; which crash and how               -> gpu_crash-<machine>.json

--quick runs each on the simulated device (tidal) and the CPU (plain PyTorch)
with tiny shapes, in seconds: it proves the script runs (tests/python/
test_gpu_scripts.py) and its numbers mean nothing. --output names the file.

Definitions (also written into the result files):
  TFLOPS              6 x params x tokens / time (the issue's figure)
  TFLOPS with attn.   (6 x params + 12 x layers x hidden x seq) x tokens / time:
                      adds QK^T and AV, forward and backward, causal not halved
  model states        14 B / parameter (bf16 parameter + fp32 master, m, v)
  quarter budget      the whole-GPU tidal run's peak non-chunk device bytes and
                      device margin + a quarter of the model states
  minimum bytes moved per step, each way: the parameters whose states (parameter
                      + fp32 master, m, v: 14 B in bf16) do not fit in the chunk
                      room (budget - peak non-chunk bytes) are updated by CPU
                      Adam, so their gradients go down and their parameters up
                      once per step: param bytes x max(0, params - room / 14 B)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.abspath(__file__)
STATE_BYTES_PER_PARAM = 14
GiB = 1 << 30
MiB = 1 << 20

LARGEST_FULL = "gpt-6.7b,gpt-8b,gpt-10b,gpt-13b,gpt-14b,gpt-16b,gpt-17b,gpt-18b,gpt-20b"
LARGEST_QUICK = "nano,quick-gpt2"


def result_path(name, output=None):
    """--output, else $TIDAL_RESULTS_DIR/<name>-<machine>.json (tests and gpu_run.sh
    redirect there), else None: benchmarks/results/<name>-<machine>.json."""
    if output:
        return output
    d = os.environ.get("TIDAL_RESULTS_DIR")
    return os.path.join(d, f"{name}-{common.machine_tag()}.json") if d else None


def log(*a):
    print("[engine_gpu]", *a, flush=True)


def shape_of(name):
    """(layers, hidden, heads, seq, vocab) of a GPT shape (tidal.models.gpt.SHAPES)."""
    from tidal.models.gpt import SHAPES
    if name in SHAPES:
        return SHAPES[name]
    raise SystemExit(f"unknown shape '{name}': expected one of {', '.join(SHAPES)}")


def params_of(name):
    from tidal.train import ModelShape
    return ModelShape(*shape_of(name)).params()


def attn_flops_per_token(name, seq):
    layers, d = shape_of(name)[:2]
    return 12 * layers * d * seq


def host_total_bytes():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --------------------------------------------------------------------------- one run per process

def peer_plain(args):
    """Plain PyTorch: TinyGPT on the device, autocast bf16, torch AdamW (fused on CUDA)."""
    import torch
    from tidal.data import synthetic_batches
    from tidal.models.gpt import TinyGPT
    layers, d, heads, seq, vocab = shape_of(args.shape)
    cuda = torch.cuda.is_available() and not args.quick
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=seq).to(dev)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=cuda)
    data = synthetic_batches(vocab, seq, args.batch, dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(args.steps):
        x, y = next(data)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes
        times.append(time.perf_counter() - t)
    steady = times[2:] or times
    return {"peer": "plain", "shape": args.shape, "params": n, "micro_batch": args.batch, "seq": seq,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "tokens_per_s": args.batch * seq * len(steady) / sum(steady),
            "step_seconds": times, "losses": losses, "first_loss": losses[0], "last_loss": losses[-1],
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_device_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None}


def _gpt2_config(name, path):
    layers, d, heads, seq, vocab = shape_of(name)
    with open(path, "w") as f:
        json.dump({"n_layer": layers, "n_embd": d, "n_head": heads, "n_positions": seq,
                   "vocab_size": vocab, "tie_word_embeddings": True}, f)


def peer_tidal(args):
    """tidal-train (tidal.train.run) on a shape, optionally under a budget and a config."""
    from tidal import train as ttrain
    argv = ["--steps", str(args.steps), "--batch", str(args.batch), "--data", "synthetic", "--no-progress"]
    if args.shape in ttrain.PRESETS:
        argv += ["--preset", args.shape]
    else:
        cfg = os.path.join(tempfile.mkdtemp(prefix="tidal_shape_"), f"{args.shape}.json")
        _gpt2_config(args.shape, cfg)
        argv += ["--hf-config", cfg]
    if args.budget:
        argv += ["--budget", str(args.budget)]
    if args.config:
        argv += ["--config", args.config]
    r = ttrain.run(argv)
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # torch's own view next to the engine's: what its caching allocator held at most
        r["torch_max_memory_allocated"] = torch.cuda.max_memory_allocated()
        r["torch_max_memory_reserved"] = torch.cuda.max_memory_reserved()
    r["peer"] = "tidal"
    r["shape"] = args.shape
    r["budget_arg"] = args.budget
    return r


def peer_matmul(args):
    """The bf16 matmul rate of this device: the ceiling next to the training TFLOPS."""
    import torch
    cuda = torch.cuda.is_available() and not args.quick
    n = 8192 if cuda else 256
    dev = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    reps = 50 if cuda else 3
    for _ in range(3):
        a @ b
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if cuda:
        torch.cuda.synchronize()
    s = time.perf_counter() - t
    return {"peer": "matmul", "n": n, "dtype": "bfloat16", "device": dev, "reps": reps,
            "tflops": 2 * n ** 3 * reps / s / 1e12}


def peer_pinloop(args):
    """Pinned HostBuffers of the dedicated-chunk sizes, kept alive, up to --total bytes;
    each one round-trips through the device. Prints one line per buffer (the log shows
    how far it got if it crashes)."""
    import torch
    import tidal
    from tidal.device import parse_bytes
    dev = tidal.get_device()
    sizes = [int(s) for s in args.sizes.split(",")]
    total = parse_bytes(args.total)
    stream = dev.create_stream("pinloop")
    keep, made, i = [], 0, 0
    t0 = time.perf_counter()
    while made < total:
        n = sizes[i % len(sizes)]
        t = time.perf_counter()
        host = tidal.HostBuffer(n, pin_with=dev)
        reg = time.perf_counter() - t
        h = torch.frombuffer(host, dtype=torch.uint8)
        h[: min(n, 1 << 16)] = (torch.arange(min(n, 1 << 16)) % 251).to(torch.uint8)
        h[-4096:] = 7
        d = dev.allocate(n)
        back = tidal.HostBuffer(n, pin_with=dev)
        dev.copy_h2d(d, host, stream)
        dev.copy_d2h(back, d, stream)
        ev = dev.create_event()
        ev.record(stream)
        ev.synchronize()
        ok = torch.equal(torch.frombuffer(back, dtype=torch.uint8), h)
        print(f"[pinloop] buffer {i}: {n} B pinned={host.pinned} register {reg * 1e3:.1f} ms "
              f"roundtrip {'ok' if ok else 'MISMATCH'}; {(made + n) / GiB:.2f} GiB so far", flush=True)
        if not ok:
            raise RuntimeError(f"buffer {i} of {n} bytes came back different from what was copied up")
        del back, d
        keep.append(host)
        made += n
        i += 1
    return {"peer": "pinloop", "buffers": i, "bytes": made, "sizes": sizes, "seconds": time.perf_counter() - t0,
            "pinned": bool(keep and keep[0].pinned), "device": dev.info()["name"]}


PEERS = {"plain": peer_plain, "tidal": peer_tidal, "matmul": peer_matmul, "pinloop": peer_pinloop}


def peer_main(args):
    import faulthandler
    faulthandler.enable()
    r = PEERS[args.kind](args)
    r["peak_host_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(args.json, "w") as f:
        json.dump(r, f, indent=2, default=str)


# --------------------------------------------------------------------------- the driver side

def child(label, argv, timeout, env=None, log_dir=None):
    """Runs argv as its own process under a timeout; returns a dict with rc, how it ended,
    the seconds, what it reported (its --json file) and the tail of its output."""
    fd, out_json = tempfile.mkstemp(prefix="engine_gpu_", suffix=".json")
    os.close(fd)
    os.unlink(out_json)
    argv = [a.replace("{json}", out_json) for a in argv]
    log(f"{label}: {' '.join(argv)} (timeout {timeout:.0f} s)")
    e = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **(env or {}))
    t = time.perf_counter()
    timed_out = False
    try:
        p = subprocess.run(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", timeout=timeout)
        rc, text = p.returncode, p.stdout
    except subprocess.TimeoutExpired as ex:
        timed_out, rc = True, None
        text = ex.stdout.decode(errors="replace") if isinstance(ex.stdout, bytes) else (ex.stdout or "")
    rec = {"label": label, "argv": argv, "rc": rc, "seconds": round(time.perf_counter() - t, 2)}
    if timed_out:
        rec["ended"] = f"timed out after {timeout:.0f} s"
    elif rc < 0:
        rec["ended"] = f"killed by signal {signal.Signals(-rc).name}"
    else:
        rec["ended"] = "ok" if rc == 0 else f"exit status {rc}"
    lines = text.splitlines()
    rec["segv_bt"] = [l for l in lines if "segv_bt" in l or l.startswith(("Fatal Python error", "  File "))][:60]
    err = [l for l in lines if "Error" in l or "error:" in l]
    if err:
        rec["error"] = err[-1][:2000]
    rec["output_tail"] = lines[-30:]
    if log_dir:
        path = os.path.join(log_dir, f"{label.replace(' ', '_').replace('/', '_')}.log")
        with open(path, "w") as f:
            f.write(text)
        rec["log"] = path
    if os.path.exists(out_json):
        with open(out_json) as f:
            rec["report"] = json.load(f)
        os.unlink(out_json)
    rec["ok"] = rc == 0 and "report" in rec
    log(f"{label}: {rec['ended']} in {rec['seconds']} s" + (f"; {rec['error']}" if not rec["ok"] and "error" in rec else ""))
    return rec


def peer_argv(kind, quick, shape=None, steps=None, batch=None, budget=None, config=None, extra=()):
    a = [sys.executable, HERE, "peer", "--kind", kind, "--json", "{json}"]
    for flag, value in (("--shape", shape), ("--steps", steps), ("--batch", batch), ("--budget", budget),
                        ("--config", config)):
        if value:
            a += [flag, str(value)]
    if quick:
        a.append("--quick")
    return a + list(extra)


def tidal_env(quick):
    # --quick: tidal on the simulated device; otherwise what TIDAL_DEVICE says (auto: the GPU).
    return {"TIDAL_DEVICE": "sim"} if quick else {}


def device_total_bytes(quick):
    """The device's memory: the GPU's, or the simulated device's capacity under --quick."""
    if quick:
        os.environ.setdefault("TIDAL_DEVICE", "sim")
        import tidal
        return int(tidal.get_device().info()["capacity"])
    import torch
    return torch.cuda.get_device_properties(0).total_memory


def _derive(run, name, seq, budget=None):
    """Per-step figures of a tidal run's report: TFLOPS with attention, bytes moved vs minimum."""
    r = run["report"]
    n = r["params"]
    toks = r["tokens_per_s"]
    out = {"tokens_per_s": toks, "tflops": r["tflops"],
           "tflops_with_attention": (6 * n + attn_flops_per_token(name, seq)) * toks / 1e12,
           "peak_host_rss_bytes": r.get("peak_host_rss_bytes"),
           # Note [Where a step's time goes] (tidal/train.py): a steady step's host-side
           # seconds in its calls.
           "phase_seconds_steady": r.get("phase_seconds_steady"),
           # Note [What a steady step costs] (tidal/train.py): a steady step's
           # prefetch hits and misses, waits, host pins and evictions.
           "scheduler_steady": r.get("scheduler_steady")}
    m = r.get("memory")
    if m:
        room = max(0, m["device_budget"] - m["peak_nonchunk_device_bytes"])
        elem = 2 if r.get("precision") in ("bf16", "fp16") else 4
        minimum = int(elem * max(0, n - room / (elem + 12)))
        moved_up, moved_down = m["bytes_host_to_device_last_step"], m["bytes_device_to_host_last_step"]
        out.update({
            "device_budget": m["device_budget"], "peak_device_bytes": m["peak_device_bytes"],
            "peak_chunk_device_bytes": m["peak_chunk_device_bytes"],
            "peak_nonchunk_device_bytes": m["peak_nonchunk_device_bytes"],
            "peak_chunk_host_bytes": m["peak_chunk_host_bytes"],
            "host_buffers": r.get("host_bytes"),
            "torch_max_memory_reserved": r.get("torch_max_memory_reserved"),
            "bytes_host_to_device_per_step": moved_up, "bytes_device_to_host_per_step": moved_down,
            "min_bytes_each_way_per_step": minimum,
            "moved_over_minimum": ((moved_up + moved_down) / (2 * minimum)) if minimum else None,
            "prefetch_hit_rate": m["prefetch_hit_rate"], "evictions": m["evictions"],
            "cpu_adam_seconds_per_step": m["cpu_adam_seconds"] / max(1, r["steps"]),
            "optimizer": {k: m["optimizer"].get(k) for k in (
                "adam_seconds", "exposed_adam_seconds", "next_forward_wait_seconds",
                "chunks_updated_under_next_forward", "chunks_updated_during_backward",
                "steps_not_speculated", "folds_on_worker", "fold_worker_seconds",
                "fold_wait_seconds", "sums_measured_in_folds")} if m.get("optimizer") else None,
            "adam_chunks_on_device": m["adam_chunks_on_device"], "adam_chunks_on_host": m["adam_chunks_on_host"],
            "loss_falling": r["last_loss"] < r["first_loss"],
            # A budget is a promise (Note [Who owns a device byte]): where the allocator's
            # reserved bytes are known (torch's on a GPU), their peak within the budget
            # (torch's cap) and no overrun; else the device peak within the budget less
            # the margin and no overrun. Otherwise the run failed.
            "budget_overruns": m["budget_overruns"],
            "peak_reserved_device_bytes": m.get("peak_reserved_device_bytes"),
            "room_on_cache_miss": m.get("room_on_cache_miss"),
            "within_budget": common.reserved_budget_kept(m),
        })
    return out


def cmd_bench(args):
    quick = args.quick
    shape = args.preset or ("nano" if quick else "gpt-1.3b")
    steps = args.steps or (4 if quick else 8)
    batch = args.batch or (2 if quick else 8)
    rounds = args.rounds or (1 if quick else 2)
    pause = 0.0 if quick else args.pause
    seq = shape_of(shape)[3]
    n = params_of(shape)
    result = {"quick": quick, "shape": shape, "params": n, "micro_batch": batch, "seq": seq, "steps": steps,
              "rounds": rounds, "pause_s": pause,
              "definitions": __doc__.split("Definitions (also written into the result files):")[1].strip(),
              "runs": {}}
    name = args.name or ("engine-quick" if quick else "engine")
    save = lambda: common.write_result(name, result, output=result_path(name, args.output))  # noqa: E731
    runs = result["runs"]
    runs["matmul"] = child("matmul", peer_argv("matmul", quick), args.timeout, log_dir=args.log_dir)
    save()
    states = STATE_BYTES_PER_PARAM * n
    quarter_args = {}

    def quarter_budget():
        """From the first whole-GPU run (else the first plain run): its activations
        and margin + a quarter of the model states."""
        if quarter_args:
            return quarter_args
        margin = 0
        whole = runs.get("tidal_whole", {})
        plain = runs.get("plain", {})
        if whole.get("ok"):
            mem = whole["report"]["memory"]
            act, margin = mem["peak_nonchunk_device_bytes"], mem["device_margin"]
            basis = "whole-GPU tidal run's peak non-chunk device bytes (+ its device margin)"
        elif plain.get("ok") and plain["report"]["peak_device_bytes"]:
            act = max(0, plain["report"]["peak_device_bytes"] - 16 * n)
            basis = "plain run's peak device bytes - 16 B/param (the whole-GPU tidal run failed)"
        else:
            act, basis = 0, "no run measured the activations: a quarter of the model states alone"
        quarter = int(margin + act + states / 4)
        result["quarter_budget"] = {"bytes": quarter, "model_state_bytes": states, "activation_bytes": act,
                                    "device_margin": margin, "activation_basis": basis}
        # The same margin as the whole-GPU run, set explicitly: the default (5% of this
        # smaller budget) would leave the chunks the rest of the whole run's margin on top
        # of their quarter (the first H200 run gave them 57% of the states).
        quarter_args.update(budget=quarter, margin=margin,
                            config=_config_file(quick, device_margin=margin) if margin else None)
        return quarter_args

    def run(kind, key):
        if kind == "plain":
            return child(key, peer_argv("plain", quick, shape, steps, batch), args.timeout, log_dir=args.log_dir)
        if kind == "tidal_whole":
            return child(key, peer_argv("tidal", quick, shape, steps, batch), args.timeout,
                         env=tidal_env(quick), log_dir=args.log_dir)
        q = quarter_budget()
        config = q["config"]
        if kind in ("tidal_quarter_accum", "tidal_quarter_accum_restore"):
            # (tokens/s counts every micro-batch: tidal.train's report)
            keys = {"device_margin": q["margin"]} if q["margin"] else {}
            if kind == "tidal_quarter_accum_restore":
                # Every fold writes the weights back from the masters, as before
                # Note [The weights' image instead of the restore].
                keys["fold_images"] = False
            config = _config_file(quick, top={"gradient_accumulation_steps": accum}, **keys)
        return child(key, peer_argv("tidal", quick, shape, steps, batch, budget=q["budget"], config=config),
                     args.timeout, env=tidal_env(quick), log_dir=args.log_dir)

    # Each contender after a pause, in alternating order over the rounds (the first
    # round measures the activations the quarter budget is made from); the
    # accumulation case once, after the first round (device time is short).
    accum = args.quarter_accum if args.quarter_accum is not None else (2 if quick else 4)
    kinds = ["plain", "tidal_whole", "tidal_quarter"]
    order = []
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            order.append((kind, kind if r == 0 else f"{kind}_r{r + 1}"))
        if r == 0 and accum > 1:
            order.append(("tidal_quarter_accum", "tidal_quarter_accum"))
            order.append(("tidal_quarter_accum_restore", "tidal_quarter_accum_restore"))
    if accum > 1:
        kinds += ["tidal_quarter_accum", "tidal_quarter_accum_restore"]
        result["quarter_accumulation"] = accum
    for kind, key in order:
        if pause:
            time.sleep(pause)
        runs[key] = run(kind, key)
        save()
    result["order"] = [key for _, key in order]

    # The figures next to each other: tokens/s as the median over the rounds
    # (every round's in tokens_per_s_rounds), the rest from the first run that worked.
    table = {}
    for kind in kinds:
        ok = [runs[key] for k, key in order if k == kind and runs[key]["ok"]]
        if not ok:
            continue
        if kind == "plain":
            p = ok[0]["report"]
            row = {"tflops": None, "peak_device_bytes": p["peak_device_bytes"],
                   "peak_device_reserved_bytes": p.get("peak_device_reserved_bytes"),
                   "peak_host_rss_bytes": p["peak_host_rss_bytes"]}
        else:
            row = _derive(ok[0], shape, seq)
        speeds = [o["report"]["tokens_per_s"] for o in ok]
        row["tokens_per_s_rounds"] = speeds
        row["tokens_per_s"] = statistics.median(speeds)
        row["tflops"] = 6 * n * row["tokens_per_s"] / 1e12
        row["tflops_with_attention"] = (6 * n + attn_flops_per_token(shape, seq)) * row["tokens_per_s"] / 1e12
        if kind != "plain":
            row["within_budget_every_round"] = all(_derive(o, shape, seq).get("within_budget") for o in ok)
        table[kind] = row
    if runs["matmul"]["ok"]:
        result["matmul_bf16_tflops"] = runs["matmul"]["report"]["tflops"]
        for row in table.values():
            row["tflops_over_matmul_rate"] = row["tflops_with_attention"] / result["matmul_bf16_tflops"]
    ratios = {}
    if "plain" in table:
        for k in ("tidal_whole", "tidal_quarter", "tidal_quarter_accum", "tidal_quarter_accum_restore"):
            if k in table:
                ratios[f"{k}_over_plain_tokens_per_s"] = table[k]["tokens_per_s"] / table["plain"]["tokens_per_s"]
        if "tidal_whole" in table:
            ratios["engine_overhead"] = 1 - ratios["tidal_whole_over_plain_tokens_per_s"]
    result["table"] = table
    result["ratios"] = ratios
    path = save()
    log(f"wrote {path}: {json.dumps(ratios)}")
    return 0 if all(r["ok"] for r in runs.values()) else 1


def cmd_big(args):
    """Issue 39's step 4: a 7B-class GPT whose states exceed the device, at a global batch
    that hides CPU Adam (micro batch x gradient accumulation), its TFLOPS by 6 N per token
    against the bf16 matmul rate of the same run."""
    quick = args.quick
    shape = args.preset or ("nano" if quick else "gpt-6.7b")
    micro = args.batch or (2 if quick else 4)
    accum = args.accum or (2 if quick else 16)
    steps = args.steps or (3 if quick else 4)
    seq = shape_of(shape)[3]
    n = params_of(shape)
    lr = _default_config(quick)["optimizer"]["params"]["lr"]
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                               "warmup_num_steps": 2 * steps, "warmup_type": "linear"}}
    config = _config_file(quick, top={"gradient_accumulation_steps": accum, "scheduler": schedule})
    result = {"quick": quick, "shape": shape, "params": n, "micro_batch": micro, "accumulation": accum,
              "global_batch_tokens": micro * accum * seq, "steps": steps, "seq": seq,
              "model_state_bytes": STATE_BYTES_PER_PARAM * n, "device_bytes": device_total_bytes(quick),
              "goal_tflops": 300, "peer_figure": "MegaTrain: 272 TFLOPS at 7B on one H100 (6 N per token)",
              "runs": {}}
    name = args.name or ("engine_big-quick" if quick else "engine_big")
    save = lambda: common.write_result(name, result, output=result_path(name, args.output))  # noqa: E731
    result["runs"]["matmul"] = child("matmul", peer_argv("matmul", quick), args.timeout, log_dir=args.log_dir)
    save()
    run = child("tidal", peer_argv("tidal", quick, shape, steps, micro, config=config), args.timeout,
                env=tidal_env(quick), log_dir=args.log_dir)
    result["runs"]["tidal"] = run
    if run["ok"]:
        row = _derive(run, shape, seq)
        m = run["report"]["memory"]
        row["states_exceed_device"] = result["model_state_bytes"] > result["device_bytes"]
        row["exposed_adam_seconds_per_step"] = m["optimizer"]["exposed_adam_seconds"] / max(1, run["report"]["steps"])
        result["table"] = row
        if result["runs"]["matmul"]["ok"]:
            result["matmul_bf16_tflops"] = result["runs"]["matmul"]["report"]["tflops"]
            row["tflops_over_matmul_rate"] = row["tflops"] / result["matmul_bf16_tflops"]
        row["meets_goal"] = row["tflops"] >= result["goal_tflops"]
    path = save()
    log(f"wrote {path}")
    return 0 if run["ok"] else 1


def cmd_largest(args):
    quick = args.quick
    shapes = (args.shapes or (LARGEST_QUICK if quick else LARGEST_FULL)).split(",")
    steps = args.steps or 5
    # Batch 1 on a GPU: the largest model is the question, and activations take device room
    # from the chunks (tidal.estimate: 0.88 of the limit at batch 1 on an H200 box, 0.85 at 2).
    batch = args.batch or (2 if quick else 1)
    given = args.host_bytes is not None or args.device_bytes is not None
    if args.predict_only != given or (given and None in (args.host_bytes, args.device_bytes)):
        raise SystemExit("largest: --predict-only goes with both --host-bytes and --device-bytes "
                         "(another machine's memory), and they with it")
    host = args.host_bytes if given else host_total_bytes()
    dev = args.device_bytes if given else device_total_bytes(quick)
    limit = (host + dev) / STATE_BYTES_PER_PARAM
    result = {"quick": quick, "steps": steps, "micro_batch": batch, "host_bytes": host, "device_bytes": dev,
              "limit_params": limit, "limit_formula": "(host + device memory) / 14 B", "tried": []}
    name = args.name or ("engine_largest-quick" if quick else "engine_largest")
    if args.predict_only:
        name = args.name or "engine_largest_prediction"
        result["memory_source"] = "given (--host-bytes, --device-bytes): another machine's; nothing ran"
    # A linear warm-up over the run: at the config's full lr from the first step,
    # gpt-6.7b's loss went 11.7 -> 25.7 on the H200 (plain PyTorch's gpt-1.3b spikes
    # too), and "trains" asks for a falling loss in 5 steps.
    lr = _default_config(quick)["optimizer"]["params"]["lr"]
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                               "warmup_num_steps": 2 * steps, "warmup_type": "linear"}}
    result["scheduler"] = schedule
    # The budgets: the host's and the margin, set so that (host + device) can be used up to
    # the goal: with tidal's defaults (85% of the host, a 5% margin) and batch 4 the largest
    # shape predicted to fit an H200 box is gpt-16b, 0.75 of it
    # (benchmarks/results/engine_largest_prediction_defaults-cpu-2c.json). Under --quick the
    # config's own.
    tidal_keys = {}
    if not quick:
        from tidal.device import parse_bytes
        tidal_keys["host_memory_budget"] = int(args.host_fraction * host)
        tidal_keys["device_margin"] = parse_bytes(args.device_margin)
    result["tidal_keys"] = tidal_keys
    run_config = _config_file(quick, top={"scheduler": schedule}, **tidal_keys)
    result["predicted"] = _predicted_fits(shapes, run_config, batch, dev, host)
    start = _search_start(shapes, result["predicted"])
    result["predicted_largest"] = shapes[start] if result["predicted"][shapes[start]]["fits"] else None
    result["order"] = (f"from {shapes[start]} ({'the largest tidal.estimate predicts to fit' if result['predicted_largest'] else 'none is predicted to fit: the smallest'}), "
                       f"up while shapes train, else down until one does")
    if args.predict_only:
        for s in shapes:
            result["predicted"][s]["params_over_limit"] = params_of(s) / limit
        path = common.write_result(name, result, output=result_path(name, args.output))
        log(f"wrote {path}: predicted largest {result['predicted_largest']}")
        return 0
    deadline = time.monotonic() + args.time_limit

    def attempt(s):
        left = deadline - time.monotonic()
        if left < 30:
            result["stopped"] = f"time limit: {left:.0f} s left before {s}"
            return None
        rec = child(f"largest {s}", peer_argv("tidal", quick, s, steps, batch, config=run_config),
                    min(args.timeout, left), env=tidal_env(quick), log_dir=args.log_dir)
        rec["shape"] = s
        rec["params"] = params_of(s)
        rec["predicted_fits"] = result["predicted"][s]["fits"]
        if rec["ok"]:
            rec.update(_derive(rec, s, shape_of(s)[3]))
            rec["trained"] = (rec["loss_falling"] and rec["within_budget"]
                              and rec["report"]["steps"] >= steps)
        else:
            rec["trained"] = False
        result["tried"].append(rec)
        common.write_result(name, result, output=result_path(name, args.output))
        if not rec["trained"]:
            rec["failure"] = rec["ended"] + ("" if rec["ok"] else f" ({rec.get('error', 'no report')})") \
                + ("" if not rec["ok"] or rec["within_budget"] else
                   f" (over its budget: {rec['budget_overruns']} overruns, peak "
                   f"{rec['peak_device_bytes']} of {rec['device_budget']} bytes)")
        return rec["trained"]

    best_shape = _search(shapes, start, attempt)
    best = next((t for t in result["tried"] if t["shape"] == best_shape), None)
    if "stopped" not in result:  # not the time limit
        failed = [t for t in result["tried"] if not t["trained"]]
        if best and failed:
            result["stopped"] = f"{best['shape']} trains; {failed[-1]['shape']} does not: {failed[-1]['failure']}"
        elif best:
            result["stopped"] = f"every shape from {shapes[start]} up trains ({shapes[-1]} is the last)"
        else:
            result["stopped"] = f"no shape down to {shapes[0]} trains: {failed[-1]['failure']}"
    if best:
        result["largest"] = {"shape": best["shape"], "params": best["params"],
                             "tokens_per_s": best["tokens_per_s"], "tflops": best["tflops"],
                             "tflops_with_attention": best["tflops_with_attention"],
                             "params_over_limit": best["params"] / limit,
                             "predicted_largest": result["predicted_largest"],
                             "first_loss": best["report"]["first_loss"], "last_loss": best["report"]["last_loss"]}
    path = common.write_result(name, result, output=result_path(name, args.output))
    log(f"wrote {path}: largest {result.get('largest')}; stopped: {result.get('stopped')}")
    return 0 if best else 1


def _predicted_fits(shapes, config_path, batch, device_bytes, host_bytes):
    """tidal.estimate's verdict for each shape on this machine under the run's config and
    micro batch: {shape: {fits, params, state_bytes, largest_model_params}} (fits None and
    the error where the estimate fails)."""
    from tidal.estimate import estimate
    from tidal.models.gpt import PRESETS
    folder = tempfile.mkdtemp(prefix="tidal_predict_")
    out = {}
    for s in shapes:
        model = s
        if s not in PRESETS:
            model = os.path.join(folder, f"{s}.json")
            _gpt2_config(s, model)
        try:
            e = estimate(model, config=config_path, device_memory=device_bytes, host_memory=host_bytes,
                         micro_batch=batch, seq=shape_of(s)[3])
            out[s] = {"fits": bool(e["fits"]), "params": e["model"]["parameters"],
                      "state_bytes": e["state_bytes"], "largest_model_params": e["largest_model_params"]}
        except Exception as ex:  # noqa: BLE001 -- a prediction is advice: record it, go on
            out[s] = {"fits": None, "error": f"{type(ex).__name__}: {ex}"}
    return out


def _search_start(shapes, predicted):
    """The index of the largest shape predicted to fit (shapes go smallest first), else 0."""
    fits = [i for i, s in enumerate(shapes) if predicted[s]["fits"]]
    return fits[-1] if fits else 0


def _search(shapes, start, attempt):
    """The largest of `shapes` (smallest first) for which attempt(shape) is True, trying as
    few as it can from `start`: up while shapes train, else down until one does. attempt
    returns None to stop (out of time). Returns the shape, or None."""
    best, up, i = None, None, start
    while 0 <= i < len(shapes):
        ok = attempt(shapes[i])
        if ok is None:
            break
        if ok:
            best = shapes[i]
            if up is False:
                break  # came down to one that trains: the one above it failed
            up, i = True, i + 1
        else:
            if up:
                break  # the one above a shape that trains failed
            up, i = False, i - 1
    return best


def _default_config(quick):
    """tidal-train's default config for this device (configs/gpt_gpu.json on a GPU)."""
    from tidal import train as ttrain
    with open(ttrain.default_config_path(False, not quick)) as f:
        return json.load(f)


def _config_file(quick, pin=None, top=None, **tidal_keys):
    """tidal-train's default config for this device with `tidal_keys` set (and pinning
    turned on or off, and the top-level keys `top`), written to a temporary file;
    returns its path."""
    cfg = _default_config(quick)
    cfg.setdefault("tidal", {}).update(tidal_keys)
    cfg.update(top or {})
    if pin is not None:
        cfg["zero_optimization"] = {"offload_optimizer": {"pin_memory": pin}, "offload_param": {"pin_memory": pin}}
    fd, path = tempfile.mkstemp(prefix="tidal_engine_gpu_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f)
    return path


def cmd_crash(args):
    quick = args.quick
    preset = "nano" if quick else "gpt-350m"
    train = [sys.executable, "-m", "tidal.train", "--preset", preset, "--steps", "3", "--data", "synthetic",
             "--no-progress"]
    sizes = "1048576,2097152" if quick else "103022592,206045184"  # 98.25 / 196.5 MiB: gpt-350m's dedicated chunks
    cases = [  # (label, argv made when the case runs: a skipped one writes no config file)
        ("train", lambda: train),
        ("train_no_pin", lambda: train + ["--config", _config_file(quick, pin=False)]),
        ("train_chunk_256MiB",
         lambda: train + ["--config", _config_file(quick, chunk_size="4MiB" if quick else "256MiB")]),
        ("pinloop", lambda: peer_argv("pinloop", quick, extra=["--sizes", sizes, "--total",
                                                               "16MiB" if quick else "6GiB"])),
    ]
    result = {"quick": quick, "preset": preset, "cases": []}
    name = args.name or ("gpu_crash-quick" if quick else "gpu_crash")
    # The device image has no gdb but has cuda-gdb, which debugs host code too.
    gdb = subprocess.run(["sh", "-c", "command -v gdb || command -v cuda-gdb"], capture_output=True,
                         text=True).stdout.strip().splitlines()
    gdb = gdb[0] if gdb else ""
    result["gdb"] = gdb or None
    for label, make_argv in cases:
        if label != "train" and not args.all_cases and result["cases"] and result["cases"][0]["ok"]:
            # The variants only narrow down a crash of the plain run; when it trains, the
            # device time goes to the next phase (--all-cases runs them anyway).
            result.setdefault("skipped", []).append(label)
            continue
        argv = make_argv()
        rec = child(label, argv, args.timeout, env=tidal_env(quick), log_dir=args.log_dir)
        rec["ok"] = rec["rc"] == 0  # tidal.train writes no --json here: exit 0 is success
        if rec["rc"] is not None and rec["rc"] < 0 and gdb:
            # The same case under gdb, for the stack of every thread.
            g = child(label + " gdb", [gdb, "-batch", "-ex", "run", "-ex", "thread apply all bt 30", "--args"] + argv,
                      args.timeout, env=dict(tidal_env(quick), LD_PRELOAD=""), log_dir=args.log_dir)
            rec["gdb_tail"] = g["output_tail"]
        result["cases"].append(rec)
        common.write_result(name, result, output=result_path(name, args.output))
    result["crashed"] = [c["label"] for c in result["cases"] if not c["ok"]]
    path = common.write_result(name, result, output=result_path(name, args.output))
    log(f"wrote {path}: crashed/failed: {result['crashed'] or 'none'}")
    return 0 if not result["crashed"] else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common_args = argparse.ArgumentParser(add_help=False)
    common_args.add_argument("--quick", action="store_true", help="tiny shapes on the simulated device / CPU")
    common_args.add_argument("--output", default=None, help="result path (default benchmarks/results/<name>-<machine>.json)")
    common_args.add_argument("--name", default=None, help="result name (default by command)")
    common_args.add_argument("--timeout", type=float, default=300, help="seconds per child process")
    common_args.add_argument("--log-dir", default=None, help="write each child's output here")
    b = sub.add_parser("bench", parents=[common_args])
    b.add_argument("--preset", default=None)
    b.add_argument("--steps", type=int, default=None)
    b.add_argument("--batch", type=int, default=None)
    b.add_argument("--rounds", type=int, default=None,
                   help="rounds of plain, whole, quarter in alternating order (default 2; 1 with --quick)")
    b.add_argument("--pause", type=float, default=5.0, help="seconds before each run (not with --quick)")
    b.add_argument("--quarter-accum", type=int, default=None,
                   help="micro-batches per step of the one accumulation run at the quarter budget "
                        "(default 4; 2 with --quick; 0 or 1: none)")
    lg = sub.add_parser("largest", parents=[common_args])
    lg.add_argument("--shapes", default=None, help=f"comma-separated, smallest first (default {LARGEST_FULL})")
    lg.add_argument("--steps", type=int, default=None)
    lg.add_argument("--batch", type=int, default=None)
    lg.add_argument("--time-limit", type=float, default=520, help="stop starting shapes after this many seconds")
    lg.add_argument("--host-fraction", type=float, default=0.9,
                    help="tidal.host_memory_budget as this fraction of the host's memory (not under --quick)")
    lg.add_argument("--device-margin", default="3GiB",
                    help="tidal.device_margin: torch's caching allocator's room (not under --quick)")
    lg.add_argument("--predict-only", action="store_true",
                    help="write tidal.estimate's verdicts for --host-bytes/--device-bytes, train nothing")
    lg.add_argument("--host-bytes", type=int, default=None, help="with --predict-only: the host's memory")
    lg.add_argument("--device-bytes", type=int, default=None, help="with --predict-only: the device's memory")
    bg = sub.add_parser("big", parents=[common_args])
    bg.add_argument("--preset", default=None, help="default gpt-6.7b")
    bg.add_argument("--batch", type=int, default=None, help="micro batch (default 4)")
    bg.add_argument("--accum", type=int, default=None, help="gradient accumulation steps (default 16)")
    bg.add_argument("--steps", type=int, default=None, help="optimizer steps (default 4; from the 3rd on count)")
    cr = sub.add_parser("crash", parents=[common_args])
    cr.add_argument("--all-cases", action="store_true",
                    help="run the diagnostic variants even when the plain tidal-train run passes")
    p = sub.add_parser("peer", parents=[common_args], help="one run in this process (used by the others)")
    p.add_argument("--kind", choices=sorted(PEERS), required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", default=None)
    p.add_argument("--config", default=None)
    p.add_argument("--sizes", default="103022592,206045184")
    p.add_argument("--total", default="6GiB")
    args = ap.parse_args(argv)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    if args.cmd == "peer":
        peer_main(args)
        return 0
    try:
        return {"bench": cmd_bench, "big": cmd_big, "largest": cmd_largest, "crash": cmd_crash}[args.cmd](args)
    except Exception:  # noqa: BLE001 -- the driver's own failure: show it, exit non-zero
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
