"""tidal's real CUDA backend on a CPU, under the fake libcudart (tests/fake_cuda).

Each case runs in a subprocess with LD_PRELOAD=libfakecudart.so (built in the C++ build,
TIDAL_CPP_BUILD, when the CUDA backend is built). The fake checks every cudaHostRegister
range, aborts when pinned memory is unmapped, decommitted or re-protected, and writes its
counters to FAKE_CUDA_REPORT at exit; the assertions read them. torch computes on the CPU
over chunk views (store.py's TIDAL_TORCH_DEVICE=cpu testing switch), so training needs
device memory the CPU can read (FAKE_CUDA_DEVICE_READABLE=1); registration alone runs with
device memory unreadable, as on a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
CHUNK = 64 * MIB
VOCAB = 50304


def _fake_lib() -> Path:
    build = Path(os.environ.get("TIDAL_CPP_BUILD", ROOT / "build" / "cpp"))
    lib = build / "tests" / "cpp" / "runtime" / "libfakecudart.so"
    if lib.exists():
        return lib
    cache = build / "CMakeCache.txt"
    if cache.exists() and "TIDAL_CUDA_ENABLED" not in cache.read_text() and \
            not any(line.startswith("CMAKE_CUDA_COMPILER:") and line.split("=", 1)[1].strip()
                    for line in cache.read_text().splitlines()):
        pytest.skip(f"the C++ build in {build} has no CUDA backend (no nvcc), so no fake libcudart")
    if not cache.exists():
        pytest.skip(f"no C++ build at {build} (set TIDAL_CPP_BUILD); the fake libcudart is built there")
    pytest.fail(f"{lib} is missing although {build} was configured with CUDA: build the "
                "tidal_fakecudart target (cmake --build {build} --target tidal_fakecudart)")


CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import tidal
    from tidal.models.gpt import TinyGPT
    spec = json.loads(sys.argv[1])
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "tidal": {"device": "cuda", "chunk_size": spec["chunk"],
                  "device_memory_budget": spec["budget"], "device_margin": spec["margin"]},
    }
    torch.manual_seed(0)
    try:
        with tidal.init_context(cfg):
            model = TinyGPT(vocab=spec["vocab"], d=spec["d"], layers=spec["layers"],
                            heads=spec["heads"], seq=spec["seq"])
        engine = tidal.initialize(model, cfg)
    except tidal.ConfigError as e:
        print("CONFIG_ERROR " + str(e))
        raise SystemExit(3)
    assert engine.memory_report()["backend"] == "cuda", engine.memory_report()["backend"]
    out = {"losses": [], "h2d": 0, "d2h": 0, "peak_nonchunk": 0, "evictions": 0,
           "pageable_copies": 0, "host_pins": 0,
           "device_budget": engine.memory_report()["device_budget"],
           "total_memory": tidal.get_device().info()["total_memory"]}
    for step in range(spec["steps"]):
        x = torch.randint(0, spec["vocab"], (1, spec["seq"]))
        y = torch.randint(0, spec["vocab"], (1, spec["seq"]))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        rep = engine.memory_report()
        out["losses"].append(float(loss))
        out["h2d"] += rep["bytes_host_to_device_last_step"]
        out["d2h"] += rep["bytes_device_to_host_last_step"]
        out["peak_nonchunk"] = max(out["peak_nonchunk"], rep["peak_nonchunk_device_bytes"])
        out["evictions"] = rep["evictions"]
        out["budget_overruns"] = rep["budget_overruns"]
        out["peak_device_bytes"] = rep["peak_device_bytes"]
        out["device_margin"] = rep["device_margin"]
    stats = engine.chunks.stats()
    out["pageable_copies"] = stats["pageable_copies"]
    out["host_pins"] = stats["host_pins"]
    del engine, model
    import gc; gc.collect()
    print("RESULT " + json.dumps(out))
""")


def _run(tmp_path, spec: dict, readable: bool, others: int = 0) -> tuple[dict, dict]:
    """others: device bytes someone else holds (FAKE_CUDA_OTHERS_BYTES)."""
    proc = _child(tmp_path, spec, readable, others)
    report = tmp_path / "fakecuda.txt"
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert report.exists(), proc.stderr[-3000:]
    counters = dict(line.split("=", 1) for line in report.read_text().split())
    counters = {k: int(v) for k, v in counters.items()}
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    return counters, result


def _child(tmp_path, spec: dict, readable: bool, others: int = 0) -> subprocess.CompletedProcess:
    lib = _fake_lib()
    env = dict(os.environ)
    env.update({
        "LD_PRELOAD": str(lib),
        "TIDAL_DEVICE": "cuda",
        "TIDAL_TORCH_DEVICE": "cpu",
        "FAKE_CUDA_REPORT": str(tmp_path / "fakecuda.txt"),
        "FAKE_CUDA_DEVICE_READABLE": "1" if readable else "0",
        "FAKE_CUDA_CAPACITY_BYTES": str(4 << 30),
        "FAKE_CUDA_OTHERS_BYTES": str(others),
        "OMP_NUM_THREADS": "2",
    })
    return subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=600)


def _assert_clean(c: dict, result: dict):
    # Nothing pinned was unmapped, decommitted or re-protected: the fake aborts the child
    # outright on that (checked by the return code). Every range tidal registered was
    # accepted, and it is what the scheduler says it pinned; every copy tidal counts as
    # pageable (a chunk's first counted crossings: Note [Pinned at the second crossing] in
    # runtime/scheduler/chunk_scheduler.h) is one the fake saw through pageable memory,
    # and no other was.
    assert c["sticky_error"] == 0, c
    assert c["register_failures"] == 0, c
    assert c["registers"] == result["host_pins"], (c, result)
    assert c["pageable_h2d"] + c["pageable_d2h"] == result["pageable_copies"], (c, result)


def _assert_released(c: dict):
    assert c["unregisters"] == c["registers"], c
    assert c["live_registrations"] == 0, c


def _spec(d, heads, layers, steps, budget=0, margin=0):
    return {"vocab": VOCAB, "d": d, "heads": heads, "layers": layers, "seq": 8,
            "chunk": CHUNK, "steps": steps, "budget": budget, "margin": margin}


def test_gpt350m_shaped_initialize_pins_and_copies_nothing_device_unreadable(tmp_path):
    # Note [Pinned at the second crossing]: the model's host chunks stay pageable until
    # a chunk crosses the link a second time after the first step.
    counters, result = _run(tmp_path, _spec(1024, 16, 4, steps=0), readable=False)
    _assert_clean(counters, result)
    assert counters["registers"] == 0, counters
    assert result["losses"] == []


@pytest.mark.parametrize("d,heads,layers", [(1024, 16, 4), (2048, 16, 2)], ids=["gpt350m", "gpt1.3b"])
def test_training_moves_chunks_both_ways_under_the_cuda_backend(tmp_path, d, heads, layers):
    # A first run with the whole (fake) device measures the non-chunk memory of a step.
    # The second run's budget then holds that, the embedding's dedicated chunk (vocab * d
    # bf16 values: 98 MiB at d 1024, 196.5 MiB at d 2048, over one 64 MiB chunk) and one
    # regular chunk: less than the model's chunks (4 layers of d 1024, 2 of d 2048 fill
    # at least two regular chunks), so chunks have to move both ways.
    _, free = _run(tmp_path, _spec(d, heads, layers, steps=1), readable=True)
    embedding = VOCAB * d * 2
    margin = 8 * MIB
    budget = free["peak_nonchunk"] + embedding + CHUNK + margin
    counters, result = _run(tmp_path, _spec(d, heads, layers, steps=3, budget=budget, margin=margin),
                            readable=True)
    _assert_clean(counters, result)
    # Chunks crossed again after the first step: their host blocks were pinned, and
    # dropping the engine unregistered every pinned range.
    assert counters["registers"] > 0, counters
    _assert_released(counters)
    assert len(result["losses"]) == 3
    assert all(l == l and abs(l) < float("inf") for l in result["losses"]), result
    assert result["h2d"] > 0 and result["d2h"] > 0, result
    assert result["evictions"] > 0, result
    assert counters["mallocs"] > 0 and counters["copies"] > 0, counters


def test_the_default_budget_is_what_the_gpu_can_give_and_more_is_refused(tmp_path):
    # Note [The whole GPU is what is free] (engine/store.py): 1 GiB of the 4 GiB
    # (fake) device belongs to someone else, as a CUDA context and other processes
    # do on a GPU. Without a budget the engine takes the 3 GiB the driver can give,
    # not the device's total; a budget above that is refused at initialize, by name,
    # before anything runs out of memory.
    others = 1 << 30
    counters, result = _run(tmp_path, _spec(1024, 16, 2, steps=1), readable=True, others=others)
    _assert_clean(counters, result)
    assert result["total_memory"] == 4 << 30
    assert result["device_budget"] == (4 << 30) - others, result
    assert result["budget_overruns"] == 0, result
    assert result["peak_device_bytes"] <= result["device_budget"] - result["device_margin"], result
    proc = _child(tmp_path, _spec(1024, 16, 2, steps=1, budget=(3 << 30) + (512 << 20)),
                  readable=True, others=others)
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    message = next(l for l in proc.stdout.splitlines() if l.startswith("CONFIG_ERROR "))
    assert "'tidal.device_memory_budget': 3758096384 bytes" in message, message
    assert f"can give this process now ({3 << 30} bytes" in message, message
    # At most what is free trains.
    counters, result = _run(tmp_path, _spec(1024, 16, 2, steps=1, budget=3 << 30), readable=True,
                            others=others)
    assert result["device_budget"] == 3 << 30 and len(result["losses"]) == 1, result
    assert result["budget_overruns"] == 0, result
    assert result["peak_device_bytes"] <= result["device_budget"] - result["device_margin"], result
