"""The largest batch at a fixed device budget under the training engine: the
engine alone, with DTR in its config, and with static recompute ("auto"),
on three models. Writes benchmarks/results/engine_dtr_batch-<machine>.json.

    python benchmarks/engine_dtr_batch.py [--quick] [--only gpt bert resnet50]

Every trial runs in a fresh process (nothing of one trial's allocator or DTR
state reaches the next) on the simulated device, with a link of --link. A
batch fits when two training steps finish with no error: the device budget
is a hard limit (Note [The simulated device's budget is a hard limit] in
hooks/host_allocation_counter.h), so chunks plus every byte torch allocates
while the engine runs never pass it; the trial records the engine's device
use at its worst moment (peak_device_bytes, chunks and everything else
together) and its overruns, and a trial with an overrun or a peak past the
budget less the margin counts as a failure. The search doubles, then
bisects; then every smaller power of two and the batch just below the
largest are run too, to check that fits are monotonic. At static
recompute's largest batch, the step time of DTR and of recompute (medians
of the timed steps, the same process order for all) are compared.

The models (fp32, 256 KiB chunks):
  * gpt      TinyGPT(vocab 256, d 128, 6 layers, 4 heads, seq 128): issue 28's;
  * bert     a BERT-like encoder (transformers' BertForMaskedLM: vocab 256,
             hidden 128, 6 layers, 4 heads, 512 intermediate, seq 128);
  * resnet50 ResNet-50's layout (3-4-6-3 bottlenecks, base width 32) on
             64x64 images, 10 classes, with BatchNorm.
CPU times: the simulated device's compute is the CPU's, a proxy for a GPU
where recomputation costs less against memory traffic.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
import batch_search  # noqa: E402
import common  # noqa: E402

MODELS = {
    # budget: chosen so the engine alone trains a batch of 1 or 2.
    "gpt": {"budget": 10 << 20, "cap": 64},
    "bert": {"budget": 12 << 20, "cap": 64},
    "resnet50": {"budget": 36 << 20, "cap": 128},
}
QUICK = {
    "gpt": {"budget": 6 << 20, "cap": 16},
}
MODES = ("engine", "dtr", "recompute")


# --------------------------------------------------------------- one trial
def _model_and_data(name: str, batch: int, quick: bool):
    import torch

    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        from tidal.models.gpt import TinyGPT
        shape = dict(vocab=256, d=64 if quick else 128, layers=2 if quick else 6, heads=4,
                     seq=64 if quick else 128)
        model = TinyGPT(**shape)
        data = [(torch.randint(0, 256, (batch, shape["seq"]), generator=g),) * 2 for _ in range(3)]
        return model, data, (lambda m, b: m(*b))
    if name == "bert":
        import transformers
        cfg = transformers.BertConfig(vocab_size=256, hidden_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, intermediate_size=512,
                                      max_position_embeddings=128, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(cfg)
        data = []
        for _ in range(3):
            ids = torch.randint(0, 256, (batch, 128), generator=g)
            data.append((ids,))
        return model, data, (lambda m, b: m(input_ids=b[0], labels=b[0]).loss)
    if name == "resnet50":
        import torch.nn.functional as F
        from dtr import ResNet50
        model = ResNet50(layers=(3, 4, 6, 3), base=32, classes=10)
        data = [(torch.randn(batch, 3, 64, 64, generator=g), torch.randint(0, 10, (batch,), generator=g))
                for _ in range(3)]
        return model, data, (lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    raise ValueError(name)


def trial(name: str, mode: str, batch: int, budget: int, quick: bool, link: str) -> dict:
    import warnings

    import torch

    import tidal
    warnings.simplefilter("ignore")
    tidal.set_device("sim", capacity="8GiB", bandwidth=link)
    torch.manual_seed(0)
    model, data, loss_of = _model_and_data(name, batch, quick)
    cfg = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "tidal": {"chunk_size": 256 << 10, "device_memory_budget": budget, "hybrid_adam": False}}
    if mode == "dtr":
        cfg["tidal"]["dtr"] = {"enabled": True}
    elif mode == "recompute":
        cfg["tidal"]["recompute"] = {"checkpoints": "auto"}
        cfg["activation_checkpointing"] = {}
    return batch_search.engine_trial({"model": name, "mode": mode, "batch": batch}, model, data, loss_of, cfg)


def run_trial(name, mode, batch, budget, quick, link) -> dict:
    return common.run_child(__file__, [name, mode, batch, budget, quick, link],
                            {"model": name, "mode": mode, "batch": batch})


# -------------------------------------------------------------- the search
def _monotonic(out, trials):
    """Monotonic over every trial of a mode, the timing runs included: a
    batch at or below the largest that failed anywhere breaks it."""
    for mode in MODES:
        out["monotonic"][mode] = all(t["fits"] for t in trials
                                     if t["mode"] == mode and t["batch"] <= out["largest"][mode])


def model_part(name: str, spec: dict, quick: bool, link: str, rounds: int) -> dict:
    trials = []

    def fits_for(mode):
        return batch_search.logged(lambda b: run_trial(name, mode, b, spec["budget"], quick, link), trials,
                                   f"    {name} {mode:9s}")

    out = {"device_budget_bytes": spec["budget"], "batch_cap": spec["cap"], "largest": {},
           "monotonic": {}}
    for mode in MODES:
        best = batch_search.largest(fits_for(mode), spec["cap"])
        out["largest"][mode] = best
        # Monotonic: every smaller power of two and the batch below the largest.
        tried = {t["batch"]: t["fits"] for t in trials if t["mode"] == mode}
        check = sorted({b for b in (2 ** k for k in range(12)) if b < best} | ({best - 1} if best > 1 else set()))
        for b in check:
            if b not in tried:
                fits_for(mode)(b)  # (recorded in trials)
    # Step times at recompute's largest batch: DTR against recompute.
    timing(name, spec, out, trials, quick, link, rounds)
    _monotonic(out, trials)
    e, d, rc = (out["largest"][m] for m in MODES)
    out["dtr_over_engine"] = d / e if e else None
    out["dtr_over_recompute"] = d / rc if rc else None
    out["trials"] = trials
    return out


def timing(name, spec, out, trials, quick, link, rounds):
    """Step times of DTR and recompute at recompute's largest batch: `rounds`
    fresh processes each, in alternating order with a pause before each, the
    median over every timed step. On the simulated device a step that moves
    chunks waits for the link's copy threads, which a loaded CPU wakes late:
    time on a quiet machine (--retime)."""
    at = out["largest"]["recompute"]
    if at <= 0:
        return
    samples = {"recompute": [], "dtr": []}
    failed = set()  # a mode that failed once is not timed again
    for mode in batch_search.alternating(("recompute", "dtr"), rounds, skip=failed):
        r = run_trial(name, mode, at, spec["budget"], quick, link)
        trials.append({**r, "timing": True})
        if r["fits"]:
            samples[mode].extend(r["step_seconds"])
        else:
            failed.add(mode)
    samples = {m: (None if m in failed else v) for m, v in samples.items()}
    times = {m: (statistics.median(v) if v else None) for m, v in samples.items()}
    out["step_seconds_at_recompute_batch"] = {"batch": at, "rounds": rounds, **times,
                                              "samples": samples}
    out.pop("dtr_over_recompute_time", None)
    if times["recompute"] and times["dtr"]:
        out["dtr_over_recompute_time"] = times["dtr"] / times["recompute"]


def retime(path, rounds, link, quick):
    """Re-measures the step times of a result file's models at recompute's
    largest batch (the largest-batch search is not timed and stays)."""
    import pathlib
    record = json.loads(pathlib.Path(path).read_text())
    specs = QUICK if quick else MODELS
    for name, out in record["models"].items():
        trials = [t for t in out["trials"] if not t.get("timing")]
        timing(name, specs[name], out, trials, quick, link, rounds)
        _monotonic(out, trials)
        out["trials"] = trials
        print(f"{name}: at batch {out['largest']['recompute']}: DTR/recompute time "
              f"{out.get('dtr_over_recompute_time')}", flush=True)
    payload = {k: v for k, v in record.items()
               if k not in ("benchmark", "command", "git_commit", "date", "machine")}
    payload["retimed"] = {"rounds": rounds, "largest_batch_search_commit": record.get("git_commit")}
    return common.write_result(record["benchmark"], payload, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the GPT only, small (a smoke run, not tabled)")
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    ap.add_argument("--link", default="12GB/s", help="the simulated host-device link")
    ap.add_argument("--output", default=None)
    ap.add_argument("--retime", metavar="RESULT_FILE",
                    help="re-measure only the step times of RESULT_FILE (on a quiet machine)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed processes per mode, alternating (the search and --retime)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(trial(*json.loads(args.child))))
        return 0
    if args.retime:
        print(f"wrote {retime(args.retime, args.rounds, args.link, args.quick)}")
        return 0
    specs = QUICK if args.quick else {k: v for k, v in MODELS.items() if not args.only or k in args.only}
    out = {"quick": args.quick, "link": args.link, "models": {}}
    for name, spec in specs.items():
        print(f"  {name}: device budget {spec['budget']} bytes", flush=True)
        out["models"][name] = model_part(name, spec, args.quick, args.link, 1 if args.quick else args.rounds)
        r = out["models"][name]
        print(f"{name}: largest batch {r['largest']} (DTR {r['dtr_over_engine']}x the engine alone); "
              f"monotonic {r['monotonic']}; DTR/recompute time {r.get('dtr_over_recompute_time')}",
              flush=True)
    path = common.write_result("engine_dtr_batch-quick" if args.quick else "engine_dtr_batch", out,
                               args.output)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
