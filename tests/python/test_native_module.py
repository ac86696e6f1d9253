"""tidal._C shares the process's C++ runtime (Note [One libstdc++ in the process]).

The gpt-350m segfault on the GPU (issue 31): the GPU image's g++ linked libstdc++
statically into _C, so the module carried a second C++ runtime, half bound to the
process's libstdc++.so.6. The first number written into a std::ostringstream --
the "tensor larger than a chunk" warning for the embedding -- crashed. These tests
check the built module, the warning text that crashed, and the link recipe
(cmake/OneLibstdcxx.cmake) against a module linked with -static-libstdc++, which on
this machine's g++ reproduces the mixed runtime (the number silently disappears).
"""
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import tidal
from tidal import _C

ROOT = Path(__file__).resolve().parents[2]
# libstdc++'s own explicit instantiation of ostream << unsigned long: user code never
# emits it (the headers declare it extern), so a module that defines it carries a copy
# of the C++ runtime.
RUNTIME_SYMBOL = "_ZNSo9_M_insertImEERSoT_"


def _needed(path):
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def _exported(path):
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_the_module_uses_the_shared_cpp_runtime_and_exports_no_copy_of_it():
    path = Path(_C.__file__)
    assert "libstdc++.so.6" in _needed(path), f"{path} does not load libstdc++.so.6: {_needed(path)}"
    exported = _exported(path)
    assert RUNTIME_SYMBOL not in exported, f"{path} defines libstdc++'s {RUNTIME_SYMBOL}: a second C++ runtime"
    # --exclude-libs: tidal's static libraries stay inside the module.
    assert "PyInit__C" in exported
    assert not any("ChunkStore" in s for s in exported), "tidal's own symbols are exported"


def test_the_warning_that_crashed_on_the_gpu_has_its_numbers():
    # A Linear whose weight is larger than a chunk gets a dedicated chunk and a warning
    # that writes its element count through std::ostringstream (chunk_store.cpp).
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8))
    cfg = {"train_batch_size": 2, "tidal": {"chunk_size": 16384}}  # (nothing trains: no budget needed)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tidal.initialize(model, cfg)
    text = " ".join(str(w.message) for w in seen)
    assert "has 6144 elements" in text and "more than the chunk size of 4096" in text, text


def _run_module(python, module):
    # Loaded the way _C is: into a process that already holds torch (and its libstdc++).
    code = textwrap.dedent(f"""
        import ctypes, torch
        lib = ctypes.CDLL({str(module)!r})
        lib.tidal_format.restype = ctypes.c_char_p
        print(lib.tidal_format(ctypes.c_size_t(51511296)).decode())
    """)
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout.strip()


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("g++") is None,
                    reason="reproduces GCC's -static-libstdc++ (the GPU image's toolchain): needs g++ "
                           "and cmake on PATH")
def test_the_link_recipe_keeps_one_runtime_under_a_static_libstdcxx_toolchain(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "fmt.cpp").write_text(textwrap.dedent("""
        #include <cstddef>
        #include <sstream>
        #include <string>
        extern "C" const char* tidal_format(std::size_t n) {
          static std::string s;
          std::ostringstream out;
          out << "tensor has " << n << " elements";
          s = out.str();
          return s.c_str();
        }
    """))
    (src / "CMakeLists.txt").write_text(textwrap.dedent(f"""
        cmake_minimum_required(VERSION 3.24)
        project(one_runtime CXX)
        include({(ROOT / "cmake" / "OneLibstdcxx.cmake").as_posix()})
        add_library(without MODULE fmt.cpp)
        add_library(with MODULE fmt.cpp)
        tidal_one_libstdcxx(with "{Path(sys.executable).as_posix()}")
    """))
    build = tmp_path / "build"
    # The GPU image's toolchain, on this machine: libstdc++ linked statically into modules.
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_CXX_COMPILER=g++",
                    "-DCMAKE_MODULE_LINKER_FLAGS=-static-libstdc++"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    without, with_ = build / "libwithout.so", build / "libwith.so"

    # Without the recipe the module carries a half-bound copy: the number is lost (here)
    # or the process crashes (the GPU image).
    assert RUNTIME_SYMBOL in _exported(without)
    rc, out = _run_module(sys.executable, without)
    assert rc != 0 or out != "tensor has 51511296 elements", (rc, out)

    # With it: one runtime, the right text.
    assert "libstdc++.so.6" in _needed(with_) and RUNTIME_SYMBOL not in _exported(with_)
    assert _run_module(sys.executable, with_) == (0, "tensor has 51511296 elements")
