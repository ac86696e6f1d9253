"""The Python face of the device layer: import, device_info, errors, copies, the GIL."""

import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tidal

ROOT = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20


def test_import_and_version():
    import tomllib  # Python 3.11+

    assert tidal.__version__ == tidal._C.__version__
    # One version for the package, the C++ build and the wheel metadata.
    text = (ROOT / "python" / "tidal" / "_version.py").read_text()
    assert f'"{tidal.__version__}"' in text
    assert "dynamic" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(tidal.__all__) <= set(dir(tidal))


def test_device_info_describes_backend_and_cpu():
    info = tidal.device_info()
    assert info["backend"] in ("cuda", "sim")
    if info["cuda_devices"] > 0:
        assert info["backend"] == "cuda" and info["pinned_memory"]
    else:
        assert info["backend"] == "sim" and not info["pinned_memory"]
        assert info["cuda_unavailable_reason"]
    assert 0 < info["capacity"] <= info["total_memory"]
    assert info["cpu_simd_target"] == info["cpu_simd_targets"][0]
    assert isinstance(info["cuda_compiled"], bool)


def test_device_info_of_a_kind_and_of_a_device(sim_device):
    assert tidal.device_info("sim")["backend"] == "sim"
    assert tidal.device_info(sim_device)["capacity"] == 64 * MiB
    with pytest.raises(TypeError, match="tidal.Device"):
        tidal.device_info(3.5)


def test_out_of_memory_is_a_tidal_runtime_error_with_the_numbers(sim_device):
    held = sim_device.allocate("40MiB")
    with pytest.raises(tidal.OutOfMemoryError) as err:
        sim_device.allocate("30MiB")
    assert isinstance(err.value, RuntimeError)
    message = str(err.value)
    assert "tried to allocate 30.00 MiB" in message
    assert "40.00 MiB (41943040 bytes) in use" in message
    assert "capacity 64.00 MiB" in message
    assert sim_device.memory_stats()["in_use"] == held.nbytes  # nothing lost


def test_value_errors_from_cpp_name_the_value(sim_device):
    with pytest.raises(ValueError, match='unknown device "gpu"'):
        tidal.set_device("gpu")
    with pytest.raises(ValueError, match='"5 parsecs"'):
        tidal.parse_bytes("5 parsecs")
    with pytest.raises(ValueError, match="below the .* already in use"):
        keep = sim_device.allocate("8MiB")
        sim_device.capacity = "4MiB"
    del keep
    buf = sim_device.allocate(MiB)
    host = tidal.HostBuffer(MiB)
    stream = sim_device.create_stream("s")
    with pytest.raises(ValueError, match=r"range \[16, 1048592\) is outside the buffer of 1048576 bytes"):
        sim_device.copy_h2d(buf, host, stream, nbytes=MiB, dst_offset=16)
    if tidal._C.cuda_device_count()[0] == 0:
        with pytest.raises(ValueError, match="TIDAL_DEVICE=sim"):
            tidal.set_device("cuda")


def test_round_trip_through_the_device_is_byte_exact(sim_device):
    stream = sim_device.create_stream("copies")
    src, dst = tidal.HostBuffer(3 * MiB + 5), tidal.HostBuffer(3 * MiB + 5)
    a = np.frombuffer(src, dtype=np.uint8)
    a[:] = np.random.default_rng(0).integers(0, 256, a.size, dtype=np.uint8)
    np.frombuffer(dst, dtype=np.uint8)[:] = 0
    d1, d2 = sim_device.allocate(src.nbytes), sim_device.allocate(src.nbytes)
    sim_device.copy_h2d(d1, src, stream)
    sim_device.copy_d2d(d2, d1, stream)
    sim_device.copy_d2h(dst, d2, stream)
    done = sim_device.create_event()
    done.record(stream)
    done.synchronize()
    assert done.query()
    np.testing.assert_array_equal(np.frombuffer(dst, dtype=np.uint8), a)


def test_counters_return_to_baseline(sim_device):
    import gc

    # Garbage of earlier tests (an engine's host chunks) goes first: until a
    # collection frees nothing more (an engine's finalizers release what the
    # next collection frees; the suite's workers run files in any order).
    before = None
    for _ in range(10):
        gc.collect()
        now = tidal.stats()["host"]["allocated"]
        if now == before:
            break
        before = now
    before = tidal.stats()
    bufs = [tidal.HostBuffer(3 * MiB) for _ in range(3)]
    devs = [sim_device.allocate(MiB) for _ in range(5)]
    during = tidal.stats()
    assert during["host"]["allocated"] == before["host"]["allocated"] + 9 * MiB
    assert during["device"]["in_use"] == before["device"]["in_use"] + 5 * MiB
    del bufs, devs
    gc.collect()
    after = tidal.stats()
    assert after["host"]["allocated"] == before["host"]["allocated"]
    assert after["device"]["in_use"] == before["device"]["in_use"]


def test_host_buffer_views_share_memory():
    buf = tidal.HostBuffer(4096)
    view = memoryview(buf)
    assert view.nbytes == 4096 and not view.readonly
    np.frombuffer(buf, dtype=np.uint8)[7] = 42
    assert view[7] == 42
    assert buf.data_ptr % 64 == 0


def test_gil_is_released_while_waiting_for_a_copy():
    # 16 MiB at 100 MB/s: the synchronize below blocks for about 0.17 s.
    device = tidal._C.create_device("sim", 32 * MiB, "100MB/s", None)
    src = tidal.HostBuffer(16 * MiB)
    dst = device.allocate(16 * MiB)
    stream = device.create_stream("slow")
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    device.copy_h2d(dst, src, stream)
    t = threading.Thread(target=spin)
    t0 = time.perf_counter()
    t.start()
    stream.synchronize()
    t1 = time.perf_counter()
    stop.set()
    t.join()
    assert t1 - t0 > 0.1
    # The other thread ran Python code while this one waited inside C++.
    assert sum(t0 < x < t1 for x in ticks) >= 10


def test_device_demo_runs_past_capacity():
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.device_demo", "--device", "sim", "--quick"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "16 chunks fit" in out and "tidal.OutOfMemoryError" in out
    assert "18/18 chunks byte-exact" in out
    assert "device in use 0 B" in out and "host buffers 0 B" in out


def test_device_bandwidth_benchmark_quick(tmp_path):
    build = pathlib.Path(os.environ.get("TIDAL_CPP_BUILD", ROOT / "build" / "cpp"))
    binary = build / "benchmarks" / "tidal_bench_device_bandwidth"
    assert binary.exists(), f"{binary} is missing: scripts/test.sh builds it before the Python tests"
    out = tmp_path / "bw.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device_bandwidth.py"), "--quick", "--device", "sim",
         "--binary", str(binary), "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    result = json.loads(out.read_text())
    for direction in ("h2d", "d2h"):
        d = result["results"]["directions"][direction]
        assert len(d["tidal_bytes_per_s"]) == d["samples"] == 3
        assert d["median_ratio_tidal_to_peer"] > 0
    assert result["simulated"] is True


def test_gpu_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_run.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
