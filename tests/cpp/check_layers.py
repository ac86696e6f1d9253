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
    upward or sideways include), with quotes or angle brackets alike (an
    include is the repository's when the file is there, from the root or,
    quoted, from the including file's folder), or includes libtorch, ATen,
    c10 or pybind11 outside the layers that may (hooks, dtr_torch, python);
  * an include looks like the repository's (quoted without a folder, or
    under one of the root's folders) but names no file there: a stale path
    would otherwise pass unseen;
  * a CMakeLists.txt adds sources to a target of another layer than the
    folder it sits in, or links a layer target to one it may not use (names
    read through set(), list(APPEND), file(GLOB) variables and generator
    expressions, not only literal ones);
  * a layer's target is missing from the CMake files;
  * the include and link graph between targets has a cycle;
  * the Python package breaks Note [The Python package's layers] (below).
Run as `python3 tests/cpp/check_layers.py [ROOT]`; CTest runs it
(tests/cpp/CMakeLists.txt, label "layers"), with --self-test too;
tests/python/test_check_layers.py plants breaches in a copy of the real tree.

Note [The Python package's layers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The package python/tidal has layers too (PY_LAYERS), each a set of modules
that imports only its own layer and the ones below it:

    front (tidal itself, deepspeed, integrations, estimate, train, ...)
      -> engine (tidal.engine) -> config (and its schema) -> recompute -> dtr -> base -> _C
      -> optim -> _C

where base holds the leaf modules (device, _schema, data_parallel,
lr_schedules, profile, data, models, the DeepSpeed key tables). Imports
inside functions count as much as those at the top. Over the bindings, tidal._C:
  * the chunk store and scheduler (`_C.chunks.Chunks`) are made only by
    their owners (SCHEDULER_OWNERS: the engine's ParamStore, and the
    estimators, which build stores of their own); the hooks' bindings
    (`ModuleHooks`, `MemoryTracer`) only by the engine (HOOKS_USERS);
  * a slot's state is the store's: the calls that change it on a Chunks
    object (access, release, set_state; SLOT_CALLS) are made only in
    SCHEDULER_OWNERS; the rest of the engine takes a slot through
    ParamStore.slots(), or holds one beyond a block with ParamStore.pin().
"""
from __future__ import annotations

import ast
import glob
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
CMAKE_SET = re.compile(r"\b(?:set|list|file)\s*\(", re.I)
CMAKE_VAR = re.compile(r"\$\{([A-Za-z0-9_]+)\}")
GENERATOR = re.compile(r"\$<[^<>]*:([^<>]*)>")
# The CMake variables that name the source tree.
ROOT_VARS = ("PROJECT_SOURCE_DIR", "CMAKE_SOURCE_DIR", "TIDAL_SOURCE_ROOT")

# Note [The Python package's layers]: name -> (modules, layers it imports directly).
# A module is in the layer of its longest listed prefix; "tidal" is the package itself only.
PY_LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "_C": (("tidal._C",), ()),
    "base": (("tidal._version", "tidal._schema", "tidal.device", "tidal.data_parallel", "tidal.lr_schedules",
              "tidal.profile", "tidal.data", "tidal.models", "tidal._deepspeed_keys", "tidal._deepspeed_rules",
              "tidal._testing"),
             ("_C",)),
    "dtr": (("tidal.dtr",), ("base",)),
    "recompute": (("tidal.recompute",), ("dtr",)),
    "config": (("tidal.config", "tidal._config_schema"), ("recompute",)),
    "optim": (("tidal.optim",), ("_C",)),
    "engine": (("tidal.engine",), ("config", "optim")),
    "front": (("tidal", "tidal.deepspeed", "tidal._deepspeed_compat", "tidal.integrations", "tidal.estimate",
               "tidal._estimate_model", "tidal.train", "tidal.device_demo"), ("engine",)),
}
# The bound classes of tidal._C.chunks and the modules that may name them.
SCHEDULER_OWNERS = ("tidal.engine.store", "tidal.estimate", "tidal._estimate_model")
HOOKS_USERS = ("tidal.engine",)
BOUND_CLASSES = {"Chunks": SCHEDULER_OWNERS, "ModuleHooks": HOOKS_USERS, "MemoryTracer": HOOKS_USERS}
# The calls on a Chunks object that change a slot's state.
SLOT_CALLS = ("access", "release", "set_state")


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


def cmake_calls(text: str, opener: re.Pattern) -> list[tuple[str, str, list[str]]]:
    """(command, first argument, other arguments) of each call `opener` finds, comments removed."""
    text = re.sub(r"(^|\s)#[^\n]*", r"\1", text)
    out = []
    for m in opener.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        args = text[m.end():i - 1].split()
        if args:
            out.append((m.group(0).split("(")[0].strip().lower(), args[0], args[1:]))
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
    cmakes = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIPPED_FOLDERS
                       and not (Path(dirpath) == root and d.startswith("build"))]
        if "CMakeLists.txt" in filenames:
            cmakes.append(Path(dirpath) / "CMakeLists.txt")
    variables = cmake_variables(root, cmakes)
    for cmake in sorted(cmakes):
        check_cmake(root, cmake, by_target, edges, defined, problems, variables)
    top_folders = {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                   and not d.name.startswith("build") and d.name not in SKIPPED_FOLDERS}
    for full in sorted(files):
        rel = full.relative_to(root).as_posix()
        own = layer_of(rel)
        if own is None:
            continue
        if not full.name.endswith(SOURCE_SUFFIXES):
            continue
        ok = allowed(own)
        for kind, header in INCLUDE.findall(full.read_text(errors="replace")):
            shown = f"<{header}>" if kind == "<" else f'"{header}"'
            path = resolve_include(root, rel, kind, header)
            if path is None:
                if kind == '"' and "/" not in header or header.split("/")[0] in top_folders:
                    problems.append(f"{rel}: includes {shown}, which looks like the repository's but "
                                    f"names no file in it")
                elif header.startswith(TORCH_HEADERS) and not LAYERS[own][3]:
                    problems.append(f"{rel}: includes {shown}, but layer '{own}' "
                                    f"({LAYERS[own][0]}) builds without libtorch")
                continue
            target = layer_of(path)
            if target is None or target == own:
                continue  # not a layer's file (tests/...), or its own
            edges[own].add(target)
            if target not in ok:
                problems.append(f"{rel}: includes {shown} of layer '{target}' "
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
    if (root / "python" / "tidal").is_dir():
        problems += check_python(root / "python")
    return problems


def resolve_include(root: Path, rel: str, kind: str, header: str) -> str | None:
    """The repository path an include names (from the root, or a quoted one
    from the including file's folder), or None when no file there has it."""
    if (root / header).is_file():
        return header
    if kind == '"':
        local = os.path.normpath(os.path.join(os.path.dirname(rel), header)).replace(os.sep, "/")
        if not local.startswith("../") and (root / local).is_file():
            return local
    return None


def cmake_variables(root: Path, cmakes: list[Path]) -> dict[str, list[str]]:
    """Every variable set(), list(APPEND) or file(GLOB) gives a value in any of
    `cmakes`, all values of a name together (scopes and order ignored: the
    check sees every name a variable may hold). Paths come out absolute."""
    out: dict[str, list[str]] = {}
    for cmake in cmakes:
        for command, first, args in cmake_calls(cmake.read_text(errors="replace"), CMAKE_SET):
            if command == "set":
                name, values = first, args
                if "CACHE" in values:
                    values = values[:values.index("CACHE")]
            elif command == "list" and first.upper() == "APPEND" and args:
                name, values = args[0], args[1:]
            elif command == "file" and first.upper() in ("GLOB", "GLOB_RECURSE") and args:
                name, patterns = args[0], [a for a in args[1:] if a not in ("CONFIGURE_DEPENDS",)]
                values = []
                for pattern in (p for a in patterns for p in expand(a, cmake.parent, root, {})):
                    if not os.path.isabs(pattern):
                        pattern = str(cmake.parent / pattern)
                    values += sorted(glob.glob(pattern, recursive=first.upper() == "GLOB_RECURSE"))
            else:
                continue
            out.setdefault(name, []).extend(v.strip('"') for v in values if v != "PARENT_SCOPE")
    return out


def expand(arg: str, folder: Path, root: Path, variables: dict[str, list[str]],
           seen: frozenset[str] = frozenset()) -> list[str]:
    """`arg` with its variables and generator expressions replaced: a list, as
    a variable may hold several values. Unknown variables stay as they are, and
    so does one met again inside its own value (set(X ${X} more))."""
    arg = arg.strip('"')
    while GENERATOR.search(arg):  # innermost first: $<$<BOOL:X>:tidal_chunk> -> tidal_chunk
        arg = GENERATOR.sub(lambda m: m.group(1), arg)
    whole = CMAKE_VAR.fullmatch(arg)
    if whole and whole.group(1) in variables and whole.group(1) not in seen:
        inner = seen | {whole.group(1)}
        return [v for value in variables[whole.group(1)] for v in expand(value, folder, root, variables, inner)
                if v != arg]

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name in ROOT_VARS:
            return str(root)
        if name == "CMAKE_CURRENT_SOURCE_DIR":
            return str(folder)
        values = variables.get(name)
        return ";".join(values) if values else m.group(0)

    return [part for part in CMAKE_VAR.sub(one, arg).split(";") if part]


def check_cmake(root: Path, cmake: Path, by_target: dict[str, str], edges: dict[str, set[str]],
                defined: set[str], problems: list[str], variables: dict[str, list[str]]) -> None:
    """A CMakeLists.txt: the sources of a layer's target lie in the layer's
    folders, and its links go to layers it may use."""
    rel = cmake.relative_to(root).as_posix()
    text = cmake.read_text(errors="replace")

    def words(args: list[str]) -> list[str]:
        return [w for a in args for w in expand(a, cmake.parent, root, variables)]

    for _, target, args in cmake_calls(text, CMAKE_ADD):
        layer = by_target.get(target)
        if layer is None:
            continue  # not a layer's target (a test helper)
        defined.add(target)
        for arg in words(args):
            if not arg.endswith(SOURCE_SUFFIXES) or "$" in arg:
                continue
            full = os.path.normpath(arg if os.path.isabs(arg) else os.path.join(cmake.parent, arg))
            source = os.path.relpath(full, root).replace(os.sep, "/")
            if layer_of(source) != layer:
                problems.append(f"{rel}: adds {source} to {target} (layer '{layer}'), but the file "
                                f"belongs to layer '{layer_of(source)}'")
    for _, target, args in cmake_calls(text, CMAKE_LINK):
        layer = by_target.get(target)
        if layer is None:
            continue
        ok = allowed(layer)
        for arg in words(args):
            dep = by_target.get(arg)
            if dep is None or dep == layer:
                continue
            edges[layer].add(dep)
            if dep not in ok:
                problems.append(f"{rel}: links {target} (layer '{layer}') to {arg} (layer '{dep}'), "
                                f"which it may not use (it uses: {', '.join(sorted(ok - {layer}))})")


def py_layer_of(module: str) -> str | None:
    """The Python layer of `module` (Note [The Python package's layers]), by its longest prefix."""
    best, best_len = None, -1
    for name, (prefixes, _) in PY_LAYERS.items():
        for prefix in prefixes:
            hit = module == prefix or (prefix != "tidal" and module.startswith(prefix + "."))
            if hit and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    return best


def py_allowed(name: str) -> set[str]:
    out, todo = {name}, [name]
    while todo:
        for dep in PY_LAYERS[todo.pop()][1]:
            if dep not in out:
                out.add(dep)
                todo.append(dep)
    return out


def py_modules(top: Path) -> dict[str, Path]:
    """module name -> file, for every module of the package python/tidal under `top`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top / "tidal"):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_FOLDERS and not d.startswith(".")]
        for f in filenames:
            if f.endswith(".py"):
                path = Path(dirpath) / f
                parts = list(path.relative_to(top).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                out[".".join(parts)] = path
    return out


def py_imports(module: str, path: Path, tree: ast.AST, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module imported) of every import of a tidal module in `tree`,
    functions' own included. `from P import n` imports module P.n when there is
    one (tidal._C counts as a module), else P itself."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tidal"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "tidal":
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                out.append((node.lineno, sub if sub in modules or sub == "tidal._C" else source))
    return out


def chunks_objects(function: ast.AST) -> set[str]:
    """The local names bound in `function` to a Chunks object (`c = self.chunks`)."""
    out = set()

    def bind(target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            for t, v in zip(target.elts, value.elts):
                bind(t, v)
        elif isinstance(target, ast.Name) and is_chunks(value, set()):
            out.add(target.id)

    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, node.value)
    return out


def is_chunks(node: ast.AST, local: set[str]) -> bool:
    """Whether `node` names a Chunks object: `chunks`, `x.chunks`, `src_chunks`, or a local bound to one."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return bool(re.search(r"(^|_)chunks$", name)) or (isinstance(node, ast.Name) and node.id in local)


def check_python(top: Path) -> list[str]:
    """The problems of the package under `top` (python/) with Note [The Python package's layers]."""
    problems: list[str] = []
    for name, (_, uses) in PY_LAYERS.items():
        for dep in uses:
            if dep not in PY_LAYERS:
                problems.append(f"PY_LAYERS: layer '{name}' uses '{dep}', which is not a layer")
    cycle = find_cycle({n: set(spec[1]) for n, spec in PY_LAYERS.items()})
    if cycle:
        return problems + [f"PY_LAYERS itself has a cycle: {' -> '.join(cycle)}"]
    modules = py_modules(top)
    reaching: dict[str, list[str]] = {}
    for module, path in sorted(modules.items()):
        rel = path.relative_to(top.parent).as_posix()
        own = py_layer_of(module)
        if own is None:
            problems.append(f"{rel}: module {module} is in no layer of PY_LAYERS")
            continue
        tree = ast.parse(path.read_text(errors="replace"), filename=str(path))
        ok = py_allowed(own)
        for line, imported in py_imports(module, path, tree, set(modules)):
            target = py_layer_of(imported)
            if target is not None and target not in ok:
                problems.append(f"{rel}:{line}: imports {imported} (layer '{target}'), which layer "
                                f"'{own}' may not use (it uses: {', '.join(sorted(ok - {own})) or 'nothing'})")
        for node in ast.walk(tree):
            named = None
            if isinstance(node, ast.Attribute) and node.attr in BOUND_CLASSES and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "chunks":
                named = node.attr
            elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_C.chunks"):
                named = next((a.name for a in node.names if a.name in BOUND_CLASSES), None)
            if named and not any(module == m or module.startswith(m + ".") for m in BOUND_CLASSES[named]):
                problems.append(f"{rel}:{node.lineno}: names _C.chunks.{named}, which only "
                                f"{', '.join(BOUND_CLASSES[named])} may")
        if module in SCHEDULER_OWNERS:
            continue
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            local = chunks_objects(function)
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in SLOT_CALLS and is_chunks(node.func.value, local):
                    reaching.setdefault(module, []).append(f"{function.name}:{node.lineno} {node.func.attr}")
    for module, calls in sorted(reaching.items()):
        problems.append(f"{modules[module].relative_to(top.parent).as_posix()}: changes slot states on "
                        f"the scheduler ({', '.join(sorted(set(calls)))}); only "
                        f"{', '.join(SCHEDULER_OWNERS)} may: ask the ParamStore")
    return problems


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
        "runtime/tracer/t.h": '#include <runtime/scheduler/s.h>\n#include "hwy/highway.h"\n',
        "hooks/dtr/CMakeLists.txt": "add_library(tidal_dtr_torch STATIC s.cpp)\n",
        "python/CMakeLists.txt": "file(GLOB SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/*.cpp)\n"
                                 "Python_add_library(_C MODULE ${SOURCES})\n",
        "python/csrc/m.cpp": '#include <hooks/m.h>\n#include "bindings.h"\n',
        "python/csrc/bindings.h": "#pragma once\n",
        "hooks/m.h": "#pragma once\n",
        "python/tidal/__init__.py": "from tidal import _C\nfrom tidal.engine import Engine\n",
        "python/tidal/dtr.py": "from tidal import _C\n",
        "python/tidal/engine/__init__.py": "from .engine import Engine\n",
        "python/tidal/engine/engine.py": "from .. import dtr as _dtr\nfrom .store import ParamStore\n"
                                         "class Engine:\n    def stats(self):\n        return self.chunks.stats()\n",
        "python/tidal/engine/store.py": "from .. import _C\nclass ParamStore:\n    def read(self, i):\n"
                                        "        c = self.chunks = _C.chunks.Chunks()\n        return c.access(i)\n",
        "python/tidal/engine/hook_wiring.py": "from .. import _C\nHOOKS = _C.chunks.ModuleHooks\n",
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
        "an upward include in angle brackets": ({"chunk/bad.h": "#include <runtime/scheduler/s.h>\n"},
                                                "may not use"),
        "a local include of another layer": ({"runtime/tracer/bad.cpp": '#include "../scheduler/s.h"\n'
                                                                          '#include "../../hooks/m.h"\n'},
                                             "of layer 'hooks'"),
        "an include of a file not in the tree": ({"chunk/bad.h": '#include "chunk/gone.h"\n'},
                                                 "names no file"),
        "an angle include of a file not in the tree": ({"hooks/bad.h": "#include <runtime/gone.h>\n"},
                                                       "names no file"),
        "a link through a variable": ({"runtime/CMakeLists.txt": "add_library(tidal_device STATIC device/device.cpp)\n"
                                                                 "set(DEPS tidal_core)\n"
                                                                 "set(DEPS ${DEPS} tidal_scheduler)\n"
                                                                 "target_link_libraries(tidal_device PUBLIC ${DEPS})\n"},
                                      "links tidal_device"),
        "a link in a generator expression": ({"runtime/CMakeLists.txt":
                                              "add_library(tidal_device STATIC device/device.cpp)\n"
                                              "target_link_libraries(tidal_device PUBLIC\n"
                                              "  $<$<BOOL:ON>:tidal_chunk>)\n"}, "links tidal_device"),
        "sources through a glob": ({"runtime/scheduler/s.cpp": "\n",
                                    "runtime/CMakeLists.txt": "add_library(tidal_device STATIC device/device.cpp)\n"
                                                              "file(GLOB MORE ${CMAKE_CURRENT_SOURCE_DIR}/scheduler/*.cpp)\n"
                                                              "target_sources(tidal_device PRIVATE ${MORE})\n"},
                                   "adds runtime/scheduler/s.cpp to tidal_device"),
        "a Python import upward": ({"python/tidal/dtr.py": "from tidal import _C\n"
                                                            "def f():\n    from tidal.engine import Engine\n"},
                                   "imports tidal.engine (layer 'engine')"),
        "a Python module in no layer": ({"python/tidal/newthing.py": "\n"}, "in no layer"),
        "the scheduler made outside its owners": ({"python/tidal/engine/engine.py": "from .. import _C\n"
                                                                                     "C = _C.chunks.Chunks\n"},
                                                  "names _C.chunks.Chunks"),
        "the hooks' binding outside the engine": ({"python/tidal/dtr.py": "from tidal._C.chunks import ModuleHooks\n"},
                                                  "names _C.chunks.ModuleHooks"),
        "a slot state changed past the store": ({"python/tidal/engine/engine.py":
                                                 "class Engine:\n    def f(self, i):\n"
                                                 "        dp, c = 1, self.chunks\n        c.release(i)\n"},
                                                "changes slot states on the scheduler (f:4 release)"),
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
    print(f"The Python package keeps its {len(PY_LAYERS)} layers; slot states are changed only by "
          f"{', '.join(SCHEDULER_OWNERS)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
