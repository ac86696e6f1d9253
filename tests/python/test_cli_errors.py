"""tidal-train and tidal-estimate on bad input (issue 42): each failure is one line
on stderr naming the file or value and what to do, a nonzero exit status, no
traceback, and nothing lost.

A full disk is simulated by making the writes of one module raise
OSError(ENOSPC) with no path, as a real full disk does. The expectations are
independent of the code under test: the bytes a checkpoint's meta.json says
its states take, byte counts of the files the tests write, controls counted
by a loop over the bytes, transformers' own defaults, json's own message.
"""
import builtins
import errno
import gzip
import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import transformers

import tidal
import tidal.engine.checkpoint as checkpoint_module
from tidal import train
from tidal.estimate import main as estimate_main
from tidal.data import sources

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keep_device():
    """run() switches the process-wide device (the quick config asks for 'sim'): restore it."""
    previous = tidal.get_device()
    try:
        yield
    finally:
        tidal._C.set_default_device(previous)


def fails(capsys, argv, status=2, main=train.main):
    """The one line a command printed on stderr as it exited with `status`."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


class FullDisk:
    """A file whose writes fail as a full disk's do: OSError(ENOSPC), no path."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def full_disk_for(monkeypatch, module, should_fail):
    """Makes `module`'s open() return FullDisk files for paths should_fail(path) accepts."""
    real = builtins.open

    def fake_open(path, mode="r", *args, **kwargs):
        f = real(path, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode and should_fail(str(path)) else f
    monkeypatch.setattr(module, "open", fake_open, raising=False)


def quick(*argv):
    return ["--quick", "--no-progress", "--seq", "32", *argv]


# ------------------------------------------------------------------ full disks
def test_a_full_disk_while_saving_a_checkpoint_names_it_and_keeps_the_previous(
        tmp_path, keep_device, capsys, monkeypatch):
    ck = tmp_path / "ck"
    full_disk_for(monkeypatch, checkpoint_module, lambda p: ".step4.tmp-" in p)
    line = fails(capsys, quick("--steps", "4", "--save-every", "2", "--save-dir", str(ck)), status=1)
    meta = json.loads((ck / "step2" / "meta.json").read_text())
    need = meta["files"]["states.bin"]     # the bytes step 4's states would take too
    assert re.fullmatch(
        re.escape(f"tidal-train: error: after step 4: --save-dir {ck}: saving checkpoint "
                  f"{ck / 'step4'} failed: No space left on device (errno 28), writing about "
                  f"{need:,} bytes (weights and Adam states), ") + r"[\d,]+"
        + re.escape(f" bytes free there; {ck / 'step2'} is intact (--resume {ck} continues from "
                    f"it, after step 2); free space on that disk, or give --save-dir DIR on one "
                    f"with room"), line), line
    # Nothing lost: latest still names step 2, no half-written step 4 or temporary
    # folder is left, and every slot of step 2 passes its CRC-32 ...
    assert (ck / "latest").read_text() == "step2"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step2"]
    states = (ck / "step2" / "states.bin").read_bytes()
    assert len(states) == need
    for e in meta["slots"]:
        assert zlib.crc32(states[e["offset"]:e["offset"] + e["bytes"]]) == e["crc32"], e["name"]
    # ... and it resumes.
    monkeypatch.undo()
    capsys.readouterr()
    report = train.run(quick("--steps", "3", "--resume", str(ck)))
    assert report["start_step"] == 2 and len(report["losses"]) == 1


def test_a_full_disk_while_writing_the_token_cache_names_it(tmp_path, keep_device, capsys,
                                                           monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    a, b = b"the chunks move between host and device.\n" * 40, b"adam runs on the host.\n" * 60
    (corpus / "a.txt").write_bytes(a)
    (corpus / "b.txt").write_bytes(b)
    cache = tmp_path / "cache"
    full_disk_for(monkeypatch, sources, lambda p: p.startswith(str(cache)))
    argv = quick("--steps", "1", "--data", str(corpus), "--cache-dir", str(cache))
    line = fails(capsys, argv)
    # Byte-level ids of a folder: one uint8 per byte, the documents joined by "\n\n".
    ids = len(a) + 2 + len(b)
    assert re.fullmatch(
        re.escape(f"tidal-train: error: --cache-dir {cache}: cannot write the token cache of "
                  f"{corpus} to {cache}/corpus-") + r"[0-9a-f]{16}" + re.escape(
            f".uint8.bin: No space left on device (errno 28), with 0 bytes written and {ids:,} "
            f"more to write; the whole cache takes about {ids:,} bytes; free space there, or give "
            f"--cache-dir DIR (or TIDAL_DATA_CACHE) on a disk with room; the partial cache was "
            f"removed and {corpus} is untouched"), line), line
    assert list(cache.iterdir()) == []
    assert (corpus / "a.txt").read_bytes() == a and (corpus / "b.txt").read_bytes() == b
    monkeypatch.undo()
    report = train.run(argv)
    assert report["data_source"] == f"{corpus} ({ids:,} tokens, cached in " \
        f"{next(cache.glob('*.bin'))})"


# ------------------------------------------------------------- budgets, models
def test_a_budget_larger_than_the_device_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"}
    proc = subprocess.run([sys.executable, "-m", "tidal.train", "--quick", "--budget", "10TB",
                           "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 2
    capacity = 8 << 30   # the simulated device's default capacity
    assert proc.stderr.splitlines() == [
        f"tidal-train: error: --budget 10TB: config key 'tidal.device_memory_budget': "
        f"{10 * 10 ** 12} bytes is more than the sim device has ({capacity} bytes); give at most "
        f"8.0 GiB ({capacity} bytes), or 0 for the whole device"]


def test_a_model_larger_than_the_budgets_is_one_line(tmp_path, keep_device, capsys):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
              "tidal": {"device": "sim", "chunk_size": "64KiB", "device_memory_budget": "2MiB",
                        "device_margin": "256KiB", "host_memory_budget": "3MiB"}}
    path = tmp_path / "small.json"
    path.write_text(json.dumps(config))
    line = fails(capsys, ["--preset", "tiny", "--config", str(path), "--no-progress"])
    assert line.startswith("tidal-train: error: preset tiny does not fit: the model's states do "
                           "not fit in host + device memory: ")
    # 3 MiB less the host reserve of two fp32 chunks of 64 KiB
    assert f"chunks may hold {(3 << 20) - 2 * (64 << 10)} bytes on the host" in line
    assert line.endswith("(--budget sets the device budget, --nvme DIR puts the optimizer states on a "
                         "disk; tidal-estimate tells what fits before anything is built)")

    # Activations past the device budget at the first step: status 1, the run stops.
    config["train_micro_batch_size_per_gpu"] = 64
    config["tidal"].update(device_memory_budget="1500KiB")
    del config["tidal"]["host_memory_budget"]
    path.write_text(json.dumps(config))
    line = fails(capsys, ["--preset", "nano", "--config", str(path), "--no-progress"], status=1)
    assert line.startswith(f"tidal-train: error: step 1: tidal: the forward ran out of the device "
                           f"budget of {1500 * 1024} bytes (margin {256 * 1024}): ")
    assert line.endswith("; tidal-train stops here, the run has no checkpoint; --budget raises "
                         "the device budget, --batch lowers the micro batch")
    assert "the engine goes on with the next batch" not in line


# ------------------------------------------------------------------- data files
def control_bytes(data: bytes):
    """(offset of the first, count of) C0 controls other than \\t \\n \\v \\f \\r and ESC."""
    hits = [i for i, c in enumerate(data) if c < 32 and c not in (9, 10, 11, 12, 13, 27)]
    return hits[0], len(hits)


def test_binary_data_given_as_text_is_refused(tmp_path, keep_device, capsys):
    garbage = tmp_path / "corpus.txt"
    data = np.random.default_rng(0).bytes(5000)
    garbage.write_bytes(data)
    first, count = control_bytes(data)
    assert fails(capsys, quick("--data", str(garbage))) == (
        f"tidal-train: error: {garbage}: binary data, not text: token ids go in a *.bin (with "
        f"--data-dtype), a document in a text or JSONL file (byte {first} is 0x{data[first]:02x}; "
        f"{count:,} of the first 5,000 bytes are control characters, which text does not hold)")
    packed = tmp_path / "corpus2.txt"
    packed.write_bytes(gzip.compress(b"the chunks move. " * 500, mtime=0))
    assert fails(capsys, quick("--data", str(packed))).startswith(
        f"tidal-train: error: {packed}: gzip-compressed: decompress it first (gunzip) (byte 0 is "
        f"0x1f; ")
    # In a folder (through the token cache) too, naming the file.
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("plain text\twith a tab and \x1b[1mbold\x1b[0m.\n" * 20)
    (tmp_path / "docs" / "b.txt").write_bytes(data)
    assert fails(capsys, quick("--data", str(tmp_path / "docs"), "--cache-dir",
                               str(tmp_path / "c"))).startswith(
        f"tidal-train: error: {tmp_path / 'docs' / 'b.txt'}: binary data, not text")
    # Text with tabs and terminal escapes is text.
    src = sources.open_source(tmp_path / "docs" / "a.txt", tidal.data.ByteTokenizer())
    assert bytes(src.tokens) == (tmp_path / "docs" / "a.txt").read_bytes()


def test_uint32_ids_read_as_uint16_are_refused(tmp_path, keep_device, capsys):
    ids = (np.arange(2000) * 7 % 200).astype(np.uint32)   # small ids, nanoGPT-style flat file
    path = tmp_path / "train.bin"
    ids.tofile(path)
    want = (f"tidal-train: error: {path}: read as uint16, every id at an odd offset is 0 (2,000 of "
            f"them) and not every one at an even offset: the layout of uint32 ids below 65536, "
            f"which would train on a 0 after every token; give --data-dtype uint32")
    assert fails(capsys, quick("--data", str(path), "--data-dtype", "uint16")) == want
    assert fails(capsys, quick("--data", str(path))) == want   # uint16 inferred from vocab 256
    report = train.run(quick("--data", str(path), "--data-dtype", "uint32", "--steps", "1"))
    assert report["data_source"] == f"{path} (uint32, 2,000 tokens)"


# ------------------------------------------------------------------ config files
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256,
         "max_position_embeddings": 64}


def test_a_misspelt_key_of_a_hugging_face_config_is_named(tmp_path, keep_device, capsys):
    typo = dict(LLAMA)
    typo["hiden_size"] = typo.pop("hidden_size")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(typo))
    default = transformers.LlamaConfig().hidden_size
    want = (f"{path}: unknown key 'hiden_size'; did you mean 'hidden_size'? LlamaConfig does not "
            f"read 'hiden_size', so hidden_size would be its default ({default}); fix the key")
    assert fails(capsys, [str(path), "--no-measure"], main=estimate_main) == \
        f"tidal-estimate: error: {want}"
    assert fails(capsys, ["--hf-config", str(path), "--quick"]) == \
        f"tidal-train: error: --hf-config {want}"
    # A TinyGPT of a config's shape (no model_type) reads its keys by name too.
    shape = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 256,
             "n_iner": 256}
    path.write_text(json.dumps(shape))
    assert fails(capsys, ["--hf-config", str(path), "--quick"]) == \
        f"tidal-train: error: --hf-config {path}: unknown key 'n_iner'; did you mean 'n_inner'? " \
        f"fix the key"


def test_keys_a_config_class_does_not_read_are_a_warning(tmp_path, capsys):
    # Published configs hold keys their class ignores: gpt2's n_ctx (GPT2Config reads
    # n_positions). Its keys, small figures: a one-line warning naming n_ctx only.
    gpt2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
            "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
            "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
            "n_ctx": 64, "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64,
            "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
            "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
            "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
            "vocab_size": 50257}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gpt2))
    assert estimate_main([str(path), "--no-measure", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"tidal-estimate: warning: {path}: GPT2Config does not read "
                                f"'n_ctx': the model is built without it"]
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2))
    assert json.loads(out)["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    # Llama-2's published keys: every one is LlamaConfig's or metadata.
    llama2 = dict(LLAMA, _name_or_path="meta-llama/Llama-2-7b-hf", architectures=["LlamaForCausalLM"],
                  bos_token_id=1, eos_token_id=2, hidden_act="silu", initializer_range=0.02,
                  num_key_value_heads=4, pretraining_tp=1, rms_norm_eps=1e-05, rope_scaling=None,
                  tie_word_embeddings=False, torch_dtype="float16",
                  transformers_version="4.31.0.dev0", use_cache=True)
    path.write_text(json.dumps(llama2))
    assert estimate_main([str(path), "--no-measure"]) == 0
    assert capsys.readouterr().err == ""


def test_a_truncated_config_names_the_file(tmp_path, capsys):
    text = json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}})
    path = tmp_path / "ds.json"
    path.write_text(text[:40])
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(text[:40])
    assert fails(capsys, ["--quick", "--config", str(path)]) == (
        f"tidal-train: error: --config {path}: not JSON ({e.value}); a DeepSpeed-style config is "
        f"one JSON object (configs/gpt_quick.json is an example)")
    assert fails(capsys, ["nano", "--config", str(path), "--no-measure"], main=estimate_main) == \
        f"tidal-estimate: error: config file '{path}' is not valid JSON: {e.value}"


def test_a_latest_file_naming_a_missing_checkpoint(tmp_path, keep_device, capsys):
    ck = tmp_path / "ck"
    train.run(quick("--steps", "2", "--save-every", "1", "--save-dir", str(ck)))
    capsys.readouterr()
    (ck / "latest").write_text("step9")
    assert fails(capsys, quick("--steps", "4", "--resume", str(ck))) == (
        f"tidal-train: error: --resume {ck}: {ck / 'latest'} names 'step9', which is not a "
        f"checkpoint in {ck}; the checkpoints there are step1, step2: give --resume "
        f"{ck / 'step2'} (or start a new run)")
    (ck / "latest").write_text("")
    assert fails(capsys, quick("--steps", "4", "--resume", str(ck))) == (
        f"tidal-train: error: --resume {ck}: {ck / 'latest'} is empty; the checkpoints there are "
        f"step1, step2: give --resume {ck / 'step2'} (or start a new run)")


def test_output_paths_that_cannot_be_written_are_refused_before_training(tmp_path, capsys):
    missing = tmp_path / "nope" / "report.json"
    assert fails(capsys, quick("--json", str(missing))) == (
        f"tidal-train: error: --json {missing}: the folder {missing.parent} does not exist; "
        f"create it first")
    report = tmp_path / "report.json"
    report.write_text("")
    assert fails(capsys, quick("--save-every", "2", "--save-dir", str(report))) == (
        f"tidal-train: error: --save-dir {report}: a file, expected a folder for the checkpoints "
        f"(or a new name)")


def test_a_corpus_that_cannot_be_read_is_one_line(tmp_path, keep_device, capsys, monkeypatch):
    path = tmp_path / "corpus.txt"
    path.write_text("the chunks move between host and device.\n" * 50)
    real = builtins.open

    def unreadable(p, mode="r", *args, **kwargs):
        if str(p) == str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))
        return real(p, mode, *args, **kwargs)
    monkeypatch.setattr(sources, "open", unreadable, raising=False)
    assert fails(capsys, quick("--data", str(path))) == \
        f"tidal-train: error: --data {path}: cannot read {path}: Permission denied"
