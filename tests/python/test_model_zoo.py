"""Third-party models as a new user brings them (issue 27): Hugging Face
families, the Hugging Face implementations of torchvision's networks, torch's
own attention, Transformer and RNN layers, tied, shared and frozen weights.

Each model trains STEPS steps in plain PyTorch with tidal.optim.CPUAdam and
under tidal.initialize on the simulated device with a measured device budget
below its state; the losses and the whole state_dict (weights, tied keys,
buffers) must be equal bit for bit, chunks must have been evicted, and no
step may have gone over the budget. The models, their data and both training
loops are benchmarks/model_zoo.py's (its result file makes the "Models
tried" table of docs/models.md); the models tidal refuses today are
model_zoo.REFUSED, marked xfail(strict=True) on the exception they raise.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import tidal

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import model_zoo  # noqa: E402

STEPS = 3
# The exception each refused model raises today.
RAISES: dict = {}


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def cases():
    out = []
    for case in model_zoo.CASES:
        marks = []
        if case.name in model_zoo.REFUSED:
            marks.append(pytest.mark.xfail(strict=True, raises=RAISES[case.name],
                                           reason=model_zoo.REFUSED[case.name]))
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


def test_every_refused_model_names_its_exception():
    assert RAISES.keys() == model_zoo.REFUSED.keys()


@pytest.mark.parametrize("case", cases())
def test_trains_bitwise_while_chunks_move(case):
    r = model_zoo.run_case(case, STEPS, catch=False)
    assert r["losses_equal"], (r["losses_plain"], r["losses_tidal"])
    assert r["weights_equal"], (f"differing: {r['tensors_differing']}, max relative L2 error "
                                f"{r['max_relative_weight_error']:.3g}")
    assert r["evictions"] > 0, f"the budget of {r['device_budget']} bytes moved no chunk"
    assert r["budget_overruns"] == 0, r


def test_the_benchmark_writes_a_record_per_model(tmp_path):
    out = tmp_path / "zoo.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model_zoo.py"), "--quick",
                           "--only", "shared_module", "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["benchmark"] == "model_zoo-quick" and result["steps"] == 2
    (record,) = result["models"]
    assert record["name"] == "shared_module" and record["trains"], record
    assert record["evictions"] > 0 and record["budget_overruns"] == 0
