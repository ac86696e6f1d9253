#!/usr/bin/env bash
# Idempotent set-up: Debian packages, the .venv (torch 2.13.0 CPU wheel + test
# tools) and the editable build of tidal. Quick when everything is in place.
# Sourced by scripts/train.sh and scripts/test.sh; also runnable on its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# ccache: the editable build and scripts/test.sh's trees compile through it.
DEB_PACKAGES=(build-essential cmake ninja-build libtbb-dev libmimalloc-dev libhwy-dev liburing-dev
              libgtest-dev libgmock-dev pybind11-dev ccache)
# expecttest: torch's own op database (tests/python/test_dtr_op_db.py) imports it.
# pytest-xdist: scripts/test.sh runs the Python suite on two worker processes.
PY_PACKAGES=(torch==2.13.0 numpy pytest scikit-build-core==1.1.2 tqdm matplotlib transformers==4.57.6 hypothesis
             peft==0.21.2 accelerate==1.15.0 expecttest pytest-xdist==3.8.0)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages ---------------------------------------------------------
missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { log "need root or sudo to install: ${missing[*]}"; exit 1; }
    SUDO=sudo
  fi
  # Lists are fetched once; a failed install retries after a refresh.
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" >/dev/null; then
    $SUDO apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" >/dev/null
  fi
fi

# --- the virtual environment ---------------------------------------------------
if [ ! -x "$PY" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
if ! "$PY" - <<'PYCHECK' 2>/dev/null; then
import importlib.metadata as md
assert md.version("torch").split("+")[0] == "2.13.0", md.version("torch")
for name in ("numpy", "pytest", "scikit-build-core", "tqdm", "matplotlib", "transformers", "hypothesis",
             "peft", "accelerate", "expecttest", "pytest-xdist"):
    md.version(name)
PYCHECK
  log "installing Python packages: ${PY_PACKAGES[*]}"
  "$PY" -m pip install -q --disable-pip-version-check "${PY_PACKAGES[@]}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$PY" -c "import torch, numpy, pytest" # fail loudly if the install did not work
fi

# --- the build -------------------------------------------------------------------
# An editable install: Python sources are used in place, tidal._C is rebuilt
# incrementally in build/wheel-* when a C++ file changed. Skipped entirely when
# nothing changed since the last build.
STAMP="$VENV/.tidal-build-stamp"
newest=$(find CMakeLists.txt pyproject.toml chunk runtime cpu_adam hooks python -newer "$STAMP" \
         -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.txt' -o -name '*.toml' -o -name '*.cu' \) \
         -print -quit 2>/dev/null || true)
# The editable install maps each module of the package to its file when it is
# made, so a Python module added, moved or removed needs it made again too.
MODULES="$VENV/.tidal-build-modules"
modules=$(cd python && find tidal -name '*.py' -not -path '*/__pycache__/*' | LC_ALL=C sort)
if [ ! -f "$STAMP" ] || [ -n "$newest" ] || [ "$modules" != "$(cat "$MODULES" 2>/dev/null)" ] \
   || ! "$PY" -c "import tidal" 2>/dev/null; then
  log "building tidal (pip install -e . --no-build-isolation)"
  # Through ccache where it is: a build in another clone folder of the same
  # tree (CI's) finds the objects (paths are taken relative to the clone).
  CCACHE=()
  if command -v ccache >/dev/null; then
    export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-4G}"
    CCACHE=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation "${CCACHE[@]}" -e . 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  "$PY" -c "import tidal" # fail loudly if the build did not work
  printf '%s\n' "$modules" >"$MODULES"
  touch "$STAMP"
fi
