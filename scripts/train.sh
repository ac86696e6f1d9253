#!/usr/bin/env bash
# The main job. Until the training engine lands (issue: "Training engine"),
# this runs the device-layer demo: chunk-sized buffers past the device's
# capacity, moved both ways, with bandwidth and capacity figures. It uses the
# GPU when there is one and the simulated device otherwise.
# Extra arguments go to the demo (python -m tidal.device_demo --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/python -m tidal.device_demo "$@"
