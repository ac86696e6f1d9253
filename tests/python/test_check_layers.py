"""The layer check (tests/cpp/check_layers.py, Note [The build's layers] and
Note [The Python package's layers]) on a copy of the real tree: the copy
passes, and each breach planted in it fails the check with its own message.
Needs no build."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the check reads: the layers' folders, the package, the CMake files.
COPIED = ("CMakeLists.txt", "cmake", "chunk", "runtime", "cpu_adam", "hooks", "python", "tests/cpp")


def _load_check():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tests" / "cpp" / "check_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_layers = _load_check()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", ".*")
    for rel in COPIED:
        src, dst = ROOT / rel, copy / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=ignore)
        elif src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return copy


@pytest.fixture
def tree(pristine, tmp_path) -> Path:
    copy = tmp_path / "tree"
    shutil.copytree(pristine, copy)
    return copy


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_real_tree_passes(tree):
    assert check_layers.check(tree) == []


# (what is planted, file, text appended, words the problem must hold)
BREACHES = [
    ("the chunk store including the scheduler in angle brackets", "chunk/chunk_store.h",
     "#include <runtime/scheduler/chunk_scheduler.h>\n", "includes <runtime/scheduler/chunk_scheduler.h> of layer 'scheduler'"),
    ("the scheduler including the hooks with quotes", "runtime/scheduler/chunk_scheduler.cpp",
     '#include "hooks/module_hooks.h"\n', "of layer 'hooks'"),
    ("an include of a header that is not there", "hooks/module_hooks.h",
     '#include "hooks/module_hooks_gone.h"\n', "names no file"),
    ("libtorch in the chunk store", "chunk/chunk_store.cpp", "#include <ATen/ATen.h>\n", "without libtorch"),
    ("DTR importing the engine", "python/tidal/dtr.py",
     "\n\ndef _planted():\n    from tidal.engine import engine\n", "imports tidal.engine.engine (layer 'engine')"),
    ("the config importing the engine", "python/tidal/config.py",
     "\nfrom .engine import errors as _planted\n", "layer 'config' may not use"),
    ("the engine changing a slot state past the store", "python/tidal/engine/engine.py",
     "\n\ndef _planted(engine, r):\n    c = engine.chunks\n    c.release(r.id, 0, 0)\n",
     "changes slot states on the scheduler (_planted:"),
    ("CPU Adam during backward pinning a chunk past the store", "python/tidal/engine/overlap.py",
     "\n\ndef _planted(e, r):\n    cfg, c = e.config, e.chunks\n    c.access(r.id, 0, 0, [r.numel])\n",
     "python/tidal/engine/overlap.py: changes slot states on the scheduler (_planted:"),
    ("the scheduler made outside its owner", "python/tidal/engine/hook_wiring.py",
     "\n_PLANTED = _C.chunks.Chunks\n", "names _C.chunks.Chunks"),
    ("the hooks' binding outside the engine", "python/tidal/recompute/run.py",
     "\n_PLANTED = _C.chunks.ModuleHooks\n", "names _C.chunks.ModuleHooks"),
]


@pytest.mark.parametrize("what,rel,text,expected", BREACHES, ids=[b[0] for b in BREACHES])
def test_a_planted_breach_fails(tree, what, rel, text, expected):
    _append(tree / rel, text)
    problems = check_layers.check(tree)
    assert any(expected in p for p in problems), f"{what}: expected '{expected}' among {problems}"


def test_a_link_through_a_variable_fails(tree):
    _append(tree / "chunk" / "CMakeLists.txt",
            "set(_PLANTED_DEPS tidal_scheduler)\ntarget_link_libraries(tidal_chunk PUBLIC ${_PLANTED_DEPS})\n")
    problems = check_layers.check(tree)
    assert any("links tidal_chunk (layer 'chunk') to tidal_scheduler" in p for p in problems), problems


def test_a_binding_source_from_another_layer_fails(tree):
    # A source named through a variable, as python/CMakeLists.txt names csrc/*.cpp.
    _append(tree / "python" / "CMakeLists.txt", "target_sources(_C PRIVATE ${PROJECT_SOURCE_DIR}/hooks/device_room.cpp)\n")
    problems = check_layers.check(tree)
    assert any("adds hooks/device_room.cpp to _C" in p for p in problems), problems


def test_the_self_test_passes():
    assert check_layers.self_test() == 0
