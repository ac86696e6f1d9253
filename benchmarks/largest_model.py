"""The largest GPT that trains in fixed host and device budgets on the
simulated device, at 14 and at 10 bytes per parameter (bf16 mixed precision
with fp32 and with bf16 Adam moments), as a fraction of the limit
(host budget + device budget) / bytes per parameter, beside tidal.estimate's
largest_model_params and fits. Writes
benchmarks/results/largest_model-<machine>.json.

    python benchmarks/largest_model.py [--host 192MiB] [--device 32MiB] [--quick]

A GPT's depth is stepped (a bisection over the number of blocks, then the
blocks just above the largest that trained tried again) and every model is
built straight into chunks (tidal.init_context) and trained in a fresh
process: 5 steps on one batch, "trains" meaning the loss falls (the last
below the first by 0.05), no skipped step, no device budget overrun, and the
device and host peaks within their budgets. A model that fails says how (the
first line of its error). On the simulated device, "device" memory is host
memory: this checks the engine's accounting, not a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.abspath(__file__)
FAMILY = {"d": 128, "heads": 4, "vocab": 96, "seq": 16, "batch": 1, "chunk": 1 << 20}
QUICK_FAMILY = {"d": 64, "heads": 4, "vocab": 96, "seq": 16, "batch": 1, "chunk": 64 << 10}


def config(family, host, device, states):
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0,
            "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": family["batch"],
            "tidal": {"chunk_size": family["chunk"], "host_memory_budget": host,
                      "device_memory_budget": device, "optimizer_state_dtype": states}}


def params_of(family, layers):
    d = family["d"]
    return layers * (12 * d * d + 13 * d) + (family["vocab"] + family["seq"]) * d + 2 * d


def build(family, layers, meta=False):
    import torch
    from tidal.models.gpt import TinyGPT
    kw = dict(vocab=family["vocab"], d=family["d"], layers=layers, heads=family["heads"],
              seq=family["seq"])
    if meta:
        with torch.device("meta"):
            return TinyGPT(**kw)
    return TinyGPT(**kw)


def trial(spec: dict) -> dict:
    """One model in this (fresh) process: does it train?"""
    import torch
    import tidal
    family, host, device = spec["family"], spec["host"], spec["device"]
    tidal.set_device("sim", capacity="1GiB")
    cfg = config(family, host, device, spec["states"])
    out = {"layers": spec["layers"], "params": params_of(family, spec["layers"])}
    t0 = time.perf_counter()
    try:
        with tidal.init_context(cfg):
            model = build(family, spec["layers"])
        engine = tidal.initialize(model, cfg)
        out["largest_model_params"] = engine.memory_report()["largest_model_params"]
        out["state_bytes_per_param"] = engine.memory_report()["state_bytes_per_param"]
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, family["vocab"], (family["batch"], family["seq"]), generator=g)
        losses = []
        for _ in range(5):
            loss = engine(x, torch.roll(x, -1, 1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        r = engine.memory_report()
        out.update(losses=losses, skipped_steps=engine.skipped_steps,
                   budget_overruns=r["budget_overruns"], peak_device_bytes=r["peak_device_bytes"],
                   peak_chunk_host_bytes=r["peak_chunk_host_bytes"],
                   chunk_spills_to_device=r["chunk_spills_to_device"])
        why = []
        if not losses[-1] < losses[0] - 0.05:
            why.append(f"the loss did not fall: {losses}")
        if engine.skipped_steps:
            why.append(f"{engine.skipped_steps} skipped steps")
        if not common.budget_kept(r):
            why.append(f"device budget overrun: {r['budget_overruns']} overruns, peak "
                       f"{r['peak_device_bytes']} > budget {r['device_budget']} less margin {r['device_margin']}")
        if r["peak_chunk_host_bytes"] > host:
            why.append(f"host peak {r['peak_chunk_host_bytes']} > budget {host}")
        out["trains"] = not why
        if why:
            out["why_not"] = "; ".join(why)
    except Exception as e:  # the model does not fit: how it says so
        out["trains"] = False
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:600]}"
    out["seconds"] = time.perf_counter() - t0
    return out


def run_trial(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, HERE, "--trial", json.dumps(spec)],
                          capture_output=True, text=True, timeout=1800)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"layers": spec["layers"], "params": params_of(spec["family"], spec["layers"]),
                "trains": False, "error": f"process failed: {tail[0][:600]}"}
    return json.loads(lines[-1])


def predicted(family, layers, host, device, states) -> dict:
    from tidal.estimate import estimate
    e = estimate(build(family, layers, meta=True), config(family, host, device, states),
                 device_memory=device, host_memory=1 << 40, rates={}, measure=False)
    return {"fits": e["fits"], "fits_states": e["fits_states"],
            "largest_model_params": e["largest_model_params"],
            "largest_trainable_params_estimate": e["largest_trainable_params_estimate"],
            "state_bytes": e["state_bytes"], "needs_on_device_at_once": e["device"]["needs_at_once"],
            "device_chunk_limit": e["device"]["chunk_limit"]}


def search(family, host, device, states, per_param, log, bracket=(0.80, 1.0), above=2) -> dict:
    """Bisects the depth between bracket[0] and bracket[1] of the limit, then
    tries the `above` depths above the largest that trained."""
    limit = (host + device) / per_param
    per_layer = params_of(family, 1) - params_of(family, 0)
    lo = max(1, int((bracket[0] * limit - params_of(family, 0)) / per_layer))
    hi = int((bracket[1] * limit - params_of(family, 0)) / per_layer) + 1
    trials = {}

    def at(layers):
        if layers not in trials:
            spec = {"family": family, "host": host, "device": device, "states": states,
                    "layers": layers}
            t = run_trial(spec)
            t["fraction_of_limit"] = t["params"] / limit
            t["estimate"] = predicted(family, layers, host, device, states)
            trials[layers] = t
            log(f"  {states} moments, {layers} blocks, {t['params'] / 1e6:.2f}M params "
                f"({t['fraction_of_limit']:.3f} of the limit): "
                f"{'trains' if t['trains'] else 'no: ' + (t.get('error') or t.get('why_not', ''))[:160]}"
                f" [estimate: fits={t['estimate']['fits']}] ({t['seconds']:.0f} s)")
        return trials[layers]["trains"]

    while not at(lo) and lo > 1:  # the bracket's low end must train
        hi, lo = lo, max(1, lo // 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid):
            lo = mid
        else:
            hi = mid
    for layers in range(lo + 1, lo + 1 + above):  # is the edge an edge?
        at(layers)
    trained = [t for t in trials.values() if t["trains"]]
    best = max(trained, key=lambda t: t["params"]) if trained else None
    return {"limit_params": limit, "trials": [trials[k] for k in sorted(trials)], "largest": best}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="192MiB")
    ap.add_argument("--device", default="32MiB")
    ap.add_argument("--quick", action="store_true", help="smoke run (not tabled)")
    ap.add_argument("--output", default=None)
    ap.add_argument("--trial", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trial:
        print(json.dumps(trial(json.loads(args.trial))))
        return
    from tidal import parse_bytes
    family = QUICK_FAMILY if args.quick else FAMILY
    host, device = parse_bytes(args.host), parse_bytes(args.device)
    if args.quick:
        host, device = 12 << 20, 4 << 20
    out = {"family": family, "precision": "bf16", "host_budget": host, "device_budget": device,
           "criterion": "5 steps on one batch: last loss < first - 0.05, no skipped step, no "
                        "budget overrun, device and host peaks within their budgets",
           "runs": {}}
    for states, per_param in (("fp32", 14), ("bf16", 10)):
        print(f"[largest_model] optimizer_state_dtype {states} ({per_param} B/param): limit "
              f"{(host + device) / per_param / 1e6:.2f}M parameters", flush=True)
        res = search(family, host, device, states, per_param, lambda s: print(s, flush=True),
                     *(((0.3, 0.3), 0) if args.quick else ()))
        best = res["largest"]
        if best is not None:
            est = best["estimate"]["largest_model_params"]
            res.update(largest_params=best["params"], largest_fraction_of_limit=best["fraction_of_limit"],
                       engine_largest_model_params=best.get("largest_model_params"),
                       estimate_largest_model_params=est,
                       estimate_over_largest_trained=est / best["params"],
                       estimate_largest_trainable=best["estimate"]["largest_trainable_params_estimate"],
                       estimate_trainable_over_largest_trained=(
                           best["estimate"]["largest_trainable_params_estimate"] / best["params"]))
            print(f"[largest_model] {states}: largest that trains {best['params'] / 1e6:.2f}M "
                  f"parameters = {best['fraction_of_limit']:.3f} of the limit; tidal.estimate's "
                  f"largest_model_params {est / 1e6:.2f}M ({est / best['params']:.3f}x it)",
                  flush=True)
        out["runs"][states] = res
    r = out["runs"]
    if r["fp32"].get("largest_params") and r["bf16"].get("largest_params"):
        out["bf16_over_fp32_largest"] = r["bf16"]["largest_params"] / r["fp32"]["largest_params"]
        print(f"[largest_model] 10 B over 14 B: {out['bf16_over_fp32_largest']:.3f}x the "
              f"parameters (14/10 = 1.4)")
    out["quick"] = args.quick
    name = "largest_model-quick" if args.quick else "largest_model"
    path = common.write_result(name, {"simulated": True, "result": out}, output=args.output)
    print(f"[largest_model] wrote {path}")


if __name__ == "__main__":
    main()
