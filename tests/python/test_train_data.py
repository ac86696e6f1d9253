"""tidal-train and scripts/finetune_hf.py on your own data (simulated device):
--data, --tokenizer, validation, checkpoints and bit-exact resume.

References are independent of the code under test: the uninterrupted run for a
resumed one (in another process), ln(vocabulary) for the loss of an untrained
model, the `tokenizers` object the tokenizer directory was saved from.
"""
import importlib.util
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import tidal
from tidal import train

sys.path.insert(0, str(Path(__file__).parent))
from test_data import make_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

WORDS = ("chunk", "device", "host", "adam", "model", "memory", "budget", "layer", "token", "step",
         "moves", "fits", "trains", "the", "a", "of", "and", "to")


@pytest.fixture
def keep_device():
    """run() may switch the process-wide device: restore it."""
    previous = tidal.get_device()
    try:
        yield
    finally:
        tidal._C.set_default_device(previous)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL corpus of 300 short documents, a tokenizer trained on it, and a
    config with CPU Adam only (no hybrid Adam)."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 60)))) + "." for _ in range(300)]
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t, "n": i}) + "\n"
                                            for i, t in enumerate(docs)))
    ref = make_tokenizer(d / "tok", docs, vocab=120)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
              "tidal": {"device": "sim", "chunk_size": "64KiB", "device_memory_budget": "4MiB",
                        "device_margin": "256KiB", "hybrid_adam": False}}
    (d / "cpu_adam.json").write_text(json.dumps(config))
    return d, ref


def data_args(d, *more):
    # The shipped quick config: hybrid Adam, a 4 MiB budget, chunks updated on both sides.
    return ["--quick", "--data", str(d / "corpus.jsonl"),
            "--tokenizer", str(d / "tok"), "--cache-dir", str(d / "cache"), "--seq", "32",
            "--no-progress", "--eval-batches", "2", *more]


def test_jsonl_and_a_tokenizer_train_evaluate_and_resume_bit_for_bit_in_a_new_process(
        corpus, tmp_path, keep_device, capsys):
    d, ref = corpus
    straight = train.run(data_args(d, "--steps", "6", "--eval-every", "2", "--save-every", "6",
                                   "--save-dir", str(tmp_path / "straight")))
    out = capsys.readouterr().out
    vocab = ref.get_vocab_size()
    assert straight["vocab"] == vocab and f"vocabulary {vocab}: the tokenizer's" in out
    assert straight["first_loss"] == pytest.approx(math.log(vocab), abs=0.15)
    assert [e["step"] for e in straight["eval"]] == [2, 4, 6]
    assert all(math.isfinite(e["loss"]) for e in straight["eval"])
    assert "validation every 2 steps on 8 windows of the held-out tail" in out
    assert "step     1  validation loss" in out

    # Interrupted after 3 steps (and validated there, which the straight run did not) ...
    first = train.run(data_args(d, "--steps", "3", "--eval-every", "3", "--save-every", "3",
                                "--save-dir", str(tmp_path / "ckpt")))
    assert first["losses"] == straight["losses"][:3]
    assert first["checkpoints"] == [str(tmp_path / "ckpt" / "step3")]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step3"
    # ... resumed by another process: a fresh engine, weights and data position from the file.
    # With this process's thread count: CPU kernels split their sums by thread, so
    # bit-exact needs the same count (an earlier test may have changed ours).
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"}
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    report = tmp_path / "resumed.json"
    proc = subprocess.run([sys.executable, "-m", "tidal.train",
                           *data_args(d, "--steps", "6", "--eval-every", "2", "--resume",
                                      str(tmp_path / "ckpt"), "--save-every", "3", "--json",
                                      str(report))],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = json.loads(report.read_text())
    assert "resumed from" in proc.stdout and "after step 3" in proc.stdout
    assert resumed["start_step"] == 3
    assert resumed["losses"] == straight["losses"][3:]          # bit for bit
    # The last step's update too (no later loss shows it): every slot of the final
    # checkpoints (weights, Adam moments) has the same CRC-32.
    def slots(path):
        return {(e["name"], e["kind"]): e["crc32"]
                for e in json.loads((path / "meta.json").read_text())["slots"]}
    assert slots(tmp_path / "ckpt" / "step6") == slots(tmp_path / "straight" / "step6")
    assert resumed["eval"] == straight["eval"][1:]               # steps 4 and 6, the same losses
    # Both sides of the hybrid Adam ran (the simulated device's is the same SIMD kernel).
    for r in (straight, resumed):
        assert r["memory"]["adam_chunks_on_device"] > 0 and r["memory"]["adam_chunks_on_host"] > 0


def test_resume_refuses_other_data_and_missing_checkpoints(corpus, tmp_path, keep_device, capsys):
    d, _ = corpus
    train.run(data_args(d, "--steps", "1", "--save-every", "1", "--save-dir", str(tmp_path / "c")))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.run(data_args(d, "--steps", "3", "--seq", "16", "--resume", str(tmp_path / "c")))
    err = capsys.readouterr().err
    assert "was trained on other batches: seq 32 there, 16 now" in err
    with pytest.raises(SystemExit):
        train.run(data_args(d, "--steps", "3", "--resume", str(tmp_path / "none")))
    assert f"--resume {tmp_path / 'none'}: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        train.run(data_args(d, "--steps", "3", "--resume", str(tmp_path / "empty")))
    assert "no checkpoint there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.run(data_args(d, "--steps", "1", "--resume", str(tmp_path / "c" / "step1")))
    assert "has done 1 steps and --steps is 1: nothing left to train" in capsys.readouterr().err
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        with pytest.warns(UserWarning, match=rf"used {threads} CPU threads, this one {threads + 1}; "
                                             rf".* set OMP_NUM_THREADS={threads} for a bit-exact"):
            train.run(data_args(d, "--steps", "2", "--resume", str(tmp_path / "c")))
    finally:
        torch.set_num_threads(threads)


def test_a_nanogpt_token_file_with_meta_pkl_and_val_bin(tmp_path, keep_device):
    # nanoGPT's shakespeare_char layout: train.bin, val.bin (uint16), meta.pkl.
    text = ("First Citizen: Before we proceed any further, hear me speak. " * 40).encode()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    ids[:2000].tofile(tmp_path / "train.bin")
    ids[2000:].tofile(tmp_path / "val.bin")
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(map(chr, chars))),
                     "stoi": {chr(c): i for c, i in stoi.items()}}, f)
    s = train.run(["--quick", "--steps", "2", "--no-progress", "--seq", "32",
                   "--data", str(tmp_path / "train.bin"), "--eval-data", str(tmp_path / "val.bin"),
                   "--eval-every", "2"])
    assert s["vocab"] == len(chars) == 26
    assert s["first_loss"] == pytest.approx(math.log(26), abs=0.15)
    assert s["eval"][0]["step"] == 2 and math.isfinite(s["eval"][0]["loss"])


def test_bad_data_exits_with_the_file_and_line(corpus, tmp_path, capsys):
    d, ref = corpus

    def err(*argv):
        with pytest.raises(SystemExit) as e:
            train.run(list(argv))
        assert e.value.code == 2
        return capsys.readouterr().err
    assert f"--data {tmp_path / 'wiki'}: no such file or directory" in \
        err("--quick", "--data", str(tmp_path / "wiki"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    assert f'{bad} line 2: no "text" field' in err("--quick", "--data", str(bad), "--cache-dir",
                                                   str(tmp_path / "c"))
    ids = np.array([1, 2, 3, 256, 4], dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    assert f"{tmp_path / 't.bin'}: token id 256 at offset 3 (byte 6) is not below the vocabulary " \
           f"size 256 (the model's, preset nano)" in err("--quick", "--data", str(tmp_path / "t.bin"))
    hf = tmp_path / "gpt2.json"
    hf.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                              "n_positions": 32, "vocab_size": 50}))
    assert f"has {ref.get_vocab_size()} ids, the model's vocabulary 50 (the model's, Hugging Face " \
           f"gpt2 config {hf})" in err("--hf-config", str(hf), "--data", str(d / "corpus.jsonl"),
                                       "--tokenizer", str(d / "tok"), "--cache-dir", str(tmp_path))


def test_finetune_hf_on_jsonl_with_its_tokenizer_resumes_bit_for_bit(corpus, tmp_path):
    """GPT-2 has dropout: the resumed run must also continue torch's RNG. CPU Adam only."""
    d, ref = corpus
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=128))
    base.save_pretrained(tmp_path / "base")
    spec = importlib.util.spec_from_file_location("finetune_hf", ROOT / "scripts" / "finetune_hf.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)

    def run(*more):
        return finetune.main([str(tmp_path / "base"), "--out", str(tmp_path / "out"), "--config",
                              str(d / "cpu_adam.json"), "--seq", "16", "--data",
                              str(d / "corpus.jsonl"), "--tokenizer", str(d / "tok"), "--cache-dir",
                              str(d / "cache"), "--eval-every", "2", "--eval-batches", "2", *more])
    straight = run("--steps", "4")
    assert [e["step"] for e in straight["eval"]] == [2, 4]
    run("--steps", "2", "--save-every", "2", "--save-dir", str(tmp_path / "ck"))
    # Resumed from the step folder itself; later checkpoints go beside it.
    resumed = run("--steps", "4", "--resume", str(tmp_path / "ck" / "step2"), "--save-every", "2")
    assert resumed["start_step"] == 2
    assert resumed["checkpoints"] == [str(tmp_path / "ck" / "step4")]
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["eval"] == straight["eval"][1:]
    assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").config.vocab_size == 128
