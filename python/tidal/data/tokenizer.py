"""Tokenizers for the training scripts: byte-level, or a local Hugging Face one.

A tokenizer here is what the data pipeline needs and nothing more: its
vocabulary size (the model's embedding must have at least that many rows),
its end-of-text id (the separator between documents), a batch encoder, and a
fingerprint that changes when its files change (the key of the token cache,
tidal.data.sources).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

__all__ = ["ByteTokenizer", "HFTokenizer", "DataError", "load_tokenizer"]


class DataError(ValueError):
    """Training data that cannot be used; the message names the file (and line or
    offset) and what was expected."""


class ByteTokenizer:
    """Byte-level tokens: each byte of the UTF-8 text is one id in [0, 256).

    No end-of-text id: documents are joined with a blank line (b"\\n\\n").
    """

    vocab_size = 256
    eos_id = None
    wants_text = False  # encodes raw bytes: any file is valid input
    name = "byte-level (256 ids)"
    fingerprint = "bytes-v1"

    def encode_batch(self, pieces: Sequence[bytes | str]) -> list[bytes]:
        """The ids of each piece: its UTF-8 bytes (bytes pass through unchanged).

        Args:
            pieces: texts, as str or already-encoded bytes.
        """
        return [p if isinstance(p, (bytes, bytearray)) else p.encode("utf-8") for p in pieces]


class HFTokenizer:
    """A Hugging Face tokenizer read from a local directory (nothing downloaded).

    The vocabulary size is len(tokenizer): the base vocabulary plus added
    tokens, which is the number of ids encode can return.

    Args:
        directory: what `tokenizer.save_pretrained(directory)` wrote
            (tokenizer.json, or vocab/merges files, or a sentencepiece model).
    """

    # Files that define what a tokenizer encodes to; their bytes make the fingerprint.
    _DEFINING = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                 "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")

    def __init__(self, directory):
        path = Path(directory)
        if not path.is_dir():
            raise DataError(f"--tokenizer {directory}: no such directory; expected a local Hugging "
                            f"Face tokenizer directory (what tokenizer.save_pretrained(DIR) writes)")
        try:
            import transformers
        except ImportError:
            raise DataError("--tokenizer needs transformers: pip install transformers") from None
        found = sorted(p.name for p in path.iterdir())
        tip = ("expected tokenizer.json (or vocab.json + merges.txt, or a sentencepiece model) as "
               "tokenizer.save_pretrained(DIR) writes")
        if not any(name in found for name in self._DEFINING):
            raise DataError(f"--tokenizer {directory}: not a Hugging Face tokenizer directory (it "
                            f"holds {', '.join(found[:8]) or 'nothing'}); {tip}")
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # noqa: BLE001 -- transformers raises many kinds here
            raise DataError(f"--tokenizer {directory}: transformers cannot load it "
                            f"({type(e).__name__}: {str(e).strip()[:300]}); {tip}") from None
        # The corpus is encoded in pieces of about a MiB: longer than any model's
        # context, which is no reason to warn.
        tok.model_max_length = 1 << 62
        self._tok = tok
        self.wants_text = True  # pieces must decode as UTF-8
        self.directory = path
        self.vocab_size = len(tok)
        self.eos_id = tok.eos_token_id
        self.name = f"{type(tok).__name__} from {path} ({self.vocab_size} ids)"
        digest = hashlib.sha256()
        for name in self._DEFINING:
            f = path / name
            if f.is_file():
                digest.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
        self.fingerprint = f"hf-{digest.hexdigest()[:24]}"

    def encode_batch(self, pieces: Sequence[bytes | str]) -> list[list[int]]:
        """The ids of each piece, without special tokens.

        Args:
            pieces: texts; bytes must be UTF-8 (the caller names the file and
                line of a UnicodeDecodeError).
        """
        texts = [p.decode("utf-8") if isinstance(p, (bytes, bytearray)) else p for p in pieces]
        return self._tok(texts, add_special_tokens=False)["input_ids"]


def load_tokenizer(directory=None):
    """The tokenizer of `--tokenizer DIR`; byte-level when `directory` is None.

    Args:
        directory: a local Hugging Face tokenizer directory, or None.
    """
    return ByteTokenizer() if directory is None else HFTokenizer(directory)
