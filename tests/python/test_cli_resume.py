"""tidal-train --resume with --lr (issue 42): the rate given applies from the next
step and the report says the rate used; without --lr the checkpoint's rate
continues, and a config that says otherwise is named.

The references are independent of the code under test: the lr in the shipped
configs/gpt_quick.json; AdamW's update, which leaves a weight unchanged at
lr 0 (decoupled decay is lr x weight_decay x w); DeepSpeed's WarmupLR
formula; and, for the scheduled case, the run started with the new --lr,
whose first two steps have lr 0 as the resumed run's had, so every weight and
Adam moment must come out bit for bit the same.
"""
import json
from pathlib import Path

import pytest

import tidal
from tidal import train

ROOT = Path(__file__).resolve().parents[2]
QUICK_LR = json.loads((ROOT / "configs" / "gpt_quick.json").read_text())["optimizer"]["params"]["lr"]


@pytest.fixture
def keep_device():
    """run() switches the process-wide device (the quick config asks for 'sim'): restore it."""
    previous = tidal.get_device()
    try:
        yield
    finally:
        tidal._C.set_default_device(previous)


def slots(checkpoint: Path) -> dict:
    """{(parameter, kind): CRC-32} of every slot a checkpoint holds."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    return {(e["name"], e["kind"]): e["crc32"] for e in meta["slots"]}


def groups(checkpoint: Path) -> list:
    return json.loads((checkpoint / "meta.json").read_text())["param_groups"]


def quick(*argv):
    return ["--quick", "--no-progress", "--seq", "32", *argv]


def test_lr_on_resume_applies_from_the_next_step_and_the_report_says_it(tmp_path, keep_device,
                                                                         capsys):
    ck = tmp_path / "ck"
    train.run(quick("--steps", "2", "--save-every", "2", "--save-dir", str(ck)))
    capsys.readouterr()
    report = train.run(quick("--steps", "4", "--resume", str(ck), "--lr", "0", "--save-every", "2"))
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("[tidal-train] note:")]
    assert notes == [f"[tidal-train] note: --lr 0 applies from step 3 on; {ck / 'step2'} trained "
                     f"at {QUICK_LR:g}"]
    assert report["lr"] == 0.0 and report["start_step"] == 2 and report["applied_steps"] == 2
    # At lr 0 AdamW moves no weight: the fp32 masters and the 16-bit copies are
    # those of step 2, bit for bit; the moments moved, so the two steps ran.
    before, after = slots(ck / "step2"), slots(ck / "step4")
    assert before.keys() == after.keys()
    for key in before:
        if key[1] in ("param32", "param16"):
            assert after[key] == before[key], key
    moments = [k for k in before if k[1] in ("momentum", "variance")]
    assert moments and all(after[k] != before[k] for k in moments)
    assert [g["lr"] for g in groups(ck / "step4")] == [0.0]
    assert [g["lr"] for g in groups(ck / "step2")] == [QUICK_LR]

    # Without --lr the checkpoint's rate continues, silently when the config agrees ...
    again = train.run(quick("--steps", "3", "--resume", str(ck / "step2")))
    assert again["lr"] == QUICK_LR
    assert "note:" not in capsys.readouterr().out
    # ... and named when it does not.
    other = tmp_path / "other.json"
    config = json.loads((ROOT / "configs" / "gpt_quick.json").read_text())
    config["optimizer"]["params"].update(lr=0.001, weight_decay=0.1)
    other.write_text(json.dumps(config))
    kept = train.run(quick("--steps", "3", "--resume", str(ck / "step2"), "--config", str(other)))
    assert kept["lr"] == QUICK_LR
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert notes == [f"[tidal-train] note: {ck / 'step2'} continues with its own lr {QUICK_LR:g} "
                     f"(the config says 0.001); weight_decay 0.01 (the config says 0.1); --lr "
                     f"changes the rate"]


def test_lr_on_resume_under_a_warmup_schedule_is_the_run_started_with_that_lr(
        tmp_path, keep_device, capsys):
    config = json.loads((ROOT / "configs" / "gpt_quick.json").read_text())
    # DeepSpeed's WarmupLR, linear from 0 over 10 steps to the optimizer's lr:
    # the lr of step k (1-based) is lr x (k - 2) / 10, 0 for the first two.
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_num_steps": 10,
                                                         "warmup_type": "linear"}}
    path = tmp_path / "warmup.json"
    path.write_text(json.dumps(config))

    def run(*argv):
        return train.run(quick("--config", str(path), "--data", "synthetic", *argv))
    straight = run("--steps", "4", "--lr", "0.02", "--save-every", "4", "--save-dir",
                   str(tmp_path / "straight"))
    run("--steps", "2", "--lr", "0.01", "--save-every", "2", "--save-dir", str(tmp_path / "ck"))
    capsys.readouterr()
    resumed = run("--steps", "4", "--lr", "0.02", "--resume", str(tmp_path / "ck"),
                  "--save-every", "2")
    assert f"note: --lr 0.02 applies from step 3 on; {tmp_path / 'ck' / 'step2'} trained at 0.01" \
        in capsys.readouterr().out
    assert resumed["lr"] == straight["lr"] == 0.02
    assert resumed["losses"] == straight["losses"][2:]
    assert slots(tmp_path / "ck" / "step4") == slots(tmp_path / "straight" / "step4")
    # The rate for step 5, by the formula: 0.02 x 3 / 10.
    assert groups(tmp_path / "ck" / "step4")[0]["lr"] == pytest.approx(0.02 * 3 / 10, rel=1e-12)
    assert groups(tmp_path / "ck" / "step4")[0]["initial_lr"] == 0.02


def test_clipping_and_accumulation_changed_on_resume_apply_and_are_named(tmp_path, keep_device, capsys):
    # The config's values a checkpoint does not restore (Note [Hyperparameters on
    # resume]): this run's apply from the next step, and one line says so.
    config = json.loads((ROOT / "configs" / "gpt_quick.json").read_text())
    trained_clip = float(config.get("gradient_clipping", 1.0))
    trained_accum = int(config.get("gradient_accumulation_steps", 1))
    ck = tmp_path / "ck"
    train.run(quick("--steps", "2", "--save-every", "2", "--save-dir", str(ck)))
    same = train.run(quick("--steps", "3", "--resume", str(ck / "step2"), "--save-every", "3",
                           "--save-dir", str(tmp_path / "same")))
    assert "note:" not in capsys.readouterr().out
    config.update(gradient_clipping=1e-4, gradient_accumulation_steps=trained_accum + 1)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(config))
    changed = train.run(quick("--steps", "3", "--resume", str(ck / "step2"), "--config", str(other),
                              "--save-every", "3", "--save-dir", str(tmp_path / "changed")))
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert notes == [f"[tidal-train] note: gradient_clipping 0.0001 applies from step 3 on "
                     f"({ck / 'step2'} trained with {trained_clip:g}); gradient_accumulation_steps "
                     f"{trained_accum + 1} applies from step 3 on ({ck / 'step2'} trained with "
                     f"{trained_accum})"]
    assert changed["gradient_accumulation_steps"] == trained_accum + 1
    assert same["gradient_accumulation_steps"] == trained_accum
    # The clip at 1e-4 (far below any gradient norm) changed step 3's update.
    a, b = slots(tmp_path / "same" / "step3"), slots(tmp_path / "changed" / "step3")
    assert any(a[k] != b[k] for k in a if k[1] == "param32")
