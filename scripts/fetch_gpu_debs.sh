#!/usr/bin/env bash
# Run HERE (a machine with Debian's package lists), not on the GPU machine:
# downloads the .deb files the GPU image lacks into .deps/debs (ignored by git,
# carried to the GPU machine by the device tool's `carry`), where
# scripts/gpu_run.sh unpacks them with dpkg -x. About 1.4 MiB (11 files); with
# scripts/fetch_gpu_wheels.sh (~6 MiB) the carried .deps stays far under the
# device tool's 64 MiB carry limit (the script prints the total).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.deps/debs"
PACKAGES=(libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libhwloc15
          libmimalloc-dev libmimalloc2.0 libhwy-dev libhwy1 libgtest-dev libgmock-dev)
mkdir -p "$DEST"
cd "$DEST"
for pkg in "${PACKAGES[@]}"; do
  compgen -G "${pkg}_*.deb" >/dev/null || apt-get download "$pkg"
done
du -sh "$DEST"; du -sh "$ROOT/.deps"  # .deps is what `carry` sends: it must stay under 64 MiB
