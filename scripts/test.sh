#!/usr/bin/env bash
# Every test tidal has: the C++ suites (plain build, then AddressSanitizer +
# UndefinedBehaviorSanitizer, then ThreadSanitizer on the threaded suites) and
# the Python suite. Does the set-up first (scripts/setup.sh).
#   TIDAL_TEST_QUICK=1    skips the sanitizer builds (for a fast local loop).
#   TIDAL_TEST_WORKERS=N  Python test processes (default 2; 0: one process).
#   TIDAL_TEST_FULL=1     every long Python sweep in full (CI runs a part of each).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh

JOBS="${TIDAL_JOBS:-$(nproc)}"
log() { printf '\n[test] %s\n' "$*" >&2; }

# The three test trees compile through ccache (scripts/setup.sh installs it):
# a later run on the same machine, from any clone folder (paths are taken
# relative to the clone), compiles only the files that changed. Its cache is
# ccache's own (~/.cache/ccache, at most CCACHE_MAXSIZE); CCACHE_DISABLE=1
# compiles everything.
LAUNCHER=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-4G}"
  LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi

# Configures a build folder once; afterwards ninja re-runs cmake by itself
# whenever a CMakeLists.txt changes. Builds `target` (all: everything).
build() {
  local dir="$1" target="$2"; shift 2
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S . -B "$dir" -G Ninja "${LAUNCHER[@]}" "$@" >"$dir.configure.log" 2>&1 \
      || { cat "$dir.configure.log"; exit 1; }
  fi
  cmake --build "$dir" -j "$JOBS" --target "$target"
}

# The libtorch suites (DTR's C++ side, hooks/dtr) build against the venv's torch.
TORCH_TESTS=(-DPython_EXECUTABLE="$ROOT/.venv/bin/python")

log "C++ tests (RelWithDebInfo, CUDA backend compiled where nvcc is found)"
build build/cpp all -DCMAKE_BUILD_TYPE=RelWithDebInfo "${TORCH_TESTS[@]}"
ctest --test-dir build/cpp -j "$JOBS" --output-on-failure --no-tests=error

log "CPU Adam suites again with Highway's baseline (scalar) target forced"
TIDAL_CPU_ADAM_TARGET=baseline ctest --test-dir build/cpp -j "$JOBS" -L cpu_adam --output-on-failure \
  --no-tests=error

if [ "${TIDAL_TEST_QUICK:-0}" != "1" ]; then
  # The sanitizer trees keep line tables only (-g1): their reports still name
  # file and line, and each file compiles in about three quarters of the time
  # (full debug info of the libtorch and GoogleTest templates is most of it).
  SANITIZER_FLAGS=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG")
  log "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  build build/asan all "${SANITIZER_FLAGS[@]}" -DTIDAL_SANITIZE="address;undefined" \
    -DTIDAL_DEBUG_FULL=ON -DTIDAL_BUILD_BENCHMARKS=OFF "${TORCH_TESTS[@]}"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build/asan -j "$JOBS" --output-on-failure --no-tests=error

  # Only the executables it runs (tests/cpp/CMakeLists.txt: every one labelled "threaded").
  log "threaded C++ tests under ThreadSanitizer"
  build build/tsan tidal_threaded_tests "${SANITIZER_FLAGS[@]}" -DTIDAL_SANITIZE=thread \
    -DTIDAL_BUILD_BENCHMARKS=OFF -DTIDAL_TORCH_TESTS=OFF
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build/tsan -j "$JOBS" -L threaded --output-on-failure --no-tests=error
fi

log "Python CPU Adam tests with the baseline (scalar) target forced"
TIDAL_CPU_ADAM_TARGET=baseline .venv/bin/python -m pytest -q tests/python/test_cpu_adam.py tests/python/test_cpu_adam_api.py

# On TIDAL_TEST_WORKERS processes (pytest-xdist; 0: in this one), each test file
# whole on one of them (--dist loadfile), so a file's module fixtures and the
# order of its tests are as when it runs alone. Long sweeps run a part of
# each; TIDAL_TEST_FULL=1 runs them all (tests/python/engine_helpers.py). The
# 30 slowest tests are listed at the end: the suite's time is CI's budget.
log "Python tests"
TIDAL_CPP_BUILD="$ROOT/build/cpp" .venv/bin/python -m pytest -q -n "${TIDAL_TEST_WORKERS:-2}" \
  --dist loadfile --durations=30 tests/python
