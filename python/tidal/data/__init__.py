"""Training data for tidal-train and scripts/finetune_hf.py.

A user's corpus (`--data PATH`: a text file, a folder of text files, JSONL
with a "text" field, or a *.bin of token ids) is read as memory-mapped ids
(tidal.data.sources, Note [Token sources]), encoded byte-level or by a local
Hugging Face tokenizer (tidal.data.tokenizer), and cut into resumable batches
with a held-out split (tidal.data.windows, Note [Resumable batches]); the
scripts' arguments, validation and checkpoints are in tidal.data.options.

Two built-in sources need no download:

- ``text``: byte-level tokens (vocabulary 256) of a corpus made at run time
  from the docstrings of Python's own standard library (about 0.6 MB of
  English prose, read from the running interpreter: nothing is bundled or
  fetched, so the text is that of whichever Python runs it). The loss falls
  fast from ln 256 = 5.55 as a model learns byte statistics and words.
- ``synthetic``: a fixed random bigram table whose successors follow a Zipf
  law over the vocabulary: each token has two possible successors, so the
  loss can fall from ln(vocab) towards ln 2, and the skewed marginal makes the
  first drop quick.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from typing import Iterator

import numpy as np
import torch

from .sources import TokenSource, open_source
from .tokenizer import ByteTokenizer, DataError, HFTokenizer, load_tokenizer
from .windows import SyntheticBatches, TokenWindows

__all__ = ["DATA_KINDS", "TEXT_VOCAB", "batches", "synthetic_batches", "text_batches",
           "text_corpus", "DataError", "ByteTokenizer", "HFTokenizer", "load_tokenizer",
           "TokenSource", "open_source", "TokenWindows", "SyntheticBatches"]

DATA_KINDS = ("text", "synthetic")
TEXT_VOCAB = 256

# Standard-library modules whose docstrings make the corpus: imported for
# their documentation only, none has side effects on import.
_MODULES = (
    "abc", "argparse", "array", "ast", "base64", "bisect", "calendar", "cmath", "codecs",
    "collections", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fnmatch", "fractions", "functools", "getopt", "gettext",
    "glob", "graphlib", "gzip", "hashlib", "heapq", "html", "inspect", "io", "itertools",
    "json", "locale", "logging", "math", "numbers", "operator", "os", "pathlib", "pickle",
    "pprint", "queue", "random", "re", "sched", "secrets", "selectors", "shlex", "shutil",
    "statistics", "string", "struct", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "typing", "unicodedata", "unittest", "urllib.parse", "uuid",
    "weakref", "zipfile",
)


@functools.lru_cache(maxsize=1)
def text_corpus() -> bytes:
    """The corpus: module, class, function and method docstrings of the modules above, UTF-8."""
    with warnings.catch_warnings():
        # Reading the docstrings of typing.io / typing.re warns that those are
        # deprecated: a note for their users, not for a reader of their text.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _build_corpus()


def _build_corpus() -> bytes:
    parts: list[str] = []
    seen: set[str] = set()

    def add(obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and doc not in seen:
            seen.add(doc)
            parts.append(doc)

    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without one of them (e.g. no _hashlib)
            continue
        add(module)
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(value) or inspect.isfunction(value):
                add(value)
            if inspect.isclass(value):
                for member_name, member in sorted(vars(value).items()):
                    if not member_name.startswith("_") and callable(member):
                        add(member)
    return "\n\n".join(parts).encode("utf-8")


def text_batches(batch: int, seq: int, device, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random windows of the corpus as byte tokens: (input, target shifted by one), int64.

    The whole corpus, no held-out split (TokenWindows with eval_fraction 0).

    Args:
        batch: sequences per batch.
        seq: tokens per sequence.
        device: where the batches are put.
        seed: the sampling seed.
    """
    data = np.frombuffer(text_corpus(), dtype=np.uint8)
    return TokenWindows(data, seq, batch, device, seed=seed, eval_fraction=0.0,
                        name="the text corpus")


def synthetic_batches(vocab: int, seq: int, batch: int, device, seed: int = 0,
                      branching: int = 2) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences from a fixed random bigram table with Zipf-distributed successors.

    Args:
        vocab: token ids are in [0, vocab).
        seq, batch, device, seed: as text_batches.
        branching: successors per token (the loss floor is ln(branching)).
    """
    return SyntheticBatches(vocab, seq, batch, device, seed=seed, branching=branching)


def batches(kind: str, vocab: int, seq: int, batch: int, device, seed: int = 0):
    """The batch iterator of `kind` ("text" or "synthetic") for a model with `vocab` tokens."""
    if kind == "text":
        if vocab < TEXT_VOCAB:
            raise ValueError(f"--data text needs a vocabulary of at least {TEXT_VOCAB} "
                             f"(byte tokens), the model has {vocab}; use --data synthetic")
        return text_batches(batch, seq, device, seed)
    if kind == "synthetic":
        return synthetic_batches(vocab, seq, batch, device, seed)
    raise ValueError(f"unknown data kind {kind!r}; expected one of {', '.join(DATA_KINDS)}")
