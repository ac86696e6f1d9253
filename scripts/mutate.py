#!/usr/bin/env python3
"""Plants known bugs in a copy of the tree, one at a time, and runs the tests
meant to catch each: a bug the tests miss (a survivor) is a test to write.

Run before a release, not in CI (it takes minutes per C++ mutation):

    .venv/bin/python scripts/mutate.py                  # every mutation
    .venv/bin/python scripts/mutate.py --python-only    # no C++ build
    .venv/bin/python scripts/mutate.py --only clip-cap checkpoint-crc
    .venv/bin/python scripts/mutate.py --list

Note [Mutations never touch the checkout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The checkout is never written: its files (tracked ones and untracked ones git
does not ignore, as they are now, uncommitted edits included) are copied into
a work folder outside it, and every bug is planted in the copy and taken out
again there. The copy imports its own tidal: PYTHONPATH names the copy's
python/ and SKBUILD_EDITABLE_SKIP turns off the editable install's import
hook (which would send `import tidal` back to the checkout); a check before
any test run makes sure of it. tidal._C for the copy is either the installed
one, copied in (Python-only mutations, nothing to build), or built from the
copy with cmake into the copy's own build/mutate (TIDAL_PYTHON_INPLACE puts
the module into the copy's python/tidal/), never with pip, which would
rewire the shared venv. A C++ mutation rebuilds that module incrementally
(one object and the link), and so does taking it out.

Each mutation is an exact text replacement whose `old` text occurs exactly
once in its file (tests/python/test_mutate_script.py checks that against the
current source, so the list cannot rot silently). The selected mutations'
tests first run on the unmutated copy: a test that fails there cannot catch
anything, and the run stops.

Exit status: 0 when every planted bug was caught, 1 when one survived (or its
run errored), 2 when the set-up failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NATIVE_SUFFIXES = (".cpp", ".cc", ".h", ".hpp", ".cu")


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One known bug: `old` replaced by `new` in `path` (relative to the
    repository root), and the pytest node ids meant to catch it."""
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str

    @property
    def native(self) -> bool:
        """Whether tidal._C must be rebuilt to carry the bug."""
        return self.path.endswith(NATIVE_SUFFIXES)


T = "tests/python/"
MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="clip-cap",
        path="python/tidal/engine/optimizer_step.py",
        old="clip = min(1.0, self._config.gradient_clipping / (norm + 1e-6))",
        new="clip = self._config.gradient_clipping / (norm + 1e-6)",
        tests=(T + "test_engine.py::test_clipping_that_fires_on_some_steps_only_matches_clip_grad_norm",
               T + "test_engine_accumulation.py::"
                   "test_clipping_of_the_summed_gradients_fires_where_clip_grad_norm_does",
               T + "test_data_parallel.py::test_clipping_by_the_global_norm_fires_where_clip_grad_norm_does"),
        what="the engine's clip factor loses its cap of 1: gradients below the max norm scale up"),
    Mutation(
        name="checkpoint-crc",
        path="python/tidal/engine/checkpoint.py",
        old='if len(data) != e["bytes"] or zlib.crc32(data) != e["crc32"]:',
        new='if len(data) != e["bytes"]:',
        tests=(T + "test_checkpoint.py::test_another_model_or_a_corrupt_file_is_a_clear_error",),
        what="load_checkpoint no longer checks a slot's CRC-32: a corrupt file loads"),
    Mutation(
        name="bias-correction-step",
        path="python/tidal/engine/optimizer_step.py",
        old="[r.step for r in members])\n",
        new="[r.step + 1 for r in members])\n",
        tests=(T + "test_engine.py::test_gpt_fp32_matches_adamw_under_a_small_budget",),
        what="the engine hands the chunk step one Adam step too many (bias correction of step t + 1)"),
    Mutation(
        name="bias-correction-step-kernel",
        path="cpu_adam/adam.cpp",
        old="const double t = static_cast<double>(step);",
        new="const double t = static_cast<double>(step + 1);",
        tests=(T + "test_cpu_adam.py::test_matches_torch_over_100_steps",
               T + "test_engine.py::test_gpt_fp32_matches_adamw_under_a_small_budget"),
        what="CPU Adam's bias correction counts one step too many"),
    Mutation(
        name="eviction-soonest",
        path="runtime/scheduler/eviction_policy.cpp",
        old="if (next > best_next || (next == best_next && time < best_time)) {",
        new="if (next < best_next || (next == best_next && time < best_time)) {",
        tests=(T + "test_engine_eviction.py",),
        what="OPT evicts the chunk needed soonest instead of the one needed latest"),
    Mutation(
        name="dtr-rng-replay",
        path="hooks/dtr/interceptor.cpp",
        old="        old_state = get_state(*gen);\n        set_state(*gen, r.rng->state);\n",
        new="        old_state = get_state(*gen);\n",
        tests=(T + "test_dtr.py::test_transformer_with_dropout_replays_rng",
               T + "test_engine_dtr.py::test_dropout_replays_identically_under_the_engine"),
        what="a DTR replay of a random op draws from the generator's current state, not the saved one"),
    Mutation(
        name="bf16-state-truncates",
        path="cpu_adam/float16.h",
        old="return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);",
        new="return static_cast<std::uint16_t>(u >> 16);",
        tests=(T + "test_cpu_adam.py::test_bf16_optimizer_state_rounds_like_torch",),
        what="the scalar kernels store bf16 by truncation, not round-to-nearest-even"),
    Mutation(
        name="kernel-clip-cap",
        path="cpu_adam/adam.cpp",
        old="result.clip_coef = std::min(1.0, options.max_grad_norm / (result.grad_norm + 1e-6));",
        new="result.clip_coef = options.max_grad_norm / (result.grad_norm + 1e-6);",
        tests=(T + "test_cpu_adam.py::test_loss_scale_and_clipping_match_torch_clip_grad_norm",),
        what="cpu_adam.adam_step's clip factor loses its cap of 1"),
)


def check(mutation: Mutation, root: Path = ROOT) -> str:
    """The file's text; ValueError unless `old` occurs in it exactly once."""
    path = root / mutation.path
    if not path.is_file():
        raise ValueError(f"mutation {mutation.name!r}: {mutation.path} does not exist")
    text = path.read_text()
    n = text.count(mutation.old)
    if n != 1:
        raise ValueError(f"mutation {mutation.name!r}: expected its old text once in {mutation.path}, "
                         f"found it {n} times; the source changed: update the mutation\n"
                         f"old text: {mutation.old!r}")
    if mutation.old == mutation.new:
        raise ValueError(f"mutation {mutation.name!r}: old and new text are the same")
    return text


def log(*parts):
    print("[mutate]", *parts, file=sys.stderr, flush=True)


class Copy:
    """The work copy of the tree. Every write goes through write(), which
    refuses paths outside the copy (Note [Mutations never touch the checkout])."""

    def __init__(self, work: Path):
        self.work = work.resolve()
        if self.work == ROOT or ROOT in self.work.parents:
            raise SystemExit(f"the work folder {self.work} is inside the checkout {ROOT}; "
                             f"pick one outside it")

    def populate(self):
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                                "--exclude-standard"], check=True, capture_output=True).stdout
        count = 0
        for name in files.decode().split("\0"):
            src = ROOT / name
            if not name or not src.is_file() or src.is_symlink():
                continue  # (a deleted tracked file; links are not followed)
            dst = self.path(name)
            dst.parent.mkdir(parents=True, exist_ok=True)
            # copy2 keeps the times: a kept build folder rebuilds only what changed.
            if not dst.exists() or dst.read_bytes() != src.read_bytes():
                shutil.copy2(src, dst)
            count += 1
        log(f"copied {count} files of {ROOT} into {self.work}")

    def path(self, relative: str) -> Path:
        p = (self.work / relative).resolve()
        if self.work not in p.parents:
            raise RuntimeError(f"{p} is outside the work copy {self.work}")
        return p

    def write(self, relative: str, text: str):
        path = self.path(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def editable_hook_paths() -> list[str]:
    """The build folders of editable installs of tidal in this interpreter
    (scikit-build-core's import hook, which SKBUILD_EDITABLE_SKIP turns off)."""
    out = []
    for finder in sys.meta_path:
        known = getattr(finder, "known_source_files", None)
        if isinstance(known, dict) and any(k == "tidal" or k.startswith("tidal.") for k in known):
            if getattr(finder, "path", None):
                out.append(finder.path)
    return out


class Runner:
    INSTALLED_MARK = "build/mutate-installed-module"

    def __init__(self, copy: Copy, args):
        self.copy, self.args = copy, args
        self.build_dir = copy.work / "build" / "mutate"
        self.dirty = False      # a C++ file changed since the last build
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(copy.work / "python")] +
                                            ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        skip = editable_hook_paths()
        if skip:
            env["SKBUILD_EDITABLE_SKIP"] = os.pathsep.join(skip + [env.get("SKBUILD_EDITABLE_SKIP", "")])
        env.pop("TIDAL_CPP_BUILD", None)
        self.env = env

    # -- tidal._C for the copy ------------------------------------------------
    def use_installed_module(self):
        found = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                                "print(u.find_spec('tidal._C').origin)"],
                               cwd=str(ROOT), capture_output=True, text=True)
        origin = Path(found.stdout.strip()) if found.returncode == 0 else None
        if origin is None or not origin.is_file():
            raise SystemExit(f"no installed tidal._C to copy ({found.stderr.strip()[-500:]}); "
                             f"run with --build")
        dst = self.copy.path("python/tidal/" + origin.name)
        shutil.copy2(origin, dst)
        # A later build in this work folder must not take it for its own output.
        self.copy.write(self.INSTALLED_MARK, origin.name)
        log(f"tidal._C: the installed {origin}")

    def build(self):
        """Configures once, then builds incrementally: tidal._C into the copy's python/tidal/."""
        mark = self.copy.path(self.INSTALLED_MARK)
        if mark.exists():  # the installed module copied in earlier: link ours anew
            self.copy.path("python/tidal/" + mark.read_text()).unlink(missing_ok=True)
            mark.unlink()
        if not (self.build_dir / "build.ninja").exists():
            cmd = ["cmake", "-S", str(self.copy.work), "-B", str(self.build_dir), "-G", "Ninja",
                   "-DCMAKE_BUILD_TYPE=Release", "-DTIDAL_BUILD_PYTHON=ON", "-DTIDAL_BUILD_TESTS=OFF",
                   "-DTIDAL_BUILD_BENCHMARKS=OFF", "-DTIDAL_PYTHON_INPLACE=ON", "-DTIDAL_WITH_CUDA=OFF",
                   f"-DPython_EXECUTABLE={sys.executable}"]
            log("configuring", self.build_dir)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"cmake configure failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        t0 = time.monotonic()
        done = subprocess.run(["cmake", "--build", str(self.build_dir), "-j", str(self.args.jobs)],
                              capture_output=True, text=True)
        log(f"build: {time.monotonic() - t0:.0f} s")
        self.dirty = False
        return done

    def ensure_module(self, need_build: bool):
        if need_build or self.args.build:
            done = self.build()
            if done.returncode != 0:
                raise SystemExit(f"the unmutated copy does not build:\n{done.stdout[-4000:]}")
        else:
            self.use_installed_module()
        probe = subprocess.run([sys.executable, "-c", "import tidal, tidal._C; print(tidal.__file__); "
                                "print(tidal._C.__file__)"], cwd=str(self.copy.work), env=self.env,
                               capture_output=True, text=True)
        where = probe.stdout.split()
        if probe.returncode != 0 or len(where) != 2 or \
                not all(Path(w).resolve().is_relative_to(self.copy.work) for w in where):
            raise SystemExit(f"the copy does not import its own tidal (got {where}):\n"
                             f"{probe.stderr[-3000:]}")

    # -- tests -------------------------------------------------------------------
    def pytest(self, tests) -> tuple[int, list[str], str, float]:
        """(return code, failed test ids, output tail, seconds); rc -1 on a timeout."""
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
        if self.args.fail_fast:
            cmd.append("-x")
        cmd += list(tests)
        t0 = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=str(self.copy.work), env=self.env, capture_output=True,
                                  text=True, timeout=self.args.timeout)
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            return -1, [], out[-3000:], time.monotonic() - t0
        out = done.stdout + done.stderr
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
        return done.returncode, failed, out[-3000:], time.monotonic() - t0

    def run(self, mutation: Mutation) -> dict:
        text = check(mutation, self.copy.work)
        self.copy.write(mutation.path, text.replace(mutation.old, mutation.new))
        try:
            if mutation.native:
                self.dirty = True
                done = self.build()
                if done.returncode != 0:
                    return {"result": "invalid (does not build)", "failed": [],
                            "output": done.stdout[-3000:], "seconds": 0.0}
            elif self.dirty:
                self.build()
            rc, failed, out, seconds = self.pytest(mutation.tests)
        finally:
            self.copy.write(mutation.path, text)
            if mutation.native:
                self.dirty = True
        result = ("caught" if rc == 1 else "SURVIVED" if rc == 0 else
                  "caught (timeout)" if rc == -1 else f"error (pytest exit {rc})")
        return {"result": result, "failed": failed, "output": out, "seconds": seconds}


def summarize(failed: list[str]) -> str:
    """'test_x.py::test_y (3), ...': failed test ids by function, without the
    folder and the parameters."""
    counts: dict[str, int] = {}
    for node in failed:
        key = re.sub(r"\[.*\]$", "", node.rsplit("/", 1)[-1])
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} ({n})" for k, n in counts.items()) or "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    p.add_argument("--python-only", action="store_true", help="skip the mutations that need a C++ build")
    p.add_argument("--build", action="store_true",
                   help="build tidal._C from the copy even for Python-only mutations (when the "
                        "installed module is older than the checkout's C++)")
    p.add_argument("--workdir", type=Path,
                   help="work folder (outside the checkout), kept afterwards: a second run reuses "
                        "its build; default: a temporary folder, removed")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build jobs")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutation's test run")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip running the tests on the unmutated copy first")
    p.add_argument("--fail-fast", action="store_true", help="stop each test run at its first failure")
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)

    selected = list(MUTATIONS)
    if args.only:
        names = {m.name for m in MUTATIONS}
        unknown = sorted(set(args.only) - names)
        if unknown:
            p.error(f"unknown mutation(s) {unknown}; known: {sorted(names)}")
        selected = [m for m in MUTATIONS if m.name in args.only]
    if args.python_only:
        selected = [m for m in selected if not m.native]
    if args.list:
        for m in selected:
            print(f"{m.name:28} {'C++' if m.native else 'Python':6} {m.path}\n{'':35}{m.what}")
        return 0
    for m in selected:
        check(m)
    # Python-only first: the C++ ones leave a rebuild behind them.
    selected.sort(key=lambda m: m.native)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tidal-mutate-"))
    work.mkdir(parents=True, exist_ok=True)
    copy = Copy(work)
    results = []
    try:
        copy.populate()
        runner = Runner(copy, args)
        runner.ensure_module(need_build=any(m.native for m in selected))
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for m in selected for t in m.tests))
            log(f"baseline: {len(tests)} test selections on the unmutated copy")
            rc, failed, out, seconds = runner.pytest(tests)
            if rc != 0:
                log(f"the tests fail without any mutation (exit {rc}, {seconds:.0f} s): {failed}\n{out}")
                return 2
            log(f"baseline passed in {seconds:.0f} s")
        for m in selected:
            log(f"{m.name}: {m.what}")
            r = runner.run(m)
            r.update(name=m.name, path=m.path, native=m.native, tests=list(m.tests))
            results.append(r)
            log(f"{m.name}: {r['result']} in {r['seconds']:.0f} s; failed: {', '.join(r['failed']) or '-'}")
            if r["result"] != "caught" and not r["result"].startswith("caught"):
                log(r["output"])
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'mutation':28} {'kind':6} {'result':24} {'s':>6}  caught by (failed cases)")
    for r in results:
        print(f"{r['name']:28} {'C++' if r['native'] else 'Py':6} {r['result']:24} {r['seconds']:6.0f}  "
              f"{summarize(r['failed'])}")
    survivors = [r["name"] for r in results if not r["result"].startswith("caught")]
    print(f"\n{len(results) - len(survivors)} of {len(results)} planted bugs caught"
          + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "output"} for r in results],
                                        indent=1))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
