"""What tidal-train and scripts/finetune_hf.py share about data: the arguments
(--data, --tokenizer, --eval-every, --save-every, --resume, ...), the batches
they make, validation, and checkpoints that resume bit for bit.

Note [Resuming a training script]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`save()` calls engine.save_checkpoint(dir, tag="step<N>") with a client_state
{"tidal_train": {...}} holding the steps done, the batches' state (the index
of the next batch and what the batches depend on: Note [Resumable batches] in
tidal/data/windows.py) and torch's RNG state (CPU, and CUDA when present),
taken between two steps. `resume()` loads the checkpoint into an engine built
as the saved one was (weights, Adam, scaler, scheduler: the engine's part),
puts the batches at the saved index and sets the RNG state, so the next step
draws the batch, and the dropout masks, that the uninterrupted run drew at
that step; --steps counts from the start of the first run. Validation reads
fixed held-out windows in eval mode under torch.no_grad(): it draws no random
numbers and leaves the batch index alone, so evaluating (or not) changes no
training loss. CPU kernels split their sums by thread, so a bit-exact resume
needs the saved run's thread count (torch.get_num_threads(), saved too; a
different one is a warning naming OMP_NUM_THREADS). What the step itself
depends on is the engine's to keep: on
the host and on the simulated device every chunk's Adam is the same SIMD
kernel, so resumed losses equal the uninterrupted ones bit for bit in fp32,
hybrid Adam or not (tested, the resumed run in another process); on a GPU a
chunk updated on the device goes through torch's fused Adam, and a fresh
engine starts with no chunk there, so its first steps may round differently.

Note [Hyperparameters on resume]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
load_checkpoint restores the parameter groups' lr, weight decay, betas and eps
as they were saved (DeepSpeed restores its optimizer's param_groups alike),
so a resumed run continues at the checkpoint's rate whatever its config says.
A rate given on the command line (`resume(lr=...)`, the scripts' --lr) is a
request to change it, and it applies, exactly: every group takes the initial
lr the fresh engine built from this command line has (the config with --lr
written in), and the lr of the next step is that, or with a scheduler in the
config the scheduler's value at the loaded position scaled by it (Note
[Parameter groups] in tidal/engine/param_groups.py): what a run started with
that --lr would use at that step. Adam's moments and step counts stay the
checkpoint's. Either way one line says what differs: the rate that now
applies and the one the checkpoint trained at, or, without --lr, each value
of the config that the checkpoint's overrides. The config's values a
checkpoint does not restore and a step depends on (gradient_clipping,
gradient_accumulation_steps) are this run's; where they differ from the ones
the checkpoint trained with (kept in its client state), the same line says
that they apply from the next step.
"""
from __future__ import annotations

import argparse
import errno
import math
import shutil
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .sources import TOKEN_DTYPES, data_kind, open_source, read_nanogpt_meta
from .tokenizer import ByteTokenizer, DataError
from .windows import SyntheticBatches, TokenWindows

__all__ = ["BUILTIN", "SaveError", "add_arguments", "check_arguments", "data_vocab",
           "open_batches", "evaluate", "save_dir_of", "save", "resume", "resume_from_args"]

BUILTIN = ("text", "synthetic")   # --data keywords: the built-in corpora (tidal.data)
_STATE_KEY, _STATE_FORMAT = "tidal_train", 1
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class SaveError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a folder that is not
    writable); the message names the checkpoint, the bytes it needed and what to
    do. The engine's save is atomic (Note [Checkpoint format]), so the previous
    checkpoint is intact."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Adds the data, validation and checkpoint arguments to a script's parser.

    Args:
        ap: the script's parser.
    """
    g = ap.add_argument_group("data, validation and checkpoints")
    g.add_argument("--data", default="text", metavar="PATH",
                   help="what to train on: a text file, a folder of text files (.txt, .text, .md, "
                        ".rst), a JSONL file with a 'text' field, or a *.bin of token ids (nanoGPT's "
                        "train.bin); or a built-in corpus: 'text' (byte tokens of Python's "
                        "docstrings, the default) or 'synthetic' (a random bigram table)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local Hugging Face tokenizer directory (default: byte-level, 256 ids)")
    g.add_argument("--data-dtype", choices=tuple(TOKEN_DTYPES), default=None,
                   help="the ids' dtype in a *.bin (default: from a meta.pkl beside it, else "
                        "uint16 when the vocabulary is at most 65536, uint32 above)")
    g.add_argument("--eval-data", default=None, metavar="PATH",
                   help="a held-out corpus (any --data form, e.g. nanoGPT's val.bin); without "
                        "it the last --eval-fraction of --data is held out")
    g.add_argument("--eval-fraction", type=float, default=0.05,
                   help="share of --data held out for validation: its last tokens (default 0.05; "
                        "0 trains on everything)")
    g.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="print the validation loss every N steps and after the last (0: never)")
    g.add_argument("--eval-batches", type=int, default=8, metavar="N",
                   help="held-out batches per validation (default 8)")
    g.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps and after the last (needs --save-dir "
                        "or --resume)")
    g.add_argument("--save-dir", default=None, metavar="DIR",
                   help="where checkpoints go (DIR/step<N>/, DIR/latest); default: --resume's DIR")
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="continue a run from DIR's latest checkpoint (or DIR/step<N>); --steps "
                        "counts from the start of the first run")
    g.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where text is tokenized to (default: $TIDAL_DATA_CACHE or "
                        "~/.cache/tidal/tokens)")


def check_arguments(ap: argparse.ArgumentParser, args) -> None:
    """Exits through ap.error() on values the data arguments cannot take.

    Args:
        ap: the parser (its error() prints the usage and exits with status 2).
        args: the parsed arguments.
    """
    for name in ("eval_every", "save_every"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be 0 (never) or a number of steps, got "
                     f"{getattr(args, name)}")
    if args.eval_batches < 1:
        ap.error(f"--eval-batches must be at least 1, got {args.eval_batches}")
    if not (math.isfinite(args.eval_fraction) and 0 <= args.eval_fraction < 1):
        ap.error(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.save_every and args.save_dir is None and args.resume is None:
        ap.error("--save-every needs --save-dir DIR (or --resume DIR, whose DIR it then saves to)")
    if args.data in BUILTIN:
        for flag in ("tokenizer", "data_dtype", "eval_data"):
            if getattr(args, flag) is not None:
                ap.error(f"--{flag.replace('_', '-')} applies to --data PATH, not to the built-in "
                         f"corpus '{args.data}'")


def data_vocab(args, tokenizer) -> tuple[int | None, str]:
    """The vocabulary the data implies, and whose it is: a --tokenizer's, else a
    nanoGPT meta.pkl's beside a *.bin; (None, "") when the data leaves it open.

    Args:
        args: the parsed arguments.
        tokenizer: the loaded tokenizer.
    """
    if not isinstance(tokenizer, ByteTokenizer):
        return tokenizer.vocab_size, f"the tokenizer's ({tokenizer.name})"
    if args.data not in BUILTIN and Path(args.data).is_file() and data_kind(args.data) == "tokens":
        meta = read_nanogpt_meta(args.data)
        if meta is not None:
            return meta["vocab_size"], f"vocab_size of {Path(args.data).parent / 'meta.pkl'}"
    return None, ""


def _tokens(path, args, tokenizer, vocab, vocab_name, log):
    return open_source(path, tokenizer, dtype=args.data_dtype, vocab=vocab, vocab_name=vocab_name,
                       cache_dir=args.cache_dir, log=log)


def open_batches(args, tokenizer, vocab: int, vocab_name: str, seq: int, batch: int, device,
                 rank: int = 0, log: Callable[[str], None] | None = None):
    """The resumable batches of --data (TokenWindows or SyntheticBatches).

    Args:
        args: the parsed arguments (add_arguments).
        tokenizer: the tokenizer of text (load_tokenizer(args.tokenizer)).
        vocab: the model's vocabulary size; ids must be below it.
        vocab_name: whose vocabulary that is, for messages.
        seq, batch: the shape of a batch.
        device: where batches are put.
        rank: the data-parallel rank (its own windows).
        log: progress lines (a token cache being built).
    """
    from . import TEXT_VOCAB, text_corpus
    if args.data == "synthetic":
        return SyntheticBatches(vocab, seq, batch, device, seed=args.seed, rank=rank,
                                eval_batches=args.eval_batches)
    byte_level = isinstance(tokenizer, ByteTokenizer)
    # Text the tokenizer will encode (a *.bin's ids are checked one by one instead).
    text = [p for p in (args.data, args.eval_data) if p is not None and p not in BUILTIN
            and Path(p).exists() and data_kind(p) != "tokens"]
    if vocab < tokenizer.vocab_size and (text or not byte_level):
        if byte_level:
            raise DataError(f"{text[0]}: byte-level text needs a vocabulary of at least "
                            f"256, the model's is {vocab} ({vocab_name}); give --tokenizer, or a "
                            f"larger model vocabulary")
        raise DataError(f"{tokenizer.name} has {tokenizer.vocab_size} ids, the model's vocabulary "
                        f"{vocab} ({vocab_name}); the model needs at least as many: a tokenizer "
                        f"made for this model, or a model config with vocab_size >= "
                        f"{tokenizer.vocab_size}")
    eval_tokens = None
    if args.eval_data is not None:
        eval_tokens = _tokens(args.eval_data, args, tokenizer, vocab, vocab_name, log).tokens
    if args.data == "text":
        if vocab < TEXT_VOCAB:
            raise DataError(f"--data text needs a vocabulary of at least {TEXT_VOCAB} (byte "
                            f"tokens), the model has {vocab}; use --data synthetic")
        tokens, name = np.frombuffer(text_corpus(), dtype=np.uint8), "the built-in text corpus"
    else:
        source = _tokens(args.data, args, tokenizer, vocab, vocab_name, log)
        tokens, name = source.tokens, source.description
    return TokenWindows(tokens, seq, batch, device, seed=args.seed, rank=rank,
                        eval_fraction=args.eval_fraction, eval_tokens=eval_tokens,
                        eval_batches=args.eval_batches, name=name)


def evaluate(engine, forward, batches) -> float:
    """The mean loss over the held-out batches: the model in eval mode, under
    torch.no_grad(), through the engine's forward; the mode is restored after.

    Args:
        engine: the tidal engine.
        forward: forward(x, y) -> the scalar loss tensor, run by the engine.
        batches: TokenWindows or SyntheticBatches (their eval_set()).
    """
    was_training = engine.module.training
    engine.eval()
    total, n = 0.0, 0
    try:
        with torch.no_grad():
            for x, y in batches.eval_set():
                total += float(forward(x, y))
                n += 1
    finally:
        engine.train(was_training)
    return total / n


def save_dir_of(args) -> str | None:
    """Where --save-every writes: --save-dir, else the folder --resume read from
    (the parent of a DIR/step<N> it named).

    Args:
        args: the parsed arguments.
    """
    if args.save_dir is not None or args.resume is None:
        return args.save_dir
    p = Path(args.resume)
    return str(p.parent if (p / "meta.json").is_file() else p)


def save(engine, save_dir, step: int, batches):
    """Writes a checkpoint after `step` steps with where the data and the RNG stand
    (Note [Resuming a training script]); returns its path.

    Args:
        engine: the engine.
        save_dir: the checkpoint folder (step<N>/ and latest go in it).
        step: steps done.
        batches: the run's batches (their state_dict()).
    """
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {_STATE_KEY: {"format": _STATE_FORMAT, "step": step, "data": batches.state_dict(),
                          "rng": rng, "threads": torch.get_num_threads(),
                          "settings": _step_settings(engine)}}
    try:
        return engine.save_checkpoint(save_dir, tag=f"step{step}", client_state=state)
    except OSError as e:
        raise SaveError(_save_failed(engine, Path(save_dir), f"step{step}", e)) from None


def _checkpoint_bytes(engine) -> int:
    """The bytes of a checkpoint's slots (Note [Checkpoint format]): per trainable
    parameter its 16-bit copy (fp32 in fp32 training), fp32 master and two
    moments; per frozen one its 16-bit copy."""
    element = _ELEMENT_BYTES[engine.precision]
    moments = 4 if engine.config.optimizer_state_dtype == "bf16" else 8
    return sum(r.numel * (element + 4 + moments if r.trainable else element)
               for r in engine.records)


def _save_failed(engine, root: Path, tag: str, e: OSError) -> str:
    need = _checkpoint_bytes(engine)
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = f", {shutil.disk_usage(where).free:,} bytes free there"
    except OSError:
        free = ""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    why = e.strerror or str(e)
    if e.filename is not None and not full:
        why += f" ({e.filename})"
    latest = root / "latest"
    previous = latest.read_text().strip() if latest.is_file() else ""
    if previous and previous != tag and (root / previous).is_dir():
        after = previous.removeprefix("step")
        kept = (f"{root / previous} is intact (--resume {root} continues from it"
                f"{f', after step {after}' if after.isdigit() else ''})")
    else:
        kept = "no earlier checkpoint of this run is in it"
    todo = ("free space on that disk, or give --save-dir DIR on one with room" if full else
            "give --save-dir DIR on a writable disk with room")
    return (f"--save-dir {root}: saving checkpoint {root / tag} failed: {why} (errno {e.errno}), "
            f"writing about {need:,} bytes (weights and Adam states){free}; {kept}; {todo}")


def _check_latest(p: Path, where) -> None:
    """The tag a save folder's `latest` names is a checkpoint there (or the copy a
    killed save left aside, which load_checkpoint takes: Note [Checkpoint format])."""
    tag = (p / "latest").read_text(errors="replace").strip()
    if tag and "/" not in tag and ((p / tag / "meta.json").is_file()
                                   or any(p.glob(f".{tag}.old-*/meta.json"))):
        return
    found = sorted((c.name for c in p.iterdir() if (c / "meta.json").is_file()),
                   key=lambda n: (len(n), n))
    there = (f"the checkpoints there are {', '.join(found)}: give --resume {p / found[-1]}"
             if found else "there is no checkpoint in it")
    named = f"names {tag!r}, which is not a checkpoint in {p}" if tag else "is empty"
    raise DataError(f"--resume {where}: {p / 'latest'} {named}; {there} (or start a new run)")


def _group_values(engine, betas: bool) -> list:
    keys = ("initial_lr", "weight_decay", "eps") + (("betas",) if betas else ())
    return [{k: tuple(float(b) for b in g[k]) if k == "betas" else float(g[k]) for k in keys}
            for g in engine.optimizer.param_groups]


def _hyperparameters(engine, fresh: list, lr: float | None, path: Path, step: int) -> str | None:
    """Applies --lr to a loaded engine, or keeps the checkpoint's rate; returns the
    line that says what differs (Note [Hyperparameters on resume]), None when
    nothing does."""
    scheduler = engine.lr_scheduler
    betas = scheduler is None or scheduler.get_betas() is None  # else the schedule's
    loaded = _group_values(engine, betas)
    parts = []
    if lr is not None:
        groups = engine.optimizer.param_groups
        for g, f in zip(groups, fresh, strict=True):
            g["initial_lr"] = g["lr"] = f["initial_lr"]
        if scheduler is None:
            engine.lr = groups[0]["lr"]
        else:
            engine.apply_lr_schedule()
        if [f["initial_lr"] for f in fresh] != [g["initial_lr"] for g in loaded]:
            was = ", ".join(f"{g['initial_lr']:g}" for g in loaded)
            parts.append(f"--lr {lr:g} applies from step {step + 1} on; {path} trained at {was}")
    kept = []
    for key, name in (("initial_lr", "lr"), ("weight_decay", "weight_decay"), ("eps", "eps"),
                      ("betas", "betas")):
        if key not in loaded[0] or (key == "initial_lr" and lr is not None):
            continue
        ours, theirs = [f[key] for f in fresh], [g[key] for g in loaded]
        if ours != theirs:
            show = (lambda v: str(list(v))) if key == "betas" else (lambda v: f"{v:g}")
            kept.append(f"{name} {', '.join(map(show, theirs))} (the config says "
                        f"{', '.join(map(show, ours))})")
    if kept:
        tip = "; --lr changes the rate" if kept[0].startswith("lr ") else ""
        parts.append(f"{path} continues with its own {'; '.join(kept)}{tip}")
    return "; ".join(parts) or None


def resume(engine, where, batches, lr: float | None = None,
           log: Callable[[str], None] | None = None) -> tuple[Path, int]:
    """Loads what save() wrote and continues the data and the RNG from it; returns
    (the checkpoint's path, the steps it had done).

    Args:
        engine: an engine built as the saved one was.
        where: a save folder (its latest checkpoint) or one checkpoint, DIR/step<N>.
        batches: the run's batches; they continue at the saved index.
        lr: the learning rate the command line gives (--lr, already written into
            the engine's config), which then applies from the next step; None:
            the checkpoint's continues (Note [Hyperparameters on resume]).
        log: called with the line that says which hyperparameters differ from
            the checkpoint's, if any.
    """
    p = Path(where)
    if not p.is_dir():
        raise DataError(f"--resume {where}: no such directory; expected the --save-dir of an "
                        f"earlier run (or one of its step<N> folders)")
    load_dir, tag = (p.parent, p.name) if (p / "meta.json").is_file() else (p, None)
    if tag is None and not (p / "latest").is_file():
        raise DataError(f"--resume {where}: no checkpoint there (no {p / 'latest'}); expected the "
                        f"--save-dir of a run with --save-every")
    if tag is None:
        _check_latest(p, where)
    fresh = _group_values(engine, True)
    path, client = engine.load_checkpoint(load_dir, tag)
    state = (client or {}).get(_STATE_KEY) if isinstance(client, dict) else None
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
        raise DataError(f"--resume {where}: {path} was not saved by tidal-train or finetune_hf.py "
                        f"(its client_state has no {_STATE_KEY!r} of format {_STATE_FORMAT}), so "
                        f"where its data stood is unknown")
    batches.load_state_dict(state["data"], origin=f"--resume {path}")
    threads = state.get("threads")
    if threads is not None and threads != torch.get_num_threads():
        warnings.warn(f"--resume {path}: the run that saved it used {threads} CPU threads, this one "
                      f"{torch.get_num_threads()}; CPU kernels split their sums by thread, so the "
                      f"losses may differ from the uninterrupted run's in the last bits; set "
                      f"OMP_NUM_THREADS={threads} for a bit-exact resume", stacklevel=2)
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    step = int(state["step"])
    line = _hyperparameters(engine, fresh, lr, path, step)
    changed = _changed_settings(engine, state.get("settings"), path, step)
    if changed is not None:
        line = changed if line is None else f"{line}; {changed}"
    if line is not None and log is not None:
        log(line)
    return path, step


def resume_from_args(ap: argparse.ArgumentParser, args, engine, batches, steps: int,
                     say: Callable[[str], None],
                     note: Callable[[str], None] | None = None) -> tuple[Path | None, int]:
    """--resume for a training command (tidal-train, scripts/finetune_hf.py):
    :func:`resume` from args.resume when it is given, with args.lr; an error,
    or a checkpoint that has done `steps` already, ends the command through
    ap.error. Returns (the checkpoint's path, the steps it had done), or
    (None, 0) without --resume.

    Args:
        ap: the command's parser (its errors exit with status 2).
        args: the parsed arguments (resume, lr).
        engine, batches: as for :func:`resume`.
        steps: the steps the run trains in all (--steps).
        say: prints a line of the command's own: "resumed from ...".
        note: prints the line on hyperparameters that differ from the
            checkpoint's; `say` when None.
    """
    if args.resume is None:
        return None, 0
    try:
        path, first = resume(engine, args.resume, batches, lr=args.lr, log=note or say)
    except ValueError as e:  # DataError, CheckpointError
        ap.error(str(e))
    if first >= steps:
        ap.error(f"--resume {args.resume}: {path} has done {first} steps and --steps is "
                 f"{steps}: nothing left to train; give a larger --steps")
    say(f"resumed from {path} after step {first}")
    return path, first


def _step_settings(engine) -> dict:
    """The config's values a checkpoint does not restore and a step depends on
    (Note [Hyperparameters on resume])."""
    return {"gradient_clipping": float(engine.config.gradient_clipping),
            "gradient_accumulation_steps": int(engine.config.gradient_accumulation_steps)}


def _changed_settings(engine, saved, path: Path, step: int) -> str | None:
    """The part of the resume line for the config's values the checkpoint does
    not restore: they apply from the next step as this run's config gives them,
    and the line says so; None when none changed (or the checkpoint predates
    saving them)."""
    if not isinstance(saved, dict):
        return None
    parts = []
    for key, value in _step_settings(engine).items():
        if key in saved and saved[key] != value:
            parts.append(f"{key} {value:g} applies from step {step + 1} on ({path} trained with "
                         f"{saved[key]:g})")
    return "; ".join(parts) or None

