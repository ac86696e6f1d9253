"""The GPU run kit without a GPU: scripts/gpu_run.sh (--dry-run, and real phases
with GPU_RUN_QUICK=1 on the simulated device), benchmarks/engine_gpu.py and
benchmarks/deepspeed_gpu.py with --quick. What runs on the GPU machine is the
same code with full shapes; these tests prove it runs and that the result files
hold what the issue asks for, before GPU time is spent on it."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_run.sh"
ALL = ["reporter", "build", "cpp", "crash", "bench1b", "dp", "largest", "deepspeed", "dtr"]


def _env(tmp_path, **extra):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               TIDAL_RESULTS_DIR=str(tmp_path / "results"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")])))
    env.pop("LD_PRELOAD", None)
    env.update(extra)
    return env


def _run(argv, env, timeout=240):
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def _engine_gpu_quick(cmd, tmp_path):
    """benchmarks/engine_gpu.py CMD --quick; its result file, once it exits 0."""
    out = tmp_path / f"{cmd}.json"
    rc, text = _run([sys.executable, "benchmarks/engine_gpu.py", cmd, "--quick", "--output", str(out)],
                    _env(tmp_path))
    assert rc == 0, text
    return json.loads(out.read_text())


def _tiny_gpt_params(layers, d, heads, seq, vocab):
    from tidal.models.gpt import TinyGPT
    return sum(p.numel() for p in TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=seq).parameters())


def test_dry_run_prints_the_plan_and_every_command_and_runs_nothing(tmp_path):
    rc, out = _run(["bash", str(SCRIPT), "--dry-run", *ALL], _env(tmp_path))
    assert rc == 0, out
    for p in ALL:
        assert f"[gpu_run]   {p:<10s} ~" in out, p  # the time plan
    assert "[gpu_run]   total" in out and "call 1 = reporter build cpp bench1b big" in out
    for cmd in ("-DCMAKE_CUDA_ARCHITECTURES=90", "--target _C tidal_runtime_tests", "--gtest_output=json:",
                "engine_gpu.py crash", "engine_gpu.py bench", "engine_gpu.py largest", "deepspeed_gpu.py",
                "benchmarks/dtr.py --device cuda", "segv_backtrace.c",
                "torch.distributed.run --standalone --nproc_per_node 1"):
        assert cmd in out, cmd
    # Nothing ran: no phase log, no summary, no result file.
    assert sorted(os.listdir(tmp_path / "out")) == ["plan.txt"]
    assert not (tmp_path / "results").exists()


def test_unknown_phase_is_a_clear_error(tmp_path):
    rc, out = _run(["bash", str(SCRIPT), "--dry-run", "bench13b"], _env(tmp_path))
    assert rc == 2 and "unknown phase 'bench13b'" in out and "bench1b" in out


def test_phases_survive_a_crashed_phase_and_the_crash_phase_runs(tmp_path):
    # `cpp` dies of a segfault (the test hook); the run goes on to `crash`, and the
    # summary, the crashed phase's log and the crash phase's result file say what happened.
    rc, out = _run(["bash", str(SCRIPT), "reporter", "cpp", "crash"],
                   _env(tmp_path, GPU_RUN_QUICK="1", GPU_RUN_SELFTEST_SEGV="cpp", CRASH_ALL_CASES="1"))
    assert rc == 1, out  # one phase failed
    outdir = tmp_path / "out"
    summary = json.loads((outdir / "summary.json").read_text())
    phases = {p["phase"]: p for p in summary["phases"]}
    assert list(phases) == ["reporter", "cpp", "crash"]
    assert phases["reporter"]["rc"] == 0 and json.loads((outdir / "reporter.json").read_text())["reporter_works"]
    assert phases["cpp"]["rc"] == 128 + 11 and phases["cpp"]["status"] == "killed by signal 11"
    log = (outdir / "cpp.log").read_text()
    # The native report comes first, with the real fault address, then Python's stack.
    assert "[segv_bt] signal 11 (Segmentation fault) fault" in log
    assert "[segv_bt] fault address 0x0000000000000010 is in no mapping" in log
    assert "[segv_bt] native backtrace" in log
    assert log.index("[segv_bt] end of native backtrace") < log.index("Fatal Python error: Segmentation fault")
    assert 'File "<string>", line 1 in <module>' in log
    assert phases["crash"]["rc"] == 0, (outdir / "crash.log").read_text()
    [res] = phases["crash"]["results"]
    crash = json.loads(Path(res).read_text())
    assert (outdir / Path(res).name).exists()  # copied to $OUT
    cases = {c["label"]: c for c in crash["cases"]}
    assert list(cases) == ["train", "train_no_pin", "train_chunk_256MiB", "pinloop"]
    assert all(c["rc"] == 0 for c in cases.values()) and crash["crashed"] == []
    assert any("[tidal-train] report" in line for line in cases["train_no_pin"]["output_tail"])
    pin = cases["pinloop"]["report"]
    assert pin["bytes"] >= 16 << 20 and pin["buffers"] == len([l for l in open(cases["pinloop"]["log"])
                                                                 if "roundtrip ok" in l])


def test_crash_skips_the_variants_when_the_plain_run_trains(tmp_path):
    # Without --all-cases a passing tidal-train is the answer: the variants that narrow
    # down a crash are recorded as skipped, not run (device time goes to the next phase).
    crash = _engine_gpu_quick("crash", tmp_path)
    assert [c["label"] for c in crash["cases"]] == ["train"] and crash["cases"][0]["ok"]
    assert crash["skipped"] == ["train_no_pin", "train_chunk_256MiB", "pinloop"] and crash["crashed"] == []


def test_engine_bench_quick_has_the_three_peers_and_their_ratios(tmp_path):
    r = _engine_gpu_quick("bench", tmp_path)
    assert all(r["runs"][k]["ok"] for k in ("matmul", "plain", "tidal_whole", "tidal_quarter"))
    n = _tiny_gpt_params(2, 64, 4, 64, 256)  # --quick: the nano preset, counted by torch
    assert r["params"] == n == r["runs"]["plain"]["report"]["params"] == r["runs"]["tidal_whole"]["report"]["params"]
    t = r["table"]
    plain = r["runs"]["plain"]["report"]
    assert t["plain"]["tflops"] == pytest.approx(6 * n * plain["tokens_per_s"] / 1e12)
    assert t["plain"]["tflops_with_attention"] == pytest.approx((6 * n + 12 * 2 * 64 * 64) * plain["tokens_per_s"] / 1e12)
    for k in ("tidal_whole", "tidal_quarter"):
        assert t[k]["tokens_per_s"] > 0 and t[k]["loss_falling"]
        assert t[k]["within_budget"] and t[k]["budget_overruns"] == 0
        assert 0 <= t[k]["prefetch_hit_rate"] <= 1 and t[k]["cpu_adam_seconds_per_step"] >= 0
        assert t[k]["tflops_over_matmul_rate"] == pytest.approx(t[k]["tflops_with_attention"] / r["matmul_bf16_tflops"])
    ratios = r["ratios"]
    assert ratios["tidal_whole_over_plain_tokens_per_s"] == pytest.approx(
        t["tidal_whole"]["tokens_per_s"] / t["plain"]["tokens_per_s"])
    assert ratios["engine_overhead"] == pytest.approx(1 - ratios["tidal_whole_over_plain_tokens_per_s"])
    # The quarter budget: the whole run's measured activations and margin + a quarter of 14 B/param,
    # and the engine ran under exactly that budget.
    q = r["quarter_budget"]
    mem = r["runs"]["tidal_whole"]["report"]["memory"]
    act, margin = mem["peak_nonchunk_device_bytes"], mem["device_margin"]
    assert q["activation_bytes"] == act and q["bytes"] == int(margin + act + 14 * n / 4)
    assert t["tidal_quarter"]["device_budget"] == q["bytes"]
    # ... with the whole run's margin, so the chunks' room is the quarter itself.
    assert r["runs"]["tidal_quarter"]["report"]["memory"]["device_margin"] == margin
    # With accumulation, once as configured and once with every fold writing the weights
    # back (tidal.fold_images false): that run takes no block back.
    accum, restore = r["runs"]["tidal_quarter_accum"], r["runs"]["tidal_quarter_accum_restore"]
    assert accum["ok"] and restore["ok"]
    assert restore["report"]["memory"]["images_taken_back"] == 0
    assert accum["report"]["gradient_accumulation_steps"] == restore["report"]["gradient_accumulation_steps"] == 2
    assert ratios["tidal_quarter_accum_restore_over_plain_tokens_per_s"] == pytest.approx(
        t["tidal_quarter_accum_restore"]["tokens_per_s"] / t["plain"]["tokens_per_s"])


def test_engine_largest_quick_starts_at_the_prediction_and_reports_against_the_limit(tmp_path):
    r = _engine_gpu_quick("largest", tmp_path)
    # tidal.estimate predicts both quick shapes fit: the search starts at the larger, which
    # trains, and it is the last shape.
    assert {s: p["fits"] for s, p in r["predicted"].items()} == {"nano": True, "quick-gpt2": True}
    assert r["predicted_largest"] == "quick-gpt2"
    assert [t["shape"] for t in r["tried"]] == ["quick-gpt2"] and r["tried"][0]["trained"]
    assert r["tried"][0]["within_budget"] and r["tried"][0]["budget_overruns"] == 0
    assert r["tried"][0]["predicted_fits"] is True
    assert r["stopped"] == "every shape from quick-gpt2 up trains (quick-gpt2 is the last)"
    # quick-gpt2 is not a preset: it trains through --hf-config; the engine built that shape,
    # and the estimate counted the same parameters.
    n = _tiny_gpt_params(2, 96, 4, 64, 256)
    assert r["tried"][0]["report"]["params"] == n == r["predicted"]["quick-gpt2"]["params"]
    big = r["largest"]
    assert big["shape"] == "quick-gpt2" and big["last_loss"] < big["first_loss"]
    assert big["predicted_largest"] == "quick-gpt2"
    assert r["limit_params"] == pytest.approx((r["host_bytes"] + r["device_bytes"]) / 14)
    assert big["params_over_limit"] == pytest.approx(n / r["limit_params"])
    # Every shape ran with the linear warm-up over twice its steps, from the config's lr.
    schedule = r["scheduler"]
    assert schedule["type"] == "WarmupLR" and schedule["params"]["warmup_num_steps"] == 2 * r["steps"]
    for t in r["tried"]:
        used = json.loads(Path(t["report"]["config"]).read_text())
        assert used["scheduler"] == schedule and t["report"]["lr"] == schedule["params"]["warmup_max_lr"]
    assert r["tidal_keys"] == {}  # --quick: the config's own budgets


def test_largest_predict_only_gives_another_machines_verdicts_and_trains_nothing(tmp_path):
    out = tmp_path / "prediction.json"
    # The H200 box of the 2026-11-26 run (engine_largest-nvidia-h200.json's host and device bytes).
    rc, text = _run([sys.executable, "benchmarks/engine_gpu.py", "largest", "--predict-only",
                     "--host-bytes", "135148564480", "--device-bytes", "150109880320",
                     "--output", str(out)], _env(tmp_path))
    assert rc == 0, text
    r = json.loads(out.read_text())
    assert r["tried"] == [] and "nothing ran" in r["memory_source"] and r["micro_batch"] == 1
    assert r["tidal_keys"] == {"host_memory_budget": int(0.9 * 135148564480), "device_margin": 3 << 30}
    fits = [s for s, p in r["predicted"].items() if p["fits"]]
    # Smaller shapes fit where larger ones do, and the search starts at the largest that fits.
    order = list(r["predicted"])
    assert fits == order[:len(fits)] and r["predicted_largest"] == fits[-1]
    assert r["predicted"]["gpt-20b"]["fits"] is False  # 0.99 of the limit: no room for activations
    rc, text = _run([sys.executable, "benchmarks/engine_gpu.py", "largest", "--predict-only",
                     "--output", str(out)], _env(tmp_path))
    assert rc != 0 and "--predict-only goes with both --host-bytes and --device-bytes" in text


def _engine_gpu_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import engine_gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return engine_gpu


SHAPES = ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize("trains,start,tried,best", [
    ({"a", "b", "c"}, 2, ["c", "d"], "c"),            # the prediction was right
    ({"a", "b", "c", "d", "e"}, 2, ["c", "d", "e"], "e"),  # too modest: up to the last
    ({"a"}, 2, ["c", "b", "a"], "a"),                 # too bold: down until one trains
    (set(), 2, ["c", "b", "a"], None),                # nothing trains
    ({"a", "b"}, 0, ["a", "b", "c"], "b"),            # nothing predicted to fit: from the smallest
])
def test_largest_search_tries_from_the_prediction_until_the_boundary(trains, start, tried, best):
    g = _engine_gpu_module()
    seen = []

    def attempt(s):
        seen.append(s)
        return s in trains
    assert g._search(SHAPES, start, attempt) == best
    assert seen == tried


def test_largest_search_stops_when_time_is_up_and_keeps_what_trained():
    g = _engine_gpu_module()
    answers = iter([True, None])
    assert g._search(SHAPES, 1, lambda s: next(answers)) == "b"


def test_largest_search_starts_at_the_largest_predicted_to_fit():
    g = _engine_gpu_module()
    predicted = {"a": {"fits": True}, "b": {"fits": True}, "c": {"fits": None},
                 "d": {"fits": False}, "e": {"fits": False}}
    assert g._search_start(SHAPES, predicted) == 1
    assert g._search_start(SHAPES, {s: {"fits": False} for s in SHAPES}) == 0


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (it is not in CI; scripts/fetch_gpu_wheels.sh "
                           "carries it to the GPU machine)")
def test_deepspeed_quick_runs_both_stages(tmp_path):
    out = tmp_path / "deepspeed.json"
    rc, text = _run([sys.executable, "benchmarks/deepspeed_gpu.py", "--quick", "--output", str(out)],
                    _env(tmp_path), timeout=600)
    r = json.loads(out.read_text())
    assert rc == 0, (text, r)
    assert [(x["stage"], x["shape"]) for x in r["runs"]] == [(2, "nano"), (3, "nano")]
    n = _tiny_gpt_params(2, 64, 4, 64, 256)
    for x in r["runs"]:
        assert x["report"]["params"] == n and x["report"]["tokens_per_s"] > 0
    assert set(r["largest"]) == {"zero2", "zero3"}


def test_dp_phase_runs_data_parallel_with_world_size_one(tmp_path):
    """The dp phase (NCCL on the GPU) with GPU_RUN_QUICK=1: gloo on the simulated
    device, one process under torchrun, data parallel forced on by its config."""
    env = _env(tmp_path, GPU_RUN_QUICK="1")
    rc, out = _run(["bash", str(SCRIPT), "dp"], env)
    assert rc == 0, out
    report = json.loads((tmp_path / "out" / "dp.json").read_text())
    dp = report["memory"]["data_parallel"]
    assert report["world_size"] == 1 and dp["world_size"] == 1 and dp["backend"] == "gloo"
    # Every chunk is this rank's, and the reductions started during backward.
    assert dp["reduces_in_backward"] > 0 and dp["owned_chunks"]
    assert json.loads((tmp_path / "out" / "dp_config.json").read_text())["tidal"]["data_parallel"][
        "enabled"] is True
