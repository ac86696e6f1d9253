"""DeepSpeed's own example scripts run with only their imports changed
(`import tidal.deepspeed as deepspeed`, `tidal.deepspeed.comm`, ...), and train
what plain PyTorch trains under DeepSpeed 0.19.8's meaning of their configs.

The four scripts of issue 42, DeepSpeedExamples' CIFAR-10 tutorial
(training/cifar/cifar10_deepspeed.py), HelloDeepSpeed's BERT
(training/HelloDeepSpeed/train_bert_ds.py), DeepSpeed-Chat's step 1 SFT
(applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py and
dschat/utils) and the SuperOffload ZeRO-3 + CPU offload fine-tune
(training/DeepSpeed-SuperOffload/finetune_zero3.py), are written here in their
shape: their argument parsing, launcher handling, config, DeepSpeed calls,
logging arithmetic and loops, with tiny models and synthetic data instead of
downloads. What each uses of DeepSpeed is called as the script calls it; the
reference is plain PyTorch doing what DeepSpeed does with that config
(DeepSpeed's rules cited where they matter: "Adam" is AdamW, gradient
clipping defaults to 1.0, bf16 casts the model before the fp32 masters are
made, a resumed run keeps the process's RNG)."""
import argparse
import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tidal
import tidal.deepspeed as deepspeed
import tidal.deepspeed.comm as dist
from tidal.deepspeed.accelerator import get_accelerator
from tidal.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from tidal.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from tidal.engine.errors import UsageError

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import within_budget  # noqa: E402

# tidal's notes on the DeepSpeed keys it does not use (ZeRO buckets, offload
# flags, tensorboard, ...) are expected: these configs are DeepSpeed's.
pytestmark = pytest.mark.filterwarnings("ignore:config key")


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


class MixedPrecision:
    """Plain PyTorch with DeepSpeed's meaning of bf16 (or fp32) training: the
    model computes in `dtype`; fp32 masters, made from the `dtype` values, take
    `make_optimizer`'s step on gradients upcast to fp32 and clipped to `clip`
    by their global norm; the model's weights are the masters rounded."""

    def __init__(self, model, dtype, make_optimizer, clip=1.0):
        self.model = model.to(dtype)
        self.masters = {id(p): torch.nn.Parameter(p.detach().float().clone())
                        for p in model.parameters()}
        self.pairs = [(p, self.masters[id(p)]) for p in model.parameters()]
        self.optimizer = make_optimizer(self.master)
        self.clip = clip

    def master(self, params):
        return [self.masters[id(p)] for p in params]

    def step(self):
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs], self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)

    def fp32(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: m.detach() for p, m in self.pairs}


def assert_close_losses(losses, ref_losses, rel):
    assert len(losses) == len(ref_losses) > 0
    assert all(math.isclose(a, b, rel_tol=rel) for a, b in zip(losses, ref_losses)), \
        (losses, ref_losses)


# An attention key's bias shifts every score of a query alike, which softmax
# cancels: its gradient is rounding noise, which Adam turns into full steps of
# either sign. Its weights are no test of the trainer.
KEY_BIAS = "k_proj.bias"


def assert_close_weights(weights, ref, rel, skip=None):
    for key, p in ref.items():
        if skip is not None and skip in key:
            continue
        err = ((weights[key] - p).norm() / p.norm()).item()
        assert err <= rel, f"{key}: relative L2 error {err:.3g}"


def deepspeed_count(model):
    """DeepSpeed-Chat's print_throughput and SuperOffload's get_parameter_count."""
    return sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())


# --- 1. The CIFAR-10 tutorial (its current version: the accelerator, a barrier
# around the download, MoE options, the dtype from the engine) ------------------

class Images(torch.utils.data.Dataset):
    def __init__(self, n=24):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 3, 10, 10, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class CifarNet(torch.nn.Module):
    """The tutorial's Net, shrunk, smooth (tanh, average pooling: a last-bit
    difference cannot flip a ReLU or a max), with its --moe branch."""

    def __init__(self, args):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 3)
        self.conv2 = torch.nn.Conv2d(6, 8, 3)
        self.fc1 = torch.nn.Linear(8 * 2 * 2, 24)
        self.fc2 = torch.nn.Linear(24, 16)
        self.moe = args.moe
        if self.moe:
            fc3 = torch.nn.Linear(16, 16)
            self.moe_layer_list = torch.nn.ModuleList([deepspeed.moe.layer.MoE(
                hidden_size=16, expert=fc3, num_experts=n, ep_size=args.ep_world_size,
                use_residual=False, k=args.top_k, min_capacity=args.min_capacity)
                for n in args.num_experts])
        self.fc4 = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = F.avg_pool2d(torch.tanh(self.conv1(x)), 2)
        x = torch.tanh(self.conv2(x)).flatten(1)
        x = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.fc4(x)


def cifar_args(argv):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-e", "--epochs", default=1, type=int)
    parser.add_argument("--log-interval", type=int, default=2000)
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--ep-world-size", default=1, type=int)
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1])
    parser.add_argument("--top-k", default=1, type=int)
    parser.add_argument("--min-capacity", default=0, type=int)
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def cifar_config(args):
    return {
        "train_batch_size": 4, "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 4}},
        "gradient_clipping": 1.0, "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False,
                 "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                 "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True,
                              "reduce_scatter": True, "allgather_bucket_size": 50000000,
                              "reduce_bucket_size": 50000000, "overlap_comm": True,
                              "contiguous_gradients": True, "cpu_offload": False},
        "tidal": {"chunk_size": 4096, "device_margin": 1024},
    }


def test_the_cifar10_tutorial_under_a_one_rank_launcher(one_rank_launcher):
    args = cifar_args(["--deepspeed", "--dtype", "fp32", "--stage", "0", "--moe-param-group",
                       "--local_rank", "0"])
    deepspeed.init_distributed()
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()  # (rank 0 downloads first)
    trainset = Images()
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()
    torch.manual_seed(0)
    net = CifarNet(args)
    ref_model = CifarNet(args)
    ref_model.load_state_dict(net.state_dict())
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
            {"params": list(parameters), "name": "parameters"})
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset,
        config=cifar_config(args))
    one_rank_launcher.append(model_engine)
    assert torch.distributed.get_world_size() == model_engine.world_size == 1
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else \
        torch.half if model_engine.fp16_enabled() else None
    assert target_dtype is None and local_rank == 0
    criterion = torch.nn.CrossEntropyLoss()
    seen, losses = [], []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            seen.append((inputs, labels))
            losses.append(loss.item())
    assert len(seen) == 6 and model_engine.global_steps == 6
    # Plain PyTorch: "Adam" with weight decay is AdamW; WarmupLR's logarithmic warm-up
    # (lr = max * log(i + 1) / log(n), i from -1 counting applied steps); clipping 1.0.
    ref = MixedPrecision(ref_model, torch.float32, lambda master: torch.optim.AdamW(
        master(ref_model.parameters()), lr=0.0, betas=(0.8, 0.999), eps=1e-8,
        weight_decay=3e-7))
    ref_losses = []
    for k, (x, y) in enumerate(seen):
        i = k - 1
        ref.optimizer.param_groups[0]["lr"] = 0.0 if i < 0 else \
            0.01 * (math.log(i + 1) / math.log(4) if i < 4 else 1.0)
        loss = criterion(ref.model(x), y)
        loss.backward()
        ref.step()
        ref_losses.append(loss.item())
    assert_close_losses(losses, ref_losses, rel=1e-5)
    assert_close_weights(model_engine.parameters_fp32(), ref.fp32(), rel=1e-5)
    within_budget(model_engine)


def test_the_cifar10_tutorials_moe_option_is_refused_by_name():
    args = cifar_args(["--deepspeed", "--moe", "--num-experts", "2"])
    with pytest.raises(UsageError, match="tidal.deepspeed.moe.layer.MoE: tidal has no "
                                         "mixture-of-experts layers"):
        CifarNet(args)


# --- 2. HelloDeepSpeed's BERT, trained, saved and resumed ----------------------

VOCAB, PAD, MASK = 40, 0, 1


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n=24, seq=12):
        g = torch.Generator().manual_seed(21)
        self.tokens = torch.randint(2, VOCAB, (n, seq), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i]


def mlm_collate(rows, mask_prob=0.15):
    """HelloDeepSpeed's masking_function in shape: random positions masked with
    the process's RNG; the loss is taken where masked."""
    src = torch.stack(rows)
    chosen = torch.rand(src.shape) < mask_prob
    chosen[:, 0] = True  # (every row predicts something)
    tgt = torch.where(chosen, src, torch.full_like(src, PAD))
    return {"src_tokens": torch.where(chosen, torch.full_like(src, MASK), src),
            "attention_mask": torch.ones_like(src), "tgt_tokens": tgt}


def create_data_iterator(batch_size):
    loader = torch.utils.data.DataLoader(TokenData(), batch_size=batch_size, shuffle=True,
                                         collate_fn=mlm_collate)

    def forever():
        while True:
            yield from loader
    return forever()


class Encoder(torch.nn.Module):
    """A small BERT: embeddings, pre-norm self-attention and feed-forward
    blocks with dropout (HelloDeepSpeed's RobertaMLMModel, shrunk)."""

    def __init__(self, h=16, layers=2, dropout=0.1):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, h)
        self.pos = torch.nn.Embedding(16, h)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            # (no bias: a key bias gets only rounding noise as its gradient, which Adam
            # would turn into full steps of either sign)
            "ln1": torch.nn.LayerNorm(h), "qkv": torch.nn.Linear(h, 3 * h, bias=False),
            "out": torch.nn.Linear(h, h), "ln2": torch.nn.LayerNorm(h),
            "ff1": torch.nn.Linear(h, 2 * h), "ff2": torch.nn.Linear(2 * h, h)})
            for _ in range(layers))
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(h, VOCAB)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        x = self.tok(src_tokens) + self.pos(torch.arange(src_tokens.shape[1]))
        bias = (1.0 - attention_mask[:, None, :].float()) * -1e4
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).chunk(3, dim=-1)
            att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]) + bias, dim=-1)
            x = x + self.drop(b["out"](att @ v))
            x = x + self.drop(b["ff2"](F.gelu(b["ff1"](b["ln2"](x)))))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), tgt_tokens.flatten(), ignore_index=PAD)


def hello_train(exp_dir, load_checkpoint_dir=None, num_iterations=7, checkpoint_every=3,
                batch_size=4, local_rank=-1):
    """HelloDeepSpeed's train(): its ds_config, initialize, load_checkpoint of the
    client state, the loop from start_step and a checkpoint every checkpoint_every."""
    torch.manual_seed(42)  # (the script's __main__)
    device = (torch.device(get_accelerator().device_name(), local_rank)
              if (local_rank > -1) and get_accelerator().is_available() else torch.device("cpu"))
    data_iterator = create_data_iterator(batch_size)
    model = Encoder()
    ds_config = {"train_micro_batch_size_per_gpu": batch_size,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                 "bf16": {"enabled": False},
                 "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
                 "tidal": {"chunk_size": 8192, "device_margin": 1024}}
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config)
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        start_step = client_state["checkpoint_step"] + 1
    model.train()
    losses = []
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    return model, losses


def plain_hello(state=None, num_iterations=7, checkpoint_every=3, start_step=1):
    """The same run in plain PyTorch with DeepSpeed's meaning: AdamW (type Adam,
    adam_w_mode by default) at lr 1e-2, weight decay 0 (DeepSpeedCPUAdam's default),
    clipping 1.0; a resumed run loads weights and Adam states and keeps the RNG."""
    torch.manual_seed(42)
    data_iterator = create_data_iterator(4)
    model = Encoder()
    ref = MixedPrecision(model, torch.float32,
                         lambda master: torch.optim.AdamW(master(model.parameters()), lr=1e-2,
                                                          weight_decay=0.0))
    if state is not None:
        model.load_state_dict(state["model"])
        for p, m in ref.pairs:
            m.data.copy_(p.data)
        ref.optimizer.load_state_dict(state["optimizer"])
    model.train()
    losses, saved = [], None
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        loss = model(**batch)
        loss.backward()
        ref.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            saved = {"model": copy.deepcopy(model.state_dict()),
                     "optimizer": copy.deepcopy(ref.optimizer.state_dict()), "step": step}
    return ref, losses, saved


def test_hellodeepspeeds_bert_trains_and_resumes_as_under_deepspeed(tmp_path):
    first, losses = hello_train(tmp_path, num_iterations=5)
    ref, ref_losses, saved = plain_hello(num_iterations=5)
    assert_close_losses(losses, ref_losses, rel=1e-5)
    assert_close_weights(first.parameters_fp32(), ref.fp32(), rel=1e-5)
    assert saved["step"] == 3 and (tmp_path / "global_step3").is_dir()
    # HelloDeepSpeed's log line counts the parameters by numel(): the number, as
    # DeepSpeed's ZeRO-3 count and the engine's (the placeholders answer their
    # shapes: Note [A parameter object stays the user's]).
    count = sum(p.numel() for p in ref.model.parameters())
    assert sum(p.numel() for p in first.module.parameters()) == count
    assert deepspeed_count(first.module) == first.num_parameters() == count
    # Resumed from global_step3 in a fresh run (the script's load_checkpoint_dir):
    # DeepSpeed's load_checkpoint leaves the RNG where the script's seed and model
    # left it, so the shuffle, the masks and the dropout are the plain resumed run's.
    assert (tmp_path / "latest").read_text().strip() == "global_step3"
    resumed, more = hello_train(tmp_path, load_checkpoint_dir=tmp_path, num_iterations=8)
    ref_resumed, ref_more, _ = plain_hello(saved, num_iterations=8, start_step=4)
    assert len(more) == 4
    assert_close_losses(more, ref_more, rel=1e-5)
    assert_close_weights(resumed.parameters_fp32(), ref_resumed.fp32(), rel=1e-5)
    within_budget(resumed)


# --- 3. DeepSpeed-Chat step 1 (supervised fine-tuning) --------------------------

def chat_args(argv):
    """main.py's parse_args, the arguments this shape reads."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--max_seq_len", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=str, default="cosine")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--dropout", type=float, default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", type=str, default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--lora_learning_rate", type=float, default=5e-4)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def get_train_ds_config(offload, dtype, stage=2):
    """dschat/utils/ds_utils.py's config, in shape."""
    device = "cpu" if offload else "none"
    data_type = "fp16" if dtype == "fp16" else "bfloat16"
    dtype_config = {"enabled": True, "loss_scale_window": 100} if dtype == "fp16" else \
        {"enabled": True}
    return {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "overlap_comm": True,
                              "offload_param": {"device": device},
                              "offload_optimizer": {"device": device},
                              "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7,
                              "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        data_type: dtype_config, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True,
                          "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"},
    }


def get_optimizer_grouped_parameters(model, weight_decay, lora_lr=5e-4,
                                     no_decay_name_list=("bias", "layer_norm.weight",
                                                         "layernorm.weight", "norm.weight",
                                                         "ln_f.weight"),
                                     lora_name_list=("lora_right_weight", "lora_left_weight")):
    """dschat/utils/utils.py's grouping, in shape."""
    groups = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad
                    and not any(nd in n.lower() for nd in lora_name_list)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad
                    and any(nd in n.lower() for nd in lora_name_list)],
         "weight_decay": weight_decay, "lr": lora_lr},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad],
         "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def z3_params_to_fetch(param_list):
    return [p for p in param_list
            if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_zero_three_model(model_ema, global_rank, zero_stage=0):
    """dschat's save_zero_three_model, returning the dict it would torch.save."""
    zero_stage_3 = zero_stage == 3
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    output_state_dict = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(z3_params_to_fetch([v]), enabled=zero_stage_3):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0 and "lora" not in k:
            output_state_dict[k] = v_p.clone()
    return output_state_dict


class ChatData(torch.utils.data.Dataset):
    """create_prompt_dataset's items, synthetic: input_ids, attention_mask, labels."""

    def __init__(self, n, seq=8, vocab=64, seed=31):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.ids[i]}


def create_hf_model(dropout):
    """dschat's create_hf_model for a causal LM (OPT, its default family), from a
    config instead of a download."""
    from transformers import OPTConfig, OPTForCausalLM
    config = OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=32,
                       dropout=dropout, attention_dropout=dropout, activation_dropout=dropout)
    model = OPTForCausalLM(config)
    model.config.end_token_id = 0
    model.config.pad_token_id = model.config.eos_token_id
    return model


@pytest.mark.parametrize("offload", [False, True], ids=["FusedAdam", "DeepSpeedCPUAdam"])
def test_deepspeed_chat_step1_sft_under_a_one_rank_launcher(one_rank_launcher, offload):
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import default_data_collator, get_scheduler, set_seed
    argv = ["--local_rank", "0", "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "2", "--learning_rate", "2e-3",
            "--weight_decay", "0.1", "--num_warmup_steps", "1", "--dtype", "bf16",
            "--zero_stage", "2", "--dropout", "0.0", "--max_seq_len", "8", "--deepspeed"]
    args = chat_args(argv + (["--offload"] if offload else []))
    get_accelerator().set_device(args.local_rank)
    device = torch.device(get_accelerator().device_name(), args.local_rank)
    deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = args.per_device_train_batch_size * \
        torch.distributed.get_world_size() * args.gradient_accumulation_steps
    ds_config["tidal"] = {"chunk_size": 16384, "device_margin": 1024}
    # set_random_seed
    set_seed(args.seed)
    torch.manual_seed(args.seed)
    get_accelerator().manual_seed_all(args.seed)
    torch.distributed.barrier()
    model = create_hf_model(args.dropout)
    ref_model = create_hf_model(args.dropout)
    ref_model.load_state_dict(model.state_dict())
    train_dataset, eval_dataset = ChatData(10), ChatData(4, seed=32)
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator,
                                  sampler=DistributedSampler(train_dataset),
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 sampler=DistributedSampler(eval_dataset),
                                 batch_size=args.per_device_eval_batch_size)

    def evaluation(model, eval_dataloader):
        model.eval()
        losses = 0
        for step, batch in enumerate(eval_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.no_grad():
                outputs = model(**batch)
            losses += outputs.loss.float()
        losses = losses / (step + 1)
        # get_all_reduce_mean
        torch.distributed.all_reduce(losses, op=torch.distributed.ReduceOp.SUM)
        losses = losses / torch.distributed.get_world_size()
        return torch.exp(losses).item(), losses.item()

    optimizer_grouped_parameters = get_optimizer_grouped_parameters(
        model, args.weight_decay, args.lora_learning_rate)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(optimizer_grouped_parameters, lr=args.learning_rate,
                              betas=(0.9, 0.95))
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) /
                                           args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs *
                                 num_update_steps_per_epoch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, args=args, config=ds_config, lr_scheduler=lr_scheduler,
        dist_init_required=True)
    one_rank_launcher.append(model)
    perplexity, eval_loss = evaluation(model, eval_dataloader)
    seen, losses, counted = [], [], []
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            model.backward(loss)
            model.step()
            seen.append(batch)
            losses.append(loss.item())
            if torch.distributed.get_rank() == 0:  # print_throughput's parameter count
                counted.append(deepspeed_count(model.model))
        end_perplexity, end_loss = evaluation(model, eval_dataloader)
        model.tput_timer.update_epoch_count()
    assert model.tput_timer.epoch_count == 1 and len(seen) == 5
    # Plain PyTorch: bf16 model, fp32 masters from the bf16 values (DeepSpeed casts the
    # model first), AdamW (both classes' default adamw mode) over the same groups,
    # transformers' cosine schedule stepped after each step, clipping 1.0.
    ref = MixedPrecision(ref_model, torch.bfloat16, lambda master: torch.optim.AdamW(
        [dict(g, params=master(g["params"])) for g in
         get_optimizer_grouped_parameters(ref_model, args.weight_decay)],
        lr=args.learning_rate, betas=(0.9, 0.95)))
    ref_sched = get_scheduler(name=args.lr_scheduler_type, optimizer=ref.optimizer,
                              num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=num_update_steps_per_epoch)

    def ref_eval():
        with torch.no_grad():
            ref.model.eval()
            out = sum(ref.model(**b).loss.float() for b in eval_dataloader) / len(eval_dataloader)
        return out.item()

    assert eval_loss == pytest.approx(ref_eval(), rel=1e-6)
    ref.model.train()
    ref_losses = []
    for batch in seen:
        loss = ref.model(**batch, use_cache=False).loss
        loss.backward()
        ref.step()
        ref_sched.step()
        ref_losses.append(loss.item())
    assert_close_losses(losses, ref_losses, rel=1e-4)
    assert_close_weights(model.parameters_fp32(), ref.fp32(), rel=1e-3, skip=KEY_BIAS)
    assert end_loss == pytest.approx(ref_eval(), rel=1e-4)
    assert model.get_lr() == pytest.approx([g["lr"] for g in ref.optimizer.param_groups])
    assert counted == [sum(p.numel() for p in ref_model.parameters())] * 5
    # save_hf_format's model.module.state_dict() and save_zero_three_model's gathered
    # weights: the 16-bit weights the model computes with.
    hf_format = model.module.state_dict()
    zero3 = save_zero_three_model(model, args.global_rank, zero_stage=3)
    for name, p in ref.model.named_parameters():
        assert torch.equal(zero3[name], hf_format[name]), name
        assert zero3[name].dtype == torch.bfloat16, name
    assert_close_weights({k: v.float() for k, v in zero3.items()},
                         {n: p.detach().float() for n, p in ref.model.named_parameters()},
                         rel=5e-3, skip=KEY_BIAS)
    within_budget(model)


def test_deepspeed_chats_zero3_model_loading_names_tidals_way():
    # create_hf_model builds HfDeepSpeedConfig(ds_config) under ZeRO-3, which needs the
    # real DeepSpeed package; the error says what to do with tidal instead.
    from transformers.integrations import HfDeepSpeedConfig
    with pytest.raises(UsageError, match="drop it and build the model as it is"):
        HfDeepSpeedConfig(get_train_ds_config(offload=True, dtype="bf16", stage=3))


# --- 4. The SuperOffload ZeRO-3 + CPU offload fine-tune -----------------------

def test_the_superoffload_zero3_finetune(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator
    ds_config = {"train_batch_size": 2, "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 3, "overlap_comm": False,
                                       "reduce_bucket_size": 4e8, "sub_group_size": 4e8,
                                       "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                             "ratio": 0.80, "super_offload": True,
                                                             "cpuadam_cores_perc": 0.90}},
                 "wall_clock_breakdown": True,
                 "tidal": {"chunk_size": 65536, "device_margin": 1024}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config))
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--batch_size", type=int, required=True)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--bench_steps", type=int, default=100)
    parser.add_argument("--max_length", type=int, default=2048)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args([f"--deepspeed_config={path}", "--lr", "1e-3", "--batch_size", "2",
                              "--activation_checkpointing", "--bench_steps", "4",
                              "--max_length", "8"])
    torch.manual_seed(42)  # transformers' set_seed(args.seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # from_pretrained(torch_dtype=bfloat16)
    ref_model = LlamaForCausalLM(config).to(torch.bfloat16)
    ref_model.load_state_dict(model.state_dict())
    for m in (model, ref_model):  # setup_model_training
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=0.001, betas=(0.9, 0.999))
    tokenized = [dict(input_ids=row, attention_mask=torch.ones_like(row), labels=row)
                 for row in ChatData(8, seed=41).ids]
    model_engine, optimizer, train_dataloader, _ = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, training_data=tokenized,
        collate_fn=default_data_collator)
    assert dist.get_rank() == 0  # (no launcher: one process, no process group)
    model_engine.train()
    model_size = deepspeed_count(model)
    assert model_size == sum(p.numel() for p in ref_model.parameters())
    seen, losses, global_step = [], [], 0
    for epoch in range(1):
        for step, batch in enumerate(train_dataloader):
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            outputs = model_engine(**batch)
            loss = outputs.loss
            model_engine.backward(loss)
            model_engine.step()
            global_step += 1
            seen.append(batch)
            losses.append(loss.item())
            if global_step >= args.bench_steps:
                break
    assert global_step == 4
    # Plain PyTorch: the bf16 model, fp32 masters from it, DeepSpeedCPUAdam's rule
    # (AdamW, weight decay 0), DeepSpeed's default clipping 1.0.
    ref = MixedPrecision(ref_model, torch.bfloat16, lambda master: torch.optim.AdamW(
        master(ref_model.parameters()), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0))
    ref_losses = []
    ref_model.train()
    for batch in seen:
        loss = ref_model(**batch).loss
        loss.backward()
        ref.step()
        ref_losses.append(loss.item())
    assert_close_losses(losses, ref_losses, rel=1e-5)
    assert_close_weights(model_engine.parameters_fp32(), ref.fp32(), rel=1e-5)
    within_budget(model_engine)
