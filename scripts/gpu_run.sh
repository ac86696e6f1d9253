#!/usr/bin/env bash
# The whole GPU run, for the device tool's lent machine (torch 2.11 + CUDA 13,
# Python 3.12, cmake, ninja, nvcc; no network, no apt). From the repo root:
#   here:  bash scripts/fetch_gpu_debs.sh           # once; fills .deps/debs
#   there: bash scripts/gpu_run.sh                   # with carry: [".deps"]
# Builds tidal with the CUDA backend, runs the C++ tests (the device contract
# runs against the real GPU) and the Python tests, then the benchmarks, and
# copies logs and result files to $OUT (and benchmarks/results/).
#   GPU_RUN_STEPS="build test bench" selects steps (default: all three).
#   TIDAL_GPU_SKIP_PYTEST=1 skips the Python tests (ctest still runs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build/gpu-out}"
STEPS="${GPU_RUN_STEPS:-build test bench}"
PREFIX="${TIDAL_DEPS_PREFIX:-/tmp/tidal-deps}"
PY="${PYTHON:-python3}"
BUILD="$ROOT/build/gpu"
JOBS="$(nproc)"
mkdir -p "$OUT"
log() { printf '\n[gpu_run] %s\n' "$*" | tee -a "$OUT/gpu_run.log" >&2; }
has_step() { [[ " $STEPS " == *" $1 "* ]]; }

# --- dependencies the image lacks: unpacked .deb files ---------------------------
shopt -s nullglob
debs=(.deps/debs/*.deb)
if ((${#debs[@]} == 0)); then
  echo "no .deb files in .deps/debs: run scripts/fetch_gpu_debs.sh here and carry .deps" >&2
  exit 1
fi
mkdir -p "$PREFIX"
for f in "${debs[@]}"; do dpkg -x "$f" "$PREFIX"; done
export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CPATH="$PREFIX/usr/include${CPATH:+:$CPATH}"

{ nvidia-smi || true; nvcc --version || true; "$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda)" || true; } \
  >"$OUT/machine.txt" 2>&1

if has_step build; then
  log "configure + build (CUDA on, Python module in place)"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIDAL_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTIDAL_BUILD_PYTHON=ON -DTIDAL_PYTHON_INPLACE=ON \
    -DPython_EXECUTABLE="$(command -v "$PY")" 2>&1 | tee "$OUT/configure.log"
  export CMAKE_BUILD_PARALLEL_LEVEL="$JOBS"
  if ! cmake --build "$BUILD" -j "$JOBS" 2>&1 | tee "$BUILD/build_full.log" | tail -n 50 | tee "$OUT/build.log"; then
    # The tail may miss the first failure: append the first error lines of the full log.
    { echo "--- first error lines (build_full.log) ---"
      grep -n -m 60 -E 'error|FAILED|undefined reference' "$BUILD/build_full.log" || true; } | tee -a "$OUT/build.log"
    log "build failed"
    exit 1
  fi
fi

status=0
if has_step test; then
  log "C++ tests (device contract against the GPU)"
  ctest --test-dir "$BUILD" -j 4 --output-on-failure 2>&1 | tee "$OUT/ctest.log" || status=1
  if [[ "${TIDAL_GPU_SKIP_PYTEST:-0}" == 1 ]]; then
    log "Python tests skipped (TIDAL_GPU_SKIP_PYTEST=1)"
  else
    log "Python tests"
    PYTHONPATH="$ROOT/python" TIDAL_CPP_BUILD="$BUILD" "$PY" -m pytest -q tests/python 2>&1 \
      | tee "$OUT/pytest.log" || status=1
  fi
fi

if has_step bench; then
  log "benchmarks"
  before=$(date +%s)
  PYTHONPATH="$ROOT/python" TIDAL_CPP_BUILD="$BUILD" "$PY" benchmarks/device_bandwidth.py --device cuda \
    2>&1 | tee -a "$OUT/bench.log" || status=1
  log "engine benchmark (plain PyTorch vs tidal, largest GPT tried)"
  PYTHONPATH="$ROOT/python" timeout "${GPU_ENGINE_TIMEOUT:-420}" "$PY" benchmarks/engine_gpu.py \
    ${GPU_ENGINE_ARGS:-} 2>&1 | tee -a "$OUT/engine.log" || status=1
  # Every result file this run wrote comes back.
  for f in benchmarks/results/*.json; do
    [ "$(stat -c %Y "$f")" -ge "$before" ] && cp "$f" "$OUT/"
  done
fi
log "done, status $status"
exit "$status"
