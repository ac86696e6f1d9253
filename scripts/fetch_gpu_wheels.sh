#!/usr/bin/env bash
# Run HERE (network, a Python with torch: the worktree's .venv), not on the GPU
# machine: puts into .deps/wheels (ignored by git, carried by the device tool's
# `carry: [".deps"]`) what scripts/gpu_run.sh's `deepspeed` phase unpacks
# there (a wheel is a zip; unpacked into a folder on PYTHONPATH, only those the
# image lacks):
#   - deepspeed==0.19.8 as a wheel built here (PyPI has only the sdist; built
#     with DS_BUILD_OPS=0, so it is pure Python and its CPU Adam JIT-builds with
#     ninja on the GPU machine), and
#   - the Python packages it imports that the GPU image (torch 2.11 + CUDA 13,
#     Python 3.12) may lack, as binary wheels for CPython 3.12 on x86_64.
# torch, numpy and tqdm are not carried: the GPU image has them.
# Size: 5.9 MiB (deepspeed ~1.7 MiB, pydantic-core ~2 MiB, the rest small);
# the script prints the total. Reruns skip what is there. Checked here: the
# unpacked set imports under CPython 3.12 (deepspeed up to its `import torch`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.deps/wheels"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DS_VERSION="${DS_VERSION:-0.19.8}"
mkdir -p "$DEST"
if ! compgen -G "$DEST/deepspeed-${DS_VERSION}-*.whl" >/dev/null; then
  # setup.py imports torch: build without isolation in an env that has it.
  DS_BUILD_OPS=0 DS_BUILD_STRING="" "$PY" -m pip wheel --no-deps --no-build-isolation \
    "deepspeed==${DS_VERSION}" -w "$DEST"
fi
# The deepspeed runtime requirements minus torch/numpy/tqdm, with their own
# dependencies (pydantic -> pydantic-core, annotated-types, typing-inspection,
# typing-extensions), as CPython 3.12 manylinux wheels.
"$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DEST" hjson py-cpuinfo pydantic msgpack einops psutil packaging ninja
# pytest for the GPU phases that run tests (gpu_run.sh unpacks it only where the image lacks it).
"$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d "$ROOT/.deps/pytest" pytest
ls -la "$DEST" "$ROOT/.deps/pytest"
du -sh "$DEST" "$ROOT/.deps/pytest"
