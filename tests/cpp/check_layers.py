#!/usr/bin/env python3
"""The C++ build's layers, and the check that the code keeps to them.

Note [The build's layers]
~~~~~~~~~~~~~~~~~~~~~~~~~
Each library target is one layer and lives in its own folders. A layer uses
only the layers below it (LAYERS: the ones it names, and theirs in turn):

    python (python/csrc, tidal._C)
      -> hooks (hooks/, libtorch)
           -> tracer (runtime/tracer) -> scheduler (runtime/scheduler)
                -> device and host memory (runtime/device, runtime/memory) -> core
                -> chunk (chunk/) -> core (runtime/core)
           -> cpu_adam (cpu_adam/) -> core
           -> dtr_torch (hooks/dtr, libtorch) -> dtr (runtime/dtr) -> core

The top-level folders stay those of the design (chunk, runtime, cpu_adam,
hooks, python); the targets say the layers. This script fails when
  * a source file includes a header of a layer its own may not use (an
    upward or sideways include), or includes libtorch, ATen, c10 or pybind11
    outside the layers that may (hooks, dtr_torch, python);
  * a CMakeLists.txt adds sources to a target of another layer than the
    folder it sits in, or links a layer target to one it may not use;
  * a layer's target is missing from the CMake files;
  * the include and link graph between targets has a cycle.
Run as `python3 tests/cpp/check_layers.py [ROOT]`; CTest runs it
(tests/cpp/CMakeLists.txt, label "layers"), with --self-test too.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

# name -> (CMake target, folders, layers it uses directly, may include libtorch)
LAYERS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], bool]] = {
    "core": ("tidal_core", ("runtime/core",), (), False),
    "chunk": ("tidal_chunk", ("chunk",), ("core",), False),
    "device": ("tidal_device", ("runtime/device", "runtime/memory"), ("core",), False),
    "scheduler": ("tidal_scheduler", ("runtime/scheduler",), ("device", "chunk"), False),
    "tracer": ("tidal_tracer", ("runtime/tracer",), ("scheduler",), False),
    "cpu_adam": ("tidal_cpu_adam", ("cpu_adam",), ("core",), False),
    "dtr": ("tidal_dtr", ("runtime/dtr",), ("core",), False),
    "dtr_torch": ("tidal_dtr_torch", ("hooks/dtr",), ("dtr",), True),
    "hooks": ("tidal_hooks", ("hooks",), ("tracer", "cpu_adam", "dtr_torch"), True),
    "python": ("_C", ("python",), ("hooks",), True),
}

SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".c")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
SKIPPED_FOLDERS = ("__pycache__", "node_modules", ".venv")
TORCH_HEADERS = ("torch/", "ATen/", "c10/", "pybind11/", "Python.h")
CMAKE_ADD = re.compile(r"\b(?:add_library|target_sources|Python_add_library)\s*\(")
CMAKE_LINK = re.compile(r"\btarget_link_libraries\s*\(")


def allowed(name: str) -> set[str]:
    """The layers `name` may use: its own, the ones it names, and theirs."""
    out, todo = {name}, [name]
    while todo:
        for dep in LAYERS[todo.pop()][2]:
            if dep not in out:
                out.add(dep)
                todo.append(dep)
    return out


def layer_of(path: str) -> str | None:
    """The layer whose folder holds `path` (a path from the root), the longest folder first."""
    best, best_len = None, -1
    for name, (_, folders, _, _) in LAYERS.items():
        for folder in folders:
            if (path == folder or path.startswith(folder + "/")) and len(folder) > best_len:
                best, best_len = name, len(folder)
    return best


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def cmake_calls(text: str, opener: re.Pattern) -> list[tuple[str, list[str]]]:
    """(first argument, other arguments) of each call `opener` finds, comments removed."""
    text = re.sub(r"(^|\s)#[^\n]*", r"\1", text)
    out = []
    for m in opener.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        args = text[m.end():i - 1].split()
        if args:
            out.append((args[0], args[1:]))
    return out


def check(root: Path, edges_out: dict[str, set[str]] | None = None) -> list[str]:
    """The problems of the tree at `root` (none: it keeps to LAYERS); the
    target graph found (includes and links) goes into `edges_out`."""
    cycle = find_cycle({n: set(spec[2]) for n, spec in LAYERS.items()})
    if cycle:
        return [f"LAYERS itself has a cycle: {' -> '.join(cycle)}"]
    problems: list[str] = []
    by_target = {spec[0]: name for name, spec in LAYERS.items()}
    edges: dict[str, set[str]] = {n: set() for n in LAYERS}
    defined: set[str] = set()

    files: set[Path] = set()
    for folder in sorted({f for spec in LAYERS.values() for f in spec[1]}):
        for dirpath, dirnames, filenames in os.walk(root / folder):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            files.update(Path(dirpath) / f for f in filenames)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIPPED_FOLDERS
                       and not (Path(dirpath) == root and d.startswith("build"))]
        if "CMakeLists.txt" in filenames:
            cmake = Path(dirpath) / "CMakeLists.txt"
            check_cmake(root, cmake, by_target, edges, defined, problems)
    for full in sorted(files):
        rel = full.relative_to(root).as_posix()
        own = layer_of(rel)
        if own is None:
            continue
        if not full.name.endswith(SOURCE_SUFFIXES):
            continue
        ok = allowed(own)
        for kind, header in INCLUDE.findall(full.read_text(errors="replace")):
            if kind == "<" or "/" not in header:
                if header.startswith(TORCH_HEADERS) and not LAYERS[own][3]:
                    problems.append(f"{rel}: includes <{header}>, but layer '{own}' "
                                    f"({LAYERS[own][0]}) builds without libtorch")
                continue
            target = layer_of(header)
            if target is None or target == own:
                continue  # not a layer's header (hwy/..., tests/...), or its own
            edges[own].add(target)
            if target not in ok:
                problems.append(f"{rel}: includes \"{header}\" of layer '{target}' "
                                f"({LAYERS[target][0]}), which layer '{own}' ({LAYERS[own][0]}) "
                                f"may not use (it uses: {', '.join(sorted(ok - {own})) or 'nothing'})")

    for name, (target, _, _, _) in LAYERS.items():
        if target not in defined:
            problems.append(f"layer '{name}': no add_library({target} ...) in a CMakeLists.txt of its folders")
    cycle = find_cycle(edges)
    if cycle:
        problems.append(f"the targets' include and link graph has a cycle: {' -> '.join(cycle)}")
    if edges_out is not None:
        edges_out.update(edges)
    return problems


def check_cmake(root: Path, cmake: Path, by_target: dict[str, str], edges: dict[str, set[str]],
                defined: set[str], problems: list[str]) -> None:
    """A CMakeLists.txt: the sources of a layer's target lie in the layer's
    folders, and its links go to layers it may use."""
    rel = cmake.relative_to(root).as_posix()
    text = cmake.read_text(errors="replace")
    for target, args in cmake_calls(text, CMAKE_ADD):
        layer = by_target.get(target)
        if layer is None:
            continue  # not a layer's target (a test helper)
        defined.add(target)
        for arg in args:
            if not arg.endswith(SOURCE_SUFFIXES) or "$" in arg:
                continue
            source = os.path.normpath(os.path.join(os.path.dirname(rel), arg)).replace(os.sep, "/")
            if layer_of(source) != layer:
                problems.append(f"{rel}: adds {source} to {target} (layer '{layer}'), but the file "
                                f"belongs to layer '{layer_of(source)}'")
    for target, args in cmake_calls(text, CMAKE_LINK):
        layer = by_target.get(target)
        if layer is None:
            continue
        ok = allowed(layer)
        for arg in args:
            dep = by_target.get(arg)
            if dep is None or dep == layer:
                continue
            edges[layer].add(dep)
            if dep not in ok:
                problems.append(f"{rel}: links {target} (layer '{layer}') to {arg} (layer '{dep}'), "
                                f"which it may not use (it uses: {', '.join(sorted(ok - {layer}))})")


def self_test() -> int:
    """The check on made-up trees: a clean one passes, each kind of breach is found."""
    with tempfile.TemporaryDirectory(prefix="tidal-layers-") as top:
        return _self_test(Path(top))


def _self_test(top: Path) -> int:
    made = iter(range(1000))

    def tree(files: dict[str, str]) -> Path:
        d = top / str(next(made))
        for rel, text in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_text(text)
        return d

    clean = {
        "runtime/core/CMakeLists.txt": "add_library(tidal_core STATIC error.cpp)\n",
        "runtime/core/error.h": "#pragma once\n",
        "chunk/CMakeLists.txt": "add_library(tidal_chunk STATIC chunk.cpp)\n"
                                "target_link_libraries(tidal_chunk PUBLIC tidal_core)\n",
        "chunk/chunk.h": '#include "runtime/core/error.h"\n',
        "runtime/CMakeLists.txt": "add_library(tidal_device STATIC device/device.cpp)\n"
                                  "target_link_libraries(tidal_device PUBLIC tidal_core)\n",
        "runtime/device/device.h": '#include "runtime/core/error.h"\n#include <vector>\n',
        "runtime/scheduler/CMakeLists.txt": "add_library(tidal_scheduler STATIC s.cpp)\n"
                                            "target_link_libraries(tidal_scheduler PUBLIC tidal_device tidal_chunk)\n",
        "runtime/scheduler/s.h": '#include "chunk/chunk.h"\n#include "runtime/device/device.h"\n',
        "runtime/tracer/CMakeLists.txt": "add_library(tidal_tracer STATIC t.cpp)\n"
                                         "target_link_libraries(tidal_tracer PUBLIC tidal_scheduler)\n",
        "runtime/dtr/CMakeLists.txt": "add_library(tidal_dtr STATIC r.cpp)\n",
        "cpu_adam/CMakeLists.txt": "add_library(tidal_cpu_adam STATIC adam.cpp)\n",
        "hooks/CMakeLists.txt": "add_library(tidal_hooks STATIC m.cpp)\n"
                                "target_link_libraries(tidal_hooks PUBLIC tidal_tracer # a comment (with parens)\n"
                                "  tidal_cpu_adam ${TORCH_LIBRARIES})\n",
        "hooks/m.cpp": '#include <torch/torch.h>\n#include "runtime/tracer/t.h"\n',
        "hooks/dtr/CMakeLists.txt": "add_library(tidal_dtr_torch STATIC s.cpp)\n",
        "python/CMakeLists.txt": "Python_add_library(_C MODULE m.cpp)\n",
    }
    failures = []
    got = check(tree(clean))
    if got:
        failures.append(f"a clean tree failed: {got}")
    breaches = {
        "an upward include": ({"chunk/bad.h": '#include "runtime/scheduler/s.h"\n'}, "may not use"),
        "a sideways include": ({"cpu_adam/bad.cpp": '#include "chunk/chunk.h"\n'}, "may not use"),
        "the device layer on the chunk store": ({"runtime/device/bad.cpp": '#include "chunk/chunk.h"\n'},
                                                "may not use"),
        "libtorch below hooks": ({"runtime/scheduler/bad.cpp": "#include <ATen/ATen.h>\n"}, "without libtorch"),
        "an upward link": ({"runtime/CMakeLists.txt": "add_library(tidal_device STATIC d.cpp)\n"
                                                      "target_link_libraries(tidal_device PUBLIC tidal_core\n"
                                                      "  tidal_scheduler)\n"}, "links tidal_device"),
        "sources in another layer's target": ({"runtime/CMakeLists.txt":
                                               "add_library(tidal_device STATIC device/device.cpp)\n"
                                               "target_sources(tidal_device PRIVATE scheduler/s.cpp)\n"},
                                              "adds runtime/scheduler/s.cpp to tidal_device"),
        "a missing target": ({"runtime/tracer/CMakeLists.txt": "\n"}, "no add_library(tidal_tracer"),
    }
    for what, (files, expected) in breaches.items():
        got = check(tree({**clean, **files}))
        if not any(expected in p for p in got):
            failures.append(f"{what}: expected a problem with '{expected}', got {got}")
    global LAYERS
    saved = LAYERS
    LAYERS = {**saved, "core": ("tidal_core", ("runtime/core",), ("hooks",), False)}
    try:
        got = check(tree(clean))
        if not any("cycle" in p for p in got):
            failures.append(f"a cycle in LAYERS: expected it found, got {got}")
    finally:
        LAYERS = saved
    for f in failures:
        print(f"check_layers self-test: {f}")
    print(f"check_layers self-test: {len(breaches) + 2 - len(failures)} of {len(breaches) + 2} cases pass")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--self-test"]:
        return self_test()
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[2]).resolve()
    edges: dict[str, set[str]] = {}
    problems = check(root, edges)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} layer problem(s); see Note [The build's layers] in tests/cpp/check_layers.py")
        return 1
    print(f"{len(LAYERS)} layer targets; every include and link goes down, no cycle. Found:")
    for name in LAYERS:
        print(f"  {LAYERS[name][0]:16} -> {', '.join(LAYERS[d][0] for d in sorted(edges.get(name, ()))) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
