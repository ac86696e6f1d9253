"""tidal.integrations.TidalTrainer: Hugging Face's Trainer on tidal, end to end.

A small Llama built from a config learns text (Python's own docstrings,
tidal.data.text_corpus) through a BPE tokenizer trained here with the
`tokenizers` package and saved as a PreTrainedTokenizerFast; nothing is
downloaded. The independent reference is the same recipe under
transformers.Trainer itself, with torch.optim.AdamW and the Trainer's own
clipping, schedule, evaluation and checkpoints. The filling of "auto" values
is checked against transformers' own code for DeepSpeed configs
(HfTrainerDeepSpeedConfig) on its ZeRO-2/ZeRO-3 templates.
"""
import copy
import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
accelerate_deepspeed = pytest.importorskip("accelerate.utils.deepspeed")

import tidal  # noqa: E402
from tidal.data import text_corpus  # noqa: E402
from tidal.integrations import TidalTrainer, trainer_config  # noqa: E402
from engine_helpers import raw_numel  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
SEQ, TRAIN_BLOCKS, EVAL_BLOCKS = 32, 64, 16
STEPS, SAVE_STEPS = 24, 8
# Chunks of 128 KiB and a 2 MiB device budget for a 0.5 MB fp32 model: part of
# the chunks stays on the host (CPU Adam), part on the device (hybrid Adam).
TIDAL = {"tidal": {"chunk_size": "128KiB", "device_memory_budget": "2MiB",
                   "device_margin": "64KiB"}}


@pytest.fixture(scope="module", autouse=True)
def simulated_device():
    previous = tidal.get_device()
    tidal.set_device("sim", capacity="1GiB")
    transformers.logging.set_verbosity_error()
    yield
    tidal._C.set_default_device(previous)


@pytest.fixture(autouse=True)
def accelerate_precision_unset(monkeypatch):
    """TrainingArguments(fp16/bf16=True) writes ACCELERATE_MIXED_PRECISION into the
    process's environment, and later TrainingArguments without them keep it: each
    test starts without it, and leaves the environment as it found it."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        ids = torch.tensor(self.blocks[i])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A BPE tokenizer trained here, saved and reloaded as a Hugging Face tokenizer, and
    the corpus in blocks of SEQ tokens: (tokenizer, train set, eval set)."""
    text = text_corpus()[:200_000].decode("utf-8", errors="ignore")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(text.split("\n\n"), tokenizers.trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    directory = tmp_path_factory.mktemp("tokenizer")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>").save_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= SEQ * (TRAIN_BLOCKS + EVAL_BLOCKS)
    blocks = [ids[i * SEQ:(i + 1) * SEQ] for i in range(TRAIN_BLOCKS + EVAL_BLOCKS)]
    return tokenizer, Blocks(blocks[:TRAIN_BLOCKS]), Blocks(blocks[TRAIN_BLOCKS:])


def llama(tokenizer):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))


def training_args(output_dir, **overrides):
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=STEPS,
                  learning_rate=3e-3, warmup_steps=4, weight_decay=0.1, max_grad_norm=1.0,
                  optim="adamw_torch", logging_steps=1, eval_strategy="steps", eval_steps=12,
                  per_device_eval_batch_size=8, save_strategy="no", report_to=[], use_cpu=True,
                  seed=0, disable_tqdm=True)
    values.update(overrides)
    return transformers.TrainingArguments(**values)


class Recording:
    """Keeps each micro-batch's loss as training_step returns it (the Trainer logs
    it rounded to 4 decimals)."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.item())
        return loss


class ReferenceTrainer(Recording, transformers.Trainer):
    pass


class RecordingTidalTrainer(Recording, TidalTrainer):
    pass


def run(trainer_class, data, args, resume=None, **kwargs):
    tokenizer, train, evaluation = data
    trainer = trainer_class(model=llama(tokenizer), args=args, train_dataset=train,
                            eval_dataset=evaluation, processing_class=tokenizer,
                            data_collator=transformers.default_data_collator, **kwargs)
    trainer.losses = []
    before = trainer.evaluate()["eval_loss"] if resume is None else None
    trainer.train(resume_from_checkpoint=resume)
    return types.SimpleNamespace(
        trainer=trainer, losses=trainer.losses, eval_before=before,
        eval_after=trainer.evaluate()["eval_loss"],
        logs=[e for e in trainer.state.log_history if "loss" in e],
        evals=[e for e in trainer.state.log_history if "eval_loss" in e])


def final_weights(result):
    if isinstance(result.trainer, TidalTrainer):
        return result.trainer.engine.state_dict()
    return {k: v.detach().clone() for k, v in result.trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    return run(ReferenceTrainer, data, training_args(tmp_path_factory.mktemp("reference")))


@pytest.fixture(scope="module")
def tidal_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("tidal")
    return run(RecordingTidalTrainer, data,
               training_args(out, save_strategy="steps", save_steps=SAVE_STEPS, save_total_limit=2),
               tidal_config=TIDAL)


def assert_close(ours, theirs, rel):
    assert len(ours) == len(theirs), (ours, theirs)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    assert worst <= rel, (worst, ours, theirs)


# --------------------------------------------------------------- training
def test_loss_falls_as_under_the_plain_trainer(reference, tidal_run):
    assert len(tidal_run.losses) == STEPS
    assert sum(tidal_run.losses[-4:]) / 4 < sum(tidal_run.losses[:4]) / 4 - 0.5, tidal_run.losses
    # fp32: tidal's SIMD Adam against torch.optim.AdamW, the engine's global-norm
    # clipping against torch's clip_grad_norm_.
    assert_close(tidal_run.losses, reference.losses, 1e-5)
    engine = tidal_run.trainer.engine
    assert engine.global_steps == STEPS
    report = engine.memory_report()
    # The chunk room at the activation peak holds the 16-bit chunks but no
    # states: hybrid Adam's plan updates them on the host (Note [Where a
    # chunk's Adam runs]), and the chunks move.
    assert report["adam_chunks_on_host"] > 0, report
    assert report["bytes_device_to_host_last_step"] > 0, report


def test_the_trainer_logs_loss_grad_norm_and_lr(reference, tidal_run):
    assert [e["step"] for e in tidal_run.logs] == list(range(1, STEPS + 1))
    assert [e["loss"] for e in tidal_run.logs] == [round(x, 4) for x in tidal_run.losses]
    # grad_norm: engine.get_global_grad_norm(), the norm before clipping, as the
    # Trainer logs torch's clip_grad_norm_ result.
    assert_close([e["grad_norm"] for e in tidal_run.logs],
                 [e["grad_norm"] for e in reference.logs], 1e-4)
    assert [e["learning_rate"] for e in tidal_run.logs] == \
        [e["learning_rate"] for e in reference.logs]
    assert any(e["grad_norm"] > 1.0 for e in reference.logs)  # (clipping did something)


def test_evaluate_reports_the_plain_trainers_eval_loss(reference, tidal_run):
    assert tidal_run.eval_before == reference.eval_before  # same weights, same forward
    assert [e["step"] for e in tidal_run.evals] == [12, 24, 24]  # eval_steps=12, evaluate()
    assert_close([e["eval_loss"] for e in tidal_run.evals],
                 [e["eval_loss"] for e in reference.evals], 1e-5)
    assert_close([tidal_run.eval_after], [reference.eval_after], 1e-5)
    assert tidal_run.eval_after < tidal_run.eval_before - 0.5


def test_gradient_accumulation_of_two(data, tmp_path):
    args = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=8,
                eval_strategy="no")
    ref = run(ReferenceTrainer, data, training_args(tmp_path / "ref", **args))
    ours = run(RecordingTidalTrainer, data, training_args(tmp_path / "tidal", **args),
               tidal_config=TIDAL)
    assert ours.trainer.tidal_config["gradient_accumulation_steps"] == 2
    assert ours.trainer.engine.global_steps == 8 and ours.trainer.engine.micro_steps == 16
    assert_close(ours.losses, ref.losses, 1e-5)  # each micro-batch's (normalised) loss
    # The logged loss sums the window's two micro-batch losses, as the Trainer's.
    assert_close([e["loss"] for e in ours.logs], [e["loss"] for e in ref.logs], 1e-4)
    assert_close([e["grad_norm"] for e in ours.logs], [e["grad_norm"] for e in ref.logs], 1e-4)
    assert_close(list(map(float, ours.trainer.engine.state_dict()["lm_head.weight"].flatten())),
                 list(map(float, final_weights(ref)["lm_head.weight"].flatten())), 1e-3)


# ----------------------------------------------------- checkpoints, saving
def test_save_steps_keep_the_last_two_checkpoints(tidal_run):
    out = Path(tidal_run.trainer.args.output_dir)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-16", "checkpoint-24"]
    for n in (16, 24):
        folder = out / f"checkpoint-{n}"
        assert (folder / "latest").read_text().strip() == f"global_step{n}"
        for name in ("model.safetensors", "config.json", "trainer_state.json", "rng_state.pth",
                     "scheduler.pt", f"global_step{n}/meta.json"):
            assert (folder / name).is_file(), name


def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(data, tidal_run, tmp_path):
    """The run stopped at step 16 (its newest checkpoint copied to a fresh output
    folder) and resumed with resume_from_checkpoint=True trains steps 17..24 with
    the same losses, bit for bit, and ends with the same weights."""
    source = Path(tidal_run.trainer.args.output_dir) / "checkpoint-16"
    shutil.copytree(source, tmp_path / "checkpoint-16")
    resumed = run(RecordingTidalTrainer, data,
                  training_args(tmp_path, save_strategy="steps", save_steps=SAVE_STEPS,
                                save_total_limit=2),
                  resume=True, tidal_config=TIDAL)
    assert resumed.losses == tidal_run.losses[16:]
    # (the Trainer's state restores the log of steps 1..16 from the checkpoint)
    assert resumed.logs == tidal_run.logs
    assert resumed.trainer.engine.global_steps == STEPS
    expected = final_weights(tidal_run)
    for name, value in final_weights(resumed).items():
        assert torch.equal(value, expected[name]), name


def test_save_model_loads_with_from_pretrained(data, reference, tidal_run, tmp_path):
    tokenizer, _, evaluation = data
    trainer = tidal_run.trainer
    trainer.save_model(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    masters = trainer.engine.state_dict()  # fp32 master weights
    state = loaded.state_dict()
    assert set(state) == set(masters)
    for name, value in state.items():
        assert value.dtype == torch.float32 and torch.equal(value, masters[name]), name
    # The trained weights: close to the plain Trainer's (AdamW, 24 steps, fp32).
    theirs = final_weights(reference)
    for name, value in state.items():
        assert torch.allclose(value, theirs[name], rtol=1e-4, atol=1e-5), name
    # It computes what the model under tidal computes.
    batch = transformers.default_data_collator([evaluation[i] for i in range(len(evaluation))])
    with torch.no_grad():
        assert loaded(**batch).loss.item() == trainer.engine(**batch).loss.item()
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert again("def f(x): return x")["input_ids"] == tokenizer("def f(x): return x")["input_ids"]
    assert (tmp_path / "generation_config.json").is_file()
    assert (tmp_path / "training_args.bin").is_file()


# ------------------------------------------------------------ the config
def deepspeed_warmup_decay_linear(k, lr, warmup, total):
    """DeepSpeed 0.19.8's WarmupDecayLR with warmup_type "linear" and warmup_min_lr 0
    at schedule position k (deepspeed/runtime/lr_schedules.py: min_lr before the
    first step, k / warmup in the warm-up, (total - k) / (total - warmup) after)."""
    if k < 0:
        return 0.0
    gamma = k / warmup if k < warmup else max(0.0, (total - k) / max(1.0, total - warmup))
    return lr * gamma


def test_the_config_scheduler_block_runs_instead_of_the_trainers(data, reference, tmp_path):
    """A config's scheduler block, its values "auto" as in transformers' templates,
    sets the learning rate the engine uses, with DeepSpeed's step convention (one
    step at warmup_min_lr before the warm-up starts, unlike the Trainer's
    schedules); the Trainer logs the lr the engine set for the next step, as
    DeepSpeed's scheduler reports it."""
    config = copy.deepcopy(TIDAL)
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto", "warmup_type": "linear"}}
    ours = run(RecordingTidalTrainer, data, training_args(tmp_path, max_steps=8,
                                                          eval_strategy="no"),
               tidal_config=config)
    assert ours.trainer.tidal_config["scheduler"]["params"] == {
        "warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4, "total_num_steps": 8,
        "warmup_type": "linear"}
    logged = [e["learning_rate"] for e in ours.logs]
    expected = [deepspeed_warmup_decay_linear(i - 1, 3e-3, 4, 8) for i in range(1, 9)]
    assert logged == pytest.approx(expected, rel=1e-12, abs=0)
    groups = ours.trainer.engine.optimizer.param_groups
    assert [g["lr"] for g in groups] == pytest.approx([expected[-1]] * len(groups), rel=1e-12)
    # The first two steps ran at lr 0, as the plain Trainer's first (warm-up from 0):
    # the second loss is still the initial weights' one, in both runs.
    assert ours.losses[:2] == reference.losses[:2]
    assert ours.losses[2] != reference.losses[2]


def test_bf16_from_the_training_arguments_is_tidals_precision(data, reference, tmp_path):
    seen = []
    tokenizer, train, _ = data
    model = llama(tokenizer)
    model.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append(torch.is_autocast_enabled("cpu")))
    args = training_args(tmp_path, bf16=True, max_steps=6, eval_strategy="no")
    before = os.environ.get("ACCELERATE_MIXED_PRECISION")  # ("bf16": TrainingArguments set it)
    trainer = RecordingTidalTrainer(model=model, args=args, train_dataset=train, tidal_config=TIDAL,
                                    data_collator=transformers.default_data_collator)
    trainer.losses = []
    trainer.train()
    assert trainer.tidal_config["bf16"] == {"enabled": True}
    assert trainer.engine.precision == "bf16"
    assert trainer.accelerator.mixed_precision == "no"
    assert os.environ.get("ACCELERATE_MIXED_PRECISION") == before
    assert seen and not any(seen)  # no autocast on top of tidal's bf16 chunks
    assert_close(trainer.losses, reference.losses[:6], 2e-2)


def test_fp16_steps_the_engine_skips_do_not_advance_the_trainers_schedule(data, tmp_path):
    """fp16 with a loss scale too large for the first gradients: the engine skips
    those steps (inf gradient norm, scale halved) and the Trainer's linear schedule
    advances only over the steps that were applied, as under DeepSpeed (and
    accelerate's GradScaler)."""
    config = copy.deepcopy(TIDAL)
    config["fp16"] = {"enabled": "auto", "initial_scale_power": 20, "hysteresis": 1}
    ours = run(RecordingTidalTrainer, data, training_args(tmp_path, fp16=True, max_steps=8,
                                                          warmup_steps=0, eval_strategy="no"),
               tidal_config=config)
    engine = ours.trainer.engine
    assert engine.precision == "fp16"
    skipped = [e["grad_norm"] == float("inf") for e in ours.logs]
    assert any(skipped) and not all(skipped) and engine.skipped_steps == sum(skipped)
    applied = 0
    for entry, was_skipped in zip(ours.logs, skipped):
        assert entry["learning_rate"] == pytest.approx(3e-3 * (1 - applied / 8), rel=1e-12)
        applied += not was_skipped
    assert ours.trainer.lr_scheduler.last_epoch == applied
    assert ours.losses[-1] < ours.losses[0] - 0.2


def test_gradient_checkpointing_of_the_trainer(data, reference, tmp_path):
    """TrainingArguments(gradient_checkpointing=True): the Trainer turns on the
    model's own (torch.utils.checkpoint per layer); the replays run under the
    engine's hooks and the losses are the plain Trainer's without it."""
    ours = run(RecordingTidalTrainer, data, training_args(tmp_path, gradient_checkpointing=True,
                                                          max_steps=4, eval_strategy="no"),
               tidal_config=TIDAL)
    assert ours.trainer.model.is_gradient_checkpointing
    # (the warm-up's lrs do not depend on max_steps)
    assert_close(ours.losses, reference.losses[:4], 1e-5)


def test_a_model_built_in_init_context_with_the_completed_config(data, reference, tmp_path):
    """trainer_config(config, args) is the config TidalTrainer trains with: a model
    built straight into chunks under it (post_init's initialisation kept) trains
    as the plain Trainer's."""
    tokenizer, train, _ = data
    args = training_args(tmp_path, max_steps=4, eval_strategy="no")
    config = trainer_config(TIDAL, args)
    with tidal.init_context(config):
        model = llama(tokenizer)
    assert all(raw_numel(p) == 0 for p in model.parameters())  # (placeholders: in chunks already)
    trainer = RecordingTidalTrainer(model=model, args=args, train_dataset=train,
                                    tidal_config=config,
                                    data_collator=transformers.default_data_collator)
    trainer.losses = []
    trainer.train()
    assert_close(trainer.losses, reference.losses[:4], 1e-5)


def test_load_best_model_at_end_loads_the_best_checkpoints_weights(data, tmp_path):
    """With greater_is_better=True the "best" eval loss is the first one: at the end
    the engine holds the fp32 weights of checkpoint-4 again, not those of step 8."""
    ours = run(RecordingTidalTrainer, data,
               training_args(tmp_path, max_steps=8, eval_steps=4, save_strategy="steps",
                             save_steps=4, load_best_model_at_end=True,
                             metric_for_best_model="eval_loss", greater_is_better=True),
               tidal_config=TIDAL)
    assert ours.trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "checkpoint-4").state_dict()
    later = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "checkpoint-8").state_dict()
    now = ours.trainer.engine.state_dict()
    for name, value in now.items():
        assert torch.equal(value, saved[name]), name
    assert not torch.equal(now["lm_head.weight"], later["lm_head.weight"])


def test_lora_with_peft(data, tmp_path):
    """A peft LoRA model (frozen base, trainable adapters) under TidalTrainer trains
    as under the plain Trainer, and save_model writes peft's adapter folder with
    the trained adapters."""
    peft = pytest.importorskip("peft")
    tokenizer, train, _ = data

    def lora():
        model = peft.get_peft_model(llama(tokenizer), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():  # (peft starts lora_B at zero)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
        return model

    results = []
    for trainer_class, extra in ((ReferenceTrainer, {}), (RecordingTidalTrainer, {
            "tidal_config": {"tidal": {"chunk_size": "128KiB", "device_memory_budget": "16MiB"}}})):
        trainer = trainer_class(model=lora(), args=training_args(tmp_path / trainer_class.__name__,
                                                                 max_steps=4, eval_strategy="no"),
                                train_dataset=train, data_collator=transformers.default_data_collator,
                                **extra)
        trainer.losses = []
        trainer.train()
        results.append(trainer)
    theirs, ours = results
    assert_close(ours.losses, theirs.losses, 1e-5)
    ours.save_model(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    loaded = peft.PeftModel.from_pretrained(llama(tokenizer), tmp_path / "adapter")
    adapters = {k: v for k, v in ours.engine.state_dict().items() if "lora_" in k}
    assert adapters
    state = loaded.state_dict()
    for name, value in adapters.items():
        assert torch.equal(state[name], value), name
        assert torch.allclose(value, theirs.model.state_dict()[name], rtol=1e-4, atol=1e-6), name


# ------------------------------------------------------------ "auto" filled
class HfReference(transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig,
                  accelerate_deepspeed.HfDeepSpeedConfig):
    """transformers' own filling of a DeepSpeed config from TrainingArguments
    (trainer_config_process/_finalize); without deepspeed installed its base
    class is object, so accelerate's query methods are mixed in here."""

    def __init__(self, config):
        accelerate_deepspeed.HfDeepSpeedConfig.__init__(self, copy.deepcopy(config))
        self._dtype = None
        self.mismatches = []


class Hidden:
    config = types.SimpleNamespace(hidden_size=64)


@pytest.mark.parametrize("name", ["hf_ds_config_zero2.json", "hf_ds_config_zero3.json"])
def test_auto_values_are_filled_as_transformers_fills_them(name, tmp_path):
    config = json.loads((CONFIGS / name).read_text())
    args = training_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         learning_rate=3e-4, adam_beta2=0.95, warmup_ratio=0.1, max_grad_norm=0.5,
                         bf16=True)
    theirs = HfReference(config)
    theirs.trainer_config_process(args)
    theirs.trainer_config_finalize(args, Hidden, 100)
    ours = trainer_config(CONFIGS / name, args, num_training_steps=100, model=Hidden)
    assert ours == theirs.config
    assert trainer_config(ours, args, num_training_steps=100, model=Hidden) == ours
    with pytest.warns(UserWarning, match="not used by tidal"):  # (ZeRO's keys: chunks instead)
        tidal.Config.load(ours)


def test_keys_the_config_leaves_out_come_from_the_training_arguments(tmp_path):
    args = training_args(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                         learning_rate=2e-4, weight_decay=0.05, max_grad_norm=0.7, bf16=True)
    ours = trainer_config({"tidal": {"chunk_size": "1MiB"}}, args)
    assert ours == {"tidal": {"chunk_size": "1MiB"}, "train_micro_batch_size_per_gpu": 3,
                    "gradient_accumulation_steps": 2, "gradient_clipping": 0.7,
                    "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.999],
                                                               "eps": 1e-8, "weight_decay": 0.05}},
                    "bf16": {"enabled": True}}


def test_values_that_differ_from_the_arguments_are_one_error(tmp_path):
    config = json.loads((CONFIGS / "hf_ds_config_zero2.json").read_text())
    config["optimizer"]["params"]["lr"] = 1e-3
    config["gradient_clipping"] = 2.0
    config["bf16"]["enabled"] = True
    args = training_args(tmp_path)  # lr 3e-3, max_grad_norm 1.0, no bf16
    theirs = HfReference(config)
    theirs.trainer_config_process(args)
    assert len(theirs.mismatches) == 3
    with pytest.raises(ValueError) as e:
        trainer_config(config, args, num_training_steps=10)
    text = str(e.value)
    for key in ("'optimizer.params.lr' = 0.001", "'gradient_clipping' = 2.0",
                "'bf16.enabled' = True", "learning_rate = 0.003", "max_grad_norm = 1.0"):
        assert key in text, text


# ---------------------------------------------------------- what is refused
@pytest.mark.parametrize("overrides, expected", [
    ({"torch_compile": True}, "torch_compile=True"),
    ({"optim": "adafactor"}, "optim='adafactor'"),
    ({"fp16_full_eval": True}, "fp16_full_eval/bf16_full_eval"),
    ({"save_safetensors": False}, "save_safetensors=False"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
])
def test_what_tidal_cannot_do_is_refused_when_the_trainer_is_made(data, tmp_path, overrides,
                                                                   expected):
    tokenizer, train, _ = data
    model = llama(tokenizer)
    with pytest.raises(ValueError, match="TidalTrainer cannot run this") as e:
        TidalTrainer(model=model, args=training_args(tmp_path, eval_strategy="no", **overrides),
                     train_dataset=train, tidal_config=TIDAL)
    assert expected in str(e.value)
    # Nothing was put into chunks: the model is as it was.
    assert all(raw_numel(p) > 0 for p in model.parameters())


def test_an_optimizer_of_the_users_own_is_refused(data, tmp_path):
    tokenizer, train, _ = data
    model = llama(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="optimizers=/optimizer_cls_and_kwargs="):
        TidalTrainer(model=model, args=training_args(tmp_path, eval_strategy="no"),
                     train_dataset=train, tidal_config=TIDAL, optimizers=(optimizer, None))
    with pytest.raises(TypeError, match="tidal_config"):
        TidalTrainer(model=model, args=training_args(tmp_path, eval_strategy="no"),
                     train_dataset=train)


def test_a_short_accumulation_window_is_refused_before_training(data, tmp_path):
    """64 examples in micro-batches of 4 are 16 per epoch: with 3 micro-batches
    per step the epoch's last step would have one, and the engine steps every 3."""
    tokenizer, train, _ = data
    trainer = TidalTrainer(model=llama(tokenizer),
                           args=training_args(tmp_path, gradient_accumulation_steps=3,
                                              max_steps=6, eval_strategy="no"),
                           train_dataset=train, tidal_config=TIDAL,
                           data_collator=transformers.default_data_collator)
    with pytest.raises(ValueError, match="not a multiple of gradient_accumulation_steps=3"):
        trainer.train()
    assert trainer.engine.global_steps == 0
