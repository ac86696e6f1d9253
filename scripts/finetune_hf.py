#!/usr/bin/env python3
"""Fine-tune a local Hugging Face causal LM with tidal, then save it back.

    python scripts/finetune_hf.py MODEL_DIR --out OUT_DIR [--steps 50] [--config tidal.json]

MODEL_DIR is what `save_pretrained` wrote (config.json and model.safetensors,
sharded or not, or pytorch_model.bin). The model is built straight into
chunks (tidal.init_context), the weights are streamed in tensor by tensor
(engine.load_pretrained), it trains on byte-level text made from the Python
standard library's docstrings (nothing is downloaded; --data synthetic for a
bigram table), and OUT_DIR gets `save_pretrained`-compatible weights and the
config, so `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads the result.

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
from tidal.data import DATA_KINDS, batches
from tidal.train import default_config_path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, help="a save_pretrained directory")
    ap.add_argument("--out", type=Path, required=True, help="where to save the fine-tuned model")
    ap.add_argument("--config", type=Path, default=None, help="tidal config JSON")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=None, help="overrides the config's optimizer lr")
    ap.add_argument("--data", choices=DATA_KINDS, default="text")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
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

    torch.manual_seed(args.seed)
    with tidal.init_context(config):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    engine = tidal.initialize(model)
    missing, unexpected = engine.load_pretrained(args.model_dir)
    print(f"[finetune] {type(model).__name__} from {args.model_dir}: "
          f"{sum(r.numel for r in engine.records) / 1e6:.1f}M parameters in chunks; "
          f"missing {len(missing)}, unexpected {len(unexpected)} keys", flush=True)

    data = batches(args.data, hf_config.vocab_size, seq, micro, engine.store.torch_device,
                   seed=args.seed)
    losses = []
    for step in range(args.steps):
        x, _ = next(data)
        loss = engine(input_ids=x, labels=x).loss  # the head shifts the labels itself
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"[finetune] step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    files = engine.save_pretrained(args.out)
    print(f"[finetune] loss {losses[0]:.4f} -> {losses[-1]:.4f}; wrote "
          f"{', '.join(f.name for f in files)} to {args.out}", flush=True)
    return {"losses": losses, "files": [str(f) for f in files], "missing": missing,
            "unexpected": unexpected}


if __name__ == "__main__":
    main()
    sys.exit(0)
