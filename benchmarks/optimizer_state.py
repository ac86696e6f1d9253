"""bf16 Adam moments train like fp32 moments: tidal-train's GPT on its
built-in text (byte-level tokens of the Python standard library's
docstrings), bf16 mixed precision, the same seed, data and config but
tidal.optimizer_state_dtype, fp32 (14 bytes per parameter) against bf16
(10 bytes). Writes benchmarks/results/optimizer_state-<machine>.json with
both loss curves, the held-out loss and the final losses (the mean of the
last 20 steps).

    python benchmarks/optimizer_state.py [--steps 300] [--preset tiny] [--quick]

Both runs go through tidal-train (python -m tidal.train) in fresh processes,
on the simulated device with configs/gpt_sim.json's device budget (8 MiB,
below the model's states), so chunks move both ways and both the CPU Adam
(host chunks) and the device-side update (device chunks) run on bf16 moments.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TAIL = 20


def run(preset, steps, states, eval_every, seed, workdir, eval_batches=8) -> dict:
    with open(common.ROOT / "configs" / "gpt_sim.json", encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["bf16"] = {"enabled": True}
    cfg["tidal"]["optimizer_state_dtype"] = states
    cfg_path = os.path.join(workdir, f"config-{states}.json")
    out_path = os.path.join(workdir, f"report-{states}.json")
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    cmd = [sys.executable, "-m", "tidal.train", "--preset", preset, "--steps", str(steps),
           "--config", cfg_path, "--json", out_path, "--no-progress", "--seed", str(seed),
           "--data", "text", "--eval-every", str(eval_every), "--eval-batches", str(eval_batches)]
    env = dict(os.environ, TIDAL_DEVICE="sim")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"[optimizer_state] {states} moments failed:\n{proc.stderr[-3000:]}")
    with open(out_path, encoding="utf-8") as f:
        report = json.load(f)
    report["config"] = cfg
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run (not tabled)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.preset = 8, "nano"
    tail = min(TAIL, args.steps)
    eval_every = args.steps if args.quick else max(1, args.steps // 6)
    runs = {}
    with tempfile.TemporaryDirectory() as workdir:
        for states in ("fp32", "bf16"):
            r = run(args.preset, args.steps, states, eval_every, args.seed, workdir,
                    2 if args.quick else 8)
            common.check_budget(r["memory"], f"{states} moments")
            final = sum(r["losses"][-tail:]) / tail
            runs[states] = {
                "state_bytes_per_param": r["memory"]["state_bytes_per_param"],
                "params": r["params"], "losses": r["losses"], "eval": r["eval"],
                "final_loss_mean_last": final, "first_loss": r["losses"][0],
                "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"],
                "adam_chunks_on_device": r["memory"]["adam_chunks_on_device"],
                "adam_chunks_on_host": r["memory"]["adam_chunks_on_host"],
                "evictions": r["memory"]["evictions"], "skipped_steps": r["memory"]["skipped_steps"],
            }
            print(f"[optimizer_state] {states} moments ({runs[states]['state_bytes_per_param']} "
                  f"B/param): loss {r['losses'][0]:.4f} -> mean of the last {tail} {final:.4f}; "
                  f"held-out {r['eval'][-1]['loss']:.4f}; {r['seconds']:.0f} s", flush=True)
    f32, b16 = runs["fp32"]["final_loss_mean_last"], runs["bf16"]["final_loss_mean_last"]
    rel = (b16 - f32) / f32
    e32, e16 = runs["fp32"]["eval"][-1]["loss"], runs["bf16"]["eval"][-1]["loss"]
    out = {"preset": args.preset, "steps": args.steps, "seed": args.seed, "precision": "bf16",
           "data": "text (tidal-train's built-in corpus)", "config": "configs/gpt_sim.json + bf16",
           "tail_steps": tail, "runs": runs,
           "final_loss_relative_difference": rel,
           "eval_loss_relative_difference": (e16 - e32) / e32,
           "within_2_percent": abs(rel) <= 0.02, "quick": args.quick}
    print(f"[optimizer_state] bf16 vs fp32 moments: final loss {b16:.4f} vs {f32:.4f} "
          f"({rel:+.2%}); held-out {e16:.4f} vs {e32:.4f}", flush=True)
    name = "optimizer_state-quick" if args.quick else "optimizer_state"
    path = common.write_result(name, {"simulated": True, "result": out}, output=args.output)
    print(f"[optimizer_state] wrote {path}")


if __name__ == "__main__":
    main()
