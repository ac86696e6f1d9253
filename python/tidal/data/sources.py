"""A user's corpus as one flat array of token ids, memory-mapped, never read whole.

Note [Token sources]
~~~~~~~~~~~~~~~~~~~~
`--data PATH` is one of four things, told apart by the path:
  a folder          every text file under it (suffixes in TEXT_SUFFIXES, hidden
                    files and folders skipped), in sorted path order, each one
                    document;
  *.jsonl           one JSON object per line, its "text" string one document
                    (blank lines skipped);
  *.bin             token ids already (nanoGPT's train.bin: a flat array of
                    uint16 or uint32, native byte order), memory-mapped as is;
  any other file    one text document.
Text becomes ids once: the documents are read in pieces of about a MiB (cut
after a newline; a line longer than that at a space, else at a UTF-8
character boundary), encoded a batch of pieces at a time and appended to a
cache file <cache>/<name>-<key>.<dtype>.bin, which is then memory-mapped as a
*.bin is. Documents are joined with the tokenizer's end-of-text id, or with
the encoding of a blank line when it has none (byte-level has none). The key
hashes the files' paths, sizes and modification times and the tokenizer's
files, so an edit or another tokenizer builds a new cache; the file is
written under a temporary name and renamed into place, with its .json
description written last, so a killed build is never taken for a finished
one. One exception: a single text file read byte-level is already an array of
uint8 ids and is mapped directly, without a cache.

So memory holds one piece (and its ids) while tokenizing, and while training
only the pages of the windows a batch reads: a corpus larger than RAM trains.
A tokenizer whose tokens can span a line break may encode a piece boundary
differently from the whole text at once (byte-level cannot).

Checks, each a DataError naming the file: missing, empty, a folder with no
text files, a JSONL line that is not JSON, not an object or without a "text"
string (by line number), text that is not UTF-8 under a Hugging Face tokenizer
(by line number), a text file that is binary (Note [Binary data read as
text]), a *.bin whose size is not a multiple of its dtype, ids at or beyond
the vocabulary in a *.bin (the first such offset and value), and a *.bin read
as uint16 whose every other id is 0, the pattern of small uint32 ids (the
file is scanned once, a block at a time, through a fixed buffer, for both).
A token cache that cannot be written (a full disk) names the cache file, the
bytes written and the bytes the write wanted, and --cache-dir.

Note [Binary data read as text]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Byte-level tokens take any bytes, so a model checkpoint, an archive or a
UTF-16 file given as --data would train without a word. Text has no NUL byte
and almost no C0 control characters (tab, newline, carriage return, form
feed and escape aside), while binary data has about one byte in nine of them.
So the first TEXT_SNIFF_BYTES of each text file are checked: a NUL, or more
than 1% control characters (and at least 8), is a DataError that names the
first such byte, and the format when its magic number is a known one (gzip,
zip, UTF-16, ...). Only the start is read, so the check costs nothing on a
large corpus; binary data that starts with a page of text is not caught.

The dtype of a *.bin: --data-dtype when given; else the vocab_size of a
nanoGPT meta.pkl beside it; else the vocabulary the ids must fit (the
tokenizer's, else the model's); uint16 when that is at most 65536, uint32
above (nanoGPT writes uint16 for GPT-2's 50257).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .tokenizer import ByteTokenizer, DataError

__all__ = ["TEXT_SUFFIXES", "TOKEN_DTYPES", "TokenSource", "data_kind", "default_cache_dir",
           "dtype_for_vocab", "read_nanogpt_meta", "check_token_ids", "check_text",
           "open_token_file", "tokenize_to_cache", "open_source"]

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
PIECE_BYTES = 1 << 20       # text read and encoded this much at a time
TEXT_SNIFF_BYTES = 1 << 16  # the start of a text file checked for binary data
_PAIRED_ZEROS_MIN = 256     # ids a uint16 file needs before its zero pattern is judged
_ENCODE_BATCH = 256         # pieces (or JSONL documents) per encoder call
_SCAN_TOKENS = 1 << 22      # ids per block of the vocabulary scan
_CACHE_VERSION = 1


@dataclasses.dataclass
class TokenSource:
    """A corpus as ids: `tokens` is a 1-D array (a numpy.memmap for files).

    Attributes:
        tokens: the ids, in corpus order.
        description: how messages name it (the path, and the cache if any).
        vocab_size: the vocabulary the ids come from when known (the
            tokenizer's, or a meta.pkl's), else None.
        path: the file or folder given, None for an in-memory corpus.
        cache: the token cache file, when text was tokenized into one.
    """

    tokens: np.ndarray
    description: str
    vocab_size: int | None = None
    path: Path | None = None
    cache: Path | None = None


def data_kind(path) -> str:
    """'folder', 'jsonl', 'tokens' or 'text' (Note [Token sources]).

    Args:
        path: what --data names; must exist.
    """
    p = Path(path)
    if p.is_dir():
        return "folder"
    suffix = p.suffix.lower()
    return "jsonl" if suffix == ".jsonl" else "tokens" if suffix == ".bin" else "text"


def default_cache_dir() -> Path:
    """$TIDAL_DATA_CACHE, else $XDG_CACHE_HOME/tidal/tokens, else ~/.cache/tidal/tokens."""
    if os.environ.get("TIDAL_DATA_CACHE"):
        return Path(os.environ["TIDAL_DATA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tidal" / "tokens"


def dtype_for_vocab(vocab: int):
    """The smallest unsigned dtype for ids below `vocab` (uint8, uint16 or uint32).

    Args:
        vocab: the vocabulary size.
    """
    return np.uint8 if vocab <= 1 << 8 else np.uint16 if vocab <= 1 << 16 else np.uint32


def _exists(path, what="--data") -> Path:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {path}: no such file or directory")
    if p.is_file() and p.stat().st_size == 0:
        raise DataError(f"{what} {path}: the file is empty (0 bytes); nothing to train on")
    return p


class _PlainData(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numbers only: a meta.pkl is data, and
    a pickle that names a class or function would run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}; a nanoGPT meta.pkl holds only "
                                     f"plain data (vocab_size, itos, stoi)")


def read_nanogpt_meta(bin_path) -> dict | None:
    """The meta.pkl beside a nanoGPT *.bin (prepare.py's vocab_size, itos, stoi), or None.

    Args:
        bin_path: the token file; meta.pkl is looked for in its folder.
    """
    meta = Path(bin_path).parent / "meta.pkl"
    if not meta.is_file():
        return None
    try:
        with open(meta, "rb") as f:
            value = _PlainData(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DataError(f"{meta}: not a nanoGPT meta.pkl ({e}); remove it or give --data-dtype "
                        f"and --tokenizer") from None
    vocab = value.get("vocab_size") if isinstance(value, dict) else None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise DataError(f"{meta}: expected a dict with a positive integer 'vocab_size', got "
                        f"{vocab!r}")
    return value


def check_token_ids(path, dtype, limit: int | None, limit_name: str) -> int:
    """Scans a token file, a fixed buffer at a time, for ids >= `limit` and, read as
    uint16, for the zero in every other id of uint32 ids (Note [Token sources]);
    returns the count of ids.

    Args:
        path: the file.
        dtype: its ids' dtype.
        limit: the vocabulary size ids must stay below (None: not checked).
        limit_name: what the limit is, for the message ("the tokenizer's", ...).
    """
    dtype = np.dtype(dtype)
    buf = np.empty(_SCAN_TOKENS, dtype=dtype)
    offset = 0
    # Whether an id at an even / odd offset of the file is not 0 (uint16 only).
    nonzero = [False, False]
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(memoryview(buf).cast("B"))
            if not got:
                break
            n = got // dtype.itemsize
            block = buf[:n]
            if n and limit is not None and int(block.max()) >= limit:
                i = int(np.argmax(block >= limit))
                raise DataError(
                    f"{path}: token id {int(block[i])} at offset {offset + i} (byte "
                    f"{(offset + i) * dtype.itemsize}) is not below the vocabulary size {limit} "
                    f"({limit_name}); the file was written with another tokenizer, or its dtype "
                    f"is not {dtype.name} (--data-dtype)")
            if dtype == np.uint16:
                for parity in (0, 1):
                    # block[j] is at file offset offset + j: parity p starts at j = (p - offset) % 2
                    nonzero[parity] = nonzero[parity] or bool(block[(parity - offset) % 2::2].any())
            offset += n
    if dtype == np.uint16 and offset >= _PAIRED_ZEROS_MIN and nonzero[0] and not nonzero[1]:
        raise DataError(
            f"{path}: read as uint16, every id at an odd offset is 0 ({offset // 2:,} of them) and "
            f"not every one at an even offset: the layout of uint32 ids below 65536, which would "
            f"train on a 0 after every token; give --data-dtype uint32")
    return offset


def open_token_file(path, dtype=None, vocab: int | None = None, vocab_name: str = "the model's",
                    check: bool = True) -> TokenSource:
    """Memory-maps a pre-tokenized *.bin (a flat array of ids, nanoGPT's layout).

    Args:
        path: the file.
        dtype: "uint16", "uint32" or None to infer it (Note [Token sources]).
        vocab: ids must be below this (None: not checked, unless a meta.pkl
            gives a vocabulary).
        vocab_name: whose vocabulary `vocab` is, for messages.
        check: scan every id against the vocabulary (one pass, fixed memory).
    """
    p = _exists(path)
    if p.is_dir():
        raise DataError(f"--data {path}: a folder, expected a token file")
    meta = read_nanogpt_meta(p)
    meta_vocab = meta["vocab_size"] if meta else None
    if dtype is None:
        basis = meta_vocab or vocab
        if basis is None:
            raise DataError(f"--data {path}: cannot tell uint16 from uint32 (no meta.pkl beside "
                            f"it, no vocabulary known); give --data-dtype")
        np_dtype = np.dtype(np.uint16 if basis <= 1 << 16 else np.uint32)
    elif dtype in TOKEN_DTYPES:
        np_dtype = np.dtype(TOKEN_DTYPES[dtype])
    else:
        raise DataError(f"--data-dtype {dtype!r}: expected one of {', '.join(TOKEN_DTYPES)}")
    size = p.stat().st_size
    if size % np_dtype.itemsize:
        raise DataError(f"--data {path}: {size} bytes is not a whole number of {np_dtype.name} ids "
                        f"({np_dtype.itemsize} bytes each); is --data-dtype right?")
    limit, name = vocab, vocab_name
    if meta_vocab is not None and (limit is None or meta_vocab < limit):
        limit, name = meta_vocab, f"vocab_size of {p.parent / 'meta.pkl'}"
    if check:
        check_token_ids(p, np_dtype, limit, name)
    tokens = np.memmap(p, dtype=np_dtype, mode="r")
    return TokenSource(tokens, f"{p} ({np_dtype.name}, {tokens.size:,} tokens)", meta_vocab, p)


# ---------------------------------------------------------------- text to ids
# Magic numbers of binary formats a corpus is often kept in, for the message.
_MAGIC = ((b"\x1f\x8b", "gzip-compressed: decompress it first (gunzip)"),
          (b"PK\x03\x04", "a zip archive: extract it first"),
          (b"BZh", "bzip2-compressed: decompress it first (bunzip2)"),
          (b"\xfd7zXZ\x00", "xz-compressed: decompress it first (unxz)"),
          (b"(\xb5/\xfd", "zstd-compressed: decompress it first (unzstd)"),
          (b"\xff\xfe", "UTF-16 text: convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"),
          (b"\xfe\xff", "UTF-16 text: convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"))
# C0 control characters that text does not hold: all but tab, newline, vertical
# tab, form feed, carriage return and escape (Note [Binary data read as text]).
_CONTROL = np.zeros(256, dtype=bool)
_CONTROL[[c for c in range(32) if c not in (9, 10, 11, 12, 13, 27)]] = True


def check_text(path) -> None:
    """Raises a DataError when a file given as text starts with binary data
    (Note [Binary data read as text]).

    Args:
        path: the text file.
    """
    with open(path, "rb") as f:
        head = f.read(TEXT_SNIFF_BYTES)
    data = np.frombuffer(head, dtype=np.uint8)
    controls = _CONTROL[data]
    count = int(controls.sum())
    if not count or (0 not in head and (count * 100 <= len(head) or count < 8)):
        return
    what = next((w for magic, w in _MAGIC if head.startswith(magic)), None)
    if what is None:
        what = ("binary data, not text: token ids go in a *.bin (with --data-dtype), a "
                "document in a text or JSONL file")
    first = int(np.argmax(controls))
    raise DataError(f"{path}: {what} (byte {first} is 0x{head[first]:02x}; {count:,} of the first "
                    f"{len(head):,} bytes are control characters, which text does not hold)")


def _text_files(root: Path) -> list[Path]:
    files, others = [], []
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).parts
        if not f.is_file() or any(part.startswith(".") for part in rel):
            continue
        (files if f.suffix.lower() in TEXT_SUFFIXES else others).append(f)
    if not files:
        seen = (f"it holds {len(others)} other files, e.g. "
                f"{', '.join(str(o.relative_to(root)) for o in others[:3])}" if others
                else "it holds no files")
        raise DataError(f"--data {root}: a folder with no text files ({', '.join(TEXT_SUFFIXES)}); "
                        f"{seen}; tip: rename text files to .txt, or give one file")
    return files


def _cut(buf: bytes) -> int:
    """Where to end a piece of `buf`, which has no newline: after its last space,
    else before its last UTF-8 character (which may continue in the next read)."""
    space = buf.rfind(b" ") + 1
    if space:
        return space
    cut = len(buf) - 1
    while cut > 0 and buf[cut] & 0xC0 == 0x80:  # a continuation byte: inside a character
        cut -= 1
    return cut or len(buf)


def _text_pieces(path: Path) -> Iterator[tuple[bytes, int]]:
    """(piece, line of its start) of a text file, at most PIECE_BYTES each."""
    line, carry = 1, b""
    with open(path, "rb") as f:
        while True:
            data = f.read(PIECE_BYTES - len(carry))
            buf = carry + data
            if not data:
                if buf:
                    yield buf, line
                return
            cut = buf.rfind(b"\n") + 1
            if cut == 0:
                if len(buf) < PIECE_BYTES:
                    carry = buf
                    continue
                cut = _cut(buf)
            piece, carry = buf[:cut], buf[cut:]
            yield piece, line
            line += piece.count(b"\n")


def _jsonl_texts(path: Path, field: str) -> Iterator[tuple[str, int]]:
    """(text, line number) of each record of a JSONL file."""
    tip = f'each line must be a JSON object with a "{field}" string'
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise DataError(f"{path} line {number}: not JSON ({e}); {tip}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path} line {number}: a JSON {type(record).__name__}, not an "
                                f"object; {tip}")
            if field not in record:
                keys = ", ".join(map(repr, list(record)[:6])) or "none"
                raise DataError(f'{path} line {number}: no "{field}" field (keys: {keys}); {tip}')
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f'{path} line {number}: "{field}" is a {type(text).__name__}, '
                                f'not a string; {tip}')
            yield text, number


def _documents(path: Path, kind: str, field: str):
    """(piece, file, line, starts_a_document) of every document of a text source."""
    if kind == "jsonl":
        for text, number in _jsonl_texts(path, field):
            if text:
                yield text, path, number, True
        return
    for f in (_text_files(path) if kind == "folder" else [path]):
        check_text(f)
        first = True
        for piece, line in _text_pieces(f):
            yield piece, f, line, first
            first = False


def _decode(piece, file: Path, line: int) -> str:
    if isinstance(piece, str):
        return piece
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + piece[:e.start].count(b"\n")
        raise DataError(f"{file} line {at}: not UTF-8 (byte 0x{piece[e.start]:02x}); a Hugging Face "
                        f"tokenizer needs UTF-8 text; tip: convert the file (iconv -t UTF-8), or "
                        f"train byte-level (no --tokenizer)") from None


def _cache_key(path: Path, kind: str, files: list[Path], tokenizer, field: str) -> str:
    desc = {"version": _CACHE_VERSION, "kind": kind, "field": field,
            "tokenizer": tokenizer.fingerprint,
            "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


class _CacheWriter:
    """A token cache being written: the ids go to a temporary file, which commit()
    renames to `out` and then describes (Note [Token sources]); discard() removes
    what is left of a build that did not commit. Every write error (a full disk,
    a read-only --cache-dir) is a DataError that names the cache file, the bytes
    written and wanted, and --cache-dir.

    Args:
        cache_dir: the cache folder (made if missing).
        out: the cache file.
        source: the text source, for messages.
        text_bytes: the source's size, for the estimate of the cache's.
    """

    def __init__(self, cache_dir: Path, out: Path, source: Path, text_bytes: int):
        self.cache_dir, self.out, self.source, self.text_bytes = cache_dir, out, source, text_bytes
        self.tmp = cache_dir / f".{out.stem}.{os.getpid()}.tmp"
        self.written = 0   # bytes of ids in the temporary file
        self.read = 0      # bytes of text they were encoded from
        self.file = None
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(self.tmp, "wb", buffering=0)  # (whole batches: no buffer to lose)
        except OSError as e:
            raise self._error(e, 0) from None

    def _error(self, e: OSError, wanted: int) -> DataError:
        what = (f"{e.strerror or e} (errno {e.errno})" if e.errno is not None else str(e))
        if self.read:
            need = -(-self.text_bytes * (self.written + wanted) // self.read)  # (rounded up)
            size = (f"with {self.written:,} bytes written and {wanted:,} more to write; the whole "
                    f"cache takes about {need:,} bytes")
        else:
            size = "before writing anything"
        removed = "the partial cache was removed and " if self.file is not None else ""
        return DataError(f"--cache-dir {self.cache_dir}: cannot write the token cache of "
                         f"{self.source} to {self.out}: {what}, {size}; free space there, or give "
                         f"--cache-dir DIR (or TIDAL_DATA_CACHE) on a disk with room; {removed}"
                         f"{self.source} is untouched")

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view.nbytes:
                n = self.file.write(view)
                self.written += n
                view = view[n:]
        except OSError as e:
            raise self._error(e, view.nbytes) from None

    def commit(self, description: dict, desc: Path) -> None:
        """Flushes the ids to disk, renames them into place and writes `desc` last."""
        desc_tmp = self.cache_dir / f".{desc.name}.{os.getpid()}.tmp"
        try:
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.out)
            desc_tmp.write_text(json.dumps(description))
            os.replace(desc_tmp, desc)
        except OSError as e:
            desc_tmp.unlink(missing_ok=True)
            self.out.unlink(missing_ok=True)  # never reused without its description
            raise self._error(e, 0) from None

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


def tokenize_to_cache(path, tokenizer, cache_dir=None, field: str = "text",
                      log: Callable[[str], None] | None = None) -> TokenSource:
    """Encodes a text file, folder or JSONL file into a cached token file, piece by piece,
    and memory-maps it (Note [Token sources]); a cache that exists is reused.

    Args:
        path: the text source.
        tokenizer: a tidal.data.tokenizer tokenizer.
        cache_dir: where caches live (default: default_cache_dir()).
        field: the JSONL field that holds the text.
        log: called with a line when a cache is built.
    """
    p = _exists(path)
    kind = data_kind(p)
    if kind == "tokens":
        raise DataError(f"--data {path}: a token file, not text")
    files = _text_files(p) if kind == "folder" else [p]
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dtype = np.dtype(dtype_for_vocab(tokenizer.vocab_size))
    stem = f"{p.name}-{_cache_key(p, kind, files, tokenizer, field)}.{dtype.name}"
    out, desc = cache_dir / f"{stem}.bin", cache_dir / f"{stem}.json"
    if desc.is_file() and out.is_file():
        n = json.loads(desc.read_text())["tokens"]
        if out.stat().st_size == n * dtype.itemsize:
            tokens = np.memmap(out, dtype=dtype, mode="r")
            return TokenSource(tokens, f"{p} ({n:,} tokens, cached in {out})",
                               tokenizer.vocab_size, p, out)
    if tokenizer.eos_id is not None:
        sep = np.array([tokenizer.eos_id], dtype=dtype)
    else:
        sep = np.asarray(bytearray(tokenizer.encode_batch(["\n\n"])[0])
                         if isinstance(tokenizer, ByteTokenizer)
                         else tokenizer.encode_batch(["\n\n"])[0], dtype=dtype)
    text_bytes = sum(f.stat().st_size for f in files)
    writer = _CacheWriter(cache_dir, out, p, text_bytes)
    count = documents = 0
    try:
        batch: list = []
        size = 0

        def flush():
            nonlocal count, documents
            ids = tokenizer.encode_batch([piece for piece, _ in batch])
            parts = []
            for (_, starts), piece_ids in zip(batch, ids):
                if starts:
                    if documents:
                        parts.append(sep.tobytes())
                        count += sep.size
                    documents += 1
                arr = (np.frombuffer(piece_ids, dtype=np.uint8).astype(dtype, copy=False)
                       if isinstance(piece_ids, (bytes, bytearray))
                       else np.asarray(piece_ids, dtype=dtype))
                parts.append(arr.tobytes())
                count += arr.size
            batch.clear()
            writer.write(b"".join(parts))

        for piece, file, line, starts in _documents(p, kind, field):
            writer.read += len(piece)
            if tokenizer.wants_text:
                piece = _decode(piece, file, line)
            batch.append((piece, starts))
            size += len(piece)
            if len(batch) >= _ENCODE_BATCH or size >= PIECE_BYTES:
                flush()
                size = 0
        if batch:
            flush()
        if count == 0:
            what = {"jsonl": "no JSON lines with text", "folder": f"only empty text files ({len(files)})",
                    "text": "no text"}[kind]
            raise DataError(f"--data {path}: {what}; nothing to train on")
        writer.commit({"tokens": count, "dtype": dtype.name, "source": str(p.resolve()),
                       "documents": documents, "tokenizer": tokenizer.name}, desc)
    finally:
        writer.discard()
    if log is not None:
        log(f"tokenized {p} ({documents:,} documents, {count:,} tokens, {tokenizer.name}) into {out}")
    tokens = np.memmap(out, dtype=dtype, mode="r")
    return TokenSource(tokens, f"{p} ({count:,} tokens, cached in {out})", tokenizer.vocab_size, p, out)


def open_source(path, tokenizer, *, dtype=None, vocab: int | None = None,
                vocab_name: str = "the model's", cache_dir=None, field: str = "text",
                log: Callable[[str], None] | None = None) -> TokenSource:
    """The token source of `--data PATH` (Note [Token sources]).

    Args:
        path: a text file, a folder of text files, a JSONL file or a *.bin of ids.
        tokenizer: the tokenizer of text (tidal.data.tokenizer.load_tokenizer).
        dtype: a *.bin's dtype ("uint16"/"uint32"), None to infer it.
        vocab: the vocabulary ids must be below (checked for a *.bin); the
            tokenizer's is used when it is byte-level's or smaller.
        vocab_name: whose vocabulary `vocab` is, for messages.
        cache_dir: where text is tokenized to (default_cache_dir()).
        field: the JSONL text field.
        log: progress lines (a cache being built).
    """
    try:
        return _open_source(path, tokenizer, dtype, vocab, vocab_name, cache_dir, field, log)
    except OSError as e:  # reading the corpus (the cache's writes are DataErrors already)
        raise DataError(f"--data {path}: cannot read {e.filename or path}: "
                        f"{e.strerror or e}") from None


def _open_source(path, tokenizer, dtype, vocab, vocab_name, cache_dir, field, log) -> TokenSource:
    p = _exists(path)
    kind = data_kind(p)
    if kind == "tokens":
        limit, name = vocab, vocab_name
        if not isinstance(tokenizer, ByteTokenizer) and (limit is None or tokenizer.vocab_size < limit):
            limit, name = tokenizer.vocab_size, f"the tokenizer's, {tokenizer.name}"
        source = open_token_file(p, dtype, limit, name)
        if not isinstance(tokenizer, ByteTokenizer):
            source.vocab_size = tokenizer.vocab_size
        return source
    if dtype is not None:
        raise DataError(f"--data-dtype {dtype} applies to a *.bin of token ids; --data {path} is "
                        f"{'a folder' if kind == 'folder' else 'JSONL' if kind == 'jsonl' else 'text'}")
    if kind == "text" and isinstance(tokenizer, ByteTokenizer):
        check_text(p)
        tokens = np.memmap(p, dtype=np.uint8, mode="r")   # the bytes are the ids
        return TokenSource(tokens, f"{p} ({tokens.size:,} bytes, byte-level)", 256, p)
    return tokenize_to_cache(p, tokenizer, cache_dir, field, log)
