#!/usr/bin/env bash
# Every test tidal has: the C++ suites (plain build, then AddressSanitizer +
# UndefinedBehaviorSanitizer, then ThreadSanitizer on the threaded suites) and
# the Python suite. Does the set-up first (scripts/setup.sh).
#   TIDAL_TEST_QUICK=1  skips the sanitizer builds (for a fast local loop).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh

JOBS="${TIDAL_JOBS:-$(nproc)}"
log() { printf '\n[test] %s\n' "$*" >&2; }

# Configures a build folder once; afterwards ninja re-runs cmake by itself
# whenever a CMakeLists.txt changes.
build() {
  local dir="$1"; shift
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S . -B "$dir" -G Ninja "$@" >"$dir.configure.log" 2>&1 \
      || { cat "$dir.configure.log"; exit 1; }
  fi
  cmake --build "$dir" -j "$JOBS"
}

# The libtorch suites (DTR's C++ side, hooks/dtr) build against the venv's torch.
TORCH_TESTS=(-DPython_EXECUTABLE="$ROOT/.venv/bin/python")

log "C++ tests (RelWithDebInfo, CUDA backend compiled where nvcc is found)"
build build/cpp -DCMAKE_BUILD_TYPE=RelWithDebInfo "${TORCH_TESTS[@]}"
ctest --test-dir build/cpp -j "$JOBS" --output-on-failure --no-tests=error

log "CPU Adam suites again with Highway's baseline (scalar) target forced"
TIDAL_CPU_ADAM_TARGET=baseline ctest --test-dir build/cpp -j "$JOBS" -L cpu_adam --output-on-failure \
  --no-tests=error

if [ "${TIDAL_TEST_QUICK:-0}" != "1" ]; then
  log "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  build build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIDAL_SANITIZE="address;undefined" \
    -DTIDAL_DEBUG_FULL=ON -DTIDAL_BUILD_BENCHMARKS=OFF "${TORCH_TESTS[@]}"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build/asan -j "$JOBS" --output-on-failure --no-tests=error

  log "threaded C++ tests under ThreadSanitizer"
  build build/tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIDAL_SANITIZE=thread \
    -DTIDAL_BUILD_BENCHMARKS=OFF -DTIDAL_TORCH_TESTS=OFF
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build/tsan -j "$JOBS" -L threaded --output-on-failure --no-tests=error
fi

log "Python CPU Adam tests with the baseline (scalar) target forced"
TIDAL_CPU_ADAM_TARGET=baseline .venv/bin/python -m pytest -q tests/python/test_cpu_adam.py

log "Python tests"
TIDAL_CPP_BUILD="$ROOT/build/cpp" .venv/bin/python -m pytest -q tests/python
