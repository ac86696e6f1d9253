"""tidal.estimate / tidal-estimate (issue 30): its memory figures are the
engine's for the same model and config (state bytes, chunk counts, bytes per
parameter, largest_model_params), its bytes moved per step are near the
engine's on a small shape, bad input is a clear error naming the value, --json
parses, and the benchmarks that validate it run with --quick.
"""
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tidal
from tidal.estimate import estimate, main
from tidal._C.chunks import ChunkKind
from tidal.models.gpt import TinyGPT

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import measured_budget, train_tidal, within_budget  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NO_RATES = {"rates": {}, "measure": False}


@pytest.fixture(autouse=True)
def simulated_device():
    previous = tidal.get_device()
    tidal.set_device("sim", capacity="1GiB")
    yield
    tidal._C.set_default_device(previous)


def config(precision="bf16", states="fp32", accumulation=1, chunk="256KiB", host="256MiB",
           device="64MiB"):
    c = {"optimizer": {"type": "AdamW"}, "gradient_accumulation_steps": accumulation,
         "train_micro_batch_size_per_gpu": 2,
         "tidal": {"chunk_size": chunk, "device_memory_budget": device, "host_memory_budget": host,
                   "optimizer_state_dtype": states}}
    if precision != "fp32":
        c[precision] = {"enabled": True}
    return c


def gpt():
    return TinyGPT(vocab=256, d=128, layers=3, heads=4, seq=32)


def llama():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def engine_figures(build, cfg, in_context):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if in_context:
            with tidal.init_context(cfg):
                model = build()
        else:
            model = build()
        engine = tidal.initialize(model, cfg)
    c, s, r = engine.chunks, engine.chunks.stats(), engine.memory_report()
    trainable = {r.chunk for r in engine.records if r.trainable}
    return {"chunks": c.num_chunks,
            "states_at_initialize": s["resident_bytes_host"] + s["resident_bytes_device"],
            "gradient_sums": sum(c.chunk_capacity_bytes(i, ChunkKind.GRAD32) for i in trainable)
            if cfg["gradient_accumulation_steps"] > 1 else 0,
            "param16": sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks)),
            "state_bytes_per_param": r["state_bytes_per_param"],
            "largest_model_params": r["largest_model_params"]}


def estimate_figures(build, cfg):
    with torch.device("meta"):
        model = build()
    e = estimate(model, cfg, device_memory="1GiB", **NO_RATES)
    ch = e["chunk"]
    return {"chunks": ch["chunks"], "states_at_initialize": e["state_bytes"] - ch["gradient_sum_bytes"],
            "gradient_sums": ch["gradient_sum_bytes"], "param16": ch["param16_bytes"],
            "state_bytes_per_param": e["state_bytes_per_param"],
            "largest_model_params": e["largest_model_params"]}


@pytest.mark.parametrize("case", [
    ("gpt", dict(), True),                                  # 14 B, built in init_context
    ("gpt", dict(precision="fp32", chunk="512KiB"), False),  # 16 B, fp32 chunks
    ("gpt", dict(states="bf16"), True),                     # 10 B
    ("gpt", dict(accumulation=4), False),                   # 18 B: the gradient sums
    ("gpt", dict(precision="fp16", chunk="64KiB", host="32MiB", device="8MiB"), True),
    ("llama", dict(chunk="64KiB"), False),                  # transformers, GQA, untied head
], ids=["14B", "fp32", "10B", "accumulation", "fp16-small-budgets", "llama"])
def test_memory_figures_are_the_engines(case):
    name, kw, in_context = case
    build = {"gpt": gpt, "llama": llama}[name]
    cfg = config(**kw)
    assert estimate_figures(build, cfg) == engine_figures(build, cfg, in_context)


def test_the_largest_model_formula_is_the_stores():
    e = estimate("nano", config(host="100MiB", device="20MiB"), device_memory="1GiB", **NO_RATES)
    host = 100 << 20
    reserve = min(2 * 2 * (256 << 10), host // 4)   # two fp32 chunks of a bf16 run
    device = 20 << 20
    margin = max(device // 20, 1 << 20)
    assert e["host"]["reserve"] == reserve and e["device"]["margin"] == margin
    assert e["largest_model_params"] == (host - reserve + device - margin) // 14
    # Unset budgets: the device's memory and 85% of the host's, as ParamStore.
    e = estimate("nano", {"bf16": {"enabled": True}}, device_memory="80GB", host_memory="128GB",
                 **NO_RATES)
    assert e["device"]["budget"] == 80 * 10**9 and e["host"]["budget"] == int(0.85 * 128 * 10**9)


def _predicted_and_trained(steps, device=None, chunk_share=None, **tidal_keys):
    """The estimate and the engine's memory_report() after `steps` steps, for one
    GPT (micro batch 4 x seq 32, 64 KiB chunks) at a device budget of `device`, or
    measured here: its activations and `chunk_share` of its 16-bit chunks
    (measured_budget)."""
    cfg = config(chunk="64KiB", device=device, host="256MiB")
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["tidal"].update(tidal_keys)

    def build():
        return TinyGPT(vocab=256, d=128, layers=4, heads=4, seq=32)

    g = torch.Generator().manual_seed(0)
    batches = [(x, torch.roll(x, -1, 1)) for x in (torch.randint(0, 256, (4, 32), generator=g)
                                                   for _ in range(steps))]
    torch.manual_seed(0)
    if chunk_share is not None:
        cfg["tidal"]["device_memory_budget"] = measured_budget(build(), cfg, batches, chunk_share=chunk_share)
    with torch.device("meta"):
        predicted = estimate(build(), cfg, device_memory="1GiB", seq=32, **NO_RATES)
    torch.manual_seed(0)
    with tidal.init_context(cfg):
        model = build()
    engine = tidal.initialize(model, cfg)
    train_tidal(engine, batches)
    within_budget(engine)
    return predicted, engine.memory_report()


def test_bytes_moved_per_step_are_near_the_engines():
    # A GPT whose states are about twice the device budget (the "streams"
    # shape of benchmarks/estimate.py, smaller): bytes are deterministic.
    predicted, r = _predicted_and_trained(6, device="6MiB")
    measured = r["bytes_host_to_device_last_step"]
    assert measured > 0
    assert predicted["traffic"]["bytes_host_to_device"] == pytest.approx(measured, rel=0.25)
    assert predicted["device"]["activations"] == pytest.approx(r["peak_nonchunk_device_bytes"],
                                                                rel=0.25)


@pytest.mark.parametrize("chunk_share", [1.0, 0.5], ids=["all-fits", "streams"])
def test_bytes_moved_without_hybrid_adam_are_the_engines(chunk_share):
    # tidal.hybrid_adam false: every step each 16-bit chunk goes to the host's
    # CPU Adam and back, even when the whole state would fit on the device.
    predicted, r = _predicted_and_trained(4, chunk_share=chunk_share, hybrid_adam=False)
    measured = r["bytes_host_to_device_last_step"]
    assert measured >= predicted["chunk"]["param16_trainable_bytes"] > 0
    assert predicted["traffic"]["hybrid_param16_bytes"] == 0
    assert predicted["traffic"]["bytes_host_to_device"] == pytest.approx(measured, rel=0.25)
    assert predicted["time"]["device_adam_s"] == 0 and predicted["time"]["cpu_adam_s"] > 0
    if chunk_share == 1.0:  # nothing but the update moves: exactly the 16-bit chunks
        assert measured == predicted["chunk"]["param16_trainable_bytes"]


@pytest.mark.parametrize("name, precision", [("gpt", "fp32"), ("llama", "bf16")])
def test_activations_are_near_the_engines(name, precision):
    # The meta-device count against the engine's measured peak of non-chunk
    # memory (a Llama: rotary embeddings under autocast, GQA, sdpa with a mask).
    build = {"gpt": gpt, "llama": llama}[name]
    cfg = config(precision, device="256MiB")
    with torch.device("meta"):
        predicted = estimate(build(), cfg, device_memory="1GiB", seq=32, **NO_RATES)
    assert not predicted["notes"]
    torch.manual_seed(0)
    engine = tidal.initialize(build(), cfg)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 32))
        loss = engine(x, x) if name == "gpt" else engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    within_budget(engine)
    measured = engine.memory_report()["peak_nonchunk_device_bytes"]
    assert predicted["device"]["activations"] == pytest.approx(measured, rel=0.25)


def test_presets_hugging_face_configs_and_meta_models(tmp_path):
    e13 = estimate("gpt-13b", precision="bf16", device_memory="80GB", host_memory="128GB",
                   micro_batch=1, seq=1024, **NO_RATES)
    assert e13["state_bytes_per_param"] == 14
    assert 12.5e9 < e13["model"]["parameters"] < 13.5e9
    assert e13["time"]["bottleneck"] in ("compute", "link", "cpu_adam", "device_adam")
    assert set(e13["time"]) >= {"compute_s", "link_s", "cpu_adam_s", "step_s"}
    (tmp_path / "config.json").write_text(json.dumps(
        {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 256}))
    e = estimate(str(tmp_path), precision="bf16", optimizer_state_dtype="bf16", device_memory="1GB",
                 host_memory="4GB", **NO_RATES)
    assert e["state_bytes_per_param"] == 10 and e["model"]["parameters"] > 0
    with torch.device("meta"):
        model = TinyGPT(vocab=256, d=64, layers=2, seq=32)
    e = estimate(model, device_memory="1GB", host_memory="4GB", **NO_RATES)
    assert e["device"]["activations"] > 0 and e["time"]["flops"] > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model is not changed


@pytest.mark.parametrize("kwargs, names", [
    (dict(model="gpt-13"), ["gpt-13", "gpt-13b"]),
    (dict(model="/no/such/config.json"), ["/no/such/config.json", "no such file"]),
    (dict(model="tiny", config="/no/such/ds_config.json"), ["/no/such/ds_config.json"]),
    (dict(model="tiny", device_memory="-5GB"), ["-5GB"]),
    (dict(model="tiny", host_memory=-1), ["-1"]),
    (dict(model="tiny", device_memory="0"), ["device memory", "0"]),
    (dict(model="tiny", precision="int8"), ["int8"]),
    (dict(model="tiny", rates={"cpu_adam_params_per_s": -3.0}), ["cpu_adam_params_per_s", "-3.0"]),
])
def test_bad_input_is_an_error_naming_the_value(kwargs, names):
    with pytest.raises(ValueError) as info:
        estimate(**{"measure": False, **kwargs})
    for name in names:
        assert name in str(info.value)


def test_the_command_line_prints_json_and_text(capsys):
    assert main(["nano", "--json", "--device-memory", "1GB", "--host-memory", "4GB",
                 "--no-measure", "--precision", "bf16", "--link", "12GB/s"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["precision"] == "bf16" and e["rates"]["h2d_bytes_per_s"]["value"] == 12e9
    for key in ("state_bytes_per_param", "state_bytes", "largest_model_params", "fits"):
        assert key in e
    assert {"chunk_size", "chunks"} <= set(e["chunk"])
    assert {"margin", "chunk_room", "activations"} <= set(e["device"])
    assert main(["nano", "--device-memory", "1GB", "--host-memory", "4GB", "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert "largest_model_params" in text and "bottleneck" in text
    with pytest.raises(SystemExit) as info:
        main(["no-such-preset", "--no-measure"])
    assert info.value.code == 2
    assert "no-such-preset" in capsys.readouterr().err


def test_console_entry_point():
    import tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["tidal-estimate"].split(":")
    assert getattr(__import__(module, fromlist=[func]), func) is main
    assert tidal.estimate is estimate


@pytest.mark.parametrize("script", ["estimate.py", "largest_model.py", "optimizer_state.py"])
def test_benchmark_runs_quick(script, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick",
                           "--output", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["simulated"] and result["result"]["quick"]


def test_initialize_largest_runs_quick(tmp_path):
    """benchmarks/initialize_largest.py (issue 52, item 6) in its smoke size:
    both ways build, initialize and train with the budget kept (the script
    fails otherwise), and each figure the table reads is there."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "initialize_largest.py"), "--quick",
                           "--output", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["simulated"] and result["quick"]
    assert set(result["runs"]) == {"init_context", "plain"}
    for run in result["runs"].values():
        assert run["budget_kept"] and run["loss_fell"] and len(run["step_s"]) == result["steps"]
        assert run["build_and_initialize_over_write"] > 0 and run["step1_over_steady"] > 0
        assert run["state_bytes_per_param"] == 14


@pytest.mark.parametrize("given, override, want", [
    # The figure not overridden keeps what train_batch_size made of it.
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, {"micro_batch": 4}, (4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, {"gradient_accumulation_steps": 2},
     (8, 2)),
])
def test_a_batch_override_keeps_the_other_figure_of_the_config(given, override, want):
    e = estimate("nano", given, device_memory="1GB", host_memory="4GB", seq=16, **override, **NO_RATES)
    assert (e["micro_batch"], e["gradient_accumulation_steps"]) == want


def test_accumulation_folds_cost_the_host_updated_parameters_at_the_fold_rate():
    """With gradient accumulation each micro-batch folds the gradients of the
    host-updated chunks into their sums on the host (Note [Folds on the
    worker] in tidal/engine/overlap.py): the estimate charges those
    parameters (the 16-bit bytes it streams, halved for bf16) at the rate of
    the fold the engine runs (Note [The weights' image instead of the
    restore]: the fold without the weights' rewrite where tidal.fold_images
    is on, the default; the fold's where it is off), nothing without
    accumulation, and beside a GPU the folds, on the update worker, only
    where they outlast backward."""
    root = Path(__file__).resolve().parents[2]
    kw = dict(precision="bf16", micro_batch=8, seq=1024, device_memory="80GB",
              device_memory_budget="26.8GB", host_memory="128GB", measure=False)
    cfg = json.loads((root / "configs" / "gpt_gpu.json").read_text())

    def run(accumulation, fold_rate, images=True):
        c = {**cfg, "tidal": {**cfg["tidal"], "fold_images": images}}
        # (The other kind's rate would give a fold a millionth as long.)
        other = fold_rate * 1e6
        rates = ({"fold_image_params_per_s": fold_rate, "fold_params_per_s": other} if images else
                 {"fold_params_per_s": fold_rate, "fold_image_params_per_s": other})
        return tidal.estimate("gpt-1.3b", c, gradient_accumulation_steps=accumulation,
                              rates=rates, **kw)

    assert run(1, 1e9)["time"]["fold_s"] == 0
    restoring = run(4, 1e9, images=False)
    assert (restoring["time"]["fold_takes_images"], run(4, 1e9)["time"]["fold_takes_images"]) == (False, True)
    slow, fast = run(4, 1e9), run(4, 1e15)
    assert restoring["time"]["fold_s"] == pytest.approx(slow["time"]["fold_s"], rel=1e-6)
    # (The trainable parameters in the share of the trainable 16-bit chunk
    # bytes that stream: the chunks' padding counted out.)
    host_share = slow["traffic"]["host_param16_bytes"] / slow["chunk"]["param16_trainable_bytes"]
    host_params = slow["model"]["trainable_parameters"] * host_share
    assert host_share > 0.5  # (most chunks are updated on the host)
    assert slow["time"]["fold_s"] == pytest.approx(4 * host_params / 1e9, rel=1e-6)
    assert fast["time"]["fold_s"] < 1e-3
    # Each fold (about 1 s at 1e9/s) outlasts a micro-batch's backward (about
    # 0.11 s), so each adds what backward does not hide; and in the window's
    # last backward the worker's folds leave CPU Adam no time: the part of it
    # that backward hid (at the speculation factor) is exposed instead.
    fold = slow["time"]["fold_s"] / 4
    backward = fast["time"]["backward_s"]
    spec = fast["rates"]["speculation_factor"]["value"]
    added = slow["time"]["step_s_overlapped"] - fast["time"]["step_s_overlapped"]
    exposed = slow["time"]["cpu_adam_exposed_s_overlapped"] - fast["time"]["cpu_adam_exposed_s_overlapped"]
    assert exposed == pytest.approx(backward / spec, rel=1e-4)  # (fast: folds of about a microsecond)
    assert added - exposed == pytest.approx(4 * (fold - backward), rel=1e-4)


def test_the_forward_waits_for_the_chunks_updated_after_backward_where_the_link_is_slow():
    """Where the undo buffers of only a share b of the host-updated chunks fit
    the host budget, only those are updated during backward and go up then;
    the rest are updated at the step and go up under the next forward, which
    needs them first (they are the first host-updated chunks in first-use
    order). The forward computes on each as its copy lands and runs the share
    updated during backward only after the last of them, so where the link
    takes about as long as compute the forward takes (1 - b) x up + b x the
    host-updated share of its compute, not max(compute / 3, (1 - b) x up):
    the benchmark's host_short shape at 250 MB/s waited 22 ms a step in
    copies there (benchmarks/results/estimate-link250mb-cpu-2c.json)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import estimate as bench
    shape = bench.SHAPES["host_short"]
    with torch.device("meta"):
        model = bench.build(bench.FAMILY, shape["layers"], meta=True)
    cfg = bench.config(bench.FAMILY, shape)

    def run(link):
        rates = {"h2d_bytes_per_s": link, "d2h_bytes_per_s": link, "device_flops_per_s": 1e11,
                 "seconds_per_module": 1e-4, "cpu_adam_params_per_s": 2e9,
                 "device_adam_params_per_s": 2e9}
        return estimate(model, cfg, device_memory="2GiB", host_memory="64GiB", rates=rates,
                        measure=False)

    fast = run(1e12)
    t = fast["time"]
    forward = (t["compute_s"] + t["hooks_s"]) / 3
    b = t["link_both_ways_at_once_share"]
    assert 0.2 < b < 0.8  # (some chunks, not all, are updated during backward)
    assert t["forward_s"] == pytest.approx(forward, rel=1e-9)
    traffic = fast["traffic"]
    host_share = 1 - traffic["hybrid_param16_bytes"] / fast["chunk"]["param16_trainable_bytes"]
    # A link whose (1 - b) share of the bytes up takes 0.9 of the forward's
    # compute: alone it would hide under that compute.
    link = (1 - b) * traffic["bytes_host_to_device"] / (0.9 * forward)
    slow = run(link)
    assert slow["time"]["link_both_ways_at_once_share"] == pytest.approx(b)
    waited = 0.9 * forward + b * host_share * forward
    assert waited > 1.1 * forward
    assert slow["time"]["forward_s"] == pytest.approx(waited, rel=1e-6)
    assert slow["time"]["step_s"] >= fast["time"]["step_s"] + (waited - forward) * 0.999
