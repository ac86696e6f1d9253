"""tidal-train (or python -m tidal.train): train a GPT-style model with tidal.

The model is tidal's TinyGPT (pre-norm GPT-2 blocks, learned positions, tied
embeddings) with the shape of a preset, or the Hugging Face architecture of a
config.json that names its model_type (GPT-2, LLaMA, Mistral, ...: any causal
LM of transformers, built straight into chunks with tidal.init_context; a
config without model_type gives a TinyGPT of its shape). The training config is a DeepSpeed-style JSON file; the
defaults ship in configs/ at the repository root:

    configs/gpt_gpu.json    on a GPU: bf16, 64 MiB chunks, the whole GPU as budget
    configs/gpt_sim.json    without one: the simulated device with an 8 MiB budget,
                            below the tiny model's 13 MB of fp32 state, so chunks
                            move both ways and CPU Adam runs
    configs/gpt_quick.json  --quick: a 2-layer model on the simulated device

Data (--data): 'text' (default), byte-level tokens of a corpus made at run time
from the Python standard library's docstrings; 'synthetic', a fixed random
bigram table; or your own corpus, --data PATH: a text file, a folder of text
files, a JSONL file with a "text" field, or a *.bin of token ids (nanoGPT's
train.bin; --data-dtype uint16|uint32). Text is encoded byte-level, or by a
local Hugging Face tokenizer (--tokenizer DIR), into a memory-mapped token
cache (Note [Token sources] in tidal/data/sources.py). The last 5% of the
tokens are held out (--eval-fraction); --eval-every N prints the validation
loss. --save-every N --save-dir DIR saves checkpoints; --resume DIR continues
one with the batches and losses the uninterrupted run would have had (Note
[Resuming a training script] in tidal/data/options.py), at the checkpoint's
learning rate, or at --lr's from the next step when given (a note says which:
Note [Hyperparameters on resume]). Nothing is downloaded. A failure is one
line on stderr naming the flag or file and what to do (Note [One line per
failure]).

    tidal-train                          # GPU: preset gpt-350m; else preset tiny, 30 steps
    tidal-train --quick                  # a few dozen steps of a tiny model, < 1 min on CPU
    tidal-train --preset gpt-1.3b --steps 20 --budget 20GB
    tidal-train --hf-config gpt2-config.json --seq 256
    tidal-train --quick --plot memory.png --json report.json
    tidal-train --quick --data corpus.jsonl --tokenizer tok/ --eval-every 10 \
        --save-every 20 --save-dir ckpt       # later: --resume ckpt --steps 80
    tidal-train --preset gpt-1.3b --nvme /local_nvme   # Adam's states on a disk (docs/nvme.md)

Progress shows loss, tokens/s, model TFLOPS (6 x parameters x tokens / time,
attention not counted), peak device memory against the budget and the host
memory of the chunks; the end prints the memory report.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import tidal
from tidal.data import DataError, load_tokenizer
from tidal.data import options as data_options
from tidal.models.gpt import PRESETS, TinyGPT  # PRESETS: tidal-train --preset, re-exported
from tidal.profile import plot_memory_profile as plot_memory_timeline

__all__ = ["PRESETS", "ModelShape", "shape_from_hf_config", "default_config_path",
           "plot_memory_timeline", "CommandLineParser", "one_line_warnings", "run", "main"]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
_QUICK_STEPS = 40


@dataclasses.dataclass
class ModelShape:
    """The shape of the TinyGPT to train, and where it came from."""

    layers: int
    hidden: int
    heads: int
    positions: int
    vocab: int
    tied: bool = True
    source: str = ""
    note: str = ""  # what differs from the model the shape came from

    def params(self) -> int:
        """TinyGPT's parameter count (qkv without bias, as tidal.models.gpt)."""
        d = self.hidden
        block = 3 * d * d + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 4 * d
        head = 0 if self.tied else self.vocab * d
        return self.layers * block + (self.vocab + self.positions) * d + 2 * d + head


def _need(cfg: dict, keys: tuple[str, ...], origin: str, what: str) -> int:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            v = cfg[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{origin}: '{k}' ({what}) must be a positive integer, got {v!r}")
            return v
    raise ValueError(f"{origin}: missing '{keys[0]}' ({what}); a GPT-2 config has n_layer, n_embd, "
                     f"n_head, n_positions and vocab_size, a LLaMA config num_hidden_layers, "
                     f"hidden_size, num_attention_heads, max_position_embeddings and vocab_size")


def _typo(key: str, known, given) -> "str | None":
    """The known key `key` is likely a misspelling of (one the config does not set)."""
    near = difflib.get_close_matches(key, sorted(set(known) - set(given)), n=1, cutoff=0.8)
    return near[0] if near else None


# The keys shape_from_hf_config reads.
_SHAPE_KEYS = ("model_type", "n_layer", "n_embd", "n_head", "n_positions", "n_ctx", "vocab_size",
               "n_inner", "tie_word_embeddings", "num_hidden_layers", "hidden_size",
               "num_attention_heads", "max_position_embeddings", "intermediate_size",
               "num_key_value_heads")


def shape_from_hf_config(cfg: dict, origin: str = "the Hugging Face config") -> ModelShape:
    """The TinyGPT shape of a Hugging Face GPT-2 or LLaMA-style config.

    GPT-2 (n_layer, n_embd, n_head, n_positions or n_ctx, vocab_size, n_inner)
    maps onto TinyGPT's blocks one to one, except that TinyGPT's qkv
    projection has no bias (GPT-2's c_attn has one) and uses exact GELU.

    LLaMA-style configs (num_hidden_layers, hidden_size, num_attention_heads,
    max_position_embeddings, vocab_size) give *LLaMA shapes with GPT blocks*:
    LayerNorm instead of RMSNorm, a 4 x hidden GELU MLP instead of SwiGLU of
    intermediate_size, learned positions instead of rotary, every head with
    its own keys and values (no grouped-query attention). The parameter count
    therefore differs from the LLaMA's; `note` says by how much.

    Args:
        cfg: the parsed config.json.
        origin: how errors name the config.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"{origin}: expected a JSON object, got {type(cfg).__name__}")
    for key in cfg:  # a misspelt optional key would leave its default without a word
        near = _typo(key, _SHAPE_KEYS, cfg) if key not in _SHAPE_KEYS else None
        if near is not None:
            raise ValueError(f"{origin}: unknown key '{key}'; did you mean '{near}'? fix the key")
    model_type = cfg.get("model_type")
    llama_like = "num_hidden_layers" in cfg or "hidden_size" in cfg
    if model_type == "gpt2" or (model_type is None and not llama_like):
        layers = _need(cfg, ("n_layer",), origin, "layers")
        d = _need(cfg, ("n_embd",), origin, "hidden size")
        heads = _need(cfg, ("n_head",), origin, "attention heads")
        positions = _need(cfg, ("n_positions", "n_ctx"), origin, "positions")
        vocab = _need(cfg, ("vocab_size",), origin, "vocabulary")
        inner = cfg.get("n_inner")
        if inner is not None and inner != 4 * d:
            raise ValueError(f"{origin}: n_inner = {inner}, but TinyGPT's MLP is 4 x n_embd = "
                             f"{4 * d} wide; remove n_inner or set it to {4 * d}")
        shape = ModelShape(layers, d, heads, positions, vocab,
                           tied=bool(cfg.get("tie_word_embeddings", True)), source=f"GPT-2 config {origin}",
                           note="TinyGPT blocks: no qkv bias, exact GELU")
    else:
        layers = _need(cfg, ("num_hidden_layers",), origin, "layers")
        d = _need(cfg, ("hidden_size",), origin, "hidden size")
        heads = _need(cfg, ("num_attention_heads",), origin, "attention heads")
        positions = _need(cfg, ("max_position_embeddings",), origin, "positions")
        vocab = _need(cfg, ("vocab_size",), origin, "vocabulary")
        tied = bool(cfg.get("tie_word_embeddings", False))
        shape = ModelShape(layers, d, heads, positions, vocab, tied=tied,
                           source=f"{model_type or 'LLaMA-style'} config {origin}")
        inter = cfg.get("intermediate_size") or 4 * d
        kv_heads = cfg.get("num_key_value_heads") or heads
        kv = d // heads * kv_heads
        llama = layers * (2 * d * d + 2 * d * kv + 3 * d * inter + 2 * d) + vocab * d + d + \
            (0 if tied else vocab * d)
        shape.note = (f"LLaMA shapes with GPT blocks: LayerNorm, 4 x {d} GELU MLP (the config's "
                      f"SwiGLU is {inter} wide), learned positions, {heads} key/value heads "
                      f"(config: {kv_heads}); {shape.params() / 1e6:.1f}M parameters here vs "
                      f"{llama / 1e6:.1f}M in the {model_type or 'LLaMA'} model")
    if shape.hidden % shape.heads:
        raise ValueError(f"{origin}: the hidden size {shape.hidden} is not a multiple of the "
                         f"{shape.heads} attention heads")
    return shape


# Keys a config.json may hold that no config class reads: what save_pretrained
# and the Hub write beside the model's settings.
_HF_METADATA = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "architectures",
                          "auto_map", "model_type", "torch_dtype", "dtype", "quantization_config",
                          "custom_pipelines", "attn_implementation", "_attn_implementation"})


def _check_hf_keys(cfg: dict, config_class, origin: str, warn) -> None:
    """Names the keys of a config.json that its config class does not read
    (transformers would keep them as plain attributes and build the model with
    the defaults they were meant to replace): a likely misspelling of a key the
    config leaves out is an error, any other unknown key a warning."""
    import inspect
    try:
        defaults = config_class()
    except (TypeError, ValueError):  # a composite config (encoder-decoder): not a causal LM
        return
    known = set(defaults.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    for c in config_class.__mro__:
        if "__init__" in vars(c):
            known |= set(inspect.signature(c.__init__).parameters)
    known |= _HF_METADATA
    unknown = [k for k in cfg if k not in known]
    typos = [(k, _typo(k, known, cfg)) for k in unknown]
    wrong = [(k, near) for k, near in typos if near is not None]
    if wrong:
        k, near = wrong[0]
        default = getattr(defaults, near, None)
        raise ValueError(
            f"{origin}: unknown key '{k}'; did you mean '{near}'? {config_class.__name__} does not "
            f"read '{k}', so {near} would be its default ({default!r})"
            + (f" (also: {', '.join(f'{a!r} -> {b!r}' for a, b in wrong[1:])})" if wrong[1:] else "")
            + "; fix the key")
    if unknown:
        message = (f"{origin}: {config_class.__name__} does not read "
                   f"{', '.join(repr(k) for k in unknown)}: the model is built without "
                   f"{'it' if len(unknown) == 1 else 'them'}")
        if warn is None:
            warnings.warn(message, stacklevel=4)
        else:
            warn(message)


def _transformers_config(cfg: dict, origin: str, warn=None):
    """The transformers config of a config.json with a model_type, for
    AutoModelForCausalLM (the architecture trained as it is).

    Args:
        cfg: the parsed config.json.
        origin: how messages name it.
        warn: called with the line naming keys the config class does not read
            (default: warnings.warn); a likely misspelling is a ValueError.
    """
    try:
        import transformers
    except ImportError:
        raise ValueError("a config with a 'model_type' trains that Hugging Face architecture, "
                         "which needs transformers: pip install transformers") from None
    kind = cfg["model_type"]
    try:
        config_class = transformers.CONFIG_MAPPING[kind]
    except KeyError:
        near = difflib.get_close_matches(str(kind), list(transformers.CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
        raise ValueError(f"model_type '{kind}' is not a transformers model type (transformers "
                         f"{transformers.__version__}){hint}") from None
    _check_hf_keys(cfg, config_class, origin, warn)
    try:
        config = transformers.AutoConfig.for_model(kind, **{k: v for k, v in cfg.items()
                                                              if k != "model_type"})
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{origin}: transformers' {config_class.__name__} refuses it: {e}") from None
    if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
        raise ValueError(f"model_type '{kind}' has no causal language model in transformers "
                         f"(AutoModelForCausalLM); tidal-train trains causal LMs")
    return config


def default_config_path(quick: bool, gpu: bool) -> Path:
    name = "gpt_quick.json" if quick else "gpt_gpu.json" if gpu else "gpt_sim.json"
    path = CONFIG_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"the default config {path} is missing (tidal installed without its source tree?); "
            f"pass --config FILE")
    return path


def _build_seconds(in_context: float, initialize: float, store_seconds: dict) -> dict:
    """Where building the model into chunks went: `in_context` seconds in
    tidal.init_context, of them `store_seconds` (ParamStore.seconds) in the
    store and the rest the model's own construction and initialisation; then
    `initialize` seconds in tidal.initialize."""
    chunks = sum(store_seconds.values())
    return {"seconds": in_context + initialize, "model_init": max(in_context - chunks, 0.0),
            **store_seconds, "initialize": initialize}


# Note [What a steady step costs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Run totals hide what a steady step does: the warm-up's misses and pins
# (the trace, the relayout) swamp them. So the run records each step's
# scheduler counters (engine.chunks.stats() before and after it: the
# report's scheduler_per_step) and their mean over the steps from the third
# on (scheduler_steady, with the prefetch hit rate of those steps): the
# copies a steady step needed that were prefetched, its waits on copies
# and host blocks, its host pins (each a cudaHostRegister on a GPU), its
# evictions, the folds that took back their weights' block. The figures a
# GPU run is judged by (issue 52: hit rate >= 0.9, no waits, no pinning).
# (benchmarks/engine_offload.py records the same.)
STEP_COUNTERS = ("bytes_host_to_device", "bytes_device_to_host", "prefetch_hits", "misses",
                 "copy_waits", "copy_wait_seconds", "block_waits", "block_wait_seconds",
                 "host_pins", "host_bytes_pinned", "host_block_allocations", "host_block_bytes_allocated",
                 "pageable_copies", "evictions", "prefetches_ahead", "images_taken_back",
                 "bytes_images_taken_back", "blocks_for_images")


def steady_counters(per_step: list) -> dict:
    """The mean of STEP_COUNTERS over the steps from the third on (all of
    them in a shorter run), with those steps' prefetch hit rate (0 where
    nothing was needed)."""
    steady = per_step[2:] or per_step
    out = {k: sum(s[k] for s in steady) / len(steady) if steady else 0.0 for k in STEP_COUNTERS}
    needed = out["prefetch_hits"] + out["misses"]
    out["prefetch_hit_rate"] = out["prefetch_hits"] / needed if needed else 0.0
    out["steps"] = len(steady)
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# Note [One line per failure]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What a user of tidal-train or tidal-estimate can get wrong -- an argument, a
# file, a budget, a full disk -- ends the command with one line on stderr,
# "tidal-train: error: ...", that names the flag, file or value and what to do,
# and a nonzero status: 2 for what is found before training starts (as
# argparse's own errors), 1 for a failure during training (a checkpoint that
# cannot be written, the device budget running out at a step). Only the error
# types that mean "bad input" are caught (DataError, ConfigError, OSError of a
# file the user named, tidal.OutOfMemoryError, SaveError), each where it can
# arise, so a bug of tidal's own still ends in its traceback. Warnings print
# as one line too (one_line_warnings).


class CommandLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `PROG: error: MESSAGE`, exit status 2
    (Note [One line per failure]): the message names the flag or file and what to
    do, so the usage block (tidal-train --help) would only push it up the screen."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).splitlines())}\n")


def _fail(message: str, status: int = 1):
    """Ends a run that failed while training with one line on stderr (Note [One
    line per failure])."""
    sys.stderr.flush()
    print(f"tidal-train: error: {' '.join(str(message).splitlines())}", file=sys.stderr, flush=True)
    raise SystemExit(status)


@contextlib.contextmanager
def one_line_warnings(prog: str):
    """Within it, a warning prints as one line, `PROG: warning: MESSAGE`, not as
    Python's file:line header and source line; the previous handling is restored
    after (Note [One line per failure]).

    Args:
        prog: the command's name.
    """
    with warnings.catch_warnings():
        def show(message, category, filename, lineno, file=None, line=None):
            print(f"{prog}: warning: {' '.join(str(message).splitlines())}",
                  file=file or sys.stderr, flush=True)
        warnings.showwarning = show
        yield


def _writable_parent(ap, flag: str, path) -> None:
    """Refuses an output path whose folder is missing before training, not after it."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        ap.error(f"{flag} {path}: the folder {parent} does not exist; create it first")


def _parser() -> argparse.ArgumentParser:
    ap = CommandLineParser(prog="tidal-train", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--preset", default=None,
                       help=f"model shape: {', '.join(PRESETS)} (default: gpt-350m on a GPU, "
                            f"tiny otherwise, nano with --quick)")
    model.add_argument("--hf-config", default=None, metavar="JSON",
                       help="train the Hugging Face architecture of a config.json with a model_type "
                            "(gpt2, llama, ...; a config without one: a TinyGPT of its shape)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: preset nano, {_QUICK_STEPS} steps, configs/gpt_quick.json "
                         f"(simulated device)")
    ap.add_argument("--config", default=None, metavar="JSON",
                    help="DeepSpeed-style config file (default: configs/gpt_gpu.json or gpt_sim.json)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=None,
                    help="micro batch size (overrides train_micro_batch_size_per_gpu)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (at most the "
                                                          "model's positions)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (overrides optimizer.params.lr)")
    ap.add_argument("--budget", default=None, help="device memory budget, e.g. 20GB "
                                                   "(overrides tidal.device_memory_budget)")
    ap.add_argument("--nvme", default=None, metavar="DIR",
                    help="chunks of the optimizer states (fp32 master, Adam moments) go to a file "
                         "in DIR, an existing folder on a disk, when the host budget is full "
                         "(zero_optimization.offload_optimizer.device 'nvme'; docs/nvme.md)")
    ap.add_argument("--nvme-param", action="store_true",
                    help="with --nvme: the 16-bit parameters may go there too (offload_param 'nvme')")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model init and the data")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the final report here")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="write a PNG of device memory over the last step (needs matplotlib)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="write the last step's memory profile to DIR: memory_profile.json and "
                         "memory_profile.png (chunks, non-chunk, free per hook, the budget, chunk "
                         "moves and evictions marked; needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true",
                    help="plain log lines instead of a progress bar")
    data_options.add_arguments(ap)
    return ap


def _positive(ap, name, value):
    if value is not None and value < 1:
        ap.error(f"{name} must be at least 1, got {value}")


def run(argv=None) -> dict:
    """Trains as the command line says and returns the final report (what --json writes).

    Args:
        argv: the arguments (default: sys.argv[1:]). Argument errors raise
            SystemExit(2) after printing the usage and the error, as argparse does.
    """
    ap = _parser()
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "seq"):
        _positive(ap, f"--{name}", getattr(args, name))
    data_options.check_arguments(ap, args)
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr >= 0):
        ap.error(f"--lr must be a finite number >= 0, got {args.lr}")
    if args.preset is not None and args.preset not in PRESETS:
        near = difflib.get_close_matches(args.preset, list(PRESETS), n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        ap.error(f"unknown preset '{args.preset}'{hint} (presets: {', '.join(PRESETS)})")
    if args.plot is not None or args.profile is not None:
        try:
            import matplotlib  # noqa: F401  -- fail before training, not after
        except ImportError:
            ap.error("--plot and --profile need matplotlib: pip install matplotlib")
    save_dir = data_options.save_dir_of(args)
    if save_dir is not None and Path(save_dir).exists() and not Path(save_dir).is_dir():
        ap.error(f"--save-dir {save_dir}: a file, expected a folder for the checkpoints (or a new "
                 f"name)")
    _writable_parent(ap, "--json", args.json)
    _writable_parent(ap, "--plot", args.plot)
    if args.profile is not None and Path(args.profile).exists() and not Path(args.profile).is_dir():
        ap.error(f"--profile {args.profile}: a file, expected a folder (or a new name)")
    if args.nvme_param and args.nvme is None:
        ap.error("--nvme-param needs --nvme DIR, the folder of the NVMe tier's file")
    if args.nvme is not None and not Path(args.nvme).is_dir():
        ap.error(f"--nvme {args.nvme}: {'a file' if Path(args.nvme).exists() else 'no such folder'}; "
                 f"expected an existing folder on the disk to put the chunks in (mkdir it first)")

    info = tidal.get_device().info()
    gpu = info["backend"] == "cuda"
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        vocab_from_data, vocab_origin = data_options.data_vocab(args, tokenizer)
    except DataError as e:
        ap.error(str(e))

    # The model's shape.
    hf_config = None  # a transformers config: train that architecture itself
    if args.hf_config:
        try:
            with open(args.hf_config, encoding="utf-8") as f:
                hf = json.load(f)
        except OSError as e:
            ap.error(f"--hf-config {args.hf_config}: {e}")
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            ap.error(f"--hf-config {args.hf_config}: not JSON ({e}); expected a Hugging Face "
                     f"config.json")
        try:
            if isinstance(hf, dict) and hf.get("model_type"):
                hf_config = _transformers_config(
                    hf, args.hf_config,
                    warn=lambda line: print(f"tidal-train: warning: {line}", file=sys.stderr,
                                            flush=True))
                c = hf_config
                shape = ModelShape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                                   getattr(c, "max_position_embeddings", None) or 1 << 30,
                                   c.vocab_size, tied=bool(c.tie_word_embeddings),
                                   source=f"Hugging Face {hf['model_type']} config {args.hf_config}")
            else:
                shape = shape_from_hf_config(hf, args.hf_config)
        except ValueError as e:
            msg = str(e)  # (shape_from_hf_config's name the file already)
            ap.error(f"--hf-config {msg}" if msg.startswith(f"{args.hf_config}: ")
                     else f"--hf-config {args.hf_config}: {msg}")
        label = Path(args.hf_config).name
    else:
        preset = args.preset or ("nano" if args.quick else "gpt-350m" if gpu else "tiny")
        layers, d, heads, positions, vocab = PRESETS[preset]
        shape = ModelShape(layers, d, heads, positions, vocab, source=f"preset {preset}")
        label = preset
        if vocab_from_data is not None:  # a preset takes the data's vocabulary
            shape.vocab = vocab_from_data
            shape.note = f"vocabulary {vocab_from_data}: {vocab_origin}"
    seq = args.seq or min(shape.positions, 1024)
    if seq > shape.positions:
        ap.error(f"--seq {seq} is longer than the model's {shape.positions} positions")
    if args.data == "text" and shape.vocab < 256:
        ap.error(f"--data text needs a vocabulary of at least 256 (byte tokens); {shape.source} "
                 f"has {shape.vocab}: use --data synthetic")

    # The training config: the file, then the command line's overrides.
    try:
        config_path = Path(args.config) if args.config else default_config_path(args.quick, gpu)
    except FileNotFoundError as e:
        ap.error(str(e))
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        ap.error(f"--config {config_path}: {e.strerror or e}")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        ap.error(f"--config {config_path}: not JSON ({e}); a DeepSpeed-style config is one JSON "
                 f"object (configs/gpt_quick.json is an example)")
    try:
        if not isinstance(config, dict):
            raise tidal.ConfigError(f"config file '{config_path}' holds a {type(config).__name__}, "
                                    f"not an object")
        if args.batch is not None:
            ga = tidal.Config.load(config).gradient_accumulation_steps
            config["train_micro_batch_size_per_gpu"] = args.batch
            if "train_batch_size" in config:
                config["train_batch_size"] = args.batch * ga
            config.setdefault("gradient_accumulation_steps", ga)
        if args.lr is not None:
            config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        if args.budget is not None:
            config.setdefault("tidal", {})["device_memory_budget"] = args.budget
        if args.nvme is not None:
            _nvme_into(config, args.nvme, args.nvme_param)
        cfg = tidal.Config.load(config)
    except ValueError as e:  # ConfigError
        ap.error(_config_error(e, args, config_path))
    micro = cfg.micro_batch_size or 1
    if cfg.micro_batch_size is None:
        config["train_micro_batch_size_per_gpu"] = micro
    accum = cfg.gradient_accumulation_steps
    steps = args.steps or (_QUICK_STEPS if args.quick else 20 if gpu else 30)
    # Under torchrun (data parallel, docs/data_parallel.md): every rank trains
    # its own batches of the same model; rank 0 speaks for the global batch.
    world = cfg.world_size
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    say = print if rank == 0 else (lambda *a, **k: None)
    tokens_per_step = micro * accum * world * seq
    n_est = shape.params() if hf_config is None else None  # HF: counted once built

    size = f"{n_est / 1e6:.1f}M parameters, " if n_est is not None else ""
    say(f"[tidal-train] {shape.source}: {size}{shape.layers} layers, "
          f"hidden {shape.hidden}, {shape.heads} heads, vocab {shape.vocab}; seq {seq}, micro batch "
          f"{micro} x {accum} accumulation"
          f"{f' x {world} ranks = global batch {micro * accum * world}' if world > 1 else ''}, "
          f"{steps} steps, data {args.data}, config {config_path}",
          flush=True)
    if shape.note:
        say(f"[tidal-train] note: {shape.note}", flush=True)

    # The data, before the model is built, so a bad file fails fast.
    try:
        data = data_options.open_batches(
            args, tokenizer, shape.vocab, f"the model's, {shape.source}", seq, micro, "cpu",
            rank=rank, log=lambda line: say(f"[tidal-train] {line}", flush=True))
    except DataError as e:
        ap.error(str(e))
    if args.eval_every and not data.has_eval:
        ap.error("--eval-every needs a held-out split: --eval-fraction > 0 or --eval-data")
    if args.data not in data_options.BUILTIN:
        say(f"[tidal-train] data: {data.name}; {tokenizer.name}", flush=True)
    if args.eval_every:
        say(f"[tidal-train] validation every {args.eval_every} steps on {data.describe_eval()}",
            flush=True)

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    try:
        with tidal.init_context(config) as store:
            if hf_config is not None:
                import transformers
                model = transformers.AutoModelForCausalLM.from_config(hf_config)
            else:
                model = TinyGPT(vocab=shape.vocab, d=shape.hidden, layers=shape.layers,
                                heads=shape.heads, seq=shape.positions, tied=shape.tied)
        t_built = time.perf_counter()
        in_context = dict(store.seconds)
        engine = tidal.initialize(model)
    except tidal.ConfigError as e:  # a budget the device cannot give, ...
        ap.error(_config_error(e, args, config_path))
    except tidal.OutOfMemoryError as e:  # the model's states do not fit
        ap.error(f"{shape.source} does not fit: {e} (--budget sets the device budget"
                 f"{'' if cfg.nvme_path else ', --nvme DIR puts the optimizer states on a disk'}; "
                 f"tidal-estimate tells what fits before anything is built)")
    except ValueError as e:
        # The NVMe tier's folder refused (tmpfs: host memory); other
        # ValueErrors are tidal's own and keep their traceback.
        if cfg.nvme_path is None or str(cfg.nvme_path) not in str(e):
            raise
        ap.error(f"{'--nvme' if args.nvme else 'nvme_path'} {cfg.nvme_path}: {e}")
    t_initialized = time.perf_counter()

    def forward(x, y):
        if hf_config is not None:
            # Causal LM heads shift the labels themselves: x predicts x.
            return engine(input_ids=x, labels=x).loss
        return engine(x, y)
    records = getattr(engine, "records", None)
    n_params = sum(r.numel for r in records) if records else (n_est or 0)
    if n_est is None:
        say(f"[tidal-train] {type(model).__name__}: {n_params / 1e6:.1f}M parameters", flush=True)
    device = engine.store.torch_device
    info = tidal.get_device().info()
    build = _build_seconds(t_built - t0, t_initialized - t_built, in_context)
    say(f"[tidal-train] built into chunks in {build['seconds']:.1f} s on "
          f"{info['backend']} ({info['name']}), precision {cfg.precision}, device budget "
          f"{_fmt_bytes(engine.store.device_budget)}", flush=True)
    say(f"  of which: the model's own init {build['model_init']:.1f} s, chunk memory "
        f"{build['chunk_memory']:.1f} s, writing values and zeroed moments "
        f"{build['write']:.1f} s, bookkeeping {build['register']:.1f} s, "
        f"tidal.initialize {build['initialize']:.1f} s", flush=True)

    # (The model above is seeded alike on every rank; the data is not: each
    # rank draws its own windows, Note [Resumable batches].)
    data.device = device
    resumed_from, first = data_options.resume_from_args(
        ap, args, engine, data, steps, say=lambda line: say(f"[tidal-train] {line}", flush=True),
        note=lambda line: say(f"[tidal-train] note: {line}", flush=True))
    bar = None
    if not args.no_progress and rank == 0:
        try:
            from tqdm import tqdm
            bar = tqdm(total=steps, initial=first, unit="step", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            say("[tidal-train] tqdm is not installed: plain progress lines", flush=True)
    write = bar.write if bar is not None else (lambda line: say(line, flush=True))
    losses, times, applied, evals, saved, disk_steps = [], [], 0, [], [], []
    # Note [Where a step's time goes]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Each step's host-side seconds in its forwards, its backwards,
    # engine.step() and the read of its losses (the report's phase_seconds,
    # and their medians over the steps from the third on). On a GPU a call
    # returns once its kernels are launched, so a long call is one whose
    # thread waited (for a copy, a fold, CPU Adam under the next forward) or
    # worked on the host, and reading the losses waits for the device to end
    # the step. The losses are read once the step is launched, not after
    # each backward: loss.item() there waited for that backward to end on
    # the device before the next micro-batch's forward could launch. The
    # same sums, in the same order.
    phases = {"forward": [], "backward": [], "step": [], "losses_read": []}
    # Each step's scheduler counters (Note [What a steady step costs]).
    moved = []
    start = time.perf_counter()
    for step in range(first, steps):
        counted = engine.chunks.stats()
        t = time.perf_counter()
        total = 0.0
        spent = dict.fromkeys(phases, 0.0)
        try:
            micro_losses = []
            for _ in range(accum):
                x, y = next(data)
                t_fwd = time.perf_counter()
                loss = forward(x, y)
                t_bwd = time.perf_counter()
                engine.backward(loss)
                spent["forward"] += t_bwd - t_fwd
                spent["backward"] += time.perf_counter() - t_bwd
                micro_losses.append(loss.detach())
            t_step = time.perf_counter()
            stepped = engine.step()
            t_read = time.perf_counter()
            for loss in micro_losses:
                total += loss.item()
            spent["step"] = t_read - t_step
            spent["losses_read"] = time.perf_counter() - t_read
            if stepped:
                applied += 1
        except tidal.OutOfMemoryError as e:
            if bar is not None:
                bar.close()
            _fail(_out_of_budget(e, step, saved[-1] if saved else resumed_from))
        except RuntimeError as e:
            # A read or write of the NVMe tier failed (Note [Chunks on NVMe:
            # after a failure]): the disk's error, in one line; tidal's own
            # errors keep their traceback.
            disk = engine.chunks.disk
            if disk is None or disk["failure"] is None:
                raise
            if bar is not None:
                bar.close()
            last = saved[-1] if saved else resumed_from
            _fail(f"step {step + 1}: {' '.join(str(e).split())}; tidal-train stops here, "
                  f"{f'{last} is intact and --resume {last} continues from it' if last is not None else 'the run has no checkpoint'}")
        times.append(time.perf_counter() - t)
        for k, v in spent.items():
            phases[k].append(v)
        now = engine.chunks.stats()
        moved.append({k: now[k] - counted[k] for k in STEP_COUNTERS})
        if engine.dp is not None:  # the global batch's mean loss
            total = engine.dp.all_reduce_sum([total], "average the loss")[0] / world
        losses.append(total / accum)
        tok_s = tokens_per_step / times[-1]
        tflops = 6 * n_params * tokens_per_step / times[-1] / 1e12
        rep = engine.memory_report()
        fields = (f"loss {losses[-1]:.3f}  {tok_s:,.0f} tok/s  {tflops:.3g} TFLOPS  "
                  f"dev {_fmt_bytes(rep['peak_device_bytes'])}/{_fmt_bytes(rep['device_budget'])}  "
                  f"host {_fmt_bytes(rep['peak_chunk_host_bytes'])}")
        if rep["nvme"] is not None:  # this step's disk traffic (an accumulation window's steps in all)
            n = rep["nvme"]
            disk_steps.append([n["bytes_read_last_step"], n["bytes_written_last_step"]])
            fields += f"  disk r {_fmt_bytes(disk_steps[-1][0])} w {_fmt_bytes(disk_steps[-1][1])}"
        if bar is not None:
            bar.set_postfix_str(fields, refresh=False)
            bar.update(1)
        elif step % max(1, steps // 10) == 0 or step == steps - 1:
            say(f"step {step:5d}  {fields}", flush=True)
        done = step + 1
        if args.eval_every and (done % args.eval_every == 0 or done == steps):
            evals.append({"step": done, "loss": data_options.evaluate(engine, forward, data)})
            write(f"step {step:5d}  validation loss {evals[-1]['loss']:.4f}")
        if args.save_every and (done % args.save_every == 0 or done == steps):
            try:
                saved.append(str(data_options.save(engine, save_dir, done, data)))
            except data_options.SaveError as e:
                if bar is not None:
                    bar.close()
                _fail(f"after step {done}: {e}")
            write(f"step {step:5d}  saved {saved[-1]}")
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - start

    report = engine.memory_report()
    steady = times[2:] or times
    tail = losses[-5:]
    summary = {
        "model": label, "source": shape.source, "architecture": type(model).__name__,
        "params": n_params, "layers": shape.layers,
        "hidden": shape.hidden, "heads": shape.heads, "vocab": shape.vocab, "seq": seq,
        "steps": steps, "start_step": first, "applied_steps": applied, "micro_batch": micro,
        "world_size": world,
        "global_batch": micro * accum * world,
        "gradient_accumulation_steps": accum, "data": args.data, "config": str(config_path),
        # The rate the steps used (a resumed run's: Note [Hyperparameters on resume]),
        # before a scheduler's factor.
        "precision": cfg.precision, "lr": engine.optimizer.param_groups[0]["initial_lr"],
        "first_loss": losses[0], "last_loss": losses[-1],
        "last5_mean_loss": sum(tail) / len(tail), "losses": losses, "seconds": wall,
        "tokens_per_s": tokens_per_step * len(steady) / sum(steady),
        "tflops": 6 * n_params * tokens_per_step * len(steady) / sum(steady) / 1e12,
        "device": info["name"], "backend": info["backend"],
        "tokenizer": tokenizer.name, "data_source": data.name, "build_seconds": build,
        "eval": evals, "checkpoints": saved,
        "memory": {k: v for k, v in report.items() if k not in ("scheduler", "host")},
        "host_bytes": report["host"],
        "phase_seconds": phases,
        "phase_seconds_steady": {k: statistics.median(v[2:] or v) for k, v in phases.items()},
        "scheduler_per_step": moved,
        "scheduler_steady": steady_counters(moved),
    }
    if disk_steps:
        # Each step's [bytes read, bytes written] of the NVMe tier; the first
        # steps fill the file, the steady ones (3 on) read and write what is
        # on disk about once.
        steady_disk = disk_steps[2:] or disk_steps
        summary["memory"]["nvme"]["bytes_per_step"] = disk_steps
        summary["memory"]["nvme"]["steady_bytes_read_per_step"] = \
            sum(b[0] for b in steady_disk) / len(steady_disk)
        summary["memory"]["nvme"]["steady_bytes_written_per_step"] = \
            sum(b[1] for b in steady_disk) / len(steady_disk)
    m = summary["memory"]
    ran = f"steps {first + 1}-{steps}" if first else f"{steps} steps"
    say(f"[tidal-train] report: {ran} in {wall:.1f} s; loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f} (mean of the last {len(tail)}: {summary['last5_mean_loss']:.4f})")
    if evals:
        say(f"  validation loss {evals[0]['loss']:.4f} (step {evals[0]['step']}) -> "
            f"{evals[-1]['loss']:.4f} (step {evals[-1]['step']})")
    say(f"  throughput (steps 3 on): {summary['tokens_per_s']:,.0f} tokens/s, "
          f"{summary['tflops']:.3g} TFLOPS")
    ph = summary["phase_seconds_steady"]
    say(f"  a steady step's calls (median, host-side): forward {ph['forward'] * 1e3:.1f} ms, backward "
        f"{ph['backward'] * 1e3:.1f} ms, step {ph['step'] * 1e3:.1f} ms, reading the losses "
        f"{ph['losses_read'] * 1e3:.1f} ms")
    c = summary["scheduler_steady"]
    say(f"  a steady step's moves (mean, steps 3 on): prefetch hits {c['prefetch_hits']:.3g}, misses "
        f"{c['misses']:.3g} (hit rate {c['prefetch_hit_rate']:.0%}); waits on copies {c['copy_waits']:.3g} "
        f"({c['copy_wait_seconds'] * 1e3:.1f} ms), on host blocks {c['block_waits']:.3g} "
        f"({c['block_wait_seconds'] * 1e3:.1f} ms); host pins {c['host_pins']:.3g} "
        f"({_fmt_bytes(c['host_bytes_pinned'])}); evictions {c['evictions']:.3g}")
    say(f"  device budget {_fmt_bytes(m['device_budget'])} (margin {_fmt_bytes(m['device_margin'])}): "
          f"peak chunks {_fmt_bytes(m['peak_chunk_device_bytes'])}, peak non-chunk "
          f"{_fmt_bytes(m['peak_nonchunk_device_bytes'])}, peak together "
          f"{_fmt_bytes(m['peak_device_bytes'])}")
    say(f"  host: peak chunks {_fmt_bytes(m['peak_chunk_host_bytes'])}, tidal host buffers "
          f"{_fmt_bytes(report['host'].get('allocated', 0))} (pinned "
          f"{_fmt_bytes(report['host'].get('pinned', 0))})")
    say(f"  last step moved {_fmt_bytes(m['bytes_host_to_device_last_step'])} host->device, "
          f"{_fmt_bytes(m['bytes_device_to_host_last_step'])} device->host; evictions "
          f"{m['evictions']}, prefetch hit rate {m['prefetch_hit_rate']:.0%}")
    if m.get("nvme"):
        n = m["nvme"]
        say(f"  NVMe: {_fmt_bytes(n['bytes_on_disk'])} of chunks on disk now (peak "
            f"{_fmt_bytes(n['peak_bytes_on_disk'])}) in {n['path']} ({n['backend']}); "
            f"{_fmt_bytes(n['bytes_read'])} read, {_fmt_bytes(n['bytes_written'])} written in all"
            + (f"; per step ({'steps 3 on' if len(disk_steps) > 2 else 'all steps'}) "
               f"{_fmt_bytes(n['steady_bytes_read_per_step'])} read, "
               f"{_fmt_bytes(n['steady_bytes_written_per_step'])} written" if disk_steps else ""))
    say(f"  Adam: {m['cpu_adam_seconds']:.2f} s in CPU Adam, chunks updated on the device "
          f"{m['adam_chunks_on_device']} / on the host {m['adam_chunks_on_host']}; skipped steps "
          f"{m['skipped_steps']}, loss scale {m['loss_scale']:g}", flush=True)
    title = (f"tidal: device memory over one step ({label}, budget "
             f"{_fmt_bytes(engine.store.device_budget)}, {info['backend']})")
    try:
        _write_outputs(args, engine, summary, title, rank, say)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        _fail(f"writing the report failed: {e.strerror or e}{where}; the run itself finished"
              f"{f' and saved {saved[-1]}' if saved else ''}")
    return summary


def _write_outputs(args, engine, summary, title, rank, say) -> None:
    """--profile, --plot and --json."""
    if args.profile and rank == 0:
        written = engine.export_memory_profile(args.profile, title=title)
        summary["profile"] = written
        say(f"[tidal-train] wrote {written['json']} and {written['png']} ({written['points']} "
              f"trace points, {written['marked_moves']} chunk moves, "
              f"{written['marked_evictions']} evictions)", flush=True)
    if args.plot and rank == 0:
        drawn = plot_memory_timeline(engine.memory_profile(), args.plot, title=title)
        summary["plot"] = {"path": str(args.plot), **drawn}
        say(f"[tidal-train] wrote {args.plot} ({drawn['points']} trace points)", flush=True)
    if args.json and rank == 0:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


def _nvme_into(config: dict, folder: str, param: bool) -> None:
    """--nvme DIR (--nvme-param): the config's zero_optimization offloads the
    optimizer states (and the 16-bit parameters) to 'nvme' in DIR, keeping the
    blocks' other keys; a config already offloading to another folder then
    fails in Config.load, which names both."""
    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        return  # (Config.load names the bad value)
    blocks = ("offload_optimizer", "offload_param") if param else ("offload_optimizer",)
    for block in blocks:
        b = zero.get(block)
        zero[block] = {**(b if isinstance(b, dict) else {}), "device": "nvme", "nvme_path": folder}
    b = zero.get("offload_param")
    if not param and isinstance(b, dict) and b.get("device") == "nvme":
        b["nvme_path"] = folder  # (one file: both blocks name the same folder)


def _config_error(e: ValueError, args, config_path) -> str:
    """A ConfigError's message naming where the value came from: --budget, or the file."""
    text = str(e)
    if args.budget is not None and "device_memory_budget" in text:
        if "device has (" not in text:  # (the message names what to give otherwise)
            return f"--budget {args.budget}: {text}"
        capacity = tidal.get_device().info()["capacity"]  # (the device the config chose)
        return (f"--budget {args.budget}: {text}; give at most {_fmt_bytes(capacity)} "
                f"({capacity} bytes), or 0 for the whole device")
    return f"{'--config' if args.config else 'the config'} {config_path}: {text}"


def _out_of_budget(e, step: int, last) -> str:
    """The message of a step that ran out of the device budget; tidal-train stops
    there (the engine would go on with the next batch, which has the same shape).
    `last`: the run's newest checkpoint, None if it has none."""
    text = str(e).strip().removesuffix("; the engine goes on with the next batch")
    kept = (f"{last} is intact and --resume {last} continues from it" if last is not None
            else "the run has no checkpoint")
    return (f"step {step + 1}: {text}; tidal-train stops here, {kept}; --budget raises the device "
            f"budget, --batch lowers the micro batch")


def main(argv=None) -> int:
    """The tidal-train console script: run(argv), exit status 0; a failure is one
    line on stderr and a nonzero status (Note [One line per failure])."""
    with one_line_warnings("tidal-train"):
        run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
