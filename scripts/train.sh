#!/usr/bin/env bash
# The main job: trains a GPT-style model with tidal (python -m tidal.train).
# On a GPU: the 'gpt-350m' preset in bf16 with the whole GPU as budget; else a
# small GPT on the simulated device with an 8 MiB device budget, below its
# state size, so chunks move and CPU Adam runs. Prints loss, tokens/s and the
# memory report. Extra arguments go to tidal.train (--help lists them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/python -m tidal.train "$@"
