#!/usr/bin/env bash
# The issue-14 GPU run, in phases, for the device tool's lent machine (H100 80 GB
# or H200; torch 2.11 + CUDA 13, Python 3.12, cmake, ninja, nvcc; no network,
# no apt, maybe no gdb). Each phase is its own process with its own `timeout`,
# log ($OUT/<phase>.log) and result files; a crash in one loses nothing else
# and the script goes on to the next. After every phase $OUT/summary.json is
# rewritten: phase, rc, seconds, time limit, log, result files.
#
# HERE, once (network):
#   bash scripts/fetch_gpu_debs.sh     # .deps/debs: TBB, hwloc, mimalloc, Highway, GoogleTest (~1.4 MiB)
#   bash scripts/fetch_gpu_wheels.sh   # .deps/wheels: deepspeed 0.19.8 + deps for Python 3.12 (~6 MiB)
#   du -sh .deps                       # must stay under the 64 MiB carry limit (with prebuilt/, below)
# THERE, one phase group per device call (`run`, carry [".deps"]; each call <= 600 s; the
# machine goes back after 30 s idle, so a later call may find a bare machine):
#   call 1: bash scripts/gpu_run.sh reporter build cpp bench1b big  # ~7.5 min: issue 51's steps 1-3
#   call 2: bash scripts/gpu_run.sh build largest deepspeed    # what is left of the 15 device-minutes (steps 4-5)
# (crash, room, dp and dtr when a session has time beyond these: the gpt-350m crash passed on
# both GPU runs so far, the others are issue 51's step 6.)
# The device tool brings back at most 8 files from its $OUT: run as
#   R=$OUT; OUT=/tmp/g bash scripts/gpu_run.sh ...; tar czf $R/g.tgz -C /tmp g
# A session has 15 device-minutes, a machine's start included (~30 s). The build takes 53-73 s
# on the H200's 16 cores (measured 2026-11-26), so a later call on a bare machine rebuilds
# rather than carrying .deps/prebuilt.
# `build` is a no-op when the machine still has build/gpu, and a 10 s install when the
# previous call's $OUT/prebuilt (the stripped _C module and test binaries, with a stamp of
# the source they were built from) was copied to .deps/prebuilt here and carried:
#   cp -r <files_at>/prebuilt .deps/        (then carry [".deps"] as before)
# Phases (the issue's "On the GPU, in this order"):
#   reporter  proves the crash reporter works on this machine (a deliberate segfault)  ~5 s
#   build     CUDA build for sm_90 of only what the GPU phases run: tidal._C and the
#             device/scheduler/chunk C++ test binaries        ~75 s cold on 16 cores
#   cpp       those GoogleTest binaries on the real GPU (gtest JSON per binary)     ~60 s
#   room      tests/python/test_cuda_room.py: the caching allocator model against torch's
#             allocator, and room made on torch's cache misses (JUnit XML)       ~30 s
#   crash     engine_gpu.py crash: tidal-train --preset gpt-350m --steps 3; only when it
#             fails (or CRASH_ALL_CASES=1): pinning off, 256 MiB chunks, pinned HostBuffers
#             of 98.25/196.5 MiB up to 6 GiB, each its own process; under gdb too when gdb
#             exists                                                     ~60 s passing, ~240 s not
#   bench1b   engine_gpu.py bench: gpt-1.3b bf16, micro batch 8, seq 1024: plain PyTorch
#             + fused AdamW vs tidal (whole GPU) vs tidal (a quarter of the model states),
#             once more at the quarter budget with 4 micro-batches per step (issue 51
#             step 2's accumulation; predicted 1.35 s a step: docs/estimate.md), and
#             that again with tidal.fold_images false (every fold writes the weights
#             back: Note [The weights' image instead of the restore]; +~30 s), and the
#             bf16 matmul rate                                                  ~270 s
#   dp        data parallel's NCCL path (issue 17) with world size 1: torchrun
#             --nproc_per_node 1 -m tidal.train, tidal.data_parallel forced on with
#             backend nccl; $OUT/dp.json is the report (world_size, loss, bytes sent) ~60 s
#   largest   engine_gpu.py largest over gpt-6.7b, 8b, 10b, 13b, 14b, 16b, 17b, 18b, 20b (batch 1,
#             host budget 90% of the host, margin 3 GiB): starts at the largest tidal.estimate
#             predicts to fit (gpt-18b, 0.88 of (host + device) / 14 B, on the H200 box), then up
#             while shapes train or down until one does; registration alone is ~12 s per 1B
#             parameters there (gpt-6.7b: 78 s), so one 18B try takes most of it    ~300 s
#   big       engine_gpu.py big: gpt-6.7b, micro batch 4 x 16 accumulation (64k tokens a step),
#             TFLOPS against the goal of 300 (issue 39 step 4)                   ~200 s
#   deepspeed deepspeed_gpu.py: ZeRO-2 + offload_optimizer, ZeRO-3 + offload_param, at
#             gpt-1.3b and up to the largest tidal trained (engine_largest result) ~400 s
#   dtr       benchmarks/dtr.py, dtr_batch.py and recompute.py on the GPU when they take
#             --device (else $OUT/dtr.json says they have no CUDA path)        ~130 s
# Results: benchmarks/results/<name>-<machine>.json (benchmarks/common.py names the
# machine), copied to $OUT with the logs.
#
# Usage: bash scripts/gpu_run.sh [--dry-run] [PHASE...]   (or GPU_RUN_PHASES="..."; default
#   "reporter build cpp bench1b big"). --dry-run prints the time plan and every command, runs nothing.
# Environment: OUT (default build/gpu-out), PYTHON (python3), GPU_RUN_BUDGET_S (570: the
#   seconds this call may use; phase limits are cut to fit, so summary.json is always
#   written), GPU_RUN_QUICK=1 (every measurement with --quick on the simulated device / CPU,
#   no CUDA build: how tests/python/test_gpu_scripts.py runs this script without a GPU),
#   TIDAL_RESULTS_DIR (write result files there instead of benchmarks/results),
#   CRASH_ALL_CASES=1 (the crash phase runs its diagnostic variants even when gpt-350m trains).
# Carry size: .deps/debs ~1.4 MiB (11 .deb files) + .deps/wheels ~6 MiB + .deps/prebuilt
#   (stripped, printed by `build`; leave it out if the total passes ~60 MiB).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build/gpu-out}"
PY="${PYTHON:-python3}"
QUICK="${GPU_RUN_QUICK:-0}"
BUDGET="${GPU_RUN_BUDGET_S:-570}"
BUILD="$ROOT/build/gpu"
PREFIX="${TIDAL_DEPS_PREFIX:-/tmp/tidal-deps}"
DS_SITE=/tmp/tidal-ds-site
RESULTS_DIR="${TIDAL_RESULTS_DIR:-benchmarks/results}"  # where the scripts write (engine_gpu.result_path)
SEGV_SO="$BUILD/segv_backtrace.so"
ALL_PHASES="reporter build cpp room crash bench1b dp largest big deepspeed dtr"
CPP_TESTS="tidal_runtime_tests tidal_scheduler_tests tidal_chunk_tests"
Q=(); ((QUICK)) && Q=(--quick)

# Seconds each phase is planned for and its own time limit (the limit is cut to what is
# left of GPU_RUN_BUDGET_S when the phase starts).
# Measured on the H200 (2026-11-26): build 53-73 s, cpp 2 s, crash 19 s passing, bench1b 72 s, dp 14 s.
declare -A EST=([reporter]=5 [build]=75 [cpp]=10 [room]=30 [crash]=30 [bench1b]=150 [dp]=20 [largest]=300 [big]=200 [deepspeed]=400 [dtr]=130)
declare -A LIMIT=([reporter]=30 [build]=420 [cpp]=120 [room]=120 [crash]=300 [bench1b]=270 [dp]=120 [largest]=330 [big]=300 [deepspeed]=420 [dtr]=150)

DRY=0
INNER=""
PHASES=()
while (($#)); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --phase-inner) INNER="$2"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) PHASES+=("$1") ;;
  esac
  shift
done
((${#PHASES[@]})) || read -ra PHASES <<<"${GPU_RUN_PHASES:-reporter build cpp bench1b big}"
for p in "${PHASES[@]}" ${INNER:+"$INNER"}; do
  [[ " $ALL_PHASES " == *" $p "* ]] || { echo "gpu_run.sh: unknown phase '$p' (phases: $ALL_PHASES)" >&2; exit 2; }
done

# `x CMD...`: run a command, or print it under --dry-run.
x() {
  if ((DRY)); then printf '    $'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
say() { printf '[gpu_run] %s\n' "$*"; }

# --- the environment every phase runs in ---------------------------------------------
setup_env() {
  export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
  export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CPATH="$PREFIX/usr/include${CPATH:+:$CPATH}"
  # On the GPU machine tidal must run on the GPU: TIDAL_DEVICE=cuda makes a CUDA problem
  # a clear error instead of a silent fallback to the simulated device.
  if ((QUICK)); then export TIDAL_DEVICE=sim; else export TIDAL_DEVICE="${TIDAL_DEVICE:-cuda}"; fi
  return 0
}

# The unpacked .deb files (TBB, mimalloc, Highway, GoogleTest) the image lacks.
unpack_debs() {
  shopt -s nullglob
  local debs=(.deps/debs/*.deb)
  if ((${#debs[@]} == 0)); then
    ((QUICK)) || say "no .deb files in .deps/debs: run scripts/fetch_gpu_debs.sh here and carry .deps"
    return 0
  fi
  mkdir -p "$PREFIX"
  local f
  for f in "${debs[@]}"; do x dpkg -x "$f" "$PREFIX"; done
}

# The crash reporter (scripts/segv_backtrace.c), preloaded into every phase but build.
build_reporter() {
  mkdir -p "$BUILD"
  x "${CC:-cc}" -O1 -g -shared -fPIC -o "$SEGV_SO" scripts/segv_backtrace.c -ldl
}

# What the native sources look like: prebuilt binaries are used only when this matches.
# A hash of the files themselves (the device machine's copy of the tree may have no .git).
source_stamp() {
  find . \( -path ./build -o -path ./.venv -o -path ./.deps -o -path ./.git \) -prune -o -type f \
    \( -name '*.cpp' -o -name '*.cc' -o -name '*.h' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \
       -o -name 'CMakeLists.txt' -o -name '*.cmake' \) -print | LC_ALL=C sort | xargs sha256sum \
    | sha256sum | cut -c1-16
}

# pytest, when the image lacks it: the carried wheels (.deps/pytest, fetched by
# scripts/fetch_gpu_wheels.sh) unpacked onto PYTHONPATH, as the deepspeed phase does.
ensure_pytest() {
  ((DRY)) && return 0
  "$PY" -c "import pytest" 2>/dev/null && return 0
  shopt -s nullglob
  local w site=/tmp/tidal-pytest-site
  mkdir -p "$site"
  for w in .deps/pytest/*.whl; do "$PY" -m zipfile -e "$w" "$site"; done
  export PYTHONPATH="$PYTHONPATH:$site"
  "$PY" -c "import pytest" || { say "no pytest on this machine and none carried (.deps/pytest)"; return 1; }
}

# --- phases (each runs as `gpu_run.sh --phase-inner NAME`, its own process) -------------
phase_reporter() {
  # A deliberate segfault in Python under the reporter: the log must show the fault
  # address's mapping, the native backtrace and the Python stack.
  local log="$OUT/reporter-child.log"
  if ((DRY)); then x "$PY" -c "import ctypes; ctypes.string_at(16)"; return 0; fi
  "$PY" -c "import ctypes; ctypes.string_at(16)" >"$log" 2>&1
  local rc=$?
  local ok=true
  for want in "[segv_bt] signal 11" "[segv_bt] fault address" "[segv_bt] native backtrace" "line 1 in <module>"; do
    grep -qF "$want" "$log" || { ok=false; say "reporter: '$want' missing from $log"; }
  done
  printf '{"child_rc": %d, "reporter_works": %s, "log": "%s"}\n' "$rc" "$ok" "$log" >"$OUT/reporter.json"
  [[ $ok == true ]]
}

phase_build() {
  if ((QUICK)); then
    x "$PY" -c "import tidal; print('tidal', tidal.device_info()['backend'], 'cuda compiled:', tidal.device_info()['cuda_compiled'])"
    return $?
  fi
  local stamp
  stamp="$(source_stamp)"
  if [[ -f .deps/prebuilt/stamp && "$(cat .deps/prebuilt/stamp)" == "$stamp" ]] && compgen -G ".deps/prebuilt/_C*.so" >/dev/null; then
    say "prebuilt binaries match the source ($stamp): installing them, no build"
    x cp .deps/prebuilt/_C*.so python/tidal/
    x mkdir -p "$BUILD/prebuilt-tests"
    local t
    for t in $CPP_TESTS; do [[ -f .deps/prebuilt/$t ]] && x cp ".deps/prebuilt/$t" "$BUILD/prebuilt-tests/"; done
    x "$PY" -c "import tidal; print(tidal.device_info())"
    return $?
  fi
  x cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIDAL_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTIDAL_BUILD_PYTHON=ON -DTIDAL_PYTHON_INPLACE=ON \
    -DTIDAL_BUILD_TESTS=ON -DTIDAL_BUILD_BENCHMARKS=OFF -DPython_EXECUTABLE="$(command -v "$PY")" || return $?
  # -k 0: every compile error in one call, not only the first (device time is short).
  x cmake --build "$BUILD" -j "$(nproc)" --target _C $CPP_TESTS -- -k 0 || return $?
  ((DRY)) && return 0
  # For the next call on a bare machine: stripped copies and the stamp, back through $OUT.
  mkdir -p "$OUT/prebuilt"
  local so t
  strip_copy() { objcopy --strip-debug "$1" "$2" 2>/dev/null || cp "$1" "$2"; }
  for so in python/tidal/_C*.so; do strip_copy "$so" "$OUT/prebuilt/$(basename "$so")"; done
  for t in $CPP_TESTS; do
    f="$(find "$BUILD" -name "$t" -type f -perm -u+x | head -n1)"
    [[ -n $f ]] && strip_copy "$f" "$OUT/prebuilt/$t"
  done
  echo "$stamp" >"$OUT/prebuilt/stamp"
  say "prebuilt for the next call: $(du -sh "$OUT/prebuilt" | cut -f1) in \$OUT/prebuilt (cp -r it to .deps/)"
  "$PY" -c "import tidal; print(tidal.device_info())" || return $?
  # The module shares the process's C++ runtime (the gpt-350m segfault's cause:
  # Note [One libstdc++ in the process], cmake/OneLibstdcxx.cmake).
  ensure_pytest || return $?
  "$PY" -m pytest -q -p no:cacheprovider tests/python/test_native_module.py -k "module_uses or warning"
}

phase_cpp() {
  if ((QUICK)); then say "cpp: skipped under GPU_RUN_QUICK=1 (no CUDA build; the CPU suites run in CI)"; return 0; fi
  local t f rc=0
  for t in $CPP_TESTS; do
    f="$(find "$BUILD" -name "$t" -type f -perm -u+x 2>/dev/null | head -n1)"
    if [[ -z $f ]]; then ((DRY)) && f="$BUILD/.../$t" || { say "cpp: $t not built"; rc=1; continue; }; fi
    x timeout -k 10 100 "$f" --gtest_output="json:$OUT/cpp-$t.json" || rc=1
  done
  return $rc
}

phase_room() {
  # One budget for every device byte (tests/python/test_cuda_room.py): the caching
  # allocator model against torch's own allocator, and torch's cache-miss callback making
  # room (Note [Room on a cache miss] in hooks/cuda_room.h). JUnit XML in $OUT/room.xml.
  ensure_pytest || return $?
  x "$PY" -m pytest -q -p no:cacheprovider tests/python/test_cuda_room.py --junitxml="$OUT/room.xml" -rs
}

phase_crash() {
  x "$PY" benchmarks/engine_gpu.py crash "${Q[@]}" ${CRASH_ALL_CASES:+--all-cases} --timeout 60 --log-dir "$OUT/crash"
}

phase_bench1b() {
  x "$PY" benchmarks/engine_gpu.py bench "${Q[@]}" --timeout 120 --log-dir "$OUT/bench1b"
}

phase_dp() {
  # World size 1 on the GPU's NCCL (gloo on the simulated device under QUICK): tidal's
  # own process group, the reductions during backward and the broadcasts in the step.
  local base=configs/gpt_gpu.json backend=nccl
  ((QUICK)) && { base=configs/gpt_quick.json; backend=gloo; }
  x "$PY" -c 'import json, sys
cfg = json.load(open(sys.argv[1]))
cfg.setdefault("tidal", {})["data_parallel"] = {"enabled": True, "backend": sys.argv[3], "timeout": 120}
json.dump(cfg, open(sys.argv[2], "w"), indent=1)' "$base" "$OUT/dp_config.json" "$backend"
  local model=(--preset tiny --steps 5)
  ((QUICK)) && model=(--quick --steps 3)
  x timeout -k 10 $((PHASE_LIMIT - 10)) "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m tidal.train "${model[@]}" --config "$OUT/dp_config.json" --no-progress --json "$OUT/dp.json"
}

phase_largest() {
  x "$PY" benchmarks/engine_gpu.py largest "${Q[@]}" ${LARGEST_SHAPES:+--shapes "$LARGEST_SHAPES"} --timeout 400 --time-limit $((PHASE_LIMIT - 60)) \
    --log-dir "$OUT/largest"
}

phase_big() {
  # Issue 39's step 4: gpt-6.7b (states past the device) at micro batch 4 x 16 accumulation,
  # TFLOPS by 6 N per token against the matmul rate of the same run.
  x "$PY" benchmarks/engine_gpu.py big "${Q[@]}" --timeout $((PHASE_LIMIT - 20)) --log-dir "$OUT/big"
}

phase_deepspeed() {
  # Install what the image lacks from the carried wheels (the ones already installed are
  # left alone), then run the peer. Its CPU Adam JIT-builds with ninja + nvcc here.
  shopt -s nullglob
  local w dist missing=()
  for w in .deps/wheels/*.whl; do
    dist="$(basename "$w" | cut -d- -f1)"
    # (under --dry-run: all of them; the check imports nothing heavy but costs a start each)
    ((DRY)) || ! "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null \
      && missing+=("$w")
  done
  # A wheel is a zip: unpacked into a folder on PYTHONPATH it imports (its .dist-info too),
  # with no pip needed and no resolver that might reach for the network.
  x mkdir -p "$DS_SITE"
  for w in "${missing[@]}"; do x "$PY" -m zipfile -e "$w" "$DS_SITE"; done
  export PYTHONPATH="$PYTHONPATH:$DS_SITE" TORCH_EXTENSIONS_DIR=/tmp/tidal-ds-ext DS_BUILD_OPS=0
  if [[ -z ${CUDA_HOME:-} ]] && command -v nvcc >/dev/null; then
    CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    export CUDA_HOME
  fi
  # gpt-1.3b, then up to the largest tidal trained here (when the largest phase ran).
  local shapes="${DS_SHAPES:-}"
  ((DRY)) && [[ -z $shapes ]] && shapes="gpt-1.3b,gpt-6.7b,<the largest in engine_largest-*.json, else gpt-13b>"
  if [[ -z $shapes ]] && ((!QUICK)); then
    shapes="$("$PY" - <<'EOF' 2>/dev/null
import glob, json
from tidal.train import PRESETS
order = ["gpt-1.3b", "gpt-2.7b", "gpt-4b", "gpt-6.7b", "gpt-13b", "gpt-20b", "gpt-30b"]
best = None
for f in glob.glob("benchmarks/results/engine_largest-*.json"):
    best = (json.load(open(f)).get("largest") or {}).get("shape") or best
shapes = ["gpt-1.3b", "gpt-6.7b"] + ([best] if best and best not in ("gpt-1.3b", "gpt-6.7b") else ["gpt-13b"])
print(",".join(shapes))
EOF
)"
  fi
  x "$PY" benchmarks/deepspeed_gpu.py "${Q[@]}" ${shapes:+--shapes "$shapes"} --timeout 400 \
    --time-limit $((PHASE_LIMIT - 60)) --log-dir "$OUT/deepspeed"
}

phase_dtr() {
  # dtr.py / dtr_batch.py / recompute.py measure on the CPU unless they take --device:
  # run them on the GPU when they do, else say so in $OUT/dtr.json.
  local s rc=0 status=()
  for s in dtr dtr_batch recompute; do
    if ((QUICK)); then
      status+=("\"$s\": \"quick: not run (each has its own --quick test)\"")
    elif ((DRY)); then
      say "dtr: if benchmarks/$s.py takes --device (else the result says it has no CUDA path):"
      x timeout -k 10 $((PHASE_LIMIT / 3)) "$PY" "benchmarks/$s.py" --device cuda
    elif "$PY" "benchmarks/$s.py" --help 2>/dev/null | grep -q -- '--device'; then
      x timeout -k 10 $((PHASE_LIMIT / 3)) "$PY" "benchmarks/$s.py" --device cuda || rc=1
      status+=("\"$s\": \"ran with --device cuda\"")
    else
      say "dtr: benchmarks/$s.py has no --device flag: it measures on the CPU only; not run here"
      status+=("\"$s\": \"not run: benchmarks/$s.py has no --device flag (no CUDA path)\"")
      rc=1
    fi
  done
  ((DRY)) || (IFS=,; printf '{%s}\n' "${status[*]}" >"$OUT/dtr.json")
  return $rc
}

# --- inner: one phase in this process ---------------------------------------------------
if [[ -n $INNER ]]; then
  setup_env
  [[ $INNER != build && -f $SEGV_SO ]] && export LD_PRELOAD="$SEGV_SO${LD_PRELOAD:+:$LD_PRELOAD}"
  PHASE_LIMIT="${PHASE_LIMIT:-${LIMIT[$INNER]}}"
  # Test hook (tests/python/test_gpu_scripts.py): this phase's process dies of a
  # segfault instead of running, to prove the run goes on and the summary says so.
  if [[ ${GPU_RUN_SELFTEST_SEGV:-} == "$INNER" ]]; then "$PY" -c "import ctypes; ctypes.string_at(16)"; exit $?; fi
  "phase_$INNER"
  exit $?
fi

# --- the plan ------------------------------------------------------------------------
mkdir -p "$OUT"
plan_total=0
{
  say "phases: ${PHASES[*]}; budget ${BUDGET} s for this call$( ((QUICK)) && echo '; QUICK (simulated device / CPU)')$( ((DRY)) && echo '; DRY RUN')"
  for p in "${PHASES[@]}"; do
    e=${EST[$p]}
    [[ $p == build ]] && { [[ -d $BUILD/CMakeFiles || -d .deps/prebuilt ]] || ((QUICK)); } && e=20
    plan_total=$((plan_total + e))
    printf '[gpu_run]   %-10s ~%4d s (limit %d s)\n' "$p" "$e" "${LIMIT[$p]}"
  done
  printf '[gpu_run]   total      ~%4d s of %d s\n' "$plan_total" "$BUDGET"
  say "the whole run (15 device-minutes a session, 10 a call): call 1 = reporter build cpp bench1b big"
  say "  (~7.5 min: issue 51's steps 1-3), call 2 = build largest deepspeed (what is left: steps 4-5; a bare"
  say "  machine rebuilds in ~1 min); crash, room, dp, dtr beyond that"
  ((plan_total <= BUDGET)) || say "WARNING: the plan (${plan_total} s) passes this call's budget: later phases get what is left, or split the call"
} | tee "$OUT/plan.txt"

if ((DRY)); then
  setup_env
  unpack_debs
  build_reporter
  for p in "${PHASES[@]}"; do
    say "phase $p: timeout -k 20 ${LIMIT[$p]} bash scripts/gpu_run.sh --phase-inner $p > \$OUT/$p.log"
    PHASE_LIMIT=${LIMIT[$p]} "phase_$p"
  done
  exit 0
fi

# --- the run -------------------------------------------------------------------------
ulimit -c 0  # a crashed process holding tens of GB pinned must not write a core file
START=$SECONDS
setup_env
unpack_debs >"$OUT/deps.log" 2>&1
{ nvidia-smi; nvcc --version; command -v gdb; "$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  free -g; nproc; cat /sys/kernel/mm/transparent_hugepage/enabled; ulimit -l; } >"$OUT/machine.txt" 2>&1
build_reporter >"$OUT/reporter-build.log" 2>&1 || say "the crash reporter did not build (see reporter-build.log): phases run without it"
ROWS=()
write_summary() {
  local IFS=,
  printf '{"phases": [%s], "budget_s": %d, "elapsed_s": %d, "quick": %s, "out": "%s"}\n' \
    "${ROWS[*]}" "$BUDGET" $((SECONDS - START)) "$( ((QUICK)) && echo true || echo false)" "$OUT" >"$OUT/summary.json.tmp"
  mv "$OUT/summary.json.tmp" "$OUT/summary.json"
}
status=0
for p in "${PHASES[@]}"; do
  left=$((BUDGET - (SECONDS - START) - 10))
  limit=${LIMIT[$p]}
  ((limit > left)) && limit=$left
  log="$OUT/$p.log"
  if ((limit < 15)); then
    say "phase $p: skipped, ${left} s left of the budget"
    ROWS+=("{\"phase\": \"$p\", \"rc\": null, \"seconds\": 0, \"limit_s\": 0, \"status\": \"skipped: out of time\", \"log\": null, \"results\": []}")
    write_summary
    status=1
    continue
  fi
  marker="$OUT/.start-$p"
  touch "$marker"
  say "phase $p (limit ${limit} s) -> $log"
  t0=$SECONDS
  PHASE_LIMIT=$limit timeout -k 20 "$limit" bash "$ROOT/scripts/gpu_run.sh" --phase-inner "$p" >"$log" 2>&1
  rc=$?
  secs=$((SECONDS - t0))
  case $rc in
    0) st=ok ;;
    124|137) st="timed out after ${limit} s" ;;
    *) ((rc > 128)) && st="killed by signal $((rc - 128))" || st="failed (exit $rc)" ;;
  esac
  if ((rc >= 124)) || grep -q '\[segv_bt\] signal' "$log"; then
    { echo "--- dmesg tail (kernel oops, Xid?)"; dmesg 2>&1 | tail -n 30; } >>"$log"
  fi
  # The result files this phase wrote come back with the logs.
  results=()
  for f in "$RESULTS_DIR"/*.json "$OUT/$p.json" "$OUT"/cpp-*.json; do
    [[ -f $f && $f -nt $marker ]] || continue
    [[ $f == "$RESULTS_DIR"/* ]] && cp "$f" "$OUT/"
    results+=("\"$f\"")
  done
  rm -f "$marker"
  ((rc == 0)) || status=1
  say "phase $p: $st in ${secs} s; results: ${results[*]:-none}"
  ROWS+=("{\"phase\": \"$p\", \"rc\": $rc, \"seconds\": $secs, \"limit_s\": $limit, \"status\": \"$st\", \"log\": \"$log\", \"results\": [$(IFS=,; echo "${results[*]}")]}")
  write_summary
done
say "done in $((SECONDS - START)) s, status $status: $OUT/summary.json"
grep -h "" "$OUT/summary.json"
exit $status
