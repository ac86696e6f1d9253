#!/usr/bin/env python3
"""Fine-tune a local Hugging Face causal LM with tidal, then save it back.

    python scripts/finetune_hf.py MODEL_DIR --out OUT_DIR [--steps 50] [--config tidal.json]

MODEL_DIR is what `save_pretrained` wrote (config.json and model.safetensors,
sharded or not, or pytorch_model.bin). The model is built straight into
chunks (tidal.init_context), the weights are streamed in tensor by tensor
(engine.load_pretrained), it trains, and OUT_DIR gets `save_pretrained`-
compatible weights and the config, so `AutoModelForCausalLM.from_pretrained(OUT_DIR)`
loads the result.

Data as tidal-train's (tidal.data.options): by default byte-level text made
from the Python standard library's docstrings (--data synthetic for a bigram
table); --data PATH for a text file, a folder of text files, a JSONL file
with a "text" field or a *.bin of token ids, with --tokenizer DIR (often
MODEL_DIR itself) for a local Hugging Face tokenizer, whose vocabulary must
fit the model's vocab_size. --eval-every N prints the loss on the held-out
split (the last --eval-fraction of the tokens), --save-every N --save-dir DIR
writes checkpoints, --resume DIR continues one bit for bit. Nothing is
downloaded.

    python scripts/finetune_hf.py my_llama --out tuned --data corpus.jsonl \
        --tokenizer my_llama --eval-every 10 --save-every 25 --save-dir ckpt

The tidal config (--config) is a DeepSpeed-style JSON file; the default is
configs/gpt_gpu.json on a GPU and configs/gpt_sim.json without one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import tidal
from tidal.data import DataError, load_tokenizer
from tidal.data import options as data_options
from tidal.train import default_config_path


def main(argv=None) -> dict:
    """Fine-tunes as the command line says; returns the losses, validation losses,
    checkpoints and the files written.

    Args:
        argv: the arguments (default: sys.argv[1:]); errors exit with status 2.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, help="a save_pretrained directory")
    ap.add_argument("--out", type=Path, required=True, help="where to save the fine-tuned model")
    ap.add_argument("--config", type=Path, default=None, help="tidal config JSON")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=None, help="overrides the config's optimizer lr")
    ap.add_argument("--seed", type=int, default=0)
    data_options.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    data_options.check_arguments(ap, args)
    import transformers

    try:
        hf_config = transformers.AutoConfig.from_pretrained(args.model_dir)
    except (OSError, ValueError) as e:
        ap.error(f"{args.model_dir} is not a save_pretrained directory: {e}")
    gpu = tidal.get_device().info()["backend"] == "cuda"
    config_path = args.config or default_config_path(False, gpu)
    config = json.loads(Path(config_path).read_text())
    if args.lr is not None:
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    micro = tidal.Config.load(config).micro_batch_size or 1
    seq = min(args.seq, getattr(hf_config, "max_position_embeddings", args.seq))

    # The data before the model, so a bad file fails fast.
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        data = data_options.open_batches(
            args, tokenizer, hf_config.vocab_size, f"vocab_size in {args.model_dir}/config.json",
            seq, micro, "cpu", log=lambda line: print(f"[finetune] {line}", flush=True))
    except DataError as e:
        ap.error(str(e))
    if args.eval_every and not data.has_eval:
        ap.error("--eval-every needs a held-out split: --eval-fraction > 0 or --eval-data")
    if args.tokenizer is None and args.data not in data_options.BUILTIN and any(
            (args.model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        print(f"[finetune] note: training byte-level, although {args.model_dir} has a tokenizer; "
              f"--tokenizer {args.model_dir} uses it", flush=True)

    torch.manual_seed(args.seed)
    with tidal.init_context(config):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    engine = tidal.initialize(model)
    missing, unexpected = engine.load_pretrained(args.model_dir)
    print(f"[finetune] {type(model).__name__} from {args.model_dir}: "
          f"{sum(r.numel for r in engine.records) / 1e6:.1f}M parameters in chunks; "
          f"missing {len(missing)}, unexpected {len(unexpected)} keys", flush=True)

    data.device = engine.store.torch_device
    _, first = data_options.resume_from_args(ap, args, engine, data, args.steps,
                                             say=lambda line: print(f"[finetune] {line}", flush=True))
    save_dir = data_options.save_dir_of(args)

    def forward(x, _y):
        return engine(input_ids=x, labels=x).loss  # the head shifts the labels itself

    losses, evals, saved = [], [], []
    for step in range(first, args.steps):
        x, y = next(data)
        loss = forward(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"[finetune] step {step:4d}  loss {losses[-1]:.4f}", flush=True)
        done = step + 1
        if args.eval_every and (done % args.eval_every == 0 or done == args.steps):
            evals.append({"step": done, "loss": data_options.evaluate(engine, forward, data)})
            print(f"[finetune] step {step:4d}  validation loss {evals[-1]['loss']:.4f}", flush=True)
        if args.save_every and (done % args.save_every == 0 or done == args.steps):
            saved.append(str(data_options.save(engine, save_dir, done, data)))
            print(f"[finetune] step {step:4d}  saved {saved[-1]}", flush=True)
    files = engine.save_pretrained(args.out)
    print(f"[finetune] loss {losses[0]:.4f} -> {losses[-1]:.4f}; wrote "
          f"{', '.join(f.name for f in files)} to {args.out}", flush=True)
    return {"losses": losses, "files": [str(f) for f in files], "missing": missing,
            "unexpected": unexpected, "start_step": first, "eval": evals, "checkpoints": saved}


if __name__ == "__main__":
    main()
    sys.exit(0)
