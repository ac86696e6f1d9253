"""Your own data (tidal.data: sources, tokenizer, windows, options) without training.

References are independent of the code under test: the files' own bytes, the
`tokenizers` object the tokenizer directory was saved from, numpy arrays
written with tofile(), and json.loads of each line. Training with the data,
validation and bit-exact resume are in test_train_data.py.
"""
import argparse
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tidal.data import (ByteTokenizer, DataError, SyntheticBatches, TokenWindows, load_tokenizer,
                        open_source, sources)
from tidal.data import options as data_options

ROOT = Path(__file__).resolve().parents[2]

PROSE = ("The quick brown fox jumps over the lazy dog. Chunks move between the host and the "
         "device as the model runs, and the optimizer updates them where they are. ")


def make_tokenizer(directory: Path, texts, vocab=300):
    """A BPE tokenizer trained here from `texts` (nothing downloaded), saved as
    save_pretrained writes it; returns the `tokenizers` object it was saved from."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            unk_token="[UNK]").save_pretrained(str(directory))
    return tok


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    ref = make_tokenizer(d, [PROSE * 20, "héllo wörld naïve café\n" * 10])
    return d, ref


def open_(path, tokenizer=None, tmp=None, **kw):
    return open_source(path, tokenizer or ByteTokenizer(), cache_dir=tmp, **kw)


# ---------------------------------------------------------------- formats
def test_a_text_file_read_byte_level_is_its_bytes_mapped_not_copied(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_bytes(PROSE.encode() * 3 + "ünïcode\n".encode())
    src = open_(f, tmp=tmp_path / "cache")
    assert isinstance(src.tokens, np.memmap) and src.cache is None
    assert bytes(src.tokens) == f.read_bytes() and src.vocab_size == 256
    assert not (tmp_path / "cache").exists()   # no copy made


def test_a_folder_is_its_text_files_in_path_order_joined_by_a_blank_line(tmp_path):
    root = tmp_path / "docs"
    (root / "b").mkdir(parents=True)
    (root / "b" / "two.md").write_text("second file")
    (root / "a.txt").write_text("first file\n")
    (root / "c.rst").write_text("third")
    (root / "skip.csv").write_text("not, text")
    (root / ".hidden.txt").write_text("hidden")
    (root / "empty.txt").write_text("")
    src = open_(root, tmp=tmp_path / "cache")
    # Sorted paths: a.txt, b/two.md, c.rst, empty.txt (no bytes); hidden and .csv left out.
    expected = b"\n\n".join([b"first file\n", b"second file", b"third"])
    assert bytes(src.tokens) == expected and src.cache.parent == tmp_path / "cache"


def test_jsonl_text_fields_are_the_documents(tmp_path):
    f = tmp_path / "d.jsonl"
    records = [{"text": "alpha", "id": 1}, {"text": "béta\nline"}, {"text": ""}, {"text": "gamma"}]
    f.write_text("\n".join(json.dumps(r) for r in records[:2]) + "\n\n  \n" +
                 "\n".join(json.dumps(r) for r in records[2:]) + "\n")
    src = open_(f, tmp=tmp_path / "cache")
    texts = [json.loads(line)["text"] for line in f.read_text().splitlines() if line.strip()]
    assert bytes(src.tokens) == "\n\n".join(t for t in texts if t).encode()


def test_a_hugging_face_tokenizer_encodes_jsonl_with_its_eos_between_documents(tmp_path, tokenizer_dir):
    d, ref = tokenizer_dir
    f = tmp_path / "d.jsonl"
    docs = ["The quick brown fox", "jumps over the lazy dog.", "héllo café"]
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = load_tokenizer(d)
    eos = ref.token_to_id("<|endoftext|>")
    assert (tok.vocab_size, tok.eos_id) == (ref.get_vocab_size(), eos)
    src = open_(f, tok, tmp=tmp_path / "cache")
    expected = ref.encode(docs[0]).ids + [eos] + ref.encode(docs[1]).ids + [eos] + ref.encode(docs[2]).ids
    assert src.tokens.tolist() == expected
    assert tok.vocab_size <= 256 and src.tokens.dtype == np.uint8   # the smallest dtype that holds them


def test_a_long_text_is_encoded_in_pieces_equal_to_the_whole(tmp_path, tokenizer_dir, monkeypatch):
    d, ref = tokenizer_dir
    monkeypatch.setattr(sources, "PIECE_BYTES", 64)   # many pieces
    lines = [PROSE[i % 50:] + f"line {i}" for i in range(40)]
    # And a line longer than a piece, cut at a space, then inside a word that the
    # tokenizer has no merges for (so the cut cannot change its ids).
    text = "\n".join(lines) + "\n" + "x" * 150 + " y " + "z" * 100
    f = tmp_path / "long.txt"
    f.write_text(text)
    seen = []
    tok = load_tokenizer(d)
    encode = tok.encode_batch
    monkeypatch.setattr(tok, "encode_batch", lambda pieces: seen.extend(pieces) or encode(pieces))
    src = open_(f, tok, tmp=tmp_path / "cache")
    # The Whitespace pre-tokenizer never joins across a space or newline: pieces cut there
    # encode as the whole text does.
    assert src.tokens.tolist() == ref.encode(text).ids
    assert len(seen) > 10 and max(len(p) for p in seen) <= 64


def test_token_files_map_uint16_and_uint32_and_meta_pkl_sets_the_dtype(tmp_path):
    ids16 = np.arange(1000, dtype=np.uint16) % 300
    (tmp_path / "a").mkdir()
    ids16.tofile(tmp_path / "a" / "train.bin")
    src = open_(tmp_path / "a" / "train.bin", vocab=300)
    assert isinstance(src.tokens, np.memmap) and src.tokens.dtype == np.uint16
    assert np.array_equal(src.tokens, ids16)
    ids32 = np.array([0, 69999, 123, 65536], dtype=np.uint32)
    (tmp_path / "b").mkdir()
    ids32.tofile(tmp_path / "b" / "train.bin")
    assert np.array_equal(open_(tmp_path / "b" / "train.bin", vocab=70000, dtype="uint32").tokens, ids32)
    # No --data-dtype: a vocabulary above 65536 means uint32 ...
    assert open_(tmp_path / "b" / "train.bin", vocab=70000).tokens.dtype == np.uint32
    # ... and a nanoGPT meta.pkl beside the file decides, and bounds the ids.
    with open(tmp_path / "b" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 70000, "itos": {0: "a"}, "stoi": {"a": 0}}, f)
    src = open_(tmp_path / "b" / "train.bin", vocab=100000)
    assert src.tokens.dtype == np.uint32 and src.vocab_size == 70000
    ns = argparse.Namespace(data=str(tmp_path / "b" / "train.bin"))
    assert data_options.data_vocab(ns, ByteTokenizer())[0] == 70000


def test_the_cache_is_reused_and_rebuilt_when_the_file_changes(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "one"}\n')
    built = []
    a = open_(f, tmp=tmp_path / "c", log=built.append)
    b = open_(f, tmp=tmp_path / "c", log=built.append)
    assert a.cache == b.cache and len(built) == 1
    f.write_text('{"text": "two!"}\n')
    c = open_(f, tmp=tmp_path / "c", log=built.append)
    assert c.cache != a.cache and len(built) == 2 and bytes(c.tokens) == b"two!"
    assert not list((tmp_path / "c").glob(".*tmp"))   # no temporary left behind


# ------------------------------------------------------------ bad input
def test_missing_and_empty_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match=f"--data {tmp_path / 'nope.txt'}: no such file or directory"):
        open_(tmp_path / "nope.txt")
    for name in ("e.txt", "e.jsonl", "e.bin"):
        (tmp_path / name).write_bytes(b"")
        with pytest.raises(DataError, match=f"--data {tmp_path / name}: the file is empty"):
            open_(tmp_path / name, vocab=300)


@pytest.mark.parametrize("line,message", [
    ('{"text": "ok"', r"line 2: not JSON \(Expecting ',' delimiter"),
    ('["text"]', r"line 2: a JSON list, not an object"),
    ('{"content": "x", "id": 3}', r"line 2: no \"text\" field \(keys: 'content', 'id'\)"),
    ('{"text": 42}', r"line 2: \"text\" is a int, not a string"),
    ("not json at all", r"line 2: not JSON"),
])
def test_a_bad_jsonl_line_is_named_by_number(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n' + line + "\n" + '{"text": "after"}\n')
    with pytest.raises(DataError, match=f"{f} {message}") as e:
        open_(f, tmp=tmp_path / "c")
    assert 'each line must be a JSON object with a "text" string' in str(e.value)
    assert not list((tmp_path / "c").glob("*")) or not list((tmp_path / "c").glob("*.bin"))


def test_jsonl_without_text_and_folders_without_text_files(tmp_path):
    f = tmp_path / "blank.jsonl"
    f.write_text("\n   \n" + json.dumps({"text": ""}) + "\n")
    with pytest.raises(DataError, match=f"--data {f}: no JSON lines with text"):
        open_(f, tmp=tmp_path / "c")
    root = tmp_path / "folder"
    root.mkdir()
    (root / "data.csv").write_text("a,b")
    (root / "x.json").write_text("{}")
    with pytest.raises(DataError, match=rf"--data {root}: a folder with no text files \(.txt, .text, "
                                        r".md, .rst\); it holds 2 other files, e.g. data.csv, x.json"):
        open_(root)


def test_ids_at_or_past_the_vocabulary_name_the_first_offset_and_value(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_SCAN_TOKENS", 7)   # the bad id in a later block
    ids = np.arange(100, dtype=np.uint16) % 50
    ids[61], ids[80] = 300, 999
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match=rf"{tmp_path / 'train.bin'}: token id 300 at offset 61 "
                                        r"\(byte 122\) is not below the vocabulary size 300 "
                                        r"\(the model's\)"):
        open_(tmp_path / "train.bin", vocab=300)
    np.arange(7, dtype=np.uint16).tofile(tmp_path / "odd.bin")
    with open(tmp_path / "odd.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match=r"15 bytes is not a whole number of uint16 ids"):
        open_(tmp_path / "odd.bin", vocab=300)
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 40}, f)   # the file's own vocabulary is the tighter bound
    with pytest.raises(DataError, match=r"token id 40 at offset 40 .* vocabulary size 40 "
                                        r"\(vocab_size of .*meta.pkl\)"):
        open_(tmp_path / "train.bin", vocab=300)


def test_a_meta_pkl_that_is_not_plain_data_is_refused(tmp_path):
    np.zeros(4, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 10, "cls": argparse.Namespace}, f)
    with pytest.raises(DataError, match=r"meta.pkl: not a nanoGPT meta.pkl \(it names "
                                        r"argparse.Namespace"):
        open_(tmp_path / "train.bin", vocab=300)


def test_text_that_is_not_utf8_names_the_line_under_a_tokenizer(tmp_path, tokenizer_dir):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"line one\nline two\ncaf\xe9 au lait\n")
    with pytest.raises(DataError, match=rf"{f} line 3: not UTF-8 \(byte 0xe9\)"):
        open_(f, load_tokenizer(tokenizer_dir[0]), tmp=tmp_path / "c")
    assert bytes(open_(f).tokens) == f.read_bytes()   # byte-level takes any bytes


def test_a_tokenizer_larger_than_the_model_names_both_sizes(tmp_path, tokenizer_dir):
    d, ref = tokenizer_dir
    f = tmp_path / "t.txt"
    f.write_text(PROSE)
    args = argparse.Namespace(data=str(f), eval_data=None, data_dtype=None, cache_dir=tmp_path,
                              seed=0, eval_fraction=0.05, eval_batches=2)
    with pytest.raises(DataError, match=rf"has {ref.get_vocab_size()} ids, the model's vocabulary "
                                        r"100 \(config.json\); the model needs at least as many"):
        data_options.open_batches(args, load_tokenizer(d), 100, "config.json", 8, 2, "cpu")
    with pytest.raises(DataError, match=rf"{f}: byte-level text needs a vocabulary of at least 256, "
                                        r"the model's is 100 \(config.json\)"):
        data_options.open_batches(args, ByteTokenizer(), 100, "config.json", 8, 2, "cpu")
    with pytest.raises(DataError, match=r"--tokenizer .*nope: no such directory"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=r"not a Hugging Face tokenizer directory"):
        load_tokenizer(tmp_path / "empty_dir")


# ------------------------------------------------------- split and batches
def test_training_windows_stay_before_the_held_out_tail_and_eval_is_fixed():
    tokens = np.arange(1000, dtype=np.uint16)   # each id names its offset
    w = TokenWindows(tokens, seq=16, batch=4, eval_fraction=0.1, eval_batches=3, seed=5)
    assert (w.train_tokens, w.eval_start, w.eval_end) == (900, 900, 1000)
    for i in range(300):
        x, y = w.batch(i)
        assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y, x + 1)   # shifted windows
        assert int(y.max()) < 900   # no training target in the held-out tail
    ev = list(w.eval_set())
    assert len(ev) == 3 and all(x.shape == (4, 16) for x, _ in ev)
    starts = torch.cat([x[:, 0] for x, _ in ev]).tolist()
    assert starts[0] == 900 and starts[-1] == 1000 - 17 and starts == sorted(starts)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ev, w.eval_set()))   # the same every time
    assert not TokenWindows(tokens, 16, 4, eval_fraction=0).has_eval


def test_the_next_batch_index_resumes_the_same_stream_and_checks_its_corpus():
    tokens = np.arange(5000, dtype=np.uint32)
    straight = TokenWindows(tokens, 8, 3, seed=2)
    expected = [next(straight) for _ in range(10)]
    first = TokenWindows(tokens, 8, 3, seed=2)
    got = [next(first) for _ in range(4)]
    state = first.state_dict()
    assert state["next_batch"] == 4
    second = TokenWindows(tokens, 8, 3, seed=2)
    second.load_state_dict(state)
    got += [next(second) for _ in range(6)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))
    with pytest.raises(DataError, match=r"the checkpoint was trained on other batches: seq 8 "
                                        r"there, 16 now; resume with the same --data, --seq"):
        TokenWindows(tokens, 16, 3, seed=2).load_state_dict(state)
    syn = SyntheticBatches(50, 8, 2, seed=1)
    a = [next(syn) for _ in range(3)]
    syn2 = SyntheticBatches(50, 8, 2, seed=1)
    syn2.load_state_dict({**syn.state_dict(), "next_batch": 2})
    assert torch.equal(next(syn2)[0], a[2][0])


def test_too_little_data_for_a_window_or_a_split_is_clear():
    with pytest.raises(DataError, match=r"x: 10 training tokens, fewer than one window of seq \+ 1 = 17"):
        TokenWindows(np.zeros(10, np.uint16), 16, 2, eval_fraction=0, name="x")
    with pytest.raises(DataError, match=r"x: the held-out tail \(5 tokens, --eval-fraction 0.05\) is "
                                        r"shorter than one window of seq \+ 1 = 17"):
        TokenWindows(np.zeros(100, np.uint16), 16, 2, name="x")


def test_data_arguments_that_cannot_work_exit_with_a_message(capsys):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    data_options.add_arguments(ap)

    def err(*argv):
        with pytest.raises(SystemExit):
            data_options.check_arguments(ap, ap.parse_args(list(argv)))
        return capsys.readouterr().err
    assert "--save-every needs --save-dir DIR" in err("--save-every", "5")
    assert "--eval-fraction must be in [0, 1), got 1.0" in err("--eval-fraction", "1")
    assert "--tokenizer applies to --data PATH, not to the built-in corpus 'text'" in \
        err("--tokenizer", "x")
    assert "--eval-every must be 0 (never) or a number of steps, got -1" in err("--eval-every", "-1")


# ------------------------------------------------------------- streaming
_UNDER_A_CAP = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    from tidal.data import ByteTokenizer, TokenWindows, open_source

    def vm_data():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024

    path, cache, vocab, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    np.zeros(1 << 20).sum()   # numpy's own first allocations before the cap
    # RLIMIT_DATA bounds private and anonymous memory (malloc, numpy arrays), not a
    # read-only file mapping: a loader that read the file into memory would fail here.
    limit = vm_data() + cap
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    src = open_source(path, ByteTokenizer(), vocab=vocab, cache_dir=cache)
    w = TokenWindows(src.tokens, 64, 8, seed=0)
    rows = sum(int(next(w)[0].shape[0]) for _ in range(50))
    print(json.dumps({"tokens": int(src.tokens.size), "rows": rows, "eval": len(list(w.eval_set()))}))
""")


def _capped(tmp_path, path, vocab, cap):
    script = tmp_path / "capped.py"
    script.write_text(_UNDER_A_CAP)
    proc = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "cache"),
                           str(vocab), str(cap)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_a_token_file_four_times_the_memory_cap_trains_and_is_checked(tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:   # 256 MiB of uint16 ids, sparse: zeros cost no disk
        f.truncate(256 << 20)
        f.seek(200 << 20)
        np.full(1000, 299, dtype=np.uint16).tofile(f)
    got = _capped(tmp_path, path, 300, 64 << 20)
    assert got == {"tokens": 128 << 20, "rows": 400, "eval": 8}
    # The same scan finds an id past the vocabulary near the end, under the same cap.
    with open(path, "r+b") as f:
        f.seek((250 << 20) + 2)
        np.array([300], dtype=np.uint16).tofile(f)
    with pytest.raises(AssertionError, match=r"token id 300 at offset 131072001"):
        _capped(tmp_path, path, 300, 64 << 20)


def test_a_jsonl_corpus_larger_than_the_memory_cap_is_tokenized_in_pieces(tmp_path):
    path = tmp_path / "big.jsonl"
    line = (json.dumps({"text": PROSE * 8, "meta": "x" * 100}) + "\n").encode()
    with open(path, "wb") as f:
        f.write(line * ((48 << 20) // len(line)))   # 48 MiB
    got = _capped(tmp_path, path, 256, 12 << 20)
    n = (48 << 20) // len(line)
    assert got["tokens"] == n * len((PROSE * 8).encode()) + (n - 1) * 2   # texts and separators
    assert got["rows"] == 400
