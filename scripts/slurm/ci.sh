#!/bin/bash
# CI wrapper around local-cluster.sh: `ci.sh up` installs (apt) and starts a single-node Slurm with
# slurmdbd, so `pytest -m slurm tests/slurm` runs against it; `ci.sh down` stops it by pid.
#   scripts/slurm/ci.sh up && .venv/bin/python -m pytest tests/slurm -x -q; rc=$?; scripts/slurm/ci.sh down; exit $rc
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
case "${1:-}" in
up)
  command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null || "$HERE/local-cluster.sh" install
  "$HERE/local-cluster.sh" start ;;
down)
  "$HERE/local-cluster.sh" stop ;;
*) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
