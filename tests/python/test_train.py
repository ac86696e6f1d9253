"""tidal-train (python/tidal/train.py) end to end on the simulated device.

The references are independent of train.py: ln 256 for the loss of an
untrained byte-level model, parameter counts of plain torch modules and of
published models, PNG headers and pixel colours read back from the file.
"""
import importlib.metadata
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
import torch

import tidal
from tidal import train
from tidal.data import synthetic_batches, text_batches, text_corpus
from tidal.models.gpt import TinyGPT

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keep_device():
    """run() may switch the process-wide device (gpt_quick.json asks for 'sim'): restore it."""
    previous = tidal.get_device()
    try:
        yield
    finally:
        tidal._C.set_default_device(previous)


def run_cli(*args, timeout=300):
    env = dict(os.environ)
    env.pop("TIDAL_DEVICE", None)
    return subprocess.run([sys.executable, "-m", "tidal.train", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def run_error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        train.run(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ end to end
def test_quick_run_trains_and_the_loss_falls(tmp_path):
    out = tmp_path / "report.json"
    proc = run_cli("--quick", "--no-progress", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["model"] == "nano" and report["steps"] == 40 and report["applied_steps"] == 40
    assert report["backend"] == "sim" and report["data"] == "text"
    # Untrained, the tied head gives near-uniform logits over the 256 bytes.
    assert report["first_loss"] == pytest.approx(math.log(256), abs=0.1)
    assert report["last5_mean_loss"] < report["first_loss"] - 1.0, report["losses"]
    mem = report["memory"]
    assert mem["device_budget"] == 4 << 20
    assert mem["bytes_device_to_host_last_step"] > 0 and mem["bytes_host_to_device_last_step"] > 0  # chunks moved
    assert mem["peak_chunk_device_bytes"] <= mem["device_budget"] - mem["device_margin"]
    assert report["tokens_per_s"] > 0 and report["tflops"] > 0
    # Note [What a steady step costs]: each step's scheduler counters; the
    # last one's bytes are the report's own count of the last step, the hit
    # rate of them all is the run's, and the steady figures are the mean of
    # the steps from the third on.
    per_step = report["scheduler_per_step"]
    assert len(per_step) == 40
    assert (per_step[-1]["bytes_host_to_device"], per_step[-1]["bytes_device_to_host"]) == \
        (mem["bytes_host_to_device_last_step"], mem["bytes_device_to_host_last_step"])
    hits, misses = sum(s["prefetch_hits"] for s in per_step), sum(s["misses"] for s in per_step)
    assert hits / (hits + misses) == pytest.approx(mem["prefetch_hit_rate"])
    steady = report["scheduler_steady"]
    assert steady["steps"] == 38
    for k in ("prefetch_hits", "misses", "copy_wait_seconds", "host_pins", "evictions"):
        assert steady[k] == pytest.approx(sum(s[k] for s in per_step[2:]) / 38), k
    assert steady["prefetch_hits"] > 0  # (chunks move in every step of this shape)
    assert steady["prefetch_hit_rate"] == pytest.approx(
        steady["prefetch_hits"] / (steady["prefetch_hits"] + steady["misses"]))
    assert "a steady step's moves (mean, steps 3 on): prefetch hits" in proc.stdout
    # Where building into chunks went (the model's own init is the rest of the
    # context's time, so it is the parts that are checked): each part was
    # timed, none is more than the whole, and the printed total is the file's.
    build = report["build_seconds"]
    measured = ("register", "chunk_memory", "write", "initialize")
    assert build["write"] > 0 and build["register"] > 0 and build["initialize"] > 0, build
    assert all(0 <= build[k] <= build["seconds"] for k in measured + ("model_init",)), build
    assert f"built into chunks in {build['seconds']:.1f} s" in proc.stdout
    text = proc.stdout
    assert "[tidal-train] preset nano: 0.1M parameters, 2 layers, hidden 64" in text
    assert "[tidal-train] report: 40 steps in" in text
    for line in ("throughput (steps 3 on):", "device budget 4.0 MiB (margin 256.0 KiB): peak chunks",
                 "host: peak chunks", "evictions", "in CPU Adam",
                 "of which: the model's own init"):
        assert line in text
    # --no-progress: ten plain lines with the figures of the bar.
    steps = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert len(steps) == 11 and all("tok/s" in ln and "TFLOPS" in ln and "dev " in ln
                                    for ln in steps)


def test_console_entry_point_is_main_and_exits_zero(keep_device):
    import tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tidal-train"] == "tidal.train:main"
    module, func = scripts["tidal-train"].split(":")
    entry = getattr(__import__(module, fromlist=[func]), func)
    assert entry is train.main
    # console scripts run sys.exit(main()): main must return 0, not the report
    assert entry(["--quick", "--steps", "2", "--no-progress"]) == 0


def test_installed_console_script_runs():
    exe = shutil.which("tidal-train", path=str(Path(sys.executable).parent))
    assert exe is not None, "no tidal-train script next to the interpreter: run scripts/setup.sh"
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: tidal-train" in proc.stdout
    assert importlib.metadata.version("tidal")


def test_progress_bar_shows_loss_throughput_and_memory(keep_device, capsys):
    summary = train.run(["--quick", "--steps", "3"])
    err = capsys.readouterr().err
    assert "3/3" in err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    for field in ("loss ", " tok/s", " TFLOPS", "dev ", " MiB/4.0 MiB", "host "):
        assert field in last, last
    assert f"loss {summary['losses'][-1]:.3f}" in last


def test_hf_gpt2_config_trains_its_shape(tmp_path, keep_device):
    hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function":
          "gelu_new", "layer_norm_epsilon": 1e-5, "n_ctx": 64, "n_embd": 64, "n_head": 4,
          "n_layer": 2, "n_positions": 64, "resid_pdrop": 0.1, "vocab_size": 300,
          "bos_token_id": 256, "eos_token_id": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    summary = train.run(["--hf-config", str(path), "--quick", "--steps", "3", "--no-progress",
                         "--seq", "32"])
    # The architecture itself, not a TinyGPT of its shape.
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf))
    expected = sum(p.numel() for p in plain.parameters())   # tied head counted once
    assert summary["architecture"] == "GPT2LMHeadModel" and summary["params"] == expected
    assert (summary["layers"], summary["hidden"], summary["heads"], summary["vocab"],
            summary["seq"]) == (2, 64, 4, 300, 32)
    assert summary["source"] == f"Hugging Face gpt2 config {path}" and summary["model"] == "config.json"
    assert all(math.isfinite(v) for v in summary["losses"])


def test_hf_llama_config_trains_the_llama_architecture(tmp_path, keep_device):
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "max_position_embeddings": 64, "vocab_size": 300,
          "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    s = train.run(["--hf-config", str(path), "--quick", "--steps", "4", "--no-progress", "--seq",
                   "32", "--lr", "0.01"])
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    assert s["architecture"] == "LlamaForCausalLM"
    assert s["params"] == sum(p.numel() for p in llama.parameters())
    assert all(math.isfinite(v) for v in s["losses"]) and s["losses"][-1] < s["losses"][0]


def test_hf_config_of_a_model_type_transformers_lacks_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt5", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                "n_positions": 16, "vocab_size": 300}))
    assert "model_type 'gpt5' is not a transformers model type" in \
        run_error(capsys, "--hf-config", str(path))


def test_shapes_of_published_configs():
    gpt2 = train.shape_from_hf_config({"model_type": "gpt2", "n_layer": 12, "n_embd": 768,
                                       "n_head": 12, "n_ctx": 1024, "vocab_size": 50257})
    # GPT-2 small has 124,439,808 parameters; TinyGPT has no qkv bias (3 x 768 per layer).
    assert gpt2.params() == 124_439_808 - 12 * 3 * 768
    assert (gpt2.positions, gpt2.tied) == (1024, True)
    small = train.shape_from_hf_config({"n_layer": 3, "n_embd": 48, "n_head": 3,
                                        "n_positions": 40, "vocab_size": 97})
    assert small.params() == sum(p.numel() for p in TinyGPT(97, 48, 3, 3, 40).parameters())
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
             "max_position_embeddings": 4096, "vocab_size": 32000, "tie_word_embeddings": False,
             "rms_norm_eps": 1e-5, "hidden_act": "silu"}
    shape = train.shape_from_hf_config(llama, "llama-2-7b/config.json")
    assert (shape.layers, shape.hidden, shape.heads, shape.positions, shape.vocab, shape.tied) == \
        (32, 4096, 32, 4096, 32000, False)
    # Llama-2-7B has 6,738,415,616 parameters; GPT blocks of its shape have more (4d MLP).
    assert "LLaMA shapes with GPT blocks" in shape.note and "6738.4M in the llama model" in shape.note
    assert shape.params() == 32 * (12 * 4096 * 4096 + 10 * 4096) + (32000 * 2 + 4096) * 4096 + 2 * 4096


@pytest.mark.parametrize("cfg,message", [
    ({"n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 300},
     "x.json: missing 'n_embd' (hidden size); a GPT-2 config has n_layer, n_embd"),
    ({"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 300, "n_inner": 128},
     "x.json: n_inner = 128, but TinyGPT's MLP is 4 x n_embd = 256 wide"),
    ({"n_layer": 2, "n_embd": 64, "n_head": 5, "n_positions": 64, "vocab_size": 300},
     "x.json: the hidden size 64 is not a multiple of the 5 attention heads"),
    ({"n_layer": "2", "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 300},
     "x.json: 'n_layer' (layers) must be a positive integer, got '2'"),
    ({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64, "vocab_size": 300},
     "x.json: missing 'num_hidden_layers' (layers)"),
])
def test_hf_config_errors(cfg, message):
    with pytest.raises(ValueError) as e:
        train.shape_from_hf_config(cfg, "x.json")
    assert message in str(e.value)


def test_bad_arguments_exit_with_clear_errors(tmp_path, capsys):
    assert "unknown preset 'gpt-350'; did you mean 'gpt-350m'? (presets: nano, tiny," in \
        run_error(capsys, "--preset", "gpt-350")
    assert "--steps must be at least 1, got 0" in run_error(capsys, "--steps", "0")
    assert "--seq 100 is longer than the model's 64 positions" in \
        run_error(capsys, "--quick", "--seq", "100")
    assert "argument --hf-config: not allowed with argument --preset" in \
        run_error(capsys, "--preset", "tiny", "--hf-config", "x.json")
    assert "--lr must be a finite number >= 0, got -1.0" in run_error(capsys, "--lr", "-1")
    assert "--data wiki: no such file or directory" in run_error(capsys, "--data", "wiki")
    missing = tmp_path / "nope.json"
    assert f"--hf-config {missing}: [Errno 2] No such file or directory" in \
        run_error(capsys, "--hf-config", str(missing))
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 16,
                                 "vocab_size": 100}))
    assert "--data text needs a vocabulary of at least 256 (byte tokens); GPT-2 config " \
        f"{small} has 100: use --data synthetic" in run_error(capsys, "--hf-config", str(small))
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"gradient_cliping": 1.0}))
    assert "unknown config key 'gradient_cliping'; did you mean 'gradient_clipping'?" in \
        run_error(capsys, "--config", str(typo))
    assert "No such file or directory" in run_error(capsys, "--config", str(missing))
    assert "config key 'tidal.device_memory_budget': invalid byte size \"5 gigs\"" in \
        run_error(capsys, "--quick", "--budget", "5 gigs")


def test_nvme_puts_the_states_on_a_disk_and_the_report_gives_each_steps_traffic(tmp_path, keep_device,
                                                                                capsys, monkeypatch):
    # --nvme DIR: the same run with the optimizer states on disk trains to the
    # same losses as with them in host memory (the reference), and the report
    # gives the disk's bytes per step beside the totals.
    config = json.loads((ROOT / "configs" / "gpt_quick.json").read_text())
    config["tidal"]["hybrid_adam"] = False  # (every state on the host's side: none stays on the device)
    (tmp_path / "reference.json").write_text(json.dumps(config))
    config["tidal"]["host_memory_budget"] = "640KiB"  # under half of nano's 1.6 MB of fp32 states
    path = tmp_path / "small_host.json"
    path.write_text(json.dumps(config))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    common = ["--quick", "--steps", "5", "--no-progress"]
    reference = train.run(common + ["--config", str(tmp_path / "reference.json")])
    assert reference["memory"]["nvme"] is None
    assert " disk r " not in capsys.readouterr().out  # (no tier, no disk figures)
    common += ["--config", str(path)]
    s = train.run(common + ["--nvme", str(nvme), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert s["losses"] == reference["losses"]
    n = s["memory"]["nvme"]
    assert Path(n["path"]).parent == nvme and n["bytes_written"] > 0 and n["bytes_read"] > 0, n
    per_step = n["bytes_per_step"]
    assert len(per_step) == 5 and per_step == json.loads((tmp_path / "r.json").read_text())[
        "memory"]["nvme"]["bytes_per_step"]
    # Steady steps read and write what is on disk: both, every step.
    assert all(r > 0 and w > 0 for r, w in per_step[2:]), per_step
    assert sum(r for r, _ in per_step) <= n["bytes_read"]  # (a relayout's copies are in the totals only)
    assert n["steady_bytes_read_per_step"] == sum(r for r, _ in per_step[2:]) / 3
    assert n["steady_bytes_written_per_step"] == sum(w for _, w in per_step[2:]) / 3
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert steps and all(" disk r " in ln for ln in steps), steps
    assert "NVMe: " in out and "; per step (steps 3 on) " in out, out
    # A disk that fails mid-run (EIO injected into the 3rd read from the start)
    # ends the run with the disk's error in one line, status 1.
    initialize = tidal.initialize

    def failing(*args, **kwargs):
        engine = initialize(*args, **kwargs)
        engine.chunks._fail_disk_io("read", 3)
        return engine

    monkeypatch.setattr(tidal, "initialize", failing)
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(SystemExit) as e:
        train.run(common + ["--nvme", str(broken)])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tidal-train: error: step "), err
    assert os.strerror(5) in err[0] and str(broken) in err[0] and "the run has no checkpoint" in err[0], err
    monkeypatch.undo()
    # Bad folders are one line each, before anything trains.
    assert f"--nvme {tmp_path / 'nope'}: no such folder; expected an existing folder" in \
        run_error(capsys, "--quick", "--nvme", str(tmp_path / "nope"))
    assert f"--nvme {path}: a file" in run_error(capsys, "--quick", "--nvme", str(path))
    assert "--nvme-param needs --nvme DIR" in run_error(capsys, "--quick", "--nvme-param")
    if os.path.isdir("/dev/shm"):
        shm = Path(f"/dev/shm/tidal-train-test-{os.getpid()}")
        shm.mkdir()
        try:
            err = run_error(capsys, *common, "--nvme", str(shm))
            assert f"--nvme {shm}: " in err and "is on tmpfs, whose files are host memory" in err, err
            assert len(err.strip().splitlines()) == 1, err
        finally:
            shm.rmdir()


def test_synthetic_data_trains_a_hf_model_with_a_small_vocabulary(tmp_path, keep_device):
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 16,
                                 "vocab_size": 100}))
    s = train.run(["--hf-config", str(small), "--data", "synthetic", "--quick", "--steps", "2",
                   "--no-progress", "--batch", "3", "--lr", "0.01"])
    assert (s["vocab"], s["micro_batch"], s["lr"], s["data"]) == (100, 3, 0.01, "synthetic")
    assert s["first_loss"] == pytest.approx(math.log(100), abs=0.15)


# ---------------------------------------------------------------- the plot
def _timeline():
    mib = 1 << 20
    rows = []
    # 10 forward points, 10 backward, the step: chunks 3 MiB, non-chunk 1 MiB, budget 8 MiB.
    for i in range(10):
        rows.append((i, f"fwd blocks.{i}.fc", 3 * mib, 1 * mib, 8 * mib))
    for i in range(10, 20):
        rows.append((i, f"bwd blocks.{19 - i}.fc", 3 * mib, 1 * mib, 8 * mib))
    rows.append((20, "step", 3 * mib, 1 * mib, 8 * mib))
    return rows


def _count(image, rgb, tol=0.02):
    colour = torch.tensor(rgb, dtype=torch.float32) / 255
    return int(((image[..., :3] - colour).abs().max(-1).values < tol).sum())


def test_plot_draws_the_timeline_into_a_png(tmp_path):
    import matplotlib.image as plt_image
    path = tmp_path / "mem.png"
    drawn = train.plot_memory_timeline(_timeline(), path)
    assert drawn == {"points": 21, "peak_chunk_bytes": 3 << 20, "peak_non_chunk_bytes": 1 << 20,
                     "budget": 8 << 20, "marked_moves": 0, "marked_evictions": 0}
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1200, 480)
    image = torch.from_numpy(plt_image.imread(str(path)).copy())
    chunks = _count(image, (0x3b, 0x75, 0xaf))
    other = _count(image, (0xef, 0x86, 0x36))
    free = _count(image, (0xd9, 0xe8, 0xd3))
    # Areas in the plot follow the bytes: chunks 3, non-chunk 1, free 4 (legend swatches aside).
    assert chunks > 10000 and other > 3000
    assert chunks / other == pytest.approx(3.0, rel=0.15)
    assert free / other == pytest.approx(4.0, rel=0.15)
    dicts = [dict(zip(("moment", "hook", "chunk_bytes", "non_chunk_bytes", "budget"), r))
             for r in _timeline()]
    assert train.plot_memory_timeline(dicts, tmp_path / "d.png")["points"] == 21


def test_plot_rejects_an_empty_or_malformed_timeline(tmp_path):
    with pytest.raises(ValueError, match="the memory timeline is empty"):
        train.plot_memory_timeline([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="a timeline entry must be"):
        train.plot_memory_timeline([(0, "fwd", 1, 2)], tmp_path / "x.png")


def test_plot_option_end_to_end(tmp_path, keep_device, capsys):
    path = tmp_path / "memory.png"
    s = train.run(["--quick", "--steps", "3", "--no-progress", "--plot", str(path)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert s["plot"]["points"] > 10 and s["plot"]["budget"] == 4 << 20
    assert 0 < s["plot"]["peak_chunk_bytes"] <= 4 << 20


def test_profile_option_writes_the_json_and_a_png_with_moves_marked(tmp_path, keep_device):
    import matplotlib.image as plt_image
    s = train.run(["--quick", "--steps", "3", "--no-progress", "--profile", str(tmp_path / "prof")])
    doc = json.loads((tmp_path / "prof" / "memory_profile.json").read_text())
    points = doc["points"]
    assert doc["device_budget"] == 4 << 20 and len(points) == s["profile"]["points"] > 10
    assert [p["moment"] for p in points] == list(range(len(points)))
    assert {p["hook"].split()[0] for p in points} == {"fwd", "bwd", "grad", "step"}
    # The quick config's budget makes chunks move every step: marked in the PNG.
    moves = sum(p["h2d_moves"] + p["d2h_moves"] for p in points)
    assert moves == s["profile"]["marked_moves"] > 0
    image = torch.from_numpy(plt_image.imread(str(tmp_path / "prof" / "memory_profile.png")).copy())
    assert _count(image, (0x1f, 0x4e, 0x79)) > 0   # host->device move markers


# ------------------------------------------------------- configs and data
def test_shipped_configs_load_without_warnings():
    import warnings
    for name in ("gpt_sim.json", "gpt_gpu.json", "gpt_quick.json"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cfg = tidal.Config.load(ROOT / "configs" / name)
        assert cfg.gradient_clipping == 1.0 and cfg.optimizer_type == "AdamW"
    sim = tidal.Config.load(ROOT / "configs" / "gpt_sim.json")
    # The tiny preset's fp32 state (weights, Adam m and v, the 16-bit slot: 16 B a
    # parameter) does not fit the simulated budget, so chunks must move.
    assert train.ModelShape(*train.PRESETS["tiny"]).params() * 16 > sim.device_memory_budget
    assert tidal.Config.load(ROOT / "configs" / "gpt_gpu.json").precision == "bf16"
    assert tidal.Config.load(ROOT / "configs" / "gpt_quick.json").device == "sim"


def test_text_batches_are_shifted_byte_windows_of_the_corpus():
    corpus = text_corpus()
    assert len(corpus) > 200_000 and b"Return" in corpus
    x, y = next(text_batches(4, 32, "cpu", seed=1))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 256
    row = bytes(x[0].tolist()) + bytes([int(y[0, -1])])
    assert row in corpus


def test_synthetic_batches_follow_a_two_successor_bigram_table():
    it = synthetic_batches(50, 64, 8, "cpu", seed=3)
    successors = {}
    for _ in range(20):
        x, y = next(it)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for a, b in zip(x.flatten().tolist(), y.flatten().tolist()):
            successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 2
    assert sum(len(s) == 2 for s in successors.values()) > 10
