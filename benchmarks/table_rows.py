"""What each benchmark's result files give the performance table of
docs/benchmarks.md (and the README's summary): one Figure per row, built from a
result record by the builder PERFORMANCE names for its "benchmark" field.
benchmarks/make_table.py lays the Figures out in tables; this module knows the
result files' fields.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, NamedTuple, Tuple

__all__ = ["PERFORMANCE", "Figure", "Rows", "gib", "machine_of", "mib", "ms", "short_machine_of", "spread"]


# -- formatting -------------------------------------------------------------------------------------------
def machine_of(r: Dict) -> str:
    m = r["machine"]
    gpu = f", {m['gpus'][0]['name']}" if m.get("gpus") else ""
    mem = f", {m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else ""
    # (The SIMD target CPU Adam ran on, where the result names it: hosts of
    # one name have differed, AVX-512 in one session and AVX2 in another.)
    isa = f", {r['kernel_target']}" if r.get("kernel_target") else ""
    # (A run with the suite's GEMM switch on: bf16 products through fp32 GEMM.)
    gemm = ", bf16 GEMM in fp32" if m.get("low_precision_gemm") else ""
    return f"{m['cpu_model']} ({m['cpu_cores']} cores{mem}{isa}{gemm}){gpu}"


def short_machine_of(r: Dict) -> str:
    gpus = r["machine"].get("gpus")
    return gpus[0]["name"] if gpus else machine_of(r)


def spread(t: Dict, unit: str, fmt: str = ".2f", scale: float = 1) -> str:
    """A summarized sample: "median unit (min-max)"."""
    return f"{t['median'] * scale:{fmt}} {unit} ({t['min'] * scale:{fmt}}-{t['max'] * scale:{fmt}})"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


# -- the performance table's rows ------------------------------------------------------------------------
class Figure(NamedTuple):
    """One row of the performance table, less its machine and result file."""
    what: str   # the figure and its conditions
    tidal: str  # tidal's figure
    peer: str   # the peer's figure, then its name
    ratio: str  # tidal / peer


def _versus(what: str, tidal: str, peers: Iterable[Tuple[str, str]]) -> List[Figure]:
    """One Figure per (peer, ratio) against the same tidal figure."""
    return [Figure(what, tidal, peer, ratio) for peer, ratio in peers]


def _device_bandwidth(r: Dict) -> List[Figure]:
    res = r["results"]
    where = "simulated device" if r["simulated"] else res["device_name"]
    out = []
    for direction, label in (("h2d", "host->device"), ("d2h", "device->host")):
        d = res["directions"][direction]
        out.append(Figure(f"{label} copy, {res['transfer_bytes'] / 2**20:.0f} MiB, {where}",
                          spread(d["tidal_gb_per_s"], "GB/s"),
                          f"{d['peer_gb_per_s']['median']:.2f} GB/s, {d['peer']}",
                          f"{d['median_ratio_tidal_to_peer']:.2f}"))
    return out


def _chunk_bookkeeping(r: Dict) -> List[Figure]:
    book = r["result"]["bookkeeping"]
    where = "simulated device" if r["simulated"] else r["result"]["device"]["name"]
    floor = book["peer_floor"]
    out = []
    for key, label in (("resident_trace_opt_prefetch", "trace followed, OPT + prefetch checks"),
                       ("resident_no_trace_lru", "no trace, LRU")):
        t = book[key]
        out.append(Figure(f"chunk bookkeeping per access+release, {book['tensors']} tensors in {book['chunks']} "
                          f"chunks, {label}, {where}",
                          spread(t, "ns", ".1f"),
                          f"{floor['median']:.2f} ns, {book['peer']}",
                          f"{t['median'] / floor['median']:.0f}"))
    return out


_DTR_OVERHEAD_OPS = {"add_4": "a + b of 4 floats", "mm_64": "a 64x64 matmul",
                     "mlp3_step": "a 3-layer MLP training step (64 wide, batch 16), per op"}


def _dtr_overhead(r: Dict) -> List[Figure]:
    out = []
    for key, per in r["per_op_overhead"].items():
        if "tidal_dtr" not in per:
            continue
        ours = per["tidal_dtr"]["us_per_op"]
        out += _versus(
            f"DTR on, nothing evicted, {_DTR_OVERHEAD_OPS.get(key, key)} (CPU, ops intercepted in C++; "
            f"+{ours['median'] - per['plain']['us_per_op']['median']:.2f} us per op over plain)",
            spread(ours, "us"),
            [(f"{per[peer]['us_per_op']['median']:.2f} us, {label}",
              f"{ours['median'] / per[peer]['us_per_op']['median']:.2f}")
             for peer, label in (("plain", "plain PyTorch"),
                                 ("tidal_dtr_python_mode",
                                  "tidal.dtr intercepting in a Python TorchDispatchMode"))])
    return out


def _dtr(r: Dict) -> List[Figure]:
    out = []
    for w in r["workloads"].values():
        plain = w["plain_pytorch_s"]
        for b in w["budgets"]:
            if b["fraction"] not in (0.5, 0.3):
                continue
            out.append(Figure(f"DTR training step at {b['fraction']:.0%} of the no-DTR peak, {w['shape']} "
                              f"(CPU proxy, {b['recomputes']} recomputes)",
                              spread(b, "s"),
                              f"{plain['median']:.2f} s, plain PyTorch without DTR",
                              f"{b['slowdown_vs_plain']:.2f}"))
        m = w["matched_memory"]
        out.append(Figure(f"DTR vs torch.utils.checkpoint per block at the same memory "
                          f"({m['checkpoint_fraction_of_no_dtr_peak']:.0%} of the no-DTR peak), {w['shape']} "
                          f"(CPU proxy)",
                          f"{m['dtr_at_checkpoint_peak_s']['median']:.2f} s",
                          f"{m['checkpoint_per_block_s']['median']:.2f} s, torch.utils.checkpoint",
                          f"{m['dtr_over_checkpoint']:.2f}"))
    return out


# The peers take fp32 grads and write no 16-bit copy: the same 28 bytes per param.
_CPU_ADAM_PEERS = (("torch_adamw_foreach", "torch.optim.AdamW(foreach=True), fp32 grads", "ratio_vs_foreach"),
                   ("torch_adamw_fused", "torch.optim.AdamW(fused=True), fp32 grads", "ratio_vs_fused"),
                   ("deepspeed_cpu_adam", "DeepSpeedCPUAdam 0.19.8, fp32 grads", "ratio_vs_deepspeed"))


def _paired(peer: Dict) -> str:
    """A peer timed in its own process beside tidal's update there (DeepSpeed
    in its venv): tidal's rate in those repeats, which the ratio pairs with;
    the machine's memory bandwidth moves between runs."""
    t = peer.get("paired_tidal_update")
    return "" if not t else f" (tidal {t['params_per_s'] / 1e9:.2f} G params/s in the same repeats)"


def _cpu_adam(r: Dict) -> List[Figure]:
    out = []
    for sz in r["sizes"]:
        t = sz["tidal"]["update"]
        n = f"2^{sz['params'].bit_length() - 1}" if sz["params"] & (sz["params"] - 1) == 0 else str(sz["params"])
        ours = (f"{t['params_per_s'] / 1e9:.2f} G params/s, {t['median_GBps']:.1f} GB/s "
                f"({t['min_max_GBps'][0]:.1f}-{t['min_max_GBps'][1]:.1f})")
        out += _versus(
            f"CPU Adam step, {n} params, fp16 grads + fp16 write-back, {sz['tidal']['kernel_target']}, "
            f"{sz['tidal']['threads']} threads (params/s; higher is better)", ours,
            [(f"{sz[key]['params_per_s'] / 1e9:.2f} G params/s, {label}" + _paired(sz[key]), f"{sz[ratio]:.2f}")
             for key, label, ratio in _CPU_ADAM_PEERS
             if isinstance(sz.get(key), dict) and "params_per_s" in sz[key]])
        out.append(Figure(f"CPU Adam step, {n} params, vs the memory-bandwidth limit "
                          f"({r['bytes_per_param']['update']} B/param moved)",
                          f"{t['median_GBps']:.1f} GB/s",
                          f"{sz['streams']['median_GBps']:.1f} GB/s, same-shape streaming kernel (limit); triad "
                          f"{sz['triad']['median_GBps']:.1f} GB/s",
                          f"{sz['fraction_of_streams']:.2f}"))
        f = sz.get("tidal_fold")
        if f is not None:  # (results from before the fold was measured have none)
            peer = sz["torch_fold_ops"]
            out.append(Figure(
                f"Gradient accumulation's fold, {n} params: fp16 grads into fp32 sums + fp16 weights "
                f"back from the masters ({r['bytes_per_param']['fold']} B/param; params/s, higher is "
                f"better; {f['over_update_rate']:.2f}x the CPU Adam rate in the same repeats)",
                f"{f['params_per_s'] / 1e9:.2f} G params/s, {f['median_GBps']:.1f} GB/s",
                f"{peer['params_per_s'] / 1e9:.2f} G params/s, torch ops ({peer['ops']})",
                f"{peer['ratio_to_tidal_paired']:.2f}"))
        fi = sz.get("tidal_fold_image")
        if f is not None and fi is not None:
            out.append(Figure(
                f"Gradient accumulation's fold, {n} params, where the chunk takes back the block of its "
                f"weights (Note [The weights' image instead of the restore]): fp16 grads into fp32 sums "
                f"only ({r['bytes_per_param']['fold_image']} B/param; params/s, higher is better)",
                f"{fi['params_per_s'] / 1e9:.2f} G params/s, {fi['median_GBps']:.1f} GB/s",
                f"{f['params_per_s'] / 1e9:.2f} G params/s, the fold writing the weights back "
                f"({r['bytes_per_param']['fold']} B/param)",
                f"{fi['over_fold_rate']:.2f}"))
        fm, fs = sz.get("tidal_fold_image_measured"), sz.get("tidal_fold_image_then_measure")
        if fm is not None and fs is not None:
            out.append(Figure(
                f"The window's last fold, {n} params, measuring the sums it writes for the clip (Note "
                f"[Measured in the fold]; params/s, higher is better)",
                f"{fm['params_per_s'] / 1e9:.2f} G params/s, one pass ({r['bytes_per_param']['fold_image']} "
                f"B/param)",
                f"{fs['params_per_s'] / 1e9:.2f} G params/s, the fold then grad_stats over the sums "
                f"({r['bytes_per_param']['fold_image_then_measure']} B/param)",
                f"{fm['over_separate_rate']:.2f}"))
    return out


def _gpt_model(m: Dict) -> str:
    return f"GPT {m['params'] / 1e6:.1f}M params ({m['layers']} layers, d {m['d']}), {m['precision']}"


def _engine_sim(r: Dict) -> List[Figure]:
    res = r["result"]
    m = res["model"]
    plain = res["plain_pytorch_step_s"]
    model = f"{_gpt_model(m)}, batch {m['batch']}x{m['seq']}, simulated device"
    labels = {"fits": "budget holds every state (cost of hooks, chunk views, tracer), hybrid Adam "
                      "(every chunk updated on the device, no bytes moved)",
              "tight": "budget = activations + 1/4 of the parameter chunks, CPU Adam"}
    out = []
    for key, run in res["runs"].items():
        out.append(Figure(f"training step, {model}, {labels.get(key, key)}",
                          spread(run["step_s"], "ms", ".0f", 1e3),
                          f"{plain['median'] * 1e3:.0f} ms, plain PyTorch + torch.optim.AdamW",
                          f"{run['overhead_vs_plain']:.2f}"))
        if run["bytes_host_to_device_per_step"]:
            out.append(Figure(f"bytes moved per step, {model}, {labels.get(key, key)} (host->device; "
                              f"device->host {run['d2h_over_minimum']:.2f}x)",
                              f"{run['bytes_host_to_device_per_step'] / 2**20:.2f} MiB",
                              f"{run['minimum_bytes_each_way'] / 2**20:.2f} MiB, minimum (each chunk down once, "
                              f"gradients up once)",
                              f"{run['h2d_over_minimum']:.2f}"))
    return out


def _engine_offload(r: Dict) -> List[Figure]:
    res = r["result"]
    m = res["model"]
    accum = m.get("gradient_accumulation_steps", 1)
    split = res.get("compute_threads")
    model = (f"{_gpt_model(m)}, batch {m['batch']}x{m['seq']}"
             f"{f', {accum} micro-batches per step' if accum > 1 else ''}, {m['chunks']} chunks, the H100 "
             f"quarter-budget shape (chunk room a quarter of the states beside the activations), simulated "
             f"device with a link and pinning set from compute (the minimum bytes' link time "
             f"{res['link_s_of_minimum'] / res['plain_step_s']['median']:.2f} of the plain step; the H100's "
             f"{res['link_share_of_compute']:.2f})"
             + (f", compute on {split} of the cores and CPU Adam on the other {res['cpu_adam_threads']}"
                if split else ""))
    plain = res["plain_step_s"]
    tidal, before = res["runs"]["tidal"], res["runs"]["before"]
    later = res["runs"].get("weights_at_step")
    ahead = [] if later is None else [
        Figure(f"training step, {model}, weights updated during backward going up then (Note [Weights up "
               f"as they are updated]; forward {tidal['phases']['forward_s'] * 1e3:.0f} ms) against after "
               f"the step (forward {later['phases']['forward_s'] * 1e3:.0f} ms)",
               spread(tidal["step_s"], "ms", ".0f", 1e3),
               f"{later['step_s']['median'] * 1e3:.0f} ms, the weights going up after the step",
               f"{tidal['step_s']['median'] / later['step_s']['median']:.2f}")]
    restore = res["runs"].get("restore_at_fold")
    if restore is not None and "steady_fold_worker_s" in restore:
        ahead.append(Figure(
            f"folds' time on the update worker per steady step, {model}, "
            f"{tidal['steady_images_taken_back']:.0f} chunks a step taking back the block of their weights "
            f"(Note [The weights' image instead of the restore]; step {tidal['step_s']['median'] * 1e3:.1f} ms "
            f"against {restore['step_s']['median'] * 1e3:.1f} ms)",
            f"{tidal['steady_fold_worker_s'] * 1e3:.2f} ms",
            f"{restore['steady_fold_worker_s'] * 1e3:.2f} ms, every fold writing the weights back from the "
            f"masters",
            f"{tidal['steady_fold_worker_s'] / restore['steady_fold_worker_s']:.2f}"))
    return [
        Figure(f"training step, {model} (steady prefetch hit rate {tidal['steady_prefetch_hit_rate']:.2f}, "
               f"{tidal['steady_host_block_allocations']:.0f} host blocks made, "
               f"{tidal.get('steady_host_pins', 0):.0f} pinned, "
               f"{tidal['steady_block_waits']:.0f} block waits; {tidal['over_limit']:.2f}x the limit "
               f"{res['limit_s'] * 1e3:.0f} ms)",
               spread(tidal["step_s"], "ms", ".0f", 1e3),
               f"{plain['median'] * 1e3:.0f} ms, plain PyTorch + torch.optim.AdamW",
               f"{tidal['over_plain']:.2f}"),
        Figure(f"training step, {model}, hybrid Adam's plan against its rule of before issue 52",
               spread(tidal["step_s"], "ms", ".0f", 1e3),
               f"{before['step_s']['median'] * 1e3:.0f} ms, the rule of before (states pulled up to be updated)",
               f"{tidal['step_s']['median'] / before['step_s']['median']:.2f}"),
        Figure(f"bytes moved each way per steady step, {model}",
               mib(tidal["bytes_host_to_device_per_step"]),
               f"{mib(res['shape']['minimum_bytes_each_way'])}, the minimum (16-bit chunks resident, the states "
               f"that fit stay; the rule of before moved {before['h2d_over_minimum']:.2f}x)",
               f"{tidal['h2d_over_minimum']:.2f}"),
    ] + ahead


def _user_param_overhead(r: Dict) -> List[Figure]:
    inside = r["inside_forward"]
    us = inside["microseconds_per_call"]
    return [Figure(f"{r['op']} inside the forward of a model a tidal engine trains, per call (the slope "
                   f"between forwards of {r['calls_per_forward'][0]} and {r['calls_per_forward'][1]} calls, "
                   f"one thread, simulated device; parameters of class "
                   f"{inside['parameter_class_inside_forward']} there)",
                   f"{us['tidal_engine']['median']:.2f} us",
                   f"{us['plain_parameter']['median']:.2f} us, plain PyTorch's nn.Parameter",
                   f"{inside['ratio_median']:.2f}")]


def _engine_accumulation(r: Dict) -> List[Figure]:
    res = r["result"]
    m = res["model"]
    k = res["accumulation_steps"]
    plain = res["plain_pytorch_micro_batch_s"]
    model = (f"{_gpt_model(m)}, micro-batch {m['micro_batch']}x{m['seq']}, {k} micro-batches per step, "
             f"simulated device")
    labels = {"fits": "budget holds every state, hybrid Adam (folds and steps on the device)",
              "tight": "budget = activations + 1/4 of the parameter chunks, folds and CPU Adam on the host"}
    out = []
    for key, run in res["runs"].items():
        moved = run["bytes_host_to_device_per_micro_batch"]
        out.append(Figure(
            f"time per micro-batch with gradient accumulation, {model}, {labels.get(key, key)} "
            f"(gradient sums {run['gradient_sum_bytes_over_master_chunk_bytes']:.2f}x the master chunks' "
            f"bytes; moved per micro-batch {moved / 2**20:.2f} MiB each way, "
            f"{run['h2d_over_minimum']:.2f}x the 16-bit chunks)",
            spread(run["micro_batch_s"], "ms", ".0f", 1e3),
            f"{plain['median'] * 1e3:.0f} ms, plain PyTorch accumulating in param.grad + torch.optim.AdamW",
            f"{run['overhead_vs_plain']:.2f}"))
    return out


def _recompute(r: Dict) -> List[Figure]:
    out = []
    for w in r["workloads"].values():
        c = w["configs"]
        ck, rec, off = (c["torch_checkpoint_per_block"], c["tidal_recompute_min_memory"],
                        c["tidal_recompute_offload"])
        out.append(Figure(f"largest batch at the activation memory no recompute needs at batch 2 "
                          f"({w['budget_bytes'] / 2**20:.0f} MiB), {w['shape']} (CPU proxy)",
                          f"{off['largest_batch']} with offload, {rec['largest_batch']} recompute only",
                          f"{ck['largest_batch']}, torch.utils.checkpoint per block",
                          f"{off['largest_batch'] / ck['largest_batch']:.2f}"))
        out.append(Figure(f"time per sample, tidal.recompute one segment per block, batch {w['time_batch']}, "
                          f"{w['shape']} (CPU proxy)",
                          f"{rec['time_per_sample_s']:.2f} s",
                          f"{ck['time_per_sample_s']:.2f} s, torch.utils.checkpoint per block",
                          f"{rec['time_per_sample_s'] / ck['time_per_sample_s']:.2f}"))
    return out


def _at_least(batch: int, cap: int) -> str:
    """The search stops at its cap: a batch there is a lower bound."""
    return ">= " if batch >= cap else ""


# dtr_batch's workloads: (key in the result file, what was measured, the peer's name).
_DTR_BATCH_WORKLOADS = (
    ("resnet50", lambda w: f"largest batch at a fixed memory ({w['fixed_memory_bytes'] / 2**20:.0f} MiB, the "
                           f"{w['memory_is']}), tidal.dtr, {w['model']} (CPU accounting; cap {w['batch_cap']})",
     "no DTR"),
    ("engine_gpt", lambda w: f"largest batch at a {w['device_budget_bytes'] / 2**20:.0f} MiB device budget, "
                             f"training engine with the config's tidal.dtr, {w['model']} (simulated device; cap "
                             f"{w['batch_cap']})",
     "engine without DTR"),
)


def _dtr_batch(r: Dict) -> List[Figure]:
    out = []
    for key, what, peer in _DTR_BATCH_WORKLOADS:
        if key not in r:
            continue
        w = r[key]
        at_least = _at_least(w["largest_batch_with_dtr"], w["batch_cap"])
        out.append(Figure(what(w), f"{at_least}{w['largest_batch_with_dtr']} with DTR",
                          f"{w['largest_batch_without_dtr']}, {peer}", f"{at_least}{w['ratio']:.2f}"))
    return out


def _engine_batch(r: Dict) -> List[Figure]:
    """Largest batch at a fixed device budget under the training engine, with
    the config's activation_checkpointing block against the engine alone."""
    none = r["configs"]["none"]
    labels = {"recompute": "recompute, one segment per block",
              "offload": "recompute-offload (cpu_checkpointing), one segment per block"}
    out = []
    for plan, label in labels.items():
        c = r["configs"].get(plan)
        if c is None:
            continue
        at_least = _at_least(c["largest_batch"], r["batch_cap"])
        out.append(Figure(
            f"largest batch at a {r['device_budget_bytes'] / 2**20:.0f} MiB device budget, training engine "
            f"with {label}, {r['model']} (simulated device; peak chunks + activations within the budget; "
            f"cap {r['batch_cap']})",
            f"{at_least}{c['largest_batch']} ({c['seconds_per_sample_at_largest'] * 1e3:.1f} ms/sample)",
            f"{none['largest_batch']}, engine without recompute "
            f"({none['seconds_per_sample_at_largest'] * 1e3:.1f} ms/sample)",
            f"{at_least}{c['ratio_to_none']:.2f}"))
    return out


_ENGINE_DTR_MODELS = {
    "gpt": "TinyGPT (vocab 256, d 128, 6 layers, 4 heads, seq 128)",
    "bert": "BERT-like encoder (transformers' BertForMaskedLM: vocab 256, hidden 128, 6 layers, seq 128)",
    "resnet50": "ResNet-50 layout (3-4-6-3 bottlenecks, base width 32, BatchNorm), 64x64 images",
}


def _largest_batches(what: str, big: Dict, ours: str, ours_label: str, peers: Iterable[Tuple[str, str]],
                     at_least: str = "") -> List[Figure]:
    """Largest batch with tidal's `ours` against each (peer, label); "-" where the peer trained none."""
    return [Figure(f"largest batch {what}", f"{at_least}{big[ours]} {ours_label}", f"{big[peer]}, {label}",
                   f"{at_least}{big[ours] / big[peer]:.2f}" if big[peer] else "-")
            for peer, label in peers]


def _engine_dtr_batch(r: Dict) -> List[Figure]:
    """One device budget under the engine: the largest batch with the config's
    tidal.dtr against the engine alone and its static recompute ("auto"), and
    DTR's step time against recompute's at recompute's largest batch."""
    out = []
    for key, m in r["models"].items():
        big = m["largest"]
        cap = m["batch_cap"]
        mono = "monotonic" if all(m["monotonic"].values()) else \
            "NOT monotonic: " + ", ".join(k for k, v in m["monotonic"].items() if not v)
        what = (f"at a {m['device_budget_bytes'] / 2**20:.0f} MiB device budget, training engine, "
                f"{_ENGINE_DTR_MODELS.get(key, key)}, fp32 (simulated device; each trial a fresh process, "
                f"2 steps, the engine's peak within the budget, 0 overruns; fits {mono}; cap {cap})")
        out += _largest_batches(what, big, "dtr", "with tidal.dtr",
                                (("engine", "engine alone"), ("recompute", 'static recompute "auto"')),
                                at_least=_at_least(big["dtr"], cap))
        t = m.get("step_seconds_at_recompute_batch")
        if t and t.get("dtr") and t.get("recompute"):
            out.append(Figure(f"step time at recompute's largest batch ({t['batch']}) {what}",
                              f"{t['dtr'] * 1e3:.0f} ms with tidal.dtr",
                              f"{t['recompute'] * 1e3:.0f} ms, static recompute \"auto\"",
                              f"{t['dtr'] / t['recompute']:.2f}"))
    return out


def _engine_arbiter(r: Dict) -> List[Figure]:
    """The arbiter between chunks and activations against chunks first and
    activations first, under the engine with DTR."""
    m = r["model"]
    what = (f"at a {r['device_budget_bytes'] / 2**20:.0f} MiB device budget, engine + tidal.dtr, "
            f"TinyGPT (vocab {m['vocab']} untied, d {m['d']}, {m['layers']} layers, seq {m['seq']}), "
            f"fp32, link {r['link']} (simulated device)")
    times = r["step_seconds_median"]
    out = []
    for peer, label in (("chunks_first", "chunks first (DTR never evicts a chunk)"),
                        ("activations_first", "activations first")):
        out += _largest_batches(what, r["largest"], "arbiter", "with the arbiter", [(peer, label)])
        if times.get("arbiter") and times.get(peer):
            out.append(Figure(f"step time at batch {r['timed_batch']} {what}",
                              f"{times['arbiter'] * 1e3:.0f} ms with the arbiter",
                              f"{times[peer] * 1e3:.0f} ms, {label}",
                              f"{times['arbiter'] / times[peer]:.2f}"))
    return out


def _linears(sh: Dict) -> str:
    return f"{sh['depth']} x Linear({sh['width']}, {sh['width']})"


def _ms_versus(what: str, ours: float, times: Dict, peers: Iterable[Tuple[str, str]]) -> List[Figure]:
    """Times in ms (one decimal) against each (peer key in `times`, label) that was measured."""
    return [Figure(what, f"{ours * 1e3:.1f} ms", f"{times[peer] * 1e3:.1f} ms, {label}", f"{ours / times[peer]:.2f}")
            for peer, label in peers if peer in times]


def _engine_overhead(r: Dict) -> List[Figure]:
    """The engine's own cost when everything fits: the whole step for a model
    of many small modules (the hooks dominate), the optimizer step alone for
    one of a few large tensors (against AdamW(fused=True))."""
    out = []
    small = r["models"].get("many_small")
    if small is not None:
        sh = small["shape"]
        steps = small["median_step_seconds"]
        floor = (f"; no-op Python hooks of the same kinds: {small['hook_floor_us_per_module']:.0f}"
                 if "hook_floor_us_per_module" in small else "")
        out += _ms_versus(
            f"training step, {_linears(sh)} + tanh, fp32, batch {sh['batch']}, simulated device, budget holds "
            f"every state (hooks: {small['hook_overhead_us_per_module']:.0f} us per module{floor})",
            steps["tidal"], steps,
            [(peer, f"plain PyTorch + torch.optim.AdamW ({label})")
             for peer, label in (("plain", "foreach"), ("plain_fused", "fused=True"))])
    large = r["models"].get("few_large")
    if large is not None:
        sh = large["shape"]
        opt = large["median_optimizer_step_seconds"]
        params = f"({large['parameters'] / 1e6:.1f}M params)"
        target = f"; cpu_adam target {r['cpu_adam_target']}" if "cpu_adam_target" in r else ""
        calls = (f"; {large['step_binding_calls_per_chunk']:.0f} binding calls per chunk"
                 if "step_binding_calls_per_chunk" in large else "")
        if "tidal_median_adam_seconds" in large:
            calls += (f"; {large['tidal_median_adam_seconds'] * 1e3:.1f} ms of the step in its chunk "
                      f"loop: one C++ update call per chunk and the Python around it")
        if "tidal_bf16" in opt:
            out += _ms_versus(
                f"optimizer step in the engine in bf16 (bf16 gradients in, bf16 weights out, fp32 "
                f"master and moments), {_linears(sh)} {params}, simulated device{target}",
                opt["tidal_bf16"], opt,
                [("cpuadam", "tidal.optim.CPUAdam alone on as many fp32 parameters")])
        out += _ms_versus(
            f"optimizer step in the engine, {_linears(sh)} {params}, fp32, simulated device (hybrid Adam: "
            f"the SIMD kernel over the device chunks; 32 bytes of traffic per parameter against "
            f"28, the fp32 working copy written beside the master: Note [The fp32 working "
            f"copy] in hooks/chunk_step.h{target}{calls})",
            opt["tidal"], opt,
            [("plain_fused", "torch.optim.AdamW(fused=True) on the same CPU"),
             ("cpuadam", "tidal.optim.CPUAdam alone on the same CPU")])
        for run, peer, what in (("tidal_torch", "tidal", "the engine's optimizer step right after backward"),
                                ("cpuadam_torch", "cpuadam", "tidal.optim.CPUAdam alone right after backward")):
            if run in opt:
                out += _ms_versus(
                    f"{what}, fp32, {_linears(sh)}: CPU Adam on torch's intra-op threads (tidal.cpu_adam_pool / "
                    f"thread_pool \"torch\"){target}",
                    opt[run], opt, [(peer, "the same on oneTBB's threads (\"onetbb\", the default)")])
    return out


def _exposed_adam(what: str, ours: Dict, peer_seconds: float, peer: str, ratio: float) -> Figure:
    """CPU Adam time left exposed after backward per step (step_overlap and step_overlap_clip)."""
    return Figure(f"CPU Adam time exposed after backward per step, {what} (of "
                  f"{ours['adam_seconds_median'] * 1e3:.1f} ms of CPU Adam: {ours['exposed_share_of_adam']:.0%})",
                  f"{ours['exposed_adam_seconds_median'] * 1e3:.1f} ms",
                  f"{peer_seconds * 1e3:.1f} ms, {peer}", f"{ratio:.2f}")


def _tiny_gpt(sh: Dict) -> str:
    return f"TinyGPT (vocab {sh['vocab']}, d {sh['d']}, {sh['layers']} layers"


def _clip_all_shares(p: Dict) -> str:
    """The clip_all case's exposed share by mean, against CPU Adam without
    overlap, and the step where the clip starts to fire (result files since
    issue 52's last wave)."""
    if "exposed_on_over_adam_off" not in p:
        return ""
    on, t = p["on"], p.get("transition")
    out = (f"; by mean {on['exposed_share_of_adam_mean']:.0%} of its CPU Adam; against CPU Adam without overlap "
           f"{p['exposed_on_over_adam_off']:.0%} by median, {p['exposed_mean_on_over_adam_mean_off']:.0%} by mean")
    if "first_module_share" in p:
        out += (f"; the next forward's first module ({p['first_module']}) needs "
                f"{p['first_module_share']:.0%} of the parameters updated before it can start: the floor of "
                f"that forward's wait")
    if t:
        out += (f"; the one step where the clip starts to fire exposes {t['exposed_adam_seconds'] * 1e3:.1f} ms "
                f"of {t['adam_seconds'] * 1e3:.1f} ms ({t['undone_chunk_updates']} speculative updates undone)")
    return out


def _step_overlap_clip(r: Dict) -> List[Figure]:
    """Speculative CPU Adam during backward (clipping 1.0, hybrid Adam) against the step without overlap."""
    sh = r["shape"]
    out = []
    for case, p in r["cases"].items():
        on, off = p["on"], p["off"]
        what = (f"{_tiny_gpt(sh)}; {p['parameters'] / 1e6:.1f}M params), {p['precision']}, gradient_clipping "
                f"1.0, hybrid Adam, budget {sh['budget']}, case {case} ({on['undone_chunk_updates']} chunk "
                f"updates undone), simulated device")
        if r.get("compute_threads"):
            what += (f", torch on {r['compute_threads']} thread(s) and CPU Adam on {r['cpu_adam_threads']} (the "
                     f"cores apart, as a GPU's compute and its host's)")
        out.append(_exposed_adam(f"tidal.overlap_step on (default), {what}", on,
                                 off["exposed_adam_seconds_median"], "overlap_step off",
                                 p["exposed_ratio_on_to_off"]))
        if "on_backward_only" in p:
            # Issue 52: the clip on every step; the updates under the next forward.
            b = p["on_backward_only"]
            out.append(_exposed_adam(
                f"the clip firing on every step, CPU Adam under the next forward "
                f"(tidal.overlap_next_forward, default; {on['chunks_updated_under_next_forward']} chunk "
                f"updates there{_clip_all_shares(p)}), {what}", on, b["exposed_adam_seconds_median"],
                "overlap during backward only (overlap_next_forward false)",
                on["exposed_adam_seconds_median"] / b["exposed_adam_seconds_median"]))
        if "on_worker_all_cores" in p:
            # Note [The worker leaves a core] (python/tidal/engine/overlap.py).
            w = p["on_worker_all_cores"]
            out.append(_exposed_adam(
                f"the clip firing on every step, the worker's updates leaving the caller a core (default; by "
                f"mean {on['exposed_share_of_adam_mean']:.0%}), {what}", on, w["exposed_adam_seconds_median"],
                f"the worker's updates on every core ({w['exposed_share_of_adam']:.0%} of its "
                f"{w['adam_seconds_median'] * 1e3:.1f} ms by median, {w['exposed_share_of_adam_mean']:.0%} by mean)",
                on["exposed_adam_seconds_median"] / w["exposed_adam_seconds_median"]))
    return out


def _step_overlap_cost(r: Dict) -> List[Figure]:
    """Speculation only where backward hides it, against speculating every chunk and no overlap."""
    sh, e = r["shape"], r["engines"]
    ours = e["default"]
    accum = r.get("gradient_accumulation_steps", 1)
    window = f" x {accum} micro-batches per step" if accum > 1 else ""
    what = (f"whole training step, CPU Adam large beside backward: {_tiny_gpt(sh)}, seq {sh['seq']}, micro batch "
            f"{sh['batch']}{window}; {r['parameters'] / 1e6:.1f}M params), bf16, gradient_clipping 1.0 (not firing), "
            f"budget {sh['budget']}, states on the host; a speculative update launched only where it ends "
            f"before backward (default: {ours['chunks_updated_during_backward']} chunk updates during "
            f"backward, {ours['chunks_left_to_the_step_by_cost']} left to the step and by it to the next forward; exposed CPU "
            f"Adam {ours['exposed_adam_seconds_median'] * 1e3:.1f} ms), simulated device, backward and CPU Adam "
            f"sharing the cores")
    out = []
    for peer, label in (("speculate_all", "every chunk speculated, as before"),
                        ("off", "overlap_step off")):
        p = e[peer]
        out.append(Figure(what, f"{ours['step_seconds_median'] * 1e3:.1f} ms",
                          f"{p['step_seconds_median'] * 1e3:.1f} ms, {label} (exposed CPU Adam "
                          f"{p['exposed_adam_seconds_median'] * 1e3:.1f} ms)",
                          f"{ours['step_seconds_median'] / p['step_seconds_median']:.2f}"))
    return out


def _step_overlap(r: Dict) -> List[Figure]:
    """CPU Adam during backward (tidal.overlap_step) against the step after backward."""
    sh = r["shape"]
    out = []
    for precision, p in r["precisions"].items():
        o, s = p["overlap"], p["step"]
        what = (f"{_tiny_gpt(sh)}, seq {sh['seq']}, batch {sh['batch']}; {p['parameters'] / 1e6:.1f}M params), "
                f"{precision}, states on the host (hybrid_adam off), simulated device, cpu_adam target "
                f"{r['cpu_adam_target']}")
        out.append(_exposed_adam(f"with tidal.overlap_step, {what}", o, s["exposed_adam_seconds_median"],
                                 "the step after backward", p["exposed_ratio_overlap_to_step"]))
        out.append(Figure(f"training step with tidal.overlap_step, {what} (backward and CPU Adam share the 2 "
                          f"cores)",
                          f"{o['step_seconds_median'] * 1e3:.1f} ms",
                          f"{s['step_seconds_median'] * 1e3:.1f} ms, the step after backward",
                          f"{p['step_ratio_overlap_to_step']:.2f}"))
        if "overlap_torch" in p:
            t = p["overlap_torch"]
            out.append(Figure(f"training step with tidal.overlap_step, CPU Adam on torch's intra-op threads "
                              f"(tidal.cpu_adam_pool \"torch\"), {what} (exposed CPU Adam "
                              f"{t['exposed_share_of_adam']:.0%} of it)",
                              f"{t['step_seconds_median'] * 1e3:.1f} ms",
                              f"{o['step_seconds_median'] * 1e3:.1f} ms, the same on oneTBB's threads "
                              f"(\"onetbb\", the default)",
                              f"{p['step_ratio_overlap_torch_to_overlap']:.2f}"))
    return out


def _engine_gpu(r: Dict) -> List[Figure]:
    """benchmarks/engine_gpu.py bench: tidal-train against plain PyTorch + fused
    AdamW on one GPU, with the whole GPU as the device budget and, where it
    trained, with a quarter of the model states (chunks moving)."""
    t = r["table"]
    plain = t["plain"]
    gpu = r["machine"]["gpus"][0]["name"]
    def what_of(window=""):
        return (f"training {r['shape']} ({r['params'] / 1e9:.2f}B params), bf16, micro batch "
                f"{r['micro_batch']} x {r['seq']}{window}, {r['steps']} steps, {gpu}")

    what = what_of()
    peer = f"{plain['tokens_per_s']:,.0f} tokens/s, plain PyTorch + fused AdamW"
    out = []
    whole = t.get("tidal_whole")
    if whole is not None:
        out.append(Figure(f"{what}, the whole GPU as the device budget (tokens/s, higher is better; nothing "
                          f"moves)",
                          f"{whole['tokens_per_s']:,.0f} tokens/s ({whole['tflops']:.0f} TFLOPS by 6N)", peer,
                          f"{whole['tokens_per_s'] / plain['tokens_per_s']:.2f}"))
    quarter = t.get("tidal_quarter")
    if quarter is not None:
        q = r["quarter_budget"]
        out.append(Figure(
            f"{what}, a device budget of {q['bytes'] / 1e9:.1f} GB: a quarter of the model states + the "
            f"activations + the margin (tokens/s, higher is better; "
            f"{quarter['bytes_host_to_device_per_step'] / 2**30:.1f} GiB moved each way per step, "
            f"{quarter['moved_over_minimum']:.1f}x the minimum; {quarter['budget_overruns']} budget overruns)",
            f"{quarter['tokens_per_s']:,.0f} tokens/s", peer,
            f"{quarter['tokens_per_s'] / plain['tokens_per_s']:.3f}"))
    accum = t.get("tidal_quarter_accum")
    if accum is not None:
        q = r["quarter_budget"]
        window = f" x {r['quarter_accumulation']} micro-batches per step"
        out.append(Figure(
            f"{what_of(window)}, the same device budget of "
            f"{q['bytes'] / 1e9:.1f} GB (tokens/s, higher is better; "
            f"{accum['bytes_host_to_device_per_step'] / 2**30:.1f} GiB moved each way per step; "
            f"{accum['budget_overruns']} budget overruns)",
            f"{accum['tokens_per_s']:,.0f} tokens/s", peer,
            f"{accum['tokens_per_s'] / plain['tokens_per_s']:.3f}"))
    restore = t.get("tidal_quarter_accum_restore")
    if accum is not None and restore is not None:
        out.append(Figure(
            f"{what_of(window)}, the same device budget, folds taking back the block of the weights "
            f"(Note [The weights' image instead of the restore]) against every fold writing them back "
            f"from the masters (tidal.fold_images false; tokens/s, higher is better)",
            f"{accum['tokens_per_s']:,.0f} tokens/s", f"{restore['tokens_per_s']:,.0f} tokens/s, every fold "
            f"writing the weights back", f"{accum['tokens_per_s'] / restore['tokens_per_s']:.3f}"))
    return out


def _data_parallel(r: Dict) -> List[Figure]:
    m = r["model"]
    out = []
    for world, run in r["runs"].items():
        if run["world_size"] < 2 or not run.get("overlap_comm", True):
            continue
        sent = sum(run["tidal_bytes_per_rank_step"]) / len(run["tidal_bytes_per_rank_step"])
        step = f"step {run['step_s']['median'] * 1e3:.0f} ms"
        off = r["runs"].get(f"{world}-no-overlap")
        if "seconds_in_collectives_per_step" in run and off is not None:
            step += (f" ({run['seconds_in_collectives_per_step']['median'] * 1e3:.0f} ms blocked in "
                     f"collectives), {off['step_s']['median'] * 1e3:.0f} ms "
                     f"({off['seconds_in_collectives_per_step']['median'] * 1e3:.0f} ms) with "
                     f"overlap_comm off")
        out.append(Figure(
            f"data parallel, bytes sent per rank per step, {world} ranks (gloo over loopback, simulated "
            f"device, GPT {m['params'] / 1e6:.1f}M params fp32, micro-batch {m['batch']} per rank; on the "
            f"wire incl. gloo and TCP: {run['wire_bytes_per_rank_step'] / 2**20:.2f} MiB, "
            f"{run['wire_over_minimum']:.2f}x; {step}; 2 shared cores)",
            f"{sent / 2**20:.2f} MiB",
            f"{run['minimum_bytes_per_rank_step'] / 2**20:.2f} MiB, ring reduce-scatter + all-gather "
            f"minimum 2(N-1)/N x the 16-bit model",
            f"{run['tidal_over_minimum']:.2f}"))
    return out


class Rows(NamedTuple):
    """The Figures one benchmark's result files give the performance table."""
    figures: Callable[[Dict], List[Figure]]
    skip_quick: bool = False  # a result file with "quick": true gives none


def _nvme_bandwidth(r: Dict) -> List[Figure]:
    where = f"{r['slots']} chunks of {mib(r['slot_bytes'])}, {r['threads']} requests of {mib(r['request_bytes'])} in flight"
    out = []
    for backend in r.get("backends", []):
        for way in ("write", "read"):
            cpu = r[f"{backend}_{way}_cpu_s_per_gb"]["median"]
            out.append(Figure(f"NVMe tier's file, {way}, {backend} backend ({where})",
                              f"{spread(r[f'{backend}_{way}_gb_per_s'], 'GB/s')}, {cpu:.2f} CPU s/GB",
                              f"{r[f'dd_{way}_gb_per_s']['median']:.2f} GB/s, dd bs=1M with O_DIRECT on the same folder",
                              f"{r[f'{backend}_{way}_ratio_to_dd']:.2f}"))
    return out


def _nvme_train(r: Dict) -> List[Figure]:
    m = r["model"]
    what = (f"{m['params'] / 1e6:.1f}M-parameter GPT in {m['precision']}, optimizer states on the NVMe tier "
            f"(states {r['states_over_host_budget']:.1f}x the host budget of {mib(r['host_budget'])}, "
            f"simulated device)")
    step = r["nvme_step_seconds"]
    # A run that began on a loaded machine (other jobs: its load_average) gives
    # bytes, not times.
    quiet = r.get("load_average", {}).get("start", [0.0])[0] < 3
    return ([
        Figure(f"training step, {what}", spread(step, "ms", ".0f", 1e3),
               f"{r['memory_step_seconds']['median'] * 1e3:.0f} ms, the same model with the states in host memory",
               f"{r['step_ratio_nvme_to_memory']:.2f}")] if quiet else []) + [
        Figure(f"disk bytes per step, {what}",
               f"{mib(r['disk_read_bytes_per_step'])} read, {mib(r['disk_written_bytes_per_step'])} written",
               f"{mib(r['disk_min_bytes_per_step_each_way'])} each way, the minimum (every chunk on disk read and "
               f"written once)", f"{max(r['read_over_min'], r['written_over_min']):.2f}"),
    ] + _nvme_train_param(r)


def _nvme_train_param(r: Dict) -> List[Figure]:
    """Both lists on the NVMe tier (offload_param): chunks read and not changed
    go back to disk without a write, against the run that writes every one.
    Bytes only: the step times of the result measured so far are other jobs'
    load (its load_average), not the skip's."""
    p = r.get("offload_param")
    if p is None:
        return []
    m = r["model"]
    what = (f"{m['params'] / 1e6:.1f}M-parameter GPT in {m['precision']}, 16-bit parameters and optimizer "
            f"states on the NVMe tier (offload_param; host budget {mib(p['host_budget'])}, simulated device)")
    skip, noskip = p["skip"], p["no_skip"]
    return [
        Figure(f"disk bytes written per step, unchanged chunks not written back, {what}",
               f"{mib(skip['disk_written_bytes_per_step'])} ({mib(skip['disk_write_skipped_bytes_per_step'])} "
               f"not written)",
               f"{mib(noskip['disk_written_bytes_per_step'])}, every chunk written back "
               f"(tidal.nvme_skip_clean_writes off)", f"{p['written_ratio_skip_to_no_skip']:.2f}"),
    ]


def _step_overlap_idle(r: Dict) -> List[Figure]:
    out = []
    shape = r["shape"]
    for key, case in r["cases"].items():
        where, precision = key.split("_")
        what = (f"engine.step() right after backward, after {r['idle_seconds'] * 1e3:.0f} ms of idle CPU, "
                f"{shape['depth']} x Linear({shape['width']}) ({case['parameters'] / 1e6:.1f}M params), {precision}, "
                f"states on the {where} (a {r['budgets'][where]} device budget)"
                f", overlap off (paired ratio median)")
        out.append(Figure(what, spread(case["step"], "ms", ".1f", 1e3),
                          f"{case['cpuadam']['median'] * 1e3:.1f} ms, tidal.optim.CPUAdam alone after the same idle",
                          f"{case['ratio_step_to_cpuadam_paired']['median']:.2f}"))
    return out


def _evict_ahead_shape(sh: Dict, link: str) -> str:
    """The shape benchmarks/evict_ahead.py and clean_down.py train, on one link."""
    return (f"training step, GPT (vocab {sh['vocab']}, d {sh['d']}, {sh['layers']} layers, 1 MiB chunks, "
            f"bf16), chunk room a quarter of the 16-bit chunks beside the activations, simulated link "
            f"{link} each way")


def _evict_ahead(r: Dict) -> List[Figure]:
    """Chunks a lowering evicts leaving at their last use before it, against leaving at the point."""
    sh = r["shape"]
    out = []
    for link, p in r["links"].items():
        ahead, at = p["ahead"], p["at_points"]
        what = (f"{_evict_ahead_shape(sh, link)}, the chunks a trace point's lowering evicts leaving at their last use before it "
                f"(tidal.evict_ahead, default; {ahead['evictions_ahead_per_step']:.0f} of "
                f"{ahead['evictions_per_step']:.0f} evictions a step; block waits "
                f"{ahead['block_waits_per_step']:.1f} a step, {ahead['block_wait_seconds_per_step'] * 1e3:.1f} ms, "
                f"against {at['block_waits_per_step']:.1f}, {at['block_wait_seconds_per_step'] * 1e3:.1f} ms; "
                f"{ahead['bytes_host_to_device_per_step'] / 2**20:.1f} MiB up a step either way; "
                f"{p['ahead_over_fits']:.2f}x the step where everything fits)")
        out.append(Figure(what, spread(ahead["step_s"], "ms", ".0f", 1e3),
                          f"{at['step_s']['median'] * 1e3:.0f} ms, leaving at the point (evict_ahead off)",
                          f"{p['step_ahead_over_at_points']:.2f}"))
    return out


def _clean_down(r: Dict) -> List[Figure]:
    """16-bit chunks that forward only read leaving the device without a copy, against copying."""
    sh = r["shape"]
    out = []
    for link, p in r["links"].items():
        clean, copies = p["clean"], p["copies"]
        what = (f"{_evict_ahead_shape(sh, link)}, chunks leaving the device unchanged taking back their host blocks without a "
                f"copy (tidal.skip_clean_copies, default; {clean['copies_down_skipped_per_step']:.0f} copies a step "
                f"skipped; {clean['bytes_device_to_host_per_step'] / 2**20:.1f} MiB down a step against "
                f"{copies['bytes_device_to_host_per_step'] / 2**20:.1f}, "
                f"{clean['bytes_host_to_device_per_step'] / 2**20:.1f} MiB up either way; block waits "
                f"{clean['block_waits_per_step']:.1f} a step, {clean['block_wait_seconds_per_step'] * 1e3:.1f} ms, "
                f"against {copies['block_waits_per_step']:.1f}, "
                f"{copies['block_wait_seconds_per_step'] * 1e3:.1f} ms; "
                f"{p['clean_over_fits']:.2f}x the step where everything fits)")
        out.append(Figure(what, spread(clean["step_s"], "ms", ".0f", 1e3),
                          f"{copies['step_s']['median'] * 1e3:.0f} ms, every move down copying "
                          f"(skip_clean_copies off)",
                          f"{p['step_clean_over_copies']:.2f}"))
    return out


# Per result file's "benchmark" field.
PERFORMANCE: Dict[str, Rows] = {
    "step_overlap_idle": Rows(_step_overlap_idle, skip_quick=True),
    "nvme_bandwidth": Rows(_nvme_bandwidth),
    "nvme_train": Rows(_nvme_train, skip_quick=True),
    "dtr_batch": Rows(_dtr_batch),
    "engine_batch": Rows(_engine_batch),
    "engine_dtr_batch": Rows(_engine_dtr_batch, skip_quick=True),
    "engine_arbiter": Rows(_engine_arbiter, skip_quick=True),
    "step_overlap": Rows(_step_overlap, skip_quick=True),
    "step_overlap_clip": Rows(_step_overlap_clip, skip_quick=True),
    "step_overlap_clip-vocab2048": Rows(_step_overlap_clip, skip_quick=True),
    "step_overlap_clip-compute1": Rows(_step_overlap_clip, skip_quick=True),
    "step_overlap_clip-vocab2048-compute1": Rows(_step_overlap_clip, skip_quick=True),
    "step_overlap_cost": Rows(_step_overlap_cost, skip_quick=True),
    "evict_ahead": Rows(_evict_ahead, skip_quick=True),
    "clean_down": Rows(_clean_down, skip_quick=True),
    "step_overlap_cost-accum2": Rows(_step_overlap_cost, skip_quick=True),
    "cpu_adam": Rows(_cpu_adam),
    "device_bandwidth": Rows(_device_bandwidth),
    "chunk_bookkeeping": Rows(_chunk_bookkeeping),
    "dtr-resnet50": Rows(_dtr),
    "dtr-gpt2_small": Rows(_dtr),
    "dtr-overhead": Rows(_dtr_overhead),
    "engine_sim": Rows(_engine_sim),
    "engine_offload": Rows(_engine_offload, skip_quick=True),
    "engine_offload-accum2": Rows(_engine_offload, skip_quick=True),
    "engine_offload-compute1": Rows(_engine_offload, skip_quick=True),
    "engine_offload-accum2-compute1": Rows(_engine_offload, skip_quick=True),
    "engine": Rows(_engine_gpu, skip_quick=True),
    "engine_accumulation": Rows(_engine_accumulation),
    "user_param_overhead": Rows(_user_param_overhead, skip_quick=True),
    "engine_overhead": Rows(_engine_overhead),
    "recompute": Rows(_recompute),
    "data_parallel": Rows(_data_parallel),
}
