"""Resumable batches: (input, target) windows of a token array, and the synthetic table.

Note [Resumable batches]
~~~~~~~~~~~~~~~~~~~~~~~~
Batch i is a function of (seed, rank, i) alone: its window starts are drawn
by numpy.random.default_rng([seed, 0, rank, i]), uniformly over the training
part of the corpus (nanoGPT's sampling). Nothing else carries from one batch
to the next, so where a run stands is one integer, the index of the next
batch (`state_dict()`), and a resumed run that sets it (`load_state_dict`)
draws exactly the batches the uninterrupted run would have. The state also
records what the batches depend on (corpus size, split, seq, batch, seed);
resuming with any of them changed is an error that says which.

The held-out split: the last ceil(eval_fraction x tokens) tokens of the
corpus (0.05 by default) are never in a training window (a training window
ends before them). Validation reads the same windows every time: `eval_batches`
x `batch` windows with starts evenly spaced through the held-out tail
(numpy.linspace, rounded down), so losses at different steps compare.
The split is the same whether or not a run evaluates, so --eval-every does not
change the training batches. A separate held-out corpus (--eval-data) is used
whole instead, and the training corpus is then not split.
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

from .tokenizer import DataError

__all__ = ["TokenWindows", "SyntheticBatches"]

_TRAIN, _EVAL = 0, 1   # stream tags in the seed sequence: train and held-out draws never share one


def _seed(seed: int) -> int:
    return int(seed) % (1 << 64)   # SeedSequence takes non-negative integers


class _Resumable:
    """next(), state_dict() and load_state_dict() over a batch(i) function."""

    next_index = 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.next_index)
        self.next_index += 1
        return out

    def fingerprint(self) -> dict:  # pragma: no cover - each subclass has one
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The next batch's index and what the batches depend on (Note [Resumable batches])."""
        return {"next_batch": self.next_index, **self.fingerprint()}

    def load_state_dict(self, state: dict, origin: str = "the checkpoint") -> None:
        """Continues at the saved position; a changed corpus, split or shape is an error.

        Args:
            state: what state_dict() returned.
            origin: how the message names where `state` came from.
        """
        mine = self.fingerprint()
        theirs = {k: v for k, v in state.items() if k != "next_batch"}
        diff = [f"{k} {theirs.get(k)!r} there, {mine.get(k)!r} now"
                for k in sorted(set(mine) | set(theirs)) if theirs.get(k) != mine.get(k)]
        if diff:
            raise DataError(f"{origin} was trained on other batches: {'; '.join(diff)}; resume with "
                            f"the same --data, --seq, --batch, --seed and --eval-fraction (or start "
                            f"a new run)")
        index = state.get("next_batch")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise DataError(f"{origin}: expected a batch index >= 0, got {index!r}")
        self.next_index = index


class TokenWindows(_Resumable):
    """Random windows of a token array for training, fixed ones of its held-out tail for
    validation (Note [Resumable batches]).

    Args:
        tokens: the ids, 1-D (a numpy.memmap is read only where windows fall).
        seq: tokens per input sequence (a window is seq + 1 tokens).
        batch: windows per batch.
        device: where batches are put.
        seed: the sampling seed.
        rank: the data-parallel rank (each draws its own windows).
        eval_fraction: the held-out share of the tokens, in [0, 1).
        eval_tokens: a separate held-out corpus; then `tokens` is not split.
        eval_batches: batches of held-out windows per validation.
        name: how messages name the corpus.
    """

    def __init__(self, tokens, seq: int, batch: int, device="cpu", *, seed: int = 0, rank: int = 0,
                 eval_fraction: float = 0.05, eval_tokens=None, eval_batches: int = 8,
                 name: str = "the corpus"):
        if not 0 <= eval_fraction < 1:
            raise DataError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
        if eval_batches < 1:
            raise DataError(f"--eval-batches must be at least 1, got {eval_batches}")
        self.tokens, self.seq, self.batch_size, self.device = tokens, seq, batch, device
        self.seed, self.rank, self.eval_batches, self.name = _seed(seed), rank, eval_batches, name
        n = int(tokens.shape[0])
        self.eval_fraction = 0.0 if eval_tokens is not None else float(eval_fraction)
        held = math.ceil(n * self.eval_fraction)
        self.train_tokens = n - held
        if self.train_tokens < seq + 1:
            split = f" after holding out the last {held:,} ({eval_fraction:g})" if held else ""
            raise DataError(f"{name}: {self.train_tokens:,} training tokens{split}, fewer than one "
                            f"window of seq + 1 = {seq + 1}; use a shorter --seq, a smaller "
                            f"--eval-fraction or more data")
        if eval_tokens is not None:
            self.eval_source, self.eval_start = eval_tokens, 0
            self.eval_end = int(eval_tokens.shape[0])
            where = "the held-out corpus"
        else:
            self.eval_source, self.eval_start, self.eval_end = tokens, self.train_tokens, n
            where = f"the held-out tail ({held:,} tokens, --eval-fraction {eval_fraction:g})"
        self._eval_where = where
        if 0 < self.eval_end - self.eval_start < seq + 1:
            raise DataError(f"{name}: {where} is shorter than one window of seq + 1 = {seq + 1} "
                            f"tokens; raise --eval-fraction or use a shorter --seq")
        self.total_tokens = n

    @property
    def has_eval(self) -> bool:
        """Whether there is a held-out split to validate on."""
        return self.eval_end > self.eval_start

    def fingerprint(self) -> dict:
        return {"kind": "windows", "tokens": self.total_tokens, "train_tokens": self.train_tokens,
                "eval_tokens": self.eval_end - self.eval_start, "seq": self.seq, "batch": self.batch_size,
                "seed": self.seed}

    def _windows(self, source, starts) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([np.asarray(source[s:s + self.seq + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        return t[:, :-1].to(self.device), t[:, 1:].to(self.device)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training batch `index`: (input, target shifted by one), int64 [batch, seq].

        Args:
            index: the batch's position in the run (0 first).
        """
        rng = np.random.default_rng([self.seed, _TRAIN, self.rank, int(index)])
        starts = rng.integers(0, self.train_tokens - self.seq, size=self.batch_size)
        return self._windows(self.tokens, starts)

    def eval_set(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out batches, the same every call (Note [Resumable batches])."""
        if not self.has_eval:
            raise DataError(f"{self.name}: no held-out split to validate on (--eval-fraction 0); "
                            f"give --eval-fraction > 0 or --eval-data")
        last = self.eval_end - self.seq - 1
        starts = np.linspace(self.eval_start, last, self.eval_batches * self.batch_size).astype(np.int64)
        for b in range(self.eval_batches):
            yield self._windows(self.eval_source, starts[b * self.batch_size:(b + 1) * self.batch_size])

    def describe_eval(self) -> str:
        """Where the validation windows come from, for a log line."""
        return f"{self.eval_batches * self.batch_size} windows of {self._eval_where}"


class SyntheticBatches(_Resumable):
    """Sequences from a fixed random bigram table with Zipf-distributed successors.

    The table depends on `seed` only; batch i's draws on (seed, rank, i), and the
    held-out batches come from a stream of their own.

    Args:
        vocab: token ids are in [0, vocab).
        seq, batch, device, seed, rank: as TokenWindows.
        branching: successors per token (the loss floor is ln(branching)).
        eval_batches: batches per validation.
    """

    has_eval = True
    name = "the synthetic bigram table"

    def __init__(self, vocab: int, seq: int, batch: int, device="cpu", *, seed: int = 0,
                 rank: int = 0, branching: int = 2, eval_batches: int = 8):
        self.vocab, self.seq, self.batch_size, self.device = vocab, seq, batch, device
        self.seed, self.rank, self.branching, self.eval_batches = _seed(seed), rank, branching, eval_batches
        zipf = 1.0 / np.arange(1, vocab + 1, dtype=np.float64)
        self.p = zipf / zipf.sum()
        table = np.random.default_rng([self.seed])
        self.successors = table.choice(vocab, size=(vocab, branching), p=self.p)

    def fingerprint(self) -> dict:
        return {"kind": "synthetic", "vocab": self.vocab, "seq": self.seq, "batch": self.batch_size,
                "seed": self.seed, "branching": self.branching}

    def _draw(self, rng) -> tuple[torch.Tensor, torch.Tensor]:
        t = np.empty((self.batch_size, self.seq + 1), dtype=np.int64)
        t[:, 0] = rng.choice(self.vocab, size=self.batch_size, p=self.p)
        picks = rng.integers(0, self.branching, size=(self.batch_size, self.seq))
        for j in range(self.seq):
            t[:, j + 1] = self.successors[t[:, j], picks[:, j]]
        w = torch.from_numpy(t)
        return w[:, :-1].to(self.device), w[:, 1:].to(self.device)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training batch `index` (see TokenWindows.batch)."""
        return self._draw(np.random.default_rng([self.seed, _TRAIN, self.rank, int(index)]))

    def eval_set(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`eval_batches` held-out batches, the same every call."""
        for b in range(self.eval_batches):
            yield self._draw(np.random.default_rng([self.seed, _EVAL, b]))

    def describe_eval(self) -> str:
        """Where the validation batches come from, for a log line."""
        return f"{self.eval_batches} batches of a held-out stream of the table"
